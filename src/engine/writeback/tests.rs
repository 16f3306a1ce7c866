//! The write buffer's state machine, in-process on the memory store: what happens to a
//! unit when it fills, when it is written again while in flight, when the store refuses
//! it, when memory runs out, and when the file is truncated.

use super::*;
use crate::backend::faults::{Faults, FaultyBackend};
use crate::backend::memory::MemoryBackend;
use crate::engine::types::{NewObject, Owner, ROOT_ID};
use std::ffi::OsStr;

const UNIT: u64 = 16 << 10;

struct Rig {
    store: Arc<MemoryBackend>,
    faults: Arc<Faults>,
    wb: Arc<Writeback>,
    metrics: Arc<Metrics>,
}

fn rig(buffer_units: u64, io_timeout: Duration) -> Rig {
    rig_with_log(buffer_units, io_timeout, None)
}

fn rig_with_log(buffer_units: u64, io_timeout: Duration, log: Option<IntentLog>) -> Rig {
    rig_on(MemoryBackend::with_partial_writes(UNIT), buffer_units, io_timeout, log)
}

fn memory_log() -> IntentLog {
    use crate::engine::intent_log::device::MemoryLogDevice;
    use crate::engine::intent_log::format::LOG_BLOCK_BYTES;
    let device = MemoryLogDevice::new(256 * LOG_BLOCK_BYTES as u64, LOG_BLOCK_BYTES);
    IntentLog::open(Box::new(device), true, Arc::new(Metrics::default())).unwrap().0
}

fn rig_on(store: MemoryBackend, buffer_units: u64, io_timeout: Duration, log: Option<IntentLog>) -> Rig {
    rig_configured(store, buffer_units, io_timeout, log, |_| {})
}

fn rig_configured(
    store: MemoryBackend,
    buffer_units: u64,
    io_timeout: Duration,
    log: Option<IntentLog>,
    adjust: impl FnOnce(&mut WritebackConfig),
) -> Rig {
    let store = Arc::new(store);
    let faults = Arc::new(Faults::new());
    let faulty = Arc::new(FaultyBackend::new(store.clone(), store.clone(), faults.clone()));
    let metrics = Arc::new(Metrics::default());
    let mut config = WritebackConfig {
        unit_bytes: UNIT,
        logical_block_bytes: 512,
        buffer_bytes: buffer_units * UNIT,
        flushers: 2,
        flush_age: Duration::from_secs(3600),
        log_threshold_bytes: 0,
        log_threshold_new_bytes: 0,
        log_closes: LogCloses::Auto,
        burst_gap: crate::engine::burst::BURST_GAP,
        checkpoint_interval: Duration::from_secs(3600),
        checkpoint_idle: Duration::from_secs(3600),
        io_timeout,
    };
    adjust(&mut config);
    let wb = Writeback::new(faulty.clone(), faulty, config, metrics.clone(), log, None);
    Rig { store, faults, wb, metrics }
}

impl Rig {
    fn file(&self, name: &str) -> Arc<FileState> {
        let attr = self
            .store
            .make(ROOT_ID, OsStr::new(name), NewObject::File { perm: 0o644 }, Owner { uid: 0, gid: 0 })
            .unwrap();
        self.wb.open_file(attr.id, || Ok(0)).unwrap()
    }

    fn stored(&self, name: &str) -> Vec<u8> {
        self.store.read_path(&[OsStr::new(name)]).unwrap()
    }

    fn wait_until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.faults.control("clear").unwrap();
        self.wb.abandon();
    }
}

