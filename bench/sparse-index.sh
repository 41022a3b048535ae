#!/usr/bin/env bash
# Issue 43: the ten corpus images imported into a dense pool and into a sparse pool whose
# --index-memory is 1/16 of what the dense index uses at the end (its dedup_index_bytes in
# `stats --json`), the two modes alternately, ROUNDS times; then the same ten imported again,
# in reverse order, into the sparse pool: the share of that pass deduplicated inline.
#
#   bench/sparse-index.sh IMAGES_DIR [WORK_DIR] [ROUNDS]
set -euo pipefail
images=${1:?usage: sparse-index.sh IMAGES_DIR [WORK_DIR] [ROUNDS]}
work=${2:-/work/sparse-bench}
rounds=${3:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
rm -rf "$work"; mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

# import_all POOL ORDER...: wall seconds of importing the images in that order
import_all() {
  local pool=$1; shift
  local start; start=$(date +%s.%N)
  local i=0
  for img in "$@"; do
    i=$((i + 1))
    CONDENSE_POOL=$pool "$condense" import "$img" --name "v$i-$(basename "$img" .raw)-$RANDOM" >/dev/null
  done
  sync
  echo "$(date +%s.%N) - $start" | bc
}

mapfile -t order < <(ls "$images"/*.raw)
mapfile -t reverse < <(ls "$images"/*.raw | sort -r)
budget=""
printf '%-6s %-6s %10s %14s %14s %12s\n' round mode seconds du_bytes stored_bytes index_ram
for r in $(seq 1 "$rounds"); do
  for mode in dense sparse; do
    pool=$work/$mode
    rm -rf "$pool"
    if [ "$mode" = dense ]; then
      CONDENSE_POOL=$pool "$condense" init --index dense >/dev/null
    else
      CONDENSE_POOL=$pool "$condense" init --index sparse --index-memory "$budget" >/dev/null
    fi
    secs=$(import_all "$pool" "${order[@]}")
    CONDENSE_POOL=$pool "$condense" stats --json > "$work/$mode.json"
    du=$(du -sb "$pool" | cut -f1)
    ram=$(field "$work/$mode.json" dedup_index_bytes)
    [ "$mode" = dense ] && [ -z "$budget" ] && budget=$(( ram / 16 < 262144 ? 262144 : ram / 16 ))
    printf '%-6s %-6s %10.1f %14s %14s %12s\n' "$r" "$mode" "$secs" "$du" \
      "$(field "$work/$mode.json" stored_bytes)" "$ram"
  done
done
# The second day: the same ten again, reverse order, into the last sparse pool.
pool=$work/sparse
before_u=$(field "$work/sparse.json" unique_chunks); before_w=$(field "$work/sparse.json" written_bytes)
secs=$(import_all "$pool" "${reverse[@]}")
CONDENSE_POOL=$pool "$condense" stats --json > "$work/again.json"
after_u=$(field "$work/again.json" unique_chunks); after_w=$(field "$work/again.json" written_bytes)
bs=$(field "$work/again.json" block_size)
python3 - "$before_u" "$after_u" "$before_w" "$after_w" "$bs" "$secs" <<'PY'
import sys
bu, au, bw, aw, bs, secs = map(float, sys.argv[1:])
new = (au - bu) * bs
print(f"second pass (reverse order, sparse): {secs:.1f} s, {aw - bw:.0f} bytes written, "
      f"{au - bu:.0f} new chunks: {100 * (1 - new / (aw - bw)):.2f} % deduplicated inline")
PY
