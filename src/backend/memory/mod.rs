//! The in-memory backend: a namespace and a unit store in memory, for in-process engine tests.
//!
//! It takes whole units only by default (so the engine's merge of partial units is exercised;
//! `MemoryBackend::with_partial_writes` takes ranges in place), and keeps, beside what it holds
//! now, what it holds durably, by rules modelled on a journaling file system:
//!
//! - a file's `sync` makes every name and attribute change so far durable, and that file's
//!   data (ext4 commits its journal on fsync);
//! - a directory's sync makes every name change durable;
//! - `sync_all` makes everything durable.
//!
//! `crash` then drops everything else: what the store holds becomes what it held durably, and
//! every lookup and open handle is forgotten, as after a power cut. Keys (`log_key`) carry a
//! birth number that is never given out twice, even across crashes, so a key never names
//! another object than the one it was made for.
//!
//! `snapshot`, `restore` and `kill_before_change` stand in for a process killed part way (a
//! recovery, say): the store as it was just before its Nth change, everything it held then kept
//! (the kernel's page cache outlives a killed daemon), durable or not.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::tree_keys::{check_name as valid_name, key, parse_key};
use crate::backend::{Capabilities, DirReader, FileData, Namespace, OpenMode, UnitSource, UnitStore, UnitWrite};
use crate::engine::types::{
    Attr, DirEntry, Kind, NewObject, ObjectId, Owner, SetAttr, StatFs, TimeToSet, Timestamp, XattrReply, ROOT_ID,
};
use crate::sys::{Errno, SysResult};

#[derive(Clone, Debug)]
struct Object {
    kind: Kind,
    perm: u32,
    uid: u32,
    gid: u32,
    rdev: u64,
    nlink: u32,
    atime: Timestamp,
    mtime: Timestamp,
    ctime: Timestamp,
    /// Never given twice, crashes included: the key's second half.
    birth: u64,
    target: Vec<u8>,
    xattrs: BTreeMap<OsString, Vec<u8>>,
    /// A directory's entries.
    entries: BTreeMap<OsString, ObjectId>,
}

/// Names and attributes: what is now, and (a copy) what is durable.
#[derive(Clone, Debug, Default)]
struct Tree {
    objects: HashMap<ObjectId, Object>,
    next_id: ObjectId,
}

#[derive(Default)]
struct State {
    tree: Tree,
    durable_tree: Tree,
    /// Files' bytes now, and as of their last sync.
    data: HashMap<ObjectId, Vec<u8>>,
    durable_data: HashMap<ObjectId, Vec<u8>>,
    /// Lookups the engine holds, and open data handles: objects without a name stay while
    /// either is held.
    lookups: HashMap<ObjectId, u64>,
    open_handles: HashMap<ObjectId, u64>,
    next_birth: u64,
    /// Bytes read to complete writes of whole units (none here: the engine reads them).
    unit_writes: u64,
    /// Changes made so far (`changes`).
    changes: u64,
    kill_point: Option<KillPoint>,
}

/// Where a process is killed part way (`MemoryBackend::kill_before_change`).
struct KillPoint {
    /// Changes still to pass before the one the process dies at.
    changes_left: u64,
    /// Called at that moment, with the store as it stands, to keep what else the process wrote.
    at_kill: Box<dyn FnOnce(MemorySnapshot) + Send>,
}

/// What a `MemoryBackend` held at a moment, durable or not (`MemoryBackend::snapshot`).
pub struct MemorySnapshot {
    tree: Tree,
    durable_tree: Tree,
    data: HashMap<ObjectId, Vec<u8>>,
    durable_data: HashMap<ObjectId, Vec<u8>>,
}

pub struct MemoryBackend {
    state: Arc<Mutex<State>>,
    capabilities: Capabilities,
    gate: Arc<WriteGate>,
}

/// For tests that need a flush in flight at a chosen moment: while held, unit writes wait
/// (and are counted as waiting) until it is let go.
#[derive(Default)]
struct WriteGate {
    state: Mutex<(bool, usize)>, // held, writers waiting
    changed: std::sync::Condvar,
}

impl WriteGate {
    fn pass(&self) {
        let mut state = self.state.lock().unwrap();
        if state.0 {
            state.1 += 1;
            self.changed.notify_all();
            while state.0 {
                state = self.changed.wait(state).unwrap();
            }
            state.1 -= 1;
        }
    }
}

