use std::cell::Cell;
use std::mem::size_of;

use crate::ll::fuse_abi as abi;
use crate::session::MAX_WRITE_SIZE;

/// Size of the buffer for reading a request from the kernel. Since the kernel may send
/// up to `MAX_WRITE_SIZE` bytes in a write request, we use that value plus some extra space.
const BUFFER_SIZE: usize = MAX_WRITE_SIZE + 4096;

/// Where a WRITE request's data starts in the buffer: after its `fuse_in_header` and
/// `fuse_write_in`.
const WRITE_DATA_OFFSET: usize = size_of::<abi::fuse_in_header>() + size_of::<abi::fuse_write_in>();

/// Transparent huge pages are 2 MiB with 4 KiB base pages (x86-64, arm64).
const HUGE_PAGE_SIZE: usize = 2 << 20;

thread_local! {
    /// The buffer of the request this thread's /dev/fuse loop is dispatching, [start, end);
    /// (0, 0) outside a dispatch.
    static DISPATCHING: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
}

/// Whether `bytes` (a write's data) lies in the buffer of the request this thread is
/// dispatching, given up: the /dev/fuse loop's read buffer, or a transport's own given to
/// `RequestDispatcher::dispatch_given`. That memory is private anonymous memory that nothing
/// reads after the dispatch (the next request is read over it). A filesystem may
/// therefore take the pages under such bytes (exchange them for pages of its own with
/// `mremap`) instead of copying them, as long as the range stays mapped, readable and
/// writable. A WRITE's data starts at a huge-page boundary of that buffer.
pub fn request_bytes_given(bytes: &[u8]) -> bool {
    let (start, end) = DISPATCHING.get();
    let at = bytes.as_ptr() as usize;
    start < end && start <= at && at + bytes.len() <= end
}

/// Runs `dispatch` with `buffer` named as the request being dispatched (`request_bytes_given`).
pub(crate) fn dispatching<R>(buffer: &[u8], dispatch: impl FnOnce() -> R) -> R {
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            DISPATCHING.set((0, 0));
        }
    }
    let _done = Done;
    let start = buffer.as_ptr() as usize;
    DISPATCHING.set((start, start + buffer.len()));
    dispatch()
}

/// A buffer for reading requests from /dev/fuse: its own anonymous mapping, placed so that a
/// WRITE's data starts at a huge-page boundary (and `fuse_in_header` 8-byte aligned), the data
/// area advised MADV_HUGEPAGE. A filesystem can then take a large write's pages whole
/// (`request_bytes_given`) rather than copy them.
#[derive(Debug)]
pub(crate) struct FuseReadBuf {
    mapping: *mut libc::c_void,
    mapped: usize,
    start: *mut u8,
}

// SAFETY: the mapping is owned by this value alone, and only reached through `&mut self`.
unsafe impl Send for FuseReadBuf {}

impl FuseReadBuf {
    /// Creates a new `FuseReadBuf` of `BUFFER_SIZE` bytes.
    pub(crate) fn new() -> Self {
        let mapped = BUFFER_SIZE + WRITE_DATA_OFFSET + HUGE_PAGE_SIZE;
        // SAFETY: a new private anonymous mapping at an address of the kernel's choice; checked.
        let mapping = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(mapping != libc::MAP_FAILED, "cannot map a {mapped}-byte request buffer: {}", std::io::Error::last_os_error());
        let data = (mapping as usize + WRITE_DATA_OFFSET).next_multiple_of(HUGE_PAGE_SIZE);
        let start = data - WRITE_DATA_OFFSET;
        assert!(start % std::mem::align_of::<abi::fuse_in_header>() == 0);
        assert!(start + BUFFER_SIZE <= mapping as usize + mapped);
        let advised = (BUFFER_SIZE - WRITE_DATA_OFFSET) / 4096 * 4096;
        // SAFETY: advice only, on whole pages inside the mapping.
        unsafe { libc::madvise(data as *mut libc::c_void, advised, libc::MADV_HUGEPAGE) };
        Self { mapping, mapped, start: start as *mut u8 }
    }

    /// Returns a mutable reference to the aligned buffer.
    pub(crate) fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: [start, start + BUFFER_SIZE) lies inside the mapping (asserted in new),
        // which is zero-filled or written, and borrowed through `&mut self` only.
        unsafe { std::slice::from_raw_parts_mut(self.start, BUFFER_SIZE) }
    }
}

impl Drop for FuseReadBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new, unmapped once.
        unsafe { libc::munmap(self.mapping, self.mapped) };
    }
}
