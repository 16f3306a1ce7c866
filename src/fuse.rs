//! The FUSE adapter: translates kernel requests into engine calls and engine answers into
//! replies. No policy lives here: what to cache, when to flush, who owns a file are the
//! engine's decisions.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    CopyFileRangeFlags, Errno as FuseErrno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::engine::buffer::WriteBytes;
use crate::engine::types::{Attr, Kind, TimeToSet, TimesToSet, Timestamp, XattrReply};
use crate::engine::{AttrChanges, Caller, Engine, Opened, PageCache};
use crate::metrics::{FuseOp, Metrics};
use crate::sys::{Errno, SysResult};
use crate::transport::Negotiation;

/// fuser's (and the kernel protocol's practical) ceiling for one write request.
pub const MAX_WRITE_BYTES_LIMIT: u64 = 16 << 20;

/// What the kernel will actually send: it clamps max_write, silently, to
/// fs.fuse.max_pages_limit pages.
fn granted_max_write_bytes(requested: u32) -> u32 {
    let page = 4096u64;
    let limit_pages: u64 = std::fs::read_to_string("/proc/sys/fs/fuse/max_pages_limit")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(256);
    u64::from(requested).min(limit_pages * page) as u32
}

pub struct FuseAdapter {
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
    max_write_bytes: u32,
    /// How long the kernel may trust the names and attributes it is told (`cache_timeout=`).
    ttl: Duration,
    /// `xattr=on` (the default): extended attributes are the backing files'. Off, every xattr
    /// request is answered ENOSYS, after which the kernel sends none (it answers EOPNOTSUPP
    /// itself): the VFS asks `security.capability` before the first write(2) of each file (FUSE
    /// clears SB_NOSEC; the inode's S_NOSEC goes with an attribute change) and before every
    /// chown, round trips the writeback cache cannot absorb (two of GNU tar's ~11 per entry).
    xattrs: bool,
    /// This mount's ID (/proc/self/mountinfo), set once it is mounted: how a closing process's
    /// descriptors are told to be on this mount (see [`crate::descriptors`]). Unset, every
    /// close is taken as the file's last.
    mount_id: Arc<OnceLock<u64>>,
    /// The session's channel for notifications to the kernel, set once it is mounted: how
    /// dirty pages are asked for before SEEK_DATA and SEEK_HOLE (see `lseek`).
    notifier: Arc<OnceLock<fuser::Notifier>>,
    /// Whether INIT asks for FUSE over io_uring, and the kernel's answer (see `transport`).
    transport: Arc<Negotiation>,
}

impl FuseAdapter {
    pub fn new(
        engine: Arc<Engine>,
        metrics: Arc<Metrics>,
        max_write_bytes: u32,
        ttl: Duration,
        xattrs: bool,
        mount_id: Arc<OnceLock<u64>>,
        transport: Arc<Negotiation>,
    ) -> FuseAdapter {
        FuseAdapter {
            engine,
            metrics,
            max_write_bytes,
            ttl,
            xattrs,
            mount_id,
            notifier: Arc::new(OnceLock::new()),
            transport,
        }
    }

    /// Where the session's notifier goes once the session exists (it is made from the adapter).
    pub fn notifier_slot(&self) -> Arc<OnceLock<fuser::Notifier>> {
        self.notifier.clone()
    }

    /// Ok where extended attributes are served; ENOSYS with `xattr=off`, which makes the
    /// kernel stop sending xattr requests for the mount.
    fn xattrs_served(&self) -> SysResult<()> {
        if self.xattrs {
            Ok(())
        } else {
            Err(Errno(libc::ENOSYS))
        }
    }
}

fn fuse_errno(e: Errno) -> FuseErrno {
    FuseErrno::from_i32(e.0)
}

fn time_of(t: Timestamp) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
    } else {
        UNIX_EPOCH - Duration::new(t.sec.unsigned_abs(), 0) + Duration::from_nanos(u64::from(t.nsec))
    }
}

fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::Directory => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDevice => FileType::CharDevice,
        Kind::BlockDevice => FileType::BlockDevice,
        Kind::File => FileType::RegularFile,
    }
}

fn attr_of(attr: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(attr.id),
        size: attr.size,
        blocks: attr.blocks,
        atime: time_of(attr.atime),
        mtime: time_of(attr.mtime),
        ctime: time_of(attr.ctime),
        crtime: UNIX_EPOCH,
        kind: file_type(attr.kind),
        perm: attr.perm as u16,
        nlink: attr.nlink,
        uid: attr.uid,
        gid: attr.gid,
        rdev: attr.rdev as u32,
        blksize: attr.blksize,
        flags: 0,
    }
}

