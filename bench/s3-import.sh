#!/usr/bin/env bash
# Pools on S3 (issue 11), the real job: import the corpus images (../shared/corpus/build.sh)
# into a local pool and into a pool on a 3-node Garage cluster (tests/s3/garage.sh, RF 3, on
# loopback, started here in WORK/garage), one `condense import` process per image as
# bench/corpus-import.sh does, and print per side: wall time, bytes stored (local: du -sb of the
# pool; S3: stats remote_bytes + du -sb of the local directory), objects, requests by kind and
# requests per GB imported. Then (COLD_EXPORT=1) one image is exported from a fresh `connect`
# directory (a cold cache: every chunk comes from the bucket) and compared with the original.
# Not a test: prints figures.
#
#   bench/s3-import.sh [import] [IMAGE...]   # default /work/corpus/images/*.raw
#   bench/s3-import.sh boot [IMAGE]          # = S3=1 bench/boot-vm.sh IMAGE: VM boot from the S3
#                                            #   pool, cold and warm cache, vs a local pool and raw
#
# Environment:
#   WORK=DIR           work directory (default /work/s3-bench; emptied first)
#   CONDENSE=PATH      the condense binary (default: target/release/condense, built if missing)
#   COMPRESSION=C      lz4 (default) | zstd:N, on both sides
#   CACHE_SIZE=SIZE    --cache-size of the S3 pool's local directory (default 4G)
#   DURABILITY=D       local (default) | remote
#   CORPUS_LOG=FILE    the corpus build's log (default /tmp/corpus-build.log): while the build
#                      runs (no "done:" line yet, or a *.tmp image), wait up to CORPUS_WAIT s
#                      (default 3600) for it
#   COLD_EXPORT=0      skip the cold export
#   DROP_CACHES=0      keep the page cache (default: dropped before each side, as root)
#   BASELINE=PATH      another condense binary whose cold export runs beside ours (before/after)
#
# Request counts come from the Garage nodes' logs (each S3 request is logged once, by the node
# that received it): they cover every process, whereas stats --json counts only the process
# that answers it. Both are printed.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  import) shift ;;
  boot) shift; exec env S3=1 "$here/bench/boot-vm.sh" "$@" ;;
  -h | --help) sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
work=${WORK:-/work/s3-bench}
comp=${COMPRESSION:-lz4}
cache_size=${CACHE_SIZE:-4G}
durability=${DURABILITY:-local}
corpus_log=${CORPUS_LOG:-/tmp/corpus-build.log}
garage_sh=$here/tests/s3/garage.sh

