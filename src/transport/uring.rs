//! FUSE over io_uring (kernel 6.14+, `CONFIG_FUSE_IO_URING`, `enable_uring`): requests arrive
//! as completions of ring commands in entries the daemon registered, and each reply goes back in
//! the same entry with one COMMIT_AND_FETCH, which also re-arms it. The kernel queues a request
//! on the queue of the CPU its caller runs on; one thread per queue, pinned to that CPU, answers
//! it there, without the cross-CPU wake-up /dev/fuse costs (docs/fuse-io-uring.md: the protocol, measurements and crates).
//!
//! The protocol as libfuse 3.18's `lib/fuse_uring.c` and the kernel's `fs/fuse/dev_uring.c`
//! speak it: INIT (over /dev/fuse) granted `FUSE_OVER_IO_URING`; one ring per queue, of
//! 128-byte SQEs, the /dev/fuse descriptor its fixed file 0; every possible CPU's queue gets
//! entries before the kernel sends any request (until then requests wait); FORGET, INTERRUPT and
//! notifications stay on /dev/fuse, where fuser's loops still read. On unmount or abort every
//! armed entry completes with an error (ENOTCONN); the queue ends when all of its have.
//!
//! Owns: the rings, the entries' memory, turning an entry into the bytes fuser parses and a
//! reply into the entry. Must not: interpret requests (fuser and `fuse.rs` do).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::metrics::Metrics;

/// `enum fuse_uring_cmd` (uapi fuse.h, 7.42+).
const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;
/// FUSE_MIN_READ_BUFFER: the kernel's floor for a request buffer (and so for the payload).
const FUSE_MIN_READ_BUFFER: usize = 8192;
/// `FUSE_URING_IN_OUT_HEADER_SZ` and `FUSE_URING_OP_IN_OUT_SZ`.
const IN_OUT_HEADER_BYTES: usize = 128;
const OP_IN_OUT_BYTES: usize = 128;
const IN_HEADER_BYTES: usize = 40;
const OUT_HEADER_BYTES: usize = 16;
/// Entries per queue, at most: one thread answers a queue's requests one at a time, so more
/// entries only let the kernel copy in the next requests meanwhile; each costs a payload buffer
/// (>= max_write).
pub const ENTRIES_PER_QUEUE_MAX: usize = 4;
/// The bound on all entries' memory together: a machine of many possible CPUs gets fewer
/// entries per queue (never fewer than one: the kernel needs one in every queue).
pub const ENTRY_MEMORY_BUDGET_BYTES: usize = 64 << 20;
/// The page that holds an entry's header and, just below the payload, the request's
/// `fuse_in_header` and op arguments copied there so that fuser sees one contiguous request.
const HEADER_AREA_BYTES: usize = 4096;
/// An idle queue looks this often whether its connection is gone without telling it.
const IDLE_CHECK: Duration = Duration::from_secs(1);
/// The user_data of the eventfd read that wakes a queue for a reply made on another thread.
const WAKE_USER_DATA: u64 = u64::MAX;

/// `struct fuse_uring_ent_in_out`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct EntInOut {
    flags: u64,
    /// The request's unique id, which COMMIT_AND_FETCH names.
    commit_id: u64,
    /// Bytes in the payload buffer: the request's, then the reply's.
    payload_sz: u32,
    padding: u32,
    reserved: u64,
}

/// `struct fuse_uring_req_header`: the entry's header buffer (iovec 0).
#[repr(C, align(8))]
struct ReqHeader {
    /// `fuse_in_header` from the kernel; `fuse_out_header` back.
    in_out: [u8; IN_OUT_HEADER_BYTES],
    /// The op's fixed arguments (its first argument), as much as it has.
    op_in: [u8; OP_IN_OUT_BYTES],
    ring_ent_in_out: EntInOut,
}

/// `struct fuse_uring_cmd_req`: the command area of the 128-byte SQE.
#[repr(C)]
struct CmdReq {
    flags: u64,
    commit_id: u64,
    qid: u16,
    padding: [u8; 6],
}

