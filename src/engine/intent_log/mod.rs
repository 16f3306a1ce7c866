//! The intent log: small pieces that must become durable before their unit fills go here,
//! packed into whole blocks, one batch per group commit, instead of into the backend.
//!
//! Owns: placing batches in the ring, group commit (concurrent callers share one write and one
//! flush), the checkpoint that releases space, and reading back what survived at open. Must
//! not: decide what is logged (the write buffer does) or touch the log file's bytes other than
//! through `LogFile` and `log_format`.
//!
//! The rules the reader relies on (see `format`): batches are written one at a time, each
//! after the one before it was written; a batch is flushed when one of its callers waits for
//! durability (`commit`), which covers every batch before it, and says in its header how many
//! batches before it were still unflushed. A caller of `commit` is answered once its batch is
//! durable; a caller of `commit_written` (a close: it must survive the daemon, not a power
//! cut) once its batch is written.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};

pub mod device;
pub mod format;
mod memory_device;
mod opening;
mod queue;
pub mod raw;
pub mod volatile_tail;

use super::burst::BURST_GAP;
use super::pending::is_pending_key;
use crate::metrics::Metrics;
use crate::sys::Errno;
use device::{AlignedScratch, LogDevice};
use format::{
    batch_blocks, encode_batch_lagging, encode_wrap, read_log, salvage_log, valid_block_bytes,
    written_after_checkpoint, Area, Batch, Corruption, LogContents, Record, Superblock, MAX_LOG_BLOCK_BYTES,
    SUPERBLOCK_COPIES,
};
pub use opening::{batches_to_replay, batches_to_replay_in_file, open_file_device};
use queue::Queue;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;
use std::time::{Duration, Instant};
use volatile_tail::VolatileTail;

/// The intent log's file in a state directory (`state.rs` makes the directory); a log on a
/// block device keeps its replay map beside where this file would be.
pub const LOG_FILE_NAME: &str = "intent.log";

/// Namespace records queued past this are written as a batch of their own.
const MAX_QUEUED_RECORDS: usize = 4096;

/// The longest a name change kept in the volatile tail waits for a batch to carry it before
/// the checkpointer writes one (`volatile_names_age`): ext4's default commit interval, the
/// longest it keeps a rename from its journal.
pub const VOLATILE_NAMES_MAX_AGE: Duration = Duration::from_secs(5);

#[derive(Clone, Debug)]
pub enum LogError {
    Io(&'static str, Errno),
    Corrupt(Corruption),
    /// A batch larger than the whole ring, or a ring with no room left until a checkpoint.
    Full {
        needed_blocks: u64,
        free_blocks: u64,
    },
    /// The file exists with another size than asked for, or is not a log.
    Mismatch(String),
}

impl From<Errno> for LogError {
    fn from(e: Errno) -> LogError {
        LogError::Io("checkpoint", e)
    }
}

impl std::fmt::Display for LogError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LogError::Io(what, e) => write!(f, "intent log: {what}: {e}"),
            LogError::Corrupt(c) => write!(f, "{c}"),
            LogError::Full { needed_blocks, free_blocks } => {
                write!(f, "intent log full: {needed_blocks} blocks needed, {free_blocks} free until a checkpoint")
            }
            LogError::Mismatch(why) => write!(f, "intent log: {why}"),
        }
    }
}

/// The log's area read through its device a window at a time (see `format::Area`): the reader
/// walks the ring forward, batch after batch, then looks at every block once, so one window
/// serves many reads. A read that fails reads as zeros; its error is kept for the caller.
struct DeviceArea<'a> {
    device: &'a dyn LogDevice,
    /// Where the area starts on the device, and its length, in bytes.
    start: u64,
    len: usize,
    /// The window: where it starts in the area, how many of its bytes hold the area's, and its
    /// buffer (page-aligned for O_DIRECT, made at the first read and read into again after).
    window: RefCell<(usize, usize, Option<AlignedScratch>)>,
    /// The window's length.
    window_bytes: usize,
    /// Bytes read from the device so far.
    bytes_read: Cell<u64>,
    error: Cell<Option<Errno>>,
}

/// What recovery holds of the log at a time (beside the records it replays).
const READ_WINDOW_BYTES: usize = 4 << 20;

