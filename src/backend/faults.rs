//! Fault injection at the backend boundary, for tests: a plan of rules that make the
//! backend's writes, syncs, reads or creates fail with an errno (EIO, ENOSPC, EDQUOT, ...) or
//! stall, a number of times or until cleared, optionally only for files whose backing path
//! contains a given text.
//!
//! Off unless the daemon starts with `COALESCEFS_FAULTS` set (its value is the first rules;
//! empty for none): then `coalescefs` accepts `inject ...` and `clear` on the control socket,
//! so a test can fail the backend, watch the mount, and let it recover, on a real mount.
//!
//! Rule syntax (also of the environment variable, rules separated by `;`):
//! `OP=ERRNO[*COUNT][/SKIP][@PATH_TEXT]` or `OP=stall:DURATION[*COUNT][/SKIP][@PATH_TEXT]`,
//! where OP is write, sync, read, create, logwrite or logsync, ERRNO a name (EIO, ENOSPC,
//! EDQUOT, EROFS), COUNT how many calls fail (default: until cleared) and SKIP how many
//! matching calls pass first. Example: `write=ENOSPC*3;sync=stall:2s@big`.
//!
//! The intent log's device fails through `FaultyLogDevice`: `logwrite` fails a batch before any
//! of its bytes reach the log (lost), `logsync` after they did (landed: a device that reports
//! EIO on the flush that follows the write).

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::engine::intent_log::device::LogDevice;
use crate::sys::{Errno, SysResult};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    /// A unit (or range) written to a file's backend copy.
    Write,
    /// fsync, fdatasync or syncfs of the backend.
    Sync,
    /// A read of a file's backend bytes.
    Read,
    /// A file, directory, node or link made in the backing directory.
    Create,
    /// A batch written to the intent log's device.
    LogWrite,
    /// The intent log's device synced.
    LogSync,
}

#[derive(Clone, Debug, PartialEq)]
enum Action {
    Fail(Errno),
    Stall(Duration),
}

#[derive(Clone, Debug, PartialEq)]
struct Rule {
    op: FaultOp,
    action: Action,
    /// Calls left to fail; None: until cleared.
    remaining: Option<u64>,
    /// Matching calls still to let pass before failing.
    skip: u64,
    path_contains: Option<String>,
}

pub struct Faults {
    rules: Mutex<Vec<Rule>>,
    /// Signalled when the rules are cleared: a stalled call then returns at once.
    cleared: Condvar,
    generation: Mutex<u64>,
}

fn errno_named(name: &str) -> Option<Errno> {
    Some(Errno(match name {
        "EIO" => libc::EIO,
        "ENOSPC" => libc::ENOSPC,
        "EDQUOT" => libc::EDQUOT,
        "EROFS" => libc::EROFS,
        "EACCES" => libc::EACCES,
        _ => return None,
    }))
}

fn parse_rule(text: &str) -> Result<Rule, String> {
    let (op, rest) = text.split_once('=').ok_or_else(|| format!("'{text}': expected OP=ACTION"))?;
    let op = match op.trim() {
        "write" => FaultOp::Write,
        "sync" => FaultOp::Sync,
        "read" => FaultOp::Read,
        "create" => FaultOp::Create,
        "logwrite" => FaultOp::LogWrite,
        "logsync" => FaultOp::LogSync,
        other => return Err(format!("'{other}': not write, sync, read, create, logwrite or logsync")),
    };
    let (rest, path_contains) = match rest.split_once('@') {
        Some((r, p)) => (r, Some(p.to_string())),
        None => (rest, None),
    };
    let (rest, skip) = match rest.split_once('/') {
        Some((r, n)) => (r, n.trim().parse::<u64>().map_err(|_| format!("'{n}': not a count"))?),
        None => (rest, 0),
    };
    let (action, remaining) = match rest.split_once('*') {
        Some((a, n)) => (a, Some(n.trim().parse::<u64>().map_err(|_| format!("'{n}': not a count"))?)),
        None => (rest, None),
    };
    let action = match action.trim().strip_prefix("stall:") {
        Some(d) => Action::Stall(crate::options::parse_duration(d)?),
        None => Action::Fail(errno_named(action.trim()).ok_or_else(|| format!("'{action}': not an errno this knows"))?),
    };
    Ok(Rule { op, action, remaining, skip, path_contains })
}

impl Default for Faults {
    fn default() -> Self {
        Self::new()
    }
}

impl Faults {
    /// A plan with no rules yet.
    pub fn new() -> Faults {
        Faults { rules: Mutex::new(Vec::new()), cleared: Condvar::new(), generation: Mutex::new(0) }
    }

    /// The plan the daemon starts with: Some when `COALESCEFS_FAULTS` is set.
    pub fn from_env() -> Result<Option<Faults>, String> {
        let Ok(spec) = std::env::var("COALESCEFS_FAULTS") else { return Ok(None) };
        let faults = Faults::new();
        for rule in spec.split(';').filter(|r| !r.trim().is_empty()) {
            faults.add(rule)?;
        }
        Ok(Some(faults))
    }

