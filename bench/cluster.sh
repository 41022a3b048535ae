#!/usr/bin/env bash
# Many hosts on one pool (issue 25), the real job: the corpus images (../shared/corpus/build.sh)
# imported into a pool on a 3-node Garage cluster (tests/s3/garage.sh, RF 3, on loopback) by one
# host, then by three hosts sharing one pool (`connect --join`; the images split 4/3/3 and
# imported at the same time, one `condense import` process per image on each host), and for each
# side: bytes in the bucket, wall time, requests per GB (from the Garage nodes' logs), each
# host's peak RSS. Then the cost of the fold (`hosts sync` on each host after the imports: the
# dedup window is the checkpoint of the writing host plus this, at most 30 s apart in serve), the
# merge and GC that bring the shared pool to one copy of each block, and a volume moved from one
# host to another (`volume move` through a serving host's control socket, `volume adopt` on the
# other). Not a test: prints figures.
#
#   bench/cluster.sh [IMAGE...]     # default /work/corpus/images/*.raw
#
# Environment: WORK=DIR (default /work/cluster-bench; emptied first), CONDENSE=PATH (default
# target/release/condense, built if missing), COMPRESSION=lz4|zstd:N (default lz4),
# CACHE_SIZE (default 4G per host), INIT_ARGS (more `init` options for both pools, e.g.
# "--index sparse --index-memory 32M": joining hosts take the first host's index setting),
# GC_ARGS (more options of each host's `gc` after the first fold, e.g. "--min-dead-percent 1":
# segments 1 % dead move their live records, which the other hosts then let go of).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in -h | --help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
work=${WORK:-/work/cluster-bench}
comp=${COMPRESSION:-lz4}
cache_size=${CACHE_SIZE:-4G}
garage_sh=$here/tests/s3/garage.sh

