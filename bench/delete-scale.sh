#!/usr/bin/env bash
# A 1 TB-class delete (issue 42): a served pool holds volume `big` (N unique, highly
# compressible 4 KiB blocks, built as bench/scale.sh builds its volumes: the metadata is what is
# big) and a 1 GiB volume `vm` under fio 4 KiB random reads and writes at queue depth 1 (every
# request's latency logged). `volume delete big` runs through the daemon's control socket;
# then the space figures (`condense stats --json` through the socket, every POLL s) are watched
# until they stop changing. Prints the delete command's wall time, vm's read and write p99 and
# worst latency during it and in the minutes after (bench/stall-lib.sh's table, goal worst <=
# 50 ms and p99 <= 2x idle), the space figures over time and when they stopped shrinking.
# With KILL_AT=SECONDS the daemon is killed with kill -9 that long after the delete started,
# served again (its open timed), fio restarted, and the release watched going on; at the end
# the daemon is stopped and `condense verify` runs on the pool.
#
#   bench/delete-scale.sh [N] [WORK_DIR]       # default 100000000 blocks (~410 GB logical), /work/delete-scale
#   KILL_AT=5 bench/delete-scale.sh 10000000   # kill -9 the daemon 5 s after the delete started
#
# Environment: CONDENSE, GEN_UNIQUE (binaries), IDLE (s of idle baseline, default 10), POLL
# (s between two reads of the figures, default 2), STABLE (s without a change after which the
# release counts as finished, default 60: longer than the serve's background GC period, 30 s),
# WATCH (s to watch at most, default 900), KILL_AT, and CACHE / S3 as bench/stall-lib.sh says.
# Disk: ~150 bytes per block of N (checked first: 100M blocks need ~15 GB). Needs fio (nbd
# engine), nbdinfo, python3. Prints figures; asserts nothing.
set -euo pipefail

n=${1:-100000000}
work=${2:-/work/delete-scale}
idle=${IDLE:-10}
poll=${POLL:-2}
stable=${STABLE:-60}
watch=${WATCH:-900}
kill_at=${KILL_AT:-}
for v in "$n" "$idle" "$poll" "$stable" "$watch" ${kill_at:+"$kill_at"}; do
    [[ $v =~ ^[0-9]+$ ]] || { echo "delete-scale.sh: N, IDLE, POLL, STABLE, WATCH and KILL_AT are whole numbers (got '$v')" >&2; exit 1; }
done
[ "$n" -ge 1000 ] || { echo "delete-scale.sh: N must be at least 1000 blocks" >&2; exit 1; }
mkdir -p "$(dirname "$work")"
avail=$(df --output=avail -B1 "$(dirname "$work")" | tail -1 | tr -d ' ')
need=$((n * 150 + (2 << 30)))
[ "$avail" -ge "$need" ] || { echo "delete-scale.sh: not enough disk for N=$n: $((avail >> 20)) MiB free, about $((need >> 20)) MiB needed (150 bytes per block + 2 GiB)" >&2; exit 1; }
# shellcheck source=bench/stall-lib.sh
. "$(dirname "$0")/stall-lib.sh"

echo "== building the pool ($kind): $n blocks in big ($((n * bs / 1000000000)) GB logical), 1 GiB vm"
stall_make_pool
t_build=$SECONDS
stall_import big "$n" 1
build_s=$((SECONDS - t_build))
c volume create vm --size 1G >/dev/null
echo "   pool on disk: $(du -sh "$pool" | cut -f1)"
stall_serve
stall_fill_vm
echo "== fio: 4 KiB random reads and writes, qd1, on vm"
stall_fio lat
sleep 2
stall_idle "$idle"

space=$work/space.tsv
# One reading of the space figures: seconds since the delete started, then the figures.
# The time is when `stats` answered: it waits for the state lock, so a reading started during
# a long hold describes the pool as of its end.
read_space() {
    local t j
    j=$(c stats --json 2>/dev/null) || { echo "$(($(now_ms) - t_del)) stats-failed" >>"$space"; return 0; }
    t=$(($(now_ms) - t_del))
    python3 -c '
import json, sys
d = json.loads(sys.argv[2])
# What the delete releases (the release is over when these stop changing), then the disk'"'"'s
# figures, which vm'"'"'s writes and the background GC keep moving.
d["releasing_blocks"] = sum(r.get("blocks_left", 0) for r in d.get("releasing", []))
keys = ["stored_bytes", "unique_chunks", "releasing_blocks", "releasing_bytes"]
disk = ["physical_bytes", "dead_bytes", "segments"]
print(sys.argv[1], " ".join(f"{k}={d.get(k)}" for k in keys), ";",
      " ".join(f"{k}={d.get(k)}" for k in disk))' "$t" "$j" >>"$space"
}

