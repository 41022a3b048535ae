#!/usr/bin/env bash
# Many hosts on one pool in a bucket (issue 25), on the 3-node Garage cluster
# (tests/s3/garage.sh), with real processes: each "host" is its own local directory and
# `condense` processes.
#
#   a. two hosts racing to open one pool writable, $POOL_ROUNDS rounds (default 20): both start a
#      writable command (`volume create`) at the same instant; exactly one wins each round, the
#      other is refused ("held by"), and no object in the bucket is ever replaced: a signed
#      ListObjectsV2 before and after each round, every key present in both with the same ETag.
#      Rounds the claim rule decided (both claims put at once) are counted apart from rounds
#      where the loser saw the winner's claim first.
#   b. a host serving the pool (NBD) keeps a second host out; killed with kill -9, it is
#      replaced by that host once its lease expired (30 s); a third host then exports what both
#      wrote byte-identical and verifies the pool clean.
#
#   c. hosts sharing one pool (`connect --join`): host A imports five images and host B the
#      other five at the same time (a common base and a part of their own each); after
#      `hosts sync` and `gc` the bucket holds at most 1.02x what one host importing all ten
#      stores; a segment host B's GC emptied stays until host A let it go, then is deleted;
#      a third host reads B's volume through B's part byte-identical (its base blocks are
#      A's records) and `verify` is clean on every host.
#
#   c2. three hosts sharing a pool with a sparse dedup index of 32 MiB (`init --index sparse`):
#      the joining hosts take the setting; after their imports at the same time, syncs,
#      `index merge` and gc, the bucket holds at most 1.02x what one host stores; verify clean.
#
#   d. host A's golden snapshot cloned on host C (`volume clone --from-host`, no data copied)
#      and read over NBD byte-identical; a volume moved from A to B (`volume move`, `volume
#      adopt`) while fio writes through A's NBD server: A refuses the writes after the
#      hand-over, fio reconnected to B verifies every write it saw complete, A deletes its copy;
#      verify clean on every host.
#
#   e. hosts A and B, both serving, race to make one volume (`volume create` through each
#      one's control socket at the same instant), $ROUNDS rounds (default 100): exactly one
#      wins each round (volume claims), the other is refused ("is held by host"), no object in
#      the bucket is ever replaced (ETags before and after each round), and each name is in
#      exactly one host's part.
#   f. GC on host A (a new generation of its volume imported, the one before last deleted,
#      `gc`, `hosts sync`) while host B imports and collects too and host C clones A's newest
#      generation and reads it back, all at once for $GC_SECONDS s (default 120): no clone
#      ever reads wrong, every clone reads back byte-identical at the end, verify clean on
#      every host.
#   g. host B serving a volume under durability `remote` killed with kill -9 after a flushed
#      copy into it: host C takes it over in one step (`volume adopt --take-over`) once B's
#      lease expired, with every byte B flushed; B, back, deletes its copy.
#
#   h. hand-overs killed half way, and a host gone for good: host A hands a volume to C,
#      whose `volume adopt` is killed (kill -9) at several moments and finished by `hosts sync`;
#      host B, serving, is killed for good while A's condemned segments wait for it; `hosts
#      forget` is refused while B's lease is alive, then forgets it: A's condemned segments
#      are deleted (bytes back, from the bucket listing); C adopts B's volume (no hand-over),
#      killed at several moments and run again, ending with one owner; `hosts forget
#      --reclaim` deletes B's segments no host names (bytes back); C reads its volumes back
#      byte-identical and verify is clean.
#
#   bash tests/s3/cluster.sh                 # builds target/release/condense first
#   ROUNDS=20 POOL_ROUNDS=5 GC_SECONDS=30 CONDENSE=/path/to/condense bash tests/s3/cluster.sh
#   PARTS=h bash tests/s3/cluster.sh         # part h alone (its own pool; a to g share theirs)
#   (KEEP=1 keeps $W on failure)
#
# Garage as in tests/s3/pool.sh (installed by scripts/install-garage.sh under CI). Needs curl,
# python3, jq, nbdinfo and nbdcopy (libnbd-bin), qemu-io (qemu-utils), fio. Ends with "N passed, M failed, K skipped".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
S3_TEST="many hosts on one pool, 3-node Garage cluster"
# shellcheck source=tests/s3/with-garage.sh
. "$ROOT/tests/s3/with-garage.sh"
need_tools curl python3 jq timeout cmp nbdinfo nbdcopy qemu-io fio /usr/bin/time

W=$(mktemp -d /tmp/condense-s3-cluster.XXXXXX)
G=$W/garage
ROUNDS=${ROUNDS:-100}
POOL_ROUNDS=${POOL_ROUNDS:-20}
GC_SECONDS=${GC_SECONDS:-120}
CACHE_SIZE=1G
CMD_TIMEOUT=${CMD_TIMEOUT:-120}
cluster=0
began=$SECONDS
PIDS=()

cleanup() {
    stop_pids "${PIDS[@]}"
    if [ "$cluster" = 1 ]; then "$GARAGE_SH" stop "$G" >/dev/null 2>&1; fi
    remove_work_dir
}
trap cleanup EXIT

note() { echo "    $*"; }
step() { echo; echo "=== $1 (at $((SECONDS - began)) s)"; }
s3url() { echo "s3://$CONDENSE_S3_BUCKET/$1"; }
# Each host's processes run with their own host name (a UTS namespace: root), so a claim of
# host A is another host's to B, as on real hypervisors (its pid cannot be checked: only the
# lease expiry frees it).
if unshare --uts true 2>/dev/null; then
    OWN_NAMES=1
else
    OWN_NAMES=0
fi
# as_host HOST CMD...: CMD with host name cluster-HOST (if UTS namespaces are available).
as_host() {
    local host=$1
    shift
    if [ "$OWN_NAMES" = 1 ]; then
        unshare --uts sh -c 'hostname "$0" && exec "$@"' "cluster-$host" "$@"
    else
        "$@"
    fi
}
# h HOST ARGS...: condense on host HOST's local directory, as that host, bounded in time.
h() {
    local host=$1
    shift
    as_host "$host" timeout "$CMD_TIMEOUT" "$CONDENSE" --pool "$W/$host" "$@"
}

