//! The daemon's state directory: what must outlive the daemon (the intent log's file, and the
//! lock that keeps a second daemon off the same state), kept off the backing directory.
//!
//! Made only when the log is on (a mount without it keeps no state: the lock that keeps a
//! second daemon out is taken on the backing directory itself). Where: `-o state=DIR`; else `/var/lib/coalescefs/<escaped backing path>/` for root (escaped
//! as `systemd-escape --path` does), `${XDG_STATE_HOME:-~/.local/state}/coalescefs/...` for
//! anyone else. A backing directory that already has the folder `.coalescefs` (where earlier
//! versions kept the state) keeps using it, and the mount keeps hiding it. Inside the backing
//! directory the folder cost every new file an inode-table block of its own: ext4 places a new
//! file's inode near its directory's, and the state folder took the first inodes after the
//! root's, so the files of the root landed one block further on.
//!
//! Because the log can live apart from the data it protects, the backing directory records
//! which log it needs: while a mount with the log runs, and after it dies, the root of the
//! backing directory carries the extended attribute `user.coalescefs.log` with the log file's
//! path; a clean unmount (the log empty) removes it. A mount that would not replay that log
//! (the log off, another state directory, the file gone) is refused with what to do, instead of
//! serving files whose fsynced bytes are still only in the log.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::runtime::escape_path;
use crate::sys::{self, Errno};

/// The state folder's name inside a backing directory, where earlier versions kept it.
pub const LEGACY_NAME: &str = ".coalescefs";
/// The extended attribute of the backing root that names the log a crash left to replay.
pub const LOG_MARKER_XATTR: &str = "user.coalescefs.log";

/// The intent log's file in the state directory; the engine owns the name (it also names the
/// replay map of a log on a block device after it).
pub use crate::engine::intent_log::LOG_FILE_NAME;
/// The local backend's list of its files made ahead (`backend::local::prepared`).
const MADE_AHEAD_LIST_NAME: &str = "made-ahead";
/// Locked by the daemon that uses the state directory.
pub const LOCK_FILE_NAME: &str = "lock";

pub struct StateDir {
    path: PathBuf,
    /// Set when the state folder is the legacy one in the backing directory.
    hidden_name: Option<OsString>,
    /// Held as long as the daemon runs: the kernel drops both locks when it ends, even by kill -9.
    _state_lock: Option<File>,
    /// None for a source that is not a path here (an S3 bucket): the state directory's own
    /// lock keeps a second daemon off it, the bucket's lease a second machine.
    _backing_lock: Option<File>,
}

/// Where the state of `backing` goes when no `state=` is given (and no legacy folder exists).
pub fn default_path(backing: &Path) -> PathBuf {
    default_base().join(escape_path(backing))
}

/// Where the default state directories are, one per backing directory.
pub fn default_base() -> PathBuf {
    // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
    if unsafe { libc::geteuid() } == 0 {
        PathBuf::from("/var/lib/coalescefs")
    } else {
        match std::env::var_os("XDG_STATE_HOME") {
            Some(dir) if Path::new(&dir).is_absolute() => PathBuf::from(dir).join("coalescefs"),
            _ => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/".into())).join(".local/state/coalescefs"),
        }
    }
}

impl StateDir {
    /// Locks the backing directory (a canonical path) and finds its state directory, making
    /// nothing yet (see `make`).
    pub fn find(backing: &Path, explicit: Option<&Path>) -> Result<StateDir, String> {
        let backing_lock = lock_backing(backing)?;
        let legacy = backing.join(LEGACY_NAME);
        let (path, hidden_name) = match explicit {
            Some(path) => {
                let path = absolute_state_path(path)?;
                if path.starts_with(backing) {
                    return Err(format!(
                        "state={}: inside the backing directory {}, where the mount would show it; give a directory outside it",
                        path.display(),
                        backing.display()
                    ));
                }
                (path, None)
            }
            None if std::fs::symlink_metadata(&legacy).is_ok() => (legacy, Some(OsString::from(LEGACY_NAME))),
            None => (default_path(backing), None),
        };
        Ok(StateDir { path, hidden_name, _state_lock: None, _backing_lock: Some(backing_lock) })
    }

