#!/usr/bin/env bash
# A Jepsen-style randomized fault test of many hosts on one pool (issue 40), on the 3-node
# Garage cluster (tests/s3/garage.sh, replication 3). Hosts A, B and C share one pool (A made
# it, B and C joined), each serving its part over NBD, each talking to Garage through its own
# fault-injecting proxy (tests/s3/nemesis-proxy.py: holds chosen replies, fails over between
# Garage nodes, can kill -9 a process right after a chosen reply).
#
#   1. deliberate windows, $ROUNDS rounds each:
#      w1. two hosts create one name while the lower slot is held between its claims LIST and
#          its PUT (its LIST reply of volumes/HEXNAME held 3 s by its proxy);
#      w2. two new hosts join a second pool while the first is held between its members/ LIST
#          and its PUT (its LIST reply held 3 s);
#      w3. `volume adopt` killed with kill -9 part way (right after its claim PUT, or after a
#          random delay), then run again.
#   2. $OPS random operations (seeded: SEED=N reproduces the choices) — volume create (a new
#      name, or one another host holds: must be refused), delete, clone, clone --from-host,
#      move + adopt, writes of a pattern at a random offset over NBD (qemu-io, then flush),
#      `hosts sync` — while a nemesis injects a fault before about FAULT_PCT % of them:
#      SIGSTOP/SIGCONT of a host's serve for 1-4 s, kill -9 of a serve (restarted), kill -9 of
#      a Garage node (restarted a few operations later), slow store (a host's LIST or PUT
#      replies held 1-4 s for a few operations).
#   3. the checker: every PROBE_EVERY operations and after every kill, every volume name is
#      written (its probe block, the last 4 KiB) over NBD on every host, every acceptance
#      logged with its time: a name accepted on two hosts, or on a host that does not own it,
#      is a violation. At the end (faults healed, pending hand-overs run again, two rounds of
#      `hosts sync`): each name is in exactly one host's part, its owner's; every volume exports
#      (nbdcopy) byte-identical to its model (every acknowledged write; the probe block all
#      0x00 or all 0xee); every join got its own slot and the registry names the host that owns
#      it; `verify` is clean on every host.
#   Prints a table of operations, faults by kind and violations by kind; exits non-zero on any
#   violation (each one is a "FAIL" line).
#
#   bash tests/s3/nemesis.sh                       # short form (CI): ROUNDS=3 OPS=60
#   SEED=1234 bash tests/s3/nemesis.sh             # the same choices again
#   ROUNDS=12 OPS=520 FAULT_PCT=25 bash tests/s3/nemesis.sh   # long form (>= 500 ops, >= 100 faults)
#   CONDENSE=/path/to/condense KEEP=1 ...          # KEEP=1 keeps $W (logs, models) on failure
#
# Garage as in tests/s3/cluster.sh (installed by scripts/install-garage.sh under CI). Needs
# curl, python3, jq, nbdcopy (libnbd-bin), qemu-io (qemu-utils). Ends with "N passed, M failed,
# K skipped".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PROXY=$ROOT/tests/s3/nemesis-proxy.py
S3_TEST="nemesis: randomized faults on many hosts, 3-node Garage cluster"
# shellcheck source=tests/s3/with-garage.sh
. "$ROOT/tests/s3/with-garage.sh"
need_tools curl python3 jq timeout cmp nbdcopy qemu-io

SEED=${SEED:-$(($(date +%s%N) % 1000000))}
ROUNDS=${ROUNDS:-3}
OPS=${OPS:-60}
FAULT_PCT=${FAULT_PCT:-30}
PROBE_EVERY=${PROBE_EVERY:-12}
CMD_TIMEOUT=${CMD_TIMEOUT:-60}
VSIZE=$((1024 * 1024)) # every volume: 1 MiB, the last 4 KiB its probe block
PROBE_OFF=$((VSIZE - 4096))
HOSTS=(A B C)

W=$(mktemp -d /tmp/condense-s3-nemesis.XXXXXX)
G=$W/garage
M=$W/model
mkdir -p "$M" "$G"
cluster=0
began=$SECONDS
PIDS=()
declare -A SPID=() PORT=() PPORT=() OWNER=() STATS=() FAULTS=() VIOL=() PENDING=() HN=() MOVED_FROM=()
echo "seed $SEED (SEED=$SEED reproduces the choices), ROUNDS=$ROUNDS OPS=$OPS FAULT_PCT=$FAULT_PCT"

cleanup() {
    local p
    for p in "${SPID[@]}"; do kill -CONT "$p" 2>/dev/null; done
    stop_pids "${SPID[@]}" "${PIDS[@]}"
    if [ "$cluster" = 1 ]; then "$GARAGE_SH" stop "$G" >/dev/null 2>&1; fi
    remove_work_dir
}
trap cleanup EXIT

note() { echo "    $*"; }
step() { echo; echo "=== $1 (at $((SECONDS - began)) s)"; }
stamp() { date +%s.%N | cut -c1-14; }

# The run's own random numbers (bash's $RANDOM is also used by free_port): rnd N sets R to
# 0..N-1 from a 31-bit LCG seeded by SEED, so SEED=N makes the same choices again.
RNG=$SEED
rnd() {
    RNG=$(((RNG * 1103515245 + 12345) % 2147483648))
    R=$(((RNG >> 8) % $1))
}

