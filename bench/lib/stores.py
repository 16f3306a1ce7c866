"""The stores the benchmark writes to and the systems it measures, for bench/run: a loop device
holding a fresh ext4 (`Store`), native ext4, bindfs or coalescefs on it (`System`), and how a run
on them is counted (`measured`: /proc/diskstats around the work, caches dropped, the FUSE mount
unmounted before the final count), with the block trace and FIEMAP that sort the device bytes by
where they landed, the daemon's RSS sampler, and the cleanups that put the machine back.
"""
import os, subprocess, sys, threading, time

from pmxcfs import PmxcfsStyle

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# COALESCEFS_BIN runs another build (an A/B of two builds in one session: bench/run rebuilds
# target/release from the tree it runs in).
BIN = os.environ.get("COALESCEFS_BIN") or os.path.join(REPO, "target", "release", "coalescefs")
# The FUSE ceiling (issue 45): a server that discards writes, built beside coalescefs.
SINK = os.path.join(REPO, "target", "release", "coalescefs-null-sink")
MAX_PAGES_LIMIT = "/proc/sys/fs/fuse/max_pages_limit"
# What puts the machine back, undone last first: `cleanups` after each repetition of a case
# (mounts, stores, traces), `cleanups_global` at the end of the run (the sysctl, the qcow2 source).
cleanups = []
cleanups_global = []


