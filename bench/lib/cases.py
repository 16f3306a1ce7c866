"""The benchmark cases of bench/run: each case's workload and its configurations, the rows of
its table, as (label, run) pairs; run(work) measures one repetition in the scratch directory
`work` and returns its numbers (a dict, or a dict of rows).
"""
import json, os, random, subprocess, sys, time

from pmxcfs import config_prepare, config_rewrites, config_tree
from stores import (BIN, ENABLE_URING, REPO, SINK, Store, System, WriteTrace, cleanups, cleanups_global, diskstats,
                    drop_caches, measured, raise_max_pages, sh, uring_enabled_while_mounting)


def fio(path, **params):
    """One fio job (or `numjobs` of them, reported as a group); `path` is a file, or a
    directory when `numjobs` is given."""
    args = ["fio", "--output-format=json", "--name=job", "--group_reporting=1",
            "--percentile_list=50:99:99.9:100"]
    args.append(f"--directory={path}" if "numjobs" in params else f"--filename={path}")
    args += [f"--{k}={v}" for k, v in params.items()]
    out = json.loads(sh(*args, capture=True))
    whole = out["jobs"][0]
    job = whole["write"]
    pct = job.get("clat_ns", {}).get("percentile", {})
    # The writer's own CPU (user + system: the copy into the kernel's FUSE request is system
    # time of the writer), from fio's percentages of the job's run time.
    client_cpu_s = (whole.get("usr_cpu", 0) + whole.get("sys_cpu", 0)) / 100 * whole.get("job_runtime", 0) / 1000
    return {"bw_bytes": job["bw_bytes"], "runtime_ms": job["runtime"] or 1, "client_cpu_s": client_cpu_s,
            "clat_us": {k: pct.get(v, 0) / 1000 for k, v in
                        (("p50", "50.000000"), ("p99", "99.000000"), ("p99.9", "99.900000"), ("max", "100.000000"))}}



def in_store(name, opts, size_mib, sector, work_fn, prepare_fn=None, app_bytes=0, sample_rss=False):
    """The usual run: a fresh store, one system on it, the work counted."""
    def run(work):
        store = Store(work, size_mib, sector)
        system = System("coalescefs" if name.startswith("coalescefs") else name, store, opts)
        r = measured(system, store, work_fn, prepare_fn, sample_rss)
        r["app_bytes"] = app_bytes
        store.close(); cleanups.remove(store.close)
        return r
    return run


# The issue-3 comparison: coalescefs with the kernel writeback cache in each of its modes.
SYSTEMS = [("native", []), ("bindfs", []), ("coalescefs", []), ("coalescefs+wbc", ["writeback_cache=on"]),
           ("coalescefs+nowbc", ["writeback_cache=off"])]
BASELINES = [("native", []), ("bindfs", []), ("coalescefs", [])]


def case_seq(bs, size_mib):
    work = lambda p: fio(os.path.join(p, "f"), rw="write", bs=bs, size=f"{size_mib}m", ioengine="psync", end_fsync=1)
    return [(name, in_store(name, opts, size_mib * 2 + 256, 4096, work, app_bytes=size_mib << 20)) for name, opts in SYSTEMS]


def case_rand512(size_mib, total_mib):
    """Seed 003: 512-byte random writes into a cold file on a 512-byte-sector device; the
    writeback-cache modes buffered, the baselines also with O_DIRECT and an fsync every 100."""
    prep = lambda p: fio(os.path.join(p, "f"), rw="write", bs="1m", size=f"{size_mib}m", ioengine="psync", end_fsync=1)
    configs = []
    variants = [("buffered", {}), ("O_DIRECT", {"direct": 1}), ("buffered, fsync/100", {"fsync": 100}),
                ("O_DIRECT, fsync/100", {"direct": 1, "fsync": 100})]
    # With the intent log (the default) fsyncs of the existing file go to the log; without it,
    # to the backend.
    with_log = BASELINES + [("coalescefs log=off", ["log=off"])]
    for label, extra in variants:
        for name, opts in (SYSTEMS if label == "buffered" else with_log if "fsync" in label else BASELINES):
            work = lambda p, extra=extra: fio(os.path.join(p, "f"), rw="randwrite", bs=512, size=f"{size_mib}m",
                                              io_size=f"{total_mib}m", ioengine="psync", end_fsync=1, randseed=1234, **extra)
            configs.append((f"{name} | {label}", in_store(name, opts, size_mib * 2 + 256, 512, work, prep, total_mib << 20)))
    return configs


