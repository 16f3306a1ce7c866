//! The system side of mounting: checking a backing directory and mount point before anything
//! is mounted, mounting `fuse.coalescefs`, finding our mounts in `/proc/self/mountinfo`, and
//! unmounting. Every failure here is an operating condition with a message a user can act on.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::sys::{self, Errno};

pub const FS_TYPE: &str = "fuse.coalescefs";

#[derive(Debug, Clone)]
pub struct MountInfo {
    /// The mount's ID, as /proc/PID/fdinfo's `mnt_id` names the mount a descriptor was opened on.
    pub mount_id: u64,
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub source: String,
    /// The minor number of the mount's device: for a FUSE mount, its connection's number in
    /// /sys/fs/fuse/connections.
    pub device_minor: u32,
}

/// mountinfo escapes space, tab, newline and backslash as \ooo.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            let value = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn read_mounts() -> Vec<MountInfo> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_id = left.split(' ').next()?.parse().ok()?;
            let mount_point = left.split(' ').nth(4)?;
            let device_minor = left.split(' ').nth(2)?.split_once(':')?.1.parse().ok()?;
            let mut right = right.split(' ');
            let fs_type = right.next()?;
            let source = right.next().unwrap_or("");
            Some(MountInfo {
                mount_id,
                mount_point: PathBuf::from(unescape(mount_point)),
                fs_type: fs_type.to_string(),
                source: unescape(source),
                device_minor,
            })
        })
        .collect()
}

pub fn mount_at(path: &Path) -> Option<MountInfo> {
    read_mounts().into_iter().rev().find(|m| m.mount_point == path)
}

/// The mount's writes the kernel still caches (FUSE's writeback cache), sent to its daemon:
/// syncfs writes a FUSE file system's dirty pages back, though it asks the daemon nothing.
/// Before `coalescefs sync` and `snapshot`, so that they cover every write made before them.
pub fn send_cached_writes(mount_point: &Path) -> Result<(), String> {
    let dir = std::fs::File::open(mount_point).map_err(|e| format!("{}: {e}", mount_point.display()))?;
    // SAFETY: `syncfs` takes a descriptor, which `dir` holds open, and touches none of our memory.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!("the kernel's cached writes to {} did not reach the daemon: {e}", mount_point.display()));
    }
    Ok(())
}

/// An absolute path without resolving the last component through a (possibly dead) mount.
pub fn absolute(path: &Path) -> PathBuf {
    let path = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().map(|cwd| cwd.join(path)).unwrap_or_else(|_| path.to_path_buf())
    };
    // Resolve the parent (a real directory), keep the last name as given.
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => std::fs::canonicalize(parent).map(|p| p.join(name)).unwrap_or(path),
        _ => path,
    }
}

/// Checks the backing directory; returns its canonical path.
pub fn check_backing_dir(path: &Path, read_only: bool) -> Result<PathBuf, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("backing directory {shown} does not exist"),
        _ => format!("backing directory {shown}: {e}"),
    })?;
    if !meta.is_dir() {
        return Err(format!("backing directory {shown} is not a directory"));
    }
    let canonical = std::fs::canonicalize(path).map_err(|e| format!("backing directory {shown}: {e}"))?;
    if !read_only {
        let c = sys::path_cstring(&canonical).map_err(|e| format!("backing directory {shown}: {e}"))?;
        // SAFETY: `access` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
            let err = Errno::last();
            return Err(format!(
                "backing directory {shown} is not writable: {err} (mount with -o ro to serve it read-only)"
            ));
        }
    }
    Ok(canonical)
}

/// Checks the mount point; returns its canonical path.
pub fn check_mount_point(path: &Path, backing: &Path) -> Result<PathBuf, String> {
    let shown = path.display();
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)) => {
            return Err(format!(
                "mount point {shown} is busy: a coalescefs daemon died there; clear it with `coalescefs umount {shown}`"
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("mount point {shown} does not exist"))
        }
        Err(e) => return Err(format!("mount point {shown}: {e}")),
    };
    if !meta.is_dir() {
        return Err(format!("mount point {shown} is not a directory"));
    }
    let canonical = std::fs::canonicalize(path).map_err(|e| format!("mount point {shown}: {e}"))?;
    if let Some(existing) = mount_at(&canonical) {
        return Err(format!(
            "mount point {shown} is busy: {} from {} is already mounted there",
            existing.fs_type, existing.source
        ));
    }
    if canonical.starts_with(backing) {
        return Err(format!(
            "mount point {shown} is inside the backing directory {}: the mount would serve itself",
            backing.display()
        ));
    }
    // Allowed, as mount(8) allows it, but what is there cannot be reached while mounted.
    if let Some(Ok(entry)) = std::fs::read_dir(&canonical).ok().and_then(|mut entries| entries.next()) {
        log::warn!(
            "mount point {shown} is not empty ({} among its entries): what it holds is hidden while mounted",
            entry.file_name().to_string_lossy()
        );
    }
    Ok(canonical)
}