say() { printf '\n== %s\n' "$*"; }
die() { printf 's3-import.sh: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }
drop_caches() { sync; [ "${DROP_CACHES:-1}" = 0 ] || echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true; }

# --- the corpus ------------------------------------------------------------------------------------
images=("$@")
default_dir=/work/corpus/images
corpus_building() {
  [ ${#images[@]} -eq 0 ] || return 1 # images named on the command line: no waiting
  compgen -G "$default_dir/*.tmp" >/dev/null && return 0
  [ -f "$corpus_log" ] || return 1
  # Still running: no "done:" line yet and the log changed in the last 10 minutes.
  ! tail -1 "$corpus_log" | grep -q ' done: ' && [ $(($(date +%s) - $(stat -c %Y "$corpus_log"))) -lt 600 ]
}
if corpus_building; then
  say "the corpus is being built ($corpus_log): waiting up to ${CORPUS_WAIT:-3600} s"
  waited=0
  while corpus_building; do
    [ "$waited" -lt "${CORPUS_WAIT:-3600}" ] || die "the corpus build did not finish in time"
    sleep 30; waited=$((waited + 30))
    echo "   $(tail -1 "$corpus_log")"
  done
fi
if [ ${#images[@]} -eq 0 ]; then
  images=("$default_dir"/*.raw)
  [ -f "${images[0]}" ] || die "no images in $default_dir (build them with ../shared/corpus/build.sh /work/corpus)"
fi
for img in "${images[@]}"; do [ -f "$img" ] || die "no image $img"; done
allocated=$(du -c -B1 "${images[@]}" | tail -1 | cut -f1)
apparent=$(du -cb --apparent-size "${images[@]}" | tail -1 | cut -f1)
gb_in=$(echo "$allocated / 1000000000" | bc -l) # what import reads: the allocated bytes

# --- tools -----------------------------------------------------------------------------------------
condense=${CONDENSE:-$here/target/release/condense}
[ -x "$condense" ] || (cd "$here" && cargo build --release -p condense)
[ -x "$condense" ] || die "no condense binary at $condense"
command -v jq >/dev/null || die "jq is missing: run scripts/install-deps.sh"
if [ -z "${GARAGE:-}" ] && ! command -v garage >/dev/null && [ ! -x "$HOME/.cargo/bin/garage" ]; then
  say "installing garage (scripts/install-garage.sh, ~10 min once per machine)"
  "$here/scripts/install-garage.sh"
fi

rm -rf "$work"; mkdir -p "$work"
garage_started=0
cleanup() { if [ "$garage_started" = 1 ]; then "$garage_sh" stop "$work/garage" >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "corpus: ${#images[@]} images, $allocated bytes allocated, $apparent apparent"
echo "condense: $condense ($("$condense" --version))"
echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"

# import_all POOL_DIR: one `condense import` process per image; sets import_s and peak_mb.
import_all() {
  local pool=$1 img start peak=0 rss
  drop_caches
  start=$(now)
  for img in "${images[@]}"; do
    /usr/bin/time -f "%M" -o "$work/rss" env -u CONDENSE_POOL "$condense" --pool "$pool" import "$img" >"$work/import.log" 2>&1 ||
      { cat "$work/import.log" >&2; die "import of $img into $pool failed"; }
    rss=$(cat "$work/rss"); [ "$rss" -gt "$peak" ] && peak=$rss
    printf '   %-12s %6.1f s\n' "$(basename "$img")" "$(since "$start")"
  done
  sync
  import_s=$(since "$start")
  peak_mb=$((peak / 1024))
}

# --- local pool ---------------------------------------------------------------------------------------
say "local pool: $work/local (compression $comp)"
"$condense" init "$work/local" --compression "$comp" >/dev/null
import_all "$work/local"
local_s=$import_s local_peak=$peak_mb
local_stored=$(du -sb "$work/local" | cut -f1)
local_files=$(find "$work/local" -type f | wc -l)
"$condense" --pool "$work/local" stats --json >"$work/stats-local.json"

# --- Garage ---------------------------------------------------------------------------------------------
say "Garage: 3 nodes, RF 3, in $work/garage"
mkdir -p "$work/garage"
"$garage_sh" start "$work/garage" >"$work/garage-start.log" 2>&1 || { cat "$work/garage-start.log" >&2; die "garage.sh start failed"; }
garage_started=1
# shellcheck disable=SC1091
. "$work/garage/credentials.env"
bucket=$CONDENSE_S3_BUCKET
prefix=corpus

# requests KIND: S3 requests of that kind the cluster has logged so far for this bucket (PUT,
# GET of an object, LIST, HEAD, DELETE, POST = multi-object delete / multipart).
requests() {
  local re
  case $1 in
    LIST) re=") GET /${bucket}[?]list-type" ;;
    GET) re=") GET /$bucket/" ;;
    *) re=") $1 /$bucket" ;;
  esac
  cat "$work/garage"/node*/log | grep -F 'generic_server:' | grep -c -e "$re" || true
}
kinds=(PUT GET LIST HEAD DELETE POST)
snapshot_requests() { local k; for k in "${kinds[@]}"; do echo "$k $(requests "$k")"; done; }
# delta_requests BEFORE_FILE: sets req_line ("PUT n  GET n ...") and req_total, the requests
# since BEFORE_FILE was written.
delta_requests() {
  local k before now
  req_line="" req_total=0
  for k in "${kinds[@]}"; do
    before=$(awk -v k="$k" '$1 == k {print $2}' "$1")
    now=$(requests "$k")
    req_line+="$k $((now - before))  "
    req_total=$((req_total + now - before))
  done
}

# --- S3 pool --------------------------------------------------------------------------------------------
s3_url=s3://$bucket/$prefix
s3_dir=$work/s3
say "S3 pool: $s3_url, local directory $s3_dir (--cache-size $cache_size, --durability $durability, compression $comp)"
snapshot_requests >"$work/req0"
env -u CONDENSE_POOL "$condense" init "$s3_url" --cache "$s3_dir" --cache-size "$cache_size" \
  --durability "$durability" --compression "$comp" >/dev/null
import_all "$s3_dir"
s3_s=$import_s s3_peak=$peak_mb
delta_requests "$work/req0"; s3_req=$req_line s3_req_total=$req_total
"$condense" --pool "$s3_dir" stats --json >"$work/stats-s3.json"
s3_remote_bytes=$(jq -r '.remote_bytes // empty' "$work/stats-s3.json")
s3_objects=$(jq -r '.remote_objects // empty' "$work/stats-s3.json")
s3_local=$(du -sb "$s3_dir" | cut -f1)
s3_stats_req=$(jq -r '"PUT \(.remote_puts) GET \(.remote_gets)"' "$work/stats-s3.json")
garage_bytes=$(du -cb "$work/garage"/node*/data | tail -1 | cut -f1)
echo "   stats --json (this process only): $(jq -c '{remote_durability, remote_objects, remote_bytes, remote_puts, remote_gets, remote_health}' "$work/stats-s3.json")"

# --- cold export ------------------------------------------------------------------------------------------
# cold_export BINARY LABEL: export the first image from a fresh connect directory with BINARY;
# appends its line to $cold.
cold=""
cold_export() {
  local bin=$1 label=$2 img=${images[0]} name dir start cold_s same written line
  name=$(basename "$img"); name=${name%.*}
  dir=$work/s3-cold-$label
  say "cold export of $name by $label ($bin): a fresh connect directory, every chunk from the bucket"
  snapshot_requests >"$work/req1"
  env -u CONDENSE_POOL "$bin" connect "$s3_url" --cache "$dir" --cache-size "$cache_size" >/dev/null
  drop_caches
  start=$(now)
  "$bin" --pool "$dir" export "$name" "$work/$name.out"
  cold_s=$(since "$start")
  delta_requests "$work/req1"
  if cmp "$img" "$work/$name.out"; then same=identical; else same="DIFFERENT"; fi
  rm -rf "$work/$name.out" "$dir"
  written=$(jq -r --arg n "$name" '.volumes[] | select(.name == $n) | .written_bytes' "$work/stats-local.json")
  line=$(printf 'cold export of %s (%s bytes written) by %s: %.1f s, %.1f MB/s; requests: %s; export %s' \
    "$name" "$written" "$label" "$cold_s" "$(echo "$written / $cold_s / 1000000" | bc -l)" "$req_line" "$same")
  echo "   $line"
  cold+="$line"$'\n'
}
if [ "${COLD_EXPORT:-1}" = 1 ]; then
  # BASELINE=PATH: also a build to compare with, in the same run (baseline, ours, ours, baseline).
  if [ -n "${BASELINE:-}" ]; then
    cold_export "$BASELINE" baseline; cold_export "$condense" ours
    cold_export "$condense" ours-2; cold_export "$BASELINE" baseline-2
  else
    cold_export "$condense" ours
  fi
fi

# --- figures ----------------------------------------------------------------------------------------------
say "result: ${#images[@]} images, $(printf '%.2f' "$gb_in") GB allocated ($apparent bytes apparent), compression $comp"
printf '%-7s %9s %16s %9s %10s  %s\n' side "wall s" "stored bytes" objects "req/GB" "requests (Garage logs)"
printf '%-7s %9.1f %16s %9s %10s  %s\n' local "$local_s" "$local_stored" "$local_files" - "- (files in the pool directory as objects)"
s3_stored=$((${s3_remote_bytes:-0} + s3_local))
printf '%-7s %9.1f %16s %9s %10.1f  %s\n' s3 "$s3_s" "$s3_stored" "${s3_objects:-?}" \
  "$(echo "$s3_req_total / $gb_in" | bc -l)" "$s3_req"
echo
printf 'local: du -sb %s; peak RSS of an import %d MB\n' "$local_stored" "$local_peak"
printf 's3: remote_bytes %s + local directory %s (cache, journal, staged, metadata mirror); peak RSS %d MB\n' \
  "${s3_remote_bytes:-?}" "$s3_local" "$s3_peak"
printf 's3: %s requests for the imports = %.1f per GB imported, %.1f per GB stored; stats --json of the last process: %s\n' \
  "$s3_req_total" "$(echo "$s3_req_total / $gb_in" | bc -l)" \
  "$(echo "$s3_req_total / ($s3_stored / 1000000000)" | bc -l)" "$s3_stats_req"
echo "s3: requests by kind of object (all processes, imports and cold export; gen/E-W/seg-N.dat.SEQ -> seg):"
cat "$work/garage"/node*/log | grep -F 'generic_server:' | grep -F ") " | grep -v 'list-type=2&max-keys=1$' |
  awk -v b="/$bucket/$prefix/" '{m = $(NF - 1); p = $NF
    if (index(p, b) == 1) { k = substr(p, length(b) + 1); sub(/^gen\/[^\/?]*\//, "", k); sub(/[\/?].*/, "", k)
      if (k ~ /^[.]/) k = "(.probe: conditional-put probe)"; else sub(/[-.].*/, "", k) }
    else if (p ~ /list-type/) k = "(list)"; else if (p ~ /[?]delete/) k = "(multi-object delete)"; else k = p
    n[m " " k]++} END {for (x in n) printf "   %6d %s\n", n[x], x}' | sort -rn
printf 's3: Garage data directories hold %s bytes (3 replicas, Garage zstd level 1)\n' "$garage_bytes"
printf 'wall time ratio s3 / local: %.2f\n' "$(echo "$s3_s / $local_s" | bc -l)"
[ -z "$cold" ] || echo "$cold"
printf 'load average now: %s on %s CPUs\n' "$(cut -d' ' -f1-3 /proc/loadavg)" "$(nproc)"
echo "work files: $work (stats-local.json, stats-s3.json, garage/node*/log)"
