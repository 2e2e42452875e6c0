//! The start state of a replay: the segments and live blocks PyTorch had when recording began,
//! imported at their offsets ([`reconstructed_start`]), or the live allocations made on an empty
//! GPU ([`fresh_start`]).

use super::report::StartReport;
use crate::allocator::{DeviceAllocator, ImportedBlock};
use crate::device::sim::SimDevice;
use crate::policy::K_MIN_BLOCK_SIZE;
use crate::replay::workload::{DeviceWorkload, StartAllocation, StartSegment};

/// Requests above this are refused as out of memory without asking the allocator: no GPU has
/// 64 PiB, and PyTorch's rounding arithmetic would overflow near `usize::MAX`.
pub(super) const LARGEST_SANE_REQUEST: u64 = 1 << 56;

/// Makes one allocation live at the start with `malloc`; false if the GPU cannot hold it.
fn allocate_start(
    allocator: &mut DeviceAllocator<SimDevice>,
    allocation: &StartAllocation,
    pointers: &mut [u64],
) -> bool {
    if allocation.requested_size > LARGEST_SANE_REQUEST {
        return false;
    }
    match allocator.malloc(allocation.requested_size as usize, allocation.stream) {
        Ok(ptr) => {
            if let Some(slot) = pointers.get_mut(allocation.id as usize) {
                *slot = ptr;
            }
            true
        }
        Err(_) => false,
    }
}

pub(super) fn fresh_start(
    allocator: &mut DeviceAllocator<SimDevice>,
    start_allocations: &[StartAllocation],
    pointers: &mut [u64],
) -> StartReport {
    let mut report = StartReport::default();
    // `start_allocations` is in address order already; PyTorch would have made them in some
    // order we do not know, and address order is the closest guess to allocation order.
    for allocation in start_allocations {
        if allocate_start(allocator, allocation, pointers) {
            report.allocated_allocations += 1;
        } else {
            report.failures += 1;
        }
    }
    report
}

/// Imports the start segments in `workload.start_order` (the order PyTorch made them in, as far
/// as the recording tells), noting in `bases` where each ordinary one landed.
pub(super) fn reconstructed_start(
    allocator: &mut DeviceAllocator<SimDevice>,
    workload: &DeviceWorkload,
    pointers: &mut [u64],
    bases: &mut [Option<u64>],
) -> StartReport {
    let mut report = StartReport::default();
    let segments = &workload.start_segments;
    // Allocations per start segment, in address (so offset) order.
    let mut by_segment: Vec<Vec<&StartAllocation>> = vec![Vec::new(); segments.len()];
    let mut unplaced: Vec<&StartAllocation> = Vec::new();
    for allocation in &workload.start_allocations {
        match allocation.segment.and_then(|s| by_segment.get_mut(s)) {
            Some(list) => list.push(allocation),
            None => unplaced.push(allocation),
        }
    }
    // Allocations whose segment is unknown get segments of their own first, so that they do
    // not take the free space of the imported segments, which PyTorch's cache held.
    for allocation in unplaced {
        if allocate_start(allocator, allocation, pointers) {
            report.allocated_allocations += 1;
        } else {
            report.failures += 1;
        }
    }
    let mut misplaced: Vec<&StartAllocation> = Vec::new();
    let mut imported = vec![false; segments.len()];
    if allocator.config().expandable_segments {
        misplaced = import_expandable_segments(
            allocator,
            segments,
            &by_segment,
            pointers,
            &mut imported,
            &mut report,
        );
    }
    // Every segment once: the order given, then any it left out.
    let order = workload
        .start_order
        .iter()
        .copied()
        .chain(0..segments.len());
    for index in order.filter(|&i| i < segments.len()) {
        let (segment, allocations) = (&segments[index], &by_segment[index]);
        if imported[index] {
            continue;
        }
        imported[index] = true;
        let (fitting, rest) = fit_in_segment(segment, allocations);
        misplaced.extend(rest);
        let blocks: Vec<ImportedBlock> = fitting
            .iter()
            .map(|a| ImportedBlock {
                offset: a.offset as usize,
                size: a.size as usize,
                requested_size: requested_within_block(a),
            })
            .collect();
        // At PyTorch's address, where it is free: ties by address break as in PyTorch.
        allocator
            .device_mut()
            .prefer_next_address(Some(segment.address));
        let imported = usize::try_from(segment.size).ok().and_then(|size| {
            allocator
                .import_segment(size, segment.stream, segment.pool, &blocks)
                .ok()
        });
        allocator.device_mut().prefer_next_address(None);
        match imported {
            Some((base, placed)) => {
                bases[index] = Some(base);
                report.imported_segments += 1;
                report.placed_allocations += placed.len();
                for (allocation, ptr) in fitting.iter().zip(placed) {
                    if let Some(slot) = pointers.get_mut(allocation.id as usize) {
                        *slot = ptr;
                    }
                }
            }
            None => {
                report.failures += 1;
                misplaced.extend(fitting);
            }
        }
    }
    for allocation in misplaced {
        report.misplaced_allocations += 1;
        if allocate_start(allocator, allocation, pointers) {
            report.allocated_allocations += 1;
        } else {
            report.failures += 1;
        }
    }
    report
}

