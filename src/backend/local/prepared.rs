//! Files made ahead: the inode and the first blocks of a new file allocated at a checkpoint,
//! with those of other files, and named later, when the engine makes one of its held files on
//! the backend before a checkpoint (it grew past what the log takes, or an operation the
//! engine does not model on held files came).
//!
//! Why: a new file made on its own costs ext4 the inode bitmap, the block bitmap and the group
//! descriptor in the journal commit that makes it durable, beside its directory block and its
//! inode. A file made ahead has paid for those in the checkpoint's commit, shared; naming it
//! costs the directory block and its inode (and the orphan file's block, which lists unnamed
//! inodes). Measured per file with seed 000's method on ext4 alone (write in 8 KiB pieces,
//! close, `sync`): 64 KiB files 72 KiB of device writes against 78 made with open(O_CREAT) on
//! 512-byte sectors, 96 against 120 on 4 KiB sectors; 1 MiB files 1,032 against 1,038 and
//! 1,056 against 1,080 (`bench/new-file-layouts` has the fsynced case).
//!
//! How: `O_TMPFILE` in the backing root (an unnamed inode the backing file system frees with
//! its last descriptor: a crash leaves nothing behind), its first `bytes` bytes allocated
//! past its end (`FALLOC_FL_KEEP_SIZE`: its size stays 0, the blocks read as zeros), named by
//! `linkat`. What a named file holds past its end is given back at the next checkpoint
//! (`trim`): a truncate to its own size, under a lock every writer of that inode takes for
//! reading (a write that grew it meanwhile would be cut off), and its mtime put back (the
//! truncate sets it; the file's own writes are what mtime is for).
//!
//! A crash between a file's naming and that checkpoint would leave its blocks past its end
//! allocated for good, so the handles (`name_to_handle_at`) of every file made ahead are
//! written, and made durable, to a list in the state directory before any of them can be
//! named (`keep_list`, `refill`): the next mount opens each by its handle and gives back what
//! it holds past its end. A handle of a file never named opens nothing (the file system freed
//! it with the daemon's descriptor). One small write of the list per checkpoint that made
//! files (into one of two slots in turn, see `List`), none per file.
//!
//! Must not: decide when (the engine asks, see `Namespace::prepare_files`).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::{Arc, Mutex, RwLock, Weak};

use super::nodes::BackingDir;
use super::objects::{BackingKey, Object};
use crate::sys::{self, check, Errno, SysResult};

/// A handle from `BackingDir::handle_of_open`.
type Handle = Vec<u8>;

/// Files are made ahead only while the backing file system keeps more than 1/this free.
const FREE_FRACTION_KEPT: u64 = 10;

/// A named file whose blocks past its end (up to `to`) are not given back yet.
#[derive(Clone)]
struct Reserved {
    /// Taken for reading by every write and size or time change of the inode
    /// (`LocalFileData`, `LocalBackend::setattr`), for writing by its trim.
    guard: Arc<RwLock<()>>,
    /// Not kept alive from here: its node's descriptor would keep an unlinked file's blocks
    /// allocated until the trim (on a full disk, `rm` of the file gave nothing back while the
    /// checkpoints failed for want of that space).
    object: Weak<Object>,
    to: u64,
    /// None where the file system gives no handles: the file is then in no list.
    handle: Option<Handle>,
    /// The last answer of `unused_reservation`, and the stat it was for: `ls -l` or a `stat`
    /// loop over fresh files asks again and again, and each answer opens the file and walks
    /// its holes. Shared by the entry's clones.
    last_unused: Arc<Mutex<Option<(StatKey, u64)>>>,
}

/// What changes whenever a file's blocks may have: any write, truncate or fallocate moves its
/// ctime (which nothing can set back), most also its size or blocks.
#[derive(Clone, Copy, PartialEq, Eq)]
struct StatKey {
    size: i64,
    blocks: i64,
    ctime: (i64, i64),
}

impl StatKey {
    fn of(st: &libc::stat) -> StatKey {
        StatKey { size: st.st_size, blocks: st.st_blocks, ctime: (st.st_ctime, st.st_ctime_nsec) }
    }
}

/// A file made ahead and not named yet.
pub struct Unnamed {
    pub file: File,
    /// The bytes allocated in it past its end.
    pub allocated: u64,
    handle: Option<Handle>,
}

