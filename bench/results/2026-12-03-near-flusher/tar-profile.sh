#!/bin/bash
# One tar extract of a generated tree (ENTRIES, 10,000 by default) onto a coalescefs mount over
# a journaled loop ext4 (the state directory on it too), with the daemon's request counts and
# busy time per kind, CPU ticks of the machine and of the daemon, and flush counters.
# COALESCEFS_BIN: the binary; TR: uring (default) or dev; PIN: a prefix for the mount and tar
# (`taskset -c 0` runs everything on one CPU). Output goes to a file first, so that a reader
# that stops early (head) cannot kill the script before it unmounts.
set -e
B=${COALESCEFS_BIN:-/work/main/target/release/coalescefs}
here=$(cd "$(dirname "$0")/../../.." && pwd)
base=$(mktemp -d /var/tmp/tarprof.XXXX)
out=$base.out
cleanup() {
  mountpoint -q $base/m && $B umount $base/m
  mountpoint -q $base/store && umount $base/store
  [ -n "$LOOP" ] && losetup -d $LOOP
  echo 0 > /sys/module/fuse/parameters/enable_uring
  rm -rf $base
}
trap cleanup EXIT
truncate -s 4G $base/img
LOOP=$(losetup --find --show --direct-io=on $base/img)
mkfs.ext4 -q -E lazy_itable_init=0,lazy_journal_init=0 $LOOP
mkdir $base/store; mount $LOOP $base/store
python3 -c "
import sys; sys.path.insert(0,'$here/tests/apps'); import workload
workload.make_tree('$base/src', ${ENTRIES:-10000}); workload.make_tarball('$base/src', '$base/tree.tar')"
mkdir $base/store/b $base/m
echo 1 > /sys/module/fuse/parameters/enable_uring
$PIN $B mount $base/store/b $base/m -o transport=${TR:-uring},state=$base/store/s
echo 0 > /sys/module/fuse/parameters/enable_uring
PID=$($B stats $base/m | awk '/^daemon_pid/{print $2}')
sleep 0.5
{
  head -1 /proc/stat > $base/stat0; cat /proc/$PID/stat > $base/pstat0
  /usr/bin/time -f "tar user %U sys %S wall %e" $PIN tar -xpf $base/tree.tar -C $base/m
  head -1 /proc/stat > $base/stat1; cat /proc/$PID/stat > $base/pstat1
  python3 -c "
a=list(map(int,open('$base/stat0').read().split()[1:])); b=list(map(int,open('$base/stat1').read().split()[1:]))
d=[y-x for x,y in zip(a,b)]; print('cpu ticks user %d nice %d sys %d idle %d iowait %d irq %d softirq %d steal %d' % tuple(d[:8]))
p0=open('$base/pstat0').read().split(); p1=open('$base/pstat1').read().split()
print('daemon utime %d stime %d ticks' % (int(p1[13])-int(p0[13]), int(p1[14])-int(p0[14])))"
  $B stats $base/m | grep -E "^fuse_[a-z]+_(total|busy_us_total) " | paste - - | awk '{ if ($2>0) printf "%-10s %7d requests %8.0f ms busy %6.1f us each\n", substr($1,6,length($1)-11), $2, $4/1000, $4/$2 }' | sort -k4 -n -r | head -12
  $B stats $base/m | grep -E "^log_batches_total|^log_write_bytes_total|flush_latency|units_flushed|flushes_near|opens_of_made_files"
} > $out 2>&1
cleanup; trap - EXIT
cat $out; rm -f $out
