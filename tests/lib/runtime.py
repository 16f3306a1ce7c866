"""Where a coalescefs daemon keeps its runtime files, as src/runtime.rs names the directory: the
store's source (a backing directory or database file, resolved; an s3:// source as given)
escaped as `systemd-escape --path` does, under /run/coalescefs."""
import os

RUN = "/run/coalescefs"


def escaped(source):
    """`source` as src/runtime.rs (and src/state.rs, under /var/lib/coalescefs) name it."""
    path = (source if source.startswith("s3://") else os.path.realpath(source)).strip("/")
    return "".join("-" if c == "/" else c if (c.isascii() and (c.isalnum() or c in ":_") or (c == "." and i > 0))
                   else "".join(f"\\x{b:02x}" for b in c.encode()) for i, c in enumerate(path)) or "-"


def runtime_dir(source):
    """The daemon's runtime directory (its daemon.log, control socket, pid file)."""
    return os.path.join(RUN, escaped(source))


def empty_volatile_tail(source):
    """What a power cut does to the intent log's volatile tail (src/runtime.rs
    `volatile_tail_path`: in the runtime directory where /run is tmpfs, else under /dev/shm):
    it is gone. A simulated cut must take it too, or recovery would replay renames a real one
    loses."""
    for path in (os.path.join(runtime_dir(source), "volatile-tail"),
                 os.path.join(f"/dev/shm/coalescefs-{os.geteuid()}", escaped(source), "volatile-tail")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
