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
    // SAFETY: lseek takes no pointers; `f` is open for the call.
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
    assert!(((4 << 20) + 4096..=8 << 20).contains(&hole), "{what}: SEEK_HOLE after the data answered {hole}");

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
    // SAFETY: one page of `f` (open read-write, 8 MiB long) mapped shared, checked against
    // MAP_FAILED before the store at offset 10 inside it, unmapped before `f` closes.
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

/// `check_seeks_see_unsent_writes` in each of `paths` over the mounts `mount` makes: on a new
/// file, then on one that holds data on the backend already (`writeback_cache=auto` bypasses
/// the kernel's cache for its writers) and is written sparsely again.
fn check_seeks_in(paths: &[&[&str]], mount: impl Fn(&[&str]) -> TestMount) {
    for options in paths {
        let m = mount(options);
        check_seeks_see_unsent_writes(&m, options, "new");
        std::fs::write(m.path("old"), b"x").unwrap();
        m.sync_to_backend();
        check_seeks_see_unsent_writes(&m, options, "old");
    }
}

#[test]
fn seek_data_and_seek_hole_see_writes_the_kernel_has_not_sent_in_every_write_path() {
    check_seeks_in(WRITE_PATHS, TestMount::with_options);
}

/// The same over a SQLite database, whose holes are units without a row: a seek sees what the
/// kernel, the write buffer and the intent log hold as well as the rows.
#[test]
fn over_sqlite_seek_data_and_seek_hole_see_writes_the_kernel_has_not_sent_in_every_write_path() {
    check_seeks_in(WRITE_PATHS, TestMount::over_sqlite);
}

/// And over S3 (a SeaweedFS server on 127.0.0.1), whose holes are units with neither an object
/// nor a piece: 1 MiB units (its smallest), so that the test's offsets fall on unit boundaries
/// (a seek answers a unit at a time). An S3 mount keeps its log on: the paths with it.
#[test]
fn over_s3_seek_data_and_seek_hole_see_writes_the_kernel_has_not_sent_in_every_write_path() {
    let test = "over_s3_seek_data_and_seek_hole_see_writes_the_kernel_has_not_sent_in_every_write_path";
    let Some(server) = common::s3::server_or_skip(test) else { return };
    let with_log: Vec<&[&str]> = WRITE_PATHS.iter().copied().filter(|options| !options.contains(&"log=off")).collect();
    check_seeks_in(&with_log, |options| TestMount::over_s3(&server, "holes", &[options, &["unit=1M"]].concat()));
}

/// A hole punched on a SQLite mount through bytes that are still in the write buffer and the
/// intent log (written and fsynced, not yet checkpointed) as well as bytes in the database:
/// reads see zeros there at once and after a remount, the whole units inside lose their rows,
/// SEEK_HOLE finds the hole, and `cp --sparse=always` copies the file byte for byte.
/// Preallocation answers EOPNOTSUPP and leaves hole punching working for the rest of the mount
/// (ENOSYS would have stopped the kernel sending either); `posix_fallocate` then writes zeros,
/// which extend the file as it promises.
#[test]
fn over_sqlite_a_punched_hole_reads_zeros_and_frees_its_rows_and_posix_fallocate_still_extends() {
    let mut m = TestMount::over_sqlite(&[]);
    check_a_punched_hole(&mut m, 64 << 10);
    m.unmount();
    let db = rusqlite::Connection::open(m.database.as_ref().unwrap()).unwrap();
    let units: Vec<i64> = db
        .prepare("SELECT unit FROM units JOIN inodes ON inodes.id = units.file WHERE length(data) > 0 ORDER BY unit")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(!units.iter().any(|u| (2..6).contains(u)), "units 2 to 5 have no row: {units:?}");
}

/// The same over S3 (a SeaweedFS server on 127.0.0.1, 1 MiB units); what the store drops is
/// checked in-process (`a_punched_hole_drops_the_units_it_covers_and_seeks_find_it`).
#[test]
fn over_s3_a_punched_hole_reads_zeros_and_posix_fallocate_still_extends() {
    let test = "over_s3_a_punched_hole_reads_zeros_and_posix_fallocate_still_extends";
    let Some(server) = common::s3::server_or_skip(test) else { return };
    let mut m = TestMount::over_s3(&server, "holes", &["unit=1M"]);
    check_a_punched_hole(&mut m, 1 << 20);
}