/// The open's size read, then the last state's flush ending and the state going before
/// the open takes the table: the size is read again (the crash harness lost bytes to a
/// reopened file that read as empty, its size read mid-flush; see `open_file`).
#[test]
fn an_open_reads_the_stores_size_again_when_a_state_ended_after_it_read_it() {
    let r = rig(8, Duration::from_secs(10));
    let f = r.file("f");
    assert!(!r.wb.release_file(&f), "nothing buffered: the state goes at its close");
    let mut reads = Vec::new();
    let reopened =
        r.wb.open_file(f.id, || {
            if reads.is_empty() {
                // Read before a concurrent writer's flush landed its bytes; then that
                // writer's state ends, idle.
                let other = r.wb.open_file(f.id, || Ok(0)).unwrap();
                r.wb.write_copied(&other, 0, &[5; 5000], false, None).unwrap();
                assert!(r.wb.release_file(&other), "closed with its bytes buffered, the state lingers");
                r.wb.flush_file(&other, None, ErrorReport::Sync).unwrap();
                r.wb.drop_if_idle(&other);
                reads.push(0);
            } else {
                reads.push(r.stored("f").len() as u64);
            }
            Ok(*reads.last().unwrap())
        })
        .unwrap();
    assert_eq!(reads, vec![0, 5000], "read again once the state had ended");
    assert_eq!(r.wb.size(&reopened), 5000);
    // With the state there, its own size counts and the store is not asked.
    let mut more_reads = 0;
    let second = r.wb.open_file(f.id, || {
        more_reads += 1;
        Ok(0)
    });
    assert!(Arc::ptr_eq(&second.unwrap(), &reopened));
    assert_eq!((more_reads, r.wb.size(&reopened)), (0, 5000));
}

#[test]
fn a_full_unit_goes_to_the_store_at_once_and_a_partial_one_waits() {
    let r = rig(8, Duration::from_secs(10));
    let f = r.file("f");
    r.wb.write_copied(&f, 0, &vec![1; UNIT as usize + 100], false, None).unwrap();
    r.wait_until("the full unit's flush", || r.stored("f").len() == UNIT as usize);
    assert_eq!(r.metrics.units_flushed_full.load(Relaxed), 1);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(r.stored("f").len(), UNIT as usize, "the partial unit waits for fsync, close, age or pressure");
    r.wb.flush_file(&f, Some(true), ErrorReport::Sync).unwrap();
    assert_eq!(r.stored("f"), vec![1; UNIT as usize + 100]);
    assert_eq!(r.metrics.units_flushed_partial.load(Relaxed), 1);
}

#[test]
fn a_unit_written_again_while_in_flight_is_flushed_again_after_it_with_the_newer_bytes() {
    let r = rig(8, Duration::from_secs(10));
    let f = r.file("f");
    r.faults.control("inject write=stall:60s*1").unwrap();
    r.wb.write_copied(&f, 0, &vec![1; UNIT as usize], false, None).unwrap(); // full: in flight, stalled
    r.wait_until("the unit in flight", || !lock(&f.inner).in_flight.is_empty());
    r.wb.write_copied(&f, 10, &[2; 10], false, None).unwrap();
    {
        let inner = lock(&f.inner);
        assert_eq!(
            (inner.in_flight.len(), inner.dirty.len()),
            (1, 1),
            "the newer bytes wait in a dirty unit of their own"
        );
    }
    r.faults.control("clear").unwrap();
    r.wb.flush_file(&f, Some(true), ErrorReport::Sync).unwrap();
    let mut want = vec![1; UNIT as usize];
    want[10..20].fill(2);
    assert_eq!(r.stored("f"), want, "the newer bytes win, written after the older flush");
}

