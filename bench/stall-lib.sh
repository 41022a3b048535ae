# Shared by bench/admin-stall.sh and bench/delete-scale.sh (issue 42), sourced, not run: a served
# pool holding a big volume built from `gen-unique` and a 1 GiB volume `vm` under fio 4 KiB
# random reads and writes at queue depth 1 (every request's latency logged), time windows
# recorded in WORK/windows, and the table of vm's latency in each window.
#
# The sourcing script sets `work` (a directory this file empties and removes at exit) and may
# set, before sourcing: CONDENSE, GEN_UNIQUE (binaries), and in the environment
#   CACHE=DIR        a writeback cache tier on DIR (CACHE_SIZE, default 4G) in front of the pool,
#                    which stays in WORK/pool: DIR must be another directory (checked)
#   S3=1             the pool in a bucket of a 3-node Garage cluster started in WORK/garage
#                    (tests/s3/garage.sh; GARAGE or ~/.cargo/bin/garage), WORK/pool its local
#                    directory (S3_CACHE_SIZE, default 4G); PEER=1 also joins a second host
#                    (WORK/peer) for `hosts sync` to fold
#   CONDENSE_SLOW_HOLD_MS=N  the serve logs holds of the pool's state >= N ms; the table is
#                    followed by a count of them by the line that took the lock
#   KEEP=1           keep WORK (serve.log, fio's logs, the windows) at the end
# The idle p99 and the goal's 2x are per direction. The serve's background GC and (on S3)
# background sync run every 30 s: what they cost lands in whichever window they fall in.
# Functions: stall_make_pool, stall_import VOLUME BLOCKS SEED [POOL], stall_serve,
# stall_fill_vm, stall_fio PREFIX, stall_stop_fio, stall_window NAME START END STATUS [NOTE],
# stall_idle SECONDS, now_ms, stall_table TITLE.

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
gen=${GEN_UNIQUE:-$here/target/release/gen-unique}
bs=4096
me=$(basename "$0")
die() { echo "$me: $*" >&2; exit 1; }
for t in fio nbdinfo python3; do command -v "$t" >/dev/null || die "needs $t"; done
[ -x "$condense" ] || (cd "$here" && cargo build --release -p condense)
[ -x "$gen" ] || (cd "$here" && cargo build --release -p condense-bench --bin gen-unique)

pool=$work/pool
sock=$work/nbd.sock
uri="nbd+unix:///vm?socket=$sock"
windows=$work/windows
garage_dir=
cache_made=
server=
fio_pid=
kind=local
[ -n "${CACHE:-}" ] && kind="local + writeback cache tier"
[ "${S3:-}" = 1 ] && kind="S3 (Garage, 3 nodes on loopback)"

stall_cleanup() {
    [ -n "$fio_pid" ] && kill "$fio_pid" 2>/dev/null
    [ -n "$server" ] && kill "$server" 2>/dev/null
    wait 2>/dev/null
    [ -n "$garage_dir" ] && bash "$here/tests/s3/garage.sh" stop "$garage_dir" >/dev/null 2>&1
    [ "${KEEP:-}" = 1 ] && { echo "$me: kept $work (KEEP=1)"; return 0; }
    [ -n "$cache_made" ] && rm -rf "$cache_made"
    rm -rf "$work"
}
trap stall_cleanup EXIT
rm -rf "$work"
mkdir -p "$work"

# The slow-hold log is the serve's: the commands and imports run without it.
slow_hold=${CONDENSE_SLOW_HOLD_MS:-}
unset CONDENSE_SLOW_HOLD_MS
c() { "$condense" --pool "$pool" "$@"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# The pool, empty: local, local with a writeback cache tier on CACHE, or on S3 (Garage).
stall_make_pool() {
    if [ "${S3:-}" = 1 ]; then
        garage_dir=$work/garage
        bash "$here/tests/s3/garage.sh" start "$garage_dir" >"$work/garage.log" 2>&1 ||
            die "Garage did not start: $(tail -3 "$work/garage.log")"
        # shellcheck disable=SC1091
        . "$garage_dir/credentials.env"
        s3_url=s3://$CONDENSE_S3_BUCKET/stall
        "$condense" init "$s3_url" --cache "$pool" --cache-size "${S3_CACHE_SIZE:-4G}" >/dev/null
        if [ "${PEER:-}" = 1 ]; then
            "$condense" connect "$s3_url" --join --host stall-peer --cache "$work/peer" \
                --cache-size "${S3_CACHE_SIZE:-4G}" >/dev/null
        fi
    else
        c init >/dev/null
    fi
    if [ -n "${CACHE:-}" ]; then
        mkdir -p "$CACHE"
        chmod 700 "$CACHE"
        local a b
        a=$(cd "$CACHE" && pwd -P)
        b=$(cd "$pool" && pwd -P)
        case "$a/" in "$b/"*) die "CACHE=$CACHE is inside the pool $pool: give another directory" ;; esac
        [ -z "$(ls -A "$CACHE")" ] || die "CACHE=$CACHE is not empty"
        cache_made=$a
        c cache attach "$CACHE" --mode writeback --size "${CACHE_SIZE:-4G}" >/dev/null
        [ -n "$(ls -A "$CACHE")" ] || die "cache attach left $CACHE empty"
    fi
}

