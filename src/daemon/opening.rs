//! Opening the store a mount names: the backing directory (and its crash marker), a SQLite
//! database, or an S3 prefix with its lease.

use super::*;

/// Raises the descriptor limit to the hard limit and returns how many descriptors the backend
/// may keep open for objects the kernel has cached: half of the limit, less a reserve, so that
/// the files applications open, the write buffer's backend files and the log keep the rest.
pub(super) fn node_fd_budget() -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` into `limit` and setrlimit reads one from `raised`,
    // both live locals; neither touches other memory.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) != 0 {
            return 256;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const raised) == 0 {
                limit = raised;
            }
        }
    }
    let soft = limit.rlim_cur.min(1 << 24) as usize;
    (soft.saturating_sub(512) / 2).max(64)
}

/// The local backend over the backing directory, with its descriptor budget.
pub fn open_backend(
    backing: &Path,
    unit_bytes: Option<u64>,
    metrics: &Arc<metrics::Metrics>,
) -> Result<backend::local::LocalBackend, String> {
    backend::local::LocalBackend::open(backing, node_fd_budget(), unit_bytes, metrics.clone())
        .map_err(|e| format!("cannot open backing directory {}: {e}", backing.display()))
}

/// The store a mount opened: the backend factory's second half (`backend::source` names it).
pub(super) enum Opened {
    Local(backend::local::LocalBackend),
    Sqlite(Arc<backend::sqlite::SqliteBackend>),
    /// A database `prepare` checked and closed again: a SQLite connection must not cross the
    /// fork (the parent's close would take the WAL from under the daemon). `serve` opens it.
    SqliteToOpen(PathBuf),
    /// An S3 source `prepare` checked: `serve` opens it, for the same reason and because the
    /// lease is taken by the daemon that holds it.
    S3ToOpen(backend::source::S3Source),
    /// The S3 backend: its namespace database and the unit store over it.
    S3 {
        names: Arc<backend::sqlite::SqliteBackend>,
        store: Arc<backend::s3::store::S3Store>,
    },
}

impl Opened {
    pub(super) fn capabilities(&self) -> &Capabilities {
        match self {
            Opened::Local(local) => local.capabilities(),
            Opened::Sqlite(db) => db.capabilities(),
            Opened::S3 { store, .. } => store.capabilities(),
            Opened::SqliteToOpen(_) | Opened::S3ToOpen(_) => unreachable!("serve opens the database first"),
        }
    }

    /// Where the crash marker lives: the backing root's xattr, or the database's meta table.
    pub(super) fn marker(&self, backing: &Path) -> Marker {
        match self {
            Opened::Local(_) => Marker::Xattr(backing.to_path_buf()),
            Opened::Sqlite(db) | Opened::S3 { names: db, .. } => Marker::Database(db.clone()),
            Opened::SqliteToOpen(_) | Opened::S3ToOpen(_) => unreachable!("serve opens the database first"),
        }
    }
}

/// The crash marker (see `state.rs`): which intent log a crash left the store needing.
pub(super) enum Marker {
    Xattr(PathBuf),
    Database(Arc<backend::sqlite::SqliteBackend>),
}

impl Marker {
    pub(super) fn get(&self) -> Result<Option<PathBuf>, String> {
        match self {
            Marker::Xattr(backing) => state::log_marker(backing),
            Marker::Database(db) => {
                db.log_marker().map_err(|e| format!("reading the crash marker of {}: {e}", db.path().display()))
            }
        }
    }

    pub(super) fn set(&self, log: &Path) -> Result<(), String> {
        match self {
            Marker::Xattr(backing) => state::set_log_marker(backing, log),
            Marker::Database(db) => db
                .set_log_marker(Some(log))
                .map_err(|e| format!("recording the intent log in {}: {e}", db.path().display())),
        }
    }

    pub(super) fn clear(&self) -> Result<(), String> {
        match self {
            Marker::Xattr(backing) => state::clear_log_marker(backing),
            Marker::Database(db) => db
                .set_log_marker(None)
                .map_err(|e| format!("clearing the crash marker of {}: {e}", db.path().display())),
        }
    }

    /// Refuses a mount that would leave a crash's log unreplayed (`state::check_log_marker`).
    pub(super) fn check(&self, log: Option<&Path>) -> Result<(), String> {
        let db = match self {
            Marker::Xattr(backing) => return state::check_log_marker(backing, log),
            Marker::Database(db) => db,
        };
        let Some(needed) = self.get()? else { return Ok(()) };
        if log.is_some_and(|log| state::same_file(log, &needed)) && needed.exists() {
            return Ok(());
        }
        let state = needed.parent().map(|dir| dir.display().to_string()).unwrap_or_default();
        Err(format!(
            "{} was not unmounted cleanly with its intent log at {}, which this mount would not replay: mount it \
             with that log (-o log=on,state={state}). If that log is lost for good, its fsynced bytes are too; \
             `sqlite3 {} \"DELETE FROM meta WHERE key = 'log_marker'\"` lets the database mount without it",
            db.path().display(),
            needed.display(),
            db.path().display()
        ))
    }
}

