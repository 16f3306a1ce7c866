//! The S3 backend in-process: its store over `MemoryObjects` (and `FaultyObjects` around it),
//! the namespace database in a temporary state directory.

use std::ffi::OsStr;
use std::sync::Arc;

use super::faulty::{FaultPlan, FaultyObjects};
use super::layout::{Content, Layout, Manifest};
use super::objects::{MemoryObjects, ObjectStore, PutCondition};
use super::S3Mount;
use crate::backend::test_support::read_all;
use crate::backend::{FileData, Namespace, OpenMode, UnitStore, UnitWrite};
use crate::engine::buffer::RangeSet;
use crate::engine::types::{NewObject, Owner, ROOT_ID};
use crate::metrics::Metrics;

const UNIT: u64 = 1 << 20;
const OWNER: Owner = Owner { uid: 1000, gid: 1000 };
const SOURCE: &str = "s3://bucket/tree";

fn layout() -> Layout {
    Layout::new("tree")
}

fn mount(objects: &Arc<dyn ObjectStore>, state: &tempfile::TempDir) -> Result<S3Mount, String> {
    super::open(objects.clone(), layout(), state.path(), Some(UNIT), SOURCE, Arc::new(Metrics::default()))
}

fn write_whole(data: &dyn FileData, bytes: &[u8]) -> crate::sys::SysResult<()> {
    crate::backend::test_support::write_whole(data, UNIT, bytes)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8) ^ (i >> 20) as u8).collect()
}

fn keys(objects: &Arc<dyn ObjectStore>, prefix: &str) -> Vec<String> {
    objects.list(prefix).unwrap().into_iter().map(|l| l.key).collect()
}

fn make_file(m: &S3Mount, name: &str, bytes: &[u8]) -> Arc<dyn FileData> {
    let file = m.names.make(ROOT_ID, OsStr::new(name), NewObject::File { perm: 0o644 }, OWNER).unwrap();
    let data = m.store.open(file.id, OpenMode { write: true, no_atime: false }).unwrap();
    write_whole(&*data, bytes).unwrap();
    data
}

fn read_file(m: &S3Mount, name: &str) -> Vec<u8> {
    let attr = m.names.lookup(ROOT_ID, OsStr::new(name)).unwrap();
    read_all(&*m.store.open(attr.id, OpenMode::default()).unwrap())
}

/// A bucket holding file `f` of two whole units and 4,000 bytes more (`pattern(.., seed)`),
/// checkpointed by a mount of `state` that then let its lease go.
fn bucket_with_one_file(seed: u8) -> (Arc<dyn ObjectStore>, tempfile::TempDir, Vec<u8>) {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let bytes = pattern(2 * UNIT as usize + 4000, seed);
    let m = mount(&objects, &state).unwrap();
    make_file(&m, "f", &bytes);
    m.store.sync_all().unwrap();
    m.lease.release().unwrap();
    (objects, state, bytes)
}

#[test]
fn units_are_objects_written_whole_short_last_units_packed_and_a_remount_reads_them_back() {
    let (objects, state, bytes) = bucket_with_one_file(1);
    let units = keys(&objects, "tree/units/");
    assert_eq!(units.len(), 2, "{units:?}");
    let sizes: Vec<u64> = objects.list("tree/units/").unwrap().iter().map(|l| l.size).collect();
    assert_eq!(sizes, [UNIT, UNIT], "whole units");
    assert_eq!(bucket_bytes(&objects, "tree/segments/"), 4000, "the short last unit packed into a segment");
    assert_eq!(keys(&objects, "tree/manifests/").len(), 1);
    assert!(objects.head("tree/lease").unwrap().is_none(), "released");

    let m = mount(&objects, &state).unwrap();
    assert_eq!(m.restored_from, None, "the state directory's own database");
    assert_eq!(read_file(&m, "f"), bytes);
}

#[test]
fn a_hole_reads_as_zeros_and_truncate_drops_records() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let data = make_file(&m, "f", &pattern(UNIT as usize, 2));
    data.set_size(3 * UNIT + 10).unwrap();
    let mut expected = pattern(UNIT as usize, 2);
    expected.resize(3 * UNIT as usize + 10, 0);
    assert_eq!(read_all(&*data), expected);
    data.set_size(100).unwrap();
    data.set_size(UNIT).unwrap();
    let mut expected = pattern(100, 2);
    expected.resize(UNIT as usize, 0);
    assert_eq!(read_all(&*data), expected, "bytes past a cut read as zeros, though the object keeps them");
    data.set_size(0).unwrap();
    assert!(!data.holds_data());
}

#[test]
fn dropped_generations_go_only_after_the_manifest_that_no_longer_names_them() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let data = make_file(&m, "f", &pattern(UNIT as usize, 3));
    m.store.sync_all().unwrap();
    let first = keys(&objects, "tree/units/");
    write_whole(&*data, &pattern(UNIT as usize, 4)).unwrap();
    let both = keys(&objects, "tree/units/");
    assert_eq!(both.len(), 2, "a new generation, the old one not overwritten: {both:?}");
    assert!(both.contains(&first[0]), "the old generation stays until a manifest drops it");
    m.store.sync_all().unwrap();
    let after = keys(&objects, "tree/units/");
    assert_eq!(after.len(), 1);
    assert_ne!(after, first);
    let manifests = keys(&objects, "tree/manifests/");
    assert_eq!(manifests.len(), 2, "the whole database, then the pages that changed over it: {manifests:?}");
    assert_eq!(manifest(&objects, &manifests[1]).base(), Some(1));
    let id = m.names.lookup(ROOT_ID, OsStr::new("f")).unwrap().id;
    m.names.remove(ROOT_ID, OsStr::new("f"), false).unwrap();
    drop(data);
    m.names.forget(id, 2); // make's lookup and this test's
    assert_eq!(keys(&objects, "tree/units/").len(), 1, "a removed file's units stay until the next manifest");
    m.store.sync_all().unwrap();
    assert_eq!(keys(&objects, "tree/units/").len(), 0);
}

