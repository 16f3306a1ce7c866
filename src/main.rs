//! coalescefs: a FUSE file system that shapes application writes into whole, aligned units.
//!
//! This file is the command line: parse, check, daemonize, serve, and tear down. The layers it
//! wires together are `fuse` (adapter), `engine` (decisions) and `backend` (storage).

mod backend;
mod control;
mod engine;
mod fuse;
mod metrics;
mod mounts;
mod options;
mod sys;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use options::{MountRequest, UsageError};

const USAGE: &str = "\
usage:
  coalescefs mount BACKING_DIR MOUNTPOINT [-o opt,opt...] [-f|--foreground]
  coalescefs umount [-z|--lazy] MOUNTPOINT
  coalescefs stats MOUNTPOINT [--prometheus]
  coalescefs sync MOUNTPOINT     (everything written made durable on the backend; with the
                                  intent log, a checkpoint)
  coalescefs recover BACKING_DIR [--log PATH]   (not mounted: applies every intact batch of a
                                  damaged intent log, says which were lost, empties the log)
  coalescefs BACKING_DIR MOUNTPOINT -o opts        (the form mount.fuse3 uses)

mount options (-o): allow_other, allow_root, ro, fsname=NAME, threads=N (FUSE workers, default 4),
  unit=SIZE (power of two, 4K..64M; default discovered from the backing device, else 1M),
  buffer=SIZE (write buffer bound, default 256M), flushers=N (default: cores, 2..8),
  flush_age=DURATION (default 5s), writeback_cache[=auto|on|off] (default auto), metrics=ADDR:PORT (Prometheus text),
  max_write=SIZE (largest FUSE write request; default the unit, at most 16M),
  cache_timeout=DURATION (how long the kernel trusts names and attributes, default 60s),
  backend=local|null (null: names and sizes in BACKING_DIR, data counted and discarded),
  log=off|on|PATH (intent log for small fsyncs, default off; on: in BACKING_DIR/.coalescefs),
  log_size=SIZE (the intent log's ring, default 64M), checkpoint_interval=DURATION (default 30s),
  log_threshold=SIZE, log_threshold_new=SIZE (most bytes one fsync logs, of an existing / a new file),
  and the kernel flags dev, nodev, suid, nosuid, exec, noexec, atime, noatime, relatime, sync,
  dirsync. fstab's own options (defaults, nofail, _netdev, noauto, x-*) are accepted and ignored.";

const EXIT_FAILURE: u8 = 1;
const EXIT_USAGE: u8 = 2;

/// Warnings raised while mounting, for the parent to print on the user's terminal: the
/// daemon's own stderr is its log file by then.
static WARNINGS_FOR_PARENT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

struct StderrLogger {
    level: log::LevelFilter,
}

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= self.level
    }
    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) && record.target().starts_with("coalescefs") {
            // The daemon's stderr is its log file in the backing directory, which may be the
            // very file system that just ran full: a lost log line must not take down the
            // thread reporting it (eprintln! panics when the write fails).
            let _ = writeln!(std::io::stderr(), "coalescefs[{}] {}: {}", std::process::id(), record.level(), record.args());
            if record.level() <= log::Level::Warn {
                let mut held = WARNINGS_FOR_PARENT.lock().unwrap_or_else(|p| p.into_inner());
                held.push(format!("{}: {}", record.level(), record.args()));
            }
        }
    }
    fn flush(&self) {}
}

