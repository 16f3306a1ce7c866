//! The flushers and the flush policy: which units go to the store and when (full at once;
//! partial on fsync, close, age or memory pressure; refused ones after a backoff), parallel
//! flusher threads, how a unit is written (whole for a store that takes whole units only), and
//! the bounded wait of whoever waits for a flush.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use super::*;

/// Which flushers a flush that is wanted goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// The pool's flushers, wherever the scheduler runs them.
    Pool,
    /// A single unit to the near flusher of the caller's CPU (when idle), more to the pool.
    NearIfOne,
}

impl Writeback {
    pub(super) fn push_job(&self, file: &Arc<FileState>, unit: u64) {
        lock(&self.queue).push_back(Job { file: file.clone(), unit });
        self.queue_ready.notify_one();
    }

    /// Queues every dirty unit of `file` (with `epoch <= up_to`) that is not queued yet.
    pub(super) fn want_all(&self, file: &Arc<FileState>, inner: &mut FileInner, up_to: u64) {
        self.want_where(file, inner, |dirty| dirty.epoch <= up_to, Placement::Pool);
    }

    /// Queues every dirty unit of `file` that `wanted` picks and is not queued yet.
    fn want_where(
        &self,
        file: &Arc<FileState>,
        inner: &mut FileInner,
        wanted: impl Fn(&DirtyUnit) -> bool,
        placement: Placement,
    ) {
        let mut jobs = Vec::new();
        for (&unit, dirty) in &mut inner.dirty {
            if !dirty.wanted && wanted(dirty) {
                dirty.wanted = true;
                if !inner.in_flight.contains_key(&unit) {
                    jobs.push(unit);
                }
            }
        }
        match jobs[..] {
            [only] if placement == Placement::NearIfOne => self.push_job_near(file, only),
            _ => jobs.into_iter().for_each(|unit| self.push_job(file, unit)),
        }
    }

    /// Memory pressure: every buffered unit to the flushers, except refused ones of files still
    /// waiting out their retry backoff (see `end_flush`). Their other units go: each is tried
    /// once, and either frees its memory or is refused in turn, which is what lets a writer
    /// short of memory hear of the refusal at once instead of waiting out `io_timeout`.
    pub(super) fn flush_everything_wanted(&self) {
        let files = self.open_files();
        let now = Instant::now();
        for file in files {
            let mut inner = lock(&file.inner);
            if inner.retry_at.is_some_and(|at| at > now) {
                self.want_where(&file, &mut inner, |dirty| !dirty.refused, Placement::Pool);
            } else {
                self.want_all(&file, &mut inner, u64::MAX);
            }
        }
    }

