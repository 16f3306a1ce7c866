//! The in-memory unit store: a file's units as the engine wrote them, and what a sync made
//! durable of them.

use super::*;

/// A file's data in the memory store.
struct MemoryFileData {
    state: Arc<Mutex<State>>,
    gate: Arc<WriteGate>,
    id: ObjectId,
    partial_writes: bool,
}

impl Drop for MemoryFileData {
    fn drop(&mut self) {
        let mut s = lock(&self.state);
        if let Some(n) = s.open_handles.get_mut(&self.id) {
            *n = n.saturating_sub(1);
        }
        s.collect(self.id);
    }
}

impl FileData for MemoryFileData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        let s = lock(&self.state);
        let data = s.data.get(&self.id).ok_or(Errno(libc::ESTALE))?;
        let start = (offset as usize).min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }

    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let limit = unit.limit();
        // The store's rule, at its boundary: a whole unit (up to the file's end) or nothing.
        assert!(
            self.partial_writes || unit.ranges.covers(0, limit),
            "a partial unit for a store of whole units: {:?}",
            unit.ranges
        );
        self.gate.pass();
        let mut s = lock(&self.state);
        s.before_change();
        s.unit_writes += 1;
        let data = s.data.get_mut(&self.id).ok_or(Errno(libc::ESTALE))?;
        for r in unit.ranges.iter() {
            let (a, b) = (r.start, r.end.min(limit));
            if a >= b {
                continue;
            }
            let end = (unit.start() + b) as usize;
            if data.len() < end {
                data.resize(end, 0);
            }
            data[(unit.start() + a) as usize..end].copy_from_slice(&unit.buf[a as usize..b as usize]);
        }
        s.touch(self.id);
        Ok(())
    }

    fn set_size(&self, size: u64) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.before_change();
        s.data.get_mut(&self.id).ok_or(Errno(libc::ESTALE))?.resize(size as usize, 0);
        s.touch(self.id);
        Ok(())
    }

    fn size(&self) -> SysResult<u64> {
        Ok(lock(&self.state).data.get(&self.id).ok_or(Errno(libc::ESTALE))?.len() as u64)
    }

    fn sync(&self, _data_only: bool) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.names_durable();
        if s.durable_tree.objects.contains_key(&self.id) {
            let now = s.data.get(&self.id).cloned().ok_or(Errno(libc::ESTALE))?;
            s.durable_data.insert(self.id, now);
        }
        Ok(())
    }

    fn holds_data(&self) -> bool {
        lock(&self.state).data.get(&self.id).is_some_and(|d| !d.is_empty())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl UnitStore for MemoryBackend {
    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn open(&self, id: ObjectId, _mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        let mut s = lock(&self.state);
        if s.object(id)?.kind != Kind::File {
            return Err(Errno(libc::EISDIR));
        }
        *s.open_handles.entry(id).or_insert(0) += 1;
        Ok(Arc::new(MemoryFileData {
            state: self.state.clone(),
            gate: self.gate.clone(),
            id,
            partial_writes: self.capabilities.partial_writes,
        }))
    }

    fn sync_all(&self) -> SysResult<()> {
        let mut s = lock(&self.state);
        s.names_durable();
        s.durable_data = s.data.clone();
        Ok(())
    }
}
