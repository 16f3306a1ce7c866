//! Every operation the mount serves, checked against what POSIX (and Linux) say it must do,
//! through a real FUSE mount of a real backing directory.

mod common;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirEntryExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::process::Command;

use common::*;

#[test]
fn written_data_reads_back_and_is_a_plain_file_in_the_backing_directory() {
    let mut m = TestMount::new();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    fs::write(m.path("data.bin"), &data).unwrap();
    assert_eq!(fs::read(m.path("data.bin")).unwrap(), data);
    m.unmount();
    assert_eq!(fs::read(m.backing_path("data.bin")).unwrap(), data, "unmounted, the data is plainly there");
}

/// The daemon keeps nothing in the backing directory: without the log no state at all; with
/// it, the log's file in the state directory and, while the log may be needed, one extended
/// attribute of the backing root naming it, which the mount neither shows nor lets anyone
/// change.
#[test]
fn the_state_lives_outside_the_backing_directory() {
    let mut m = TestMount::with_options(&["log=off"]);
    fs::write(m.path("f"), b"x").unwrap();
    let names_in_backing =
        |m: &TestMount| -> Vec<_> { fs::read_dir(&m.backing).unwrap().map(|e| e.unwrap().file_name()).collect() };
    assert_eq!(names_in_backing(&m), ["f"]);
    assert!(!m.state_dir().exists(), "a mount without the log makes no state directory");
    m.unmount();
    m.set_options(&["log=on"]);
    m.mount();
    assert!(m.log_path().is_file(), "the log is {}", m.log_path().display());
    assert_eq!(names_in_backing(&m), ["f"]);
    let marker = xattr_of(&m.backing, "user.coalescefs.log").expect("the backing root names its log");
    assert_eq!(marker, path_str(&m.log_path()).as_bytes());
    let root = m.path("");
    assert!(!xattr_names(&root).iter().any(|n| n.starts_with("user.coalescefs")), "{:?}", xattr_names(&root));
    assert_eq!(xattr_of(&root, "user.coalescefs.log"), Err(libc::ENODATA));
    let c = cstr(&root);
    // SAFETY: `setxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live slice passed with its own length, which the kernel only reads.
    let set = unsafe { libc::setxattr(c.as_ptr(), c"user.coalescefs.log".as_ptr(), b"x".as_ptr().cast(), 1, 0) };
    assert_eq!((set, errno()), (-1, libc::EPERM));
    // SAFETY: `removexattr` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    let removed = unsafe { libc::removexattr(c.as_ptr(), c"user.coalescefs.log".as_ptr()) };
    assert_eq!((removed, errno()), (-1, libc::EPERM));
    // Other attributes of the root are the application's, listed as ever.
    // SAFETY: `setxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live slice passed with its own length, which the kernel only reads.
    let set = unsafe { libc::setxattr(c.as_ptr(), c"user.mine".as_ptr(), b"1".as_ptr().cast(), 1, 0) };
    assert_eq!(set, 0);
    assert_eq!(xattr_names(&root), ["user.mine"]);
    m.unmount();
    assert_eq!(xattr_of(&m.backing, "user.coalescefs.log"), Err(libc::ENODATA), "a clean unmount needs no log");
}

/// A backing directory where an earlier version kept its state in `.coalescefs` keeps it there,
/// hidden and reserved.
#[test]
fn a_legacy_state_folder_stays_in_use_hidden_and_reserved() {
    let dir = tempfile::tempdir().unwrap();
    let backing = dir.path().join("backing");
    fs::create_dir_all(backing.join(".coalescefs")).unwrap();
    let _state = StateCleanup::of(&backing);
    let m = TestMount::build(&["log=on"], &[], Some(&backing));
    assert!(m.backing_path(".coalescefs/intent.log").is_file(), "the legacy folder holds the log");
    assert!(!m.state_dir().exists());
    let names: Vec<_> = fs::read_dir(&m.mnt).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!names.iter().any(|n| n == ".coalescefs"), "listing shows {names:?}");
    assert_eq!(fs::metadata(m.path(".coalescefs")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    assert_eq!(fs::create_dir(m.path(".coalescefs")).unwrap_err().raw_os_error(), Some(libc::EPERM));
    assert_eq!(File::create(m.path(".coalescefs")).unwrap_err().raw_os_error(), Some(libc::EPERM));
    // Only at the root: the same name deeper down is an ordinary name.
    fs::create_dir(m.path("sub")).unwrap();
    fs::create_dir(m.path("sub/.coalescefs")).unwrap();
}

#[test]
fn chmod_chown_truncate_and_utimens() {
    let m = TestMount::new();
    let p = m.path("f");
    fs::write(&p, b"hello world").unwrap();

    fs::set_permissions(&p, fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(&p).unwrap().mode() & 0o7777, 0o640);
    // A new file lives in the intent log until a checkpoint makes it on the backend.
    m.sync_to_backend();
    assert_eq!(fs::metadata(m.backing_path("f")).unwrap().mode() & 0o7777, 0o640);

    std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.uid(), md.gid()), (65534, 65534));

    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(5).unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"hello");
    f.set_len(8).unwrap();
    assert_eq!(fs::read(&p).unwrap(), b"hello\0\0\0", "growing reads back zeros");
    drop(f);
    // truncate(2) by path, without an open file
    let c = cstr(&p);
    // SAFETY: `truncate` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    assert_eq!(unsafe { libc::truncate(c.as_ptr(), 2) }, 0);
    assert_eq!(fs::read(&p).unwrap(), b"he");

    let times = [
        libc::timespec { tv_sec: 1_000_000_000, tv_nsec: 123_456_789 },
        libc::timespec { tv_sec: 1_500_000_000, tv_nsec: 987_654_321 },
    ];
    // SAFETY: `utimensat` reads a live array of two `timespec`s, as it expects, and any C string
    // passed is NUL-terminated.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) }, 0);
    let md = fs::metadata(&p).unwrap();
    assert_eq!((md.atime(), md.atime_nsec()), (1_000_000_000, 123_456_789));
    assert_eq!((md.mtime(), md.mtime_nsec()), (1_500_000_000, 987_654_321));
}

#[test]
fn readdir_lists_every_entry_with_the_inode_stat_reports() {
    let m = TestMount::new();
    fs::create_dir(m.path("d")).unwrap();
    for i in 0..1500 {
        File::create(m.path(&format!("d/file-with-a-longish-name-{i:05}"))).unwrap();
    }
    let mut seen = 0;
    for entry in fs::read_dir(m.path("d")).unwrap() {
        let entry = entry.unwrap();
        assert_eq!(entry.ino(), fs::symlink_metadata(entry.path()).unwrap().ino(), "{:?}", entry.path());
        seen += 1;
    }
    assert_eq!(seen, 1500);
    // `ls` goes through readdirplus; every name must come back exactly once.
    let out = Command::new("ls").arg("-1f").arg(m.path("d")).output().unwrap();
    let listed = String::from_utf8(out.stdout).unwrap();
    assert_eq!(listed.lines().filter(|l| l.starts_with("file-")).count(), 1500);
}

