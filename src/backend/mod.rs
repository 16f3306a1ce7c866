//! Backends store; they never decide. A backend is two things the engine talks to:
//!
//! - a `Namespace`: names, attributes, directories, extended attributes, and the key the
//!   intent log names an object by (with the key-addressed calls replay needs);
//! - a `UnitStore`: a file's data, written a unit at a time, read, resized and synced; it
//!   declares its `Capabilities`, and the engine plans its writes from them.
//!
//! One type may implement both (the local directory, the in-memory store), or a unit store may
//! sit over another's namespace (the null store over the local directory's). The engine holds
//! them as trait objects and never names an implementation: `daemon` picks them.
//!
//! | backend | namespace | unit store |
//! |---|---|---|
//! | `local` | the backing directory | its files: aligned ranges in place (O_DIRECT), sub-block edges through the page cache |
//! | `null` | the local one | nothing stored, sizes kept: the FUSE and engine ceiling |
//! | `memory` | in memory | in memory, whole units only, durable at sync; for in-process tests, with crashes |
//! | `faults` | wraps any | wraps any: fails or stalls calls as a test's plan says |
//! | `sqlite` | tables of one database file | one row per file and unit, whole units only; a transaction per sync |
//! | `s3` | the SQLite one, its database local | unit objects in a bucket, partial units packed into segments; a manifest per checkpoint |
//!
//! # The contract
//!
//! The rules every backend keeps, which the engine (the intent log, replay, checkpoints) relies
//! on. Where one can vary between stores it is a field of `Capabilities`, and `Engine::new`
//! refuses a backend that lacks one the intent log needs, saying which.
//!
//! 1. **A sync orders name changes** (`Capabilities::sync_orders_names`). A name change
//!    (make, link, remove, rename, setattr) that has returned is made durable by the next
//!    `FileData::sync`, `Namespace::sync_dir` or `UnitStore::sync_all`, together with every
//!    name change before it and never one after it without the ones before (ext4's journal
//!    does this; a SQLite commit does). Replay and fsync's checks (`engine::replay`,
//!    `engine::writeback::durability`, the NamesSynced record) read the store as a prefix of
//!    the changes made to it.
//! 2. **Engine-chosen ids are kept** (`Capabilities::keeps_chosen_ids`). `make_with_id` makes
//!    the file under exactly the id it is given, which stays the file's id while the namespace
//!    lives; answering another id is a bug the checkpointer stops on. With the intent log on
//!    (the default), every new file is made this way at a checkpoint.
//! 3. **Reserved ids and keys.** Ids from `engine::pending::PENDING_ID_BASE` up are the
//!    engine's: a backend gives none of them out itself (only through `make_with_id`). Log keys
//!    of 20 bytes starting with `b"CFSn"` are the engine's too (`engine::pending::is_pending_key`):
//!    no `log_key` may return one.
//! 4. **Keys are forever.** A key (`log_key`) names one object: it finds that object after a
//!    restart whatever its name is then, and never another object, even after the first is
//!    gone and its id given out again. It may find nothing after a power cut where
//!    `Capabilities::keys_can_go_stale`.
//! 5. **Errors are errors.** `identify`, `key_at` and `find` answer `Ok(None)` only when the
//!    name (or key) holds nothing; an I/O error is an `Err`, never read as "the name is free"
//!    (replay would make a second file at a taken name, or skip an unlink).
//! 6. **Whole units where partial writes are refused.** With `partial_writes` false the engine
//!    hands `write_unit` every byte of the unit below the file's size; a store may refuse a
//!    partial unit as a bug.
//! 7. **A replay watermark commits with what it follows** (`Capabilities::keeps_replay_watermark`,
//!    optional). `Namespace::set_replay_watermark` is made durable by the next sync that makes
//!    every change before it durable, in the same atomic step, and never apart from them (a
//!    database transaction). A checkpoint sets it to the first log batch it does not cover
//!    before its sync; replay then starts there, so a crash between the store's sync and the
//!    log's release does not apply the checkpoint's batches again. Not a file system's journal:
//!    ext4 commits the xattr such a mark would be without waiting for overwritten data blocks.

pub mod faults;
pub mod holes;
pub mod local;
pub mod memory;
pub mod null;
pub mod s3;
pub mod source;
pub mod sqlite;
#[cfg(test)]
pub mod test_support;
pub mod tree_keys;

use std::ffi::OsStr;
use std::sync::Arc;

