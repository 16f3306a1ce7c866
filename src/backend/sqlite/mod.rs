//! The SQLite backend (`sqlite:PATH`): a whole tree in one database file, names and data, for
//! configuration stores like pmxcfs (seed 000). The schema is in `schema`.
//!
//! Durability: every change goes into one open transaction; a sync (`FileData::sync`,
//! `Namespace::sync_dir`, `UnitStore::sync_all`) commits it, with WAL and synchronous=FULL. So a
//! sync makes every change before it durable, in order, and a crash keeps a prefix of the
//! commits (the contract's rule 1); a checkpoint's changes, names included, are one
//! transaction. Each call's own statements are one savepoint: a call that fails changes
//! nothing.
//!
//! Data is stored as whole units only (`Capabilities::partial_writes` false): one row per file
//! and unit, at most the unit's bytes, clipped to the file's size. Ids the engine chooses are
//! kept (`make_with_id`); the ids it gives out itself count up from the largest in the file.
//! Keys are the id and a birth number (the open's generation and a counter), which no later
//! open gives out again, crashes included.
//!
//! Semantics follow `memory.rs`: an object without a name stays while the engine holds a lookup
//! or an open handle of it, and goes then (or at the next open, after a crash).

mod schema;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::{params, Connection, OptionalExtension};

use crate::backend::tree_keys::{key, parse_key};
use crate::backend::{Capabilities, DirReader, FileData, Namespace, OpenMode, UnitSource, UnitStore, UnitWrite};
use crate::engine::types::{
    Attr, DirEntry, Kind, NewObject, ObjectId, Owner, SetAttr, StatFs, TimeToSet, Timestamp, XattrReply, ROOT_ID,
};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};

pub use schema::SCHEMA_VERSION;

/// The unit when `-o unit=` gives none: a row of at most 64 KiB.
pub const DEFAULT_UNIT_BYTES: u64 = 64 << 10;

/// The `meta` key of the crash marker: the intent log a crash left to replay.
const LOG_MARKER_KEY: &str = "log_marker";

/// An inode row.
#[derive(Clone, Debug)]
struct Object {
    kind: Kind,
    perm: u32,
    uid: u32,
    gid: u32,
    rdev: u64,
    size: u64,
    nlink: u32,
    atime: Timestamp,
    mtime: Timestamp,
    ctime: Timestamp,
    birth: u64,
    target: Vec<u8>,
}

struct Inner {
    db: Connection,
    /// Lookups the engine holds, and open data handles: an object without a name stays while
    /// either is held.
    lookups: HashMap<ObjectId, u64>,
    open_handles: HashMap<ObjectId, u64>,
    next_id: u64,
    /// Keys' second half: `generation << 32 | counter`.
    generation: u64,
    births: u64,
    /// Crashed (`SqliteBackend::crash`): every change and commit fails from now on.
    crashed: bool,
    /// The unit store that keeps file data outside `units`, told when a file goes.
    external: Option<Arc<dyn ExternalData>>,
}

/// A unit store that keeps file data outside this database, with records of it in tables of
/// its own here (the S3 backend: unit objects in a bucket, `backend::s3::store`). The namespace
/// calls it inside its open transaction, so what happens to a file's data records commits with
/// the name change that caused it, never apart from it (contract rule 1).
pub trait ExternalData: Send + Sync {
    /// Its tables, made if absent (`CREATE TABLE IF NOT EXISTS`) whenever the database opens.
    fn tables(&self) -> &'static str;
    /// The namespace deleted `file` (no name, no lookup, no open handle left): its records go.
    fn file_deleted(&self, db: &Connection, file: ObjectId) -> rusqlite::Result<()>;
}

pub struct SqliteBackend {
    inner: Arc<Mutex<Inner>>,
    capabilities: Capabilities,
    path: PathBuf,
    metrics: Arc<Metrics>,
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|p| p.into_inner())
}

/// A database error as the caller's errno, said in the daemon's log.
fn errno(e: rusqlite::Error) -> Errno {
    use rusqlite::ErrorCode::*;
    let errno = match e.sqlite_error_code() {
        Some(DiskFull) => libc::ENOSPC,
        Some(ReadOnly) => libc::EROFS,
        Some(TooBig) => libc::EFBIG,
        _ => libc::EIO,
    };
    log::error!("sqlite backend: {e}");
    Errno(errno)
}