/// Aborts FUSE connection `connection` (fusectl, mounted first if it is not): every request
/// waiting on it fails at once and the session ends. The last resort of a daemon that must exit.
pub fn abort_connection(connection: u32) -> std::io::Result<()> {
    let control = Path::new("/sys/fs/fuse/connections");
    let abort = control.join(connection.to_string()).join("abort");
    if !abort.exists() {
        // SAFETY: mount reads NUL-terminated literals; its data argument may be null.
        let ret = unsafe {
            libc::mount(
                c"fusectl".as_ptr(),
                c"/sys/fs/fuse/connections".as_ptr(),
                c"fusectl".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if ret != 0 && Errno::last().0 != libc::EBUSY {
            return Err(std::io::Error::last_os_error());
        }
    }
    std::fs::write(abort, "1\n")
}

/// Alive means running: a zombie has finished its work, whenever its parent gets to reap it
/// (a daemon's parent is init, and some inits reap only once a second).
pub fn process_alive(pid: i32) -> bool {
    // A zombie leader is not enough: its other threads may still be exiting, and the last one
    // to go closes the files (after tearing down the address space, AIO contexts included,
    // which takes tens of milliseconds). Alive while any thread is not a zombie.
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().any(|task| match std::fs::read_to_string(task.path().join("stat")) {
        // The state follows the parenthesised command name, which may itself hold spaces.
        Ok(stat) => stat.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')).unwrap_or(true),
        Err(_) => false,
    })
}

/// When the process started, in clock ticks since boot (/proc/PID/stat's 22nd field): with its
/// id, it names one process, where an id alone is given out again once the process is gone.
pub fn process_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields from the state on (the 3rd) follow the parenthesised command name.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Changes the flags of a mounted coalescefs (`mount -o remount,ro`); the daemon keeps serving.
pub fn remount(mount_point: &Path, options: &crate::options::MountOptions) -> Result<(), String> {
    let target = sys::path_cstring(mount_point).map_err(|e| format!("mount point: {e}"))?;
    let mut flags = libc::MS_REMOUNT | kernel_flags(options);
    if !options.read_only {
        flags &= !libc::MS_RDONLY;
    }
    // Going read-only fails with EBUSY while a file is open for writing.
    retrying_while_busy(|| {
        // SAFETY: mount reads the NUL-terminated `target`; a remount takes no source, type or data,
        // so those are null as the call allows.
        let ret = unsafe { libc::mount(std::ptr::null(), target.as_ptr(), std::ptr::null(), flags, std::ptr::null()) };
        if ret == 0 {
            Ok(())
        } else {
            Err(Errno::last())
        }
    })
    .map_err(|err| format!("remount of {} failed: {err}", mount_point.display()))
}

/// How long a busy mount is asked again: a file closed a moment ago can still be on its way out
/// of the kernel (CI: `umount` right after a test read its files back answered EBUSY once).
const BUSY_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// `attempt` again every 20 ms while it fails with EBUSY, for at most [`BUSY_GRACE`]; then its
/// error. A file that stays open keeps the mount busy: the caller reports it.
fn retrying_while_busy(mut attempt: impl FnMut() -> Result<(), Errno>) -> Result<(), Errno> {
    let deadline = std::time::Instant::now() + BUSY_GRACE;
    loop {
        match attempt() {
            Err(Errno(libc::EBUSY)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            done => return done,
        }
    }
}

/// `coalescefs umount`'s unmount: the lazy form at once, the other asked again while the mount
/// is busy for [`BUSY_GRACE`], before the caller says which files keep it.
pub fn unmount_when_closed(mount_point: &Path, lazy: bool) -> Result<(), Errno> {
    if lazy {
        return unmount(mount_point, true);
    }
    retrying_while_busy(|| unmount(mount_point, false))
}

fn kernel_flags(options: &crate::options::MountOptions) -> libc::c_ulong {
    let mut flags = libc::MS_NODEV | libc::MS_NOSUID;
    if options.read_only {
        flags |= libc::MS_RDONLY;
    }
    for flag in &options.kernel_flags {
        match flag.as_str() {
            "dev" => flags &= !libc::MS_NODEV,
            "nodev" => flags |= libc::MS_NODEV,
            "suid" => flags &= !libc::MS_NOSUID,
            "nosuid" => flags |= libc::MS_NOSUID,
            "exec" => flags &= !libc::MS_NOEXEC,
            "noexec" => flags |= libc::MS_NOEXEC,
            "atime" => flags &= !libc::MS_NOATIME,
            "noatime" => flags |= libc::MS_NOATIME,
            "relatime" => flags |= libc::MS_RELATIME,
            "diratime" => flags &= !libc::MS_NODIRATIME,
            "nodiratime" => flags |= libc::MS_NODIRATIME,
            "sync" => flags |= libc::MS_SYNCHRONOUS,
            "dirsync" => flags |= libc::MS_DIRSYNC,
            _ => unreachable!("options.rs accepts only the flags listed here"),
        }
    }
    flags
}

/// Mounts `fuse.coalescefs` directly (as root): returns the /dev/fuse fd the session serves.
pub fn mount_direct(
    source: &str,
    mount_point: &Path,
    options: &crate::options::MountOptions,
) -> Result<OwnedFd, String> {
    mount_direct_as(FS_TYPE, source, mount_point, options)
}

/// `mount_direct` under another file system type (`fuse.NAME`): the benchmark's null sink
/// mounts so, so that nothing that looks for coalescefs mounts takes it for one.
pub fn mount_direct_as(
    fs_type: &str,
    source: &str,
    mount_point: &Path,
    options: &crate::options::MountOptions,
) -> Result<OwnedFd, String> {
    let dev_fuse = sys::openat(libc::AT_FDCWD, c"/dev/fuse", libc::O_RDWR, 0).map_err(|e| match e.0 {
        libc::ENOENT => "/dev/fuse does not exist: load the fuse module (modprobe fuse)".to_string(),
        _ => format!("cannot open /dev/fuse: {e}"),
    })?;
    let root_mode = std::fs::metadata(mount_point).map(|m| m.mode() & libc::S_IFMT).unwrap_or(libc::S_IFDIR);
    let mut data = format!(
        "fd={},rootmode={:o},user_id={},group_id={},default_permissions",
        dev_fuse.as_raw_fd(),
        root_mode,
        // SAFETY: `getuid` takes no arguments, cannot fail and touches none of our memory.
        unsafe { libc::getuid() },
        // SAFETY: `getgid` takes no arguments, cannot fail and touches none of our memory.
        unsafe { libc::getgid() }
    );
    if options.allow_other || options.allow_root {
        data.push_str(",allow_other");
    }
    let flags = kernel_flags(options);
    let source_c = CString::new(source).map_err(|_| "the backing path contains a NUL byte".to_string())?;
    let target = sys::path_cstring(mount_point).map_err(|e| format!("mount point: {e}"))?;
    let fs_type = CString::new(fs_type).map_err(|_| "the file system type contains a NUL byte".to_string())?;
    let data_c = CString::new(data).expect("no NUL in formatted options");
    let ret =
        // SAFETY: mount reads NUL-terminated C strings that outlive the call (the data is a C
        // string too, as FUSE's mount options are).
        unsafe { libc::mount(source_c.as_ptr(), target.as_ptr(), fs_type.as_ptr(), flags, data_c.as_ptr().cast()) };
    if ret != 0 {
        return Err(format!("mount of {} failed: {}", mount_point.display(), Errno::last()));
    }
    let fd = dev_fuse.as_raw_fd();
    std::mem::forget(dev_fuse);
    // SAFETY: `fd` is /dev/fuse's descriptor, open, and its owner `dev_fuse` was forgotten just
    // above without closing it, so the new OwnedFd is its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Unmounts a coalescefs mount point. Lazy (MNT_DETACH) when asked, or when the daemon is gone
/// and the mount can only answer ENOTCONN.
pub fn unmount(mount_point: &Path, lazy: bool) -> Result<(), Errno> {
    let target = sys::path_cstring(mount_point)?;
    // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
    if unsafe { libc::geteuid() } == 0 {
        let flags = if lazy { libc::MNT_DETACH } else { 0 };
        // SAFETY: `umount2` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        sys::check(unsafe { libc::umount2(target.as_ptr(), flags) }).map(drop)
    } else {
        let mut cmd = std::process::Command::new("fusermount3");
        cmd.arg("-u");
        if lazy {
            cmd.arg("-z");
        }
        let status = cmd.arg(mount_point).status().map_err(Errno::from)?;
        if status.success() {
            Ok(())
        } else {
            Err(Errno(libc::EBUSY))
        }
    }
}
