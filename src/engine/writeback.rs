//! The write buffer and its flushers: where application writes become whole, aligned units.
//!
//! Per file, per unit: an aligned buffer and the dirty byte ranges in it. A unit that becomes
//! full goes to the flushers at once; a partial unit waits for more data, fsync/close, the age
//! limit, or memory pressure. Flushers write units in parallel: aligned ranges with O_DIRECT,
//! and nothing on this path ever reads old data back. A flush error keeps the data buffered and
//! reaches the application on its next write, fsync or close.
//!
//! Invariants (asserted or upheld here):
//! - A unit index is in flight at most once; a newer dirty buffer of the same unit waits for it.
//! - Bytes at or beyond the logical size are never written: truncate waits for in-flight units
//!   beyond the new size and drops their dirty data before it shrinks the backend file.
//! - Buffer memory in use (dirty + in flight) never exceeds the bound; writers wait, flushers
//!   never do, so the flushers always make progress.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use super::buffer::{AlignedBuf, RangeSet};
use super::types::{ObjectId, SetAttr, TimesToSet};
use crate::backend::{FileData, Namespace, OpenMode, UnitStore, UnitWrite};
use super::intent_log::format::Record;
use super::intent_log::{IntentLog, LogError};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};

#[derive(Debug, Clone)]
pub struct WritebackConfig {
    pub unit_bytes: u64,
    pub logical_block_bytes: u64,
    pub buffer_bytes: u64,
    pub flushers: usize,
    pub flush_age: Duration,
    /// With the intent log: the most buffered bytes of one file an fsync puts in the log
    /// rather than writing them to the backend and syncing it.
    pub log_threshold_bytes: u64,
    /// The same for a file created since the last checkpoint.
    pub log_threshold_new_bytes: u64,
    /// With the intent log: the longest between checkpoints while anything waits for one.
    pub checkpoint_interval: Duration,
    /// The longest a request waits for the backend without any progress (a flush that does
    /// not end, memory that is not freed) before it fails with EIO.
    pub io_timeout: Duration,
}

/// What the backend holds durably for one file, beyond its FileState's lifetime: whether a
/// log fsync can stand for a backend sync.
#[derive(Default, Debug)]
struct Durability {
    /// Created by this mount since the last checkpoint: the backend may not hold it durably
    /// (a log record finds its file by handle, which a power cut can invalidate), so the log
    /// holds its Create record, and nothing created inside it (a directory) can be logged.
    created: bool,
    /// For a created file: the directory inode holding its one name, which the log's Create
    /// and Rename records say. None for a file created with no name the log records, or which
    /// has since gained a second name or lost its own (link, unlink, exchange): such a file is
    /// synced on the backend path until the next checkpoint.
    named_in: Option<u64>,
    /// Flushes that reached the backend, and how many of those a sync has made durable.
    backend_changes: u64,
    synced_changes: u64,
    /// The log holds records of this file up to (and excluding) this sequence number.
    logged_before_seq: u64,
}

impl Durability {
    fn backend_in_sync(&self) -> bool {
        self.backend_changes == self.synced_changes
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The memory bound: writers take a unit's worth before they buffer into a new unit.
struct Budget {
    used_bytes: Mutex<u64>,
    freed: Condvar,
    limit_bytes: u64,
}

struct DirtyUnit {
    buf: AlignedBuf,
    ranges: RangeSet,
    /// fsync waits for every unit of an epoch up to its own.
    epoch: u64,
    dirtied_at: Instant,
    /// Someone wants it flushed (full, fsync, age, pressure); a job is queued or will be
    /// queued when the in-flight flush of the same unit ends.
    wanted: bool,
    /// Ranges whose bytes, as they are now, are in the intent log: the next log fsync need not
    /// log them again. A write takes its range out.
    logged: RangeSet,
    /// Its last flush failed: it holds bytes the backend refused (see `Writeback::refused`).
    refused: bool,
}

struct FlushingUnit {
    buf: AlignedBuf,
    ranges: RangeSet,
    epoch: u64,
}

/// Who is told of a failed flush. Each learns of every failure once, on its own account: a close
/// (any close, even a forked child's close-on-exec, which nobody checks) must not use up the
/// report an fsync is owed, and an fsync that reported it must not make the next write fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorReport {
    /// write(2), and operations that need the buffer written first (fallocate, copy_file_range).
    Write = 0,
    /// close(2) (FUSE FLUSH).
    Close = 1,
    /// fsync(2), fdatasync(2), O_SYNC/O_DSYNC writes, unmount.
    Sync = 2,
    /// The intent log's checkpoint: it only needs to know that it must try again later.
    Checkpoint = 3,
}

#[derive(Default)]
struct FlushErrors {
    last: Option<Errno>,
    failures: u64,
    /// For each `ErrorReport`, the number of failures it has been told of.
    reported: [u64; 4],
}

impl FlushErrors {
    fn record(&mut self, err: Errno) {
        self.last = Some(err);
        self.failures += 1;
    }

    /// Whether the file's writer has heard of its latest failure, in any of the ways a writer
    /// hears (write, close, fsync).
    fn writer_told(&self) -> bool {
        let told = |who: ErrorReport| self.reported[who as usize] == self.failures;
        self.failures > 0 && (told(ErrorReport::Write) || told(ErrorReport::Close) || told(ErrorReport::Sync))
    }

