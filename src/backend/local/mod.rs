//! The local-directory backend: every file of the mount is an ordinary file at the same path in
//! the backing directory, so an unmounted backing directory is plainly readable. It is both a
//! `Namespace` (the directory tree) and a `UnitStore` (the files' bytes).
//!
//! - `nodes`: every system call on the backing directory, objects found again by file handle,
//!   and the bounded cache of their descriptors;
//! - `objects`: ids (the backing inode numbers where unambiguous) and lookup counts;
//! - `data`: a file's data, and how a unit reaches it (O_DIRECT, AIO, sub-block edges);
//! - `geometry`: the unit discovered from the device under the backing directory.
//!
//! Must not: decide anything (caching, flushing, hiding the daemon's state): the engine does.

// Public for examples/aio_vs_uring.rs, which measures it against io_uring.
pub mod aio;
pub mod data;
pub mod geometry;
pub mod nodes;
pub mod objects;
pub mod prepared;

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use crate::backend::{Capabilities, DirReader, FileData, Namespace, OpenMode, UnitStore};
use crate::engine::types::{Attr, DirEntry, Kind, NewObject, ObjectId, Owner, SetAttr, StatFs, Timestamp, XattrReply};
use crate::metrics::Metrics;
use crate::sys::{check, name_cstring, Errno, SysResult};
use data::LocalFileData;
use nodes::{BackingDir, DirStream, Node};
use objects::{BackingKey, ObjectTable};
use prepared::{lock, PreparedFiles};

fn key_of(st: &libc::stat) -> BackingKey {
    (st.st_dev, st.st_ino)
}

fn timestamp(sec: i64, nsec: i64) -> Timestamp {
    Timestamp { sec, nsec: nsec as u32 }
}

pub struct LocalBackend {
    dir: BackingDir,
    objects: Arc<ObjectTable>,
    capabilities: Capabilities,
    metrics: Arc<Metrics>,
    /// Files made on a user's behalf are given to that user (the daemon makes them as root).
    is_root_daemon: bool,
    /// Files made ahead (`Namespace::prepare_files`); None where they would hold blocks no
    /// data goes to (the null store's).
    prepared: Option<Arc<PreparedFiles>>,
    /// The backing file system allocates nothing on request: set by the first file that finds
    /// it so (`LocalFileData::extend_for_direct`), so that no other file asks again.
    no_fallocate: Arc<AtomicBool>,
    /// Files just made, with the descriptor that made them (open for reading and writing;
    /// for a file made ahead, the one of its O_TMPFILE), for the open that follows: a create's,
    /// or a checkpoint's flush of a file it made. Taking
    /// it spares opening the file again through /proc/self/fd (5.5 us here, once per file tar
    /// extracts). Bounded: a file made and not opened at once (mknod, an empty file) only
    /// holds its descriptor until newer ones push it out. (Boxed: the daemon holds one backend
    /// of any kind in an enum, and this one should not make it larger.)
    made_files: Box<Mutex<lru::LruCache<ObjectId, (BackingKey, File)>>>,
}

/// How many descriptors of files just made `LocalBackend::made_files` keeps: an open follows
/// its make at once, so a few are enough for every request thread.
const MADE_FILES_KEPT: usize = 64;

impl LocalBackend {
    /// The backing directory at `root_path` (canonical), keeping at most `fd_budget`
    /// descriptors for cached objects; `unit_bytes` overrides the unit the device suggests.
    pub fn open(
        root_path: &Path,
        fd_budget: usize,
        unit_bytes: Option<u64>,
        metrics: Arc<Metrics>,
    ) -> SysResult<LocalBackend> {
        let dir = BackingDir::at(root_path, fd_budget, metrics.clone())?;
        let root = dir.root_node()?;
        let root_stat = dir.stat(&root)?;
        let geometry = geometry::discover(root_path, unit_bytes);
        let capabilities = Capabilities {
            unit_bytes: geometry.unit_bytes,
            unit_source: geometry.unit_source,
            logical_block_bytes: geometry.logical_block_bytes,
            partial_writes: true,
            syncs_cost_requests: false,
            durable_writes: false,
            atomic_unit_writes: false,
            copy_ranges: true,
            allocate: true,
            keys_can_go_stale: true,
            sync_orders_names: true,
            keeps_chosen_ids: true,
            keeps_replay_watermark: false,
            preferred_flushers: None,
        };
        Ok(LocalBackend {
            dir,
            objects: Arc::new(ObjectTable::new(root, key_of(&root_stat))),
            capabilities,
            metrics,
            // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
            is_root_daemon: unsafe { libc::geteuid() } == 0,
            prepared: Some(Arc::default()),
            no_fallocate: Arc::new(AtomicBool::new(false)),
            made_files: Box::new(Mutex::new(lru::LruCache::new(NonZeroUsize::new(MADE_FILES_KEPT).expect("not zero")))),
        })
    }

