//! Loans: an owner's stream lent to another crate ([`StreamRef::lend`]), as a shared handle of
//! that crate's type. The borrower works on the raw stream (simulated GPU work of its own),
//! keeps its handle past the owner's drop (and the model keeps some past the
//! `Context` handle, to the teardown), and ends the loan by dropping its handle.
//!
//! Checked after every step: a stream lent out is held by no owner but its lender (never handed
//! to another owner while lent, concurrent steps' workers included), and `PoolStats::lent`
//! lies between the live loans whose stream no owner holds and every stream lent and not yet
//! seen back. At teardown the loans outlive the `Context`: the borrower's work still runs on
//! the streams (the loans keep them and their context), and once the loans end a later crate
//! operation releases everything (the teardown's leak checks then apply as always).
//!
//! Only without a cap: with one, an acquisition waiting for a lent stream looks for the loan's
//! end every few milliseconds (real time), which the model's thread cannot wait for.

use super::*;
use cuda_stream_pool::driver::Stream;

/// At most this many loans at once.
const MAX_LOANS: usize = 8;

/// The borrower's handle of a lent stream (another crate's stream type).
#[derive(Debug)]
pub(super) struct Borrowed(pub(super) Stream);

/// A loan the model's borrower holds.
pub(super) struct Loan {
    pub(super) h: Arc<Borrowed>,
    /// The lender's model id.
    pub(super) lender: u64,
}

impl Model {
    /// See [`Op::Lend`].
    pub(super) fn lend(&mut self, owner: usize) -> bool {
        if self.cap.is_some() || self.loans.len() >= MAX_LOANS {
            return false;
        }
        let Some(i) = self.pick_owner(owner) else {
            return false;
        };
        let (id, o) = (self.owners[i].0, self.owners[i].1.clone());
        let before = o.streams().len();
        let Ok(s) = o.stream() else { return false };
        let acquired = o.streams().len() > before;
        if acquired {
            self.check_fresh(&s);
        }
        let raw = s.model_handle();
        match s.lend(|r| Ok(Arc::new(Borrowed(r)))) {
            Ok(h) => {
                assert_eq!(h.0, raw, "a loan's handle names another stream");
                // Every call on the same stream returns the same handle.
                if let Some(l) = self.loans.iter().find(|l| l.h.0 == raw) {
                    assert!(
                        Arc::ptr_eq(&l.h, &h),
                        "a stream lent twice gave two handles"
                    );
                }
                self.lent_ever.insert(raw.0, id);
                self.loans.push(Loan { h, lender: id });
            }
            Err(e) => assert!(
                e.code().is_some(),
                "lending an owner's stream failed without a driver error: {e:?}"
            ),
        }
        acquired
    }

    /// See [`Op::LoanWork`]: the borrower enqueues `ns` of work on its stream.
    pub(super) fn loan_work(&mut self, k: usize, ns: u64) {
        let Some(k) = pick(&self.loans, k) else {
            return;
        };
        let s = self.loans[k].h.0;
        // (Not into a capture of the crate's: the borrower's node would enter the model's
        // graph.)
        if self.guards.iter().any(|c| c.raw == s.0) || self.leaked.contains(&s.0) {
            return;
        }
        borrower_work(&self.sim, s, ns);
    }

    /// See [`Op::EndLoan`].
    pub(super) fn end_loan(&mut self, k: usize) {
        if let Some(k) = pick(&self.loans, k) {
            drop(self.loans.swap_remove(k));
        }
    }

    /// The loans' invariants (see the module's docs).
    pub(super) fn check_loans(&self, st: &cuda_stream_pool::PoolStats, pairs: &[(u64, u64)]) {
        if self.loans.is_empty() && self.lent_ever.is_empty() {
            // (What the general case below checks then, without building its sets: this runs
            // after every step, and most inputs lend nothing.)
            assert!(
                st.lent == 0,
                "lent streams: {} counted, 0 live loans of streams no owner holds, at most 0 \
                 lent and not seen back: {st:?}",
                st.lent
            );
            return;
        }
        let held: HashSet<u64> = pairs.iter().map(|p| p.1).collect();
        for l in &self.loans {
            let raw = l.h.0 .0;
            for (id, _) in pairs.iter().filter(|p| p.1 == raw) {
                assert_eq!(
                    *id, l.lender,
                    "a lent stream was handed to another owner while lent"
                );
            }
        }
        let parked_live: HashSet<u64> = self
            .loans
            .iter()
            .map(|l| l.h.0 .0)
            .filter(|r| !held.contains(r))
            .collect();
        let parked_max = self.lent_ever.keys().filter(|r| !held.contains(r)).count();
        assert!(
            st.lent as usize >= parked_live.len() && st.lent as usize <= parked_max,
            "lent streams: {} counted, {} live loans of streams no owner holds, at most {} \
             lent and not seen back: {st:?}",
            st.lent,
            parked_live.len(),
            parked_max
        );
    }

    /// A stream held by a worker of a concurrent step (`raw`) was not lent out.
    pub(super) fn check_not_lent(&self, raw: u64) {
        assert!(
            !self.loans.iter().any(|l| l.h.0 .0 == raw),
            "a lent stream was handed to a concurrent step's owner while lent"
        );
    }

    /// A stream lent before and now held by another owner than its lender is back: forgotten.
    /// (`held`: the pairs held now, `held_pairs`.)
    pub(super) fn loans_seen_back(&mut self, held: &[(u64, u64)]) {
        self.lent_ever
            .retain(|raw, lender| !held.iter().any(|(id, r)| r == raw && id != lender));
    }

    /// The teardown's part: the loans outlive the `Context` (the model has just dropped it and
    /// everything else): the borrower still works on each stream, then ends its loans, and a
    /// later operation of the crate (a new context, dropped) completes the state's teardown.
    pub(super) fn end_loans_after_the_context(&mut self) {
        if self.loans.is_empty() {
            return;
        }
        for l in std::mem::take(&mut self.loans) {
            borrower_work(&self.sim, l.h.0, 1_000);
            // The loan keeps its stream (and its context) after the `Context` is gone.
            assert!(
                self.sim.stream_exists(l.h.0),
                "a lent stream was destroyed after the Context was dropped"
            );
            drop(l);
        }
        self.sim.advance(futs::LONG);
        let later = Context::primary(self.drv.clone(), 0).expect("a later context");
        drop(later);
    }
}

/// The borrower's work on its stream: `ns` of simulated GPU work (a kernel of its own). (No
/// query: a borrower's `cuStreamQuery` outside relaxed mode would invalidate the model's live
/// captures, leaked ones included, and count among `SimDriver::unrelaxed_calls`.)
fn borrower_work(sim: &SimDriver, s: Stream, ns: u64) {
    assert!(
        sim.stream_exists(s),
        "a lent stream was destroyed while lent"
    );
    let _ = sim.enqueue_work(s, ns);
}