    fn add(&self, text: &str) -> Result<(), String> {
        let rule = parse_rule(text)?;
        self.rules.lock().unwrap_or_else(|p| p.into_inner()).push(rule);
        Ok(())
    }

    /// A control socket request: `inject RULE` or `clear`.
    pub fn control(&self, request: &str) -> Result<(), String> {
        match request.split_once(' ') {
            Some(("inject", rule)) => self.add(rule.trim()),
            None if request == "clear" => {
                self.rules.lock().unwrap_or_else(|p| p.into_inner()).clear();
                *self.generation.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                self.cleared.notify_all();
                Ok(())
            }
            _ => Err(format!("'{request}': expected 'inject RULE' or 'clear'")),
        }
    }

    /// Called by the backend before `op` on the file at `path` (None: not a file's call).
    pub fn check(&self, op: FaultOp, path: Option<&Path>) -> SysResult<()> {
        let action = {
            let mut rules = self.rules.lock().unwrap_or_else(|p| p.into_inner());
            let matching = rules.iter_mut().find(|r| {
                r.op == op
                    && r.remaining != Some(0)
                    && r.path_contains.as_ref().is_none_or(|p| path.is_some_and(|path| path.to_string_lossy().contains(p.as_str())))
            });
            let Some(rule) = matching else { return Ok(()) };
            if rule.skip > 0 {
                rule.skip -= 1;
                return Ok(());
            }
            if let Some(n) = &mut rule.remaining {
                *n -= 1;
            }
            rule.action.clone()
        };
        match action {
            Action::Fail(errno) => Err(errno),
            Action::Stall(duration) => {
                let deadline = Instant::now() + duration;
                let mut generation = self.generation.lock().unwrap_or_else(|p| p.into_inner());
                let started = *generation;
                while *generation == started && Instant::now() < deadline {
                    generation = self
                        .cleared
                        .wait_timeout(generation, deadline.saturating_duration_since(Instant::now()))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                Ok(())
            }
        }
    }
}

/// The intent log's device with fault injection (`logwrite`, `logsync`).
pub struct FaultyLogDevice {
    inner: Box<dyn LogDevice>,
    faults: Arc<Faults>,
}

impl FaultyLogDevice {
    pub fn new(inner: Box<dyn LogDevice>, faults: Arc<Faults>) -> FaultyLogDevice {
        FaultyLogDevice { inner, faults }
    }
}

impl LogDevice for FaultyLogDevice {
    fn size_bytes(&self) -> SysResult<u64> {
        self.inner.size_bytes()
    }
    fn write_blocks(&self, block: u64, bytes: &[u8]) -> SysResult<()> {
        self.faults.check(FaultOp::LogWrite, None)?;
        self.inner.write_blocks(block, bytes)
    }
    fn sync(&self) -> SysResult<()> {
        self.inner.sync()?;
        // After the flush: what was written landed, and the caller is told it did not.
        self.faults.check(FaultOp::LogSync, None)
    }
    fn read_all(&self) -> SysResult<Vec<u8>> {
        self.inner.read_all()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn read_map(&self) -> SysResult<Vec<u8>> {
        self.inner.read_map()
    }
    fn append_map_synced(&self, bytes: &[u8]) -> SysResult<()> {
        self.inner.append_map_synced(bytes)
    }
    fn remove_map(&self) -> SysResult<()> {
        self.inner.remove_map()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_count_down_and_match_paths() {
        let f = Faults { rules: Mutex::new(Vec::new()), cleared: Condvar::new(), generation: Mutex::new(0) };
        f.control("inject write=ENOSPC*2@big").unwrap();
        assert_eq!(f.check(FaultOp::Write, Some(Path::new("/b/small"))), Ok(()));
        assert_eq!(f.check(FaultOp::Write, Some(Path::new("/b/big"))), Err(Errno(libc::ENOSPC)));
        assert_eq!(f.check(FaultOp::Write, Some(Path::new("/b/big"))), Err(Errno(libc::ENOSPC)));
        assert_eq!(f.check(FaultOp::Write, Some(Path::new("/b/big"))), Ok(()), "two only");
        f.control("inject sync=EIO").unwrap();
        assert_eq!(f.check(FaultOp::Sync, None), Err(Errno(libc::EIO)));
        assert_eq!(f.check(FaultOp::Sync, None), Err(Errno(libc::EIO)), "until cleared");
        f.control("clear").unwrap();
        assert_eq!(f.check(FaultOp::Sync, None), Ok(()));
        assert!(f.control("inject frobnicate=EIO").is_err());
        assert!(f.control("inject write=EWHAT").is_err());
    }

    #[test]
    fn a_stall_ends_when_cleared() {
        let f = std::sync::Arc::new(Faults { rules: Mutex::new(Vec::new()), cleared: Condvar::new(), generation: Mutex::new(0) });
        f.control("inject read=stall:60s").unwrap();
        let stalled = {
            let f = f.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                f.check(FaultOp::Read, None).unwrap();
                t.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        f.control("clear").unwrap();
        assert!(stalled.join().unwrap() < Duration::from_secs(10));
    }
}
