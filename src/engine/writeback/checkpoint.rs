//! The checkpoint, which writes everything buffered to the store, syncs it once and releases
//! the intent log's records, and the ends of a mount: forgetting files, a whole sync, shut-down.
//! What an fsync or close logs before a checkpoint is `durability`'s.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

impl Writeback {
    /// Before a sync of the whole backend: the files made ahead for held files made alone are
    /// refilled, and those used give back what they did not (`Namespace::prepare_files`). A
    /// failure costs only the saving: held files are then made as any other.
    fn prepare_files(&self) {
        if self.pending.is_none() {
            return;
        }
        let bytes = bytes_made_ahead(self.config.unit_bytes);
        if let Err(e) = self.ns.prepare_files(FILES_MADE_AHEAD, bytes) {
            log::warn!(
                "making files ahead on the backend: {e}; new files are made one by one until the next checkpoint"
            );
        }
    }

    /// Writes everything buffered to the backend, syncs the backend file system once, and
    /// releases the log records that held it. Order matters; see SEMANTICS.md.
    pub fn checkpoint(&self) -> SysResult<()> {
        let Some(log) = &self.log else { return Ok(()) };
        let _one_at_a_time = lock(&self.checkpointing);
        let take_backs = log.take_backs_so_far();
        // The queued name records go into the log first, in a batch this checkpoint releases:
        // each change was made on the backend before it was queued, so the sync below makes it
        // durable there. Written after the release point, they would outlive the checkpoint (a
        // clean unmount would leave a batch for the next mount, which called it unclean).
        // Dropping them instead is not safe: a concurrent fsync may be acknowledged by a batch
        // holding a new file's bytes before that sync has made the file's creation durable.
        match log.commit(Vec::new()) {
            // No room for them: the sync below makes them durable on the backend anyway.
            Ok(()) | Err(LogError::Full { .. }) => {}
            Err(e) => {
                log::error!("committing queued name changes to the intent log: {e}");
                return Err(Errno(libc::EIO));
            }
        }
        let release_before = log.next_seq();
        let started = Instant::now();
        self.flush_every_file(ErrorReport::Checkpoint)?;
        let flushed_at = Instant::now();
        // Held files whose records this checkpoint releases are made on the backend, in
        // directory order; an fsync or close of one waits for the release (replay finds such
        // a file by the name its records leave it with, and would put its older held bytes
        // over newer ones), a rename or unlink settles it first (`settle_made`).
        let held = self.pending.as_ref().filter(|held| held.any_to_settle());
        let _until_released = held.map(|held| held.release_gate.write().unwrap());
        if let Some(held) = held {
            // Names held files took over backend files: their Unlink records are in the log
            // (committed with the renames, before the release point), so the backend may lose
            // them now, and the held files take them.
            let unlinked = held.make_all(release_before).inspect_err(|e| {
                log::error!("making new files on the backend at a checkpoint: {e}; the log keeps them");
            })?;
            for id in unlinked {
                if self.is_lingering(id) && self.has_no_name(id) {
                    self.forget_file(id);
                }
            }
        }
        let made_at = Instant::now();
        let flushed: Vec<(u64, u64)> =
            lock(&self.durability).iter().map(|(&ino, d)| (ino, d.backend_changes)).collect();
        self.prepare_files();
        if self.store.capabilities().keeps_replay_watermark {
            // Everything the batches before `release_before` hold is in the store now: the sync
            // below commits that with it, so a crash before the log's release below replays
            // from here, not the whole checkpoint again (contract rule 7).
            self.ns.set_replay_watermark(Some(release_before)).inspect_err(|e| {
                log::error!("recording the replay watermark in the store: {e}");
            })?;
        }
        self.sync_backend()?;
        let synced_at = Instant::now();
        log.checkpoint(release_before).map_err(|e| {
            log::error!("{e}");
            Errno(libc::EIO)
        })?;
        log::debug!(
            "checkpoint: batches before {release_before} released; flush {:?}, held files made {:?}, backend sync \
             {:?}, log release {:?}",
            flushed_at - started,
            made_at - flushed_at,
            synced_at - made_at,
            synced_at.elapsed()
        );
        log.forget_take_backs_before(take_backs);
        if let Some(held) = &self.pending {
            held.checkpoint_released(release_before);
        }
        let mut d = lock(&self.durability);
        for (ino, changes) in flushed {
            if let Some(entry) = d.get_mut(&ino) {
                entry.created = false;
                entry.named_in = None;
                // Synced backend bytes may be newer than records of the file the log still
                // holds: replay would put those older records over them. Such a file stays
                // ineligible until an fsync syncs it and writes a barrier (the crash harness
                // found the older bytes back after a log fsync that had nothing left to log).
                if entry.logged_before_seq <= release_before {
                    entry.logged_before_seq = 0;
                    entry.synced_changes = entry.synced_changes.max(changes);
                }
            }
        }
        let mut forgets_due = Vec::new();
        d.retain(|&ino, e| {
            let keep = e.created || !e.backend_in_sync() || e.logged_before_seq > 0;
            if !keep && e.forgets_held_back > 0 {
                forgets_due.push((ino, e.forgets_held_back));
            }
            keep
        });
        drop(d);
        for (ino, lookups) in forgets_due {
            self.ns.forget(ino, lookups);
        }
        Ok(())
    }

