//! The memory of the write buffer: one aligned buffer per unit, and the dirty byte ranges in it.
//!
//! Owns: allocation (aligned for O_DIRECT) and range bookkeeping. Must not: decide when to
//! flush or block; `writeback.rs` does.

use std::ops::Range;

/// O_DIRECT wants memory aligned to the logical block size; a page covers every device.
pub const BUFFER_ALIGN_BYTES: usize = 4096;

/// Transparent huge pages are 2 MiB with 4 KiB base pages (x86-64, arm64).
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Empty chunks kept mapped, per slot size. A stream of writes takes and frees units in turn,
/// and a fresh mapping costs a page fault and the kernel's zeroing of every page: a fifth of
/// the daemon's time when 4 MiB units streamed into the null backend at 1.5 GB/s.
const WARM_CHUNK_BYTES: usize = 8 << 20;

/// The smallest memory a unit holds; it grows fourfold from here as writes reach past it.
const FIRST_CAPACITY_BYTES: usize = 16 << 10;

/// A piece of a write whose pages are given (`WriteBytes::pages_given`) is taken rather than
/// copied only in whole huge pages, at huge-page boundaries on both sides: then each `mremap`
/// moves one page-table entry per 2 MiB. A piece of 4 KiB pages moves 256 entries per
/// megabyte, splits the huge pages around it and flushes the other CPU's TLB three times: 1 MiB
/// O_DIRECT writes into the null backend over /dev/fuse went from 0.59x the null sink to 0.75x
/// when such pieces were copied instead, 1 MiB buffered ones from 0.64x to 1.20x
/// (bench/results/2026-12-01-huge-page-exchange).
const EXCHANGE_GRAIN_BYTES: usize = HUGE_PAGE_BYTES;

/// The bytes of a write, and whether the unit may take their pages instead of copying them.
#[derive(Clone, Copy)]
pub struct WriteBytes<'a> {
    bytes: &'a [u8],
    /// See [`WriteBytes::pages_given`].
    pages_given: bool,
}

impl<'a> WriteBytes<'a> {
    /// Bytes the write buffer copies.
    pub fn copied(bytes: &'a [u8]) -> WriteBytes<'a> {
        WriteBytes { bytes, pages_given: false }
    }

    /// Bytes whose pages the write buffer may take: where a piece is whole huge pages of both
    /// its unit and `bytes` (`EXCHANGE_GRAIN_BYTES`), the unit's pages there and the bytes'
    /// pages change places (`pages::exchange`), and no byte is copied.
    ///
    /// # Safety
    /// `bytes` lies in private anonymous memory (`mmap` with MAP_PRIVATE | MAP_ANONYMOUS) that
    /// the caller owns: nothing else (another thread, the kernel, an I/O in flight) touches it
    /// until the write returns, nothing reads it afterwards, and the caller accepts that it
    /// then holds anything (another unit's stale bytes). Only the page mappings change: the
    /// range stays mapped, readable and writable.
    pub unsafe fn pages_given(bytes: &'a [u8]) -> WriteBytes<'a> {
        WriteBytes { bytes, pages_given: true }
    }

    pub fn as_slice(&self) -> &'a [u8] {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The bytes of `range`, given as these are.
    pub fn piece(&self, range: Range<usize>) -> WriteBytes<'a> {
        WriteBytes { bytes: &self.bytes[range], pages_given: self.pages_given }
    }
}

/// A zeroed, page-aligned byte buffer of one unit, mapped straight from the kernel, never
/// from the malloc heap (which keeps freed units: the memory bound is about resident memory).
///
/// A unit holds memory for the bytes written to it, not for the whole unit: it starts with
/// none, takes 16 KiB at its first write and grows fourfold (copying what it holds) as writes
/// reach further, up to the unit. A small file's unit in a whole 1 MiB slot cost a 2 MiB huge
/// page fault and its zeroing (~100 us) for every other file, whenever units stayed buffered
/// (the intent log holds fsynced data until the checkpoint): git's object writes on the
/// default mount spent 112 us per WRITE against 16 us without the log.
///
/// Memory comes in 2 MiB-aligned chunks of max(slot, 2 MiB) advised MADV_HUGEPAGE, several
/// small slots to a chunk. A slot inside one huge page is physically contiguous, so its
/// O_DIRECT write reaches the device as one request: from 4 KiB pages a device that takes 128
/// segments per request (a loop device, many SSDs) receives a 1 MiB unit as two 512 KiB
/// requests. Without huge pages (disabled, or memory too fragmented) the same chunks hold 4 KiB
/// pages. A free slot is reused before a new chunk is mapped. Empty chunks beyond
/// `WARM_CHUNK_BYTES` per slot size are unmapped once they stayed empty through a tick of the age
/// timer (`unmap_cold`), or at once when a chunk of another size is mapped: mapped memory stays
/// within the slots in use plus 8 MiB per size, and for a second or two after a peak the chunks
/// of that peak's size, which the next units of that size take before any new one is mapped.
pub struct AlignedBuf {
    /// Null while the unit holds no memory (`capacity` 0).
    ptr: *mut u8,
    /// The unit's length: every range it is asked for lies within.
    len: usize,
    /// The memory it holds, from its start: a slot of this size.
    capacity: usize,
    /// The unit's bytes end here: every byte at or past it reads as zero, whatever the slot
    /// holds there. Writes go through `write_at` and `range_mut`, which move it; a truncate
    /// inside the unit (`zero_from`) moves it back.
    touched: usize,
    /// The slot's bytes at or past this are zero in memory (at least `touched`): what this unit
    /// and the slot's earlier units wrote ends here. Nothing is zeroed until the unit's bytes
    /// reach into that stale memory, and then only the stretch they do not write themselves: a
    /// slot goes back to its chunk as it is (a 1 MiB memset per small file was 2 % of the
    /// daemon's time extracting a source tree), and a unit streamed in pieces zeroes nothing.
    stale_end: usize,
}

// SAFETY: the buffer owns its slot alone (no other value points into it, see `chunks`), and its raw
// pointer is only dereferenced through `&self`/`&mut self`, so it may move to another thread like
// the `Vec<u8>` it stands for.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only read the slot (`as_slice`); writes need `&mut self`, so sharing it
// between threads is as sound as sharing a `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A unit of `len` bytes, all zero, holding no memory yet.
    pub fn zeroed(len: usize) -> AlignedBuf {
        assert!(len > 0 && len % BUFFER_ALIGN_BYTES == 0, "unit buffers are whole pages: {len}");
        AlignedBuf { ptr: std::ptr::null_mut(), len, capacity: 0, touched: 0, stale_end: 0 }
    }