fn init_logging() {
    let level = match std::env::var("COALESCEFS_LOG").as_deref() {
        Ok("debug") => log::LevelFilter::Debug,
        Ok("trace") => log::LevelFilter::Trace,
        Ok("warn") => log::LevelFilter::Warn,
        Ok("error") => log::LevelFilter::Error,
        _ => log::LevelFilter::Info,
    };
    let logger = Box::leak(Box::new(StderrLogger { level }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("coalescefs: {message}");
    ExitCode::from(EXIT_FAILURE)
}

fn usage_error(err: UsageError) -> ExitCode {
    eprintln!("coalescefs: {}\n{USAGE}", err.0);
    ExitCode::from(EXIT_USAGE)
}

fn main() -> ExitCode {
    init_logging();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None => usage_error(UsageError("missing command".into())),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some("-V" | "--version") => {
            println!("coalescefs {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("mount") => match options::parse_mount_args(&args[1..]) {
            Ok(request) => run_mount(request),
            Err(e) => usage_error(e),
        },
        Some("umount" | "unmount") => run_umount(&args[1..]),
        Some("stats") => run_stats(&args[1..]),
        Some("sync") => run_sync(&args[1..]),
        Some("recover") => run_recover(&args[1..]),
        Some(other) if other.starts_with('-') || args.len() < 2 => {
            usage_error(UsageError(format!("unknown command '{other}'")))
        }
        // mount.fuse3 runs `coalescefs SOURCE MOUNTPOINT -o OPTIONS`.
        Some(_) => match options::parse_mount_args(&args) {
            Ok(request) => run_mount(request),
            Err(e) => usage_error(e),
        },
    }
}

/// The parent's side of daemonizing: waits until the child reports the mount ready or failed,
/// so that `coalescefs mount` returns only once the mount can be used, with the child's error
/// and a non-zero status otherwise.
fn wait_for_daemon(read_end: OwnedFd, daemon: libc::pid_t) -> ExitCode {
    let mut pipe = std::fs::File::from(read_end);
    let mut report = String::new();
    let _ = pipe.read_to_string(&mut report);
    if !report.starts_with("ok") {
        // A daemon that failed still holds the backing directory's lock until it has exited:
        // a `coalescefs recover` run right after this failure would find it taken.
        let mut status = 0;
        while unsafe { libc::waitpid(daemon, &mut status, 0) } == -1 && sys::Errno::last().0 == libc::EINTR {}
    }
    match report.strip_prefix("ok") {
        Some(warnings) => {
            for line in warnings.lines().filter(|l| !l.is_empty()) {
                eprintln!("coalescefs: {line}");
            }
            ExitCode::SUCCESS
        }
        None if report.is_empty() => fail("the daemon exited before the mount was ready (see .coalescefs/daemon.log)"),
        None => fail(report.trim_start_matches("error:").trim()),
    }
}

/// Where the daemon tells its parent how mounting went; `None` in the foreground.
struct ReadyReport(Option<std::fs::File>);

impl ReadyReport {
    fn ok(&mut self) {
        if let Some(mut pipe) = self.0.take() {
            let warnings = std::mem::take(&mut *WARNINGS_FOR_PARENT.lock().unwrap_or_else(|p| p.into_inner()));
            let _ = pipe.write_all(format!("ok\n{}", warnings.join("\n")).as_bytes());
        }
    }
    fn error(&mut self, message: &str) -> ExitCode {
        match self.0.take() {
            Some(mut pipe) => {
                let _ = pipe.write_all(format!("error:{message}").as_bytes());
                ExitCode::from(EXIT_FAILURE)
            }
            None => fail(message),
        }
    }
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    let ret = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(ret, 0, "pipe2 failed: {}", sys::Errno::last());
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Raises the descriptor limit to the hard limit and returns how many descriptors the backend
/// may keep open for objects the kernel has cached: half of the limit, less a reserve, so that
/// the files applications open, the write buffer's backend files and the log keep the rest.
fn node_fd_budget() -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 256;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    let soft = limit.rlim_cur.min(1 << 24) as usize;
    (soft.saturating_sub(512) / 2).max(64)
}

/// Sends the daemon's stdio away from the terminal; errors go to the state folder's log.
fn detach_stdio(state_dir: Option<&OwnedFd>) {
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            libc::dup2(null, 0);
            libc::dup2(null, 1);
            libc::dup2(null, 2);
            libc::close(null);
        }
        if let Some(dir) = state_dir {
            let log = libc::openat(
                dir.as_raw_fd(),
                c"daemon.log".as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
                0o600,
            );
            if log >= 0 {
                libc::dup2(log, 2);
                libc::close(log);
            }
        }
    }
}

fn termination_signals() -> libc::sigset_t {
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Blocks the termination signals in this thread and so in every thread started after it:
/// called before the first thread exists, so that no flusher can be picked to die by one.
fn block_termination_signals() {
    let set = termination_signals();
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Waits for the termination signals on a thread of their own, which unmounts: the session
/// then ends cleanly and the write buffer is flushed.
fn unmount_on_signal(mount_point: PathBuf) {
    let set = termination_signals();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let mut signal = 0;
            if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                continue;
            }
            log::info!("signal {signal}: unmounting {}", mount_point.display());
            if mounts::unmount(&mount_point, false).is_err() {
                // Files are still open: detach now, finish when they close.
                let _ = mounts::unmount(&mount_point, true);
            }
        })
        .expect("spawn the signal thread");
}

