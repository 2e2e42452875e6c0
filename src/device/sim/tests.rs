//! Unit tests of the simulated device.

use super::*;

const MIB: usize = 1 << 20;

#[test]
fn addresses_are_deterministic_aligned_and_reused() {
    let mut d = SimDevice::new(1 << 30);
    let a = d.malloc(20 * MIB, 0).unwrap();
    let b = d.malloc(512, 0).unwrap();
    assert_eq!(a, ADDRESS_BASE);
    assert_eq!(b, ADDRESS_BASE + 20 * MIB as u64);
    d.free(a).unwrap();
    let c = d.malloc(2 * MIB, 0).unwrap();
    assert_eq!(c, a);
    assert_eq!(d.physical_in_use(), 2 * MIB + 512);
}

#[test]
fn capacity_and_limits_report_out_of_memory() {
    let mut d = SimDevice::new(10 * MIB);
    assert_eq!(d.malloc(11 * MIB, 0), Err(DeviceError::OutOfMemory));
    d.set_physical_limit(Some(4 * MIB));
    assert_eq!(d.malloc(5 * MIB, 0), Err(DeviceError::OutOfMemory));
    assert!(d.malloc(4 * MIB, 0).is_ok());
    d.fail_next_mallocs(1);
    d.set_physical_limit(None);
    assert_eq!(d.malloc(MIB, 0), Err(DeviceError::OutOfMemory));
    assert!(d.malloc(MIB, 0).is_ok());
    assert!(d.free(12345).is_err());
}

#[test]
fn events_complete_when_their_stream_does() {
    let mut d = SimDevice::new(1 << 30);
    let e1 = d.record_event(7).unwrap();
    let e2 = d.record_event(7).unwrap();
    assert!(!d.query_event(e1).unwrap());
    d.complete_stream(7);
    assert!(d.query_event(e1).unwrap() && d.query_event(e2).unwrap());
    let e3 = d.record_event(7).unwrap();
    assert!(!d.query_event(e3).unwrap());
    d.synchronize_event(e3).unwrap();
    assert!(d.query_event(e3).unwrap());
    d.set_complete_immediately(true);
    let e4 = d.record_event(8).unwrap();
    assert!(d.query_event(e4).unwrap());
}

#[test]
fn virtual_memory_maps_pages_into_reservations() {
    let mut d = SimDevice::new(1 << 30);
    let base = d.reserve_address_range(64 * MIB).unwrap();
    let h = d.create_physical(2 * MIB).unwrap();
    assert!(!d.is_accessible(base, 512));
    d.map(base, 2 * MIB, h).unwrap();
    assert!(!d.is_accessible(base, 512));
    d.set_access(base, 2 * MIB).unwrap();
    assert!(d.is_accessible(base, 2 * MIB));
    assert!(!d.is_accessible(base, 2 * MIB + 1));
    assert!(d.map(base, 2 * MIB, h).is_err());
    assert!(d.free_address_range(base, 64 * MIB).is_err());
    d.unmap(base, 2 * MIB).unwrap();
    assert_eq!(d.physical_in_use(), 2 * MIB);
    d.release_physical(h).unwrap();
    assert_eq!(d.physical_in_use(), 0);
    d.free_address_range(base, 64 * MIB).unwrap();
    assert_eq!(d.live_physical_handles(), 0);
    assert_eq!(d.reserved_ranges(), 0);
}

#[test]
fn injected_faults_hit_the_named_operation_once_each() {
    let mut d = SimDevice::new(1 << 30);
    d.fail_next(SimOp::Map, 2, DeviceError::OutOfMemory);
    let base = d.reserve_address_range(4 * MIB).unwrap();
    let h = d.create_physical(2 * MIB).unwrap();
    assert!(d.map(base, 2 * MIB, h).is_err());
    assert!(d.map(base, 2 * MIB, h).is_err());
    assert!(d.map(base, 2 * MIB, h).is_ok());
    d.fail_nth(SimOp::Malloc, 2, DeviceError::OutOfMemory);
    assert!(d.malloc(MIB, 0).is_ok());
    assert!(d.malloc(MIB, 0).is_err());
    assert!(d.malloc(MIB, 0).is_ok());
}

fn naive_first_fit(occupied: &BTreeMap<u64, u64>, size: u64) -> u64 {
    let size = size.div_ceil(ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT;
    let mut cursor = ADDRESS_BASE;
    for (&start, &end) in occupied {
        if start >= cursor + size {
            break;
        }
        cursor = cursor.max(end.div_ceil(ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT);
    }
    cursor
}

use proptest::prelude::*;

proptest! {
    #![proptest_config(crate::test_properties::config(64))]

    /// The search hint changes nothing: placement equals a plain first-fit scan from the
    /// base, for any sequence of allocations (1 byte to 64 MiB) and frees.
    #[test]
    fn placement_is_plain_first_fit(
        steps in prop::collection::vec((0u8..3, 1..=64 * MIB, any::<usize>()), 1..600)
    ) {
        let mut d = SimDevice::new(1 << 50);
        let mut live: Vec<u64> = Vec::new();
        for (kind, size, pick) in steps {
            if kind == 0 && !live.is_empty() {
                let p = live.swap_remove(pick % live.len());
                d.free(p).unwrap();
            } else {
                let expected = naive_first_fit(&d.occupied, size as u64);
                let p = d.malloc(size, 0).unwrap();
                prop_assert_eq!(p, expected);
                live.push(p);
            }
        }
    }
}
