//! coalescefs-null-sink: the FUSE ceiling coalescefs is measured against (issue 45, seed 001).
//! A FUSE server that does no work: files in its root keep their sizes, writes are discarded,
//! reads return zeros. It is served by the same fuser (vendored) and the same transport layer
//! (`transport=auto|uring|dev`, the rings of `coalescefs::transport`) as coalescefs, with the
//! same INIT flags on the data path and the same session set-up (threads, clone_fd), so that
//! coalescefs over this machine's kernel can be compared with it in one benchmark run
//! (`bench/run --only transport`): whatever separates the two is coalescefs's own work.
//!
//! A binary of its own rather than a hidden `coalescefs` subcommand: the command line's help,
//! man page and completions are generated from main.rs's definitions and are the product's; a
//! benchmark tool does not belong there, nor in the package (scripts/package ships only
//! `coalescefs`). Its process name also tells it apart from the daemon in `ps` and profiles.
//!
//! usage: coalescefs-null-sink MOUNTPOINT [-o transport=auto|uring|dev,max_write=SIZE,threads=N,cache_timeout=DURATION]
//!
//! Root only (it mounts with mount(2) as the daemon does). Prints `serving MOUNTPOINT over
//! uring|dev` on stdout once the mount answers, serves in the foreground until it is unmounted
//! (SIGINT and SIGTERM unmount it), then prints on stderr how many requests came over the rings.
//!
//! Owns: only what a file needs to be written and read back as zeros. Must not: grow into a
//! second file system; anything coalescefs does on top of this is what the comparison measures.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use coalescefs::metrics::Metrics;
use coalescefs::transport::{self, Negotiation, TransportChoice};
use coalescefs::{fuse, mounts, options, parse};
use fuser::{
    FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig, LockOwner,
    OpenFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request,
    TimeOrNow, WriteFlags,
};

const USAGE: &str = "usage: coalescefs-null-sink MOUNTPOINT [-o transport=auto|uring|dev,max_write=SIZE,threads=N,cache_timeout=DURATION]";
/// `mount` shows it so; not `fuse.coalescefs`, so that nothing looking for coalescefs mounts
/// (`coalescefs umount`, `forget --orphans`) takes it for one.
const FS_TYPE: &str = "fuse.coalescefs-null-sink";
const ROOT: u64 = 1;
/// The most files it keeps: a bound, and far more than a benchmark makes.
const FILES_MAX: usize = 1 << 16;

/// The options it shares with `coalescefs mount`, with the same defaults.
struct SinkOptions {
    transport: TransportChoice,
    max_write_bytes: u32,
    threads: usize,
    /// How long the kernel trusts names and attributes (`cache_timeout=`; 0 makes every fstat
    /// a GETATTR, as the per-request benchmark wants).
    ttl: Duration,
}

fn parse_options(list: &[String]) -> Result<SinkOptions, String> {
    let defaults = options::MountOptions::default();
    let mut sink = SinkOptions {
        transport: defaults.transport,
        // coalescefs's default is the unit, 1 MiB where nothing else decides it.
        max_write_bytes: 1 << 20,
        threads: defaults.threads,
        ttl: defaults.cache_timeout,
    };
    for option in list.iter().flat_map(|o| o.split(',')).filter(|o| !o.is_empty()) {
        let (key, value) = option.split_once('=').ok_or_else(|| format!("option '{option}' needs a value"))?;
        match key {
            "transport" => sink.transport = TransportChoice::parse(value)?,
            "max_write" => {
                let bytes = options::parse_size(value)?;
                if bytes < 4096 || bytes % 4096 != 0 || bytes > fuse::MAX_WRITE_BYTES_LIMIT {
                    return Err(format!("max_write={value}: a multiple of 4K up to 16M"));
                }
                sink.max_write_bytes = bytes as u32;
            }
            "threads" => {
                sink.threads = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=64).contains(n))
                    .ok_or_else(|| format!("threads={value}: expected a whole number from 1 to 64"))?;
            }
            "cache_timeout" => sink.ttl = parse::parse_duration(value)?,
            _ => {
                return Err(format!(
                    "unknown option '{key}' (the null sink takes transport, max_write, threads, cache_timeout)"
                ))
            }
        }
    }
    Ok(sink)
}

