//! coalescefs: a FUSE file system that shapes application writes into whole, aligned units.
//!
//! This file is the command line: each command parsed and run; `daemon` has the mount's life.

use coalescefs::daemon::{fail, open_backend};
use coalescefs::{control, daemon, engine, logging, metrics, mounts, options, runtime, state};

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use options::UsageError;

const USAGE: &str = "\
usage:
  coalescefs mount BACKING_DIR MOUNTPOINT [-o opt,opt...] [-f|--foreground]
  coalescefs umount [-z|--lazy] MOUNTPOINT
  coalescefs stats MOUNTPOINT [--prometheus]
  coalescefs sync MOUNTPOINT     (everything written made durable on the backend; with the
                                  intent log, a checkpoint)
  coalescefs recover BACKING_DIR [--state DIR | --log PATH]   (not mounted: applies every
                                  intact batch of a damaged intent log, says which were lost,
                                  empties the log)
  coalescefs BACKING_DIR MOUNTPOINT -o opts        (the form mount.fuse3 uses)

mount options (-o): allow_other, allow_root, ro, fsname=NAME, threads=N (FUSE workers, default 4),
  unit=SIZE (power of two, 4K..64M; default discovered from the backing device, else 1M),
  buffer=SIZE (write buffer bound, default 256M), flushers=N (default: cores, 2..8),
  flush_age=DURATION (default 5s), writeback_cache[=auto|on|off] (default auto), metrics=ADDR:PORT (Prometheus text),
  max_write=SIZE (largest FUSE write request; default the unit, at most 16M),
  cache_timeout=DURATION (how long the kernel trusts names and attributes, default 60s),
  io_timeout=DURATION (how long a request waits for a backend that finishes nothing before EIO, default 30s),
  backend=local|null (null: names and sizes in BACKING_DIR, data counted and discarded),
  log=off|on|PATH (intent log for small fsyncs, default off; on: in the state directory),
  state=DIR (the state directory, default /var/lib/coalescefs/<escaped BACKING_DIR>),
  log_size=SIZE (the intent log's ring, default 64M), checkpoint_interval=DURATION (default 30s),
  log_threshold=SIZE, log_threshold_new=SIZE (most bytes one fsync logs, of an existing / a new file),
  and the kernel flags dev, nodev, suid, nosuid, exec, noexec, atime, noatime, relatime, sync,
  dirsync. fstab's own options (defaults, nofail, _netdev, noauto, x-*) are accepted and ignored.";

const EXIT_USAGE: u8 = 2;

fn usage_error(err: UsageError) -> ExitCode {
    eprintln!("coalescefs: {}\n{USAGE}", err.0);
    ExitCode::from(EXIT_USAGE)
}

fn main() -> ExitCode {
    logging::init();
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
            Ok(request) => daemon::run_mount(request),
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
            Ok(request) => daemon::run_mount(request),
            Err(e) => usage_error(e),
        },
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
    let runtime = runtime::RuntimeDir::of(&backing);
    let daemon = runtime.read_pid().filter(|&pid| mounts::process_alive(pid));
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
    // What the daemon could not write before it exited (see daemon::report_unwritten).
    if !lazy {
        if let Ok(report) = std::fs::read_to_string(runtime.unmount_report_path()) {
            let _ = std::fs::remove_file(runtime.unmount_report_path());
            return fail(format!("{} unmounted, but {}", mount_point.display(), report.trim_end()));
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

fn run_recover(args: &[String]) -> ExitCode {
    let (backing, state_dir, log_path) = match args {
        [backing] => (backing, None, None),
        [backing, flag, path] if flag == "--log" => (backing, None, Some(PathBuf::from(path))),
        [backing, flag, path] if flag == "--state" => (backing, Some(PathBuf::from(path)), None),
        _ => return usage_error(UsageError("recover takes BACKING_DIR [--state DIR | --log PATH]".into())),
    };
    let backing = match mounts::check_backing_dir(std::path::Path::new(backing), false) {
        Ok(path) => path,
        Err(message) => return fail(message),
    };
    let backend = match open_backend(&backing, None, &Arc::new(metrics::Metrics::default())) {
        Ok(backend) => backend,
        Err(message) => return fail(message),
    };
    // Held while recovering: a mount of the same directory now would replay the same log.
    let state = match state::StateDir::find(&backing, state_dir.as_deref()) {
        Ok(state) => state,
        Err(message) => return fail(format!("{message}: unmount it first")),
    };
    // Which log: the one asked for, else the one the backing directory says it needs, else
    // the state directory's.
    let marker = match state::log_marker(&backing) {
        Ok(marker) => marker,
        Err(message) => return fail(message),
    };
    let log_path = match (log_path, state_dir) {
        (Some(path), _) => path,
        (None, Some(_)) => state.log_path(),
        (None, None) => marker.clone().unwrap_or_else(|| state.log_path()),
    };
    if !log_path.exists() {
        return fail(format!("no intent log at {}", log_path.display()));
    }
    let device = match engine::intent_log::open_file_device(&log_path, None) {
        Ok((device, _)) => device,
        Err(e) => return fail(format!("{}: {e}", log_path.display())),
    };
    let result = engine::salvage_log(&backend, &backend, Box::new(device));
    if result.is_ok() && marker.as_deref() == Some(log_path.as_path()) {
        if let Err(message) = state::clear_log_marker(&backing) {
            return fail(message);
        }
    }
    match result {
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
    match control::ask(&runtime::RuntimeDir::of(&backing).socket_path(), "sync") {
        Ok(answer) if answer.trim() == "ok" => ExitCode::SUCCESS,
        Ok(answer) => {
            fail(format!("sync of {}: {}", mount_point.display(), answer.trim().trim_start_matches("error: ")))
        }
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
    match control::ask(&runtime::RuntimeDir::of(&backing).socket_path(), if prometheus { "metrics" } else { "stats" }) {
        Ok(answer) => {
            print!("{answer}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("the daemon of {} does not answer: {e}", mount_point.display())),
    }
}
