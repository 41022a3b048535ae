#!/usr/bin/env bash
# fio over NBD: Condense vs a plain file vs nbdkit's file plugin serving the same plain file.
# The plain file shows what the disk and page cache give; nbdkit-file adds only the NBD
# protocol; Condense adds the protocol and data reduction. The ratios separate the two costs.
# nbdkit-null (a server that stores nothing and reads zeros) shows what the protocol and
# fio's NBD client cost alone. fio's nbd engine is one thread: for small requests it is the
# limit, and the plain file through io_uring can be past what any NBD server reaches.
#
#   bash bench/nbd/fio-bench.sh                 # 1 GiB, 15 s per job
#   SIZE=4G RUNTIME=30 bash bench/nbd/fio-bench.sh
#   CONDENSE=target/release/condense BENCH_DIR=/mnt/disk bash bench/nbd/fio-bench.sh
#   CONDENSE_OLD=/tmp/condense-before bash bench/nbd/fio-bench.sh   # old and new binary, one run
#   JOBS="seqwrite1m randwrite4k lat4k" bash bench/nbd/fio-bench.sh  # only these jobs
#   SUMMARY_JSON=/tmp/fio.json ...      # also write the table's figures as JSON (bench/regress.sh)
#   # the cost of the background scrub at its default rate, one binary both ways ("old" is off):
#   # (a scrubbing server is never below 5 % of a core: IDLE_TICKS=20 takes 20 % as idle)
#   CONDENSE_OLD=target/release/condense CONDENSE_ARGS="--scrub-every 0" \
#       CONDENSE_OLD_ARGS="--scrub-rate 0" IDLE_TICKS=20 bash bench/nbd/fio-bench.sh
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
PORT_OLD=$((PORT_NBDKIT + 2))
PORT_NULL=$((PORT_NBDKIT + 3))
TARGETS=(plain nbdkit null condense)
[ -n "${CONDENSE_OLD:-}" ] && TARGETS+=(old)
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

# start_condense BINARY POOL PORT [SERVE_ARGS]: a pool with one volume "bench", served.
condense_pids=()
condense_pools=()
start_condense() {
    condense_pools+=("$1|$2")
    "$1" --pool "$2" init >/dev/null
    "$1" --pool "$2" volume create bench --size "$bytes" >/dev/null
    # Plaintext TCP is --insecure-listen since issue 23; a binary from before it has --listen.
    local listen=--insecure-listen
    "$1" serve --help | grep -q -- --insecure-listen || listen=--listen
    # shellcheck disable=SC2086 # the arguments are words
    "$1" --pool "$2" serve "$listen" "127.0.0.1:$3" ${4:-} >"$2.serve.log" 2>&1 &
    pids+=($!)
    condense_pids+=($!)
}

# quiesce: collect every Condense pool's garbage now (`condense gc` through the live pool's
# control socket, which returns when it is done), then wait (at most 60 s) until every server
# is idle: below 5 % of a core over one second. After a write job a pool's background GC
# compacts what the overwrites left dead; started by its 30 s timer, it would otherwise run
# (disk-bound, so CPU-idle) during the next target's job, whichever binary that is.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
quiesce() {
    local waited=0 busy p i
    local -a before
    for p in "${condense_pools[@]}"; do
        "${p%%|*}" --pool "${p#*|}" gc >/dev/null 2>&1 || echo "   (gc of ${p#*|} failed)"
    done
    sync
    while [ "$waited" -lt 60 ]; do
        before=()
        for p in "${condense_pids[@]}"; do before+=("$(cpu_ticks "$p")"); done
        sleep 1
        waited=$((waited + 1))
        busy=0
        for i in "${!condense_pids[@]}"; do
            if [ $(($(cpu_ticks "${condense_pids[$i]}") - before[i])) -ge "${IDLE_TICKS:-5}" ]; then busy=1; fi
        done
        [ "$busy" = 0 ] && break
    done
    if [ "$waited" -gt 1 ]; then
        echo "   (waited ${waited} s for the Condense servers to go idle)"
    fi
}

