#!/usr/bin/env bash
# fio over NBD: Condense vs a plain file vs nbdkit's file plugin serving the same plain file.
# The plain file shows what the disk and page cache give; nbdkit-file adds only the NBD
# protocol; Condense adds the protocol and data reduction. The ratios separate the two costs.
#
#   bash bench/nbd/fio-bench.sh                 # 1 GiB, 15 s per job
#   SIZE=4G RUNTIME=30 bash bench/nbd/fio-bench.sh
#   CONDENSE=target/release/condense BENCH_DIR=/mnt/disk bash bench/nbd/fio-bench.sh
#
# Everything lives in BENCH_DIR (default target/bench-nbd, i.e. the repository's disk). Caches
# are warm for all three (the data set fits in RAM); each target reads the same bytes: random
# (incompressible, unique) data written once to the plain file and copied into the volume.
# Needs: fio, nbdkit, libnbd-bin (nbdcopy, nbdinfo), python3. Prints figures; asserts nothing.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIZE=${SIZE:-1G}
RUNTIME=${RUNTIME:-15}
RAMP=${RAMP:-2}
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=$ROOT/target/release/condense
fi
for tool in fio nbdkit nbdcopy nbdinfo python3; do
    command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install fio nbdkit libnbd-bin python3)"; exit 1; }
done

BASE=${BENCH_DIR:-$ROOT/target/bench-nbd}
mkdir -p "$BASE"
W=$(mktemp -d "$BASE/run.XXXXXX")
PLAIN=$W/plain.raw
POOL=$W/pool
PORT_NBDKIT=$((20000 + RANDOM % 10000))
PORT_CONDENSE=$((PORT_NBDKIT + 1))
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$W"
}
trap cleanup EXIT

wait_nbd() {
    for _ in $(seq 1 100); do
        nbdinfo "$1" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "no NBD server at $1"
    return 1
}

# The plain file's engine: io_uring (asynchronous even on buffered files), else libaio.
PLAIN_ENGINE=io_uring
if ! fio --name=probe --filename="$W/probe" --size=1M --rw=read --ioengine=io_uring \
    --runtime=1 >/dev/null 2>&1; then
    PLAIN_ENGINE=libaio
fi
rm -f "$W/probe"

echo "== setup: $SIZE of random data, plain file on $(df -h "$W" | awk 'NR==2 {print $1}')"
fio --name=fill --filename="$PLAIN" --size="$SIZE" --rw=write --bs=1M --ioengine=psync \
    --refill_buffers=1 --end_fsync=1 --output=/dev/null
bytes=$(stat -c %s "$PLAIN")

"$CONDENSE" --pool "$POOL" init >/dev/null
"$CONDENSE" --pool "$POOL" volume create bench --size "$bytes" >/dev/null
"$CONDENSE" --pool "$POOL" serve --listen "127.0.0.1:$PORT_CONDENSE" >"$W/serve.log" 2>&1 &
pids+=($!)
nbdkit --foreground --port "$PORT_NBDKIT" --ipaddr 127.0.0.1 file "$PLAIN" >"$W/nbdkit.log" 2>&1 &
pids+=($!)
URI_CONDENSE=nbd://127.0.0.1:$PORT_CONDENSE/bench
URI_NBDKIT=nbd://127.0.0.1:$PORT_NBDKIT/
wait_nbd "$URI_CONDENSE"
wait_nbd "$URI_NBDKIT"
nbdcopy --flush "$PLAIN" "$URI_CONDENSE"

# run TARGET NAME FIO-ARGS...: print the fio JSON of one job against one target.
run() {
    local target=$1 name=$2
    shift 2
    local where
    case $target in
        plain) where=(--filename="$PLAIN" --ioengine="$PLAIN_ENGINE") ;;
        nbdkit) where=(--ioengine=nbd --uri="$URI_NBDKIT") ;;
        condense) where=(--ioengine=nbd --uri="$URI_CONDENSE") ;;
    esac
    fio --name="$name" "${where[@]}" --size="$bytes" --time_based=1 --runtime="$RUNTIME" \
        --ramp_time="$RAMP" --randrepeat=0 --refill_buffers=1 --output-format=json \
        --output="$W/$target-$name.json" "$@" >/dev/null 2>&1 ||
        { echo "fio $name on $target failed"; cat "$W/$target-$name.json" 2>/dev/null | tail -5; return 1; }
}

