//! coalescefs: a FUSE file system that shapes application writes into whole, aligned units.
//!
//! This file is the command line (clap): each command parsed and run; `daemon` has the
//! mount's life. `coalescefs man` and `coalescefs completions SHELL` print the man page and
//! shell completions from the same definitions, so they cannot drift from `--help`.

use coalescefs::daemon::{fail, open_backend};
use coalescefs::{control, daemon, engine, logging, metrics, mounts, options, runtime, state};

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser, Subcommand};
use engine::intent_log::raw::RawLog;
use options::UsageError;

const MOUNT_OPTIONS_HELP: &str = "\
Mount options (-o, comma-separated, repeatable):
  allow_other, allow_root, ro, fsname=NAME, threads=N (FUSE workers, default 4)
  transport=auto|uring|dev  FUSE over io_uring (a queue per CPU) or /dev/fuse; auto (the
                     default): io_uring where the kernel offers it (enable_uring is Y)
  session=mounter|own  the daemon's session: the one mount ran in (default), whose programs
                     share its scheduling group under the kernel's autogroups (io_uring requests
                     ~3x faster for them), or one of its own (setsid)
  unit=SIZE          power of two, 4K..64M; default discovered from the backing device, else 1M
  buffer=SIZE        write buffer bound (default 256M)
  flushers=N         parallel flushers (default: cores, 2..8)
  flush_age=DURATION how long a partial unit waits (default 5s)
  writeback_cache[=auto|on|off]  the kernel's page cache for writes (default auto)
  max_write=SIZE     largest FUSE write request (default the unit, at most 16M)
  cache_timeout=DURATION  how long the kernel trusts names (and missing ones) and attributes (default 60s)
  io_timeout=DURATION     how long a request waits for a backend that finishes nothing (default 30s)
  metrics=ADDR:PORT  serve the counters in the Prometheus text format
  backend=local|null null: names and sizes in BACKING_DIR, data counted and discarded
  log=on|off|PATH    intent log: fsync, new files, names (default on: in the state directory)
  state=DIR          state directory (default /var/lib/coalescefs/<escaped BACKING_DIR>)
  log_size=SIZE      the intent log's ring (default 64M)
  checkpoint_interval=DURATION  the longest between checkpoints (default 300s)
  checkpoint_idle=DURATION      a checkpoint once nothing was logged for this long (default 30s)
  log_threshold=SIZE, log_threshold_new=SIZE  most bytes one fsync logs (existing / new file)
  log_closes=auto|always|never  closes of new or changed small files the log takes (default
                     auto: those not in a burst of closes; the others write to BACKING_DIR)
  burst_gap=DURATION closes less than this apart are a burst (default 2ms)
  fsync=log|backend  log (default): an fsync may be answered by the intent log; backend: every
                     fsync is a checkpoint (an s3:// mount's objects and manifest in the bucket)
  log_raw=auto|off   auto: as root on ext4, the log file's blocks are written on its device, so a
                     commit changes no inode (the file is immutable while mounted); off: through it
  xattr=on|off       extended attributes (default on); off: refused as unsupported, and the kernel
                     stops asking security.capability before each file's first write and each chown
  endpoint=URL       an s3:// source's server, http://HOST:PORT (required for one); credentials
                     from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws/credentials, never -o
  region=NAME        the region an s3:// source's requests are signed for (default us-east-1)
  sqlite_journal=wal|rollback  a sqlite: database's journal mode, kept in it from this mount on
                     (unset: the database's own; a new one's is wal). wal: readers never hold
                     up the daemon, every page is written twice; rollback: new rows written
                     once, the old bytes of pages changed in place copied first, a reader of
                     the file holds up a checkpoint's commit while it reads
  and the kernel flags dev, nodev, suid, nosuid, exec, noexec, atime, noatime, relatime, sync,
  dirsync. fstab's own options (defaults, nofail, _netdev, noauto, x-*) are accepted and ignored.

Examples:
  coalescefs mount /srv/data /mnt/data -o allow_other
  mount -t fuse.coalescefs /srv/data /mnt/data -o allow_other     (through mount.fuse.coalescefs)
  /srv/data /mnt/data fuse.coalescefs defaults,allow_other,nofail 0 0     (an /etc/fstab line)
  coalescefs mount s3://bucket/tree /mnt/tree -o endpoint=http://127.0.0.1:8333   (keys in the environment)";

const EXIT_CODES_HELP: &str = "\
Exit codes: 0 success; 1 the command failed (the message says why); 2 bad usage.

Environment: RUST_LOG sets the daemon's log levels (e.g. RUST_LOG=coalescefs=debug; COALESCEFS_LOG=debug
works too); the daemon's log is /run/coalescefs/<escaped BACKING_DIR>/daemon.log.";

