//! The namespace the engine sees: held files answered from memory, with their names merged
//! into the backend's listings; everything else passed through to the backend.

use super::*;

/// Directory entries of held files come after the backend's, at offsets no backend uses
/// (file systems' directory offsets are positive `loff_t`s, below 1 << 63).
const HELD_OFFSET_BASE: u64 = 1 << 63;

struct MergedDirReader {
    backend: Box<dyn DirReader>,
    pending: Arc<Pending>,
    dir: ObjectId,
    /// The held names of the directory, taken before the backend's listing: a held file made
    /// on the backend meanwhile (a flusher or a checkpoint making it) is then in both, and
    /// listed once, as held. Taken after it, a file made in between is in neither: the
    /// reference test saw a name listed twice when they were taken after the backend's first
    /// entries were read, and, over a store that lists a directory when it is opened (SQLite,
    /// memory), a name missing when they were taken at the first read. In name order (the
    /// table's), so that a backend entry is looked for by binary search.
    held: Vec<(OsString, ObjectId)>,
    /// Nothing read yet of the listing taken at open: a read at offset 0 after others
    /// (rewinddir) takes both again, as the directory is now.
    unread: bool,
}

/// Whether `name` is among `held` (in name order, as `MergedDirReader` takes it).
fn is_held_name(held: &[(OsString, ObjectId)], name: &OsStr) -> bool {
    held.binary_search_by(|(held_name, _)| held_name.as_os_str().cmp(name)).is_ok()
}

impl MergedDirReader {
    /// The held names of `dir`, then the backend's listing of it, in that order (see `held`).
    fn open(pending: &Arc<Pending>, dir: ObjectId) -> SysResult<MergedDirReader> {
        let held: Vec<(OsString, ObjectId)> = {
            let table = pending.table();
            table
                .by_name
                .get(&dir)
                .map_or_else(Vec::new, |names| names.iter().map(|(name, id)| (name.clone(), *id)).collect())
        };
        debug_assert!(held.windows(2).all(|pair| pair[0].0 < pair[1].0), "held names in order");
        let backend = pending.ns.open_dir(dir)?;
        Ok(MergedDirReader { backend, pending: pending.clone(), dir, held, unread: true })
    }
}

impl DirReader for MergedDirReader {
    fn read(&mut self, offset: u64, max: usize) -> SysResult<Vec<DirEntry>> {
        let mut entries = Vec::new();
        if offset == 0 && !self.unread {
            *self = MergedDirReader::open(&self.pending, self.dir)?;
        }
        self.unread = false;
        if offset < HELD_OFFSET_BASE {
            // Hidden names are gone here: the backend is read on until `max` entries are left
            // or it has no more (fewer than `max` says the end).
            let mut at = offset;
            loop {
                let wanted = max - entries.len();
                let batch = self.backend.read(at, wanted)?;
                let (got, next) = (batch.len(), batch.last().map(|e| e.next_offset));
                let held = &self.held;
                if self.pending.any_hidden() {
                    let table = self.pending.table();
                    entries.extend(
                        batch
                            .into_iter()
                            .filter(|e| !table.is_hidden(self.dir, &e.name) && !is_held_name(held, &e.name)),
                    );
                } else {
                    entries.extend(batch.into_iter().filter(|e| !is_held_name(held, &e.name)));
                }
                if entries.len() == max {
                    return Ok(entries);
                }
                match next {
                    Some(next) if got == wanted => at = next,
                    _ => break,
                }
            }
        }
        let held = &self.held;
        let start = offset.saturating_sub(HELD_OFFSET_BASE) as usize;
        for (i, (name, id)) in held.iter().enumerate().skip(start) {
            if entries.len() == max {
                break;
            }
            entries.push(DirEntry {
                name: name.clone(),
                id: *id,
                kind: Some(Kind::File),
                next_offset: HELD_OFFSET_BASE + i as u64 + 1,
            });
        }
        Ok(entries)
    }
}

impl PendingNamespace {
    fn set_held_attr(body: &mut Body, changes: &SetAttr) {
        let t = now();
        if let Some(mode) = changes.mode {
            body.attr.perm = mode & 0o7777;
        }
        if let Some(uid) = changes.uid {
            body.attr.uid = uid;
        }
        if let Some(gid) = changes.gid {
            body.attr.gid = gid;
        }
        let at = |time: TimeToSet| if let TimeToSet::At(at) = time { at } else { t };
        if let Some(atime) = changes.times.atime {
            body.attr.atime = at(atime);
        }
        if let Some(mtime) = changes.times.mtime {
            body.attr.mtime = at(mtime);
        }
        body.attr.ctime = t;
        body.changed_since_log = true;
    }
}