use crate::engine::buffer::RangeSet;
use crate::engine::types::{Attr, DirEntry, NewObject, ObjectId, Owner, SetAttr, StatFs, XattrReply};
use crate::sys::{Errno, SysResult};

/// Where the unit size came from, for the log and `coalescefs stats`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitSource {
    /// `-o unit=`.
    Option,
    /// A block device's hint (`optimal_io_size`, `minimum_io_size`, `st_blksize`).
    Device {
        device: String,
        attribute: &'static str,
    },
    /// The store's own rule (an object store's part size, a row size).
    Store,
    Default,
}

/// What a unit store can take, which the engine plans its writes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// The store's natural write size (a power of two), and where that came from.
    pub unit_bytes: u64,
    pub unit_source: UnitSource,
    /// The store's smallest addressable write (a power of two, at most the unit): ranges
    /// aligned to it go in place without a read.
    pub logical_block_bytes: u64,
    /// Takes aligned ranges of a unit in place. When false it takes whole units only: the
    /// engine writes a partial unit by reading the rest of it first (counted as
    /// `backend_read_bytes_for_writes`), and prefers the intent log for a partial unit an
    /// fsync must make durable.
    pub partial_writes: bool,
    /// Its data reaches the store by requests of a fixed price whatever their size (an object
    /// PUT: 40-120 KB of device writes on Ceph): the engine answers an fsync of up to half a
    /// unit from the intent log rather than sync the store, as for a store of whole units.
    pub syncs_cost_requests: bool,
    /// A write (and a size change) is durable when it returns: the engine skips a file's sync
    /// after flushing it (fsync, close of a logged file). The checkpoint still calls `sync_all`,
    /// which covers the namespace too.
    pub durable_writes: bool,
    /// One `write_unit` call lands whole or not at all.
    pub atomic_unit_writes: bool,
    /// `FileData::copy_to` works (else ENOSYS, and the kernel copies through reads and writes).
    pub copy_ranges: bool,
    /// `FileData::allocate` works (preallocation, hole punching).
    pub allocate: bool,
    /// A log key can stop naming its object after a power cut (a file handle of a file whose
    /// creation the backing file system had not committed): the log then records names.
    pub keys_can_go_stale: bool,
    /// A sync makes every earlier name change durable, in the order they were made (contract
    /// rule 1). The intent log needs it: `Engine::new` refuses a log over a store without it.
    pub sync_orders_names: bool,
    /// `Namespace::make_with_id` makes a file under the id it is given (contract rule 2). The
    /// intent log needs it (its new files are made so at checkpoints): `Engine::new` refuses a
    /// log over a store without it.
    pub keeps_chosen_ids: bool,
    /// The namespace keeps a replay watermark that commits with every change before it
    /// (contract rule 7): replay starts from it.
    pub keeps_replay_watermark: bool,
    /// The flusher threads the store wants when `-o flushers=` is not given (None: the
    /// machine's default, one per CPU from 2 to 8). An object store's PUTs wait on the network,
    /// not the CPU, so it wants more in flight.
    pub preferred_flushers: Option<usize>,
}

impl Capabilities {
    /// What the intent log needs and this store lacks, said for the person mounting; None
    /// when it has all of it.
    pub fn lacks_for_log(&self) -> Option<String> {
        let mut lacking = Vec::new();
        if !self.sync_orders_names {
            lacking.push("a sync that orders name changes");
        }
        if !self.keeps_chosen_ids {
            lacking.push("files made under engine-chosen ids (make_with_id)");
        }
        (!lacking.is_empty()).then(|| lacking.join(" and "))
    }
}

/// What the engine asks of the names and attributes of a backend. Every call addresses objects
/// by `ObjectId`; an id the namespace has given out stays valid until the engine forgets it.
/// The rules of the module's contract (above) hold for every call.
pub trait Namespace: Send + Sync {
    /// Looks `name` up in the directory `parent`; counts one lookup of the object (the kernel
    /// will forget it later, `forget`).
    fn lookup(&self, parent: ObjectId, name: &OsStr) -> SysResult<Attr>;

    /// The kernel dropped `lookups` lookups of `id`; at zero the namespace may let go of what
    /// it holds for it (the id stays unused for another object while anything names it).
    fn forget(&self, id: ObjectId, lookups: u64);

    /// Counts one more lookup of a known object: the engine holds it while it keeps state for
    /// it (a file with buffered data after its last close), and forgets it after.
    fn hold(&self, id: ObjectId) -> SysResult<()>;

    fn getattr(&self, id: ObjectId) -> SysResult<Attr>;

