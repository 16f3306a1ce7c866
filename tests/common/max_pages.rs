//! fs.fuse.max_pages_limit raised for a test: the kernel caps a FUSE request at it (256 pages,
//! 1 MiB, by default), and a mount made while it is higher gets larger requests. A test raises
//! it while it mounts and puts back what it found, also when it fails.

use std::fs;
use std::sync::Mutex;

use super::skip;

const MAX_PAGES_LIMIT: &str = "/proc/sys/fs/fuse/max_pages_limit";

/// One test of a binary at a time: the limit is global, and one test putting it back must not
/// lower it under another's mount.
static MAX_PAGES_HELD: Mutex<()> = Mutex::new(());

/// The limit at least `pages` while it lives; what it was before when dropped (also on a panic).
pub struct MaxPagesRaised {
    previous: String,
    _held: std::sync::MutexGuard<'static, ()>,
}

impl MaxPagesRaised {
    /// None, with the reason printed, where the test cannot run.
    pub fn at_least(test: &str, pages: u64) -> Option<MaxPagesRaised> {
        let held = MAX_PAGES_HELD.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let previous = match fs::read_to_string(MAX_PAGES_LIMIT) {
            Ok(value) => value.trim().to_string(),
            Err(e) => {
                skip(test, &format!("{MAX_PAGES_LIMIT}: {e}"));
                return None;
            }
        };
        if previous.parse::<u64>().is_ok_and(|limit| limit >= pages) {
            return Some(MaxPagesRaised { previous, _held: held });
        }
        // SAFETY: geteuid takes no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            skip(test, &format!("fs.fuse.max_pages_limit is {previous}, below {pages}, and only root can raise it"));
            return None;
        }
        fs::write(MAX_PAGES_LIMIT, pages.to_string()).expect("raise fs.fuse.max_pages_limit");
        Some(MaxPagesRaised { previous, _held: held })
    }
}

impl Drop for MaxPagesRaised {
    fn drop(&mut self) {
        if let Err(e) = fs::write(MAX_PAGES_LIMIT, &self.previous) {
            eprintln!("cannot put {MAX_PAGES_LIMIT} back to {}: {e}", self.previous);
        }
    }
}
