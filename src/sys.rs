//! Thin, checked wrappers over the libc calls that several modules share.
//!
//! Owns: turning `-1`/errno into `Errno`, and the shared calls that hand pointers to the kernel.
//! A call made in one place only stays there, beside the code that knows why it is sound; every
//! unsafe block in the crate says so in a `// SAFETY:` comment (`clippy::undocumented_unsafe_blocks`
//! is denied in Cargo.toml). Must not: hold policy. Every function here is one system call (or a
//! fixed retry of one).

use std::ffi::{CStr, CString, OsStr};
use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;

/// A POSIX error number, as the kernel would return it to the application.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    pub fn last() -> Errno {
        Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", std::io::Error::from_raw_os_error(self.0), self.0)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", std::io::Error::from_raw_os_error(self.0))
    }
}

impl From<std::io::Error> for Errno {
    fn from(e: std::io::Error) -> Errno {
        Errno(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

pub type SysResult<T> = Result<T, Errno>;

/// `len` bytes of new private anonymous memory placed so that its byte `aligned_at` lies on an
/// `align` boundary (a huge page's, for memory whose pages move whole: the write buffer's
/// units, the requests whose pages they take); `prot` and `extra_flags` as for mmap(2). Returns
/// its first byte's address; it is the caller's to unmap.
pub fn map_anonymous_aligned(
    len: usize,
    aligned_at: usize,
    align: usize,
    prot: libc::c_int,
    extra_flags: libc::c_int,
) -> std::io::Result<usize> {
    assert!(align.is_power_of_two() && aligned_at <= len && len > 0, "{len} bytes, byte {aligned_at} at {align}");
    let reserved = len + align;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags;
    // SAFETY: a new anonymous mapping at an address of the kernel's choice touches no existing
    // memory; the result is checked before use.
    let start = unsafe { libc::mmap(std::ptr::null_mut(), reserved, prot, flags, -1, 0) };
    if start == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let start = start as usize;
    let first = (start + aligned_at).next_multiple_of(align) - aligned_at;
    let end = start + reserved;
    // SAFETY: the parts of the fresh reservation [start, end) outside [first, first + len),
    // which nothing refers to.
    unsafe {
        if first > start {
            libc::munmap(start as *mut libc::c_void, first - start);
        }
        if end > first + len {
            libc::munmap((first + len) as *mut libc::c_void, end - first - len);
        }
    }
    Ok(first)
}

/// `-1` means look at errno; anything else is the result.
pub fn check(ret: libc::c_int) -> SysResult<libc::c_int> {
    if ret == -1 {
        Err(Errno::last())
    } else {
        Ok(ret)
    }
}

pub fn check_size(ret: libc::ssize_t) -> SysResult<usize> {
    if ret == -1 {
        Err(Errno::last())
    } else {
        Ok(ret as usize)
    }
}

/// Retries a call that the kernel interrupted: a FUSE worker must never turn EINTR into an error.
pub fn retry_eintr<T>(mut call: impl FnMut() -> SysResult<T>) -> SysResult<T> {
    loop {
        match call() {
            Err(Errno(libc::EINTR)) => continue,
            other => return other,
        }
    }
}

/// A file name for an `*at` call. Names from FUSE never contain NUL; a name with `/` would
/// escape the directory handle, so both are refused here, at the boundary.
pub fn name_cstring(name: &OsStr) -> SysResult<CString> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.contains(&b'/') {
        return Err(Errno(libc::EINVAL));
    }
    CString::new(bytes).map_err(|_| Errno(libc::EINVAL))
}

pub fn path_cstring(path: &std::path::Path) -> SysResult<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno(libc::EINVAL))
}

pub const EMPTY: &CStr = c"";

/// `statvfs(2)` of the file system holding `path`.
pub fn statvfs(path: &std::path::Path) -> SysResult<libc::statvfs> {
    let path = path_cstring(path)?;
    // SAFETY: `st` is plain data that statvfs fills; `path` is a NUL-terminated string that
    // outlives the call.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(path.as_ptr(), &raw mut st) != 0 {
            return Err(Errno::last());
        }
        Ok(st)
    }
}

