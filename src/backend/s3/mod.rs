//! The S3 backend (issue 44), landing in steps. Here now: the object store interface
//! (`objects`) and its client for a real endpoint (`client`), the bucket's layout (`layout`),
//! the unit store of immutable unit objects over the SQLite namespace with a manifest per
//! checkpoint (`store`), the writer's lease (`lease`), and `open`, which a mount calls: the
//! lease taken, the namespace database found in the state directory or recovered from the
//! bucket's newest manifest, the store opened over it.
//!
//! A manifest holds the whole database, or the pages where it differs from the manifest
//! before it (`store::Shipped`); a mount from the bucket applies them over the last whole one.

pub mod client;
pub mod faulty;
pub mod layout;
pub mod lease;
pub mod objects;
pub mod segments;
pub mod store;

use std::path::Path;
use std::sync::Arc;

use crate::backend::sqlite::SqliteBackend;
use crate::metrics::Metrics;
use layout::{Layout, Manifest};
use lease::Lease;
use objects::ObjectStore;
use store::S3Store;

/// The namespace database's file in the state directory.
pub const NAMESPACE_FILE: &str = "namespace.db";

/// How far a database restored from a manifest moves its open generation on: past every open
/// the lost writer may have made since that manifest, so that the unit generations this one
/// gives out are new (a put `IfAbsent` still catches any that is not).
const RESTORED_GENERATION_STEP: i64 = 1 << 16;

/// What a mount of a bucket's prefix holds.
pub struct S3Mount {
    pub names: Arc<SqliteBackend>,
    pub store: Arc<S3Store>,
    pub lease: Lease,
    /// The manifest the namespace was restored from, when the state directory did not hold it.
    pub restored_from: Option<u64>,
}

/// Removes what a mount that failed to start made in a state directory it made itself (the
/// lease id, a namespace database restored or begun), so that the directory can go too.
pub fn remove_state_files(state_dir: &Path) {
    for name in [lease::LEASE_ID_FILE, NAMESPACE_FILE, "namespace.db-wal", "namespace.db-shm", "namespace.db.restoring"]
    {
        let _ = std::fs::remove_file(state_dir.join(name));
    }
}

/// The sequence number of the newest manifest in the bucket.
pub fn newest_manifest(objects: &dyn ObjectStore, layout: &Layout) -> Result<Option<u64>, String> {
    let listed = objects.list(&layout.manifests_prefix()).map_err(|e| format!("listing the manifests: {e}"))?;
    Ok(listed.iter().filter_map(|l| layout.manifest_seq(&l.key)).max())
}

/// The manifest a database file last reserved, and the intent log a crash left it needing.
fn local_state(db: &Path) -> Result<(u64, Option<String>), String> {
    let fail = |e: rusqlite::Error| format!("the namespace database {}: {e}", db.display());
    let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE).map_err(fail)?;
    crate::backend::sqlite::leave_wal_at_close(&conn)
        .map_err(|e| format!("the namespace database {}: {e}", db.display()))?;
    let seq = store::meta_number(&conn, store::MANIFEST_SEQ_KEY).map_err(fail)?.unwrap_or(0);
    let marker: Option<Vec<u8>> = rusqlite::OptionalExtension::optional(conn.query_row(
        "SELECT value FROM meta WHERE key = 'log_marker'",
        [],
        |r| r.get(0),
    ))
    .map_err(fail)?;
    Ok((seq, marker.map(|m| String::from_utf8_lossy(&m).into_owned())))
}

/// The database manifest `seq` names: its own, or, for a manifest of pages, the whole manifest
/// before it and every manifest of pages from there, each checked as it is applied. None when
/// one of them is gone: a writer's newer whole manifest deleted it meanwhile.
fn read_database(objects: &dyn ObjectStore, layout: &Layout, seq: u64) -> Result<Option<Vec<u8>>, String> {
    let mut chain = Vec::new();
    let mut next = Some(seq);
    while let Some(seq) = next {
        if chain.len() > store::MAX_PAGE_MANIFESTS as usize {
            return Err(format!("manifest {seq} is more than {} manifests of pages after a whole one", chain.len()));
        }
        let key = layout.manifest_key(seq);
        let Some(bytes) = objects.get(&key, None).map_err(|e| format!("reading the manifest {key}: {e}"))? else {
            return Ok(None);
        };
        let manifest = Manifest::decode(&bytes).map_err(|e| format!("the manifest {key}: {e}"))?;
        if manifest.seq != seq {
            return Err(format!("the manifest {key} says it is number {}", manifest.seq));
        }
        next = manifest.base();
        chain.push(manifest);
    }
    let mut database = None;
    for manifest in chain.into_iter().rev() {
        let key = layout.manifest_key(manifest.seq);
        database = Some(manifest.into_database(database).map_err(|e| format!("the manifest {key}: {e}"))?);
    }
    Ok(Some(database.expect("a chain of at least one manifest")))
}