/// Poisoning is a panic's trace, and a panic ends the daemon (the panic policy, src/main.rs):
/// no lock is seen poisoned there; a test that panics in-process fails anyway.
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap()
}

impl State {
    fn object(&self, id: ObjectId) -> SysResult<&Object> {
        self.tree.objects.get(&id).ok_or(Errno(libc::ESTALE))
    }

    fn object_mut(&mut self, id: ObjectId) -> SysResult<&mut Object> {
        self.tree.objects.get_mut(&id).ok_or(Errno(libc::ESTALE))
    }

    fn dir(&self, id: ObjectId) -> SysResult<&Object> {
        let dir = self.object(id)?;
        if dir.kind != Kind::Directory {
            return Err(Errno(libc::ENOTDIR));
        }
        Ok(dir)
    }

    fn attr(&self, id: ObjectId) -> SysResult<Attr> {
        let o = self.object(id)?;
        let size = match o.kind {
            Kind::File => self.data.get(&id).map_or(0, |d| d.len() as u64),
            Kind::Symlink => o.target.len() as u64,
            Kind::Directory => 4096,
            _ => 0,
        };
        Ok(Attr {
            id,
            kind: o.kind,
            perm: o.perm,
            nlink: o.nlink,
            uid: o.uid,
            gid: o.gid,
            rdev: o.rdev,
            size,
            blocks: size.div_ceil(512),
            blksize: 4096,
            atime: o.atime,
            mtime: o.mtime,
            ctime: o.ctime,
        })
    }

    fn touch(&mut self, id: ObjectId) {
        let now = Timestamp::now();
        if let Some(o) = self.tree.objects.get_mut(&id) {
            o.mtime = now;
            o.ctime = now;
        }
    }

    /// An object with no name, no lookup and no open handle is gone.
    fn collect(&mut self, id: ObjectId) {
        let unnamed =
            self.tree.objects.get(&id).is_some_and(|o| o.nlink == 0 || (o.kind == Kind::Directory && o.nlink <= 1));
        let held = self.lookups.get(&id).is_some_and(|&n| n > 0) || self.open_handles.get(&id).is_some_and(|&n| n > 0);
        if unnamed && !held && id != ROOT_ID {
            self.tree.objects.remove(&id);
            self.data.remove(&id);
        }
    }

    /// Before every change to the store: counted, and where a process is to be killed part
    /// way, the store as it stands before the change it dies at is handed over.
    fn before_change(&mut self) {
        self.changes += 1;
        let Some(point) = &mut self.kill_point else { return };
        point.changes_left -= 1;
        if point.changes_left == 0 {
            let at_kill = self.kill_point.take().expect("checked above").at_kill;
            at_kill(self.snapshot());
        }
    }

    fn snapshot(&self) -> MemorySnapshot {
        MemorySnapshot {
            tree: self.tree.clone(),
            durable_tree: self.durable_tree.clone(),
            data: self.data.clone(),
            durable_data: self.durable_data.clone(),
        }
    }

    fn count_lookup(&mut self, id: ObjectId) {
        *self.lookups.entry(id).or_insert(0) += 1;
    }

    fn names_durable(&mut self) {
        self.durable_tree = self.tree.clone();
        // Data of files whose names went: nothing durable names it any more.
        let live: std::collections::HashSet<ObjectId> = self.durable_tree.objects.keys().copied().collect();
        self.durable_data.retain(|id, _| live.contains(id));
    }

    /// Unlinks `name` from `parent` (its object keeps living while held).
    fn unlink_entry(&mut self, parent: ObjectId, name: &OsStr) -> SysResult<ObjectId> {
        let id = *self.dir(parent)?.entries.get(name).ok_or(Errno(libc::ENOENT))?;
        self.object_mut(parent)?.entries.remove(name);
        let kind = self.object(id)?.kind;
        if kind == Kind::Directory {
            self.object_mut(id)?.nlink = 0;
            self.object_mut(parent)?.nlink -= 1;
        } else {
            let o = self.object_mut(id)?;
            o.nlink -= 1;
            o.ctime = Timestamp::now();
        }
        self.touch(parent);
        Ok(id)
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new(64 << 10)
    }
}

