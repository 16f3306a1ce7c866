//! The database file: opening it (with a clear error for what is not ours to write), its
//! schema, and the `meta` table's values. Owns no file-system semantics (`super` does).
//!
//! Schema version 3 (`PRAGMA user_version`), readable with the `sqlite3` CLI:
//!
//! - `meta(key, value)`: `generation` (bumped and committed at every open: keys made by one
//!   open never match another's), `log_marker` (the intent log a crash left to replay),
//!   `replay_watermark` (the first batch of that log the last checkpoint's commit did not
//!   cover: replay starts there), `closed_at` (the Unix time of the last clean unmount,
//!   written after the WAL was emptied so that the WAL starts over).
//! - `inodes(id, birth, kind, mode, uid, gid, rdev, size, nlink, atime_s, atime_ns, mtime_s,
//!   mtime_ns, ctime_s, ctime_ns, target)`: `mode` is the whole `st_mode`, `kind` its format
//!   in words, `target` a symlink's. Ids are u64 stored as i64 (the engine's reserved range
//!   reads negative).
//! - `dentries(parent, name, child)`: one row per name.
//! - `xattrs(id, name, value)`.
//! - `units(file, unit, data)`: unit `unit` of file `file`, bytes [unit * U, unit * U + len);
//!   a missing row is a hole. A rowid table with a unique index on `(file, unit)`: version 1
//!   kept it `WITHOUT ROWID`, an index b-tree, whose rows hold at most ~1,000 bytes of a 4 KiB
//!   page before the rest goes to an overflow page of its own, so a 1-4 KiB file took a whole
//!   extra page; a rowid table keeps up to ~4,000 in the row, and new files' rows (higher
//!   rowids) fill pages in order. Version 1 files are converted at a read-write open.
//!   Version 3 makes the index on `(file, unit)` not unique: in rollback mode a unit written
//!   again (or cut by a truncate) keeps its old row, if longer than two pages, to the end of
//!   the transaction, deleted then, so that the new row does not take the pages the old one frees, each of which the
//!   journal would first copy (`Inner::superseded`). Only the open transaction itself sees two
//!   rows of a unit; every commit has one at most. A version 2 file's index is made again at a
//!   read-write open.
//!
//! Pages of 1 KiB (set when the file is made): measured against 2, 4 and 8 KiB on the
//! config-store workload and seed 000's per-file case, the fewest bytes written
//! (bench/results/2026-11-29-sqlite-layout), at some cost to large files' throughput.

use std::path::Path;

use rusqlite::{Connection, OpenFlags, OptionalExtension};

pub const SCHEMA_VERSION: i64 = 3;

/// The page size of a database this coalescefs makes (an existing one keeps its own).
pub const PAGE_BYTES: u32 = 1024;

/// The WAL file's size, written once and kept from one mount to the next. A WAL that grows
/// costs ext4 a journaled size change and block allocation at every commit: 86.5 KB a
/// checkpoint of one new file against 45.6 KB over a WAL that is written over in place
/// (bench/results/2026-11-29-sqlite-wal). SQLite starts the WAL over after its automatic
/// checkpoint (1,000 pages: about 1 MiB with 1 KiB pages), so twice that holds a cycle and a
/// transaction of 1 MiB past it. A larger transaction grows the file, which then keeps that size
/// (no `journal_size_limit`: cutting it back at each start-over made a workload of large
/// transactions grow it again every cycle); `TRANSACTION_MAX_BYTES` bounds it.
pub const WAL_KEPT_BYTES: u64 = 2 << 20;

