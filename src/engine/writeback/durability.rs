//! The durability policy: when an fsync can be answered by the intent log instead of the store,
//! what it logs, the barriers that keep replay from going back in time, the name records of
//! creations, unlinks and renames. The checkpoint that releases the log, and shut-down, are
//! `checkpoint`'s.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::*;
use crate::engine::intent_log::format::describe_key;

impl Writeback {
    /// The backend's copy of `ino` changed in a way only a backend sync makes durable.
    pub fn note_backend_changed(&self, ino: u64) {
        if self.log.is_some() {
            let mut d = lock(&self.durability);
            // Under the map's lock: a file's stamps only grow.
            let stamp = self.change_stamps.fetch_add(1, Relaxed) + 1;
            d.entry(ino).or_default().backend_changes = stamp;
        }
    }

    /// The file's last change on the backend, as a backend sync reads it before it syncs
    /// (`note_synced` with it afterwards marks that and everything before it durable), and
    /// whether the log holds records of the file.
    pub(super) fn backend_changes_now(&self, ino: u64) -> (u64, bool) {
        lock(&self.durability).get(&ino).map_or((0, false), |e| (e.backend_changes, e.logged_before_seq > 0))
    }

    /// A backend sync that began after the file's change `changes` (`backend_changes_now`)
    /// has ended: that change and every one before it are durable.
    /// A file with no entry has nothing to mark: one made here would only hold back the
    /// kernel's forgets of it (`forget`) until the next checkpoint.
    pub(super) fn note_synced(&self, ino: u64, changes: u64) {
        if let Some(entry) = lock(&self.durability).get_mut(&ino) {
            entry.synced_changes = entry.synced_changes.max(changes);
        }
    }

    /// Whether namespace changes should be reported (with backend handles) for the log.
    pub fn logging(&self) -> bool {
        self.log.is_some()
    }

    /// `ino` was created by this mount, named in the directory `named_in` (None: a directory,
    /// or a name the log does not record); `record` says so in the log.
    pub fn note_created(&self, ino: u64, named_in: Option<u64>, record: Option<Record>) {
        if let Some(log) = &self.log {
            // A fresh start: the number may be a deleted file's, whose history is not this one's.
            restart(&mut lock(&self.durability), ino, Durability { created: true, named_in, ..Durability::default() });
            if let Some(record) = record {
                log.append(vec![record]);
            }
        }
    }

    /// Whether a new regular file in `parent` is held in memory and the log until the next
    /// checkpoint (`pending`): where its close would go to the log (`log_closes`: not in a
    /// burst of closes, or in a burst of files each fsynced before its close), in a directory
    /// the backend holds durably, or one the log can make again (`logged_path`).
    ///
    /// Why the fsynced burst is held: tar and rsync fsync nothing, and the backend's one journal
    /// commit shares the creations of their whole burst; dpkg, a maildir and git with
    /// core.fsync fsync every file, and a file made on the backend at once costs each fsync a
    /// journal commit, where the log answers it with a block or two. Measured with 200 new
    /// 1 KiB files, each fsynced then closed, state directory on the measured 512-byte-sector
    /// ext4: 25.2x the application bytes made at once, 7.0x held (native ext4 36.3x).
    pub fn may_hold_new_file(&self, parent: u64) -> bool {
        if self.pending.is_none() || !logged_path(&lock(&self.durability), parent) {
            return false;
        }
        let in_burst = self.bursts.in_close_burst_without_fsyncs();
        let hold = self.logs_close(in_burst);
        if !hold {
            self.metrics.pending_files_declined.fetch_add(1, Relaxed);
        }
        hold
    }

    /// Whether a held file may take a name in `parent` (a hard link): one the backend holds
    /// durably, or that the log can make again (`logged_path`), where replay can make it.
    pub fn may_name_held_file(&self, parent: u64) -> bool {
        self.pending.is_some() && logged_path(&lock(&self.durability), parent)
    }

    /// Whether a close goes to the log (`LogCloses`), given whether it comes in a burst.
    fn logs_close(&self, in_burst: bool) -> bool {
        match self.config.log_closes {
            LogCloses::Always => true,
            LogCloses::Never => false,
            LogCloses::Auto => !in_burst,
        }
    }

    /// A held file was made on the backend before a checkpoint (nothing of it in the log): from
    /// now on it is a file created since the last checkpoint like any other, with its Create
    /// record queued, and bytes on the backend that no sync has made durable yet.
    pub fn note_made_early(&self, id: u64, made: Made) {
        let record = match (self.ns.log_key(id), self.ns.log_key(made.parent)) {
            (Ok(file), Ok(parent)) => Some(Record::Create {
                file,
                parent,
                name: made.name.as_encoded_bytes().to_vec(),
                mode: made.attr.mode(),
                uid: made.attr.uid,
                gid: made.attr.gid,
            }),
            _ => None,
        };
        let named_in = record.as_ref().map(|_| made.parent);
        self.note_created(id, named_in, record);
        self.note_backend_changed(id);
    }

