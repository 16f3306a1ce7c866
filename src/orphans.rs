//! State, runtime and volatile tail directories whose backing directory is gone (`coalescefs
//! forget --orphans`): each holds what nothing else would ever remove, a 64 MiB intent log, a
//! daemon's log, or a killed daemon's volatile tail in `/dev/shm`. Found by name: a
//! directory's name is its backing directory's path, escaped (`runtime::escape_path`), so the
//! backing directory it served is known without reading it.
//! A state directory named by `state=DIR` is not under the default base and is not found.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::engine::intent_log;
use crate::{runtime, state};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The intent log and what goes with it (`state.rs`).
    State,
    /// The daemon's log, its socket and pid file (`runtime.rs`).
    Runtime,
    /// The volatile tail's directory in `/dev/shm` (`runtime::shm_dir_of`), where the runtime
    /// directory is not on tmpfs: left by a killed daemon.
    VolatileTail,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::State => "state",
            Kind::Runtime => "runtime",
            Kind::VolatileTail => "volatile tail",
        }
    }
}

pub struct Orphan {
    pub kind: Kind,
    pub dir: PathBuf,
    /// The backing directory it served, which is gone.
    pub backing: PathBuf,
    /// The space its files take (their allocated blocks).
    pub bytes: u64,
}

/// Every state, runtime and volatile tail directory under the default bases whose backing
/// directory is gone, in that order (a tail is removed only once its state directory is).
pub fn find() -> Vec<Orphan> {
    let mut found = Vec::new();
    let bases = [
        (Kind::State, state::default_base()),
        (Kind::Runtime, runtime::base_dir()),
        (Kind::VolatileTail, runtime::shm_base_dir()),
    ];
    for (kind, base) in bases {
        let Ok(entries) = std::fs::read_dir(&base) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name();
            // An S3 source's directories hold its namespace database: its bucket is not a path.
            if name.to_str().is_some_and(crate::backend::source::is_s3_key_name) {
                continue;
            }
            let Some(backing) = name.to_str().and_then(runtime::unescape_path) else { continue };
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            // Gone, not merely unreadable: any answer but ENOENT keeps it.
            let gone =
                matches!(std::fs::symlink_metadata(&backing), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
            if is_dir && gone {
                let dir = entry.path();
                found.push(Orphan { kind, bytes: allocated_bytes(&dir), dir, backing });
            }
        }
    }
    found
}

fn allocated_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.blocks() * 512).sum()
}

/// Refuses to remove `shown` while the daemon whose pid its runtime directory records is alive.
fn refuse_while_its_daemon_runs(runtime_dir: &Path, shown: &Path) -> Result<(), String> {
    if runtime::RuntimeDir::at(runtime_dir.to_path_buf()).read_pid().is_some_and(crate::mounts::process_alive) {
        return Err(format!("{}: its daemon is still running", shown.display()));
    }
    Ok(())
}

/// Removes an orphan: refused while a daemon uses it (its lock held, its pid alive), and for a
/// state directory whose log holds batches never replayed unless `discard` (its backing
/// directory is gone: they can never be, but they are the last copy of fsynced writes).
pub fn remove(orphan: &Orphan, discard: bool) -> Result<(), String> {
    let dir = &orphan.dir;
    match orphan.kind {
        Kind::State => {
            let lock_path = dir.join(state::LOCK_FILE_NAME);
            let _lock = match std::fs::File::open(&lock_path) {
                Ok(lock) => {
                    // SAFETY: flock takes no pointers; the descriptor is open for the call.
                    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                        return Err(format!("{}: in use by a running coalescefs", dir.display()));
                    }
                    Some(lock)
                }
                Err(_) => None,
            };
            let log = dir.join(state::LOG_FILE_NAME);
            if log.exists() && !discard {
                let held = intent_log::batches_to_replay_in_file(&log, dir);
                match held {
                    Ok(0) => {}
                    Ok(n) => {
                        return Err(format!(
                            "{} holds {n} batches never replayed (the last copy of fsynced writes to {}): \
                             give --discard to lose them",
                            log.display(),
                            orphan.backing.display()
                        ))
                    }
                    Err(e) => return Err(format!("{}: {e}; give --discard to remove it anyway", log.display())),
                }
            }
            state::remove_state_files(dir)?;
            std::fs::remove_dir(dir).map_err(|e| format!("removing {}: {e}", dir.display()))
        }
        Kind::Runtime => {
            refuse_while_its_daemon_runs(dir, dir)?;
            std::fs::remove_dir_all(dir).map_err(|e| format!("removing {}: {e}", dir.display()))
        }
        Kind::VolatileTail => {
            // The tail holds name changes for the log's next batch: it goes with the log.
            let name = dir.file_name().ok_or_else(|| format!("{}: no name", dir.display()))?;
            let state_dir = state::default_base().join(name);
            if state_dir.exists() {
                return Err(format!("kept with the state directory {} (its log's next batch)", state_dir.display()));
            }
            refuse_while_its_daemon_runs(&runtime::base_dir().join(name), dir)?;
            std::fs::remove_dir_all(dir).map_err(|e| format!("removing {}: {e}", dir.display()))
        }
    }
}
