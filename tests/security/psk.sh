#!/usr/bin/env bash
# TLS-PSK end to end with the real clients (issue 23): `serve --listen --tls-psk FILE` with keys
# made by psktool (GnuTLS) and by openssl ->
#   qemu-img (tls-creds-psk, DIR/keys.psk) writes a volume, reads it back (info, convert,
#   compare: byte-identical); nbdinfo and nbdcopy (nbds://USER@HOST/NAME?tls-psk-file=FILE)
#   connect and read the same bytes; a client limited to TLS 1.2 still connects ->
#   a wrong key, an unknown username, a certificate client and a plaintext client get no
#   export name and no data ->
#   --allow-export USER=EXPORTS limits what each username lists and opens ->
#   a key file readable by others (0644) is refused with the chmod fix; malformed files, rules
#   naming unknown users, --tls allow and --tls-cert with --tls-psk are refused at startup.
#
#   CONDENSE=$CARGO_TARGET_DIR/release/condense bash tests/security/psk.sh
#
# Needs (Debian): gnutls-bin (psktool) openssl qemu-utils libnbd-bin. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools psktool openssl qemu-img nbdinfo nbdcopy

W=$(mktemp -d /tmp/condense-psk.XXXXXX)
POOL=$W/pool
free_port PORT
SERVER_PID=

