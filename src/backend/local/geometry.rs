//! Unit geometry: the unit size U the backend wants, and the logical block size below it.
//!
//! Unit k of a file covers bytes [k*U, (k+1)*U), whatever offset the first write had. U is a
//! power of two from 4 KiB to 64 MiB: `-o unit=` when given, else discovered from the backing
//! device, else 1 MiB.
//!
//! Discovery reads the block device under the backing directory (a partition resolved to its
//! disk, a loop device to the device holding its backing file): `optimal_io_size`, then
//! `minimum_io_size`, then the directory's `st_blksize`. Only a value above one page counts as
//! discovered: every disk reports 512 or 4096 as its minimum, which says nothing about a
//! preferred large write, and units of one page would leave nothing to coalesce.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub use crate::backend::UnitSource;

pub const UNIT_BYTES_MIN: u64 = 4 << 10;
pub const UNIT_BYTES_MAX: u64 = 64 << 20;
pub const UNIT_BYTES_DEFAULT: u64 = 1 << 20;
const PAGE_BYTES: u64 = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    pub unit_bytes: u64,
    pub unit_source: UnitSource,
    /// The device's logical block size: the alignment O_DIRECT needs (512 when unknown).
    pub logical_block_bytes: u64,
}

pub fn check_unit_bytes(unit_bytes: u64) -> Result<u64, String> {
    if !unit_bytes.is_power_of_two() || !(UNIT_BYTES_MIN..=UNIT_BYTES_MAX).contains(&unit_bytes) {
        return Err(format!("unit={unit_bytes}: must be a power of two from 4K to 64M"));
    }
    Ok(unit_bytes)
}

/// Facts about one block device, as sysfs gives them.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DeviceQueue {
    pub name: String,
    pub optimal_io_bytes: u64,
    pub minimum_io_bytes: u64,
    pub logical_block_bytes: u64,
}

/// The pure decision, separate from sysfs so that it can be tested on any machine.
pub fn choose(option_unit_bytes: Option<u64>, queue: Option<&DeviceQueue>, st_blksize: u64) -> Geometry {
    let logical_block_bytes = queue.map(|q| q.logical_block_bytes).filter(|&b| b >= 512).unwrap_or(512);
    let usable = |bytes: u64| bytes > PAGE_BYTES && bytes.is_power_of_two() && bytes <= UNIT_BYTES_MAX;
    if let Some(unit_bytes) = option_unit_bytes {
        return Geometry { unit_bytes, unit_source: UnitSource::Option, logical_block_bytes };
    }
    if let Some(q) = queue {
        for (bytes, attribute) in [(q.optimal_io_bytes, "optimal_io_size"), (q.minimum_io_bytes, "minimum_io_size")] {
            if usable(bytes) {
                let unit_source = UnitSource::Device { device: q.name.clone(), attribute };
                return Geometry { unit_bytes: bytes, unit_source, logical_block_bytes };
            }
        }
    }
    if usable(st_blksize) {
        let unit_source = UnitSource::Device { device: "backing directory".into(), attribute: "st_blksize" };
        return Geometry { unit_bytes: st_blksize, unit_source, logical_block_bytes };
    }
    Geometry { unit_bytes: UNIT_BYTES_DEFAULT, unit_source: UnitSource::Default, logical_block_bytes }
}