const _: () = assert!(std::mem::size_of::<EntInOut>() == 32);
const _: () = assert!(std::mem::size_of::<ReqHeader>() == 288);
const _: () = assert!(std::mem::size_of::<CmdReq>() == 24);
const _: () = assert!(std::mem::size_of::<ReqHeader>() + OP_IN_OUT_BYTES + IN_HEADER_BYTES <= HEADER_AREA_BYTES);
/// `sqe->len` in the kernel's `struct io_uring_sqe` (the io-uring crate builds URING_CMD
/// without it; REGISTER needs it: the number of iovecs).
const SQE_LEN_OFFSET: usize = 24;

/// Whether a ring of 128-byte entries can be created here (io_uring may be disabled by
/// `kernel.io_uring_disabled` or a seccomp filter): checked before asking the kernel for the
/// transport, since once granted, requests wait until every queue is registered.
pub fn probe_ring() -> io::Result<()> {
    IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2).map(|_| ())
}

/// The payload buffer the kernel requires of every entry: max(FUSE_MIN_READ_BUFFER, max_write,
/// max_pages pages), max_pages at most `fs.fuse.max_pages_limit`; rounded to pages.
pub fn payload_bytes(max_write_bytes: u32) -> usize {
    let page = 4096usize;
    let limit_pages: usize = std::fs::read_to_string("/proc/sys/fs/fuse/max_pages_limit")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(256);
    let bytes = FUSE_MIN_READ_BUFFER.max(max_write_bytes as usize).max(limit_pages * page);
    bytes.div_ceil(page) * page
}

/// As many entries per queue as ENTRY_MEMORY_BUDGET_BYTES holds, 1 to ENTRIES_PER_QUEUE_MAX.
fn entries_per_queue(queue_count: usize, payload_capacity: usize) -> usize {
    let entry_bytes = HEADER_AREA_BYTES + payload_capacity;
    (ENTRY_MEMORY_BUDGET_BYTES / (queue_count * entry_bytes)).clamp(1, ENTRIES_PER_QUEUE_MAX)
}

/// One entry's memory: the header area (header, then room for the request's headers just below
/// the payload) and the payload, one anonymous mapping. While registered the kernel writes into
/// it (on this queue's thread, in task work run when the thread enters the kernel), so no Rust
/// reference to it lives across a ring wait; only raw pointers are kept.
///
/// The payload starts at a huge-page boundary and is advised MADV_HUGEPAGE, as the write
/// buffer's units are: a write's whole units then take the payload's pages by moving 2 MiB
/// page-table entries (`WriteBytes::pages_given`), and the payload gets the units' in return.
struct EntryMemory {
    base: *mut u8,
    mapped_bytes: usize,
    payload_capacity: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access is serialized by the entry's
// protocol (the kernel, then the queue thread, then one reply, then the kernel again).
unsafe impl Send for EntryMemory {}
// SAFETY: as for Send; shared references only hand out raw pointers.
unsafe impl Sync for EntryMemory {}

/// Transparent huge pages are 2 MiB with 4 KiB base pages (x86-64, arm64).
const HUGE_PAGE_BYTES: usize = 2 << 20;

impl EntryMemory {
    fn new(payload_capacity: usize) -> io::Result<EntryMemory> {
        assert!(payload_capacity % 4096 == 0, "payload {payload_capacity} not whole pages");
        let mapped_bytes = HEADER_AREA_BYTES + payload_capacity;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let base = crate::sys::map_anonymous_aligned(mapped_bytes, HEADER_AREA_BYTES, HUGE_PAGE_BYTES, prot, 0)?;
        // SAFETY: advice only, on the payload of the mapping just made (without huge pages it
        // works the same on 4 KiB pages).
        unsafe {
            libc::madvise((base + HEADER_AREA_BYTES) as *mut libc::c_void, payload_capacity, libc::MADV_HUGEPAGE)
        };
        Ok(EntryMemory { base: base as *mut u8, mapped_bytes, payload_capacity })
    }

    fn header(&self) -> *mut ReqHeader {
        self.base.cast()
    }

