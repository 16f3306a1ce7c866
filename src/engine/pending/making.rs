//! Held files made on the backend: one at once (it grew past what the log takes, or an
//! operation the engine does not model on held files came), or all of them at a checkpoint;
//! and the records a made file leaves in the log, settled before they could be replayed over it.

use super::*;

/// The directories `names` are in, each once.
fn distinct_parents(names: &[(ObjectId, OsString)]) -> Vec<ObjectId> {
    let mut parents: Vec<ObjectId> = names.iter().map(|(parent, _)| *parent).collect();
    parents.sort_unstable();
    parents.dedup();
    parents
}

/// A held file as a make gives it to the backend (`Pending::make_with`).
struct HeldAsItIs {
    /// Its names, the first the one it is made with (see `Body::names`).
    names: Vec<(ObjectId, OsString)>,
    perm: u32,
    owner: Owner,
    times: TimesToSet,
    bytes: Vec<u8>,
}

impl Pending {
    /// Makes the held file `id` on the backend now, at its name, with its attributes and bytes,
    /// under its id, if `when` says so of its body. Ok(None): not held, unlinked, or `when`
    /// declined.
    pub(super) fn make_if(&self, id: ObjectId, when: impl Fn(&Body) -> bool) -> SysResult<Option<Made>> {
        self.make_with(id, when, None, false)
    }

    /// One held file made on the backend ahead of the checkpoint (`make_unlogged_now`,
    /// `make_logged_now`), its directory's times kept as a checkpoint keeps them: `link` of a
    /// file tar extracted earlier must not stamp that file's directory with the time of the link.
    pub(super) fn make_early(
        &self,
        id: ObjectId,
        when: impl Fn(&Body) -> bool,
        durably: Option<&dyn Fn(Vec<Record>) -> SysResult<()>>,
    ) -> SysResult<Option<Made>> {
        let mut parents = self.parents_of(id);
        parents.sort_unstable();
        parents.dedup();
        if parents.is_empty() {
            return self.make_with(id, when, durably, true);
        }
        self.keeping_times_of(&parents, || self.make_with(id, when, durably, true))
    }

    /// `make_if`; with `durably`, the file and its name are synced on the backend and then
    /// `durably(records)` runs (the log's commit of `made_durably_records`), all before anything
    /// else can change the file. While the backend makes it the body is unlocked and marked
    /// `making`: answers that only read it go on from memory, changes wait for the make to end
    /// (see `PendingFile::body`). `alone`: made by itself, not in a checkpoint's batch, so from a
    /// file the backend made ahead (`Namespace::make_with_id_prepared`) where it has one: a
    /// checkpoint's creations share their costs anyway, one made alone pays them all.
    pub(super) fn make_with(
        &self,
        id: ObjectId,
        when: impl Fn(&Body) -> bool,
        durably: Option<&dyn Fn(Vec<Record>) -> SysResult<()>>,
        alone: bool,
    ) -> SysResult<Option<Made>> {
        let Some(file) = self.get(id) else { return Ok(None) };
        let mut body = file.body();
        if body.real.is_some() || !when(&body) {
            return Ok(None);
        }
        // Unlinked: nothing can name it on the backend, and its bytes go with its last handle.
        let Some((parent, name)) = body.names.first().cloned() else { return Ok(None) };
        // What the backend is given: the body as it is now, which nothing changes until the
        // make ends (`PendingFile::body` waits for it), though answers read it meanwhile.
        let held = HeldAsItIs {
            names: body.names.clone(),
            perm: body.attr.perm,
            owner: Owner { uid: body.attr.uid, gid: body.attr.gid },
            times: TimesToSet {
                atime: Some(TimeToSet::At(body.attr.atime)),
                mtime: Some(TimeToSet::At(body.attr.mtime)),
            },
            bytes: body.bytes.clone(),
        };
        body.making = true;
        drop(body);
        let on_backend = self.make_on_backend(id, &file.key, &held, durably, alone);
        let mut body = lock(&file.body);
        debug_assert!(body.making && body.real.is_none(), "a make's body changed under it");
        let made = on_backend.map(|(data, made)| {
            let names = held.names;
            // The lookups held so far pass to the backend (which counted one for the make),
            // those counted while it made the file too.
            match body.lookups {
                0 => self.ns.forget(id, 1),
                n => {
                    for _ in 1..n {
                        if let Err(e) = self.ns.hold(id) {
                            log::warn!("inode {id}: handing the kernel's lookups to the backend: {e}");
                        }
                    }
                }
            }
            if let (None, Some(created_before_seq)) = (durably, body.created_before_seq) {
                // Made by a checkpoint or for a flush (nothing else makes a logged file without a
                // barrier), marked before its body is let go: whoever finds it made finds it marked.
                let unreleased =
                    Unreleased { key: file.key.clone(), names: names.clone(), attr: made.clone(), created_before_seq };
                lock(&self.made_unbarred).insert(id, unreleased);
            }
            body.real = Some(data);
            self.bytes_held.fetch_sub(body.bytes.len() as u64, Relaxed);
            body.bytes = Vec::new();
            let mut table = self.table();
            table.by_id.remove(&id);
            for (named_parent, named) in &names {
                table.unname(*named_parent, named);
                self.repin(&mut table, *named_parent);
            }
            drop(table);
            self.metrics.pending_files_made.fetch_add(1, Relaxed);
            Some(Made { parent, name, attr: made })
        });
        body.making = false;
        drop(body);
        file.made.notify_all();
        made
    }