/// A FUSE file system that turns whatever applications write into whole, aligned units for the
/// storage below, with an intent log for cheap, durable fsyncs.
#[derive(Parser)]
#[command(name = "coalescefs", version = VERSION, after_help = EXIT_CODES_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("COALESCEFS_COMMIT"), ")");

#[derive(Subcommand)]
enum Command {
    /// Mount BACKING_DIR at MOUNTPOINT (returns once the mount answers; the daemon stays)
    #[command(after_help = MOUNT_OPTIONS_HELP)]
    Mount(MountArgs),
    /// Unmount, waiting for the daemon to write everything (a dead daemon's mount is cleared)
    #[command(alias = "unmount", after_help = "Example:\n  coalescefs umount /mnt/data")]
    Umount {
        /// Detach now even if files are open; the daemon finishes when they close
        #[arg(short = 'z', long)]
        lazy: bool,
        /// Where it is mounted
        mountpoint: PathBuf,
    },
    /// Print the mount's counters (bytes, requests, sizes, the log, write amplification)
    #[command(
        after_help = "Examples:\n  coalescefs stats /mnt/data | grep amplification\n  coalescefs stats --watch=5 /mnt/data"
    )]
    Stats {
        /// The Prometheus (OpenMetrics) text format instead
        #[arg(long, conflicts_with = "watch")]
        prometheus: bool,
        /// One line every SECONDS of what happened since the last: application, backend and log
        /// MiB/s, the amplification of that interval, fsyncs, FUSE requests, buffer in use
        // `--watch=N` with an equals sign: `--watch /mnt/data` is the mount point, not N.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, require_equals = true, default_missing_value = "2")]
        watch: Option<f64>,
        /// Where it is mounted
        mountpoint: PathBuf,
    },
    /// Make everything written so far durable on the backend (with the intent log, a checkpoint)
    #[command(after_help = "Example:\n  coalescefs sync /mnt/data")]
    Sync {
        /// Where it is mounted
        mountpoint: PathBuf,
    },
    /// Copy a mounted sqlite: store, consistent, into a new database file (after a sync)
    #[command(after_help = "Everything written before the command started is in the copy; what is written \
while it runs may be in part. The copy is a tree of its own (mount it, or open it with sqlite3) and never \
replaces a file.\n\nExample:\n  coalescefs snapshot /etc/pve /backup/config-$(date +%F).db")]
    Snapshot {
        /// Where it is mounted
        mountpoint: PathBuf,
        /// The new database file (must not exist)
        file: PathBuf,
    },
    /// Not mounted: apply every intact batch of a damaged intent log, say which were lost, empty the log
    #[command(after_help = "Without --state or --log, the log the backing directory (or the database) names \
after a crash, else the default state directory's. For an s3:// source, -o endpoint=URL (as mounted) \
reaches the bucket; its state directory holds the namespace the batches go into.\n\nExamples:\n  \
coalescefs recover /srv/data\n  coalescefs recover sqlite:/srv/config.db --state /var/lib/config-state\n  \
coalescefs recover s3://bucket/tree -o endpoint=http://127.0.0.1:8333")]
    Recover {
        /// The backing directory of the unmounted file system, its sqlite:PATH or s3://BUCKET/PREFIX
        backing_dir: PathBuf,
        /// The state directory the log is in (as mounted with -o state=DIR)
        #[arg(long, value_name = "DIR", conflicts_with = "log")]
        state: Option<PathBuf>,
        /// The log file itself (as mounted with -o log=PATH)
        #[arg(long, value_name = "PATH")]
        log: Option<PathBuf>,
        /// For an s3:// source: its endpoint= (and region=, io_timeout=), as mounted
        #[arg(short = 'o', value_name = "OPTIONS")]
        options: Option<String>,
    },
    /// Not mounted: remove what coalescefs keeps for BACKING_DIR outside it (the state directory
    /// with the intent log, the runtime directory with the daemon's log)
    #[command(after_help = "Refused while the intent log holds batches BACKING_DIR does not have yet (a mount \
