#!/usr/bin/env bash
# NBD over TLS vs plaintext: fio (nbd ioengine, libnbd URIs) against one `condense serve
# --tls allow`, so both go to the same server, pool and volume; only the transport differs.
# Jobs alternate plaintext/TLS (the order swapped every round) and each figure is the median
# of ROUNDS runs, so drift on a shared machine hits both sides alike. Goal (issue 12): TLS at
# most 15 % slower, i.e. a TLS/plain ratio of at least 0.85 for throughput and IOPS.
#
#   bash bench/nbd/tls-bench.sh                         # 512 MiB, 10 s per run, 3 rounds
#   SIZE=1G RUNTIME=20 ROUNDS=5 bash bench/nbd/tls-bench.sh
#   CONDENSE=target/release/condense BENCH_DIR=/mnt/disk bash bench/nbd/tls-bench.sh
#
# Certificates are made with openssl (ECDSA P-256; TLS 1.3 with AES-GCM is what libnbd's
# GnuTLS and rustls agree on). Needs: fio, openssl, libnbd-bin, python3. Prints figures;
# asserts nothing.
#
# With nbdkit installed (NBDKIT=0 skips it), every job also runs against `nbdkit --tls=require
# file` serving a copy of the same data from the page cache, in the same rounds: the peer to
# beat. JOBS picks jobs by name (JOBS="seqread1m randread4k"; default: all four). Besides the
# server's CPU seconds per GiB, the client's (fio with libnbd/GnuTLS, from fio's own CPU
# figures) are printed: on 2 cores the client's decryption competes with the server.
# CONDENSE_BASE=/path/to/older/condense adds "TLS base": TLS served by that build from a copy
# of the pool, in the same rounds, to compare two builds in one run.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SIZE=${SIZE:-512M}
RUNTIME=${RUNTIME:-10}
RAMP=${RAMP:-2}
ROUNDS=${ROUNDS:-3}
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=${CARGO_TARGET_DIR:-$ROOT/target}/release/condense
fi
NBDKIT=${NBDKIT:-1}
command -v nbdkit >/dev/null || NBDKIT=0
JOBS=${JOBS:-seqread1m seqwrite1m randread4k randwrite4k}
for tool in fio openssl nbdcopy nbdinfo python3; do
    command -v "$tool" >/dev/null || { echo "missing $tool (scripts/install-deps.sh)"; exit 1; }
done
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "this fio has no nbd ioengine"; exit 1; }

BASE=${BENCH_DIR:-$ROOT/target/bench-nbd}
mkdir -p "$BASE"
W=$(mktemp -d "$BASE/tls.XXXXXX")
POOL=$W/pool
PORT=$((20000 + RANDOM % 20000))
SERVER_PID=
NBDKIT_PID=
BASE_PID=
cleanup() {
    for pid in $SERVER_PID $NBDKIT_PID $BASE_PID; do
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$W"
}
trap cleanup EXIT

# A CA and a server certificate for localhost; the client directory holds the CA only.
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
# fio's libnbd refuses local files named in a URI (tls-certificates=), so the TLS runs find
# the CA where libnbd looks by default: $HOME/.pki/libnbd/ca-cert.pem.
mkdir -p client/.pki/libnbd && cp ca-cert.pem client/.pki/libnbd/

echo "== setup: $SIZE of random data in a volume"
fio --name=fill --filename="$W/src.raw" --size="$SIZE" --rw=write --bs=1M --ioengine=psync \
    --refill_buffers=1 --output=/dev/null
