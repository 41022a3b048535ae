#!/usr/bin/env bash
# Sequential read over NBD: plaintext vs certificate TLS (rustls) vs TLS-PSK (OpenSSL).
# nbdcopy copies one volume of random data to null: over each transport, the three in turn
# (the order rotated every round) against `condense serve` on the same pool; each figure is
# the median of ROUNDS runs. One server runs at a time (a pool has one server), restarted for
# each run; a first untimed read warms the page cache.
#
#   bash bench/nbd/tls-psk-read.sh                          # 1 GiB, 3 rounds
#   SIZE=512M ROUNDS=5 bash bench/nbd/tls-psk-read.sh
#   CONDENSE_BASE=/path/to/older/condense bash bench/nbd/tls-psk-read.sh
#       # adds "tls-base": certificate TLS served by another build, to compare two builds
#
# Also prints the server's CPU seconds per GiB read (user + system from /proc): on a 2-core
# machine nbdcopy's GnuTLS competes with the server for the cores, so that figure is the one
# that carries over to clients on other hosts. Needs: nbdcopy, nbdinfo, openssl, psktool,
# fio (to make the data). Prints figures; asserts nothing.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIZE=${SIZE:-1G}
ROUNDS=${ROUNDS:-3}
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=${CARGO_TARGET_DIR:-$ROOT/target}/release/condense
fi
for tool in fio openssl psktool nbdcopy nbdinfo; do
    command -v "$tool" >/dev/null || { echo "missing $tool (scripts/install-deps.sh)"; exit 1; }
done

BASE=${BENCH_DIR:-$ROOT/target/bench-nbd}
mkdir -p "$BASE"
W=$(mktemp -d "$BASE/psk.XXXXXX")
POOL=$W/pool
PORT=$((20000 + RANDOM % 20000))
SERVER_PID=
stop_server() {
    if [ -n "$SERVER_PID" ]; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
cleanup() {
    stop_server
    rm -rf "$W"
}
trap cleanup EXIT

# Certificates (as tests/tls/run.sh makes them) and a PSK file.
cd "$W"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -keyout ca-key.pem -out ca-cert.pem -subj "/CN=bench CA" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout server-key.pem \
    -out server.csr -subj "/CN=localhost" 2>/dev/null
printf '%s\n' "basicConstraints=CA:FALSE" "extendedKeyUsage=serverAuth" \
    "subjectAltName=DNS:localhost,IP:127.0.0.1" >server.ext
openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial -days 2 \
    -out server-cert.pem -extfile server.ext 2>/dev/null
mkdir -p client && cp ca-cert.pem client/
psktool -u bench -p keys.psk >/dev/null

# serve_as MODE: start the server for MODE; sets URI.
serve_as() {
    local bin=$CONDENSE args=()
    case $1 in
        plain) URI=nbd://127.0.0.1:$PORT/bench ;;
        tls | tls-base)
            args=(--tls-cert server-cert.pem --tls-key server-key.pem)
            URI="nbds://localhost:$PORT/bench?tls-certificates=$W/client"
            [ "$1" = tls-base ] && bin=$CONDENSE_BASE
            ;;
        psk)
            args=(--tls-psk keys.psk)
            URI="nbds://bench@127.0.0.1:$PORT/bench?tls-psk-file=$W/keys.psk"
            ;;
    esac
    "$bin" --pool "$POOL" serve --listen "127.0.0.1:$PORT" "${args[@]}" >"$W/serve.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 100); do nbdinfo "$URI" >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "server for $1 did not start:"; cat "$W/serve.log"; exit 1
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$SERVER_PID/stat"; }

echo "== setup: $SIZE of random data in a volume"
fio --name=fill --filename="$W/src.raw" --size="$SIZE" --rw=write --bs=1M --ioengine=psync \
    --refill_buffers=1 --output=/dev/null
bytes=$(stat -c %s "$W/src.raw")
"$CONDENSE" --pool "$POOL" init >/dev/null
"$CONDENSE" --pool "$POOL" volume create bench --size "$bytes" >/dev/null
serve_as plain
nbdcopy --flush "$W/src.raw" "$URI"
rm -f "$W/src.raw"
nbdcopy "$URI" null:
stop_server

MODES=(plain tls psk)
[ -n "${CONDENSE_BASE:-}" ] && MODES+=(tls-base)
declare -A MIBS CPU
tick=$(getconf CLK_TCK)
for round in $(seq 1 "$ROUNDS"); do
    n=${#MODES[@]}
    for i in $(seq 0 $((n - 1))); do
        mode=${MODES[$(((i + round) % n))]}
        serve_as "$mode"
        t0=$(cpu_ticks)
        s=$(date +%s.%N)
        nbdcopy "$URI" null:
        e=$(date +%s.%N)
        t1=$(cpu_ticks)
        stop_server
        mibs=$(echo "$bytes / 1048576 / ($e - $s)" | bc -l)
        cpu=$(echo "($t1 - $t0) / $tick / ($bytes / 1073741824)" | bc -l)
        printf 'round %d %-8s %7.0f MiB/s  server %.2f CPU s/GiB\n' "$round" "$mode" "$mibs" "$cpu"
        MIBS[$mode]="${MIBS[$mode]:-} $mibs"
        CPU[$mode]="${CPU[$mode]:-} $cpu"
    done
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo
echo "== median of $ROUNDS rounds, $SIZE sequential read with nbdcopy to null:"
printf '%-9s %10s %16s\n' transport "MiB/s" "server CPU s/GiB"
for mode in "${MODES[@]}"; do
    # shellcheck disable=SC2086
    printf '%-9s %10.0f %16.2f\n' "$mode" "$(median ${MIBS[$mode]})" "$(median ${CPU[$mode]})"
done
