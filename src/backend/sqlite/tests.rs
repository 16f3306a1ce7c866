//! The SQLite backend in-process, against a real database file in a temporary directory.

use std::ffi::OsStr;
use std::sync::Arc;

use super::SqliteBackend;
use crate::backend::test_support::read_all;
use crate::backend::{FileData, Namespace, OpenMode, UnitStore};
use crate::engine::types::{Kind, NewObject, Owner, XattrReply, ROOT_ID};
use crate::metrics::Metrics;

const UNIT: u64 = 4096;
const OWNER: Owner = Owner { uid: 1000, gid: 1000 };

fn open(dir: &tempfile::TempDir) -> SqliteBackend {
    SqliteBackend::open(&dir.path().join("tree.db"), Some(UNIT), Arc::new(Metrics::default())).expect("open")
}

fn write_whole(data: &dyn FileData, bytes: &[u8]) {
    crate::backend::test_support::write_whole(data, UNIT, bytes).expect("write");
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
}

#[test]
fn a_synced_tree_is_there_after_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = pattern(3 * UNIT as usize + 100);
    let (file_key, file_id) = {
        let b = open(&dir);
        let sub = b.make(ROOT_ID, OsStr::new("sub"), NewObject::Directory { perm: 0o750 }, OWNER).unwrap();
        let file = b.make(sub.id, OsStr::new("f"), NewObject::File { perm: 0o640 }, OWNER).unwrap();
        b.make(sub.id, OsStr::new("l"), NewObject::Symlink { target: b"f" }, OWNER).unwrap();
        b.set_xattr(file.id, OsStr::new("user.k"), b"v", 0).unwrap();
        b.link(file.id, ROOT_ID, OsStr::new("hard")).unwrap();
        let data = b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap();
        write_whole(&*data, &bytes);
        b.sync_all().unwrap();
        (b.log_key(file.id).unwrap(), file.id)
    };
    let b = open(&dir);
    assert_eq!(b.integrity_check().unwrap(), "ok");
    let sub = b.lookup(ROOT_ID, OsStr::new("sub")).unwrap();
    assert_eq!((sub.kind, sub.perm, sub.nlink), (Kind::Directory, 0o750, 2));
    let file = b.lookup(sub.id, OsStr::new("f")).unwrap();
    assert_eq!((file.id, file.perm, file.nlink, file.uid, file.size), (file_id, 0o640, 2, 1000, bytes.len() as u64));
    assert_eq!(b.find(&file_key).unwrap(), Some(file_id), "a key finds its file after a reopen");
    let link = b.lookup(sub.id, OsStr::new("l")).unwrap();
    assert_eq!(b.readlink(link.id).unwrap(), b"f");
    assert_eq!(b.get_xattr(file.id, OsStr::new("user.k"), 10).unwrap(), XattrReply::Data(b"v".to_vec()));
    let data = b.open(file.id, OpenMode::default()).unwrap();
    assert_eq!(read_all(&*data), bytes);
    let mut names = Vec::new();
    let mut reader = b.open_dir(ROOT_ID).unwrap();
    for e in reader.read(0, 100).unwrap() {
        names.push(e.name.to_string_lossy().into_owned());
    }
    assert_eq!(names, [".", "..", "hard", "sub"]);
}