/// A missing name is cached by the kernel (a negative entry): a second look at it does not reach
/// the daemon, and making it through the mount, by any way, replaces the kernel's entry.
#[test]
fn a_missing_name_is_looked_up_once_and_made_through_the_mount_all_the_same() {
    let m = TestMount::new();
    fs::create_dir(m.path("d")).unwrap();
    let missing = |name: &str| assert!(fs::symlink_metadata(m.path(name)).is_err(), "{name} exists");
    let cached = KERNEL_CACHES.read().unwrap_or_else(std::sync::PoisonError::into_inner);
    missing("d/gone");
    let lookups = m.counter("fuse_lookup_total");
    for _ in 0..10 {
        missing("d/gone");
    }
    assert_eq!(m.counter("fuse_lookup_total"), lookups, "the missing name was looked up again");
    drop(cached);
    // Every way to make a name the kernel holds as missing.
    fs::write(m.path("d/gone"), b"made").unwrap();
    assert_eq!(fs::read(m.path("d/gone")).unwrap(), b"made");
    for name in ["d/dir", "d/link", "d/hard", "d/moved", "d/node"] {
        missing(name);
    }
    fs::create_dir(m.path("d/dir")).unwrap();
    std::os::unix::fs::symlink("gone", m.path("d/link")).unwrap();
    fs::hard_link(m.path("d/gone"), m.path("d/hard")).unwrap();
    fs::write(m.path("d/tmp"), b"moved").unwrap();
    fs::rename(m.path("d/tmp"), m.path("d/moved")).unwrap();
    let node = cstr(&m.path("d/node"));
    // SAFETY: `mknod` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    assert_eq!(unsafe { libc::mknod(node.as_ptr(), libc::S_IFIFO | 0o644, 0) }, 0);
    assert!(fs::metadata(m.path("d/dir")).unwrap().is_dir());
    assert_eq!(fs::read_link(m.path("d/link")).unwrap(), std::path::Path::new("gone"));
    assert_eq!(fs::read(m.path("d/hard")).unwrap(), b"made");
    assert_eq!(fs::read(m.path("d/moved")).unwrap(), b"moved");
    assert!(fs::symlink_metadata(m.path("d/node")).unwrap().file_type().is_fifo());
    // Removed again: missing at once, not after the timeout.
    fs::remove_file(m.path("d/moved")).unwrap();
    missing("d/moved");
    fs::rename(m.path("d/hard"), m.path("d/hard2")).unwrap();
    missing("d/hard");
}