    /// The latest error, if this kind of caller has not been told of every failure yet.
    fn report_to(&mut self, who: ErrorReport) -> Option<Errno> {
        let reported = &mut self.reported[who as usize];
        if *reported == self.failures {
            return None;
        }
        *reported = self.failures;
        self.last
    }
}

struct FileInner {
    /// The size applications see: the backend's, plus buffered extension, less truncation.
    size: u64,
    dirty: BTreeMap<u64, DirtyUnit>,
    in_flight: BTreeMap<u64, Arc<FlushingUnit>>,
    /// Failed flushes, and what each kind of caller has been told of them.
    errors: FlushErrors,
    epoch: u64,
    open_handles: u64,
    last_write: Option<SystemTime>,
    /// Access and modification times an application set (utimensat, futimens) after its last
    /// write, while written data was still buffered: every flush that ends afterwards sets them
    /// on the backend file again, or the flush's own write would stamp it with the flush time
    /// (GNU tar writes, sets the archived mtime, then closes). The next write clears them.
    times_set: Option<TimesToSet>,
    /// The file's data in the store, opened for writing by the first flush (or truncate).
    data: Option<Arc<dyn FileData>>,
    /// After a failed flush: no retry before this (except one an application asks for with
    /// fsync or close), and the wait before the next one (see `Writeback::note_failure`).
    retry_at: Option<Instant>,
    backoff: Duration,
    /// The file is gone (its last name unlinked, no handle open): nothing of it is written
    /// any more, and a flush still in flight drops its unit when it ends.
    forgotten: bool,
    /// Flushes of this file that have ended, for waiters to see progress by.
    flushes_ended: u64,
    /// Released by its last handle with data still buffered (`Writeback::lingering` counts it).
    lingering: bool,
    /// Units whose backend bytes a reader is reading through the page cache, and how many
    /// readers. A unit is never flushed while read there, nor read there while flushed: after
    /// an O_DIRECT write the kernel must drop the cached pages it covers, and a page a reader
    /// is filling cannot be dropped (the write then fails the file with EIO, "Page cache
    /// invalidation failure on direct I/O", and the stale page stays).
    backend_readers: BTreeMap<u64, usize>,
}

/// A read of the backend's bytes under way; see `FileInner::backend_readers`.
pub struct BackendRead<'a> {
    file: &'a FileState,
    units: std::ops::RangeInclusive<u64>,
}

impl Drop for BackendRead<'_> {
    fn drop(&mut self) {
        let mut inner = lock(&self.file.inner);
        for unit in self.units.clone() {
            if let Some(readers) = inner.backend_readers.get_mut(&unit) {
                *readers -= 1;
                if *readers == 0 {
                    inner.backend_readers.remove(&unit);
                }
            }
        }
        drop(inner);
        self.file.flush_ended.notify_all();
    }
}

pub struct FileState {
    id: ObjectId,
    /// The key the intent log names the file by, asked of the namespace once.
    log_key: std::sync::OnceLock<Vec<u8>>,
    inner: Mutex<FileInner>,
    /// Signalled whenever a flush of this file ends.
    flush_ended: Condvar,
}

struct Job {
    file: Arc<FileState>,
    unit: u64,
}

pub struct Writeback {
    ns: Arc<dyn Namespace>,
    store: Arc<dyn UnitStore>,
    config: WritebackConfig,
    metrics: Arc<Metrics>,
    budget: Budget,
    queue: Mutex<VecDeque<Job>>,
    queue_ready: Condvar,
    files: Mutex<HashMap<u64, Arc<FileState>>>,
    stopping: AtomicBool,
    /// Joined at shut-down, so that each flusher's resources are gone before the daemon exits.
    flusher_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The age timer and the checkpointer, joined when the engine is abandoned.
    timer_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Files with data buffered and no handle open (see `forget_file`).
    lingering: std::sync::atomic::AtomicUsize,
    /// What shut-down could not write, once it has run.
    shut_down_report: Mutex<Option<Vec<Unwritten>>>,
    /// Bytes of buffer memory held by units the backend refused (`DirtyUnit::refused`), and
    /// the error it refused the last one with.
    refused: Mutex<RefusedMemory>,
    log: Option<IntentLog>,
    /// Per inode number; see `Durability`. Entries go at checkpoints.
    durability: Mutex<HashMap<u64, Durability>>,
    /// One checkpoint at a time; fsyncs of one file never pass each other.
    checkpointing: Mutex<()>,
}