/// The namespace the engine sees: held files first, the backend's for the rest.
pub struct PendingNamespace(pub Arc<Pending>);

impl Namespace for PendingNamespace {
    fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr> {
        let p = &self.0;
        let held = p.with_held_at_to_read(parent, name, |_, body| {
            body.lookups += 1;
            Pending::attr_of(body)
        });
        match held {
            Some(attr) => Ok(attr),
            None if p.is_hidden(parent, name) => Err(Errno(libc::ENOENT)),
            None => p.ns.lookup(parent, name).map(|attr| p.with_directory_times(attr)),
        }
    }

    fn forget(&self, id: ObjectId, lookups: u64) {
        let p = &self.0;
        // During a make too: the make hands the lookups left to the backend when it ends, and
        // a file being made has a name, so it is not dropped here.
        let held = p.with_held_to_read(id, |file, body| {
            body.lookups = body.lookups.saturating_sub(lookups);
            p.drop_if_gone(file, body);
        });
        if held.is_none() {
            p.ns.forget(id, lookups);
        }
    }

    fn hold(&self, id: ObjectId) -> SysResult<()> {
        match self.0.with_held_to_read(id, |_, body| body.lookups += 1) {
            Some(()) => Ok(()),
            None => self.0.ns.hold(id),
        }
    }

    fn getattr(&self, id: ObjectId) -> SysResult<Attr> {
        match self.0.with_held_to_read(id, |_, body| Pending::attr_of(body)) {
            Some(attr) => Ok(attr),
            None => self.0.ns.getattr(id).map(|attr| self.0.with_directory_times(attr)),
        }
    }

    fn setattr(&self, id: ObjectId, changes: &SetAttr) -> SysResult<()> {
        let changed = self.0.with_held(id, |_, body| Self::set_held_attr(body, changes));
        match changed {
            Some(()) => Ok(()),
            None => {
                let Some(mtime) = changes.times.mtime else { return self.0.ns.setattr(id, changes) };
                // Ordered with a keeper's give-back (`Pending::dir_times_gate`). A getattr
                // between the two steps shows the time set, or (set older than the held
                // changes' time, which the table still has) the time shown before: what a
                // stat racing the setattr may see.
                let _ordered = lock(&self.0.dir_times_gate);
                self.0.ns.setattr(id, changes)?;
                let mut table = self.0.table();
                table.mtime_set(id, mtime);
                self.0.repin(&mut table, id);
                Ok(())
            }
        }
    }

    fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, owner: Owner) -> SysResult<Attr> {
        if self.0.named(parent, name).is_some() {
            return Err(Errno(libc::EEXIST));
        }
        self.0.remove_hidden(parent, Some(name))?;
        self.0.backend_names().make(parent, name, what, owner)
    }

    fn make_with_id(&self, id: ObjectId, parent: ObjectId, name: &OsStr, perm: u32, owner: Owner) -> SysResult<Attr> {
        self.0.backend_names().make_with_id(id, parent, name, perm, owner)
    }
    fn make_with_id_prepared(
        &self,
        id: ObjectId,
        parent: ObjectId,
        name: &OsStr,
        perm: u32,
        owner: Owner,
    ) -> SysResult<Attr> {
        self.0.backend_names().make_with_id_prepared(id, parent, name, perm, owner)
    }
    fn prepare_files(&self, count: usize, bytes: u64) -> SysResult<usize> {
        self.0.ns.prepare_files(count, bytes)
    }
    fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        if self.0.named(new_parent, new_name).is_some() {
            return Err(Errno(libc::EEXIST));
        }
        if self.0.is_held(id) {
            // The engine links it held (`Pending::link`) or makes it on the backend first.
            log::error!("link of a held file reached the namespace");
            return Err(Errno(libc::EIO));
        }
        self.0.remove_hidden(new_parent, Some(new_name))?;
        self.0.backend_names().link(id, new_parent, new_name)
    }

    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()> {
        let p = &self.0;
        if p.with_held_at(parent, name, |_, _| ()).is_some() {
            if directory {
                return Err(Errno(libc::ENOTDIR));
            }
            return p.unlink(parent, name).map(drop);
        }
        if p.is_hidden(parent, name) {
            return Err(Errno(libc::ENOENT));
        }
        if directory && (p.any_named() || p.any_hidden()) {
            if let Some((_, dir)) = p.ns.identify(parent, name)? {
                if p.has_names_in(dir) {
                    return Err(Errno(libc::ENOTEMPTY));
                }
                // Empty here: the backend's unlinks of its hidden names first.
                p.remove_hidden(dir, None)?;
            }
        }
        p.backend_names().remove(parent, name, directory)
    }

    fn rename(
        &self,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        flags: u32,
    ) -> SysResult<()> {
        let p = &self.0;
        if p.with_held_at(parent, name, |_, _| ()).is_some() {
            if flags & !libc::RENAME_NOREPLACE != 0 {
                log::error!("a rename of a held file with flags {flags:#x} reached the namespace");
                return Err(Errno(libc::EIO));
            }
            return p.rename(parent, name, new_parent, new_name).map(drop);
        }
        if p.named(new_parent, new_name).is_some() {
            log::error!("a rename over a held file reached the namespace");
            return Err(Errno(libc::EIO));
        }
        if p.is_hidden(parent, name) {
            return Err(Errno(libc::ENOENT));
        }
        // The target is free here: the backend's unlink of what it hid first.
        p.remove_hidden(new_parent, Some(new_name))?;
        if p.any_named() || p.any_hidden() {
            // A directory renamed over an empty one: empty on the backend may not be empty here.
            if let Some((_, target)) = p.ns.identify(new_parent, new_name)? {
                if p.has_names_in(target) && flags & libc::RENAME_EXCHANGE == 0 {
                    return Err(Errno(libc::ENOTEMPTY));
                }
                if flags & libc::RENAME_EXCHANGE == 0 {
                    p.remove_hidden(target, None)?;
                }
            }
        }
        p.backend_names().rename(parent, name, new_parent, new_name, flags)
    }

    fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        if self.0.is_held(id) {
            return Err(Errno(libc::EINVAL));
        }
        self.0.ns.readlink(id)
    }

    fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()> {
        if self.0.is_held(id) {
            log::error!("an extended attribute of a held file reached the namespace");
            return Err(Errno(libc::EIO));
        }
        self.0.ns.set_xattr(id, name, value, flags)
    }

    fn get_xattr(&self, id: ObjectId, name: &OsStr, size: usize) -> SysResult<XattrReply> {
        if self.0.is_held_to_read(id) {
            return Err(Errno(libc::ENODATA));
        }
        self.0.ns.get_xattr(id, name, size)
    }

    fn list_xattr(&self, id: ObjectId, size: usize) -> SysResult<XattrReply> {
        if self.0.is_held_to_read(id) {
            return Ok(if size == 0 { XattrReply::Size(0) } else { XattrReply::Data(Vec::new()) });
        }
        self.0.ns.list_xattr(id, size)
    }

    fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()> {
        if self.0.is_held(id) {
            return Err(Errno(libc::ENODATA));
        }
        self.0.ns.remove_xattr(id, name)
    }

    fn statfs(&self, id: ObjectId) -> SysResult<StatFs> {
        let id = if self.0.is_held(id) { crate::engine::types::ROOT_ID } else { id };
        self.0.ns.statfs(id)
    }

    fn open_dir(&self, id: ObjectId) -> SysResult<Box<dyn DirReader>> {
        Ok(Box::new(MergedDirReader::open(&self.0, id)?))
    }

    fn sync_dir(&self, id: ObjectId) -> SysResult<()> {
        self.0.ns.sync_dir(id)
    }

    fn log_key(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        match self.0.with_held(id, |file, _| file.key.clone()) {
            Some(key) => Ok(key),
            None => self.0.ns.log_key(id),
        }
    }

    fn identify(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<(Vec<u8>, ObjectId)>> {
        match self.0.with_held_at(parent, name, |file, _| (file.key.clone(), file.id)) {
            Some(found) => Ok(Some(found)),
            None if self.0.is_hidden(parent, name) => Ok(None),
            None => self.0.ns.identify(parent, name),
        }
    }

    fn describe(&self, id: ObjectId) -> Option<String> {
        if let Some(named) = self.0.with_held_to_read(id, |_, body| body.names.first().cloned()) {
            let (parent, name) = named?;
            let dir = self.0.ns.describe(parent).unwrap_or_else(|| format!("inode {parent}"));
            return Some(format!("{dir}/{} (not yet on the backend)", name.to_string_lossy()));
        }
        self.0.ns.describe(id)
    }

    fn find(&self, key: &[u8]) -> SysResult<Option<ObjectId>> {
        if is_pending_key(key) {
            return Ok(None);
        }
        self.0.ns.find(key)
    }

    fn key_at(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<Vec<u8>>> {
        match self.0.with_held_at(parent, name, |file, _| file.key.clone()) {
            Some(key) => Ok(Some(key)),
            None if self.0.is_hidden(parent, name) => Ok(None),
            None => self.0.ns.key_at(parent, name),
        }
    }

    fn set_replay_watermark(&self, first_batch: Option<u64>) -> SysResult<()> {
        self.0.ns.set_replay_watermark(first_batch)
    }

    fn replay_watermark(&self) -> SysResult<Option<u64>> {
        self.0.ns.replay_watermark()
    }
}
