#!/usr/bin/env bash
# Issue 44: delta compression on the ten corpus images. Per configuration (zstd:3 and lz4, each
# without and with `init --delta`): a fresh pool, `condense import` of each image (wall time),
# `du -sb` of the pool, the delta figures of `stats --json`, then a full read-back (`condense
# export` of every volume, one at a time, to a scratch file removed at once; wall time).
#
#   bench/delta.sh IMAGES_DIR [WORK_DIR] [SCRATCH_DIR]
#
# WORK_DIR (default /work/d44) holds one pool at a time and is removed at the end; SCRATCH_DIR
# (default /dev/shm) takes each export (as big as the largest image's data). CONFIGS overrides
# the list, e.g. CONFIGS="zstd:3 zstd:3+delta".
set -euo pipefail
images=${1:?usage: delta.sh IMAGES_DIR [WORK_DIR] [SCRATCH_DIR]}
work=${2:-/work/d44}
scratch=${3:-/dev/shm}
configs=${CONFIGS:-"zstd:3 zstd:3+delta lz4 lz4+delta"}
here=$(cd "$(dirname "$0")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
[ -x "$condense" ] || (cd "$here" && cargo build --release -p condense)
rm -rf "$work"; mkdir -p "$work"
out=$scratch/delta-bench-export.raw
trap 'rm -rf "$work" "$out"' EXIT
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
now() { date +%s.%N; }

printf '%-12s %14s %9s %9s %10s %12s %14s\n' config du_bytes import_s read_s deltas sketch_ram ram_per_chunk
for c in $configs; do
  comp=${c%+delta}
  delta=(); [ "$comp" != "$c" ] && delta=(--delta)
  export CONDENSE_POOL=$work/pool
  rm -rf "$CONDENSE_POOL"
  "$condense" init --compression "$comp" "${delta[@]}" >/dev/null
  sync
  start=$(now)
  for img in "$images"/*.raw; do
    "$condense" import "$img" >/dev/null
  done
  sync
  import_s=$(echo "$(now) - $start" | bc)
  du=$(du -sb "$CONDENSE_POOL" | cut -f1)
  # The delta figures are the importing process's: count deltas over the pool's life.
  "$condense" stats --json > "$work/stats.json"
  # The read-back, cold: the pool's pages dropped from the page cache if we may.
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
  start=$(now)
  for img in "$images"/*.raw; do
    "$condense" export "$(basename "$img" .raw)" "$out" --force >/dev/null
    rm -f "$out"
  done
  read_s=$(echo "$(now) - $start" | bc)
  printf '%-12s %14s %9.1f %9.1f %10s %12s %14s\n' "$c" "$du" "$import_s" "$read_s" \
    "$(field "$work/stats.json" delta_chunks_written)" \
    "$(field "$work/stats.json" sketch_index_bytes)" \
    "$(field "$work/stats.json" sketch_index_bytes_per_chunk)"
  rm -rf "$CONDENSE_POOL"
done
