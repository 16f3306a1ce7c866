//! What the log's records say about names, read before replay applies any: which object a
//! record removes from or puts at a name, where each is last removed, put or moved away,
//! which directories replay may have to make again, and how far a directory's sync reached.

use super::*;

/// The object a name record removes from a name, and that name (its directory's key, the name):
/// an Unlink's file, or the file a Rename replaced.
pub(super) fn removed_by(record: &Record) -> Option<(&[u8], &[u8], &[u8])> {
    match record {
        Record::Unlink { file, parent, name, .. } => Some((file, parent, name)),
        Record::Rename { to_parent, to_name, replaced, .. } if !replaced.is_empty() => {
            Some((replaced, to_parent, to_name))
        }
        _ => None,
    }
}

/// The object a name record puts at a name, and the name (its directory's key and the name):
/// a rename's target, a link's new name (`Record::name_taken`, a Create's aside: it puts a new
/// object, never one back).
pub(super) fn put_by(record: &Record) -> Option<(&[u8], &[u8], &[u8])> {
    match record {
        Record::Rename { .. } | Record::Link { .. } => {
            record.name_taken().map(|(parent, name)| (record.file(), parent, name))
        }
        _ => None,
    }
}

/// Whether a record in `later` puts `object` back at `name` in `parent` (through another hard
/// link of it): renames it there, or links it there.
pub(super) fn put_back(later: &[&Record], object: &[u8], parent: &[u8], name: &[u8]) -> bool {
    later.iter().any(|r| put_by(r) == Some((object, parent, name)))
}

/// A name of a new file the log held: its directory's key and the name.
pub(super) type LastName<'a> = (&'a [u8], &'a [u8]);

/// Where each file's last Barrier is (its records before it are on the backend durably).
pub(super) fn last_barriers<'a>(records: &[&'a Record]) -> HashMap<&'a [u8], usize> {
    let mut last_barrier = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        if let Record::Barrier { file } = r {
            last_barrier.insert(file.as_slice(), i);
        }
    }
    last_barrier
}

/// Keys of the files the log holds bytes, sizes or attributes of after their last Barrier.
pub(super) fn with_contents(records: &[&Record], last_barrier: &HashMap<&[u8], usize>) -> HashSet<Vec<u8>> {
    records
        .iter()
        .enumerate()
        .filter(|(i, r)| {
            matches!(r, Record::Data { .. } | Record::Size { .. } | Record::Attrs { .. })
                && last_barrier.get(r.file()).is_none_or(|&b| *i > b)
        })
        .map(|(_, r)| r.file().to_vec())
        .collect()
}

/// The names each new file the log held ends with, the one it was made with (or renamed to)
/// first, then those its hard links gave it (empty: unlinked from all, or made on the backend
/// durably, its records barred: `make_logged_now`). Records of a key no Create names (a
/// checkpoint released the Create and made the file) are not followed.
pub(super) fn held_file_ends<'a>(records: &[&'a Record]) -> HashMap<&'a [u8], Vec<LastName<'a>>> {
    let mut held_ends: HashMap<&[u8], Vec<LastName<'_>>> = HashMap::new();
    for r in records {
        match r {
            Record::Create { file, parent, name, .. } if is_pending_key(file) => {
                held_ends.insert(file, vec![(parent, name)]);
            }
            Record::Rename { file, from_parent, from_name, to_parent, to_name, .. } if is_pending_key(file) => {
                if let Some(names) = held_ends.get_mut(file.as_slice()) {
                    let from = (from_parent.as_slice(), from_name.as_slice());
                    match names.iter_mut().find(|n| **n == from) {
                        Some(renamed) => *renamed = (to_parent, to_name),
                        None => log::debug!("replay: {} renamed from a name it did not have", r.describe()),
                    }
                }
            }
            Record::Link { file, parent, name } if is_pending_key(file) => {
                if let Some(names) = held_ends.get_mut(file.as_slice()) {
                    names.push((parent, name));
                }
            }
            Record::Unlink { file, parent, name, .. } if is_pending_key(file) => {
                if let Some(names) = held_ends.get_mut(file.as_slice()) {
                    names.retain(|n| *n != (parent.as_slice(), name.as_slice()));
                } else {
                    held_ends.insert(file, Vec::new());
                }
            }
            Record::Barrier { file } if is_pending_key(file) => {
                held_ends.insert(file, Vec::new());
            }
            _ => {}
        }
    }
    held_ends
}

