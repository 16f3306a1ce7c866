//! The engine decides; it knows nothing of FUSE. It owns the inode table, open file and
//! directory handles, the hidden state folder, and ownership of files created on a user's
//! behalf; `writeback` shapes writes (units, write buffer, flushers, memory bound) and
//! `log_format` holds the intent log's on-disk format.
//!
//! Must not: speak the FUSE protocol (the adapter translates) or make system calls on the
//! backing directory itself (the backend does).

pub mod buffer;
pub mod geometry;
pub mod inodes;
pub mod intent_log;
mod replay;
pub mod writeback;

use std::collections::HashMap;
use std::ffi::{CStr, OsStr, OsString};
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::local::{self, data, DirStream, LocalBackend, Node, TimesToSet, XattrReply, STATE_DIR_NAME};
use crate::metrics::Metrics;
use crate::sys::{name_cstring, Errno, SysResult};
use inodes::{Inode, InodeTable, ROOT_INO};
use intent_log::device::LogDevice;
use intent_log::format::Record;
use intent_log::{IntentLog, LogError};
use crate::backend::faults::{FaultOp, Faults};
use writeback::{ErrorReport, FileState, Unwritten, Writeback, WritebackConfig};

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

/// An object the kernel now knows by `stat.st_ino`.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub stat: libc::stat,
}

/// One line of a directory listing, with the offset of the line after it.
#[derive(Debug, Clone)]
pub struct ListedEntry {
    pub ino: u64,
    pub next_offset: u64,
    pub kind: u8,
    pub name: OsString,
}

struct OpenFile {
    /// Keeps the inode (and its backing handle) alive while the file is open.
    inode: Arc<Inode>,
    /// The backend file opened with the application's access mode, for reads.
    file: File,
    /// The write buffer of a regular file, shared by all its handles.
    state: Option<Arc<FileState>>,
    /// Opened for writing: its close flushes the file (a reader's close leaves it alone).
    writable: bool,
}

/// The writable handles open on one inode, and the page-cache choice they share.
struct WriterMode {
    handles: usize,
    bypass_page_cache: bool,
}

impl OpenFile {
    fn state(&self) -> SysResult<&Arc<FileState>> {
        self.state.as_ref().ok_or(Errno(libc::EINVAL))
    }
}

struct OpenDir {
    inode: Arc<Inode>,
    /// Read a batch at a time from the offset the kernel asks for: nothing of the directory is
    /// copied whole, whatever its size.
    stream: Mutex<DirStream>,
}

/// Directory entries read from the backend for one readdir request: about what a 4 KiB
/// request holds when names are short (a readdirplus request holds fewer).
const READDIR_BATCH: usize = 128;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Reported as `st_blksize`, so stdio-buffered writers pick their write size from it.
    pub block_size_bytes: u32,
    pub writeback: WritebackConfig,
    pub page_cache: PageCache,
}

/// The intent log's device, when the log is on, and whether it was just created (all zeros).
pub struct LogSetup {
    pub device: Box<dyn LogDevice>,
    pub created: bool,
}

/// How writes use the kernel's page cache (FUSE's writeback cache).
///
/// With it, the kernel gathers small writes into large requests (4 KiB sequential writes
/// arrive as 1 MiB), but it must read a page before a write that covers only part of it: on a
/// file that holds data that is a device read per small write, the read-modify-write this
/// file system exists to avoid. `Auto` takes the cache where that cannot happen: a handle
/// opened for writing bypasses the page cache (FOPEN_DIRECT_IO, so every write reaches the
/// write buffer as it was made) when the file already holds data, and uses it when the file
/// is new, empty, truncated on open or only allocated. Readers always use the cache. All
/// writable handles of one file share one choice while any is open, so cached and uncached
/// writes never mix on a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageCache {
    Off,
    On,
    Auto,
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
    /// Test-only fault injection at the backend boundary (see `backend::faults`).
    faults: Option<Arc<Faults>>,
    backend: Arc<LocalBackend>,
    writeback: Arc<Writeback>,
    metrics: Arc<Metrics>,
    inodes: InodeTable,
    config: EngineConfig,
    is_root_daemon: bool,
    next_handle: AtomicU64,
    files: Mutex<HashMap<u64, Arc<OpenFile>>>,
    dirs: Mutex<HashMap<u64, Arc<OpenDir>>>,
    /// Per inode number, under `PageCache::Auto`.
    writer_modes: Mutex<HashMap<u64, WriterMode>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn key_of(st: &libc::stat) -> inodes::BackingKey {
    (st.st_dev, st.st_ino)
}

