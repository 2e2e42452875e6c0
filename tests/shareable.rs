//! What CUDA IPC shares of an allocation (the core's half of `shareIpcHandle`), on the simulated
//! GPU: a plain segment by its base with the allocation's offset in it, an expandable or
//! sleep-able segment by the physical pages under the allocation.

use ferrocache::allocator::DeviceAllocator;
use ferrocache::allocator::shareable::{ShareError, Shareable};
use ferrocache::allocator::sleep::Tags;
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;

const MIB: usize = 1 << 20;
const CAPACITY: usize = 1 << 30;

fn allocator(expandable_segments: bool) -> DeviceAllocator<SimDevice> {
    let config = Config {
        expandable_segments,
        ..Config::default()
    };
    DeviceAllocator::new(SimDevice::new(CAPACITY), 0, config)
}

#[test]
fn a_plain_segment_is_shared_by_its_base_with_the_allocations_offset() {
    let mut a = allocator(false);
    let first = a.malloc(4096, 0).unwrap();
    let second = a.malloc(4096, 0).unwrap();
    let (base, _) = a.base_allocation(second).unwrap();
    assert_eq!(base, first, "both carved from one small segment");
    assert_eq!(
        a.shareable(second),
        Ok(Shareable::Plain {
            base,
            offset: (second - base) as usize,
        })
    );
    let large = a.malloc(24 * MIB, 0).unwrap();
    assert_eq!(
        a.shareable(large),
        Ok(Shareable::Plain {
            base: large,
            offset: 0
        })
    );
}

#[test]
fn an_expandable_segment_is_shared_by_the_pages_under_the_allocation() {
    let mut a = allocator(true);
    let first = a.malloc(3 * MIB, 0).unwrap();
    let second = a.malloc(19 * MIB, 0).unwrap();
    assert_eq!(second - first, 3 * MIB as u64);
    // The large pool's pages are 20 MiB: the second allocation lies on pages 0 and 1, 3 MiB
    // into page 0.
    let Ok(Shareable::Pages {
        page_size,
        handles,
        offset,
    }) = a.shareable(second)
    else {
        panic!("pages expected: {:?}", a.shareable(second));
    };
    assert_eq!((page_size, handles.len(), offset), (20 * MIB, 2, 3 * MIB));
    let Ok(Shareable::Pages { handles: own, .. }) = a.shareable(first) else {
        panic!("pages expected");
    };
    assert_eq!(
        own,
        handles[..1],
        "the page both lie on is the same physical memory"
    );
}

#[test]
fn a_sleepable_segment_is_shared_as_its_one_physical_allocation_and_not_while_asleep() {
    let mut a = allocator(false);
    a.set_sleepable(true);
    let ptr = a.malloc(24 * MIB, 0).unwrap();
    let Ok(Shareable::Pages {
        page_size,
        handles,
        offset,
    }) = a.shareable(ptr)
    else {
        panic!("pages expected: {:?}", a.shareable(ptr));
    };
    assert_eq!((page_size, handles.len(), offset), (24 * MIB, 1, 0));
    a.sleep(Tags::All, false).unwrap();
    assert_eq!(a.shareable(ptr), Err(ShareError::Asleep(ptr)));
    assert!(
        a.shareable(ptr)
            .unwrap_err()
            .to_string()
            .contains("wake it")
    );
    a.wake(Tags::All).unwrap();
    assert!(matches!(a.shareable(ptr), Ok(Shareable::Pages { .. })));
}

#[test]
fn only_the_start_of_a_live_allocation_is_shared() {
    let mut a = allocator(false);
    let ptr = a.malloc(4096, 0).unwrap();
    assert!(matches!(
        a.shareable(ptr + 512),
        Err(ShareError::Pointer(_))
    ));
    a.free(ptr).unwrap();
    assert!(matches!(a.shareable(ptr), Err(ShareError::Pointer(_))));
}
