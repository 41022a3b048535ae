#!/usr/bin/env bash
# End-to-end test of the cache tier with real clients (condense serve, nbdcopy, qemu-img):
#
#   attach a cache -> read a volume over NBD twice: misses, then hits (cache stats --json,
#   through the control socket) -> restart serve: still warm -> kill -9 serve: still warm ->
#   corrupt cache.dat with dd: reads still correct (qemu-img compare), corruption counted ->
#   stats --json carries the cache keys -> detach: reads still correct -> verify clean.
#
#   bash tests/cache/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/cache/run.sh
#
# Needs (Debian): qemu-utils libnbd-bin jq. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-img nbdcopy nbdinfo jq python3

W=$(mktemp -d /tmp/condense-cache-e2e.XXXXXX)
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

# read_all: copy the whole volume over NBD and compare it with the image.
read_all() {
    rm -f "$W/copy.raw"
    nbdcopy "$URI/vm" "$W/copy.raw" && cmp -s "$W/copy.raw" "$IMG"
}

# A 16 MiB image: random data, a compressible region, a duplicated region and a hole.
IMG=$W/disk.raw
python3 - "$IMG" <<'EOF'
import random, sys
r = random.Random(11)
with open(sys.argv[1], "wb") as f:
    f.truncate(16 << 20)
    for mib in range(16):
        if mib == 13:
            continue  # a hole
        f.seek(mib << 20)
        if mib % 3 == 0:
            f.write(bytes(r.getrandbits(8) for _ in range(1 << 20)))
        elif mib % 3 == 1:
            f.write(b"".join(b"line %08d of a compressible text block\n" % (mib * 100000 + i)
                             for i in range((1 << 20) // 42)).ljust(1 << 20, b"."))
        else:
            f.write(bytes(r.getrandbits(8) for _ in range(4096)) * 256)
EOF

"$CONDENSE" init "$POOL" >/dev/null || { echo "init failed"; exit 1; }
check "import the image" c import "$IMG" --name vm
check "attach a 64M writethrough cache" c cache attach "$FAST" --size 64M
refuse "a second cache is refused" "already has a cache attached" c cache attach "$W/other" --size 64M --mode writeback
check "cache.conf is in the pool" test -f "$POOL/cache.conf"

serve_vm
check "first pass reads the image" read_all
m1=$(stat cache_misses); h1=$(stat cache_hits)
check "first pass: misses, no hits ($m1 misses)" test "$m1" -gt 0 -a "$h1" -eq 0
check "first pass promoted chunks" test "$(stat cache_promotions)" -gt 0
check "second pass reads the image" read_all
h2=$(stat cache_hits); hb2=$(stat cache_hit_bytes); mb1=$(stat cache_miss_bytes)
check "second pass served from the cache ($h2 hits)" test "$h2" -gt 0 -a "$hb2" -ge $((mb1 * 9 / 10))
check "cache_used_bytes > 0, dirty 0" bash -c "c() { '$CONDENSE' --pool '$POOL' \"\$@\"; }; c cache stats --json | jq -e '.cache_used_bytes > 0 and .cache_dirty_bytes == 0 and .cache_mode == \"writethrough\"'"
c stats --json >"$W/stats.json"
check "stats --json has the cache keys" jq -e 'has("cache_hit_bytes") and has("cache_miss_bytes") and has("cache_used_bytes") and has("cache_dirty_bytes") and has("cache_promotions") and has("cache_hits") and has("cache_misses") and has("cache_demotions") and has("cache_size_bytes") and has("cache_mode") and has("cache_dir")' "$W/stats.json"

stop_server
h3=$(stat cache_hits)
check "counters survive a clean stop ($h3 hits)" test "$h3" -ge "$h2"
serve_vm
check "after restart: reads correct" read_all
hb4=$(stat cache_hit_bytes)
check "after restart: still warm" test $((hb4 - hb2)) -ge $((mb1 * 9 / 10))

sleep 1.5 # let the counters reach the index, as a running daemon does every second
kill9_server
serve_vm
hb5=$(stat cache_hit_bytes)
check "after kill -9: reads correct" read_all
hb6=$(stat cache_hit_bytes)
check "after kill -9: still warm" test $((hb6 - hb5)) -ge $((mb1 * 9 / 10))

stop_server
# Overwrite 1 MiB of slots (past the 4 KiB header) with random bytes.
dd if=/dev/urandom of="$FAST/cache.dat" bs=4096 seek=2 count=256 conv=notrunc status=none
serve_vm
check "corrupt cache: qemu-img compare against the image" qemu-img compare -f raw -F raw "$IMG" "$URI/vm"
check "corrupt cache: nbdcopy reads the image" read_all
corrupt=$(stat cache_corrupt_entries)
check "corrupt cache: entries detected and counted ($corrupt)" test "$corrupt" -gt 0

check "detach through the control socket" c cache detach
check "after detach: no cache.conf" test ! -f "$POOL/cache.conf"
check "after detach: reads correct" qemu-img compare -f raw -F raw "$IMG" "$URI/vm"
check "after detach: cache stats says no cache" bash -c "! '$CONDENSE' --pool '$POOL' cache stats 2>&1 | grep -v 'no cache attached' >/dev/null; '$CONDENSE' --pool '$POOL' cache stats 2>&1 | grep -q 'no cache attached'"
stop_server
check "verify clean" c verify

# A cache directory that disappeared: the pool serves without it.
check "re-attach" c cache attach "$FAST" --size 64M
rm -rf "$FAST"
serve_vm
check "lost cache directory: reads correct" read_all
stop_server
check "lost cache directory: verify clean" c verify
summary
