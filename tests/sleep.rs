//! Sleep and wake on the simulated GPU: the memory goes back to the device and comes again at
//! the same addresses, with the same bytes when backed up, and PyTorch's decisions unchanged.

use ferrocache::allocator::DeviceAllocator;
use ferrocache::allocator::sleep::{SleepError, Tags};
use ferrocache::config::Config;
use ferrocache::device::sim::{SimDevice, SimOp};
use ferrocache::device::{Device, DeviceError, DevicePtr};

const MIB: usize = 1 << 20;
const CAPACITY: usize = 1 << 30;
const WEIGHTS: u32 = 1;
const KV_CACHE: u32 = 2;

fn sleepable() -> DeviceAllocator<SimDevice> {
    let mut a = DeviceAllocator::new(SimDevice::new(CAPACITY), 0, Config::default());
    a.set_sleepable(true);
    a
}

fn checked(a: &DeviceAllocator<SimDevice>) {
    if let Err(why) = a.check_invariants() {
        panic!("invariant broken: {why}");
    }
    assert_eq!(
        a.stats().reserved_bytes.all.current as usize,
        a.device().physical_in_use(),
        "what is reserved is what the device holds"
    );
}

/// A recognisable pattern for the allocation at `ptr`.
fn pattern(ptr: DevicePtr, size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| (ptr as usize / 512 + i * 7) as u8)
        .collect()
}

fn write(a: &mut DeviceAllocator<SimDevice>, ptr: DevicePtr, size: usize) {
    a.device_mut()
        .copy_from_host(ptr, &pattern(ptr, size))
        .unwrap();
}

fn read(a: &mut DeviceAllocator<SimDevice>, ptr: DevicePtr, size: usize) -> Vec<u8> {
    let mut bytes = vec![0; size];
    a.device_mut().copy_to_host(ptr, &mut bytes).unwrap();
    bytes
}

/// Small and large allocations, some freed again (cached), each written with its pattern.
fn fill(a: &mut DeviceAllocator<SimDevice>, tag: Option<u32>) -> Vec<(DevicePtr, usize)> {
    let mut live = Vec::new();
    for (i, size) in [4096, 700_000, 3 * MIB, 25 * MIB, 512, 9 * MIB]
        .iter()
        .enumerate()
    {
        let ptr = a.malloc_tagged(*size, 0, tag).unwrap();
        write(a, ptr, *size);
        if i % 3 == 2 {
            a.free(ptr).unwrap();
        } else {
            live.push((ptr, *size));
        }
    }
    live
}

#[test]
fn sleep_with_backup_gives_the_memory_back_and_wake_restores_it_at_the_same_addresses() {
    let mut a = sleepable();
    let live = fill(&mut a, None);
    let reserved = a.reserved_bytes();
    let free_before = a.device_mut().mem_get_info().unwrap().free;

    let allocated = a.stats().allocated_bytes.all.current as usize;
    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(slept.bytes, reserved);
    assert_eq!(slept.copied_bytes, allocated, "the live blocks' bytes only");
    assert_eq!(slept.blocks, live.len());
    assert_eq!(a.reserved_bytes(), 0);
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    assert!(
        a.segments().is_empty(),
        "a snapshot shows no sleeping segment"
    );
    assert_eq!(
        a.device_mut().mem_get_info().unwrap().free,
        free_before + reserved
    );
    for &(ptr, size) in &live {
        assert!(
            !a.device().is_accessible(ptr, size),
            "{ptr:#x} still mapped"
        );
        // Touching sleeping memory is the program's error, and the device says so.
        let touched = a.device_mut().copy_to_host(ptr, &mut [0; 8]);
        assert!(matches!(
            touched,
            Err(DeviceError::Driver { code: 700, .. })
        ));
    }
    checked(&a);

    // Another user of the device takes the memory, and gives it back.
    let raw = a.device_mut().malloc(CAPACITY, 0).unwrap();
    a.device_mut().free(raw).unwrap();

    // Allocations while asleep are served normally, never from sleeping memory.
    let during = a.malloc(700_000, 0).unwrap();
    assert!(a.device().is_accessible(during, 700_000));
    assert!(live.iter().all(|&(ptr, _)| ptr != during));
    checked(&a);

    let woke = a.wake(Tags::All).unwrap();
    assert_eq!(woke.bytes, reserved);
    assert_eq!(woke.blocks, live.len());
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
        assert_eq!(a.allocation_info(ptr).unwrap().ptr, ptr);
    }
    a.free(during).unwrap();
    checked(&a);
    // Everything goes back as usual.
    for &(ptr, _) in &live {
        a.free(ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().physical_in_use(), 0);
    assert_eq!(a.device().reserved_ranges(), 0);
}