impl<'a> DeviceArea<'a> {
    fn new(device: &'a dyn LogDevice, start: u64, len: u64) -> DeviceArea<'a> {
        Self::with_window(device, start, len, READ_WINDOW_BYTES)
    }

    /// An area read a few blocks at a time, for a look at one batch.
    fn with_window(device: &'a dyn LogDevice, start: u64, len: u64, window_bytes: usize) -> DeviceArea<'a> {
        assert!(
            window_bytes.is_power_of_two() && window_bytes <= READ_WINDOW_BYTES,
            "a window of {window_bytes} bytes"
        );
        DeviceArea {
            device,
            start,
            len: len as usize,
            window: RefCell::new((0, 0, None)),
            window_bytes,
            bytes_read: Cell::new(0),
            error: Cell::new(None),
        }
    }

    /// Fills `buf` with the area's bytes at `at`; zeros where the read failed or fell short.
    fn read_into(&self, at: usize, buf: &mut [u8]) {
        self.bytes_read.set(self.bytes_read.get() + buf.len() as u64);
        let failed = match self.device.read_into(self.start + at as u64, buf) {
            Ok(n) if n == buf.len() => return,
            Ok(_) => Errno(libc::EIO),
            Err(e) => e,
        };
        self.error.set(self.error.get().or(Some(failed)));
        buf.fill(0);
    }

    fn read(&self, at: usize, len: usize) -> Vec<u8> {
        self.bytes_read.set(self.bytes_read.get() + len as u64);
        match self.device.read_at(self.start + at as u64, len) {
            Ok(bytes) if bytes.len() == len => bytes,
            Ok(_) => {
                self.error.set(self.error.get().or(Some(Errno(libc::EIO))));
                vec![0; len]
            }
            Err(e) => {
                self.error.set(self.error.get().or(Some(e)));
                vec![0; len]
            }
        }
    }
}

impl Area for DeviceArea<'_> {
    fn bytes(&self, at: usize, len: usize) -> Cow<'_, [u8]> {
        assert!(at + len <= self.len, "{len} bytes at {at} of an area of {}", self.len);
        if len > self.window_bytes {
            return Cow::Owned(self.read(at, len));
        }
        let mut window = self.window.borrow_mut();
        let (from, held, scratch) = &mut *window;
        let scratch = scratch.get_or_insert_with(|| AlignedScratch::zeroed(self.window_bytes, 4096));
        if !(at >= *from && at + len <= *from + *held) {
            let want = self.window_bytes.min(self.len - at);
            self.read_into(at, &mut scratch.bytes_mut()[..want]);
            (*from, *held) = (at, want);
        }
        let within = at - *from;
        Cow::Owned(scratch.bytes()[within..within + len].to_vec())
    }
}

/// What the log holds: read from its area, unless the log was just made, when its area is the
/// zeros `open_or_create` and `zero_device_bytes` wrote (the reading would read every block, all
/// of the log's bytes, to find nothing: a tenth of a second of a 64 MiB log's mount here).
fn read_log_unless_made(created: bool, area: &DeviceArea<'_>, sb: &Superblock) -> Result<LogContents, Corruption> {
    if created {
        return Ok(LogContents {
            batches: Vec::new(),
            starts: Vec::new(),
            next_seq: sb.checkpoint_seq,
            next_block: sb.checkpoint_block,
            unflushed_dropped: 0,
        });
    }
    read_log(area, sb)
}

struct Ring {
    sb: Superblock,
    next_block: u64,
    next_seq: u64,
    /// Where each batch since the checkpoint starts, by sequence number (for checkpoints).
    starts: std::collections::VecDeque<(u64, u64)>,
    /// A batch write failed at the next position: its bytes may still have landed there, with
    /// the sequence number a reader expects next. Until a batch is written over it, it could
    /// be replayed, though nobody was told it was durable.
    failed_write_at_next: bool,
    /// Every batch before this sequence number has been flushed to the device.
    flushed_before_seq: u64,
    /// The reading at open left unflushed batches after the tail (see `format`): a checkpoint
    /// must record where the log goes on before any batch is written over them.
    checkpoint_before_writing: bool,
    /// When the last batch was written. A batch nobody waits to see flushed, written within
    /// `BURST_GAP` of the one before it, goes through the page cache
    /// (`LogDevice::write_unflushed_at`): closes that come in a burst would each wait for the
    /// device with a direct write (24-42 % of tar's and rsync's time, when all their new files
    /// were held). Their batches share the page cache's pages, which the next `sync` writes once.
    /// A lone close stays direct: through the page cache it would cost a whole page at `sync`
    /// where its batch takes one or two sectors.
    last_batch_at: Option<std::time::Instant>,
    /// A batch went through the page cache since the device was last flushed or written back
    /// (`commit_written_to_device`).
    page_cache_unwritten: bool,
    /// Directories whose name changes batches since the checkpoint hold and no `NamesSynced`
    /// covers yet: the first and the last such batch's sequence number (see
    /// `commit_names_synced`).
    names_unsynced: HashMap<Vec<u8>, (u64, u64)>,
}

impl Ring {
    /// Blocks in use from the checkpoint to the next write position.
    fn used_blocks(&self) -> u64 {
        if self.next_seq == self.sb.checkpoint_seq {
            return 0;
        }
        (self.next_block + self.sb.area_blocks - self.sb.checkpoint_block) % self.sb.area_blocks
    }

    /// How many blocks from `block` on hold nothing the log needs, before the oldest batch kept
    /// or the area's end, whichever comes first (`block` is where the batches written end).
    fn free_blocks_from(&self, block: u64) -> u64 {
        let area = self.sb.area_blocks;
        assert!(block <= area, "block {block} past the area of {area}");
        let kept_from = self.sb.checkpoint_block;
        if self.next_seq != self.sb.checkpoint_seq && kept_from >= block {
            kept_from - block
        } else {
            area - block
        }
    }
}

/// The group commit's state: records queued for the next batch, and the tickets of the callers
/// waiting for one. (Named apart from `engine::pending::Pending`, the files held in the log.)
struct GroupCommit {
    records: Queue,
    /// Tickets handed to callers, and the highest one whose batch is done (written, and
    /// flushed if any of its callers asked for that).
    next_ticket: u64,
    durable_ticket: u64,
    /// The highest ticket whose caller waits for a flush: a round that holds it flushes.
    flush_wanted_ticket: u64,
    /// Ticket ranges whose batch failed, and why: the newest few.
    failed: std::collections::VecDeque<(u64, u64, LogError)>,
    failed_total: u64,
    leader_active: bool,
    /// Ticket ranges written, oldest first, each with the sequence number its batch ends
    /// before, kept until every caller in the range has read it (`commit_before_seq`).
    written: std::collections::VecDeque<WrittenRound>,
    /// What the volatile tail holds of the queue.
    tail: TailMark,
}