#[test]
fn a_refused_flush_keeps_the_data_and_is_reported_only_while_the_retries_fail() {
    let r = rig(8, Duration::from_secs(10));
    let f = r.file("f");
    r.faults.control("inject write=ENOSPC*2").unwrap();
    r.wb.write_copied(&f, 0, &[7; 100], false, None).unwrap();
    assert_eq!(r.wb.flush_file(&f, None, ErrorReport::Close), Err(Errno(libc::ENOSPC)), "close hears of it");
    assert_eq!(r.metrics.buffer_refused_bytes.load(Relaxed), UNIT, "the refused unit is counted as held");
    {
        let inner = lock(&f.inner);
        assert!(inner.retry_at.is_some_and(|at| at > Instant::now()), "a retry waits out a backoff");
        assert!(inner.dirty[&0].refused && inner.dirty[&0].ranges.bytes() == 100, "the data stays buffered");
    }
    r.wb.write_copied(&f, 100, &[8; 10], false, None).expect("a write does not report a refused flush");
    // fsync tries again at once, past the backoff: refused once more, it fails on its own
    // account (close's report did not use it up)...
    assert_eq!(r.wb.flush_file(&f, Some(true), ErrorReport::Sync), Err(Errno(libc::ENOSPC)));
    // ... and once the store takes the bytes, the earlier refusals are healed, not reported.
    r.wb.flush_file(&f, Some(true), ErrorReport::Sync).unwrap();
    r.wb.flush_file(&f, None, ErrorReport::Close).unwrap();
    let mut want = vec![7; 100];
    want.extend([8; 10]);
    assert_eq!(r.stored("f"), want);
    assert_eq!(r.metrics.buffer_refused_bytes.load(Relaxed), 0);
}

#[test]
fn discarded_refused_bytes_are_reported_to_close_and_fsync_once_each() {
    let r = rig(1, Duration::from_secs(10));
    let f = r.file("f");
    r.faults.control("inject write=EIO").unwrap();
    r.wb.write_copied(&f, 0, &vec![1; UNIT as usize], false, None).unwrap(); // full: flushed, refused
    r.wait_until("the refusal", || r.metrics.buffer_refused_bytes.load(Relaxed) == UNIT);
    let g = r.file("g");
    assert_eq!(
        r.wb.write_copied(&g, 0, &[1; 10], false, None),
        Err(Errno(libc::EIO)),
        "f's writer not told: nothing may go"
    );
    assert_eq!(
        r.wb.write_copied(&f, UNIT, &[1; 10], false, None),
        Err(Errno(libc::EIO)),
        "f's own write fails: now it is told"
    );
    // Still refusing: no retry of f's unit can free the room first.
    r.wb.write_copied(&g, 0, &[1; 10], false, None).expect("room made by discarding f's told refusal");
    assert_eq!(r.metrics.buffer_discarded_bytes.load(Relaxed), UNIT);
    r.faults.control("clear").unwrap();
    assert_eq!(r.wb.flush_file(&f, None, ErrorReport::Close), Err(Errno(libc::EIO)), "close hears of the loss");
    assert_eq!(r.wb.flush_file(&f, Some(true), ErrorReport::Sync), Err(Errno(libc::EIO)), "so does fsync");
    r.wb.flush_file(&f, Some(true), ErrorReport::Sync).expect("once");
}

#[test]
fn a_writer_fails_at_once_when_all_the_memory_is_refused_data() {
    let r = rig(2, Duration::from_secs(10));
    let f = r.file("f");
    r.faults.control("inject write=EIO").unwrap();
    r.wb.write_copied(&f, 0, &vec![1; 2 * UNIT as usize], false, None).unwrap(); // two full units, both refused
    r.wait_until("both refusals", || r.metrics.buffer_refused_bytes.load(Relaxed) == 2 * UNIT);
    let g = r.file("g");
    let started = Instant::now();
    assert_eq!(
        r.wb.write_copied(&g, 0, &[1; 10], false, None),
        Err(Errno(libc::EIO)),
        "nothing can come free: the store's error"
    );
    assert!(started.elapsed() < Duration::from_secs(2), "at once, not after io_timeout");
    // Once f's writer has been told (its write or close), its refused data makes room. The store
    // still refuses: room can come from nothing else (once it takes writes again, a retry of f's
    // units racing g's write may free it, and CI once saw nothing discarded).
    assert_eq!(r.wb.flush_file(&f, None, ErrorReport::Close), Err(Errno(libc::EIO)));
    r.wb.write_copied(&g, 0, &[1; 10], false, None).expect("room made by discarding told refusals");
    assert!(r.metrics.buffer_discarded_bytes.load(Relaxed) > 0);
    r.faults.control("clear").unwrap();
    assert!(*lock(&r.wb.budget.used_bytes) <= 2 * UNIT);
}

