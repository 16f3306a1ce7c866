//! Backends store; they never decide. The engine plans every write from what a backend says it
//! can take, so the description below must stay honest as SQLite and the S3 API arrive:
//! a local file accepts aligned partial writes in place; an object store takes only whole
//! objects; a SQLite row is rewritten whole.
//!
//! Only the local-directory backend exists today; the engine uses it directly until a second
//! backend gives a trait its real shape. `DataStore::Null` is the one variation so far: the
//! same directory for names and attributes, nowhere for data.

mod aio;
pub mod faults;
pub mod local;

use std::fs::File;
use std::sync::Mutex;

use crate::sys::SysResult;

/// Where the flushers' bytes go. `Null` (`-o backend=null`) accepts and counts them and stores
/// nothing: names, sizes and attributes still live in the backing directory, and data reads
/// back as zeros. It measures this machine's FUSE and engine ceiling, as the null-sink server
/// of seed 001 did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataStore {
    Local,
    Null,
}

impl DataStore {
    pub fn write_at(self, file: &File, bytes: &[u8], offset: u64) -> SysResult<()> {
        match self {
            DataStore::Local => local::data::write_at(file, bytes, offset),
            DataStore::Null => extend_to(file, offset + bytes.len() as u64),
        }
    }

    /// Aligned pieces for a file opened with O_DIRECT, all in flight at once; each piece's
    /// result, in order.
    pub fn write_many_direct(self, file: &File, pieces: &[(&[u8], u64)]) -> Vec<SysResult<()>> {
        match self {
            DataStore::Local => local::data::write_many_direct(file, pieces),
            DataStore::Null => {
                let end = pieces.iter().map(|(bytes, offset)| offset + bytes.len() as u64).max().unwrap_or(0);
                let extended = extend_to(file, end);
                pieces.iter().map(|_| extended).collect()
            }
        }
    }
}

/// The null store's only write: the file's length, so that sizes stay true. Serialised, so
/// that two flushers extending one file never shorten it between their stat and truncate.
fn extend_to(file: &File, end: u64) -> SysResult<()> {
    static EXTENDING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = EXTENDING.lock().unwrap_or_else(|p| p.into_inner());
    if local::data::stat(file)?.st_size as u64 >= end {
        return Ok(());
    }
    local::data::set_len(file, end)
}