    /// Waits on the file's flushes while `busy` says so. A backend that answers nothing (no
    /// flush of the file ends) for `io_timeout` makes the wait fail with EIO: the request
    /// returns, its process stays killable, and the flush goes on.
    pub(super) fn wait_for_flushes<'a>(
        &self,
        file: &'a FileState,
        mut inner: MutexGuard<'a, FileInner>,
        what: &str,
        mut busy: impl FnMut(&mut FileInner) -> Result<bool, Errno>,
    ) -> SysResult<MutexGuard<'a, FileInner>> {
        let mut seen = inner.flushes_ended;
        let mut since = Instant::now();
        while busy(&mut inner)? {
            if inner.flushes_ended != seen {
                seen = inner.flushes_ended;
                since = Instant::now();
            } else if since.elapsed() >= self.config.io_timeout {
                log::error!(
                    "{}: {what} waited {} s for the backend, which finished nothing: EIO",
                    self.name_of(file),
                    self.config.io_timeout.as_secs()
                );
                return Err(Errno(libc::EIO));
            }
            let step = self.config.io_timeout.saturating_sub(since.elapsed()).min(Duration::from_secs(1));
            inner = file.flush_ended.wait_timeout(inner, step.max(Duration::from_millis(1))).unwrap().0;
        }
        Ok(inner)
    }

    /// How a file is named in the daemon's log: its path in the store, else its id.
    pub(super) fn name_of(&self, file: &FileState) -> String {
        self.ns.describe(file.id).unwrap_or_else(|| format!("inode {}", file.id))
    }

    /// Everything written to the store made durable: a checkpoint's one sync.
    pub(super) fn sync_backend(&self) -> SysResult<()> {
        self.store.sync_all()
    }

    /// Flushes every unit of `file` dirty now and waits for them; with `sync_backend`, then
    /// makes the backend durable (fsync/fdatasync). A flush failure `report` has not been told
    /// of yet ends the wait with its error; the data stays buffered for the next attempt.
    pub fn flush_file(&self, file: &Arc<FileState>, sync_backend: Option<bool>, report: ErrorReport) -> SysResult<()> {
        let mut inner = lock(&file.inner);
        let target = inner.epoch;
        let failures_before = inner.errors.failures;
        inner.epoch += 1;
        // The caller only waits (with a bound, see wait_for_flushes) while flushers make the
        // backend calls: a backend call that never returns must not take the request with it.
        // One unit (a small file's) goes to the flusher on the caller's CPU (`near`); more go to
        // the pool, which writes them in parallel.
        self.want_where(file, &mut inner, |dirty| dirty.epoch <= target, Placement::NearIfOne);
        let mut inner = self.wait_for_flushes(file, inner, "a flush", |inner| {
            if inner.forgotten {
                return Ok(false);
            }
            if let Some(err) = inner.errors.report_after_wait(report, failures_before) {
                return Err(err);
            }
            Ok(inner.dirty.values().any(|u| u.epoch <= target) || inner.in_flight.values().any(|u| u.epoch <= target))
        })?;
        if inner.forgotten {
            return Ok(()); // deleted: nothing of it is left to write or sync
        }
        if inner.cut_to.is_some() {
            self.file_data(file, &mut inner)?; // gives the store its truncate
        }
        if let Some(times) = inner.times_set.filter(|_| inner.times_pending) {
            self.ns.setattr(file.id, &SetAttr { times, ..SetAttr::default() })?;
            inner.times_pending = false;
        }
        let Some(data_only) = sync_backend else { return Ok(()) };
        if self.store.capabilities().durable_writes {
            return Ok(());
        }
        // Also when this mount never wrote the file: an earlier mount may have left its data
        // written but not yet durable.
        let data = self.file_data(file, &mut inner)?;
        drop(inner);
        data.sync(data_only)
    }

    pub(super) fn flusher_loop(&self) {
        loop {
            let job = {
                let mut queue = lock(&self.queue);
                loop {
                    if let Some(job) = queue.pop_front() {
                        break job;
                    }
                    if self.threads.stopping() {
                        return;
                    }
                    queue = self.queue_ready.wait_timeout(queue, Duration::from_millis(200)).unwrap().0;
                }
            };
            self.flush_unit(&job.file, job.unit, &mut None::<fn()>);
        }
    }

    /// `written`, where given, is taken and called once the store's call has returned, before
    /// the unit's waiters are woken (the near flusher frees its slot there: a closing thread
    /// woken by this flush may hand it its next unit at once). It is left untaken where no
    /// write was made.
    pub(super) fn flush_unit(&self, file: &Arc<FileState>, unit: u64, written: &mut Option<impl FnOnce()>) {
        let mut inner = lock(&file.inner);
        if inner.in_flight.contains_key(&unit) {
            return; // its end re-queues the newer dirty buffer, which stays `wanted`
        }
        while inner.backend_readers.contains_key(&unit) {
            inner = file.flush_ended.wait(inner).unwrap();
        }
        if inner.in_flight.contains_key(&unit) {
            return; // another flusher took it while this one waited
        }
        if inner.forgotten {
            return;
        }
        let Some(dirty) = inner.dirty.remove(&unit) else { return };
        let flying = Arc::new(FlushingUnit {
            buf: dirty.buf,
            ranges: dirty.ranges,
            epoch: dirty.epoch,
            refused: dirty.refused,
            refused_since: dirty.refused_since,
        });
        let earlier = inner.in_flight.insert(unit, flying.clone());
        assert!(earlier.is_none(), "unit {unit} in flight twice");
        let size = inner.size;
        let data = if self.made_on_backend_for_flush(file, &inner) {
            // Made with the file's lock let go (the unit is in flight meanwhile, as while it is
            // written): a stalled make held up every getattr of the file, and `ls -l` with it.
            drop(inner);
            let made = self.make_held_for_flush(file.id);
            inner = lock(&file.inner);
            made.and_then(|()| self.file_data(file, &mut inner))
        } else {
            self.file_data(file, &mut inner)
        };
        drop(inner);
        let started = Instant::now();
        let result = data.and_then(|data| self.write_unit(&*data, unit, &flying, size));
        self.metrics.record_flush_latency(started.elapsed().as_micros() as u64);
        drop(flying); // end_flush takes the unit back on failure: no other reference may remain
        if let Some(written) = written.take() {
            written();
        }
        let inner = lock(&file.inner);
        self.end_flush(file, inner, unit, result);
        // Written, or forgotten by `end_flush` (deleted behind the mount).
        self.drop_if_idle(file);
    }

    pub(super) fn end_flush(
        &self,
        file: &Arc<FileState>,
        mut inner: MutexGuard<'_, FileInner>,
        unit: u64,
        result: SysResult<()>,
    ) {
        let flown = inner.in_flight.remove(&unit).expect("a flushing unit is in flight");
        inner.flushes_ended += 1;
        match result {
            Ok(()) => {
                self.release_unit_memory(flown.refused);
                self.note_backend_changed(file.id);
                inner.retry_at = None;
                inner.backoff = Duration::ZERO;
                // Under the file's lock: no write since the times were set, so the data just
                // written is older than them.
                if let Some(times) = inner.times_set {
                    match self.ns.setattr(file.id, &SetAttr { times, ..SetAttr::default() }) {
                        Ok(()) => inner.times_pending = false,
                        Err(e) => {
                            log::warn!("{}: setting its times again after a flush failed: {e}", self.name_of(file));
                        }
                    }
                }
            }
            Err(_) if inner.forgotten => {
                // Nobody can read or write the file any more: its data has nowhere to go.
                self.release_unit_memory(flown.refused);
            }
            // Deleted behind the mount, in the backing directory (one deleted through it is
            // forgotten before its flushes could find it gone). Retried, it would fail the same
            // way at every retry and fail every checkpoint, so that the log could never empty.
            // A file still open keeps its data and its error for the application's next fsync;
            // its last release drops them.
            Err(Errno(libc::ESTALE)) if inner.open_handles == 0 && self.has_no_name(file.id) => {
                self.metrics.flush_errors.fetch_add(1, Relaxed);
                self.release_unit_memory(flown.refused);
                let dropped = flown.ranges.bytes() + self.drop_buffered(&mut inner);
                log::warn!(
                    "{}: deleted behind the mount (its backing file is gone) with {dropped} bytes buffered, \
                     which have nowhere to go: dropped",
                    self.name_of(file)
                );
            }
            Err(err) => {
                self.metrics.flush_errors.fetch_add(1, Relaxed);
                inner.errors.record(err);
                let backoff = (inner.backoff * 2).clamp(RETRY_BACKOFF_MIN, RETRY_BACKOFF_MAX);
                inner.backoff = backoff;
                inner.retry_at = Some(Instant::now() + backoff);
                log::warn!(
                    "{}: flush of unit {unit} failed: {err}; the data stays buffered, retried in {} ms",
                    self.name_of(file),
                    backoff.as_millis()
                );
                let flown = Arc::try_unwrap(flown).unwrap_or_else(|_| panic!("no reader keeps a flushing unit"));
                let refused_since = flown.refused_since.unwrap_or(inner.errors.failures);
                match inner.dirty.get_mut(&unit) {
                    Some(newer) => {
                        // Newer writes win; the failed unit fills in only what they did not touch.
                        let older = flown.ranges.minus(&newer.ranges);
                        for r in older.iter() {
                            let (a, b) = (r.start as usize, r.end as usize);
                            newer.buf.write_at(a, &flown.buf.as_slice()[a..b]);
                            newer.ranges.insert(r.clone());
                        }
                        newer.epoch = newer.epoch.min(flown.epoch);
                        newer.wanted = false;
                        newer.refused_since = Some(newer.refused_since.map_or(refused_since, |n| n.min(refused_since)));
                        self.mark_refused(newer, err);
                        self.release_unit_memory(flown.refused);
                    }
                    None => {
                        let mut back = DirtyUnit {
                            buf: flown.buf,
                            ranges: flown.ranges,
                            epoch: flown.epoch,
                            dirtied_at: Instant::now(),
                            wanted: false,
                            logged: RangeSet::default(),
                            refused: flown.refused, // counted once, by `mark_refused`
                            refused_since: Some(refused_since),
                        };
                        self.mark_refused(&mut back, err);
                        inner.dirty.insert(unit, back);
                    }
                }
            }
        }
        if let Some(newer) = inner.dirty.get(&unit) {
            if newer.wanted {
                self.push_job(file, unit);
            }
        }
        // Woken after the lock is let go: a waiter woken under it would find it held, and
        // sleep again until it is (two more switches of the CPU on each close's wait).
        drop(inner);
        file.flush_ended.notify_all();
    }

    /// Writes one unit's dirty ranges (clipped to the logical size) to the store. A store that
    /// takes whole units only gets the unit whole: what the buffer lacks is read from the store
    /// first, and counted as read for a write.
    pub(super) fn write_unit(&self, data: &dyn FileData, unit: u64, flying: &FlushingUnit, size: u64) -> SysResult<()> {
        let write = UnitWrite {
            unit,
            unit_bytes: self.config.unit_bytes,
            buf: flying.buf.as_slice(),
            ranges: &flying.ranges,
            size,
        };
        write_unit_to(&*self.store, data, &write, &self.metrics)
    }

    /// Partial units older than the age limit go to the flushers; so do units that failed
    /// before, which is how a transient backend error heals without the application's help.
    pub(super) fn age_loop(&self) {
        let tick = (self.config.flush_age / 2).clamp(Duration::from_millis(50), Duration::from_secs(1));
        while self.threads.pause_unless_stopped(tick) {
            crate::engine::buffer::unmap_cold();
            let files = self.open_files();
            let now = Instant::now();
            for file in files {
                let mut inner = lock(&file.inner);
                // A file whose last flush was refused waits out its backoff; then its refused
                // units are tried again, whatever their age.
                if inner.retry_at.is_some_and(|at| at > now) {
                    continue;
                }
                // A unit the intent log holds whole waits for the checkpoint (or memory pressure):
                // written now, its bytes would reach the store twice, and its file's metadata
                // would cost a journal commit of its own instead of a share of the checkpoint's.
                let old: Vec<u64> = inner
                    .dirty
                    .iter()
                    .filter(|(_, u)| !u.wanted && (u.refused || u.dirtied_at.elapsed() >= self.config.flush_age))
                    .filter(|(_, u)| u.refused || u.logged.is_empty() || !u.ranges.minus(&u.logged).is_empty())
                    .map(|(&k, _)| k)
                    .collect();
                for unit in old {
                    inner.dirty.get_mut(&unit).expect("listed above").wanted = true;
                    if !inner.in_flight.contains_key(&unit) {
                        self.push_job(&file, unit);
                    }
                }
            }
        }
    }
}