#[test]
fn sleep_and_wake_are_idempotent() {
    let mut a = sleepable();
    fill(&mut a, None);
    let first = a.sleep(Tags::All, true).unwrap();
    assert!(first.segments > 0);
    assert_eq!(a.sleep(Tags::All, true).unwrap().segments, 0);
    assert_eq!(a.wake(Tags::All).unwrap().segments, first.segments);
    assert_eq!(a.wake(Tags::All).unwrap().segments, 0);
    checked(&a);
}

#[test]
fn a_tag_sleeps_alone_and_without_backup_reads_zeros_after_wake() {
    let mut a = DeviceAllocator::new(SimDevice::new(CAPACITY), 0, Config::default());
    let weights = fill(&mut a, Some(WEIGHTS));
    let cache = fill(&mut a, Some(KV_CACHE));
    assert!(a.is_sleepable(), "a tag turns sleep-ability on");
    // Blocks of different tags never share a segment, so never a page.
    for &(w, _) in &weights {
        let (base, size) = a.base_allocation(w).unwrap();
        for &(c, _) in &cache {
            assert!(c < base || c >= base + size as u64);
        }
    }
    let slept = a.sleep(Tags::Only(&[KV_CACHE]), false).unwrap();
    assert_eq!(slept.copied_bytes, 0);
    assert_eq!(slept.blocks, cache.len());
    for &(ptr, size) in &weights {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size));
    }
    // The awake tag allocates as usual.
    let more = a.malloc_tagged(3 * MIB, 0, Some(WEIGHTS)).unwrap();
    write(&mut a, more, 3 * MIB);
    checked(&a);
    a.wake(Tags::Only(&[KV_CACHE])).unwrap();
    for &(ptr, size) in &cache {
        assert_eq!(read(&mut a, ptr, size), vec![0; size], "dropped contents");
    }
    for &(ptr, size) in &weights {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size));
    }
    checked(&a);
}

#[test]
fn segments_made_before_sleep_ability_are_reported_as_skipped() {
    let mut a = DeviceAllocator::new(SimDevice::new(CAPACITY), 0, Config::default());
    let ptr = a.malloc(3 * MIB, 0).unwrap();
    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(slept.segments, 0);
    assert_eq!(slept.skipped_bytes, a.reserved_bytes());
    assert!(a.device().is_accessible(ptr, 3 * MIB));
}

/// The same program with sleep-ability on (never used) and off: the same addresses, the same
/// segments, the same statistics. (On the simulated GPU, a reservation and a `cudaMalloc` of
/// one size get the same address.)
#[test]
fn sleep_ability_on_changes_no_decision() {
    let run = |on: bool| {
        let mut a = DeviceAllocator::new(SimDevice::new(64 << 30), 0, Config::default());
        a.set_sleepable(on);
        let mut ptrs = Vec::new();
        let mut live = Vec::new();
        for i in 0..400usize {
            let size = (i * 7919 % 97 + 1) * if i % 5 == 0 { MIB } else { 4096 };
            let stream = (i % 3) as u64;
            if i % 4 == 3 && !live.is_empty() {
                a.free(live.swap_remove(i % live.len())).unwrap();
            }
            let ptr = a.malloc(size, stream).unwrap();
            ptrs.push(ptr);
            live.push(ptr);
            if i % 150 == 149 {
                a.empty_cache().unwrap();
            }
        }
        checked(&a);
        (ptrs, a.stats().clone())
    };
    let (off_ptrs, off_stats) = run(false);
    let (on_ptrs, on_stats) = run(true);
    assert_eq!(off_ptrs, on_ptrs);
    assert_eq!(off_stats, on_stats);
}

fn fault() -> DeviceError {
    DeviceError::Driver {
        call: "injected",
        code: 999,
        message: "injected".into(),
    }
}

/// Each call of `sleep_ops` to fail during a sleep (`true`), then each of `wake_ops` during a
/// wake (`false`).
fn failing_during_sleep_then_wake(
    sleep_ops: &[SimOp],
    wake_ops: &[SimOp],
) -> impl Iterator<Item = (SimOp, bool)> {
    let during_sleep = sleep_ops.iter().map(|&op| (op, true));
    during_sleep.chain(wake_ops.iter().map(|&op| (op, false)))
}

