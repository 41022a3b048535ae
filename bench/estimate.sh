#!/usr/bin/env bash
# `condense estimate` on the corpus images: how fast (GB/s of non-zero data), and how close the
# projection is to what `condense import` of the same images then stores (`condense stats`).
#
#   bench/estimate.sh [IMAGES_DIR] [WORK_DIR] [COMPRESSION]    # COMPRESSION: lz4 | zstd:N
#
# IMAGES_DIR defaults to /work/corpus/images (the ten images of ../shared/corpus/build.sh).
# Set SKIP_IMPORT=1 to time the estimate only; CHUNKINGS=fixed:4K,fixed:16K,cdc:8K to time
# several chunkings in one pass as well; COLD=1 to start from a dropped page cache.
# Needs jq, /usr/bin/time and bc.
set -euo pipefail
images=${1:-/work/corpus/images}
work=${2:-/work/estimate-bench}
comp=${3:-lz4}
here=$(cd "$(dirname "$0")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
[ -x "$condense" ] || (cd "$here" && cargo build --release -p condense)
for t in jq bc /usr/bin/time; do
  command -v "$t" >/dev/null || { echo "estimate.sh needs $t (apt-get install jq bc time)" >&2; exit 1; }
done
rm -rf "$work"; mkdir -p "$work"
shopt -s nullglob
imgs=("$images"/*.raw "$images"/*.qcow2 "$images"/*.vmdk "$images"/*.vdi "$images"/*.vhdx)
[ ${#imgs[@]} -gt 0 ] || { echo "no images in $images" >&2; exit 1; }
echo "images: ${#imgs[@]} in $images, $(du -cb --apparent-size "${imgs[@]}" | tail -1 | cut -f1) bytes apparent, $(du -c -B1 "${imgs[@]}" | tail -1 | cut -f1) allocated; $(nproc) cores"

gbps() { echo "scale=3; $1 / $2 / 1000000000" | bc -l; }

# One estimate; prints elapsed, CPU and RSS; leaves the JSON in $work/$1.json.
estimate() {
  local tag=$1; shift
  /usr/bin/time -f "%e %P %M" -o "$work/$tag.time" \
    "$condense" estimate --json --compression "$comp" "$@" "${imgs[@]}" > "$work/$tag.json"
  read -r secs cpu rss < "$work/$tag.time"
  local nz; nz=$(jq .total.nonzero_bytes "$work/$tag.json")
  printf '%-28s %6.2f s  %6s GB/s of non-zero data (%s bytes)  CPU %s  peak RSS %d MB\n' \
    "$tag" "$secs" "$(gbps "$nz" "$secs")" "$nz" "$cpu" "$((rss / 1024))"
}

# COLD=1 first drops the page cache (machine-wide: other jobs on the machine will notice).
if [ "${COLD:-0}" = 1 ] && sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
  estimate "estimate (cold cache)"
else
  estimate "estimate (first run)"
fi
estimate "estimate (warm cache)"
cp "$work/estimate (warm cache).json" "$work/estimate.json"
if [ -n "${CHUNKINGS:-}" ]; then
  estimate "estimate --chunking $CHUNKINGS" --chunking "$CHUNKINGS"
  jq -r '.chunkings[] | "  \(.chunking): unique \(.total.unique_bytes) bytes, projected \(.total.projected_physical_bytes) bytes, saving \(.total.projected_saving_percent) %"' \
    "$work/estimate --chunking $CHUNKINGS.json"
fi

e=$work/estimate.json
echo
jq -r '.total | "estimate (\(.codecs | map(select(.sampled_percent < 100) | "\(.codec) sampled \(.sampled_percent) %") | join(", "))):
  non-zero \(.nonzero_bytes) bytes, unique chunks \(.unique_chunks), duplicate \(.duplicate_chunks), zero \(.zero_chunks)
  dedup \(.dedup_saving_percent) %, compression \(.compression_saving_percent) %
  projected physical \(.projected_physical_bytes) bytes (data \(.projected_data_bytes), metadata \(.projected_metadata_bytes)), saving \(.projected_saving_percent) %
  projected RAM \(.index_ram_bytes) bytes
  all codecs: \(.codecs | map("\(.codec) \(.projected_physical_bytes) bytes / \(.projected_saving_percent) %") | join(", "))"' "$e"

[ "${SKIP_IMPORT:-0}" = 1 ] && exit 0

export CONDENSE_POOL=$work/pool
"$condense" init --compression "$comp" >/dev/null
start=$(date +%s.%N)
for img in "${imgs[@]}"; do
  "$condense" import "$img" >/dev/null
done
sync
import_s=$(echo "$(date +%s.%N) - $start" | bc)
"$condense" stats --json > "$work/stats.json"
s=$work/stats.json
echo
jq -r '"import (\(.unique_chunks) unique chunks): physical \(.physical_bytes) bytes (data \(.data_bytes), metadata \(.metadata_bytes)), saving \(.saving_percent) %, RAM \(.index_ram_bytes) bytes"' "$s"
printf 'import took %.1f s\n' "$import_s"
pp=$(jq .total.projected_physical_bytes "$e"); ps=$(jq .total.projected_saving_percent "$e")
ap=$(jq .physical_bytes "$s"); as=$(jq .saving_percent "$s")
pr=$(jq .total.index_ram_bytes "$e"); ar=$(jq .index_ram_bytes "$s")
echo
printf 'estimate vs import (%s): physical %s vs %s bytes (%+.3f %%), saving %s %% vs %s %% (%+.2f points), RAM %s vs %s bytes\n' \
  "$comp" "$pp" "$ap" "$(echo "100 * ($pp - $ap) / $ap" | bc -l)" "$ps" "$as" "$(echo "$ps - $as" | bc -l)" "$pr" "$ar"
