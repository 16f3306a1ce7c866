//! Post-mortem of a crash-harness failure: prints every record an intent log file would
//! replay, batch by batch (object keys in hex, data as offset and length).
//! Work on a copy: opening a log may write to it, as a mount's opening would.
//!
//! usage: cargo run --release --example logdump -- COPY_OF_INTENT_LOG
use std::path::Path;
use std::sync::Arc;

use coalescefs::engine::intent_log::{self, format::Record, raw::RawLog, IntentLog};

fn hex(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

fn name(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}

fn describe(record: &Record) -> String {
    match record {
        Record::Data { file, offset, bytes } => format!("Data {} at {offset}, {} bytes", hex(file), bytes.len()),
        Record::Size { file, size } => format!("Size {} = {size}", hex(file)),
        Record::Barrier { file } => format!("Barrier {}", hex(file)),
        Record::Create { file, parent, name: n, mode, .. } => {
            format!("Create {} as {} in {} (mode {mode:o})", hex(file), name(n), hex(parent))
        }
        Record::Unlink { file, parent, name: n, .. } => {
            format!("Unlink {} at {} in {}", hex(file), name(n), hex(parent))
        }
        Record::Hidden { file, parent, name: n } => format!("Hidden {} at {} in {}", hex(file), name(n), hex(parent)),
        Record::Attrs { file, mode, .. } => format!("Attrs {} (mode {mode:o})", hex(file)),
        Record::Rename { file, from_name, to_name, replaced, .. } => format!(
            "Rename {} {} -> {} replacing {}",
            hex(file),
            name(from_name),
            name(to_name),
            if replaced.is_empty() { "nothing".to_string() } else { hex(replaced) }
        ),
    }
}

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
            println!("  {}", describe(record));
        }
    }
    Ok(())
}
