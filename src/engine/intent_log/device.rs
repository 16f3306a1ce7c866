//! Where the intent log's blocks live: a `LogDevice`. The log writes whole blocks at block
//! offsets and syncs; recovery reads it once, a window at a time. Beside the log, the device keeps the replay
//! map (see `engine::replay`): an append-only byte file, synced on every append.
//!
//! `FileLogDevice`: a file, preallocated and written through once at creation, so that
//! appending later changes no file-system metadata (no allocation, no unwritten-extent
//! conversion: an fdatasync is then one device flush), written in whole aligned blocks with
//! O_DIRECT where the file system allows it. A file's write still updates its mtime, a journal
//! commit at the next `sync` (Linux has no O_NOCMTIME for open(2)), except on XFS as root: the
//! file is then opened through its XFS handle, which the kernel opens without mtime and ctime
//! updates ("invisible I/O", FMODE_NOCMTIME, for backup tools). Or a block device
//! (`log=/dev/...`): the log's blocks are then the device's sectors, and a commit costs those
//! sectors and nothing else.
//!
//! `MemoryLogDevice`: blocks in memory, for in-process tests, with what a crash keeps: every
//! synced block, and any chosen subset of the writes since the last sync, in order.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use super::raw::{self, RawBlocks, RawLog};
use crate::sys::{self, check, Errno, SysResult};

pub use super::memory_device::{MemoryLogDevice, MemoryLogSnapshot};

pub trait LogDevice: Send + Sync {
    fn size_bytes(&self) -> SysResult<u64>;
    /// The smallest write the device takes in place, without reading around it (its direct-I/O
    /// alignment): a new log's block. Every write is whole, aligned multiples of it.
    fn block_bytes(&self) -> usize;
    /// Writes `bytes` at byte `offset`, both multiples of `block_bytes`; durable only after `sync`.
    fn write_at(&self, offset: u64, bytes: &[u8]) -> SysResult<()>;
    /// `write_at` for a batch nobody waits to see flushed (closes in a burst): where `sync(1)`
    /// flushes the log, through the page cache, which `sync(1)` writes back, as `sync` does.
    /// Direct and page-cache writes of one file stay coherent: the kernel writes a range's
    /// dirty pages back before a direct write or read of it. `free_after`: how many bytes after
    /// the write hold nothing the log needs (free ring), which the device may write over to
    /// cover whole blocks of its own. Where it cannot (too little free ring, or what comes
    /// before the write in its block unknown), the write goes as it is: slower where the kernel
    /// reads the block first, never wrong. This default writes directly, over nothing more.
    fn write_unflushed_at(&self, offset: u64, bytes: &[u8], _free_after: u64) -> SysResult<()> {
        self.write_at(offset, bytes)
    }
    /// Whether `write_unflushed_at` goes through the page cache (else it is `write_at`).
    fn writes_through_page_cache(&self) -> bool {
        false
    }
    /// Writes to the device what `write_unflushed_at` left in the page cache, and waits for it,
    /// without a flush: a change of the backing file system after this finds those blocks
    /// written before its journal's commit flushes the device (`IntentLog::commit_written_to_device`).
    fn write_back(&self) -> SysResult<()> {
        Ok(())
    }
    /// Makes every block written so far durable.
    fn sync(&self) -> SysResult<()>;
    /// `len` bytes from byte `offset` (fewer at the end of the device), as recovery reads them.
    fn read_at(&self, offset: u64, len: usize) -> SysResult<Vec<u8>>;
    /// Reads up to `buf.len()` bytes at `offset` into `buf`; returns how many (fewer at the
    /// device's end). Recovery reads its window into one buffer this way: a fresh buffer for
    /// each window cost more than the reading (a 64 MiB log's mount took 90 ms, most of it
    /// page faults and copies).
    fn read_into(&self, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
        read_into_through_read_at(self, offset, buf)
    }
    /// The whole log (for tests and tools: recovery reads a window at a time).
    fn read_all(&self) -> SysResult<Vec<u8>> {
        self.read_at(0, self.size_bytes()? as usize)
    }
    /// How the log is named in messages.
    fn describe(&self) -> String;
    /// Whether `sync(1)` flushes what was written: a file on a mounted file system is (its
    /// file system's sync flushes the device: the file's mtime at least is to commit); a block
    /// device is not (sync flushes only file systems' devices), nor a file whose writes change
    /// no inode (XFS's sync then forces an empty log, and flushes nothing).
    fn flushed_by_sync(&self) -> bool {
        true
    }
    /// The replay map beside the log: its bytes (empty when there is none).
    fn read_map(&self) -> SysResult<Vec<u8>>;
    /// Appends to the replay map and makes the bytes (and the map's existence) durable.
    fn append_map_synced(&self, bytes: &[u8]) -> SysResult<()>;
    /// Removes the replay map (the log is empty: nothing will look old handles up again).
    fn remove_map(&self) -> SysResult<()>;
    /// The daemon is done with the log (at unmount): a file whose blocks were written on its
    /// device is written through again, and is no longer immutable.
    fn release(&self) {}
}

