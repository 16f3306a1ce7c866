//! The S3 backend's unit store: a file's data as immutable unit objects in the bucket
//! (`layout`), and the record of which object holds each unit in the SQLite namespace's
//! database, beside the names (`ExternalData`). Owns the write, read and truncate of unit
//! objects and the checkpoint (a manifest per `sync_all`); must not decide anything the engine
//! decides (what to flush, when to checkpoint).
//!
//! - A write of a whole unit puts it under a new generation (`PutCondition::IfAbsent`: an
//!   object is never overwritten), then records (file, unit) -> (generation, length) in the
//!   namespace's open transaction, so a sync orders records with names (contract rule 1). The
//!   generation it replaces is *dropped*, recorded too. A partial unit's ranges go into a
//!   packed segment as pieces (`segments`), or the unit is folded whole when they would reach
//!   half of it.
//! - A read finds the record and GETs the range of the object that holds the bytes, then the
//!   unit's pieces over it; no record and no piece is a hole. A truncate drops the records
//!   past the end and shortens the one the end falls in (its object keeps its bytes; the
//!   record says how many count), and cuts the pieces as it does.
//! - A checkpoint commits the database, puts `manifests/<seq>` IfAbsent holding the database's
//!   bytes (what another machine needs to mount the bucket), and only then deletes the objects
//!   of dropped generations and the older manifests: a manifest in the bucket never names an
//!   object that is gone. A manifest already at its key means another writer: the checkpoint
//!   fails (EIO, an error line) and nothing is overwritten.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, OptionalExtension};

use super::layout::{Content, Layout, Manifest};
use super::objects::{ObjectError, ObjectResult, ObjectStore, PutCondition, PutOutcome};
use super::segments::{Piece, Segments, Sink, MAX_PIECES_PER_UNIT};
use crate::backend::holes::{self, Punch, UnitCopy};
use crate::backend::sqlite::{ExternalData, FileHold, SqliteBackend};
use crate::backend::{Capabilities, FileData, OpenMode, UnitSource, UnitStore, UnitWrite};
use crate::engine::types::ObjectId;
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};

/// The least unit a mount takes: an S3 PUT costs the engine 40-120 KB of device writes
/// whatever its size (docs/ceph-and-s3.md), so only objects of 1 MiB or more come near the
/// erasure-coding floor.
pub const MIN_UNIT_BYTES: u64 = 1 << 20;
/// The unit of a new bucket prefix when `-o unit=` gives none. On the Ceph cluster of
/// `bench/results/2026-11-29-s3-ceph-unit`, 1 GiB written sequentially cost 1.529x at the OSDs
/// in 4 MiB units and 1.604x in 1 MiB ones (RGW writes ~60 KB of metadata per object), at 1.7x
/// the MB/s; scattered writes go into segments whatever the unit (the sparse 1 GiB case costs
/// more in 4 MiB units, 3.37x against 2.96x: the report says why).
pub const DEFAULT_UNIT_BYTES: u64 = 4 << 20;
/// Flushers of an S3 mount when `-o flushers=` gives none: each waits on a PUT's round trip,
/// not a core (1 GiB sequential in 1 MiB units: 2 flushers 89 MB/s, 8 flushers 114; in 4 MiB
/// units 155 and 189; same report).
pub const DEFAULT_FLUSHERS: usize = 8;

/// The `meta` keys the store keeps in the namespace's database.
pub const MANIFEST_SEQ_KEY: &str = "s3_manifest_seq";
/// The largest manifest a checkpoint puts: S3's limit for one PUT (and Ceph RGW's default
/// `rgw_max_put_size`). At about 150 bytes of database per file that is some 30 million files;
/// past it the checkpoint fails (EFBIG, an error line) and deletes nothing, as a refused put.
pub const MANIFEST_MAX_BYTES: u64 = 5 << 30;
pub const UNIT_BYTES_KEY: &str = "s3_unit_bytes";

/// Tries of a unit put whose key is taken (only garbage of a database restored from an older
/// manifest can hold one: see `next_generation`), each further along the counter.
const PUT_TRIES: u32 = 16;

/// The most units one copy_file_range call copies (each a CopyObject request, 17-47 ms on RGW
/// here): the kernel asks again for the rest.
const COPY_MAX_UNITS: u64 = 64;

/// The unit copies of one copy_file_range call in flight at once.
const COPIES_AT_ONCE: usize = 8;

