#!/usr/bin/env bash
# What the first count of the exact per-volume figures (docs/STATS.md) costs the I/O of a
# served pool: `serve` a pool, run fio random 4 KiB reads at queue depth 1 over NBD on one
# volume for RUNTIME s, and ask `condense stats` through the daemon at 3 s (the first figures
# after an open are counted then). Prints how long `stats` took and fio's read latency
# percentiles and maximum, per binary, so an older build can run beside ours.
#
#   POOL=/path/to/pool VOLUME=db1 bench/figures-stall.sh [CONDENSE_BINARY...]
#
# POOL must be a local pool holding VOLUME (e.g. the corpus imported with bench/corpus-import.sh);
# it is only read. Default binary: target/release/condense. Needs fio with the nbd engine.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
pool=${POOL:?POOL=/path/to/pool}
volume=${VOLUME:-db1}
runtime=${RUNTIME:-12}
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=("$here/target/release/condense")
work=$(mktemp -d /tmp/figures-stall.XXXXXX)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
for bin in "${bins[@]}"; do
    sock=$work/nbd.sock
    "$bin" --pool "$pool" serve --socket "$sock" --read-only >"$work/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1 100); do [ -S "$sock" ] && break; sleep 0.1; done
    fio --name=qd1 --ioengine=nbd --uri="nbd+unix:///$volume?socket=$sock" --rw=randread --bs=4k \
        --iodepth=1 --time_based --runtime="$runtime" --size=1G --output-format=json --output="$work/fio.json" \
        >"$work/fio.out" 2>&1 &
    fio_pid=$!
    sleep 3
    t0=$(date +%s.%N)
    "$bin" --pool "$pool" stats >/dev/null
    stats_s=$(echo "$(date +%s.%N) - $t0" | bc)
    wait "$fio_pid"
    kill "$server"; wait "$server" 2>/dev/null || true; server=
    jq -r --arg b "$bin" --arg s "$stats_s" '.jobs[0].read |
        "\($b): stats took \($s | tonumber * 100 | round / 100) s; reads \(.total_ios), p50 \(.clat_ns.percentile["50.000000"] / 1000 | round) us, p99 \(.clat_ns.percentile["99.000000"] / 1000 | round) us, p99.99 \(.clat_ns.percentile["99.990000"] / 1000 | round) us, max \(.clat_ns.max / 1000000 | . * 10 | round / 10) ms"' "$work/fio.json"
done
