//! The namespace side of the engine: names, attributes, links, renames, directories and
//! their listings, extended attributes. Each call checks what the kernel cannot (the hidden
//! names), keeps the write buffer's view and the store's in step (sizes, times, removals), and
//! queues the name changes the intent log must carry.

use std::ffi::OsStr;
use std::sync::{Arc, Mutex};

use super::handles::OpenDir;
use super::intent_log::format::Record;
use super::pending::Held;
use super::types::{
    Attr, Kind, NewObject, ObjectId, Owner, SetAttr, StatFs, TimeToSet, Timestamp, XattrReply, ROOT_ID,
};
use super::{lock, AttrChanges, Caller, Engine, ListedEntry};
use crate::backend::OpenMode;
use crate::sys::{Errno, SysResult};

/// The names a held file takes before a further link makes it on the backend (where the
/// backing file system's own limit, EMLINK, applies at the link): the checkpoint makes each
/// name, and replay each again, so their number is bounded here rather than by the backend.
const HELD_NAMES_MAX: usize = 32;

/// Directory entries read from the backend for one readdir request: about what a 4 KiB
/// request holds when names are short (a readdirplus request holds fewer).
const READDIR_BATCH: usize = 128;

/// What a rename of a file only memory and the log hold finds at its new name.
#[derive(Clone, Copy)]
enum HeldRenameTarget {
    Free,
    /// A file memory and the log hold too: it goes as an unlink of it would.
    Held(ObjectId),
    /// A file the backend holds: hidden, its backend unlink left to the checkpoint.
    Backend(ObjectId),
}

impl Engine {
    pub fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr> {
        self.checked_name(parent, name, false)?;
        Ok(self.finish_attr(self.ns.lookup(parent, name)?))
    }

    pub fn forget(&self, id: ObjectId, count: u64) {
        // The kernel forgets an object once, when it lets its inode go.
        lock(&self.deleted_attrs).remove(&id);
        self.writeback.forget(id, count);
    }

    pub fn getattr(&self, id: ObjectId) -> SysResult<Attr> {
        match self.ns.getattr(id) {
            Ok(attr) => Ok(self.finish_attr(attr)),
            Err(e @ Errno(libc::ESTALE | libc::ENOENT)) => lock(&self.deleted_attrs).get(&id).cloned().ok_or(e),
            Err(e) => Err(e),
        }
    }

    pub fn setattr(&self, id: ObjectId, fh: Option<u64>, changes: AttrChanges) -> SysResult<Attr> {
        match self.setattr_now(id, fh, changes) {
            // A deleted file the backend no longer finds (`deleted_attrs`): its times are set
            // where anybody could still see them, the kernel's copy.
            Err(e @ Errno(libc::ESTALE | libc::ENOENT)) if changes.times_only() => {
                let mut deleted = lock(&self.deleted_attrs);
                let attr = deleted.get_mut(&id).ok_or(e)?;
                let now = Timestamp::now();
                let times = changes.times.resolved(now);
                if let Some(TimeToSet::At(at)) = times.atime {
                    attr.atime = at;
                }
                if let Some(TimeToSet::At(at)) = times.mtime {
                    attr.mtime = at;
                }
                attr.ctime = now;
                Ok(attr.clone())
            }
            result => result,
        }
    }

