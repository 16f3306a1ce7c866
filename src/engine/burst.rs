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
//! Owns: the gap that makes a burst, a lock-free record of when something last happened, and
//! the application's rhythm of closes and fsyncs the engine chooses by (`Bursts`).

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

/// What the engine knows of an application's rhythm: when it last closed a file open for
/// writing, when it last fsynced one, and whether that close came right after the fsync.
pub struct Bursts {
    last_close: LastEvent,
    last_fsync: LastEvent,
    /// The last close came right after an fsync (within the gap): a burst of such closes is a
    /// burst of fsynced files (dpkg, a maildir, git with core.fsync), whose new files the log
    /// holds, unlike tar's and rsync's, which fsync nothing.
    last_close_fsynced: std::sync::atomic::AtomicBool,
}

impl Bursts {
    pub fn with_gap(gap: Duration) -> Bursts {
        Bursts {
            last_close: LastEvent::with_gap(gap),
            last_fsync: LastEvent::with_gap(gap),
            last_close_fsynced: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// An fsync or fdatasync happened now.
    pub fn fsynced(&self) {
        self.last_fsync.note();
    }

    /// A close of a file open for writing happened now; returns whether it comes in a burst of
    /// closes.
    pub fn closed(&self) -> bool {
        let in_burst = self.last_close.note();
        self.last_close_fsynced.store(self.last_fsync.within_burst(), Relaxed);
        in_burst
    }

    /// Whether now is in a burst of closes that do not each follow an fsync (tar, rsync).
    pub fn in_close_burst_without_fsyncs(&self) -> bool {
        self.last_close.within_burst() && !self.last_close_fsynced.load(Relaxed)
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

    /// With a gap no test run reaches: closes one after the other are a burst, and a burst of
    /// fsynced files (each close right after an fsync) is not one of tar's.
    #[test]
    fn closes_right_after_fsyncs_are_not_a_burst_of_unfsynced_closes() {
        let hour = Duration::from_secs(3600);
        let tar = Bursts::with_gap(hour);
        assert!(!tar.closed(), "the first close follows nothing");
        assert!(tar.closed());
        assert!(tar.in_close_burst_without_fsyncs());
        let dpkg = Bursts::with_gap(hour);
        dpkg.fsynced();
        dpkg.closed();
        dpkg.fsynced();
        assert!(dpkg.closed(), "still a burst of closes");
        assert!(!dpkg.in_close_burst_without_fsyncs(), "each close followed an fsync");
    }
}
