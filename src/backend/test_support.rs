//! What the in-process tests of unit stores share: a file's bytes written as whole units, and
//! read back whole.

use super::{FileData, UnitWrite};
use crate::engine::buffer::RangeSet;
use crate::sys::SysResult;

/// Writes `bytes` into `data` as whole units of `unit_bytes` (the last cut at the end), as the
/// engine's flushers hand a store of whole units.
pub fn write_whole(data: &dyn FileData, unit_bytes: u64, bytes: &[u8]) -> SysResult<()> {
    let size = bytes.len() as u64;
    for unit in 0..size.div_ceil(unit_bytes) {
        let start = (unit * unit_bytes) as usize;
        let mut buf = vec![0u8; unit_bytes as usize];
        let end = (start + unit_bytes as usize).min(bytes.len());
        buf[..end - start].copy_from_slice(&bytes[start..end]);
        let mut ranges = RangeSet::default();
        ranges.insert(0..(end - start) as u64);
        data.write_unit(&UnitWrite { unit, unit_bytes, buf: &buf, ranges: &ranges, size })?;
    }
    Ok(())
}

/// Every byte of the file.
pub fn read_all(data: &dyn FileData) -> Vec<u8> {
    let mut buf = vec![0u8; data.size().unwrap() as usize + 100];
    let n = data.read_at(&mut buf, 0).unwrap();
    buf.truncate(n);
    buf
}