impl Engine {
    /// The error says what stopped the start, for the person mounting.
    pub fn new(
        backend: LocalBackend,
        config: EngineConfig,
        metrics: Arc<Metrics>,
        faults: Option<Arc<Faults>>,
        log: Option<LogSetup>,
    ) -> Result<Engine, String> {
        let root = backend.root_node().map_err(|e| e.to_string())?;
        let root_stat = backend.stat(&root).map_err(|e| e.to_string())?;
        let inodes = InodeTable::new(root, key_of(&root_stat));
        let backend = Arc::new(backend);
        let log = match log {
            Some(setup) => Some(recover_from_log(&backend, setup, &metrics)?),
            None => None,
        };
        let writeback = Writeback::new(backend.clone(), config.writeback.clone(), metrics.clone(), log, faults.clone());
        Ok(Engine {
            faults,
            backend,
            writeback,
            metrics,
            inodes,
            config,
            is_root_daemon: unsafe { libc::geteuid() } == 0,
            next_handle: AtomicU64::new(1),
            files: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            writer_modes: Mutex::new(HashMap::new()),
        })
    }

    /// Fault injection's check before a backend call (`node`: the object it is about).
    fn fault(&self, op: FaultOp, node: Option<&Node>) -> SysResult<()> {
        match &self.faults {
            Some(faults) => faults.check(op, node.and_then(|n| self.backend.path_of(n)).as_deref()),
            None => Ok(()),
        }
    }

    /// The page-cache policy; the FUSE adapter negotiates the kernel flags it needs.
    pub fn page_cache(&self) -> PageCache {
        self.config.page_cache
    }

