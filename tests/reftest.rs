//! Reference-model property test (after mountpoint-s3's tests/reftests): random sequences of
//! create / write at random offsets and sizes / truncate / rename / unlink / fsync / remount run
//! on the real mount and on an in-memory model of what a reader must see; after every step the
//! whole tree is compared, by names and by bytes, through the mount.
//!
//! Each file keeps one writable handle open across steps (it follows its file through renames),
//! so writes stay in the write buffer while the checks read through other handles: the model
//! is compared against buffer overlays, not only against flushed data.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;

use common::TestMount;
use proptest::prelude::*;

const NAMES: [&str; 4] = ["a", "b", "c", "d"];
/// Big enough that files span several units of any unit size up to 1 MiB.
const MAX_OFFSET: u64 = 3 << 20;
const MAX_WRITE: usize = 600 << 10;

#[derive(Debug, Clone)]
enum Op {
    Create(usize),
    Write { file: usize, offset: u64, len: usize, seed: u8 },
    Truncate { file: usize, size: u64 },
    Rename { from: usize, to: usize },
    Unlink(usize),
    Fsync(usize),
    Remount,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let file = 0..NAMES.len();
    prop_oneof![
        2 => file.clone().prop_map(Op::Create),
        8 => (file.clone(), 0..MAX_OFFSET, 1..MAX_WRITE, any::<u8>())
            .prop_map(|(file, offset, len, seed)| Op::Write { file, offset, len, seed }),
        // Small writes too: the pieces the write buffer must merge.
        4 => (file.clone(), 0..MAX_OFFSET, 1..5000usize, any::<u8>())
            .prop_map(|(file, offset, len, seed)| Op::Write { file, offset, len, seed }),
        2 => (file.clone(), 0..MAX_OFFSET).prop_map(|(file, size)| Op::Truncate { file, size }),
        2 => (file.clone(), file.clone()).prop_map(|(from, to)| Op::Rename { from, to }),
        1 => file.clone().prop_map(Op::Unlink),
        2 => file.prop_map(Op::Fsync),
        1 => Just(Op::Remount),
    ]
}

fn pattern(len: usize, seed: u8, offset: u64) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add(((offset as usize + i) % 251) as u8)).collect()
}

/// What a reader must see: name -> bytes.
type Model = BTreeMap<String, Vec<u8>>;
/// The writable handle each file keeps open, by its current name.
type Handles = HashMap<String, File>;

fn open_for_write(m: &TestMount, name: &str) -> File {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).open(m.path(name)).unwrap()
}

fn apply(m: &mut TestMount, model: &mut Model, handles: &mut Handles, op: &Op) {
    match *op {
        Op::Create(f) => {
            let name = NAMES[f];
            let handle = open_for_write(m, name);
            handles.entry(name.to_string()).or_insert(handle);
            model.entry(name.to_string()).or_default();
        }
        Op::Write { file, offset, len, seed } => {
            let name = NAMES[file];
            let Some(content) = model.get_mut(name) else { return };
            let bytes = pattern(len, seed, offset);
            handles[name].write_all_at(&bytes, offset).unwrap();
            let end = offset as usize + len;
            if content.len() < end {
                content.resize(end, 0);
            }
            content[offset as usize..end].copy_from_slice(&bytes);
        }
        Op::Truncate { file, size } => {
            let name = NAMES[file];
            let Some(content) = model.get_mut(name) else { return };
            handles[name].set_len(size).unwrap();
            content.resize(size as usize, 0);
        }
        Op::Rename { from, to } => {
            let (from, to) = (NAMES[from], NAMES[to]);
            let Some(content) = model.get(from).cloned() else { return };
            fs::rename(m.path(from), m.path(to)).unwrap();
            if from != to {
                model.remove(from);
                model.insert(to.to_string(), content);
                // The replaced file's handle goes; the moved file's handle follows its name.
                let moved = handles.remove(from).expect("every file has a handle");
                handles.insert(to.to_string(), moved);
            }
        }
        Op::Unlink(f) => {
            let name = NAMES[f];
            if model.remove(name).is_some() {
                fs::remove_file(m.path(name)).unwrap();
                handles.remove(name);
            }
        }
        Op::Fsync(f) => {
            let name = NAMES[f];
            if model.contains_key(name) {
                handles[name].sync_all().unwrap();
            }
        }
        Op::Remount => {
            handles.clear(); // closing flushes; a mount with open files cannot be unmounted
            m.remount();
            for name in model.keys() {
                handles.insert(name.clone(), open_for_write(m, name));
            }
        }
    }
}

