//! The SQLite backend (`sqlite:PATH`): a whole tree in one database file, names and data, for
//! configuration stores like pmxcfs (seed 000). The schema is in `schema`.
//!
//! Durability: every change goes into one open transaction; a sync (`FileData::sync`,
//! `Namespace::sync_dir`, `UnitStore::sync_all`) commits it, with WAL (or a rollback journal,
//! `Journal`) and synchronous=FULL. So a sync makes every change before it durable, in order, and a crash keeps a prefix of the
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

mod data;
mod namespace;
mod schema;
mod seam;
mod snapshot;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rusqlite::{params, Connection, OptionalExtension};

pub use schema::{leave_wal_at_close, Journal, WAL_KEPT_BYTES};

use crate::backend::tree_keys::{key, parse_key};
use crate::backend::{Capabilities, DirReader, FileData, Namespace, OpenMode, UnitSource, UnitStore, UnitWrite};
use crate::engine::types::{
    Attr, DirEntry, Kind, NewObject, ObjectId, Owner, SetAttr, StatFs, TimeToSet, Timestamp, XattrReply, ROOT_ID,
};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};

pub use schema::SCHEMA_VERSION;
pub use seam::{FileHold, Records};

/// The unit when `-o unit=` gives none: a row of at most 64 KiB.
pub const DEFAULT_UNIT_BYTES: u64 = 64 << 10;

/// The most file bytes the open transaction takes before it is committed without a sync: a
/// copy of gigabytes with no fsync would otherwise grow one transaction (and the WAL) without
/// bound, all of it lost to a kill. A commit in between keeps a prefix of the changes, which
/// is all the contract asks of a crash (rule 1).
pub const TRANSACTION_MAX_BYTES: u64 = 32 << 20;

/// How long a change waits for the database's write lock while another program holds it, and
/// every statement for the locks it needs (rusqlite's default busy timeout).
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// The `meta` key of the crash marker: the intent log a crash left to replay.
const LOG_MARKER_KEY: &str = "log_marker";

/// The `meta` key of the replay watermark (contract rule 7): the first intent log batch the
/// last committed checkpoint did not cover.
const REPLAY_WATERMARK_KEY: &str = "replay_watermark";

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
    /// The unit of `units` rows.
    unit_bytes: u64,
    /// File bytes written in the open transaction (`wrote`).
    bytes_uncommitted: u64,
    /// Opened read-only (`-o ro`): every change fails with EROFS, and nothing is collected.
    read_only: bool,
    /// How commits are made atomic (`schema::Journal`).
    journal: Journal,
    /// Files whose `units` rows go at the next commit (rollback mode only,
    /// `free_deferred_units`). Each is deleted from `inodes` already: nothing reads their rows
    /// meanwhile.
    units_freed_at_commit: DeferredFrees,
    /// `units` rows a unit written again or a truncate replaced in the open transaction
    /// (rollback mode only), deleted at its end: reads pass them by.
    superseded: SupersededRows,
    /// Rows longer than this are replaced to the commit, shorter ones deleted at once
    /// (`replace_rows`): two of the database's pages.
    replaced_at_commit_above: u64,
    /// The open transaction is the read transaction `hold_read` began (rollback mode), which
    /// the first change turns into the write transaction.
    holding_read: bool,
    metrics: Arc<Metrics>,
}

/// The files whose rows a commit frees, in the order they were deleted: a file made again with
/// its id (which replay and held files do, one create at a time) is found without a walk of the
/// list, which an `rm -rf` before a checkpoint makes tens of thousands long. A savepoint that
/// fails undoes what its call did to the list, in both directions: its deletes' frees are
/// forgotten, and a file it took out (made again: its old rows deleted there, which the
/// savepoint's rollback brings back) goes back in.
#[derive(Default)]
struct DeferredFrees {
    /// In deletion order; None where the file was taken out since.
    order: Vec<Option<ObjectId>>,
    at: HashMap<ObjectId, usize>,
    /// What was done since the last commit, to undo back to a `mark`.
    undo: Vec<FreesChange>,
}