pub struct FileLogDevice {
    file: File,
    path: PathBuf,
    block_bytes: usize,
    direct: bool,
    /// Opened through its XFS handle: writes change no inode (`open_without_time_updates`).
    invisible: bool,
    /// A block device: the bytes of it the log takes (a file's size is the file's).
    device_bytes: Option<u64>,
    /// Where the replay map lives: beside a file; in the state directory for a block device.
    map_path: PathBuf,
    /// The file opened without O_DIRECT, for `write_unflushed_at`; None where `sync(1)` would
    /// not write its pages to the device and flush it (a block device, a file opened by its
    /// XFS handle) or where every write goes through the page cache anyway.
    through_page_cache: Option<File>,
    /// The file system's block (`st_blksize`): a write through the page cache that covers part
    /// of one makes the kernel read the block from the device first, unless its page is cached
    /// (a direct write of the block before drops the page).
    fs_block_bytes: u64,
    /// What the log wrote last in the file-system block where its last write ended.
    last_block: Mutex<Option<LastBlock>>,
    /// The file's blocks written on its device (`raw`): writes change no inode. Until
    /// `release`; a write holds it shared, so none is under way when it goes.
    raw: RwLock<Option<RawBlocks>>,
}

/// The bytes written in one file-system block, from its start: with them a write through the
/// page cache that begins inside the block covers it whole from the start, and is not held up
/// by a read. (An unlink in a burst after git's fsynced object write, each a 512-byte batch
/// after a direct one, waited ~80 us for the read of its page.)
struct LastBlock {
    start: u64,
    bytes: Vec<u8>,
}

/// What is found at the start of a block device given as the log.
pub enum BlockDeviceContents {
    /// Zeros: a new log may be made there.
    Zeros,
    /// Something else (a log, or data): its first bytes, for the caller to tell which.
    Bytes(Vec<u8>),
}

/// `LogDevice::read_into` for a device that reads only into buffers of its own: a copy.
fn read_into_through_read_at<D: LogDevice + ?Sized>(device: &D, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
    let bytes = device.read_at(offset, buf.len())?;
    buf[..bytes.len()].copy_from_slice(&bytes);
    Ok(bytes.len())
}

/// Page-aligned memory for O_DIRECT, from the allocator (log writes are few and short-lived).
pub(super) struct AlignedScratch {
    ptr: *mut u8,
    layout: std::alloc::Layout,
    len: usize,
}

impl AlignedScratch {
    pub(super) fn zeroed(len: usize, align: usize) -> AlignedScratch {
        let layout = std::alloc::Layout::from_size_align(len.max(align), align).expect("a valid layout");
        // SAFETY: `layout` has a non-zero size (at least `align`, which `Layout::from_size_align`
        // checked is a power of two); the result is checked for null below.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory for a {len}-byte log write");
        AlignedScratch { ptr, layout, len }
    }

    fn copy_of(bytes: &[u8], align: usize) -> AlignedScratch {
        let mut scratch = AlignedScratch::zeroed(bytes.len(), align);
        scratch.bytes_mut().copy_from_slice(bytes);
        scratch
    }

