//! The memory of the write buffer: one aligned buffer per unit, and the dirty byte ranges in it.
//!
//! Owns: allocation (aligned for O_DIRECT) and range bookkeeping. Must not: decide when to
//! flush or block; `writeback.rs` does.

use std::ops::Range;

/// O_DIRECT wants memory aligned to the logical block size; a page covers every device.
pub const BUFFER_ALIGN_BYTES: usize = 4096;

/// A zeroed, page-aligned byte buffer of one unit, mapped straight from the kernel and
/// unmapped on drop: the malloc heap would keep freed units (its mmap threshold rises after
/// the first large free), and the memory bound is about resident memory, not bookkeeping.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// The buffer is plain memory owned by one value; moving it between threads is safe.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> AlignedBuf {
        assert!(len > 0 && len % BUFFER_ALIGN_BYTES == 0, "unit buffers are whole pages: {len}");
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(ptr != libc::MAP_FAILED, "out of memory for a {len}-byte unit buffer");
        AlignedBuf { ptr: ptr.cast(), len }
    }

    pub fn as_slice(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Sorted, disjoint, non-adjacent byte ranges (offsets within one unit).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RangeSet {
    ranges: Vec<Range<u64>>,
}

impl RangeSet {
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Range<u64>> {
        self.ranges.iter()
    }

    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }

    /// Adds `r`, merging with every range it overlaps or touches.
    pub fn insert(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        let mut merged = r;
        let mut out = Vec::with_capacity(self.ranges.len() + 1);
        let mut placed = false;
        for existing in self.ranges.drain(..) {
            if existing.end < merged.start {
                out.push(existing);
            } else if existing.start > merged.end {
                if !placed {
                    out.push(merged.clone());
                    placed = true;
                }
                out.push(existing);
            } else {
                merged = merged.start.min(existing.start)..merged.end.max(existing.end);
            }
        }
        if !placed {
            out.push(merged);
        }
        self.ranges = out;
        debug_assert!(self.ranges.windows(2).all(|w| w[0].end < w[1].start));
    }

    /// Removes everything at or after `end`.
    pub fn clip_end(&mut self, end: u64) {
        self.ranges.retain(|r| r.start < end);
        if let Some(last) = self.ranges.last_mut() {
            last.end = last.end.min(end);
        }
    }

    /// Whether [start, end) is wholly inside one range.
    pub fn covers(&self, start: u64, end: u64) -> bool {
        start >= end || self.ranges.iter().any(|r| r.start <= start && end <= r.end)
    }

    /// The parts of `self` not in `other`.
    pub fn minus(&self, other: &RangeSet) -> RangeSet {
        let mut out = RangeSet::default();
        for r in &self.ranges {
            let mut start = r.start;
            for o in other.ranges.iter().filter(|o| o.end > r.start && o.start < r.end) {
                if o.start > start {
                    out.ranges.push(start..o.start);
                }
                start = start.max(o.end);
            }
            if start < r.end {
                out.ranges.push(start..r.end);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ranges: &[(u64, u64)]) -> RangeSet {
        let mut s = RangeSet::default();
        for &(a, b) in ranges {
            s.insert(a..b);
        }
        s
    }

    #[test]
    fn insert_merges_overlapping_and_touching_ranges() {
        let s = set(&[(10, 20), (30, 40), (20, 25), (50, 60), (35, 55)]);
        assert_eq!(s.iter().cloned().collect::<Vec<_>>(), vec![10..25, 30..60]);
        assert_eq!(s.bytes(), 45);
        assert!(s.covers(31, 59) && !s.covers(24, 31));
    }

    #[test]
    fn clip_and_minus() {
        let mut s = set(&[(0, 10), (20, 30)]);
        assert_eq!(s.minus(&set(&[(5, 22)])).iter().cloned().collect::<Vec<_>>(), vec![0..5, 22..30]);
        s.clip_end(25);
        assert_eq!(s.iter().cloned().collect::<Vec<_>>(), vec![0..10, 20..25]);
        s.clip_end(5);
        assert_eq!(s.iter().cloned().collect::<Vec<_>>(), vec![0..5]);
    }

    #[test]
    fn aligned_buffers_are_aligned_and_zeroed() {
        let mut b = AlignedBuf::zeroed(1 << 20);
        assert_eq!(b.as_slice().as_ptr() as usize % BUFFER_ALIGN_BYTES, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[5] = 1;
        assert_eq!(b.as_slice()[5], 1);
    }
}
