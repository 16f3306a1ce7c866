//! A full or failing backend never freezes the mount (SEMANTICS.md, "Data the backend
//! refuses"): the writer gets the error within a bounded time, `ls` and other files keep
//! answering, memory stays within its bound, removing the file frees the space and the mount
//! recovers when the backend does, unmount finishes and says what it could not write, and
//! every fsync-acknowledged byte survives.
//!
//! The matrix: a real 64 MiB ext4 that runs full (ENOSPC) and a backend failing every write and
//! sync (EIO, by fault injection), under streaming writes and under small fsynced writes, with
//! the intent log off and on. Workloads run as child processes under `timeout`: a mount that
//! froze would fail the test, not hang it.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;

/// The longest the writer may wait for its error, and any other request for its answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(15);
const BUFFER_MIB: u64 = 8;
/// The bound on the daemon's memory stated in docs/design.md: the buffer plus a fixed overhead.
const OVERHEAD_MIB: u64 = 48;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// The backing file system runs out of space for real.
    Full,
    /// Every write and sync of the backend fails (fault injection).
    Eio,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Workload {
    /// 1 MiB writes, far more than the backend takes.
    Streaming,
    /// 4 KiB writes, each fsynced.
    SmallFsynced,
}

/// Runs a command, and returns its output and how long it took. Past `seconds` the command
/// is killed; if it cannot die (stuck in the kernel on a mount that does not answer), the
/// mount's FUSE connection is aborted so that it can, and the test fails.
fn timed(m: &TestMount, seconds: u64, program: &str, args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let mut child = Command::new(program)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = started + Duration::from_secs(seconds);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            std::thread::sleep(Duration::from_secs(2));
            if child.try_wait().unwrap().is_none() {
                m.abort_connection();
            }
            let out = child.wait_with_output().unwrap();
            panic!("{program} {args:?} did not finish in {seconds} s (the mount froze): {out:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = started.elapsed();
    (child.wait_with_output().unwrap(), took)
}

/// Small fsynced writes to `path` (appended, 4 KiB each, the k-th filled with byte k % 251 + 1)
/// until one fails or `count` succeed; prints the number of acknowledged writes, exits 1 on error.
const SMALL_FSYNCS: &str = r#"
import os, sys
path, count = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
acked = 0
try:
    for k in range(count):
        os.write(fd, bytes([k % 251 + 1]) * 4096)
        os.fsync(fd)
        acked += 1
    os.close(fd)
    print(acked)
except OSError as e:
    print(acked)
    print(e, file=sys.stderr)
    sys.exit(1)
"#;

/// One 4 KiB append to `name` and its fsync (`SMALL_FSYNCS`), in a process of its own; killed
/// after 60 s.
fn append_fsynced(m: &TestMount, name: &str) -> (Output, Duration) {
    timed(m, 60, "python3", &["-c", SMALL_FSYNCS, &path_str(&m.path(name)), "1"])
}

fn pattern_of_small_fsyncs(acked: usize) -> Vec<u8> {
    (0..acked).flat_map(|k| vec![(k % 251 + 1) as u8; 4096]).collect()
}

fn peak_rss_mib(pid: i32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 =
        status.lines().find(|l| l.starts_with("VmHWM:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kib / 1024
}

fn run_case(fault: Fault, workload: Workload, log: bool) {
    let case = format!("{fault:?}, {workload:?}, log={}", if log { "on" } else { "off" });
    let small = SmallFileSystem::new(64);
    let backing = small.path().join("backing");
    fs::create_dir(&backing).unwrap();
    let _state = StateCleanup::of(&backing);
    let buffer = format!("buffer={BUFFER_MIB}M");
    let mut options = vec![buffer.as_str(), "unit=1M", "io_timeout=5s", "flush_age=500ms"];
    if log {
        options.extend(["log=on", "log_size=16M", "checkpoint_interval=1s"]);
    } else {
        options.push("log=off");
    }
    // Fault injection on (no rule yet), so that rules can be added while mounted.
    let env = [("COALESCEFS_FAULTS", "")];
    let mut m = TestMount::build(&options, &env, Some(&backing));

    // Acknowledged before anything fails: fsynced, then checked at the very end.
    let acked = pattern(300_000, 41);
    write_fsynced(&m.path("acked"), &acked);
    fs::write(m.path("readable"), pattern(50_000, 42)).unwrap();
    let victim = m.path("victim");
    let victim_s = path_str(&victim);

    // The fault, and the workload that meets it.
    let filler = m.path("filler");
    match (fault, workload) {
        (Fault::Eio, _) => {
            m.inject("write=EIO");
            m.inject("sync=EIO");
        }
        (Fault::Full, Workload::SmallFsynced) => {
            // Most of the space taken by a file made through the mount, so that removing it
            // through the mount gives the space back.
            let (out, _) = timed(
                &m,
                60,
                "dd",
                &["if=/dev/zero", &format!("of={}", path_str(&filler)), "bs=1M", "count=200", "conv=fsync"],
            );
            assert!(!out.status.success(), "{case}: the filler was meant to fill the file system");
        }
        (Fault::Full, Workload::Streaming) => {}
    }
    let (out, took) = match workload {
        Workload::Streaming => timed(&m, 60, "dd", &["if=/dev/zero", &format!("of={victim_s}"), "bs=1M", "count=400"]),
        Workload::SmallFsynced => timed(&m, 60, "python3", &["-c", SMALL_FSYNCS, &victim_s, "3000"]),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    let acked_fsyncs: usize = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
    // With the log, small fsyncs may all be answered by it while the backend refuses: they are
    // acknowledged, and must survive. Otherwise the writer hears of the failure.
    let logged_them_all = log && workload == Workload::SmallFsynced && out.status.success();
    if !logged_them_all {
        assert!(!out.status.success(), "{case}: the writer never heard of the failure");
        let expected = if fault == Fault::Full { "No space left on device" } else { "Input/output error" };
        assert!(stderr.contains(expected), "{case}: the writer got {stderr:?}, not {expected:?}");
    }
    assert!(took < ANSWER_WITHIN, "{case}: the writer waited {took:?}");
    let writer_took = took;

    // The mount keeps answering: a listing, a read of another file, a write to another file.
    let (out, took) = timed(&m, 30, "ls", &["-l", &path_str(&m.mnt)]);
    assert!(out.status.success() && took < ANSWER_WITHIN, "{case}: ls took {took:?}: {out:?}");
    let (out, took) = timed(&m, 30, "cmp", &[&path_str(&m.path("readable")), "-"]);
    let _ = out;
    assert!(took < ANSWER_WITHIN, "{case}: reading another file took {took:?}");
    assert_eq!(fs::read(m.path("readable")).unwrap(), pattern(50_000, 42), "{case}");
    let (out, took) = timed(&m, 30, "sh", &["-c", &format!("echo other > {}", path_str(&m.path("other")))]);
    let _ = out; // it may well fail (the backend is full or failing); it must answer
    assert!(took < ANSWER_WITHIN, "{case}: a write to another file took {took:?}");

    let rss = peak_rss_mib(m.daemon_pid());
    eprintln!(
        "{case}: the writer {} after {writer_took:?} ({acked_fsyncs} small fsyncs acknowledged); peak RSS {rss} MiB; \
         refused bytes buffered {}, flush errors {}",
        if logged_them_all { "was answered by the log every time" } else { "got its error" },
        m.counter("buffer_refused_bytes"),
        m.counter("flush_errors_total")
    );
    assert!(rss <= BUFFER_MIB + OVERHEAD_MIB, "{case}: the daemon's peak resident memory {rss} MiB is past the bound");
    let log_text = m.daemon_log();
    let warnings = log_text.lines().filter(|l| l.contains("flush of unit")).count();
    assert!(warnings <= 20, "{case}: {warnings} log lines about refused flushes: repeats are not rate-limited");
    assert!(log_text.lines().all(|l| l.starts_with("20")), "{case}: a log line without a timestamp:\n{log_text}");

    if fault == Fault::Full {
        // Removing the file (dd's, or the filler) gives the space back at once, and the mount
        // recovers: a new file is written and fsynced.
        let removed = if workload == Workload::Streaming { &victim } else { &filler };
        let before = available_bytes(&small.path());
        fs::remove_file(removed).unwrap();
        wait_for(|| available_bytes(&small.path()) > before + (20 << 20), "the removed file's space to come back");
        write_fsynced(&m.path("after"), &pattern(100_000, 43));
        if workload == Workload::SmallFsynced {
            // The victim's refused writes are retried and drain now that there is room.
            let (out, _) = timed(&m, 30, "python3", &["-c", SMALL_FSYNCS, &victim_s, "1"]);
            assert!(out.status.success(), "{case}: fsync after room was made: {out:?}");
        }
        let out = m.unmount_reporting();
        assert!(out.status.success(), "{case}: the backend recovered, yet unmount reports: {}", stderr_of(&out));
    } else {
        // Unmount while the backend still fails: it finishes, and says what it could not write
        // (the victim's refused bytes, or another writer's that replaced them in the buffer).
        let refused = m.counter("buffer_refused_bytes");
        let started = Instant::now();
        let out = m.unmount_reporting();
        assert!(started.elapsed() < Duration::from_secs(30), "{case}: unmount took {:?}", started.elapsed());
        let said = stderr_of(&out);
        if refused > 0 {
            assert!(
                !out.status.success(),
                "{case}: {refused} refused bytes were buffered, yet unmount reported nothing"
            );
            assert!(said.contains("could not be written before unmount"), "{case}: unmount said {said:?}");
        }
    }

    // Every acknowledged byte survived: the fsynced file, and the small writes the log answered.
    let m = TestMount::build(&options, &[], Some(&backing));
    assert!(fs::read(m.path("acked")).unwrap() == acked, "{case}: fsynced bytes were lost");
    if workload == Workload::SmallFsynced && acked_fsyncs > 0 {
        let now = fs::read(m.path("victim")).unwrap_or_default();
        let want = pattern_of_small_fsyncs(acked_fsyncs);
        assert!(
            now.len() >= want.len() && now[..want.len()] == want[..],
            "{case}: {acked_fsyncs} acknowledged small writes not all there"
        );
    }
    drop(m);
}

fn write_fsynced(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    let mut f = fs::File::create(path).unwrap();
    f.write_all(bytes).unwrap();
    f.sync_all().unwrap();
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8)).collect()
}

#[test]
fn full_backend_streaming_writes() {
    run_case(Fault::Full, Workload::Streaming, false);
}

#[test]
fn full_backend_small_fsynced_writes() {
    run_case(Fault::Full, Workload::SmallFsynced, false);
}

#[test]
fn full_backend_streaming_writes_with_the_log() {
    run_case(Fault::Full, Workload::Streaming, true);
}

#[test]
fn full_backend_small_fsynced_writes_with_the_log() {
    run_case(Fault::Full, Workload::SmallFsynced, true);
}

#[test]
fn failing_backend_streaming_writes() {
    run_case(Fault::Eio, Workload::Streaming, false);
}

#[test]
fn failing_backend_small_fsynced_writes() {
    run_case(Fault::Eio, Workload::SmallFsynced, false);
}

#[test]
fn failing_backend_streaming_writes_with_the_log() {
    run_case(Fault::Eio, Workload::Streaming, true);
}

#[test]
fn failing_backend_small_fsynced_writes_with_the_log() {
    run_case(Fault::Eio, Workload::SmallFsynced, true);
}

/// For the tests whose premise is a file the backend holds unsynced after its close: nothing
/// flushed by age, and no new file held in memory and the log (`log_closes=never`). With the
/// defaults, under CI's parallel tests (about one run in ten), a close of the held file found
/// only part of its bytes there and logged them; the next close made the file on the backend and
/// synced it there (`settle_made`), so the fsync after it was rightly answered by the log, and
/// the test's premise was gone.
const CLOSE_LEAVES_BYTES_UNSYNCED: [&str; 2] = ["flush_age=3600s", "log_closes=never"];

/// Which path answered each close and fsync, in the daemon's log, for a failure to show.
const DEBUG_WRITEBACK: &str = "info,coalescefs::engine::writeback=debug";

/// A backend whose writes do not return: fsync fails with EIO after io_timeout instead of
/// waiting forever, `ls` answers meanwhile, and once the backend answers again the data drains.
#[test]
fn a_stalled_backend_fails_the_waiting_request_after_io_timeout() {
    let options = ["unit=1M", "io_timeout=2s", CLOSE_LEAVES_BYTES_UNSYNCED[0], CLOSE_LEAVES_BYTES_UNSYNCED[1]];
    let env = [("COALESCEFS_FAULTS", ""), ("RUST_LOG", DEBUG_WRITEBACK)];
    let mut m = TestMount::build(&options, &env, None);
    let data = pattern(300_000, 44);
    fs::write(m.path("f"), &data).unwrap();
    m.inject("write=stall:120s");
    let (out, took) = append_fsynced(&m, "f");
    assert!(
        !out.status.success(),
        "fsync succeeded on a backend that takes nothing: {out:?}; the daemon's log:\n{}",
        m.daemon_log()
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("Input/output error"), "{out:?}");
    assert!(took >= Duration::from_secs(2) && took < ANSWER_WITHIN, "fsync waited {took:?} for io_timeout=2s");
    let (out, took) = timed(&m, 30, "ls", &[&path_str(&m.mnt)]);
    assert!(out.status.success() && took < Duration::from_secs(5), "ls took {took:?}");
    m.clear_faults();
    let (out, _) = append_fsynced(&m, "f");
    assert!(out.status.success(), "the backend answers again, yet fsync fails: {out:?}");
    let expected = [data, pattern_of_small_fsyncs(1), pattern_of_small_fsyncs(1)].concat();
    m.unmount();
    assert!(fs::read(m.backing_path("f")).unwrap() == expected);
}

/// A clean unmount is a durability point because the daemon syncs the backend last (with the
/// log, its last checkpoint); when that sync fails, `coalescefs umount` says so and exits 1
/// (the data is on the backing file system, written, not known durable; with the log, what the
/// log holds stays there for the next mount).
#[test]
fn a_failed_sync_at_unmount_is_reported_by_umount() {
    for log in ["log=on", "log=off"] {
        let mut m = TestMount::build(&["unit=64K", log], &[("COALESCEFS_FAULTS", "")], None);
        fs::write(m.path("f"), pattern(100_000, 3)).unwrap();
        fs::write(m.path("small"), pattern(1000, 4)).unwrap();
        m.inject("sync=EIO");
        let out = m.unmount_reporting();
        assert_eq!(out.status.code(), Some(1), "{log}: umount after a failed sync: {out:?}");
        let said = stderr_of(&out);
        assert!(said.contains("sync at unmount failed") && said.contains("Input/output error"), "{log}: {said}");
        assert_eq!(said.contains("the next mount replays them"), log == "log=on", "{log}: {said}");
        assert_eq!(fs::read(m.backing_path("f")).unwrap(), pattern(100_000, 3), "{log}: written, not known durable");
        m.mount();
        assert_eq!(fs::read(m.path("small")).unwrap(), pattern(1000, 4), "{log}: what close acknowledged");
        m.unmount();
    }
}

/// SIGTERM while a process keeps a file open on the mount and the backend answers nothing:
/// the daemon unmounts lazily, and when the mount has not let go ten seconds later it aborts
/// the FUSE connection, so it exits (the process gets ENOTCONN) and says what it could not
/// write.
#[test]
fn sigterm_ends_the_daemon_even_when_the_mount_stays_busy() {
    let options = ["unit=1M", "io_timeout=2s", "flush_age=3600s", "writeback_cache=off"];
    let mut m = TestMount::build(&options, &[("COALESCEFS_FAULTS", "write=stall:600s")], None);
    let mut holder = Command::new("python3")
        .args(["-c", "import os, sys, time\nfd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x' * 100000)\nprint('open', flush=True)\ntime.sleep(600)", &path_str(&m.path("held"))])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.as_mut().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "open");
    let pid = m.daemon_pid();
    let started = Instant::now();
    // SAFETY: `kill` takes only a pid and a signal number; it touches none of our memory.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    while !process_gone(pid) {
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "the daemon still runs {:?} after SIGTERM",
            started.elapsed()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(9), "the daemon exited after {took:?}: before it waited for the busy mount");
    let log = m.daemon_log();
    assert!(log.contains("aborting its FUSE connection"), "{log}");
    assert!(log.contains("could not be written before unmount") && log.contains("held"), "{log}");
    let _ = holder.kill();
    let _ = holder.wait();
    m.assume_unmounted();
    // Lazily detached by the daemon, the mount point is free again.
    assert!(!fs::read_to_string("/proc/self/mountinfo").unwrap().contains(&path_str(&m.mnt)));
}