const CREATE: &str = "
CREATE TABLE meta(key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE inodes(
    id INTEGER PRIMARY KEY, birth INTEGER NOT NULL, kind TEXT NOT NULL, mode INTEGER NOT NULL,
    uid INTEGER NOT NULL, gid INTEGER NOT NULL, rdev INTEGER NOT NULL, size INTEGER NOT NULL,
    nlink INTEGER NOT NULL,
    atime_s INTEGER NOT NULL, atime_ns INTEGER NOT NULL, mtime_s INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL, ctime_s INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    target BLOB);
CREATE TABLE dentries(parent INTEGER NOT NULL, name BLOB NOT NULL, child INTEGER NOT NULL,
    PRIMARY KEY(parent, name)) WITHOUT ROWID;
CREATE INDEX dentries_by_child ON dentries(child);
CREATE TABLE xattrs(id INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY(id, name)) WITHOUT ROWID;
CREATE TABLE units(file INTEGER NOT NULL, unit INTEGER NOT NULL, data BLOB NOT NULL);
CREATE INDEX units_by_file ON units(file, unit);
";

/// Version 1 to 2: `units` from an index b-tree to a rowid table (above), rows copied in key
/// order; one transaction with the open's, so a crash leaves version 1 whole.
const UNITS_FROM_VERSION_1: &str = "
CREATE TABLE units_v2(file INTEGER NOT NULL, unit INTEGER NOT NULL, data BLOB NOT NULL);
INSERT INTO units_v2(file, unit, data) SELECT file, unit, data FROM units ORDER BY file, unit;
DROP TABLE units;
ALTER TABLE units_v2 RENAME TO units;
CREATE INDEX units_by_file ON units(file, unit);
";

/// Version 2 to 3: the index on `(file, unit)` made again, not unique (above).
const UNITS_FROM_VERSION_2: &str = "
DROP INDEX units_by_file;
CREATE INDEX units_by_file ON units(file, unit);
";

/// How the database's commits are made atomic, kept in the file from one open to the next (a
/// WAL database's header says so; any other opens in rollback mode) and changed by the mount
/// option `sqlite_journal=wal|rollback`.
///
/// - `Wal` (a new database's): each commit appends its pages to the WAL, and SQLite's
///   checkpoint copies them into the database file: every page written twice. Readers (a
///   `sqlite3` shell, `coalescefs snapshot`) never hold up the daemon's commits.
/// - `Rollback` (`PRAGMA journal_mode = PERSIST`): before a commit writes pages of the database
///   in place, their old bytes go to the `-journal` file, whose header is zeroed at the end (the
///   file is kept: no size change for ext4 to journal). A page the file did not have, or one
///   free before the transaction, has no old bytes to keep: new rows are written once. The
///   backend frees a checkpoint's deleted rows only at its commit, so that its new rows do not
///   reuse pages freed in the same transaction (those would be journaled). A reader holds up the
///   daemon's commit while it reads: 5 s at most (rusqlite's busy timeout), then the commit fails with EIO and the
///   transaction stays open (a checkpoint is tried again, its records still in the intent log;
///   with `log=off` the fsync that asked fails).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Journal {
    Wal,
    Rollback,
}

impl Journal {
    /// The mount option's value.
    pub fn parse(value: &str) -> Option<Journal> {
        match value {
            "wal" => Some(Journal::Wal),
            "rollback" => Some(Journal::Rollback),
            _ => None,
        }
    }

    /// `PRAGMA journal_mode`'s name for it.
    fn pragma(self) -> &'static str {
        match self {
            Journal::Wal => "wal",
            Journal::Rollback => "persist",
        }
    }
}

/// The versions a read-only open reads: versions 1's and 2's tables answer the same queries.
fn readable(version: i64) -> bool {
    (1..=SCHEMA_VERSION).contains(&version)
}

/// The WAL file of the database at `path`.
pub fn wal_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push("-wal");
    name.into()
}

/// The rollback journal of the database at `path`.
pub fn journal_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push("-journal");
    name.into()
}

