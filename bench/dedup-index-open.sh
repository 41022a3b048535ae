#!/usr/bin/env bash
# The dedup index at the first write after an open: loaded from dedup.idx (saved at the last
# clean close) vs built from the chunk table (no saved index: the first open, or after a
# crash). N unique, highly compressible 4 KiB blocks (gen-unique) are imported once; then a
# one-block import (the first write, which needs the index) runs three times with the saved
# index and three times with it removed. Prints the engine's own figure for each ("dedup
# index loaded/built: N chunks in S s"), the wall time of the import, its RSS, the size of
# dedup.idx and the time the clean close took to save it. Each first write starts with the
# page cache dropped (as after a reboot; root only), unless COLD=0.
#
#   bench/dedup-index-open.sh [N] [WORK_DIR]      # default 10000000 /work/dedup-index-bench
#   bench/dedup-index-open.sh 50000000            # the figure of issue 26 (205 GB logical)
#   REUSE=1 bench/dedup-index-open.sh 50000000    # again, on the pool the last run imported
#
# Environment: CONDENSE (binary; default target/release/condense), GEN_UNIQUE (default
# target/release/gen-unique). Prints figures; asserts nothing.

set -euo pipefail
n=${1:-10000000}
work=${2:-/work/dedup-index-bench}
here=$(cd "$(dirname "$0")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
gen=${GEN_UNIQUE:-$here/target/release/gen-unique}
die() { echo "dedup-index-open.sh: $*" >&2; exit 1; }
[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 100 ] || die "N must be a whole number of blocks, at least 100"
if [ ! -x "$condense" ]; then (cd "$here" && cargo build --release -p condense); fi
if [ ! -x "$gen" ]; then (cd "$here" && cargo build --release -p condense-bench --bin gen-unique); fi
need=$((n * 150 + (1 << 30)))
mkdir -p "$work"
avail=$(df --output=avail -B1 "$work" | tail -1 | tr -d ' ')
[ "$avail" -ge "$need" ] || die "not enough disk in $work: $((avail >> 20)) MiB free, need $((need >> 20)) MiB"
pool=$work/pool
export CONDENSE_LOG=${CONDENSE_LOG:-info}

if [ "${REUSE:-0}" = 1 ] && [ -e "$pool/superblock" ]; then
  echo "reusing the pool in $pool (REUSE=1)"
else
  rm -rf "$pool"
  "$condense" --pool "$pool" init >/dev/null
  echo "importing $n unique blocks ($((n * 4096 >> 20)) MiB logical)..."
  start=$(date +%s.%N)
  "$gen" --blocks "$n" | "$condense" --pool "$pool" import - --name big --size $((n * 4096)) \
      >/dev/null 2>"$work/import.log"
  end=$(date +%s.%N)
  echo "  import: $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.0f", b - a }') s"
  grep -o "dedup index saved.*" "$work/import.log" | tail -1 | sed 's/^/  /' || true
fi
idx=$(stat -c %s "$pool/dedup.idx" 2>/dev/null || echo 0)
echo "  dedup.idx: $((idx >> 20)) MiB ($(awk -v a="$idx" -v n="$n" 'BEGIN { printf "%.2f", a / n }') bytes per chunk)"

head -c 4096 /dev/urandom >"$work/one.raw"
first_write() { # $1: label, $2: volume name
  local log=$work/$2.log t0 t1 rss
  # Cold: what the first write after a reboot pays (root only; COLD=0 keeps the page cache).
  if [ "${COLD:-1}" = 1 ] && [ -w /proc/sys/vm/drop_caches ]; then
    sync; echo 3 >/proc/sys/vm/drop_caches
  fi
  t0=$(date +%s.%N)
  /usr/bin/time -f %M -o "$work/rss" "$condense" --pool "$pool" import --format raw \
      "$work/one.raw" --name "$2" >/dev/null 2>"$log"
  t1=$(date +%s.%N)
  rss=$(cat "$work/rss")
  local line
  line=$(grep -o "dedup index [a-z]*[^:]*: [0-9]* chunks in [0-9.]* s" "$log" | head -1 || true)
  local saved
  saved=$(grep -o "chunks in [0-9.]* s" <(grep "dedup index saved" "$log") | head -1 || true)
  saved=${saved#chunks in }
  printf "  %-6s %-58s | saved at close in %-7s | import wall %5.2f s, max RSS %4d MiB\n" \
      "$1" "${line:-?}" "${saved:-?}" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" \
      $((rss / 1024))
}
echo "first write after an open:"
for i in 1 2 3; do
  first_write saved "s$i-$$"
  cp "$pool/dedup.idx" "$work/dedup.idx.keep"
  rm -f "$pool/dedup.idx"
  first_write none "b$i-$$"
  # The clean close of that import saved a new index; the next round starts with it.
done
rm -f "$work/dedup.idx.keep"
