//! Post-mortem of a crash-harness failure: prints every record an intent log file would
//! replay, batch by batch, as replay's debug log names them (keys in hex, data as offset and
//! length). A mount logs the same lines at replay with `RUST_LOG=coalescefs=debug`; this reads
//! a kept log without mounting anything.
//! Work on a copy: opening a log may write to it, as a mount's opening would.
//!
//! usage: cargo run --release --example logdump -- COPY_OF_INTENT_LOG [--runs]
//!   --runs: each data record's runs of zero bytes (16 or more) too, as offsets in the file
use std::path::Path;
use std::sync::Arc;

use coalescefs::engine::intent_log::format::Record;
use coalescefs::engine::intent_log::{self, raw::RawLog, IntentLog};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const USAGE: &str = "usage: logdump COPY_OF_INTENT_LOG [--runs]";
    let (flags, paths): (Vec<String>, Vec<String>) = std::env::args().skip(1).partition(|a| a.starts_with("--"));
    if let Some(unknown) = flags.iter().find(|f| *f != "--runs") {
        return Err(format!("unknown option {unknown}; {USAGE}").into());
    }
    let [path] = paths.as_slice() else { return Err(USAGE.into()) };
    let zero_runs = !flags.is_empty();
    // A block device's replay map would go to the state directory; a file's is beside it.
    let (device, _) = intent_log::open_file_device(Path::new(&path), None, Path::new("/nonexistent"), RawLog::Off)
        .map_err(|e| e.to_string())?;
    let (_, batches) =
        IntentLog::open(Box::new(device), false, Arc::new(Default::default())).map_err(|e| e.to_string())?;
    for batch in batches {
        println!("batch {}", batch.seq);
        for record in &batch.records {
            println!("  {}", record.describe());
            if let (true, Record::Data { offset, bytes, .. }) = (zero_runs, record) {
                for (start, end) in runs_of_zeros(bytes) {
                    println!("    zeros {}..{}", offset + start as u64, offset + end as u64);
                }
            }
        }
    }
    Ok(())
}

/// Runs of 16 or more zero bytes (start, end) in `bytes`.
fn runs_of_zeros(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, &b) in bytes.iter().chain(std::iter::once(&1)).enumerate() {
        match (b, start) {
            (0, None) => start = Some(i),
            (0, Some(_)) => {}
            (_, Some(s)) => {
                if i - s >= 16 {
                    runs.push((s, i));
                }
                start = None;
            }
            _ => {}
        }
    }
    runs
}