enum FreesChange {
    Pushed,
    Took { at: usize, id: ObjectId },
}

impl DeferredFrees {
    /// Adds `id`, unless the list holds it already (its rows go once either way).
    fn push(&mut self, id: ObjectId) {
        if let std::collections::hash_map::Entry::Vacant(entry) = self.at.entry(id) {
            entry.insert(self.order.len());
            self.order.push(Some(id));
            self.undo.push(FreesChange::Pushed);
        }
    }

    /// Where the list stands, for `undo_to`.
    fn mark(&self) -> usize {
        self.undo.len()
    }

    /// Undoes the pushes and takes since `mark`, the last first.
    fn undo_to(&mut self, mark: usize) {
        while self.undo.len() > mark {
            match self.undo.pop().expect("longer than the mark") {
                FreesChange::Pushed => {
                    let id = self.order.pop().expect("a push is at the end").expect("its place is held");
                    self.at.remove(&id);
                }
                FreesChange::Took { at, id } => {
                    assert!(self.order[at].is_none(), "file {id}'s place was taken by another");
                    self.order[at] = Some(id);
                    self.at.insert(id, at);
                }
            }
        }
    }

    fn contains(&self, id: ObjectId) -> bool {
        self.at.contains_key(&id)
    }

    /// Takes `id` out of the list, if there.
    fn take(&mut self, id: ObjectId) {
        if let Some(at) = self.at.remove(&id) {
            self.order[at] = None;
            self.undo.push(FreesChange::Took { at, id });
        }
    }

    /// The files in the list, the last deleted first.
    fn newest_first(&self) -> Vec<ObjectId> {
        self.order.iter().rev().flatten().copied().collect()
    }

    /// Everything freed (the commit): the list starts again, with nothing to undo.
    fn committed(&mut self) {
        assert!(self.at.is_empty(), "a commit with files whose rows were not freed");
        self.clear();
    }

    #[cfg(test)]
    fn ids(&self) -> Vec<ObjectId> {
        self.order.iter().flatten().copied().collect()
    }

    fn clear(&mut self) {
        self.order.clear();
        self.at.clear();
        self.undo.clear();
    }
}

/// The `units` rows the open transaction replaced (rollback mode): a unit written again gets a
/// row of its own beside the old one, which goes at the commit (schema version 3's index is not
/// unique for this), so that the new row does not take pages the old one freed, which the
/// journal would copy first. Until then every read of a unit passes its replaced rows by.
#[derive(Default)]
struct SupersededRows {
    /// Row id to its file.
    rows: HashMap<i64, ObjectId>,
    by_file: HashMap<ObjectId, Vec<i64>>,
    /// The rows in the order they were replaced, to undo back to a `mark`.
    undo: Vec<i64>,
}

impl SupersededRows {
    fn replace(&mut self, file: ObjectId, row: i64) {
        if let std::collections::hash_map::Entry::Vacant(entry) = self.rows.entry(row) {
            entry.insert(file);
            self.by_file.entry(file).or_default().push(row);
            self.undo.push(row);
        }
    }

    fn contains(&self, row: i64) -> bool {
        self.rows.contains_key(&row)
    }

    fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn mark(&self) -> usize {
        self.undo.len()
    }

    /// A failed savepoint's replacements forgotten: its rows are the units' rows again.
    fn undo_to(&mut self, mark: usize) {
        for row in self.undo.drain(mark.min(self.undo.len())..) {
            if let Some(file) = self.rows.remove(&row) {
                if let Some(rows) = self.by_file.get_mut(&file) {
                    rows.retain(|&r| r != row);
                }
            }
        }
    }

    /// Every row of `file` deleted (the file is gone): none of them is to delete again, and
    /// their ids may be given to new rows.
    fn forget_file(&mut self, file: ObjectId) {
        for row in self.by_file.remove(&file).unwrap_or_default() {
            self.rows.remove(&row);
        }
    }

    /// `row` deleted: its id may be given to a new row.
    fn forget_row(&mut self, row: i64) {
        self.rows.remove(&row);
    }

    fn all(&self) -> Vec<i64> {
        self.rows.keys().copied().collect()
    }

