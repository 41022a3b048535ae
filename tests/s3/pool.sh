#!/usr/bin/env bash
# End-to-end test of pools on S3-compatible object storage (issue 11) on a 3-node Garage
# cluster (replication factor 3, tests/s3/garage.sh), with real clients (condense serve, fio's
# nbd engine, nbdcopy):
#
#   a. import + export round trip: a ~200 MiB image (random, duplicate, compressible, zero and
#      hole regions) into an S3 pool (durability local); export is byte-identical; stats --json
#      and a listing of the bucket show the objects.
#   b. fio randwrite + verify over NBD (~30 s, rate-limited) with Garage node 2 killed 8 s in:
#      fio ends without an error and verifies; the uploads go on (remote_bytes grows).
#   c. every Garage node stopped while serving, for 45 s (longer than the lease): 96 MiB of writes
#      + flushes through NBD end in bounded time (errors allowed), the server does not crash,
#      stats answers (remote_health shown); after the nodes restart, a
#      new fio write + verify passes within 60 s, the data written before the outage verifies
#      (and what the outage job had acknowledged), remote_health is ok again.
#   d. disaster reopen from the bucket alone: local durability (clean stop, local directory
#      deleted, `connect --credentials FILE` to a fresh one: both volumes export identical; a
#      credentials file of mode 0644 and an endpoint with a password are refused, the password
#      not shown); remote durability, the pool's (issue 23): `connect --durability local`
#      refused; then twice in a row fio + flushes, kill -9 of serve, local directory deleted,
#      a plain `connect` (no --durability) to a fresh one: stats shows remote and every
#      flushed write of both rounds is there; before the second round `durability set` through
#      the control socket switches the running server to local and back to remote; a last
#      `durability set local` is kept across a reconnect. The pool is made with `--index sparse
#      --index-memory 1M`: stats shows that setting after init and after every connect.
#   e. the lease: while a server holds the pool, a second local directory connected to the same
#      bucket prefix cannot write ("held by"); `connect --read-only` beside it exports a volume
#      byte-identical and refuses writes; the writer is unharmed.
#   d3. durability local, kill -9 of serve after writes the bucket has not seen, local directory
#      deleted, `connect` to a fresh one: everything up to the last upload is there, verify clean.
#
#   bash tests/s3/pool.sh                    # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/s3/pool.sh     # KEEP=1 keeps $W when a check failed
#
# Garage: $GARAGE, `garage` on PATH or ~/.cargo/bin/garage (scripts/install-garage.sh, ~10 min
# once per machine). Without it the test skips, except under CI (CI=true), where it installs it
# first. Needs (Debian): fio (nbd engine), libnbd-bin, jq, curl, python3. Prints each step's
# wall time. Ends with "N passed, M failed, K skipped".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
S3_TEST="S3 pools on a 3-node Garage cluster"
# shellcheck source=tests/s3/with-garage.sh
. "$ROOT/tests/s3/with-garage.sh"
need_tools fio nbdcopy nbdinfo jq curl python3 cmp timeout

W=$(mktemp -d /tmp/condense-s3-pool.XXXXXX)
G=$W/garage
free_port PORT
free_port PORT2
URI=nbd://127.0.0.1:$PORT
SERVER_PID=
POOL=
cluster=0
began=$SECONDS
CMD_TIMEOUT=${CMD_TIMEOUT:-300} # no single condense command may take longer
CACHE_SIZE=1G # the least an S3 pool takes (a quarter holds segments not yet uploaded)

cleanup() {
    stop_pids "$SERVER_PID"
    if [ "$cluster" = 1 ]; then "$GARAGE_SH" stop "$G" >/dev/null 2>&1; fi
    remove_work_dir
}
trap cleanup EXIT

# The stats --json keys of an S3 pool.
K_DURABILITY=remote_durability
K_OBJECTS=remote_objects
K_BYTES=remote_bytes
K_PUTS=remote_puts
K_GETS=remote_gets
K_HEALTH=remote_health

# --- helpers ------------------------------------------------------------------------------------
# step NAME: a new step; its wall time is printed when the next one begins (and at the end).
step_names=() step_secs=() step_t=
step() {
    end_step
    step_names+=("$1")
    step_t=$SECONDS
    echo
    echo "=== $1 (at $((SECONDS - began)) s)"
}
end_step() {
    [ -n "$step_t" ] || return 0
    step_secs+=("$((SECONDS - step_t))")
    echo "    [step took $((SECONDS - step_t)) s]"
    step_t=
}
# timed NAME CMD...: check, then its wall time.
timed() {
    local t=$SECONDS
    check "$@"
    echo "    ($((SECONDS - t)) s)"
}
note() { echo "    $*"; }