    /// Changes mode, owner and times (no "now" left in them: the engine fixed it).
    fn setattr(&self, id: ObjectId, changes: &SetAttr) -> SysResult<()>;

    /// Makes `what` as `name` in `parent` (failing with EEXIST if the name is taken), owned by
    /// `owner`; counts one lookup of it.
    fn make(&self, parent: ObjectId, name: &OsStr, what: NewObject<'_>, owner: Owner) -> SysResult<Attr>;

    /// Makes a regular file as `make` does, under the id `id`, which the engine chose from its
    /// own range (`engine::pending`) and served the file under while only its memory and the
    /// intent log held it; counts one lookup of it. The file keeps that id while the namespace
    /// lives, forgotten and looked up again too (the kernel showed it as the inode number).
    /// ENOSYS where the namespace cannot (`Capabilities::keeps_chosen_ids` false); never
    /// another id.
    fn make_with_id(
        &self,
        _id: ObjectId,
        _parent: ObjectId,
        _name: &OsStr,
        _perm: u32,
        _owner: Owner,
    ) -> SysResult<Attr> {
        Err(Errno(libc::ENOSYS))
    }

    /// `make_with_id` of a file about to be given its bytes, from one `prepare_files` made
    /// ahead where one is ready (else as `make_with_id`): its creation was paid for in the
    /// sync that followed the preparation, shared with the others made then.
    fn make_with_id_prepared(
        &self,
        id: ObjectId,
        parent: ObjectId,
        name: &OsStr,
        perm: u32,
        owner: Owner,
    ) -> SysResult<Attr> {
        self.make_with_id(id, parent, name, perm, owner)
    }

    /// Makes files ahead, unnamed, until `count` are ready, with their first `bytes` allocated
    /// where the backend can; and gives back what files made from earlier ones were given and
    /// did not use. For the caller's next sync of the whole store (a checkpoint), which makes
    /// it all durable at once. Returns how many are ready; none by default.
    fn prepare_files(&self, _count: usize, _bytes: u64) -> SysResult<usize> {
        Ok(0)
    }

    /// Gives `id` the further name `new_name` in `new_parent`; counts one lookup.
    fn link(&self, id: ObjectId, new_parent: ObjectId, new_name: &OsStr) -> SysResult<Attr>;

    /// Removes `name` from `parent` (`directory`: an empty directory, as rmdir).
    fn remove(&self, parent: ObjectId, name: &OsStr, directory: bool) -> SysResult<()>;

    /// renameat2(2), with its flags (RENAME_NOREPLACE, RENAME_EXCHANGE).
    fn rename(
        &self,
        parent: ObjectId,
        name: &OsStr,
        new_parent: ObjectId,
        new_name: &OsStr,
        flags: u32,
    ) -> SysResult<()>;

    fn readlink(&self, id: ObjectId) -> SysResult<Vec<u8>>;

    fn set_xattr(&self, id: ObjectId, name: &OsStr, value: &[u8], flags: i32) -> SysResult<()>;
    /// With `size` 0, the value's size; else the value (ERANGE if larger than `size`).
    fn get_xattr(&self, id: ObjectId, name: &OsStr, size: usize) -> SysResult<XattrReply>;
    fn list_xattr(&self, id: ObjectId, size: usize) -> SysResult<XattrReply>;
    fn remove_xattr(&self, id: ObjectId, name: &OsStr) -> SysResult<()>;

    fn statfs(&self, id: ObjectId) -> SysResult<StatFs>;

    /// Opens a directory for reading a bounded batch at a time (see `DirReader`).
    fn open_dir(&self, id: ObjectId) -> SysResult<Box<dyn DirReader>>;

    /// Makes the directory's entries durable (fsyncdir).
    fn sync_dir(&self, id: ObjectId) -> SysResult<()>;

    /// The key the intent log names the object by: it finds the object again after a restart,
    /// whatever it is called by then, and never finds another object in its place (though it
    /// may find nothing, see `Capabilities::keys_can_go_stale`).
    fn log_key(&self, id: ObjectId) -> SysResult<Vec<u8>>;

    /// What `name` in `parent` is now, without counting a lookup: its key and id. For the log
    /// records of a change about to remove or replace it. `Ok(None)` only when nothing has the
    /// name; a failure to look is an error.
    fn identify(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<(Vec<u8>, ObjectId)>>;

    /// How the object is named in the daemon's log (a path), if it can say.
    fn describe(&self, id: ObjectId) -> Option<String>;

    // Replay: the intent log names objects by key; these find them again.

    /// The object logged as `key`, if it still exists; counts one lookup (replay forgets it).
    fn find(&self, key: &[u8]) -> SysResult<Option<ObjectId>>;

    /// The key of what `name` in the directory `parent` is now: `Ok(None)` only when nothing
    /// has the name (replay then takes it as free); a failure to look is an error.
    fn key_at(&self, parent: ObjectId, name: &OsStr) -> SysResult<Option<Vec<u8>>>;

    /// Where `Capabilities::keeps_replay_watermark` (contract rule 7): records that every
    /// intent log batch before `first_batch` is in the store once the next sync returns (None
    /// forgets it). ENOSYS elsewhere.
    fn set_replay_watermark(&self, first_batch: Option<u64>) -> SysResult<()> {
        let _ = first_batch;
        Err(Errno(libc::ENOSYS))
    }

    /// The replay watermark the store holds durably or in its open transaction (None where it
    /// keeps none).
    fn replay_watermark(&self) -> SysResult<Option<u64>> {
        Ok(None)
    }
}

/// A directory being read: `read(offset, max)` returns up to `max` entries from `offset` (0:
/// the start; else an entry's `next_offset`), "." and ".." included. Fewer than `max` means
/// the end.
pub trait DirReader: Send {
    fn read(&mut self, offset: u64, max: usize) -> SysResult<Vec<DirEntry>>;
}

/// How a file's data is opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenMode {
    pub write: bool,
    /// The application asked that reads leave atime alone (O_NOATIME).
    pub no_atime: bool,
}

/// One unit's dirty ranges to write: offsets within the unit, into `buf` (the unit's whole
/// buffer, aligned for direct I/O), none of them at or past `size` (the file's logical size)
/// once clipped.
pub struct UnitWrite<'a> {
    pub unit: u64,
    pub unit_bytes: u64,
    pub buf: &'a [u8],
    pub ranges: &'a RangeSet,
    pub size: u64,
}

