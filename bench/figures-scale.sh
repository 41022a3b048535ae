#!/usr/bin/env bash
# The exact per-volume figures (docs/STATS.md) of a pool with many chunks: N unique blocks
# (gen-unique) imported into volume a, the same stream into b (every chunk then named by two
# volumes), and a snapshot a@s (three). Then, per binary given, the page cache dropped (as
# root): `condense stats --json` (open + the figures' first count), its wall time and peak
# RSS, the figures' RAM and scratch-file bytes, a's exclusive and shared chunks, and whether
# the sum rule holds (exclusive parts + shared = chunk bytes). Pass an older build too to
# compare in one run.
#
#   bench/figures-scale.sh N WORK_DIR [CONDENSE_BINARY...]     # e.g. 10000000 /work/fs-bench
#
# The pool is made with the first binary and kept in WORK_DIR/pool (reused when it already
# holds N blocks). Needs jq and /usr/bin/time; builds gen-unique if missing (GEN_UNIQUE=PATH).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
n=${1:?N blocks}
work=${2:?WORK_DIR}
shift 2
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=("$here/target/release/condense")
gen=${GEN_UNIQUE:-$here/target/release/gen-unique}
[ -x "$gen" ] || (cd "$here" && cargo build --release -p condense-bench --bin gen-unique)
pool=$work/pool
size=$((n * 4096))
mkdir -p "$work"
c=${bins[0]}
if [ "$(jq -r '.unique_chunks' "$work/made.json" 2>/dev/null || echo 0)" != "$n" ]; then
    rm -rf "$pool"
    "$c" init "$pool" >/dev/null
    for v in a b; do
        t0=$EPOCHREALTIME
        "$gen" --blocks "$n" --seed 1 | "$c" --pool "$pool" import - --name "$v" --size "$size" >/dev/null
        echo "import of $n blocks into $v: $(echo "$EPOCHREALTIME - $t0" | bc) s"
    done
    "$c" --pool "$pool" snapshot create a s >/dev/null
    "$c" --pool "$pool" stats --json >"$work/made.json"
fi
echo
echo "| binary | stats wall s | peak RSS MiB | figures RAM MiB | scratch MiB | a: exclusive, shared chunks | sum rule | error |"
echo "|---|---|---|---|---|---|---|---|"
for bin in "${bins[@]}"; do
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    t0=$EPOCHREALTIME
    /usr/bin/time -f %M -o "$work/rss" "$bin" --pool "$pool" stats --json >"$work/stats.json"
    wall=$(echo "$EPOCHREALTIME - $t0" | bc)
    jq -r --arg bin "$bin" --arg wall "$wall" --arg rss "$(cat "$work/rss")" '
      def mib: if . == null then "n/a" else (. / 1048576 * 10 | round / 10 | tostring) end;
      (.volumes[] | select(.name == "a")) as $a
      | ([.volumes[], .snapshots[] | .exclusive_bytes // 0] | add) as $excl
      | [$bin, ($wall | tonumber * 100 | round / 100 | tostring), ($rss | tonumber / 1024 | round | tostring),
         (.attribution_ram_bytes | mib), (.attribution_scratch_bytes | mib),
         "\($a.exclusive_chunks), \($a.shared_chunks)",
         (if .attribution_error != null then "n/a" elif $excl + .shared_bytes == .chunk_bytes then "holds" else "BROKEN" end),
         (.attribution_error // "" | .[0:60])]
      | "| " + join(" | ") + " |"' "$work/stats.json"
done
