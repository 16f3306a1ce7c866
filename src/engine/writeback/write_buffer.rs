//! The write buffer: per file, per unit, an aligned buffer and its dirty ranges; the memory
//! bound every unit is taken from (refused data included, see SEMANTICS.md, "Data the backend
//! refuses"); what readers see (the buffer over the store's bytes); truncation through the
//! buffer; and the life of a file's state (open, last close, a file gone with data buffered).
//! Must not: write to the store (the flushers do) or decide durability (`durability` does).

use std::collections::HashMap;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::*;

impl Writeback {
    /// The state of a regular file, made on first open, of the store's size then
    /// (`store_size`). The namespace is asked to hold the file while the state exists (a file
    /// with buffered data outlives its last close).
    ///
    /// A size read while a flush of an earlier state was passing through the store (a
    /// truncate the store was given, then the bytes written since) is stale once that state
    /// has ended, idle: the file would read as that shorter size, or empty (a file truncated,
    /// rewritten and closed under checkpoints read back as zeros). So the size counts only if
    /// no state ended between its reading and the table's lock; else it is read again (not
    /// under the lock: a held file's size takes its own). Any file's state ending counts, so an
    /// open may read twice while others close; each try is one size read (an fstat), and it
    /// ends with the first window in which no state ends. A file that has a state (open
    /// elsewhere, or lingering with buffered bytes) is not asked: its state's size is the one.
    pub fn open_file(&self, id: ObjectId, mut store_size: impl FnMut() -> SysResult<u64>) -> SysResult<Arc<FileState>> {
        let (mut files, size) = loop {
            let files = lock(&self.files);
            if files.contains_key(&id) {
                break (files, 0);
            }
            drop(files);
            let ended_before = self.states_ended.load(Acquire);
            let size = store_size()?;
            let files = lock(&self.files);
            if files.contains_key(&id) || self.states_ended.load(Acquire) == ended_before {
                break (files, size);
            }
        };
        if !files.contains_key(&id) {
            self.ns.hold(id)?;
        }
        let file = files.entry(id).or_insert_with(|| {
            Arc::new(FileState {
                id,
                log_key: std::sync::OnceLock::new(),
                inner: Mutex::new(FileInner {
                    size,
                    dirty: BTreeMap::new(),
                    in_flight: BTreeMap::new(),
                    errors: FlushErrors::default(),
                    epoch: 0,
                    open_handles: 0,
                    last_write: None,
                    times_set: None,
                    cut_to: None,
                    cut_unlogged: None,
                    size_logged_since_cut: None,
                    times_pending: false,
                    times_logged: false,
                    retry_at: None,
                    backoff: Duration::ZERO,
                    forgotten: false,
                    flushes_ended: 0,
                    lingering: false,
                    data: None,
                    backend_readers: BTreeMap::new(),
                }),
                flush_ended: Condvar::new(),
                durability_points: Mutex::new(()),
            })
        });
        let mut inner = lock(&file.inner);
        self.stop_lingering(&mut inner);
        inner.open_handles += 1;
        drop(inner);
        Ok(file.clone())
    }

    /// A file's state leaves the table: the namespace stops holding it for us.
    pub(super) fn remove_state(&self, files: &mut HashMap<ObjectId, Arc<FileState>>, id: ObjectId) {
        if files.remove(&id).is_some() {
            self.states_ended.fetch_add(1, Release);
            self.ns.forget(id, 1);
        }
    }

    /// The last handle closed: a clean file's state goes; a file whose data could not be
    /// flushed, or waits for the checkpoint, keeps it, and the age timer retries. Returns
    /// whether the file now lingers so (see `forget_file`).
    pub fn release_file(&self, file: &Arc<FileState>) -> bool {
        let mut files = lock(&self.files);
        let mut inner = lock(&file.inner);
        inner.open_handles = inner.open_handles.saturating_sub(1);
        if inner.open_handles > 0 {
            return false;
        }
        if inner.dirty.is_empty() && inner.in_flight.is_empty() && inner.cut_to.is_none() && !inner.times_pending {
            self.remove_state(&mut files, file.id);
            return false;
        }
        if !inner.lingering {
            inner.lingering = true;
            self.lingering.fetch_add(1, Relaxed);
        }
        true
    }