# bucket_list PREFIX: "KEY ETAG SIZE" lines of every key under PREFIX, sorted (signed
# ListObjectsV2 through node 1, pages followed).
bucket_list() {
    python3 - "$1" <<'PY'
import os, subprocess, sys, urllib.parse, xml.etree.ElementTree as ET
prefix, token, out = sys.argv[1], None, []
env = os.environ
while True:
    q = "list-type=2&prefix=" + urllib.parse.quote(prefix, safe="")
    if token:
        q += "&continuation-token=" + urllib.parse.quote(token, safe="")
    url = "%s/%s?%s" % (env["AWS_ENDPOINT_URL"], env["CONDENSE_S3_BUCKET"], q)
    body = subprocess.run(["curl", "-sSf", "--max-time", "30", "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
                           "--aws-sigv4", "aws:amz:%s:s3" % env["AWS_REGION"],
                           "--user", "%s:%s" % (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]), url],
                          check=True, capture_output=True).stdout
    root = ET.fromstring(body)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    for o in root.iter(ns + "Contents"):
        out.append("%s %s %s" % (o.findtext(ns + "Key"), o.findtext(ns + "ETag").strip('"'), o.findtext(ns + "Size")))
    t = root.find(ns + "NextContinuationToken")
    if root.findtext(ns + "IsTruncated") != "true" or t is None:
        break
    token = t.text
print("\n".join(sorted(out)))
PY
}

# bucket_etags PREFIX: "KEY ETAG" lines; bytes_under PREFIX: the bytes of its keys.
bucket_etags() { bucket_list "$1" | cut -d' ' -f1,2; }
bytes_under() { bucket_list "$1" | awk '{ s += $3 } END { print s + 0 }'; }

# replaced BEFORE AFTER: the keys in both listings whose ETag changed (none expected).
replaced() { join "$1" "$2" | awk '$2 != $3 { print $1 }'; }

# race HOST_A HOST_B NAME ROUNDS BUCKET_PREFIX HELD RULED: ROUNDS rounds in which both hosts
# run `volume create NAME$r` at the same instant. Counts wins_a, wins_b, bad_rounds (not
# exactly one winner whose loser says HELD), ruled (the loser says RULED: both claims were
# put), seen (the other losers) and replaced_keys (ETags changed under BUCKET_PREFIX, listed
# before and after each round).
race() {
    local ha=$1 hb=$2 name=$3 rounds=$4 prefix=$5 held=$6 rule=$7 r pa pb ra rb n loser
    bad_rounds=0 ruled=0 seen=0 wins_a=0 wins_b=0 replaced_keys=0
    for r in $(seq 1 "$rounds"); do
        bucket_etags "$prefix" >"$W/before"
        h "$ha" volume create "$name$r" --size 1M >"$W/outA" 2>&1 &
        pa=$!
        h "$hb" volume create "$name$r" --size 1M >"$W/outB" 2>&1 &
        pb=$!
        wait "$pa"
        ra=$?
        wait "$pb"
        rb=$?
        bucket_etags "$prefix" >"$W/after"
        n=$(replaced "$W/before" "$W/after" | wc -l)
        replaced_keys=$((replaced_keys + n))
        if [ "$n" -gt 0 ]; then
            echo "round $r: replaced objects:"
            replaced "$W/before" "$W/after" | sed 's/^/      /'
        fi
        if [ "$ra" = 0 ] && [ "$rb" != 0 ] && grep -q "$held" "$W/outB"; then
            wins_a=$((wins_a + 1)) loser=$W/outB
        elif [ "$rb" = 0 ] && [ "$ra" != 0 ] && grep -q "$held" "$W/outA"; then
            wins_b=$((wins_b + 1)) loser=$W/outA
        else
            bad_rounds=$((bad_rounds + 1)) loser=
            echo "round $r: A exit $ra, B exit $rb"
            sed 's/^/      A: /' "$W/outA" | tail -3
            sed 's/^/      B: /' "$W/outB" | tail -3
        fi
        if [ -n "$loser" ]; then
            if grep -q "$rule" "$loser"; then ruled=$((ruled + 1)); else seen=$((seen + 1)); fi
        fi
    done
}

# nbd_up PORT EXPORT: the export answers within 60 s.
nbd_up() {
    for _ in $(seq 1 60); do
        nbdinfo "nbd://127.0.0.1:$1/$2" >/dev/null 2>&1 && return 0
        sleep 1
    done
    return 1
}
# serve_host HOST PORTVAR: serve HOST's part in the background (as that host); its pid in $served_pid.
serve_host() {
    local host=$1 port
    free_port port
    printf -v "$2" '%s' "$port"
    if [ "$OWN_NAMES" = 1 ]; then
        unshare --uts sh -c 'hostname "$0" && exec "$@"' "cluster-$host" \
            "$CONDENSE" --pool "$W/$host" serve --insecure-listen "127.0.0.1:$port" >"$W/serve$host.log" 2>&1 &
    else
        "$CONDENSE" --pool "$W/$host" serve --insecure-listen "127.0.0.1:$port" >"$W/serve$host.log" 2>&1 &
    fi
    served_pid=$!
    PIDS+=("$served_pid")
}
# same_on HOST VOL: HOST exports VOL byte-identical to $W/VOL.raw.
same_on() {
    rm -f "$W/h.out"
    h "$1" export "$2" "$W/h.out" >/dev/null && cmp "$W/$2.raw" "$W/h.out"
}
# kill_adopts HOST VOL FROM N: `volume adopt VOL --from-host FROM` on HOST killed (kill -9)
# up to N times, each 0.15 s later into the command than the one before (from 1.5 s), until
# one finishes before its kill; notes what each kill left (the hand-overs `hosts` names once
# the volume exists) and counts the kills that left it half made.
kill_adopts() {
    local host=$1 vol=$2 from=$3 n=$4 i t left
    for i in $(seq 0 $((n - 1))); do
        t=$(python3 -c "print(round(1.5 + 0.15 * $i, 2))")
        if as_host "$host" timeout -s KILL "$t" "$CONDENSE" --pool "$W/$host" volume adopt "$vol" --from-host "$from" >/dev/null 2>&1; then
            note "adopt of $vol finished within $t s: no more kills"
            return
        fi
        if ! h "$host" volume list --json | jq -e --arg v "$vol" 'map(.name) | index($v) != null' >/dev/null; then
            note "adopt of $vol killed after $t s: nothing made yet"
            continue
        fi
        left=$(h "$host" hosts --json | jq -c '[.hosts[] | select(.this_host) | .hand_overs[]]')
        note "adopt of $vol killed after $t s: $left"
        if grep -q "half made" <<<"$left"; then half_made=$((half_made + 1)); fi
    done
}
half_made=0

