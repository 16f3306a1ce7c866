//! The unit store the engine sees: a held file's data in memory until the backend makes the
//! file, the backend's data for every other file.

use super::*;

/// A held file's data: its body's bytes, or the backend's file once it is made.
struct PendingData {
    file: Arc<PendingFile>,
    pending: Arc<Pending>,
}

impl PendingData {
    fn real(&self) -> Option<Arc<dyn FileData>> {
        self.file.body().real.clone()
    }
}

/// The store's own data behind `data`: a handle opened while memory held its file keeps the
/// held file's data, which goes on to the backend's once the file is made there. For what only
/// the store's data can do with another of its files (`FileData::copy_to`).
pub fn store_data(data: &Arc<dyn FileData>) -> Arc<dyn FileData> {
    match data.as_any().downcast_ref::<PendingData>().and_then(PendingData::real) {
        Some(real) => real,
        None => data.clone(),
    }
}

impl FileData for PendingData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        let body = self.file.body_to_read();
        if let Some(real) = body.real.clone() {
            drop(body);
            return real.read_at(buf, offset);
        }
        let start = (offset as usize).min(body.bytes.len());
        let n = (body.bytes.len() - start).min(buf.len());
        buf[..n].copy_from_slice(&body.bytes[start..start + n]);
        Ok(n)
    }

    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let mut body = self.file.body();
        if let Some(real) = body.real.clone() {
            drop(body);
            return real.write_unit(unit);
        }
        let start = unit.start();
        let limit = unit.limit();
        let before = body.bytes.len();
        for r in unit.ranges.iter() {
            let end = r.end.min(limit);
            if r.start >= end {
                continue;
            }
            let (from, to) = ((start + r.start) as usize, (start + end) as usize);
            if body.bytes.len() < to {
                body.bytes.resize(to, 0);
            }
            body.bytes[from..to].copy_from_slice(&unit.buf[r.start as usize..end as usize]);
        }
        let t = now();
        body.attr.mtime = t;
        body.attr.ctime = t;
        body.changed_since_log = true;
        let lowest = unit.ranges.iter().map(|r| start + r.start).min().unwrap_or(start);
        body.changed_from = body.changed_from.min(lowest);
        let grown = body.bytes.len() - before;
        self.pending.bytes_held.fetch_add(grown as u64, Relaxed);
        Ok(())
    }

    fn set_size(&self, size: u64) -> SysResult<()> {
        let mut body = self.file.body();
        if let Some(real) = body.real.clone() {
            drop(body);
            return real.set_size(size);
        }
        let before = body.bytes.len() as u64;
        body.bytes.resize(size as usize, 0);
        if size >= before {
            self.pending.bytes_held.fetch_add(size - before, Relaxed);
        } else {
            self.pending.bytes_held.fetch_sub(before - size, Relaxed);
        }
        let t = now();
        body.attr.mtime = t;
        body.attr.ctime = t;
        body.changed_since_log = true;
        body.changed_from = body.changed_from.min(size);
        Ok(())
    }

    fn size(&self) -> SysResult<u64> {
        let body = self.file.body_to_read();
        match body.real.clone() {
            Some(real) => {
                drop(body);
                real.size()
            }
            None => Ok(body.bytes.len() as u64),
        }
    }

    /// A held file is made durable by the log (`Writeback::commit_pending`), never here: the
    /// engine routes its fsync and close there before any sync of its data.
    fn sync(&self, data_only: bool) -> SysResult<()> {
        match self.real() {
            Some(real) => real.sync(data_only),
            None => Ok(()),
        }
    }

    fn holds_data(&self) -> bool {
        let body = self.file.body_to_read();
        match body.real.clone() {
            Some(real) => {
                drop(body);
                real.holds_data()
            }
            None => !body.bytes.is_empty(),
        }
    }

    fn allocate(&self, mode: i32, offset: u64, length: u64) -> SysResult<()> {
        // The engine makes the file on the backend before it preallocates (`Engine::make_real`).
        match self.real() {
            Some(real) => real.allocate(mode, offset, length),
            None => Err(Errno(libc::EOPNOTSUPP)),
        }
    }

    fn seek(&self, offset: i64, whence: i32) -> SysResult<i64> {
        let body = self.file.body_to_read();
        if let Some(real) = body.real.clone() {
            drop(body);
            return real.seek(offset, whence);
        }
        // No holes in memory: data everywhere before the end.
        let size = body.bytes.len() as i64;
        if offset < 0 || offset >= size {
            return Err(Errno(libc::ENXIO));
        }
        Ok(if whence == libc::SEEK_DATA { offset } else { size })
    }

    fn copy_to(&self, source_offset: u64, target: &dyn FileData, target_offset: u64, length: u64) -> SysResult<usize> {
        // Both files are on the backend by now (`Engine::make_real`); the target may be one
        // made from a held file, which the store knows only through its data.
        let target = match target.as_any().downcast_ref::<PendingData>() {
            Some(held) => held.real().ok_or(Errno(libc::EOPNOTSUPP))?,
            None => {
                return self.real().ok_or(Errno(libc::EOPNOTSUPP))?.copy_to(
                    source_offset,
                    target,
                    target_offset,
                    length,
                )
            }
        };
        self.real().ok_or(Errno(libc::EOPNOTSUPP))?.copy_to(source_offset, &*target, target_offset, length)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The unit store the engine sees: held files' data in memory, the backend's for the rest.
pub struct PendingStore(pub Arc<Pending>);

impl UnitStore for PendingStore {
    fn capabilities(&self) -> &Capabilities {
        self.0.store.capabilities()
    }

    fn open(&self, id: ObjectId, mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        if let Some(file) = self.0.get(id) {
            // A file being made opens as held: its data goes on to the backend's once made.
            let real = file.body_to_read().real.is_some();
            if !real {
                return Ok(Arc::new(PendingData { file, pending: self.0.clone() }));
            }
        }
        self.0.store.open(id, mode)
    }

    fn sync_all(&self) -> SysResult<()> {
        self.0.store.sync_all()
    }
}
