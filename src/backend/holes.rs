//! Holes in a store of units (the SQLite and S3 stores): a unit the store holds nothing for is
//! a hole. What a hole punch does to which units, and where SEEK_DATA and SEEK_HOLE land, a
//! unit at a time, computed once for every such store.

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
}