/// After a sleep or wake that `op` failed: calling sleep and wake again finishes the job and
/// brings back every byte of `live`; once everything is freed, `empty_cache` gives the device
/// back all it held, what it refused to take back before included.
fn sleep_and_wake_again_lose_nothing(
    a: &mut DeviceAllocator<SimDevice>,
    live: &[(DevicePtr, usize)],
    reserved: usize,
    op: SimOp,
) {
    a.sleep(Tags::All, true).unwrap();
    assert_eq!(a.reserved_bytes(), 0, "{op:?}");
    a.wake(Tags::All).unwrap();
    assert_eq!(a.reserved_bytes(), reserved, "{op:?}");
    for &(ptr, size) in live {
        assert_eq!(read(a, ptr, size), pattern(ptr, size), "{op:?} {ptr:#x}");
    }
    checked(a);
    for &(ptr, _) in live {
        a.free(ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.device().physical_in_use(), 0, "{op:?}");
    assert_eq!(a.device().reserved_ranges(), 0, "{op:?}");
}

/// Every driver call of a sleep, then of a wake, fails once, in the middle (the second
/// segment's): no segment is left half-mapped, no backup is lost, and calling again finishes.
#[test]
fn a_driver_failure_in_the_middle_of_sleep_or_wake_loses_nothing() {
    let sleep_ops = [
        SimOp::CreateStream,
        SimOp::WaitEvent,
        SimOp::AllocPinnedHost,
        SimOp::CopyToPinnedAsync,
        SimOp::RecordEvent,
        SimOp::QueryEvent,
        SimOp::SynchronizeStream,
        SimOp::Unmap,
    ];
    let wake_ops = [
        SimOp::CreatePhysical,
        SimOp::Map,
        SimOp::SetAccess,
        SimOp::CopyFromPinnedAsync,
    ];
    // Called once per call: the first fails; once per segment: the second segment's.
    let once_per_call = [
        SimOp::WaitEvent,
        SimOp::CreateStream,
        SimOp::AllocPinnedHost,
        SimOp::QueryEvent,
        SimOp::SynchronizeStream,
    ];
    for (op, during_sleep) in failing_during_sleep_then_wake(&sleep_ops, &wake_ops) {
        let mut a = sleepable();
        let live = fill(&mut a, None);
        let reserved = a.reserved_bytes();
        let nth = if once_per_call.contains(&op) { 1 } else { 2 };
        if during_sleep {
            a.device_mut().fail_nth(op, nth, fault());
            let err = a.sleep(Tags::All, true).unwrap_err();
            assert!(matches!(err, SleepError::Device { .. }), "{op:?}");
            checked(&a);
        } else {
            a.sleep(Tags::All, true).unwrap();
            a.device_mut().fail_nth(op, nth, fault());
            let err = a.wake(Tags::All).unwrap_err();
            let SleepError::Device { done, .. } = err else {
                panic!("{op:?}: {err}")
            };
            if op == SimOp::CopyFromPinnedAsync {
                // Counted per copy, and a segment with nothing live has none.
                assert!(done.segments >= 1, "{op:?}: the first segment woke");
            } else {
                assert_eq!(done.segments, 1, "{op:?}: the first segment woke");
            }
            checked(&a);
            // Every segment is mapped whole or not at all.
            for &(ptr, size) in &live {
                let (base, segment) = a.base_allocation(ptr).unwrap();
                let whole = a.device().is_accessible(base, segment);
                assert!(
                    whole || !a.device().is_accessible(ptr, size.min(512)),
                    "{op:?}"
                );
            }
        }
        sleep_and_wake_again_lose_nothing(&mut a, &live, reserved, op);
    }
}

#[test]
fn a_release_the_device_refuses_during_sleep_is_retried_by_empty_cache() {
    let mut a = sleepable();
    let live = fill(&mut a, None);
    a.device_mut().fail_nth(SimOp::ReleasePhysical, 1, fault());
    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(a.reserved_bytes(), 0);
    assert!(a.device().physical_in_use() > 0, "one release was refused");
    a.empty_cache().unwrap();
    assert_eq!(a.device().physical_in_use(), 0);
    a.wake(Tags::All).unwrap();
    assert_eq!(a.reserved_bytes(), slept.bytes);
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size));
    }
}

#[test]
fn sleep_and_wake_are_refused_during_a_capture() {
    let mut a = sleepable();
    fill(&mut a, None);
    a.begin_allocate_to_pool((1, 0), Box::new(|_| Ok(true)))
        .unwrap();
    assert_eq!(a.sleep(Tags::All, true), Err(SleepError::Capturing));
    assert_eq!(a.wake(Tags::All), Err(SleepError::Capturing));
    a.end_allocate_to_pool((1, 0)).unwrap();
    assert!(a.sleep(Tags::All, true).unwrap().segments > 0);
    checked(&a);
}