/// Found by CI, under a loaded disk: a full backend, and dd waited 27 s for its ENOSPC.
#[test]
fn a_retry_of_refused_data_under_way_does_not_make_a_writer_wait_for_it() {
    let r = rig(2, Duration::from_secs(10));
    let f = r.file("f");
    r.faults.control("inject write=ENOSPC").unwrap();
    r.wb.write_copied(&f, 0, &vec![1; 2 * UNIT as usize], false, None).unwrap(); // two full units, both refused
    r.wait_until("both refusals", || r.metrics.buffer_refused_bytes.load(Relaxed) == 2 * UNIT);
    // The retries hang (a slow full disk): an fsync sends both, and waits for them.
    r.faults.control("clear").unwrap();
    r.faults.control("inject write=stall:60s").unwrap();
    let retry = {
        let (wb, f) = (r.wb.clone(), f.clone());
        std::thread::spawn(move || wb.flush_file(&f, Some(true), ErrorReport::Sync))
    };
    r.wait_until("both retries under way", || lock(&f.inner).in_flight.len() == 2);
    assert_eq!(r.metrics.buffer_refused_bytes.load(Relaxed), 2 * UNIT, "still refused while retried");
    let g = r.file("g");
    let started = Instant::now();
    assert_eq!(r.wb.write_copied(&g, 0, &[1; 10], false, None), Err(Errno(libc::ENOSPC)), "the store's last error");
    assert!(started.elapsed() < Duration::from_secs(2), "at once, not after io_timeout");
    r.faults.control("clear").unwrap();
    retry.join().unwrap().expect("the retries succeed once the store takes them");
    assert_eq!(r.metrics.buffer_refused_bytes.load(Relaxed), 0);
    assert_eq!(r.stored("f"), vec![1; 2 * UNIT as usize]);
}

/// Under memory pressure, a file waiting out its retry backoff still sends the units it has
/// never tried: refused in turn, they tell the writer at once; held back, they made it wait
/// out the backoff (up to 30 s) or io_timeout.
#[test]
fn a_writer_short_of_memory_hears_of_a_full_store_without_waiting_out_the_backoff() {
    let r = rig(8, Duration::from_secs(10));
    let f = r.file("f");
    r.faults.control("inject write=ENOSPC").unwrap();
    r.wb.write_copied(&f, 0, &vec![1; 7 * UNIT as usize], false, None).unwrap(); // seven full units, refused
    r.wait_until("seven refusals", || r.metrics.buffer_refused_bytes.load(Relaxed) == 7 * UNIT);
    let backoff = lock(&f.inner).retry_at.expect("a backoff").saturating_duration_since(Instant::now());
    assert!(backoff > Duration::from_secs(3), "seven failures back off for {backoff:?}");
    r.wb.write_copied(&f, 7 * UNIT, &[2; 10], false, None).unwrap(); // partial, never tried: the buffer is full
    let g = r.file("g");
    let started = Instant::now();
    assert_eq!(r.wb.write_copied(&g, 0, &[1; 10], false, None), Err(Errno(libc::ENOSPC)));
    assert!(started.elapsed() < Duration::from_secs(2), "at once, not after the backoff");
    assert!(lock(&f.inner).dirty[&7].refused, "the untried unit was tried, and refused");
}

#[test]
fn a_writer_waiting_on_a_stalled_store_fails_after_io_timeout() {
    let r = rig(2, Duration::from_millis(300));
    let f = r.file("f");
    r.faults.control("inject write=stall:60s").unwrap();
    r.wb.write_copied(&f, 0, &vec![1; 2 * UNIT as usize], false, None).unwrap(); // two units in flight, stalled
    let started = Instant::now();
    assert_eq!(r.wb.write_copied(&f, 2 * UNIT, &[1; 10], false, None), Err(Errno(libc::EIO)));
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(5), "waited {waited:?}");
    assert_eq!(r.wb.flush_file(&f, None, ErrorReport::Close), Err(Errno(libc::EIO)), "a close waits boundedly too");
}