/// Writes one unit's dirty ranges (clipped to the logical size) to the store. A store that
/// takes whole units only gets the unit whole: what the buffer lacks is read from the store
/// first, and counted as read for a write.
pub(crate) fn write_unit_to(
    store: &dyn UnitStore,
    data: &dyn FileData,
    write: &UnitWrite<'_>,
    metrics: &Metrics,
) -> SysResult<()> {
    let limit = write.limit();
    let complete = limit > 0 && write.ranges.covers(0, limit);
    let result = if complete || store.capabilities().partial_writes || limit == 0 {
        data.write_unit(write)
    } else {
        let mut merged = AlignedBuf::zeroed(write.unit_bytes as usize);
        let read = data.read_at(merged.range_mut(0..limit as usize), write.start())?;
        metrics.backend_read_bytes_for_writes.fetch_add(read as u64, Relaxed);
        for r in write.ranges.iter() {
            let (a, b) = (r.start as usize, (r.end.min(limit)) as usize);
            if a < b {
                merged.write_at(a, &write.buf[a..b]);
            }
        }
        let whole = RangeSet::from(0..limit);
        data.write_unit(&UnitWrite { buf: merged.as_slice(), ranges: &whole, ..*write })
    };
    // Whole: the unit was written in full, not a file's shorter last piece.
    if complete && limit == write.unit_bytes {
        metrics.units_flushed_full.fetch_add(1, Relaxed);
    } else {
        metrics.units_flushed_partial.fetch_add(1, Relaxed);
    }
    result
}

/// Writes `bytes` at `offset` as unit writes (replay's data records, which are byte ranges).
pub(crate) fn write_range(
    store: &dyn UnitStore,
    data: &dyn FileData,
    offset: u64,
    bytes: &[u8],
    metrics: &Metrics,
) -> SysResult<()> {
    let unit_bytes = store.capabilities().unit_bytes;
    let size = data.size()?.max(offset + bytes.len() as u64);
    let end = offset + bytes.len() as u64;
    let mut pos = offset;
    while pos < end {
        let unit = pos / unit_bytes;
        let unit_start = unit * unit_bytes;
        let piece_end = end.min(unit_start + unit_bytes);
        let mut buf = AlignedBuf::zeroed(unit_bytes as usize);
        let (from, to) = ((pos - unit_start) as usize, (piece_end - unit_start) as usize);
        buf.write_at(from, &bytes[(pos - offset) as usize..(piece_end - offset) as usize]);
        let ranges = RangeSet::from(from as u64..to as u64);
        write_unit_to(
            store,
            data,
            &UnitWrite { unit, unit_bytes, buf: buf.as_slice(), ranges: &ranges, size },
            metrics,
        )?;
        pos = piece_end;
    }
    Ok(())
}