fn expandable() -> DeviceAllocator<SimDevice> {
    let config = Config {
        expandable_segments: true,
        ..Config::default()
    };
    DeviceAllocator::new(SimDevice::new(CAPACITY), 0, config)
}

/// Expandable segments' mapped pages sleep and wake at the same addresses: the physical memory
/// goes back to the device, the bytes come back from the backup, and a sleeping segment does
/// not grow (an allocation that would need it reserves a new segment).
#[test]
fn expandable_segments_sleep_with_backup_and_wake_at_the_same_addresses() {
    let mut a = expandable();
    let live = fill(&mut a, None);
    let reserved = a.reserved_bytes();
    let ranges = a.device().reserved_ranges();
    let free_before = a.device_mut().mem_get_info().unwrap().free;

    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(slept.skipped_bytes, 0, "expandable memory sleeps");
    assert_eq!(slept.bytes, reserved);
    let requested: usize = live.iter().map(|&(_, size)| size).sum();
    assert!(
        slept.copied_bytes >= requested && slept.copied_bytes < reserved,
        "the live blocks, not the pages: {slept:?}"
    );
    assert!(slept.host_memory_pinned);
    assert_eq!(slept.blocks, live.len());
    assert_eq!(a.reserved_bytes(), 0);
    assert_eq!(a.sleeping_bytes(), reserved);
    assert!(a.segments().is_empty());
    assert_eq!(
        a.device_mut().mem_get_info().unwrap().free,
        free_before + reserved
    );
    for &(ptr, size) in &live {
        assert!(!a.device().is_accessible(ptr, size.min(512)));
    }
    checked(&a);
    assert_eq!(a.sleep(Tags::All, true).unwrap().segments, 0, "idempotent");

    // Another user takes all of the device's memory, and gives it back.
    let raw = a.device_mut().malloc(CAPACITY, 0).unwrap();
    a.device_mut().free(raw).unwrap();

    // The sleeping segments do not grow: new requests reserve segments of their own.
    let small = a.malloc(4096, 0).unwrap();
    let large = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(a.device().reserved_ranges(), ranges + 2);
    for during in [small, large] {
        assert!(a.device().is_accessible(during, 512));
        for &(ptr, size) in &live {
            let (base, segment) = a.base_allocation(ptr).unwrap();
            assert!(
                during < base || during >= base + segment as u64,
                "{during:#x} lies in the sleeping segment of {ptr:#x} ({size} bytes)"
            );
        }
    }
    checked(&a);

    let woke = a.wake(Tags::All).unwrap();
    assert_eq!(woke.bytes, reserved);
    assert_eq!(woke.copied_bytes, slept.copied_bytes);
    assert!(woke.host_memory_pinned);
    assert_eq!(woke.blocks, live.len());
    assert_eq!(a.sleeping_bytes(), 0);
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
    }
    checked(&a);
    assert_eq!(a.wake(Tags::All).unwrap().segments, 0, "idempotent");
    // Awake, the segment grows again, and everything goes back as usual.
    let grown = a.malloc(3 * MIB, 0).unwrap();
    write(&mut a, grown, 3 * MIB);
    for ptr in live
        .iter()
        .map(|&(ptr, _)| ptr)
        .chain([small, large, grown])
    {
        a.free(ptr).unwrap();
    }
    a.empty_cache().unwrap();
    checked(&a);
    assert_eq!(a.device().physical_in_use(), 0);
    assert_eq!(a.device().reserved_ranges(), 0);
}

/// Each tag's pools have expandable segments of their own, so a tag's pages hold no other
/// tag's blocks, and one tag sleeps (here without backup) while the other works on.
#[test]
fn expandable_segments_of_a_tag_sleep_alone() {
    let mut a = expandable();
    let weights = fill(&mut a, Some(WEIGHTS));
    let cache = fill(&mut a, Some(KV_CACHE));
    let untagged = fill(&mut a, None);
    for &(w, _) in &weights {
        let (base, size) = a.base_allocation(w).unwrap();
        for &(other, _) in cache.iter().chain(&untagged) {
            assert!(other < base || other >= base + size as u64);
        }
    }
    let slept = a.sleep(Tags::Only(&[KV_CACHE]), false).unwrap();
    assert_eq!(slept.copied_bytes, 0);
    assert_eq!(slept.blocks, cache.len());
    for &(ptr, size) in weights.iter().chain(&untagged) {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size));
    }
    let more = a.malloc_tagged(3 * MIB, 0, Some(WEIGHTS)).unwrap();
    write(&mut a, more, 3 * MIB);
    checked(&a);
    a.wake(Tags::Only(&[KV_CACHE])).unwrap();
    for &(ptr, size) in &cache {
        assert_eq!(read(&mut a, ptr, size), vec![0; size], "dropped contents");
    }
    for &(ptr, size) in weights.iter().chain(&untagged) {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size));
    }
    checked(&a);
}

