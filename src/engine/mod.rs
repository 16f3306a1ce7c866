//! The engine decides; it knows nothing of FUSE and names no backend. It speaks to a
//! `backend::Namespace` (names, attributes) and a `backend::UnitStore` (a file's data), and
//! owns what lies between them and the kernel:
//!
//! - `types`: its vocabulary at the seam (ids, attributes, directory entries, changes);
//! - open file and directory handles, and the page-cache choice of writers (here);
//! - `writeback`: the write buffer, the flushers, the memory bound, flush errors, and the
//!   durability rules of fsync and close with the intent log;
//! - `buffer`: unit buffers and dirty-range sets;
//! - `intent_log`: the log's format, ring and device;
//! - `replay`: recovery from the log at mount.
//!
//! Must not: speak the FUSE protocol (the adapter translates) or make system calls on the
//! backing store itself (the backend does).

pub mod buffer;
pub mod intent_log;
mod replay;
pub mod types;
pub mod writeback;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::{DirReader, FileData, Namespace, OpenMode, UnitStore};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};
use intent_log::device::LogDevice;
use intent_log::format::Record;
use intent_log::{IntentLog, LogError};
use types::{Attr, Kind, NewObject, ObjectId, Owner, SetAttr, StatFs, TimesToSet, Timestamp, XattrReply, ROOT_ID};
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

/// One line of a directory listing, with the offset of the line after it.
#[derive(Debug, Clone)]
pub struct ListedEntry {
    pub ino: u64,
    pub next_offset: u64,
    pub kind: Option<Kind>,
    pub name: OsString,
}

struct OpenFile {
    id: ObjectId,
    /// The file's data, opened with the application's access mode, for reads.
    data: Arc<dyn FileData>,
    /// The write buffer of a regular file, shared by all its handles.
    state: Option<Arc<FileState>>,
    /// Opened for writing: its close flushes the file (a reader's close leaves it alone).
    writable: bool,
}

