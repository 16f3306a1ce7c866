//! The mount at scale: more objects than the daemon has descriptors, and directories read a
//! batch at a time. The kernel may cache any number of inodes; the daemon keeps a bounded
//! number of descriptors for them and finds the others again by file handle.

mod common;

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use common::*;

/// Six thousand files made, listed, stat'ed, changed, renamed and removed by a daemon that may
/// open 1,024 descriptors: every step past the limit used to fail with EMFILE (file 19,983 of
/// an extraction where the limit was 20,000).
#[test]
fn a_daemon_with_fewer_descriptors_than_cached_files_serves_them_all() {
    const FILES: usize = 6000;
    let m = TestMount::with_descriptor_limit(&["allow_other"], 1024);
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..FILES {
        let mut f = File::create(m.path(&format!("d/f{i}"))).unwrap();
        write!(f, "file {i}").unwrap();
    }
    // New small files live in the intent log until a checkpoint makes them backend files.
    m.sync_to_backend();
    let limit = m.counter("node_fds_limit");
    assert!(limit < FILES as u64 / 4, "the daemon's budget ({limit}) is far below the files made");
    let listed: BTreeSet<String> =
        fs::read_dir(m.path("d")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(listed.len(), FILES, "readdir lists every file once");
    for i in 0..FILES {
        let p = m.path(&format!("d/f{i}"));
        assert_eq!(fs::metadata(&p).unwrap().len(), format!("file {i}").len() as u64);
    }
    // The first files' descriptors were closed long ago: open, write, chmod and read them
    // again, through handles the kernel still holds.
    let early: Vec<File> =
        (0..200).map(|i| OpenOptions::new().read(true).write(true).open(m.path(&format!("d/f{i}"))).unwrap()).collect();
    for (i, f) in early.iter().enumerate() {
        f.set_permissions(fs::Permissions::from_mode(0o600)).unwrap();
        let mut text = String::new();
        (&*f).read_to_string(&mut text).unwrap();
        assert_eq!(text, format!("file {i}"));
    }
    drop(early);
    assert!(m.counter("node_fds_open") <= limit, "the descriptors held stay within the bound");
    assert!(m.counter("node_fds_reopened_total") > 0, "objects were found again by handle");
    for i in (0..FILES).step_by(2) {
        fs::rename(m.path(&format!("d/f{i}")), m.path(&format!("d/g{i}"))).unwrap();
    }
    for i in 0..FILES {
        let name = if i % 2 == 0 { format!("d/g{i}") } else { format!("d/f{i}") };
        let md = fs::metadata(m.path(&name)).unwrap();
        assert_eq!(md.mode() & 0o777, if i < 200 { 0o600 } else { 0o644 }, "{name}");
        fs::remove_file(m.path(&name)).unwrap();
    }
    assert_eq!(fs::read_dir(m.path("d")).unwrap().count(), 0);
    fs::remove_dir(m.path("d")).unwrap();
}

/// A directory listed while it changes: every entry present throughout is listed exactly once,
/// whatever the size of the kernel's requests, and "." and ".." once each.
#[test]
fn a_large_directory_lists_each_entry_once_in_batches() {
    let m = TestMount::new();
    fs::create_dir(m.path("d")).unwrap();
    let names: BTreeSet<String> = (0..3000).map(|i| format!("entry-with-a-longer-name-{i:05}")).collect();
    for name in &names {
        File::create(m.path(&format!("d/{name}"))).unwrap();
    }
    let mut seen = Vec::new();
    // SAFETY: `opendir` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    let dir = unsafe { libc::opendir(cstr(&m.path("d")).as_ptr()) };
    assert!(!dir.is_null());
    loop {
        // SAFETY: `dir` is the non-null `DIR` opendir returned above, used by this thread alone and
        // closed after the loop.
        let ent = unsafe { libc::readdir64(dir) };
        if ent.is_null() {
            break;
        }
        // SAFETY: `ent` is non-null and stays valid until the next readdir64 on `dir`; its `d_name`
        // is NUL-terminated, and the name is copied out at once.
        let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) }.to_string_lossy().into_owned();
        seen.push(name);
        if seen.len() == 1000 {
            // Changes in the middle of the listing: entries not yet listed may or may not be
            // seen (POSIX), the rest never twice.
            File::create(m.path("d/zz-added")).unwrap();
        }
    }
    // SAFETY: `dir` came from opendir above, and is closed once, here.
    unsafe { libc::closedir(dir) };
    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "no entry listed twice");
    for name in &names {
        assert!(unique.contains(name), "{name} missing");
    }
    assert!(unique.contains(&".".to_string()) && unique.contains(&"..".to_string()));
}