/// Every driver call of an expandable segment's sleep, then of its wake, fails once, at its
/// second page: no page is left half-mapped, no backup is lost, every segment is mapped whole
/// or not at all after a failed wake, and calling again finishes the job.
#[test]
fn a_driver_failure_while_expandable_pages_sleep_or_wake_loses_nothing() {
    let sleep_ops = [
        SimOp::WaitEvent,
        SimOp::CopyToPinnedAsync,
        SimOp::RecordEvent,
        SimOp::QueryEvent,
        SimOp::SynchronizeStream,
        SimOp::Unmap,
        SimOp::ReleasePhysical,
    ];
    let wake_ops = [
        SimOp::CreatePhysical,
        SimOp::Map,
        SimOp::SetAccess,
        SimOp::CopyFromPinnedAsync,
    ];
    let once_per_call = [
        SimOp::WaitEvent,
        SimOp::QueryEvent,
        SimOp::SynchronizeStream,
    ];
    for (op, during_sleep) in failing_during_sleep_then_wake(&sleep_ops, &wake_ops) {
        let mut a = expandable();
        let live = fill(&mut a, None);
        let reserved = a.reserved_bytes();
        let nth = if once_per_call.contains(&op) { 1 } else { 2 };
        if during_sleep {
            a.device_mut().fail_nth(op, nth, fault());
            match a.sleep(Tags::All, true) {
                // The device keeps a page it would not take back: a leftover for empty_cache.
                Ok(_) if op == SimOp::ReleasePhysical => a.empty_cache().unwrap(),
                Ok(_) => panic!("{op:?}: the sleep did not fail"),
                Err(err) => assert!(matches!(err, SleepError::Device { .. }), "{op:?}"),
            }
            checked(&a);
        } else {
            a.sleep(Tags::All, true).unwrap();
            a.device_mut().fail_nth(op, nth, fault());
            let err = a.wake(Tags::All).unwrap_err();
            assert!(matches!(err, SleepError::Device { .. }), "{op:?}");
            checked(&a);
            for &(ptr, size) in &live {
                let (base, segment) = a.base_allocation(ptr).unwrap();
                let mapped = a.device().is_accessible(ptr, size);
                let others = live
                    .iter()
                    .filter(|&&(p, _)| p >= base && p < base + segment as u64);
                assert!(
                    others
                        .into_iter()
                        .all(|&(p, s)| a.device().is_accessible(p, s) == mapped),
                    "{op:?}: a segment half awake"
                );
            }
        }
        sleep_and_wake_again_lose_nothing(&mut a, &live, reserved, op);
    }
}

/// Sleeping memory is out of `empty_cache`'s reach: a sleeping segment whose blocks are all
/// free keeps its addresses (and its backup) until it wakes.
#[test]
fn empty_cache_leaves_sleeping_expandable_pages_alone() {
    let mut a = expandable();
    let live = fill(&mut a, None);
    a.sleep(Tags::All, true).unwrap();
    for &(ptr, _) in &live {
        a.free(ptr).unwrap();
    }
    let sleeping = a.sleeping_bytes();
    a.empty_cache().unwrap();
    assert_eq!(a.sleeping_bytes(), sleeping);
    checked(&a);
    a.wake(Tags::All).unwrap();
    a.empty_cache().unwrap();
    checked(&a);
    assert_eq!(a.device().physical_in_use(), 0);
    assert_eq!(a.device().reserved_ranges(), 0);
}

/// The memory fraction bounds what the allocator reserves, sleeping memory included when it
/// wakes: past the limit a segment stays asleep, the call says so, and it finishes once the
/// limit allows (for VMM-backed and for expandable segments).
#[test]
fn wake_stops_at_the_memory_fraction_and_finishes_once_it_allows() {
    for mut a in [sleepable(), expandable()] {
        let live = fill(&mut a, None);
        let reserved = a.reserved_bytes();
        a.sleep(Tags::All, true).unwrap();
        // Room for less than what slept.
        let fraction = (reserved / 2) as f64 / CAPACITY as f64;
        a.set_memory_fraction(fraction).unwrap();
        let err = a.wake(Tags::All).unwrap_err();
        let SleepError::OverMemoryFraction { done, allowed, .. } = err else {
            panic!("{err}")
        };
        assert!(err_text_says_fraction(&a.wake(Tags::All).unwrap_err()));
        assert!(a.reserved_bytes() <= allowed);
        assert_eq!(a.reserved_bytes(), done.bytes);
        assert!(a.sleeping_bytes() > 0);
        checked(&a);
        a.set_memory_fraction(1.0).unwrap();
        a.wake(Tags::All).unwrap();
        assert_eq!(a.reserved_bytes(), reserved);
        for &(ptr, size) in &live {
            assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
        }
        checked(&a);
    }
}

