"""Real applications on a directory, as a user runs them: tar, git, SQLite, rsync, make, rm.

The steps are shared by tests/apps/run (which checks every result on a coalescefs mount) and
bench/run --only apps (which times them beside native ext4). Each step takes the directory it
works in and returns nothing; the checks are separate functions that return a list of
problems (empty: all is well), so a test can name every difference it finds.

Everything here is deterministic for a given seed: the source tree, the C project and the
database rows are generated, not taken from the machine.
"""
import errno, hashlib, os, random, shutil, sqlite3, stat, subprocess, sys, time

# Owners the tree's entries get (tar -p as root restores them).
OWNERS = [(0, 0), (1000, 1000), (65534, 65534), (1000, 100)]


def run(*args, cwd=None, env=None, check=True):
    r = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        # git merge says its conflicts on stdout.
        said = r.stderr.strip() or r.stdout.strip()
        raise RuntimeError(f"{' '.join(args)} (in {cwd}): exit {r.returncode}: {said[-2000:]}")
    return r


def _content(rng, size):
    """Text-like bytes: compressible as source code is, never all zeros."""
    words = [b"static ", b"int ", b"return ", b"if (", b"){\n", b"}\n", b"    ", b"struct ", b"const ",
             b"char *", b"0x", b";\n", b"/* ", b" */\n", b"#include <", b">\n"]
    out = bytearray()
    while len(out) < size:
        out += rng.choice(words)
        out += b"%x" % rng.getrandbits(24)
    return bytes(out[:size])


def _size(rng):
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.50:
        return rng.randint(1, 2048)
    if r < 0.88:
        return rng.randint(2048, 16384)
    if r < 0.99:
        return rng.randint(16384, 65536)
    return rng.randint(65536, 512 << 10)


def make_tree(root, entries, seed=1):
    """A source-like tree of about `entries` entries under `root` (which must not exist):
    directories a few levels deep, files of mostly small sizes, symlinks (relative, some
    dangling), hard links, several owners and modes, and times in the past with nanoseconds.
    Returns the number of entries made."""
    rng = random.Random(seed)
    os.makedirs(root)
    dirs = [root]
    made = 0
    files = []
    while made < entries:
        r = rng.random()
        parent = rng.choice(dirs[-200:] if rng.random() < 0.7 else dirs)
        name = f"{rng.choice(['src', 'lib', 'core', 'util', 'net', 'fs', 'mm', 'test', 'doc'])}_{made}"
        if r < 0.05:
            path = os.path.join(parent, name)
            os.mkdir(path, 0o755)
            dirs.append(path)
        elif r < 0.09 and files:
            path = os.path.join(parent, name + ".lnk")
            target = os.path.relpath(rng.choice(files), parent) if rng.random() < 0.9 else "missing-target"
            os.symlink(target, path)
        elif r < 0.10 and files:
            path = os.path.join(parent, name + ".hard")
            os.link(rng.choice(files), path)
        else:
            ext = rng.choice([".c", ".h", ".txt", ".py", ".md", " with space.c", "-é.h", ".o"])
            path = os.path.join(parent, name + ext)
            with open(path, "wb") as f:
                f.write(_content(rng, _size(rng)))
            mode = rng.choice([0o644, 0o644, 0o644, 0o755, 0o600, 0o640, 0o444])
            os.chmod(path, mode)
            files.append(path)
        uid, gid = rng.choice(OWNERS)
        os.lchown(path, uid, gid)
        made += 1
    # Times last, deepest first, so that making an entry does not touch its directory's time.
    for path in sorted(set(files) | set(dirs), key=lambda p: -p.count(os.sep)):
        t = rng.randint(1_000_000_000, 1_700_000_000) * 10**9 + rng.randint(0, 10**9 - 1)
        os.utime(path, ns=(t, t), follow_symlinks=False)
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                t = rng.randint(1_000_000_000, 1_700_000_000) * 10**9 + rng.randint(0, 10**9 - 1)
                os.utime(p, ns=(t, t), follow_symlinks=False)
    t = 1_600_000_000 * 10**9 + 123
    for d in sorted(dirs, key=lambda p: -p.count(os.sep)):
        os.utime(d, ns=(t, t))
    return made