#[test]
fn a_manifest_over_one_puts_bound_fails_the_checkpoint_and_deletes_nothing() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let data = make_file(&m, "f", &pattern(UNIT as usize, 3));
    m.store.sync_all().unwrap();
    let manifests = keys(&objects, "tree/manifests/");
    write_whole(&*data, &pattern(UNIT as usize, 4)).unwrap();
    let units = keys(&objects, "tree/units/");
    assert_eq!(units.len(), 2, "the new generation and the one the manifest names");
    m.store.set_manifest_max_bytes(1000);
    assert_eq!(m.store.sync_all().unwrap_err().0, libc::EFBIG);
    assert_eq!(keys(&objects, "tree/manifests/"), manifests, "no manifest put");
    assert_eq!(keys(&objects, "tree/units/"), units, "the dropped generation stays: the manifest names it");
    m.store.set_manifest_max_bytes(super::store::MANIFEST_MAX_BYTES);
    m.store.sync_all().unwrap();
    assert_ne!(keys(&objects, "tree/manifests/"), manifests);
    assert_eq!(keys(&objects, "tree/units/").len(), 1);
}

fn manifest(objects: &Arc<dyn ObjectStore>, key: &str) -> Manifest {
    Manifest::decode(&objects.get(key, None).unwrap().unwrap()).unwrap()
}

#[test]
fn manifests_of_pages_follow_a_whole_one_and_another_machine_reads_the_tree_through_them() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let metrics = Arc::new(Metrics::default());
    let m = super::open(objects.clone(), layout(), state.path(), Some(UNIT), SOURCE, metrics.clone()).unwrap();
    // Enough files that the database is many pages, then one more file per checkpoint.
    for i in 0..2000 {
        make_file(&m, &format!("base-{i}"), &pattern(100, i as u8));
    }
    m.store.sync_all().unwrap();
    for i in 0..10 {
        make_file(&m, &format!("later-{i}"), &pattern(300 + i, i as u8));
        m.store.sync_all().unwrap();
    }
    let manifests = keys(&objects, "tree/manifests/");
    assert_eq!(manifests.len(), 11, "{manifests:?}");
    let counted = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!((counted(&metrics.s3_manifests_whole), counted(&metrics.s3_manifests_pages)), (1, 10));
    let whole = manifest(&objects, &manifests[0]);
    let Content::Whole(database) = &whole.content else { panic!("the mount's first manifest is whole") };
    for (i, key) in manifests.iter().enumerate().skip(1) {
        let later = manifest(&objects, key);
        assert_eq!(later.base(), Some(i as u64), "{key} applies over the one before it");
        let size = objects.head(key).unwrap().unwrap() as usize;
        assert!(size * 20 < database.len(), "{key}: {size} bytes against a {} byte database", database.len());
    }
    assert_eq!(read_from_another_machine(&objects, "later-9"), pattern(309, 9));
    assert_eq!(read_from_another_machine(&objects, "base-17"), pattern(100, 17));
}

#[test]
fn a_whole_manifest_comes_again_before_the_pages_outgrow_it_and_the_ones_before_it_go() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let checkpoints = 2 * super::store::MAX_PAGE_MANIFESTS as usize + 10;
    let mut wholes = 0;
    for i in 0..checkpoints {
        make_file(&m, &format!("f{i}"), &pattern(50, i as u8));
        m.store.sync_all().unwrap();
        let manifests = keys(&objects, "tree/manifests/");
        assert!(manifests.len() <= super::store::MAX_PAGE_MANIFESTS as usize + 1, "{}", manifests.len());
        let first = manifest(&objects, &manifests[0]);
        assert_eq!(first.base(), None, "the oldest manifest kept is a whole database");
        let newest = manifest(&objects, manifests.last().unwrap());
        if newest.base().is_none() {
            wholes += 1;
            assert_eq!(manifests.len(), 1, "a whole manifest deletes the ones before it");
        }
    }
    assert!(wholes >= 3, "whole manifests again as the pages add up: {wholes} in {checkpoints} checkpoints");
    let last = format!("f{}", checkpoints - 1);
    assert_eq!(read_from_another_machine(&objects, &last), pattern(50, (checkpoints - 1) as u8));
}

#[test]
fn a_mount_that_finds_a_manifest_its_pages_build_on_gone_says_so_and_takes_nothing() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    make_file(&m, "f", b"one");
    m.store.sync_all().unwrap();
    make_file(&m, "g", b"two");
    m.store.sync_all().unwrap();
    let manifests = keys(&objects, "tree/manifests/");
    assert_eq!(manifests.len(), 2);
    objects.delete(&manifests[0]).unwrap();
    drop(m);
    objects.delete("tree/lease").unwrap();
    let other = tempfile::tempdir().unwrap();
    let e = mount(&objects, &other).err().expect("refused");
    assert!(e.contains("went away"), "{e}");
    assert!(!other.path().join(super::NAMESPACE_FILE).exists(), "no namespace made from part of a chain");
}

#[test]
fn a_checkpoint_with_nothing_changed_writes_no_manifest() {
    let objects = Arc::new(MemoryObjects::default());
    let counting: Arc<dyn ObjectStore> = objects.clone();
    let state = tempfile::tempdir().unwrap();
    let m = mount(&counting, &state).unwrap();
    make_file(&m, "f", b"hello");
    m.store.sync_all().unwrap();
    let manifests = keys(&counting, "tree/manifests/");
    m.store.sync_all().unwrap();
    m.store.sync_all().unwrap();
    assert_eq!(keys(&counting, "tree/manifests/"), manifests);
    make_file(&m, "g", b"x");
    m.store.sync_all().unwrap();
    assert_ne!(keys(&counting, "tree/manifests/"), manifests);
}

