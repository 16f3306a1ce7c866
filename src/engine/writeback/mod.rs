//! The write buffer, its flushers and the durability rules: where application writes become
//! whole, aligned units, and when they are durable.
//!
//! - `write_buffer`: per file, per unit, an aligned buffer and its dirty byte ranges; the
//!   memory bound; what readers see; truncation; a file's state from first open to last.
//! - `flushers`: the flush policy (a full unit at once; a partial one on fsync, close, age or
//!   memory pressure; a refused one after a backoff), the flusher threads, and how a unit is
//!   written (whole for a store that takes whole units only).
//! - `near`: the flusher pinned to each CPU, for a single unit a request waits on.
//! - `durability`: fsync and close through the intent log or the store, barriers, name records,
//!   checkpoints, shut-down.
//!
//! This file holds the types they share. A flush error keeps the data buffered and reaches the
//! application on its next write, fsync or close.
//!
//! Invariants (asserted at their boundaries):
//! - A unit index is in flight at most once; a newer dirty buffer of the same unit waits for it.
//! - Bytes at or beyond the logical size are never written: truncate waits for in-flight units
//!   beyond the new size and drops their dirty data before it shrinks the store's file.
//! - Buffer memory in use (dirty + in flight, refused data included) never exceeds the bound;
//!   writers wait (bounded) or fail, flushers never wait, so the flushers always make progress.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

mod checkpoint;
mod durability;
mod flushers;
mod near;
mod threads;
mod write_buffer;

pub(crate) use flushers::write_range;

use super::buffer::{AlignedBuf, RangeSet, WriteBytes};
use super::burst::Bursts;
use super::intent_log::format::Record;
use super::intent_log::{IntentLog, LogError, TailKeep, VOLATILE_NAMES_MAX_AGE};
use super::pending::{Commit, Held, Made, Pending};
use super::types::{ObjectId, SetAttr, TimeToSet, TimesToSet, Timestamp};
use super::LogCloses;
use crate::backend::{FileData, Namespace, OpenMode, UnitStore, UnitWrite};
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
    /// With the intent log: which new files it holds until the checkpoint.
    pub log_closes: LogCloses,
    /// Closes (and an fsync before a close) less than this apart are a burst (`burst`).
    pub burst_gap: Duration,
    /// With the intent log: the longest between checkpoints while anything waits for one.
    pub checkpoint_interval: Duration,
    /// With the intent log: a checkpoint once nothing has been logged for this long (and
    /// anything waits for one); the longest a close's batch waits for a flush of the log.
    pub checkpoint_idle: Duration,
    /// The longest a request waits for the backend without any progress (a flush that does
    /// not end, memory that is not freed) before it fails with EIO.
    pub io_timeout: Duration,
}

/// The durability map's size that brings the next checkpoint forward (which empties it but for
/// files changed while it ran): about 100 bytes an entry, so some 10 MiB at most, whatever the
/// number of files a tree extraction touches between two checkpoints.
const DURABILITY_ENTRIES_BEFORE_CHECKPOINT: usize = 100_000;

/// The bytes of new files held in memory (`pending`) that bring the next checkpoint forward.
const HELD_BYTES_BEFORE_CHECKPOINT: u64 = 64 << 20;

/// Files the backend makes ahead for held files made alone before a checkpoint
/// (`Namespace::prepare_files`): enough for the lone closes of a checkpoint interval
/// (seed 000's writers), refilled at every checkpoint. A burst of closes makes its files on the
/// backend directly and takes none.
const FILES_MADE_AHEAD: usize = 16;

/// A write at least this large is answered before it is copied into the buffer when it can be
/// (`Writeback::write`): its copy is long enough for the kernel's next request to overlap it.
/// Below it the copy costs less than holding the file's lock across the answer.
const ACKNOWLEDGE_BEFORE_COPY_MIN_BYTES: u64 = 128 << 10;

/// Bytes allocated in each file made ahead: the unit, at most 1 MiB (a file made alone is small
/// more often than not, and what it does not use waits for the next checkpoint to be given back).
fn bytes_made_ahead(unit_bytes: u64) -> u64 {
    unit_bytes.min(1 << 20)
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
    /// The last flush (or truncate) that reached the backend, and the last one a sync has made
    /// durable, as stamps from one counter for the whole mount (`Writeback::change_stamps`),
    /// not counts from 0: an entry ends when its file is in sync, and a count a sync read
    /// before that (it reads, syncs, then marks what it read synced) would pass for the same
    /// count of the entry that begins after, marking a flush no sync covered as synced.
    backend_changes: u64,
    synced_changes: u64,
    /// The log holds records of this file up to (and excluding) this sequence number.
    logged_before_seq: u64,
    /// Lookups the kernel dropped (FORGET) while this entry was here, handed to the namespace
    /// when it goes (`Writeback::forget`).
    forgets_held_back: u64,
}

