//! The volatile tail: name changes of held files (a rename or unlink of a file only memory and
//! the log hold) kept in a file on tmpfs until the log's next batch carries them, instead of
//! a log block of their own.
//!
//! Such a change must survive a killed daemon, which the kernel outlives: the next mount
//! finds the file by the name its records leave it with. It need not survive a power cut any
//! more than ext4's rename does before its next journal commit (the table in SEMANTICS.md). A
//! file on tmpfs is kept exactly that long, and costs no device bytes: tmp + fsync + rename
//! then costs one log block (the fsync's, which carries the rename before it) where it cost
//! two.
//!
//! The file holds entries appended for one batch at a time: the records queued for the batch
//! the log will write next (`seq`), in queue order. The next mount that finds entries for the
//! batch its log would write next writes them into the log as that batch before replay
//! (`IntentLog::adopt_volatile_tail`); entries for an earlier batch were carried by it, and a
//! file of another boot is a power cut's leftover. Each entry has its own checksum, so a
//! write a kill cut short loses only itself (its caller was not answered).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::format::{crc32c, crc32c_extend, decode_records, encode_records, Record};

/// The volatile tail's file name, in the directory the daemon chooses for it (`runtime.rs`).
pub const VOLATILE_TAIL_FILE_NAME: &str = "volatile-tail";

const FILE_MAGIC: &[u8; 8] = b"CFSVTAL1";
/// The boot id's text (`/proc/sys/kernel/random/boot_id`, without its newline).
const BOOT_ID_BYTES: usize = 36;
/// The magic, the boot id, a checksum of both, zeros.
const FILE_HEADER_BYTES: usize = 64;
const ENTRY_MAGIC: u32 = 0x4c41_5456;
/// The magic, the batch's sequence number, the record count, the payload's length, and a
/// checksum of what comes before it in the header and of the payload.
const ENTRY_HEADER_BYTES: usize = 24;

