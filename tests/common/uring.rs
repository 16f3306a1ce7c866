//! FUSE over io_uring in tests: the kernel offers it only while
//! /sys/module/fuse/parameters/enable_uring is on (off by default), so a test turns it on while
//! it mounts and puts back what it found, also when it fails.

use std::fs;
use std::sync::Mutex;

use super::skip;

pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// The tests of a binary that turn it on run one at a time: the parameter is global, and one
/// test putting it back must not pull it from under another's INIT.
pub static ENABLE_URING_HELD: Mutex<()> = Mutex::new(());

/// enable_uring on while it lives; what it was before when dropped (also on a panic).
pub struct UringEnabled {
    previous: String,
    _held: std::sync::MutexGuard<'static, ()>,
}

impl UringEnabled {
    /// None, with the reason printed, where the test cannot run.
    pub fn new(test: &str) -> Option<UringEnabled> {
        // SAFETY: geteuid takes no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            skip(test, "enable_uring can only be set as root");
            return None;
        }
        let held = ENABLE_URING_HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let previous = match fs::read_to_string(ENABLE_URING) {
            Ok(value) => value.trim().to_string(),
            Err(e) => {
                skip(test, &format!("{ENABLE_URING}: {e} (a kernel without CONFIG_FUSE_IO_URING)"));
                return None;
            }
        };
        fs::write(ENABLE_URING, "1").expect("turn enable_uring on");
        Some(UringEnabled { previous, _held: held })
    }
}

impl Drop for UringEnabled {
    fn drop(&mut self) {
        if let Err(e) = fs::write(ENABLE_URING, &self.previous) {
            eprintln!("cannot put {ENABLE_URING} back to {}: {e}", self.previous);
        }
    }
}