# Part h (see the header): a pool of its own, hosts HA, HB and HC.
part_h() {
    step "h. hand-overs killed half way; a host gone for good, forgotten, its space back"
    local url k t out
    url=$(s3url forget)
    check "init on host HA" timeout "$CMD_TIMEOUT" "$CONDENSE" init "$url" --cache "$W/HA" --cache-size "$CACHE_SIZE"
    for host in HB HC; do
        check "host $host joins" as_host "$host" timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$url" --join --host "cluster-$host" --cache "$W/$host" --cache-size "$CACHE_SIZE"
    done
    for k in fa1 scratch fb1 fb2; do head -c 6M /dev/urandom >"$W/$k.raw"; done
    check "host HA imports fa1 and scratch" sh -c "'$CONDENSE' --pool '$W/HA' import '$W/fa1.raw' --name fa1 && '$CONDENSE' --pool '$W/HA' import '$W/scratch.raw' --name scratch"
    check "host HB imports fb1" h HB import "$W/fb1.raw" --name fb1
    check "host HB imports fb2" h HB import "$W/fb2.raw" --name fb2
    for host in HB HC HA; do h "$host" hosts sync >/dev/null; done

    # A move whose adopt is killed half way, at several moments: finished by `hosts sync`.
    check "host HA hands fa1 to HC" h HA volume move fa1 --to cluster-HC
    kill_adopts HC fa1 first-host 16
    h HC hosts sync --json >"$W/h-sync.json"
    note "the sync on HC: finished $(jq -c '.hand_overs_finished' "$W/h-sync.json"), unfinished $(jq -c '.hand_overs_unfinished' "$W/h-sync.json")"
    adopted_fa1() { h HC volume list --json | jq -e 'map(.name) | index("fa1") != null' >/dev/null || h HC volume adopt fa1 --from-host first-host >/dev/null; }
    check "fa1 is adopted on HC (finished by the sync, or by the adopt run again)" adopted_fa1
    h HC hosts sync >/dev/null
    h HA hosts sync >/dev/null
    check "HA deleted its copy of fa1: one owner" sh -c "'$CONDENSE' --pool '$W/HA' volume list --json | jq -e 'map(.name) | index(\"fa1\") == null' >/dev/null"
    check "HC names no unfinished hand-over" sh -c "'$CONDENSE' --pool '$W/HC' hosts --json | jq -e '[.hosts[] | select(.this_host) | .hand_overs[]] == []' >/dev/null"
    check "HC exports fa1 byte-identical" same_on HC fa1

    # Condemned segments of HA that wait for HB.
    check "host HA deletes scratch and collects" sh -c "'$CONDENSE' --pool '$W/HA' volume delete scratch && '$CONDENSE' --pool '$W/HA' gc >/dev/null"
    h HA hosts sync --json >"$W/h-sync.json"
    h HC hosts sync >/dev/null
    h HA hosts sync --json >"$W/h-sync.json"
    local condemned a_before a_after b_before b_after
    condemned=$(jq '.segments_condemned' "$W/h-sync.json")
    check "HA's emptied segments are condemned, waiting for HB ($condemned)" test "$condemned" -gt 0

    # HB serving, killed for good.
    serve_host HB PH_B
    local ph_b=$served_pid
    check "host HB serves (fb1)" nbd_up "$PH_B" fb1
    kill -9 "$ph_b"
    wait "$ph_b" 2>/dev/null
    check "HA's condemned segments still wait for the dead HB" sh -c "'$CONDENSE' --pool '$W/HA' hosts sync --json | jq -e '.segments_deleted == 0 and .segments_condemned > 0' >/dev/null"
    # A's part: its segments (the keys of forget/ outside hosts/, members/ and volumes/).
    a_segs() { bucket_list forget/ | awk '$1 !~ "^forget/(hosts|members|volumes)/" && $1 ~ /seg-/ { s += $3 } END { print s + 0 }'; }
    b_segs() { bucket_list forget/hosts/01/ | awk '$1 ~ /seg-/ { s += $3 } END { print s + 0 }'; }
    a_before=$(a_segs)
    refuse "hosts forget is refused while HB's lease is alive" "lease" h HA hosts forget cluster-HB
    forget_b() {
        for _ in $(seq 1 45); do
            if h HA hosts forget cluster-HB --json >"$W/forget.json" 2>"$W/forget.err"; then return 0; fi
            grep -q "lease" "$W/forget.err" || { cat "$W/forget.err"; return 1; }
            sleep 2
        done
        return 1
    }
    check "hosts forget cluster-HB once its lease expired" forget_b
    note "forget: $(jq -c '{host, volumes, sync}' "$W/forget.json")"
    a_after=$(a_segs)
    check "HA's condemned segments are deleted at once (none left waiting)" jq -e '.sync.segments_deleted > 0 and .sync.segments_condemned == 0' "$W/forget.json"
    note "space back on HA's part: $((a_before - a_after)) bytes of segments ($a_before -> $a_after)"
    check "HA's part holds fewer segment bytes after the forget" test "$a_after" -lt "$a_before"
    check "hosts on HC shows HB forgotten" sh -c "'$CONDENSE' --pool '$W/HC' hosts sync >/dev/null; '$CONDENSE' --pool '$W/HC' hosts --json | jq -e '.hosts[] | select(.host == \"cluster-HB\") | .forgotten == \"forgotten\"' >/dev/null"

    # HB's volume adopted on HC without a hand-over, killed at several moments, run again.
    kill_adopts HC fb1 cluster-HB 16
    check "the adopt of fb1 run again finishes" h HC volume adopt fb1 --from-host cluster-HB
    check "HC exports fb1 byte-identical" same_on HC fb1
    check "HC names no unfinished hand-over" sh -c "'$CONDENSE' --pool '$W/HC' hosts --json | jq -e '[.hosts[] | select(.this_host) | .hand_overs[]] == []' >/dev/null"
    local hex winner
    hex=$(printf fb1 | od -An -tx1 | tr -d ' \n')
    note "claims of fb1: $(bucket_list "forget/volumes/$hex/" | awk '{ print $1 }' | sed 's|.*/||' | tr '\n' ' ')"
    # The claim rule: the highest turn, then the lowest slot (TTTTTTTT-SS-WRITER).
    winner=$(bucket_list "forget/volumes/$hex/" | awk '{ print $1 }' | sed 's|.*/||' | sort -t- -k1,1r -k2,2 | head -1 | cut -d- -f2)
    check "one owner: the winning claim of fb1 is HC's (slot 02, a turn above HB's)" test "$winner" = 02
    check "no name held twice (HC's sync)" sh -c "'$CONDENSE' --pool '$W/HC' hosts sync --json | jq -e '.name_conflicts == []' >/dev/null"

    # Reclaim: HB's segments no host names are deleted (fb2 given up, fb1's kept).
    b_before=$(b_segs)
    check "hosts forget cluster-HB --reclaim on HA" sh -c "'$CONDENSE' --pool '$W/HA' hosts forget cluster-HB --reclaim --json >'$W/reclaim.json'"
    note "reclaim right after the forget: $(jq -c '.sync | {reclaimed_segments, reclaimed_bytes, reclaim_waiting}' "$W/reclaim.json")"
    h HC hosts sync >/dev/null # acknowledges
    h HA hosts sync --json >"$W/h-sync.json"
    note "HA's sync: $(jq -c '{reclaimed_segments, reclaimed_bytes, reclaim_waiting}' "$W/h-sync.json")"
    b_after=$(b_segs)
    check "HB's unnamed segments are deleted ($(jq '.reclaimed_segments' "$W/h-sync.json") segments)" jq -e '.reclaimed_segments > 0' "$W/h-sync.json"
    note "space back from HB's part: $((b_before - b_after)) bytes of segments ($b_before -> $b_after)"
    check "HB's part holds fewer segment bytes after the reclaim" test "$b_after" -lt "$b_before"
    check "fb1 on HC still byte-identical (its records in HB's part are kept)" same_on HC fb1
    check "fa1 on HC still byte-identical" same_on HC fa1
    for host in HA HC; do check "verify clean on $host" h "$host" verify; done
    note "kills that left a half-made adopt (finished afterwards): $half_made"
    check "at least one kill left an adopt half made (the window was hit)" test "$half_made" -gt 0
    rm -f "$W"/fa1.raw "$W"/scratch.raw "$W"/fb1.raw "$W"/fb2.raw "$W/h.out"
}