# stall_import VOLUME BLOCKS SEED [POOL]: BLOCKS unique compressible blocks into a new volume.
stall_import() {
    local t0=$SECONDS
    "$gen" --blocks "$2" --seed "$3" 2>/dev/null |
        "$condense" --pool "${4:-$pool}" import - --name "$1" --size $(($2 * bs)) >/dev/null
    echo "   $1: $2 blocks imported in $((SECONDS - t0)) s"
}

# Serve the pool on $sock (log WORK/serve.log, appended) and wait until vm answers.
stall_serve() {
    CONDENSE_SLOW_HOLD_MS=$slow_hold CONDENSE_LOG=info "$condense" --pool "$pool" serve --socket "$sock" >>"$work/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1 1200); do nbdinfo --size "$uri" >/dev/null 2>&1 && return 0; sleep 0.1; done
    die "the server did not answer in 120 s: $(tail -3 "$work/serve.log")"
}

# Write vm once and read it once (on S3, what is uploaded is read from the bucket until a
# read promotes it into the local cache tier: fio must measure the pool, not the first
# misses), then wait for the per-volume figures' first count (it runs after the open) and,
# on a local pool, for the serve's first background scrub pass to end (a new pool is scrubbed
# at once, then every 7 days: a busy core beside fio made vm's requests ~3x faster, so an
# idle window that straddled the pass's end was no baseline; 2026-11-29, sixth pass).
stall_fill_vm() {
    fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=4 --size=1G \
        --refill_buffers=1 --output=/dev/null
    fio --name=warm --ioengine=nbd --uri="$uri" --rw=read --bs=1M --iodepth=4 --size=1G \
        --output=/dev/null
    for _ in $(seq 1 600); do grep -q "attribution counted" "$work/serve.log" && break; sleep 0.1; done
    [ "${S3:-}" = 1 ] && return 0
    for _ in $(seq 1 6000); do grep -q "scrub: .* checked" "$work/serve.log" && return 0; sleep 0.1; done
    echo "   (the first scrub pass had not ended after 600 s: it runs beside the idle window)"
}

# stall_fio PREFIX: fio on vm in the background, latency log WORK/PREFIX_clat.*.log.
stall_fio() {
    fio --name=vm --ioengine=nbd --uri="$uri" --rw=randrw --rwmixread=50 --bs=4k --iodepth=1 \
        --size=1G --time_based --runtime=36000 --refill_buffers=1 --randrepeat=0 \
        --write_lat_log="$work/$1" --log_avg_msec=0 --log_unix_epoch=1 \
        --output="$work/fio-$1.txt" >/dev/null 2>&1 &
    fio_pid=$!
}

stall_stop_fio() {
    [ -n "$fio_pid" ] || return 0
    kill -INT "$fio_pid" 2>/dev/null
    wait "$fio_pid" 2>/dev/null || true
    fio_pid=
}

# stall_window NAME START_MS END_MS STATUS [NOTE...]: one row of the table.
stall_window() { echo "$*" >>"$windows"; }

# stall_idle SECONDS: the idle baseline (fio running, nothing else).
stall_idle() {
    local a
    a=$(now_ms)
    sleep "$1"
    stall_window idle "$a" "$(now_ms)" ok
}