jobs=(
    "seqread1m|--rw=read --bs=1M --iodepth=4"
    "seqwrite1m|--rw=write --bs=1M --iodepth=4"
    "randread4k|--rw=randread --bs=4k --iodepth=32"
    "randwrite4k|--rw=randwrite --bs=4k --iodepth=32"
    "lat4k|--rw=randwrite --bs=4k --iodepth=1"
    "study-seqread1k|--rw=read --bs=1k --iodepth=4"
    "study-randread1k|--rw=randread --bs=1k --iodepth=4"
)
for j in "${jobs[@]}"; do
    name=${j%%|*}
    read -r -a args <<<"${j#*|}"
    for target in plain nbdkit condense; do
        echo "== $name on $target"
        run "$target" "$name" "${args[@]}"
    done
done

python3 - "$W" "$SIZE" "$RUNTIME" "$PLAIN_ENGINE" <<'EOF'
import json, sys, os
w, size, runtime, engine = sys.argv[1:5]

def load(target, name):
    with open(os.path.join(w, f"{target}-{name}.json")) as f:
        return json.load(f)["jobs"][0]

def iops(target, name, rw):
    return load(target, name)[rw]["iops"]

def bw_mib(target, name, rw):
    return load(target, name)[rw]["bw_bytes"] / 2**20

def lat_us(target, name, pct):
    p = load(target, name)["write"]["clat_ns"]["percentile"]
    return p[f"{pct:.6f}"] / 1000

rows = [
    ("seq read 1M (MiB/s)", lambda t: bw_mib(t, "seqread1m", "read"), True),
    ("seq write 1M (MiB/s)", lambda t: bw_mib(t, "seqwrite1m", "write"), True),
    ("rand read 4K qd32 (IOPS)", lambda t: iops(t, "randread4k", "read"), True),
    ("rand write 4K qd32 (IOPS)", lambda t: iops(t, "randwrite4k", "write"), True),
    ("write 4K qd1 p50 (us)", lambda t: lat_us(t, "lat4k", 50), False),
    ("write 4K qd1 p99 (us)", lambda t: lat_us(t, "lat4k", 99), False),
    ("study seq read 1K qd4 (IOPS)", lambda t: iops(t, "study-seqread1k", "read"), True),
    ("study rand read 1K qd4 (IOPS)", lambda t: iops(t, "study-randread1k", "read"), True),
]
print()
print(f"fio, {size} data set, {runtime} s per job, one connection; plain file via {engine} (buffered)")
hdr = f"{'job':<30}{'plain file':>12}{'nbdkit-file':>13}{'condense':>11}{'cond/plain':>12}{'cond/nbdkit':>13}"
print(hdr)
print("-" * len(hdr))
values = {}
for label, f, higher_better in rows:
    p, n, c = f("plain"), f("nbdkit"), f("condense")
    values[label] = (p, n, c)
    rp = c / p if p else float("nan")
    rn = c / n if n else float("nan")
    print(f"{label:<30}{p:>12.0f}{n:>13.0f}{c:>11.0f}{rp:>11.2f}x{rn:>12.2f}x")
print("(for latencies a ratio above 1 means Condense is slower)")
print()
def goal(label, col, target, want):
    p, n, c = values[label]
    base = p if col == "plain" else n
    r = c / base if base else 0
    verdict = "met" if r >= want else "MISSED"
    print(f"goal: {label} >= {want:.0%} of {col}: {r:.0%} ({verdict})")
goal("rand read 4K qd32 (IOPS)", "plain", None, 0.50)
goal("rand read 4K qd32 (IOPS)", "nbdkit-file", None, 0.80)
goal("seq read 1M (MiB/s)", "plain", None, 0.80)
EOF