impl Durability {
    fn backend_in_sync(&self) -> bool {
        self.synced_changes >= self.backend_changes
    }
}

/// Poisoning is a panic's trace, and a panic ends the daemon (the panic policy, src/main.rs):
/// no lock is seen poisoned there; a test that panics in-process fails anyway.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap()
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
    /// The file's failure (`FlushErrors::failures`) at which these bytes were first refused,
    /// kept through later retries: once the writer has heard of that failure or a later one,
    /// the bytes may be discarded to make room.
    refused_since: Option<u64>,
}

impl DirtyUnit {
    /// A unit the buffer has taken memory for, nothing written to it yet.
    fn empty(unit_bytes: u64, epoch: u64) -> DirtyUnit {
        DirtyUnit {
            buf: AlignedBuf::zeroed(unit_bytes as usize),
            ranges: RangeSet::default(),
            epoch,
            dirtied_at: Instant::now(),
            wanted: false,
            logged: RangeSet::default(),
            refused: false,
            refused_since: None,
        }
    }
}

struct FlushingUnit {
    buf: AlignedBuf,
    ranges: RangeSet,
    epoch: u64,
    /// A retry of bytes the backend refused: they stay counted as refused while it is under
    /// way, so that a writer short of memory fails at once instead of waiting on a retry that
    /// will most likely be refused again (a full disk stays full).
    refused: bool,
    refused_since: Option<u64>,
}

/// Who is told of a failed flush, each on its own account: a close (any close, even a forked
/// child's close-on-exec, which nobody checks) must not use up the report an fsync is owed, and
/// an fsync that reported it must not make the next write fail.
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

/// A file's failed flushes. Refused bytes stay buffered and are tried again, so a failure is
/// not a loss: a close or fsync tries again at once and fails only when a flush fails while it
/// waits, or when refused bytes were discarded since it last heard (the one real loss). A
/// write(2) fails only when the buffer holds nothing but refused bytes; as in Linux, it does
/// not report a background flush.
#[derive(Default)]
struct FlushErrors {
    last: Option<Errno>,
    failures: u64,
    /// For each `ErrorReport`, the number of failures it has been told of.
    reported: [u64; 4],
    /// Times refused bytes of the file were discarded, and for each `ErrorReport`, how many of
    /// those it has been told of.
    discards: u64,
    discards_reported: [u64; 4],
}

impl FlushErrors {
    fn record(&mut self, err: Errno) {
        self.last = Some(err);
        self.failures += 1;
    }

    fn record_discard(&mut self) {
        self.discards += 1;
    }

    /// The latest failure the file's writer has heard of, in any of the ways a writer hears
    /// (write, close, fsync); 0: none.
    fn told_through(&self) -> u64 {
        [ErrorReport::Write, ErrorReport::Close, ErrorReport::Sync]
            .iter()
            .map(|&who| self.reported[who as usize])
            .max()
            .unwrap_or(0)
    }

    fn error(&self) -> Errno {
        self.last.unwrap_or(Errno(libc::EIO))
    }

    /// A caller of this kind was told of the file's failures some other way (a write that
    /// found the buffer full of refused bytes).
    fn mark_told(&mut self, who: ErrorReport) {
        self.reported[who as usize] = self.failures;
    }

