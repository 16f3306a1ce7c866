//! The daemon's runtime directory: where a running mount keeps what only lives as long as it
//! does (its log, pid file, control socket, and the report of data it had to drop at unmount),
//! off the backing file system, so that a full backing file system cannot silence it.
//!
//! One directory per backing directory: `/run/coalescefs/<escaped path>/` for root (the path
//! escaped as `systemd-escape --path` does: `/srv/data` is `srv-data`), else
//! `$XDG_RUNTIME_DIR/coalescefs/...`, else `/tmp/coalescefs-<uid>/...`. Every command that
//! finds the mount (`umount`, `stats`, `sync`) finds this directory from the backing path.
//!
//! What must survive the daemon (the intent log) is in the state directory (`state.rs`).

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

    /// The pid file, mode 0644: anyone may see which process serves the mount. The process's
    /// start time follows its id, so that a daemon that died without removing the file is not
    /// taken for whatever process has its id since.
    pub fn write_pid(&self) -> std::io::Result<()> {
        let path = self.pid_path();
        let tmp = self.path.join("pid.tmp");
        let pid = std::process::id() as i32;
        let line = match crate::mounts::process_start_time(pid) {
            Some(started) => format!("{pid} {started}\n"),
            None => format!("{pid}\n"),
        };
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
        std::io::Write::write_all(&mut file, line.as_bytes())?;
        std::fs::rename(tmp, path)
    }

    /// The daemon's process id, if the process with that id is the one that wrote the file
    /// (same start time; a file without one, from an older daemon, is taken at its word).
    pub fn read_pid(&self) -> Option<i32> {
        parse_pid_file(&std::fs::read_to_string(self.pid_path()).ok()?, crate::mounts::process_start_time)
    }

    /// At a clean exit: the pid file and the socket go; the log and the report stay.
    pub fn remove_runtime_files(&self) {
        let _ = std::fs::remove_file(self.pid_path());
        let _ = std::fs::remove_file(self.socket_path());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_escaped_as_systemd_escape_does() {
        assert_eq!(escape_path(Path::new("/srv/data")), "srv-data");
        assert_eq!(escape_path(Path::new("/srv/my-data/")), "srv-my\\x2ddata");
        assert_eq!(escape_path(Path::new("/tmp/a b/.hidden")), "tmp-a\\x20b-.hidden");
        assert_eq!(escape_path(Path::new("/")), "-");
    }
}

/// A pid file's process id, checked against `start_time_of` (see `RuntimeDir::read_pid`).
fn parse_pid_file(text: &str, start_time_of: impl Fn(i32) -> Option<u64>) -> Option<i32> {
    let mut words = text.split_whitespace();
    let pid: i32 = words.next()?.parse().ok()?;
    match words.next() {
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
        assert_eq!(parse_pid_file("42 1000\n", running), Some(42));
        assert_eq!(parse_pid_file("42 999\n", running), None, "the id was given to another process since");
        assert_eq!(parse_pid_file("43 1000\n", running), None, "no such process");
        assert_eq!(parse_pid_file("42\n", running), Some(42), "an older daemon's file");
        assert_eq!(parse_pid_file("", running), None);
        let me = std::process::id() as i32;
        let started = crate::mounts::process_start_time(me).expect("this process's start time");
        assert_eq!(parse_pid_file(&format!("{me} {started}"), crate::mounts::process_start_time), Some(me));
    }
}
