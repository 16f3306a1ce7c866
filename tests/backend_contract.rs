//! The backend contract's capabilities (`backend`, "The contract") as the engine reads them: a
//! store that lacks what the intent log needs is refused when the engine starts with the log,
//! with a message naming what it lacks, and served without the log.

use std::sync::Arc;
use std::time::Duration;

use coalescefs::backend::memory::MemoryBackend;
use coalescefs::backend::{Capabilities, FileData, OpenMode, UnitStore};
use coalescefs::engine::intent_log::device::MemoryLogDevice;
use coalescefs::engine::intent_log::format::LOG_BLOCK_BYTES;
use coalescefs::engine::types::ObjectId;
use coalescefs::engine::writeback::WritebackConfig;
use coalescefs::engine::{Engine, EngineConfig, LogCloses, LogSetup, PageCache};
use coalescefs::metrics::Metrics;
use coalescefs::sys::SysResult;

const UNIT: u64 = 16 << 10;

/// The memory store's data, under capabilities a test chooses.
struct Declaring {
    store: Arc<MemoryBackend>,
    capabilities: Capabilities,
}

impl UnitStore for Declaring {
    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn open(&self, id: ObjectId, mode: OpenMode) -> SysResult<Arc<dyn FileData>> {
        self.store.open(id, mode)
    }

    fn sync_all(&self) -> SysResult<()> {
        self.store.sync_all()
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        block_size_bytes: UNIT as u32,
        writeback: WritebackConfig {
            unit_bytes: UNIT,
            logical_block_bytes: 512,
            buffer_bytes: 64 * UNIT,
            flushers: 1,
            flush_age: Duration::from_millis(20),
            log_threshold_bytes: 64 << 10,
            log_threshold_new_bytes: 24 << 10,
            log_closes: LogCloses::Always,
            burst_gap: coalescefs::engine::burst::BURST_GAP,
            checkpoint_interval: Duration::from_secs(3600),
            io_timeout: Duration::from_secs(10),
        },
        page_cache: PageCache::Off,
        hidden_name: None,
        hidden_root_xattr: None,
    }
}

fn start(change: impl Fn(&mut Capabilities), log: bool) -> Result<Engine, String> {
    let memory = Arc::new(MemoryBackend::new(UNIT));
    let mut capabilities = memory.capabilities().clone();
    change(&mut capabilities);
    let store = Arc::new(Declaring { store: memory.clone(), capabilities });
    let setup = log.then(|| LogSetup {
        device: Box::new(Arc::new(MemoryLogDevice::new(64 * LOG_BLOCK_BYTES as u64, 512))),
        created: true,
        flushed_by_backend: false,
    });
    Engine::new(memory, store, config(), Arc::new(Metrics::default()), setup)
}

#[test]
fn a_store_that_does_not_keep_engine_chosen_ids_is_refused_with_the_log_and_served_without() {
    let refused = start(|c| c.keeps_chosen_ids = false, true).err().expect("refused with the log");
    assert!(refused.contains("engine-chosen ids") && refused.contains("log=off"), "{refused}");
    assert!(!refused.contains("orders name changes"), "it lacks only one thing: {refused}");
    start(|c| c.keeps_chosen_ids = false, false).expect("served without the log").abandon();
}

#[test]
fn a_store_whose_sync_does_not_order_name_changes_is_refused_with_the_log() {
    let refused = start(|c| c.sync_orders_names = false, true).err().expect("refused with the log");
    assert!(refused.contains("a sync that orders name changes"), "{refused}");
    start(|_| {}, true).expect("the memory store has what the log needs").abandon();
}