    /// A file nobody holds open whose buffered data has all reached the backend (the age timer
    /// or a retry wrote what its last close could not), or one forgotten under its own lock
    /// (`end_flush`, which must not take the files' lock): its state goes.
    pub(super) fn drop_if_idle(&self, file: &Arc<FileState>) {
        let mut files = lock(&self.files);
        let mut inner = lock(&file.inner);
        let idle = inner.open_handles == 0
            && inner.dirty.is_empty()
            && inner.in_flight.is_empty()
            && inner.cut_to.is_none()
            && !inner.times_pending;
        if (idle || inner.forgotten) && files.get(&file.id).is_some_and(|f| Arc::ptr_eq(f, file)) {
            self.remove_state(&mut files, file.id);
            self.stop_lingering(&mut inner);
        }
    }

    pub(super) fn stop_lingering(&self, inner: &mut FileInner) {
        if inner.lingering {
            inner.lingering = false;
            self.lingering.fetch_sub(1, Relaxed);
        }
    }

    /// Whether some file nobody holds open still has data buffered (see `forget_file`).
    pub fn has_lingering_files(&self) -> bool {
        self.lingering.load(Relaxed) > 0
    }

    /// Whether `ino` is such a file.
    pub fn is_lingering(&self, ino: u64) -> bool {
        self.file(ino).is_some_and(|f| lock(&f.inner).open_handles == 0)
    }

    /// The file's last name is gone and no handle is open: its buffered data can never be read
    /// or written again, refused data included. It is dropped with the file's backend
    /// descriptors, so the backend frees the space (a flush still in flight finishes first).
    pub fn forget_file(&self, ino: u64) {
        let mut files = lock(&self.files);
        let Some(file) = files.get(&ino).cloned() else { return };
        let mut inner = lock(&file.inner);
        if inner.open_handles > 0 || inner.forgotten {
            return;
        }
        let dropped = self.drop_buffered(&mut inner);
        self.remove_state(&mut files, ino);
        self.stop_lingering(&mut inner);
        if dropped > 0 {
            log::info!("inode {ino}: deleted with {dropped} bytes still buffered; they are dropped");
        }
    }

    /// The file is gone and nobody can read or write it: everything it buffers goes, and no
    /// flush takes it up again. Returns the bytes dropped.
    pub(super) fn drop_buffered(&self, inner: &mut FileInner) -> u64 {
        let mut dropped = 0;
        for (_, unit) in std::mem::take(&mut inner.dirty) {
            dropped += unit.ranges.bytes();
            self.release_unit_memory(unit.refused);
        }
        inner.forgotten = true;
        inner.data = None;
        dropped
    }

    /// Whether the backend's object has no name left. A handle that no longer opens anything
    /// (ESTALE: the local backend reopens an object whose descriptor it let go by its file
    /// handle) is an object deleted.
    pub fn has_no_name(&self, id: u64) -> bool {
        match self.ns.getattr(id) {
            Ok(attr) => attr.nlink == 0,
            Err(Errno(libc::ESTALE)) => true,
            Err(_) => false,
        }
    }