/// An fsync makes durable what the file holds, so bytes a close gave the backend unsynced (a
/// 300 KB new file, more than the log takes at close) are synced by the next fsync, not left
/// for the log's record of the append to stand for. The kernel forgetting the file in between
/// (memory pressure, an admin's `drop_caches`) ended the id the file had been served under,
/// the file came back under another, and the fsync found no note of the backend's unsynced
/// bytes: the log answered it, and a power cut could have lost the 300 KB it acknowledged.
/// A backend whose syncs fail shows which: the fsync must fail.
/// With file handles the local namespace keeps such a file's id (`backend::local::objects`);
/// without them (a daemon that is not root) the engine keeps the kernel's forgets of it until
/// the backend's changes are synced.
#[test]
fn an_fsync_after_the_kernel_forgot_the_file_still_syncs_what_the_backend_holds_unsynced() {
    // Which path answered each close and fsync is logged at debug: a failure shows it.
    let (options, env) = (CLOSE_LEAVES_BYTES_UNSYNCED, [("COALESCEFS_FAULTS", ""), ("RUST_LOG", DEBUG_WRITEBACK)]);
    fsync_after_the_kernel_forgot_the_file(TestMount::build(&options, &env, None));
    match TestMount::without_file_handles(&options, &env) {
        Some(m) => fsync_after_the_kernel_forgot_the_file(m),
        None => skip(
            "an_fsync_after_the_kernel_forgot_the_file_still_syncs_what_the_backend_holds_unsynced",
            "the half without file handles: dropping the capability needs root",
        ),
    }
}

