#!/usr/bin/env bash
# Snapshots and clones: what they cost in time and space, and what snapshots cost writes.
#
#   bash bench/snapshots.sh IMAGE                # e.g. /work/corpus/images/dns1.raw (16 GiB)
#   CLONES=100 RUNTIME=60 SIZE=2G bash bench/snapshots.sh IMAGE
#
# 1. Import IMAGE, start `condense serve`, then take a snapshot and make CLONES clones of it in
#    a row, each through the control socket (the way an administrator does it while VMs run):
#    wall time per command (p50 / p99 / max, CLI start and socket round trip included) and
#    pool growth per clone (du -sb of the pool directory).
# 2. 4 KiB random writes over NBD (fio, qd32) on a SIZE volume for RUNTIME s, once with no
#    snapshots and once with a snapshot every 5 s: write IOPS ratio and pool growth.
# Needs: fio, libnbd-bin (nbdinfo), jq. Prints figures; asserts nothing.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${1:?usage: bench/snapshots.sh IMAGE}
CLONES=${CLONES:-100}
SIZE=${SIZE:-2G}
RUNTIME=${RUNTIME:-60}
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=$ROOT/target/release/condense
fi
for tool in fio nbdinfo jq; do
    command -v "$tool" >/dev/null || { echo "missing $tool (scripts/install-deps.sh)"; exit 1; }
done

BASE=${BENCH_DIR:-$ROOT/target/bench-snapshots}
mkdir -p "$BASE"
W=$(mktemp -d "$BASE/snap.XXXXXX")
POOL=$W/pool
PORT=$((20000 + RANDOM % 10000))
spid=
cleanup() {
    [ -n "$spid" ] && kill -TERM "$spid" 2>/dev/null && wait "$spid" 2>/dev/null
    rm -rf "$W"
}
trap cleanup EXIT
c() { "$CONDENSE" --pool "$POOL" "$@"; }
serve() {
    PORT=$((PORT + 1)) # a fresh port: the last one may still be in TIME_WAIT
    c serve --insecure-listen "127.0.0.1:$PORT" >"$W/serve.log" 2>&1 &
    spid=$!
    for _ in $(seq 1 200); do
        [ -S "$POOL/control.sock" ] && nbdinfo --list "nbd://127.0.0.1:$PORT" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "serve did not start"; cat "$W/serve.log"; exit 1
}
ms() { echo "$(( ($2 - $1) / 1000000 ))"; }
pcts() { sort -n | awk '{a[NR]=$1} END {printf "p50 %d ms, p99 %d ms, max %d ms", a[int(NR*0.5+0.5)], a[int(NR*0.99+0.5)], a[NR]}'; }

c init >/dev/null
name=$(basename "$IMAGE" .raw)
echo "== import $IMAGE"
c import "$IMAGE" --name "$name" | tail -1
serve
du0=$(du -sb "$POOL" | cut -f1)
t0=$(date +%s%N); c snapshot create "$name" golden >/dev/null; t1=$(date +%s%N)
du1=$(du -sb "$POOL" | cut -f1)
echo "snapshot of $name ($(c volume info "$name" --json | jq -r .logical_bytes) bytes logical): $(ms "$t0" "$t1") ms, pool +$((du1 - du0)) bytes"

: >"$W/clone_ms"; : >"$W/clone_bytes"
prev=$du1
for i in $(seq 1 "$CLONES"); do
    t0=$(date +%s%N); c volume clone "$name@golden" "vm$i" >/dev/null; t1=$(date +%s%N)
    now=$(du -sb "$POOL" | cut -f1)
    ms "$t0" "$t1" >>"$W/clone_ms"
    echo $((now - prev)) >>"$W/clone_bytes"
    prev=$now
done
echo "$CLONES clones of $name@golden in a row: $(pcts <"$W/clone_ms")"
echo "  first clone $(head -1 "$W/clone_ms") ms, clone #$CLONES $(tail -1 "$W/clone_ms") ms"
echo "  pool growth per clone: $(pcts <"$W/clone_bytes" | sed 's/ ms/ B/g'); total +$((prev - du1)) bytes for $CLONES clones"
echo "  pool now $(du -sb "$POOL" | cut -f1) bytes for $((CLONES + 1)) volumes of $(c volume info "$name" --json | jq -r .logical_bytes) bytes"
kill -TERM "$spid"; wait "$spid" 2>/dev/null || true; spid=
rm -rf "$POOL"

echo "== 4K random writes over NBD, qd32, ${RUNTIME} s on a $SIZE volume: no snapshots vs a snapshot every 5 s"
run() { # NAME SNAPSHOTS(0|1)
    rm -rf "$POOL"
    c init >/dev/null
    c volume create bench --size "$SIZE" >/dev/null
    serve
    local uri=nbd://127.0.0.1:$PORT/bench
    fio --name=fill --ioengine=nbd --uri="$uri" --size="$SIZE" --rw=write --bs=1M --iodepth=8 \
        --refill_buffers=1 --end_fsync=1 --output=/dev/null
    local before n=0 snapper=
    before=$(du -sb "$POOL" | cut -f1)
    if [ "$2" = 1 ]; then
        : >"$W/snap_ms"
        (i=0; while sleep 5; do
            i=$((i + 1)); t0=$(date +%s%N)
            c snapshot create bench "s$i" >/dev/null || break
            ms "$t0" "$(date +%s%N)" >>"$W/snap_ms"
        done) &
        snapper=$!
    fi
    fio --name="$1" --ioengine=nbd --uri="$uri" --size="$SIZE" --rw=randwrite --bs=4k \
        --iodepth=32 --time_based=1 --runtime="$RUNTIME" --randrepeat=0 --refill_buffers=1 \
        --output-format=json --output="$W/$1.json" >/dev/null
    [ -n "$snapper" ] && kill "$snapper" 2>/dev/null && wait "$snapper" 2>/dev/null || true
    n=$(c snapshot list bench --json | jq '.snapshots | length')
    local after; after=$(du -sb "$POOL" | cut -f1)
    printf '%-22s %10s IOPS  p99 %6s us  snapshots %4s  pool growth %6s MiB\n' "$1" \
        "$(jq -r '.jobs[0].write.iops | floor' "$W/$1.json")" \
        "$(jq -r '.jobs[0].write.clat_ns.percentile["99.000000"] / 1000 | floor' "$W/$1.json")" \
        "$n" "$(( (after - before) >> 20 ))"
    kill -TERM "$spid"; wait "$spid" 2>/dev/null || true; spid=
}
run no_snapshots 0
run snapshot_every_5s 1
echo "snapshot create while fio writes (makes every write so far durable: a checkpoint): $(pcts <"$W/snap_ms")"
a=$(jq -r '.jobs[0].write.iops' "$W/no_snapshots.json")
b=$(jq -r '.jobs[0].write.iops' "$W/snapshot_every_5s.json")
echo "write IOPS with a snapshot every 5 s / without: $(echo "scale=2; $b / $a" | bc)"
