#!/usr/bin/env bash
# Issue 43: the ten corpus images imported into a dense pool and into a sparse pool whose
# --index-memory is 1/16 of what the dense index uses at the end (its dedup_index_bytes in
# `stats --json`), the two modes alternately, ROUNDS times; then the merge pass and GC on the
# last sparse pool (`condense index merge`: its wall time, stored and du bytes against dense's);
# then the same ten imported again, in reverse order, into the sparse pool: the share of that
# pass deduplicated inline.
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
# The merge pass and GC on the last sparse pool, against the last dense one.
pool=$work/sparse
start=$(date +%s.%N)
CONDENSE_POOL=$pool "$condense" index merge --json > "$work/merge.json"
secs=$(echo "$(date +%s.%N) - $start" | bc)
CONDENSE_POOL=$pool "$condense" stats --json > "$work/merged.json"
CONDENSE_POOL=$work/dense "$condense" stats --json > "$work/dense-final.json"
python3 - "$work/merge.json" "$work/merged.json" "$work/dense-final.json" "$(du -sb "$pool" | cut -f1)" \
  "$(du -sb "$work/dense" | cut -f1)" "$secs" <<'PY'
import json, sys
m, s, d = (json.load(open(f)) for f in sys.argv[1:4])
du_s, du_d, secs = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
print(f"merge pass + GC: {secs:.1f} s, {m['chunks_sorted']} chunks sorted in {m['sort_runs']} run(s), "
      f"{m['merged']} merged; sparse/dense stored_bytes {s['stored_bytes'] / d['stored_bytes']:.4f}, "
      f"du {du_s / du_d:.4f}, unique chunks {s['unique_chunks']} / {d['unique_chunks']}")
PY
cp "$work/merged.json" "$work/sparse.json"
# The second day: the same ten again, reverse order, into the last sparse pool.
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