CONDENSE=$(realpath "$CONDENSE")
cd "$W" || exit 1

step "3-node Garage cluster (RF 3)"
mkdir -p "$G"
check "3-node Garage cluster started" "$GARAGE_SH" start "$G"
if [ "$failed" -gt 0 ]; then
    summary
    exit 1
fi
cluster=1
# shellcheck disable=SC1091
. "$G/credentials.env"
POOL_URL=$(s3url shared)
if [ "${PARTS:-}" = h ]; then
    part_h
    echo
    echo "wall time: $((SECONDS - began)) s"
    check "cluster stopped" "$GARAGE_SH" stop "$G"
    cluster=0
    summary
    exit
fi

step "setup: host A makes the pool, hosts B and C connect"
check "init on host A" timeout "$CMD_TIMEOUT" "$CONDENSE" init "$POOL_URL" --cache "$W/A" --cache-size "$CACHE_SIZE"
head -c 8M /dev/urandom >"$W/base.raw"
check "host A imports an 8 MiB image" h A import "$W/base.raw" --name base
for host in B C; do
    check "connect host $host" timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$POOL_URL" --cache "$W/$host" --cache-size "$CACHE_SIZE"
done

step "a. two hosts race to open the pool writable, $POOL_ROUNDS rounds"
PREFIX=shared/
t_race=$SECONDS
race A B r "$POOL_ROUNDS" "$PREFIX" "held by" "claimed the pool at once"
note "$POOL_ROUNDS rounds in $((SECONDS - t_race)) s: A won $wins_a, B won $wins_b; decided by the claim rule (both claimed at once) $ruled, loser saw the winner's claim first $seen"
check "exactly one winner in each of $POOL_ROUNDS rounds" test "$bad_rounds" = 0
check "the claim rule decided rounds (both hosts had claimed: the race is real)" test "$ruled" -gt 0
if [ "$POOL_ROUNDS" -ge 20 ]; then
    check "both hosts won rounds (the lower random writer id wins)" test "$wins_a" -gt 0 -a "$wins_b" -gt 0
fi
check "no object in the bucket was ever replaced (ETags of keys listed before and after each round)" test "$replaced_keys" = 0
vols() { h C volume list --json | jq -r '.[].name' | grep -c '^r[0-9]'; }
check "host C sees the $POOL_ROUNDS volumes the winners created" test "$(vols)" = "$POOL_ROUNDS"

step "b. a host killed while holding the pool; another takes over after the lease expiry"
head -c 4M /dev/urandom >"$W/late.raw"
check "host B imports an image (finished: closed cleanly)" h B import "$W/late.raw" --name late
free_port PORT
# Started directly (not through a shell function, whose subshell kill -9 would hit instead).
if [ "$OWN_NAMES" = 1 ]; then
    unshare --uts sh -c 'hostname "$0" && exec "$@"' cluster-A \
        "$CONDENSE" --pool "$W/A" serve --insecure-listen "127.0.0.1:$PORT" >"$W/serveA.log" 2>&1 &
else
    "$CONDENSE" --pool "$W/A" serve --insecure-listen "127.0.0.1:$PORT" >"$W/serveA.log" 2>&1 &