    /// The unit's bytes from its start to the end of the furthest write (or `range_mut`)
    /// since its last truncate: everything written to it, and zeros between. Bytes past it
    /// read as zeros.
    pub fn as_slice(&self) -> &[u8] {
        if self.touched == 0 {
            return &[];
        }
        // SAFETY: `touched <= capacity`, and `ptr` is a slot of `capacity` bytes taken from
        // `chunks::take`, owned by this buffer alone; its first `touched` bytes are initialised
        // (written, or zeroed by `span_mut` where stale), and the slice borrows `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.touched) }
    }

    /// The memory the unit holds, from its start.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.capacity
    }

    /// Every byte from `at` on reads as zero (a truncate inside the unit). Nothing is
    /// zeroed now: the bytes stay in the slot as stale memory, zeroed if a later write
    /// reaches past them without writing them.
    pub fn zero_from(&mut self, at: usize) {
        assert!(at <= self.len, "{at} outside a unit of {}", self.len);
        self.touched = self.touched.min(at);
    }

    /// The bytes of `range`, to write (they hold what was written there before, or zeros);
    /// with `write_at` and `zero_from`, the only ways to change the buffer.
    pub fn range_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        self.span_mut(range, false)
    }

    /// Copies `bytes` in at `at`. Unlike `range_mut`, the stale memory where the copy lands
    /// is not zeroed first: a unit written whole or in order is never zeroed at all.
    pub fn write_at(&mut self, at: usize, bytes: &[u8]) {
        let exchanged = self.write_taking(at, WriteBytes::copied(bytes));
        debug_assert!(!exchanged, "copied bytes are never exchanged");
    }

    /// Puts `bytes` in at `at` as `write_at` does, but by exchanging pages where they are given
    /// and the piece is whole huge pages on both sides (`EXCHANGE_GRAIN_BYTES`): the unit's
    /// pages there (its stale or overwritten bytes) go to the caller's memory. True when the
    /// pages were exchanged, false when the bytes were copied.
    pub fn write_taking(&mut self, at: usize, bytes: WriteBytes<'_>) -> bool {
        let source = bytes.as_slice();
        let whole_huge_pages = |address: usize| address % EXCHANGE_GRAIN_BYTES == 0;
        let target = self.span_mut(at..at + source.len(), true);
        let exchangeable = bytes.pages_given
            && !source.is_empty()
            && source.len() % EXCHANGE_GRAIN_BYTES == 0
            && whole_huge_pages(target.as_ptr() as usize)
            && whole_huge_pages(source.as_ptr() as usize);
        // SAFETY: `target` is this buffer's own slot memory (anonymous, private, page-aligned
        // chunks: `chunks::map_huge_aligned`), borrowed mutably so nothing else sees it during
        // the exchange; `source` is private anonymous memory the caller gave up for the write
        // (`WriteBytes::pages_given`'s contract); both are whole pages of the same length.
        if exchangeable && unsafe { pages::exchange(target.as_mut_ptr(), source.as_ptr().cast_mut(), source.len()) } {
            return true;
        }
        target.copy_from_slice(source);
        false
    }

    /// `range` within the buffer, grown to hold it; `overwritten`: the caller writes all of it
    /// before anything reads the buffer, so a new slot's leftover bytes there stay.
    fn span_mut(&mut self, range: Range<usize>, overwritten: bool) -> &mut [u8] {
        assert!(range.start <= range.end && range.end <= self.len, "{range:?} outside a unit of {}", self.len);
        if range.end > self.capacity {
            self.grow_to_hold(range.end, range.len());
        }
        // The unit's bytes now reach `range.end`: the stale memory between its old end and
        // there must read as zero, except what the caller is about to write.
        let zero_to = if overwritten { range.start } else { range.end };
        let stale = self.touched..zero_to.min(self.stale_end);
        if !stale.is_empty() {
            // SAFETY: `stale.end <= stale_end <= capacity`: the range lies within this buffer's
            // own slot; `&mut self` excludes any other borrow of it.
            unsafe { std::ptr::write_bytes(self.ptr.add(stale.start), 0, stale.len()) };
        }
        self.touched = self.touched.max(range.end);
        self.stale_end = self.stale_end.max(self.touched);
        // SAFETY: `grow_to_hold` made `range.end <= capacity`, so the range lies within this
        // buffer's own initialised slot, and the slice's lifetime is tied to `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start) }
    }

    /// Moves to a slot of at least `end` bytes: 16 KiB, then fourfold steps up to the unit,
    /// or the whole unit at once for a write of a quarter of it or more (a stream of writes
    /// smaller than the unit otherwise moved its first ones from slot to slot). What the unit
    /// holds moves along; the slot's other bytes stay as its last unit left them (stale,
    /// `stale_end`).
    fn grow_to_hold(&mut self, end: usize, write_bytes: usize) {
        let mut capacity = FIRST_CAPACITY_BYTES.min(self.len).max(self.capacity);
        if write_bytes >= self.len / 4 {
            capacity = self.len;
        }
        while capacity < end {
            capacity = (capacity * 4).min(self.len);
        }
        assert!(
            capacity % BUFFER_ALIGN_BYTES == 0 && capacity <= self.len,
            "a slot of {capacity} for a unit of {}",
            self.len
        );
        let (ptr, left_by_last_unit) = chunks::take(capacity);
        assert!(left_by_last_unit <= capacity, "a slot of {capacity} left written to {left_by_last_unit}");
        if self.capacity > 0 {
            // SAFETY: `ptr` is a fresh slot of `capacity >= touched` bytes, distinct from our own,
            // whose first `touched` bytes are ours to read; the two slots never overlap (each is
            // handed out once).
            unsafe { std::ptr::copy_nonoverlapping(self.ptr, ptr, self.touched) };
            chunks::give_back(self.ptr, self.capacity, self.stale_end);
        }
        self.ptr = ptr;
        self.capacity = capacity;
        self.stale_end = left_by_last_unit.max(self.touched);
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.capacity > 0 {
            chunks::give_back(self.ptr, self.capacity, self.stale_end);
        }
    }
}

