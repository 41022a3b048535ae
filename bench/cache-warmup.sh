#!/usr/bin/env bash
# Issue 10: a dedup-aware cache tier on a fast device in front of a slow one. How fast does the
# cache warm up, and what does it give? (The lvmcache/dm-cache article this reproduces needed
# ~22 reads of a 2.5 GB file before dm-cache served it.)
#
#   bash bench/cache-warmup.sh                                   # 2.5 GiB, 25 runs per mode
#   FILE_GIB=0.25 RUNS=4 CACHE_SIZE=300M bash bench/cache-warmup.sh      # quick: ~2 minutes
#   PARTS="warmup zipf randwrite clones scan" bash bench/cache-warmup.sh  # everything
#   MODES="none" bash bench/cache-warmup.sh                      # the uncached baseline only
#
# The pool lives on a slow device (../shared/tools/slow-device.sh: a loop-device ext4 behind a
# cgroup v1 blkio throttle, SLOW_RMBPS/SLOW_WMBPS MB/s and SLOW_RIOPS/SLOW_WIOPS IOPS, default
# 60/60/150/150, size SLOW_GIB, default enough for the data). `condense serve` runs inside the
# throttled cgroup, so every read it makes from the pool and every fsync'd write pays the slow
# rates. The cache directory (`condense cache attach DIR --size CACHE_SIZE --mode M`) is on the
# normal disk, in BENCH_DIR. The volumes are filled before serve starts, outside the cgroup.
#
# What is read: the volume itself, over NBD, with `nbdcopy nbd://127.0.0.1:PORT/NAME null:` (the
# issue allows it in place of a file in XFS on the volume: the same bytes reach the slow device,
# without a file system layer that could hide reads in its own caching). The data is random
# (unique, incompressible: every byte read comes from the device), or with DATA=images the
# concatenated /work/corpus/images/*.raw (IMAGES=glob) trimmed to the size.
#
# Parts (PARTS, default "warmup"), each with a fresh, empty cache:
#   warmup     read the FILE_GIB volume RUNS times (default 25), page cache dropped before each
#              run, for MODES (default "none writethrough writeback"); per-run seconds, MB/s and
#              cache hit ratio (from `cache stats --json` before/after the run); an SVG chart of
#              MB/s per run; the goals: run 1 cached <= 1.1x run 1 uncached, run 2 >= 90 % of a
#              run served wholly from cache (the fastest of runs 3..RUNS; its hit ratio printed).
#   zipf       fio 4 KiB random reads over NBD, random_distribution=zipf:1.1, qd ZIPF_QD (16),
#              ZIPF_SLICES (6) x ZIPF_SECS (10 s) in one fio run: IOPS and hit ratio per slice,
#              no cache vs writethrough. The page cache is dropped every ZIPF_DROP_SECS (1 s; 0:
#              never) during the run, or the zipf hot set would soon be served from RAM and the
#              uncached baseline would measure the page cache, not the slow device.
#   randwrite  fio 4 KiB random writes over NBD (qd 16, fsync=32: a flush every 32 writes so the
#              throttle applies) for RW_SECS (30) on an empty RW_SIZE (1G) volume: writeback vs
#              no cache IOPS (goal >= 20x), and a pool on the normal disk (the ceiling).
#   clones     snapshot the warmup volume, make CLONES (20) clones, read each in turn
#              (writethrough): time per clone, cache_used_bytes after the first and after all.
#   scan       heat a hot volume (HOT_SIZE, default CACHE_SIZE/4) by reading it twice, read a
#              cold volume of 2 x CACHE_SIZE once, read the hot one again: the fraction of it
#              still served from the cache (goal >= 80 %). Writethrough.
#
# If `condense cache attach --mode writeback` is refused (not implemented in this build), the
# tables say "writeback: not available in this build" and the script goes on. Without a `cache`
# command at all, only the uncached columns are measured.
# Needs root (loop device, cgroup, drop_caches; without root it prints "skipped" and exits 0),
# fio (with the nbd engine), libnbd-bin (nbdcopy, nbdinfo), jq, python3. Prints figures;
# asserts nothing. Results (tables, TSV, SVG) are left in BENCH_DIR/results-TIMESTAMP/.

