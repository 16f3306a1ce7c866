//! Fault injection at the backend boundary, for tests: a plan of rules that make the
//! backend's writes, syncs, reads or creates fail with an errno (EIO, ENOSPC, EDQUOT, ...),
//! stall, abort the process or panic, a number of times or until cleared, optionally only for files
//! whose path contains a given text. `FaultyBackend` wraps any namespace and unit store with
//! the plan, `FaultyLogDevice` any log device: production code never asks the plan itself.
//!
//! Off unless the daemon starts with `COALESCEFS_FAULTS` set (its value is the first rules;
//! empty for none): then `coalescefs` accepts `inject ...` and `clear` on the control socket,
//! so a test can fail the backend, watch the mount, and let it recover, on a real mount.
//!
//! Rule syntax (also of the environment variable, rules separated by `;`):
//! `OP=ERRNO[*COUNT][/SKIP][@PATH_TEXT]`, `OP=stall:DURATION...`, `OP=abort...` (the process dies
//! as kill -9 would) or `OP=panic...` (the calling thread panics), where OP is
//! write, sync, read, create, mutate (any change to the store: a write, a size, a name; for
//! killing a replay part way), logwrite or logsync, ERRNO a name (EIO, ENOSPC, EDQUOT, EROFS),
//! COUNT how many calls fail (default: until cleared) and SKIP how many matching calls pass
//! first. Examples: `write=ENOSPC*3;sync=stall:2s@big`, `mutate=abort/12`.
//!
//! The intent log's device fails through `FaultyLogDevice`: `logwrite` fails a batch before any
//! of its bytes reach the log (lost), `logsync` after they did (landed: a device that reports
//! EIO on the flush that follows the write).

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use std::ffi::OsStr;

use crate::backend::{Capabilities, DirReader, FileData, Namespace, OpenMode, UnitStore, UnitWrite};
use crate::engine::intent_log::device::LogDevice;
use crate::engine::types::{Attr, NewObject, ObjectId, Owner, SetAttr, StatFs, XattrReply};
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
    /// Any change to the store: a unit written, a size set, an object made, removed or renamed.
    Mutate,
    /// A batch written to the intent log's device.
    LogWrite,
    /// The intent log's device synced.
    LogSync,
}

#[derive(Clone, Debug, PartialEq)]
enum Action {
    Fail(Errno),
    Stall(Duration),
    /// Dies at once, as kill -9 would.
    Abort,
    /// Panics in the calling thread (a flusher, a FUSE worker): the panic policy's test.
    Panic,
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
    /// Signalled when the rules are cleared (a stalled call then returns at once), and when a
    /// call begins to stall (`wait_for_stalls`).
    changed: Condvar,
    stalls: Mutex<Stalls>,
}

#[derive(Default)]
struct Stalls {
    /// Moves on at every clear: a stall that began before it ends.
    generation: u64,
    /// Calls stalled now.
    stalled: usize,
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
        "mutate" => FaultOp::Mutate,
        "logwrite" => FaultOp::LogWrite,
        "logsync" => FaultOp::LogSync,
        other => return Err(format!("'{other}': not write, sync, read, create, mutate, logwrite or logsync")),
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
    let action = match action.trim() {
        "abort" => Action::Abort,
        "panic" => Action::Panic,
        a => match a.strip_prefix("stall:") {
            Some(d) => Action::Stall(crate::parse::parse_duration(d)?),
            None => Action::Fail(errno_named(a).ok_or_else(|| format!("'{a}': not an errno this knows"))?),
        },
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
        Faults { rules: Mutex::new(Vec::new()), changed: Condvar::new(), stalls: Mutex::default() }
    }

    /// Waits until `calls` calls are stalled (each has begun its stall, so a `clear` from now on
    /// ends it); false after `timeout`.
    pub fn wait_for_stalls(&self, calls: usize, timeout: Duration) -> bool {
        let stalls = self.stalls.lock().unwrap();
        let (stalls, _) = self.changed.wait_timeout_while(stalls, timeout, |s| s.stalled < calls).unwrap();
        stalls.stalled >= calls
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
        self.rules.lock().unwrap().push(rule);
        Ok(())
    }

    /// A control socket request: `inject RULE` or `clear`.
    pub fn control(&self, request: &str) -> Result<(), String> {
        match request.split_once(' ') {
            Some(("inject", rule)) => self.add(rule.trim()),
            None if request == "clear" => {
                self.rules.lock().unwrap().clear();
                self.stalls.lock().unwrap().generation += 1;
                self.changed.notify_all();
                Ok(())
            }
            _ => Err(format!("'{request}': expected 'inject RULE' or 'clear'")),
        }
    }