    fn as_slice(&self, len: usize) -> &[u8] {
        assert!(len <= self.layout.size(), "{len} bytes of a {}-byte buffer", self.layout.size());
        // SAFETY: `ptr` holds `layout.size()` zero-initialised bytes owned by this value, `len` is
        // within them (asserted above), and the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds `layout.size() >= len` zero-initialised bytes owned by this value,
        // and the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `layout.size() >= len` initialised bytes owned by this value alone,
        // and the slice borrows `self` exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedScratch {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated in `zeroed` with this same `layout` and is freed once, here.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

impl FileLogDevice {
    /// Opens the log file at `path`, or makes it `size_bytes` long (a multiple of 4 KiB) and
    /// all zeros, durably (the file and its name); says whether it was made. An existing file
    /// keeps its size: the caller checks it against what it expects. With `RawLog::Auto` its
    /// blocks are written on its device where `RawBlocks::set_up` allows it.
    pub fn open_or_create(path: &Path, size_bytes: u64, raw_log: RawLog) -> SysResult<(FileLogDevice, bool)> {
        assert!(size_bytes > 0 && size_bytes % 4096 == 0, "a log of whole 4 KiB pages: {size_bytes}");
        let block_bytes = 4096;
        // A daemon that wrote the file's blocks on its device and died left it immutable.
        raw::clear_immutable(path).inspect_err(|e| {
            log::error!("{}: clearing the immutable flag a daemon left: {e}", path.display());
        })?;
        let created = match OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path) {
            Ok(file) => {
                fill_with_zeros(&file, size_bytes, block_bytes).inspect_err(|_| {
                    let _ = std::fs::remove_file(path);
                })?;
                sync_parent(path)?;
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(Errno::from(e)),
        };
        let open = |flags: i32| OpenOptions::new().read(true).write(true).custom_flags(flags).open(path);
        // O_DIRECT where the file system takes it; otherwise the page cache and fdatasync.
        let (file, direct) = match open(libc::O_DIRECT) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(0).map_err(Errno::from)?, false),
            Err(e) => return Err(Errno::from(e)),
        };
        // Through the page cache a write smaller than a page may make the kernel read the page.
        let block_bytes = if direct { direct_io_alignment(&file).unwrap_or(block_bytes) } else { block_bytes };
        let (file, invisible) = match direct
            .then(|| open_without_time_updates(&file, path.parent()?, libc::O_RDWR | libc::O_DIRECT))
            .flatten()
        {
            Some(invisible) => {
                log::info!("{}: opened by its XFS handle, its writes update no inode", path.display());
                (invisible, true)
            }
            _ => (file, false),
        };
        let map_path = replay_map_path(path);
        let raw = match raw_log {
            RawLog::Auto if direct && !invisible => {
                let size = sys::fstat_fd(&file)?.st_size as u64;
                match RawBlocks::set_up(&file, path, size, block_bytes) {
                    Ok(raw) => {
                        log::info!(
                            "{}: its blocks are written on {}, so its writes change no inode",
                            path.display(),
                            raw.describe()
                        );
                        Some(raw)
                    }
                    Err(why) => {
                        log::info!("{}: written through the file ({why})", path.display());
                        None
                    }
                }
            }
            _ => None,
        };
        let device = FileLogDevice {
            file,
            path: path.to_path_buf(),
            block_bytes,
            direct,
            invisible,
            device_bytes: None,
            map_path,
            through_page_cache: if invisible || !direct || raw.is_some() { None } else { open(0).ok() },
            fs_block_bytes: fs_block_bytes(path),
            last_block: Mutex::new(None),
            raw: RwLock::new(raw),
        };
        Ok((device, created))
    }