    /// The error to tell a caller that waited for the file's flushes since the file had
    /// `failures_before` failures: one of them failed meanwhile, or refused bytes were
    /// discarded and this kind of caller has not heard of it. Earlier failures whose bytes were
    /// written since are healed, not reported.
    fn report_after_wait(&mut self, who: ErrorReport, failures_before: u64) -> Option<Errno> {
        let who = who as usize;
        if self.failures > failures_before {
            self.reported[who] = self.failures;
            return Some(self.error());
        }
        if self.discards_reported[who] < self.discards {
            self.discards_reported[who] = self.discards;
            self.reported[who] = self.reported[who].max(self.failures);
            return Some(self.error());
        }
        None
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
    /// Access and modification times an application set (utimensat, futimens), or the kernel's
    /// writeback cache kept for its cached writes, after the application's last write: every
    /// flush that ends afterwards sets them on the backend file again, or the flush's own write
    /// would stamp it with the flush time (GNU tar writes, sets the archived mtime, then closes;
    /// the kernel sends its times at close, possibly served before its pages' WRITEs). The
    /// application's next write clears them; the kernel's writeback of its cache does not.
    times_set: Option<TimesToSet>,
    /// With the log: a truncate the store has not been given yet. The store's bytes from this
    /// offset on are not the file's (readers see zeros there, under what was written since);
    /// the first flush gives the store the truncate, and the log the Size record that says
    /// it (`cut_unlogged`), so that an O_TRUNC rewrite of a small file costs the log's bytes and
    /// nothing on the backend until the checkpoint.
    cut_to: Option<u64>,
    /// The lowest size a truncate the store has not been given left the file at since the
    /// file's last log batch: the next batch says it first (a Size record), then the bytes
    /// written since. Not `cut_to`, which is older: a batch saying that again would cut bytes
    /// an earlier batch logged after it (the crash harness found a file's first bytes back
    /// after a second truncate to 0 that no batch said).
    cut_unlogged: Option<u64>,
    /// While `cut_to` waits: the size the file's last log batch said, so that a close with
    /// nothing else to log writes no batch (otherwise each close logged the size again, a
    /// Size-only batch at every FLUSH, one per child a program started while it held the file
    /// open). None where no batch since the cut is known to say it (a failed batch, a new cut).
    size_logged_since_cut: Option<u64>,
    /// With the log: `times_set` is not on the backend yet; it waits with the file's other
    /// changes the log holds (`Writeback::defer_times`), and the flush that gives the backend
    /// the rest sets it. `times_logged`: the log holds it (an Attrs record).
    times_pending: bool,
    times_logged: bool,
    /// The file's data in the store, opened for writing by the first flush (or truncate).
    data: Option<Arc<dyn FileData>>,
    /// After a failed flush: no retry before this (except one an application asks for with
    /// fsync or close), and the wait before the next one (see `Writeback::end_flush`).
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

impl FileInner {
    /// Whether the buffer (units dirty or in flight) holds every byte of the file from `from`
    /// to its size: none of the store's bytes there is then the file's. It stops at the first
    /// unit the buffer does not hold, so it visits at most the buffered units plus one, whatever
    /// size a truncate set; it runs once per deferred truncate, not per write.
    fn buffer_holds_all_from(&self, from: u64, unit_bytes: u64) -> bool {
        let mut pos = from;
        while pos < self.size {
            let unit = pos / unit_bytes;
            let unit_start = unit * unit_bytes;
            let end = (unit_start + unit_bytes).min(self.size);
            let mut held = self.dirty.get(&unit).map(|u| u.ranges.clone()).unwrap_or_default();
            for r in self.in_flight.get(&unit).into_iter().flat_map(|u| u.ranges.iter()) {
                held.insert(r.clone());
            }
            if !held.covers(pos - unit_start, end - unit_start) {
                return false;
            }
            pos = end;
        }
        true
    }

    /// Whether a flush would give the backend something the log's records of the file do not
    /// say: bytes in flight or written since they were logged, or a truncate the store has not
    /// been given (the size the log said last may have changed since: grown again).
    fn flush_outruns_the_log(&self) -> bool {
        !self.in_flight.is_empty()
            || self.size_unlogged_since_cut()
            || self.dirty.values().any(|u| !u.ranges.minus(&u.logged).is_empty())
    }

    /// A truncate the store has not been given waits (the store's size is not the file's),
    /// and no log batch since has said the file's size as it is now.
    fn size_unlogged_since_cut(&self) -> bool {
        self.cut_to.is_some() && (self.cut_unlogged.is_some() || self.size_logged_since_cut != Some(self.size))
    }
}

/// What a read sees of the buffer (`Writeback::snapshot_overlay`): the file's size, the
/// buffered pieces in the range (offset, bytes), and the registration of the read of the rest
/// from the backend.
pub type Overlay<'a> = (u64, Vec<(u64, Vec<u8>)>, BackendRead<'a>);

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
    /// Held through each of the file's durability points (fsync, close): they run one at a
    /// time. A backend sync's Barrier tells replay that the backend holds everything the log
    /// held of the file before it, which is true of what that sync's own flush wrote only; a
    /// log fsync of the same file committed meanwhile, of bytes written after the flush began,
    /// landed before the Barrier (in its batch), and replay skipped bytes nothing had written
    /// (the crash harness found an acknowledged write's bytes back at older ones).
    durability_points: Mutex<()>,
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
    /// Per CPU, the near flusher's slot (`near`).
    near: Vec<near::NearSlot>,
    files: Mutex<HashMap<u64, Arc<FileState>>>,
    /// File states that have left `files`, counted under its lock (see `open_file`).
    states_ended: std::sync::atomic::AtomicU64,
    /// Stamps of backend changes (`Durability::backend_changes`), the last one given out.
    change_stamps: std::sync::atomic::AtomicU64,
    /// The flushers and the timers, and the flag that stops them.
    threads: threads::Threads,
    /// Files with data buffered and no handle open (see `forget_file`).
    lingering: std::sync::atomic::AtomicUsize,
    /// What shut-down could not write, once it has run.
    shut_down_report: Mutex<Option<ShutDown>>,
    /// Bytes of buffer memory held by units the backend refused (`DirtyUnit::refused`), and
    /// the error it refused the last one with.
    refused: Mutex<RefusedMemory>,
    log: Option<IntentLog>,
    /// New files only memory and the log hold (with the log).
    pending: Option<Arc<Pending>>,
    /// Per inode number; see `Durability`. Entries go at checkpoints.
    durability: Mutex<HashMap<u64, Durability>>,
    /// One checkpoint at a time: another (the loop's, `sync`'s, a full log's) waits for the one
    /// running, then runs its own.
    checkpointing: Mutex<()>,
    /// When the application last closed and fsynced files (`LogCloses::Auto`).
    bursts: Bursts,
}