/// A file of 8 units, 4 of them on the backend and 4 written and fsynced after (the buffer and
/// the log hold them), a hole punched from half of unit 1 to half of unit 6; unmounted and
/// mounted again at its end.
fn check_a_punched_hole(m: &mut TestMount, unit: usize) {
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    let fallocate = |f: &File, mode: i32, offset: usize, length: usize| {
        // SAFETY: `fallocate` takes only integers (a descriptor and plain values) and touches
        // none of our memory; a bad descriptor is an error return.
        let ret = unsafe { libc::fallocate(f.as_raw_fd(), mode, offset as i64, length as i64) };
        if ret == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap())
        }
    };
    let mut expected: Vec<u8> = (0..8 * unit).map(|i| (i % 251) as u8 | 1).collect();
    std::fs::write(m.path("f"), &expected[..4 * unit]).unwrap();
    m.sync_to_backend();
    let f = OpenOptions::new().read(true).write(true).open(m.path("f")).unwrap();
    f.write_all_at(&expected[4 * unit..], 4 * unit as u64).unwrap();
    f.sync_all().unwrap();

    assert_eq!(fallocate(&f, 0, 0, unit), Err(libc::EOPNOTSUPP), "preallocation");
    // Half of unit 1 (on the backend) to half of unit 6 (in the buffer and the log).
    fallocate(&f, punch, unit + unit / 2, 5 * unit).expect("a hole punched after the refusal");
    expected[unit + unit / 2..6 * unit + unit / 2].fill(0);
    assert_eq!(std::fs::read(m.path("f")).unwrap(), expected, "zeros where the hole is");
    assert_eq!(seek(&f, 0, libc::SEEK_HOLE), Ok(2 * unit as i64), "the first whole unit of the hole");
    assert_eq!(seek(&f, 2 * unit as i64, libc::SEEK_DATA), Ok(6 * unit as i64));

    let elsewhere = tempfile::tempdir().unwrap();
    let copy = elsewhere.path().join("copy");
    let out = std::process::Command::new("cp").arg("--sparse=always").arg(m.path("f")).arg(&copy).output().unwrap();
    assert!(out.status.success(), "cp: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&copy).unwrap(), expected, "cp --sparse=always");

    // posix_fallocate past the end: glibc writes zeros where the kernel refused.
    // SAFETY: as `fallocate` above: integers only.
    assert_eq!(unsafe { libc::posix_fallocate(f.as_raw_fd(), 8 * unit as i64, unit as i64) }, 0);
    expected.resize(9 * unit, 0);
    assert_eq!(f.metadata().unwrap().len(), 9 * unit as u64, "posix_fallocate extends the file");
    drop(f);

    m.unmount();
    m.mount();
    assert_eq!(std::fs::read(m.path("f")).unwrap(), expected, "after a remount");
}

/// `du`'s figure for a path: the st_blocks of every file under it, in bytes.
fn allocated_bytes(path: &Path) -> u64 {
    let out = std::process::Command::new("du").args(["-s", "--block-size=1"]).arg(path).output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().parse().unwrap()
}

/// A file made ahead (its inode and first blocks allocated at a checkpoint, see
/// `backend/local/prepared.rs`) counts through the mount the blocks it uses, not those it holds
/// ahead, and the next checkpoint gives the rest back on the backend: past its end, and inside
/// its size where it grew past them unwritten (a truncate to 10 GiB).
#[test]
fn a_file_made_ahead_counts_and_keeps_only_the_blocks_it_uses() {
    let m = TestMount::with_options(&["checkpoint_interval=3600s"]);
    wait_for(|| m.counter("files_made_ahead_ready") > 0, "files made ahead");
    let named = m.counter("files_made_ahead_named_total");
    let written = 100 << 10; // more than the log takes for a file: made on the backend
    for name in ["dense", "grown"] {
        std::thread::sleep(std::time::Duration::from_millis(20)); // a lone close
        let mut f = File::create(m.path(name)).unwrap();
        std::io::Write::write_all(&mut f, &vec![7u8; written]).unwrap();
        if name == "grown" {
            f.set_len(10 << 30).unwrap();
        }
    }
    assert_eq!(m.counter("files_made_ahead_named_total"), named + 2, "both made from files made ahead");
    for name in ["dense", "grown"] {
        let through_mount = std::fs::metadata(m.path(name)).unwrap().blocks() * 512;
        assert_eq!(through_mount, written as u64, "{name}: st_blocks through the mount counts what was written");
        assert_eq!(allocated_bytes(&m.path(name)), written as u64, "{name}: du through the mount");
    }
    m.sync_to_backend();
    for name in ["dense", "grown"] {
        assert_eq!(allocated_bytes(&m.backing_path(name)), written as u64, "{name}: on the backend after a checkpoint");
        let mut bytes = vec![0u8; written];
        File::open(m.path(name)).unwrap().read_exact_at(&mut bytes, 0).unwrap();
        assert!(bytes.iter().all(|&b| b == 7), "{name}: its bytes");
    }
}