def make_tarball(tree, tarball):
    """POSIX (pax) format: nanosecond mtimes, long names, every owner kept."""
    run("tar", "--format=posix", "--pax-option=delete=atime,delete=ctime", "-C", tree, "-cf", tarball, ".")


def extract(tarball, dest):
    os.makedirs(dest, exist_ok=True)
    run("tar", "--same-owner", "-p", "-C", dest, "-xf", tarball)


def describe(root):
    """Every entry under `root` by relative path: type, mode, owner, size, link target, mtime
    (ns), content digest, and for hard links the group of paths that share an inode."""
    out, inodes = {}, {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            entry = {"type": kind, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
                     "mtime_ns": st.st_mtime_ns}
            if stat.S_ISREG(kind):
                entry["size"] = st.st_size
                with open(path, "rb") as f:
                    entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
                entry["nlink"] = st.st_nlink
                inodes.setdefault(st.st_ino, []).append(rel)
            elif stat.S_ISLNK(kind):
                entry["target"] = os.readlink(path)
            out[rel] = entry
    for paths in inodes.values():
        for p in paths:
            out[p]["links"] = tuple(sorted(paths))
    return out


def compare_trees(expected, actual, limit=20):
    """The differences between two `describe` results, at most `limit` of them named."""
    problems = []
    for rel in sorted(set(expected) | set(actual)):
        e, a = expected.get(rel), actual.get(rel)
        if e != a:
            if e is None or a is None:
                problems.append(f"{rel}: {'missing' if a is None else 'unexpected'}")
            else:
                fields = [f"{k} {e.get(k)!r} != {a.get(k)!r}" for k in sorted(set(e) | set(a)) if e.get(k) != a.get(k)]
                problems.append(f"{rel}: {', '.join(fields)}")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more"]
    return problems


# ---- git


GIT_ENV = dict(os.environ, GIT_AUTHOR_NAME="coalescefs", GIT_AUTHOR_EMAIL="ci@coalescefs",
               GIT_COMMITTER_NAME="coalescefs", GIT_COMMITTER_EMAIL="ci@coalescefs",
               GIT_AUTHOR_DATE="2026-01-01T00:00:00Z", GIT_COMMITTER_DATE="2026-01-01T00:00:00Z",
               HOME="/nonexistent", GIT_CONFIG_NOSYSTEM="1")


def git(repo, *args, check=True):
    # gc.auto=0: a detached automatic gc would still be running when the step ends. No delta
    # search and light zlib: the file system is under test, not git's compressor (a delta
    # search over 30,000 blobs costs a minute of CPU on any file system).
    return run("git", "-c", "safe.directory=*", "-c", "core.fsync=all", "-c", "core.fsyncMethod=fsync",
               "-c", "gc.auto=0", "-c", "pack.window=0", "-c", "core.compression=1", "-C", repo, *args,
               env=GIT_ENV, check=check)


def git_commit_tree(repo):
    """git init, add everything, commit: every object written and fsynced (core.fsync=all)."""
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "import")


def git_rework(repo, seed=2):
    """A day's work: edit a few hundred files, rename some, delete some, a branch, a merge."""
    rng = random.Random(seed)
    tracked = git(repo, "ls-files", "-z").stdout.split("\0")
    tracked = [t for t in tracked if t and not os.path.islink(os.path.join(repo, t))]
    # Its slices below take 500 files; in a smaller tree the merge conflicts (a tree of 500
    # entries, 456 files: content conflicts where rename detection pairs the moved files).
    if len(tracked) < 500:
        raise ValueError(f"git_rework works on 500 of the tree's files, and {repo} has {len(tracked)} (1,000 entries or more)")
    rng.shuffle(tracked)
    git(repo, "checkout", "-q", "-b", "topic")
    for rel in tracked[:300]:
        with open(os.path.join(repo, rel), "ab") as f:
            f.write(b"\n/* edited on the topic branch */\n")
    git(repo, "commit", "-q", "-a", "-m", "edit")
    for rel in tracked[300:340]:
        git(repo, "mv", rel, rel + ".moved")
    git(repo, "rm", "-q", *tracked[340:380])
    git(repo, "commit", "-q", "-m", "move and remove")
    git(repo, "checkout", "-q", "-")
    for rel in tracked[400:500]:
        with open(os.path.join(repo, rel), "ab") as f:
            f.write(b"\n/* edited on the main branch */\n")
    git(repo, "commit", "-q", "-a", "-m", "main edit")
    git(repo, "merge", "-q", "--no-edit", "topic")
    git(repo, "gc", "-q")


