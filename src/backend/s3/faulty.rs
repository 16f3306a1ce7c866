//! An object store that fails on purpose, around any other: for the S3 backend's failure
//! paths in-process (a put that fails must give EIO and lose nothing acknowledged). A test
//! says which calls fail (by kind and a piece of the key) and heals it later, and may count the
//! GETs it passes on of keys with a given piece (how many requests a read made).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::objects::{Listed, ObjectError, ObjectResult, ObjectStore, PutCondition, PutOutcome};

/// Which calls fail: those of a kind whose key contains the given piece ("" for every key).
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    pub puts: Option<String>,
    pub gets: Option<String>,
    pub deletes: Option<String>,
    pub lists: bool,
}

pub struct FaultyObjects {
    inner: Arc<dyn ObjectStore>,
    plan: Mutex<FaultPlan>,
    failed: AtomicU64,
    /// The piece of a key whose GETs are counted, and how many passed on.
    counted_piece: Mutex<Option<String>>,
    counted_gets: AtomicU64,
}

impl FaultyObjects {
    pub fn new(inner: Arc<dyn ObjectStore>) -> FaultyObjects {
        FaultyObjects {
            inner,
            plan: Mutex::new(FaultPlan::default()),
            failed: AtomicU64::new(0),
            counted_piece: Mutex::new(None),
            counted_gets: AtomicU64::new(0),
        }
    }

    pub fn set(&self, plan: FaultPlan) {
        *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = plan;
    }

    /// Every call succeeds again (as the wrapped store answers).
    pub fn heal(&self) {
        self.set(FaultPlan::default());
    }

    /// How many calls failed on purpose so far.
    pub fn failed(&self) -> u64 {
        self.failed.load(Relaxed)
    }

    /// Counts from now on (from zero) the GETs passed on of keys containing `piece`.
    pub fn count_gets_of(&self, piece: &str) {
        *self.counted_piece.lock().unwrap_or_else(|p| p.into_inner()) = Some(piece.to_owned());
        self.counted_gets.store(0, Relaxed);
    }

    /// How many GETs `count_gets_of` counted.
    pub fn counted_gets(&self) -> u64 {
        self.counted_gets.load(Relaxed)
    }

    fn check(&self, kind: &str, key: &str, pick: impl Fn(&FaultPlan) -> bool) -> ObjectResult<()> {
        if pick(&self.plan.lock().unwrap_or_else(|p| p.into_inner())) {
            self.failed.fetch_add(1, Relaxed);
            return Err(ObjectError::Status {
                what: format!("{kind} {key}"),
                status: 503,
                body: "injected failure".into(),
            });
        }
        Ok(())
    }
}

fn matches(piece: &Option<String>, key: &str) -> bool {
    piece.as_deref().is_some_and(|p| key.contains(p))
}

impl ObjectStore for FaultyObjects {
    fn put(&self, key: &str, body: &[u8], condition: PutCondition) -> ObjectResult<PutOutcome> {
        self.check("PUT", key, |p| matches(&p.puts, key))?;
        self.inner.put(key, body, condition)
    }

    fn get(&self, key: &str, range: Option<Range<u64>>) -> ObjectResult<Option<Vec<u8>>> {
        self.check("GET", key, |p| matches(&p.gets, key))?;
        if matches(&self.counted_piece.lock().unwrap_or_else(|p| p.into_inner()), key) {
            self.counted_gets.fetch_add(1, Relaxed);
        }
        self.inner.get(key, range)
    }

    fn head(&self, key: &str) -> ObjectResult<Option<u64>> {
        self.check("HEAD", key, |p| matches(&p.gets, key))?;
        self.inner.head(key)
    }

    fn delete(&self, key: &str) -> ObjectResult<()> {
        self.check("DELETE", key, |p| matches(&p.deletes, key))?;
        self.inner.delete(key)
    }

    fn list(&self, prefix: &str) -> ObjectResult<Vec<Listed>> {
        self.check("LIST", prefix, |p| p.lists)?;
        self.inner.list(prefix)
    }

    /// A copy is a put of `target` (it fails where puts of it are set to).
    fn copy(&self, source: &str, target: &str) -> ObjectResult<bool> {
        self.check("COPY", target, |p| matches(&p.puts, target))?;
        self.inner.copy(source, target)
    }
}