# violation KIND TEXT: counted by kind, printed as a FAIL line, logged with its time.
violation() {
    VIOL[$1]=$((${VIOL[$1]:-0} + 1))
    echo "$(stamp) $1: $2" >>"$W/violations.log"
    echo "$2" >"$W/out"
    fail "violation ($1): $2" /dev/null
}
count_op() { STATS[$1]=$((${STATS[$1]:-0} + 1)); }
count_fault() { FAULTS[$1]=$((${FAULTS[$1]:-0} + 1)); }

# Each host's processes run with their own host name (a UTS namespace: root), as on real
# hypervisors; without it they share the machine's name.
if unshare --uts true 2>/dev/null; then OWN_NAMES=1; else OWN_NAMES=0; fi
# run_as HOST CMD...: exec CMD as host HOST (name nem-HOST), talking to Garage through HOST's
# proxy. Same process id (exec all the way), so kill -9 of $! hits condense itself.
run_as() {
    local host=$1
    shift
    if [ "$OWN_NAMES" = 1 ]; then
        exec unshare --uts sh -c 'hostname "$0" && exec "$@"' "nem-$host" \
            env AWS_ENDPOINT_URL="http://127.0.0.1:${PPORT[$host]}" "$@"
    else
        exec env AWS_ENDPOINT_URL="http://127.0.0.1:${PPORT[$host]}" "$@"
    fi
}
# h HOST ARGS...: condense on HOST's local directory (through its serve's control socket
# while it serves), bounded in time.
h() {
    local host=$1 t rc
    shift
    t=$(stamp)
    (run_as "$host" timeout "$CMD_TIMEOUT" "$CONDENSE" --pool "$W/$host" "$@")
    rc=$?
    echo "$t-$(stamp) $host: $* -> exit $rc" >>"$W/commands.log"
    return $rc
}

