//! Recovery: what the intent log holds after its checkpoint, applied to the backend at mount.
//!
//! The log holds the mount's name changes in the order they happened (creations, unlinks and
//! renames are queued as they happen and ride along with the next batch; every backend sync the
//! mount issues commits the queue first), and the bytes of every fsync it answered. After a
//! power cut a journaling backing file system (ext4, XFS) holds the last checkpoint plus a
//! prefix of the name changes since, which may be shorter or longer than the log's.
//!
//! 1. Where the backend is: the last name record whose effect the backend shows (a created
//!    file that exists, a renamed object under its new name), or the last one a NamesSynced
//!    record covers (a directory's sync said the backend holds it), whichever is later. The
//!    backend holds every change up to that one, so name records before it are not applied:
//!    they would undo later changes the log may not hold (a file made again after it was
//!    replaced, say; a file renamed a -> b, then back, the second rename lost with the daemon:
//!    the backend shows nothing of the first). Only records before the first one the backend
//!    shows has not happened (the file a rename replaced, or an unlink removed, still at its
//!    name), past those a NamesSynced covers, count as evidence: a file renamed a -> b over
//!    another and back to a, neither rename on the backend, is at a as if renamed back.
//! 2. From there on, each name record only where the backend shows it has not happened yet:
//!    - Create: a file that is gone is made again under its logged name, mode and owner, and
//!      the file's records go to it; a name that is taken is never taken from its holder. Only
//!      a file the log holds bytes, a size or attributes of (after its last Barrier): a
//!      creation acknowledged any other way (an fsync of the file or of its directory on the
//!      backend, a checkpoint) is durable on the backend, so a file of which the log holds no
//!      more than its Create, and which is gone, was unlinked, and its Unlink record need not
//!      have reached the log (see `Writeback::note_names_changed`).
//!    - Unlink: only if the name still refers to the logged object.
//!    - Hidden (a backend file a new one was renamed over, whose backend unlink waited for the
//!      checkpoint): wherever the backend stands, since it can hold later changes without this
//!      one; only if the name still refers to the logged object and no later rename put that
//!      object back there.
//!    - Link: never (the backend sync that acknowledges a second name makes it durable there).
//!      It is evidence: a removal of an object from a name a later Link (or Rename) puts it
//!      back at is not applied, and a backend that shows the link holds what came before it.
//!    - Rename: only if the source name still refers to the logged object and the target name
//!      is free or holds what the rename replaced. Where the source no longer does and a later
//!      record removes the renamed object, the name ends without what the rename replaced: the
//!      file there is removed, whether replay made it again (from a record the backend showed
//!      nothing of) or the backend kept it, unless a later record puts it back there.
//! 3. Data and sizes in order, after the file's last Barrier (a backend sync made everything
//!    before it durable there). A file that no longer exists had been deleted: dropped.
//!
//! Then one sync of the backing file system and a checkpoint, so the log starts empty.
//!
//! Files the backend had not made when they were logged (`pending`: created since the last
//! checkpoint and held in memory, logged at their close or fsync) are logged under keys no
//! backend gives out. Their name records were committed as they happened, so the log knows
//! the name each ends with: such a file is made there, with its records' bytes, unless a
//! checkpoint had already made it there before the crash (then that file is taken as it, and
//! its bytes written again); one the log saw unlinked is not made at all. Their Rename and
//! Unlink records are never applied one by one, and never tell where the backend is (step 1):
//! a checkpoint made them later than their records say. All their records wait until every
//! other record is applied: the name such a file ends with may be freed by one of those (a
//! held file renamed over a backend file logs that file's unlink first).
//!
//! A replay can itself be interrupted (kill -9, a power cut). Everything it does is applied
//! again by the next one the same way, except making a file again: that gives the file a new
//! handle, which the log does not know. So each file made again is written, with its logged
//! handle, to a map beside the log (`LOG.replay-map`) and the map synced before the file is
//! used; the next replay starts from the map, and the map goes once the log is empty.

mod history;

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::intent_log::device::LogDevice;
use super::intent_log::format::{describe_key, Batch, Record};
use super::intent_log::volatile_tail::VolatileTail;
use super::intent_log::{IntentLog, LogError};
use super::pending::is_pending_key;
use super::types::{Kind, NewObject, ObjectId, Owner, SetAttr, TimeToSet, TimesToSet};
use super::LogSetup;
use crate::backend::{FileData, Namespace, OpenMode, UnitStore};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};
use history::*;

