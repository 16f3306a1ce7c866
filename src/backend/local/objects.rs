//! The local namespace's ids: which `ObjectId` stands for which backing object, and how many
//! lookups keep it known.
//!
//! Ids are the backing file system's inode numbers where that is unambiguous (same device as
//! the backing root), so `stat` and `readdir` agree, hard links share a number, and numbers
//! stay the same across remounts. Objects on other devices (a mount inside the backing
//! directory) get ids from a synthetic range, and so does a new object whose inode number is
//! still held by a deleted one the kernel has not forgotten (nodes do not pin their inodes, see
//! `nodes`). The root is always `ROOT_ID`.
//!
//! An id the engine chose (a new file it served from its own memory, then made here under that
//! id, `remember_as`) outlives the kernel forgetting the object: the object's handle and id are
//! kept aside (`Table::chosen`), and its next lookup takes that id again, so its inode number
//! does not change while the mount lasts (git's index and hard-link detection compare them,
//! and the engine's notes of unsynced changes are keyed by id).

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use super::nodes::Node;
use crate::engine::types::{ObjectId, ROOT_ID};

/// Synthetic ids start here; backing file systems do not hand out inode numbers this high.
const SYNTHETIC_ID_BASE: u64 = 1 << 63;

/// Forgotten chosen ids kept aside at most (about 80 MiB of them): beyond, one goes for each
/// new one, and that file comes back under its inode number at its next lookup (the engine's
/// durability notes do not depend on it: `Writeback::forget`).
const CHOSEN_IDS_KEPT: usize = 1 << 20;

/// Identity of a backing object: (st_dev, st_ino).
pub type BackingKey = (u64, u64);

pub struct Object {
    pub id: ObjectId,
    pub key: BackingKey,
    pub node: Node,
    /// The object has no `security.capability` attribute: made by this mount, or a read of it
    /// found none, and none set since (only this mount changes the backing directory, and a
    /// write, truncate or chown only ever removes one). The kernel asks for it before the first
    /// write to a file and before every chown (two of tar's ~11 requests per file), and the
    /// local directory answers through a /proc path walk.
    pub capability_absent: AtomicBool,
    /// The engine chose the id (`remember_as`): kept aside when the object is forgotten.
    chosen_id: bool,
    /// Its persistent handle, once asked (`Namespace::log_key`): with the log on, every
    /// unlink, rename and creation names its directory by it, and a handle never changes.
    pub log_key: std::sync::OnceLock<Vec<u8>>,
}

impl Object {
    fn new(id: ObjectId, key: BackingKey, node: Node) -> Object {
        Object {
            id,
            key,
            node,
            capability_absent: AtomicBool::new(false),
            chosen_id: false,
            log_key: std::sync::OnceLock::new(),
        }
    }
}

/// A forgotten object whose id the engine chose: the id, and the handle that tells the object
/// from a later one given the same inode number.
struct ChosenId {
    id: ObjectId,
    handle: Box<[u8]>,
}

struct Slot {
    object: Arc<Object>,
    lookups: u64,
}

struct Table {
    by_id: HashMap<ObjectId, Slot>,
    by_key: HashMap<BackingKey, ObjectId>,
    /// Forgotten objects whose ids the engine chose, by key (see the module's notes): one entry
    /// per such file not in the kernel's cache, until it is looked up again or its inode number
    /// goes to another object.
    chosen: HashMap<BackingKey, ChosenId>,
    next_synthetic: u64,
}

pub struct ObjectTable {
    root_key: BackingKey,
    table: Mutex<Table>,
}

impl ObjectTable {
    pub fn new(root: Node, root_key: BackingKey) -> ObjectTable {
        let root = Arc::new(Object::new(ROOT_ID, root_key, root));
        let mut by_id = HashMap::new();
        // The root is never forgotten: one lookup that no forget will ever balance.
        by_id.insert(ROOT_ID, Slot { object: root, lookups: 1 });
        let mut by_key = HashMap::new();
        by_key.insert(root_key, ROOT_ID);
        let table = Table { by_id, by_key, chosen: HashMap::new(), next_synthetic: SYNTHETIC_ID_BASE };
        ObjectTable { root_key, table: Mutex::new(table) }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap()
    }

    pub fn get(&self, id: ObjectId) -> Option<Arc<Object>> {
        self.table().by_id.get(&id).map(|slot| slot.object.clone())
    }

