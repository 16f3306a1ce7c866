//! Open files and directories: handles, the page-cache choice writers share, and the data
//! path of a handle (read, write, flush at close, fsync, preallocation, holes, copies), which
//! hands written bytes to the write buffer and asks it for durability.

use std::ffi::OsStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::buffer::WriteBytes;
use super::types::{Attr, Kind, NewObject, ObjectId};
use super::writeback::{ErrorReport, FileState};
use super::{lock, Caller, Engine, Opened, PageCache};
use crate::backend::{DirReader, FileData, OpenMode};
use crate::sys::{Errno, SysResult};

pub(super) struct OpenFile {
    pub(super) id: ObjectId,
    /// The file's data, opened with the application's access mode, for reads.
    pub(super) data: Arc<dyn FileData>,
    /// The write buffer of a regular file, shared by all its handles.
    pub(super) state: Option<Arc<FileState>>,
    /// Opened for writing: its close flushes the file (a reader's close leaves it alone).
    pub(super) writable: bool,
    /// A write came through this handle. Until one does, its close may be left to another
    /// descriptor of the file (see [`Engine::flush`]).
    pub(super) written_through: AtomicBool,
}

/// The writable handles open on one file, and the page-cache choice they share (under
/// `PageCache::Auto`; with the cache on or off it is the same for every file).
pub(super) struct WriterMode {
    pub(super) handles: usize,
    pub(super) bypass_page_cache: bool,
}

impl OpenFile {
    pub(super) fn state(&self) -> SysResult<&Arc<FileState>> {
        self.state.as_ref().ok_or(Errno(libc::EINVAL))
    }
}

pub(super) struct OpenDir {
    pub(super) id: ObjectId,
    /// Read a batch at a time from the offset the kernel asks for: nothing of the directory is
    /// copied whole, whatever its size.
    pub(super) reader: Mutex<Box<dyn DirReader>>,
}

impl Engine {
    /// The data of a regular file opened for an application: the kernel has checked its access
    /// mode; only O_NOATIME (the application's wish about reads) reaches the store, and write
    /// access (the kernel reads partly written pages of the writeback cache through whichever
    /// handle it holds, a write-only one included). Every other open flag was the kernel's to
    /// act on, or is the engine's decision:
    ///
    /// | flag | why it is not passed on |
    /// |---|---|
    /// | O_NOFOLLOW, O_DIRECTORY | the kernel resolved the path (O_NOFOLLOW on the store's reopen made SQLite's and rsync's opens fail with ELOOP) |
    /// | O_CREAT, O_EXCL, O_NOCTTY, O_TMPFILE | the kernel's (create is its own request) |
    /// | O_TRUNC | the kernel truncates with a setattr after its own checks (ETXTBSY); an O_TRUNC the engine is given (in-process callers) truncates through the write buffer |
    /// | O_APPEND | the kernel sends the offset; Linux pwrite on an O_APPEND file would ignore it |
    /// | O_SYNC, O_DSYNC | the engine makes such writes durable (through the log or the store) |
    /// | O_DIRECT | the engine chooses how units reach the store |
    /// | O_NONBLOCK, O_ASYNC, kernel-internal bits | mean nothing for a regular file's data |
    fn open_mode(flags: i32) -> OpenMode {
        OpenMode { write: flags & libc::O_ACCMODE != libc::O_RDONLY, no_atime: flags & libc::O_NOATIME != 0 }
    }