    /// No files made ahead: the data goes elsewhere (`backend=null`), and their allocated blocks
    /// would only take space.
    pub fn without_prepared_files(mut self) -> LocalBackend {
        self.prepared = None;
        self
    }

    /// Keeps the list of files made ahead at `path` (in the state directory), first giving back
    /// what the files the last daemon named from it hold past their ends (see `prepared`).
    /// Returns how many had blocks given back. Without it, files made ahead are in no list.
    pub fn keep_made_ahead_list(&self, path: &Path) -> SysResult<usize> {
        let Some(prepared) = &self.prepared else { return Ok(0) };
        let trimmed = prepared.keep_list(&self.dir, path)?;
        self.metrics.files_made_ahead_trimmed.fetch_add(trimmed as u64, Relaxed);
        Ok(trimmed)
    }

    /// How many files made ahead are ready.
    pub fn prepared_files_ready(&self) -> usize {
        self.prepared.as_ref().map_or(0, |p| p.ready())
    }

    pub fn root_path(&self) -> &Path {
        self.dir.root_path()
    }

    fn node(&self, id: ObjectId) -> SysResult<Arc<objects::Object>> {
        // An id the kernel uses but we forgot would be a protocol bug; ESTALE is what a network
        // file system answers for a handle it no longer knows.
        self.objects.get(id).ok_or(Errno(libc::ESTALE))
    }

    fn attr_of(&self, id: ObjectId, st: &libc::stat) -> Attr {
        Attr {
            id,
            kind: Kind::of_mode(st.st_mode),
            perm: st.st_mode & 0o7777,
            nlink: st.st_nlink as u32,
            uid: st.st_uid,
            gid: st.st_gid,
            rdev: st.st_rdev,
            size: st.st_size as u64,
            blocks: st.st_blocks as u64,
            blksize: st.st_blksize as u32,
            atime: timestamp(st.st_atime, st.st_atime_nsec),
            mtime: timestamp(st.st_mtime, st.st_mtime_nsec),
            ctime: timestamp(st.st_ctime, st.st_ctime_nsec),
        }
    }

    /// The attributes of `object`, whose stat is `st`, with the blocks it uses: a file made
    /// ahead holds blocks for what it may be written until the next checkpoint gives the rest
    /// back (`prepared`), and `du` must count what was written.
    fn attr_in_use(&self, object: &objects::Object, st: &libc::stat) -> Attr {
        let mut attr = self.attr_of(object.id, st);
        if let Some(prepared) = &self.prepared {
            let unused = prepared.unused_reservation(
                object,
                st,
                || self.dir.file_handle(&object.node),
                || self.dir.open(&object.node, libc::O_RDONLY),
            );
            attr.blocks -= unused / 512;
        }
        attr
    }

    /// Records one lookup of a node just opened, and answers with its attributes.
    fn remember(&self, node: Node, st: &libc::stat) -> Attr {
        let object = self.objects.remember(node, key_of(st));
        self.attr_in_use(&object, st)
    }

    fn keep_made_file(&self, id: ObjectId, key: BackingKey, file: Option<File>) {
        let Some(file) = file else { return };
        // The one pushed out is closed after the lock.
        let _pushed_out = lock(&self.made_files).push(id, (key, file));
    }

    /// The descriptor that made `object`, for an open for writing: the same inode (an id the
    /// engine chose may have been given to another object since, so the key is compared),
    /// and as `open` would have opened it (O_RDWR, O_NOATIME where asked and allowed).
    fn take_made_file(&self, object: &objects::Object, mode: OpenMode) -> Option<File> {
        if !mode.write {
            return None;
        }
        let (key, file) = lock(&self.made_files).pop(&object.id)?;
        if key != object.key {
            return None;
        }
        if mode.no_atime {
            // O_NOATIME is only for the file's owner (or CAP_FOWNER): as `BackingDir::open`, a
            // daemon without it reads with atime updates rather than not at all.
            // SAFETY: `fcntl(F_GETFL/F_SETFL)` takes only integers and touches none of our memory.
            let _ = check(unsafe {
                libc::fcntl(
                    file.as_raw_fd(),
                    libc::F_SETFL,
                    libc::fcntl(file.as_raw_fd(), libc::F_GETFL) | libc::O_NOATIME,
                )
            });
        }
        self.metrics.backend_opens_of_made_files.fetch_add(1, Relaxed);
        Some(file)
    }

    /// Gives a just-made object to the user who made it. The daemon makes it as itself (root),
    /// so without this every file would belong to root. A set-group-ID parent keeps its group,
    /// as the kernel would have done.
    /// `made`: the object's stat as it was made (the lookup that made its node took it).
    fn give_to(&self, parent: &Node, node: &Node, made: libc::stat, owner: Owner) -> SysResult<libc::stat> {
        if !self.is_root_daemon {
            return Ok(made);
        }
        let parent_stat = self.dir.stat(parent)?;
        let gid = if parent_stat.st_mode & libc::S_ISGID != 0 { parent_stat.st_gid } else { owner.gid };
        if made.st_uid == owner.uid && made.st_gid == gid {
            return Ok(made);
        }
        self.dir.chown(node, Some(owner.uid), Some(gid))?;
        let owned = self.dir.stat(node)?;
        // chown clears set-user-ID and set-group-ID bits; the maker asked for them.
        if owned.st_mode != made.st_mode && made.st_mode & libc::S_IFMT != libc::S_IFLNK {
            self.dir.chmod(node, made.st_mode & 0o7777)?;
            return self.dir.stat(node);
        }
        Ok(owned)
    }
}