def case_smallfiles(sizes_kib, quick, systems=None, patterns=("8k", "one", "rename")):
    """Seed 000's steady state: for each size, N new files written in 8 KiB pieces, in one
    piece, and as tmp + rename over an existing file, each fsynced; device bytes per file byte.
    One store per system and repetition; each (size, pattern) phase counted on its own."""
    # With the intent log, a new file's fsync logs its name and bytes; `coalescefs sync` at the
    # end of each phase is the checkpoint that writes them to the backend, and is counted. The
    # unmount after it is counted apart: it is paid once per mount, not per file.
    systems = systems or BASELINES + [("coalescefs log=off", ["log=off"])]
    def count_for(kib):
        n = 200 if kib <= 16 else (50 if kib <= 256 else 20)
        return max(n // 10, 5) if quick else n

    def write_files(path, kib, pattern):
        size, n = kib * 1024, count_for(kib)
        data = os.urandom(size)
        step = size if pattern == "one" else 8192
        for i in range(n):
            final = os.path.join(path, f"f{kib}-{pattern}-{i}")
            name = final + ".tmp" if pattern == "rename" else final
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for off in range(0, size, step):
                os.write(fd, data[off:off + step])
            os.fsync(fd)
            os.close(fd)
            if pattern == "rename":
                os.rename(name, final)

    def existing(path, kib, pattern):
        # tmp + rename replaces a file that is already there, as an editor or pmxcfs does.
        if pattern == "rename":
            for i in range(count_for(kib)):
                with open(os.path.join(path, f"f{kib}-{pattern}-{i}"), "wb") as f:
                    f.write(b"old")

    def run_for(name, opts):
        def run(work):
            total = sum(3 * count_for(k) * k for k in sizes_kib) // 1024
            store = Store(work, 512 + 2 * total, 4096)
            trace = WriteTrace(store.dev)
            rows = {}
            for kib in sizes_kib:
                for pattern in patterns:
                    system = System("coalescefs" if name.startswith("coalescefs") else name, store, opts)
                    r = measured(system, store, lambda p: write_files(p, kib, pattern), lambda p: existing(p, kib, pattern),
                                 trace=trace, checkpoint=True)
                    r["app_bytes"] = count_for(kib) * kib * 1024
                    r["files"] = count_for(kib)
                    rows[f"{kib}K/{pattern}"] = r
            trace.close(); cleanups.remove(trace.close)
            store.close(); cleanups.remove(store.close)
            return rows
        return run
    return [(name, run_for(name, opts)) for name, opts in systems]


PERFILE_PATTERNS = ("new-8k", "new-one", "rename-8k", "rename-one", "trunc-8k", "trunc-one")


# coalescefs as users get it (the intent log on, a file in the state directory, here on the
# measured device), without the log, and with the log on a block device of its own (counted
# with the store's): checkpoints held off while files are measured, then measured apart.
PERFILE_SYSTEMS = [("native", []), ("coalescefs", ["checkpoint_interval=3600s"]), ("coalescefs log=off", ["log=off"]),
                   ("coalescefs log device", ["log=DEVICE", "checkpoint_interval=3600s"])]
LOG_DEVICE_MIB = 80
# Issue 43: the SQLite backend (its database file on the measured device, the log beside it) and
# the pmxcfs-style baseline (bench/lib/pmxcfs.py), in the per-file table only: the other cases'
# workloads are a mount's.
PERFILE_STORES = [("coalescefs sqlite", ["store=sqlite", "checkpoint_interval=3600s"]),
                  ("coalescefs sqlite rollback", ["store=sqlite", "sqlite_journal=rollback", "checkpoint_interval=3600s"]),
                  ("pmxcfs-style", [])]


def case_perfile(sizes_kib, quick, sectors=(512, 4096), systems=None):
    """Seed 000's own method, one file at a time: `sync`, drop caches, read the device's
    counters; write the file as `dd` does (opened, closed once empty as dd's dup2 onto its
    standard output does, then 8 KiB pieces or one write, and closed), no fsync;
    `sync`, drop caches, read again. Six patterns: a new file, tmp + rename over an existing
    file, and an existing file rewritten in place with O_TRUNC, each in 8 KiB pieces and in one
    write. The median file's device bytes per (size, pattern), on a device of 512-byte and of
    4 KiB sectors. `sync` does not reach a FUSE daemon: for coalescefs the close is its
    durability point (with the log, a log write, which `sync` flushes), and what the backing file
    system writes at `sync` is counted. The checkpoint that makes the files plain backend files
    (`coalescefs sync`, then `sync`) is counted apart, per file, after each pattern's files, and
    so is the unmount after it (where a SQLite WAL's pages reach the database file)."""
    systems = systems or PERFILE_SYSTEMS + PERFILE_STORES
    files = 3 if quick else 7

    def write_one(path, name, data, pattern):
        kind, pieces = pattern.split("-")
        target = os.path.join(path, name)
        written = target + ".tmp" if kind == "rename" else target
        step = 8192 if pieces == "8k" else max(len(data), 1)
        opened = os.open(written, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        # GNU dd opens `of=` onto its standard output (fd_reopen: open, dup2, close the first
        # descriptor): the file is closed once, empty, before dd writes a byte, and a FUSE file
        # system sees that close (FLUSH). The seed's writer is dd, so this does the same.
        fd = os.dup(opened)
        os.close(opened)
        try:
            for off in range(0, len(data), step):
                os.write(fd, data[off:off + step])
        finally:
            os.close(fd)
        if kind == "rename":
            os.rename(written, target)

    def run_for(name, opts, sector):
        def run(work):
            total_mib = sum(2 * files * k for k in sizes_kib) * len(PERFILE_PATTERNS) // 1024
            log_device = LOG_DEVICE_MIB if "log=DEVICE" in opts else 0
            store = Store(work, 256 + total_mib, sector, log_device)
            rows = {}
            for kib in sizes_kib:
                data = os.urandom(kib * 1024)
                for pattern in PERFILE_PATTERNS:
                    system = System("coalescefs" if name.startswith("coalescefs") else name, store, opts)
                    system.mount()
                    names = [f"f{kib}-{pattern}-{i}" for i in range(files)]
                    emulated = system.kind == "pmxcfs-style"
                    if not pattern.startswith("new"):
                        # Rename and rewrite in place act on files that exist, as an editor's or
                        # pmxcfs's do, made before the mount that is measured.
                        for n in names:
                            if emulated:
                                system.emulated.write_file(n, os.urandom(kib * 1024))
                                continue
                            with open(os.path.join(system.path, n), "wb") as f:
                                f.write(os.urandom(kib * 1024))
                        system.unmount(); cleanups.remove(system.unmount)
                        system.mount()
                    per_file = []
                    t0 = time.monotonic()
                    for n in names:
                        os.sync(); drop_caches()
                        before = store.counters()
                        if emulated:
                            # FUSE splits pmxcfs's writes at 4 KiB, whatever the pieces.
                            system.emulated.write_file(n, data, "rename" if pattern.startswith("rename") else "new")
                        else:
                            write_one(system.path, n, data, pattern)
                        os.sync(); drop_caches()
                        per_file.append(store.counters()["write_bytes"] - before["write_bytes"])
                    elapsed = time.monotonic() - t0
                    engine = system.stats()
                    before = store.counters()
                    system.checkpoint()
                    os.sync(); drop_caches()
                    checkpoint_per_file = (store.counters()["write_bytes"] - before["write_bytes"]) / files
                    # And the unmount: what a checkpoint left for later (a SQLite WAL's frames,
                    # copied into the database file at SQLite's own checkpoint) is these files'.
                    before = store.counters()
                    system.unmount(); cleanups.remove(system.unmount)
                    os.sync(); drop_caches()
                    unmount_per_file = (store.counters()["write_bytes"] - before["write_bytes"]) / files
                    per_file.sort()
                    rows[f"{kib}K/{pattern}"] = {"seconds": elapsed, "write_bytes": per_file[len(per_file) // 2],
                                                 "per_file": per_file, "app_bytes": kib * 1024, "sector": sector,
                                                 "checkpoint_bytes_per_file": checkpoint_per_file,
                                                 "unmount_bytes_per_file": unmount_per_file,
                                                 "read_bytes_during_work": 0, "engine": engine}
            store.close(); cleanups.remove(store.close)
            return rows
        return run
    return [(f"{name} | {sector}", run_for(name, opts, sector)) for sector in sectors for name, opts in systems]


# Native ext4 twice: with a `sync` after every file, as seed 000's writers make each file durable
# (coalescefs does that at every close, through its log), and with one `sync` at the end, its
# best case, which makes nothing durable until then.
# And every close logged (`log_closes=always`): what the log's second copy of a burst's bytes costs.
# The SQLite backend too (issue 43: its steady state below native ext4's up to 64 KiB).
STEADY_SYSTEMS = [("native, sync per file", ["sync-per-file"]), ("native, one sync", [])] + PERFILE_SYSTEMS[1:] + \
    [("coalescefs log_closes=always", ["checkpoint_interval=3600s", "log_closes=always"]),
     ("coalescefs sqlite", ["store=sqlite", "checkpoint_interval=3600s"]),
     ("coalescefs sqlite rollback", ["store=sqlite", "sqlite_journal=rollback", "checkpoint_interval=3600s"])]


def case_steady(sizes_kib, quick, sectors=(512, 4096), systems=None):
    """Seed 000's steady state: N new files written as `dd` does (8 KiB pieces) and closed, then
    what makes them durable plain files on the store (for coalescefs the checkpoint, `coalescefs
    sync`, then `sync`; natively `sync`): every device byte over N x size, on 512-byte and 4 KiB
    sectors."""
    systems = systems or STEADY_SYSTEMS

    def count_for(kib):
        n = 200 if kib <= 16 else (50 if kib <= 256 else 20)
        return max(n // 10, 5) if quick else n

    def run_for(name, opts, sector):
        def run(work):
            total_mib = sum(count_for(k) * k for k in sizes_kib) // 1024
            store = Store(work, 256 + 2 * total_mib, sector, LOG_DEVICE_MIB if "log=DEVICE" in opts else 0)
            rows = {}
            for kib in sizes_kib:
                n, data = count_for(kib), os.urandom(kib * 1024)
                sync_per_file = "sync-per-file" in opts
                system = System("coalescefs" if name.startswith("coalescefs") else "native", store,
                                [o for o in opts if o != "sync-per-file"])
                system.mount()
                os.sync(); drop_caches()
                before = store.counters()
                t0 = time.monotonic()
                for i in range(n):
                    fd = os.open(os.path.join(system.path, f"s{kib}-{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    for off in range(0, len(data), 8192):
                        os.write(fd, data[off:off + 8192])
                    os.close(fd)
                    if sync_per_file:
                        os.sync()
                elapsed = time.monotonic() - t0
                system.checkpoint()
                os.sync(); drop_caches()
                after = store.counters()
                engine = system.stats()
                system.unmount(); cleanups.remove(system.unmount)
                rows[f"{kib}K"] = {"seconds": elapsed, "write_bytes": after["write_bytes"] - before["write_bytes"],
                                   "read_bytes_during_work": after["read_bytes"] - before["read_bytes"],
                                   "app_bytes": n * kib * 1024, "files": n, "sector": sector, "engine": engine}
            store.close(); cleanups.remove(store.close)
            return rows
        return run
    return [(f"{name} | {sector}", run_for(name, opts, sector)) for sector in sectors for name, opts in systems]


APPS_DIR = os.path.join(REPO, "tests", "apps")


def case_apps(entries, quick):
    """Real applications, the steps of tests/apps/run, timed: a generated source tree of
    `entries` entries extracted with tar, committed and reworked with git, SQLite inserts in
    WAL mode with synchronous=FULL (a second process reading), rsync of the tree, a parallel C
    build, and rm -rf of it all. Per step: seconds, and device bytes of the step and the sync
    after it (`coalescefs sync`, then `sync`; the sync is not timed), and the intent log's
    batches."""
    sys.path.insert(0, APPS_DIR)
    import workload
    # bindfs is the FUSE reference: a mature libfuse passthrough pays the same kernel round
    # trips per operation, so it shows how much of the gap to native any FUSE server has.
    # The intent log is on by default; without it is the other write path; every close logged
    # (`log_closes=always`, the default before `auto`) shows what logging a burst's closes costs.
    systems = [("native", []), ("bindfs", []), ("coalescefs", []), ("coalescefs log=off", ["log=off"]),
               ("coalescefs log_closes=always", ["log_closes=always"]),
               # Issue 45: the same over FUSE over io_uring (where the kernel has it).
               ("coalescefs uring", ["transport=uring"]),
               # Not run unless asked for (BENCH_APPS_SYSTEMS): what the kernel's
               # security.capability questions cost (two of tar's ~11 requests per entry).
               ("coalescefs xattr=off", ["xattr=off"]),
               # Not run unless asked for: the daemon in a session of its own, another scheduling
               # group than the applications' under the kernel's autogroups.
               ("coalescefs session=own", ["session=own"]),
               ("coalescefs uring session=own", ["transport=uring", "session=own"])]
    # BENCH_APPS_SYSTEMS="native,coalescefs,coalescefs log=off": some of them only (bindfs and
    # every close logged take half of the case's 37 minutes).
    only = os.environ.get("BENCH_APPS_SYSTEMS")
    if only:
        systems = [s for s in systems if s[0] in only.split(",")]
    else:
        systems = [s for s in systems if s[0] not in ("coalescefs xattr=off", "coalescefs session=own",
                                                      "coalescefs uring session=own")]
        assert any(name == "native" for name, _ in systems), "the apps case compares with native: keep it"
    if not os.path.exists(ENABLE_URING) and any(name == "coalescefs uring" for name, _ in systems):
        print(f"bench: apps: no {ENABLE_URING} (a kernel without CONFIG_FUSE_IO_URING): io_uring not measured",
              file=sys.stderr)
        systems = [s for s in systems if "uring" not in s[0]]
    transactions = 100 if quick else 1000
    # BENCH_APPS_STEPS="tar extract,rsync,rm -rf": some steps only (issue 45's three take a
    # fifth of the suite's time; git's two most of the rest).
    steps = os.environ.get("BENCH_APPS_STEPS")
    steps = steps.split(",") if steps else None

    def run_for(name, opts):
        def run(work):
            src, tarball = os.path.join(work, "src"), os.path.join(work, "tree.tar")
            workload.make_tree(src, entries)
            workload.make_tarball(src, tarball)
            tree_mib = int(sh("du", "-sm", src, capture=True).split()[0])
            store = Store(work, 1024 + 6 * tree_mib, 4096)
            system = System("coalescefs" if name.startswith("coalescefs") else name, store, opts)
            system.mount()
            rows = {}

            def step(label, fn):
                if steps is not None and label not in steps:
                    return
                os.sync()
                before, engine_before = diskstats(store.dev), system.stats()
                t0 = time.monotonic()
                try:
                    fn()
                except RuntimeError as e:
                    # The reference may fail where coalescefs must not (bindfs breaks git's
                    # view of hard links): its step is reported as failed, the rest goes on.
                    if name != "bindfs":
                        raise
                    print(f"apps: {name}: {label} failed: {str(e)[-300:]}", file=sys.stderr)
                    rows[label] = {"failed": True, "seconds": float("nan"), "write_bytes": 0, "read_bytes_during_work": 0}
                    return
                elapsed = time.monotonic() - t0
                system.checkpoint()
                os.sync()
                after, engine_after = diskstats(store.dev), system.stats()
                row = {k: after[k] - before[k] for k in ("read_bytes", "write_bytes", "reads", "writes")}
                row["seconds"] = elapsed
                row["read_bytes_during_work"] = row["read_bytes"]
                row["engine"] = {k: v - engine_before.get(k, 0) for k, v in engine_after.items() if k.endswith("_total")}
                rows[label] = row

            root = system.path
            tree = os.path.join(root, "tree")
            step("tar extract", lambda: workload.extract(tarball, tree))
            step("git commit", lambda: workload.git_commit_tree(tree))
            step("git rework", lambda: workload.git_rework(tree))
            step("sqlite inserts", lambda: workload.sqlite_inserts(os.path.join(root, "db.sqlite"), transactions, 10))
            step("rsync", lambda: workload.rsync(src, os.path.join(root, "copy")))
            if steps is None or "make -j4" in steps:
                workload.make_c_project(os.path.join(root, "build"))
            step("make -j4", lambda: workload.c_build(os.path.join(root, "build")))
            step("rm -rf", lambda: [workload.remove_tree(os.path.join(root, d)) for d in os.listdir(root)])
            system.unmount(); cleanups.remove(system.unmount)
            store.close(); cleanups.remove(store.close)
            return rows
        return run
    return [(name, run_for(name, opts)) for name, opts in systems]


def case_requestsize(quick):
    """Seed 001: throughput against the FUSE request size, unit 4 MiB, max_pages_limit raised.
    The null backend is the ceiling; the local backend shows whole units whatever the request."""
    sizes = ["128k", "16m"] if quick else ["128k", "256k", "1m", "4m", "16m"]
    total_mib = 64 if quick else 1024
    configs = []
    for store_kind in ("null", "local"):
        for jobs in (1, 4):
            for direct in (1, 0):
                for max_write in sizes:
                    opts = [f"backend={store_kind}", "unit=4M", f"max_write={max_write}"]
                    work = lambda p, jobs=jobs, direct=direct: fio(
                        p, rw="write", bs="16m", size=f"{total_mib // jobs}m", numjobs=jobs, direct=direct,
                        ioengine="psync", end_fsync=1, filename_format="f.$jobnum")
                    label = f"{store_kind} | {jobs} | {'O_DIRECT' if direct else 'buffered'} | {max_write}"
                    configs.append((label, in_store("coalescefs", opts, total_mib + 512, 4096, work, app_bytes=total_mib << 20)))
    return configs


def mixed_image(path, size_mib):
    """Thirds of zeros, text and random bytes, in 1 MiB stripes."""
    text = b"".join(f"line {i}: the quick brown fox jumps over the lazy dog\n".encode() for i in range(20000))
    with open(path, "wb") as f:
        for i in range(size_mib):
            kind = i % 3
            chunk = bytes(1 << 20) if kind == 0 else (text[(i * 7919) % 100000:][:1 << 20] if kind == 1 else os.urandom(1 << 20))
            f.write(chunk.ljust(1 << 20, b"."))


def case_qcow2(size_mib):
    """Seed 002: qemu-img convert -c -O qcow2 of a mixed image; time, device bytes, and the page
    cache the output leaves behind (fincore), as the application and as the backend see it."""
    source = f"/dev/shm/coalescefs-bench-source-{size_mib}.img"

    def convert(cache):
        def work(p):
            if not os.path.exists(source):
                mixed_image(source, size_mib)
                cleanups_global.append(lambda: os.path.exists(source) and os.unlink(source))
            target = os.path.join(p, "out.qcow2")
            sh("qemu-img", "convert", "-c", "-O", "qcow2", "-t", cache, source, target)
            r = {"output_bytes": os.path.getsize(target), "cached_bytes": fincore(target)}
            # Under a FUSE mount (work/mnt), the backend's copy (work/store/data) has its own.
            backing = os.path.join(os.path.dirname(p), "store", "data", "out.qcow2")
            r["backend_cached_bytes"] = fincore(backing) if os.path.basename(p) == "mnt" else None
            return r
        return work

    return [(f"{name} | -t {cache}", in_store(name, [], size_mib + 512, 4096, convert(cache), app_bytes=size_mib << 20))
            for name, cache in (("native", "writeback"), ("native", "none"), ("coalescefs", "none"))]


def fincore(path):
    out = sh("fincore", "--bytes", "--noheadings", "--output", "RES", path, capture=True, check=False) or "0"
    try:
        return int(out.split()[0])
    except (ValueError, IndexError):
        return 0


def case_flushers(size_mib):
    """Seed 004: one sequential writer of 1 MiB writes; native buffered and O_DIRECT against
    coalescefs with 1, 2, 4 and 8 flushers."""
    seq = lambda **extra: (lambda p: fio(os.path.join(p, "f"), rw="write", bs="1m", size=f"{size_mib}m",
                                         ioengine="psync", end_fsync=1, **extra))
    configs = [("native buffered", in_store("native", [], size_mib + 512, 4096, seq(), app_bytes=size_mib << 20)),
               ("native O_DIRECT", in_store("native", [], size_mib + 512, 4096, seq(direct=1), app_bytes=size_mib << 20))]
    for n in (1, 2, 4, 8):
        configs.append((f"coalescefs flushers={n}",
                        in_store("coalescefs", [f"flushers={n}"], size_mib + 512, 4096, seq(), app_bytes=size_mib << 20)))
    return configs


def case_memory(size_mib, writers=4):
    """4 writers with -o buffer=64M, writing 4 KiB pieces (partial units held in memory): the
    daemon's resident memory over time."""
    work = lambda p: fio(p, rw="write", bs="4k", size=f"{size_mib}m", numjobs=writers, ioengine="psync",
                         end_fsync=1, filename_format="f.$jobnum")
    return [("coalescefs buffer=64M", in_store("coalescefs", ["buffer=64M", "writeback_cache=off"], writers * size_mib + 512,
                                               4096, work, app_bytes=writers * size_mib << 20, sample_rss=True))]


def per_request_us(path, count):
    """Microseconds per fstat of an open file and per stat of its name, in this process (the
    loop's own cost, about 0.3 us in Python, is in every row alike)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(200):
            os.fstat(fd)
        started = time.perf_counter()
        for _ in range(count):
            os.fstat(fd)
        fstat_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(count // 4):
            os.stat(path)
        stat_s = time.perf_counter() - started
    finally:
        os.close(fd)
    return fstat_s, fstat_s / count * 1e6, stat_s / (count // 4) * 1e6


def process_cpu_s(pid):
    """User + system CPU seconds of a process, all its threads, so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """One FUSE server for the transport case, mounted at work/mnt: coalescefs (`coalescefs
    mount`, a backing directory in work) or the null sink (`coalescefs-null-sink`, in the
    foreground, stopped by unmounting). `enable_uring` is on only while it mounts.

    `own_session`: the server in a session of its own (`setsid`); otherwise in the benchmark's,
    the client's, where coalescefs's daemon stays by default (`session=mounter`). With the
    kernel's autogroups on (`kernel.sched_autogroup_enabled`, Debian's default) a session is a
    scheduling group, and over io_uring a client in another group than the server is moved off
    the server's CPU at nearly every wake-up (fstat 27-46 us against 9.4-15.5 in one group,
    either server; bench/results/2026-11-29-transport-autogroup, 2026-12-03-daemon-session).
    `binary`: another coalescefs build than BIN (bench/builds-large-writes mounts two)."""

    def __init__(self, work, kind, transport, options, binary=None, own_session=False):
        self.kind, self.work, self.binary = kind, work, binary or BIN
        self.mnt, self.backing, self.state = (os.path.join(work, d) for d in ("mnt", "backing", "state"))
        os.makedirs(self.mnt), os.makedirs(self.backing)
        self.sink, self.sink_log = None, os.path.join(work, "sink.log")
        restore = uring_enabled_while_mounting() if transport == "uring" else None
        try:
            if kind == "coalescefs":
                # `setsid` rather than `session=own`: builds before the option (bench/ab,
                # builds-large-writes) take it too, and made a session of their own anyway.
                sh(*(["setsid"] if own_session else []), self.binary, "mount", self.backing, self.mnt, "-o",
                   ",".join([f"transport={transport}", f"state={self.state}"] + options))
                cleanups.append(self.unmount)
                out = sh(self.binary, "stats", self.mnt, capture=True)
                self.transport = next((l.split(":", 1)[1].strip() for l in out.splitlines()
                                       if l.startswith("transport:")), "?")
                self.pid = int(next(l.split()[1] for l in out.splitlines() if l.startswith("daemon_pid ")))
            else:
                with open(self.sink_log, "w") as log:
                    self.sink = subprocess.Popen([SINK, self.mnt, "-o", ",".join([f"transport={transport}"] + options)],
                                                 stdout=subprocess.PIPE, stderr=log, text=True,
                                                 start_new_session=own_session)
                cleanups.append(self.unmount)
                line = self.sink.stdout.readline()
                if not line:
                    raise RuntimeError(f"coalescefs-null-sink did not start: {open(self.sink_log).read().strip()}")
                self.transport = line.split()[-1]
                self.pid = self.sink.pid
        finally:
            if restore:
                restore()

    def ring_requests(self):
        if self.kind == "coalescefs":
            out = sh(self.binary, "stats", self.mnt, capture=True)
            return next((int(l.split()[1]) for l in out.splitlines() if l.startswith("fuse_ring_requests_total ")), 0)
        return None  # the sink says it when it exits: see unmount

    def unmount(self):
        """Unmounts (waiting for the server to exit); the sink's count of ring requests."""
        if self.unmount in cleanups:
            cleanups.remove(self.unmount)
        if self.kind == "coalescefs":
            if sh(self.binary, "umount", self.mnt, check=False).returncode != 0:
                sh(self.binary, "umount", "--lazy", self.mnt, check=False)
            sh(self.binary, "forget", "--discard", "--state", self.state, self.backing, check=False)
            return None
        if sh("umount", self.mnt, check=False).returncode != 0:
            sh("umount", "-l", self.mnt, check=False)
        try:
            self.sink.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.sink.kill()
            self.sink.wait()
        said = open(self.sink_log).read()
        return int(said.split("unmounted; ")[1].split()[0]) if "unmounted; " in said else 0


# The large-write rows: coalescefs with the null backend against the null sink, both asking for
# 16 MiB requests (fs.fuse.max_pages_limit raised to 4096 pages for these runs only).
TRANSPORT_WRITE_OPTIONS = {"coalescefs": ["backend=null", "unit=4M", "max_write=16M"], "null sink": ["max_write=16M"]}


def case_transport(quick):
    """Issue 45: the round trip of one FUSE request and the large-write ceiling, coalescefs
    against the null sink (`coalescefs-null-sink`: the same fuser, transport layer and INIT
    flags, no work), each over /dev/fuse and over io_uring, in one run, interleaved.

    Per request: fstat and stat loops on one file with attribute and name timeouts 0
    (cache_timeout=0), so that every fstat is a GETATTR and every stat a LOOKUP and a GETATTR;
    native ext4 (/var/tmp) beside them. Large writes: fio, 1 job, 1 MiB and 16 MiB writes,
    O_DIRECT and buffered, end_fsync, coalescefs `backend=null` against the sink; MB/s and the
    CPU seconds per GiB of the server (all its threads) and of the writer (fio's user + system)."""
    count = 2000 if quick else 20000
    write_mib = 128 if quick else 1024
    transports = ["dev"]
    if os.path.exists(ENABLE_URING):
        transports.append("uring")
    else:
        print(f"bench: transport: no {ENABLE_URING} (a kernel without CONFIG_FUSE_IO_URING): io_uring not measured",
              file=sys.stderr)

    def per_request(kind, transport, own_session=False):
        def run(work):
            if kind == "native":
                path = os.path.join(work, "f")
                with open(path, "w") as f:
                    f.write("x")
                seconds, fstat_us, stat_us = per_request_us(path, count)
                return {"seconds": seconds, "fstat_us": fstat_us, "stat_us": stat_us, "write_bytes": 0,
                        "read_bytes_during_work": 0}
            server = Server(work, kind, transport, ["cache_timeout=0"], own_session=own_session)
            path = os.path.join(server.mnt, "f")
            with open(path, "w") as f:
                f.write("x")
            seconds, fstat_us, stat_us = per_request_us(path, count)
            ring_requests = server.ring_requests()
            sink_ring_requests = server.unmount()
            return {"seconds": seconds, "fstat_us": fstat_us, "stat_us": stat_us, "write_bytes": 0,
                    "read_bytes_during_work": 0, "transport": server.transport,
                    "ring_requests": ring_requests if ring_requests is not None else sink_ring_requests}
        return run

    def large_write(kind, transport, bs, direct):
        def run(work):
            restore = raise_max_pages(4096)
            try:
                server = Server(work, kind, transport, TRANSPORT_WRITE_OPTIONS[kind])
                cpu_before = process_cpu_s(server.pid)
                r = fio(os.path.join(server.mnt, "f"), rw="write", bs=bs, size=f"{write_mib}m", ioengine="psync",
                        direct=direct, end_fsync=1)
                r["server_cpu_s"] = process_cpu_s(server.pid) - cpu_before
                ring_requests = server.ring_requests()
                sink_ring_requests = server.unmount()
            finally:
                restore()
                cleanups_global.remove(restore)
            r.update({"seconds": (write_mib << 20) / r["bw_bytes"], "app_bytes": write_mib << 20, "write_bytes": 0,
                      "read_bytes_during_work": 0, "transport": server.transport,
                      "ring_requests": ring_requests if ring_requests is not None else sink_ring_requests})
            return r
        return run

    configs = [("per request | native", per_request("native", None))]
    for session in ("", " | own session"):
        for kind in ("coalescefs", "null sink"):
            for transport in transports:
                configs.append((f"per request | {kind} | {transport}{session}",
                                per_request(kind, transport, own_session=bool(session))))
    for bs in ("1m", "16m"):
        for io, direct in (("O_DIRECT", 1), ("buffered", 0)):
            for transport in transports:
                for kind in ("coalescefs", "null sink"):
                    configs.append((f"write | {kind} | {transport} | {bs} | {io}", large_write(kind, transport, bs, direct)))
    return configs


CONFIG_SYSTEMS = [("native", []), ("coalescefs", []), ("coalescefs sqlite", ["store=sqlite"]),
                  ("coalescefs sqlite rollback", ["store=sqlite", "sqlite_journal=rollback"]), ("pmxcfs-style", [])]


def case_configstore(rewrites, systems=None):
    """Issue 43's config-store workload (bench/lib/pmxcfs.py): 400 files of 1-8 KiB in 10
    directories made (uncounted) and the store remounted cold, then `rewrites` rewrites, each a
    temporary file written, fsynced and renamed over the file, one at a time; every byte the
    store's device takes, to the end of the unmount (coalescefs's checkpoint included), per
    rewrite, and rewrites per second. With the defaults (the log on; a checkpoint 30 s after the last record logged, at most 300 s apart)."""
    systems = systems or CONFIG_SYSTEMS

    def run_for(name, opts):
        def run(work):
            store = Store(work, 512, 4096)
            trace = WriteTrace(store.dev)
            system = System("coalescefs" if name.startswith("coalescefs") else name, store, opts)
            tree = config_tree(random.Random(43))
            emulated = lambda: getattr(system, "emulated", None)
            r = measured(system, store, lambda p: {"app_bytes": config_rewrites(p, tree, rewrites, 4300, emulated())},
                         lambda p: config_prepare(p, tree, emulated()), trace=trace)
            r["rewrites"] = rewrites
            trace.close(); cleanups.remove(trace.close)
            store.close(); cleanups.remove(store.close)
            return r
        return run
    return [(name, run_for(name, opts)) for name, opts in systems]
