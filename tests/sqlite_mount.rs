//! The SQLite backend over a real FUSE mount (`coalescefs mount sqlite:PATH MOUNTPOINT`, the
//! intent log on, as by default): a tree copied in survives an unmount and a remount byte for
//! byte and attribute for attribute, the database checks clean, a kill -9 after an fsync is
//! replayed at the next mount, and what is not a database is refused unwritten.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use rusqlite::OptionalExtension;

use common::{
    coalescefs, control_in, daemon_log_in, kill_daemon_of, path_str, runtime_dir, stderr_of, unmount_in_drop,
    xattr_names, xattr_of, BIN,
};

/// A database in a temporary directory, its state directory beside it, mounted at `mnt`.
struct SqliteMount {
    dir: tempfile::TempDir,
    db: PathBuf,
    mnt: PathBuf,
    mounted: bool,
}

impl SqliteMount {
    fn new() -> SqliteMount {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("tree.db");
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        SqliteMount { dir, db, mnt, mounted: false }
    }

    fn source(&self) -> String {
        format!("sqlite:{}", path_str(&self.db))
    }

    fn mount(&mut self, options: &[&str]) {
        self.mount_with_env(options, &[]);
    }

    fn mount_with_env(&mut self, options: &[&str], env: &[(&str, &str)]) {
        let state = format!("state={}", path_str(&self.dir.path().join("state")));
        let options = [&[state.as_str()], options].concat().join(",");
        let out = Command::new(BIN)
            .args(["mount", &self.source(), &path_str(&self.mnt), "-o", &options])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(out.status.success(), "mount failed: {}", stderr_of(&out));
        self.mounted = true;
    }

    /// A counter of the daemon's `stats`.
    fn counter(&self, name: &str) -> u64 {
        let stats = control_in(&self.runtime_dir(), "stats");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no counter {name} in:\n{stats}"))
    }

    fn unmount(&mut self) {
        let out = coalescefs(&["umount", &path_str(&self.mnt)]);
        assert!(out.status.success(), "umount failed: {}", stderr_of(&out));
        self.mounted = false;
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    fn runtime_dir(&self) -> PathBuf {
        runtime_dir(&self.db)
    }

    fn daemon_log(&self) -> String {
        daemon_log_in(&self.runtime_dir())
    }

    fn kill_daemon(&mut self) {
        kill_daemon_of(&self.runtime_dir(), &self.mnt);
        self.mounted = false;
    }

    /// The database opened as any program would (unmounted).
    fn open_db(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.db).unwrap()
    }

    fn integrity(&self) -> String {
        self.open_db().query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap()
    }
}

