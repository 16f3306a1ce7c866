//! The daemon: everything `coalescefs mount` does after parsing. Check the directories, take
//! the backing directory's lock, detach from the terminal (reporting to the parent once the
//! mount answers or fails), wire the engine to a FUSE session, serve until unmounted, and tear
//! down within a bounded time, saying what could not be written.
//!
//! Termination: SIGINT, SIGTERM and SIGHUP unmount (lazily when files are open); if the session
//! has not ended `ABORT_AFTER` later (a process keeps the mount busy, or a request waits on a
//! backend that answers nothing), the FUSE connection is aborted, so the daemon always exits.

mod opening;
mod process;
mod unmounted;

pub use opening::open_backend;
use opening::*;
use process::*;
pub use unmounted::{forget_s3, open_s3_unmounted, UnmountedS3};

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::faults::Faults;
use crate::backend::source::MountSource;
use crate::backend::{Capabilities, Namespace, UnitStore};
use crate::engine::intent_log::raw::RawLog;
use crate::options::{BackendKind, DaemonSession, LogPlace, MountOptions, MountRequest};
use crate::runtime::RuntimeDir;
use crate::state::{self, StateDir};
use crate::transport;
use crate::{backend, control, engine, fuse, logging, metrics, mounts, sys};

/// The exit status of a command that met a condition (usage errors exit 2).
pub const EXIT_FAILURE: u8 = 1;

/// Says what went wrong on stderr; exit status 1.
pub fn fail(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("coalescefs: {message}");
    ExitCode::from(EXIT_FAILURE)
}

/// After a termination signal's unmount, the longest the daemon waits for the session to end
/// before it aborts the FUSE connection.
const ABORT_AFTER: Duration = Duration::from_secs(10);

/// What a successful `prepare` holds for the daemon: the backing directory opened, and it and
/// the state directory locked (as long as the daemon runs: a second mount is refused).
struct Prepared {
    backing: PathBuf,
    mount_point: PathBuf,
    runtime: RuntimeDir,
    metrics: Arc<metrics::Metrics>,
    backend: Opened,
    /// The mount source as the kernel's mount table shows it.
    source: String,
    state: StateDir,
    metrics_listener: Option<std::net::TcpListener>,
    /// What this start made, for a start that fails to undo.
    made: MadeAtStart,
}

/// What a start made that a failed start takes away again, so that it leaves the backing and
/// state directories as it found them (a crash marker left behind made the next mount refuse
/// to start as "not unmounted cleanly").
#[derive(Default)]
struct MadeAtStart {
    /// The state directory did not exist before.
    state_dir: Option<PathBuf>,
    /// The backing root named no log before this start set it.
    marker: bool,
    /// The log's file did not exist before.
    log_file: Option<PathBuf>,
}

impl MadeAtStart {
    /// `undo` for a start that failed once its engine ran (it may have replayed a crash's log):
    /// the engine is shut down first, and what it could not make durable keeps the log, its
    /// marker and the state directory for the next mount.
    fn undo_after(&self, engine: &engine::Engine, marker: &Marker, runtime: &RuntimeDir) {
        let done = engine.shut_down();
        if done.unwritten.is_empty() && !engine.log_holds_records() {
            self.undo(marker, runtime);
        } else {
            runtime.remove_runtime_files();
        }
    }

    fn undo(&self, marker: &Marker, runtime: &RuntimeDir) {
        runtime.remove_runtime_files();
        if self.marker {
            if let Err(e) = marker.clear() {
                log::warn!("undoing a failed start: {e}");
            }
        }
        if let Some(log) = &self.log_file {
            for file in [engine::intent_log::device::replay_map_path(log), log.clone()] {
                let _ = std::fs::remove_file(file);
            }
        }
        if let Some(state_dir) = &self.state_dir {
            if let Err(e) = state::remove_state_files(state_dir).and_then(|()| {
                std::fs::remove_dir(state_dir).map_err(|e| format!("removing {}: {e}", state_dir.display()))
            }) {
                log::warn!("undoing a failed start: {e}");
            }
        }
    }
}