    /// Called by the backend before `op` on the file at `path` (None: not a file's call).
    pub fn check(&self, op: FaultOp, path: Option<&Path>) -> SysResult<()> {
        let action = {
            let mut rules = self.rules.lock().unwrap();
            let matching = rules.iter_mut().find(|r| {
                r.op == op
                    && r.remaining != Some(0)
                    && r.path_contains
                        .as_ref()
                        .is_none_or(|p| path.is_some_and(|path| path.to_string_lossy().contains(p.as_str())))
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
            Action::Abort => {
                log::error!("fault injection: aborting at a {op:?} call");
                std::process::abort();
            }
            Action::Panic => panic!("fault injection: a panic at a {op:?} call"),
            Action::Stall(duration) => {
                let deadline = Instant::now() + duration;
                let mut stalls = self.stalls.lock().unwrap();
                let started = stalls.generation;
                stalls.stalled += 1;
                self.changed.notify_all();
                while stalls.generation == started && Instant::now() < deadline {
                    stalls = self
                        .changed
                        .wait_timeout(stalls, deadline.saturating_duration_since(Instant::now()))
                        .unwrap()
                        .0;
                }
                stalls.stalled -= 1;
                Ok(())
            }
        }
    }
}

/// A namespace and a unit store, with fault injection: `create` rules meet objects made and
/// links, `sync` rules directory syncs and the store's sync, `mutate` rules every change.
pub struct FaultyBackend {
    ns: Arc<dyn Namespace>,
    store: Arc<dyn UnitStore>,
    faults: Arc<Faults>,
}

impl FaultyBackend {
    pub fn new(ns: Arc<dyn Namespace>, store: Arc<dyn UnitStore>, faults: Arc<Faults>) -> FaultyBackend {
        FaultyBackend { ns, store, faults }
    }

    fn check(&self, op: FaultOp, id: Option<ObjectId>) -> SysResult<()> {
        let name = id.and_then(|id| self.ns.describe(id));
        self.faults.check(op, name.as_deref().map(Path::new))
    }
}

impl Namespace for FaultyBackend {
    fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr> {
        self.ns.lookup(parent, name)
    }
    fn forget(&self, id: ObjectId, lookups: u64) {
        self.ns.forget(id, lookups);
    }
    fn hold(&self, id: ObjectId) -> SysResult<()> {
        self.ns.hold(id)
    }
    fn getattr(&self, id: ObjectId) -> SysResult<Attr> {
        self.ns.getattr(id)
    }
    fn setattr(&self, id: ObjectId, changes: &SetAttr) -> SysResult<()> {
        self.check(FaultOp::Mutate, Some(id))?;
        self.ns.setattr(id, changes)
    }
    fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, owner: Owner) -> SysResult<Attr> {
        self.check(FaultOp::Create, Some(parent))?;
        self.check(FaultOp::Mutate, Some(parent))?;
        self.ns.make(parent, name, what, owner)
    }
    fn make_with_id(&self, id: ObjectId, parent: ObjectId, name: &OsStr, perm: u32, owner: Owner) -> SysResult<Attr> {
        self.check(FaultOp::Create, Some(parent))?;
        self.check(FaultOp::Mutate, Some(parent))?;
        self.ns.make_with_id(id, parent, name, perm, owner)
    }
    fn make_with_id_prepared(
        &self,
        id: ObjectId,
        parent: ObjectId,
        name: &OsStr,
        perm: u32,
        owner: Owner,
    ) -> SysResult<Attr> {
        self.check(FaultOp::Create, Some(parent))?;
        self.check(FaultOp::Mutate, Some(parent))?;
        self.ns.make_with_id_prepared(id, parent, name, perm, owner)
    }
    fn prepare_files(&self, count: usize, bytes: u64) -> SysResult<usize> {
        // No fault of its own: a rule meant for an application's create would be spent here.
        self.ns.prepare_files(count, bytes)
    }
    fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        self.check(FaultOp::Create, Some(new_parent))?;
        self.check(FaultOp::Mutate, Some(new_parent))?;
        self.ns.link(id, new_parent, new_name)
    }
    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()> {
        self.check(FaultOp::Mutate, Some(parent))?;
        self.ns.remove(parent, name, directory)
    }
    fn rename(
        &self,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        flags: u32,
    ) -> SysResult<()> {
        self.check(FaultOp::Mutate, Some(parent))?;
        self.ns.rename(parent, name, new_parent, new_name, flags)
    }
    fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        self.ns.readlink(id)
    }
    fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()> {
        self.ns.set_xattr(id, name, value, flags)
    }
    fn get_xattr(&self, id: ObjectId, name: &OsStr, size: usize) -> SysResult<XattrReply> {
        self.ns.get_xattr(id, name, size)
    }
    fn list_xattr(&self, id: ObjectId, size: usize) -> SysResult<XattrReply> {
        self.ns.list_xattr(id, size)
    }
    fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()> {
        self.ns.remove_xattr(id, name)
    }
    fn statfs(&self, id: ObjectId) -> SysResult<StatFs> {
        self.ns.statfs(id)
    }
    fn open_dir(&self, id: ObjectId) -> SysResult<Box<dyn DirReader>> {
        self.ns.open_dir(id)
    }
    fn sync_dir(&self, id: ObjectId) -> SysResult<()> {
        self.check(FaultOp::Sync, Some(id))?;
        self.ns.sync_dir(id)
    }
    fn log_key(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        self.ns.log_key(id)
    }
    fn identify(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<(Vec<u8>, ObjectId)>> {
        self.ns.identify(parent, name)
    }
    fn describe(&self, id: ObjectId) -> Option<String> {
        self.ns.describe(id)
    }
    fn find(&self, key: &[u8]) -> SysResult<Option<ObjectId>> {
        self.ns.find(key)
    }
    fn key_at(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<Vec<u8>>> {
        self.ns.key_at(parent, name)
    }

    fn set_replay_watermark(&self, first_batch: Option<u64>) -> SysResult<()> {
        // A name change as far as faults go: `mutate` kills a process between two changes.
        self.faults.check(FaultOp::Mutate, None)?;
        self.ns.set_replay_watermark(first_batch)
    }

    fn replay_watermark(&self) -> SysResult<Option<u64>> {
        self.ns.replay_watermark()
    }
}

impl UnitStore for FaultyBackend {
    fn capabilities(&self) -> &Capabilities {
        self.store.capabilities()
    }
    fn open(&self, id: ObjectId, mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        let data = self.store.open(id, mode)?;
        Ok(Arc::new(FaultyFileData { data, name: self.ns.describe(id), faults: self.faults.clone() }))
    }
    fn sync_all(&self) -> SysResult<()> {
        self.faults.check(FaultOp::Sync, None)?;
        self.store.sync_all()
    }
}

/// A file's data with fault injection; `name` (its path when it was opened) for path rules.
struct FaultyFileData {
    data: Arc<dyn FileData>,
    name: Option<String>,
    faults: Arc<Faults>,
}

impl FaultyFileData {
    fn check(&self, op: FaultOp) -> SysResult<()> {
        self.faults.check(op, self.name.as_deref().map(Path::new))
    }
}

impl FileData for FaultyFileData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        self.check(FaultOp::Read)?;
        self.data.read_at(buf, offset)
    }
    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        self.check(FaultOp::Write)?;
        self.check(FaultOp::Mutate)?;
        self.data.write_unit(unit)
    }
    fn set_size(&self, size: u64) -> SysResult<()> {
        self.check(FaultOp::Mutate)?;
        self.data.set_size(size)
    }
    fn size(&self) -> SysResult<u64> {
        self.data.size()
    }
    fn sync(&self, data_only: bool) -> SysResult<()> {
        self.check(FaultOp::Sync)?;
        self.data.sync(data_only)
    }
    fn holds_data(&self) -> bool {
        self.data.holds_data()
    }
    fn allocate(&self, mode: i32, offset: u64, length: u64) -> SysResult<()> {
        self.data.allocate(mode, offset, length)
    }
    fn seek(&self, offset: i64, whence: i32) -> SysResult<i64> {
        self.data.seek(offset, whence)
    }
    fn copy_to(&self, source_offset: u64, target: &dyn FileData, target_offset: u64, length: u64) -> SysResult<usize> {
        self.data.copy_to(source_offset, target, target_offset, length)
    }
    /// The wrapped data's: a store's `copy_to` finds its own kind behind the wrapper.
    fn as_any(&self) -> &dyn std::any::Any {
        self.data.as_any()
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
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn write_at(&self, offset: u64, bytes: &[u8]) -> SysResult<()> {
        self.faults.check(FaultOp::LogWrite, None)?;
        self.inner.write_at(offset, bytes)
    }
    fn sync(&self) -> SysResult<()> {
        self.inner.sync()?;
        // After the flush: what was written landed, and the caller is told it did not.
        self.faults.check(FaultOp::LogSync, None)
    }
    fn read_at(&self, offset: u64, len: usize) -> SysResult<Vec<u8>> {
        self.inner.read_at(offset, len)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn flushed_by_sync(&self) -> bool {
        self.inner.flushed_by_sync()
    }
    fn release(&self) {
        self.inner.release();
    }
    fn writes_through_page_cache(&self) -> bool {
        self.inner.writes_through_page_cache()
    }
    fn write_back(&self) -> SysResult<()> {
        self.inner.write_back()
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
        let f = Faults::new();
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
        let f = std::sync::Arc::new(Faults::new());
        f.control("inject read=stall:60s").unwrap();
        let stalled = {
            let f = f.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                f.check(FaultOp::Read, None).unwrap();
                t.elapsed()
            })
        };
        // Cleared only once the call stalls: cleared before, it would not stall at all, and the
        // test would pass without testing anything.
        assert!(f.wait_for_stalls(1, Duration::from_secs(10)), "the read never stalled");
        f.control("clear").unwrap();
        assert!(stalled.join().unwrap() < Duration::from_secs(10), "the clear ended the stall");
    }
}
