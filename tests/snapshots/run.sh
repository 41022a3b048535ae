#!/usr/bin/env bash
# End-to-end test of snapshots, clones, rollback and changed-block backup on a live pool,
# with real clients: every `condense` command here runs while `condense serve` holds the
# pool, so it goes through the control socket.
#
#   import an image -> snapshot -> overwrite part of it through NBD (qemu-io) ->
#   qemu-img compare VOL@SNAP against the original image: identical ->
#   nbdinfo --map=qemu:dirty-bitmap:SNAP lists exactly the overwritten extents ->
#   condense diff agrees -> a clone of the snapshot is writable and independent of both ->
#   rollback refused while an NBD client holds the volume, then restores the original ->
#   restart: everything still as it was -> snapshot delete + gc frees the space -> verify ->
#   a big volume deleted through the socket, the daemon killed -9 during its background
#   release: the restarted daemon finishes it, verify clean ->
#   a pool with the sparse dedup index (init --index sparse --index-memory 8M): the image
#   imported twice is deduplicated, stats --json says the mode and budget, index show|set;
#   the same on a pool in a file:// bucket, kept across a connect from a fresh directory ->
#   the merge pass: an image imported in order and shuffled into a pool with the smallest
#   sparse index, `index merge` killed -9 at ever later points (verify clean after each, the
#   next run resumes), then `index merge` through the control socket merges the rest and its GC
#   frees their space; the shuffled volume still reads as written over NBD, verify clean.
#
#   bash tests/snapshots/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/snapshots/run.sh
#
# Needs (Debian): qemu-utils libnbd-bin jq. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-img qemu-io nbdinfo jq

W=$(mktemp -d /tmp/condense-snap-e2e.XXXXXX)
POOL=$W/pool
free_port PORT
URI=nbd://127.0.0.1:$PORT
SERVER_PID=
HOLDER_PID=

