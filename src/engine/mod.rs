//! The engine decides; it knows nothing of FUSE and names no backend. It speaks to a
//! `backend::Namespace` (names, attributes) and a `backend::UnitStore` (a file's data), and
//! owns what lies between them and the kernel:
//!
//! - `types`: its vocabulary at the seam (ids, attributes, directory entries, changes);
//! - `names`: names, attributes, links, renames, directory listings, extended attributes;
//! - `handles`: open files and directories, the page-cache choice of writers, and the data
//!   path of a handle (read, write, close, fsync, fallocate, lseek, copy_file_range);
//! - `writeback`: the write buffer, the flushers, the memory bound, flush errors, and the
//!   durability rules of fsync and close with the intent log;
//! - `pending`: files created since the last checkpoint that only the engine's memory and the
//!   intent log hold, in front of the backend's namespace and unit store;
//! - `buffer`: unit buffers and dirty-range sets;
//! - `burst`: when work comes close together (closes of tar's, rsync's, git's files);
//! - `intent_log`: the log's format, ring and device;
//! - `replay`: recovery from the log at mount, and `coalescefs recover`'s salvage.
//!
//! Must not: speak the FUSE protocol (the adapter translates) or make system calls on the
//! backing store itself (the backend does).

pub mod buffer;
pub mod burst;
mod handles;
pub mod intent_log;
mod names;
pub mod pending;
mod replay;
pub mod types;
pub mod writeback;

pub use replay::salvage_log;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::{Namespace, UnitStore};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};
use handles::{OpenDir, OpenFile, WriterMode};
use intent_log::device::LogDevice;
use types::{Attr, Kind, ObjectId, TimesToSet, Timestamp, ROOT_ID};
use writeback::{ShutDown, Writeback, WritebackConfig};

/// Who asked: files and directories created on a user's behalf belong to that user.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// Attribute changes of one setattr call; `None` leaves a field alone.
#[derive(Debug, Default, Clone, Copy)]
pub struct AttrChanges {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub times: TimesToSet,
    /// Clear set-user-ID and set-group-ID as an unprivileged truncate must (see
    /// [`Engine::drop_set_id_bits`]).
    pub drop_set_id_bits: bool,
}

impl AttrChanges {
    /// Only times change (what the kernel's writeback cache sends of a file's times).
    fn times_only(&self) -> bool {
        self.mode.is_none() && self.uid.is_none() && self.gid.is_none() && self.size.is_none() && !self.drop_set_id_bits
    }
}

/// One line of a directory listing, with the offset of the line after it.
#[derive(Debug, Clone)]
pub struct ListedEntry {
    pub ino: u64,
    pub next_offset: u64,
    pub kind: Option<Kind>,
    pub name: OsString,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Reported as `st_blksize`, so stdio-buffered writers pick their write size from it.
    pub block_size_bytes: u32,
    pub writeback: WritebackConfig,
    pub page_cache: PageCache,
    /// A name in the root directory the mount neither shows nor lets anyone make: the daemon's
    /// legacy state folder, when it lives in the backing directory.
    pub hidden_name: Option<OsString>,
    /// An extended attribute of the root the mount neither shows nor lets anyone change: the
    /// record of which intent log the backing directory needs after a crash.
    pub hidden_root_xattr: Option<OsString>,
    /// `fsync=backend`: an fsync (of a file or a directory, and an O_SYNC or O_DSYNC write) is a
    /// checkpoint, answered once the store holds everything written before it (an S3 mount's
    /// objects and manifest), not once the intent log does. Without a log an fsync syncs the
    /// store anyway.
    pub fsync_checkpoints: bool,
}

/// The intent log's device, when the log is on, and whether it was just created (all zeros).
pub struct LogSetup {
    pub device: Box<dyn LogDevice>,
    pub created: bool,
    /// The device is the one the backing file system journals to (see
    /// `IntentLog::flushed_by_backend`).
    pub flushed_by_backend: bool,
    /// Where held files' name changes wait for the log's next batch, on a file system a power
    /// cut empties (`intent_log::volatile_tail`); None: each is a batch of its own.
    pub volatile_tail: Option<intent_log::volatile_tail::VolatileTail>,
}

/// How writes use the kernel's page cache (FUSE's writeback cache).
///
/// With it, the kernel gathers small writes into large requests (4 KiB sequential writes
/// arrive as 1 MiB), but it must read a page before a write that covers only part of it: on a
/// file that holds data that is a device read per small write, the read-modify-write this
/// file system exists to avoid. `Auto` takes the cache where that cannot happen: a handle
/// opened for writing bypasses the page cache (FOPEN_DIRECT_IO, so every write reaches the
/// write buffer as it was made) when the file already holds data, and uses it when the file
/// is new, empty or only allocated (an O_TRUNC open over data is truncated after the open, by
/// the kernel's setattr, so it counts as holding data). Readers always use the cache. All
/// writable handles of one file share one choice while any is open, so cached and uncached
/// writes never mix on a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageCache {
    Off,
    On,
    Auto,
}