/// Makes the WAL file `WAL_KEPT_BYTES` long once, and keeps it: SQLite's persistent-WAL mode
/// (the last connection's close leaves the file instead of deleting it). Only zeros past the
/// file's end are written: SQLite reads the WAL up to its first invalid frame, and a zero frame
/// is one, so a reader of the file (`sqlite3`, the snapshot) sees the same WAL before and after.
fn keep_wal(db: &Connection, path: &Path) -> std::io::Result<()> {
    leave_wal_at_close(db)?;
    let wal = std::fs::OpenOptions::new().write(true).open(wal_path(path))?;
    let length = wal.metadata()?.len();
    if length >= WAL_KEPT_BYTES {
        return Ok(());
    }
    use std::os::unix::fs::FileExt;
    let zeros = vec![0u8; 256 << 10];
    let mut at = length;
    while at < WAL_KEPT_BYTES {
        let n = zeros.len().min((WAL_KEPT_BYTES - at) as usize);
        wal.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    wal.sync_data()
}

/// SQLite's persistent-WAL mode for `db`: when it is the database's last connection, its close
/// leaves the WAL file (emptied into the database) instead of deleting it. Every read-write
/// connection to a database this coalescefs keeps sets it, or the WAL's kept size is lost.
pub fn leave_wal_at_close(db: &Connection) -> std::io::Result<()> {
    let mut persist: std::os::raw::c_int = 1;
    // SAFETY: the handle is this open connection's; the call reads and writes one c_int.
    let rc = unsafe {
        rusqlite::ffi::sqlite3_file_control(
            db.handle(),
            c"main".as_ptr(),
            rusqlite::ffi::SQLITE_FCNTL_PERSIST_WAL,
            (&raw mut persist).cast(),
        )
    };
    if rc != rusqlite::ffi::SQLITE_OK {
        return Err(std::io::Error::other(format!("persistent WAL mode refused (SQLite code {rc})")));
    }
    Ok(())
}

/// Opens an existing database read-only (`-o ro`): its schema checked, nothing written, its
/// generation and journal mode read as they are. Returns the connection, the generation and
/// the journal mode.
pub fn open_read_only(path: &Path) -> Result<(Connection, u64, Journal), String> {
    let shown = path.display();
    if !path.is_file() {
        return Err(format!("SQLite database {shown}: no such file (a read-only mount makes none)"));
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let db = Connection::open_with_flags(path, flags).map_err(|e| format!("SQLite database {shown}: {e}"))?;
    let fail = |what: &str, e: rusqlite::Error| match &e {
        rusqlite::Error::SqliteFailure(failure, _)
            if failure.extended_code == rusqlite::ffi::SQLITE_READONLY_ROLLBACK =>
        {
            format!(
                "SQLite database {shown}: a commit a crash cut short left its rollback journal {} to undo, which a \
                 read-only open cannot: mount it read-write once (or `coalescefs recover`) first ({what}: {e})",
                journal_path(path).display()
            )
        }
        _ if e.sqlite_error_code() == Some(rusqlite::ErrorCode::NotADatabase) => {
            format!("{shown} is not a SQLite database ({what}: {e})")
        }
        _ => format!("SQLite database {shown}: {what}: {e}"),
    };
    let version: i64 =
        db.query_row("PRAGMA user_version", [], |row| row.get(0)).map_err(|e| fail("reading its version", e))?;
    if !readable(version) {
        return Err(format!(
            "SQLite database {shown} has schema version {version} (user_version), this coalescefs reads 1 to {SCHEMA_VERSION}: \
             it is another program's database, another version's, or was never mounted read-write"
        ));
    }
    let generation: i64 = db
        .query_row("SELECT value FROM meta WHERE key = 'generation'", [], |row| row.get(0))
        .map_err(|e| fail("reading its generation", e))?;
    let mode: String =
        db.query_row("PRAGMA journal_mode", [], |row| row.get(0)).map_err(|e| fail("reading its journal mode", e))?;
    let journal = if mode.eq_ignore_ascii_case("wal") { Journal::Wal } else { Journal::Rollback };
    Ok((db, generation as u64, journal))
}

/// Opens (or makes, with its directory present) the database at `path` for writing: in
/// `journal` mode (None: the one the file has, WAL for a new file), synchronous=FULL, the schema
/// checked or made, the generation bumped and committed. Returns the connection, the
/// generation and the journal mode.
pub fn open(path: &Path, journal: Option<Journal>) -> Result<(Connection, u64, Journal), String> {
    let shown = path.display();
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => {
            return Err(format!("SQLite database {shown}: its directory {} does not exist", dir.display()));
        }
        _ => {}
    }
    if path.is_dir() {
        return Err(format!("SQLite database {shown}: is a directory"));
    }
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let db = Connection::open_with_flags(path, flags).map_err(|e| format!("SQLite database {shown}: {e}"))?;
    let fail = |what: &str, e: rusqlite::Error| match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) => format!("{shown} is not a SQLite database ({what}: {e})"),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            format!("SQLite database {shown} is locked by another program ({what}: {e})")
        }
        Some(rusqlite::ErrorCode::ReadOnly) => {
            format!("SQLite database {shown} is read-only ({what}: {e}); `-o ro` mounts it to read")
        }
        _ => format!("SQLite database {shown}: {what}: {e}"),
    };
    // Reading the header first: a file that is not a database fails here, before any write.
    let version: i64 =
        db.query_row("PRAGMA user_version", [], |row| row.get(0)).map_err(|e| fail("reading its version", e))?;
    let tables: i64 = db
        .query_row("SELECT count(*) FROM sqlite_master", [], |row| row.get(0))
        .map_err(|e| fail("reading its schema", e))?;
    if tables > 0 && !readable(version) {
        return Err(format!(
            "SQLite database {shown} has schema version {version} (user_version), this coalescefs reads 1 to {SCHEMA_VERSION}: \
             it is another program's database or another version's, and is left as it is"
        ));
    }
    if tables == 0 {
        // Before the first table: the page size is fixed then.
        db.execute_batch(&format!("PRAGMA page_size = {PAGE_BYTES}")).map_err(|e| fail("setting its page size", e))?;
    }
    // The header read above put the connection in WAL mode if the file is in it.
    let current: String =
        db.query_row("PRAGMA journal_mode", [], |row| row.get(0)).map_err(|e| fail("reading its journal mode", e))?;
    let journal = journal.unwrap_or(if tables == 0 || current.eq_ignore_ascii_case("wal") {
        Journal::Wal
    } else {
        Journal::Rollback
    });
    let wanted = journal.pragma();
    let mode: String = db
        .query_row(&format!("PRAGMA journal_mode = {wanted}"), [], |row| row.get(0))
        .map_err(|e| fail("setting its journal mode", e))?;
    if !mode.eq_ignore_ascii_case(wanted) {
        return Err(format!("SQLite database {shown}: cannot use journal mode {wanted} (journal_mode is {mode})"));
    }
    // temp_store = MEMORY: what SQLite would put in files it creates in /var/tmp and unlinks
    // right after stays in memory, so a daemon killed between the two leaves no `etilqs_*` file
    // behind (seen once in 200 kills). On this connection that is little: every ORDER BY follows
    // a key or an index (no sort spills); only the one-time version 1 conversion builds an index
    // (two integers a unit to sort); snapshots copy through the backup API on their own
    // connection; a statement journal, kept only for a statement that writes many rows and may
    // fail part way, holds the pages that one statement changes. Deleting a 2 GiB file (2.1
    // million pages freed) raised the daemon's peak RSS by 17 MB, about its page cache.
    db.execute_batch(
        "PRAGMA synchronous = FULL; PRAGMA foreign_keys = OFF; PRAGMA cache_size = -16384; PRAGMA temp_store = MEMORY",
    )
    .map_err(|e| fail("setting its pragmas", e))?;
    db.execute_batch("BEGIN IMMEDIATE").map_err(|e| fail("starting a transaction", e))?;
    let made = (|| -> rusqlite::Result<u64> {
        if tables == 0 {
            db.execute_batch(CREATE)?;
        } else if version == 1 {
            log::info!("SQLite database {shown}: converting its units table to schema version {SCHEMA_VERSION}");
            db.execute_batch(UNITS_FROM_VERSION_1)?;
        } else if version == 2 {
            log::info!("SQLite database {shown}: its units index made again for schema version {SCHEMA_VERSION}");
            db.execute_batch(UNITS_FROM_VERSION_2)?;
        }
        if version != SCHEMA_VERSION {
            db.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}"))?;
        }
        let generation: i64 = db
            .query_row("SELECT value FROM meta WHERE key = 'generation'", [], |row| row.get(0))
            .optional()?
            .unwrap_or(0)
            + 1;
        db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('generation', ?1)", [generation])?;
        Ok(generation as u64)
    })();
    match made {
        Ok(generation) => {
            db.execute_batch("COMMIT").map_err(|e| fail("committing its generation", e))?;
            match journal {
                Journal::Wal => {
                    keep_wal(&db, path).map_err(|e| format!("SQLite database {shown}: keeping its WAL file: {e}"))?;
                    // A rollback journal left from an earlier mode (zeroed: the header read
                    // above would have rolled a live one back) is no longer this file's.
                    match std::fs::remove_file(journal_path(path)) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            return Err(format!("SQLite database {shown}: removing its old rollback journal: {e}"));
                        }
                        _ => {}
                    }
                }
                Journal::Rollback => {}
            }
            Ok((db, generation, journal))
        }
        Err(e) => {
            let _ = db.execute_batch("ROLLBACK");
            Err(fail("writing its schema and generation", e))
        }
    }
}
