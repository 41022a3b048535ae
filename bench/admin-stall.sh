#!/usr/bin/env bash
# What an administrator's command costs the other VMs of a served pool (issue 42). A pool holds
# volume `big` (N unique, highly compressible 4 KiB blocks: the metadata is what is big) and a
# 1 GiB volume `vm`; while fio does 4 KiB random reads and writes at queue depth 1 on `vm`
# (every request's latency logged), each operation below runs in turn on `big` through the
# daemon's control socket. Prints, per operation, its wall time and vm's read and write p99 and
# worst latency during it (at least the first second from its start), against the idle p99
# measured first, and whether issue 42's goal (worst <= 50 ms, p99 <= 2x idle) is met.
#
#   bench/admin-stall.sh [N] [WORK_DIR]          # default 10000000 blocks (40 GiB), /work/admin-stall
#   OPS="stats gc" bench/admin-stall.sh 1000000   # only these operations, in this order
#   CACHE=/work/stall-cache bench/admin-stall.sh 1000000   # with a writeback cache tier
#   S3=1 bench/admin-stall.sh 1000000             # the pool on S3 (Garage), `hosts sync` too
#
# Operations (default order; each needs what the earlier ones made): [hosts-sync on S3,]
# stats, snap-create, diff, clone (of the snapshot), grow, verify, rollback, snap-delete,
# shrink (to half, --force), delete-clone, delete (big), gc, then idle-after (the baseline again:
# vm's own drift over the run). The window of a deletion or
# rollback lasts until its map's background release is over (its note: the command's time).
# hosts-sync: a second host joined to the pool (S3 only) imports PEER_N unique blocks
# (default N / 2; not timed), then this host's `hosts sync` folds them in; the note column
# says how many chunks it folded. The serve's background sync (every 30 s) may fold them
# first: then the second host imports another volume and the command runs again (3 tries).
# Environment: CONDENSE (binary), GEN_UNIQUE (bench's gen-unique), IDLE (s of idle baseline,
# default 60: long enough to hold vm's own background GC, which its random overwrites set off
# every 30-50 s; a shorter window is vm's best case, bench/README.md sixth pass), GAP (s
# between operations, default 3), CACHE=DIR (a writeback cache tier on DIR, CACHE_SIZE of it,
# default 4G; the pool stays on WORK_DIR as its slow tier; DIR must be
# another, empty directory, removed at the end), S3=1 (bench/stall-lib.sh: Garage started in
# WORK_DIR/garage, S3_CACHE_SIZE). Needs fio (nbd engine), nbdinfo, python3. Disk: ~150 bytes
# per block of N (and as much again in Garage's data with S3=1). Prints figures; asserts nothing.
set -euo pipefail

n=${1:-10000000}
work=${2:-/work/admin-stall}
idle=${IDLE:-60}
gap=${GAP:-3}
[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1000 ] || { echo "admin-stall.sh: N must be a whole number of blocks, at least 1000" >&2; exit 1; }
default_ops="stats snap-create diff clone grow verify rollback snap-delete shrink delete-clone delete gc"
peer_n=${PEER_N:-$((n / 2))}
if [ "${S3:-}" = 1 ]; then
    default_ops="hosts-sync $default_ops"
    PEER=1
fi
ops=(${OPS:-$default_ops})
# shellcheck source=bench/stall-lib.sh
. "$(dirname "$0")/stall-lib.sh"
case " ${ops[*]} " in *" hosts-sync "*) [ "${S3:-}" = 1 ] || die "hosts-sync needs S3=1" ;; esac

echo "== building the pool ($kind): $n blocks in big ($((n * bs / 1024 / 1024 / 1024)) GiB logical), 1 GiB vm"
stall_make_pool
stall_import big "$n" 1
c volume create vm --size 1G >/dev/null
stall_serve
stall_fill_vm

echo "== fio: 4 KiB random reads and writes, qd1, on vm; operations on big"
stall_fio lat
sleep 2
stall_idle "$idle"

run_op() {
    case $1 in
        hosts-sync) c hosts sync --json ;;
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
# The chunks the serve's background sync folded so far (its log lines).
background_folds() {
    { grep -o 'hosts: folded [0-9]*' "$work/serve.log" || true; } | awk '{ n += $3 } END { print n + 0 }'
}
# Chunks `hosts sync --json` (in FILE) folded.
folded_in() {
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(p.get("chunks_folded", 0) for p in d.get("other_hosts", [])))' "$1" 2>/dev/null || echo 0
}
for op in "${ops[@]}"; do
    tries=1
    [ "$op" = hosts-sync ] && tries=3
    for try in $(seq 1 "$tries"); do
        if [ "$op" = hosts-sync ]; then
            # Each try a new volume of the second host: the serve's background sync (every
            # 30 s) may fold it before the command does; then it is tried again.
            echo "   the second host imports $peer_n blocks for hosts-sync to fold"
            stall_import "peer$try" "$peer_n" $((1 + try)) "$work/peer"
            bg=$(background_folds)
        else
            sleep "$gap"
        fi
        start=$(now_ms)
        status=ok
        if ! run_op "$op" >"$work/op-$op.log" 2>&1; then
            echo "   $op failed: $(tail -2 "$work/op-$op.log")"
            status=failed
        fi
        end=$(now_ms)
        note=
        case $op in rollback | snap-delete | delete-clone | delete)
            # The command returns once the map is detached; its window runs until the
            # background release is over (`stats --json` lists nothing releasing).
            for _ in $(seq 1 3000); do
                c stats --json 2>/dev/null | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin).get("releasing", []) == [] else 1)' && break
                sleep 0.2
            done
            note="command $(((end - start)))ms, then released in the background"
            end=$(now_ms) ;;
        esac
        if [ "$op" = hosts-sync ] && [ "$status" = ok ]; then
            folded=$(folded_in "$work/op-$op.log")
            note="folded $folded chunks"
            bg=$(($(background_folds) - bg))
            [ "$bg" -gt 0 ] && note="$note (the background sync folded $bg meanwhile)"
            if [ "$folded" -eq 0 ] && [ "$try" -lt "$tries" ]; then
                echo "   hosts-sync folded nothing ($note): again"
                continue
            fi
        fi
        stall_window "$op" "$start" "$end" "$status" "$note"
        break
    done
done
sleep "$gap"
# The baseline again, as a row of the table: vm's own drift over the run.
a=$(now_ms)
sleep "$idle"
stall_window idle-after "$a" "$(now_ms)" ok "nothing running: the baseline again"
stall_stop_fio
[ -n "${CACHE:-}" ] && { echo "   cache tier:"; c cache stats 2>&1 | sed 's/^/     /' | head -12; }
stall_table "big: $n blocks; pool: $kind; vm: 4 KiB random read/write qd1 (fio, nbd); $(date -u +%F) $(git -C "$here" rev-parse --short HEAD 2>/dev/null)"
