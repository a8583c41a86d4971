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
    /// The context the event was created in.
    pub(super) ctx: u64,
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

impl SimDriver {
    /// `event_record` of the [`Driver`] impl.
    pub(super) fn do_event_record(&self, event: Event, stream: Stream) -> Result<()> {
        self.cost(|l| l.event);
        let mut st = self.enter("cuEventRecord", Some(stream), Some(event), None)?;
        Self::check_event(&mut st, event, "cuEventRecord")?;
        Self::check_stream(&mut st, stream, "cuEventRecord")?;
        if let Some(id) = Self::capture_of(&st, stream.0) {
            self.enqueue(
                &mut st,
                stream,
                OpKind::Record { event: 0, seq: 0 },
                0,
                "cuEventRecord",
            )?;
            let tip = st.captures[&id].tips.get(&stream.0).copied().unwrap_or(0);
            st.events.get_mut(&event.0).unwrap().captured = Some((id, stream.0, tip));
            return Ok(());
        }
        let ev = st.events.get_mut(&event.0).unwrap();
        ev.recorded += 1;
        let seq = ev.recorded;
        ev.pending.insert(seq);
        self.enqueue(
            &mut st,
            stream,
            OpKind::Record {
                event: event.0,
                seq,
            },
            0,
            "cuEventRecord",
        )?;
        let vc = st.streams[&stream.0].vc.clone();
        let ev = st.events.get_mut(&event.0).unwrap();
        ev.vc = vc;
        ev.captured = None;
        Ok(())
    }

    /// `stream_wait_event` of the [`Driver`] impl.
    pub(super) fn do_stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.cost(|l| l.event);
        let mut st = self.enter("cuStreamWaitEvent", Some(stream), Some(event), None)?;
        Self::check_stream(&mut st, stream, "cuStreamWaitEvent")?;
        Self::check_event(&mut st, event, "cuStreamWaitEvent")?;
        if self.capture_wait(&mut st, stream, event)? {
            return Ok(());
        }
        let seq = st.events[&event.0].recorded;
        if seq == 0 {
            return Ok(());
        }
        let vc = st.events[&event.0].vc.clone();
        Self::stream_joins(&mut st, stream.0, &vc);
        self.enqueue(
            &mut st,
            stream,
            OpKind::Wait {
                event: event.0,
                seq,
            },
            0,
            "cuStreamWaitEvent",
        )
    }

    /// `event_query` of the [`Driver`] impl.
    pub(super) fn do_event_query(&self, event: Event) -> Result<bool> {
        self.cost(|l| l.query);
        let mut st = self.enter("cuEventQuery", None, Some(event), None)?;
        Self::check_event(&mut st, event, "cuEventQuery")?;
        self.unsafe_call(&mut st, "cuEventQuery")?;
        self.progress(&mut st);
        let e = &st.events[&event.0];
        let done = e.is_done(e.recorded);
        if done {
            let vc = e.vc.clone();
            Self::host_observes(&mut st, &vc);
        }
        Ok(done)
    }

    /// `event_synchronize` of the [`Driver`] impl.
    pub(super) fn do_event_synchronize(&self, event: Event) -> Result<()> {
        let mut st = self.enter("cuEventSynchronize", None, Some(event), None)?;
        Self::check_event(&mut st, event, "cuEventSynchronize")?;
        self.unsafe_call(&mut st, "cuEventSynchronize")?;
        let target = st.events[&event.0].recorded;
        let vc = st.events[&event.0].vc.clone();
        let ctx = st.events[&event.0].ctx;
        self.wait_until(
            st,
            ctx,
            "cuEventSynchronize",
            |st| st.events.get(&event.0).is_none_or(|e| e.is_done(target)),
            |st| Self::host_observes(st, &vc),
        )
    }

    /// `event_destroy` of the [`Driver`] impl.
    pub(super) fn do_event_destroy(&self, event: Event) -> Result<()> {
        let mut st = self.enter("cuEventDestroy_v2", None, Some(event), None)?;
        Self::check_event(&mut st, event, "cuEventDestroy_v2")?;
        let ev = st.events.remove(&event.0).unwrap();
        if !ev.pending.is_empty() {
            // As in CUDA, waits already enqueued still wait for the event's records.
            st.retired_events.insert(event.0, ev);
        }
        st.counters.live_events -= 1;
        Ok(())
    }
}
