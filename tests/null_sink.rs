//! The benchmark's null sink (`coalescefs-null-sink`, the FUSE ceiling of issue 45): it mounts
//! over /dev/fuse and over FUSE over io_uring, keeps a written file's size while discarding its
//! bytes, reads zeros, and leaves no mount behind when unmounted. Root only (it mounts with
//! mount(2)); io_uring where the kernel has it (enable_uring turned on while it mounts and put
//! back).

mod common;

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use common::*;

const SINK: &str = env!("CARGO_BIN_EXE_coalescefs-null-sink");

/// A running null sink, unmounted and waited for on drop if the test did not.
struct Sink {
    child: Child,
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Sink {
    /// Mounts a sink with `-o options`; returns it and the line it printed once serving.
    fn start(options: &str) -> (Sink, String) {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let mut child = Command::new(SINK)
            .arg(&mnt)
            .args(["-o", options])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start coalescefs-null-sink");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        if line.is_empty() {
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            let _ = child.wait();
            panic!("the null sink did not start: {err}");
        }
        (Sink { child, mnt, _dir: dir }, line.trim().to_string())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.mnt.join(name)
    }

    /// Unmounts, waits for the sink to exit and returns what it said on stderr.
    fn unmount(&mut self) -> String {
        let status = Command::new("umount").arg(&self.mnt).status().unwrap();
        assert!(status.success(), "umount {}", self.mnt.display());
        let status = self.child.wait().unwrap();
        let mut err = String::new();
        let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
        assert!(status.success(), "the sink exited with {status}: {err}");
        err
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        if mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mounted(mnt: &Path) -> bool {
    fs::read_to_string("/proc/self/mountinfo").unwrap().contains(&format!(" {} ", path_str(mnt)))
}

/// A write, its size, zeros read back, a truncate and an fsync, then the unmount.
fn writes_keep_their_size(transport: &str) {
    let (mut sink, serving) = Sink::start(&format!("transport={transport},max_write=1M,threads=2,cache_timeout=0"));
    assert_eq!(serving, format!("serving {} over {transport}", sink.mnt.display()));
    assert!(mounted(&sink.mnt));
    let fstype = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(fstype.contains("fuse.coalescefs-null-sink"), "{fstype}");

    let bytes = (3 << 20) + 123;
    let data: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 + 1).collect();
    let mut file = fs::File::create(sink.path("f")).unwrap();
    file.write_all(&data).unwrap();
    file.sync_all().unwrap();
    drop(file);
    assert_eq!(fs::metadata(sink.path("f")).unwrap().len(), bytes as u64);
    // The bytes were discarded: what comes back is zeros, as many as the size says.
    // (Through the page cache the kernel may still hold what was written; dropping it makes
    // the read reach the sink.)
    let _ = drop_kernel_caches();
    let back = fs::read(sink.path("f")).unwrap();
    assert_eq!(back.len(), bytes);
    assert!(back.iter().all(|&b| b == 0), "a null sink read back written bytes");
    fs::OpenOptions::new().write(true).open(sink.path("f")).unwrap().set_len(10).unwrap();
    assert_eq!(fs::metadata(sink.path("f")).unwrap().len(), 10);
    assert!(fs::metadata(sink.path("missing")).is_err());

    let said = sink.unmount();
    assert!(!mounted(&sink.mnt), "the sink's mount is still there");
    let ring_requests: u64 = said
        .split("unmounted; ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no request count in: {said}"));
    if transport == "uring" {
        assert!(ring_requests > 0, "nothing came over the rings: {said}");
    } else {
        assert_eq!(ring_requests, 0, "{said}");
    }
}

fn root(test: &str) -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        skip(test, "the null sink mounts with mount(2), as root only");
    }
    root
}

#[test]
fn the_null_sink_keeps_sizes_over_dev_fuse() {
    if !root("the_null_sink_keeps_sizes_over_dev_fuse") {
        return;
    }
    writes_keep_their_size("dev");
}

#[test]
fn the_null_sink_keeps_sizes_over_io_uring() {
    let test = "the_null_sink_keeps_sizes_over_io_uring";
    if !root(test) {
        return;
    }
    if fs::read_to_string("/proc/sys/kernel/io_uring_disabled").is_ok_and(|v| v.trim() != "0") {
        skip(test, "kernel.io_uring_disabled is set");
        return;
    }
    let Some(_uring) = KernelParameter::uring(test, true) else { return };
    writes_keep_their_size("uring");
}