const TABLES: &str = "
CREATE TABLE IF NOT EXISTS s3_units(file INTEGER NOT NULL, unit INTEGER NOT NULL,
    generation INTEGER NOT NULL, length INTEGER NOT NULL, PRIMARY KEY(file, unit)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS s3_dropped(file INTEGER NOT NULL, unit INTEGER NOT NULL,
    generation INTEGER NOT NULL, PRIMARY KEY(file, unit, generation)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS s3_pieces(file INTEGER NOT NULL, unit INTEGER NOT NULL, seq INTEGER NOT NULL,
    start INTEGER NOT NULL, length INTEGER NOT NULL, segment INTEGER NOT NULL, offset INTEGER NOT NULL,
    PRIMARY KEY(file, unit, seq)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS s3_pieces_by_segment ON s3_pieces(segment);
CREATE TABLE IF NOT EXISTS s3_dropped_segments(segment INTEGER PRIMARY KEY);
";

/// The records' side of the namespace: a file the namespace deletes drops its generations and
/// pieces; a commit puts the open segment first.
#[derive(Default)]
pub struct UnitRecords {
    segments: Arc<Segments>,
    /// `bytes_stored` as last summed, let go at every commit: a sum over every record (15-18 ms
    /// for 250,000 units, 1 TiB in 4 MiB units, measured here) under the backend's lock, which
    /// every request of the mount waits for, at every statfs (`df`, a monitoring agent's poll).
    /// Between commits (checkpoints, a few seconds apart while writing) `df` may lag the
    /// records of the open transaction.
    stored: Mutex<Option<u64>>,
}

impl ExternalData for UnitRecords {
    fn tables(&self) -> &'static str {
        TABLES
    }

    fn file_deleted(&self, db: &Connection, file: ObjectId) -> rusqlite::Result<()> {
        drop_data(db, &self.segments, "file = ?1", &[file as i64])
    }

    /// Its unit objects' bytes that count and its pieces' (a piece over a unit object counted
    /// twice: the namespace caps the sum at the file's size).
    fn bytes_held(&self, db: &Connection, file: ObjectId) -> rusqlite::Result<u64> {
        let held: i64 = db
            .prepare_cached(
                "SELECT (SELECT coalesce(sum(length), 0) FROM s3_units WHERE file = ?1) \
                 + (SELECT coalesce(sum(length), 0) FROM s3_pieces WHERE file = ?1)",
            )?
            .query_row([file as i64], |r| r.get(0))?;
        Ok(held as u64)
    }

    /// Every unit object's bytes that count and every piece's, as `bytes_held` (a piece over a
    /// unit object counted twice; segments' dropped pieces and objects waiting for the next
    /// manifest's deletes not at all).
    fn bytes_stored(&self, db: &Connection) -> rusqlite::Result<u64> {
        let mut summed = self.stored.lock().unwrap();
        if let Some(stored) = *summed {
            return Ok(stored);
        }
        let stored: i64 = db
            .prepare_cached(
                "SELECT (SELECT coalesce(sum(length), 0) FROM s3_units) \
                 + (SELECT coalesce(sum(length), 0) FROM s3_pieces)",
            )?
            .query_row([], |r| r.get(0))?;
        *summed = Some(stored as u64);
        Ok(stored as u64)
    }

    fn before_commit(&self, db: &Connection) -> SysResult<()> {
        *self.stored.lock().unwrap() = None;
        self.segments.seal(db)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Drops the unit records and pieces `condition` selects (SQL over the `file` and `unit`
/// columns, its parameters `values`): their generations, and segments no piece names any more,
/// are deleted from the bucket after the next manifest.
fn drop_data(db: &Connection, segments: &Segments, condition: &str, values: &[i64]) -> rusqlite::Result<()> {
    db.prepare_cached(&format!(
        "INSERT OR IGNORE INTO s3_dropped(file, unit, generation) \
         SELECT file, unit, generation FROM s3_units WHERE {condition}"
    ))?
    .execute(rusqlite::params_from_iter(values))?;
    db.prepare_cached(&format!("DELETE FROM s3_units WHERE {condition}"))?
        .execute(rusqlite::params_from_iter(values))?;
    segments.delete_pieces(db, condition, values)
}

/// The namespace database at `path` with the unit records' tables, for an `S3Store`.
pub fn open_namespace(path: &std::path::Path, metrics: Arc<Metrics>) -> Result<SqliteBackend, String> {
    SqliteBackend::open_with(path, None, metrics, Some(Arc::new(UnitRecords::default())))
}

/// The namespace database at `path` read-only, for an `S3Store` that serves a read-only mount.
pub fn open_namespace_read_only(path: &std::path::Path, metrics: Arc<Metrics>) -> Result<SqliteBackend, String> {
    SqliteBackend::open_read_only_with(path, None, metrics, Arc::new(UnitRecords::default()))
}

/// The generations this store gives out (unit objects' and segments'): the namespace
/// database's open generation in the high half, never the same twice for one database file,
/// and a counter.
pub struct Generations {
    epoch: u64,
    counter: AtomicU64,
}

impl Generations {
    /// A generation no object of this database has; `skip` moves further along the counter.
    pub fn next(&self, skip: u64) -> u64 {
        let n = self.counter.fetch_add(1 + skip, Relaxed) + skip;
        assert!(n < 1 << 32, "more than 2^32 object writes in one mount");
        self.epoch << 32 | n
    }
}

/// A value of the `meta` table as a number.
pub fn meta_number(db: &Connection, key: &str) -> rusqlite::Result<Option<u64>> {
    let value: Option<rusqlite::types::Value> =
        db.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0)).optional()?;
    Ok(value.and_then(|v| match v {
        rusqlite::types::Value::Integer(n) => Some(n as u64),
        rusqlite::types::Value::Text(t) => t.parse().ok(),
        _ => None,
    }))
}

fn set_meta_number(db: &Connection, key: &str, value: u64) -> rusqlite::Result<()> {
    db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?1, ?2)", params![key, value as i64])?;
    Ok(())
}

/// A database error as EIO, said in the daemon's log.
pub(super) fn sql<T>(result: rusqlite::Result<T>) -> SysResult<T> {
    result.map_err(|e| {
        log::error!("s3 backend: the namespace database: {e}");
        Errno(libc::EIO)
    })
}

/// An object call's failure as the caller's errno, said in the daemon's log.
pub(super) fn object_errno(e: ObjectError) -> Errno {
    log::error!("s3 backend: {e}");
    e.to_errno()
}

/// Where a unit's bytes are: the object of `generation`, its first `length` bytes.
#[derive(Clone, Copy)]
struct Record {
    unit: u64,
    generation: u64,
    length: u64,
}

/// The first of units `first..=last` of `file` with pieces (its bytes partly in segments).
fn first_unit_with_pieces(db: &Connection, file: ObjectId, first: u64, last: u64) -> SysResult<Option<u64>> {
    let unit: Option<i64> =
        sql(sql(db.prepare_cached("SELECT min(unit) FROM s3_pieces WHERE file = ?1 AND unit BETWEEN ?2 AND ?3"))?
            .query_row(params![file as i64, first as i64, last as i64], |row| row.get(0)))?;
    Ok(unit.map(|unit| unit as u64))
}

/// The records of units `first..=last` of `file`, in unit order.
fn unit_records(db: &Connection, file: ObjectId, first: u64, last: u64) -> SysResult<Vec<Record>> {
    let mut stmt = sql(db.prepare_cached(
        "SELECT unit, generation, length FROM s3_units WHERE file = ?1 AND unit BETWEEN ?2 AND ?3 ORDER BY unit",
    ))?;
    let rows = sql(stmt.query_map(params![file as i64, first as i64, last as i64], |row| {
        Ok(Record {
            unit: row.get::<_, i64>(0)? as u64,
            generation: row.get::<_, i64>(1)? as u64,
            length: row.get::<_, i64>(2)? as u64,
        })
    }))?;
    sql(rows.collect::<rusqlite::Result<Vec<_>>>())
}

/// The most manifests of pages that follow one whole database: a mount from the bucket reads
/// at most one more than this many manifests.
pub const MAX_PAGE_MANIFESTS: u32 = 64;

/// What the bucket holds of the database since this mount's first manifest: enough to put
/// only the pages that changed. Kept as a hash per page, not the database's bytes.
struct Shipped {
    /// The newest manifest in the bucket, which the next one's pages apply over.
    seq: u64,
    /// None when the database's header gave no page size (then only whole manifests).
    page_bytes: Option<usize>,
    /// A 64-bit SipHash of each page of manifest `seq`'s database (keys random per mount).
    page_hashes: Vec<u64>,
    hasher: std::collections::hash_map::RandomState,
    /// Manifests of pages since the last whole one, and their bytes.
    page_manifests: u32,
    page_manifest_bytes: u64,
}

/// The page size a database image gives in its header (bytes 16-17, big-endian; 1 means
/// 65536), checked against its length.
fn page_bytes_of(database: &[u8]) -> Option<usize> {
    let raw = u16::from_be_bytes(database.get(16..18)?.try_into().ok()?);
    let page = if raw == 1 { 65536 } else { usize::from(raw) };
    (page.is_power_of_two() && page >= 512 && database.len() % page == 0).then_some(page)
}

fn page_hashes(database: &[u8], page_bytes: usize, hasher: &std::collections::hash_map::RandomState) -> Vec<u64> {
    use std::hash::BuildHasher;
    database.chunks_exact(page_bytes).map(|page| hasher.hash_one(page)).collect()
}

impl Shipped {
    /// Manifest `seq`'s content over this one: the pages of `database` that changed, while
    /// the manifests of pages since the last whole one stay fewer than `MAX_PAGE_MANIFESTS`
    /// and their bytes below one database's (a mount from the bucket reads no more than
    /// about two databases); else the whole database. Returns the state after it is put.
    fn next(this: Option<&Shipped>, seq: u64, database: Vec<u8>) -> (Content, Shipped) {
        let hasher = this.map(|s| s.hasher.clone()).unwrap_or_default();
        let page_bytes = page_bytes_of(&database);
        let page_hashes = page_bytes.map(|p| page_hashes(&database, p, &hasher)).unwrap_or_default();
        // The pages that changed over the last manifest, while a manifest of them stays within
        // the bounds; None: the whole database.
        let over_last = this.zip(page_bytes).filter(|(last, p)| last.page_bytes == Some(*p)).and_then(|(last, p)| {
            let changed: Vec<usize> = (0..page_hashes.len())
                .filter(|&i| last.page_hashes.get(i).is_none_or(|old| *old != page_hashes[i]))
                .collect();
            let bytes = last.page_manifest_bytes + (changed.len() * (4 + p)) as u64;
            (last.page_manifests < MAX_PAGE_MANIFESTS && bytes <= database.len() as u64)
                .then_some((last, p, changed, bytes))
        });
        let (content, page_manifests, page_manifest_bytes) = match over_last {
            None => (Content::Whole(database), 0, 0),
            Some((last, p, changed, bytes)) => {
                let pages = changed
                    .into_iter()
                    .map(|i| {
                        (u32::try_from(i).expect("a SQLite page number fits u32"), database[i * p..][..p].to_vec())
                    })
                    .collect();
                let content = Content::Pages {
                    base: last.seq,
                    page_bytes: p as u32,
                    database_bytes: database.len() as u64,
                    database_crc32c: crc32c::crc32c(&database),
                    pages,
                };
                (content, last.page_manifests + 1, bytes)
            }
        };
        (content, Shipped { seq, page_bytes, page_hashes, hasher, page_manifests, page_manifest_bytes })
    }
}

/// One dropped generation: its object goes once a manifest without it is in the bucket.
#[derive(Clone, Copy, Debug)]
struct Dropped {
    file: u64,
    unit: u64,
    generation: u64,
}

/// What a checkpoint ships: the database as of manifest `seq`, the generations and segments it
/// no longer names, and the database's change count then.
struct Snapshot {
    seq: u64,
    database: Vec<u8>,
    dropped: Vec<Dropped>,
    dropped_segments: Vec<u64>,
    changes: u64,
}

struct Shared {
    names: Arc<SqliteBackend>,
    objects: Arc<dyn ObjectStore>,
    layout: Layout,
    metrics: Arc<Metrics>,
    unit_bytes: u64,
    generations: Arc<Generations>,
    segments: Arc<Segments>,
}

impl Shared {
    fn next_generation(&self, skip: u64) -> u64 {
        self.generations.next(skip)
    }

    /// Puts the unit's bytes under a fresh generation; returns it.
    fn put_unit(&self, file: u64, unit: u64, body: &[u8]) -> SysResult<u64> {
        let mut skip = 0;
        for _ in 0..PUT_TRIES {
            let generation = self.next_generation(skip);
            let key = self.layout.unit_key(file, unit, generation);
            match self.objects.put(&key, body, PutCondition::IfAbsent).map_err(object_errno)? {
                PutOutcome::Written => return Ok(generation),
                PutOutcome::AlreadyThere => {
                    // A database restored from a manifest may give out a generation the lost
                    // writer used after it: that object is garbage, and still not overwritten.
                    log::warn!(
                        "s3 backend: {key} is already in the bucket (left by an earlier writer); trying further on"
                    );
                    skip = (skip + 1) * 64;
                }
            }
        }
        log::error!("s3 backend: no free generation for unit {unit} of file {file} in {PUT_TRIES} tries");
        Err(Errno(libc::EIO))
    }

    /// What a read of `within` (bytes of `file`, clipped to its size) needs, from one view
    /// of the database: the file's size, the records of the units it spans in unit order, and
    /// their pieces that reach into it (applied over the records, in order).
    fn view(&self, file: u64, within: Range<u64>) -> SysResult<(u64, Vec<Record>, Vec<Piece>)> {
        let u = self.unit_bytes;
        self.names.records(|r| {
            let size = r.file_size(file)?;
            let within = within.start..within.end.min(size);
            if within.is_empty() {
                return Ok((size, Vec::new(), Vec::new()));
            }
            let (first, last) = (within.start / u, (within.end - 1) / u);
            let records = unit_records(r.db(), file, first, last)?;
            let pieces = self.segments.pieces(r.db(), file, first, last, u, within)?;
            Ok((size, records, pieces))
        })
    }

    /// Fetches `range` of object `key` into `out`; false when the object is gone (a checkpoint
    /// deleted it after the view was read: read again).
    fn fetch(&self, key: &str, range: Range<u64>, out: &mut [u8]) -> SysResult<bool> {
        let Some(bytes) = self.fetch_range(key, range)? else { return Ok(false) };
        out.copy_from_slice(&bytes);
        Ok(true)
    }

    /// `range` of object `key`, as the GET returned it (no copy); None when the object is gone.
    /// Fewer bytes than the range is an error: a record promised them.
    fn fetch_range(&self, key: &str, range: Range<u64>) -> SysResult<Option<Vec<u8>>> {
        let wanted = range.end - range.start;
        match self.objects.get(key, Some(range)).map_err(object_errno)? {
            Some(bytes) if bytes.len() as u64 == wanted => Ok(Some(bytes)),
            Some(bytes) => {
                log::error!("s3 backend: {key}: {} bytes where its record promises {wanted}", bytes.len());
                Err(Errno(libc::EIO))
            }
            None => Ok(None),
        }
    }
}

/// Two pieces of one segment at most this far apart are fetched by one GET, the bytes between
/// them read and thrown away: less than a GET's round trip costs. A span is at most the
/// segment (`SEGMENT_BYTES` and the last unit's pieces appended), held for one read.
const PIECE_GAP_FETCHED: u64 = 64 << 10;

/// Bytes of segments fetched for one read: per segment, spans in offset order.
struct Fetched {
    spans: std::collections::HashMap<u64, Vec<(u64, Vec<u8>)>>,
}

impl Fetched {
    /// `len` bytes at `at` of `segment`, which a span fetched holds.
    fn bytes(&self, segment: u64, at: u64, len: u64) -> &[u8] {
        let spans = &self.spans[&segment];
        let i = spans.partition_point(|(start, _)| *start <= at) - 1;
        let (start, bytes) = &spans[i];
        let from = (at - start) as usize;
        assert!(from + len as usize <= bytes.len(), "segment {segment}: {len} bytes at {at} outside the span fetched");
        &bytes[from..from + len as usize]
    }
}

impl Shared {
    /// Fetches the segment ranges `wanted` names, merging the ranges of one segment that lie
    /// within `PIECE_GAP_FETCHED` of each other into one GET; None when a segment is gone.
    fn fetch_spans(&self, wanted: impl Iterator<Item = (u64, Range<u64>)>) -> SysResult<Option<Fetched>> {
        let mut by_segment: std::collections::HashMap<u64, Vec<Range<u64>>> = std::collections::HashMap::new();
        for (segment, range) in wanted {
            by_segment.entry(segment).or_default().push(range);
        }
        let mut spans = std::collections::HashMap::new();
        for (segment, mut ranges) in by_segment {
            ranges.sort_by_key(|r| r.start);
            let mut merged: Vec<Range<u64>> = Vec::new();
            for r in ranges {
                match merged.last_mut() {
                    Some(last) if r.start <= last.end + PIECE_GAP_FETCHED => last.end = last.end.max(r.end),
                    _ => merged.push(r),
                }
            }
            let key = self.layout.segment_key(segment);
            let mut fetched = Vec::with_capacity(merged.len());
            for span in merged {
                let start = span.start;
                let Some(bytes) = self.fetch_range(&key, span)? else { return Ok(None) };
                fetched.push((start, bytes));
            }
            spans.insert(segment, fetched);
        }
        Ok(Some(Fetched { spans }))
    }
}

/// The S3 backend's unit store, over the SQLite namespace it shares a database with.
pub struct S3Store {
    shared: Arc<Shared>,
    capabilities: Capabilities,
    /// The lease id of this mount, named in its manifests.
    writer: String,
    /// One checkpoint at a time; the database's change count at the last manifest, and what
    /// the bucket holds of the database since this mount's first.
    checkpoint: Mutex<(Option<u64>, Option<Shipped>)>,
    /// `MANIFEST_MAX_BYTES`; smaller in tests, which cannot make 5 GiB.
    manifest_max_bytes: AtomicU64,
}

impl S3Store {
    /// The store over `names` (opened with `open_namespace`), its objects under `layout` in
    /// `objects`. `unit_bytes`: `-o unit=` (the mount refuses less than `MIN_UNIT_BYTES`;
    /// in-process tests use smaller ones); none given, the unit the database records, else
    /// `DEFAULT_UNIT_BYTES`. A database made with another unit than the one given is refused:
    /// its records count in that unit.
    pub fn new(
        names: Arc<SqliteBackend>,
        objects: Arc<dyn ObjectStore>,
        layout: Layout,
        unit_bytes: Option<u64>,
        writer: String,
        metrics: Arc<Metrics>,
    ) -> Result<S3Store, String> {
        let recorded = names
            .records(|r| {
                let recorded = sql(meta_number(r.db(), UNIT_BYTES_KEY))?;
                if recorded.is_none() {
                    let unit = unit_bytes.unwrap_or(DEFAULT_UNIT_BYTES);
                    r.change(|r| sql(set_meta_number(r.db(), UNIT_BYTES_KEY, unit)))?;
                    r.commit()?;
                }
                Ok(recorded)
            })
            .map_err(|e| format!("the namespace database {}: {e}", names.path().display()))?;
        let unit = unit_bytes.or(recorded).unwrap_or(DEFAULT_UNIT_BYTES);
        assert!(unit.is_power_of_two() && unit >= 4096, "a unit of {unit} bytes");
        if let Some(recorded) = recorded.filter(|&r| r != unit) {
            return Err(format!(
                "unit={unit}: this bucket's files are stored in units of {recorded} bytes; mount it with unit={recorded}"
            ));
        }
        let capabilities = Capabilities {
            unit_bytes: unit,
            unit_source: if unit_bytes.is_some() { UnitSource::Option } else { UnitSource::Store },
            logical_block_bytes: 4096,
            // Ranges of a unit go to a packed segment (`segments`) or fold it whole: the store
            // decides, the engine reads nothing back for it.
            partial_writes: true,
            // Its data reaches the bucket by PUTs whatever their size: an fsync is answered
            // from the intent log up to half a unit (issue 44: partial units stay in the log
            // until they fill or a checkpoint writes them).
            syncs_cost_requests: true,
            // A unit's object is in the bucket when its put returns, its record only in the
            // open transaction: the file's sync commits it.
            durable_writes: false,
            atomic_unit_writes: true,
            // Unit objects copied by the server (`S3FileData::copy_to`).
            copy_ranges: true,
            // Hole punching (`S3FileData::allocate`); preallocation answers EOPNOTSUPP.
            allocate: true,
            keys_can_go_stale: true,
            sync_orders_names: true,
            keeps_chosen_ids: true,
            // Its namespace database could keep one; not claimed until its unit puts, commit and
            // manifest are shown to make one atomic step with it.
            keeps_replay_watermark: false,
            // Eight PUTs in flight: 4 MiB units took 189 MB/s on the project's Ceph against 89
            // with 1 MiB units and two flushers (bench/results/2026-11-29-s3-ceph-unit).
            preferred_flushers: Some(DEFAULT_FLUSHERS),
        };
        let external = names.external();
        let Some(records) = external.as_ref().and_then(|e| e.as_any().downcast_ref::<UnitRecords>()) else {
            return Err(format!("{}: not opened as an S3 namespace (open_namespace)", names.path().display()));
        };
        let segments = records.segments.clone();
        let generations = Arc::new(Generations { epoch: names.generation(), counter: AtomicU64::new(1) });
        segments.connect(Sink {
            objects: objects.clone(),
            layout: layout.clone(),
            metrics: metrics.clone(),
            generations: generations.clone(),
        });
        Ok(S3Store {
            shared: Arc::new(Shared { names, objects, layout, metrics, unit_bytes: unit, generations, segments }),
            capabilities,
            writer,
            manifest_max_bytes: AtomicU64::new(MANIFEST_MAX_BYTES),
            checkpoint: Mutex::new((None, None)),
        })
    }

    /// Deletes the unit objects and segments no record of the database names, dropped ones
    /// included: objects a crashed writer put whose records never committed (a record is
    /// committed only after its object is in the bucket). Only for a writer that holds the lease
    /// and has written nothing yet; returns how many went. Keys it cannot read as its own stay.
    pub fn sweep_unnamed(&self) -> Result<usize, String> {
        let shared = &self.shared;
        let layout = &shared.layout;
        let listed = |prefix: String| shared.objects.list(&prefix).map_err(|e| format!("listing {prefix}: {e}"));
        let units = listed(layout.units_prefix())?;
        let segments = listed(layout.segments_prefix())?;
        // What the database names, read once under one lock (not a query per listed object).
        let (named_units, named_segments) = shared
            .names
            .records(|r| {
                let db = r.db();
                let mut stmt = sql(db.prepare_cached(
                    "SELECT file, unit, generation FROM s3_units UNION SELECT file, unit, generation FROM s3_dropped",
                ))?;
                let units: HashSet<(i64, i64, i64)> =
                    sql(sql(stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?))))?.collect())?;
                let mut stmt = sql(
                    db.prepare_cached("SELECT segment FROM s3_pieces UNION SELECT segment FROM s3_dropped_segments")
                )?;
                let segments: HashSet<i64> = sql(sql(stmt.query_map([], |row| row.get(0)))?.collect())?;
                Ok((units, segments))
            })
            .map_err(|e| format!("the namespace database: {e}"))?;
        let mut unnamed = Vec::new();
        for object in units {
            let Some((file, unit, generation)) = layout.unit_of_key(&object.key) else { continue };
            if !named_units.contains(&(file as i64, unit as i64, generation as i64)) {
                unnamed.push(object.key);
            }
        }
        for object in segments {
            let Some(segment) = layout.segment_of_key(&object.key) else { continue };
            if !named_segments.contains(&(segment as i64)) {
                unnamed.push(object.key);
            }
        }
        for key in &unnamed {
            shared.objects.delete(key).map_err(|e| format!("deleting {key}, which no record names: {e}"))?;
        }
        Ok(unnamed.len())
    }

    /// The namespace this store keeps its records in.
    pub fn names(&self) -> &Arc<SqliteBackend> {
        &self.shared.names
    }

    /// Commits, and when anything changed since the last manifest, snapshots the database for
    /// the next one: its sequence number (recorded in the snapshot itself), its bytes, and the
    /// dropped generations it no longer names.
    fn prepare_manifest(&self, at_last: Option<u64>) -> SysResult<Option<Snapshot>> {
        self.shared.names.records(|r| {
            r.commit()?;
            if at_last == Some(r.total_changes()) {
                return Ok(None);
            }
            let seq = r.change(|r| {
                let seq = sql(meta_number(r.db(), MANIFEST_SEQ_KEY))?.unwrap_or(0) + 1;
                sql(set_meta_number(r.db(), MANIFEST_SEQ_KEY, seq))?;
                Ok(seq)
            })?;
            r.commit()?;
            let database = r.serialize()?;
            let mut stmt = sql(r.db().prepare_cached("SELECT file, unit, generation FROM s3_dropped"))?;
            let rows = sql(stmt.query_map([], |row| {
                Ok(Dropped {
                    file: row.get::<_, i64>(0)? as u64,
                    unit: row.get::<_, i64>(1)? as u64,
                    generation: row.get::<_, i64>(2)? as u64,
                })
            }))?;
            let dropped = sql(rows.collect::<rusqlite::Result<Vec<_>>>())?;
            let mut stmt = sql(r.db().prepare_cached("SELECT segment FROM s3_dropped_segments"))?;
            let rows = sql(stmt.query_map([], |row| Ok(row.get::<_, i64>(0)? as u64)))?;
            let dropped_segments = sql(rows.collect::<rusqlite::Result<Vec<_>>>())?;
            Ok(Some(Snapshot { seq, database, dropped, dropped_segments, changes: r.total_changes() }))
        })
    }
}

