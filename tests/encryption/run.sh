#!/usr/bin/env bash
# End-to-end test of encryption at rest with real clients (docs/ENCRYPTION.md):
#
#   init --encrypt (a key file) and a plain pool -> write a distinctive 1 MiB pattern
#   (compressible) and 1 MiB (incompressible) through NBD with nbdcopy and qemu-io against
#   `condense serve` -> read back identical -> grep over every file of the pool finds the
#   pattern nowhere (while serving, after a clean stop = checkpoint, after gc), and the same
#   grep on the plain pool does find it (so the check works) -> a missing key and a wrong key
#   (volume list, serve) fail with a clear error and change no file (sha256 of the directory)
#   -> key files others can read, 32 bytes of text as a key file, and a passphrase under 15
#   characters at init are refused -> a passphrase pool (argon2id) opens with its passphrase
#   only -> a flipped byte in each
#   chunk record: the NBD read fails (EIO), the server log and `condense verify` name the volume
#   and block with an authentication error (so does `condense export`).
#
#   bash tests/encryption/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/encryption/run.sh
#
# Needs (Debian): qemu-utils libnbd-bin python3. No root. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-io nbdcopy nbdinfo python3 sha256sum

W=$(mktemp -d /tmp/condense-crypt-e2e.XXXXXX)
ENC=$W/enc
PLAIN=$W/plain
free_port PORT
URI=nbd://127.0.0.1:$PORT
SERVER_PID=

cleanup() {
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

start_server() { # POOL [key options...]
    local pool=$1; shift
    rm -f "$W/server.log"
    "$CONDENSE" --pool "$pool" "$@" serve --insecure-listen "127.0.0.1:$PORT" >"$W/server.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/server.log" nbdinfo --size "$URI/vm" || exit 1
}
# Files of POOL that hold the marker (0 lines = none), by grep over every file.
hits() { grep -rlaF -- "$MARK" "$1" 2>/dev/null | wc -l; }
tree_sum() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum; find . -printf '%p %s %T@\n' | sort); }

# The known plaintext: a marker unique to this run. 1 MiB compressible (the marker and a
# counter), then 1 MiB incompressible (random, the marker at the start of every 4 KiB).
MARK="CONDENSE-KNOWN-PLAINTEXT-$$-$RANDOM-"
python3 - "$W/data.raw" "$MARK" <<'EOF'
import os, sys
mark = sys.argv[2].encode()
a = bytearray()
while len(a) < 1 << 20:
    a += mark + b"%010d|" % len(a)
b = bytearray()
while len(b) < 1 << 20:
    b += mark + os.urandom(4096 - len(mark))
open(sys.argv[1], "wb").write(bytes(a[:1 << 20]) + bytes(b[:1 << 20]))
EOF
head -c 32 /dev/urandom >"$W/key"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$W/wrong.hex"
printf 'correct horse battery staple\n' >"$W/pass"
printf 'wrong horse\n' >"$W/wrongpass"
# Key and passphrase files are read only if owner-only (docs/ENCRYPTION.md).
chmod 600 "$W/key" "$W/wrong.hex" "$W/pass" "$W/wrongpass"
K=(--key-file "$W/key")

check "init --encrypt --key-file" "$CONDENSE" init "$ENC" --encrypt "${K[@]}"
check "init a plain pool" "$CONDENSE" init "$PLAIN"
check "encrypted pool: create volume vm" "$CONDENSE" --pool "$ENC" "${K[@]}" volume create vm --size 16M
check "plain pool: create volume vm" "$CONDENSE" --pool "$PLAIN" volume create vm --size 16M
# Volume names are plaintext too: one holding the marker (hits() must not find it either).
check "encrypted pool: a volume named after the marker" \
    "$CONDENSE" --pool "$ENC" "${K[@]}" volume create "${MARK}vol" --size 1M
check "plain pool: a volume named after the marker" \
    "$CONDENSE" --pool "$PLAIN" volume create "${MARK}vol" --size 1M

for pool in "$PLAIN" "$ENC"; do
    name=$([ "$pool" = "$ENC" ] && echo encrypted || echo plain)
    if [ "$pool" = "$ENC" ]; then start_server "$pool" "${K[@]}"; else start_server "$pool"; fi
    check "$name: nbdcopy the 2 MiB pattern into vm" nbdcopy "$W/data.raw" "$URI/vm"
    check "$name: qemu-io writes the pattern again at 4 MiB" \
        qemu-io -f raw "$URI/vm" -c "write -s $W/data.raw 4M 2M" -c flush
    nbdcopy "$URI/vm" "$W/back.raw" 2>"$W/out"
    check "$name: the volume reads back the pattern (nbdcopy)" \
        bash -c "cmp <(head -c 2097152 '$W/back.raw') '$W/data.raw' && cmp <(tail -c +4194305 '$W/back.raw' | head -c 2097152) '$W/data.raw'"
    if [ "$name" = plain ]; then
        n=$(hits "$pool")
        [ "$n" -gt 0 ] && ok "plain (control): grep finds the pattern in $n file(s) while serving" \
            || fail "plain (control): grep finds no pattern, so the check proves nothing"
    else
        n=$(hits "$pool")
        [ "$n" = 0 ] && ok "encrypted: the pattern is in no file while serving (journal, segments)" \
            || fail "encrypted: the pattern is in $n file(s) while serving: $(grep -rlaF -- "$MARK" "$pool" | tr '\n' ' ')"
    fi
    # Overwrite half so gc has something to move, then gc through the control socket.
    check "$name: overwrite the first MiB with zeros (qemu-io)" \
        qemu-io -f raw "$URI/vm" -c "write -z 0 1M" -c "write -s $W/data.raw 8M 2M" -c flush
    check "$name: gc" "$CONDENSE" --pool "$pool" gc --min-dead-percent 1
    stop_server
    n=$(hits "$pool")
    if [ "$name" = plain ]; then
        [ "$n" -gt 0 ] && ok "plain (control): pattern found after stop (checkpoint) and gc" \
            || fail "plain (control): pattern not found after stop and gc"
    else
        [ "$n" = 0 ] && ok "encrypted: the pattern is in no file after gc and a clean stop (checkpoint)" \
            || fail "encrypted: the pattern is in $n file(s) after gc and stop"
    fi
