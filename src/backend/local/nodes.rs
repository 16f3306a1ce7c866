//! The system calls of the local backend: every one that touches the backing directory.
//!
//! Names are always resolved one component at a time relative to a directory handle
//! (`openat`-style, `O_NOFOLLOW`), so a symlink inside the backing directory can never make the
//! daemon touch a path outside it.
//!
//! Descriptors are bounded. The kernel may keep a million inodes cached, and each is a `Node`
//! here; a node holds the object's persistent file handle (`name_to_handle_at`), and its
//! `O_PATH` descriptor lives in `NodeFds`, a least-recently-used cache of at most `capacity`
//! descriptors. A node whose descriptor was closed is opened again by its handle
//! (`open_by_handle_at`): the same inode, never a name resolved again, and ESTALE once the
//! object is gone. Where handles cannot be used (no CAP_DAC_READ_SEARCH, a file system without
//! them, an object on another device) the node pins its descriptor, as every node once did.
//!
//! A path under /proc/self/fd is walked through procfs on every use: calls that can name the
//! object by its descriptor (`AT_EMPTY_PATH`) do, and a regular file is made by the open that
//! creates it, whose descriptor serves the file's first open for I/O (`make_file`).

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::engine::types::{TimeToSet, TimesToSet, XattrReply};
use crate::metrics::Metrics;
use crate::sys::{self, check, check_size, Errno, SysResult, EMPTY};

/// The open `O_PATH` descriptors of nodes, the least recently used closed first beyond
/// `capacity`. A descriptor in use stays open until its user is done (`NodeFd` shares it).
pub struct NodeFds {
    open: Mutex<lru::LruCache<u64, Arc<OwnedFd>>>,
    capacity: usize,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
}

impl NodeFds {
    fn new(capacity: usize, metrics: Arc<Metrics>) -> NodeFds {
        metrics.node_fds_limit.store(capacity as u64, Ordering::Relaxed);
        NodeFds {
            open: Mutex::new(lru::LruCache::unbounded()),
            capacity: capacity.max(1),
            next_id: AtomicU64::new(1),
            metrics,
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, lru::LruCache<u64, Arc<OwnedFd>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, id: u64) -> Option<Arc<OwnedFd>> {
        self.cache().get(&id).cloned()
    }

    // Descriptors leave the cache under its lock but are closed after it: the close of a
    // deleted file's last descriptor is where the backing file system frees its inode and
    // blocks, which must not stall every other node behind the lock.

    fn insert(&self, id: u64, fd: Arc<OwnedFd>) {
        let mut evicted = Vec::new();
        let mut cache = self.cache();
        if let Some(replaced) = cache.put(id, fd) {
            evicted.push(replaced);
        }
        while cache.len() > self.capacity {
            evicted.extend(cache.pop_lru().map(|(_, fd)| fd));
        }
        self.metrics.node_fds_open.store(cache.len() as u64, Ordering::Relaxed);
        drop(cache);
        drop(evicted);
    }

    fn forget(&self, id: u64) {
        let mut cache = self.cache();
        let closing = cache.pop(&id);
        self.metrics.node_fds_open.store(cache.len() as u64, Ordering::Relaxed);
        drop(cache);
        drop(closing);
    }

    /// The process ran out of descriptors (files the applications hold open count too): half
    /// of the cached ones are closed, so that the call can be tried again.
    fn shed_half(&self) -> usize {
        let mut cache = self.cache();
        let shed = cache.len().div_ceil(2);
        let closing: Vec<_> = (0..shed).filter_map(|_| cache.pop_lru()).collect();
        self.metrics.node_fds_open.store(cache.len() as u64, Ordering::Relaxed);
        drop(cache);
        drop(closing);
        shed
    }
}

/// One object of the backing directory. It finds the object again by its file handle (so no
/// name is resolved again) through a descriptor from `NodeFds`, or holds its descriptor
/// itself (`pinned`) where there is no handle to find it by.
pub struct Node {
    /// Unique for the daemon's life: the descriptor cache's key.
    id: u64,
    /// `name_to_handle_at`, encoded as the handle type (4 bytes, little-endian) and its bytes.
    handle: Option<Box<[u8]>>,
    pinned: Option<OwnedFd>,
    fds: Arc<NodeFds>,
    /// An inode's type never changes: known from the stat that made the node, so that calls
    /// that treat symbolic links apart (chmod, times, xattrs) need no stat of their own.
    is_symlink: bool,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node({}, {})", self.id, if self.pinned.is_some() { "pinned" } else { "by handle" })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.pinned.is_none() {
            self.fds.forget(self.id);
        }
    }
}