/// With the intent log: which closes it takes. A close of a new file (its name, attributes and
/// bytes), or of small changes to a file the log can stand for, may be a log commit, the
/// backend given the file at the next checkpoint; or the close may write the file to the
/// backend, as without the log. A new file whose close the log would take is held in memory
/// from its creation (`pending`); one whose close it would not is made on the backend then.
///
/// The log's commit costs the bytes once in the log and once more at the checkpoint. That wins
/// where a close is a durability point of its own (seed 000: one file, then `sync`, for which
/// the backing file system journals one creation: 15 KiB for a 1 KiB file on ext4, against the
/// log's 1.5), and loses in a burst (tar, rsync, a compiler, git's objects), whose creations
/// and changes one journal commit of the backing file system shares, so that the log's second
/// copy of every byte is the larger cost (seed 000's steady state, 200 files of 4 KiB: 2.30x the
/// file bytes through the log, 1.18x without). fsyncs go through the log either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogCloses {
    /// A close within `burst::BURST_GAP` of the one before it goes to the backend, and so does
    /// a new file created within that gap of a close; the others go to the log.
    Auto,
    /// Every close the log can take (the only choice before `Auto`).
    Always,
    /// None: closes write to the backend, and new files are made there when created.
    Never,
}

/// The answer to open and create: the handle, and whether the kernel should bypass its page
/// cache for it.
#[derive(Clone, Copy, Debug)]
pub struct Opened {
    pub fh: u64,
    pub bypass_page_cache: bool,
    /// Opened for writing: its close has buffered data to flush and errors to report.
    pub writable: bool,
}

pub struct Engine {
    /// With the intent log, `pending`'s views of the backend's namespace and store.
    ns: Arc<dyn Namespace>,
    store: Arc<dyn UnitStore>,
    pending: Option<Arc<pending::Pending>>,
    writeback: Arc<Writeback>,
    metrics: Arc<Metrics>,
    config: EngineConfig,
    next_handle: AtomicU64,
    files: Mutex<HashMap<u64, Arc<OpenFile>>>,
    /// `shut_down` has said so in the log once.
    shut_down_said: std::sync::atomic::AtomicBool,
    dirs: Mutex<HashMap<u64, Arc<OpenDir>>>,
    /// Per file with a writable handle open.
    writer_modes: Mutex<HashMap<ObjectId, WriterMode>>,
    /// The last attributes of files whose last name went while the write buffer held their
    /// data (`forget_if_gone`), until the kernel forgets them. The write buffer let their
    /// backend descriptors go, so the backend may find such a file no more (the local one
    /// reopens an object by its handle, which a deleted inode no longer has), yet the kernel
    /// writes its times once more after the unlink or rename (its writeback cache's ctime), and
    /// records a failure of that against the whole file system, where the next `syncfs`
    /// reports it (`coalescefs sync` failed with ESTALE after a `git commit` of 30,000 files).
    deleted_attrs: Mutex<HashMap<ObjectId, Attr>>,
}

/// Poisoning is a panic's trace, and a panic ends the daemon (the panic policy, src/main.rs):
/// no lock is seen poisoned there; a test that panics in-process fails anyway.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap()
}

impl Engine {
    /// Starts the engine on a namespace and a unit store; with a log, first replays what it
    /// holds. The error says what stopped the start, for the person mounting.
    pub fn new(
        ns: Arc<dyn Namespace>,
        store: Arc<dyn UnitStore>,
        config: EngineConfig,
        metrics: Arc<Metrics>,
        log: Option<LogSetup>,
    ) -> Result<Engine, String> {
        // The intent log's rules of the backend contract (`backend`, "The contract").
        if log.is_some() {
            if let Some(lacking) = store.capabilities().lacks_for_log() {
                return Err(format!(
                    "this backend lacks what the intent log needs: {lacking}; mount it with -o log=off"
                ));
            }
        }
        // The log answers an fsync of a file with nothing buffered from what this daemon knows:
        // the file is in sync. A daemon killed before this one may have left the backend changes
        // of its own unsynced (a close's bytes, names made at once), and a power cut would take
        // them though that fsync returned: the backend is synced once first.
        if log.as_ref().is_some_and(|setup| !setup.created) {
            store.sync_all().map_err(|e| format!("the backend could not be synced before recovery: {e}"))?;
        }
        let log = match log {
            Some(setup) => Some(replay::recover_from_log(&*ns, &*store, setup, &metrics)?),
            None => None,
        };
        // With the log, new files can live in it until a checkpoint: the engine then sees the
        // backend through the files it holds.
        let (ns, store, pending) = match &log {
            Some(_) => {
                let held = Arc::new(pending::Pending::new(ns, store, metrics.clone()));
                let ns: Arc<dyn Namespace> = Arc::new(pending::PendingNamespace(held.clone()));
                let store: Arc<dyn UnitStore> = Arc::new(pending::PendingStore(held.clone()));
                (ns, store, Some(held))
            }
            None => (ns, store, None),
        };
        let writeback =
            Writeback::new(ns.clone(), store.clone(), config.writeback.clone(), metrics.clone(), log, pending.clone());
        Ok(Engine {
            ns,
            store,
            pending,
            writeback,
            metrics,
            config,
            next_handle: AtomicU64::new(1),
            files: Mutex::new(HashMap::new()),
            shut_down_said: std::sync::atomic::AtomicBool::new(false),
            dirs: Mutex::new(HashMap::new()),
            writer_modes: Mutex::new(HashMap::new()),
            deleted_attrs: Mutex::new(HashMap::new()),
        })
    }