#[cfg(test)]
impl S3Store {
    pub fn open_segment_bytes(&self) -> usize {
        self.shared.segments.open_bytes()
    }

    pub fn set_manifest_max_bytes(&self, max: u64) {
        self.manifest_max_bytes.store(max, Relaxed);
    }
}

impl UnitStore for S3Store {
    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn open(&self, id: ObjectId, _mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        let hold = self.shared.names.hold_file(id)?;
        Ok(Arc::new(S3FileData { shared: self.shared.clone(), id, _hold: hold }))
    }

    fn sync_all(&self) -> SysResult<()> {
        let shared = &self.shared;
        if shared.names.read_only() {
            return Ok(()); // a read-only mount's: nothing it could have changed to ship
        }
        let mut checkpoint = self.checkpoint.lock().unwrap_or_else(|p| p.into_inner());
        let (at_last, shipped) = &mut *checkpoint;
        let Some(Snapshot { seq, database, dropped, dropped_segments, changes }) = self.prepare_manifest(*at_last)?
        else {
            return Ok(());
        };
        let key = shared.layout.manifest_key(seq);
        let (content, next_shipped) = Shipped::next(shipped.as_ref(), seq, database);
        let whole = matches!(content, Content::Whole(_));
        let body = Manifest { seq, writer: self.writer.clone(), unit_bytes: shared.unit_bytes, content }.encode();
        let max = self.manifest_max_bytes.load(Relaxed);
        if body.len() as u64 > max {
            log::error!(
                "s3 backend: the manifest {key} would be {} bytes, over the {max} one PUT takes (manifests in \
                 parts are not built): this checkpoint fails and the intent log keeps what it holds",
                body.len()
            );
            return Err(Errno(libc::EFBIG));
        }
        match shared.objects.put(&key, &body, PutCondition::IfAbsent).map_err(object_errno)? {
            PutOutcome::Written => {}
            PutOutcome::AlreadyThere => {
                log::error!(
                    "s3 backend: the manifest {key} is already in the bucket: another mount writes this prefix. \
                     This checkpoint fails and nothing is overwritten; unmount this one and find the other writer"
                );
                return Err(Errno(libc::EIO));
            }
        }
        *shipped = Some(next_shipped);
        let kind = if whole { &shared.metrics.s3_manifests_whole } else { &shared.metrics.s3_manifests_pages };
        kind.fetch_add(1, Relaxed);
        shared.metrics.backend_write_bytes.fetch_add(body.len() as u64, Relaxed);
        shared.metrics.backend_write_requests.fetch_add(1, Relaxed);
        shared.metrics.backend_write_sizes.record(body.len() as u64);
        log::debug!(
            "s3 backend: checkpoint manifest {key}, {} bytes ({})",
            body.len(),
            if whole { "the whole database" } else { "the pages that changed" }
        );

        // The manifest in the bucket names none of these: their objects may go now.
        let mut deleted = Vec::new();
        for d in &dropped {
            match shared.objects.delete(&shared.layout.unit_key(d.file, d.unit, d.generation)) {
                Ok(()) => deleted.push(*d),
                Err(e) => log::warn!("s3 backend: a dropped generation stays for the next checkpoint: {e}"),
            }
        }
        let mut deleted_segments = Vec::new();
        for &segment in &dropped_segments {
            match shared.objects.delete(&shared.layout.segment_key(segment)) {
                Ok(()) => deleted_segments.push(segment),
                Err(e) => log::warn!("s3 backend: a dropped segment stays for the next checkpoint: {e}"),
            }
        }
        let forgotten = shared.names.records(|r| {
            let before = r.total_changes();
            r.change(|r| {
                let mut stmt = sql(r
                    .db()
                    .prepare_cached("DELETE FROM s3_dropped WHERE file = ?1 AND unit = ?2 AND generation = ?3"))?;
                for d in &deleted {
                    sql(stmt.execute(params![d.file as i64, d.unit as i64, d.generation as i64]))?;
                }
                let mut stmt = sql(r.db().prepare_cached("DELETE FROM s3_dropped_segments WHERE segment = ?1"))?;
                for &segment in &deleted_segments {
                    sql(stmt.execute([segment as i64]))?;
                }
                Ok(())
            })?;
            // Forgetting them changes nothing the manifest needs: unchanged otherwise, the next
            // checkpoint writes none.
            Ok((before == changes).then(|| r.total_changes()))
        });
        *at_last = match forgotten {
            Ok(at) => at,
            Err(e) => {
                log::warn!("s3 backend: dropped generations deleted but still listed: {e}");
                None
            }
        };
        // Manifests before a whole one name objects just deleted, and no later manifest's
        // pages apply over them: the tree is the newest whole manifest and the pages after it.
        if !whole {
            return Ok(());
        }
        match shared.objects.list(&shared.layout.manifests_prefix()) {
            Ok(listed) => {
                for old in listed.iter().filter(|l| shared.layout.manifest_seq(&l.key).is_some_and(|s| s < seq)) {
                    if let Err(e) = shared.objects.delete(&old.key) {
                        log::warn!("s3 backend: an older manifest stays: {e}");
                    }
                }
            }
            Err(e) => log::warn!("s3 backend: older manifests not listed: {e}"),
        }
        Ok(())
    }
}

