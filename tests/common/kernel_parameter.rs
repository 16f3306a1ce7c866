//! Kernel parameters a test sets while it mounts, put back to what the test found when it ends,
//! also when it fails:
//! - fs.fuse.max_pages_limit caps a FUSE request (256 pages, 1 MiB, by default); a mount made
//!   while it is higher gets larger requests.
//! - /sys/module/fuse/parameters/enable_uring: the kernel offers FUSE over io_uring only while it
//!   is on (off by default).

use std::fs;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::skip;

pub const MAX_PAGES_LIMIT: &str = "/proc/sys/fs/fuse/max_pages_limit";
pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// One test of a binary at a time per parameter: each is global, and one test putting it back
/// must not change it under another's mount or INIT.
static MAX_PAGES_HELD: Mutex<()> = Mutex::new(());
static ENABLE_URING_HELD: Mutex<()> = Mutex::new(());

/// A parameter as a test wants it while this lives; what it was before when dropped.
pub struct KernelParameter {
    path: &'static str,
    /// None when the parameter already was as wanted: nothing to put back.
    previous: Option<String>,
    _held: MutexGuard<'static, ()>,
}

impl KernelParameter {
    /// fs.fuse.max_pages_limit at least `pages`. None, with the reason printed, where the test
    /// cannot run.
    pub fn max_pages_at_least(test: &str, pages: u64) -> Option<KernelParameter> {
        let is_enough = move |value: &str| value.parse::<u64>().is_ok_and(|limit| limit >= pages);
        Self::set(test, MAX_PAGES_LIMIT, &MAX_PAGES_HELD, is_enough, &pages.to_string(), "")
    }

    /// enable_uring on (`true`) or off. None, with the reason printed, where the test cannot run:
    /// also where it is as wanted but this is not root: the io_uring tests are written for
    /// root's mounts, and are checked only as root.
    pub fn uring(test: &str, enabled: bool) -> Option<KernelParameter> {
        // SAFETY: geteuid takes no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            skip(test, "the io_uring tests run as root, which alone sets enable_uring");
            return None;
        }
        let is_as_wanted = move |value: &str| matches!(value, "Y" | "1") == enabled;
        let value = if enabled { "1" } else { "0" };
        let missing = " (a kernel without CONFIG_FUSE_IO_URING)";
        Self::set(test, ENABLE_URING, &ENABLE_URING_HELD, is_as_wanted, value, missing)
    }

    fn set(
        test: &str,
        path: &'static str,
        lock: &'static Mutex<()>,
        is_as_wanted: impl Fn(&str) -> bool,
        value: &str,
        missing: &str,
    ) -> Option<KernelParameter> {
        let held = lock.lock().unwrap_or_else(PoisonError::into_inner);
        let previous = match fs::read_to_string(path) {
            Ok(previous) => previous.trim().to_string(),
            Err(e) => {
                skip(test, &format!("{path}: {e}{missing}"));
                return None;
            }
        };
        if is_as_wanted(&previous) {
            return Some(KernelParameter { path, previous: None, _held: held });
        }
        // SAFETY: geteuid takes no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            skip(test, &format!("{path} is {previous}, the test needs {value}, and only root can set it"));
            return None;
        }
        fs::write(path, value).unwrap_or_else(|e| panic!("write {value} to {path}: {e}"));
        Some(KernelParameter { path, previous: Some(previous), _held: held })
    }
}

impl Drop for KernelParameter {
    fn drop(&mut self) {
        let Some(previous) = &self.previous else { return };
        if let Err(e) = fs::write(self.path, previous) {
            eprintln!("cannot put {} back to {previous}: {e}", self.path);
        }
    }
}
