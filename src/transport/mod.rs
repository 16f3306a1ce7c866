//! How FUSE requests reach the daemon: read(2) from /dev/fuse (fuser's own loops), or FUSE over
//! io_uring (`uring`: a queue per possible CPU, each answered in place in its ring entry).
//!
//! Owns: choosing the transport (`-o transport=`), the INIT negotiation state it needs, and the
//! rings. Must not: interpret requests; fuser parses and dispatches them to `fuse::FuseAdapter`
//! whichever transport brought them.

pub mod uring;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

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
