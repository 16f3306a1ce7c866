//! coalescefs: a FUSE file system that shapes application writes into whole, aligned units.
//!
//! The layers, each in its own module: `fuse` (the adapter: kernel requests to engine calls),
//! `engine` (every decision: the write buffer, flushers, the intent log, durability, replay),
//! `backend` (storage: the namespace and unit store traits and their implementations). Around
//! them: `daemon` (a mount's life), `control` (the stats socket and Prometheus endpoint),
//! `metrics`, `mounts`, `options`, `runtime` (the runtime directory), `state` (the state directory), `logging`, `sys`,
//! `transport` (/dev/fuse or FUSE over io_uring, under fuser).
//! The binary (`main.rs`) is the command line.

pub mod backend;
pub mod control;
pub mod daemon;
pub mod descriptors;
pub mod engine;
pub mod fuse;
pub mod logging;
pub mod metrics;
pub mod mounts;
pub mod options;
pub mod orphans;
pub mod parse;
pub mod runtime;
pub mod state;
pub mod sys;
pub mod transport;
