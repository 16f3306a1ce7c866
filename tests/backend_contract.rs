//! The backend contract's capabilities (`backend`, "The contract") as the engine reads them: a
//! store that lacks what the intent log needs is refused when the engine starts with the log,
//! with a message naming what it lacks, and served without the log. And the S3 store's failure
//! path under the engine (`FaultyObjects`); its conformance run with crashes is in
//! `tests/engine_model.rs`, beside the SQLite one.

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
            checkpoint_idle: Duration::from_secs(3600),
            io_timeout: Duration::from_secs(10),
        },
        page_cache: PageCache::Off,
        hidden_name: None,
        hidden_root_xattr: None,
        fsync_checkpoints: false,
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
        volatile_tail: None,
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

/// The S3 store under the engine, its objects behind a wrapper that fails puts on purpose: an
/// fsync whose unit cannot be put fails with EIO, and a power cut then keeps what the last
/// fsync that succeeded acknowledged, never a record of an object that is not there; healed,
/// the next fsync makes the new bytes durable.
#[test]
fn an_s3_put_that_fails_fails_the_fsync_and_loses_nothing_acknowledged() {
    use coalescefs::backend::s3::faulty::{FaultPlan, FaultyObjects};
    use coalescefs::backend::s3::layout::Layout;
    use coalescefs::backend::s3::objects::{MemoryObjects, ObjectStore};
    use coalescefs::backend::s3::store::{open_namespace, S3Store};
    use coalescefs::backend::Namespace;
    use coalescefs::engine::types::ROOT_ID;
    use coalescefs::engine::Caller;
    use std::ffi::OsStr;

    let dir = tempfile::tempdir().unwrap();
    let memory: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let faulty = Arc::new(FaultyObjects::new(memory.clone()));
    let open = |objects: Arc<dyn ObjectStore>| {
        let metrics = Arc::new(Metrics::default());
        let names = Arc::new(open_namespace(&dir.path().join("namespace.db"), metrics.clone()).unwrap());
        Arc::new(S3Store::new(names, objects, Layout::new("t"), Some(UNIT), "test".into(), metrics).unwrap())
    };
    let store = open(faulty.clone());
    let mut cfg = config();
    cfg.writeback.io_timeout = Duration::from_secs(2);
    let engine = Engine::new(store.names().clone(), store.clone(), cfg, Arc::new(Metrics::default()), None).unwrap();
    let root = Caller { uid: 0, gid: 0 };
    let (_, opened) = engine.create(ROOT_ID, OsStr::new("f"), 0o644, libc::O_RDWR, root).unwrap();
    let first = vec![1u8; UNIT as usize];
    engine.write(opened.fh, 0, &first, libc::O_RDWR, false, false).unwrap();
    engine.fsync(opened.fh, false).unwrap();

    faulty.set(FaultPlan { puts: Some("/units/".into()), ..FaultPlan::default() });
    let second = vec![2u8; UNIT as usize];
    engine.write(opened.fh, 0, &second, libc::O_RDWR, false, false).unwrap();
    assert_eq!(engine.fsync(opened.fh, false).unwrap_err().0, libc::EIO, "the store's error, not a hang");
    assert!(faulty.failed() > 0);
    assert_eq!(engine.read(opened.fh, 0, UNIT as u32).unwrap(), second, "a reader sees the last write");

    // A power cut now: the database keeps its last commit, the bucket every object.
    let read_after_crash = |store: &Arc<S3Store>| {
        store.names().crash();
        let reopened = open(memory.clone());
        let id = reopened.names().lookup(ROOT_ID, OsStr::new("f")).unwrap().id;
        let data = reopened.open(id, OpenMode::default()).unwrap();
        let mut buf = vec![0u8; UNIT as usize];
        assert_eq!(data.read_at(&mut buf, 0).unwrap(), UNIT as usize);
        buf
    };
    faulty.heal();
    engine.fsync(opened.fh, false).unwrap();
    engine.abandon();
    assert_eq!(read_after_crash(&store), second, "healed, the fsync made the new bytes durable");

    // And the acknowledged bytes survive a cut after a failed fsync.
    let store = open(faulty.clone());
    let engine = Engine::new(
        store.names().clone(),
        store.clone(),
        {
            let mut cfg = config();
            cfg.writeback.io_timeout = Duration::from_secs(2);
            cfg
        },
        Arc::new(Metrics::default()),
        None,
    )
    .unwrap();
    let id = store.names().lookup(ROOT_ID, OsStr::new("f")).unwrap().id;
    let opened = engine.open(id, libc::O_RDWR, false).unwrap();
    faulty.set(FaultPlan { puts: Some("/units/".into()), ..FaultPlan::default() });
    engine.write(opened.fh, 0, &first, libc::O_RDWR, false, false).unwrap();
    assert_eq!(engine.fsync(opened.fh, false).unwrap_err().0, libc::EIO);
    engine.abandon();
    assert_eq!(read_after_crash(&store), second, "the last acknowledged bytes, not the refused ones");
}