fn err_text_says_fraction(err: &SleepError) -> bool {
    err.to_string().contains("memory fraction")
}

/// With expandable segments, a CUDA graph's private pool sleeps and wakes with the rest under
/// `sleep()` of everything, and a block used on another stream (`record_stream`) and freed
/// while asleep waits for its event as usual, then serves again after wake.
#[test]
fn expandable_private_pools_and_record_stream_keep_their_rules_across_sleep() {
    let mut a = expandable();
    a.device_mut().set_complete_immediately(false);
    let live = fill(&mut a, None);
    let shared = a.malloc(5 * MIB, 0).unwrap();
    write(&mut a, shared, 5 * MIB);
    a.record_stream(shared, 0x2000).unwrap();
    a.begin_allocate_to_pool((1, 0), Box::new(|_| Ok(true)))
        .unwrap();
    let graph = a.malloc(3 * MIB, 0).unwrap();
    a.end_allocate_to_pool((1, 0)).unwrap();
    write(&mut a, graph, 3 * MIB);
    assert_ne!(a.base_allocation(graph), a.base_allocation(shared));

    a.sleep(Tags::All, true).unwrap();
    assert!(!a.device().is_accessible(graph, 512));
    a.free(shared).unwrap(); // records an event on the other stream
    checked(&a);
    let during = a.malloc(5 * MIB, 0).unwrap();
    assert_ne!(during, shared, "a sleeping block serves nobody");
    checked(&a);

    a.wake(Tags::All).unwrap();
    assert_eq!(read(&mut a, graph, 3 * MIB), pattern(graph, 3 * MIB));
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size));
    }
    checked(&a);
    a.device_mut().set_complete_immediately(true);
    a.free(during).unwrap();
    // Awake, the cached blocks (the one freed while asleep among them) serve again: no new
    // memory is taken.
    let (ranges, reserved) = (a.device().reserved_ranges(), a.reserved_bytes());
    for _ in 0..2 {
        a.malloc(5 * MIB, 0).unwrap();
    }
    assert_eq!(a.device().reserved_ranges(), ranges);
    assert_eq!(a.reserved_bytes(), reserved);
    checked(&a);
}

/// Ten 2 MiB blocks in one 20 MiB segment, every other one freed again: a half-empty segment,
/// the live half written with its pattern.
fn half_empty_segment(a: &mut DeviceAllocator<SimDevice>) -> Vec<(DevicePtr, usize)> {
    let blocks: Vec<DevicePtr> = (0..10).map(|_| a.malloc(2 * MIB, 0).unwrap()).collect();
    assert_eq!(a.reserved_bytes(), 20 * MIB, "one segment");
    let mut live = Vec::new();
    for (i, &ptr) in blocks.iter().enumerate() {
        if i % 2 == 0 {
            a.free(ptr).unwrap();
        } else {
            write(a, ptr, 2 * MIB);
            live.push((ptr, 2 * MIB));
        }
    }
    live
}

#[test]
fn sleep_copies_the_live_blocks_of_a_half_empty_segment_not_the_segment() {
    let mut a = sleepable();
    let live = half_empty_segment(&mut a);
    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(slept.bytes, 20 * MIB, "the whole segment sleeps");
    assert_eq!(slept.copied_bytes, 10 * MIB, "only its live half is copied");
    assert_eq!(a.device().counters().bytes_copied_pinned, 10 * MIB as u64);
    let woke = a.wake(Tags::All).unwrap();
    assert_eq!(woke.copied_bytes, 10 * MIB);
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
    }
    checked(&a);
}