done

# Missing and wrong keys: a clear error, nothing written.
tree_sum "$ENC" >"$W/sum.before"
refuse "no key: clear error" "is encrypted: give its key with --key-file" \
    env -u CONDENSE_KEY_FILE -u CONDENSE_PASSPHRASE_FILE "$CONDENSE" --pool "$ENC" volume list </dev/null
refuse "wrong key file (hex): clear error" "the key does not open pool" \
    "$CONDENSE" --pool "$ENC" --key-file "$W/wrong.hex" volume list
refuse "wrong key: serve refuses to start" "the key does not open pool" \
    timeout 20 "$CONDENSE" --pool "$ENC" --key-file "$W/wrong.hex" serve --insecure-listen "127.0.0.1:$PORT"
refuse "passphrase given to a key-file pool: clear error" "encrypted with a key file" \
    "$CONDENSE" --pool "$ENC" --passphrase-file "$W/pass" stats
refuse "a key file of the wrong size: clear error" "32 raw bytes or 64 hex digits" \
    "$CONDENSE" --pool "$ENC" --key-file "$W/pass" stats
# Key files are secrets of random bytes: others must not read them, and text is no key.
cp "$W/key" "$W/key.shared" && chmod 644 "$W/key.shared"
refuse "a key file other users can read is refused, naming the chmod that fixes it" "chmod 600" \
    "$CONDENSE" --pool "$ENC" --key-file "$W/key.shared" stats
(umask 077 && printf 'correct horse battery staple 123' >"$W/text.key")
refuse "a 32-byte text file is not taken as a raw key" "looks like text" \
    "$CONDENSE" --pool "$ENC" --key-file "$W/text.key" stats
(umask 077 && printf 'short pass\n' >"$W/short.pass")
refuse "init refuses a passphrase of fewer than 15 characters" "at least 15" \
    "$CONDENSE" init "$W/short" --encrypt --passphrase-file "$W/short.pass"
tree_sum "$ENC" >"$W/sum.after"
check "no file changed by the failed opens (sha256, sizes and mtimes of the pool)" diff "$W/sum.before" "$W/sum.after"
check "the key in \$CONDENSE_KEY_FILE opens the pool; verify clean" \
    env CONDENSE_KEY_FILE="$W/key" "$CONDENSE" --pool "$ENC" verify

# A passphrase pool.
check "init --encrypt --passphrase-file" "$CONDENSE" init "$W/pp" --encrypt --passphrase-file "$W/pass"
check "passphrase pool: create a volume with the passphrase" \
    "$CONDENSE" --pool "$W/pp" --passphrase-file "$W/pass" volume create vm --size 4M
refuse "passphrase pool: a wrong passphrase is refused" "the key does not open pool" \
    "$CONDENSE" --pool "$W/pp" --passphrase-file "$W/wrongpass" volume list

# A flipped byte in the payload of every chunk record (headers are in the clear: walk them),
# so whichever block a reader meets first is damaged.
if python3 - "$ENC" >"$W/flip.out" 2>&1 <<'EOF'
import glob, struct, sys
n = 0
for seg in sorted(glob.glob(sys.argv[1] + "/seg-*.dat")):
    b = bytearray(open(seg, "rb").read())
    at = 64                                   # segment header
    while at + 32 <= len(b):
        length = struct.unpack_from("<I", b, at + 24)[0] & 0xFFFFFF
        if length == 0 or at + 32 + length > len(b):
            break                             # the zero tail of an open segment, or a torn record
        b[at + 32 + length // 2] ^= 0x20      # the middle of the sealed payload
        at += 32 + length
        n += 1
    open(seg, "wb").write(b)
if n == 0:
    sys.exit("no chunk record found in the segments")
print(f"flipped a byte in {n} records")
EOF
then
    ok "$(cat "$W/flip.out")"
else
    fail "could not flip a byte in the chunk records: $(cat "$W/flip.out")"
fi
start_server "$ENC" "${K[@]}"
if nbdcopy "$URI/vm" "$W/back2.raw" >"$W/out" 2>&1; then
    fail "reading the whole volume over NBD succeeded despite a flipped byte"
else
    ok "reading the whole volume over NBD fails (EIO) after a flipped byte"
fi
if grep -q 'authentication failed for volume "vm" block [0-9]' "$W/server.log"; then
    ok "the server log names the volume and block: $(grep -o 'authentication failed for volume "vm" block [0-9]*' "$W/server.log" | head -1)"
else
    cp "$W/server.log" "$W/out"; fail "the server log names no authentication error with volume and block"
fi
"$CONDENSE" --pool "$ENC" verify >"$W/verify.out" 2>&1
vrc=$?
cp "$W/verify.out" "$W/out"
if [ "$vrc" != 0 ] && grep -q 'authentication failed' "$W/verify.out" && grep -q 'vm' "$W/verify.out" \
    && grep -qi 'block' "$W/verify.out"; then
    ok "condense verify reports the authentication error with volume and block"
else
    fail "condense verify (exit $vrc) does not report the authentication error with volume and block"
fi
stop_server
refuse "condense export names the volume and block of the authentication error" \
    'authentication failed for volume "vm" block' \
    "$CONDENSE" --pool "$ENC" "${K[@]}" export vm "$W/export.raw"

summary