trait Sql<T> {
    fn sql(self) -> SysResult<T>;
}

impl<T> Sql<T> for rusqlite::Result<T> {
    fn sql(self) -> SysResult<T> {
        self.map_err(errno)
    }
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::File => "file",
        Kind::Directory => "directory",
        Kind::Symlink => "symlink",
        Kind::Fifo => "fifo",
        Kind::Socket => "socket",
        Kind::CharDevice => "char",
        Kind::BlockDevice => "block",
    }
}

/// `tree_keys::check_name`, and no name longer than a directory entry on Linux holds.
fn valid_name(name: &OsStr) -> SysResult<()> {
    crate::backend::tree_keys::check_name(name)?;
    if name.as_bytes().len() > 255 {
        return Err(Errno(libc::ENAMETOOLONG));
    }
    Ok(())
}

/// The access ACL's extended attribute (the kernel's POSIX ACL xattr format).
const ACL_ACCESS: &str = "system.posix_acl_access";

/// The permission bits an access ACL gives (owner, group or mask, other), and whether it says
/// more than they do (named users or groups). None when it is not an ACL.
fn acl_mode(value: &[u8]) -> Option<(u32, bool)> {
    const USER_OBJ: u16 = 0x01;
    const GROUP_OBJ: u16 = 0x04;
    const MASK: u16 = 0x10;
    const OTHER: u16 = 0x20;
    if value.len() < 4 || (value.len() - 4) % 8 != 0 || u32::from_le_bytes(value[..4].try_into().ok()?) != 2 {
        return None;
    }
    let (mut user, mut group, mut mask, mut other, mut extended) = (None, None, None, None, false);
    for entry in value[4..].chunks_exact(8) {
        let tag = u16::from_le_bytes([entry[0], entry[1]]);
        let perm = u32::from(u16::from_le_bytes([entry[2], entry[3]]) & 0o7);
        match tag {
            USER_OBJ => user = Some(perm),
            GROUP_OBJ => group = Some(perm),
            MASK => mask = Some(perm),
            OTHER => other = Some(perm),
            _ => extended = true,
        }
    }
    let group_bits = mask.or(group)?;
    Some((user? << 6 | group_bits << 3 | other?, extended || mask.is_some()))
}

/// Ids are u64; SQLite's integers i64: the bits are kept.
fn sql_id(id: ObjectId) -> i64 {
    id as i64
}

impl Inner {
    /// Runs `f` as one savepoint inside the open transaction (begun here if none is): its
    /// changes stay only if it succeeds.
    fn change<T>(&mut self, f: impl FnOnce(&mut Inner) -> SysResult<T>) -> SysResult<T> {
        if self.crashed {
            return Err(Errno(libc::EIO));
        }
        if self.db.is_autocommit() {
            self.db.execute_batch("BEGIN IMMEDIATE").sql()?;
        }
        self.db.execute_batch("SAVEPOINT call").sql()?;
        match f(self) {
            Ok(value) => {
                self.db.execute_batch("RELEASE call").sql()?;
                Ok(value)
            }
            Err(e) => {
                if !self.db.is_autocommit() {
                    self.db.execute_batch("ROLLBACK TO call; RELEASE call").sql()?;
                }
                Err(e)
            }
        }
    }

    /// Commits the open transaction: everything so far is durable.
    fn commit(&mut self) -> SysResult<()> {
        if self.crashed {
            return Err(Errno(libc::EIO));
        }
        if !self.db.is_autocommit() {
            self.db.execute_batch("COMMIT").sql()?;
        }
        Ok(())
    }

