#!/usr/bin/env bash
# A 3-node Garage cluster (replication factor 3) on loopback, for the S3 backend's tests.
#
#   tests/s3/garage.sh start DIR       # new cluster in DIR; writes DIR/credentials.env
#   tests/s3/garage.sh stop DIR        # SIGTERM every node and wait until each has exited
#   tests/s3/garage.sh kill DIR N      # kill -9 node N (1..3)
#   tests/s3/garage.sh restart DIR [N] # start the stopped nodes (or node N) again, same config
#   tests/s3/garage.sh status DIR      # which nodes run, then `garage status` from a live node
#   tests/s3/garage.sh cli DIR ARGS... # the garage CLI against this cluster (via a live node)
#
# DIR/credentials.env (shell syntax, `. DIR/credentials.env` exports them): AWS_ACCESS_KEY_ID,
# AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL (node 1's S3 API), AWS_REGION, CONDENSE_S3_BUCKET, and
# also AWS_ALLOW_HTTP=true (object_store refuses http:// endpoints without it) and
# GARAGE_S3_ENDPOINTS (every node's S3 API, space-separated). Every node serves the whole S3 API
# (it forwards to the others), so a client of node 1 keeps working while node 2 or 3 is down; a
# test that kills node 1 must point its client at another node.
#
# Layout of DIR: nodeN/{garage.toml,meta,data,log,pid}, rpc_secret, admin_token, ports.
# Ports: 9 consecutive free ones from a base chosen at start (GARAGE_PORT_BASE to force one);
# node N uses base+3(N-1) + 0 S3, +1 RPC, +2 admin. The binary: $GARAGE, else `garage`
# on PATH (scripts/install-garage.sh puts the pinned version in ~/.cargo/bin).
set -euo pipefail

NODES=3
BUCKET=${CONDENSE_S3_BUCKET:-condense-test}
REGION=garage
WAIT_SECS=${GARAGE_WAIT_SECS:-60}

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    echo "Environment: GARAGE (binary), GARAGE_PORT_BASE, GARAGE_WAIT_SECS (default 60), CONDENSE_S3_BUCKET."
}

die() { echo "garage.sh: $*" >&2; exit 1; }
say() { echo "garage.sh: $*"; }

find_garage() {
    if [ -n "${GARAGE:-}" ]; then
        [ -x "$GARAGE" ] || die "GARAGE=$GARAGE is not an executable"
    elif command -v garage >/dev/null; then
        GARAGE=$(command -v garage)
    elif [ -x "$HOME/.cargo/bin/garage" ]; then
        GARAGE=$HOME/.cargo/bin/garage
    else
        die "no garage binary: run scripts/install-garage.sh (or set GARAGE=/path/to/garage)"
    fi
}

