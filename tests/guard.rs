//! The guard in front of the device: every way the allocator takes memory from the device (a
//! new segment, pages grown into an expandable segment, for the request's own stream or for
//! another's, and a wake) is bounded by the memory fraction and by `throw_on_cudamalloc_oom`'s
//! limit, on the simulated GPU.

use ferrocache::allocator::sleep::Tags;
use ferrocache::allocator::{AllocError, DeviceAllocator};
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const WEIGHTS: u32 = 1;

fn checked(a: &DeviceAllocator<SimDevice>) {
    if let Err(why) = a.check_invariants() {
        panic!("invariant broken: {why}");
    }
}

/// `throw_on_cudamalloc_oom` with the configured fraction `0.5`, then
/// `set_per_process_memory_fraction(1.0)`: the memory-fraction limit is lifted, and PyTorch's
/// rejection limit stays half the device (see `tests/allocator.rs`,
/// `throw_on_cudamalloc_oom_rejects_only_past_the_configured_fraction`).
fn rejecting_past_half(capacity: usize, extra: &str) -> DeviceAllocator<SimDevice> {
    let conf = format!("throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.5{extra}");
    let mut a = DeviceAllocator::new(SimDevice::new(capacity), 0, Config::parse(&conf).unwrap());
    a.set_memory_fraction(1.0).unwrap();
    assert_eq!(a.allowed_memory_maximum(), None);
    a
}

fn preemptively_rejected(err: &AllocError) -> bool {
    matches!(err, AllocError::OutOfMemory(oom) if oom.preemptively_rejected)
}

/// With cross-stream reuse and expandable segments, a request of stream A may grow a free
/// block at the end of stream B's segment into B's unmapped pages. Those pages are a device
/// allocation like any other: past `throw_on_cudamalloc_oom`'s limit they are refused before
/// the device is asked, and the malloc fails with PyTorch's preemptive rejection, counted once.
#[test]
fn growing_another_streams_expandable_segment_is_refused_past_the_rejection_limit() {
    const A: u64 = 0;
    const B: u64 = 0x1000;
    let mut a = rejecting_past_half(200 * MIB, ",expandable_segments:True");
    let mut config = a.config().clone();
    config.opt_in.cross_stream = true;
    a.replace_config(config);
    let limit = 100 * MIB;
    // B's segment: one 20 MiB page mapped, 18.5 MiB of it free at its end.
    let _x = a.malloc(3 * MIB / 2, B).unwrap();
    assert_eq!(a.reserved_bytes(), 20 * MIB);
    // 90 MiB for A: B's free tail and four more pages would take 100 MiB past the limit.
    let err = a.malloc(90 * MIB, A).unwrap_err();
    assert!(preemptively_rejected(&err), "{err}");
    assert!(
        a.reserved_bytes() <= limit,
        "{} reserved",
        a.reserved_bytes()
    );
    assert_eq!(a.reserved_bytes(), 20 * MIB, "nothing was mapped");
    assert_eq!(a.stats().num_oom_rejections, 1);
    assert_eq!(a.cross_stream_counts().segment_growths, 0);
    checked(&a);
    // Within the limit, the growth goes ahead as before.
    let y = a.malloc(60 * MIB, A).unwrap();
    assert_eq!(a.cross_stream_counts().segment_growths, 1);
    assert!(a.reserved_bytes() <= limit);
    a.free(y).unwrap();
    checked(&a);
}

/// A wake takes physical memory from the device again, so it passes the same guard as a new
/// segment: past `throw_on_cudamalloc_oom`'s limit the segment stays asleep (its backup kept),
/// the wake says why, and it finishes once memory was given back.
#[test]
fn wake_is_refused_past_the_rejection_limit_and_finishes_once_it_allows() {
    for expandable in [false, true] {
        let extra = if expandable {
            ",expandable_segments:True"
        } else {
            ""
        };
        let mut a = rejecting_past_half(GIB, extra);
        a.set_sleepable(true);
        let limit = GIB / 2;
        let weights = a.malloc_tagged(300 * MIB, 0, Some(WEIGHTS)).unwrap();
        let slept = a.sleep(Tags::All, true).unwrap();
        assert!(slept.bytes >= 300 * MIB, "{expandable}");
        let other = a.malloc(300 * MIB, 0).unwrap();
        let reserved = a.reserved_bytes();
        let sleeping = a.sleeping_bytes();
        let rejections = a.stats().num_oom_rejections;

        let err = a.wake(Tags::All).unwrap_err();
        assert!(
            err.to_string().contains("throw_on_cudamalloc_oom"),
            "{expandable}: {err}"
        );
        assert!(a.reserved_bytes() <= limit, "{expandable}");
        assert_eq!(a.reserved_bytes(), reserved, "{expandable}");
        assert_eq!(a.sleeping_bytes(), sleeping, "{expandable}: still asleep");
        assert_eq!(a.stats().num_oom_rejections, rejections + 1, "{expandable}");
        checked(&a);

        a.free(other).unwrap();
        a.empty_cache().unwrap();
        a.wake(Tags::All).unwrap();
        assert_eq!(a.sleeping_bytes(), 0, "{expandable}");
        assert_eq!(
            a.allocation_info(weights).map(|i| i.ptr),
            Some(weights),
            "{expandable}"
        );
        checked(&a);
    }
}