    fn setattr_now(&self, id: ObjectId, fh: Option<u64>, changes: AttrChanges) -> SysResult<Attr> {
        if changes.drop_set_id_bits && changes.mode.is_none() {
            self.drop_set_id_bits(id)?;
        }
        if changes.uid.is_some() || changes.gid.is_some() || changes.mode.is_some() {
            let owner_and_mode =
                SetAttr { mode: changes.mode, uid: changes.uid, gid: changes.gid, ..SetAttr::default() };
            self.ns.setattr(id, &owner_and_mode)?;
        }
        if let Some(size) = changes.size {
            // A held file lives in memory: one made larger than the log takes for a new file
            // is made on the backend first (`truncate -s 100G` must not take 100 GiB of it).
            if size > self.config.writeback.log_threshold_new_bytes {
                self.make_real(id)?;
            }
            let state = match fh {
                Some(fh) => self.open_file(fh)?.state.clone(),
                None => self.writeback.file(id),
            };
            match state {
                Some(state) => self.writeback.set_size(&state, size)?,
                None => {
                    self.store.open(id, OpenMode { write: true, no_atime: false })?.set_size(size)?;
                    self.writeback.note_backend_changed(id);
                }
            }
        }
        if !changes.times.is_empty() {
            // "Now" is fixed here: flushes may set the times again later (see note_times_set).
            let resolved = changes.times.resolved(Timestamp::now());
            let state = self.writeback.file(id);
            if state.as_ref().is_some_and(|state| self.writeback.defer_times(state, resolved)) {
                return self.getattr(id);
            }
            // Flushes still to come set them again, unchanged ones too. Noted before the
            // backend is given them: a flush whose write lands after the backend took them and
            // ends before they were noted would leave the backend with the flush's time (the
            // posix_ops times tests failed that way about once in thirty runs).
            if let Some(state) = &state {
                self.writeback.note_times_set(state, resolved);
            }
            // The kernel's writeback cache sends the times it kept at every close, the same
            // as the file's more often than not (a file renamed over): setting them again
            // would cost the backend a journal commit for nothing.
            let now = self.ns.getattr(id)?;
            let mut times = resolved;
            let unchanged =
                |t: Option<TimeToSet>, current: Timestamp| matches!(t, Some(TimeToSet::At(at)) if at == current);
            if unchanged(times.atime, now.atime) {
                times.atime = None;
            }
            if unchanged(times.mtime, now.mtime) {
                times.mtime = None;
            }
            if !times.is_empty() {
                self.ns.setattr(id, &SetAttr { times, ..SetAttr::default() })?;
            }
        }
        self.getattr(id)
    }