    fn payload(&self) -> *mut u8 {
        // SAFETY: HEADER_AREA_BYTES is inside the mapping (mapped_bytes is larger).
        unsafe { self.base.add(HEADER_AREA_BYTES) }
    }
}

impl Drop for EntryMemory {
    fn drop(&mut self) {
        // SAFETY: base/mapped_bytes are the mapping made in new(); dropped only once the kernel
        // has let go of the entry (see Queue::run: its memory is leaked otherwise).
        unsafe { libc::munmap(self.base.cast(), self.mapped_bytes) };
    }
}

/// What happened to the request an entry holds.
#[derive(Debug, Default)]
struct ReplyState {
    /// The request's unique id (its commit id); 0 while the entry waits in the kernel.
    unique: u64,
    answered: bool,
    /// A reply body kept aside because the request's own bytes were still in the payload
    /// buffer when it was made (fuser's request data is borrowed during dispatch).
    staged_body: Option<Vec<u8>>,
}

struct Entry {
    memory: EntryMemory,
    /// REGISTER's iovec[2] = {header, payload}: the kernel reads it at submission.
    iovecs: [libc::iovec; 2],
    reply: Mutex<ReplyState>,
}

// SAFETY: the iovecs point into `memory`, which is Send and Sync; they are only read by the kernel.
unsafe impl Send for Entry {}
// SAFETY: as for Send.
unsafe impl Sync for Entry {}

/// What a queue's thread and the replies made for its entries share.
struct QueueShared {
    qid: u16,
    entries: Vec<Entry>,
    /// Entries answered, waiting for their COMMIT_AND_FETCH.
    answered: Mutex<Vec<usize>>,
    /// Written by a reply made off the queue's thread, to wake it.
    wake: OwnedFd,
    thread: std::sync::OnceLock<ThreadId>,
}

/// The reply to one request that came over a ring: written into its entry.
#[derive(Debug)]
struct RingReply {
    queue: Arc<QueueShared>,
    entry: usize,
    /// The request it answers: a reply kept past its entry's commit must not answer the next.
    unique: u64,
    /// The request carried no payload, so its reply may go straight into the payload buffer.
    payload_free: bool,
}

impl std::fmt::Debug for QueueShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueShared").field("qid", &self.qid).finish_non_exhaustive()
    }
}