    /// Makes a held file (`pending`) a backend file: at once when the log has not seen it, else
    /// durably (`make_held_durably`). Returns whether it was held: a commit racing with this
    /// can change which make applies, so a caller that needs the file made calls again until
    /// it was not.
    pub fn make_held_on_backend(&self, id: u64) -> SysResult<bool> {
        let Some(held) = &self.pending else { return Ok(false) };
        match held.status(id) {
            Held::No => return Ok(false),
            Held::Unlogged => {
                if let Some(made) = held.make_unlogged_now(id)? {
                    self.note_made_early(id, made);
                }
            }
            Held::Logged(_) => self.make_held_durably(id)?,
        }
        Ok(true)
    }

    /// For a flush of a held file's bytes (it grew past what the log takes): made on the
    /// backend now; one the log knows is synced and its records barred at its next close,
    /// fsync, rename or unlink (`Pending::make_logged_for_flush`).
    pub fn make_held_for_flush(&self, id: u64) -> SysResult<()> {
        let Some(held) = &self.pending else { return Ok(()) };
        match held.status(id) {
            Held::No => {}
            Held::Unlogged => {
                if let Some(made) = held.make_unlogged_now(id)? {
                    self.note_made_early(id, made);
                }
            }
            Held::Logged(_) => {
                held.make_logged_for_flush(id)?;
            }
        }
        Ok(())
    }

    /// Makes a held file the log knows on the backend now, durably, and bars its earlier
    /// records (see `Pending::make_logged_now`); from then on it is like any synced file.
    pub fn make_held_durably(&self, id: u64) -> SysResult<()> {
        let Some(held) = &self.pending else { return Ok(()) };
        if held.make_logged_now(id, &|records| self.commit_made_durably(id, records))?.is_some() {
            // Synced, named durably, its log records barred: as a file older than the
            // checkpoint, in sync with the backend.
            restart(&mut lock(&self.durability), id, Durability::default());
        }
        Ok(())
    }

    /// The records of a new file made on the backend durably (`Pending::made_durably_records`).
    fn commit_made_durably(&self, id: u64, records: Vec<Record>) -> SysResult<()> {
        let Some(log) = &self.log else { return Ok(()) };
        log.commit(records).map_err(|e| {
            log::error!("inode {id}: committing the barrier of a new file made on the backend: {e}");
            Errno(libc::EIO)
        })
    }

    /// A file made on the backend with its held records unbarred (by a checkpoint, or for a
    /// flush) is settled before its close or fsync returns and before it is renamed or unlinked
    /// (see `Pending::settle_if_made_unbarred`). `names_held`: the caller holds the names gate,
    /// so it cannot wait for a running checkpoint's release (whose next chunk of makes needs
    /// the gate): it settles the file itself, one sync of it and its directory.
    pub fn settle_made(&self, id: u64, names_held: bool) -> SysResult<()> {
        // Every close and fsync asks: the durability map is locked below only for such a file.
        let Some(held) = self.pending.as_ref().filter(|held| held.is_unbarred(id)) else { return Ok(()) };
        let commit = |records| self.commit_made_durably(id, records);
        // Counted before the settle's sync: every flush counted by then reached the backend
        // before the sync began, and the sync covers it. One counted later may have landed
        // after the sync and stays unsynced, so an fsync after the settle syncs the backend
        // again rather than trusting the log with a file the backend is ahead of.
        let (changes_before, logged_before) = {
            let d = lock(&self.durability);
            d.get(&id).map_or((0, 0), |e| (e.backend_changes, e.logged_before_seq))
        };
        let settled =
            if names_held { held.settle_unreleased(id, &commit)? } else { held.settle_if_made_unbarred(id, &commit)? };
        if settled {
            // Synced with its directory, named durably, its held records barred: a file older
            // than the checkpoint, as `make_held_durably` leaves one. Without this its close
            // synced it once more and logged a second barrier.
            let mut d = lock(&self.durability);
            let entry = d.entry(id).or_default();
            entry.created = false;
            entry.named_in = None;
            entry.synced_changes = entry.synced_changes.max(changes_before);
            // Only records logged before the settle are barred by it.
            if entry.logged_before_seq == logged_before {
                entry.logged_before_seq = 0;
            }
        }
        Ok(())
    }

