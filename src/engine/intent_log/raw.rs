//! The log file's own blocks, written on the block device under it (`log_raw=auto`, the default).
//!
//! Why: every write(2) of a file, O_DIRECT too, updates its mtime, and ext4 journals the dirty
//! inode at the next commit: a log commit that should cost its sectors costs a journal
//! transaction as well the next time anyone runs `sync` (4 KiB of inode block plus the
//! journal's descriptor and commit blocks; 20 KiB on a 4Kn disk). Linux gives open(2) no
//! O_NOCMTIME; XFS's handle open does (see `device::open_without_time_updates`), ext4 has none.
//! The file was preallocated and written through once, so its blocks never move while nobody
//! moves them: written at their place on the device, they are the file's bytes, and no inode
//! changes.
//!
//! What keeps that true, each checked before the first write and refused otherwise (the log
//! then writes through the file, as before):
//! - ext4, not `data=journal` or DAX, the file not journaled, inline, encrypted or verity;
//! - every byte of the file in a written extent (FIEMAP: not unwritten, delayed, shared,
//!   encoded, inline, unknown), aligned to the device's logical block;
//! - the device the file system reports (`st_dev`) opened for writing (the kernel may refuse
//!   writes to a mounted device: `bdev_allow_write_mounted=0`);
//! - the mapping proven: bytes written through the file read back the same through the device;
//! - the file immutable while the daemon writes it (FS_IMMUTABLE_FL: e4defrag's extent moves,
//!   truncation, fallocate and unlink are refused), the flag cleared when the log closes, and by
//!   the next open or `coalescefs forget` after a daemon that died.
//!
//! The device's volatile cache is flushed as for the file: an fdatasync of the file, whose
//! inode then has nothing to commit, is one device flush and nothing else (ext4_sync_file sends
//! the flush when the inode's last transaction has committed), and `sync(1)` flushes the device
//! ext4 is on (ext4_sync_fs). (An fdatasync of the device itself would also write back every
//! dirty metadata buffer ext4 keeps in the device's page cache.) Reads go through the file with
//! O_DIRECT: the same blocks.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::device::AlignedScratch;
use crate::sys::{self, check, Errno, SysResult};

/// `log_raw=auto|off`: whether the log file's blocks may be written on its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawLog {
    Auto,
    Off,
}