/// The S3 source's bucket opened (`backend::s3::open`): the client, the lease, the namespace
/// database in the state directory (restored from the bucket when it has none).
pub(super) fn open_s3(
    s3: &backend::source::S3Source,
    opts: &MountOptions,
    state: &StateDir,
    metrics: &Arc<metrics::Metrics>,
) -> Result<backend::s3::S3Mount, String> {
    let objects = s3_client(s3, opts)?;
    let layout = backend::s3::layout::Layout::new(&s3.prefix);
    backend::s3::open(objects, layout, state.path(), opts.unit_bytes, &s3.path_shown(), metrics.clone())
}

/// The S3 client for `s3`'s bucket at `endpoint=`, credentials from the environment or the
/// credentials file (never options). The bucket must exist: making one is its owner's choice.
pub(super) fn s3_client(
    s3: &backend::source::S3Source,
    opts: &MountOptions,
) -> Result<Arc<dyn backend::s3::objects::ObjectStore>, String> {
    use backend::s3::client::{S3Client, S3Config};
    let shown = s3.path_shown();
    let endpoint = opts.s3_endpoint.clone().ok_or_else(|| format!("{shown}: no endpoint= given"))?;
    let config = S3Config {
        endpoint: endpoint.clone(),
        region: opts.s3_region.clone().unwrap_or_else(|| crate::options::S3_REGION_DEFAULT.to_owned()),
        bucket: s3.bucket.clone(),
        io_timeout: opts.io_timeout,
    };
    let client = S3Client::new(&config).map_err(|e| format!("{shown}: {e}"))?;
    match client.bucket_exists() {
        Ok(true) => Ok(Arc::new(client)),
        Ok(false) => Err(format!("{shown}: the bucket {} does not exist at {endpoint}", s3.bucket)),
        Err(e) => Err(format!("{shown}: cannot reach the bucket at {endpoint}: {e}")),
    }
}

/// The writer's lease of an S3 mount, while the daemon holds it. Dropped at the daemon's end
/// (a clean unmount, or a start that failed): released unless the namespace database still
/// names an intent log to replay, which only this state directory can (then its next mount
/// takes the lease back, and no other machine mounts over what the log alone holds).
#[derive(Default)]
pub(super) struct HeldLease(pub(super) Option<(backend::s3::lease::Lease, Arc<backend::sqlite::SqliteBackend>)>);

impl HeldLease {
    pub(super) fn hold(&mut self, lease: backend::s3::lease::Lease, names: Arc<backend::sqlite::SqliteBackend>) {
        self.0 = Some((lease, names));
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        let Some((lease, names)) = self.0.take() else { return };
        match names.log_marker() {
            Ok(None) => match lease.release() {
                Ok(()) => log::info!("released the lease"),
                Err(e) => log::warn!("{e}"),
            },
            Ok(Some(log)) => log::warn!(
                "the lease stays: the intent log {} holds what this state directory's next mount replays",
                log.display()
            ),
            Err(e) => log::warn!("the lease stays: the crash marker cannot be read ({e})"),
        }
    }
}
