//! Command-line and `-o` mount options, parsed the FUSE way so that an `/etc/fstab` line and
//! `mount -t fuse.coalescefs` work through `mount.fuse3`.
//!
//! Owns: turning argv into a `MountRequest` or a clear error. Must not: touch the file system.

use std::path::PathBuf;

/// What the user asked for, before anything is checked against the system.
#[derive(Debug, Clone, PartialEq)]
pub struct MountRequest {
    pub backing_dir: PathBuf,
    pub mount_point: PathBuf,
    pub foreground: bool,
    pub options: MountOptions,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MountOptions {
    pub allow_other: bool,
    pub allow_root: bool,
    pub read_only: bool,
    pub fsname: Option<String>,
    /// Kernel mount flags passed through as given (nodev, noexec, ...).
    pub kernel_flags: Vec<String>,
    /// FUSE worker threads.
    pub threads: usize,
    /// `cache_timeout=DURATION`: how long the kernel may trust names (and that a name is missing)
    /// and attributes.
    pub cache_timeout: std::time::Duration,
    /// `io_timeout=DURATION`: how long a request waits for a backend that finishes nothing.
    pub io_timeout: std::time::Duration,
    /// `mount -o remount,...`: change the flags of an existing mount, start nothing.
    pub remount: bool,
    /// `unit=SIZE`: the unit size, instead of the one discovered from the backing device.
    pub unit_bytes: Option<u64>,
    /// `sqlite_journal=wal|rollback`: a `sqlite:` database's journal mode from this mount on
    /// (`backend::sqlite::Journal`); unset, the database keeps its own.
    pub sqlite_journal: Option<crate::backend::sqlite::Journal>,
    /// `buffer=SIZE`: the write buffer's memory bound.
    pub buffer_bytes: u64,
    /// `flushers=N`: parallel flusher threads.
    pub flushers: usize,
    /// `flushers=` was given (else the store's `Capabilities::preferred_flushers` decides).
    pub flushers_given: bool,
    /// `flush_age=DURATION`: the longest a partial unit waits in memory.
    pub flush_age: std::time::Duration,
    /// `writeback_cache[=auto|on|off]`: how writes use the kernel's page cache.
    pub writeback_cache: crate::engine::PageCache,
    /// `metrics=ADDR:PORT`: serve the counters in the Prometheus text format.
    pub metrics_address: Option<std::net::SocketAddr>,
    /// `backend=local|null`: where data goes (names and attributes always in the directory).
    pub backend: BackendKind,
    /// `max_write=SIZE`: the largest FUSE write request asked of the kernel, instead of the
    /// unit size (capped at 16 MiB either way).
    pub max_write_bytes: Option<u64>,
    /// `log=on|off|PATH`: the intent log, in the state directory (`on`, the default) or at PATH.
    pub log: LogPlace,
    /// `state=DIR`: the state directory (see `state.rs`; default under /var/lib/coalescefs).
    pub state_dir: Option<std::path::PathBuf>,
    /// `log_size=SIZE`: the intent log's ring.
    pub log_size_bytes: u64,
    /// `checkpoint_interval=DURATION`: the longest between intent log checkpoints.
    pub checkpoint_interval: std::time::Duration,
    /// `checkpoint_idle=DURATION`: a checkpoint once nothing has been logged for this long.
    pub checkpoint_idle: std::time::Duration,
    /// `log_threshold=SIZE`: the most buffered bytes of a file that existed at the last
    /// checkpoint one fsync puts in the log.
    pub log_threshold_bytes: u64,
    /// `log_threshold_new=SIZE`: the same for a file created since the last checkpoint.
    pub log_threshold_new_bytes: u64,
    /// `log_closes=auto|always|never`: which closes of new or changed files the intent log takes.
    pub log_closes: crate::engine::LogCloses,
    /// `burst_gap=DURATION`: closes less than this apart are a burst (see `log_closes`).
    pub burst_gap: std::time::Duration,
    /// `log_raw=auto|off`: whether a log file's blocks may be written on its block device
    /// (see `engine::intent_log::raw`).
    pub log_raw: crate::engine::intent_log::raw::RawLog,
    /// `xattr=on|off`: extended attributes served (the default), or refused as unsupported
    /// (see `fuse::FuseAdapter::xattrs`).
    pub xattrs: bool,
    /// `fsync=log|backend`: an fsync answered by the intent log (the default) or by a checkpoint
    /// (`engine::EngineConfig::fsync_checkpoints`).
    pub fsync_backend: bool,
    /// `transport=auto|uring|dev`: how FUSE requests reach the daemon (see `transport`).
    pub transport: crate::transport::TransportChoice,
    /// `session=mounter|own`: the session the detached daemon runs in (see [`DaemonSession`]).
    pub session: DaemonSession,
    /// `endpoint=http://HOST:PORT`: the S3 server of an `s3://` source.
    pub s3_endpoint: Option<String>,
    /// `region=NAME`: the region an `s3://` source's requests are signed for.
    pub s3_region: Option<String>,
}

/// Which session the detached daemon runs in. Either way it leads a process group of its own,
/// so that the terminal's job control (Ctrl-C to the foreground job, the SIGHUP a hangup sends
/// it) never reaches it. The choice matters where the kernel's autogroups are on
/// (`kernel.sched_autogroup_enabled`; on without systemd, which puts sessions in cgroups and
/// the daemon in the mounter's cgroup either way): a session is then a scheduling group, and
/// over io_uring a client in another group than the daemon is moved off the daemon's CPU at
/// nearly every request (bench/results/2026-12-03-daemon-session: fstat 36.3 us against 12.6 in
/// one group; tar extract and rsync 1.3x slower).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DaemonSession {
    /// The session `coalescefs mount` ran in (the default): programs started there share the
    /// daemon's scheduling group.
    Mounter,
    /// A session of its own (`setsid`), as libfuse's `fuse_daemonize` makes.
    Own,
}