pub fn run_mount(request: MountRequest) -> ExitCode {
    let opts = &request.options;
    if opts.remount {
        return match mounts::remount(&mounts::absolute(&request.mount_point), opts) {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => fail(message),
        };
    }
    let prepared = match prepare(&request) {
        Ok(prepared) => prepared,
        Err(message) => return fail(message),
    };
    let mut ready = ReadyReport(None);
    if !request.foreground {
        let (read_end, write_end) = pipe();
        // No thread exists yet, so fork is safe.
        // SAFETY: no thread exists yet (the caller runs before any is started), so the child's
        // single thread inherits no lock held by another thread; the child only calls setpgid
        // or setsid, detaches stdio and goes on as the daemon.
        match unsafe { libc::fork() } {
            -1 => return fail(format!("fork failed: {}", sys::Errno::last())),
            0 => {
                drop(read_end);
                // A process group of its own either way: the terminal's job control never
                // reaches the daemon (`options::DaemonSession` says what the session changes).
                match opts.session {
                    // SAFETY: `setpgid` takes two integers and touches none of our memory.
                    DaemonSession::Mounter => unsafe { libc::setpgid(0, 0) },
                    // SAFETY: `setsid` takes no arguments and touches none of our memory.
                    DaemonSession::Own => unsafe { libc::setsid() },
                };
                detach_stdio(&prepared.runtime.log_path());
                ready = ReadyReport(Some(std::fs::File::from(write_end)));
            }
            child => {
                drop(write_end);
                return wait_for_daemon(read_end, child, &prepared.runtime.log_path());
            }
        }
    }
    serve(prepared, opts, ready)
}

/// Everything that can fail before the daemon detaches, with a message for the user.
fn prepare(request: &MountRequest) -> Result<Prepared, String> {
    let opts = &request.options;
    let source = MountSource::parse(&request.backing_dir)?;
    let backing = match &source {
        // Checked by `options::mount_request`; the bucket itself when the daemon opens it.
        MountSource::S3(_) => source.path().to_path_buf(),
        MountSource::Local(dir) => mounts::check_backing_dir(dir, opts.read_only)?,
        MountSource::Sqlite(path) => {
            if opts.backend != BackendKind::Local {
                return Err("backend=null: a SQLite source keeps its data in the database".into());
            }
            backend::source::check_database_path(path)?
        }
    };
    let mount_point = mounts::check_mount_point(&request.mount_point, &backing)?;
    let metrics_listener = match opts.metrics_address {
        Some(address) => {
            Some(control::bind_prometheus(address).map_err(|e| format!("metrics={address}: cannot listen: {e}"))?)
        }
        None => None,
    };
    let runtime = RuntimeDir::of(&backing);
    runtime.create().map_err(|e| format!("cannot create the runtime directory {}: {e}", runtime.path().display()))?;
    let metrics = Arc::new(metrics::Metrics::default());
    let (backend, source) = match source {
        MountSource::Local(_) => (Opened::Local(open_backend(&backing, opts.unit_bytes, &metrics)?), None),
        MountSource::Sqlite(_) => {
            let db = open_database(&backing, opts, &metrics)?;
            (Opened::Sqlite(Arc::new(db)), Some(format!("{}{}", backend::source::SQLITE_PREFIX, backing.display())))
        }
        MountSource::S3(s3) => (Opened::S3ToOpen(s3), None),
    };
    let source = source.unwrap_or_else(|| backing.display().to_string());
    let s3 = matches!(backend, Opened::S3ToOpen(_));
    let mut state = if s3 {
        StateDir::find_for_remote(&backing, runtime.path(), opts.state_dir.as_deref())?
    } else {
        StateDir::find(&backing, opts.state_dir.as_deref())?
    };
    // A crash's log that this mount would not replay stops it here, before it serves a byte
    // (an S3 mount's, once `serve` has found its namespace database).
    let marker = (!s3).then(|| backend.marker(&backing));
    if let Some(marker) = &marker {
        marker.check(log_path(opts, &state).as_deref())?;
    }
    let state_existed = state.path().exists();
    // An S3 mount keeps its namespace database there, whatever the log.
    state.make(opts.read_only, opts.log != LogPlace::Off || s3)?;
    let made = MadeAtStart {
        state_dir: (!state_existed && state.path().is_dir()).then(|| state.path().to_path_buf()),
        ..MadeAtStart::default()
    };
    // Files made ahead are made only for the log's held files.
    if let (Opened::Local(backend), Some(marker), true) =
        (&backend, &marker, opts.log != LogPlace::Off && !opts.read_only)
    {
        let list = state.made_ahead_list_path();
        if let Err(e) = backend.keep_made_ahead_list(&list) {
            made.undo(marker, &runtime);
            return Err(format!("cannot keep the list of files made ahead at {}: {e}", list.display()));
        }
    }
    drop(marker);
    let backend = match backend {
        Opened::Sqlite(db) => Opened::SqliteToOpen(db.path().to_path_buf()),
        other => other,
    };
    // The last daemon's report was read by its `coalescefs umount`, or is out of date now.
    let _ = std::fs::remove_file(runtime.unmount_report_path());
    Ok(Prepared { backing, mount_point, runtime, metrics, backend, source, state, metrics_listener, made })
}

