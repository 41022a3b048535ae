#!/usr/bin/env bash
# End-to-end test of `condense repair` and of the `sync` write policy under kill -9, with
# real clients over NBD.
#
# Repair:  write three flushed batches through NBD (qemu-io) -> kill -9 the server so the
#   journal holds them -> flip one byte of the middle batch with dd -> opening fails and says
#   to run `condense repair` -> `repair --dry-run` changes no file and names the lost blocks ->
#   `repair` reports exactly the blocks of the damaged batch that the later batch did not
#   rewrite, keeps a backup -> `verify` clean -> the volume, served again, equals a reference
#   image (lost ranges hold their earlier content) under qemu-img compare and cmp.
# Sync:  a pool made with --write-policy sync, fio randwrite with verify over NBD, kill -9 the
#   server mid-run, restart, fio verify_only with the saved verify state: every write fio saw
#   complete verifies (with sync every acknowledged write is durable, not only flushed ones).
#
#   bash tests/repair/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/repair/run.sh
#
# Needs (Debian): qemu-utils libnbd-bin fio jq. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-img qemu-io nbdinfo fio jq od

W=$(mktemp -d /tmp/condense-repair-e2e.XXXXXX)
POOL=$W/pool
free_port PORT
URI=nbd://127.0.0.1:$PORT
SERVER_PID=
FIO_PID=