impl fuser::ReplySink for RingReply {
    fn send(&self, reply: &[io::IoSlice<'_>]) -> io::Result<()> {
        let entry = &self.queue.entries[self.entry];
        let (header, body) = reply.split_first().ok_or_else(|| io::Error::other("an empty reply"))?;
        assert_eq!(header.len(), OUT_HEADER_BYTES, "a reply starts with fuse_out_header");
        let body_bytes: usize = body.iter().map(|b| b.len()).sum();
        let mut state = entry.reply.lock().unwrap_or_else(|e| e.into_inner());
        if state.answered || state.unique != self.unique {
            return Err(io::Error::other("a second reply to one request"));
        }
        let mut out_header = [0u8; OUT_HEADER_BYTES];
        out_header.copy_from_slice(header);
        let payload_sz = if body_bytes > entry.memory.payload_capacity {
            // Cannot happen for requests within max_write/max_pages; answer rather than hang.
            log::error!("a reply of {body_bytes} bytes does not fit the ring's payload buffer: EIO instead");
            out_header[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
            out_header[0..4].copy_from_slice(&(OUT_HEADER_BYTES as u32).to_ne_bytes());
            0
        } else if self.payload_free {
            let mut at = entry.memory.payload();
            for part in body {
                // SAFETY: the payload holds payload_capacity >= body_bytes bytes; nothing
                // borrows it (the request had no payload) and the kernel does not touch an
                // entry between delivering a request and its COMMIT.
                unsafe {
                    std::ptr::copy_nonoverlapping(part.as_ptr(), at, part.len());
                    at = at.add(part.len());
                }
            }
            body_bytes
        } else {
            state.staged_body = Some(body.iter().flat_map(|b| b.iter().copied()).collect());
            body_bytes
        };
        let header_ptr = entry.memory.header();
        // SAFETY: the header buffer is ours between delivery and COMMIT (see above); nothing
        // borrows it (the request's in-header was copied out before dispatch).
        unsafe {
            let in_out = std::ptr::addr_of_mut!((*header_ptr).in_out).cast::<u8>();
            std::ptr::copy_nonoverlapping(out_header.as_ptr(), in_out, OUT_HEADER_BYTES);
            std::ptr::addr_of_mut!((*header_ptr).ring_ent_in_out.payload_sz).write(payload_sz as u32);
        }
        state.answered = true;
        drop(state);
        self.queue.answered.lock().unwrap_or_else(|e| e.into_inner()).push(self.entry);
        if self.queue.thread.get() != Some(&std::thread::current().id()) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live array to the queue's eventfd.
            unsafe { libc::write(self.queue.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
        Ok(())
    }
}

/// The ring transport of one mount.
pub struct RingTransport {
    queues: Vec<Arc<QueueShared>>,
    rings: Vec<IoUring<squeue::Entry128, cqueue::Entry>>,
    dev_fuse: OwnedFd,
}

impl RingTransport {
    /// Makes a ring and its entries for every possible CPU. `dev_fuse` is (a duplicate of) the
    /// connection's /dev/fuse descriptor; `payload_capacity` from [`payload_bytes`].
    pub fn new(dev_fuse: OwnedFd, payload_capacity: usize) -> io::Result<RingTransport> {
        // One per possible CPU, as the kernel makes them.
        let queue_count = crate::sys::possible_cpus();
        assert!(queue_count > 0 && u16::try_from(queue_count).is_ok());
        let entries_per_queue = entries_per_queue(queue_count, payload_capacity);
        let mut queues = Vec::with_capacity(queue_count);
        let mut rings = Vec::with_capacity(queue_count);
        for qid in 0..queue_count {
            // No SINGLE_ISSUER, COOP_TASKRUN or DEFER_TASKRUN: libfuse measured them slower for
            // this (lib/fuse_uring.c), and COOP_TASKRUN made no difference here (fstat 11-15 us
            // either way on the loaded 2-CPU machine).
            let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
                .setup_cqsize(4 * entries_per_queue as u32)
                .build(2 * entries_per_queue as u32)?;
            ring.submitter().register_files(&[dev_fuse.as_raw_fd()])?;
            let mut entries = Vec::with_capacity(entries_per_queue);
            for _ in 0..entries_per_queue {
                let memory = EntryMemory::new(payload_capacity)?;
                let iovecs = [
                    libc::iovec { iov_base: memory.header().cast(), iov_len: std::mem::size_of::<ReqHeader>() },
                    libc::iovec { iov_base: memory.payload().cast(), iov_len: payload_capacity },
                ];
                entries.push(Entry { memory, iovecs, reply: Mutex::new(ReplyState::default()) });
            }
            // SAFETY: eventfd(2) with valid flags; the result is checked.
            let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if wake < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `wake` is a descriptor just created and owned by nothing else.
            let wake = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(wake) };
            queues.push(Arc::new(QueueShared {
                qid: qid as u16,
                entries,
                answered: Mutex::new(Vec::new()),
                wake,
                thread: std::sync::OnceLock::new(),
            }));
            rings.push(ring);
        }
        Ok(RingTransport { queues, rings, dev_fuse })
    }

    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    pub fn entries_per_queue(&self) -> usize {
        self.queues[0].entries.len()
    }

    /// Serves every queue on a thread of its own until the connection ends, then returns.
    pub fn serve<FS: fuser::Filesystem>(self, dispatcher: fuser::RequestDispatcher<FS>, metrics: Arc<Metrics>) {
        let dev_fuse = self.dev_fuse.as_raw_fd();
        let mut threads = Vec::new();
        for (shared, ring) in self.queues.into_iter().zip(self.rings) {
            let queue = Queue { shared, ring, dev_fuse, dispatcher: dispatcher.clone(), metrics: metrics.clone() };
            let qid = queue.shared.qid;
            match std::thread::Builder::new().name(format!("fuse-ring-{qid}")).spawn(move || queue.run()) {
                Ok(thread) => threads.push(thread),
                Err(e) => {
                    log::error!("cannot start the thread of ring queue {qid}: {e}");
                    queue_failed(dev_fuse, &metrics);
                }
            }
        }
        drop(dispatcher);
        for thread in threads {
            let _ = thread.join();
        }
        // self.dev_fuse closes here, after every ring that named it as a fixed file.
    }
}

/// One queue's thread: its ring, entries and the dispatcher.
struct Queue<FS: fuser::Filesystem> {
    shared: Arc<QueueShared>,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    dev_fuse: RawFd,
    dispatcher: fuser::RequestDispatcher<FS>,
    metrics: Arc<Metrics>,
}

/// A URING_CMD on the fixed file 0 (/dev/fuse) with its `fuse_uring_cmd_req`.
fn ring_cmd(cmd_op: u32, qid: u16, commit_id: u64, entry: usize, addr: Option<u64>) -> squeue::Entry128 {
    let request = CmdReq { flags: 0, commit_id, qid, padding: [0; 6] };
    let mut cmd = [0u8; 80];
    // SAFETY: CmdReq is 24 bytes of plain integers (asserted above), read as bytes.
    let request_bytes =
        unsafe { std::slice::from_raw_parts((&raw const request).cast::<u8>(), std::mem::size_of::<CmdReq>()) };
    cmd[..request_bytes.len()].copy_from_slice(request_bytes);
    opcode::UringCmd80::new(types::Fixed(0), cmd_op).cmd(cmd).addr(addr).build().user_data(entry as u64)
}

/// Sets `sqe->len`, which `UringCmd80` leaves 0.
fn set_sqe_len(sqe: &mut squeue::Entry128, len: u32) {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    let bytes = std::ptr::from_mut::<squeue::Entry128>(sqe).cast::<u8>();
    // SAFETY: Entry128 is #[repr(C)]: the kernel's 64-byte `struct io_uring_sqe` (its `__u32
    // len` at byte 24) then 64 command bytes; the write stays inside the 128 bytes.
    unsafe { bytes.add(SQE_LEN_OFFSET).cast::<u32>().write_unaligned(len) };
}

impl<FS: fuser::Filesystem> Queue<FS> {
    fn run(mut self) {
        let qid = self.shared.qid;
        let _ = self.shared.thread.set(std::thread::current().id());
        // The kernel queues a request on its caller's CPU's queue: answering it on that CPU
        // saves the cross-CPU wake-up.
        if let Err(e) = crate::sys::run_on_cpu(qid as usize) {
            log::debug!("ring queue {qid}: not pinned: {e}");
        }
        // Leaked (8 bytes a queue): an eventfd read may still be armed when the ring closes,
        // and closing cancels it asynchronously.
        let wake_buffer: &'static mut [u8; 8] = Box::leak(Box::new([0u8; 8]));
        let mut sqes: Vec<squeue::Entry128> = (0..self.shared.entries.len()).map(|i| self.register(i)).collect();
        sqes.push(self.wake_read(wake_buffer));
        // Entries that have delivered a request: an error on one of those is not a refused
        // registration.
        let mut delivered = vec![false; self.shared.entries.len()];
        let mut register_retries_left = 100;
        if let Err(e) = self.push(&sqes).and_then(|()| self.ring.submit().map(|_| ())) {
            log::error!("ring queue {qid}: cannot register its entries: {e}");
            queue_failed(self.dev_fuse, &self.metrics);
            return;
        }
        let mut live_entries = self.shared.entries.len();
        let mut kernel_let_go = true;
        let mut completions: Vec<(u64, i32)> = Vec::with_capacity(4 * self.shared.entries.len());
        while live_entries > 0 {
            let commits = self.commits();
            if let Err(e) = self.push(&commits) {
                log::error!("ring queue {qid}: cannot queue replies: {e}");
                kernel_let_go = false;
                break;
            }
            let timeout = types::Timespec::new().sec(IDLE_CHECK.as_secs());
            let args = types::SubmitArgs::new().timespec(&timeout);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ETIME) || e.raw_os_error() == Some(libc::EINTR) => {
                    if connection_gone(self.dev_fuse) && self.ring.completion().is_empty() {
                        log::warn!("ring queue {qid}: the connection ended with requests still armed");
                        kernel_let_go = false;
                        break;
                    }
                    continue;
                }
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    log::error!("ring queue {qid}: io_uring_enter: {e}");
                    kernel_let_go = false;
                    break;
                }
            }
            completions.clear();
            completions.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            for &(user_data, result) in &completions {
                if user_data == WAKE_USER_DATA {
                    let sqe = self.wake_read(wake_buffer);
                    if self.push(&[sqe]).is_err() {
                        log::error!("ring queue {qid}: cannot re-arm its wake-up");
                    }
                    continue;
                }
                let index = user_data as usize;
                assert!(index < self.shared.entries.len(), "completion for entry {index}");
                if result < 0 {
                    let errno = -result;
                    let connection_ended = [libc::ENOTCONN, libc::ECONNABORTED, libc::ECANCELED].contains(&errno);
                    let error = io::Error::from_raw_os_error(errno);
                    let retry = errno == libc::EAGAIN || errno == libc::EINTR;
                    if retry && !delivered[index] && register_retries_left > 0 {
                        // EAGAIN: the connection's INIT not yet complete (it is, before the
                        // rings start; libfuse retries too). Bounded, and spaced.
                        register_retries_left -= 1;
                        std::thread::sleep(Duration::from_millis(10));
                        let sqe = self.register(index);
                        if self.push(&[sqe]).is_ok() {
                            continue;
                        }
                    }
                    if !connection_ended && delivered[index] {
                        // A COMMIT the kernel refused (its request gone): the entry stays with
                        // the kernel unusable, so register it again or the queue would shrink.
                        log::warn!("ring queue {qid} entry {index}: commit refused ({error}): registered again");
                        let sqe = self.register(index);
                        if self.push(&[sqe]).is_ok() {
                            continue;
                        }
                    } else if !connection_ended {
                        // A refused REGISTER makes the kernel serve the whole connection over
                        // /dev/fuse, where fuser's loops still read.
                        log::warn!("ring queue {qid} entry {index}: REGISTER refused ({error}): the mount falls back to /dev/fuse");
                        self.metrics.set_transport("dev (io_uring registration refused)");
                        self.metrics.fuse_ring_queues.store(0, Relaxed);
                    }
                    live_entries -= 1;
                    continue;
                }
                delivered[index] = true;
                self.serve_request(index);
            }
        }
        log::debug!("ring queue {qid}: ended");
        if !kernel_let_go {
            // The kernel may still hold these entries' buffers: never unmap them under it.
            std::mem::forget(self.shared.clone());
        }
    }

