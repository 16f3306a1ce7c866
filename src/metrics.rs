//! Counters for every layer, named with design.md's words: application bytes in, backend
//! bytes out, and what happened in between. `coalescefs stats` and the Prometheus endpoint
//! both render this one set.
//!
//! Owns: the counters and their text forms. Must not: decide anything.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Request sizes in powers of two from 512 B (bucket 0: up to 512 B) to 16 MiB and above.
pub const SIZE_BUCKETS: usize = 16;

pub fn size_bucket(bytes: u64) -> usize {
    let bits = 64 - bytes.saturating_sub(1).leading_zeros() as usize; // ceil(log2)
    bits.saturating_sub(9).min(SIZE_BUCKETS - 1)
}

pub fn bucket_upper_bytes(bucket: usize) -> u64 {
    512u64 << bucket
}

#[derive(Default)]
pub struct Histogram {
    counts: [AtomicU64; SIZE_BUCKETS],
    /// Bytes of every request recorded: Prometheus's `_sum`.
    sum: AtomicU64,
}

impl Histogram {
    pub fn record(&self, bytes: u64) {
        self.counts[size_bucket(bytes)].fetch_add(1, Relaxed);
        self.sum.fetch_add(bytes, Relaxed);
    }
    pub fn counts(&self) -> [u64; SIZE_BUCKETS] {
        std::array::from_fn(|i| self.counts[i].load(Relaxed))
    }
    pub fn sum(&self) -> u64 {
        self.sum.load(Relaxed)
    }
}

/// Bytes in binary units with one decimal: "0 B", "512 B", "1.5 KiB", "12.0 MiB".
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Whether a number only grows (a counter) or goes up and down (a gauge).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Counter,
    Gauge,
}

/// The kinds of FUSE request the adapter serves: what a workload costs in round trips.
#[derive(Clone, Copy, Debug)]
pub enum FuseOp {
    Lookup,
    Forget,
    Getattr,
    Setattr,
    Readlink,
    Mknod,
    Mkdir,
    Unlink,
    Rmdir,
    Symlink,
    Rename,
    Link,
    Open,
    Read,
    Write,
    Flush,
    Release,
    Fsync,
    Opendir,
    Readdir,
    Readdirplus,
    Releasedir,
    Fsyncdir,
    Statfs,
    Setxattr,
    Getxattr,
    Listxattr,
    Removexattr,
    Create,
    Fallocate,
    Lseek,
    CopyFileRange,
}

const FUSE_OP_COUNT: usize = 32;
const FUSE_OP_NAMES: [&str; FUSE_OP_COUNT] = [
    "lookup",
    "forget",
    "getattr",
    "setattr",
    "readlink",
    "mknod",
    "mkdir",
    "unlink",
    "rmdir",
    "symlink",
    "rename",
    "link",
    "open",
    "read",
    "write",
    "flush",
    "release",
    "fsync",
    "opendir",
    "readdir",
    "readdirplus",
    "releasedir",
    "fsyncdir",
    "statfs",
    "setxattr",
    "getxattr",
    "listxattr",
    "removexattr",
    "create",
    "fallocate",
    "lseek",
    "copy_file_range",
];

/// Requests served and the time spent serving them, per kind of request.
#[derive(Default)]
pub struct FuseRequests {
    count: [AtomicU64; FUSE_OP_COUNT],
    busy_us: [AtomicU64; FUSE_OP_COUNT],
}

/// Adds the time since the request was counted (at `FuseRequests::start`) when dropped.
pub struct RequestTimer<'a> {
    requests: &'a FuseRequests,
    op: FuseOp,
    started: std::time::Instant,
}

impl Drop for RequestTimer<'_> {
    fn drop(&mut self) {
        self.requests.busy_us[self.op as usize].fetch_add(self.started.elapsed().as_micros() as u64, Relaxed);
    }
}