    /// Takes a unit's worth of buffer memory for a writer. The bound holds for every byte,
    /// refused ones included (SEMANTICS.md, "Data the backend refuses"): the writer waits while
    /// memory can come free (flushes under way or possible), at most `io_timeout` without any
    /// coming free; refused data whose writers have been told is discarded for it; and when
    /// all that is left is refused data whose writer has not been told yet, it fails at once
    /// with the backend's error rather than wait for a retry that may never succeed.
    pub(super) fn acquire_unit_memory(&self) -> SysResult<()> {
        let unit = self.config.unit_bytes;
        let mut waited = false;
        let mut last_progress = Instant::now();
        let mut used = lock(&self.budget.used_bytes);
        let mut least_used = *used;
        while *used + unit > self.budget.limit_bytes {
            if !waited {
                self.metrics.buffer_waits.fetch_add(1, Relaxed);
                waited = true;
            }
            if *used < least_used {
                least_used = *used;
                last_progress = Instant::now();
            }
            // Memory pressure: partial units go to the flushers too. Done without holding the
            // budget lock, since it takes file locks.
            drop(used);
            self.flush_everything_wanted();
            let (refused, last_error) = {
                let r = lock(&self.refused);
                (r.bytes, r.last_error)
            };
            used = lock(&self.budget.used_bytes);
            if *used + unit <= self.budget.limit_bytes {
                break;
            }
            if used.saturating_sub(refused) < unit {
                drop(used);
                if self.discard_told_refusals() == 0 {
                    return Err(last_error.unwrap_or(Errno(libc::EIO)));
                }
                used = lock(&self.budget.used_bytes);
                continue;
            }
            if last_progress.elapsed() > self.config.io_timeout {
                log::error!(
                    "no write buffer memory came free for {} s (the backend takes nothing): a write fails with EIO",
                    self.config.io_timeout.as_secs()
                );
                return Err(last_error.unwrap_or(Errno(libc::EIO)));
            }
            used = self.budget.freed.wait_timeout(used, Duration::from_millis(50)).unwrap().0;
        }
        self.count_unit_taken(&mut used);
        Ok(())
    }

    /// Counts one more unit's memory as used, under the budget's lock (`used`), where the caller
    /// found room for it.
    fn count_unit_taken(&self, used: &mut u64) {
        *used += self.config.unit_bytes;
        assert!(*used <= self.budget.limit_bytes, "buffer memory {} past its bound {}", *used, self.budget.limit_bytes);
        self.metrics.buffer_bytes_used.store(*used, Relaxed);
    }

    /// Counts a unit's memory as refused by the backend (`err`), once.
    pub(super) fn mark_refused(&self, unit: &mut DirtyUnit, err: Errno) {
        let mut refused = lock(&self.refused);
        if !unit.refused {
            unit.refused = true;
            refused.bytes += self.config.unit_bytes;
        }
        refused.last_error = Some(err);
        self.metrics.buffer_refused_bytes.store(refused.bytes, Relaxed);
    }

    /// Frees the memory of refused units whose files' writers have been told of the failure,
    /// except bytes the intent log acknowledged (fsynced through the log: never dropped).
    /// Counted and logged; returns the bytes of memory freed.
    pub(super) fn discard_told_refusals(&self) -> u64 {
        let mut freed = 0;
        for file in self.open_files() {
            let mut inner = lock(&file.inner);
            let told = inner.errors.told_through();
            let doomed: Vec<u64> = inner
                .dirty
                .iter()
                .filter(|(_, u)| u.refused && u.logged.is_empty() && u.refused_since.is_some_and(|first| first <= told))
                .map(|(&k, _)| k)
                .collect();
            if doomed.is_empty() {
                continue;
            }
            let mut lost = 0;
            for unit in doomed {
                let dirty = inner.dirty.remove(&unit).expect("listed above");
                lost += dirty.ranges.bytes();
                self.release_unit_memory(dirty.refused);
                freed += self.config.unit_bytes;
            }
            self.shrink_to_what_remains(&file, &mut inner);
            self.metrics.buffer_discarded_bytes.fetch_add(lost, Relaxed);
            inner.errors.record_discard();
            log::warn!(
                "{}: {lost} written bytes the backend refused ({}) were discarded to make room in the write buffer; \
                 the file's writer had been told",
                self.name_of(&file),
                inner.errors.error()
            );
        }
        freed
    }

    /// After buffered data was dropped: the logical size comes back to what is left, the
    /// backend's bytes and the buffer's.
    pub(super) fn shrink_to_what_remains(&self, file: &FileState, inner: &mut FileInner) {
        let unit_bytes = self.config.unit_bytes;
        let buffered_end = inner
            .dirty
            .iter()
            .map(|(&k, u)| (k, u.ranges.iter().last().map_or(0, |r| r.end)))
            .chain(inner.in_flight.iter().map(|(&k, u)| (k, u.ranges.iter().last().map_or(0, |r| r.end))))
            .map(|(unit, end)| unit * unit_bytes + end)
            .max()
            .unwrap_or(0);
        let backend_size = self.file_data(file, inner).and_then(|data| data.size()).unwrap_or(0);
        inner.size = inner.size.min(backend_size.max(buffered_end));
    }