s3url() { echo "s3://$CONDENSE_S3_BUCKET/$1"; }
# c ARGS...: condense on $POOL (the local directory of the pool), bounded in time.
c() { timeout "$CMD_TIMEOUT" "$CONDENSE" --pool "$POOL" "$@"; }
cond() { timeout "$CMD_TIMEOUT" "$CONDENSE" "$@"; }
# st KEY: one figure of `stats --json` (through the control socket while serving).
st() { c stats --json | jq -r ".$1"; }
# stats_line: the S3 figures of stats --json on one line.
stats_line() {
    c stats --json | jq -r --arg d "$K_DURABILITY" --arg o "$K_OBJECTS" --arg b "$K_BYTES" \
        --arg p "$K_PUTS" --arg g "$K_GETS" --arg h "$K_HEALTH" \
        '"durability \(.[$d]), \(.[$o]) objects, \(.[$b]) bytes, \(.remote_pending_bytes) pending, \(.[$p]) PUTs, \(.[$g]) GETs, health \(.[$h])"'
}
# jq_true FILTER: stats --json satisfies FILTER.
jq_true() { c stats --json | jq -e "$1" >/dev/null; }
health_ok() { jq_true ".$K_HEALTH | tostring | startswith(\"ok\")"; }
# same_export VOLUME FILE [BYTES]: VOLUME of $POOL exports byte-identical to FILE (in its
# first BYTES only, if given).
same_export() {
    rm -f "$W/export.out"
    c export "$1" "$W/export.out" && cmp ${3:+-n "$3"} "$2" "$W/export.out"
    local rc=$?
    rm -f "$W/export.out"
    return $rc
}

# bucket_list PREFIX: "OBJECTS BYTES" of the keys starting with PREFIX (a signed ListObjectsV2 through node 1;
# Garage wants x-amz-content-sha256, a '/' in the query is sent as %2F; pages followed).
bucket_list() {
    python3 - "$1" <<'EOF'
import os, subprocess, sys, urllib.parse, xml.etree.ElementTree as ET
prefix, n, size, token = sys.argv[1], 0, 0, None
env = os.environ
while True:
    q = "list-type=2&prefix=" + urllib.parse.quote(prefix, safe="")
    if token:
        q += "&continuation-token=" + urllib.parse.quote(token, safe="")
    url = "%s/%s?%s" % (env["AWS_ENDPOINT_URL"], env["CONDENSE_S3_BUCKET"], q)
    out = subprocess.run(["curl", "-sSf", "--max-time", "30", "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
                          "--aws-sigv4", "aws:amz:%s:s3" % env["AWS_REGION"],
                          "--user", "%s:%s" % (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]), url],
                         check=True, capture_output=True).stdout
    root = ET.fromstring(out)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    for o in root.iter(ns + "Contents"):
        n += 1
        size += int(o.find(ns + "Size").text)
    t = root.find(ns + "NextContinuationToken")
    if root.findtext(ns + "IsTruncated") != "true" or t is None:
        break
    token = t.text
print(n, size)
EOF
}

# fio_job FILE NAME LINES...: a fio job file for the nbd engine on volume vm (4K direct unless
# a line says otherwise), one job called NAME.
fio_job() {
    local file=$1 name=$2 l
    shift 2
    {
        echo "[global]"
        echo "ioengine=nbd"
        echo "uri=$URI/vm"
        echo "direct=1"
        for l in "$@"; do echo "$l"; done
        echo "[$name]"
    } >"$file"
}
# fio_verify_job FILE NAME LINES...: the job that verifies what `fio_job FILE NAME LINES...`
# wrote (same layout and seed, verify_only; rate limits dropped).
fio_verify_job() {
    local file=$1 name=$2 l keep=()
    shift 2
    for l in "$@"; do
        case $l in rate* | do_verify=*) ;; *) keep+=("$l") ;; esac
    done
    fio_job "$file" "$name" "${keep[@]}" "verify_only=1"
}