impl MemoryBackend {
    fn make_object(
        &self,
        parent: ObjectId,
        name: &OsStr,
        what: NewObject<'_>,
        owner: Owner,
        chosen_id: Option<ObjectId>,
    ) -> SysResult<Attr> {
        valid_name(name)?;

        let mut s = lock(&self.state);
        s.before_change();
        if s.dir(parent)?.entries.contains_key(name) {
            return Err(Errno(libc::EEXIST));
        }
        let now = Timestamp::now();
        let (kind, perm, rdev, target) = match what {
            NewObject::File { perm } => (Kind::File, perm, 0, Vec::new()),
            NewObject::Directory { perm } => (Kind::Directory, perm, 0, Vec::new()),
            NewObject::Node { mode, rdev } => (Kind::of_mode(mode), mode & 0o7777, rdev, Vec::new()),
            NewObject::Symlink { target } => (Kind::Symlink, 0o777, 0, target.to_vec()),
        };
        let id = match chosen_id {
            Some(id) => {
                assert!(!s.tree.objects.contains_key(&id), "id {id} given out twice");
                id
            }
            None => {
                s.tree.next_id += 1;
                s.tree.next_id - 1
            }
        };
        let birth = s.next_birth;
        s.next_birth += 1;
        let nlink = if kind == Kind::Directory { 2 } else { 1 };
        let object = Object {
            kind,
            perm: perm & 0o7777,
            uid: owner.uid,
            gid: owner.gid,
            rdev,
            nlink,
            atime: now,
            mtime: now,
            ctime: now,
            birth,
            target,
            xattrs: BTreeMap::new(),
            entries: BTreeMap::new(),
        };
        s.tree.objects.insert(id, object);
        if kind == Kind::File {
            s.data.insert(id, Vec::new());
        }
        s.object_mut(parent)?.entries.insert(name.to_os_string(), id);
        if kind == Kind::Directory {
            s.object_mut(parent)?.nlink += 1;
        }
        s.touch(parent);
        s.count_lookup(id);
        s.attr(id)
    }

    /// An empty tree (the root directory only), taking whole units of `unit_bytes`.
    pub fn new(unit_bytes: u64) -> MemoryBackend {
        let now = Timestamp::now();
        let root = Object {
            kind: Kind::Directory,
            perm: 0o755,
            uid: 0,
            gid: 0,
            rdev: 0,
            nlink: 2,
            atime: now,
            mtime: now,
            ctime: now,
            birth: 1,
            target: Vec::new(),
            xattrs: BTreeMap::new(),
            entries: BTreeMap::new(),
        };
        let mut tree = Tree { objects: HashMap::new(), next_id: ROOT_ID + 1 };
        tree.objects.insert(ROOT_ID, root);
        let state = State { durable_tree: tree.clone(), tree, next_birth: 2, ..State::default() };
        let capabilities = Capabilities {
            unit_bytes,
            unit_source: UnitSource::Store,
            logical_block_bytes: 512,
            partial_writes: false,
            syncs_cost_requests: false,
            durable_writes: false,
            atomic_unit_writes: true,
            copy_ranges: false,
            allocate: false,
            keys_can_go_stale: true,
            sync_orders_names: true,
            keeps_chosen_ids: true,
            keeps_replay_watermark: false,
            preferred_flushers: None,
        };
        MemoryBackend { state: Arc::new(Mutex::new(state)), capabilities, gate: Arc::default() }
    }

    /// The same, taking aligned ranges in place instead of whole units.
    pub fn with_partial_writes(unit_bytes: u64) -> MemoryBackend {
        let mut backend = Self::new(unit_bytes);
        backend.capabilities.partial_writes = true;
        backend
    }

    /// Holds every unit write from now on (a flush stays in flight) until called with false.
    pub fn hold_unit_writes(&self, held: bool) {
        let mut state = self.gate.state.lock().unwrap();
        state.0 = held;
        self.gate.changed.notify_all();
    }