    /// `made`: the open made the file (a create), so the store's data it opens is the file's
    /// only one yet.
    fn register_file(&self, id: ObjectId, kind: Kind, flags: i32, made: bool) -> SysResult<Opened> {
        let mode = Self::open_mode(flags);
        let data = self.store.open(id, mode)?;
        let state = match kind {
            Kind::File => Some(self.writeback.open_file(id, || data.size())?),
            _ => None,
        };
        // A file this open made: its flushes write through the data it opened rather than open
        // the store's file a second time. (A file opened again keeps the flushes' own open, by
        // which a file deleted behind the mount is found gone: SEMANTICS.md.)
        if let (Some(state), true) = (&state, mode.write && made) {
            self.writeback.share_data(state, &data);
        }
        // An empty file stays as it is: truncating it would change nothing but count as a
        // backend change, and keep a new file's fsync off the intent log.
        if let (Some(state), true) = (&state, flags & libc::O_TRUNC != 0) {
            if self.writeback.size(state) != 0 {
                self.writeback.set_size(state, 0)?;
            }
        }
        let writable = mode.write;
        let mut bypass_page_cache = false;
        if let (Some(state), true) = (&state, writable) {
            let mut modes = lock(&self.writer_modes);
            let writer = modes.entry(id).or_insert_with(|| WriterMode {
                handles: 0,
                bypass_page_cache: self.config.page_cache == PageCache::Auto && self.holds_data(&*data, state),
            });
            writer.handles += 1;
            bypass_page_cache = writer.bypass_page_cache;
        }
        let fh = self.new_handle();
        lock(&self.files)
            .insert(fh, Arc::new(OpenFile { id, data, state, writable, written_through: AtomicBool::new(false) }));
        Ok(Opened { fh, bypass_page_cache, writable })
    }

    /// Whether a partial-page write into this file could make the kernel read old data:
    /// bytes in the write buffer or data (not holes, not unwritten allocation) in the store.
    fn holds_data(&self, data: &dyn FileData, state: &FileState) -> bool {
        if self.writeback.size(state) == 0 {
            return false;
        }
        self.writeback.has_buffered_data(state) || data.holds_data()
    }

    /// `drop_set_id_bits`: an unprivileged open with O_TRUNC (see [`Engine::drop_set_id_bits`]).
    pub fn open(&self, id: ObjectId, flags: i32, drop_set_id_bits: bool) -> SysResult<Opened> {
        let attr = self.ns.getattr(id)?;
        if drop_set_id_bits && flags & libc::O_TRUNC != 0 {
            self.drop_set_id_bits(id)?;
        }
        self.register_file(id, attr.kind, flags, false)
    }

    pub fn create(
        &self,
        parent: ObjectId,
        name: &OsStr,
        mode: u32,
        flags: i32,
        caller: Caller,
    ) -> SysResult<(Attr, Opened)> {
        let (attr, made) = match self.make(parent, name, NewObject::File { perm: mode & 0o7777 }, caller) {
            Ok(attr) => (attr, true),
            // Made by someone else since the kernel looked: without O_EXCL that is an open.
            Err(Errno(libc::EEXIST)) if flags & libc::O_EXCL == 0 => (self.lookup(parent, name)?, false),
            Err(e) => return Err(e),
        };
        let opened = self.register_file(attr.id, attr.kind, flags, made)?;
        Ok((attr, opened))
    }

    pub fn read(&self, fh: u64, offset: u64, size: u32) -> SysResult<Vec<u8>> {
        let open = self.open_file(fh)?;
        let Some(state) = &open.state else {
            let mut buf = vec![0u8; size as usize];
            let n = open.data.read_at(&mut buf, offset)?;
            buf.truncate(n);
            return Ok(buf);
        };
        // The overlay is taken before the store is read: a unit whose flush ends in between is
        // then in both, never in neither.
        let (logical_size, overlay, _reading) = self.writeback.snapshot_overlay(state, offset, u64::from(size))?;
        let len = logical_size.saturating_sub(offset).min(u64::from(size)) as usize;
        let mut buf = vec![0u8; len];
        open.data.read_at(&mut buf, offset)?; // short where the store is shorter: zeros
        for (at, bytes) in overlay {
            let from = (at - offset) as usize;
            let to = (from + bytes.len()).min(len);
            if from < to {
                buf[from..to].copy_from_slice(&bytes[..to - from]);
            }
        }
        self.metrics.application_read_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(buf)
    }

    /// `drop_set_id_bits`: the writer lacks CAP_FSETID (see [`Engine::drop_set_id_bits`]).
    /// `from_page_cache`: see [`Writeback::write`].
    pub fn write(
        &self,
        fh: u64,
        offset: u64,
        bytes: &[u8],
        flags: i32,
        drop_set_id_bits: bool,
        from_page_cache: bool,
    ) -> SysResult<u32> {
        let bytes = WriteBytes::copied(bytes);
        self.write_answering(fh, offset, bytes, flags, drop_set_id_bits, from_page_cache, &mut |_| {})
    }