    /// Name records of held files the log knows (`pending`), written before the caller is
    /// answered: replay finds such a file by the name its records leave it with, so no later
    /// change may depend on a name change the log does not have yet. With `before_backend`,
    /// the records describe a change the backend has made or may make durable on its own (the
    /// unlink of a file a held one replaces; a name a held file frees, which a backend file may
    /// take): they are durable before the backend's change is (`commit_before_backend`). A
    /// held file's own unlink is not: if a power cut takes its record, replay makes the file
    /// again with the bytes its last commit acknowledged, or finds the name taken, and either
    /// is a state an unsynced unlink may leave.
    ///
    /// `names_gate`: the caller's hold of the held files' names gate, kept until the records
    /// are committed (a checkpoint then makes the file at the name they say), let go before a
    /// full log's checkpoint, which needs the gate. Such a checkpoint commits what it can of
    /// the queued records first.
    pub fn commit_names_now(
        &self,
        records: Vec<Record>,
        before_backend: bool,
        names_gate: Option<parking_lot::RwLockReadGuard<'_, ()>>,
    ) {
        let Some(log) = &self.log else { return };
        // Kept in the volatile tail where the log has one, for the next batch to carry: they
        // survive a killed daemon there, and no backend change can overtake them
        // (`write_volatile_names`). A tmp + rename then costs the fsync's log block alone.
        let records = match log.keep_in_volatile_tail(records) {
            TailKeep::Kept => return,
            TailKeep::Declined(records) => records,
        };
        let commit = |records: Vec<Record>| {
            if before_backend {
                self.commit_before_backend(log, records)
            } else {
                log.commit_written(records)
            }
        };
        let result = match commit(records.clone()) {
            Err(LogError::Full { .. }) => {
                drop(names_gate);
                self.checkpoint().map_err(LogError::from).and_then(|()| commit(records))
            }
            other => other,
        };
        if let Err(e) = result {
            log::warn!("committing a name change of a new file to the intent log: {e}; it stays queued");
        }
    }

    /// Before the backend changes a name (the held files' namespace calls it): records only the
    /// volatile tail keeps are committed first, as `commit_names_now` would have committed
    /// them, so the backend never holds a change durably that follows one the log lacks (a
    /// backend file made at the name a renamed held file freed, with the rename lost to a
    /// power cut, would leave that file's logged bytes nowhere).
    pub fn write_volatile_names(&self) {
        let Some(log) = self.log.as_ref().filter(|log| log.holds_volatile_names()) else { return };
        if let Err(e) = self.commit_before_backend(log, Vec::new()) {
            log::warn!("committing the volatile tail's name changes to the intent log: {e}; they stay queued");
        }
    }

    /// Name records that must be durable before a change the backend makes: written where a
    /// change of the backend flushes the log's device anyway (`IntentLog::flushed_by_backend`),
    /// flushed otherwise.
    fn commit_before_backend(&self, log: &IntentLog, records: Vec<Record>) -> Result<(), LogError> {
        if log.flushed_by_backend() {
            log.commit_written_to_device(records)
        } else {
            log.commit(records)
        }
    }

    /// Close and fsync of a file only memory holds (`pending`): its buffered bytes go to that
    /// memory, then its name and bytes to the log in one commit. None when the file is not
    /// held (any more): the caller goes on as for any file. A file the log has not seen that
    /// is larger than `log_threshold_new` is made on the backend instead.
    pub(super) fn commit_pending(&self, file: &Arc<FileState>, report: ErrorReport) -> Option<SysResult<()>> {
        let (held, log) = (self.pending.as_ref()?, self.log.as_ref()?);
        if !held.is_held(file.id) {
            return self.settle_made(file.id, false).err().map(Err);
        }
        if let Err(e) = self.flush_file(file, None, report) {
            return Some(Err(e));
        }
        // A close writes the batch, an fsync waits for its flush (see `IntentLog::commit_written`).
        let flushed = report != ErrorReport::Close;
        for attempt in 0..2 {
            let committed = held.commit(file.id, self.config.log_threshold_new_bytes, |records| {
                if flushed {
                    log.commit_before_seq(records)
                } else {
                    log.commit_written_before_seq(records)
                }
            });
            match committed {
                Ok(Commit::NotHeld) => return self.settle_made(file.id, false).err().map(Err),
                Ok(Commit::TooLarge) => {
                    match held.make_unlogged_now(file.id) {
                        Ok(Some(made)) => self.note_made_early(file.id, made),
                        Ok(None) => {}
                        Err(e) => return Some(Err(e)),
                    }
                    return None;
                }
                // An earlier close may have written its last commit without a flush (also the
                // close of a duplicate, or of a forked child's copy at its exec): this fsync's
                // flush of the log makes it durable, and it is the log's as much as a commit.
                Ok(Commit::Unchanged) if flushed => {
                    let answered = self.commit_queued_names_before_seq();
                    if report == ErrorReport::Sync && matches!(answered, Ok(Some(_))) {
                        self.metrics.log_fsyncs.fetch_add(1, Relaxed);
                    }
                    return Some(answered.map(drop));
                }
                Ok(Commit::Unnamed | Commit::Unchanged) => return Some(Ok(())),
                Ok(Commit::Committed) => {
                    // Made on the backend by a checkpoint that does not release these records,
                    // the file is then synced at close as any file the log holds records of.
                    lock(&self.durability).entry(file.id).or_default().logged_before_seq = log.next_seq();
                    if report == ErrorReport::Sync {
                        self.metrics.log_fsyncs.fetch_add(1, Relaxed);
                    }
                    return Some(Ok(()));
                }
                Err(LogError::Full { .. }) if attempt == 0 => {
                    // The checkpoint makes the file on the backend unless the log knows it.
                    if let Err(e) = self.checkpoint() {
                        return Some(Err(e));
                    }
                }
                Err(e) => {
                    log::error!("{}: committing a new file to the intent log: {e}", self.name_of(file));
                    return Some(Err(Errno(libc::EIO)));
                }
            }
        }
        Some(Err(Errno(libc::EIO)))
    }

