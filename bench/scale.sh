#!/usr/bin/env bash
# Metadata scaling: N unique but highly compressible 4 KiB blocks (the disk holds little, the
# metadata is what grows) go through `condense import -` twice, into volumes a and b (the second
# pass is all duplicates of the first). A third import of the same stream into c is killed with
# SIGKILL at ~50 % and the pool is opened again and verified.
# Prints throughput and RSS at every 10 %, unique chunks, physical bytes, checkpoint bytes written
# per GB ingested, the open time after kill -9, verify, and bytes of RAM per unique chunk; ends
# with a Markdown summary (also left in WORK_DIR/summary-N.md).
#
#   bench/scale.sh [N] [WORK_DIR]        # default 1000000 /work/scale-bench
#   bench/scale.sh 50000000              # 205 GB (191 GiB) of unique logical data per pass
#
# Environment: CONDENSE (binary; default target/release/condense, built if missing),
# GEN_UNIQUE (default target/release/gen-unique, built if missing), SEED (1), KILL_AT (50, the
# percentage at which pass 3 is killed), INIT_ARGS (more `condense init` arguments, e.g.
# INIT_ARGS="--index sparse --index-memory 32M" for the sparse dedup index), IMPORT_CMD (testing only: a simple command that
# replaces `condense import -` and reads the stream on stdin, with $NAME, $SIZE, $POOL and
# $CONDENSE in its environment, e.g. IMPORT_CMD='cat >/dev/null'; RSS figures are then its own).
set -euo pipefail