    fn inode(&self, ino: u64) -> SysResult<Arc<Inode>> {
        // A number the kernel uses but we forgot would be a protocol bug; ESTALE is what a
        // network file system answers for a handle it no longer knows.
        self.inodes.get(ino).ok_or(Errno(libc::ESTALE))
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

    /// The state folder is the daemon's: the mount neither shows it nor lets anyone make it.
    fn is_state_dir(parent: u64, name: &OsStr) -> bool {
        parent == ROOT_INO && name == STATE_DIR_NAME
    }

    fn checked_name(parent: u64, name: &OsStr, creating: bool) -> SysResult<std::ffi::CString> {
        if Self::is_state_dir(parent, name) {
            return Err(Errno(if creating { libc::EPERM } else { libc::ENOENT }));
        }
        name_cstring(name)
    }

    /// Every attribute answer goes through here (getattr, lookup, readdirplus, create): the
    /// kernel caches what it is told, so all must agree, the write buffer included.
    fn finish_stat(&self, ino: u64, mut st: libc::stat) -> libc::stat {
        st.st_ino = ino;
        st.st_blksize = self.config.block_size_bytes as libc::blksize_t;
        if let Some(state) = self.writeback.file(ino) {
            // The write buffer knows better than the backend until it is flushed.
            st.st_size = self.writeback.size(&state) as libc::off_t;
            if let Some(written) = self.writeback.last_write(&state) {
                if let Ok(d) = written.duration_since(std::time::UNIX_EPOCH) {
                    if (d.as_secs() as i64, d.subsec_nanos() as i64) > (st.st_mtime, st.st_mtime_nsec) {
                        st.st_mtime = d.as_secs() as i64;
                        st.st_mtime_nsec = d.subsec_nanos() as i64;
                        st.st_ctime = st.st_mtime;
                        st.st_ctime_nsec = st.st_mtime_nsec;
                    }
                }
            }
        }
        st
    }

    fn remember(&self, node: Node, st: libc::stat) -> Entry {
        let inode = self.inodes.remember(node, key_of(&st));
        Entry { stat: self.finish_stat(inode.ino, st) }
    }

    pub fn lookup(&self, parent: u64, name: &OsStr) -> SysResult<Entry> {
        let name = Self::checked_name(parent, name, false)?;
        let parent = self.inode(parent)?;
        let (node, st) = self.backend.lookup(&parent.node, &name)?;
        Ok(self.remember(node, st))
    }

    pub fn forget(&self, ino: u64, count: u64) {
        self.inodes.forget(ino, count);
    }

    pub fn getattr(&self, ino: u64) -> SysResult<libc::stat> {
        let inode = self.inode(ino)?;
        let st = self.backend.stat(&inode.node)?;
        Ok(self.finish_stat(ino, st))
    }

    pub fn setattr(&self, ino: u64, fh: Option<u64>, changes: AttrChanges) -> SysResult<libc::stat> {
        let inode = self.inode(ino)?;
        if changes.drop_set_id_bits && changes.mode.is_none() {
            self.drop_set_id_bits(&inode)?;
        }
        if changes.uid.is_some() || changes.gid.is_some() {
            self.backend.chown(&inode.node, changes.uid, changes.gid)?;
        }
        if let Some(mode) = changes.mode {
            self.backend.chmod(&inode.node, mode & 0o7777)?;
        }
        if let Some(size) = changes.size {
            let state = match fh {
                Some(fh) => self.open_file(fh)?.state.clone(),
                None => self.writeback.file(ino),
            };
            match state {
                Some(state) => self.writeback.set_size(&state, size)?,
                None => {
                    self.backend.truncate(&inode.node, size)?;
                    self.writeback.note_backend_changed(ino);
                }
            }
        }
        if changes.times.atime.is_some() || changes.times.mtime.is_some() {
            // "Now" is fixed here: flushes may set the times again later (see note_times_set).
            let times = changes.times.resolved_now(std::time::SystemTime::now());
            self.backend.set_times(&inode.node, times)?;
            if let Some(state) = self.writeback.file(ino) {
                self.writeback.note_times_set(&state, times);
            }
        }
        self.getattr(ino)
    }

    /// The FUSE adapter negotiates FUSE_HANDLE_KILLPRIV_V2, so clearing set-user-ID and
    /// set-group-ID after an unprivileged write or truncate is ours to do (otherwise the kernel
    /// asks for security.capability before every single write, one more round trip each).
    /// The kernel's own rule (setattr_should_drop_suidgid): set-user-ID always; set-group-ID only
    /// with group execute, since without it the bit marks mandatory locking, not privilege.
    fn drop_set_id_bits(&self, inode: &Inode) -> SysResult<()> {
        let st = self.backend.stat(&inode.node)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(());
        }
        let mode = st.st_mode & 0o7777;
        let mut kept = mode & !libc::S_ISUID;
        if mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            kept &= !libc::S_ISGID;
        }
        if kept != mode {
            self.backend.chmod(&inode.node, kept)?;
        }
        Ok(())
    }

    pub fn readlink(&self, ino: u64) -> SysResult<Vec<u8>> {
        let inode = self.inode(ino)?;
        self.backend.readlink(&inode.node)
    }

    /// Gives a just-created object to the user who created it. The daemon creates as itself
    /// (root), so without this every file would belong to root. A set-group-ID parent keeps its
    /// group, as the kernel would have done.
    fn give_to_caller(&self, parent: &Inode, node: &Node, caller: Caller) -> SysResult<libc::stat> {
        let created = self.backend.stat(node)?;
        if !self.is_root_daemon {
            return Ok(created);
        }
        let parent_stat = self.backend.stat(&parent.node)?;
        let gid = if parent_stat.st_mode & libc::S_ISGID != 0 { parent_stat.st_gid } else { caller.gid };
        if created.st_uid == caller.uid && created.st_gid == gid {
            return Ok(created);
        }
        self.backend.chown(node, Some(caller.uid), Some(gid))?;
        let owned = self.backend.stat(node)?;
        // chown clears set-user-ID and set-group-ID bits; the creator asked for them.
        if owned.st_mode != created.st_mode && created.st_mode & libc::S_IFMT != libc::S_IFLNK {
            self.backend.chmod(node, created.st_mode & 0o7777)?;
            return self.backend.stat(node);
        }
        Ok(owned)
    }

    pub fn mknod(&self, parent: u64, name: &OsStr, mode: u32, rdev: u64, caller: Caller) -> SysResult<Entry> {
        let name = Self::checked_name(parent, name, true)?;
        let parent = self.inode(parent)?;
        self.fault(FaultOp::Create, Some(&parent.node))?;
        let (node, _) = self.backend.mknod(&parent.node, &name, mode, rdev)?;
        let st = self.give_to_caller(&parent, &node, caller)?;
        let regular = mode & libc::S_IFMT == libc::S_IFREG;
        let entry = self.remember(node, st);
        let created_record = regular.then(|| self.create_record(entry.stat.st_ino, &parent, &name, &st)).flatten();
        self.writeback.note_created(entry.stat.st_ino, regular.then_some(parent.ino), created_record);
        Ok(entry)
    }

    pub fn mkdir(&self, parent: u64, name: &OsStr, mode: u32, caller: Caller) -> SysResult<Entry> {
        let name = Self::checked_name(parent, name, true)?;
        let parent = self.inode(parent)?;
        self.fault(FaultOp::Create, Some(&parent.node))?;
        let (node, _) = self.backend.mkdir(&parent.node, &name, mode)?;
        let st = self.give_to_caller(&parent, &node, caller)?;
        let entry = self.remember(node, st);
        self.writeback.note_created(entry.stat.st_ino, None, None);
        Ok(entry)
    }

    pub fn symlink(&self, parent: u64, name: &OsStr, target: &Path, caller: Caller) -> SysResult<Entry> {
        let name = Self::checked_name(parent, name, true)?;
        let target = local::symlink_target(target)?;
        let parent = self.inode(parent)?;
        self.fault(FaultOp::Create, Some(&parent.node))?;
        let (node, _) = self.backend.symlink(&parent.node, &name, &target)?;
        let st = self.give_to_caller(&parent, &node, caller)?;
        Ok(self.remember(node, st))
    }

    pub fn link(&self, ino: u64, new_parent: u64, new_name: &OsStr) -> SysResult<Entry> {
        let new_name = Self::checked_name(new_parent, new_name, true)?;
        let inode = self.inode(ino)?;
        let new_parent = self.inode(new_parent)?;
        self.fault(FaultOp::Create, Some(&new_parent.node))?;
        let (node, st) = self.backend.link(&inode.node, &new_parent.node, &new_name)?;
        // The log records one name per file: a second one only a backend sync makes durable.
        self.writeback.note_backend_changed(ino);
        self.writeback.note_names_changed(None, None, &[ino]);
        Ok(self.remember(node, st))
    }

    /// For the intent log: the record of a regular file's creation, queued when it happens, so
    /// that the log holds names in the order they came to be (replay relies on it).
    fn create_record(&self, ino: u64, parent: &Inode, name: &CStr, st: &libc::stat) -> Option<Record> {
        if !self.writeback.logging() {
            return None;
        }
        Some(Record::Create {
            file: self.inode(ino).ok()?.backend_handle(&self.backend).ok()?,
            parent: parent.backend_handle(&self.backend).ok()?,
            name: name.to_bytes().to_vec(),
            mode: st.st_mode,
            uid: st.st_uid,
            gid: st.st_gid,
        })
    }

    /// For the intent log: what `name` in `parent` is now (its handle and inode number), if
    /// anything, before a change removes or replaces it.
    fn named_object(&self, parent: &Inode, name: &CStr) -> Option<(Vec<u8>, u64)> {
        if !self.writeback.logging() {
            return None;
        }
        let (node, st) = self.backend.lookup(&parent.node, name).ok()?;
        let handle = self.backend.file_handle(&node).ok()?;
        Some((handle, self.inodes.ino_for_listing(key_of(&st))))
    }

    pub fn unlink(&self, parent: u64, name: &OsStr) -> SysResult<()> {
        self.remove(parent, name, false)
    }

    pub fn rmdir(&self, parent: u64, name: &OsStr) -> SysResult<()> {
        self.remove(parent, name, true)
    }

    fn remove(&self, parent: u64, name: &OsStr, directory: bool) -> SysResult<()> {
        let name = Self::checked_name(parent, name, false)?;
        let parent = self.inode(parent)?;
        let removed = self.named_object(&parent, &name);
        // A file released with data still buffered (its flush refused, or not yet due): once its
        // last name goes, that data can never be read and its descriptors keep the backend's
        // space allocated, so both go. Looked up only when there is such a file.
        let lingering = (!directory && self.writeback.has_lingering_files())
            .then(|| self.backend.lookup(&parent.node, &name).ok())
            .flatten()
            .filter(|(_, st)| self.writeback.is_lingering(self.inodes.ino_for_listing(key_of(st))));
        if directory {
            self.backend.rmdir(&parent.node, &name)?;
        } else {
            self.backend.unlink(&parent.node, &name)?;
        }
        if let Some((node, st)) = lingering {
            if self.backend.stat(&node).is_ok_and(|now| now.st_nlink == 0) {
                self.writeback.forget_file(self.inodes.ino_for_listing(key_of(&st)));
            }
        }
        if let (Some((handle, ino)), Ok(parent_handle)) = (removed, parent.backend_handle(&self.backend)) {
            let record = Record::Unlink { file: handle, parent: parent_handle, name: name.to_bytes().to_vec(), directory };
            self.writeback.note_names_changed(Some(record), None, &[ino]);
        }
        Ok(())
    }

    pub fn rename(&self, parent: u64, name: &OsStr, new_parent: u64, new_name: &OsStr, flags: u32) -> SysResult<()> {
        let name = Self::checked_name(parent, name, false)?;
        let new_name = Self::checked_name(new_parent, new_name, true)?;
        let parent = self.inode(parent)?;
        let new_parent = self.inode(new_parent)?;
        let moved = self.named_object(&parent, &name);
        let replaced = self.named_object(&new_parent, &new_name);
        self.backend.rename(&parent.node, &name, &new_parent.node, &new_name, flags)?;
        let Some((handle, ino)) = moved else { return Ok(()) };
        if flags & libc::RENAME_EXCHANGE != 0 {
            let replaced_ino = replaced.map(|(_, ino)| ino);
            // Two names swapped: the log has no record for it, so only a backend sync makes
            // either durable.
            for ino in [Some(ino), replaced_ino].into_iter().flatten() {
                self.writeback.note_backend_changed(ino);
            }
            self.writeback.note_names_changed(None, None, &[Some(ino), replaced_ino].into_iter().flatten().collect::<Vec<_>>());
            return Ok(());
        }
        let (Ok(from_parent), Ok(to_parent)) = (parent.backend_handle(&self.backend), new_parent.backend_handle(&self.backend))
        else {
            return Ok(());
        };
        let (replaced_handle, replaced_ino) = replaced.map_or((Vec::new(), None), |(h, ino)| (h, Some(ino)));
        let record = Record::Rename {
            file: handle,
            from_parent,
            from_name: name.to_bytes().to_vec(),
            to_parent,
            to_name: new_name.to_bytes().to_vec(),
            replaced: replaced_handle,
        };
        self.writeback.note_names_changed(Some(record), Some((ino, new_parent.ino)), &replaced_ino.into_iter().collect::<Vec<_>>());
        Ok(())
    }

    /// Flags for the backend's own open of an object the kernel has already resolved. Only
    /// what still means something for that reopen is kept; every other flag the kernel passes
    /// was the kernel's to act on, or is the engine's decision:
    ///
    /// | flag | why it is not passed on |
    /// |---|---|
    /// | O_NOFOLLOW, O_DIRECTORY | the kernel resolved the path; the reopen goes through `/proc/self/fd`, a link that O_NOFOLLOW would refuse (ELOOP: SQLite's and rsync's opens) |
    /// | O_CREAT, O_EXCL, O_NOCTTY, O_TMPFILE | the kernel's (create is its own request) |
    /// | O_TRUNC | FUSE_ATOMIC_O_TRUNC: the engine truncates through the write buffer |
    /// | O_APPEND | the kernel sends the offset; Linux pwrite on an O_APPEND file would ignore it |
    /// | O_SYNC, O_DSYNC | the engine makes such writes durable (through the log or the backend) |
    /// | O_DIRECT | the engine chooses how units reach the backend |
    /// | O_NONBLOCK, O_ASYNC, kernel-internal bits | mean nothing for a regular file's reopen |
    ///
    /// Kept: O_NOATIME (the application asked that its reads leave atime alone). Write-only
    /// opens are opened read-write: with the kernel's writeback cache the kernel reads partly
    /// written pages through whichever handle it holds, a write-only one included. The kernel
    /// has checked the application's access mode already.
    fn backend_open_flags(flags: i32) -> i32 {
        let access = match flags & libc::O_ACCMODE {
            libc::O_RDONLY => libc::O_RDONLY,
            _ => libc::O_RDWR,
        };
        access | (flags & libc::O_NOATIME)
    }

    fn register_file(&self, inode: Arc<Inode>, file: File, flags: i32) -> SysResult<Opened> {
        let st = data::stat(&file)?;
        let state = (st.st_mode & libc::S_IFMT == libc::S_IFREG)
            .then(|| self.writeback.open_file(&inode, st.st_size as u64));
        // An empty file stays as it is: truncating it would change nothing but count as a
        // backend change, and keep a new file's fsync off the intent log.
        if let (Some(state), true) = (&state, flags & libc::O_TRUNC != 0) {
            if st.st_size != 0 || self.writeback.size(state) != 0 {
                self.writeback.set_size(state, 0)?;
            }
        }
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let mut bypass_page_cache = false;
        if let (Some(state), true, PageCache::Auto) = (&state, writable, self.config.page_cache) {
            let mut modes = lock(&self.writer_modes);
            let mode = modes.entry(inode.ino).or_insert_with(|| WriterMode {
                handles: 0,
                bypass_page_cache: self.holds_data(&file, state),
            });
            mode.handles += 1;
            bypass_page_cache = mode.bypass_page_cache;
        }
        let fh = self.new_handle();
        lock(&self.files).insert(fh, Arc::new(OpenFile { inode, file, state, writable }));
        Ok(Opened { fh, bypass_page_cache, writable })
    }

    /// Whether a partial-page write into this file could make the kernel read old data:
    /// bytes in the write buffer or data (not holes, not unwritten allocation) on the backend.
    fn holds_data(&self, file: &File, state: &FileState) -> bool {
        if self.writeback.size(state) == 0 {
            return false;
        }
        if self.writeback.has_buffered_data(state) {
            return true;
        }
        // Doubt counts as data: the uncached path is always correct, only slower.
        !matches!(data::seek(file, 0, libc::SEEK_DATA), Err(Errno(libc::ENXIO)))
    }

    /// `drop_set_id_bits`: an unprivileged open with O_TRUNC (see [`Engine::drop_set_id_bits`]).
    pub fn open(&self, ino: u64, flags: i32, drop_set_id_bits: bool) -> SysResult<Opened> {
        let inode = self.inode(ino)?;
        let file = self.backend.open(&inode.node, Self::backend_open_flags(flags))?;
        if drop_set_id_bits && flags & libc::O_TRUNC != 0 {
            self.drop_set_id_bits(&inode)?;
        }
        self.register_file(inode, file, flags)
    }

    pub fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> SysResult<(Entry, Opened)> {
        let name = Self::checked_name(parent, name, true)?;
        let parent_inode = self.inode(parent)?;
        self.fault(FaultOp::Create, Some(&parent_inode.node))?;
        let (file, node, _) = self.backend.create(
            &parent_inode.node,
            &name,
            Self::backend_open_flags(flags) | (flags & libc::O_EXCL),
            mode,
        )?;
        let st = self.give_to_caller(&parent_inode, &node, caller)?;
        let entry = self.remember(node, st);
        let created_record = self.create_record(entry.stat.st_ino, &parent_inode, &name, &st);
        self.writeback.note_created(entry.stat.st_ino, Some(parent_inode.ino), created_record);
        let inode = self.inode(entry.stat.st_ino)?;
        Ok((entry, self.register_file(inode, file, flags)?))
    }

    pub fn read(&self, fh: u64, offset: u64, size: u32) -> SysResult<Vec<u8>> {
        let open = self.open_file(fh)?;
        let Some(state) = &open.state else {
            self.fault(FaultOp::Read, Some(&open.inode.node))?;
            let mut buf = vec![0u8; size as usize];
            let n = data::read_at(&open.file, &mut buf, offset)?;
            buf.truncate(n);
            return Ok(buf);
        };
        // The overlay is taken before the backend is read: a unit whose flush ends in between
        // is then in both, never in neither.
        let (logical_size, overlay, _reading) = self.writeback.snapshot_overlay(state, offset, size as u64)?;
        self.fault(FaultOp::Read, Some(&open.inode.node))?;
        let len = logical_size.saturating_sub(offset).min(size as u64) as usize;
        let mut buf = vec![0u8; len];
        data::read_at(&open.file, &mut buf, offset)?; // short where the backend is shorter: zeros
        for (at, bytes) in overlay {
            let from = (at - offset) as usize;
            let to = (from + bytes.len()).min(len);
            if from < to {
                buf[from..to].copy_from_slice(&bytes[..to - from]);
            }
        }
        self.metrics.application_read_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(buf)
    }

    /// `drop_set_id_bits`: the writer lacks CAP_FSETID (see [`Engine::drop_set_id_bits`]).
    /// `from_page_cache`: see [`Writeback::write`].
    pub fn write(
        &self,
        fh: u64,
        offset: u64,
        bytes: &[u8],
        flags: i32,
        drop_set_id_bits: bool,
        from_page_cache: bool,
    ) -> SysResult<u32> {
        let open = self.open_file(fh)?;
        let state = open.state()?;
        if drop_set_id_bits {
            self.drop_set_id_bits(&open.inode)?;
        }
        let taken = self.writeback.write(state, offset, bytes, from_page_cache)?;
        self.metrics.application_write_bytes.fetch_add(taken as u64, Ordering::Relaxed);
        self.metrics.application_write_requests.fetch_add(1, Ordering::Relaxed);
        self.metrics.application_write_sizes.record(taken as u64);
        if flags & libc::O_DSYNC != 0 {
            // O_SYNC and O_DSYNC writes are durable when they return.
            self.writeback.fsync(state, flags & libc::O_SYNC != libc::O_SYNC)?;
        }
        Ok(taken as u32)
    }

    /// close(2): the file's buffered data goes to the backend, and a flush error is reported
    /// here, where the application can still see it.
    pub fn flush(&self, fh: u64) -> SysResult<()> {
        let open = self.open_file(fh)?;
        match &open.state {
            Some(state) if open.writable => self.writeback.close_file(state),
            _ => Ok(()),
        }
    }

    pub fn release(&self, fh: u64) -> SysResult<()> {
        let open = lock(&self.files).remove(&fh).ok_or(Errno(libc::EBADF))?;
        if open.writable && open.state.is_some() && self.config.page_cache == PageCache::Auto {
            let mut modes = lock(&self.writer_modes);
            if let Some(mode) = modes.get_mut(&open.inode.ino) {
                mode.handles -= 1;
                if mode.handles == 0 {
                    modes.remove(&open.inode.ino);
                }
            }
        }
        if let Some(state) = &open.state {
            self.writeback.release_file(state);
        }
        Ok(())
    }

    pub fn fsync(&self, fh: u64, data_only: bool) -> SysResult<()> {
        let open = self.open_file(fh)?;
        match &open.state {
            Some(state) => self.writeback.fsync(state, data_only),
            None => data::sync(&open.file, data_only),
        }
    }

    /// Operations the backend performs on its own data flush the write buffer first, so that
    /// they see, and are not later overwritten by, what the application wrote before them.
    fn flushed(&self, fh: u64) -> SysResult<Arc<OpenFile>> {
        let open = self.open_file(fh)?;
        if let Some(state) = &open.state {
            self.writeback.flush_file(state, None, ErrorReport::Write)?;
        }
        Ok(open)
    }

    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32) -> SysResult<()> {
        let open = self.flushed(fh)?;
        data::fallocate(&open.file, mode, offset, length)?;
        self.writeback.note_backend_changed(open.inode.ino);
        if let (Some(state), true) = (&open.state, mode & libc::FALLOC_FL_KEEP_SIZE == 0) {
            self.writeback.note_backend_size(state, offset + length);
        }
        Ok(())
    }

    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> SysResult<i64> {
        let open = self.flushed(fh)?;
        data::seek(&open.file, offset, whence)
    }

    pub fn copy_file_range(
        &self,
        source_fh: u64,
        source_offset: u64,
        target_fh: u64,
        target_offset: u64,
        length: u64,
    ) -> SysResult<u32> {
        let source = self.flushed(source_fh)?;
        let target = self.flushed(target_fh)?;
        // FUSE replies carry a u32 byte count; the kernel loops for the rest.
        let length = length.min(u32::MAX as u64 & !0xfff);
        let copied = data::copy_range(&source.file, source_offset, &target.file, target_offset, length)?;
        self.writeback.note_backend_changed(target.inode.ino);
        if let Some(state) = &target.state {
            self.writeback.note_backend_size(state, target_offset + copied as u64);
        }
        Ok(copied as u32)
    }

    pub fn opendir(&self, ino: u64) -> SysResult<u64> {
        let inode = self.inode(ino)?;
        let stream = self.backend.open_dir_stream(&inode.node)?;
        let fh = self.new_handle();
        lock(&self.dirs).insert(fh, Arc::new(OpenDir { inode, stream: Mutex::new(stream) }));
        Ok(fh)
    }

    /// Up to `READDIR_BATCH` entries from `offset` on (0: the start; otherwise an entry's
    /// `next_offset`, which is the backing file system's own cookie), without the state folder.
    /// An empty answer is the end of the directory.
    pub fn readdir(&self, fh: u64, offset: u64) -> SysResult<Vec<ListedEntry>> {
        let dir = self.open_dir(fh)?;
        let entries = lock(&dir.stream).read(offset, READDIR_BATCH)?;
        let dir_ino = dir.inode.ino;
        let dev = dir.inode.key.0;
        // A batch of two or more cannot consist of the state folder alone: filtering never
        // turns a full batch into a false end.
        Ok(entries
            .into_iter()
            .filter(|entry| !Self::is_state_dir(dir_ino, &entry.name))
            .map(|entry| ListedEntry {
                // ".." is reported as the directory itself: the kernel takes neither number.
                ino: if entry.name == "." || entry.name == ".." {
                    dir_ino
                } else {
                    self.inodes.ino_for_listing((dev, entry.backing_ino))
                },
                next_offset: entry.next_offset,
                kind: entry.kind,
                name: entry.name,
            })
            .collect())
    }

    pub fn releasedir(&self, fh: u64) -> SysResult<()> {
        lock(&self.dirs).remove(&fh).map(drop).ok_or(Errno(libc::EBADF))
    }

    pub fn fsyncdir(&self, fh: u64, data_only: bool) -> SysResult<()> {
        let dir = self.open_dir(fh)?;
        self.writeback.commit_queued_names()?;
        self.fault(FaultOp::Sync, Some(&dir.inode.node))?;
        let file = self.backend.open_dir_for_sync(&dir.inode.node)?;
        data::sync(&file, data_only)
    }

    pub fn statfs(&self, ino: u64) -> SysResult<libc::statvfs> {
        let inode = self.inode(ino)?;
        self.backend.statfs(&inode.node)
    }

    pub fn set_xattr(&self, ino: u64, name: &CStr, value: &[u8], flags: i32) -> SysResult<()> {
        let inode = self.inode(ino)?;
        self.backend.set_xattr(&inode.node, name, value, flags)
    }

    pub fn get_xattr(&self, ino: u64, name: &CStr, size: u32) -> SysResult<XattrReply> {
        let inode = self.inode(ino)?;
        self.backend.get_xattr(&inode.node, name, size as usize)
    }

    pub fn list_xattr(&self, ino: u64, size: u32) -> SysResult<XattrReply> {
        let inode = self.inode(ino)?;
        self.backend.list_xattr(&inode.node, size as usize)
    }

    pub fn remove_xattr(&self, ino: u64, name: &CStr) -> SysResult<()> {
        let inode = self.inode(ino)?;
        self.backend.remove_xattr(&inode.node, name)
    }

    /// `coalescefs sync`: everything written so far made durable on the backend (with the
    /// intent log, a checkpoint, which also empties the log).
    pub fn sync_all(&self) -> SysResult<()> {
        self.writeback.sync_all()
    }

    /// Called once the kernel has let go of the mount: nothing may stay only in memory. Returns
    /// what could not be written (see `Writeback::shut_down`); later calls return the same.
    pub fn shut_down(&self) -> Vec<Unwritten> {
        let unwritten = self.writeback.shut_down();
        log::info!(
            "unmounting {}: {} inodes, {} open files",
            self.backend.root_path().display(),
            self.inodes.len(),
            lock(&self.files).len()
        );
        unwritten
    }
}