/// A file's data: its unit objects, found through its records.
struct S3FileData {
    shared: Arc<Shared>,
    id: ObjectId,
    _hold: FileHold,
}

impl S3FileData {
    /// Puts `body` as the whole of `unit` (up to the file's end) under a fresh generation,
    /// records it in place of the one before, and drops the unit's pieces.
    fn write_whole(&self, unit: u64, body: &[u8]) -> SysResult<()> {
        let shared = &self.shared;
        let length = body.len() as u64;
        let generation = shared.put_unit(self.id, unit, body)?;
        let id = self.id;
        let recorded = shared.names.records(|r| {
            r.change(|r| {
                r.file_size(id)?;
                let db = r.db();
                let old: Option<i64> =
                    sql(sql(db.prepare_cached("SELECT generation FROM s3_units WHERE file = ?1 AND unit = ?2"))?
                        .query_row(params![id as i64, unit as i64], |row| row.get(0))
                        .optional())?;
                if let Some(old) = old {
                    sql(sql(db.prepare_cached(
                        "INSERT OR IGNORE INTO s3_dropped(file, unit, generation) VALUES(?1, ?2, ?3)",
                    ))?
                    .execute(params![id as i64, unit as i64, old]))?;
                }
                sql(sql(db.prepare_cached(
                    "INSERT OR REPLACE INTO s3_units(file, unit, generation, length) VALUES(?1, ?2, ?3, ?4)",
                ))?
                .execute(params![id as i64, unit as i64, generation as i64, length as i64]))?;
                sql(shared.segments.delete_pieces(db, "file = ?1 AND unit = ?2", &[id as i64, unit as i64]))?;
                r.set_file_size(id, unit * shared.unit_bytes + length, true)
            })
        });
        if let Err(e) = recorded {
            // Named by no record: take it back rather than leave it to no one.
            let _ = shared.objects.delete(&shared.layout.unit_key(id, unit, generation));
            return Err(e);
        }
        shared.metrics.backend_write_bytes.fetch_add(length, Relaxed);
        shared.metrics.backend_write_requests.fetch_add(1, Relaxed);
        shared.metrics.backend_write_sizes.record(length);
        Ok(())
    }
}