# stall_table TITLE: per window, vm's read and write p99 and worst latency against the idle
# window's p99, and issue 42's goal (worst <= 50 ms, p99 <= 2x idle in each direction). The
# "idle spread" column: the highest p99 of vm alone over slices of the idle window as long as
# the operation's (its own background GC lands in some); a FAIL whose p99 is no higher says
# "within vm's idle spread": the window cannot tell the operation from vm's own drift.
stall_table() {
    python3 - "$work" "$1" <<'EOF'
import glob, sys
work, title = sys.argv[1], sys.argv[2]
# fio's completion-latency log: completion time (ms since the epoch), latency (ns), direction
# (0 read, 1 write), ...
lat = {0: [], 1: []}
for path in glob.glob(f"{work}/*_clat.*.log"):
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 3 and f[2] in ("0", "1"):
            lat[int(f[2])].append((int(f[0]), int(f[1]) / 1e6))
rows = []
for line in open(f"{work}/windows"):
    p = line.split()
    rows.append((p[0], int(p[1]), int(p[2]), p[3], " ".join(p[4:])))
rows.sort(key=lambda r: r[1])
def during(d, a, b):
    # every request that completed in the window, or was in flight at its end
    return sorted(ms for t, ms in lat[d] if a <= t <= b or (t > b and t - ms <= b))
def pct(v, p):
    return v[min(len(v) - 1, int(len(v) * p))] if v else float("nan")
def figures(a, b):
    r, w = during(0, a, b), during(1, a, b)
    return (pct(r, 0.99), max(r, default=float("nan")), pct(w, 0.99),
            max(w, default=float("nan")), len(r) + len(w))
idle = [r for r in rows if r[0] == "idle"]
# idle-after: the same baseline again after the last operation, as a row: how far vm's own
# latency drifted over the run, whatever the operations did
if not idle:
    sys.exit("no idle window")
ir99, irw, iw99, iww, n = figures(idle[0][1], idle[0][2])
print()
print(title)
print(f"idle: {n} requests; read p99 {ir99:.2f} ms (worst {irw:.2f}), write p99 {iw99:.2f} ms (worst {iww:.2f})")
print()
def spread(length):
    # vm's own spread: its p99 over every slice of the idle window as long as an operation's
    # window (vm's background GC, set off by its own overwrites, lands in some slices and not
    # others); the highest of them, read and write
    ia, ib = idle[0][1], idle[0][2]
    r, w = [], []
    for s in range(ia, ib - length + 1, length):
        f = figures(s, s + length - 1)
        r.append(f[0]); w.append(f[2])
    return max(r, default=float("nan")), max(w, default=float("nan"))
print("| operation | wall (s) | read p99 (ms) | read worst (ms) | write p99 (ms) | write worst (ms) | idle p99 r/w (ms) | idle spread r/w (ms) | goal: worst <= 50 ms, p99 <= 2x idle | note |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
for name, a, b, status, note in rows:
    if name == "idle":
        continue
    # at least one second from the start: a short command's cost (the CLI starting, its
    # request, the daemon's work) shows in the requests around it, not only inside it
    r99, rw, w99, ww, n = figures(a, max(b, a + 1000))
    sr, sw = spread(max(b - a, 1000)) if name != "idle-after" else (float("nan"),) * 2
    why = []
    if not rw <= 50 or not ww <= 50:
        why.append(f"worst {max(rw, ww):.0f} ms")
    if not r99 <= 2 * ir99:
        why.append(f"read p99 {r99 / ir99:.1f}x")
    if not w99 <= 2 * iw99:
        why.append(f"write p99 {w99 / iw99:.1f}x")
    goal = "pass" if not why else "FAIL (" + ", ".join(why) + ")"
    if status != "ok":
        note = (note + " " if note else "") + f"(the command: {status})"
    if why and r99 <= max(sr, 2 * ir99) and w99 <= max(sw, 2 * iw99) and rw <= 50 and ww <= 50:
        goal += "; within vm's idle spread"
    print(f"| {name} | {(b - a) / 1000:.2f} | {r99:.2f} | {rw:.2f} | {w99:.2f} | {ww:.2f} | {ir99:.2f}/{iw99:.2f} | {sr:.2f}/{sw:.2f} | {goal} | {note} |")
EOF
    stall_holds
}

# The serve's slow-hold log (CONDENSE_SLOW_HOLD_MS, pool/mod.rs `slow_hold`): how many holds
# of the pool's state reached the limit, by the line that took the lock, and the longest.
stall_holds() {
    [ -n "$slow_hold" ] || return 0
    echo
    echo "state-lock holds >= $slow_hold ms (the serve's log), by where the lock was taken:"
    python3 - "$work/serve.log" <<'EOF'
import re, sys
holds = {}
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"state was held ([0-9.]+) ms by (\S+)", line)
    if m:
        holds.setdefault(m.group(2), []).append(float(m.group(1)))
for at, v in sorted(holds.items(), key=lambda kv: -max(kv[1])):
    v.sort()
    print(f"  {at:<45} {len(v):6} holds, p50 {v[len(v) // 2]:.2f} ms, p90 {v[len(v) * 9 // 10]:.2f} ms, longest {v[-1]:.1f} ms")
EOF
}