/// Writes manifest `seq`'s database as the state directory's namespace database (see
/// `install`).
fn restore(objects: &dyn ObjectStore, layout: &Layout, seq: u64, db: &Path) -> Result<(), String> {
    let key = layout.manifest_key(seq);
    let database = read_database(objects, layout, seq)?.ok_or_else(|| {
        format!("the manifest {key} or one it builds on went away while this mount read it: mount again")
    })?;
    install(&database, &key, db)
}

/// Writes `database` (manifest `key`'s) as the namespace database `db`: the crash marker of the
/// writer that made it cleared (its intent log is not here), its generation moved on.
fn install(database: &[u8], key: &str, db: &Path) -> Result<(), String> {
    let tmp = db.with_extension("db.restoring");
    let fail = |e: String| format!("restoring {} from {key}: {e}", db.display());
    check_room(db, database.len() as u64).map_err(fail)?;
    std::fs::write(&tmp, database).map_err(|e| fail(e.to_string()))?;
    {
        let conn = rusqlite::Connection::open(&tmp).map_err(|e| fail(e.to_string()))?;
        conn.execute_batch(&format!(
            "DELETE FROM meta WHERE key = 'log_marker';
             UPDATE meta SET value = value + {RESTORED_GENERATION_STEP} WHERE key = 'generation';
             PRAGMA wal_checkpoint(TRUNCATE);"
        ))
        .map_err(|e| fail(e.to_string()))?;
    }
    // The replaced database's WAL must not be applied to the restored one.
    for stale in ["-wal", "-shm"] {
        let mut path = db.as_os_str().to_owned();
        path.push(stale);
        let _ = std::fs::remove_file(path);
    }
    std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| fail(e.to_string()))?;
    std::fs::rename(&tmp, db).map_err(|e| fail(e.to_string()))?;
    if let Some(dir) = db.parent() {
        std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}

/// Refuses a restore of `bytes` into `db`'s directory unless its file system has room for the
/// database, its restoring copy beside it and the WAL it is kept with: a read-only mount's copy
/// lives in the runtime directory, memory on a tmpfs `/run`, and a namespace grows with the
/// tree (about 150 bytes a file).
fn check_room(db: &Path, bytes: u64) -> Result<(), String> {
    let dir = db.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let st = crate::sys::statvfs(dir).map_err(|e| format!("statvfs of {}: {e}", dir.display()))?;
    let available = st.f_bavail.saturating_mul(st.f_frsize);
    let needed = bytes.saturating_mul(2) + crate::backend::sqlite::WAL_KEPT_BYTES;
    if available < needed {
        return Err(format!(
            "the namespace database is {bytes} bytes and {} has {available} bytes free ({needed} needed: \
             the copy, its temporary twin and a {} byte WAL): free room there (a read-only mount's \
             copy is in its runtime directory, a writing mount's in its state directory, -o state=DIR)",
            dir.display(),
            crate::backend::sqlite::WAL_KEPT_BYTES
        ));
    }
    Ok(())
}

/// The file a read-only mount restores the bucket's newest manifest into, in its runtime
/// directory (it is this mount's copy, not a writer's state).
pub const READ_ONLY_COPY_FILE: &str = "namespace-read-only.db";

/// A read-only mount of `layout`'s prefix: the bucket's newest manifest (a whole checkpoint of
/// the writer's) restored into `db`, opened read-only, and the store over it. No lease is taken
/// and nothing is put or deleted: the writer goes on meanwhile, and this mount serves the tree
/// as of that checkpoint (objects a later checkpoint of the writer deletes read as EIO; mount
/// again for a newer tree). Returns the manifest's number too.
pub fn open_read_only(
    objects: Arc<dyn ObjectStore>,
    layout: Layout,
    db: &Path,
    source: &str,
    metrics: Arc<Metrics>,
) -> Result<(Arc<SqliteBackend>, Arc<S3Store>, u64), String> {
    // The writer goes on meanwhile: a whole manifest it puts deletes the ones before it, maybe
    // while this mount reads them; then the newest is read again.
    let mut tries = 0;
    let seq = loop {
        let seq = newest_manifest(&*objects, &layout)
            .map_err(|e| format!("{source}: {e}"))?
            .ok_or_else(|| format!("{source}: no checkpoint in the bucket yet, so nothing to mount read-only"))?;
        tries += 1;
        let key = layout.manifest_key(seq);
        match read_database(&*objects, &layout, seq).map_err(|e| format!("{source}: {e}"))? {
            Some(database) => {
                install(&database, &key, db).map_err(|e| format!("{source}: {e}"))?;
                break seq;
            }
            None if tries < 3 => log::info!("{source}: {key} or one it builds on went away; reading the newest again"),
            None => {
                return Err(format!(
                    "{source}: the bucket's manifests went away {tries} times while this mount read them"
                ))
            }
        }
    };
    let unit_bytes = {
        let conn = rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|e| format!("{}: {e}", db.display()))?;
        store::meta_number(&conn, store::UNIT_BYTES_KEY)
            .map_err(|e| format!("{}: {e}", db.display()))?
            .ok_or_else(|| format!("{source}: manifest {seq} records no unit size"))?
    };
    let names = Arc::new(store::open_namespace_read_only(db, metrics.clone())?);
    let store = Arc::new(S3Store::new(names.clone(), objects, layout, Some(unit_bytes), "read-only".into(), metrics)?);
    log::info!("{source}: read-only, the tree of manifest {seq}");
    Ok((names, store, seq))
}