say() { printf '\n== %s\n' "$*"; }
die() { printf 'cluster.sh: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }

images=("$@")
if [ ${#images[@]} -eq 0 ]; then
  images=(/work/corpus/images/*.raw)
  [ -f "${images[0]}" ] || die "no images in /work/corpus/images (build them with ../shared/corpus/build.sh /work/corpus)"
fi
[ ${#images[@]} -ge 3 ] || die "give at least three images (one per host)"
allocated=$(du -c -B1 "${images[@]}" | tail -1 | cut -f1)
gb_in=$(echo "$allocated / 1000000000" | bc -l)

condense=${CONDENSE:-$here/target/release/condense}
[ -x "$condense" ] || (cd "$here" && cargo build --release -p condense)
command -v jq >/dev/null || die "jq is missing: run scripts/install-deps.sh"
if [ -z "${GARAGE:-}" ] && ! command -v garage >/dev/null && [ ! -x "$HOME/.cargo/bin/garage" ]; then
  "$here/scripts/install-garage.sh"
fi

rm -rf "$work"; mkdir -p "$work/garage"
garage_started=0
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ "$garage_started" = 1 ]; then "$garage_sh" stop "$work/garage" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
"$garage_sh" start "$work/garage" >"$work/garage-start.log" 2>&1 || { cat "$work/garage-start.log" >&2; die "garage.sh start failed"; }
garage_started=1
# shellcheck disable=SC1091
. "$work/garage/credentials.env"
bucket=$CONDENSE_S3_BUCKET
echo "corpus: ${#images[@]} images, $allocated bytes allocated"
echo "condense: $condense ($("$condense" --version)); machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"

requests() {
  cat "$work/garage"/node*/log | grep -F 'generic_server:' | grep -c -e ") [A-Z]* /$bucket" || true
}
c() { env -u CONDENSE_POOL "$condense" "$@"; }
# import_on DIR IMAGE...: one import process per image; prints the peak RSS (KiB).
import_on() {
  local dir=$1 peak=0 rss img
  shift
  for img in "$@"; do
    /usr/bin/time -f "%M" -o "$dir.rss" env -u CONDENSE_POOL "$condense" --pool "$dir" import "$img" >"$dir.import.log" 2>&1 ||
      { cat "$dir.import.log" >&2; return 1; }
    rss=$(cat "$dir.rss"); [ "$rss" -gt "$peak" ] && peak=$rss
  done
  echo "$peak" >"$dir.peak"
}
bytes_of() { # the bucket bytes of the parts whose local directories are given
  local sum=0 d b
  for d in "$@"; do
    b=$(c --pool "$d" stats --json | jq -r '.remote_bytes')
    sum=$((sum + b))
  done
  echo "$sum"
}

say "one host: the ten images into s3://$bucket/one"
r0=$(requests)
c init "s3://$bucket/one" --cache "$work/one" --cache-size "$cache_size" --compression "$comp" ${INIT_ARGS:-} >/dev/null
t=$(now)
import_on "$work/one" "${images[@]}"
one_s=$(since "$t")
one_req=$(($(requests) - r0))
one_bytes=$(bytes_of "$work/one")
printf '   %.1f s, %d bytes in the bucket, %d requests (%.0f per GB), peak RSS %d MiB\n' \
  "$one_s" "$one_bytes" "$one_req" "$(echo "$one_req / $gb_in" | bc -l)" $(($(cat "$work/one.peak") / 1024))

say "three hosts sharing s3://$bucket/three: images split 4/3/3, imported at the same time"
r0=$(requests)
c init "s3://$bucket/three" --cache "$work/A" --cache-size "$cache_size" --compression "$comp" ${INIT_ARGS:-} >/dev/null
c connect "s3://$bucket/three" --join --host B --cache "$work/B" --cache-size "$cache_size" >/dev/null
c connect "s3://$bucket/three" --join --host C --cache "$work/C" --cache-size "$cache_size" >/dev/null
n=${#images[@]}
a_imgs=("${images[@]:0:$((n - 2 * (n / 3)))}")
b_imgs=("${images[@]:$((n - 2 * (n / 3))):$((n / 3))}")
c_imgs=("${images[@]:$((n - n / 3))}")
t=$(now)
import_on "$work/A" "${a_imgs[@]}" & pa=$!
import_on "$work/B" "${b_imgs[@]}" & pb=$!
import_on "$work/C" "${c_imgs[@]}" & pc=$!
wait "$pa" && wait "$pb" && wait "$pc" || die "an import failed"
three_s=$(since "$t")
three_req=$(($(requests) - r0))
raw_bytes=$(bytes_of "$work/A" "$work/B" "$work/C")
printf '   %.1f s, %d bytes in the bucket before any fold (%.3fx one host), %d requests (%.0f per GB)\n' \
  "$three_s" "$raw_bytes" "$(echo "$raw_bytes / $one_bytes" | bc -l)" "$three_req" "$(echo "$three_req / $gb_in" | bc -l)"
for h in A B C; do
  printf '   host %s import peak RSS %d MiB; index: %s\n' "$h" $(($(cat "$work/$h.peak") / 1024)) \
    "$(c --pool "$work/$h" index show --json | jq -c '{mode, memory_bytes}')"
done

say "fold, merge, GC, fold again (each host in turn) until no condemned segment waits"
r0=$(requests)
for round in 1 2 3 4; do
  waiting=0
  for h in A B C; do
    t=$(now)
    out=$(/usr/bin/time -f "%M" -o "$work/$h.sync.rss" env -u CONDENSE_POOL "$condense" --pool "$work/$h" hosts sync --json 2>/dev/null)
    rss=$(cat "$work/$h.sync.rss"); [ "$rss" -gt "$(cat "$work/$h.peak")" ] && echo "$rss" >"$work/$h.peak"
    printf '   round %d host %s: hosts sync %.2f s, peak RSS %d MiB: %s\n' "$round" "$h" "$(since "$t")" $((rss / 1024)) \
      "$(jq -c '{folded: [.other_hosts[].chunks_folded] | add, merged: [.other_hosts[].chunks_merged] | add, let_go: [.other_hosts[].chunks_let_go] | add, deleted: .segments_deleted, waiting: .segments_condemned}' <<<"$out")"
    waiting=$((waiting + $(jq '.segments_condemned' <<<"$out")))
  done
  if [ "$round" = 1 ]; then
    for h in A B C; do
      t=$(now)
      if [ "$(c --pool "$work/$h" index show --json | jq -r .mode)" = sparse ]; then
        # What the sparse index let through, across hosts too, merged; then the same GC.
        c --pool "$work/$h" index merge --no-gc >"$work/merge$h.out" 2>/dev/null
        printf '   host %s index merge %.1f s: %s\n' "$h" "$(since "$t")" "$(tr '\n' ' ' <"$work/merge$h.out")"
        t=$(now)
      fi
      # shellcheck disable=SC2086
      c --pool "$work/$h" gc ${GC_ARGS:-} >"$work/gc$h.out" 2>/dev/null
      printf '   host %s gc %.1f s: %s\n' "$h" "$(since "$t")" "$(tail -1 "$work/gc$h.out")"
    done
  elif [ "$waiting" = 0 ]; then
    break
  fi
done
fold_req=$(($(requests) - r0))
three_bytes=$(bytes_of "$work/A" "$work/B" "$work/C")
printf '   after: %d bytes in the bucket (%.4fx one host); the folds, merges and GC cost %d requests\n' \
  "$three_bytes" "$(echo "$three_bytes / $one_bytes" | bc -l)" "$fold_req"

say "a served volume moved from host A to host B"
vol=$(basename "${a_imgs[0]}"); vol=${vol%.*}
port=$((20000 + RANDOM % 20000))
env -u CONDENSE_POOL "$condense" --pool "$work/A" serve --insecure-listen "127.0.0.1:$port" >"$work/serveA.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 60); do [ -S "$work/A/control.sock" ] && break; sleep 0.5; done
t=$(now)
c --pool "$work/A" volume move "$vol" --to B >/dev/null
move_s=$(since "$t")
t=$(now)
c --pool "$work/B" volume adopt "$vol" --from-host first-host >"$work/adopt.out"
adopt_s=$(since "$t")
printf '   volume move on A (flush + root) %.2f s; volume adopt on B %.2f s (%s)\n' "$move_s" "$adopt_s" "$(cat "$work/adopt.out")"
kill "${pids[0]}" 2>/dev/null || true

say "result"
printf '| figure | one host | three hosts |\n|---|---|---|\n'
printf '| bucket bytes | %d | %d (%.4fx; %.3fx before the fold) |\n' "$one_bytes" "$three_bytes" \
  "$(echo "$three_bytes / $one_bytes" | bc -l)" "$(echo "$raw_bytes / $one_bytes" | bc -l)"
printf '| import wall time | %.1f s | %.1f s (three at once) |\n' "$one_s" "$three_s"
printf '| peak RSS (imports; three hosts: syncs too) | %d MiB | %d / %d / %d MiB |\n' $(($(cat "$work/one.peak") / 1024)) \
  $(($(cat "$work/A.peak") / 1024)) $(($(cat "$work/B.peak") / 1024)) $(($(cat "$work/C.peak") / 1024))
printf '| requests per GB imported | %.0f | %.0f (+ %d for folds, merges, GC) |\n' \
  "$(echo "$one_req / $gb_in" | bc -l)" "$(echo "$three_req / $gb_in" | bc -l)" "$fold_req"
printf '| volume move (hand-over + adopt) | - | %.2f s |\n' "$(echo "$move_s + $adopt_s" | bc -l)"
