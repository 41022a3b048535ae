#!/usr/bin/env bash
# End-to-end test of the Prometheus endpoint (`--metrics-listen`) with real clients and a real
# Prometheus server:
#
#   condense serve --metrics-listen -> qemu-io and nbdcopy write through NBD -> curl /metrics:
#   promtool check metrics passes, write counters moved by exactly the bytes written, the
#   latency histogram counts every request, a connected client shows and goes away, the
#   pool's written bytes and savings are there -> Prometheus (Debian's package) scrapes the
#   endpoint every second; after more writes its HTTP API answers the new counter value ->
#   condense mount --metrics-listen (FUSE: root and /dev/fuse; skipped elsewhere with the
#   reason, failed in CI): dd through the mount moves the FUSE byte counters.
#
#   bash tests/metrics/run.sh              # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/metrics/run.sh
#
# Needs (Debian): qemu-utils libnbd-bin curl prometheus (prometheus and promtool); fuse3 for
# the mount part. Ends with "N passed, M failed, K skipped". KEEP=1 keeps the work directory
# of a failed run.

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-io qemu-img nbdcopy nbdinfo curl jq python3 promtool prometheus

W=$(mktemp -d /tmp/condense-metrics-e2e.XXXXXX)
POOL=$W/pool
MNT=$W/mnt
free_port PORT
free_port MPORT
free_port PPORT
URI=nbd://127.0.0.1:$PORT
METRICS=http://127.0.0.1:$MPORT/metrics
SERVER_PID=
PROM_PID=
MOUNT_PID=
HOLDER_PID=

cleanup() {
    stop_pids "$HOLDER_PID" "$PROM_PID" "$SERVER_PID" "$MOUNT_PID"
    if grep -q " $MNT " /proc/mounts 2>/dev/null; then umount -l "$MNT" 2>/dev/null; fi
    remove_work_dir
}
trap cleanup EXIT

finish() { summary; exit $?; }
# expect NAME ACTUAL WANTED: pass if the two strings are equal.
expect() {
    if [ "$2" = "$3" ]; then ok "$1"; else echo "got '$2', want '$3'" >"$W/out"; fail "$1"; fi
}
c() { "$CONDENSE" --pool "$POOL" "$@"; }
scrape() { curl -sf "${1:-$METRICS}" -o "$W/scrape" && cp "$W/scrape" "$W/$2"; }
# value FILE SERIES: the sample's value in a saved scrape (empty if absent).
value() { awk -v s="$2" '$1 == s { print $2 }' "$W/$1"; }

c init >"$W/out" 2>&1 || { fail "condense init"; finish; }
c volume create vm --size 64M >"$W/out" 2>&1 || { fail "volume create"; finish; }
# A cache tier, so that its metrics are scraped (and checked against docs/METRICS.md) too.
c cache attach "$W/fast" --size 16M >"$W/out" 2>&1 || { fail "cache attach"; finish; }
head -c 8388608 /dev/urandom >"$W/random.raw"

"$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" --metrics-listen "127.0.0.1:$MPORT" \
    >"$W/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 100); do
    curl -sf "$METRICS" -o /dev/null && nbdinfo --size "$URI/vm" >/dev/null 2>&1 && break
    sleep 0.1
done
check "serve prints where the metrics are" grep -q "metrics at http://127.0.0.1:$MPORT/metrics" "$W/server.log"
scrape "$METRICS" before || { cp "$W/server.log" "$W/out"; fail "first scrape"; finish; }
W_BYTES='condense_nbd_request_bytes_total{command="write"}'
W_REQS='condense_nbd_requests_total{command="write"}'
W_COUNT='condense_nbd_request_duration_seconds_count{command="write"}'
W_INF='condense_nbd_request_duration_seconds_bucket{command="write",le="+Inf"}'
expect "no NBD writes counted before any" "$(value before "$W_BYTES")" 0

# One 4 MiB write with qemu-io (one request), then 8 MiB of random data with nbdcopy.
check "qemu-io writes 4 MiB" qemu-io -f raw -c "write -P 0xab 0 4M" "$URI/vm"
scrape "$METRICS" after_qemu
expect "one write request counted" "$(value after_qemu "$W_REQS")" 1
expect "its 4 MiB counted" "$(value after_qemu "$W_BYTES")" 4194304
expect "qemu-io's flush counted" \
    "$(value after_qemu 'condense_nbd_requests_total{command="flush"}')" 1
