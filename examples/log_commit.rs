//! The intent log's commit path, timed: what an fsync answered by the log costs the daemon.
//!
//! usage: cargo run --release --example log_commit -- DIR [COMMITS] [RECORD_BYTES]
//!
//! Makes a 64 MiB log file in DIR, then commits COMMITS batches (default 2,000), each one Data
//! record of RECORD_BYTES (default 4096) as an fsync of a 4 KiB write makes: encode (records
//! and crc32c), write the batch's blocks, fdatasync. Prints the time per batch of the encoding
//! alone and of the whole commit, and crc32c's speed over 1 MiB. Used to measure the crc32c
//! implementation (issue 16); on a loop device the sync dominates.
use std::time::Instant;

use coalescefs::engine::intent_log::device::{FileLogDevice, LogDevice};
use coalescefs::engine::intent_log::format::{crc32c, encode_batch, Record};
use coalescefs::engine::intent_log::raw;

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("usage: log_commit DIR [COMMITS] [RECORD_BYTES]");
    let commits: u64 = args.next().map(|a| a.parse().expect("COMMITS")).unwrap_or(2000);
    let record_bytes: usize = args.next().map(|a| a.parse().expect("RECORD_BYTES")).unwrap_or(4096);
    let path = std::path::Path::new(&dir).join("log_commit.log");
    let _ = raw::clear_immutable(&path);
    let _ = std::fs::remove_file(&path);
    // As the daemon opens it: on ext4 as root its blocks are written on the device.
    let (log, _) = FileLogDevice::open_or_create(&path, 64 << 20, raw::RawLog::Auto).expect("log file");
    let block = log.block_bytes();
    let payload: Vec<u8> = (0..record_bytes).map(|i| (i * 7 + 3) as u8).collect();

    let mut encode_ns = 0u128;
    let started = Instant::now();
    let mut offset = 0u64;
    for seq in 1..=commits {
        let t = Instant::now();
        let records = [Record::Data { file: seq.to_le_bytes().to_vec(), offset: seq * 4096, bytes: payload.clone() }];
        let batch = encode_batch(seq, &records, block);
        encode_ns += t.elapsed().as_nanos();
        if offset + batch.len() as u64 > 64 << 20 {
            offset = 0;
        }
        log.write_at(offset, &batch).expect("log write");
        log.sync().expect("log sync");
        offset += batch.len() as u64;
    }
    let total = started.elapsed();
    let _ = std::fs::remove_file(&path);

    let mib: Vec<u8> = (0..1 << 20).map(|i: usize| (i * 31) as u8).collect();
    let t = Instant::now();
    let mut sink = 0u32;
    for _ in 0..200 {
        sink = sink.wrapping_add(crc32c(&mib));
    }
    let crc_mb_s = 200.0 * 1.048576 / t.elapsed().as_secs_f64();
    println!(
        "{commits} commits of {record_bytes} B in {block} B blocks: encode {:.2} us/batch, commit {:.1} us/batch; crc32c {crc_mb_s:.0} MB/s ({sink:08x})",
        encode_ns as f64 / commits as f64 / 1000.0,
        total.as_secs_f64() * 1e6 / commits as f64
    );
}