    /// A unit's memory leaves the buffer (its bytes flushed, dropped or discarded), and with it,
    /// if the unit was counted as refused (`was_refused`), its share of the refused memory.
    pub(super) fn release_unit_memory(&self, was_refused: bool) {
        if was_refused {
            let mut refused = lock(&self.refused);
            assert!(refused.bytes >= self.config.unit_bytes, "refused memory accounting went negative");
            refused.bytes -= self.config.unit_bytes;
            self.metrics.buffer_refused_bytes.store(refused.bytes, Relaxed);
        }
        let mut used = lock(&self.budget.used_bytes);
        assert!(*used >= self.config.unit_bytes, "buffer accounting went negative");
        *used -= self.config.unit_bytes;
        self.metrics.buffer_bytes_used.store(*used, Relaxed);
        self.budget.freed.notify_all();
    }

    /// Buffers one write. A refused flush is not reported here (close and fsync try again and
    /// report); a write fails when the buffer holds nothing but refused bytes, with the
    /// backend's error, and then counts as the file's writer having been told.
    /// `from_page_cache`: the kernel writing back its cache, not an application's write(2).
    /// Returns how many bytes were taken: all of them, or fewer when buffer memory ran out part
    /// way (the next write then hears why).
    ///
    /// `acknowledge`, given for a write that may be answered before its bytes are in (not
    /// O_DSYNC): a large write whose units' memory is free at once is answered (`acknowledge`
    /// called with all its bytes) before they are copied in, the file's lock held from before the
    /// answer to after the copy, so that nothing reads, flushes or logs the range in between.
    /// The copy cannot fail, so the answer stands. Over /dev/fuse the kernel then hands the
    /// writer's next request to another thread while this one copies: a stream of large writes
    /// pays the kernel's copy into the request and ours into the unit side by side, not one
    /// after the other.
    pub fn write(
        &self,
        file: &Arc<FileState>,
        offset: u64,
        bytes: WriteBytes<'_>,
        from_page_cache: bool,
        acknowledge: Option<&mut dyn FnMut(usize)>,
    ) -> SysResult<usize> {
        if from_page_cache {
            self.keep_the_kernels_mtime(file);
        }
        let unit_bytes = self.config.unit_bytes;
        let end = offset + bytes.len() as u64;
        if let Some(acknowledge) = acknowledge.filter(|_| bytes.len() as u64 >= ACKNOWLEDGE_BEFORE_COPY_MIN_BYTES) {
            let units = offset / unit_bytes..=(end - 1) / unit_bytes;
            if let Some(mut inner) = self.lock_with_units_buffered(file, units) {
                acknowledge(bytes.len());
                let mut pos = offset;
                while pos < end {
                    let piece_end = end.min((pos / unit_bytes + 1) * unit_bytes);
                    let piece = bytes.piece((pos - offset) as usize..(piece_end - offset) as usize);
                    self.put_piece(file, &mut inner, pos, piece, from_page_cache);
                    pos = piece_end;
                }
                return Ok(bytes.len());
            }
            // Memory is short: the units are taken one by one below, waiting for the flushers
            // as they need, each copied before the answer.
        }
        let mut pos = offset;
        while pos < end {
            let unit = pos / unit_bytes;
            let piece_end = end.min((unit + 1) * unit_bytes);
            let mut inner = lock(&file.inner);
            if !inner.dirty.contains_key(&unit) {
                drop(inner);
                if let Err(e) = self.acquire_unit_memory() {
                    if !from_page_cache {
                        lock(&file.inner).errors.mark_told(ErrorReport::Write);
                    }
                    let taken = (pos - offset) as usize;
                    return if taken > 0 { Ok(taken) } else { Err(e) };
                }
                inner = lock(&file.inner);
                if inner.dirty.contains_key(&unit) {
                    self.release_unit_memory(false); // another writer made it meanwhile
                } else {
                    let epoch = inner.epoch;
                    inner.dirty.insert(unit, DirtyUnit::empty(unit_bytes, epoch));
                }
            }
            let piece = bytes.piece((pos - offset) as usize..(piece_end - offset) as usize);
            self.put_piece(file, &mut inner, pos, piece, from_page_cache);
            pos = piece_end;
        }
        Ok(bytes.len())
    }