pub fn openat(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> SysResult<OwnedFd> {
    // SAFETY: `openat` reads only NUL-terminated C strings that outlive the call; the other
    // arguments are integers.
    let fd = retry_eintr(|| check(unsafe { libc::openat(dir, name.as_ptr(), flags | libc::O_CLOEXEC, mode) }))?;
    // SAFETY: the descriptor was just returned by a successful call that opened it, and nothing
    // else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub fn fstatat(dir: RawFd, name: &CStr, flags: i32) -> SysResult<libc::stat> {
    // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes are
    // a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fstatat` writes one value of the type its out-pointer has, into a live local
    // borrowed exclusively for the call; any C string passed is NUL-terminated.
    check(unsafe { libc::fstatat(dir, name.as_ptr(), &raw mut st, flags) })?;
    Ok(st)
}

/// `stat` of the object an fd (also an O_PATH fd) refers to, never following a symlink.
pub fn fstat_fd(fd: &impl AsRawFd) -> SysResult<libc::stat> {
    fstatat(fd.as_raw_fd(), EMPTY, libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW)
}

/// fallocate(2) on `fd`, retried where the kernel interrupted it.
pub fn fallocate(fd: &impl AsRawFd, mode: i32, offset: u64, length: u64) -> SysResult<()> {
    retry_eintr(|| {
        // SAFETY: `fallocate` takes only integers (a descriptor and plain values) and touches none
        // of our memory; a bad descriptor is an error return.
        check(unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset as libc::off_t, length as libc::off_t) })
    })
    .map(drop)
}

/// The ranges of `[from, to)` that `fd` reads as holes (SEEK_HOLE and SEEK_DATA): never
/// written, or allocated and never written (unwritten extents) with nothing in the page cache.
/// A file written meanwhile may show fewer than it has (never a range written before the
/// call); at most `HOLES_WALK_STEPS` seeks are made.
pub fn holes_within(fd: &impl AsRawFd, from: u64, to: u64) -> SysResult<Vec<(u64, u64)>> {
    let seek = |offset: u64, whence: i32| {
        // SAFETY: lseek takes no pointers; an fd that is not open answers EBADF.
        let at = unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, whence) };
        if at < 0 {
            Err(Errno::last())
        } else {
            Ok(at as u64)
        }
    };
    let mut holes = Vec::new();
    let mut at = from;
    for _ in 0..HOLES_WALK_STEPS {
        if at >= to {
            break;
        }
        let hole = match seek(at, libc::SEEK_HOLE) {
            Ok(hole) => hole,
            Err(Errno(libc::ENXIO)) => break, // at or past the end
            Err(e) => return Err(e),
        };
        if hole >= to {
            break;
        }
        let data = match seek(hole, libc::SEEK_DATA) {
            Ok(data) => data.min(to),
            Err(Errno(libc::ENXIO)) => to,
            Err(e) => return Err(e),
        };
        if data <= hole {
            // Written between the two seeks (nothing stops a writer of the file while a getattr
            // asks): no hole there now. Found once as a panic that ended the daemon under fsx.
            at = hole + 1;
            continue;
        }
        holes.push((hole, data));
        at = data;
    }
    Ok(holes)
}

/// See `holes_within`: a walk that long is a file changing under it, not one with that many
/// holes in the 1 MiB a file made ahead reserves.
const HOLES_WALK_STEPS: usize = 1024;

/// The `/proc/self/fd/N` path of an fd: the one safe way to reopen or chmod the exact inode an
/// O_PATH fd holds, without resolving any name again.
pub fn proc_fd_path(fd: &impl AsRawFd) -> CString {
    CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("no NUL in a formatted path")
}

pub fn pread(fd: RawFd, buf: &mut [u8], offset: u64) -> SysResult<usize> {
    // SAFETY: `pread`: the C strings are NUL-terminated and outlive the call; the buffer is a live,
    // exclusively borrowed slice passed with its own length, so the kernel writes within it.
    retry_eintr(|| check_size(unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), offset as libc::off_t) }))
}