fi
PIDS+=($!)
servea=$!
served() {
    for _ in $(seq 1 60); do
        nbdinfo "nbd://127.0.0.1:$PORT/base" >/dev/null 2>&1 && return 0
        kill -0 "$servea" 2>/dev/null || break
        sleep 1
    done
    tail -3 "$W/serveA.log"
    return 1
}
check "host A serves the pool (nbdinfo answers)" served
# A writable open that writes nothing if it got the pool: deleting a volume that is not there.
refuse "host B cannot write while A serves" "held by" h B volume delete no-such-volume
kill -9 "$servea"
wait "$servea" 2>/dev/null
sleep 1
t_kill=$SECONDS
takeover() {
    for _ in $(seq 1 30); do
        if h B volume create after-kill --size 1M 2>"$W/takeover.err"; then return 0; fi
        grep -q "held by" "$W/takeover.err" || { cat "$W/takeover.err"; return 1; }
        sleep 2
    done
    return 1
}
check "host B takes the pool once A's lease expired" takeover
waited=$((SECONDS - t_kill))
note "host B wrote $waited s after kill -9 of A (lease: 30 s)"
if [ "$OWN_NAMES" = 1 ]; then
    check "host B waited out the lease of another host (>= 20 s)" test "$waited" -ge 20
else
    skip "the lease expiry between two host names" "no UTS namespace here (unshare --uts needs root): B took A's claim at once as a dead process of its own host"
fi
same_export() {
    rm -f "$W/export.out"
    h C export "$1" "$W/export.out" && cmp "$2" "$W/export.out"
}
check "host C exports base byte-identical" same_export base "$W/base.raw"
check "host C exports late byte-identical" same_export late "$W/late.raw"
check "verify clean (host C)" h C verify

step "c. hosts sharing one pool: dedup across hosts, GC that waits for every host"
# Ten images: a common 24 MiB base (the OS every VM was cloned from) and 4 MiB of their own.
head -c 24M /dev/urandom >"$W/common.raw"
for i in $(seq 1 10); do
    { cat "$W/common.raw"; head -c 4M /dev/urandom; } >"$W/img$i.raw"
done
ONE_URL=$(s3url single)
MULTI_URL=$(s3url multi)
check "init the one-host pool" timeout "$CMD_TIMEOUT" "$CONDENSE" init "$ONE_URL" --cache "$W/S" --cache-size "$CACHE_SIZE"
one_host() { for i in $(seq 1 10); do h S import "$W/img$i.raw" --name "vm$i" || return 1; done; }
check "one host imports all ten images" one_host
check "init the shared pool on host A" timeout "$CMD_TIMEOUT" "$CONDENSE" init "$MULTI_URL" --cache "$W/MA" --cache-size "$CACHE_SIZE"
check "host B joins the pool" as_host B timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$MULTI_URL" --join --host cluster-B --cache "$W/MB" --cache-size "$CACHE_SIZE"
listed() { h MA hosts --json | jq -e ".other_hosts | map(.host) | sort == $1" >/dev/null; }
check "hosts on host A lists B" listed '["cluster-B"]'
imports() {
    local host=$1 from=$2
    for i in $(seq "$from" $((from + 4))); do h "$host" import "$W/img$i.raw" --name "vm$i" || return 1; done
}
t_imp=$SECONDS
imports MA 1 >"$W/impA.log" 2>&1 &
pa=$!
imports MB 6 >"$W/impB.log" 2>&1 &
pb=$!
check "host A imports five images" wait "$pa"
check "host B imports the other five at the same time" wait "$pb"
note "both imports took $((SECONDS - t_imp)) s"
sync_json() { h "$1" hosts sync --json; }
check "hosts sync on host A" sync_json MA
sync_json MB >"$W/syncB.json"
note "host B's sync: $(jq -c '.other_hosts[] | {host, chunks_folded, chunks_merged}' "$W/syncB.json")"
check "host B merged the blocks both stored into A's copies" test "$(jq '.other_hosts[0].chunks_merged' "$W/syncB.json")" -gt 6000
check "host B's GC empties the segments whose blocks it merged" h MB gc
condemned() { h MB hosts --json | jq '.condemned_segments'; }
n_condemned=$(condemned)
note "host B's condemned segments, kept until host A lets them go: $n_condemned"
check "host B's emptied segments are condemned, not deleted, while A may name them" test "$n_condemned" -gt 0
check "host B deletes nothing before A let go" sh -c "'$CONDENSE' --pool '$W/MB' hosts sync --json | jq -e '.segments_deleted == 0' >/dev/null"
h MA hosts sync >/dev/null # A lets go (acknowledged in its next root)
check "host B deletes its condemned segments once A let go" sh -c "'$CONDENSE' --pool '$W/MB' hosts sync --json | jq -e '.segments_deleted > 0 and .segments_condemned == 0' >/dev/null"
one=$(bytes_under single/)
multi=$(bytes_under multi/)
note "bucket bytes: one host importing all ten $one, hosts A and B five each $multi ($(python3 -c "print(round($multi / $one, 4))")x)"
check "the shared pool holds at most 1.02x what one host stores" python3 -c "import sys; sys.exit(0 if $multi <= 1.02 * $one else 1)"
check "host A reads its images back byte-identical" sh -c "'$CONDENSE' --pool '$W/MA' export vm3 '$W/out3' && cmp '$W/img3.raw' '$W/out3'"
check "host B reads its images back byte-identical (base blocks from A's records)" sh -c "'$CONDENSE' --pool '$W/MB' export vm8 '$W/out8' && cmp '$W/img8.raw' '$W/out8'"
check "host C joins the pool" as_host C timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$MULTI_URL" --join --host cluster-C --cache "$W/MC" --cache-size "$CACHE_SIZE"
check "hosts on host A lists B and C" listed '["cluster-B","cluster-C"]'
h MA hosts --json >"$W/hosts.json"
note "hosts on A: $(jq -c '[.hosts[] | {host, volumes, bucket_bytes, chunks_published, lease: .lease.state}], .whole_pool' "$W/hosts.json" | tr '\n' ' ')"
check "hosts shows every host's volumes (5 on A, 5 on B) and the whole pool's bucket bytes" \
    jq -e '([.hosts[] | select(.slot <= 1) | .volumes] == [5, 5]) and .whole_pool.bucket_bytes > 0 and (.hosts | length) == 3' "$W/hosts.json"
