//! A file's data in the backing directory, and how a unit reaches it.
//!
//! A unit's dirty ranges are split at logical-block boundaries: the aligned interiors go with
//! O_DIRECT, all in flight at once (Linux AIO) when none of the unit's pieces went through the
//! page cache; the sub-block edges (an unaligned head or tail, such as a file's last bytes) go
//! through the page cache and are counted as `backend_subblock_writes`. A file smaller than
//! one unit goes through the page cache whole (see `write_unit`), one write a dirty range, its
//! sub-block edges still counted. Nothing here reads old data back.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard};

use super::prepared::PreparedFiles;
use crate::backend::{FileData, UnitWrite};
use crate::metrics::Metrics;
use crate::sys::{self, check, check_size, retry_eintr, Errno, SysResult};

pub struct LocalFileData {
    /// Opened with the page cache: reads, sub-block edges, small files, sync.
    file: File,
    /// The same file with O_DIRECT for aligned ranges, opened at the first unit written
    /// (None: the backing file system refuses O_DIRECT).
    direct: OnceLock<Option<File>>,
    logical_block_bytes: u64,
    metrics: Arc<Metrics>,
    /// For a file made ahead whose blocks past its end are not given back yet: taken for
    /// reading by every write and size change, so none grows the file while its trim truncates
    /// it to the size it had (`prepared::PreparedFiles::trim`).
    trim_guard: Option<Arc<RwLock<()>>>,
    /// The backing file system allocates nothing on request (`extend_for_direct`): not asked
    /// again, by this file or any other of the backend's (`LocalBackend::no_fallocate`).
    no_fallocate: Arc<AtomicBool>,
    /// The files made ahead, whose blocks a write that finds the disk full is given first.
    made_ahead: Option<Arc<PreparedFiles>>,
}

fn align_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

fn align_down(x: u64, to: u64) -> u64 {
    x / to * to
}

/// The block-aligned interior `[start, end)` of the range `[a, b)`: empty (start == end) when
/// the range covers no whole block; what lies before and after it are the sub-block edges.
fn aligned_interior(a: u64, b: u64, block: u64) -> (u64, u64) {
    let start = align_up(a, block).min(b);
    (start, align_down(b, block).max(start))
}

impl LocalFileData {
    pub fn new(
        file: File,
        logical_block_bytes: u64,
        metrics: Arc<Metrics>,
        no_fallocate: Arc<AtomicBool>,
    ) -> LocalFileData {
        LocalFileData {
            file,
            direct: OnceLock::new(),
            logical_block_bytes,
            metrics,
            trim_guard: None,
            no_fallocate,
            made_ahead: None,
        }
    }

    /// Before O_DIRECT writes covering [from, end): the part past the file's end allocated
    /// first, which grows the file to `end`. An O_DIRECT write past the end makes ext4 put the
    /// inode on its orphan list for the write's duration (to cut the size back after a crash)
    /// and take it off after, one more journaled block per write: measured on a 4Kn loop
    /// device, 1 MiB files written by one O_DIRECT write each cost 1,088 KiB of device writes
    /// against 1,080 allocated first (and 1,080 written through the page cache); 1,042 against
    /// 1,040 on 512-byte sectors. fallocate, not ftruncate: it only ever grows the file, so a
    /// size a concurrent write or truncate set meanwhile is never cut back (a check then an
    /// ftruncate did cut a tail another flusher had just written: the crash harness saw the
    /// file short). A crash between the two leaves the allocated part reading zeros, as any
    /// write not yet acknowledged may. Where it fails, the writes go on as they would have.
    fn extend_for_direct(&self, from: u64, end: u64) -> SysResult<()> {
        if self.no_fallocate.load(Relaxed) {
            return Ok(());
        }
        let size = sys::fstat_fd(&self.file)?.st_size as u64;
        if size >= end {
            return Ok(());
        }
        let from = from.max(size);
        match sys::fallocate(&self.file, 0, from, end - from) {
            Ok(()) => {}
            Err(Errno(libc::EOPNOTSUPP)) => self.no_fallocate.store(true, Relaxed),
            // ENOSPC and the like: the writes meet it too, and say it.
            Err(e) => log::debug!("allocating {from}..{end} before O_DIRECT writes: {e}"),
        }
        Ok(())
    }

    /// See `trim_guard`.
    pub fn not_trimmed_while_written(&mut self, guard: Option<Arc<RwLock<()>>>) {
        self.trim_guard = guard;
    }

    /// See `made_ahead`.
    pub fn gives_way_to_files_made_ahead(&mut self, made_ahead: Option<Arc<PreparedFiles>>) {
        self.made_ahead = made_ahead;
    }