    /// The state directory of a source that is not a path on this machine (`key`, an S3
    /// source's `s3://BUCKET/PREFIX`): `explicit`, else the default one keyed by it. The
    /// source's runtime directory (made already) is locked in the backing directory's stead:
    /// a second mount of the source on this machine would share it, and is refused before it
    /// touches it.
    pub fn find_for_remote(key: &Path, runtime: &Path, explicit: Option<&Path>) -> Result<StateDir, String> {
        let lock = File::open(runtime).map_err(|e| format!("runtime directory {}: {e}", runtime.display()))?;
        let runtime_dir = crate::runtime::RuntimeDir::at(runtime.to_path_buf());
        if !lock_exclusive_once_holder_gone(&lock, || runtime_dir.read_pid()) {
            let holder = where_mounted(key, runtime_dir.read_pid());
            return Err(format!("{} is already mounted by another coalescefs on this machine{holder}", key.display()));
        }
        let path = match explicit {
            Some(path) => absolute_state_path(path)?,
            None => default_path(key),
        };
        Ok(StateDir { path, hidden_name: None, _state_lock: None, _backing_lock: Some(lock) })
    }

    /// When `needed` (the log is on) or it is the legacy folder: makes the directory (unless
    /// `read_only`) and locks it. A mount without the log keeps no state, and nothing is made.
    pub fn make(&mut self, read_only: bool, needed: bool) -> Result<(), String> {
        if !needed && self.hidden_name.is_none() {
            return Ok(());
        }
        self._state_lock = match make_and_lock(&self.path, self.hidden_name.is_some(), read_only) {
            Ok(lock) => lock,
            Err(e) if read_only => {
                log::warn!("no state directory for a read-only mount ({e}); mounting without one");
                None
            }
            Err(e) => return Err(e),
        };
        Ok(())
    }

    /// Locks the state directory if it exists, as a mount does, for a command that works on it
    /// unmounted (`recover`, `forget`): another backing directory's mount may use it.
    pub fn lock_if_present(&mut self) -> Result<(), String> {
        if self.path.is_dir() {
            self.make(false, true)?;
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The intent log's file, unless `log=PATH` puts it elsewhere.
    pub fn log_path(&self) -> PathBuf {
        self.path.join(LOG_FILE_NAME)
    }

    /// The list of files the local backend made ahead, while the log is on.
    pub fn made_ahead_list_path(&self) -> PathBuf {
        self.path.join(MADE_AHEAD_LIST_NAME)
    }

    /// The name in the backing root the mount must hide: the legacy state folder's.
    pub fn hidden_name(&self) -> Option<&OsStr> {
        self.hidden_name.as_deref()
    }
}

fn absolute_state_path(path: &Path) -> Result<PathBuf, String> {
    if !path.is_absolute() {
        return Err(format!("state={}: expected an absolute path", path.display()));
    }
    // The directory itself may not exist yet; its parent must.
    match std::fs::canonicalize(path) {
        Ok(canonical) => Ok(canonical),
        Err(_) => {
            let parent = path.parent().ok_or_else(|| format!("state={}: no parent directory", path.display()))?;
            let parent = std::fs::canonicalize(parent).map_err(|e| format!("state={}: {e}", path.display()))?;
            Ok(parent.join(path.file_name().unwrap_or_default()))
        }
    }
}

/// Removes what a mount keeps in the state directory `path` (its log, the log's replay map, the
/// list of files made ahead, the lock), for `coalescefs forget`; the caller holds the
/// directory's lock. Anything else stays.
/// `forget`'s check of a log it would remove: None when `log` holds nothing a mount would
/// replay into `store` (a backing directory, a database, an S3 source, as said), else why the
/// forget is refused (it goes on only with --discard).
pub fn unreplayed_in_log(log: &Path, state_dir: &Path, store: &str) -> Option<String> {
    match crate::engine::intent_log::batches_to_replay_in_file(log, state_dir) {
        Ok(0) => None,
        Ok(n) => Some(format!(
            "{} holds {n} {} {store} does not have yet: mount it once (the mount replays them) or run \
             `coalescefs recover`, or give --discard to lose them",
            log.display(),
            if n == 1 { "batch" } else { "batches" },
        )),
        Err(e) => Some(format!(
            "{}: {e}; `coalescefs recover` applies what can be read, or give --discard to lose it",
            log.display()
        )),
    }
}

pub fn remove_state_files(path: &Path) -> Result<(), String> {
    let log = path.join(LOG_FILE_NAME);
    // A daemon that died writing the log's blocks on its device left it immutable.
    crate::engine::intent_log::raw::clear_immutable(&log)
        .map_err(|e| format!("clearing the immutable flag of {}: {e}", log.display()))?;
    let made_ahead = path.join(MADE_AHEAD_LIST_NAME);
    for file in [crate::engine::intent_log::device::replay_map_path(&log), log, made_ahead, path.join(LOCK_FILE_NAME)] {
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("removing {}: {e}", file.display())),
        }
    }
    Ok(())
}

