//! A block device recorder for the power-cut simulation (tests/powercut/run), in the manner of
//! dm-log-writes, which this machine's kernel lacks: a FUSE file system holding one file,
//! `disk`, backed by an image file, to be attached to a loop device. Every write to `disk` is
//! appended to a trace with its bytes, every fsync of it (the loop device's FLUSH, and the
//! flush that emulates FUA) as a barrier, and every write to the file `mark` as a marker: the
//! test writes one after each acknowledgement, so the trace says which acknowledgements came
//! before which writes.
//!
//! usage: block_recorder IMAGE TRACE MOUNTPOINT      (runs until unmounted)
//!
//! Trace records, little-endian: b'W' offset:u64 length:u32 bytes | b'F' | b'M' length:u32 text.
//! Requests are handled one at a time, in the order the kernel sends them.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::sync::Mutex;
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags,
    ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, WriteFlags,
};

const ROOT: u64 = 1;
const DISK: u64 = 2;
const MARK: u64 = 3;
const TTL: Duration = Duration::from_secs(3600);

struct Recorder {
    image: File,
    size: u64,
    trace: Mutex<BufWriter<File>>,
}

impl Recorder {
    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, perm, size, nlink) = match ino {
            ROOT => (FileType::Directory, 0o755, 0, 2),
            DISK => (FileType::RegularFile, 0o600, self.size, 1),
            _ => (FileType::RegularFile, 0o200, 0, 1),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn record(&self, bytes: &[&[u8]], sync: bool) -> std::io::Result<()> {
        let mut trace = self.trace.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for part in bytes {
            trace.write_all(part)?;
        }
        if sync {
            trace.flush()?;
        }
        Ok(())
    }
}

impl Filesystem for Recorder {
    fn destroy(&mut self) {
        let _ = self.record(&[], true);
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (parent.0, name.to_str()) {
            (ROOT, Some("disk")) => reply.entry(&TTL, &self.attr(DISK), Generation(0)),
            (ROOT, Some("mark")) => reply.entry(&TTL, &self.attr(MARK), Generation(0)),
            _ => reply.error(Errno::from_i32(libc::ENOENT)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino.0 {
            ROOT | DISK | MARK => reply.attr(&TTL, &self.attr(ino.0)),
            _ => reply.error(Errno::from_i32(libc::ENOENT)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // No page cache above the recorder: every write reaches it, in the order it was issued.
        reply.opened(FileHandle(ino.0), FopenFlags::FOPEN_DIRECT_IO);
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
        if ino.0 != DISK {
            return reply.data(&[]);
        }
        let len = u64::from(size).min(self.size.saturating_sub(offset)) as usize;
        let mut buf = vec![0u8; len];
        match self.image.read_exact_at(&mut buf, offset) {
            Ok(()) => reply.data(&buf),
            Err(e) => reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
        }
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
        let result = match ino.0 {
            DISK if offset + data.len() as u64 > self.size => Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
            DISK => self.image.write_all_at(data, offset).and_then(|()| {
                self.record(&[b"W", &offset.to_le_bytes(), &(data.len() as u32).to_le_bytes(), data], false)
            }),
            MARK => self.record(&[b"M", &(data.len() as u32).to_le_bytes(), data], true),
            _ => Err(std::io::Error::from_raw_os_error(libc::EBADF)),
        };
        match result {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
        }
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let result = if ino.0 == DISK { self.record(&[b"F"], true) } else { Ok(()) };
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let entries = [
            (ROOT, FileType::Directory, "."),
            (ROOT, FileType::Directory, ".."),
            (DISK, FileType::RegularFile, "disk"),
            (MARK, FileType::RegularFile, "mark"),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*ino), i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, image, trace, mountpoint] = args.as_slice() else {
        eprintln!("usage: block_recorder IMAGE TRACE MOUNTPOINT");
        std::process::exit(2);
    };
    let image = OpenOptions::new().read(true).write(true).open(image).expect("open the image");
    let size = image.metadata().expect("stat the image").len();
    let trace = BufWriter::with_capacity(1 << 20, File::create(trace).expect("create the trace"));
    let recorder = Recorder { image, size, trace: Mutex::new(trace) };
    let mut config = fuser::Config::default();
    config.mount_options = vec![fuser::MountOption::FSName("block_recorder".into())];
    if let Err(e) = fuser::mount(recorder, mountpoint, &config) {
        eprintln!("block_recorder: {e}");
        std::process::exit(1);
    }
}