/// The mapped ranges of PyTorch's expandable segments, imported as expandable segments (one
/// per stream and pool, as PyTorch has them), so that the replay grows them as PyTorch did.
/// Each stream's ranges are mapped from the first to the end of the last, gaps included (a gap
/// is free mapped space in the replay, where PyTorch had unmapped it). Ranges that cannot be
/// imported so are left for [`reconstructed_start`] to import as ordinary segments. Returns
/// the allocations of imported ranges whose recorded place was impossible.
fn import_expandable_segments<'a>(
    allocator: &mut DeviceAllocator<SimDevice>,
    segments: &[StartSegment],
    by_segment: &[Vec<&'a StartAllocation>],
    pointers: &mut [u64],
    imported: &mut [bool],
    report: &mut StartReport,
) -> Vec<&'a StartAllocation> {
    let mut misplaced = Vec::new();
    let mut groups: Vec<((u64, crate::policy::PoolKind), Vec<usize>)> = Vec::new();
    for (index, segment) in segments.iter().enumerate() {
        if !segment.is_expandable {
            continue;
        }
        let key = (segment.stream, segment.pool);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(index),
            None => groups.push((key, vec![index])),
        }
    }
    for ((stream, pool), members) in groups {
        let first = segments[members[0]].address;
        let last = &segments[members[members.len() - 1]];
        let span = last.address.saturating_add(last.size) - first;
        let mut placed: Vec<&StartAllocation> = Vec::new();
        let mut unfit: Vec<&StartAllocation> = Vec::new();
        let mut blocks: Vec<ImportedBlock> = Vec::new();
        for &member in &members {
            let segment = &segments[member];
            let (fitting, rest) = fit_in_segment(segment, &by_segment[member]);
            unfit.extend(rest);
            for allocation in fitting {
                blocks.push(ImportedBlock {
                    offset: (segment.address - first + allocation.offset) as usize,
                    size: allocation.size as usize,
                    requested_size: requested_within_block(allocation),
                });
                placed.push(allocation);
            }
        }
        let Ok(span) = usize::try_from(span) else {
            continue;
        };
        let Ok((_, addresses)) = allocator.import_expandable_segment(span, stream, pool, &blocks)
        else {
            continue;
        };
        for &member in &members {
            imported[member] = true;
        }
        misplaced.extend(unfit);
        report.imported_segments += 1;
        report.placed_allocations += addresses.len();
        // Allocations whose recorded place was impossible are made by the caller's malloc.
        for (allocation, ptr) in placed.iter().zip(addresses) {
            if let Some(slot) = pointers.get_mut(allocation.id as usize) {
                *slot = ptr;
            }
        }
    }
    misplaced
}

/// An imported block's requested size: never more than the block (as in PyTorch; a hostile
/// snapshot's larger figure would overflow the statistics).
fn requested_within_block(allocation: &StartAllocation) -> usize {
    allocation.requested_size.min(allocation.size) as usize
}

/// Splits a segment's allocations into those whose recorded place is possible (aligned, inside
/// the segment, not overlapping the one before) and the rest.
fn fit_in_segment<'a>(
    segment: &StartSegment,
    allocations: &[&'a StartAllocation],
) -> (Vec<&'a StartAllocation>, Vec<&'a StartAllocation>) {
    let align = K_MIN_BLOCK_SIZE as u64;
    let mut fitting = Vec::with_capacity(allocations.len());
    let mut rest = Vec::new();
    let mut cursor = 0u64;
    for &allocation in allocations {
        let end = allocation.offset.checked_add(allocation.size);
        let fits = allocation.size > 0
            && allocation.offset >= cursor
            && allocation.offset.is_multiple_of(align)
            && allocation.size.is_multiple_of(align)
            && end.is_some_and(|end| end <= segment.size);
        if fits {
            cursor = allocation.offset + allocation.size;
            fitting.push(allocation);
        } else {
            rest.push(allocation);
        }
    }
    (fitting, rest)
}
