//! The file the intent log lives in: preallocated and written through once at creation, so
//! that appending later changes no file-system metadata (no allocation, no unwritten-extent
//! conversion: an fdatasync is then one device flush), and written in whole aligned blocks
//! with O_DIRECT where the file system allows it.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::sys::{self, check, Errno, SysResult};

pub struct LogFile {
    file: File,
    path: PathBuf,
    block_bytes: usize,
    direct: bool,
}

/// Page-aligned memory for O_DIRECT, from the allocator (log writes are few and short-lived).
struct AlignedScratch {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedScratch {
    fn copy_of(bytes: &[u8], align: usize) -> AlignedScratch {
        let layout = std::alloc::Layout::from_size_align(bytes.len().max(align), align).expect("a valid layout");
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory for a {}-byte log write", bytes.len());
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
        AlignedScratch { ptr, layout }
    }

    fn as_slice(&self, len: usize) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }
}

impl Drop for AlignedScratch {
    fn drop(&mut self) {
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

impl LogFile {
    /// Opens the log file, or creates it with `size_bytes` of zeros, durably (the file and its
    /// name). An existing file keeps its size: the caller checks it against what it expects.
    pub fn open_or_create(path: &Path, size_bytes: u64, block_bytes: usize) -> SysResult<(LogFile, bool)> {
        assert!(size_bytes > 0 && size_bytes % block_bytes as u64 == 0, "a log of whole blocks: {size_bytes}");
        let created = match OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path) {
            Ok(file) => {
                fill_with_zeros(&file, size_bytes, block_bytes).inspect_err(|_| {
                    let _ = std::fs::remove_file(path);
                })?;
                if let Some(parent) = path.parent() {
                    let dir = File::open(parent).map_err(Errno::from)?;
                    check(unsafe { libc::fsync(dir.as_raw_fd()) })?;
                }
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(Errno::from(e)),
        };
        let open = |flags: i32| OpenOptions::new().read(true).write(true).custom_flags(flags).open(path);
        // O_DIRECT where the file system takes it; otherwise the page cache and fdatasync.
        let (file, direct) = match open(libc::O_DIRECT) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (open(0).map_err(Errno::from)?, false)
            }
            Err(e) => return Err(Errno::from(e)),
        };
        Ok((LogFile { file, path: path.to_path_buf(), block_bytes, direct }, created))
    }

    pub fn size_bytes(&self) -> SysResult<u64> {
        Ok(sys::fstat_fd(&self.file)?.st_size as u64)
    }

    /// Writes whole blocks at block index `block`; durable only after `sync`.
    pub fn write_blocks(&self, block: u64, bytes: &[u8]) -> SysResult<()> {
        assert!(!bytes.is_empty() && bytes.len() % self.block_bytes == 0, "whole log blocks: {}", bytes.len());
        let offset = block * self.block_bytes as u64;
        if self.direct {
            let aligned = AlignedScratch::copy_of(bytes, self.block_bytes.max(4096));
            sys::pwrite_all(self.file.as_raw_fd(), aligned.as_slice(bytes.len()), offset)
        } else {
            sys::pwrite_all(self.file.as_raw_fd(), bytes, offset)
        }
    }

    /// Makes every block written so far durable: data only, since the file's size and
    /// allocation never change after creation.
    pub fn sync(&self) -> SysResult<()> {
        check(unsafe { libc::fdatasync(self.file.as_raw_fd()) }).map(drop)
    }

    /// The whole file, through the page cache's sibling path: recovery reads it once at mount.
    pub fn read_all(&self) -> SysResult<Vec<u8>> {
        let mut buf = vec![0u8; self.size_bytes()? as usize];
        let plain = File::open(&self.path).map_err(Errno::from)?;
        let n = sys::pread_full(plain.as_raw_fd(), &mut buf, 0)?;
        buf.truncate(n);
        Ok(buf)
    }
}

fn fill_with_zeros(file: &File, size_bytes: u64, block_bytes: usize) -> SysResult<()> {
    // Written, not fallocated: fallocate leaves unwritten extents, and the first write into
    // each would change metadata (and cost a journal commit at fdatasync).
    let chunk = vec![0u8; (1 << 20).max(block_bytes)];
    let mut at = 0u64;
    while at < size_bytes {
        let n = chunk.len().min((size_bytes - at) as usize);
        sys::pwrite_all(file.as_raw_fd(), &chunk[..n], at)?;
        at += n as u64;
    }
    check(unsafe { libc::fsync(file.as_raw_fd()) }).map(drop)
}
