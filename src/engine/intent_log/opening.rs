//! Opening the log: on a file (made at its size, refused at another) or a block device (one
//! holding neither a log nor zeros is somebody's data, refused), and what `coalescefs forget`
//! asks of a log without mounting.

use std::path::Path;
use std::sync::Arc;

use super::device::{self, LogDevice};
use super::format::{Superblock, MAX_LOG_BLOCK_BYTES, SUPERBLOCK_COPIES};
use super::{raw, IntentLog, LogError, LOG_FILE_NAME};
use crate::metrics::Metrics;
use crate::sys::Errno;

/// `batches_to_replay` of the log file at `path`, its state directory `state_dir` (where its
/// replay map is), opened as `coalescefs forget` opens it: through the file.
pub fn batches_to_replay_in_file(path: &std::path::Path, state_dir: &std::path::Path) -> Result<usize, LogError> {
    let (device, _) = open_file_device(path, None, state_dir, raw::RawLog::Off)?;
    batches_to_replay(Box::new(device))
}

/// How many batches the log on `device` holds that a mount would replay (after its checkpoint,
/// or a recovery's replay map left part way), for `coalescefs forget`. Changes nothing but what
/// a mount's opening would (a checkpoint past batches a power cut left unflushed).
pub fn batches_to_replay(device: Box<dyn LogDevice>) -> Result<usize, LogError> {
    let recovery_under_way = !device.read_map().map_err(|e| LogError::Io("read the replay map", e))?.is_empty();
    let (_, batches) = IntentLog::open(device, false, Arc::new(Metrics::default()))?;
    Ok(batches.len().max(usize::from(recovery_under_way)))
}

/// Opens (or creates, `size_bytes` long) the log file at `path`; returns it and whether it was
/// created. A file of another size is refused: the ring's geometry is in its superblock, and
/// `log_size=` must not change while the log holds data. `size_bytes` None: whatever size the
/// file has (`coalescefs recover`). A block device takes the log in its first `size_bytes`
/// (None: as much as the log on it says), its replay map in `state_dir`.
pub fn open_file_device(
    path: &Path,
    size_bytes: Option<u64>,
    state_dir: &Path,
    raw_log: raw::RawLog,
) -> Result<(device::FileLogDevice, bool), LogError> {
    if device::is_block_device(path) {
        return open_block_device(path, size_bytes, state_dir);
    }
    let asked = match size_bytes {
        Some(size) => size,
        None => std::fs::metadata(path).map_err(|e| LogError::Io("open", Errno::from(e)))?.len(),
    };
    let (device, created) =
        device::FileLogDevice::open_or_create(path, asked, raw_log).map_err(|e| LogError::Io("open", e))?;
    let actual = device.size_bytes().map_err(|e| LogError::Io("open", e))?;
    if actual != asked {
        return Err(LogError::Mismatch(format!(
            "{} is {actual} bytes, not the {asked} asked for (log_size= must not change while the log holds data)",
            path.display()
        )));
    }
    Ok((device, created))
}

/// A block device as the log (see `open_file_device`). One that holds neither a log nor zeros
/// is refused: it is somebody's data.
fn open_block_device(
    path: &Path,
    size_bytes: Option<u64>,
    state_dir: &Path,
) -> Result<(device::FileLogDevice, bool), LogError> {
    let shown = path.display();
    let look = 2 * MAX_LOG_BLOCK_BYTES;
    let (mut device, device_bytes, contents) =
        device::FileLogDevice::open_block_device(path, device::replay_map_path(&state_dir.join(LOG_FILE_NAME)), look)
            .map_err(|e| match e {
            Errno(libc::EBUSY) => LogError::Mismatch(format!("{shown} is in use (mounted, or held by a program)")),
            e => LogError::Io("open", e),
        })?;
    let (log_bytes, created) = match contents {
        device::BlockDeviceContents::Bytes(start) => match Superblock::find(&start) {
            Some(sb) => ((sb.area_blocks + SUPERBLOCK_COPIES) * u64::from(sb.block_bytes), false),
            None => {
                return Err(LogError::Mismatch(format!(
                    "{shown} holds data that is not a coalescefs intent log (its first {} KiB are not zeros): \
                     wipe it first (blkdiscard, or dd from /dev/zero) to use it as the log, or give another device",
                    start.len() >> 10
                )))
            }
        },
        device::BlockDeviceContents::Zeros => (size_bytes.unwrap_or(device_bytes), true),
    };
    if log_bytes > device_bytes {
        return Err(LogError::Mismatch(format!(
            "{shown} has {device_bytes} bytes, fewer than the {log_bytes} of the log (log_size=)"
        )));
    }
    if let Some(asked) = size_bytes.filter(|&asked| asked != log_bytes) {
        return Err(LogError::Mismatch(format!(
            "{shown} holds a log of {log_bytes} bytes, not the {asked} asked for (log_size= must not change while the log \
             holds data)"
        )));
    }
    device.take_device_bytes(log_bytes);
    if created {
        device.zero_device_bytes().map_err(|e| LogError::Io("zero the log's bytes", e))?;
    }
    Ok((device, created))
}