    pub(super) fn not_trimmed(&self) -> Option<RwLockReadGuard<'_, ()>> {
        self.trim_guard.as_ref().map(|g| g.read().unwrap())
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// The O_DIRECT sibling of the file, reopened through `/proc/self/fd` (the same inode).
    fn direct(&self) -> SysResult<Option<&File>> {
        if let Some(direct) = self.direct.get() {
            return Ok(direct.as_ref());
        }
        let path = sys::proc_fd_path(&self.file);
        let direct = match sys::openat(libc::AT_FDCWD, &path, libc::O_WRONLY | libc::O_DIRECT, 0) {
            Ok(fd) => Some(File::from(fd)),
            // EINVAL is the file system refusing O_DIRECT; anything else (EMFILE) is this
            // attempt failing, and the next flush tries again.
            Err(Errno(libc::EINVAL)) => {
                log::info!("no O_DIRECT on the backing file system (EINVAL); flushing through the page cache");
                None
            }
            Err(e) => return Err(e),
        };
        Ok(self.direct.get_or_init(|| direct).as_ref())
    }

    fn count_write(&self, bytes: u64, direct: bool) {
        self.metrics.backend_write_bytes.fetch_add(bytes, Relaxed);
        self.metrics.backend_write_requests.fetch_add(1, Relaxed);
        self.metrics.backend_write_sizes.record(bytes);
        if direct {
            self.metrics.backend_direct_write_requests.fetch_add(1, Relaxed);
        }
    }
}