replays them; so does `coalescefs recover`), unless --discard. The files of BACKING_DIR are not touched. \
For an s3:// source, -o endpoint=URL (as mounted) reaches the bucket, where the writer's lease this state \
directory holds is released.\n\n\
Examples:\n  coalescefs forget /srv/data\n  coalescefs forget s3://bucket/tree -o endpoint=http://127.0.0.1:8333 --discard")]
    Forget {
        /// The backing directory of the unmounted file system, its sqlite:PATH or s3://BUCKET/PREFIX
        #[arg(required_unless_present = "orphans")]
        backing_dir: Option<PathBuf>,
        /// Instead: list the state, runtime and volatile tail directories whose backing directory is gone
        /// (tests, benchmarks, removed data); with --remove, remove them
        #[arg(long, conflicts_with_all = ["backing_dir", "state"])]
        orphans: bool,
        /// With --orphans: remove what it lists
        #[arg(long, requires = "orphans")]
        remove: bool,
        /// The state directory (as mounted with -o state=DIR)
        #[arg(long, value_name = "DIR")]
        state: Option<PathBuf>,
        /// Remove them even if the log holds batches not replayed yet: those writes are lost
        #[arg(long)]
        discard: bool,
        /// For an s3:// source: its endpoint= (and region=, io_timeout=), as mounted
        #[arg(short = 'o', value_name = "OPTIONS")]
        options: Option<String>,
    },
    /// Print shell completions (bash, zsh, fish, elvish, powershell)
    #[command(after_help = "Example:\n  coalescefs completions bash > /etc/bash_completion.d/coalescefs")]
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff)
    #[command(after_help = "Example:\n  coalescefs man > /usr/local/share/man/man1/coalescefs.1")]
    Man,
}

#[derive(clap::Args)]
struct MountArgs {
    /// The directory whose files the mount serves, sqlite:PATH for a tree kept in one SQLite
    /// database file (made if absent), or s3://BUCKET/PREFIX for a tree in an S3 bucket
    backing_dir: PathBuf,
    /// An empty directory to mount it on
    mountpoint: PathBuf,
    /// Mount options, comma-separated (listed below)
    #[arg(short = 'o', value_name = "OPTIONS", action = clap::ArgAction::Append)]
    options: Vec<String>,
    /// Stay in the foreground (the daemon's log goes to stderr)
    #[arg(short, long)]
    foreground: bool,
    /// Accepted for mount(8): no mtab
    #[arg(short = 'n', hide = true)]
    no_mtab: bool,
    /// Accepted for mount(8): sloppy
    #[arg(short = 's', hide = true)]
    sloppy: bool,
    /// Accepted for mount(8): verbose
    #[arg(short = 'v', hide = true)]
    verbose: bool,
}

const SUBCOMMANDS: &[&str] =
    &["mount", "umount", "unmount", "stats", "sync", "snapshot", "recover", "forget", "completions", "man", "help"];

fn usage_error(err: UsageError) -> ExitCode {
    eprintln!("coalescefs: {}\n\nFor more information, try '--help'.", err.0);
    ExitCode::from(2)
}

/// The panic policy: a panic anywhere (a failed invariant in a FUSE worker or a flusher) ends
/// the process at once, as kill -9 would, after the panic's message reaches stderr (the daemon's
/// log). A daemon that kept serving after one thread declared its state wrong could write that
/// state to the backend; a dead one leaves the backend and the intent log as a crash does, and
/// the next mount replays the log (`a_panic_in_a_flusher_ends_the_daemon_and_the_next_mount_replays`).
/// The hook is the policy in every build of the binary (Cargo.toml says why not `panic =
/// "abort"` as well), so no lock is ever seen poisoned.
fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
}

fn main() -> ExitCode {
    logging::init();
    abort_on_panic();
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // mount.fuse3 (and mount -t fuse.coalescefs) run `coalescefs SOURCE MOUNTPOINT -o OPTIONS`.
    if let Some(first) = args.get(1).and_then(|a| a.to_str()) {
        if !first.starts_with('-') && !SUBCOMMANDS.contains(&first) && args.len() > 2 {
            args.insert(1, "mount".into());
        }
    }
    // clap prints help and errors itself, ignoring a closed pipe, and exits 0 or 2.
    let cli = Cli::parse_from(args);
    match cli.command {
        Command::Mount(m) => run_mount(m),
        Command::Umount { lazy, mountpoint } => run_umount(&mountpoint, lazy),
        Command::Stats { prometheus, watch: None, mountpoint } => run_stats(&mountpoint, prometheus),
        Command::Stats { watch: Some(seconds), mountpoint, .. } => watch_stats(&mountpoint, seconds),
        Command::Sync { mountpoint } => run_sync(&mountpoint),
        Command::Snapshot { mountpoint, file } => run_snapshot(&mountpoint, &file),
        Command::Recover { backing_dir, state, log, options } => {
            run_recover(&backing_dir, state, log, options.as_deref())
        }
        Command::Forget { orphans: true, remove, discard, .. } => run_forget_orphans(remove, discard),
        Command::Forget { backing_dir, state, discard, options, .. } => {
            run_forget(&backing_dir.expect("clap requires it without --orphans"), state, discard, options.as_deref())
        }
        Command::Completions { shell } => {
            // Into memory first: clap_complete panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "coalescefs", &mut script);
            let _ = std::io::stdout().write_all(&script);
            ExitCode::SUCCESS
        }
        Command::Man => match print_man_page() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => fail(format!("writing the man page: {e}")),
        },
    }
}

