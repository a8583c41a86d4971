//! Review 14: `StreamRef::slot_arc` raises the slot's count from the reference's pointer.
//!
//! Run under Miri (`cargo +nightly miri test --test review14_slot_arc`): the pointer must carry
//! the provenance of the whole `Arc` allocation (as `Arc::as_ptr` gives it), not only of the
//! `Slot` inside it, or raising the strong count (which lives before the `Slot`) is undefined
//! behaviour under Stacked Borrows.

use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::{Context, DeviceBuffer};
use std::sync::Arc;

// Pins review 14 defect 1: `slot_arc` used a pointer narrowed to the `Slot` to reach the count.
#[test]
fn a_buffer_allocated_on_an_owners_stream_counts_the_slot_through_the_arcs_own_pointer() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim, 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    // `DeviceBuffer::alloc` records its last use with `slot_arc()`.
    let buf = DeviceBuffer::<u32>::alloc(&s, 4).unwrap();
    drop(s);
    drop(owner);
    // The buffer's last use keeps the slot: freeing it orders after that stream.
    drop(buf);
    ctx.trim().unwrap();
    assert_eq!(ctx.stats().in_use, 0);
}