    /// The FUSE adapter negotiates FUSE_HANDLE_KILLPRIV_V2, so clearing set-user-ID and
    /// set-group-ID after an unprivileged write or truncate is ours to do (otherwise the kernel
    /// asks for security.capability before every single write, one more round trip each).
    /// The kernel's own rule (setattr_should_drop_suidgid): set-user-ID always; set-group-ID only
    /// with group execute, since without it the bit marks mandatory locking, not privilege.
    pub(super) fn drop_set_id_bits(&self, id: ObjectId) -> SysResult<()> {
        let attr = self.ns.getattr(id)?;
        if attr.kind != Kind::File {
            return Ok(());
        }
        let mode = attr.perm;
        let mut kept = mode & !libc::S_ISUID;
        if mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            kept &= !libc::S_ISGID;
        }
        if kept != mode {
            self.ns.setattr(id, &SetAttr { mode: Some(kept), ..SetAttr::default() })?;
        }
        Ok(())
    }

    pub fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        self.ns.readlink(id)
    }

    /// Makes an object on a user's behalf (it belongs to that user, see `Namespace::make`),
    /// and tells the write buffer and the log of a regular file made.
    pub(super) fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, caller: Caller) -> SysResult<Attr> {
        self.checked_name(parent, name, true)?;
        let owner = Owner { uid: caller.uid, gid: caller.gid };
        if let (Some(held), NewObject::File { perm }) = (&self.pending, &what) {
            if self.writeback.may_hold_new_file(parent) {
                // Only memory holds it until its close or fsync logs it, and the backend makes
                // it at the next checkpoint (`pending`).
                let attr = held.make(parent, name, *perm, owner)?;
                self.writeback.note_created(attr.id, Some(parent), None);
                return Ok(self.finish_attr(attr));
            }
        }
        let attr = self.ns.make(parent, name, what, owner)?;
        match attr.kind {
            Kind::File => {
                let record = self.create_record(attr.id, parent, name, &attr);
                self.writeback.note_created(attr.id, Some(parent), record);
            }
            // Logged as files are: new files in it may then live in the log as in an older
            // directory, and replay makes it again for them when the backend lost it.
            Kind::Directory => {
                let record = self.create_record(attr.id, parent, name, &attr);
                let named_in = record.as_ref().map(|_| parent);
                self.writeback.note_created(attr.id, named_in, record);
            }
            _ => {}
        }
        Ok(self.finish_attr(attr))
    }

    pub fn mknod(&self, parent: ObjectId, name: &OsStr, mode: u32, rdev: u64, caller: Caller) -> SysResult<Attr> {
        let what = match mode & libc::S_IFMT {
            libc::S_IFREG | 0 => NewObject::File { perm: mode & 0o7777 },
            _ => NewObject::Node { mode, rdev },
        };
        self.make(parent, name, what, caller)
    }

    pub fn mkdir(&self, parent: ObjectId, name: &OsStr, mode: u32, caller: Caller) -> SysResult<Attr> {
        self.make(parent, name, NewObject::Directory { perm: mode & 0o7777 }, caller)
    }

    pub fn symlink(&self, parent: ObjectId, name: &OsStr, target: &[u8], caller: Caller) -> SysResult<Attr> {
        if target.contains(&0) {
            return Err(Errno(libc::EINVAL));
        }
        self.make(parent, name, NewObject::Symlink { target }, caller)
    }

    pub fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        self.checked_name(new_parent, new_name, true)?;
        if let Some(attr) = self.link_held(id, new_parent, new_name)? {
            return Ok(self.finish_attr(attr));
        }
        self.make_real(id)?;
        let attr = self.ns.link(id, new_parent, new_name)?;
        // The log records one name per file: a second one only a backend sync makes durable.
        // Its Link record is for replay, so that an earlier removal of the object from the same
        // name (unlinked, then linked back) is not taken for one the backend has not done yet.
        self.writeback.note_backend_changed(id);
        let record = self.writeback.logging().then(|| self.link_record(id, new_parent, new_name)).flatten();
        self.writeback.note_names_changed(record, None, &[id]);
        Ok(self.finish_attr(attr))
    }

    /// A hard link of a held file the log knows, kept held: its Link record under the file's
    /// held key, and the checkpoint makes the file with all its names. git links each object
    /// it wrote and fsynced (core.fsync) into place, then unlinks the temporary name: made on
    /// the backend for the link, each object cost a journal commit, synced with its directory,
    /// and a barrier in the log. Into its own directories, or one replay can make it in; None
    /// for anything else, which the caller makes on the backend first.
    fn link_held(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Option<Attr>> {
        let Some(held) = &self.pending else { return Ok(None) };
        if !matches!(held.status(id), Held::Logged(_)) {
            return Ok(None);
        }
        let parents = held.parents_of(id);
        if parents.len() >= HELD_NAMES_MAX
            || !parents.contains(&new_parent) && !self.writeback.may_name_held_file(new_parent)
        {
            return Ok(None);
        }
        let parent = self.ns.log_key(new_parent)?;
        // Under the gate, as a rename: a checkpoint makes the file with the names it has then.
        let _gate = held.names_gate.read();
        let (attr, key) = match held.link(id, new_parent, new_name) {
            Ok(linked) => linked,
            // Made on the backend meanwhile (a flush grew it past the log's bound).
            Err(Errno(libc::ENOENT)) if !held.is_held(id) => return Ok(None),
            Err(e) => return Err(e),
        };
        let record = Record::Link { file: key, parent, name: new_name.as_encoded_bytes().to_vec() };
        // Queued: durable with the log's next batch, as ext4 makes a link with its next commit.
        self.writeback.note_names_changed(Some(record), None, &[]);
        Ok(Some(attr))
    }

    /// For the intent log: the record of a regular file's or a directory's creation, queued when
    /// it happens, so that the log holds names in the order they came to be (replay relies on it).
    fn create_record(&self, id: ObjectId, parent: ObjectId, name: &OsStr, attr: &Attr) -> Option<Record> {
        if !self.writeback.logging() {
            return None;
        }
        Some(Record::Create {
            file: self.ns.log_key(id).ok()?,
            parent: self.ns.log_key(parent).ok()?,
            name: name.as_encoded_bytes().to_vec(),
            mode: attr.mode(),
            uid: attr.uid,
            gid: attr.gid,
        })
    }

    fn link_record(&self, id: ObjectId, parent: ObjectId, name: &OsStr) -> Option<Record> {
        Some(Record::Link {
            file: self.ns.log_key(id).ok()?,
            parent: self.ns.log_key(parent).ok()?,
            name: name.as_encoded_bytes().to_vec(),
        })
    }

    /// For the intent log: what `name` in `parent` is now (its key and id), if anything,
    /// before a change removes or replaces it.
    fn named_object(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<(Vec<u8>, ObjectId)>> {
        if !self.writeback.logging() {
            return Ok(None);
        }
        self.ns.identify(parent, name)
    }

    /// The id at `name` in `parent`: what `named_object` found, or with the log off, where it
    /// looks nothing up, a lookup now.
    fn found_or_identified(
        &self,
        found: &Option<(Vec<u8>, ObjectId)>,
        parent: ObjectId,
        name: &OsStr,
    ) -> SysResult<Option<ObjectId>> {
        match found {
            Some((_, id)) => Ok(Some(*id)),
            None if self.writeback.logging() => Ok(None),
            None => Ok(self.ns.identify(parent, name)?.map(|(_, id)| id)),
        }
    }

    pub fn unlink(&self, parent: ObjectId, name: &OsStr) -> SysResult<()> {
        self.remove(parent, name, false)
    }

    pub fn rmdir(&self, parent: ObjectId, name: &OsStr) -> SysResult<()> {
        self.remove(parent, name, true)
    }

    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()> {
        self.checked_name(parent, name, false)?;
        let gate = self.pending.as_ref().map(|held| held.names_gate.read());
        let held = self.pending.as_ref().filter(|_| !directory).and_then(|held| held.id_named(parent, name));
        if let Some(held) = held {
            match self.unlink_held(held, parent, name) {
                // Made on the backend meanwhile (a flush grew it past the log's bound).
                Err(Errno(libc::ENOENT)) if !self.pending.as_ref().is_some_and(|h| h.is_held(held)) => {}
                Err(e) => return Err(e),
                Ok(record) => {
                    if let Some(record) = record {
                        self.writeback.commit_names_now(vec![record], false, gate);
                    }
                    return Ok(());
                }
            }
        }
        if let Some((record, id)) = self.remove_on_backend(parent, name, directory)? {
            self.writeback.note_names_changed(Some(record), None, &[id]);
        }
        Ok(())
    }

    /// The backend's `name` in `parent` removed and the write buffer told. Returns, with the
    /// log on, the Unlink record and the object it removed, for the caller to log.
    fn remove_on_backend(
        &self,
        parent: ObjectId,
        name: &OsStr,
        directory: bool,
    ) -> SysResult<Option<(Record, ObjectId)>> {
        let removed = self.named_object(parent, name)?;
        if let Some((_, id)) = removed.as_ref().filter(|_| !directory) {
            self.writeback.settle_made(*id, true)?;
        }
        let lingering = if directory { None } else { self.lingering_at(parent, name)? };
        let removed_file = if directory { None } else { self.found_or_identified(&removed, parent, name)? };
        self.removing_last_name(removed_file, || self.ns.remove(parent, name, directory))?;
        self.forget_if_gone(lingering);
        let (Some((key, id)), Ok(parent_key)) = (removed, self.ns.log_key(parent)) else { return Ok(None) };
        let record =
            Record::Unlink { file: key, parent: parent_key, name: name.as_encoded_bytes().to_vec(), directory };
        Ok(Some((record, id)))
    }

    /// The file at `name` in `parent`, if it was released with data still buffered (its flush
    /// refused, or not yet due: changes the log took at close wait for the checkpoint): once
    /// its last name goes (`forget_if_gone`), that data can never be read, and writing it
    /// would find the backend's file gone (ESTALE, at every retry and every checkpoint).
    /// Looked up only when there is such a file.
    fn lingering_at(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<ObjectId>> {
        if !self.writeback.has_lingering_files() {
            return Ok(None);
        }
        Ok(self.ns.identify(parent, name)?.map(|(_, id)| id).filter(|&id| self.writeback.is_lingering(id)))
    }

    /// After the backend removed or replaced a name of `lingering` (`lingering_at`): if that was
    /// its last, its buffered data and descriptors go, so the backend frees its space.
    fn forget_if_gone(&self, lingering: Option<ObjectId>) {
        if let Some(id) = lingering.filter(|&id| self.writeback.has_no_name(id)) {
            self.writeback.forget_file(id);
        }
    }

    /// Before a change that removes a name of `id`: if it is a regular file's last, its
    /// attributes as they will be after it (no link left), for the kernel's last questions about
    /// it (`deleted_attrs`). Read now, while the backend still finds the file.
    fn remember_if_last_name(&self, id: ObjectId) {
        let Ok(attr) = self.ns.getattr(id) else { return };
        if attr.kind == Kind::File && attr.nlink == 1 {
            let mut attr = self.finish_attr(attr);
            attr.nlink = 0;
            attr.ctime = Timestamp::now();
            lock(&self.deleted_attrs).insert(id, attr);
        }
    }

    /// `change`, a backend change that may take the last name of the file `id`: its attributes
    /// remembered first (`remember_if_last_name`), and forgotten again if the change fails while
    /// the backend still finds the file. (Entries are otherwise dropped at `forget`, which the
    /// kernel sends soon after a deleted file's last user lets it go: the map holds about as
    /// many entries as there are deleted files still open.)
    fn removing_last_name(&self, id: Option<ObjectId>, change: impl FnOnce() -> SysResult<()>) -> SysResult<()> {
        let Some(id) = id else { return change() };
        self.remember_if_last_name(id);
        change().inspect_err(|_| {
            if self.ns.getattr(id).is_ok() {
                lock(&self.deleted_attrs).remove(&id);
            }
        })
    }

    pub fn rename(
        &self,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        flags: u32,
    ) -> SysResult<()> {
        self.checked_name(parent, name, false)?;
        self.checked_name(new_parent, new_name, true)?;
        if let Some(held) = &self.pending {
            let source = held.id_named(parent, name);
            // What the target name holds, where a held source may go there; else only whether
            // it is a held file (which must be made on the backend first).
            let target = match source {
                Some(_) => self.ns.identify(new_parent, new_name)?.map(|(_, id)| id),
                None => held.id_named(new_parent, new_name),
            };
            if let Some(source) = source {
                if target == Some(source) {
                    return Ok(()); // one object, two names of it: nothing to do (see below)
                }
                // Over a regular file, a held file the log knows takes the name and the target
                // goes as an unlink would: no backend file is made for it, as a rename to a free
                // name. (One the log does not know could then be lost with the target's name:
                // a rename leaves the name with the old file or the new one.)
                let replaceable = || {
                    matches!(held.status(source), Held::Logged(_))
                        && target.is_some_and(|t| self.ns.getattr(t).is_ok_and(|a| a.kind == Kind::File))
                };
                let plain = flags & !libc::RENAME_NOREPLACE == 0;
                // Into a directory the backend holds durably, or one the log can make again (as
                // `make` holds a new file there): replay makes such a directory again for a held
                // file that ends up in it. Elsewhere the file is made on the backend first.
                let new_parent_durable = new_parent == parent || self.writeback.may_hold_new_file(new_parent);
                if plain && new_parent_durable && (target.is_none() || flags == 0 && replaceable()) {
                    if let Some(target) = target {
                        self.remember_if_last_name(target);
                    }
                    let gate = held.names_gate.read();
                    let mut records = Vec::new();
                    let renamed = self.rename_held(source, target, parent, name, new_parent, new_name, &mut records);
                    // On failure too: the target may be gone all the same, and the log must say so.
                    if records.is_empty() {
                        drop(gate); // taken again below: a read under a waiting writer would wait forever
                    } else {
                        self.writeback.commit_names_now(records, true, Some(gate));
                    }
                    match renamed {
                        // Made on the backend meanwhile (a flush grew it past the log's bound).
                        Err(Errno(libc::ENOENT)) if !held.is_held(source) => {}
                        Err(e) => return Err(e),
                        Ok(()) => return Ok(()),
                    }
                }
            }
            // Anything else a held file takes part in happens on the backend: the held files
            // at the two names now (a checkpoint may have made the source since it was looked
            // up, after the attempt above unlinked a held target from memory: that one is gone).
            let at_names = [held.id_named(parent, name), held.id_named(new_parent, new_name)];
            for id in at_names.into_iter().flatten() {
                self.make_real(id)?;
            }
        }
        let _gate = self.pending.as_ref().map(|held| held.names_gate.read());
        let moved = self.named_object(parent, name)?;
        let replaced = self.named_object(new_parent, new_name)?;
        for (_, id) in moved.iter().chain(&replaced) {
            self.writeback.settle_made(*id, true)?;
        }
        let lingering =
            if flags & libc::RENAME_EXCHANGE == 0 { self.lingering_at(new_parent, new_name)? } else { None };
        // The file the new name held, unless the rename swaps the two or both names are the
        // same file; the moved name looked up only when there is one (a rename to a free name,
        // rsync's, costs one lookup with the log off).
        let mut replaced_file = None;
        if flags & libc::RENAME_EXCHANGE == 0 {
            if let Some(replaced_id) = self.found_or_identified(&replaced, new_parent, new_name)? {
                if self.found_or_identified(&moved, parent, name)? != Some(replaced_id) {
                    replaced_file = Some(replaced_id);
                }
            }
        }
        self.removing_last_name(replaced_file, || self.ns.rename(parent, name, new_parent, new_name, flags))?;
        self.forget_if_gone(lingering);
        let Some((key, id)) = moved else { return Ok(()) };
        if replaced.as_ref().is_some_and(|(_, replaced_id)| *replaced_id == id) {
            // Both names are the same object (one name, or two hard links of one file): POSIX
            // rename does nothing then, and nothing may be recorded. A Rename record here would
            // show its effect on the backend whatever was durable, and replay, which starts
            // after the last record the backend shows, would skip the names queued before it
            // (the engine model test found a fsynced file lost that way).
            return Ok(());
        }
        if flags & libc::RENAME_EXCHANGE != 0 {
            let replaced_id = replaced.map(|(_, id)| id);
            // Two names swapped: the log has no record for it, so only a backend sync makes
            // either durable.
            let both: Vec<ObjectId> = [Some(id), replaced_id].into_iter().flatten().collect();
            for &one in &both {
                self.writeback.note_backend_changed(one);
            }
            self.writeback.note_names_changed(None, None, &both);
            return Ok(());
        }
        let (Ok(from_parent), Ok(to_parent)) = (self.ns.log_key(parent), self.ns.log_key(new_parent)) else {
            return Ok(());
        };
        let (replaced_key, replaced_id) = replaced.map_or((Vec::new(), None), |(k, id)| (k, Some(id)));
        let record = Record::Rename {
            file: key,
            from_parent,
            from_name: name.as_encoded_bytes().to_vec(),
            to_parent,
            to_name: new_name.as_encoded_bytes().to_vec(),
            replaced: replaced_key,
        };
        self.writeback.note_names_changed(
            Some(record),
            Some((id, new_parent)),
            &replaced_id.into_iter().collect::<Vec<_>>(),
        );
        Ok(())
    }

    /// Unlinks a file only memory and the log hold. If the log knows it, returns the Unlink
    /// record the caller commits before it answers (replay would make the file again).
    fn unlink_held(&self, id: ObjectId, parent: ObjectId, name: &OsStr) -> SysResult<Option<Record>> {
        let held = self.pending.as_ref().expect("held files exist with the log");
        self.remember_if_last_name(id);
        let logged = held.unlink(parent, name)?;
        self.after_held_unlink(id);
        self.unlink_record(logged, parent, name)
    }

    /// The Unlink record of a held file's name, if the log knows the file (`logged`: its key).
    fn unlink_record(&self, logged: Option<Vec<u8>>, parent: ObjectId, name: &OsStr) -> SysResult<Option<Record>> {
        let Some(file) = logged else { return Ok(None) };
        let parent = self.ns.log_key(parent)?;
        Ok(Some(Record::Unlink { file, parent, name: name.as_encoded_bytes().to_vec(), directory: false }))
    }

    /// After a held file lost a name: its buffered state goes with its last name (a held file
    /// may have hard links), and the log's bookkeeping of its names changes.
    fn after_held_unlink(&self, id: ObjectId) {
        let held = self.pending.as_ref().expect("held files exist with the log");
        if self.writeback.is_lingering(id) && held.parents_of(id).is_empty() {
            self.writeback.forget_file(id);
        }
        self.writeback.note_names_changed(None, None, &[id]);
    }

    /// Renames a file only memory and the log hold, to a free name or over the regular file
    /// `target`, which goes first as an unlink would (a held one from memory, with its Unlink
    /// record if the log knows it; a backend one hidden, its Unlink record in the rename's
    /// batch and its backend unlink at the next checkpoint, `Pending::hide`). Adds to `records`
    /// what to commit before the caller is answered, failed or not: replay makes a held file at
    /// the name its records end with, after the backend's unlink of what it replaced. The
    /// caller holds the names gate until they are committed.
    #[allow(clippy::too_many_arguments)] // a rename's two names, and where its records go
    fn rename_held(
        &self,
        id: ObjectId,
        target: Option<ObjectId>,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        records: &mut Vec<Record>,
    ) -> SysResult<()> {
        let held = self.pending.as_ref().expect("held files exist with the log");
        if (parent, name) == (new_parent, new_name) {
            return Ok(()); // one name: nothing to do
        }
        let target = match target {
            None => HeldRenameTarget::Free,
            Some(target) if held.is_held(target) => HeldRenameTarget::Held(target),
            Some(target) => HeldRenameTarget::Backend(target),
        };
        if let HeldRenameTarget::Backend(target) = target {
            // A backend target made from a held file: synced and its records barred first.
            self.writeback.settle_made(target, true)?;
        }
        // The target goes while the renamed file is kept held (`Pending::rename_after`); the
        // renamed file made on the backend meanwhile, the target stays and this fails with
        // ENOENT (the caller renames the file there).
        let mut target_gone = false;
        // Nothing here takes the write buffer's locks: a flusher of the renamed file holds
        // its state while it waits for the body `rename_after` holds.
        let free_the_name = || -> SysResult<()> {
            match target {
                HeldRenameTarget::Free => Ok(()),
                HeldRenameTarget::Held(_) => {
                    let logged = held.unlink(new_parent, new_name)?;
                    target_gone = true;
                    records.extend(self.unlink_record(logged, new_parent, new_name)?);
                    Ok(())
                }
                HeldRenameTarget::Backend(_) => {
                    // Its record goes in the rename's batch, and the backend's unlink waits for
                    // the checkpoint: a crash must not find the name gone with neither file there.
                    let (Some((key, _)), Ok(parent_key)) =
                        (self.named_object(new_parent, new_name)?, self.ns.log_key(new_parent))
                    else {
                        return Err(Errno(libc::EIO));
                    };
                    held.hide(new_parent, new_name, key.clone());
                    target_gone = true;
                    records.push(Record::Hidden {
                        file: key,
                        parent: parent_key,
                        name: new_name.as_encoded_bytes().to_vec(),
                    });
                    Ok(())
                }
            }
        };
        let renamed = held.rename_after(parent, name, new_parent, new_name, free_the_name);
        match target {
            HeldRenameTarget::Held(target) if target_gone => self.after_held_unlink(target),
            HeldRenameTarget::Backend(target) if target_gone => {
                self.writeback.note_names_changed(None, None, &[target]);
            }
            _ => {}
        }
        let ((), logged) = renamed?;
        self.writeback.note_names_changed(None, Some((id, new_parent)), &[]);
        if let Some(file) = logged {
            records.push(Record::Rename {
                file,
                from_parent: self.ns.log_key(parent)?,
                from_name: name.as_encoded_bytes().to_vec(),
                to_parent: self.ns.log_key(new_parent)?,
                to_name: new_name.as_encoded_bytes().to_vec(),
                replaced: Vec::new(),
            });
        }
        Ok(())
    }

    pub fn opendir(&self, id: ObjectId) -> SysResult<u64> {
        let reader = self.ns.open_dir(id)?;
        let fh = self.new_handle();
        lock(&self.dirs).insert(fh, Arc::new(OpenDir { id, reader: Mutex::new(reader) }));
        Ok(fh)
    }

    /// Up to `READDIR_BATCH` entries from `offset` on (0: the start; otherwise an entry's
    /// `next_offset`), without the hidden legacy state folder. An empty answer is the end.
    pub fn readdir(&self, fh: u64, offset: u64) -> SysResult<Vec<ListedEntry>> {
        let dir = self.open_dir(fh)?;
        let entries = lock(&dir.reader).read(offset, READDIR_BATCH)?;
        // A batch of two or more cannot consist of the state folder alone: filtering never
        // turns a full batch into a false end.
        Ok(entries
            .into_iter()
            .filter(|entry| !self.is_hidden(dir.id, &entry.name))
            .map(|entry| ListedEntry {
                // ".." is reported as the directory itself: the kernel takes neither number.
                ino: if entry.name == "." || entry.name == ".." { dir.id } else { entry.id },
                next_offset: entry.next_offset,
                kind: entry.kind,
                name: entry.name,
            })
            .collect())
    }

    pub fn releasedir(&self, fh: u64) -> SysResult<()> {
        lock(&self.dirs).remove(&fh).map(drop).ok_or(Errno(libc::EBADF))
    }

    pub fn fsyncdir(&self, fh: u64, _data_only: bool) -> SysResult<()> {
        let dir = self.open_dir(fh)?;
        if self.fsync_is_a_checkpoint() {
            return self.writeback.checkpoint();
        }
        self.writeback.commit_held_in(dir.id)?;
        let names_before_seq = self.writeback.commit_queued_names_before_seq()?;
        self.ns.sync_dir(dir.id)?;
        match names_before_seq {
            Some(before_seq) => self.writeback.note_dir_synced(dir.id, before_seq),
            None => Ok(()),
        }
    }

    pub fn statfs(&self, id: ObjectId) -> SysResult<StatFs> {
        self.ns.statfs(id)
    }

    fn is_hidden_xattr(&self, id: ObjectId, name: &OsStr) -> bool {
        id == ROOT_ID && self.config.hidden_root_xattr.as_deref() == Some(name)
    }

    pub fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()> {
        if self.is_hidden_xattr(id, name) {
            return Err(Errno(libc::EPERM));
        }
        self.make_real(id)?;
        self.ns.set_xattr(id, name, value, flags)
    }

    pub fn get_xattr(&self, id: ObjectId, name: &OsStr, size: u32) -> SysResult<XattrReply> {
        if self.is_hidden_xattr(id, name) {
            return Err(Errno(libc::ENODATA));
        }
        self.ns.get_xattr(id, name, size as usize)
    }

    /// The names of `id`'s extended attributes, NUL-terminated, without the hidden one.
    pub fn list_xattr(&self, id: ObjectId, size: u32) -> SysResult<XattrReply> {
        let Some(hidden) = self.config.hidden_root_xattr.as_deref().filter(|_| id == ROOT_ID) else {
            return self.ns.list_xattr(id, size as usize);
        };
        // The whole list is needed to answer even a size query without the hidden name. A
        // list that keeps growing between the size query and the read gets a few more tries,
        // then the caller hears ERANGE, as from listxattr(2) itself.
        const TRIES: usize = 8;
        let mut names = None;
        for _ in 0..TRIES {
            let XattrReply::Size(needed) = self.ns.list_xattr(id, 0)? else { return Err(Errno(libc::EIO)) };
            match self.ns.list_xattr(id, needed.max(1)) {
                Ok(XattrReply::Data(listed)) => {
                    names = Some(listed);
                    break;
                }
                Ok(XattrReply::Size(_)) => return Err(Errno(libc::EIO)),
                Err(Errno(libc::ERANGE)) => continue,
                Err(e) => return Err(e),
            }
        }
        let Some(names) = names else { return Err(Errno(libc::ERANGE)) };
        let shown: Vec<u8> = names
            .split_inclusive(|&b| b == 0)
            .filter(|name| name.strip_suffix(&[0]).unwrap_or(name) != hidden.as_encoded_bytes())
            .flatten()
            .copied()
            .collect();
        match size as usize {
            0 => Ok(XattrReply::Size(shown.len())),
            room if room < shown.len() => Err(Errno(libc::ERANGE)),
            _ => Ok(XattrReply::Data(shown)),
        }
    }

    pub fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()> {
        if self.is_hidden_xattr(id, name) {
            return Err(Errno(libc::EPERM));
        }
        if self.pending.as_ref().is_some_and(|held| held.is_held(id)) {
            return Err(Errno(libc::ENODATA)); // a held file has none
        }
        self.ns.remove_xattr(id, name)
    }
}

/// Gives directory `dir` back the mtime `mtime` after the engine's own backend changes (a
/// checkpoint making held files, replay) moved it: those times were the application's to set.
/// A directory the changes left alone costs a stat and no journal commit.
pub(super) fn give_back_mtime(ns: &dyn crate::backend::Namespace, dir: ObjectId, mtime: Timestamp) -> SysResult<()> {
    if ns.getattr(dir)?.mtime == mtime {
        return Ok(());
    }
    let times = super::types::TimesToSet { atime: None, mtime: Some(TimeToSet::At(mtime)) };
    ns.setattr(dir, &SetAttr { times, ..SetAttr::default() })
}