pub(super) fn is_directory(mode: u32) -> bool {
    mode & libc::S_IFMT == libc::S_IFDIR
}

/// The directories replay may make again (`Replay::needed_dirs`): where files with contents to
/// restore, and new files the log held, end up (their Creates' and Renames' directories, the
/// held files' last names'), and, up the tree, the directories those were made or moved in.
pub(super) fn needed_directories(
    records: &[&Record],
    with_contents: &HashSet<Vec<u8>>,
    held_ends: &HashMap<&[u8], Vec<LastName<'_>>>,
) -> HashSet<Vec<u8>> {
    let restored = |file: &[u8]| with_contents.contains(file) || is_pending_key(file);
    let mut needed: HashSet<Vec<u8>> = HashSet::new();
    for r in records {
        match r {
            Record::Create { file, parent, mode, .. } if !is_directory(*mode) && restored(file) => {
                needed.insert(parent.clone());
            }
            Record::Rename { file, to_parent, .. } if restored(file) => {
                needed.insert(to_parent.clone());
            }
            _ => {}
        }
    }
    needed.extend(held_ends.values().flatten().map(|(parent, _)| parent.to_vec()));
    loop {
        let before = needed.len();
        for r in records {
            match r {
                Record::Create { file, parent, mode, .. }
                    if is_directory(*mode) && needed.contains(file.as_slice()) =>
                {
                    needed.insert(parent.clone());
                }
                Record::Rename { file, from_parent, to_parent, .. } if needed.contains(file.as_slice()) => {
                    needed.insert(from_parent.clone());
                    needed.insert(to_parent.clone());
                }
                _ => {}
            }
        }
        if needed.len() == before {
            return needed;
        }
    }
}

/// The last name record a `NamesSynced` covers (one that changes its directory's names, in a
/// batch before its `before_seq`): the backend holds it, and every name change before it (a
/// journaling file system commits them in order). Not a new file's the log held: those are
/// made apart, at the end.
pub(super) fn names_synced_through(records: &[&Record], batches: &[Batch]) -> Option<usize> {
    let seqs: Vec<u64> = batches.iter().flat_map(|b| std::iter::repeat_n(b.seq, b.records.len())).collect();
    debug_assert_eq!(seqs.len(), records.len(), "a sequence number for each record");
    // Records are in sequence order; the one covered is near the end of the batches before
    // (the log writes the record only when such a change is there to cover).
    let covered_by = |dir: &[u8], before_seq: u64| {
        let end = seqs.partition_point(|&seq| seq < before_seq);
        (0..end).rev().find(|&i| !is_pending_key(records[i].file()) && records[i].directories_changed().contains(&dir))
    };
    records
        .iter()
        .filter_map(|r| match r {
            Record::NamesSynced { dir, before_seq } => covered_by(dir, *before_seq),
            _ => None,
        })
        .max()
}

/// Where each object is last removed (`Replay::last_removal`).
pub(super) fn last_removals(records: &[&Record]) -> HashMap<Vec<u8>, usize> {
    let mut last = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        match r {
            Record::Unlink { file, .. } | Record::Hidden { file, .. } => {
                last.insert(file.clone(), i);
            }
            Record::Rename { replaced, .. } if !replaced.is_empty() => {
                last.insert(replaced.clone(), i);
            }
            _ => {}
        }
    }
    last
}