check "nbdcopy copies 8 MiB of random data" nbdcopy "$W/random.raw" "$URI/vm"
scrape "$METRICS" after
expect "write bytes moved by exactly 4 MiB + 8 MiB" "$(value after "$W_BYTES")" 12582912
expect "the latency histogram counts every write" \
    "$(value after "$W_COUNT")" "$(value after "$W_REQS")"
expect "the +Inf bucket equals the count" "$(value after "$W_INF")" "$(value after "$W_COUNT")"
expect "pool written bytes: the 8 MiB now in the volume" \
    "$(value after condense_pool_written_bytes)" 8388608
expect "per-volume written bytes" \
    "$(value after 'condense_volume_written_bytes{volume="vm"}')" 8388608
# Per-volume I/O, counted beneath NBD: the same writes, bytes and blocks.
V_IO='condense_volume_io_duration_seconds_count{volume="vm",op="write"}'
expect "per-volume I/O: vm's write bytes are the NBD write bytes" \
    "$(value after 'condense_volume_io_bytes_total{volume="vm",op="write"}')" "$(value after "$W_BYTES")"
expect "per-volume I/O: vm's write histogram counts every NBD write" \
    "$(value after "$V_IO")" "$(value after "$W_REQS")"
expect "per-volume I/O: its +Inf bucket equals its count" \
    "$(value after 'condense_volume_io_duration_seconds_bucket{volume="vm",op="write",le="+Inf"}')" \
    "$(value after "$V_IO")"
# 12 MiB in 4 KiB blocks: 3072 blocks written; the 8 MiB of random data are 2048 new chunks,
# the 4 MiB of one pattern one new chunk and 1023 deduplicated blocks.
blocks() { value after "condense_volume_blocks_written_total{volume=\"vm\",kind=\"$1\"}"; }
expect "per-volume I/O: vm's blocks written by kind (zero, dedup, new)" \
    "$(blocks zero) $(blocks dedup) $(blocks new)" "0 1023 2049"
expect "per-volume I/O: no errors" "$(value after 'condense_volume_io_errors_total{volume="vm"}')" 0
# A read of a range never written is answered over NBD with a hole chunk, and still counts
# as one read of its bytes (as a read of data does).
R_OPS='condense_volume_io_duration_seconds_count{volume="vm",op="read"}'
R_BYTES='condense_volume_io_bytes_total{volume="vm",op="read"}'
scrape "$METRICS" before_hole
check "qemu-io reads 1 MiB never written" qemu-io -f raw -c "read -P 0 32M 1M" "$URI/vm"
scrape "$METRICS" after_hole
expect "per-volume I/O: the hole read counts as one read of 1 MiB" \
    "$(($(value after_hole "$R_OPS") - $(value before_hole "$R_OPS"))) $(($(value after_hole "$R_BYTES") - $(value before_hole "$R_BYTES")))" \
    "1 1048576"
# The scrape counts the per-volume figures (a few KiB of pages here), and nothing spills.
expect "the per-volume figures' RAM and scratch bytes are exported (RAM > 0, scratch 0)" \
    "$(awk '$1 > 0 { print "ram" }' <<<"$(value after condense_pool_figures_ram_bytes)") $(value after condense_pool_figures_scratch_bytes)" \
    "ram 0"
check "savings ratio, dead bytes, journal, checkpoint and GC metrics are exposed" bash -c "
    for m in condense_pool_savings_ratio condense_pool_dead_bytes condense_pool_saved_bytes \
             condense_journal_records_total condense_journal_sync_duration_seconds_count \
             condense_checkpoint_duration_seconds_count condense_gc_progress_ratio \
             condense_nbd_clients_connected; do
        grep -q \"^\$m \" '$W/after' || { echo \"missing \$m\"; exit 1; }
    done"
