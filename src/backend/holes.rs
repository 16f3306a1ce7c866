//! Holes in a store of units (the SQLite and S3 stores): a unit the store holds nothing for is
//! a hole. What a hole punch does to which units, where SEEK_DATA and SEEK_HOLE land, and which
//! units a copy_file_range can copy whole, a unit at a time, computed once for every such store.

use std::ops::{Range, RangeInclusive};

use crate::sys::{Errno, SysResult};

/// What a hole punched over `[offset, offset + length)` of a file of `size` bytes does to its
/// units: the units at its ends it covers only part of get those bytes zeroed, the ones it
/// covers up to their end (or the file's) lose all they hold.
#[derive(Debug, PartialEq, Eq)]
pub struct Punch {
    /// Units and the bytes in them to zero (offsets within the unit).
    pub partial: Vec<(u64, Range<u64>)>,
    /// Units to drop whole.
    pub whole: Option<RangeInclusive<u64>>,
}

impl Punch {
    /// None where the hole covers no byte of the file (past its end, or empty).
    pub fn plan(offset: u64, length: u64, size: u64, unit_bytes: u64) -> Option<Punch> {
        assert!(unit_bytes > 0, "units of no bytes");
        let end = offset.saturating_add(length).min(size);
        if offset >= end {
            return None;
        }
        let u = unit_bytes;
        let within = |unit: u64| {
            let start = unit * u;
            (offset.max(start) - start)..(end.min(start + u) - start)
        };
        let whole = |unit: u64| {
            let range = within(unit);
            range.start == 0 && range.end == u.min(size - unit * u)
        };
        let (first, last) = (offset / u, (end - 1) / u);
        let ends = if first == last { vec![first] } else { vec![first, last] };
        let partial = ends.into_iter().filter(|&unit| !whole(unit)).map(|unit| (unit, within(unit))).collect();
        let whole_first = if whole(first) { first } else { first + 1 };
        let whole_last = if whole(last) { Some(last) } else { last.checked_sub(1) };
        let whole = whole_last.filter(|&l| l >= whole_first).map(|l| whole_first..=l);
        Some(Punch { partial, whole })
    }
}

/// lseek(2)'s SEEK_DATA or SEEK_HOLE from `offset` in a file of `size` bytes, `units_with_data`
/// the units that hold data from `offset`'s unit on, ascending (each at most once); a unit with
/// data is data to its end (or the file's). Reads them only as far as the answer: `cp`
/// alternates the two through a sparse file.
pub fn seek(
    offset: i64,
    whence: i32,
    size: u64,
    unit_bytes: u64,
    units_with_data: impl IntoIterator<Item = SysResult<u64>>,
) -> SysResult<i64> {
    if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE {
        return Err(Errno(libc::EINVAL));
    }
    let offset = u64::try_from(offset).ok().filter(|&offset| offset < size).ok_or(Errno(libc::ENXIO))?;
    let mut units = units_with_data.into_iter();
    let found = if whence == libc::SEEK_DATA {
        match units.next() {
            Some(unit) => offset.max(unit? * unit_bytes),
            None => size,
        }
    } else {
        let mut hole = offset / unit_bytes;
        for unit in units {
            let unit = unit?;
            if unit > hole {
                break;
            }
            hole = unit + 1;
        }
        offset.max(hole.saturating_mul(unit_bytes))
    };
    match found >= size {
        true if whence == libc::SEEK_DATA => Err(Errno(libc::ENXIO)),
        true => Ok(size as i64),
        false => Ok(found as i64),
    }
}

/// A copy_file_range a store of units does by copying what it holds for whole units (SQLite
/// rows, object records) from one file to another: source units `source_first..source_first +
/// units` become target units `target_first..`, a hole a hole. `bytes` is what the call answers
/// (the caller asks again for the rest).
#[derive(Debug, PartialEq, Eq)]
pub struct UnitCopy {
    pub source_first: u64,
    pub target_first: u64,
    pub units: u64,
    pub bytes: u64,
}