    /// Opens the block device at `path` for the log, exclusively (O_EXCL: refused while it is
    /// mounted or another program holds it so), with O_DIRECT in its logical sectors; the
    /// replay map goes to `map_path`. Returns the device, its size, and what its first bytes
    /// (up to `look_bytes`) hold. The caller decides how much of it the log takes
    /// (`take_device_bytes`) and makes a new log there (`zero_device_bytes`).
    pub fn open_block_device(
        path: &Path,
        map_path: PathBuf,
        look_bytes: usize,
    ) -> SysResult<(FileLogDevice, u64, BlockDeviceContents)> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_EXCL)
            .open(path)
            .map_err(Errno::from)?;
        let mut size: u64 = 0;
        // SAFETY: the ioctl reads or writes one value of the type its request is defined with, a
        // live value borrowed for the call.
        check(unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) })?;
        let mut sector: libc::c_int = 0;
        // SAFETY: the ioctl reads or writes one value of the type its request is defined with, a
        // live value borrowed for the call.
        check(unsafe { libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut sector) })?;
        let block_bytes = sector as usize;
        assert!(block_bytes.is_power_of_two() && (512..=4096).contains(&block_bytes), "a sector of {block_bytes}");
        let device = FileLogDevice {
            file,
            path: path.to_path_buf(),
            block_bytes,
            direct: true,
            invisible: false,
            device_bytes: Some(size),
            map_path,
            through_page_cache: None,
            fs_block_bytes: 4096,
            last_block: Mutex::new(None),
            raw: RwLock::new(None),
        };
        let start = device.read_at(0, look_bytes.min(size as usize))?;
        let contents =
            if start.iter().all(|&b| b == 0) { BlockDeviceContents::Zeros } else { BlockDeviceContents::Bytes(start) };
        Ok((device, size, contents))
    }

    /// A block device's log takes its first `bytes` (at most the device).
    pub fn take_device_bytes(&mut self, bytes: u64) {
        let size = self.device_bytes.expect("a block device");
        assert!(bytes <= size && bytes % self.block_bytes as u64 == 0, "{bytes} bytes of a {size}-byte device");
        self.device_bytes = Some(bytes);
    }

    /// Zeros the log's bytes of a block device, durably: a new log's area holds no batch.
    pub fn zero_device_bytes(&self) -> SysResult<()> {
        let size = self.device_bytes.expect("a block device");
        let zeros = AlignedScratch::copy_of(&vec![0u8; 1 << 20], 4096);
        let mut at = 0u64;
        while at < size {
            let n = (1u64 << 20).min(size - at) as usize;
            sys::pwrite_all(self.file.as_raw_fd(), zeros.as_slice(n), at)?;
            at += n as u64;
        }
        self.sync()
    }

    fn map_path(&self) -> PathBuf {
        self.map_path.clone()
    }
}

/// Where the replay map of the log file `log` lives: beside it.
pub fn replay_map_path(log: &Path) -> PathBuf {
    let mut path = log.as_os_str().to_owned();
    path.push(".replay-map");
    path.into()
}

/// Whether `path` is a block device (following symlinks, as /dev/disk/by-id/... are).
pub fn is_block_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// ioctl(2) requests of linux/fs.h: the device's size in bytes, and its logical sector size.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

/// The file's direct-I/O offset alignment (statx STATX_DIOALIGN: the device's logical block
/// where the file system takes direct I/O at that granularity), between 512 B and 4 KiB.
fn direct_io_alignment(file: &File) -> Option<usize> {
    // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes are
    // a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let ret =
        // SAFETY: `statx` writes one value of the type its out-pointer has, into a live local
        // borrowed exclusively for the call; any C string passed is NUL-terminated.
        unsafe { libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &raw mut stx) };
    if ret != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    let align = stx.stx_dio_offset_align as usize;
    (align.is_power_of_two() && (512..=4096).contains(&align)).then_some(align)
}

/// xfs_fsop_handlereq of xfs_fs.h, for XFS_IOC_FD_TO_HANDLE and XFS_IOC_OPEN_BY_HANDLE.
#[repr(C)]
struct XfsHandleRequest {
    fd: u32,
    path: *mut libc::c_void,
    oflags: u32,
    ihandle: *mut libc::c_void,
    ihandlen: u32,
    ohandle: *mut libc::c_void,
    ohandlen: *mut u32,
}

const XFS_SUPER_MAGIC: libc::c_long = 0x5846_5342;
/// _IOWR('X', 106 and 107, struct xfs_fsop_handlereq).
const XFS_IOC_FD_TO_HANDLE: libc::c_ulong = 0xC000_586A | ((size_of::<XfsHandleRequest>() as libc::c_ulong) << 16);
const XFS_IOC_OPEN_BY_HANDLE: libc::c_ulong = 0xC000_586B | ((size_of::<XfsHandleRequest>() as libc::c_ulong) << 16);