/// The SQLite database of a `sqlite:` source: read-only with `-o ro` (nothing written to it).
fn open_database(
    path: &Path,
    opts: &MountOptions,
    metrics: &Arc<metrics::Metrics>,
) -> Result<backend::sqlite::SqliteBackend, String> {
    if opts.read_only {
        backend::sqlite::SqliteBackend::open_read_only(path, opts.unit_bytes, metrics.clone())
    } else {
        backend::sqlite::SqliteBackend::open_in_journal_mode(
            path,
            opts.unit_bytes,
            metrics.clone(),
            opts.sqlite_journal,
        )
    }
}

/// The intent log's file, when the log is on.
fn log_path(opts: &MountOptions, state: &StateDir) -> Option<PathBuf> {
    match &opts.log {
        LogPlace::Off => None,
        LogPlace::StateDir => Some(state.log_path()),
        LogPlace::At(path) => Some(path.clone()),
        LogPlace::Default => unreachable!("mount_request resolves the default log place"),
    }
}

/// `-o flushers=` when given, else what the store prefers, else the machine's default.
fn flusher_count(opts: &MountOptions, capabilities: &Capabilities) -> usize {
    match capabilities.preferred_flushers {
        Some(preferred) if !opts.flushers_given => preferred,
        _ => opts.flushers,
    }
}

fn engine_config(opts: &MountOptions, capabilities: &Capabilities, state: &StateDir) -> engine::EngineConfig {
    engine::EngineConfig {
        // st_blksize = unit: stdio-buffered writers (Perl print, fwrite, cp) then write whole units.
        block_size_bytes: capabilities.unit_bytes as u32,
        writeback: engine::writeback::WritebackConfig {
            unit_bytes: capabilities.unit_bytes,
            logical_block_bytes: capabilities.logical_block_bytes,
            buffer_bytes: opts.buffer_bytes,
            flushers: flusher_count(opts, capabilities),
            flush_age: opts.flush_age,
            log_threshold_bytes: opts.log_threshold_bytes,
            log_threshold_new_bytes: opts.log_threshold_new_bytes,
            log_closes: opts.log_closes,
            burst_gap: opts.burst_gap,
            checkpoint_interval: opts.checkpoint_interval,
            checkpoint_idle: opts.checkpoint_idle,
            io_timeout: opts.io_timeout,
        },
        page_cache: opts.writeback_cache,
        hidden_name: state.hidden_name().map(std::ffi::OsString::from),
        hidden_root_xattr: Some(std::ffi::OsString::from(state::LOG_MARKER_XATTR)),
        fsync_checkpoints: opts.fsync_backend,
    }
}

/// The namespace and unit store the engine gets: the local directory's, its names with the
/// null store's data, and either wrapped for fault injection when the daemon runs with it.
fn backends(
    opened: Opened,
    opts: &MountOptions,
    metrics: &Arc<metrics::Metrics>,
    faults: Option<&Arc<Faults>>,
) -> (Arc<dyn Namespace>, Arc<dyn UnitStore>) {
    let local = match opened {
        Opened::Local(local) => local,
        Opened::Sqlite(db) => return wrap_for_faults(db.clone(), db, faults),
        Opened::S3 { names, store } => return wrap_for_faults(names, store, faults),
        Opened::SqliteToOpen(_) | Opened::S3ToOpen(_) => unreachable!("serve opens the database first"),
    };
    let (ns, store): (Arc<dyn Namespace>, Arc<dyn UnitStore>) = match opts.backend {
        BackendKind::Local => {
            let local = Arc::new(local);
            (local.clone(), local)
        }
        BackendKind::Null => {
            let local = Arc::new(local.without_prepared_files());
            (local.clone(), Arc::new(backend::null::NullStore::new(local, metrics.clone())))
        }
    };
    wrap_for_faults(ns, store, faults)
}

fn wrap_for_faults(
    ns: Arc<dyn Namespace>,
    store: Arc<dyn UnitStore>,
    faults: Option<&Arc<Faults>>,
) -> (Arc<dyn Namespace>, Arc<dyn UnitStore>) {
    match faults {
        Some(faults) => {
            let wrapped = Arc::new(backend::faults::FaultyBackend::new(ns, store, faults.clone()));
            (wrapped.clone(), wrapped)
        }
        None => (ns, store),
    }
}