    fn object_opt(&self, id: ObjectId) -> SysResult<Option<Object>> {
        let mut stmt = self
            .db
            .prepare_cached(
                "SELECT mode, uid, gid, rdev, size, nlink, atime_s, atime_ns, mtime_s, mtime_ns, ctime_s, ctime_ns, \
                 birth, target FROM inodes WHERE id = ?1",
            )
            .sql()?;
        stmt.query_row([sql_id(id)], |r| {
            let mode: u32 = r.get(0)?;
            Ok(Object {
                kind: Kind::of_mode(mode),
                perm: mode & 0o7777,
                uid: r.get(1)?,
                gid: r.get(2)?,
                rdev: r.get::<_, i64>(3)? as u64,
                size: r.get::<_, i64>(4)? as u64,
                nlink: r.get(5)?,
                atime: Timestamp { sec: r.get(6)?, nsec: r.get(7)? },
                mtime: Timestamp { sec: r.get(8)?, nsec: r.get(9)? },
                ctime: Timestamp { sec: r.get(10)?, nsec: r.get(11)? },
                birth: r.get::<_, i64>(12)? as u64,
                target: r.get::<_, Option<Vec<u8>>>(13)?.unwrap_or_default(),
            })
        })
        .optional()
        .sql()
    }

    fn object(&self, id: ObjectId) -> SysResult<Object> {
        self.object_opt(id)?.ok_or(Errno(libc::ESTALE))
    }

    fn dir(&self, id: ObjectId) -> SysResult<Object> {
        let dir = self.object(id)?;
        if dir.kind != Kind::Directory {
            return Err(Errno(libc::ENOTDIR));
        }
        Ok(dir)
    }