impl DaemonSession {
    /// The option's value for it, as `session=` takes it and `stats` shows it.
    pub fn name(self) -> &'static str {
        match self {
            DaemonSession::Mounter => "mounter",
            DaemonSession::Own => "own",
        }
    }
}

/// The region an S3 request is signed for when `region=` gives none (RGW and SeaweedFS take
/// any).
pub const S3_REGION_DEFAULT: &str = "us-east-1";

/// Option names that would carry S3 credentials: refused, never taken (they would show in
/// `mount`, `ps` and the daemon's log).
const CREDENTIAL_OPTIONS: &[&str] = &[
    "access_key",
    "secret_key",
    "access_key_id",
    "secret_access_key",
    "aws_access_key_id",
    "aws_secret_access_key",
    "session_token",
    "aws_session_token",
    "passwd_file",
];

/// `endpoint=`: `http://` or `https://`, a host, an optional port, nothing after.
fn check_endpoint(v: &str) -> Result<String, UsageError> {
    let bad = |why: &str| UsageError(format!("endpoint={v}: {why} (example: endpoint=http://127.0.0.1:8333)"));
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .ok_or_else(|| bad("expected http:// or https://"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('@') {
        return Err(UsageError(format!(
            "endpoint={v}: credentials never go in options; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a credentials file)"
        )));
    }
    if rest.contains(['/', '?', '#']) {
        return Err(bad("expected only a host and a port, no path"));
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(']') || host.starts_with('[') => (host, Some(port)),
        _ => (rest, None),
    };
    if host.is_empty() || !host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._[]:".contains(&b)) {
        return Err(bad("expected a host name or address"));
    }
    if let Some(port) = port {
        if !port.parse::<u16>().is_ok_and(|p| p > 0) {
            return Err(bad("expected a port from 1 to 65535"));
        }
    }
    Ok(v.trim_end_matches('/').to_owned())
}

/// BlueStore's `prefer_deferred_size` on HDD: a time decision (one sequential log write rather
/// than scattered small backend writes), which bench's rand512 case measures.
pub const LOG_THRESHOLD_BYTES_DEFAULT: u64 = 64 << 10;
/// For a new file the log's price is its bytes twice (log, then checkpoint) and the backend
/// path's is its bytes once plus one journal commit. bench's logthreshold case on ext4
/// (bench/results/2026-11-23-intent-log): device bytes log / backend 0.77x at 16 KiB, 0.96x at
/// 24 KiB, 1.09x at 32 KiB, 1.39x at 64 KiB; the largest measured size the log wins is the
/// default.
pub const LOG_THRESHOLD_NEW_BYTES_DEFAULT: u64 = 24 << 10;

/// `backend=`: where data goes (names and attributes are the local directory's either way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The backing directory's files.
    Local,
    /// Nowhere: counted and discarded, sizes kept (the FUSE and engine ceiling).
    Null,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LogPlace {
    Off,
    StateDir,
    At(std::path::PathBuf),
    /// No `log=` given: `StateDir`, except for a read-only mount, which writes no log
    /// (resolved by `mount_request`; nothing after it sees this).
    Default,
}

pub const LOG_SIZE_BYTES_DEFAULT: u64 = 64 << 20;

pub const BUFFER_BYTES_DEFAULT: u64 = 256 << 20;

/// The longest between two checkpoints while the log holds records: what a store's view may lag
/// the mount by (another reader of a database, another machine after an S3 mount is lost), and
/// how much a steady trickle of writes shares one checkpoint's fixed cost, ~74-95 KB on ext4
/// whatever it carries (bench/results/2026-11-29-sqlite-layout). A configuration store that
/// rewrites a file every 2 s paid 12.5 KiB a rewrite at 30 s (bench/results/2026-11-28-sporadic);
/// five minutes is also PostgreSQL's `checkpoint_timeout`.
pub const CHECKPOINT_INTERVAL_DEFAULT: std::time::Duration = std::time::Duration::from_secs(300);

/// A checkpoint once nothing has been logged for this long: a burst (a package install, a
/// commit) reaches the store soon after it ends, as with the 30 s timer before, while a trickle
/// waits for `CHECKPOINT_INTERVAL_DEFAULT`. Also the longest a close's batch waits for the log's
/// device to be flushed.
pub const CHECKPOINT_IDLE_DEFAULT: std::time::Duration = std::time::Duration::from_secs(30);

/// Only this mount changes the backing directory while it is mounted (its lock on the directory
/// keeps a second mount out), so what the kernel was told stays true until the mount itself
/// changes it, and the kernel then learns of it. Every expiry costs a LOOKUP or GETATTR round
/// trip per cached object (git status lstat()s every file); the timeout bounds how long
/// someone who edits the backing directory underneath anyway sees the old state.
pub const CACHE_TIMEOUT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(60);

pub use crate::parse::parse_duration;

fn default_flushers() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(2, 8)
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            allow_other: false,
            allow_root: false,
            read_only: false,
            fsname: None,
            kernel_flags: Vec::new(),
            threads: 4,
            cache_timeout: CACHE_TIMEOUT_DEFAULT,
            io_timeout: std::time::Duration::from_secs(30),
            remount: false,
            unit_bytes: None,
            sqlite_journal: None,
            buffer_bytes: BUFFER_BYTES_DEFAULT,
            flushers: default_flushers(),
            flushers_given: false,
            flush_age: std::time::Duration::from_secs(5),
            writeback_cache: crate::engine::PageCache::Auto,
            metrics_address: None,
            backend: BackendKind::Local,
            max_write_bytes: None,
            log: LogPlace::Default,
            state_dir: None,
            log_size_bytes: LOG_SIZE_BYTES_DEFAULT,
            checkpoint_interval: CHECKPOINT_INTERVAL_DEFAULT,
            checkpoint_idle: CHECKPOINT_IDLE_DEFAULT,
            log_threshold_bytes: LOG_THRESHOLD_BYTES_DEFAULT,
            log_threshold_new_bytes: LOG_THRESHOLD_NEW_BYTES_DEFAULT,
            log_closes: crate::engine::LogCloses::Auto,
            burst_gap: crate::engine::burst::BURST_GAP,
            log_raw: crate::engine::intent_log::raw::RawLog::Auto,
            xattrs: true,
            fsync_backend: false,
            transport: crate::transport::TransportChoice::Auto,
            session: DaemonSession::Mounter,
            s3_endpoint: None,
            s3_region: None,
        }
    }
}