    fn clear(&mut self) {
        self.rows.clear();
        self.by_file.clear();
        self.undo.clear();
    }
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
    /// At most how many bytes of `file` it holds (what a file's `st_blocks` counts, capped at
    /// its size): a hole holds none.
    fn bytes_held(&self, db: &Connection, file: ObjectId) -> rusqlite::Result<u64>;
    /// The bytes its records name in all, every file's (what statfs calls used): the data is
    /// where these say, not on the database's file system.
    fn bytes_stored(&self, db: &Connection) -> rusqlite::Result<u64>;
    /// Called inside the open transaction just before it commits: what the records written in
    /// it name must exist elsewhere before they are durable (the S3 store puts its open
    /// segment). An error fails the commit, and the transaction stays open.
    fn before_commit(&self, _db: &Connection) -> SysResult<()> {
        Ok(())
    }
    /// For a unit store to find its own side among the namespace's (`SqliteBackend::external`).
    fn as_any(&self) -> &dyn std::any::Any;
}

pub struct SqliteBackend {
    /// One connection behind one lock, for every call. Not for want of a pool: the daemon's
    /// transaction stays open between syncs (a commit per checkpoint, not per call), and only
    /// the connection that holds it sees its changes; a second connection would read the last
    /// commit, a tree older than the one the mount serves. Readers that want a commit's view do
    /// open their own (`snapshot_into`).
    inner: Arc<Mutex<Inner>>,
    capabilities: Capabilities,
    path: PathBuf,
    metrics: Arc<Metrics>,
}

/// Why `Inner::try_write_lock` did not take the write lock.
enum WriteLock {
    /// Another program holds it.
    Busy,
    Failed(Errno),
}

/// `inner` locked with the database's write lock taken for a change (`Inner::change` next),
/// having waited for it with the backend's mutex let go: while another program holds the lock
/// (a `sqlite3` shell in a transaction), lookups, reads and attributes go on answering, where
/// every flusher's attempt used to hold the mutex for the whole busy timeout and stall them
/// all. After `LOCK_WAIT` it fails with EIO (the engine keeps the data buffered and tries
/// again).
fn locked_for_change(inner: &Mutex<Inner>) -> SysResult<MutexGuard<'_, Inner>> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        let mut s = lock(inner);
        match s.try_write_lock() {
            Ok(()) => return Ok(s),
            Err(WriteLock::Failed(e)) => return Err(e),
            Err(WriteLock::Busy) if started.elapsed() >= LOCK_WAIT => {
                s.metrics.sqlite_lock_wait_failures.fetch_add(1, Relaxed);
                log::error!(
                    "sqlite backend: another program has held the database's write lock for {} s: the change \
                     fails with EIO (buffered data stays buffered and is written when the lock is free)",
                    LOCK_WAIT.as_secs()
                );
                return Err(Errno(libc::EIO));
            }
            Err(WriteLock::Busy) => {
                if pause == Duration::from_millis(1) {
                    s.metrics.sqlite_lock_waits.fetch_add(1, Relaxed);
                }
            }
        }
        drop(s);
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Runs `f` as one change (`Inner::change`) once the write lock is taken (`locked_for_change`).
fn change_waiting<T>(inner: &Mutex<Inner>, f: impl FnOnce(&mut Inner) -> SysResult<T>) -> SysResult<T> {
    locked_for_change(inner)?.change(f)
}

/// Deletes `id` if nothing names or holds it any more (read-only: it stays, as the file does).
/// `s` is `inner` locked; only a deletion is a change, so the close of a file and the kernel's
/// forget of a name, which come by the thousand, take no write lock (they began a write
/// transaction each until 2026-12-05, and waited for one while another program held it).
fn collect_if_unheld(inner: &Mutex<Inner>, s: MutexGuard<'_, Inner>, id: ObjectId) -> SysResult<()> {
    if s.read_only || !s.unheld(id)? {
        return Ok(());
    }
    drop(s);
    change_waiting(inner, |s| s.collect(id))
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
    not_too_long(name)
}

