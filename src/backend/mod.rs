//! Backends store; they never decide. The engine plans every write from what a backend says it
//! can take, so the description below must stay honest as SQLite and the S3 API arrive:
//! a local file accepts aligned partial writes in place; an object store takes only whole
//! objects; a SQLite row is rewritten whole.
//!
//! Only the local-directory backend exists today; the engine uses it directly until a second
//! backend gives a trait its real shape.

mod aio;
pub mod local;