/// The man page: the command's and every subcommand's help, as one page.
fn print_man_page() -> std::io::Result<()> {
    let command = Cli::command();
    let mut out = std::io::stdout().lock();
    let man = clap_mangen::Man::new(command.clone());
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    man.render_options_section(&mut out)?;
    for sub in command.get_subcommands().filter(|s| s.get_name() != "help") {
        writeln!(out, ".SH \"{}\"", format!("coalescefs {}", sub.get_name()).to_uppercase())?;
        let help = sub.clone().bin_name(format!("coalescefs {}", sub.get_name())).render_long_help().to_string();
        writeln!(out, ".nf")?;
        for line in help.lines() {
            // roff: a line starting with . or ' is a request; backslashes escape.
            let line = line.replace('\\', "\\e");
            writeln!(out, "{}{line}", if line.starts_with(['.', '\'']) { "\\&" } else { "" })?;
        }
        writeln!(out, ".fi")?;
    }
    man.render_extra_section(&mut out)?;
    man.render_version_section(&mut out)?;
    Ok(())
}

fn run_mount(m: MountArgs) -> ExitCode {
    let mut options = options::MountOptions::default();
    for text in &m.options {
        if let Err(e) = options::parse_mount_options(text, &mut options) {
            return usage_error(e);
        }
    }
    match options::mount_request(m.backing_dir, m.mountpoint, options, m.foreground) {
        Ok(request) => daemon::run_mount(request),
        Err(e) => usage_error(e),
    }
}

