#!/usr/bin/env bash
# The metrics endpoint under a slow-client flood (issue 39, part 4), end to end with
# `condense serve --metrics-listen`:
#
#   1. 1,000 slow clients held open for 20 s (python3): 500 silent, 450 sending a request head a
#      byte a second (slowloris), 50 sending a whole request and never reading the answer; each
#      one the server closes is opened again at once, so there are 1,000 all along. Meanwhile
#      curl scrapes every second, 15 times, --max-time 3: every scrape is answered with the
#      pool's metrics. The server's open files stay under its cap, and once the flood ends its
#      open files come back to where they were and its RSS stays bounded. Head timeouts are
#      counted in condense_metrics_connections_dropped_total.
#   2. A flood beyond the connection cap (condense_metrics_connections_max, 2,048 with the
#      usual open-files limits): cap + 1,000 silent and slowloris clients. The oldest are
#      closed to make room (reason="evicted"), the open files stay bounded, and every scrape
#      is answered.
#
# (Before: 64 connections held open made 7 scrapes in 8 fail.)
#
#   bash tests/security/metrics-flood.sh
#   CONDENSE=/path/to/condense bash tests/security/metrics-flood.sh
#
# Needs (Debian): python3 curl. Ends with "N passed, M failed,
# K skipped". KEEP=1 keeps the work directory of a failed run.

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools python3 curl

W=$(mktemp -d /tmp/condense-metrics-flood.XXXXXX)
POOL=$W/pool
SOCK=$W/nbd.sock
free_port MPORT
METRICS=http://127.0.0.1:$MPORT/metrics
SERVER_PID=
HELPER_PID=

cleanup() {
    [ -n "$HELPER_PID" ] && kill "$HELPER_PID" 2>/dev/null
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

finish() { summary; exit $?; }
fds() { find "/proc/$1/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
metric() { curl -sf --max-time 3 "$METRICS" | awk -v s="$1" '$1 == s { print $2 }'; }

# The slow clients, in python3.
cat >"$W/flood.py" <<'EOF'
import json, resource, select, socket, sys, time

HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
GONE = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLRDHUP
NEVER_READ_GONE = select.POLLHUP | select.POLLERR | select.POLLRDHUP

def main(port, silent, slowloris, never_read, seconds):
    want = silent + slowloris + never_read + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < want:
        print(f"skip: the open-files limit is {hard}; {want} are needed", flush=True)
        sys.exit(2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))

    kinds = ["silent"] * silent + ["slowloris"] * slowloris + ["never-read"] * never_read
    reopened = {k: 0 for k in set(kinds)}
    failed = 0

    def open_one(kind):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        if kind == "never-read":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect(("127.0.0.1", port))
        if kind == "never-read":
            s.sendall(REQUEST)
        elif kind == "slowloris":
            s.sendall(HEAD[:1])
        s.setblocking(False)
        return s

    socks = [None] * len(kinds)
    sent = [1] * len(kinds)
    for i, k in enumerate(kinds):
        try:
            socks[i] = open_one(k)
        except OSError:
            failed += 1
    print("ready", flush=True)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        tick = time.monotonic()
        poller = select.poll()
        fd_of = {}
        for i, s in enumerate(socks):
            if s is not None:
                poller.register(s, NEVER_READ_GONE if kinds[i] == "never-read" else GONE)
                fd_of[s.fileno()] = i
        gone = {fd_of[fd] for fd, _ in poller.poll(0)}
        for i, k in enumerate(kinds):
            s = socks[i]
            if s is not None and i not in gone and k == "slowloris":
                try:
                    s.send(HEAD[sent[i] % len(HEAD):][:1] if sent[i] < len(HEAD) else b"a")
                    sent[i] += 1
                except OSError:
                    gone.add(i)
            if s is None or i in gone:
                if s is not None:
                    s.close()
                    reopened[k] += 1
                try:
                    socks[i] = open_one(k)
                    sent[i] = 1
                except OSError:
                    socks[i] = None
                    failed += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    print(json.dumps({"reopened": reopened, "connect_failures": failed}), flush=True)

if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:6]))
EOF