check "stats on B shows the whole pool beside its own part (shared_pool)" \
    sh -c "'$CONDENSE' --pool '$W/MB' stats --json | jq -e '.shared_pool.whole_pool.hosts == 3 and .shared_pool.whole_pool.written_bytes > .shared_pool.whole_pool.bucket_bytes' >/dev/null"
check "hosts shows B's lease released (B closed cleanly) and what B published" \
    jq -e '.hosts[] | select(.host == "cluster-B") | .lease.state == "released" and .chunks_published > 0' "$W/hosts.json"
check "hosts sync on host C folds A and B in" sh -c "'$CONDENSE' --pool '$W/MC' hosts sync --json | jq -e '[.other_hosts[].chunks_folded] | add > 10000' >/dev/null"
check "a reader of B's part exports vm9 byte-identical" sh -c "'$CONDENSE' connect '$MULTI_URL/hosts/01' --read-only --cache '$W/RB' --cache-size 1G >/dev/null && '$CONDENSE' --pool '$W/RB' export vm9 '$W/out9' && cmp '$W/img9.raw' '$W/out9'"

step "c2. three hosts with a sparse dedup index of 32 MiB each (issue 43)"
SPARSE_URL=$(s3url sparse)
check "init a shared pool with a 32 MiB sparse index on host A" timeout "$CMD_TIMEOUT" "$CONDENSE" init "$SPARSE_URL" --cache "$W/SA" --cache-size "$CACHE_SIZE" --index sparse --index-memory 32M
check "host B joins it" as_host B timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$SPARSE_URL" --join --host cluster-B --cache "$W/SB" --cache-size "$CACHE_SIZE"
check "host C joins it" as_host C timeout "$CMD_TIMEOUT" "$CONDENSE" connect "$SPARSE_URL" --join --host cluster-C --cache "$W/SC" --cache-size "$CACHE_SIZE"
for x in SB SC; do
    check "host ${x#S} took the first host's index setting (sparse, 32 MiB)" \
        sh -c "'$CONDENSE' --pool '$W/$x' index show --json | jq -e '.mode == \"sparse\" and .memory_bytes == 33554432' >/dev/null"
done
# sparse_imports HOST FIRST LAST: images FIRST..LAST; each import's peak RSS (KiB) in $W/HOST.rss.
sparse_imports() {
    local host=$1 i
    for i in $(seq "$2" "$3"); do
        as_host "$host" /usr/bin/time -a -o "$W/$host.rss" -f %M timeout "$CMD_TIMEOUT" "$CONDENSE" --pool "$W/$host" import "$W/img$i.raw" --name "vm$i" || return 1
    done
}
sparse_imports SA 1 4 >"$W/impSA.log" 2>&1 &
pa=$!
sparse_imports SB 5 7 >"$W/impSB.log" 2>&1 &
pb=$!
sparse_imports SC 8 10 >"$W/impSC.log" 2>&1 &
pc=$!
check "host A imports four images" wait "$pa"
check "host B imports three at the same time" wait "$pb"
check "host C imports three at the same time" wait "$pc"
note "peak RSS of the imports (KiB): A $(sort -n "$W/SA.rss" | tail -1), B $(sort -n "$W/SB.rss" | tail -1), C $(sort -n "$W/SC.rss" | tail -1)"
for x in SA SB SC; do h "$x" hosts sync >/dev/null || fail "hosts sync on $x"; done
merge_and_gc() {
    local x
    for x in SA SB SC; do
        h "$x" index merge --no-gc --json >"$W/merge$x.json" && h "$x" gc >/dev/null || return 1
    done
}
check "index merge and gc on every host" merge_and_gc
note "merged: A $(jq -c '{duplicates, merged}' "$W/mergeSA.json"), B $(jq -c '{duplicates, merged}' "$W/mergeSB.json"), C $(jq -c '{duplicates, merged}' "$W/mergeSC.json")"
settle() {
    local round x waiting
    for round in 1 2 3 4; do
        waiting=0
        for x in SA SB SC; do
            waiting=$((waiting + $(h "$x" hosts sync --json | jq '.segments_condemned'))) || return 1
        done
        [ "$waiting" = 0 ] && return 0
    done
    return 1
}
check "hosts sync rounds until no condemned segment waits" settle
sparse_bytes=$(bytes_under sparse/)
note "bucket bytes: one host (dense) $one, three sparse hosts $sparse_bytes ($(python3 -c "print(round($sparse_bytes / $one, 4))")x)"
check "three sparse hosts hold at most 1.02x what one host stores" python3 -c "import sys; sys.exit(0 if $sparse_bytes <= 1.02 * $one else 1)"
for x in SA:2 SB:6 SC:9; do
    check "host ${x:1:1} reads vm${x#*:} back byte-identical" sh -c "'$CONDENSE' --pool '$W/${x%:*}' export vm${x#*:} '$W/outs' && cmp '$W/img${x#*:}.raw' '$W/outs' && rm -f '$W/outs'"
    check "verify clean on host ${x:1:1}" h "${x%:*}" verify
done

