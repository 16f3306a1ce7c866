//! The inode table: which FUSE inode number stands for which backing object, and how many
//! kernel lookups keep it alive.
//!
//! Inode numbers are the backing file system's own where that is unambiguous (same device as
//! the backing root), so `stat` and `readdir` agree, hard links share a number, and numbers stay
//! the same across remounts. Objects on other devices (a mount inside the backing directory)
//! get numbers from a synthetic range. The root is always FUSE inode 1.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::backend::local::{LocalBackend, Node};
use crate::sys::SysResult;

pub const ROOT_INO: u64 = 1;
/// Synthetic numbers start here; backing file systems do not hand out inode numbers this high.
const SYNTHETIC_INO_BASE: u64 = 1 << 63;

/// Identity of a backing object: (st_dev, st_ino).
pub type BackingKey = (u64, u64);

#[derive(Debug)]
pub struct Inode {
    pub ino: u64,
    pub key: BackingKey,
    pub node: Node,
    /// The object's persistent backend handle, which the intent log names it by: it never
    /// changes while the node pins the object, so it is asked for once.
    handle: OnceLock<Vec<u8>>,
}

impl Inode {
    fn new(ino: u64, key: BackingKey, node: Node) -> Inode {
        Inode { ino, key, node, handle: OnceLock::new() }
    }

    pub fn backend_handle(&self, backend: &LocalBackend) -> SysResult<Vec<u8>> {
        if let Some(handle) = self.handle.get() {
            return Ok(handle.clone());
        }
        let handle = backend.file_handle(&self.node)?;
        Ok(self.handle.get_or_init(|| handle).clone())
    }
}

struct Slot {
    inode: Arc<Inode>,
    lookups: u64,
}

struct Table {
    by_ino: HashMap<u64, Slot>,
    by_key: HashMap<BackingKey, u64>,
    next_synthetic: u64,
}

pub struct InodeTable {
    root_key: BackingKey,
    table: Mutex<Table>,
}

impl InodeTable {
    pub fn new(root: Node, root_key: BackingKey) -> InodeTable {
        let root = Arc::new(Inode::new(ROOT_INO, root_key, root));
        let mut by_ino = HashMap::new();
        // The root is never forgotten: one lookup that no forget will ever balance.
        by_ino.insert(ROOT_INO, Slot { inode: root, lookups: 1 });
        let mut by_key = HashMap::new();
        by_key.insert(root_key, ROOT_INO);
        InodeTable {
            root_key,
            table: Mutex::new(Table { by_ino, by_key, next_synthetic: SYNTHETIC_INO_BASE }),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn get(&self, ino: u64) -> Option<Arc<Inode>> {
        self.table().by_ino.get(&ino).map(|slot| slot.inode.clone())
    }

    /// The number this key has or would have: what readdir reports for an entry that was never
    /// looked up. Numbers of other-device objects are only known once looked up.
    pub fn ino_for_listing(&self, key: BackingKey) -> u64 {
        if let Some(&ino) = self.table().by_key.get(&key) {
            return ino;
        }
        self.natural_ino(key).unwrap_or(key.1)
    }

    fn natural_ino(&self, key: BackingKey) -> Option<u64> {
        if key == self.root_key {
            return Some(ROOT_INO);
        }
        if key.0 == self.root_key.0 && key.1 != ROOT_INO && key.1 < SYNTHETIC_INO_BASE {
            Some(key.1)
        } else {
            None
        }
    }

    /// Records one kernel lookup of the object `node` refers to. If the object is already in the
    /// table, the new node is dropped and the existing inode returned.
    ///
    /// The backing inode number alone does not name an object: nodes do not pin their inodes
    /// (see `backend::local`), so a file deleted while the kernel still holds its inode frees
    /// its number, and the next file created may get it. That new object gets a synthetic
    /// number, and the key then leads to it; the old one keeps its number until forgotten.
    pub fn remember(&self, node: Node, key: BackingKey) -> Arc<Inode> {
        let mut table = self.table();
        let mut number_taken = false;
        if let Some(&ino) = table.by_key.get(&key) {
            let slot = table.by_ino.get_mut(&ino).expect("by_key and by_ino agree");
            if slot.inode.node.is_same_object(&node) {
                slot.lookups += 1;
                return slot.inode.clone();
            }
            number_taken = true;
        }
        let ino = match self.natural_ino(key) {
            Some(ino) if !number_taken && !table.by_ino.contains_key(&ino) => ino,
            _ => {
                table.next_synthetic += 1;
                table.next_synthetic
            }
        };
        assert!(!table.by_ino.contains_key(&ino), "inode number {ino} already stands for another object");
        let inode = Arc::new(Inode::new(ino, key, node));
        table.by_ino.insert(ino, Slot { inode: inode.clone(), lookups: 1 });
        table.by_key.insert(key, ino);
        inode
    }

    /// The kernel dropped `count` lookups of `ino`; at zero the backing handle is closed.
    pub fn forget(&self, ino: u64, count: u64) {
        if ino == ROOT_INO {
            return;
        }
        let mut table = self.table();
        let Some(slot) = table.by_ino.get_mut(&ino) else { return };
        slot.lookups = slot.lookups.saturating_sub(count);
        if slot.lookups == 0 {
            let slot = table.by_ino.remove(&ino).expect("present above");
            // The key may lead to a newer object by now (see `remember`).
            if table.by_key.get(&slot.inode.key) == Some(&ino) {
                table.by_key.remove(&slot.inode.key);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.table().by_ino.len()
    }
}