/// What the volatile tail holds: entries for batch `seq` (0: none that count) up to byte
/// `end`, the queue's records up to slot `covered`, the first of them kept since `since`.
#[derive(Clone, Copy, Default)]
struct TailMark {
    seq: u64,
    end: u64,
    covered: usize,
    since: Option<Instant>,
}

/// What `IntentLog::keep_in_volatile_tail` did with its records.
pub enum TailKeep {
    /// Queued for the next batch, and in the tail meanwhile (or, the tail's write failed,
    /// committed as the caller would have).
    Kept,
    /// Not taken (no tail, or a batch under way whose number the records would not get): the
    /// caller commits them.
    Declined(Vec<Record>),
}

struct WrittenRound {
    first_ticket: u64,
    last_ticket: u64,
    before_seq: u64,
    unread: u64,
}

pub struct IntentLog {
    device: Box<dyn LogDevice>,
    /// The log lives on the device the backing file system journals to (see
    /// `flushed_by_backend`).
    flushed_by_backend: bool,
    metrics: Arc<Metrics>,
    ring: Mutex<Ring>,
    group: Mutex<GroupCommit>,
    committed: Condvar,
    /// Where held files' name changes wait for the next batch (`keep_in_volatile_tail`): set
    /// at the mount (`adopt_volatile_tail`), none in-process.
    tail: Option<VolatileTail>,
    /// The queue holds records only the tail keeps: a change of the backend's names must
    /// have them written first (`holds_volatile_names`).
    volatile_queued: AtomicBool,
    /// A clean stop is under way (`stopping`).
    stopping: AtomicBool,
}

/// Poisoning is a panic's trace, and a panic ends the daemon (the panic policy, src/main.rs):
/// no lock is seen poisoned there; a test that panics in-process fails anyway.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap()
}

impl IntentLog {
    /// Opens the log on `device` (`created`: just made, all zeros) and returns it with every
    /// batch written after the last checkpoint, for recovery to replay.
    pub fn open(
        device: Box<dyn LogDevice>,
        created: bool,
        metrics: Arc<Metrics>,
    ) -> Result<(IntentLog, Vec<Batch>), LogError> {
        Self::open_reading(device, created, metrics, false).map(|(log, batches, _)| (log, batches))
    }

    /// For `coalescefs recover`: opens an existing log whose reading may stop at damage, and
    /// returns every intact batch after the checkpoint, with a line for each one lost.
    pub fn salvage(
        device: Box<dyn LogDevice>,
        metrics: Arc<Metrics>,
    ) -> Result<(IntentLog, Vec<Batch>, Vec<String>), LogError> {
        Self::open_reading(device, false, metrics, true)
    }

    fn open_reading(
        device: Box<dyn LogDevice>,
        created: bool,
        metrics: Arc<Metrics>,
        salvage: bool,
    ) -> Result<(IntentLog, Vec<Batch>, Vec<String>), LogError> {
        let size_bytes = device.size_bytes().map_err(|e| LogError::Io("open", e))?;
        let name = device.describe();
        if created {
            // A new log's block is the device's smallest write in place: a commit of a few
            // records costs one sector where the device has 512-byte sectors.
            let block = device.block_bytes() as u64;
            assert!(valid_block_bytes(block as usize), "{name}: a device block of {block} bytes");
            if size_bytes % block != 0 || size_bytes / block <= SUPERBLOCK_COPIES + 1 {
                return Err(LogError::Mismatch(format!(
                    "a log of {size_bytes} bytes is not whole blocks of {block} bytes, or too small"
                )));
            }
            let area_blocks = size_bytes / block - SUPERBLOCK_COPIES;
            let first = Superblock {
                block_bytes: block as u32,
                generation: 0,
                area_blocks,
                checkpoint_seq: 1,
                checkpoint_block: 0,
                closed_clean: false,
            };
            device.write_at(0, &first.encode()).map_err(|e| LogError::Io("write superblock", e))?;
            device.sync().map_err(|e| LogError::Io("sync", e))?;
        }
        let start = device
            .read_at(0, (2 * MAX_LOG_BLOCK_BYTES as u64).min(size_bytes) as usize)
            .map_err(|e| LogError::Io("read", e))?;
        let sb = Superblock::find(&start)
            .ok_or_else(|| LogError::Mismatch(format!("{name} holds no intact log superblock")))?;
        let block = u64::from(sb.block_bytes);
        if block % device.block_bytes() as u64 != 0 {
            return Err(LogError::Mismatch(format!(
                "{name} has log blocks of {block} bytes, but its device takes writes of {} bytes at least \
                 (moved to another disk?): `coalescefs recover` empties it, then remove it to have it made again",
                device.block_bytes()
            )));
        }
        let area_blocks = (size_bytes / block).saturating_sub(SUPERBLOCK_COPIES);
        if sb.area_blocks != area_blocks {
            return Err(LogError::Mismatch(format!(
                "{name} says {} blocks, the file holds {area_blocks}",
                sb.area_blocks
            )));
        }
        let area = DeviceArea::new(&*device, SUPERBLOCK_COPIES * block, area_blocks * block);
        // A log a clean stop closed holds no batch to find (`format`), unless a build that
        // predates the flag wrote one after it, which starts at the checkpoint: one batch is
        // read to see. `recover` reads the whole area.
        let mut read_bytes = start.len() as u64;
        let closed_clean = sb.closed_clean && !salvage && {
            let probe =
                DeviceArea::with_window(&*device, SUPERBLOCK_COPIES * block, area_blocks * block, 4 * block as usize);
            let written_after = written_after_checkpoint(&probe, &sb);
            read_bytes += probe.bytes_read.get();
            if let Some(e) = probe.error.take() {
                return Err(LogError::Io("read", e));
            }
            if written_after {
                log::warn!(
                    "{name}: closed clean, but a batch follows its checkpoint (written by an older \
                     coalescefs?): read whole"
                );
            }
            !written_after
        };
        let read = match read_log_unless_made(created || closed_clean, &area, &sb) {
            Ok(contents) => Ok((contents, Vec::new())),
            Err(_) if salvage => {
                let salvaged = salvage_log(&area, &sb);
                Ok((salvaged.contents, salvaged.lost))
            }
            Err(corruption) => Err(LogError::Corrupt(corruption)),
        };
        // A read that failed read as zeros, which the reader took for the log's end: it is the
        // error, not what the reader made of it.
        if let Some(e) = area.error.take() {
            return Err(LogError::Io("read", e));
        }
        read_bytes += area.bytes_read.get();
        drop(area);
        let (contents, lost) = read?;
        metrics.log_block_bytes.store(u64::from(sb.block_bytes), Relaxed);
        metrics.log_read_at_mount_bytes.store(read_bytes, Relaxed);
        if contents.unflushed_dropped > 0 {
            log::warn!(
                "{name}: {} batches after the log's tail were written without a flush and lost the one before \
                 them to a power cut: not replayed (closes acknowledged before the cut, never fsynced)",
                contents.unflushed_dropped
            );
        }
        let ring = Ring {
            sb,
            next_block: contents.next_block,
            next_seq: contents.next_seq,
            starts: contents.starts.into(),
            failed_write_at_next: false,
            last_batch_at: None,
            page_cache_unwritten: false,
            flushed_before_seq: contents.next_seq,
            checkpoint_before_writing: contents.unflushed_dropped > 0,
            // Batches read at open are replayed and checkpointed before any is written.
            names_unsynced: HashMap::new(),
        };
        let log = IntentLog {
            device,
            flushed_by_backend: false,
            metrics,
            ring: Mutex::new(ring),
            group: Mutex::new(GroupCommit {
                records: Queue::default(),
                next_ticket: 1,
                durable_ticket: 0,
                flush_wanted_ticket: 0,
                failed: Default::default(),
                failed_total: 0,
                leader_active: false,
                written: Default::default(),
                tail: TailMark::default(),
            }),
            committed: Condvar::new(),
            tail: None,
            volatile_queued: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        };
        if log.lock_ring().checkpoint_before_writing && contents.batches.is_empty() {
            // Nothing to replay, whose checkpoint would do it: the next batch's place and
            // number are recorded now, past the unflushed batches left there.
            log.checkpoint(log.next_seq())?;
        }
        Ok((log, contents.batches, lost))
    }