/// Retries of a refused flush wait this long at first, twice as long after each failure that
/// follows, and at most `RETRY_BACKOFF_MAX`: a full disk is tried again every 30 s, not spun on.
const RETRY_BACKOFF_MIN: Duration = Duration::from_millis(100);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(30);

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

/// What the unmount could not do: files whose data did not reach the backend, and whether
/// the backend's closing sync failed (without the log, the sync that makes `umount` a
/// durability point).
#[derive(Clone, Debug, Default)]
pub struct ShutDown {
    pub unwritten: Vec<Unwritten>,
    pub backend_unsynced: Option<Errno>,
}

impl ShutDown {
    pub fn is_clean(&self) -> bool {
        self.unwritten.is_empty() && self.backend_unsynced.is_none()
    }
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
        pending: Option<Arc<Pending>>,
    ) -> Arc<Writeback> {
        assert!(config.unit_bytes.is_power_of_two() && config.logical_block_bytes.is_power_of_two());
        assert!(config.logical_block_bytes <= config.unit_bytes, "units are whole logical blocks");
        assert!(config.buffer_bytes >= config.unit_bytes, "the buffer holds at least one unit");
        metrics.buffer_bytes_limit.store(config.buffer_bytes, Relaxed);
        metrics.unit_bytes.store(config.unit_bytes, Relaxed);
        let burst_gap = config.burst_gap;
        let writeback = Arc::new(Writeback {
            ns,
            store,
            budget: Budget { used_bytes: Mutex::new(0), freed: Condvar::new(), limit_bytes: config.buffer_bytes },
            config,
            metrics,
            queue: Mutex::new(VecDeque::new()),
            queue_ready: Condvar::new(),
            near: near::slots(),
            files: Mutex::new(HashMap::new()),
            states_ended: std::sync::atomic::AtomicU64::new(0),
            change_stamps: std::sync::atomic::AtomicU64::new(0),
            threads: threads::Threads::default(),
            refused: Mutex::new(RefusedMemory::default()),
            lingering: std::sync::atomic::AtomicUsize::new(0),
            shut_down_report: Mutex::new(None),
            log,
            pending,
            durability: Mutex::new(HashMap::new()),
            checkpointing: Mutex::new(()),
            bursts: Bursts::with_gap(burst_gap),
        });
        if let Some(held) = &writeback.pending {
            let wb = Arc::downgrade(&writeback);
            held.set_before_backend_names(Box::new(move || {
                if let Some(wb) = wb.upgrade() {
                    wb.write_volatile_names();
                }
            }));
        }
        for i in 0..writeback.config.flushers {
            let wb = writeback.clone();
            let thread = std::thread::Builder::new()
                .name(format!("flusher-{i}"))
                .spawn(move || wb.flusher_loop())
                .expect("spawn a flusher");
            writeback.threads.add_flusher(thread);
        }
        for cpu in 0..writeback.near.len() {
            let wb = writeback.clone();
            let thread = std::thread::Builder::new()
                .name(format!("flusher-near-{cpu}"))
                .spawn(move || wb.near_flusher_loop(cpu))
                .expect("spawn a near flusher");
            writeback.threads.add_flusher(thread);
        }
        let wb = writeback.clone();
        let age = std::thread::Builder::new()
            .name("flush-age".into())
            .spawn(move || wb.age_loop())
            .expect("spawn the age timer");
        writeback.threads.add_timer(age);
        if writeback.log.is_some() {
            let wb = writeback.clone();
            let checkpointer = std::thread::Builder::new()
                .name("checkpoint".into())
                .spawn(move || wb.checkpoint_loop())
                .expect("spawn the checkpointer");
            writeback.threads.add_timer(checkpointer);
        }
        writeback
    }

    pub fn file(&self, ino: u64) -> Option<Arc<FileState>> {
        lock(&self.files).get(&ino).cloned()
    }
}

#[cfg(test)]
mod tests;