    /// REGISTER of entry `index`: addr is its iovec array {header, payload}, len the count (2).
    fn register(&self, index: usize) -> squeue::Entry128 {
        let iovecs = self.shared.entries[index].iovecs.as_ptr() as u64;
        let mut sqe = ring_cmd(FUSE_IO_URING_CMD_REGISTER, self.shared.qid, 0, index, Some(iovecs));
        set_sqe_len(&mut sqe, 2);
        sqe
    }

    /// An eventfd read that completes when a reply made on another thread wants a commit.
    fn wake_read(&self, buffer: &mut [u8; 8]) -> squeue::Entry128 {
        squeue::Entry128::from(
            opcode::Read::new(types::Fd(self.shared.wake.as_raw_fd()), buffer.as_mut_ptr(), 8)
                .build()
                .user_data(WAKE_USER_DATA),
        )
    }

    fn push(&mut self, sqes: &[squeue::Entry128]) -> io::Result<()> {
        for sqe in sqes {
            loop {
                // SAFETY: every SQE's buffers (entries' memory and iovecs, the wake buffer)
                // live as long as the queue, past the ring's last use of them.
                let pushed = unsafe { self.ring.submission().push(sqe) };
                if pushed.is_ok() {
                    break;
                }
                self.ring.submit()?;
            }
        }
        Ok(())
    }