bytes=$(stat -c %s "$W/src.raw")
"$CONDENSE" --pool "$POOL" init >/dev/null
"$CONDENSE" --pool "$POOL" volume create bench --size "$bytes" >/dev/null
# serve BINARY POOL PORT: a server with TLS allowed; prints its pid once it answers.
serve() {
    "$1" --pool "$2" serve --insecure-listen "127.0.0.1:$3" --tls allow \
        --tls-cert server-cert.pem --tls-key server-key.pem >>"$W/serve.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 100); do nbdinfo "nbd://127.0.0.1:$3/bench" >/dev/null 2>&1 && break; sleep 0.1; done
    HOME=$W/client nbdinfo "nbds://localhost:$3/bench" | grep -q "with TLS" ||
        { echo "TLS client cannot connect"; cat "$W/serve.log"; exit 1; }
    echo "$pid"
}
URI_PLAIN=nbd://127.0.0.1:$PORT/bench
URI_TLS="nbds://localhost:$PORT/bench"
SERVER_PID=$(serve "$CONDENSE" "$POOL" "$PORT")
nbdcopy --flush "$W/src.raw" "$URI_PLAIN"
TRANSPORTS="plain tls"
if [ -n "${CONDENSE_BASE:-}" ]; then
    # The older build serves a copy of the pool, taken while no server has it open.
    kill -TERM "$SERVER_PID"; while [ -e "/proc/$SERVER_PID" ]; do sleep 0.1; done
    cp -a "$POOL" "$W/pool-base"
    SERVER_PID=$(serve "$CONDENSE" "$POOL" "$PORT")
    BASE_PORT=$((PORT + 2))
    BASE_PID=$(serve "$CONDENSE_BASE" "$W/pool-base" "$BASE_PORT")
    URI_BASE="nbds://localhost:$BASE_PORT/bench"
    TRANSPORTS="$TRANSPORTS tls-base"
fi
if [ "$NBDKIT" = 1 ]; then
    # nbdkit --tls on the same data (a file in the page cache); its writes go to that file.
    NBDKIT_PORT=$((PORT + 1))
    nbdkit --exit-with-parent --foreground --pidfile="$W/nbdkit.pid" --port="$NBDKIT_PORT" \
        --ipaddr=127.0.0.1 --tls=require --tls-certificates="$W" file "$W/src.raw" \
        >"$W/nbdkit.log" 2>&1 &
    NBDKIT_PID=$!
    URI_NBDKIT="nbds://localhost:$NBDKIT_PORT/"
    for _ in $(seq 1 100); do HOME=$W/client nbdinfo "$URI_NBDKIT" >/dev/null 2>&1 && break; sleep 0.1; done
    HOME=$W/client nbdinfo "$URI_NBDKIT" | grep -q "with TLS" || { echo "nbdkit --tls does not answer"; cat "$W/nbdkit.log"; exit 1; }
    cat "$W/src.raw" >/dev/null
    TRANSPORTS="$TRANSPORTS nbdkit-tls"
else
    rm -f "$W/src.raw"
fi

# The server's CPU time so far (user + system, in clock ticks): on a 2-core machine the client
# (GnuTLS in libnbd) competes for the same cores, so the server's CPU per GiB moved is the
# figure that carries over to a server whose clients run on other hosts.
server_cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TICKS=$(getconf CLK_TCK)

# run TRANSPORT NAME ROUND FIO-ARGS...
run() {
    local transport=$1 name=$2 round=$3
    shift 3
    local uri=$URI_PLAIN home=$HOME pid=$SERVER_PID
    [ "$transport" = tls ] && uri=$URI_TLS home=$W/client
    [ "$transport" = tls-base ] && uri=$URI_BASE home=$W/client pid=$BASE_PID
    [ "$transport" = nbdkit-tls ] && uri=$URI_NBDKIT home=$W/client pid=$NBDKIT_PID
    local before
    before=$(server_cpu_ticks "$pid")
    HOME=$home fio --name="$name" --ioengine=nbd --uri="$uri" --size="$bytes" --time_based=1 \
        --runtime="$RUNTIME" --ramp_time="$RAMP" --randrepeat=0 --refill_buffers=1 \
        --output-format=json --output="$W/$transport-$name-$round.json" "$@" >/dev/null 2>&1 ||
        { echo "fio $name over $transport failed"; tail -5 "$W/$transport-$name-$round.json"; return 1; }
    echo $(($(server_cpu_ticks "$pid") - before)) >"$W/$transport-$name-$round.cpu"
}

jobs=(
    "seqread1m|--rw=read --bs=1M --iodepth=4"
    "seqwrite1m|--rw=write --bs=1M --iodepth=4"
    "randread4k|--rw=randread --bs=4k --iodepth=32"
    "randwrite4k|--rw=randwrite --bs=4k --iodepth=32"
)
for round in $(seq 1 "$ROUNDS"); do
    order=$TRANSPORTS
    [ $((round % 2)) = 0 ] && order=$(printf '%s\n' $TRANSPORTS | tac | xargs)
    for j in "${jobs[@]}"; do
        name=${j%%|*}
        [[ " $JOBS " == *" $name "* ]] || continue
        read -r -a args <<<"${j#*|}"
        for transport in $order; do
            echo "== round $round: $name over $transport"
            run "$transport" "$name" "$round" "${args[@]}"
        done
    done