#[test]
fn the_backup_goes_to_pinned_host_memory_kept_for_the_next_cycle() {
    let mut a = sleepable();
    let live = half_empty_segment(&mut a);
    let slept = a.sleep(Tags::All, true).unwrap();
    assert!(slept.host_memory_pinned);
    assert_eq!(slept.host_allocations, 1);
    assert_eq!(a.device().pinned_host().0, 1);
    let woke = a.wake(Tags::All).unwrap();
    assert!(woke.host_memory_pinned);
    assert_eq!(woke.host_allocations, 0);
    assert_eq!(a.device().pinned_host().0, 1, "kept after the wake");

    // The second cycle reuses the buffer: no host allocation at all.
    let allocations = a.device().counters().pinned_host_allocations;
    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(slept.host_allocations, 0);
    assert!(slept.host_memory_pinned);
    a.wake(Tags::All).unwrap();
    assert_eq!(a.device().counters().pinned_host_allocations, allocations);
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
    }

    // Given back on request, and allocated again by the next sleep.
    assert_eq!(
        a.release_host_memory(),
        a.device().pinned_host().1.max(10 * MIB)
    );
    assert_eq!(a.device().pinned_host(), (0, 0));
    assert_eq!(a.sleep(Tags::All, true).unwrap().host_allocations, 1);
    assert_eq!(a.release_host_memory(), 0, "a backup asleep in it keeps it");
    a.wake(Tags::All).unwrap();
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
    }
    checked(&a);
}

#[test]
fn sleep_and_wake_each_wait_once_for_all_their_copies() {
    let mut a = sleepable();
    let live = fill(&mut a, None);
    let before = a.device().counters().clone();
    let slept = a.sleep(Tags::All, true).unwrap();
    assert!(slept.segments > 2, "several segments: {slept:?}");
    let after = a.device().counters().clone();
    // The copies wait for the program's work on the device; the host waits once, for them.
    assert_eq!(slept.host_synchronizations, 1);
    assert_eq!(
        after.device_synchronizations,
        before.device_synchronizations
    );
    assert!(
        after.event_waits > before.event_waits,
        "ordered on the device"
    );
    assert_eq!(
        after.stream_synchronizations - before.stream_synchronizations,
        1
    );
    assert_eq!(after.event_synchronizations, before.event_synchronizations);

    let woke = a.wake(Tags::All).unwrap();
    let end = a.device().counters().clone();
    assert_eq!(woke.host_synchronizations, 1);
    assert_eq!(
        end.stream_synchronizations - after.stream_synchronizations,
        1
    );
    assert_eq!(end.device_synchronizations, after.device_synchronizations);
    assert_eq!(end.event_synchronizations, after.event_synchronizations);
    for &(ptr, size) in &live {
        assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
    }
}

/// Copies that finish while the next segments' copies are queued let their segment be
/// unmapped at once, without a wait; a segment is never unmapped under a pending copy (the
/// simulated device refuses that, as the fake's ordering check does).
#[test]
fn a_segment_whose_copies_finished_is_unmapped_while_the_next_ones_copy() {
    for mut a in [sleepable(), expandable()] {
        a_segment_whose_copies_finished_is_unmapped_at_once(&mut a);
    }
}

fn a_segment_whose_copies_finished_is_unmapped_at_once(a: &mut DeviceAllocator<SimDevice>) {
    let live = fill(a, None);
    a.device_mut().set_complete_immediately(true);
    let before = a.device().counters().stream_synchronizations;
    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(slept.host_synchronizations, 0, "no wait at all: {slept:?}");
    assert_eq!(a.device().counters().stream_synchronizations, before);
    a.device_mut().set_complete_immediately(false);
    a.wake(Tags::All).unwrap();
    for &(ptr, size) in &live {
        assert_eq!(read(a, ptr, size), pattern(ptr, size), "{ptr:#x}");
    }
}

#[test]
fn sleep_without_backup_copies_nothing_and_holds_no_host_memory() {
    let mut a = sleepable();
    half_empty_segment(&mut a);
    let slept = a.sleep(Tags::All, false).unwrap();
    assert_eq!(slept.copied_bytes, 0);
    assert!(!slept.host_memory_pinned);
    assert_eq!(slept.host_allocations, 0);
    assert_eq!(slept.host_synchronizations, 1);
    assert_eq!(a.wake(Tags::All).unwrap().host_synchronizations, 0);
    assert_eq!(a.device().pinned_host(), (0, 0));
}

