//! The object store as the S3 backend needs it: whole objects put, read (a range of one),
//! listed and deleted, and one conditional put. Two implementations: `client::S3Client` (a real
//! S3 endpoint: Ceph RGW, SeaweedFS) and `MemoryObjects` (in-process engine tests beside the
//! real-server ones, never instead of them).
//!
//! Must not: decide what an object means (the backend's layout does), retry forever (every
//! call ends within the client's `io_timeout`, with an error), or log credentials.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use crate::sys::Errno;

/// Why an object call failed, for the log; the engine sees `Errno` (`to_errno`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectError {
    /// No answer within the client's `io_timeout` (retries included).
    Timeout { what: String },
    /// The server answered an error status that retries did not clear.
    Status { what: String, status: u16, body: String },
    /// The connection failed (refused, reset, DNS) on every try.
    Network { what: String, why: String },
}

impl ObjectError {
    pub fn to_errno(&self) -> Errno {
        match self {
            ObjectError::Timeout { .. } => Errno(libc::ETIMEDOUT),
            ObjectError::Status { status: 403, .. } => Errno(libc::EACCES),
            ObjectError::Status { .. } | ObjectError::Network { .. } => Errno(libc::EIO),
        }
    }
}

impl std::fmt::Display for ObjectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectError::Timeout { what } => write!(f, "{what}: no answer in time"),
            ObjectError::Status { what, status, body } => write!(f, "{what}: HTTP {status}: {body}"),
            ObjectError::Network { what, why } => write!(f, "{what}: {why}"),
        }
    }
}

pub type ObjectResult<T> = Result<T, ObjectError>;

/// Whether a put may replace an object already at its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutCondition {
    Always,
    /// `If-None-Match: *`: only where no object is at the key. Checkpoint manifests and the
    /// writer's lease are put so: of two writers, one wins.
    IfAbsent,
}

/// What a conditional put found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Written,
    /// `PutCondition::IfAbsent` and an object was there (HTTP 412): nothing written.
    AlreadyThere,
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub size: u64,
}

/// Keys are whole keys in the bucket (the backend adds its prefix).
pub trait ObjectStore: Send + Sync {
    fn put(&self, key: &str, body: &[u8], condition: PutCondition) -> ObjectResult<PutOutcome>;
    /// The object's bytes, or those of `range` of it (clipped at its end); None where no object
    /// is at the key.
    fn get(&self, key: &str, range: Option<Range<u64>>) -> ObjectResult<Option<Vec<u8>>>;
    /// The object's size, None where there is none.
    fn head(&self, key: &str) -> ObjectResult<Option<u64>>;
    /// Deletes the object; none at the key is not an error.
    fn delete(&self, key: &str) -> ObjectResult<()>;
    /// Every object whose key starts with `prefix`, in key order (all pages).
    fn list(&self, prefix: &str) -> ObjectResult<Vec<Listed>>;
    /// Copies the object at `source` to `target` (replacing what is there); false where no
    /// object is at `source`. Here through the caller, a get and a put; a server copies inside
    /// itself (`S3Client`: CopyObject).
    fn copy(&self, source: &str, target: &str) -> ObjectResult<bool> {
        match self.get(source, None)? {
            Some(body) => self.put(target, &body, PutCondition::Always).map(|_| true),
            None => Ok(false),
        }
    }
}

/// Why `probe_conditional_put` refused the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeError {
    Object(ObjectError),
    /// The second `If-None-Match: *` put of the probe was accepted: the server ignores the
    /// condition (Garage 2.5 overwrites silently), so two writers could both win.
    ConditionIgnored {
        key: String,
    },
}

impl std::fmt::Display for ProbeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProbeError::Object(e) => write!(f, "{e}"),
            ProbeError::ConditionIgnored { key } => write!(
                f,
                "the server overwrote an object on a put with If-None-Match: * (a second conditional put of {key}): \
                 it ignores conditional puts, and the lease and the checkpoint manifests could not stop a second \
                 writer, so this server is refused"
            ),
        }
    }
}