/// syncfs on the mount (`coalescefs sync`, `sync -f`) after files were deleted whose backend
/// descriptors the daemon had let go. In its writeback cache mode the kernel writes a file's
/// ctime back once more after the unlink or rename that took its last name, and records a
/// failure of that against the whole file system, where the next syncfs reports it: the
/// backend, finding a deleted file by its handle no more, answered ESTALE (after a git commit
/// of 30,000 files, `coalescefs sync` failed so). Over held files and files on the backend,
/// with the log and without.
#[test]
fn syncfs_after_files_whose_descriptors_went_are_deleted_or_replaced_succeeds() {
    for options in [&["allow_other"][..], &["allow_other", "log=off"]] {
        for on_backend in [true, false] {
            syncfs_after_deleting_files_without_descriptors(options, on_backend);
        }
    }
}

fn syncfs_after_deleting_files_without_descriptors(options: &[&str], on_backend: bool) {
    const FILES: usize = 200;
    let m = TestMount::with_descriptor_limit(options, 700);
    let limit = m.counter("node_fds_limit");
    assert!(limit < FILES as u64, "the daemon's budget ({limit}) is below the files touched");
    let path = |name: &str| m.path(&format!("d/{name}"));
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..FILES {
        fs::write(path(&format!("f{i}")), [b'x'; 100]).unwrap();
        fs::write(path(&format!("o{i}")), [b'o'; 100]).unwrap();
    }
    if on_backend {
        m.sync_to_backend();
    }
    let syncfs = || {
        let dir = File::open(&m.mnt).unwrap();
        // SAFETY: syncfs takes a descriptor `dir` holds open and touches none of our memory.
        let result = unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir)) };
        (result == 0).then_some(()).ok_or_else(std::io::Error::last_os_error)
    };
    syncfs().unwrap();
    for i in 0..FILES {
        // Rewritten and fsynced: with the log, their bytes wait in it after the close.
        let mut f = OpenOptions::new().write(true).open(path(&format!("f{i}"))).unwrap();
        f.write_all(&[b'z'; 120]).unwrap();
        f.sync_all().unwrap();
    }
    for i in 0..FILES {
        // Other files take the daemon's descriptors.
        File::open(path(&format!("o{i}"))).unwrap().read_to_end(&mut Vec::new()).unwrap();
    }
    for i in 0..FILES {
        let (target, new) = (path(&format!("f{i}")), path(&format!("n{i}")));
        let mut f = File::create(&new).unwrap();
        f.write_all(&[b'y'; 50]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        if i % 2 == 1 {
            fs::rename(&new, &target).unwrap();
        } else {
            fs::remove_file(&target).unwrap();
        }
    }
    if let Err(e) = syncfs() {
        panic!("syncfs after the deletions ({options:?}, files on the backend: {on_backend}): {e}");
    }
    m.sync_to_backend();
    for i in 0..FILES {
        let read = fs::read(path(&format!("f{i}")));
        if i % 2 == 1 {
            assert_eq!(read.unwrap(), [b'y'; 50], "f{i}: the file renamed over it");
        } else {
            assert_eq!(read.unwrap_err().kind(), std::io::ErrorKind::NotFound, "f{i}: removed");
        }
    }
}
