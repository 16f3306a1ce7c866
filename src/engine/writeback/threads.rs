//! The writeback's threads: the flushers and the timers (the age timer, the checkpointer), how
//! a timer pauses between its rounds, and how they are all told to stop and joined.
//!
//! Owns: the stop flag every loop reads, the timers' wake-up, the join handles.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::lock;

#[derive(Default)]
pub(super) struct Threads {
    stopping: AtomicBool,
    /// Set when `stopping` is, under this lock, so that a timer thread's pause ends at once
    /// (an abandoned engine's threads are joined: a crash test starts several engines per case).
    timers_stopped: Mutex<bool>,
    timers_wake: Condvar,
    /// Joined at shut-down, so that each flusher's resources are gone before the daemon exits.
    flushers: Mutex<Vec<JoinHandle<()>>>,
    /// The age timer and the checkpointer, joined when the engine is abandoned.
    timers: Mutex<Vec<JoinHandle<()>>>,
}

impl Threads {
    /// Whether the threads were told to stop (a flusher then ends once its queue is empty).
    pub(super) fn stopping(&self) -> bool {
        self.stopping.load(Relaxed)
    }

    /// Tells every thread to stop: the flushers at their next look at the queue (the caller
    /// wakes them), the timers at once.
    pub(super) fn stop(&self) {
        self.stopping.store(true, Relaxed);
        *lock(&self.timers_stopped) = true;
        self.timers_wake.notify_all();
    }

    /// A timer thread's pause between its rounds: false, at once, when the threads stop.
    pub(super) fn pause_unless_stopped(&self, pause: Duration) -> bool {
        let stopped = lock(&self.timers_stopped);
        let (stopped, _) = self.timers_wake.wait_timeout_while(stopped, pause, |stopped| !*stopped).unwrap();
        !*stopped
    }

    pub(super) fn add_flusher(&self, thread: JoinHandle<()>) {
        lock(&self.flushers).push(thread);
    }

    pub(super) fn add_timer(&self, thread: JoinHandle<()>) {
        lock(&self.timers).push(thread);
    }

    /// The flushers' handles, for the caller to join (or leave behind).
    pub(super) fn take_flushers(&self) -> Vec<JoinHandle<()>> {
        lock(&self.flushers).drain(..).collect()
    }

    /// Every thread's handle, flushers first.
    pub(super) fn take_all(&self) -> Vec<JoinHandle<()>> {
        let mut all = self.take_flushers();
        all.extend(lock(&self.timers).drain(..));
        all
    }
}
