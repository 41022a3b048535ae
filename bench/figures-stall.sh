#!/usr/bin/env bash
# What the first count of the exact per-volume figures (docs/STATS.md) costs a served pool.
# `serve` counts them a moment after it starts (its status publication); an older build
# counted them before it answered at all. Per binary: the page cache dropped (as root), `serve`
# started, the time until the first NBD answer (nbdinfo), then fio random 4 KiB reads at queue
# depth 1 on one volume for RUNTIME s straight away, while the count runs: read latency
# percentiles and maximum. Then `condense stats` through the daemon, timed. Pass an older build
# too to compare in one run.
#
#   POOL=/path/to/pool VOLUME=db1 bench/figures-stall.sh [CONDENSE_BINARY...]
#
# POOL: a local pool holding VOLUME (the corpus imported with bench/corpus-import.sh); it is
# served read-only. Default binary: target/release/condense. Needs fio (nbd engine), nbdinfo, jq.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
pool=${POOL:?POOL=/path/to/pool}
volume=${VOLUME:-db1}
runtime=${RUNTIME:-10}
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=("$here/target/release/condense")
work=$(mktemp -d /tmp/figures-stall.XXXXXX)
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
now() { date +%s.%N; }
for bin in "${bins[@]}"; do
    sock=$work/nbd.sock
    rm -f "$sock"
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    t0=$(now)
    "$bin" --pool "$pool" serve --socket "$sock" --read-only >"$work/serve.log" 2>&1 &
    server=$!
    uri="nbd+unix:///$volume?socket=$sock"
    for _ in $(seq 1 1000); do nbdinfo --size "$uri" >/dev/null 2>&1 && break; sleep 0.01; done
    ready=$(echo "$(now) - $t0" | bc)
    fio --name=qd1 --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=1 --time_based \
        --runtime="$runtime" --size=1G --output-format=json --output="$work/fio.json" >"$work/fio.out" 2>&1
    t1=$(now)
    "$bin" --pool "$pool" stats >/dev/null
    stats_s=$(echo "$(now) - $t1" | bc)
    kill "$server"; wait "$server" 2>/dev/null || true; server=
    jq -r --arg b "$bin" --arg r "$ready" --arg s "$stats_s" '.jobs[0].read |
        "\($b): first answer after \($r | tonumber * 100 | round / 100) s; then \(.total_ios) reads: p50 \(.clat_ns.percentile["50.000000"] / 1000 | round) us, p99 \(.clat_ns.percentile["99.000000"] / 1000 | round) us, p99.99 \(.clat_ns.percentile["99.990000"] / 1000 | round) us, max \(.clat_ns.max / 1000000 | . * 10 | round / 10) ms; stats \($s | tonumber * 100 | round / 100) s"' "$work/fio.json"
done
