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
//!
//! A holder that panics poisons the lock for good, as `std::sync::Mutex` does, but with no way
//! back: the allocator it guards may be half-updated (a merge under way, a block out of its
//! pool), and serving from it could hand out memory twice. The guard's drop reads
//! `std::thread::panicking()`, one process-wide counter, so a release stays one store;
//! [`SpinNapGuard::unlock`] skips even that read, for a caller that gives the lock back
//! explicitly (a panic's unwinding never reaches that call, so drop still poisons).

use std::cell::UnsafeCell;
use std::fmt;
use std::hint::spin_loop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

/// Checks of the lock, with a CPU pause between them, before a waiter starts to yield.
const SPINS: u32 = 256;
/// `sched_yield` calls before a waiter starts to sleep.
const YIELDS: u32 = 16;
/// The first nap; each next one is twice as long, up to [`MAX_NAP`].
const FIRST_NAP: Duration = Duration::from_micros(10);
/// The longest a waiter sleeps between two looks at the lock.
pub const MAX_NAP: Duration = Duration::from_micros(200);

/// Nobody holds the lock.
const FREE: u8 = 0;
/// A thread holds the lock.
const HELD: u8 = 1;
/// A holder panicked: what the lock guards may be half-updated, and nobody takes it again.
const POISONED: u8 = 2;

/// A mutex whose release is a plain store, and which a panic poisons for good; see the module
/// documentation.
pub struct SpinNapMutex<T> {
    state: AtomicU8,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and one guard exists at a time: `state`
// goes from FREE to HELD by a compare-exchange (one thread at a time succeeds, with Acquire
// ordering), and only the guard's drop leaves HELD, with Release ordering, so what the holder
// wrote is visible to the next one. A value that may go to another thread needs `T: Send`.
unsafe impl<T: Send> Send for SpinNapMutex<T> {}
// SAFETY: as above: shared references to the mutex hand out the value to one thread at a time.
unsafe impl<T: Send> Sync for SpinNapMutex<T> {}

/// The lock was given up by a thread that panicked while holding it: the value may be
/// half-updated, and is never handed out again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Poisoned;

impl fmt::Display for Poisoned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a thread panicked while holding the lock")
    }
}

impl std::error::Error for Poisoned {}

impl<T> SpinNapMutex<T> {
    pub const fn new(value: T) -> SpinNapMutex<T> {
        SpinNapMutex {
            state: AtomicU8::new(FREE),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for it; [`Poisoned`] once a holder panicked.
    #[inline]
    pub fn lock(&self) -> Result<SpinNapGuard<'_, T>, Poisoned> {
        // The usual case is one compare-exchange; a poisoned lock fails it too, and the slow
        // path says so.
        if !self.try_acquire() {
            self.wait_and_acquire()?;
        }
        Ok(SpinNapGuard { mutex: self })
    }

    /// Takes the lock if it is free now; `None` while another thread holds it.
    #[inline]
    pub fn try_lock(&self) -> Option<Result<SpinNapGuard<'_, T>, Poisoned>> {
        if self.try_acquire() {
            return Some(Ok(SpinNapGuard { mutex: self }));
        }
        match self.state.load(Ordering::Relaxed) {
            POISONED => Some(Err(Poisoned)),
            _ => None,
        }
    }

    pub fn is_locked(&self) -> bool {
        self.state.load(Ordering::Relaxed) == HELD
    }

    pub fn is_poisoned(&self) -> bool {
        self.state.load(Ordering::Relaxed) == POISONED
    }

    #[inline]
    fn try_acquire(&self) -> bool {
        self.state
            .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// The slow path: waits until the lock looks free, then tries to take it, until it does
    /// or finds it poisoned.
    #[cold]
    #[inline(never)]
    fn wait_and_acquire(&self) -> Result<(), Poisoned> {
        let mut waits = 0u32;
        loop {
            // Reading, not writing, while it is held keeps the cache line shared with the
            // holder instead of pulling it away on every look.
            loop {
                match self.state.load(Ordering::Relaxed) {
                    HELD => {
                        wait(waits);
                        waits = waits.saturating_add(1);
                    }
                    POISONED => return Err(Poisoned),
                    _ => break,
                }
            }
            if self.try_acquire() {
                return Ok(());
            }
        }
    }
}

/// The lock held; released when dropped, and poisoned when dropped by a panic's unwinding.
pub struct SpinNapGuard<'a, T> {
    mutex: &'a SpinNapMutex<T>,
}