pub use chunks::unmap_cold;

mod chunks {
    use super::{HUGE_PAGE_BYTES, WARM_CHUNK_BYTES};
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    use std::sync::Mutex;

    struct Chunk {
        base: usize,
        len: usize,
        slots_in_use: usize,
        /// The sweep (`unmap_cold`) during whose interval its last slot in use came back.
        emptied_in_sweep: u64,
    }

    /// The chunks holding slots of one size, and their free slots (addresses).
    #[derive(Default)]
    struct SizeClass {
        chunks: Vec<Chunk>,
        /// Each free slot's address, and how many of its first bytes its last unit wrote (the
        /// rest is zero): zeroed by the next unit to take it, where that one does not write.
        free_slots: Vec<(usize, usize)>,
    }

    /// Process-wide: its lock recovers from poisoning (the only engine lock that does), because
    /// in-process tests (proptest shrinking a failed case) go on after a panic, and a static
    /// outlives the engine that panicked. The daemon never sees it poisoned: a panic aborts it.
    static SIZE_CLASSES: Mutex<BTreeMap<usize, SizeClass>> = Mutex::new(BTreeMap::new());

    /// How many times `unmap_cold` has run.
    static SWEEPS: AtomicU64 = AtomicU64::new(0);

    /// A slot of `slot_len` bytes, and how many of its first bytes may be nonzero (the rest
    /// are zero); the taker zeroes what it needs zeroed.
    pub(super) fn take(slot_len: usize) -> (*mut u8, usize) {
        let mut classes = SIZE_CLASSES.lock().unwrap_or_else(|e| e.into_inner());
        let class = classes.entry(slot_len).or_default();
        if let Some((slot, written)) = class.free_slots.pop() {
            chunk_holding(&mut class.chunks, slot).slots_in_use += 1;
            return (slot as *mut u8, written);
        }
        // Empty chunks of other sizes go first, however recently emptied: memory a unit of
        // another size gave back would otherwise sit beside this one's until the next sweep,
        // and mapped memory stay within what is in use plus the warm chunks.
        unmap_empty(&mut classes, None);
        let class = classes.get_mut(&slot_len).expect("made above");
        let len = slot_len.max(HUGE_PAGE_BYTES);
        let base = map_huge_aligned(len);
        class.free_slots.extend((1..len / slot_len).rev().map(|i| (base + i * slot_len, 0)));
        class.chunks.push(Chunk { base, len, slots_in_use: 1, emptied_in_sweep: 0 });
        (base as *mut u8, 0) // fresh anonymous memory is zero already
    }