#[test]
fn a_crash_keeps_what_the_last_sync_committed_and_no_key_finds_another_object() {
    let dir = tempfile::tempdir().unwrap();
    let lost_key = {
        let b = open(&dir);
        b.make(ROOT_ID, OsStr::new("kept"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
        b.sync_dir(ROOT_ID).unwrap();
        let lost = b.make(ROOT_ID, OsStr::new("lost"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
        b.rename(ROOT_ID, OsStr::new("kept"), ROOT_ID, OsStr::new("renamed"), 0).unwrap();
        let key = b.log_key(lost.id).unwrap();
        b.crash();
        key
    };
    let b = open(&dir);
    assert!(b.lookup(ROOT_ID, OsStr::new("kept")).is_ok(), "the synced name is there");
    assert_eq!(b.lookup(ROOT_ID, OsStr::new("renamed")).unwrap_err().0, libc::ENOENT, "the unsynced rename is not");
    assert_eq!(b.key_at(ROOT_ID, OsStr::new("lost")).unwrap(), None);
    // The next object may get the lost one's id; its key still finds nothing.
    b.make(ROOT_ID, OsStr::new("new"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
    assert_eq!(b.find(&lost_key).unwrap(), None);
}

#[test]
fn engine_chosen_ids_are_kept_and_a_taken_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let id = crate::engine::pending::PENDING_ID_BASE + 5;
    {
        let b = open(&dir);
        let attr = b.make_with_id(id, ROOT_ID, OsStr::new("held"), 0o600, OWNER).unwrap();
        assert_eq!(attr.id, id);
        assert_eq!(b.make_with_id(id, ROOT_ID, OsStr::new("again"), 0o600, OWNER).unwrap_err().0, libc::EEXIST);
        assert_eq!(
            b.lookup(ROOT_ID, OsStr::new("again")).unwrap_err().0,
            libc::ENOENT,
            "a failed call changes nothing"
        );
        b.sync_all().unwrap();
    }
    let b = open(&dir);
    assert_eq!(b.lookup(ROOT_ID, OsStr::new("held")).unwrap().id, id);
    // Ids the backend gives out itself stay below the engine's range.
    let own = b.make(ROOT_ID, OsStr::new("own"), NewObject::File { perm: 0o600 }, OWNER).unwrap();
    assert!(own.id < crate::engine::pending::PENDING_ID_BASE && own.id > ROOT_ID);
}

#[test]
fn truncation_cuts_units_and_holes_read_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(&dir);
    let file = b.make(ROOT_ID, OsStr::new("f"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
    let data = b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap();
    let bytes = pattern(2 * UNIT as usize);
    write_whole(&*data, &bytes);
    data.set_size(UNIT + 10).unwrap();
    data.set_size(3 * UNIT).unwrap();
    let mut expected = bytes[..UNIT as usize + 10].to_vec();
    expected.resize(3 * UNIT as usize, 0);
    assert_eq!(read_all(&*data), expected);
    data.set_size(0).unwrap();
    assert!(!data.holds_data());
}

#[test]
fn an_unlinked_open_file_lives_until_closed_and_then_its_rows_go() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(&dir);
    let file = b.make(ROOT_ID, OsStr::new("f"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
    let data = b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap();
    write_whole(&*data, b"hello");
    b.remove(ROOT_ID, OsStr::new("f"), false).unwrap();
    b.forget(file.id, 1);
    assert_eq!(read_all(&*data), b"hello", "open: still readable");
    drop(data);
    assert_eq!(b.getattr(file.id).unwrap_err().0, libc::ESTALE);
    let units: i64 = super::lock(&b.inner).db.query_row("SELECT count(*) FROM units", [], |r| r.get(0)).unwrap();
    assert_eq!(units, 0);
}

#[test]
fn rename_refuses_a_directory_into_itself_and_a_non_empty_target() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(&dir);
    let a = b.make(ROOT_ID, OsStr::new("a"), NewObject::Directory { perm: 0o755 }, OWNER).unwrap();
    let inner = b.make(a.id, OsStr::new("in"), NewObject::Directory { perm: 0o755 }, OWNER).unwrap();
    assert_eq!(b.rename(ROOT_ID, OsStr::new("a"), inner.id, OsStr::new("x"), 0).unwrap_err().0, libc::EINVAL);
    b.make(ROOT_ID, OsStr::new("b"), NewObject::Directory { perm: 0o755 }, OWNER).unwrap();
    assert_eq!(b.rename(ROOT_ID, OsStr::new("b"), ROOT_ID, OsStr::new("a"), 0).unwrap_err().0, libc::ENOTEMPTY);
    b.rename(a.id, OsStr::new("in"), ROOT_ID, OsStr::new("moved"), 0).unwrap();
    assert_eq!(b.getattr(a.id).unwrap().nlink, 2);
    assert_eq!(b.getattr(ROOT_ID).unwrap().nlink, 5);
}

#[test]
fn bad_input_gets_a_clear_error_and_is_never_written() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no/such/dir/x.db");
    let e = SqliteBackend::open(&missing, None, Arc::new(Metrics::default())).err().expect("refused");
    assert!(e.contains("does not exist"), "{e}");

    let not_db = dir.path().join("text.db");
    let junk = b"this is not a database, it is a text file that is long enough to have a header..........".repeat(10);
    std::fs::write(&not_db, &junk).unwrap();
    let e = SqliteBackend::open(&not_db, None, Arc::new(Metrics::default())).err().expect("refused");
    assert!(e.contains("is not a SQLite database"), "{e}");
    assert_eq!(std::fs::read(&not_db).unwrap(), junk, "left as it was");

    let other = dir.path().join("other.db");
    rusqlite::Connection::open(&other).unwrap().execute_batch("CREATE TABLE t(x); PRAGMA user_version = 7").unwrap();
    let e = SqliteBackend::open(&other, None, Arc::new(Metrics::default())).err().expect("refused");
    assert!(e.contains("schema version 7"), "{e}");
}

#[test]
fn the_crash_marker_lives_in_the_database() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(&dir);
        assert_eq!(b.log_marker().unwrap(), None);
        b.set_log_marker(Some(std::path::Path::new("/state/intent.log"))).unwrap();
        b.crash();
    }
    let b = open(&dir);
    assert_eq!(b.log_marker().unwrap().as_deref(), Some(std::path::Path::new("/state/intent.log")));
    b.set_log_marker(None).unwrap();
    assert_eq!(b.log_marker().unwrap(), None);
}

#[test]
fn an_access_acl_the_mode_says_all_of_sets_the_mode_and_is_not_kept() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(&dir);
    let d = b.make(ROOT_ID, OsStr::new("d"), NewObject::Directory { perm: 0o700 }, OWNER).unwrap();
    // What `cp -a` sets for a directory of mode 0755: owner rwx, group r-x, other r-x.
    let acl = b"\x02\0\0\0\x01\0\x07\0\xff\xff\xff\xff\x04\0\x05\0\xff\xff\xff\xff\x20\0\x05\0\xff\xff\xff\xff";
    b.set_xattr(d.id, OsStr::new("system.posix_acl_access"), acl, 0).unwrap();
    assert_eq!(b.getattr(d.id).unwrap().perm, 0o755);
    assert_eq!(b.list_xattr(d.id, 0).unwrap(), XattrReply::Size(0));
    assert_eq!(b.set_xattr(d.id, OsStr::new("system.posix_acl_access"), b"junk", 0).unwrap_err().0, libc::EINVAL);
}

/// A long write with no sync is committed every `TRANSACTION_MAX_BYTES`: another connection
/// sees the units committed so far (WAL: readers see the last commit), where one unit alone
/// stays in the open transaction.
#[test]
fn a_long_write_without_a_sync_is_committed_in_bounded_transactions() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(&dir);
    let file = b.make(ROOT_ID, OsStr::new("big"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
    b.sync_all().unwrap();
    let data = b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap();
    let committed_units = || -> i64 {
        let reader = rusqlite::Connection::open(dir.path().join("tree.db")).unwrap();
        reader.query_row("SELECT count(*) FROM units", [], |r| r.get(0)).unwrap()
    };
    write_whole(&*data, &pattern(UNIT as usize));
    assert_eq!(committed_units(), 0, "one unit is committed without a sync: the bound tests nothing");
    let units = super::TRANSACTION_MAX_BYTES / UNIT + 2;
    write_whole(&*data, &pattern((units * UNIT) as usize));
    let committed = committed_units() as u64;
    assert!(committed >= super::TRANSACTION_MAX_BYTES / UNIT, "{committed} units committed");
    assert!(committed < units, "all {units} units committed: the last ones were in no open transaction");
    b.sync_all().unwrap();
    assert_eq!(committed_units() as u64, units);
    assert_eq!(read_all(&*data), pattern((units * UNIT) as usize));
}

/// A database of schema version 1 (`units` an index b-tree, `WITHOUT ROWID`) reads as it is
/// read-only, and a read-write open converts it, rows whole, in the transaction that opens it.
#[test]
fn a_version_1_database_is_converted_at_a_read_write_open_and_read_as_it_is_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tree.db");
    let big = pattern(3 * UNIT as usize + 100);
    let small = pattern(1000);
    {
        let b = open(&dir);
        for (name, bytes) in [("big", &big), ("small", &small)] {
            let file = b.make(ROOT_ID, OsStr::new(name), NewObject::File { perm: 0o644 }, OWNER).unwrap();
            write_whole(&*b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap(), bytes);
        }
        b.sync_all().unwrap();
        b.close_at_unmount(false).unwrap();
    }
    let db = rusqlite::Connection::open(&path).unwrap();
    db.execute_batch(
        "BEGIN;
         CREATE TABLE units_v1(file INTEGER NOT NULL, unit INTEGER NOT NULL, data BLOB NOT NULL,
             PRIMARY KEY(file, unit)) WITHOUT ROWID;
         INSERT INTO units_v1 SELECT file, unit, data FROM units;
         DROP TABLE units;
         ALTER TABLE units_v1 RENAME TO units;
         PRAGMA user_version = 1;
         COMMIT;",
    )
    .unwrap();
    let units_sql = |db: &rusqlite::Connection| -> String {
        db.query_row("SELECT sql FROM sqlite_master WHERE name = 'units'", [], |r| r.get(0)).unwrap()
    };
    let version = |db: &rusqlite::Connection| -> i64 { db.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap() };
    assert!(units_sql(&db).contains("WITHOUT ROWID"));
    let unit_rows: i64 = db.query_row("SELECT count(*) FROM units", [], |r| r.get(0)).unwrap();
    drop(db);
    let read_back = |b: &SqliteBackend| {
        for (name, bytes) in [("big", &big), ("small", &small)] {
            let file = b.lookup(ROOT_ID, OsStr::new(name)).unwrap();
            assert_eq!(&read_all(&*b.open(file.id, OpenMode::default()).unwrap()), bytes, "{name}");
        }
    };

    let b = SqliteBackend::open_read_only(&path, Some(UNIT), Arc::new(Metrics::default())).expect("read-only open");
    read_back(&b);
    drop(b);
    let db = rusqlite::Connection::open(&path).unwrap();
    assert_eq!(version(&db), 1, "a read-only open converted the file");
    drop(db);

    let b = open(&dir);
    read_back(&b);
    assert_eq!(b.integrity_check().unwrap(), "ok");
    drop(b);
    let db = rusqlite::Connection::open(&path).unwrap();
    assert_eq!(version(&db), super::SCHEMA_VERSION);
    assert!(!units_sql(&db).contains("WITHOUT ROWID"), "{}", units_sql(&db));
    let converted: i64 = db.query_row("SELECT count(*) FROM units", [], |r| r.get(0)).unwrap();
    assert_eq!(converted, unit_rows);
    let page: i64 = db.query_row("PRAGMA page_size", [], |r| r.get(0)).unwrap();
    assert_eq!(page, i64::from(super::schema::PAGE_BYTES), "a new database's page size");
}

/// Contract rule 7: the replay watermark stays in the open transaction until a sync commits
/// it with every change before it; a crash before that keeps the last committed one.
#[test]
fn the_replay_watermark_commits_with_the_changes_before_it_and_never_apart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(&dir);
        assert!(b.capabilities().keeps_replay_watermark);
        assert_eq!(b.replay_watermark().unwrap(), None);
        b.set_replay_watermark(Some(7)).unwrap();
        b.sync_all().unwrap();
        b.make(ROOT_ID, OsStr::new("after"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
        b.set_replay_watermark(Some(9)).unwrap();
        assert_eq!(b.replay_watermark().unwrap(), Some(9), "the open transaction's own");
        b.crash();
    }
    {
        let b = open(&dir);
        assert_eq!(b.replay_watermark().unwrap(), Some(7), "a watermark no sync committed survived a crash");
        assert_eq!(b.lookup(ROOT_ID, OsStr::new("after")).unwrap_err().0, libc::ENOENT);
        b.make(ROOT_ID, OsStr::new("before"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
        b.set_replay_watermark(Some(11)).unwrap();
        let data = b.make(ROOT_ID, OsStr::new("data"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
        write_whole(&*b.open(data.id, OpenMode { write: true, no_atime: false }).unwrap(), &pattern(100));
        // Any sync commits the transaction: a file's too.
        b.open(data.id, OpenMode::default()).unwrap().sync(true).unwrap();
        b.crash();
    }
    let b = open(&dir);
    assert_eq!(b.replay_watermark().unwrap(), Some(11));
    assert!(b.lookup(ROOT_ID, OsStr::new("before")).is_ok(), "the watermark committed without the change before it");
    b.set_replay_watermark(None).unwrap();
    b.sync_all().unwrap();
    assert_eq!(b.replay_watermark().unwrap(), None);
}

/// The WAL file is written to its kept size once and then over in place, from one open to the
/// next: a WAL that grows costs ext4 a journal commit at every commit. A clean close starts it
/// over, so the next open finds nothing in it to copy into the database again; the database file
/// alone is the whole tree after a clean close.
#[test]
fn the_wal_file_is_kept_at_its_size_from_one_open_to_the_next_and_the_database_alone_is_the_tree() {
    use super::schema::{wal_path, WAL_KEPT_BYTES};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tree.db");
    let wal_len = || std::fs::metadata(wal_path(&path)).map(|m| m.len()).ok();
    // The frames the WAL holds (`wal_checkpoint`'s second column; PASSIVE copies them too).
    let frames_in_wal = |b: &SqliteBackend| -> i64 {
        super::lock(&b.inner).db.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1)).unwrap()
    };
    let small = pattern(1500);
    let alone = tempfile::tempdir().unwrap();
    let ino_before = {
        let b = open(&dir);
        assert_eq!(wal_len(), Some(WAL_KEPT_BYTES), "a new database's WAL is made its kept size");
        for i in 0..50 {
            let file = b.make(ROOT_ID, OsStr::new(&format!("f{i}")), NewObject::File { perm: 0o644 }, OWNER).unwrap();
            write_whole(&*b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap(), &small);
            b.sync_all().unwrap();
        }
        assert_eq!(wal_len(), Some(WAL_KEPT_BYTES), "50 commits write the WAL over, not past its end");
        assert!(frames_in_wal(&b) > 100, "the 50 commits are in the WAL");
        b.close_at_unmount(false).unwrap();
        // The daemon exits without closing its connection: the database file alone, copied
        // now without its WAL, is the whole database, the row `close_at_unmount` wrote included.
        std::fs::copy(&path, alone.path().join("tree.db")).unwrap();
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(wal_path(&path)).unwrap())
    };
    assert_eq!(wal_len(), Some(WAL_KEPT_BYTES), "the close leaves the WAL file as it was");
    {
        let copy = rusqlite::Connection::open(alone.path().join("tree.db")).unwrap();
        let closed: Option<i64> = rusqlite::OptionalExtension::optional(copy.query_row(
            "SELECT value FROM meta WHERE key = 'closed_at'",
            [],
            |r| r.get(0),
        ))
        .unwrap();
        assert!(closed.is_some(), "closed_at is only in the WAL");
    }
    {
        let b = open(&alone);
        let file = b.lookup(ROOT_ID, OsStr::new("f49")).unwrap();
        assert_eq!(read_all(&*b.open(file.id, OpenMode::default()).unwrap()), small);
    }
    drop(open(&dir));
    assert_eq!(wal_len(), Some(WAL_KEPT_BYTES), "a close without `close_at_unmount` (a failed start) keeps it too");
    let b = open(&dir);
    let kept = std::fs::metadata(wal_path(&path)).unwrap();
    assert_eq!(
        (kept.len(), std::os::unix::fs::MetadataExt::ino(&kept)),
        (WAL_KEPT_BYTES, ino_before),
        "the next open writes the same file over"
    );
    let frames = frames_in_wal(&b);
    assert!(frames < 10, "the open found the last mount's frames to copy again: {frames}");
    assert_eq!(b.integrity_check().unwrap(), "ok");
    // One transaction larger than the kept WAL grows it, and it keeps that size.
    let big = pattern(3 << 20);
    let file = b.make(ROOT_ID, OsStr::new("big"), NewObject::File { perm: 0o644 }, OWNER).unwrap();
    write_whole(&*b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap(), &big);
    b.sync_all().unwrap();
    let grown = wal_len().unwrap();
    assert!(grown > WAL_KEPT_BYTES);
    b.close_at_unmount(false).unwrap();
    drop(b);
    assert_eq!(wal_len(), Some(grown));
    let b = open(&dir);
    assert_eq!(read_all(&*b.open(file.id, OpenMode::default()).unwrap()), big);
}

/// A daemon killed between SQLite's creation of a temporary file and its unlink would leave the
/// file in /var/tmp; with temporary storage in memory there is no such file to leave.
#[test]
fn sqlite_keeps_its_temporary_storage_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(&dir);
    let temp_store: i64 = super::lock(&b.inner).db.query_row("PRAGMA temp_store", [], |r| r.get(0)).unwrap();
    assert_eq!(temp_store, 2, "PRAGMA temp_store is MEMORY (2)");
}

fn open_in(dir: &tempfile::TempDir, journal: Option<super::Journal>) -> SqliteBackend {
    SqliteBackend::open_in_journal_mode(&dir.path().join("tree.db"), Some(UNIT), Arc::new(Metrics::default()), journal)
        .expect("open")
}

fn new_file(b: &SqliteBackend, name: &str, bytes: &[u8]) -> crate::engine::types::ObjectId {
    let file = b.make(ROOT_ID, OsStr::new(name), NewObject::File { perm: 0o644 }, OWNER).unwrap();
    write_whole(&*b.open(file.id, OpenMode { write: true, no_atime: false }).unwrap(), bytes);
    file.id
}

/// The journal mode is the file's: `sqlite_journal=` changes it, an open without it keeps it,
/// and each mode leaves only its own journal file beside the database.
#[test]
fn the_journal_mode_is_kept_in_the_database_from_one_open_to_the_next() {
    use super::schema::{journal_path, wal_path, WAL_KEPT_BYTES};
    use super::Journal;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tree.db");
    let bytes = pattern(5000);
    {
        let b = open(&dir);
        assert_eq!(b.journal(), Journal::Wal, "a new database's mode");
        new_file(&b, "in-wal", &bytes);
        b.sync_all().unwrap();
        b.close_at_unmount(false).unwrap();
    }
    {
        let b = open_in(&dir, Some(Journal::Rollback));
        assert_eq!(b.journal(), Journal::Rollback);
        assert!(!wal_path(&path).exists(), "leaving WAL mode empties the WAL into the database and removes it");
        new_file(&b, "in-rollback", &bytes);
        b.sync_all().unwrap();
        assert!(journal_path(&path).exists(), "PERSIST keeps the journal file");
        b.close_at_unmount(false).unwrap();
    }
    {
        let b = open(&dir);
        assert_eq!(b.journal(), Journal::Rollback, "an open without the option keeps the file's mode");
        assert_eq!(b.integrity_check().unwrap(), "ok");
        for name in ["in-wal", "in-rollback"] {
            let file = b.lookup(ROOT_ID, OsStr::new(name)).unwrap();
            assert_eq!(read_all(&*b.open(file.id, OpenMode::default()).unwrap()), bytes, "{name}");
        }
    }
    let b = open_in(&dir, Some(Journal::Wal));
    assert_eq!(b.journal(), Journal::Wal);
    assert!(!journal_path(&path).exists(), "back in WAL mode, the old rollback journal is removed");
    assert_eq!(std::fs::metadata(wal_path(&path)).unwrap().len(), WAL_KEPT_BYTES);
    let file = b.lookup(ROOT_ID, OsStr::new("in-rollback")).unwrap();
    assert_eq!(read_all(&*b.open(file.id, OpenMode::default()).unwrap()), bytes);
}

/// In rollback mode a checkpoint that deletes files and writes new ones writes the new rows
/// once: the deleted files' rows are freed at the commit, so the new ones do not take the pages
/// they free, whose old bytes the journal would have to keep first.
#[test]
fn in_rollback_mode_new_rows_do_not_reuse_pages_freed_in_the_same_transaction() {
    use super::schema::journal_path;
    use super::Journal;
    let dir = tempfile::tempdir().unwrap();
    let b = open_in(&dir, Some(Journal::Rollback));
    let old = pattern(1 << 20);
    let old_id = new_file(&b, "old", &old);
    b.sync_all().unwrap();
    let journal_after_first = std::fs::metadata(journal_path(&dir.path().join("tree.db"))).unwrap().len();
    // One transaction: the old file replaced by a new one of the same size.
    b.remove(ROOT_ID, OsStr::new("old"), false).unwrap();
    b.forget(old_id, 1); // `make`'s lookup: now nothing holds it
    let fresh = pattern((1 << 20) + 7);
    let fresh_id = new_file(&b, "new", &fresh);
    b.sync_all().unwrap();
    let journal = std::fs::metadata(journal_path(&dir.path().join("tree.db"))).unwrap().len();
    assert!(
        journal < 128 << 10,
        "the journal took {journal} bytes (first commit {journal_after_first}) for a 1 MiB file replaced: \
         the new rows reused the old file's pages"
    );
    let units: i64 = super::lock(&b.inner)
        .db
        .query_row("SELECT count(*) FROM units WHERE file = ?1", [super::sql_id(old_id)], |r| r.get(0))
        .unwrap();
    assert_eq!(units, 0, "the old file's rows are gone once the commit is made");
    assert_eq!(b.integrity_check().unwrap(), "ok");
    drop(b);
    let b = open(&dir);
    assert_eq!(read_all(&*b.open(fresh_id, OpenMode::default()).unwrap()), fresh);
}

/// A delete undone with its savepoint (a call that failed part way) frees nothing at the
/// commit: the file and its bytes stay.
#[test]
fn a_failed_call_frees_none_of_the_rows_it_deleted() {
    use super::Journal;
    let dir = tempfile::tempdir().unwrap();
    let b = open_in(&dir, Some(Journal::Rollback));
    let bytes = pattern(9000);
    let id = new_file(&b, "kept", &bytes);
    b.sync_all().unwrap();
    {
        let mut s = super::lock(&b.inner);
        let failed: crate::sys::SysResult<()> = s.change(|s| {
            s.unlink_entry(ROOT_ID, OsStr::new("kept"))?;
            s.delete_object(id)?;
            assert_eq!(s.units_freed_at_commit.ids(), [id]);
            Err(crate::sys::Errno(libc::EIO))
        });
        assert!(failed.is_err());
        assert!(s.units_freed_at_commit.ids().is_empty(), "the undone delete's free is forgotten");
        s.commit().unwrap();
    }
    drop(b);
    let b = open(&dir);
    let file = b.lookup(ROOT_ID, OsStr::new("kept")).unwrap();
    assert_eq!(read_all(&*b.open(file.id, OpenMode::default()).unwrap()), bytes);
}

/// A commit a crash cut short in rollback mode leaves a hot journal: a read-only open cannot
/// undo it and says what to do; a read-write open undoes it, and the tree is the last commit's.
#[test]
fn a_hot_rollback_journal_is_refused_read_only_and_undone_read_write() {
    use super::schema::journal_path;
    let dir = tempfile::tempdir().unwrap();
    let bytes = pattern(300 << 10);
    {
        let b = open_in(&dir, Some(super::Journal::Rollback));
        new_file(&b, "f", &bytes);
        b.sync_all().unwrap();
    }
    // A transaction that has written pages of the database in place (a small cache spills
    // them), copied as a power cut would leave it: journal and database, no lock.
    let path = dir.path().join("tree.db");
    let writer = rusqlite::Connection::open(&path).unwrap();
    writer.execute_batch("PRAGMA journal_mode = PERSIST; PRAGMA cache_size = 10; BEGIN").unwrap();
    writer.execute("UPDATE units SET data = zeroblob(length(data))", []).unwrap();
    let cut = tempfile::tempdir().unwrap();
    let copy = cut.path().join("tree.db");
    std::fs::copy(&path, &copy).unwrap();
    std::fs::copy(journal_path(&path), journal_path(&copy)).unwrap();
    drop(writer);
    let e = SqliteBackend::open_read_only(&copy, Some(UNIT), Arc::new(Metrics::default())).err().expect("refused");
    assert!(e.contains("mount it read-write once"), "{e}");
    let b = open(&cut);
    assert_eq!(b.integrity_check().unwrap(), "ok");
    let file = b.lookup(ROOT_ID, OsStr::new("f")).unwrap();
    assert_eq!(read_all(&*b.open(file.id, OpenMode::default()).unwrap()), bytes, "the cut-short commit is undone");
}

/// An id whose file went earlier in the same transaction, asked for again (the engine chooses
/// ids; a replay may make one again): the old file's rows go before the new file's are written,
/// not at the commit after them.
#[test]
fn an_id_made_again_before_the_commit_keeps_its_new_rows() {
    use super::Journal;
    let dir = tempfile::tempdir().unwrap();
    let b = open_in(&dir, Some(Journal::Rollback));
    let id = crate::engine::pending::PENDING_ID_BASE + 9;
    let write = |name: &str, bytes: &[u8]| {
        b.make_with_id(id, ROOT_ID, OsStr::new(name), 0o644, OWNER).unwrap();
        write_whole(&*b.open(id, OpenMode { write: true, no_atime: false }).unwrap(), bytes);
    };
    write("first", &pattern(3 * UNIT as usize));
    b.sync_all().unwrap();
    b.remove(ROOT_ID, OsStr::new("first"), false).unwrap();
    b.forget(id, 1);
    assert_eq!(super::lock(&b.inner).units_freed_at_commit.ids(), [id], "the old rows wait for the commit");
    let again = pattern(UNIT as usize + 10);
    write("again", &again);
    b.sync_all().unwrap();
    drop(b);
    let b = open(&dir);
    assert_eq!(read_all(&*b.open(id, OpenMode::default()).unwrap()), again);
}

/// In rollback mode reads between commits leave the `-journal` file alone: without the read
/// transaction held from one commit to the next, every read would open it to look for a crash's
/// leftovers, and SQLite running as root `fchown`s it at each open, a ctime change that costs an
/// ext4 journal commit at the next sync, per file seed 000's writers make.
#[test]
fn in_rollback_mode_reads_between_commits_do_not_touch_the_journal_file() {
    use super::schema::journal_path;
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid cannot fail and touches no memory of ours.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: SQLite changes the journal's owner (and ctime) at each open only as root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let b = open_in(&dir, Some(super::Journal::Rollback));
    let id = new_file(&b, "f", &pattern(2000));
    b.sync_all().unwrap();
    let ctime = || {
        let m = std::fs::metadata(journal_path(&dir.path().join("tree.db"))).unwrap();
        (m.ctime(), m.ctime_nsec())
    };
    let before = ctime();
    for _ in 0..20 {
        std::thread::sleep(std::time::Duration::from_millis(2));
        b.getattr(id).unwrap();
        b.lookup(ROOT_ID, OsStr::new("f")).unwrap();
        read_all(&*b.open(id, OpenMode::default()).unwrap());
    }
    assert_eq!(ctime(), before, "a read opened the journal file (and SQLite changed its owner)");
}

/// An idle checkpoint (its watermark the one the database holds) and an idle unmount (the
/// crash marker cleared with `closed_at`) commit nothing, and one transaction: each commit
/// costs three syncs in rollback mode, where the database header's change counter counts them.
#[test]
fn an_idle_checkpoint_commits_nothing_and_the_unmount_commits_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tree.db");
    let commits = || {
        let header = std::fs::read(&path).unwrap();
        u32::from_be_bytes(header[24..28].try_into().unwrap())
    };
    {
        let b = open_in(&dir, Some(super::Journal::Rollback));
        b.set_log_marker(Some(std::path::Path::new("/state/intent.log"))).unwrap();
        new_file(&b, "f", &pattern(100));
        b.set_replay_watermark(Some(4)).unwrap();
        b.sync_all().unwrap();
        let before = commits();
        b.set_replay_watermark(Some(4)).unwrap();
        b.sync_all().unwrap();
        assert_eq!(commits(), before, "the same watermark again is no commit");
        b.close_at_unmount(true).unwrap();
        assert_eq!(commits(), before + 1, "closed_at and the marker's clearing in one commit");
    }
    let b = open(&dir);
    assert_eq!(b.log_marker().unwrap(), None);
    assert_eq!(b.replay_watermark().unwrap(), Some(4));
}

/// The list of files whose rows a commit frees: a failed savepoint's frees forgotten, and a
/// file it took out (made again) put back; a file made again taken out wherever it stands; each
/// file once.
#[test]
fn deferred_frees_keep_order_undo_a_failed_savepoint_and_take_a_file_made_again() {
    let mut frees = super::DeferredFrees::default();
    for id in [1, 2, 3] {
        frees.push(id);
    }
    frees.push(2);
    assert_eq!(frees.ids(), [1, 2, 3], "each file once");
    let savepoint = frees.mark();
    frees.push(4);
    frees.take(2);
    frees.push(5);
    assert_eq!(frees.ids(), [1, 3, 4, 5]);
    frees.undo_to(savepoint);
    assert_eq!(frees.ids(), [1, 2, 3], "4 and 5 forgotten with their savepoint, 2 back in its place");
    assert!(frees.contains(2) && !frees.contains(4));
    frees.take(3);
    assert_eq!(frees.newest_first(), [2, 1]);
    frees.take(2);
    frees.take(1);
    frees.committed();
    assert_eq!(frees.ids(), Vec::<u64>::new());
    frees.push(6);
    assert_eq!(frees.ids(), [6]);
}

/// A file made again with its id in a call that then fails: the savepoint brings its old rows
/// back, and they must still go at the commit (else the next file made with that id reads them).
#[test]
fn a_file_made_again_in_a_failed_call_still_has_its_old_rows_freed_at_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let b = open_in(&dir, Some(super::Journal::Rollback));
    let id = new_file(&b, "old", &pattern(3 * UNIT as usize));
    b.sync_all().unwrap();
    b.remove(ROOT_ID, OsStr::new("old"), false).unwrap();
    b.forget(id, 1);
    let rows_of = |b: &SqliteBackend| -> i64 {
        super::lock(&b.inner)
            .db
            .query_row("SELECT count(*) FROM units WHERE file = ?1", [super::sql_id(id)], |r| r.get(0))
            .unwrap()
    };
    {
        let mut s = super::lock(&b.inner);
        let failed: crate::sys::SysResult<()> = s.change(|s| {
            s.make_object(ROOT_ID, OsStr::new("again"), NewObject::File { perm: 0o644 }, OWNER, Some(id))?;
            Err(crate::sys::Errno(libc::EIO))
        });
        assert!(failed.is_err());
        assert_eq!(s.units_freed_at_commit.ids(), [id], "the undone make's take is undone too");
    }
    assert_eq!(rows_of(&b), 3, "the failed call's delete of the old rows was rolled back");
    b.sync_all().unwrap();
    assert_eq!(rows_of(&b), 0, "the old rows went at the commit");
}

