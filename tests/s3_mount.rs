//! The S3 backend over a real FUSE mount and a real S3 server (SeaweedFS, started by
//! `scripts/s3-server` on 127.0.0.1): `coalescefs mount s3://BUCKET/PREFIX MOUNTPOINT -o
//! endpoint=...`, the intent log on as by default. A tree written reads back after a remount
//! and on a mount from an empty state directory (restored from the bucket's manifest); a
//! second writing mount of the prefix is refused; a kill -9 of the daemon loses nothing
//! fsynced, and the same state directory takes its lease back.

mod common;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::s3::{server_or_skip, S3Server};
use common::{coalescefs, daemon_log_in, kill_daemon_of, path_str, runtime_dir, stderr_of, unmount_in_drop, BIN};

use coalescefs::backend::s3::layout::LeaseHolder;
use coalescefs::backend::s3::objects::{ObjectStore, PutCondition};

const BUCKET: &str = "mounts";

/// One mount of `s3://mounts/PREFIX` with a state directory of its own.
struct S3Mount {
    dir: tempfile::TempDir,
    source: String,
    endpoint: String,
    env: Vec<(String, String)>,
    mnt: PathBuf,
    state: PathBuf,
    mounted: bool,
}

impl S3Mount {
    fn new(server: &S3Server, prefix: &str) -> S3Mount {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let state = dir.path().join("state");
        S3Mount {
            source: format!("s3://{BUCKET}/{prefix}"),
            endpoint: server.endpoint.clone(),
            env: vec![
                ("AWS_ACCESS_KEY_ID".into(), server.access_key.clone()),
                ("AWS_SECRET_ACCESS_KEY".into(), server.secret_key.clone()),
            ],
            dir,
            mnt,
            state,
            mounted: false,
        }
    }

    /// Another mount of the same prefix, with a state directory of its own (another machine).
    fn elsewhere(&self) -> S3Mount {
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let state = dir.path().join("state");
        S3Mount {
            dir,
            source: self.source.clone(),
            endpoint: self.endpoint.clone(),
            env: self.env.clone(),
            mnt,
            state,
            mounted: false,
        }
    }

    fn try_mount(&mut self) -> std::process::Output {
        let options =
            format!("endpoint={},region=us-east-1,io_timeout=20s,state={}", self.endpoint, path_str(&self.state));
        let out = Command::new(BIN)
            .args(["mount", &self.source, &path_str(&self.mnt), "-o", &options])
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .unwrap();
        self.mounted = out.status.success();
        out
    }

    fn mount(&mut self) {
        let out = self.try_mount();
        assert!(out.status.success(), "mount failed: {}\n{}", stderr_of(&out), self.daemon_log());
    }

