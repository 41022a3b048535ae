#!/usr/bin/env bash
# Benchmark of the FUSE mount against a plain file on the same disk:
#   1. fio sequential and random read/write (O_DIRECT, unique data) on a plain file, on a file
#      under MOUNT/files/ and on MOUNT/volumes/NAME; throughput, IOPS and FUSE/plain ratios.
#   2. The same through the page cache (buffered, no O_DIRECT): sequential 1 MiB write and
#      random 4 KiB write, each ended by an fsync that fio counts in the time, and a sequential
#      1 MiB read (fio drops the file's cached pages first). This is where the kernel's
#      writeback cache (`condense mount --writeback-cache`) matters; O_DIRECT bypasses it.
#   3. Time to copy VM images into MOUNT/files/ vs into a plain directory (cp --sparse=auto),
#      and what the pool stores for them.
#
#   bash bench/fuse/run.sh [WORK_DIR]          # default WORK_DIR: a new directory under /var/tmp
#   IMAGES=/work/corpus/images N_IMAGES=10 bash bench/fuse/run.sh
#   SEQ_SIZE=2G RAND_SIZE=512M RUNTIME=30 bash bench/fuse/run.sh
#   FUSE_WRITEBACK=1 bash bench/fuse/run.sh      # mount with --writeback-cache
#   FUSE_WRITEBACK="0 1" bash bench/fuse/run.sh  # 1. and 2. once per setting (remounting in
#                                                # between), 3. with the last one
#
# IMAGES defaults to ../shared/corpus output at /work/corpus/images when present (built by
# /work/shared/corpus/build.sh), else six generated 256 MiB images. Needs fio, python3, fuse3
# (or root). Prints figures; asserts nothing about speed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${1:-$(mktemp -d /var/tmp/condense-fuse-bench.XXXXXX)}
SEQ_SIZE=${SEQ_SIZE:-1G}
RAND_SIZE=${RAND_SIZE:-256M}
RUNTIME=${RUNTIME:-20}
N_IMAGES=${N_IMAGES:-10}
FUSE_WRITEBACK=${FUSE_WRITEBACK:-0}
for wb in $FUSE_WRITEBACK; do
    case $wb in 0 | 1) ;; *) echo "FUSE_WRITEBACK must be 0, 1 or a list of them, not '$wb'"; exit 1 ;; esac
done
if [ -z "${IMAGES:-}" ] && [ -d /work/corpus/images ]; then IMAGES=/work/corpus/images; fi
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense >/dev/null) || { echo "build failed"; exit 1; }
    CONDENSE=$ROOT/target/release/condense
fi
for tool in fio python3; do command -v $tool >/dev/null || { echo "missing $tool"; exit 1; }; done

POOL=$WORK/pool
MNT=$WORK/mnt
PLAIN=$WORK/plain
mkdir -p "$MNT" "$PLAIN"
MOUNT_PID=
cleanup() {
    if [ -n "$MOUNT_PID" ]; then kill -TERM "$MOUNT_PID" 2>/dev/null; wait "$MOUNT_PID" 2>/dev/null; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

condense() { "$CONDENSE" --pool "$POOL" "$@"; }
start_mount() { # [--writeback-cache]
    "$CONDENSE" --pool "$POOL" mount "$MNT" "$@" >>"$WORK/mount.log" 2>&1 &
    MOUNT_PID=$!
    for _ in $(seq 1 100); do [ -d "$MNT/files" ] && return 0; sleep 0.1; done
    echo "mount did not come up"; tail "$WORK/mount.log"; exit 1
}
stop_mount() { kill -TERM "$MOUNT_PID"; wait "$MOUNT_PID"; MOUNT_PID=; }

mount_flags() { # SETTING -> the mount's flags
    if [ "$1" = 1 ]; then echo --writeback-cache; fi
}
condense init >/dev/null
condense volume create benchvol --size 4G >/dev/null

echo "Condense FUSE benchmark — $(nproc) cores, $(date -u +%F)"
echo "work dir $WORK on $(df -h --output=source,fstype "$WORK" | tail -1)"
echo "fio: refill_buffers (unique, incompressible data: the worst case for Condense),"
echo "     sequential 1 MiB x $SEQ_SIZE, random 4 KiB on $RAND_SIZE for ${RUNTIME}s, 1 job, psync"
echo

# fio_run TARGET RW BS SIZE [DIRECT] -> prints "MBps IOPS". DIRECT is 1 (O_DIRECT, the
# default) or 0 (buffered: through the page cache, and the writeback cache when it is on).
# fio counts end_fsync in its runtime, so buffered writes are timed until they are durable.
fio_run() {
    local target=$1 rw=$2 bs=$3 size=$4 direct=${5:-1} extra=()
    case $rw in rand*) extra=(--time_based --runtime="$RUNTIME") ;; esac
    fio --name=b --filename="$target" --rw="$rw" --bs="$bs" --size="$size" --direct="$direct" \
        --ioengine=psync --refill_buffers --end_fsync=1 --output-format=json "${extra[@]}" \
        >"$WORK/fio.json" 2>"$WORK/fio.err" || { cat "$WORK/fio.err"; return 1; }
    python3 - "$WORK/fio.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
op = "write" if j["write"]["io_bytes"] > 0 else "read"
print(f'{j[op]["bw_bytes"] / 1e6:.1f} {j[op]["iops"]:.0f}')
EOF
}

