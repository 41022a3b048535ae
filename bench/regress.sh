#!/usr/bin/env bash
# The regression guard: this tree's build against an older commit's (the last release, not only
# the commit before), alternated on one machine, on the product's main job and its I/O paths:
#
#   1. the corpus import (bench/corpus-import.sh's job: every IMAGES_DIR/*.raw imported into a
#      fresh pool, page cache dropped first): wall, user and system CPU and peak RSS of the
#      imports, and bytes stored;
#   2. bench/nbd/fio-bench.sh with both servers in each run (CONDENSE_OLD), its jobs' figures.
#
# Rounds alternate the order (old new, new old, ...) so that a warming disk or a neighbour's
# load falls on both. Prints, per figure, each build's median and the new/old ratio of the
# medians with the range of the per-round ratios (the spread: a change inside it is noise).
#
#   bench/regress.sh OLD_COMMIT IMAGES_DIR                  # 2 rounds of each
#   ROUNDS=4 bench/regress.sh 37089bd /work/corpus/images
#   SKIP_FIO=1 / SKIP_IMPORT=1 bench/regress.sh ...         # one half only
#   FIO_JOBS="seqwrite1m lat4k" SIZE=1G RUNTIME=15 ...      # passed to fio-bench.sh
#   COMPRESSION=zstd:3 ...                                  # the pools' compression (lz4)
#   OLD_BINARY=/tmp/condense-old ...      # OLD_COMMIT's binary, built already (named in the output)
#
# The old commit is built in a worktree of its own under target/regress/ (its target directory
# is kept there, so a second run against the same commit builds nothing). The new build is
# `cargo build --release -p condense` of this tree. Work files live in WORK_DIR
# (default target/regress/work, on the repository's disk). Needs root to drop the page cache
# (without it the imports read warm images, said in the output). Asserts nothing.
set -euo pipefail
OLD=${1:?usage: bench/regress.sh OLD_COMMIT IMAGES_DIR}
IMAGES=${2:-}
ROUNDS=${ROUNDS:-2}
COMPRESSION=${COMPRESSION:-lz4}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REG=$ROOT/target/regress
WORK=${WORK_DIR:-$REG/work}
mkdir -p "$REG" "$WORK"

old_rev=$(git -C "$ROOT" rev-parse --verify "$OLD^{commit}")
short=$(git -C "$ROOT" rev-parse --short "$old_rev")
tree=$REG/$short
if [ -n "${OLD_BINARY:-}" ]; then
    echo "== old ($short): $OLD_BINARY, as given (not built here)"
else
    if [ ! -d "$tree" ]; then
        git -C "$ROOT" worktree add --detach "$tree" "$old_rev" >/dev/null
    fi
    echo "== building old ($short) in $tree"
    (cd "$tree" && CARGO_TARGET_DIR=$tree/target cargo build --release -p condense 2>&1 | tail -1)
fi
echo "== building new ($(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet || echo ', with uncommitted changes'))"
(cd "$ROOT" && cargo build --release -p condense 2>&1 | tail -1)
cp "${OLD_BINARY:-$tree/target/release/condense}" "$WORK/condense-old"
cp "${CARGO_TARGET_DIR:-$ROOT/target}/release/condense" "$WORK/condense-new"
RESULTS=$WORK/results.jsonl
: >"$RESULTS"

drop_caches() {
    sync
    if ! echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
        [ -n "${warned:-}" ] || echo "   (not root: the page cache is not dropped, images are read warm)"
        warned=1
    fi
}