# shellcheck disable=SC2317 # the parts are called as "part_$part", cleanup from the EXIT trap
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

if [ "$(id -u)" != 0 ]; then
    echo "cache-warmup: needs root (loop device, cgroup blkio throttle, drop_caches): skipped"
    exit 0
fi

# ---- settings -----------------------------------------------------------------------------
FILE_GIB=${FILE_GIB:-2.5}
RUNS=${RUNS:-25}
CACHE_SIZE=${CACHE_SIZE:-3G}
MODES=${MODES:-none writethrough writeback}
PARTS=${PARTS:-warmup}
DATA=${DATA:-random}
IMAGES=${IMAGES:-/work/corpus/images/*.raw}
SLOW_RMBPS=${SLOW_RMBPS:-60}
SLOW_WMBPS=${SLOW_WMBPS:-60}
SLOW_RIOPS=${SLOW_RIOPS:-150}
SLOW_WIOPS=${SLOW_WIOPS:-150}
ZIPF_SLICES=${ZIPF_SLICES:-6}
ZIPF_SECS=${ZIPF_SECS:-10}
ZIPF_QD=${ZIPF_QD:-16}
ZIPF_DROP_SECS=${ZIPF_DROP_SECS:-1}
RW_SIZE=${RW_SIZE:-1G}
RW_SECS=${RW_SECS:-30}
CLONES=${CLONES:-20}
SLOWDEV=${SLOWDEV:-$ROOT/../shared/tools/slow-device.sh}
[ -f "$SLOWDEV" ] || SLOWDEV=/work/shared/tools/slow-device.sh

# to_bytes SIZE: K/M/G/T suffixes are powers of 1024 (as condense takes them); decimals allowed.
to_bytes() {
    awk -v s="$1" 'BEGIN {
        n = s + 0; u = toupper(substr(s, length(s)))
        m = (u == "K") ? 2^10 : (u == "M") ? 2^20 : (u == "G") ? 2^30 : (u == "T") ? 2^40 : 1
        printf "%.0f\n", n * m }'
}
# mib_round BYTES: down to a whole MiB (volume sizes must be multiples of the block size).
mib_round() { echo $(( $1 / 1048576 * 1048576 )); }

FILE_BYTES=$(mib_round "$(to_bytes "${FILE_GIB}G")")
CACHE_BYTES=$(to_bytes "$CACHE_SIZE")
HOT_BYTES=$(mib_round "$(to_bytes "${HOT_SIZE:-$((CACHE_BYTES / 4))}")")
COLD_BYTES=$(mib_round $((2 * CACHE_BYTES)))
RW_BYTES=$(mib_round "$(to_bytes "$RW_SIZE")")

has_part() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }

# The slow device must hold the pool: the data, the scan volumes, the random writes, 20 % and
# 1 GiB of slack for metadata and ext4.
if [ -z "${SLOW_GIB:-}" ]; then
    need=$FILE_BYTES
    has_part scan && need=$((need + HOT_BYTES + COLD_BYTES))
    has_part randwrite && need=$((need + 2 * RW_BYTES))
    SLOW_GIB=$(( need * 12 / 10 / 1073741824 + 2 ))
fi

if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=${CARGO_TARGET_DIR:-$ROOT/target}/release/condense
fi
for tool in fio nbdcopy nbdinfo jq python3 losetup mkfs.ext4; do
    command -v "$tool" >/dev/null || { echo "missing $tool (scripts/install-deps.sh)"; exit 1; }
done
[ -f "$SLOWDEV" ] || { echo "missing slow-device.sh (set SLOWDEV=PATH)"; exit 1; }
[ -d /sys/fs/cgroup/blkio ] || { echo "cache-warmup: no cgroup v1 blkio controller here: skipped"; exit 0; }
if has_part zipf || has_part randwrite; then
    fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd ioengine"; exit 1; }
fi

BASE=${BENCH_DIR:-$ROOT/target/bench-cache}
mkdir -p "$BASE"
W=$(mktemp -d "$BASE/run.XXXXXX")          # slow device, cache, pool: removed at exit
OUT=$BASE/results-$(date -u +%Y%m%dT%H%M%SZ)  # tables, TSV, SVG: kept
mkdir -p "$OUT"
SLOW=$W/slow
POOL=$SLOW/mnt/pool
CACHE_DIR=$W/cache
PORT=$((20000 + RANDOM % 20000))
SERVER_PID=
DROPPER_PID=
SLOW_UP=

# ---- cleanup -------------------------------------------------------------------------------
cleanup() {
    stop_dropper
    stop_serve
    if [ -n "$SLOW_UP" ]; then bash "$SLOWDEV" down "$SLOW" || true; fi
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $W"; else rm -rf "$W"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- helpers -------------------------------------------------------------------------------
c() { "$CONDENSE" --pool "$POOL" "$@"; }
now() { date +%s.%N; }
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
say() { echo "== $*"; }

# Does this build have `condense cache`?
HAS_CACHE=0
if "$CONDENSE" cache --help >/dev/null 2>&1; then HAS_CACHE=1; fi

# fill_volume NAME BYTES: a new volume holding BYTES of data (see DATA), imported from stdin.
fill_volume() {
    local name=$1 bytes=$2
    if [ "$DATA" = images ]; then
        # shellcheck disable=SC2086 # IMAGES is a glob on purpose
        { cat $IMAGES 2>/dev/null || true; } | head -c "$bytes" |
            c import - --name "$name" --size "$bytes" >/dev/null
    else
        head -c "$bytes" /dev/urandom | c import - --name "$name" --size "$bytes" >/dev/null
    fi
}

# start_serve: `condense serve` inside the slow device's cgroup (slow-device.sh run execs it,
# so $! is the server). Waits until the NBD port and the control socket answer.
start_serve() {
    PORT=$((PORT + 1)) # a fresh port: the last one may still be in TIME_WAIT
    bash "$SLOWDEV" run "$SLOW" "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" \
        >>"$W/serve.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 300); do
        if [ -S "$POOL/control.sock" ] && nbdinfo --list "nbd://127.0.0.1:$PORT" >/dev/null 2>&1; then
            return 0
        fi
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 0.1
    done
    echo "serve did not start"; tail -20 "$W/serve.log"; exit 1
}
stop_serve() {
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}

# start_dropper / stop_dropper: drop the page cache every ZIPF_DROP_SECS in the background.
start_dropper() {
    [ "$ZIPF_DROP_SECS" != 0 ] || return 0
    (while sleep "$ZIPF_DROP_SECS"; do echo 1 >/proc/sys/vm/drop_caches; done) &
    DROPPER_PID=$!
}
stop_dropper() {
    if [ -n "$DROPPER_PID" ]; then
        kill "$DROPPER_PID" 2>/dev/null || true
        wait "$DROPPER_PID" 2>/dev/null || true
        DROPPER_PID=
    fi
}

# use_cache MODE: detach whatever cache is attached, empty the cache directory, and attach a
# fresh one in MODE (none: no cache). Serve must be stopped. Returns 1 (with the reason in
# $W/why-MODE) if this build cannot do MODE.
use_cache() {
    local mode=$1 out
    if [ "$HAS_CACHE" = 1 ]; then
        c cache detach >/dev/null 2>&1 || c cache detach --force >/dev/null 2>&1 || true
    fi
    rm -rf "$CACHE_DIR"; mkdir -p "$CACHE_DIR"
    [ "$mode" = none ] && return 0
    if [ "$HAS_CACHE" = 0 ]; then
        echo "$mode: not available in this build (no \`condense cache\` command)" >"$W/why-$mode"
        return 1
    fi
    if ! out=$(c cache attach "$CACHE_DIR" --size "$CACHE_SIZE" --mode "$mode" 2>&1); then
        if grep -qi "not implemented" <<<"$out"; then
            echo "$mode: not available in this build" >"$W/why-$mode"
        else
            echo "$mode: cache attach failed: $(head -1 <<<"$out")" >"$W/why-$mode"
        fi
        return 1
    fi
}

# stats FILE: `cache stats --json` of the running server into FILE ({} without a cache).
stats() {
    if [ "$HAS_CACHE" = 1 ] && c cache stats --json >"$1" 2>/dev/null && jq -e . "$1" >/dev/null 2>&1; then
        return 0
    fi
    echo '{}' >"$1"
}
# delta KEY BEFORE AFTER: the growth of one counter (0 if absent).
delta() { jq -n --slurpfile a "$2" --slurpfile b "$3" "((\$b[0].$1 // 0) - (\$a[0].$1 // 0))"; }
# hit_ratio BEFORE AFTER: hit bytes / (hit + miss bytes) between two stats files, or "-".
hit_ratio() {
    local h m
    h=$(delta cache_hit_bytes "$1" "$2"); m=$(delta cache_miss_bytes "$1" "$2")
    if [ $((h + m)) -gt 0 ]; then awk -v h="$h" -v m="$m" 'BEGIN {printf "%.3f", h / (h + m)}'; else echo -; fi
}
field() { jq -r ".$1 // \"-\"" "$2"; }

# read_volume NAME: page cache dropped, the whole volume read over NBD. Prints
# "SECONDS MBPS HIT_RATIO USED_BYTES" (hit ratio and cache_used_bytes from cache stats).
read_volume() {
    local name=$1 bytes t0 t1
    bytes=$(c volume info "$name" --json | jq -r .logical_bytes)
    stats "$W/s0.json"
    drop_caches
    t0=$(now)
    nbdcopy "nbd://127.0.0.1:$PORT/$name" null:
    t1=$(now)
    stats "$W/s1.json"
    awk -v a="$t0" -v b="$t1" -v n="$bytes" -v r="$(hit_ratio "$W/s0.json" "$W/s1.json")" \
        -v u="$(field cache_used_bytes "$W/s1.json")" \
        'BEGIN {printf "%.2f %.1f %s %s\n", b - a, n / (b - a) / 1e6, r, u}'
}

# ---- the parts -----------------------------------------------------------------------------

# warmup: RUNS reads of the volume per mode -> $OUT/warmup-MODE.tsv (run secs mbps hit used).
part_warmup() {
    local mode run line
    for mode in $MODES; do
        if ! use_cache "$mode"; then cat "$W/why-$mode"; cp "$W/why-$mode" "$OUT/warmup-$mode.na"; continue; fi
        start_serve
        say "warmup, $mode: $RUNS reads of $FILE_BYTES bytes"
        : >"$OUT/warmup-$mode.tsv"
        for run in $(seq 1 "$RUNS"); do
            line=$(read_volume file)
            echo "$run $line" >>"$OUT/warmup-$mode.tsv"
            awk -v r="$run" '{printf "   run %3d: %7.2f s %8.1f MB/s  hit %s\n", r, $1, $2, $3}' <<<"$line"
        done
        stop_serve
    done
    python3 - "$OUT" "$RUNS" "$FILE_BYTES" "$MODES" <<'EOF'
import os, sys
out, runs, size, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
data, na = {}, {}
for m in modes:
    p = os.path.join(out, f"warmup-{m}.tsv")
    if os.path.exists(p):
        rows = [l.split() for l in open(p) if l.strip()]
        data[m] = {int(r[0]): (float(r[1]), float(r[2]), r[3]) for r in rows}
    elif os.path.exists(os.path.join(out, f"warmup-{m}.na")):
        na[m] = open(os.path.join(out, f"warmup-{m}.na")).read().strip()
lines = [f"warmup: {size / 2**30:.2f} GiB volume read {runs} times (nbdcopy to null:, page cache dropped before each run)"]
hdr = f"{'run':>4}" + "".join(f"{m + ' s':>16}{'MB/s':>9}{'hit':>7}" for m in data)
lines += [hdr, "-" * len(hdr)]
for r in range(1, runs + 1):
    row = f"{r:>4}"
    for m in data:
        s, mb, hit = data[m].get(r, (float("nan"), float("nan"), "-"))
        row += f"{s:>16.2f}{mb:>9.1f}{hit:>7}"
    lines.append(row)
for m, why in na.items():
    lines.append(why)
lines.append("")
base = data.get("none")
for m in data:
    if m == "none":
        continue
    d = data[m]
    if base and 1 in base and 1 in d:
        r = d[1][0] / base[1][0]
        lines.append(f"{m}: run 1 {d[1][0]:.2f} s vs uncached run 1 {base[1][0]:.2f} s = {r:.2f}x "
                     f"(goal <= 1.1x: {'met' if r <= 1.1 else 'MISSED'})")
    later = [(d[k][1], k) for k in d if k >= 3]
    if 2 in d and later:
        best, k = max(later)
        pct = d[2][1] / best
        lines.append(f"{m}: run 2 {d[2][1]:.1f} MB/s vs run {k} {best:.1f} MB/s (the fastest of runs 3..{runs}, "
                     f"hit ratio {d[k][2]}, taken as wholly from cache) = {pct:.0%} (goal >= 90 %: {'met' if pct >= 0.9 else 'MISSED'})")
        med = sorted(v for v, _ in later)[len(later) // 2]
        lines.append(f"{m}: run 2 vs the median of runs 3..{runs} ({med:.1f} MB/s): {d[2][1] / med:.0%}")
    elif 2 in d:
        lines.append(f"{m}: run 2 vs a run wholly from cache: n/a (needs RUNS >= 3)")
    first_full = next((k for k in sorted(d) if d[k][2] not in ("-",) and float(d[k][2]) >= 0.99), None)
    lines.append(f"{m}: first run with hit ratio >= 99 %: {first_full if first_full else 'none'}")
text = "\n".join(lines)
print(text)
open(os.path.join(out, "warmup.txt"), "w").write(text + "\n")

# The chart: MB/s per run, one line per mode.
W, H, L, R, T, B = 720, 420, 60, 150, 30, 45
ymax = max([v[1] for d in data.values() for v in d.values()] + [1]) * 1.1
x = lambda r: L + (r - 1) * (W - L - R) / max(runs - 1, 1)
y = lambda v: T + (H - T - B) * (1 - v / ymax)
colors = {"none": "#888888", "writethrough": "#1f77b4", "writeback": "#d62728"}
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{W/2}" y="18" text-anchor="middle" font-size="14">Cache warm-up: MB/s per run ({size / 2**30:.2f} GiB, page cache dropped)</text>']
for i in range(6):
    v = ymax * i / 5
    svg.append(f'<line x1="{L}" x2="{W-R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
    svg.append(f'<text x="{L-6}" y="{y(v)+4:.1f}" text-anchor="end">{v:.0f}</text>')
step = max(1, runs // 12)
for r in range(1, runs + 1, step):
    svg.append(f'<text x="{x(r):.1f}" y="{H-B+16}" text-anchor="middle">{r}</text>')
svg.append(f'<text x="{(L+W-R)/2}" y="{H-8}" text-anchor="middle">run</text>')
svg.append(f'<text x="14" y="{(T+H-B)/2}" transform="rotate(-90 14 {(T+H-B)/2})" text-anchor="middle">MB/s</text>')
svg.append(f'<line x1="{L}" x2="{L}" y1="{T}" y2="{H-B}" stroke="black"/><line x1="{L}" x2="{W-R}" y1="{H-B}" y2="{H-B}" stroke="black"/>')
for n, m in enumerate(data):
    col = colors.get(m, "#2ca02c")
    pts = " ".join(f"{x(r):.1f},{y(v[1]):.1f}" for r, v in sorted(data[m].items()))
    svg.append(f'<polyline fill="none" stroke="{col}" stroke-width="2" points="{pts}"/>')
    for r, v in sorted(data[m].items()):
        svg.append(f'<circle cx="{x(r):.1f}" cy="{y(v[1]):.1f}" r="2.5" fill="{col}"/>')
    svg.append(f'<line x1="{W-R+15}" x2="{W-R+35}" y1="{T+20+n*18}" y2="{T+20+n*18}" stroke="{col}" stroke-width="2"/>')
    svg.append(f'<text x="{W-R+40}" y="{T+24+n*18}">{m}</text>')
for n, (m, why) in enumerate(na.items()):
    svg.append(f'<text x="{W-R+15}" y="{T+24+(len(data)+n)*18}" fill="#999">{m}: n/a</text>')
svg.append("</svg>")
open(os.path.join(out, "warmup.svg"), "w").write("\n".join(svg) + "\n")
EOF
}

# zipf: one fio run of ZIPF_SLICES x ZIPF_SECS, IOPS per slice from fio's log, hit ratio per
# slice from cache stats taken at the slice boundaries.
part_zipf() {
    local mode i t0 fpid
    for mode in none writethrough; do
        if ! use_cache "$mode"; then cat "$W/why-$mode"; continue; fi
        start_serve
        say "zipf, $mode: 4K random reads, zipf:1.1, qd $ZIPF_QD, $ZIPF_SLICES x $ZIPF_SECS s"
        drop_caches
        stats "$W/z0.json"
        t0=$(now)
        fio --name=zipf --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/file" --size="$FILE_BYTES" \
            --rw=randread --bs=4k --iodepth="$ZIPF_QD" --random_distribution=zipf:1.1 \
            --time_based=1 --runtime=$((ZIPF_SLICES * ZIPF_SECS)) \
            --write_iops_log="$W/zipf-$mode" --log_avg_msec=$((ZIPF_SECS * 1000)) \
            --output-format=json --output="$W/zipf-$mode.json" >/dev/null 2>&1 &
        fpid=$!
        start_dropper
        for i in $(seq 1 "$ZIPF_SLICES"); do
            sleep "$(awk -v t0="$t0" -v now="$(now)" -v e=$((i * ZIPF_SECS)) 'BEGIN {d = t0 + e - now; print (d > 0 ? d : 0)}')"
            stats "$W/z$i.json"
        done
        stop_dropper
        wait "$fpid" || { echo "fio zipf ($mode) failed"; tail -5 "$W/zipf-$mode.json"; exit 1; }
        : >"$OUT/zipf-$mode.tsv"
        for i in $(seq 1 "$ZIPF_SLICES"); do
            # fio's log: msec, average IOPS over the interval, direction, bs, offset
            iops=$(awk -F, -v i="$i" 'NR == i {printf "%d", $2}' "$W/zipf-${mode}_iops.1.log")
            echo "$i ${iops:--} $(hit_ratio "$W/z$((i - 1)).json" "$W/z$i.json") $(field cache_used_bytes "$W/z$i.json")" >>"$OUT/zipf-$mode.tsv"
        done
        stop_serve
    done
    {
        echo "zipf: fio 4K randread, zipf:1.1, qd $ZIPF_QD, over the $FILE_BYTES-byte volume, slices of $ZIPF_SECS s," \
            "page cache dropped every ${ZIPF_DROP_SECS} s"
        printf '%6s %12s %12s %8s %14s\n' slice "none IOPS" "wt IOPS" "wt hit" "wt used bytes"
        for i in $(seq 1 "$ZIPF_SLICES"); do
            a=$(awk -v i="$i" '$1 == i {print $2}' "$OUT/zipf-none.tsv" 2>/dev/null || true)
            b=$(awk -v i="$i" '$1 == i {print $2, $3, $4}' "$OUT/zipf-writethrough.tsv" 2>/dev/null || true)
            read -r bi bh bu <<<"${b:-- - -}"
            printf '%6s %12s %12s %8s %14s\n' "$i" "${a:--}" "$bi" "$bh" "$bu"
        done
        if [ -f "$W/why-writethrough" ]; then cat "$W/why-writethrough"; fi
    } | tee "$OUT/zipf.txt"
}

# randwrite: 4K random writes with a flush every 32, on a fresh empty volume per mode; and the
# same job on a pool on the normal disk (no slow device, no cache): the ceiling writeback can
# reach on this machine, measured in the same run.
part_randwrite() {
    local mode iops vol saved
    : >"$OUT/randwrite.tsv"
    for mode in none writeback fastdisk; do
        saved=$POOL
        if [ "$mode" = fastdisk ]; then
            POOL=$W/fastdisk-pool
            "$CONDENSE" init "$POOL" >/dev/null
        elif ! use_cache "$mode"; then
            cat "$W/why-$mode"; continue
        fi
        vol=rw-$mode
        c volume create "$vol" --size "$RW_BYTES" >/dev/null
        start_serve
        say "randwrite, $mode: 4K random writes, qd 16, fsync=32, $RW_SECS s on an empty $RW_BYTES-byte volume"
        fio --name=randwrite --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$vol" --size="$RW_BYTES" \
            --rw=randwrite --bs=4k --iodepth=16 --fsync=32 --refill_buffers=1 --randrepeat=0 \
            --time_based=1 --runtime="$RW_SECS" --output-format=json \
            --output="$W/randwrite-$mode.json" >/dev/null 2>&1 ||
            { echo "fio randwrite ($mode) failed"; tail -5 "$W/randwrite-$mode.json"; exit 1; }
        iops=$(jq -r '.jobs[0].write.iops | floor' "$W/randwrite-$mode.json")
        stats "$W/rw.json"
        echo "$mode $iops $(field cache_dirty_bytes "$W/rw.json")" >>"$OUT/randwrite.tsv"
        stop_serve
        POOL=$saved
    done
    {
        echo "randwrite: fio 4K randwrite over NBD, qd 16, fsync=32, $RW_SECS s"
        echo "  (fastdisk: a pool on the normal disk, no cache: the ceiling on this machine)"
        awk '{printf "  %-10s %8s IOPS   dirty after: %s bytes\n", $1, $2, $3}' "$OUT/randwrite.tsv"
        awk '$1 == "none" {n = $2} $1 == "writeback" {w = $2} $1 == "fastdisk" {f = $2}
             END {if (n > 0 && w > 0) printf "  writeback / none = %.1fx (goal >= 20x: %s)\n", w / n, (w / n >= 20 ? "met" : "MISSED")
                  if (f > 0 && w > 0) printf "  writeback / fastdisk = %.2fx\n", w / f}' \
            "$OUT/randwrite.tsv"
        if [ -f "$W/why-writeback" ]; then cat "$W/why-writeback"; fi
    } | tee "$OUT/randwrite.txt"
}

# clones: CLONES clones of one snapshot, each read in turn; the cache should hold one copy.
part_clones() {
    local i line
    use_cache writethrough || { echo "clones: $(cat "$W/why-writethrough")" | tee "$OUT/clones.txt"; return 0; }
    start_serve
    c snapshot create file golden >/dev/null
    for i in $(seq 1 "$CLONES"); do c volume clone file@golden "clone$i" >/dev/null; done
    say "clones: $CLONES clones of file@golden read in turn (writethrough)"
    : >"$OUT/clones.tsv"
    for i in $(seq 1 "$CLONES"); do
        line=$(read_volume "clone$i")
        echo "$i $line" >>"$OUT/clones.tsv"
    done
    stop_serve
    {
        echo "clones: $CLONES clones of a $FILE_BYTES-byte volume, each read once (writethrough)"
        printf '%6s %9s %9s %7s %16s\n' clone seconds MB/s hit cache_used
        awk '{printf "%6s %9.2f %9.1f %7s %16s\n", $1, $2, $3, $4, $5}' "$OUT/clones.tsv"
        awk -v v="$FILE_BYTES" 'NR == 1 {f = $5} {l = $5}
             END {if (f > 0) printf "cache_used_bytes after all %d clones / after the first: %s / %s = %.2fx (goal: ~1x, one copy)\n" \
                  "cache_used_bytes after all / one volume'"'"'s bytes: %.2fx (a first read that did not fill the cache makes the first ratio look worse)\n",
                  NR, l, f, l / f, l / v}' "$OUT/clones.tsv"
    } | tee "$OUT/clones.txt"
}

# scan: does one big sequential read of cold data flush the hot set out of the cache?
part_scan() {
    local step line
    use_cache writethrough || { echo "scan: $(cat "$W/why-writethrough")" | tee "$OUT/scan.txt"; return 0; }
    start_serve
    say "scan: hot set $HOT_BYTES bytes read twice, cold volume $COLD_BYTES bytes once, hot again (writethrough)"
    : >"$OUT/scan.tsv"
    for step in hot:heat-1 hot:heat-2 cold:scan hot:after-scan; do
        line=$(read_volume "${step%%:*}")
        echo "${step#*:} $line" >>"$OUT/scan.tsv"
    done
    stop_serve
    {
        echo "scan: cache $CACHE_BYTES bytes, hot $HOT_BYTES, cold $COLD_BYTES (writethrough)"
        printf '%-12s %9s %9s %7s %16s\n' read seconds MB/s hit cache_used
        awk '{printf "%-12s %9.2f %9.1f %7s %16s\n", $1, $2, $3, $4, $5}' "$OUT/scan.tsv"
        awk '$1 == "heat-2" {printf "hot set served from the cache before the scan (second heating read): %s\n", $4}
             $1 == "after-scan" {if ($4 == "-") print "hot set after the scan: n/a"; else
             printf "hot set served from the cache after the scan: %.0f %% (goal >= 80 %%: %s)\n", $4 * 100, ($4 >= 0.8 ? "met" : "MISSED")}' \
            "$OUT/scan.tsv"
    } | tee "$OUT/scan.txt"
}

# ---- setup and run -----------------------------------------------------------------------
say "slow device: $SLOW_GIB GiB, read $SLOW_RMBPS MB/s $SLOW_RIOPS IOPS, write $SLOW_WMBPS MB/s $SLOW_WIOPS IOPS"
SLOW_UP=1
bash "$SLOWDEV" up "$SLOW" "$SLOW_GIB" "$SLOW_RMBPS" "$SLOW_WMBPS" "$SLOW_RIOPS" "$SLOW_WIOPS"
c init >/dev/null
say "filling volume file: $FILE_BYTES bytes of $DATA data"
fill_volume file "$FILE_BYTES"
if has_part scan; then
    say "filling volumes hot ($HOT_BYTES bytes) and cold ($COLD_BYTES bytes) for the scan"
    fill_volume hot "$HOT_BYTES"
    fill_volume cold "$COLD_BYTES"
fi
[ "$HAS_CACHE" = 1 ] || echo "note: this condense has no \`cache\` command: cached modes are not available in this build"
echo "condense: $CONDENSE ($("$CONDENSE" --version)); cache dir $CACHE_DIR, size $CACHE_SIZE; parts: $PARTS"

for part in $PARTS; do
    case $part in
        warmup | zipf | randwrite | clones | scan) "part_$part" ;;
        *) echo "unknown part $part (warmup zipf randwrite clones scan)"; exit 2 ;;
    esac
done

echo
for f in warmup zipf randwrite clones scan; do
    if [ -f "$OUT/$f.txt" ]; then cat "$OUT/$f.txt"; echo; fi
done
echo "results: $OUT"
if [ -f "$OUT/warmup.svg" ]; then echo "chart: $OUT/warmup.svg"; fi
exit 0
