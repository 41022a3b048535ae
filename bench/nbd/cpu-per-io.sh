#!/usr/bin/env bash
# CPU per request of the NBD server: old and new binary, alternated, the same fixed amount of
# I/O each time. Throughput on a noisy 2-core machine moves 30 % between runs; the server's
# own CPU time per request (perf stat's task-clock on its process; instructions too where the
# machine has performance counters: a VM often has none, and the column is then 0) moves
# less, so this tells whether a change made the server dearer when fio-bench cannot.
#
#   CONDENSE=new CONDENSE_OLD=old bash bench/nbd/cpu-per-io.sh
#   ROUNDS=5 IO=512M JOBS="randwrite4k seqwrite1m" bash bench/nbd/cpu-per-io.sh
#   JOBS=seqread1m-warm ...   # the read from the page cache: read once before it is measured
#
# Each round: for each binary (the order swaps every round), a fresh pool with one 1 GiB
# volume, served over TCP; fio writes IO bytes of random data (incompressible, unique) with
# the job's pattern, then reads them back with the same pattern; perf counts the server's
# instructions and task-clock over the fio run only. Prints per job and binary the median
# over the rounds, and new/old. Needs: perf, fio, nbdinfo. Prints figures; asserts nothing.

set -euo pipefail
NEW=${CONDENSE:?set CONDENSE to the new binary}
OLD=${CONDENSE_OLD:?set CONDENSE_OLD to the old binary}
ROUNDS=${ROUNDS:-3}
IO=${IO:-256M}
JOBS=${JOBS:-randwrite4k seqwrite1m randread4k seqread1m}
BASE=${BENCH_DIR:-/tmp}
for tool in perf fio nbdinfo; do
    command -v "$tool" >/dev/null || { echo "missing $tool"; exit 1; }
done
W=$(mktemp -d "$BASE/cpu-per-io.XXXXXX")
server=
cleanup() {
    [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
    rm -rf "$W"
}
trap cleanup EXIT

job_args() {
    case $1 in
        randwrite4k) echo "--rw=randwrite --bs=4k --iodepth=32" ;;
        seqwrite1m) echo "--rw=write --bs=1M --iodepth=4" ;;
        randread4k) echo "--rw=randread --bs=4k --iodepth=32" ;;
        seqread1m | seqread1m-warm) echo "--rw=read --bs=1M --iodepth=4" ;;
        *) echo "unknown job $1" >&2; exit 1 ;;
    esac
}

# measure BINARY JOB: prints "instructions task_clock_ms requests"
measure() {
    local bin=$1 job=$2 pool=$W/pool port=$((20000 + RANDOM % 20000)) fill=
    rm -rf "$pool"
    "$bin" --pool "$pool" init >/dev/null
    "$bin" --pool "$pool" volume create bench --size 1G >/dev/null
    "$bin" --pool "$pool" serve --insecure-listen "127.0.0.1:$port" >"$W/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1 100); do nbdinfo "nbd://127.0.0.1:$port" >/dev/null 2>&1 && break; sleep 0.1; done
    case $job in
        *read*) fill="--rw=write --bs=1M --iodepth=4" ;;
    esac
    if [ -n "$fill" ]; then
        # shellcheck disable=SC2086
        fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:$port/" --size=1G --io_size="$IO" \
            --refill_buffers=1 $fill --output=/dev/null
    fi
    if [[ $job == *-warm ]]; then
        # Read once unmeasured: the segments are then in the page cache (direct-I/O writes
        # leave them out), so the measured read is the server's own CPU, not the disk's.
        # shellcheck disable=SC2046
        fio --name=warm --ioengine=nbd --uri="nbd://127.0.0.1:$port/" --size=1G --io_size="$IO" \
            $(job_args "$job") --output=/dev/null
    fi
    # shellcheck disable=SC2046
    perf stat -x, -e instructions,task-clock -p "$server" -o "$W/perf.txt" -- \
        fio --name="$job" --ioengine=nbd --uri="nbd://127.0.0.1:$port/" --size=1G --io_size="$IO" \
            --randrepeat=0 --refill_buffers=1 $(job_args "$job") --output-format=json \
            --output="$W/fio.json" >/dev/null 2>&1
    kill "$server"; wait "$server" 2>/dev/null || true; server=
    python3 - "$W/perf.txt" "$W/fio.json" <<'EOF'
import json, sys
ins = clock = 0.0
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) > 3 and f[2] == "instructions" and f[0][:1].isdigit():
        ins = float(f[0])
    if len(f) > 3 and f[2] == "task-clock":
        clock = float(f[0])
j = json.load(open(sys.argv[2]))["jobs"][0]
reqs = j["read"]["total_ios"] + j["write"]["total_ios"]
print(ins, clock, reqs)
EOF
}

declare -A results
for r in $(seq 1 "$ROUNDS"); do
    for job in $JOBS; do
        if [ $((r % 2)) = 1 ]; then order="new old"; else order="old new"; fi
        for which in $order; do
            bin=$NEW; [ "$which" = old ] && bin=$OLD
            read -r ins clock reqs < <(measure "$bin" "$job")
            results[$job,$which]+="$ins/$clock/$reqs "
            echo "round $r $job $which: $(awk -v i="$ins" -v c="$clock" -v n="$reqs" 'BEGIN { printf "%.0f instructions, %.1f us CPU per request (%d requests)", i / n, c * 1000 / n, n }')"
        done
    done
done
echo
printf "%-12s %16s %16s %7s %14s %14s %7s\n" job "new instr/req" "old instr/req" new/old "new CPU us/req" "old CPU us/req" new/old
for job in $JOBS; do
    python3 - "$job" "${results[$job,new]}" "${results[$job,old]}" <<'EOF'
import statistics, sys
def per(s):
    rows = [tuple(float(x) for x in r.split("/")) for r in s.split()]
    return (statistics.median(i / n for i, _, n in rows),
            statistics.median(c * 1000 / n for _, c, n in rows))
job, new, old = sys.argv[1], per(sys.argv[2]), per(sys.argv[3])
ratio = lambda a, b: a / b if b else 0.0
print(f"{job:<12} {new[0]:>16.0f} {old[0]:>16.0f} {ratio(new[0], old[0]):>7.3f} {new[1]:>14.2f} {old[1]:>14.2f} {ratio(new[1], old[1]):>7.3f}")
EOF
done