#[test]
fn an_empty_state_directory_recovers_the_tree_from_the_newest_manifest() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let bytes = pattern(UNIT as usize + 77, 5);
    {
        let m = mount(&objects, &a).unwrap();
        m.names.set_log_marker(Some(std::path::Path::new("/elsewhere/intent.log"))).unwrap();
        let sub = m.names.make(ROOT_ID, OsStr::new("sub"), NewObject::Directory { perm: 0o750 }, OWNER).unwrap();
        let file = m.names.make(sub.id, OsStr::new("f"), NewObject::File { perm: 0o600 }, OWNER).unwrap();
        write_whole(&*m.store.open(file.id, OpenMode { write: true, no_atime: false }).unwrap(), &bytes).unwrap();
        m.store.sync_all().unwrap();
        m.lease.release().unwrap();
    }
    let m = mount(&objects, &b).unwrap();
    assert!(m.restored_from.is_some());
    assert_eq!(m.names.log_marker().unwrap(), None, "the lost writer's log is not this mount's to replay");
    let sub = m.names.lookup(ROOT_ID, OsStr::new("sub")).unwrap();
    let file = m.names.lookup(sub.id, OsStr::new("f")).unwrap();
    assert_eq!((file.perm, file.size), (0o600, bytes.len() as u64));
    assert_eq!(read_all(&*m.store.open(file.id, OpenMode::default()).unwrap()), bytes);
    // Its own writes go on from there, under generations of their own.
    make_file(&m, "g", b"after");
    m.store.sync_all().unwrap();
    assert_eq!(read_file(&m, "g"), b"after");
}

#[test]
fn a_second_writer_is_refused_and_the_same_state_directory_takes_its_lease_back() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = mount(&objects, &a).unwrap();
    let refused = mount(&objects, &b).err().expect("a second writer is refused");
    assert!(refused.contains("is mounted for writing by another coalescefs"), "{refused}");
    assert!(refused.contains(&a.path().display().to_string()), "it names the holder's state directory: {refused}");
    // The first mount dies without releasing (kill -9): its state directory takes it back.
    drop(first);
    let again = mount(&objects, &a).expect("the same state directory takes its own lease back");
    again.lease.release().unwrap();
    mount(&objects, &b).expect("released: another state directory may mount");
}

#[test]
fn a_manifest_already_in_the_bucket_fails_the_checkpoint_and_is_not_overwritten() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    make_file(&m, "f", b"mine");
    let theirs = layout().manifest_key(1);
    objects.put(&theirs, b"another writer's", PutCondition::Always).unwrap();
    assert_eq!(m.store.sync_all().unwrap_err().0, libc::EIO);
    assert_eq!(objects.get(&theirs, None).unwrap().unwrap(), b"another writer's");
}

#[test]
fn a_put_that_fails_gives_eio_and_loses_nothing_acknowledged() {
    let memory: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let faulty = Arc::new(FaultyObjects::new(memory.clone()));
    let objects: Arc<dyn ObjectStore> = faulty.clone();
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let kept = pattern(UNIT as usize, 6);
    let data = make_file(&m, "f", &kept);
    data.sync(false).unwrap();
    faulty.set(FaultPlan { puts: Some("/units/".into()), ..FaultPlan::default() });
    let err = write_whole(&*data, &pattern(UNIT as usize, 7)).unwrap_err();
    assert_eq!(err.0, libc::EIO);
    assert_eq!(read_all(&*data), kept, "the acknowledged unit is what a reader sees");
    faulty.set(FaultPlan { puts: Some("/manifests/".into()), ..FaultPlan::default() });
    assert_eq!(m.store.sync_all().unwrap_err().0, libc::EIO);
    assert_eq!(keys(&memory, "tree/units/").len(), 1, "nothing deleted by a checkpoint that failed");
    faulty.heal();
    m.store.sync_all().unwrap();
    drop(data);
    drop(m);
    // What the failed checkpoint had committed locally reaches the bucket with the next one:
    // another state directory recovers it.
    assert_eq!(read_from_another_machine(&memory, "f"), kept);
}

/// File `name` as another machine reads it from the bucket alone, the first writer gone (its
/// lease deleted by hand, as the refusal of a second writer says to).
fn read_from_another_machine(objects: &Arc<dyn ObjectStore>, name: &str) -> Vec<u8> {
    let other = tempfile::tempdir().unwrap();
    objects.delete("tree/lease").unwrap();
    let m = mount(objects, &other).unwrap();
    assert!(m.restored_from.is_some(), "restored from the bucket");
    read_file(&m, name)
}

#[test]
fn a_damaged_manifest_stops_the_mount_that_would_restore_it() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let m =
        Manifest { seq: 3, writer: "w".into(), unit_bytes: UNIT, content: Content::Whole(b"not a database".to_vec()) };
    let mut bytes = m.encode();
    *bytes.last_mut().unwrap() ^= 0xff;
    objects.put(&layout().manifest_key(3), &bytes, PutCondition::Always).unwrap();
    let state = tempfile::tempdir().unwrap();
    let e = mount(&objects, &state).err().expect("refused");
    assert!(e.contains("checksum"), "{e}");
    assert!(objects.head("tree/lease").unwrap().is_none(), "a mount that fails lets its lease go");
}

