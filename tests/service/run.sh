#!/usr/bin/env bash
# End-to-end test of Condense as a systemd service (docs/SERVICE.md), with real tools:
#
#   systemd-analyze verify accepts both units (and flags a broken copy: the check bites) ->
#   scripts/install-service.sh stages binary, units, sample config and guide (DESTDIR) ->
#   serve --config: a fake service manager (a Python Unix-datagram listener on $NOTIFY_SOCKET)
#   gets READY=1, and the moment it does, nbdinfo lists the exports on the configured TCP
#   port and Unix socket -> data written with qemu-io -> SIGTERM: STOPPING=1, exit status 0,
#   `condense verify` clean, the data exported intact ->
#   an abstract $NOTIFY_SOCKET (@name) -> a command-line --insecure-listen overrides the
#   file's ->
#   an unknown key fails naming the key and the file, and nothing is served ->
#   mount --config (root or fusermount3, /dev/fuse): READY=1 once volumes/ is visible,
#   STOPPING=1 and exit 0 on SIGTERM.
#
#   bash tests/service/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/service/run.sh
#
# Needs (Debian): systemd (systemd-analyze), libnbd-bin (nbdinfo), qemu-utils (qemu-io),
# python3. Ends with "N passed, M failed, K skipped"; in CI (CI=true) nothing may skip.

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"

finish() { summary; exit $?; }

for tool in systemd-analyze nbdinfo qemu-io python3 cmp; do
    command -v "$tool" >/dev/null || { fail "missing $tool (scripts/install-deps.sh)"; finish; }
done

W=$(mktemp -d /tmp/condense-service-e2e.XXXXXX)
POOL=$W/pool
free_port PORT
free_port PORT2
SOCK=$W/nbd.sock
MNT=$W/mnt
SERVER_PID=
LISTENER_PID=
mkdir -p "$MNT"

cleanup() {
    stop_pids "$SERVER_PID"
    [ -n "$LISTENER_PID" ] && kill "$LISTENER_PID" 2>/dev/null
    if grep -q " $MNT " /proc/mounts 2>/dev/null; then
        umount "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT" 2>/dev/null
    fi
    remove_work_dir
}
trap cleanup EXIT

# A fake service manager: receives sd_notify datagrams on ADDR (a path, or @name for an
# abstract socket) and appends each to LOG; on READY=1 it runs HOOK at once (before
# anything else can happen) and logs "HOOK rc=N". Exits after STOPPING=1 (or 60 s).
cat >"$W/listener.py" <<'EOF'
import socket, subprocess, sys, time
addr, log, hook = sys.argv[1], sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("\0" + addr[1:] if addr.startswith("@") else addr)
open(log + ".bound", "w").close()
s.settimeout(60)
with open(log, "a") as out:
    while True:
        try:
            msg = s.recv(4096).decode()
        except socket.timeout:
            out.write("TIMEOUT\n")
            break
        out.write("MSG " + msg.replace("\n", " | ") + "\n")
        out.flush()
        if "READY=1" in msg.split("\n"):
            rc = subprocess.run(hook, shell=True, stdout=out, stderr=out).returncode
            out.write("HOOK rc=%d\n" % rc)
            out.flush()
        if "STOPPING=1" in msg.split("\n"):
            break
EOF

