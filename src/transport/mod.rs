//! How FUSE requests reach the daemon: read(2) from /dev/fuse (fuser's own loops), or FUSE over
//! io_uring (`uring`: a queue per possible CPU, each answered in place in its ring entry).
//!
//! Owns: choosing the transport (`-o transport=`), the INIT negotiation state it needs, and the
//! rings. Must not: interpret requests; fuser parses and dispatches them to `fuse::FuseAdapter`
//! whichever transport brought them.

pub mod uring;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// Whether `data` (a write's bytes) lies in the buffer of the request this thread is
/// dispatching, and its transport gives that buffer's pages up: private anonymous memory of
/// the transport's own, which the kernel does not touch until the request is answered after
/// its handler returns, and which nothing reads after the handler (the next request is copied
/// over it). The write buffer may then take its pages instead of copying them. Both transports
/// do: fuser's /dev/fuse read buffer, and a ring entry's memory (`uring`, through
/// `RequestDispatcher::dispatch_given`); fuser keeps the one record of it
/// (`fuser::request_bytes_given`, vendor/fuser/PATCHES.md).
pub fn payload_pages_given(data: &[u8]) -> bool {
    fuser::request_bytes_given(data)
}

/// The kernel's switch for FUSE over io_uring (root may set it; off by default).
pub const ENABLE_URING_PATH: &str = "/sys/module/fuse/parameters/enable_uring";

/// `-o transport=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// io_uring where the kernel offers it, else /dev/fuse.
    Auto,
    /// io_uring, or the mount fails.
    Uring,
    /// /dev/fuse only.
    Dev,
}

impl TransportChoice {
    pub fn parse(value: &str) -> Result<TransportChoice, String> {
        match value {
            "auto" => Ok(TransportChoice::Auto),
            "uring" => Ok(TransportChoice::Uring),
            "dev" => Ok(TransportChoice::Dev),
            v => Err(format!("transport={v}: expected auto, uring or dev")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Uring => "uring",
            TransportChoice::Dev => "dev",
        }
    }
}

/// Why the kernel will not speak io_uring to this mount, or None when it should: the module
/// parameter is on and this process may create a ring of 128-byte entries.
pub fn uring_unavailable() -> Option<String> {
    match std::fs::read_to_string(ENABLE_URING_PATH) {
        Ok(s) if s.trim() == "Y" || s.trim() == "1" => {}
        Ok(s) => return Some(format!("{ENABLE_URING_PATH} is {} (echo 1 > it, as root)", s.trim())),
        Err(e) => return Some(format!("{ENABLE_URING_PATH}: {e} (a kernel without CONFIG_FUSE_IO_URING)")),
    }
    uring::probe_ring().err().map(|e| format!("cannot create an io_uring: {e}"))
}

/// Whether the daemon asks for FUSE over io_uring at INIT, and whether the kernel granted it.
/// Shared by the daemon (which decides before mounting and starts the rings after INIT) and
/// the adapter (which answers INIT).
#[derive(Debug, Default)]
pub struct Negotiation {
    ask_for_ring: bool,
    granted: AtomicBool,
}

impl Negotiation {
    pub fn new(ask_for_ring: bool) -> Negotiation {
        Negotiation { ask_for_ring, granted: AtomicBool::new(false) }
    }

    /// What `-o transport=` asks for at INIT on this kernel: `auto` asks only where the kernel
    /// offers the ring; `uring` where it does not is an error, before anything is mounted.
    pub fn for_choice(choice: TransportChoice) -> Result<Negotiation, String> {
        let ask_for_ring = match (choice, uring_unavailable()) {
            (TransportChoice::Dev, _) => false,
            (TransportChoice::Auto | TransportChoice::Uring, None) => true,
            (TransportChoice::Auto, Some(why)) => {
                log::info!("transport=auto: /dev/fuse, FUSE over io_uring is not available: {why}");
                false
            }
            (TransportChoice::Uring, Some(why)) => {
                return Err(format!("transport=uring: FUSE over io_uring is not available: {why}"));
            }
        };
        Ok(Negotiation::new(ask_for_ring))
    }

    /// At INIT, given the capabilities the kernel offers: FUSE_OVER_IO_URING when it was asked
    /// for and is offered (then granted), else nothing. It is a `flags2` bit (41): fuser answers
    /// INIT with flags2, so adding it to the capabilities is enough.
    pub fn answer_init(&self, offered: fuser::InitFlags) -> fuser::InitFlags {
        if !self.ask_for_ring {
            return fuser::InitFlags::empty();
        }
        if !offered.contains(fuser::InitFlags::FUSE_OVER_IO_URING) {
            log::warn!("the kernel did not offer FUSE over io_uring at INIT: requests come over /dev/fuse");
            return fuser::InitFlags::empty();
        }
        self.grant();
        fuser::InitFlags::FUSE_OVER_IO_URING
    }

    pub fn ask_for_ring(&self) -> bool {
        self.ask_for_ring
    }

    /// INIT was answered with `FUSE_OVER_IO_URING` (it is in `flags2`).
    pub fn grant(&self) {
        self.granted.store(true, Relaxed);
    }

    pub fn granted(&self) -> bool {
        self.granted.load(Relaxed)
    }
}

/// The rings of a session whose INIT granted FUSE over io_uring; None when they were not asked
/// for or (transport=auto) not granted. An error when transport=uring was not granted or the
/// rings cannot be made. Called right after INIT: with the ring granted, the kernel holds every
/// request until each possible CPU's queue has an entry registered, so the rings must exist
/// before anything waits on the mount, or the ring be turned off (auto), or the mount go
/// (uring, the caller unmounts).
pub fn rings_after_init<FS: fuser::Filesystem>(
    session: &fuser::Session<FS>,
    negotiation: &Negotiation,
    choice: TransportChoice,
    max_write_bytes: u32,
) -> Result<Option<uring::RingTransport>, String> {
    if !negotiation.granted() {
        if choice == TransportChoice::Uring {
            return Err("transport=uring: the kernel did not grant FUSE over io_uring at INIT".into());
        }
        return Ok(None);
    }
    let dev_fuse = std::os::fd::AsFd::as_fd(session);
    let rings = dev_fuse
        .try_clone_to_owned()
        .and_then(|fd| uring::RingTransport::new(fd, uring::payload_bytes(max_write_bytes)));
    match rings {
        Ok(rings) => Ok(Some(rings)),
        Err(e) if choice == TransportChoice::Auto => {
            // Turned off for the connection, the held requests go to /dev/fuse.
            log::warn!("cannot set up FUSE over io_uring ({e}): transport=auto falls back to /dev/fuse");
            if uring::fall_back_to_dev_fuse(std::os::fd::AsRawFd::as_raw_fd(&dev_fuse)) {
                Ok(None)
            } else {
                Err(format!("cannot set up FUSE over io_uring ({e}), nor turn it off"))
            }
        }
        Err(e) => Err(format!("cannot set up FUSE over io_uring: {e}")),
    }
}
