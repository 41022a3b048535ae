#!/usr/bin/env bash
# What bounds Condense's writes over NBD on this disk (issue 45): each write job against a plain
# file written through the page cache, the same file with O_DIRECT (what the disk itself gives
# a direct write), nbdkit-null (fio's NBD client and the protocol alone: a server that stores
# nothing) and Condense; with each job the CPU the server and fio used, and optionally where
# Condense's server spent its CPU (perf, by component).
#
#   bash bench/nbd/write-account.sh                               # the repository's disk
#   BENCH_DIR=/mnt/slow/dir WRAP="CMD ARGS" bash bench/nbd/write-account.sh
#   PROFILE=1 SIZE=1G RUNTIME=10 JOBS="seqwrite1m lat4k" bash bench/nbd/write-account.sh
#
# WRAP is a command prefix the servers and the plain file's fio run under (e.g. one that
# puts them into a cgroup with a blkio throttle, making an HDD-like disk of BENCH_DIR): a
# throttle charges direct writes and syncs to the process, while buffered writes written
# back later by the kernel escape it, so on such a disk only the O_DIRECT column is the disk.
#
# Jobs (random, incompressible, unique data; one connection; 1 GiB by default):
#   seqwrite1m   sequential 1 MiB writes, queue depth 4
#   lat4k        random 4 KiB writes, queue depth 1, no flush (latency: p50, p99)
#   lat4k-flush  the same with a flush after every write (fio --fsync=1: NBD_CMD_FLUSH; the
#                plain file gets fsync): what a sync of the journal costs a write
# Columns: MiB/s or latency; "srv CPU" is the server's CPU over the job in % of one core
# (utime + stime from /proc; the plain file's column shows 0: the kernel's work is charged
# to fio), "fio CPU" fio's own (usr + sys from its JSON). Two cores: a server near 100 %
# and fio near 100 % mean the job is CPU-bound, whatever the disk.
# Needs: fio, nbdkit, nbdinfo, python3; perf for PROFILE=1. Prints figures; asserts nothing.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIZE=${SIZE:-1G}
RUNTIME=${RUNTIME:-10}
RAMP=${RAMP:-2}
JOBS=${JOBS:-seqwrite1m lat4k lat4k-flush}
read -r -a WRAP_CMD <<<"${WRAP:-}"
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=$ROOT/target/release/condense
fi
for tool in fio nbdkit nbdinfo python3; do
    command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install fio nbdkit libnbd-bin python3)"; exit 1; }
done
[ "${PROFILE:-0}" = 1 ] && { command -v perf >/dev/null || { echo "PROFILE=1 needs perf"; exit 1; }; }

BASE=${BENCH_DIR:-$ROOT/target/bench-nbd}
mkdir -p "$BASE"
W=$(mktemp -d "$BASE/account.XXXXXX")
PLAIN=$W/plain.raw
POOL=$W/pool
PORT=$((20000 + RANDOM % 10000))
PORT_NULL=$((PORT + 1))
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

echo "== setup: $SIZE plain file and a Condense volume in $W ($(df -h "$W" | awk 'NR==2 {print $1}'))"
"${WRAP_CMD[@]}" fio --name=fill --filename="$PLAIN" --size="$SIZE" --rw=write --bs=1M \
    --ioengine=psync --refill_buffers=1 --end_fsync=1 --output=/dev/null
bytes=$(stat -c %s "$PLAIN")
"$CONDENSE" --pool "$POOL" init >/dev/null
"$CONDENSE" --pool "$POOL" volume create bench --size "$bytes" >/dev/null
"${WRAP_CMD[@]}" "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" \
    >"$W/serve.log" 2>&1 &
server=$!
pids+=("$server")
nbdkit --foreground --port "$PORT_NULL" --ipaddr 127.0.0.1 null size="$bytes" >"$W/null.log" 2>&1 &
pids+=($!)
wait_nbd "nbd://127.0.0.1:$PORT/bench"
wait_nbd "nbd://127.0.0.1:$PORT_NULL/"
# The volume holds data before the overwrite jobs, as the plain file does.
"${WRAP_CMD[@]}" fio --name=prefill --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/bench" \
    --size="$bytes" --rw=write --bs=1M --iodepth=4 --refill_buffers=1 --output=/dev/null

ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }

# run TARGET JOB FIO-ARGS...: one job on one target; writes TARGET-JOB.json and .cpu
run() {
    local target=$1 job=$2
    shift 2
    local where=() wrap=() pid=
    case $target in
        plain) where=(--filename="$PLAIN" --ioengine=io_uring) wrap=("${WRAP_CMD[@]}") ;;
        direct) where=(--filename="$PLAIN" --ioengine=io_uring --direct=1) wrap=("${WRAP_CMD[@]}") ;;
        null) where=(--ioengine=nbd --uri="nbd://127.0.0.1:$PORT_NULL/") ;;
        condense) where=(--ioengine=nbd --uri="nbd://127.0.0.1:$PORT/bench") pid=$server ;;
    esac
    sync
    # a pool's GC of what the previous overwrite left dead runs now, not during this job
    [ "$target" = condense ] && { "$CONDENSE" --pool "$POOL" gc >/dev/null 2>&1 || true; }
    local t0 c0 prof=()
    t0=$(date +%s%N)
    c0=$([ -n "$pid" ] && ticks "$pid" || echo 0)
    if [ "${PROFILE:-0}" = 1 ] && [ "$target" = condense ]; then
        perf record -q -F 499 -g -p "$server" -o "$W/perf-$job.data" -- sleep "$((RUNTIME + RAMP))" \
            >/dev/null 2>&1 &
        prof=($!)
    fi
    "${wrap[@]}" fio --name="$job" "${where[@]}" --size="$bytes" --time_based=1 \
        --runtime="$RUNTIME" --ramp_time="$RAMP" --randrepeat=0 --refill_buffers=1 \
        --output-format=json --output="$W/$target-$job.json" "$@" >/dev/null 2>&1 ||
        { echo "fio $job on $target failed"; tail -5 "$W/serve.log"; return 1; }
    local c1 t1
    c1=$([ -n "$pid" ] && ticks "$pid" || echo 0)
    t1=$(date +%s%N)
    echo "$(((c1 - c0) * 10)) $(((t1 - t0) / 1000000))" >"$W/$target-$job.cpu" # ms of CPU, ms of wall
    [ ${#prof[@]} -gt 0 ] && wait "${prof[0]}" 2>/dev/null || true
}

declare -A ARGS=(
    [seqwrite1m]="--rw=write --bs=1M --iodepth=4"
    [lat4k]="--rw=randwrite --bs=4k --iodepth=1"
    [lat4k-flush]="--rw=randwrite --bs=4k --iodepth=1 --fsync=1"
)
for job in $JOBS; do
    [ -n "${ARGS[$job]:-}" ] || { echo "unknown job $job (seqwrite1m lat4k lat4k-flush)"; exit 2; }
    read -r -a args <<<"${ARGS[$job]}"
    for target in plain direct null condense; do
        echo "== $job on $target"
        run "$target" "$job" "${args[@]}"
    done
done

python3 - "$W" "$SIZE" "$RUNTIME" "$JOBS" <<'EOF'
import json, os, sys
w, size, runtime, jobs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
targets = [("plain", "plain file"), ("direct", "O_DIRECT"), ("null", "nbdkit-null"), ("condense", "condense")]
def load(t, j):
    p = os.path.join(w, f"{t}-{j}.json")
    if not os.path.exists(p):
        return None, None
    job = json.load(open(p))["jobs"][0]
    ms, wall = map(int, open(os.path.join(w, f"{t}-{j}.cpu")).read().split())
    return job, (100.0 * ms / wall if wall else 0.0)
print()
print(f"fio, {size}, {runtime} s per job, one connection; random incompressible data")
print(f"{'job':<14}{'target':<13}{'MiB/s':>7}{'IOPS':>8}{'p50 us':>8}{'p99 us':>8}{'flush p50':>10}{'flush p99':>10}{'srv CPU':>8}{'fio CPU':>8}{'/plain':>8}{'/direct':>8}")
for j in jobs:
    res = {}
    for t, label in targets:
        job, srv = load(t, j)
        if job is None:
            continue
        wr = job["write"]
        pct = wr["clat_ns"]["percentile"]
        sync = job.get("sync", {}).get("lat_ns", {}).get("percentile") or {}
        res[t] = dict(bw=wr["bw_bytes"] / 2**20, iops=wr["iops"], p50=pct["50.000000"] / 1000,
                      p99=pct["99.000000"] / 1000,
                      f50=sync.get("50.000000", 0) / 1000, f99=sync.get("99.000000", 0) / 1000,
                      srv=srv, fio=job["usr_cpu"] + job["sys_cpu"], label=label)
    for t, r in res.items():
        # the figure a job is judged by: throughput for seqwrite1m, the write's p99 for
        # lat4k, writes + flushes per second for lat4k-flush
        key = "bw" if j.startswith("seq") else ("iops" if j.endswith("flush") else "p99")
        def rel(base):
            b = res.get(base)
            return r[key] / b[key] if b and b[key] else float("nan")
        flush = f"{r['f50']:>10.0f}{r['f99']:>10.0f}" if j.endswith("flush") else f"{'':>20}"
        print(f"{j:<14}{r['label']:<13}{r['bw']:>7.0f}{r['iops']:>8.0f}{r['p50']:>8.0f}{r['p99']:>8.0f}"
              f"{flush}{r['srv']:>7.0f}%{r['fio']:>7.0f}%{rel('plain'):>7.2f}x{rel('direct'):>7.2f}x")
print("(/plain, /direct: MiB/s ratio for seqwrite1m, p99 ratio for lat4k (above 1 = slower), IOPS ratio for lat4k-flush)")
EOF

if [ "${PROFILE:-0}" = 1 ]; then
    for job in $JOBS; do
        [ -f "$W/perf-$job.data" ] || continue
        echo
        echo "== where the Condense server's CPU went during $job (perf, self time by component)"
        perf report -i "$W/perf-$job.data" --no-children --sort sym --stdio -g none 2>/dev/null |
            python3 "$ROOT/bench/nbd/perf-components.py"
    done
fi