/// Retries of a refused flush wait this long at first, twice as long after each failure that
/// follows, and at most `RETRY_BACKOFF_MAX`: a full disk is tried again every 30 s, not spun on.
const RETRY_BACKOFF_MIN: Duration = Duration::from_millis(100);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Writes one unit's dirty ranges (clipped to the logical size) to the store. A store that
/// takes whole units only gets the unit whole: what the buffer lacks is read from the store
/// first, and counted as read for a write.
pub(crate) fn write_unit_to(store: &dyn UnitStore, data: &dyn FileData, write: &UnitWrite<'_>, metrics: &Metrics) -> SysResult<()> {
    let limit = write.limit();
    let complete = limit > 0 && write.ranges.covers(0, limit);
    let result = if complete || store.capabilities().partial_writes || limit == 0 {
        data.write_unit(write)
    } else {
        let mut merged = AlignedBuf::zeroed(write.unit_bytes as usize);
        let read = data.read_at(&mut merged.as_mut_slice()[..limit as usize], write.start())?;
        metrics.backend_read_bytes_for_writes.fetch_add(read as u64, Relaxed);
        for r in write.ranges.iter() {
            let (a, b) = (r.start as usize, (r.end.min(limit)) as usize);
            if a < b {
                merged.as_mut_slice()[a..b].copy_from_slice(&write.buf[a..b]);
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
pub(crate) fn write_range(store: &dyn UnitStore, data: &dyn FileData, offset: u64, bytes: &[u8], metrics: &Metrics) -> SysResult<()> {
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
        buf.as_mut_slice()[from..to].copy_from_slice(&bytes[(pos - offset) as usize..(piece_end - offset) as usize]);
        let ranges = RangeSet::from(from as u64..to as u64);
        write_unit_to(store, data, &UnitWrite { unit, unit_bytes, buf: buf.as_slice(), ranges: &ranges, size }, metrics)?;
        pos = piece_end;
    }
    Ok(())
}

/// Data a file still held in the write buffer when the daemon had to stop.
#[derive(Clone, Debug)]
pub struct Unwritten {
    /// The file's backing path (or inode number).
    pub name: String,
    /// Written bytes lost: never acknowledged by fsync (an fsync that could not write them
    /// failed).
    pub bytes: u64,
    /// Bytes acknowledged through the intent log, which keeps them for the next mount.
    pub in_log: u64,
    pub error: Errno,
}

#[derive(Default)]
struct RefusedMemory {
    bytes: u64,
    last_error: Option<Errno>,
}


impl Writeback {
    pub fn new(
        ns: Arc<dyn Namespace>,
        store: Arc<dyn UnitStore>,
        config: WritebackConfig,
        metrics: Arc<Metrics>,
        log: Option<IntentLog>,
    ) -> Arc<Writeback> {
        assert!(config.unit_bytes.is_power_of_two() && config.logical_block_bytes.is_power_of_two());
        assert!(config.logical_block_bytes <= config.unit_bytes, "units are whole logical blocks");
        assert!(config.buffer_bytes >= config.unit_bytes, "the buffer holds at least one unit");
        metrics.buffer_bytes_limit.store(config.buffer_bytes, Relaxed);
        metrics.unit_bytes.store(config.unit_bytes, Relaxed);
        let writeback = Arc::new(Writeback {
            ns,
            store,
            budget: Budget { used_bytes: Mutex::new(0), freed: Condvar::new(), limit_bytes: config.buffer_bytes },
            config,
            metrics,
            queue: Mutex::new(VecDeque::new()),
            queue_ready: Condvar::new(),
            files: Mutex::new(HashMap::new()),
            stopping: AtomicBool::new(false),
            flusher_threads: Mutex::new(Vec::new()),
            refused: Mutex::new(RefusedMemory::default()),
            lingering: std::sync::atomic::AtomicUsize::new(0),
            timer_threads: Mutex::new(Vec::new()),
            shut_down_report: Mutex::new(None),
            log,
            durability: Mutex::new(HashMap::new()),
            checkpointing: Mutex::new(()),
        });
        for i in 0..writeback.config.flushers {
            let wb = writeback.clone();
            let thread = std::thread::Builder::new()
                .name(format!("flusher-{i}"))
                .spawn(move || wb.flusher_loop())
                .expect("spawn a flusher");
            lock(&writeback.flusher_threads).push(thread);
        }
        let wb = writeback.clone();
        let age = std::thread::Builder::new().name("flush-age".into()).spawn(move || wb.age_loop()).expect("spawn the age timer");
        lock(&writeback.timer_threads).push(age);
        if writeback.log.is_some() {
            let wb = writeback.clone();
            let checkpointer =
                std::thread::Builder::new().name("checkpoint".into()).spawn(move || wb.checkpoint_loop()).expect("spawn the checkpointer");
            lock(&writeback.timer_threads).push(checkpointer);
        }
        writeback
    }

    /// The state of a regular file, made on first open; `size` is the store's size then. The
    /// namespace is asked to hold the file while the state exists (a file with buffered data
    /// outlives its last close).
    pub fn open_file(&self, id: ObjectId, size: u64) -> SysResult<Arc<FileState>> {
        let mut files = lock(&self.files);
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
                    retry_at: None,
                    backoff: Duration::ZERO,
                    forgotten: false,
                    flushes_ended: 0,
                    lingering: false,
                    data: None,
                    backend_readers: BTreeMap::new(),
                }),
                flush_ended: Condvar::new(),
            })
        });
        let mut inner = lock(&file.inner);
        self.stop_lingering(&mut inner);
        inner.open_handles += 1;
        drop(inner);
        Ok(file.clone())
    }

    /// A file's state leaves the table: the namespace stops holding it for us.
    fn remove_state(&self, files: &mut HashMap<ObjectId, Arc<FileState>>, id: ObjectId) {
        if files.remove(&id).is_some() {
            self.ns.forget(id, 1);
        }
    }

    pub fn file(&self, ino: u64) -> Option<Arc<FileState>> {
        lock(&self.files).get(&ino).cloned()
    }

    /// The last handle closed: a clean file's state goes; a file whose data could not be
    /// flushed keeps it, and the age timer retries.
    pub fn release_file(&self, file: &Arc<FileState>) {
        let mut files = lock(&self.files);
        let mut inner = lock(&file.inner);
        inner.open_handles = inner.open_handles.saturating_sub(1);
        if inner.open_handles == 0 {
            if inner.dirty.is_empty() && inner.in_flight.is_empty() {
                self.remove_state(&mut files, file.id);
            } else if !inner.lingering {
                inner.lingering = true;
                self.lingering.fetch_add(1, Relaxed);
            }
        }
    }

    /// A file nobody holds open whose buffered data has all reached the backend: its state
    /// goes (the age timer or a retry wrote what its last close could not).
    fn drop_if_idle(&self, file: &Arc<FileState>) {
        let mut files = lock(&self.files);
        let mut inner = lock(&file.inner);
        let idle = inner.open_handles == 0 && inner.dirty.is_empty() && inner.in_flight.is_empty() && !inner.forgotten;
        if idle && files.get(&file.id).is_some_and(|f| Arc::ptr_eq(f, file)) {
            self.remove_state(&mut files, file.id);
            self.stop_lingering(&mut inner);
        }
    }

    fn stop_lingering(&self, inner: &mut FileInner) {
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
        let mut dropped = 0;
        for (_, unit) in std::mem::take(&mut inner.dirty) {
            dropped += unit.ranges.bytes();
            self.unmark_refused(&unit);
            self.release_unit_memory();
        }
        inner.forgotten = true;
        inner.data = None;
        self.remove_state(&mut files, ino);
        self.stop_lingering(&mut inner);
        if dropped > 0 {
            log::info!("inode {ino}: deleted with {dropped} bytes still buffered; they are dropped");
        }
    }

    fn push_job(&self, file: &Arc<FileState>, unit: u64) {
        lock(&self.queue).push_back(Job { file: file.clone(), unit });
        self.queue_ready.notify_one();
    }

    /// Queues every dirty unit of `file` (with `epoch <= up_to`) that is not queued yet.
    fn want_all(&self, file: &Arc<FileState>, inner: &mut FileInner, up_to: u64) {
        for (&unit, dirty) in inner.dirty.iter_mut() {
            if dirty.epoch <= up_to && !dirty.wanted {
                dirty.wanted = true;
                if !inner.in_flight.contains_key(&unit) {
                    self.push_job(file, unit);
                }
            }
        }
    }

    /// Takes a unit's worth of buffer memory for a writer. The bound holds for every byte,
    /// refused ones included (SEMANTICS.md, "Data the backend refuses"): the writer waits while
    /// memory can come free (flushes under way or possible), at most `io_timeout` without any
    /// coming free; refused data whose writers have been told is discarded for it; and when
    /// all that is left is refused data whose writer has not been told yet, it fails at once
    /// with the backend's error rather than wait for a retry that may never succeed.
    fn acquire_unit_memory(&self) -> SysResult<()> {
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
            used = self.budget.freed.wait_timeout(used, Duration::from_millis(50)).unwrap_or_else(|p| p.into_inner()).0;
        }
        *used += unit;
        self.metrics.buffer_bytes_used.store(*used, Relaxed);
        Ok(())
    }

    /// Counts a unit's memory as refused by the backend (`err`), once.
    fn mark_refused(&self, unit: &mut DirtyUnit, err: Errno) {
        let mut refused = lock(&self.refused);
        if !unit.refused {
            unit.refused = true;
            refused.bytes += self.config.unit_bytes;
        }
        refused.last_error = Some(err);
        self.metrics.buffer_refused_bytes.store(refused.bytes, Relaxed);
    }

    /// A unit leaves the dirty set (flushed, dropped or discarded): its memory, if refused,
    /// no longer is.
    fn unmark_refused(&self, unit: &DirtyUnit) {
        if unit.refused {
            let mut refused = lock(&self.refused);
            refused.bytes -= self.config.unit_bytes;
            self.metrics.buffer_refused_bytes.store(refused.bytes, Relaxed);
        }
    }

    /// Frees the memory of refused units whose files' writers have been told of the failure,
    /// except bytes the intent log acknowledged (fsynced through the log: never dropped).
    /// Counted and logged; returns the bytes of memory freed.
    fn discard_told_refusals(&self) -> u64 {
        let mut freed = 0;
        for file in self.open_files() {
            let mut inner = lock(&file.inner);
            if !inner.errors.writer_told() {
                continue;
            }
            let doomed: Vec<u64> = inner
                .dirty
                .iter()
                .filter(|(_, u)| u.refused && u.logged.is_empty())
                .map(|(&k, _)| k)
                .collect();
            if doomed.is_empty() {
                continue;
            }
            let mut lost = 0;
            for unit in doomed {
                let dirty = inner.dirty.remove(&unit).expect("listed above");
                lost += dirty.ranges.bytes();
                self.unmark_refused(&dirty);
                self.release_unit_memory();
                freed += self.config.unit_bytes;
            }
            self.shrink_to_what_remains(&file, &mut inner);
            self.metrics.buffer_discarded_bytes.fetch_add(lost, Relaxed);
            log::warn!(
                "{}: {lost} written bytes the backend refused ({}) were discarded to make room in the write buffer; \
                 the file's writer had been told",
                self.name_of(&file),
                inner.errors.last.unwrap_or(Errno(libc::EIO))
            );
        }
        freed
    }

    /// After buffered data was dropped: the logical size comes back to what is left, the
    /// backend's bytes and the buffer's.
    fn shrink_to_what_remains(&self, file: &FileState, inner: &mut FileInner) {
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

    fn release_unit_memory(&self) {
        let mut used = lock(&self.budget.used_bytes);
        assert!(*used >= self.config.unit_bytes, "buffer accounting went negative");
        *used -= self.config.unit_bytes;
        self.metrics.buffer_bytes_used.store(*used, Relaxed);
        self.budget.freed.notify_all();
    }

    /// Memory pressure: every buffered unit to the flushers, except those of files waiting to
    /// retry a refused flush (see `note_failure`).
    fn flush_everything_wanted(&self) {
        let files = self.open_files();
        let now = Instant::now();
        for file in files {
            let mut inner = lock(&file.inner);
            if inner.retry_at.is_some_and(|at| at > now) {
                continue;
            }
            self.want_all(&file, &mut inner, u64::MAX);
        }
    }

    /// Buffers one application write. Returns the sticky flush error, if any, instead.
    /// `from_page_cache`: the kernel writing back its cache, not an application's write(2). A
    /// pending flush error is then left for fsync or close: refused, the kernel would drop
    /// those pages, and the bytes with them.
    /// Returns how many bytes were taken: all of them, or fewer when buffer memory ran out part
    /// way (the next write then hears why).
    pub fn write(&self, file: &Arc<FileState>, offset: u64, bytes: &[u8], from_page_cache: bool) -> SysResult<usize> {
        if !from_page_cache {
            if let Some(err) = lock(&file.inner).errors.report_to(ErrorReport::Write) {
                return Err(err);
            }
        }
        let unit_bytes = self.config.unit_bytes;
        let end = offset + bytes.len() as u64;
        let mut pos = offset;
        while pos < end {
            let unit = pos / unit_bytes;
            let unit_start = unit * unit_bytes;
            let piece_end = end.min(unit_start + unit_bytes);
            let mut inner = lock(&file.inner);
            if !inner.dirty.contains_key(&unit) {
                drop(inner);
                if let Err(e) = self.acquire_unit_memory() {
                    let taken = (pos - offset) as usize;
                    return if taken > 0 { Ok(taken) } else { Err(e) };
                }
                inner = lock(&file.inner);
                if inner.dirty.contains_key(&unit) {
                    self.release_unit_memory(); // another writer made it meanwhile
                } else {
                    let epoch = inner.epoch;
                    inner.dirty.insert(
                        unit,
                        DirtyUnit {
                            buf: AlignedBuf::zeroed(unit_bytes as usize),
                            ranges: RangeSet::default(),
                            epoch,
                            dirtied_at: Instant::now(),
                            wanted: false,
                            logged: RangeSet::default(),
                            refused: false,
                        },
                    );
                }
            }
            let in_flight = inner.in_flight.contains_key(&unit);
            let dirty = inner.dirty.get_mut(&unit).expect("inserted above");
            let (from, to) = (pos - unit_start, piece_end - unit_start);
            dirty.buf.as_mut_slice()[from as usize..to as usize]
                .copy_from_slice(&bytes[(pos - offset) as usize..(piece_end - offset) as usize]);
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
            inner.size = inner.size.max(piece_end);
            inner.last_write = Some(SystemTime::now());
            // The kernel's own writeback of its cache is not a new write: in that mode the
            // kernel keeps the times and sends them itself.
            if !from_page_cache {
                inner.times_set = None;
            }
            pos = piece_end;
        }
        Ok(bytes.len())
    }

    /// Waits on the file's flushes while `busy` says so. A backend that answers nothing (no
    /// flush of the file ends) for `io_timeout` makes the wait fail with EIO: the request
    /// returns, its process stays killable, and the flush goes on.
    fn wait_for_flushes<'a>(
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
            inner = file.flush_ended.wait_timeout(inner, step.max(Duration::from_millis(1))).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(inner)
    }

    /// How a file is named in the daemon's log: its path in the store, else its id.
    fn name_of(&self, file: &FileState) -> String {
        self.ns.describe(file.id).unwrap_or_else(|| format!("inode {}", file.id))
    }

    /// Everything written to the store made durable: a checkpoint's one sync.
    fn sync_backend(&self) -> SysResult<()> {
        self.store.sync_all()
    }

    /// Flushes every unit of `file` dirty now and waits for them; with `sync_backend`, then
    /// makes the backend durable (fsync/fdatasync). A flush failure `report` has not been told
    /// of yet ends the wait with its error; the data stays buffered for the next attempt.
    pub fn flush_file(&self, file: &Arc<FileState>, sync_backend: Option<bool>, report: ErrorReport) -> SysResult<()> {
        let mut inner = lock(&file.inner);
        let target = inner.epoch;
        inner.epoch += 1;
        // The caller only waits (with a bound, see wait_for_flushes) while flushers make the
        // backend calls: a backend call that never returns must not take the request with it.
        self.want_all(file, &mut inner, target);
        let mut inner = self.wait_for_flushes(file, inner, "a flush", |inner| {
            if let Some(err) = inner.errors.report_to(report) {
                return Err(err);
            }
            Ok(inner.dirty.values().any(|u| u.epoch <= target) || inner.in_flight.values().any(|u| u.epoch <= target))
        })?;
        let Some(data_only) = sync_backend else { return Ok(()) };
        // Also when this mount never wrote the file: an earlier mount may have left its data
        // written but not yet durable.
        let data = self.file_data(file, &mut inner)?;
        drop(inner);
        data.sync(data_only)
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

    /// An application set the file's times (already on the backend, with no UTIME_NOW left in
    /// them): they outrank the last buffered write's time, and flushes still to come of data
    /// written before now must not overwrite them (see `FileInner::times_set`).
    pub fn note_times_set(&self, file: &FileState, times: TimesToSet) {
        let mut inner = lock(&file.inner);
        inner.last_write = None;
        if inner.dirty.is_empty() && inner.in_flight.is_empty() {
            inner.times_set = None;
            return;
        }
        let earlier = inner.times_set.unwrap_or_default();
        inner.times_set =
            Some(TimesToSet { atime: times.atime.or(earlier.atime), mtime: times.mtime.or(earlier.mtime) });
    }

    /// A size change: buffered data beyond the new size is dropped (after waiting for units in
    /// flight there), then the backend file takes the size.
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
                dirty.buf.as_mut_slice()[keep as usize..].fill(0);
            }
            if unit_start >= size || dirty.ranges.is_empty() {
                let dropped = inner.dirty.remove(&unit).expect("listed above");
                self.unmark_refused(&dropped);
                self.release_unit_memory();
            }
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

    /// The file's data in the store, opened for writing by whoever first needs it.
    fn file_data(&self, file: &FileState, inner: &mut FileInner) -> SysResult<Arc<dyn FileData>> {
        if let Some(data) = &inner.data {
            return Ok(data.clone());
        }
        let data = self.store.open(file.id, OpenMode { write: true, no_atime: false })?;
        inner.data = Some(data.clone());
        Ok(data)
    }

    /// Copies what the write buffer holds for [offset, offset+len) over `out`, which holds the
    /// backend's bytes for that range (zeros where the backend file is shorter). Returns the
    /// logical size; the caller trims the read to it.
    /// Also waits until no unit in the range is being flushed and registers the read, until
    /// the returned guard drops, so that none is (see `FileInner::backend_readers`).
    pub fn snapshot_overlay<'a>(
        &self,
        file: &'a FileState,
        offset: u64,
        len: u64,
    ) -> SysResult<(u64, Vec<(u64, Vec<u8>)>, BackendRead<'a>)> {
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

    fn flusher_loop(&self) {
        loop {
            let job = {
                let mut queue = lock(&self.queue);
                loop {
                    if let Some(job) = queue.pop_front() {
                        break job;
                    }
                    if self.stopping.load(Relaxed) {
                        return;
                    }
                    queue = self.queue_ready.wait_timeout(queue, Duration::from_millis(200)).unwrap_or_else(|p| p.into_inner()).0;
                }
            };
            self.flush_unit(&job.file, job.unit);
        }
    }

    fn flush_unit(&self, file: &Arc<FileState>, unit: u64) {
        let mut inner = lock(&file.inner);
        if inner.in_flight.contains_key(&unit) {
            return; // its end re-queues the newer dirty buffer, which stays `wanted`
        }
        while inner.backend_readers.contains_key(&unit) {
            inner = file.flush_ended.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
        if inner.in_flight.contains_key(&unit) {
            return; // another flusher took it while this one waited
        }
        if inner.forgotten {
            return;
        }
        let Some(dirty) = inner.dirty.remove(&unit) else { return };
        self.unmark_refused(&dirty);
        let flying = Arc::new(FlushingUnit { buf: dirty.buf, ranges: dirty.ranges, epoch: dirty.epoch });
        inner.in_flight.insert(unit, flying.clone());
        let size = inner.size;
        let data = self.file_data(file, &mut inner);
        drop(inner);
        let started = Instant::now();
        let result = data.and_then(|data| self.write_unit(&*data, unit, &flying, size));
        self.metrics.record_flush_latency(started.elapsed().as_micros() as u64);
        drop(flying); // end_flush takes the unit back on failure: no other reference may remain
        let succeeded = result.is_ok();
        let inner = lock(&file.inner);
        self.end_flush(file, inner, unit, result);
        if succeeded {
            self.drop_if_idle(file);
        }
    }

    fn end_flush(&self, file: &Arc<FileState>, mut inner: MutexGuard<'_, FileInner>, unit: u64, result: SysResult<()>) {
        let flown = inner.in_flight.remove(&unit).expect("a flushing unit is in flight");
        inner.flushes_ended += 1;
        match result {
            Ok(()) => {
                self.release_unit_memory();
                self.note_backend_changed(file.id);
                inner.retry_at = None;
                inner.backoff = Duration::ZERO;
                // Under the file's lock: no write since the times were set, so the data just
                // written is older than them.
                if let Some(times) = inner.times_set {
                    if let Err(e) = self.ns.setattr(file.id, &SetAttr { times, ..SetAttr::default() }) {
                        log::warn!("{}: setting its times again after a flush failed: {e}", self.name_of(file));
                    }
                }
            }
            Err(_) if inner.forgotten => {
                // Nobody can read or write the file any more: its data has nowhere to go.
                self.release_unit_memory();
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
                match inner.dirty.get_mut(&unit) {
                    Some(newer) => {
                        // Newer writes win; the failed unit fills in only what they did not touch.
                        let older = flown.ranges.minus(&newer.ranges);
                        for r in older.iter() {
                            let (a, b) = (r.start as usize, r.end as usize);
                            newer.buf.as_mut_slice()[a..b].copy_from_slice(&flown.buf.as_slice()[a..b]);
                            newer.ranges.insert(r.clone());
                        }
                        newer.epoch = newer.epoch.min(flown.epoch);
                        newer.wanted = false;
                        self.mark_refused(newer, err);
                        self.release_unit_memory();
                    }
                    None => {
                        let mut back = DirtyUnit {
                            buf: flown.buf,
                            ranges: flown.ranges,
                            epoch: flown.epoch,
                            dirtied_at: Instant::now(),
                            wanted: false,
                            logged: RangeSet::default(),
                            refused: false,
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
        file.flush_ended.notify_all();
    }

    /// Writes one unit's dirty ranges (clipped to the logical size) to the store. A store that
    /// takes whole units only gets the unit whole: what the buffer lacks is read from the store
    /// first, and counted as read for a write.
    fn write_unit(&self, data: &dyn FileData, unit: u64, flying: &FlushingUnit, size: u64) -> SysResult<()> {
        let write = UnitWrite { unit, unit_bytes: self.config.unit_bytes, buf: flying.buf.as_slice(), ranges: &flying.ranges, size };
        write_unit_to(&*self.store, data, &write, &self.metrics)
    }

    /// Partial units older than the age limit go to the flushers; so do units that failed
    /// before, which is how a transient backend error heals without the application's help.
    fn age_loop(&self) {
        let tick = (self.config.flush_age / 2).clamp(Duration::from_millis(50), Duration::from_secs(1));
        while !self.stopping.load(Relaxed) {
            std::thread::sleep(tick);
            let files = self.open_files();
            let now = Instant::now();
            for file in files {
                let mut inner = lock(&file.inner);
                // A file whose last flush was refused waits out its backoff; then its refused
                // units are tried again, whatever their age.
                if inner.retry_at.is_some_and(|at| at > now) {
                    continue;
                }
                let old: Vec<u64> = inner
                    .dirty
                    .iter()
                    .filter(|(_, u)| !u.wanted && (u.refused || u.dirtied_at.elapsed() >= self.config.flush_age))
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

    /// The backend's copy of `ino` changed in a way only a backend sync makes durable.
    pub fn note_backend_changed(&self, ino: u64) {
        if self.log.is_some() {
            lock(&self.durability).entry(ino).or_default().backend_changes += 1;
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
            lock(&self.durability).insert(ino, Durability { created: true, named_in, ..Durability::default() });
            if let Some(record) = record {
                log.append(vec![record]);
            }
        }
    }

    /// A name changed on the backend: `record` (if any) says how, for replay; `moved` is the
    /// object renamed and its new directory, `lost_names` those whose one name no longer holds.
    /// Called after the backend change and before the caller is answered, so the record is
    /// queued before anything that depends on it can be committed.
    pub fn note_names_changed(&self, record: Option<Record>, moved: Option<(u64, u64)>, lost_names: &[u64]) {
        let Some(log) = &self.log else { return };
        // Replacing or removing a file created since the last checkpoint: its creation is in
        // the log, and a replay that does not know it is gone would make it again. The record
        // is committed before the caller is answered.
        let destroys_logged_file;
        {
            let mut d = lock(&self.durability);
            destroys_logged_file = lost_names.iter().any(|ino| d.get(ino).is_some_and(|e| e.created));
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
            // otherwise cost a log write per file).
            Some(Record::Unlink { ref file, directory: false, .. }) if destroys_logged_file && log.cancel_queued_create(file) => {}
            Some(record) if destroys_logged_file => {
                if let Err(e) = log.commit(vec![record]) {
                    log::warn!("committing a name change to the intent log: {e}; it stays queued");
                }
            }
            Some(record) => log.append(vec![record]),
            None => {}
        }
    }

    /// Before fsync of a directory (and a checkpoint's syncfs): the name changes queued for the
    /// log become durable there first, so that what the directory's fsync acknowledges is in
    /// the log too.
    pub fn commit_queued_names(&self) -> SysResult<()> {
        let Some(log) = &self.log else { return Ok(()) };
        match log.commit(Vec::new()) {
            Ok(()) => Ok(()),
            // No room: a checkpoint makes them durable on the backend instead, and frees the ring.
            Err(LogError::Full { .. }) => self.checkpoint(),
            Err(e) => {
                log::error!("committing queued name changes to the intent log: {e}");
                Err(Errno(libc::EIO))
            }
        }
    }

    /// Whether a log fsync can stand for a backend sync of `ino` (None: it cannot), and
    /// whether the file was created since the last checkpoint. Called under the file's lock.
    fn log_eligibility(&self, ino: u64) -> Option<bool> {
        let d = lock(&self.durability);
        let Some(entry) = d.get(&ino) else { return Some(false) };
        if !entry.backend_in_sync() {
            return None;
        }
        if !entry.created {
            return Some(false);
        }
        let parent = entry.named_in?;
        // A file in a directory the backend may not hold yet: replay would have nowhere to put it.
        if d.get(&parent).is_some_and(|p| p.created) {
            return None;
        }
        Some(true)
    }

    /// fsync(2) and fdatasync(2): through the intent log when it can stand for a backend
    /// sync, otherwise the buffered units to the backend and the backend synced.
    pub fn fsync(&self, file: &Arc<FileState>, data_only: bool) -> SysResult<()> {
        self.sync_file(file, data_only, ErrorReport::Sync)
    }

    /// close(2): the buffered data goes to the backend. A file with records in the intent log
    /// is synced instead (through the log where it can be): unsynced bytes on the backend
    /// would be taken back to the logged ones by a replay after a daemon crash, and what close
    /// acknowledged survives a daemon crash, with the log as without it.
    pub fn close_file(&self, file: &Arc<FileState>) -> SysResult<()> {
        // Only when something newer than the log's records would be left unsynced: a close
        // right after an fsync costs nothing more.
        let backend_behind = match lock(&self.durability).get(&file.id) {
            Some(entry) if self.log.is_some() && entry.logged_before_seq > 0 => Some(!entry.backend_in_sync()),
            _ => None,
        };
        let must_sync = backend_behind.is_some_and(|behind| {
            let inner = lock(&file.inner);
            behind || !inner.in_flight.is_empty() || inner.dirty.values().any(|u| !u.ranges.minus(&u.logged).is_empty())
        });
        if must_sync {
            self.sync_file(file, true, ErrorReport::Close)
        } else {
            self.flush_file(file, None, ErrorReport::Close)
        }
    }

    fn sync_file(&self, file: &Arc<FileState>, data_only: bool, report: ErrorReport) -> SysResult<()> {
        let Some(log) = &self.log else {
            return self.flush_file(file, Some(data_only), report);
        };
        if let Some(result) = self.fsync_through_log(file, log, report) {
            return result;
        }
        self.flush_file(file, None, report)?;
        let (changes, logged) = {
            let d = lock(&self.durability);
            let entry = d.get(&file.id);
            (entry.map_or(0, |e| e.backend_changes), entry.is_some_and(|e| e.logged_before_seq > 0))
        };
        let data = {
            let mut inner = lock(&file.inner);
            self.file_data(file, &mut inner)?
        };
        // No commit of the queued name records here: a file's own sync is the seed-000 path
        // above log_threshold_new, and one more log write per file would cost more than the
        // log saves. What the backend may then hold ahead of the log is safe for replay:
        // unlinks and replacements of files the log created were committed when they happened.
        data.sync(data_only)?;
        if logged {
            // What the log holds for this file is older than what the backend now holds
            // durably: replaying it after a crash would take the file back.
            let handle = self.file_handle(file)?;
            log.commit(vec![Record::Barrier { file: handle }]).map_err(|e| {
                log::error!("inode {}: {e}", file.id);
                Errno(libc::EIO)
            })?;
        }
        let mut d = lock(&self.durability);
        let entry = d.entry(file.id).or_default();
        entry.synced_changes = entry.synced_changes.max(changes);
        Ok(())
    }

    /// The key the log names the file by (asked of the namespace once).
    fn file_handle(&self, file: &FileState) -> SysResult<Vec<u8>> {
        if let Some(key) = file.log_key.get() {
            return Ok(key.clone());
        }
        let key = self.ns.log_key(file.id)?;
        Ok(file.log_key.get_or_init(|| key).clone())
    }

    /// The log path of fsync: None when it cannot stand for a backend sync (the file is new,
    /// the backend holds changes not yet synced, too much is buffered, or the log refused).
    fn fsync_through_log(&self, file: &Arc<FileState>, log: &IntentLog, report: ErrorReport) -> Option<SysResult<()>> {
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
        if let Some(err) = inner.errors.report_to(report) {
            return Some(Err(err));
        }
        let unit_bytes = self.config.unit_bytes;
        let size = inner.size;
        // What the log does not hold yet: units in flight whole (older), then the ranges of
        // dirty units not logged since they were last written.
        let failures_before = log.failed_batches();
        let in_flight: Vec<(u64, Vec<std::ops::Range<u64>>)> =
            inner.in_flight.iter().map(|(&k, u)| (k, u.ranges.iter().cloned().collect())).collect();
        let dirty: Vec<(u64, Vec<std::ops::Range<u64>>)> =
            inner.dirty.iter().map(|(&k, u)| (k, u.ranges.minus(&u.logged).iter().cloned().collect())).collect();
        // Measured before anything is copied: a file with more buffered than the threshold
        // goes to the backend, and its buffer is not copied for nothing.
        let mut spans: Vec<(u64, std::ops::Range<u64>, bool)> = Vec::new(); // unit, range in it, in flight
        for (unit, ranges, from_flight) in
            in_flight.iter().map(|(k, r)| (*k, r, true)).chain(dirty.iter().map(|(k, r)| (*k, r, false)))
        {
            for r in ranges {
                let end = r.end.min(size.saturating_sub(unit * unit_bytes));
                if r.start < end {
                    spans.push((unit, r.start..end, from_flight));
                }
            }
        }
        let bytes: u64 = spans.iter().map(|(_, r, _)| r.end - r.start).sum();
        let threshold =
            if created { self.config.log_threshold_new_bytes } else { self.config.log_threshold_bytes };
        if bytes > threshold {
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
        if pieces.is_empty() && inner.dirty.values().all(|u| u.logged.is_empty()) && !created {
            // Nothing buffered: the store is in sync. The file's name changes may still be
            // queued (a rename since the last checkpoint): an fsync makes them durable too, as
            // ext4's does and the store's path here does; a commit of an empty queue writes
            // nothing.
            drop(inner);
            return Some(match log.commit(Vec::new()) {
                Ok(()) => Ok(()),
                Err(LogError::Full { .. }) => self.checkpoint(),
                Err(e) => {
                    log::error!("committing queued name changes to the intent log: {e}");
                    Err(Errno(libc::EIO))
                }
            });
        }
        // Marked now, under the lock: a write after this point takes its range out again.
        for (unit, ranges) in &dirty {
            let unit_state = inner.dirty.get_mut(unit).expect("listed above");
            for r in ranges {
                unit_state.logged.insert(r.clone());
            }
        }
        let mut records = Vec::with_capacity(pieces.len() + 1);
        records.extend(pieces.into_iter().map(|(offset, b)| Record::Data { file: handle.clone(), offset, bytes: b }));
        records.push(Record::Size { file: handle, size });
        drop(inner);
        let committed = match log.commit(records.clone()) {
            Err(LogError::Full { .. }) => self.checkpoint().map_err(LogError::from).and_then(|()| log.commit(records)),
            other => other,
        };
        // A failed batch may have held ranges this fsync skipped as logged by another one.
        if committed.is_err() || log.failed_batches() != failures_before {
            let mut inner = lock(&file.inner);
            for unit in inner.dirty.values_mut() {
                unit.logged = RangeSet::default();
            }
            drop(inner);
            // It may also have landed (EIO after the bytes were written): the backend sync
            // below must then be followed by a barrier, which is written over it.
            let mut d = lock(&self.durability);
            let entry = d.entry(file.id).or_default();
            entry.logged_before_seq = entry.logged_before_seq.max(log.readable_before_seq());
            drop(d);
            if let Err(e) = committed {
                log::warn!("inode {}: {e}; this fsync syncs the backend instead", file.id);
            }
            return None;
        }
        let next = log.next_seq();
        lock(&self.durability).entry(file.id).or_default().logged_before_seq = next;
        self.metrics.log_fsyncs.fetch_add(1, Relaxed);
        Some(Ok(()))
    }

    /// Writes everything buffered to the backend, syncs the backend file system once, and
    /// releases the log records that held it. Order matters; see SEMANTICS.md.
    pub fn checkpoint(&self) -> SysResult<()> {
        let Some(log) = &self.log else { return Ok(()) };
        let _one_at_a_time = lock(&self.checkpointing);
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
        self.flush_every_file(ErrorReport::Checkpoint)?;
        let flushed: Vec<(u64, u64)> = lock(&self.durability).iter().map(|(&ino, d)| (ino, d.backend_changes)).collect();
        self.sync_backend()?;
        log.checkpoint(release_before).map_err(|e| {
            log::error!("{e}");
            Errno(libc::EIO)
        })?;
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
        d.retain(|_, e| e.created || !e.backend_in_sync() || e.logged_before_seq > 0);
        Ok(())
    }

    /// The files with write state now, taken out of the lock so each can be worked on alone.
    fn open_files(&self) -> Vec<Arc<FileState>> {
        lock(&self.files).values().cloned().collect()
    }

    /// Every buffered unit of every file written to the backend (not synced), each file waited for.
    fn flush_every_file(&self, report: ErrorReport) -> SysResult<()> {
        for file in self.open_files() {
            self.flush_file(&file, None, report)?;
        }
        Ok(())
    }

    /// Every buffered unit written to the backend and the backend synced once: a checkpoint
    /// where there is a log.
    pub fn sync_all(&self) -> SysResult<()> {
        if self.log.is_some() {
            return self.checkpoint();
        }
        self.flush_every_file(ErrorReport::Sync)?;
        self.sync_backend()
    }

    /// Checkpoints when the log is half full, and every `checkpoint_interval` while the log
    /// holds anything or a file waits for a backend sync to become eligible for it.
    fn checkpoint_loop(&self) {
        let log = self.log.as_ref().expect("the checkpointer runs with a log");
        let mut last = Instant::now();
        while !self.stopping.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(100).min(self.config.checkpoint_interval));
            let waiting = log.holds_batches() || !lock(&self.durability).is_empty();
            let due = log.used_fraction() > 0.5 || (waiting && last.elapsed() >= self.config.checkpoint_interval);
            if due {
                if let Err(e) = self.checkpoint() {
                    log::warn!("checkpoint failed ({e}); the log keeps its records and it is tried again");
                }
                last = Instant::now();
            }
        }
    }

    /// For in-process tests: every thread stopped as a killed daemon's would be, nothing more
    /// written; the buffer and the log's queue are dropped with the engine. A flush under way
    /// finishes first (it was issued before the "crash").
    pub fn abandon(&self) {
        self.stopping.store(true, Relaxed);
        lock(&self.queue).clear();
        self.queue_ready.notify_all();
        let threads: Vec<_> = lock(&self.flusher_threads).drain(..).chain(lock(&self.timer_threads).drain(..)).collect();
        for thread in threads {
            let _ = thread.join();
        }
        *lock(&self.shut_down_report) = Some(Vec::new());
    }

    /// At unmount: every file's buffered data written and synced, each given `io_timeout`
    /// without progress at most (so a backend that answers nothing cannot hold the daemon);
    /// then the last checkpoint; then the threads stopped. Returns what could not be written,
    /// per file, once (later calls return the same).
    pub fn shut_down(&self) -> Vec<Unwritten> {
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
                if in_log > 0 { format!("; {in_log} fsynced bytes stay in the intent log for the next mount") } else { String::new() }
            );
            self.metrics.unmount_dropped_bytes.fetch_add(bytes, Relaxed);
            unwritten.push(Unwritten { name, bytes, in_log, error: e });
        }
        if let Err(e) = self.checkpoint() {
            log::error!("the last checkpoint failed ({e}); the next mount replays the intent log");
        }
        self.stopping.store(true, Relaxed);
        self.queue_ready.notify_all();
        // A flusher stuck in a backend call that never returns is left behind, not waited for.
        let flushers: Vec<_> = lock(&self.flusher_threads).drain(..).collect();
        let stop_deadline = Instant::now() + self.config.io_timeout;
        for thread in flushers {
            while !thread.is_finished() && Instant::now() < stop_deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if thread.is_finished() {
                let _ = thread.join();
            } else {
                log::error!("a flusher is still in a backend call after {} s; the daemon exits without it", self.config.io_timeout.as_secs());
            }
        }
        *report = Some(unwritten.clone());
        unwritten
    }
}