    /// The kernel dropped `lookups` lookups of `ino`. A file with a durability entry that can
    /// be looked up again keeps them until the entry goes: at zero lookups the namespace may
    /// end the id, and the file, looked up again, come back under another one (where the
    /// backend cannot keep an id the engine chose), whose fsync would find no entry and be
    /// answered by the log over backend changes no sync had made durable. A file with no name
    /// left lets them all go at once: nothing can look it up, and the backend frees its space
    /// only when the last lookup goes (the full-disk tests wait for that).
    pub fn forget(&self, ino: u64, lookups: u64) {
        // One lock for the many files with no entry.
        if !lock(&self.durability).contains_key(&ino) {
            return self.ns.forget(ino, lookups);
        }
        // The name is asked for outside the map's lock: a held file's answer takes its body's
        // lock, under which a log commit takes the map's.
        let named = !self.has_no_name(ino);
        let held_back = match lock(&self.durability).get_mut(&ino) {
            Some(entry) if named => {
                entry.forgets_held_back += lookups;
                return;
            }
            Some(entry) => std::mem::take(&mut entry.forgets_held_back),
            None => 0,
        };
        self.ns.forget(ino, lookups + held_back);
    }

    /// The files with write state now, taken out of the lock so each can be worked on alone.
    pub(super) fn open_files(&self) -> Vec<Arc<FileState>> {
        lock(&self.files).values().cloned().collect()
    }

    /// Every buffered unit of every file written to the backend (not synced), each file waited for.
    pub(super) fn flush_every_file(&self, report: ErrorReport) -> SysResult<()> {
        for file in self.open_files() {
            self.flush_file(&file, None, report)?;
        }
        Ok(())
    }

    /// Every buffered unit written to the backend and the backend synced once: a checkpoint
    /// where there is a log.
    /// Whether the intent log holds batches a next mount would replay.
    pub fn log_holds_records(&self) -> bool {
        self.log.as_ref().is_some_and(|log| log.holds_batches())
    }

    pub fn sync_all(&self) -> SysResult<()> {
        if self.log.is_some() {
            return self.checkpoint();
        }
        self.flush_every_file(ErrorReport::Sync)?;
        self.sync_backend()
    }

    /// Checkpoints when the log is half full, the durability map holds more than
    /// `DURABILITY_ENTRIES_BEFORE_CHECKPOINT` files or the held files more than
    /// `HELD_BYTES_BEFORE_CHECKPOINT` bytes; and, while the log holds anything or a file waits
    /// for a backend sync, once nothing has been logged for `checkpoint_idle` or at the latest
    /// `checkpoint_interval` after the last one. A checkpoint's fixed cost (a journal commit of
    /// the backing file system, a database commit) is the same whatever it carries, and a file
    /// rewritten again before it is written once: a trickle of fsyncs shares one checkpoint
    /// every `checkpoint_interval`, a burst reaches the store `checkpoint_idle` after it ends.
    /// Between checkpoints, the batches of closes (which flush nothing) are flushed to the
    /// log's device within `checkpoint_idle`.
    pub(super) fn checkpoint_loop(&self) {
        let log = self.log.as_ref().expect("the checkpointer runs with a log");
        // The first ones: their creation shares the backend's next sync with whatever comes.
        self.prepare_files();
        let tick = Duration::from_millis(100).min(self.config.checkpoint_interval).min(self.config.checkpoint_idle);
        let mut last_checkpoint = Instant::now();
        let mut last_flush = Instant::now();
        let (mut seen_seq, mut last_logged) = (log.next_seq(), Instant::now());
        while self.threads.pause_unless_stopped(tick) {
            // Name changes the volatile tail keeps reach the log within a journal's commit
            // interval when no batch comes to carry them.
            if log.volatile_names_age().is_some_and(|age| age >= VOLATILE_NAMES_MAX_AGE) {
                if let Err(e) = log.commit_written(Vec::new()) {
                    log::warn!("writing the volatile tail's name changes to the intent log: {e}; tried again");
                }
            }
            let seq = log.next_seq();
            if seq != seen_seq {
                (seen_seq, last_logged) = (seq, Instant::now());
            }
            let entries = lock(&self.durability).len();
            let held_bytes = self.pending.as_ref().map_or(0, |held| held.bytes_held());
            let waiting = log.holds_batches() || entries > 0;
            let quiet_since = last_logged.max(last_checkpoint);
            let due = log.used_fraction() > 0.5
                || entries > DURABILITY_ENTRIES_BEFORE_CHECKPOINT
                || held_bytes > HELD_BYTES_BEFORE_CHECKPOINT
                || (waiting
                    && (last_checkpoint.elapsed() >= self.config.checkpoint_interval
                        || quiet_since.elapsed() >= self.config.checkpoint_idle));
            if due {
                if let Err(e) = self.checkpoint() {
                    log::warn!("checkpoint failed ({e}); the log keeps its records and it is tried again");
                }
                (last_checkpoint, last_flush) = (Instant::now(), Instant::now());
            } else if last_flush.elapsed() >= self.config.checkpoint_idle {
                if let Err(e) = log.flush_written_batches() {
                    log::warn!(
                        "flushing the intent log's device failed ({e}); the next fsync or checkpoint tries again"
                    );
                }
                last_flush = Instant::now();
            }
        }
    }

