//! When checkpoints come (`checkpoint_idle`, `checkpoint_interval`): a checkpoint costs the
//! same whatever it carries, so records that keep coming share one, and the store catches up
//! once they stop; the batches of closes meanwhile reach the log's device within
//! `checkpoint_idle` (SEMANTICS.md, "close returning 0 of such a file").

mod common;

use std::fs;
use std::time::{Duration, Instant};

use common::*;

/// Closes held in the log every 100 ms for 7 s with `checkpoint_idle=2s`: no checkpoint while
/// they come (the interval is an hour), the log's device flushed at least every 2 s meanwhile
/// (a close flushes nothing itself), and a checkpoint once they stop.
#[test]
fn a_trickle_of_logged_closes_shares_a_checkpoint_after_it_stops_and_is_flushed_meanwhile() {
    let m = TestMount::with_options(&[
        "log_closes=always",
        "checkpoint_interval=3600s",
        "checkpoint_idle=2s",
        "writeback_cache=off",
    ]);
    let (checkpoints, flushes, held) =
        (m.counter("log_checkpoints_total"), m.counter("log_flushes_total"), m.counter("pending_files_logged_total"));
    let started = Instant::now();
    let mut files = 0;
    while started.elapsed() < Duration::from_secs(7) {
        fs::write(m.path(&format!("f{files}")), b"a line of configuration\n").unwrap();
        files += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(m.counter("pending_files_logged_total") - held >= files / 2, "the log held too few closes: tests nothing");
    assert_eq!(m.counter("log_checkpoints_total"), checkpoints, "a checkpoint while records kept coming");
    let flushed = m.counter("log_flushes_total") - flushes;
    assert!((2..files / 2).contains(&flushed), "{flushed} flushes of the log over {files} closes in 7 s");
    wait_for(|| m.counter("log_checkpoints_total") > checkpoints, "a checkpoint once the closes stopped");
    for i in 0..files {
        assert_eq!(fs::read(m.backing_path(&format!("f{i}"))).unwrap(), b"a line of configuration\n");
    }
}
