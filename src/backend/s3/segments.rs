//! Packed segments: the dirty pieces of units that are mostly clean, many files' and units'
//! pieces packed into one object, so that scattered small writes do not put whole units.
//!
//! - A partial unit write (the engine's ranges not covering the unit) appends each range to
//!   the *open segment*, a buffer in memory, and records it as a *piece* in the namespace's
//!   open transaction: (file, unit, seq) -> bytes `[start, start + length)` of the unit, at
//!   `offset` of segment `segment`. A unit's pieces apply over its unit object in `seq` order.
//! - The open segment is put (`PREFIX/segments/<id>`, `If-None-Match: *`) before any commit of
//!   the transaction that records its pieces (`UnitRecords::before_commit`), and by the next
//!   write once it holds `SEGMENT_BYTES` (`make_room`): no committed record ever names a segment
//!   the bucket lacks.
//! - A unit written whole drops its pieces; a unit whose pieces would reach half of it (or
//!   `MAX_PIECES_PER_UNIT`) is *folded*: read, merged with the write and put whole (the store
//!   decides this, at its boundary: the engine only says which ranges are dirty). A segment
//!   whose pieces are all gone is dropped as a unit generation is, and deleted once a manifest
//!   that no longer names it is in the bucket.
//!
//! Tables (`store::TABLES`): `s3_pieces(file, unit, seq, start, length, segment, offset)` and
//! `s3_dropped_segments(segment)`.
//!
//! Every call here runs with the namespace's lock held (inside `SqliteBackend::records` or a
//! commit); the open segment's own lock is taken after it, never before.

use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use rusqlite::{params, params_from_iter, Connection};

use super::layout::Layout;
use super::objects::{ObjectStore, PutCondition, PutOutcome};
use super::store::{object_errno, sql, Generations};
use crate::metrics::Metrics;
use crate::sys::{Errno, SysResult};

/// An open segment is put once it holds this much: big enough that its PUT's fixed cost (40-120
/// KB on Ceph) is small beside it, small enough to keep in memory beside the write buffer.
pub const SEGMENT_BYTES: usize = 8 << 20;
/// A unit with more pieces than this is folded at its next partial write. 512: 4 KiB pieces
/// reach half a 4 MiB unit first, so a fold puts about two bytes per byte of pieces (at 128 it
/// was eight: 1,000 random 4 KiB writes a run into a 64 MiB file folded every unit in the third
/// run, 25.7x at Ceph's OSDs, bench/results/2026-11-29-s3-manifest-pages). A read GETs the
/// pieces it overlaps, one GET per run of them side by side in a segment.
pub const MAX_PIECES_PER_UNIT: u64 = 512;
/// Tries of a segment put whose key is taken (garbage of a writer whose database was lost).
const PUT_TRIES: u64 = 16;

/// What putting a segment takes; given once the store opens (the namespace opens first).
pub struct Sink {
    pub objects: Arc<dyn ObjectStore>,
    pub layout: Layout,
    pub metrics: Arc<Metrics>,
    pub generations: Arc<Generations>,
}

/// The segment being filled: its id (a generation) and its bytes so far.
struct OpenSegment {
    id: u64,
    bytes: Vec<u8>,
}

/// One piece of a unit: where its bytes are.
#[derive(Clone, Debug)]
pub struct Piece {
    pub unit: u64,
    /// Within the unit.
    pub start: u64,
    pub length: u64,
    pub segment: u64,
    pub offset: u64,
    /// The piece's bytes when its segment is still open (not in the bucket yet).
    pub held: Option<Vec<u8>>,
}

#[derive(Default)]
pub struct Segments {
    sink: OnceLock<Sink>,
    open: Mutex<Option<OpenSegment>>,
}

impl Segments {
    pub fn connect(&self, sink: Sink) {
        assert!(self.sink.set(sink).is_ok(), "segments connected twice");
    }

    fn sink(&self) -> &Sink {
        self.sink.get().expect("segments used before their store opened")
    }