    /// fsync of a directory: the files only memory holds in it (`pending`) logged, names and
    /// bytes (or made on the backend, where the directory's sync that follows covers them).
    pub fn commit_held_in(&self, dir: u64) -> SysResult<()> {
        let Some(held) = &self.pending else { return Ok(()) };
        for id in held.named_in(dir) {
            let result = match self.file(id) {
                Some(file) => self.commit_pending(&file, ErrorReport::Sync),
                None => {
                    let log = self.log.as_ref().expect("held files exist with the log");
                    let committed = held.commit(id, u64::MAX, |records| log.commit_before_seq(records));
                    Some(match committed {
                        Ok(_) => Ok(()),
                        Err(LogError::Full { .. }) => self.checkpoint(),
                        Err(e) => {
                            log::error!("inode {id}: committing a new file to the intent log: {e}");
                            Err(Errno(libc::EIO))
                        }
                    })
                }
            };
            result.unwrap_or(Ok(()))?;
        }
        Ok(())
    }

    /// A name changed on the backend: `record` (if any) says how, for replay; `moved` is the
    /// object renamed and its new directory, `lost_names` those whose one name no longer holds.
    /// Called after the backend change and before the caller is answered, so the record is
    /// queued before anything that depends on it can be committed.
    pub fn note_names_changed(&self, record: Option<Record>, moved: Option<(u64, u64)>, lost_names: &[u64]) {
        let Some(log) = &self.log else { return };
        // Replacing or removing a file whose bytes the log holds: a replay that does not know
        // it is gone would make it again with them (from its Create, still in the log after a
        // settle marked it no longer created). The record is written before the caller is
        // answered, and durable before the backend's change is (`commit_before_backend`). A
        // created file the log holds nothing more of than its Create is never made again
        // (`replay`): its record is only queued.
        let destroys_logged_file;
        {
            let mut d = lock(&self.durability);
            destroys_logged_file = lost_names.iter().any(|ino| d.get(ino).is_some_and(|e| e.logged_before_seq > 0));
            for ino in lost_names {
                if let Some(entry) = d.get_mut(ino) {
                    entry.named_in = None;
                }
            }
            if let Some((ino, new_parent)) = moved {
                if let Some(entry) = d.get_mut(&ino).filter(|e| e.created) {
                    entry.named_in = Some(new_parent);
                }
            }
        }
        match record {
            // Removed before any batch carried its creation: nothing in the log or acknowledged
            // by it knows the file, so neither record is needed (rm -rf of a fresh tree would
            // otherwise cost a log write per file), until a record puts something else at the
            // name before a checkpoint (the log keeps the Unlink for that).
            Some(ref unlink @ Record::Unlink { .. }) if log.cancel_queued_create(unlink) => {}
            // A link removes nothing: only the file's one logged name stops being its only one.
            Some(record) if destroys_logged_file && !matches!(record, Record::Link { .. }) => {
                if let Err(e) = self.commit_before_backend(log, vec![record]) {
                    log::warn!("committing a name change to the intent log: {e}; it stays queued");
                }
            }
            Some(record) => log.append(vec![record]),
            None => {}
        }
    }

    /// Before fsync of a directory (and a checkpoint's syncfs): the name changes queued for the
    /// log become durable there first, so that what the directory's fsync acknowledges is in
    /// the log too; so do the batches closes wrote without a flush.
    pub fn commit_queued_names(&self) -> SysResult<()> {
        self.commit_queued_names_before_seq().map(drop)
    }

    /// `commit_queued_names`, and the sequence number the batches holding them end before
    /// (None: a checkpoint made them durable on the backend instead, and the log holds none).
    pub fn commit_queued_names_before_seq(&self) -> SysResult<Option<u64>> {
        let Some(log) = &self.log else { return Ok(None) };
        match log.commit_before_seq(Vec::new()) {
            Ok(before_seq) => Ok(Some(before_seq)),
            // No room: a checkpoint makes them durable on the backend instead, and frees the ring.
            Err(LogError::Full { .. }) => self.checkpoint().map(|()| None),
            Err(e) => {
                log::error!("committing queued name changes to the intent log: {e}");
                Err(Errno(libc::EIO))
            }
        }
    }

