#!/usr/bin/env bash
# Issue 44: delta compression on the ten corpus images. Per configuration (zstd:3 and lz4, each
# without and with `init --delta`): a fresh pool, `condense import` of each image (wall time),
# `du -sb` of the pool, the delta figures of `stats --json`, then a full read-back (`condense
# export` of every volume, one at a time, to a scratch file removed at once; wall time).
#
#   bench/delta.sh IMAGES_DIR [WORK_DIR] [SCRATCH_DIR]
#
# Then the pool is served and fio (nbd engine) reads one volume (FIO_VOLUME, default the first
# image's) over NBD: 4 KiB random reads at queue depth 1 and 1 MiB sequential reads at queue
# depth 4 over its first FIO_SIZE (default 2G), FIO_SECONDS (default 20) each, cold (page cache
# dropped, a fresh serve) then warm (the same again); a second table prints IOPS, p99 latency
# and MB/s. FIO=0 skips it.
#
# WORK_DIR (default /work/d44) holds one pool at a time and is removed at the end; SCRATCH_DIR
# (default /dev/shm) takes each export (as big as the largest image's data). CONFIGS overrides
# the list, e.g. CONFIGS="zstd:3 zstd:3+delta". Needs fio with its nbd engine and nbdinfo
# (scripts/install-deps.sh).
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
server=
trap '[ -z "$server" ] || kill "$server" 2>/dev/null; rm -rf "$work" "$out"' EXIT
fio_secs=${FIO_SECONDS:-20}
fio_size=${FIO_SIZE:-2G}
first_image=$(ls "$images"/*.raw | head -1)
fio_vol=${FIO_VOLUME:-$(basename "$first_image" .raw)}
fio_table=$work/fio-table.txt
# fio_read NAME RW BS QD: one fio job over NBD; prints "IOPS p99_ms MB/s" of its reads.
fio_read() {
  fio --name="$1" --ioengine=nbd --uri="nbd+unix:///$fio_vol?socket=$work/nbd.sock" --rw="$2" \
    --bs="$3" --iodepth="$4" --size="$fio_size" --time_based --runtime="$fio_secs" \
    --output-format=json --output="$work/fio.json" >/dev/null 2>&1 || { echo "fio failed" >&2; return 1; }
  python3 - "$work/fio.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["jobs"][0]["read"]
p99 = r["clat_ns"]["percentile"]["99.000000"] / 1e6
print(f"{r['iops']:.0f} {p99:.2f} {r['bw_bytes'] / 1e6:.1f}")
PY
}
# fio_pass CONFIG: cold then warm, one line of the fio table.
fio_pass() {
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
  "$condense" serve --socket "$work/nbd.sock" >"$work/serve.log" 2>&1 &
  server=$!
  for _ in $(seq 1 600); do
    nbdinfo --size "nbd+unix:///$fio_vol?socket=$work/nbd.sock" >/dev/null 2>&1 && break; sleep 0.1
  done
  local cold_r cold_s warm_r warm_s
  cold_r=$(fio_read rand randread 4k 1); cold_s=$(fio_read seq read 1M 4)
  warm_r=$(fio_read rand randread 4k 1); warm_s=$(fio_read seq read 1M 4)
  kill "$server"; wait "$server" 2>/dev/null || true; server=
  printf '%-12s %s %s %s %s\n' "$1" "$cold_r" "$cold_s" "$warm_r" "$warm_s" >> "$fio_table"
}
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
  [ "${FIO:-1}" = 0 ] || fio_pass "$c"
  rm -rf "$CONDENSE_POOL"
done
if [ -s "$fio_table" ]; then
  echo
  echo "fio over NBD on volume $fio_vol (first $fio_size, ${fio_secs} s per job): 4 KiB random reads qd1 (IOPS, p99 ms, MB/s), 1 MiB sequential reads qd4 (IOPS, p99 ms, MB/s)"
  printf '%-12s %-24s %-24s %-24s %-24s\n' config cold_rand4k cold_seq1M warm_rand4k warm_seq1M
  while read -r c a1 a2 a3 b1 b2 b3 c1 c2 c3 d1 d2 d3; do
    printf '%-12s %-24s %-24s %-24s %-24s\n' "$c" "$a1 $a2 $a3" "$b1 $b2 $b3" "$c1 $c2 $c3" "$d1 $d2 $d3"
  done < "$fio_table"
fi
