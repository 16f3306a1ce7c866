//! The daemon as a process: reporting to the parent through a pipe, detaching from the
//! terminal, and the termination signals that unmount.

use super::*;

/// The parent's side of daemonizing: waits until the child reports the mount ready or failed,
/// so that `coalescefs mount` returns only once the mount can be used, with the child's error
/// and a non-zero status otherwise.
pub(super) fn wait_for_daemon(read_end: OwnedFd, daemon: libc::pid_t, log_path: &Path) -> ExitCode {
    let mut pipe = std::fs::File::from(read_end);
    let mut report = String::new();
    let _ = pipe.read_to_string(&mut report);
    if !report.starts_with("ok") {
        // A daemon that failed still holds the backing directory's lock until it has exited:
        // a `coalescefs recover` run right after this failure would find it taken.
        let mut status = 0;
        // SAFETY: waitpid writes one `int` into `status`, a live local; `daemon` is our own child.
        while unsafe { libc::waitpid(daemon, &raw mut status, 0) } == -1 && sys::Errno::last().0 == libc::EINTR {}
    }
    match report.strip_prefix("ok") {
        Some(warnings) => {
            for line in warnings.lines().filter(|l| !l.is_empty()) {
                eprintln!("coalescefs: {line}");
            }
            ExitCode::SUCCESS
        }
        None if report.is_empty() => {
            fail(format!("the daemon exited before the mount was ready (see {})", log_path.display()))
        }
        None => fail(report.trim_start_matches("error:").trim()),
    }
}

/// Where the daemon tells its parent how mounting went; `None` in the foreground.
pub(super) struct ReadyReport(pub(super) Option<std::fs::File>);

impl ReadyReport {
    pub(super) fn ok(&mut self) {
        if let Some(mut pipe) = self.0.take() {
            let warnings = logging::take_warnings();
            let _ = pipe.write_all(format!("ok\n{}", warnings.join("\n")).as_bytes());
        }
    }
    pub(super) fn error(&mut self, message: &str) -> ExitCode {
        match self.0.take() {
            Some(mut pipe) => {
                let _ = pipe.write_all(format!("error:{message}").as_bytes());
                ExitCode::from(EXIT_FAILURE)
            }
            None => fail(message),
        }
    }
}

pub(super) fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`, a live array of two `int`s, as it expects.
    let ret = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(ret, 0, "pipe2 failed: {}", sys::Errno::last());
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nothing else yet.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Sends the daemon's stdio away from the terminal: stdin and stdout to /dev/null, stderr (a
/// panic's last words) and the log to the runtime directory's log file.
pub(super) fn detach_stdio(log_path: &Path) {
    // SAFETY: open reads a NUL-terminated literal; dup2 and close take only descriptors: `null`
    // was just opened here and is owned by nothing else, and 0, 1 and 2 are replaced, not freed.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            libc::dup2(null, 0);
            libc::dup2(null, 1);
            libc::dup2(null, 2);
            libc::close(null);
        }
    }
    if let Ok(path) = sys::path_cstring(log_path) {
        // SAFETY: `open` reads only NUL-terminated C strings that outlive the call; the other
        // arguments are integers.
        let log = unsafe {
            libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC, 0o600)
        };
        if log >= 0 {
            // SAFETY: dup2 and close take only descriptors: `log` was just opened here and is owned
            // by nothing else, so closing it after duplicating it onto stderr closes nothing
            // another owner holds.
            unsafe {
                libc::dup2(log, 2);
                libc::close(log);
            }
        }
    }
    if let Err(e) = logging::to_file(log_path.to_path_buf()) {
        eprintln!("coalescefs: cannot log to {}: {e}", log_path.display());
    }
}

pub(super) fn termination_signals() -> libc::sigset_t {
    // SAFETY: `sigset_t` is plain integers, for which all-zero is a valid value, and
    // sigemptyset/sigaddset only write the live local `set`.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut set);
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&raw mut set, signal);
        }
        set
    }
}

/// Blocks the termination signals in this thread and so in every thread started after it:
/// called before the first thread exists, so that no flusher can be picked to die by one.
pub(super) fn block_termination_signals() {
    let set = termination_signals();
    // SAFETY: pthread_sigmask reads one `sigset_t` from `set`, a live local; the old mask is not
    // asked for (null).
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &raw const set, std::ptr::null_mut()) };
}

/// Waits for the termination signals on a thread of their own, which unmounts: the session
/// then ends and the write buffer is flushed. When it has not ended `ABORT_AFTER` later, the
/// connection (`connection`: the mount's device minor, its fusectl number) is aborted.
pub(super) fn unmount_on_signal(
    mount_point: PathBuf,
    connection: Option<u32>,
    session_ended: Arc<std::sync::atomic::AtomicBool>,
) {
    let set = termination_signals();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let mut signal = 0;
            // SAFETY: sigwait reads `set` and writes one `int` into `signal`, both live locals of
            // this thread.
            if unsafe { libc::sigwait(&raw const set, &raw mut signal) } != 0 {
                continue;
            }
            log::info!("signal {signal}: unmounting {}", mount_point.display());
            if mounts::unmount(&mount_point, false).is_err() {
                // Files are still open: detach now, finish when they close.
                let _ = mounts::unmount(&mount_point, true);
            }
            if let Some(connection) = connection {
                let session_ended = session_ended.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(ABORT_AFTER);
                    if session_ended.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    log::warn!(
                        "the mount has not let go {} s after the signal (open files, or requests waiting on the backend): \
                         aborting its FUSE connection",
                        ABORT_AFTER.as_secs()
                    );
                    if let Err(e) = mounts::abort_connection(connection) {
                        log::error!("cannot abort FUSE connection {connection}: {e}");
                    }
                });
            }
        })
        .expect("spawn the signal thread");
}