/// A usage error: printed with the usage line, exit status 2.
#[derive(Debug, PartialEq)]
pub struct UsageError(pub String);

/// Options that fstab and `mount.fuse3` hand to every helper and that mean nothing to the
/// daemon itself; accepted so that an fstab line works, ignored on purpose.
const IGNORED_OPTIONS: &[&str] =
    &["defaults", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser", "owner", "rw", "async"];

/// Kernel mount flags accepted and passed through.
const KERNEL_FLAGS: &[&str] = &[
    "dev",
    "nodev",
    "suid",
    "nosuid",
    "exec",
    "noexec",
    "atime",
    "noatime",
    "relatime",
    "diratime",
    "nodiratime",
    "sync",
    "dirsync",
];

pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let number: u64 = digits.parse().map_err(|_| format!("'{text}' is not a size (examples: 4096, 64K, 4M, 1G)"))?;
    let multiplier: u64 = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("'{text}' has an unknown size suffix (use K, M or G)")),
    };
    number.checked_mul(multiplier).ok_or_else(|| format!("'{text}' is too large"))
}

/// A thread count option (threads=, flushers=): 1 to 64.
fn thread_count(key: &str, v: &str) -> Result<usize, UsageError> {
    v.parse()
        .ok()
        .filter(|n| (1..=64).contains(n))
        .ok_or_else(|| UsageError(format!("{key}={v}: expected a whole number from 1 to 64")))
}

/// One `key[=value]` of `-o`, with the parsing its values share; errors name the option.
struct OptionArg<'a> {
    key: &'a str,
    value: Option<&'a str>,
}

impl<'a> OptionArg<'a> {
    fn value(&self) -> Result<&'a str, UsageError> {
        let key = self.key;
        self.value.ok_or_else(|| UsageError(format!("mount option '{key}' needs a value ({key}=...)")))
    }

    fn size(&self) -> Result<u64, UsageError> {
        let v = self.value()?;
        parse_size(v).map_err(|e| UsageError(format!("{}={v}: {e}", self.key)))
    }

    fn duration(&self) -> Result<std::time::Duration, UsageError> {
        let v = self.value()?;
        parse_duration(v).map_err(|e| UsageError(format!("{}={v}: {e}", self.key)))
    }

    fn positive_duration(&self) -> Result<std::time::Duration, UsageError> {
        let d = self.duration()?;
        if d.is_zero() {
            return Err(UsageError(format!("{}={}: must be more than 0", self.key, self.value()?)));
        }
        Ok(d)
    }

    /// An error for a value outside what the option takes: `expected` says what it takes.
    fn refused(&self, expected: &str) -> UsageError {
        UsageError(format!("{}={}: {expected}", self.key, self.value.unwrap_or_default()))
    }
}

