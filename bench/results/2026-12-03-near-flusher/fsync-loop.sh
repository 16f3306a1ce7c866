#!/bin/bash
# 500 new 1 KiB files, each written, fsynced and closed, on a coalescefs mount (io_uring where
# enabled) over a journaled loop ext4 holding the state directory too. Arguments: the binary,
# and options to add (",log=off").  Prints microseconds per file and flushes_near_total.
set -e
B=$1; OPTS=$2
base=$(mktemp -d /var/tmp/fsab.XXXX)
cleanup() { mountpoint -q $base/m && $B umount $base/m; mountpoint -q $base/store && umount $base/store; [ -n "$LOOP" ] && losetup -d $LOOP; echo 0 > /sys/module/fuse/parameters/enable_uring; rm -rf $base; }
trap cleanup EXIT
truncate -s 1G $base/img
LOOP=$(losetup --find --show --direct-io=on $base/img)
mkfs.ext4 -q -E lazy_itable_init=0,lazy_journal_init=0 $LOOP
mkdir $base/store $base/m; mount $LOOP $base/store; mkdir $base/store/b
echo 1 > /sys/module/fuse/parameters/enable_uring
$B mount $base/store/b $base/m -o state=$base/store/s$OPTS
python3 -c "
import os,time
t=time.perf_counter()
for i in range(500):
    fd=os.open('$base/m/f%d'%i, os.O_WRONLY|os.O_CREAT); os.write(fd,b'x'*1024); os.fsync(fd); os.close(fd)
print('%.0f us per file' % ((time.perf_counter()-t)/500*1e6))" > $base.out
$B stats $base/m | grep -E "^flushes_near_total" >> $base.out || true
cleanup; trap - EXIT; cat $base.out | tr '\n' ' '; echo; rm -f $base.out