fn flipped(bytes: &[u8]) -> Vec<u8> {
    bytes.iter().map(|b| b ^ 0x5a).collect()
}

fn unit_rows(b: &SqliteBackend, id: crate::engine::types::ObjectId) -> i64 {
    super::lock(&b.inner)
        .db
        .query_row("SELECT count(*) FROM units WHERE file = ?1", [super::sql_id(id)], |r| r.get(0))
        .unwrap()
}

/// A file written over in place (cut to nothing, written again) in rollback mode: its old rows
/// stay beside the new ones to the commit, which deletes them, so the new rows do not take the
/// pages they free and the journal keeps no copy of them (1.1 MB for this 1 MiB file before);
/// reads meanwhile see the new bytes only.
#[test]
fn in_rollback_mode_a_file_written_over_keeps_its_old_rows_to_the_commit_and_journals_little() {
    use super::schema::journal_path;
    let dir = tempfile::tempdir().unwrap();
    let b = open_in(&dir, Some(super::Journal::Rollback));
    let old = pattern(1 << 20);
    let id = new_file(&b, "f", &old);
    b.sync_all().unwrap();
    let units = (1u64 << 20).div_ceil(UNIT) as i64;
    let data = b.open(id, OpenMode { write: true, no_atime: false }).unwrap();
    data.set_size(0).unwrap();
    let fresh = flipped(&pattern((1 << 20) + 7));
    write_whole(&*data, &fresh);
    assert_eq!(read_all(&*data), fresh, "the replaced rows are passed by");
    assert_eq!(unit_rows(&b, id), 2 * units + 1, "old rows kept to the commit");
    b.sync_all().unwrap();
    let journal = std::fs::metadata(journal_path(&dir.path().join("tree.db"))).unwrap().len();
    assert!(journal < 128 << 10, "the journal took {journal} bytes for a 1 MiB file written over");
    assert_eq!(unit_rows(&b, id), units + 1, "one row a unit after the commit");
    assert_eq!(b.integrity_check().unwrap(), "ok");
    drop(data);
    drop(b);
    let b = open(&dir);
    assert_eq!(read_all(&*b.open(id, OpenMode::default()).unwrap()), fresh);
}