    /// For in-process tests: every thread stopped as a killed daemon's would be, nothing more
    /// written; the buffer and the log's queue are dropped with the engine. A flush under way
    /// finishes first (it was issued before the "crash").
    pub fn abandon(&self) {
        self.threads.stop();
        lock(&self.queue).clear();
        self.queue_ready.notify_all();
        self.stop_near_flushers();
        for thread in self.threads.take_all() {
            let _ = thread.join();
        }
        *lock(&self.shut_down_report) = Some(ShutDown::default());
    }

    /// At unmount: every file's buffered data written and synced, each given `io_timeout`
    /// without progress at most (so a backend that answers nothing cannot hold the daemon);
    /// then the last checkpoint (without the log, a sync of the backend); then the threads
    /// stopped. Returns what could not be written, per file, and whether the closing sync
    /// failed; computed once (later calls return the same).
    pub fn shut_down(&self) -> ShutDown {
        let mut report = lock(&self.shut_down_report);
        if let Some(done) = &*report {
            return done.clone();
        }
        let mut unwritten = Vec::new();
        let deadline = Instant::now() + self.config.io_timeout;
        for file in self.open_files() {
            // Past the deadline the backend has shown it takes nothing: no more waiting.
            let result = if Instant::now() < deadline {
                self.flush_file(&file, Some(true), ErrorReport::Sync)
            } else {
                Err(Errno(libc::EIO))
            };
            let Err(e) = result else { continue };
            let inner = lock(&file.inner);
            let in_log: u64 = inner.dirty.values().map(|u| u.ranges.bytes().min(u.logged.bytes())).sum();
            let bytes: u64 = inner.dirty.values().map(|u| u.ranges.minus(&u.logged).bytes()).sum::<u64>()
                + inner.in_flight.values().map(|u| u.ranges.bytes()).sum::<u64>();
            if bytes + in_log == 0 {
                continue;
            }
            let name = self.name_of(&file);
            log::error!(
                "{name}: {bytes} written bytes could not be written before unmount ({e}) and are lost{}",
                if in_log > 0 {
                    format!("; {in_log} fsynced bytes stay in the intent log for the next mount")
                } else {
                    String::new()
                }
            );
            self.metrics.unmount_dropped_bytes.fetch_add(bytes, Relaxed);
            unwritten.push(Unwritten { name, bytes, in_log, error: e });
        }
        // A clean unmount is a durability point, as a native file system's: what was written
        // survives a power cut after `umount` returns (with the log, the checkpoint's sync).
        let mut backend_unsynced = None;
        if let Some(log) = &self.log {
            // A checkpoint that leaves the log empty now tells the next mount so.
            log.stopping();
            let mut checkpointed = self.checkpoint();
            // New files the log took after that checkpoint began, or whose commit failed, are
            // made on the backend too (nothing changes any more), and a second checkpoint
            // releases their records: a clean unmount leaves nothing to replay.
            if let Some(held) =
                self.pending.as_ref().filter(|held| checkpointed.is_ok() && (held.any_named() || held.any_hidden()))
            {
                checkpointed = held.make_all(u64::MAX).and_then(|_| self.checkpoint());
            }
            if let Err(e) = checkpointed {
                log::error!("the last checkpoint failed ({e}); the next mount replays the intent log");
                backend_unsynced = Some(e);
            }
        } else if let Err(e) = self.sync_backend() {
            log::error!("syncing the backend at unmount failed ({e}): what was written may not survive a power cut");
            backend_unsynced = Some(e);
        }
        self.threads.stop();
        self.queue_ready.notify_all();
        self.stop_near_flushers();
        // A flusher stuck in a backend call that never returns is left behind, not waited for.
        let flushers = self.threads.take_flushers();
        let stop_deadline = Instant::now() + self.config.io_timeout;
        for thread in flushers {
            while !thread.is_finished() && Instant::now() < stop_deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if thread.is_finished() {
                let _ = thread.join();
            } else {
                log::error!(
                    "a flusher is still in a backend call after {} s; the daemon exits without it",
                    self.config.io_timeout.as_secs()
                );
            }
        }
        if let Some(log) = &self.log {
            log.release_device();
            // The last checkpoint wrote whatever the tail kept into the log (else it stays,
            // for the next mount).
            if !log.holds_volatile_names() {
                log.remove_volatile_tail();
            }
        }
        let done = ShutDown { unwritten, backend_unsynced };
        *report = Some(done.clone());
        done
    }
}
