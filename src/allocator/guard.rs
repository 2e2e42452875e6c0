//! The guard in front of the device: the one door every device allocation passes (a new
//! segment, pages grown into an expandable segment for the request's stream or for another's,
//! and a wake), as RMM's `limiting_resource_adaptor` stands in front of its upstream.
//!
//! Two of PyTorch's limits, checked in PyTorch's order (`alloc_block`):
//! - the memory fraction (`set_per_process_memory_fraction`): reserved bytes plus the
//!   allocation must stay within `allowed_memory_maximum`; a refusal is an ordinary failed
//!   device allocation (the caller releases cached blocks and retries);
//! - `throw_on_cudamalloc_oom`: reserved bytes plus the allocation must stay within the
//!   configured fraction of the device ([`policy::preemptive_rejection_limit`]); a refusal is
//!   counted (`num_oom_rejections`), logged with PyTorch's warning and remembered for the
//!   malloc under way, which then fails at once.
//!
//! The guard only decides; the ledger ([`super::ledger`]) counts what was obtained.

use super::stats::DeviceStats;
use crate::config::Config;
use crate::device::{Device, DeviceError};
use crate::logging;
use crate::policy;

/// Why the guard refused a device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Past the memory-fraction limit `allowed` (bytes).
    OverMemoryFraction { allowed: usize },
    /// Past `throw_on_cudamalloc_oom`'s limit (bytes): a preemptive rejection.
    Rejected { limit: usize },
}

/// Whether a preemptive rejection is the caller's answer (counted, warned, remembered) or
/// only a reason to try another way first (the malloc's own device allocation follows and
/// answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Announce {
    Yes,
    Quietly,
}

/// The limits and what they need to know.
#[derive(Debug, Default)]
pub(crate) struct Guard {
    /// The memory-fraction limit, once `set_memory_fraction` was called.
    pub(crate) allowed_memory_maximum: Option<usize>,
    /// The device's total memory, asked once (the preemptive-rejection limit).
    device_total: Option<usize>,
    /// Set when `throw_on_cudamalloc_oom` refused a device allocation during the current
    /// `malloc` (PyTorch's `AllocParams` flag): the malloc then fails with the rejection.
    pub(crate) preemptively_rejected: bool,
}

impl Guard {
    /// PyTorch's memory fraction (`alloc_block`:
    /// `set_fraction && total_allocated_memory + size > allowed_memory_maximum`): the limit,
    /// when reserving `size` more bytes past `reserved` would exceed it.
    #[inline]
    pub(crate) fn over_fraction(&self, reserved: usize, size: usize) -> Option<usize> {
        self.allowed_memory_maximum
            .filter(|&allowed| reserved + size > allowed)
    }

    /// Whether a device allocation of `size` bytes, with `reserved` held now, may go ahead:
    /// the memory fraction first, then `throw_on_cudamalloc_oom`.
    pub(crate) fn admit<D: Device>(
        &mut self,
        device: &mut D,
        config: &Config,
        stats: &mut DeviceStats,
        reserved: usize,
        size: usize,
        announce: Announce,
    ) -> Result<Result<(), Refusal>, DeviceError> {
        if let Some(allowed) = self.over_fraction(reserved, size) {
            return Ok(Err(Refusal::OverMemoryFraction { allowed }));
        }
        if !config.throw_on_cudamalloc_oom {
            return Ok(Ok(()));
        }
        let device_total = self.device_total(device)?;
        let Some(limit) = policy::preemptive_rejection_limit(config, device_total) else {
            return Ok(Ok(()));
        };
        if reserved + size <= limit {
            return Ok(Ok(()));
        }
        if announce == Announce::Yes {
            stats.num_oom_rejections += 1;
            self.preemptively_rejected = true;
            logging::warning(&policy::preemptive_rejection_warning(
                size,
                reserved,
                limit,
                config.per_process_memory_fraction.unwrap_or(1.0),
                device_total,
            ));
        }
        Ok(Err(Refusal::Rejected { limit }))
    }

    /// The device's total memory, asked of the device once.
    pub(crate) fn device_total<D: Device>(&mut self, device: &mut D) -> Result<usize, DeviceError> {
        if let Some(total) = self.device_total {
            return Ok(total);
        }
        let total = device.mem_get_info()?.total;
        self.device_total = Some(total);
        Ok(total)
    }
}