    /// Waits until `writers` unit writes are held (see `hold_unit_writes`), for 10 s at most.
    pub fn wait_for_held_writes(&self, writers: usize) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut state = self.gate.state.lock().unwrap();
        while state.1 < writers {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self.gate.changed.wait_timeout(state, left).unwrap().0;
        }
        true
    }

    /// A power cut: the store holds what it held durably, and nothing is looked up or open.
    pub fn crash(&self) {
        let mut s = lock(&self.state);
        s.tree = s.durable_tree.clone();
        s.data = s.durable_data.clone();
        // A file whose name was durable and whose data never was is empty.
        let files: Vec<ObjectId> =
            s.tree.objects.iter().filter(|(_, o)| o.kind == Kind::File).map(|(&id, _)| id).collect();
        for id in files {
            s.data.entry(id).or_default();
        }
        s.lookups.clear();
        s.open_handles.clear();
    }

    /// Everything the store holds now, durable or not, to be put back by `restore`.
    pub fn snapshot(&self) -> MemorySnapshot {
        lock(&self.state).snapshot()
    }

    /// The store as `snapshot` took it, with nothing looked up or open: as a killed process
    /// leaves it (the kernel's page cache outlives it).
    pub fn restore(&self, snapshot: MemorySnapshot) {
        let mut s = lock(&self.state);
        s.tree = snapshot.tree;
        s.durable_tree = snapshot.durable_tree;
        s.data = snapshot.data;
        s.durable_data = snapshot.durable_data;
        s.lookups.clear();
        s.open_handles.clear();
        s.kill_point = None;
    }

    /// Changes made to the store so far: objects made, removed or renamed, attributes set,
    /// units written, sizes set.
    pub fn changes(&self) -> u64 {
        lock(&self.state).changes
    }

    /// For tests of a process killed part way (a recovery): just before its `nth` change to
    /// the store from now (1: the next), `at_kill` gets the store as it stands then (and, as it
    /// runs with the store's lock held, can copy what else the process wrote: its log). The
    /// test abandons the process, then restores what `at_kill` kept.
    pub fn kill_before_change(&self, nth: u64, at_kill: Box<dyn FnOnce(MemorySnapshot) + Send>) {
        assert!(nth >= 1, "changes count from 1");
        lock(&self.state).kill_point = Some(KillPoint { changes_left: nth, at_kill });
    }

    /// What `path` (names from the root) holds now: a file's bytes, or None when there is no
    /// regular file there. For tests comparing the store with what was acknowledged.
    pub fn read_path(&self, path: &[&OsStr]) -> Option<Vec<u8>> {
        let s = lock(&self.state);
        let mut id = ROOT_ID;
        for name in path {
            id = *s.tree.objects.get(&id)?.entries.get(*name)?;
        }
        (s.tree.objects.get(&id)?.kind == Kind::File).then(|| s.data.get(&id).cloned().unwrap_or_default())
    }

    /// How many whole-unit writes the store took (for tests of the engine's planning).
    pub fn unit_writes(&self) -> u64 {
        lock(&self.state).unit_writes
    }
}

/// A directory's entries as they were when it was opened ("." and ".." first); an entry's
/// offset is its place in that list.
struct MemoryDirReader {
    entries: Vec<DirEntry>,
}

impl DirReader for MemoryDirReader {
    fn read(&mut self, offset: u64, max: usize) -> SysResult<Vec<DirEntry>> {
        Ok(self.entries.iter().skip(offset as usize).take(max).cloned().collect())
    }
}

impl Namespace for MemoryBackend {
    fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr> {
        let mut s = lock(&self.state);
        let id = *s.dir(parent)?.entries.get(name).ok_or(Errno(libc::ENOENT))?;
        s.count_lookup(id);
        s.attr(id)
    }

    fn forget(&self, id: ObjectId, lookups: u64) {
        let mut s = lock(&self.state);
        if let Some(n) = s.lookups.get_mut(&id) {
            *n = n.saturating_sub(lookups);
        }
        s.collect(id);
    }