cleanup() {
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

# --- Keys ------------------------------------------------------------------------------------
# The server's file holds every client; each client gets a directory with a keys.psk holding
# its own line only (qemu reads DIR/keys.psk; libnbd reads the file named in the URI).
KEYS=$W/server.psk
psktool -u alice -p "$KEYS" >"$W/out" 2>&1 || { cat "$W/out"; echo "psktool failed"; exit 1; }
echo "bob:$(openssl rand -hex 32)" >>"$KEYS"
chmod 600 "$KEYS"
# clientdir NAME LINE: $W/NAME.d/keys.psk holding LINE.
clientdir() {
    mkdir -p "$W/$1.d"
    (umask 077 && printf '%s\n' "$2" >"$W/$1.d/keys.psk")
}
clientdir alice "$(grep '^alice:' "$KEYS")"
clientdir bob "$(grep '^bob:' "$KEYS")"
clientdir wrong "alice:$(openssl rand -hex 32)"
clientdir carol "carol:$(openssl rand -hex 32)"

# --- Pool --------------------------------------------------------------------------------------
c() { "$CONDENSE" --pool "$POOL" "$@"; }
"$CONDENSE" init "$POOL" >/dev/null || { echo "init failed"; exit 1; }
c volume create vm1 --size 16M >/dev/null && c volume create vm2 --size 8M >/dev/null \
    || { echo "volume create failed"; exit 1; }
# 16 MiB source: 6 MiB of random data, a hole, then a repeated pattern.
SRC=$W/src.raw
head -c 6M /dev/urandom >"$SRC"
truncate -s 10M "$SRC"
yes "condense over tls-psk" | head -c 6M >>"$SRC"

# start_server ARGS...: serve on 127.0.0.1:$PORT with ARGS (debug log of the NBD server, which
# names the TLS version of each connection); wait until it is up.
start_server() {
    rm -f "$W/server.log"
    CONDENSE_LOG=condense_nbd=debug "$CONDENSE" --pool "$POOL" serve --listen "127.0.0.1:$PORT" \
        "$@" >"$W/server.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/server.log" grep -q "stop with Ctrl-C" "$W/server.log" || exit 1
}
# bad_start NAME PATTERN ARGS...: serve with ARGS must fail before serving, saying PATTERN.
bad_start() {
    local name=$1 pattern=$2
    shift 2
    refuse "$name" "$pattern" timeout 20 "$CONDENSE" --pool "$POOL" serve \
        --listen "127.0.0.1:$PORT" "$@"
}
# URIs and qemu options for a client (its directory $W/CLIENT.d): nbds CLIENT EXPORT,
# qobj CLIENT [PRIORITY], qimg EXPORT. The "wrong" client is alice with another key.
user_of() { if [ "$1" = wrong ]; then echo alice; else echo "$1"; fi; }
nbds() { echo "nbds://$(user_of "$1")@127.0.0.1:$PORT/$2?tls-psk-file=$W/$1.d/keys.psk"; }
qobj() {
    echo "tls-creds-psk,id=tls0,endpoint=client,dir=$W/$1.d,username=$(user_of "$1")${2:+,priority=$2}"
}
qimg() {
    echo "driver=raw,file.driver=nbd,file.host=127.0.0.1,file.port=$PORT,file.export=$1,file.tls-creds=tls0"
}
# no_data FILE: FILE is missing, empty, or holds none of the source's first 64 KiB.
no_data() { [ ! -s "$1" ] || ! cmp -s <(head -c 65536 "$1") <(head -c 65536 "$SRC"); }

# --- The key file's mode -------------------------------------------------------------------
chmod 644 "$KEYS"
bad_start "a PSK file readable by others (0644) is refused, with the chmod fix" \
    "chmod 600 $KEYS" --tls-psk "$KEYS"
chmod 600 "$KEYS"

# --- Good clients --------------------------------------------------------------------------
start_server --tls-psk "$KEYS"
check "the log says TLS-PSK is required, for 2 usernames" \
    grep -q "TLS-PSK required, 2 username(s)" "$W/server.log"
check "qemu-img convert writes vm1 over TLS-PSK (tls-creds-psk, alice)" \
    qemu-img convert -n -f raw --object "$(qobj alice)" --target-image-opts "$SRC" "$(qimg vm1)"
check "qemu-img info over TLS-PSK reports vm1's 16 MiB" \
    sh -c "qemu-img info --object '$(qobj alice)' --image-opts '$(qimg vm1)' \
        | grep -q 'virtual size: 16 MiB'"
check "qemu-img convert reads vm1 over TLS-PSK: byte-identical to the source" \
    sh -c "qemu-img convert -O raw --object '$(qobj alice)' --image-opts '$(qimg vm1)' \
        '$W/qemu-read.raw' && cmp '$W/qemu-read.raw' '$SRC'"
check "qemu-img compare vm1 over TLS-PSK with the source: identical" \
    qemu-img compare --object "$(qobj alice)" --image-opts "$(qimg vm1)" \
    "driver=raw,file.filename=$SRC"
check "the server log names alice and TLS 1.3" \
    grep -q 'TLS-PSK established user="alice" version="TLSv1.3"' "$W/server.log"
check "nbdinfo nbds://alice@...?tls-psk-file= connects with TLS and sees 16 MiB" \
    sh -c "nbdinfo '$(nbds alice vm1)' | grep -q 'with TLS' \
        && nbdinfo --size '$(nbds alice vm1)' | grep -qx 16777216"
check "nbdinfo --list over TLS-PSK lists vm1 and vm2" \
    sh -c "nbdinfo --list '$(nbds alice "")' | grep -c '^export=\"vm[12]\"' | grep -qx 2"
check "nbdcopy reads vm1 over TLS-PSK (libnbd): byte-identical to the source" \
    sh -c "nbdcopy '$(nbds alice vm1)' '$W/nbdcopy.raw' && cmp '$W/nbdcopy.raw' '$SRC'"
check "bob's key (made with openssl rand) works too: nbdcopy into vm2 and back" \
    sh -c "head -c 8M '$SRC' >'$W/half.raw' && nbdcopy '$W/half.raw' '$(nbds bob vm2)' \
        && nbdcopy '$(nbds bob vm2)' '$W/half.back' && cmp '$W/half.raw' '$W/half.back'"
check "a client limited to TLS 1.2 (qemu priority NORMAL:-VERS-TLS1.3) reads vm1: identical" \
    qemu-img compare --object "$(qobj alice NORMAL:-VERS-TLS1.3)" --image-opts "$(qimg vm1)" \
    "driver=raw,file.filename=$SRC"
check "that connection used TLS 1.2 with ECDHE-PSK (forward secret)" \
    grep -q 'version="TLSv1.2" cipher="ECDHE-PSK-CHACHA20-POLY1305"' "$W/server.log"

# --- Clients that get nothing --------------------------------------------------------------
# Each of these fails in the TLS handshake: the server sent a fatal alert.
refuse "alice with a wrong key is refused in the handshake (nbdinfo)" "gnutls_handshake" \
    nbdinfo "$(nbds wrong vm1)"
refuse "alice with a wrong key lists no export name (nbdinfo --list)" "gnutls_handshake" \
    nbdinfo --list "$(nbds wrong "")"
refuse "alice with a wrong key gets no data (nbdcopy)" "gnutls_handshake" \
    nbdcopy "$(nbds wrong vm1)" "$W/wrong.raw"
check "no source data reached the wrong-key client" no_data "$W/wrong.raw"
refuse "alice with a wrong key is refused in the handshake (qemu-img)" "TLS handshake failed" \
    qemu-img convert -O raw --object "$(qobj wrong)" --image-opts "$(qimg vm1)" \
    "$W/wrong-qemu.raw"
check "no source data reached the wrong-key qemu-img" no_data "$W/wrong-qemu.raw"
refuse "an unknown username is refused in the handshake (nbdinfo)" "gnutls_handshake" \
    nbdinfo "$(nbds carol vm1)"
refuse "an unknown username is refused in the handshake (qemu-img)" "TLS handshake failed" \
    qemu-img info --object "$(qobj carol)" --image-opts "$(qimg vm1)"
check "the server log names the unknown username" grep -q 'unknown username user=carol' \
    "$W/server.log"
check "the server log shows the failed handshakes" grep -q 'TLS handshake failed' "$W/server.log"
refuse "a certificate client (nbds:// without a PSK file) is refused" "gnutls_handshake" \
    nbdinfo "nbds://127.0.0.1:$PORT/vm1"
refuse "a plaintext client is refused, told TLS is required" "requires TLS" \
    env LIBNBD_DEBUG=1 nbdinfo "nbd://127.0.0.1:$PORT/vm1"
refuse "a plaintext client lists no export name" "" \
    sh -c "nbdinfo --list 'nbd://127.0.0.1:$PORT' 2>&1 | grep -q 'export=\"vm' && exit 0; exit 1"
refuse "a plaintext nbdcopy gets no data" "" nbdcopy "nbd://127.0.0.1:$PORT/vm1" "$W/plain.raw"
check "no source data reached the plaintext client" no_data "$W/plain.raw"
refuse "plaintext qemu-img gets nothing" "" qemu-img info "nbd://127.0.0.1:$PORT/vm1"
stop_server

# --- Per-user exports ----------------------------------------------------------------------
start_server --tls-psk "$KEYS" --allow-export alice=vm1
check "--allow-export alice=vm1: alice lists vm1 only" \
    sh -c "nbdinfo --list '$(nbds alice "")' | grep '^export=' | tr '\n' ' ' \
        | grep -qx 'export=\"vm1\": '"
check "--allow-export alice=vm1: alice reads vm1" \
    sh -c "nbdcopy '$(nbds alice vm1)' '$W/a.raw' && cmp '$W/a.raw' '$SRC'"
refuse "--allow-export alice=vm1: alice cannot open vm2 (nbdinfo)" "" nbdinfo "$(nbds alice vm2)"
refuse "--allow-export alice=vm1: alice cannot open vm2 (qemu-img)" "" \
    qemu-img info --object "$(qobj alice)" --image-opts "$(qimg vm2)"
check "--allow-export: bob (no rule) lists nothing" \
    sh -c "! nbdinfo --list '$(nbds bob "")' 2>&1 | grep -q '^export='"
refuse "--allow-export: bob (no rule) cannot open vm1" "" nbdinfo "$(nbds bob vm1)"
stop_server
start_server --tls-psk "$KEYS" --allow-export alice=vm1 --allow-export '*=vm2'
check "--allow-export '*=vm2': bob gets vm2" nbdinfo --size "$(nbds bob vm2)"
refuse "--allow-export '*=vm2': bob still cannot open vm1" "" nbdinfo "$(nbds bob vm1)"
stop_server

# --- Settings refused at startup ---------------------------------------------------------------
bad_start "a rule naming a username the file lacks is refused" '"carol"' \
    --tls-psk "$KEYS" --allow-export carol=vm1
bad_start "--tls allow with --tls-psk is refused" "always required" \
    --tls-psk "$KEYS" --tls allow
bad_start "--tls-cert with --tls-psk is refused" "cannot be used with" \
    --tls-psk "$KEYS" --tls-cert "$KEYS" --tls-key "$KEYS"
(umask 077 && { grep '^alice:' "$KEYS"; echo "bob $(openssl rand -hex 32)"; } >"$W/bad.psk")
bad_start "a malformed line is refused with its line number" "line 2: there is no ':'" \
    --tls-psk "$W/bad.psk"
if grep -q "$(grep '^alice:' "$KEYS" | cut -d: -f2 | head -c 16)" "$W/out"; then
    fail "the error does not show the key"
else
    ok "the error does not show the key"
fi
(umask 077 && { grep '^alice:' "$KEYS"; grep '^alice:' "$KEYS"; } >"$W/dup.psk")
bad_start "a username given twice is refused" "line 2: username \"alice\" was already given" \
    --tls-psk "$W/dup.psk"
(umask 077 && echo "alice:0123456789abcdef" >"$W/short.psk")
bad_start "a key shorter than 128 bits is refused" "shorter than 16 bytes" \
    --tls-psk "$W/short.psk"
bad_start "a missing PSK file is named" "$W/nope.psk" --tls-psk "$W/nope.psk"

check "verify clean after the TLS-PSK sessions" c verify
summary
