#!/usr/bin/env bash
# End-to-end test of NBD over TLS with real clients and certificates made here by openssl:
#
#   a CA, a server certificate for localhost/127.0.0.1, client certificates "alice" and "bob"
#   from that CA and "mallory" from another CA ->
#   serve --tls-cert/--tls-key (require): qemu-img convert and compare through
#   tls-creds-x509, nbdinfo nbds://, nbdcopy over TLS, data compared to the source; a
#   plaintext nbdinfo nbd:// is refused and reads nothing; --tls allow serves both ->
#   --tls-client-ca: no certificate or another CA's refused, alice's accepted ->
#   --allow-export alice=vm1: alice lists and opens vm1 only, bob (no rule) nothing ->
#   bad certificate files are refused at startup with a message naming the file.
#
#   bash tests/tls/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/tls/run.sh
#
# Needs (Debian): openssl qemu-utils libnbd-bin. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools openssl qemu-img nbdinfo nbdcopy

W=$(mktemp -d /tmp/condense-tls-e2e.XXXXXX)
POOL=$W/pool
free_port PORT
SERVER_PID=

cleanup() {
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

# refused NAME CMD...: pass if CMD fails (its output goes to $W/out).
refused() {
    local name=$1; shift
    if "$@" >"$W/out" 2>&1; then fail "$name (it succeeded)"; else ok "$name"; fi
}

# --- Certificates -------------------------------------------------------------------------
cd "$W" || exit 1
# mkca NAME: a CA in NAME-ca-cert.pem / NAME-ca-key.pem.
mkca() {
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -keyout "$1-ca-key.pem" -out "$1-ca-cert.pem" -subj "/CN=$1 test CA" \
        -addext basicConstraints=critical,CA:TRUE \
        -addext keyUsage=critical,keyCertSign,cRLSign 2>>"$W/openssl.log"
}
# mkcert CA CN USAGE OUT [SAN]: OUT-cert.pem / OUT-key.pem signed by CA.
mkcert() {
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$4-key.pem" \
        -out "$4.csr" -subj "/CN=$2" 2>>"$W/openssl.log"
    {
        echo "basicConstraints=CA:FALSE"
        # qemu (crypto/tlscredsx509.c) refuses a critical keyUsage without keyEncipherment.
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$3"
        [ -n "${5:-}" ] && echo "subjectAltName=$5"
    } >"$4.ext"
    openssl x509 -req -in "$4.csr" -CA "$1-ca-cert.pem" -CAkey "$1-ca-key.pem" \
        -CAcreateserial -days 2 -out "$4-cert.pem" -extfile "$4.ext" 2>>"$W/openssl.log"
}
# Client credential directories as qemu (tls-creds-x509 dir=) and libnbd (tls-certificates=)
# read them: ca-cert.pem, and client-cert.pem + client-key.pem when the client has one.
mkclientdir() {
    mkdir -p "$W/$1.d"
    cp main-ca-cert.pem "$W/$1.d/ca-cert.pem"
    if [ -f "$1-cert.pem" ]; then
        cp "$1-cert.pem" "$W/$1.d/client-cert.pem"
        cp "$1-key.pem" "$W/$1.d/client-key.pem"
    fi
}
if mkca main && mkca other \
    && mkcert main localhost serverAuth server "DNS:localhost,IP:127.0.0.1" \
    && mkcert main alice clientAuth alice \
    && mkcert main bob clientAuth bob \
    && mkcert other mallory clientAuth mallory; then
    ok "certificates made with openssl"
else
    cp "$W/openssl.log" "$W/out"; fail "certificates made with openssl"; exit 1
fi
for c in anon alice bob mallory; do mkclientdir "$c"; done

# --- Pool ---------------------------------------------------------------------------------
c() { "$CONDENSE" --pool "$POOL" "$@"; }
"$CONDENSE" init "$POOL" >/dev/null || { echo "init failed"; exit 1; }
c volume create vm1 --size 16M >/dev/null && c volume create vm2 --size 8M >/dev/null \
    || { echo "volume create failed"; exit 1; }
# 16 MiB source: 6 MiB of random data, a hole, then a repeated pattern.
SRC=$W/src.raw
head -c 6M /dev/urandom >"$SRC"
truncate -s 10M "$SRC"
yes "condense over tls" | head -c 6M >>"$SRC"

# start_server ARGS...: serve with ARGS; wait until the port accepts connections.
start_server() {
    rm -f "$W/server.log"
    "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" "$@" >"$W/server.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/server.log" grep -q "stop with Ctrl-C" "$W/server.log" || exit 1
}
stop_server() {
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=
}
TLS=(--tls-cert "$W/server-cert.pem" --tls-key "$W/server-key.pem")
# nbds URI of EXPORT for the credentials of CLIENT.
nbds() { echo "nbds://localhost:$PORT/$2?tls-certificates=$W/$1.d"; }
# qemu's TLS object and an nbd image over it: qemu_opts CLIENT EXPORT.
qobj() { echo "tls-creds-x509,id=tls0,dir=$W/$1.d,endpoint=client"; }
qimg() {
    echo "driver=raw,file.driver=nbd,file.host=localhost,file.port=$PORT,file.export=$1,file.tls-creds=tls0"
}

# --- require (default once a certificate is given) -----------------------------------------
start_server "${TLS[@]}"
check "qemu-img convert into vm1 over TLS (tls-creds-x509)" \
    qemu-img convert -n -f raw --object "$(qobj anon)" --target-image-opts "$SRC" "$(qimg vm1)"
check "qemu-img compare vm1 over TLS with the source: identical" \
    qemu-img compare --object "$(qobj anon)" --image-opts "$(qimg vm1)" \
    "driver=raw,file.filename=$SRC"
check "nbdinfo nbds:// reports TLS and the size" \
    sh -c "nbdinfo '$(nbds anon vm1)' | grep -q 'with TLS' && nbdinfo --size '$(nbds anon vm1)' | grep -qx 16777216"
check "nbdinfo --list nbds:// lists vm1 and vm2" \
    sh -c "nbdinfo --list '$(nbds anon "")' | grep -c '^export=\"vm[12]\"' | grep -qx 2"
check "nbdcopy from nbds:// equals the source" \
    sh -c "nbdcopy '$(nbds anon vm1)' '$W/copy.raw' && cmp '$W/copy.raw' '$SRC'"
check "nbdcopy into vm2 over TLS, read back equal" \
    sh -c "head -c 8M '$SRC' >'$W/half.raw' && nbdcopy '$W/half.raw' '$(nbds anon vm2)' \
        && nbdcopy '$(nbds anon vm2)' '$W/half.back' && cmp '$W/half.raw' '$W/half.back'"
refused "plaintext nbdinfo nbd:// is refused under require" \
    env LIBNBD_DEBUG=1 nbdinfo "nbd://127.0.0.1:$PORT/vm1"
if grep -q "server error message: this server requires TLS" "$W/out"; then
    ok "the refusal (NBD_REP_ERR_TLS_REQD) says TLS is required"
else
    fail "the refusal (NBD_REP_ERR_TLS_REQD) says TLS is required"
fi
refused "plaintext nbdcopy gets no data under require" \
    nbdcopy "nbd://127.0.0.1:$PORT/vm1" "$W/plain.raw"
if [ ! -s "$W/plain.raw" ] || ! cmp -s <(head -c 4096 "$W/plain.raw") <(head -c 4096 "$SRC"); then
    ok "no source data reached the plaintext client"
else
    fail "the plaintext client received data"
fi
check "plaintext nbdinfo --list sees no export name" \
    sh -c "! nbdinfo --list 'nbd://127.0.0.1:$PORT' 2>&1 | grep -q 'export=\"vm'"
check "a libnbd client with TLS disabled by URI (nbd://) cannot open vm2 either" \
    sh -c "! qemu-img info 'nbd://127.0.0.1:$PORT/vm2'"
stop_server

# --- allow: both -----------------------------------------------------------------------------
start_server "${TLS[@]}" --tls allow
check "--tls allow: plaintext client served" \
    sh -c "nbdcopy 'nbd://127.0.0.1:$PORT/vm1' '$W/p.raw' && cmp '$W/p.raw' '$SRC'"
check "--tls allow: TLS client served" \
    sh -c "nbdinfo '$(nbds anon vm1)' | grep -q 'with TLS'"
stop_server

# --- client certificates -----------------------------------------------------------------
start_server "${TLS[@]}" --tls-client-ca "$W/main-ca-cert.pem"
refused "--tls-client-ca: a client without a certificate is refused" \
    nbdinfo "$(nbds anon vm1)"
refused "--tls-client-ca: a certificate from another CA is refused" \
    nbdinfo "$(nbds mallory vm1)"
refused "--tls-client-ca: qemu-img without a client certificate is refused" \
    qemu-img compare --object "$(qobj anon)" --image-opts "$(qimg vm1)" \
    "driver=raw,file.filename=$SRC"
check "--tls-client-ca: alice's certificate is accepted (nbdcopy, data equal)" \
    sh -c "nbdcopy '$(nbds alice vm1)' '$W/a.raw' && cmp '$W/a.raw' '$SRC'"
check "--tls-client-ca: qemu-img compare with alice's certificate: identical" \
    qemu-img compare --object "$(qobj alice)" --image-opts "$(qimg vm1)" \
    "driver=raw,file.filename=$SRC"
stop_server

# --- per-client exports ------------------------------------------------------------------
start_server "${TLS[@]}" --tls-client-ca "$W/main-ca-cert.pem" --allow-export alice=vm1
check "--allow-export alice=vm1: alice lists vm1 only" \
    sh -c "nbdinfo --list '$(nbds alice "")' | grep '^export=' | tr '\n' ' ' | grep -qx 'export=\"vm1\": '"
check "--allow-export alice=vm1: alice reads vm1" \
    sh -c "nbdcopy '$(nbds alice vm1)' '$W/a2.raw' && cmp '$W/a2.raw' '$SRC'"
refused "--allow-export alice=vm1: alice cannot open vm2" nbdinfo "$(nbds alice vm2)"
check "--allow-export: bob (no rule) lists nothing" \
    sh -c "! nbdinfo --list '$(nbds bob "")' 2>&1 | grep -q '^export='"
refused "--allow-export: bob (no rule) cannot open vm1" nbdinfo "$(nbds bob vm1)"
stop_server
start_server "${TLS[@]}" --tls-client-ca "$W/main-ca-cert.pem" --allow-export alice=vm1 \
    --allow-export '*=vm2'
check "--allow-export '*=vm2': bob gets vm2" nbdinfo --size "$(nbds bob vm2)"
refused "--allow-export '*=vm2': bob still cannot open vm1" nbdinfo "$(nbds bob vm1)"
stop_server

# --- bad settings are refused at startup ---------------------------------------------------
bad_start() {
    local name=$1 want=$2; shift 2
    if timeout 20 "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" "$@" >"$W/out" 2>&1; then
        fail "$name (the server started)"
    elif grep -q -- "$want" "$W/out"; then
        ok "$name"
    else
        fail "$name (message lacks '$want')"
    fi
}
bad_start "a missing certificate file is named at startup" "$W/nope.pem" \
    --tls-cert "$W/nope.pem" --tls-key "$W/server-key.pem"
bad_start "a key that is not the certificate's is refused at startup" "does not fit" \
    --tls-cert "$W/server-cert.pem" --tls-key "$W/alice-key.pem"
bad_start "a certificate file without a certificate is refused" "holds no PEM" \
    --tls-cert "$W/server.ext" --tls-key "$W/server-key.pem"
bad_start "--tls allow with --tls-client-ca is refused" "require" \
    "${TLS[@]}" --tls allow --tls-client-ca "$W/main-ca-cert.pem"
bad_start "--allow-export without --tls-client-ca is refused" "tls-client-ca" \
    "${TLS[@]}" --allow-export alice=vm1

check "verify clean after the TLS sessions" c verify
summary
