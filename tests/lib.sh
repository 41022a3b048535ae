# The harness every tests/*/run.sh sources: the binary under test, result counters and the
# checks that print "ok - NAME" / "FAIL - NAME" / "skip - NAME: WHY".
#
#   ROOT=$(cd "$(dirname "$0")/../.." && pwd)
#   . "$ROOT/tests/lib.sh"
#   need_tools qemu-img nbdinfo      # a missing tool is an error naming scripts/install-deps.sh
#   W=$(mktemp -d ...)               # work directory: check/refuse keep the last output in $W/out
#   check "NAME" cmd args...         # pass if cmd exits 0
#   refuse "NAME" PATTERN cmd...     # pass if cmd fails and its output matches PATTERN
#   summary                          # "N passed, M failed, K skipped"; non-zero if anything failed
#
# skip: a test that cannot run on this machine (no root, no /dev/fuse) says why; under CI
# (CI=true) a skip is a failure, because CI must run everything.
# shellcheck shell=bash

passed=0
failed=0
skipped=0

# The binary under test: $CONDENSE, else built here (honouring CARGO_TARGET_DIR).
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense) || { echo "build failed"; exit 1; }
    CONDENSE=${CARGO_TARGET_DIR:-$ROOT/target}/release/condense
fi

# need_tools TOOL...: exit with an error naming the first missing tool.
need_tools() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null || { echo "missing $t: run scripts/install-deps.sh"; exit 1; }
    done
}

# free_port VAR: set VAR to a TCP port on 127.0.0.1 that nothing listens on, below the kernel's
# ephemeral range (net.ipv4.ip_local_port_range starts at 32768), so that no outgoing connection
# can take it between this pick and the test's listen. Never the same port twice in one script.
PICKED_PORTS=" "
free_port() {
    local p
    for _ in $(seq 1 200); do
        p=$((10000 + RANDOM % 22000))
        case "$PICKED_PORTS" in *" $p "*) continue ;; esac
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && continue
        PICKED_PORTS="$PICKED_PORTS$p "
        printf -v "$1" '%s' "$p"
        return 0
    done
    echo "no free TCP port found on 127.0.0.1" >&2
    exit 1
}

ok() { passed=$((passed + 1)); echo "ok - $1"; }

# fail NAME [LOG]: the tail of LOG (default: the last check's output, $W/out) is shown.
fail() {
    failed=$((failed + 1))
    echo "FAIL - $1"
    local log=${2:-${W:-/nonexistent}/out}
    if [ -f "$log" ]; then tail -20 "$log" | sed 's/^/    | /'; fi
}

# skip NAME WHY
skip() {
    if [ "${CI:-}" = true ]; then
        fail "$1 (cannot run here: $2; CI must run it)"
    else
        skipped=$((skipped + 1))
        echo "skip - $1: $2"
    fi
}

# check NAME CMD...: pass if CMD exits 0 (its output goes to $W/out).
check() {
    local name=$1
    shift
    if "$@" >"$W/out" 2>&1; then ok "$name"; else fail "$name" "$W/out"; fi
}

# refuse NAME PATTERN CMD...: pass if CMD fails and its output matches PATTERN (grep; an empty
# PATTERN accepts any failure).
refuse() {
    local name=$1 pattern=$2
    shift 2
    if "$@" >"$W/out" 2>&1; then
        fail "$name (it succeeded)"
    elif [ -z "$pattern" ] || grep -q -- "$pattern" "$W/out"; then
        ok "$name"
    else
        fail "$name (no \"$pattern\" in the error)" "$W/out"
    fi
}

# stop_pids PID...: SIGTERM each running one (empty arguments are skipped) and reap it.
stop_pids() {
    local p
    for p in "$@"; do
        [ -n "$p" ] || continue
        kill -TERM "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
}

# remove_work_dir: delete $W, or keep it (and say where) when something failed and KEEP=1.
remove_work_dir() {
    if [ "$failed" -gt 0 ] && [ "${KEEP:-0}" = 1 ]; then
        echo "work files kept in $W"
    else
        rm -rf "$W"
    fi
}

# wait_ready PID LOG CMD...: poll CMD (quietly) for up to 10 s until it succeeds; fails early
# if process PID has ended, and then shows the tail of LOG.
wait_ready() {
    local pid=$1 log=$2
    shift 2
    for _ in $(seq 1 100); do
        "$@" >/dev/null 2>&1 && return 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "server did not start:"
    tail -20 "$log"
    return 1
}

# The `condense serve` of a script whose volume is vm: on $POOL at 127.0.0.1:$PORT (plaintext,
# unauthenticated TCP: --insecure-listen, fine on a test machine), its log in
# $W/server.log, its PID in SERVER_PID (the script's cleanup runs stop_pids "$SERVER_PID").
# serve_vm: start it; ready once vm answers over NBD and the control socket is up.
serve_vm() {
    rm -f "$W/server.log"
    "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" >"$W/server.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/server.log" serving_vm || exit 1
}
serving_vm() { [ -S "$POOL/control.sock" ] && nbdinfo --size "nbd://127.0.0.1:$PORT/vm"; }
# stop_server / kill9_server: end it with SIGTERM / SIGKILL and reap it.
stop_server() { kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; }
kill9_server() { kill -KILL "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; }

# expect_le NAME VALUE MAX / expect_ge NAME VALUE MIN: pass if the integer VALUE is at most MAX
# / at least MIN (an empty VALUE fails).
expect_le() {
    if [ -n "$2" ] && [ "$2" -le "$3" ]; then ok "$1 ($2 <= $3)"; else
        echo "got '$2', want at most $3" >"$W/out"
        fail "$1"
    fi
}
expect_ge() {
    if [ -n "$2" ] && [ "$2" -ge "$3" ]; then ok "$1 ($2 >= $3)"; else
        echo "got '$2', want at least $3" >"$W/out"
        fail "$1"
    fi
}

# kib PID FIELD: a /proc/PID/status figure in KiB (VmRSS, VmHWM).
kib() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }

# summary: print the counts; the return status is non-zero if anything failed.
summary() {
    echo
    echo "$passed passed, $failed failed, $skipped skipped"
    [ "$failed" -eq 0 ]
}