/// A tree of small and middling files copied in takes, through the mount and on the backend
/// once checkpointed, the space it takes copied natively beside it (within a block a file).
#[test]
fn a_copied_tree_takes_the_space_it_takes_natively() {
    let m = TestMount::with_options(&[]);
    wait_for(|| m.counter("files_made_ahead_ready") > 0, "files made ahead");
    let source = tempfile::tempdir_in(m.backing.parent().unwrap()).unwrap();
    let mut files = 0u64;
    for dir in 0..6 {
        let dir_path = source.path().join(format!("d{dir}"));
        std::fs::create_dir(&dir_path).unwrap();
        for i in 0..40u64 {
            // 0 bytes to 390 KiB, most of them small, as in /usr/share/doc.
            let size = (i * i * 7919 + dir * 131) % (if i % 5 == 0 { 400 << 10 } else { 9 << 10 });
            std::fs::write(dir_path.join(format!("f{i}")), vec![(i % 251) as u8 + 1; size as usize]).unwrap();
            files += 1;
        }
    }
    let status = std::process::Command::new("cp").arg("-a").arg(source.path()).arg(m.path("copy")).status().unwrap();
    assert!(status.success());
    let native = tempfile::tempdir_in(m.backing.parent().unwrap()).unwrap();
    let status =
        std::process::Command::new("cp").arg("-a").arg(source.path()).arg(native.path().join("copy")).status().unwrap();
    assert!(status.success());
    let native_bytes = allocated_bytes(&native.path().join("copy"));
    // Within 1 % of native, as the issue asks (files made ahead held 16 MiB more on 10 MiB).
    let slack = native_bytes / 100;
    assert!(files >= 200);
    let through_mount = allocated_bytes(&m.path("copy"));
    // Never more than 1 % over; under by at most a block a file: a file the log holds in
    // memory counts its size in 512-byte sectors, where ext4 will round it up to its 4 KiB block.
    assert!(
        through_mount <= native_bytes + slack && through_mount + files * 4096 >= native_bytes,
        "du through the mount {through_mount}, native {native_bytes}"
    );
    m.sync_to_backend();
    let on_backend = allocated_bytes(&m.backing_path("copy"));
    assert!(on_backend.abs_diff(native_bytes) <= slack, "du of the backend {on_backend}, native {native_bytes}");
    eprintln!("du: native {native_bytes}, through the mount {through_mount}, backend after a checkpoint {on_backend}");
}

/// Over SQLite and S3: a hole is a unit the store holds nothing for, and `st_blocks` says so
/// (it said the whole size was held), so `du` of a sparse file through the mount is what it is
/// on ext4, and `cp` with its defaults, which looks for holes only where `st_blocks` is below
/// the size, copies it out sparse instead of writing every zero.
#[test]
fn over_sqlite_and_s3_a_sparse_file_takes_no_space_for_its_holes_and_copies_out_sparse() {
    check_a_sparse_file_in_a_store_of_units(TestMount::over_sqlite(&[]), 64 << 10);
    let test = "over_sqlite_and_s3_a_sparse_file_takes_no_space_for_its_holes_and_copies_out_sparse";
    let Some(server) = common::s3::server_or_skip(test) else { return };
    check_a_sparse_file_in_a_store_of_units(TestMount::over_s3(&server, "sparse", &["unit=1M"]), 1 << 20);
}

fn check_a_sparse_file_in_a_store_of_units(m: TestMount, unit: u64) {
    let f = File::create(m.path("sparse")).unwrap();
    f.set_len(1 << 30).unwrap();
    let written: Vec<u8> = (0..2 * unit).map(|i| (i % 251) as u8 | 1).collect();
    f.write_all_at(&written, 512 << 20).unwrap();
    drop(f);
    m.sync_to_backend();
    let through_mount = allocated_bytes(&m.path("sparse"));
    assert!(through_mount >= 2 * unit && through_mount <= 3 * unit, "du of 2 units written: {through_mount}");
    let elsewhere = tempfile::tempdir().unwrap();
    let copy = elsewhere.path().join("copy");
    let out = std::process::Command::new("cp").arg(m.path("sparse")).arg(&copy).output().unwrap();
    assert!(out.status.success(), "cp: {}", String::from_utf8_lossy(&out.stderr));
    assert!(allocated_bytes(&copy) <= 4 * unit, "cp made a copy of {} bytes", allocated_bytes(&copy));
    let copied = std::fs::read(&copy).unwrap();
    assert_eq!(copied.len(), 1 << 30);
    assert!(copied[512 << 20..][..written.len()] == written[..], "the written bytes copied");
    assert!(copied[..512 << 20].iter().all(|&b| b == 0), "zeros before them");
}