    /// COMMIT_AND_FETCH for every answered entry, its staged reply moved into the payload.
    fn commits(&self) -> Vec<squeue::Entry128> {
        let answered: Vec<usize> = std::mem::take(&mut *self.shared.answered.lock().unwrap_or_else(|e| e.into_inner()));
        let mut sqes = Vec::with_capacity(answered.len());
        for index in answered {
            let entry = &self.shared.entries[index];
            let mut state = entry.reply.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(body) = state.staged_body.take() {
                assert!(body.len() <= entry.memory.payload_capacity);
                // SAFETY: dispatch has returned, so the request's bytes in the payload are no
                // longer borrowed; the kernel reads the payload only after this COMMIT.
                unsafe { std::ptr::copy_nonoverlapping(body.as_ptr(), entry.memory.payload(), body.len()) };
            }
            let unique = std::mem::take(&mut state.unique);
            state.answered = false;
            sqes.push(ring_cmd(FUSE_IO_URING_CMD_COMMIT_AND_FETCH, self.shared.qid, unique, index, None));
        }
        sqes
    }

    /// Hands the request in entry `index` to fuser, as the contiguous bytes /dev/fuse would
    /// have delivered: `fuse_in_header`, the op's arguments, then the payload.
    fn serve_request(&mut self, index: usize) {
        let shared = self.shared.clone();
        let entry = &shared.entries[index];
        let header = entry.memory.header();
        // SAFETY: the kernel delivered a request into this entry and will not touch it until our
        // COMMIT; reading plain bytes out of the header buffer.
        let delivered: ReqHeader = unsafe { std::ptr::read(header) };
        let mut in_header = [0u8; IN_HEADER_BYTES];
        in_header.copy_from_slice(&delivered.in_out[..IN_HEADER_BYTES]);
        let (op_in, in_out) = (delivered.op_in, delivered.ring_ent_in_out);
        self.metrics.fuse_ring_requests.fetch_add(1, Relaxed);
        let request_len = u32::from_ne_bytes(in_header[0..4].try_into().unwrap()) as usize;
        let unique = u64::from_ne_bytes(in_header[8..16].try_into().unwrap());
        let payload_bytes = in_out.payload_sz as usize;
        {
            let mut state = entry.reply.lock().unwrap_or_else(|e| e.into_inner());
            state.unique = unique;
            state.answered = false;
            state.staged_body = None;
        }
        let sink =
            Arc::new(RingReply { queue: shared.clone(), entry: index, unique, payload_free: payload_bytes == 0 });
        // The op arguments are whatever the request holds besides its header and payload.
        let op_bytes = request_len.checked_sub(IN_HEADER_BYTES + payload_bytes);
        let valid = unique == in_out.commit_id
            && payload_bytes <= entry.memory.payload_capacity
            && op_bytes.is_some_and(|op| op <= OP_IN_OUT_BYTES && op % 8 == 0);
        if !valid {
            log::error!(
                "ring queue {}: a request that does not add up (len {request_len}, payload {payload_bytes}, \
                 unique {unique}, commit id {}): EIO",
                shared.qid,
                in_out.commit_id
            );
            answer_error(&sink, unique, libc::EIO);
            return;
        }
        let op_bytes = op_bytes.unwrap_or(0);
        let start_offset = IN_HEADER_BYTES + op_bytes;
        // SAFETY: the header area's last start_offset (<= 168) bytes, just below the payload,
        // are ours (the kernel never writes past the 288-byte header); the payload holds
        // payload_bytes of the request. The slice covers both, contiguous in one mapping; it is
        // 8-byte aligned (payload page-aligned, start_offset a multiple of 8) as fuser requires,
        // and dropped before the entry is committed.
        let request = unsafe {
            let start = entry.memory.payload().sub(start_offset);
            std::ptr::copy_nonoverlapping(in_header.as_ptr(), start, IN_HEADER_BYTES);
            std::ptr::copy_nonoverlapping(op_in.as_ptr(), start.add(IN_HEADER_BYTES), op_bytes);
            std::slice::from_raw_parts(start as *const u8, start_offset + payload_bytes)
        };
        debug_assert_eq!(request.as_ptr() as usize % 8, 0);
        // No catch_unwind: the panic policy (main.rs, `abort_on_panic`) ends the daemon at a
        // panic, as kill -9 would, and the next mount replays the log; a queue left serving on
        // state a failed invariant declared wrong is what the policy rules out.
        // SAFETY: `request` lies in the entry's own private anonymous mapping, which the kernel
        // fills again only after our COMMIT, after dispatch, and which nothing reads before
        // that: a write's handler may take its pages.
        if let Err(e) = unsafe { self.dispatcher.dispatch_given(request, sink.clone()) } {
            log::error!("ring queue {}: {e}: EIO", shared.qid);
            answer_error(&sink, unique, libc::EIO);
        }
    }
}