#[derive(Default)]
pub struct PreparedFiles {
    ready: Mutex<Vec<Unnamed>>,
    reserved: Mutex<HashMap<BackingKey, Reserved>>,
    /// Whether `reserved` holds anything: every open for writing and every setattr asks, and
    /// almost always it holds nothing, which this answers without the map's lock.
    any_reserved: AtomicBool,
    /// The backing file system makes no unnamed files (no O_TMPFILE): none is tried again.
    unsupported: AtomicBool,
    /// The state directory's list of the files made ahead, once `keep_list` opened it; its
    /// lock is held by a refill from its writing the list until its files are ready.
    list: Mutex<Option<List>>,
    /// The files the last `trim` gave blocks back: listed once more, since their truncates are
    /// durable only with the backend's next sync, which comes after the list's next write.
    just_trimmed: Mutex<Vec<Handle>>,
    /// See `times_given_back`.
    given_back: std::sync::atomic::AtomicU64,
    /// See `hole_walks`.
    hole_walks: std::sync::atomic::AtomicU64,
}

/// A lock a panicking thread held is taken as it is: the daemon goes on serving.
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PreparedFiles {
    /// One unnamed file, if any is left, and how many are left after it.
    pub fn take(&self) -> Option<(Unnamed, usize)> {
        let mut ready = lock(&self.ready);
        ready.pop().map(|unnamed| (unnamed, ready.len()))
    }

    pub fn ready(&self) -> usize {
        lock(&self.ready).len()
    }

    /// Frees the files made ahead and not named yet, for a write that found the disk full.
    /// Returns the bytes they held ahead; the next checkpoint makes more only where the disk
    /// has room (`FREE_FRACTION_KEPT`).
    pub fn give_back_ready(&self) -> u64 {
        // Freed and counted under the lock: a write that met ENOSPC while another writer gives
        // the blocks back waits here, then sees the count moved and tries again (with the list
        // taken first and counted after, it found the list empty and the count not yet moved,
        // and failed with the space about to be free: CI, holes_and_space).
        self.give_back_locked(&mut lock(&self.ready))
    }

    /// Closes the files `ready` (the list, under its lock), which frees them (unnamed,
    /// O_TMPFILE: the file system frees each with its last descriptor), and counts the
    /// give-back if it freed anything; returns the bytes they held.
    fn give_back_locked(&self, ready: &mut Vec<Unnamed>) -> u64 {
        let freed = std::mem::take(ready);
        let bytes = freed.iter().map(|unnamed| unnamed.allocated).sum();
        drop(freed);
        if bytes > 0 {
            self.given_back.fetch_add(1, Release);
        }
        bytes
    }

    /// How many times `give_back_ready` freed anything: a write that met ENOSPC while another
    /// was given the blocks tries again too.
    pub fn times_given_back(&self) -> u64 {
        self.given_back.load(Acquire)
    }

    /// A file taken from here was named as `object`: its blocks past `to` are its own, those
    /// before it and past its end are given back by the next `trim`.
    pub fn note_named(&self, object: Arc<Object>, unnamed: Unnamed) {
        let guard = Arc::new(RwLock::new(()));
        let (to, handle) = (unnamed.allocated, unnamed.handle);
        let mut reserved = lock(&self.reserved);
        let last_unused = Arc::new(Mutex::new(None));
        reserved.insert(object.key, Reserved { guard, object: Arc::downgrade(&object), to, handle, last_unused });
        self.any_reserved.store(true, Release);
    }

    /// The lock a writer of the inode `key` takes for reading, while it holds reserved blocks.
    pub fn guard_of(&self, key: BackingKey) -> Option<Arc<RwLock<()>>> {
        // Set with the entry, under the map's lock; cleared only with the map empty, under it.
        if !self.any_reserved.load(Acquire) {
            return None;
        }
        lock(&self.reserved).get(&key).map(|r| r.guard.clone())
    }

    /// The bytes of the file `key` that are its reservation's and hold nothing it wrote: its
    /// allocated blocks past its end, and those of `[0, to)` inside its size that read as holes
    /// (`to`: what was allocated ahead). 0 for a file with no reservation left. `open` opens
    /// the file for the holes, asked only where the file is reserved and reaches `to`.
    /// `handle_of`: the object's persistent handle, asked only where the object the entry was
    /// made for is gone from memory.
    pub fn unused_reservation(
        &self,
        object: &Object,
        st: &libc::stat,
        handle_of: impl FnOnce() -> SysResult<Handle>,
        open: impl FnOnce() -> SysResult<File>,
    ) -> u64 {
        // As `guard_of`: almost always nothing is reserved, which this answers without the lock.
        if !self.any_reserved.load(Acquire) || st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return 0;
        }
        let Some(entry) = lock(&self.reserved).get(&object.key).cloned() else { return 0 };
        // The entry stays until the next trim, and the inode number is the backing file
        // system's to give again: a file removed since and a directory made in its inode showed
        // the directory's blocks as the reservation's (pjdfstest rename::preserve_metadata_dir).
        let is_this_file = match entry.object.upgrade() {
            Some(named) => std::ptr::eq(Arc::as_ptr(&named), object),
            // Forgotten by the kernel and looked up again, or another file: the handle holds
            // the inode's generation.
            None => entry.handle.as_ref().is_some_and(|kept| handle_of().is_ok_and(|now| &now == kept)),
        };
        if !is_this_file {
            return 0;
        }
        let key = StatKey::of(st);
        if let Some((asked, unused)) = *lock(&entry.last_unused) {
            if asked == key {
                return unused;
            }
        }
        self.hole_walks.fetch_add(1, Relaxed);
        let to = entry.to;
        let (size, block) = (st.st_size as u64, st.st_blksize.max(512) as u64);
        let past_end = to.saturating_sub(size.next_multiple_of(block));
        let inside = if size >= block {
            let holes = open().and_then(|file| sys::holes_within(&file, 0, to.min(size)));
            holes.map_or(0, |holes| holes.iter().map(|(from, to)| to - from).sum())
        } else {
            0
        };
        let unused = (past_end + inside).min(st.st_blocks as u64 * 512);
        *lock(&entry.last_unused) = Some((key, unused));
        unused
    }

    /// How many times `unused_reservation` walked a file's holes (the rest were answered from
    /// the entry's last answer).
    #[cfg(test)]
    pub fn hole_walks(&self) -> u64 {
        self.hole_walks.load(Relaxed)
    }

    /// Makes unnamed files until `count` are ready, each with `bytes` allocated; none where
    /// that would leave under `FREE_FRACTION_KEPT` of the backing file system free (the ones
    /// ready are then given back too: a nearly full disk keeps its space for the files written).
    /// Returns how many are ready. The files are made without the lock `take` needs: a held
    /// file made meanwhile does not wait for them.
    pub fn refill(&self, dir: &BackingDir, count: usize, bytes: u64) -> SysResult<usize> {
        if self.unsupported.load(Relaxed) {
            return Ok(0);
        }
        let (free, total) = {
            let st = dir.statfs_root()?;
            (st.f_bavail.saturating_mul(st.f_frsize), st.f_blocks.saturating_mul(st.f_frsize))
        };
        let missing = count.saturating_sub(self.ready());
        if free < (total / FREE_FRACTION_KEPT).saturating_add(missing as u64 * bytes) {
            let mut ready = lock(&self.ready);
            if !ready.is_empty() {
                log::info!("{free} bytes free on the backing file system: no files made ahead");
            }
            self.give_back_locked(&mut ready);
            return Ok(0);
        }
        let mut made = Vec::with_capacity(missing);
        let result = (|| {
            for _ in 0..missing {
                let file = match dir.make_unnamed() {
                    Ok(file) => file,
                    // What open(2) answers where the file system has no O_TMPFILE.
                    Err(Errno(e)) if [libc::EOPNOTSUPP, libc::EISDIR, libc::EINVAL].contains(&e) => {
                        log::info!(
                            "the backing file system makes no unnamed files ({}): new files are made one by one",
                            Errno(e)
                        );
                        self.unsupported.store(true, Relaxed);
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                };
                let allocated = match sys::fallocate(&file, libc::FALLOC_FL_KEEP_SIZE, 0, bytes) {
                    Ok(()) => bytes,
                    // Still a file made ahead: its inode is, if not its blocks.
                    Err(Errno(libc::EOPNOTSUPP)) => 0,
                    Err(e) => return Err(e),
                };
                let handle = dir
                    .handle_of_open(&file)
                    .inspect_err(|e| log::debug!("no handle for a file made ahead ({e}): it is in no list"))
                    .ok();
                made.push(Unnamed { file, allocated, handle });
            }
            Ok(())
        })();
        // What was made before a failure is kept, once listed.
        let mut list = lock(&self.list);
        if let Some(list) = list.as_mut().filter(|_| !made.is_empty()) {
            let mut handles: Vec<Handle> = made.iter().filter_map(|u| u.handle.clone()).collect();
            handles.extend(lock(&self.ready).iter().filter_map(|u| u.handle.clone()));
            handles.extend(lock(&self.reserved).values().filter_map(|r| r.handle.clone()));
            handles.extend(lock(&self.just_trimmed).iter().cloned());
            // Unlisted, none may be named: they go (unnamed, the file system frees them).
            write_list(list, &handles)?;
        }
        let mut ready = lock(&self.ready);
        ready.extend(made);
        result.map(|()| ready.len())
    }

    /// Opens (or makes) the list of files made ahead at `path` and gives back the blocks past
    /// their ends that the files it names hold: those a daemon that stopped without its last
    /// checkpoint named and never trimmed. From now on `refill` lists its files there before it
    /// hands them out. Returns how many files were given blocks back. Before the engine serves
    /// anything: a file trimmed here has no writer.
    pub fn keep_list(&self, dir: &BackingDir, path: &Path) -> SysResult<usize> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| Errno(e.raw_os_error().unwrap_or(libc::EIO)))?;
        let (trimmed, next_seq) = match read_list(&file) {
            Ok(None) => (0, 0),
            // A handle holds the inode's generation beside its number: one of another file
            // system (a different one mounted at the backing path since) opens nothing here,
            // or, against odds of one in 2^32, a file whose blocks past its end are trimmed.
            Ok(Some((seq, handles))) => (give_back_listed(dir, &handles), seq + 1),
            Err(why) => {
                log::warn!(
                    "{}: {why}; the files made ahead before this mount keep what they hold past their ends",
                    path.display()
                );
                (0, 0)
            }
        };
        *lock(&self.list) = Some(List { file, next_seq });
        Ok(trimmed)
    }

    /// Gives back the blocks named files hold past their ends. Returns how many were trimmed;
    /// one that cannot be is left with its blocks, and logged.
    pub fn trim(&self, dir: &BackingDir) -> usize {
        let entries: Vec<(BackingKey, Reserved)> = lock(&self.reserved).iter().map(|(k, r)| (*k, r.clone())).collect();
        *lock(&self.just_trimmed) = entries.iter().filter_map(|(_, r)| r.handle.clone()).collect();
        let mut trimmed = 0;
        for (key, entry) in entries {
            let _no_writer = entry.guard.write().unwrap_or_else(|p| p.into_inner());
            match trim_one(dir, &entry) {
                Ok(true) => trimmed += 1,
                Ok(false) => {}
                Err(e) => log::warn!(
                    "giving back the blocks past the end of inode {} (made ahead): {e}; they stay allocated",
                    key.1
                ),
            }
            // Out of the map before the guard goes: a writer that opens the file from now on
            // needs none. Only this entry: its inode number may be a newer file's by now.
            let mut map = lock(&self.reserved);
            if map.get(&key).is_some_and(|r| Arc::ptr_eq(&r.guard, &entry.guard)) {
                map.remove(&key);
            }
            if map.is_empty() {
                self.any_reserved.store(false, Release);
            }
        }
        trimmed
    }
}

