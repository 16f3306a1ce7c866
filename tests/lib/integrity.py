"""`PRAGMA integrity_check` of a SQLite store's database file, for the crash harness, the power
cut and the application suite over `sqlite:`."""
import sqlite3


def open_read_only(path):
    """The database file at `path`, read only (a daemon may hold it open: WAL lets a reader in
    beside it)."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=20)


def sqlite_integrity(path):
    """The database file at `path` checked read only; "ok" when clean, else SQLite's findings
    joined."""
    db = open_read_only(path)
    try:
        return "; ".join(row[0] for row in db.execute("PRAGMA integrity_check"))
    finally:
        db.close()