# serve_pool: `condense serve` on $POOL, ready once volume vm answers over NBD and the control
# socket is up (an S3 pool's open takes the lease and reads the bucket: up to 60 s allowed).
serve_n=0
serve_pool() {
    serve_n=$((serve_n + 1))
    SERVER_LOG=$W/server-$serve_n.log # one log per serve, kept with KEEP=1
    "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" >"$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
    local t=$SECONDS
    while [ $((SECONDS - t)) -lt 60 ]; do
        if [ -S "$POOL/control.sock" ] && nbdinfo --size "$URI/vm" >/dev/null 2>&1; then return 0; fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then break; fi
        sleep 0.2
    done
    echo "condense serve on $POOL did not come up (after $((SECONDS - t)) s):"
    tail -20 "$SERVER_LOG"
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
    SERVER_PID=
    return 1
}
# stop_pool: SIGTERM, clean close (uploads what is left); fails unless serve exits 0 in 120 s.
stop_pool() {
    local rc
    kill -TERM "$SERVER_PID"
    if ! timeout 120 tail --pid="$SERVER_PID" -f /dev/null; then
        echo "serve still running 120 s after SIGTERM"
        kill -KILL "$SERVER_PID"
    fi
    wait "$SERVER_PID"
    rc=$?
    SERVER_PID=
    cat "$SERVER_LOG"
    [ "$rc" = 0 ]
}
server_alive() { [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; }

# while_held SECS CMD...: run CMD; while it fails with "held by" (a lease left by a killed
# writer, not yet expired), try again every 2 s for up to SECS s. Prints how long it waited.
while_held() {
    local secs=$1 t=$SECONDS rc
    shift
    while :; do
        "$@" >"$W/held.out" 2>&1
        rc=$?
        if [ "$rc" = 0 ] || ! grep -q "held by" "$W/held.out" || [ $((SECONDS - t)) -ge "$secs" ]; then
            cat "$W/held.out"
            echo "(waited $((SECONDS - t)) s for the lease)"
            return "$rc"
        fi
        sleep 2
    done
}

CONDENSE=$(realpath "$CONDENSE")
cd "$W" || exit 1 # fio leaves its verify state files in the working directory

# --- the cluster --------------------------------------------------------------------------------
step "3-node Garage cluster (RF 3)"
mkdir -p "$G"
timed "3-node Garage cluster started" "$GARAGE_SH" start "$G"
if [ "$failed" -gt 0 ]; then
    summary
    exit 1
fi
cluster=1
# shellcheck disable=SC1091
. "$G/credentials.env"
note "bucket $CONDENSE_S3_BUCKET at $AWS_ENDPOINT_URL (nodes: $GARAGE_S3_ENDPOINTS)"

# --- a. import + export round trip ----------------------------------------------------------------
step "a. import + export round trip (durability local)"
IMG=$W/image.raw
{   # 200 MiB: 48 random | 32 zero | the first 32 random again | 16 compressible | 24 random |
    # 8 random shifted by 512 bytes (not block-aligned) | 40 hole (sparse end)
    head -c 48M /dev/urandom >"$W/r1"
    head -c 24M /dev/urandom >"$W/r2"
    cat "$W/r1"
    head -c 32M /dev/zero
    head -c 32M "$W/r1"
    seq 1 3000000 | head -c 16M
    cat "$W/r2"
    head -c 512 /dev/zero
    head -c $((8 * 1048576 - 512)) "$W/r2"
} >"$IMG"
truncate -s 200M "$IMG"
rm -f "$W/r1" "$W/r2"
note "image: $(du -b --apparent-size "$IMG" | cut -f1) bytes apparent, $(du -B1 "$IMG" | cut -f1) allocated"
POOL=$W/a
timed "init $(s3url pool-a) --cache DIR --cache-size $CACHE_SIZE" \
    cond init "$(s3url pool-a)" --cache "$POOL" --cache-size "$CACHE_SIZE"
timed "import the image into the S3 pool" c import "$IMG" --name img
timed "export is byte-identical" same_export img "$IMG"
check "stats --json: durability local" jq_true ".$K_DURABILITY == \"local\""
check "stats --json: $K_OBJECTS > 0" jq_true ".$K_OBJECTS > 0"
# stats opens the pool read-only: it reads the bucket and writes nothing to it (its counters
# are this process's requests).
check "stats --json: $K_GETS > 0, and no PUT or DELETE from a read-only open" \
    jq_true ".$K_GETS > 0 and .$K_PUTS == 0 and .remote_deletes == 0"
check "stats --json: $K_BYTES >= 80 MiB (the unique random data)" jq_true ".$K_BYTES >= 83886080"
note "stats: $(stats_line)"
read -r objs bytes < <(bucket_list pool-a/)
note "bucket listing of pool-a/: ${objs:-?} objects, ${bytes:-?} bytes"
check "the bucket holds the pool's objects (>= 80 MiB under pool-a/)" test "${bytes:-0}" -ge 83886080
timed "verify clean" c verify

# --- b. fio verify over NBD, Garage node 2 killed mid-run ---------------------------------------------
step "b. fio randwrite + verify over NBD, Garage node 2 killed 8 s in"
check "create volume vm (320M)" c volume create vm --size 320M
serve_pool || fail "serve the S3 pool" "$SERVER_LOG"
JOB_B=("rw=randwrite" "bs=64k" "size=160M" "iodepth=8" "rate_iops=85" "fsync=64" "end_fsync=1"
    "verify=crc32c" "verify_fatal=1" "do_verify=1")
fio_job "$W/b.fio" b "${JOB_B[@]}"
fio_verify_job "$W/b-verify.fio" b "${JOB_B[@]}"
bytes_before=$(st "$K_BYTES")
t=$SECONDS
fio --output="$W/fioB.log" "$W/b.fio" >/dev/null 2>&1 &
fio_pid=$!
sleep 8
check "fio still running when node 2 is killed" kill -0 "$fio_pid"
check "kill -9 Garage node 2" "$GARAGE_SH" kill "$G" 2
wait "$fio_pid"
rc=$?
fio_clean() { [ "$1" = 0 ] && ! grep -q 'err= *[1-9]' "$2"; }
check "fio randwrite 160M + verify ended without error, node 2 down ($((SECONDS - t)) s, fio exit $rc)" \
    fio_clean "$rc" "$W/fioB.log"
[ "$rc" = 0 ] || tail -30 "$W/fioB.log" | sed 's/^/    | /'
grep -E '^ +(write|read):' "$W/fioB.log" | sed 's/^/    fio /'
check "serve still running" server_alive
# The sealed segments are uploaded (to two nodes out of three) while node 2 is down.
t=$SECONDS
while [ $((SECONDS - t)) -lt 60 ]; do
    [ "$(st "$K_BYTES")" -ge $((bytes_before + 64 * 1048576)) ] 2>/dev/null && break
    sleep 2
done
bytes_after=$(st "$K_BYTES")
check "uploads went on with node 2 down ($K_BYTES $bytes_before -> $bytes_after, +64 MiB wanted)" \
    test "${bytes_after:-0}" -ge $((bytes_before + 64 * 1048576))
note "stats (live): $(stats_line)"
timed "restart Garage node 2" "$GARAGE_SH" restart "$G" 2
timed "b's data verifies after node 2 is back" fio --output="$W/fioBv.log" "$W/b-verify.fio"

# --- c. every node stopped, then restarted -------------------------------------------------------
step "c. every Garage node stopped while serving, then restarted"
# Longer than the lease (30 s): the writer must take its own expired lease back afterwards.
OUTAGE_SECS=${OUTAGE_SECS:-45}
# 96 MiB with a flush every 16 writes: more than a 64 MiB segment, so one is sealed and its
# upload fails until the store is back.
JOB_C=("rw=randwrite" "bs=64k" "offset=160M" "size=96M" "iodepth=4" "fsync=16" "end_fsync=1"
    "verify=crc32c" "do_verify=0")
JOB_D=("rw=randwrite" "bs=4k" "offset=272M" "size=16M" "iodepth=8" "end_fsync=1"
    "verify=crc32c" "verify_fatal=1" "do_verify=1")
fio_job "$W/c.fio" c "${JOB_C[@]}"
fio_verify_job "$W/c-verify.fio" c "${JOB_C[@]}"
fio_job "$W/d.fio" d "${JOB_D[@]}"
outage=$SECONDS
timed "stop every Garage node" "$GARAGE_SH" stop "$G"
t=$SECONDS
timeout 90 fio --output="$W/fioC.log" "$W/c.fio" >/dev/null 2>&1
rc_c=$?
note "writes + flushes during the outage: fio exit $rc_c after $((SECONDS - t)) s"
grep -E '^ +write:|err=' "$W/fioC.log" | sed 's/^/    fio /'
check "writes + flushes during the outage end in bounded time (< 90 s)" test "$rc_c" != 124
check "serve still running during the outage" server_alive
timed "stats answers during the outage" c stats --json
note "health during the outage: $(jq -r ".$K_HEALTH" "$W/out" 2>/dev/null)"
while [ $((SECONDS - outage)) -lt "$OUTAGE_SECS" ]; do sleep 1; done
check "serve still running after $((SECONDS - outage)) s of outage" server_alive
timed "restart every Garage node" "$GARAGE_SH" restart "$G"
t=$SECONDS
ok_d=1
while :; do
    timeout 60 fio --output="$W/fioD.log" "$W/d.fio" >/dev/null 2>&1 && { ok_d=0; break; }
    [ $((SECONDS - t)) -ge 60 ] && break
    sleep 3
done
check "a new fio write + verify passes within 60 s of the restart ($((SECONDS - t)) s)" test "$ok_d" = 0
[ "$ok_d" = 0 ] || tail -20 "$W/fioD.log" | sed 's/^/    | /'
timed "data written before the outage verifies" fio --output="$W/fioBv2.log" "$W/b-verify.fio"
if [ "$rc_c" = 0 ]; then
    timed "writes acknowledged during the outage verify" fio --output="$W/fioCv.log" "$W/c-verify.fio"
else
    note "(the outage job failed, exit $rc_c: its writes are not checked)"
fi
t=$SECONDS
while [ $((SECONDS - t)) -lt 60 ]; do
    st "$K_HEALTH" 2>/dev/null | grep -q '^ok' && break
    sleep 2
done
check "$K_HEALTH ok again ($((SECONDS - t)) s after the checks above)" health_ok
note "stats (live): $(stats_line)"
note "the end of serve's log:"
tail -5 "$SERVER_LOG" | cut -c1-400 | sed 's/^/    | /'

# --- d. disaster reopen from the bucket alone -------------------------------------------------------
step "d1. disaster reopen, durability local: clean stop, local directory deleted"
timed "vm read whole over NBD" nbdcopy "$URI/vm" "$W/vm-before.raw"
f0=$failed
timed "clean stop of serve (exit 0)" stop_pool
if [ "$failed" -gt "$f0" ]; then
    # Its local directory may hold what the bucket lacks: reopen it, as the error says, and
    # stop again, so that the steps below test what they are about.
    note "(the clean stop failed: reopening the pool and stopping it again before the local directory goes)"
    serve_pool || fail "serve pool-a again after the failed stop" "$SERVER_LOG"
    timed "clean stop of serve after the reopen (exit 0)" stop_pool
fi
rm -rf "$W/a"
POOL=$W/a2
# Credentials from a file only (not from the environment) for this connect.
timed "connect --credentials FILE to a fresh directory" \
    env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_ENDPOINT_URL -u AWS_REGION -u AWS_ALLOW_HTTP \
    timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$(s3url pool-a)" --credentials "$G/credentials.env" \
    --cache "$POOL" --cache-size "$CACHE_SIZE"
# Secrets: a credentials file others can read, and a password in the endpoint URL.
cp "$G/credentials.env" "$W/creds-0644"
chmod 644 "$W/creds-0644"
refuse "connect --credentials FILE of mode 0644 is refused with the chmod fix" "chmod 600" \
    env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY \
    timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$(s3url pool-a)" --credentials "$W/creds-0644" \
    --cache "$W/x1" --cache-size "$CACHE_SIZE"
check "... and leaves no local directory" test ! -e "$W/x1"
refuse "connect --endpoint with USER:PASSWORD@ is refused, pointing to --credentials" "credentials" \
    cond connect "$(s3url pool-a)" --endpoint "http://$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY@${AWS_ENDPOINT_URL#http://}" \
    --cache "$W/x2" --cache-size "$CACHE_SIZE"
cp "$W/out" "$W/endpoint.out"
no_password() { grep -q '\*\*\*@' "$W/endpoint.out" && ! grep -qF "$AWS_SECRET_ACCESS_KEY" "$W/endpoint.out"; }
check "... without showing the password (the URL shown with ***@)" no_password
timed "after the reopen: vm exports identical" same_export vm "$W/vm-before.raw"
timed "after the reopen: img exports identical" same_export img "$IMG"

step "d2. durability remote, the pool's: two lost local directories in a row, plain connects"
POOL=$W/b
timed "init $(s3url pool-b) --durability remote --index sparse --index-memory 1M" \
    cond init "$(s3url pool-b)" --cache "$POOL" --cache-size "$CACHE_SIZE" --durability remote \
    --index sparse --index-memory 1M
# sparse_1m: stats says the sparse dedup index of init, with its 1 MiB budget.
sparse_1m() { jq_true '.dedup_index_mode == "sparse" and .dedup_index_budget_bytes == 1048576'; }
check "stats --json: the sparse index of init, 1 MiB" sparse_1m
check "create volume vm (64M)" c volume create vm --size 64M
check "create volume known (64M)" c volume create known --size 64M
serve_pool || fail "serve the remote-durability pool" "$SERVER_LOG"
check "stats --json: durability remote" jq_true ".$K_DURABILITY == \"remote\""
JOB_E=("rw=randwrite" "bs=4k" "size=16M" "iodepth=8" "fsync=64" "end_fsync=1" "verify=crc32c" "do_verify=0")
JOB_E2=("rw=randwrite" "bs=4k" "offset=16M" "size=16M" "iodepth=8" "fsync=64" "end_fsync=1" "verify=crc32c" "do_verify=0")
fio_job "$W/e.fio" e "${JOB_E[@]}"
fio_verify_job "$W/e-verify.fio" e "${JOB_E[@]}"
fio_job "$W/e2.fio" e2 "${JOB_E2[@]}"
fio_verify_job "$W/e2-verify.fio" e2 "${JOB_E2[@]}"
timed "fio randwrite 16M, a flush every 64 writes, over NBD" fio --output="$W/fioE.log" "$W/e.fio"
grep -E '^ +(write|sync):|^ +(sync|fsync)' "$W/fioE.log" | head -3 | sed 's/^/    fio /'
{ head -c 24M /dev/urandom; head -c 8M /dev/zero; seq 1 2000000 | head -c 8M; } >"$W/known.raw"
timed "nbdcopy --flush a 40 MiB file into volume known" nbdcopy --flush "$W/known.raw" "$URI/known"
note "stats (live): $(stats_line)"
check "kill -9 serve" kill9_server
rm -rf "$POOL"
refuse "connect --durability local to the remote pool is refused, naming durability set" "durability set local" \
    cond connect "$(s3url pool-b)" --cache "$W/bx" --cache-size "$CACHE_SIZE" --durability local
# plain_connect DIR: the documented disaster reopen, no --durability (waits out the dead
# writer's lease), then stats (a read-only open) must show the pool's durability.
plain_connect() {
    POOL=$1
    timed "plain connect to a fresh directory $(basename "$1")" \
        while_held 60 timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$(s3url pool-b)" \
        --cache "$POOL" --cache-size "$CACHE_SIZE"
    check "stats after the plain connect: durability $2" jq_true ".$K_DURABILITY == \"$2\""
    check "... and the sparse index of init, 1 MiB (kept in the bucket)" sparse_1m
}
# serve_b: serve the reconnected pool (its open may wait out the lease too).
serve_b() {
    local t=$SECONDS
    served=1
    while :; do
        serve_pool >"$W/serve-b.out" 2>&1 && { served=0; break; }
        if ! grep -q "held by" "$W/serve-b.out" || [ $((SECONDS - t)) -ge 60 ]; then break; fi
        sleep 2
    done
    check "serve the reconnected pool ($((SECONDS - t)) s)" test "$served" = 0
    [ "$served" = 0 ] || sed 's/^/    | /' "$W/serve-b.out"
}
known_there() { nbdcopy "$URI/known" "$W/known.out" && cmp -n $((40 * 1048576)) "$W/known.raw" "$W/known.out"; }
plain_connect "$W/b2" remote
serve_b
if [ "$served" = 0 ]; then
    timed "every flushed fio write is there" fio --output="$W/fioEv.log" "$W/e-verify.fio"
    timed "the nbdcopy --flush file is there" known_there
    rm -f "$W/known.out"
    # The change command, through the control socket of the running server: to local and
    # back. The writes below survive the next loss only if `set remote` applies at once.
    # said PATTERN: the last check's output matched PATTERN.
    said() { grep -q -- "$1" "$W/said.out"; }
    shows() { c durability show | grep -q "^$1:"; }
    check "durability set local through the control socket" c durability set local
    cp "$W/out" "$W/said.out"
    check "... says what it changed (remote -> local)" said "remote -> local"
    check "stats (live): durability local" jq_true ".$K_DURABILITY == \"local\""
    check "durability set remote through the control socket" c durability set remote
    cp "$W/out" "$W/said.out"
    check "... says it is in effect in the running server" said "local -> remote.*in effect now in the running server"
    check "durability show: remote" shows remote
    timed "fio randwrite 16M more, a flush every 64 writes" fio --output="$W/fioE2.log" "$W/e2.fio"
    check "kill -9 serve (second loss)" kill9_server
    rm -rf "$POOL"
    plain_connect "$W/b3" remote
    serve_b
fi
if [ "$served" = 0 ]; then
    timed "after two losses: round 1's flushed writes are there" fio --output="$W/fioEv2.log" "$W/e-verify.fio"
    timed "after two losses: round 2's flushed writes are there" fio --output="$W/fioE2v.log" "$W/e2-verify.fio"
    timed "after two losses: the nbdcopy --flush file is there" known_there
    rm -f "$W/known.out"
    check "durability set local, kept across the next reconnect" c durability set local
    timed "clean stop of serve (exit 0)" stop_pool
    rm -rf "$POOL"
    plain_connect "$W/b4" local
fi
timed "verify clean" c verify

# --- e. the lease ----------------------------------------------------------------------------------------
step "e. the lease: a second writer refused, a reader beside the writer"
POOL=$W/a2
serve_pool || fail "serve pool-a again (the writer)" "$SERVER_LOG"
head -c 1M /dev/urandom >"$W/small.raw"
# second_writer DIR: connect DIR to pool-a and import into it (either may be the refusal).
a3_connected=0
second_writer() {
    timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$(s3url pool-a)" --cache "$1" --cache-size "$CACHE_SIZE" || return
    a3_connected=1
    timeout "$CMD_TIMEOUT" "$CONDENSE" --pool "$1" import "$W/small.raw" --name intruder
}
refuse "a second writer is refused while serve holds the pool" "held by" second_writer "$W/a3"
no_intruder() { ! c volume list | grep -qw intruder; }
check "the writer has no volume 'intruder'" no_intruder
if [ "$a3_connected" = 1 ]; then # connect itself did not refuse: serve must
    refuse "serve on the second directory is refused too" "held by" \
        timeout 60 "$CONDENSE" --pool "$W/a3" serve --insecure-listen "127.0.0.1:$PORT2"
fi
timed "connect --read-only beside the writer" \
    cond connect "$(s3url pool-a)" --cache "$W/a4" --cache-size "$CACHE_SIZE" --read-only
POOL=$W/a4 timed "the reader exports img identical" same_export img "$IMG"
refuse "the reader refuses to write" "read.only" cond --pool "$W/a4" volume create y --size 1M
check "the writer still writes + verifies over NBD" fio --output="$W/fioD2.log" "$W/d.fio"
check "the writer's $K_HEALTH is ok" health_ok
note "stats (live): $(stats_line)"
timed "clean stop of serve (exit 0)" stop_pool

step "d3. disaster reopen, durability local, after kill -9: everything up to the last upload"
serve_pool || fail "serve pool-a again" "$SERVER_LOG"
JOB_F=("rw=randwrite" "bs=4k" "offset=288M" "size=16M" "iodepth=8" "end_fsync=1" "verify=crc32c" "do_verify=0")
fio_job "$W/f.fio" f "${JOB_F[@]}"
check "fio randwrite 16M + flush over NBD (in the local journal only)" fio --output="$W/fioF.log" "$W/f.fio"
check "kill -9 serve" kill9_server
rm -rf "$POOL"
POOL=$W/a5
timed "connect to a fresh directory (waits out the dead writer's lease)" \
    while_held 60 timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$(s3url pool-a)" \
    --cache "$POOL" --cache-size "$CACHE_SIZE"
timed "img exports identical" same_export img "$IMG"
timed "vm exports as uploaded at the last clean stop (its first 272 MiB)" same_export vm "$W/vm-before.raw" $((272 * 1048576))
timed "verify clean (pool-a)" c verify

end_step
echo
echo "step timings:"
for i in "${!step_names[@]}"; do printf '  %4d s  %s\n' "${step_secs[$i]}" "${step_names[$i]}"; done
echo "wall time: $((SECONDS - began)) s"
read -r objs bytes < <(bucket_list "")
echo "bucket at the end: ${objs:-?} objects, ${bytes:-?} bytes"
timed "cluster stopped" "$GARAGE_SH" stop "$G"
cluster=0
summary