/// A truncate into a unit and an extension past it, before any commit, in both journal modes:
/// the bytes past the cut read as zeros (not the replaced rows' old bytes), the cut unit as its
/// kept head, and the commit leaves one row a unit.
#[test]
fn a_cut_and_an_extension_read_zeros_past_the_cut_before_and_after_the_commit() {
    for journal in [super::Journal::Wal, super::Journal::Rollback] {
        let dir = tempfile::tempdir().unwrap();
        let b = open_in(&dir, Some(journal));
        let old = pattern(3 * UNIT as usize + 100);
        let id = new_file(&b, "f", &old);
        b.sync_all().unwrap();
        let data = b.open(id, OpenMode { write: true, no_atime: false }).unwrap();
        let cut = UNIT as usize + 10;
        data.set_size(cut as u64).unwrap();
        data.set_size(3 * UNIT).unwrap();
        let mut expected = old[..cut].to_vec();
        expected.resize(3 * UNIT as usize, 0);
        assert_eq!(read_all(&*data), expected, "{journal:?}, before the commit");
        b.sync_all().unwrap();
        assert_eq!(read_all(&*data), expected, "{journal:?}, after it");
        assert_eq!(unit_rows(&b, id), 2, "{journal:?}: unit 0 and the cut unit 1");
        assert!(data.holds_data());
        data.set_size(0).unwrap();
        assert!(!data.holds_data(), "{journal:?}: replaced rows are no data");
        b.sync_all().unwrap();
        assert_eq!(unit_rows(&b, id), 0);
    }
}