    /// As [`Engine::write`], with `answer` called with the bytes taken once the write cannot
    /// fail, possibly before they are copied in (see [`Writeback::write`]): the FUSE adapter
    /// answers the kernel there. When it is not called, the caller answers with the result.
    /// `bytes` may give their pages for the units to take (`WriteBytes::pages_given`).
    #[allow(clippy::too_many_arguments)]
    pub fn write_answering(
        &self,
        fh: u64,
        offset: u64,
        bytes: WriteBytes<'_>,
        flags: i32,
        drop_set_id_bits: bool,
        from_page_cache: bool,
        answer: &mut dyn FnMut(u32),
    ) -> SysResult<u32> {
        let open = self.open_file(fh)?;
        let state = open.state()?;
        if drop_set_id_bits {
            self.drop_set_id_bits(open.id)?;
        }
        open.written_through.store(true, Ordering::Relaxed);
        // An O_DSYNC write is answered after its fsync, below.
        let synced = flags & libc::O_DSYNC != 0;
        let mut answer_early = |taken: usize| answer(taken as u32);
        let early: Option<&mut dyn FnMut(usize)> = if synced { None } else { Some(&mut answer_early) };
        let taken = self.writeback.write(state, offset, bytes, from_page_cache, early)?;
        self.metrics.application_write_bytes.fetch_add(taken as u64, Ordering::Relaxed);
        self.metrics.application_write_requests.fetch_add(1, Ordering::Relaxed);
        self.metrics.application_write_sizes.record(taken as u64);
        if synced {
            // O_SYNC and O_DSYNC writes are durable when they return, as an fsync makes them.
            if self.fsync_is_a_checkpoint() {
                self.writeback.checkpoint()?;
            } else {
                self.writeback.fsync(state, flags & libc::O_SYNC != libc::O_SYNC)?;
            }
        }
        Ok(taken as u32)
    }

    /// `fsync=backend` with the log on: every durability point the application asks for is a
    /// checkpoint (without the log an fsync syncs the store anyway).
    pub(crate) fn fsync_is_a_checkpoint(&self) -> bool {
        self.config.fsync_checkpoints && self.writeback.logging()
    }