/// Over S3, `df` says what the bucket holds for the mount, and room a bucket has (no capacity
/// the mount can know), not the state directory's disk, which it showed before: used grows by
/// what a file puts in the bucket and falls when the file goes.
#[test]
fn over_s3_df_counts_the_bytes_in_the_bucket_not_the_state_directorys_disk() {
    let test = "over_s3_df_counts_the_bytes_in_the_bucket_not_the_state_directorys_disk";
    let Some(server) = common::s3::server_or_skip(test) else { return };
    let m = TestMount::over_s3(&server, "space", &["unit=1M"]);
    let space = |path: &Path| {
        let st = statvfs_of(path);
        (st.f_blocks.saturating_sub(st.f_bfree) * st.f_frsize, st.f_bavail * st.f_frsize)
    };
    let (empty, room) = space(&m.mnt);
    let (_, state_disk_room) = space(&m.state_dir());
    assert!(room >= 1 << 50 && room != state_disk_room, "room {room}, the state directory's disk {state_disk_room}");
    let written: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
    std::fs::write(m.path("eight"), &written).unwrap();
    m.sync_to_backend();
    let (used, _) = space(&m.mnt);
    assert_eq!(used - empty, 8 << 20, "8 MiB in 1 MiB units in the bucket");
    std::fs::remove_file(m.path("eight")).unwrap();
    m.sync_to_backend();
    assert_eq!(space(&m.mnt).0, empty, "the file removed");
}

#[test]
fn a_sparse_file_takes_no_space_for_its_holes() {
    for options in [&[][..], &["log=off"][..]] {
        let m = TestMount::with_options(options);
        let f = File::create(m.path("sparse")).unwrap();
        f.set_len(10 << 30).unwrap();
        drop(f);
        assert_eq!(std::fs::metadata(m.path("sparse")).unwrap().blocks(), 0, "{options:?}: through the mount");
        // On the backend it may hold the blocks of a file made ahead until the checkpoint.
        assert!(allocated_bytes(&m.backing_path("sparse")) <= 1 << 20, "{options:?}: on the backend");
        m.sync_to_backend();
        assert_eq!(allocated_bytes(&m.backing_path("sparse")), 0, "{options:?}: after a checkpoint");
    }
}

/// On a backing file system that fills up, the blocks held for files made ahead go to the
/// write that needs them: a file as large as the free space plus most of what is held ahead is
/// written whole, where it would otherwise have met ENOSPC.
#[test]
fn a_full_disk_takes_back_the_blocks_held_for_files_made_ahead() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip("a_full_disk_takes_back_the_blocks_held_for_files_made_ahead", "a small ext4 on a loop device needs root");
        return;
    }
    let small = SmallFileSystem::new(128);
    let backing = small.path().join("backing");
    std::fs::create_dir(&backing).unwrap();
    let _state = StateCleanup::of(&backing);
    let m = TestMount::build(&["unit=1M"], &[], Some(&backing));
    m.sync_to_backend();
    wait_for(|| m.counter("files_made_ahead_ready") > 0, "files made ahead");
    let held_ahead = m.counter("files_made_ahead_ready") << 20;
    assert!(held_ahead >= 8 << 20, "{held_ahead} bytes held ahead");
    let free = available_bytes(&backing);
    // More than is free, less than is free with what is held ahead: a few MiB to spare for the
    // file's extent blocks.
    let size = (free + held_ahead - (4 << 20)) & !((1 << 20) - 1);
    assert!(size > free, "{size} > {free}");
    let piece = vec![0x5au8; 1 << 20];
    let mut f = File::create(m.path("big")).unwrap();
    for _ in 0..size >> 20 {
        std::io::Write::write_all(&mut f, &piece).unwrap();
    }
    f.sync_all().expect("a file that fits once the blocks held ahead are given back");
    drop(f);
    assert_eq!(std::fs::metadata(m.backing_path("big")).unwrap().len(), size);
    assert_eq!(m.counter("files_made_ahead_ready"), 0, "the files made ahead gave their blocks back");
}
