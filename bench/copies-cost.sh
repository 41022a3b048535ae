#!/usr/bin/env bash
# What the second copies of the superblock and the checkpoint root cost (issue 28): the time
# to open a pool (`condense volume list`) and to write a checkpoint (`condense snapshot
# create`, which is made inside one), old binary and new side by side, alternating, medians
# of RUNS. Both pools hold the same volume (IMAGE, default 64 MiB of random data).
#
#   CONDENSE_OLD=/path/to/condense-before bash bench/copies-cost.sh
#   RUNS=15 IMAGE=/work/corpus/images/dns1.raw CONDENSE_OLD=... bash bench/copies-cost.sh
#
# Prints milliseconds; asserts nothing.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${RUNS:-9}
NEW=${CONDENSE:-$ROOT/target/release/condense}
OLD=${CONDENSE_OLD:?set CONDENSE_OLD to the binary to compare with}
W=$(mktemp -d "${TMPDIR:-/tmp}/condense-copies.XXXXXX")
trap 'rm -rf "$W"' EXIT
IMAGE=${IMAGE:-}
if [ -z "$IMAGE" ]; then
    IMAGE=$W/img.raw
    head -c 64M /dev/urandom >"$IMAGE"
fi
for b in old new; do
    bin=$OLD
    [ $b = new ] && bin=$NEW
    "$bin" --pool "$W/$b" init >/dev/null
    # (--format came with issue 23; a raw image needs none in the builds before)
    fmt=(--format raw)
    "$bin" import --help | grep -q -- --format || fmt=()
    "$bin" --pool "$W/$b" import "${fmt[@]}" --name vm "$IMAGE" >/dev/null
done
# milliseconds with one decimal
ms() {
    local t0 t1
    t0=$(date +%s%N)
    "$@" >/dev/null
    t1=$(date +%s%N)
    awk -v d=$((t1 - t0)) 'BEGIN { printf "%.1f\n", d / 1e6 }'
}
median() { sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }
declare -A open_ms snap_ms
for i in $(seq 1 "$RUNS"); do
    for b in old new; do
        bin=$OLD
        [ $b = new ] && bin=$NEW
        open_ms[$b]+="$(ms "$bin" --pool "$W/$b" volume list) "
        snap_ms[$b]+="$(ms "$bin" --pool "$W/$b" snapshot create vm "s$i") "
    done
done
printf '%-28s %10s %10s\n' "median of $RUNS (ms)" old new
for what in open snap; do
    label="open (volume list)"
    [ $what = snap ] && label="checkpoint (snapshot create)"
    o=$(eval "echo \${${what}_ms[old]}" | tr ' ' '\n' | grep . | median)
    n=$(eval "echo \${${what}_ms[new]}" | tr ' ' '\n' | grep . | median)
    printf '%-28s %10s %10s\n' "$label" "$o" "$n"
done