    /// close(2): the file's buffered data goes to the store (with the log, the close is a
    /// durability point), and a flush error is reported here, where the application can still
    /// see it.
    ///
    /// Not when the close leaves the file open for writing in the closing process: dd (`of=`),
    /// touch and a shell's `> file` open the file, dup2 it onto a standard descriptor and close
    /// the first before writing a byte. That close is not the end of the writer, and making
    /// the empty file durable there cost a log block per file (on a 4Kn device, one more
    /// block than the file and its record). The close of the last such descriptor is the
    /// durability point, and is never left: a process's exit closes its descriptors with no
    /// table left to find them in. `closer_keeps_a_writer(id)` says whether the closing
    /// process holds another writable descriptor of the file; it reads /proc, so it is asked
    /// only of a handle nothing was written through (dd's, touch's, the shell's first close).
    pub fn flush(&self, fh: u64, closer_keeps_a_writer: &dyn Fn(ObjectId) -> bool) -> SysResult<()> {
        let open = self.open_file(fh)?;
        match &open.state {
            Some(state) if open.writable => {
                if !open.written_through.load(Ordering::Relaxed) && closer_keeps_a_writer(open.id) {
                    self.metrics.closes_left_to_another_descriptor.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                self.writeback.close_file(state)
            }
            _ => Ok(()),
        }
    }

    pub fn release(&self, fh: u64) -> SysResult<()> {
        let open = lock(&self.files).remove(&fh).ok_or(Errno(libc::EBADF))?;
        if open.writable && open.state.is_some() {
            let mut modes = lock(&self.writer_modes);
            if let Some(mode) = modes.get_mut(&open.id) {
                mode.handles -= 1;
                if mode.handles == 0 {
                    modes.remove(&open.id);
                }
            }
        }
        if let Some(state) = &open.state {
            // Unlinked while open, released with data still buffered (changes the log took at
            // close wait for the checkpoint): nothing can read it again, and the backend's file
            // is gone, so writing it would fail (ESTALE) at every retry and fail the checkpoint.
            if self.writeback.release_file(state) && self.writeback.has_no_name(open.id) {
                self.writeback.forget_file(open.id);
            }
        }
        Ok(())
    }

    pub fn fsync(&self, fh: u64, data_only: bool) -> SysResult<()> {
        let open = self.open_file(fh)?;
        if self.fsync_is_a_checkpoint() {
            return self.writeback.checkpoint();
        }
        match &open.state {
            Some(state) => self.writeback.fsync(state, data_only),
            None => open.data.sync(data_only),
        }
    }

    /// Operations the store performs on its own data flush the write buffer first, so that
    /// they see, and are not later overwritten by, what the application wrote before them.
    fn flushed(&self, fh: u64) -> SysResult<Arc<OpenFile>> {
        let open = self.open_file(fh)?;
        if let Some(state) = &open.state {
            self.writeback.flush_file(state, None, ErrorReport::Write)?;
        }
        Ok(open)
    }

    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32) -> SysResult<()> {
        // Before the flush: a store without it answers at once. The kernel turns ENOSYS into
        // EOPNOTSUPP and asks no more on this mount; posix_fallocate then writes zeros.
        if !self.store.capabilities().allocate {
            return Err(Errno(libc::ENOSYS));
        }
        self.make_real(self.open_file(fh)?.id)?;
        let open = self.flushed(fh)?;
        open.data.allocate(mode, offset, length)?;
        self.writeback.note_backend_changed(open.id);
        if let (Some(state), true) = (&open.state, mode & libc::FALLOC_FL_KEEP_SIZE == 0) {
            self.writeback.note_backend_size(state, offset + length);
        }
        Ok(())
    }

    /// Whether the kernel may hold bytes of the file that it has not sent yet: while a handle
    /// is open for writing, its writes through the kernel's page cache (the writeback cache),
    /// and its stores into a shared mapping (in every cache mode), are dirty pages the kernel
    /// sends at its own pace, at the close, or when asked. The engine cannot see them, so an
    /// answer about where the file holds data (SEEK_DATA, SEEK_HOLE) needs them sent first,
    /// which the kernel does not do before it asks (FUSE_LSEEK). With no writer open there are
    /// none: each close sent them, and a mapping keeps its handle open until it is unmapped.
    pub fn kernel_may_hold_writes(&self, fh: u64) -> bool {
        let Ok(open) = self.open_file(fh) else { return false };
        open.state.is_some() && lock(&self.writer_modes).contains_key(&open.id)
    }

    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> SysResult<i64> {
        let open = self.flushed(fh)?;
        open.data.seek(offset, whence)
    }

    pub fn copy_file_range(
        &self,
        source_fh: u64,
        source_offset: u64,
        target_fh: u64,
        target_offset: u64,
        length: u64,
    ) -> SysResult<u32> {
        // ENOSYS: the kernel copies through reads and writes, and asks no more on this mount.
        if !self.store.capabilities().copy_ranges {
            return Err(Errno(libc::ENOSYS));
        }
        self.make_real(self.open_file(source_fh)?.id)?;
        self.make_real(self.open_file(target_fh)?.id)?;
        let source = self.flushed(source_fh)?;
        let target = self.flushed(target_fh)?;
        // FUSE replies carry a u32 byte count; the kernel loops for the rest.
        let length = length.min(u64::from(u32::MAX) & !0xfff);
        // Both are on the backend now (`make_real`); a handle opened while the target was held
        // reaches its backend data through the held file's.
        let target_data = super::pending::store_data(&target.data);
        let copied = source.data.copy_to(source_offset, &*target_data, target_offset, length)?;
        if copied == 0 {
            // At or past the source's end: the target is as it was, however far its offset.
            return Ok(0);
        }
        self.writeback.note_backend_changed(target.id);
        if let Some(state) = &target.state {
            self.writeback.note_backend_size(state, target_offset + copied as u64);
        }
        Ok(copied as u32)
    }
}