    /// The backend's part of `make_with`, the file's body unlocked: the file made at its first
    /// name under its id, linked at the others, its bytes and times written, and with
    /// `durably`, synced and its records committed. On failure the backend keeps no half of it
    /// (the file stays held, whole).
    fn make_on_backend(
        &self,
        id: ObjectId,
        key: &[u8],
        held: &HeldAsItIs,
        durably: Option<&dyn Fn(Vec<Record>) -> SysResult<()>>,
        alone: bool,
    ) -> SysResult<(Arc<dyn FileData>, Attr)> {
        let (parent, name) = &held.names[0];
        // A backend file it was renamed over may still hold the name, hidden: it goes first.
        self.remove_hidden(*parent, Some(name))?;
        let made = if alone {
            self.backend_names().make_with_id_prepared(id, *parent, name, held.perm, held.owner)?
        } else {
            self.backend_names().make_with_id(id, *parent, name, held.perm, held.owner)?
        };
        assert_eq!(made.id, id, "the backend keeps the id it is given");
        // Its hard links, each where the file's name was made: the names it has now.
        let mut linked = 0;
        let written = (|| {
            for (link_parent, link_name) in &held.names[1..] {
                self.remove_hidden(*link_parent, Some(link_name))?;
                self.backend_names().link(id, *link_parent, link_name)?;
                self.ns.forget(id, 1); // the link's lookup: the make's stands for the kernel's
                linked += 1;
            }
            let data = self.store.open(id, OpenMode { write: true, no_atime: false })?;
            if !held.bytes.is_empty() {
                crate::engine::writeback::write_range(&*self.store, &*data, 0, &held.bytes, &self.metrics)?;
            }
            self.ns.setattr(id, &SetAttr { times: held.times, ..SetAttr::default() })?;
            if let Some(commit) = durably {
                data.sync(false)?;
                for dir in distinct_parents(&held.names) {
                    self.ns.sync_dir(dir)?;
                }
                commit(self.made_durably_records(key, &held.names, &made)?)?;
            }
            Ok(data)
        })();
        match written {
            Ok(data) => Ok((data, made)),
            Err(e) => {
                // Taken back: the file stays held, whole, and the backend keeps no half of it.
                for (made_parent, made_name) in held.names.iter().take(1 + linked) {
                    let _ = self.backend_names().remove(*made_parent, made_name, false);
                }
                self.ns.forget(id, 1);
                Err(e)
            }
        }
    }

    /// What the log is told of a held file made on the backend durably: a Barrier under its
    /// held key (replay leaves its earlier records alone: the backend holds all of it), and its
    /// creation under its backend key at its first name (a Link for each other one), as for
    /// any file created since the checkpoint. Without that Create, replay could not follow the
    /// file's later renames and unlinks once the backend lost it (the power-cut test found a
    /// file renamed over and then unlinked made again: the Create of the file it replaced was
    /// replayed, its replacement's rename not).
    pub(super) fn made_durably_records(
        &self,
        key: &[u8],
        names: &[(ObjectId, OsString)],
        made: &Attr,
    ) -> SysResult<Vec<Record>> {
        let file = self.ns.log_key(made.id)?;
        let mut records = vec![Record::Barrier { file: key.to_vec() }];
        for (i, (parent, name)) in names.iter().enumerate() {
            let (parent, name) = (self.ns.log_key(*parent)?, name.as_encoded_bytes().to_vec());
            records.push(if i == 0 {
                Record::Create { file: file.clone(), parent, name, mode: made.mode(), uid: made.uid, gid: made.gid }
            } else {
                Record::Link { file: file.clone(), parent, name }
            });
        }
        Ok(records)
    }