impl FuseRequests {
    /// Counts the request now: the handler answers it before the timer drops, and whoever
    /// reads the count after the answer must find it there (a test that counted lookups saw
    /// one missing, and once no counter at all).
    pub fn start(&self, op: FuseOp) -> RequestTimer<'_> {
        self.count[op as usize].fetch_add(1, Relaxed);
        RequestTimer { requests: self, op, started: std::time::Instant::now() }
    }

    /// (name, requests, microseconds spent) for every kind served at least once.
    pub fn served(&self) -> Vec<(&'static str, u64, u64)> {
        (0..FUSE_OP_COUNT)
            .map(|i| (FUSE_OP_NAMES[i], self.count[i].load(Relaxed), self.busy_us[i].load(Relaxed)))
            .filter(|&(_, n, _)| n > 0)
            .collect()
    }
}

#[derive(Default)]
pub struct Metrics {
    pub application_write_bytes: AtomicU64,
    pub application_write_requests: AtomicU64,
    pub application_write_sizes: Histogram,
    pub application_read_bytes: AtomicU64,
    pub backend_write_bytes: AtomicU64,
    pub backend_write_requests: AtomicU64,
    pub backend_write_sizes: Histogram,
    /// Of the backend writes, those made with O_DIRECT.
    pub backend_direct_write_requests: AtomicU64,
    /// Pieces smaller than one logical block written through the page cache, a write's
    /// unaligned head and tail each counted: each may make the kernel read the rest of its
    /// block first (the read-modify-write the log will remove).
    pub backend_subblock_writes: AtomicU64,
    /// Bytes the engine read from the backend to complete a unit before writing it whole: only
    /// a store of whole units (partial_writes false) makes it read.
    pub backend_read_bytes_for_writes: AtomicU64,
    /// Bytes copy_file_range copied inside the store, never through FUSE (the SQLite store:
    /// what the rows it copied hold, holes not counted).
    pub backend_copied_bytes: AtomicU64,
    /// Changes to a SQLite database that found its write lock held by another program and
    /// waited for it (the backend's lock let go meanwhile).
    pub sqlite_lock_waits: AtomicU64,
    /// ... and those that failed with EIO, the lock still held after the wait.
    pub sqlite_lock_wait_failures: AtomicU64,
    /// The S3 store's packed segments put (each one PUT of many units' pieces).
    pub s3_segments_put: AtomicU64,
    /// Units the S3 store read and put whole because their pieces reached half of them.
    pub s3_units_folded: AtomicU64,
    /// The S3 store's checkpoint manifests put holding the whole namespace database.
    pub s3_manifests_whole: AtomicU64,
    /// ... and those holding only the pages changed since the manifest before.
    pub s3_manifests_pages: AtomicU64,
    /// Truncates of a rewritten file the store was not given: the buffer held every byte past
    /// them, written over the store's blocks in place (`Writeback::file_data`).
    pub backend_truncates_written_over: AtomicU64,
    pub units_flushed_full: AtomicU64,
    pub units_flushed_partial: AtomicU64,
    pub flush_errors: AtomicU64,
    pub flushes_near: AtomicU64,
    pub flush_latency_us_sum: AtomicU64,
    pub flush_latency_us_max: AtomicU64,
    pub buffer_bytes_used: AtomicU64,
    pub buffer_bytes_limit: AtomicU64,
    pub buffer_waits: AtomicU64,
    /// Written bytes a unit took page for page from the request instead of copying them.
    pub write_pages_exchanged_bytes: AtomicU64,
    /// Buffer memory held by units the backend refused (still buffered, retried with backoff).
    pub buffer_refused_bytes: AtomicU64,
    /// Written bytes the backend refused and the buffer discarded after their writer was told.
    pub buffer_discarded_bytes: AtomicU64,
    /// Written bytes that could not be written before the daemon exited.
    pub unmount_dropped_bytes: AtomicU64,
    pub unit_bytes: AtomicU64,
    /// fsyncs made durable by the intent log instead of the backend.
    pub log_fsyncs: AtomicU64,
    /// Directory fsyncs after which the log recorded that the backend holds the directory's
    /// name changes (`Record::NamesSynced`).
    pub log_dir_syncs_recorded: AtomicU64,
    /// Files created since the last checkpoint whose name and bytes went to the intent log at
    /// close or fsync, the backend not yet told (`engine::pending`); and of all the files made
    /// that way, those the backend has been given (at a checkpoint, or earlier when needed).
    pub pending_files_logged: AtomicU64,
    pub pending_files_made: AtomicU64,
    /// By `log_closes`: new files made on the backend when created rather than held (created in
    /// a burst of closes, or `never`), and closes that wrote to the backend what the log could
    /// have taken (a close in a burst, or `never`).
    pub pending_files_declined: AtomicU64,
    /// Held files made on the backend from a file it made ahead (`Namespace::prepare_files`),
    /// and of those, the ones whose unused blocks a checkpoint gave back (or this daemon's mount,
    /// for files a daemon before it named and no checkpoint trimmed).
    pub files_made_ahead_named: AtomicU64,
    pub files_made_ahead_trimmed: AtomicU64,
    /// Files made ahead, ready to be named now.
    pub files_made_ahead_ready: AtomicU64,
    pub closes_not_logged: AtomicU64,
    /// Closes that left the file open for writing in the closing process (dd's dup2 onto its
    /// standard output): not a durability point, the last descriptor's close is.
    pub closes_left_to_another_descriptor: AtomicU64,
    /// The intent log's size; 0 when the log is off.
    pub log_size_bytes: AtomicU64,
    /// The intent log's block: the device bytes of the smallest commit.
    pub log_block_bytes: AtomicU64,
    pub log_batches: AtomicU64,
    /// Of those, written through the page cache (closes in a burst; `sync` writes them).
    pub log_batches_page_cache: AtomicU64,
    /// Name changes of held files kept in the volatile tail for the next batch, instead of a
    /// batch of their own.
    pub log_tail_records: AtomicU64,
    /// Of those, found in the tail by a mount after a killed daemon, and replayed.
    pub log_tail_records_replayed: AtomicU64,
    /// Batches in the log's page cache written to its device before a backend change that
    /// must not become durable before them (`IntentLog::commit_written_to_device`).
    pub log_write_backs: AtomicU64,
    /// Device flushes of the log (a batch a caller waits on to be durable; not a close's).
    pub log_flushes: AtomicU64,
    pub log_records: AtomicU64,
    pub log_write_bytes: AtomicU64,
    pub log_checkpoints: AtomicU64,
    /// Records applied to the backend from the log at mount, after a crash.
    pub log_replayed_records: AtomicU64,
    /// Bytes of the log read at mount: the whole area after a crash, its superblocks and one
    /// batch place after a clean unmount.
    pub log_read_at_mount_bytes: AtomicU64,
    /// Batches not replayed at mount because the store's replay watermark says it holds them
    /// (a crash between a checkpoint's commit and the log's release; contract rule 7).
    pub log_batches_below_watermark: AtomicU64,
    /// Descriptors the backend keeps open for objects the kernel has cached, and its bound.
    pub node_fds_open: AtomicU64,
    pub node_fds_limit: AtomicU64,
    /// Objects opened again by file handle after their descriptor was closed to stay in bound.
    pub node_fds_reopened: AtomicU64,
    /// Opens for writing that took the descriptor that made the file (no reopen by path).
    pub backend_opens_of_made_files: AtomicU64,
    /// Objects opened for I/O through their /proc/self/fd path (a procfs walk each).
    pub backend_reopens: AtomicU64,
    pub fuse_requests: FuseRequests,
    /// The daemon's process id, for tools that signal it.
    pub daemon_pid: AtomicU64,
    /// Requests that arrived over FUSE over io_uring (the rest came from /dev/fuse), and its
    /// queues (0: the mount uses /dev/fuse only).
    pub fuse_ring_requests: AtomicU64,
    pub fuse_ring_queues: AtomicU64,
    /// How requests reach the daemon (`set_transport`).
    transport: std::sync::Mutex<String>,
    /// The options the mount runs with (`set_mount_options`).
    mount_options: std::sync::OnceLock<Vec<(String, String)>>,
}