    /// The page-cache policy; the FUSE adapter negotiates the kernel flags it needs.
    pub fn page_cache(&self) -> PageCache {
        self.config.page_cache
    }

    fn open_file(&self, fh: u64) -> SysResult<Arc<OpenFile>> {
        lock(&self.files).get(&fh).cloned().ok_or(Errno(libc::EBADF))
    }

    fn open_dir(&self, fh: u64) -> SysResult<Arc<OpenDir>> {
        lock(&self.dirs).get(&fh).cloned().ok_or(Errno(libc::EBADF))
    }

    fn new_handle(&self) -> u64 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    /// The legacy state folder is the daemon's: the mount neither shows it nor lets anyone make it.
    fn is_hidden(&self, parent: ObjectId, name: &OsStr) -> bool {
        parent == ROOT_ID && self.config.hidden_name.as_deref() == Some(name)
    }

    fn checked_name(&self, parent: ObjectId, name: &OsStr, creating: bool) -> SysResult<()> {
        if self.is_hidden(parent, name) {
            return Err(Errno(if creating { libc::EPERM } else { libc::ENOENT }));
        }
        if name.is_empty() || name.as_encoded_bytes().contains(&b'/') {
            return Err(Errno(libc::EINVAL));
        }
        Ok(())
    }

    /// Every attribute answer goes through here (getattr, lookup, readdirplus, create): the
    /// kernel caches what it is told, so all must agree, the write buffer included.
    fn finish_attr(&self, mut attr: Attr) -> Attr {
        attr.blksize = self.config.block_size_bytes;
        if let Some(state) = self.writeback.file(attr.id) {
            // The write buffer knows better than the backend until it is flushed.
            attr.size = self.writeback.size(&state);
            if let Some(written) = self.writeback.last_write(&state) {
                let written = Timestamp::from(written);
                if written > attr.mtime {
                    attr.mtime = written;
                    attr.ctime = written;
                }
            }
            // Times that wait for the backend with the file's logged changes.
            if let Some(times) = self.writeback.pending_times(&state) {
                if let Some(types::TimeToSet::At(at)) = times.atime {
                    attr.atime = at;
                }
                if let Some(types::TimeToSet::At(at)) = times.mtime {
                    attr.mtime = at;
                }
            }
        }
        attr
    }

    /// Makes a file the engine holds (`pending`) a backend file, for an operation held files do
    /// not model: at once when the log has not seen it, else durably with a barrier.
    fn make_real(&self, id: ObjectId) -> SysResult<()> {
        if self.pending.is_none() {
            return Ok(());
        }
        // A commit between the status and the make changes which make applies: twice at most.
        for _ in 0..3 {
            if !self.writeback.make_held_on_backend(id)? {
                return Ok(());
            }
        }
        // Unlinked while open: it can no longer be made anywhere.
        Err(Errno(libc::EOPNOTSUPP))
    }

    /// Whether the intent log still holds records a next mount would replay.
    pub fn log_holds_records(&self) -> bool {
        self.writeback.log_holds_records()
    }

    /// `coalescefs sync`: everything written so far made durable in the store (with the
    /// intent log, a checkpoint, which also empties the log).
    pub fn sync_all(&self) -> SysResult<()> {
        self.writeback.sync_all()
    }

    /// Called once the kernel has let go of the mount: nothing may stay only in memory. Returns
    /// what could not be written (see `Writeback::shut_down`); later calls return the same.
    pub fn shut_down(&self) -> ShutDown {
        let first = !self.shut_down_said.swap(true, std::sync::atomic::Ordering::Relaxed);
        let done = self.writeback.shut_down();
        // Called by the kernel's DESTROY and again by the daemon after its session ends.
        if first {
            log::info!("shut down with {} open files", lock(&self.files).len());
        }
        done
    }

    /// For in-process tests: stops as a killed daemon would, writing nothing more and keeping
    /// nothing the store and the log have not made durable by their own rules.
    pub fn abandon(&self) {
        self.writeback.abandon();
    }
}
