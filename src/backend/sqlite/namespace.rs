//! The SQLite backend's names: `Namespace` over the database's inodes, dentries and xattrs.

use super::*;

/// A directory's entries as they were when it was opened ("." and ".." first); an entry's
/// offset is its place in that list.
struct SqliteDirReader {
    entries: Vec<DirEntry>,
}

impl DirReader for SqliteDirReader {
    fn read(&mut self, offset: u64, max: usize) -> SysResult<Vec<DirEntry>> {
        Ok(self.entries.iter().skip(offset as usize).take(max).cloned().collect())
    }
}

/// The room statfs reports free where the data is in a store of no capacity the mount can
/// know (a bucket): enough that no tool refuses a write for want of it. 1 PiB, as a bucket's
/// quota, if it has one, is the server's to enforce.
const FREE_BYTES_WITHOUT_CAPACITY: u64 = 1 << 50;
/// The same for files.
const FREE_FILES_WITHOUT_CAPACITY: u64 = 1 << 32;
const BLOCK_WITHOUT_CAPACITY: u64 = 4096;

/// statfs of a mount whose data is elsewhere (`ExternalData`): the bytes its records name used,
/// `FREE_BYTES_WITHOUT_CAPACITY` free. The database's file system (the state directory's) is not
/// where the bytes go: `df` of an S3 mount showed that disk's size and use.
fn space_of_a_store_without_capacity(stored: u64, files: u64) -> StatFs {
    let free = FREE_BYTES_WITHOUT_CAPACITY / BLOCK_WITHOUT_CAPACITY;
    StatFs {
        blocks: stored.div_ceil(BLOCK_WITHOUT_CAPACITY) + free,
        blocks_free: free,
        blocks_available: free,
        files: files + FREE_FILES_WITHOUT_CAPACITY,
        files_free: FREE_FILES_WITHOUT_CAPACITY,
        block_size: BLOCK_WITHOUT_CAPACITY as u32,
        name_max: 255,
        fragment_size: BLOCK_WITHOUT_CAPACITY as u32,
    }
}

impl Namespace for SqliteBackend {
    fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr> {
        let mut s = lock(&self.inner);
        s.dir(parent)?;
        let id = s.child(parent, name)?.ok_or(Errno(libc::ENOENT))?;
        let attr = s.attr(id)?;
        s.count_lookup(id);
        Ok(attr)
    }

    fn forget(&self, id: ObjectId, lookups: u64) {
        let mut s = lock(&self.inner);
        if let Some(n) = s.lookups.get_mut(&id) {
            *n = n.saturating_sub(lookups);
        }
        if let Err(e) = collect_if_unheld(&self.inner, s, id) {
            log::warn!("sqlite backend: forgetting object {id}: {e}");
        }
    }

    fn hold(&self, id: ObjectId) -> SysResult<()> {
        let mut s = lock(&self.inner);
        s.object(id)?;
        s.count_lookup(id);
        Ok(())
    }

    fn getattr(&self, id: ObjectId) -> SysResult<Attr> {
        lock(&self.inner).attr(id)
    }

    fn setattr(&self, id: ObjectId, changes: &SetAttr) -> SysResult<()> {
        change_waiting(&self.inner, |s| {
            let now = Timestamp::now();
            let at = |t: TimeToSet| if let TimeToSet::At(at) = t { at } else { now };
            s.update(id, |o| {
                if let Some(mode) = changes.mode {
                    o.perm = mode & 0o7777;
                }
                if let Some(uid) = changes.uid {
                    o.uid = uid;
                }
                if let Some(gid) = changes.gid {
                    o.gid = gid;
                }
                if let Some(t) = changes.times.atime {
                    o.atime = at(t);
                }
                if let Some(t) = changes.times.mtime {
                    o.mtime = at(t);
                }
                o.ctime = now;
            })
        })
    }

    fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, owner: Owner) -> SysResult<Attr> {
        change_waiting(&self.inner, |s| s.make_object(parent, name, what, owner, None))
    }

    fn make_with_id(&self, id: ObjectId, parent: ObjectId, name: &OsStr, perm: u32, owner: Owner) -> SysResult<Attr> {
        change_waiting(&self.inner, |s| s.make_object(parent, name, NewObject::File { perm }, owner, Some(id)))
    }

    fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        valid_name(new_name)?;
        change_waiting(&self.inner, |s| {
            if s.object(id)?.kind == Kind::Directory {
                return Err(Errno(libc::EPERM));
            }
            s.dir(new_parent)?;
            if s.child(new_parent, new_name)?.is_some() {
                return Err(Errno(libc::EEXIST));
            }
            s.set_entry(new_parent, new_name, id)?;
            let now = Timestamp::now();
            s.update(id, |o| {
                o.nlink += 1;
                o.ctime = now;
            })?;
            s.touch(new_parent)?;
            s.count_lookup(id);
            s.attr(id)
        })
    }

    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()> {
        change_waiting(&self.inner, |s| {
            s.dir(parent)?;
            let id = s.child(parent, name)?.ok_or(Errno(libc::ENOENT))?;
            let is_dir = s.object(id)?.kind == Kind::Directory;
            match (directory, is_dir) {
                (true, false) => return Err(Errno(libc::ENOTDIR)),
                (false, true) => return Err(Errno(libc::EISDIR)),
                (true, true) if !s.is_empty_dir(id)? => return Err(Errno(libc::ENOTEMPTY)),
                _ => {}
            }
            s.unlink_entry(parent, name)?;
            s.collect(id)
        })
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
        change_waiting(&self.inner, |s| {
            s.dir(parent)?;
            s.dir(new_parent)?;
            let id = s.child(parent, name)?.ok_or(Errno(libc::ENOENT))?;
            let target = s.child(new_parent, new_name)?;
            let now = Timestamp::now();
            if flags & libc::RENAME_EXCHANGE != 0 {
                let other = target.ok_or(Errno(libc::ENOENT))?;
                s.set_entry(parent, name, other)?;
                s.set_entry(new_parent, new_name, id)?;
                let (a_dir, b_dir) = (s.object(id)?.kind == Kind::Directory, s.object(other)?.kind == Kind::Directory);
                if parent != new_parent && a_dir != b_dir {
                    let (gains, loses) = if a_dir { (new_parent, parent) } else { (parent, new_parent) };
                    s.update(gains, |o| o.nlink += 1)?;
                    s.update(loses, |o| o.nlink -= 1)?;
                }
                for moved in [id, other] {
                    s.update(moved, |o| o.ctime = now)?;
                }
                s.touch(parent)?;
                return s.touch(new_parent);
            }
            if target == Some(id) {
                return Ok(()); // two names of one object: POSIX says nothing happens
            }
            let moving_dir = s.object(id)?.kind == Kind::Directory;
            if let Some(old) = target {
                if flags & libc::RENAME_NOREPLACE != 0 {
                    return Err(Errno(libc::EEXIST));
                }
                let old_is_dir = s.object(old)?.kind == Kind::Directory;
                match (moving_dir, old_is_dir) {
                    (true, false) => return Err(Errno(libc::ENOTDIR)),
                    (false, true) => return Err(Errno(libc::EISDIR)),
                    (true, true) if !s.is_empty_dir(old)? => return Err(Errno(libc::ENOTEMPTY)),
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
                    match s.parent_of(at)? {
                        Some(up) if at != ROOT_ID => at = up,
                        _ => break,
                    }
                }
            }
            if let Some(old) = target {
                s.unlink_entry(new_parent, new_name)?;
                s.collect(old)?;
            }
            s.remove_entry(parent, name)?;
            s.set_entry(new_parent, new_name, id)?;
            if moving_dir && parent != new_parent {
                s.update(parent, |o| o.nlink -= 1)?;
                s.update(new_parent, |o| o.nlink += 1)?;
            }
            s.update(id, |o| o.ctime = now)?;
            s.touch(parent)?;
            s.touch(new_parent)
        })
    }

    fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        let o = lock(&self.inner).object(id)?;
        if o.kind != Kind::Symlink {
            return Err(Errno(libc::EINVAL));
        }
        Ok(o.target)
    }

    fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()> {
        change_waiting(&self.inner, |s| {
            s.object(id)?;
            // An access ACL sets the mode's bits, as a local file system's does (`cp -a`
            // preserves modes so); one the mode says all of is not kept apart.
            if name == ACL_ACCESS {
                let (perm, extended) = acl_mode(value).ok_or(Errno(libc::EINVAL))?;
                let now = Timestamp::now();
                s.update(id, |o| {
                    o.perm = (o.perm & !0o777) | perm;
                    o.ctime = now;
                })?;
                if !extended {
                    s.db.prepare_cached("DELETE FROM xattrs WHERE id = ?1 AND name = ?2")
                        .sql()?
                        .execute(params![sql_id(id), name.as_bytes()])
                        .sql()?;
                    return Ok(());
                }
            }
            let exists =
                s.db.prepare_cached("SELECT 1 FROM xattrs WHERE id = ?1 AND name = ?2")
                    .sql()?
                    .query_row(params![sql_id(id), name.as_bytes()], |_| Ok(()))
                    .optional()
                    .sql()?
                    .is_some();
            if flags & libc::XATTR_CREATE != 0 && exists {
                return Err(Errno(libc::EEXIST));
            }
            if flags & libc::XATTR_REPLACE != 0 && !exists {
                return Err(Errno(libc::ENODATA));
            }
            s.db.prepare_cached("INSERT OR REPLACE INTO xattrs(id, name, value) VALUES(?1, ?2, ?3)")
                .sql()?
                .execute(params![sql_id(id), name.as_bytes(), value])
                .sql()?;
            let now = Timestamp::now();
            s.update(id, |o| o.ctime = now)
        })
    }

    fn get_xattr(&self, id: ObjectId, name: &OsStr, size: usize) -> SysResult<XattrReply> {
        let s = lock(&self.inner);
        s.object(id)?;
        let value: Vec<u8> =
            s.db.prepare_cached("SELECT value FROM xattrs WHERE id = ?1 AND name = ?2")
                .sql()?
                .query_row(params![sql_id(id), name.as_bytes()], |r| r.get(0))
                .optional()
                .sql()?
                .ok_or(Errno(libc::ENODATA))?;
        match size {
            0 => Ok(XattrReply::Size(value.len())),
            n if n < value.len() => Err(Errno(libc::ERANGE)),
            _ => Ok(XattrReply::Data(value)),
        }
    }

    fn list_xattr(&self, id: ObjectId, size: usize) -> SysResult<XattrReply> {
        let s = lock(&self.inner);
        s.object(id)?;
        let mut stmt = s.db.prepare_cached("SELECT name FROM xattrs WHERE id = ?1 ORDER BY name").sql()?;
        let names = stmt.query_map([sql_id(id)], |r| r.get::<_, Vec<u8>>(0)).sql()?;
        let mut list = Vec::new();
        for name in names {
            list.extend_from_slice(&name.sql()?);
            list.push(0);
        }
        match size {
            0 => Ok(XattrReply::Size(list.len())),
            n if n < list.len() => Err(Errno(libc::ERANGE)),
            _ => Ok(XattrReply::Data(list)),
        }
    }

    fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()> {
        change_waiting(&self.inner, |s| {
            s.object(id)?;
            let n =
                s.db.prepare_cached("DELETE FROM xattrs WHERE id = ?1 AND name = ?2")
                    .sql()?
                    .execute(params![sql_id(id), name.as_bytes()])
                    .sql()?;
            if n == 0 {
                return Err(Errno(libc::ENODATA));
            }
            let now = Timestamp::now();
            s.update(id, |o| o.ctime = now)
        })
    }

    fn statfs(&self, _id: ObjectId) -> SysResult<StatFs> {
        let (files, stored): (i64, Option<u64>) = {
            let s = lock(&self.inner);
            let files = s.db.query_row("SELECT count(*) FROM inodes", [], |r| r.get(0)).sql()?;
            (files, s.external.as_ref().map(|external| external.bytes_stored(&s.db)).transpose().sql()?)
        };
        if let Some(stored) = stored {
            return Ok(space_of_a_store_without_capacity(stored, files as u64));
        }
        // The file system the database is on, in its block size.
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let st = crate::sys::statvfs(dir)?;
        Ok(StatFs {
            blocks: st.f_blocks,
            blocks_free: st.f_bfree,
            blocks_available: st.f_bavail,
            files: files as u64 + st.f_favail.max(1 << 20),
            files_free: st.f_favail.max(1 << 20),
            block_size: st.f_frsize as u32,
            name_max: 255,
            fragment_size: st.f_frsize as u32,
        })
    }

    fn open_dir(&self, id: ObjectId) -> SysResult<Box<dyn DirReader>> {
        let s = lock(&self.inner);
        s.dir(id)?;
        let up = s.parent_of(id)?.unwrap_or(id);
        let mut entries = vec![
            DirEntry { name: ".".into(), id, kind: Some(Kind::Directory), next_offset: 1 },
            DirEntry { name: "..".into(), id: up, kind: Some(Kind::Directory), next_offset: 2 },
        ];
        let mut stmt =
            s.db.prepare_cached(
                "SELECT d.name, d.child, i.mode FROM dentries d LEFT JOIN inodes i ON i.id = d.child \
                 WHERE d.parent = ?1 ORDER BY d.name",
            )
            .sql()?;
        let rows = stmt
            .query_map([sql_id(id)], |r| {
                Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, i64>(1)? as u64, r.get::<_, Option<u32>>(2)?))
            })
            .sql()?;
        for (i, row) in rows.enumerate() {
            let (name, child, mode) = row.sql()?;
            entries.push(DirEntry {
                name: OsString::from(OsStr::from_bytes(&name)),
                id: child,
                kind: mode.map(Kind::of_mode),
                next_offset: i as u64 + 3,
            });
        }
        Ok(Box::new(SqliteDirReader { entries }))
    }

    fn sync_dir(&self, id: ObjectId) -> SysResult<()> {
        let mut s = lock(&self.inner);
        s.dir(id)?;
        s.commit()
    }

    fn log_key(&self, id: ObjectId) -> SysResult<Vec<u8>> {
        Ok(key(id, lock(&self.inner).object(id)?.birth))
    }

    fn identify(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<(Vec<u8>, ObjectId)>> {
        let s = lock(&self.inner);
        s.dir(parent)?;
        let Some(id) = s.child(parent, name)? else { return Ok(None) };
        Ok(Some((key(id, s.object(id)?.birth), id)))
    }

    fn describe(&self, id: ObjectId) -> Option<String> {
        let s = lock(&self.inner);
        let mut names = Vec::new();
        let mut at = id;
        while at != ROOT_ID && names.len() < 256 {
            let (parent, name): (i64, Vec<u8>) =
                s.db.query_row("SELECT parent, name FROM dentries WHERE child = ?1 LIMIT 1", [sql_id(at)], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .ok()?;
            names.push(String::from_utf8_lossy(&name).into_owned());
            at = parent as u64;
        }
        names.reverse();
        Some(format!("{}:/{}", self.path.display(), names.join("/")))
    }

    fn find(&self, key: &[u8]) -> SysResult<Option<ObjectId>> {
        let (id, birth) = parse_key(key).ok_or(Errno(libc::EINVAL))?;
        let mut s = lock(&self.inner);
        match s.object_opt(id)? {
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

    /// A row of `meta` in the open transaction: the commit that makes it durable makes every
    /// change before it durable with it (contract rule 7). The row is left alone when it holds
    /// that already (a checkpoint with no batch to release, the unmount's after `coalescefs
    /// sync`): rewritten, it would cost a transaction of its own, three syncs in rollback mode.
    /// A checkpoint that flushed nothing begins its transaction here: it waits for another
    /// program's write lock with the backend's mutex let go, as every change does.
    fn set_replay_watermark(&self, first_batch: Option<u64>) -> SysResult<()> {
        // Only the checkpointer writes it: unchanged between this look and the change.
        if lock(&self.inner).replay_watermark()? == first_batch {
            return Ok(());
        }
        change_waiting(&self.inner, |s| {
            match first_batch {
                Some(seq) => {
                    s.db.execute(
                        "INSERT OR REPLACE INTO meta(key, value) VALUES(?1, ?2)",
                        params![REPLAY_WATERMARK_KEY, seq as i64],
                    )
                    .sql()?
                }
                None => s.db.execute("DELETE FROM meta WHERE key = ?1", [REPLAY_WATERMARK_KEY]).sql()?,
            };
            Ok(())
        })
    }

    fn replay_watermark(&self) -> SysResult<Option<u64>> {
        lock(&self.inner).replay_watermark()
    }
}
