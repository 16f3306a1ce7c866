"""Seed 000's pmxcfs, as this bench reproduces it without Proxmox: a tree kept in one SQLite
database whose every FUSE request that changes it is one transaction, and whose every write
(FUSE hands pmxcfs 4 KiB at a time) rewrites the file's whole blob (pmxcfs keeps a file's bytes
in one row of its `tree` table and writes the row back whole; `memdb.c`, `database.c`), with
the version counter pmxcfs bumps in the same transaction. WAL, synchronous=NORMAL, as the issue
states the baseline. No FUSE mount: the daemon's FUSE layer writes nothing to a device, and
the transactions are what the device sees. The file is on the measured device like any store.

And the config-store workload of issue 43, over any of the systems: 400 files of 1-8 KiB in 10
directories, then 1,000 rewrites, each a temporary file written, fsynced and renamed over the
file, one at a time, as a cluster configuration tool writes.
"""
import os, random, sqlite3, time

FUSE_WRITE = 4096


class PmxcfsStyle:
    """The emulated file system: names are paths relative to its root (directories too)."""

    def __init__(self, db_path):
        self.db = sqlite3.connect(db_path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS tree (inode INTEGER PRIMARY KEY, parent INTEGER, version INTEGER, "
                        "writer INTEGER, mtime INTEGER, type INTEGER, name TEXT, data BLOB, UNIQUE(parent, name))")
        self.db.execute("INSERT OR IGNORE INTO tree VALUES (0, 0, 0, 0, 0, 4, '__version__', NULL)")

    def close(self):
        self.db.close()

    def _transaction(self, statements):
        # One FUSE request, one transaction, the version counter bumped with it (pmxcfs's
        # `db_tree_entry_update` and `__version__` row).
        self.db.execute("BEGIN")
        for sql, args in statements:
            self.db.execute(sql, args)
        self.db.execute("UPDATE tree SET version = version + 1 WHERE inode = 0")
        self.db.execute("COMMIT")

    def _split(self, path):
        parent, _, name = path.rpartition("/")
        return (self.inode(parent) if parent else 0), name

    def inode(self, path):
        parent, name = self._split(path)
        row = self.db.execute("SELECT inode FROM tree WHERE parent = ? AND name = ?", (parent, name)).fetchone()
        return row[0] if row else None

    def mkdir(self, path):
        parent, name = self._split(path)
        self._transaction([("INSERT INTO tree(parent, version, writer, mtime, type, name, data) VALUES (?, 0, 0, ?, 4, ?, NULL)",
                            (parent, int(time.time()), name))])

    def create_or_truncate(self, path):
        """open(O_CREAT | O_TRUNC): a new row, or the blob emptied (a setattr of size 0)."""
        inode = self.inode(path)
        if inode is None:
            parent, name = self._split(path)
            self._transaction([("INSERT INTO tree(parent, version, writer, mtime, type, name, data) "
                                "VALUES (?, 0, 0, ?, 8, ?, x'')", (parent, int(time.time()), name))])
        else:
            self._transaction([("UPDATE tree SET data = x'', mtime = ? WHERE inode = ?", (int(time.time()), inode))])

    def write(self, path, data):
        """The file's bytes from offset 0, as FUSE delivers them: a whole-blob rewrite per 4 KiB."""
        inode = self.inode(path)
        for end in range(FUSE_WRITE, len(data) + FUSE_WRITE, FUSE_WRITE):
            blob = data[:min(end, len(data))]
            self._transaction([("UPDATE tree SET data = ?, mtime = ? WHERE inode = ?", (blob, int(time.time()), inode))])

    def rename(self, old, new):
        old_inode = self.inode(old)
        parent, name = self._split(new)
        self._transaction([("DELETE FROM tree WHERE parent = ? AND name = ?", (parent, name)),
                           ("UPDATE tree SET parent = ?, name = ? WHERE inode = ?", (parent, name, old_inode))])

    def write_file(self, path, data, kind="new"):
        """seed 000's patterns: a new file (or O_TRUNC over one), or tmp + rename over it."""
        written = path + ".tmp" if kind == "rename" else path
        self.create_or_truncate(written)
        self.write(written, data)
        if kind == "rename":
            self.rename(written, path)


def config_tree(rng):
    """The config store's 400 files in 10 directories, each of 1-8 KiB: (relative path, size)."""
    return [(f"d{i % 10}/f{i}.conf", rng.randint(1, 8) * 1024) for i in range(400)]


def config_prepare(path, tree, emulated=None):
    if emulated:
        for d in sorted({name.split("/")[0] for name, _ in tree}):
            emulated.mkdir(d)
        for name, size in tree:
            emulated.write_file(name, os.urandom(size))
        return
    for d in sorted({name.split("/")[0] for name, _ in tree}):
        os.makedirs(os.path.join(path, d), exist_ok=True)
    for name, size in tree:
        with open(os.path.join(path, name), "wb") as f:
            f.write(os.urandom(size))


def config_rewrites(path, tree, rewrites, seed, emulated=None):
    """`rewrites` files chosen at random rewritten with new bytes of a new size (1-8 KiB): a
    temporary file beside it written, fsynced, renamed over it; one after the other. Returns
    the bytes written."""
    rng = random.Random(seed)
    written = 0
    for _ in range(rewrites):
        name, _ = rng.choice(tree)
        data = os.urandom(rng.randint(1, 8) * 1024)
        written += len(data)
        if emulated:
            # pmxcfs's fsync commits nothing more: each write was its own transaction.
            emulated.write_file(name, data, "rename")
            continue
        target = os.path.join(path, name)
        tmp = target + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, target)
    return written
