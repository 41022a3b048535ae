#!/usr/bin/env bash
# Write latency while the background GC compacts: 4 KiB random writes at queue depth 1 over
# NBD, once on a pool with nothing to collect and once while `condense serve`'s background GC
# copies a volume's worth of live chunks (GC copies without holding the state lock, so writes
# should go on with little added latency).
#
#   bash bench/nbd/gc-latency.sh              # 2 GiB volume, 60 s per run
#   SIZE=4G RUNTIME=90 bash bench/nbd/gc-latency.sh
#
# Setup: a volume of SIZE is filled with random data, then every other 1 MiB of it is
# overwritten with new random data, so each segment is about half dead (the background GC,
# every 30 s, compacts segments at least half dead once a quarter of all segment bytes are
# dead). Run 1 (baseline) writes while nothing is dead yet; run 2 starts right after the
# overwrite, so the GC runs inside it. Prints p50/p99/p99.9/max of both runs and when the GC ran.
# Needs: fio, libnbd-bin (nbdinfo), jq. Prints figures; asserts nothing.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIZE=${SIZE:-2G}
RUNTIME=${RUNTIME:-60}
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=$ROOT/target/release/condense
fi
for tool in fio nbdinfo jq; do
    command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install fio libnbd-bin jq)"; exit 1; }
done

BASE=${BENCH_DIR:-$ROOT/target/bench-nbd}
mkdir -p "$BASE"
W=$(mktemp -d "$BASE/gc.XXXXXX")
POOL=$W/pool
PORT=$((20000 + RANDOM % 10000))
URI=nbd://127.0.0.1:$PORT/bench
spid=
cleanup() {
    [ -n "$spid" ] && kill -TERM "$spid" 2>/dev/null && wait "$spid" 2>/dev/null
    rm -rf "$W"
}
trap cleanup EXIT

"$CONDENSE" --pool "$POOL" init >/dev/null
"$CONDENSE" --pool "$POOL" volume create bench --size "$SIZE" >/dev/null
CONDENSE_LOG=info "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" >"$W/serve.log" 2>&1 &
spid=$!
for _ in $(seq 1 100); do nbdinfo "$URI" >/dev/null 2>&1 && break; sleep 0.1; done

nbd() { fio --name="$1" --ioengine=nbd --uri="$URI" --size="$SIZE" --randrepeat=0 \
    --refill_buffers=1 "${@:2}"; }

echo "== fill $SIZE with random data"
nbd fill --rw=write --bs=1M --iodepth=8 --end_fsync=1 --output=/dev/null

# lat RUN: 4 KiB random writes at qd1 for RUNTIME s; fio JSON in W/RUN.json.
lat() {
    nbd "$1" --rw=randwrite --bs=4k --iodepth=1 --time_based=1 --runtime="$RUNTIME" \
        --percentile_list=50:99:99.9 --output-format=json --output="$W/$1.json" >/dev/null
}
echo "== run 1: ${RUNTIME} s of 4K random writes, qd1, nothing to collect"
lat baseline
echo "== overwrite every other MiB (segments about half dead)"
nbd overwrite --rw=write:1M --bs=1M --iodepth=8 --end_fsync=1 --output=/dev/null
dead_before=$("$CONDENSE" --pool "$POOL" stats --json | jq .dead_bytes)
echo "== run 2: ${RUNTIME} s of 4K random writes, qd1, background GC due within 30 s ($((dead_before >> 20)) MiB dead)"
t0=$(date +%s.%N)
lat during_gc
t1=$(date +%s.%N)
dead_after=$("$CONDENSE" --pool "$POOL" stats --json | jq .dead_bytes)

pct() { jq -r ".jobs[0].write.clat_ns.percentile[\"$2\"] / 1000 | floor" "$W/$1.json"; }
row() {
    printf '%-26s %10s %10s %10s %10s %10s\n' "$1" \
        "$(jq -r '.jobs[0].write.iops | floor' "$W/$2.json")" \
        "$(pct "$2" 50.000000)" "$(pct "$2" 99.000000)" "$(pct "$2" 99.900000)" \
        "$(jq -r '.jobs[0].write.clat_ns.max / 1000 | floor' "$W/$2.json")"
}
echo
printf '%-26s %10s %10s %10s %10s %10s\n' "4K random write, qd1" IOPS "p50 us" "p99 us" "p99.9 us" "max us"
row "no GC" baseline
row "background GC running" during_gc
echo
echo "dead bytes: $((dead_before >> 20)) MiB before run 2, $((dead_after >> 20)) MiB after"
echo "GC during run 2 ($(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.0f", b-a}') s):"
grep -h "background gc" "$W/serve.log" | sed 's/^/  /' || echo "  (none logged: the GC did not run inside the run; raise RUNTIME)"
