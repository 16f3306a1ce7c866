//! The intent log's device in memory, for in-process tests: it keeps what was synced and, at
//! a crash, a prefix-closed choice of the writes made since, as a real device might.

use std::sync::Mutex;

use super::device::LogDevice;
use crate::sys::SysResult;

/// The log in memory, for in-process tests. `crash` keeps what a real device might: the synced
/// state, plus a prefix-closed choice of the writes made since.
pub struct MemoryLogDevice {
    block_bytes: usize,
    state: Mutex<MemoryLogState>,
}

/// What a `MemoryLogDevice` held at a moment (`MemoryLogDevice::snapshot`).
pub struct MemoryLogSnapshot(MemoryLogState);

#[derive(Clone)]
struct MemoryLogState {
    durable: Vec<u8>,
    /// Writes since the last sync, in order: (byte offset, bytes).
    unsynced: Vec<(usize, Vec<u8>)>,
    map_durable: Vec<u8>,
}

impl MemoryLogDevice {
    pub fn new(size_bytes: u64, block_bytes: usize) -> MemoryLogDevice {
        MemoryLogDevice {
            block_bytes,
            state: Mutex::new(MemoryLogState {
                durable: vec![0; size_bytes as usize],
                unsynced: Vec::new(),
                map_durable: Vec::new(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MemoryLogState> {
        self.state.lock().unwrap()
    }

    /// What the device holds after a crash: every synced byte, and of the writes since the
    /// last sync those `keep` chooses (by their order), each whole.
    pub fn crash(&self, mut keep: impl FnMut(usize) -> bool) {
        let mut state = self.state();
        let unsynced = std::mem::take(&mut state.unsynced);
        for (i, (at, bytes)) in unsynced.into_iter().enumerate() {
            if keep(i) {
                state.durable[at..at + bytes.len()].copy_from_slice(&bytes);
            }
        }
    }

    /// All the device holds now, synced or not, to be put back by `restore` (what a killed
    /// process left: the kernel's page cache outlives it).
    pub fn snapshot(&self) -> MemoryLogSnapshot {
        MemoryLogSnapshot(self.state().clone())
    }

    pub fn restore(&self, snapshot: MemoryLogSnapshot) {
        *self.state() = snapshot.0;
    }

    fn current(state: &MemoryLogState) -> Vec<u8> {
        let mut bytes = state.durable.clone();
        for (at, written) in &state.unsynced {
            bytes[*at..*at + written.len()].copy_from_slice(written);
        }
        bytes
    }
}

impl LogDevice for MemoryLogDevice {
    fn size_bytes(&self) -> SysResult<u64> {
        Ok(self.state().durable.len() as u64)
    }

    fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> SysResult<()> {
        assert!(!bytes.is_empty() && bytes.len() % self.block_bytes == 0, "whole log blocks: {}", bytes.len());
        assert!(offset % self.block_bytes as u64 == 0, "a log write at {offset}, not a block boundary");
        let at = offset as usize;
        let mut state = self.state();
        assert!(at + bytes.len() <= state.durable.len(), "a log write past the device's end");
        state.unsynced.push((at, bytes.to_vec()));
        Ok(())
    }

    fn sync(&self) -> SysResult<()> {
        let mut state = self.state();
        let current = Self::current(&state);
        state.durable = current;
        state.unsynced.clear();
        Ok(())
    }

    fn read_at(&self, offset: u64, len: usize) -> SysResult<Vec<u8>> {
        let current = Self::current(&self.state());
        let start = (offset as usize).min(current.len());
        Ok(current[start..(start + len).min(current.len())].to_vec())
    }

    fn describe(&self) -> String {
        "the in-memory log".to_string()
    }

    fn read_map(&self) -> SysResult<Vec<u8>> {
        Ok(self.state().map_durable.clone())
    }

    fn append_map_synced(&self, bytes: &[u8]) -> SysResult<()> {
        self.state().map_durable.extend_from_slice(bytes);
        Ok(())
    }

    fn remove_map(&self) -> SysResult<()> {
        self.state().map_durable.clear();
        Ok(())
    }
}
