//! The daemon's log: one timestamped line per event (env_logger's format and its RUST_LOG
//! filters, e.g. `RUST_LOG=coalescefs=debug`; `COALESCEFS_LOG=debug` is still read), written
//! to stderr until the daemon detaches and to its runtime directory's `daemon.log` after that
//! (see `runtime`: never on the backing file system, which may be the one that ran full).
//!
//! Repeats of warnings, errors and notices are rate-limited per call site (debug lines, asked
//! for to trace a run, never are): a backend that refuses every flush must not write
//! a line per retry. At most `LINES_PER_WINDOW` lines per site in each `WINDOW`; the rest are
//! counted and said in one line ("N more like this") when the site speaks again. The file is
//! kept under `MAX_LOG_BYTES` by moving it to `daemon.log.1` when it would grow past that.
//!
//! Warnings raised while mounting are also kept for the parent process, which prints them on
//! the user's terminal once the mount is ready.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const LINES_PER_WINDOW: u32 = 5;
const WINDOW: Duration = Duration::from_secs(10);
const MAX_LOG_BYTES: u64 = 16 << 20;

/// Where lines go: stderr, or a file that is moved aside when it grows too large.
enum Sink {
    Stderr,
    File { path: PathBuf, file: File, bytes: u64 },
}

impl Sink {
    fn write_line(&mut self, line: &[u8]) {
        match self {
            // A lost line must not take down the thread reporting it (eprintln! panics when
            // the write fails), so errors are dropped.
            Sink::Stderr => {
                let _ = std::io::stderr().write_all(line);
            }
            Sink::File { path, file, bytes } => {
                if *bytes + line.len() as u64 > MAX_LOG_BYTES {
                    let mut older = path.clone().into_os_string();
                    older.push(".1");
                    if std::fs::rename(&*path, older).is_ok() {
                        if let Ok(fresh) = open_log(path) {
                            *file = fresh;
                            *bytes = 0;
                        }
                    }
                }
                if file.write_all(line).is_ok() {
                    *bytes += line.len() as u64;
                }
            }
        }
    }
}

fn open_log(path: &PathBuf) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().append(true).create(true).mode(0o600).custom_flags(libc::O_CLOEXEC).open(path)
}

/// The writer env_logger formats into: the current sink, shared with `to_file`.
#[derive(Clone)]
struct SharedSink(Arc<Mutex<Sink>>);

impl Write for SharedSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).write_line(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

struct Site {
    window_start: Instant,
    lines: u32,
    suppressed: u64,
}

struct DaemonLogger {
    inner: env_logger::Logger,
    sink: SharedSink,
    sites: Mutex<HashMap<(&'static str, u32), Site>>,
}

static LOGGER: std::sync::OnceLock<&'static DaemonLogger> = std::sync::OnceLock::new();

/// Warnings raised while mounting, for the parent to print on the user's terminal: the
/// daemon's own stderr is its log file by then.
static WARNINGS_FOR_PARENT: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl DaemonLogger {
    /// Whether this record may be written now; a line about earlier repeats comes first when
    /// the site's window has passed.
    fn admit(&self, record: &log::Record<'_>) -> (bool, Option<u64>) {
        let key = (record.file_static().unwrap_or(""), record.line().unwrap_or(0));
        let mut sites = self.sites.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let site = sites.entry(key).or_insert(Site { window_start: now, lines: 0, suppressed: 0 });
        let mut repeats = None;
        if now.duration_since(site.window_start) >= WINDOW {
            if site.suppressed > 0 {
                repeats = Some(site.suppressed);
            }
            *site = Site { window_start: now, lines: 0, suppressed: 0 };
        }
        if site.lines < LINES_PER_WINDOW {
            site.lines += 1;
            (true, repeats)
        } else {
            site.suppressed += 1;
            (false, repeats)
        }
    }
}

impl log::Log for DaemonLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.inner.matches(record) {
            return;
        }
        // Debug lines are asked for, to trace one run: all of them are written.
        let (write, repeats) = if record.level() >= log::Level::Debug { (true, None) } else { self.admit(record) };
        if let Some(n) = repeats {
            self.inner.log(
                &log::Record::builder()
                    .args(format_args!("{n} more like this in the last {} s (not shown)", WINDOW.as_secs()))
                    .level(record.level())
                    .target(record.target())
                    .build(),
            );
        }
        if write {
            self.inner.log(record);
        }
        if record.level() <= log::Level::Warn && record.target().starts_with("coalescefs") {
            let mut held = WARNINGS_FOR_PARENT.lock().unwrap_or_else(|p| p.into_inner());
            if held.len() < 32 {
                held.push(format!("{}: {}", record.level(), record.args()));
            }
        }
    }

    fn flush(&self) {}
}

/// Sets up the log on stderr. Filters: RUST_LOG, else COALESCEFS_LOG (a level), else info for
/// coalescefs and warnings for the libraries.
pub fn init() {
    let sink = SharedSink(Arc::new(Mutex::new(Sink::Stderr)));
    let mut builder = env_logger::Builder::new();
    builder.filter_level(log::LevelFilter::Warn).filter_module("coalescefs", log::LevelFilter::Info);
    if let Ok(level) = std::env::var("COALESCEFS_LOG") {
        builder.parse_filters(&format!("coalescefs={level}"));
    }
    if let Ok(filters) = std::env::var("RUST_LOG") {
        builder.parse_filters(&filters);
    }
    builder.format(|buf, record| {
        writeln!(
            buf,
            "{} {:<5} coalescefs[{}] {}",
            buf.timestamp_millis(),
            record.level(),
            std::process::id(),
            record.args()
        )
    });
    builder.target(env_logger::Target::Pipe(Box::new(sink.clone())));
    let inner = builder.build();
    let max_level = inner.filter();
    let logger: &'static DaemonLogger =
        Box::leak(Box::new(DaemonLogger { inner, sink, sites: Mutex::new(HashMap::new()) }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(max_level);
        let _ = LOGGER.set(logger);
    }
}

/// From now on, lines go to `path` (the daemon, once detached from the terminal).
pub fn to_file(path: PathBuf) -> std::io::Result<()> {
    let file = open_log(&path)?;
    let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
    if let Some(logger) = LOGGER.get() {
        *logger.sink.0.lock().unwrap_or_else(|p| p.into_inner()) = Sink::File { path, file, bytes };
    }
    Ok(())
}

/// The warnings raised so far, taken.
pub fn take_warnings() -> Vec<String> {
    std::mem::take(&mut *WARNINGS_FOR_PARENT.lock().unwrap_or_else(|p| p.into_inner()))
}
