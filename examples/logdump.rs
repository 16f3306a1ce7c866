//! Post-mortem of a crash-harness failure: prints every record an intent log file would
//! replay, batch by batch, as replay's debug log names them (keys in hex, data as offset and
//! length). A mount logs the same lines at replay with `RUST_LOG=coalescefs=debug`; this reads
//! a kept log without mounting anything.
//! Work on a copy: opening a log may write to it, as a mount's opening would.
//!
//! usage: cargo run --release --example logdump -- COPY_OF_INTENT_LOG
use std::path::Path;
use std::sync::Arc;

use coalescefs::engine::intent_log::{self, raw::RawLog, IntentLog};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: logdump COPY_OF_INTENT_LOG")?;
    // A block device's replay map would go to the state directory; a file's is beside it.
    let (device, _) = intent_log::open_file_device(Path::new(&path), None, Path::new("/nonexistent"), RawLog::Off)
        .map_err(|e| e.to_string())?;
    let (_, batches) =
        IntentLog::open(Box::new(device), false, Arc::new(Default::default())).map_err(|e| e.to_string())?;
    for batch in batches {
        println!("batch {}", batch.seq);
        for record in &batch.records {
            println!("  {}", record.describe());
        }
    }
    Ok(())
}
