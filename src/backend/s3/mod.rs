//! The S3 backend (issue 44), landing in steps: first the object store interface
//! (`objects`), the client over it, then the unit store of immutable unit objects over the
//! SQLite namespace.

pub mod client;
pub mod objects;