check "promtool check metrics passes on the scrape" bash -c "promtool check metrics <'$W/after'"
# documented NAME: whether docs/METRICS.md has a row for the metric.
documented() { grep -q "^| \`$1[\`{]" "$ROOT/docs/METRICS.md"; }
# undocumented SCRAPE: the families of a saved scrape docs/METRICS.md does not list.
undocumented() {
    awk '/^# TYPE/ { print $3 }' "$W/$1" | while read -r m; do documented "$m" || echo "$m"; done
}
expect "every metric of the serve scrape is in docs/METRICS.md" "$(undocumented after | xargs)" ""
expect "the cache tier's metrics are scraped" "$(grep -c '^condense_cache_\(hits_total\|used_bytes\|size_bytes\) ' "$W/after")" "3"

# A client that stays connected shows in condense_nbd_clients_connected.
qemu-io -f raw -c "sleep 4000" "$URI/vm" >/dev/null 2>&1 &
HOLDER_PID=$!
held=
for _ in $(seq 1 30); do
    scrape "$METRICS" held
    held=$(value held condense_nbd_clients_connected)
    [ "$held" = 1 ] && break
    sleep 0.1
done
expect "a connected client is counted" "$held" 1
wait "$HOLDER_PID" 2>/dev/null; HOLDER_PID=
scrape "$METRICS" released
expect "and uncounted when it leaves" "$(value released condense_nbd_clients_connected)" 0

# A real Prometheus server scrapes the endpoint every second.
mkdir -p "$W/prom"
cat >"$W/prom/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: condense
    static_configs:
      - targets: ['127.0.0.1:$MPORT']
YML
check "promtool accepts the Prometheus config" promtool check config "$W/prom/prometheus.yml"
prometheus --config.file="$W/prom/prometheus.yml" --storage.tsdb.path="$W/prom/data" \
    --web.listen-address="127.0.0.1:$PPORT" >"$W/prom.log" 2>&1 &
PROM_PID=$!
PROM=http://127.0.0.1:$PPORT
ready=0
for _ in $(seq 1 150); do
    curl -sf "$PROM/-/ready" >/dev/null 2>&1 && { ready=1; break; }
    sleep 0.2
done
if [ "$ready" = 1 ]; then ok "Prometheus started"; else cp "$W/prom.log" "$W/out"; fail "Prometheus started"; fi
# promql QUERY: the value of the first result of an instant query (empty if none).
promql() {
    curl -sf -G "$PROM/api/v1/query" --data-urlencode "query=$1" |
        jq -r '.data.result[0].value[1] // empty'
}
# wait_promql QUERY WANTED: poll until the query answers WANTED (20 s at most); print the last answer.
wait_promql() {
    local got=
    for _ in $(seq 1 100); do
        got=$(promql "$1")
        [ "$got" = "$2" ] && break
        sleep 0.2
    done
    echo "$got"
}
expect "Prometheus scrapes condense (up == 1)" "$(wait_promql 'up{job="condense"}' 1)" 1
expect "Prometheus sees the 12 MiB written so far" "$(wait_promql "$W_BYTES" 12582912)" 12582912
check "qemu-io writes 2 MiB more" qemu-io -f raw -c "write -P 0xcd 16M 2M" "$URI/vm"
expect "Prometheus answers the moved counter: 14 MiB" "$(wait_promql "$W_BYTES" 14680064)" 14680064
expect "Prometheus answers the pool's written bytes" \
    "$(wait_promql condense_pool_written_bytes 10485760)" 10485760