# start_listener ADDR LOG HOOK
start_listener() {
    rm -f "$2" "$2.bound"
    case $1 in @*) ;; *) rm -f "$1" ;; esac
    python3 "$W/listener.py" "$1" "$2" "$3" &
    LISTENER_PID=$!
    for _ in $(seq 1 50); do [ -e "$2.bound" ] && return 0; sleep 0.1; done
    echo "notify listener did not start"; return 1
}
wait_listener() { # until the listener has exited (it does after STOPPING=1)
    for _ in $(seq 1 100); do kill -0 "$LISTENER_PID" 2>/dev/null || break; sleep 0.1; done
    wait "$LISTENER_PID" 2>/dev/null
    LISTENER_PID=
}
# wait_ready LOG: until the READY hook has run (or the server died).
wait_ready() {
    for _ in $(seq 1 100); do
        grep -q "^HOOK rc=" "$1" 2>/dev/null && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
stop_server() { # SIGTERM; the exit status of the server
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID"
    local rc=$?
    SERVER_PID=
    return $rc
}

# --- 1. the units --------------------------------------------------------------------------
mkdir -p "$W/units"
for u in serve mount; do
    # systemd-analyze verify checks that ExecStart's program exists: point it at ours.
    sed "s#/usr/local/bin/condense#$CONDENSE#" "$ROOT/dist/systemd/condense-$u@.service" \
        >"$W/units/condense-$u@vm.service"
done
verify_units() {
    systemd-analyze verify "$W/units/condense-serve@vm.service" "$W/units/condense-mount@vm.service" >"$W/verify.out" 2>&1 || return 1
    # Unknown keys and bad values are only warnings; there must be none.
    [ ! -s "$W/verify.out" ] || { cat "$W/verify.out"; return 1; }
}
check "systemd-analyze verify: both units clean" verify_units
cp "$W/units/condense-serve@vm.service" "$W/broken@vm.service"
sed -i 's/^KillSignal=SIGTERM/KilSignal=SIGTERM/' "$W/broken@vm.service"
broken_flagged() {
    systemd-analyze verify "$W/broken@vm.service" 2>&1 | grep -q "KilSignal"
}
check "systemd-analyze verify flags a misspelt key (the check above can fail)" broken_flagged
check "serve unit: Type=notify, --config /etc/condense/%i.toml, restart on failure" \
    bash -c "grep -qx 'Type=notify' '$ROOT/dist/systemd/condense-serve@.service' &&
             grep -qx 'ExecStart=/usr/local/bin/condense serve --config /etc/condense/%i.toml' '$ROOT/dist/systemd/condense-serve@.service' &&
             grep -qx 'Restart=on-failure' '$ROOT/dist/systemd/condense-serve@.service' &&
             grep -qx 'KillSignal=SIGTERM' '$ROOT/dist/systemd/condense-serve@.service'"
check "mount unit: Type=notify, /dev/fuse allowed, CAP_SYS_ADMIN, no private mount namespace" \
    bash -c "grep -qx 'Type=notify' '$ROOT/dist/systemd/condense-mount@.service' &&
             grep -qx 'DeviceAllow=/dev/fuse rw' '$ROOT/dist/systemd/condense-mount@.service' &&
             grep -q '^CapabilityBoundingSet=.*CAP_SYS_ADMIN' '$ROOT/dist/systemd/condense-mount@.service' &&
             ! grep -Eq '^(ProtectSystem|ProtectHome|PrivateTmp|PrivateDevices|ReadWritePaths)=' '$ROOT/dist/systemd/condense-mount@.service'"

# --- 2. the install script (staged) --------------------------------------------------------
staged() {
    DESTDIR="$W/stage" CONDENSE="$CONDENSE" "$ROOT/scripts/install-service.sh" &&
        cmp "$W/stage/usr/local/bin/condense" "$CONDENSE" &&
        cmp "$W/stage/etc/systemd/system/condense-serve@.service" "$ROOT/dist/systemd/condense-serve@.service" &&
        cmp "$W/stage/etc/systemd/system/condense-mount@.service" "$ROOT/dist/systemd/condense-mount@.service" &&
        cmp "$W/stage/etc/condense/condense.toml.sample" "$ROOT/dist/condense.toml" &&
        [ -f "$W/stage/usr/local/share/doc/condense/SERVICE.md" ]
}
check "install-service.sh stages binary, units, sample config and guide" staged
# The sample config is a valid config for serve (every key known).
# (Its group `condense` exists only where install-service.sh ran: this user's group instead.)
sed "s#/var/lib/condense/vm#$W/nopool#; s#/run/condense/vm/nbd.sock#$W/sample.sock#; s#^group = \"condense\"#group = \"$(id -g)\"#" \
    "$ROOT/dist/condense.toml" >"$W/sample.toml"
sample_keys_known() {
    "$CONDENSE" serve --config "$W/sample.toml" >"$W/sample.out" 2>&1
    grep -q "cannot open pool $W/nopool" "$W/sample.out" # got as far as opening the pool
}
check "the sample dist/condense.toml is accepted by serve --config" sample_keys_known

# --- 3. serve --config under a fake service manager -----------------------------------------
"$CONDENSE" init "$POOL" >/dev/null && "$CONDENSE" --pool "$POOL" volume create vm --size 16M >/dev/null ||
    { fail "cannot create the test pool"; finish; }
cat >"$W/serve.toml" <<EOF
# a test service
pool = "$POOL"
insecure-listen = "127.0.0.1:$PORT"
socket = "$SOCK"
metadata-cache = "16M"
EOF

NOTIFY=$W/notify.sock
start_listener "$NOTIFY" "$W/notify.log" \
    "nbdinfo --list nbd://127.0.0.1:$PORT | grep -x 'export=\"vm\":' &&
     nbdinfo --list 'nbd+unix:///?socket=$SOCK' | grep -x 'export=\"vm\":'" || { fail "the fake service manager (notify listener) started"; finish; }
(cd / && NOTIFY_SOCKET=$NOTIFY exec "$CONDENSE" serve --config "$W/serve.toml") >"$W/serve.log" 2>&1 &
SERVER_PID=$!
if wait_ready "$W/notify.log"; then
    ok "READY=1 received"
    check "READY=1 carries STATUS= and MAINPID of the server" \
        grep -q "^MSG READY=1 | STATUS=serving 1 volume(s) | MAINPID=$SERVER_PID" "$W/notify.log"
    check "at READY=1 nbdinfo already lists the export on the configured port and socket" \
        bash -c "grep -qx 'HOOK rc=0' '$W/notify.log' && [ \$(grep -cx 'export=\"vm\":' '$W/notify.log') = 2 ]"
else
    fail "READY=1 received" "$W/serve.log"
fi
check "the configured pool is served (qemu-io writes 1 MiB of 0x5a at 4 MiB)" \
    qemu-io -f raw -c "write -P 0x5a 4M 1M" "nbd://127.0.0.1:$PORT/vm"
if stop_server; then ok "SIGTERM: serve exits with status 0"; else fail "SIGTERM: serve exits with status 0" "$W/serve.log"; fi
wait_listener
check "STOPPING=1 received after SIGTERM" grep -q "^MSG STOPPING=1" "$W/notify.log"
check "stop order: READY before STOPPING, once each" \
    bash -c "[ \$(grep -c '^MSG READY=1' '$W/notify.log') = 1 ] && [ \$(grep -c '^MSG STOPPING=1' '$W/notify.log') = 1 ] &&
             [ \$(grep -n '^MSG READY=1' '$W/notify.log' | cut -d: -f1) -lt \$(grep -n '^MSG STOPPING=1' '$W/notify.log' | cut -d: -f1) ]"
check "condense verify is clean after the SIGTERM stop" "$CONDENSE" --pool "$POOL" verify
data_intact() {
    "$CONDENSE" --pool "$POOL" export vm "$W/vm.raw" &&
        python3 -c "import sys; sys.stdout.buffer.write(b'\x5a' * (1 << 20))" >"$W/pattern" &&
        cmp -i "$((4 << 20)):0" -n $((1 << 20)) "$W/vm.raw" "$W/pattern"
}
check "the data written before SIGTERM is in the pool" data_intact

# An abstract notify socket (what systemd uses for user managers and in containers).
ABSTRACT="@condense-test-$$-$RANDOM"
start_listener "$ABSTRACT" "$W/notify2.log" "nbdinfo --list nbd://127.0.0.1:$PORT >/dev/null" || { fail "the fake service manager (notify listener) started"; finish; }
NOTIFY_SOCKET=$ABSTRACT "$CONDENSE" serve --config "$W/serve.toml" >"$W/serve2.log" 2>&1 &
SERVER_PID=$!
if wait_ready "$W/notify2.log" && grep -qx "HOOK rc=0" "$W/notify2.log"; then
    ok "READY=1 on an abstract NOTIFY_SOCKET (@name), port serving at that moment"
else
    fail "READY=1 on an abstract NOTIFY_SOCKET (@name), port serving at that moment" "$W/notify2.log"
fi
stop_server
wait_listener
check "STOPPING=1 on the abstract socket" grep -q "^MSG STOPPING=1" "$W/notify2.log"

# --- 4. the command line wins; unknown keys fail ---------------------------------------------
"$CONDENSE" serve --config "$W/serve.toml" --insecure-listen "127.0.0.1:$PORT2" >"$W/serve3.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 100); do nbdinfo --list "nbd://127.0.0.1:$PORT2" >/dev/null 2>&1 && break; sleep 0.1; done
check "--insecure-listen on the command line overrides the file's" nbdinfo --list "nbd://127.0.0.1:$PORT2"
check "... and the file's port is not served" bash -c "! nbdinfo --list nbd://127.0.0.1:$PORT"
check "... while the file's other keys still apply (its socket serves)" \
    nbdinfo --list "nbd+unix:///?socket=$SOCK"
check "SIGTERM: exit status 0 again" stop_server

printf 'pool = "%s"\ninsecure-listen = "127.0.0.1:%s"\nlisen = "0.0.0.0:1"\n' "$POOL" "$PORT" >"$W/bad.toml"
unknown_key() {
    if "$CONDENSE" serve --config "$W/bad.toml" >"$W/bad.out" 2>&1; then return 1; fi
    cat "$W/bad.out"
    grep -q "unknown key \`lisen\` in $W/bad.toml" "$W/bad.out" && ! nbdinfo --list "nbd://127.0.0.1:$PORT" >/dev/null 2>&1
}
check "an unknown key fails, naming the key and the file, and serves nothing" unknown_key

# --- 5. mount --config under the fake service manager ----------------------------------------
if [ ! -e /dev/fuse ]; then
    skip "mount --config with READY=1/STOPPING=1" "/dev/fuse is missing"
elif [ "$(id -u)" != 0 ] && ! command -v fusermount3 >/dev/null; then
    skip "mount --config with READY=1/STOPPING=1" "not root and no fusermount3 (apt-get install fuse3)"
else
    printf 'pool = "%s"\nmountpoint = "%s"\n' "$POOL" "$MNT" >"$W/mount.toml"
    start_listener "$NOTIFY" "$W/notify3.log" "test -f '$MNT/volumes/vm' && grep -q ' $MNT ' /proc/mounts" || { fail "the fake service manager (notify listener) started"; finish; }
    NOTIFY_SOCKET=$NOTIFY "$CONDENSE" mount --config "$W/mount.toml" >"$W/mount.log" 2>&1 &
    SERVER_PID=$!
    if wait_ready "$W/notify3.log" && grep -qx "HOOK rc=0" "$W/notify3.log"; then
        ok "mount: READY=1 once MOUNTPOINT/volumes/vm is there"
    else
        fail "mount: READY=1 once MOUNTPOINT/volumes/vm is there" "$W/notify3.log"
    fi
    if stop_server; then ok "mount: SIGTERM exits with status 0"; else fail "mount: SIGTERM exits with status 0" "$W/mount.log"; fi
    wait_listener
    check "mount: STOPPING=1 received, and the mount is gone" \
        bash -c "grep -q '^MSG STOPPING=1' '$W/notify3.log' && ! grep -q ' $MNT ' /proc/mounts"
    check "condense verify is clean after the mount stopped" "$CONDENSE" --pool "$POOL" verify
fi

finish