done

python3 - "$W" "$SIZE" "$RUNTIME" "$ROUNDS" "$RAMP" "$TICKS" "$JOBS" "$TRANSPORTS" <<'EOF'
import json, os, statistics, sys
w, size, runtime, rounds, ramp, ticks, jobs, transports = sys.argv[1:9]
rounds, seconds, ticks = int(rounds), float(runtime) + float(ramp), int(ticks)
jobs = jobs.split()
extra = [(t, label) for t, label in [("tls-base", "TLS base"), ("nbdkit-tls", "nbdkit TLS")]
         if t in transports.split()]

def load(transport, name, r):
    with open(os.path.join(w, f"{transport}-{name}-{r}.json")) as f:
        return json.load(f)["jobs"][0]

def value(transport, name, rw, key):
    return statistics.median(load(transport, name, r)[rw][key] for r in range(1, rounds + 1))

def cpu_per_gib(transport, name, rw):
    """Server CPU seconds per GiB moved: CPU over the run (ramp included) / (bandwidth × time)."""
    out = []
    for r in range(1, rounds + 1):
        bw = load(transport, name, r)[rw]["bw_bytes"]
        with open(os.path.join(w, f"{transport}-{name}-{r}.cpu")) as f:
            cpu = int(f.read()) / ticks
        out.append(cpu / (bw * seconds / 2**30) if bw else float("nan"))
    return statistics.median(out)

def client_cpu_per_gib(transport, name, rw):
    """fio's own CPU seconds (user + system, ramp excluded) per GiB it moved."""
    out = []
    for r in range(1, rounds + 1):
        j = load(transport, name, r)
        cpu = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000
        moved = j[rw]["io_bytes"] / 2**30
        out.append(cpu / moved if moved else float("nan"))
    return statistics.median(out)

rows = [
    ("seq read 1M qd4 (MiB/s)", "seqread1m", "read", "bw_bytes", 2**20),
    ("seq write 1M qd4 (MiB/s)", "seqwrite1m", "write", "bw_bytes", 2**20),
    ("rand read 4K qd32 (IOPS)", "randread4k", "read", "iops", 1),
    ("rand write 4K qd32 (IOPS)", "randwrite4k", "write", "iops", 1),
]
rows = [row for row in rows if row[1] in jobs]
kit_hdr = "".join(f"{label:>12}" for _, label in extra)
print()
print(f"NBD plaintext vs TLS, one connection, {size} volume, {runtime} s per run, "
      f"median of {rounds} alternated rounds")
hdr = f"{'job':<28}{'plaintext':>12}{'TLS':>12}{'TLS/plain':>12}{kit_hdr}{'goal >=0.85':>13}"
print(hdr)
print("-" * len(hdr))
for label, name, rw, key, div in rows:
    p = value("plain", name, rw, key) / div
    t = value("tls", name, rw, key) / div
    k = "".join(f"{value(t, name, rw, key) / div:>12.0f}" for t, _ in extra)
    r = t / p if p else float("nan")
    print(f"{label:<28}{p:>12.0f}{t:>12.0f}{r:>11.2f}x{k}{'met' if r >= 0.85 else 'MISSED':>13}")
for title, f in [("server CPU seconds per GiB moved (client excluded)", cpu_per_gib),
                 ("client (fio) CPU seconds per GiB moved, ramp excluded", client_cpu_per_gib)]:
    print()
    print(title)
    hdr = f"{'job':<28}{'plaintext':>12}{'TLS':>12}{'TLS/plain':>12}{kit_hdr}"
    print(hdr)
    print("-" * len(hdr))
    for label, name, rw, key, div in rows:
        p = f("plain", name, rw)
        t = f("tls", name, rw)
        k = "".join(f"{f(t, name, rw):>12.2f}" for t, _ in extra)
        print(f"{label.split(' (')[0]:<28}{p:>12.2f}{t:>12.2f}"
              f"{t / p if p else float('nan'):>11.2f}x{k}")
EOF
