//! Where a file holds data, and how much space it takes: SEEK_DATA and SEEK_HOLE answer what the
//! application wrote in every write path (the kernel's page cache on, off or chosen per file,
//! the intent log on and off), and `st_blocks` and `du` count what was written, not what the
//! backend holds ahead for files to come.

mod common;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use common::*;

/// The write paths an lseek can meet: which writes reach the daemon when, and which files the
/// intent log holds in memory until a checkpoint.
const WRITE_PATHS: &[&[&str]] = &[
    &[],
    &["writeback_cache=on"],
    &["writeback_cache=off"],
    &["log=off"],
    &["log=off", "writeback_cache=on"],
    &["log=off", "writeback_cache=off"],
];

fn seek(f: &File, offset: i64, whence: i32) -> Result<i64, i32> {
    let at = unsafe { libc::lseek(f.as_raw_fd(), offset, whence) };
    if at < 0 {
        Err(errno())
    } else {
        Ok(at)
    }
}

/// The data ranges SEEK_DATA and SEEK_HOLE give, walked from 0 as `cp --sparse` does.
fn data_ranges(f: &File) -> Vec<(u64, u64)> {
    let mut ranges = Vec::new();
    let mut at = 0;
    loop {
        let data = match seek(f, at, libc::SEEK_DATA) {
            Ok(data) => data,
            Err(libc::ENXIO) => return ranges,
            Err(e) => panic!("SEEK_DATA from {at}: errno {e}"),
        };
        let hole = seek(f, data, libc::SEEK_HOLE).unwrap_or_else(|e| panic!("SEEK_HOLE from {data}: errno {e}"));
        assert!(hole > data, "SEEK_HOLE from data at {data} answered {hole}: a walk would never end");
        ranges.push((data as u64, hole as u64));
        at = hole;
    }
}

/// Every byte of `written` lies in one of `ranges`.
fn covered(ranges: &[(u64, u64)], written: (u64, u64)) -> bool {
    ranges.iter().any(|&(from, to)| from <= written.0 && written.1 <= to)
}

/// The program: a sparse file written and sought in before its close, through the
/// descriptor that wrote it and through a second one of the same process.
fn check_seeks_see_unsent_writes(m: &TestMount, options: &[&str], name: &str) {
    let what = format!("{name} (options {options:?})");
    let f =
        OpenOptions::new().read(true).write(true).create(true).truncate(true).mode(0o644).open(m.path(name)).unwrap();
    f.set_len(8 << 20).unwrap();
    f.write_all_at(&[b'q'; 4096], 4 << 20).unwrap();
    assert_eq!(seek(&f, 0, libc::SEEK_DATA), Ok(4 << 20), "{what}: SEEK_DATA from 0 skipped or invented data");
    let second = File::open(m.path(name)).unwrap();
    assert_eq!(seek(&second, 0, libc::SEEK_DATA), Ok(4 << 20), "{what}: a second descriptor");
    let hole = seek(&f, 4 << 20, libc::SEEK_HOLE).unwrap();
    assert!((4 << 20) + 4096 <= hole && hole <= 8 << 20, "{what}: SEEK_HOLE after the data answered {hole}");

    // Past the size the backend knows of: a write that grew the file, still in the kernel.
    f.write_all_at(&[b'z'; 100], 9 << 20).unwrap();
    let ranges = data_ranges(&f);
    for written in [(4 << 20, (4 << 20) + 4096), (9 << 20, (9 << 20) + 100)] {
        assert!(covered(&ranges, written), "{what}: {written:?} written, the walk found {ranges:?}");
    }
    assert_eq!(ranges.last().unwrap().1, (9 << 20) + 100, "{what}: the last data ends at the file's end");
    assert_eq!(seek(&f, (9 << 20) + 100, libc::SEEK_DATA), Err(libc::ENXIO), "{what}: at the end");

    // A store into a shared mapping of a hole: a dirty page in every cache mode.
    let map_at = 2 << 20;
    unsafe {
        let page = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            map_at,
        );
        assert_ne!(page, libc::MAP_FAILED, "{what}: mmap: {}", std::io::Error::last_os_error());
        *(page as *mut u8).add(10) = b'm';
        assert_eq!(seek(&f, 0, libc::SEEK_DATA), Ok(map_at), "{what}: a store through a mapping");
        libc::munmap(page, 4096);
    }
    drop(second);
    drop(f);
    // And once closed, the same answers from the backend.
    let f = File::open(m.path(name)).unwrap();
    let ranges = data_ranges(&f);
    for written in [(map_at as u64, map_at as u64 + 11), (4 << 20, (4 << 20) + 4096), (9 << 20, (9 << 20) + 100)] {
        assert!(covered(&ranges, written), "{what}: after the close, {written:?} not in {ranges:?}");
    }
    assert_eq!(seek(&f, 0, libc::SEEK_DATA), Ok(map_at), "{what}: after the close");
}

#[test]
fn seek_data_and_seek_hole_see_writes_the_kernel_has_not_sent_in_every_write_path() {
    for options in WRITE_PATHS {
        let m = TestMount::with_options(options);
        check_seeks_see_unsent_writes(&m, options, "new");
        // A file that holds data on the backend already (`writeback_cache=auto` bypasses the
        // kernel's cache for its writers) and is written sparsely again.
        std::fs::write(m.path("old"), b"x").unwrap();
        m.sync_to_backend();
        check_seeks_see_unsent_writes(&m, options, "old");
    }
}

/// `du`'s figure for a path: the st_blocks of every file under it, in bytes.
fn allocated_bytes(path: &Path) -> u64 {
    let out = std::process::Command::new("du").args(["-s", "--block-size=1"]).arg(path).output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn a_sparse_file_takes_no_space_for_its_holes() {
    for options in [&[][..], &["log=off"][..]] {
        let m = TestMount::with_options(options);
        let f = File::create(m.path("sparse")).unwrap();
        f.set_len(10 << 30).unwrap();
        drop(f);
        assert_eq!(std::fs::metadata(m.path("sparse")).unwrap().blocks(), 0, "{options:?}: through the mount");
        assert_eq!(allocated_bytes(&m.backing_path("sparse")), 0, "{options:?}: on the backend");
        m.sync_to_backend();
        assert_eq!(allocated_bytes(&m.backing_path("sparse")), 0, "{options:?}: after a checkpoint");
    }
}