impl Metrics {
    pub fn record_flush_latency(&self, us: u64) {
        self.flush_latency_us_sum.fetch_add(us, Relaxed);
        self.flush_latency_us_max.fetch_max(us, Relaxed);
    }

    /// Every byte the daemon wrote toward storage (units and ranges to the backend, the
    /// checkpoints' flushes among them, and the intent log's batches and superblocks) over the
    /// bytes applications wrote.
    fn amplification(&self) -> f64 {
        let app = self.application_write_bytes.load(Relaxed);
        if app == 0 {
            0.0
        } else {
            (self.backend_write_bytes.load(Relaxed) + self.log_write_bytes.load(Relaxed)) as f64 / app as f64
        }
    }

    /// (name, help, value) of every plain number; counters are the names ending in `_total`
    /// and the flush latency sum.
    fn scalars(&self) -> Vec<(&'static str, &'static str, u64)> {
        vec![
            ("application_write_bytes_total", "Bytes applications wrote", self.application_write_bytes.load(Relaxed)),
            ("application_write_requests_total", "FUSE write requests", self.application_write_requests.load(Relaxed)),
            ("application_read_bytes_total", "Bytes applications read", self.application_read_bytes.load(Relaxed)),
            ("backend_write_bytes_total", "Bytes written to the backend", self.backend_write_bytes.load(Relaxed)),
            (
                "backend_write_requests_total",
                "Write requests sent to the backend",
                self.backend_write_requests.load(Relaxed),
            ),
            (
                "backend_direct_write_requests_total",
                "Backend writes made with O_DIRECT",
                self.backend_direct_write_requests.load(Relaxed),
            ),
            (
                "backend_subblock_writes_total",
                "Pieces under one logical block written through the page cache",
                self.backend_subblock_writes.load(Relaxed),
            ),
            (
                "backend_read_bytes_for_writes_total",
                "Bytes read from the backend to complete writes",
                self.backend_read_bytes_for_writes.load(Relaxed),
            ),
            (
                "backend_copied_bytes_total",
                "Bytes copy_file_range copied inside the store, never through FUSE",
                self.backend_copied_bytes.load(Relaxed),
            ),
            (
                "sqlite_lock_waits_total",
                "Changes that waited for a write lock another program held on the database (SQLite)",
                self.sqlite_lock_waits.load(Relaxed),
            ),
            (
                "sqlite_lock_wait_failures_total",
                "Changes that failed with EIO, another program holding the database's write lock past the wait (SQLite)",
                self.sqlite_lock_wait_failures.load(Relaxed),
            ),
            ("s3_segments_put_total", "Packed segments of unit pieces put (S3)", self.s3_segments_put.load(Relaxed)),
            (
                "s3_units_folded_total",
                "Units read and put whole because their pieces reached half of them (S3)",
                self.s3_units_folded.load(Relaxed),
            ),
            (
                "s3_manifests_whole_total",
                "Checkpoint manifests put holding the whole namespace database (S3)",
                self.s3_manifests_whole.load(Relaxed),
            ),
            (
                "s3_manifests_pages_total",
                "Checkpoint manifests put holding only the pages changed since the one before (S3)",
                self.s3_manifests_pages.load(Relaxed),
            ),
            (
                "backend_truncates_written_over_total",
                "Truncates of rewritten files written over in place, the buffer holding every byte past them",
                self.backend_truncates_written_over.load(Relaxed),
            ),
            ("units_flushed_full_total", "Units flushed whole", self.units_flushed_full.load(Relaxed)),
            ("units_flushed_partial_total", "Units flushed as dirty ranges", self.units_flushed_partial.load(Relaxed)),
            ("flush_errors_total", "Unit flushes the backend refused", self.flush_errors.load(Relaxed)),
            (
                "flushes_near_total",
                "Single units a waiting request handed to the flusher on its own CPU",
                self.flushes_near.load(Relaxed),
            ),
            (
                "flush_latency_us_sum",
                "Microseconds spent flushing units, summed (over units_flushed: the mean)",
                self.flush_latency_us_sum.load(Relaxed),
            ),
            ("flush_latency_us_max", "Longest unit flush", self.flush_latency_us_max.load(Relaxed)),
            ("buffer_bytes_used", "Write buffer memory in use", self.buffer_bytes_used.load(Relaxed)),
            ("buffer_bytes_limit", "Write buffer memory bound", self.buffer_bytes_limit.load(Relaxed)),
            ("buffer_waits_total", "Writes that waited for buffer memory", self.buffer_waits.load(Relaxed)),
            (
                "write_pages_exchanged_bytes_total",
                "Written bytes a unit took page for page from the request (FUSE over io_uring) instead of copying",
                self.write_pages_exchanged_bytes.load(Relaxed),
            ),
            (
                "buffer_refused_bytes",
                "Buffer memory held by data the backend refused, retried with backoff",
                self.buffer_refused_bytes.load(Relaxed),
            ),
            (
                "buffer_discarded_bytes_total",
                "Refused bytes discarded after their writer was told, to make room",
                self.buffer_discarded_bytes.load(Relaxed),
            ),
            ("unit_bytes", "Unit size", self.unit_bytes.load(Relaxed)),
            ("daemon_pid", "The daemon's process id", self.daemon_pid.load(Relaxed)),
            (
                "fuse_ring_requests_total",
                "FUSE requests that arrived over io_uring",
                self.fuse_ring_requests.load(Relaxed),
            ),
            ("fuse_ring_queues", "FUSE over io_uring queues (0: /dev/fuse only)", self.fuse_ring_queues.load(Relaxed)),
            ("log_size_bytes", "Size of the intent log (0: the log is off)", self.log_size_bytes.load(Relaxed)),
            ("log_block_bytes", "The intent log's block, the smallest commit", self.log_block_bytes.load(Relaxed)),
            (
                "log_read_at_mount_bytes",
                "Bytes of the intent log read at mount (the whole log after a crash)",
                self.log_read_at_mount_bytes.load(Relaxed),
            ),
            ("log_fsyncs_total", "fsyncs made durable by the intent log", self.log_fsyncs.load(Relaxed)),
            (
                "log_dir_syncs_recorded_total",
                "Directory fsyncs the intent log recorded, so that replay leaves the names they made durable",
                self.log_dir_syncs_recorded.load(Relaxed),
            ),
            (
                "pending_files_logged_total",
                "New files made durable by the intent log alone at close or fsync",
                self.pending_files_logged.load(Relaxed),
            ),
            (
                "pending_files_made_total",
                "New files held in memory and the log, then made on the backend",
                self.pending_files_made.load(Relaxed),
            ),
            (
                "pending_files_declined_total",
                "New files made on the backend when created, not held (a burst of closes, or log_closes=never)",
                self.pending_files_declined.load(Relaxed),
            ),
            (
                "files_made_ahead_named_total",
                "New files made on the backend from a file it made ahead at a checkpoint",
                self.files_made_ahead_named.load(Relaxed),
            ),
            (
                "files_made_ahead_ready",
                "Files the backend made ahead, ready for new files made alone",
                self.files_made_ahead_ready.load(Relaxed),
            ),
            (
                "files_made_ahead_trimmed_total",
                "Files made ahead whose blocks past their end a checkpoint (or, after a crash, the mount) gave back",
                self.files_made_ahead_trimmed.load(Relaxed),
            ),
            (
                "closes_not_logged_total",
                "Closes that wrote to the backend what the log could have taken (a burst, or log_closes=never)",
                self.closes_not_logged.load(Relaxed),
            ),
            (
                "closes_left_to_another_descriptor_total",
                "Closes that left the file open for writing in the closing process (dd's dup2): the last one is the durability point",
                self.closes_left_to_another_descriptor.load(Relaxed),
            ),
            ("log_batches_total", "Batches (group commits) written to the intent log", self.log_batches.load(Relaxed)),
            (
                "log_batches_page_cache_total",
                "Of those, closes in a burst written through the page cache (sync writes them)",
                self.log_batches_page_cache.load(Relaxed),
            ),
            (
                "log_tail_records_total",
                "Name changes of new files kept in the volatile tail (tmpfs) for the next batch instead of a batch of their own",
                self.log_tail_records.load(Relaxed),
            ),
            (
                "log_tail_records_replayed_total",
                "Name changes a killed daemon kept in the volatile tail, replayed by this mount",
                self.log_tail_records_replayed.load(Relaxed),
            ),
            (
                "log_write_backs_total",
                "Write-backs of the intent log's page-cache batches before a backend change that must not overtake them",
                self.log_write_backs.load(Relaxed),
            ),
            (
                "log_flushes_total",
                "Device flushes of the intent log (batches waited on to be durable)",
                self.log_flushes.load(Relaxed),
            ),
            ("log_records_total", "Records written to the intent log", self.log_records.load(Relaxed)),
            ("log_write_bytes_total", "Bytes written to the intent log", self.log_write_bytes.load(Relaxed)),
            ("log_checkpoints_total", "Checkpoints that released intent log space", self.log_checkpoints.load(Relaxed)),
            (
                "log_replayed_records_total",
                "Intent log records replayed at mount",
                self.log_replayed_records.load(Relaxed),
            ),
            (
                "log_batches_below_watermark_total",
                "Intent log batches the store's replay watermark says it holds, not replayed at mount",
                self.log_batches_below_watermark.load(Relaxed),
            ),
            ("node_fds_open", "Descriptors held for objects the kernel has cached", self.node_fds_open.load(Relaxed)),
            ("node_fds_limit", "The bound on descriptors held for cached objects", self.node_fds_limit.load(Relaxed)),
            (
                "node_fds_reopened_total",
                "Cached objects opened again by file handle",
                self.node_fds_reopened.load(Relaxed),
            ),
            (
                "backend_opens_of_made_files_total",
                "Opens for writing that took the descriptor that made the file",
                self.backend_opens_of_made_files.load(Relaxed),
            ),
            (
                "backend_reopens_total",
                "Objects opened for I/O through their /proc/self/fd path",
                self.backend_reopens.load(Relaxed),
            ),
        ]
    }

