//! What a process holds open, read from /proc: whether the process closing one of our files
//! keeps another descriptor open for writing on it.
//!
//! GNU dd (`of=`), touch and a shell's `> file` open the file, dup2 it onto a standard
//! descriptor and close the first: the kernel sends a FLUSH for that close although the file
//! stays open. fdinfo is read from the kernel's own `struct file`; nothing here sends a request
//! to this or any FUSE file system (a stat of /proc/PID/fd/N would, and could wait on this
//! daemon).

use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, OwnedFd};

/// More descriptors than this and the process is not read: the question is worth a few reads,
/// not a walk of a server's descriptor table on each close.
const MOST_DESCRIPTORS_READ: usize = 64;

/// Whether thread `pid` (a FUSE request's pid is the caller's thread) holds a descriptor open
/// for writing on inode `ino` of the mount `mount_id`. False whenever it cannot tell: pid 0 (a
/// caller outside the daemon's PID namespace), the process gone or exiting (its descriptor
/// table already taken down), more than [`MOST_DESCRIPTORS_READ`] descriptors, an fdinfo
/// without `mnt_id` or `ino`. Only this process's table is read: a descriptor a child inherited
/// is not seen, and the close is then treated as the last.
pub fn holds_a_writer(pid: u32, mount_id: u64, ino: u64) -> bool {
    holds_a_writer_among(pid, mount_id, ino, MOST_DESCRIPTORS_READ)
}

fn holds_a_writer_among(pid: u32, mount_id: u64, ino: u64, most_read: usize) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(path) = CString::new(format!("/proc/{pid}/fdinfo")) else { return false };
    // Each entry opened relative to the directory: a path from /proc would look the process up
    // again for every descriptor.
    let Ok(dir) = crate::sys::openat(libc::AT_FDCWD, &path, libc::O_RDONLY | libc::O_DIRECTORY, 0) else {
        return false;
    };
    let Some(names) = entry_names(&dir, most_read) else { return false };
    names.iter().any(|name| {
        let Ok(file) = crate::sys::openat(dir.as_raw_fd(), name, libc::O_RDONLY, 0) else { return false };
        // The lines read come first (pos, flags, mnt_id, ino); what follows them (locks, an
        // eventfd's count) may be cut off.
        let mut text = [0u8; FDINFO_BYTES_READ];
        // SAFETY: `read` writes at most `text.len()` bytes into the local buffer, borrowed
        // exclusively for the call.
        let got = unsafe { libc::read(file.as_raw_fd(), text.as_mut_ptr().cast(), text.len()) };
        let Ok(got) = crate::sys::check_size(got) else { return false };
        let info = FdInfo::parse(&String::from_utf8_lossy(&text[..got]));
        info.mount_id == Some(mount_id) && info.ino == Some(ino) && info.writable()
    })
}

/// Enough of an fdinfo file for its first four lines, which are all that is parsed.
const FDINFO_BYTES_READ: usize = 256;

/// The names in directory `dir` other than `.` and `..`, or None past `most_read` of them or
/// when the directory cannot be read.
fn entry_names(dir: &OwnedFd, most_read: usize) -> Option<Vec<CString>> {
    let mut names = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: `getdents64` writes at most `buf.len()` bytes of records into the local
        // buffer, borrowed exclusively for the call.
        let got = unsafe { libc::syscall(libc::SYS_getdents64, dir.as_raw_fd(), buf.as_mut_ptr(), buf.len()) };
        let got = crate::sys::check_size(got as libc::ssize_t).ok()?;
        if got == 0 {
            return Some(names);
        }
        // Each record: d_ino (8 bytes), d_off (8), d_reclen (2), d_type (1), then the name,
        // NUL-terminated, padded to d_reclen.
        let mut at = 0;
        while at < got {
            let record_len = u16::from_ne_bytes([buf[at + 16], buf[at + 17]]) as usize;
            assert!(
                record_len > 19 && at + record_len <= got,
                "a getdents64 record of {record_len} bytes at {at} of {got}"
            );
            let name = CStr::from_bytes_until_nul(&buf[at + 19..at + record_len]).ok()?;
            if name.to_bytes() != b"." && name.to_bytes() != b".." {
                if names.len() == most_read {
                    return None;
                }
                names.push(name.to_owned());
            }
            at += record_len;
        }
    }
}

#[derive(Debug, Default, PartialEq)]
struct FdInfo {
    flags: Option<i32>,
    mount_id: Option<u64>,
    ino: Option<u64>,
}

impl FdInfo {
    fn parse(text: &str) -> FdInfo {
        let mut info = FdInfo::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once(':') else { continue };
            let value = value.trim();
            match key {
                // Octal, as the kernel prints it.
                "flags" => info.flags = i32::from_str_radix(value, 8).ok(),
                "mnt_id" => info.mount_id = value.parse().ok(),
                "ino" => info.ino = value.parse().ok(),
                _ => {}
            }
        }
        info
    }

    /// Open for writing, as our FLUSH counts a handle writable: an O_PATH descriptor is not.
    fn writable(&self) -> bool {
        self.flags.is_some_and(|f| f & libc::O_PATH == 0 && f & libc::O_ACCMODE != libc::O_RDONLY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn fdinfo_is_parsed_as_the_kernel_prints_it() {
        let info = FdInfo::parse("pos:\t0\nflags:\t0100001\nmnt_id:\t24\nino:\t3\n");
        assert_eq!(info, FdInfo { flags: Some(0o100001), mount_id: Some(24), ino: Some(3) });
        assert!(info.writable());
        assert!(!FdInfo::parse("flags:\t0100000\nmnt_id:\t24\nino:\t3\n").writable());
        assert!(!FdInfo::parse("flags:\t012000002\n").writable(), "O_PATH");
        assert!(!FdInfo::parse("mnt_id:\t24\n").writable(), "no flags line");
    }

    /// The mount and inode the kernel names for `fd` (an overlay's st_ino may not be its ino).
    fn mount_and_ino_of(fd: i32) -> (u64, u64) {
        let info = FdInfo::parse(&std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap());
        (info.mount_id.expect("mnt_id in fdinfo"), info.ino.expect("ino in fdinfo"))
    }

    #[test]
    fn a_writable_descriptor_of_this_process_is_found_and_a_reader_is_not() {
        let dir = std::env::temp_dir().join(format!("descriptors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        // More descriptors than one getdents64 buffer lists, opened before the writer, so that
        // it is found only past the first buffer.
        std::fs::write(dir.join("r"), b"").unwrap();
        let readers: Vec<_> = (0..300).map(|_| std::fs::File::open(dir.join("r")).unwrap()).collect();
        let writer = std::fs::File::create(&path).unwrap();
        let (mount, ino) = mount_and_ino_of(writer.as_raw_fd());
        // SAFETY: `gettid` takes no arguments, cannot fail and touches none of our memory.
        let tid = unsafe { libc::gettid() } as u32;
        // Other tests of this binary open files meanwhile: no bound on how many are read.
        let holds = |pid, mount| holds_a_writer_among(pid, mount, ino, usize::MAX);
        assert!(holds(tid, mount));
        assert!(!holds(tid, mount + 1), "another mount's inode of that number");
        assert!(!holds_a_writer_among(tid, mount, ino, 0), "more descriptors than are read");
        assert!(!holds_a_writer_among(tid, mount, ino, readers.len()), "the writer past the descriptors read");
        drop(writer);
        let reader = std::fs::File::open(&path).unwrap();
        assert!(!holds(tid, mount), "only a reader left");
        drop(reader);
        assert!(!holds(0, mount), "pid 0: a caller in another PID namespace");
        drop(readers);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