    /// `write` of bytes the buffer copies: the in-process tests' form.
    #[cfg(test)]
    pub fn write_copied(
        &self,
        file: &Arc<FileState>,
        offset: u64,
        bytes: &[u8],
        from_page_cache: bool,
        acknowledge: Option<&mut dyn FnMut(usize)>,
    ) -> SysResult<usize> {
        self.write(file, offset, WriteBytes::copied(bytes), from_page_cache, acknowledge)
    }

    /// The file's lock, with every unit of `units` in the write buffer, or None (nothing
    /// taken) when that needs memory the buffer does not have free at once: the caller is
    /// about to answer a write before copying it, and must not wait for the flushers while
    /// holding memory they may need, nor with its answer late.
    fn lock_with_units_buffered<'file>(
        &self,
        file: &'file FileState,
        units: std::ops::RangeInclusive<u64>,
    ) -> Option<MutexGuard<'file, FileInner>> {
        let unit_bytes = self.config.unit_bytes;
        let mut reserved = 0u64;
        loop {
            let mut inner = lock(&file.inner);
            let missing: Vec<u64> = units.clone().filter(|unit| !inner.dirty.contains_key(unit)).collect();
            if missing.len() as u64 <= reserved {
                let epoch = inner.epoch;
                for unit in &missing {
                    inner.dirty.insert(*unit, DirtyUnit::empty(unit_bytes, epoch));
                }
                for _ in missing.len() as u64..reserved {
                    self.release_unit_memory(false); // another writer made it meanwhile
                }
                return Some(inner);
            }
            drop(inner);
            while reserved < missing.len() as u64 {
                if !self.try_acquire_unit_memory() {
                    for _ in 0..reserved {
                        self.release_unit_memory(false);
                    }
                    return None;
                }
                reserved += 1;
            }
        }
    }

    /// One unit's memory from the budget if it is free now, without waiting.
    fn try_acquire_unit_memory(&self) -> bool {
        let mut used = lock(&self.budget.used_bytes);
        if *used + self.config.unit_bytes > self.budget.limit_bytes {
            return false;
        }
        self.count_unit_taken(&mut used);
        true
    }

    /// Copies `piece` (within one unit, which is in the buffer) in at `pos`, and notes what
    /// the write changed: the unit's ranges and log state, its flush when it is whole, the
    /// file's size and times.
    fn put_piece(
        &self,
        file: &Arc<FileState>,
        inner: &mut FileInner,
        pos: u64,
        piece: WriteBytes<'_>,
        from_page_cache: bool,
    ) {
        let unit_bytes = self.config.unit_bytes;
        let unit = pos / unit_bytes;
        let from = pos - unit * unit_bytes;
        let to = from + piece.len() as u64;
        assert!(to <= unit_bytes, "a piece of {} bytes at {pos} crosses its unit of {unit_bytes}", piece.len());
        let in_flight = inner.in_flight.contains_key(&unit);
        let dirty = inner.dirty.get_mut(&unit).expect("the unit is in the buffer");
        if dirty.buf.write_taking(from as usize, piece) {
            self.metrics.write_pages_exchanged_bytes.fetch_add(piece.len() as u64, Relaxed);
        }
        dirty.ranges.insert(from..to);
        if !dirty.logged.is_empty() {
            dirty.logged = dirty.logged.minus(&RangeSet::from(from..to));
        }
        let full = dirty.ranges.covers(0, unit_bytes);
        if full && !dirty.wanted {
            dirty.wanted = true;
            if !in_flight {
                self.push_job(file, unit);
            }
        }
        inner.size = inner.size.max(pos + piece.len() as u64);
        // The kernel's own writeback of its cache is not a new write: in that mode the
        // kernel keeps the times and sends them itself.
        if !from_page_cache {
            inner.last_write = Some(crate::sys::coarse_now());
            inner.times_set = None;
            inner.times_pending = false;
            inner.times_logged = false;
        }
    }

    /// Under the kernel's writeback cache the kernel keeps a regular file's times: it stamps
    /// them when the application writes into its cache, and sends them (a SETATTR before the
    /// close's FLUSH) when that changed them. A write in the clock tick of the file's creation
    /// changes nothing, so nothing is sent, and the kernel shows the creation's mtime; the flush
    /// of those pages must leave the backend's mtime at that too, or the file shows a later
    /// one once the kernel forgets it (a C build's objects then looked newer than the program
    /// linked from them, and `make -q` found the build out of date). So before the first of
    /// the kernel's pages reaches the buffer, the backend's mtime (what the kernel was told)
    /// becomes the file's `times_set`, which every flush sets again and the kernel's own SETATTR
    /// replaces.
    fn keep_the_kernels_mtime(&self, file: &FileState) {
        if lock(&file.inner).times_set.is_some() {
            return;
        }
        let Ok(attr) = self.ns.getattr(file.id) else { return };
        let mut inner = lock(&file.inner);
        if inner.times_set.is_none() {
            inner.times_set = Some(TimesToSet { atime: None, mtime: Some(TimeToSet::At(attr.mtime)) });
        }
    }

    pub fn size(&self, file: &FileState) -> u64 {
        lock(&file.inner).size
    }

    /// Whether any of the file's data is in memory (buffered or on its way to the backend).
    pub fn has_buffered_data(&self, file: &FileState) -> bool {
        let inner = lock(&file.inner);
        !inner.dirty.is_empty() || !inner.in_flight.is_empty()
    }

    pub fn last_write(&self, file: &FileState) -> Option<SystemTime> {
        lock(&file.inner).last_write
    }

    /// Times set on the file that wait with its logged changes (see `defer_times`).
    pub fn pending_times(&self, file: &FileState) -> Option<TimesToSet> {
        let inner = lock(&file.inner);
        inner.times_set.filter(|_| inner.times_pending)
    }

    /// With the log, times set on a file whose changes wait in the log for the checkpoint (a
    /// truncate, or bytes of a file the log can stand for) wait with them: kept here, logged
    /// with the file's next batch (an Attrs record), and set on the backend by the flush that
    /// gives it the rest. The kernel sends the times its writeback cache kept at every close:
    /// set at once, they would cost the file a journal commit of its own. Returns whether it
    /// kept them (else the caller sets them on the backend).
    pub fn defer_times(&self, file: &FileState, times: TimesToSet) -> bool {
        if self.log.is_none() {
            return false;
        }
        let mut inner = lock(&file.inner);
        let waiting = inner.cut_to.is_some() || !inner.dirty.is_empty();
        if !waiting || !inner.in_flight.is_empty() || self.log_eligibility(file.id) != Some(false) {
            return false;
        }
        let earlier = inner.times_set.unwrap_or_default();
        inner.times_set =
            Some(TimesToSet { atime: times.atime.or(earlier.atime), mtime: times.mtime.or(earlier.mtime) });
        inner.times_pending = true;
        inner.times_logged = false;
        inner.last_write = None;
        true
    }

    /// An application set the file's times (already on the backend, with no UTIME_NOW left in
    /// them): they outrank the last buffered write's time, and flushes still to come of data
    /// written before now must not overwrite them (see `FileInner::times_set`). Kept though
    /// nothing is buffered yet: at a close, the kernel's writeback cache submits the WRITE
    /// requests of its cached pages and then sends the times it kept for them, and a daemon
    /// thread may serve the times first; the flush of those pages must not stamp the backend
    /// with its own time. A write from the application itself clears them.
    pub fn note_times_set(&self, file: &FileState, times: TimesToSet) {
        let mut inner = lock(&file.inner);
        inner.last_write = None;
        let earlier = inner.times_set.unwrap_or_default();
        inner.times_set =
            Some(TimesToSet { atime: times.atime.or(earlier.atime), mtime: times.mtime.or(earlier.mtime) });
    }

    /// A size change: buffered data beyond the new size is dropped (after waiting for units in
    /// flight there), then the backend file takes the size; with the log, a file it can stand
    /// for made shorter gives the store its truncate at the next flush (`FileInner::cut_to`).
    pub fn set_size(&self, file: &Arc<FileState>, size: u64) -> SysResult<()> {
        let unit_bytes = self.config.unit_bytes;
        let first_affected = size / unit_bytes;
        let inner = lock(&file.inner);
        let mut inner = self.wait_for_flushes(file, inner, "a truncate", |inner| {
            Ok(inner.in_flight.range(first_affected..).next().is_some())
        })?;
        let beyond: Vec<u64> = inner.dirty.range(first_affected..).map(|(&k, _)| k).collect();
        for unit in beyond {
            let unit_start = unit * unit_bytes;
            let dirty = inner.dirty.get_mut(&unit).expect("listed above");
            if unit_start < size {
                let keep = size - unit_start;
                dirty.ranges.clip_end(keep);
                dirty.buf.zero_from(keep as usize);
            }
            if unit_start >= size || dirty.ranges.is_empty() {
                let dropped = inner.dirty.remove(&unit).expect("listed above");
                self.release_unit_memory(dropped.refused);
            }
        }
        // A file the log can stand for (an existing one, in sync with the store), made
        // shorter: the store's truncate waits for its next flush (see `FileInner::cut_to`).
        let deferred = size < inner.size && self.log.is_some() && self.log_eligibility(file.id) == Some(false);
        if deferred || (inner.cut_to.is_some() && size >= inner.size) {
            if deferred {
                inner.cut_to = Some(inner.cut_to.map_or(size, |cut| cut.min(size)));
                inner.cut_unlogged = Some(inner.cut_unlogged.map_or(size, |cut| cut.min(size)));
                inner.size_logged_since_cut = None;
            }
            inner.size = size;
            // A change of size is a modification: the file's mtime and ctime, as the backend's
            // truncate would have set them.
            inner.last_write = Some(crate::sys::coarse_now());
            inner.times_set = None;
            inner.times_pending = false;
            inner.times_logged = false;
            return Ok(());
        }
        self.file_data(file, &mut inner)?.set_size(size)?;
        inner.size = size;
        self.note_backend_changed(file.id);
        Ok(())
    }

    /// After the backend grew the file by itself (fallocate, copy_file_range).
    pub fn note_backend_size(&self, file: &FileState, size: u64) {
        let mut inner = lock(&file.inner);
        inner.size = inner.size.max(size);
    }

    /// Offers the store's data the create of a file opened, for the flushes to write through
    /// where they have none yet: one open of the store per new file instead of two (through /proc/self/fd on the local directory, 5.5 us here, once per file tar
    /// extracts).
    pub fn share_data(&self, file: &FileState, data: &Arc<dyn FileData>) {
        let mut inner = lock(&file.inner);
        if inner.data.is_none() && !inner.forgotten {
            inner.data = Some(data.clone());
        }
    }

    /// Whether `file_data` makes the file on the backend first, if it is held: it has grown
    /// past what its close would log. Only ids given to held files can be held: a flush of any
    /// other file asks the held files nothing, and its flusher keeps the file's lock.
    pub(super) fn made_on_backend_for_flush(&self, file: &FileState, inner: &FileInner) -> bool {
        self.pending.is_some()
            && file.id >= crate::engine::pending::PENDING_ID_BASE
            && inner.size > self.config.log_threshold_new_bytes
    }

    /// The file's data in the store, opened for writing by whoever first needs it.
    pub(super) fn file_data(&self, file: &FileState, inner: &mut FileInner) -> SysResult<Arc<dyn FileData>> {
        // A held file (`pending`) grown past what its close would log: the backend makes it
        // now, and its bytes go there. (Logged while small, as a shell's redirection closes the
        // new file once before anything is written: synced with its bytes at its close.)
        if self.made_on_backend_for_flush(file, inner) {
            self.make_held_for_flush(file.id)?;
        }
        let data = match &inner.data {
            Some(data) => data.clone(),
            None => {
                let data = self.store.open(file.id, OpenMode { write: true, no_atime: false })?;
                inner.data = Some(data.clone());
                data
            }
        };
        // A truncate the store has not been given yet goes first: whoever writes or reads the
        // store through here must find the file's bytes, not the ones the truncate dropped
        // (or, where the buffer holds every byte past it, their reads get the buffer's).
        if let Some(cut) = inner.cut_to {
            if inner.buffer_holds_all_from(cut, self.config.unit_bytes) {
                // An O_TRUNC rewrite, whole in the buffer: the store's blocks are written over
                // in place instead of freed by the truncate and allocated again by the writes,
                // which costs the backing file system its block bitmap, group descriptor and
                // extent changes (an extra bitmap block in each rewrite where the new blocks
                // landed in another group). Readers meanwhile get the buffer's bytes over every
                // byte the store still holds from before; a crash before the flushes end leaves
                // old bytes where new ones were not yet written, as a rewrite's truncate that was
                // not acknowledged may (and replay applies a logged truncate first).
                if data.size()? != inner.size {
                    data.set_size(inner.size)?;
                }
                self.metrics.backend_truncates_written_over.fetch_add(1, Relaxed);
            } else {
                data.set_size(cut)?;
                if inner.size > cut {
                    data.set_size(inner.size)?;
                }
            }
            inner.cut_to = None;
            inner.cut_unlogged = None;
            inner.size_logged_since_cut = None;
            self.note_backend_changed(file.id);
        }
        Ok(data)
    }

    /// Copies what the write buffer holds for [offset, offset+len) over `out`, which holds the
    /// backend's bytes for that range (zeros where the backend file is shorter). Returns the
    /// logical size; the caller trims the read to it.
    /// Also waits until no unit in the range is being flushed and registers the read, until
    /// the returned guard drops, so that none is (see `FileInner::backend_readers`).
    pub fn snapshot_overlay<'a>(&self, file: &'a FileState, offset: u64, len: u64) -> SysResult<Overlay<'a>> {
        let unit_bytes = self.config.unit_bytes;
        let end = offset + len;
        let first = offset / unit_bytes;
        let last = end.saturating_sub(1) / unit_bytes;
        let inner = lock(&file.inner);
        let mut inner = self.wait_for_flushes(file, inner, "a read", |inner| {
            Ok(inner.in_flight.range(first..=last).next().is_some())
        })?;
        for unit in first..=last {
            *inner.backend_readers.entry(unit).or_insert(0) += 1;
        }
        let reading = BackendRead { file, units: first..=last };
        let mut pieces = Vec::new();
        // The store's bytes past a truncate it has not been given read as zeros (first: the
        // buffer's pieces go over them).
        if let Some(cut) = inner.cut_to.filter(|&cut| cut < end) {
            let from = cut.max(offset);
            pieces.push((from, vec![0u8; (end - from) as usize]));
        }
        // In-flight first, dirty after: a dirty unit is newer than the in-flight one it covers.
        let flying = inner.in_flight.range(first..=last).map(|(&k, u)| (k, &u.buf, &u.ranges));
        let dirty = inner.dirty.range(first..=last).map(|(&k, u)| (k, &u.buf, &u.ranges));
        for (unit, buf, ranges) in flying.chain(dirty) {
            let unit_start = unit * unit_bytes;
            for r in ranges.iter() {
                let (a, b) = ((unit_start + r.start).max(offset), (unit_start + r.end).min(end));
                if a < b {
                    pieces.push((a, buf.as_slice()[(a - unit_start) as usize..(b - unit_start) as usize].to_vec()));
                }
            }
        }
        Ok((inner.size, pieces, reading))
    }
}