/// The longest name a directory holds, as on ext4 (`NAME_MAX`). The kernel passes FUSE names
/// up to 1,024 bytes: a longer one is ENAMETOOLONG wherever it is looked up, never ENOENT.
const NAME_MAX_BYTES: usize = 255;

fn not_too_long(name: &OsStr) -> SysResult<()> {
    if name.as_bytes().len() > NAME_MAX_BYTES {
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
        if self.read_only {
            return Err(Errno(libc::EROFS));
        }
        if self.db.is_autocommit() {
            self.db.execute_batch("BEGIN IMMEDIATE").sql()?;
        }
        self.db.execute_batch("SAVEPOINT call").sql()?;
        let freed_before = self.units_freed_at_commit.mark();
        let replaced_before = self.superseded.mark();
        match f(self) {
            Ok(value) => {
                self.db.execute_batch("RELEASE call").sql()?;
                Ok(value)
            }
            Err(e) => {
                // The savepoint's deletes are undone, so are the frees they deferred.
                self.units_freed_at_commit.undo_to(freed_before);
                self.superseded.undo_to(replaced_before);
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
            self.free_deferred_units()?;
            if let Some(external) = &self.external {
                external.before_commit(&self.db)?;
            }
            self.db.execute_batch("COMMIT").sql()?;
            self.holding_read = false;
        }
        self.bytes_uncommitted = 0;
        self.hold_read()
    }

    /// In rollback mode, a read transaction held from one commit to the next write: every read
    /// that begins without one first opens the `-journal` file to see whether a crash left it
    /// to undo, and SQLite running as root then `fchown`s it to the database's owner, a ctime
    /// change: an ext4 journal commit (3-16 KiB) at the next sync for every file seed 000's
    /// writers make, where nothing of the database changed. Held, the lock is taken once a
    /// commit; the next write statement turns it into the write transaction. Readers beside it
    /// are not held up (SHARED locks share); a write by another program waits, as it would for
    /// the open write transaction anyway.
    fn hold_read(&mut self) -> SysResult<()> {
        if self.journal == Journal::Rollback && !self.read_only && self.db.is_autocommit() {
            self.db.execute_batch("BEGIN DEFERRED; SELECT count(*) FROM meta;").sql()?;
            self.holding_read = true;
        }
        Ok(())
    }

    /// Takes the database's write lock for a change, if the open transaction does not hold it
    /// yet, without waiting for another program that holds it: `Busy` then, and the caller
    /// waits with the backend's mutex let go (`change_waiting`). In rollback mode the read
    /// transaction `hold_read` keeps is let go too: the other program cannot commit while it
    /// is held.
    fn try_write_lock(&mut self) -> Result<(), WriteLock> {
        if self.crashed || self.read_only {
            return Ok(()); // `change` refuses
        }
        let statement = if self.db.is_autocommit() {
            "BEGIN IMMEDIATE"
        } else if self.holding_read {
            // A write statement that changes nothing takes the write lock (RESERVED) for the
            // transaction, as the change's first write would, and opens no journal.
            "UPDATE meta SET value = value WHERE 0"
        } else {
            return Ok(());
        };
        let timeout = |db: &Connection, wait| db.busy_timeout(wait).sql().map_err(WriteLock::Failed);
        timeout(&self.db, Duration::ZERO)?;
        let result = self.db.execute_batch(statement);
        timeout(&self.db, LOCK_WAIT)?;
        match result {
            Ok(()) => {
                self.holding_read = false;
                Ok(())
            }
            Err(rusqlite::Error::SqliteFailure(e, _)) if e.code == rusqlite::ErrorCode::DatabaseBusy => {
                if self.holding_read {
                    self.db.execute_batch("ROLLBACK").sql().map_err(WriteLock::Failed)?;
                    self.holding_read = false;
                }
                Err(WriteLock::Busy)
            }
            Err(e) => Err(WriteLock::Failed(errno(e))),
        }
    }

    /// The first intent log batch the last checkpoint's commit did not cover, as the open
    /// transaction sees it.
    fn replay_watermark(&self) -> SysResult<Option<u64>> {
        let value: Option<i64> = self
            .db
            .prepare_cached("SELECT value FROM meta WHERE key = ?1")
            .sql()?
            .query_row([REPLAY_WATERMARK_KEY], |r| r.get(0))
            .optional()
            .sql()?;
        Ok(value.map(|v| v as u64))
    }

    /// Every `units` row of file `id`, deleted now.
    fn delete_units(&mut self, id: ObjectId) -> SysResult<()> {
        self.db.prepare_cached("DELETE FROM units WHERE file = ?1").sql()?.execute([sql_id(id)]).sql()?;
        self.superseded.forget_file(id);
        Ok(())
    }

    /// Rows `unit` and past of file `id` replaced (`replace_rows`).
    fn replace_units_from(&mut self, id: ObjectId, unit: u64) -> SysResult<()> {
        self.replace_rows(id, unit, i64::MAX as u64)
    }

    /// Unit `unit` of file `id` about to be written again: its rows replaced (`replace_rows`).
    fn replace_unit(&mut self, id: ObjectId, unit: u64) -> SysResult<()> {
        self.replace_rows(id, unit, unit)
    }

    /// The live rows of units `first..=last` of file `id` replaced. In WAL mode they are
    /// deleted now: every page is written twice whatever it held, and a freed page is best
    /// reused. In rollback mode a row longer than two pages stays to the commit
    /// (`SupersededRows`): deleted now, its overflow pages would be taken by the rows written
    /// next, each copied into the journal first. A shorter row is deleted now: its new row goes
    /// in its page, which is journaled once either way, where a new row elsewhere would dirty
    /// another page (another 4 KiB block on 4Kn).
    fn replace_rows(&mut self, id: ObjectId, first: u64, last: u64) -> SysResult<()> {
        assert!(first <= last && i64::try_from(last).is_ok(), "units {first}..={last} of file {id}");
        let range = params![sql_id(id), first as i64, last as i64];
        // Constant statements, each prepared once: this is on every unit's write.
        if self.journal == Journal::Wal {
            self.db
                .prepare_cached("DELETE FROM units WHERE file = ?1 AND unit BETWEEN ?2 AND ?3")
                .sql()?
                .execute(range)
                .sql()?;
            return Ok(());
        }
        let rows: Vec<(i64, i64)> = self
            .db
            .prepare_cached("SELECT rowid, length(data) FROM units WHERE file = ?1 AND unit BETWEEN ?2 AND ?3")
            .sql()?
            .query_map(range, |r| Ok((r.get(0)?, r.get(1)?)))
            .sql()?
            .collect::<Result<_, _>>()
            .sql()?;
        for (row, len) in rows {
            if self.superseded.contains(row) {
                continue;
            }
            if len as u64 > self.replaced_at_commit_above {
                self.superseded.replace(id, row);
            } else {
                self.db.prepare_cached("DELETE FROM units WHERE rowid = ?1").sql()?.execute([row]).sql()?;
            }
        }
        Ok(())
    }

    /// The bytes `within` unit `unit` of file `id` made zeros (a hole punched through part of
    /// it): cut off where they reach the row's end, for a short row reads as zeros past it; the
    /// row deleted where nothing else is left in it.
    fn zero_in_unit(&mut self, id: ObjectId, unit: u64, within: std::ops::Range<u64>) -> SysResult<()> {
        let Some((row, len)) = self.unit_row(id, unit)? else { return Ok(()) };
        if within.start >= len {
            return Ok(());
        }
        let mut data: Vec<u8> = self
            .db
            .prepare_cached("SELECT data FROM units WHERE rowid = ?1")
            .sql()?
            .query_row([row], |r| r.get(0))
            .sql()?;
        assert_eq!(data.len() as u64, len, "row {row} of file {id}, unit {unit}");
        let (a, b) = (within.start as usize, (within.end.min(len)) as usize);
        data[a..b].fill(0);
        let kept = data.iter().rposition(|&byte| byte != 0).map_or(0, |last| last + 1);
        data.truncate(kept);
        if data.is_empty() {
            return self.replace_unit(id, unit);
        }
        if self.journal == Journal::Rollback && len > self.replaced_at_commit_above {
            self.db
                .prepare_cached("INSERT INTO units(file, unit, data) VALUES(?1, ?2, ?3)")
                .sql()?
                .execute(params![sql_id(id), unit as i64, &data])
                .sql()?;
            self.superseded.replace(id, row);
        } else {
            self.db
                .prepare_cached("UPDATE units SET data = ?2 WHERE rowid = ?1")
                .sql()?
                .execute(params![row, &data])
                .sql()?;
        }
        Ok(())
    }

    /// The live row of unit `unit` of file `id`, if any: its row id and length.
    fn unit_row(&self, id: ObjectId, unit: u64) -> SysResult<Option<(i64, u64)>> {
        let mut stmt =
            self.db.prepare_cached("SELECT rowid, length(data) FROM units WHERE file = ?1 AND unit = ?2").sql()?;
        let rows = stmt
            .query_map(params![sql_id(id), unit as i64], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))
            .sql()?;
        for row in rows {
            let (row, len) = row.sql()?;
            if !self.superseded.contains(row) {
                return Ok(Some((row, len as u64)));
            }
        }
        Ok(None)
    }

    /// The `units` rows of the files deleted in the open transaction, deleted now, at its end:
    /// the pages they free are not reused by rows written in the same transaction, which in
    /// rollback mode would cost each such page a copy of its old bytes in the journal.
    fn free_deferred_units(&mut self) -> SysResult<()> {
        // Each replaced row leaves the set once deleted: a row id deleted and still in it could
        // be given to a new row, which reads would then pass by.
        for row in self.superseded.all() {
            self.db.prepare_cached("DELETE FROM units WHERE rowid = ?1").sql()?.execute([row]).sql()?;
            self.superseded.forget_row(row);
        }
        self.superseded.clear();
        // Each file's rows go before it leaves the list: a failed delete leaves the rest.
        for id in self.units_freed_at_commit.newest_first() {
            self.delete_units(id)?;
            self.units_freed_at_commit.take(id);
        }
        self.units_freed_at_commit.committed();
        Ok(())
    }

    /// Counts `bytes` of file data written in the open transaction, and commits it once it
    /// holds more than `TRANSACTION_MAX_BYTES`.
    fn wrote(&mut self, bytes: u64) -> SysResult<()> {
        self.bytes_uncommitted += bytes;
        if self.bytes_uncommitted > TRANSACTION_MAX_BYTES {
            self.commit()?;
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
        not_too_long(name)?;
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
        let mut attr = attr_of(id, &o);
        if o.kind == Kind::File && o.size > 0 {
            attr.blocks = self.bytes_held(id)?.min(o.size).div_ceil(512);
        }
        Ok(attr)
    }

    /// At most how many bytes file `id` holds: its units with a row, whole (the rows a store
    /// of whole units writes are whole but for the file's last and a punched hole's ends). A
    /// hole holds none, so `du` counts a sparse file as ext4 does, and `cp` and `tar
    /// --sparse`, which look for holes only where `st_blocks` says the size is not all held,
    /// find them. One look in the index: 0.6 ms for a file of 1 GiB (16,384 rows), where the
    /// rows' exact lengths took 12 ms.
    fn bytes_held(&self, id: ObjectId) -> SysResult<u64> {
        if let Some(external) = &self.external {
            return external.bytes_held(&self.db, id).sql();
        }
        let rows: i64 = self
            .db
            .prepare_cached("SELECT count(*) FROM units WHERE file = ?1")
            .sql()?
            .query_row([sql_id(id)], |r| r.get(0))
            .sql()?;
        Ok(rows as u64 * self.unit_bytes)
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

    /// The file's size becomes `size` (`grow`: at least `size`, as a write past the end makes
    /// it), its mtime and ctime now.
    fn set_file_size(&self, id: ObjectId, size: u64, grow: bool) -> SysResult<()> {
        let now = Timestamp::now();
        self.update(id, |o| {
            o.size = if grow { o.size.max(size) } else { size };
            o.mtime = now;
            o.ctime = now;
        })
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
    /// Whether nothing names or holds `id` any more: it is to be deleted (`collect`).
    fn unheld(&self, id: ObjectId) -> SysResult<bool> {
        let Some(o) = self.object_opt(id)? else { return Ok(false) };
        let unnamed = o.nlink == 0 || (o.kind == Kind::Directory && o.nlink <= 1);
        let held = self.lookups.get(&id).is_some_and(|&n| n > 0) || self.open_handles.get(&id).is_some_and(|&n| n > 0);
        Ok(unnamed && !held && id != ROOT_ID)
    }

    fn collect(&mut self, id: ObjectId) -> SysResult<()> {
        if self.unheld(id)? {
            self.delete_object(id)?;
        }
        Ok(())
    }

    fn delete_object(&mut self, id: ObjectId) -> SysResult<()> {
        for sql in ["DELETE FROM inodes WHERE id = ?1", "DELETE FROM xattrs WHERE id = ?1"] {
            self.db.prepare_cached(sql).sql()?.execute([sql_id(id)]).sql()?;
        }
        match self.journal {
            Journal::Rollback => self.units_freed_at_commit.push(id),
            Journal::Wal => {
                // Pages are written twice in WAL mode whatever they held: freeing at once lets
                // the transaction reuse them, and the database grows less.
                self.delete_units(id)?;
            }
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
                if self.units_freed_at_commit.contains(id) {
                    // A file of this id went earlier in the transaction: its rows go before the
                    // new file's, not at the commit after them.
                    self.delete_units(id)?;
                    self.units_freed_at_commit.take(id);
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
        Self::open_mode(path, unit_bytes, metrics, None, false, None)
    }

    /// `open`, the database put in `journal` mode (`-o sqlite_journal=`) first; None keeps the
    /// file's.
    pub fn open_in_journal_mode(
        path: &Path,
        unit_bytes: Option<u64>,
        metrics: Arc<Metrics>,
        journal: Option<Journal>,
    ) -> Result<SqliteBackend, String> {
        Self::open_mode(path, unit_bytes, metrics, None, false, journal)
    }

    /// `open`, as the namespace of a unit store that keeps file data elsewhere (`external`),
    /// with its tables made in the same database.
    pub fn open_with(
        path: &Path,
        unit_bytes: Option<u64>,
        metrics: Arc<Metrics>,
        external: Option<Arc<dyn ExternalData>>,
    ) -> Result<SqliteBackend, String> {
        Self::open_mode(path, unit_bytes, metrics, external, false, None)
    }

    /// An existing database, read-only (`-o ro`): nothing is made, collected or written; every
    /// change fails with EROFS.
    pub fn open_read_only(
        path: &Path,
        unit_bytes: Option<u64>,
        metrics: Arc<Metrics>,
    ) -> Result<SqliteBackend, String> {
        Self::open_mode(path, unit_bytes, metrics, None, true, None)
    }

    /// `open_read_only`, as the namespace of a unit store that keeps file data elsewhere (an
    /// S3 bucket mounted read-only).
    pub fn open_read_only_with(
        path: &Path,
        unit_bytes: Option<u64>,
        metrics: Arc<Metrics>,
        external: Arc<dyn ExternalData>,
    ) -> Result<SqliteBackend, String> {
        Self::open_mode(path, unit_bytes, metrics, Some(external), true, None)
    }

    fn open_mode(
        path: &Path,
        unit_bytes: Option<u64>,
        metrics: Arc<Metrics>,
        external: Option<Arc<dyn ExternalData>>,
        read_only: bool,
        journal: Option<Journal>,
    ) -> Result<SqliteBackend, String> {
        let (db, generation, journal) =
            if read_only { schema::open_read_only(path)? } else { schema::open(path, journal)? };
        let unit = unit_bytes.unwrap_or(DEFAULT_UNIT_BYTES);
        let mut inner = Inner {
            db,
            lookups: HashMap::new(),
            open_handles: HashMap::new(),
            next_id: 0,
            generation,
            births: 0,
            crashed: false,
            external,
            unit_bytes: unit,
            bytes_uncommitted: 0,
            read_only,
            journal,
            units_freed_at_commit: DeferredFrees::default(),
            superseded: SupersededRows::default(),
            holding_read: false,
            replaced_at_commit_above: 2 * u64::from(schema::PAGE_BYTES),
            metrics: metrics.clone(),
        };
        if let Ok(page) = inner.db.query_row("PRAGMA page_size", [], |r| r.get::<_, i64>(0)) {
            inner.replaced_at_commit_above = 2 * page as u64;
        }
        let shown = path.display();
        let setup = (|| -> SysResult<()> {
            if read_only {
                return match inner.object_opt(ROOT_ID)? {
                    Some(_) => Ok(()),
                    None => Err(Errno(libc::ENOENT)),
                };
            }
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
        let capabilities = Capabilities {
            unit_bytes: unit,
            unit_source: if unit_bytes.is_some() { UnitSource::Option } else { UnitSource::Store },
            logical_block_bytes: 512,
            partial_writes: false,
            syncs_cost_requests: false,
            durable_writes: false,
            atomic_unit_writes: true,
            copy_ranges: true,
            // Hole punching (`FileData::allocate` in data.rs); preallocation answers EOPNOTSUPP.
            allocate: true,
            // A key made in a transaction a crash lost finds nothing.
            keys_can_go_stale: true,
            sync_orders_names: true,
            keeps_chosen_ids: true,
            keeps_replay_watermark: true,
            preferred_flushers: None,
        };
        Ok(SqliteBackend { inner: Arc::new(Mutex::new(inner)), capabilities, path: path.to_path_buf(), metrics })
    }

    /// The unit store's side of this database, when opened with one (`open_with`).
    pub fn external(&self) -> Option<Arc<dyn ExternalData>> {
        lock(&self.inner).external.clone()
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

    /// Opened read-only (`-o ro`): every change fails with EROFS.
    pub fn read_only(&self) -> bool {
        lock(&self.inner).read_only
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
        s.units_freed_at_commit.clear();
        s.superseded.clear();
        s.crashed = true;
    }

    /// At a clean stop: everything committed, and the WAL copied into the database file, so
    /// that the file alone is the whole tree (to copy or back up unmounted). The WAL file stays
    /// as long as it is (`schema::WAL_KEPT_BYTES` or what a transaction grew it to), and starts
    /// over: after RESTART the next write transaction begins the WAL again at its start, so one
    /// small write (`closed_at`) leaves it holding that alone. Without it the next open would
    /// find the whole last cycle's frames valid and copy them into the database again. In
    /// rollback mode every commit wrote the database file already: only the time is written.
    /// With `clear_log_marker` (nothing left to replay) the crash marker goes in that same
    /// transaction: cleared in one of its own first, it cost a second commit (in WAL mode its
    /// frames copied by RESTART as well), about half of what an idle unmount wrote.
    pub fn close_at_unmount(&self, clear_log_marker: bool) -> SysResult<()> {
        let mut s = lock(&self.inner);
        s.commit()?;
        let wal = s.journal == Journal::Wal;
        let mut wal_emptied = wal;
        if wal {
            let busy: i64 = s.db.query_row("PRAGMA wal_checkpoint(RESTART)", [], |r| r.get(0)).sql()?;
            if busy != 0 {
                log::warn!(
                    "sqlite backend: the WAL of {} could not be emptied (a reader holds it)",
                    self.path.display()
                );
                wal_emptied = false;
                if !clear_log_marker {
                    return Ok(());
                }
            }
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        s.change(|s| {
            s.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('closed_at', ?1)", [now]).sql()?;
            if clear_log_marker {
                s.db.execute("DELETE FROM meta WHERE key = ?1", [LOG_MARKER_KEY]).sql()?;
            }
            Ok(())
        })?;
        s.commit()?;
        if wal_emptied {
            // And that row into the database file too: the daemon exits without closing the
            // connection (whose close would copy it), and the file alone must be the database.
            s.db.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())).sql()?;
        }
        Ok(())
    }

    /// How the database's commits are made atomic.
    pub fn journal(&self) -> Journal {
        lock(&self.inner).journal
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