cleanup() {
    exec 7>&- 2>/dev/null
    [ -n "$HOLDER_PID" ] && kill "$HOLDER_PID" 2>/dev/null
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

c() { "$CONDENSE" --pool "$POOL" "$@"; }


# A 32 MiB image: mixed data, a duplicated region and holes (a VM disk in miniature).
IMG=$W/disk.raw
python3 - "$IMG" <<'EOF'
import random, sys
r = random.Random(7)
with open(sys.argv[1], "wb") as f:
    f.truncate(32 << 20)
    for mib in range(32):
        if mib % 5 == 4:
            continue  # a hole
        f.seek(mib << 20)
        block = bytes(r.getrandbits(8) for _ in range(4096))
        f.write((block * 2 + bytes(range(256)) * 32) * 64 if mib % 3 else block * 256)
EOF
cp "$IMG" "$W/orig.raw"

"$CONDENSE" init "$POOL" >/dev/null || { echo "init failed"; exit 1; }
check "import the image" c import "$IMG" --name vm
serve_vm

check "snapshot create through the control socket" c snapshot create vm base
if grep -q "in use" "$W/out"; then fail "snapshot create went around the daemon"; fi

# Overwrite two extents through NBD: 256 KiB at 1 MiB, 4 KiB at 10 MiB + 8 KiB.
check "overwrite through NBD (qemu-io)" qemu-io -f raw "$URI/vm" \
    -c 'write -P 0x5a 1M 256k' -c 'write -P 0x33 10493952 4k' -c flush

check "qemu-img compare vm@base against the original image: identical" \
    qemu-img compare -f raw -F raw "$URI/vm@base" "$W/orig.raw"
if qemu-img compare -f raw -F raw "$URI/vm" "$W/orig.raw" >"$W/out" 2>&1; then
    fail "the live volume should differ from the original image"
else
    ok "the live volume differs from the original image"
fi
check "vm@base is read-only over NBD" sh -c "nbdinfo --json '$URI/vm@base' | jq -e '.exports[0].is_read_only == true'"
if qemu-io -f raw "$URI/vm@base" -c 'write -P 1 0 4k' >"$W/out" 2>&1; then
    fail "a write to vm@base over NBD was accepted"
else
    ok "a write to vm@base over NBD is refused"
fi

# The dirty bitmap: exactly the two overwritten extents.
nbdinfo --map=qemu:dirty-bitmap:base "$URI/vm" >"$W/map" 2>&1
awk '$3 == 1 { print $1, $2 }' "$W/map" >"$W/dirty"
printf '%s\n' "1048576 262144" "10493952 4096" >"$W/want"
if diff -q "$W/dirty" "$W/want" >/dev/null; then
    ok "nbdinfo --map=qemu:dirty-bitmap:base lists exactly the overwritten extents"
else
    cp "$W/map" "$W/out"; fail "dirty bitmap: got $(tr '\n' ';' <"$W/dirty") want $(tr '\n' ';' <"$W/want")"
fi
c diff vm@base vm --json >"$W/diff.json" 2>&1
jq -r '.extents[] | "\(.offset) \(.length)"' "$W/diff.json" >"$W/diffx" 2>/dev/null
if diff -q "$W/diffx" "$W/want" >/dev/null \
    && [ "$(jq -r .changed_bytes "$W/diff.json")" = $((262144 + 4096)) ]; then
    ok "condense diff agrees with the dirty bitmap"
else
    cp "$W/diff.json" "$W/out"; fail "condense diff disagrees"
fi

# A clone of the snapshot: writable, independent of both.
check "clone vm@base into c1" c volume clone vm@base c1
check "write to the clone through NBD" qemu-io -f raw "$URI/c1" -c 'write -P 0x77 0 64k' -c flush
check "vm@base unchanged by the clone's write" \
    qemu-img compare -f raw -F raw "$URI/vm@base" "$W/orig.raw"
qemu-io -f raw "$URI/vm" -c 'read -P 0x5a 1M 256k' >"$W/out" 2>&1 \
    && ! grep -q "Pattern verification failed" "$W/out" && ok "vm keeps its own writes" \
    || fail "vm lost its writes"
cp "$W/orig.raw" "$W/c1.want"
printf '\x77%.0s' $(seq 1 65536) | dd of="$W/c1.want" conv=notrunc status=none
check "c1 reads the snapshot plus its own write" \
    qemu-img compare -f raw -F raw "$URI/c1" "$W/c1.want"

# Rollback: refused while a client holds vm open read-write, then done.
mkfifo "$W/fifo"
qemu-io -f raw "$URI/vm" <"$W/fifo" >/dev/null 2>&1 &
HOLDER_PID=$!
exec 7>"$W/fifo"
sleep 0.5
if c volume rollback vm@base >"$W/out" 2>&1; then
    fail "rollback was accepted while an NBD client held the volume"
else
    grep -q "open for writing" "$W/out" && ok "rollback refused while exported read-write" \
        || fail "rollback refused for another reason"
fi
exec 7>&-
wait "$HOLDER_PID" 2>/dev/null; HOLDER_PID=
check "rollback vm@base once the client is gone" c volume rollback vm@base
check "after rollback vm is the original image" qemu-img compare -f raw -F raw "$URI/vm" "$W/orig.raw"

# A second snapshot, then a restart: everything is durable.
check "write after rollback" qemu-io -f raw "$URI/vm" -c 'write -P 0x11 2M 8k' -c flush
check "snapshot create vm later" c snapshot create vm later
stop_server
serve_vm
check "after restart vm@base is still the original image" \
    qemu-img compare -f raw -F raw "$URI/vm@base" "$W/orig.raw"
check "after restart c1 still reads its own content" \
    qemu-img compare -f raw -F raw "$URI/c1" "$W/c1.want"
c diff vm@base vm@later --json >"$W/diff2.json" 2>&1
if [ "$(jq -r .changed_bytes "$W/diff2.json")" = 8192 ]; then
    ok "diff between two snapshots: the 8 KiB written between them"
else
    cp "$W/diff2.json" "$W/out"; fail "diff between two snapshots"
fi

# Space: snapshot list says what deleting frees; delete + gc frees it.
c snapshot list --json >"$W/list.json" 2>&1
check "snapshot list --json names both snapshots" \
    jq -e '[.snapshots[].snapshot] == ["base", "later"]' "$W/list.json"
if c volume delete vm >"$W/out" 2>&1; then fail "deleting a volume with snapshots was accepted"
else ok "a volume with snapshots is not deleted"; fi
check "delete the clone" c volume delete c1
check "snapshot delete vm@base" c snapshot delete vm@base
check "snapshot delete vm@later" c snapshot delete vm@later
check "gc" c gc
c stats --json >"$W/stats.json"
check "stats: no snapshots left" jq -e '.snapshots == []' "$W/stats.json"
check "verify clean through the socket" c verify
check "vm still reads its content" bash -c "qemu-img convert -f raw -O raw '$URI/vm' '$W/vm.now' && cmp -s <(head -c 2097152 '$W/vm.now') <(head -c 2097152 '$W/orig.raw')"

# A deletion returns at once and its map is released in the background (issue 42): a sparse
# 16 GiB volume with a block every 2 MiB (8192 block-map leaves), deleted through the socket,
# the daemon killed -9 right after; the restarted daemon finishes the release, and the pool is
# whole.
python3 - "$W/sparse.raw" <<'EOF2'
import sys
with open(sys.argv[1], "wb") as f:
    f.truncate(16 << 30)
    for i in range(8192):
        f.seek(i << 21)
        f.write(i.to_bytes(8, "little") * 512)
EOF2
stop_server
check "import a sparse 16 GiB volume (8192 leaves)" c import "$W/sparse.raw" --name sparse
rm -f "$W/sparse.raw"
serve_vm
check "delete it through the socket" c volume delete sparse
cp "$W/out" "$W/delete.out"
check "the delete said the map is released in the background" grep -q "released in the background" "$W/delete.out"
c stats --json >"$W/stats.json" 2>&1
check "stats --json has the release figures" jq -e '(.releasing | type) == "array" and (.releasing_bytes | type) == "number"' "$W/stats.json"
check "the name is free at once" c volume create sparse --size 1G
kill9_server
serve_vm
released=
for _ in $(seq 1 300); do
    c stats --json >"$W/stats.json" 2>/dev/null && jq -e '.releasing == []' "$W/stats.json" >/dev/null && { released=1; break; }
    sleep 0.2
done
if [ -n "$released" ]; then ok "after kill -9 and a restart the release finished"; else
    cp "$W/stats.json" "$W/out"; fail "the release did not finish within 60 s of the restart"; fi
check "gc" c gc
check "verify clean after the release" c verify
check "vm still reads its content after the release" bash -c "qemu-img convert -f raw -O raw '$URI/vm' '$W/vm.now' && cmp -s <(head -c 2097152 '$W/vm.now') <(head -c 2097152 '$W/orig.raw')"

stop_server
check "verify clean with no daemon" c verify

# The sparse dedup index (issue 43): a pool made with it, the same image imported twice,
# `stats --json` says the mode and the budget, and the second import was deduplicated.
S=$W/sparse
s() { "$CONDENSE" --pool "$S" "$@"; }
check "init --index sparse --index-memory 8M" s init --index sparse --index-memory 8M
refuse "--index-memory without --index sparse is refused" "add --index sparse" \
    "$CONDENSE" --pool "$W/sparse2" init --index-memory 8M
check "import the image" s import "$W/orig.raw" --name one
check "import it again" s import "$W/orig.raw" --name two
s stats --json >"$W/sparse.json" 2>&1
check "stats --json: mode sparse, an 8 MiB budget, RAM within it" jq -e \
    '.dedup_index_mode == "sparse" and .dedup_index_budget_bytes == 8388608 and .dedup_index_bytes <= 8388608' "$W/sparse.json"
check "the second import was deduplicated (>= 49 % dedup saving over both)" jq -e \
    '.dedup_saving_percent >= 49' "$W/sparse.json"
check "index show says sparse" bash -c "'$CONDENSE' --pool '$S' index show | grep -q 'sparse, 8.00 MiB'"
check "index set dense" s index set dense
check "index show --json: dense from the next open" jq -e '.mode == "dense"' <(s index show --json)
check "verify clean (sparse pool)" s verify

# The same setting on a pool in an object store (a file:// bucket: the directory backend of
# the S3 code; tests/s3/pool.sh checks it on Garage): stored by init, kept in the bucket, so a
# connect from a fresh local directory has it and imports through it.
s3() { "$CONDENSE" --pool "$W/s3-$1" "${@:2}"; }
sparse_1m() { s3 "$1" stats --json | jq -e '.dedup_index_mode == "sparse" and .dedup_index_budget_bytes == 1048576' >/dev/null; }
check "init file://BUCKET --index sparse --index-memory 1M" \
    "$CONDENSE" init "file://$W/bucket" --cache "$W/s3-a" --cache-size 1G --index sparse --index-memory 1M
check "stats: sparse, 1 MiB" sparse_1m a
check "import the image into it" s3 a import "$W/orig.raw" --name one
rm -rf "$W/s3-a"
check "connect file://BUCKET from a fresh local directory" \
    "$CONDENSE" connect "file://$W/bucket" --cache "$W/s3-b" --cache-size 1G
check "stats after the connect: still sparse, 1 MiB" sparse_1m b
check "import the image again: it is deduplicated" s3 b import "$W/orig.raw" --name two
check "the second import was found by the sparse index (>= 49 % dedup saving over both)" \
    jq -e '.dedup_saving_percent >= 49 and .dedup_index_mode == "sparse"' <(s3 b stats --json)

# The merge pass (issue 43): 16,384 random blocks imported in order, then shuffled, into a pool
# whose sparse index (256 KiB) misses most of the shuffled copy; `index merge` through the
# control socket of the serving daemon finds every duplicate.
POOL=$W/merge
python3 - "$W/seq.raw" "$W/shuffled.raw" <<'EOF2'
import os, random, sys
blocks = [os.urandom(4096) for _ in range(16384)]
order = list(range(len(blocks)))
random.Random(3).shuffle(order)
open(sys.argv[1], "wb").write(b"".join(blocks))
open(sys.argv[2], "wb").write(b"".join(blocks[i] for i in order))
EOF2
check "init a pool with the smallest sparse index" c init --index sparse --index-memory 256K
check "import the image" c import "$W/seq.raw" --name vm
check "import it shuffled" c import "$W/shuffled.raw" --name shuffled
before=$(c stats --json | jq .unique_chunks)
expect_ge "a good part of the shuffled copy was stored again (unique chunks)" "$before" 20480
# kill -9 of the pass, on a copy of this pool, at ever later points (5 ms apart) until one run
# finishes: after each, verify is clean and what was merged and made durable stays merged (the
# pass flushes every second: a kill of a pass shorter than that may leave none of its forwards);
# each run resumes from there, and the one that finishes leaves one chunk per block. (Not
# `timeout -s KILL`: it kills its own process group, itself included, without waiting.)
cp -a "$POOL" "$W/merge-kill"
k() { "$CONDENSE" --pool "$W/merge-kill" "$@"; }
left=$before killed=0 landed=0 resumed_ok=1
for ms in $(seq 5 5 5000); do
    "$CONDENSE" --pool "$W/merge-kill" index merge --no-gc >/dev/null 2>&1 & # not k: a subshell
    pid=$!
    sleep "$(awk "BEGIN { printf \"%.3f\", $ms / 1000 }")"
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null && break
    killed=$((killed + 1))
    k verify >"$W/kv.out" 2>&1 || { resumed_ok=0; cat "$W/kv.out"; break; }
    now=$(k stats --json | jq .unique_chunks)
    [ "$now" -le "$left" ] || { resumed_ok=0; echo "unique chunks grew after a kill: $left -> $now"; break; }
    [ "$now" -lt "$left" ] && landed=$((landed + 1))
    left=$now
done
if [ "$resumed_ok" = 1 ] && [ "$killed" -gt 0 ]; then
    ok "index merge killed -9 $killed times ($landed after some of its forwards were durable): verify clean after each, nothing merged was lost"
else
    fail "index merge killed -9 $killed times: verify or the chunk count failed after a kill"
fi
check "the run after the kills merged the rest: 16,384 unique chunks" jq -e '.unique_chunks == 16384' <(k stats --json)
check "verify clean after it" k verify
rm -rf "$W/merge-kill"
serve_vm
check "index merge --json through the control socket" c index merge --json
cp "$W/out" "$W/merge.json"
check "every duplicate merged" jq -e ".merged == $before - 16384 and .chunks_sorted == $before" "$W/merge.json"
check "its GC freed their space (segments within 10 % of the unique data's share)" \
    jq -e ".gc.segment_bytes_after <= .gc.segment_bytes_before * 16384 / $before * 1.1" "$W/merge.json"
check "16,384 unique chunks left" jq -e '.unique_chunks == 16384' <(c stats --json)
check "the shuffled volume reads as written (qemu-img compare over NBD)" \
    qemu-img compare -f raw -F raw "$URI/shuffled" "$W/shuffled.raw"
check "vm too" qemu-img compare -f raw -F raw "$URI/vm" "$W/seq.raw"
check "verify clean after the merge (through the socket)" c verify
stop_server
check "verify clean after the merge, offline" c verify
summary
