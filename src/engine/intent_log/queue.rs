//! The queue of records waiting for the next batch (name changes made on the backend, and
//! Creates an unlink may still take back), with the indexes that keep an unlink's take-back
//! cheap.

use std::collections::HashMap;

use super::format::Record;

/// Records waiting for the next batch, in order, with an index of the queued Creates and of
/// how many queued records refer to each object: an unlink of a file whose creation no batch
/// carried takes its Create back without a scan of the queue (rm -rf of a fresh tree unlinks
/// thousands of files while thousands of records wait).
#[derive(Default)]
pub(super) struct Queue {
    /// Taken-back records leave a hole (None) until the queue is taken.
    records: Vec<Option<Record>>,
    creates: HashMap<Vec<u8>, usize>,
    mentions: HashMap<Vec<u8>, u32>,
    live: usize,
    /// The Unlinks taken back with their Creates, by the name they freed (its directory's key,
    /// the name), each with its place in the order of take-backs; kept over batches until a
    /// checkpoint has synced the backend. The backend may still hold such a file after a
    /// crash (its creation committed, its unlink not), and a record that puts another object
    /// at the name brings the Unlink back in front of it: else replay takes the old file for a
    /// new one the log holds that a checkpoint made there (`replay::Replay::adopt`), and keeps
    /// its bytes past the new one's.
    pub(super) taken_back_unlinks: HashMap<(Vec<u8>, Vec<u8>), (u64, Record)>,
    pub(super) take_backs: u64,
}

/// Unlinks taken back and kept (`Queue::taken_back_unlinks`) at most: past it, unlinks of files
/// no batch carried are logged as any (rm -rf of a fresh tree costs log bytes, not memory).
const TAKEN_BACK_UNLINKS_MAX: usize = 65536;

impl Queue {
    pub(super) fn extend(&mut self, records: impl IntoIterator<Item = Record>) {
        for record in records {
            if let Some(at) = record.name_taken() {
                if let Some((_, unlink)) = self.taken_back_unlinks.remove(&(at.0.to_vec(), at.1.to_vec())) {
                    self.push(unlink);
                }
            }
            self.push(record);
        }
    }

    pub(super) fn push(&mut self, record: Record) {
        let mut objects = record.objects();
        objects.sort_unstable();
        objects.dedup();
        for key in objects {
            *self.mentions.entry(key.to_vec()).or_default() += 1;
        }
        if let Record::Create { file, .. } = &record {
            self.creates.entry(file.clone()).or_insert(self.records.len());
        }
        self.records.push(Some(record));
        self.live += 1;
    }

    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Slots so far, taken-back records' holes included: where the next record goes (the
    /// volatile tail's mark of what it holds).
    pub(super) fn slots(&self) -> usize {
        self.records.len()
    }

    /// The records queued from slot `from` on, in their order.
    pub(super) fn since(&self, from: usize) -> impl Iterator<Item = &Record> {
        self.records[from..].iter().flatten()
    }

    pub(super) fn take(&mut self) -> Vec<Record> {
        let records = std::mem::take(&mut self.records).into_iter().flatten().collect();
        *self = Queue {
            taken_back_unlinks: std::mem::take(&mut self.taken_back_unlinks),
            take_backs: self.take_backs,
            ..Queue::default()
        };
        records
    }

    /// Whether a queued record other than its Create refers to `file` (a rename of it, say).
    pub(super) fn changes_names_of(&self, file: &[u8]) -> bool {
        let own_create = u32::from(self.creates.contains_key(file));
        self.mentions.get(file).is_some_and(|&count| count > own_create)
    }

    pub(super) fn forget_take_backs_before(&mut self, take_backs: u64) {
        self.taken_back_unlinks.retain(|_, (order, _)| *order >= take_backs);
    }

    /// Takes back the Create of the file `unlink` removes if nothing else queued refers to the
    /// file, and keeps `unlink` for a record that puts another object at its name.
    pub(super) fn cancel_create(&mut self, unlink: &Record) -> bool {
        let Record::Unlink { file, parent, name, .. } = unlink else { return false };
        let Some(&at) = self.creates.get(file) else { return false };
        if self.mentions.get(file) != Some(&1) || self.taken_back_unlinks.len() >= TAKEN_BACK_UNLINKS_MAX {
            return false;
        }
        let earlier = self.taken_back_unlinks.insert((parent.clone(), name.clone()), (self.take_backs, unlink.clone()));
        // The file's Create took the name, and brought back whatever was kept for it.
        debug_assert!(earlier.is_none(), "an unlink kept for a name no record took since");
        self.take_backs += 1;
        let record = self.records[at].take().expect("an indexed Create is queued");
        for key in record.objects() {
            if let Some(count) = self.mentions.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    self.mentions.remove(key);
                }
            }
        }
        self.creates.remove(file);
        self.live -= 1;
        true
    }
}
