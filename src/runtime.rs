//! The daemon's runtime directory: where a running mount keeps what only lives as long as it
//! does (its log, pid file, control socket, and the report of data it had to drop at unmount),
//! off the backing file system, so that a full backing file system cannot silence it.
//!
//! One directory per backing directory: `/run/coalescefs/<escaped path>/` for root (the path
//! escaped as `systemd-escape --path` does: `/srv/data` is `srv-data`), else
//! `$XDG_RUNTIME_DIR/coalescefs/...`, else `/tmp/coalescefs-<uid>/...`. Every command that
//! finds the mount (`umount`, `stats`, `sync`) finds this directory from the backing path.
//!
//! What must survive the daemon (the intent log) is in the state directory (`state.rs`); what
//! must survive the daemon and not the machine (the log's volatile tail) here where this is on
//! tmpfs, else beside it under /dev/shm (`volatile_tail_path`).

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub struct RuntimeDir {
    path: PathBuf,
}

/// `systemd-escape --path`: the path without its outer slashes, `/` as `-`, and every byte
/// that is not an ASCII letter, digit, `:`, `_` or a non-leading `.` as `\xNN`.
pub fn escape_path(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    let trimmed: &[u8] = {
        let start = bytes.iter().position(|&b| b != b'/').unwrap_or(bytes.len());
        let end = bytes.iter().rposition(|&b| b != b'/').map_or(start, |i| i + 1);
        &bytes[start..end]
    };
    if trimmed.is_empty() {
        return "-".to_string();
    }
    let mut out = String::new();
    for (i, &b) in trimmed.iter().enumerate() {
        match b {
            b'/' => out.push('-'),
            b'.' if i > 0 => out.push('.'),
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b':' | b'_' => out.push(b as char),
            other => out.push_str(&format!("\\x{other:02x}")),
        }
    }
    out
}

/// The path `escape_path` made `name` from; None for a name it cannot have made.
pub fn unescape_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    if name == "-" {
        return Some(PathBuf::from("/"));
    }
    let mut bytes = vec![b'/'];
    let mut rest = name.as_bytes();
    while let Some((&b, after)) = rest.split_first() {
        match b {
            b'-' => bytes.push(b'/'),
            b'\\' => {
                let hex = after.strip_prefix(b"x").filter(|h| h.len() >= 2)?;
                bytes.push(u8::from_str_radix(std::str::from_utf8(&hex[..2]).ok()?, 16).ok()?);
                rest = &hex[2..];
                continue;
            }
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b':' | b'_' | b'.' => bytes.push(b),
            _ => return None,
        }
        rest = after;
    }
    Some(PathBuf::from(std::ffi::OsString::from_vec(bytes)))
}

/// The file system type statfs(2) gives tmpfs.
const TMPFS_MAGIC: libc::c_long = 0x0102_1994;

/// Whether `path` lies on tmpfs: memory, which a power cut empties and a killed daemon does not.
pub fn on_tmpfs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c_path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: an all-zero `statfs` is a valid value of that plain C struct.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `statfs` writes one value of the type its out-pointer has, into a live local
    // borrowed exclusively for the call; the path is NUL-terminated.
    unsafe { libc::statfs(c_path.as_ptr(), &raw mut fs) == 0 && fs.f_type as libc::c_long == TMPFS_MAGIC }
}