impl Drop for SqliteMount {
    fn drop(&mut self) {
        if self.mounted {
            unmount_in_drop(&self.mnt);
        }
        if !std::thread::panicking() {
            let _ = fs::remove_dir_all(self.runtime_dir());
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8) ^ (i / 4096) as u8).collect()
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let p = common::cstr(path);
    let n = std::ffi::CString::new(name).unwrap();
    // SAFETY: NUL-terminated strings and a buffer of `value.len()` bytes, all outliving the call.
    let ret = unsafe { libc::lsetxattr(p.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    assert_eq!(ret, 0, "setxattr {name} on {}: {}", path.display(), std::io::Error::last_os_error());
}

/// A small tree: subdirectories, files from empty to 3 MiB, symlinks, a hard link, extended
/// attributes on a file and a directory, modes and times of its own.
fn make_tree(root: &Path) {
    for dir in ["etc", "etc/pve", "etc/pve/nodes", "etc/pve/nodes/n1", "var/empty"] {
        fs::create_dir_all(root.join(dir)).unwrap();
    }
    fs::write(root.join("etc/pve/corosync.conf"), pattern(1000, 1)).unwrap();
    fs::write(root.join("etc/pve/nodes/n1/qemu.conf"), pattern(5000, 2)).unwrap();
    fs::write(root.join("etc/pve/empty"), b"").unwrap();
    fs::write(root.join("big.img"), pattern(3 << 20, 3)).unwrap();
    fs::write(root.join("odd"), pattern(65536 + 17, 4)).unwrap();
    std::os::unix::fs::symlink("pve/corosync.conf", root.join("etc/corosync.link")).unwrap();
    std::os::unix::fs::symlink("/nowhere/at/all", root.join("dangling")).unwrap();
    fs::hard_link(root.join("odd"), root.join("etc/odd.hard")).unwrap();
    set_xattr(&root.join("etc/pve/corosync.conf"), "user.checksum", b"abc123");
    set_xattr(&root.join("etc/pve/corosync.conf"), "user.empty", b"");
    set_xattr(&root.join("etc/pve"), "user.dir", &pattern(300, 5));
    for (rel, mode) in [("etc/pve/corosync.conf", 0o640), ("etc/pve/nodes", 0o750), ("odd", 0o600)] {
        fs::set_permissions(root.join(rel), std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    }
}

/// Everything the test compares, by relative path: kind and mode, size, nlink, mtime, a
/// symlink's target, a file's bytes, the extended attributes.
fn snapshot(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in fs::read_dir(root.join(&rel)).unwrap() {
            let entry = entry.unwrap();
            let rel = rel.join(entry.file_name());
            let path = root.join(&rel);
            let meta = fs::symlink_metadata(&path).unwrap();
            let mut what = format!(
                "mode {:o} nlink {} uid {} gid {} mtime {}.{:09}",
                meta.mode(),
                meta.nlink(),
                meta.uid(),
                meta.gid(),
                meta.mtime(),
                meta.mtime_nsec()
            );
            if meta.file_type().is_symlink() {
                what += &format!(" -> {}", fs::read_link(&path).unwrap().display());
            } else {
                let mut names = xattr_names(&path);
                names.sort();
                for name in names.iter().filter(|n| n.starts_with("user.")) {
                    what += &format!(" xattr {name}={:?}", xattr_of(&path, name).unwrap());
                }
            }
            if meta.is_file() {
                let bytes = fs::read(&path).unwrap();
                what += &format!(" size {} crc {:08x}", bytes.len(), crc32c::crc32c(&bytes));
            }
            if meta.is_dir() {
                stack.push(rel.clone());
            }
            out.insert(path_str(&rel), what);
        }
    }
    out
}

#[test]
fn a_tree_copied_in_survives_a_remount_byte_for_byte_and_the_database_checks_clean() {
    let mut m = SqliteMount::new();
    let source = m.dir.path().join("source");
    fs::create_dir(&source).unwrap();
    make_tree(&source);
    let expected = snapshot(&source);
    assert!(expected.len() >= 13, "the tree has what the test means to copy: {expected:?}");

    m.mount(&[]);
    let out = Command::new("cp").args(["-a", &format!("{}/.", path_str(&source)), &path_str(&m.mnt)]).output().unwrap();
    assert!(out.status.success(), "cp -a: {}", stderr_of(&out));
    assert_eq!(snapshot(&m.mnt), expected, "as copied, before the unmount");
    m.unmount();

    // Unmounted: the database file alone holds it all (its WAL copied into it: a copy of the
    // file without its WAL is checked), clean, with no crash marker left.
    let copy = m.dir.path().join("copy.db");
    fs::copy(&m.db, &copy).unwrap();
    assert_eq!(m.integrity(), "ok");
    let db = rusqlite::Connection::open(&copy).unwrap();
    let check: String = db.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    assert_eq!(check, "ok", "the database file alone");
    let (rows, bytes): (i64, i64) = db
        .query_row("SELECT count(*), coalesce(sum(length(data)), 0) FROM units", [], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap();
    let file_bytes: i64 = db.query_row("SELECT sum(size) FROM inodes WHERE kind = 'file'", [], |r| r.get(0)).unwrap();
    assert_eq!(file_bytes, (3 << 20) + 1000 + 5000 + 65536 + 17, "every file's size, a hard link's once");
    assert_eq!(bytes, file_bytes, "every byte in unit rows");
    assert!(rows >= 48, "a 3 MiB file is 48 units of 64 KiB: {rows} rows");
    let marker: i64 = db.query_row("SELECT count(*) FROM meta WHERE key = 'log_marker'", [], |r| r.get(0)).unwrap();
    assert_eq!(marker, 0, "a clean unmount clears the crash marker");
    drop(db);

    m.mount(&[]);
    assert_eq!(snapshot(&m.mnt), expected, "after a remount");
    m.unmount();
    assert_eq!(m.integrity(), "ok");
}

#[test]
fn an_fsync_the_daemon_was_killed_after_is_replayed_at_the_next_mount() {
    let mut m = SqliteMount::new();
    // No checkpoint before the kill: the fsynced bytes are in the intent log only.
    m.mount(&["checkpoint_interval=3600s", "flush_age=3600s"]);
    fs::create_dir(m.path("cfg")).unwrap();
    fs::write(m.path("cfg/old.conf"), pattern(2000, 7)).unwrap();
    let out = coalescefs(&["sync", &path_str(&m.mnt)]);
    assert!(out.status.success(), "coalescefs sync: {}", stderr_of(&out));

    let new_bytes = pattern(1024, 8);
    let mut f = fs::OpenOptions::new().write(true).create_new(true).mode(0o640).open(m.path("cfg/new.conf")).unwrap();
    f.write_all(&new_bytes).unwrap();
    f.sync_all().unwrap();
    let mut old = fs::OpenOptions::new().append(true).open(m.path("cfg/old.conf")).unwrap();
    old.write_all(b"appended and fsynced").unwrap();
    old.sync_all().unwrap();
    m.kill_daemon();
    drop((f, old));

    // The database alone has neither: what brings them back is the log.
    {
        let db = m.open_db();
        let named: i64 =
            db.query_row("SELECT count(*) FROM dentries WHERE name = x'6e65772e636f6e66'", [], |r| r.get(0)).unwrap();
        assert_eq!(named, 0, "new.conf reached the database before the kill: the test tests nothing");
        let marker: i64 = db.query_row("SELECT count(*) FROM meta WHERE key = 'log_marker'", [], |r| r.get(0)).unwrap();
        assert_eq!(marker, 1, "the crash marker is in the database");
        let check: String = db.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
        assert_eq!(check, "ok", "after the kill");
    }

    m.mount(&[]);
    assert!(m.daemon_log().contains("replayed the intent log"), "no replay: {}", m.daemon_log());
    assert_eq!(fs::read(m.path("cfg/new.conf")).unwrap(), new_bytes);
    assert_eq!(fs::metadata(m.path("cfg/new.conf")).unwrap().mode() & 0o7777, 0o640);
    let mut expected_old = pattern(2000, 7);
    expected_old.extend_from_slice(b"appended and fsynced");
    assert_eq!(fs::read(m.path("cfg/old.conf")).unwrap(), expected_old);
    m.unmount();
    assert_eq!(m.integrity(), "ok");
    let db = m.open_db();
    let named: i64 =
        db.query_row("SELECT count(*) FROM dentries WHERE name = x'6e65772e636f6e66'", [], |r| r.get(0)).unwrap();
    assert_eq!(named, 1, "replayed into the database");
}

/// A crash after a checkpoint's commit and before the log's release (the daemon dies at the
/// release's write to the log): the database's replay watermark says it holds the
/// checkpoint's batches, and the next mount replays none of them (contract rule 7), the tree
/// whole. Without the watermark every one of them was applied again over the database.
#[test]
fn a_crash_between_a_checkpoints_commit_and_the_logs_release_replays_nothing_the_database_holds() {
    let mut m = SqliteMount::new();
    let quiet = ["checkpoint_interval=3600s", "checkpoint_idle=3600s", "flush_age=3600s"];
    m.mount_with_env(&quiet, &[("COALESCEFS_FAULTS", "")]);
    fs::create_dir(m.path("cfg")).unwrap();
    let out = coalescefs(&["sync", &path_str(&m.mnt)]);
    assert!(out.status.success(), "coalescefs sync: {}", stderr_of(&out));
    let files = 20;
    for i in 0..files {
        let mut f = fs::File::create(m.path(&format!("cfg/f{i}"))).unwrap();
        f.write_all(&pattern(1500, i as u8)).unwrap();
        f.sync_all().unwrap();
    }
    // The next write to the log's device ends the daemon as kill -9 would: the checkpoint's
    // release, after the database's commit.
    assert_eq!(control_in(&m.runtime_dir(), "inject logwrite=abort").trim(), "ok");
    let out = coalescefs(&["sync", &path_str(&m.mnt)]);
    assert!(!out.status.success(), "the checkpoint's release was not cut short: the test tests nothing");
    m.kill_daemon();
    {
        let db = m.open_db();
        let named: i64 =
            db.query_row("SELECT count(*) FROM dentries WHERE CAST(name AS TEXT) LIKE 'f%'", [], |r| r.get(0)).unwrap();
        assert_eq!(named, files, "the checkpoint's commit did not happen before the daemon died");
        let watermark: Option<i64> =
            db.query_row("SELECT value FROM meta WHERE key = 'replay_watermark'", [], |r| r.get(0)).optional().unwrap();
        assert!(watermark.is_some(), "no replay watermark in the database");
    }

    m.mount(&[]);
    let skipped = m.counter("log_batches_below_watermark_total");
    assert!(skipped >= files as u64, "{skipped} batches skipped of the {files} fsyncs'");
    assert_eq!(m.counter("log_replayed_records_total"), 0, "records the database held were replayed");
    for i in 0..files {
        assert_eq!(fs::read(m.path(&format!("cfg/f{i}"))).unwrap(), pattern(1500, i as u8), "f{i}");
    }
    m.unmount();
    assert_eq!(m.integrity(), "ok");
}

#[test]
fn a_missing_directory_or_a_file_that_is_not_a_database_is_refused_and_left_unwritten() {
    let m = SqliteMount::new();
    let out = coalescefs(&["mount", "sqlite:/no/such/dir/x.db", &path_str(&m.mnt)]);
    assert!(!out.status.success());
    assert!(stderr_of(&out).contains("/no/such/dir does not exist"), "{}", stderr_of(&out));

    let text = m.dir.path().join("notes.txt");
    let junk = b"not a database at all, only text long enough to fill a header\n".repeat(20);
    fs::write(&text, &junk).unwrap();
    let out = coalescefs(&["mount", &format!("sqlite:{}", path_str(&text)), &path_str(&m.mnt)]);
    assert!(!out.status.success());
    assert!(stderr_of(&out).contains("is not a SQLite database"), "{}", stderr_of(&out));
    assert_eq!(fs::read(&text).unwrap(), junk, "left as it was");
    assert!(!m.dir.path().join("notes.txt-wal").exists());
    let _ = fs::remove_dir_all(runtime_dir(&text));

    // recover and forget open it as a database and refuse it, writing nothing.
    for command in ["recover", "forget"] {
        let out = coalescefs(&[command, &format!("sqlite:{}", path_str(&text))]);
        assert!(!out.status.success());
        assert!(stderr_of(&out).contains("is not a SQLite database"), "{command}: {}", stderr_of(&out));
    }
    assert_eq!(fs::read(&text).unwrap(), junk, "still as it was");
    assert!(!m.dir.path().join("notes.txt-wal").exists());
}

/// `-o ro` over a database: the tree reads back, every change is refused with EROFS, and the
/// database file is byte for byte what it was (no generation bumped, nothing collected). A
/// database a crash left needing its log is refused read-only, as a directory is.
#[test]
fn a_read_only_mount_of_a_database_reads_the_tree_and_writes_nothing_to_it() {
    let mut m = SqliteMount::new();
    m.mount(&[]);
    make_tree(&m.mnt);
    let expected = snapshot(&m.mnt);
    m.unmount();
    let before = fs::read(&m.db).unwrap();

    m.mount(&["ro"]);
    assert_eq!(snapshot(&m.mnt), expected);
    let refused = fs::write(m.path("new"), b"x").unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::EROFS), "{refused}");
    let refused = fs::remove_file(m.path("odd")).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::EROFS), "{refused}");
    m.unmount();
    assert!(fs::read(&m.db).unwrap() == before, "the read-only mount changed the database file");
    assert!(!m.daemon_log().contains("WARN"), "{}", m.daemon_log());

    // A crash's log to replay: refused read-only, the database left as it is.
    m.mount(&["checkpoint_interval=3600s"]);
    let mut f = fs::File::create(m.path("logged")).unwrap();
    f.write_all(b"only in the log").unwrap();
    f.sync_all().unwrap();
    m.kill_daemon();
    drop(f);
    let before = fs::read(&m.db).unwrap();
    let state = format!("state={},ro", path_str(&m.dir.path().join("state")));
    let out = Command::new(BIN).args(["mount", &m.source(), &path_str(&m.mnt), "-o", &state]).output().unwrap();
    assert!(!out.status.success(), "a database needing its log was mounted read-only");
    assert!(stderr_of(&out).contains("not unmounted cleanly"), "{}", stderr_of(&out));
    assert!(fs::read(&m.db).unwrap() == before, "the refused mount changed the database file");
    m.mount(&[]);
    assert_eq!(fs::read(m.path("logged")).unwrap(), b"only in the log");
    m.unmount();
}