/// Makes the state directory (mode 0700; a symlink in its place is refused, not followed) and
/// takes its lock, so that two backing directories never share one log.
fn make_and_lock(path: &Path, inside_backing: bool, read_only: bool) -> Result<Option<File>, String> {
    let shown = path.display();
    if !read_only {
        let mut builder = std::fs::DirBuilder::new();
        // The default's parents (/var/lib/coalescefs) are made too; inside the backing
        // directory only the folder itself.
        builder.recursive(!inside_backing).mode(0o700);
        match builder.create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot create the state directory {shown}: {e}")),
        }
    }
    let meta = std::fs::symlink_metadata(path).map_err(|e| format!("state directory {shown}: {e}"))?;
    if !meta.is_dir() {
        return Err(format!("state directory {shown} is not a directory"));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(!read_only)
        .create(!read_only)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path.join(LOCK_FILE_NAME))
        .map_err(|e| format!("cannot open the lock file in the state directory {shown}: {e}"))?;
    // The backing directory's lock is ours already: a daemon of the same directory killed a
    // moment ago may still be letting go of this one, as of that (no pid is known here, so a
    // mount of another directory that shares the state directory is refused after the wait).
    if !lock_exclusive_once_holder_gone(&file, || None) {
        return Err(format!(
            "state directory {shown} is in use by another coalescefs (a mount of another backing directory?)"
        ));
    }
    Ok(Some(file))
}

/// How long a mount waits for the lock of a daemon that has finished but whose lock the kernel
/// has not yet let go: a daemon killed a moment ago (kill -9, then a remount at once) is a
/// zombie before its last file is released in some exits (the final `fput` of a file an exiting
/// thread's task work could no longer take is left to a kernel worker).
const EXITED_HOLDER_WAIT: Duration = Duration::from_secs(5);

/// Takes `file`'s exclusive flock without blocking on a live holder: while the lock is taken
/// and `holder` (the pid file) names no running daemon, waits up to [`EXITED_HOLDER_WAIT`] for
/// the kernel to release it. False when it stays taken, at once when the holder runs. (A
/// daemon starting has the lock before its pid file: a second mount waits until it appears.)
fn lock_exclusive_once_holder_gone(file: &File, holder: impl Fn() -> Option<i32>) -> bool {
    let try_lock = || {
        // SAFETY: `flock` takes only integers (a descriptor and plain values) and touches none of
        // our memory; a bad descriptor is an error return.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    };
    if try_lock() {
        return true;
    }
    let deadline = Instant::now() + EXITED_HOLDER_WAIT;
    while !holder().is_some_and(crate::mounts::process_alive) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        if try_lock() {
            log::info!("took the lock a daemon that had ended was still holding a moment ago");
            return true;
        }
    }
    false
}

/// " at MOUNTPOINT (pid N)" for a refusal's message: where `source` is mounted by coalescefs
/// and which daemon holds it, each part left out where it is not known.
fn where_mounted(source: &Path, holder: Option<i32>) -> String {
    let place = crate::mounts::read_mounts()
        .into_iter()
        .find(|m| m.fs_type == crate::mounts::FS_TYPE && Path::new(&m.source) == source)
        .map(|m| format!(" at {}", m.mount_point.display()))
        .unwrap_or_default();
    let holder = holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default();
    format!("{place}{holder}")
}

/// The backing directory itself is locked (flock on the directory): a second daemon on it is
/// refused whichever state directory it was given.
fn lock_backing(backing: &Path) -> Result<File, String> {
    let dir = File::open(backing).map_err(|e| format!("backing directory {}: {e}", backing.display()))?;
    let runtime_dir = crate::runtime::RuntimeDir::of(backing);
    if !lock_exclusive_once_holder_gone(&dir, || runtime_dir.read_pid()) {
        let holder = where_mounted(backing, runtime_dir.read_pid());
        return Err(format!(
            "backing directory {} is already mounted by another coalescefs{holder}",
            backing.display()
        ));
    }
    Ok(dir)
}

/// The log the backing directory says a crash left to replay, if any.
pub fn log_marker(backing: &Path) -> Result<Option<PathBuf>, String> {
    let path = sys::path_cstring(backing).map_err(|e| format!("{}: {e}", backing.display()))?;
    let name = std::ffi::CString::new(LOG_MARKER_XATTR).expect("constant has no NUL");
    let mut buf = vec![0u8; 4096];
    // SAFETY: `lgetxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return match Errno::last() {
            Errno(libc::ENODATA | libc::ENOTSUP) => Ok(None),
            e => Err(format!("reading {LOG_MARKER_XATTR} of {}: {e}", backing.display())),
        };
    }
    buf.truncate(n as usize);
    Ok(Some(PathBuf::from(OsStr::from_bytes(&buf))))
}