/// The log file's blocks on its device, proven (see the module's comment).
pub struct RawBlocks {
    device: File,
    device_path: PathBuf,
    /// Sorted, adjacent, covering the file from byte 0 to its size.
    extents: Vec<Extent>,
    /// The file, for clearing the immutable flag when the log closes.
    file: File,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Extent {
    logical: u64,
    physical: u64,
    len: u64,
}

const EXT4_SUPER_MAGIC: libc::c_long = 0xEF53;
/// ioctl(2) requests of linux/fs.h.
const FS_IOC_GETFLAGS: libc::c_ulong = 0x8008_6601;
const FS_IOC_SETFLAGS: libc::c_ulong = 0x4008_6602;
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const BLKSSZGET: libc::c_ulong = 0x1268;
const FS_IMMUTABLE_FL: libc::c_int = 0x10;
/// Flags under which the file's bytes are not simply its blocks: encrypted, journaled data,
/// DAX, inline data, verity, casefold does not matter.
const FS_BLOCKS_ARE_NOT_BYTES: libc::c_int = 0x800 | 0x4000 | 0x0200_0000 | 0x1000_0000 | 0x0010_0000;
const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_MERGED: u32 = 0x1000;
/// The most extents a log file may have (a preallocated 64 MiB file has one or two); one with
/// more is written through the file, as where any other check refuses.
const MAX_EXTENTS: usize = 64;

#[repr(C)]
#[derive(Clone, Copy)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

#[repr(C)]
struct Fiemap {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [FiemapExtent; MAX_EXTENTS],
}

impl RawBlocks {
    /// Sets the log file `file` (at `path`, `size` bytes, written in `block_bytes` blocks) up
    /// for writes on its device, or says why not. `file` is open O_RDWR|O_DIRECT.
    pub fn set_up(file: &File, path: &Path, size: u64, block_bytes: usize) -> Result<RawBlocks, String> {
        // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes
        // are a valid value.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `fstatfs` writes one value of the type its out-pointer has, into a live local
        // borrowed exclusively for the call; any C string passed is NUL-terminated.
        check(unsafe { libc::fstatfs(file.as_raw_fd(), &raw mut fs) }).map_err(|e| format!("statfs: {e}"))?;
        if fs.f_type as libc::c_long != EXT4_SUPER_MAGIC {
            return Err("not on ext4".into());
        }
        let st = sys::fstat_fd(file).map_err(|e| format!("stat: {e}"))?;
        let (major, minor) = (libc::major(st.st_dev), libc::minor(st.st_dev));
        if let Some(option) = super_options(major, minor)
            .map_err(|e| format!("/proc/self/mountinfo: {e}"))?
            .into_iter()
            .find(|o| o == "data=journal" || o.starts_with("dax"))
        {
            return Err(format!("its file system is mounted {option}"));
        }
        let flags = inode_flags(file).map_err(|e| format!("its inode flags: {e}"))?;
        if flags & FS_BLOCKS_ARE_NOT_BYTES != 0 {
            return Err(format!("its inode flags {flags:#x} say its blocks are not its bytes"));
        }
        let device_path = device_node(major, minor)?;
        let device = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(&device_path)
            .map_err(|e| format!("{} for writing: {e}", device_path.display()))?;
        let mut sector: libc::c_int = 0;
        // SAFETY: the ioctl reads or writes one value of the type its request is defined with, a
        // live value borrowed for the call.
        check(unsafe { libc::ioctl(device.as_raw_fd(), BLKSSZGET, &mut sector) })
            .map_err(|e| format!("{}: its sector size: {e}", device_path.display()))?;
        if sector <= 0 || block_bytes % sector as usize != 0 {
            return Err(format!("log blocks of {block_bytes} bytes on sectors of {sector}"));
        }
        // No page of the file may be written back over the device's blocks later, nor read
        // instead of them.
        // SAFETY: `fdatasync` takes only integers (a descriptor and plain values) and touches none
        // of our memory; a bad descriptor is an error return.
        check(unsafe { libc::fdatasync(file.as_raw_fd()) }).map_err(|e| format!("fdatasync: {e}"))?;
        // SAFETY: `posix_fadvise` takes only integers (a descriptor and plain values) and touches
        // none of our memory; a bad descriptor is an error return.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let extents = file_extents(file, size, block_bytes)?;
        let plain = File::open(path).map_err(|e| format!("reopen: {e}"))?;
        let raw = RawBlocks { device, device_path, extents, file: plain };
        raw.prove(file, block_bytes)?;
        set_immutable(&raw.file, true).map_err(|e| format!("making it immutable: {e}"))?;
        // Pinned now: the extents proven must be the extents it has.
        let now = file_extents(file, size, block_bytes);
        if now.as_ref().is_ok_and(|now| *now == raw.extents) {
            return Ok(raw);
        }
        // Dropped: the flag goes (`RawBlocks::drop`).
        Err(now.err().unwrap_or_else(|| "its extents moved while it was set up".into()))
    }

    /// Proves the mapping: bytes written through the file at the start of its first block read
    /// back the same from the device. Where the block holds zeros (a new log) a marker is
    /// written and the zeros put back; elsewhere its bytes (the log's superblock) are compared.
    fn prove(&self, file: &File, block_bytes: usize) -> Result<(), String> {
        let len = block_bytes.max(4096);
        let mut through_file = AlignedScratch::zeroed(len, 4096);
        let n = sys::pread_full(file.as_raw_fd(), through_file.bytes_mut(), 0)
            .map_err(|e| format!("reading its first block: {e}"))?;
        if n != len {
            return Err(format!("a log of fewer than {len} bytes"));
        }
        let expected = if through_file.bytes().iter().all(|&b| b == 0) {
            let mut marker = AlignedScratch::zeroed(len, 4096);
            let stamp = format!("coalescefs raw log probe {:?} {}", std::time::SystemTime::now(), std::process::id());
            marker.bytes_mut()[..stamp.len()].copy_from_slice(stamp.as_bytes());
            let written = sys::pwrite_all(file.as_raw_fd(), marker.bytes(), 0)
                // SAFETY: `fdatasync` takes only integers (a descriptor and plain values) and
                // touches none of our memory; a bad descriptor is an error return.
                .and_then(|()| check(unsafe { libc::fdatasync(file.as_raw_fd()) }).map(drop));
            let read = written.and_then(|()| self.read_device(0, len));
            let restored = sys::pwrite_all(file.as_raw_fd(), through_file.bytes(), 0)
                // SAFETY: `fdatasync` takes only integers (a descriptor and plain values) and
                // touches none of our memory; a bad descriptor is an error return.
                .and_then(|()| check(unsafe { libc::fdatasync(file.as_raw_fd()) }).map(drop));
            restored.map_err(|e| format!("putting its first block back: {e}"))?;
            let read = read.map_err(|e| format!("the probe: {e}"))?;
            return if read == marker.bytes() {
                Ok(())
            } else {
                Err("bytes written through the file are not where its extents say on the device".into())
            };
        } else {
            through_file.bytes().to_vec()
        };
        match self.read_device(0, len) {
            Ok(read) if read == expected => Ok(()),
            Ok(_) => Err("its first block on the device is not what the file holds".into()),
            Err(e) => Err(format!("reading its first block on the device: {e}")),
        }
    }