# node_pid DIR N: the PID of node N if it is running (a live garage process for this config).
node_pid() {
    local f=$1/node$2/pid pid
    [ -f "$f" ] || return 1
    pid=$(cat "$f")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
    # Guard against PID reuse: the process must be garage serving this node's config.
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$1/node$2/garage.toml" || return 1
    echo "$pid"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

pick_port_base() {
    if [ -n "${GARAGE_PORT_BASE:-}" ]; then echo "$GARAGE_PORT_BASE"; return; fi
    local base p busy
    # Start somewhere pseudo-random so that parallel clusters rarely race for the same range.
    for _ in $(seq 1 50); do
        base=$((10000 + (RANDOM % 2000) * 9))
        busy=0
        for p in $(seq "$base" $((base + 3 * NODES - 1))); do
            if port_busy "$p"; then busy=1; break; fi
        done
        [ "$busy" = 0 ] && { echo "$base"; return; }
    done
    die "no free range of $((3 * NODES)) ports found on 127.0.0.1"
}

s3_port() { echo $(($(cat "$1/ports") + 3 * ($2 - 1))); }

# write_config DIR N BASE [PEERS]: PEERS, a TOML list of "id@addr", lets a restarted node find
# the others (Garage saves its peer list only now and then: a cluster stopped within a minute of
# its start would otherwise come back as three strangers, 503 on every request).
write_config() {
    local dir=$1 n=$2 base=$3 peers=${4:-} p
    p=$((base + 3 * (n - 1)))
    mkdir -p "$dir/node$n/meta" "$dir/node$n/data"
    cat >"$dir/node$n/garage.toml" <<EOF
# node $n of the test cluster made by tests/s3/garage.sh
metadata_dir = "$dir/node$n/meta"
data_dir = "$dir/node$n/data"
db_engine = "lmdb"
replication_factor = $NODES
consistency_mode = "consistent"
rpc_bind_addr = "127.0.0.1:$((p + 1))"
rpc_public_addr = "127.0.0.1:$((p + 1))"
rpc_secret_file = "$dir/rpc_secret"
bootstrap_peers = [$peers]

[s3_api]
api_bind_addr = "127.0.0.1:$p"
s3_region = "$REGION"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$((p + 2))"
admin_token_file = "$dir/admin_token"
EOF
}

start_node() {
    local dir=$1 n=$2
    # setsid: the node outlives this script and a Ctrl-C in the caller's terminal.
    NO_COLOR=1 setsid "$GARAGE" -c "$dir/node$n/garage.toml" server </dev/null >>"$dir/node$n/log" 2>&1 &
    echo $! >"$dir/node$n/pid"
}

# cli DIR ARGS...: the garage CLI through the first live node.
cli() {
    local dir=$1 n
    shift
    for n in $(seq 1 $NODES); do
        if node_pid "$dir" "$n" >/dev/null; then
            "$GARAGE" -c "$dir/node$n/garage.toml" "$@"
            return
        fi
    done
    die "no node of $dir is running"
}

# retry SECS DESCRIPTION CMD...: run CMD until it succeeds (output kept in DIR/last.out).
retry() {
    local secs=$1 what=$2 end
    shift 2
    end=$((SECONDS + secs))
    while :; do
        if "$@" >"$D/last.out" 2>&1; then return 0; fi
        if [ "$SECONDS" -ge "$end" ]; then
            echo "garage.sh: timed out after ${secs}s waiting for: $what" >&2
            sed 's/^/    | /' "$D/last.out" >&2
            return 1
        fi
        sleep 0.5
    done
}

# s3_ready DIR N: a signed ListObjectsV2 of the bucket on node N answers 200.
s3_ready() {
    local dir=$1 n=$2
    # shellcheck disable=SC1091
    (. "$dir/credentials.env" &&
        curl -sf -o /dev/null --max-time 5 -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" \
            --aws-sigv4 "aws:amz:$AWS_REGION:s3" \
            --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
            "http://127.0.0.1:$(s3_port "$dir" "$n")/$CONDENSE_S3_BUCKET?list-type=2&max-keys=1")
}

# wait_s3 DIR: every running node answers the S3 API for the bucket.
wait_s3() {
    local dir=$1 n
    for n in $(seq 1 $NODES); do
        node_pid "$dir" "$n" >/dev/null || continue
        retry "$WAIT_SECS" "node $n's S3 API to answer (log: $dir/node$n/log)" s3_ready "$dir" "$n"
    done
}

check_started() {
    local dir=$1 n
    for n in "${@:2}"; do
        node_pid "$dir" "$n" >/dev/null && continue
        echo "garage.sh: node $n did not start; the end of $dir/node$n/log:" >&2
        tail -20 "$dir/node$n/log" | sed 's/^/    | /' >&2
        exit 1
    done
}

cmd_start() {
    local dir=$1 n pid base ids=() id key_id secret
    D=$dir
    for n in $(seq 1 $NODES); do
        if pid=$(node_pid "$dir" "$n"); then
            die "$dir already has a running cluster (node $n is PID $pid): '$0 stop $dir' first"
        fi
    done
    [ ! -e "$dir/ports" ] || die "$dir already holds a (stopped) cluster: '$0 restart $dir' starts it again, or remove the directory"
    find_garage
    base=$(pick_port_base)
    # Secrets: the RPC secret (32 bytes hex), the admin token, and an S3 key imported with
    # `garage key import` (so nothing has to be parsed out of the CLI's human output).
    (umask 077
        od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$dir/rpc_secret"
        od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$dir/admin_token")
    key_id=GK$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')
    secret=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    for n in $(seq 1 $NODES); do write_config "$dir" "$n" "$base"; done
    echo "$base" >"$dir/ports"
    # A start that fails half-way leaves no node running behind it.
    trap 'echo "garage.sh: start failed: stopping the nodes (files left in $D)" >&2; cmd_stop "$D" >/dev/null 2>&1 || true' EXIT
    for n in $(seq 1 $NODES); do start_node "$dir" "$n"; done
    sleep 0.5
    check_started "$dir" $(seq 1 $NODES)

    # Node IDs, then connect node 1 to the others (gossip spreads the rest).
    for n in $(seq 1 $NODES); do
        retry "$WAIT_SECS" "node $n's RPC (log: $dir/node$n/log)" \
            "$GARAGE" -c "$dir/node$n/garage.toml" node id -q
        ids+=("$(cat "$dir/last.out")")
    done
    for n in $(seq 2 $NODES); do
        retry "$WAIT_SECS" "node 1 to connect to node $n" \
            "$GARAGE" -c "$dir/node1/garage.toml" node connect "${ids[$((n - 1))]}"
    done
    local peers=""
    for id in "${ids[@]}"; do peers+="${peers:+, }\"$id\""; done
    for n in $(seq 1 $NODES); do write_config "$dir" "$n" "$base" "$peers"; done
    # Layout: one zone per node, 1 GB capacity each (a weight; nothing is enforced).
    for n in $(seq 1 $NODES); do
        id=${ids[$((n - 1))]%%@*}
        retry "$WAIT_SECS" "layout assign of node $n" \
            "$GARAGE" -c "$dir/node1/garage.toml" layout assign -z "z$n" -c 1G "${id:0:16}"
    done
    retry "$WAIT_SECS" "layout apply" "$GARAGE" -c "$dir/node1/garage.toml" layout apply --version 1
    retry "$WAIT_SECS" "key import" \
        "$GARAGE" -c "$dir/node1/garage.toml" key import --yes -n condense-test "$key_id" "$secret"
    retry "$WAIT_SECS" "bucket create" "$GARAGE" -c "$dir/node1/garage.toml" bucket create "$BUCKET"
    retry "$WAIT_SECS" "bucket allow" "$GARAGE" -c "$dir/node1/garage.toml" \
        bucket allow --read --write --owner "$BUCKET" --key "$key_id"

    local endpoints=""
    for n in $(seq 1 $NODES); do endpoints+="${endpoints:+ }http://127.0.0.1:$(s3_port "$dir" "$n")"; done
    (umask 077
        cat >"$dir/credentials.env" <<EOF
# Garage test cluster in $dir (tests/s3/garage.sh)
export AWS_ACCESS_KEY_ID=$key_id
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_ENDPOINT_URL=http://127.0.0.1:$(s3_port "$dir" 1)
export AWS_REGION=$REGION
export CONDENSE_S3_BUCKET=$BUCKET
export AWS_ALLOW_HTTP=true
export GARAGE_S3_ENDPOINTS="$endpoints"
EOF
    )
    wait_s3 "$dir"
    trap - EXIT
    say "3 nodes up in $dir (S3: $endpoints; bucket $BUCKET); credentials in $dir/credentials.env"
}

cmd_stop() {
    local dir=$1 n pid pids=() end
    [ -f "$dir/ports" ] || die "$dir holds no cluster"
    for n in $(seq 1 $NODES); do
        if pid=$(node_pid "$dir" "$n"); then kill -TERM "$pid"; pids+=("$pid"); fi
    done
    end=$((SECONDS + 30))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null; do
            if [ "$SECONDS" -ge "$end" ]; then
                echo "garage.sh: PID $pid ignored SIGTERM for 30 s: SIGKILL" >&2
                kill -KILL "$pid" 2>/dev/null || true
            fi
            sleep 0.1
        done
    done
    say "stopped ${#pids[@]} node(s) in $dir"
}

cmd_kill() {
    local dir=$1 n=$2 pid
    [[ "$n" =~ ^[1-3]$ ]] || die "node number must be 1..$NODES, not '$n'"
    pid=$(node_pid "$dir" "$n") || die "node $n of $dir is not running"
    kill -KILL "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
    say "killed node $n (PID $pid)"
}

cmd_restart() {
    local dir=$1 n started=()
    shift
    [ -f "$dir/ports" ] || die "$dir holds no cluster: '$0 start $dir' makes one"
    D=$dir
    find_garage
    local which=("$@")
    if [ ${#which[@]} -eq 0 ]; then mapfile -t which < <(seq 1 $NODES); fi
    for n in "${which[@]}"; do
        [[ "$n" =~ ^[1-3]$ ]] || die "node number must be 1..$NODES, not '$n'"
        if node_pid "$dir" "$n" >/dev/null; then continue; fi
        start_node "$dir" "$n"
        started+=("$n")
    done
    [ ${#started[@]} -gt 0 ] || { say "all requested nodes were already running"; return; }
    sleep 0.5
    check_started "$dir" "${started[@]}"
    wait_s3 "$dir"
    say "started node(s) ${started[*]} in $dir"
}

cmd_status() {
    local dir=$1 n pid
    [ -f "$dir/ports" ] || die "$dir holds no cluster"
    find_garage
    for n in $(seq 1 $NODES); do
        if pid=$(node_pid "$dir" "$n"); then
            echo "node $n: running, PID $pid, S3 http://127.0.0.1:$(s3_port "$dir" "$n")"
        else
            echo "node $n: stopped"
        fi
    done
    cli "$dir" status
}

# absdir DIR: DIR as an absolute path (node configs and the PID check use absolute paths).
absdir() { [ -d "$1" ] || die "no directory $1"; (cd "$1" && pwd); }

case "${1:-}" in
    -h | --help | help) usage ;;
    start)
        [ $# -eq 2 ] || die "usage: $0 start DIR"
        mkdir -p "$2"
        cmd_start "$(absdir "$2")"
        ;;
    stop) [ $# -eq 2 ] || die "usage: $0 stop DIR"; cmd_stop "$(absdir "$2")" ;;
    kill) [ $# -eq 3 ] || die "usage: $0 kill DIR N"; cmd_kill "$(absdir "$2")" "$3" ;;
    restart) [ $# -ge 2 ] || die "usage: $0 restart DIR [N...]"; cmd_restart "$(absdir "$2")" "${@:3}" ;;
    status) [ $# -eq 2 ] || die "usage: $0 status DIR"; cmd_status "$(absdir "$2")" ;;
    cli)
        [ $# -ge 3 ] || die "usage: $0 cli DIR ARGS..."
        find_garage
        cli "$(absdir "$2")" "${@:3}"
        ;;
    *) usage >&2; exit 2 ;;
esac