fn fsync_after_the_kernel_forgot_the_file(m: TestMount) {
    let data = pattern(300_000, 9);
    fs::write(m.path("f"), &data).unwrap();
    if drop_kernel_caches().is_none() {
        skip(
            "an_fsync_after_the_kernel_forgot_the_file_still_syncs_what_the_backend_holds_unsynced",
            "dropping the kernel's caches needs root",
        );
        return;
    }
    m.inject("sync=EIO");
    let (out, _) = append_fsynced(&m, "f");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("Input/output error"),
        "an fsync the backend could not sync: {out:?}; the daemon's log:\n{}",
        m.daemon_log()
    );
    m.clear_faults();
    let (out, _) = append_fsynced(&m, "f");
    assert!(out.status.success(), "the backend syncs again, yet fsync fails: {out:?}");
    let expected = [data, pattern_of_small_fsyncs(1), pattern_of_small_fsyncs(1)].concat();
    assert!(fs::read(m.path("f")).unwrap() == expected, "the file after both appends");
}

/// A backend that stalls while the engine makes a new file the log holds on it (a checkpoint
/// making the files created since the last, or an extended attribute set on one): `ls -l`,
/// `stat` and `cat` of that file answer from memory meanwhile, and the make finishes once the
/// backend answers. They waited for the whole stall before (19 s for one `ls` over a SQLite
/// database another program locked).
#[test]
fn a_stalled_make_of_a_new_file_holds_up_no_listing_stat_or_read_of_it() {
    // Every stat asks the daemon: the kernel answers none from its attribute cache.
    let m = TestMount::build(&["cache_timeout=0"], &[("COALESCEFS_FAULTS", "")], None);
    fs::create_dir(m.path("slow")).unwrap();
    let (checkpointed, xattred) = (pattern(1000, 5), pattern(3000, 6));
    // Each closed: in the log, held. Apart: a file created just after a close is made on the
    // backend at once (`log_closes=auto`'s burst rule).
    fs::write(m.path("slow/checkpointed"), &checkpointed).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    fs::write(m.path("slow/xattred"), &xattred).unwrap();
    m.inject("create=stall:120s@slow");
    let mnt = path_str(&m.mnt);
    let checkpoint = Command::new(env!("CARGO_BIN_EXE_coalescefs")).args(["sync", &mnt]).spawn().unwrap();
    let xattr_path = path_str(&m.path("slow/xattred"));
    let xattr = Command::new("setfattr").args(["-n", "user.why", "-v", "slow", &xattr_path]).spawn().unwrap();
    // Each makes one file, milliseconds on a backend that answers.
    std::thread::sleep(Duration::from_secs(1));
    // A file grown past what the log takes for a new one, made on the backend for a flush.
    std::thread::sleep(Duration::from_millis(100));
    let grown = pattern(3 << 20, 7);
    let grown_path = path_str(&m.path("slow/grown"));
    // From outside the mount: a copy inside it is a copy_file_range, another path.
    let source = m.mnt.parent().unwrap().join("grown-source");
    fs::write(&source, &grown).unwrap();
    let flush = Command::new("cp").args([&path_str(&source), &grown_path]).spawn().unwrap();
    let mut stalled = [checkpoint, xattr, flush];
    for (what, child) in ["coalescefs sync", "setfattr", "cp"].iter().zip(&mut stalled) {
        let finished = child.try_wait().unwrap();
        assert!(finished.is_none(), "{what} did not stall: {finished:?}; the daemon's log:\n{}", m.daemon_log());
    }
    for (name, bytes) in [("checkpointed", &checkpointed), ("xattred", &xattred)] {
        let path = path_str(&m.path(&format!("slow/{name}")));
        let (out, ls_took) = timed(&m, 60, "ls", &["-l", &path_str(&m.path("slow"))]);
        assert!(out.status.success(), "{out:?}");
        let (out, stat_took) = timed(&m, 60, "stat", &["-c", "%s", &path]);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), bytes.len().to_string());
        let (out, cat_took) = timed(&m, 60, "cat", &[&path]);
        assert!(out.stdout == *bytes, "cat of {name} while it is made");
        for took in [ls_took, stat_took, cat_took] {
            assert!(took < ANSWER_WITHIN, "ls -l, stat, cat of {name}: {ls_took:?}, {stat_took:?}, {cat_took:?}");
        }
    }
    let (out, took) = timed(&m, 60, "stat", &["-c", "%n", &grown_path]);
    assert!(out.status.success() && took < ANSWER_WITHIN, "stat of a file made for a flush took {took:?}: {out:?}");
    m.clear_faults();
    for mut child in stalled {
        assert!(child.wait().unwrap().success(), "{child:?} once the backend answers");
    }
    assert_eq!(xattr_of(&m.path("slow/xattred"), "user.why").unwrap(), b"slow");
    assert!(fs::read(m.backing_path("slow/checkpointed")).unwrap() == checkpointed);
    assert!(fs::read(m.backing_path("slow/xattred")).unwrap() == xattred);
    assert!(fs::read(m.path("slow/grown")).unwrap() == grown);
}