/// Refuses a mount that would leave a crash's log unreplayed: `log` is the log this mount
/// replays (None: the log is off).
/// Whether two paths name one file, however written (relative, through links, `..`): the
/// marker holds the log's path as the mount that wrote it spelled it.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => a == b,
    }
}

pub fn check_log_marker(backing: &Path, log: Option<&Path>) -> Result<(), String> {
    let Some(needed) = log_marker(backing)? else { return Ok(()) };
    if log.is_some_and(|log| same_file(log, &needed)) && needed.exists() {
        return Ok(());
    }
    let why = match log {
        _ if !needed.exists() => format!("and that file is gone ({LOG_MARKER_XATTR} names it)"),
        None => "and this mount has the log off".to_string(),
        Some(other) => format!("and this mount's log is {}", other.display()),
    };
    let options = match (needed.parent(), needed.file_name()) {
        (Some(dir), Some(name)) if name == LOG_FILE_NAME => format!("-o log=on,state={}", dir.display()),
        _ => format!("-o log={}", needed.display()),
    };
    Err(format!(
        "{} was not unmounted cleanly with its intent log at {}, {why}: mount it with that log ({options}), or run \
         `coalescefs recover {} --log {}`. If that log is lost for good, its fsynced bytes are too; \
         `setfattr -x {LOG_MARKER_XATTR} {}` lets the directory mount without it",
        backing.display(),
        needed.display(),
        backing.display(),
        needed.display(),
        backing.display()
    ))
}

/// Records that `backing` needs the log at `log` after a crash. A file system without user
/// extended attributes cannot keep the record: the mount goes on, said once in the log.
pub fn set_log_marker(backing: &Path, log: &Path) -> Result<(), String> {
    let path = sys::path_cstring(backing).map_err(|e| format!("{}: {e}", backing.display()))?;
    let name = std::ffi::CString::new(LOG_MARKER_XATTR).expect("constant has no NUL");
    let value = log.as_os_str().as_bytes();
    // SAFETY: `lsetxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live slice passed with its own length, which the kernel only reads.
    let ret = unsafe { libc::lsetxattr(path.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if ret != 0 {
        return match Errno::last() {
            Errno(libc::ENOTSUP) => {
                log::warn!(
                    "{} has no user extended attributes: it cannot record that it needs the intent log {} after a \
                     crash; mount it with the same log= and state= options every time",
                    backing.display(),
                    log.display()
                );
                Ok(())
            }
            e => Err(format!("recording the intent log in {LOG_MARKER_XATTR} of {}: {e}", backing.display())),
        };
    }
    Ok(())
}

/// After a clean unmount or a recovery: no log holds anything the directory needs.
pub fn clear_log_marker(backing: &Path) -> Result<(), String> {
    let path = sys::path_cstring(backing).map_err(|e| format!("{}: {e}", backing.display()))?;
    let name = std::ffi::CString::new(LOG_MARKER_XATTR).expect("constant has no NUL");
    // SAFETY: `lremovexattr` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    if unsafe { libc::lremovexattr(path.as_ptr(), name.as_ptr()) } != 0 {
        return match Errno::last() {
            Errno(libc::ENODATA | libc::ENOTSUP) => Ok(()),
            e => Err(format!("removing {LOG_MARKER_XATTR} of {}: {e}", backing.display())),
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locked_pair() -> (tempfile::TempDir, File, File) {
        let dir = tempfile::tempdir().unwrap();
        let holder = File::open(dir.path()).unwrap();
        // SAFETY: `flock` takes only integers; the descriptor is live.
        assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        let second = File::open(dir.path()).unwrap();
        (dir, holder, second)
    }

    #[test]
    fn a_lock_whose_holder_runs_is_refused_without_waiting_for_it() {
        let (_dir, _holder, second) = locked_pair();
        let me = std::process::id() as i32;
        assert!(!lock_exclusive_once_holder_gone(&second, || Some(me)));
    }

    #[test]
    fn a_lock_no_running_daemon_holds_is_taken_once_the_kernel_lets_it_go() {
        let (_dir, holder, second) = locked_pair();
        let released = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(holder);
        });
        // The pid file names a daemon that is gone (no process has pid i32::MAX), as after kill -9.
        assert!(lock_exclusive_once_holder_gone(&second, || Some(i32::MAX)));
        released.join().unwrap();
    }

    #[test]
    fn a_lock_that_stays_taken_is_refused_after_the_wait() {
        let (_dir, _holder, second) = locked_pair();
        assert!(!lock_exclusive_once_holder_gone(&second, || None));
    }
}