/// Errors that say the store is in another state than the record expects, not that it
/// failed: the record is skipped.
fn means_state_moved_on(e: Errno) -> bool {
    matches!(e.0, libc::ENOENT | libc::ESTALE | libc::ENOTEMPTY | libc::EEXIST | libc::ENOTDIR | libc::EISDIR)
}

/// Files whose data replay keeps open at once; the rest are opened again when a record needs
/// them (a log can name many thousands of files).
const OPEN_FILES_MAX: usize = 256;

fn name_of(bytes: &[u8]) -> &OsStr {
    use std::os::unix::ffi::OsStrExt;
    OsStr::from_bytes(bytes)
}

struct Replay<'a> {
    ns: &'a dyn Namespace,
    store: &'a dyn UnitStore,
    metrics: &'a Metrics,
    /// Where the map of files made again lives: appended (and synced) before each one is used.
    device: &'a dyn LogDevice,
    /// Every object a record named, once looked for: its id if it exists (None: gone, or not
    /// the kind the record needs). Each found id holds one lookup, forgotten at the end.
    found: HashMap<Vec<u8>, Option<ObjectId>>,
    /// Data of files records were applied to, at most `OPEN_FILES_MAX` of them.
    open: lru::LruCache<ObjectId, Arc<dyn FileData>>,
    /// Objects made again by replay: the logged key, and the new object's.
    recreated: HashMap<Vec<u8>, Vec<u8>>,
    /// The new objects' keys (an index of `recreated`'s values, kept with it: a log can hold
    /// many thousands of Creates). One may equal the logged key of another object whose
    /// creation the crash lost: XFS gives a freed inode number back with its generation plus
    /// one, so the file replay makes can have exactly the handle a lost file had.
    made_by_replay: HashSet<Vec<u8>>,
    /// Keys of files the log holds bytes, sizes or attributes of after their last Barrier:
    /// the files a Create may make again.
    with_contents: HashSet<Vec<u8>>,
    /// Keys of directories made since the checkpoint that files made again (or new files the
    /// log held) end up in, and their directories made since: the ones a Create may make again.
    needed_dirs: HashSet<Vec<u8>>,
    /// Where each object is last removed (its Unlink or Hidden record, or a Rename over it): the
    /// index of that record.
    last_removal: HashMap<Vec<u8>, usize>,
    /// Where each object is last put at a name (object, directory, name; by a Rename or a
    /// Link record): the index of that record.
    last_put: HashMap<Place, usize>,
    /// Where each object is last renamed away from a name (object, directory, name): the index
    /// of that Rename record.
    last_move_away: HashMap<Place, usize>,
    /// Directories replay changed, and their mtime before (see `keep_time_of`).
    dir_times: HashMap<ObjectId, super::types::Timestamp>,
    applied: u64,
    recreated_files: u64,
    not_restored: Vec<String>,
}