#[test]
fn mkdir_rmdir_and_their_errors() {
    let m = TestMount::new();
    fs::create_dir(m.path("a")).unwrap();
    assert_eq!(fs::create_dir(m.path("a")).unwrap_err().raw_os_error(), Some(libc::EEXIST));
    File::create(m.path("a/f")).unwrap();
    assert_eq!(fs::remove_dir(m.path("a")).unwrap_err().raw_os_error(), Some(libc::ENOTEMPTY));
    assert_eq!(fs::remove_dir(m.path("a/f")).unwrap_err().raw_os_error(), Some(libc::ENOTDIR));
    fs::remove_file(m.path("a/f")).unwrap();
    fs::remove_dir(m.path("a")).unwrap();
    assert!(!m.backing_path("a").exists());
    assert_eq!(fs::remove_dir(m.path("a")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
}

#[test]
fn mknod_makes_a_working_fifo() {
    let m = TestMount::new();
    let p = m.path("fifo");
    let c = cstr(&p);
    // SAFETY: `mkfifo` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    assert!(fs::metadata(&p).unwrap().file_type().is_fifo());
    assert!(fs::symlink_metadata(m.backing_path("fifo")).unwrap().file_type().is_fifo());
    let reader_path = p.clone();
    let reader = std::thread::spawn(move || fs::read(reader_path).unwrap());
    fs::write(&p, b"through the pipe").unwrap();
    assert_eq!(reader.join().unwrap(), b"through the pipe");
}

#[test]
fn unlink_keeps_open_files_readable() {
    let m = TestMount::new();
    fs::write(m.path("f"), b"still here").unwrap();
    let mut f = File::open(m.path("f")).unwrap();
    fs::remove_file(m.path("f")).unwrap();
    assert!(!m.path("f").exists());
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "still here");
    assert_eq!(fs::remove_file(m.path("f")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
}

fn renameat2(from: &std::path::Path, to: &std::path::Path, flags: u32) -> i32 {
    let (a, b) = (cstr(from), cstr(to));
    // SAFETY: `renameat2` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    let ret = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), flags) };
    if ret == 0 {
        0
    } else {
        errno()
    }
}

#[test]
fn rename_plain_noreplace_and_exchange() {
    let m = TestMount::new();
    fs::write(m.path("a"), b"A").unwrap();
    fs::write(m.path("b"), b"B").unwrap();
    fs::create_dir(m.path("dir")).unwrap();

    assert_eq!(renameat2(&m.path("a"), &m.path("b"), libc::RENAME_NOREPLACE), libc::EEXIST);
    assert_eq!(fs::read(m.path("a")).unwrap(), b"A", "a failed NOREPLACE changes nothing");

    assert_eq!(renameat2(&m.path("a"), &m.path("b"), libc::RENAME_EXCHANGE), 0);
    assert_eq!(fs::read(m.path("a")).unwrap(), b"B");
    assert_eq!(fs::read(m.path("b")).unwrap(), b"A");

    fs::rename(m.path("a"), m.path("dir/moved")).unwrap();
    assert!(!m.path("a").exists());
    assert_eq!(fs::read(m.path("dir/moved")).unwrap(), b"B");
    // A close the log took leaves the bytes buffered until the checkpoint: whether b's did
    // depends on how soon after a's close it came (`BURST_GAP`), so the backend is synced first.
    m.sync_to_backend();
    assert_eq!(fs::read(m.backing_path("dir/moved")).unwrap(), b"B");

    fs::rename(m.path("b"), m.path("dir/moved")).unwrap(); // replaces
    assert_eq!(fs::read(m.path("dir/moved")).unwrap(), b"A");
    assert_eq!(renameat2(&m.path("nope"), &m.path("x"), 0), libc::ENOENT);
    fs::create_dir(m.path("full")).unwrap();
    File::create(m.path("full/x")).unwrap();
    assert_eq!(renameat2(&m.path("dir"), &m.path("full"), 0), libc::ENOTEMPTY);
}

#[test]
fn hard_links_share_an_inode() {
    let m = TestMount::new();
    fs::write(m.path("orig"), b"shared").unwrap();
    fs::hard_link(m.path("orig"), m.path("link")).unwrap();
    let (a, b) = (fs::metadata(m.path("orig")).unwrap(), fs::metadata(m.path("link")).unwrap());
    assert_eq!(a.ino(), b.ino());
    assert_eq!(b.nlink(), 2);
    fs::write(m.path("link"), b"changed").unwrap();
    assert_eq!(fs::read(m.path("orig")).unwrap(), b"changed");
    // A new file the log holds is linked held: the backend has both names from the checkpoint.
    m.sync_to_backend();
    assert_eq!(
        fs::metadata(m.backing_path("orig")).unwrap().ino(),
        fs::metadata(m.backing_path("link")).unwrap().ino()
    );
    assert_eq!(fs::hard_link(m.path("orig"), m.path("link")).unwrap_err().raw_os_error(), Some(libc::EEXIST));
}

#[test]
fn symlinks_and_readlink() {
    let m = TestMount::new();
    fs::write(m.path("target"), b"t").unwrap();
    std::os::unix::fs::symlink("target", m.path("rel")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/abs", m.path("dangling")).unwrap();
    assert_eq!(fs::read_link(m.path("rel")).unwrap().to_str(), Some("target"));
    assert_eq!(fs::read(m.path("rel")).unwrap(), b"t");
    assert_eq!(fs::read_link(m.path("dangling")).unwrap().to_str(), Some("/nonexistent/abs"));
    assert!(fs::symlink_metadata(m.path("dangling")).unwrap().file_type().is_symlink());
    assert_eq!(fs::read_link(m.backing_path("rel")).unwrap().to_str(), Some("target"));
    // lchown changes the link, not its target
    let c = cstr(&m.path("rel"));
    // SAFETY: `lchown` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    assert_eq!(unsafe { libc::lchown(c.as_ptr(), 65534, 65534) }, 0);
    assert_eq!(fs::symlink_metadata(m.path("rel")).unwrap().uid(), 65534);
    assert_eq!(fs::metadata(m.path("target")).unwrap().uid(), 0);
}

#[test]
fn a_symlink_swapped_into_the_backing_directory_is_never_followed_by_the_daemon() {
    let m = TestMount::new();
    let outside = tempfile::tempdir().unwrap();
    fs::create_dir(m.path("d")).unwrap();
    File::create(m.path("d/existing")).unwrap(); // the kernel now holds d by inode
                                                 // Behind the mount's back, d becomes a symlink to a directory outside the backing dir.
    fs::rename(m.backing_path("d"), m.backing_path("d.old")).unwrap();
    std::os::unix::fs::symlink(outside.path(), m.backing_path("d")).unwrap();
    let created = File::create(m.path("d/new"));
    assert!(created.is_ok(), "{created:?}");
    assert!(!outside.path().join("new").exists(), "the daemon followed a symlink out of the backing dir");
    // A new file reaches the backend at the checkpoint, through the directory's own handle.
    m.sync_to_backend();
    assert!(!outside.path().join("new").exists(), "the checkpoint followed a symlink out of the backing dir");
    assert!(m.backing_path("d.old/new").exists(), "the file went into the directory the kernel meant");
}

/// `security.capability` (which the kernel asks for before a file's first write and every
/// chown) is answered from memory for a file the mount made; one set or removed through the
/// mount, or present in the backing directory before the mount, reads as it is.
#[test]
fn file_capabilities_read_back_as_set_and_a_new_file_has_none() {
    let m = TestMount::with_options(&["log=off"]);
    fs::write(m.backing_path("old"), b"x").unwrap();
    // VFS_CAP_REVISION_2: cap_net_raw (13) permitted and effective.
    let mut caps = [0u8; 20];
    caps[..4].copy_from_slice(&(0x0200_0001u32).to_le_bytes());
    caps[4..8].copy_from_slice(&(1u32 << 13).to_le_bytes());
    let set = |path: &std::path::Path| {
        let name = std::ffi::CString::new("security.capability").unwrap();
        // SAFETY: `setxattr`: the C strings are NUL-terminated and outlive the call; the buffer is
        // a live slice passed with its own length, which the kernel only reads.
        let r = unsafe { libc::setxattr(cstr(path).as_ptr(), name.as_ptr(), caps.as_ptr().cast(), caps.len(), 0) };
        assert_eq!(r, 0, "setxattr security.capability: {}", std::io::Error::last_os_error());
    };
    set(&m.backing_path("old"));
    assert_eq!(
        xattr_of(&m.path("old"), "security.capability"),
        Ok(caps.to_vec()),
        "set in the backing directory before the mount looked"
    );
    fs::write(m.path("new"), b"x").unwrap();
    assert_eq!(xattr_of(&m.path("new"), "security.capability"), Err(libc::ENODATA));
    set(&m.path("new"));
    assert_eq!(xattr_of(&m.path("new"), "security.capability"), Ok(caps.to_vec()), "set through the mount");
    assert_eq!(xattr_of(&m.backing_path("new"), "security.capability"), Ok(caps.to_vec()));
    let name = std::ffi::CString::new("security.capability").unwrap();
    // SAFETY: `removexattr` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    assert_eq!(unsafe { libc::removexattr(cstr(&m.path("new")).as_ptr(), name.as_ptr()) }, 0);
    assert_eq!(xattr_of(&m.path("new"), "security.capability"), Err(libc::ENODATA), "removed through the mount");
    assert_eq!(xattr_of(&m.backing_path("new"), "security.capability"), Err(libc::ENODATA));
}

#[test]
fn statfs_reports_the_backing_file_system() {
    let m = TestMount::new();
    // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes are
    // a valid value.
    let (mut ours, mut theirs): (libc::statvfs, libc::statvfs) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: `statvfs` writes one value of the type its out-pointer has, into a live local
    // borrowed exclusively for the call; any C string passed is NUL-terminated.
    assert_eq!(unsafe { libc::statvfs(cstr(&m.mnt).as_ptr(), &raw mut ours) }, 0);
    // SAFETY: `statvfs` writes one value of the type its out-pointer has, into a live local
    // borrowed exclusively for the call; any C string passed is NUL-terminated.
    assert_eq!(unsafe { libc::statvfs(cstr(&m.backing).as_ptr(), &raw mut theirs) }, 0);
    assert_eq!(ours.f_blocks * ours.f_frsize, theirs.f_blocks * theirs.f_frsize);
    assert_eq!(ours.f_files, theirs.f_files);
    assert_eq!(ours.f_namemax, theirs.f_namemax);
}

#[test]
fn extended_attributes() {
    let m = TestMount::new();
    let p = m.path("f");
    File::create(&p).unwrap();
    let c = cstr(&p);
    // SAFETY: `setxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live slice passed with its own length, which the kernel only reads.
    let set = |name: &std::ffi::CStr, value: &[u8], flags: i32| unsafe {
        if libc::setxattr(c.as_ptr(), name.as_ptr(), value.as_ptr().cast(), value.len(), flags) == 0 {
            0
        } else {
            errno()
        }
    };
    assert_eq!(set(c"user.color", b"blue", 0), 0);
    assert_eq!(set(c"user.color", b"red", libc::XATTR_CREATE), libc::EEXIST);
    assert_eq!(set(c"user.shape", b"round", libc::XATTR_REPLACE), libc::ENODATA);
    let mut buf = [0u8; 64];
    // SAFETY: `getxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let n = unsafe { libc::getxattr(c.as_ptr(), c"user.color".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n as usize], b"blue");
    // SAFETY: `getxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let size = unsafe { libc::getxattr(c.as_ptr(), c"user.color".as_ptr(), std::ptr::null_mut(), 0) };
    assert_eq!(size, 4);
    // SAFETY: `getxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let n = unsafe { libc::getxattr(c.as_ptr(), c"user.color".as_ptr(), buf.as_mut_ptr().cast(), 2) };
    assert_eq!((n, errno()), (-1, libc::ERANGE));
    // SAFETY: `listxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let n = unsafe { libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n as usize], b"user.color\0");
    // SAFETY: `removexattr` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    assert_eq!(unsafe { libc::removexattr(c.as_ptr(), c"user.color".as_ptr()) }, 0);
    // SAFETY: `getxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let n = unsafe { libc::getxattr(c.as_ptr(), c"user.color".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!((n, errno()), (-1, libc::ENODATA));
}

#[test]
fn fallocate_extends_keeps_size_and_punches_holes() {
    let m = TestMount::new();
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(m.path("f")).unwrap();
    let fd = f.as_raw_fd();
    // SAFETY: `fallocate` takes only integers (a descriptor and plain values) and touches none of
    // our memory; a bad descriptor is an error return.
    assert_eq!(unsafe { libc::fallocate(fd, 0, 0, 1 << 20) }, 0);
    assert_eq!(f.metadata().unwrap().len(), 1 << 20);
    // SAFETY: `fallocate` takes only integers (a descriptor and plain values) and touches none of
    // our memory; a bad descriptor is an error return.
    assert_eq!(unsafe { libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, 1 << 20, 1 << 20) }, 0);
    assert_eq!(f.metadata().unwrap().len(), 1 << 20, "KEEP_SIZE keeps the size");
    (&f).write_all_at_start(&[0xAB; 8192]);
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: `fallocate` takes only integers (a descriptor and plain values) and touches none of
    // our memory; a bad descriptor is an error return.
    assert_eq!(unsafe { libc::fallocate(fd, punch, 0, 4096) }, 0);
    let mut back = vec![0u8; 8192];
    (&f).seek(SeekFrom::Start(0)).unwrap();
    (&f).read_exact(&mut back).unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0), "punched range reads as zeros");
    assert!(back[4096..].iter().all(|&b| b == 0xAB), "the rest is untouched");
}

trait WriteAtStart {
    fn write_all_at_start(self, data: &[u8]);
}

impl WriteAtStart for &File {
    fn write_all_at_start(mut self, data: &[u8]) {
        self.seek(SeekFrom::Start(0)).unwrap();
        self.write_all(data).unwrap();
    }
}

/// copy_file_range of `len` bytes from `off_in` of `src` to `off_out` of `dst`, until all are
/// copied (a call may copy fewer).
fn copy_range(src: &File, mut off_in: i64, dst: &File, mut off_out: i64, len: usize) {
    let mut left = len;
    while left > 0 {
        // SAFETY: `copy_file_range` updates the two offsets, live locals borrowed exclusively for
        // the call; the rest are descriptors and a length.
        let n = unsafe {
            libc::copy_file_range(src.as_raw_fd(), &raw mut off_in, dst.as_raw_fd(), &raw mut off_out, left, 0)
        };
        assert!(n > 0, "copy_file_range: {}", std::io::Error::last_os_error());
        left -= n as usize;
    }
}

#[test]
fn copy_file_range_copies_bytes() {
    let m = TestMount::new();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    fs::write(m.path("src"), &data).unwrap();
    let src = File::open(m.path("src")).unwrap();
    let dst = OpenOptions::new().write(true).create(true).truncate(false).open(m.path("dst")).unwrap();
    copy_range(&src, 1000, &dst, 0, 200_000);
    drop(dst);
    assert_eq!(fs::read(m.path("dst")).unwrap(), &data[1000..201_000]);
}

/// With its defaults a new file lives in memory and the log until a checkpoint; a copy into one
/// made it on the backend, then asked the backend to copy into the held file's data, which the
/// backend did not know: ENOSYS, on which the kernel stops sending copy_file_range for the whole
/// mount (every later `cp` copied through reads and writes). Every copy reaches the daemon now.
#[test]
fn a_copy_into_a_new_file_keeps_copy_file_range_for_the_mount() {
    let m = TestMount::new();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    fs::write(m.path("src"), &data).unwrap();
    m.sync_to_backend();
    let src = File::open(m.path("src")).unwrap();
    for (copy, name) in ["dst1", "dst2", "dst3"].iter().enumerate() {
        let dst = OpenOptions::new().write(true).create_new(true).open(m.path(name)).unwrap();
        let (mut off_in, mut off_out) = (0i64, 0i64);
        // SAFETY: `copy_file_range` updates the two offsets, live locals borrowed exclusively for
        // the call; the rest are descriptors and a length.
        let n = unsafe {
            libc::copy_file_range(src.as_raw_fd(), &raw mut off_in, dst.as_raw_fd(), &raw mut off_out, data.len(), 0)
        };
        assert_eq!(n, data.len() as isize, "copy_file_range: {}", std::io::Error::last_os_error());
        drop(dst);
        assert_eq!(fs::read(m.path(name)).unwrap(), data);
        assert_eq!(m.counter("fuse_copy_file_range_total"), copy as u64 + 1, "copy {copy} reached the daemon");
    }
}

/// `cp` of a file on a SQLite mount: coreutils copies with copy_file_range, which the store
/// answers by copying the file's rows inside the database, so the bytes never pass through FUSE
/// (the kernel moved each twice, as a read and a write, while the store answered ENOSYS). A copy
/// off a unit boundary is refused with EOPNOTSUPP, which the kernel then does through reads and
/// writes: it is right too, and copy_file_range stays on for the mount. Both read back the same
/// after a remount.
#[test]
fn over_sqlite_cp_copies_rows_inside_the_database_and_an_unaligned_copy_goes_through_the_kernel() {
    check_cp_copies_inside_the_store(TestMount::over_sqlite(&[]), 64 << 10, 3 * (64 << 10) + 1000);
}

/// The same over S3 (a SeaweedFS server on 127.0.0.1, 1 MiB units): the server copies each unit
/// object (CopyObject); the last 1,000 bytes are a piece in a segment, not an object, and the
/// kernel copies them through reads and writes.
#[test]
fn over_s3_cp_copies_unit_objects_inside_the_bucket_and_an_unaligned_copy_goes_through_the_kernel() {
    let test = "over_s3_cp_copies_unit_objects_inside_the_bucket_and_an_unaligned_copy_goes_through_the_kernel";
    let Some(server) = common::s3::server_or_skip(test) else { return };
    check_cp_copies_inside_the_store(TestMount::over_s3(&server, "copies", &["unit=1M"]), 1 << 20, 3 << 20);
}

/// `cp` of a file of three units and 1,000 bytes, then an unaligned copy_file_range of two
/// units, and a second `cp`; `inside` is what the store must have copied itself.
fn check_cp_copies_inside_the_store(mut m: TestMount, unit: usize, inside: u64) {
    let data: Vec<u8> = (0..3 * unit + 1000).map(|i| (i % 251) as u8 ^ (i / 4096) as u8).collect();
    fs::write(m.path("src"), &data).unwrap();
    m.sync_to_backend();
    let written_before = m.counter("application_write_bytes_total");
    let out = std::process::Command::new("cp").arg(m.path("src")).arg(m.path("dst")).output().unwrap();
    assert!(out.status.success(), "cp: {}", String::from_utf8_lossy(&out.stderr));
    assert!(fs::read(m.path("dst")).unwrap() == data, "the copy reads back byte for byte");
    assert_eq!(m.counter("backend_copied_bytes_total"), inside, "what the store copied itself");
    let written_through_fuse = m.counter("application_write_bytes_total") - written_before;
    assert!(
        written_through_fuse <= data.len() as u64 - inside,
        "{written_through_fuse} bytes of the copy came through FUSE writes"
    );

    let src = File::open(m.path("src")).unwrap();
    let unaligned = OpenOptions::new().write(true).create_new(true).open(m.path("unaligned")).unwrap();
    copy_range(&src, 1000, &unaligned, 0, 2 * unit);
    drop(unaligned);
    assert!(fs::read(m.path("unaligned")).unwrap() == data[1000..1000 + 2 * unit], "an unaligned copy");
    let copies = m.counter("fuse_copy_file_range_total");
    let out = std::process::Command::new("cp").arg(m.path("src")).arg(m.path("again")).output().unwrap();
    assert!(out.status.success(), "cp: {}", String::from_utf8_lossy(&out.stderr));
    assert!(m.counter("fuse_copy_file_range_total") > copies, "copy_file_range still reaches the daemon");
    drop(src);

    m.unmount();
    m.mount();
    for name in ["dst", "again"] {
        assert!(fs::read(m.path(name)).unwrap() == data, "{name} after a remount");
    }
    assert!(fs::read(m.path("unaligned")).unwrap() == data[1000..1000 + 2 * unit], "after a remount");
}

#[test]
fn seek_data_and_seek_hole_find_the_written_ranges() {
    let m = TestMount::new();
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(m.path("sparse")).unwrap();
    f.set_len(64 << 20).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[1u8; 1 << 20], 32 << 20).unwrap();
    f.sync_all().unwrap();
    // SAFETY: `lseek` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    let data = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_DATA) };
    assert_eq!(data, 32 << 20);
    // SAFETY: `lseek` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    let hole = unsafe { libc::lseek(f.as_raw_fd(), 32 << 20, libc::SEEK_HOLE) };
    assert_eq!(hole, 33 << 20);
    // SAFETY: `lseek` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    let past = unsafe { libc::lseek(f.as_raw_fd(), 64 << 20, libc::SEEK_DATA) };
    assert_eq!((past, errno()), (-1, libc::ENXIO));
}

