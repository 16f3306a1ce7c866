//! Extended attributes answer through the mount what the backing file system answers, for
//! every file type and every namespace: `ls -l` asks every symlink for `security.selinux`, and a
//! refusal where ext4 says "no such attribute" prints an error for each.

mod common;

use std::ffi::CString;
use std::path::Path;

use common::*;

/// One file of each type the backend stores, made under `dir` by name.
fn make_one_of_each(dir: &Path) {
    std::fs::write(dir.join("file"), b"x").unwrap();
    std::fs::create_dir(dir.join("dir")).unwrap();
    std::os::unix::fs::symlink("file", dir.join("symlink")).unwrap();
    std::os::unix::fs::symlink("gone", dir.join("dangling")).unwrap();
    let fifo = cstr(&dir.join("fifo"));
    // SAFETY: `fifo` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0, "mkfifo: errno {}", errno());
}

const FILES: &[&str] = &["file", "dir", "symlink", "dangling", "fifo"];
const NAMES: &[&str] = &["user.t", "trusted.t", "security.t", "security.selinux", "system.posix_acl_access"];

/// What each call answers for `path` itself (never followed), in order: get of a missing name,
/// set, get, list contains, remove, get after the remove.
fn answers(path: &Path, name: &str) -> Vec<Result<Vec<u8>, i32>> {
    let (p, n) = (cstr(path), CString::new(name).unwrap());
    let status = |r: libc::c_int| if r == 0 { Ok(vec![]) } else { Err(errno()) };
    let value: &[u8] = if name.starts_with("system.") { b"" } else { b"value" };
    let listed = || Ok(vec![u8::from(xattr_names(path).iter().any(|listed| listed == name))]);
    let missing = xattr_of(path, name);
    // SAFETY: `p` and `n` are NUL-terminated and `value` is `value.len()` bytes, all alive for
    // the call.
    let set = status(unsafe { libc::lsetxattr(p.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) });
    vec![
        missing,
        set,
        xattr_of(path, name),
        listed(),
        // SAFETY: `p` and `n` are NUL-terminated, alive for the call.
        status(unsafe { libc::lremovexattr(p.as_ptr(), n.as_ptr()) }),
        xattr_of(path, name),
    ]
}

#[test]
fn every_xattr_call_on_every_file_type_answers_what_the_backing_file_system_answers() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip(
            "every_xattr_call_on_every_file_type_answers_what_the_backing_file_system_answers",
            "trusted.* and security.* need CAP_SYS_ADMIN to answer as they do for root",
        );
        return;
    }
    let m = TestMount::new();
    // The reference: the same files on the backing directory's own file system, beside it.
    let native = tempfile::tempdir_in(m.backing.parent().unwrap()).unwrap();
    make_one_of_each(native.path());
    make_one_of_each(&m.path(""));
    for file in FILES {
        for name in NAMES {
            let expected = answers(&native.path().join(file), name);
            let through_mount = answers(&m.path(file), name);
            assert_eq!(through_mount, expected, "{file} {name}: the mount's answers against the backing file system's");
        }
    }
    // And what was set through the mount is on the backing file itself, not on what it names.
    let link = m.path("symlink");
    let (p, n) = (cstr(&link), CString::new("trusted.t").unwrap());
    // SAFETY: `p` and `n` are NUL-terminated, the value one byte, all alive for the call.
    assert_eq!(unsafe { libc::lsetxattr(p.as_ptr(), n.as_ptr(), b"v".as_ptr().cast(), 1, 0) }, 0);
    assert_eq!(xattr_of(&m.backing_path("symlink"), "trusted.t"), Ok(b"v".to_vec()));
    assert_eq!(xattr_of(&m.backing_path("file"), "trusted.t"), Err(libc::ENODATA), "the symlink was followed");
}