impl Replay<'_> {
    /// The object logged as `key` (a file made again: the new one), if it exists and is of
    /// `kind`.
    fn object(&mut self, key: &[u8], kind: Kind) -> SysResult<Option<ObjectId>> {
        if let Some(found) = self.found.get(key) {
            return Ok(*found);
        }
        let found = match self.current_key(key).map(<[u8]>::to_vec) {
            // Never made on the backend (yet): no backend key finds it.
            Some(current) if is_pending_key(&current) => None,
            Some(current) => match self.ns.find(&current) {
                Ok(Some(id)) => match self.ns.getattr(id) {
                    Ok(attr) if attr.kind == kind => Some(id),
                    _ => {
                        self.ns.forget(id, 1);
                        None
                    }
                },
                Ok(None) => None,
                Err(e) if means_state_moved_on(e) => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        self.found.insert(key.to_vec(), found);
        Ok(found)
    }

    fn file(&mut self, key: &[u8]) -> SysResult<Option<Arc<dyn FileData>>> {
        let Some(id) = self.object(key, Kind::File)? else { return Ok(None) };
        if let Some(data) = self.open.get(&id) {
            return Ok(Some(data.clone()));
        }
        let data = self.store.open(id, OpenMode { write: true, no_atime: false })?;
        self.open.put(id, data.clone());
        Ok(Some(data))
    }

    /// The key the object logged as `key` has now; None when it is gone and its logged key
    /// now names an object replay made for another record.
    fn current_key<'k>(&'k self, key: &'k [u8]) -> Option<&'k [u8]> {
        match self.recreated.get(key) {
            Some(made) => Some(made),
            None if self.made_by_replay.contains(key) => None,
            None => Some(key),
        }
    }

    /// A directory, found by its logged key (a directory made again: the new one).
    fn directory(&mut self, key: &[u8]) -> SysResult<Option<ObjectId>> {
        self.object(key, Kind::Directory)
    }

    /// Whether `name` in `dir` is the object logged as `key`.
    fn names(&self, dir: ObjectId, name: &[u8], key: &[u8]) -> SysResult<bool> {
        let Some(current) = self.current_key(key) else { return Ok(false) };
        Ok(self.ns.key_at(dir, name_of(name))?.is_some_and(|k| k == current))
    }

    /// Before replay changes `dir`: its mtime, which `release` gives it back (a directory's
    /// times were the application's to set, tar's for one; replay's own changes are not).
    fn keep_time_of(&mut self, dir: ObjectId) {
        if !self.dir_times.contains_key(&dir) {
            if let Ok(attr) = self.ns.getattr(dir) {
                self.dir_times.insert(dir, attr.mtime);
            }
        }
    }

    fn skip_if_moved_on(result: SysResult<()>) -> SysResult<bool> {
        match result {
            Ok(()) => Ok(true),
            Err(e) if means_state_moved_on(e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn create(&mut self, key: &[u8], parent: &[u8], name: &[u8], mode: u32, uid: u32, gid: u32) -> SysResult<bool> {
        let directory = is_directory(mode);
        // There, or made again by a replay that was interrupted (that file is this one).
        if self.object(key, if directory { Kind::Directory } else { Kind::File })?.is_some() {
            return Ok(false);
        }
        let shown = String::from_utf8_lossy(name).into_owned();
        let Some(dir) = self.directory(parent)? else {
            self.not_restored.push(format!("{shown}: its directory is gone"));
            return Ok(false);
        };
        if self.ns.key_at(dir, name_of(name))?.is_some() {
            self.not_restored.push(format!("{shown}: the name holds a later file"));
            return Ok(false);
        }
        let what = if directory {
            NewObject::Directory { perm: mode & 0o7777 }
        } else {
            NewObject::File { perm: mode & 0o7777 }
        };
        self.keep_time_of(dir);
        let attr = self.ns.make(dir, name_of(name), what, Owner { uid, gid })?;
        let new_key = self.ns.log_key(attr.id)?;
        let mut entry = Vec::new();
        for k in [key, new_key.as_slice()] {
            entry.extend_from_slice(&(k.len() as u32).to_le_bytes());
            entry.extend_from_slice(k);
        }
        self.device.append_map_synced(&entry)?;
        self.made_by_replay.insert(new_key.clone());
        self.recreated.insert(key.to_vec(), new_key);
        self.found.insert(key.to_vec(), Some(attr.id));
        self.recreated_files += 1;
        Ok(true)
    }

    /// Whether the store shows this name record's effect (see the module's step 1).
    fn shows(&mut self, record: &Record) -> SysResult<bool> {
        Ok(match record {
            // Only the store's own evidence counts: an object replay made (an interrupted one,
            // before this) is not the logged one, whatever key it has.
            Record::Create { file, .. } if self.made_by_replay.contains(file) || self.recreated.contains_key(file) => {
                false
            }
            record if is_pending_key(record.file()) => false,
            Record::Create { file, .. } => match self.ns.find(file) {
                Ok(Some(id)) => {
                    self.ns.forget(id, 1);
                    true
                }
                Ok(None) => false,
                Err(e) if means_state_moved_on(e) => false,
                Err(e) => return Err(e),
            },
            record => match put_by(record) {
                Some((object, parent, name)) => match self.directory(parent)? {
                    Some(dir) => self.names(dir, name, object)?,
                    None => false,
                },
                None => false,
            },
        })
    }

    /// Whether the store shows that this name record has not happened: the object a rename
    /// replaced, or the one an unlink removed, is still at the name. Surer than `shows`, which
    /// a rename back can fake (a -> b and b -> a, neither on the backend: the object at a looks
    /// renamed back); a replaced or unlinked file does not come back to its name.
    fn shows_not_happened(&mut self, record: &Record) -> SysResult<bool> {
        if is_pending_key(record.file()) {
            return Ok(false);
        }
        let Some((object, parent, name)) = removed_by(record) else { return Ok(false) };
        Ok(match self.directory(parent)? {
            Some(dir) => self.names(dir, name, object)?,
            None => false,
        })
    }

    /// Applies `record`, the log's `at`-th.
    fn apply(&mut self, at: usize, record: &Record) -> SysResult<bool> {
        match record {
            Record::Data { file, offset, bytes } => match self.file(file)? {
                Some(data) => {
                    super::writeback::write_range(self.store, &*data, *offset, bytes, self.metrics).map(|()| true)
                }
                None => Ok(false),
            },
            Record::Size { file, size } => match self.file(file)? {
                Some(data) => data.set_size(*size).map(|()| true),
                None => Ok(false),
            },
            Record::Attrs { file, mode, uid, gid, atime, mtime } => match self.object(file, Kind::File)? {
                Some(id) => {
                    let now = self.ns.getattr(id)?;
                    if (now.uid, now.gid) != (*uid, *gid) {
                        // First: a change of owner clears set-user-ID bits the mode then sets. A
                        // daemon that may not give files away keeps them its own, as it made them.
                        let owner = SetAttr { uid: Some(*uid), gid: Some(*gid), ..SetAttr::default() };
                        match self.ns.setattr(id, &owner) {
                            Err(Errno(libc::EPERM)) => {}
                            other => other?,
                        }
                    }
                    let times = TimesToSet { atime: Some(TimeToSet::At(*atime)), mtime: Some(TimeToSet::At(*mtime)) };
                    Self::skip_if_moved_on(
                        self.ns.setattr(id, &SetAttr { mode: Some(*mode), times, ..SetAttr::default() }),
                    )
                }
                None => Ok(false),
            },
            Record::Barrier { .. } | Record::NamesSynced { .. } => Ok(false),
            Record::Create { file, mode, .. } if is_directory(*mode) && !self.needed_dirs.contains(file.as_slice()) => {
                log::debug!("replay: directory {} is gone, and nothing the log restores is in it", describe_key(file));
                Ok(false)
            }
            Record::Create { file, mode, .. }
                if !is_directory(*mode) && !self.with_contents.contains(file.as_slice()) =>
            {
                log::debug!("replay: {} is gone, and the log holds nothing of it to restore", describe_key(file));
                Ok(false)
            }
            Record::Create { file, parent, name, mode, uid, gid } => self.create(file, parent, name, *mode, *uid, *gid),
            Record::Unlink { file, parent, name, directory } => {
                let Some(dir) = self.directory(parent)? else { return Ok(false) };
                if !self.names(dir, name, file)? {
                    return Ok(false);
                }
                self.keep_time_of(dir);
                Self::skip_if_moved_on(self.ns.remove(dir, name_of(name), *directory))
            }
            // The caller applies it only when no later record names the file (see `replay`).
            Record::Hidden { file, parent, name } => {
                let Some(dir) = self.directory(parent)? else { return Ok(false) };
                if !self.names(dir, name, file)? {
                    return Ok(false);
                }
                self.keep_time_of(dir);
                Self::skip_if_moved_on(self.ns.remove(dir, name_of(name), false))
            }
            // Evidence only (`put_back`, `shows`): a second name is durable by the backend sync
            // that acknowledges it (`note_backend_changed`), and making it here could bring back
            // a name later records took away (replaced by a rename, then unlinked).
            Record::Link { .. } => Ok(false),
            Record::Rename { file, from_parent, from_name, to_parent, to_name, replaced } => {
                let Some(to) = self.directory(to_parent)? else { return Ok(false) };
                let from = match self.directory(from_parent)? {
                    Some(from) if self.names(from, from_name, file)? => from,
                    _ if self.last_removal.get(file.as_slice()).is_some_and(|&later| later > at)
                        || self.moved_away_later(at, file, to_parent, to_name) =>
                    {
                        return self.remove_what_it_replaced(at, replaced, to, to_parent, to_name);
                    }
                    _ => return Ok(false),
                };
                let target_free = self.ns.key_at(to, name_of(to_name))?.is_none();
                if !target_free && (replaced.is_empty() || !self.names(to, to_name, replaced)?) {
                    return Ok(false); // the target holds a later object than the one replaced
                }
                self.keep_time_of(from);
                self.keep_time_of(to);
                Self::skip_if_moved_on(self.ns.rename(from, name_of(from_name), to, name_of(to_name), 0))
            }
        }
    }

    /// Whether a record after the `at`-th renames `object` away from `name` in `parent`.
    fn moved_away_later(&self, at: usize, object: &[u8], parent: &[u8], name: &[u8]) -> bool {
        let place = (object.to_vec(), parent.to_vec(), name.to_vec());
        self.last_move_away.get(&place).is_some_and(|&away| away > at)
    }

    /// A rename that cannot be applied because its source name no longer holds its object, an
    /// object a later record removes or renames away from the rename's target: the log says the name ends without what the rename
    /// replaced, so that (`replaced`) goes if it is still there, or it outlives its replacement
    /// and comes back after an acknowledged unlink. Whether replay made it again (from an
    /// earlier record the backend showed nothing of) or the backend kept it (its creation was
    /// durable, the rename and its file's creation were not), unless a later record puts it
    /// back at that name. (Without a later removal or move the object is gone because its
    /// creation never reached the backend, nor the rename: what the rename replaced is the
    /// older state to keep. With a later move away, the log says the name ends free of both,
    /// and a later file may be made there again: a file made at the name and fsynced must not
    /// find the replaced one in its place.) Returns whether it removed one.
    fn remove_what_it_replaced(
        &mut self,
        at: usize,
        replaced: &[u8],
        to: ObjectId,
        to_parent: &[u8],
        to_name: &[u8],
    ) -> SysResult<bool> {
        if replaced.is_empty() || !self.names(to, to_name, replaced)? {
            return Ok(false);
        }
        let put_back_later = || {
            let place = (replaced.to_vec(), to_parent.to_vec(), to_name.to_vec());
            self.last_put.get(&place).is_some_and(|&put| put > at)
        };
        if !self.recreated.contains_key(replaced) && put_back_later() {
            return Ok(false);
        }
        self.keep_time_of(to);
        let removed = Self::skip_if_moved_on(self.ns.remove(to, name_of(to_name), false))?;
        if removed {
            if let Some(Some(id)) = self.found.insert(replaced.to_vec(), None) {
                self.open.pop(&id);
                self.ns.forget(id, 1);
            }
            log::debug!("replay: {}, replaced by a rename whose file is gone: removed", describe_key(replaced));
        }
        Ok(removed)
    }

    /// A new file the log held (`pending`) that a checkpoint had made at `name` in `parent`
    /// (its last logged name) before the crash: that file is this one from now on (recorded in
    /// the replay map, as a file made again is). Returns whether there was one.
    fn adopt(&mut self, key: &[u8], parent: &[u8], name: &[u8]) -> SysResult<bool> {
        if self.recreated.contains_key(key) {
            return Ok(true); // an interrupted replay made or took it already
        }
        let Some(dir) = self.directory(parent)? else { return Ok(false) };
        let Some(holder) = self.ns.key_at(dir, name_of(name))? else { return Ok(false) };
        if self.made_by_replay.contains(&holder) || self.object(&holder, Kind::File)?.is_none() {
            return Ok(false);
        }
        let mut entry = Vec::new();
        for k in [key, holder.as_slice()] {
            entry.extend_from_slice(&(k.len() as u32).to_le_bytes());
            entry.extend_from_slice(k);
        }
        self.device.append_map_synced(&entry)?;
        // `object(key)` now finds the holder (looked up once more, and forgotten, as any).
        self.recreated.insert(key.to_vec(), holder);
        Ok(true)
    }

    /// Lets go of every object found.
    fn release(&mut self) {
        self.open.clear();
        for (dir, mtime) in std::mem::take(&mut self.dir_times) {
            if let Err(e) = super::names::give_back_mtime(self.ns, dir, mtime) {
                log::debug!("replay: inode {dir}: its mtime again: {e}");
            }
        }
        for id in self.found.values().flatten() {
            self.ns.forget(*id, 1);
        }
        self.found.clear();
    }
}

/// The map of files made again by earlier, interrupted replays of this log (logged handle ->
/// the new file's), kept beside the log on its device. A torn last entry (the replay died
/// writing it) is dropped: its file was not used yet.
fn read_replay_map(device: &dyn LogDevice) -> SysResult<HashMap<Vec<u8>, Vec<u8>>> {
    let bytes = device.read_map()?;
    let mut map = HashMap::new();
    let mut rest = bytes.as_slice();
    let take = |rest: &mut &[u8]| -> Option<Vec<u8>> {
        let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let key = rest.get(4..4 + len)?.to_vec();
        *rest = &rest[4 + len..];
        Some(key)
    };
    while let (Some(old), Some(new)) = (take(&mut rest), take(&mut rest)) {
        map.insert(old, new);
    }
    Ok(map)
}

pub fn replay(
    ns: &dyn Namespace,
    store: &dyn UnitStore,
    log: IntentLog,
    batches: &[Batch],
    metrics: &Arc<Metrics>,
) -> SysResult<IntentLog> {
    if batches.is_empty() {
        // A map left by a replay that emptied the log and stopped before removing it.
        let _ = log.device().remove_map();
        return Ok(log);
    }
    let records: Vec<&Record> = batches.iter().flat_map(|b| &b.records).collect();
    if log::log_enabled!(log::Level::Debug) {
        let mut first = 0;
        for batch in batches {
            log::debug!("replay: batch {} holds records {first}..{}", batch.seq, first + batch.records.len());
            first += batch.records.len();
        }
    }
    let last_barrier = last_barriers(&records);
    let recreated = read_replay_map(log.device())?;
    let mut replay = Replay {
        ns,
        store,
        metrics,
        device: log.device(),
        found: HashMap::new(),
        open: lru::LruCache::new(std::num::NonZeroUsize::new(OPEN_FILES_MAX).expect("not zero")),
        made_by_replay: recreated.values().cloned().collect(),
        recreated,
        with_contents: with_contents(&records, &last_barrier),
        needed_dirs: HashSet::new(),
        last_removal: last_removals(&records),
        last_put: last_puts(&records),
        last_move_away: last_moves_away(&records),
        dir_times: HashMap::new(),
        applied: 0,
        recreated_files: 0,
        not_restored: Vec::new(),
    };
    let held_ends = held_file_ends(&records);
    replay.needed_dirs = needed_directories(&records, &replay.with_contents, &held_ends);
    // The backend holds every name change up to the last one a directory's sync covered: its
    // evidence about those is no evidence (a later change may have put a name back).
    let after_synced = names_synced_through(&records, batches).map_or(0, |s| s + 1);
    let backend_holds_names_up_to = replay.names_the_backend_holds(&records, after_synced)?;
    replay.apply_to_backend_objects(&records, &last_barrier, backend_holds_names_up_to.max(after_synced))?;
    replay.apply_to_held_files(&records, &held_ends)?;
    replay.release();
    store.sync_all()?;
    log.checkpoint(log.next_seq()).map_err(|e| {
        log::error!("{e}");
        Errno(libc::EIO)
    })?;
    // The log is empty: nothing will look the made-again files up by their old handles.
    log.device().remove_map()?;
    metrics.log_replayed_records.fetch_add(replay.applied, Ordering::Relaxed);
    log::warn!(
        "the last mount did not end cleanly: replayed the intent log {} ({} batches, {} records): {} applied, \
         {} already on the backend or made moot by a later record (markers included), {} files made again",
        log.device().describe(),
        batches.len(),
        records.len(),
        replay.applied,
        records.len() as u64 - replay.applied,
        replay.recreated_files,
    );
    for what in &replay.not_restored {
        log::warn!("intent log: a file created before the crash was not made again: {what}");
    }
    Ok(log)
}

impl<'r> Replay<'r> {
    /// How far the backend holds the log's name changes: the index of the last one it shows
    /// before the first it shows has not happened (it holds a prefix of them: none past one it
    /// shows has not happened, unless a later record puts the removed object back at its name).
    /// Records from `after_synced` on are asked; those before it a directory's sync covered.
    fn names_the_backend_holds(&mut self, records: &[&Record], after_synced: usize) -> SysResult<usize> {
        let mut not_happened_from = records.len();
        for (i, r) in records.iter().enumerate().skip(after_synced) {
            let put_back_later = || {
                removed_by(r).is_some_and(|(object, parent, name)| put_back(&records[i + 1..], object, parent, name))
            };
            if r.is_namespace() && self.shows_not_happened(r)? && !put_back_later() {
                not_happened_from = i;
                break;
            }
        }
        let mut backend_holds_names_up_to = 0;
        for (i, r) in records.iter().enumerate().take(not_happened_from) {
            if r.is_namespace() && self.shows(r)? {
                backend_holds_names_up_to = i;
            }
        }
        Ok(backend_holds_names_up_to)
    }

    /// Every record but those of new files the log held, in order: contents after the file's
    /// last Barrier, name changes from `names_from` on (the backend holds those before it).
    fn apply_to_backend_objects(
        &mut self,
        records: &[&Record],
        last_barrier: &HashMap<&[u8], usize>,
        names_from: usize,
    ) -> SysResult<()> {
        for (i, r) in records.iter().enumerate() {
            if is_pending_key(r.file()) {
                continue; // `apply_to_held_files`, after the rest
            }
            let contents = matches!(r, Record::Data { .. } | Record::Size { .. } | Record::Attrs { .. });
            if contents && last_barrier.get(r.file()).is_some_and(|&b| i <= b) {
                log::debug!("replay {i}: before its file's last barrier: {}", r.describe());
                continue;
            }
            if let Record::Hidden { file, parent, name } = r {
                // Its backend unlink waited for a checkpoint, so the backend may hold later
                // changes and not this one: applied wherever it stands, unless a later rename
                // put the same object back at the name (through another hard link of it).
                let renamed_back = put_back(&records[i + 1..], file, parent, name);
                let applied = !renamed_back && self.apply(i, r)?;
                self.applied += u64::from(applied);
                log::debug!("replay {i}: {} {}", if applied { "applied" } else { "skipped" }, r.describe());
                continue;
            }
            if r.is_namespace() && i < names_from {
                // The file of a Create the backend has gone past: its records find it by handle
                // (or it is gone, and they are dropped).
                log::debug!("replay {i}: behind the backend: {}", r.describe());
                continue;
            }
            let applied = self.apply(i, r)?;
            self.applied += u64::from(applied);
            log::debug!("replay {i}: {} {}", if applied { "applied" } else { "skipped" }, r.describe());
        }
        Ok(())
    }

    /// New files the log held, last: each is made at the first name its records leave it with
    /// (or taken at any of them, made by a checkpoint), which the records before may have
    /// freed (the unlink of a backend file a held one was renamed over), then given its bytes
    /// and attributes, then linked at its other names.
    fn apply_to_held_files(
        &mut self,
        records: &[&Record],
        held_ends: &HashMap<&[u8], Vec<LastName<'_>>>,
    ) -> SysResult<()> {
        for (key, names) in held_ends {
            for (parent, name) in names {
                if self.adopt(key, parent, name)? {
                    log::debug!("replay: new file {} found made at one of its last names", describe_key(key));
                    break;
                }
            }
        }
        for (i, r) in records.iter().enumerate().filter(|(_, r)| is_pending_key(r.file())) {
            let Some(&(parent, name)) = held_ends.get(r.file()).and_then(|names| names.first()) else {
                log::debug!("replay {i}: a new file the log saw unlinked or made durably: {}", r.describe());
                continue;
            };
            let applied = match r {
                Record::Create { file, mode, uid, gid, .. } => self.create(file, parent, name, *mode, *uid, *gid)?,
                r if r.is_namespace() => false, // its renames and links: made at its last names
                r => self.apply(i, r)?,
            };
            self.applied += u64::from(applied);
            log::debug!("replay {i}: new file, {}: {}", if applied { "applied" } else { "skipped" }, r.describe());
        }
        for (key, names) in held_ends.iter().filter(|(_, names)| names.len() > 1) {
            for (parent, name) in names {
                self.link_held_name(key, parent, name)?;
            }
        }
        Ok(())
    }

    /// A hard link a new file the log held ends with: made at `name` in `parent` unless the
    /// name holds it already (a checkpoint made it with the file); one that holds another
    /// object is left to it, as a Create leaves it.
    fn link_held_name(&mut self, key: &[u8], parent: &[u8], name: &[u8]) -> SysResult<()> {
        let shown = String::from_utf8_lossy(name).into_owned();
        let Some(id) = self.object(key, Kind::File)? else { return Ok(()) };
        let Some(dir) = self.directory(parent)? else {
            self.not_restored.push(format!("{shown} (a hard link): its directory is gone"));
            return Ok(());
        };
        match self.ns.key_at(dir, name_of(name))? {
            Some(holder) if Some(holder.as_slice()) == self.current_key(key) => Ok(()),
            Some(_) => {
                self.not_restored.push(format!("{shown} (a hard link): the name holds a later file"));
                Ok(())
            }
            None => {
                self.keep_time_of(dir);
                self.ns.link(id, dir, name_of(name))?;
                self.ns.forget(id, 1);
                self.applied += 1;
                log::debug!("replay: new file {} linked as {shown}", describe_key(key));
                Ok(())
            }
        }
    }
}

/// `coalescefs recover`: applies every intact batch of a damaged intent log and empties the
/// log. Returns a line for each batch that could not be read.
pub fn salvage_log(
    ns: &dyn Namespace,
    store: &dyn UnitStore,
    device: Box<dyn LogDevice>,
    volatile_tail: Option<VolatileTail>,
) -> Result<Vec<String>, String> {
    let metrics = Arc::new(Metrics::default());
    let name = device.describe();
    let (mut log, mut batches, lost) =
        IntentLog::salvage(device, metrics.clone()).map_err(|e| format!("{name}: {e}"))?;
    // What a killed daemon kept in the volatile tail follows the log's last batch, as at a
    // mount; left there, a later mount would apply it over what this recovery made.
    if let Some(tail) = volatile_tail {
        let shown = tail.path().display().to_string();
        log.adopt_volatile_tail(tail, false, &mut batches).map_err(|e| format!("{shown}: {e}"))?;
    }
    let (batches, watermark) = after_watermark(ns, store, false, batches, &metrics)?;
    replay(ns, store, log, &batches, &metrics).map_err(|e| format!("replaying {name}: {e}"))?;
    forget_watermark(ns, store, watermark)?;
    Ok(lost)
}

/// The batches replay applies: those from the store's replay watermark on, where it keeps one
/// (contract rule 7: the checkpoint that set it committed everything before it, and a crash
/// stopped the log's release). A log made just now is not the one the watermark counts in:
/// nothing of it is skipped. Returns the watermark read, for `forget_watermark`.
fn after_watermark(
    ns: &dyn Namespace,
    store: &dyn UnitStore,
    created: bool,
    batches: Vec<Batch>,
    metrics: &Metrics,
) -> Result<(Vec<Batch>, Option<u64>), String> {
    if !store.capabilities().keeps_replay_watermark {
        return Ok((batches, None));
    }
    let watermark = ns.replay_watermark().map_err(|e| format!("reading the store's replay watermark: {e}"))?;
    let Some(first) = watermark.filter(|_| !created) else { return Ok((batches, watermark)) };
    let (below, kept): (Vec<Batch>, Vec<Batch>) = batches.into_iter().partition(|b| b.seq < first);
    if !below.is_empty() {
        log::info!(
            "replay: the store holds every batch before {first} (its last checkpoint committed them; the log's \
             release did not happen): {} batches not replayed, {} replayed",
            below.len(),
            kept.len()
        );
        metrics.log_batches_below_watermark.fetch_add(below.len() as u64, Ordering::Relaxed);
    }
    Ok((kept, watermark))
}

/// After replay (the log empty): the watermark forgotten, durably, before the log takes a
/// batch. A log that lost batches to a power cut (written unflushed, before a checkpoint
/// committed them into the store) numbers its next batches below the watermark, which would
/// then hide them from the next replay.
fn forget_watermark(ns: &dyn Namespace, store: &dyn UnitStore, watermark: Option<u64>) -> Result<(), String> {
    if watermark.is_none() {
        return Ok(());
    }
    ns.set_replay_watermark(None)
        .and_then(|()| store.sync_all())
        .map_err(|e| format!("forgetting the store's replay watermark: {e}"))
}

/// Opens the intent log and applies what it holds after its checkpoint (see `replay`), so the
/// log starts empty.
pub(super) fn recover_from_log(
    ns: &dyn Namespace,
    store: &dyn UnitStore,
    setup: LogSetup,
    metrics: &Arc<Metrics>,
) -> Result<IntentLog, String> {
    let name = setup.device.describe();
    let flushed_by_backend = setup.flushed_by_backend;
    let (mut log, mut batches) =
        IntentLog::open(setup.device, setup.created, metrics.clone()).map_err(|e| match e {
            LogError::Corrupt(_) => format!(
                "{name}: {e}; nothing was replayed or changed. `coalescefs recover` (of this source, with this \
             log's state directory) applies every intact batch and empties the log"
            ),
            _ => format!("{name}: {e}"),
        })?;
    log.set_flushed_by_backend(flushed_by_backend);
    if let Some(tail) = setup.volatile_tail {
        let shown = tail.path().display().to_string();
        log.adopt_volatile_tail(tail, setup.created, &mut batches).map_err(|e| format!("{shown}: {e}"))?;
    }
    let (batches, watermark) = after_watermark(ns, store, setup.created, batches, metrics)?;
    let log = replay(ns, store, log, &batches, metrics).map_err(|e| format!("replaying the intent log {name}: {e}"))?;
    forget_watermark(ns, store, watermark)?;
    Ok(log)
}
