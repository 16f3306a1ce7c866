//! The engine's own vocabulary at the seam to the backends: object ids, attributes, directory
//! entries, attribute changes. Backends speak it (see `backend::Namespace`); the FUSE adapter
//! translates it to the kernel's. Nothing here is any backend's type.

use std::ffi::OsString;

/// An object's id, which is also its FUSE inode number. Stable for the object's life, and never
/// given to another object while anything may still name it (the kernel's cached inode, an
/// open file, the intent log). The root is `ROOT_ID`.
pub type ObjectId = u64;

pub const ROOT_ID: ObjectId = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    File,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl Kind {
    /// The kind a `st_mode`'s format bits say.
    pub fn of_mode(mode: u32) -> Kind {
        match mode & libc::S_IFMT {
            libc::S_IFDIR => Kind::Directory,
            libc::S_IFLNK => Kind::Symlink,
            libc::S_IFIFO => Kind::Fifo,
            libc::S_IFSOCK => Kind::Socket,
            libc::S_IFCHR => Kind::CharDevice,
            libc::S_IFBLK => Kind::BlockDevice,
            _ => Kind::File,
        }
    }

    /// The format bits of a `st_mode` of this kind.
    pub fn mode_bits(self) -> u32 {
        match self {
            Kind::File => libc::S_IFREG,
            Kind::Directory => libc::S_IFDIR,
            Kind::Symlink => libc::S_IFLNK,
            Kind::Fifo => libc::S_IFIFO,
            Kind::Socket => libc::S_IFSOCK,
            Kind::CharDevice => libc::S_IFCHR,
            Kind::BlockDevice => libc::S_IFBLK,
        }
    }
}

/// A point in time: seconds and nanoseconds since the epoch (seconds may be negative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

impl Timestamp {
    pub fn now() -> Timestamp {
        Timestamp::from(std::time::SystemTime::now())
    }
}

impl From<std::time::SystemTime> for Timestamp {
    fn from(t: std::time::SystemTime) -> Timestamp {
        match t.duration_since(std::time::UNIX_EPOCH) {
            Ok(d) => Timestamp { sec: d.as_secs() as i64, nsec: d.subsec_nanos() },
            Err(before) => {
                let d = before.duration();
                let (mut sec, mut nsec) = (-(d.as_secs() as i64), d.subsec_nanos());
                if nsec > 0 {
                    sec -= 1;
                    nsec = 1_000_000_000 - nsec;
                }
                Timestamp { sec, nsec }
            }
        }
    }
}

/// What an object is, as a backend reports it and the engine completes it (the write buffer
/// knows newer sizes and times than the backend until it is flushed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    pub id: ObjectId,
    pub kind: Kind,
    /// Permission bits, set-id and sticky bits (`mode & 0o7777`).
    pub perm: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub size: u64,
    /// 512-byte blocks allocated.
    pub blocks: u64,
    pub blksize: u32,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
}

impl Attr {
    /// The whole `st_mode`: format bits and permissions.
    pub fn mode(&self) -> u32 {
        self.kind.mode_bits() | self.perm
    }
}

/// One entry of a directory listing, with the offset reading continues at after it.
#[derive(Clone, Debug)]
pub struct DirEntry {
    pub name: OsString,
    /// The id the entry's object has or would get (what `stat` reports), for the listing.
    pub id: ObjectId,
    /// None where the backend does not say (the caller looks it up if it needs to know).
    pub kind: Option<Kind>,
    pub next_offset: u64,
}

/// A time to set: a given one, or the time of the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeToSet {
    Now,
    At(Timestamp),
}

/// Times to set; None leaves one as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimesToSet {
    pub atime: Option<TimeToSet>,
    pub mtime: Option<TimeToSet>,
}

impl TimesToSet {
    /// The same times with "now" fixed to `now`, so that they can be set again later.
    pub fn resolved(self, now: Timestamp) -> TimesToSet {
        let fix = |t: Option<TimeToSet>| t.map(|t| TimeToSet::At(if let TimeToSet::At(at) = t { at } else { now }));
        TimesToSet { atime: fix(self.atime), mtime: fix(self.mtime) }
    }

    pub fn is_empty(&self) -> bool {
        self.atime.is_none() && self.mtime.is_none()
    }
}

/// Attribute changes of one setattr; None leaves a field alone. A size change is the write
/// buffer's (see `backend::FileData::set_size`), not the namespace's.
#[derive(Clone, Copy, Debug, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub times: TimesToSet,
}

/// Who a new object belongs to.
#[derive(Clone, Copy, Debug)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// What to make in a directory.
#[derive(Clone, Copy, Debug)]
pub enum NewObject<'a> {
    /// A regular file, with these permission bits.
    File {
        perm: u32,
    },
    Directory {
        perm: u32,
    },
    /// A fifo, socket or device node: the whole mode (format bits included) and its device.
    Node {
        mode: u32,
        rdev: u64,
    },
    Symlink {
        target: &'a [u8],
    },
}

/// The answer to a getxattr or listxattr: the size, when asked with size 0, else the bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XattrReply {
    Size(usize),
    Data(Vec<u8>),
}

/// A file system's sizes, for statfs.
#[derive(Clone, Copy, Debug, Default)]
pub struct StatFs {
    pub blocks: u64,
    pub blocks_free: u64,
    pub blocks_available: u64,
    pub files: u64,
    pub files_free: u64,
    pub block_size: u32,
    pub name_max: u32,
    pub fragment_size: u32,
}