#[test]
fn a_unit_below_one_mib_and_a_server_that_ignores_conditional_puts_are_refused() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let e = super::open(objects, layout(), state.path(), Some(64 << 10), SOURCE, Arc::new(Metrics::default()))
        .err()
        .expect("refused");
    assert!(e.contains("at least 1048576"), "{e}");

    /// A store that overwrites whatever the condition (Garage's answer to If-None-Match).
    struct Overwriting(MemoryObjects);
    impl ObjectStore for Overwriting {
        fn put(
            &self,
            key: &str,
            body: &[u8],
            _: PutCondition,
        ) -> super::objects::ObjectResult<super::objects::PutOutcome> {
            self.0.put(key, body, PutCondition::Always)
        }
        fn get(&self, key: &str, range: Option<std::ops::Range<u64>>) -> super::objects::ObjectResult<Option<Vec<u8>>> {
            self.0.get(key, range)
        }
        fn head(&self, key: &str) -> super::objects::ObjectResult<Option<u64>> {
            self.0.head(key)
        }
        fn delete(&self, key: &str) -> super::objects::ObjectResult<()> {
            self.0.delete(key)
        }
        fn list(&self, prefix: &str) -> super::objects::ObjectResult<Vec<super::objects::Listed>> {
            self.0.list(prefix)
        }
    }
    let objects: Arc<dyn ObjectStore> = Arc::new(Overwriting(MemoryObjects::default()));
    let e = mount(&objects, &state).err().expect("refused");
    assert!(e.contains("ignores conditional puts"), "{e}");
}

#[test]
fn a_mount_with_another_unit_than_the_buckets_is_refused() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    mount(&objects, &state).unwrap().lease.release().unwrap();
    let e = super::open(objects, layout(), state.path(), Some(4 << 20), SOURCE, Arc::new(Metrics::default()))
        .err()
        .expect("refused");
    assert!(e.contains("units of 1048576"), "{e}");
}

/// Writes `bytes` at `offset` of the file as the engine flushes a partial unit: only that
/// range of the unit dirty, the file's size at least its end, the unit's buffer as far as the
/// range reaches (the engine's grows as written).
fn write_piece(data: &dyn FileData, offset: u64, bytes: &[u8]) -> crate::sys::SysResult<()> {
    let unit = offset / UNIT;
    let start = offset % UNIT;
    assert!(start + bytes.len() as u64 <= UNIT, "a piece within one unit");
    let mut buf = vec![0u8; (start as usize + bytes.len()).next_multiple_of(4096)];
    buf[start as usize..start as usize + bytes.len()].copy_from_slice(bytes);
    let ranges = RangeSet::from(start..start + bytes.len() as u64);
    let size = data.size()?.max(offset + bytes.len() as u64);
    data.write_unit(&UnitWrite { unit, unit_bytes: UNIT, buf: &buf, ranges: &ranges, size })
}

fn bucket_bytes(objects: &Arc<dyn ObjectStore>, prefix: &str) -> u64 {
    objects.list(prefix).unwrap().iter().map(|l| l.size).sum()
}

#[test]
fn scattered_small_writes_go_into_one_segment_and_read_back_over_their_units() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let mut expected = pattern(8 * UNIT as usize, 10);
    {
        let m = mount(&objects, &state).unwrap();
        let data = make_file(&m, "f", &expected);
        m.store.sync_all().unwrap();
        let units_before = keys(&objects, "tree/units/");
        // 64 writes of 4 KiB, 8 into each unit, some over each other.
        for i in 0..64u64 {
            let offset = (i % 8) * UNIT + (i * 37_123) % (UNIT - 4096);
            let bytes = pattern(4096, 100 + i as u8);
            write_piece(&*data, offset, &bytes).unwrap();
            expected[offset as usize..offset as usize + 4096].copy_from_slice(&bytes);
        }
        assert_eq!(read_all(&*data), expected, "pieces still in the open segment read over their units");
        assert!(keys(&objects, "tree/segments/").is_empty(), "the open segment waits for a commit");
        m.store.sync_all().unwrap();
        assert_eq!(keys(&objects, "tree/units/"), units_before, "no unit put again");
        let segments = keys(&objects, "tree/segments/");
        assert_eq!(segments.len(), 1, "{segments:?}");
        assert_eq!(bucket_bytes(&objects, "tree/segments/"), 64 * 4096, "only the dirty bytes");
        assert_eq!(read_all(&*data), expected, "pieces read from the segment in the bucket");
        m.lease.release().unwrap();
    }
    // Another machine, from the manifest alone.
    let other = tempfile::tempdir().unwrap();
    let m = mount(&objects, &other).unwrap();
    assert!(m.restored_from.is_some());
    assert_eq!(read_file(&m, "f"), expected);
}

#[test]
fn a_units_pieces_side_by_side_in_a_segment_are_read_by_one_get() {
    let counting = Arc::new(FaultyObjects::new(Arc::new(MemoryObjects::default())));
    let objects: Arc<dyn ObjectStore> = counting.clone();
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let mut expected = pattern(UNIT as usize, 40);
    let data = make_file(&m, "f", &expected);
    m.store.sync_all().unwrap();
    // 100 pieces of 1 KiB scattered over the unit (some over each other), put as one segment.
    for i in 0..100u64 {
        let offset = (i * 7_919 * 1024) % (UNIT - 1024);
        let bytes = pattern(1024, 50 + i as u8);
        write_piece(&*data, offset, &bytes).unwrap();
        expected[offset as usize..offset as usize + 1024].copy_from_slice(&bytes);
    }
    m.store.sync_all().unwrap();
    assert_eq!(keys(&objects, "tree/segments/").len(), 1);
    counting.count_gets_of("tree/segments/");
    assert_eq!(read_all(&*data), expected, "the pieces over the unit, in their order");
    let gets = counting.counted_gets();
    assert_eq!(gets, 1, "one GET for 100 pieces side by side in one segment");
    // A read of one piece's bytes fetches that piece alone, right.
    let offset = (5 * 7_919 * 1024) % (UNIT - 1024);
    let mut one = vec![0u8; 1024];
    assert_eq!(data.read_at(&mut one, offset).unwrap(), 1024);
    assert_eq!(one, &expected[offset as usize..offset as usize + 1024]);
}

