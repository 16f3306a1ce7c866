//! The null unit store (`-o backend=null`): names, sizes and attributes stay in the local
//! directory (its namespace, and its files' lengths), while the data is counted and discarded:
//! reads give zeros. It measures this machine's FUSE and engine ceiling, as the null-sink
//! server of seed 001 did.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use crate::backend::{Capabilities, FileData, OpenMode, UnitStore, UnitWrite};
use crate::engine::types::ObjectId;
use crate::metrics::Metrics;
use crate::sys::SysResult;

pub struct NullStore {
    /// Where the files' lengths are kept: the local store's files.
    lengths: Arc<dyn UnitStore>,
    capabilities: Capabilities,
    metrics: Arc<Metrics>,
}

impl NullStore {
    pub fn new(lengths: Arc<dyn UnitStore>, metrics: Arc<Metrics>) -> NullStore {
        // The local files' capabilities: their lengths (what the null store keeps) need syncs
        // like any local file's, and the kernel must not be told of copies or preallocation
        // that would put bytes in them.
        let capabilities = Capabilities { copy_ranges: false, allocate: false, ..lengths.capabilities().clone() };
        NullStore { lengths, capabilities, metrics }
    }
}

struct NullFileData {
    lengths: Arc<dyn FileData>,
    metrics: Arc<Metrics>,
}

/// Extensions are serialised, so that two flushers extending one file never shorten it between
/// their size and set_size.
static EXTENDING: Mutex<()> = Mutex::new(());

impl FileData for NullFileData {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> SysResult<usize> {
        self.lengths.read_at(buf, offset)
    }

    fn write_unit(&self, unit: &UnitWrite<'_>) -> SysResult<()> {
        let limit = unit.limit();
        let mut end = 0;
        for r in unit.ranges.iter() {
            let (a, b) = (r.start, r.end.min(limit));
            if a < b {
                self.metrics.backend_write_bytes.fetch_add(b - a, Relaxed);
                self.metrics.backend_write_requests.fetch_add(1, Relaxed);
                self.metrics.backend_write_sizes.record(b - a);
                end = unit.start() + b;
            }
        }
        let _one_at_a_time = EXTENDING.lock().unwrap();
        if self.lengths.size()? < end {
            self.lengths.set_size(end)?;
        }
        Ok(())
    }

    fn set_size(&self, size: u64) -> SysResult<()> {
        self.lengths.set_size(size)
    }

    fn size(&self) -> SysResult<u64> {
        self.lengths.size()
    }

    fn sync(&self, data_only: bool) -> SysResult<()> {
        self.lengths.sync(data_only)
    }

    fn holds_data(&self) -> bool {
        false
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl UnitStore for NullStore {
    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn open(&self, id: ObjectId, mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        Ok(Arc::new(NullFileData { lengths: self.lengths.open(id, mode)?, metrics: self.metrics.clone() }))
    }

    fn sync_all(&self) -> SysResult<()> {
        self.lengths.sync_all()
    }
}
