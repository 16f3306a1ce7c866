#!/bin/bash
# usage: buffab.sh BIN REPS BS TRANSPORT
B=$1; REPS=${2:-3}; BS=${3:-1m}; TR=${4:-dev}
old=$(sysctl -n fs.fuse.max_pages_limit); sysctl -qw fs.fuse.max_pages_limit=4096
[ "$TR" = uring ] && echo 1 > /sys/module/fuse/parameters/enable_uring
for r in $(seq $REPS); do
 if [ $((r % 2)) = 0 ]; then modes="own same"; else modes="same own"; fi
 for mode in $modes; do
  w=$(mktemp -d /var/tmp/bab.XXXX); mkdir $w/b $w/m
  extra=""; [ $mode = same ] && extra=,session=mounter
  $B mount $w/b $w/m -o backend=null,unit=4M,max_write=16M,transport=$TR,state=$w/s$extra
  out=$(fio --name=w --filename=$w/m/f --rw=write --bs=$BS --size=1g --ioengine=psync --direct=0 --end_fsync=1 --output-format=json 2>/dev/null | python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(int(j['write']['bw_bytes']/1e6), 'MB/s usr', round(j['usr_cpu'],1), 'sys', round(j['sys_cpu'],1))")
  echo "rep $r $mode: $out"
  $B umount $w/m; $B forget --discard --state $w/s $w/b >/dev/null 2>&1; rm -rf $w
 done
done
sysctl -qw fs.fuse.max_pages_limit=$old; echo 0 > /sys/module/fuse/parameters/enable_uring