/// Gives back what the file holds past its end and what of `[0, to)` inside its size it never
/// wrote (a file grown by a truncate or a write past `to`), keeping its mtime. Returns whether
/// it had anything there. Past the end a truncate to its own size, not a hole punched: ext4
/// punches nothing past the end, and frees preallocated blocks there on any truncate
/// (`ext4_setattr`).
fn trim_one(dir: &BackingDir, reserved: &Reserved) -> SysResult<bool> {
    let file = match reserved.handle.as_ref().map(|handle| open_listed(dir, handle)) {
        Some(Ok(Some(file))) => file,
        Some(Ok(None)) => return Ok(false),
        // No CAP_DAC_READ_SEARCH: through the object while anything else keeps it.
        Some(Err(Errno(libc::EPERM))) | None => match reserved.object.upgrade() {
            Some(object) => dir.open(&object.node, libc::O_WRONLY)?,
            None => return Ok(false),
        },
        Some(Err(e)) => return Err(e),
    };
    trim_file(&file, Some(reserved.to))
}

/// A file made ahead, opened for its trim by its handle; None where it is gone (never named,
/// and freed with the daemon's descriptor that held it; or named and removed since: its blocks
/// went with it).
fn open_listed(dir: &BackingDir, handle: &Handle) -> SysResult<Option<File>> {
    match dir.open_by_handle(handle, libc::O_WRONLY) {
        Ok(file) => Ok(Some(file)),
        Err(Errno(libc::ESTALE | libc::ENOENT)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Gives back what `file` holds past its end: up to `to` where that is known, else whatever
/// it has allocated past the end's block.
fn trim_file(file: &File, to: Option<u64>) -> SysResult<bool> {
    let before = sys::fstat_fd(file)?;
    let size = before.st_size as u64;
    if before.st_nlink == 0 || before.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Ok(false);
    }
    let holds_past_end = match to {
        Some(to) => size < to,
        None => before.st_blocks as u64 * 512 > size.next_multiple_of(before.st_blksize.max(512) as u64),
    };
    // Holes inside the size, in what was allocated ahead: unwritten extents ext4 keeps
    // allocated (a punch of a range that holds none is not asked for).
    let unwritten_inside = match to {
        Some(to) if before.st_blocks > 0 => sys::holes_within(file, 0, to.min(size))?,
        _ => Vec::new(),
    };
    if !holds_past_end && unwritten_inside.is_empty() {
        return Ok(false);
    }
    for (from, to) in unwritten_inside {
        sys::fallocate(file, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, from, to - from)?;
    }
    if holds_past_end {
        // SAFETY: `ftruncate` takes only integers (a descriptor and plain values) and touches
        // none of our memory; a bad descriptor is an error return.
        sys::retry_eintr(|| check(unsafe { libc::ftruncate(file.as_raw_fd(), before.st_size) }))?;
    }
    let after = sys::fstat_fd(file)?;
    if (after.st_mtime, after.st_mtime_nsec) != (before.st_mtime, before.st_mtime_nsec) {
        let times = [
            libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
            libc::timespec { tv_sec: before.st_mtime, tv_nsec: before.st_mtime_nsec },
        ];
        // SAFETY: `futimens` reads a live array of two `timespec`s, as it expects, and any C string
        // passed is NUL-terminated.
        check(unsafe { libc::futimens(file.as_raw_fd(), times.as_ptr()) })?;
    }
    Ok(true)
}

/// The trims `keep_list` does: each listed file that is still there, by its handle. Returns how
/// many had blocks given back.
fn give_back_listed(dir: &BackingDir, handles: &[Handle]) -> usize {
    let mut trimmed = 0;
    for handle in handles {
        let file = match open_listed(dir, handle) {
            Ok(Some(file)) => file,
            Ok(None) => continue,
            Err(Errno(libc::EPERM)) => {
                log::warn!(
                    "files made ahead before this mount: opening them by handle needs CAP_DAC_READ_SEARCH; \
                     what they hold past their ends stays allocated"
                );
                break;
            }
            Err(e) => {
                log::warn!("a file made ahead before this mount: {e}; what it holds past its end stays allocated");
                continue;
            }
        };
        match trim_file(&file, None) {
            Ok(true) => trimmed += 1,
            Ok(false) => {}
            Err(e) => log::warn!("giving back the blocks past the end of a file made ahead before this mount: {e}"),
        }
    }
    if trimmed > 0 {
        log::info!(
            "{trimmed} files made ahead and named before the last daemon stopped: blocks past their ends given back"
        );
    }
    trimmed
}

/// The list is two slots, written in turn: a crash that tears one write leaves the other, the
/// list before, which names every file the torn one would have but those it was about to hand
/// out (which die unnamed). A slot's first bytes; then its body's length and crc32c, then the
/// body: the write's sequence number, the handle count, and each handle's length and bytes.
const LIST_MAGIC: &[u8; 8] = b"CFSAHD02";
const LIST_HEADER_BYTES: usize = 16;
/// A slot's size: longer than any list the engine's count makes (16 ready, as many named since
/// the last trim and trimmed by it, 132 bytes a handle at most); a longer one is refused
/// (`write_list`).
const LIST_SLOT_BYTES: usize = 64 << 10;

/// The list the state directory keeps, and the sequence number of its next write.
struct List {
    file: File,
    next_seq: u64,
}

/// Writes the list into the slot the last write did not use, in whole 4 KiB blocks, and waits
/// for it to be durable.
fn write_list(list: &mut List, handles: &[Handle]) -> SysResult<()> {
    let mut body = Vec::with_capacity(12 + handles.len() * 16);
    body.extend_from_slice(&list.next_seq.to_le_bytes());
    body.extend_from_slice(&(handles.len() as u32).to_le_bytes());
    for handle in handles {
        body.extend_from_slice(&(handle.len() as u32).to_le_bytes());
        body.extend_from_slice(handle);
    }
    let mut block = Vec::with_capacity(LIST_HEADER_BYTES + body.len());
    block.extend_from_slice(LIST_MAGIC);
    block.extend_from_slice(&(body.len() as u32).to_le_bytes());
    block.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    block.extend_from_slice(&body);
    if block.len() > LIST_SLOT_BYTES {
        // More handles than `refill`'s callers ever make ready: the refill fails, and none of
        // its files is handed out unlisted.
        log::error!("a list of {} files made ahead is longer than its slot ({LIST_SLOT_BYTES} bytes)", handles.len());
        return Err(Errno(libc::EOVERFLOW));
    }
    block.resize(block.len().next_multiple_of(4096), 0);
    let slot = (list.next_seq % 2) as usize * LIST_SLOT_BYTES;
    sys::pwrite_all(list.file.as_raw_fd(), &block, slot as u64)?;
    // SAFETY: `fdatasync` takes only integers (a descriptor and plain values) and touches none of
    // our memory; a bad descriptor is an error return.
    sys::retry_eintr(|| check(unsafe { libc::fdatasync(list.file.as_raw_fd()) }))?;
    list.next_seq += 1;
    Ok(())
}

/// The newer whole slot's sequence number and handles; None for a new list (no slot written),
/// Err where no slot is whole.
fn read_list(file: &File) -> Result<Option<(u64, Vec<Handle>)>, String> {
    let mut bytes = vec![0u8; 2 * LIST_SLOT_BYTES];
    let n = sys::pread_full(file.as_raw_fd(), &mut bytes, 0).map_err(|e| format!("reading the list: {e}"))?;
    let bytes = &bytes[..n];
    if bytes.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let slots: Vec<Result<(u64, Vec<Handle>), String>> = bytes.chunks(LIST_SLOT_BYTES).map(read_slot).collect();
    match slots.iter().filter_map(|slot| slot.as_ref().ok()).max_by_key(|(seq, _)| *seq) {
        Some(newer) => Ok(Some(newer.clone())),
        None => Err(slots.into_iter().find_map(Result::err).unwrap_or_default()),
    }
}

fn read_slot(bytes: &[u8]) -> Result<(u64, Vec<Handle>), String> {
    let (header, rest) = bytes.split_at_checked(LIST_HEADER_BYTES).ok_or("a list shorter than its header")?;
    if &header[..8] != LIST_MAGIC {
        return Err("not a list of files made ahead".into());
    }
    let u32_at = |b: &[u8], at: usize| b.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let body_len = u32_at(header, 8).unwrap() as usize;
    let body = rest.get(..body_len).ok_or("a list cut short")?;
    if crc32c::crc32c(body) != u32_at(header, 12).unwrap() {
        return Err("a list whose checksum does not match (a write torn by a crash?)".into());
    }
    let seq = u64::from_le_bytes(body.get(..8).ok_or("no sequence number")?.try_into().unwrap());
    let count = u32_at(body, 8).ok_or("no count")? as usize;
    let mut handles = Vec::with_capacity(count.min(1024));
    let mut at = 12;
    for _ in 0..count {
        let len = u32_at(body, at).ok_or("a handle cut short")? as usize;
        handles.push(body.get(at + 4..at + 4 + len).ok_or("a handle cut short")?.to_vec());
        at += 4 + len;
    }
    Ok((seq, handles))
}