# flood NAME SILENT SLOWLORIS NEVER_READ SECONDS SCRAPES: run the flood, scrape once a second
# meanwhile, and check every scrape; the server's most open files go to $W/NAME.fds.
flood() {
    local name=$1 scrapes=$6 i t0 t1 good=0 slowest=0 most=0 n
    python3 "$W/flood.py" "$MPORT" "$2" "$3" "$4" "$5" >"$W/$name.out" 2>&1 &
    HELPER_PID=$!
    for _ in $(seq 1 300); do
        grep -q "ready\|skip" "$W/$name.out" && break
        kill -0 "$HELPER_PID" 2>/dev/null || break
        sleep 0.1
    done
    if ! grep -q ready "$W/$name.out"; then
        if grep -q skip "$W/$name.out"; then
            skip "$name" "$(sed -n 's/^skip: //p' "$W/$name.out")"
        else
            fail "$name: the slow clients started" "$W/$name.out"
        fi
        wait "$HELPER_PID" 2>/dev/null
        HELPER_PID=
        return 1
    fi
    sleep 1
    for i in $(seq 1 "$scrapes"); do
        t0=$(now_ms)
        if curl -sf --max-time 3 -o "$W/scrape" "$METRICS" &&
            grep -q '^condense_pool_logical_bytes ' "$W/scrape"; then
            good=$((good + 1))
        else
            echo "scrape $i failed" >>"$W/$name.failures"
        fi
        t1=$(now_ms)
        [ $((t1 - t0)) -gt "$slowest" ] && slowest=$((t1 - t0))
        n=$(fds "$SERVER_PID")
        [ "$n" -gt "$most" ] && most=$n
        sleep "0.$((1000 - (t1 - t0) % 1000))" 2>/dev/null || sleep 1
    done
    echo "$most" >"$W/$name.fds"
    wait "$HELPER_PID" 2>/dev/null
    HELPER_PID=
    echo "    ($name: $good of $scrapes scrapes answered, the slowest in $slowest ms;" \
        "server open files at most $most; clients: $(tail -1 "$W/$name.out"))"
    if [ "$good" = "$scrapes" ]; then
        ok "$name: all $scrapes scrapes answered with the pool's metrics"
    else
        cp "$W/$name.failures" "$W/out" 2>/dev/null
        fail "$name: all $scrapes scrapes answered with the pool's metrics ($good were)"
    fi
}

"$CONDENSE" --pool "$POOL" init >"$W/out" 2>&1 || { fail "condense init"; finish; }
"$CONDENSE" --pool "$POOL" volume create vm --size 64M >"$W/out" 2>&1 ||
    { fail "volume create"; finish; }
"$CONDENSE" --pool "$POOL" serve --socket "$SOCK" --metrics-listen "127.0.0.1:$MPORT" \
    >"$W/serve.log" 2>&1 &
SERVER_PID=$!
wait_ready "$SERVER_PID" "$W/serve.log" curl -sf "$METRICS" || finish
fds_idle=$(fds "$SERVER_PID")
rss_idle=$(kib "$SERVER_PID" VmRSS)
cap=$(metric condense_metrics_connections_max)
nofile=$(awk '/^Max open files/ { print $4 }' "/proc/$SERVER_PID/limits")
echo "    (serve: $fds_idle open files, RSS $rss_idle KiB; connection cap ${cap:-?}," \
    "open-files limit $nofile)"
if [ "${nofile:-0}" -ge 8192 ]; then
    expect_ge "the connection cap holds a flood of 1,000" "${cap:-0}" 1024
else
    skip "the connection cap holds a flood of 1,000" \
        "the open-files limit is $nofile (hard), so the cap is a quarter of it"
fi

# --- 1. 1,000 slow clients -----------------------------------------------------------------
if flood "1,000 slow clients" 500 450 50 20 15; then
    expect_le "... the server's open files stay under its cap" \
        "$(cat "$W/1,000 slow clients.fds")" $((fds_idle + ${cap:-0} + 8))
    # Their sockets are closed now; the server notices within its deadlines (10 s at most).
    for _ in $(seq 1 120); do
        [ "$(fds "$SERVER_PID")" -le $((fds_idle + 2)) ] && break
        sleep 0.1
    done
    expect_le "... once they are gone, the server's open files are back to idle" \
        "$(fds "$SERVER_PID")" $((fds_idle + 2))
    expect_le "... its RSS stays bounded (growth in KiB)" \
        $(($(kib "$SERVER_PID" VmRSS) - rss_idle)) $((32 << 10))
    expect_le "... and its peak RSS too (VmHWM growth in KiB)" \
        $(($(kib "$SERVER_PID" VmHWM) - rss_idle)) $((64 << 10))
    expect_ge "... head timeouts counted in condense_metrics_connections_dropped_total" \
        "$(metric 'condense_metrics_connections_dropped_total{reason="head_timeout"}')" 500
    expect_ge "... connections counted in condense_metrics_connections_total" \
        "$(metric condense_metrics_connections_total)" 1000
fi

# --- 2. More slow clients than the cap -----------------------------------------------------
over=$((${cap:-2048} + 1000))
before=$(metric 'condense_metrics_connections_dropped_total{reason="evicted"}')
if flood "$over slow clients (cap + 1,000)" $((over / 2)) $((over - over / 2)) 0 10 6; then
    expect_le "... the server's open files stay under its cap" \
        "$(cat "$W/$over slow clients (cap + 1,000).fds")" $((fds_idle + ${cap:-0} + 8))
    after=$(metric 'condense_metrics_connections_dropped_total{reason="evicted"}')
    expect_ge "... the oldest were closed to make room (reason=\"evicted\")" \
        $((${after:-0} - ${before:-0})) 1000
fi

finish