step "d. a golden snapshot of host A cloned on host C, read over NBD; a volume moved from A to B"
check "host A snapshots vm1 (the golden image)" h MA snapshot create vm1 golden
h MA hosts sync >/dev/null # published in A's root
check "host C clones A's golden snapshot (no data copied)" h MC volume clone --from-host first-host vm1@golden web1
free_port PORTC
"$CONDENSE" --pool "$W/MC" serve --insecure-listen "127.0.0.1:$PORTC" >"$W/serveC.log" 2>&1 &
PIDS+=($!)
servec=$!
check "host C serves web1" nbd_up "$PORTC" web1
check "web1 over NBD is A's golden image byte-identical (nbdcopy)" sh -c "nbdcopy 'nbd://127.0.0.1:$PORTC/web1' '$W/web1.out' && cmp '$W/img1.raw' '$W/web1.out'"
kill "$servec"
wait "$servec" 2>/dev/null
free_port PORTA
"$CONDENSE" --pool "$W/MA" serve --insecure-listen "127.0.0.1:$PORTA" >"$W/serveA2.log" 2>&1 &
PIDS+=($!)
servea2=$!
check "host A serves vm2" nbd_up "$PORTA" vm2
# qemu-io exits 0 when a command fails: its output says so.
qio_write() {
    local out
    out=$(qemu-io -f raw -c "write -P $1 0 $2" "$3" 2>&1)
    echo "$out"
    ! grep -qi 'failed\|error' <<<"$out"
}
# fio writes and verifies vm2 through A's NBD server (4 connections at depth 1, as
# tests/repair/run.sh: fio's saved verify state then holds exactly the writes it saw complete)
# while vm2 is handed to B; its writes fail from the hand-over on; then it reconnects to B and
# verifies every write it saw complete there.
fio_job() {
    cat <<JOB
[global]
ioengine=nbd
uri=nbd://127.0.0.1:$1/vm2
bs=4k
direct=1
rw=randwrite
size=4M
offset_increment=4M
numjobs=4
iodepth=1
verify=crc32c
verify_fatal=1
$2
[w]
JOB
}
mkdir -p "$W/fio" && cd "$W/fio" || exit 1
fio_job "$PORTA" "verify_state_save=1
time_based=1
runtime=120" >write.fio
fio --output="$W/fio-write.log" write.fio >/dev/null 2>&1 &
fio_pid=$!
sleep 5
t_move=$SECONDS
check "host A hands vm2 to host B while fio writes (through its serve's control socket)" h MA volume move vm2 --to cluster-B
wait "$fio_pid" 2>/dev/null
check "fio's writes to A fail from the hand-over on (read-only)" grep -qi 'read-only\|error' "$W/fio-write.log"
refuse "host A can no longer write vm2 (NBD write refused)" "" qio_write 0x11 4k "nbd://127.0.0.1:$PORTA/vm2"
check "host B adopts vm2" sh -c "'$CONDENSE' --pool '$W/MB' volume adopt vm2 --from-host first-host | tee '$W/adopt.out'"
note "move: $(cat "$W/adopt.out"); $((SECONDS - t_move)) s from the hand-over to the adopted volume"
free_port PORTB
"$CONDENSE" --pool "$W/MB" serve --insecure-listen "127.0.0.1:$PORTB" >"$W/serveB.log" 2>&1 &
PIDS+=($!)
serveb=$!
check "host B serves vm2" nbd_up "$PORTB" vm2
fio_job "$PORTB" "verify_state_load=1
verify_only=1" >verify.fio
check "fio reconnected to B verifies every write it saw complete on A (verify_only)" fio --output="$W/fio-verify.log" verify.fio
read_io=$(grep -o 'io=[0-9.]*[KMG]i\?B' "$W/fio-verify.log" | head -1)
check "the verify pass read the writes made on A ($read_io)" test -n "$read_io" -a "$read_io" != "io=0B"
cd "$W" || exit 1
check "host B writes vm2 over NBD" qio_write 0x77 4k "nbd://127.0.0.1:$PORTB/vm2"
kill "$serveb"
wait "$serveb" 2>/dev/null
h MB hosts sync >/dev/null # publishes the adoption
h MA hosts sync >/dev/null # (or its serve's background sync did it already)
check "host A deleted its copy of vm2 once B adopted it" sh -c "'$CONDENSE' --pool '$W/MA' volume list --json | jq -e 'map(.name) | index(\"vm2\") == null' >/dev/null"
kill "$servea2"
wait "$servea2" 2>/dev/null
for host in MA MB MC; do check "verify clean on $host" h "$host" verify; done

step "e. hosts A and B, both serving, race to make one volume, $ROUNDS rounds (volume claims)"
serve_host MA PE_A
pe_a=$served_pid
serve_host MB PE_B
pe_b=$served_pid
check "host A serves (vm1)" nbd_up "$PE_A" vm1
check "host B serves (vm6)" nbd_up "$PE_B" vm6
t_race=$SECONDS
race MA MB v "$ROUNDS" multi/ "is held by host" "claimed the name at once"
note "$ROUNDS rounds in $((SECONDS - t_race)) s: A won $wins_a, B won $wins_b; decided by the claim rule (both claimed at once) $ruled"
check "exactly one winner in each of $ROUNDS rounds" test "$bad_rounds" = 0
check "the claim rule decided rounds (both hosts had claimed: the race is real)" test "$ruled" -gt 0
check "no object in the bucket was ever replaced (ETags of keys listed before and after each round)" test "$replaced_keys" = 0
names_of() { h "$1" volume list --json | jq -r '.[].name' | grep '^v[0-9]' | sort; }
names_of MA >"$W/namesA"
names_of MB >"$W/namesB"
check "every name is in exactly one host's part ($(wc -l <"$W/namesA") on A, $(wc -l <"$W/namesB") on B)" \
    test "$(sort -u "$W/namesA" "$W/namesB" | wc -l)" = "$ROUNDS" -a "$(comm -12 "$W/namesA" "$W/namesB" | wc -l)" = 0
stop_pids "$pe_a" "$pe_b"