    /// Makes a held file the log has not seen on the backend now (for an operation the
    /// engine does not model on held files, or a file grown past the log's bound).
    pub fn make_unlogged_now(&self, id: ObjectId) -> SysResult<Option<Made>> {
        self.make_early(id, |body| body.created_before_seq.is_none(), None)
    }

    /// Makes a held file the log knows on the backend now, durably (the file synced, then its
    /// directory), then runs `commit` with the records that say so (`made_durably_records`).
    /// Costs what an fsync of a new backend file costs, and no checkpoint.
    pub fn make_logged_now(
        &self,
        id: ObjectId,
        commit: &dyn Fn(Vec<Record>) -> SysResult<()>,
    ) -> SysResult<Option<Made>> {
        self.make_early(id, |body| body.created_before_seq.is_some(), Some(commit))
    }

    /// A checkpoint's pass: the backend files held files took the names of unlinked (their
    /// Unlink records precede the release point), then every named held file whose Create
    /// record precedes `released_before` (or that has none) made on the backend, in directory
    /// order. Files first logged since stay held: their Create outlives this checkpoint.
    /// Returns the objects whose names were unlinked.
    ///
    /// Each step holds the names gate for writing, a chunk of `FILES_MADE_PER_GATE` files (or
    /// directories) at a time, so a rename or unlink waits for one chunk, not the whole pass:
    /// those commit their records under the gate, so every chunk makes a file at the name its
    /// committed records leave it with, which is where replay looks for it, and gives back
    /// directory times no held change moves meanwhile. A file made here and renamed or unlinked
    /// before the release is settled first (`settle_made`).
    pub fn make_all(&self, released_before: u64) -> SysResult<Vec<ObjectId>> {
        let hiding: Vec<ObjectId> = self.table().hidden.keys().copied().collect();
        let mut unlinked = Vec::new();
        for dirs in hiding.chunks(FILES_MADE_PER_GATE) {
            self.chunk_under_the_gate(dirs, || {
                for dir in dirs {
                    unlinked.extend(self.remove_hidden(*dir, None)?);
                }
                Ok(())
            })?;
        }
        let mut files: Vec<(ObjectId, ObjectId)> =
            self.table().by_name.iter().flat_map(|(parent, names)| names.values().map(|id| (*parent, *id))).collect();
        // Directory by directory, each in name order (stable: names come sorted).
        files.sort_by_key(|(parent, _)| *parent);
        let due = |body: &Body| body.created_before_seq.is_none_or(|seq| seq <= released_before);
        for chunk in files.chunks(FILES_MADE_PER_GATE) {
            // Where the files are now: a rename between chunks may have moved one.
            let mut dirs: Vec<ObjectId> = chunk.iter().flat_map(|(_, id)| self.parents_of(*id)).collect();
            dirs.sort_unstable();
            dirs.dedup();
            self.chunk_under_the_gate(&dirs, || {
                for (_, id) in chunk {
                    self.make_if(*id, due)?;
                }
                Ok(())
            })?;
        }
        // Directories whose changes were all unlinks or renames away keep their times too.
        for dirs in self.directories_changed().chunks(FILES_MADE_PER_GATE) {
            self.chunk_under_the_gate(dirs, || Ok(()))?;
        }
        Ok(unlinked)
    }

    /// One step of `make_all`: `settle` under the names gate, the times of `dirs` kept, then
    /// the gate handed straight to whoever waits for it. Released plainly, it went back to the
    /// checkpoint's next step before a woken reader ran, and a rename waited for every step
    /// (hundreds of ms for 10,000 files).
    fn chunk_under_the_gate(&self, dirs: &[ObjectId], settle: impl FnOnce() -> SysResult<()>) -> SysResult<()> {
        let gate = self.names_gate.write();
        let settled = self.keeping_times_of(dirs, settle);
        parking_lot::RwLockWriteGuard::unlock_fair(gate);
        settled
    }