/// `coalescefs recover`: applies every intact batch of a damaged intent log to the backend and
/// empties the log. Returns a line for each batch that could not be read.
pub fn salvage_log(backend: LocalBackend, device: Box<dyn LogDevice>) -> Result<Vec<String>, String> {
    let metrics = Arc::new(Metrics::default());
    let name = device.describe();
    let (log, batches, lost) = IntentLog::salvage(device, metrics.clone()).map_err(|e| format!("{name}: {e}"))?;
    replay::replay(&backend, log, &batches, &metrics).map_err(|e| format!("replaying {name}: {e}"))?;
    Ok(lost)
}

/// Opens the intent log and applies what it holds after its checkpoint to the backend (see
/// `replay`), so the log starts empty.
fn recover_from_log(backend: &LocalBackend, setup: LogSetup, metrics: &Arc<Metrics>) -> Result<IntentLog, String> {
    let name = setup.device.describe();
    let (log, batches) = IntentLog::open(setup.device, setup.created, metrics.clone()).map_err(|e| match e {
        LogError::Corrupt(_) => format!("{name}: {e}; nothing was replayed or changed"),
        _ => format!("{name}: {e}"),
    })?;
    replay::replay(backend, log, &batches, metrics).map_err(|e| format!("replaying the intent log {name}: {e}"))
}