impl UnitWrite<'_> {
    /// Where the unit starts in the file.
    pub fn start(&self) -> u64 {
        self.unit * self.unit_bytes
    }

    /// How much of the unit lies before the logical size.
    pub fn limit(&self) -> u64 {
        self.size.saturating_sub(self.start()).min(self.unit_bytes)
    }
}

/// What the engine asks of a file's data.
pub trait FileData: Send + Sync {
    /// Reads at `offset`; returns the bytes read (short at the end of the data).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize>;

    /// Writes one unit's dirty ranges (clipped to the logical size). Never reads old data
    /// back unless the store takes whole units only (`Capabilities::partial_writes`); counts
    /// what it writes.
    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()>;

    /// The data's size becomes exactly `size`.
    fn set_size(&self, size: u64) -> SysResult<()>;

    fn size(&self) -> SysResult<u64>;

    /// Makes every write so far durable (`data_only`: fdatasync's promise).
    fn sync(&self, data_only: bool) -> SysResult<()>;

    /// Whether any byte is data (not a hole, not unwritten allocation). Doubt answers true.
    fn holds_data(&self) -> bool {
        true
    }

    /// fallocate(2), with its mode; ENOSYS where the store cannot.
    fn allocate(&self, _mode: i32, _offset: u64, _length: u64) -> SysResult<()> {
        Err(Errno(libc::ENOSYS))
    }

    /// lseek(2) for SEEK_DATA and SEEK_HOLE; ENOSYS where the store cannot (the kernel then
    /// answers them itself, as if the file had no holes).
    fn seek(&self, _offset: i64, _whence: i32) -> SysResult<i64> {
        Err(Errno(libc::ENOSYS))
    }

    /// Copies `length` bytes from `source_offset` to `target` at `target_offset` inside the
    /// store; ENOSYS where it cannot (the kernel copies through reads and writes).
    fn copy_to(
        &self,
        _source_offset: u64,
        _target: &dyn FileData,
        _target_offset: u64,
        _length: u64,
    ) -> SysResult<usize> {
        Err(Errno(libc::ENOSYS))
    }

    /// For `copy_to` between two files of one store.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// What the engine asks of the store a file's data lives in.
pub trait UnitStore: Send + Sync {
    fn capabilities(&self) -> &Capabilities;

    /// Opens the data of the regular file `id`.
    fn open(&self, id: ObjectId, mode: OpenMode) -> SysResult<Arc<dyn FileData>>;

    /// Makes everything written to the store durable (a checkpoint's one sync), the
    /// namespace's changes included, in order (contract rule 1).
    fn sync_all(&self) -> SysResult<()>;
}