/// Makes the kernel serve the connection over /dev/fuse, for rings that cannot be made or a
/// queue that cannot register its entries: until every queue has one, the kernel holds every request of the mount. A REGISTER
/// it refuses (here: no iovecs) turns the connection's io_uring off and wakes those requests
/// (fs/fuse/dev_uring.c, fuse_uring_cmd); it is sent on a ring of its own, since the queue's
/// ring may be what failed. True when the kernel took the refusal.
pub fn fall_back_to_dev_fuse(dev_fuse: RawFd) -> bool {
    let refused = (|| -> io::Result<i32> {
        let mut ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2)?;
        ring.submitter().register_files(&[dev_fuse])?;
        // len 0: the kernel wants exactly 2 iovecs and refuses with EINVAL.
        let sqe = ring_cmd(FUSE_IO_URING_CMD_REGISTER, 0, 0, 0, None);
        // SAFETY: the SQE names no memory (no iovecs).
        unsafe { ring.submission().push(&sqe) }.map_err(|_| io::Error::other("submission queue full"))?;
        ring.submit_and_wait(1)?;
        let result = ring.completion().next().map(|c| c.result()).unwrap_or(0);
        Ok(result)
    })();
    match refused {
        Ok(result) if result < 0 => {
            log::warn!("FUSE over io_uring turned off for this mount: requests come over /dev/fuse");
            true
        }
        Ok(result) => {
            log::error!("could not turn FUSE over io_uring off (REGISTER answered {result})");
            false
        }
        Err(e) => {
            log::error!("could not turn FUSE over io_uring off: {e}");
            false
        }
    }
}