/// `file` opened again with `flags` through its XFS handle, where the kernel marks a regular
/// file so opened FMODE_NOCMTIME: its writes update no mtime or ctime, so a log commit dirties
/// no inode and costs the backing file system no journal commit at the next `sync`. None on
/// any other file system, without CAP_SYS_ADMIN, or on any refusal: the plain file serves.
fn open_without_time_updates(file: &File, dir: &Path, flags: i32) -> Option<File> {
    // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes are
    // a valid value.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fstatfs` writes one value of the type its out-pointer has, into a live local
    // borrowed exclusively for the call; any C string passed is NUL-terminated.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &raw mut fs) } != 0 || fs.f_type as libc::c_long != XFS_SUPER_MAGIC {
        return None;
    }
    // XFS takes handle requests on a directory of the file system only.
    let dir = File::open(dir).ok()?;
    let mut handle = [0u8; 64];
    let mut handle_len = handle.len() as u32;
    let mut request = XfsHandleRequest {
        fd: file.as_raw_fd() as u32,
        path: std::ptr::null_mut(),
        oflags: 0,
        ihandle: std::ptr::null_mut(),
        ihandlen: 0,
        ohandle: handle.as_mut_ptr().cast(),
        ohandlen: &raw mut handle_len,
    };
    // SAFETY: XFS reads `request` (xfs_fsop_handlereq_t's layout) and writes at most
    // `handle_len` (64) bytes into `handle` and the length into `handle_len`, all live locals.
    if unsafe { libc::ioctl(dir.as_raw_fd(), XFS_IOC_FD_TO_HANDLE, &mut request) } != 0 {
        log::debug!("the log file's XFS handle: {}", Errno::last());
        return None;
    }
    // xfs_handle_t is 24 bytes; the kernel copies out whatever it made, so a longer one would
    // say this is not the XFS this code knows: the plain file serves.
    if handle_len as usize > handle.len() {
        log::warn!("an XFS handle of {handle_len} bytes; the log keeps its own descriptor");
        return None;
    }
    let mut request = XfsHandleRequest {
        fd: 0,
        path: std::ptr::null_mut(),
        oflags: flags as u32,
        ihandle: handle.as_mut_ptr().cast(),
        ihandlen: handle_len,
        ohandle: std::ptr::null_mut(),
        ohandlen: std::ptr::null_mut(),
    };
    // SAFETY: XFS reads `request` and `handle_len <= handle.len()` bytes of `handle`, live
    // locals; it writes nothing of ours.
    let opened = unsafe { libc::ioctl(dir.as_raw_fd(), XFS_IOC_OPEN_BY_HANDLE, &mut request) };
    if opened < 0 {
        log::info!("the log file opened by its XFS handle: {}; its writes update its mtime", Errno::last());
        return None;
    }
    // SAFETY: XFS_IOC_OPEN_BY_HANDLE returned a new open descriptor, owned by nothing else.
    let reopened = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(opened) };
    let identity = |f: &File| sys::fstat_fd(f).ok().map(|st| (st.st_dev, st.st_ino));
    if identity(&reopened).is_none() || identity(&reopened) != identity(file) {
        log::warn!("the log file's XFS handle opened another file; the log keeps its own descriptor");
        return None;
    }
    Some(reopened)
}

/// The block size of the file system holding `path` (4 KiB when it cannot say).
fn fs_block_bytes(path: &Path) -> u64 {
    match std::fs::metadata(path) {
        Ok(m) if (m.blksize() as usize).is_power_of_two() && m.blksize() >= 512 => m.blksize(),
        _ => 4096,
    }
}

impl FileLogDevice {
    /// Notes a write that succeeded (`Some(bytes)` at `offset`) or failed (`None`: what the
    /// file holds there is unknown).
    /// Only where writes may go through the page cache: `last_block` serves nothing else, and
    /// remembering costs a copy per commit.
    fn remember_write(&self, offset: u64, bytes: Option<&[u8]>) {
        if self.through_page_cache.is_none() {
            return;
        }
        let mut last = self.last_block.lock().unwrap();
        let Some(bytes) = bytes else {
            *last = None;
            return;
        };
        let end = offset + bytes.len() as u64;
        let start = (end - 1) / self.fs_block_bytes * self.fs_block_bytes;
        *last = if offset <= start {
            Some(LastBlock { start, bytes: bytes[(start - offset) as usize..].to_vec() })
        } else {
            match last.take() {
                Some(mut l) if l.start == start && l.start + l.bytes.len() as u64 == offset => {
                    l.bytes.extend_from_slice(bytes);
                    Some(l)
                }
                _ => None,
            }
        };
    }