fn apply_option(options: &mut MountOptions, option: &str) -> Result<(), UsageError> {
    let (key, value) = match option.split_once('=') {
        Some((k, v)) => (k, Some(v)),
        None => (option, None),
    };
    let arg = OptionArg { key, value };
    if apply_write_path_option(options, &arg)? || apply_log_option(options, &arg)? || apply_store_option(options, &arg)?
    {
        return Ok(());
    }
    match key {
        "" => {}
        "allow_other" => options.allow_other = true,
        "allow_root" => options.allow_root = true,
        "ro" => options.read_only = true,
        "remount" => options.remount = true,
        // Always on: the kernel checks permissions against the modes the backend reports.
        "default_permissions" => {}
        "fsname" => options.fsname = Some(arg.value()?.to_string()),
        "subtype" => {}
        "metrics" => {
            let v = arg.value()?;
            options.metrics_address =
                Some(v.parse().map_err(|_| arg.refused("expected ADDRESS:PORT, for example 127.0.0.1:9100"))?);
        }
        k if CREDENTIAL_OPTIONS.contains(&k.to_ascii_lowercase().as_str()) => {
            return Err(UsageError(format!(
                "{k}: credentials never go in mount options (they would show in `mount` and the daemon's log); \
                 set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a credentials file"
            )))
        }
        k if KERNEL_FLAGS.contains(&k) && value.is_none() => options.kernel_flags.push(k.to_string()),
        k if IGNORED_OPTIONS.contains(&k) || k.starts_with("x-") || k == "comment" => {}
        // What the kernel shows for a mounted FUSE file system, which mount(8) hands back on
        // `mount -o remount,...`: set by the daemon itself, never by the user.
        "user_id" | "group_id" | "rootmode" | "max_read" | "blksize" if value.is_some() => {}
        _ => return Err(UsageError(format!("unknown mount option '{option}'"))),
    }
    Ok(())
}

/// The write buffer, its flushers and the FUSE session: returns whether `arg` was one of them.
fn apply_write_path_option(options: &mut MountOptions, arg: &OptionArg<'_>) -> Result<bool, UsageError> {
    match arg.key {
        "unit" => {
            let bytes = arg.size()?;
            options.unit_bytes = Some(crate::backend::local::geometry::check_unit_bytes(bytes).map_err(UsageError)?);
        }
        "buffer" => options.buffer_bytes = arg.size()?,
        "flushers" => {
            options.flushers = thread_count(arg.key, arg.value()?)?;
            options.flushers_given = true;
        }
        "flush_age" => options.flush_age = arg.duration()?,
        "writeback_cache" => {
            options.writeback_cache = match arg.value {
                None | Some("on") => crate::engine::PageCache::On,
                Some("off") => crate::engine::PageCache::Off,
                Some("auto") => crate::engine::PageCache::Auto,
                Some(_) => return Err(arg.refused("expected auto, on or off")),
            }
        }
        "max_write" => {
            let bytes = arg.size()?;
            if !(4096..=crate::fuse::MAX_WRITE_BYTES_LIMIT).contains(&bytes) || bytes % 4096 != 0 {
                return Err(arg.refused("expected a multiple of 4 KiB from 4K to 16M"));
            }
            options.max_write_bytes = Some(bytes);
        }
        "transport" => {
            options.transport = crate::transport::TransportChoice::parse(arg.value()?).map_err(UsageError)?;
        }
        "session" => {
            let value = arg.value()?;
            options.session = [DaemonSession::Mounter, DaemonSession::Own]
                .into_iter()
                .find(|session| session.name() == value)
                .ok_or_else(|| arg.refused("expected mounter or own"))?;
        }
        "xattr" => {
            options.xattrs = match arg.value()? {
                "on" => true,
                "off" => false,
                _ => return Err(arg.refused("expected on or off")),
            }
        }
        "threads" => options.threads = thread_count(arg.key, arg.value()?)?,
        "io_timeout" => options.io_timeout = arg.positive_duration()?,
        "cache_timeout" => options.cache_timeout = arg.duration()?,
        _ => return Ok(false),
    }
    Ok(true)
}