    /// The id this key has or would have: what readdir reports for an entry that was never
    /// looked up. Ids of other-device objects are only known once looked up.
    pub fn id_for_listing(&self, key: BackingKey) -> ObjectId {
        let table = self.table();
        if let Some(&id) = table.by_key.get(&key) {
            return id;
        }
        if let Some(chosen) = table.chosen.get(&key) {
            return chosen.id;
        }
        drop(table);
        self.natural_id(key).unwrap_or(key.1)
    }

    fn natural_id(&self, key: BackingKey) -> Option<ObjectId> {
        if key == self.root_key {
            return Some(ROOT_ID);
        }
        (key.0 == self.root_key.0 && key.1 != ROOT_ID && key.1 < SYNTHETIC_ID_BASE).then_some(key.1)
    }

    /// Records one lookup of the object `node` refers to. If the object is already in the
    /// table, the new node is dropped and the existing object returned.
    ///
    /// The backing inode number alone does not name an object: a file deleted while the kernel
    /// still holds its inode frees its number, and the next file created may get it. That new
    /// object gets a synthetic id, and the key then leads to it; the old one keeps its id until
    /// forgotten.
    pub fn remember(&self, node: Node, key: BackingKey) -> Arc<Object> {
        let mut table = self.table();
        let mut number_taken = false;
        if let Some(&id) = table.by_key.get(&key) {
            let slot = table.by_id.get_mut(&id).expect("by_key and by_id agree");
            if slot.object.node.is_same_object(&node) {
                slot.lookups += 1;
                let known = slot.object.clone();
                drop(table);
                // Closing the new node's descriptor happens outside the lock.
                drop(node);
                return known;
            }
            number_taken = true;
        }
        let chosen = table.chosen.remove(&key).filter(|chosen| {
            !number_taken && node.handle() == Some(&chosen.handle[..]) && !table.by_id.contains_key(&chosen.id)
        });
        let id = match (chosen.as_ref(), self.natural_id(key)) {
            (Some(chosen), _) => chosen.id,
            (None, Some(id)) if !number_taken && !table.by_id.contains_key(&id) => id,
            _ => {
                table.next_synthetic += 1;
                table.next_synthetic
            }
        };
        let mut object = Object::new(id, key, node);
        object.chosen_id = chosen.is_some();
        let object = Arc::new(object);
        table.by_id.insert(id, Slot { object: object.clone(), lookups: 1 });
        table.by_key.insert(key, id);
        object
    }

    /// Records one lookup of a just-made object under an id the engine chose (a file it had
    /// served from its own memory until now, under that id, see `Namespace::make_with_id`).
    pub fn remember_as(&self, node: Node, key: BackingKey, id: ObjectId) -> Arc<Object> {
        let mut table = self.table();
        assert!(!table.by_id.contains_key(&id), "id {id} given out twice");
        table.chosen.remove(&key);
        let mut object = Object::new(id, key, node);
        object.chosen_id = true;
        let object = Arc::new(object);
        table.by_id.insert(id, Slot { object: object.clone(), lookups: 1 });
        table.by_key.insert(key, id);
        object
    }

    /// One more lookup of a known object (the engine holding it while it has state for it).
    pub fn hold(&self, id: ObjectId) -> bool {
        match self.table().by_id.get_mut(&id) {
            Some(slot) => {
                slot.lookups += 1;
                true
            }
            None => false,
        }
    }

    /// `count` lookups of `id` dropped; at zero the object (and its node) is let go.
    pub fn forget(&self, id: ObjectId, count: u64) {
        if id == ROOT_ID {
            return;
        }
        let mut table = self.table();
        let Some(slot) = table.by_id.get_mut(&id) else { return };
        slot.lookups = slot.lookups.saturating_sub(count);
        if slot.lookups == 0 {
            let slot = table.by_id.remove(&id).expect("present above");
            // The key may lead to a newer object by now (see `remember`).
            if table.by_key.get(&slot.object.key) == Some(&id) {
                table.by_key.remove(&slot.object.key);
                if let Some(handle) = slot.object.node.handle().filter(|_| slot.object.chosen_id) {
                    if table.chosen.len() >= CHOSEN_IDS_KEPT {
                        let some = *table.chosen.keys().next().expect("the map is full");
                        table.chosen.remove(&some);
                    }
                    table.chosen.insert(slot.object.key, ChosenId { id, handle: handle.into() });
                }
            }
            drop(table);
            // The last reference to a deleted file closes its descriptor, and the backing
            // file system frees the inode in that close (blocks, bitmaps): slow work that
            // must not hold every other lookup and getattr behind this lock.
            drop(slot);
        }
    }

    pub fn len(&self) -> usize {
        self.table().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