/// `coalescefs forget sqlite:PATH` after a kill: refused while the log holds batches the
/// database does not have (naming the mount and recover), done with --discard: the state and
/// runtime directories go, the database's crash marker is cleared, and the database mounts
/// again without the lost writes.
#[test]
fn forget_of_a_database_refuses_to_lose_logged_writes_unless_told_to_discard_them() {
    let mut m = SqliteMount::new();
    m.mount(&["checkpoint_interval=3600s", "flush_age=3600s"]);
    fs::write(m.path("kept"), b"checkpointed").unwrap();
    let out = coalescefs(&["sync", &path_str(&m.mnt)]);
    assert!(out.status.success(), "coalescefs sync: {}", stderr_of(&out));
    let mut f = fs::File::create(m.path("logged")).unwrap();
    f.write_all(b"only in the log").unwrap();
    f.sync_all().unwrap();
    m.kill_daemon();
    drop(f);
    let state = m.dir.path().join("state");

    let watermark: i64 =
        m.open_db().query_row("SELECT count(*) FROM meta WHERE key = 'replay_watermark'", [], |r| r.get(0)).unwrap();
    assert_eq!(watermark, 1, "the checkpoint left no replay watermark: the check below tests nothing");

    let out = coalescefs(&["forget", &m.source(), "--state", &path_str(&state)]);
    assert!(!out.status.success(), "forget lost logged writes without --discard");
    assert!(stderr_of(&out).contains("--discard"), "{}", stderr_of(&out));
    assert!(state.join("intent.log").exists(), "the refused forget removed the log");

    let out = coalescefs(&["forget", &m.source(), "--state", &path_str(&state), "--discard"]);
    assert!(out.status.success(), "forget --discard: {}", stderr_of(&out));
    assert!(!state.exists(), "the state directory is still there");
    assert!(!m.runtime_dir().exists(), "the runtime directory is still there");
    let marker: i64 =
        m.open_db().query_row("SELECT count(*) FROM meta WHERE key = 'log_marker'", [], |r| r.get(0)).unwrap();
    assert_eq!(marker, 0, "the crash marker is cleared");
    let watermark: i64 =
        m.open_db().query_row("SELECT count(*) FROM meta WHERE key = 'replay_watermark'", [], |r| r.get(0)).unwrap();
    assert_eq!(watermark, 0, "the replay watermark, a place in the log forgotten, is kept");

    m.mount(&[]);
    assert_eq!(fs::read(m.path("kept")).unwrap(), b"checkpointed");
    assert!(fs::metadata(m.path("logged")).is_err(), "the discarded write came back");
    m.unmount();
}

