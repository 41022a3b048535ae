#!/usr/bin/env bash
# What an administrator's command costs the other VMs of a served pool (issue 42). A pool holds
# volume `big` (N unique, highly compressible 4 KiB blocks: the metadata is what is big) and a
# 1 GiB volume `vm`; while fio does 4 KiB random reads and writes at queue depth 1 on `vm`
# (every request's latency logged), each operation below runs in turn on `big` through the
# daemon's control socket. Prints, per operation, its wall time and vm's p99 and worst latency
# during it (at least the first second from its start), against the idle p99 measured first.
#
#   bench/admin-stall.sh [N] [WORK_DIR]          # default 10000000 blocks (40 GiB), /work/admin-stall
#   OPS="stats gc" bench/admin-stall.sh 1000000   # only these operations, in this order
#
# Operations (default order; each needs what the earlier ones made): stats, snap-create,
# diff, clone (of the snapshot), grow, verify, rollback, snap-delete, shrink (to half,
# --force), delete-clone, delete (big), gc.
# Environment: CONDENSE (binary), GEN_UNIQUE (bench's gen-unique), IDLE (s of idle baseline,
# default 10), GAP (s between operations, default 3), CACHE=DIR (attach a writeback cache tier
# on DIR first, CACHE_SIZE of it (default 4G); the pool then lives on WORK_DIR as its slow tier). Needs fio (nbd engine),
# nbdinfo, python3. Disk: ~150 bytes per block of N. Prints figures; asserts nothing.
set -euo pipefail

n=${1:-10000000}
work=${2:-/work/admin-stall}
here=$(cd "$(dirname "$0")/.." && pwd)
condense=${CONDENSE:-$here/target/release/condense}
gen=${GEN_UNIQUE:-$here/target/release/gen-unique}
idle=${IDLE:-10}
gap=${GAP:-3}
ops=(${OPS:-stats snap-create diff clone grow verify rollback snap-delete shrink delete-clone delete gc})
bs=4096
die() { echo "admin-stall.sh: $*" >&2; exit 1; }
[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1000 ] || die "N must be a whole number of blocks, at least 1000"
for t in fio nbdinfo python3; do command -v "$t" >/dev/null || die "needs $t"; done
[ -x "$condense" ] || (cd "$here" && cargo build --release -p condense)
[ -x "$gen" ] || (cd "$here" && cargo build --release -p condense-bench --bin gen-unique)

