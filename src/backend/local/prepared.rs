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
//! Must not: decide when (the engine asks, see `Namespace::prepare_files`).

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::{Arc, Mutex, RwLock};

use super::nodes::BackingDir;
use super::objects::{BackingKey, Object};
use crate::sys::{self, check, Errno, SysResult};

/// Files are made ahead only while the backing file system keeps more than 1/this free.
const FREE_FRACTION_KEPT: u64 = 10;

/// A named file whose blocks past its end (up to `to`) are not given back yet.
#[derive(Clone)]
struct Reserved {
    /// Taken for reading by every write and size or time change of the inode
    /// (`LocalFileData`, `LocalBackend::setattr`), for writing by its trim.
    guard: Arc<RwLock<()>>,
    object: Arc<Object>,
    to: u64,
}

#[derive(Default)]
pub struct PreparedFiles {
    /// Unnamed files, and the bytes each has allocated.
    ready: Mutex<Vec<(File, u64)>>,
    reserved: Mutex<HashMap<BackingKey, Reserved>>,
    /// Whether `reserved` holds anything: every open for writing and every setattr asks, and
    /// almost always it holds nothing, which this answers without the map's lock.
    any_reserved: AtomicBool,
    /// The backing file system makes no unnamed files (no O_TMPFILE): none is tried again.
    unsupported: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PreparedFiles {
    /// One unnamed file and the bytes allocated in it, if any is left.
    pub fn take(&self) -> Option<(File, u64)> {
        lock(&self.ready).pop()
    }

    pub fn ready(&self) -> usize {
        lock(&self.ready).len()
    }

    /// A file taken from here was named as `object`: its blocks past `to` are its own, those
    /// before it and past its end are given back by the next `trim`.
    pub fn note_named(&self, object: Arc<Object>, to: u64) {
        let guard = Arc::new(RwLock::new(()));
        let mut reserved = lock(&self.reserved);
        reserved.insert(object.key, Reserved { guard, object, to });
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
                log::info!("{} bytes free on the backing file system: no files made ahead", free);
            }
            ready.clear();
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
                let allocated = sys::retry_eintr(|| {
                    check(unsafe {
                        libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, bytes as libc::off_t)
                    })
                });
                match allocated {
                    Ok(_) => made.push((file, bytes)),
                    // Still a file made ahead: its inode is, if not its blocks.
                    Err(Errno(libc::EOPNOTSUPP)) => made.push((file, 0)),
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })();
        // What was made before a failure is kept.
        let mut ready = lock(&self.ready);
        ready.extend(made);
        result.map(|()| ready.len())
    }

    /// Gives back the blocks named files hold past their ends. Returns how many were trimmed;
    /// one that cannot be is left with its blocks, and logged.
    pub fn trim(&self, dir: &BackingDir) -> usize {
        let entries: Vec<(BackingKey, Reserved)> = lock(&self.reserved).iter().map(|(k, r)| (*k, r.clone())).collect();
        let mut trimmed = 0;
        for (key, Reserved { guard, object, to }) in entries {
            let _no_writer = guard.write().unwrap_or_else(|p| p.into_inner());
            match trim_one(dir, &object, to) {
                Ok(true) => trimmed += 1,
                Ok(false) => {}
                Err(e) => log::warn!(
                    "giving back the blocks past the end of inode {} (made ahead): {e}; they stay allocated",
                    object.key.1
                ),
            }
            // Out of the map before the guard goes: a writer that opens the file from now on
            // needs none. Only this entry: its inode number may be a newer file's by now.
            let mut reserved = lock(&self.reserved);
            if reserved.get(&key).is_some_and(|r| Arc::ptr_eq(&r.guard, &guard)) {
                reserved.remove(&key);
            }
            if reserved.is_empty() {
                self.any_reserved.store(false, Release);
            }
        }
        trimmed
    }
}

/// Gives back what the file holds past its end, keeping its mtime. Returns whether it had
/// anything there. A truncate to its own size, not a hole punched: ext4 punches nothing past
/// the end, and frees preallocated blocks there on any truncate (`ext4_setattr`).
fn trim_one(dir: &BackingDir, object: &Object, to: u64) -> SysResult<bool> {
    let file = dir.open(&object.node, libc::O_WRONLY)?;
    let before = sys::fstat_fd(&file)?;
    let size = before.st_size as u64;
    if before.st_nlink == 0 || size >= to {
        return Ok(false);
    }
    sys::retry_eintr(|| check(unsafe { libc::ftruncate(file.as_raw_fd(), before.st_size) }))?;
    let after = sys::fstat_fd(&file)?;
    if (after.st_mtime, after.st_mtime_nsec) != (before.st_mtime, before.st_mtime_nsec) {
        let times = [
            libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
            libc::timespec { tv_sec: before.st_mtime, tv_nsec: before.st_mtime_nsec },
        ];
        check(unsafe { libc::futimens(file.as_raw_fd(), times.as_ptr()) })?;
    }
    Ok(true)
}
