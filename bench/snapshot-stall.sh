#!/usr/bin/env bash
# What a snapshot costs the I/O of a served pool whose per-volume figures are kept
# (docs/STATS.md): per binary, a fresh copy of POOL is served, the figures' first count is
# waited for, then fio reads 4 KiB at random at queue depth 1 from VOLUME for RUNTIME s, and
# RUNTIME/3 s into it `condense snapshot create VOLUME stall` runs through the daemon. Prints
# the snapshot command's wall time, the reads' p99.99 and maximum latency, and how long the
# figures took to be whole again (the next `stats`). Pass an older build too to compare.
#
#   POOL=/work/fs-pristine VOLUME=a bench/snapshot-stall.sh [CONDENSE_BINARY...]
#
# ACTION replaces the snapshot (e.g. ACTION="volume delete b"). Needs fio (nbd engine),
# nbdinfo, jq; WORK (default /work/snapshot-stall) holds the copies.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
pool=${POOL:?POOL=/path/to/pool}
volume=${VOLUME:-a}
runtime=${RUNTIME:-15}
work=${WORK:-/work/snapshot-stall}
read -r -a action <<<"${ACTION:-snapshot create $volume stall}"
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=("$here/target/release/condense")
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
echo "| binary | ${action[*]}: wall s | reads p99.99 ms | reads max ms | next stats s |"
echo "|---|---|---|---|---|"
for bin in "${bins[@]}"; do
    rm -rf "$work"; mkdir -p "$work"
    cp -a "$pool" "$work/pool"
    sock=$work/nbd.sock
    CONDENSE_LOG=info "$bin" --pool "$work/pool" serve --socket "$sock" >"$work/serve.log" 2>&1 &
    server=$!
    uri="nbd+unix:///$volume?socket=$sock"
    for _ in $(seq 1 1000); do nbdinfo --size "$uri" >/dev/null 2>&1 && break; sleep 0.05; done
    for _ in $(seq 1 600); do grep -q "attribution counted" "$work/serve.log" && break; sleep 0.1; done
    fio --name=qd1 --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=1 --time_based \
        --runtime="$runtime" --size=1G --output-format=json --output="$work/fio.json" >/dev/null 2>&1 &
    fio_pid=$!
    sleep $((runtime / 3))
    t0=$EPOCHREALTIME
    "$bin" --pool "$work/pool" "${action[@]}" >/dev/null
    snap=$(echo "$EPOCHREALTIME - $t0" | bc)
    wait $fio_pid
    t0=$EPOCHREALTIME
    "$bin" --pool "$work/pool" stats >/dev/null
    st=$(echo "$EPOCHREALTIME - $t0" | bc)
    kill "$server"; wait "$server" 2>/dev/null || true; server=
    jq -r --arg bin "$bin" --arg snap "$snap" --arg st "$st" '.jobs[0].read.clat_ns as $c
      | "| \($bin) | \($snap) | \($c.percentile["99.990000"] / 1e6 * 100 | round / 100) | \($c.max / 1e6 * 100 | round / 100) | \($st) |"' "$work/fio.json"
done
