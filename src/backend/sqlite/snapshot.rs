//! `coalescefs snapshot`: a consistent copy of a mounted database, taken beside the daemon.
//!
//! The copy is read through a second, read-only connection whose read transaction starts under
//! the namespace's lock right after a commit: it sees exactly the tree that commit left (WAL
//! keeps that view for it while the daemon goes on writing), and nothing of a transaction the
//! daemon has open. The pages are copied with SQLite's backup API in one step, without the
//! lock: the mount is held up only for the commit, not for the copy. In rollback mode
//! (`Journal::Rollback`) a reader holds up the daemon's next commit until it is done, so the
//! copy is made under the lock instead, and the mount waits for it. The copy is then made a
//! tree of its own: the crash marker (the path of the mounted database's intent log) and the
//! replay watermark (a place in that log) are taken out of it, so that mounting it never
//! replays another tree's log into it nor skips a batch of its own, and it is left in
//! rollback-journal mode (one file, no `-wal` beside it). It reaches its name only whole and
//! synced, and never over an existing file.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags};

use super::{lock, Journal, SqliteBackend, LOG_MARKER_KEY, REPLAY_WATERMARK_KEY};

impl SqliteBackend {
    /// Copies the tree the last commit left (everything synced before the call is in it) into
    /// a new database file `dest`; returns its size in bytes.
    pub fn snapshot_into(&self, dest: &Path) -> Result<u64, String> {
        assert!(dest.is_absolute(), "the daemon's working directory is not the asker's: {}", dest.display());
        let shown = dest.display();
        let (Some(dir), Some(name)) = (dest.parent(), dest.file_name()) else {
            return Err(format!("{shown}: not a file name"));
        };
        if dest.symlink_metadata().is_ok() {
            return Err(format!("{shown} exists: a snapshot never writes over a file"));
        }
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let reader =
            Connection::open_with_flags(&self.path, flags).map_err(|e| format!("opening the database to read: {e}"))?;
        let mut s = lock(&self.inner);
        s.commit().map_err(|e| format!("committing before the copy: {e}"))?;
        // A read transaction starts at its first read: here, still under the lock, so it is
        // pinned to the commit just made.
        reader
            .execute_batch("BEGIN; SELECT count(*) FROM meta;")
            .map_err(|e| format!("starting the read of the copy: {e}"))?;
        let held = match s.journal {
            Journal::Wal => {
                drop(s);
                None
            }
            Journal::Rollback => Some(s),
        };
        let temporary = dir.join(format!(".{}.coalescefs-snapshot-{}", name.to_string_lossy(), std::process::id()));
        let _ = std::fs::remove_file(&temporary); // a snapshot before that died part way
        let copied = copy_to(&reader, &temporary);
        let _ = reader.execute_batch("COMMIT");
        drop(held);
        let copied = copied.and_then(|()| {
            let file = std::fs::File::open(&temporary).map_err(|e| format!("{}: {e}", temporary.display()))?;
            // The tree's own file's permissions (a configuration store may hold keys), not the
            // daemon's defaults.
            let mode =
                std::fs::metadata(&self.path).map_err(|e| format!("{}: {e}", self.path.display()))?.permissions();
            file.set_permissions(mode).map_err(|e| format!("{}: {e}", temporary.display()))?;
            file.sync_all().map_err(|e| format!("syncing {}: {e}", temporary.display()))?;
            // A link fails where the name is taken: never over a file made meanwhile.
            std::fs::hard_link(&temporary, dest).map_err(|e| format!("naming the copy {shown}: {e}"))?;
            Ok(file.metadata().map_err(|e| format!("{shown}: {e}"))?.len())
        });
        let _ = std::fs::remove_file(&temporary);
        let bytes = copied?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| format!("syncing the directory {}: {e}", dir.display()))?;
        Ok(bytes)
    }
}

/// The pages `reader`'s transaction sees, into a new database file at `to`, made a tree of
/// its own (no crash marker nor replay watermark, one file).
fn copy_to(reader: &Connection, to: &PathBuf) -> Result<(), String> {
    let shown = to.display();
    let mut copy = Connection::open(to).map_err(|e| format!("{shown}: {e}"))?;
    {
        let backup = rusqlite::backup::Backup::new(reader, &mut copy).map_err(|e| format!("{shown}: {e}"))?;
        // One step: the whole database under the reader's one transaction.
        match backup.step(-1).map_err(|e| format!("copying into {shown}: {e}"))? {
            rusqlite::backup::StepResult::Done => {}
            other => return Err(format!("copying into {shown}: the copy stopped part way ({other:?})")),
        }
    }
    let mode = copy
        .query_row("PRAGMA journal_mode = DELETE", [], |row| row.get::<_, String>(0))
        .map_err(|e| format!("{shown}: {e}"))?;
    if !mode.eq_ignore_ascii_case("delete") {
        return Err(format!("{shown}: the copy stayed in journal mode {mode}, not one file"));
    }
    copy.execute("DELETE FROM meta WHERE key IN (?1, ?2)", [LOG_MARKER_KEY, REPLAY_WATERMARK_KEY])
        .map_err(|e| format!("{shown}: {e}"))?;
    copy.close().map_err(|(_, e)| format!("closing {shown}: {e}"))
}