n=${1:-1000000}
work=${2:-/work/scale-bench}
here=$(cd "$(dirname "$0")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
gen=${GEN_UNIQUE:-$here/target/release/gen-unique}
seed=${SEED:-1}
kill_at=${KILL_AT:-50}
pool=$work/pool
bs=4096
# Bytes of disk per block the pool needs, with headroom (measured 107 after pass 1, 124 after
# pass 2: LZ4 records, chunk table, block maps).
disk_per_block=${DISK_PER_BLOCK:-150}

die() { echo "scale.sh: $*" >&2; exit 1; }

if ! [[ $n =~ ^[0-9]+$ ]] || [ "$n" -lt 100 ]; then
  die "N must be a whole number of blocks, at least 100 (got '$n')"
fi
size=$((n * bs))
if ! [[ $kill_at =~ ^[0-9]+$ ]] || [ "$kill_at" -lt 1 ] || [ "$kill_at" -gt 99 ]; then
  die "KILL_AT must be 1-99"
fi
command -v jq >/dev/null || die "needs jq (apt-get install jq)"
[ -x /usr/bin/time ] && timer=(/usr/bin/time -f %M -o) || timer=()

if [ ! -x "$condense" ] && [ -z "${CONDENSE:-}" ]; then
  (cd "$here" && cargo build --release -p condense)
fi
[ -x "$condense" ] || die "no condense binary at $condense"
if [ ! -x "$gen" ] && [ -z "${GEN_UNIQUE:-}" ]; then
  (cd "$here" && cargo build --release -p condense-bench --bin gen-unique)
fi
[ -x "$gen" ] || die "no gen-unique binary at $gen"
if [ -z "${IMPORT_CMD:-}" ] && ! "$condense" import --help 2>&1 | grep -q -- '--size'; then
  die "$condense cannot import from standard input: this benchmark needs
  \`condense --pool DIR import - --name NAME --size BYTES\` (a newer build; set CONDENSE=PATH)"
fi

mkdir -p "$work"
if [ -e "$pool" ]; then
  echo "removing the previous pool $pool"
  rm -rf "$pool"
fi
rm -f "$work"/{progress,pid,maxrss,gen,import,stats}-*
avail=$(df --output=avail -B1 "$work" | tail -1 | tr -d ' ')
need=$((n * disk_per_block + (1 << 30)))
if [ "$avail" -lt "$need" ]; then
  die "not enough disk in $work: $((avail >> 20)) MiB free, N=$n needs about $((need >> 20)) MiB ($disk_per_block bytes per block + 1 GiB)"
fi
mem_avail=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)

# Float arithmetic and formatting: f EXPR [PRINTF_FORMAT].
f() { awk -v fmt="${2:-%.1f}" "BEGIN { printf fmt, $1 }"; }
mib() { f "$1 / 1024" "%.0f"; }   # KiB -> MiB

# VmRSS / VmHWM of a process in KiB into rss_kb / hwm_kb (empty once it is gone).
proc_mem() {
  rss_kb='' hwm_kb=''
  local k v _
  while read -r k v _; do
    case $k in
      VmRSS:) rss_kb=$v ;;
      VmHWM:) hwm_kb=$v ;;
    esac
  done 2>/dev/null <"/proc/$1/status" || true
}

ipid=
cleanup() { [ -n "$ipid" ] && kill "$ipid" 2>/dev/null; return 0; }
trap cleanup EXIT

declare -A secs peak_kb mbs tail_s slope
last_sample=
# run_pass NAME [KILL_PERCENT]: stream the N blocks into volume NAME and sample every 10 %.
run_pass() {
  local name=$1 kill_pct=${2:-}
  local prog=$work/progress-$name pidf=$work/pid-$name rssf=$work/maxrss-$name
  local cmd
  if [ -n "${IMPORT_CMD:-}" ]; then
    cmd=(env NAME="$name" SIZE="$size" POOL="$pool" CONDENSE="$condense" bash -c "exec $IMPORT_CMD")
  else
    cmd=("$condense" --pool "$pool" import - --name "$name" --size "$size")
  fi
  local t0=$EPOCHREALTIME
  # The importer writes its PID, then execs: that PID is the one to sample and to kill.
  # shellcheck disable=SC2016
  "$gen" --blocks "$n" --seed "$seed" --progress-file "$prog" 2>"$work/gen-$name.log" |
    "${timer[@]}" ${timer:+"$rssf"} bash -c 'echo $$ >"$1"; shift; exec "$@"' importer "$pidf" "${cmd[@]}" \
      >"$work/import-$name.log" 2>&1 &
  local job=$!
  ipid=
  for _ in $(seq 200); do
    [ -s "$pidf" ] && break
    sleep 0.05
  done
  read -r ipid <"$pidf" || die "the importer of pass $name did not start"

  echo
  echo "| % | blocks | elapsed s | MB/s (last 10 %) | RSS MiB | peak RSS MiB |"
  echo "|---|---|---|---|---|---|"
  local next=1 last_t=$t0 last_b=0 blocks=0 rss=0 peak=0 t gen_done='' killed='' first=''
  while kill -0 "$job" 2>/dev/null; do
    blocks=
    read -r blocks 2>/dev/null <"$prog" || true
    blocks=${blocks:-0}
    t=$EPOCHREALTIME
    proc_mem "$ipid"
    [ -n "$rss_kb" ] && rss=$rss_kb
    [ -n "$hwm_kb" ] && [ "$hwm_kb" -gt "$peak" ] && peak=$hwm_kb
    [ "$blocks" -ge "$n" ] && [ -z "$gen_done" ] && gen_done=$t
    if [ "$blocks" -lt "$n" ] && [ $((blocks * 10)) -ge $((next * n)) ]; then
      echo "| $((blocks * 100 / n)) | $blocks | $(f "$t - $t0" %.2f) | $(f "($blocks - $last_b) * $bs / 1e6 / ($t - $last_t)" %.0f) | $(mib "$rss") | $(mib "$peak") |"
      last_t=$t last_b=$blocks
      [ -n "$first" ] || first="$blocks $rss"
      last_sample="$blocks $rss"
      while [ $((blocks * 10)) -ge $((next * n)) ]; do next=$((next + 1)); done
    fi
    if [ -n "$kill_pct" ] && [ $((blocks * 100)) -ge $((kill_pct * n)) ]; then
      kill -9 "$ipid"
      killed=$blocks
      break
    fi
    sleep 0.1
  done
  local status=0
  wait "$job" || status=$?
  t=$EPOCHREALTIME
  ipid=
  if [ -n "${timer[*]}" ] && [ -s "$rssf" ]; then
    local m
    m=$(tail -1 "$rssf")
    [[ $m =~ ^[0-9]+$ ]] && [ "$m" -gt "$peak" ] && peak=$m
  fi
  peak_kb[$name]=$peak
  # RSS growth per block between the first and the last 10 % sample: the per-chunk cost without
  # the fixed part (binary, caches up to their budget).
  slope[$name]=n/a
  if [ -n "$first" ]; then
    local b0 r0 b1 r1
    read -r b0 r0 <<<"$first"
    read -r b1 r1 <<<"$last_sample"
    [ "$b1" -gt "$b0" ] && slope[$name]="$(f "($r1 - $r0) * 1024 / ($b1 - $b0)") B"
  fi
  if [ -n "$killed" ]; then
    echo "| kill -9 | $killed | $(f "$t - $t0" %.2f) | | $(mib "$rss") | $(mib "$peak") |"
    sed 's/^/  /' "$work/gen-$name.log" "$work/import-$name.log"
    return 0
  fi
  if [ "$status" -ne 0 ]; then
    echo "pass $name failed (exit $status):" >&2
    cat "$work/gen-$name.log" "$work/import-$name.log" >&2
    exit 1
  fi
  secs[$name]=$(f "$t - $t0" %.2f)
  mbs[$name]=$(f "$size / 1e6 / ($t - $t0)" %.0f)
  tail_s[$name]=$(f "$t - ${gen_done:-$t}" %.2f)
  echo "| 100 | $n | ${secs[$name]} | $(f "($n - $last_b) * $bs / 1e6 / ($t - $last_t)" %.0f) | $(mib "$rss") (last sample) | $(mib "$peak") |"
  echo
  echo "pass $name: ${secs[$name]} s, ${mbs[$name]} MB/s; the import ran ${tail_s[$name]} s after the generator had written its last block (last blocks, flush, close)"
  sed 's/^/  /' "$work/gen-$name.log" "$work/import-$name.log"
}

declare -A unique physical mpbw iram open_s
# stats_after NAME: `condense stats --json` (timed: open, replay, statistics) into stats-NAME.json.
stats_after() {
  local name=$1 t0 st=0
  t0=$EPOCHREALTIME
  "$condense" --pool "$pool" stats --json >"$work/stats-$name.json" 2>"$work/stats-$name.err" || st=$?
  open_s[$name]=$(f "$EPOCHREALTIME - $t0" %.3f)
  if [ "$st" -ne 0 ]; then
    cat "$work/stats-$name.err" >&2
    die "condense stats failed after pass $name (exit $st)"
  fi
  local j=$work/stats-$name.json
  unique[$name]=$(jq -r '.unique_chunks // "n/a"' "$j")
  physical[$name]=$(jq -r '.physical_bytes // "n/a"' "$j")
  mpbw[$name]=$(jq -r '.metadata_page_bytes_written // "n/a"' "$j")
  iram[$name]=$(jq -r '.index_ram_bytes // "n/a"' "$j")
  echo "stats after pass $name (condense stats took ${open_s[$name]} s): unique chunks ${unique[$name]}, physical bytes ${physical[$name]}, metadata_page_bytes_written ${mpbw[$name]}, index_ram_bytes ${iram[$name]}"
  sed 's/^/  /' "$work/stats-$name.err"
}
num() { [[ $1 =~ ^[0-9]+$ ]]; }
# per A B [UNIT]: A / B with one decimal and UNIT, or n/a.
per() { if num "$1" && num "$2" && [ "$2" -gt 0 ]; then echo "$(f "$1 / $2")${3:-}"; else echo n/a; fi; }

echo "scale: N=$n blocks of $bs bytes = $(f "$size / 1e9" %.2f) GB ($(f "$size / 2^30" %.2f) GiB) per pass, seed $seed"
echo "condense: $condense${IMPORT_CMD:+ (import replaced by IMPORT_CMD=$IMPORT_CMD)}"
echo "pool: $pool ($((avail >> 30)) GiB free on its file system, $((mem_avail >> 20)) GiB RAM available)"
# shellcheck disable=SC2086 # INIT_ARGS is a list of arguments
"$condense" init "$pool" ${INIT_ARGS:-} >/dev/null
echo "init arguments: ${INIT_ARGS:-none}"

echo
echo "## pass 1: N unique blocks into volume a"
run_pass a
stats_after a
echo
echo "## pass 2: the same stream into volume b (all duplicates)"
run_pass b
stats_after b

gb=$(f "$size / 1e9" %.6f)
ck_a=n/a ck_b=n/a
if num "${mpbw[a]}" && num "${mpbw[b]}"; then
  ck_a=$(f "${mpbw[a]} / $gb" %.0f)
  ck_b=$(f "(${mpbw[b]} - ${mpbw[a]}) / $gb" %.0f)
fi
echo
echo "checkpoint bytes written per GB ingested: pass 1 $ck_a, pass 2 $ck_b"
if num "${unique[b]}" && [ -z "${IMPORT_CMD:-}" ] && [ "${unique[b]}" -ne "$n" ]; then
  echo "WARNING: $n unique blocks written but the pool counts ${unique[b]} unique chunks"
fi

echo
echo "## pass 3: the same stream into volume c, kill -9 at ~$kill_at %"
run_pass c "$kill_at"
# The first open after the crash replays the journal: `index show` (no per-volume figures to
# count); then `stats`, which counts them on an open of its own.
t0=$EPOCHREALTIME
st=0
"$condense" --pool "$pool" index show >"$work/list-c.txt" 2>"$work/stats-c.err" || st=$?
open_s[c]=$(f "$EPOCHREALTIME - $t0" %.3f)
echo "condense index show after kill -9: ${open_s[c]} s (open + journal replay), exit $st"
t0=$EPOCHREALTIME
"$condense" --pool "$pool" stats >"$work/stats-c.txt" 2>>"$work/stats-c.err" || st=$?
echo "then condense stats: $(f "$EPOCHREALTIME - $t0" %.3f) s (open + counting the per-volume figures), exit $st"
sed 's/^/  /' "$work/stats-c.err"
t0=$EPOCHREALTIME
st=0
"$condense" --pool "$pool" verify >"$work/verify.txt" 2>&1 || st=$?
verify_s=$(f "$EPOCHREALTIME - $t0" %.2f)
if [ "$st" -eq 0 ]; then verify=clean; else verify="NOT clean (exit $st)"; fi
echo "condense verify: $verify, $verify_s s"
sed 's/^/  /' "$work/verify.txt"

ram_a=$(per $((peak_kb[a] * 1024)) "${unique[a]}" " B")
ram_b=$(per $((peak_kb[b] * 1024)) "${unique[b]}" " B")
summary=$work/summary-$n.md
{
  echo
  echo "## summary: N=$n ($(f "$size / 1e9" %.1f) GB of unique logical data per pass), $(date -u +%F)"
  echo
  echo "| figure | pass 1 (unique) | pass 2 (duplicates) |"
  echo "|---|---|---|"
  echo "| import time | ${secs[a]} s | ${secs[b]} s |"
  echo "| throughput | ${mbs[a]} MB/s | ${mbs[b]} MB/s |"
  echo "| import after the last block (flush, close) | ${tail_s[a]} s | ${tail_s[b]} s |"
  echo "| peak RSS | $(mib "${peak_kb[a]}") MiB | $(mib "${peak_kb[b]}") MiB |"
  echo "| unique chunks | ${unique[a]} | ${unique[b]} |"
  echo "| physical bytes (per unique chunk) | ${physical[a]} ($(per "${physical[a]}" "${unique[a]}")) | ${physical[b]} ($(per "${physical[b]}" "${unique[b]}")) |"
  echo "| metadata page bytes written, cumulative | ${mpbw[a]} | ${mpbw[b]} |"
  echo "| checkpoint bytes written per GB ingested | $ck_a | $ck_b |"
  echo "| RAM per unique chunk (peak RSS / unique chunks) | $ram_a | $ram_b |"
  echo "| RSS growth per block, first to last 10 % sample | ${slope[a]} | ${slope[b]} |"
  echo "| index_ram_bytes per unique chunk | $(per "${iram[a]}" "${unique[a]}" " B") | $(per "${iram[b]}" "${unique[b]}" " B") |"
  echo "| open (condense stats) after a clean close | ${open_s[a]} s | ${open_s[b]} s |"
  echo
  echo "| after kill -9 of pass 3 at ~$kill_at % | |"
  echo "|---|---|"
  echo "| open + journal replay (condense index show) | ${open_s[c]} s |"
  echo "| condense verify | $verify, $verify_s s |"
  echo "| peak RSS of pass 3 before the kill | $(mib "${peak_kb[c]}") MiB |"
} | tee "$summary"
