use super::*;
use format::{encode_batch, LOG_BLOCK_BYTES};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

fn metrics() -> Arc<Metrics> {
    Arc::new(Metrics::default())
}

/// The log file at `path`, as the daemon opens it.
fn open(path: &Path, size: u64, metrics: Arc<Metrics>) -> Result<(IntentLog, Vec<Batch>), LogError> {
    open_with(path, size, metrics, raw::RawLog::Auto)
}

fn open_with(
    path: &Path,
    size: u64,
    metrics: Arc<Metrics>,
    raw_log: raw::RawLog,
) -> Result<(IntentLog, Vec<Batch>), LogError> {
    let (device, created) = open_file_device(path, Some(size), path.parent().unwrap(), raw_log)?;
    IntentLog::open(Box::new(device), created, metrics)
}

/// A log file in a temporary directory, opened as the daemon opens it (`open`).
struct TestLogFile {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    size: u64,
    metrics: Arc<Metrics>,
    raw_log: raw::RawLog,
}

impl TestLogFile {
    /// A new log of `blocks` log blocks, and the log opened on it.
    fn create(blocks: u64) -> (TestLogFile, IntentLog) {
        Self::create_with(blocks, raw::RawLog::Auto)
    }

    /// `create`, the file written through (its page-cache path exists only then).
    fn create_through_the_file(blocks: u64) -> (TestLogFile, IntentLog) {
        Self::create_with(blocks, raw::RawLog::Off)
    }

    fn create_with(blocks: u64, raw_log: raw::RawLog) -> (TestLogFile, IntentLog) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let size = blocks * LOG_BLOCK_BYTES as u64;
        let file = TestLogFile { _dir: dir, path, size, metrics: metrics(), raw_log };
        let (log, replay) = file.reopen().unwrap();
        assert!(replay.is_empty(), "a new log has nothing to replay");
        (file, log)
    }

    /// The log opened again, as a restarted daemon opens it.
    fn reopen(&self) -> Result<(IntentLog, Vec<Batch>), LogError> {
        open_with(&self.path, self.size, self.metrics.clone(), self.raw_log)
    }
}

fn data(file: u64, offset: u64, len: usize, fill: u8) -> Record {
    Record::Data { file: file.to_le_bytes().to_vec(), offset, bytes: vec![fill; len] }
}

#[test]
fn commits_survive_reopening_and_a_checkpoint_releases_them() {
    let (file, log) = TestLogFile::create(64);
    log.commit(vec![data(1, 0, 100, 1)]).unwrap();
    log.commit(vec![data(2, 4096, 5000, 2), Record::Size { file: 2u64.to_le_bytes().to_vec(), size: 9096 }]).unwrap();
    let kept_from = log.next_seq();
    log.commit(vec![data(1, 100, 10, 3)]).unwrap();
    drop(log);
    let (log, replay) = file.reopen().unwrap();
    assert_eq!(replay.len(), 3, "everything committed is read back: {replay:?}");
    assert_eq!(replay[1].records[1], Record::Size { file: 2u64.to_le_bytes().to_vec(), size: 9096 });
    log.checkpoint(kept_from).unwrap();
    drop(log);
    let (_log, replay) = file.reopen().unwrap();
    assert_eq!(replay.len(), 1);
    assert_eq!(replay[0].records, vec![data(1, 100, 10, 3)]);
}