    /// After the backend synced the directory `dir`, which it began once the name records in
    /// batches before `before_seq` were durable: a record saying the backend holds them, so
    /// that replay does not apply them again over later changes the log never saw (a rename
    /// back that no fsync acknowledged, and the daemon's death took from the queue). Durable
    /// before any later change the backend makes can be (`commit_before_backend`).
    pub fn note_dir_synced(&self, dir: u64, before_seq: u64) -> SysResult<()> {
        let Some(log) = &self.log else { return Ok(()) };
        let key = self.ns.log_key(dir)?;
        let committed = log.commit_names_synced(&key, before_seq, |record| {
            match self.commit_before_backend(log, vec![record.clone()]) {
                Ok(()) => {
                    self.metrics.log_dir_syncs_recorded.fetch_add(1, Relaxed);
                    Ok(())
                }
                // The checkpoint makes every name durable on the backend: nothing left to cover.
                Err(LogError::Full { .. }) => self.checkpoint().map_err(LogError::from),
                Err(e) => Err(e),
            }
        });
        committed.map_err(|e| {
            log::error!("inode {dir}: recording its sync in the intent log: {e}");
            Errno(libc::EIO)
        })
    }

    /// Whether a log fsync can stand for a backend sync of `ino` (None: it cannot), and
    /// whether the file was created since the last checkpoint. Called under the file's lock.
    pub(super) fn log_eligibility(&self, ino: u64) -> Option<bool> {
        let d = lock(&self.durability);
        let Some(entry) = d.get(&ino) else { return Some(false) };
        if !entry.backend_in_sync() {
            return None;
        }
        if !entry.created {
            return Some(false);
        }
        let parent = entry.named_in?;
        // A file in a directory the backend may not hold yet, and the log could not make again:
        // replay would have nowhere to put it.
        if !logged_path(&d, parent) {
            return None;
        }
        Some(true)
    }

    /// fsync(2) and fdatasync(2): through the intent log when it can stand for a backend
    /// sync, otherwise the buffered units to the backend and the backend synced.
    pub fn fsync(&self, file: &Arc<FileState>, data_only: bool) -> SysResult<()> {
        let _one_at_a_time = lock(&file.durability_points);
        let synced = self.sync_file(file, data_only, ErrorReport::Sync);
        self.bursts.fsynced();
        synced
    }

    /// close(2): the buffered data goes to the backend. A file with records in the intent log
    /// is synced instead (through the log where it can be): unsynced bytes on the backend
    /// would be taken back to the logged ones by a replay after a daemon crash, and what close
    /// acknowledged survives a daemon crash, with the log as without it.
    pub fn close_file(&self, file: &Arc<FileState>) -> SysResult<()> {
        let _one_at_a_time = lock(&file.durability_points);
        let in_burst = self.bursts.closed();
        if let Some(result) = self.commit_pending(file, ErrorReport::Close) {
            return result;
        }
        // With the log, a small change of a file it can stand for is logged at close (written,
        // not flushed, as a new file's close) and reaches the store at the checkpoint with
        // every other such change: an in-place rewrite of a small file costs its bytes in the
        // log, not a journal commit of its own. What the log holds already stays buffered. In
        // a burst of closes the backend takes it (`LogCloses`).
        if let Some(log) = &self.log {
            let (unlogged, refused) = {
                let inner = lock(&file.inner);
                let unlogged = inner.flush_outruns_the_log()
                    || inner.cut_unlogged.is_some()
                    || (inner.times_pending && !inner.times_logged);
                (unlogged, inner.dirty.values().any(|u| u.refused))
            };
            if unlogged {
                if !self.logs_close(in_burst) {
                    self.metrics.closes_not_logged.fetch_add(1, Relaxed);
                } else if let Some(result) = self.fsync_through_log(file, log, ErrorReport::Close) {
                    return result;
                }
            } else if !refused
                && lock(&self.durability).get(&file.id).is_some_and(|e| e.logged_before_seq > 0 && e.backend_in_sync())
            {
                // Everything the file has is in the log, and nothing the backend holds is newer
                // than the log's records (a unit flushed since its last batch, under memory
                // pressure, would be: it is synced below, and barred, as before).
                return Ok(());
            }
        }
        // Only when something newer than the log's records would be left unsynced: a close
        // right after an fsync costs nothing more.
        let backend_behind = match lock(&self.durability).get(&file.id) {
            Some(entry) if self.log.is_some() && entry.logged_before_seq > 0 => Some(!entry.backend_in_sync()),
            _ => None,
        };
        // What the flush below gives the backend, unsynced, the log's older records would undo.
        let must_sync = backend_behind.is_some_and(|behind| behind || lock(&file.inner).flush_outruns_the_log());
        if must_sync {
            self.sync_file(file, true, ErrorReport::Close)
        } else {
            log::debug!("inode {}: Close flushes to the backend, unsynced", file.id);
            self.flush_file(file, None, ErrorReport::Close)
        }
    }