fn check(m: &TestMount, model: &Model, step: usize, op: &Op) {
    let mut names: Vec<String> =
        fs::read_dir(&m.mnt).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let expected: Vec<String> = model.keys().cloned().collect();
    assert_eq!(names, expected, "after step {step} ({op:?}): names differ");
    for (name, content) in model {
        let actual = fs::read(m.path(name)).unwrap();
        assert_eq!(actual.len(), content.len(), "after step {step} ({op:?}): size of {name}");
        if let Some(at) = actual.iter().zip(content).position(|(a, b)| a != b) {
            panic!("after step {step} ({op:?}): {name} differs first at byte {at}");
        }
        assert_eq!(fs::metadata(m.path(name)).unwrap().len(), content.len() as u64);
    }
}

/// Small units, so that files span many of them (the store may ask for larger ones).
const SMALL_UNIT: &str = "unit=64K";

/// One case: `ops` on a fresh mount (`mount` makes it with `unit` and the other options),
/// checked after every step; then, unmounted, `finally` checks what the store holds.
fn run_case(ops: &[Op], unit: &str, mount: impl Fn(&[&str]) -> TestMount, finally: impl Fn(&mut TestMount, &Model)) {
    // A long flush_age, so that only the operations themselves move data out of the buffer.
    // REFTEST_OPTIONS adds mount options (scripts/test runs it again with writeback_cache).
    let extra = std::env::var("REFTEST_OPTIONS").unwrap_or_default();
    let mut options = vec![unit, "flush_age=3600s"];
    options.extend(extra.split(',').filter(|o| !o.is_empty()));
    let mut m = mount(&options);
    let mut model = Model::new();
    let mut handles = Handles::new();
    for (step, op) in ops.iter().enumerate() {
        apply(&mut m, &mut model, &mut handles, op);
        check(&m, &model, step, op);
    }
    handles.clear();
    m.unmount();
    finally(&mut m, &model);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("REFTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
        max_shrink_iters: 200,
        .. ProptestConfig::default()
    })]

    #[test]
    fn mount_matches_the_model_after_every_step(ops in proptest::collection::vec(op_strategy(), 1..40)) {
        // Finally the backing directory itself holds exactly the model.
        run_case(&ops, SMALL_UNIT, TestMount::with_options, |m, model| {
            for (name, content) in model {
                assert_eq!(&fs::read(m.backing_path(name)).unwrap(), content, "the backing file {name}");
            }
        });
    }

    /// The same over the SQLite backend (the conformance run): finally a fresh mount of the
    /// database shows exactly the model, and the database checks clean.
    #[test]
    fn a_sqlite_mount_matches_the_model_after_every_step(ops in proptest::collection::vec(op_strategy(), 1..40)) {
        run_case(&ops, SMALL_UNIT, TestMount::over_sqlite, |m, model| {
            let db = rusqlite::Connection::open(m.database.as_ref().unwrap()).unwrap();
            let integrity: String = db.query_row("PRAGMA integrity_check", [], |r| r.get(0)).unwrap();
            assert_eq!(integrity, "ok");
            drop(db);
            m.mount();
            check(m, model, usize::MAX, &Op::Remount);
        });
    }
}

/// The same over the S3 backend (a prefix on the test's S3 server: SeaweedFS, or Ceph's RGW under
/// `tests/ceph/run`): finally the state directory is lost, as with the machine, and a mount from
/// the bucket alone shows exactly the model. Fewer cases (REFTEST_S3_CASES, default 8): each
/// mounts three times over the network. The options of the reruns in scripts/test do not apply
/// (S3 refuses `log=off`); they skip it.
#[test]
fn an_s3_mount_matches_the_model_after_every_step_and_a_mount_from_the_bucket_alone_after_it() {
    let test = "an_s3_mount_matches_the_model_after_every_step_and_a_mount_from_the_bucket_alone_after_it";
    let Some(server) = common::s3::server_or_skip(test) else { return };
    let cases = std::env::var("REFTEST_S3_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        max_shrink_iters: 50,
        // A failure prints its shrunk case; a test outside proptest! has no source file to persist it beside.
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let outcome = runner.run(&proptest::collection::vec(op_strategy(), 1..40), |ops| {
        run_case(
            &ops,
            // An S3 mount's unit is at least 1 MiB (the mount refuses less): files span fewer
            // units than the 64 KiB ones elsewhere, and the pieces packed into segments matter.
            "unit=1M",
            |options| TestMount::over_s3(&server, "reftest", options),
            |m, model| {
                m.lose_state_directory();
                m.mount();
                check(m, model, usize::MAX, &Op::Remount);
            },
        );
        Ok(())
    });
    if let Err(failure) = outcome {
        panic!("{failure}");
    }
}