#[test]
fn a_unit_whose_pieces_reach_half_of_it_is_put_whole_and_their_segment_goes() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let mut expected = pattern(UNIT as usize, 20);
    let data = make_file(&m, "f", &expected);
    let piece = 64 << 10;
    // Seven pieces of 64 KiB (448 KiB) stay pieces; the eighth reaches half the unit.
    for i in 0..8u64 {
        let bytes = pattern(piece, 30 + i as u8);
        let offset = i * 2 * piece as u64;
        write_piece(&*data, offset, &bytes).unwrap();
        expected[offset as usize..offset as usize + piece].copy_from_slice(&bytes);
        if i == 6 {
            m.store.sync_all().unwrap();
            assert_eq!(keys(&objects, "tree/segments/").len(), 1);
        }
    }
    assert_eq!(keys(&objects, "tree/units/").len(), 2, "the unit put again whole (the old one until the manifest)");
    assert_eq!(read_all(&*data), expected);
    m.store.sync_all().unwrap();
    assert!(keys(&objects, "tree/segments/").is_empty(), "a segment no piece names is deleted after the manifest");
    assert_eq!(keys(&objects, "tree/units/").len(), 1, "the folded unit, the old generation deleted");
    assert_eq!(read_all(&*data), expected);
}

#[test]
fn a_truncate_cuts_pieces_and_bytes_past_it_read_as_zeros() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let data = make_file(&m, "f", &pattern(2 * UNIT as usize, 40));
    write_piece(&*data, 1000, &[7u8; 3000]).unwrap();
    write_piece(&*data, UNIT + 5000, &[8u8; 3000]).unwrap();
    m.store.sync_all().unwrap();
    data.set_size(2000).unwrap();
    data.set_size(2 * UNIT).unwrap();
    let mut expected = pattern(2 * UNIT as usize, 40);
    expected[1000..2000].fill(7);
    expected[2000..].fill(0);
    assert_eq!(read_all(&*data), expected, "the piece cut at the end, the other unit's dropped");
    m.store.sync_all().unwrap();
    assert_eq!(keys(&objects, "tree/segments/").len(), 1, "the cut piece still names its segment");
    data.set_size(0).unwrap();
    m.store.sync_all().unwrap();
    assert!(keys(&objects, "tree/segments/").is_empty());
    assert!(!data.holds_data());
}

#[test]
fn a_segment_put_that_fails_fails_the_commit_and_the_next_one_puts_it() {
    let memory: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let faulty = Arc::new(FaultyObjects::new(memory.clone()));
    let objects: Arc<dyn ObjectStore> = faulty.clone();
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let mut expected = pattern(UNIT as usize, 50);
    let data = make_file(&m, "f", &expected);
    m.store.sync_all().unwrap();
    write_piece(&*data, 4096, &[9u8; 4096]).unwrap();
    expected[4096..8192].fill(9);
    faulty.set(FaultPlan { puts: Some("/segments/".into()), ..FaultPlan::default() });
    assert_eq!(data.sync(false).unwrap_err().0, libc::EIO, "no commit of records naming a segment not put");
    assert_eq!(m.store.sync_all().unwrap_err().0, libc::EIO);
    assert_eq!(read_all(&*data), expected, "the piece is still read from memory");
    faulty.heal();
    m.store.sync_all().unwrap();
    drop(data);
    drop(m);
    assert_eq!(read_from_another_machine(&memory, "f"), expected);
}

#[test]
fn objects_a_crashed_writer_put_and_never_recorded_go_at_the_next_mount() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let mut expected = pattern(2 * UNIT as usize, 60);
    {
        let m = mount(&objects, &state).unwrap();
        let data = make_file(&m, "f", &expected);
        write_piece(&*data, 100, &[1u8; 2000]).unwrap();
        expected[100..2100].fill(1);
        m.store.sync_all().unwrap();
        // Put, then the crash before their records commit: two units, and a segment (put as
        // a full one would be, before the commit that never came).
        write_whole(&*data, &pattern(2 * UNIT as usize, 61)).unwrap();
        objects.put(&layout().segment_key(0xdead), &[3u8; 100], PutCondition::IfAbsent).unwrap();
        m.names.crash();
    }
    let keys_before = keys(&objects, "tree/");
    assert_eq!(keys_before.iter().filter(|k| k.starts_with("tree/units/")).count(), 4);
    assert_eq!(keys_before.iter().filter(|k| k.starts_with("tree/segments/")).count(), 2);
    // Not this store's keys: left alone.
    objects.put("tree/units/notes.txt", b"someone's", PutCondition::Always).unwrap();
    let m = mount(&objects, &state).unwrap();
    assert_eq!(read_file(&m, "f"), expected, "what was committed reads back");
    let units = keys(&objects, "tree/units/");
    assert_eq!(units.len(), 3, "the two committed units and the foreign key: {units:?} (before: {keys_before:?})");
    assert!(units.contains(&"tree/units/notes.txt".to_string()));
    assert_eq!(keys(&objects, "tree/segments/").len(), 1, "the committed segment only");
}

