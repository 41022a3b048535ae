#!/usr/bin/env bash
# End-to-end tests of `condense serve` with real NBD clients: qemu-img, qemu-io, nbdinfo,
# nbdcopy and fio (ioengine=nbd), against a real pool, including SIGTERM + restart and a
# kill -9 in the middle of a write job.
#
#   bash tests/nbd/run.sh            # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/nbd/run.sh
#
# Needs (Debian): qemu-utils libnbd-bin fio. Ends with the line "N passed, M failed" and
# exits non-zero if anything failed. Work files live in a temporary directory (kept on
# failure when KEEP=1).

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-img qemu-io nbdinfo nbdcopy fio

if ! "$CONDENSE" serve --help >/dev/null 2>&1; then
    echo "FAIL - $CONDENSE has no 'serve' command (crates/cli/src/main.rs must add 'mod serve;')"
    echo "0 passed, 1 failed"
    exit 1
fi

W=$(mktemp -d /tmp/condense-nbd-e2e.XXXXXX)
POOL=$W/pool
free_port PORT
URI=nbd://127.0.0.1:$PORT
SOCK=$W/nbd.sock
SERVER_PID=

cleanup() {
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

condense() { "$CONDENSE" --pool "$POOL" "$@"; }

start_server() {
    # Not through the condense() function: $! must be the server itself, not a subshell.
    "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" --socket "$SOCK" "$@" >>"$W/serve.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/serve.log" nbdinfo --list "$URI"
}

# SIGTERM, and the exit status of the server.
stop_server() {
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID"
    local rc=$?
    SERVER_PID=
    return $rc
}

crash_server() {
    kill -KILL "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=
}

fio_job() { # FILE EXPORT EXTRA-LINES...: write a fio job file for the nbd engine
    local file=$1 export=$2
    shift 2
    {
        echo "[global]"
        echo "ioengine=nbd"
        echo "uri=$URI/$export"
        echo "bs=4k"
        echo "direct=1"
        for l in "$@"; do echo "$l"; done
    } >"$file"
}

cd "$W" || exit 1
echo "condense: $CONDENSE; work dir $W; port $PORT"

# ---------------------------------------------------------------------------------------
# Pool and server.
if ! condense init >"$W/out" 2>&1; then
    fail "condense init" "$W/out"
    echo "$passed passed, $failed failed"
    exit 1
fi
for v in vm1:256M vm2:64M vm3:64M vm4:64M vm5:64M; do
    condense volume create "${v%%:*}" --size "${v##*:}" >/dev/null || fail "volume create $v"
done
if ! start_server; then
    fail "condense serve starts"
    echo "$passed passed, $failed failed"
    exit 1
fi
ok "condense serve starts and answers"

# ---------------------------------------------------------------------------------------
# nbdinfo: list, details, map.
nbdinfo --list "$URI" >"$W/list" 2>&1
if grep -q 'export="vm1"' "$W/list" && grep -q 'export="vm5"' "$W/list"; then
    ok "nbdinfo --list shows every volume"
else
    fail "nbdinfo --list shows every volume" "$W/list"
fi

nbdinfo "$URI/vm1" >"$W/info" 2>&1
info_ok=1
for want in "export-size: 268435456" "base:allocation" "can_multi_conn: true" "can_trim: true" \
    "can_zero: true" "can_fast_zero: true" "can_fua: true" "block_size_minimum: 1" \
    "block_size_preferred: 4096"; do
    grep -q "$want" "$W/info" || { info_ok=0; echo "missing: $want" >>"$W/info"; }
done
if [ $info_ok = 1 ]; then ok "nbdinfo shows size, base:allocation, multi-conn, block sizes"; else fail "nbdinfo details" "$W/info"; fi

check "nbdinfo over the Unix socket" nbdinfo "nbd+unix:///vm2?socket=$SOCK"

# ---------------------------------------------------------------------------------------
# qemu-io: aligned, unaligned, write -z, discard, flush.
check "qemu-io aligned write/read" qemu-io -f raw \
    -c 'write -P 0xa1 0 1M' -c 'read -P 0xa1 0 1M' -c 'write -P 0xa2 1M 64k' -c 'read -P 0xa2 1M 64k' "$URI/vm1"
check "qemu-io unaligned write/read" qemu-io -f raw \
    -c 'write -P 0xb2 1000 3333' -c 'read -P 0xb2 1000 3333' -c 'read -P 0xa1 0 1000' \
    -c 'read -P 0xa1 4333 100000' -c 'write -P 0xb3 1048575 3' -c 'read -P 0xb3 1048575 3' "$URI/vm1"
check "qemu-io write -z, discard, flush" qemu-io -f raw \
    -c 'write -P 0xc1 2M 3M' -c 'write -z 2M 1M' -c 'write -z -u 3M 1M' -c 'discard 4M 1M' -c 'flush' \
    -c 'read -P 0 2M 3M' -c 'read -P 0xa1 0 1000' "$URI/vm1"
check "qemu-io reads unwritten space as zeros" qemu-io -f raw -c 'read -P 0 100M 1M' "$URI/vm1"

# nbdinfo --map matches what was written: data [0,1M+64k), hole [1M+64k,2M), allocated zeros
# [2M,3M), holes from 3M on.
nbdinfo --map "$URI/vm1" >"$W/map" 2>&1
expected_map="0 1114112 0
1114112 983040 3
2097152 1048576 2
3145728 265289728 3"
if [ "$(awk '{print $1, $2, $3}' "$W/map")" = "$expected_map" ]; then
    ok "nbdinfo --map matches what was written"
else
    { echo "expected:"; echo "$expected_map"; echo "got:"; cat "$W/map"; } >"$W/out"
    fail "nbdinfo --map matches what was written" "$W/out"
fi

# ---------------------------------------------------------------------------------------
# qemu-img: convert in and out, compare, map.
qemu-img create -q -f qcow2 src.qcow2 64M
qemu-io -f qcow2 -c 'write -P 0x11 0 4M' -c 'write -P 0x22 20M 1M' -c 'write -P 0x11 40M 4M' \
    -c 'write -z 50M 1M' src.qcow2 >/dev/null
head -c 3M /dev/urandom >rand.bin
qemu-io -f qcow2 -c "write -s rand.bin 30M 3M" src.qcow2 >/dev/null 2>&1 ||
    qemu-img dd -f raw -O qcow2 if=rand.bin of=src.qcow2 bs=1M seek=30 count=3 >/dev/null 2>&1
check "qemu-img info over NBD" qemu-img info "$URI/vm2"
check "qemu-img convert qcow2 -> NBD" qemu-img convert -n -f qcow2 -O raw src.qcow2 "$URI/vm2"
check "qemu-img compare qcow2 vs NBD" qemu-img compare -f qcow2 -F raw src.qcow2 "$URI/vm2"
for fmt in qcow2 vmdk vdi; do
    if qemu-img convert -f raw -O "$fmt" "$URI/vm2" "out.$fmt" >"$W/out" 2>&1 &&
        qemu-img compare -f qcow2 -F "$fmt" src.qcow2 "out.$fmt" >>"$W/out" 2>&1; then
        ok "qemu-img convert NBD -> $fmt, byte-identical"
    else
        fail "qemu-img convert NBD -> $fmt, byte-identical" "$W/out"
    fi
done
# The image made from the export keeps the holes: 64M virtual, about 12M of data.
used_kb=$(du -k out.qcow2 | cut -f1)
if [ "$used_kb" -lt 20000 ]; then ok "exported qcow2 is sparse (${used_kb} KiB)"; else fail "exported qcow2 is sparse (${used_kb} KiB)"; fi
qemu-img map -f raw --output=json "$URI/vm2" >"$W/qmap" 2>&1
if grep -q '"start": 4194304, "length": [0-9]*, "depth": 0, "present": true, "zero": true, "data": false' "$W/qmap"; then
    ok "qemu-img map shows holes"
else
    fail "qemu-img map shows holes" "$W/qmap"
fi

# ---------------------------------------------------------------------------------------
# nbdcopy: sparse round trip, one and several connections.
truncate -s 64M sparse.raw
head -c 8M /dev/urandom | dd of=sparse.raw conv=notrunc bs=1M seek=0 status=none
head -c 4M /dev/urandom | dd of=sparse.raw conv=notrunc bs=1M seek=40 status=none
check "nbdcopy file -> NBD" nbdcopy sparse.raw "$URI/vm3"
check "nbdcopy NBD -> file" nbdcopy "$URI/vm3" back.raw
check "nbdcopy round trip is byte-identical" cmp sparse.raw back.raw
used_kb=$(du -k back.raw | cut -f1)
if [ "$used_kb" -lt 20000 ]; then ok "nbdcopy output is sparse (${used_kb} KiB)"; else fail "nbdcopy output is sparse (${used_kb} KiB)"; fi
data_bytes=$(nbdinfo --map "$URI/vm3" | awk '$3 == 0 {s += $2} END {print s + 0}')
if [ "$data_bytes" = $((12 * 1024 * 1024)) ]; then
    ok "nbdinfo --map shows exactly the 12 MiB written as data"
else
    fail "nbdinfo --map shows exactly the 12 MiB written as data (got $data_bytes)"
fi
check "nbdcopy with 4 connections (multi-conn)" nbdcopy --connections=4 --requests=16 "$URI/vm3" back4.raw
check "multi-conn copy is byte-identical" cmp sparse.raw back4.raw

# ---------------------------------------------------------------------------------------
# fio verify across several connections, then SIGTERM, restart, verify-only.
fio_job verify.fio vm4 "rw=randwrite" "iodepth=32" "numjobs=4" "size=16M" "offset_increment=16M" \
    "verify=crc32c" "verify_fatal=1" "do_verify=1" "group_reporting=1" "[verify]"
check "fio randwrite 4k iodepth 32 x4 connections, verify=crc32c" fio --output="$W/fio1.log" verify.fio
grep -q "err= 0" "$W/fio1.log" || fail "fio verify job reported errors" "$W/fio1.log"

if stop_server; then ok "SIGTERM stops the server with status 0"; else fail "SIGTERM stops the server with status 0" "$W/serve.log"; fi
if grep -q "stopped" "$W/serve.log"; then ok "server reports a clean stop"; else fail "server reports a clean stop" "$W/serve.log"; fi
start_server || fail "server restarts after SIGTERM" "$W/serve.log"
fio_job verifyonly.fio vm4 "rw=randwrite" "iodepth=32" "numjobs=4" "size=16M" "offset_increment=16M" \
    "verify=crc32c" "verify_fatal=1" "verify_only=1" "group_reporting=1" "[verify]"
check "fio verify-only pass after restart" fio --output="$W/fio2.log" verifyonly.fio

# ---------------------------------------------------------------------------------------
# kill -9 in the middle of a write job with periodic flushes: what completed flushes covered
# survives. Phase A writes [0,32M) and ends with a flush; phase B writes [32M,64M) with a
# flush every 16 writes and is cut off by kill -9. After restart A verifies and the whole
# volume reads without an error.
fio_job crashA.fio vm5 "rw=randwrite" "iodepth=16" "size=32M" "verify=crc32c" "do_verify=0" \
    "end_fsync=1" "[a]"
check "fio write phase with final flush" fio --output="$W/fioA.log" crashA.fio
fio_job crashB.fio vm5 "rw=randwrite" "iodepth=16" "offset=32M" "size=32M" "fsync=16" \
    "time_based=1" "runtime=60" "[b]"
fio --output="$W/fioB.log" crashB.fio >/dev/null 2>&1 &
fio_pid=$!
sleep 3
crash_server
wait "$fio_pid" 2>/dev/null
start_server || fail "server restarts after kill -9" "$W/serve.log"
fio_job crashV.fio vm5 "rw=randwrite" "iodepth=16" "size=32M" "verify=crc32c" "verify_fatal=1" \
    "verify_only=1" "[a]"
check "after kill -9 + restart, flushed data verifies" fio --output="$W/fioV.log" crashV.fio
check "after kill -9 + restart, the whole volume reads without error" nbdcopy "$URI/vm5" null:
# Phase B really ran: some of what it wrote and flushed before the kill is there (phase A
# covers exactly [0,32M) with data, so any data beyond 32 MiB is B's).
b_data=$(nbdinfo --map "$URI/vm5" | awk '$3 == 0 {s += $2} END {print s - 33554432}')
if [ "$b_data" -gt 0 ]; then
    ok "the interrupted job had written and flushed data ($b_data bytes survive)"
else
    fail "the interrupted job had written and flushed data" "$W/fioB.log"
fi

# ---------------------------------------------------------------------------------------
# Bad clients do not disturb the server.
{
    exec 3<>"/dev/tcp/127.0.0.1/$PORT"
    head -c 200 /dev/urandom >&3
    exec 3>&-
} 2>/dev/null
check "server still serves after a garbage client" qemu-io -f raw -c 'read -P 0xa1 8192 4k' "$URI/vm1"

# ---------------------------------------------------------------------------------------
# Read-only mode.
stop_server >/dev/null 2>&1
start_server --read-only || fail "server starts read-only" "$W/serve.log"
nbdinfo "$URI/vm1" >"$W/out" 2>&1
if grep -q "is_read_only: true" "$W/out"; then ok "read-only export advertised"; else fail "read-only export advertised" "$W/out"; fi
if qemu-io -f raw -c 'write -P 0xee 0 4k' "$URI/vm1" >"$W/out" 2>&1; then
    fail "read-only server refuses writes" "$W/out"
else
    ok "read-only server refuses writes"
fi
check "read-only server still reads" qemu-io -r -f raw -c 'read -P 0xa1 8192 512k' "$URI/vm1"
stop_server >/dev/null 2>&1

# ---------------------------------------------------------------------------------------
# condense import / export of image formats (through qemu-img and an in-process server).
if "$CONDENSE" export --help 2>/dev/null | grep -q -- "--format"; then
    check "condense import qcow2" condense import src.qcow2 --name imported
    for fmt in vmdk vdi qcow2; do
        check "condense import $fmt" condense import "out.$fmt" --name "from-$fmt"
        check "condense export $fmt" condense export "from-$fmt" "exp.$fmt" --format "$fmt"
        check "export $fmt is identical to the source" qemu-img compare -f qcow2 -F "$fmt" src.qcow2 "exp.$fmt"
    done
    start_server || fail "server restarts" "$W/serve.log"
    check "imported volume is identical over NBD" qemu-img compare -f qcow2 -F raw src.qcow2 "$URI/imported"
    stop_server >/dev/null 2>&1
else
    echo "# not tested: condense import/export of qcow2/vmdk/vdi (export has no --format yet)"
fi

# The pool is consistent after all of it.
check "condense verify finds no damage" condense verify

summary