fn run_umount(target: &Path, lazy: bool) -> ExitCode {
    let (mount_point, backing) = match backing_of_mount(target) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    let runtime = runtime::RuntimeDir::of(&backing);
    let daemon = runtime.read_pid().filter(|&pid| mounts::process_alive(pid));
    // A dead daemon's mount answers only ENOTCONN; the lazy form is the one that clears it.
    let lazy = lazy || daemon.is_none();
    if let Err(e) = mounts::unmount_when_closed(&mount_point, lazy) {
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

/// The options `recover` and `forget` take for an s3:// source (`-o endpoint=...`), with the
/// state directory `--state` gave; refused for the other sources, which need none.
fn unmounted_options(
    options: Option<&str>,
    state_dir: Option<PathBuf>,
    s3: bool,
) -> Result<options::MountOptions, String> {
    let mut opts = options::MountOptions { state_dir, ..options::MountOptions::default() };
    match options {
        Some(_) if !s3 => Err("-o is for an s3:// source (its endpoint=, as mounted)".into()),
        Some(text) => options::parse_mount_options(text, &mut opts).map(|()| opts).map_err(|UsageError(e)| e),
        None => Ok(opts),
    }
}

/// The mount's backing directory, from /proc/self/mountinfo, or a message why there is none.
fn backing_of_mount(target: &Path) -> Result<(PathBuf, PathBuf), String> {
    let mount_point = mounts::absolute(target);
    if let Err(e) = std::fs::symlink_metadata(&mount_point) {
        if e.kind() == std::io::ErrorKind::NotFound {
            return Err(format!("{} does not exist", mount_point.display()));
        }
    }
    let info = mounts::mount_at(&mount_point).ok_or_else(|| format!("{} is not mounted", mount_point.display()))?;
    if info.fs_type != mounts::FS_TYPE {
        return Err(format!("{} is a {} mount, not coalescefs", mount_point.display(), info.fs_type));
    }
    // The runtime directory is keyed by the backing directory or the database file.
    let source = Path::new(&info.source);
    let backing = coalescefs::backend::source::MountSource::parse(source)
        .map_or_else(|_| source.to_path_buf(), |s| s.path().to_path_buf());
    Ok((mount_point, backing))
}

fn run_recover(
    backing: &Path,
    state_dir: Option<PathBuf>,
    log_path: Option<PathBuf>,
    options: Option<&str>,
) -> ExitCode {
    use coalescefs::backend::source::MountSource;
    let source = MountSource::parse(backing);
    let opts = match unmounted_options(options, state_dir.clone(), matches!(source, Ok(MountSource::S3(_)))) {
        Ok(opts) => opts,
        Err(message) => return fail(message),
    };
    match source {
        Ok(MountSource::Sqlite(db)) => return run_recover_sqlite(&db, state_dir, log_path),
        Ok(MountSource::S3(s3)) => return run_recover_s3(backing, &s3, &opts, log_path),
        _ => {}
    }
    let backing = match mounts::check_backing_dir(backing, false) {
        Ok(path) => path,
        Err(message) => return fail(message),
    };
    let backend = match open_backend(&backing, None, &Arc::new(metrics::Metrics::default())) {
        Ok(backend) => backend,
        Err(message) => return fail(message),
    };
    // Held while recovering: a mount of the same directory now would replay the same log.
    let mut state = match state::StateDir::find(&backing, state_dir.as_deref()) {
        Ok(state) => state,
        Err(message) => return fail(format!("{message}: unmount it first")),
    };
    // And the state directory's lock, as a mount takes it: another backing directory's mount
    // may use a state=DIR given here too, and its log and its files made ahead are its own.
    if let Err(message) = state.lock_if_present() {
        return fail(message);
    }
    // Which log: the one asked for, else the one the backing directory says it needs, else
    // the state directory's.
    let marker = match state::log_marker(&backing) {
        Ok(marker) => marker,
        Err(message) => return fail(message),
    };
    let (log_path, device) = match log_to_recover(log_path, state_dir.is_some(), &state, marker.as_deref()) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    let result = engine::salvage_log(&backend, &backend, Box::new(device), daemon::volatile_tail_of(&backing));
    // What files made ahead and named before the crash hold past their ends, as a mount gives back.
    let made_ahead = state.made_ahead_list_path();
    if made_ahead.exists() {
        match backend.keep_made_ahead_list(&made_ahead) {
            Ok(0) => {}
            Ok(n) => {
                println!("files made ahead and named before the crash, given back the blocks past their ends: {n}");
            }
            Err(e) => eprintln!(
                "coalescefs: warning: {}: {e}; files made ahead keep what they hold past their ends",
                made_ahead.display()
            ),
        }
    }
    if result.is_ok() && marker.as_deref().is_some_and(|marked| state::same_file(marked, &log_path)) {
        if let Err(message) = state::clear_log_marker(&backing) {
            return fail(message);
        }
    }
    report_recovery(&log_path, result)
}

/// `recover sqlite:PATH`: as for a backing directory, with the database as the store and its
/// `meta` row as the crash marker.
fn run_recover_sqlite(db: &Path, state_dir: Option<PathBuf>, log_path: Option<PathBuf>) -> ExitCode {
    let db = match coalescefs::backend::source::check_database_path(db) {
        Ok(path) if path.is_file() => path,
        Ok(path) => return fail(format!("SQLite database {}: no such file", path.display())),
        Err(message) => return fail(message),
    };
    // Held while recovering (the database file's lock, as a mount takes it): a mount now would
    // replay the same log.
    let mut state = match state::StateDir::find(&db, state_dir.as_deref()) {
        Ok(state) => state,
        Err(message) => return fail(format!("{message}: unmount it first")),
    };
    if let Err(message) = state.lock_if_present() {
        return fail(message);
    }
    let store = match coalescefs::backend::sqlite::SqliteBackend::open(&db, None, Arc::new(metrics::Metrics::default()))
    {
        Ok(store) => store,
        Err(message) => return fail(message),
    };
    let marker = match store.log_marker() {
        Ok(marker) => marker,
        Err(e) => return fail(format!("reading the crash marker of {}: {e}", db.display())),
    };
    let (log_path, device) = match log_to_recover(log_path, state_dir.is_some(), &state, marker.as_deref()) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    let result = engine::salvage_log(&store, &store, Box::new(device), daemon::volatile_tail_of(&db));
    if result.is_ok() && marker.as_deref().is_some_and(|marked| state::same_file(marked, &log_path)) {
        if let Err(e) = store.set_log_marker(None) {
            return fail(format!("clearing the crash marker of {}: {e}", db.display()));
        }
    }
    report_recovery(&log_path, result)
}

/// `recover s3://...`: the mount opened as a mount would (its lease taken back, its namespace
/// found), the log's intact batches applied into it (the bucket gets a manifest with them), the
/// crash marker cleared and the lease released.
fn run_recover_s3(
    source: &Path,
    s3: &coalescefs::backend::source::S3Source,
    opts: &options::MountOptions,
    log_path: Option<PathBuf>,
) -> ExitCode {
    let unmounted = match daemon::open_s3_unmounted(source, s3, opts) {
        Ok(unmounted) => unmounted,
        Err(message) => return fail(message),
    };
    let names = &unmounted.mount.names;
    let marker = match names.log_marker() {
        Ok(marker) => marker,
        Err(e) => return fail(format!("reading the crash marker of {}: {e}", s3.path_shown())),
    };
    let (log_path, device) =
        match log_to_recover(log_path, opts.state_dir.is_some(), &unmounted.state, marker.as_deref()) {
            Ok(found) => found,
            Err(message) => return fail(message),
        };
    let result =
        engine::salvage_log(&**names, &*unmounted.mount.store, Box::new(device), daemon::volatile_tail_of(source));
    if result.is_ok() && marker.as_deref().is_some_and(|marked| state::same_file(marked, &log_path)) {
        if let Err(e) = names.set_log_marker(None) {
            return fail(format!("clearing the crash marker of {}: {e}", s3.path_shown()));
        }
    }
    // What the log held is in the bucket now: another state directory may mount.
    if result.is_ok() {
        if let Err(message) = unmounted.mount.lease.release() {
            eprintln!("coalescefs: warning: {message}");
        }
    }
    report_recovery(&log_path, result)
}

/// The log `recover` salvages, opened: the one asked for (`--log`), else the state directory's
/// when `--state` was given, else the one the crash marker names, else the state directory's.
fn log_to_recover(
    asked: Option<PathBuf>,
    state_given: bool,
    state: &state::StateDir,
    marker: Option<&Path>,
) -> Result<(PathBuf, engine::intent_log::device::FileLogDevice), String> {
    let log_path = match (asked, state_given) {
        (Some(path), _) => mounts::absolute(&path),
        (None, true) => state.log_path(),
        (None, false) => marker.map_or_else(|| state.log_path(), Path::to_path_buf),
    };
    if !log_path.exists() {
        return Err(format!("no intent log at {}", log_path.display()));
    }
    let (device, _) = engine::intent_log::open_file_device(&log_path, None, state.path(), RawLog::Off)
        .map_err(|e| format!("{}: {e}", log_path.display()))?;
    Ok((log_path, device))
}

/// What `recover` says of its salvage, and its exit status.
fn report_recovery(log_path: &Path, result: Result<Vec<String>, String>) -> ExitCode {
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

/// `forget --orphans`: one line per directory whose backing directory is gone; with `remove`,
/// each removed (or why not). Exit status 1 if any could not be.
fn run_forget_orphans(remove: bool, discard: bool) -> ExitCode {
    let found = coalescefs::orphans::find();
    if found.is_empty() {
        println!("no state, runtime or volatile tail directory of a backing directory that is gone");
        return ExitCode::SUCCESS;
    }
    let mut refused = 0;
    for orphan in &found {
        let what = format!(
            "{} {} ({} KiB; {} is gone)",
            orphan.kind.name(),
            orphan.dir.display(),
            orphan.bytes.div_ceil(1024),
            orphan.backing.display()
        );
        if !remove {
            println!("{what}");
            continue;
        }
        match coalescefs::orphans::remove(orphan, discard) {
            Ok(()) => println!("removed {what}"),
            Err(message) => {
                eprintln!("coalescefs: left {}: {message}", orphan.dir.display());
                refused += 1;
            }
        }
    }
    if !remove {
        println!("`coalescefs forget --orphans --remove` removes them");
    }
    if refused > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn run_forget(backing: &Path, state_dir: Option<PathBuf>, discard: bool, options: Option<&str>) -> ExitCode {
    use coalescefs::backend::source::MountSource;
    let source = MountSource::parse(backing);
    let opts = match unmounted_options(options, state_dir.clone(), matches!(source, Ok(MountSource::S3(_)))) {
        Ok(opts) => opts,
        Err(message) => return fail(message),
    };
    if let Ok(MountSource::S3(s3)) = source {
        return match daemon::forget_s3(backing, &s3, &opts, discard) {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => fail(message),
        };
    }
    let database = match coalescefs::backend::source::MountSource::parse(backing) {
        Ok(coalescefs::backend::source::MountSource::Sqlite(db)) => Some(db),
        _ => None,
    };
    let backing = match &database {
        Some(db) => match coalescefs::backend::source::check_database_path(db) {
            Ok(path) if path.is_file() => path,
            Ok(path) => return fail(format!("SQLite database {}: no such file", path.display())),
            Err(message) => return fail(message),
        },
        None => match mounts::check_backing_dir(backing, true) {
            Ok(path) => path,
            Err(message) => return fail(message),
        },
    };
    // Both locks a mount takes, held until the end: the backing directory's (no mount of it
    // may start while its state goes) and the state directory's (another backing directory's
    // mount may share a state=DIR).
    let mut state = match state::StateDir::find(&backing, state_dir.as_deref()) {
        Ok(state) => state,
        Err(message) => return fail(format!("{message}: unmount it first")),
    };
    if let Err(message) = state.lock_if_present() {
        return fail(message);
    }
    // The crash marker: the backing directory's xattr, or the database's row.
    let database = match database {
        Some(_) => match coalescefs::backend::sqlite::SqliteBackend::open(
            &backing,
            None,
            Arc::new(metrics::Metrics::default()),
        ) {
            Ok(db) => Some(db),
            Err(message) => return fail(message),
        },
        None => None,
    };
    let marker = match &database {
        Some(db) => match db.log_marker() {
            Ok(marker) => marker,
            Err(e) => return fail(format!("reading the crash marker of {}: {e}", backing.display())),
        },
        None => match state::log_marker(&backing) {
            Ok(marker) => marker,
            Err(message) => return fail(message),
        },
    };
    // The state directory's log, and a log elsewhere (log=PATH) the backing directory says it needs.
    let mut logs = vec![state.log_path()];
    logs.extend(marker.clone().filter(|marked| !state::same_file(marked, &state.log_path())));
    for log_path in logs.iter().filter(|path| path.exists()) {
        match state::unreplayed_in_log(log_path, state.path(), &backing.display().to_string()) {
            Some(message) if discard => eprintln!("coalescefs: discarding: {message}"),
            Some(message) => return fail(message),
            None => {}
        }
    }
    if let Some(db) = &database {
        // The state directory's log goes: a place in it (the replay watermark) means nothing to
        // the log the next mount makes.
        use coalescefs::backend::{Namespace, UnitStore};
        if let Err(e) = db.set_replay_watermark(None).and_then(|()| db.sync_all()) {
            return fail(format!("forgetting the replay watermark of {}: {e}", backing.display()));
        }
    }
    if marker.is_some() {
        let cleared = match &database {
            Some(db) => {
                db.set_log_marker(None).map_err(|e| format!("clearing the crash marker of {}: {e}", backing.display()))
            }
            None => state::clear_log_marker(&backing),
        };
        if let Err(message) = cleared {
            return fail(message);
        }
    }
    drop(database);
    // The state directory may be one an admin named (state=DIR): only what coalescefs puts
    // there goes, and the directory if that leaves it empty.
    let runtime = runtime::RuntimeDir::of(&backing);
    let removed = state::remove_state_files(state.path())
        .and_then(|()| said_removed(state.path(), std::fs::remove_dir(state.path())))
        .and_then(|()| said_removed(runtime.path(), std::fs::remove_dir_all(runtime.path())))
        .and_then(|()| {
            let shm = runtime::shm_dir_of(&backing);
            said_removed(&shm, std::fs::remove_dir_all(&shm))
        });
    match removed {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => fail(message),
    }
}

/// Says what the removal of `dir` did: a directory that is not there is no error, one that
/// still holds others' files is left.
fn said_removed(dir: &Path, removal: std::io::Result<()>) -> Result<(), String> {
    match removal {
        Ok(()) => {
            println!("removed {}", dir.display());
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
            println!("left {}: it holds files coalescefs did not make", dir.display());
            Ok(())
        }
        Err(e) => Err(format!("removing {}: {e}", dir.display())),
    }
}

fn run_sync(target: &Path) -> ExitCode {
    match ask_after_cached_writes(target, "sync") {
        Ok(_) => ExitCode::SUCCESS,
        Err(message) => fail(message),
    }
}

fn run_snapshot(target: &Path, file: &Path) -> ExitCode {
    // The daemon's working directory is not ours: the path goes to it absolute, on one line.
    let file = mounts::absolute(file);
    let Some(shown) = file.to_str().filter(|path| !path.contains('\n')) else {
        return fail(format!("{file:?}: give the snapshot a UTF-8 path without a newline (the request is a line)"));
    };
    if file.symlink_metadata().is_ok() {
        return fail(format!("{shown} exists: a snapshot never writes over a file"));
    }
    match ask_after_cached_writes(target, &format!("snapshot {shown}")) {
        Ok((mount_point, made)) => {
            println!("{shown}: a snapshot of {}, {made}", mount_point.display());
            ExitCode::SUCCESS
        }
        Err(message) => fail(message),
    }
}

/// Asks the daemon of the mount at `target` for `request` (its first word names it in errors),
/// once the writes the kernel caches for it have reached it; returns the mount point and what
/// the daemon said after "ok".
fn ask_after_cached_writes(target: &Path, request: &str) -> Result<(PathBuf, String), String> {
    let (mount_point, backing) = backing_of_mount(target)?;
    mounts::send_cached_writes(&mount_point)?;
    let what = request.split(' ').next().unwrap_or(request);
    match control::ask(&runtime::RuntimeDir::of(&backing).socket_path(), request) {
        Ok(answer) if answer == "ok\n" || answer.starts_with("ok ") => {
            let said = answer.strip_prefix("ok").unwrap_or_default().trim().to_string();
            Ok((mount_point, said))
        }
        Ok(answer) => {
            Err(format!("{what} of {}: {}", mount_point.display(), answer.trim().trim_start_matches("error: ")))
        }
        Err(e) => Err(format!("the daemon of {} does not answer: {e}", mount_point.display())),
    }
}

/// `stats --watch`: a line per interval, until interrupted or the mount goes away.
fn watch_stats(target: &Path, seconds: f64) -> ExitCode {
    if !(seconds.is_finite() && seconds >= 0.1) {
        return usage_error(UsageError(format!("--watch {seconds}: give an interval of at least 0.1 seconds")));
    }
    let (mount_point, backing) = match backing_of_mount(target) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    let socket = runtime::RuntimeDir::of(&backing).socket_path();
    let sample = || -> Result<std::collections::HashMap<String, f64>, String> {
        let answer = control::ask(&socket, "stats")
            .map_err(|e| format!("the daemon of {} does not answer: {e}", mount_point.display()))?;
        Ok(answer
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                let (name, value) = (words.next()?, words.next()?);
                words.next().is_none().then(|| Some((name.to_string(), value.parse().ok()?))).flatten()
            })
            .collect())
    };
    let mut out = std::io::stdout();
    let mut before = match sample() {
        Ok(s) => s,
        Err(message) => return fail(message),
    };
    let header = format!(
        "{:>8} {:>10} {:>10} {:>10} {:>13} {:>9} {:>10} {:>10}",
        "time", "app MiB/s", "backend MiB/s", "log MiB/s", "amplification", "fsyncs/s", "FUSE req/s", "buffer MiB"
    );
    if writeln!(out, "{header}").is_err() {
        return ExitCode::SUCCESS;
    }
    loop {
        std::thread::sleep(std::time::Duration::from_secs_f64(seconds));
        let now = match sample() {
            Ok(s) => s,
            Err(message) => return fail(message),
        };
        let delta = |name: &str| now.get(name).copied().unwrap_or(0.0) - before.get(name).copied().unwrap_or(0.0);
        let requests: f64 = now
            .keys()
            .filter(|k| k.starts_with("fuse_") && k.ends_with("_total") && !k.ends_with("_busy_us_total"))
            .map(|k| delta(k))
            .sum();
        let (app, store, log) = (
            delta("application_write_bytes_total"),
            delta("backend_write_bytes_total"),
            delta("log_write_bytes_total"),
        );
        let amplification = if app > 0.0 { format!("{:.3}", (store + log) / app) } else { "-".to_string() };
        let mib_s = |bytes: f64| bytes / seconds / f64::from(1 << 20);
        let line = format!(
            "{:>8} {:>10.1} {:>10.1} {:>10.1} {:>13} {:>9.0} {:>10.0} {:>10.1}",
            clock_now(),
            mib_s(app),
            mib_s(store),
            mib_s(log),
            amplification,
            delta("fuse_fsync_total") / seconds,
            requests / seconds,
            now.get("buffer_bytes_used").copied().unwrap_or(0.0) / f64::from(1 << 20)
        );
        // A reader that stops (`| head`) ends the watch without an error.
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            return ExitCode::SUCCESS;
        }
        before = now;
    }
}

/// HH:MM:SS, UTC, for `stats --watch` lines.
fn clock_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format!("{:02}:{:02}:{:02}", secs / 3600 % 24, secs / 60 % 60, secs % 60)
}

fn run_stats(target: &Path, prometheus: bool) -> ExitCode {
    let (mount_point, backing) = match backing_of_mount(target) {
        Ok(found) => found,
        Err(message) => return fail(message),
    };
    match control::ask(&runtime::RuntimeDir::of(&backing).socket_path(), if prometheus { "metrics" } else { "stats" }) {
        Ok(answer) => {
            // A reader that stops early (`| head`) is not an error.
            let _ = std::io::stdout().write_all(answer.as_bytes());
            ExitCode::SUCCESS
        }
        Err(e) => fail(format!("the daemon of {} does not answer: {e}", mount_point.display())),
    }
}