# import_round WHICH: one corpus import by build WHICH, its figures appended to $RESULTS.
import_round() {
    local which=$1 bin=$WORK/condense-$1 pool=$WORK/pool
    rm -rf "$pool"
    "$bin" init "$pool" --compression "$COMPRESSION" >/dev/null
    drop_caches
    local start end peak=0 user=0 sys=0 rss t
    start=$(date +%s.%N)
    for img in "$IMAGES"/*.raw; do
        /usr/bin/time -f "%M %U %S" -o "$WORK/time" "$bin" --pool "$pool" import "$img" >/dev/null
        read -r rss u s <"$WORK/time"
        [ "$rss" -gt "$peak" ] && peak=$rss
        user=$(echo "$user + $u" | bc)
        sys=$(echo "$sys + $s" | bc)
    done
    sync
    end=$(date +%s.%N)
    t=$(echo "$end - $start" | bc)
    local stored
    stored=$(du -sb "$pool" | cut -f1)
    printf '{"kind":"import","build":"%s","wall_s":%s,"user_s":%s,"sys_s":%s,"peak_rss_mb":%s,"stored_bytes":%s}\n' \
        "$which" "$t" "$user" "$sys" "$((peak / 1024))" "$stored" >>"$RESULTS"
    printf '   %s: %.1f s wall, %.1f s user, %.1f s system, peak RSS %d MB, %s bytes stored\n' \
        "$which" "$t" "$user" "$sys" "$((peak / 1024))" "$stored"
    rm -rf "$pool"
}

if [ -z "${SKIP_IMPORT:-}" ]; then
    [ -n "$IMAGES" ] && ls "$IMAGES"/*.raw >/dev/null 2>&1 ||
        { echo "no IMAGES_DIR/*.raw (build them with ../shared/corpus/build.sh OUT; images are in OUT/images)"; exit 1; }
    echo "== corpus import: $(ls "$IMAGES"/*.raw | wc -l) images in $IMAGES, $COMPRESSION, $ROUNDS rounds"
    for r in $(seq 1 "$ROUNDS"); do
        if [ $((r % 2)) = 1 ]; then order="old new"; else order="new old"; fi
        echo " round $r ($order)"
        for b in $order; do import_round "$b"; done
    done
fi

if [ -z "${SKIP_FIO:-}" ]; then
    echo "== fio over NBD (bench/nbd/fio-bench.sh, both servers in each run), $ROUNDS rounds"
    for r in $(seq 1 "$ROUNDS"); do
        # fio-bench runs "condense" (CONDENSE) then "old" (CONDENSE_OLD) per job: swap which
        # binary sits in which slot every other round.
        if [ $((r % 2)) = 1 ]; then first=new second=old; else first=old second=new; fi
        echo " round $r ($first first)"
        env CONDENSE="$WORK/condense-$first" CONDENSE_OLD="$WORK/condense-$second" \
            SUMMARY_JSON="$WORK/fio-$r.json" BENCH_DIR="$WORK" \
            ${FIO_JOBS:+JOBS="$FIO_JOBS"} bash "$ROOT/bench/nbd/fio-bench.sh" >"$WORK/fio-$r.log" 2>&1 ||
            { echo "fio-bench failed: $WORK/fio-$r.log"; tail -20 "$WORK/fio-$r.log"; exit 1; }
        python3 - "$WORK/fio-$r.json" "$first" "$second" >>"$RESULTS" <<'EOF'
import json, sys
path, first, second = sys.argv[1:4]
for label, v in json.load(open(path)).items():
    figures = {first: v.get("condense"), second: v.get("old"), "plain": v.get("plain")}
    for build in ("old", "new"):
        print(json.dumps({"kind": "fio", "job": label, "build": build, "value": figures[build],
                          "plain": figures["plain"]}))
EOF
    done
fi

python3 - "$RESULTS" "$short" <<'EOF'
import json, statistics, sys
path, short = sys.argv[1:3]
rows = [json.loads(l) for l in open(path)]

def table(title, series):
    # series: label -> {"old": [per round], "new": [per round]}
    if not series:
        return
    print()
    print(title)
    cols = f"{'figure':<32}{'old (' + short + ')':>16}{'new':>12}{'new/old':>10}{'per-round range':>20}"
    print(cols)
    print("-" * len(cols))
    for label, v in series.items():
        old, new = v["old"], v["new"]
        if not old or not new or None in old or None in new:
            continue
        mo, mn = statistics.median(old), statistics.median(new)
        per = [n / o for o, n in zip(old, new) if o]
        spread = f"{min(per):.3f}-{max(per):.3f}" if per else "-"
        print(f"{label:<32}{mo:>16.1f}{mn:>12.1f}{(mn / mo if mo else float('nan')):>10.3f}{spread:>20}")

imp = {}
for r in rows:
    if r["kind"] != "import":
        continue
    for key, label in (("wall_s", "import wall (s)"), ("user_s", "import user CPU (s)"),
                       ("sys_s", "import system CPU (s)"),
                       ("peak_rss_mb", "import peak RSS (MB)"), ("stored_bytes", "stored (MB)")):
        val = r[key] / 1e6 if key == "stored_bytes" else r[key]
        imp.setdefault(label, {"old": [], "new": []})[r["build"]].append(val)
table("corpus import (lower is better)", imp)

fio = {}
for r in rows:
    if r["kind"] == "fio":
        fio.setdefault(r["job"], {"old": [], "new": []})[r["build"]].append(r["value"])
table("fio over NBD (MiB/s and IOPS: higher is better; latencies in us: lower is better)", fio)
plain = {}
for r in rows:
    if r["kind"] == "fio" and r["build"] == "new" and r["plain"]:
        plain.setdefault(r["job"], []).append(r["value"] / r["plain"])
if plain:
    print()
    print("new against a plain file in the same runs (median of the rounds):")
    for label, v in plain.items():
        print(f"  {label:<32}{statistics.median(v):.2f}x")
EOF
