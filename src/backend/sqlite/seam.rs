//! What a unit store over this namespace uses (the S3 backend's): a file's hold, and its own
//! records in the namespace's transaction.

use super::*;

/// An open handle of a regular file's data: while one is held, the file lives on without a
/// name (unlinked while open); the last one let go deletes such a file. The SQLite backend's
/// data handles hold one, and so do those of a unit store over this namespace (`ExternalData`).
pub struct FileHold {
    pub(super) inner: Arc<Mutex<Inner>>,
    pub(super) id: ObjectId,
}

impl Drop for FileHold {
    fn drop(&mut self) {
        let mut s = lock(&self.inner);
        if let Some(n) = s.open_handles.get_mut(&self.id) {
            *n = n.saturating_sub(1);
        }
        let id = self.id;
        if let Err(e) = collect_if_unheld(&self.inner, s, id) {
            log::warn!("sqlite backend: closing object {id}: {e}");
        }
    }
}

/// The namespace's database as a unit store over it sees it (`SqliteBackend::records`): its
/// own tables read and written inside the namespace's open transaction, a file's size, the
/// commit, and the whole database's bytes for a checkpoint that ships it elsewhere.
pub struct Records<'a> {
    pub(super) s: &'a mut Inner,
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
        self.s.set_file_size(id, size, grow)
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