fn time_to_set(t: Option<TimeOrNow>) -> Option<TimeToSet> {
    t.map(|t| match t {
        TimeOrNow::Now => TimeToSet::Now,
        TimeOrNow::SpecificTime(t) => TimeToSet::At(Timestamp::from(t)),
    })
}

fn caller(req: &Request) -> Caller {
    Caller { uid: req.uid(), gid: req.gid() }
}

/// The kernel reads an entry with node id 0 as "no such name", valid for its timeout.
fn negative_entry() -> FileAttr {
    FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    }
}

fn reply_entry(reply: ReplyEntry, ttl: &Duration, result: SysResult<Attr>) {
    match result {
        Ok(attr) => reply.entry(ttl, &attr_of(&attr), Generation(0)),
        Err(e) => reply.error(fuse_errno(e)),
    }
}

/// Only this mount changes the backing files, and the kernel learns of every change it makes
/// (or drops the pages itself: truncate, hole punching, copy_file_range, uncached writes under
/// FUSE_DIRECT_IO_ALLOW_MMAP), so what it has cached stays true across opens: without
/// FOPEN_KEEP_CACHE every open would throw the file's pages away, and git reading the files
/// tar has just written would ask the daemon for each again. A reader's close flushes
/// nothing here: no FLUSH round trip for it (FOPEN_NOFLUSH).
fn open_flags_of(opened: Opened) -> FopenFlags {
    let mut flags = if opened.bypass_page_cache { FopenFlags::FOPEN_DIRECT_IO } else { FopenFlags::FOPEN_KEEP_CACHE };
    if !opened.writable {
        flags |= FopenFlags::FOPEN_NOFLUSH;
    }
    flags
}

fn reply_empty(reply: ReplyEmpty, result: SysResult<()>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(fuse_errno(e)),
    }
}

