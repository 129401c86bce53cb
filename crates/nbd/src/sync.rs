//! The lock-poisoning policy of the NBD server and the binary's control socket, written down
//! once.
//!
//! A lock is poisoned when a thread panicked while holding it. The panic itself is a bug and
//! is reported where it happens (the thread's panic message; a connection thread's panic ends
//! that connection only). What the other threads should do depends on what the lock protects:
//!
//! - **Recover the guard** ([`lock`], [`read`], [`write()`], [`wait`], [`wait_timeout`]) where
//!   every change made under the lock is one step that cannot be seen half-done: tables of
//!   connections and listeners (one insert or remove), the export map, a budget's counters
//!   (checked by assertions before they change), a memory export's blocks. Recovering keeps
//!   one connection's panic from taking every other connection, the shutdown path, or a
//!   `Drop` (where a second panic aborts the process) down with it.
//! - **End what the lock belongs to** where a panic can leave the protected thing mid-change:
//!   a connection's input (a request half-read) and its reply stream (a reply half-written).
//!   There the session stops reading, or marks the connection broken and shuts the socket,
//!   instead of serving on from a torn stream; see `session.rs` (the input lock) and `session/dispatch.rs` (the writer lock).
//!
//! Plain `expect` on a lock result is not used in this crate or the binary.

use std::sync::{
    Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, WaitTimeoutResult,
};
use std::time::Duration;

/// Locks `mutex`, taking the guard even if a panicking thread poisoned it. Only for data whose
/// every change under the lock is one step (see the module docs).
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Read-locks `lock`, recovering from poisoning as [`lock`] does.
pub fn read<T: ?Sized>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Write-locks `lock`, recovering from poisoning as [`lock`] does.
pub fn write<T: ?Sized>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits on `condvar`, recovering from poisoning as [`lock`] does.
pub fn wait<'a, T>(condvar: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    condvar
        .wait(guard)
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits on `condvar` for at most `timeout`, recovering from poisoning as [`lock`] does.
pub fn wait_timeout<'a, T>(
    condvar: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
    condvar
        .wait_timeout(guard, timeout)
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_poisoned_lock_still_gives_its_data() {
        let table = Arc::new(Mutex::new(vec![1, 2]));
        let poisoner = Arc::clone(&table);
        let panicked = std::thread::spawn(move || {
            let _guard = poisoner.lock().unwrap();
            panic!("poison the lock on purpose");
        })
        .join();
        assert!(panicked.is_err());
        assert!(table.is_poisoned());
        lock(&table).push(3);
        assert_eq!(*lock(&table), [1, 2, 3]);

        let map = Arc::new(RwLock::new(1));
        let poisoner = Arc::clone(&map);
        let panicked = std::thread::spawn(move || {
            let _guard = poisoner.write().unwrap();
            panic!("poison the lock on purpose");
        })
        .join();
        assert!(panicked.is_err());
        *write(&map) += 1;
        assert_eq!(*read(&map), 2);
    }
}