start_condense "$CONDENSE" "$POOL" "$PORT_CONDENSE" "${CONDENSE_ARGS:-}"
nbdkit --foreground --port "$PORT_NBDKIT" --ipaddr 127.0.0.1 file "$PLAIN" >"$W/nbdkit.log" 2>&1 &
pids+=($!)
nbdkit --foreground --port "$PORT_NULL" --ipaddr 127.0.0.1 null size="$bytes" >"$W/null.log" 2>&1 &
pids+=($!)
URI_NULL=nbd://127.0.0.1:$PORT_NULL/
URI_CONDENSE=nbd://127.0.0.1:$PORT_CONDENSE/bench
URI_NBDKIT=nbd://127.0.0.1:$PORT_NBDKIT/
URI_OLD=nbd://127.0.0.1:$PORT_OLD/bench
wait_nbd "$URI_CONDENSE"
wait_nbd "$URI_NBDKIT"
wait_nbd "$URI_NULL"
nbdcopy --flush "$PLAIN" "$URI_CONDENSE"
if [ -n "${CONDENSE_OLD:-}" ]; then
    start_condense "$CONDENSE_OLD" "$W/pool-old" "$PORT_OLD" "${CONDENSE_OLD_ARGS:-}"
    wait_nbd "$URI_OLD"
    nbdcopy --flush "$PLAIN" "$URI_OLD"
fi

# warm URI: read a volume once before a read job. The plain file is in the page cache since
# it was written; Condense writes large batches with direct I/O (bypassing the page cache).
warm() { nbdcopy "$1" null:; }

# run TARGET NAME FIO-ARGS...: print the fio JSON of one job against one target.
run() {
    local target=$1 name=$2
    shift 2
    local where
    case $target in
        plain) where=(--filename="$PLAIN" --ioengine="$PLAIN_ENGINE") ;;
        nbdkit) where=(--ioengine=nbd --uri="$URI_NBDKIT") ;;
        null) where=(--ioengine=nbd --uri="$URI_NULL") ;;
        condense) where=(--ioengine=nbd --uri="$URI_CONDENSE") ;;
        old) where=(--ioengine=nbd --uri="$URI_OLD") ;;
    esac
    fio --name="$name" "${where[@]}" --size="$bytes" --time_based=1 --runtime="$RUNTIME" \
        --ramp_time="$RAMP" --randrepeat=0 --refill_buffers=1 --output-format=json \
        --output="$W/$target-$name.json" "$@" >/dev/null 2>&1 ||
        {
            echo "fio $name on $target failed"
            grep -h '"error"\|fio: ' "$W/$target-$name.json" 2>/dev/null | head -5
            for log in "$POOL.serve.log" "$W/pool-old.serve.log"; do
                [ -f "$log" ] && { echo "--- $log"; tail -5 "$log"; }
            done
            return 1
        }
}

jobs=(
    "seqread1m|--rw=read --bs=1M --iodepth=4"
    "seqwrite1m|--rw=write --bs=1M --iodepth=4"
    "seqwrite1m-dup|--rw=write --bs=1M --iodepth=4 --dedupe_percentage=100"
    "seqwrite1m-comp|--rw=write --bs=1M --iodepth=4 --buffer_compress_percentage=50 --buffer_compress_chunk=4k"
    "randread4k|--rw=randread --bs=4k --iodepth=32"
    "randwrite4k|--rw=randwrite --bs=4k --iodepth=32"
    "lat4k|--rw=randwrite --bs=4k --iodepth=1"
    "study-seqread1k|--rw=read --bs=1k --iodepth=4"
    "study-randread1k|--rw=randread --bs=1k --iodepth=4"
)
JOBS=${JOBS:-}
for j in "${jobs[@]}"; do
    name=${j%%|*}
    if [ -n "$JOBS" ] && ! [[ " $JOBS " == *" $name "* ]]; then continue; fi
    read -r -a args <<<"${j#*|}"
    for target in "${TARGETS[@]}"; do
        echo "== $name on $target"
        if [[ $name == *read* ]]; then
            case $target in
                condense) warm "$URI_CONDENSE" ;;
                old) warm "$URI_OLD" ;;
            esac
        fi
        # Start every job on a quiet disk: buffered writes of the previous job (the plain
        # file's and nbdkit's) would otherwise be written back during this one's window; and
        # with idle servers (a pool's GC after the previous write job).
        sync
        quiesce
        run "$target" "$name" "${args[@]}"
    done
done

python3 - "$W" "$SIZE" "$RUNTIME" "$PLAIN_ENGINE" "${CONDENSE_OLD:-}" "${SUMMARY_JSON:-}" <<'EOF'
import json, sys, os
w, size, runtime, engine, old, summary = sys.argv[1:7]