    /// What `coalescefs stats` prints: a summary in human units, the options the mount runs
    /// with, then every number by its name (the names carry their units).
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "write amplification {:.3}: applications wrote {}; the daemon wrote {} to the backend and {} to the intent log",
            self.amplification(),
            human_bytes(self.application_write_bytes.load(Relaxed)),
            human_bytes(self.backend_write_bytes.load(Relaxed)),
            human_bytes(self.log_write_bytes.load(Relaxed)),
        );
        let _ = writeln!(out, "transport: {}", self.transport());
        if let Some(options) = self.mount_options.get() {
            let listed: Vec<String> = options.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(out, "options: {}", listed.join(" "));
        }
        for (name, _, value) in self.scalars() {
            let _ = writeln!(out, "{name:<40} {value}");
        }
        let flushed = self.units_flushed_full.load(Relaxed) + self.units_flushed_partial.load(Relaxed);
        if let Some(mean) = self.flush_latency_us_sum.load(Relaxed).checked_div(flushed) {
            let _ = writeln!(out, "{:<40} {mean}", "flush_latency_us_mean");
        }
        let _ = writeln!(out, "{:<40} {:.3}", "write_amplification", self.amplification());
        for (op, count, busy_us) in self.fuse_requests.served() {
            let _ = writeln!(out, "{:<40} {count}", format!("fuse_{op}_total"));
            let _ = writeln!(out, "{:<40} {busy_us}", format!("fuse_{op}_busy_us_total"));
        }
        for (label, hist) in [("application", &self.application_write_sizes), ("backend", &self.backend_write_sizes)] {
            let _ = writeln!(out, "{label} write sizes:");
            for (i, count) in hist.counts().iter().enumerate().filter(|(_, &c)| c > 0) {
                let _ = writeln!(out, "  <= {:>9} B  {count}", bucket_upper_bytes(i));
            }
        }
        out
    }

    /// How requests reach the daemon: "uring" (FUSE over io_uring), "dev" (/dev/fuse), and why
    /// when it is not what was asked for.
    pub fn set_transport(&self, transport: &str) {
        *self.transport.lock().unwrap_or_else(|e| e.into_inner()) = transport.to_string();
    }

    pub fn transport(&self) -> String {
        let transport = self.transport.lock().unwrap_or_else(|e| e.into_inner());
        if transport.is_empty() {
            "dev".to_string()
        } else {
            transport.clone()
        }
    }

    /// The mount's options as it runs with them (the unit it found, the log's path), for the
    /// `mount_info` metric. Set once, at mount.
    pub fn set_mount_options(&self, options: Vec<(String, String)>) {
        let _ = self.mount_options.set(options);
    }

    fn kind_of(name: &str) -> Kind {
        if name.ends_with("_total") || name == "flush_latency_us_sum" {
            Kind::Counter
        } else {
            Kind::Gauge
        }
    }

    /// The OpenMetrics text format (which Prometheus scrapes), encoded by `prometheus-client`:
    /// counters end in `_total`, histograms have `_bucket`, `_sum` and `_count`, and the
    /// options the mount runs with are `coalescefs_mount_info`'s labels.
    pub fn render_prometheus(self: &std::sync::Arc<Self>) -> String {
        let mut registry = prometheus_client::registry::Registry::with_prefix("coalescefs");
        registry.register_collector(Box::new(Exposition(self.clone())));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String cannot fail");
        out
    }
}

