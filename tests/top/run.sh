#!/usr/bin/env bash
# End-to-end test of `condense top` (alias `iostat`), the live per-volume view of a served
# pool: fio writes and reads one volume over NBD while another stays idle, and `top` must show
# the load on the right volume in its first report (one interval, 1 s) — through --json (jq),
# the plain lines for logs, and the full-screen view driven in tmux (capture-pane, then q and
# Ctrl-C, which must leave the terminal as it was). Then the same pool under `condense mount`:
# writes through FUSE count too. And without a server, `top` says what to run.
#
#   bash tests/top/run.sh            # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/top/run.sh
#
# Needs (Debian): libnbd-bin fio tmux jq; the FUSE part needs root or fusermount3 (it skips,
# saying why, elsewhere; under CI=true a skip fails).

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools nbdinfo fio tmux jq

W=$(mktemp -d /tmp/condense-top.XXXXXX)
POOL=$W/pool
SOCK=$W/nbd.sock
MNT=$W/mnt
SERVER_PID=
FIO_PID=
TMUX_SOCKET=condense-top-$$

cleanup() {
    tmux -L "$TMUX_SOCKET" kill-server 2>/dev/null
    stop_pids "$FIO_PID" "$SERVER_PID"
    if grep -q " $MNT " /proc/mounts 2>/dev/null; then
        umount "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT" 2>/dev/null
    fi
    remove_work_dir
}
trap cleanup EXIT

condense() { "$CONDENSE" --pool "$POOL" "$@"; }
t() { tmux -L "$TMUX_SOCKET" "$@"; }

cd "$W" || exit 1
echo "condense: $CONDENSE; work dir $W"

condense init >"$W/out" 2>&1 || fail "condense init"
condense volume create busy --size 256M >/dev/null || fail "volume create busy"
condense volume create idle --size 256M >/dev/null || fail "volume create idle"

# ---------------------------------------------------------------------------------------
# No server: a clear error that says what to run.
refuse "top without a server says to start condense serve or mount" \
    "start \`condense --pool .* serve\` (or \`mount\`) first" condense top --count 1

# ---------------------------------------------------------------------------------------
# Served over NBD; fio keeps 'busy' loaded: random 4 KiB writes of half-compressible data (so
# compression has something to show) and random reads of its first 16 MiB, written first (a
# read of a hole is answered from block status over NBD and reaches no read to count).
# 'idle' is never touched.
"$CONDENSE" --pool "$POOL" serve --socket "$SOCK" >"$W/server.log" 2>&1 &
SERVER_PID=$!
serving() { [ -S "$POOL/control.sock" ] && nbdinfo --size "nbd+unix:///busy?socket=$SOCK"; }
wait_ready "$SERVER_PID" "$W/server.log" serving || exit 1
fio --name=fill --ioengine=nbd --uri="nbd+unix:///busy?socket=$SOCK" --rw=write --bs=1M \
    --size=16M --output="$W/fill.log" || fail "fio fills busy's first 16 MiB" "$W/fill.log"
cat >"$W/busy.fio" <<EOF
[global]
ioengine=nbd
uri=nbd+unix:///busy?socket=$SOCK
bs=4k
iodepth=4
time_based=1
runtime=120
[writes]
rw=randwrite
size=64M
rate_iops=400
buffer_compress_percentage=50
refill_buffers=1
[reads]
rw=randread
size=16M
rate_iops=200
EOF
fio "$W/busy.fio" >"$W/fio.log" 2>&1 &
FIO_PID=$!
# Wait until fio's writes arrive (top's own --json is the probe).
for _ in $(seq 1 50); do
    condense top --json --count 1 --interval 0.2 2>/dev/null |
        jq -e '.volumes[] | select(.name == "busy" and .write_ops > 0)' >/dev/null && break
    kill -0 "$FIO_PID" 2>/dev/null || break
done
kill -0 "$FIO_PID" 2>/dev/null || { fail "fio runs against busy" "$W/fio.log"; exit 1; }

# --json: one object per interval; the load is on busy from the first interval on, idle has
# none, busy comes first.
condense top --json --count 2 --interval 1 >"$W/top.json" 2>"$W/out"
lines=$(wc -l <"$W/top.json")
if [ "$lines" = 2 ] && jq -e . "$W/top.json" >/dev/null 2>&1; then
    ok "top --json --count 2 prints two JSON objects"
else
    fail "top --json --count 2 prints two JSON objects ($lines lines)" "$W/top.json"
fi
busy_first=$(head -1 "$W/top.json" | jq -r \
    '[.volumes[] | select(.name == "busy")][0] | (.write_ops > 0 and .read_ops > 0 and .write_iops > 0
      and .write_p50_us > 0 and .write_p99_us >= .write_p50_us and .read_p50_us > 0
      and .dedup_hit_ratio != null and .compression_ratio > 1)')