    pub(super) fn sync_file(&self, file: &Arc<FileState>, data_only: bool, report: ErrorReport) -> SysResult<()> {
        let Some(log) = &self.log else {
            return self.flush_file(file, Some(data_only), report);
        };
        if let Some(result) = self.commit_pending(file, report) {
            return result;
        }
        if let Some(result) = self.fsync_through_log(file, log, report) {
            return result;
        }
        self.flush_file(file, None, report)?;
        let (changes, logged) = self.backend_changes_now(file.id);
        let data = {
            let mut inner = lock(&file.inner);
            self.file_data(file, &mut inner)?
        };
        // No commit of the queued name records here for a file's Create: a file's own sync is
        // the seed-000 path above log_threshold_new, and one more log write per file would cost
        // more than the log saves. What the backend may then hold ahead of the log is safe for
        // replay: unlinks and replacements of files the log created were committed when they
        // happened. A queued rename of the file is not: the fsync acknowledges the file's names,
        // and the backend's sync makes its rename durable there, while the log may hold an
        // earlier rename of it (committed with another batch) that replay would apply again
        // over it (renamed a -> b in the log, b -> a only on the backend: replay finds it at a,
        // and takes it to b).
        // Nor may the backend's sync make a file durable where the log's durable records
        // would have replay see another: batches written without a flush (a close's, or the
        // unlink of a new file the log holds whose name this file now has) are flushed first,
        // unless the backend's sync flushes the log's device anyway.
        if self.file_handle(file).is_ok_and(|handle| log.has_queued_name_change_of(&handle)) {
            self.commit_queued_names()?;
        } else if !log.flushed_by_backend() {
            log.flush_written_batches().map_err(|e| {
                log::error!("flushing the intent log: {e}");
                Errno(libc::EIO)
            })?;
        }
        if !self.store.capabilities().durable_writes {
            data.sync(data_only)?;
        }
        if logged {
            // What the log holds for this file is older than what the backend now holds
            // durably: replaying it after a crash would take the file back.
            let handle = self.file_handle(file)?;
            log.commit(vec![Record::Barrier { file: handle }]).map_err(|e| {
                log::error!("inode {}: {e}", file.id);
                Errno(libc::EIO)
            })?;
        }
        if log::log_enabled!(log::Level::Debug) {
            let key = self.file_handle(file).map(|k| describe_key(&k)).unwrap_or_default();
            let how = if logged { ", then a barrier" } else { " (nothing of it in the log)" };
            log::debug!("inode {} (key {key}): {report:?} answered by a backend sync{how}", file.id);
        }
        self.note_synced(file.id, changes);
        Ok(())
    }

    /// The key the log names the file by (asked of the namespace once).
    pub(super) fn file_handle(&self, file: &FileState) -> SysResult<Vec<u8>> {
        if let Some(key) = file.log_key.get() {
            return Ok(key.clone());
        }
        let key = self.ns.log_key(file.id)?;
        if super::super::pending::is_pending_key(&key) {
            return Ok(key); // the backend's key replaces it once the file is made there
        }
        Ok(file.log_key.get_or_init(|| key).clone())
    }

