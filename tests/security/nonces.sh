#!/usr/bin/env bash
# Nonces that can never repeat (issue 23, docs/ENCRYPTION.md, docs/FORMAT.md "Encryption"), end
# to end with the real CLI and a real NBD client:
#
#   an encrypted pool A, written by `condense import` and by qemu-io over NBD (serve --socket)
#   -> cp -a to B (a copied pool / a restored backup) and to C; A and B then written with
#   different data, each by import and by qemu-io -> C written, then its superblock rolled back
#   to the copy saved before, then written again (the rolled-back superblock opens: it is valid,
#   and harmless) -> D's superblock edited without the key (the old epoch field and the write
#   policy, CRCs fixed as a forger would): it does not open, for reading or writing, and no file
#   changes -> every volume reads back what was written -> a Python reader walks the files of
#   every pool, and of copies taken while the servers ran (journals hold batches then), by
#   docs/FORMAT.md: chunk records of the segments, journal batches, checkpoint roots and sealed
#   pages of meta.dat; it collects each object's nonce (session salt and counter; 12-byte nonce
#   in a format 3 pool) and fails if one nonce sealed two different objects, or if it read too
#   few objects to mean anything.
#
# Against a build with the older scheme (nonce = superblock epoch + counter) the copies and the
# rollback reuse nonces and the edited superblock opens: this test fails there.
#
#   CONDENSE=/path/to/condense bash tests/security/nonces.sh
#
# Needs (Debian): qemu-utils libnbd-bin python3. No root. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-io nbdinfo python3 cmp

W=$(mktemp -d /tmp/condense-nonces.XXXXXX)
SERVER_PID=
cleanup() {
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

(umask 077 && head -c 32 /dev/urandom >"$W/key")
K=(--key-file "$W/key")
c() { # POOL ARGS...: condense on POOL with the key
    local pool=$1
    shift
    "$CONDENSE" --pool "$pool" "${K[@]}" "$@"
}

# Six 4 MiB images of distinct random data (incompressible: one record per 4 KiB block).
for i in 1 2 3 4 5 6; do head -c 4M /dev/urandom >"$W/data-$i.raw"; done

SOCK=$W/nbd.sock
serve() { # POOL: serve it on $SOCK (NBD over a Unix socket only), ready when vm answers
    rm -f "$SOCK" "$W/server.log"
    "$CONDENSE" --pool "$1" "${K[@]}" serve --socket "$SOCK" >"$W/server.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/server.log" nbdinfo --size "nbd+unix:///vm?socket=$SOCK"
}
stop() { stop_server; }
# state NAME POOL: keep a copy of the pool's regular files as they are now.
state() {
    mkdir -p "$W/states/$1"
    find "$2" -maxdepth 1 -type f -exec cp {} "$W/states/$1/" \;
}
# write_vm NAME POOL IMAGE OFFSET: qemu-io writes IMAGE into vm at OFFSET over NBD, flushes;
# a copy of the pool's files is kept while the server still runs.
write_vm() {
    local name=$1 pool=$2 image=$3 offset=$4
    if ! serve "$pool"; then
        fail "$name: serve $pool" "$W/server.log"
        return
    fi
    check "$name: qemu-io writes $(basename "$image") at $offset over NBD" \
        qemu-io -f raw "nbd+unix:///vm?socket=$SOCK" -c "write -s $image $offset 4M" -c flush
    state "$name-serving" "$pool"
    stop
}

A=$W/a B=$W/b C=$W/c D=$W/d
check "init an encrypted pool A (key file)" "$CONDENSE" init "$A" --encrypt "${K[@]}"
check "A: create volume vm" c "$A" volume create vm --size 64M
check "A: condense import data-1 as volume base" c "$A" import "$W/data-1.raw" --name base
write_vm "A1" "$A" "$W/data-2.raw" 0
cp "$A/superblock" "$W/superblock.saved"
state "A-before-copies" "$A"

# Copies: a restored backup, a copied directory, a reverted host snapshot all look like this.
check "cp -a A to B" cp -a "$A" "$B"
check "cp -a A to C" cp -a "$A" "$C"
check "cp -a A to D" cp -a "$A" "$D"

# A and B written differently, by the CLI and by an NBD client.
write_vm "A2" "$A" "$W/data-3.raw" 8M
check "A: condense import data-5 as volume extra" c "$A" import "$W/data-5.raw" --name extra
write_vm "B2" "$B" "$W/data-4.raw" 8M
check "B: condense import data-6 as volume extra" c "$B" import "$W/data-6.raw" --name extra

# C: written, then its superblock rolled back to the copy saved before, then written again.
write_vm "C2" "$C" "$W/data-5.raw" 8M
cp "$W/superblock.saved" "$C/superblock"
check "C: the superblock rolled back to an older valid copy opens (verify)" c "$C" verify
write_vm "C3" "$C" "$W/data-6.raw" 16M

# D: the superblock edited without the key, both CRCs recomputed (in one copy, then in both).
edit_superblock() { # FILE OFFSET VALUE: set the byte, fix the CRCs (docs/FORMAT.md)
    python3 - "$@" <<'EOF'
import sys
path, at, value = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
b = bytearray(open(path, "rb").read())
b[at] = value

def crc32c(data):
    crc = 0xFFFFFFFF
    for x in data:
        crc ^= x
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF

b[124:128] = crc32c(b[:124]).to_bytes(4, "little")
if len(b) >= 256:
    b[252:256] = crc32c(b[:252]).to_bytes(4, "little")
open(path, "wb").write(bytes(b))
EOF
}
sum_dir() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }
opens_with_copy() { c "$1" volume list 2>&1 | grep 'the pool opened with superblock.copy'; }
cp "$D/superblock" "$W/superblock.d"
for edit in "132 1:the epoch field set back to 1" "18 2:the write policy set to async" \
    "16 0:compression set to none"; do
    # One copy edited: the pool opens with the other, authentic one, and says so.
    cp "$W/superblock.d" "$D/superblock"
    cp "$W/superblock.d" "$D/superblock.copy"
    edit_superblock "$D/superblock" ${edit%%:*}
    check "D (${edit#*:}, one copy): opens with the authentic copy and says so" \
        opens_with_copy "$D"
    # Both copies edited (an attacker who can write the pool directory edits both): refused.
    edit_superblock "$D/superblock.copy" ${edit%%:*}
    sum_dir "$D" >"$W/sum.before"
    refuse "D (${edit#*:}, CRCs fixed): a writable open refuses with a clear error" \
        "changed without the key" c "$D" import "$W/data-3.raw" --name t
    refuse "D (${edit#*:}): a read-only open refuses too" "changed without the key" \
        c "$D" volume list
    sum_dir "$D" >"$W/sum.after"
    check "D (${edit#*:}): the refused opens changed no file" diff "$W/sum.before" "$W/sum.after"
