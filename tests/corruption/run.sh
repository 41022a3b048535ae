#!/usr/bin/env bash
# A disk that rots: random bit flips and zeroed 4 KiB sectors in every kind of file of a pool,
# seeded, round after round, through the CLI (issue "a flipped bit never loses the pool").
#
# The pool: a volume imported from an image (unique, duplicate, compressible and zero blocks),
# a snapshot of it, a clone of the snapshot, a file copied into files/ of a FUSE mount, then
# flushed NBD writes from qemu-io to the volume and the clone and a kill -9 of the server, so
# the journal holds batches after the last checkpoint. Every volume and snapshot is exported
# once as the reference.
#
# Each round (tests/corruption/rounds.py) copies the pool, damages one file (the superblock or
# its copy, the root or its copy, the journal, meta.dat, a segment), then:
#   - no command panics or hangs (each has a time limit);
#   - `verify` exits 0 (clean), 3 (damage, named) or 1 (the pool does not open, said why);
#   - every `export` that succeeds is byte-identical to the reference: never wrong data
#     without an error;
#   - where verify was not clean, `repair` succeeds and `verify` is then clean;
#   - after repair every block of every volume reads as the reference, except inside the
#     ranges the repair report says were lost (for damaged journal batches the report names
#     the batches, and their blocks only as far as they decode without their checksum:
#     differences are then accepted anywhere, the loss having been said);
#   - damage to one copy of the superblock or of the root loses nothing, and open says which
#     copy it used.
#
#   bash tests/corruption/run.sh                 # ROUNDS=100 SEED=1
#   ROUNDS=300 SEED=7 bash tests/corruption/run.sh
#
# Needs (Debian): qemu-utils (qemu-io), python3, fuse3 (files/; skipped without /dev/fuse
# outside CI). A damaged last journal batch is not part of the rounds: it cannot be told from
# a write torn by a crash, which open drops (docs/REPAIR.md).

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-io python3

W=$(mktemp -d /tmp/condense-corruption.XXXXXX)
POOL=$W/base
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

check "rounds: ${ROUNDS:-100} seeded rounds of damage, verify, export, repair" \
    python3 "$ROOT/tests/corruption/rounds.py" "$CONDENSE" "$POOL" "$W/rounds" \
    "${ROUNDS:-100}" "${SEED:-1}"
sed 's/^/    /' "$W/out" | tail -25
summary