#[test]
fn small_files_share_a_segment_and_a_rewrite_replaces_the_piece() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let files: Vec<(String, Vec<u8>)> = (0..100).map(|i| (format!("f{i}"), pattern(1000 + 70 * i, i as u8))).collect();
    for (name, bytes) in &files {
        make_file(&m, name, bytes);
    }
    m.store.sync_all().unwrap();
    assert!(keys(&objects, "tree/units/").is_empty(), "no object of its own for a small file");
    assert_eq!(keys(&objects, "tree/segments/").len(), 1, "one PUT for them all");
    let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
    assert_eq!(bucket_bytes(&objects, "tree/segments/"), total);
    // Each rewritten whole: its old piece goes; once no file's piece is in the first segment,
    // it goes too (after the manifest that no longer names it).
    for (i, (name, bytes)) in files.iter().enumerate() {
        let id = m.names.lookup(ROOT_ID, OsStr::new(name)).unwrap().id;
        let data = m.store.open(id, OpenMode { write: true, no_atime: false }).unwrap();
        let new = pattern(bytes.len(), 200 ^ i as u8);
        write_whole(&*data, &new).unwrap();
        assert_eq!(read_all(&*data), new);
    }
    m.store.sync_all().unwrap();
    assert_eq!(keys(&objects, "tree/segments/").len(), 1, "the rewrites' segment only: {:?}", keys(&objects, "tree/"));
    assert_eq!(bucket_bytes(&objects, "tree/segments/"), total);
}

#[test]
fn while_segment_puts_fail_the_open_segment_stays_bounded_and_writes_fail() {
    use super::segments::SEGMENT_BYTES;
    let memory: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let faulty = Arc::new(FaultyObjects::new(memory.clone()));
    let objects: Arc<dyn ObjectStore> = faulty.clone();
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let units = 40u64;
    let mut expected = pattern((units * UNIT) as usize, 70);
    let data = make_file(&m, "f", &expected);
    m.store.sync_all().unwrap();
    faulty.set(FaultPlan { puts: Some("/segments/".into()), ..FaultPlan::default() });
    let piece = 400 << 10;
    let mut refused = 0;
    for unit in 0..units {
        let bytes = pattern(piece, unit as u8);
        match write_piece(&*data, unit * UNIT, &bytes) {
            Ok(()) => expected[(unit * UNIT) as usize..][..piece].copy_from_slice(&bytes),
            Err(e) => {
                assert_eq!(e.0, libc::EIO);
                refused += 1;
            }
        }
        assert!(m.store.open_segment_bytes() < SEGMENT_BYTES + piece, "{} bytes held", m.store.open_segment_bytes());
    }
    assert!(refused > 0, "a write once the open segment was full and could not be put");
    assert_eq!(read_all(&*data), expected, "the pieces taken read back; the refused ones changed nothing");
    faulty.heal();
    m.store.sync_all().unwrap();
    drop(data);
    drop(m);
    assert_eq!(read_from_another_machine(&memory, "f"), expected);
}

/// A namespace restored where there is no room for it (a read-only mount's copy in a tmpfs
/// `/run`) is refused before anything is written, with the sizes said.
#[test]
fn a_restore_without_room_for_the_namespace_is_refused_with_the_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("namespace.db");
    assert_eq!(super::check_room(&db, 100_000), Ok(()));
    let error = super::check_room(&db, u64::MAX / 4).unwrap_err();
    assert!(error.contains(&format!("{} bytes", u64::MAX / 4)) && error.contains("bytes free"), "{error}");
    assert!(!db.exists());
}

/// A writing mount deletes the unit objects and segments no record names (what a killed writer
/// put and never committed) and keeps every one the database names, dropped ones included.
#[test]
fn a_writing_mount_sweeps_the_objects_no_record_names_and_keeps_the_named_ones() {
    let (objects, state, bytes) = bucket_with_one_file(3);
    let named: Vec<String> = [keys(&objects, "tree/units/"), keys(&objects, "tree/segments/")].concat();
    assert_eq!(named.len(), 3, "two units and a segment: {named:?}");
    let stray_unit = layout().unit_key(999, 0, 1);
    let stray_segment = layout().segment_key(999_999);
    for key in [&stray_unit, &stray_segment] {
        objects.put(key, b"put by a writer killed before its commit", PutCondition::Always).unwrap();
    }
    let m = mount(&objects, &state).unwrap();
    let after: Vec<String> = [keys(&objects, "tree/units/"), keys(&objects, "tree/segments/")].concat();
    assert_eq!(after, named, "the strays swept, the named kept");
    assert_eq!(read_file(&m, "f"), bytes);
}

/// Every object of a bucket, keys and bytes.
type Objects = Vec<(String, Vec<u8>)>;

/// Every object of `objects`, with its bytes.
fn snapshot(objects: &Arc<dyn ObjectStore>) -> Objects {
    keys(objects, "").into_iter().map(|key| (key.clone(), objects.get(&key, None).unwrap().unwrap())).collect()
}

/// A bucket as a read-only mount sees it while the writer goes on: at the first GET of a
/// manifest, every object is replaced by `later` (the writer's newer state: a whole manifest,
/// the ones before it deleted), or, with `always_gone`, every manifest reads as gone. Counts
/// the manifest GETs.
struct WriterMovesOn {
    inner: Arc<dyn ObjectStore>,
    later: std::sync::Mutex<Option<Objects>>,
    always_gone: bool,
    manifest_gets: std::sync::atomic::AtomicU64,
}

impl ObjectStore for WriterMovesOn {
    fn put(
        &self,
        key: &str,
        body: &[u8],
        condition: PutCondition,
    ) -> super::objects::ObjectResult<super::objects::PutOutcome> {
        self.inner.put(key, body, condition)
    }

    fn get(&self, key: &str, range: Option<std::ops::Range<u64>>) -> super::objects::ObjectResult<Option<Vec<u8>>> {
        if key.contains("/manifests/") {
            self.manifest_gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.always_gone {
                return Ok(None);
            }
            if let Some(later) = self.later.lock().unwrap().take() {
                for listed in self.inner.list("")? {
                    self.inner.delete(&listed.key)?;
                }
                for (key, bytes) in later {
                    self.inner.put(&key, &bytes, PutCondition::Always)?;
                }
            }
        }
        self.inner.get(key, range)
    }

    fn head(&self, key: &str) -> super::objects::ObjectResult<Option<u64>> {
        self.inner.head(key)
    }