step "f. GC on host A while host B imports and host C clones A's newest, for $GC_SECONDS s"
head -c 8M "$W/common.raw" >"$W/small-base.raw"
stop_at=$((SECONDS + GC_SECONDS))
# gen_image K: host A's generation K (a common base and 2 MiB of its own).
gen_image() { [ -f "$W/gen$1.raw" ] || { cat "$W/small-base.raw"; head -c 2M /dev/urandom; } >"$W/gen$1.raw"; }
loop_a() {
    local k=0
    while [ "$SECONDS" -lt "$stop_at" ]; do
        gen_image "$k"
        h MA import "$W/gen$k.raw" --name "gen$k" >/dev/null || { echo "A: import gen$k failed"; return 1; }
        if [ "$k" -ge 2 ]; then h MA volume delete "gen$((k - 2))" >/dev/null || return 1; fi
        h MA gc >/dev/null || { echo "A: gc failed"; return 1; }
        h MA hosts sync --json >"$W/syncA.json" || { echo "A: hosts sync failed"; return 1; }
        jq '.segments_deleted' "$W/syncA.json" >>"$W/deletedA"
        echo "$k" >"$W/published" # gen$k is in A's newest root
        k=$((k + 1))
    done
    echo "A: $k generations"
}
loop_b() {
    local k=0
    while [ "$SECONDS" -lt "$stop_at" ]; do
        { cat "$W/small-base.raw"; head -c 1M /dev/urandom; } >"$W/b.raw"
        h MB import "$W/b.raw" --name "b$k" >/dev/null || { echo "B: import b$k failed"; return 1; }
        h MB hosts sync >/dev/null || { echo "B: hosts sync failed"; return 1; }
        if [ "$k" -ge 2 ]; then h MB volume delete "b$((k - 2))" >/dev/null || return 1; fi
        h MB gc >/dev/null || { echo "B: gc failed"; return 1; }
        k=$((k + 1))
    done
    echo "B: $k imports"
}
loop_c() {
    local last=-1 k clones=0 gone=0
    while [ "$SECONDS" -lt "$stop_at" ]; do
        k=$(cat "$W/published" 2>/dev/null || echo -1)
        if [ "$k" = "$last" ] || [ "$k" = -1 ]; then sleep 1; continue; fi
        last=$k
        if ! h MC volume clone --from-host first-host "gen$k" "c$k" >"$W/clone.out" 2>&1; then
            # A deletes gen$k two generations on: a clone that comes too late finds nothing.
            if grep -q "not found" "$W/clone.out"; then gone=$((gone + 1)); continue; fi
            echo "C: clone of gen$k failed:"; cat "$W/clone.out"; return 1
        fi
        rm -f "$W/c.out"
        h MC export "c$k" "$W/c.out" >/dev/null && cmp "$W/gen$k.raw" "$W/c.out" || { echo "C: c$k reads wrong"; return 1; }
        h MC hosts sync >/dev/null || { echo "C: hosts sync failed"; return 1; }
        clones=$((clones + 1))
        echo "$k" >>"$W/cloned"
    done
    echo "C: $clones clones read back byte-identical ($gone came too late)"
}
: >"$W/cloned"
: >"$W/deletedA"
loop_a >"$W/loopA.log" 2>&1 &
la=$!
loop_b >"$W/loopB.log" 2>&1 &
lb=$!
loop_c >"$W/loopC.log" 2>&1 &
lc=$!
check "host A: import, delete, gc, hosts sync in a loop for $GC_SECONDS s" wait "$la"
check "host B: import, hosts sync, delete, gc in a loop" wait "$lb"
check "host C: clones of A's newest generation read back byte-identical, at once" wait "$lc"
note "$(cat "$W/loopA.log" "$W/loopB.log" "$W/loopC.log" | tr '\n' ' ')"
check "host C cloned at least 3 generations" test "$(wc -l <"$W/cloned")" -ge 3
for host in MA MB MC MA MB MC; do h "$host" hosts sync --json >"$W/sync.json"; jq '.segments_deleted' "$W/sync.json" >>"$W/deleted$host"; done # every condemnation let go
deleted_a=$(awk '{ s += $1 } END { print s + 0 }' "$W/deletedMA" "$W/deletedA")
note "segments host A's GC emptied and deleted once B and C let go: $deleted_a"
check "host A's GC deleted segments while the others cloned and folded (the race is real)" test "$deleted_a" -gt 0
all_clones() {
    local k
    while read -r k; do
        rm -f "$W/c.out"
        h MC export "c$k" "$W/c.out" >/dev/null && cmp "$W/gen$k.raw" "$W/c.out" || { echo "c$k differs"; return 1; }
    done <"$W/cloned"
}
check "every clone on C still reads back byte-identical after A's GC" all_clones
# Volume claims: one per volume of every host, none left of a deleted volume.
n_vols=$(for host in MA MB MC; do h "$host" volume list --json | jq -r '.[].name' | grep -vc '@'; done | awk '{ s += $1 } END { print s }')
n_claims=$(bucket_list multi/volumes/ | wc -l)
check "one volume claim per volume of every host ($n_vols volumes, $n_claims claims): none outlives its volume" test "$n_vols" = "$n_claims"
for host in MA MB MC; do check "verify clean on $host" h "$host" verify; done

step "g. host B killed under durability remote; host C takes its volume after the lease expiry"
check "durability set remote on host B" h MB durability set remote
check "host B makes volume k1" h MB volume create k1 --size 16M
serve_host MB PG_B
pg_b=$served_pid
check "host B serves k1" nbd_up "$PG_B" k1
head -c 8M /dev/urandom >"$W/known.raw"
check "nbdcopy --flush 8 MiB into k1 through B" nbdcopy --flush "$W/known.raw" "nbd://127.0.0.1:$PG_B/k1"
kill -9 "$pg_b"
wait "$pg_b" 2>/dev/null
t_kill=$SECONDS
check "hosts on C shows B's lease still held (B is dead, its lease not expired yet)" \
    sh -c "'$CONDENSE' --pool '$W/MC' hosts --json | jq -e '.hosts[] | select(.host == \"cluster-B\") | .lease.state == \"held\"' >/dev/null"
check "host C takes k1 over from B in one step (volume adopt --take-over)" h MC volume adopt k1 --from-host cluster-B --take-over --wait 90
waited=$((SECONDS - t_kill))
note "host C adopted k1 $waited s after kill -9 of B (lease: 30 s)"
if [ "$OWN_NAMES" = 1 ]; then
    check "host C waited out B's lease (>= 20 s)" test "$waited" -ge 20
fi
check "k1 on C holds every byte B flushed" sh -c "'$CONDENSE' --pool '$W/MC' export k1 '$W/k1.out' && cmp -n 8388608 '$W/known.raw' '$W/k1.out'"
check "host B, back, deletes its copy of k1 at its sync" sh -c "'$CONDENSE' --pool '$W/MB' hosts sync >/dev/null && '$CONDENSE' --pool '$W/MB' volume list --json | jq -e 'map(.name) | index(\"k1\") == null' >/dev/null"
for host in MB MC; do check "verify clean on $host" h "$host" verify; done

part_h

echo
echo "wall time: $((SECONDS - began)) s"
check "cluster stopped" "$GARAGE_SH" stop "$G"
cluster=0
summary