done
# (A build that opened the forged superblock sealed data under it: the reader below sees it.)

# What was written reads back, in every copy.
readback() { # NAME POOL VOLUME IMAGE OFFSET
    c "$2" export "$3" "$W/out-$1.raw" >"$W/out" 2>&1 || { fail "$1: export $3" "$W/out"; return; }
    check "$1: volume $3 reads back $(basename "$4") at $5" \
        cmp -n 4194304 -i "0:$5" "$4" "$W/out-$1.raw"
}
readback A-base "$A" base "$W/data-1.raw" 0
readback A-vm1 "$A" vm "$W/data-2.raw" 0
readback A-vm2 "$A" vm "$W/data-3.raw" 8388608
readback A-extra "$A" extra "$W/data-5.raw" 0
readback B-vm1 "$B" vm "$W/data-2.raw" 0
readback B-vm2 "$B" vm "$W/data-4.raw" 8388608
readback B-extra "$B" extra "$W/data-6.raw" 0
readback C-vm2 "$C" vm "$W/data-5.raw" 8388608
readback C-vm3 "$C" vm "$W/data-6.raw" 16777216
for p in A B C; do state "$p-final" "$W/$(echo "$p" | tr ABC abc)"; done
state "D-final" "$D"

# Every nonce of every sealed object in every state kept.
python3 - "$W/states" >"$W/nonces.out" 2>&1 <<'EOF'
import os, struct, sys

SEG_HEADER, RECORD_HEADER, JOURNAL_HEADER, BATCH_HEADER = 64, 32, 64, 24
UNIT, META_HEADER = 64, 4096
TAG = 16

CRC_TABLE = []
for i in range(256):
    crc = i
    for _ in range(8):
        crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    CRC_TABLE.append(crc)