    fn delete(&self, key: &str) -> super::objects::ObjectResult<()> {
        self.inner.delete(key)
    }

    fn list(&self, prefix: &str) -> super::objects::ObjectResult<Vec<super::objects::Listed>> {
        self.inner.list(prefix)
    }
}

/// A read-only mount lists the newest manifest (of pages), and before it reads it the writer
/// puts a whole one and deletes those before it: the mount reads the newest again and serves
/// the writer's newer tree.
#[test]
fn a_read_only_mount_whose_manifests_go_while_it_reads_them_reads_the_newest_again() {
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let writer = mount(&objects, &state).unwrap();
    make_file(&writer, "first", &pattern(100, 1));
    writer.store.sync_all().unwrap();
    make_file(&writer, "second", &pattern(200, 2));
    writer.store.sync_all().unwrap();
    let listed_first = keys(&objects, "tree/manifests/");
    assert_eq!(listed_first.len(), 2, "a whole manifest and one of pages: {listed_first:?}");
    let before = snapshot(&objects);
    // The writer goes on until a whole manifest has replaced those two.
    let mut made = 0;
    let newest = loop {
        made += 1;
        make_file(&writer, &format!("later-{made}"), &pattern(300, made as u8));
        writer.store.sync_all().unwrap();
        let manifests = keys(&objects, "tree/manifests/");
        if manifests.len() == 1 && !listed_first.contains(&manifests[0]) {
            break manifest(&objects, &manifests[0]).seq;
        }
        assert!(made <= 2 * super::store::MAX_PAGE_MANIFESTS as usize, "no whole manifest after {made} checkpoints");
    };
    let later = snapshot(&objects);

    let seen: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    for (key, bytes) in before {
        seen.put(&key, &bytes, PutCondition::Always).unwrap();
    }
    let moving = Arc::new(WriterMovesOn {
        inner: seen,
        later: std::sync::Mutex::new(Some(later)),
        always_gone: false,
        manifest_gets: Default::default(),
    });
    let copy = tempfile::tempdir().unwrap();
    let (names, store, seq) = super::open_read_only(
        moving.clone(),
        layout(),
        &copy.path().join(super::READ_ONLY_COPY_FILE),
        SOURCE,
        Arc::new(Metrics::default()),
    )
    .unwrap();
    assert_eq!(seq, newest, "the writer's newest manifest, read after the one listed first went");
    // The first try read the listed manifest (gone by then), the second the newest whole one.
    assert_eq!(moving.manifest_gets.load(std::sync::atomic::Ordering::Relaxed), 2);
    let attr = names.lookup(ROOT_ID, OsStr::new(&format!("later-{made}"))).unwrap();
    assert_eq!(read_all(&*store.open(attr.id, OpenMode::default()).unwrap()), pattern(300, made as u8));
}

/// A read-only mount whose manifests keep going while it reads them stops after three tries
/// and says so, rather than looping.
#[test]
fn a_read_only_mount_gives_up_after_its_manifests_went_away_three_times() {
    let (objects, _state, _) = bucket_with_one_file(4);
    let gone = Arc::new(WriterMovesOn {
        inner: objects,
        later: std::sync::Mutex::new(None),
        always_gone: true,
        manifest_gets: Default::default(),
    });
    let copy = tempfile::tempdir().unwrap();
    let db = copy.path().join(super::READ_ONLY_COPY_FILE);
    let e = super::open_read_only(gone.clone(), layout(), &db, SOURCE, Arc::new(Metrics::default()))
        .err()
        .expect("refused");
    assert!(e.contains("went away 3 times"), "{e}");
    assert_eq!(gone.manifest_gets.load(std::sync::atomic::Ordering::Relaxed), 3);
    assert!(!db.exists(), "nothing restored");
}

/// A hole punched through a file of whole units, pieces and a short last unit: the units wholly
/// inside lose their records and pieces (their objects go after the next manifest), the bytes
/// of the units at its ends read as zeros, SEEK_DATA and SEEK_HOLE find the hole a unit at a
/// time, and a remount reads the same bytes. Preallocation answers EOPNOTSUPP.
#[test]
fn a_punched_hole_drops_the_units_it_covers_and_seeks_find_it() {
    use libc::{ENXIO, EOPNOTSUPP, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, SEEK_DATA, SEEK_HOLE};
    const PUNCH: i32 = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
    let u = UNIT as usize;
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let mut expected: Vec<u8> = pattern(4 * u + 3000, 7).iter().map(|&byte| byte | 1).collect();
    let size = expected.len() as u64;
    let data = make_file(&m, "f", &expected);
    write_piece(&*data, 2 * UNIT + 100, &[0xEE; 50]).unwrap();
    expected[2 * u + 100..2 * u + 150].fill(0xEE);
    m.store.sync_all().unwrap();
    assert_eq!(keys(&objects, "tree/units/").len(), 4);
    let seek = |offset: u64, whence: i32| data.seek(offset as i64, whence).map(|at| at as u64).map_err(|e| e.0);

    // From the middle of unit 0 to the middle of unit 3: units 1 and 2 (with its piece) go.
    data.allocate(PUNCH, UNIT / 2, 3 * UNIT).unwrap();
    expected[u / 2..3 * u + u / 2].fill(0);
    assert_eq!(read_all(&*data), expected, "zeros where the hole is");
    assert_eq!(seek(0, SEEK_HOLE), Ok(UNIT));
    assert_eq!(seek(UNIT, SEEK_DATA), Ok(3 * UNIT));
    assert_eq!(seek(3 * UNIT, SEEK_HOLE), Ok(size), "the file's end is a hole");
    assert_eq!(seek(size, SEEK_DATA), Err(ENXIO));
    assert_eq!(data.allocate(0, 0, UNIT).map_err(|e| e.0), Err(EOPNOTSUPP), "preallocation");
    m.store.sync_all().unwrap();
    assert_eq!(keys(&objects, "tree/units/").len(), 2, "units 1 and 2's objects went after the manifest");

    // To the end: unit 3's rest and the short last unit (a piece) go whole.
    data.allocate(PUNCH, 3 * UNIT + 10, 10 * UNIT).unwrap();
    expected[3 * u + 10..].fill(0);
    assert_eq!(data.size().unwrap(), size, "KEEP_SIZE");
    assert_eq!(read_all(&*data), expected);
    assert_eq!(seek(4 * UNIT, SEEK_DATA), Err(ENXIO), "nothing past unit 3");
    m.store.sync_all().unwrap();
    drop(data);
    m.lease.release().unwrap();
    drop(m);
    let m = mount(&objects, &state).unwrap();
    assert_eq!(read_file(&m, "f"), expected, "after a remount");
}

