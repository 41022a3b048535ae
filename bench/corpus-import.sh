#!/usr/bin/env bash
# The real job: import the ten corpus images (../shared/corpus/build.sh OUT) into a fresh pool
# and print wall time, bytes stored (du -sb of the pool, metadata included) and savings,
# next to `cp --sparse=always` of the same images on the same disk.
#
#   bench/corpus-import.sh IMAGES_DIR [WORK_DIR] [COMPRESSION]     # COMPRESSION: lz4 | zstd:N
set -euo pipefail
images=${1:?usage: corpus-import.sh IMAGES_DIR [WORK_DIR] [COMPRESSION]}
work=${2:-/work/corpus-bench}
comp=${3:-lz4}
# ENCRYPT=1 (with $CONDENSE_KEY_FILE or $CONDENSE_PASSPHRASE_FILE set): an encrypted pool.
encrypt=(); [ "${ENCRYPT:-0}" = 1 ] && encrypt=(--encrypt)
here=$(cd "$(dirname "$0")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
[ -x "$condense" ] || (cd "$here" && cargo build --release -p condense)
rm -rf "$work"; mkdir -p "$work"
allocated=$(du -c -B1 "$images"/*.raw | tail -1 | cut -f1)
apparent=$(du -cb --apparent-size "$images"/*.raw | tail -1 | cut -f1)
echo "corpus: $(ls "$images"/*.raw | wc -l) images, $allocated bytes allocated, $apparent apparent"

sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
start=$(date +%s.%N)
mkdir -p "$work/cp"; cp --sparse=always "$images"/*.raw "$work/cp/"; sync
cp_s=$(echo "$(date +%s.%N) - $start" | bc)
rm -rf "$work/cp"

export CONDENSE_POOL=$work/pool
"$condense" init --compression "$comp" "${encrypt[@]}" >/dev/null
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
start=$(date +%s.%N)
peak=0
for img in "$images"/*.raw; do
  /usr/bin/time -f "%M" -o "$work/rss" "$condense" import "$img"
  rss=$(cat "$work/rss"); [ "$rss" -gt "$peak" ] && peak=$rss
done
sync
import_s=$(echo "$(date +%s.%N) - $start" | bc)
stored=$(du -sb "$work/pool" | cut -f1)
"$condense" stats
"$condense" stats --json > "$work/stats.json"
echo
printf 'cp --sparse=always: %.1f s\n' "$cp_s"
printf 'condense import (%s): %.1f s wall, %s bytes stored (du -sb, metadata included) = %.3f GB, peak RSS %d MB\n' \
  "$comp" "$import_s" "$stored" "$(echo "$stored / 1000000000" | bc -l)" "$((peak / 1024))"