# Every query of the Grafana dashboard is valid PromQL for this Prometheus (Grafana's
# variables replaced by plain values) and names only documented metrics.
DASH=$ROOT/dist/grafana/condense.json
dash_ok=1
: >"$W/out"
while IFS= read -r q; do
    q=${q//\$__rate_interval/1m}
    q=${q//\$job/.*}
    status=$(curl -s -G "$PROM/api/v1/query" --data-urlencode "query=$q" | jq -r .status)
    [ "$status" = success ] || { echo "query refused: $q" >>"$W/out"; dash_ok=0; }
done < <(jq -r '.panels[].targets[]?.expr' "$DASH")
for m in $(jq -r '.panels[].targets[]?.expr' "$DASH" | grep -o 'condense_[a-z_]*' |
           sed -E 's/_(bucket|sum|count)$//' | sort -u); do
    documented "$m" || { echo "undocumented: $m" >>"$W/out"; dash_ok=0; }
done
if [ "$dash_ok" = 1 ]; then ok "Grafana dashboard queries parse in Prometheus and use documented metrics"
else fail "Grafana dashboard queries parse in Prometheus and use documented metrics"; fi
kill -TERM "$PROM_PID" 2>/dev/null; wait "$PROM_PID" 2>/dev/null; PROM_PID=

kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=
if curl -sf "$METRICS" -o /dev/null 2>&1; then fail "the endpoint closes with the server"
else ok "the endpoint closes with the server"; fi

# A taken metrics address fails before serving, with a message naming it.
python3 -c "
import socket, sys, time
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()
open(sys.argv[1], 'w').write(str(s.getsockname()[1])); time.sleep(30)" "$W/squat.port" &
SQUAT=$!
for _ in $(seq 1 50); do [ -s "$W/squat.port" ] && break; sleep 0.1; done
TAKEN=$(cat "$W/squat.port" 2>/dev/null)
if timeout 10 "$CONDENSE" --pool "$POOL" serve --insecure-listen "127.0.0.1:$PORT" \
    --metrics-listen "127.0.0.1:$TAKEN" >"$W/taken.log" 2>&1; then
    cp "$W/taken.log" "$W/out"; fail "serve with a taken --metrics-listen address fails"
else
    check "serve with a taken --metrics-listen address fails and names it" \
        grep -q -- "--metrics-listen \"127.0.0.1:$TAKEN\"" "$W/taken.log"
fi
kill "$SQUAT" 2>/dev/null; wait "$SQUAT" 2>/dev/null

# The mount's endpoint (FUSE).
if [ ! -e /dev/fuse ]; then
    skip "metrics of condense mount" "/dev/fuse is missing"
    finish
fi
if [ "$(id -u)" != 0 ]; then
    skip "metrics of condense mount" "not root (dropping the page cache needs root)"
    finish
fi
mkdir -p "$MNT"
"$CONDENSE" --pool "$POOL" mount "$MNT" --metrics-listen "127.0.0.1:$MPORT" >"$W/mount.log" 2>&1 &
MOUNT_PID=$!
for _ in $(seq 1 100); do
    [ -e "$MNT/volumes/vm" ] && curl -sf "$METRICS" -o /dev/null && break
    sleep 0.1
done
scrape "$METRICS" mount_before || { cp "$W/mount.log" "$W/out"; fail "scrape of the mount"; finish; }
expect "no FUSE writes counted before any" \
    "$(value mount_before 'condense_fuse_bytes_total{op="write"}')" 0
check "dd writes 1 MiB into volumes/vm" \
    dd if="$W/random.raw" of="$MNT/volumes/vm" bs=1M count=1 seek=32 conv=notrunc,fsync status=none
sync
echo 3 >/proc/sys/vm/drop_caches
check "dd reads 2 MiB back" dd if="$MNT/volumes/vm" of="$W/back.raw" bs=1M count=2 skip=32 status=none
scrape "$METRICS" mount_after
expect "FUSE write bytes moved by exactly 1 MiB" \
    "$(value mount_after 'condense_fuse_bytes_total{op="write"}')" 1048576
read_bytes=$(value mount_after 'condense_fuse_bytes_total{op="read"}')
if [ -n "$read_bytes" ] && [ "$read_bytes" -ge 2097152 ]; then ok "FUSE read bytes cover the 2 MiB read ($read_bytes)"
else echo "read bytes: '$read_bytes'" >"$W/out"; fail "FUSE read bytes cover the 2 MiB read"; fi
expect "pool written bytes include the new MiB" "$(value mount_after condense_pool_written_bytes)" 11534336
check "promtool check metrics passes on the mount's scrape" bash -c "promtool check metrics <'$W/mount_after'"
expect "every metric of the mount's scrape is in docs/METRICS.md" "$(undocumented mount_after | xargs)" ""
kill -TERM "$MOUNT_PID"; wait "$MOUNT_PID" 2>/dev/null; MOUNT_PID=
check "verify clean after everything" c verify
finish