fn read_number(path: &Path) -> u64 {
    std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// The sysfs directory of the whole disk behind a device number, following a partition to
/// its disk and a loop device to the device of its backing file (at most a few hops).
fn disk_dir_of(mut dev: u64) -> Option<PathBuf> {
    for _ in 0..4 {
        let link = PathBuf::from(format!("/sys/dev/block/{}:{}", libc::major(dev), libc::minor(dev)));
        let mut dir = std::fs::canonicalize(link).ok()?;
        if dir.join("partition").exists() {
            dir = dir.parent()?.to_path_buf();
        }
        let backing_file = dir.join("loop/backing_file");
        if let Ok(file) = std::fs::read_to_string(&backing_file) {
            dev = std::fs::metadata(file.trim()).ok()?.dev();
            continue;
        }
        return Some(dir);
    }
    None
}

/// The unit hints come from the device at the end of the chain (a loop device says nothing of
/// its own), the logical block size from the device right under the file system: that is
/// the alignment O_DIRECT on the backing files must meet.
pub fn device_queue_of(dev: u64) -> Option<DeviceQueue> {
    let dir = disk_dir_of(dev)?;
    let queue = dir.join("queue");
    let immediate = std::fs::canonicalize(format!("/sys/dev/block/{}:{}", libc::major(dev), libc::minor(dev))).ok();
    let immediate_queue =
        immediate.map(|d| if d.join("partition").exists() { d.join("../queue") } else { d.join("queue") });
    let logical_block_bytes = read_number(&queue.join("logical_block_size"))
        .max(immediate_queue.map(|q| read_number(&q.join("logical_block_size"))).unwrap_or(0));
    Some(DeviceQueue {
        name: dir.file_name()?.to_string_lossy().into_owned(),
        optimal_io_bytes: read_number(&queue.join("optimal_io_size")),
        minimum_io_bytes: read_number(&queue.join("minimum_io_size")),
        logical_block_bytes,
    })
}

pub fn discover(backing_dir: &Path, option_unit_bytes: Option<u64>) -> Geometry {
    let meta = std::fs::metadata(backing_dir).ok();
    let queue = meta.as_ref().and_then(|m| device_queue_of(m.dev()));
    choose(option_unit_bytes, queue.as_ref(), meta.map(|m| m.blksize()).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(optimal: u64, minimum: u64, logical: u64) -> DeviceQueue {
        DeviceQueue {
            name: "sdz".into(),
            optimal_io_bytes: optimal,
            minimum_io_bytes: minimum,
            logical_block_bytes: logical,
        }
    }

    #[test]
    fn the_option_wins() {
        let g = choose(Some(4 << 20), Some(&queue(1 << 20, 4096, 4096)), 4096);
        assert_eq!((g.unit_bytes, g.unit_source, g.logical_block_bytes), (4 << 20, UnitSource::Option, 4096));
    }

    #[test]
    fn optimal_then_minimum_io_size() {
        assert_eq!(choose(None, Some(&queue(4 << 20, 64 << 10, 512)), 4096).unit_bytes, 4 << 20);
        let g = choose(None, Some(&queue(0, 64 << 10, 512)), 4096);
        assert_eq!(g.unit_bytes, 64 << 10);
        assert_eq!(g.unit_source, UnitSource::Device { device: "sdz".into(), attribute: "minimum_io_size" });
    }

    #[test]
    fn page_sized_hints_fall_back_to_the_default() {
        let g = choose(None, Some(&queue(0, 4096, 512)), 4096);
        assert_eq!((g.unit_bytes, g.unit_source), (UNIT_BYTES_DEFAULT, UnitSource::Default));
        assert_eq!(g.logical_block_bytes, 512);
        // A striped device reporting a non-power-of-two stripe is not a unit either.
        assert_eq!(choose(None, Some(&queue(3 << 20, 4096, 512)), 4096).unit_bytes, UNIT_BYTES_DEFAULT);
    }

    #[test]
    fn large_st_blksize_counts_without_a_device() {
        assert_eq!(choose(None, None, 128 << 10).unit_bytes, 128 << 10);
        assert_eq!(choose(None, None, 0).unit_bytes, UNIT_BYTES_DEFAULT);
    }

    #[test]
    fn unit_option_bounds() {
        assert!(check_unit_bytes(4096).is_ok());
        assert!(check_unit_bytes(64 << 20).is_ok());
        assert!(check_unit_bytes(2048).is_err());
        assert!(check_unit_bytes(128 << 20).is_err());
        assert!(check_unit_bytes(3 << 20).is_err());
    }

    #[test]
    fn this_machines_root_device_resolves() {
        // Whatever the root file system sits on, discovery must give a valid unit.
        let g = discover(Path::new("/"), None);
        assert!(check_unit_bytes(g.unit_bytes).is_ok(), "{g:?}");
        assert!(g.logical_block_bytes.is_power_of_two());
    }
}
