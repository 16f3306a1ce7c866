//! The writer's lease: one writing mount per prefix. At mount, `PREFIX/lease` is put
//! `IfAbsent` naming this mount (host, state directory, pid, and a random id kept in the state
//! directory); a lease held by another id refuses the mount, one held by this state
//! directory's own id (a mount killed before its unmount) is taken back; a clean unmount
//! deletes it. Must not: take a lease another mount holds (nothing here guesses that a holder
//! is gone; the person mounting decides, and the message says how).
//!
//! Before the lease, a probe checks that the server keeps conditional puts (Garage answers
//! `If-None-Match: *` by overwriting, docs/ceph-and-s3.md): without them neither the lease nor
//! the manifests stop a second writer.

use std::path::Path;
use std::sync::Arc;

use super::layout::{Layout, LeaseHolder};
use super::objects::{ObjectStore, PutCondition, PutOutcome};

/// The state directory's file with this mount's lease id.
pub const LEASE_ID_FILE: &str = "s3-lease-id";

pub struct Lease {
    objects: Arc<dyn ObjectStore>,
    key: String,
    holder: LeaseHolder,
    /// Whom the error messages name: `s3://BUCKET/PREFIX`.
    source: String,
}

/// This state directory's lease id, made (random, 128 bits) the first time.
fn lease_id(state_dir: &Path) -> Result<String, String> {
    let path = state_dir.join(LEASE_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("reading {}: {e}", path.display())),
    }
    let mut bytes = [0u8; 16];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into `bytes`, a live local array.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        return Err(format!("no random bytes for a lease id: {}", crate::sys::Errno::last()));
    }
    let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = state_dir.join(format!("{LEASE_ID_FILE}.tmp"));
    let written = (|| -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(format!("{id}\n").as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(state_dir)?.sync_all()
    })();
    written.map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(id)
}

fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`, a live local array.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

impl Lease {
    /// Takes the lease of `layout`'s prefix for the mount whose state directory is `state_dir`.
    pub fn take(
        objects: Arc<dyn ObjectStore>,
        layout: &Layout,
        state_dir: &Path,
        source: &str,
    ) -> Result<Lease, String> {
        let id = lease_id(state_dir)?;
        let probe = format!("{}.probe-{id}", layout.lease_key());
        super::objects::probe_conditional_put(&*objects, &probe)
            .map_err(|e| format!("{source}: probing conditional puts: {e}"))?;
        let holder = LeaseHolder {
            id,
            host: host_name(),
            state_dir: state_dir.display().to_string(),
            pid: std::process::id(),
            since: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        };
        let key = layout.lease_key();
        let fail = |e: super::objects::ObjectError| format!("{source}: taking the lease {key}: {e}");
        if objects.put(&key, &holder.encode(), PutCondition::IfAbsent).map_err(fail)? == PutOutcome::AlreadyThere {
            let there = objects.get(&key, None).map_err(fail)?;
            match there.as_deref().and_then(LeaseHolder::decode) {
                Some(other) if other.id == holder.id => {
                    log::warn!(
                        "{source}: taking back this state directory's own lease (pid {} on {} did not unmount cleanly)",
                        other.pid,
                        other.host
                    );
                    objects.put(&key, &holder.encode(), PutCondition::Always).map_err(fail)?;
                }
                Some(other) => {
                    return Err(format!(
                        "{source} is mounted for writing by another coalescefs: host {}, state directory {}, pid {}, \
                         since {} (seconds since 1970); one writing mount per prefix. If that mount is gone for good \
                         (its machine lost), delete the object {key} and mount again: what it wrote after its last \
                         checkpoint is lost with it",
                        other.host, other.state_dir, other.pid, other.since
                    ))
                }
                None if there.is_none() => {
                    return Err(format!("{source}: the lease {key} went away while this mount took it: mount again"))
                }
                None => return Err(format!("{source}: {key} is there but is not a coalescefs lease: refused")),
            }
        }
        Ok(Lease { objects, key, holder, source: source.to_owned() })
    }

    /// `coalescefs forget`: deletes the lease of `layout`'s prefix if the state directory whose
    /// lease id is `id` holds it (a mount of it killed, its state about to go). Returns who
    /// holds it otherwise (None: nobody), left as it is.
    pub fn forget(
        objects: &dyn ObjectStore,
        layout: &Layout,
        id: &str,
        source: &str,
    ) -> Result<Option<LeaseHolder>, String> {
        let key = layout.lease_key();
        let fail = |e: super::objects::ObjectError| format!("{source}: the lease {key}: {e}");
        let Some(there) = objects.get(&key, None).map_err(fail)? else { return Ok(None) };
        match LeaseHolder::decode(&there) {
            Some(holder) if holder.id == id => {
                objects.delete(&key).map_err(fail)?;
                Ok(None)
            }
            Some(holder) => Ok(Some(holder)),
            None => Err(format!("{source}: {key} is there but is not a coalescefs lease: left as it is")),
        }
    }

    /// The id manifests name their writer by.
    pub fn id(&self) -> &str {
        &self.holder.id
    }

    /// Deletes the lease, if it is still this mount's (a clean unmount).
    pub fn release(&self) -> Result<(), String> {
        let fail = |e: super::objects::ObjectError| format!("{}: releasing the lease {}: {e}", self.source, self.key);
        let there = self.objects.get(&self.key, None).map_err(fail)?;
        match there.as_deref().and_then(LeaseHolder::decode) {
            Some(holder) if holder.id == self.holder.id => self.objects.delete(&self.key).map_err(fail),
            _ => Err(format!("{}: the lease {} is no longer this mount's: left as it is", self.source, self.key)),
        }
    }
}