/// A call that replaced rows and then failed leaves them the units' rows.
#[test]
fn a_failed_call_leaves_the_rows_it_replaced_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let b = open_in(&dir, Some(super::Journal::Rollback));
    let old = pattern(2 * UNIT as usize);
    let id = new_file(&b, "f", &old);
    b.sync_all().unwrap();
    {
        let mut s = super::lock(&b.inner);
        let failed: crate::sys::SysResult<()> = s.change(|s| {
            s.replace_units_from(id, 0)?;
            assert!(!s.superseded.is_empty());
            Err(crate::sys::Errno(libc::EIO))
        });
        assert!(failed.is_err());
        assert!(s.superseded.is_empty(), "the failed call's replacements are undone");
    }
    assert_eq!(read_all(&*b.open(id, OpenMode::default()).unwrap()), old);
    b.sync_all().unwrap();
    assert_eq!(unit_rows(&b, id), 2);
}

/// A version 2 database (a unique index on `(file, unit)`) reads as it is read-only, and a
/// read-write open makes its index again, not unique, in the transaction that opens it.
#[test]
fn a_version_2_database_gets_its_units_index_made_again_at_a_read_write_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tree.db");
    let bytes = pattern(2 * UNIT as usize + 5);
    let id = {
        let b = open(&dir);
        let id = new_file(&b, "f", &bytes);
        b.sync_all().unwrap();
        b.close_at_unmount(false).unwrap();
        id
    };
    let index_sql = |db: &rusqlite::Connection| -> String {
        db.query_row("SELECT sql FROM sqlite_master WHERE name = 'units_by_file'", [], |r| r.get(0)).unwrap()
    };
    let db = rusqlite::Connection::open(&path).unwrap();
    db.execute_batch(
        "DROP INDEX units_by_file; CREATE UNIQUE INDEX units_by_file ON units(file, unit); PRAGMA user_version = 2;",
    )
    .unwrap();
    drop(db);
    let b = SqliteBackend::open_read_only(&path, Some(UNIT), Arc::new(Metrics::default())).expect("read-only open");
    assert_eq!(read_all(&*b.open(id, OpenMode::default()).unwrap()), bytes);
    drop(b);
    let b = open(&dir);
    assert_eq!(read_all(&*b.open(id, OpenMode::default()).unwrap()), bytes);
    drop(b);
    let db = rusqlite::Connection::open(&path).unwrap();
    let version: i64 = db.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(version, super::SCHEMA_VERSION);
    assert!(!index_sql(&db).contains("UNIQUE"), "{}", index_sql(&db));
}

