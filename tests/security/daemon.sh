#!/usr/bin/env bash
# The CLI authenticates the daemon end to end (issue 39, part 5: "the CLI trusts whatever listens
# on POOL/control.sock"), with a second Unix account made here and forged daemons in python3:
#
#   another account's socket: in a root-owned pool directory that account may write to, it
#     binds control.sock and answers a forged "no damage" with escape sequences and exit 0 (or
#     an endless reply); root's `verify`, `stats` and `volume list` refuse it, naming the socket,
#     the uid found and the uid expected, exit non-zero, print no ESC byte and stay small;
#     the same through a control.sock that is a symlink to that account's socket ->
#   the pool owner's daemon: a `condense serve` run by the account on its own pool is used by
#     root's CLI (a write through it, while serve holds the pool) ->
#   a trusted uid (root's forger on root's pool): an endless reply stops the CLI with an error
#     naming the limit, its memory stays small; the escape sequences of a forged reply are not
#     printed; an exit status no process can have (256, which exit() would turn into 0) fails.
#
#   sudo bash tests/security/daemon.sh      # builds target/release/condense first
#   sudo CONDENSE=/path/to/condense bash tests/security/daemon.sh
#
# Needs root (useradd, runuser; skipped with the reason otherwise, a failure under CI=true),
# passwd (useradd), util-linux (runuser), python3, time (/usr/bin/time for the peak RSS).
# Ends with "N passed, M failed, K skipped".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"

if [ "$(id -u)" != 0 ]; then
    skip "daemon: the CLI trusts only the pool owner's daemon" "needs root to create the account (useradd) and act as it (runuser)"
    summary
    exit $?
fi
need_tools useradd userdel runuser python3 /usr/bin/time

W=$(mktemp -d /tmp/condense-daemon.XXXXXX)
chmod 755 "$W"
U=cdmn$$ # the other Unix account
SERVER_PID=
FORGERS=() # pid files of the forged daemons
cleanup() {
    local f
    for f in "${FORGERS[@]}"; do [ -s "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null; done
    stop_pids "$SERVER_PID"
    userdel "$U" >/dev/null 2>&1
    remove_work_dir
}
trap cleanup EXIT

if useradd --no-create-home --shell /usr/sbin/nologin "$U"; then
    ok "a second Unix account $U made for this test"
else
    fail "a second Unix account $U made for this test"
    exit 1
fi
UID_U=$(id -u "$U")
as_user() { runuser -u "$U" -- "$@"; }
install -m 755 "$CONDENSE" "$W/condense" # wherever $CONDENSE is, the other user can run this

# A forged daemon: listens on SOCK and answers every connection as MODE says, after reading
# what the client sends (if anything, for at most 5 s). It writes its pid to PIDFILE and ends
# by itself after 10 minutes.
cat >"$W/forger.py" <<'EOF'
import os, socket, sys, threading

sock_path, mode, pid_file = sys.argv[1:4]
ESC = "\\u001b[2J\\u001b[H\\u001b]0;owned\\u0007\\u009b31m"
FORGED = '{"stdout": "' + ESC + 'verify: no damage found\\n", "stderr": "", "code": %d}\n'

def answer(c):
    try:
        c.settimeout(5)
        try:
            while True:
                got = c.recv(65536)
                if not got or b"\n" in got:
                    break
        except OSError:
            pass
        c.settimeout(60)
        if mode == "forged":
            c.sendall((FORGED % 0).encode())
        elif mode == "bad-code":
            c.sendall((FORGED % 256).encode())
        elif mode == "endless":
            c.sendall(b'{"stdout": "')
            chunk = (ESC + "no damage ").encode() * 4096
            while True:
                c.sendall(chunk)
    except OSError:
        pass
    finally:
        c.close()

s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sock_path)
os.chmod(sock_path, 0o777)
s.listen(16)
with open(pid_file, "w") as f:
    f.write(str(os.getpid()))
threading.Timer(600, lambda: os._exit(0)).start()
while True:
    c, _ = s.accept()
    threading.Thread(target=answer, args=(c,), daemon=True).start()
