//! Events: each `cuEventRecord` is a new record; `cuStreamWaitEvent` waits for the record that
//! was latest when the wait was enqueued (later records do not affect it), and querying or
//! synchronizing an event looks at its latest record, as in CUDA. A record carries the recording
//! stream's vector clock; a wait joins it into the waiting stream's clock, a completed query or
//! synchronization into the host's.

use super::*;

/// An event: each record has a sequence number; a wait targets the record that was latest when
/// the wait was enqueued, and is not affected by later records (as in CUDA), so completions are
/// tracked per record, not as a maximum.
#[derive(Default)]
pub(super) struct SimEvent {
    pub(super) recorded: u64,
    pub(super) pending: std::collections::BTreeSet<u64>,
    pub(super) done_at: u64,
    /// The recording stream's clock at the latest record made outside a capture.
    pub(super) vc: Arc<Vc>,
    /// Where the latest record was made if it was made in a capture: (capture id, stream, the
    /// stream's node count in the capture at the record).
    pub(super) captured: Option<(u64, u64, u64)>,
}

impl SimEvent {
    pub(super) fn is_done(&self, seq: u64) -> bool {
        !self.pending.contains(&seq)
    }
}

impl SimDriver {
    pub(super) fn check_event(st: &mut State, e: Event, call: &'static str) -> Result<()> {
        if st.events.contains_key(&e.0) {
            Ok(())
        } else {
            Self::note_misuse(
                st,
                format!("{call} on unknown or destroyed event {:#x}", e.0),
            );
            Self::fail(st, ErrorCode::ERROR_INVALID_HANDLE, call)
        }
    }
}