/// Batches nobody waits for go through the page cache, widened to whole file-system blocks
/// with zeros after them (`FileLogDevice`): never over the oldest batches a nearly full ring
/// keeps right after its head.
#[test]
fn batches_through_the_page_cache_never_pad_over_the_oldest_ones_kept() {
    let (file, log) = TestLogFile::create_through_the_file(18);
    let mut committed: Vec<(u64, Vec<Record>)> = Vec::new();
    let mut kept_from = None;
    for i in 0..100_000u64 {
        let records = vec![data(i, 0, 10, i as u8)];
        match log.commit_written_before_seq(records.clone()) {
            Ok(end) => committed.push((end - 1, records)),
            Err(LogError::Full { .. }) if kept_from.is_none() => {
                // The ring wraps with the three newest batches kept just ahead of its head.
                let from = log.next_seq() - 3;
                log.checkpoint(from).unwrap();
                kept_from = Some(from);
            }
            Err(LogError::Full { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    let kept_from = kept_from.expect("the ring filled");
    assert!(file.metrics.log_batches_page_cache.load(Relaxed) > 0, "batches went through the page cache");
    drop(log); // as a killed daemon leaves it: the page cache outlives it
    let (_, replay) = file.reopen().unwrap();
    let want: Vec<(u64, Vec<Record>)> = committed.into_iter().filter(|(seq, _)| *seq >= kept_from).collect();
    let got: Vec<(u64, Vec<Record>)> = replay.into_iter().map(|b| (b.seq, b.records)).collect();
    assert_eq!(got.len(), want.len(), "every batch kept is read back");
    assert_eq!(got, want);
}

#[test]
fn the_ring_wraps_and_refuses_to_overrun_its_checkpoint() {
    let (file, log) = TestLogFile::create(18); // 16 blocks of area
    for i in 0..40u64 {
        match log.commit(vec![data(i, 0, 6000, i as u8)]) {
            Ok(()) => {}
            Err(LogError::Full { .. }) => {
                // Release all but the last batch; the commit then fits.
                log.checkpoint(log.next_seq() - 1).unwrap();
                log.commit(vec![data(i, 0, 6000, i as u8)]).unwrap();
            }
            Err(e) => panic!("{e}"),
        }
    }
    drop(log);
    let (_, replay) = file.reopen().unwrap();
    let last = replay.last().expect("batches since the checkpoint");
    assert_eq!(last.records, vec![data(39, 0, 6000, 39)], "the newest commit is read back after many wraps");
    assert!(replay.windows(2).all(|w| w[0].seq < w[1].seq));
}

#[test]
fn concurrent_commits_share_batches_and_all_come_back() {
    use crate::backend::faults::{Faults, FaultyLogDevice};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let size = 4096 * LOG_BLOCK_BYTES as u64;
    // Every sync takes 5 ms, as on a disk: while one batch syncs, the other seven threads'
    // commits arrive, and must go out together in the next batch, not one sync each.
    let faults = Arc::new(Faults::new());
    faults.control("inject logsync=stall:5ms").unwrap();
    let (device, created) = open_file_device(&path, Some(size), dir.path(), raw::RawLog::Auto).unwrap();
    let (log, _) =
        IntentLog::open(Box::new(FaultyLogDevice::new(Box::new(device), faults)), created, metrics()).unwrap();
    let log = Arc::new(log);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                for i in 0..50u64 {
                    log.commit(vec![data(t, i * 512, 512, (t * 50 + i) as u8)]).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let batches_written = log.next_seq() - 1;
    drop(log);
    let (_, replay) = open(&path, size, metrics()).unwrap();
    let mut seen: Vec<(u64, u64)> = replay
        .iter()
        .flat_map(|b| &b.records)
        .map(|r| match r {
            Record::Data { file, offset, .. } => (u64::from_le_bytes(file[..].try_into().unwrap()), *offset),
            other => panic!("{other:?}"),
        })
        .collect();
    seen.sort();
    let expected: Vec<(u64, u64)> = (0..8).flat_map(|t| (0..50).map(move |i| (t, i * 512))).collect();
    assert_eq!(seen, expected, "every commit is in the log exactly once");
    assert!(
        batches_written <= 200,
        "{batches_written} batches for 400 commits: commits waiting on a sync were not grouped"
    );
    eprintln!("400 commits from 8 threads in {batches_written} batches");
}

#[test]
fn damage_before_the_tail_stops_the_open_with_the_offset() {
    let (file, log) = TestLogFile::create(64);
    for i in 0..3 {
        log.commit(vec![data(1, i * 100, 100, 7)]).unwrap();
    }
    let block = log.block_bytes();
    drop(log);
    // Flip one bit in the first batch (block 2 of the file).
    let mut bytes = std::fs::read(&file.path).unwrap();
    bytes[2 * block + 60] ^= 0x10;
    std::fs::write(&file.path, &bytes).unwrap();
    match file.reopen() {
        Err(LogError::Corrupt(c)) => assert_eq!(c.offset, 2 * block as u64),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a damaged log opened"),
    }
}

#[test]
fn a_failed_batch_that_landed_is_written_over_before_a_checkpoint_releases_past_it() {
    use crate::backend::faults::{Faults, FaultyLogDevice};
    // In memory, behind fault injection: `logsync` fails a batch after its bytes landed.
    let device = Arc::new(device::MemoryLogDevice::new(64 * LOG_BLOCK_BYTES as u64, LOG_BLOCK_BYTES));
    let faults = Arc::new(Faults::new());
    let open = |created| {
        IntentLog::open(Box::new(FaultyLogDevice::new(Box::new(device.clone()), faults.clone())), created, metrics())
    };
    let (log, _) = open(true).unwrap();
    log.commit(vec![data(1, 0, 100, 1)]).unwrap();
    faults.control("inject logsync=EIO*1").unwrap();
    assert!(matches!(log.commit(vec![data(1, 0, 100, 2)]), Err(LogError::Io(..))));
    drop(log);
    // Nothing released it: the landed batch is read back like any other.
    let (log, replay) = open(false).unwrap();
    assert_eq!(
        replay.iter().map(|b| b.records.clone()).collect::<Vec<_>>(),
        vec![vec![data(1, 0, 100, 1)], vec![data(1, 0, 100, 2)]]
    );
    log.checkpoint(log.next_seq()).unwrap();
    faults.control("inject logsync=EIO*1").unwrap();
    assert!(log.commit(vec![data(1, 0, 100, 3)]).is_err());
    // The caller made everything durable elsewhere, and releases the whole log.
    log.checkpoint(log.next_seq()).unwrap();
    drop(log);
    let (_, replay) = open(false).unwrap();
    assert!(replay.iter().all(|b| b.records.is_empty()), "the failed batch was read after the checkpoint: {replay:?}");
}

#[test]
fn a_crash_keeps_every_synced_batch_and_never_a_torn_one() {
    // A batch of several blocks written a block at a time, then a crash keeping any subset
    // of those writes: the synced batch before it always comes back, and the new one only
    // when every one of its blocks survived.
    for block_bytes in [512, 4096] {
        let batch = encode_batch(2, &[data(1, 0, if block_bytes == 512 { 1200 } else { 9000 }, 2)], block_bytes);
        let blocks = batch.len() / block_bytes;
        assert!(blocks >= 3);
        for keep_mask in 0..1u32 << blocks {
            let device = Arc::new(device::MemoryLogDevice::new(64 * 4096, block_bytes));
            let (log, _) = IntentLog::open(Box::new(device.clone()), true, metrics()).unwrap();
            assert_eq!(log.block_bytes(), block_bytes, "a new log takes the device's block");
            log.commit(vec![data(1, 0, 100, 1)]).unwrap();
            let next = log.next_seq();
            assert_eq!(next, 2);
            drop(log);
            for (i, block) in batch.chunks(block_bytes).enumerate() {
                device.write_at((SUPERBLOCK_COPIES + 1 + i as u64) * block_bytes as u64, block).unwrap();
            }
            device.crash(|i| keep_mask & (1 << i) != 0);
            let (_, replay) = IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap();
            assert_eq!(replay[0].records, vec![data(1, 0, 100, 1)], "mask {keep_mask:b}");
            let whole = keep_mask == (1 << blocks) - 1;
            assert_eq!(replay.len(), if whole { 2 } else { 1 }, "mask {keep_mask:b}");
            if whole {
                assert_eq!(replay[1].records, vec![data(1, 0, if block_bytes == 512 { 1200 } else { 9000 }, 2)]);
            }
        }
    }
}

/// A xorshift generator from `seed`: the power-cut tests' choices, the same every run.
fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// Batches of assorted sizes written to `log`, each unflushed (a close's) or, now and then
/// (`flush_first`: the first always), flushed, which makes everything before it durable; then
/// a power cut keeping a random subset of the unflushed writes. The log must read back as a
/// prefix of what was written, holding every flushed batch, and batches written after the next
/// opening must never be confused with the survivors past its tail.
fn cut_and_check(
    log: IntentLog,
    device: &Arc<device::MemoryLogDevice>,
    next: &mut impl FnMut() -> u64,
    round: u32,
    flush_first: bool,
) {
    let mut flushed_through = 0;
    let mut written = Vec::new();
    for i in 0..(if flush_first { 2 } else { 1 } + next() % 6) {
        let records = vec![data(i, 0, 1 + (next() % 3000) as usize, i as u8)];
        if (flush_first && i == 0) || next() % 5 == 0 {
            log.commit(records.clone()).unwrap();
            flushed_through = written.len() + 1;
        } else {
            log.commit_written(records.clone()).unwrap();
        }
        written.push(records);
    }
    drop(log);
    let mask = next();
    device.crash(|i| mask & (1 << (i % 64)) != 0);
    let (log, replay) =
        IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap_or_else(|e| panic!("round {round}: {e}"));
    let read: Vec<Vec<Record>> = replay.iter().map(|b| b.records.clone()).collect();
    assert!(read.len() >= flushed_through, "round {round}: a flushed batch was lost");
    assert_eq!(read[..], written[..read.len()], "round {round}: not a prefix of what was written");
    // As replay does: everything read is applied, then released.
    log.checkpoint(log.next_seq()).unwrap();
    let after = vec![data(99, 0, 700, 99)];
    log.commit_written(after.clone()).unwrap();
    log.commit(vec![data(100, 0, 10, 100)]).unwrap();
    drop(log);
    let (_, replay) = IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap();
    let read: Vec<Vec<Record>> = replay.iter().map(|b| b.records.clone()).collect();
    assert_eq!(read, vec![after, vec![data(100, 0, 10, 100)]], "round {round}");
}

#[test]
fn unflushed_batches_a_power_cut_took_end_the_log_and_are_never_read_as_successors() {
    // Batches written without a flush (closes) may reach the device in any order: a crash
    // keeps any subset of them (`cut_and_check`).
    let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
    for round in 0..400 {
        let block_bytes = if round % 2 == 0 { 512 } else { 4096 };
        let device = Arc::new(device::MemoryLogDevice::new(48 * block_bytes as u64, block_bytes));
        let (log, _) = IntentLog::open(Box::new(device.clone()), true, metrics()).unwrap();
        cut_and_check(log, &device, &mut next, round, true);
    }
}

#[test]
fn a_missing_batch_that_was_flushed_before_a_later_one_is_damage() {
    let device = Arc::new(device::MemoryLogDevice::new(64 * 512, 512));
    let (log, _) = IntentLog::open(Box::new(device.clone()), true, metrics()).unwrap();
    log.commit_written(vec![data(1, 0, 100, 1)]).unwrap();
    log.commit(vec![data(2, 0, 100, 2)]).unwrap(); // flushes batch 1 too
    log.commit_written(vec![data(3, 0, 100, 3)]).unwrap();
    drop(log);
    device.crash(|_| true);
    // Batch 1 damaged after the flush: batch 3 was written after it was flushed.
    let mut bytes = device.read_all().unwrap();
    bytes[2 * 512 + 60] ^= 1;
    device.write_at(0, &bytes).unwrap();
    device.sync().unwrap();
    match IntentLog::open(Box::new(device.clone()), false, metrics()) {
        Err(LogError::Corrupt(c)) => assert_eq!(c.offset, 2 * 512),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a damaged log opened"),
    }
}

#[test]
fn a_queued_create_is_taken_back_only_while_nothing_else_queued_names_its_file() {
    let create = |file: &[u8]| Record::Create {
        file: file.to_vec(),
        parent: b"dir".to_vec(),
        name: file.to_vec(),
        mode: 0o100644,
        uid: 0,
        gid: 0,
    };
    let rename = Record::Rename {
        file: b"a".to_vec(),
        from_parent: b"dir".to_vec(),
        from_name: b"a".to_vec(),
        to_parent: b"dir".to_vec(),
        to_name: b"a2".to_vec(),
        replaced: Vec::new(),
    };
    let unlink = |file: &[u8]| Record::Unlink {
        file: file.to_vec(),
        parent: b"dir".to_vec(),
        name: file.to_vec(),
        directory: false,
    };
    let mut queue = Queue::default();
    queue.extend([create(b"a"), rename.clone(), create(b"b"), create(b"c")]);
    assert!(!queue.cancel_create(&unlink(b"a")), "a rename of it is queued");
    assert!(queue.changes_names_of(b"a"), "the rename is a change of its names");
    assert!(!queue.changes_names_of(b"b"), "its creation alone is not");
    assert!(queue.cancel_create(&unlink(b"b")));
    assert!(!queue.cancel_create(&unlink(b"b")), "taken back once");
    assert!(!queue.cancel_create(&unlink(b"dir")), "a directory's key is no queued Create");
    assert_eq!(queue.len(), 3);
    assert_eq!(queue.take(), vec![create(b"a"), rename, create(b"c")]);
    assert_eq!(queue.len(), 0);
    assert!(!queue.cancel_create(&unlink(b"c")), "taken by a batch");
}

#[test]
fn an_unlink_taken_back_comes_back_before_whatever_takes_its_name_until_a_checkpoint() {
    let create = |file: &[u8], name: &[u8]| Record::Create {
        file: file.to_vec(),
        parent: b"dir".to_vec(),
        name: name.to_vec(),
        mode: 0o100644,
        uid: 0,
        gid: 0,
    };
    let unlink = |file: &[u8], name: &[u8]| Record::Unlink {
        file: file.to_vec(),
        parent: b"dir".to_vec(),
        name: name.to_vec(),
        directory: false,
    };
    let mut queue = Queue::default();
    queue.extend([create(b"a", b"f"), create(b"b", b"g")]);
    assert!(queue.cancel_create(&unlink(b"a", b"f")));
    assert_eq!(queue.take(), vec![create(b"b", b"g")], "a batch carries neither record");
    queue.extend([create(b"c", b"f")]);
    assert_eq!(queue.take(), vec![unlink(b"a", b"f"), create(b"c", b"f")], "over batches, before the new name");
    queue.extend([create(b"d", b"f")]);
    assert_eq!(queue.take(), vec![create(b"d", b"f")], "once");
    // A checkpoint's sync makes what was taken back before it durable on the backend.
    queue.extend([create(b"e", b"h")]);
    assert!(queue.cancel_create(&unlink(b"e", b"h")));
    let before_checkpoint = queue.take_backs;
    queue.forget_take_backs_before(before_checkpoint);
    queue.extend([create(b"f", b"h")]);
    assert_eq!(queue.take(), vec![create(b"f", b"h")]);
}

#[test]
fn a_log_larger_than_the_read_window_reads_back_whole() {
    // Recovery reads the area a window at a time: batches across window edges, one larger
    // than the window, and the ring wrapped, all come back.
    let device = Arc::new(device::MemoryLogDevice::new(3 * READ_WINDOW_BYTES as u64, 4096));
    let (log, _) = IntentLog::open(Box::new(device.clone()), true, metrics()).unwrap();
    let mut written = Vec::new();
    for i in 0..40u64 {
        let len = if i == 20 { READ_WINDOW_BYTES + 5000 } else { 300_000 + i as usize * 777 };
        let records = vec![data(i, 0, len, i as u8)];
        if log.commit(records.clone()).is_err() {
            log.checkpoint(log.next_seq()).unwrap();
            written.clear();
            log.commit(records.clone()).unwrap();
        }
        written.push(records);
    }
    drop(log);
    let (_, replay) = IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap();
    let read: Vec<Vec<Record>> = replay.into_iter().map(|b| b.records).collect();
    assert_eq!(read.len(), written.len());
    assert!(read == written, "the log read back differs");
}

#[test]
fn closes_in_a_burst_go_through_the_page_cache_and_read_back_with_direct_ones_between() {
    let (file, log) = TestLogFile::create_through_the_file(256);
    let mut written = Vec::new();
    for i in 0..60u64 {
        // Sizes that end batches inside pages; an fsync's direct, flushed batch now and then.
        let records = vec![data(i, 0, 200 + (i as usize * 1531) % 9000, i as u8)];
        if i % 7 == 6 {
            log.commit(records.clone()).unwrap();
        } else {
            log.commit_written(records.clone()).unwrap();
        }
        written.push(records);
    }
    let through_page_cache = file.metrics.log_batches_page_cache.load(Relaxed);
    if std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(&file.path).is_ok() {
        // At most 51: the first batch had none before it, the fsyncs' are direct; a machine
        // busy enough to stretch a close past `BURST_GAP` makes it fewer.
        assert!((20..=51).contains(&through_page_cache), "{through_page_cache} of 60 through the page cache");
    }
    drop(log);
    let (_, replay) = file.reopen().unwrap();
    let read: Vec<Vec<Record>> = replay.into_iter().map(|b| b.records).collect();
    assert!(read == written, "the log read back differs: {} of {} batches", read.len(), written.len());
}

#[test]
fn a_lone_close_is_written_directly() {
    let (file, log) = TestLogFile::create(64);
    for i in 0..3u64 {
        log.commit_written(vec![data(i, 0, 100, 1)]).unwrap();
        std::thread::sleep(BURST_GAP * 2);
    }
    assert_eq!(file.metrics.log_batches_page_cache.load(Relaxed), 0);
    assert_eq!(file.metrics.log_batches.load(Relaxed), 3);
}

#[test]
fn a_log_of_another_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    open(&path, 64 * LOG_BLOCK_BYTES as u64, metrics()).unwrap();
    match open(&path, 128 * LOG_BLOCK_BYTES as u64, metrics()) {
        Err(LogError::Mismatch(why)) => assert!(why.contains("not the"), "{why}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("opened with the wrong size"),
    }
}

#[test]
fn a_log_just_made_is_not_read_back_and_is_the_empty_log_its_zeros_read_as() {
    for block_bytes in [512, 4096] {
        let device = device::MemoryLogDevice::new(64 * 4096, block_bytes);
        let sb = Superblock {
            block_bytes: block_bytes as u32,
            generation: 0,
            area_blocks: 64 * 4096 / block_bytes as u64 - SUPERBLOCK_COPIES,
            checkpoint_seq: 1,
            checkpoint_block: 0,
            closed_clean: false,
        };
        device.write_at(0, &sb.encode()).unwrap();
        let area =
            DeviceArea::new(&device, SUPERBLOCK_COPIES * block_bytes as u64, sb.area_blocks * block_bytes as u64);
        let made = read_log_unless_made(true, &area, &sb).unwrap();
        assert!(area.window.borrow().1 == 0, "a log just made was read back");
        assert_eq!(made, read_log(&area, &sb).unwrap(), "what a made log is taken to hold is what its zeros read as");
        assert!(area.window.borrow().1 > 0);
    }
}

/// A batch that does not fit before the ring's end is written after a wrap marker, which takes
/// a number of its own. A kill between the two writes leaves the marker: the volatile tail's
/// records, stamped with the marker's number, are still the next batch's, and the next mount
/// replays them.
#[test]
fn the_volatile_tail_is_replayed_after_a_kill_between_a_wrap_marker_and_its_batch() {
    let (file, mut log) = TestLogFile::create_through_the_file(18);
    let dir = tempfile::tempdir().unwrap();
    let tail_path = dir.path().join("tail");
    let tail = || volatile_tail::VolatileTail::open(&tail_path).unwrap();
    log.adopt_volatile_tail(tail(), true, &mut Vec::new()).unwrap();
    let block = log.block_bytes() as u64;
    let area = file.size / block - SUPERBLOCK_COPIES;
    // One-block batches up to the area's last block, all released.
    while log.lock_ring().next_block < area - 1 {
        log.commit(vec![data(1, 0, 10, 1)]).unwrap();
    }
    log.checkpoint(log.next_seq()).unwrap();
    let rename = Record::Rename {
        file: 9u64.to_le_bytes().to_vec(),
        from_parent: 1u64.to_le_bytes().to_vec(),
        from_name: b"tmp".to_vec(),
        to_parent: 1u64.to_le_bytes().to_vec(),
        to_name: b"f".to_vec(),
        replaced: Vec::new(),
    };
    assert!(matches!(log.keep_in_volatile_tail(vec![rename.clone()]), TailKeep::Kept));
    // The next batch takes two blocks: a wrap marker in the last one, the batch from the first.
    let start = (SUPERBLOCK_COPIES * block) as usize;
    let first_blocks = std::fs::read(&file.path).unwrap()[start..start + 2 * block as usize].to_vec();
    log.commit(vec![data(2, 0, block as usize, 2)]).unwrap();
    drop(log);
    // The kill came between the two writes: the first blocks as they were.
    let mut bytes = std::fs::read(&file.path).unwrap();
    bytes[start..start + first_blocks.len()].copy_from_slice(&first_blocks);
    std::fs::write(&file.path, &bytes).unwrap();
    let (mut log, mut replay) = file.reopen().unwrap();
    assert!(replay.is_empty(), "the batch after the marker was not taken back: {replay:?}");
    log.adopt_volatile_tail(tail(), false, &mut replay).unwrap();
    assert_eq!(replay.iter().map(|b| b.records.clone()).collect::<Vec<_>>(), [vec![rename]]);
}

/// A clean stop's checkpoint that releases every batch says so in the superblock, and the next
/// open reads no more of the area than the batch at the checkpoint (a batch planted further on,
/// which a whole reading takes for damage, is not seen); the first batch written after that open
/// unsays it first, so that a crash then replays it; and a batch at the checkpoint that an
/// older build wrote (it knows nothing of the flag) is found.
#[test]
fn a_log_a_clean_stop_closed_is_not_read_and_a_batch_after_it_is_found_after_a_crash() {
    for block_bytes in [512, 4096] {
        let device = Arc::new(device::MemoryLogDevice::new(64 * 4096, block_bytes));
        let (log, _) = IntentLog::open(Box::new(device.clone()), true, metrics()).unwrap();
        log.commit(vec![data(1, 0, 100, 1)]).unwrap();
        log.checkpoint(log.next_seq()).unwrap();
        assert!(!log.closed_clean(), "a checkpoint outside a stop");
        log.commit(vec![data(2, 0, 100, 2)]).unwrap();
        log.stopping();
        log.checkpoint(log.next_seq() - 1).unwrap();
        assert!(!log.closed_clean(), "a stop's checkpoint that keeps a batch");
        log.checkpoint(log.next_seq()).unwrap();
        assert!(log.closed_clean());
        let (seq, at) = {
            let ring = log.lock_ring();
            (ring.next_seq, ring.next_block)
        };
        drop(log);
        let clean_image = device.read_all().unwrap();
        let far = encode_batch(seq + 5, &[data(3, 0, 100, 3)], block_bytes);
        device.write_at((SUPERBLOCK_COPIES + at + 10) * block_bytes as u64, &far).unwrap();
        device.sync().unwrap();
        let (log, replay) = IntentLog::open(Box::new(device.clone()), false, metrics())
            .unwrap_or_else(|e| panic!("{block_bytes}: the area of a log closed clean was read: {e}"));
        assert!(replay.is_empty());
        assert_eq!(log.next_seq(), seq);
        drop(log);
        device.write_at(0, &clean_image).unwrap();
        let (log, _) = IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap();
        log.commit(vec![data(4, 0, 100, 4)]).unwrap();
        assert!(!log.closed_clean());
        drop(log);
        device.crash(|_| true);
        let (_, replay) = IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap();
        let read: Vec<Vec<Record>> = replay.iter().map(|b| b.records.clone()).collect();
        assert_eq!(read, vec![vec![data(4, 0, 100, 4)]], "{block_bytes}: the batch after a clean open");

        device.write_at(0, &clean_image).unwrap();
        let older_build = encode_batch(seq, &[data(5, 0, 100, 5)], block_bytes);
        device.write_at((SUPERBLOCK_COPIES + at) * block_bytes as u64, &older_build).unwrap();
        device.sync().unwrap();
        let (_, replay) = IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap();
        let read: Vec<Vec<Record>> = replay.iter().map(|b| b.records.clone()).collect();
        assert_eq!(read, vec![vec![data(5, 0, 100, 5)]], "{block_bytes}: an older build's batch after a clean close");
    }
}

/// `unflushed_batches_a_power_cut_took_end_the_log_and_are_never_read_as_successors`, from a log
/// a clean stop closed: the open after it reads no batch, so the superblock must stop saying so
/// before the first batch can land. A power cut keeping any subset of the unflushed batches
/// then still reads as a prefix of what was written, and batches written after the next
/// opening are never confused with survivors past the tail.
#[test]
fn after_a_clean_close_a_power_cut_still_leaves_a_prefix_and_no_successor_is_confused() {
    let mut next = xorshift(0x2545_F491_4F6C_DD1D);
    for round in 0..300 {
        let block_bytes = if round % 2 == 0 { 512 } else { 4096 };
        let device = Arc::new(device::MemoryLogDevice::new(48 * block_bytes as u64, block_bytes));
        let (log, _) = IntentLog::open(Box::new(device.clone()), true, metrics()).unwrap();
        // Somewhere in the ring, then a clean stop.
        for i in 0..next() % 4 {
            log.commit(vec![data(50 + i, 0, 1 + (next() % 2000) as usize, 7)]).unwrap();
        }
        log.stopping();
        log.checkpoint(log.next_seq()).unwrap();
        assert!(log.closed_clean(), "round {round}");
        drop(log);
        let (log, replay) = IntentLog::open(Box::new(device.clone()), false, metrics()).unwrap();
        assert!(replay.is_empty());
        cut_and_check(log, &device, &mut next, round, false);
    }
}