/// A queue that cannot serve: the connection falls back to /dev/fuse, and stats say so.
fn queue_failed(dev_fuse: RawFd, metrics: &Metrics) {
    if fall_back_to_dev_fuse(dev_fuse) {
        metrics.set_transport("dev (io_uring queue setup failed)");
        metrics.fuse_ring_queues.store(0, Relaxed);
    }
}

/// Answers a request fuser could not take with `-errno` and no body.
fn answer_error(sink: &Arc<RingReply>, unique: u64, errno: i32) {
    let mut header = [0u8; OUT_HEADER_BYTES];
    header[0..4].copy_from_slice(&(OUT_HEADER_BYTES as u32).to_ne_bytes());
    header[4..8].copy_from_slice(&(-errno).to_ne_bytes());
    header[8..16].copy_from_slice(&unique.to_ne_bytes());
    let _ = fuser::ReplySink::send(&**sink, &[io::IoSlice::new(&header)]);
}

/// /dev/fuse reports POLLERR once the connection is aborted or unmounted.
fn connection_gone(dev_fuse: RawFd) -> bool {
    let mut poll = libc::pollfd { fd: dev_fuse, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&raw mut poll, 1, 0) };
    n > 0 && poll.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const SQE_ADDR_OFFSET: usize = 16;

    #[test]
    fn sqe_offsets_match_the_kernel_layout() {
        // UringCmd80 writes addr where the kernel's SQE has it: the offset set_sqe_len relies on
        // is the field after it.
        let sqe = opcode::UringCmd80::new(types::Fixed(0), 7).addr(Some(0x1122_3344_5566_7788)).build();
        // SAFETY: reading the 128 bytes of a repr(C) value as bytes.
        let bytes = unsafe { std::slice::from_raw_parts((&raw const sqe).cast::<u8>(), 128) };
        assert_eq!(
            u64::from_ne_bytes(bytes[SQE_ADDR_OFFSET..SQE_ADDR_OFFSET + 8].try_into().unwrap()),
            0x1122_3344_5566_7788
        );
        let mut sqe = sqe;
        set_sqe_len(&mut sqe, 2);
        // SAFETY: as above.
        let bytes = unsafe { std::slice::from_raw_parts((&raw const sqe).cast::<u8>(), 128) };
        assert_eq!(u32::from_ne_bytes(bytes[SQE_LEN_OFFSET..SQE_LEN_OFFSET + 4].try_into().unwrap()), 2);
        // cmd_op (u32 at byte 8, in the `off` union) and the command area at byte 48.
        assert_eq!(u32::from_ne_bytes(bytes[8..12].try_into().unwrap()), 7);
    }

    #[test]
    fn entries_stay_within_their_memory_budget_but_every_queue_has_one() {
        assert_eq!(entries_per_queue(2, 1 << 20), ENTRIES_PER_QUEUE_MAX);
        assert_eq!(entries_per_queue(16, 1 << 20), 3);
        assert_eq!(entries_per_queue(64, 1 << 20), 1);
        assert_eq!(entries_per_queue(1024, 16 << 20), 1);
        for queues in [1, 2, 8, 16, 64] {
            let entries = entries_per_queue(queues, 1 << 20);
            assert!(entries == 1 || queues * entries * ((1 << 20) + 4096) <= ENTRY_MEMORY_BUDGET_BYTES);
        }
    }

    #[test]
    fn payload_covers_max_write_and_the_page_limit() {
        assert!(payload_bytes(1 << 20) >= 1 << 20);
        assert!(payload_bytes(16 << 20) >= 16 << 20);
        assert!(payload_bytes(4096) >= FUSE_MIN_READ_BUFFER);
        assert_eq!(payload_bytes(100_000) % 4096, 0);
    }
}