def crc32c(*parts):
    crc = 0xFFFFFFFF
    for data in parts:
        for x in data:
            crc = CRC_TABLE[(crc ^ x) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF

def nonce_bytes(pool):
    """Format 4 seals salt (16) + counter (8); format 3 a 12-byte nonce (epoch + counter)."""
    version = struct.unpack_from("<I", open(os.path.join(pool, "superblock"), "rb").read(), 8)[0]
    return {4: 24, 3: 12}.get(version)

seen = {}          # nonce -> (what, sealed bytes compared)
reuse = []
count = {"segment records": 0, "journal batches": 0, "checkpoint roots": 0, "meta.dat pages": 0}
sessions = set()

def add(kind, nonce, compared, what, n):
    count[kind] += 1
    sessions.add(nonce[:n - 8])
    earlier = seen.setdefault(nonce, (what, compared))
    if earlier[1] != compared:
        reuse.append((nonce.hex(), earlier[0], what))

pools = sorted(os.listdir(sys.argv[1]))
metas = []
for name in pools:
    pool = os.path.join(sys.argv[1], name)
    n = nonce_bytes(pool)
    if n is None:
        sys.exit(f"{pool}: not an encrypted pool of format 3 or 4")
    for f in sorted(os.listdir(pool)):
        b = open(os.path.join(pool, f), "rb").read()
        where = f"{name}/{f}"
        if f.startswith("seg-") and f.endswith(".dat"):
            at = SEG_HEADER
            while at + RECORD_HEADER <= len(b):
                length = struct.unpack_from("<I", b, at + 24)[0] & 0xFFFFFF
                if length < n + TAG or at + RECORD_HEADER + length > len(b):
                    break                                   # torn tail / zero padding
                p = b[at + RECORD_HEADER: at + RECORD_HEADER + length]
                add("segment records", p[:n], p, f"{where}@{at}", n)
                at += RECORD_HEADER + length
        elif f.startswith("journal-") and f.endswith(".wal"):
            at = JOURNAL_HEADER
            while at + BATCH_HEADER <= len(b) and b[at:at + 4] == b"JBAT":
                length = struct.unpack_from("<I", b, at + 4)[0]
                if at + BATCH_HEADER + length > len(b):
                    break
                p = b[at + BATCH_HEADER: at + BATCH_HEADER + length]
                stored = struct.unpack_from("<I", b, at + 16)[0]
                if crc32c(b[at:at + 16], b[at + 20:at + 24], p) != stored:
                    break                                   # a torn tail (copied mid-write)
                add("journal batches", p[:n], p, f"{where}@{at}", n)
                at += BATCH_HEADER + length
        elif f == "checkpoint":
            length = struct.unpack_from("<I", b, 48)[0]
            p = b[64:64 + length]
            add("checkpoint roots", p[:n], p, where, n)
        elif f == "meta.dat":
            metas.append((name, where, b, n))

# meta.dat: a sealed page starts at a 64-byte unit with its sealed length (u16). Pages cannot
# be walked without the key (interior pages are sealed), so every unit is a candidate, kept only
# if its nonce names a session seen in the other objects (random bytes do so with odds 2^-128).
# A freed page may later lose its tail to a newer one (never its head, which is allocated
# first), so a page is compared by its length and first 64 bytes (a reused nonce shows there).
for name, where, b, n in metas:
    for at in range(META_HEADER, len(b) - 2, UNIT):
        length = struct.unpack_from("<H", b, at)[0]
        if length < n + TAG or length > 4096 + 2 + 64 or at + 2 + length > len(b):
            continue
        p = b[at + 2: at + 2 + length]
        if p[:n - 8] not in sessions:
            continue
        add("meta.dat pages", p[:n], (length, p[:64]), f"{where}@{at}", n)

print("read " + ", ".join(f"{v} {k}" for k, v in count.items())
      + f" from {len(pools)} pool states; {len(sessions)} distinct sessions (salts or epochs)")
for r in reuse[:10]:
    print(f"REUSED nonce {r[0]}: {r[1]} and {r[2]} hold different sealed bytes")
if reuse:
    sys.exit(f"{len(reuse)} objects reuse a nonce of a different object")
if count["segment records"] < 8000 or count["journal batches"] < 4 \
        or count["checkpoint roots"] < 4 or count["meta.dat pages"] < 4:
    sys.exit("too few objects read: the reader does not match the format")
EOF
rc=$?
cp "$W/nonces.out" "$W/out"
if [ $rc = 0 ]; then
    ok "no nonce sealed two different objects: $(head -1 "$W/nonces.out")"
else
    fail "the nonce reader: $(tail -1 "$W/nonces.out")" "$W/nonces.out"
fi

summary