#[test]
fn fsync_fdatasync_and_fsyncdir_succeed() {
    let m = TestMount::new();
    let mut f = File::create(m.path("f")).unwrap();
    f.write_all(b"durable").unwrap();
    f.sync_all().unwrap();
    f.sync_data().unwrap();
    let dir = File::open(&m.mnt).unwrap();
    // SAFETY: `fsync` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    assert_eq!(unsafe { libc::fsync(dir.as_raw_fd()) }, 0);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"durable");
    // A new file lives in the intent log until a checkpoint makes it on the backend.
    m.sync_to_backend();
    assert_eq!(fs::read(m.backing_path("f")).unwrap(), b"durable");
}

#[test]
fn flock_and_posix_locks_exclude_other_holders() {
    let m = TestMount::new();
    let p = m.path("lockfile");
    let f = File::create(&p).unwrap();
    // SAFETY: `flock` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let other = File::open(&p).unwrap();
    // SAFETY: `flock` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    assert_eq!(unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, -1);
    assert_eq!(errno(), libc::EWOULDBLOCK);
    // Another process sees the lock too (util-linux flock(1)).
    let status = Command::new("flock").args(["-n", p.to_str().unwrap(), "true"]).status().unwrap();
    assert_eq!(status.code(), Some(1), "flock -n must fail while we hold the lock");
    // SAFETY: `flock` takes only integers (a descriptor and plain values) and touches none of our
    // memory; a bad descriptor is an error return.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
    let status = Command::new("flock").args(["-n", p.to_str().unwrap(), "true"]).status().unwrap();
    assert!(status.success());

    // POSIX record locks: held here, seen by another process through F_GETLK.
    let rw = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes are
    // a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as i16;
    lock.l_whence = libc::SEEK_SET as i16;
    lock.l_len = 100;
    // SAFETY: F_SETLK reads one `flock` from `lock`, a live local.
    assert_eq!(unsafe { libc::fcntl(rw.as_raw_fd(), libc::F_SETLK, &lock) }, 0);
    let script = format!(
        "import fcntl,struct,os\nfd=os.open('{}',os.O_RDWR)\ntry:\n fcntl.lockf(fd,fcntl.LOCK_EX|fcntl.LOCK_NB,10,0)\n print('acquired')\nexcept OSError:\n print('blocked')",
        p.display()
    );
    let out = Command::new("python3").args(["-c", &script]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "blocked");
}

