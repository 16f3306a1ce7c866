//! What the stores that keep a tree of their own (`memory`, `sqlite`) share: a log key made of
//! an object's id and its birth (the generation that made it: an id given out again never
//! finds the older object, contract rule 4), and the names every such store refuses.

use std::ffi::OsStr;

use crate::engine::types::ObjectId;
use crate::sys::{Errno, SysResult};

/// The log key of object `id` born in generation `birth`: 16 bytes, both little-endian.
pub fn key(id: ObjectId, birth: u64) -> Vec<u8> {
    let mut key = id.to_le_bytes().to_vec();
    key.extend_from_slice(&birth.to_le_bytes());
    key
}

/// The id and birth a `key` holds; None for bytes no such store wrote.
pub fn parse_key(key: &[u8]) -> Option<(ObjectId, u64)> {
    Some((u64::from_le_bytes(key.get(..8)?.try_into().ok()?), u64::from_le_bytes(key.get(8..16)?.try_into().ok()?)))
}

/// EINVAL for a name no directory entry can have (empty, with a slash, `.` or `..`).
pub fn check_name(name: &OsStr) -> SysResult<()> {
    let bytes = name.as_encoded_bytes();
    if bytes.is_empty() || bytes.contains(&b'/') || name == "." || name == ".." {
        return Err(Errno(libc::EINVAL));
    }
    Ok(())
}