# start_proxy HOST: HOST's proxy to every Garage node, its rules and log in $W/proxy-HOST.
start_proxy() {
    local port
    free_port port
    PPORT[$1]=$port
    mkdir -p "$W/proxy-$1"
    # shellcheck disable=SC2086
    python3 "$PROXY" "$port" "$W/proxy-$1" $GARAGE_S3_ENDPOINTS 2>>"$W/proxy-$1/stderr" &
    PIDS+=($!)
    for _ in $(seq 1 50); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "proxy of $1 did not start"
    return 1
}
# rule HOST LINE / clear_rules HOST: set / drop HOST's proxy rules (nemesis-proxy.py).
rule() { echo "$2" >"$W/proxy-$1/rules.tmp" && mv "$W/proxy-$1/rules.tmp" "$W/proxy-$1/rules"; }
clear_rules() { rm -f "$W/proxy-$1/rules"; }
# wait_hit HOST REGEX: wait up to 15 s until HOST's proxy logged a hit matching REGEX.
wait_hit() {
    for _ in $(seq 1 150); do
        grep -q -- "$2" "$W/proxy-$1/log" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

# start_serve HOST: serve HOST's part (NBD on PORT[HOST]); ready once its control socket answers.
start_serve() {
    local host=$1
    rm -f "$W/$host/control.sock" # a kill -9 left it
    (run_as "$host" "$CONDENSE" --pool "$W/$host" serve --insecure-listen "127.0.0.1:${PORT[$host]}") \
        >>"$W/serve-$host.log" 2>&1 &
    SPID[$host]=$!
    for _ in $(seq 1 300); do
        if [ -S "$W/$host/control.sock" ] && h "$host" volume list --json >/dev/null 2>&1; then return 0; fi
        kill -0 "${SPID[$host]}" 2>/dev/null || break
        sleep 0.1
    done
    echo "serve of $host did not start:"
    tail -5 "$W/serve-$host.log"
    return 1
}
# restart_serve HOST: start_serve, again every 5 s for a minute while it fails (a Garage node
# restarted just before may take that long to rejoin its peers: the open then finds no quorum).
# A slow-store fault on HOST itself ends after the first failed try: while every PUT of the
# store takes longer than the lease's bound (docs/S3.md "Lease: claims"), the open refuses
# the lease by design, and the fault is meant to last a few operations, not the restart.
restart_serve() {
    local i
    for i in $(seq 1 12); do
        start_serve "$1" >>"$W/faults.log" 2>&1 && return 0
        echo "$(stamp) serve of $1 did not start (try $i), again in 5 s" >>"$W/faults.log"
        if [ "$SLOW_HOST" = "$1" ]; then
            clear_rules "$SLOW_HOST"
            SLOW_HOST=
            echo "$(stamp) slow store for $1 healed early: its lease cannot be taken while it lasts" >>"$W/faults.log"
        fi
        sleep 5
    done
    violation host-restart "serve of $1 did not come back within a minute (see serve-$1.log)"
    return 1
}
stop_serve() { stop_pids "${SPID[$1]}"; SPID[$1]=; }
kill_serve() {
    kill -KILL "${SPID[$1]}" 2>/dev/null
    wait "${SPID[$1]}" 2>/dev/null
    SPID[$1]=
}

hexname() { printf %s "$1" | od -An -tx1 | tr -d ' \n'; }
url_of() { echo "nbd://127.0.0.1:${PORT[$1]}/$2"; }

# nbd_write HOST NAME OFF LEN ARGS...: qemu-io write (ARGS: -P BYTE or -s FILE) + flush over
# HOST's NBD; acknowledged only if both succeed (qemu-io exits 0 when a command fails: its
# output says so).
nbd_write() {
    local host=$1 name=$2 off=$3 len=$4 out
    shift 4
    out=$(timeout 15 qemu-io -f raw -c "write $* $off $len" -c flush "$(url_of "$host" "$name")" 2>&1) || return 1
    ! grep -qi 'failed\|error\|cannot\|could not' <<<"$out"
}
# model_write NAME OFF LEN BYTE: the model of NAME after that write.
model_write() {
    head -c "$3" /dev/zero | tr '\0' "\\$(printf %o "$4")" |
        dd of="$M/$1" bs=4096 seek=$(($2 / 4096)) conv=notrunc status=none
}
model_new() { truncate -s "$VSIZE" "$M/$1"; OWNER[$1]=$2; }
model_drop() { rm -f "$M/$1"; unset "OWNER[$1]"; }
# lists HOST NAME: HOST's part has volume NAME (asked after the operation, faults healed).
lists() { h "$1" volume list --json 2>/dev/null | jq -e --arg n "$2" 'map(.name) | index($n) != null' >/dev/null; }

names_n=0
new_name() { names_n=$((names_n + 1)); NEW="v$names_n"; }
# pick_name: a random volume of the model in P ("" if none); pick_host: a random host in H.
pick_name() {
    local all=("${!OWNER[@]}")
    P=
    [ ${#all[@]} -gt 0 ] || return 1
    mapfile -t all < <(printf '%s\n' "${all[@]}" | sort)
    rnd ${#all[@]}
    P=${all[$R]}
}
pick_host() { rnd 3; H=${HOSTS[$R]}; }
other_host() {
    local o=() x
    rnd 2
    for x in "${HOSTS[@]}"; do [ "$x" = "$1" ] || o+=("$x"); done
    H=${o[$R]}
}

# probe: write every model volume's probe block (the last 4 KiB, 0xee) on every host; more
# than one host accepting a name, or a host that does not own it, is a violation
# (probe_names). Each acceptance is logged with its time in $W/accept.log.
probe() {
    wait_conts
    count_op probe-round
    # shellcheck disable=SC2046
    probe_names $(printf '%s\n' "${!OWNER[@]}" | sort)
}

# --- faults -----------------------------------------------------------------------------------
CONTS=()
wait_conts() {
    local p
    for p in "${CONTS[@]}"; do wait "$p" 2>/dev/null; done
    CONTS=()
}
GARAGE_DOWN= GARAGE_BACK_AT=0 SLOW_HOST= SLOW_UNTIL=0
fault() {
    local host d
    rnd 100
    if [ "$R" -lt 35 ]; then
        pick_host
        host=$H
        [ -n "${SPID[$host]}" ] || return
        rnd 3000
        d=$((1000 + R))
        count_fault "sigstop-host"
        echo "$(stamp) SIGSTOP $host for $d ms" >>"$W/faults.log"
        kill -STOP "${SPID[$host]}"
        (sleep "$(printf '%d.%03d' $((d / 1000)) $((d % 1000)))"; kill -CONT "${SPID[$host]}") &
        CONTS+=($!)
    elif [ "$R" -lt 55 ]; then
        pick_host
        host=$H
        wait_conts
        count_fault "kill9-host"
        echo "$(stamp) kill -9 serve of $host" >>"$W/faults.log"
        kill_serve "$host"
        rnd 1000
        sleep "0.$(printf %03d "$R")"
        restart_serve "$host"
        NEED_PROBE=1
    elif [ "$R" -lt 75 ]; then
        [ -z "$GARAGE_DOWN" ] || return
        rnd 3
        GARAGE_DOWN=$((R + 1))
        rnd 4
        GARAGE_BACK_AT=$((op + 2 + R))
        count_fault "kill9-garage-node"
        echo "$(stamp) kill -9 Garage node $GARAGE_DOWN (back after op $GARAGE_BACK_AT)" >>"$W/faults.log"
        "$GARAGE_SH" kill "$G" "$GARAGE_DOWN" >>"$W/faults.log" 2>&1
        NEED_PROBE=1
    else
        [ -z "$SLOW_HOST" ] || return
        pick_host
        SLOW_HOST=$H
        rnd 3000
        d=$((1000 + R))
        rnd 2
        local what=LIST
        if [ "$R" = 0 ]; then
            rule "$SLOW_HOST" "GET list-type=2 $d -1"
        else
            rule "$SLOW_HOST" "PUT . $d -1"
            what=PUT
        fi
        rnd 3
        SLOW_UNTIL=$((op + 1 + R))
        count_fault "slow-store"
        echo "$(stamp) slow store for $SLOW_HOST: $what replies held $d ms until op $SLOW_UNTIL" >>"$W/faults.log"
    fi
}
heal_due() {
    if [ -n "$GARAGE_DOWN" ] && { [ "$op" -ge "$GARAGE_BACK_AT" ] || [ "${1:-}" = all ]; }; then
        "$GARAGE_SH" restart "$G" "$GARAGE_DOWN" >>"$W/faults.log" 2>&1 || violation garage-restart "Garage node $GARAGE_DOWN did not restart"
        echo "$(stamp) Garage node $GARAGE_DOWN restarted" >>"$W/faults.log"
        GARAGE_DOWN=
    fi
    if [ -n "$SLOW_HOST" ] && { [ "$op" -ge "$SLOW_UNTIL" ] || [ "${1:-}" = all ]; }; then
        clear_rules "$SLOW_HOST"
        SLOW_HOST=
    fi
    if [ "${1:-}" = all ]; then wait_conts; fi
}

# --- operations -------------------------------------------------------------------------------
op_create() {
    pick_host
    local host=$H
    new_name
    local name=$NEW
    if h "$host" volume create "$name" --size "$VSIZE" >"$W/op.out" 2>&1; then
        model_new "$name" "$host"
        count_op create
    else
        count_op create-failed
        wait_conts
        # Indeterminate: the volume is there or not.
        if lists "$host" "$name"; then model_new "$name" "$host"; fi
    fi
}
# op_create_taken: a name another host owns must be refused.
op_create_taken() {
    pick_name || return
    local name=$P
    other_host "${OWNER[$name]}"
    if h "$H" volume create "$name" --size "$VSIZE" >"$W/op.out" 2>&1; then
        violation created-on-two "volume create $name on host $H succeeded while host ${OWNER[$name]} owns it"
        h "$H" volume delete "$name" >/dev/null 2>&1
    else
        count_op create-taken-refused
    fi
}
op_write() {
    pick_name || return
    local name=$P host=${OWNER[$P]} off len byte
    rnd $((PROBE_OFF / 4096))
    off=$((R * 4096))
    rnd 16
    len=$(((R + 1) * 4096))
    [ $((off + len)) -le "$PROBE_OFF" ] || len=$((PROBE_OFF - off))
    rnd 200
    byte=$((R + 1)) # never 0xee, never 0
    if nbd_write "$host" "$name" "$off" "$len" -P "$byte"; then
        model_write "$name" "$off" "$len" "$byte"
        echo "$(stamp) write $name@$host $off+$len byte $byte" >>"$W/writes.log"
        count_op write
    else
        count_op write-failed
        # Indeterminate: once the host answers, the range holds the old bytes or the new.
        wait_conts
        rm -f "$W/rb"
        if timeout 30 nbdcopy "$(url_of "$host" "$name")" "$W/rb" 2>/dev/null; then
            if cmp -s -i "$off:$off" -n "$len" "$W/rb" "$M/$name"; then :; else
                model_write "$name" "$off" "$len" "$byte"
                cmp -s -i "$off:$off" -n "$len" "$W/rb" "$M/$name" ||
                    violation lost-or-torn-write "volume $name on $host: a failed write left bytes $off+$len neither old nor new"
            fi
        fi
    fi
}
op_clone() {
    pick_name || return
    local src=$P host=${OWNER[$P]}
    new_name
    if h "$host" volume clone "$src" "$NEW" >"$W/op.out" 2>&1; then
        cp "$M/$src" "$M/$NEW"
        OWNER[$NEW]=$host
        count_op clone
    else
        count_op clone-failed
        wait_conts
        if lists "$host" "$NEW"; then cp "$M/$src" "$M/$NEW"; OWNER[$NEW]=$host; fi
    fi
}
op_clone_from_host() {
    pick_name || return
    local src=$P from=${OWNER[$P]}
    other_host "$from"
    local to=$H
    new_name
    # The clone sees the source's newest root: publish it first.
    h "$from" hosts sync >/dev/null 2>&1 || { count_op clone-from-host-failed; return; }
    if h "$to" volume clone --from-host "${HN[$from]}" "$src" "$NEW" >"$W/op.out" 2>&1; then
        cp "$M/$src" "$M/$NEW"
        OWNER[$NEW]=$to
        count_op clone-from-host
    else
        count_op clone-from-host-failed
        wait_conts
        if lists "$to" "$NEW"; then cp "$M/$src" "$M/$NEW"; OWNER[$NEW]=$to; fi
    fi
}
# adopt_or_pend NAME FROM TO: adopt on TO; on success TO owns NAME, else the hand-over is
# pending (run again later, and at the end).
adopt_or_pend() {
    if h "$3" volume adopt "$1" --from-host "${HN[$2]}" >"$W/adopt.out" 2>&1; then
        OWNER[$1]=$3
        unset "PENDING[$1]"
        return 0
    fi
    PENDING[$1]="$2 $3"
    unset "OWNER[$1]"
    return 1
}
op_move() {
    pick_name || return
    local name=$P from=${OWNER[$P]}
    other_host "$from"
    local to=$H
    MOVED_FROM[$name]="${MOVED_FROM[$name]:-}$from"
    if h "$from" volume move "$name" --to "${HN[$to]}" >"$W/op.out" 2>&1; then
        if adopt_or_pend "$name" "$from" "$to"; then count_op move-adopt; else count_op adopt-failed; fi
    else
        count_op move-failed
        wait_conts
        # Indeterminate: if the hand-over was recorded, the adopt finishes it.
        if adopt_or_pend "$name" "$from" "$to"; then count_op move-adopt; else
            unset "PENDING[$name]"
            OWNER[$name]=$from
        fi
    fi
}
op_delete() {
    pick_name || return
    local name=$P host=${OWNER[$P]}
    if h "$host" volume delete "$name" >"$W/op.out" 2>&1; then
        model_drop "$name"
        count_op delete
    else
        count_op delete-failed
        wait_conts
        lists "$host" "$name" || model_drop "$name"
    fi
}
op_sync() {
    pick_host
    if h "$H" hosts sync >"$W/op.out" 2>&1; then count_op hosts-sync; else count_op hosts-sync-failed; fi
}
# retry_pending: run every pending hand-over's adopt again.
retry_pending() {
    local name
    for name in "${!PENDING[@]}"; do
        read -r from to <<<"${PENDING[$name]}"
        adopt_or_pend "$name" "$from" "$to" && count_op adopt-retried
    done
}

# --- the cluster and the hosts ----------------------------------------------------------------
CONDENSE=$(realpath "$CONDENSE")
cd "$W" || exit 1
step "3-node Garage cluster (RF 3), hosts A, B, C each behind a proxy"
check "3-node Garage cluster started" "$GARAGE_SH" start "$G"
if [ "$failed" -gt 0 ]; then summary; exit 1; fi
cluster=1
# shellcheck disable=SC1091
. "$G/credentials.env"
POOL_URL=s3://$CONDENSE_S3_BUCKET/nemesis
for host in A B C J; do check "proxy of $host started" start_proxy "$host"; done
check "init on host A" h A init "$POOL_URL" --cache "$W/A" --cache-size 1G
for host in B C; do
    check "host $host joins" h "$host" connect "$POOL_URL" --join --host "nem-$host" --cache "$W/$host" --cache-size 1G
done
for host in A B C; do
    free_port nbdport
    PORT[$host]=$nbdport
    check "host $host serves" start_serve "$host"
done
h A hosts --json >"$W/hosts.json" 2>&1
check "hosts lists A, B and C at slots 0, 1, 2" jq -e '[.hosts[] | .slot] | sort == [0, 1, 2]' "$W/hosts.json"
if [ "$failed" -gt 0 ]; then summary; exit 1; fi
# Host names as the pool lists them: A made the pool (slot 0), B and C joined in that order.
HN[A]=$(jq -r '.hosts[] | select(.slot == 0) | .host' "$W/hosts.json")
HN[B]=nem-B
HN[C]=nem-C

# --- w1: two hosts create one name, the lower slot held between its claims LIST and its PUT ---
HITS_W1=0 HITS_W2=0 HITS_W3=0 W3_AIMED=0
w1_round() {
    local r=$1 x=A y name hex pa ra rb
    rnd 2
    y=${HOSTS[$((R + 1))]}
    name=race$r
    hex=$(hexname "$name")
    rule "$x" "GET volumes(%2F|/)$hex $W1_HOLD_MS 1"
    h "$x" volume create "$name" --size "$VSIZE" >"$W/w1x.out" 2>&1 &
    pa=$!
    if wait_hit "$x" "volumes.*$hex"; then HITS_W1=$((HITS_W1 + 1)); else note "w1 round $r: host $x's LIST of $name was not seen by its proxy"; fi
    h "$y" volume create "$name" --size "$VSIZE" >"$W/w1y.out" 2>&1
    rb=$?
    wait "$pa"
    ra=$?
    clear_rules "$x"
    count_op w1-round
    echo "$(stamp) w1 round $r: $x (held) exit $ra, $y exit $rb" >>"$W/windows.log"
    if [ "$ra" = 0 ] && [ "$rb" = 0 ]; then
        violation created-on-two "window 1, round $r (seed $SEED): volume create $name succeeded on host $x (held ${W1_HOLD_MS} ms between its claims LIST and PUT) and on host $y"
        OWNER[$name]=$x
        truncate -s "$VSIZE" "$M/$name"
        probe_names "$name"
        h "$x" hosts sync >/dev/null 2>&1
        h "$y" hosts sync >/dev/null 2>&1
        # The issue's rule: a name in two parts is reported loudly and refused on the losing host.
        if lists "$x" "$name" && lists "$y" "$name"; then note "w1 round $r: after hosts sync on both, $name is still in the parts of $x and $y"; fi
        probe_names "$name"
        h "$x" volume delete "$name" >/dev/null 2>&1
        h "$y" volume delete "$name" >/dev/null 2>&1
        model_drop "$name"
    elif [ "$ra" = 0 ]; then
        model_new "$name" "$x"
    elif [ "$rb" = 0 ]; then
        model_new "$name" "$y"
    fi
}

# --- w2: two hosts join, the first held between its members/ LIST and its PUT ----------------
JOINED=()
w2_round() {
    local r=$1 a=j${1}a b=j${1}b pa ra rb
    PPORT[$a]=${PPORT[J]}
    PPORT[$b]=${PPORT[K]}
    rule J "GET members $W2_HOLD_MS 1"
    h "$a" connect "$JOIN_URL" --join --host "nem-$a" --cache "$W/$a" --cache-size 1G >"$W/w2a.out" 2>&1 &
    pa=$!
    if wait_hit J "members"; then HITS_W2=$((HITS_W2 + 1)); else note "w2 round $r: the LIST of members/ of $a was not seen by its proxy"; fi
    h "$b" connect "$JOIN_URL" --join --host "nem-$b" --cache "$W/$b" --cache-size 1G >"$W/w2b.out" 2>&1
    rb=$?
    wait "$pa"
    ra=$?
    clear_rules J
    : >"$W/proxy-J/log"
    count_op w2-round
    echo "$(stamp) w2 round $r: $a (held) exit $ra, $b exit $rb" >>"$W/windows.log"
    [ "$ra" = 0 ] && JOINED+=("$a")
    [ "$rb" = 0 ] && JOINED+=("$b")
    [ "$ra" = 0 ] || sed 's/^/      '"$a"': /' "$W/w2a.out" | tail -2
    [ "$rb" = 0 ] || sed 's/^/      '"$b"': /' "$W/w2b.out" | tail -2
}
# w2_check: every joined host has a slot of its own, and the registry names it at that slot.
w2_check() {
    local j own
    h J0 hosts --json >"$W/jhosts.json" 2>"$W/out" || { violation join-registry "hosts --json of the join pool failed"; return; }
    jq -c '[.hosts[] | {slot, host}]' "$W/jhosts.json" >>"$W/windows.log"
    local dup
    dup=$(jq -r '[.hosts[].slot] | group_by(.) | map(select(length > 1) | .[0]) | .[]' "$W/jhosts.json")
    [ -z "$dup" ] || violation join-slot-twice "window 2 (seed $SEED): slot(s) $dup listed for two hosts"
    for j in "${JOINED[@]}"; do
        own=$(h "$j" hosts --json 2>/dev/null | jq -r '[.hosts[] | select(.this_host == true) | .slot][0] // empty')
        local named
        named=$(jq -r --argjson s "${own:-null}" '[.hosts[] | select(.slot == $s) | .host] | join(",")' "$W/jhosts.json")
        if [ -z "$own" ]; then
            violation join-slot-unknown "window 2: host $j joined but its hosts --json names no slot of its own"
        elif [ "$named" != "nem-$j" ]; then
            violation join-slot-taken "window 2 (seed $SEED): host $j joined at slot $own, but the registry names '$named' there"
        fi
    done
    for j in "${JOINED[@]}"; do echo "$j $(h "$j" hosts --json 2>/dev/null | jq -c '[.hosts[] | select(.this_host == true) | .slot][0]')"; done >>"$W/windows.log"
}

# --- w3: `volume adopt` killed part way, then run again --------------------------------------
w3_round() {
    local r=$1 x y name hex apid ra rb mode d on_x on_y
    pick_host
    x=$H
    other_host "$x"
    y=$H
    name=hand$r
    hex=$(hexname "$name")
    # 16 MiB of data: the adopt's clone of its 4096 blocks takes long enough to be killed in.
    h "$x" volume create "$name" --size "$W3_SIZE" >"$W/out" 2>&1 || { note "w3 round $r: create failed: $(tail -1 "$W/out")"; return; }
    OWNER[$name]=$x
    W3_NAMES+=("$name")
    timeout 60 nbdcopy --flush "$W/w3data.raw" "$(url_of "$x" "$name")" 2>"$W/out" || note "w3 round $r: the write to $name failed: $(tail -1 "$W/out")"
    if ! h "$x" volume move "$name" --to "${HN[$y]}" >"$W/out" 2>&1; then
        note "w3 round $r: volume move $name on $x failed: $(tail -1 "$W/out")"
        lists "$x" "$name" || model_drop "$name"
        return
    fi
    stop_serve "$y"
    (run_as "$y" "$CONDENSE" --pool "$W/$y" volume adopt "$name" --from-host "${HN[$x]}") >"$W/w3.out" 2>&1 &
    apid=$!
    if [ $((r % 2)) = 1 ]; then
        local after=(0 0 1 2 5 10 20 50)
        rnd ${#after[@]}
        d=${after[$R]}
        mode="kill -9 $d ms after its claim PUT's reply"
        rule "$y" "PUT volumes(%2F|/)$hex 0 1 $apid $d"
    else
        rnd 3000
        d=$((300 + R))
        mode="kill -9 at $d ms"
        (sleep "$(printf '%d.%03d' $((d / 1000)) $((d % 1000)))"; kill -KILL "$apid" 2>/dev/null) &
    fi
    { wait "$apid"; } 2>/dev/null
    ra=$?
    clear_rules "$y"
    # The rounds of the proxy's kill must each be killed there (the deliberate window); a
    # timed kill may come after the adopt finished.
    if [ $((r % 2)) = 1 ]; then
        W3_AIMED=$((W3_AIMED + 1))
        if [ "$ra" = 137 ]; then HITS_W3=$((HITS_W3 + 1)); fi
    fi
    count_op w3-round
    h "$y" volume adopt "$name" --from-host "${HN[$x]}" >"$W/w3b.out" 2>&1
    rb=$?
    if [ "$rb" != 0 ]; then count_op w3-rerun-refused; fi
    restart_serve "$y"
    for host in "$y" "$x" "$y" "$x"; do h "$host" hosts sync >/dev/null 2>&1; done
    on_x=0 on_y=0
    lists "$x" "$name" && on_x=1
    lists "$y" "$name" && on_y=1
    echo "$(stamp) w3 round $r: adopt $name $x->$y, $mode: exit $ra; run again: exit $rb ($(tail -1 "$W/w3b.out")); on $x $on_x, on $y $on_y" >>"$W/windows.log"
    if [ "$on_x" = 1 ] && [ "$on_y" = 1 ]; then
        violation handover-stuck "window 3, round $r (seed $SEED): adopt of $name ($x -> $y) $mode, run again (exit $rb: $(tail -1 "$W/w3b.out" | cut -c1-160)): the volume is on both hosts after two hosts syncs each"
        OWNER[$name]=$y
        probe_names "$name"
        h "$x" volume delete "$name" >/dev/null 2>&1 # the manual way out, so the run goes on
    elif [ "$on_y" = 1 ]; then
        OWNER[$name]=$y
    elif [ "$on_x" = 1 ]; then
        violation handover-unfinished "window 3, round $r (seed $SEED): adopt of $name ($x -> $y) $mode, run again (exit $rb): only $x's handed-over copy is left"
        unset "OWNER[$name]"
        h "$x" volume delete "$name" >/dev/null 2>&1
    else
        violation volume-lost "window 3, round $r (seed $SEED): adopt of $name ($x -> $y) $mode: the volume is on neither host"
        unset "OWNER[$name]"
    fi
    # Its content on its owner: the data written before the move, zeros after it.
    if [ -n "${OWNER[$name]:-}" ]; then
        rm -f "$W/w3.exp"
        if ! timeout 60 nbdcopy "$(url_of "${OWNER[$name]}" "$name")" "$W/w3.exp" 2>"$W/out"; then
            violation export-failed "window 3, round $r: $name on ${OWNER[$name]}: nbdcopy failed: $(tail -1 "$W/out")"
        elif ! cmp -s -n "$W3_DATA_BYTES" "$W/w3.exp" "$W/w3data.raw" ||
            ! cmp -s -n $((W3_BYTES - W3_DATA_BYTES)) -i "$W3_DATA_BYTES:0" "$W/w3.exp" /dev/zero; then
            violation content "window 3, round $r (seed $SEED): $name on ${OWNER[$name]} after the adopt killed ($mode) and run again is not what was written before the move"
        fi
        h "${OWNER[$name]}" volume delete "$name" >/dev/null 2>&1 || note "w3 round $r: delete of $name failed"
        unset "OWNER[$name]"
    fi
}

probe_names() {
    local name host accepted
    for name in "$@"; do
        accepted=()
        for host in "${HOSTS[@]}"; do
            [ -n "${SPID[$host]}" ] || continue
            if nbd_write "$host" "$name" "$PROBE_OFF" 4096 -P 0xee; then
                accepted+=("$host")
                echo "$(stamp) accepted $name on $host (owner ${OWNER[$name]:-none})" >>"$W/accept.log"
            fi
        done
        if [ ${#accepted[@]} -gt 1 ]; then
            violation writable-on-two "volume $name accepted a write on hosts ${accepted[*]} (model owner ${OWNER[$name]:-none})"
        elif [ ${#accepted[@]} = 1 ] && [ "${accepted[0]}" != "${OWNER[$name]:-}" ]; then
            violation writable-on-non-owner "volume $name accepted a write on host ${accepted[0]}, its owner is ${OWNER[$name]:-nobody}"
        fi
    done
}

W1_HOLD_MS=${W1_HOLD_MS:-3000}
W3_SIZE=64M
W3_BYTES=$((64 * 1024 * 1024))
W3_DATA_BYTES=$((16 * 1024 * 1024))
head -c "$W3_DATA_BYTES" /dev/urandom >"$W/w3data.raw"
W3_NAMES=()
WINDOWS=${WINDOWS:-123}
W2_HOLD_MS=${W2_HOLD_MS:-3000}

step "w1. two hosts create one name, host A held ${W1_HOLD_MS} ms between its claims LIST and PUT, $ROUNDS rounds"
case $WINDOWS in *1*) for r in $(seq 1 "$ROUNDS"); do w1_round "$r"; done ;; *) HITS_W1=$ROUNDS ;; esac
check "window 1 hit deliberately in every round (the proxy held host A's LIST: $HITS_W1 of $ROUNDS)" test "$HITS_W1" = "$ROUNDS"

step "w2. two hosts join a second pool, the first held ${W2_HOLD_MS} ms between its members/ LIST and PUT, $ROUNDS rounds"
JOIN_URL=s3://$CONDENSE_S3_BUCKET/joins
check "proxy of the second joiners started" start_proxy K
PPORT[J0]=${PPORT[K]}
check "init the join pool" h J0 init "$JOIN_URL" --cache "$W/J0" --cache-size 1G
case $WINDOWS in *2*) for r in $(seq 1 "$ROUNDS"); do w2_round "$r"; done ;; *) HITS_W2=$ROUNDS ;; esac
check "window 2 hit deliberately in every round (the proxy held the first joiner's LIST: $HITS_W2 of $ROUNDS)" test "$HITS_W2" = "$ROUNDS"
w2_check

step "w3. volume adopt killed part way (kill -9), then run again, $ROUNDS rounds"
case $WINDOWS in *3*) for r in $(seq 1 "$ROUNDS"); do w3_round "$r"; done ;; esac
check "window 3 hit deliberately: the adopt killed by its proxy right after its claim PUT in every odd round ($HITS_W3 of $W3_AIMED)" test "$HITS_W3" = "$W3_AIMED"
probe

step "random operations: $OPS, a fault before ~$FAULT_PCT % of them (seed $SEED)"
t_ops=$SECONDS
NEED_PROBE=0
for op in $(seq 1 "$OPS"); do
    heal_due
    rnd 100
    if [ "$R" -lt "$FAULT_PCT" ]; then fault; fi
    rnd 100
    if [ "${#OWNER[@]}" -lt 3 ] || [ "$R" -lt 18 ]; then op_create
    elif [ "$R" -lt 24 ]; then op_create_taken
    elif [ "$R" -lt 54 ]; then op_write
    elif [ "$R" -lt 61 ]; then op_clone
    elif [ "$R" -lt 66 ]; then op_clone_from_host
    elif [ "$R" -lt 75 ]; then op_move
    elif [ "$R" -lt 84 ]; then op_delete
    else op_sync; fi
    if [ "${#PENDING[@]}" -gt 0 ] && [ $((op % 5)) = 0 ]; then retry_pending; fi
    if [ "$NEED_PROBE" = 1 ] || [ $((op % PROBE_EVERY)) = 0 ]; then
        probe
        NEED_PROBE=0
    fi
    if [ $((op % 50)) = 0 ]; then note "$op operations, $((SECONDS - t_ops)) s"; fi
done
note "$OPS operations in $((SECONDS - t_ops)) s"

step "the checker: faults healed, pending hand-overs run again, hosts sync everywhere"
op=$((OPS + 1000))
heal_due all
for _ in 1 2 3; do
    [ "${#PENDING[@]}" -gt 0 ] || break
    retry_pending
    for host in "${HOSTS[@]}"; do h "$host" hosts sync >/dev/null 2>&1; done
done
for name in "${!PENDING[@]}"; do
    violation handover-unfinished "volume $name: its hand-over ${PENDING[$name]/ / -> } never finished (adopt run again 3 times with no fault)"
done
for _ in 1 2; do
    for host in "${HOSTS[@]}"; do h "$host" hosts sync >"$W/out" 2>&1 || note "hosts sync on $host: $(tail -1 "$W/out")"; done
done
probe
declare -A SEEN=()
for host in "${HOSTS[@]}"; do
    h "$host" volume list --json >"$W/list-$host.json" 2>"$W/out" || { violation checker "volume list on $host failed: $(tail -1 "$W/out")"; continue; }
    for name in $(jq -r '.[].name' "$W/list-$host.json"); do
        SEEN[$name]="${SEEN[$name]:-}$host"
        if [ -z "${OWNER[$name]:-}" ] && [[ "${MOVED_FROM[$name]:-}" == *"$host"* ]]; then
            violation moved-copy-left "volume $name is still in host $host's part, which moved it away (then it was deleted on its new host): the released copy was never deleted"
        elif [ -z "${OWNER[$name]:-}" ]; then
            violation unexpected-volume "volume $name is in host $host's part, but no acknowledged operation made it there"
        elif [ "${OWNER[$name]}" != "$host" ] && [[ "${MOVED_FROM[$name]:-}" == *"$host"* ]]; then
            violation moved-copy-left "volume $name is still in host $host's part, which moved it away; its owner is ${OWNER[$name]}"
        elif [ "${OWNER[$name]}" != "$host" ]; then
            violation name-on-non-owner "volume $name is in host $host's part; its owner is ${OWNER[$name]}"
        fi
    done
done
head -c 4096 /dev/zero >"$W/zero4k"
head -c 4096 /dev/zero | tr '\0' '\356' >"$W/ee4k"
n_same=0
for name in $(printf '%s\n' "${!OWNER[@]}" | sort); do
    host=${OWNER[$name]}
    case "${SEEN[$name]:-}" in *"$host"*) ;; *)
        violation volume-missing "volume $name (owner $host) is in no part"
        continue ;;
    esac
    rm -f "$W/exp"
    if ! timeout 60 nbdcopy "$(url_of "$host" "$name")" "$W/exp" 2>"$W/out"; then
        violation export-failed "volume $name on $host: nbdcopy failed: $(tail -1 "$W/out")"
    elif ! cmp -s -n "$PROBE_OFF" "$W/exp" "$M/$name"; then
        violation content "volume $name on $host differs from its model (acknowledged writes): $(cmp -n "$PROBE_OFF" "$W/exp" "$M/$name" 2>&1 | head -1)"
        cp "$W/exp" "$W/differs-$name"
    elif ! cmp -s -i "$PROBE_OFF:0" "$W/exp" "$W/zero4k" && ! cmp -s -i "$PROBE_OFF:0" "$W/exp" "$W/ee4k"; then
        violation content "volume $name on $host: its probe block is neither zeros nor the probe's 0xee"
    else
        n_same=$((n_same + 1))
    fi
done
note "$n_same of ${#OWNER[@]} volumes export byte-identical to their models"
for host in "${HOSTS[@]}"; do
    h "$host" verify >"$W/verify-$host.out" 2>&1 || violation verify "verify on host $host: $(tail -2 "$W/verify-$host.out" | tr '\n' ' ')"
done

# --- the summary ------------------------------------------------------------------------------
table() {
    local -n arr=$1
    local k total=0
    for k in $(printf '%s\n' "${!arr[@]}" | sort); do
        printf '    %-28s %6d\n' "$k" "${arr[$k]}"
        total=$((total + arr[$k]))
    done
    printf '    %-28s %6d\n' total "$total"
    TOTAL=$total
}
step "summary (seed $SEED)"
echo "  operations:"
table STATS
n_ops=$TOTAL
echo "  faults:"
table FAULTS
n_faults=$TOTAL
echo "  violations:"
table VIOL
n_viol=$TOTAL
echo "  deliberate windows hit: w1 $HITS_W1 of $ROUNDS, w2 $HITS_W2 of $ROUNDS, w3 $HITS_W3 of $W3_AIMED (and $((ROUNDS - W3_AIMED)) timed kills)"
if [ "$n_viol" -gt 0 ]; then sed 's/^/    /' "$W/violations.log"; fi
echo "  $n_ops operations, $n_faults faults, $n_viol violations (seed $SEED: SEED=$SEED ROUNDS=$ROUNDS OPS=$OPS FAULT_PCT=$FAULT_PCT reproduces the choices)"
check "no violation (seed $SEED)" test "$n_viol" = 0
stop_pids "${SPID[@]}"
SPID=()
echo "wall time: $((SECONDS - began)) s"
check "cluster stopped" "$GARAGE_SH" stop "$G"
cluster=0
summary
