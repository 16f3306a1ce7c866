//! Commands on an S3 source that is not mounted. `coalescefs forget s3://BUCKET/PREFIX`: the
//! mount's state directory removed (its intent log, its namespace database, its lease id) and
//! the writer's lease it holds in the bucket released, so that another state directory, here
//! or on another machine, can mount the prefix. For a mount that will not come back (a
//! replaced disk): what its log holds that the bucket lacks is lost, so that needs
//! `--discard`. `coalescefs recover s3://...` opens the mount as a mount would
//! (`open_s3_unmounted`) for a damaged log's intact batches to be applied into it.

use super::*;

pub fn forget_s3(
    source: &Path,
    s3: &backend::source::S3Source,
    opts: &MountOptions,
    discard: bool,
) -> Result<(), String> {
    let shown = s3.path_shown();
    let (runtime, state) = existing_state(source, s3, opts)?;
    let state_path = state.path().to_path_buf();
    let log = state.log_path();
    if log.exists() {
        match state::unreplayed_in_log(&log, &state_path, &shown) {
            Some(message) if discard => eprintln!("coalescefs: discarding: {message}"),
            Some(message) => return Err(message),
            None => {}
        }
    }
    if let Ok(id) = std::fs::read_to_string(state_path.join(backend::s3::lease::LEASE_ID_FILE)) {
        let objects = s3_client(s3, opts)?;
        let layout = backend::s3::layout::Layout::new(&s3.prefix);
        match backend::s3::lease::Lease::forget(&*objects, &layout, id.trim(), &shown)? {
            None => log::info!("{shown}: no lease of this state directory's left in the bucket"),
            Some(holder) => eprintln!(
                "coalescefs: {shown}: the lease is another mount's (host {}, state directory {}), left as it is",
                holder.host, holder.state_dir
            ),
        }
    }
    backend::s3::remove_state_files(&state_path);
    state::remove_state_files(&state_path)?;
    std::fs::remove_dir(&state_path).map_err(|e| format!("removing {}: {e}", state_path.display()))?;
    drop(state);
    std::fs::remove_dir_all(runtime.path()).map_err(|e| format!("removing {}: {e}", runtime.path().display()))?;
    let shm = crate::runtime::shm_dir_of(source);
    match std::fs::remove_dir_all(&shm) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("removing {}: {e}", shm.display())),
        _ => Ok(()),
    }
}

/// The source's runtime directory (made if absent) and its state directory, which must exist;
/// the state directory holds the runtime directory's lock, as a mount's does, so that no mount
/// of the source starts here meanwhile.
fn existing_state(
    source: &Path,
    s3: &backend::source::S3Source,
    opts: &MountOptions,
) -> Result<(RuntimeDir, StateDir), String> {
    let runtime = RuntimeDir::of(source);
    let made_runtime = !runtime.path().is_dir();
    runtime.create().map_err(|e| format!("cannot create the runtime directory {}: {e}", runtime.path().display()))?;
    let found = StateDir::find_for_remote(source, runtime.path(), opts.state_dir.as_deref()).and_then(|state| {
        if state.path().is_dir() {
            Ok(state)
        } else {
            Err(format!(
                "{}: no state directory at {} (give --state DIR as mounted)",
                s3.path_shown(),
                state.path().display()
            ))
        }
    });
    match found {
        Ok(state) => Ok((runtime, state)),
        Err(e) => {
            // Made only to hold the lock (the state directory, and its lock, dropped by now).
            if made_runtime {
                let _ = std::fs::remove_dir_all(runtime.path());
            }
            Err(e)
        }
    }
}

/// An S3 source opened for `recover`: its lease taken (back), its namespace found, with the
/// state directory (locked through the source's runtime directory, as a mount locks it).
pub struct UnmountedS3 {
    pub mount: backend::s3::S3Mount,
    pub state: StateDir,
}

pub fn open_s3_unmounted(
    source: &Path,
    s3: &backend::source::S3Source,
    opts: &MountOptions,
) -> Result<UnmountedS3, String> {
    let (_runtime, mut state) = existing_state(source, s3, opts)?;
    state.lock_if_present()?;
    let mount = open_s3(s3, opts, &state, &Arc::new(metrics::Metrics::default()))?;
    Ok(UnmountedS3 { mount, state })
}