    fn child(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<ObjectId>> {
        let mut stmt = self.db.prepare_cached("SELECT child FROM dentries WHERE parent = ?1 AND name = ?2").sql()?;
        Ok(stmt
            .query_row(params![sql_id(parent), name.as_bytes()], |r| r.get::<_, i64>(0))
            .optional()
            .sql()?
            .map(|id| id as u64))
    }

    fn is_empty_dir(&self, id: ObjectId) -> SysResult<bool> {
        let mut stmt = self.db.prepare_cached("SELECT 1 FROM dentries WHERE parent = ?1 LIMIT 1").sql()?;
        Ok(stmt.query_row([sql_id(id)], |_| Ok(())).optional().sql()?.is_none())
    }

    /// A directory's parent (a directory has one name).
    fn parent_of(&self, id: ObjectId) -> SysResult<Option<ObjectId>> {
        let mut stmt = self.db.prepare_cached("SELECT parent FROM dentries WHERE child = ?1 LIMIT 1").sql()?;
        Ok(stmt.query_row([sql_id(id)], |r| r.get::<_, i64>(0)).optional().sql()?.map(|id| id as u64))
    }

    fn attr(&self, id: ObjectId) -> SysResult<Attr> {
        let o = self.object(id)?;
        Ok(attr_of(id, &o))
    }

    fn write_object(&self, id: ObjectId, o: &Object) -> SysResult<()> {
        let mut stmt = self
            .db
            .prepare_cached(
                "INSERT OR REPLACE INTO inodes(id, birth, kind, mode, uid, gid, rdev, size, nlink, atime_s, atime_ns, \
                 mtime_s, mtime_ns, ctime_s, ctime_ns, target) \
                 VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
            )
            .sql()?;
        stmt.execute(params![
            sql_id(id),
            o.birth as i64,
            kind_name(o.kind),
            o.kind.mode_bits() | o.perm,
            o.uid,
            o.gid,
            o.rdev as i64,
            o.size as i64,
            o.nlink,
            o.atime.sec,
            o.atime.nsec,
            o.mtime.sec,
            o.mtime.nsec,
            o.ctime.sec,
            o.ctime.nsec,
            (o.kind == Kind::Symlink).then_some(&o.target),
        ])
        .sql()?;
        Ok(())
    }

    fn update(&self, id: ObjectId, f: impl FnOnce(&mut Object)) -> SysResult<()> {
        let mut o = self.object(id)?;
        f(&mut o);
        self.write_object(id, &o)
    }

    fn touch(&self, id: ObjectId) -> SysResult<()> {
        let now = Timestamp::now();
        self.update(id, |o| {
            o.mtime = now;
            o.ctime = now;
        })
    }

    fn set_entry(&self, parent: ObjectId, name: &OsStr, child: ObjectId) -> SysResult<()> {
        let mut stmt =
            self.db.prepare_cached("INSERT OR REPLACE INTO dentries(parent, name, child) VALUES(?1, ?2, ?3)").sql()?;
        stmt.execute(params![sql_id(parent), name.as_bytes(), sql_id(child)]).sql()?;
        Ok(())
    }

    fn remove_entry(&self, parent: ObjectId, name: &OsStr) -> SysResult<()> {
        let mut stmt = self.db.prepare_cached("DELETE FROM dentries WHERE parent = ?1 AND name = ?2").sql()?;
        stmt.execute(params![sql_id(parent), name.as_bytes()]).sql()?;
        Ok(())
    }

    fn count_lookup(&mut self, id: ObjectId) {
        *self.lookups.entry(id).or_insert(0) += 1;
    }

    fn next_birth(&mut self) -> u64 {
        self.births += 1;
        self.generation << 32 | self.births
    }

    /// Unlinks `name` from `parent` (its object keeps living while held).
    fn unlink_entry(&self, parent: ObjectId, name: &OsStr) -> SysResult<ObjectId> {
        let id = self.child(parent, name)?.ok_or(Errno(libc::ENOENT))?;
        self.remove_entry(parent, name)?;
        let kind = self.object(id)?.kind;
        let now = Timestamp::now();
        if kind == Kind::Directory {
            self.update(id, |o| o.nlink = 0)?;
            self.update(parent, |o| o.nlink -= 1)?;
        } else {
            self.update(id, |o| {
                o.nlink -= 1;
                o.ctime = now;
            })?;
        }
        self.touch(parent)?;
        Ok(id)
    }

    /// An object with no name, no lookup and no open handle is gone, with its data.
    fn collect(&self, id: ObjectId) -> SysResult<()> {
        let Some(o) = self.object_opt(id)? else { return Ok(()) };
        let unnamed = o.nlink == 0 || (o.kind == Kind::Directory && o.nlink <= 1);
        let held = self.lookups.get(&id).is_some_and(|&n| n > 0) || self.open_handles.get(&id).is_some_and(|&n| n > 0);
        if unnamed && !held && id != ROOT_ID {
            self.delete_object(id)?;
        }
        Ok(())
    }

    fn delete_object(&self, id: ObjectId) -> SysResult<()> {
        for sql in [
            "DELETE FROM inodes WHERE id = ?1",
            "DELETE FROM units WHERE file = ?1",
            "DELETE FROM xattrs WHERE id = ?1",
        ] {
            self.db.prepare_cached(sql).sql()?.execute([sql_id(id)]).sql()?;
        }
        if let Some(external) = &self.external {
            external.file_deleted(&self.db, id).sql()?;
        }
        Ok(())
    }

    fn make_object(
        &mut self,
        parent: ObjectId,
        name: &OsStr,
        what: NewObject<'_>,
        owner: Owner,
        chosen_id: Option<ObjectId>,
    ) -> SysResult<Attr> {
        valid_name(name)?;
        self.dir(parent)?;
        if self.child(parent, name)?.is_some() {
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
                if self.object_opt(id)?.is_some() {
                    log::error!("sqlite backend: id {id} asked for twice");
                    return Err(Errno(libc::EEXIST));
                }
                id
            }
            None => {
                self.next_id += 1;
                self.next_id - 1
            }
        };
        let birth = self.next_birth();
        let size = if kind == Kind::Symlink { target.len() as u64 } else { 0 };
        let nlink = if kind == Kind::Directory { 2 } else { 1 };
        let object = Object {
            kind,
            perm: perm & 0o7777,
            uid: owner.uid,
            gid: owner.gid,
            rdev,
            size,
            nlink,
            atime: now,
            mtime: now,
            ctime: now,
            birth,
            target,
        };
        self.write_object(id, &object)?;
        self.set_entry(parent, name, id)?;
        if kind == Kind::Directory {
            self.update(parent, |o| o.nlink += 1)?;
        }
        self.touch(parent)?;
        self.count_lookup(id);
        Ok(attr_of(id, &object))
    }
}

fn attr_of(id: ObjectId, o: &Object) -> Attr {
    let size = match o.kind {
        Kind::File | Kind::Symlink => o.size,
        Kind::Directory => 4096,
        _ => 0,
    };
    Attr {
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
    }
}

