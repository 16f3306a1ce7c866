//! Near flushers: one per CPU, pinned there, for the flush a request waits on when it is a
//! single unit (a small file's close or fsync).
//!
//! A request's thread that hands its unit to the pool and waits pays two wake-ups: the pool's
//! flusher is woken on whichever CPU the scheduler finds idle (on a 2-CPU machine, the other
//! one), and its end wakes the request's thread back on its own CPU, idle meanwhile. On a VM a
//! wake-up of an idle vCPU costs tens of microseconds (a pipe round trip here: 2.6 us on one
//! CPU, 62 us across two): tar's close cost 127-190 us, 21 us of it the write. Handed to the
//! flusher pinned to its own CPU, the request's thread sleeps and the near flusher runs in its
//! place at once (the close 70 us). The request still only waits, bounded by `io_timeout`,
//! while a flusher makes the backend call: a backend that never answers holds the flusher, not
//! the request.
//!
//! Owns: one slot per CPU, holding one job at a time. Must not: queue behind a busy near
//! flusher (the job goes to the pool then), so a near flusher stuck in a backend call
//! strands nothing but the unit it holds.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::{lock, FileState, Job, Writeback};

#[derive(Default)]
pub(super) struct NearSlot {
    state: Mutex<SlotState>,
    ready: Condvar,
}

#[derive(Default)]
struct SlotState {
    job: Option<Job>,
    /// From the hand-off until its flusher has flushed the job: no second job meanwhile.
    busy: bool,
}

/// Near flushers at most: a thread each. A request on a CPU beyond them hands its unit to the
/// pool.
const NEAR_FLUSHERS_MAX: usize = 64;

/// One slot per possible CPU (`sys::possible_cpus`), up to `NEAR_FLUSHERS_MAX`.
pub(super) fn slots() -> Vec<NearSlot> {
    (0..crate::sys::possible_cpus().min(NEAR_FLUSHERS_MAX)).map(|_| NearSlot::default()).collect()
}

impl Writeback {
    /// Hands `unit` to the near flusher of the calling thread's CPU when it is idle; otherwise
    /// (busy, or no CPU known) to the pool.
    pub(super) fn push_job_near(&self, file: &Arc<FileState>, unit: u64) {
        let slot = crate::sys::current_cpu().and_then(|cpu| self.near.get(cpu));
        if let Some(slot) = slot {
            let mut state = lock(&slot.state);
            if !state.busy && !self.threads.stopping() {
                state.busy = true;
                state.job = Some(Job { file: file.clone(), unit });
                drop(state);
                slot.ready.notify_one();
                self.metrics.flushes_near.fetch_add(1, Relaxed);
                return;
            }
        }
        self.push_job(file, unit);
    }

    /// A near flusher: pinned to `cpu` (left unpinned, it still serves, as a pool flusher
    /// would), it flushes the job its slot is handed, one at a time, until the threads stop.
    pub(super) fn near_flusher_loop(&self, cpu: usize) {
        if let Err(e) = crate::sys::run_on_cpu(cpu) {
            log::debug!("near flusher {cpu}: not pinned: {e}");
        }
        let slot = &self.near[cpu];
        loop {
            let job = {
                let mut state = lock(&slot.state);
                loop {
                    if let Some(job) = state.job.take() {
                        break job;
                    }
                    if self.threads.stopping() {
                        return;
                    }
                    state = slot.ready.wait_timeout(state, Duration::from_millis(200)).unwrap().0;
                }
            };
            // Free once the store's call has returned, before the closing thread is woken: its
            // next close may come at once, and would go to the pool if this one were still busy.
            // A flusher stuck in the store stays busy and is handed nothing more.
            let mut free_slot = Some(|| lock(&slot.state).busy = false);
            self.flush_unit(&job.file, job.unit, &mut free_slot);
            if let Some(free) = free_slot.take() {
                free();
            }
        }
    }

    /// Whether no near flusher holds a job (a request woken by its flush's end may ask before
    /// the flusher has finished with it; such a request's unit goes to the pool).
    #[cfg(test)]
    pub(super) fn near_flushers_idle(&self) -> bool {
        self.near.iter().all(|slot| !lock(&slot.state).busy)
    }

    /// At a stop: jobs not taken yet are dropped (an abandoned engine writes nothing more; a
    /// shut-down has flushed every file before), and every near flusher is woken to end.
    pub(super) fn stop_near_flushers(&self) {
        for slot in &self.near {
            lock(&slot.state).job = None;
            slot.ready.notify_all();
        }
    }
}
