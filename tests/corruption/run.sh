#!/usr/bin/env bash
# A disk that rots: random bit flips and zeroed 4 KiB sectors in every kind of file of a pool,
# of its cache tier and of an S3 pool's local directory, seeded, round after round, through
# the CLI (issue "a flipped bit never loses the pool").
#
# Three pools, built once under $W/base (rounds copy them; the base is never opened by a round,
# and is checked unchanged at the end):
#   - local: a volume imported from an image (unique, duplicate, compressible and zero blocks),
#     a snapshot of it, a clone of the snapshot, a file copied into files/ of a FUSE mount,
#     then flushed NBD writes from qemu-io to the volume and the clone and a kill -9 of the
#     server, so the journal holds batches after the last checkpoint;
#   - cached: a copy of that pool with a writethrough cache tier attached (the default mode)
#     in its own directory, warmed by reading the volumes over NBD twice (a clean stop, then a
#     kill -9: the index is a compact log plus appended records);
#   - s3: a pool on a file:// bucket (init file://... --cache DIR) with the same image, a
#     snapshot, a clone, flushed NBD writes (patterns and random data: a staged segment) and
#     reads (a warm cache), then a kill -9: its local directory holds the journal's batches
#     and a staged segment not yet uploaded.
# Every volume and snapshot of each is exported once from an undamaged copy as the reference;
# for the S3 pool a second reference, the pool as of its last upload: a copy of its bucket
# connected (`condense connect file://COPY --cache NEW_DIR`) into a fresh directory, every
# volume and snapshot there exported (the writes since that upload are not in it).
#
# Each round (tests/corruption/rounds.py) copies one pool (with its cache directory, or its
# bucket; absolute paths in cache.conf, remote.conf and status.json are rewritten to name the
# copy, and no file of the copy may name the base), damages one file, then:
#   - no command panics or hangs (each has a time limit);
#   - `verify` exits 0 (clean), 3 (damage, named) or 1 (the pool does not open, said why);
#   - every `export` that succeeds is byte-identical to the reference: never wrong data
#     without an error;
#   - where verify was not clean, `repair` succeeds and `verify` is then clean (a pool on S3:
#     see below);
#   - after repair every block of every volume reads as the reference, except inside the
#     ranges the repair report says were lost (for damaged journal batches the report names
#     the batches, and their blocks only as far as they decode without their checksum:
#     differences are then accepted anywhere, the loss having been said);
# and by kind of file:
#   - local pool: the superblock or its copy, the root or its copy, the journal, meta.dat, a
#     segment; damage to one copy of the superblock or of the root loses nothing, and open
#     says which copy it used;
#   - cache tier (cache.dat, cache.idx of the cached pool): a writethrough cache holds nothing
#     the pool lacks. First (before any other open rewrites the index) `serve` must open the
#     pool, every volume read over NBD through the cache (qemu-img convert; `export` does not
#     read through a local pool's cache tier) must be the reference, and serve must stop
#     cleanly; then verify must be clean (0), every export must succeed, nothing is lost. The
#     tally counts the cache hits and the damaged entries the engine detected (`cache stats`);
#   - S3 local directory (pool/meta.dat, the metadata mirror; pool/meta.synced; the cache
#     tier's cache.dat and cache.idx; the journal; a staged segment): the exports of an S3
#     pool read through its cache tier. The bucket holds a good copy of the metadata mirror,
#     meta.synced and the cache: damage to them loses nothing (verify clean at once, or after
#     the open mends the file from the bucket; every export the reference). The journal and
#     the staged segment exist only locally (durability local): where verify is not clean,
#     `repair` (not built for a pool on S3) must fail, exit 1, saying "repair of a pool on S3
#     is not built yet" and naming `condense connect`; then the fallback it names is run,
#     connecting the round's copy of the bucket into a new local directory: `verify` there must
#     be clean, and it must hold the volumes and snapshots of the as-of-upload reference, each
#     exporting exactly as that. The tally says how many blocks then differ from the live pool
#     (the writes since the last upload). The base's bucket is never connected to: only copies,
#     which hold the lease object a connect takes over.
#
#   bash tests/corruption/run.sh                 # ROUNDS=100 SEED=1: the 17 kinds in turn
#   ROUNDS=300 SEED=7 bash tests/corruption/run.sh
#   KEEP_GOING=1 bash tests/corruption/run.sh    # every round; the broken ones listed at the end
#   KEEP=1 bash tests/corruption/run.sh          # a failed run keeps W; one round again with
#   python3 tests/corruption/rounds.py "$CONDENSE" W/base W/rounds 1 SEED ROUND
#
# Needs (Debian): qemu-utils (qemu-io, qemu-img), python3, fuse3 (files/; skipped without
# /dev/fuse outside CI). A damaged last journal batch is not part of the rounds: it cannot be
# told from a write torn by a crash, which open drops (docs/REPAIR.md).

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-io qemu-img python3