impl LocalFileData {
    fn write_unit_once(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let _not_trimmed = self.not_trimmed();
        let block = self.logical_block_bytes;
        let unit_start = unit.start();
        let limit = unit.limit();
        let buf = unit.buf;
        // A file smaller than one unit goes through the page cache whole: O_DIRECT into blocks
        // ext4 has just allocated makes it journal the unwritten-extent conversion on top of
        // the allocation, ~4 KiB more per fsynced new file (64 KiB files: 1.571 device bytes
        // per byte O_DIRECT, 1.506 buffered), and there is no large stream to keep out of the
        // page cache. (Strictly smaller: a growing file's first unit, flushed the moment it
        // fills, is a stream's and goes direct.)
        let direct_file = if unit.size < unit.unit_bytes { None } else { self.direct()? };
        let Some(direct) = direct_file else { return self.write_through_page_cache(unit) };
        // Sub-block edges go through the page cache as they come; the aligned interiors are
        // gathered and go to the O_DIRECT file together, all in flight at once.
        let mut direct_pieces: Vec<(&[u8], u64)> = Vec::new();
        let mut cached_pieces = 0;
        for r in unit.ranges.iter() {
            let (a, b) = (r.start, r.end.min(limit));
            if a >= b {
                continue;
            }
            let (interior_start, interior_end) = aligned_interior(a, b, block);
            let mut pieces = Vec::with_capacity(3);
            if a < interior_start {
                pieces.push((a, interior_start, false));
            }
            if interior_start < interior_end {
                pieces.push((interior_start, interior_end, true));
            }
            if interior_end < b {
                pieces.push((interior_end, b, false));
            }
            for (from, to, aligned) in pieces {
                let bytes = &buf[from as usize..to as usize];
                if aligned {
                    assert_eq!(
                        (bytes.as_ptr() as u64 | (unit_start + from) | bytes.len() as u64) % block,
                        0,
                        "a direct piece is aligned"
                    );
                    direct_pieces.push((bytes, unit_start + from));
                    continue;
                }
                sys::pwrite_all(self.file.as_raw_fd(), bytes, unit_start + from)?;
                cached_pieces += 1;
                self.count_write(to - from, false);
                self.metrics.backend_subblock_writes.fetch_add(1, Relaxed);
            }
        }
        // In offset order, as the unit's ranges are.
        if let (Some((_, from)), Some((bytes, last))) = (direct_pieces.first(), direct_pieces.last()) {
            self.extend_for_direct(*from, last + bytes.len() as u64)?;
        }
        // Together only when no piece of this unit went through the page cache: with a cached
        // page beside them, concurrent O_DIRECT writes were seen (fsx) to fail the kernel's
        // page invalidation and the file with EIO; one at a time they never did.
        let results = if cached_pieces == 0 {
            super::aio::write_many_at(direct.as_raw_fd(), &direct_pieces)
        } else {
            direct_pieces.iter().map(|(bytes, offset)| sys::pwrite_all(direct.as_raw_fd(), bytes, *offset)).collect()
        };
        let mut first_error = None;
        for ((bytes, offset), result) in direct_pieces.iter().zip(results) {
            let went_direct = match result {
                Ok(()) => true,
                // The device wants a larger alignment than discovery found: this piece, and the
                // evidence, go through the page cache instead of failing the flush.
                Err(Errno(libc::EINVAL)) => {
                    log::warn!(
                        "O_DIRECT write of {} bytes at {offset} refused (EINVAL); written through the page cache",
                        bytes.len()
                    );
                    match sys::pwrite_all(self.file.as_raw_fd(), bytes, *offset) {
                        Ok(()) => false,
                        Err(e) => {
                            first_error.get_or_insert(e);
                            continue;
                        }
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            self.count_write(bytes.len() as u64, went_direct);
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Each dirty range in one write through the page cache, whatever its edges (a new
    /// 5000-byte file was two writes, its first 4608 bytes and then its last 392). Its
    /// sub-block edges are counted as they would be split.
    fn write_through_page_cache(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let limit = unit.limit();
        for r in unit.ranges.iter() {
            let (a, b) = (r.start, r.end.min(limit));
            if a >= b {
                continue;
            }
            sys::pwrite_all(self.file.as_raw_fd(), &unit.buf[a as usize..b as usize], unit.start() + a)?;
            self.count_write(b - a, false);
            let (interior_start, interior_end) = aligned_interior(a, b, self.logical_block_bytes);
            let edges = u64::from(a < interior_start) + u64::from(interior_end < b);
            self.metrics.backend_subblock_writes.fetch_add(edges, Relaxed);
        }
        Ok(())
    }
}

impl FileData for LocalFileData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        sys::pread_full(self.file.as_raw_fd(), buf, offset)
    }

    /// A write that finds the backing file system full is tried once more after the files made
    /// ahead and not named yet give their blocks back (up to 16 MiB a mount, see `prepared`):
    /// the space goes to what was written, not to files that may come. The write is the same
    /// bytes at the same offsets, so its part that went through before is written again.
    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let given_back_before = self.made_ahead.as_ref().map(|m| m.times_given_back());
        let space_freed_since = || {
            let made_ahead = self.made_ahead.as_ref();
            made_ahead.is_some_and(|m| m.give_back_ready() > 0 || Some(m.times_given_back()) != given_back_before)
        };
        match self.write_unit_once(unit) {
            Err(Errno(libc::ENOSPC)) if space_freed_since() => {
                self.metrics.files_made_ahead_ready.store(0, Relaxed);
                log::info!("the backing file system is full: files made ahead gave their blocks back");
                self.write_unit_once(unit)
            }
            result => result,
        }
    }

    fn set_size(&self, size: u64) -> SysResult<()> {
        let _not_trimmed = self.not_trimmed();
        // SAFETY: `ftruncate` takes only integers (a descriptor and plain values) and touches none
        // of our memory; a bad descriptor is an error return.
        check(unsafe { libc::ftruncate(self.file.as_raw_fd(), size as libc::off_t) }).map(drop)
    }

    fn size(&self) -> SysResult<u64> {
        Ok(sys::fstat_fd(&self.file)?.st_size as u64)
    }

    fn sync(&self, data_only: bool) -> SysResult<()> {
        let ret = if data_only {
            // SAFETY: `fdatasync` takes only integers (a descriptor and plain values) and touches
            // none of our memory; a bad descriptor is an error return.
            unsafe { libc::fdatasync(self.file.as_raw_fd()) }
        } else {
            // SAFETY: `fsync` takes only integers (a descriptor and plain values) and touches none
            // of our memory; a bad descriptor is an error return.
            unsafe { libc::fsync(self.file.as_raw_fd()) }
        };
        check(ret).map(drop)
    }

    fn holds_data(&self) -> bool {
        // Doubt counts as data: the uncached path is always correct, only slower.
        !matches!(self.seek(0, libc::SEEK_DATA), Err(Errno(libc::ENXIO)))
    }

    fn allocate(&self, mode: i32, offset: u64, length: u64) -> SysResult<()> {
        let _not_trimmed = self.not_trimmed();
        sys::fallocate(&self.file, mode, offset, length)
    }

    fn seek(&self, offset: i64, whence: i32) -> SysResult<i64> {
        // SAFETY: `lseek` takes only integers (a descriptor and plain values) and touches none of
        // our memory; a bad descriptor is an error return.
        let ret = unsafe { libc::lseek(self.file.as_raw_fd(), offset, whence) };
        if ret == -1 {
            Err(Errno::last())
        } else {
            Ok(ret)
        }
    }

    fn copy_to(&self, source_offset: u64, target: &dyn FileData, target_offset: u64, length: u64) -> SysResult<usize> {
        // Not ENOSYS: on that the kernel stops sending copies for the whole mount; on
        // EOPNOTSUPP it copies this one through reads and writes, and asks again next time.
        let Some(target) = target.as_any().downcast_ref::<LocalFileData>() else {
            return Err(Errno(libc::EOPNOTSUPP));
        };
        let _target_not_trimmed = target.not_trimmed();
        let mut source_off = source_offset as libc::loff_t;
        let mut target_off = target_offset as libc::loff_t;
        let copied = retry_eintr(|| {
            // SAFETY: `copy_file_range` updates the two offsets, live locals borrowed exclusively
            // for the call; the rest are descriptors and a length.
            check_size(unsafe {
                libc::copy_file_range(
                    self.file.as_raw_fd(),
                    &raw mut source_off,
                    target.file.as_raw_fd(),
                    &raw mut target_off,
                    length as usize,
                    0,
                )
            })
        })?;
        self.metrics.backend_copied_bytes.fetch_add(copied as u64, Relaxed);
        Ok(copied)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