/// Where the intent log of the mount of `backing` keeps its volatile tail
/// (`engine::intent_log::volatile_tail`), which must be on a file system a power cut empties:
/// the runtime directory (made already) where that is on tmpfs (`/run` on most systems), else
/// `shm_dir_of(backing)` (made here, only the daemon's user's). None where neither is tmpfs:
/// a held file's rename or unlink is then a log batch of its own.
pub fn volatile_tail_path(runtime: &RuntimeDir, backing: &Path) -> Option<PathBuf> {
    use crate::engine::intent_log::volatile_tail::VOLATILE_TAIL_FILE_NAME;
    if on_tmpfs(runtime.path()) {
        return Some(runtime.path().join(VOLATILE_TAIL_FILE_NAME));
    }
    let dir = shm_dir_of(backing);
    let base = dir.parent()?;
    if !on_tmpfs(base.parent()?) {
        return None;
    }
    for made in [base, dir.as_path()] {
        match std::fs::DirBuilder::new().mode(0o700).create(made) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                log::warn!("{}: {e}; held files' renames are each a log batch", made.display());
                return None;
            }
        }
        // /dev/shm is everyone's: a directory somebody else made (or a link) is not used.
        let ours = std::fs::symlink_metadata(made).is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt;
            // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
            m.is_dir() && m.uid() == unsafe { libc::geteuid() } && m.mode() & 0o077 == 0
        });
        if !ours {
            log::warn!(
                "{} is not a directory of this user's alone: held files' renames are each a log batch",
                made.display()
            );
            return None;
        }
    }
    Some(dir.join(VOLATILE_TAIL_FILE_NAME))
}

/// The directory under `/dev/shm` that keeps the volatile tail of the mount of `backing` where
/// the runtime directory is not on tmpfs (`volatile_tail_path`); `coalescefs forget` removes it.
pub fn shm_dir_of(backing: &Path) -> PathBuf {
    shm_base_dir().join(escape_path(backing))
}

/// Where the `/dev/shm` directories of `shm_dir_of` are, one per backing directory, as the
/// runtime directories are under `base_dir`.
pub fn shm_base_dir() -> PathBuf {
    // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
    PathBuf::from(format!("/dev/shm/coalescefs-{}", unsafe { libc::geteuid() }))
}

/// Where the runtime directories are, one per backing directory.
pub fn base_dir() -> PathBuf {
    base()
}

fn base() -> PathBuf {
    // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/run/coalescefs");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("coalescefs"),
        // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
        _ => PathBuf::from(format!("/tmp/coalescefs-{}", unsafe { libc::geteuid() })),
    }
}

impl RuntimeDir {
    /// A runtime directory found by its path (`orphans`).
    pub fn at(path: PathBuf) -> RuntimeDir {
        RuntimeDir { path }
    }

    /// The runtime directory of the mount of `backing` (a canonical path).
    pub fn of(backing: &Path) -> RuntimeDir {
        RuntimeDir { path: base().join(escape_path(backing)) }
    }

    /// Creates the directory, readable only by the daemon's user.
    pub fn create(&self) -> std::io::Result<()> {
        if let Some(parent) = self.path.parent() {
            std::fs::DirBuilder::new().recursive(true).mode(0o755).create(parent)?;
        }
        match std::fs::DirBuilder::new().mode(0o700).create(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(0o700))
            }
            Err(e) => Err(e),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn log_path(&self) -> PathBuf {
        self.path.join("daemon.log")
    }

    pub fn pid_path(&self) -> PathBuf {
        self.path.join("pid")
    }

    pub fn socket_path(&self) -> PathBuf {
        self.path.join("control.sock")
    }

    /// What the last daemon could not write before it exited, for `coalescefs umount` to say.
    pub fn unmount_report_path(&self) -> PathBuf {
        self.path.join("unmount-report")
    }

    /// The pid file, mode 0644: anyone may see which process serves the mount, and
    /// `kill $(cat pid)` signals it. The process's start time goes to a file beside it
    /// (`pid.start`), written first, so that a daemon that died without removing them is not
    /// taken for whatever process has its id since.
    pub fn write_pid(&self) -> std::io::Result<()> {
        let pid = std::process::id() as i32;
        match crate::mounts::process_start_time(pid) {
            Some(started) => self.write_replacing(&self.start_time_path(), &format!("{started}\n"))?,
            None => {
                let _ = std::fs::remove_file(self.start_time_path());
            }
        }
        self.write_replacing(&self.pid_path(), &format!("{pid}\n"))
    }

    fn start_time_path(&self) -> PathBuf {
        self.path.join("pid.start")
    }

