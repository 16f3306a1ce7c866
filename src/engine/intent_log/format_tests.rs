use super::*;

#[test]
fn crc32c_matches_the_standard_check_value() {
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c_extend(crc32c(b"1234"), b"56789"), 0xE306_9283);
}

#[test]
fn superblocks_round_trip_and_the_newest_intact_copy_counts() {
    for block_bytes in [512, 4096, 65536] {
        let old = Superblock {
            block_bytes,
            generation: 6,
            area_blocks: 100,
            checkpoint_seq: 40,
            checkpoint_block: 7,
            closed_clean: false,
        };
        let new = Superblock { generation: 7, checkpoint_seq: 45, checkpoint_block: 20, closed_clean: true, ..old };
        assert_eq!(old.encode().len(), block_bytes as usize);
        assert_eq!(Superblock::decode(&old.encode()), Some(old));
        assert_eq!(Superblock::newest([&old.encode(), &new.encode()]), Some(new));
        let mut torn = new.encode();
        torn[33] ^= 1;
        assert_eq!(Superblock::newest([&old.encode(), &torn]), Some(old), "a torn newer copy leaves the older");
        assert_eq!(Superblock::newest([&torn, &vec![0u8; block_bytes as usize]]), None);
        // In a file: the copies are blocks 0 and 1, found whatever the block size, even
        // when the first copy is torn.
        let file = |first: &[u8], second: &[u8]| [first, second, &[0u8; 1024][..]].concat();
        assert_eq!(Superblock::find(&file(&new.encode(), &old.encode())), Some(new));
        assert_eq!(Superblock::find(&file(&torn, &old.encode())), Some(old), "{block_bytes}");
        assert_eq!(Superblock::find(&file(&torn, &torn)), None);
    }
    let odd = Superblock {
        block_bytes: 4096,
        generation: 1,
        area_blocks: 10,
        checkpoint_seq: 1,
        checkpoint_block: 0,
        closed_clean: false,
    };
    let mut bytes = odd.encode();
    bytes[12..16].copy_from_slice(&3000u32.to_le_bytes());
    let crc = crc32c(&bytes[..SUPERBLOCK_BYTES_COVERED]);
    bytes[48..52].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(Superblock::decode(&bytes), None, "a block size that is no power of two");
}

/// The clean-close flag is an extension with a checksum of its own: a superblock written by a
/// build without it (zeros after the version 1 checksum) decodes as before, not closed clean,
/// and so does one whose extension is damaged; the rest of it still counts.
#[test]
fn a_superblock_says_closed_clean_only_where_its_extension_is_intact() {
    let clean = Superblock {
        block_bytes: 512,
        generation: 3,
        area_blocks: 10,
        checkpoint_seq: 9,
        checkpoint_block: 4,
        closed_clean: true,
    };
    assert_eq!(Superblock::decode(&clean.encode()), Some(clean));
    let not_clean = Superblock { closed_clean: false, ..clean };
    let mut older_build = clean.encode();
    older_build[SUPERBLOCK_FLAGS_AT..SUPERBLOCK_EXTENSION_COVERED + 4].fill(0);
    assert_eq!(Superblock::decode(&older_build), Some(not_clean), "a version 1 superblock");
    let mut damaged = clean.encode();
    damaged[SUPERBLOCK_EXTENSION_COVERED] ^= 1;
    assert_eq!(Superblock::decode(&damaged), Some(not_clean), "a damaged extension says nothing");
}

/// The writer's placement rule, for building test logs: a batch that does not fit before
/// the end of the area goes to block 0, after a wrap batch when a block is left.
struct TestLog {
    area: Vec<u8>,
    sb: Superblock,
    next_block: u64,
    next_seq: u64,
    written: Vec<Batch>,
    /// Block ranges of each written data batch, in `written` order.
    places: Vec<(u64, u64)>,
}

impl TestLog {
    fn new(block_bytes: usize, area_blocks: u64, first_seq: u64, first_block: u64) -> TestLog {
        let sb = Superblock {
            block_bytes: block_bytes as u32,
            generation: 1,
            area_blocks,
            checkpoint_seq: first_seq,
            checkpoint_block: first_block,
            closed_clean: false,
        };
        TestLog {
            area: vec![0u8; area_blocks as usize * block_bytes],
            sb,
            next_block: first_block,
            next_seq: first_seq,
            written: Vec::new(),
            places: Vec::new(),
        }
    }

    fn put(&mut self, block: u64, bytes: &[u8]) {
        let at = block as usize * self.block();
        self.area[at..at + bytes.len()].copy_from_slice(bytes);
    }

    fn block(&self) -> usize {
        self.sb.block_bytes as usize
    }