W=$(mktemp -d /tmp/condense-corruption.XXXXXX)
BASE=$W/base
POOL=$BASE/pool
mkdir -p "$BASE"
SOCK=$W/nbd.sock
SERVER_PID=
MOUNT_PID=
cleanup() {
    stop_pids "$SERVER_PID" "$MOUNT_PID"
    fusermount3 -u "$W/mnt" 2>/dev/null
    remove_work_dir
}
trap cleanup EXIT
c() { "$CONDENSE" --pool "$POOL" "$@"; }
echo "condense: $CONDENSE; work dir $W"

check "init" c init --write-policy async
# A 24 MiB image: unique random blocks, duplicates of them, compressible text, zero runs.
python3 - "$W/img.raw" <<'EOF'
import random, sys
rng = random.Random(11)
blocks = []
for i in range(6144):
    k = i % 16
    if k < 6:
        blocks.append(rng.randbytes(4096))
    elif k < 9 and blocks:
        blocks.append(blocks[rng.randrange(len(blocks))])
    elif k < 13:
        blocks.append((f"line {i} of a log file, level {k}\n" * 200).encode()[:4096])
    else:
        blocks.append(bytes(4096))
open(sys.argv[1], "wb").write(b"".join(blocks))
EOF
check "import a 24 MiB image as vm" c import --format raw --name vm "$W/img.raw"
check "snapshot vm@s1" c snapshot create vm s1
check "clone vm@s1 as vm2" c volume clone vm@s1 vm2

# files/: a file copied in through the FUSE mount (a hidden volume .file.N).
if [ -e /dev/fuse ] && [ "$(id -u)" = 0 ] && command -v fusermount3 >/dev/null; then
    mkdir -p "$W/mnt"
    "$CONDENSE" --pool "$POOL" mount "$W/mnt" >"$W/mount.log" 2>&1 &
    MOUNT_PID=$!
    if wait_ready "$MOUNT_PID" "$W/mount.log" test -d "$W/mnt/files"; then
        head -c 3145728 "$W/img.raw" >"$W/file.bin"
        check "cp a file into files/ of the mount" cp "$W/file.bin" "$W/mnt/files/file.bin"
        sync "$W/mnt/files/file.bin"
    else
        fail "condense mount" "$W/mount.log"
    fi
    stop_pids "$MOUNT_PID"
    MOUNT_PID=
else
    skip "files/ in the pool" "needs root, /dev/fuse and fusermount3"
fi

# Flushed writes after the last checkpoint, then a crash: the journal holds them.
"$CONDENSE" --pool "$POOL" serve --socket "$SOCK" >"$W/serve.log" 2>&1 &
SERVER_PID=$!
wait_ready "$SERVER_PID" "$W/serve.log" test -S "$POOL/control.sock" || exit 1
for i in 1 2 3 4; do
    check "qemu-io: flushed writes $i to vm and vm2" \
        qemu-io -f raw -c "write -P 0x$((i + 40)) $((i * 3))M 512K" -c flush \
        "nbd+unix:///vm?socket=$SOCK"
    qemu-io -f raw -c "write -P 0x$((i + 50)) $((i * 2))M 256K" -c flush \
        "nbd+unix:///vm2?socket=$SOCK" >/dev/null 2>&1
done
kill9_server
rm -f "$POOL/control.sock" # the dead server's socket: not part of the pool's files
journal=$(ls "$POOL"/journal-*.wal 2>/dev/null | head -1)
size=$(stat -c %s "$journal" 2>/dev/null || echo 0)
if [ "$size" -gt 64 ]; then ok "kill -9 left the journal with batches ($size bytes)"; else fail "journal holds batches ($size bytes)"; fi

# --- The cached pool: a copy of the local pool with a writethrough cache tier, warmed ---
CACHED=$BASE/cached
cp -a "$POOL" "$CACHED"
check "cached: cache attach (writethrough, 64M) to a copy of the pool" \
    "$CONDENSE" --pool "$CACHED" cache attach "$BASE/cached.cache" --size 64M