impl UnitCopy {
    /// The copy of up to `length` bytes from `source_offset` of a file of `source_size` bytes
    /// to `target_offset` of one of `target_size` (the same file when `same_file`), at most
    /// `max_bytes` at once. Ok(None) where there is nothing to copy (no length, or the source
    /// offset at or past its end: copy_file_range answers 0). EOPNOTSUPP where whole units
    /// cannot do it, on which the kernel copies the range through reads and writes: an offset
    /// off a unit boundary, or less than a unit left that is not the source's end or that the
    /// target holds bytes after (a copied unit replaces the target's whole). A unit cut short
    /// at the source's end is copied as it stands: it holds nothing past that end.
    pub fn plan(
        (source_offset, source_size): (u64, u64),
        (target_offset, target_size): (u64, u64),
        length: u64,
        unit_bytes: u64,
        max_bytes: u64,
        same_file: bool,
    ) -> SysResult<Option<UnitCopy>> {
        let u = unit_bytes;
        assert!(u > 0 && max_bytes >= u, "units of {u} bytes, at most {max_bytes} at once");
        if length == 0 || source_offset >= source_size {
            return Ok(None);
        }
        if source_offset % u != 0 || target_offset % u != 0 {
            return Err(Errno(libc::EOPNOTSUPP));
        }
        let mut bytes = length.min(source_size - source_offset).min(max_bytes / u * u);
        let to_source_end = source_offset + bytes == source_size;
        let target_end = target_offset.checked_add(bytes).ok_or(Errno(libc::EFBIG))?;
        if bytes % u != 0 && !(to_source_end && target_size <= target_end) {
            bytes -= bytes % u;
        }
        if bytes == 0 {
            return Err(Errno(libc::EOPNOTSUPP));
        }
        let units = bytes.div_ceil(u);
        let (source_first, target_first) = (source_offset / u, target_offset / u);
        // The kernel refuses overlapping ranges of one file (EINVAL); whole units of ranges that
        // do not overlap do not either, and a copy that read units it had written would be wrong.
        if same_file && source_first < target_first + units && target_first < source_first + units {
            return Err(Errno(libc::EINVAL));
        }
        Ok(Some(UnitCopy { source_first, target_first, units, bytes }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_punch_zeroes_its_ends_and_drops_the_units_it_covers_to_their_end_or_the_files() {
        // Half of unit 0 to half of unit 3, in a file of 4 units and 100 bytes.
        let plan = Punch::plan(50, 300, 4 * 100 + 100, 100).unwrap();
        assert_eq!(plan, Punch { partial: vec![(0, 50..100), (3, 0..50)], whole: Some(1..=2) });
        // Within one unit.
        assert_eq!(Punch::plan(10, 20, 1000, 100).unwrap(), Punch { partial: vec![(0, 10..30)], whole: None });
        // To past the end: the short last unit goes whole.
        assert_eq!(
            Punch::plan(150, 1000, 250, 100).unwrap(),
            Punch { partial: vec![(1, 50..100)], whole: Some(2..=2) }
        );
        assert_eq!(Punch::plan(0, 1000, 250, 100).unwrap(), Punch { partial: vec![], whole: Some(0..=2) });
        assert_eq!(Punch::plan(300, 10, 250, 100), None, "past the end");
    }

    #[test]
    fn seeks_answer_a_unit_at_a_time_and_enxio_past_the_end() {
        let units = |list: &[u64]| list.iter().map(|&u| Ok(u)).collect::<Vec<_>>();
        assert_eq!(seek(0, libc::SEEK_DATA, 1000, 100, units(&[3, 4, 7])), Ok(300));
        assert_eq!(seek(350, libc::SEEK_HOLE, 1000, 100, units(&[3, 4, 7])), Ok(500));
        assert_eq!(seek(250, libc::SEEK_HOLE, 1000, 100, units(&[3])), Ok(250), "a hole where it is asked");
        assert_eq!(seek(750, libc::SEEK_HOLE, 780, 100, units(&[7])), Ok(780), "the end is a hole");
        assert_eq!(seek(800, libc::SEEK_DATA, 1000, 100, units(&[])), Err(Errno(libc::ENXIO)));
        assert_eq!(seek(1000, libc::SEEK_HOLE, 1000, 100, units(&[])), Err(Errno(libc::ENXIO)));
        assert_eq!(seek(-1, libc::SEEK_DATA, 1000, 100, units(&[])), Err(Errno(libc::ENXIO)));
        assert_eq!(seek(0, libc::SEEK_SET, 1000, 100, units(&[])), Err(Errno(libc::EINVAL)));
    }

    #[test]
    fn a_copy_takes_whole_units_or_the_source_to_its_end_and_leaves_the_rest_to_the_kernel() {
        let plan = |source, target, length, max| UnitCopy::plan(source, target, length, 100, max, false);
        let copy =
            |source_first, target_first, units, bytes| Ok(Some(UnitCopy { source_first, target_first, units, bytes }));
        // Whole units, at most `max_bytes` (rounded down to units) at once.
        assert_eq!(plan((200, 1000), (0, 0), 500, 1000), copy(2, 0, 5, 500));
        assert_eq!(plan((0, 1000), (300, 0), 1000, 450), copy(0, 3, 4, 400));
        // A source cut short: to its end as it stands, where the target holds nothing after.
        assert_eq!(plan((200, 250), (100, 120), 1000, 1000), copy(2, 1, 1, 50));
        assert_eq!(plan((0, 250), (0, 999), 1000, 1000), copy(0, 0, 2, 200), "the target has more: whole units");
        assert_eq!(plan((0, 1000), (0, 0), 250, 1000), copy(0, 0, 2, 200), "not the source's end");
        assert_eq!(plan((0, 1000), (0, 0), 50, 1000), Err(Errno(libc::EOPNOTSUPP)), "less than a unit");
        assert_eq!(plan((10, 1000), (0, 0), 500, 1000), Err(Errno(libc::EOPNOTSUPP)), "off a boundary");
        assert_eq!(plan((0, 1000), (10, 0), 500, 1000), Err(Errno(libc::EOPNOTSUPP)));
        assert_eq!(plan((1000, 1000), (0, 0), 500, 1000), Ok(None), "at the source's end");
        assert_eq!(plan((0, 1000), (0, 0), 0, 1000), Ok(None));
        // Within one file, ranges apart.
        assert_eq!(UnitCopy::plan((0, 1000), (500, 1000), 300, 100, 1000, true), copy(0, 5, 3, 300));
        assert_eq!(UnitCopy::plan((0, 1000), (200, 1000), 300, 100, 1000, true), Err(Errno(libc::EINVAL)));
    }
}