impl From<ObjectError> for ProbeError {
    fn from(e: ObjectError) -> ProbeError {
        ProbeError::Object(e)
    }
}

/// Refuses a server that ignores `If-None-Match: *`: puts `key` twice with
/// `PutCondition::IfAbsent` and requires the second to find it there (HTTP 412). The probe
/// object is deleted after, whatever the outcome.
pub fn probe_conditional_put(objects: &dyn ObjectStore, key: &str) -> Result<(), ProbeError> {
    // A probe left by an earlier mount that died between put and delete.
    objects.delete(key)?;
    let first = objects.put(key, b"coalescefs conditional put probe 1", PutCondition::IfAbsent);
    let second =
        first.clone().and_then(|_| objects.put(key, b"coalescefs conditional put probe 2", PutCondition::IfAbsent));
    let deleted = objects.delete(key);
    match (first?, second?) {
        (PutOutcome::Written, PutOutcome::AlreadyThere) => {}
        (PutOutcome::AlreadyThere, _) => {
            // Deleted just before: another prober runs at the same key. Not a verdict.
            return Err(ProbeError::Object(ObjectError::Status {
                what: format!("probe {key}"),
                status: 412,
                body: "another writer holds the probe key".into(),
            }));
        }
        (PutOutcome::Written, PutOutcome::Written) => return Err(ProbeError::ConditionIgnored { key: key.to_owned() }),
    }
    deleted?;
    Ok(())
}

/// Objects in memory, for in-process tests.
#[derive(Default)]
pub struct MemoryObjects {
    objects: Mutex<BTreeMap<String, Vec<u8>>>,
}

impl MemoryObjects {
    fn objects(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ObjectStore for MemoryObjects {
    fn put(&self, key: &str, body: &[u8], condition: PutCondition) -> ObjectResult<PutOutcome> {
        let mut objects = self.objects();
        if condition == PutCondition::IfAbsent && objects.contains_key(key) {
            return Ok(PutOutcome::AlreadyThere);
        }
        objects.insert(key.to_owned(), body.to_vec());
        Ok(PutOutcome::Written)
    }

    fn get(&self, key: &str, range: Option<Range<u64>>) -> ObjectResult<Option<Vec<u8>>> {
        Ok(self.objects().get(key).map(|body| match range {
            None => body.clone(),
            Some(range) => {
                let end = (range.end as usize).min(body.len());
                body[(range.start as usize).min(end)..end].to_vec()
            }
        }))
    }

    fn head(&self, key: &str) -> ObjectResult<Option<u64>> {
        Ok(self.objects().get(key).map(|body| body.len() as u64))
    }

    fn delete(&self, key: &str) -> ObjectResult<()> {
        self.objects().remove(key);
        Ok(())
    }

    fn list(&self, prefix: &str) -> ObjectResult<Vec<Listed>> {
        Ok(self
            .objects()
            .range(prefix.to_owned()..)
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, body)| Listed { key: key.clone(), size: body.len() as u64 })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_objects_keep_the_conditional_put_and_clip_ranges() {
        let store = MemoryObjects::default();
        assert_eq!(store.put("p/a", b"hello", PutCondition::IfAbsent).unwrap(), PutOutcome::Written);
        assert_eq!(store.put("p/a", b"other", PutCondition::IfAbsent).unwrap(), PutOutcome::AlreadyThere);
        assert_eq!(store.get("p/a", Some(1..99)).unwrap().unwrap(), b"ello");
        store.put("p/b", b"", PutCondition::Always).unwrap();
        store.put("q/c", b"x", PutCondition::Always).unwrap();
        let keys: Vec<_> = store.list("p/").unwrap().into_iter().map(|l| l.key).collect();
        assert_eq!(keys, ["p/a", "p/b"]);
        store.delete("p/a").unwrap();
        store.delete("p/a").unwrap();
        assert_eq!(store.head("p/a").unwrap(), None);
    }
}