rm -rf "$work"
mkdir -p "$work"
pool=$work/pool
server=
fio_pid=
cleanup() {
    [ -n "$fio_pid" ] && kill "$fio_pid" 2>/dev/null
    [ -n "$server" ] && kill "$server" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
c() { "$condense" --pool "$pool" "$@"; }

echo "== building the pool: $n blocks in big ($((n * bs / 1024 / 1024 / 1024)) GiB logical), 1 GiB vm"
c init >/dev/null
if [ -n "${CACHE:-}" ]; then
    c cache attach "$CACHE" --mode writeback --size "${CACHE_SIZE:-4G}" >/dev/null
fi
t0=$SECONDS
"$gen" --blocks "$n" --seed 1 2>/dev/null | c import - --name big --size $((n * bs)) >/dev/null
echo "   imported in $((SECONDS - t0)) s"
c volume create vm --size 1G >/dev/null
sock=$work/nbd.sock
CONDENSE_LOG=info "$condense" --pool "$pool" serve --socket "$sock" >"$work/serve.log" 2>&1 &
server=$!
uri="nbd+unix:///vm?socket=$sock"
for _ in $(seq 1 600); do nbdinfo --size "$uri" >/dev/null 2>&1 && break; sleep 0.1; done
fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=4 --size=1G \
    --refill_buffers=1 --output=/dev/null
# The per-volume figures are counted once after the open: let that finish first.
for _ in $(seq 1 600); do grep -q "attribution counted" "$work/serve.log" && break; sleep 0.1; done

echo "== fio: 4 KiB random reads and writes, qd1, on vm; operations on big"
fio --name=vm --ioengine=nbd --uri="$uri" --rw=randrw --rwmixread=50 --bs=4k --iodepth=1 \
    --size=1G --time_based --runtime=36000 --refill_buffers=1 --randrepeat=0 \
    --write_lat_log="$work/lat" --log_avg_msec=0 --log_unix_epoch=1 \
    --output="$work/fio.txt" >/dev/null 2>&1 &
fio_pid=$!
now_ms() { echo $(($(date +%s%N) / 1000000)); }
windows=$work/windows
sleep 2
echo "idle $(now_ms)" >"$windows"
sleep "$idle"
echo "end $(now_ms)" >>"$windows"

run_op() {
    case $1 in
        stats) c stats ;;
        snap-create) c snapshot create big s1 ;;
        diff) c diff big@s1 big ;;
        clone) c volume clone big@s1 big-clone ;;
        grow) c volume resize big $((n * bs * 2)) ;;
        verify) c verify ;;
        rollback) c volume rollback big@s1 ;;
        snap-delete) c snapshot delete big@s1 ;;
        shrink) c volume resize big $((n * bs / 2)) --force ;;
        delete-clone) c volume delete big-clone ;;
        delete) c volume delete big ;;
        gc) c gc ;;
        *) die "unknown operation $1" ;;
    esac
}
for op in "${ops[@]}"; do
    sleep "$gap"
    start=$(now_ms)
    status=ok
    if ! run_op "$op" >"$work/op-$op.log" 2>&1; then
        echo "   $op failed: $(tail -2 "$work/op-$op.log")"
        status=failed
    fi
    echo "$op $start $(now_ms) $status" >>"$windows"
done
sleep "$gap"
kill -INT "$fio_pid"
wait "$fio_pid" 2>/dev/null || true
fio_pid=

python3 - "$work" "$n" <<'EOF'
import glob, sys
work, n = sys.argv[1], int(sys.argv[2])
# fio's completion-latency log: time of completion (ms since the epoch), latency (ns), ...
lat = []
for path in glob.glob(f"{work}/lat_clat*.log"):
    for line in open(path):
        f = line.split(",")
        if len(f) >= 2:
            lat.append((int(f[0]), int(f[1]) / 1e6))
lat.sort()
rows = []
idle = None
for line in open(f"{work}/windows"):
    parts = line.split()
    if parts[0] == "idle":
        idle_start = int(parts[1]); continue
    if parts[0] == "end":
        idle = (idle_start, int(parts[1])); continue
    rows.append((parts[0], int(parts[1]), int(parts[2]), parts[3]))
def during(a, b):
    # every request that completed during the window, or was in flight at its end
    return sorted(ms for t, ms in lat if a <= t <= b or (t > b and t - ms <= b))
def pct(v, p):
    return v[min(len(v) - 1, int(len(v) * p))] if v else float("nan")
iv = during(*idle)
idle_p99 = pct(iv, 0.99)
print()
print(f"big: {n} blocks; vm: 4 KiB random read/write qd1; idle: {len(iv)} requests, "
      f"p99 {idle_p99:.2f} ms, worst {max(iv) if iv else float('nan'):.2f} ms")
print(f"| operation | wall (s) | vm p99 (ms) | vm worst (ms) | p99 / idle | goal (worst <= 50 ms, p99 <= 2x idle) |")
print("|---|---:|---:|---:|---:|---|")
for op, a, b, status in rows:
    # at least one second from the start: a short command's cost (the CLI starting, its
    # request, the daemon's work) shows in the requests around it, not only inside it
    v = during(a, max(b, a + 1000))
    p99, worst = pct(v, 0.99), (max(v) if v else float("nan"))
    met = worst <= 50 and p99 <= 2 * idle_p99
    print(f"| {op} | {(b - a) / 1000:.2f} | {p99:.2f} | {worst:.2f} | {p99 / idle_p99:.1f}x | {'met' if met else 'MISSED'}{'' if status == 'ok' else ' (the command failed)'} |")
EOF