#[derive(Default)]
struct Files {
    by_name: HashMap<OsString, u64>,
    /// Size of file `ino`, at index ino - 2.
    sizes: Vec<u64>,
}

struct NullSink {
    files: Mutex<Files>,
    ttl: Duration,
    max_write_bytes: u32,
    transport: Arc<Negotiation>,
    /// What a read returns: zeros, never written (the zero page behind it).
    zeros: Vec<u8>,
}

fn attr(ino: u64, size: u64) -> FileAttr {
    let directory = ino == ROOT;
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: if directory { FileType::Directory } else { FileType::RegularFile },
        perm: if directory { 0o755 } else { 0o644 },
        nlink: if directory { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl NullSink {
    fn lock(&self) -> std::sync::MutexGuard<'_, Files> {
        self.files.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn size_of(&self, ino: u64) -> Option<u64> {
        if ino == ROOT {
            return Some(0);
        }
        self.lock().sizes.get(ino.checked_sub(2)? as usize).copied()
    }
}

/// Cached as coalescefs caches a file without data (FOPEN_KEEP_CACHE, the writeback cache on),
/// so buffered writes take the same kernel path through both.
const OPEN_FLAGS: FopenFlags = FopenFlags::FOPEN_KEEP_CACHE;

impl Filesystem for NullSink {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(nearest) = config.set_max_write(self.max_write_bytes) {
            let _ = config.set_max_write(nearest);
        }
        // The flags of coalescefs's INIT that shape the data path (src/fuse.rs): the same
        // requests reach both servers for the same workload.
        let wanted = InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_ASYNC_DIO
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2
            | InitFlags::FUSE_WRITEBACK_CACHE
            | InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP
            | self.transport.answer_init(config.capabilities());
        let _ = config.add_capabilities(wanted & config.capabilities());
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let files = self.lock();
        match files.by_name.get(name) {
            Some(&ino) if parent.0 == ROOT => {
                let size = files.sizes[(ino - 2) as usize];
                reply.entry(&self.ttl, &attr(ino, size), Generation(0));
            }
            _ => reply.error(fuser::Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.size_of(ino.0) {
            Some(size) => reply.attr(&self.ttl, &attr(ino.0, size)),
            None => reply.error(fuser::Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // Only the size is kept; every other change is accepted and forgotten.
        let mut files = self.lock();
        let Some(slot) = ino.0.checked_sub(2).and_then(|i| files.sizes.get_mut(i as usize)) else {
            drop(files);
            return match ino.0 {
                ROOT => reply.attr(&self.ttl, &attr(ROOT, 0)),
                _ => reply.error(fuser::Errno::ENOENT),
            };
        };
        if let Some(size) = size {
            *slot = size;
        }
        let size = *slot;
        drop(files);
        reply.attr(&self.ttl, &attr(ino.0, size));
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.size_of(ino.0) {
            Some(_) => reply.opened(FileHandle(ino.0), OPEN_FLAGS),
            None => reply.error(fuser::Errno::ENOENT),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        if parent.0 != ROOT {
            return reply.error(fuser::Errno::ENOENT);
        }
        let mut files = self.lock();
        let ino = match files.by_name.get(name) {
            Some(&ino) => ino,
            None if files.sizes.len() >= FILES_MAX => {
                drop(files);
                return reply.error(fuser::Errno::ENOSPC);
            }
            None => {
                files.sizes.push(0);
                let ino = files.sizes.len() as u64 + 1;
                files.by_name.insert(name.to_owned(), ino);
                ino
            }
        };
        let size = files.sizes[(ino - 2) as usize];
        drop(files);
        reply.created(&self.ttl, &attr(ino, size), Generation(0), FileHandle(ino), OPEN_FLAGS);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let file_size = self.size_of(ino.0).unwrap_or(0);
        let bytes = file_size.saturating_sub(offset).min(u64::from(size)).min(self.zeros.len() as u64) as usize;
        reply.data(&self.zeros[..bytes]);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let end = offset.saturating_add(data.len() as u64);
        let mut files = self.lock();
        match ino.0.checked_sub(2).and_then(|i| files.sizes.get_mut(i as usize)) {
            Some(size) => {
                *size = (*size).max(end);
                drop(files);
                reply.written(data.len() as u32);
            }
            None => {
                drop(files);
                reply.error(fuser::Errno::EBADF);
            }
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // Room for anything (1 PiB free): a tool that checks free space first writes anyway.
        let blocks = 1u64 << 38;
        reply.statfs(blocks, blocks, blocks, FILES_MAX as u64, FILES_MAX as u64, 4096, 255, 4096);
    }
}

/// SIGINT and SIGTERM unmount (lazily), which ends the session: the sink never leaves a dead
/// mount behind when a benchmark stops it. The signals are blocked in every thread but one
/// that waits for them (called before any other thread starts, so all inherit the mask).
fn unmount_on_signal(mount_point: PathBuf) {
    // SAFETY: sigset_t is plain data initialised by sigemptyset; the calls only read and write
    // the set and this thread's signal mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&raw mut set);
        libc::sigaddset(&raw mut set, libc::SIGINT);
        libc::sigaddset(&raw mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &raw const set, std::ptr::null_mut());
        set
    };
    std::thread::spawn(move || loop {
        let mut signal = 0;
        // SAFETY: waits on a valid set; writes the signal number into a live integer.
        if unsafe { libc::sigwait(&raw const set, &raw mut signal) } == 0 {
            eprintln!("coalescefs-null-sink: signal {signal}: unmounting {}", mount_point.display());
            let _ = mounts::unmount(&mount_point, true);
        }
    });
}

fn serve(mount_point: &Path, sink_options: &SinkOptions) -> Result<u64, String> {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("the null sink mounts with mount(2): run it as root".into());
    }
    let negotiation = Arc::new(Negotiation::for_choice(sink_options.transport)?);
    let sink = NullSink {
        files: Mutex::new(Files::default()),
        ttl: sink_options.ttl,
        max_write_bytes: sink_options.max_write_bytes,
        transport: negotiation.clone(),
        zeros: vec![0u8; fuse::MAX_WRITE_BYTES_LIMIT as usize],
    };
    unmount_on_signal(mount_point.to_path_buf());
    let fd = mounts::mount_direct_as(FS_TYPE, "null-sink", mount_point, &options::MountOptions::default())?;
    // As the daemon's session (src/daemon/mod.rs, start_session): its threads, a cloned /dev/fuse
    // descriptor per thread.
    let mut config = fuser::Config::default();
    config.acl = fuser::SessionACL::Owner;
    config.n_threads = Some(sink_options.threads);
    config.clone_fd = true;
    let session = fuser::Session::from_fd(sink, fd, fuser::SessionACL::Owner, config).map_err(|e| {
        let _ = mounts::unmount(mount_point, true);
        format!("FUSE handshake failed: {e}")
    })?;
    let rings =
        transport::rings_after_init(&session, &negotiation, sink_options.transport, sink_options.max_write_bytes)
            .inspect_err(|_| {
                let _ = mounts::unmount(mount_point, true);
            })?;
    let metrics = Arc::new(Metrics::default());
    let name = if rings.is_some() { "uring" } else { "dev" };
    println!("serving {} over {name}", mount_point.display());
    let _ = std::io::stdout().flush();
    let ring_metrics = metrics.clone();
    session
        .run_with_transport(move |dispatcher| {
            if let Some(rings) = rings {
                rings.serve(dispatcher, ring_metrics);
            }
            Ok(())
        })
        .map_err(|e| format!("the session ended: {e}"))?;
    Ok(metrics.fuse_ring_requests.load(Relaxed))
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn,fuser=error")).init();
    let mut args = std::env::args().skip(1);
    let mut mount_point = None;
    let mut option_lists = Vec::new();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "-o" => match args.next() {
                Some(list) => option_lists.push(list),
                None => {
                    eprintln!("-o needs options\n{USAGE}");
                    return ExitCode::from(2);
                }
            },
            _ if mount_point.is_none() && !arg.starts_with('-') => mount_point = Some(PathBuf::from(arg)),
            _ => {
                eprintln!("unexpected argument '{arg}'\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(mount_point) = mount_point else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let sink_options = match parse_options(&option_lists) {
        Ok(o) => o,
        Err(message) => {
            eprintln!("coalescefs-null-sink: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match serve(&mount_point, &sink_options) {
        Ok(ring_requests) => {
            eprintln!("coalescefs-null-sink: unmounted; {ring_requests} requests over the rings");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("coalescefs-null-sink: {message}");
            ExitCode::FAILURE
        }
    }
}
