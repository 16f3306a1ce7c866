//! Recovery: what the intent log holds after its checkpoint, applied to the backend at mount.
//!
//! The backend's state after a crash is the last checkpoint plus any subset of what happened
//! since (on a journaling file system, a prefix); the log holds a prefix of what happened since,
//! in order. Replay applies the log's prefix over the backend's state, every record only where
//! the backend shows it has not happened yet, so a record the backend already holds (or has
//! gone past) changes nothing:
//!
//! - Data and Size, in order, after the file's last Barrier (a backend sync made everything
//!   before it durable there). A file that no longer exists had been deleted: dropped.
//! - Create: nothing if the file still exists (the backend kept its creation, and its names
//!   are at least as new as the log's). Otherwise the file is made again under its logged name,
//!   and its records go to the new file. If the name is taken, the backend holds a later state
//!   of that name (every unlink and rename before the create is in the log, in front of it,
//!   and was applied first): the older file is not put back, and the mount says so.
//! - Unlink and Rename: applied only if the name still refers to the logged object.
//!
//! Then one sync of the backing file system and a checkpoint, so the log starts empty.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::intent_log::IntentLog;
use super::log_format::{Batch, Record};
use crate::backend::local::{data, LocalBackend, Node};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};

/// Errors that say the backend is in another state than the record expects, not that it
/// failed: the record is skipped.
fn means_state_moved_on(e: Errno) -> bool {
    matches!(e.0, libc::ENOENT | libc::ESTALE | libc::ENOTEMPTY | libc::EEXIST | libc::ENOTDIR | libc::EISDIR)
}

struct Replay<'a> {
    backend: &'a LocalBackend,
    /// Every object a record named, once looked for: its file if it exists (None: gone, or not
    /// a regular file).
    files: HashMap<Vec<u8>, Option<File>>,
    /// Objects made again by replay: the logged handle, and the new object's.
    recreated: HashMap<Vec<u8>, Vec<u8>>,
    applied: u64,
    recreated_files: u64,
    not_restored: Vec<String>,
}