/// A log damaged before its last batch (a disk's bad sector, a copy cut short) stops the mount
/// with nothing changed and names the way out; `coalescefs recover sqlite:PATH` applies every
/// intact batch into the database, clears its crash marker, and the next mount serves the files
/// those batches hold.
#[test]
fn a_damaged_log_stops_the_mount_and_recover_applies_its_intact_batches_to_the_database() {
    let mut m = SqliteMount::new();
    m.mount(&["checkpoint_interval=3600s", "flush_age=3600s"]);
    let stats = String::from_utf8(coalescefs(&["stats", &path_str(&m.mnt)]).stdout).unwrap();
    let block: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("log_block_bytes")?.trim().parse().ok())
        .expect("log_block_bytes in stats");
    // One fsync each, one batch each: the first file's batch is the log's first.
    for i in 1..=3u8 {
        let mut f = fs::File::create(m.path(&format!("f{i}"))).unwrap();
        f.write_all(&pattern(3000, i)).unwrap();
        f.sync_all().unwrap();
    }
    m.kill_daemon();
    let log = m.dir.path().join("state/intent.log");
    let mut bytes = fs::read(&log).unwrap();
    // The log's first batch follows its two superblock copies.
    let at = (2 * block + 100) as usize;
    bytes[at] ^= 0xff;
    fs::write(&log, &bytes).unwrap();
    // The tree's rows (the meta table's open generation moves at every open, a refused one too).
    let rows = |m: &SqliteMount| -> (i64, i64, i64) {
        m.open_db()
            .query_row(
                "SELECT (SELECT count(*) FROM dentries), (SELECT count(*) FROM inodes), (SELECT count(*) FROM units)",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .unwrap()
    };
    let rows_before = rows(&m);

    let state = format!("state={}", path_str(&m.dir.path().join("state")));
    let out = Command::new(BIN).args(["mount", &m.source(), &path_str(&m.mnt), "-o", &state]).output().unwrap();
    assert!(!out.status.success(), "a damaged log was mounted");
    let said = stderr_of(&out);
    assert!(said.contains("corrupt") && said.contains("coalescefs recover"), "{said}");
    assert_eq!(rows(&m), rows_before, "the refused mount changed the tree");

    let out = coalescefs(&["recover", &m.source(), "--state", &path_str(&m.dir.path().join("state"))]);
    assert!(out.status.success(), "recover: {}", stderr_of(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("Could not be read"), "recover said: {said}");
    {
        let db = m.open_db();
        let marker: i64 = db.query_row("SELECT count(*) FROM meta WHERE key = 'log_marker'", [], |r| r.get(0)).unwrap();
        assert_eq!(marker, 0, "the crash marker is cleared");
    }

    m.mount(&[]);
    assert!(fs::metadata(m.path("f1")).is_err(), "f1's batch was the damaged one");
    for i in 2..=3u8 {
        assert_eq!(fs::read(m.path(&format!("f{i}"))).unwrap(), pattern(3000, i), "f{i}");
    }
    m.unmount();
    assert_eq!(m.integrity(), "ok");
}

/// `coalescefs snapshot MOUNTPOINT FILE` while mounted: the copy holds everything written
/// before it (a file still open with its bytes in the kernel's cache and the daemon's buffer,
/// another fsynced into the intent log only), checks clean, keeps the database's permissions,
/// has no crash marker (mounting it never asks for the original's log), mounts as a tree of its
/// own beside the original, and is never written over; a mount of a directory says the command
/// is for sqlite: stores.
#[test]
fn a_snapshot_while_mounted_is_the_whole_tree_in_a_database_of_its_own() {
    let mut m = SqliteMount::new();
    m.mount(&["checkpoint_interval=3600s"]);
    make_tree(&m.mnt);
    let mut open = fs::File::create(m.path("still-open")).unwrap();
    open.write_all(&pattern(200_000, 9)).unwrap();
    let mut logged = fs::File::create(m.path("etc/pve/logged.conf")).unwrap();
    logged.write_all(&pattern(3000, 7)).unwrap();
    logged.sync_all().unwrap();
    drop(logged);
    fs::set_permissions(&m.db, fs::Permissions::from_mode(0o600)).unwrap();
    let expected = snapshot(&m.mnt);

    let mut copy = SqliteMount::new();
    let out = coalescefs(&["snapshot", &path_str(&m.mnt), &path_str(&copy.db)]);
    assert!(out.status.success(), "snapshot: {}", stderr_of(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("bytes"), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(fs::metadata(&copy.db).unwrap().mode() & 0o777, 0o600, "the database's permissions");
    let leftovers: Vec<_> = fs::read_dir(copy.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("snapshot"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    let db = copy.open_db();
    let check: String = db.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
    assert_eq!(check, "ok");
    let marker: i64 = db.query_row("SELECT count(*) FROM meta WHERE key = 'log_marker'", [], |r| r.get(0)).unwrap();
    assert_eq!(marker, 0, "the copy carries no crash marker");
    let watermarks = |db: &rusqlite::Connection| -> i64 {
        db.query_row("SELECT count(*) FROM meta WHERE key = 'replay_watermark'", [], |r| r.get(0)).unwrap()
    };
    assert_eq!(watermarks(&m.open_db()), 1, "the original holds a replay watermark: the next check tests nothing");
    assert_eq!(watermarks(&db), 0, "the copy carries the original's replay watermark (a place in another log)");
    drop(db);

    // Never over a file, the copy's name taken or not.
    let again = coalescefs(&["snapshot", &path_str(&m.mnt), &path_str(&copy.db)]);
    assert!(!again.status.success() && stderr_of(&again).contains("exists"), "{}", stderr_of(&again));

    // Written after the snapshot: in the original, not in the copy.
    fs::write(m.path("after"), b"later").unwrap();
    copy.mount(&[]);
    assert_eq!(snapshot(&copy.mnt), expected, "the copy, mounted beside the original");
    assert!(!copy.daemon_log().contains("WARN"), "{}", copy.daemon_log());
    copy.unmount();
    drop(open);
    m.unmount();
    assert_eq!(m.integrity(), "ok");

    let dir = tempfile::tempdir().unwrap();
    let local = common::TestMount::new();
    let refused = coalescefs(&["snapshot", &path_str(&local.path("")), &path_str(&dir.path().join("x.db"))]);
    assert!(!refused.status.success() && stderr_of(&refused).contains("sqlite:"), "{}", stderr_of(&refused));
    assert!(!dir.path().join("x.db").exists());
}

/// A database another program holds a write transaction on is refused at mount with that said
/// (after SQLite's 5 s busy wait), and mounts once the other program is done; one on a
/// read-only file system is refused read-write, naming `-o ro`, and mounts with `-o ro`; neither
/// refusal writes a byte of the database file.
#[test]
fn a_database_locked_by_another_program_or_on_a_read_only_file_system_is_refused_unwritten() {
    let mut m = SqliteMount::new();
    m.mount(&[]);
    fs::write(m.path("a"), b"kept").unwrap();
    m.unmount();
    let before = fs::read(&m.db).unwrap();
    let other = rusqlite::Connection::open(&m.db).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let state = format!("state={}", path_str(&m.dir.path().join("state")));
    let out = Command::new(BIN).args(["mount", &m.source(), &path_str(&m.mnt), "-o", &state]).output().unwrap();
    assert!(!out.status.success(), "mounted a database another program was writing");
    assert!(stderr_of(&out).contains("locked by another program"), "{}", stderr_of(&out));
    other.execute_batch("ROLLBACK").unwrap();
    drop(other);
    assert!(fs::read(&m.db).unwrap() == before, "the refused mount wrote to the database file");
    m.mount(&[]);
    assert_eq!(fs::read(m.path("a")).unwrap(), b"kept");
    m.unmount();

    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        common::skip(
            "a_database_locked_by_another_program_or_on_a_read_only_file_system_is_refused_unwritten",
            "a read-only tmpfs needs root",
        );
        return;
    }
    let ro = ReadOnlyCopy::of(&m.db);
    let before = fs::read(&ro.db).unwrap();
    let source = format!("sqlite:{}", path_str(&ro.db));
    let out = Command::new(BIN).args(["mount", &source, &path_str(&m.mnt), "-o", &state]).output().unwrap();
    assert!(!out.status.success(), "mounted read-write on a read-only file system");
    assert!(stderr_of(&out).contains("is read-only") && stderr_of(&out).contains("-o ro"), "{}", stderr_of(&out));
    let read_only = format!("{state},ro");
    let out = Command::new(BIN).args(["mount", &source, &path_str(&m.mnt), "-o", &read_only]).output().unwrap();
    assert!(out.status.success(), "-o ro on a read-only file system: {}", stderr_of(&out));
    let read = fs::read(m.path("a"));
    let out = coalescefs(&["umount", &path_str(&m.mnt)]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(read.unwrap(), b"kept");
    assert!(fs::read(&ro.db).unwrap() == before);
    let _ = fs::remove_dir_all(runtime_dir(&ro.db));
}

/// A copy of a database file (and its WAL) on a tmpfs mounted read-only; unmounted on drop.
struct ReadOnlyCopy {
    dir: tempfile::TempDir,
    db: PathBuf,
}

impl ReadOnlyCopy {
    fn of(db: &Path) -> ReadOnlyCopy {
        let dir = tempfile::tempdir().unwrap();
        let run = |args: &[&str]| {
            let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
            assert!(out.status.success(), "{args:?}: {}", stderr_of(&out));
        };
        let at = path_str(dir.path());
        run(&["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", &at]);
        let copy = ReadOnlyCopy { db: dir.path().join("tree.db"), dir };
        for suffix in ["", "-wal", "-shm"] {
            let from = PathBuf::from(format!("{}{suffix}", path_str(db)));
            if from.exists() {
                fs::copy(&from, format!("{}{suffix}", path_str(&copy.db))).unwrap();
            }
        }
        run(&["mount", "-o", "remount,ro", &at]);
        copy
    }
}

impl Drop for ReadOnlyCopy {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// `sqlite_journal=rollback` over a real mount: the database leaves WAL mode and keeps its
/// rollback journal from one mount to the next, a snapshot (copied under the namespace's lock)
/// and an fsync the daemon was killed after come through it, and `sqlite_journal=wal` brings
/// the WAL back.
#[test]
fn in_rollback_journal_mode_a_mount_snapshots_and_replays_and_the_mode_stays_with_the_file() {
    // The file format's read and write versions (header bytes 18 and 19): 1 legacy, 2 WAL.
    let header_mode = |db: &Path| fs::read(db).unwrap()[18..20].to_vec();
    let side = |db: &Path, suffix: &str| PathBuf::from(format!("{}{suffix}", path_str(db)));
    let mut m = SqliteMount::new();
    m.mount(&["sqlite_journal=rollback", "checkpoint_interval=3600s"]);
    make_tree(&m.mnt);
    let expected = snapshot(&m.mnt);
    let copy = SqliteMount::new();
    let out = coalescefs(&["snapshot", &path_str(&m.mnt), &path_str(&copy.db)]);
    assert!(out.status.success(), "snapshot: {}", stderr_of(&out));
    assert_eq!(copy.integrity(), "ok");
    let mut logged = fs::File::create(m.path("etc/pve/logged.conf")).unwrap();
    logged.write_all(&pattern(3000, 7)).unwrap();
    logged.sync_all().unwrap();
    drop(logged);
    m.kill_daemon();
    m.mount(&[]);
    assert_eq!(fs::read(m.path("etc/pve/logged.conf")).unwrap(), pattern(3000, 7), "the fsync replayed");
    m.unmount();
    assert_eq!(header_mode(&m.db), [1, 1], "a mount without the option kept rollback mode");
    assert!(!side(&m.db, "-wal").exists(), "rollback mode leaves no WAL");
    assert!(side(&m.db, "-journal").exists(), "PERSIST keeps its journal file");
    assert_eq!(m.integrity(), "ok");
    let mut copy = copy;
    copy.mount(&[]);
    assert_eq!(snapshot(&copy.mnt), expected, "the snapshot taken in rollback mode");
    copy.unmount();

    m.mount(&["sqlite_journal=wal"]);
    m.unmount();
    assert_eq!(header_mode(&m.db), [2, 2], "sqlite_journal=wal put it back in WAL mode");
    assert!(!side(&m.db, "-journal").exists(), "the old rollback journal is removed");
    assert_eq!(m.integrity(), "ok");
}