/// The counters as a `prometheus-client` collector: read at each scrape, so the atomics the
/// daemon increments stay the only copy.
struct Exposition(std::sync::Arc<Metrics>);

impl std::fmt::Debug for Exposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exposition")
    }
}

impl prometheus_client::collector::Collector for Exposition {
    fn encode(&self, mut encoder: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::encoding::{EncodeMetric, NoLabelSet};
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let m = &self.0;
        for (name, help, value) in m.scalars() {
            match Metrics::kind_of(name) {
                Kind::Counter => {
                    // The encoder adds the `_total` a counter's samples end with.
                    let base = name.strip_suffix("_total").or_else(|| name.strip_suffix("_sum")).unwrap_or(name);
                    let counter = ConstCounter::new(value);
                    counter.encode(encoder.encode_descriptor(base, help, None, counter.metric_type())?)?;
                }
                Kind::Gauge => {
                    let gauge = ConstGauge::new(value as i64);
                    gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
                }
            }
        }
        let amplification = ConstGauge::new(m.amplification());
        amplification.encode(encoder.encode_descriptor(
            "write_amplification",
            "Every byte the daemon wrote toward storage (backend units and ranges, checkpoint flushes, intent log batches and superblocks) over the bytes applications wrote",
            None,
            amplification.metric_type(),
        )?)?;
        let served = m.fuse_requests.served();
        let mut requests =
            encoder.encode_descriptor("fuse_requests", "FUSE requests served, by kind", None, MetricType::Counter)?;
        for (op, count, _) in &served {
            ConstCounter::new(*count).encode(requests.encode_family(&[("op", *op)])?)?;
        }
        let mut busy = encoder.encode_descriptor(
            "fuse_busy_us",
            "Microseconds spent serving FUSE requests, by kind",
            None,
            MetricType::Counter,
        )?;
        for (op, _, busy_us) in &served {
            ConstCounter::new(*busy_us).encode(busy.encode_family(&[("op", *op)])?)?;
        }
        for (name, help, hist) in [
            (
                "application_write_size_bytes",
                "Sizes of the write requests applications made",
                &m.application_write_sizes,
            ),
            ("backend_write_size_bytes", "Sizes of the write requests sent to the backend", &m.backend_write_sizes),
        ] {
            let counts = hist.counts();
            let buckets: Vec<(f64, u64)> = (0..SIZE_BUCKETS)
                // The encoder writes the last bucket as "+Inf" when its bound is f64::MAX.
                .map(|i| (if i == SIZE_BUCKETS - 1 { f64::MAX } else { bucket_upper_bytes(i) as f64 }, counts[i]))
                .collect();
            let total = counts.iter().sum();
            encoder.encode_descriptor(name, help, None, MetricType::Histogram)?.encode_histogram::<NoLabelSet>(
                hist.sum() as f64,
                total,
                &buckets,
                None,
            )?;
        }
        if let Some(options) = m.mount_options.get() {
            encoder
                .encode_descriptor("mount", "The options the mount runs with, as labels", None, MetricType::Info)?
                .encode_info(options)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler answers before its timer drops: the request must be counted by then.
    #[test]
    fn a_request_is_counted_before_it_is_answered() {
        let requests = FuseRequests::default();
        let timer = requests.start(FuseOp::Lookup);
        assert_eq!(requests.served(), vec![("lookup", 1, 0)]);
        std::thread::sleep(std::time::Duration::from_millis(2));
        drop(timer);
        let served = requests.served();
        assert_eq!((served[0].0, served[0].1), ("lookup", 1), "counted once");
        assert!(served[0].2 >= 2000, "its time is added when it ends: {served:?}");
    }

    #[test]
    fn buckets_are_powers_of_two_from_512() {
        assert_eq!(size_bucket(1), 0);
        assert_eq!(size_bucket(512), 0);
        assert_eq!(size_bucket(513), 1);
        assert_eq!(size_bucket(4096), 3);
        assert_eq!(size_bucket(1 << 20), 11);
        assert_eq!(size_bucket(1 << 30), SIZE_BUCKETS - 1);
    }

    #[test]
    fn human_bytes_in_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(12 << 20), "12.0 MiB");
    }