#[test]
fn truncate_drops_buffered_bytes_past_the_new_size_and_frees_their_units() {
    let r = rig(8, Duration::from_secs(10));
    let f = r.file("f");
    r.wb.write_copied(&f, 0, &[1; 100], false, None).unwrap();
    r.wb.write_copied(&f, 3 * UNIT, &[2; 100], false, None).unwrap();
    assert_eq!(*lock(&r.wb.budget.used_bytes), 2 * UNIT);
    r.wb.set_size(&f, 50).unwrap();
    assert_eq!(*lock(&r.wb.budget.used_bytes), UNIT, "the unit past the size is freed");
    assert_eq!(r.wb.size(&f), 50);
    r.wb.flush_file(&f, Some(true), ErrorReport::Sync).unwrap();
    assert_eq!(r.stored("f"), vec![1; 50], "nothing past the size reaches the store");
}

#[test]
fn a_crowded_durability_map_brings_the_checkpoint_forward() {
    let r = rig_with_log(4, Duration::from_secs(10), Some(memory_log())); // checkpoints hourly, unless crowded
    for ino in 0..DURABILITY_ENTRIES_BEFORE_CHECKPOINT as u64 {
        r.wb.note_created(1_000_000 + ino, Some(ROOT_ID), None);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(lock(&r.wb.durability).len(), DURABILITY_ENTRIES_BEFORE_CHECKPOINT, "at the bound: no checkpoint yet");
    r.wb.note_created(999_999, Some(ROOT_ID), None);
    r.wait_until("an early checkpoint to empty the map", || lock(&r.wb.durability).is_empty());
}

/// The rig's log thresholds are 0: only the whole-unit rule can send an fsync to the log.
#[test]
fn a_store_of_whole_units_gets_small_fsyncs_through_the_log() {
    for (store, through_log) in [(MemoryBackend::new(UNIT), true), (MemoryBackend::with_partial_writes(UNIT), false)] {
        let r = rig_on(store, 4, Duration::from_secs(10), Some(memory_log()));
        let f = r.file("f");
        r.wb.write_copied(&f, 0, &[4; UNIT as usize], false, None).unwrap();
        r.wb.fsync(&f, false).unwrap(); // a whole unit: to the store
        r.wb.checkpoint().unwrap(); // the file's flush synced: the log may stand for the store again
        r.wb.write_copied(&f, 100, &[5; 1000], false, None).unwrap();
        r.wb.fsync(&f, false).unwrap();
        assert_eq!(r.metrics.units_flushed_partial.load(Relaxed) == 0, through_log, "through the log: {through_log}");
        assert_eq!(r.metrics.backend_read_bytes_for_writes.load(Relaxed), 0, "no unit was read to be written whole");
        if through_log {
            r.wb.write_copied(&f, 4000, &[6; UNIT as usize / 2 + 1], false, None).unwrap();
            r.wb.fsync(&f, false).unwrap();
            assert_eq!(r.metrics.units_flushed_partial.load(Relaxed), 1, "more than half a unit goes to the store");
            assert!(r.metrics.backend_read_bytes_for_writes.load(Relaxed) > 0, "whole: the rest read first");
        }
    }
}

#[test]
fn a_large_write_is_answered_before_its_copy_and_nothing_sees_the_file_in_between() {
    let r = rig(32, Duration::from_secs(10));
    let f = r.file("f");
    let bytes = vec![9u8; ACKNOWLEDGE_BEFORE_COPY_MIN_BYTES as usize + 100];
    let seen_size = std::thread::scope(|scope| {
        let mut reader = None;
        let taken =
            r.wb.write_copied(
                &f,
                0,
                &bytes,
                false,
                Some(&mut |answered| {
                    assert_eq!(answered, bytes.len(), "answered with every byte");
                    reader = Some(scope.spawn(|| r.wb.size(&f)));
                    // Time for the reader to look, were the file not locked until the copy ends.
                    std::thread::sleep(Duration::from_millis(50));
                }),
            )
            .unwrap();
        assert_eq!(taken, bytes.len());
        reader.expect("a write this large is answered before its copy").join().unwrap()
    });
    assert_eq!(seen_size, bytes.len() as u64, "a reader after the answer waits for the copy");
    r.wb.flush_file(&f, Some(true), ErrorReport::Sync).unwrap();
    assert_eq!(r.stored("f"), bytes);
}

#[test]
fn a_small_write_or_one_short_of_free_memory_is_answered_after_its_copy() {
    let r = rig(4, Duration::from_secs(10));
    let f = r.file("f");
    let mut answered = false;
    r.wb.write_copied(&f, 0, &[1; 100], false, Some(&mut |_| answered = true)).unwrap();
    assert!(!answered, "a small write");
    // Eight units, the buffer holds four: taken unit by unit as the flushers free them.
    let bytes = vec![2u8; ACKNOWLEDGE_BEFORE_COPY_MIN_BYTES as usize];
    assert_eq!(r.wb.write_copied(&f, 0, &bytes, false, Some(&mut |_| answered = true)).unwrap(), bytes.len());
    assert!(!answered, "memory for its units was not free at once");
    r.wb.flush_file(&f, Some(true), ErrorReport::Sync).unwrap();
    assert_eq!(r.stored("f"), bytes);
    r.wait_until("every unit's memory back", || r.metrics.buffer_bytes_used.load(Relaxed) == 0);
}

/// A backend sync reads the file's change count, syncs, then marks that count synced. A
/// checkpoint in between may end the file's entry (in sync, nothing in the log) and a flush
/// after the sync begin a new one: the count read before must not pass for the new entry's.
/// Counted per entry from 0, it did: the file read as in sync with a flush no sync had
/// covered, and its next fsync was answered from the log, which held nothing of it. Over S3,
/// whose flushes wait in the namespace's open transaction for a commit, that loses the write
/// to a kill: what CI's crash matrix found once (seed 544530016), as far as its kept database
/// shows.
#[test]
fn a_change_count_read_before_a_files_entry_ended_never_passes_a_later_flush_as_synced() {
    let r = rig_with_log(4, Duration::from_secs(10), Some(memory_log()));
    let f = r.file("f");
    r.wb.write_copied(&f, 0, &[1; 1000], false, None).unwrap();
    r.wb.flush_file(&f, None, ErrorReport::Write).unwrap(); // on the store, not synced
    let (read_by_a_sync, _) = r.wb.backend_changes_now(f.id); // a backend sync of the file begins
    r.wb.checkpoint().unwrap(); // the store synced: the file in sync, nothing logged
    assert!(!lock(&r.wb.durability).contains_key(&f.id), "the file's entry ended");
    r.wb.write_copied(&f, 2000, &[2; 1000], false, None).unwrap();
    r.wb.flush_file(&f, None, ErrorReport::Write).unwrap(); // after the sync's store call: not covered
    r.wb.note_synced(f.id, read_by_a_sync); // the sync ends
    r.wb.fsync(&f, false).unwrap();
    r.store.crash();
    let stored = r.stored("f");
    assert!(stored.len() >= 3000 && stored[2000..3000] == [2; 1000], "an fsynced write lost to a crash");
}

/// A truncate the store has not been given is said in the log once: closes after it with
/// nothing else changed write no batch (each close wrote a Size-only one: every child's FLUSH
/// of a file its parent held open with a truncate waiting). A change of size after it, or a
/// second truncate, is said again, and a flush that gives the store the truncate ends it.
#[test]
fn a_truncate_the_store_has_not_been_given_is_logged_once_not_at_every_close() {
    let store = MemoryBackend::with_partial_writes(UNIT);
    let r = rig_configured(store, 4, Duration::from_secs(10), Some(memory_log()), |config| {
        config.log_closes = LogCloses::Always;
        config.log_threshold_bytes = 4096;
    });
    let log = r.wb.log.as_ref().unwrap();
    let f = r.file("f");
    r.wb.write_copied(&f, 0, &[1; 8000], false, None).unwrap();
    r.wb.flush_file(&f, Some(false), ErrorReport::Sync).unwrap();
    r.wb.checkpoint().unwrap(); // in sync with the store: a truncate of it waits for a flush
    r.wb.set_size(&f, 3000).unwrap();
    assert!(lock(&f.inner).cut_to.is_some(), "the truncate waits for the file's next flush");
    // A close, and whether it wrote a batch as `expected`; returns the log's next sequence number.
    let close_logs = |what: &str, seq_before: u64, expected: bool| {
        r.wb.close_file(&f).unwrap();
        assert_eq!(log.next_seq() > seq_before, expected, "{what}: a batch at close");
        log.next_seq()
    };
    let seq = close_logs("the truncate", log.next_seq(), true);
    let seq = close_logs("a close with nothing new", seq, false);
    let seq = close_logs("another", seq, false);
    r.wb.set_size(&f, 5000).unwrap(); // larger again, the cut still waiting
    let seq = close_logs("a change of size", seq, true);
    let seq = close_logs("a close after it", seq, false);
    r.wb.set_size(&f, 1000).unwrap();
    let seq = close_logs("a second truncate", seq, true);
    r.wb.write_copied(&f, 100, &[2; 100], false, None).unwrap();
    let seq = close_logs("a write", seq, true);
    close_logs("a close after it", seq, false);
    r.wb.flush_file(&f, Some(false), ErrorReport::Sync).unwrap();
    let mut expected = vec![1; 1000];
    expected[100..200].fill(2);
    assert_eq!(r.stored("f"), expected, "the store given the truncates and the write");
    assert!(lock(&f.inner).cut_to.is_none() && lock(&f.inner).size_logged_since_cut.is_none());
}

/// The single unit a close waits on goes to the flusher pinned to the closing thread's CPU
/// (`near`); while that flusher is stuck in a stalled backend call, the close fails after
/// `io_timeout` as any waiting request, and the next file's close on that CPU goes to the pool
/// instead of queueing behind it.
#[test]
fn a_closes_single_unit_goes_to_its_cpus_flusher_and_a_stuck_one_strands_nothing() {
    let r = rig(8, Duration::from_millis(300));
    let (f, g, h) = (r.file("f"), r.file("g"), r.file("h"));
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // One CPU for the whole case: the flusher asked for is that CPU's.
                let cpu = crate::sys::current_cpu().expect("sched_getcpu");
                crate::sys::run_on_cpu(cpu).unwrap();
                r.wb.write_copied(&f, 0, &[1; 100], false, None).unwrap();
                r.wb.flush_file(&f, None, ErrorReport::Close).unwrap();
                assert_eq!(r.stored("f"), vec![1; 100]);
                assert_eq!(r.metrics.flushes_near.load(Relaxed), 1, "f's unit went to the pool");

                r.wait_until("f's near flusher to be done with it", || r.wb.near_flushers_idle());
                r.faults.control("inject write=stall:60s*1").unwrap(); // g's write alone
                r.wb.write_copied(&g, 0, &[2; 100], false, None).unwrap();
                let started = Instant::now();
                assert_eq!(r.wb.flush_file(&g, None, ErrorReport::Close), Err(Errno(libc::EIO)));
                let waited = started.elapsed();
                assert!(waited >= Duration::from_millis(300) && waited < Duration::from_secs(5), "waited {waited:?}");
                assert_eq!(r.metrics.flushes_near.load(Relaxed), 2, "g's unit went to the pool");

                r.wb.write_copied(&h, 0, &[3; 100], false, None).unwrap();
                r.wb.flush_file(&h, None, ErrorReport::Close).unwrap();
                assert_eq!(r.stored("h"), vec![3; 100], "h waited behind the stuck flusher");
                assert_eq!(r.metrics.flushes_near.load(Relaxed), 2, "h was handed to the busy near flusher");
            })
            .join()
            .unwrap();
    });
    r.faults.control("clear").unwrap();
    r.wb.flush_file(&g, None, ErrorReport::Close).unwrap();
    assert_eq!(r.stored("g"), vec![2; 100]);
}