/// Reads until `buf` is full or EOF; returns how many bytes were read.
pub fn pread_full(fd: RawFd, buf: &mut [u8], offset: u64) -> SysResult<usize> {
    let mut done = 0;
    while done < buf.len() {
        let n = pread(fd, &mut buf[done..], offset + done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

/// Writes all of `buf` at `offset`; a short write is continued, never reported as success.
pub fn pwrite_all(fd: RawFd, buf: &[u8], offset: u64) -> SysResult<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = retry_eintr(|| {
            // SAFETY: `pwrite`: the C strings are NUL-terminated and outlive the call; the buffer
            // is a live slice passed with its own length, which the kernel only reads.
            check_size(unsafe {
                libc::pwrite(fd, buf[done..].as_ptr().cast(), buf.len() - done, (offset + done as u64) as libc::off_t)
            })
        })?;
        if n == 0 {
            return Err(Errno(libc::EIO));
        }
        done += n;
    }
    Ok(())
}

/// The time now on the clock the kernel stamps inodes with (the coarse real-time clock, one
/// tick behind at most): what a file system's own later stamp is never earlier than. A change
/// the daemon shows before the backend has it (a buffered write's mtime), stamped finer, could
/// be later than the stamp the backend then gives it, and the file's mtime would step back
/// once the backend's is shown.
pub fn coarse_now() -> std::time::SystemTime {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `clock_gettime` writes one value of the type its out-pointer has, into a live local
    // borrowed exclusively for the call; any C string passed is NUL-terminated.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &raw mut ts) };
    assert_eq!(rc, 0, "CLOCK_REALTIME_COARSE is always there on Linux");
    std::time::UNIX_EPOCH + std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The CPUs the kernel may ever run a thread on (`num_possible_cpus()`: the highest listed in
/// `/sys/devices/system/cpu/possible`, + 1): what per-CPU structures are sized by, the kernel's
/// FUSE ring queues among them.
pub fn possible_cpus() -> usize {
    // "0-1", "0", "0-3,8-11": the highest listed CPU + 1.
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            s.trim().split([',', '-']).filter_map(|n| n.parse::<usize>().ok()).max().map(|highest| highest + 1)
        })
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// The CPU the calling thread runs on now (it may be moved right after).
pub fn current_cpu() -> Option<usize> {
    // SAFETY: no arguments; returns a CPU number or -1.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

/// Runs the calling thread on `cpu` alone from now on.
pub fn run_on_cpu(cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET stays within it for cpu < CPU_SETSIZE
    // (checked above); sched_setaffinity reads the set it is given the size of.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw const set)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn an_aligned_mapping_puts_the_byte_asked_for_on_the_boundary_and_is_usable_whole() {
        for (len, aligned_at) in [(4096, 0), (3 << 20, 4096), ((1 << 20) + 8192, 80 + 4016)] {
            let prot = libc::PROT_READ | libc::PROT_WRITE;
            let first = map_anonymous_aligned(len, aligned_at, 2 << 20, prot, 0).unwrap();
            assert_eq!((first + aligned_at) % (2 << 20), 0, "{len} {aligned_at}");
            // SAFETY: the mapping just made, `len` bytes, ours alone; unmapped once.
            unsafe {
                std::ptr::write_bytes(first as *mut u8, 7, len);
                assert_eq!(*((first + len - 1) as *const u8), 7);
                libc::munmap(first as *mut libc::c_void, len);
            }
        }
    }

    /// A getattr asks for a file's holes while its writer goes on: the walk must answer, never
    /// stop the daemon (an assert that SEEK_DATA moves past the hole SEEK_HOLE found did, under
    /// fsx), and what it answers lies inside the range asked.
    #[test]
    fn holes_within_a_file_written_meanwhile_answers_ranges_inside_the_range() {
        let dir = tempfile::tempdir().unwrap();
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        file.set_len(4 << 20).unwrap();
        let writer = file.try_clone().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop_writer = stop.clone();
        let writing = std::thread::spawn(move || {
            let mut at = 0u64;
            while !stop_writer.load(std::sync::atomic::Ordering::Relaxed) {
                writer.write_all_at(&[1; 4096], at % (4 << 20)).unwrap();
                writer.set_len(4 << 20).unwrap();
                at += 4096 * 37;
                if at % (16 * 4096) == 0 {
                    // Holes again, for the walk to find and lose.
                    fallocate(&writer, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 0, 2 << 20).unwrap();
                }
            }
        });
        for _ in 0..2000 {
            for (from, to) in holes_within(&file, 0, 4 << 20).unwrap() {
                assert!(from < to && to <= 4 << 20, "a hole {from}..{to}");
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writing.join().unwrap();
    }
}