    fn write_replacing(&self, path: &Path, text: &str) -> std::io::Result<()> {
        let tmp = self.path.join("pid.tmp");
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
        std::io::Write::write_all(&mut file, text.as_bytes())?;
        std::fs::rename(tmp, path)
    }

    /// The daemon's process id, if the process with that id is the one that wrote the file
    /// (same start time; a pid file without one, or with the start time after the id as older
    /// daemons wrote it, is read too).
    pub fn read_pid(&self) -> Option<i32> {
        let pid = std::fs::read_to_string(self.pid_path()).ok()?;
        let started = std::fs::read_to_string(self.start_time_path()).ok();
        parse_pid_file(&pid, started.as_deref(), crate::mounts::process_start_time)
    }

    /// At a clean exit: the pid file and the socket go; the log and the report stay.
    pub fn remove_runtime_files(&self) {
        let _ = std::fs::remove_file(self.pid_path());
        let _ = std::fs::remove_file(self.start_time_path());
        let _ = std::fs::remove_file(self.socket_path());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_escaped_path_is_unescaped_to_itself() {
        for path in ["/", "/srv/data", "/tmp/coalescefs-test-ab.c/backing", "/a b/ü/.hidden/x:y_z"] {
            assert_eq!(unescape_path(&escape_path(Path::new(path))), Some(PathBuf::from(path)), "{path}");
        }
        assert_eq!(unescape_path("bad name"), None);
        assert_eq!(unescape_path("trailing\\x4"), None);
    }

    #[test]
    fn paths_are_escaped_as_systemd_escape_does() {
        assert_eq!(escape_path(Path::new("/srv/data")), "srv-data");
        assert_eq!(escape_path(Path::new("/srv/my-data/")), "srv-my\\x2ddata");
        assert_eq!(escape_path(Path::new("/tmp/a b/.hidden")), "tmp-a\\x20b-.hidden");
        assert_eq!(escape_path(Path::new("/")), "-");
    }
}

/// A pid file's process id, checked against `start_time_of` (see `RuntimeDir::read_pid`).
fn parse_pid_file(pid_text: &str, start_text: Option<&str>, start_time_of: impl Fn(i32) -> Option<u64>) -> Option<i32> {
    let mut words = pid_text.split_whitespace();
    let pid: i32 = words.next()?.parse().ok()?;
    match words.next().or_else(|| start_text.and_then(|t| t.split_whitespace().next())) {
        Some(started) => (start_time_of(pid)? == started.parse::<u64>().ok()?).then_some(pid),
        None => Some(pid),
    }
}

#[cfg(test)]
mod pid_file_tests {
    use super::parse_pid_file;

    #[test]
    fn a_pid_file_names_its_process_only_while_the_start_time_matches() {
        let running = |pid: i32| (pid == 42).then_some(1000);
        assert_eq!(parse_pid_file("42\n", Some("1000\n"), running), Some(42));
        assert_eq!(parse_pid_file("42\n", Some("999\n"), running), None, "the id was given to another process since");
        assert_eq!(parse_pid_file("43\n", Some("1000\n"), running), None, "no such process");
        assert_eq!(parse_pid_file("42 1000\n", None, running), Some(42), "an older daemon's file");
        assert_eq!(parse_pid_file("42 999\n", None, running), None);
        assert_eq!(parse_pid_file("42\n", None, running), Some(42), "without a start time");
        assert_eq!(parse_pid_file("", None, running), None);
    }

    #[test]
    fn the_pid_file_holds_one_number_and_names_this_process() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = super::RuntimeDir::at(dir.path().to_path_buf());
        runtime.write_pid().unwrap();
        let me = std::process::id() as i32;
        assert_eq!(std::fs::read_to_string(runtime.pid_path()).unwrap(), format!("{me}\n"), "kill $(cat pid) works");
        assert_eq!(runtime.read_pid(), Some(me));
        std::fs::write(runtime.start_time_path(), "1\n").unwrap();
        assert_eq!(runtime.read_pid(), None, "another process with this id");
    }
}