    fn hold(&self, id: ObjectId) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.object(id)?;
        s.count_lookup(id);
        Ok(())
    }

    fn getattr(&self, id: ObjectId) -> SysResult<Attr> {
        lock(&self.state).attr(id)
    }

    fn setattr(&self, id: ObjectId, changes: &SetAttr) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.before_change();
        let now = Timestamp::now();
        let o = s.object_mut(id)?;
        if let Some(mode) = changes.mode {
            o.perm = mode & 0o7777;
        }
        if let Some(uid) = changes.uid {
            o.uid = uid;
        }
        if let Some(gid) = changes.gid {
            o.gid = gid;
        }
        let at = |t: TimeToSet| if let TimeToSet::At(at) = t { at } else { now };
        if let Some(t) = changes.times.atime {
            o.atime = at(t);
        }
        if let Some(t) = changes.times.mtime {
            o.mtime = at(t);
        }
        o.ctime = now;
        Ok(())
    }

    fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, owner: Owner) -> SysResult<Attr> {
        self.make_object(parent, name, what, owner, None)
    }

    fn make_with_id(&self, id: ObjectId, parent: ObjectId, name: &OsStr, perm: u32, owner: Owner) -> SysResult<Attr> {
        self.make_object(parent, name, NewObject::File { perm }, owner, Some(id))
    }

    fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        valid_name(new_name)?;
        let mut s = lock(&self.state);
        s.before_change();
        if s.object(id)?.kind == Kind::Directory {
            return Err(Errno(libc::EPERM));
        }
        if s.dir(new_parent)?.entries.contains_key(new_name) {
            return Err(Errno(libc::EEXIST));
        }
        s.object_mut(new_parent)?.entries.insert(new_name.to_os_string(), id);
        let o = s.object_mut(id)?;
        o.nlink += 1;
        o.ctime = Timestamp::now();
        s.touch(new_parent);
        s.count_lookup(id);
        s.attr(id)
    }

    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.before_change();
        let id = *s.dir(parent)?.entries.get(name).ok_or(Errno(libc::ENOENT))?;
        let o = s.object(id)?;
        match (directory, o.kind == Kind::Directory) {
            (true, false) => return Err(Errno(libc::ENOTDIR)),
            (false, true) => return Err(Errno(libc::EISDIR)),
            (true, true) if !o.entries.is_empty() => return Err(Errno(libc::ENOTEMPTY)),
            _ => {}
        }
        s.unlink_entry(parent, name)?;
        s.collect(id);
        Ok(())
    }

    fn rename(
        &self,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        flags: u32,
    ) -> SysResult<()> {
        valid_name(new_name)?;
        let mut s = lock(&self.state);
        s.before_change();
        let id = *s.dir(parent)?.entries.get(name).ok_or(Errno(libc::ENOENT))?;
        let target = s.dir(new_parent)?.entries.get(new_name).copied();
        if flags & libc::RENAME_EXCHANGE != 0 {
            let other = target.ok_or(Errno(libc::ENOENT))?;
            s.object_mut(parent)?.entries.insert(name.to_os_string(), other);
            s.object_mut(new_parent)?.entries.insert(new_name.to_os_string(), id);
            s.touch(parent);
            s.touch(new_parent);
            return Ok(());
        }
        if target == Some(id) {
            return Ok(()); // two names of one object: POSIX says nothing happens
        }
        let moving_dir = s.object(id)?.kind == Kind::Directory;
        if let Some(old) = target {
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(Errno(libc::EEXIST));
            }
            let old = s.object(old)?;
            match (moving_dir, old.kind == Kind::Directory) {
                (true, false) => return Err(Errno(libc::ENOTDIR)),
                (false, true) => return Err(Errno(libc::EISDIR)),
                (true, true) if !old.entries.is_empty() => return Err(Errno(libc::ENOTEMPTY)),
                _ => {}
            }
        }
        if moving_dir {
            // Not into itself or below it.
            let mut at = new_parent;
            loop {
                if at == id {
                    return Err(Errno(libc::EINVAL));
                }
                let up = s
                    .tree
                    .objects
                    .iter()
                    .find(|(_, o)| o.entries.values().any(|&c| c == at && o.kind == Kind::Directory));
                match up {
                    Some((&p, _)) if at != ROOT_ID => at = p,
                    _ => break,
                }
            }
        }
        if let Some(old) = target {
            s.unlink_entry(new_parent, new_name)?;
            s.collect(old);
        }
        s.object_mut(parent)?.entries.remove(name);
        s.object_mut(new_parent)?.entries.insert(new_name.to_os_string(), id);
        if moving_dir && parent != new_parent {
            s.object_mut(parent)?.nlink -= 1;
            s.object_mut(new_parent)?.nlink += 1;
        }
        s.object_mut(id)?.ctime = Timestamp::now();
        s.touch(parent);
        s.touch(new_parent);
        Ok(())
    }

    fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        let s = lock(&self.state);
        let o = s.object(id)?;
        if o.kind != Kind::Symlink {
            return Err(Errno(libc::EINVAL));
        }
        Ok(o.target.clone())
    }

    fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.before_change();
        let o = s.object_mut(id)?;
        let exists = o.xattrs.contains_key(name);
        if flags & libc::XATTR_CREATE != 0 && exists {
            return Err(Errno(libc::EEXIST));
        }
        if flags & libc::XATTR_REPLACE != 0 && !exists {
            return Err(Errno(libc::ENODATA));
        }
        o.xattrs.insert(name.to_os_string(), value.to_vec());
        Ok(())
    }

    fn get_xattr(&self, id: ObjectId, name: &OsStr, size: usize) -> SysResult<XattrReply> {
        let s = lock(&self.state);
        let value = s.object(id)?.xattrs.get(name).ok_or(Errno(libc::ENODATA))?;
        match size {
            0 => Ok(XattrReply::Size(value.len())),
            n if n < value.len() => Err(Errno(libc::ERANGE)),
            _ => Ok(XattrReply::Data(value.clone())),
        }
    }

    fn list_xattr(&self, id: ObjectId, size: usize) -> SysResult<XattrReply> {
        let s = lock(&self.state);
        let mut list = Vec::new();
        for name in s.object(id)?.xattrs.keys() {
            list.extend_from_slice(name.as_encoded_bytes());
            list.push(0);
        }
        match size {
            0 => Ok(XattrReply::Size(list.len())),
            n if n < list.len() => Err(Errno(libc::ERANGE)),
            _ => Ok(XattrReply::Data(list)),
        }
    }

    fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.before_change();
        s.object_mut(id)?.xattrs.remove(name).map(drop).ok_or(Errno(libc::ENODATA))
    }

    fn statfs(&self, _id: ObjectId) -> SysResult<StatFs> {
        Ok(StatFs {
            blocks: 1 << 20,
            blocks_free: 1 << 19,
            blocks_available: 1 << 19,
            files: 1 << 20,
            files_free: 1 << 19,
            block_size: 4096,
            name_max: 255,
            fragment_size: 4096,
        })
    }

    fn open_dir(&self, id: ObjectId) -> SysResult<Box<dyn DirReader>> {
        let s = lock(&self.state);
        let dir = s.dir(id)?;
        let mut entries = vec![
            DirEntry { name: ".".into(), id, kind: Some(Kind::Directory), next_offset: 1 },
            DirEntry { name: "..".into(), id, kind: Some(Kind::Directory), next_offset: 2 },
        ];
        for (i, (name, &child)) in dir.entries.iter().enumerate() {
            let kind = s.tree.objects.get(&child).map(|o| o.kind);
            entries.push(DirEntry { name: name.clone(), id: child, kind, next_offset: i as u64 + 3 });
        }
        Ok(Box::new(MemoryDirReader { entries }))
    }

    fn sync_dir(&self, id: ObjectId) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.dir(id)?;
        s.names_durable();
        Ok(())
    }

    fn log_key(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        Ok(key(id, lock(&self.state).object(id)?.birth))
    }

    fn identify(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<(Vec<u8>, ObjectId)>> {
        let s = lock(&self.state);
        let Some(&id) = s.dir(parent)?.entries.get(name) else { return Ok(None) };
        Ok(Some((key(id, s.object(id)?.birth), id)))
    }

    fn describe(&self, id: ObjectId) -> Option<String> {
        Some(format!("memory object {id}"))
    }

    fn find(&self, key: &[u8]) -> SysResult<Option<ObjectId>> {
        let (id, birth) = parse_key(key).ok_or(Errno(libc::EINVAL))?;
        let mut s = lock(&self.state);
        match s.tree.objects.get(&id) {
            Some(o) if o.birth == birth => {
                s.count_lookup(id);
                Ok(Some(id))
            }
            _ => Ok(None),
        }
    }

    fn key_at(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<Vec<u8>>> {
        Ok(self.identify(parent, name)?.map(|(key, _)| key))
    }
}

mod data;