fn run_mount(request: MountRequest) -> ExitCode {
    let opts = &request.options;
    if opts.remount {
        return match mounts::remount(&mounts::absolute(&request.mount_point), opts) {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => fail(message),
        };
    }
    let backing = match mounts::check_backing_dir(&request.backing_dir, opts.read_only) {
        Ok(path) => path,
        Err(message) => return fail(message),
    };
    let mount_point = match mounts::check_mount_point(&request.mount_point, &backing) {
        Ok(path) => path,
        Err(message) => return fail(message),
    };
    let metrics = Arc::new(metrics::Metrics::default());
    let backend = match open_backend(&backing, &metrics) {
        Ok(backend) => backend,
        Err(message) => return fail(message),
    };
    let state_dir = match backend.open_state_dir() {
        Ok(dir) => Some(dir),
        Err(e) if opts.read_only => {
            log::warn!("no state folder in a read-only backing directory ({e}); mounting without one");
            None
        }
        Err(e) => return fail(format!("cannot create the state folder {}/.coalescefs: {e}", backing.display())),
    };
    let _lock = match state_dir.as_ref().map(|dir| mounts::lock_backing_dir(dir, &backing)).transpose() {
        Ok(lock) => lock,
        Err(message) => return fail(message),
    };

    let mut ready = ReadyReport(None);
    if !request.foreground {
        let (read_end, write_end) = pipe();
        // No thread exists yet, so fork is safe.
        match unsafe { libc::fork() } {
            -1 => return fail(format!("fork failed: {}", sys::Errno::last())),
            0 => {
                drop(read_end);
                unsafe { libc::setsid() };
                detach_stdio(state_dir.as_ref());
                ready = ReadyReport(Some(std::fs::File::from(write_end)));
            }
            child => {
                drop(write_end);
                return wait_for_daemon(read_end, child);
            }
        }
    }

    block_termination_signals();
    // Modes arrive already masked by the kernel; the daemon's own umask must not mask twice.
    unsafe { libc::umask(0) };

    let geometry = engine::geometry::discover(&backing, opts.unit_bytes);
    log::info!(
        "unit {} bytes ({:?}), logical block {} bytes",
        geometry.unit_bytes,
        geometry.unit_source,
        geometry.logical_block_bytes
    );
    // A discovered unit larger than half the buffer would leave writers nothing to work with.
    if opts.buffer_bytes < 2 * geometry.unit_bytes {
        return ready.error(&format!(
            "buffer={} must hold at least two units of {} bytes (give a larger buffer= or a smaller unit=)",
            opts.buffer_bytes, geometry.unit_bytes
        ));
    }
    // st_blksize = unit: stdio-buffered writers (Perl print, fwrite, cp) then write whole units.
    let engine_config = engine::EngineConfig {
        block_size_bytes: geometry.unit_bytes as u32,
        writeback: engine::writeback::WritebackConfig {
            unit_bytes: geometry.unit_bytes,
            logical_block_bytes: geometry.logical_block_bytes,
            buffer_bytes: opts.buffer_bytes,
            flushers: opts.flushers,
            flush_age: opts.flush_age,
            store: opts.data_store,
            log_threshold_bytes: opts.log_threshold_bytes,
            log_threshold_new_bytes: opts.log_threshold_new_bytes,
            checkpoint_interval: opts.checkpoint_interval,
        },
        log: match &opts.log {
            options::LogPlace::Off => None,
            options::LogPlace::StateFolder => {
                Some((backend::local::default_log_path(&backing), opts.log_size_bytes))
            }
            options::LogPlace::At(path) => Some((path.clone(), opts.log_size_bytes)),
        },
        page_cache: opts.writeback_cache,
    };
    let engine = match engine::Engine::new(backend, engine_config, metrics.clone()) {
        Ok(engine) => Arc::new(engine),
        Err(e) => return ready.error(&format!("cannot start on {}: {e}", backing.display())),
    };
    let max_write = opts.max_write_bytes.unwrap_or(geometry.unit_bytes).min(fuse::MAX_WRITE_BYTES_LIMIT);
    let engine_for_sync = engine.clone();
    let adapter = fuse::FuseAdapter::new(engine, metrics.clone(), max_write as u32, opts.cache_timeout);
    let source = opts.fsname.clone().unwrap_or_else(|| backing.display().to_string());

    let acl = if opts.allow_other {
        fuser::SessionACL::All
    } else if opts.allow_root {
        fuser::SessionACL::RootAndOwner
    } else {
        fuser::SessionACL::Owner
    };
    let mut config = fuser::Config::default();
    config.acl = acl;
    config.n_threads = Some(opts.threads);
    config.clone_fd = true;

    let session = if unsafe { libc::geteuid() } == 0 {
        let fd = match mounts::mount_direct(&source, &mount_point, opts) {
            Ok(fd) => fd,
            Err(message) => return ready.error(&message),
        };
        match fuser::Session::from_fd(adapter, fd, acl, config) {
            Ok(session) => session,
            Err(e) => {
                let _ = mounts::unmount(&mount_point, true);
                return ready.error(&format!("FUSE handshake failed: {e}"));
            }
        }
    } else {
        config.mount_options = vec![
            fuser::MountOption::FSName(source.clone()),
            fuser::MountOption::Subtype("coalescefs".into()),
            fuser::MountOption::DefaultPermissions,
        ];
        if opts.read_only {
            config.mount_options.push(fuser::MountOption::RO);
        }
        for flag in &opts.kernel_flags {
            config.mount_options.push(fuser::MountOption::CUSTOM(flag.clone()));
        }
        match fuser::Session::new(adapter, &mount_point, &config) {
            Ok(session) => session,
            Err(e) => return ready.error(&format!("mount of {} failed: {e}", mount_point.display())),
        }
    };

    if state_dir.is_some() {
        let _ = std::fs::write(mounts::pid_file(&backing), format!("{}\n", std::process::id()));
        let sync_all: control::SyncAll = Box::new(move || engine_for_sync.sync_all().map_err(|e| e.to_string()));
        if let Err(e) = control::serve_control_socket(&backing, metrics.clone(), sync_all) {
            log::warn!("no control socket ({e}): `coalescefs stats` will not answer");
        }
    }
    if let Some(address) = opts.metrics_address {
        if let Err(e) = control::serve_prometheus(address, metrics.clone()) {
            let _ = mounts::unmount(&mount_point, true);
            return ready.error(&format!("metrics={address}: cannot listen: {e}"));
        }
    }
    log::info!("mounted {} at {}", backing.display(), mount_point.display());
    // Signals are taken over before the parent returns: a SIGINT right after `coalescefs mount`
    // must unmount, not kill the daemon and leave a dead mount behind.
    unmount_on_signal(mount_point.clone());
    ready.ok();
    let result = session.run();
    if state_dir.is_some() {
        let _ = std::fs::remove_file(mounts::pid_file(&backing));
    }
    match result {
        Ok(()) => {
            log::info!("unmounted {}", mount_point.display());
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("session on {} ended with an error: {e}", mount_point.display())),
    }
}