/// The intent log's device, when the log is on: its file opened (or made), and wrapped for
/// fault injection when the daemon runs with it. From here on the backing directory names the
/// log (see `state.rs`), until a clean unmount leaves the log empty.
fn log_setup(
    opts: &MountOptions,
    backing: &Path,
    marker: &Marker,
    state: &StateDir,
    faults: Option<&Arc<Faults>>,
) -> Result<Option<engine::LogSetup>, String> {
    let Some(path) = log_path(opts, state) else { return Ok(None) };
    if !opts.read_only {
        marker.set(&path)?;
    }
    let (device, created) =
        engine::intent_log::open_file_device(&path, Some(opts.log_size_bytes), state.path(), opts.log_raw)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    // The backing file system's journal flushes the device it is on before any change of it
    // becomes durable: a log file on that same file system is flushed along.
    let same_device = |a: &Path, b: &Path| match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => std::os::unix::fs::MetadataExt::dev(&a) == std::os::unix::fs::MetadataExt::dev(&b),
        _ => false,
    };
    let flushed_by_backend = same_device(&path, backing);
    let device: Box<dyn engine::intent_log::device::LogDevice> = match faults {
        Some(faults) => Box::new(backend::faults::FaultyLogDevice::new(Box::new(device), faults.clone())),
        None => Box::new(device),
    };
    let volatile_tail = if opts.read_only { None } else { volatile_tail_of(backing) };
    Ok(Some(engine::LogSetup { device, created, flushed_by_backend, volatile_tail }))
}

/// The intent log's volatile tail for the mount of `backing` (`runtime::volatile_tail_path`),
/// for the mount and for `coalescefs recover`; None, said in the log, where there is no tmpfs
/// for it or it cannot be opened.
pub fn volatile_tail_of(backing: &Path) -> Option<engine::intent_log::volatile_tail::VolatileTail> {
    let Some(path) = crate::runtime::volatile_tail_path(&RuntimeDir::of(backing), backing) else {
        log::info!("no tmpfs for the intent log's volatile tail: each rename of a new file is a log batch");
        return None;
    };
    match engine::intent_log::volatile_tail::VolatileTail::open(&path) {
        Ok(tail) => Some(tail),
        Err(e) => {
            log::warn!("{}: {e}; each rename of a new file is a log batch", path.display());
            None
        }
    }
}

