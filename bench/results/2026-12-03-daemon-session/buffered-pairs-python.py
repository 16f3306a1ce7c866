import sys, os, tempfile
sys.path.insert(0, '/work/main/bench/lib')
import cases
from stores import raise_max_pages
print("self ag", open('/proc/self/autogroup').read().strip())
restore = raise_max_pages(4096)
try:
    for rep in range(4):
        for own in ((True, False) if rep % 2 == 0 else (False, True)):
            work = tempfile.mkdtemp(prefix="srvtest-", dir="/var/tmp")
            s = cases.Server(work, "coalescefs", "dev", cases.TRANSPORT_WRITE_OPTIONS["coalescefs"], own_session=own)
            ag = open(f'/proc/{s.pid}/autogroup').read().strip()
            r = cases.fio(os.path.join(s.mnt, "f"), rw="write", bs="1m", size="1024m", ioengine="psync", direct=0, end_fsync=1)
            print(rep, "own" if own else "mounter", ag, int(r["bw_bytes"]/1e6), "MB/s writer cpu", round(r["client_cpu_s"],2))
            s.unmount()
finally:
    restore()