fn run_umount(args: &[String]) -> ExitCode {
    let mut lazy = false;
    let mut targets = Vec::new();
    for arg in args {
        match arg.as_str() {
            "-z" | "--lazy" => lazy = true,
            a if a.starts_with('-') => return usage_error(UsageError(format!("unknown flag '{a}'"))),
            _ => targets.push(arg),
        }
    }
    let [target] = targets.as_slice() else {
        return usage_error(UsageError("umount takes one MOUNTPOINT".into()));
    };
    let (mount_point, backing) = match backing_of_mount(target) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    let daemon = mounts::read_pid_file(&backing).filter(|&pid| mounts::process_alive(pid));
    // A dead daemon's mount answers only ENOTCONN; the lazy form is the one that clears it.
    let lazy = lazy || daemon.is_none();
    if let Err(e) = mounts::unmount(&mount_point, lazy) {
        return match e.0 {
            libc::EBUSY => fail(format!(
                "{} is busy: files are open on it; close them or use `coalescefs umount --lazy`",
                mount_point.display()
            )),
            _ => fail(format!("cannot unmount {}: {e}", mount_point.display())),
        };
    }
    // Return only once the daemon has finished, so that a following mount or read of the
    // backing directory sees everything.
    if let Some(pid) = daemon {
        let deadline = Instant::now() + Duration::from_secs(120);
        while mounts::process_alive(pid) && !lazy {
            if Instant::now() > deadline {
                return fail(format!("unmounted, but daemon {pid} is still running after 120 s"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    ExitCode::SUCCESS
}

/// The mount's backing directory, from /proc/self/mountinfo, or a message why there is none.
fn backing_of_mount(target: &str) -> Result<(PathBuf, PathBuf), String> {
    let mount_point = mounts::absolute(Path::new(target));
    let info = mounts::mount_at(&mount_point).ok_or_else(|| format!("{} is not mounted", mount_point.display()))?;
    if info.fs_type != mounts::FS_TYPE {
        return Err(format!("{} is a {} mount, not coalescefs", mount_point.display(), info.fs_type));
    }
    Ok((mount_point, PathBuf::from(info.source)))
}

fn open_backend(backing: &Path, metrics: &Arc<metrics::Metrics>) -> Result<backend::local::LocalBackend, String> {
    backend::local::LocalBackend::open_dir(backing, node_fd_budget(), metrics.clone())
        .map_err(|e| format!("cannot open backing directory {}: {e}", backing.display()))
}

fn run_recover(args: &[String]) -> ExitCode {
    let (backing, log_path) = match args {
        [backing] => (backing, None),
        [backing, flag, path] if flag == "--log" => (backing, Some(std::path::PathBuf::from(path))),
        _ => return usage_error(UsageError("recover takes BACKING_DIR [--log PATH]".into())),
    };
    let backing = match mounts::check_backing_dir(std::path::Path::new(backing), false) {
        Ok(path) => path,
        Err(message) => return fail(message),
    };
    let backend = match open_backend(&backing, &Arc::new(metrics::Metrics::default())) {
        Ok(backend) => backend,
        Err(message) => return fail(message),
    };
    let state_dir = match backend.open_state_dir() {
        Ok(dir) => dir,
        Err(e) => return fail(format!("cannot open the state folder {}/.coalescefs: {e}", backing.display())),
    };
    // Held while recovering: a mount of the same directory now would replay the same log.
    let _lock = match mounts::lock_backing_dir(&state_dir, &backing) {
        Ok(lock) => lock,
        Err(message) => return fail(format!("{message}: unmount it first")),
    };
    let log_path = log_path.unwrap_or_else(|| backend::local::default_log_path(&backing));
    if !log_path.exists() {
        return fail(format!("no intent log at {}", log_path.display()));
    }
    match engine::salvage_log(backend, &log_path) {
        Ok(lost) if lost.is_empty() => {
            println!("{}: every batch intact and applied; the log is empty", log_path.display());
            ExitCode::SUCCESS
        }
        Ok(lost) => {
            println!("{}: every intact batch applied; the log is empty. Could not be read:", log_path.display());
            for line in &lost {
                println!("  {line}");
            }
            println!("Files those batches held fsynced bytes for may have older contents.");
            ExitCode::SUCCESS
        }
        Err(message) => fail(message),
    }
}

fn run_sync(args: &[String]) -> ExitCode {
    let [target] = args else {
        return usage_error(UsageError("sync takes one MOUNTPOINT".into()));
    };
    let (mount_point, backing) = match backing_of_mount(target) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    match control::ask(&backing, "sync") {
        Ok(answer) if answer.trim() == "ok" => ExitCode::SUCCESS,
        Ok(answer) => fail(format!("sync of {}: {}", mount_point.display(), answer.trim().trim_start_matches("error: "))),
        Err(e) => fail(format!("the daemon of {} does not answer: {e}", mount_point.display())),
    }
}

fn run_stats(args: &[String]) -> ExitCode {
    let prometheus = args.iter().any(|a| a == "--prometheus");
    let targets: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let [target] = targets.as_slice() else {
        return usage_error(UsageError("stats takes one MOUNTPOINT".into()));
    };
    let (mount_point, backing) = match backing_of_mount(target) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    match control::ask(&backing, if prometheus { "metrics" } else { "stats" }) {
        Ok(answer) => {
            print!("{answer}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("the daemon of {} does not answer: {e}", mount_point.display())),
    }
}