/// A hole punched through a file in both journal modes: the units wholly inside lose their
/// rows, the ones at its ends keep their other bytes (a row the hole reaches the end of is cut
/// short, a row left with zeros only goes), reads see zeros there before the commit, after it
/// and after a reopen, and SEEK_DATA and SEEK_HOLE find the holes a unit at a time.
/// Preallocation is refused with EOPNOTSUPP, not ENOSYS, on which the kernel would stop sending
/// hole punches too.
#[test]
fn a_punched_hole_deletes_the_rows_it_covers_and_seeks_find_it() {
    use libc::{ENXIO, EOPNOTSUPP, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, SEEK_DATA, SEEK_HOLE};
    const PUNCH: i32 = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
    let u = UNIT as usize;
    for journal in [super::Journal::Wal, super::Journal::Rollback] {
        let dir = tempfile::tempdir().unwrap();
        let b = open_in(&dir, Some(journal));
        // No byte of the pattern is zero, so every row keeps its length until a hole reaches
        // its end.
        let mut expected: Vec<u8> = pattern(5 * u + 100).iter().map(|&byte| byte | 1).collect();
        let size = expected.len() as u64;
        let id = new_file(&b, "f", &expected);
        b.sync_all().unwrap();
        let data = b.open(id, OpenMode { write: true, no_atime: false }).unwrap();
        let seek = |offset: u64, whence: i32| data.seek(offset as i64, whence).map(|at| at as u64).map_err(|e| e.0);

        data.allocate(PUNCH, UNIT / 2, 3 * UNIT + 10 - UNIT / 2).unwrap();
        expected[u / 2..3 * u + 10].fill(0);
        assert_eq!(read_all(&*data), expected, "{journal:?}: before the commit");
        assert_eq!(seek(0, SEEK_HOLE), Ok(UNIT), "{journal:?}");
        assert_eq!(seek(UNIT, SEEK_DATA), Ok(3 * UNIT), "{journal:?}");
        assert_eq!(seek(3 * UNIT, SEEK_HOLE), Ok(size), "{journal:?}: the file's end is a hole");
        assert_eq!(seek(UNIT + 5, SEEK_HOLE), Ok(UNIT + 5), "{journal:?}: a hole from where it is asked");
        assert_eq!(seek(size, SEEK_DATA), Err(ENXIO), "{journal:?}");
        b.sync_all().unwrap();
        assert_eq!(read_all(&*data), expected, "{journal:?}: after it");
        assert_eq!(unit_rows(&b, id), 4, "{journal:?}: units 1 and 2 have no row");
        let head: i64 = super::lock(&b.inner)
            .db
            .query_row("SELECT length(data) FROM units WHERE file = ?1 AND unit = 0", [super::sql_id(id)], |r| r.get(0))
            .unwrap();
        assert_eq!(head, UNIT as i64 / 2, "{journal:?}: a row the hole reaches the end of is cut short");

        // The rest of unit 3 and everything past the end: unit 3 holds zeros only and goes,
        // units 4 and 5 go, the size stays.
        data.allocate(PUNCH, 3 * UNIT + 10, 10 * UNIT).unwrap();
        expected[3 * u..].fill(0);
        assert_eq!(data.size().unwrap(), size, "{journal:?}: KEEP_SIZE");
        assert_eq!(read_all(&*data), expected, "{journal:?}");
        assert_eq!(seek(UNIT, SEEK_DATA), Err(ENXIO), "{journal:?}: no data past unit 0");
        assert_eq!(data.allocate(0, 0, UNIT).map_err(|e| e.0), Err(EOPNOTSUPP), "{journal:?}: preallocation");
        b.sync_all().unwrap();
        assert_eq!(unit_rows(&b, id), 1, "{journal:?}: only unit 0 has bytes left");
        assert_eq!(b.integrity_check().unwrap(), "ok");
        drop(data);
        drop(b);
        let b = open(&dir);
        assert_eq!(read_all(&*b.open(id, OpenMode::default()).unwrap()), expected, "{journal:?}: reopened");
    }
}

