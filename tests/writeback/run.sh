#!/usr/bin/env bash
# End-to-end test of the writeback cache tier with real clients (condense serve, fio's nbd
# engine, nbdcopy, qemu-img):
#
#   init a pool with 4 MiB segments -> attach a writeback cache -> fio randwrite + verify over
#   NBD: segments and the journal land in the cache directory, sealed ones are destaged in the
#   background (cache stats --json) -> a second fio job with a flush every 16 writes, cut by
#   kill -9 of serve -> restart: the first job's data verifies, the volume reads whole ->
#   detach through the control socket destages everything (no pool file left in the cache
#   directory) -> verify clean, the pool opens without the cache -> a lost writeback cache:
#   opening is refused with what to do, `cache detach --force` opens without it,
#   `condense verify` names the chunks lost and `condense repair` reports the blocks lost.
#
#   bash tests/writeback/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/writeback/run.sh
#
# Needs (Debian): fio (nbd engine), libnbd-bin, qemu-utils, jq. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools fio nbdcopy nbdinfo qemu-img jq

W=$(mktemp -d /tmp/condense-writeback-e2e.XXXXXX)
POOL=$W/pool
FAST=$W/fast
free_port PORT
URI=nbd://127.0.0.1:$PORT
SERVER_PID=

cleanup() {
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

c() { "$CONDENSE" --pool "$POOL" "$@"; }
# stat KEY: one figure of `cache stats --json`.
stat() { c cache stats --json | jq -r ".$1"; }
fio_job() { # FILE EXTRA-LINES...: a fio job file for the nbd engine on volume vm
    local file=$1
    shift
    {
        echo "[global]"
        echo "ioengine=nbd"
        echo "uri=$URI/vm"
        echo "bs=4k"
        echo "direct=1"
        for l in "$@"; do echo "$l"; done
    } >"$file"
}
# Pool files (segments, journal) in the cache directory.
staged_files() { find "$FAST" -maxdepth 1 \( -name 'seg-*' -o -name 'journal-*' \) | wc -l; }

CONDENSE=$(realpath "$CONDENSE")
cd "$W" || exit 1 # fio leaves its verify state files in the working directory
"$CONDENSE" init "$POOL" --segment-size 4M >/dev/null || { echo "init failed"; exit 1; }
check "create a 128M volume" c volume create vm --size 128M
check "attach a 256M writeback cache" c cache attach "$FAST" --size 256M --mode writeback
check "cache stats: mode writeback" bash -c "'$CONDENSE' --pool '$POOL' cache stats --json | jq -e '.cache_mode == \"writeback\"'"
check "the journal moved to the cache directory" bash -c "ls '$FAST' | grep -q '^journal-' && ! ls '$POOL' | grep -q '^journal-'"

serve_vm
# Phase A: 48 MiB of random 4K writes, verified, ending with a flush.
fio_job "$W/a.fio" "rw=randwrite" "iodepth=16" "size=48M" "verify=crc32c" "verify_fatal=1" \
    "do_verify=1" "end_fsync=1" "[a]"
check "fio randwrite 48M + verify over NBD (writeback)" fio --output="$W/fioA.log" "$W/a.fio"
check "new segments are staged in the cache directory" test "$(find "$FAST" -name 'seg-*' | wc -l)" -gt 0
# Sealed segments are destaged in the background.
for _ in $(seq 1 100); do [ "$(stat cache_destaged_segments)" -gt 0 ] && break; sleep 0.2; done
destaged=$(stat cache_destaged_segments)
check "sealed segments destaged in the background ($destaged)" test "$destaged" -gt 0
check "destaged segments are in the pool directory" test "$(find "$POOL" -name 'seg-*.dat' | wc -l)" -gt 0

# Phase B: writes to [64M,112M) with a flush every 16, cut off by kill -9.
fio_job "$W/b.fio" "rw=randwrite" "iodepth=16" "offset=64M" "size=48M" "fsync=16" \
    "time_based=1" "runtime=60" "[b]"
fio --output="$W/fioB.log" "$W/b.fio" >/dev/null 2>&1 &
fio_pid=$!
sleep 3
dirty=$(stat cache_dirty_bytes)
kill9_server
wait "$fio_pid" 2>/dev/null
check "dirty bytes in the cache when serve was killed ($dirty)" test "$dirty" -gt 0
check "pool files in the cache directory after kill -9 ($(staged_files))" test "$(staged_files)" -gt 0

serve_vm
fio_job "$W/v.fio" "rw=randwrite" "iodepth=16" "size=48M" "verify=crc32c" "verify_fatal=1" \
    "verify_only=1" "[a]"
check "after kill -9 + restart, flushed data verifies" fio --output="$W/fioV.log" "$W/v.fio"
check "after kill -9 + restart, the whole volume reads without error" nbdcopy "$URI/vm" null:
b_data=$(nbdinfo --map "$URI/vm" | awk '$3 == 0 && $1 >= 67108864 {s += $2} END {print s + 0}')
check "the interrupted job's flushed writes survive ($b_data bytes)" test "$b_data" -gt 0
nbdcopy "$URI/vm" "$W/before-detach.raw"

check "detach through the control socket (destages what is dirty)" c cache detach
check "after detach: no pool file in the cache directory" test "$(staged_files)" -eq 0
check "after detach: no cache.conf" test ! -f "$POOL/cache.conf"
check "after detach: the journal is back in the pool directory" bash -c "ls '$POOL' | grep -q '^journal-'"
check "after detach: flushed data verifies" fio --output="$W/fioV2.log" "$W/v.fio"
check "after detach: the volume reads as before" bash -c "nbdcopy '$URI/vm' '$W/after-detach.raw' && cmp -s '$W/before-detach.raw' '$W/after-detach.raw'"
stop_server
check "verify clean" c verify
rm -rf "$FAST"
check "the pool opens without the cache directory" c export vm "$W/export.raw"
check "export equals what NBD read" cmp -s "$W/export.raw" "$W/before-detach.raw"

# A lost writeback cache device.
check "re-attach writeback" c cache attach "$FAST" --size 64M --mode writeback
head -c 4M /dev/urandom >"$W/unique.raw"
check "import into the writeback cache" c import "$W/unique.raw" --name lost
rm -rf "$FAST"
refuse "lost cache: opening is refused" "cache directory .* is missing" c volume list
refuse "lost cache: detach without --force is refused" "detach --force" c cache detach
check "lost cache: detach --force opens the pool without it" c cache detach --force
refuse "lost cache: verify names the chunks lost" "segment [0-9]* is missing" c verify
c repair >"$W/repair.out" 2>&1
check "lost cache: repair reports the lost volume's blocks" grep -q '"lost" blocks [0-9]*-[0-9]* .*segment [0-9]*, which is missing' "$W/repair.out"
check "lost cache: verify clean after repair" c verify
# Lost blocks fail to read (an I/O error, never zeros taken for data); export
# --lost-as-zeros copies the rest: each block reads its data (destaged before the loss) or
# zeros (reported lost).
refuse "lost cache: reading the lost blocks fails, naming one" "was lost" c export lost "$W/lost.raw"
check "lost cache: export --lost-as-zeros reads the rest" c export lost "$W/lost.raw" --lost-as-zeros
check "lost cache: lost blocks are zeros, the rest intact" python3 -c '
import sys
got, want = (open(f, "rb").read() for f in sys.argv[1:3])
blocks = [(got[i:i + 4096], want[i:i + 4096]) for i in range(0, len(want), 4096)]
bad = [i for i, (g, w) in enumerate(blocks) if g != w and g != bytes(4096)]
zeros = sum(g != w for g, w in blocks)
print(zeros, "blocks zero,", len(bad), "wrong")
sys.exit(1 if bad or zeros == 0 else 0)
' "$W/lost.raw" "$W/unique.raw"
check "lost cache: the other volume still verifies whole" bash -c "'$CONDENSE' --pool '$POOL' export vm '$W/export2.raw' && cmp -s '$W/export2.raw' '$W/before-detach.raw'"
summary