/// Removes a read-only mount's copy of the namespace (at its unmount).
pub fn remove_read_only_copy(runtime_dir: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(runtime_dir.join(format!("{READ_ONLY_COPY_FILE}{suffix}")));
    }
}

/// The namespace, the store, and the manifest restored from.
type Opened = (Arc<SqliteBackend>, Arc<S3Store>, Option<u64>);

/// Opens a mount of `layout`'s prefix in `objects`, its local state in `state_dir`: takes the
/// lease, finds the namespace database (restored from the newest manifest when the state
/// directory has none, or has one the bucket has moved past and holds nothing the bucket
/// lacks), and opens the store over it. `source` names the bucket in messages.
pub fn open(
    objects: Arc<dyn ObjectStore>,
    layout: Layout,
    state_dir: &Path,
    unit_bytes: Option<u64>,
    source: &str,
    metrics: Arc<Metrics>,
) -> Result<S3Mount, String> {
    if let Some(unit) = unit_bytes.filter(|&u| u < store::MIN_UNIT_BYTES) {
        return Err(format!(
            "unit={unit}: an S3 mount's unit is at least {} (a PUT costs the engine 40-120 KB whatever its size)",
            store::MIN_UNIT_BYTES
        ));
    }
    let lease = Lease::take(objects.clone(), &layout, state_dir, source)?;
    let opened = (|| -> Result<Opened, String> {
        let db = state_dir.join(NAMESPACE_FILE);
        let newest = newest_manifest(&*objects, &layout).map_err(|e| format!("{source}: {e}"))?;
        let local = if db.exists() { Some(local_state(&db)?) } else { None };
        let restore_from = match (&local, newest) {
            (None, Some(seq)) => Some(seq),
            (Some((local_seq, None)), Some(seq)) if seq > *local_seq => {
                log::warn!(
                    "{source}: the bucket's manifest {seq} is newer than this state directory's ({local_seq}), which \
                     was unmounted cleanly: taking the bucket's"
                );
                Some(seq)
            }
            (Some((local_seq, Some(log))), Some(seq)) if seq > *local_seq => {
                return Err(format!(
                    "{source}: another mount has written the bucket (manifest {seq}) since this state directory's \
                     namespace (manifest {local_seq}), and this state directory's intent log {log} still holds what a \
                     crash left: the two cannot both be kept. To take the bucket's tree and lose the log's, move \
                     {} away and mount again",
                    state_dir.display()
                ))
            }
            _ => None,
        };
        if let Some(seq) = restore_from {
            restore(&*objects, &layout, seq, &db).map_err(|e| format!("{source}: {e}"))?;
            log::info!("{source}: the namespace restored from manifest {seq}");
        }
        let names = Arc::new(store::open_namespace(&db, metrics.clone())?);
        let store = Arc::new(S3Store::new(
            names.clone(),
            objects.clone(),
            layout.clone(),
            unit_bytes,
            lease.id().to_owned(),
            metrics,
        )?);
        // What a crashed writer put and never recorded: this mount holds the lease and has
        // written nothing yet. A sweep that fails leaves them for the next mount.
        match store.sweep_unnamed() {
            Ok(0) => {}
            Ok(n) => log::info!("{source}: deleted {n} objects no record names (put by a writer that crashed)"),
            Err(e) => log::warn!("{source}: objects no record names stay until the next mount: {e}"),
        }
        Ok((names, store, restore_from))
    })();
    match opened {
        Ok((names, store, restored_from)) => Ok(S3Mount { names, store, lease, restored_from }),
        Err(e) => {
            if let Err(release) = lease.release() {
                log::warn!("{release}");
            }
            Err(e)
        }
    }
}
#[cfg(test)]
mod tests;