impl Node {
    /// The object's persistent file handle, where it has one.
    pub fn handle(&self) -> Option<&[u8]> {
        self.handle.as_deref()
    }

    /// Whether two nodes stand for the same object. Only handles can tell: an inode number
    /// freed by a deleted file is given to the next new one, while the kernel may still hold
    /// the old object under that number. A node that pins its descriptor keeps its inode
    /// alive, so its number cannot have been given away.
    pub fn is_same_object(&self, other: &Node) -> bool {
        match (&self.handle, &other.handle) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        }
    }
}

/// A node's open descriptor, for the length of one call.
pub enum NodeFd<'a> {
    Pinned(&'a OwnedFd),
    Cached(Arc<OwnedFd>),
}

impl AsRawFd for NodeFd<'_> {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            NodeFd::Pinned(fd) => fd.as_raw_fd(),
            NodeFd::Cached(fd) => fd.as_raw_fd(),
        }
    }
}

/// One directory entry as the backing file system reports it, with the position after it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub name: OsString,
    pub backing_ino: u64,
    pub kind: u8, // DT_* from getdents
    /// Where reading continues after this entry: the backing file system's own cookie
    /// (`d_off`), valid for `seekdir` on this directory for as long as the entry exists.
    pub next_offset: u64,
}

/// An open directory, read a bounded number of entries at a time from any offset it gave
/// out. Nothing is copied whole: a directory of a million entries costs one descriptor and a
/// batch of entries.
pub struct DirStream {
    dir: std::ptr::NonNull<libc::DIR>,
    /// Entries read but not yet taken (a reply holds fewer than a batch), the first of them at
    /// offset `buffered_from`: the next request, from where the last reply ended, starts there.
    buffered: std::collections::VecDeque<DirEntry>,
    buffered_from: u64,
    /// The offset the next `readdir64` continues from; None: unknown, seek first.
    position: Option<u64>,
}

// The stream is owned by one open directory handle and used under its lock.
// SAFETY: `DIR` is a heap object of libc's with no thread affinity; the stream owns its pointer
// alone (closed once, in Drop) and is used by one thread at a time, under its directory handle's
// lock.
unsafe impl Send for DirStream {}

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: `dir` came from a successful fdopendir, is owned by this stream alone, and is
        // closed once, here.
        unsafe { libc::closedir(self.dir.as_ptr()) };
    }
}

impl DirStream {
    /// Up to `max` entries from `offset` (0: the start; else an entry's `next_offset`), "."
    /// and ".." included. Fewer than `max` means the end of the directory.
    pub fn read(&mut self, offset: u64, max: usize) -> SysResult<Vec<DirEntry>> {
        assert!(max > 0, "a read of no entries would look like the end of the directory");
        // Entries a reply took before `offset` are dropped; any other offset starts afresh.
        let taken = if self.buffered_from == offset {
            Some(0)
        } else {
            self.buffered.iter().position(|e| e.next_offset == offset).map(|i| i + 1)
        };
        match taken {
            Some(n) => {
                self.buffered.drain(..n);
                self.buffered_from = offset;
            }
            None => {
                self.buffered.clear();
                self.buffered_from = offset;
            }
        }
        // With nothing buffered the directory must continue exactly at `offset`.
        if self.buffered.is_empty() && self.position != Some(offset) {
            // SAFETY: `dir` is this stream's open `DIR`, used by one thread at a time (`&mut
            // self`); seekdir takes an offset telldir or d_off gave.
            unsafe { libc::seekdir(self.dir.as_ptr(), offset as libc::c_long) };
            self.position = Some(offset);
        }
        while self.buffered.len() < max {
            // SAFETY: `__errno_location` returns this thread's errno, always a valid `int` to
            // write.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: `dir` is this stream's open `DIR`, used by one thread at a time (`&mut
            // self`).
            let ent = unsafe { libc::readdir64(self.dir.as_ptr()) };
            if ent.is_null() {
                // SAFETY: `__errno_location` returns this thread's errno, always a valid `int` to
                // read.
                let err = unsafe { *libc::__errno_location() };
                if err != 0 {
                    self.buffered.clear();
                    self.position = None;
                    return Err(Errno(err));
                }
                break;
            }
            // SAFETY: readdir64 returned a non-null entry that stays valid until the next readdir64
            // or closedir on `dir`, both of which need `&mut self`, which this loop holds until the
            // entry is copied.
            let ent = unsafe { &*ent };
            // SAFETY: the kernel's `d_name` is NUL-terminated within the entry, which stays valid
            // while it is read here.
            let name = unsafe { CStr::from_ptr(ent.d_name.as_ptr()) };
            let next_offset = ent.d_off as u64;
            self.position = Some(next_offset);
            self.buffered.push_back(DirEntry {
                name: OsStr::from_bytes(name.to_bytes()).to_os_string(),
                backing_ino: ent.d_ino,
                kind: ent.d_type,
                next_offset,
            });
        }
        Ok(self.buffered.iter().cloned().collect())
    }
}