# Two passes of reads over NBD: a clean stop after the first (the index rewritten compactly),
# a kill -9 after the second (hits; records appended to the index since).
for pass in 1 2; do
    "$CONDENSE" --pool "$CACHED" serve --socket "$W/cached.sock" >"$W/cached-serve.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/cached-serve.log" test -S "$CACHED/control.sock" || exit 1
    for v in vm vm2; do
        check "cached: read $v over NBD (pass $pass)" \
            qemu-io -r -f raw -c "read 0 24M" "nbd+unix:///$v?socket=$W/cached.sock"
    done
    if [ $pass = 1 ]; then stop_server; continue; fi
    # Its counters through the control socket (an open of its own would rewrite the index).
    sleep 1.2 # the counters reach the index every second
    "$CONDENSE" --pool "$CACHED" cache stats --json >"$W/cached-stats.json" 2>&1
    kill9_server
done
rm -f "$CACHED/control.sock"
cache_stat() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['$1'])" "$W/cached-stats.json"; }
used=$(cache_stat cache_used_bytes) hits=$(cache_stat cache_hits) corrupt=$(cache_stat cache_corrupt_entries)
if [ "${used:-0}" -gt 1000000 ] && [ "${hits:-0}" -gt 0 ] && [ "$corrupt" = 0 ]; then
    ok "cached: the cache is warm ($used bytes used, $hits hits, 0 corrupt)"
else
    fail "cached: the cache is warm (used $used, hits $hits, corrupt $corrupt)"
fi

# --- The S3 pool: a file:// bucket and its local directory ---------------------------------
S3=$BASE/s3local
check "s3: init file://.../bucket --cache s3local" \
    "$CONDENSE" init "file://$BASE/bucket" --cache "$S3" --cache-size 1G
s3() { "$CONDENSE" --pool "$S3" "$@"; }
check "s3: import the image as vm" s3 import --format raw --name vm "$W/img.raw"
check "s3: snapshot vm@s1" s3 snapshot create vm s1
check "s3: clone vm@s1 as vm2" s3 volume clone vm@s1 vm2
for i in 1 2 3 4; do
    python3 -c "import random, sys; sys.stdout.buffer.write(random.Random($i).randbytes(1 << 18))" >"$W/random-$i.bin"
done
"$CONDENSE" --pool "$S3" serve --socket "$W/s3.sock" >"$W/s3-serve.log" 2>&1 &
SERVER_PID=$!
wait_ready "$SERVER_PID" "$W/s3-serve.log" test -S "$S3/control.sock" || exit 1
for i in 1 2 3 4; do
    check "s3: qemu-io: flushed writes $i to vm and vm2 (a pattern, 256K of random data)" \
        qemu-io -f raw -c "write -P 0x$((i + 40)) $((i * 3))M 512K" \
        -c "write -s $W/random-$i.bin $((i * 5))M 256K" -c flush "nbd+unix:///vm?socket=$W/s3.sock"
    qemu-io -f raw -c "write -P 0x$((i + 50)) $((i * 2))M 256K" -c flush \
        "nbd+unix:///vm2?socket=$W/s3.sock" >/dev/null 2>&1
done
for v in vm vm2; do
    check "s3: read $v over NBD (the cache tier warms)" \
        qemu-io -r -f raw -c "read 0 24M" "nbd+unix:///$v?socket=$W/s3.sock"
done
sleep 1.2 # the cache's counters are written every second
kill9_server
rm -f "$S3/control.sock"
journal=$(ls "$S3"/journal-*.wal 2>/dev/null | head -1)
size=$(stat -c %s "$journal" 2>/dev/null || echo 0)
staged=$(ls "$S3"/seg-*.dat 2>/dev/null | wc -l)
if [ "$size" -gt 64 ] && [ "$staged" -gt 0 ]; then
    ok "s3: kill -9 left the journal with batches ($size bytes) and $staged staged segment(s)"
else
    fail "s3: journal holds batches ($size bytes), a staged segment ($staged)"
fi
(cd "$BASE" && find bucket s3local -type f -printf '    %p %s\n' | sort) # what the rounds damage

check "rounds: ${ROUNDS:-100} seeded rounds of damage, verify, export, repair (local, cached, s3)" \
    python3 "$ROOT/tests/corruption/rounds.py" "$CONDENSE" "$BASE" "$W/rounds" \
    "${ROUNDS:-100}" "${SEED:-1}"
# The references and the seed (the head), then the last broken rounds and the tally.
awk -v n="$(wc -l <"$W/out")" 'NR <= 8 && !seen { print; if (/^seed /) seen = 1; next }
    n <= 48 || NR > n - 40 { print; next } NR == 9 { print "..." }' "$W/out" | sed 's/^/    /'
summary