    fn read_device(&self, offset: u64, len: usize) -> SysResult<Vec<u8>> {
        let mut out = Vec::with_capacity(len);
        for (physical, range) in self.pieces(offset, len as u64) {
            let mut buf = AlignedScratch::zeroed((range.end - range.start) as usize, 4096);
            let n = sys::pread_full(self.device.as_raw_fd(), buf.bytes_mut(), physical)?;
            if n != buf.bytes().len() {
                return Err(Errno(libc::EIO));
            }
            out.extend_from_slice(buf.bytes());
        }
        Ok(out)
    }

    fn pieces(&self, offset: u64, len: u64) -> Vec<(u64, std::ops::Range<u64>)> {
        pieces(&self.extents, offset, len)
    }

    /// Writes `bytes` (aligned, whole blocks, in aligned memory) at the file's byte `offset`;
    /// durable after a flush of the device (see the module's comment).
    pub fn write(&self, offset: u64, bytes: &[u8]) -> SysResult<()> {
        for (physical, range) in self.pieces(offset, bytes.len() as u64) {
            let piece = &bytes[(range.start - offset) as usize..(range.end - offset) as usize];
            sys::pwrite_all(self.device.as_raw_fd(), piece, physical)?;
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        self.device_path.display().to_string()
    }
}

/// Whatever made it (set up, or refused part way), the file is not immutable once it goes
/// (`set_immutable` leaves a file without the flag alone).
impl Drop for RawBlocks {
    fn drop(&mut self) {
        if let Err(e) = set_immutable(&self.file, false) {
            log::warn!("the intent log file stays immutable ({e}): `chattr -i` it, or `coalescefs forget`");
        }
    }
}

fn inode_flags(file: &File) -> SysResult<libc::c_int> {
    let mut flags: libc::c_int = 0;
    // SAFETY: the ioctl reads or writes one value of the type its request is defined with, a live
    // value borrowed for the call.
    check(unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_GETFLAGS, &mut flags) })?;
    Ok(flags)
}

fn set_immutable(file: &File, on: bool) -> SysResult<()> {
    let flags = inode_flags(file)?;
    let wanted = if on { flags | FS_IMMUTABLE_FL } else { flags & !FS_IMMUTABLE_FL };
    if wanted != flags {
        // SAFETY: the ioctl reads or writes one value of the type its request is defined with, a
        // live value borrowed for the call.
        check(unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_SETFLAGS, &wanted) })?;
    }
    Ok(())
}

/// Where bytes `offset..offset+len` of a file with `extents` are on the device: (device
/// offset, range of the file's bytes), one per extent they cross. Bytes past the extents are a
/// bug of the caller's, not a write somewhere else.
fn pieces(extents: &[Extent], offset: u64, len: u64) -> Vec<(u64, std::ops::Range<u64>)> {
    let end = offset + len;
    let covered = extents.last().map_or(0, |e| e.logical + e.len);
    assert!(end <= covered, "log bytes {offset}..{end} past the file's {covered}");
    let mut pieces = Vec::new();
    let mut at = offset;
    for extent in extents {
        if at == end {
            break;
        }
        let extent_end = extent.logical + extent.len;
        if at >= extent_end {
            continue;
        }
        assert!(at >= extent.logical, "extents cover the file without gaps");
        let piece_end = end.min(extent_end);
        pieces.push((extent.physical + (at - extent.logical), at..piece_end));
        at = piece_end;
    }
    assert_eq!(at, end, "log bytes {offset}..{end} mapped whole");
    pieces
}