def git_check(repo):
    problems = []
    r = git(repo, "fsck", "--full", "--strict", check=False)
    if r.returncode != 0:
        problems.append(f"git fsck --full --strict: {r.stderr.strip()[-1500:]}")
    r = git(repo, "status", "--porcelain", check=False)
    if r.returncode != 0 or r.stdout.strip():
        problems.append(f"git status not clean: {(r.stdout + r.stderr).strip()[:1500]}")
    return problems


# ---- SQLite

READER = r"""
import sqlite3, sys, time
path, stop_file = sys.argv[1], sys.argv[2]
reads = 0
while True:
    stopping = __import__("os").path.exists(stop_file)
    db = sqlite3.connect(path, timeout=30)
    n, top, total = db.execute("SELECT count(*), coalesce(max(id), 0), coalesce(sum(value), 0) FROM t").fetchone()
    db.close()
    # Transactions insert consecutive ids: a reader sees all of them or none.
    if n != top:
        print(f"reader saw {n} rows but max id {top}", file=sys.stderr)
        sys.exit(1)
    reads += 1
    if stopping:
        break
    time.sleep(0.005)
print(reads)
"""


def sqlite_inserts(path, transactions=1000, rows=10, with_reader=True):
    """WAL mode, synchronous=FULL: every commit fsyncs the WAL. A second process reads while
    rows are inserted and checks it always sees whole transactions. Returns the reader's
    number of reads (0 without one)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, value INTEGER, payload BLOB)")
    stop_file = path + ".stop"
    reader = None
    if with_reader:
        reader = subprocess.Popen([sys.executable, "-c", READER, path, stop_file],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rng = random.Random(3)
    next_id = (db.execute("SELECT coalesce(max(id), 0) FROM t").fetchone()[0]) + 1
    for _ in range(transactions):
        db.execute("BEGIN")
        for _ in range(rows):
            db.execute("INSERT INTO t VALUES (?, ?, ?)", (next_id, next_id * 7, rng.randbytes(rng.randint(50, 400))))
            next_id += 1
        db.execute("COMMIT")
    db.close()
    reads = 0
    if reader:
        open(stop_file, "w").close()
        out, err = reader.communicate(timeout=120)
        os.unlink(stop_file)
        if reader.returncode != 0:
            raise RuntimeError(f"the SQLite reader failed: {err.strip()}")
        reads = int(out.strip() or 0)
    return reads


def sqlite_check(path, expected_rows):
    problems = []
    db = sqlite3.connect(path)
    ok = db.execute("PRAGMA integrity_check").fetchone()[0]
    if ok != "ok":
        problems.append(f"PRAGMA integrity_check: {ok}")
    n, total = db.execute("SELECT count(*), coalesce(sum(value), 0) FROM t").fetchone()
    if n != expected_rows or total != 7 * expected_rows * (expected_rows + 1) // 2:
        problems.append(f"{n} rows (sum {total}), {expected_rows} expected")
    db.close()
    return problems


# ---- a sparse image written and walked before its close


def sparse_image(path, size=64 << 20, extents=24, seed=5):
    """What an image tool or a log-structured store does: writes scattered extents into a
    sparse file, then, still holding it open (its writes in the kernel's cache), walks its data
    with SEEK_DATA and SEEK_HOLE, as `cp --sparse` and `qemu-img convert` do, and reads each
    range back. Returns the problems: a written byte the walk skipped, or a range that reads
    other bytes than were written."""
    rng = random.Random(seed)
    written = {}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        for _ in range(extents):
            at = rng.randrange(0, size - (1 << 20)) & ~4095
            data = rng.randbytes(rng.choice([512, 4096, 70000, 1 << 20]))
            os.pwrite(fd, data, at)
            for i in range(0, len(data), 512):  # 512-byte granules, the later write wins
                written[at + i] = data[i:i + 512]
        ranges, at = [], 0
        while True:
            try:
                data = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break
                raise
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            if hole <= data:
                return [f"SEEK_HOLE from data at {data} answered {hole}"]
            ranges.append((data, hole))
            at = hole
        problems = []
        for offset, piece in sorted(written.items()):
            if not any(a <= offset and offset + len(piece) <= b for a, b in ranges):
                problems.append(f"written at {offset}, the walk found data only at {ranges[:8]}...")
                break
            if os.pread(fd, len(piece), offset) != piece:
                problems.append(f"{offset}: reads other bytes than were written")
                break
        return problems
    finally:
        os.close(fd)


# ---- rsync


def rsync(src, dest):
    os.makedirs(dest, exist_ok=True)
    run("rsync", "-aH", src.rstrip("/") + "/", dest)


def rsync_changes(src, dest):
    """What a second rsync would do: nothing, when names, sizes, times and modes all arrived."""
    r = run("rsync", "-aHi", "--dry-run", src.rstrip("/") + "/", dest)
    return [line for line in r.stdout.splitlines() if line.strip()]


# ---- a C build


def make_c_project(root, units=200, seed=4):
    rng = random.Random(seed)
    os.makedirs(os.path.join(root, "include"))
    os.makedirs(os.path.join(root, "src"))
    for h in range(20):
        with open(os.path.join(root, "include", f"h{h}.h"), "w") as f:
            f.write(f"#pragma once\n#define H{h}_VALUE {rng.randint(1, 1000)}\nint h{h}_helper(int);\n")
    for u in range(units):
        includes = "".join(f'#include "h{h}.h"\n' for h in rng.sample(range(20), 3))
        body = "".join(f"    x = x * {rng.randint(2, 9)} + {rng.randint(0, 99)};\n" for _ in range(40))
        with open(os.path.join(root, "src", f"u{u}.c"), "w") as f:
            f.write(f"{includes}int unit{u}(int x) {{\n{body}    return x;\n}}\n")
    with open(os.path.join(root, "src", "main.c"), "w") as f:
        f.write("".join(f"int unit{u}(int);\n" for u in range(units)))
        f.write("#include <stdio.h>\nint main(void) { long s = 0;\n")
        f.write("".join(f"  s += unit{u}({u});\n" for u in range(units)))
        f.write('  printf("%ld\\n", s); return 0; }\n')
    with open(os.path.join(root, "Makefile"), "w") as f:
        f.write("SRCS := $(wildcard src/*.c)\nOBJS := $(SRCS:.c=.o)\nCFLAGS := -O1 -Iinclude -MMD\n"
                "prog: $(OBJS)\n\t$(CC) -o $@ $(OBJS)\n%.o: %.c\n\t$(CC) $(CFLAGS) -c -o $@ $<\n"
                "-include $(OBJS:.o=.d)\n")


def c_build(root, jobs=4):
    run("make", "-s", f"-j{jobs}", cwd=root)


def c_build_check(root, expected_output):
    problems = []
    r = run("make", "-q", cwd=root, check=False)
    if r.returncode != 0:
        problems.append(f"make -q says the build is not up to date (exit {r.returncode})")
    out = run(os.path.join(root, "prog")).stdout.strip()
    if out != expected_output:
        problems.append(f"the built program printed {out!r}, not {expected_output!r}")
    return problems


def remove_tree(path):
    run("rm", "-rf", path)