/// The most bytes of a file handle kept (MAX_HANDLE_SZ in the kernel).
const MAX_HANDLE_BYTES: usize = 128;

/// A `struct file_handle` with room for its bytes after the header, aligned as the kernel's
/// type is (a byte vector cast to it relied on the allocator's alignment).
#[repr(C)]
struct HandleBuf {
    header: libc::file_handle,
    bytes: [u8; MAX_HANDLE_BYTES],
}

// The kernel writes the handle's bytes at the header's flexible array `f_handle`, which is
// where `bytes` starts.
const _: () = assert!(std::mem::offset_of!(HandleBuf, bytes) == std::mem::size_of::<libc::file_handle>());

impl HandleBuf {
    fn new(handle_bytes: usize, handle_type: i32) -> HandleBuf {
        assert!(handle_bytes <= MAX_HANDLE_BYTES);
        let header = libc::file_handle { handle_bytes: handle_bytes as u32, handle_type, f_handle: [] };
        HandleBuf { header, bytes: [0; MAX_HANDLE_BYTES] }
    }

    /// The header, with its provenance over the whole buffer, for the kernel to read or fill.
    fn as_mut_ptr(&mut self) -> *mut libc::file_handle {
        std::ptr::from_mut::<HandleBuf>(self).cast()
    }
}

/// name_to_handle_at, encoded as the handle type (4 bytes, little-endian) and its bytes.
fn handle_of(dir: RawFd, name: &CStr, flags: i32) -> SysResult<Vec<u8>> {
    let mut handle = HandleBuf::new(MAX_HANDLE_BYTES, 0);
    let mut mount_id = 0;
    // SAFETY: `name` is NUL-terminated and outlives the call; `handle` is an aligned
    // `file_handle` followed by the `handle_bytes` bytes it announces, all the kernel writes;
    // `mount_id` is a live `int`.
    check(unsafe { libc::name_to_handle_at(dir, name.as_ptr(), handle.as_mut_ptr(), &raw mut mount_id, flags) })?;
    let len = (handle.header.handle_bytes as usize).min(MAX_HANDLE_BYTES);
    let mut key = handle.header.handle_type.to_le_bytes().to_vec();
    key.extend_from_slice(&handle.bytes[..len]);
    Ok(key)
}

