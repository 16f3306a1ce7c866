#!/bin/bash
# tar extract of a 10,000-entry tree over libfuse's passthrough_ll and coalescefs, both
# transports, on a journaled loop ext4; TIMEOUT0=1: attribute and entry timeouts 0 on both.
# LIBFUSE: a libfuse build with io_uring (meson setup build -Denable-io-uring=true).
set -e
B=${COALESCEFS_BIN:-/work/main/target/release/coalescefs}; PT=${LIBFUSE:-/var/tmp/libfuse}/build/example/passthrough_ll
PT_OPTS=; CFS_OPTS=
if [ -n "$TIMEOUT0" ]; then PT_OPTS=,timeout=0; CFS_OPTS=,cache_timeout=0; fi
base=$(mktemp -d /var/tmp/tarlib.XXXX)
truncate -s 4G $base/img
LOOP=$(losetup --find --show --direct-io=on $base/img)
mkfs.ext4 -q -E lazy_itable_init=0,lazy_journal_init=0 $LOOP
mkdir $base/store; mount $LOOP $base/store
python3 -c "
import sys; sys.path.insert(0,'/work/main/tests/apps'); import workload
workload.make_tree('$base/src', 10000); workload.make_tarball('$base/src', '$base/tree.tar')"
echo 1 > /sys/module/fuse/parameters/enable_uring
trap 'echo 0 > /sys/module/fuse/parameters/enable_uring' EXIT
one() { # system transport
  local d=$base/store/d m=$base/m; mkdir -p $d $m
  case $1 in
    native) m=$d ;;
    pt) $PT -f -o source=$d$PT_OPTS $( [ $2 = uring ] && echo "-o io_uring" ) $m & PTPID=$!; for i in $(seq 100); do mountpoint -q $m && break; sleep 0.05; done ;;
    cfs) $B mount $d $m -o transport=$2,state=$base/store/s$CFS_OPTS ;;
  esac
  sync; echo 3 > /proc/sys/vm/drop_caches
  local s=$(date +%s.%N); tar -xpf $base/tree.tar -C $m; local e=$(date +%s.%N)
  case $1 in pt) umount $m; wait $PTPID ;; cfs) $B umount $m; $B forget --discard --state $base/store/s $d >/dev/null 2>&1 || true ;; esac
  rm -rf $d $base/store/s; sync
  printf "%s %s %.2f s\n" $1 $2 $(echo "$e - $s" | bc)
}
for r in $(seq ${ROUNDS:-2}); do
  one native - ; one pt dev; one pt uring; one cfs dev; one cfs uring
done
umount $base/store; losetup -d $LOOP; rm -rf $base
