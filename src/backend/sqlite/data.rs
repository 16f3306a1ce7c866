//! The SQLite backend's data: a file's units as rows, `FileData` and `UnitStore`.

use super::*;
use crate::backend::holes::{self, Punch, UnitCopy};

/// A file's data in the database.
struct SqliteFileData {
    inner: Arc<Mutex<Inner>>,
    metrics: Arc<Metrics>,
    id: ObjectId,
    unit_bytes: u64,
    _hold: FileHold,
}

impl FileData for SqliteFileData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        let s = lock(&self.inner);
        let size = s.object(self.id)?.size;
        if offset >= size || buf.is_empty() {
            return Ok(0);
        }
        let n = (buf.len() as u64).min(size - offset) as usize;
        let buf = &mut buf[..n];
        buf.fill(0);
        let (first, last) = (offset / self.unit_bytes, (offset + n as u64 - 1) / self.unit_bytes);
        // A unit's rows replaced in the open transaction are passed by (`SupersededRows`);
        // where there are none (always in WAL mode and read-only, where a version 1 table has
        // no row ids), the rows are the units.
        let sql = if s.superseded.is_empty() {
            "SELECT 0, unit, data FROM units WHERE file = ?1 AND unit BETWEEN ?2 AND ?3"
        } else {
            "SELECT rowid, unit, data FROM units WHERE file = ?1 AND unit BETWEEN ?2 AND ?3"
        };
        let mut stmt = s.db.prepare_cached(sql).sql()?;
        let rows = stmt
            .query_map(params![sql_id(self.id), first as i64, last as i64], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)? as u64, r.get::<_, Vec<u8>>(2)?))
            })
            .sql()?;
        for row in rows {
            let (row, unit, data) = row.sql()?;
            if s.superseded.contains(row) {
                continue;
            }
            let start = unit * self.unit_bytes;
            // The overlap of [start, start + len) with [offset, offset + n).
            let a = start.max(offset);
            let b = (start + data.len() as u64).min(offset + n as u64);
            if a < b {
                buf[(a - offset) as usize..(b - offset) as usize]
                    .copy_from_slice(&data[(a - start) as usize..(b - start) as usize]);
            }
        }
        Ok(n)
    }

    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let limit = unit.limit();
        // The store's rule, at its boundary: a whole unit (up to the file's end) or nothing.
        if !unit.ranges.covers(0, limit) {
            log::error!("sqlite backend: a partial unit for a store of whole units: {:?}", unit.ranges);
            return Err(Errno(libc::EIO));
        }
        let id = self.id;
        let mut s = locked_for_change(&self.inner)?;
        s.change(|s| {
            let o = s.object(id)?;
            if o.kind != Kind::File {
                return Err(Errno(libc::EISDIR));
            }
            s.replace_unit(id, unit.unit)?;
            s.db.prepare_cached("INSERT INTO units(file, unit, data) VALUES(?1, ?2, ?3)")
                .sql()?
                .execute(params![sql_id(id), unit.unit as i64, &unit.buf[..limit as usize]])
                .sql()?;
            s.set_file_size(id, unit.start() + limit, true)
        })?;
        s.wrote(limit)?;
        drop(s);
        self.metrics.backend_write_bytes.fetch_add(limit, Relaxed);
        self.metrics.backend_write_requests.fetch_add(1, Relaxed);
        self.metrics.backend_write_sizes.record(limit);
        Ok(())
    }

    fn set_size(&self, size: u64) -> SysResult<()> {
        let (id, u) = (self.id, self.unit_bytes);
        change_waiting(&self.inner, |s| {
            // Units wholly past the end go; the one the end falls in is cut there (a row of
            // its own, as a unit written again).
            s.replace_units_from(id, size.div_ceil(u))?;
            let keep = size % u;
            if let Some((row, len)) = s.unit_row(id, size / u)?.filter(|&(_, len)| keep != 0 && len > keep) {
                if s.journal == Journal::Rollback && len > s.replaced_at_commit_above {
                    s.db.prepare_cached(
                        "INSERT INTO units(file, unit, data) SELECT file, unit, substr(data, 1, ?2) FROM units \
                         WHERE rowid = ?1",
                    )
                    .sql()?
                    .execute(params![row, keep as i64])
                    .sql()?;
                    s.superseded.replace(id, row);
                } else {
                    s.db.prepare_cached("UPDATE units SET data = substr(data, 1, ?2) WHERE rowid = ?1")
                        .sql()?
                        .execute(params![row, keep as i64])
                        .sql()?;
                }
            }
            s.set_file_size(id, size, false)
        })
    }

    fn size(&self) -> SysResult<u64> {
        Ok(lock(&self.inner).object(self.id)?.size)
    }

    /// Hole punching only (`FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`, `holes::Punch`): the
    /// rows of units it covers to their end (or the file's) go, and its bytes are cut out of
    /// the rows of the units at its ends. Preallocation (mode 0, `KEEP_SIZE`, `ZERO_RANGE`)
    /// answers EOPNOTSUPP: a database reserves no pages for rows not yet written, so the
    /// promise that later writes find room could not be kept; glibc's `posix_fallocate` then
    /// writes zeros, which do take the room. Not ENOSYS: the kernel would send no fallocate
    /// again, holes included, for the rest of the mount.
    fn allocate(&self, mode: i32, offset: u64, length: u64) -> SysResult<()> {
        if mode != libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE {
            return Err(Errno(libc::EOPNOTSUPP));
        }
        let (id, u) = (self.id, self.unit_bytes);
        change_waiting(&self.inner, |s| {
            if let Some(punch) = Punch::plan(offset, length, s.object(id)?.size, u) {
                for (unit, within) in punch.partial {
                    s.zero_in_unit(id, unit, within)?;
                }
                if let Some(whole) = punch.whole {
                    s.replace_rows(id, *whole.start(), *whole.end())?;
                }
            }
            s.touch(id)
        })
    }

    /// SEEK_DATA and SEEK_HOLE, a unit at a time (`holes::seek`): a unit with a live row is
    /// data.
    fn seek(&self, offset: i64, whence: i32) -> SysResult<i64> {
        let s = lock(&self.inner);
        let size = s.object(self.id)?.size;
        let u = self.unit_bytes;
        let mut stmt =
            s.db.prepare_cached(
                "SELECT rowid, unit FROM units WHERE file = ?1 AND unit >= ?2 AND length(data) > 0 ORDER BY unit",
            )
            .sql()?;
        let rows = stmt
            .query_map(params![sql_id(self.id), (offset.max(0) as u64 / u) as i64], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)? as u64))
            })
            .sql()?;
        // Rows of one unit come together: the replaced ones passed by, at most one is live.
        let units_with_data = rows.filter_map(|row| match row {
            Ok((rowid, _)) if s.superseded.contains(rowid) => None,
            Ok((_, unit)) => Some(Ok(unit)),
            Err(e) => Some(Err(errno(e))),
        });
        holes::seek(offset, whence, size, u, units_with_data)
    }

    /// copy_file_range between two files of this database, a row at a time (`UnitCopy::plan`:
    /// whole units, or the source to its end), the bytes never leaving the daemon: where the
    /// kernel would move every byte through FUSE twice, a read and a write
    /// (`cp` copies with it since coreutils 9). The target's rows in the range go first, so a
    /// hole in the source is a hole in the copy. At most `TRANSACTION_MAX_BYTES` a call (a
    /// short count: the kernel asks again for the rest). What whole units cannot do answers
    /// EOPNOTSUPP, on which the kernel copies that range through reads and writes and keeps
    /// asking (ENOSYS would stop it for the mount).
    fn copy_to(&self, source_offset: u64, target: &dyn FileData, target_offset: u64, length: u64) -> SysResult<usize> {
        let Some(target) = target.as_any().downcast_ref::<SqliteFileData>() else {
            return Err(Errno(libc::EOPNOTSUPP));
        };
        if !Arc::ptr_eq(&self.inner, &target.inner) {
            return Err(Errno(libc::EOPNOTSUPP));
        }
        let (source, target, u) = (self.id, target.id, self.unit_bytes);
        let mut s = locked_for_change(&self.inner)?;
        let copied = s.change(|s| {
            let target_object = s.object(target)?;
            if target_object.kind != Kind::File {
                return Err(Errno(libc::EISDIR));
            }
            let plan = UnitCopy::plan(
                (source_offset, s.object(source)?.size),
                (target_offset, target_object.size),
                length,
                u,
                TRANSACTION_MAX_BYTES,
                source == target,
            )?;
            let Some(plan) = plan else { return Ok((0, 0)) };
            let source_last = plan.source_first + plan.units - 1;
            s.replace_rows(target, plan.target_first, plan.target_first + plan.units - 1)?;
            let rows: Vec<(i64, u64, u64)> =
                s.db.prepare_cached(
                    "SELECT rowid, unit, length(data) FROM units WHERE file = ?1 AND unit BETWEEN ?2 AND ?3",
                )
                .sql()?
                .query_map(params![sql_id(source), plan.source_first as i64, source_last as i64], |r| {
                    Ok((r.get(0)?, r.get::<_, i64>(1)? as u64, r.get::<_, i64>(2)? as u64))
                })
                .sql()?
                .collect::<Result<_, _>>()
                .sql()?;
            let mut row_bytes = 0;
            for (row, unit, len) in rows {
                if s.superseded.contains(row) || len == 0 {
                    continue;
                }
                // Read, then inserted: `INSERT ... SELECT` from the table it inserts into copies
                // each blob through a temporary table first.
                let data: Vec<u8> =
                    s.db.prepare_cached("SELECT data FROM units WHERE rowid = ?1")
                        .sql()?
                        .query_row([row], |r| r.get(0))
                        .sql()?;
                s.db.prepare_cached("INSERT INTO units(file, unit, data) VALUES(?1, ?2, ?3)")
                    .sql()?
                    .execute(params![sql_id(target), (unit - plan.source_first + plan.target_first) as i64, data])
                    .sql()?;
                row_bytes += len;
            }
            s.set_file_size(target, target_offset + plan.bytes, true)?;
            Ok((plan.bytes, row_bytes))
        });
        // What the call answers (holes included) and what the rows copied hold.
        let (copied, row_bytes) = copied?;
        s.wrote(row_bytes)?;
        drop(s);
        self.metrics.backend_copied_bytes.fetch_add(row_bytes, Relaxed);
        Ok(copied as usize)
    }

    fn sync(&self, _data_only: bool) -> SysResult<()> {
        lock(&self.inner).commit()
    }

    fn holds_data(&self) -> bool {
        let s = lock(&self.inner);
        if s.superseded.is_empty() {
            return s
                .db
                .prepare_cached("SELECT 1 FROM units WHERE file = ?1 LIMIT 1")
                .and_then(|mut stmt| stmt.query_row([sql_id(self.id)], |_| Ok(())).optional())
                .map_or(true, |found| found.is_some());
        }
        let live = s.db.prepare_cached("SELECT rowid FROM units WHERE file = ?1").and_then(|mut stmt| {
            let rows = stmt.query_map([sql_id(self.id)], |r| r.get::<_, i64>(0))?;
            for row in rows {
                if !s.superseded.contains(row?) {
                    return Ok(true);
                }
            }
            Ok(false)
        });
        live.unwrap_or(true)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl UnitStore for SqliteBackend {
    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn open(&self, id: ObjectId, _mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        Ok(Arc::new(SqliteFileData {
            _hold: self.hold_file(id)?,
            inner: self.inner.clone(),
            metrics: self.metrics.clone(),
            id,
            unit_bytes: self.capabilities.unit_bytes,
        }))
    }

    fn sync_all(&self) -> SysResult<()> {
        lock(&self.inner).commit()
    }
}