/// Clears the immutable flag a daemon that died left on the log file at `path` (a no-op when
/// it is not set, or there is no such file).
pub fn clear_immutable(path: &Path) -> SysResult<()> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Errno::from(e)),
    };
    match inode_flags(&file) {
        Ok(flags) if flags & FS_IMMUTABLE_FL != 0 => set_immutable(&file, false),
        // A file system without inode flags has no immutable flag set either.
        Ok(_) | Err(Errno(libc::ENOTTY | libc::EOPNOTSUPP)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The super options (the last field) of the mount of device `major:minor`, from mountinfo.
fn super_options(major: u32, minor: u32) -> std::io::Result<Vec<String>> {
    let wanted = format!("{major}:{minor}");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(mountinfo
        .lines()
        .filter(|line| line.split(' ').nth(2) == Some(wanted.as_str()))
        .flat_map(|line| line.rsplit(' ').next().unwrap_or("").split(',').map(str::to_string).collect::<Vec<_>>())
        .collect())
}

/// The block device node for `major:minor`: /dev/NAME, where sysfs names it.
fn device_node(major: u32, minor: u32) -> Result<PathBuf, String> {
    let uevent = format!("/sys/dev/block/{major}:{minor}/uevent");
    let text = std::fs::read_to_string(&uevent).map_err(|e| format!("{uevent}: {e} (not on a block device)"))?;
    let name = text
        .lines()
        .find_map(|line| line.strip_prefix("DEVNAME="))
        .ok_or_else(|| format!("{uevent} names no device"))?;
    let path = Path::new("/dev").join(name);
    let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let expected = libc::makedev(major, minor);
    if !meta.file_type().is_block_device() || meta.rdev() != expected {
        return Err(format!("{} is not the block device {major}:{minor}", path.display()));
    }
    Ok(path)
}

/// The file's extents, each written and aligned, covering it from 0 to `size` without gaps.
fn file_extents(file: &File, size: u64, block_bytes: usize) -> Result<Vec<Extent>, String> {
    // SAFETY: `Fiemap` is a `repr(C)` struct of integers and an array of integer structs, for
    // which all-zero bytes are a valid value.
    let mut map: Box<Fiemap> = Box::new(unsafe { std::mem::zeroed() });
    map.start = 0;
    map.length = size;
    map.flags = FIEMAP_FLAG_SYNC;
    map.extent_count = MAX_EXTENTS as u32;
    // SAFETY: FIEMAP reads the header of `map` and writes at most `extent_count` (MAX_EXTENTS)
    // extents into its array of that many; `map` is a live box borrowed for the call.
    check(unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, &mut *map) }).map_err(|e| format!("FIEMAP: {e}"))?;
    let count = map.mapped_extents as usize;
    if count == 0 || count > MAX_EXTENTS {
        return Err(format!("{count} extents"));
    }
    let block = block_bytes as u64;
    let mut extents = Vec::with_capacity(count);
    let mut next = 0u64;
    for e in &map.extents[..count] {
        if e.flags & !(FIEMAP_EXTENT_LAST | FIEMAP_EXTENT_MERGED) != 0 {
            return Err(format!("an extent with flags {:#x} (unwritten, shared, encoded or unknown)", e.flags));
        }
        if e.logical != next || e.logical % block != 0 || e.physical % block != 0 || e.length % block != 0 {
            return Err(format!(
                "an extent at {} ({} bytes at device byte {}) not adjacent or aligned",
                e.logical, e.length, e.physical
            ));
        }
        extents.push(Extent { logical: e.logical, physical: e.physical, len: e.length });
        next = e.logical + e.length;
    }
    if next < size {
        return Err(format!("extents cover {next} of its {size} bytes"));
    }
    Ok(extents)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXTENTS: [Extent; 2] =
        [Extent { logical: 0, physical: 1 << 30, len: 8192 }, Extent { logical: 8192, physical: 4096, len: 8192 }];

    #[test]
    fn a_write_within_one_extent_is_one_piece_at_its_device_offset() {
        assert_eq!(pieces(&EXTENTS, 512, 1024), vec![((1 << 30) + 512, 512..1536)]);
        assert_eq!(pieces(&EXTENTS, 12288, 4096), vec![(4096 + 4096, 12288..16384)]);
    }

    #[test]
    fn a_write_across_extents_is_split_at_their_boundary() {
        assert_eq!(pieces(&EXTENTS, 7680, 1024), vec![((1 << 30) + 7680, 7680..8192), (4096, 8192..8704)]);
    }

    #[test]
    #[should_panic(expected = "past the file's 16384")]
    fn a_write_past_the_extents_is_refused() {
        pieces(&EXTENTS, 16384 - 512, 1024);
    }
}