    fn unmount(&mut self) {
        let out = coalescefs(&["umount", &path_str(&self.mnt)]);
        assert!(out.status.success(), "umount failed: {}\n{}", stderr_of(&out), self.daemon_log());
        self.mounted = false;
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    fn runtime_dir(&self) -> PathBuf {
        runtime_dir(Path::new(&self.source))
    }

    fn daemon_log(&self) -> String {
        daemon_log_in(&self.runtime_dir())
    }

    fn kill_daemon(&mut self) {
        kill_daemon_of(&self.runtime_dir(), &self.mnt);
        self.mounted = false;
    }
}

impl Drop for S3Mount {
    fn drop(&mut self) {
        if self.mounted {
            unmount_in_drop(&self.mnt);
        }
        let _ = &self.dir;
        if !std::thread::panicking() {
            let _ = fs::remove_dir_all(self.runtime_dir());
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8) ^ (i / 4096) as u8).collect()
}

/// A small tree: files from empty to 3 MiB and a bit, a directory, a symlink.
fn make_tree(root: &Path) {
    fs::create_dir_all(root.join("etc/conf.d")).unwrap();
    fs::write(root.join("etc/conf.d/a.conf"), pattern(1000, 1)).unwrap();
    fs::write(root.join("etc/empty"), b"").unwrap();
    fs::write(root.join("big.img"), pattern((3 << 20) + 4097, 2)).unwrap();
    std::os::unix::fs::symlink("etc/conf.d/a.conf", root.join("link")).unwrap();
}

fn check_tree(root: &Path) {
    assert_eq!(fs::read(root.join("etc/conf.d/a.conf")).unwrap(), pattern(1000, 1));
    assert_eq!(fs::read(root.join("etc/empty")).unwrap(), b"");
    assert!(fs::read(root.join("big.img")).unwrap() == pattern((3 << 20) + 4097, 2), "big.img differs");
    assert_eq!(fs::read_link(root.join("link")).unwrap(), Path::new("etc/conf.d/a.conf"));
}

fn keys(server: &S3Server, prefix: &str) -> Vec<(String, u64)> {
    let client = server.client(BUCKET, Duration::from_secs(20));
    client.list(prefix).unwrap().into_iter().map(|l| (l.key, l.size)).collect()
}

#[test]
fn a_tree_reads_back_after_a_remount_and_from_an_empty_state_directory() {
    let test = "a_tree_reads_back_after_a_remount_and_from_an_empty_state_directory";
    let Some(server) = server_or_skip(test) else { return };
    server.client(BUCKET, Duration::from_secs(20));
    let mut m = S3Mount::new(&server, "tree");
    m.mount();
    make_tree(&m.mnt);
    m.unmount();

    let objects = keys(&server, "tree/");
    let units: Vec<_> = objects.iter().filter(|(k, _)| k.starts_with("tree/units/")).collect();
    assert!(units.iter().all(|(_, size)| *size <= 1 << 20), "no object larger than the unit: {units:?}");
    assert_eq!(units.iter().map(|(_, s)| s).sum::<u64>(), 1000 + (3 << 20) + 4097, "the files' bytes, once");
    assert_eq!(objects.iter().filter(|(k, _)| k.starts_with("tree/manifests/")).count(), 1, "{objects:?}");
    assert!(!objects.iter().any(|(k, _)| k == "tree/lease"), "a clean unmount releases the lease");

    m.mount();
    check_tree(&m.mnt);
    m.unmount();

    let mut other = m.elsewhere();
    other.mount();
    check_tree(&other.mnt);
    assert!(other.daemon_log().contains("restored from manifest"), "{}", other.daemon_log());
    // It writes on from there, and the first state directory takes the bucket's newer tree.
    fs::write(other.path("from-elsewhere"), b"second machine").unwrap();
    other.unmount();
    m.mount();
    assert_eq!(fs::read(m.path("from-elsewhere")).unwrap(), b"second machine");
    check_tree(&m.mnt);
    m.unmount();
}

#[test]
fn a_second_writing_mount_of_a_prefix_is_refused_here_and_from_another_machine() {
    let test = "a_second_writing_mount_of_a_prefix_is_refused_here_and_from_another_machine";
    let Some(server) = server_or_skip(test) else { return };
    let client = server.client(BUCKET, Duration::from_secs(20));
    let mut first = S3Mount::new(&server, "shared");
    first.mount();
    fs::write(first.path("f"), b"first").unwrap();
    // On this machine: the source's runtime directory is taken.
    let mut second = first.elsewhere();
    let out = second.try_mount();
    assert!(!out.status.success(), "a second writer mounted");
    let said = stderr_of(&out);
    assert!(said.contains("is already mounted by another coalescefs on this machine"), "{said}");
    assert!(fs::read(first.path("f")).unwrap() == b"first", "the first mount still answers");
    first.unmount();

    // From another machine: its lease is in the bucket.
    let theirs = LeaseHolder {
        id: "another-machines-id".into(),
        host: "other-machine".into(),
        state_dir: "/var/lib/elsewhere".into(),
        pid: 4242,
        since: 1,
    };
    client.put("shared/lease", &theirs.encode(), PutCondition::IfAbsent).unwrap();
    let out = second.try_mount();
    assert!(!out.status.success(), "mounted over another machine's lease");
    let said = stderr_of(&out);
    assert!(said.contains("is mounted for writing by another coalescefs: host other-machine"), "{said}");
    assert!(said.contains("delete the object shared/lease"), "it says what to do: {said}");
    assert!(fs::read_dir(&second.mnt).unwrap().next().is_none(), "nothing mounted there");
    assert!(!second.state.join("namespace.db").exists(), "a refused mount restores nothing");
    client.delete("shared/lease").unwrap();
    second.mount();
    assert_eq!(fs::read(second.path("f")).unwrap(), b"first");
    second.unmount();
}

/// `coalescefs forget s3://...` of a mount killed (its lease left in the bucket, its log holding
/// an fsync the bucket lacks): refused without --discard, everything kept; with it, the state
/// directory goes and the lease is released, so that another state directory mounts the prefix
/// (before, only deleting the lease object by hand let it).
#[test]
fn forget_of_an_s3_source_releases_its_lease_and_refuses_to_lose_logged_writes_unless_told() {
    let test = "forget_of_an_s3_source_releases_its_lease_and_refuses_to_lose_logged_writes_unless_told";
    let Some(server) = server_or_skip(test) else { return };
    server.client(BUCKET, Duration::from_secs(20));
    let mut m = S3Mount::new(&server, "forgotten");
    m.mount();
    fs::write(m.path("checkpointed"), b"in the bucket").unwrap();
    let out = coalescefs(&["sync", &path_str(&m.mnt)]);
    assert!(out.status.success(), "coalescefs sync: {}", stderr_of(&out));
    let mut f = fs::File::create(m.path("logged")).unwrap();
    f.write_all(b"only in the log").unwrap();
    f.sync_all().unwrap();
    m.kill_daemon();
    drop(f);
    let lease_there = || keys(&server, "forgotten/").iter().any(|(k, _)| k == "forgotten/lease");
    assert!(lease_there(), "a killed mount keeps its lease");
    let forget = |extra: &[&str]| {
        let options = format!("endpoint={},io_timeout=20s", m.endpoint);
        Command::new(BIN)
            .args(["forget", &m.source, "--state", &path_str(&m.state), "-o", &options])
            .args(extra)
            .envs(m.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .unwrap()
    };

    let out = forget(&[]);
    assert!(!out.status.success(), "forget lost logged writes without --discard");
    assert!(stderr_of(&out).contains("--discard"), "{}", stderr_of(&out));
    assert!(m.state.join("intent.log").exists() && lease_there(), "a refused forget changed something");

    let out = forget(&["--discard"]);
    assert!(out.status.success(), "forget --discard: {}", stderr_of(&out));
    assert!(!m.state.exists(), "the state directory is still there");
    assert!(!lease_there(), "the lease is still in the bucket");
    let mut other = m.elsewhere();
    other.mount();
    assert_eq!(fs::read(other.path("checkpointed")).unwrap(), b"in the bucket");
    assert!(fs::metadata(other.path("logged")).is_err(), "the discarded write came back");
    other.unmount();

    // Without the endpoint it cannot reach the lease: said, nothing removed.
    m.mount();
    m.kill_daemon();
    let out = coalescefs(&["forget", &m.source, "--state", &path_str(&m.state), "--discard"]);
    assert!(!out.status.success() && stderr_of(&out).contains("endpoint"), "{}", stderr_of(&out));
    assert!(m.state.exists(), "a forget that could not release the lease removed the state directory");
}

/// `coalescefs recover s3://...` (what a mount whose log is damaged names): the log's batches
/// applied into the namespace and the bucket, the crash marker cleared and the lease released,
/// so that another state directory mounts the prefix with the fsynced writes in it.
#[test]
fn recover_of_an_s3_source_puts_what_the_log_held_into_the_bucket_and_releases_the_lease() {
    let test = "recover_of_an_s3_source_puts_what_the_log_held_into_the_bucket_and_releases_the_lease";
    let Some(server) = server_or_skip(test) else { return };
    server.client(BUCKET, Duration::from_secs(20));
    let mut m = S3Mount::new(&server, "recovered");
    m.mount();
    let mut f = fs::File::create(m.path("logged")).unwrap();
    for i in 0..10u8 {
        f.write_all(&pattern(900, i)).unwrap();
        f.sync_all().unwrap();
    }
    m.kill_daemon();
    drop(f);
    let options = format!("endpoint={},io_timeout=20s", m.endpoint);
    let out = Command::new(BIN)
        .args(["recover", &m.source, "--state", &path_str(&m.state), "-o", &options])
        .envs(m.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    assert!(out.status.success(), "recover: {}", stderr_of(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("every batch intact and applied"), "{out:?}");
    assert!(!keys(&server, "recovered/").iter().any(|(k, _)| k == "recovered/lease"), "the lease was kept");

    let expected: Vec<u8> = (0..10u8).flat_map(|i| pattern(900, i)).collect();
    let mut other = m.elsewhere();
    other.mount();
    assert_eq!(fs::read(other.path("logged")).unwrap(), expected, "the log's writes are not in the bucket");
    other.unmount();
    // The state directory recovered needs no replay: it mounts the bucket's newer tree.
    m.mount();
    assert!(!m.daemon_log().contains("replayed the intent log"), "{}", m.daemon_log());
    assert_eq!(fs::read(m.path("logged")).unwrap(), expected);
    m.unmount();

    let out = coalescefs(&["recover", "/srv/nowhere", "-o", "endpoint=http://127.0.0.1:1"]);
    assert!(!out.status.success() && stderr_of(&out).contains("s3://"), "{}", stderr_of(&out));
}

#[test]
fn kill_9_of_the_daemon_loses_nothing_fsynced_and_the_same_state_directory_takes_its_lease_back() {
    let test = "kill_9_of_the_daemon_loses_nothing_fsynced_and_the_same_state_directory_takes_its_lease_back";
    let Some(server) = server_or_skip(test) else { return };
    server.client(BUCKET, Duration::from_secs(20));
    let mut m = S3Mount::new(&server, "crash");
    m.mount();
    // Small fsyncs (the intent log's), a whole-unit file (the store's), and a rename.
    let mut small = fs::File::create(m.path("small.log")).unwrap();
    for i in 0..20u8 {
        small.write_all(&pattern(700, i)).unwrap();
        small.sync_all().unwrap();
    }
    let big = pattern(2 << 20, 9);
    let mut f = fs::File::create(m.path("big.tmp")).unwrap();
    f.write_all(&big).unwrap();
    f.sync_all().unwrap();
    fs::rename(m.path("big.tmp"), m.path("big")).unwrap();
    fs::File::open(&m.mnt).unwrap().sync_all().unwrap();
    m.kill_daemon();
    assert!(keys(&server, "crash/").iter().any(|(k, _)| k == "crash/lease"), "a killed mount keeps its lease");

    m.mount();
    assert!(m.daemon_log().contains("taking back this state directory's own lease"), "{}", m.daemon_log());
    let expected: Vec<u8> = (0..20u8).flat_map(|i| pattern(700, i)).collect();
    assert_eq!(fs::read(m.path("small.log")).unwrap(), expected, "every fsynced piece is back");
    assert!(fs::read(m.path("big")).unwrap() == big, "the fsynced big file is back under its new name");
    m.unmount();
    // Replayed and checkpointed: another machine sees it all too.
    let mut other = m.elsewhere();
    other.mount();
    assert_eq!(fs::read(other.path("small.log")).unwrap(), expected);
    other.unmount();
}