def load(target, name):
    path = os.path.join(w, f"{target}-{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["jobs"][0]

def iops(target, name, rw):
    j = load(target, name)
    return j and j[rw]["iops"]

def bw_mib(target, name, rw):
    j = load(target, name)
    return j and j[rw]["bw_bytes"] / 2**20

def lat_us(target, name, pct):
    j = load(target, name)
    return j and j["write"]["clat_ns"]["percentile"][f"{pct:.6f}"] / 1000

rows = [
    ("seq read 1M (MiB/s)", lambda t: bw_mib(t, "seqread1m", "read")),
    ("seq write 1M (MiB/s)", lambda t: bw_mib(t, "seqwrite1m", "write")),
    ("seq write 1M dup (MiB/s)", lambda t: bw_mib(t, "seqwrite1m-dup", "write")),
    ("seq write 1M 2:1 (MiB/s)", lambda t: bw_mib(t, "seqwrite1m-comp", "write")),
    ("rand read 4K qd32 (IOPS)", lambda t: iops(t, "randread4k", "read")),
    ("rand write 4K qd32 (IOPS)", lambda t: iops(t, "randwrite4k", "write")),
    ("write 4K qd1 p50 (us)", lambda t: lat_us(t, "lat4k", 50)),
    ("write 4K qd1 p99 (us)", lambda t: lat_us(t, "lat4k", 99)),
    ("study seq read 1K qd4 (IOPS)", lambda t: iops(t, "study-seqread1k", "read")),
    ("study rand read 1K qd4 (IOPS)", lambda t: iops(t, "study-randread1k", "read")),
]
targets = ["plain", "nbdkit", "null", "condense"] + (["old"] if old else [])
print()
print(f"fio, {size} data set, {runtime} s per job, one connection; plain file via {engine} (buffered)")
if old:
    print(f"old = {old}")
cols = f"{'job':<30}{'plain file':>12}{'nbdkit-file':>13}{'nbdkit-null':>13}{'condense':>11}"
cols += f"{'old':>9}" if old else ""
cols += f"{'cond/plain':>12}{'cond/nbdkit':>13}{'cond/null':>11}" + (f"{'old/plain':>11}" if old else "")
print(cols)
print("-" * len(cols))
values = {}
def ratio(a, b):
    return a / b if a is not None and b else float("nan")
for label, f in rows:
    v = {t: f(t) for t in targets}
    if v["condense"] is None:
        continue
    values[label] = v
    line = f"{label:<30}{v['plain']:>12.0f}{v['nbdkit']:>13.0f}{v['null']:>13.0f}{v['condense']:>11.0f}"
    if old:
        line += f"{v['old']:>9.0f}"
    line += f"{ratio(v['condense'], v['plain']):>11.2f}x{ratio(v['condense'], v['nbdkit']):>12.2f}x"
    line += f"{ratio(v['condense'], v['null']):>10.2f}x"
    if old:
        line += f"{ratio(v['old'], v['plain']):>10.2f}x"
    print(line)
print("(for latencies a ratio above 1 means Condense is slower)")
print()
if summary:
    with open(summary, "w") as f:
        json.dump(values, f)
def goal(label, col, want, at_most=False, or_mib=None):
    if label not in values:
        return
    v = values[label]
    r = ratio(v["condense"], v[col])
    met = r <= want if at_most else r >= want
    if or_mib is not None and v["condense"] >= or_mib:
        met = True
    sign = "<=" if at_most else ">="
    alt = f" (or >= {or_mib} MiB/s)" if or_mib else ""
    print(f"goal: {label} {sign} {want:.0%} of {col}{alt}: {r:.0%} ({'met' if met else 'MISSED'})")
    # The goal may lie past what fio's NBD client reaches at all on this machine.
    ceiling = ratio(v["null"], v[col])
    if not met and not at_most and ceiling < want:
        print(f"      nbdkit-null, which stores nothing, reaches {ceiling:.0%} of {col} in this run (fio's NBD client is one thread: bench/README.md)")
goal("rand read 4K qd32 (IOPS)", "plain", 0.50)
goal("rand read 4K qd32 (IOPS)", "nbdkit", 0.80)
goal("seq read 1M (MiB/s)", "plain", 0.80)
goal("seq write 1M (MiB/s)", "plain", 0.60, or_mib=954)
goal("seq write 1M dup (MiB/s)", "plain", 1.00)
goal("rand write 4K qd32 (IOPS)", "plain", 0.80)
goal("write 4K qd1 p99 (us)", "plain", 2.00, at_most=True)
EOF