#[test]
fn files_created_for_a_user_belong_to_that_user() {
    let m = TestMount::new();
    fs::create_dir(m.path("shared")).unwrap();
    fs::set_permissions(m.path("shared"), fs::Permissions::from_mode(0o777)).unwrap();
    let file = m.path("shared/by-nobody");
    let out = run_as(65534, 65534, "touch", &[file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let out = run_as(65534, 65534, "mkdir", &[m.path("shared/dir-by-nobody").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    for p in [file, m.path("shared/dir-by-nobody")] {
        let md = fs::metadata(&p).unwrap();
        assert_eq!((md.uid(), md.gid()), (65534, 65534), "{p:?}");
    }
    m.sync_to_backend();
    let md = fs::metadata(m.backing_path("shared/by-nobody")).unwrap();
    assert_eq!((md.uid(), md.gid()), (65534, 65534), "the backing file belongs to the user too");
    // And permissions hold: nobody cannot write into a root-only directory.
    fs::create_dir(m.path("private")).unwrap();
    fs::set_permissions(m.path("private"), fs::Permissions::from_mode(0o755)).unwrap();
    let out = run_as(65534, 65534, "touch", &[m.path("private/x").to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr_of(&out).contains("Permission denied"), "{}", stderr_of(&out));
}

/// The kernel leaves clearing set-ID bits to us (FUSE_HANDLE_KILLPRIV_V2): a write or truncate
/// by someone without CAP_FSETID clears set-user-ID, and set-group-ID when group-executable;
/// root's write keeps them; set-group-ID without group execute (mandatory locking) stays.
fn check_set_id_bits_cleared_by_unprivileged_writes(m: &TestMount) {
    fs::create_dir(m.path("setid")).unwrap();
    fs::set_permissions(m.path("setid"), fs::Permissions::from_mode(0o777)).unwrap();
    let mode_of = |name: &str| fs::metadata(m.path(&format!("setid/{name}"))).unwrap().mode() & 0o7777;
    let make = |name: &str, mode: u32| {
        let p = m.path(&format!("setid/{name}"));
        fs::write(&p, b"0123456789").unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        assert_eq!(mode_of(name), mode);
        p.to_str().unwrap().to_string()
    };

    let by_root = make("root-writes", 0o6777);
    OpenOptions::new().append(true).open(&by_root).unwrap().write_all(b"x").unwrap();
    assert_eq!(mode_of("root-writes"), 0o6777, "a writer with CAP_FSETID keeps set-ID bits");

    let written = make("user-writes", 0o6777);
    let out = run_as(65534, 65534, "sh", &["-c", &format!("printf x >> {written}")]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(mode_of("user-writes"), 0o0777, "an unprivileged write clears set-user-ID and set-group-ID");

    let truncated = make("user-truncates", 0o6777);
    let out = run_as(65534, 65534, "truncate", &["-s", "3", &truncated]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(mode_of("user-truncates"), 0o0777, "an unprivileged truncate clears them too");

    let locking = make("mandatory-locking", 0o2766);
    let out = run_as(65534, 65534, "sh", &["-c", &format!("printf x >> {locking}")]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(mode_of("mandatory-locking"), 0o2766, "set-group-ID without group execute stays");
    m.sync_to_backend();
    let backing = fs::metadata(m.backing_path("setid/user-writes")).unwrap().mode() & 0o7777;
    assert_eq!(backing, 0o0777, "the backing file lost the bits as well");
}

#[test]
fn set_id_bits_are_cleared_by_unprivileged_writes_and_truncates() {
    check_set_id_bits_cleared_by_unprivileged_writes(&TestMount::new());
}

#[test]
fn set_id_bits_are_cleared_through_the_kernel_writeback_cache_too() {
    check_set_id_bits_cleared_by_unprivileged_writes(&TestMount::with_options(&["allow_other", "writeback_cache"]));
}

#[test]
fn st_blksize_is_the_unit() {
    let m = TestMount::with_options(&["unit=256K"]);
    File::create(m.path("f")).unwrap();
    assert_eq!(fs::metadata(m.path("f")).unwrap().blksize(), 256 << 10);
    assert_eq!(fs::metadata(&m.mnt).unwrap().blksize(), 256 << 10);
    // Discovered when not given: a power of two above one page (a device hint or 1 MiB).
    let d = TestMount::new();
    File::create(d.path("f")).unwrap();
    let blksize = fs::metadata(d.path("f")).unwrap().blksize();
    assert!(blksize.is_power_of_two() && (8192..=64 << 20).contains(&blksize), "{blksize}");
}

#[test]
fn a_unit_above_the_kernel_request_ceiling_is_named_with_the_sysctl_to_raise() {
    let limit: u64 = fs::read_to_string("/proc/sys/fs/fuse/max_pages_limit").unwrap().trim().parse().unwrap();
    if limit * 4096 >= 16 << 20 {
        skip("a_unit_above_the_kernel_request_ceiling_is_named_with_the_sysctl_to_raise", &format!("fs.fuse.max_pages_limit is {limit}, so the kernel grants the largest request the mount asks for (16 MiB)"));
        return;
    }
    let unit = (limit * 4096 * 2).next_power_of_two().min(64 << 20);
    let m = TestMount::with_options(&[&format!("unit={unit}")]);
    let log = m.daemon_log();
    let want = format!("sysctl fs.fuse.max_pages_limit={}", unit.min(16 << 20) / 4096);
    assert!(log.contains(&want), "daemon log lacks {want:?}:\n{log}");
}

/// SQLite opens every database with O_NOFOLLOW, rsync its temporary files too: the kernel has
/// resolved the name, so the daemon's reopen of the object must not refuse it as a link.
#[test]
fn open_with_o_nofollow_opens_a_regular_file_and_still_refuses_a_symlink() {
    let m = TestMount::new();
    fs::write(m.path("f"), b"hi").unwrap();
    std::os::unix::fs::symlink("f", m.path("link")).unwrap();
    for flags in [libc::O_RDONLY, libc::O_WRONLY, libc::O_RDWR, libc::O_RDWR | libc::O_NOATIME] {
        // SAFETY: `open` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        let fd = unsafe { libc::open(cstr(&m.path("f")).as_ptr(), flags | libc::O_NOFOLLOW) };
        assert!(fd >= 0, "open(O_NOFOLLOW | {flags:#o}) of a regular file: errno {}", errno());
        // SAFETY: `fd` was opened just above by this loop and is closed once.
        unsafe { libc::close(fd) };
    }
    // SAFETY: `open` reads only NUL-terminated C strings that outlive the call; the other arguments
    // are integers.
    let fd = unsafe { libc::open(cstr(&m.path("link")).as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW) };
    assert_eq!((fd, errno()), (-1, libc::ELOOP), "O_NOFOLLOW of a symlink is the kernel's ELOOP");
}

/// GNU tar writes each file, sets the archived times with futimens, then closes it: the flush
/// at close must not stamp the file with the flush time. Checked after the kernel has dropped
/// its cached attributes, in the mount and in the backing directory, with every writeback
/// cache mode, for a small file and one of several units still being flushed.
#[test]
fn times_set_between_the_last_write_and_close_survive_the_flush() {
    for mode in ["auto", "off", "on"] {
        let options = [format!("writeback_cache={mode}"), "unit=64K".to_string()];
        let m = TestMount::with_options(&options.iter().map(String::as_str).collect::<Vec<_>>());
        for (name, len) in [("small", 1000usize), ("large", 1 << 20)] {
            let p = m.path(name);
            let mut f = File::create(&p).unwrap();
            f.write_all(&vec![7u8; len]).unwrap();
            let times = [
                libc::timespec { tv_sec: 1_000_000_000, tv_nsec: 5 },
                libc::timespec { tv_sec: 1_200_000_000, tv_nsec: 700 },
            ];
            // SAFETY: `futimens` reads a live array of two `timespec`s, as it expects, and any C
            // string passed is NUL-terminated.
            assert_eq!(unsafe { libc::futimens(f.as_raw_fd(), times.as_ptr()) }, 0);
            drop(f);
        }
        if drop_kernel_caches().is_none() {
            skip(
                "times_set_between_the_last_write_and_close_survive_the_flush",
                "dropping the kernel's caches needs root",
            );
            return;
        }
        // Seen in the mount before, and after, the checkpoint that makes the small file (held
        // in the intent log) on the backend.
        for name in ["small", "large"] {
            let md = fs::metadata(m.path(name)).unwrap();
            assert_eq!((md.mtime(), md.mtime_nsec()), (1_200_000_000, 700), "{name}, writeback_cache={mode}");
        }
        m.sync_to_backend();
        drop_kernel_caches();
        for name in ["small", "large"] {
            for (where_, md) in [
                ("mount", fs::metadata(m.path(name)).unwrap()),
                ("backing", fs::metadata(m.backing_path(name)).unwrap()),
            ] {
                assert_eq!(
                    (md.mtime(), md.mtime_nsec()),
                    (1_200_000_000, 700),
                    "{name} mtime in the {where_}, writeback_cache={mode}"
                );
                assert_eq!(
                    (md.atime(), md.atime_nsec()),
                    (1_000_000_000, 5),
                    "{name} atime in the {where_}, writeback_cache={mode}"
                );
            }
        }
        // A write after the times were set is a new modification: its time wins again. (Under
        // `auto` that write bypasses the page cache, and the kernel shows the set mtime until
        // it forgets the file: see `an_in_place_write_moves_the_mtime`.)
        let mut f = OpenOptions::new().append(true).open(m.path("small")).unwrap();
        f.write_all(b"more").unwrap();
        drop(f);
        let what = format!("small, writeback_cache={mode}: the appended write's mtime");
        wait_for_the_kernel_to_show_an_mtime_after(&m.path("small"), 1_600_000_000, &what);
    }
}

/// Waits (`wait_for`) until the kernel, its caches dropped, shows `path` with an mtime after
/// `after`: the one the daemon gives it once the kernel has forgotten the file. One drop is not
/// always enough: the kernel holds the inode until the daemon has answered the close's RELEASE,
/// sent after close(2) returns (CI saw `auto` show the mtime the kernel kept, once).
fn wait_for_the_kernel_to_show_an_mtime_after(path: &std::path::Path, after: i64, what: &str) {
    wait_for(
        || {
            drop_kernel_caches();
            fs::metadata(path).unwrap().mtime() > after
        },
        what,
    );
}

/// A write into a file that holds data moves its mtime and ctime. With the writeback cache on
/// or off the kernel shows it at once; under `auto` (the default) a handle opened for writing
/// on such a file bypasses the page cache (FOPEN_DIRECT_IO, to spare the read around a partial
/// page), and the kernel, which keeps a cached file's times itself under its writeback cache,
/// does not stamp writes that bypass it (Linux's `fuse_direct_write_iter`): the mtime shown
/// moves when the kernel forgets the file, the daemon's being right all along. An O_TRUNC open
/// moves it at once in every mode (the kernel's own truncate).
#[test]
fn an_in_place_write_moves_the_mtime() {
    use std::os::unix::fs::FileExt;
    const SET: i64 = 1_200_000_000;
    for mode in ["auto", "off", "on"] {
        let m = TestMount::with_options(&[&format!("writeback_cache={mode}")]);
        for name in ["appended", "written", "truncated"] {
            fs::write(m.path(name), vec![7u8; 10_000]).unwrap();
            let set = [libc::timespec { tv_sec: SET, tv_nsec: 0 }, libc::timespec { tv_sec: SET, tv_nsec: 0 }];
            // SAFETY: `utimensat` reads a NUL-terminated path and an array of two `timespec`s,
            // both live for the call.
            let done = unsafe { libc::utimensat(libc::AT_FDCWD, cstr(&m.path(name)).as_ptr(), set.as_ptr(), 0) };
            assert_eq!(done, 0, "utimensat: errno {}", errno());
        }
        m.sync_to_backend();
        if drop_kernel_caches().is_none() {
            skip("an_in_place_write_moves_the_mtime", "dropping the kernel's caches needs root");
            return;
        }
        OpenOptions::new().append(true).open(m.path("appended")).unwrap().write_all(b"more").unwrap();
        OpenOptions::new().write(true).open(m.path("written")).unwrap().write_all_at(b"more", 5000).unwrap();
        OpenOptions::new().write(true).truncate(true).open(m.path("truncated")).unwrap().write_all(b"new").unwrap();
        let a_minute_ago =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64 - 60;
        for name in ["appended", "written", "truncated"] {
            let md = fs::metadata(m.path(name)).unwrap();
            if mode != "auto" || name == "truncated" {
                assert!(
                    md.mtime() > a_minute_ago,
                    "{name}, writeback_cache={mode}: mtime {} shown at once",
                    md.mtime()
                );
                assert!(
                    md.ctime() > a_minute_ago,
                    "{name}, writeback_cache={mode}: ctime {} shown at once",
                    md.ctime()
                );
            }
            let what = format!("{name}, writeback_cache={mode}: the write's mtime once the kernel forgot the file");
            wait_for_the_kernel_to_show_an_mtime_after(&m.path(name), a_minute_ago, &what);
        }
    }
}

/// The mtime a file shows while the kernel holds it is the one it shows after: under the
/// kernel's writeback cache the kernel keeps the times of what it cached, and a write in the
/// clock tick of the file's creation changes nothing there, so the daemon's later flush must not
/// stamp the backend file with its own time (make then found objects newer than the program
/// linked from them). Every writeback cache mode, with and without the intent log.
#[test]
fn the_mtime_a_file_shows_survives_the_flush_and_the_kernel_forgetting_it() {
    for options in [
        &["log=off"][..],
        &["log=off", "writeback_cache=on"],
        &["log=off", "writeback_cache=off"],
        &[],
        &["log_closes=always"],
    ] {
        let m = TestMount::with_options(options);
        let names: Vec<String> = (0..100).map(|i| format!("f{i}")).collect();
        let mut shown = Vec::new();
        for name in &names {
            let mut f = File::create(m.path(name)).unwrap();
            f.write_all(b"int main(void) { return 0; }\n").unwrap();
            drop(f);
            let md = fs::metadata(m.path(name)).unwrap();
            shown.push((md.mtime(), md.mtime_nsec()));
        }
        if drop_kernel_caches().is_none() {
            skip(
                "the_mtime_a_file_shows_survives_the_flush_and_the_kernel_forgetting_it",
                "dropping the kernel's caches needs root",
            );
            return;
        }
        m.sync_to_backend();
        drop_kernel_caches();
        let changed: Vec<&String> = names
            .iter()
            .zip(&shown)
            .filter(|(name, before)| {
                let md = fs::metadata(m.path(name)).unwrap();
                (md.mtime(), md.mtime_nsec()) != **before
            })
            .map(|(name, _)| name)
            .collect();
        assert!(changed.is_empty(), "{} of 100 files changed their mtime, {options:?}: {changed:?}", changed.len());
    }
}

/// A program running from the mount: every open that would change it fails with ETXTBSY, and
/// none changes a byte. O_RDONLY|O_TRUNC is the subtle one: the kernel checks write access only
/// after the file system's open, so a file system that truncates in its open (FUSE's
/// atomic_o_trunc) emptied the program on the backend though the open failed, and the program
/// died at its next page read (pjdfstest's open::etxtbsy, now and then).
#[test]
fn a_running_program_is_neither_opened_for_writing_nor_truncated() {
    let m = TestMount::new();
    let program = m.path("sleeper");
    fs::copy("/bin/sleep", &program).unwrap();
    fs::set_permissions(&program, fs::Permissions::from_mode(0o755)).unwrap();
    let original = fs::read("/bin/sleep").unwrap();
    let mut child = Command::new(&program).arg("30").spawn().unwrap();
    for flags in [libc::O_WRONLY, libc::O_RDWR, libc::O_RDONLY | libc::O_TRUNC] {
        // SAFETY: `open` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        let fd = unsafe { libc::open(cstr(&program).as_ptr(), flags) };
        let err = errno();
        if fd >= 0 {
            // SAFETY: `fd` was opened just above, checked, and is closed once.
            unsafe { libc::close(fd) };
        }
        assert_eq!((fd, err), (-1, libc::ETXTBSY), "open flags {flags:#x}");
        assert!(fs::read(m.backing_path("sleeper")).unwrap() == original, "flags {flags:#x} changed the program");
    }
    assert!(child.try_wait().unwrap().is_none(), "the program still runs");
    child.kill().unwrap();
    child.wait().unwrap();
    // Not running any more: O_TRUNC truncates, through the kernel's setattr.
    // SAFETY: `open` reads only NUL-terminated C strings that outlive the call; the other arguments
    // are integers.
    let fd = unsafe { libc::open(cstr(&program).as_ptr(), libc::O_RDONLY | libc::O_TRUNC) };
    assert!(fd >= 0, "errno {}", errno());
    // SAFETY: `fd` was opened just above, checked, and is closed once.
    unsafe { libc::close(fd) };
    assert_eq!(fs::metadata(&program).unwrap().len(), 0);
    // With the log, a truncate of a file the log can stand for reaches the backend at its next
    // flush, and a lone close's flush is a log commit: the backend has it after a checkpoint.
    m.sync_to_backend();
    assert_eq!(fs::metadata(m.backing_path("sleeper")).unwrap().len(), 0);
}

/// New files the intent log holds are made on the backend at the next checkpoint, in their
/// directory, by the directory's backend id: the kernel forgetting the directory in between
/// (memory pressure, an admin's `drop_caches`) must not end that id. It did: every checkpoint
/// then failed with ESTALE, and so did the sync at unmount, and the log could not empty. With
/// a file renamed there over a backend one (whose name stays on the backend, hidden, until the
/// checkpoint), and one moved between two forgotten directories.
#[test]
fn held_files_are_made_at_the_checkpoint_after_the_kernel_forgot_their_directory() {
    // The defaults hold a file for a close apart from others (`engine::burst`): 20 ms apart.
    for options in [&[][..], &["log_closes=always"]] {
        let m = TestMount::with_options(options);
        fs::create_dir_all(m.path("d/e")).unwrap();
        fs::write(m.path("d/old"), b"the backend's").unwrap();
        m.sync_to_backend();
        let made_before = m.counter("pending_files_made_total");
        let files = [("d/f0", "held 0"), ("d/f1", "held 1"), ("d/e/moved", "moved up"), ("d/e/over", "renamed over")];
        for (rel, content) in files {
            std::thread::sleep(std::time::Duration::from_millis(20));
            fs::write(m.path(rel), content).unwrap();
        }
        fs::rename(m.path("d/e/over"), m.path("d/old")).unwrap();
        let inode = |rel: &str| fs::symlink_metadata(m.path(rel)).unwrap().ino();
        let served_as = [inode("d/f0"), inode("d/f1")];
        if drop_kernel_caches().is_none() {
            skip(
                "held_files_are_made_at_the_checkpoint_after_the_kernel_forgot_their_directory",
                "dropping the kernel's caches needs root",
            );
            return;
        }
        fs::rename(m.path("d/e/moved"), m.path("d/moved")).unwrap();
        drop_kernel_caches();
        m.sync_to_backend();
        let made = m.counter("pending_files_made_total") - made_before;
        assert_eq!(made, 4, "held files the checkpoint made on the backend, {options:?}");
        for (name, content) in [("f0", "held 0"), ("f1", "held 1"), ("moved", "moved up"), ("old", "renamed over")] {
            let rel = format!("d/{name}");
            assert_eq!(fs::read_to_string(m.backing_path(&rel)).unwrap(), content, "{rel} on the backend, {options:?}");
            assert_eq!(fs::read_to_string(m.path(&rel)).unwrap(), content, "{rel} in the mount, {options:?}");
        }
        assert!(fs::read_dir(m.backing_path("d/e")).unwrap().next().is_none(), "d/e empty on the backend");
        // A file keeps its inode number while the mount lasts: the number a held file was
        // served under is the backend's for it after the checkpoint, and after the kernel
        // forgot it again (git's index compares them), in stat and in readdir alike.
        drop_kernel_caches();
        let listed: Vec<u64> = ["f0", "f1"]
            .iter()
            .map(|name| {
                let found = fs::read_dir(m.path("d")).unwrap().map(Result::unwrap).find(|e| e.file_name() == *name);
                found.unwrap().ino()
            })
            .collect();
        assert_eq!(listed, served_as, "inode numbers in readdir after the checkpoint, {options:?}");
        assert_eq!([inode("d/f0"), inode("d/f1")], served_as, "inode numbers after the checkpoint, {options:?}");
    }
}

/// An ioctl the mount does not implement fails as on a file without it (ENOTTY), and quietly:
/// Python asks every file it opens whether it is a terminal (TCGETS), and each one logged a
/// warning, so that the daemon's log of the crash harness was mostly these.
#[test]
fn an_ioctl_the_mount_does_not_implement_is_enotty_without_a_log_line() {
    let m = TestMount::new();
    fs::write(m.path("f"), b"data").unwrap();
    let f = File::open(m.path("f")).unwrap();
    let mut termios = std::mem::MaybeUninit::<libc::termios>::uninit();
    // SAFETY: the ioctl reads or writes one value of the type its request is defined with, a live
    // value borrowed for the call.
    let answer = unsafe { libc::ioctl(f.as_raw_fd(), libc::TCGETS, termios.as_mut_ptr()) };
    assert_eq!((answer, errno()), (-1, libc::ENOTTY), "TCGETS of a regular file on the mount");
    let out = Command::new("python3")
        .args(["-c", "import sys; open(sys.argv[1]).read()", &path_str(&m.path("f"))])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let log = m.daemon_log();
    assert!(!log.contains("ioctl"), "the daemon logged an ioctl:\n{log}");
}

/// The kernel asks the daemon for `security.capability` before the first write(2) of each file
/// (and again once its attributes change) and before every chown: a round trip per new file
/// that the writeback cache cannot absorb (GNU tar: two of its ~11 per entry). With `xattr=off`
/// the first of them is answered ENOSYS and the kernel asks no more; extended attributes are
/// then unsupported (EOPNOTSUPP), as on a file system without them.
#[test]
fn xattr_off_ends_the_kernels_capability_questions_before_writes() {
    let writes = |m: &TestMount| {
        for i in 0..20 {
            fs::write(m.path(&format!("w{i}")), [7u8; 100]).unwrap();
        }
        let mut f = fs::File::create(m.path("f")).unwrap();
        for _ in 0..50 {
            f.write_all(&[7u8; 100]).unwrap();
        }
    };
    // Listed once the daemon served one.
    let getxattrs = |m: &TestMount| {
        m.control("stats").lines().find_map(|l| l.strip_prefix("fuse_getxattr_total")?.trim().parse::<u64>().ok())
    };
    let mut m = TestMount::new();
    let before = getxattrs(&m).unwrap_or(0);
    writes(&m);
    let asked = getxattrs(&m).unwrap_or(0) - before;
    assert!(asked >= 20, "the default: {asked} getxattr requests for the first writes of 21 files");
    let c = cstr(&m.path("f"));
    // SAFETY: `setxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live slice passed with its own length, which the kernel only reads.
    let set = unsafe { libc::setxattr(c.as_ptr(), c"user.kept".as_ptr(), b"1".as_ptr().cast(), 1, 0) };
    assert_eq!(set, 0, "xattrs work by default: errno {}", errno());
    m.unmount();

    m.set_options(&["xattr=off"]);
    m.mount();
    writes(&m);
    assert!(getxattrs(&m).unwrap_or(0) <= 1, "xattr=off: the kernel stopped asking after the first answer");
    assert_eq!(fs::read(m.path("f")).unwrap(), vec![7u8; 5000]);
    assert_eq!(xattr_of(&m.path("f"), "user.kept"), Err(libc::EOPNOTSUPP));
    // SAFETY: `setxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live slice passed with its own length, which the kernel only reads.
    let set = unsafe { libc::setxattr(c.as_ptr(), c"user.other".as_ptr(), b"1".as_ptr().cast(), 1, 0) };
    assert_eq!((set, errno()), (-1, libc::EOPNOTSUPP));
    m.unmount();
    assert_eq!(xattr_of(&m.backing.join("f"), "user.kept"), Ok(b"1".to_vec()), "the backing file keeps its attributes");
}

/// A client signalled while it waits on the mount makes the kernel send FUSE_INTERRUPT, which the
/// daemon (fuser) answers ENOSYS, often after its answer to the interrupted request: the kernel
/// no longer holds that request then and refuses the reply (ENOENT). Nothing waits for it. The
/// signalled writes and fsyncs complete whole, and the daemon's log does not call the refused
/// reply an error (it did, "Failed to send FUSE reply", about once a signal here: as many lines
/// as the log's rate limit let through, 5 a mount).
#[test]
fn requests_interrupted_by_signals_complete_and_log_no_error() {
    extern "C" fn ignore(_: libc::c_int) {}
    // SAFETY: `sigaction` with a zeroed struct (no flags: no SA_RESTART, so the signal
    // interrupts the waits) and a handler that does nothing, which is async-signal-safe.
    // SIGUSR1 is sent to this test's worker thread only.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = ignore as extern "C" fn(libc::c_int) as usize;
        assert_eq!(libc::sigaction(libc::SIGUSR1, &raw const action, std::ptr::null_mut()), 0);
    }
    let m = TestMount::new();
    let path = m.path("signalled");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (thread_id_tx, thread_id_rx) = std::sync::mpsc::channel();
    let worker = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            use std::os::unix::fs::FileExt;
            // SAFETY: `pthread_self` takes no arguments and cannot fail.
            thread_id_tx.send(unsafe { libc::pthread_self() }).unwrap();
            let file = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path).unwrap();
            let mut expected = Vec::new();
            let mut rounds = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let at = (rounds * 4099) as usize % ((64 << 10) - 100);
                let piece = [(rounds % 251) as u8 + 1; 100];
                retry_interrupted(|| file.write_all_at(&piece, at as u64));
                expected.resize(expected.len().max(at + 100), 0);
                expected[at..at + 100].copy_from_slice(&piece);
                retry_interrupted(|| file.sync_all());
                retry_interrupted(|| fs::metadata(&path).map(|_| ()));
                rounds += 1;
            }
            (rounds, expected)
        })
    };
    let worker_thread = thread_id_rx.recv().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    let mut signals = 0;
    while std::time::Instant::now() < deadline {
        // SAFETY: the worker thread is alive until `stop` is set below and it is joined.
        assert_eq!(unsafe { libc::pthread_kill(worker_thread, libc::SIGUSR1) }, 0);
        signals += 1;
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (rounds, expected) = worker.join().unwrap();
    assert!(rounds > 10 && signals > 100, "{rounds} write + fsync rounds, {signals} signals");
    assert!(fs::read(&path).unwrap() == expected, "the signalled writes read back whole");
    let log = m.daemon_log();
    let refused = log.lines().filter(|l| l.contains("Failed to send FUSE reply")).count();
    assert_eq!(
        refused,
        0,
        "{refused} reply failures logged as errors; the first: {:?}",
        log.lines().find(|l| l.contains("FUSE reply"))
    );
}

/// `op`, again while a signal interrupted it.
fn retry_interrupted(mut op: impl FnMut() -> std::io::Result<()>) {
    loop {
        match op() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            done => return done.unwrap(),
        }
    }
}