# fio_table DIRECT JOB... : one line per job, on the plain file, files/ and volumes/.
fio_table() {
    local direct=$1 job name rw bs size p f v
    shift
    printf '%-22s %14s %14s %14s %8s %8s\n' "job" "plain file" "files/ file" "volumes/ file" "files/" "volumes/"
    for job in "$@"; do
        read -r name rw bs size <<<"$job"
        p=$(fio_run "$PLAIN/bench.dat" "$rw" "$bs" "$size" "$direct")
        f=$(fio_run "$MNT/files/bench.dat" "$rw" "$bs" "$size" "$direct")
        v=$(fio_run "$MNT/volumes/benchvol" "$rw" "$bs" "$size" "$direct")
        python3 - "$name" "$p" "$f" "$v" "$bs" <<'EOF'
import sys
name, p, f, v, bs = sys.argv[1:]
(pm, pi), (fm, fi), (vm, vi) = (map(float, x.split()) for x in (p, f, v))
if bs == "1M":
    cells = [f"{pm:.0f} MB/s", f"{fm:.0f} MB/s", f"{vm:.0f} MB/s"]
    ratio = (fm / pm, vm / pm)
else:
    cells = [f"{pi:.0f} IOPS", f"{fi:.0f} IOPS", f"{vi:.0f} IOPS"]
    ratio = (fi / pi, vi / pi)
print(f"{name:<22} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14} {ratio[0]:>7.2f}x {ratio[1]:>7.2f}x")
EOF
    done
    rm -f "$PLAIN/bench.dat" "$MNT/files/bench.dat"
}

for wb in $FUSE_WRITEBACK; do
    if [ -n "$MOUNT_PID" ]; then stop_mount; fi
    # shellcheck disable=SC2046 # no flag or one word
    start_mount $(mount_flags "$wb")
    echo "mount: writeback cache $([ "$wb" = 1 ] && echo on || echo off)"
    echo "O_DIRECT (direct=1):"
    fio_table 1 "seq-write write 1M $SEQ_SIZE" "seq-read read 1M $SEQ_SIZE" \
        "rand-write-4k randwrite 4k $RAND_SIZE" "rand-read-4k randread 4k $RAND_SIZE"
    echo "buffered (direct=0; writes end with an fsync, reads start with the file's pages dropped):"
    fio_table 0 "seq-write-buf write 1M $SEQ_SIZE" "seq-read-buf read 1M $SEQ_SIZE" \
        "rand-write-4k-buf randwrite 4k $RAND_SIZE"
    echo
done

# ---------------------------------------------------------------------------------------
echo
if [ -n "${IMAGES:-}" ]; then
    mapfile -t imgs < <(ls "$IMAGES"/*.raw | head -n "$N_IMAGES")
else
    mkdir -p "$WORK/gen"
    head -c 128M /dev/urandom >"$WORK/gen/base"
    for i in $(seq 1 6); do
        { cat "$WORK/gen/base"; head -c 64M /dev/zero; head -c 64M /dev/urandom; } >"$WORK/gen/vm$i.raw"
    done
    rm "$WORK/gen/base"
    imgs=("$WORK"/gen/vm*.raw)
fi
apparent=$(du -c --apparent-size -B1 "${imgs[@]}" | tail -1 | cut -f1)
allocated=$(du -c -B1 "${imgs[@]}" | tail -1 | cut -f1)
echo "copy of ${#imgs[@]} images ($((apparent >> 20)) MiB apparent, $((allocated >> 20)) MiB allocated) with cp --sparse=auto, then sync"
sync
t0=$(date +%s.%N)
cp --sparse=auto "${imgs[@]}" "$PLAIN/"
sync
t1=$(date +%s.%N)
mkdir -p "$MNT/files/images"
cp --sparse=auto "${imgs[@]}" "$MNT/files/images/"
sync
python3 -c "import os; fd = os.open('$MNT/files/images', os.O_RDONLY); os.fsync(fd)"
t2=$(date +%s.%N)
python3 - "$t0" "$t1" "$t2" "$allocated" <<'EOF'
import sys
t0, t1, t2, alloc = map(float, sys.argv[1:])
plain, fuse = t1 - t0, t2 - t1
print(f"  plain directory: {plain:7.1f} s  ({alloc / plain / 1e6:6.0f} MB/s of allocated data)")
print(f"  MOUNT/files/:    {fuse:7.1f} s  ({alloc / fuse / 1e6:6.0f} MB/s of allocated data)  ratio {plain / fuse:.2f}x")
EOF
du_plain=$(du -s -B1 "$PLAIN" | cut -f1)
du_fuse=$(du -s -B1 "$MNT/files/images" | cut -f1)
ok=0
for img in "${imgs[@]}"; do cmp -s "$img" "$MNT/files/images/$(basename "$img")" && ok=$((ok + 1)); done
echo "  byte-identical copies in files/: $ok of ${#imgs[@]}"
echo "  du: plain $((du_plain >> 20)) MiB, files/ $((du_fuse >> 20)) MiB (data blocks before dedup and compression)"
stop_mount
condense stats --json >"$WORK/stats.json"
python3 - "$WORK/stats.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"  pool after the copy: written {s['written_bytes'] >> 20} MiB, physical {s['physical_bytes'] >> 20} MiB, "
      f"dedup saving {s['dedup_saving_percent']:.1f}%, compression {s['compression_saving_percent']:.1f}%, "
      f"total {s['saving_percent']:.1f}%")
EOF
