//! The lock around each device's allocator: one atomic read-modify-write to take it, a plain
//! store to give it back.
//!
//! A cache hit holds the lock for a few tens of nanoseconds, so the lock's own cost is a large
//! share of an allocation's. A mutex that puts waiters to sleep (parking_lot's, or the
//! `std::mutex` in PyTorch's allocator) needs a second read-modify-write on release to learn
//! whether anyone sleeps on it. Through the C ABI that second atomic cost about 5 ns of a 56 ns
//! malloc/free pair, the difference between meeting the host-cost target and missing it
//! (`docs/performance.md`; `cargo bench --bench allocator -- locked` compares the two locks
//! around the core alone).
//!
//! Here nobody is woken: a waiter spins for a while (the usual wait is one short critical
//! section), then yields, then sleeps in naps that grow to [`MAX_NAP`], looking at the lock
//! after each. So a release is a plain store; a thread that waits through a long critical
//! section (a `cudaMalloc`, a `cudaFree` that synchronizes, `empty_cache`) costs little CPU; and
//! it notices the release at most [`MAX_NAP`] late, which is small next to the device call it
//! waited for.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Checks of the lock, with a CPU pause between them, before a waiter starts to yield.
const SPINS: u32 = 256;
/// `sched_yield` calls before a waiter starts to sleep.
const YIELDS: u32 = 16;
/// The first nap; each next one is twice as long, up to [`MAX_NAP`].
const FIRST_NAP: Duration = Duration::from_micros(10);
/// The longest a waiter sleeps between two looks at the lock.
pub const MAX_NAP: Duration = Duration::from_micros(200);

/// A mutex whose release is a plain store; see the module documentation.
pub type SpinNapMutex<T> = lock_api::Mutex<RawSpinNapLock, T>;

/// The raw lock behind [`SpinNapMutex`].
pub struct RawSpinNapLock {
    locked: AtomicBool,
}

// SAFETY: the lock is held exactly while `locked` is true. `try_acquire` sets it only by a
// compare-exchange from false (so one thread at a time succeeds, with Acquire ordering), and
// only the holder clears it, in `unlock`, with Release ordering, so what the holder wrote is
// visible to the next one.
unsafe impl lock_api::RawMutex for RawSpinNapLock {
    #[allow(
        clippy::declare_interior_mutable_const,
        reason = "lock_api's way to initialise a lock in a static"
    )]
    const INIT: RawSpinNapLock = RawSpinNapLock {
        locked: AtomicBool::new(false),
    };

    // The lock belongs to no thread in particular: a guard may be released on another thread.
    type Guard = lock_api::GuardSend;

    #[inline]
    fn lock(&self) -> Self::Guard {
        if !self.try_acquire() {
            self.wait_and_acquire();
        }
        lock_api::GuardSend::new()
    }

    #[inline]
    fn try_lock(&self) -> Option<Self::Guard> {
        self.try_acquire().then(lock_api::GuardSend::new)
    }

    #[inline]
    unsafe fn unlock(&self, _guard: Self::Guard) {
        self.locked.store(false, Ordering::Release);
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
    }
}

impl RawSpinNapLock {
    #[inline]
    fn try_acquire(&self) -> bool {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// The slow path: waits until the lock looks free, then tries to take it, until it does.
    #[cold]
    #[inline(never)]
    fn wait_and_acquire(&self) {
        let mut waits = 0u32;
        loop {
            // Reading, not writing, while it is held keeps the cache line shared with the
            // holder instead of pulling it away on every look.
            while self.locked.load(Ordering::Relaxed) {
                wait(waits);
                waits = waits.saturating_add(1);
            }
            if self.try_acquire() {
                return;
            }
        }
    }
}

/// The `waits`-th pause of a waiter: a CPU pause, then a yield, then a growing nap.
fn wait(waits: u32) {
    if waits < SPINS {
        spin_loop();
    } else if waits < SPINS + YIELDS {
        std::thread::yield_now();
    } else {
        std::thread::sleep(nap(waits - SPINS - YIELDS));
    }
}

/// The length of the `n`-th nap (from 0).
fn nap(n: u32) -> Duration {
    FIRST_NAP.saturating_mul(1u32 << n.min(16)).min(MAX_NAP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    #[test]
    fn threads_never_hold_it_together() {
        // A read-modify-write split in two: a second holder at the same time loses updates.
        let counter = Arc::new(SpinNapMutex::new(0u64));
        let inside = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (counter, inside) = (counter.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut guard = counter.lock();
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                        let value = *guard;
                        std::hint::black_box(&value);
                        *guard = value + 1;
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("no thread panicked");
        }
        assert_eq!(*counter.lock(), 80_000);
    }

    #[test]
    fn a_waiter_gets_it_after_a_long_hold() {
        let lock = Arc::new(SpinNapMutex::new(()));
        let guard = lock.lock();
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let _guard = lock.lock();
                Instant::now()
            })
        };
        // Long enough for the waiter to be napping.
        std::thread::sleep(Duration::from_millis(50));
        assert!(lock.is_locked());
        let released = Instant::now();
        drop(guard);
        let acquired = waiter.join().expect("the waiter ran");
        assert!(
            acquired >= released,
            "the waiter got the lock while it was held"
        );
        assert!(!lock.is_locked());
    }

    #[test]
    fn try_lock_fails_while_held() {
        let lock = SpinNapMutex::new(());
        let guard = lock.try_lock().expect("free at first");
        assert!(lock.try_lock().is_none());
        drop(guard);
        assert!(lock.try_lock().is_some());
    }

    #[test]
    fn naps_grow_to_the_limit() {
        assert_eq!(nap(0), FIRST_NAP);
        assert_eq!(nap(1), FIRST_NAP * 2);
        assert_eq!(nap(40), MAX_NAP);
        assert!((0..40).all(|n| nap(n) <= nap(n + 1)));
    }
}