    /// `bytes` at `offset`, widened to whole file-system blocks where what comes before them
    /// in their first block is known, and what comes after them up to the block's end is free
    /// (`free_after` bytes are): zeros there (a reader ends the log at the first block that is
    /// not a batch). Never over the oldest batches of a ring that is nearly full.
    fn widened_to_fs_blocks(&self, offset: u64, bytes: &[u8], free_after: u64) -> Option<(u64, Vec<u8>)> {
        let block = self.fs_block_bytes;
        let start = offset / block * block;
        let end = offset + bytes.len() as u64;
        let padded_end = end.div_ceil(block) * block;
        if padded_end - end > free_after {
            return None;
        }
        // `free_after` ends at the ring's area, and the area inside the file: no size check
        // (an fstat) per batch is needed.
        debug_assert!(self.size_bytes().is_ok_and(|size| padded_end <= size), "padding past the log's end");
        let last = self.last_block.lock().unwrap();
        let before: &[u8] = if start == offset {
            &[]
        } else {
            match &*last {
                Some(l) if l.start == start && l.start + l.bytes.len() as u64 == offset => &l.bytes,
                _ => return None,
            }
        };
        let mut widened = Vec::with_capacity((padded_end - start) as usize);
        widened.extend_from_slice(before);
        widened.extend_from_slice(bytes);
        widened.resize((padded_end - start) as usize, 0);
        Some((start, widened))
    }
}

fn sync_parent(path: &Path) -> SysResult<()> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let dir = File::open(dir).map_err(Errno::from)?;
    // SAFETY: `fsync` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    check(unsafe { libc::fsync(dir.as_raw_fd()) }).map(drop)
}

impl LogDevice for FileLogDevice {
    fn size_bytes(&self) -> SysResult<u64> {
        match self.device_bytes {
            Some(bytes) => Ok(bytes),
            None => Ok(sys::fstat_fd(&self.file)?.st_size as u64),
        }
    }

    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> SysResult<()> {
        assert!(!bytes.is_empty() && bytes.len() % self.block_bytes == 0, "whole log blocks: {}", bytes.len());
        assert!(offset % self.block_bytes as u64 == 0, "a log write at {offset}, not a block boundary");
        // Raw writes are direct too (`RawBlocks::set_up` only where the file takes O_DIRECT).
        let result = if self.direct {
            let aligned = AlignedScratch::copy_of(bytes, self.block_bytes.max(4096));
            let aligned = aligned.as_slice(bytes.len());
            match &*self.raw.read().unwrap() {
                Some(raw) => raw.write(offset, aligned),
                None => sys::pwrite_all(self.file.as_raw_fd(), aligned, offset),
            }
        } else {
            sys::pwrite_all(self.file.as_raw_fd(), bytes, offset)
        };
        self.remember_write(offset, result.is_ok().then_some(bytes));
        result
    }

    fn writes_through_page_cache(&self) -> bool {
        self.through_page_cache.is_some()
    }

    fn write_unflushed_at(&self, offset: u64, bytes: &[u8], free_after: u64) -> SysResult<()> {
        let Some(file) = &self.through_page_cache else {
            return self.write_at(offset, bytes);
        };
        let result = match self.widened_to_fs_blocks(offset, bytes, free_after) {
            Some((start, widened)) => sys::pwrite_all(file.as_raw_fd(), &widened, start),
            None => sys::pwrite_all(file.as_raw_fd(), bytes, offset),
        };
        self.remember_write(offset, result.is_ok().then_some(bytes));
        result
    }

