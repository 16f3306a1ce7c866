//! The local backend's many-writes-in-flight path, Linux AIO (`backend::local::aio`, raw
//! syscalls) against io_uring (the `io-uring` crate), on the same O_DIRECT file: the question
//! issue 16 asks before the hand-made AIO is replaced.
//!
//! usage: cargo run --release --example aio_vs_uring -- DIR [ROUNDS]
//!
//! Three shapes a flusher writes, each ROUNDS times (default 300), alternating the two
//! implementations round by round so that a noisy machine treats both alike: 256 pieces of
//! 512 B scattered over a 1 MiB unit (what 512-byte random writes leave), 64 pieces of 4 KiB,
//! and 4 whole 1 MiB units. Prints the median microseconds per call of each, and plain pwrite
//! one piece at a time beside them.
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::time::Instant;

use coalescefs::backend::local::aio;

const MAX_IN_FLIGHT: usize = 128;

/// `(bytes, offset)` pieces, as `aio::write_many_at` takes them.
type Pieces<'a> = Vec<(&'a [u8], u64)>;

/// The same contract as `aio::write_many_at`, on an io_uring of MAX_IN_FLIGHT entries.
fn uring_write_many_at(ring: &mut io_uring::IoUring, fd: i32, pieces: &[(&[u8], u64)]) -> Vec<std::io::Result<()>> {
    let mut results: Vec<Option<std::io::Result<()>>> = (0..pieces.len()).map(|_| None).collect();
    for (start, batch) in pieces.chunks(MAX_IN_FLIGHT).enumerate().map(|(i, b)| (i * MAX_IN_FLIGHT, b)) {
        for (i, (bytes, offset)) in batch.iter().enumerate() {
            let entry = io_uring::opcode::Write::new(io_uring::types::Fd(fd), bytes.as_ptr(), bytes.len() as u32)
                .offset(*offset)
                .build()
                .user_data((start + i) as u64);
            // SAFETY: the entry names `bytes`, a piece of the caller's slice that outlives this
            // function, which waits below for every entry it pushed to complete.
            unsafe { ring.submission().push(&entry).expect("the ring holds a batch") };
        }
        ring.submit_and_wait(batch.len()).expect("io_uring_enter");
        for cqe in ring.completion() {
            let index = cqe.user_data() as usize;
            results[index] = Some(match cqe.result() {
                r if r < 0 => Err(std::io::Error::from_raw_os_error(-r)),
                r if (r as usize) < pieces[index].0.len() => Err(std::io::Error::other("short write")),
                _ => Ok(()),
            });
        }
    }
    results.into_iter().map(|r| r.expect("every piece completed")).collect()
}

fn aligned(len: usize) -> &'static mut [u8] {
    let layout = std::alloc::Layout::from_size_align(len, 4096).expect("layout");
    // SAFETY: `layout` has a non-zero size (the caller asks for whole pieces); the result is
    // checked for null below.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!ptr.is_null(), "out of memory for {len} bytes");
    // SAFETY: `ptr` is a live, zeroed allocation of `len` bytes that is leaked, never freed, so the
    // `'static` slice stays valid.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 13 + 1) as u8;
    }
    buf
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("usage: aio_vs_uring DIR [ROUNDS]");
    let rounds: usize = args.next().map(|a| a.parse().expect("ROUNDS")).unwrap_or(300);
    let path = std::path::Path::new(&dir).join("aio_vs_uring.data");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .expect("an O_DIRECT file in DIR");
    let fd = file.as_raw_fd();
    let unit = aligned(4 << 20);
    // Allocate the area first, so that every round overwrites (as a flusher's unit does).
    for i in 0..4u64 {
        aio::write_many_at(fd, &[(&unit[..1 << 20], i << 20), (&unit[..4096], (i << 20) + 4096)]);
    }
    let mut ring = io_uring::IoUring::new(MAX_IN_FLIGHT as u32).expect("io_uring_setup");

    let shapes: Vec<(&str, Pieces)> = vec![
        ("256 x 512 B over 1 MiB", (0..256u64).map(|i| (&unit[..512], (i * 4093 % 2048) * 512)).collect()),
        ("64 x 4 KiB over 1 MiB", (0..64u64).map(|i| (&unit[..4096], (i * 37 % 256) * 4096)).collect()),
        ("4 x 1 MiB", (0..4u64).map(|i| (&unit[..1 << 20], i << 20)).collect()),
    ];
    for (label, pieces) in &shapes {
        let (mut t_aio, mut t_uring, mut t_pwrite) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            assert!(aio::write_many_at(fd, pieces).iter().all(std::result::Result::is_ok), "AIO write failed");
            t_aio.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            assert!(
                uring_write_many_at(&mut ring, fd, pieces).iter().all(std::result::Result::is_ok),
                "io_uring write failed"
            );
            t_uring.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            for (bytes, offset) in pieces {
                coalescefs::sys::pwrite_all(fd, bytes, *offset).expect("pwrite");
            }
            t_pwrite.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let (a, u, p) = (median(t_aio), median(t_uring), median(t_pwrite));
        println!(
            "{label:>24}: AIO {a:8.0} us, io_uring {u:8.0} us ({:.2}x AIO), one pwrite at a time {p:8.0} us",
            u / a
        );
    }
    drop(file);
    let _ = std::fs::remove_file(&path);
}