    /// The log path of fsync: None when it cannot stand for a backend sync (the file is new,
    /// the backend holds changes not yet synced, too much is buffered, or the log refused).
    pub(super) fn fsync_through_log(
        &self,
        file: &Arc<FileState>,
        log: &IntentLog,
        report: ErrorReport,
    ) -> Option<SysResult<()>> {
        let handle = self.file_handle(file).ok()?;
        let mut inner = lock(&file.inner);
        // Checked under the file's lock, which a flush holds when it records its backend
        // change: a unit whose flush ended before this point makes the file ineligible, and one
        // still in flight is logged whole below. Checked before taking the lock, a flush ending
        // in between left its bytes in neither (unsynced on the backend, absent from the log),
        // and the crash harness caught an older logged record replayed over them.
        // A file created since the last checkpoint: its Create record was queued when it was
        // created and goes into the log with this batch, ahead of its bytes.
        let created = self.log_eligibility(file.id)?;
        // Bytes the backend refused are still buffered and go into the log with the rest; only
        // a discard of refused bytes (a loss) is reported.
        let failures = inner.errors.failures;
        if let Some(err) = inner.errors.report_after_wait(report, failures) {
            return Some(Err(err));
        }
        let unit_bytes = self.config.unit_bytes;
        let size = inner.size;
        let failures_before = log.failed_batches();
        let (dirty, spans) = unlogged_spans(&inner, unit_bytes);
        // Measured before anything is copied: a file with more buffered than the threshold
        // goes to the backend, and its buffer is not copied for nothing.
        let bytes: u64 = spans.iter().map(|(_, r, _)| r.end - r.start).sum();
        if bytes > self.log_threshold(created) {
            return None;
        }
        let pieces: Vec<(u64, Vec<u8>)> = spans
            .iter()
            .map(|(unit, r, from_flight)| {
                let buf = if *from_flight { &inner.in_flight[unit].buf } else { &inner.dirty[unit].buf };
                (unit * unit_bytes + r.start, buf.as_slice()[r.start as usize..r.end as usize].to_vec())
            })
            .collect();
        // Ranges marked logged may belong to another fsync's batch not yet durable: then a
        // record of our own (the size) waits behind it.
        // A truncate the store has not been given yet goes first (`FileInner::cut_unlogged`).
        // While one is pending the store's size is not the file's: the batch says the size
        // even with no bytes to log (a truncate to less, or to more, after a logged one; the
        // power-cut simulation found both lost).
        let cut = inner.cut_unlogged;
        let size_unsettled = inner.size_unlogged_since_cut();
        let cut_waits = inner.cut_to.is_some();
        // Times that wait with the changes (`defer_times`) go in the batch too, once.
        let times = inner.times_set.filter(|_| inner.times_pending && !inner.times_logged);
        if pieces.is_empty()
            && inner.dirty.values().all(|u| u.logged.is_empty())
            && !created
            && !size_unsettled
            && times.is_none()
        {
            drop(inner);
            return Some(self.sync_nothing_buffered(log, report));
        }
        // The mode and owner beside deferred times, asked before anything is marked logged.
        let attrs = match times {
            Some(times) => Some(self.attrs_beside(file.id, times).ok()?),
            None => None,
        };
        // Marked now, under the lock: a write after this point takes its range out again.
        for (unit, ranges) in &dirty {
            let unit_state = inner.dirty.get_mut(unit).expect("listed above");
            for r in ranges {
                unit_state.logged.insert(r.clone());
            }
        }
        // For a post-mortem (`RUST_LOG=coalescefs::engine::writeback=debug`): what this batch holds.
        let debug = log::log_enabled!(log::Level::Debug);
        let key_shown = if debug { describe_key(&handle) } else { String::new() };
        let spans_shown = if debug {
            let shown: Vec<String> = pieces.iter().map(|(at, b)| format!("{at}+{}", b.len())).collect();
            format!(
                "data {} size {size}{}",
                shown.join(" "),
                cut.map_or(String::new(), |c| format!(" after a cut to {c}"))
            )
        } else {
            String::new()
        };
        let mut records = Vec::with_capacity(pieces.len() + 2);
        if let Some(cut) = cut {
            records.push(Record::Size { file: handle.clone(), size: cut });
            inner.cut_unlogged = None;
        }
        records.extend(pieces.into_iter().map(|(offset, b)| Record::Data { file: handle.clone(), offset, bytes: b }));
        records.push(Record::Size { file: handle.clone(), size });
        if let Some((mode, uid, gid, atime, mtime)) = attrs {
            records.push(Record::Attrs { file: handle, mode, uid, gid, atime, mtime });
            inner.times_logged = true;
        }
        drop(inner);
        let committed = match commit_as(log, report, records.clone()) {
            Err(LogError::Full { .. }) => {
                self.checkpoint().map_err(LogError::from).and_then(|()| commit_as(log, report, records))
            }
            other => other,
        };
        // A failed batch may have held ranges this fsync skipped as logged by another one.
        if committed.is_err() || log.failed_batches() != failures_before {
            self.unmark_logged(file, cut, log);
            if let Err(e) = committed {
                log::warn!("inode {}: {e}; this fsync syncs the backend instead", file.id);
            }
            return None;
        }
        let next = log.next_seq();
        lock(&self.durability).entry(file.id).or_default().logged_before_seq = next;
        if cut_waits {
            // The batch said `size` (its last record): while the cut waits and the file keeps
            // that size, a close has nothing more to say of it. (A cut made since the batch
            // was built is unlogged, and one given to the store is gone: both skip this.)
            let mut inner = lock(&file.inner);
            if inner.cut_to.is_some() && inner.cut_unlogged.is_none() {
                inner.size_logged_since_cut = Some(size);
            }
        }
        if let Ok(batch_end) = committed {
            log::debug!(
                "inode {} (key {key_shown}): {report:?} answered by the log, in batch {}: {spans_shown}",
                file.id,
                batch_end - 1
            );
        }
        if report != ErrorReport::Close {
            self.metrics.log_fsyncs.fetch_add(1, Relaxed);
        }
        Some(Ok(()))
    }

    /// The most a file's fsync logs; above it the file goes to the backend.
    fn log_threshold(&self, created: bool) -> u64 {
        let threshold = if created { self.config.log_threshold_new_bytes } else { self.config.log_threshold_bytes };
        // A store that takes whole units only would read the rest of each partial unit and write
        // it whole, and one whose syncs cost requests would pay one per fsync: logging up to half
        // a unit costs less than either.
        let capabilities = self.store.capabilities();
        if capabilities.partial_writes && !capabilities.syncs_cost_requests {
            threshold
        } else {
            threshold.max(self.config.unit_bytes / 2)
        }
    }

    /// An fsync of a file with nothing buffered: the store is in sync. The file's name changes
    /// may still be queued (a rename since the last checkpoint): an fsync makes them durable
    /// too, as ext4's does and the store's path here does; a commit of an empty queue writes
    /// nothing (but flushes what closes wrote).
    fn sync_nothing_buffered(&self, log: &IntentLog, report: ErrorReport) -> SysResult<()> {
        match commit_as(log, report, Vec::new()) {
            Ok(_) => Ok(()),
            Err(LogError::Full { .. }) => self.checkpoint(),
            Err(e) => {
                log::error!("committing queued name changes to the intent log: {e}");
                Err(Errno(libc::EIO))
            }
        }
    }