pub struct VolatileTail {
    file: File,
    path: PathBuf,
    header: [u8; FILE_HEADER_BYTES],
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

impl VolatileTail {
    /// Opens the tail at `path` (made if missing, only the owner's), a file on a file system a
    /// power cut empties: the caller chose it (`runtime::volatile_tail_path`).
    pub fn open(path: &Path) -> io::Result<VolatileTail> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
        let boot_id = boot_id.trim().as_bytes();
        if boot_id.len() != BOOT_ID_BYTES {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a boot id of {} bytes", boot_id.len())));
        }
        let mut header = [0u8; FILE_HEADER_BYTES];
        header[..8].copy_from_slice(FILE_MAGIC);
        header[8..8 + BOOT_ID_BYTES].copy_from_slice(boot_id);
        let checked = 8 + BOOT_ID_BYTES;
        let crc = crc32c(&header[..checked]);
        header[checked..checked + 4].copy_from_slice(&crc.to_le_bytes());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        Ok(VolatileTail { file, path: path.to_path_buf(), header })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The records a killed daemon of this boot kept for the batch numbered one of `seqs`, in
    /// their order: none when the file is another boot's, or empty, or its entries are for
    /// another batch. Reading stops at the first entry that does not check out (the write a
    /// kill cut short: the last).
    pub fn read_for(&self, seqs: &[u64]) -> io::Result<Vec<Record>> {
        let bytes = std::fs::read(&self.path)?;
        if bytes.get(..FILE_HEADER_BYTES) != Some(&self.header[..]) {
            return Ok(Vec::new());
        }
        let mut records = Vec::new();
        let mut at = FILE_HEADER_BYTES;
        while let Some(header) = bytes.get(at..at + ENTRY_HEADER_BYTES) {
            if u32_at(header, 0) != ENTRY_MAGIC {
                break;
            }
            let entry_seq = u64::from_le_bytes(header[4..12].try_into().unwrap());
            let count = u32_at(header, 12);
            let payload_bytes = u32_at(header, 16) as usize;
            let Some(payload) = bytes.get(at + ENTRY_HEADER_BYTES..at + ENTRY_HEADER_BYTES + payload_bytes) else {
                break;
            };
            if crc32c_extend(crc32c(&header[..20]), payload) != u32_at(header, 20) {
                break;
            }
            if seqs.contains(&entry_seq) {
                match decode_records(payload, count) {
                    Ok(decoded) => records.extend(decoded),
                    // Written whole and malformed: a bug's trace, not a kill's.
                    Err(why) => {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("{}: an entry for batch {entry_seq}: {why}", self.path.display()),
                        ))
                    }
                }
            }
            at += ENTRY_HEADER_BYTES + payload_bytes;
        }
        Ok(records)
    }

    /// Empties the tail to its header (nothing in it is needed any more); returns where the
    /// next entry goes.
    pub fn reset(&self) -> io::Result<u64> {
        self.file.set_len(0)?;
        self.file.write_all_at(&self.header, 0)?;
        Ok(FILE_HEADER_BYTES as u64)
    }

    /// Appends an entry of `records` for batch `seq` at `end`, where the last one ended (or
    /// `reset` left it); returns the new end.
    pub fn append<'a>(&self, end: u64, seq: u64, records: impl IntoIterator<Item = &'a Record>) -> io::Result<u64> {
        assert!(end >= FILE_HEADER_BYTES as u64, "an entry at {end}, inside the header");
        let (count, payload) = encode_records(records);
        let payload_bytes = u32::try_from(payload.len()).expect("a queue of names is far below 4 GiB");
        let mut entry = Vec::with_capacity(ENTRY_HEADER_BYTES + payload.len());
        entry.extend_from_slice(&ENTRY_MAGIC.to_le_bytes());
        entry.extend_from_slice(&seq.to_le_bytes());
        entry.extend_from_slice(&count.to_le_bytes());
        entry.extend_from_slice(&payload_bytes.to_le_bytes());
        let crc = crc32c_extend(crc32c(&entry), &payload);
        entry.extend_from_slice(&crc.to_le_bytes());
        entry.extend_from_slice(&payload);
        self.file.write_all_at(&entry, end)?;
        Ok(end + entry.len() as u64)
    }

    /// At a clean unmount, the log empty: nothing is left for the tail to keep. Its directory
    /// goes too where that leaves it empty (one of its own under /dev/shm; the runtime
    /// directory keeps the daemon's log).
    pub fn remove(&self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                log::warn!("removing {}: {e}", self.path.display());
            }
        }
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rename(n: u8) -> Record {
        Record::Rename {
            file: vec![n; 8],
            from_parent: vec![1; 8],
            from_name: b"tmp".to_vec(),
            to_parent: vec![1; 8],
            to_name: vec![b'f', n],
            replaced: Vec::new(),
        }
    }

    /// A new, empty tail in a directory of its own (kept while the test runs), and its path.
    fn new_tail() -> (tempfile::TempDir, PathBuf, VolatileTail, u64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(VOLATILE_TAIL_FILE_NAME);
        let tail = VolatileTail::open(&path).unwrap();
        let end = tail.reset().unwrap();
        (dir, path, tail, end)
    }

    #[test]
    fn a_tail_gives_back_the_entries_of_the_batch_asked_for_up_to_the_first_cut_short() {
        let (_dir, path, tail, end) = new_tail();
        let end = tail.append(end, 5, &[rename(1), rename(2)]).unwrap();
        let end = tail.append(end, 5, &[rename(3)]).unwrap();
        let end = tail.append(end, 6, &[rename(4)]).unwrap();
        assert_eq!(tail.read_for(&[5]).unwrap(), [rename(1), rename(2), rename(3)]);
        assert_eq!(tail.read_for(&[6]).unwrap(), [rename(4)]);
        assert!(tail.read_for(&[7]).unwrap().is_empty());
        // A kill that cut the last write short: that entry is gone, the ones before it stay.
        let last = tail.append(end, 6, &[rename(5)]).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(last - 3).unwrap();
        assert_eq!(tail.read_for(&[6]).unwrap(), [rename(4)], "a torn entry is not read");
        // Reopened (the next daemon): the same boot reads it.
        assert_eq!(VolatileTail::open(&path).unwrap().read_for(&[5]).unwrap().len(), 3);
        tail.reset().unwrap();
        assert!(tail.read_for(&[5]).unwrap().is_empty(), "reset keeps nothing");
    }

    #[test]
    fn a_tail_of_another_boot_is_not_read() {
        let (_dir, path, tail, end) = new_tail();
        tail.append(end, 9, &[rename(1)]).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[8] ^= 0x01; // the boot id's first character
        std::fs::write(&path, &bytes).unwrap();
        assert!(tail.read_for(&[9]).unwrap().is_empty(), "a power cut's leftover was read");
    }
}
