"""fstat round trips (attr timeout 0) of libfuse's null example, coalescefs's null sink and
coalescefs, over /dev/fuse and io_uring, interleaved; argument: rounds. LIBFUSE: a libfuse
build with io_uring."""
import os, subprocess, sys, tempfile, time
SINK="/work/main/target/release/coalescefs-null-sink"; BIN=os.environ.get("COALESCEFS_BIN","/work/main/target/release/coalescefs")
NULL=os.environ.get("LIBFUSE","/var/tmp/libfuse")+"/build/example/null"
def measure(path, n):
    fd=os.open(path,os.O_RDONLY)
    for _ in range(500): os.fstat(fd)
    t=time.perf_counter()
    for _ in range(n): os.fstat(fd)
    us=(time.perf_counter()-t)/n*1e6; os.close(fd); return us
def one(kind, transport, n=20000):
    work=tempfile.mkdtemp(prefix="fq-",dir="/var/tmp"); mnt=work+"/mnt"; b=work+"/b"; st=work+"/s"
    os.makedirs(b)
    proc=None
    try:
        if kind=="libfuse":
            open(mnt,"w").close()
            args=[NULL,"-f",mnt,"-o","attr_timeout=0"]+(["-o","io_uring"] if transport=="uring" else [])
            if transport=="dev1": args.append("-s")
            proc=subprocess.Popen(args,stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
            for _ in range(100):
                time.sleep(0.05)
                if os.stat(mnt).st_size>0 or os.stat(mnt).st_dev!=os.stat(work).st_dev: break
            return measure(mnt,n)
        os.makedirs(mnt)
        opts=f"transport={transport},cache_timeout=0"
        if kind=="sink":
            proc=subprocess.Popen([SINK,mnt,"-o",opts],stdout=subprocess.PIPE,stderr=subprocess.DEVNULL,text=True); proc.stdout.readline()
        else:
            subprocess.run([BIN,"mount",b,mnt,"-o",opts+",state="+st],check=True)
        p=mnt+"/f"; open(p,"w").write("x")
        return measure(p,n)
    finally:
        if kind=="cfs":
            subprocess.run([BIN,"umount",mnt]); subprocess.run([BIN,"forget","--discard","--state",st,b],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
        else:
            subprocess.run(["umount",mnt]); proc.wait()
open("/sys/module/fuse/parameters/enable_uring","w").write("1")
try:
    for r in range(int(sys.argv[1]) if len(sys.argv)>1 else 3):
        for kind in ("libfuse","sink","cfs"):
            for tr in ("dev","uring"):
                us=one(kind,tr); print(r,kind,tr,f"{us:.1f}us",flush=True)
finally:
    open("/sys/module/fuse/parameters/enable_uring","w").write("0")