    /// Returns a slot; `written_to`: its bytes past this are zero. Not zeroed here: a stream
    /// of units written whole never needs it (a 4 MiB memset per unit was a sixth of the
    /// daemon's time streaming 16 MiB writes into the null backend).
    pub(super) fn give_back(ptr: *mut u8, slot_len: usize, written_to: usize) {
        assert!(written_to <= slot_len, "{written_to} bytes written in a slot of {slot_len}");
        let slot = ptr as usize;
        let mut classes = SIZE_CLASSES.lock().unwrap_or_else(|e| e.into_inner());
        let class = classes.get_mut(&slot_len).expect("a unit buffer returns to the size it came from");
        let chunk = chunk_holding(&mut class.chunks, slot);
        chunk.slots_in_use -= 1;
        if chunk.slots_in_use == 0 {
            chunk.emptied_in_sweep = SWEEPS.load(Relaxed);
        }
        class.free_slots.push((slot, written_to));
    }

    /// Unmaps the chunks that stayed empty since the sweep before this one, beyond the
    /// `WARM_CHUNK_BYTES` per slot size emptied last. Called on a timer (the write buffer's
    /// age loop, at least once a second): a stream of writes takes and frees units faster than
    /// that, and unmapped as soon as they were empty, 4 MiB units streaming at 1 GB/s mapped a
    /// fresh chunk for two units in five, each page faulted in and zeroed by the kernel again.
    pub fn unmap_cold() {
        let sweep = SWEEPS.fetch_add(1, Relaxed);
        unmap_empty(&mut SIZE_CLASSES.lock().unwrap_or_else(|e| e.into_inner()), Some(sweep));
    }

    /// Unmaps empty chunks beyond the warm ones of each size: those emptied before sweep
    /// `emptied_before`, or all of them.
    fn unmap_empty(classes: &mut BTreeMap<usize, SizeClass>, emptied_before: Option<u64>) {
        for class in classes.values_mut() {
            let mut empty: Vec<(u64, usize, usize)> = class
                .chunks
                .iter()
                .filter(|c| c.slots_in_use == 0)
                .map(|c| (c.emptied_in_sweep, c.base, c.len))
                .collect();
            empty.sort_unstable_by(|a, b| b.cmp(a)); // the last emptied first: they stay warm
            let mut warm_bytes = 0;
            for (emptied_in_sweep, base, len) in empty {
                warm_bytes += len;
                if warm_bytes <= WARM_CHUNK_BYTES || emptied_before.is_some_and(|sweep| emptied_in_sweep >= sweep) {
                    continue;
                }
                class.free_slots.retain(|&(s, _)| !(base..base + len).contains(&s));
                class.chunks.retain(|c| c.base != base);
                // SAFETY: the chunk [base, base + len) was mapped by `map_huge_aligned`, is removed
                // from the size class above (no slot of it is free or in use), and is unmapped once.
                unsafe { libc::munmap(base as *mut libc::c_void, len) };
            }
        }
    }

    #[cfg(test)]
    pub(super) fn mapped_chunks(slot_len: usize) -> usize {
        SIZE_CLASSES.lock().unwrap().get(&slot_len).map_or(0, |c| c.chunks.len())
    }

    fn chunk_holding(chunks: &mut [Chunk], slot: usize) -> &mut Chunk {
        chunks
            .iter_mut()
            .find(|c| (c.base..c.base + c.len).contains(&slot))
            .expect("every unit buffer lies in a mapped chunk")
    }

    /// `len` bytes of anonymous memory at a huge-page boundary, advised to use huge pages.
    fn map_huge_aligned(len: usize) -> usize {
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let base = crate::sys::map_anonymous_aligned(len, 0, HUGE_PAGE_BYTES, prot, 0)
            .unwrap_or_else(|e| panic!("out of memory for a {len}-byte chunk of unit buffers: {e}"));
        // SAFETY: advice only, on the mapping just made: without huge pages the chunk works
        // the same, on 4 KiB pages.
        unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        base
    }
}

/// Exchanging the pages of two ranges of memory, so that a unit takes a write's pages instead
/// of copying them.
mod pages {
    use std::cell::Cell;

    pub(super) const PAGE_BYTES: usize = 4096;