/// open_by_handle_at of a handle from `handle_of`, on the file system `mount_fd` is on.
fn open_handle_at(mount_fd: &OwnedFd, key: &[u8], flags: i32) -> SysResult<OwnedFd> {
    if key.len() < 4 || key.len() - 4 > MAX_HANDLE_BYTES {
        return Err(Errno(libc::EINVAL));
    }
    let mut handle = HandleBuf::new(key.len() - 4, i32::from_le_bytes(key[..4].try_into().expect("four bytes")));
    handle.bytes[..key.len() - 4].copy_from_slice(&key[4..]);
    // SAFETY: `handle` is an aligned `file_handle` followed by the `handle_bytes` bytes it
    // announces, which the kernel only reads.
    let fd =
        check(unsafe { libc::open_by_handle_at(mount_fd.as_raw_fd(), handle.as_mut_ptr(), flags | libc::O_CLOEXEC) })?;
    // SAFETY: `fd` was just returned by a successful open_by_handle_at and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether open_by_handle_at works on this file system for this process (it needs
/// CAP_DAC_READ_SEARCH, and a file system that gives out handles).
fn handles_work(mount_fd: &OwnedFd) -> bool {
    handle_of(mount_fd.as_raw_fd(), EMPTY, libc::AT_EMPTY_PATH)
        .and_then(|handle| open_handle_at(mount_fd, &handle, libc::O_PATH))
        .is_ok()
}

/// utimensat's form of a time to set.
pub fn timespec_of(time: Option<TimeToSet>) -> libc::timespec {
    match time {
        None => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
        Some(TimeToSet::Now) => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
        Some(TimeToSet::At(t)) => libc::timespec { tv_sec: t.sec, tv_nsec: i64::from(t.nsec) },
    }
}

/// Whether `err` says the process (or the system) has no descriptor left.
fn out_of_descriptors(err: Errno) -> bool {
    matches!(err.0, libc::EMFILE | libc::ENFILE)
}

pub struct BackingDir {
    root: Node,
    root_path: std::path::PathBuf,
    /// The backing file system's device: handles are used for objects on it.
    root_dev: u64,
    /// A directory descriptor (not O_PATH) on the backing file system, for open_by_handle_at.
    mount_fd: OwnedFd,
    /// Whether nodes find their objects by handle (else every node pins its descriptor).
    by_handle: bool,
    fds: Arc<NodeFds>,
    /// The kernel has no fchmodat2 (before Linux 6.6): chmod goes through /proc/self/fd.
    no_fchmodat2: AtomicBool,
}

fn is_symlink(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFLNK
}

impl BackingDir {
    /// Opens the backing directory. The path is resolved once, here, by the kernel, as the user
    /// gave it; from then on only the handle is used. At most `fd_budget` descriptors are kept
    /// open for cached objects.
    pub fn at(root_path: &Path, fd_budget: usize, metrics: Arc<Metrics>) -> SysResult<BackingDir> {
        let path = sys::path_cstring(root_path)?;
        let fd = sys::openat(libc::AT_FDCWD, &path, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let root_dev = sys::fstat_fd(&fd)?.st_dev;
        let mount_fd = sys::openat(fd.as_raw_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let fds = Arc::new(NodeFds::new(fd_budget, metrics));
        let by_handle = handles_work(&mount_fd);
        if !by_handle {
            log::warn!(
                "file handles cannot be used on {} (the daemon needs CAP_DAC_READ_SEARCH, and the file system \
                 must support them): every object the kernel caches holds a descriptor, and past the \
                 descriptor limit the mount fails with EMFILE",
                root_path.display()
            );
        }
        let root = Node {
            id: fds.next_id.fetch_add(1, Ordering::Relaxed),
            handle: None,
            pinned: Some(fd),
            fds: fds.clone(),
            is_symlink: false,
        };
        Ok(BackingDir {
            root,
            root_path: root_path.to_path_buf(),
            root_dev,
            mount_fd,
            by_handle,
            fds,
            no_fchmodat2: AtomicBool::new(false),
        })
    }

    pub fn root_path(&self) -> &Path {
        &self.root_path
    }

    /// A second handle on the root, for the engine's inode table.
    pub fn root_node(&self) -> SysResult<Node> {
        // SAFETY: `fcntl(F_DUPFD_CLOEXEC)` takes only integers and touches none of our memory.
        let fd = check(unsafe { libc::fcntl(self.fd(&self.root)?.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
        // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor, owned by nothing else.
        Ok(self.pinned_node(unsafe { OwnedFd::from_raw_fd(fd) }, false))
    }

    fn pinned_node(&self, fd: OwnedFd, is_symlink: bool) -> Node {
        Node {
            id: self.fds.next_id.fetch_add(1, Ordering::Relaxed),
            handle: None,
            pinned: Some(fd),
            fds: self.fds.clone(),
            is_symlink,
        }
    }

    /// Makes a node of a descriptor just opened on the object (`O_PATH | O_NOFOLLOW`).
    fn adopt(&self, fd: OwnedFd, st: &libc::stat) -> Node {
        let symlink = is_symlink(st);
        if !self.by_handle || st.st_dev != self.root_dev {
            return self.pinned_node(fd, symlink);
        }
        match handle_of(fd.as_raw_fd(), EMPTY, libc::AT_EMPTY_PATH) {
            Ok(handle) => {
                let id = self.fds.next_id.fetch_add(1, Ordering::Relaxed);
                self.fds.insert(id, Arc::new(fd));
                Node {
                    id,
                    handle: Some(handle.into_boxed_slice()),
                    pinned: None,
                    fds: self.fds.clone(),
                    is_symlink: symlink,
                }
            }
            Err(_) => self.pinned_node(fd, symlink),
        }
    }

    /// Runs `call` once more after closing half of the cached descriptors, when it failed for
    /// want of one.
    fn with_descriptor<T>(&self, mut call: impl FnMut() -> SysResult<T>) -> SysResult<T> {
        match call() {
            Err(e) if out_of_descriptors(e) && self.fds.shed_half() > 0 => {
                log::debug!("out of descriptors ({e}): closed half of the cached ones");
                call()
            }
            other => other,
        }
    }

    /// The node's open descriptor: its own, a cached one, or one opened again by its handle.
    pub fn fd<'a>(&self, node: &'a Node) -> SysResult<NodeFd<'a>> {
        if let Some(fd) = &node.pinned {
            return Ok(NodeFd::Pinned(fd));
        }
        if let Some(fd) = self.fds.get(node.id) {
            return Ok(NodeFd::Cached(fd));
        }
        let handle = node.handle.as_deref().expect("a node without a pinned descriptor has a handle");
        let fd = Arc::new(self.with_descriptor(|| self.open_handle(handle, libc::O_PATH))?);
        self.fds.metrics.node_fds_reopened.fetch_add(1, Ordering::Relaxed);
        self.fds.insert(node.id, fd.clone());
        Ok(NodeFd::Cached(fd))
    }

    pub fn lookup(&self, parent: &Node, name: &CStr) -> SysResult<(Node, libc::stat)> {
        let dir = self.fd(parent)?;
        let fd = self.with_descriptor(|| sys::openat(dir.as_raw_fd(), name, libc::O_PATH | libc::O_NOFOLLOW, 0))?;
        let st = sys::fstat_fd(&fd)?;
        Ok((self.adopt(fd, &st), st))
    }

    pub fn stat(&self, node: &Node) -> SysResult<libc::stat> {
        sys::fstat_fd(&self.fd(node)?)
    }

    pub fn chmod(&self, node: &Node, mode: u32) -> SysResult<()> {
        let fd = self.fd(node)?;
        if node.is_symlink {
            // Linux has no symlink modes; chmod through a link name would follow it.
            return Err(Errno(libc::EOPNOTSUPP));
        }
        // fchmodat2 (Linux 6.6) changes the mode through the descriptor itself, where chmod of
        // its /proc/self/fd path walks procfs first (1.9 against 3.8 us here, once per file
        // tar extracts).
        if !self.no_fchmodat2.load(Ordering::Relaxed) {
            // SAFETY: `fchmodat2` reads only the NUL-terminated empty C string, which outlives the
            // call; the other arguments are integers.
            let changed = check(unsafe {
                libc::syscall(
                    libc::SYS_fchmodat2,
                    fd.as_raw_fd(),
                    EMPTY.as_ptr(),
                    mode as libc::mode_t,
                    libc::AT_EMPTY_PATH,
                ) as i32
            });
            match changed {
                // An older kernel: ENOSYS, or EINVAL for a flag it does not know.
                Err(Errno(libc::ENOSYS | libc::EINVAL)) => self.no_fchmodat2.store(true, Ordering::Relaxed),
                other => return other.map(drop),
            }
        }
        let path = sys::proc_fd_path(&fd);
        // SAFETY: `chmod` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe { libc::chmod(path.as_ptr(), mode as libc::mode_t) }).map(drop)
    }

    /// As on a kernel without fchmodat2 (Debian 12's own 6.1): chmod goes through /proc/self/fd.
    #[cfg(test)]
    pub fn chmod_as_before_fchmodat2(&self) {
        self.no_fchmodat2.store(true, Ordering::Relaxed);
    }

    pub fn chown(&self, node: &Node, uid: Option<u32>, gid: Option<u32>) -> SysResult<()> {
        let uid = uid.unwrap_or(u32::MAX);
        let gid = gid.unwrap_or(u32::MAX);
        let fd = self.fd(node)?;
        // SAFETY: `fchownat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe {
            libc::fchownat(fd.as_raw_fd(), EMPTY.as_ptr(), uid, gid, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW)
        })
        .map(drop)
    }

    pub fn set_times(&self, node: &Node, times: TimesToSet) -> SysResult<()> {
        let spec = [timespec_of(times.atime), timespec_of(times.mtime)];
        let fd = self.fd(node)?;
        // Through the descriptor itself (an empty path), for every kind of object: a /proc/self/fd
        // path walks procfs first (1.7 against 3.8 us here, once per file tar extracts), and
        // would follow a symbolic link.
        // SAFETY: `utimensat` reads a live array of two `timespec`s, as it expects, and the
        // NUL-terminated empty C string, which outlives the call.
        check(unsafe {
            libc::utimensat(
                fd.as_raw_fd(),
                EMPTY.as_ptr(),
                spec.as_ptr(),
                libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
            )
        })
        .map(drop)
    }

    /// Opens the object a node refers to for I/O, by its `/proc/self/fd` path: the same inode,
    /// never a name resolved again.
    pub fn open(&self, node: &Node, flags: i32) -> SysResult<File> {
        debug_assert_eq!(flags & (libc::O_CREAT | libc::O_NOFOLLOW), 0, "a reopen of a resolved object: {flags:#o}");
        let fd = self.fd(node)?;
        let path = sys::proc_fd_path(&fd);
        self.fds.metrics.backend_reopens.fetch_add(1, Ordering::Relaxed);
        let open = |flags| self.with_descriptor(|| sys::openat(libc::AT_FDCWD, &path, flags, 0));
        match open(flags) {
            // O_NOATIME is only for the file's owner (or CAP_FOWNER): a daemon without it
            // reads with atime updates rather than not at all.
            Err(Errno(libc::EPERM)) if flags & libc::O_NOATIME != 0 => open(flags & !libc::O_NOATIME).map(File::from),
            result => result.map(File::from),
        }
    }

    /// Makes a regular file `name` in `parent` (EEXIST if taken), and keeps the descriptor that
    /// made it, open for reading and writing, where it is the object found by name after:
    /// the first open for I/O can take it instead of opening again through /proc/self/fd
    /// (`LocalBackend::open`).
    pub fn make_file(&self, parent: &Node, name: &CStr, perm: u32) -> SysResult<(Node, libc::stat, Option<File>)> {
        let dir = self.fd(parent)?;
        let flags = libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_NOFOLLOW;
        let made = File::from(self.with_descriptor(|| sys::openat(dir.as_raw_fd(), name, flags, perm))?);
        let (node, st) = self.lookup(parent, name)?;
        // The daemon is the only one changing the backing directory, but a name is a name:
        // the descriptor is kept only if it is the object the node stands for.
        let made_st = sys::fstat_fd(&made)?;
        let same = (made_st.st_dev, made_st.st_ino) == (st.st_dev, st.st_ino);
        Ok((node, st, same.then_some(made)))
    }

    pub fn mknod(&self, parent: &Node, name: &CStr, mode: u32, rdev: u64) -> SysResult<(Node, libc::stat)> {
        // SAFETY: `mknodat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe { libc::mknodat(self.fd(parent)?.as_raw_fd(), name.as_ptr(), mode, rdev) })?;
        self.lookup(parent, name)
    }

    pub fn mkdir(&self, parent: &Node, name: &CStr, mode: u32) -> SysResult<(Node, libc::stat)> {
        // SAFETY: `mkdirat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe { libc::mkdirat(self.fd(parent)?.as_raw_fd(), name.as_ptr(), mode) })?;
        self.lookup(parent, name)
    }

    pub fn symlink(&self, parent: &Node, name: &CStr, target: &CStr) -> SysResult<(Node, libc::stat)> {
        // SAFETY: `symlinkat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe { libc::symlinkat(target.as_ptr(), self.fd(parent)?.as_raw_fd(), name.as_ptr()) })?;
        self.lookup(parent, name)
    }

    pub fn link(&self, node: &Node, new_parent: &Node, new_name: &CStr) -> SysResult<(Node, libc::stat)> {
        // Through /proc/self/fd with AT_SYMLINK_FOLLOW: links the exact inode the handle holds,
        // and works without CAP_DAC_READ_SEARCH (which AT_EMPTY_PATH would need).
        let fd = self.fd(node)?;
        let path = sys::proc_fd_path(&fd);
        let dir = self.fd(new_parent)?;
        // SAFETY: `linkat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe {
            libc::linkat(libc::AT_FDCWD, path.as_ptr(), dir.as_raw_fd(), new_name.as_ptr(), libc::AT_SYMLINK_FOLLOW)
        })?;
        self.lookup(new_parent, new_name)
    }

    /// A regular file with no name (O_TMPFILE in the backing root, mode 0600): the backing file
    /// system frees it with its last descriptor, a crash included, unless `name_unnamed` names it.
    pub fn make_unnamed(&self) -> SysResult<File> {
        let root = self.fd(&self.root)?;
        let fd = self.with_descriptor(|| sys::openat(root.as_raw_fd(), c".", libc::O_TMPFILE | libc::O_RDWR, 0o600))?;
        Ok(File::from(fd))
    }

    /// Names a file `make_unnamed` made: `name` in `parent` (EEXIST if taken).
    pub fn name_unnamed(&self, file: &File, parent: &Node, name: &CStr) -> SysResult<(Node, libc::stat)> {
        let path = sys::proc_fd_path(file);
        let dir = self.fd(parent)?;
        // SAFETY: `linkat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe {
            libc::linkat(libc::AT_FDCWD, path.as_ptr(), dir.as_raw_fd(), name.as_ptr(), libc::AT_SYMLINK_FOLLOW)
        })?;
        self.lookup(parent, name)
    }

    pub fn readlink(&self, node: &Node) -> SysResult<Vec<u8>> {
        let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
        let fd = self.fd(node)?;
        // SAFETY: `readlinkat`: the C strings are NUL-terminated and outlive the call; the buffer
        // is a live, exclusively borrowed slice passed with its own length, so the kernel writes
        // within it.
        let n = check_size(unsafe {
            libc::readlinkat(fd.as_raw_fd(), EMPTY.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        })?;
        buf.truncate(n);
        Ok(buf)
    }

    pub fn unlink(&self, parent: &Node, name: &CStr) -> SysResult<()> {
        // SAFETY: `unlinkat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe { libc::unlinkat(self.fd(parent)?.as_raw_fd(), name.as_ptr(), 0) }).map(drop)
    }

    pub fn rmdir(&self, parent: &Node, name: &CStr) -> SysResult<()> {
        // SAFETY: `unlinkat` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe { libc::unlinkat(self.fd(parent)?.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) }).map(drop)
    }

    pub fn rename(&self, parent: &Node, name: &CStr, new_parent: &Node, new_name: &CStr, flags: u32) -> SysResult<()> {
        let (from, to) = (self.fd(parent)?, self.fd(new_parent)?);
        // SAFETY: `renameat2` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        check(unsafe { libc::renameat2(from.as_raw_fd(), name.as_ptr(), to.as_raw_fd(), new_name.as_ptr(), flags) })
            .map(drop)
    }

    /// Opens a directory for reading in pieces (see `DirStream`).
    pub fn open_dir_stream(&self, node: &Node) -> SysResult<DirStream> {
        let fd = self
            .with_descriptor(|| sys::openat(self.fd(node)?.as_raw_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0))?;
        // SAFETY: fdopendir takes an integer descriptor; on success the `DIR` owns it and `fd` is
        // forgotten below, not closed; on failure `fd` still owns it and closes it.
        let dir = unsafe { libc::fdopendir(fd.as_raw_fd()) };
        let dir = std::ptr::NonNull::new(dir).ok_or_else(Errno::last)?;
        // fdopendir owns the descriptor from here on; closedir closes it.
        std::mem::forget(fd);
        Ok(DirStream { dir, buffered: Default::default(), buffered_from: 0, position: Some(0) })
    }

    pub fn open_dir_for_sync(&self, node: &Node) -> SysResult<File> {
        let fd = self.fd(node)?;
        self.with_descriptor(|| sys::openat(fd.as_raw_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0))
            .map(File::from)
    }

    /// Where the object is now, as the kernel sees it (`/proc/self/fd`): for log lines and
    /// fault rules, never to open anything by.
    pub fn path_of(&self, node: &Node) -> Option<std::path::PathBuf> {
        let fd = self.fd(node).ok()?;
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
    }

    /// The file's persistent handle (name_to_handle_at): it finds the file again after a
    /// restart, whatever it has been renamed to, and never finds another file in its place.
    pub fn file_handle(&self, node: &Node) -> SysResult<Vec<u8>> {
        match &node.handle {
            Some(handle) => Ok(handle.to_vec()),
            None => handle_of(self.fd(node)?.as_raw_fd(), EMPTY, libc::AT_EMPTY_PATH),
        }
    }

    /// The handle of the inode an open file is (named or not), for `open_by_handle`.
    pub fn handle_of_open(&self, file: &File) -> SysResult<Vec<u8>> {
        handle_of(file.as_raw_fd(), EMPTY, libc::AT_EMPTY_PATH)
    }

    /// The handle of what `name` in the directory `dir` is, without following a symlink.
    pub fn handle_at(&self, dir: &Node, name: &CStr) -> SysResult<Vec<u8>> {
        handle_of(self.fd(dir)?.as_raw_fd(), name, 0)
    }

    /// What `name` in the directory `dir` is (its attributes and handle), without following a
    /// symlink and without opening it: two path walks, where `lookup` opens the object, asks
    /// its handle and closes it again.
    pub fn identity_at(&self, dir: &Node, name: &CStr) -> SysResult<(libc::stat, Vec<u8>)> {
        let dir = self.fd(dir)?;
        let st = sys::fstatat(dir.as_raw_fd(), name, libc::AT_SYMLINK_NOFOLLOW)?;
        Ok((st, handle_of(dir.as_raw_fd(), name, 0)?))
    }

    fn open_handle(&self, key: &[u8], flags: i32) -> SysResult<OwnedFd> {
        open_handle_at(&self.mount_fd, key, flags)
    }

    /// Opens a file by a handle from `file_handle`; ESTALE when the file is gone.
    pub fn open_by_handle(&self, key: &[u8], flags: i32) -> SysResult<File> {
        self.with_descriptor(|| self.open_handle(key, flags)).map(File::from)
    }

    /// The object a handle from `file_handle` names, as a node, with its attributes; ESTALE
    /// when it is gone.
    pub fn node_by_handle(&self, key: &[u8]) -> SysResult<(Node, libc::stat)> {
        let fd = self.with_descriptor(|| self.open_handle(key, libc::O_PATH))?;
        let st = sys::fstat_fd(&fd)?;
        Ok((self.adopt(fd, &st), st))
    }

    /// Makes everything written to the backing file system durable, in one call.
    pub fn sync_file_system(&self) -> SysResult<()> {
        // SAFETY: `syncfs` takes only integers (a descriptor and plain values) and touches none of
        // our memory; a bad descriptor is an error return.
        check(unsafe { libc::syncfs(self.mount_fd.as_raw_fd()) }).map(drop)
    }

    pub fn statfs_root(&self) -> SysResult<libc::statvfs> {
        self.statfs(&self.root)
    }

    pub fn statfs(&self, node: &Node) -> SysResult<libc::statvfs> {
        // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes
        // are a valid value.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `fstatvfs` writes one value of the type its out-pointer has, into a live local
        // borrowed exclusively for the call; any C string passed is NUL-terminated.
        check(unsafe { libc::fstatvfs(self.fd(node)?.as_raw_fd(), &raw mut st) })?;
        Ok(st)
    }

    /// The `/proc/self/fd` path of a node, with the descriptor it names, which must stay open
    /// while the path is used. For a symlink too: the descriptor is an O_PATH one of the link
    /// itself, and its /proc/self/fd entry resolves to that link, not to what it names, so the
    /// xattr calls answer what the backing file system answers for the link (ENODATA for a
    /// missing security.* name, EPERM for user.*) (tests/xattrs.rs).
    fn xattr_path<'a>(&self, node: &'a Node) -> SysResult<(NodeFd<'a>, CString)> {
        let fd = self.fd(node)?;
        let path = sys::proc_fd_path(&fd);
        Ok((fd, path))
    }

    pub fn set_xattr(&self, node: &Node, name: &CStr, value: &[u8], flags: i32) -> SysResult<()> {
        let (_fd, path) = self.xattr_path(node)?;
        // SAFETY: `setxattr`: the C strings are NUL-terminated and outlive the call; the buffer is
        // a live slice passed with its own length, which the kernel only reads.
        check(unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), flags) })
            .map(drop)
    }

    /// With `size == 0` returns the value's size (FUSE's size probe); otherwise the value.
    pub fn get_xattr(&self, node: &Node, name: &CStr, size: usize) -> SysResult<XattrReply> {
        let (_fd, path) = self.xattr_path(node)?;
        let mut buf = vec![0u8; size];
        let n =
            // SAFETY: `getxattr`: the C strings are NUL-terminated and outlive the call; the buffer
            // is a live, exclusively borrowed slice passed with its own length, so the kernel
            // writes within it.
            check_size(unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
        Ok(if size == 0 {
            XattrReply::Size(n)
        } else {
            buf.truncate(n);
            XattrReply::Data(buf)
        })
    }

    pub fn list_xattr(&self, node: &Node, size: usize) -> SysResult<XattrReply> {
        let (_fd, path) = self.xattr_path(node)?;
        let mut buf = vec![0u8; size];
        // SAFETY: `listxattr`: the C strings are NUL-terminated and outlive the call; the buffer is
        // a live, exclusively borrowed slice passed with its own length, so the kernel writes
        // within it.
        let n = check_size(unsafe { libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
        Ok(if size == 0 {
            XattrReply::Size(n)
        } else {
            buf.truncate(n);
            XattrReply::Data(buf)
        })
    }

    pub fn remove_xattr(&self, node: &Node, name: &CStr) -> SysResult<()> {
        let (_fd, path) = self.xattr_path(node)?;
        // SAFETY: `removexattr` reads only NUL-terminated C strings that outlive the call; the
        // other arguments are integers.
        check(unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) }).map(drop)
    }
}
