//! The local-directory backend: every file of the mount is an ordinary file at the same path in
//! the backing directory, so an unmounted backing directory is plainly readable.
//!
//! Owns: every system call that touches the backing directory. Names are always resolved one
//! component at a time relative to a directory handle (`openat`-style, `O_NOFOLLOW`), so a
//! symlink inside the backing directory can never make the daemon touch a path outside it.
//! Must not: decide anything (caching, ownership policy, hiding the state folder): the engine
//! does that.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::sys::{self, check, check_size, retry_eintr, Errno, SysResult, EMPTY};

/// Name of the daemon's own folder inside the backing directory; the mount never shows it.
pub const STATE_DIR_NAME: &str = ".coalescefs";
/// The intent log's file in the state folder, unless `-o log=PATH` puts it elsewhere.
pub fn default_log_path(backing: &Path) -> std::path::PathBuf {
    backing.join(STATE_DIR_NAME).join("intent.log")
}

/// A handle on one object of the backing directory: an `O_PATH | O_NOFOLLOW` fd. It pins the
/// backing inode (so its number is never reused while we hold it) and lets every later call
/// address that exact inode without resolving a name again.
#[derive(Debug)]
pub struct Node {
    fd: OwnedFd,
}

impl Node {
    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsRawFd for Node {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// One directory entry as the backing file system reports it.
#[derive(Debug, Clone)]
pub struct DirEntry {
    pub name: OsString,
    pub backing_ino: u64,
    pub kind: u8, // DT_* from getdents
}

/// Attributes to set; `None` leaves a field as it is.
#[derive(Debug, Default, Clone, Copy)]
pub struct TimesToSet {
    pub atime: Option<libc::timespec>,
    pub mtime: Option<libc::timespec>,
}

impl TimesToSet {
    /// The same times with UTIME_NOW replaced by `now`, so that they can be set again later.
    pub fn resolved_now(self, now: std::time::SystemTime) -> TimesToSet {
        let since_epoch = now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let now = libc::timespec { tv_sec: since_epoch.as_secs() as i64, tv_nsec: since_epoch.subsec_nanos() as i64 };
        let resolve = |t: Option<libc::timespec>| t.map(|t| if t.tv_nsec == libc::UTIME_NOW { now } else { t });
        TimesToSet { atime: resolve(self.atime), mtime: resolve(self.mtime) }
    }
}

/// name_to_handle_at, encoded as the handle type (4 bytes, little-endian) and its bytes.
fn handle_of(dir: RawFd, name: &CStr, flags: i32) -> SysResult<Vec<u8>> {
    const MAX_HANDLE_BYTES: usize = 128;
    let mut raw = vec![0u8; std::mem::size_of::<libc::file_handle>() + MAX_HANDLE_BYTES];
    let handle = raw.as_mut_ptr() as *mut libc::file_handle;
    unsafe { (*handle).handle_bytes = MAX_HANDLE_BYTES as u32 };
    let mut mount_id = 0;
    check(unsafe { libc::name_to_handle_at(dir, name.as_ptr(), handle, &mut mount_id, flags) })?;
    let (len, kind) = unsafe { ((*handle).handle_bytes as usize, (*handle).handle_type) };
    let header = std::mem::size_of::<libc::file_handle>();
    let mut key = kind.to_le_bytes().to_vec();
    key.extend_from_slice(&raw[header..header + len]);
    Ok(key)
}

pub struct LocalBackend {
    root: Node,
    root_path: std::path::PathBuf,
}

fn is_symlink(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFLNK
}

impl LocalBackend {
    /// Opens the backing directory. The path is resolved once, here, by the kernel, as the user
    /// gave it; from then on only the handle is used.
    pub fn open_dir(root_path: &Path) -> SysResult<LocalBackend> {
        let path = sys::path_cstring(root_path)?;
        let fd = sys::openat(libc::AT_FDCWD, &path, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        Ok(LocalBackend { root: Node { fd }, root_path: root_path.to_path_buf() })
    }

    pub fn root_path(&self) -> &Path {
        &self.root_path
    }

    /// A second handle on the root, for the engine's inode table.
    pub fn root_node(&self) -> SysResult<Node> {
        self.reopen_path(&self.root)
    }

    fn reopen_path(&self, node: &Node) -> SysResult<Node> {
        let fd = check(unsafe { libc::fcntl(node.raw(), libc::F_DUPFD_CLOEXEC, 0) })?;
        Ok(Node { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub fn lookup(&self, parent: &Node, name: &CStr) -> SysResult<(Node, libc::stat)> {
        let fd = sys::openat(parent.raw(), name, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let st = sys::fstat_fd(&fd)?;
        Ok((Node { fd }, st))
    }

    pub fn stat(&self, node: &Node) -> SysResult<libc::stat> {
        sys::fstat_fd(&node.fd)
    }

    pub fn chmod(&self, node: &Node, mode: u32) -> SysResult<()> {
        let st = self.stat(node)?;
        if is_symlink(&st) {
            // Linux has no symlink modes; chmod through a link name would follow it.
            return Err(Errno(libc::EOPNOTSUPP));
        }
        let path = sys::proc_fd_path(&node.fd);
        check(unsafe { libc::chmod(path.as_ptr(), mode as libc::mode_t) }).map(drop)
    }

    pub fn chown(&self, node: &Node, uid: Option<u32>, gid: Option<u32>) -> SysResult<()> {
        let uid = uid.unwrap_or(u32::MAX);
        let gid = gid.unwrap_or(u32::MAX);
        check(unsafe {
            libc::fchownat(
                node.raw(),
                EMPTY.as_ptr(),
                uid,
                gid,
                libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
            )
        })
        .map(drop)
    }

    pub fn set_times(&self, node: &Node, times: TimesToSet) -> SysResult<()> {
        let omit = libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT };
        let spec = [times.atime.unwrap_or(omit), times.mtime.unwrap_or(omit)];
        let st = self.stat(node)?;
        if is_symlink(&st) {
            check(unsafe {
                libc::utimensat(
                    node.raw(),
                    EMPTY.as_ptr(),
                    spec.as_ptr(),
                    libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
                )
            })
            .map(drop)
        } else {
            let path = sys::proc_fd_path(&node.fd);
            check(unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), spec.as_ptr(), 0) })
                .map(drop)
        }
    }

    /// Opens the object a node refers to for I/O, by its `/proc/self/fd` path: the same inode,
    /// never a name resolved again.
    pub fn open(&self, node: &Node, flags: i32) -> SysResult<File> {
        debug_assert_eq!(flags & (libc::O_CREAT | libc::O_NOFOLLOW), 0, "a reopen of a resolved object: {flags:#o}");
        let path = sys::proc_fd_path(&node.fd);
        match sys::openat(libc::AT_FDCWD, &path, flags, 0) {
            // O_NOATIME is only for the file's owner (or CAP_FOWNER): a daemon without it
            // reads with atime updates rather than not at all.
            Err(Errno(libc::EPERM)) if flags & libc::O_NOATIME != 0 => {
                sys::openat(libc::AT_FDCWD, &path, flags & !libc::O_NOATIME, 0).map(File::from)
            }
            result => result.map(File::from),
        }
    }

    pub fn truncate(&self, node: &Node, size: u64) -> SysResult<()> {
        let file = self.open(node, libc::O_WRONLY)?;
        check(unsafe { libc::ftruncate(file.as_raw_fd(), size as libc::off_t) }).map(drop)
    }

    pub fn create(
        &self,
        parent: &Node,
        name: &CStr,
        flags: i32,
        mode: u32,
    ) -> SysResult<(File, Node, libc::stat)> {
        let fd = sys::openat(parent.raw(), name, flags | libc::O_CREAT | libc::O_NOFOLLOW, mode)?;
        let file = File::from(fd);
        let (node, st) = self.lookup(parent, name)?;
        Ok((file, node, st))
    }

    pub fn mknod(&self, parent: &Node, name: &CStr, mode: u32, rdev: u64) -> SysResult<(Node, libc::stat)> {
        check(unsafe { libc::mknodat(parent.raw(), name.as_ptr(), mode, rdev) })?;
        self.lookup(parent, name)
    }

    pub fn mkdir(&self, parent: &Node, name: &CStr, mode: u32) -> SysResult<(Node, libc::stat)> {
        check(unsafe { libc::mkdirat(parent.raw(), name.as_ptr(), mode) })?;
        self.lookup(parent, name)
    }

    pub fn symlink(&self, parent: &Node, name: &CStr, target: &CStr) -> SysResult<(Node, libc::stat)> {
        check(unsafe { libc::symlinkat(target.as_ptr(), parent.raw(), name.as_ptr()) })?;
        self.lookup(parent, name)
    }

    pub fn link(&self, node: &Node, new_parent: &Node, new_name: &CStr) -> SysResult<(Node, libc::stat)> {
        // Through /proc/self/fd with AT_SYMLINK_FOLLOW: links the exact inode the handle holds,
        // and works without CAP_DAC_READ_SEARCH (which AT_EMPTY_PATH would need).
        let path = sys::proc_fd_path(&node.fd);
        check(unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                path.as_ptr(),
                new_parent.raw(),
                new_name.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        })?;
        self.lookup(new_parent, new_name)
    }

    pub fn readlink(&self, node: &Node) -> SysResult<Vec<u8>> {
        let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
        let n = check_size(unsafe {
            libc::readlinkat(node.raw(), EMPTY.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        })?;
        buf.truncate(n);
        Ok(buf)
    }

    pub fn unlink(&self, parent: &Node, name: &CStr) -> SysResult<()> {
        check(unsafe { libc::unlinkat(parent.raw(), name.as_ptr(), 0) }).map(drop)
    }

    pub fn rmdir(&self, parent: &Node, name: &CStr) -> SysResult<()> {
        check(unsafe { libc::unlinkat(parent.raw(), name.as_ptr(), libc::AT_REMOVEDIR) }).map(drop)
    }

    pub fn rename(
        &self,
        parent: &Node,
        name: &CStr,
        new_parent: &Node,
        new_name: &CStr,
        flags: u32,
    ) -> SysResult<()> {
        check(unsafe {
            libc::renameat2(parent.raw(), name.as_ptr(), new_parent.raw(), new_name.as_ptr(), flags)
        })
        .map(drop)
    }

    /// Reads a whole directory. FUSE readdir is offset-addressed; a snapshot taken at
    /// opendir/rewind gives stable offsets, which POSIX allows (entries added later may or may
    /// not appear).
    pub fn read_dir(&self, node: &Node) -> SysResult<Vec<DirEntry>> {
        let fd = sys::openat(node.raw(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let dir = unsafe { libc::fdopendir(fd.as_raw_fd()) };
        if dir.is_null() {
            return Err(Errno::last());
        }
        // fdopendir owns the fd from here on; closedir closes it.
        std::mem::forget(fd);
        let mut entries = Vec::new();
        let result = loop {
            unsafe { *libc::__errno_location() = 0 };
            let ent = unsafe { libc::readdir64(dir) };
            if ent.is_null() {
                let err = unsafe { *libc::__errno_location() };
                break if err == 0 { Ok(()) } else { Err(Errno(err)) };
            }
            let ent = unsafe { &*ent };
            let name = unsafe { CStr::from_ptr(ent.d_name.as_ptr()) };
            let name = OsStr::from_bytes(name.to_bytes());
            if name == "." || name == ".." {
                continue;
            }
            entries.push(DirEntry { name: name.to_os_string(), backing_ino: ent.d_ino, kind: ent.d_type });
        };
        unsafe { libc::closedir(dir) };
        result.map(|()| entries)
    }

    pub fn open_dir_for_sync(&self, node: &Node) -> SysResult<File> {
        sys::openat(node.raw(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0).map(File::from)
    }

    /// The file's persistent handle (name_to_handle_at): it finds the file again after a
    /// restart, whatever it has been renamed to, and never finds another file in its place.
    pub fn file_handle(&self, node: &Node) -> SysResult<Vec<u8>> {
        handle_of(node.raw(), c"", libc::AT_EMPTY_PATH)
    }

    /// The handle of what `name` in the directory `dir` is, without following a symlink.
    pub fn handle_at(&self, dir: &impl AsRawFd, name: &CStr) -> SysResult<Vec<u8>> {
        handle_of(dir.as_raw_fd(), name, 0)
    }

    /// Opens a file by a handle from `file_handle`; ESTALE when the file is gone.
    pub fn open_by_handle(&self, key: &[u8], flags: i32) -> SysResult<File> {
        let header = std::mem::size_of::<libc::file_handle>();
        if key.len() < 4 || key.len() - 4 > 128 {
            return Err(Errno(libc::EINVAL));
        }
        let mut raw = vec![0u8; header + key.len() - 4];
        let handle = raw.as_mut_ptr() as *mut libc::file_handle;
        raw[header..].copy_from_slice(&key[4..]);
        unsafe {
            (*handle).handle_bytes = (key.len() - 4) as u32;
            (*handle).handle_type = i32::from_le_bytes(key[..4].try_into().expect("four bytes"));
        }
        // An O_PATH descriptor will not do for either call here.
        let root = self.open_dir_for_sync(&self.root)?;
        let fd = check(unsafe { libc::open_by_handle_at(root.as_raw_fd(), handle, flags | libc::O_CLOEXEC) })?;
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// A directory found by its handle from `file_handle`, to address entries in it.
    pub fn directory_by_handle(&self, key: &[u8]) -> SysResult<Node> {
        let dir = self.open_by_handle(key, libc::O_RDONLY | libc::O_DIRECTORY)?;
        Ok(Node { fd: OwnedFd::from(dir) })
    }

    /// Makes everything written to the backing file system durable, in one call.
    pub fn sync_file_system(&self) -> SysResult<()> {
        let root = self.open_dir_for_sync(&self.root)?;
        check(unsafe { libc::syncfs(root.as_raw_fd()) }).map(drop)
    }

    pub fn statfs(&self, node: &Node) -> SysResult<libc::statvfs> {
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        check(unsafe { libc::fstatvfs(node.raw(), &mut st) })?;
        Ok(st)
    }

    fn xattr_path(&self, node: &Node) -> SysResult<CString> {
        let st = self.stat(node)?;
        if is_symlink(&st) {
            // The /proc/self/fd path of a symlink would be followed; user xattrs are not allowed
            // on symlinks anyway.
            return Err(Errno(libc::EPERM));
        }
        Ok(sys::proc_fd_path(&node.fd))
    }

    pub fn set_xattr(&self, node: &Node, name: &CStr, value: &[u8], flags: i32) -> SysResult<()> {
        let path = self.xattr_path(node)?;
        check(unsafe {
            libc::setxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), flags)
        })
        .map(drop)
    }

    /// With `size == 0` returns the value's size (FUSE's size probe); otherwise the value.
    pub fn get_xattr(&self, node: &Node, name: &CStr, size: usize) -> SysResult<XattrReply> {
        let path = self.xattr_path(node)?;
        let mut buf = vec![0u8; size];
        let n = check_size(unsafe {
            libc::getxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        })?;
        Ok(if size == 0 { XattrReply::Size(n) } else { buf.truncate(n); XattrReply::Data(buf) })
    }

    pub fn list_xattr(&self, node: &Node, size: usize) -> SysResult<XattrReply> {
        let path = match self.xattr_path(node) {
            Ok(p) => p,
            Err(_) => return Ok(if size == 0 { XattrReply::Size(0) } else { XattrReply::Data(vec![]) }),
        };
        let mut buf = vec![0u8; size];
        let n = check_size(unsafe { libc::listxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) })?;
        Ok(if size == 0 { XattrReply::Size(n) } else { buf.truncate(n); XattrReply::Data(buf) })
    }

    pub fn remove_xattr(&self, node: &Node, name: &CStr) -> SysResult<()> {
        let path = self.xattr_path(node)?;
        check(unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) }).map(drop)
    }

    /// Creates (if needed) and opens the daemon's state folder. It is made as a directory with
    /// mode 0700; a symlink or file in its place is refused rather than followed.
    pub fn open_state_dir(&self) -> SysResult<OwnedFd> {
        let name = CString::new(STATE_DIR_NAME).expect("constant has no NUL");
        match check(unsafe { libc::mkdirat(self.root.raw(), name.as_ptr(), 0o700) }) {
            Ok(_) | Err(Errno(libc::EEXIST)) => {}
            Err(e) => return Err(e),
        }
        sys::openat(self.root.raw(), &name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0)
    }
}

/// Answer to a getxattr/listxattr: the size when asked with size 0, else the bytes.
#[derive(Debug)]
pub enum XattrReply {
    Size(usize),
    Data(Vec<u8>),
}

/// Data operations on a file the engine has opened on the backend.
pub mod data {
    use super::*;

    pub fn read_at(file: &File, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        sys::pread_full(file.as_raw_fd(), buf, offset)
    }

    pub fn sync(file: &File, data_only: bool) -> SysResult<()> {
        let ret = if data_only {
            unsafe { libc::fdatasync(file.as_raw_fd()) }
        } else {
            unsafe { libc::fsync(file.as_raw_fd()) }
        };
        check(ret).map(drop)
    }

    pub fn write_at(file: &File, buf: &[u8], offset: u64) -> SysResult<()> {
        sys::pwrite_all(file.as_raw_fd(), buf, offset)
    }

    /// Writes several aligned pieces to a file opened with O_DIRECT, all in flight at once;
    /// each piece's result, in order.
    pub fn write_many_direct(file: &File, pieces: &[(&[u8], u64)]) -> Vec<SysResult<()>> {
        super::super::aio::write_many_at(file.as_raw_fd(), pieces)
    }

    pub fn stat(file: &File) -> SysResult<libc::stat> {
        sys::fstat_fd(file)
    }

    /// Appends `bytes` and makes them durable before returning.
    pub fn append_synced(mut file: &File, bytes: &[u8]) -> SysResult<()> {
        use std::io::Write;
        file.write_all(bytes).map_err(Errno::from)?;
        sync(file, true)
    }

    pub fn set_len(file: &File, size: u64) -> SysResult<()> {
        check(unsafe { libc::ftruncate(file.as_raw_fd(), size as libc::off_t) }).map(drop)
    }

    pub fn fallocate(file: &File, mode: i32, offset: u64, length: u64) -> SysResult<()> {
        retry_eintr(|| {
            check(unsafe {
                libc::fallocate(file.as_raw_fd(), mode, offset as libc::off_t, length as libc::off_t)
            })
        })
        .map(drop)
    }

    pub fn seek(file: &File, offset: i64, whence: i32) -> SysResult<i64> {
        let ret = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
        if ret == -1 {
            Err(Errno::last())
        } else {
            Ok(ret)
        }
    }

    pub fn copy_range(
        source: &File,
        source_offset: u64,
        target: &File,
        target_offset: u64,
        length: u64,
    ) -> SysResult<usize> {
        let mut source_off = source_offset as libc::loff_t;
        let mut target_off = target_offset as libc::loff_t;
        retry_eintr(|| {
            check_size(unsafe {
                libc::copy_file_range(
                    source.as_raw_fd(),
                    &mut source_off,
                    target.as_raw_fd(),
                    &mut target_off,
                    length as usize,
                    0,
                )
            })
        })
    }
}

/// Reads a symlink target given as a path into the C string symlinkat wants.
pub fn symlink_target(target: &Path) -> SysResult<CString> {
    CString::new(target.as_os_str().as_bytes().to_vec()).map_err(|_| Errno(libc::EINVAL))
}