/// A backend that stalls in a setattr of a directory's times (`touch -d` of a directory, or tar
/// restoring its directories' times, over a SQLite database another program locks): requests
/// on the new files the log holds, in other directories, answer meanwhile. They waited for the
/// whole stall: the table of held files was locked across the backend's setattr.
#[test]
fn a_stalled_setattr_of_a_directory_holds_up_no_request_on_new_files() {
    // Every stat asks the daemon: the kernel answers none from its attribute cache.
    let m = TestMount::build(&["cache_timeout=0"], &[("COALESCEFS_FAULTS", "")], None);
    fs::create_dir(m.path("other")).unwrap();
    fs::create_dir(m.path("slowdir")).unwrap();
    let held = pattern(1000, 8);
    fs::write(m.path("other/new"), &held).unwrap(); // closed: in the log, held
    m.inject("mutate=stall:120s@slowdir");
    let mut touch =
        Command::new("touch").args(["-m", "-d", "2001-02-03 04:05:06", &path_str(&m.path("slowdir"))]).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let finished = touch.try_wait().unwrap();
    assert!(finished.is_none(), "the setattr did not stall: {finished:?}; the daemon's log:\n{}", m.daemon_log());
    let (out, ls_took) = timed(&m, 60, "ls", &["-l", &path_str(&m.path("other"))]);
    assert!(out.status.success(), "{out:?}");
    let (out, stat_took) = timed(&m, 60, "stat", &["-c", "%s", &path_str(&m.path("other/new"))]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), held.len().to_string());
    let (out, cat_took) = timed(&m, 60, "cat", &[&path_str(&m.path("other/new"))]);
    assert!(out.stdout == held, "cat of the new file while the setattr stalls");
    for took in [ls_took, stat_took, cat_took] {
        assert!(took < ANSWER_WITHIN, "ls -l, stat, cat: {ls_took:?}, {stat_took:?}, {cat_took:?}");
    }
    m.clear_faults();
    assert!(touch.wait().unwrap().success(), "touch once the backend answers");
    // The time touch sets, as it sets it outside the mount.
    let reference = m.mnt.parent().unwrap().join("reference");
    fs::write(&reference, b"").unwrap();
    let out = Command::new("touch").args(["-m", "-d", "2001-02-03 04:05:06", &path_str(&reference)]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let set = fs::metadata(&reference).unwrap().modified().unwrap();
    assert_eq!(fs::metadata(m.path("slowdir")).unwrap().modified().unwrap(), set, "the directory's time set");
}