/// `fsync=backend` over S3: an fsync returns once the bucket holds the bytes and a manifest
/// naming them (a checkpoint), where by default the intent log answers it and the bucket gets
/// nothing until the next checkpoint.
#[test]
fn with_fsync_backend_an_s3_fsync_puts_the_data_and_a_manifest_before_it_returns() {
    use coalescefs::backend::s3::layout::Layout;
    use coalescefs::backend::s3::objects::{MemoryObjects, ObjectStore};
    use coalescefs::backend::s3::store::{open_namespace, S3Store};
    use coalescefs::engine::types::ROOT_ID;
    use coalescefs::engine::Caller;
    use std::ffi::OsStr;

    for fsync_checkpoints in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
        let metrics = Arc::new(Metrics::default());
        let names = Arc::new(open_namespace(&dir.path().join("namespace.db"), metrics.clone()).unwrap());
        let store = Arc::new(
            S3Store::new(names, objects.clone(), Layout::new("t"), Some(UNIT), "test".into(), metrics).unwrap(),
        );
        let setup = LogSetup {
            device: Box::new(Arc::new(MemoryLogDevice::new(64 * LOG_BLOCK_BYTES as u64, 512))),
            created: true,
            flushed_by_backend: false,
            volatile_tail: None,
        };
        let mut cfg = config();
        cfg.fsync_checkpoints = fsync_checkpoints;
        let engine =
            Engine::new(store.names().clone(), store.clone(), cfg, Arc::new(Metrics::default()), Some(setup)).unwrap();
        let root = Caller { uid: 0, gid: 0 };
        let (_, opened) = engine.create(ROOT_ID, OsStr::new("f"), 0o644, libc::O_RDWR, root).unwrap();
        engine.write(opened.fh, 0, &vec![5u8; 3 * UNIT as usize], libc::O_RDWR, false, false).unwrap();
        engine.fsync(opened.fh, false).unwrap();
        let manifests = |objects: &Arc<dyn ObjectStore>| objects.list("t/manifests/").unwrap().len();
        let units = |objects: &Arc<dyn ObjectStore>| objects.list("t/units/").unwrap().len();
        if fsync_checkpoints {
            assert_eq!((manifests(&objects), units(&objects)), (1, 3), "the fsync was a checkpoint");
        } else {
            assert_eq!(manifests(&objects), 0, "answered by the intent log, nothing in the bucket named yet");
        }
        // A 4 KiB write into a unit the bucket holds: a piece in a segment, and a manifest again.
        engine.write(opened.fh, 4096, &[6u8; 4096], libc::O_RDWR, false, false).unwrap();
        engine.fsync(opened.fh, false).unwrap();
        if fsync_checkpoints {
            assert_eq!(objects.list("t/segments/").unwrap().len(), 1, "the piece, packed");
            assert_eq!(units(&objects), 3, "no unit put again for 4 KiB");
        }
        // An O_DSYNC write is a durability point of its own: a checkpoint too.
        let before = objects.list("t/manifests/").unwrap();
        engine.write(opened.fh, 8192, &[7u8; 4096], libc::O_RDWR | libc::O_DSYNC, false, false).unwrap();
        let after = objects.list("t/manifests/").unwrap();
        assert_eq!(after != before, fsync_checkpoints, "a new manifest exactly when fsync=backend: {after:?}");
        engine.release(opened.fh).unwrap();
        engine.shut_down();
    }
}