impl Replay<'_> {
    fn file(&mut self, key: &[u8]) -> SysResult<Option<&File>> {
        if !self.files.contains_key(key) {
            let found = match self.backend.open_by_handle(key, libc::O_RDWR) {
                Ok(f) => Some(f),
                Err(e) if means_state_moved_on(e) => None,
                Err(e) => return Err(e),
            };
            self.files.insert(key.to_vec(), found);
        }
        Ok(self.files[key].as_ref())
    }

    /// The handle the object logged as `key` has now.
    fn current_handle<'k>(&'k self, key: &'k [u8]) -> &'k [u8] {
        self.recreated.get(key).map_or(key, Vec::as_slice)
    }

    fn directory(&self, key: &[u8]) -> SysResult<Option<Node>> {
        match self.backend.directory_by_handle(key) {
            Ok(dir) => Ok(Some(dir)),
            Err(e) if means_state_moved_on(e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether `name` in `dir` is the object logged as `key`.
    fn names(&self, dir: &Node, name: &CString, key: &[u8]) -> bool {
        self.backend.handle_at(dir, name).is_ok_and(|h| h == self.current_handle(key))
    }

    fn skip_if_moved_on(result: SysResult<()>) -> SysResult<bool> {
        match result {
            Ok(()) => Ok(true),
            Err(e) if means_state_moved_on(e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn create(&mut self, key: &[u8], parent: &[u8], name: &[u8], mode: u32, uid: u32, gid: u32) -> SysResult<bool> {
        if self.files.contains_key(key) || self.file(key)?.is_some() {
            return Ok(false);
        }
        let shown = String::from_utf8_lossy(name).into_owned();
        let name = CString::new(name).map_err(|_| Errno(libc::EINVAL))?;
        let Some(dir) = self.directory(parent)? else {
            self.not_restored.push(format!("{shown}: its directory is gone"));
            return Ok(false);
        };
        if self.backend.handle_at(&dir, &name).is_ok() {
            self.not_restored.push(format!("{shown}: the name holds a later file"));
            return Ok(false);
        }
        let flags = libc::O_RDWR | libc::O_EXCL;
        let (file, node, _) = self.backend.create(&dir, &name, flags, mode & 0o7777)?;
        self.backend.chown(&node, Some(uid), Some(gid))?;
        self.backend.chmod(&node, mode & 0o7777)?;
        self.recreated.insert(key.to_vec(), self.backend.file_handle(&node)?);
        self.files.insert(key.to_vec(), Some(file));
        self.recreated_files += 1;
        Ok(true)
    }

    fn apply(&mut self, record: &Record) -> SysResult<bool> {
        match record {
            Record::Data { file, offset, bytes } => match self.file(file)? {
                Some(f) => data::write_at(f, bytes, *offset).map(|()| true),
                None => Ok(false),
            },
            Record::Size { file, size } => match self.file(file)? {
                Some(f) => data::set_len(f, *size).map(|()| true),
                None => Ok(false),
            },
            Record::Barrier { .. } => Ok(false),
            Record::Create { file, parent, name, mode, uid, gid } => self.create(file, parent, name, *mode, *uid, *gid),
            Record::Unlink { file, parent, name, directory } => {
                let name = CString::new(name.as_slice()).map_err(|_| Errno(libc::EINVAL))?;
                let Some(dir) = self.directory(parent)? else { return Ok(false) };
                if !self.names(&dir, &name, file) {
                    return Ok(false);
                }
                Self::skip_if_moved_on(if *directory {
                    self.backend.rmdir(&dir, &name)
                } else {
                    self.backend.unlink(&dir, &name)
                })
            }
            Record::Rename { file, from_parent, from_name, to_parent, to_name } => {
                let from_name = CString::new(from_name.as_slice()).map_err(|_| Errno(libc::EINVAL))?;
                let to_name = CString::new(to_name.as_slice()).map_err(|_| Errno(libc::EINVAL))?;
                let (Some(from), Some(to)) = (self.directory(from_parent)?, self.directory(to_parent)?) else {
                    return Ok(false);
                };
                if !self.names(&from, &from_name, file) {
                    return Ok(false);
                }
                Self::skip_if_moved_on(self.backend.rename(&from, &from_name, &to, &to_name, 0))
            }
        }
    }
}

pub fn replay(backend: &LocalBackend, log: IntentLog, batches: &[Batch], path: &Path, metrics: &Arc<Metrics>) -> SysResult<IntentLog> {
    if batches.is_empty() {
        return Ok(log);
    }
    let records: Vec<&Record> = batches.iter().flat_map(|b| &b.records).collect();
    let mut last_barrier: HashMap<&[u8], usize> = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        if let Record::Barrier { file } = r {
            last_barrier.insert(file, i);
        }
    }
    let mut replay = Replay {
        backend,
        files: HashMap::new(),
        recreated: HashMap::new(),
        applied: 0,
        recreated_files: 0,
        not_restored: Vec::new(),
    };
    for (i, r) in records.iter().enumerate() {
        let contents = matches!(r, Record::Data { .. } | Record::Size { .. });
        if contents && last_barrier.get(r.file()).is_some_and(|&b| i <= b) {
            continue;
        }
        if replay.apply(r)? {
            replay.applied += 1;
        }
    }
    backend.sync_file_system()?;
    log.checkpoint(log.next_seq()).map_err(|e| {
        log::error!("{e}");
        Errno(libc::EIO)
    })?;
    metrics.log_replayed_records.fetch_add(replay.applied, Ordering::Relaxed);
    log::warn!(
        "replayed {} of {} intent log records ({} batches, {} files made again) from {}: the last mount did not end cleanly",
        replay.applied,
        records.len(),
        batches.len(),
        replay.recreated_files,
        path.display()
    );
    for what in &replay.not_restored {
        log::warn!("intent log: a file created before the crash was not made again: {what}");
    }
    Ok(log)
}