/// Another program holding the database's write lock (a `sqlite3` shell in a transaction): a
/// change waits for it without the backend's mutex, so lookups, attributes and reads answer
/// meanwhile (every flusher's attempt held the mutex through the whole busy timeout, and
/// stalled `ls` on a mount for tens of seconds), and fails with EIO after `LOCK_WAIT`; the replay
/// watermark's write too (it held the mutex through SQLite's busy wait until 2026-12-06). The close
/// of a file and a forget of a name begin no write transaction: they took the write lock
/// (and waited for it) on every call.
#[test]
fn a_write_lock_another_program_holds_fails_changes_after_the_wait_and_stalls_no_read() {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let b = Arc::new(open(&dir));
    let id = new_file(&b, "f", &pattern(3000));
    b.sync_all().unwrap();
    b.forget(id, 1); // new_file's lookup
    read_all(&*b.open(id, OpenMode::default()).unwrap());
    b.lookup(ROOT_ID, OsStr::new("f")).unwrap();
    b.forget(id, 1);
    assert!(super::lock(&b.inner).db.is_autocommit(), "a close and a forget began a transaction");

    let other = rusqlite::Connection::open(dir.path().join("tree.db")).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = Instant::now();
    let changing = {
        let b = b.clone();
        std::thread::spawn(move || b.make(ROOT_ID, OsStr::new("g"), NewObject::Directory { perm: 0o755 }, OWNER))
    };
    // A checkpoint that releases batches and flushes nothing begins its transaction with the
    // replay watermark: it waits as any change does.
    let watermark = {
        let b = b.clone();
        std::thread::spawn(move || b.set_replay_watermark(Some(7)))
    };
    std::thread::sleep(Duration::from_millis(500));
    let reads = Instant::now();
    for _ in 0..10 {
        assert_eq!(b.lookup(ROOT_ID, OsStr::new("f")).unwrap().id, id);
        b.getattr(id).unwrap();
        assert_eq!(read_all(&*b.open(id, OpenMode::default()).unwrap()), pattern(3000));
    }
    assert!(reads.elapsed() < Duration::from_secs(1), "reads waited {:?} behind a change", reads.elapsed());
    let failed = changing.join().unwrap();
    assert_eq!(failed.map(|_| ()).map_err(|e| e.0), Err(libc::EIO));
    assert_eq!(watermark.join().unwrap().map_err(|e| e.0), Err(libc::EIO), "the watermark's write");
    let metrics = super::lock(&b.inner).metrics.clone();
    let counted = (metrics.sqlite_lock_waits.load(Relaxed), metrics.sqlite_lock_wait_failures.load(Relaxed));
    assert_eq!(counted, (2, 2), "waits and failures counted");
    let waited = started.elapsed();
    assert!(waited >= super::LOCK_WAIT && waited < super::LOCK_WAIT * 2, "the change failed after {waited:?}");
    other.execute_batch("ROLLBACK").unwrap();
    b.make(ROOT_ID, OsStr::new("g"), NewObject::Directory { perm: 0o755 }, OWNER).expect("the lock is free again");
    b.set_replay_watermark(Some(7)).unwrap();
    assert_eq!(b.replay_watermark().unwrap(), Some(7));
}

