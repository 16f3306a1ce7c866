//! FUSE over io_uring (`transport=uring`) on a real mount: file I/O answered over the rings,
//! and a daemon killed while its rings hold requests leaves a mount that `coalescefs umount`
//! clears and a remount replays. And what both transports share: a write of whole units takes
//! its request's pages.
//!
//! The kernel offers the transport only while /sys/module/fuse/parameters/enable_uring is on
//! (off by default): each test turns it on and puts back what it found, also when it fails.
//! Without root or without the parameter (a kernel without CONFIG_FUSE_IO_URING) the tests say
//! why and pass.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::time::Duration;

use common::*;

fn stats_text(m: &TestMount) -> String {
    let out = coalescefs(&["stats", &path_str(&m.mnt)]);
    assert!(out.status.success(), "stats: {}", stderr_of(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn possible_cpus() -> u64 {
    let possible = fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    possible.trim().split([',', '-']).filter_map(|n| n.parse::<u64>().ok()).max().unwrap() + 1
}

#[test]
fn file_io_is_answered_over_the_rings() {
    let Some(_uring) = KernelParameter::uring("file_io_is_answered_over_the_rings", true) else { return };
    // cache_timeout=0: every stat reaches the daemon.
    let mut m = TestMount::with_options(&["allow_other", "transport=uring", "cache_timeout=0"]);
    let text = stats_text(&m);
    assert!(text.contains("transport: uring"), "{text}");
    assert_eq!(m.counter("fuse_ring_queues"), possible_cpus());
    assert!(m.daemon_log().contains("FUSE over io_uring"), "{}", m.daemon_log());
    let served_before = m.counter("fuse_ring_requests_total");

    fs::write(m.path("small"), b"over the ring").unwrap();
    assert_eq!(fs::read(m.path("small")).unwrap(), b"over the ring");
    fs::rename(m.path("small"), m.path("renamed")).unwrap();
    assert!(!m.path("small").exists());
    let mut file = fs::OpenOptions::new().append(true).open(m.path("renamed")).unwrap();
    file.write_all(b", synced").unwrap();
    file.sync_all().unwrap();
    drop(file);
    assert_eq!(fs::read(m.path("renamed")).unwrap(), b"over the ring, synced");

    // 4 MiB: requests of max_write (the unit, 1 MiB) fill the payload buffers; once through the
    // page cache, once O_DIRECT (each write its own request), and read back both ways.
    let big: Vec<u8> = (0..4u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    fs::write(m.path("big"), &big).unwrap();
    let mut direct = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.path("big-direct"))
        .unwrap();
    let aligned = AlignedBuffer::copy_of(&big);
    direct.write_all(aligned.bytes()).unwrap();
    direct.sync_all().unwrap();
    drop(direct);
    assert!(fs::read(m.path("big")).unwrap() == big, "big read back differs");
    let mut read_direct =
        fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(m.path("big-direct")).unwrap();
    let mut back = AlignedBuffer::zeroed(big.len());
    read_direct.read_exact(back.bytes_mut()).unwrap();
    drop(read_direct);
    assert!(back.bytes() == big.as_slice(), "big-direct read back differs");

    fs::create_dir(m.path("dir")).unwrap();
    for i in 0..50 {
        fs::write(m.path(&format!("dir/f{i}")), i.to_string()).unwrap();
    }
    let mut names: Vec<String> =
        fs::read_dir(m.path("dir")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let mut expected: Vec<String> = (0..50).map(|i| format!("f{i}")).collect();
    expected.sort();
    assert_eq!(names, expected);
    for _ in 0..100 {
        fs::metadata(m.path("renamed")).unwrap();
    }

    let served = m.counter("fuse_ring_requests_total") - served_before;
    // Each create, write, rename, fsync, readdir and stat above is at least one request.
    assert!(served >= 250, "only {served} requests came over the rings");
    // FORGET never comes over a ring: the kernel sends it on /dev/fuse, where fuser's loops
    // still read. Dropping the kernel's caches forgets the 50 files.
    // (The counter is listed once it is not 0.)
    let forgets = |m: &TestMount| m.stats().get("fuse_forget_total").copied().unwrap_or(0);
    let forgets_before = forgets(&m);
    if drop_kernel_caches().is_some() {
        wait_for(|| forgets(&m) >= forgets_before + 50, "FORGETs over /dev/fuse");
    }

    // After a clean unmount and a mount again, every byte is there.
    m.remount();
    assert_eq!(fs::read(m.path("renamed")).unwrap(), b"over the ring, synced");
    assert!(fs::read(m.path("big")).unwrap() == big);
    assert!(fs::read(m.path("big-direct")).unwrap() == big);
    assert!(stats_text(&m).contains("transport: uring"));
}

#[test]
fn transport_uring_is_refused_clearly_where_the_kernel_does_not_offer_it() {
    let test = "transport_uring_is_refused_clearly_where_the_kernel_does_not_offer_it";
    let Some(_uring_off) = KernelParameter::uring(test, false) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (backing, mnt) = (dir.path().join("b"), dir.path().join("m"));
    fs::create_dir(&backing).unwrap();
    fs::create_dir(&mnt).unwrap();
    let _cleanup = StateCleanup::of(&backing);
    let out = coalescefs(&["mount", &path_str(&backing), &path_str(&mnt), "-o", "transport=uring"]);
    assert!(!out.status.success());
    let message = stderr_of(&out);
    assert!(message.contains("transport=uring") && message.contains("enable_uring"), "{message}");
    assert!(!fs::read_to_string("/proc/self/mountinfo").unwrap().contains(&path_str(&mnt)));
    // auto falls back to /dev/fuse and says so.
    let out = coalescefs(&["mount", &path_str(&backing), &path_str(&mnt), "-o", "transport=auto"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let stats = coalescefs(&["stats", &path_str(&mnt)]);
    let text = String::from_utf8_lossy(&stats.stdout).into_owned();
    assert!(coalescefs(&["umount", &path_str(&mnt)]).status.success());
    assert!(text.contains("transport: dev"), "{text}");
    assert!(text.contains("fuse_ring_queues                         0"), "{text}");
}

#[test]
fn a_daemon_killed_while_its_rings_hold_requests_leaves_a_mount_that_umount_clears_and_a_remount_replays() {
    let Some(_uring) = KernelParameter::uring("a_daemon_killed_while_its_rings_hold_requests", true) else { return };
    let mut m = TestMount::build(&["allow_other", "transport=uring"], &[("COALESCEFS_FAULTS", "")], None);
    let mnt = path_str(&m.mnt);
    assert!(stats_text(&m).contains("transport: uring"));
    let mut kept = fs::File::create(m.path("kept")).unwrap();
    kept.write_all(b"made durable by fsync").unwrap();
    kept.sync_all().unwrap();
    drop(kept);

    // Hold requests in the daemon: the intent log's device stalls, so fsyncs wait in ring
    // entries the daemon has taken and not answered.
    m.inject("logsync=stall:60s");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for i in 0..2 {
        let path = m.path(&format!("held{i}"));
        let done_tx = done_tx.clone();
        std::thread::spawn(move || {
            let result = (|| {
                let mut f = fs::File::create(&path)?;
                f.write_all(b"never acknowledged")?;
                f.sync_all()
            })();
            let _ = done_tx.send(result.map_err(|e| e.raw_os_error()));
        });
    }
    assert!(done_rx.recv_timeout(Duration::from_millis(700)).is_err(), "the fsyncs should be held by the stalled log");
    kill_and_wait(m.daemon_pid());
    // The held requests fail rather than hang.
    for _ in 0..2 {
        let result = done_rx.recv_timeout(Duration::from_secs(20)).expect("a held fsync never returned");
        assert!(result.is_err(), "a held fsync succeeded after the daemon died");
    }
    // A name never looked up, so that the kernel must ask: the root's attributes may still be
    // cached (for `cache_timeout`, 60 s), fetched for the permission check of a held file's
    // create that the dying daemon never answered.
    let dead = fs::metadata(m.path("never-looked-up")).unwrap_err().raw_os_error();
    assert!(matches!(dead, Some(libc::ENOTCONN | libc::ECONNABORTED)), "{dead:?}");
    let out = coalescefs(&["umount", &mnt]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(!fs::read_to_string("/proc/self/mountinfo").unwrap().contains(&mnt));

    // A mount over the ring again replays the intent log: what fsync acknowledged is there.
    m.assume_unmounted();
    m.set_options(&["allow_other", "transport=uring"]);
    m.mount();
    assert_eq!(fs::read(m.path("kept")).unwrap(), b"made durable by fsync");
    assert!(m.counter("log_replayed_records_total") > 0);
    assert!(stats_text(&m).contains("transport: uring"));
}

#[test]
fn whole_units_written_over_the_rings_take_the_requests_pages_and_read_back_as_written() {
    let test = "whole_units_written_over_the_rings_take_the_requests_pages";
    let Some(_uring) = KernelParameter::uring(test, true) else { return };
    whole_units_take_the_requests_pages_and_read_back_as_written(test, "transport=uring");
}

#[test]
fn whole_units_written_over_dev_fuse_take_the_requests_pages_and_read_back_as_written() {
    let test = "whole_units_written_over_dev_fuse_take_the_requests_pages";
    whole_units_take_the_requests_pages_and_read_back_as_written(test, "transport=dev");
}

/// unit=2M, and O_DIRECT writes of 2 MiB at 2 MiB boundaries (a request holds one once
/// fs.fuse.max_pages_limit allows 512 pages): each such write's unit takes its request's pages
/// (a ring entry's payload, or fuser's read buffer, both placed at a huge-page boundary)
/// instead of copying them. Pieces of 4 KiB pages are copied (the unit tests of
/// `engine::buffer`), so a unit of 1 MiB, whose requests fit the default limit, takes none.
fn whole_units_take_the_requests_pages_and_read_back_as_written(test: &str, transport: &str) {
    let Some(_max_pages) = KernelParameter::max_pages_at_least(test, 512) else { return };
    let mut m = TestMount::with_options(&["allow_other", transport, "unit=2M"]);
    const UNIT: usize = 2 << 20;
    let pattern = |seed: u32, len: usize| -> Vec<u8> {
        (0..len as u32).map(|i| (i.wrapping_add(seed << 20).wrapping_mul(2_654_435_761) >> 11) as u8).collect()
    };
    let mut model = vec![0u8; 8 * UNIT];
    let direct =
        fs::OpenOptions::new().create(true).write(true).custom_flags(libc::O_DIRECT).open(m.path("f")).unwrap();
    let exchanged_before = m.counter("write_pages_exchanged_bytes_total");
    let write_direct = |model: &mut Vec<u8>, at: usize, bytes: Vec<u8>| {
        let aligned = AlignedBuffer::copy_of(&bytes);
        std::os::unix::fs::FileExt::write_all_at(&direct, aligned.bytes(), at as u64).unwrap();
        model[at..at + bytes.len()].copy_from_slice(&bytes);
    };
    for i in 0..8 {
        write_direct(&mut model, i * UNIT, pattern(i as u32, UNIT));
    }
    // A unit that took pages, written whole again while still buffered, and one written in
    // part over them (a copy into the taken pages), then made durable through the log.
    write_direct(&mut model, 2 * UNIT, pattern(100, UNIT));
    write_direct(&mut model, 3 * UNIT + 8192, pattern(101, 3 * 4096));
    fs::File::open(m.path("f")).unwrap().sync_all().unwrap();
    let exchanged = m.counter("write_pages_exchanged_bytes_total") - exchanged_before;
    assert!(exchanged >= 9 * UNIT as u64, "only {exchanged} bytes' pages taken for nine whole-unit writes");
    // Buffered writes into units that took pages: a few bytes, and past a truncate.
    let buffered = fs::OpenOptions::new().write(true).open(m.path("f")).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&buffered, b"in the middle", (5 * UNIT + 77) as u64).unwrap();
    model[5 * UNIT + 77..5 * UNIT + 90].copy_from_slice(b"in the middle");
    buffered.set_len((6 * UNIT + 1000) as u64).unwrap();
    model.truncate(6 * UNIT + 1000);
    model.resize(8 * UNIT, 0);
    write_direct(&mut model, 7 * UNIT, pattern(102, UNIT));
    drop(buffered);
    drop(direct);
    assert!(fs::read(m.path("f")).unwrap() == model, "read back differs from what was written");
    m.remount();
    assert!(fs::read(m.path("f")).unwrap() == model, "read back after a remount differs from what was written");
}

/// Page-aligned bytes for O_DIRECT.
struct AlignedBuffer {
    words: Vec<u64>,
    len: usize,
    offset: usize,
}

impl AlignedBuffer {
    fn zeroed(len: usize) -> AlignedBuffer {
        let words = vec![0u64; (len + 8192) / 8];
        let offset = (4096 - words.as_ptr() as usize % 4096) % 4096;
        AlignedBuffer { words, len, offset }
    }

    fn copy_of(bytes: &[u8]) -> AlignedBuffer {
        let mut buffer = AlignedBuffer::zeroed(bytes.len());
        buffer.bytes_mut().copy_from_slice(bytes);
        buffer
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: words holds len + 8192 bytes; offset < 4096, so offset + len is inside.
        unsafe { std::slice::from_raw_parts((self.words.as_ptr() as *const u8).add(self.offset), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in bytes, and &mut self makes it the only view.
        unsafe { std::slice::from_raw_parts_mut((self.words.as_mut_ptr() as *mut u8).add(self.offset), self.len) }
    }
}