    /// The mode, owner and times a batch logs beside deferred times (`times` over what the
    /// namespace holds now).
    fn attrs_beside(&self, id: ObjectId, times: TimesToSet) -> SysResult<(u32, u32, u32, Timestamp, Timestamp)> {
        let now = self.ns.getattr(id)?;
        let at = |t: Option<TimeToSet>, or: Timestamp| match t {
            Some(TimeToSet::At(at)) => at,
            _ => or,
        };
        Ok((now.perm, now.uid, now.gid, at(times.atime, now.atime), at(times.mtime, now.mtime)))
    }

    /// After a batch that failed (or another that did, which may have held ranges this one
    /// skipped as logged): nothing of the file counts as logged, its cut is unlogged again, and
    /// the backend sync that follows must be followed by a barrier, written over whatever of
    /// the batch landed (EIO after the bytes were written).
    fn unmark_logged(&self, file: &FileState, cut: Option<u64>, log: &IntentLog) {
        let mut inner = lock(&file.inner);
        for unit in inner.dirty.values_mut() {
            unit.logged = RangeSet::default();
        }
        if let Some(cut) = cut {
            inner.cut_unlogged = Some(inner.cut_unlogged.map_or(cut, |later| later.min(cut)));
        }
        inner.times_logged = false;
        inner.size_logged_since_cut = None;
        drop(inner);
        let mut d = lock(&self.durability);
        let entry = d.entry(file.id).or_default();
        entry.logged_before_seq = entry.logged_before_seq.max(log.readable_before_seq());
    }
}

/// A close writes its batch, an fsync waits for the flush (see `IntentLog::commit_written`).
/// Returns the sequence number the batch holding `records` ends before.
fn commit_as(log: &IntentLog, report: ErrorReport, records: Vec<Record>) -> Result<u64, LogError> {
    if report == ErrorReport::Close {
        log.commit_written_before_seq(records)
    } else {
        log.commit_before_seq(records)
    }
}

/// A unit and ranges in it.
type UnitRanges = (u64, Vec<std::ops::Range<u64>>);
/// A unit, a range in it, and whether its bytes come from the unit in flight.
type Span = (u64, std::ops::Range<u64>, bool);

/// What the log does not hold yet of a file: its dirty units' ranges not logged since they
/// were last written, and the spans to log (unit, range in it, whether from a unit in flight),
/// cut at the file's size: units in flight whole (older), then the dirty ranges. A unit's bytes
/// in flight are older than its dirty ones, which this batch or an earlier one logs after them:
/// where the dirty unit has bytes, the flight's are left out, or a second fsync while the flush
/// is still under way would log them after the newer ones an earlier batch holds, and replay
/// would end with the older (the crash harness found them back after a kill).
fn unlogged_spans(inner: &FileInner, unit_bytes: u64) -> (Vec<UnitRanges>, Vec<Span>) {
    let in_flight: Vec<UnitRanges> = inner
        .in_flight
        .iter()
        .map(|(&k, u)| match inner.dirty.get(&k) {
            Some(newer) => (k, u.ranges.minus(&newer.ranges).iter().cloned().collect()),
            None => (k, u.ranges.iter().cloned().collect()),
        })
        .collect();
    let dirty: Vec<UnitRanges> =
        inner.dirty.iter().map(|(&k, u)| (k, u.ranges.minus(&u.logged).iter().cloned().collect())).collect();
    let mut spans = Vec::new();
    for (unit, ranges, from_flight) in
        in_flight.iter().map(|(k, r)| (*k, r, true)).chain(dirty.iter().map(|(k, r)| (*k, r, false)))
    {
        for r in ranges {
            let end = r.end.min(inner.size.saturating_sub(unit * unit_bytes));
            if r.start < end {
                spans.push((unit, r.start..end, from_flight));
            }
        }
    }
    (dirty, spans)
}

/// Whether the directory `dir` is durable on the backend, or the log holds what replay needs to
/// make it again: every directory made since the checkpoint on its way up has its one name in
/// the log (its Create and any Rename since; an exchange or a hard link loses that).
fn logged_path(d: &HashMap<u64, Durability>, mut dir: u64) -> bool {
    // Bounded: a cycle cannot happen (names form a tree), but a bound costs nothing.
    for _ in 0..4096 {
        match d.get(&dir) {
            Some(entry) if entry.created => match entry.named_in {
                Some(parent) => dir = parent,
                None => return false,
            },
            _ => return true,
        }
    }
    false
}

/// Starts `ino`'s entry again as `fresh` (a new file, or one now in sync with the backend),
/// keeping the kernel's forgets it holds back (`Writeback::forget`): the namespace still counts them.
fn restart(map: &mut HashMap<u64, Durability>, ino: u64, fresh: Durability) {
    let forgets_held_back = map.get(&ino).map_or(0, |e| e.forgets_held_back);
    map.insert(ino, Durability { forgets_held_back, ..fresh });
}