impl<T> SpinNapGuard<'_, T> {
    /// Gives the lock back: one store, with no look at whether this thread panics. A guard
    /// dropped instead (at the end of its scope, or by a panic's unwinding, which never reaches
    /// this call) asks that, and poisons the lock when it does; the hot paths of the C ABI call
    /// this to skip the question where the answer is known to be no.
    #[inline]
    pub fn unlock(self) {
        self.mutex.state.store(FREE, Ordering::Release);
        std::mem::forget(self);
    }
}

impl<T> Drop for SpinNapGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // `panicking` reads one process-wide counter while no thread panics.
        let next = if std::thread::panicking() {
            POISONED
        } else {
            FREE
        };
        self.mutex.state.store(next, Ordering::Release);
    }
}

impl<T> Deref for SpinNapGuard<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock, so no other reference to the value exists.
        unsafe { &*self.mutex.value.get() }
    }
}

impl<T> DerefMut for SpinNapGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock, so no other reference to the value exists.
        unsafe { &mut *self.mutex.value.get() }
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
                        let mut guard = counter.lock().expect("nobody panicked");
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
        assert_eq!(*counter.lock().expect("nobody panicked"), 80_000);
    }

    #[test]
    fn a_waiter_gets_it_after_a_long_hold() {
        let lock = Arc::new(SpinNapMutex::new(()));
        let guard = lock.lock().expect("nobody panicked");
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let _guard = lock.lock().expect("nobody panicked");
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
    fn a_panic_while_holding_it_poisons_it_for_every_later_taker() {
        let lock = Arc::new(SpinNapMutex::new(0u32));
        let holder = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let mut guard = lock.lock().expect("nobody panicked yet");
                *guard = 1;
                panic!("half-way through an update");
            })
        };
        assert!(holder.join().is_err(), "the holder panicked");
        assert!(lock.is_poisoned());
        assert_eq!(lock.lock().err(), Some(Poisoned));
        assert!(matches!(lock.try_lock(), Some(Err(Poisoned))));
        // A waiter that was already waiting learns it too.
        let waiting = Arc::new(SpinNapMutex::new(()));
        let guard = waiting.lock().expect("free");
        let waiter = {
            let waiting = waiting.clone();
            std::thread::spawn(move || waiting.lock().map(|_| ()))
        };
        std::thread::sleep(Duration::from_millis(20));
        let poisoner = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _guard = guard;
            panic!("while a waiter waits");
        }));
        assert!(poisoner.is_err());
        assert_eq!(waiter.join().expect("the waiter ran"), Err(Poisoned));
    }

    #[test]
    fn a_panic_before_an_explicit_unlock_still_poisons_it() {
        let lock = SpinNapMutex::new(0u32);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut guard = lock.lock().expect("free");
            *guard += 1;
            if *guard == 1 {
                panic!("before the unlock");
            }
            guard.unlock();
        }));
        assert!(caught.is_err());
        assert_eq!(lock.lock().err(), Some(Poisoned));
    }

    #[test]
    fn an_explicit_unlock_frees_it_for_the_next_taker() {
        let lock = SpinNapMutex::new(0u32);
        let mut guard = lock.lock().expect("free");
        *guard += 1;
        guard.unlock();
        assert!(!lock.is_locked());
        assert_eq!(*lock.lock().expect("not poisoned"), 1);
    }

    #[test]
    fn a_panic_caught_outside_the_lock_leaves_it_usable() {
        let lock = SpinNapMutex::new(0u32);
        *lock.lock().expect("free") += 1;
        let caught = std::panic::catch_unwind(|| panic!("no lock held"));
        assert!(caught.is_err());
        assert_eq!(*lock.lock().expect("not poisoned"), 1);
    }

    #[test]
    fn naps_grow_to_the_limit() {
        assert_eq!(nap(0), FIRST_NAP);
        assert_eq!(nap(1), FIRST_NAP * 2);
        assert_eq!(nap(40), MAX_NAP);
        assert!((0..40).all(|n| nap(n) <= nap(n + 1)));
    }
}
