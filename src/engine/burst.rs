//! Bursts: work that comes close together, and what the engine does differently then.
//!
//! tar, rsync, a compiler or git close a small file every few hundred microseconds; seed 000's
//! writers (a configuration tool, an editor) close one and wait. Two choices depend on which:
//! whether a close goes to the log, and a new file is held for it (`LogCloses::Auto`: a lone
//! close does, and costs its sectors; a close in a burst writes to the backend, where the
//! backing file system's one journal commit shares the creations of the whole burst and the
//! log's second copy of every byte would be the larger cost), and whether a log batch nobody
//! waits to see flushed goes through the page cache (`IntentLog`: a direct write would make
//! each close of a burst wait for the device).
//!
//! Owns: the gap that makes a burst, and a lock-free record of when something last happened.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Events this close together are one burst, unless `-o burst_gap=` says otherwise: tar's
/// closes come a few hundred microseconds apart, an editor's seconds.
pub const BURST_GAP: Duration = Duration::from_millis(2);

/// When an event of one kind last happened, noted and read without a lock by every thread.
pub struct LastEvent {
    since: Instant,
    /// Nanoseconds from `since` to the last event; `NEVER` before the first.
    at_nanos: AtomicU64,
    /// Events less than this apart are one burst.
    gap_nanos: u64,
}

const NEVER: u64 = u64::MAX;

impl Default for LastEvent {
    fn default() -> Self {
        LastEvent::with_gap(BURST_GAP)
    }
}

impl LastEvent {
    pub fn with_gap(gap: Duration) -> LastEvent {
        let gap_nanos = u64::try_from(gap.as_nanos()).unwrap_or(NEVER - 1);
        LastEvent { since: Instant::now(), at_nanos: AtomicU64::new(NEVER), gap_nanos }
    }

    fn now_nanos(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(NEVER - 1)
    }

    /// The event happened now; returns whether the one before it was less than the gap ago.
    pub fn note(&self) -> bool {
        self.note_at(self.now_nanos())
    }

    /// Whether the last event was less than the gap ago.
    pub fn within_burst(&self) -> bool {
        self.within_burst_at(self.now_nanos())
    }

    fn note_at(&self, now: u64) -> bool {
        let before = self.at_nanos.swap(now, Relaxed);
        before != NEVER && now.saturating_sub(before) < self.gap_nanos
    }

    fn within_burst_at(&self, now: u64) -> bool {
        let at = self.at_nanos.load(Relaxed);
        // Noted by another thread after `now` was read: that is no gap at all.
        at != NEVER && now.saturating_sub(at) < self.gap_nanos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GAP_NANOS: u64 = BURST_GAP.as_nanos() as u64;

    /// On the event's own clock: a test that reads the real one fails when the machine stalls
    /// it past the gap between two calls.
    #[test]
    fn an_event_is_a_burst_until_the_gap_has_passed() {
        let last = LastEvent::default();
        assert!(!last.within_burst_at(0), "nothing happened yet");
        assert!(!last.note_at(1_000), "the first event follows none");
        assert!(last.within_burst_at(1_000 + GAP_NANOS - 1));
        assert!(last.note_at(1_000 + GAP_NANOS - 1), "the second, within the gap, is in its burst");
        let after = 1_000 + 2 * GAP_NANOS;
        assert!(!last.within_burst_at(after));
        assert!(!last.note_at(after), "an event after the gap starts no burst with the one before");
        assert!(last.within_burst_at(after - 5), "an event noted after the moment read is no gap");
    }

    #[test]
    fn the_real_clock_notes_events() {
        let last = LastEvent::default();
        assert!(!last.note());
        std::thread::sleep(BURST_GAP + Duration::from_millis(1));
        assert!(!last.within_burst(), "the gap passed on the real clock");
    }
}