    #[test]
    fn prometheus_text_has_help_type_sum_and_cumulative_buckets() {
        let m = std::sync::Arc::new(Metrics::default());
        m.set_mount_options(vec![("unit_bytes".into(), "65536".into()), ("log".into(), "off".into())]);
        m.application_write_bytes.fetch_add(8192, Relaxed);
        m.backend_write_bytes.fetch_add(8192, Relaxed);
        m.application_write_sizes.record(4096);
        m.application_write_sizes.record(4096);
        let text = m.render_prometheus();
        assert!(
            text.contains(
                "# TYPE coalescefs_application_write_bytes counter\ncoalescefs_application_write_bytes_total 8192"
            ),
            "{text}"
        );
        assert!(text.contains("coalescefs_application_write_size_bytes_bucket{le=\"4096.0\"} 2"), "{text}");
        assert!(text.contains("coalescefs_application_write_size_bytes_bucket{le=\"+Inf\"} 2"), "{text}");
        assert!(text.contains("coalescefs_application_write_size_bytes_sum 8192.0"), "{text}");
        assert!(text.contains("coalescefs_application_write_size_bytes_count 2"), "{text}");
        assert!(text.contains("coalescefs_write_amplification 1.0"), "{text}");
        assert!(text.contains("coalescefs_flush_latency_us_total 0"), "{text}");
        assert!(text.contains("coalescefs_mount_info{unit_bytes=\"65536\",log=\"off\"} 1"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