    fn append(&mut self, records: Vec<Record>) {
        let blocks = batch_blocks(&records, self.block());
        assert!(blocks < self.sb.area_blocks);
        if self.next_block + blocks > self.sb.area_blocks {
            if self.next_block < self.sb.area_blocks {
                let wrap = encode_wrap(self.next_seq, 0, self.block());
                self.put(self.next_block, &wrap);
                self.next_seq += 1;
            }
            self.next_block = 0;
        }
        let bytes = encode_batch(self.next_seq, &records, self.block());
        self.put(self.next_block, &bytes);
        self.places.push((self.next_block, blocks));
        self.written.push(Batch { seq: self.next_seq, records });
        self.next_block += blocks;
        self.next_seq += 1;
    }
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

fn key(n: u64) -> Vec<u8> {
    n.to_le_bytes()[..1 + (n % 8) as usize].to_vec()
}

fn random_records(rng: &mut Rng) -> Vec<Record> {
    (0..1 + rng.below(6))
        .map(|_| match rng.below(10) {
            0 => Record::Size { file: key(rng.below(50)), size: rng.below(1 << 40) },
            6 => Record::Hidden { file: key(rng.below(50)), parent: key(rng.below(50)), name: key(rng.below(1 << 30)) },
            1 if rng.below(4) == 0 => Record::NamesSynced { dir: key(rng.below(50)), before_seq: rng.below(1 << 40) },
            1 => Record::Barrier { file: key(rng.below(50)) },
            2 => Record::Create {
                file: key(rng.below(50)),
                parent: key(rng.below(50)),
                name: key(rng.below(1 << 30)),
                mode: rng.below(0o170000) as u32,
                uid: rng.below(70000) as u32,
                gid: rng.below(70000) as u32,
            },
            3 => Record::Unlink {
                file: key(rng.below(50)),
                parent: key(rng.below(50)),
                name: key(rng.below(1 << 30)),
                directory: rng.below(2) == 1,
            },
            4 => Record::Rename {
                file: key(rng.below(50)),
                from_parent: key(rng.below(50)),
                from_name: key(rng.below(1 << 30)),
                to_parent: key(rng.below(50)),
                to_name: key(rng.below(1 << 30)),
                replaced: if rng.below(2) == 0 { Vec::new() } else { key(rng.below(50)) },
            },
            7 => Record::Link { file: key(rng.below(50)), parent: key(rng.below(50)), name: key(rng.below(1 << 30)) },
            5 => Record::Attrs {
                file: key(rng.below(50)),
                mode: rng.below(0o170000) as u32,
                uid: rng.below(70000) as u32,
                gid: rng.below(70000) as u32,
                atime: Timestamp { sec: rng.below(1 << 40) as i64 - (1 << 39), nsec: rng.below(1_000_000_000) as u32 },
                mtime: Timestamp { sec: rng.below(1 << 40) as i64, nsec: rng.below(1_000_000_000) as u32 },
            },
            _ => Record::Data {
                file: key(rng.below(50)),
                offset: rng.below(1 << 40),
                bytes: (0..rng.below(9000)).map(|_| rng.below(256) as u8).collect(),
            },
        })
        .collect()
}

/// A log that has gone round its ring: starts mid-area, wraps, ends before the start; of
/// 512-byte or 4 KiB blocks.
fn random_log(rng: &mut Rng) -> TestLog {
    let block_bytes = if rng.below(2) == 0 { 512 } else { 4096 };
    let area_blocks = (24 + rng.below(40)) * 4096 / block_bytes as u64;
    let mut log = TestLog::new(block_bytes, area_blocks, 1000 + rng.below(1000), rng.below(area_blocks));
    let mut used = 0;
    loop {
        let records = random_records(rng);
        let blocks = batch_blocks(&records, block_bytes);
        let wrap_waste = if log.next_block + blocks > area_blocks { area_blocks - log.next_block } else { 0 };
        // The ring never runs into its own checkpoint.
        if used + wrap_waste + blocks >= area_blocks {
            break;
        }
        used += wrap_waste + blocks;
        log.append(records);
    }
    log
}

#[test]
fn an_intact_log_reads_back_whole_across_the_wrap() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..300 {
        let log = random_log(&mut rng);
        let read = read_log(&log.area, &log.sb).unwrap();
        assert_eq!(read.batches, log.written);
        assert_eq!(
            (read.next_seq, read.next_block % log.sb.area_blocks),
            (log.next_seq, log.next_block % log.sb.area_blocks)
        );
    }
}