impl S3FileData {
    /// `body` as the whole of `unit`, shorter than half a unit (the file ends in it): one piece
    /// in the open segment in place of the unit's object and pieces, which it covers.
    fn write_small_whole(&self, unit: u64, body: &[u8]) -> SysResult<()> {
        let shared = &self.shared;
        let id = self.id;
        shared.names.records(|r| {
            shared.segments.make_room(r.db())?;
            r.change(|r| {
                r.file_size(id)?;
                let db = r.db();
                sql(drop_data(db, &shared.segments, "file = ?1 AND unit = ?2", &[id as i64, unit as i64]))?;
                shared.segments.append(db, id, unit, 0, body)?;
                r.set_file_size(id, unit * shared.unit_bytes + body.len() as u64, true)
            })
        })
    }
}

impl FileData for S3FileData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        let shared = &self.shared;
        let u = shared.unit_bytes;
        // A view read, then its objects fetched without the namespace locked: a checkpoint
        // may delete a generation or segment dropped in between. The view has changed then;
        // read it again.
        for _ in 0..3 {
            let (size, records, pieces) = shared.view(self.id, offset..offset.saturating_add(buf.len() as u64))?;
            if offset >= size || buf.is_empty() {
                return Ok(0);
            }
            let n = (buf.len() as u64).min(size - offset) as usize;
            let end = offset + n as u64;
            let out = &mut buf[..n];
            out.fill(0);
            let mut missing = false;
            for Record { unit, generation, length } in records {
                let start = unit * u;
                let (a, b) = (start.max(offset), (start + length).min(end));
                if a >= b {
                    continue;
                }
                let key = shared.layout.unit_key(self.id, unit, generation);
                if !shared.fetch(&key, a - start..b - start, &mut out[(a - offset) as usize..(b - offset) as usize])? {
                    missing = true;
                    break;
                }
            }
            if missing {
                continue;
            }
            // Pieces are newer than their unit's object (a whole write drops them): over it, in
            // their order. Their bytes in the bucket are fetched first, one GET per run of
            // nearby pieces of one segment (a checkpoint packs a unit's pieces side by side).
            let clipped = |piece: &Piece| {
                let start = piece.unit * u + piece.start;
                let (a, b) = (start.max(offset), (start + piece.length).min(end));
                (a < b).then_some((start, a, b))
            };
            let wanted = pieces.iter().filter(|p| p.held.is_none()).filter_map(|p| {
                let (start, a, b) = clipped(p)?;
                Some((p.segment, p.offset + (a - start)..p.offset + (b - start)))
            });
            let Some(fetched) = shared.fetch_spans(wanted)? else { continue };
            for piece in &pieces {
                let Some((start, a, b)) = clipped(piece) else { continue };
                let into = &mut out[(a - offset) as usize..(b - offset) as usize];
                match &piece.held {
                    Some(bytes) => into.copy_from_slice(&bytes[(a - start) as usize..(b - start) as usize]),
                    None => into.copy_from_slice(fetched.bytes(piece.segment, piece.offset + (a - start), b - a)),
                }
            }
            return Ok(n);
        }
        log::error!("s3 backend: file {}: an object its records name is not in the bucket", self.id);
        Err(Errno(libc::EIO))
    }

    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let shared = &self.shared;
        let u = shared.unit_bytes;
        assert_eq!(unit.unit_bytes, u, "a unit of another size than the store's");
        let limit = unit.limit();
        if limit == 0 {
            return Ok(()); // wholly past the file's end: nothing of it is data
        }
        if unit.ranges.covers(0, limit) {
            assert!(unit.buf.len() as u64 >= limit, "a whole unit's buffer shorter than the unit's bytes");
            let body = &unit.buf[..limit as usize];
            // A small file (or a file's short last unit) is packed like a piece: a PUT of its
            // own would cost the engine more than its bytes.
            return if limit < u / 2 {
                self.write_small_whole(unit.unit, body)
            } else {
                self.write_whole(unit.unit, body)
            };
        }
        // A partial unit's buffer may end after its last dirty range (the engine's buffer for
        // it grows as far as it was written).
        let dirty: Vec<Range<u64>> =
            unit.ranges.iter().map(|r| r.start..r.end.min(limit)).filter(|r| !r.is_empty()).collect();
        assert!(
            dirty.iter().all(|r| r.end <= unit.buf.len() as u64),
            "a dirty range past its unit's buffer ({} bytes): {dirty:?}",
            unit.buf.len()
        );
        let dirty_bytes: u64 = dirty.iter().map(|r| r.end - r.start).sum();
        let id = self.id;
        let (pieces, piece_bytes) = shared.names.records(|r| shared.segments.unit_load(r.db(), id, unit.unit))?;
        if piece_bytes + dirty_bytes >= u / 2 || pieces + dirty.len() as u64 > MAX_PIECES_PER_UNIT {
            // Mostly dirty, or in too many pieces: read what the store holds, put it whole.
            let mut merged = vec![0u8; limit as usize];
            let read = self.read_at(&mut merged, unit.start())?;
            shared.metrics.backend_read_bytes_for_writes.fetch_add(read as u64, Relaxed);
            shared.metrics.s3_units_folded.fetch_add(1, Relaxed);
            for r in &dirty {
                let (a, b) = (r.start as usize, r.end as usize);
                merged[a..b].copy_from_slice(&unit.buf[a..b]);
            }
            return self.write_whole(unit.unit, &merged);
        }
        shared.names.records(|r| {
            shared.segments.make_room(r.db())?;
            r.change(|r| {
                r.file_size(id)?;
                for range in &dirty {
                    let bytes = &unit.buf[range.start as usize..range.end as usize];
                    shared.segments.append(r.db(), id, unit.unit, range.start, bytes)?;
                }
                r.set_file_size(id, unit.start() + limit, true)
            })
        })
    }

    fn set_size(&self, size: u64) -> SysResult<()> {
        let (id, u) = (self.id, self.shared.unit_bytes);
        let segments = &self.shared.segments;
        self.shared.names.records(|r| {
            r.change(|r| {
                r.file_size(id)?;
                let db = r.db();
                let first_gone = size.div_ceil(u) as i64;
                sql(drop_data(db, segments, "file = ?1 AND unit >= ?2", &[id as i64, first_gone]))?;
                if size % u != 0 {
                    // The objects keep their bytes; the records count only those before the end.
                    let keep = (size % u) as i64;
                    sql(sql(db.prepare_cached(
                        "UPDATE s3_units SET length = ?3 WHERE file = ?1 AND unit = ?2 AND length > ?3",
                    ))?
                    .execute(params![id as i64, (size / u) as i64, keep]))?;
                    sql(segments.cut_pieces(db, id, size / u, keep as u64))?;
                }
                r.set_file_size(id, size, false)
            })
        })
    }

    fn size(&self) -> SysResult<u64> {
        self.shared.names.records(|r| r.file_size(self.id))
    }

    /// Hole punching only (`FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`, `holes::Punch`), as the
    /// SQLite store does: the records and pieces of units it covers to their end (or the
    /// file's) are dropped (their objects go after the next manifest), and the bytes of the
    /// units at its ends are written as zeros (pieces, or the unit put again, as any partial
    /// write). Preallocation answers EOPNOTSUPP: a bucket has nothing to reserve, and glibc's
    /// `posix_fallocate` then writes zeros.
    fn allocate(&self, mode: i32, offset: u64, length: u64) -> SysResult<()> {
        if mode != libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE {
            return Err(Errno(libc::EOPNOTSUPP));
        }
        let (id, u) = (self.id, self.shared.unit_bytes);
        let size = self.size()?;
        let Some(punch) = Punch::plan(offset, length, size, u) else { return Ok(()) };
        for (unit, within) in punch.partial {
            let zeros = vec![0u8; within.end as usize];
            self.write_unit(&UnitWrite { unit, unit_bytes: u, buf: &zeros, ranges: &within.into(), size })?;
        }
        let segments = &self.shared.segments;
        self.shared.names.records(|r| {
            r.change(|r| {
                r.file_size(id)?;
                if let Some(whole) = &punch.whole {
                    let values = [id as i64, *whole.start() as i64, *whole.end() as i64];
                    sql(drop_data(r.db(), segments, "file = ?1 AND unit BETWEEN ?2 AND ?3", &values))?;
                }
                r.set_file_size(id, size, true)
            })
        })
    }

    /// SEEK_DATA and SEEK_HOLE, a unit at a time (`holes::seek`): a unit with an object or a
    /// piece is data.
    fn seek(&self, offset: i64, whence: i32) -> SysResult<i64> {
        let u = self.shared.unit_bytes;
        self.shared.names.records(|r| {
            let size = r.file_size(self.id)?;
            let mut stmt = sql(r.db().prepare_cached(
                "SELECT unit FROM s3_units WHERE file = ?1 AND unit >= ?2 AND length > 0 \
                 UNION SELECT unit FROM s3_pieces WHERE file = ?1 AND unit >= ?2 ORDER BY unit",
            ))?;
            let units =
                sql(stmt.query_map(params![self.id as i64, (offset.max(0) as u64 / u) as i64], |row| {
                    row.get::<_, i64>(0)
                }))?;
            holes::seek(offset, whence, size, u, units.map(|unit| sql(unit).map(|unit| unit as u64)))
        })
    }

    /// copy_file_range between two files of this bucket: each unit object the range spans is
    /// copied by the server (`ObjectStore::copy`, CopyObject) under a fresh generation of the
    /// target's unit, so no byte passes through this daemon or FUSE (the kernel read and wrote
    /// every one, a GET and a PUT of each unit, while the store answered ENOSYS); then, in one
    /// change, the target's records and pieces in the range are dropped (a hole copies as a
    /// hole) and the copies recorded. Whole units only (`UnitCopy::plan`), and only units that
    /// are one object: the copy ends before a unit with pieces. What it cannot do answers
    /// EOPNOTSUPP, on which the kernel copies through reads and writes: an unaligned range, a
    /// unit with pieces first, a source written meanwhile, a server that refuses the copy.
    fn copy_to(&self, source_offset: u64, target: &dyn FileData, target_offset: u64, length: u64) -> SysResult<usize> {
        let Some(target) = target.as_any().downcast_ref::<S3FileData>() else {
            return Err(Errno(libc::EOPNOTSUPP));
        };
        if !Arc::ptr_eq(&self.shared, &target.shared) {
            return Err(Errno(libc::EOPNOTSUPP));
        }
        let shared = &self.shared;
        let (source, target, u) = (self.id, target.id, shared.unit_bytes);
        let planned = shared.names.records(|r| {
            let plan = UnitCopy::plan(
                (source_offset, r.file_size(source)?),
                (target_offset, r.file_size(target)?),
                length,
                u,
                COPY_MAX_UNITS * u,
                source == target,
            )?;
            let Some(mut plan) = plan else { return Ok(None) };
            let last = plan.source_first + plan.units - 1;
            if let Some(unit) = first_unit_with_pieces(r.db(), source, plan.source_first, last)? {
                // Its bytes are in segments, not one object: the kernel copies from there.
                plan.units = unit - plan.source_first;
                plan.bytes = plan.units * u;
            }
            if plan.units == 0 {
                return Err(Errno(libc::EOPNOTSUPP));
            }
            let sources = plan.source_first..=plan.source_first + plan.units - 1;
            let records = unit_records(r.db(), source, *sources.start(), *sources.end())?;
            Ok(Some((plan, sources, records)))
        })?;
        let Some((plan, sources, records)) = planned else { return Ok(0) };

        let take_back = |copies: &[Record]| {
            for copy in copies {
                let _ = shared.objects.delete(&shared.layout.unit_key(target, copy.unit, copy.generation));
            }
        };
        // Each copy is a request of its own (17-47 ms on RGW), `COPIES_AT_ONCE` at a time.
        let outcomes: Vec<(Record, String, ObjectResult<bool>)> = std::thread::scope(|scope| {
            let mut outcomes = Vec::with_capacity(records.len());
            for batch in records.chunks(COPIES_AT_ONCE) {
                let copying: Vec<_> = batch
                    .iter()
                    .map(|record| {
                        let unit = record.unit - plan.source_first + plan.target_first;
                        // A fresh generation, copied over without a condition (whether CopyObject
                        // keeps `If-None-Match` was not checked on the servers here): only a
                        // database restored from an older manifest can find its key taken, by
                        // garbage of the writer it lost (`put_unit`).
                        let generation = shared.next_generation(0);
                        let from = shared.layout.unit_key(source, record.unit, record.generation);
                        let to = shared.layout.unit_key(target, unit, generation);
                        scope.spawn(move || {
                            let outcome = shared.objects.copy(&from, &to);
                            (Record { unit, generation, length: record.length }, from, outcome)
                        })
                    })
                    .collect();
                outcomes.extend(copying.into_iter().map(|copy| copy.join().expect("a unit copy panicked")));
            }
            outcomes
        });
        let copies: Vec<Record> =
            outcomes.iter().filter(|(_, _, outcome)| matches!(outcome, Ok(true))).map(|(copy, _, _)| *copy).collect();
        if copies.len() < records.len() {
            for (_, from, outcome) in &outcomes {
                match outcome {
                    Ok(true) => {}
                    Err(e) => log::warn!("s3 backend: {e}; the kernel copies through reads and writes"),
                    // Gone: the unit was written again and a checkpoint deleted this object.
                    Ok(false) => log::debug!("s3 backend: {from} went while it was copied"),
                }
            }
            take_back(&copies);
            return Err(Errno(libc::EOPNOTSUPP));
        }

        let (first, last) = (plan.target_first, plan.target_first + plan.units - 1);
        let recorded = shared.names.records(|r| {
            r.change(|r| {
                r.file_size(target)?;
                let db = r.db();
                // The source as it was when its objects were chosen, or the copy is not made.
                let now = unit_records(db, source, *sources.start(), *sources.end())?;
                let unchanged = now.len() == records.len()
                    && now.iter().zip(&records).all(|(a, b)| (a.unit, a.generation) == (b.unit, b.generation))
                    && first_unit_with_pieces(db, source, *sources.start(), *sources.end())?.is_none();
                if !unchanged {
                    return Ok(false);
                }
                let values = [target as i64, first as i64, last as i64];
                sql(drop_data(db, &shared.segments, "file = ?1 AND unit BETWEEN ?2 AND ?3", &values))?;
                let mut insert = sql(
                    db.prepare_cached("INSERT INTO s3_units(file, unit, generation, length) VALUES(?1, ?2, ?3, ?4)")
                )?;
                for copy in &copies {
                    sql(insert.execute(params![
                        target as i64,
                        copy.unit as i64,
                        copy.generation as i64,
                        copy.length as i64
                    ]))?;
                }
                r.set_file_size(target, target_offset + plan.bytes, true)?;
                Ok(true)
            })
        });
        if !matches!(recorded, Ok(true)) {
            // Named by no record: taken back rather than left to no one. A source written
            // meanwhile is left to the kernel.
            take_back(&copies);
            return Err(recorded.err().unwrap_or(Errno(libc::EOPNOTSUPP)));
        }
        let bytes: u64 = copies.iter().map(|copy| copy.length).sum();
        shared.metrics.backend_copied_bytes.fetch_add(bytes, Relaxed);
        Ok(plan.bytes as usize)
    }

    fn sync(&self, _data_only: bool) -> SysResult<()> {
        self.shared.names.records(|r| r.commit())
    }

    fn holds_data(&self) -> bool {
        self.shared
            .names
            .records(|r| {
                let found: Option<i64> = sql(sql(r.db().prepare_cached(
                    "SELECT 1 FROM s3_units WHERE file = ?1 UNION ALL SELECT 1 FROM s3_pieces WHERE file = ?1 LIMIT 1",
                ))?
                .query_row([self.id as i64], |row| row.get(0))
                .optional())?;
                Ok(found.is_some())
            })
            .unwrap_or(true)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