/// The options as the mount runs with them, defaults and discoveries resolved (the unit the
/// device gave, the log's file): what `coalescefs_mount_info` shows.
fn options_in_effect(
    opts: &MountOptions,
    capabilities: &Capabilities,
    backing: &Path,
    mount_point: &Path,
    state: &StateDir,
    max_write: u64,
    store_name: Option<&str>,
) -> Vec<(String, String)> {
    let page_cache = match opts.writeback_cache {
        engine::PageCache::Auto => "auto",
        engine::PageCache::On => "on",
        engine::PageCache::Off => "off",
    };
    let log_closes = match opts.log_closes {
        engine::LogCloses::Auto => "auto",
        engine::LogCloses::Always => "always",
        engine::LogCloses::Never => "never",
    };
    let backend = match opts.backend {
        _ if store_name.is_some() => store_name.unwrap_or_default(),
        BackendKind::Local => "local",
        BackendKind::Null => "null",
    };
    let log = log_path(opts, state).map(|p| p.display().to_string()).unwrap_or_else(|| "off".into());
    let metrics = opts.metrics_address.map(|a| a.to_string()).unwrap_or_else(|| "off".into());
    [
        ("backing", backing.display().to_string()),
        ("mountpoint", mount_point.display().to_string()),
        ("backend", backend.to_string()),
        ("unit_bytes", capabilities.unit_bytes.to_string()),
        ("logical_block_bytes", capabilities.logical_block_bytes.to_string()),
        ("buffer_bytes", opts.buffer_bytes.to_string()),
        ("flushers", flusher_count(opts, capabilities).to_string()),
        ("flush_age_ms", opts.flush_age.as_millis().to_string()),
        ("writeback_cache", page_cache.to_string()),
        ("max_write_bytes", max_write.to_string()),
        ("log", log),
        ("log_size_bytes", if opts.log == LogPlace::Off { "0".into() } else { opts.log_size_bytes.to_string() }),
        ("checkpoint_interval_ms", opts.checkpoint_interval.as_millis().to_string()),
        ("checkpoint_idle_ms", opts.checkpoint_idle.as_millis().to_string()),
        ("log_threshold_bytes", opts.log_threshold_bytes.to_string()),
        ("log_threshold_new_bytes", opts.log_threshold_new_bytes.to_string()),
        ("log_closes", if opts.log == LogPlace::Off { "never".into() } else { log_closes.to_string() }),
        ("burst_gap_us", opts.burst_gap.as_micros().to_string()),
        ("log_raw", if opts.log_raw == RawLog::Auto && opts.log != LogPlace::Off { "auto" } else { "off" }.into()),
        ("xattr", if opts.xattrs { "on" } else { "off" }.into()),
        ("fsync", if opts.fsync_backend { "backend" } else { "log" }.into()),
        ("transport", opts.transport.name().into()),
        ("session", opts.session.name().into()),
        ("cache_timeout_ms", opts.cache_timeout.as_millis().to_string()),
        ("io_timeout_ms", opts.io_timeout.as_millis().to_string()),
        ("read_only", opts.read_only.to_string()),
        ("metrics", metrics),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The daemon proper (also in the foreground): runs until unmounted, then tears down.
fn serve(prepared: Prepared, opts: &MountOptions, mut ready: ReadyReport) -> ExitCode {
    let Prepared { backing, mount_point, runtime, metrics, backend, source, state, metrics_listener, mut made } =
        prepared;
    // Dropped last (declared first): a lease this daemon took goes at its end unless the
    // intent log must be replayed by this state directory.
    let mut lease = HeldLease::default();
    let s3 = matches!(backend, Opened::S3ToOpen(_));
    let backend = match open_store(backend, opts, &state, runtime.path(), &metrics, &mut lease) {
        Ok(backend) => backend,
        Err(e) => {
            if s3 && made.state_dir.is_some() {
                backend::s3::remove_state_files(state.path());
            }
            made.undo(&Marker::Xattr(backing.clone()), &runtime);
            return ready.error(&e);
        }
    };
    let marker = backend.marker(&backing);
    if matches!(backend, Opened::S3 { .. }) {
        if let Err(e) = marker.check(log_path(opts, &state).as_deref()) {
            made.undo(&marker, &runtime);
            return ready.error(&e);
        }
    }
    // `coalescefs snapshot` copies a database that is the whole tree: SQLite's alone (an S3
    // mount's database holds its names, not its data).
    let snapshot_of = match &backend {
        Opened::Sqlite(db) => Some(db.clone()),
        _ => None,
    };
    let store_name = match backend {
        Opened::Sqlite(_) => Some("sqlite"),
        Opened::S3 { .. } => Some("s3"),
        _ => None,
    };
    block_termination_signals();
    // Modes arrive already masked by the kernel; the daemon's own umask must not mask twice.
    // SAFETY: `umask` takes one integer, cannot fail and touches none of our memory.
    unsafe { libc::umask(0) };

    let capabilities = backend.capabilities().clone();
    let (engine, faults) = match start_engine(
        backend,
        &capabilities,
        &StartAt { opts, backing: &backing, state: &state, marker: &marker, metrics: &metrics },
        &mut made,
    ) {
        Ok(started) => started,
        Err(message) => {
            made.undo(&marker, &runtime);
            return ready.error(&message);
        }
    };
    let max_write = opts.max_write_bytes.unwrap_or(capabilities.unit_bytes).min(fuse::MAX_WRITE_BYTES_LIMIT);
    metrics.set_mount_options(options_in_effect(
        opts,
        &capabilities,
        &backing,
        &mount_point,
        &state,
        max_write,
        store_name,
    ));
    let mount_id = Arc::new(std::sync::OnceLock::new());
    let negotiation = match transport::Negotiation::for_choice(opts.transport) {
        Ok(negotiation) => Arc::new(negotiation),
        Err(message) => {
            made.undo_after(&engine, &marker, &runtime);
            return ready.error(&message);
        }
    };
    let adapter = fuse::FuseAdapter::new(
        engine.clone(),
        metrics.clone(),
        max_write as u32,
        opts.cache_timeout,
        opts.xattrs,
        mount_id.clone(),
        negotiation.clone(),
    );
    let notifier = adapter.notifier_slot();
    let session = match start_session(adapter, &source, &mount_point, opts) {
        Ok(session) => session,
        Err(message) => {
            made.undo_after(&engine, &marker, &runtime);
            return ready.error(&message);
        }
    };
    let _ = notifier.set(session.notifier());
    // INIT is answered: the rings now, before anything waits on the mount.
    let rings = match transport::rings_after_init(&session, &negotiation, opts.transport, max_write as u32) {
        Ok(rings) => rings,
        Err(message) => {
            let _ = mounts::unmount(&mount_point, true);
            made.undo_after(&engine, &marker, &runtime);
            return ready.error(&message);
        }
    };
    report_transport(rings.as_ref(), &metrics, opts, max_write);
    metrics.daemon_pid.store(u64::from(std::process::id()), std::sync::atomic::Ordering::Relaxed);
    if let Err(e) = runtime.write_pid() {
        log::warn!(
            "cannot write {} ({e}): `coalescefs umount` will not wait for this daemon",
            runtime.pid_path().display()
        );
    }
    let snapshot = snapshot_request(engine.clone(), snapshot_of, store_name);
    serve_control(&engine, &runtime, &metrics, snapshot, faults, metrics_listener);
    log::info!("mounted {source} at {}", mount_point.display());
    // Signals are taken over before the parent returns: a SIGINT right after `coalescefs mount`
    // must unmount, not kill the daemon and leave a dead mount behind.
    let session_ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Mounted just now, ours is the topmost mount there.
    let ours = mounts::mount_at(&mount_point);
    if let Some(m) = ours.as_ref().filter(|m| m.fs_type == mounts::FS_TYPE) {
        let _ = mount_id.set(m.mount_id);
    }
    unmount_on_signal(mount_point.clone(), ours.map(|m| m.device_minor), session_ended.clone());
    ready.ok();
    let ring_metrics = metrics.clone();
    let result = session.run_with_transport(move |dispatcher| {
        if let Some(rings) = rings {
            rings.serve(dispatcher, ring_metrics);
        }
        Ok(())
    });
    session_ended.store(true, std::sync::atomic::Ordering::Relaxed);
    let exit = shut_down(&engine, opts, &state, &marker, &runtime);
    if store_name == Some("s3") && opts.read_only {
        drop(engine);
        backend::s3::remove_read_only_copy(runtime.path());
    }
    match result {
        Ok(()) => log::info!("unmounted {}", mount_point.display()),
        Err(e) => log::info!("the session on {} ended: {e}", mount_point.display()),
    }
    exit
}

/// What a start reads of where it happens: the options, the backing source, the state
/// directory, where the crash marker lives, and the counters.
struct StartAt<'a> {
    opts: &'a MountOptions,
    backing: &'a Path,
    state: &'a state::StateDir,
    marker: &'a Marker,
    metrics: &'a Arc<crate::metrics::Metrics>,
}

/// The engine over the opened store, its log replayed, with fault injection where the
/// environment asks for it. On an error, `made` says what the caller undoes (a replay that
/// failed part way leaves its log and marker for the next mount).
fn start_engine(
    backend: Opened,
    capabilities: &backend::Capabilities,
    at: &StartAt<'_>,
    made: &mut MadeAtStart,
) -> Result<(Arc<engine::Engine>, Option<Arc<Faults>>), String> {
    let StartAt { opts, backing, state, marker, metrics } = *at;
    log::info!(
        "unit {} bytes ({:?}), logical block {} bytes",
        capabilities.unit_bytes,
        capabilities.unit_source,
        capabilities.logical_block_bytes
    );
    // A discovered unit larger than half the buffer would leave writers nothing to work with.
    if opts.buffer_bytes < 2 * capabilities.unit_bytes {
        return Err(format!(
            "buffer={} must hold at least two units of {} bytes (give a larger buffer= or a smaller unit=)",
            opts.buffer_bytes, capabilities.unit_bytes
        ));
    }
    let faults = Faults::from_env().map_err(|e| format!("COALESCEFS_FAULTS: {e}"))?.map(Arc::new);
    if faults.is_some() {
        log::warn!("fault injection is on (COALESCEFS_FAULTS): for tests only");
    }
    let config = engine_config(opts, capabilities, state);
    if !opts.read_only {
        made.marker = matches!(marker.get(), Ok(None));
        made.log_file = log_path(opts, state).filter(|log| !log.exists());
    }
    let log = log_setup(opts, backing, marker, state, faults.as_ref())
        .map_err(|e| format!("cannot start on {}: {e}", backing.display()))?;
    if log.is_some() {
        metrics.log_size_bytes.store(opts.log_size_bytes, std::sync::atomic::Ordering::Relaxed);
    }
    let (ns, store) = backends(backend, opts, metrics, faults.as_ref());
    match engine::Engine::new(ns, store, config, metrics.clone(), log) {
        Ok(engine) => Ok((Arc::new(engine), faults)),
        Err(e) => {
            if !made.marker {
                made.log_file = None;
            }
            Err(format!("cannot start on {}: {e}", backing.display()))
        }
    }
}

/// Opens the database of a `sqlite:` or `s3://` store (a directory's was opened before the
/// daemon detached); an S3 store's lease goes into `lease`. A read-only S3 mount takes none:
/// its copy of the bucket's newest manifest goes in the runtime directory.
fn open_store(
    backend: Opened,
    opts: &MountOptions,
    state: &state::StateDir,
    runtime_dir: &Path,
    metrics: &Arc<crate::metrics::Metrics>,
    lease: &mut HeldLease,
) -> Result<Opened, String> {
    Ok(match backend {
        Opened::SqliteToOpen(path) => Opened::Sqlite(Arc::new(open_database(&path, opts, metrics)?)),
        Opened::S3ToOpen(s3) if opts.read_only => {
            let objects = opening::s3_client(&s3, opts)?;
            let layout = backend::s3::layout::Layout::new(&s3.prefix);
            let copy = runtime_dir.join(backend::s3::READ_ONLY_COPY_FILE);
            let (names, store, _) =
                backend::s3::open_read_only(objects, layout, &copy, &s3.path_shown(), metrics.clone())?;
            Opened::S3 { names, store }
        }
        Opened::S3ToOpen(s3) => {
            let mount = open_s3(&s3, opts, state, metrics)?;
            lease.hold(mount.lease, mount.names.clone());
            Opened::S3 { names: mount.names, store: mount.store }
        }
        other => other,
    })
}

/// Says which transport serves the mount, in the log and the metrics.
fn report_transport(
    rings: Option<&transport::uring::RingTransport>,
    metrics: &crate::metrics::Metrics,
    opts: &MountOptions,
    max_write: u64,
) {
    match rings {
        Some(rings) => {
            metrics.set_transport("uring");
            metrics.fuse_ring_queues.store(rings.queue_count() as u64, std::sync::atomic::Ordering::Relaxed);
            log::info!(
                "transport: FUSE over io_uring, {} queues of {} entries ({} byte payloads); FORGET and INTERRUPT over /dev/fuse",
                rings.queue_count(),
                rings.entries_per_queue(),
                transport::uring::payload_bytes(max_write as u32)
            );
        }
        None => {
            metrics.set_transport("dev");
            log::info!("transport: /dev/fuse, {} threads", opts.threads);
        }
    }
}

/// The control socket (`coalescefs stats`, `sync`, `snapshot`) and the Prometheus endpoint;
/// neither is needed to serve files, so a failure to start one is a warning.
fn serve_control(
    engine: &Arc<engine::Engine>,
    runtime: &crate::runtime::RuntimeDir,
    metrics: &Arc<crate::metrics::Metrics>,
    snapshot: control::Snapshot,
    faults: Option<Arc<Faults>>,
    metrics_listener: Option<std::net::TcpListener>,
) {
    let engine_for_sync = engine.clone();
    let sync_all: control::SyncAll = Box::new(move || engine_for_sync.sync_all().map_err(|e| e.to_string()));
    if let Err(e) = control::serve_control_socket(&runtime.socket_path(), metrics.clone(), sync_all, snapshot, faults) {
        log::warn!("no control socket ({e}): `coalescefs stats` and `sync` will not answer");
    }
    if let Some(listener) = metrics_listener {
        if let Err(e) = control::serve_prometheus(listener, metrics.clone()) {
            log::warn!("no thread for the metrics endpoint ({e}): it will not answer");
        }
    }
}

/// After the session: the engine shut down (the kernel's DESTROY usually did it already;
/// after an aborted connection it did not), the crash marker cleared where nothing is left to
/// replay, a database's WAL copied into it, the runtime files removed; the exit status says
/// what could not be written.
fn shut_down(
    engine: &engine::Engine,
    opts: &MountOptions,
    state: &state::StateDir,
    marker: &Marker,
    runtime: &crate::runtime::RuntimeDir,
) -> ExitCode {
    let done = engine.shut_down();
    let clear_marker =
        log_path(opts, state).is_some() && !opts.read_only && done.unwritten.is_empty() && !engine.log_holds_records();
    match (opts.read_only, marker) {
        // A read-only mount leaves the database's files as they are. A read-write one closes
        // the database with the marker's clearing in its last commit.
        (false, Marker::Database(db)) => {
            if let Err(e) = db.close_at_unmount(clear_marker) {
                log::warn!(
                    "the database {} was not closed cleanly at unmount (the next open finishes it{}): {e}",
                    db.path().display(),
                    if clear_marker { "; the next mount will ask for the same intent log" } else { "" }
                );
            }
        }
        _ if clear_marker => {
            if let Err(e) = marker.clear() {
                log::warn!("{e}: the next mount will ask for the same intent log");
            }
        }
        _ => {}
    }
    runtime.remove_runtime_files();
    report_shut_down(runtime, &done, engine.log_holds_records())
}

/// `coalescefs snapshot`: everything written so far synced (a checkpoint), then the database
/// copied as that commit left it; a store that is not one database file says so.
fn snapshot_request(
    engine: Arc<crate::engine::Engine>,
    database: Option<Arc<backend::sqlite::SqliteBackend>>,
    store_name: Option<&'static str>,
) -> control::Snapshot {
    Box::new(move |dest| {
        let Some(db) = &database else {
            return Err(format!(
                "snapshot copies a sqlite: store, this mount's is {}; `coalescefs sync` makes what was written \
                 durable for another tool to copy",
                store_name.unwrap_or("a backing directory")
            ));
        };
        engine.sync_all().map_err(|e| format!("the sync before the copy failed: {e}"))?;
        let bytes = db.snapshot_into(dest)?;
        log::info!("snapshot of {} in {} ({bytes} bytes)", db.path().display(), dest.display());
        Ok(format!("{bytes} bytes"))
    })
}

fn start_session(
    adapter: fuse::FuseAdapter,
    source: &str,
    mount_point: &Path,
    opts: &MountOptions,
) -> Result<fuser::Session<fuse::FuseAdapter>, String> {
    let source = opts.fsname.clone().unwrap_or_else(|| source.to_string());
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
    // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
    if unsafe { libc::geteuid() } == 0 {
        let fd = mounts::mount_direct(&source, mount_point, opts)?;
        return fuser::Session::from_fd(adapter, fd, acl, config).map_err(|e| {
            let _ = mounts::unmount(mount_point, true);
            format!("FUSE handshake failed: {e}")
        });
    }
    config.mount_options = vec![
        fuser::MountOption::FSName(source),
        fuser::MountOption::Subtype("coalescefs".into()),
        fuser::MountOption::DefaultPermissions,
        // Whatever helper mounts it: the documented default.
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
    ];
    if opts.read_only {
        config.mount_options.push(fuser::MountOption::RO);
    }
    for flag in &opts.kernel_flags {
        config.mount_options.push(fuser::MountOption::CUSTOM(flag.clone()));
    }
    fuser::Session::new(adapter, mount_point, &config)
        .map_err(|e| format!("mount of {} failed: {e}", mount_point.display()))
}

/// Says what could not be written (or synced), in the log and in the runtime directory's
/// report that `coalescefs umount` prints; exit status 1 when the unmount was not clean.
fn report_shut_down(runtime: &RuntimeDir, done: &engine::writeback::ShutDown, log_kept: bool) -> ExitCode {
    if done.is_clean() {
        return ExitCode::SUCCESS;
    }
    let unwritten = &done.unwritten;
    let mut report = String::new();
    if !unwritten.is_empty() {
        let lost: u64 = unwritten.iter().map(|u| u.bytes).sum();
        report +=
            &format!("{lost} written bytes in {} file(s) could not be written before unmount:\n", unwritten.len());
    }
    for u in unwritten {
        report += &format!("  {}: {} bytes lost ({})", u.name, u.bytes, u.error);
        if u.in_log > 0 {
            report += &format!(", {} fsynced bytes kept in the intent log for the next mount", u.in_log);
        }
        report.push('\n');
    }
    if let Some(e) = done.backend_unsynced {
        report += &format!(
            "the backend's sync at unmount failed ({e}): what was written is on the backing file system but may not survive a power cut{}\n",
            if log_kept {
                "; the intent log keeps its records (every fsync and close it took), and the next mount replays them"
            } else {
                ""
            }
        );
    }
    log::error!("{}", report.trim_end());
    if let Err(e) = std::fs::write(runtime.unmount_report_path(), &report) {
        log::error!("cannot write {}: {e}", runtime.unmount_report_path().display());
    }
    ExitCode::from(EXIT_FAILURE)
}