    /// A range of address space of this thread's own, at a huge-page boundary, that an exchange
    /// moves one side's pages through: (address, length), (0, 0) before the first. Unmapped
    /// when the thread ends (a ring's or a /dev/fuse reader's thread, with the mount).
    struct Scratch(Cell<(usize, usize)>);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let (address, mapped) = self.0.get();
            if mapped > 0 {
                // SAFETY: the range is this thread's alone, and no exchange runs while its
                // thread-local is dropped; it holds no page anybody uses between exchanges.
                unsafe { libc::munmap(address as *mut libc::c_void, mapped) };
            }
        }
    }

    thread_local! {
        static SCRATCH: Scratch = const { Scratch(Cell::new((0, 0))) };
    }

    /// Moves the pages of `[from, from + len)` over `[to, to + len)` (whose own pages are
    /// freed), leaving `from` mapped and empty (MREMAP_DONTUNMAP: it reads as zeros until
    /// written). Never leaves a hole in the address space that another thread's mmap could
    /// take between two calls, which a plain move would.
    ///
    /// # Safety
    /// Both ranges are private anonymous memory, whole pages, and nothing else uses them.
    unsafe fn move_pages(from: usize, to: usize, len: usize) -> bool {
        let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP;
        // SAFETY: per this function's contract; MREMAP_FIXED replaces `to`'s mapping in one
        // step, MREMAP_DONTUNMAP keeps `from` mapped.
        let moved = unsafe { libc::mremap(from as *mut libc::c_void, len, len, flags, to as *mut libc::c_void) };
        moved != libc::MAP_FAILED
    }

    /// This thread's scratch range of at least `len` bytes, at a huge-page boundary (so that a
    /// move between huge-page-aligned ranges moves whole page-table entries of 2 MiB).
    fn scratch(len: usize) -> Option<usize> {
        // None while the thread is ending (its thread-locals going): the caller copies instead.
        SCRATCH
            .try_with(|scratch| {
                let (address, mapped) = scratch.0.get();
                if mapped >= len {
                    return Some(address);
                }
                if mapped > 0 {
                    // SAFETY: the old scratch range is this thread's alone and holds nothing in use.
                    unsafe { libc::munmap(address as *mut libc::c_void, mapped) };
                    scratch.0.set((0, 0));
                }
                let len = len.next_multiple_of(super::HUGE_PAGE_BYTES);
                // No access until an exchange moves pages in, and no memory reserved for it.
                let flags = libc::MAP_NORESERVE;
                let address =
                    crate::sys::map_anonymous_aligned(len, 0, super::HUGE_PAGE_BYTES, libc::PROT_NONE, flags).ok()?;
                scratch.0.set((address, len));
                Some(address)
            })
            .ok()
            .flatten()
    }

    /// Exchanges the pages of `[a, a + len)` and `[b, b + len)`: afterwards `a` holds what `b`
    /// held and `b` what `a` held, with no byte copied. False when the kernel refused a step
    /// (a range across two mappings, which earlier exchanges of parts of it leave and `mremap`
    /// does not move; too many mappings; out of memory): then `a` reads as zeros or as before,
    /// and `b` as before, and the caller copies instead.
    ///
    /// # Safety
    /// Both ranges are private anonymous memory, page-aligned, whole pages, disjoint, and
    /// nothing else uses either during the call.
    pub(super) unsafe fn exchange(a: *mut u8, b: *mut u8, len: usize) -> bool {
        let (a, b) = (a as usize, b as usize);
        assert!(
            a % PAGE_BYTES == 0 && b % PAGE_BYTES == 0 && len % PAGE_BYTES == 0 && len > 0,
            "an exchange of whole pages: {a:#x} {b:#x} {len}"
        );
        assert!(a + len <= b || b + len <= a, "an exchange of overlapping ranges {a:#x} {b:#x} {len}");
        let Some(scratch) = scratch(len) else { return false };
        // SAFETY: the three moves, per this function's contract, and the scratch range is this
        // thread's own. After the first, `a` is empty and its pages in the scratch range; after
        // the second, `a` holds `b`'s pages and `b` is empty; after the third, `b` holds `a`'s
        // old pages and the scratch range is empty again (still mapped: ours for the next).
        unsafe {
            if !move_pages(a, scratch, len) {
                return false;
            }
            if !move_pages(b, a, len) {
                return false; // `a` reads as zeros; its old pages wait in the scratch range
            }
            // `a` is done; if the last step fails `b` reads as zeros, which its owner gave up.
            move_pages(scratch, b, len);
        }
        true
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// `len` bytes at `offset` past a huge-page boundary, in a mapping advised to use huge
        /// pages (as the unit chunks and the ring payloads are), every page touched.
        fn map(len: usize, offset: usize) -> (*mut u8, usize, usize) {
            let mapped = offset + len;
            let prot = libc::PROT_READ | libc::PROT_WRITE;
            let base = crate::sys::map_anonymous_aligned(mapped, 0, 2 << 20, prot, 0).unwrap();
            let at = base + offset;
            // SAFETY: [at, at + len) lies within the fresh mapping; madvise is advice only.
            unsafe {
                libc::madvise(at as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
                std::ptr::write_bytes(at as *mut u8, 1, len);
            }
            (at as *mut u8, base, mapped)
        }

        #[test]
        fn exchanged_ranges_hold_each_others_bytes_and_stay_mapped() {
            // Whole huge pages on both sides, half of one (the huge page split), and 4 KiB.
            let cases =
                [(4 << 20, 0, 0), (1 << 20, 1 << 20, 0), (1 << 20, 0, 1 << 20), (3 << 20, 0, 4096), (4096, 0, 0)];
            for (len, offset_a, offset_b) in cases {
                let ((a, map_a, len_a), (b, map_b, len_b)) = (map(len, offset_a), map(len, offset_b));
                // SAFETY: both ranges lie in mappings of our own, `len` bytes each.
                let (sa, sb) =
                    unsafe { (std::slice::from_raw_parts_mut(a, len), std::slice::from_raw_parts_mut(b, len)) };
                for (i, (x, y)) in sa.iter_mut().zip(sb.iter_mut()).enumerate() {
                    (*x, *y) = ((i % 251) as u8, (i % 241) as u8 ^ 0x5a);
                }
                // SAFETY: as above, disjoint and used by nothing else.
                assert!(unsafe { exchange(a, b, len) });
                for (i, (x, y)) in sa.iter().zip(sb.iter()).enumerate() {
                    assert_eq!((*x, *y), ((i % 241) as u8 ^ 0x5a, (i % 251) as u8), "byte {i} of {len}");
                }
                sa[len - 1] = 7; // still mapped and writable on both sides
                sb[0] = 9;
                // SAFETY: the mappings made above, unmapped once.
                unsafe {
                    libc::munmap(map_a as *mut libc::c_void, len_a);
                    libc::munmap(map_b as *mut libc::c_void, len_b);
                }
            }
        }
    }
}