cleanup() {
    [ -n "$FIO_PID" ] && kill "$FIO_PID" 2>/dev/null
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

c() { "$CONDENSE" --pool "$POOL" "$@"; }

start_server() {
    # No background scrub: the record of a finished pass is a journal batch of its own, and
    # this test damages the batches it wrote by their order.
    "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" --scrub-rate 0 \
        >>"$W/serve.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/serve.log" nbdinfo --list "$URI"
}
stop_server() { kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; }
crash_server() { kill -KILL "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; }
u32_at() { od -An -tu4 -j "$2" -N4 "$1" | tr -d ' '; } # FILE OFFSET: little-endian u32

cd "$W" || exit 1
echo "condense: $CONDENSE; work dir $W; port $PORT"

# ---------------------------------------------------------------------------------------
# Repair of a journal damaged in the middle.
c init --write-policy async >"$W/out" 2>&1 || { fail "condense init" "$W/out"; echo "$passed passed, $failed failed"; exit 1; }
c volume create vm --size 16M >/dev/null || fail "volume create vm"
start_server || exit 1
# Three batches, each one NBD write then a flush: A 0x11 [0,1M), B 0x22 [1M,2M),
# C 0x33 [1.5M,1.75M) and [4M,5M).
check "batch A written through NBD" qemu-io -f raw -c "write -P 0x11 0 1M" -c flush "$URI/vm"
check "batch B written through NBD" qemu-io -f raw -c "write -P 0x22 1M 1M" -c flush "$URI/vm"
check "batch C written through NBD" qemu-io -f raw -c "write -P 0x33 1536k 256k" -c "write -P 0x33 4M 1M" -c flush "$URI/vm"
crash_server # the journal holds all three batches, no checkpoint after them

# The reference: what the volume holds if batch B is lost (its blocks keep their zeros,
# except where C rewrote them).
truncate -s 16M ref.raw
qemu-io -f raw -c "write -P 0x11 0 1M" -c "write -P 0x33 1536k 256k" -c "write -P 0x33 4M 1M" ref.raw >/dev/null
# And what it held before the damage, to show the damage is real.
cp ref.raw full.raw
qemu-io -f raw -c "write -P 0x22 1M 1M" -c "write -P 0x33 1536k 256k" full.raw >/dev/null

# batch_offsets JOURNAL: the byte offset of every batch, into the array `offsets`.
batch_offsets() {
    offsets=()
    local pos=64 size
    size=$(stat -c %s "$1")
    while [ $((pos + 24)) -le "$size" ]; do
        offsets+=("$pos")
        pos=$((pos + 24 + $(u32_at "$1" $((pos + 4)))))
    done
}
J=$(ls "$POOL"/journal-*.wal)
batch_offsets "$J"
# A and B are one batch each (one write, then a flush); C may take more than one.
if [ "${#offsets[@]}" -ge 3 ]; then ok "the journal holds batches A, B, C (${#offsets[@]} batches)"; else fail "the journal holds at least 3 batches (found ${#offsets[@]})"; fi
# The last byte of batch B: the high byte of the last entry of its map run.
b_end=$((offsets[2] - 1))
printf '\xff' | dd of="$J" bs=1 seek="$b_end" conv=notrunc status=none
cp "$J" damaged.wal

if c volume list >"$W/out" 2>&1; then
    fail "opening a pool with mid-journal damage fails" "$W/out"
else
    if grep -q "condense repair" "$W/out"; then ok "opening fails and says to run condense repair"; else fail "the open error names condense repair" "$W/out"; fi
fi

sum_files() { (cd "$POOL" && find . -maxdepth 1 -type f ! -name lock -print0 | sort -z | xargs -0 sha256sum); }
sum_files >"$W/before.sum"
c repair --dry-run --json >"$W/dry.json" 2>"$W/dry.err"
rc=$?
if [ "$rc" -eq 3 ]; then ok "repair --dry-run exits 3 (damage found)"; else fail "repair --dry-run exits 3 (got $rc)" "$W/dry.err"; fi
sum_files >"$W/after.sum"
check "repair --dry-run changes no file" cmp "$W/before.sum" "$W/after.sum"
check "repair --dry-run made no backup" bash -c "! ls -d '$POOL'/repair-* 2>/dev/null"
# Lost: B's blocks that C did not rewrite: [256,384) and [448,512) in 4 KiB blocks.
expected='[{"volume":"vm","first_block":256,"blocks":128,"offset":1048576,"bytes":524288},{"volume":"vm","first_block":448,"blocks":64,"offset":1835008,"bytes":262144}]'
lost_of() { jq -c '[.lost[] | {volume, first_block, blocks, offset, bytes}]' "$1"; }
if [ "$(lost_of "$W/dry.json")" = "$expected" ]; then ok "dry run names exactly the lost blocks"; else fail "dry run names exactly the lost blocks: $(lost_of "$W/dry.json")"; fi

c repair --json >"$W/repair.json" 2>"$W/repair.err"
rc=$?
if [ "$rc" -eq 0 ]; then ok "repair exits 0"; else fail "repair exits 0 (got $rc)" "$W/repair.err"; fi
if [ "$(lost_of "$W/repair.json")" = "$expected" ]; then ok "repair reports exactly the lost blocks"; else fail "repair reports exactly the lost blocks: $(lost_of "$W/repair.json")"; fi
backup=$(jq -r .backup "$W/repair.json")
check "the damaged journal is kept in the backup" cmp damaged.wal "$backup/$(basename "$J")"
check "the backup holds checkpoint and meta.dat" test -f "$backup/checkpoint" -a -f "$backup/meta.dat"
check "verify is clean after repair" c verify
# The loss stays in the pool's history: verify lists it, repair --history shows it.
hist() { jq -c '[.[] | .lost[] | {volume, first_block, blocks}]'; }
want_hist=$(jq -c '[.lost[] | {volume, first_block, blocks}]' "$W/repair.json")
if [ "$(c verify --json 2>/dev/null | jq -c '.accepted_damage' | hist)" = "$want_hist" ]; then
    ok "verify --json lists the accepted loss"; else fail "verify --json lists the accepted loss"; fi
if [ "$(c repair --history --json 2>/dev/null | hist)" = "$want_hist" ]; then
    ok "repair --history names the lost ranges"; else fail "repair --history names the lost ranges"; fi
check "repair --clear-history" c repair --clear-history
if [ "$(c repair --history --json 2>/dev/null | jq length)" = 0 ]; then
    ok "the history is empty once cleared"; else fail "the history is empty once cleared"; fi
# Text report for an administrator (nothing left to repair now).
c repair --dry-run >"$W/out" 2>&1
if grep -q "no damage found" "$W/out"; then ok "a second dry run finds nothing to repair"; else fail "a second dry run finds nothing to repair" "$W/out"; fi

start_server || fail "server starts on the repaired pool"
if c repair --dry-run >"$W/out" 2>&1; then
    fail "repair refuses while serve holds the pool" "$W/out"
elif grep -q "in use" "$W/out"; then ok "repair refuses while serve holds the pool"; else fail "repair refuses while serve holds the pool (message)" "$W/out"; fi
check "the volume equals the reference (qemu-img compare over NBD)" qemu-img compare -f raw -F raw ref.raw "$URI/vm"
check "qemu-img convert of the volume over NBD" qemu-img convert -f raw -O raw "$URI/vm" now.raw
check "cmp: outside the lost ranges every byte is what was written" cmp ref.raw now.raw
if cmp -s full.raw now.raw; then fail "the damage lost something (lost ranges differ from the undamaged content)"; else ok "the lost ranges differ from the undamaged content"; fi
check "the repaired pool takes writes" qemu-io -f raw -c "write -P 0x44 8M 1M" -c flush "$URI/vm"
stop_server
check "verify still clean after a clean stop" c verify

# ---------------------------------------------------------------------------------------
# Repair of an encrypted pool: the same three batches, batch B's header checksum flipped (its
# sealed payload still authenticates, so repair can name what it wrote); repair needs the key
# and seals the rebuilt metadata under a new nonce epoch.
POOL=$W/pool-enc
(umask 077 && head -c 32 /dev/urandom >"$W/key")
export CONDENSE_KEY_FILE=$W/key
c init --encrypt --write-policy async >"$W/out" 2>&1 || fail "condense init --encrypt" "$W/out"
c volume create vm --size 16M >/dev/null || fail "volume create vm (encrypted)"
start_server || exit 1
check "encrypted: batches A, B, C written through NBD" qemu-io -f raw -c "write -P 0x11 0 1M" -c flush \
    -c "write -P 0x22 1M 1M" -c flush -c "write -P 0x33 1536k 256k" -c "write -P 0x33 4M 1M" -c flush "$URI/vm"
crash_server
J=$(ls "$POOL"/journal-*.wal)
batch_offsets "$J"
printf '\xff' | dd of="$J" bs=1 seek=$((offsets[1] + 17)) conv=notrunc status=none
if env -u CONDENSE_KEY_FILE "$CONDENSE" --pool "$POOL" repair --dry-run </dev/null >"$W/out" 2>&1; then
    fail "encrypted: repair without the key fails" "$W/out"
elif grep -q "key" "$W/out"; then ok "encrypted: repair without the key fails and asks for it"; else fail "encrypted: repair without the key names the key" "$W/out"; fi
c repair --json >"$W/repair-enc.json" 2>"$W/out" || fail "encrypted: repair" "$W/out"
if [ "$(lost_of "$W/repair-enc.json")" = "$expected" ]; then ok "encrypted: repair reports exactly the lost blocks"; else fail "encrypted: repair reports exactly the lost blocks: $(lost_of "$W/repair-enc.json")"; fi
check "encrypted: verify is clean after repair" c verify
start_server || fail "server starts on the repaired encrypted pool"
check "encrypted: the volume equals the reference (qemu-img compare over NBD)" qemu-img compare -f raw -F raw ref.raw "$URI/vm"
stop_server
unset CONDENSE_KEY_FILE

# ---------------------------------------------------------------------------------------
# kill -9 under fio verify with the sync write policy: every completed write is durable.
# Four connections (numjobs=4) at depth 1 each: fio's saved verify state then excludes exactly
# the write in flight at the kill. (At iodepth 8 on one connection, fio 3.33 with the nbd
# engine also counted some writes the dead server never answered as completed, so its
# verify_only pass flagged them.) The same job on an async pool fails this check.
POOL=$W/pool-sync
c init --write-policy sync >"$W/out" 2>&1 || fail "condense init --write-policy sync" "$W/out"
c volume create v --size 64M >/dev/null || fail "volume create v"
start_server || exit 1
cat >sync.fio <<EOF
[global]
ioengine=nbd
uri=$URI/v
bs=4k
direct=1
rw=randwrite
size=16M
offset_increment=16M
numjobs=4
iodepth=1
verify=crc32c
verify_fatal=1
verify_state_save=1
[w]
EOF
fio --output="$W/fio-write.log" sync.fio >/dev/null 2>&1 &
FIO_PID=$!
sleep 4
crash_server
wait "$FIO_PID" 2>/dev/null
FIO_PID=
if ls ./*w-*-verify.state >/dev/null 2>&1; then ok "fio saved its verify state at the crash"; else fail "fio saved its verify state at the crash" "$W/fio-write.log"; fi
start_server || fail "server restarts after kill -9"
sed -e 's/^verify_state_save=1$/verify_state_load=1\nverify_only=1/' sync.fio >verify.fio
check "after kill -9, every write fio saw complete verifies (verify_only)" fio --output="$W/fio-verify.log" verify.fio
if grep -q "err=[ ]*[1-9]" "$W/fio-verify.log"; then fail "fio verify_only reported errors" "$W/fio-verify.log"; fi
# The verify pass did check data written before the kill.
read_kib=$(grep -o 'io=[0-9.]*[KMG]i\?B' "$W/fio-verify.log" | head -1)
if [ -n "$read_kib" ] && [ "$read_kib" != "io=0B" ]; then ok "verify_only read back the completed writes ($read_kib)"; else fail "verify_only read back the completed writes" "$W/fio-verify.log"; fi
stop_server
check "verify clean after the crash" c verify

summary