    /// A checkpoint has released every batch before `released_before`: the files whose Create
    /// those held are released with them (the checkpoint synced the backend first).
    pub fn checkpoint_released(&self, released_before: u64) {
        lock(&self.made_unbarred).retain(|_, file| file.created_before_seq > released_before);
    }

    /// Makes a held file the log knows on the backend for a flush of its bytes (it grew past
    /// what the log takes), without syncing it or writing its barrier: those wait for its
    /// close or fsync, rename or unlink (`settle_made`), which then syncs its creation and the
    /// bytes written meanwhile in one journal commit. Made durably at once (`make_logged_now`)
    /// the file cost a commit of its own before its bytes reached the backend, and another at
    /// the next `sync` for their blocks: a shell's `cmd > file` and dd close the new file once
    /// empty (the log takes that close), then write it, 24 KiB more than native ext4 on a 4Kn
    /// device for a 64 KiB file. Until it is settled only unacknowledged writes are in it.
    pub fn make_logged_for_flush(&self, id: ObjectId) -> SysResult<Option<Made>> {
        self.make_early(id, |body| body.created_before_seq.is_some(), None)
    }

    /// Whether `id` was made on the backend with its held records still in the log, unbarred.
    pub fn is_unbarred(&self, id: ObjectId) -> bool {
        lock(&self.made_unbarred).contains_key(&id)
    }

    /// Before an fsync or close of a file that is not held: if a checkpoint made it and is
    /// still running, waits until it has released the file's records (it holds `release_gate`
    /// until then); if it failed, or a flush made it, settles the file (`settle_unreleased`).
    /// Returns whether this call settled it. The caller asked `is_unbarred` first, and holds
    /// no names gate.
    pub fn settle_if_made_unbarred(
        &self,
        id: ObjectId,
        commit: &dyn Fn(Vec<Record>) -> SysResult<()>,
    ) -> SysResult<bool> {
        drop(self.release_gate.read().unwrap());
        self.settle_unreleased(id, commit)
    }

    /// A file a failed checkpoint or a flush made, whose held records are still in the log:
    /// synced on the backend with its directory, then `commit` of the records that say it was made durably
    /// (as `make_logged_now`), so that replay leaves its held records alone and follows what
    /// comes next. A checkpoint may be running: what this commits follows its release point, and
    /// its release of the held records leaves this file's barrier and Create to replay.
    /// Returns whether this call settled it (synced it and committed its records).
    pub fn settle_unreleased(&self, id: ObjectId, commit: &dyn Fn(Vec<Record>) -> SysResult<()>) -> SysResult<bool> {
        // The entry stays through the syncs, and the map is not held across them (every close
        // and fsync asks it): a second caller meanwhile settles the file too, and neither goes
        // on before a commit of the records, its own.
        let Some(file) = lock(&self.made_unbarred).get(&id).cloned() else { return Ok(false) };
        self.store.open(id, OpenMode { write: true, no_atime: false })?.sync(false)?;
        for dir in distinct_parents(&file.names) {
            self.ns.sync_dir(dir)?;
        }
        commit(self.made_durably_records(&file.key, &file.names, &file.attr)?)?;
        let mut made = lock(&self.made_unbarred);
        if made.get(&id).is_some_and(|now| now.key == file.key && now.created_before_seq == file.created_before_seq) {
            made.remove(&id);
        }
        Ok(true)
    }

    /// The held files named in the directory `dir`.
    pub fn named_in(&self, dir: ObjectId) -> Vec<ObjectId> {
        let table = self.table();
        table.by_name.get(&dir).map_or_else(Vec::new, |names| names.values().copied().collect())
    }

    /// Whether a checkpoint would make anything (see `make_all`).
    pub fn any_named(&self) -> bool {
        !self.table().by_name.is_empty()
    }

    /// Whether a checkpoint has anything of held files to settle: files to make, hidden names
    /// to unlink, directory times to set.
    pub fn any_to_settle(&self) -> bool {
        let table = self.table();
        !table.by_name.is_empty() || !table.hidden.is_empty() || !table.dir_changed.is_empty()
    }
}