/// The intent log and its checkpoints: returns whether `arg` was one of them.
fn apply_log_option(options: &mut MountOptions, arg: &OptionArg<'_>) -> Result<bool, UsageError> {
    match arg.key {
        "log" => {
            options.log = match arg.value()? {
                "off" => LogPlace::Off,
                "on" => LogPlace::StateDir,
                p if p.starts_with('/') => LogPlace::At(p.into()),
                _ => return Err(arg.refused("expected on, off or an absolute path")),
            }
        }
        "state" => {
            let v = arg.value()?;
            if !v.starts_with('/') {
                return Err(arg.refused("expected an absolute path"));
            }
            options.state_dir = Some(v.into());
        }
        "log_raw" => {
            use crate::engine::intent_log::raw::RawLog;
            options.log_raw = match arg.value()? {
                "auto" => RawLog::Auto,
                "off" => RawLog::Off,
                _ => return Err(arg.refused("expected auto or off")),
            }
        }
        "log_size" => {
            let bytes = arg.size()?;
            if bytes < 1 << 20 || bytes % 4096 != 0 {
                return Err(arg.refused("expected at least 1M, in whole 4K blocks"));
            }
            options.log_size_bytes = bytes;
        }
        "log_threshold" | "log_threshold_new" => {
            let bytes = arg.size()?;
            if bytes > 16 << 20 {
                return Err(arg.refused("at most 16M"));
            }
            if arg.key == "log_threshold" {
                options.log_threshold_bytes = bytes;
            } else {
                options.log_threshold_new_bytes = bytes;
            }
        }
        "log_closes" => {
            options.log_closes = match arg.value()? {
                "auto" => crate::engine::LogCloses::Auto,
                "always" => crate::engine::LogCloses::Always,
                "never" => crate::engine::LogCloses::Never,
                _ => return Err(arg.refused("expected auto, always or never")),
            }
        }
        "fsync" => {
            options.fsync_backend = match arg.value()? {
                "log" => false,
                "backend" => true,
                _ => return Err(arg.refused("expected log or backend")),
            }
        }
        "checkpoint_interval" => options.checkpoint_interval = arg.positive_duration()?,
        "checkpoint_idle" => options.checkpoint_idle = arg.positive_duration()?,
        "burst_gap" => {
            let d = arg.duration()?;
            if d > std::time::Duration::from_secs(10) {
                return Err(arg.refused("at most 10s"));
            }
            options.burst_gap = d;
        }
        _ => return Ok(false),
    }
    Ok(true)
}

/// Which store and how to reach it (S3's endpoint and region): returns whether `arg` was one.
fn apply_store_option(options: &mut MountOptions, arg: &OptionArg<'_>) -> Result<bool, UsageError> {
    match arg.key {
        "backend" => {
            options.backend = match arg.value()? {
                "local" => BackendKind::Local,
                "null" => BackendKind::Null,
                _ => return Err(arg.refused("expected local or null")),
            }
        }
        "endpoint" => options.s3_endpoint = Some(check_endpoint(arg.value()?)?),
        "sqlite_journal" => {
            let journal = crate::backend::sqlite::Journal::parse(arg.value()?);
            options.sqlite_journal = Some(journal.ok_or_else(|| arg.refused("expected wal or rollback"))?);
        }
        "region" => {
            let v = arg.value()?;
            if v.is_empty()
                || v.len() > 64
                || !v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return Err(arg.refused("expected a region name such as us-east-1"));
            }
            options.s3_region = Some(v.to_owned());
        }
        _ => return Ok(false),
    }
    Ok(true)
}

pub fn parse_mount_options(text: &str, options: &mut MountOptions) -> Result<(), UsageError> {
    for option in text.split(',') {
        apply_option(options, option.trim())?;
    }
    Ok(())
}

/// Parses the arguments after `mount` (or, in the helper form `mount.fuse3` uses, all of them):
/// `BACKING_DIR MOUNTPOINT [-o opt,...] [-f|--foreground]`, in any order.
pub fn parse_mount_args(args: &[String]) -> Result<MountRequest, UsageError> {
    let mut positional = Vec::new();
    let mut options = MountOptions::default();
    let mut foreground = false;
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        match arg.as_str() {
            "-f" | "--foreground" => foreground = true,
            "-o" => {
                i += 1;
                let text = args.get(i).ok_or_else(|| UsageError("-o needs a list of options".into()))?;
                parse_mount_options(text, &mut options)?;
            }
            a if a.starts_with("-o") && a.len() > 2 => parse_mount_options(&a[2..], &mut options)?,
            // mount(8) passes these to helpers: -n (no mtab), -s (sloppy), -v (verbose).
            "-n" | "-s" | "-v" => {}
            a if a.starts_with('-') && a.len() > 1 => return Err(UsageError(format!("unknown flag '{a}'"))),
            _ => positional.push(arg.clone()),
        }
        i += 1;
    }
    if positional.len() != 2 {
        return Err(UsageError(format!("expected BACKING_DIR and MOUNTPOINT, got {} argument(s)", positional.len())));
    }
    mount_request(PathBuf::from(&positional[0]), PathBuf::from(&positional[1]), options, foreground)
}