/// Sorted, disjoint, non-adjacent byte ranges (offsets within one unit).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RangeSet {
    ranges: Vec<Range<u64>>,
}

impl From<Range<u64>> for RangeSet {
    fn from(r: Range<u64>) -> RangeSet {
        let mut set = RangeSet::default();
        set.insert(r);
        set
    }
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

    /// Adds `r`, merging with every range it overlaps or touches. Binary search: a unit
    /// written in 512-byte pieces at random holds thousands of ranges.
    pub fn insert(&mut self, r: Range<u64>) {
        if r.start >= r.end {
            return;
        }
        // [first, last) are the ranges that overlap or touch `r`.
        let first = self.ranges.partition_point(|e| e.end < r.start);
        let last = self.ranges.partition_point(|e| e.start <= r.end);
        let merged = match self.ranges[first..last] {
            [] => r,
            ref touching => touching[0].start.min(r.start)..touching[touching.len() - 1].end.max(r.end),
        };
        self.ranges.splice(first..last, std::iter::once(merged));
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
        if start >= end {
            return true;
        }
        let i = self.ranges.partition_point(|r| r.end < end);
        self.ranges.get(i).is_some_and(|r| r.start <= start && end <= r.end)
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

    fn chunks_of(unit_len: usize) -> usize {
        chunks::mapped_chunks(unit_len)
    }

    /// A unit of `len` bytes holding memory for all of them.
    fn whole(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::zeroed(len);
        b.range_mut(len - 1..len);
        b
    }

    // Each test uses its own unit size: the chunks are shared by the whole process.
    #[test]
    fn small_units_share_huge_page_chunks_come_back_zeroed_and_free_their_chunks_beyond_the_warm_ones() {
        let unit = 256 << 10;
        let mut bufs: Vec<AlignedBuf> = (0..9).map(|_| whole(unit)).collect();
        assert_eq!(chunks_of(unit), 2, "eight 256 KiB units to a 2 MiB chunk");
        let mut starts: Vec<usize> = bufs.iter().map(|b| b.as_slice().as_ptr() as usize).collect();
        starts.sort();
        assert!(starts.windows(2).all(|w| w[1] - w[0] >= unit), "units never overlap");
        assert!(starts.iter().all(|s| s % BUFFER_ALIGN_BYTES == 0));
        for (i, b) in bufs.iter_mut().enumerate() {
            // Some written whole, some only at the start: either way they come back zeroed.
            let end = if i % 2 == 0 { unit } else { 4096 };
            b.range_mut(0..end).fill(0xa5);
        }
        bufs.truncate(4);
        assert_eq!(chunks_of(unit), 2, "the chunk that held only the ninth unit stays warm");
        let again: Vec<AlignedBuf> = (0..12).map(|_| whole(unit)).collect();
        assert!(again.iter().all(|b| b.as_slice().iter().all(|&b| b == 0)), "reused slots are zeroed");
        assert_eq!(chunks_of(unit), 2, "free slots are reused before a new chunk is mapped");
        drop(again);
        bufs.clear();
        assert_eq!(chunks_of(unit), 2, "two empty chunks of 2 MiB are within the warm allowance");
    }

    #[test]
    fn a_truncate_inside_the_unit_zeroes_the_tail_and_the_slot_comes_back_zeroed() {
        let unit = 128 << 10;
        let mut b = AlignedBuf::zeroed(unit);
        b.range_mut(0..8192).fill(0xff);
        b.zero_from(100);
        assert!(b.as_slice()[..100].iter().all(|&x| x == 0xff));
        assert!(b.as_slice()[100..].iter().all(|&x| x == 0), "the tail reads as zeros");
        b.range_mut(unit - 10..unit).fill(0x11);
        assert!(b.as_slice()[100..unit - 10].iter().all(|&x| x == 0), "what the truncate cut reads as zeros");
        drop(b);
        let again: Vec<AlignedBuf> = (0..16).map(|_| whole(unit)).collect();
        assert!(again.iter().all(|b| b.as_slice().iter().all(|&x| x == 0)), "every slot taken is zero");
    }

    #[test]
    fn units_of_two_mib_and_more_are_huge_page_aligned_chunks_of_their_own() {
        // The pool is the process's: no other test takes slots of this size (a growing 8 MiB
        // unit below passes through a 4 MiB slot, which made this count fail when they ran
        // together).
        let unit = 2 << 20;
        let bufs: Vec<AlignedBuf> = (0..5).map(|_| whole(unit)).collect();
        assert!(bufs.iter().all(|b| b.as_slice().as_ptr() as usize % HUGE_PAGE_BYTES == 0));
        assert_eq!(chunks_of(unit), 5);
        drop(bufs);
        assert_eq!(chunks_of(unit), 5, "empty chunks stay mapped until they stay empty through a sweep");
        unmap_cold();
        unmap_cold();
        assert_eq!(chunks_of(unit) * unit, WARM_CHUNK_BYTES, "empty chunks beyond the warm allowance are unmapped");
    }

    #[test]
    fn a_unit_holds_memory_for_what_was_written_and_keeps_it_as_it_grows() {
        let unit = 8 << 20; // no other test takes slots of these sizes
        let mut b = AlignedBuf::zeroed(unit);
        assert!(b.as_slice().is_empty(), "no memory before the first write");
        b.range_mut(0..10).copy_from_slice(b"small file");
        assert_eq!(b.capacity(), FIRST_CAPACITY_BYTES, "a small write takes the smallest slot");
        assert_eq!(b.as_slice().len(), 10, "the unit's bytes end where its writes do");
        b.range_mut(20_000..20_010).fill(7);
        assert_eq!(b.capacity(), 64 << 10, "fourfold");
        b.range_mut(3 << 20..(3 << 20) + 1).fill(9);
        assert_eq!(b.capacity(), 4 << 20, "as many fourfold steps as the write needs");
        assert_eq!(&b.as_slice()[..10], b"small file", "what was written moves along");
        assert!(b.as_slice()[10..20_000].iter().all(|&x| x == 0));
        assert!(b.as_slice()[20_000..20_010].iter().all(|&x| x == 7));
        assert_eq!(b.as_slice()[3 << 20], 9);
        b.range_mut(unit - 1..unit).fill(1);
        assert_eq!((b.capacity(), b.as_slice().len()), (unit, unit), "never past the unit");
        assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert!(b.as_slice()[(3 << 20) + 1..unit - 1].iter().all(|&x| x == 0));
        drop(b);
        let mut again = AlignedBuf::zeroed(unit);
        again.range_mut(unit - 1..unit);
        assert!(again.as_slice().iter().all(|&x| x == 0), "the slot it left reads as zeros to the next unit");
        drop(again);
        let mut streamed = AlignedBuf::zeroed(unit);
        streamed.write_at(0, &vec![4; unit / 4]);
        assert_eq!(streamed.capacity(), unit, "a write of a quarter of the unit takes the whole unit's slot");
        streamed.write_at(unit / 2, &[5; 10]);
        assert!(
            streamed.as_slice()[unit / 4..unit / 2].iter().all(|&x| x == 0),
            "stale memory skipped over reads as zeros"
        );
    }

    /// Memory a unit of one size gave back does not sit beside new chunks of another size until
    /// the next sweep: mapping a chunk first unmaps the empty ones beyond the warm allowance.
    #[test]
    fn a_new_chunk_of_one_size_first_unmaps_the_empty_chunks_of_another() {
        let (gone, coming) = (3 << 20, 5 << 20); // sizes no other test takes
        let bufs: Vec<AlignedBuf> = (0..5).map(|_| whole(gone)).collect();
        drop(bufs);
        let _new = whole(coming);
        assert_eq!(chunks_of(gone), 2, "two empty 3 MiB chunks are the warm allowance, the rest went");
    }

    /// Given pages are taken in whole huge pages at huge-page boundaries of both sides, and
    /// copied otherwise; either way the unit reads as if copied, and the slot's earlier bytes
    /// stay out of it.
    #[test]
    fn a_piece_whose_pages_are_given_is_taken_in_whole_huge_pages_and_reads_as_if_copied() {
        const MIB: usize = 1 << 20;
        let unit = 4 * MIB;
        let mut earlier = AlignedBuf::zeroed(unit);
        earlier.write_at(0, &vec![0xee; unit]); // the slot the next unit takes is left written
        drop(earlier);
        let given_len = 8 * MIB;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let given = crate::sys::map_anonymous_aligned(given_len, 0, HUGE_PAGE_BYTES, prot, 0).unwrap();
        // SAFETY: the mapping above, `given_len` bytes, ours alone.
        let bytes = unsafe { std::slice::from_raw_parts_mut(given as *mut u8, given_len) };
        let pattern: Vec<u8> = (0..given_len).map(|i| (i % 253) as u8).collect();
        bytes.copy_from_slice(&pattern);
        let mut buf = AlignedBuf::zeroed(unit);
        let mut model = vec![0u8; unit];
        let put = |buf: &mut AlignedBuf, model: &mut [u8], at: usize, from: std::ops::Range<usize>| {
            model[at..at + from.len()].copy_from_slice(&pattern[from.clone()]);
            // SAFETY: private anonymous memory of this test's own; a range is given once and
            // not read again until unmapped.
            buf.write_taking(at, unsafe { WriteBytes::pages_given(&bytes[from]) })
        };
        assert!(put(&mut buf, &mut model, 2 * MIB, 0..2 * MIB), "a whole huge page on both sides: taken, not copied");
        assert_eq!(buf.as_slice().len(), unit);
        assert!(buf.as_slice()[..2 * MIB].iter().all(|&b| b == 0), "the earlier unit's bytes before the piece");
        assert!(buf.as_slice() == &model[..]);
        assert!(!put(&mut buf, &mut model, 0, 2 * MIB..3 * MIB), "1 MiB of 4 KiB pages: copied");
        assert!(
            !put(&mut buf, &mut model, 2 * MIB, 3 * MIB + 4096..5 * MIB + 4096),
            "given bytes off a huge page: copied"
        );
        assert!(!put(&mut buf, &mut model, MIB, 6 * MIB..8 * MIB), "off a huge page of the unit: copied");
        assert!(!put(&mut buf, &mut model, 3 * MIB, 5 * MIB + 8192..5 * MIB + 8192 + 100), "a few bytes: copied");
        assert!(buf.as_slice() == &model[..], "the unit reads as if every piece were copied");
        // SAFETY: the mapping made above, unmapped once.
        unsafe { libc::munmap(given as *mut libc::c_void, given_len) };
    }

    #[test]
    fn a_slot_left_written_reads_as_zeros_outside_what_its_next_unit_writes() {
        // No other test takes slots of this size, and neither write here passes through a
        // smaller one (growth from nothing goes straight to the slot that holds the write).
        let unit = 768 << 10;
        let mut first = AlignedBuf::zeroed(unit);
        first.write_at(0, &vec![0xa5; unit]);
        drop(first);
        let mut second = AlignedBuf::zeroed(unit);
        second.write_at(300_000, &[7; 10]);
        assert_eq!(second.capacity(), unit, "took the slot the first unit left");
        assert_eq!(second.as_slice().len(), 300_010, "the unit's bytes end where its write does");
        assert!(second.as_slice()[..300_000].iter().all(|&x| x == 0), "before the write");
        assert!(second.as_slice()[300_000..300_010].iter().all(|&x| x == 7));
        second.write_at(unit - 16, &[8; 16]);
        assert!(second.as_slice()[300_010..unit - 16].iter().all(|&x| x == 0), "between the writes");
        second.zero_from(300_005);
        second.write_at(300_020, &[6; 4]);
        assert_eq!(
            &second.as_slice()[300_000..300_024],
            &[&[7u8; 5][..], &[0; 15], &[6; 4]].concat()[..],
            "a truncate's tail"
        );
        second.write_at(0, &[9; 16]);
        assert_eq!(&second.as_slice()[..16], &[9; 16]);
        drop(second);
        let mut third = AlignedBuf::zeroed(unit);
        third.range_mut(unit - 1..unit);
        assert!(third.as_slice().iter().all(|&x| x == 0), "range_mut of a slot left written");
        let mut whole = AlignedBuf::zeroed(unit);
        whole.write_at(0, &vec![3; unit]);
        assert!(whole.as_slice().iter().all(|&x| x == 3));
    }

    /// The binary-searched insert against the plain definition: a byte is in the set iff some
    /// inserted range held it, and the ranges stay sorted, disjoint and apart.
    #[test]
    fn insert_and_covers_agree_with_a_byte_map() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let mut s = RangeSet::default();
            let mut bytes = [false; 512];
            for _ in 0..next(40) {
                let a = next(512);
                let b = (a + 1 + next(64)).min(512);
                s.insert(a..b);
                bytes[a as usize..b as usize].fill(true);
                assert!(s.ranges.windows(2).all(|w| w[0].end < w[1].start), "{s:?}");
                for x in 0..512u64 {
                    assert_eq!(s.covers(x, x + 1), bytes[x as usize], "byte {x} in {s:?}");
                }
                let (a, b) = (next(512), next(512));
                let (a, b) = (a.min(b), a.max(b) + 1);
                let plain = (a..b.min(512)).all(|x| bytes[x as usize]) && b <= 512;
                let one_range = s.iter().any(|r| r.start <= a && b <= r.end);
                assert_eq!(s.covers(a, b), one_range);
                assert_eq!(one_range, plain, "[{a}, {b}) in {s:?}"); // ranges never touch, so covered = in one range
            }
        }
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
        b.range_mut(5..6)[0] = 1;
        assert_eq!(b.as_slice().as_ptr() as usize % BUFFER_ALIGN_BYTES, 0);
        assert_eq!(b.as_slice()[5], 1);
        assert!(b.as_slice().iter().enumerate().all(|(i, &x)| x == 0 || i == 5));
    }
}