EOF
chmod 644 "$W/forger.py"

# forge WHO SOCK MODE: start a forged daemon as WHO (root or $U) on SOCK; ready once it listens.
forge() {
    local who=$1 sock=$2 mode=$3 pidfile
    pidfile=$W/forger.$RANDOM.pid
    : >"$pidfile"
    chmod 666 "$pidfile"
    FORGERS+=("$pidfile")
    if [ "$who" = root ]; then
        python3 "$W/forger.py" "$sock" "$mode" "$pidfile" >"$W/forger.log" 2>&1 &
    else
        runuser -u "$who" -- python3 "$W/forger.py" "$sock" "$mode" "$pidfile" >"$W/forger.log" 2>&1 &
    fi
    for _ in $(seq 1 100); do
        [ -s "$pidfile" ] && return 0
        sleep 0.1
    done
    fail "forged daemon ($mode, as $who) listens on $sock" "$W/forger.log"
    return 1
}
# unforge: stop every forged daemon.
unforge() {
    local f
    for f in "${FORGERS[@]}"; do
        [ -s "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null
    done
    FORGERS=()
    sleep 0.2
}

# run_cli NAME POOL ARGS...: root's condense on POOL (60 s at most), its output in $W/NAME.out,
# its exit status in $W/NAME.rc, its peak RSS (KiB) in $W/NAME.rss.
run_cli() {
    local name=$1 pool=$2
    shift 2
    /usr/bin/time -o "$W/$name.rss" -f %M timeout 60 "$CONDENSE" --pool "$pool" "$@" \
        >"$W/$name.out" 2>&1
    echo $? >"$W/$name.rc"
    tail -1 "$W/$name.rss" >"$W/$name.rss.1" && mv "$W/$name.rss.1" "$W/$name.rss"
}
rc_of() { cat "$W/$1.rc"; }
rss_of() { cat "$W/$1.rss"; }
# clean NAME: no control character in the output but newline and tab (no ESC, BEL, CSI, CR).
clean() {
    cat "$W/$1.out"
    ! LC_ALL=C grep -qP '[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]' "$W/$1.out"
}
# refused NAME: non-zero, and the message names the socket, the uid found and the one expected.
refused() {
    local name=$1 sock=$2 found=$3 expected=$4
    cat "$W/$name.out"
    [ "$(rc_of "$name")" -ne 0 ] && [ "$(rc_of "$name")" -ne 124 ] &&
        grep -qF "refusing control socket $sock" "$W/$name.out" &&
        grep -qF "runs as uid $found" "$W/$name.out" &&
        grep -qF "belongs to uid $expected" "$W/$name.out" &&
        ! grep -q "no damage" "$W/$name.out"
}
# rss_below NAME MIB: the command's peak RSS was under MIB MiB.
rss_below() {
    echo "peak RSS $(($(rss_of "$1") / 1024)) MiB, limit $2 MiB"
    [ "$(rss_of "$1")" -lt $(($2 * 1024)) ]
}

# --- 1. Another account's socket in a root-owned pool ----------------------------------------
POOL=$W/rootpool
"$CONDENSE" init "$POOL" >"$W/init.log" 2>&1 &&
    "$CONDENSE" --pool "$POOL" volume create vm --size 4M >>"$W/init.log" 2>&1 ||
    { fail "a root-owned pool made" "$W/init.log"; exit 1; }
chmod 777 "$POOL" # an administrator's mistake: now $U can put a socket there
SOCK=$POOL/control.sock
if forge "$U" "$SOCK" forged; then
    check "the forged socket is $U's" test "$(stat -c %U "$SOCK")" = "$U"
    for cmd in verify stats "volume list"; do
        # shellcheck disable=SC2086
        run_cli "u-$cmd" "$POOL" $cmd
        check "root's \`$cmd\`: $U's control socket refused (socket, uid $UID_U found, uid 0 expected; exit non-zero)" \
            refused "u-$cmd" "$SOCK" "$UID_U" 0
        check "... and no control character printed" clean "u-$cmd"
    done
    check "... and the message says what to do" grep -qF "chmod 700 $POOL" "$W/u-verify.out"
fi
unforge
rm -f "$SOCK"
if forge "$U" "$SOCK" endless; then
    run_cli u-endless "$POOL" verify
    check "$U's endless forged daemon: refused before anything is read" \
        refused u-endless "$SOCK" "$UID_U" 0
    check "... in little memory" rss_below u-endless 100
fi
unforge
rm -f "$SOCK"

# control.sock a symlink to the account's socket elsewhere.
mkdir -m 755 "$W/elsewhere"
chown "$U" "$W/elsewhere"
if forge "$U" "$W/elsewhere/fake.sock" forged; then
    as_user ln -s "$W/elsewhere/fake.sock" "$SOCK"
    run_cli u-link "$POOL" verify
    check "control.sock a symlink to $U's socket: refused" refused u-link "$SOCK" "$UID_U" 0
    check "... and no control character printed" clean u-link
fi
unforge
rm -f "$SOCK"
chmod 700 "$POOL"
run_cli direct "$POOL" verify
check "with the forged socket gone, root's verify opens the pool itself" \
    test "$(rc_of direct)" = 0

# --- 2. The pool owner's daemon --------------------------------------------------------------
mkdir -m 755 "$W/u"
chown "$U" "$W/u"
UPOOL=$W/u/pool
as_user "$W/condense" init "$UPOOL" >"$W/uinit.log" 2>&1 &&
    as_user "$W/condense" --pool "$UPOOL" volume create vm --size 4M >>"$W/uinit.log" 2>&1 ||
    fail "a pool owned by $U made" "$W/uinit.log"
runuser -u "$U" -- "$W/condense" --pool "$UPOOL" serve >"$W/userve.log" 2>&1 &
SERVER_PID=$!
if wait_ready "$SERVER_PID" "$W/userve.log" test -S "$UPOOL/control.sock"; then
    ok "$U's serve holds its pool (control socket up)"
    run_cli owner-create "$UPOOL" volume create vm2 --size 4M
    check "root's \`volume create\` on $U's pool runs through $U's daemon" \
        bash -c "cat '$W/owner-create.out'; test $(rc_of owner-create) = 0"
    run_cli owner-list "$UPOOL" volume list
    check "... and \`volume list\` shows the volume" grep -qw vm2 "$W/owner-list.out"
    run_cli owner-verify "$UPOOL" verify
    check "... and \`verify\` exits 0 through it" test "$(rc_of owner-verify)" = 0
else
    fail "$U's serve holds its pool" "$W/userve.log"
fi
stop_pids "$SERVER_PID"
SERVER_PID=

# --- 3. A trusted uid that misbehaves: root's forger on root's pool -------------------------
if forge root "$SOCK" endless; then
    run_cli r-endless "$POOL" verify
    check "root's endless daemon: the CLI stops with an error naming the limit (exit non-zero)" \
        bash -c "cat '$W/r-endless.out'; test $(rc_of r-endless) -ne 0 && test $(rc_of r-endless) -ne 124 &&
                 grep -q 'control socket $SOCK.*past 67108864 bytes' '$W/r-endless.out'"
    check "... its peak RSS stays small (64 MiB read at most)" rss_below r-endless 100
    check "... and no control character printed" clean r-endless
fi
unforge
rm -f "$SOCK"
if forge root "$SOCK" forged; then
    run_cli r-forged "$POOL" verify
    check "root's forged \"no damage\": its text is printed" grep -q "no damage found" "$W/r-forged.out"
    check "... without its escape sequences" clean r-forged
fi
unforge
rm -f "$SOCK"
if forge root "$SOCK" bad-code; then
    run_cli r-code "$POOL" verify
    check "a reply with exit status 256 (exit() would make it 0) fails" \
        bash -c "cat '$W/r-code.out'; test $(rc_of r-code) -ne 0 && grep -q 'exit status 256' '$W/r-code.out'"
fi
unforge
rm -f "$SOCK"

summary