/// In rollback mode the backend holds a read transaction between commits (its SHARED lock),
/// under which another program can take the write lock (RESERVED) but never commit: a change
/// that finds the lock taken lets its read transaction go, so the other program's commit goes
/// through, and then takes the lock itself.
#[test]
fn in_rollback_mode_a_change_waiting_for_the_write_lock_lets_the_other_program_commit() {
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let b = Arc::new(open_in(&dir, Some(super::Journal::Rollback)));
    new_file(&b, "f", &pattern(3000));
    b.sync_all().unwrap();
    assert!(!super::lock(&b.inner).db.is_autocommit(), "the read transaction held between commits");
    let other = rusqlite::Connection::open(dir.path().join("tree.db")).unwrap();
    other.busy_timeout(Duration::from_secs(3)).unwrap();
    other.execute_batch("BEGIN IMMEDIATE; INSERT INTO meta(key, value) VALUES('by_another', 1)").unwrap();
    let changing = {
        let b = b.clone();
        std::thread::spawn(move || b.make(ROOT_ID, OsStr::new("g"), NewObject::Directory { perm: 0o755 }, OWNER))
    };
    std::thread::sleep(Duration::from_millis(200));
    other.execute_batch("COMMIT").expect("the other program's commit, the backend's read lock let go");
    changing.join().unwrap().expect("the change, once the other program committed");
    b.sync_all().unwrap();
    drop(other);
    let by_another: i64 = super::lock(&b.inner)
        .db
        .query_row("SELECT value FROM meta WHERE key = 'by_another'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(by_another, 1);
    assert!(b.lookup(ROOT_ID, OsStr::new("g")).is_ok());
}

/// copy_file_range inside the database: whole units go as rows (a hole as a hole, the target's
/// rows in the range replaced), a source cut short at its end goes as it stands where the target
/// holds nothing after, and what whole units cannot do answers EOPNOTSUPP (the kernel copies it
/// through reads and writes) without changing the target. Read back before the commit, after it
/// and after a reopen, in both journal modes; in rollback mode with every replaced row kept to
/// the commit (as a unit above two pages would be), so the copy must pass the superseded rows by.
#[test]
fn a_copy_between_files_copies_whole_units_as_rows_and_leaves_the_rest_to_the_kernel() {
    use libc::{EOPNOTSUPP, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
    use std::sync::atomic::Ordering::Relaxed;
    let u = UNIT as usize;
    for journal in [super::Journal::Wal, super::Journal::Rollback] {
        let dir = tempfile::tempdir().unwrap();
        let b = open_in(&dir, Some(journal));
        if journal == super::Journal::Rollback {
            super::lock(&b.inner).replaced_at_commit_above = 0;
        }
        let mut source_bytes: Vec<u8> = pattern(4 * u + 100).iter().map(|&byte| byte | 1).collect();
        let source = new_file(&b, "source", &source_bytes);
        let target = new_file(&b, "target", &vec![7u8; 6 * u]);
        let empty = new_file(&b, "empty", &[]);
        b.sync_all().unwrap();
        let open_data = |id| b.open(id, OpenMode { write: true, no_atime: false }).unwrap();
        let (source_data, target_data, empty_data) = (open_data(source), open_data(target), open_data(empty));
        // Unit 1 of the source a hole: the target's unit 2 must lose its row, not keep its 7s.
        source_data.allocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, UNIT, UNIT).unwrap();
        source_bytes[u..2 * u].fill(0);
        // Rewrite unit 0 so that in rollback mode its old row is superseded, not deleted.
        write_whole(&*source_data, &source_bytes[..u]);

        let mut target_bytes = vec![7u8; 6 * u];
        let copied_before = super::lock(&b.inner).metrics.backend_copied_bytes.load(Relaxed);
        // The whole source into the middle of the target: its four whole units go, the short
        // fifth does not (the target holds bytes after it).
        let copied = source_data.copy_to(0, &*target_data, UNIT, 100 * UNIT).unwrap();
        assert_eq!(copied, 4 * u, "{journal:?}: whole units only");
        target_bytes[u..5 * u].copy_from_slice(&source_bytes[..4 * u]);
        assert_eq!(read_all(&*target_data), target_bytes, "{journal:?}: before the commit");
        let refused = source_data.copy_to(4 * UNIT, &*target_data, 5 * UNIT, 100).map_err(|e| e.0);
        assert_eq!(refused, Err(EOPNOTSUPP), "{journal:?}: less than a unit over the target's bytes");
        assert_eq!(source_data.copy_to(10, &*target_data, 0, UNIT).map_err(|e| e.0), Err(EOPNOTSUPP));
        assert_eq!(read_all(&*target_data), target_bytes, "{journal:?}: a refused copy changes nothing");
        let rows_copied = super::lock(&b.inner).metrics.backend_copied_bytes.load(Relaxed) - copied_before;
        assert_eq!(rows_copied, 3 * UNIT, "{journal:?}: the rows of units 0, 2 and 3, the hole not counted");

        // Into an empty file: the short last unit goes too, and sets the size.
        assert_eq!(source_data.copy_to(0, &*empty_data, 0, u64::MAX / 2).unwrap(), source_bytes.len());
        assert_eq!(read_all(&*empty_data), source_bytes, "{journal:?}: a whole copy");
        assert_eq!(source_data.copy_to(source_bytes.len() as u64, &*empty_data, 0, UNIT).unwrap(), 0, "at the end");

        // Within one file, past its end: the file grows, the range between is a hole.
        assert_eq!(source_data.copy_to(0, &*source_data, 8 * UNIT, 2 * UNIT).unwrap(), 2 * u);
        let mut grown = source_bytes.clone();
        grown.resize(8 * u, 0);
        grown.extend_from_slice(&source_bytes[..2 * u]);
        assert_eq!(read_all(&*source_data), grown, "{journal:?}: a copy within the file");

        b.sync_all().unwrap();
        assert_eq!(read_all(&*target_data), target_bytes, "{journal:?}: after the commit");
        assert_eq!(unit_rows(&b, target), 5, "{journal:?}: the target's unit 2 has no row");
        assert_eq!(b.integrity_check().unwrap(), "ok");
        drop((source_data, target_data, empty_data));
        drop(b);
        let b = open(&dir);
        let read = |id| read_all(&*b.open(id, OpenMode::default()).unwrap());
        assert_eq!(read(target), target_bytes, "{journal:?}: reopened");
        assert_eq!(read(empty), source_bytes, "{journal:?}: reopened");
        assert_eq!(read(source), grown, "{journal:?}: reopened");
    }
}

/// A file's `st_blocks` counts the units it holds rows for, capped at its size: a hole holds
/// nothing, so `du` of a sparse file is what ext4 says, and `cp` and `tar --sparse`, which look
/// for holes only where `st_blocks` is below the size, find them (a file said it held its whole
/// size until 2026-12-06).
#[test]
fn a_files_blocks_count_the_units_it_holds_and_a_hole_none() {
    use libc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
    let dir = tempfile::tempdir().unwrap();
    let b = open(&dir);
    let blocks = |id| b.getattr(id).unwrap().blocks;
    let truncated = new_file(&b, "truncated", &[]);
    b.open(truncated, OpenMode { write: true, no_atime: false }).unwrap().set_size(10 << 30).unwrap();
    assert_eq!(blocks(truncated), 0, "a truncated file holds nothing");

    let id = new_file(&b, "sparse", &pattern(3 * UNIT as usize));
    let data = b.open(id, OpenMode { write: true, no_atime: false }).unwrap();
    data.set_size(10 << 30).unwrap();
    assert_eq!(blocks(id), 3 * UNIT / 512, "three units written, then grown");
    assert_eq!(b.lookup(ROOT_ID, OsStr::new("sparse")).unwrap().blocks, 3 * UNIT / 512, "a lookup says the same");
    data.allocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 2 * UNIT).unwrap();
    assert_eq!(blocks(id), UNIT / 512, "two punched out");
    let small = new_file(&b, "small", &[1u8; 100]);
    assert_eq!(blocks(small), 1, "at most the size");
}