echo "== volume delete big (through the control socket), then the space figures every $poll s"
t_del=$(now_ms)
read_space
( c volume delete big >"$work/delete.log" 2>&1; echo "$? $(now_ms)" >"$work/delete.done" ) &
del_job=$!
seg_start=$t_del # start of the current run of windows after the delete
killed=
restart_ms=
last=
last_change=0
# Windows after the delete: +0-10 s, +10-30, +30-60, then a minute each.
bucket_edges=(10 30 60)
for ((e = 120; e <= watch + 60; e += 60)); do bucket_edges+=("$e"); done
windows_between() { # from to (ms): the after-delete windows inside [from, to)
    local from=$1 to=$2 a=0 e s b
    for e in "${bucket_edges[@]}"; do
        s=$((t_del + a * 1000)) b=$((t_del + e * 1000))
        a=$e
        [ "$b" -le "$from" ] && continue
        [ "$s" -ge "$to" ] && break
        [ "$s" -lt "$from" ] && s=$from
        [ "$b" -gt "$to" ] && b=$to
        [ $((b - s)) -ge 1000 ] && stall_window "after+$(((s - t_del) / 1000))-$(((b - t_del) / 1000))s" "$s" "$b" ok
    done
    return 0
}
while :; do
    sleep "$poll"
    el=$(($(now_ms) - t_del))
    if [ -n "$kill_at" ] && [ -z "$killed" ] && [ "$el" -ge $((kill_at * 1000)) ]; then
        k=$(now_ms)
        kill -9 "$server"
        wait "$server" 2>/dev/null || true
        windows_between "$seg_start" "$k"
        stall_stop_fio
        echo "   kill -9 of the daemon at +$(((k - t_del) / 1000)) s"
        echo "$(((k - t_del))) killed" >>"$space"
        stall_serve
        restart_ms=$(now_ms)
        echo "   served again after $(((restart_ms - k))) ms (open, journal replay, recovery)"
        echo "$((restart_ms - t_del)) served-again" >>"$space"
        stall_fio lat_r
        killed=$k
        seg_start=$restart_ms
        continue
    fi
    read_space
    read -r t_read cur <<<"$(tail -1 "$space" | cut -d';' -f1)"
    if [ "$cur" != "$last" ]; then
        last=$cur
        last_change=$t_read
    fi
    el=$(($(now_ms) - t_del))
    [ -s "$work/delete.done" ] && [ $((el - last_change)) -ge $((stable * 1000)) ] && break
    [ "$el" -ge $((watch * 1000)) ] && { echo "   still changing after WATCH=$watch s"; break; }
done
end=$(now_ms)
wait "$del_job" 2>/dev/null || true
read -r del_rc del_end <"$work/delete.done"
del_status=ok
[ "$del_rc" = 0 ] || del_status="failed (exit $del_rc): $(tail -1 "$work/delete.log")"
stall_window delete "$t_del" "$del_end" "$(echo "$del_status" | tr ' ' '_')"
windows_between "$seg_start" "$end"
stall_stop_fio
echo "== stopping the daemon, then condense verify"
kill "$server"
wait "$server" 2>/dev/null || true
server=
t0=$(now_ms)
if c verify >"$work/verify.log" 2>&1; then verify=clean; else verify="NOT clean (exit $?)"; fi
verify_s=$(( $(now_ms) - t0 ))

stall_table "delete of big ($n blocks); pool: $kind; vm: 4 KiB random read/write qd1 (fio, nbd); $(date -u +%F) $(git -C "$here" rev-parse --short HEAD 2>/dev/null)"
python3 - "$space" "$last_change" "${killed:+$((killed - t_del))}" <<'EOF'
import sys
path, last_change, killed = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print()
print("space figures (condense stats --json through the control socket) each time what the")
print("delete releases changed (and the disk's figures then; vm's writes and the GC move those):")
print("| s after the delete | released figures | disk |")
print("|---:|---|---|")
prev = None
rows = []
for l in open(path):
    t, _, figs = l.strip().partition(" ")
    key, _, disk = figs.partition(";")
    rows.append((int(t), key.strip(), disk.strip()))
for i, (t, key, disk) in enumerate(rows):
    if key != prev or i == len(rows) - 1:
        print(f"| {t / 1000:.1f} | {key} | {disk} |")
    prev = key
phys = [(int(d.split("physical_bytes=")[1].split()[0]), t) for t, _, d in rows if "physical_bytes=" in d]
if phys:
    lo = min(phys)
    print(f"physical bytes: {phys[0][0]} at the delete, lowest {lo[0]} at +{lo[1] / 1000:.1f} s, {phys[-1][0]} at the end")
print()
print(f"what the delete releases last changed at +{last_change / 1000:.1f} s after the delete started")
if killed:
    after = [key for t, key, _ in rows if t > int(killed) and "=" in key]
    changes = sum(1 for a, b in zip(after, after[1:]) if a != b)
    print(f"after the kill -9 at +{int(killed) / 1000:.1f} s: it changed {changes} times more")
EOF
echo
echo "build of big: $build_s s ($((n / (build_s > 0 ? build_s : 1))) blocks/s)"
echo "delete command: $(((del_end - t_del))) ms, $del_status"
echo "condense verify after the run: $verify ($verify_s ms)"
sed 's/^/  /' "$work/verify.log" | tail -5