def sh(*args, check=True, capture=False, **kw):
    r = subprocess.run(list(args), check=False, text=True,
                       stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout if capture else r


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def diskstats(dev):
    name = os.path.basename(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == name:
                # sectors read (field 6), sectors written (field 10), always 512-byte sectors
                return {"read_bytes": int(p[5]) * 512, "write_bytes": int(p[9]) * 512,
                        "writes": int(p[7]), "reads": int(p[3])}
    raise RuntimeError(f"{name} not in /proc/diskstats")


ENABLE_URING = "/sys/module/fuse/parameters/enable_uring"


def uring_enabled_while_mounting():
    """enable_uring on (the kernel offers FUSE over io_uring only then, at INIT); what puts it
    back, also run if the benchmark is interrupted. None where the kernel has no such switch."""
    if not os.path.exists(ENABLE_URING):
        return None
    with open(ENABLE_URING) as f:
        before = f.read().strip()

    def restore():
        with open(ENABLE_URING, "w") as f:
            f.write(before + "\n")
        if restore in cleanups_global:
            cleanups_global.remove(restore)
    cleanups_global.append(restore)
    with open(ENABLE_URING, "w") as f:
        f.write("1\n")
    return restore


def raise_max_pages(pages):
    """fs.fuse.max_pages_limit up to `pages` for one case; returns what puts it back, which
    also runs on the way out if the run is interrupted."""
    with open(MAX_PAGES_LIMIT) as f:
        before = f.read().strip()

    def restore():
        with open(MAX_PAGES_LIMIT, "w") as f:
            f.write(before + "\n")
    cleanups_global.append(restore)
    with open(MAX_PAGES_LIMIT, "w") as f:
        f.write(f"{pages}\n")
    return restore


TRACEFS = "/sys/kernel/tracing"
FS_IOC_FIEMAP = 0xC020660B


class WriteTrace:
    """Every write request the block layer issues to one device (tracefs, block:block_rq_issue,
    in a trace instance of our own), so that the device bytes of a run can be sorted by where
    they land. `available` is False where tracefs cannot be had; the breakdown is then left out."""

    def __init__(self, dev):
        self.dev, self.instance, self.available = dev, None, False
        cleanups.append(self.close)
        try:
            if not os.path.isdir(os.path.join(TRACEFS, "events")):
                sh("mount", "-t", "tracefs", "nodev", TRACEFS)
            self.instance = os.path.join(TRACEFS, "instances", f"coalescefs-bench-{os.getpid()}")
            os.makedirs(self.instance, exist_ok=True)
            st = os.stat(dev)
            kernel_dev = (os.major(st.st_rdev) << 20) | os.minor(st.st_rdev)
            event = os.path.join(self.instance, "events", "block", "block_rq_issue")
            self._write("buffer_size_kb", "65536")
            self._write(os.path.join(event, "filter"), f"dev == {kernel_dev}")
            self.enable_file = os.path.join(event, "enable")
            self.available = True
        except (OSError, RuntimeError) as e:
            print(f"bench: no block trace ({e}); device bytes are not broken down", file=sys.stderr)

    def _write(self, name, value):
        with open(os.path.join(self.instance, name), "w") as f:
            f.write(value + "\n")

    def start(self):
        if self.available:
            self._write("trace", "")
            self._write(self.enable_file, "1")

    def stop(self):
        """The write requests since start, as (byte offset, bytes); None if any were lost."""
        if not self.available:
            return None
        self._write(self.enable_file, "0")
        lost = 0
        for cpu in os.listdir(os.path.join(self.instance, "per_cpu")):
            with open(os.path.join(self.instance, "per_cpu", cpu, "stats")) as f:
                lost += sum(int(l.split()[1]) for l in f if l.startswith("overrun:"))
        if lost:
            return None
        writes = []
        with open(os.path.join(self.instance, "trace")) as f:
            for line in f:
                # "... block_rq_issue: 7,0 WS 4096 () 123456 + 8 ..."; sectors are 512 bytes
                head, sep, tail = line.partition("block_rq_issue: ")
                if not sep:
                    continue
                w = tail.split()
                if "W" in w[1] and "+" in w:
                    at = w.index("+")
                    writes.append((int(w[at - 1]) * 512, int(w[at + 1]) * 512))
        return writes

    def close(self):
        if self.instance and os.path.isdir(self.instance):
            if self.available:
                self._write(self.enable_file, "0")
            os.rmdir(self.instance)
        self.instance = None


def fiemap(path):
    """The physical byte ranges of a file, from FS_IOC_FIEMAP (synced first)."""
    import fcntl, struct
    ranges, start = [], 0
    with open(path, "rb") as f:
        while True:
            count = 256
            buf = bytearray(struct.pack("=QQIIII", start, 2**64 - 1 - start, 1, 0, count, 0) + bytes(56 * count))
            fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
            mapped = struct.unpack_from("=I", buf, 20)[0]
            last = False
            for i in range(mapped):
                logical, physical, length, flags = struct.unpack_from("=QQQ16xI", buf, 32 + 56 * i)
                ranges.append((physical, physical + length))
                start = logical + length
                last = last or bool(flags & 1)  # FIEMAP_EXTENT_LAST
            if last or mapped < count:
                return ranges


def journal_ranges(dev):
    """The ext4 journal's byte ranges (inode 8), from debugfs; it never moves after mkfs."""
    import re
    out = sh("debugfs", "-R", "stat <8>", dev, capture=True)
    block = int(sh("dumpe2fs", "-h", dev, capture=True).split("Block size:")[1].split()[0])
    ranges = []
    for first, last in re.findall(r"\(\d+(?:-\d+)?\):(\d+)(?:-(\d+))?", out):
        ranges.append((int(first) * block, (int(last or first) + 1) * block))
    return ranges


def sort_writes(writes, regions):
    """Bytes of `writes` falling in each named region (lists of ranges); the rest is "other"."""
    import bisect
    flat = sorted((a, b, name) for name, ranges in regions.items() for a, b in ranges)
    starts = [a for a, _, _ in flat]
    out = {name: 0 for name in regions}
    out["other"] = 0
    for offset, length in writes:
        end, covered = offset + length, 0
        i = max(bisect.bisect_right(starts, offset) - 1, 0)
        while i < len(flat) and flat[i][0] < end:
            a, b, name = flat[i]
            overlap = min(b, end) - max(a, offset)
            if overlap > 0:
                out[name] += overlap
                covered += overlap
            i += 1
        out["other"] += length - covered
    return out


def where_bytes_went(store, writes):
    """Device bytes of a run sorted into file data (the files under data/), the intent log,
    the ext4 journal, and other (metadata written in place, the daemon's state files). A SQLite
    database's journal (its WAL, `-wal`, or its rollback journal, `-journal`; coalescefs keeps
    either after a clean stop) and shared-memory file (`-shm`) are sorted apart from the
    database file, which counts as data."""
    if writes is None:
        return None
    data, journal, shm, log = [], [], [], []
    for root, dirs, files in os.walk(store.data):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                (journal if name.endswith(("-wal", "-journal")) else shm if name.endswith("-shm") else data).extend(fiemap(path))
    if os.path.exists(store.log_path()):
        log = fiemap(store.log_path())
    regions = {"data": data, "sqlite_journal": journal, "sqlite_shm": shm, "log": log, "journal": journal_ranges(store.dev)}
    sorted_bytes = sort_writes(writes, regions)
    sorted_bytes["traced"] = sum(length for _, length in writes)
    return sorted_bytes


class Store:
    """A loop device with a fresh ext4 mounted at work/store; with `log_device_mib`, beside it a
    second loop device of the same sector size, zeros, for coalescefs's intent log
    (`log=DEVICE` in a system's options is replaced by its path). `counters()` sums both."""

    def __init__(self, work, size_mib, sector=4096, log_device_mib=0):
        self.work = work
        self.log_dev = None
        if log_device_mib:
            log_image = os.path.join(work, "log.img")
            with open(log_image, "wb") as f:
                f.truncate(log_device_mib << 20)
            self.log_dev = sh("losetup", "--direct-io=on", "--sector-size", str(sector), "-f", "--show",
                              log_image, capture=True).strip()
            cleanups.append(lambda: sh("losetup", "-d", self.log_dev, check=False))
        self.image = os.path.join(work, "store.img")
        with open(self.image, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size_mib << 20)
        self.dev = sh("losetup", "--direct-io=on", "--sector-size", str(sector), "-f", "--show",
                      self.image, capture=True).strip()
        cleanups.append(self.close)
        sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.dev)
        self.mnt = os.path.join(work, "store")
        os.makedirs(self.mnt, exist_ok=True)
        sh("mount", self.dev, self.mnt)
        self.data = os.path.join(self.mnt, "data")
        os.makedirs(self.data, exist_ok=True)
        # coalescefs's state directory (the intent log, with it on) on the measured device,
        # beside the data, so that the log's bytes count.
        self.state = os.path.join(self.mnt, "state")
        # The coalescefs build last mounted over this store (a system's `bin=`), which forgets
        # its mounts at close: the default build may not be the one that ran, or not be built.
        self.bin = BIN

    def log_path(self):
        return os.path.join(self.state, "intent.log")

    def counters(self):
        """diskstats of the store's device, plus the log device's where there is one."""
        counted = diskstats(self.dev)
        if self.log_dev:
            for k, v in diskstats(self.log_dev).items():
                counted[k] += v
        return counted

    def close(self):
        # coalescefs's runtime directory (the daemon's log) of a mount of this store, in
        # /run/coalescefs; its state directory is on the store and goes with it.
        if os.path.isdir(self.data):
            sh(self.bin, "forget", "--discard", "--state", self.state, self.data, check=False)
            database = os.path.join(self.data, "tree.db")
            if os.path.exists(database):
                sh(self.bin, "forget", "--discard", "--state", self.state, "sqlite:" + database, check=False)
        if sh("umount", self.mnt, check=False).returncode != 0:
            sh("umount", "-l", self.mnt, check=False)
        sh("losetup", "-d", self.dev, check=False)
        if os.path.exists(self.image):
            os.unlink(self.image)


class System:
    """Where the workload writes: the store itself, or a FUSE mount of it."""

    def __init__(self, kind, store, options=()):
        # `bin=PATH` among the options: that coalescefs build for this system (bench/ab's A/B of
        # two builds in one run, interleaved); not a mount option.
        builds = [o[len("bin="):] for o in options if o.startswith("bin=")]
        self.bin = builds[-1] if builds else BIN
        self.kind, self.store = kind, store
        self.options = [o for o in options if not o.startswith("bin=")]
        self.path = store.data
        self.fuse_mnt = os.path.join(store.work, "mnt")

    def source(self):
        """What coalescefs mounts: the store's directory, or with `store=sqlite` in the options a
        database file in it (`sqlite:PATH`)."""
        if "store=sqlite" in self.options:
            return "sqlite:" + os.path.join(self.store.data, "tree.db")
        return self.store.data

    def mount(self):
        cleanups.append(self.unmount)
        if self.kind == "native":
            self.path = self.store.data
            return
        if self.kind == "pmxcfs-style":
            # No mount: the emulation's database in the store's directory (bench/lib/pmxcfs.py).
            self.emulated = PmxcfsStyle(os.path.join(self.store.data, "config.db"))
            self.path = self.store.data
            return
        os.makedirs(self.fuse_mnt, exist_ok=True)
        if self.kind == "bindfs":
            sh("bindfs", self.store.data, self.fuse_mnt)
        else:
            options = [f"log={self.store.log_dev}" if o == "log=DEVICE" else o for o in self.options
                       if o != "store=sqlite"]
            options.append("state=" + self.store.state)
            restore = uring_enabled_while_mounting() if "transport=uring" in options else None
            self.store.bin = self.bin
            try:
                sh(self.bin, "mount", self.source(), self.fuse_mnt, "-o", ",".join(options))
            finally:
                if restore:
                    restore()
        self.path = self.fuse_mnt

    def unmount(self):
        if self.kind == "pmxcfs-style":
            # The last connection's close checkpoints the WAL into the database: counted.
            if getattr(self, "emulated", None):
                self.emulated.close()
                self.emulated = None
        elif self.kind == "bindfs":
            if sh("umount", self.fuse_mnt, check=False).returncode != 0:
                sh("umount", "-l", self.fuse_mnt, check=False)
        elif self.kind == "coalescefs":
            if sh(self.bin, "umount", self.fuse_mnt, check=False).returncode != 0:
                sh(self.bin, "umount", "--lazy", self.fuse_mnt, check=False)

    def checkpoint(self):
        """Everything acknowledged so far written to the store (the file system's own sync is
        the caller's): `coalescefs sync` checkpoints the intent log or flushes the buffer."""
        if self.kind == "coalescefs":
            sh(self.bin, "sync", self.fuse_mnt)

    def daemon_pid(self):
        return int(self.stats()["daemon_pid"])

    def stats(self):
        if self.kind != "coalescefs":
            return {}
        out = sh(self.bin, "stats", self.fuse_mnt, capture=True, check=False) or ""
        stats = {}
        for line in out.splitlines():
            w = line.split()
            if len(w) == 2:
                try:
                    stats[w[0]] = float(w[1])
                except ValueError:
                    pass
        return stats


def measured(system, store, work_fn, prepare_fn=None, sample_rss=False, trace=None, checkpoint=False):
    """Runs prepare (uncounted), remounts cold, then counts the device around work_fn; with a
    WriteTrace, also sorts the bytes written by where they land. Counted to the end of the
    unmount; with `checkpoint`, counted to the end of a checkpoint instead (`coalescefs sync`,
    then the file system's sync), and the unmount's bytes, a cost per mount rather than per
    file, are kept apart in unmount_write_bytes."""
    system.mount()
    if prepare_fn:
        prepare_fn(system.path)
        system.unmount()
        cleanups.remove(system.unmount)
        drop_caches()
        system.mount()
    drop_caches()
    # Names and inodes are looked up before counting starts: what is counted is data, and a
    # read counted below is one the write path caused.
    for name in os.listdir(system.path):
        os.stat(os.path.join(system.path, name))
    # The first connect to the daemon's control socket updates the socket's atime (relatime),
    # one journal commit per mount; `coalescefs stats` and `sync` below would otherwise pay it
    # inside the count.
    system.stats()
    os.sync()
    sampler = RssSampler(system.daemon_pid()) if sample_rss else None
    if trace:
        trace.start()
    before = diskstats(store.dev)
    t0 = time.monotonic()
    result = work_fn(system.path) or {}
    elapsed = time.monotonic() - t0
    # Reads are counted up to the end of the work: the unmount afterwards touches the daemon's
    # state directory (its log), whose directory blocks were dropped from the cache.
    read_during_work = diskstats(store.dev)["read_bytes"] - before["read_bytes"]
    stats = system.stats()
    if sampler:
        result["rss"] = sampler.stop()
    if checkpoint:
        system.checkpoint()
        drop_caches()
        counted = diskstats(store.dev)
        writes = trace.stop() if trace else None
    system.unmount()
    cleanups.remove(system.unmount)
    drop_caches()
    after = diskstats(store.dev)
    if not checkpoint:
        counted = after
        writes = trace.stop() if trace else None
    if trace:
        result["where"] = where_bytes_went(store, writes)
    result.update({k: counted[k] - before[k] for k in ("read_bytes", "write_bytes", "reads", "writes")})
    result["unmount_write_bytes"] = after["write_bytes"] - counted["write_bytes"]
    result["read_bytes_during_work"] = read_during_work
    result["seconds"] = elapsed
    result["engine"] = stats
    return result


class RssSampler:
    """The daemon's resident memory every 50 ms, as (seconds, bytes)."""

    def __init__(self, pid):
        self.pid, self.samples, self.done = pid, [], threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    rss = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
                self.samples.append((time.monotonic() - self.t0, rss))
            except (OSError, StopIteration):
                pass
            self.done.wait(0.05)

    def stop(self):
        self.done.set()
        self.thread.join()
        return self.samples


def run_cleanups():
    for stack in (cleanups, cleanups_global):
        while stack:
            try:
                stack.pop()()
            except Exception:
                pass