impl SqliteBackend {
    /// The database at `path` (made, with a root directory, if the file is new or empty);
    /// `unit_bytes` overrides the default unit. The error says what is wrong with the file.
    pub fn open(path: &Path, unit_bytes: Option<u64>, metrics: Arc<Metrics>) -> Result<SqliteBackend, String> {
        Self::open_with(path, unit_bytes, metrics, None)
    }

    /// `open`, as the namespace of a unit store that keeps file data elsewhere (`external`),
    /// with its tables made in the same database.
    pub fn open_with(
        path: &Path,
        unit_bytes: Option<u64>,
        metrics: Arc<Metrics>,
        external: Option<Arc<dyn ExternalData>>,
    ) -> Result<SqliteBackend, String> {
        let (db, generation) = schema::open(path)?;
        let mut inner = Inner {
            db,
            lookups: HashMap::new(),
            open_handles: HashMap::new(),
            next_id: 0,
            generation,
            births: 0,
            crashed: false,
            external,
        };
        let shown = path.display();
        let setup = (|| -> SysResult<()> {
            inner.change(|s| {
                if let Some(external) = &s.external {
                    s.db.execute_batch(external.tables()).sql()?;
                }
                if s.object_opt(ROOT_ID)?.is_none() {
                    let now = Timestamp::now();
                    let birth = s.next_birth();
                    let (uid, gid) = unsafe_ids();
                    let root = Object {
                        kind: Kind::Directory,
                        perm: 0o755,
                        uid,
                        gid,
                        rdev: 0,
                        size: 0,
                        nlink: 2,
                        atime: now,
                        mtime: now,
                        ctime: now,
                        birth,
                        target: Vec::new(),
                    };
                    s.write_object(ROOT_ID, &root)?;
                }
                // Objects a crash left without a name (unlinked while open): nothing holds them now.
                let orphans: Vec<i64> = {
                    let mut stmt = s
                        .db
                        .prepare("SELECT id FROM inodes WHERE id != 1 AND (nlink = 0 OR (kind = 'directory' AND nlink <= 1))")
                        .sql()?;
                    let rows = stmt.query_map([], |r| r.get(0)).sql()?;
                    rows.collect::<rusqlite::Result<_>>().sql()?
                };
                for id in orphans {
                    s.delete_object(id as u64)?;
                }
                let max: i64 =
                    s.db.query_row("SELECT coalesce(max(id), 1) FROM inodes WHERE id > 0", [], |r| r.get(0)).sql()?;
                s.next_id = max as u64 + 1;
                Ok(())
            })?;
            inner.commit()
        })();
        setup.map_err(|e| format!("SQLite database {shown}: setting it up: {e}"))?;
        let unit = unit_bytes.unwrap_or(DEFAULT_UNIT_BYTES);
        let capabilities = Capabilities {
            unit_bytes: unit,
            unit_source: if unit_bytes.is_some() { UnitSource::Option } else { UnitSource::Store },
            logical_block_bytes: 512,
            partial_writes: false,
            durable_writes: false,
            atomic_unit_writes: true,
            copy_ranges: false,
            allocate: false,
            // A key made in a transaction a crash lost finds nothing.
            keys_can_go_stale: true,
            sync_orders_names: true,
            keeps_chosen_ids: true,
        };
        Ok(SqliteBackend { inner: Arc::new(Mutex::new(inner)), capabilities, path: path.to_path_buf(), metrics })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Counts an open handle of the regular file `id` until the hold is dropped.
    pub fn hold_file(&self, id: ObjectId) -> SysResult<FileHold> {
        let mut s = lock(&self.inner);
        if s.object(id)?.kind != Kind::File {
            return Err(Errno(libc::EISDIR));
        }
        *s.open_handles.entry(id).or_insert(0) += 1;
        Ok(FileHold { inner: self.inner.clone(), id })
    }

    /// Runs `f` on the database with the namespace locked (for a unit store over it).
    pub fn records<T>(&self, f: impl FnOnce(&mut Records<'_>) -> SysResult<T>) -> SysResult<T> {
        let mut s = lock(&self.inner);
        f(&mut Records { s: &mut s })
    }

    /// This open's generation (bumped and committed at every open, so never given out twice
    /// by one database file).
    pub fn generation(&self) -> u64 {
        lock(&self.inner).generation
    }

    /// The intent log a crash left this database needing (the crash marker), if any.
    pub fn log_marker(&self) -> SysResult<Option<PathBuf>> {
        let s = lock(&self.inner);
        let value: Option<Vec<u8>> =
            s.db.query_row("SELECT value FROM meta WHERE key = ?1", [LOG_MARKER_KEY], |r| r.get(0)).optional().sql()?;
        Ok(value.map(|v| PathBuf::from(OsStr::from_bytes(&v))))
    }

    /// Sets (Some) or clears (None) the crash marker, durably.
    pub fn set_log_marker(&self, log: Option<&Path>) -> SysResult<()> {
        let mut s = lock(&self.inner);
        s.change(|s| {
            match log {
                Some(log) => {
                    s.db.execute(
                        "INSERT OR REPLACE INTO meta(key, value) VALUES(?1, ?2)",
                        params![LOG_MARKER_KEY, log.as_os_str().as_bytes()],
                    )
                    .sql()?
                }
                None => s.db.execute("DELETE FROM meta WHERE key = ?1", [LOG_MARKER_KEY]).sql()?,
            };
            Ok(())
        })?;
        s.commit()
    }

    /// A power cut, for tests: what no sync committed is lost, and this backend takes no more
    /// changes (an abandoned engine's threads may still call it); open the file again for the
    /// store after the crash.
    pub fn crash(&self) {
        let mut s = lock(&self.inner);
        if !s.db.is_autocommit() {
            s.db.execute_batch("ROLLBACK").expect("rollback");
        }
        s.crashed = true;
    }

    /// At a clean stop: everything committed, and the WAL copied into the database file, so
    /// that the file alone is the whole tree (to copy or back up unmounted). The WAL keeps its
    /// size (RESTART, not TRUNCATE) and the next mount writes it over from its start: a WAL
    /// that grows costs ext4 a journaled size change at every commit (about 15 KiB of a
    /// checkpoint, bench/results/2026-11-28-sqlite-perfile).
    pub fn close_wal(&self) -> SysResult<()> {
        let mut s = lock(&self.inner);
        s.commit()?;
        let busy: i64 = s.db.query_row("PRAGMA wal_checkpoint(RESTART)", [], |r| r.get(0)).sql()?;
        if busy != 0 {
            log::warn!("sqlite backend: the WAL of {} could not be emptied (a reader holds it)", self.path.display());
        }
        Ok(())
    }

    /// `PRAGMA integrity_check`'s answer ("ok" when clean), for tests and `recover`.
    pub fn integrity_check(&self) -> SysResult<String> {
        let s = lock(&self.inner);
        s.db.query_row("PRAGMA integrity_check", [], |r| r.get(0)).sql()
    }
}

/// The daemon's own uid and gid, the root directory's owner in a new database.
fn unsafe_ids() -> (u32, u32) {
    // SAFETY: getuid and getgid cannot fail and touch no memory of ours.
    unsafe { (libc::getuid(), libc::getgid()) }
}

impl Drop for SqliteBackend {
    fn drop(&mut self) {
        // What a clean stop left uncommitted (no sync after it) is kept; a crash keeps nothing.
        let mut s = lock(&self.inner);
        if s.crashed {
            return;
        }
        if let Err(e) = s.commit() {
            log::warn!("sqlite backend: the commit at close failed: {e}");
        }
    }
}

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
        if let Err(e) = s.change(|s| s.collect(id)) {
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
        let mut s = lock(&self.inner);
        s.change(|s| {
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
        lock(&self.inner).change(|s| s.make_object(parent, name, what, owner, None))
    }

    fn make_with_id(&self, id: ObjectId, parent: ObjectId, name: &OsStr, perm: u32, owner: Owner) -> SysResult<Attr> {
        lock(&self.inner).change(|s| s.make_object(parent, name, NewObject::File { perm }, owner, Some(id)))
    }

    fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr> {
        valid_name(new_name)?;
        lock(&self.inner).change(|s| {
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
        lock(&self.inner).change(|s| {
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
        lock(&self.inner).change(|s| {
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
        lock(&self.inner).change(|s| {
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
        lock(&self.inner).change(|s| {
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
        // The file system the database is on, in its block size.
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let path = crate::sys::path_cstring(dir)?;
        // SAFETY: `st` is plain data that statvfs fills; `path` is a NUL-terminated string that
        // outlives the call.
        let st = unsafe {
            let mut st: libc::statvfs = std::mem::zeroed();
            if libc::statvfs(path.as_ptr(), &mut st) != 0 {
                return Err(Errno::last());
            }
            st
        };
        let files: i64 = lock(&self.inner).db.query_row("SELECT count(*) FROM inodes", [], |r| r.get(0)).sql()?;
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
}

/// An open handle of a regular file's data: while one is held, the file lives on without a
/// name (unlinked while open); the last one let go deletes such a file. The SQLite backend's
/// data handles hold one, and so do those of a unit store over this namespace (`ExternalData`).
pub struct FileHold {
    inner: Arc<Mutex<Inner>>,
    id: ObjectId,
}

impl Drop for FileHold {
    fn drop(&mut self) {
        let mut s = lock(&self.inner);
        if let Some(n) = s.open_handles.get_mut(&self.id) {
            *n = n.saturating_sub(1);
        }
        let id = self.id;
        if let Err(e) = s.change(|s| s.collect(id)) {
            log::warn!("sqlite backend: closing object {id}: {e}");
        }
    }
}

/// The namespace's database as a unit store over it sees it (`SqliteBackend::records`): its
/// own tables read and written inside the namespace's open transaction, a file's size, the
/// commit, and the whole database's bytes for a checkpoint that ships it elsewhere.
pub struct Records<'a> {
    s: &'a mut Inner,
}

impl Records<'_> {
    pub fn db(&self) -> &Connection {
        &self.s.db
    }

    /// Runs `f` as one savepoint inside the open transaction: its changes stay only if it
    /// succeeds (as every namespace call's do).
    pub fn change<T>(&mut self, f: impl FnOnce(&Records<'_>) -> SysResult<T>) -> SysResult<T> {
        self.s.change(|s| f(&Records { s }))
    }

    /// Commits the open transaction: every change so far, names and records, is durable.
    pub fn commit(&mut self) -> SysResult<()> {
        self.s.commit()
    }

    /// The size of the regular file `id` (ESTALE when gone, EISDIR when not a file).
    pub fn file_size(&self, id: ObjectId) -> SysResult<u64> {
        let o = self.s.object(id)?;
        if o.kind != Kind::File {
            return Err(Errno(libc::EISDIR));
        }
        Ok(o.size)
    }

    /// The file's size becomes `size` (`grow`: at least `size`, as a write past the end makes
    /// it), its mtime and ctime now.
    pub fn set_file_size(&self, id: ObjectId, size: u64, grow: bool) -> SysResult<()> {
        let now = Timestamp::now();
        self.s.update(id, |o| {
            o.size = if grow { o.size.max(size) } else { size };
            o.mtime = now;
            o.ctime = now;
        })
    }

    /// Rows changed by this connection since it opened: equal counts, an unchanged database.
    pub fn total_changes(&self) -> u64 {
        self.s.db.total_changes()
    }

    /// The database's bytes as of its last commit (call `commit` first): a file that opens as
    /// this database, for a copy kept elsewhere.
    pub fn serialize(&self) -> SysResult<Vec<u8>> {
        if self.s.crashed {
            return Err(Errno(libc::EIO));
        }
        Ok(self.s.db.serialize(rusqlite::MAIN_DB).sql()?.to_vec())
    }
}

/// A file's data in the database.
struct SqliteFileData {
    inner: Arc<Mutex<Inner>>,
    metrics: Arc<Metrics>,
    id: ObjectId,
    unit_bytes: u64,
    _hold: FileHold,
}

impl FileData for SqliteFileData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        let s = lock(&self.inner);
        let size = s.object(self.id)?.size;
        if offset >= size || buf.is_empty() {
            return Ok(0);
        }
        let n = (buf.len() as u64).min(size - offset) as usize;
        let buf = &mut buf[..n];
        buf.fill(0);
        let (first, last) = (offset / self.unit_bytes, (offset + n as u64 - 1) / self.unit_bytes);
        let mut stmt =
            s.db.prepare_cached("SELECT unit, data FROM units WHERE file = ?1 AND unit BETWEEN ?2 AND ?3").sql()?;
        let rows = stmt
            .query_map(params![sql_id(self.id), first as i64, last as i64], |r| {
                Ok((r.get::<_, i64>(0)? as u64, r.get::<_, Vec<u8>>(1)?))
            })
            .sql()?;
        for row in rows {
            let (unit, data) = row.sql()?;
            let start = unit * self.unit_bytes;
            // The overlap of [start, start + len) with [offset, offset + n).
            let a = start.max(offset);
            let b = (start + data.len() as u64).min(offset + n as u64);
            if a < b {
                buf[(a - offset) as usize..(b - offset) as usize]
                    .copy_from_slice(&data[(a - start) as usize..(b - start) as usize]);
            }
        }
        Ok(n)
    }

    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let limit = unit.limit();
        // The store's rule, at its boundary: a whole unit (up to the file's end) or nothing.
        if !unit.ranges.covers(0, limit) {
            log::error!("sqlite backend: a partial unit for a store of whole units: {:?}", unit.ranges);
            return Err(Errno(libc::EIO));
        }
        let id = self.id;
        lock(&self.inner).change(|s| {
            let o = s.object(id)?;
            if o.kind != Kind::File {
                return Err(Errno(libc::EISDIR));
            }
            s.db.prepare_cached("INSERT OR REPLACE INTO units(file, unit, data) VALUES(?1, ?2, ?3)")
                .sql()?
                .execute(params![sql_id(id), unit.unit as i64, &unit.buf[..limit as usize]])
                .sql()?;
            let end = unit.start() + limit;
            let now = Timestamp::now();
            s.update(id, |o| {
                o.size = o.size.max(end);
                o.mtime = now;
                o.ctime = now;
            })
        })?;
        self.metrics.backend_write_bytes.fetch_add(limit, Relaxed);
        self.metrics.backend_write_requests.fetch_add(1, Relaxed);
        self.metrics.backend_write_sizes.record(limit);
        Ok(())
    }

    fn set_size(&self, size: u64) -> SysResult<()> {
        let (id, u) = (self.id, self.unit_bytes);
        lock(&self.inner).change(|s| {
            // Units wholly past the end go; the one the end falls in is cut there.
            s.db.prepare_cached("DELETE FROM units WHERE file = ?1 AND unit >= ?2")
                .sql()?
                .execute(params![sql_id(id), size.div_ceil(u) as i64])
                .sql()?;
            if size % u != 0 {
                let keep = (size % u) as i64;
                s.db.prepare_cached(
                    "UPDATE units SET data = substr(data, 1, ?3) WHERE file = ?1 AND unit = ?2 AND length(data) > ?3",
                )
                .sql()?
                .execute(params![sql_id(id), (size / u) as i64, keep])
                .sql()?;
            }
            let now = Timestamp::now();
            s.update(id, |o| {
                o.size = size;
                o.mtime = now;
                o.ctime = now;
            })
        })
    }

    fn size(&self) -> SysResult<u64> {
        Ok(lock(&self.inner).object(self.id)?.size)
    }

    fn sync(&self, _data_only: bool) -> SysResult<()> {
        lock(&self.inner).commit()
    }

    fn holds_data(&self) -> bool {
        let s = lock(&self.inner);
        s.db.prepare_cached("SELECT 1 FROM units WHERE file = ?1 LIMIT 1")
            .and_then(|mut stmt| stmt.query_row([sql_id(self.id)], |_| Ok(())).optional())
            .map_or(true, |found| found.is_some())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl UnitStore for SqliteBackend {
    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn open(&self, id: ObjectId, _mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        Ok(Arc::new(SqliteFileData {
            _hold: self.hold_file(id)?,
            inner: self.inner.clone(),
            metrics: self.metrics.clone(),
            id,
            unit_bytes: self.capabilities.unit_bytes,
        }))
    }

    fn sync_all(&self) -> SysResult<()> {
        lock(&self.inner).commit()
    }
}