fn reply_xattr(reply: ReplyXattr, result: SysResult<XattrReply>) {
    match result {
        Ok(XattrReply::Size(n)) => reply.size(n as u32),
        Ok(XattrReply::Data(bytes)) => reply.data(&bytes),
        Err(e) => reply.error(fuse_errno(e)),
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Ask for the largest requests the kernel allows; it clamps silently to
        // fs.fuse.max_pages_limit pages.
        if let Err(nearest) = config.set_max_write(self.max_write_bytes) {
            let _ = config.set_max_write(nearest);
        }
        let granted = granted_max_write_bytes(self.max_write_bytes);
        if granted < self.max_write_bytes {
            log::warn!(
                "asked for {} byte FUSE requests, the kernel grants {}: raise it with \
                 `sysctl fs.fuse.max_pages_limit={}` before mounting",
                self.max_write_bytes,
                granted,
                self.max_write_bytes / 4096
            );
        } else {
            log::info!("FUSE requests up to {granted} bytes");
        }
        let mut wanted = InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO
            | InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_ASYNC_DIO
            // Without it the kernel sends GETXATTR security.capability before every write:
            // two round trips per write instead of one. The price is that clearing
            // set-user-ID/set-group-ID after unprivileged writes and truncates is ours.
            | InitFlags::FUSE_HANDLE_KILLPRIV_V2
            // Not FUSE_ATOMIC_O_TRUNC: with it, an O_RDONLY|O_TRUNC open reaches the daemon
            // before the kernel checks write access, so a running executable was truncated
            // although the open then failed with ETXTBSY (pjdfstest's open::etxtbsy caught
            // the program dying as its pages went). The kernel sends the truncate as a setattr
            // after its checks.
            // Link targets stay in the page cache (only this mount changes them).
            | InitFlags::FUSE_CACHE_SYMLINKS;
        match self.engine.page_cache() {
            PageCache::Off => {}
            PageCache::On => wanted |= InitFlags::FUSE_WRITEBACK_CACHE,
            // Handles that bypass the cache may still be mapped shared; with this flag the
            // kernel also writes back and drops cached pages before every uncached request.
            PageCache::Auto => wanted |= InitFlags::FUSE_WRITEBACK_CACHE | InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
        }
        wanted |= self.transport.answer_init(config.capabilities());
        let supported = wanted & config.capabilities();
        let _ = config.add_capabilities(supported);
        Ok(())
    }

    fn destroy(&mut self) {
        self.engine.shut_down();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Lookup);
        match self.engine.lookup(parent.0, name) {
            // A name that does not exist, cached by the kernel as long as one that does (node id
            // 0 with a timeout: a negative dentry). Only this mount changes the backing
            // directory, and the kernel replaces the negative entry itself when the mount makes
            // the name. git looks a loose object's name up before it writes the object and
            // again to link it there; a compiler looks for each header along its search path.
            Err(Errno(libc::ENOENT)) => reply.entry(&self.ttl, &negative_entry(), Generation(0)),
            result => reply_entry(reply, &self.ttl, result),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Forget);
        self.engine.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Getattr);
        match self.engine.getattr(ino.0) {
            Ok(attr) => reply.attr(&self.ttl, &attr_of(&attr)),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Setattr);
        let changes = AttrChanges {
            mode,
            uid,
            gid,
            size,
            times: TimesToSet { atime: time_to_set(atime), mtime: time_to_set(mtime) },
            // The kernel flags unprivileged truncates with FATTR_KILL_SUIDGID, and asks to drop
            // privileges before an unprivileged write with an otherwise empty setattr; fuser
            // hides the flag, so a caller other than root stands for "lacks CAP_FSETID".
            drop_set_id_bits: req.uid() != 0
                && (size.is_some() || (mode, uid, gid, atime, mtime) == (None, None, None, None, None)),
        };
        match self.engine.setattr(ino.0, fh.map(|fh| fh.0), changes) {
            Ok(attr) => reply.attr(&self.ttl, &attr_of(&attr)),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Readlink);
        match self.engine.readlink(ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Mknod);
        reply_entry(reply, &self.ttl, self.engine.mknod(parent.0, name, mode, u64::from(rdev), caller(req)));
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, reply: ReplyEntry) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Mkdir);
        reply_entry(reply, &self.ttl, self.engine.mkdir(parent.0, name, mode, caller(req)));
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Unlink);
        reply_empty(reply, self.engine.unlink(parent.0, name));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Rmdir);
        reply_empty(reply, self.engine.rmdir(parent.0, name));
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Symlink);
        reply_entry(
            reply,
            &self.ttl,
            self.engine.symlink(parent.0, link_name, target.as_os_str().as_bytes(), caller(req)),
        );
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Rename);
        reply_empty(reply, self.engine.rename(parent.0, name, newparent.0, newname, flags.bits()));
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Link);
        reply_entry(reply, &self.ttl, self.engine.link(ino.0, newparent.0, newname));
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Open);
        // An unprivileged O_TRUNC open comes with FUSE_OPEN_KILL_SUIDGID, which fuser hides;
        // as for truncate, a caller other than root stands for it.
        match self.engine.open(ino.0, flags.0, req.uid() != 0) {
            Ok(opened) => reply.opened(FileHandle(opened.fh), open_flags_of(opened)),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Read);
        match self.engine.read(fh.0, offset, size) {
            Ok(bytes) => reply.data(&bytes),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Write);
        let drop_set_id_bits = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let from_page_cache = write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        // The engine may answer a large write before copying it in (`Engine::write_answering`).
        let mut unanswered = Some(reply);
        let bytes = if crate::transport::payload_pages_given(data) {
            // SAFETY: the transport gives this payload's pages up (`payload_pages_given`): its
            // own private anonymous memory, untouched by the kernel and unread by anything
            // until it is filled again after this write.
            unsafe { WriteBytes::pages_given(data) }
        } else {
            WriteBytes::copied(data)
        };
        let result = self.engine.write_answering(
            fh.0,
            offset,
            bytes,
            flags.0,
            drop_set_id_bits,
            from_page_cache,
            &mut |taken| {
                if let Some(reply) = unanswered.take() {
                    reply.written(taken);
                }
            },
        );
        match (unanswered, result) {
            (Some(reply), Ok(n)) => reply.written(n),
            (Some(reply), Err(e)) => reply.error(fuse_errno(e)),
            (None, result) => assert!(result.is_ok(), "a write failed after it was answered: {result:?}"),
        }
    }

    fn flush(&self, req: &Request, _ino: INodeNo, fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Flush);
        // The kernel names our files to the caller by the node ID (`ino` in every attribute).
        let closer_keeps_a_writer = |id: u64| {
            self.mount_id.get().is_some_and(|&mount_id| crate::descriptors::holds_a_writer(req.pid(), mount_id, id))
        };
        reply_empty(reply, self.engine.flush(fh.0, &closer_keeps_a_writer));
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Release);
        reply_empty(reply, self.engine.release(fh.0));
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Fsync);
        reply_empty(reply, self.engine.fsync(fh.0, datasync));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Opendir);
        match self.engine.opendir(ino.0) {
            // Listings stay cached until the kernel itself changes the directory (see
            // open_flags_of): rm -rf and git status list every directory.
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Readdir);
        match self.engine.readdir(fh.0, offset) {
            Ok(entries) => {
                for entry in entries {
                    if reply.add(
                        INodeNo(entry.ino),
                        entry.next_offset,
                        entry.kind.map_or(FileType::RegularFile, file_type),
                        &entry.name,
                    ) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn readdirplus(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectoryPlus) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Readdirplus);
        let entries = match self.engine.readdir(fh.0, offset) {
            Ok(entries) => entries,
            Err(e) => return reply.error(fuse_errno(e)),
        };
        for entry in entries {
            if entry.name == "." || entry.name == ".." {
                // The kernel does not link "." and ".." from readdirplus; no lookup is owed.
                let Ok(st) = self.engine.getattr(ino.0) else { continue };
                if reply.add(
                    INodeNo(entry.ino),
                    entry.next_offset,
                    &entry.name,
                    &self.ttl,
                    &attr_of(&st),
                    Generation(0),
                ) {
                    break;
                }
                continue;
            }
            // Every entry sent with attributes counts as a lookup the kernel will forget later.
            let Ok(found) = self.engine.lookup(ino.0, &entry.name) else { continue };
            if reply.add(INodeNo(found.id), entry.next_offset, &entry.name, &self.ttl, &attr_of(&found), Generation(0))
            {
                // Did not fit: the kernel will not learn of this lookup, so undo it.
                self.engine.forget(found.id, 1);
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Releasedir);
        reply_empty(reply, self.engine.releasedir(fh.0));
    }

    fn fsyncdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Fsyncdir);
        reply_empty(reply, self.engine.fsyncdir(fh.0, datasync));
    }

    /// No ioctl is implemented, and the answer is the one a file without them gives: every
    /// `open()` in Python asks a new file whether it is a terminal (TCGETS), and fuser's default
    /// logged a warning for each.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(FuseErrno::from_i32(libc::ENOTTY));
    }

    fn statfs(&self, _req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Statfs);
        match self.engine.statfs(ino.0) {
            Ok(st) => reply.statfs(
                st.blocks,
                st.blocks_free,
                st.blocks_available,
                st.files,
                st.files_free,
                st.block_size,
                st.name_max,
                st.fragment_size,
            ),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Setxattr);
        reply_empty(reply, self.xattrs_served().and_then(|()| self.engine.set_xattr(ino.0, name, value, flags)));
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Getxattr);
        reply_xattr(reply, self.xattrs_served().and_then(|()| self.engine.get_xattr(ino.0, name, size)));
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Listxattr);
        reply_xattr(reply, self.xattrs_served().and_then(|()| self.engine.list_xattr(ino.0, size)));
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Removexattr);
        reply_empty(reply, self.xattrs_served().and_then(|()| self.engine.remove_xattr(ino.0, name)));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Create);
        match self.engine.create(parent.0, name, mode, flags, caller(req)) {
            Ok((entry, opened)) => {
                reply.created(&self.ttl, &attr_of(&entry), Generation(0), FileHandle(opened.fh), open_flags_of(opened));
            }
            Err(e) => reply.error(fuse_errno(e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::Fallocate);
        reply_empty(reply, self.engine.fallocate(fh.0, offset, length, mode));
    }

    /// SEEK_DATA and SEEK_HOLE must see what the application wrote, pages the kernel holds
    /// dirty included (`Engine::kernel_may_hold_writes`). An inode invalidation from `offset`
    /// on makes the kernel write those pages back (each one a WRITE request) before it returns;
    /// it runs on a thread of its own, which answers the lseek after it, so that the workers
    /// (one, with `threads=1`) are free to take those writes. Its cost: the file's cached pages
    /// from `offset` on are read again.
    fn lseek(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        let answer = move |engine: &Engine, reply: ReplyLseek| match engine.lseek(fh.0, offset, whence) {
            Ok(offset) => reply.offset(offset),
            Err(e) => reply.error(fuse_errno(e)),
        };
        let notifier = self.notifier.get().filter(|_| {
            matches!(whence, libc::SEEK_DATA | libc::SEEK_HOLE) && self.engine.kernel_may_hold_writes(fh.0)
        });
        let Some(notifier) = notifier.cloned() else {
            let _served = self.metrics.fuse_requests.start(FuseOp::Lseek);
            return answer(&self.engine, reply);
        };
        let (engine, metrics) = (self.engine.clone(), self.metrics.clone());
        let spawned = std::thread::Builder::new().name("lseek".into()).spawn(move || {
            let _served = metrics.fuse_requests.start(FuseOp::Lseek);
            if let Err(e) = notifier.inval_inode(ino, offset.max(0), 0) {
                log::warn!("inode {}: asking the kernel for its dirty pages before lseek: {e}", ino.0);
            }
            answer(&engine, reply);
        });
        // One thread per such lseek, as many as applications ask at once. Where none can be
        // made the reply goes unsent with the closure, which fuser answers EIO on drop.
        if let Err(e) = spawned {
            log::warn!("no thread for an lseek that must wait for the kernel's dirty pages: {e}; answered EIO");
        }
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        _ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let _served = self.metrics.fuse_requests.start(FuseOp::CopyFileRange);
        match self.engine.copy_file_range(fh_in.0, offset_in, fh_out.0, offset_out, len) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(fuse_errno(e)),
        }
    }
}
