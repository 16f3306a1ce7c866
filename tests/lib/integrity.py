"""`PRAGMA integrity_check` of a SQLite store's database file, for the crash harness, the power
cut and the application suite over `sqlite:`."""
import os
import shutil
import sqlite3
import tempfile

# How many checks found a live rollback journal (a commit a crash cut short) and checked the
# database as its undo leaves it: the crash harness reports it, so a run shows that path ran.
live_journals_checked = 0


def open_read_only(path):
    """The database file at `path`, read only (a daemon may hold it open: WAL lets a reader in
    beside it; in rollback mode the reader waits for a commit under way)."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=20)


def hot_journal(error):
    """Whether a read-only open failed on a rollback journal a crash left to undo."""
    return isinstance(error, sqlite3.OperationalError) and "readonly" in str(error).replace("-", "")


def checked(db):
    """SQLite's own check, and coalescefs's rule beside it: every commit leaves one `units` row
    a unit at most (schema version 3's index on (file, unit) is not unique: a unit written
    again has two rows only inside the transaction that wrote it)."""
    findings = "; ".join(row[0] for row in db.execute("PRAGMA integrity_check"))
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "units" in tables:
        doubled = db.execute(
            "SELECT count(*) FROM (SELECT 1 FROM units GROUP BY file, unit HAVING count(*) > 1)").fetchone()[0]
        if doubled:
            findings += f"; {doubled} units with more than one row"
    return findings


def sqlite_integrity(path):
    """The database file at `path` checked read only (`checked`); "ok" when clean, else the
    findings joined. In rollback mode a crash may leave a commit cut short, which SQLite undoes from the
    `-journal` file at the next read-write open, so the database is what the two make
    together: a copy of both is opened read-write and checked, the files themselves untouched."""
    db = open_read_only(path)
    try:
        return checked(db)
    except sqlite3.OperationalError as e:
        if not hot_journal(e):
            raise
    finally:
        db.close()
    global live_journals_checked
    live_journals_checked += 1
    with tempfile.TemporaryDirectory(prefix="integrity-", dir=os.path.dirname(os.path.abspath(path))) as copies:
        copy = os.path.join(copies, os.path.basename(path))
        shutil.copyfile(path, copy)
        shutil.copyfile(path + "-journal", copy + "-journal")
        db = sqlite3.connect(copy)
        try:
            return checked(db)
        finally:
            db.close()