/// copy_file_range inside the bucket: each whole unit that is one object is copied by the
/// store (here `MemoryObjects`' get and put; a server copies inside itself) under a fresh
/// generation of the target's unit, a hole copies as a hole (the target's unit there loses its
/// object), and the copy ends before a unit with pieces, which, first in the range, answers
/// EOPNOTSUPP as an unaligned range does (the kernel copies those through reads and writes).
/// The copies read back before and after a checkpoint and a remount, and the source keeps its
/// objects.
#[test]
fn a_copy_between_files_copies_unit_objects_and_leaves_pieces_to_the_kernel() {
    use libc::{EOPNOTSUPP, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
    let u = UNIT as usize;
    let objects: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    // Four whole units and 3,000 bytes (a piece: a whole unit under half a unit).
    let mut source_bytes: Vec<u8> = pattern(4 * u + 3000, 3).iter().map(|&byte| byte | 1).collect();
    let source = make_file(&m, "source", &source_bytes);
    source.allocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, UNIT, UNIT).unwrap();
    source_bytes[u..2 * u].fill(0);
    let target = make_file(&m, "target", &vec![7u8; 6 * u]);
    let empty = make_file(&m, "empty", &[]);
    m.store.sync_all().unwrap();
    let unit_objects = keys(&objects, "tree/units/").len();

    let mut target_bytes = vec![7u8; 6 * u];
    assert_eq!(source.copy_to(0, &*target, UNIT, 100 * UNIT).unwrap(), 4 * u, "whole units over the target's");
    target_bytes[u..5 * u].copy_from_slice(&source_bytes[..4 * u]);
    assert!(read_all(&*target) == target_bytes, "the target after the copy");
    assert_eq!(source.copy_to(0, &*empty, 0, 100 * UNIT).unwrap(), 4 * u, "up to the unit with pieces");
    let refused = |offset: u64| source.copy_to(offset, &*empty, offset, UNIT).map_err(|e| e.0);
    assert_eq!(refused(4 * UNIT), Err(EOPNOTSUPP), "a unit with pieces first");
    assert_eq!(refused(10), Err(EOPNOTSUPP), "off a unit boundary");
    assert!(read_all(&*empty) == source_bytes[..4 * u], "the copy into the empty file");
    m.store.sync_all().unwrap();
    // The target's units 1..=4 got three copies (the source's unit 1 is a hole, so the
    // target's unit 2 lost its object), the empty file three: the old objects of the target's
    // units 1, 3 and 4 went after the manifest.
    assert_eq!(keys(&objects, "tree/units/").len(), unit_objects + 3 + 3 - 4, "{:?}", keys(&objects, "tree/units/"));

    drop((source, target, empty));
    m.lease.release().unwrap();
    drop(m);
    let m = mount(&objects, &state).unwrap();
    assert!(read_file(&m, "target") == target_bytes, "after a remount");
    assert!(read_file(&m, "empty") == source_bytes[..4 * u], "after a remount");
    assert!(read_file(&m, "source") == source_bytes, "the source as it was");
}

/// A unit copy the server fails (one of three, copied at once): the copy answers EOPNOTSUPP
/// (the kernel then copies through reads and writes), the units copied meanwhile are deleted
/// again, and the target keeps its objects and bytes; healed, the same copy goes through.
#[test]
fn a_copy_that_fails_for_one_unit_takes_back_the_others_and_changes_nothing() {
    let u = UNIT as usize;
    let memory: Arc<dyn ObjectStore> = Arc::new(MemoryObjects::default());
    let faulty = Arc::new(FaultyObjects::new(memory.clone()));
    let objects: Arc<dyn ObjectStore> = faulty.clone();
    let state = tempfile::tempdir().unwrap();
    let m = mount(&objects, &state).unwrap();
    let source_bytes = pattern(3 * u, 5);
    let source = make_file(&m, "source", &source_bytes);
    let target = make_file(&m, "target", &vec![7u8; 3 * u]);
    m.store.sync_all().unwrap();
    let target_id = m.names.lookup(ROOT_ID, OsStr::new("target")).unwrap().id;
    let target_keys = || keys(&memory, &format!("tree/units/{target_id:016x}/"));
    let before = target_keys();
    assert_eq!(before.len(), 3, "the target's unit objects");
    faulty.set(FaultPlan { puts: Some(format!("units/{target_id:016x}/{:016x}.", 2)), ..FaultPlan::default() });
    assert_eq!(source.copy_to(0, &*target, 0, 3 * UNIT).map_err(|e| e.0), Err(libc::EOPNOTSUPP));
    assert_eq!(target_keys(), before, "the copies made were taken back");
    assert!(read_all(&*target) == vec![7u8; 3 * u], "the target as it was");
    faulty.heal();
    assert_eq!(source.copy_to(0, &*target, 0, 3 * UNIT).unwrap(), 3 * u);
    assert!(read_all(&*target) == source_bytes, "healed, the copy");
}