/// The writable handles open on one file, and the page-cache choice they share.
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
    id: ObjectId,
    /// Read a batch at a time from the offset the kernel asks for: nothing of the directory is
    /// copied whole, whatever its size.
    reader: Mutex<Box<dyn DirReader>>,
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
    /// A name in the root directory the mount neither shows nor lets anyone make: the daemon's
    /// legacy state folder, when it lives in the backing directory.
    pub hidden_name: Option<OsString>,
    /// An extended attribute of the root the mount neither shows nor lets anyone change: the
    /// record of which intent log the backing directory needs after a crash.
    pub hidden_root_xattr: Option<OsString>,
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
    ns: Arc<dyn Namespace>,
    store: Arc<dyn UnitStore>,
    writeback: Arc<Writeback>,
    metrics: Arc<Metrics>,
    config: EngineConfig,
    next_handle: AtomicU64,
    files: Mutex<HashMap<u64, Arc<OpenFile>>>,
    dirs: Mutex<HashMap<u64, Arc<OpenDir>>>,
    /// Per file, under `PageCache::Auto`.
    writer_modes: Mutex<HashMap<ObjectId, WriterMode>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
        let log = match log {
            Some(setup) => Some(recover_from_log(&*ns, &*store, setup, &metrics)?),
            None => None,
        };
        let writeback = Writeback::new(ns.clone(), store.clone(), config.writeback.clone(), metrics.clone(), log);
        Ok(Engine {
            ns,
            store,
            writeback,
            metrics,
            config,
            next_handle: AtomicU64::new(1),
            files: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            writer_modes: Mutex::new(HashMap::new()),
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
        }
        attr
    }

    pub fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr> {
        self.checked_name(parent, name, false)?;
        Ok(self.finish_attr(self.ns.lookup(parent, name)?))
    }

    pub fn forget(&self, id: ObjectId, count: u64) {
        self.ns.forget(id, count);
    }

    pub fn getattr(&self, id: ObjectId) -> SysResult<Attr> {
        Ok(self.finish_attr(self.ns.getattr(id)?))
    }

    pub fn setattr(&self, id: ObjectId, fh: Option<u64>, changes: AttrChanges) -> SysResult<Attr> {
        if changes.drop_set_id_bits && changes.mode.is_none() {
            self.drop_set_id_bits(id)?;
        }
        if changes.uid.is_some() || changes.gid.is_some() || changes.mode.is_some() {
            let owner_and_mode =
                SetAttr { mode: changes.mode, uid: changes.uid, gid: changes.gid, ..SetAttr::default() };
            self.ns.setattr(id, &owner_and_mode)?;
        }
        if let Some(size) = changes.size {
            let state = match fh {
                Some(fh) => self.open_file(fh)?.state.clone(),
                None => self.writeback.file(id),
            };
            match state {
                Some(state) => self.writeback.set_size(&state, size)?,
                None => {
                    self.store.open(id, OpenMode { write: true, no_atime: false })?.set_size(size)?;
                    self.writeback.note_backend_changed(id);
                }
            }
        }
        if !changes.times.is_empty() {
            // "Now" is fixed here: flushes may set the times again later (see note_times_set).
            let times = changes.times.resolved(Timestamp::now());
            self.ns.setattr(id, &SetAttr { times, ..SetAttr::default() })?;
            if let Some(state) = self.writeback.file(id) {
                self.writeback.note_times_set(&state, times);
            }
        }
        self.getattr(id)
    }

    /// The FUSE adapter negotiates FUSE_HANDLE_KILLPRIV_V2, so clearing set-user-ID and
    /// set-group-ID after an unprivileged write or truncate is ours to do (otherwise the kernel
    /// asks for security.capability before every single write, one more round trip each).
    /// The kernel's own rule (setattr_should_drop_suidgid): set-user-ID always; set-group-ID only
    /// with group execute, since without it the bit marks mandatory locking, not privilege.
    fn drop_set_id_bits(&self, id: ObjectId) -> SysResult<()> {
        let attr = self.ns.getattr(id)?;
        if attr.kind != Kind::File {
            return Ok(());
        }
        let mode = attr.perm;
        let mut kept = mode & !libc::S_ISUID;
        if mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            kept &= !libc::S_ISGID;
        }
        if kept != mode {
            self.ns.setattr(id, &SetAttr { mode: Some(kept), ..SetAttr::default() })?;
        }
        Ok(())
    }

    pub fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        self.ns.readlink(id)
    }

    /// Makes an object on a user's behalf (it belongs to that user, see `Namespace::make`),
    /// and tells the write buffer and the log of a regular file made.
    fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, caller: Caller) -> SysResult<Attr> {
        self.checked_name(parent, name, true)?;
        let attr = self.ns.make(parent, name, what, Owner { uid: caller.uid, gid: caller.gid })?;
        match attr.kind {
            Kind::File => {
                let record = self.create_record(attr.id, parent, name, &attr);
                self.writeback.note_created(attr.id, Some(parent), record);
            }
            Kind::Directory => self.writeback.note_created(attr.id, None, None),
            _ => {}
        }
        Ok(self.finish_attr(attr))
    }

    pub fn mknod(&self, parent: ObjectId, name: &OsStr, mode: u32, rdev: u64, caller: Caller) -> SysResult<Attr> {
        let what = match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => NewObject::File { perm: mode & 0o7777 },
            _ => NewObject::Node { mode, rdev },
        };
        self.make(parent, name, what, caller)
    }

    pub fn mkdir(&self, parent: ObjectId, name: &OsStr, mode: u32, caller: Caller) -> SysResult<Attr> {
        self.make(parent, name, NewObject::Directory { perm: mode & 0o7777 }, caller)
    }

    pub fn symlink(&self, parent: ObjectId, name: &OsStr, target: &[u8], caller: Caller) -> SysResult<Attr> {
        if target.contains(&0) {
            return Err(Errno(libc::EINVAL));
        }
        self.make(parent, name, NewObject::Symlink { target }, caller)
    }

    pub fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        self.checked_name(new_parent, new_name, true)?;
        let attr = self.ns.link(id, new_parent, new_name)?;
        // The log records one name per file: a second one only a backend sync makes durable.
        self.writeback.note_backend_changed(id);
        self.writeback.note_names_changed(None, None, &[id]);
        Ok(self.finish_attr(attr))
    }

    /// For the intent log: the record of a regular file's creation, queued when it happens, so
    /// that the log holds names in the order they came to be (replay relies on it).
    fn create_record(&self, id: ObjectId, parent: ObjectId, name: &OsStr, attr: &Attr) -> Option<Record> {
        if !self.writeback.logging() {
            return None;
        }
        Some(Record::Create {
            file: self.ns.log_key(id).ok()?,
            parent: self.ns.log_key(parent).ok()?,
            name: name.as_encoded_bytes().to_vec(),
            mode: attr.mode(),
            uid: attr.uid,
            gid: attr.gid,
        })
    }

    /// For the intent log: what `name` in `parent` is now (its key and id), if anything,
    /// before a change removes or replaces it.
    fn named_object(&self, parent: ObjectId, name: &OsStr) -> Option<(Vec<u8>, ObjectId)> {
        if !self.writeback.logging() {
            return None;
        }
        self.ns.identify(parent, name)
    }

    pub fn unlink(&self, parent: ObjectId, name: &OsStr) -> SysResult<()> {
        self.remove(parent, name, false)
    }

    pub fn rmdir(&self, parent: ObjectId, name: &OsStr) -> SysResult<()> {
        self.remove(parent, name, true)
    }

    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()> {
        self.checked_name(parent, name, false)?;
        let removed = self.named_object(parent, name);
        // A file released with data still buffered (its flush refused, or not yet due): once its
        // last name goes, that data can never be read and its descriptors keep the backend's
        // space allocated, so both go. Looked up only when there is such a file.
        let lingering = (!directory && self.writeback.has_lingering_files())
            .then(|| self.ns.identify(parent, name))
            .flatten()
            .map(|(_, id)| id)
            .filter(|&id| self.writeback.is_lingering(id));
        self.ns.remove(parent, name, directory)?;
        if let Some(id) = lingering {
            if self.ns.getattr(id).is_ok_and(|now| now.nlink == 0) {
                self.writeback.forget_file(id);
            }
        }
        if let (Some((key, id)), Ok(parent_key)) = (removed, self.ns.log_key(parent)) {
            let record =
                Record::Unlink { file: key, parent: parent_key, name: name.as_encoded_bytes().to_vec(), directory };
            self.writeback.note_names_changed(Some(record), None, &[id]);
        }
        Ok(())
    }

    pub fn rename(
        &self,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        flags: u32,
    ) -> SysResult<()> {
        self.checked_name(parent, name, false)?;
        self.checked_name(new_parent, new_name, true)?;
        let moved = self.named_object(parent, name);
        let replaced = self.named_object(new_parent, new_name);
        self.ns.rename(parent, name, new_parent, new_name, flags)?;
        let Some((key, id)) = moved else { return Ok(()) };
        if flags & libc::RENAME_EXCHANGE != 0 {
            let replaced_id = replaced.map(|(_, id)| id);
            // Two names swapped: the log has no record for it, so only a backend sync makes
            // either durable.
            let both: Vec<ObjectId> = [Some(id), replaced_id].into_iter().flatten().collect();
            for &one in &both {
                self.writeback.note_backend_changed(one);
            }
            self.writeback.note_names_changed(None, None, &both);
            return Ok(());
        }
        let (Ok(from_parent), Ok(to_parent)) = (self.ns.log_key(parent), self.ns.log_key(new_parent)) else {
            return Ok(());
        };
        let (replaced_key, replaced_id) = replaced.map_or((Vec::new(), None), |(k, id)| (k, Some(id)));
        let record = Record::Rename {
            file: key,
            from_parent,
            from_name: name.as_encoded_bytes().to_vec(),
            to_parent,
            to_name: new_name.as_encoded_bytes().to_vec(),
            replaced: replaced_key,
        };
        self.writeback.note_names_changed(
            Some(record),
            Some((id, new_parent)),
            &replaced_id.into_iter().collect::<Vec<_>>(),
        );
        Ok(())
    }

    /// The data of a regular file opened for an application: the kernel has checked its access
    /// mode; only O_NOATIME (the application's wish about reads) reaches the store, and write
    /// access (the kernel reads partly written pages of the writeback cache through whichever
    /// handle it holds, a write-only one included). Every other open flag was the kernel's to
    /// act on, or is the engine's decision:
    ///
    /// | flag | why it is not passed on |
    /// |---|---|
    /// | O_NOFOLLOW, O_DIRECTORY | the kernel resolved the path (O_NOFOLLOW on the store's reopen made SQLite's and rsync's opens fail with ELOOP) |
    /// | O_CREAT, O_EXCL, O_NOCTTY, O_TMPFILE | the kernel's (create is its own request) |
    /// | O_TRUNC | FUSE_ATOMIC_O_TRUNC: the engine truncates through the write buffer |
    /// | O_APPEND | the kernel sends the offset; Linux pwrite on an O_APPEND file would ignore it |
    /// | O_SYNC, O_DSYNC | the engine makes such writes durable (through the log or the store) |
    /// | O_DIRECT | the engine chooses how units reach the store |
    /// | O_NONBLOCK, O_ASYNC, kernel-internal bits | mean nothing for a regular file's data |
    fn open_mode(flags: i32) -> OpenMode {
        OpenMode { write: flags & libc::O_ACCMODE != libc::O_RDONLY, no_atime: flags & libc::O_NOATIME != 0 }
    }

    fn register_file(&self, id: ObjectId, kind: Kind, flags: i32) -> SysResult<Opened> {
        let mode = Self::open_mode(flags);
        let data = self.store.open(id, mode)?;
        let state = match kind {
            Kind::File => Some(self.writeback.open_file(id, data.size()?)?),
            _ => None,
        };
        // An empty file stays as it is: truncating it would change nothing but count as a
        // backend change, and keep a new file's fsync off the intent log.
        if let (Some(state), true) = (&state, flags & libc::O_TRUNC != 0) {
            if self.writeback.size(state) != 0 {
                self.writeback.set_size(state, 0)?;
            }
        }
        let writable = mode.write;
        let mut bypass_page_cache = false;
        if let (Some(state), true, PageCache::Auto) = (&state, writable, self.config.page_cache) {
            let mut modes = lock(&self.writer_modes);
            let writer = modes
                .entry(id)
                .or_insert_with(|| WriterMode { handles: 0, bypass_page_cache: self.holds_data(&*data, state) });
            writer.handles += 1;
            bypass_page_cache = writer.bypass_page_cache;
        }
        let fh = self.new_handle();
        lock(&self.files).insert(fh, Arc::new(OpenFile { id, data, state, writable }));
        Ok(Opened { fh, bypass_page_cache, writable })
    }

    /// Whether a partial-page write into this file could make the kernel read old data:
    /// bytes in the write buffer or data (not holes, not unwritten allocation) in the store.
    fn holds_data(&self, data: &dyn FileData, state: &FileState) -> bool {
        if self.writeback.size(state) == 0 {
            return false;
        }
        self.writeback.has_buffered_data(state) || data.holds_data()
    }

    /// `drop_set_id_bits`: an unprivileged open with O_TRUNC (see [`Engine::drop_set_id_bits`]).
    pub fn open(&self, id: ObjectId, flags: i32, drop_set_id_bits: bool) -> SysResult<Opened> {
        let attr = self.ns.getattr(id)?;
        if drop_set_id_bits && flags & libc::O_TRUNC != 0 {
            self.drop_set_id_bits(id)?;
        }
        self.register_file(id, attr.kind, flags)
    }

    pub fn create(
        &self,
        parent: ObjectId,
        name: &OsStr,
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> SysResult<(Attr, Opened)> {
        let attr = match self.make(parent, name, NewObject::File { perm: mode & 0o7777 }, caller) {
            Ok(attr) => attr,
            // Made by someone else since the kernel looked: without O_EXCL that is an open.
            Err(Errno(libc::EEXIST)) if flags & libc::O_EXCL == 0 => self.lookup(parent, name)?,
            Err(e) => return Err(e),
        };
        let opened = self.register_file(attr.id, attr.kind, flags)?;
        Ok((attr, opened))
    }

    pub fn read(&self, fh: u64, offset: u64, size: u32) -> SysResult<Vec<u8>> {
        let open = self.open_file(fh)?;
        let Some(state) = &open.state else {
            let mut buf = vec![0u8; size as usize];
            let n = open.data.read_at(&mut buf, offset)?;
            buf.truncate(n);
            return Ok(buf);
        };
        // The overlay is taken before the store is read: a unit whose flush ends in between is
        // then in both, never in neither.
        let (logical_size, overlay, _reading) = self.writeback.snapshot_overlay(state, offset, size as u64)?;
        let len = logical_size.saturating_sub(offset).min(size as u64) as usize;
        let mut buf = vec![0u8; len];
        open.data.read_at(&mut buf, offset)?; // short where the store is shorter: zeros
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
            self.drop_set_id_bits(open.id)?;
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

    /// close(2): the file's buffered data goes to the store, and a flush error is reported
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
            if let Some(mode) = modes.get_mut(&open.id) {
                mode.handles -= 1;
                if mode.handles == 0 {
                    modes.remove(&open.id);
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
            None => open.data.sync(data_only),
        }
    }

    /// Operations the store performs on its own data flush the write buffer first, so that
    /// they see, and are not later overwritten by, what the application wrote before them.
    fn flushed(&self, fh: u64) -> SysResult<Arc<OpenFile>> {
        let open = self.open_file(fh)?;
        if let Some(state) = &open.state {
            self.writeback.flush_file(state, None, ErrorReport::Write)?;
        }
        Ok(open)
    }

    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32) -> SysResult<()> {
        // Before the flush: a store without it answers at once. The kernel turns ENOSYS into
        // EOPNOTSUPP and asks no more on this mount; posix_fallocate then writes zeros.
        if !self.store.capabilities().allocate {
            return Err(Errno(libc::ENOSYS));
        }
        let open = self.flushed(fh)?;
        open.data.allocate(mode, offset, length)?;
        self.writeback.note_backend_changed(open.id);
        if let (Some(state), true) = (&open.state, mode & libc::FALLOC_FL_KEEP_SIZE == 0) {
            self.writeback.note_backend_size(state, offset + length);
        }
        Ok(())
    }

    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> SysResult<i64> {
        let open = self.flushed(fh)?;
        open.data.seek(offset, whence)
    }

    pub fn copy_file_range(
        &self,
        source_fh: u64,
        source_offset: u64,
        target_fh: u64,
        target_offset: u64,
        length: u64,
    ) -> SysResult<u32> {
        // ENOSYS: the kernel copies through reads and writes, and asks no more on this mount.
        if !self.store.capabilities().copy_ranges {
            return Err(Errno(libc::ENOSYS));
        }
        let source = self.flushed(source_fh)?;
        let target = self.flushed(target_fh)?;
        // FUSE replies carry a u32 byte count; the kernel loops for the rest.
        let length = length.min(u32::MAX as u64 & !0xfff);
        let copied = source.data.copy_to(source_offset, &*target.data, target_offset, length)?;
        self.writeback.note_backend_changed(target.id);
        if let Some(state) = &target.state {
            self.writeback.note_backend_size(state, target_offset + copied as u64);
        }
        Ok(copied as u32)
    }

    pub fn opendir(&self, id: ObjectId) -> SysResult<u64> {
        let reader = self.ns.open_dir(id)?;
        let fh = self.new_handle();
        lock(&self.dirs).insert(fh, Arc::new(OpenDir { id, reader: Mutex::new(reader) }));
        Ok(fh)
    }

    /// Up to `READDIR_BATCH` entries from `offset` on (0: the start; otherwise an entry's
    /// `next_offset`), without the hidden legacy state folder. An empty answer is the end.
    pub fn readdir(&self, fh: u64, offset: u64) -> SysResult<Vec<ListedEntry>> {
        let dir = self.open_dir(fh)?;
        let entries = lock(&dir.reader).read(offset, READDIR_BATCH)?;
        // A batch of two or more cannot consist of the state folder alone: filtering never
        // turns a full batch into a false end.
        Ok(entries
            .into_iter()
            .filter(|entry| !self.is_hidden(dir.id, &entry.name))
            .map(|entry| ListedEntry {
                // ".." is reported as the directory itself: the kernel takes neither number.
                ino: if entry.name == "." || entry.name == ".." { dir.id } else { entry.id },
                next_offset: entry.next_offset,
                kind: entry.kind,
                name: entry.name,
            })
            .collect())
    }

    pub fn releasedir(&self, fh: u64) -> SysResult<()> {
        lock(&self.dirs).remove(&fh).map(drop).ok_or(Errno(libc::EBADF))
    }

    pub fn fsyncdir(&self, fh: u64, _data_only: bool) -> SysResult<()> {
        let dir = self.open_dir(fh)?;
        self.writeback.commit_queued_names()?;
        self.ns.sync_dir(dir.id)
    }

    pub fn statfs(&self, id: ObjectId) -> SysResult<StatFs> {
        self.ns.statfs(id)
    }

    fn is_hidden_xattr(&self, id: ObjectId, name: &OsStr) -> bool {
        id == ROOT_ID && self.config.hidden_root_xattr.as_deref() == Some(name)
    }

    pub fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()> {
        if self.is_hidden_xattr(id, name) {
            return Err(Errno(libc::EPERM));
        }
        self.ns.set_xattr(id, name, value, flags)
    }

    pub fn get_xattr(&self, id: ObjectId, name: &OsStr, size: u32) -> SysResult<XattrReply> {
        if self.is_hidden_xattr(id, name) {
            return Err(Errno(libc::ENODATA));
        }
        self.ns.get_xattr(id, name, size as usize)
    }

    /// The names of `id`'s extended attributes, NUL-terminated, without the hidden one.
    pub fn list_xattr(&self, id: ObjectId, size: u32) -> SysResult<XattrReply> {
        let Some(hidden) = self.config.hidden_root_xattr.as_deref().filter(|_| id == ROOT_ID) else {
            return self.ns.list_xattr(id, size as usize);
        };
        // The whole list is needed to answer even a size query without the hidden name.
        let names = loop {
            let XattrReply::Size(needed) = self.ns.list_xattr(id, 0)? else { return Err(Errno(libc::EIO)) };
            match self.ns.list_xattr(id, needed.max(1)) {
                Ok(XattrReply::Data(names)) => break names,
                Ok(XattrReply::Size(_)) => return Err(Errno(libc::EIO)),
                // It grew between the two calls: ask again.
                Err(Errno(libc::ERANGE)) => continue,
                Err(e) => return Err(e),
            }
        };
        let shown: Vec<u8> = names
            .split_inclusive(|&b| b == 0)
            .filter(|name| name.strip_suffix(&[0]).unwrap_or(name) != hidden.as_encoded_bytes())
            .flatten()
            .copied()
            .collect();
        match size as usize {
            0 => Ok(XattrReply::Size(shown.len())),
            room if room < shown.len() => Err(Errno(libc::ERANGE)),
            _ => Ok(XattrReply::Data(shown)),
        }
    }

    pub fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()> {
        if self.is_hidden_xattr(id, name) {
            return Err(Errno(libc::EPERM));
        }
        self.ns.remove_xattr(id, name)
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
    pub fn shut_down(&self) -> Vec<Unwritten> {
        let unwritten = self.writeback.shut_down();
        log::info!("shut down with {} open files", lock(&self.files).len());
        unwritten
    }

    /// For in-process tests: stops as a killed daemon would, writing nothing more and keeping
    /// nothing the store and the log have not made durable by their own rules.
    pub fn abandon(&self) {
        self.writeback.abandon();
    }
}

/// `coalescefs recover`: applies every intact batch of a damaged intent log and empties the
/// log. Returns a line for each batch that could not be read.
pub fn salvage_log(
    ns: &dyn Namespace,
    store: &dyn UnitStore,
    device: Box<dyn LogDevice>,
) -> Result<Vec<String>, String> {
    let metrics = Arc::new(Metrics::default());
    let name = device.describe();
    let (log, batches, lost) = IntentLog::salvage(device, metrics.clone()).map_err(|e| format!("{name}: {e}"))?;
    replay::replay(ns, store, log, &batches, &metrics).map_err(|e| format!("replaying {name}: {e}"))?;
    Ok(lost)
}

/// Opens the intent log and applies what it holds after its checkpoint (see `replay`), so the
/// log starts empty.
fn recover_from_log(
    ns: &dyn Namespace,
    store: &dyn UnitStore,
    setup: LogSetup,
    metrics: &Arc<Metrics>,
) -> Result<IntentLog, String> {
    let name = setup.device.describe();
    let (log, batches) = IntentLog::open(setup.device, setup.created, metrics.clone()).map_err(|e| match e {
        LogError::Corrupt(_) => format!("{name}: {e}; nothing was replayed or changed"),
        _ => format!("{name}: {e}"),
    })?;
    replay::replay(ns, store, log, &batches, metrics).map_err(|e| format!("replaying the intent log {name}: {e}"))
}