    fn open(&self) -> MutexGuard<'_, Option<OpenSegment>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `bytes` as the next piece of `unit` of `file`, at `start` within the unit, and
    /// appends them to the open segment. Inside the open transaction.
    pub fn append(&self, db: &Connection, file: u64, unit: u64, start: u64, bytes: &[u8]) -> SysResult<()> {
        assert!(!bytes.is_empty(), "an empty piece");
        let mut open = self.open();
        let segment = match open.as_mut() {
            Some(segment) => segment,
            None => open.insert(OpenSegment { id: self.sink().generations.next(0), bytes: Vec::new() }),
        };
        let seq: i64 = sql(db
            .prepare_cached("SELECT coalesce(max(seq), 0) + 1 FROM s3_pieces WHERE file = ?1 AND unit = ?2")
            .and_then(|mut s| s.query_row(params![file as i64, unit as i64], |r| r.get(0))))?;
        sql(db
            .prepare_cached(
                "INSERT INTO s3_pieces(file, unit, seq, start, length, segment, offset) \
                 VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    file as i64,
                    unit as i64,
                    seq,
                    start as i64,
                    bytes.len() as i64,
                    segment.id as i64,
                    segment.bytes.len() as i64
                ])
            }))?;
        segment.bytes.extend_from_slice(bytes);
        Ok(())
    }

    /// Room for more pieces: an open segment that holds `SEGMENT_BYTES` is put first. Called
    /// before a write appends anything, so a put that fails fails that write alone (the engine
    /// keeps its data and tries again): while the server is away the open segment stays
    /// within `SEGMENT_BYTES` and one write's pieces, and memory within the write buffer's bound.
    pub fn make_room(&self, db: &Connection) -> SysResult<()> {
        if self.open().as_ref().is_some_and(|s| s.bytes.len() >= SEGMENT_BYTES) {
            self.seal(db)?;
        }
        Ok(())
    }

    /// Puts the open segment, if any, so that the records naming it may commit. A put that
    /// fails keeps it open (and the commit waiting) for the next try. Inside the transaction.
    pub fn seal(&self, db: &Connection) -> SysResult<()> {
        let mut open = self.open();
        let Some(segment) = open.as_mut() else {
            return Ok(());
        };
        let sink = self.sink();
        let mut tries = 0;
        loop {
            let key = sink.layout.segment_key(segment.id);
            match sink.objects.put(&key, &segment.bytes, PutCondition::IfAbsent).map_err(object_errno)? {
                PutOutcome::Written => break,
                PutOutcome::AlreadyThere if tries + 1 < PUT_TRIES => {
                    // Left by a writer whose database was lost: never overwritten; its pieces
                    // move to a fresh id.
                    tries += 1;
                    let fresh = sink.generations.next(tries * 64);
                    log::warn!(
                        "s3 backend: {key} is already in the bucket (left by an earlier writer); trying further on"
                    );
                    sql(db
                        .prepare_cached("UPDATE s3_pieces SET segment = ?2 WHERE segment = ?1")
                        .and_then(|mut s| s.execute(params![segment.id as i64, fresh as i64])))?;
                    segment.id = fresh;
                }
                PutOutcome::AlreadyThere => {
                    log::error!("s3 backend: no free segment key in {PUT_TRIES} tries");
                    return Err(Errno(libc::EIO));
                }
            }
        }
        let (id, length) = (segment.id, segment.bytes.len() as u64);
        *open = None;
        drop(open);
        sink.metrics.backend_write_bytes.fetch_add(length, Relaxed);
        sink.metrics.backend_write_requests.fetch_add(1, Relaxed);
        sink.metrics.backend_write_sizes.record(length);
        sink.metrics.s3_segments_put.fetch_add(1, Relaxed);
        log::debug!("s3 backend: segment {id:016x} put, {length} bytes");
        // Its pieces may all have gone while it was open.
        drop_if_unnamed(db, id)
    }

    /// How many bytes the open segment holds (none open: 0).
    pub fn open_bytes(&self) -> usize {
        self.open().as_ref().map_or(0, |s| s.bytes.len())
    }

    /// The bytes `range` of the open segment `id`; None once it is no longer open.
    fn held(&self, id: u64, range: Range<u64>) -> Option<Vec<u8>> {
        let open = self.open();
        let segment = open.as_ref().filter(|s| s.id == id)?;
        let (a, b) = (range.start as usize, range.end as usize);
        assert!(a <= b && b <= segment.bytes.len(), "a piece past its open segment's end");
        Some(segment.bytes[a..b].to_vec())
    }

    /// The pieces of units `first..=last` of `file`, in unit and then application order; those
    /// in the open segment with their bytes. Pieces that do not reach into `within` (bytes of
    /// the file) are left out.
    pub fn pieces(
        &self,
        db: &Connection,
        file: u64,
        first: u64,
        last: u64,
        unit_bytes: u64,
        within: Range<u64>,
    ) -> SysResult<Vec<Piece>> {
        let mut stmt = sql(db.prepare_cached(
            "SELECT unit, start, length, segment, offset FROM s3_pieces \
             WHERE file = ?1 AND unit BETWEEN ?2 AND ?3 ORDER BY unit, seq",
        ))?;
        let rows = sql(stmt.query_map(params![file as i64, first as i64, last as i64], |r| {
            Ok(Piece {
                unit: r.get::<_, i64>(0)? as u64,
                start: r.get::<_, i64>(1)? as u64,
                length: r.get::<_, i64>(2)? as u64,
                segment: r.get::<_, i64>(3)? as u64,
                offset: r.get::<_, i64>(4)? as u64,
                held: None,
            })
        }))?;
        let mut pieces = Vec::new();
        for piece in rows {
            let mut piece = sql(piece)?;
            let begins = piece.unit * unit_bytes + piece.start;
            if begins >= within.end || begins + piece.length <= within.start {
                continue;
            }
            piece.held = self.held(piece.segment, piece.offset..piece.offset + piece.length);
            pieces.push(piece);
        }
        Ok(pieces)
    }

    /// How many pieces `unit` of `file` has, and their bytes (overlaps counted twice).
    pub fn unit_load(&self, db: &Connection, file: u64, unit: u64) -> SysResult<(u64, u64)> {
        sql(db
            .prepare_cached("SELECT count(*), coalesce(sum(length), 0) FROM s3_pieces WHERE file = ?1 AND unit = ?2")
            .and_then(|mut s| {
                s.query_row(params![file as i64, unit as i64], |r| {
                    Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64))
                })
            }))
    }

    /// Deletes the pieces `condition` (SQL over `s3_pieces`, its parameters `values`) selects;
    /// a segment (other than the open one) left naming no piece is dropped.
    pub fn delete_pieces(&self, db: &Connection, condition: &str, values: &[i64]) -> rusqlite::Result<()> {
        let segments: Vec<i64> = {
            let mut stmt = db.prepare_cached(&format!("SELECT DISTINCT segment FROM s3_pieces WHERE {condition}"))?;
            let rows = stmt.query_map(params_from_iter(values), |r| r.get(0))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        if segments.is_empty() {
            return Ok(());
        }
        db.prepare_cached(&format!("DELETE FROM s3_pieces WHERE {condition}"))?.execute(params_from_iter(values))?;
        let open = self.open().as_ref().map(|s| s.id as i64);
        for segment in segments.into_iter().filter(|&s| Some(s) != open) {
            drop_if_unnamed_sql(db, segment as u64)?;
        }
        Ok(())
    }

    /// Shortens the pieces of `unit` of `file` to the unit's first `keep` bytes (a truncate
    /// inside the unit): those wholly past go, one across it is cut.
    pub fn cut_pieces(&self, db: &Connection, file: u64, unit: u64, keep: u64) -> rusqlite::Result<()> {
        let (file, unit, keep) = (file as i64, unit as i64, keep as i64);
        self.delete_pieces(db, "file = ?1 AND unit = ?2 AND start >= ?3", &[file, unit, keep])?;
        db.prepare_cached(
            "UPDATE s3_pieces SET length = ?3 - start WHERE file = ?1 AND unit = ?2 AND start + length > ?3",
        )?
        .execute(params![file, unit, keep])?;
        Ok(())
    }
}

fn drop_if_unnamed_sql(db: &Connection, segment: u64) -> rusqlite::Result<()> {
    db.prepare_cached(
        "INSERT OR IGNORE INTO s3_dropped_segments(segment) \
         SELECT ?1 WHERE NOT EXISTS (SELECT 1 FROM s3_pieces WHERE segment = ?1)",
    )?
    .execute([segment as i64])?;
    Ok(())
}

fn drop_if_unnamed(db: &Connection, segment: u64) -> SysResult<()> {
    sql(drop_if_unnamed_sql(db, segment))
}
