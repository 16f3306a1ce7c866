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
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/run/coalescefs");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("coalescefs"),
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

    /// The pid file, mode 0644: anyone may see which process serves the mount.
    pub fn write_pid(&self) -> std::io::Result<()> {
        let path = self.pid_path();
        let tmp = self.path.join("pid.tmp");
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
        std::io::Write::write_all(&mut file, format!("{}\n", std::process::id()).as_bytes())?;
        std::fs::rename(tmp, path)
    }

    pub fn read_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.pid_path()).ok()?.trim().parse().ok()
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