/// Expandable segments take the same fast path: a half-empty 20 MiB page copies its live half
/// (not the page) into pinned host memory kept for the next cycle, with one wait per call, and
/// wakes at the same addresses with every byte back.
#[test]
fn an_expandable_page_copies_its_live_blocks_into_pinned_memory_kept_between_cycles() {
    let mut a = expandable();
    let live = half_empty_segment(&mut a);
    let addresses: Vec<DevicePtr> = live.iter().map(|&(ptr, _)| ptr).collect();
    for cycle in 0..2 {
        let before = a.device().counters().clone();
        let slept = a.sleep(Tags::All, true).unwrap();
        let after = a.device().counters().clone();
        assert_eq!(slept.bytes, 20 * MIB, "the mapped page sleeps");
        assert_eq!(slept.copied_bytes, 10 * MIB, "only the live half is copied");
        assert_eq!(
            after.bytes_copied_pinned - before.bytes_copied_pinned,
            10 * MIB as u64
        );
        assert_eq!(
            after.bytes_copied - before.bytes_copied,
            after.bytes_copied_pinned - before.bytes_copied_pinned,
            "nothing through pageable memory"
        );
        assert!(slept.host_memory_pinned);
        assert_eq!(slept.host_allocations, usize::from(cycle == 0));
        assert_eq!(slept.host_synchronizations, 1);
        assert_eq!(
            after.device_synchronizations,
            before.device_synchronizations
        );
        assert_eq!(a.reserved_bytes(), 0);
        assert_eq!(a.device().physical_in_use(), 0);
        checked(&a);

        let woke = a.wake(Tags::All).unwrap();
        assert_eq!(woke.bytes, 20 * MIB);
        assert_eq!(woke.copied_bytes, 10 * MIB);
        assert!(woke.host_memory_pinned);
        assert_eq!(woke.host_synchronizations, 1);
        for (&(ptr, size), &address) in live.iter().zip(&addresses) {
            assert_eq!(ptr, address);
            assert_eq!(read(&mut a, ptr, size), pattern(ptr, size), "{ptr:#x}");
        }
        checked(&a);
    }
    assert_eq!(a.device().pinned_host().0, 1, "one buffer for both cycles");
    assert!(a.release_host_memory() >= 10 * MIB);
    assert_eq!(a.device().pinned_host(), (0, 0));
}

/// A large expandable segment wakes a group of pages at a time, each group's copies queued
/// before the next group is mapped, and comes back whole; its bytes travel in chunks of at most
/// 64 MiB.
#[test]
fn a_large_expandable_segment_wakes_group_by_group_with_every_byte_back() {
    let mut a = expandable();
    let big = 150 * MIB;
    let ptr = a.malloc(big, 0).unwrap();
    write(&mut a, ptr, big);
    let before = a.device().counters().clone();
    let slept = a.sleep(Tags::All, true).unwrap();
    assert_eq!(slept.copied_bytes, big);
    let copies = a.device().counters().async_copies - before.async_copies;
    assert_eq!(copies, 3, "150 MiB in copies of at most 64 MiB");
    let accesses = a.device().counters().set_accesses;
    a.wake(Tags::All).unwrap();
    assert!(
        a.device().counters().set_accesses - accesses > 1,
        "one grant per group of pages"
    );
    assert_eq!(read(&mut a, ptr, big), pattern(ptr, big));
    checked(&a);
}

/// The copies wait, on the device, for the work queued on the streams that used the memory:
/// the allocation's stream and a stream it was recorded on, and the stream of a freed block
/// still waiting for its event, which is then cached (not copied) and sleeps with the rest.
#[test]
fn the_copies_wait_on_the_device_for_the_streams_that_used_the_memory() {
    for mut a in [sleepable(), expandable()] {
        let (stream, other, third) = (5, 6, 7);
        let ptr = a.malloc(2 * MIB, stream).unwrap();
        write(&mut a, ptr, 2 * MIB);
        a.record_stream(ptr, other).unwrap();
        let freed = a.malloc(2 * MIB, stream).unwrap();
        a.record_stream(freed, third).unwrap();
        let work = [stream, other, third].map(|s| (s, a.device_mut().submit_work(s)));
        a.free(freed).unwrap();
        let slept = a.sleep(Tags::All, true).unwrap();
        assert_eq!(slept.copied_bytes, 2 * MIB, "the freed block is not copied");
        assert_eq!(slept.blocks, 1);
        assert_eq!(slept.host_synchronizations, 1);
        for (s, sequence) in work {
            assert!(
                a.device()
                    .waits()
                    .iter()
                    .any(|w| w.event_stream == s && w.sequence >= sequence),
                "the copies wait for stream {s}"
            );
        }
        checked(&a);
        a.wake(Tags::All).unwrap();
        assert_eq!(read(&mut a, ptr, 2 * MIB), pattern(ptr, 2 * MIB));
        checked(&a);
        // The freed block was cached when it went to sleep, and serves again.
        assert_eq!(a.malloc(2 * MIB, stream).unwrap(), freed);
    }
}