    /// Says that the log lives on the device the backing file system journals to.
    pub fn set_flushed_by_backend(&mut self, flushed_by_backend: bool) {
        self.flushed_by_backend = flushed_by_backend;
    }

    /// Whether a batch written (not flushed) before a change to the backend is durable before
    /// that change is: true where the log lives on the device the backing file system journals
    /// to, because a journaling file system flushes the device (REQ_PREFLUSH) before the commit
    /// that makes any change durable, and the batch's write had completed before the change
    /// was made: on the device, not in the log file's page cache (`commit_written_to_device`).
    pub fn flushed_by_backend(&self) -> bool {
        self.flushed_by_backend
    }

    fn lock_ring(&self) -> MutexGuard<'_, Ring> {
        lock(&self.ring)
    }

    /// Makes `records` durable in the log; returns once they are. Concurrent callers share
    /// batches: whoever finds no batch being written writes everything queued, as one batch,
    /// while the others wait for it. With no records, makes every batch written so far
    /// durable (and whatever was queued).
    pub fn commit(&self, records: Vec<Record>) -> Result<(), LogError> {
        self.commit_before_seq(records).map(drop)
    }

    /// `commit`, and the sequence number the batch holding `records` ends before: exactly,
    /// not `next_seq` read afterwards, which a concurrent batch may have moved on. A checkpoint
    /// that releases batches before S makes a held file on the backend when its records end
    /// before S; a later number would let the checkpoint release them and keep the file held.
    pub fn commit_before_seq(&self, records: Vec<Record>) -> Result<u64, LogError> {
        self.commit_to(records, true)
    }

    /// Writes `records` to the log, without waiting for the device to flush them: they survive
    /// the daemon (the device has them), and a power cut only after a later flush (any later
    /// `commit`, a checkpoint, or the file system's own flush of the device). A power cut
    /// before then takes this batch and every later unflushed one, never one without the
    /// batches before it. For what close acknowledges: as a close without the log, whose bytes
    /// reach the backing file system's cache.
    pub fn commit_written(&self, records: Vec<Record>) -> Result<(), LogError> {
        self.commit_written_before_seq(records).map(drop)
    }

    /// `commit_written`, and the batch (and every one before it) on the device when it returns:
    /// one written through the page cache is written back (`LogDevice::write_back`), without a
    /// flush. For records that must be durable before a change of the backing file system,
    /// where the log lives on its device (`flushed_by_backend`): its journal's commit flushes
    /// the device, not another file's dirty pages.
    pub fn commit_written_to_device(&self, records: Vec<Record>) -> Result<(), LogError> {
        self.commit_written(records)?;
        let mut ring = self.lock_ring();
        if ring.page_cache_unwritten {
            self.device.write_back().map_err(|e| LogError::Io("write back", e))?;
            ring.page_cache_unwritten = false;
            self.metrics.log_write_backs.fetch_add(1, Relaxed);
        }
        Ok(())
    }

    /// `commit_written`, and the sequence number its batch ends before (as `commit_before_seq`).
    pub fn commit_written_before_seq(&self, records: Vec<Record>) -> Result<u64, LogError> {
        self.commit_to(records, false)
    }

    fn commit_to(&self, records: Vec<Record>, flushed: bool) -> Result<u64, LogError> {
        // What a close acknowledges survives a power cut after `sync(1)`: where sync does not
        // reach the log (a block device), its batches are flushed at once.
        let flushed = flushed || !self.device.flushed_by_sync();
        let mut group = lock(&self.group);
        group.records.extend(records);
        let ticket = group.next_ticket;
        group.next_ticket += 1;
        if flushed {
            group.flush_wanted_ticket = ticket;
        }
        while group.durable_ticket < ticket {
            if group.leader_active {
                group = self.committed.wait(group).unwrap();
                continue;
            }
            group.leader_active = true;
            let records = group.records.take();
            // The tail's records go with the batch (its entries are for this batch's number,
            // which a mount after it finds written). They count as kept by the tail alone
            // until the batch is written: a backend change meanwhile waits for it.
            let tail_before = group.tail;
            group.tail = TailMark { covered: 0, since: None, ..tail_before };
            let (first, last) = (group.durable_ticket + 1, group.next_ticket - 1);
            let flush = group.flush_wanted_ticket >= first;
            drop(group);
            // Nothing queued (a caller making sure earlier names are durable): no batch, and a
            // flush only if a batch before waits for one.
            let result = if records.is_empty() { self.flush_written(flush) } else { self.write_batch(&records, flush) };
            group = lock(&self.group);
            group.leader_active = false;
            group.durable_ticket = last;
            // No record was kept in the tail while the batch was written (`keep_in_volatile_tail`
            // declines then): written, it leaves none that the tail alone keeps.
            if result.is_ok() {
                self.volatile_queued.store(false, Release);
            }
            if let Ok(before_seq) = result {
                group.written.push_back(WrittenRound {
                    first_ticket: first,
                    last_ticket: last,
                    before_seq,
                    unread: last - first + 1,
                });
            }
            if let Err(e) = result {
                // Names go back in front of what was queued since, in their order: a later
                // batch must not hold a create without the unlinks and renames before it.
                // The failed callers' data is theirs to write elsewhere.
                let later = group.records.take();
                group.records.extend(records.into_iter().filter(Record::is_namespace));
                group.records.extend(later);
                // The tail no longer matches the queue (a kill now loses its records, as it
                // would a failed batch's); the checkpointer tries them again in a batch.
                if let Some(since) = tail_before.since {
                    group.tail = TailMark { seq: 0, since: Some(since), ..TailMark::default() };
                    self.volatile_queued.store(true, Release);
                }
                group.failed_total += 1;
                group.failed.push_back((first, last, e));
                if group.failed.len() > 64 {
                    group.failed.pop_front();
                }
            }
            self.committed.notify_all();
        }
        if let Some((_, _, why)) = group.failed.iter().find(|(first, last, _)| (*first..=*last).contains(&ticket)) {
            return Err(why.clone());
        }
        let Some(at) =
            group.written.iter().position(|round| (round.first_ticket..=round.last_ticket).contains(&ticket))
        else {
            // Its round failed so many rounds ago that the failure was forgotten.
            return Err(LogError::Io("write", Errno(libc::EIO)));
        };
        let round = &mut group.written[at];
        let before_seq = round.before_seq;
        round.unread -= 1;
        while group.written.front().is_some_and(|round| round.unread == 0) {
            group.written.pop_front();
        }
        Ok(before_seq)
    }

    /// Queues namespace records to ride along with the next batch, without waiting for it:
    /// whatever a later commit makes durable, everything appended before it is durable too,
    /// which is all replay needs to apply names in the order they happened.
    pub fn append(&self, records: Vec<Record>) {
        assert!(records.iter().all(Record::is_namespace), "only names ride along; data is committed");
        let mut group = lock(&self.group);
        group.records.extend(records);
        // Renames with no fsync after them would otherwise queue without bound.
        if group.records.len() >= MAX_QUEUED_RECORDS && !group.leader_active {
            drop(group);
            if let Err(e) = self.commit_written(Vec::new()) {
                log::warn!("writing queued namespace records: {e}; they stay queued");
            }
        }
    }

    /// At the mount, before replay: `tail` becomes where this log keeps held files' name
    /// changes between batches (`keep_in_volatile_tail`). What a killed daemon kept there for
    /// the batch this log would write next is written into the log now, flushed, as that
    /// batch, and returned for replay with the others. Anything else it holds is not needed:
    /// entries for an earlier batch, which carried them; another boot's (a power cut took
    /// them, as it takes a batch written unflushed); any, beside a log just made or one a
    /// power cut left batches in unflushed. `batches`: what the log holds for replay, which
    /// the adopted batch joins.
    pub fn adopt_volatile_tail(
        &mut self,
        tail: VolatileTail,
        created: bool,
        batches: &mut Vec<Batch>,
    ) -> Result<(), LogError> {
        let (seq, cut, checkpoint_seq) = {
            let ring = self.lock_ring();
            (ring.next_seq, ring.checkpoint_before_writing, ring.sb.checkpoint_seq)
        };
        // A batch that did not fit before the ring's end is written after a wrap marker, which
        // takes a number of its own: a kill between the two writes leaves the marker, and the
        // tail's records stamped with its number are still the next batch's.
        let after_wrap = seq > checkpoint_seq && batches.last().is_none_or(|last| last.seq + 1 < seq);
        let wanted: &[u64] = if after_wrap { &[seq - 1, seq] } else { &[seq] };
        let records = if created || cut {
            Vec::new()
        } else {
            tail.read_for(wanted).map_err(|e| LogError::Io("read the volatile tail", Errno::from(e)))?
        };
        if !records.is_empty() {
            let before_seq = self.write_batch(&records, true)?;
            log::info!(
                "{}: {} name changes a stopped daemon kept there for batch {seq} are replayed with the log",
                tail.path().display(),
                records.len()
            );
            self.metrics.log_tail_records_replayed.fetch_add(records.len() as u64, Relaxed);
            // Written after a wrap marker of its own, where it does not fit before the end.
            batches.push(Batch { seq: before_seq - 1, records });
        }
        let end = tail.reset().map_err(|e| LogError::Io("empty the volatile tail", Errno::from(e)))?;
        self.group.get_mut().unwrap().tail = TailMark { end, ..TailMark::default() };
        self.tail = Some(tail);
        Ok(())
    }

    /// Queues `records` (name changes of held files) for the next batch, and keeps them in the
    /// volatile tail until it is written, instead of writing a batch now: they survive a
    /// killed daemon (the next mount reads the tail), not a power cut, as ext4 keeps a rename
    /// until its next journal commit. A later batch carries them (the next fsync's or close's),
    /// or the checkpointer's within `VOLATILE_NAMES_MAX_AGE`, or the writeback's before the
    /// backend changes a name (`holds_volatile_names`).
    pub fn keep_in_volatile_tail(&self, records: Vec<Record>) -> TailKeep {
        let Some(tail) = &self.tail else { return TailKeep::Declined(records) };
        let mut group = lock(&self.group);
        // A batch under way took the queue, and may fail and put it back before these: which
        // batch will carry them is not known here. A long queue is written as `append` writes it.
        if group.leader_active || group.records.len() >= MAX_QUEUED_RECORDS {
            return TailKeep::Declined(records);
        }
        let seq = {
            let ring = self.lock_ring();
            if ring.failed_write_at_next || ring.checkpoint_before_writing {
                return TailKeep::Declined(records);
            }
            ring.next_seq
        };
        let count = records.len() as u64;
        let mark = group.tail;
        let (from, end) = if mark.seq == seq { (mark.covered, Ok(mark.end)) } else { (0, tail.reset()) };
        group.records.extend(records);
        let written = end.and_then(|end| tail.append(end, seq, group.records.since(from)));
        let since = Some(mark.since.unwrap_or_else(Instant::now));
        match written {
            Ok(end) => {
                group.tail = TailMark { seq, end, covered: group.records.slots(), since };
                self.volatile_queued.store(true, Release);
                self.metrics.log_tail_records.fetch_add(count, Relaxed);
                TailKeep::Kept
            }
            Err(e) => {
                group.tail = TailMark { since, ..TailMark::default() };
                drop(group);
                log::warn!("{}: {e}; the name change is written to the log instead", tail.path().display());
                let committed = if self.flushed_by_backend {
                    self.commit_written_to_device(Vec::new())
                } else {
                    self.commit(Vec::new())
                };
                if let Err(e) = committed {
                    log::warn!("committing a name change of a new file to the intent log: {e}; it stays queued");
                }
                TailKeep::Kept
            }
        }
    }

    /// Whether queued records are kept only by the volatile tail: a change of the backend's
    /// names must not become durable before them (a name a renamed held file freed, taken by
    /// a backend file), so the writeback commits them first.
    pub fn holds_volatile_names(&self) -> bool {
        self.volatile_queued.load(Acquire)
    }

    /// How long the oldest record only the volatile tail keeps has waited for a batch.
    pub fn volatile_names_age(&self) -> Option<Duration> {
        if !self.holds_volatile_names() {
            return None;
        }
        lock(&self.group).tail.since.map(|since| since.elapsed())
    }

    /// At a clean unmount, the log emptied: the tail's file goes too.
    pub fn remove_volatile_tail(&self) {
        if let Some(tail) = &self.tail {
            tail.remove();
        }
    }

    /// Takes back the queued Create record of the file `unlink` removes if no batch has taken
    /// it yet and nothing else queued refers to the file: the log never knew the file, so its
    /// removal need not be logged either, unless something later takes its name before a
    /// checkpoint (`Queue::taken_back_unlinks`). Returns whether it did.
    pub fn cancel_queued_create(&self, unlink: &Record) -> bool {
        lock(&self.group).records.cancel_create(unlink)
    }

    /// How many Creates have been taken back so far: a checkpoint reads it before it commits
    /// the queue and syncs the backend, which then holds every unlink taken back before.
    pub fn take_backs_so_far(&self) -> u64 {
        lock(&self.group).records.take_backs
    }

    /// After a checkpoint: the unlinks taken back before `take_backs` are durable on the
    /// backend, and no longer kept.
    pub fn forget_take_backs_before(&self, take_backs: u64) {
        lock(&self.group).records.forget_take_backs_before(take_backs);
    }

    /// After a sync of the directory `dir` on the backend that began once every batch before
    /// `before_seq` was durable: `commit` is given the record that says the backend holds their
    /// name changes of it, for replay (`Record::NamesSynced`). Not when no batch before
    /// `before_seq` holds one that an earlier such record does not cover: the record would tell
    /// replay nothing. New files the log holds are not counted: replay makes them apart.
    pub fn commit_names_synced(
        &self,
        dir: &[u8],
        before_seq: u64,
        commit: impl FnOnce(Record) -> Result<(), LogError>,
    ) -> Result<(), LogError> {
        let uncovered = lock(&self.ring).names_unsynced.get(dir).is_some_and(|&(first, _)| first < before_seq);
        if !uncovered {
            return Ok(());
        }
        commit(Record::NamesSynced { dir: dir.to_vec(), before_seq })?;
        let mut ring = lock(&self.ring);
        if let Some((first, last)) = ring.names_unsynced.get_mut(dir) {
            *first = (*first).max(before_seq);
            if *last < before_seq {
                ring.names_unsynced.remove(dir);
            }
        }
        Ok(())
    }

    /// Makes the batches written so far durable (a flush of the device, if any is unflushed),
    /// and nothing queued.
    pub fn flush_written_batches(&self) -> Result<(), LogError> {
        self.flush_written(true).map(drop)
    }

    /// Whether a name change of `file` other than its creation waits in the queue.
    pub fn has_queued_name_change_of(&self, file: &[u8]) -> bool {
        lock(&self.group).records.changes_names_of(file)
    }

    /// Flushes the batches written so far, if `flush` and any is unflushed; returns the
    /// sequence number the next batch will get.
    fn flush_written(&self, flush: bool) -> Result<u64, LogError> {
        let mut ring = lock(&self.ring);
        if flush && ring.flushed_before_seq < ring.next_seq {
            self.device.sync().map_err(|e| LogError::Io("sync", e))?;
            self.metrics.log_flushes.fetch_add(1, Relaxed);
            ring.flushed_before_seq = ring.next_seq;
            ring.page_cache_unwritten = false;
        }
        Ok(ring.next_seq)
    }

    /// Writes one batch (and flushes it and everything before it, with `flush`); returns the
    /// sequence number it ends before.
    fn write_batch(&self, records: &[Record], flush: bool) -> Result<u64, LogError> {
        let mut ring = lock(&self.ring);
        let result = self.write_batch_locked(&mut ring, records, flush);
        // Refusing for want of room writes nothing; any other failure may have written.
        match &result {
            Ok(()) => ring.failed_write_at_next = false,
            Err(LogError::Full { .. }) => {}
            Err(_) => ring.failed_write_at_next = true,
        }
        result.map(|()| ring.next_seq)
    }

    fn write_batch_locked(&self, ring: &mut Ring, records: &[Record], flush: bool) -> Result<(), LogError> {
        assert!(!ring.checkpoint_before_writing, "a batch written over unflushed ones a power cut left, unrecorded");
        if ring.sb.closed_clean {
            // An open would not look for this batch: the superblock stops saying so first.
            let sb = Superblock { generation: ring.sb.generation + 1, closed_clean: false, ..ring.sb };
            self.write_superblock_locked(ring, sb)?;
        }
        let block_bytes = ring.sb.block_bytes as usize;
        let blocks = batch_blocks(records, block_bytes);
        let area = ring.sb.area_blocks;
        let wrap_waste = if ring.next_block + blocks > area { area - ring.next_block } else { 0 };
        let free = area - ring.used_blocks();
        // One block always stays free: a full ring would look empty.
        if wrap_waste + blocks + 1 > free {
            return Err(LogError::Full { needed_blocks: wrap_waste + blocks, free_blocks: free.saturating_sub(1) });
        }
        // Batches before this many were not flushed yet: a reader that misses one of them
        // knows a power cut took it, not damage.
        let lag = |seq: u64| u32::try_from(seq - ring.flushed_before_seq).unwrap_or(u32::MAX);
        let now = std::time::Instant::now();
        let through_page_cache = !flush
            && self.device.writes_through_page_cache()
            && ring.last_batch_at.is_some_and(|at| now.duration_since(at) < BURST_GAP);
        ring.last_batch_at = Some(now);
        // Blocks `at` on: the batch there, then free ring up to the oldest batch kept (or the
        // area's end), which a page-cache write may pad over.
        let write = |ring: &Ring, at: u64, bytes: &[u8]| {
            let offset = (SUPERBLOCK_COPIES + at) * block_bytes as u64;
            if through_page_cache {
                let end = at + (bytes.len() / block_bytes) as u64;
                self.device.write_unflushed_at(offset, bytes, ring.free_blocks_from(end) * block_bytes as u64)
            } else {
                self.device.write_at(offset, bytes)
            }
        };
        if wrap_waste > 0 {
            let seq = ring.next_seq;
            let at = ring.next_block;
            write(ring, at, &encode_wrap(seq, lag(seq), block_bytes)).map_err(|e| LogError::Io("write", e))?;
            ring.starts.push_back((seq, at));
            ring.next_seq += 1;
            ring.next_block = 0;
        } else if ring.next_block == area {
            ring.next_block = 0;
        }
        let (seq, at) = (ring.next_seq, ring.next_block);
        let bytes = encode_batch_lagging(seq, lag(seq), records, block_bytes);
        assert_eq!(
            bytes.len() as u64,
            blocks * block_bytes as u64,
            "a batch is the whole blocks it was given room for"
        );
        write(ring, at, &bytes).map_err(|e| LogError::Io("write", e))?;
        if flush {
            self.device.sync().map_err(|e| LogError::Io("sync", e))?;
            self.metrics.log_flushes.fetch_add(1, Relaxed);
            ring.page_cache_unwritten = false;
        } else if through_page_cache {
            ring.page_cache_unwritten = true;
        }
        self.metrics.log_batches.fetch_add(1, Relaxed);
        if through_page_cache {
            self.metrics.log_batches_page_cache.fetch_add(1, Relaxed);
        }
        self.metrics.log_records.fetch_add(records.len() as u64, Relaxed);
        self.metrics.log_write_bytes.fetch_add(bytes.len() as u64 + wrap_waste.min(1) * block_bytes as u64, Relaxed);
        for record in records.iter().filter(|r| !is_pending_key(r.file())) {
            for dir in record.directories_changed() {
                // The commit path: the key is copied only the first time its directory comes.
                match ring.names_unsynced.get_mut(dir) {
                    Some((_, last)) => *last = seq,
                    None => {
                        ring.names_unsynced.insert(dir.to_vec(), (seq, seq));
                    }
                }
            }
        }
        ring.starts.push_back((seq, at));
        ring.next_seq += 1;
        ring.next_block = at + blocks;
        if flush {
            ring.flushed_before_seq = ring.next_seq;
        }
        Ok(())
    }

    /// Releases every batch before `first_kept_seq`: the caller has made what they hold
    /// durable in the backend. Writes the next superblock generation to its copy and syncs.
    pub fn checkpoint(&self, first_kept_seq: u64) -> Result<(), LogError> {
        let mut ring = lock(&self.ring);
        assert!(first_kept_seq <= ring.next_seq, "checkpoint past the log's end");
        if ring.failed_write_at_next {
            // A failed batch that landed would be read after this checkpoint, its older bytes
            // over what the caller has just made durable: an empty batch goes over it first.
            self.write_batch_locked(&mut ring, &[], false)?;
            ring.failed_write_at_next = false;
        }
        while ring.starts.front().is_some_and(|&(seq, _)| seq < first_kept_seq) {
            ring.starts.pop_front();
        }
        ring.names_unsynced.retain(|_, (first, last)| {
            *first = (*first).max(first_kept_seq);
            *last >= first_kept_seq
        });
        let block = ring.starts.front().map_or(ring.next_block % ring.sb.area_blocks, |&(_, b)| b);
        let sb = Superblock {
            generation: ring.sb.generation + 1,
            checkpoint_seq: first_kept_seq,
            checkpoint_block: block,
            // A stop's checkpoint that releases every batch, with no record waiting in the
            // volatile tail for one: the next open reads none.
            closed_clean: self.stopping.load(Acquire)
                && first_kept_seq == ring.next_seq
                && !self.holds_volatile_names(),
            ..ring.sb
        };
        self.write_superblock_locked(&mut ring, sb)?;
        ring.flushed_before_seq = ring.next_seq;
        ring.page_cache_unwritten = false;
        ring.checkpoint_before_writing = false;
        self.metrics.log_checkpoints.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Writes `sb` (the next generation) to its copy and syncs the device.
    fn write_superblock_locked(&self, ring: &mut Ring, sb: Superblock) -> Result<(), LogError> {
        assert_eq!(sb.generation, ring.sb.generation + 1, "superblocks are written one generation at a time");
        let copy = sb.generation % SUPERBLOCK_COPIES;
        self.device
            .write_at(copy * u64::from(sb.block_bytes), &sb.encode())
            .map_err(|e| LogError::Io("write superblock", e))?;
        self.device.sync().map_err(|e| LogError::Io("sync", e))?;
        ring.sb = sb;
        self.metrics.log_write_bytes.fetch_add(u64::from(sb.block_bytes), Relaxed);
        Ok(())
    }

    /// A clean stop begins: a checkpoint from now on that releases every batch says so in the
    /// superblock it writes, and the next open reads no batch (80-90 ms of a 64 MiB log's
    /// mount here). A batch written after it makes the superblock say otherwise first.
    pub fn stopping(&self) {
        self.stopping.store(true, Release);
    }

    /// Whether the superblock says a clean stop closed the log (`stopping`).
    #[cfg(test)]
    pub fn closed_clean(&self) -> bool {
        lock(&self.ring).sb.closed_clean
    }

    /// How much of the ring holds batches not yet checkpointed.
    pub fn used_fraction(&self) -> f64 {
        let ring = lock(&self.ring);
        ring.used_blocks() as f64 / ring.sb.area_blocks as f64
    }

    pub fn holds_batches(&self) -> bool {
        let ring = lock(&self.ring);
        ring.next_seq > ring.sb.checkpoint_seq
    }

    /// How many batches have failed since the log was opened.
    pub fn failed_batches(&self) -> u64 {
        lock(&self.group).failed_total
    }

    /// The sequence number the next batch will get.
    /// The log block, in bytes: what one small commit costs the device.
    pub fn block_bytes(&self) -> usize {
        lock(&self.ring).sb.block_bytes as usize
    }

    pub fn next_seq(&self) -> u64 {
        lock(&self.ring).next_seq
    }

    /// The device the log lives on (recovery keeps its replay map there too).
    /// At unmount, after the last checkpoint: see `LogDevice::release`. A later commit (a
    /// timer's checkpoint) still works: through the file.
    pub fn release_device(&self) {
        self.device.release();
    }

    pub fn device(&self) -> &dyn LogDevice {
        &*self.device
    }

    /// Every batch a reader could find lies before this sequence number: `next_seq`, or one
    /// more while a failed batch may sit at the next position (an error reported after its
    /// bytes landed), until a batch or a checkpoint is written over it.
    pub fn readable_before_seq(&self) -> u64 {
        let ring = lock(&self.ring);
        ring.next_seq + u64::from(ring.failed_write_at_next)
    }
}

#[cfg(test)]
mod tests;
