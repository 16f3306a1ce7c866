#!/usr/bin/python3
"""bench/run's perfile case for a subset of its systems, one repetition: python3 perfile-subset.py "coalescefs;coalescefs sqlite;coalescefs sqlite rollback;pmxcfs-style" (as root, from this directory; COALESCEFS_BIN= for a build). Writes perfile-results.json, prints the tables."""
import sys, os, json, tempfile, shutil
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "lib"))
from stores import cleanups, run_cleanups
from cases import case_perfile, PERFILE_SYSTEMS, PERFILE_STORES
from report import perfile_tables
want = sys.argv[1].split(";")
systems = [(n, o) for n, o in PERFILE_SYSTEMS + PERFILE_STORES if n in want]
out = {}
try:
    for label, run in case_perfile([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], False, (512, 4096), systems):
        work = tempfile.mkdtemp(prefix="pf-", dir="/var/tmp")
        try:
            out[label] = run(work)
        finally:
            while cleanups:
                cleanups.pop()()
            shutil.rmtree(work, ignore_errors=True)
        print(label, "done", flush=True)
        json.dump(out, open("perfile-results.json", "w"))
finally:
    run_cleanups()
print("\n".join(perfile_tables({"perfile": out})))