idle_all=$(jq -s '[.[].volumes[] | select(.name == "idle")] | length == 2 and
    all(.read_ops == 0 and .write_ops == 0 and .zero_ops == 0 and .write_p50_us == null)' "$W/top.json")
order=$(head -1 "$W/top.json" | jq -r '[.volumes[].name] | join(",")')
if [ "$busy_first" = true ] && [ "$idle_all" = true ] && [ "$order" = busy,idle ]; then
    ok "top --json: the first interval shows busy's writes, reads, latency and reduction; idle shows none"
else
    echo "busy in the first interval: $busy_first; idle zero in both: $idle_all; order: $order" >>"$W/top.json"
    fail "top --json shows the load on the right volume" "$W/top.json"
fi
# Its rate matches fio's: 400 writes/s asked (fio's rate limit; a loaded machine does less).
wiops=$(head -1 "$W/top.json" | jq '[.volumes[] | select(.name == "busy")][0].write_iops')
echo "busy write IOPS shown in the first interval: $wiops (fio asks for 400)"
if jq -en "$wiops > 40 and $wiops < 700" >/dev/null; then
    ok "top --json: busy's write IOPS ($wiops) is fio's rate"
else
    fail "top --json: busy's write IOPS ($wiops) is fio's rate (400, or less on a loaded machine)" "$W/top.json"
fi

# Plain lines (stdout not a terminal): a header, one line per volume, no escape codes.
condense top --count 1 --interval 1 >"$W/plain" 2>"$W/out"
if [ "$(wc -l <"$W/plain")" = 3 ] && head -1 "$W/plain" | grep -q '^TIME *VOLUME *r/s *w/s' &&
    ! grep -q $'\x1b' "$W/plain" && awk '$2 == "busy" && $4 > 0 {b=1} $2 == "idle" && $3 == 0 && $4 == 0 {i=1} END {exit !(b && i)}' "$W/plain"; then
    ok "top (not a terminal): plain lines, busy writing, idle quiet, no escape codes"
else
    fail "top (not a terminal): plain lines" "$W/plain"
fi
refuse "top refuses a bad interval" "invalid interval" condense top --interval 0

# ---------------------------------------------------------------------------------------
# The full-screen view in a terminal (tmux): the first report (after 1 s) shows busy writing
# and idle quiet, busy above idle; q, Ctrl-C and SIGTERM each end it, and the terminal is left
# as it was: the normal screen, echo and canonical input back on (stty).
screen_test() { # NAME KEY: start top in tmux, check its first report, press KEY (or send SIGTERM)
    local name=$1 key=$2 started report="" waited
    t kill-server 2>/dev/null
    t new-session -d -x 160 -y 30 -s top "$CONDENSE --pool $POOL top; echo exited \$?; stty -a | grep -q ' icanon .* echo ' && echo terminal-restored; sleep 30"
    started=$(date +%s%N)
    for _ in $(seq 1 100); do
        t capture-pane -p -t top >"$W/pane" 2>/dev/null
        if grep -q '^busy ' "$W/pane"; then report=1; break; fi
        sleep 0.05
    done
    waited=$((($(date +%s%N) - started) / 1000000))
    if [ -n "$report" ] && grep -q 'condense top: pool' "$W/pane" &&
        awk '$1 == "busy" && $3 > 0 {b=NR} $1 == "idle" && $2 == 0 && $3 == 0 {i=NR} END {exit !(b && i && b < i)}' "$W/pane"; then
        ok "$name: the first report (after ${waited} ms) shows busy writing above an idle idle"
    else
        fail "$name: the first report shows busy writing, idle quiet (waited ${waited} ms)" "$W/pane"
    fi
    if [ "$key" = SIGTERM ]; then
        # The pane's shell runs top as its only child.
        kill -TERM $(cat "/proc/$(t list-panes -t top -F '#{pane_pid}')/task/"*/children)
    else
        t send-keys -t top "$key"
    fi
    for _ in $(seq 1 40); do
        t capture-pane -p -t top >"$W/pane" 2>/dev/null
        grep -q '^terminal-restored' "$W/pane" && break
        sleep 0.05
    done
    # Back on the normal screen: the table is gone, the shell's line is there.
    if grep -q '^exited 0' "$W/pane" && grep -q '^terminal-restored' "$W/pane" && ! grep -q 'VOLUME' "$W/pane"; then
        ok "$name: quits with status 0 and restores the screen"
    else
        fail "$name: quits with status 0 and restores the screen" "$W/pane"
    fi
    t kill-server 2>/dev/null
}
screen_test "top in a terminal, q" q
screen_test "top in a terminal, Ctrl-C" C-c
screen_test "top in a terminal, SIGTERM" SIGTERM

stop_pids "$FIO_PID"
FIO_PID=
stop_pids "$SERVER_PID"
SERVER_PID=

# ---------------------------------------------------------------------------------------
# FUSE: the counters are beneath the frontends, so writes through a mount count too.
if [ "$(id -u)" != 0 ] && ! command -v fusermount3 >/dev/null; then
    skip "top counts FUSE writes" "not root and no fusermount3 (apt-get install fuse3)"
elif [ ! -e /dev/fuse ]; then
    skip "top counts FUSE writes" "no /dev/fuse"
else
    mkdir -p "$MNT"
    "$CONDENSE" --pool "$POOL" mount "$MNT" >"$W/mount.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/mount.log" test -S "$POOL/control.sock" || exit 1
    for _ in $(seq 1 50); do [ -e "$MNT/volumes/idle" ] && break; sleep 0.1; done
    # 8 MiB of random data written to 'idle' while top reports three intervals.
    (sleep 0.3; dd if=/dev/urandom of="$MNT/volumes/idle" bs=1M count=8 oflag=direct conv=notrunc 2>"$W/dd.log") &
    dd_pid=$!
    condense top --json --count 3 --interval 1 >"$W/fuse.json" 2>"$W/out"
    wait "$dd_pid"
    if jq -se '[.[].volumes[] | select(.name == "idle")] | (map(.write_bytes) | add) == 8388608 and
        (map(.new_blocks) | add) == 2048' "$W/fuse.json" >/dev/null &&
        jq -se '[.[].volumes[] | select(.name == "busy")] | all(.write_ops == 0)' "$W/fuse.json" >/dev/null; then
        ok "top under condense mount: 8 MiB written through FUSE show on that volume, none on the other"
    else
        fail "top under condense mount counts FUSE writes" "$W/fuse.json"
    fi
    stop_pids "$SERVER_PID"
    SERVER_PID=
fi

summary