#[test]
fn a_torn_last_batch_ends_the_log_and_loses_nothing_before_it() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for _ in 0..300 {
        let mut log = random_log(&mut rng);
        let Some(&(start, blocks)) = log.places.last() else { continue };
        // Any prefix of the batch's blocks written, the rest as they were (zeros here).
        let block = log.block();
        let kept = rng.below(blocks * block as u64) as usize;
        let at = start as usize * block;
        log.area[at + kept..at + blocks as usize * block].fill(0);
        let read = read_log(&log.area, &log.sb).unwrap();
        let whole = read.batches.len() == log.written.len();
        assert!(
            whole || read.batches[..] == log.written[..log.written.len() - 1],
            "a prefix, and only the last may go"
        );
        if whole {
            assert_eq!(read.batches, log.written, "a batch reads back only as written");
        }
    }
}

/// Bit flips, garbage blocks and zeroed blocks anywhere in the area: the reader never
/// panics and never returns a record that was not written; when it loses a batch that has
/// later batches after it, it reports corruption instead.
#[test]
fn damage_anywhere_is_detected_or_harmless_never_accepted() {
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    for round in 0..2000 {
        let mut log = random_log(&mut rng);
        for _ in 0..1 + rng.below(3) {
            let size = log.block();
            let block = rng.below(log.sb.area_blocks) as usize;
            let at = block * size;
            match rng.below(3) {
                0 => {
                    let bit = rng.below(size as u64 * 8) as usize;
                    log.area[at + bit / 8] ^= 1 << (bit % 8);
                }
                1 => {
                    for b in &mut log.area[at..at + size] {
                        *b = rng.below(256) as u8;
                    }
                }
                _ => log.area[at..at + size].fill(0),
            }
        }
        match read_log(&log.area, &log.sb) {
            Ok(read) => {
                assert!(read.batches.len() <= log.written.len());
                assert_eq!(read.batches[..], log.written[..read.batches.len()], "round {round}: only what was written");
                // Whatever was lost is a tail: no later batch survived.
                let lost = &log.written[read.batches.len()..];
                let later_survivor =
                    lost.iter().zip(&log.places[read.batches.len()..]).skip(1).any(|(b, &(start, _))| {
                        batch_at(&log.area, &log.sb, start).is_some_and(|(v, _)| v.seq == b.seq)
                    });
                assert!(!later_survivor, "round {round}: a lost batch had a surviving successor, not reported");
            }
            Err(c) => assert!(c.offset >= 2 * log.block() as u64 && !c.reason.is_empty()),
        }
    }
}

#[test]
fn salvage_takes_every_intact_batch_and_names_the_damaged_one() {
    let mut rng = Rng(7);
    for _ in 0..50 {
        let mut log = random_log(&mut rng);
        let intact = read_log(&log.area, &log.sb).expect("an intact log");
        if intact.batches.len() < 3 {
            continue;
        }
        let victim = rng.below(intact.batches.len() as u64 - 1) as usize;
        let (seq, block) = *intact.starts.iter().find(|(s, _)| *s == intact.batches[victim].seq).unwrap();
        let at = block as usize * log.block() + 30;
        log.area[at] ^= 0x01;
        assert!(read_log(&log.area, &log.sb).is_err(), "damage before the tail stops the normal reader");
        let salvage = salvage_log(&log.area, &log.sb);
        let mut expected = intact.batches.clone();
        expected.remove(victim);
        assert_eq!(salvage.contents.batches, expected, "every other batch, in order");
        assert_eq!(salvage.lost.len(), 1, "{:?}", salvage.lost);
        assert!(salvage.lost[0].contains(&format!("batches {seq} to {seq}")), "{:?}", salvage.lost);
        assert_eq!(salvage.contents.next_seq, intact.next_seq);
    }
}

#[test]
fn a_checksummed_batch_with_malformed_records_is_corruption() {
    let mut log = TestLog::new(LOG_BLOCK_BYTES, 16, 1, 0);
    let record = Record::Size { file: key(1), size: 2 };
    log.append(vec![record.clone()]);
    // Re-encode batch 1 claiming two records while holding one, with a valid checksum.
    let mut bytes = encode_batch(1, std::slice::from_ref(&record), LOG_BLOCK_BYTES);
    bytes[24..28].copy_from_slice(&2u32.to_le_bytes());
    let payload_end = BATCH_HEADER_BYTES + record.encoded_len();
    let crc = crc32c_extend(crc32c(&bytes[..BATCH_CRC_AT]), &bytes[BATCH_HEADER_BYTES..payload_end]);
    bytes[BATCH_CRC_AT..BATCH_HEADER_BYTES].copy_from_slice(&crc.to_le_bytes());
    log.put(0, &bytes);
    let err = read_log(&log.area, &log.sb).unwrap_err();
    assert_eq!(err.offset, 2 * LOG_BLOCK_BYTES as u64);
    assert!(err.reason.contains("cut short"), "{}", err.reason);
}