/// The arguments of `mount` once parsed (by the command line, or `parse_mount_args`), with
/// the checks that take several options together.
pub fn mount_request(
    backing_dir: PathBuf,
    mount_point: PathBuf,
    mut options: MountOptions,
    foreground: bool,
) -> Result<MountRequest, UsageError> {
    if options.allow_other && options.allow_root {
        return Err(UsageError("allow_other and allow_root exclude each other".into()));
    }
    options.log = match options.log {
        LogPlace::Default if options.read_only => LogPlace::Off,
        LogPlace::Default => LogPlace::StateDir,
        LogPlace::StateDir | LogPlace::At(_) if options.read_only => {
            return Err(UsageError(
                "ro: a read-only mount writes no intent log (leave log= out, or mount read-write to replay one)".into(),
            ))
        }
        given => given,
    };
    let source = crate::backend::source::MountSource::parse(&backing_dir).map_err(UsageError)?;
    match source {
        crate::backend::source::MountSource::S3(ref s3) => {
            if options.s3_endpoint.is_none() {
                return Err(UsageError(format!(
                    "{}: needs the S3 server, -o endpoint=http://HOST:PORT",
                    s3.path_shown()
                )));
            }
            if let Some(unit) = options.unit_bytes.filter(|&u| u < crate::backend::s3::store::MIN_UNIT_BYTES) {
                return Err(UsageError(format!(
                    "unit={unit}: an S3 mount's unit is at least 1M (a PUT costs the server 40-120 KB whatever its size)"
                )));
            }
            if options.backend != BackendKind::Local {
                return Err(UsageError("backend=null: an S3 source keeps its data in the bucket".into()));
            }
            if options.log == LogPlace::Off && !options.read_only {
                // Its namespace database's commits are this machine's only record of what
                // the bucket's objects hold between checkpoints; fsync would have no log.
                return Err(UsageError("log=off: an S3 mount keeps its intent log on".into()));
            }
        }
        _ => {
            for (given, name) in [(options.s3_endpoint.is_some(), "endpoint"), (options.s3_region.is_some(), "region")]
            {
                if given {
                    return Err(UsageError(format!("{name}=: only for an s3://BUCKET/PREFIX source")));
                }
            }
        }
    }
    if options.sqlite_journal.is_some() {
        if !matches!(source, crate::backend::source::MountSource::Sqlite(_)) {
            return Err(UsageError("sqlite_journal=: only for a sqlite:PATH source".into()));
        }
        if options.read_only {
            return Err(UsageError("sqlite_journal=: a read-only mount changes nothing in the database".into()));
        }
    }
    let unit_bytes = options.unit_bytes.unwrap_or(0);
    if options.buffer_bytes < 2 * unit_bytes.max(4096) {
        return Err(UsageError(format!(
            "buffer={} must hold at least two units ({} bytes each)",
            options.buffer_bytes,
            unit_bytes.max(4096)
        )));
    }
    // One fsync's batch must fit the ring with room to spare: past half full the checkpointer
    // empties it, and a batch larger than that would only ever fall back to the backend.
    for (key, bytes) in
        [("log_threshold", options.log_threshold_bytes), ("log_threshold_new", options.log_threshold_new_bytes)]
    {
        if bytes > options.log_size_bytes / 4 {
            return Err(UsageError(format!(
                "{key}={bytes} must be at most a quarter of log_size={} (raise log_size or lower {key})",
                options.log_size_bytes
            )));
        }
    }
    Ok(MountRequest { backing_dir, mount_point, foreground, options })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn fstab_style_options_parse() {
        let req = parse_mount_args(&args(&[
            "/srv/data",
            "/mnt",
            "-o",
            "rw,allow_other,noatime,nofail,x-systemd.automount,threads=8",
        ]))
        .unwrap();
        assert!(req.options.allow_other);
        assert_eq!(req.options.threads, 8);
        assert_eq!(req.options.kernel_flags, vec!["noatime".to_string()]);
        assert!(!req.foreground);
    }

    #[test]
    fn unknown_option_is_refused_by_name() {
        let err = parse_mount_args(&args(&["a", "b", "-o", "allow_other,frobnicate"])).unwrap_err();
        assert_eq!(err.0, "unknown mount option 'frobnicate'");
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(parse_mount_args(&args(&["a", "b", "-othreads=0"])).is_err());
        assert!(parse_mount_args(&args(&["a", "b", "-o", "fsname"])).is_err());
        assert!(parse_mount_args(&args(&["a"])).is_err());
        assert!(parse_mount_args(&args(&["a", "b", "--bogus"])).is_err());
    }

    #[test]
    fn xattr_takes_on_or_off() {
        assert!(parse_mount_args(&args(&["a", "b"])).unwrap().options.xattrs);
        assert!(!parse_mount_args(&args(&["a", "b", "-o", "xattr=off"])).unwrap().options.xattrs);
    }

    #[test]
    fn session_is_mounter_or_own() {
        assert_eq!(parse_mount_args(&args(&["a", "b"])).unwrap().options.session, DaemonSession::Mounter);
        let own = parse_mount_args(&args(&["a", "b", "-o", "session=own"])).unwrap();
        assert_eq!(own.options.session, DaemonSession::Own);
        let error = parse_mount_args(&args(&["a", "b", "-o", "session=shared"])).unwrap_err();
        assert!(error.0.contains("session=shared: expected mounter or own"), "{}", error.0);
    }

    #[test]
    fn transport_is_auto_uring_or_dev() {
        use crate::transport::TransportChoice;
        assert_eq!(parse_mount_args(&args(&["a", "b"])).unwrap().options.transport, TransportChoice::Auto);
        for (value, choice) in
            [("auto", TransportChoice::Auto), ("uring", TransportChoice::Uring), ("dev", TransportChoice::Dev)]
        {
            let option = format!("transport={value}");
            assert_eq!(parse_mount_args(&args(&["a", "b", "-o", &option])).unwrap().options.transport, choice);
        }
        let error = parse_mount_args(&args(&["a", "b", "-o", "transport=ring"])).unwrap_err();
        assert!(error.0.contains("transport=ring: expected auto, uring or dev"), "{}", error.0);
        let err = parse_mount_args(&args(&["a", "b", "-o", "xattr=no"])).unwrap_err();
        assert_eq!(err.0, "xattr=no: expected on or off");
    }

    #[test]
    fn log_raw_takes_auto_or_off() {
        use crate::engine::intent_log::raw::RawLog;
        assert_eq!(parse_mount_args(&args(&["a", "b"])).unwrap().options.log_raw, RawLog::Auto);
        let req = parse_mount_args(&args(&["a", "b", "-o", "log_raw=off"])).unwrap();
        assert_eq!(req.options.log_raw, RawLog::Off);
        let err = parse_mount_args(&args(&["a", "b", "-o", "log_raw=on"])).unwrap_err();
        assert_eq!(err.0, "log_raw=on: expected auto or off");
    }

    #[test]
    fn fsync_takes_log_or_backend() {
        assert!(!parse_mount_args(&args(&["a", "b"])).unwrap().options.fsync_backend);
        assert!(parse_mount_args(&args(&["a", "b", "-o", "fsync=backend"])).unwrap().options.fsync_backend);
        assert!(!parse_mount_args(&args(&["a", "b", "-o", "fsync=log"])).unwrap().options.fsync_backend);
        let err = parse_mount_args(&args(&["a", "b", "-o", "fsync=store"])).unwrap_err();
        assert_eq!(err.0, "fsync=store: expected log or backend");
    }

    #[test]
    fn log_closes_takes_auto_always_or_never() {
        assert_eq!(parse_mount_args(&args(&["a", "b"])).unwrap().options.log_closes, crate::engine::LogCloses::Auto);
        let req = parse_mount_args(&args(&["a", "b", "-o", "log_closes=always"])).unwrap();
        assert_eq!(req.options.log_closes, crate::engine::LogCloses::Always);
        let req = parse_mount_args(&args(&["a", "b", "-o", "log_closes=never"])).unwrap();
        assert_eq!(req.options.log_closes, crate::engine::LogCloses::Never);
        let err = parse_mount_args(&args(&["a", "b", "-o", "log_closes=off"])).unwrap_err();
        assert_eq!(err.0, "log_closes=off: expected auto, always or never");
    }

    #[test]
    fn burst_gap_takes_a_duration_up_to_ten_seconds() {
        let defaults = parse_mount_args(&args(&["a", "b"])).unwrap().options;
        assert_eq!(defaults.burst_gap, std::time::Duration::from_millis(2));
        let req = parse_mount_args(&args(&["a", "b", "-o", "burst_gap=50ms"])).unwrap();
        assert_eq!(req.options.burst_gap, std::time::Duration::from_millis(50));
        assert!(parse_mount_args(&args(&["a", "b", "-o", "burst_gap=11s"])).unwrap_err().0.contains("at most 10s"));
        assert!(parse_mount_args(&args(&["a", "b", "-o", "burst_gap=soon"]))
            .unwrap_err()
            .0
            .starts_with("burst_gap=soon"));
    }

    #[test]
    fn unit_option_takes_a_power_of_two_size() {
        let req = parse_mount_args(&args(&["a", "b", "-o", "unit=4M"])).unwrap();
        assert_eq!(req.options.unit_bytes, Some(4 << 20));
        let err = parse_mount_args(&args(&["a", "b", "-o", "unit=3M"])).unwrap_err();
        assert_eq!(err.0, "unit=3145728: must be a power of two from 4K to 64M");
        assert!(parse_mount_args(&args(&["a", "b", "-o", "unit=lots"])).is_err());
    }

    #[test]
    fn the_log_is_on_by_default_except_on_a_read_only_mount() {
        let log_of = |extra: &[&str]| {
            let mut a = vec!["a", "b"];
            a.extend_from_slice(extra);
            parse_mount_args(&args(&a)).map(|r| r.options.log)
        };
        assert_eq!(log_of(&[]), Ok(LogPlace::StateDir));
        assert_eq!(log_of(&["-o", "log=off"]), Ok(LogPlace::Off));
        assert_eq!(log_of(&["-o", "ro"]), Ok(LogPlace::Off));
        assert_eq!(log_of(&["-o", "ro,log=off"]), Ok(LogPlace::Off));
        let err = log_of(&["-o", "ro,log=on"]).unwrap_err();
        assert!(err.0.contains("read-only mount writes no intent log"), "{}", err.0);
        assert!(log_of(&["-o", "log=/var/log.img,ro"]).is_err());
    }

    #[test]
    fn a_log_threshold_must_fit_a_quarter_of_the_log() {
        assert!(parse_mount_args(&args(&["a", "b", "-o", "log=on,log_size=1M,log_threshold=256K"])).is_ok());
        let err = parse_mount_args(&args(&["a", "b", "-o", "log=on,log_size=1M,log_threshold_new=512K"])).unwrap_err();
        assert_eq!(err.0, "log_threshold_new=524288 must be at most a quarter of log_size=1048576 (raise log_size or lower log_threshold_new)");
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("4M"), Ok(4 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("4X").is_err());
        assert!(parse_size("M").is_err());
    }

    #[test]
    fn s3_options_are_checked_and_credentials_refused() {
        let mount = |source: &str, opts: &str| parse_mount_args(&args(&[source, "/mnt", "-o", opts]));
        let req = mount("s3://bkt/tree", "endpoint=http://127.0.0.1:8333,region=eu-west-1,io_timeout=10s").unwrap();
        assert_eq!(req.options.s3_endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        assert_eq!(req.options.s3_region.as_deref(), Some("eu-west-1"));
        assert_eq!(req.options.io_timeout, std::time::Duration::from_secs(10));
        assert!(!req.options.flushers_given, "the store's preference decides (`Capabilities::preferred_flushers`)");
        let given = mount("s3://bkt/tree", "endpoint=http://h,flushers=3").unwrap().options;
        assert_eq!((given.flushers, given.flushers_given), (3, true));
        assert_eq!(parse_mount_args(&args(&["/srv/data", "/mnt"])).unwrap().options.flushers, default_flushers());
        let req = mount("s3://bkt/tree", "endpoint=http://h,ro").unwrap();
        assert_eq!((req.options.read_only, req.options.log.clone()), (true, LogPlace::Off), "a read-only S3 mount");
        let error = |source: &str, opts: &str| mount(source, opts).unwrap_err().0;
        assert!(error("s3://bkt/tree", "region=x").contains("needs the S3 server"));
        assert!(error("s3://bkt/tree", "endpoint=ftp://h").contains("http:// or https://"));
        assert!(error("s3://bkt/tree", "endpoint=http://h:99999").contains("port"));
        assert!(error("s3://bkt/tree", "endpoint=http://h/path").contains("no path"));
        assert!(error("s3://bkt/tree", "endpoint=http://key:secret@h").contains("credentials never"));
        assert!(error("s3://bkt/tree", "endpoint=http://h,region=Bad_Region").contains("region=Bad_Region"));
        assert!(error("s3://bkt/tree", "endpoint=http://h,secret_key=abc").contains("AWS_SECRET_ACCESS_KEY"));
        assert!(error("s3://bkt/tree", "endpoint=http://h,unit=64K").contains("at least 1M"));
        assert!(error("s3://bkt/tree", "endpoint=http://h,log=off").contains("intent log on"));
        assert!(error("s3://BKT", "endpoint=http://h").contains("not a bucket name"));
        assert!(error("/srv/data", "endpoint=http://h").contains("only for an s3://"));
    }

    #[test]
    fn sqlite_journal_is_for_a_writable_sqlite_source_only() {
        use crate::backend::sqlite::Journal;
        let mount = |source: &str, opts: &str| parse_mount_args(&args(&[source, "/mnt", "-o", opts]));
        assert_eq!(mount("sqlite:/x.db", "rw").unwrap().options.sqlite_journal, None, "unset: the file's own");
        assert_eq!(
            mount("sqlite:/x.db", "sqlite_journal=rollback").unwrap().options.sqlite_journal,
            Some(Journal::Rollback)
        );
        assert_eq!(mount("sqlite:/x.db", "sqlite_journal=wal").unwrap().options.sqlite_journal, Some(Journal::Wal));
        let error = |source: &str, opts: &str| mount(source, opts).unwrap_err().0;
        assert!(error("sqlite:/x.db", "sqlite_journal=delete").contains("expected wal or rollback"));
        assert!(error("/srv/data", "sqlite_journal=wal").contains("only for a sqlite:PATH source"));
        assert!(error("sqlite:/x.db", "ro,sqlite_journal=rollback").contains("read-only"));
    }
}