    fn write_back(&self) -> SysResult<()> {
        let Some(file) = &self.through_page_cache else { return Ok(()) };
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: `sync_file_range` takes only integers (a descriptor and plain values) and
        // touches none of our memory; a bad descriptor is an error return.
        check(unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, flags) }).map(drop)
    }

    /// Data only: the file's size and allocation never change after creation (and when its
    /// blocks are written on the device, its inode does not either: a device flush alone).
    fn sync(&self) -> SysResult<()> {
        // SAFETY: `fdatasync` takes only integers (a descriptor and plain values) and touches none
        // of our memory; a bad descriptor is an error return.
        check(unsafe { libc::fdatasync(self.file.as_raw_fd()) }).map(drop)
    }

    /// Recovery reads it once at mount. A file opened with O_DIRECT is read so too, from its
    /// blocks: a page another reader cached while a daemon wrote them on the device is stale.
    fn read_at(&self, offset: u64, len: usize) -> SysResult<Vec<u8>> {
        let len = match self.device_bytes {
            Some(bytes) => len.min(bytes.saturating_sub(offset) as usize),
            None => len,
        };
        if self.direct && self.device_bytes.is_none() {
            let align = self.block_bytes as u64;
            let start = offset / align * align;
            let end = (offset + len as u64).div_ceil(align) * align;
            let mut buf = AlignedScratch::zeroed((end - start) as usize, 4096);
            let direct = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&self.path);
            let direct = direct.map_err(Errno::from)?;
            let n = sys::pread_full(direct.as_raw_fd(), buf.bytes_mut(), start)?;
            let from = (offset - start) as usize;
            let to = (from + len).min(n.max(from));
            return Ok(buf.bytes()[from..to].to_vec());
        }
        let mut buf = vec![0u8; len];
        let plain = File::open(&self.path).map_err(Errno::from)?;
        let n = sys::pread_full(plain.as_raw_fd(), &mut buf, offset)?;
        buf.truncate(n);
        Ok(buf)
    }

    fn read_into(&self, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
        let align = self.block_bytes;
        let direct_fits = offset % align as u64 == 0 && buf.len() % align == 0 && buf.as_ptr() as usize % 4096 == 0;
        if !(self.direct && self.device_bytes.is_none() && direct_fits) {
            return read_into_through_read_at(self, offset, buf);
        }
        let direct = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&self.path);
        let direct = direct.map_err(Errno::from)?;
        sys::pread_full(direct.as_raw_fd(), buf, offset)
    }

    fn describe(&self) -> String {
        match &*self.raw.read().unwrap() {
            Some(raw) => format!("{} (its blocks on {})", self.path.display(), raw.describe()),
            None => self.path.display().to_string(),
        }
    }

    fn flushed_by_sync(&self) -> bool {
        self.device_bytes.is_none() && !self.invisible
    }

    fn read_map(&self) -> SysResult<Vec<u8>> {
        match std::fs::read(self.map_path()) {
            Ok(bytes) => Ok(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(Errno::from(e)),
        }
    }

    fn append_map_synced(&self, bytes: &[u8]) -> SysResult<()> {
        use std::io::Write;
        let path = self.map_path();
        let existed = path.exists();
        let mut file = OpenOptions::new().create(true).append(true).open(&path).map_err(Errno::from)?;
        if !existed {
            // Its name must survive a power cut as its entries will.
            sync_parent(&path)?;
        }
        file.write_all(bytes).map_err(Errno::from)?;
        // SAFETY: `fdatasync` takes only integers (a descriptor and plain values) and touches none
        // of our memory; a bad descriptor is an error return.
        check(unsafe { libc::fdatasync(file.as_raw_fd()) }).map(drop)
    }

    fn remove_map(&self) -> SysResult<()> {
        match std::fs::remove_file(self.map_path()) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Errno::from(e)),
        }
    }

    fn release(&self) {
        // Dropped: the immutable flag goes (`RawBlocks::drop`).
        self.raw.write().unwrap().take();
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
    // SAFETY: `fsync` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    check(unsafe { libc::fsync(file.as_raw_fd()) }).map(drop)
}

impl<D: LogDevice + ?Sized> LogDevice for std::sync::Arc<D> {
    fn size_bytes(&self) -> SysResult<u64> {
        (**self).size_bytes()
    }
    fn block_bytes(&self) -> usize {
        (**self).block_bytes()
    }
    fn write_at(&self, offset: u64, bytes: &[u8]) -> SysResult<()> {
        (**self).write_at(offset, bytes)
    }
    fn write_unflushed_at(&self, offset: u64, bytes: &[u8], free_after: u64) -> SysResult<()> {
        (**self).write_unflushed_at(offset, bytes, free_after)
    }
    fn sync(&self) -> SysResult<()> {
        (**self).sync()
    }
    fn read_at(&self, offset: u64, len: usize) -> SysResult<Vec<u8>> {
        (**self).read_at(offset, len)
    }
    fn read_into(&self, offset: u64, buf: &mut [u8]) -> SysResult<usize> {
        (**self).read_into(offset, buf)
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn flushed_by_sync(&self) -> bool {
        (**self).flushed_by_sync()
    }
    fn read_map(&self) -> SysResult<Vec<u8>> {
        (**self).read_map()
    }
    fn append_map_synced(&self, bytes: &[u8]) -> SysResult<()> {
        (**self).append_map_synced(bytes)
    }
    fn remove_map(&self) -> SysResult<()> {
        (**self).remove_map()
    }
}

#[cfg(test)]
#[path = "device_tests.rs"]
mod tests;
