//! Values written as text, in mount options and in fault-injection rules: durations.
//!
//! A leaf: it imports nothing of the crate, so the engine and the backends may use it without
//! depending on the command line (`options.rs`) above them.

/// `5s`, `500ms`, or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let (number, scale_ms) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1000)
    } else {
        (text, 1000)
    };
    let n: u64 = number.parse().map_err(|_| format!("'{text}' is not a duration (examples: 5s, 500ms)"))?;
    Ok(std::time::Duration::from_millis(n * scale_ms))
}