/// An object at a name: its key, its directory's key, the name.
pub(super) type Place = (Vec<u8>, Vec<u8>, Vec<u8>);

/// Where each object is last put at a name (`Replay::last_put`).
pub(super) fn last_puts(records: &[&Record]) -> HashMap<Place, usize> {
    let mut last = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        if let Some((object, parent, name)) = put_by(r) {
            last.insert((object.to_vec(), parent.to_vec(), name.to_vec()), i);
        }
    }
    last
}

/// Where each object is last renamed away from a name (`Replay::last_move_away`).
pub(super) fn last_moves_away(records: &[&Record]) -> HashMap<Place, usize> {
    let mut last = HashMap::new();
    for (i, r) in records.iter().enumerate() {
        if let Record::Rename { file, from_parent, from_name, .. } = r {
            last.insert((file.clone(), from_parent.clone(), from_name.clone()), i);
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held_key(n: u8) -> Vec<u8> {
        let mut key = b"CFSn".to_vec();
        key.resize(20, n);
        assert!(is_pending_key(&key));
        key
    }

    fn link(file: &[u8], name: &str) -> Record {
        Record::Link { file: file.to_vec(), parent: b"dir".to_vec(), name: name.into() }
    }

    fn unlink(file: &[u8], name: &str) -> Record {
        Record::Unlink { file: file.to_vec(), parent: b"dir".to_vec(), name: name.into(), directory: false }
    }

    /// A held file's names follow its links, renames and unlinks (git's link into place, then
    /// the temporary name's unlink, leaves the final name alone); its last unlink, or a Barrier
    /// (made durably), leaves none; records of a key no Create names are not followed.
    #[test]
    fn a_held_file_ends_with_the_names_its_links_renames_and_unlinks_leave() {
        let (a, b, c) = (held_key(1), held_key(2), held_key(3));
        let create = |file: &[u8], name: &str| Record::Create {
            file: file.to_vec(),
            parent: b"dir".to_vec(),
            name: name.into(),
            mode: libc::S_IFREG | 0o644,
            uid: 0,
            gid: 0,
        };
        let rename = |file: &[u8], from: &str, to: &str| Record::Rename {
            file: file.to_vec(),
            from_parent: b"dir".to_vec(),
            from_name: from.into(),
            to_parent: b"other".to_vec(),
            to_name: to.into(),
            replaced: Vec::new(),
        };
        let records = [
            create(&a, "tmp_a"),
            link(&a, "obj_a"),
            unlink(&a, "tmp_a"),
            create(&b, "tmp_b"),
            link(&b, "obj_b"),
            rename(&b, "tmp_b", "moved_b"),
            create(&c, "c"),
            link(&c, "c2"),
            unlink(&c, "c"),
            unlink(&c, "c2"),
            link(&held_key(4), "released"),
        ];
        let records: Vec<&Record> = records.iter().collect();
        let ends = held_file_ends(&records);
        let names = |key: &[u8]| -> Vec<(Vec<u8>, Vec<u8>)> {
            ends[key].iter().map(|(parent, name)| (parent.to_vec(), name.to_vec())).collect()
        };
        assert_eq!(names(&a), [(b"dir".to_vec(), b"obj_a".to_vec())]);
        assert_eq!(
            names(&b),
            [(b"other".to_vec(), b"moved_b".to_vec()), (b"dir".to_vec(), b"obj_b".to_vec())],
            "the rename moves the name it names, the first"
        );
        assert!(names(&c).is_empty(), "unlinked from both names");
        assert!(!ends.contains_key(held_key(4).as_slice()), "a link of a file whose Create was released");
        let barred = [create(&a, "tmp_a"), link(&a, "obj_a"), Record::Barrier { file: a.clone() }];
        let barred: Vec<&Record> = barred.iter().collect();
        assert!(held_file_ends(&barred)[a.as_slice()].is_empty(), "made durably: replay leaves it");
    }
}