/// See `Object::capability_absent`.
const CAPABILITY_XATTR: &str = "security.capability";

fn xattr_name(name: &OsStr) -> SysResult<CString> {
    CString::new(name.as_bytes()).map_err(|_| Errno(libc::EINVAL))
}

fn kind_of_dirent(d_type: u8) -> Option<Kind> {
    Some(match d_type {
        libc::DT_DIR => Kind::Directory,
        libc::DT_LNK => Kind::Symlink,
        libc::DT_FIFO => Kind::Fifo,
        libc::DT_SOCK => Kind::Socket,
        libc::DT_CHR => Kind::CharDevice,
        libc::DT_BLK => Kind::BlockDevice,
        libc::DT_REG => Kind::File,
        _ => return None,
    })
}

/// A directory of the backing directory, read a batch at a time at its own offsets.
struct LocalDirReader {
    stream: DirStream,
    dev: u64,
    /// For the ids entries are listed with.
    objects: Arc<ObjectTable>,
}

impl DirReader for LocalDirReader {
    fn read(&mut self, offset: u64, max: usize) -> SysResult<Vec<DirEntry>> {
        let table = &self.objects;
        Ok(self
            .stream
            .read(offset, max)?
            .into_iter()
            .map(|e| DirEntry {
                id: table.id_for_listing((self.dev, e.backing_ino)),
                kind: kind_of_dirent(e.kind),
                next_offset: e.next_offset,
                name: e.name,
            })
            .collect())
    }
}

impl Namespace for LocalBackend {
    fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr> {
        let name = name_cstring(name)?;
        let parent = self.node(parent)?;
        let (node, st) = self.dir.lookup(&parent.node, &name)?;
        Ok(self.remember(node, &st))
    }

    fn forget(&self, id: ObjectId, lookups: u64) {
        self.objects.forget(id, lookups);
    }

    fn hold(&self, id: ObjectId) -> SysResult<()> {
        if self.objects.hold(id) {
            Ok(())
        } else {
            Err(Errno(libc::ESTALE))
        }
    }

    fn getattr(&self, id: ObjectId) -> SysResult<Attr> {
        let object = self.node(id)?;
        Ok(self.attr_in_use(&object, &self.dir.stat(&object.node)?))
    }

    fn setattr(&self, id: ObjectId, changes: &SetAttr) -> SysResult<()> {
        let object = self.node(id)?;
        // Not across a trim of blocks made ahead, which puts the mtime it found back.
        let guard = self.prepared.as_ref().and_then(|p| p.guard_of(object.key));
        let _not_trimmed = guard.as_ref().map(|g| g.read().unwrap());
        if changes.uid.is_some() || changes.gid.is_some() {
            self.dir.chown(&object.node, changes.uid, changes.gid)?;
        }
        if let Some(mode) = changes.mode {
            self.dir.chmod(&object.node, mode & 0o7777)?;
        }
        if !changes.times.is_empty() {
            self.dir.set_times(&object.node, changes.times)?;
        }
        Ok(())
    }

    fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, owner: Owner) -> SysResult<Attr> {
        let name = name_cstring(name)?;
        let parent = self.node(parent)?;
        let mut made_file = None;
        let (node, made) = match what {
            NewObject::File { perm } => {
                let (node, made, file) = self.dir.make_file(&parent.node, &name, perm & 0o7777)?;
                made_file = file;
                (node, made)
            }
            NewObject::Directory { perm } => self.dir.mkdir(&parent.node, &name, perm & 0o7777)?,
            NewObject::Node { mode, rdev } => self.dir.mknod(&parent.node, &name, mode, rdev)?,
            NewObject::Symlink { target } => {
                let target = CString::new(target).map_err(|_| Errno(libc::EINVAL))?;
                self.dir.symlink(&parent.node, &name, &target)?
            }
        };
        let st = self.give_to(&parent.node, &node, made, owner)?;
        let object = self.objects.remember(node, key_of(&st));
        object.capability_absent.store(true, Relaxed);
        self.keep_made_file(object.id, object.key, made_file);
        Ok(self.attr_of(object.id, &st))
    }

    fn make_with_id(&self, id: ObjectId, parent: ObjectId, name: &OsStr, perm: u32, owner: Owner) -> SysResult<Attr> {
        let name = name_cstring(name)?;
        let parent = self.node(parent)?;
        let (node, made, made_file) = self.dir.make_file(&parent.node, &name, perm & 0o7777)?;
        let st = self.give_to(&parent.node, &node, made, owner)?;
        let object = self.objects.remember_as(node, key_of(&st), id);
        object.capability_absent.store(true, Relaxed);
        self.keep_made_file(object.id, object.key, made_file);
        Ok(self.attr_of(object.id, &st))
    }

    fn make_with_id_prepared(
        &self,
        id: ObjectId,
        parent: ObjectId,
        name: &OsStr,
        perm: u32,
        owner: Owner,
    ) -> SysResult<Attr> {
        let Some(prepared) = self.prepared.as_ref().filter(|p| p.ready() > 0) else {
            return self.make_with_id(id, parent, name, perm, owner);
        };
        let c_name = name_cstring(name)?;
        let parent_object = self.node(parent)?;
        // A directory with a default ACL gives its new files an ACL and a mode of its own: a
        // file made ahead in the root would have neither.
        let default_acl = self.dir.get_xattr(&parent_object.node, c"system.posix_acl_default", 0).is_ok();
        let Some((unnamed, left)) = (!default_acl).then(|| prepared.take()).flatten() else {
            return self.make_with_id(id, parent, name, perm, owner);
        };
        self.metrics.files_made_ahead_ready.store(left as u64, Relaxed);
        // SAFETY: `fchmod` takes only integers (a descriptor and plain values) and touches none of
        // our memory; a bad descriptor is an error return.
        check(unsafe { libc::fchmod(unnamed.file.as_raw_fd(), (perm & 0o7777) as libc::mode_t) })?;
        let (node, made) = self.dir.name_unnamed(&unnamed.file, &parent_object.node, &c_name)?;
        let st = self.give_to(&parent_object.node, &node, made, owner)?;
        let object = self.objects.remember_as(node, key_of(&st), id);
        object.capability_absent.store(true, Relaxed);
        // Its first flush opens it for writing: with the descriptor it was made with (O_RDWR),
        // not again through /proc. The reservation's trim guard goes by the inode, not by the
        // descriptor a writer holds.
        let file = unnamed.file.try_clone().ok();
        if unnamed.allocated > 0 {
            prepared.note_named(object.clone(), unnamed);
        }
        self.keep_made_file(object.id, object.key, file);
        self.metrics.files_made_ahead_named.fetch_add(1, Relaxed);
        Ok(self.attr_in_use(&object, &st))
    }

    fn prepare_files(&self, count: usize, bytes: u64) -> SysResult<usize> {
        let Some(prepared) = &self.prepared else { return Ok(0) };
        let trimmed = prepared.trim(&self.dir);
        self.metrics.files_made_ahead_trimmed.fetch_add(trimmed as u64, Relaxed);
        let ready = prepared.refill(&self.dir, count, bytes)?;
        self.metrics.files_made_ahead_ready.store(ready as u64, Relaxed);
        log::debug!("files made ahead: {trimmed} trimmed, {ready} ready");
        Ok(ready)
    }

    fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        let new_name = name_cstring(new_name)?;
        let object = self.node(id)?;
        let new_parent = self.node(new_parent)?;
        let (node, st) = self.dir.link(&object.node, &new_parent.node, &new_name)?;
        Ok(self.remember(node, &st))
    }

    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()> {
        let name = name_cstring(name)?;
        let parent = self.node(parent)?;
        if directory {
            self.dir.rmdir(&parent.node, &name)
        } else {
            self.dir.unlink(&parent.node, &name)
        }
    }

    fn rename(
        &self,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        flags: u32,
    ) -> SysResult<()> {
        let (name, new_name) = (name_cstring(name)?, name_cstring(new_name)?);
        let (parent, new_parent) = (self.node(parent)?, self.node(new_parent)?);
        self.dir.rename(&parent.node, &name, &new_parent.node, &new_name, flags)
    }

    fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        self.dir.readlink(&self.node(id)?.node)
    }

    fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()> {
        let object = self.node(id)?;
        if name == CAPABILITY_XATTR {
            object.capability_absent.store(false, Relaxed);
        }
        self.dir.set_xattr(&object.node, &xattr_name(name)?, value, flags)
    }

    fn get_xattr(&self, id: ObjectId, name: &OsStr, size: usize) -> SysResult<XattrReply> {
        let object = self.node(id)?;
        let capability = name == CAPABILITY_XATTR;
        if capability && object.capability_absent.load(Relaxed) {
            return Err(Errno(libc::ENODATA));
        }
        let result = self.dir.get_xattr(&object.node, &xattr_name(name)?, size);
        if capability && result.as_ref().err() == Some(&Errno(libc::ENODATA)) {
            object.capability_absent.store(true, Relaxed);
        }
        result
    }

    fn list_xattr(&self, id: ObjectId, size: usize) -> SysResult<XattrReply> {
        self.dir.list_xattr(&self.node(id)?.node, size)
    }

    fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()> {
        let object = self.node(id)?;
        self.dir.remove_xattr(&object.node, &xattr_name(name)?)?;
        if name == CAPABILITY_XATTR {
            object.capability_absent.store(true, Relaxed);
        }
        Ok(())
    }

    fn statfs(&self, id: ObjectId) -> SysResult<StatFs> {
        let st = self.dir.statfs(&self.node(id)?.node)?;
        Ok(StatFs {
            blocks: st.f_blocks,
            blocks_free: st.f_bfree,
            blocks_available: st.f_bavail,
            files: st.f_files,
            files_free: st.f_ffree,
            block_size: st.f_bsize as u32,
            name_max: st.f_namemax as u32,
            fragment_size: st.f_frsize as u32,
        })
    }

    fn open_dir(&self, id: ObjectId) -> SysResult<Box<dyn DirReader>> {
        let object = self.node(id)?;
        let stream = self.dir.open_dir_stream(&object.node)?;
        Ok(Box::new(LocalDirReader { stream, dev: object.key.0, objects: self.objects.clone() }))
    }

    fn sync_dir(&self, id: ObjectId) -> SysResult<()> {
        let file = self.dir.open_dir_for_sync(&self.node(id)?.node)?;
        LocalFileData::new(file, 1, self.metrics.clone(), self.no_fallocate.clone()).sync(false)
    }

    fn log_key(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        let object = self.node(id)?;
        if let Some(key) = object.log_key.get() {
            return Ok(key.clone());
        }
        let key = self.dir.file_handle(&object.node)?;
        Ok(object.log_key.get_or_init(|| key).clone())
    }

    fn identify(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<(Vec<u8>, ObjectId)>> {
        // Asked before every unlink and rename with the log on: no descriptor opened for it.
        let parent = self.node(parent)?;
        match self.dir.identity_at(&parent.node, &name_cstring(name)?) {
            Ok((st, key)) => Ok(Some((key, self.objects.id_for_listing(key_of(&st))))),
            Err(Errno(libc::ENOENT)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn describe(&self, id: ObjectId) -> Option<String> {
        let object = self.objects.get(id)?;
        self.dir.path_of(&object.node).map(|p| p.display().to_string())
    }

    fn find(&self, key: &[u8]) -> SysResult<Option<ObjectId>> {
        match self.dir.node_by_handle(key) {
            Ok((node, st)) => Ok(Some(self.remember(node, &st).id)),
            Err(e) if matches!(e.0, libc::ENOENT | libc::ESTALE) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn key_at(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<Vec<u8>>> {
        let parent = self.node(parent)?;
        let name: CString = name_cstring(name)?;
        match self.dir.handle_at(&parent.node, &name) {
            Ok(key) => Ok(Some(key)),
            Err(Errno(libc::ENOENT)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl UnitStore for LocalBackend {
    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn open(&self, id: ObjectId, mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        let object = self.node(id)?;
        let flags =
            if mode.write { libc::O_RDWR } else { libc::O_RDONLY } | if mode.no_atime { libc::O_NOATIME } else { 0 };
        let file = match self.take_made_file(&object, mode) {
            Some(file) => file,
            None => self.dir.open(&object.node, flags)?,
        };
        let mut data = LocalFileData::new(
            file,
            self.capabilities.logical_block_bytes,
            self.metrics.clone(),
            self.no_fallocate.clone(),
        );
        if mode.write {
            data.not_trimmed_while_written(self.prepared.as_ref().and_then(|p| p.guard_of(object.key)));
            data.gives_way_to_files_made_ahead(self.prepared.clone());
        }
        Ok(Arc::new(data))
    }

    fn sync_all(&self) -> SysResult<()> {
        self.dir.sync_file_system()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::types::ROOT_ID;
    use std::os::unix::fs::{FileExt, PermissionsExt};
    use std::sync::mpsc;
    use std::time::Duration;

    /// A backend over `dir` with one file made ahead ready; None (the test skips, saying why)
    /// where the file system makes no unnamed files or has no room.
    fn backend_with_one_made_ahead(dir: &tempfile::TempDir) -> Option<LocalBackend> {
        let backend = LocalBackend::open(dir.path(), 64, None, Arc::new(Metrics::default())).unwrap();
        if backend.prepare_files(1, 1 << 20).unwrap() == 0 {
            eprintln!("skipped: no O_TMPFILE or no room on the file system under {}", dir.path().display());
            return None;
        }
        Some(backend)
    }

    fn process_owner() -> Owner {
        // SAFETY: `geteuid` and `getegid` take no arguments, cannot fail and touch none of our memory.
        Owner { uid: unsafe { libc::geteuid() }, gid: unsafe { libc::getegid() } }
    }

    /// A write to a file made ahead holds off the checkpoint's trim, which truncates the file to
    /// the size it finds: one that ran across the write would cut off what it added.
    #[test]
    fn a_write_to_a_file_made_ahead_holds_off_its_trim() {
        let dir = tempfile::tempdir().unwrap();
        let Some(backend) = backend_with_one_made_ahead(&dir) else { return };
        let backend = Arc::new(backend);
        let id = 1 << 62;
        let owner = process_owner();
        backend.make_with_id_prepared(id, ROOT_ID, OsStr::new("f"), 0o644, owner).unwrap();
        assert_eq!(backend.prepared_files_ready(), 0, "the one made ahead was taken");
        let data = backend.open(id, OpenMode { write: true, no_atime: false }).unwrap();
        let data = data.as_any().downcast_ref::<LocalFileData>().unwrap();
        let writing = data.not_trimmed().expect("a file made ahead is written under its trim guard");

        let (done_tx, done_rx) = mpsc::channel();
        let trimmer = backend.clone();
        let trim = std::thread::spawn(move || {
            trimmer.prepare_files(0, 1 << 20).unwrap();
            done_tx.send(()).unwrap();
        });
        assert!(done_rx.recv_timeout(Duration::from_millis(200)).is_err(), "the trim waits for the write");
        data.file().write_all_at(&[7u8; 200 << 10], 0).unwrap();
        drop(writing);
        done_rx.recv_timeout(Duration::from_secs(10)).expect("the trim ran after the write");
        trim.join().unwrap();
        let st = std::fs::metadata(dir.path().join("f")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(st.len(), 200 << 10, "the write's bytes are all there");
        assert_eq!(st.blocks() * 512, 200 << 10, "and nothing past them");
        let reopened = backend.open(id, OpenMode { write: true, no_atime: false }).unwrap();
        let reopened = reopened.as_any().downcast_ref::<LocalFileData>().unwrap();
        assert!(reopened.not_trimmed().is_none(), "trimmed, it needs no guard for later writes");
    }

    /// The blocks a file made ahead uses, asked again and again (`ls -l`, a `stat` loop) while
    /// nothing changes it, walk its holes once; a write into a hole is seen at the next ask.
    #[test]
    fn the_blocks_a_file_made_ahead_uses_are_walked_once_until_it_changes() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let Some(backend) = backend_with_one_made_ahead(&dir) else { return };
        let owner = process_owner();
        let id = 1 << 62;
        backend.make_with_id_prepared(id, ROOT_ID, OsStr::new("f"), 0o644, owner).unwrap();
        let data = backend.open(id, OpenMode { write: true, no_atime: false }).unwrap();
        let file = data.as_any().downcast_ref::<LocalFileData>().unwrap().file();
        file.write_all_at(&[1u8; 8192], 0).unwrap();
        file.write_all_at(&[2u8; 8192], 256 << 10).unwrap();
        let prepared = backend.prepared.as_ref().unwrap();
        let walks = prepared.hole_walks();
        let first = backend.getattr(id).unwrap().blocks;
        for _ in 0..50 {
            assert_eq!(backend.getattr(id).unwrap().blocks, first);
        }
        assert_eq!(prepared.hole_walks(), walks + 1, "50 more asks of an unchanged file walked its holes again");
        assert_eq!(first * 512, 16384, "the blocks the two writes use");
        file.write_all_at(&[3u8; 65536], 64 << 10).unwrap();
        let after = backend.getattr(id).unwrap().blocks;
        assert_eq!(after * 512, 16384 + 65536, "a write into a hole is counted at the next ask");
        assert_eq!(prepared.hole_walks(), walks + 2);
        let native = std::fs::metadata(dir.path().join("f")).unwrap();
        assert!(native.blocks() >= after, "the backing file holds at least what it uses");
    }

    /// A file named from one made ahead keeps its entry until the next trim; removed before
    /// it, its inode number is the backing file system's to give again. What takes it (here a
    /// directory) shows its own blocks, none of them taken for the old file's reservation.
    #[test]
    fn an_inode_number_given_again_is_not_counted_as_the_reservation_of_a_file_removed() {
        use crate::engine::types::NewObject;
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let Some(backend) = backend_with_one_made_ahead(&dir) else { return };
        let owner = process_owner();
        backend.make_with_id_prepared(1 << 62, ROOT_ID, OsStr::new("f"), 0o644, owner).unwrap();
        let removed_ino = std::fs::metadata(dir.path().join("f")).unwrap().ino();
        backend.remove(ROOT_ID, OsStr::new("f"), false).unwrap();
        backend.forget(1 << 62, 1); // the kernel's: the node's descriptor goes, and the inode
        for n in 0..64 {
            let name = format!("d{n}");
            let attr = backend.make(ROOT_ID, OsStr::new(&name), NewObject::Directory { perm: 0o755 }, owner).unwrap();
            let native = std::fs::metadata(dir.path().join(&name)).unwrap();
            if native.ino() == removed_ino {
                assert_eq!(attr.blocks, native.blocks(), "made: the directory's own blocks");
                let again = backend.getattr(attr.id).unwrap();
                assert_eq!(again.blocks, native.blocks(), "getattr: the directory's own blocks");
                return;
            }
        }
        eprintln!(
            "skipped: the file system under {} gave the inode number to none of 64 directories",
            dir.path().display()
        );
    }

    /// A daemon that stops before the checkpoint that trims a file it named from one made ahead
    /// leaves that file's blocks past its end allocated; the next backend on the same list gives
    /// them back, and leaves alone what the list does not name. A slot of the list whose
    /// checksum fails is not trusted; the other is read.
    #[test]
    fn the_next_backend_gives_back_what_files_made_ahead_hold_past_their_ends() {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: opening files by handle needs CAP_DAC_READ_SEARCH (root)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let state = tempfile::tempdir().unwrap();
        let list = state.path().join("made-ahead");
        let open = || LocalBackend::open(dir.path(), 64, None, Arc::new(Metrics::default())).unwrap();
        let owner = Owner { uid: 0, gid: 0 };
        let backend = open();
        assert_eq!(backend.keep_made_ahead_list(&list).unwrap(), 0, "a new list names nothing");
        if backend.prepare_files(3, 1 << 20).unwrap() == 0 {
            eprintln!("skipped: no O_TMPFILE or no room on the file system under {}", dir.path().display());
            return;
        }
        let named = |backend: &LocalBackend, id: u64, name: &str| {
            backend.make_with_id_prepared(id, ROOT_ID, OsStr::new(name), 0o644, owner).unwrap();
            let data = backend.open(id, OpenMode { write: true, no_atime: false }).unwrap();
            let data = data.as_any().downcast_ref::<LocalFileData>().unwrap();
            data.file().write_all_at(&[7u8; 100 << 10], 0).unwrap();
        };
        named(&backend, 1 << 62, "f");
        // Allocated past its end by someone else: not the backend's to give back.
        let other = std::fs::File::create(dir.path().join("other")).unwrap();
        // SAFETY: `fallocate` takes only integers (a descriptor and plain values) and touches none
        // of our memory; a bad descriptor is an error return.
        assert_eq!(unsafe { libc::fallocate(other.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, 1 << 20) }, 0);
        let f = dir.path().join("f");
        let before = std::fs::metadata(&f).unwrap();
        assert!(before.blocks() * 512 >= 1 << 20, "named with its blocks made ahead: {} sectors", before.blocks());
        drop(backend); // a daemon gone without its checkpoint: the two unnamed ones go with it

        let next = open();
        assert_eq!(next.keep_made_ahead_list(&list).unwrap(), 1, "the named one, not the two never named");
        let after = std::fs::metadata(&f).unwrap();
        assert_eq!((after.len(), after.blocks() * 512), (100 << 10, 100 << 10), "nothing past its end");
        assert_eq!((after.mtime(), after.mtime_nsec()), (before.mtime(), before.mtime_nsec()), "its mtime kept");
        assert!(std::fs::read(&f).unwrap().iter().all(|&b| b == 7));
        assert!(std::fs::metadata(dir.path().join("other")).unwrap().blocks() * 512 >= 1 << 20, "not listed");

        // The next one's file, listed in the other slot; then slots torn as a crash in a
        // write would tear them (a checksum broken).
        assert!(next.prepare_files(1, 1 << 20).unwrap() == 1);
        named(&next, 1 << 61, "g");
        drop(next);
        let whole = std::fs::read(&list).unwrap();
        let g_blocks = || std::fs::metadata(dir.path().join("g")).unwrap().blocks() * 512;
        let mut both_torn = whole.clone();
        both_torn[20] ^= 1;
        both_torn[(64 << 10) + 20] ^= 1;
        std::fs::write(&list, both_torn).unwrap();
        assert_eq!(open().keep_made_ahead_list(&list).unwrap(), 0, "no whole slot: nothing is trusted");
        assert!(g_blocks() >= 1 << 20);
        let mut older_torn = whole;
        older_torn[20] ^= 1; // the slot the next write would have used
        std::fs::write(&list, older_torn).unwrap();
        assert_eq!(open().keep_made_ahead_list(&list).unwrap(), 1, "the whole slot is read");
        assert_eq!(g_blocks(), 100 << 10);
    }

    /// A list that cannot be written (here /dev/full: every write ENOSPC) hands out no file
    /// made ahead: one named and then lost to a crash would be in no list. The refill fails,
    /// and the files it made go with their descriptors.
    #[test]
    fn files_made_ahead_are_not_handed_out_unlisted() {
        if !Path::new("/dev/full").exists() {
            eprintln!("skipped: no /dev/full");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let backend = LocalBackend::open(dir.path(), 64, None, Arc::new(Metrics::default())).unwrap();
        assert_eq!(backend.keep_made_ahead_list(Path::new("/dev/full")).unwrap(), 0, "zeros are no list");
        match backend.prepare_files(2, 1 << 20) {
            Err(Errno(libc::ENOSPC)) => {}
            other => panic!("a refill whose list cannot be written: {other:?}"),
        }
        assert_eq!(backend.prepared_files_ready(), 0);
        // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
        let owner = Owner { uid: unsafe { libc::geteuid() }, gid: unsafe { libc::getegid() } };
        backend.make_with_id_prepared(1 << 62, ROOT_ID, OsStr::new("f"), 0o644, owner).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(dir.path().join("f")).unwrap().blocks(), 0, "made by mknod, nothing ahead");
    }

    /// A new file's first open for writing takes the descriptor that made it (no reopen through
    /// /proc/self/fd), and it is that file: what is written through it is in the backing
    /// file. A read-only open, a second open, and a file pushed out of the few kept open
    /// by newer ones all open the file again, as before.
    #[test]
    fn a_new_files_first_open_for_writing_takes_the_descriptor_that_made_it() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::default());
        let backend = LocalBackend::open(dir.path(), 64, None, metrics.clone()).unwrap();
        let taken = || metrics.backend_opens_of_made_files.load(Relaxed);
        let owner = process_owner();
        let (write, read) = (OpenMode { write: true, no_atime: true }, OpenMode { write: false, no_atime: false });

        let f = backend.make(ROOT_ID, OsStr::new("f"), NewObject::File { perm: 0o640 }, owner).unwrap();
        assert_eq!(std::fs::metadata(dir.path().join("f")).unwrap().permissions().mode() & 0o7777, 0o640);
        backend.open(f.id, read).unwrap();
        assert_eq!(taken(), 0, "a read-only open leaves it");
        let data = backend.open(f.id, write).unwrap();
        assert_eq!(taken(), 1, "the first open for writing takes it");
        data.set_size(4096).unwrap();
        assert_eq!(std::fs::metadata(dir.path().join("f")).unwrap().len(), 4096, "the descriptor is the file's");
        backend.open(f.id, write).unwrap();
        assert_eq!(taken(), 1, "taken once");

        let id = 1 << 62;
        backend.make_with_id(id, ROOT_ID, OsStr::new("g"), 0o644, owner).unwrap();
        for i in 0..MADE_FILES_KEPT {
            backend.make(ROOT_ID, OsStr::new(&format!("h{i}")), NewObject::File { perm: 0o644 }, owner).unwrap();
        }
        assert_eq!(backend.made_files.lock().unwrap().len(), MADE_FILES_KEPT, "bounded");
        let data = backend.open(id, write).unwrap();
        assert_eq!(taken(), 1, "g's was pushed out by newer files: opened again");
        data.set_size(1).unwrap();
        assert_eq!(std::fs::metadata(dir.path().join("g")).unwrap().len(), 1);

        // A file made ahead (O_TMPFILE, named at need) as well.
        if backend.prepare_files(1, 1 << 20).unwrap() == 0 {
            eprintln!("the made-ahead part skipped: no O_TMPFILE or no room under {}", dir.path().display());
            return;
        }
        let ahead = (1 << 62) + 1;
        backend.make_with_id_prepared(ahead, ROOT_ID, OsStr::new("ahead"), 0o600, owner).unwrap();
        assert_eq!(backend.metrics.files_made_ahead_named.load(Relaxed), 1, "named from a file made ahead");
        let data = backend.open(ahead, write).unwrap();
        assert_eq!(taken(), 2, "its first open for writing takes the descriptor it was made with");
        data.set_size(3).unwrap();
        assert_eq!(std::fs::metadata(dir.path().join("ahead")).unwrap().len(), 3, "the descriptor is the file's");
    }

    /// chmod sets the same modes with fchmodat2 and, where the kernel lacks it (before Linux
    /// 6.6, as Debian 12's own kernel), through the /proc/self/fd path; a symbolic link has no
    /// mode to set either way.
    #[test]
    fn chmod_sets_the_mode_with_or_without_fchmodat2() {
        let dir = tempfile::tempdir().unwrap();
        let backend = LocalBackend::open(dir.path(), 64, None, Arc::new(Metrics::default())).unwrap();
        let owner = process_owner();
        let f = backend.make(ROOT_ID, OsStr::new("f"), NewObject::File { perm: 0o600 }, owner).unwrap();
        let link = backend.make(ROOT_ID, OsStr::new("l"), NewObject::Symlink { target: b"f" }, owner).unwrap();
        let mode_of = || std::fs::metadata(dir.path().join("f")).unwrap().permissions().mode() & 0o7777;
        for (before_fchmodat2, mode) in [(false, 0o640), (true, 0o751)] {
            if before_fchmodat2 {
                backend.dir.chmod_as_before_fchmodat2();
            }
            backend.setattr(f.id, &SetAttr { mode: Some(mode), ..SetAttr::default() }).unwrap();
            assert_eq!(mode_of(), mode, "before fchmodat2: {before_fchmodat2}");
            let on_link = backend.setattr(link.id, &SetAttr { mode: Some(0o700), ..SetAttr::default() });
            assert_eq!(on_link, Err(Errno(libc::EOPNOTSUPP)), "before fchmodat2: {before_fchmodat2}");
            assert_eq!(mode_of(), mode, "the link's target is left alone");
        }
    }
}
