use super::*;

/// Bytes this thread has had read from a device (the kernel counts a read-before-write
/// against the writer).
fn device_bytes_read_by_this_thread() -> u64 {
    let io = std::fs::read_to_string("/proc/thread-self/io").expect("task I/O accounting");
    io.lines().find_map(|l| l.strip_prefix("read_bytes: ")).expect("read_bytes").trim().parse().unwrap()
}

#[test]
fn a_write_through_the_page_cache_after_a_direct_one_in_the_same_block_reads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let (log, _) = FileLogDevice::open_or_create(&path, 1 << 20, RawLog::Off).unwrap();
    if log.through_page_cache.is_none() || !log.direct {
        eprintln!("skipped: {} takes no O_DIRECT, every log write goes through the page cache", dir.path().display());
        return;
    }
    let (block, fs_block) = (log.block_bytes as u64, log.fs_block_bytes);
    if block >= fs_block {
        eprintln!("skipped: log blocks of {block} bytes fill the file system's blocks of {fs_block}");
        return;
    }
    let at = 2 * fs_block;
    log.write_at(at, &vec![1; block as usize]).unwrap();
    let read_before = device_bytes_read_by_this_thread();
    let free = 1 << 16;
    log.write_unflushed_at(at + block, &vec![2; block as usize], free).unwrap();
    log.write_unflushed_at(at + 2 * block, &vec![3; block as usize], free).unwrap();
    assert_eq!(device_bytes_read_by_this_thread(), read_before, "the page was written whole, not read first");
    log.sync().unwrap();
    let bytes = log.read_at(at, fs_block as usize).unwrap();
    let b = block as usize;
    assert!(bytes[..b].iter().all(|&x| x == 1), "the direct write's bytes stay");
    assert!(bytes[b..2 * b].iter().all(|&x| x == 2));
    assert!(bytes[2 * b..3 * b].iter().all(|&x| x == 3));
    assert!(bytes[3 * b..].iter().all(|&x| x == 0), "what the ring holds nothing of yet is zeros");
    // A ring nearly full: the oldest batch kept starts right after the next write.
    let next = at + fs_block;
    log.write_at(next + 2 * block, &vec![7; block as usize]).unwrap();
    log.write_at(next, &vec![4; block as usize]).unwrap();
    log.write_unflushed_at(next + block, &vec![8; block as usize], 0).unwrap();
    log.sync().unwrap();
    let bytes = log.read_at(next, 3 * b).unwrap();
    assert!(bytes[..b].iter().all(|&x| x == 4));
    assert!(bytes[b..2 * b].iter().all(|&x| x == 8));
    assert!(bytes[2 * b..].iter().all(|&x| x == 7), "no padding over a batch the log keeps");
}

#[test]
fn a_write_through_the_page_cache_where_the_block_before_is_unknown_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let (log, _) = FileLogDevice::open_or_create(&path, 1 << 20, RawLog::Off).unwrap();
    let block = log.block_bytes as u64;
    let at = 4 * log.fs_block_bytes;
    log.write_at(at, &vec![5; block as usize]).unwrap();
    // A superblock write in between: the block the log wrote last is another one now.
    log.write_at(0, &vec![9; block as usize]).unwrap();
    log.write_unflushed_at(at + block, &vec![6; block as usize], 1 << 16).unwrap();
    log.sync().unwrap();
    let bytes = log.read_at(at, 2 * block as usize).unwrap();
    assert!(bytes[..block as usize].iter().all(|&x| x == 5), "the block before, unknown to the writer, stays");
    assert!(bytes[block as usize..].iter().all(|&x| x == 6));
    let after_failure = FileLogDevice::open_or_create(&path, 1 << 20, RawLog::Off).unwrap().0;
    after_failure.remember_write(at, None);
    assert!(
        after_failure.widened_to_fs_blocks(at + block, &[0; 512], 1 << 16).is_none(),
        "after a failed write nothing is assumed"
    );
}
