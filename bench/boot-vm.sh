#!/usr/bin/env bash
# A VM boots from a Condense volume: import a corpus image (../shared/corpus/build.sh) into a
# fresh pool, serve it over NBD (Unix socket), boot it read-write with qemu-system-x86_64 (TCG)
# until the serial console shows "login:", power the VM off, and print that time next to the
# same boot from a sparse copy of the raw file. Then stop the server (SIGTERM) and run
# `condense stats` and `condense verify` on the pool the VM wrote to. Not a test: prints figures.
#
#   bench/boot-vm.sh [IMAGE] [WORK_DIR]      # default /work/corpus/images/dns1.raw /work/boot-vm
#
# Environment:
#   BOOT=bios|kernel   bios (default): SeaBIOS -> GRUB from the disk -> kernel. kernel: direct
#                      kernel boot with the image's kernel/initrd from ROOTFS/<name>/boot (the
#                      root file system still comes from the disk).
#   ROOTFS=DIR         where build.sh left the trees (default: IMAGE's ../rootfs)
#   BOOT_TIMEOUT=S     seconds to wait for "login:" (default 600)
#   RUNS=N             boots each way, alternating which goes first (default 3); medians printed.
#                      Boots after the first start from a file system the previous VM wrote to
#                      and was powered off under (journal replay), the same on both sides.
#   MEM=MiB SMP=N      guest size (default 1024, 2)
#   CONDENSE=PATH      use this condense binary instead of building one
#   DROP_CACHES=0      keep the page cache before each boot (default: drop it, both boots cold)
#   CLONE=1            boot a clone instead: snapshot the imported volume as NAME@golden and
#                      boot `condense volume clone NAME@golden NAME-clone` (what a VM host does
#                      with a golden image); the clone's writes leave the golden image as it was
#   S3=1               also boot from a pool on S3 (issue 11): a 3-node Garage cluster
#                      (tests/s3/garage.sh, in WORK_DIR/garage) holds a second pool with the same
#                      image; each run adds a boot with a cold cache (a fresh `condense connect`
#                      directory: every chunk from the bucket) and a warm one (the same directory,
#                      serve restarted), with the S3 requests each made (Garage's logs). The
#                      pool's local directory is deleted after the import: the bucket alone.
#   S3_CACHE_SIZE=SIZE --cache-size of the S3 pool's local directory (default 4G)
#   S3_DURABILITY=D    local (default) | remote
set -euo pipefail

image=${1:-/work/corpus/images/dns1.raw}
work=${2:-/work/boot-vm}
boot=${BOOT:-bios}
boot_timeout=${BOOT_TIMEOUT:-600}
runs=${RUNS:-3}
mem=${MEM:-1024}
smp=${SMP:-2}
here=$(cd "$(dirname "$0")/.." && pwd)

say() { printf '\n== %s\n' "$*"; }
die() { printf 'boot-vm.sh: %s\n' "$*" >&2; exit 1; }

[ -f "$image" ] || die "no image $image (build the corpus with ../shared/corpus/build.sh OUT)"
image=$(cd "$(dirname "$image")" && pwd)/$(basename "$image")
name=$(basename "$image"); name=${name%.*}
rootfs=${ROOTFS:-$(dirname "$(dirname "$image")")/rootfs}

# --- tools --------------------------------------------------------------------------------
if ! command -v qemu-system-x86_64 >/dev/null; then
  say "installing qemu-system-x86"
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y qemu-system-x86 >/dev/null || { apt-get update >/dev/null && apt-get install -y qemu-system-x86 >/dev/null; }
  else
    sudo apt-get install -y qemu-system-x86 >/dev/null
  fi
fi
if [ -n "${CONDENSE:-}" ]; then
  condense=$CONDENSE
else
  say "building condense (cargo build --release -p condense)"
  (cd "$here" && cargo build --release -p condense)
  condense=$here/target/release/condense
fi
[ -x "$condense" ] || die "no condense binary at $condense"

kernel_args=()
if [ "$boot" = kernel ]; then
  bootdir=$rootfs/$name/boot
  vmlinuz=$(ls "$bootdir"/vmlinuz-* 2>/dev/null | sort -V | tail -1)
  initrd=$(ls "$bootdir"/initrd.img-* 2>/dev/null | sort -V | tail -1)
  [ -n "$vmlinuz" ] && [ -n "$initrd" ] || die "BOOT=kernel: no vmlinuz/initrd in $bootdir"
  uuid=$(grep -o 'root=UUID=[0-9a-f-]*' "$bootdir/grub/grub.cfg" | head -1 | cut -d= -f3)
  [ -n "$uuid" ] || die "BOOT=kernel: no root=UUID= in $bootdir/grub/grub.cfg"
  kernel_args=(-kernel "$vmlinuz" -initrd "$initrd" -append "root=UUID=$uuid ro console=ttyS0,115200n8")
elif [ "$boot" != bios ]; then
  die "BOOT must be bios or kernel"
fi

# --- processes we start, and their cleanup ---------------------------------------------------
qemu_pid= qemu_pidfile= server_pid= boot_s= boot_line=
s3=${S3:-0} s3_pid='' garage_started=0
cleanup() {
  stop_qemu
  local p
  for p in "$server_pid" "$s3_pid"; do
    if [ -n "$p" ] && kill -0 "$p" 2>/dev/null; then
      kill -TERM "$p" 2>/dev/null || true
      timeout 60 tail --pid="$p" -f /dev/null 2>/dev/null || kill -KILL "$p" 2>/dev/null || true
    fi
  done
  if [ "$garage_started" = 1 ]; then "$here/tests/s3/garage.sh" stop "$work/garage" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

drop_caches() {
  sync
  [ "${DROP_CACHES:-1}" = 0 ] || echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
}

# stop_qemu: SIGTERM to `timeout`, which passes it on; QEMU then stops the guest, flushes its
# block devices and exits. SIGKILL (to QEMU itself, from its pid file) if it takes over 30 s.
stop_qemu() {
  [ -n "$qemu_pid" ] || return 0
  kill -TERM "$qemu_pid" 2>/dev/null || true
  if ! timeout 30 tail --pid="$qemu_pid" -f /dev/null 2>/dev/null; then
    [ -s "$qemu_pidfile" ] && kill -KILL "$(cat "$qemu_pidfile")" 2>/dev/null || true
    kill -KILL "$qemu_pid" 2>/dev/null || true
  fi
  wait "$qemu_pid" 2>/dev/null || true
  qemu_pid=
}

# boot_vm LABEL DRIVE_FILE: boot the VM until "login:" on its serial console; sets boot_s and
# boot_line (that line of the console).
boot_vm() {
  local label=$1 file=$2 log=$work/serial-$1.log start
  : > "$log"
  qemu_pidfile=$work/qemu-$label.pid
  rm -f "$qemu_pidfile"
  drop_caches
  start=$(date +%s.%N)
  timeout $((boot_timeout + 60)) qemu-system-x86_64 \
    -accel tcg -m "$mem" -smp "$smp" -nographic -monitor none -serial "file:$log" \
    -drive "file=$file,format=raw,if=virtio" -nic none -pidfile "$qemu_pidfile" "${kernel_args[@]}" \
    </dev/null >"$work/qemu-$label.out" 2>&1 &
  qemu_pid=$!
  until grep -q 'login:' "$log"; do
    if ! kill -0 "$qemu_pid" 2>/dev/null; then
      echo "boot-vm.sh: $label: qemu exited before the login prompt; its output:" >&2
      cat "$work/qemu-$label.out" >&2; tail -20 "$log" | sed 's/\x1b\[[0-9;?]*[A-Za-z]//g' >&2
      qemu_pid=; return 1
    fi
    if [ "$(echo "$(date +%s.%N) - $start > $boot_timeout" | bc)" = 1 ]; then
      echo "boot-vm.sh: $label: no login prompt after $boot_timeout s; last serial lines:" >&2
      tail -20 "$log" | sed 's/\x1b\[[0-9;?]*[A-Za-z]//g' >&2
      stop_qemu; return 1
    fi
    sleep 0.2
  done
  boot_s=$(echo "$(date +%s.%N) - $start" | bc)
  stop_qemu
  boot_line=$(grep -a 'login:' "$log" | head -1 | tr -d '\r' | sed 's/ *$//')
}

# --- setup: the pool with the imported image, the raw copy, the server -----------------------
rm -rf "$work"; mkdir -p "$work"
export CONDENSE_POOL=$work/pool
sock=$work/nbd.sock
say "condense: fresh pool in $CONDENSE_POOL, importing $image"
"$condense" init >/dev/null
"$condense" import "$image" --name "$name"
export_name=$name
if [ "${CLONE:-0}" = 1 ]; then
  say "snapshot $name@golden and clone it into $name-clone (the VM boots the clone)"
  "$condense" snapshot create "$name" golden
  "$condense" volume clone "$name@golden" "$name-clone"
  export_name=$name-clone
fi
"$condense" stats > "$work/stats-import.txt"

# --- S3=1: the same image in a pool on a Garage cluster ---------------------------------------------
if [ "$s3" = 1 ]; then
  s3_cache_size=${S3_CACHE_SIZE:-4G}
  s3_durability=${S3_DURABILITY:-local}
  s3_sock=$work/s3.sock
  # s3c ARGS...: condense for the S3 pool (--pool or connect name its directory, not $CONDENSE_POOL).
  s3c() { env -u CONDENSE_POOL "$condense" "$@"; }
  say "S3: a 3-node Garage cluster (RF 3) in $work/garage"
  mkdir -p "$work/garage"
  "$here/tests/s3/garage.sh" start "$work/garage" > "$work/garage-start.log" 2>&1 \
    || { cat "$work/garage-start.log" >&2; die "tests/s3/garage.sh start failed (scripts/install-garage.sh installs garage)"; }
  garage_started=1
  # shellcheck disable=SC1091
  . "$work/garage/credentials.env"
  s3_url=s3://$CONDENSE_S3_BUCKET/boot-vm
  say "S3: condense init $s3_url (--cache-size $s3_cache_size, --durability $s3_durability), importing $image"
  s3c init "$s3_url" --cache "$work/s3-import" --cache-size "$s3_cache_size" --durability "$s3_durability" >/dev/null
  s3c --pool "$work/s3-import" import "$image" --name "$name"
  if [ "${CLONE:-0}" = 1 ]; then
    s3c --pool "$work/s3-import" snapshot create "$name" golden
    s3c --pool "$work/s3-import" volume clone "$name@golden" "$name-clone"
  fi
  s3c --pool "$work/s3-import" stats > "$work/stats-s3-import.txt"
  rm -rf "$work/s3-import" # from here on the pool is the bucket alone
fi

say "cp --sparse=always $image $work/$name.raw (the baseline)"
cp --sparse=always "$image" "$work/$name.raw"

say "condense serve --socket $sock"
"$condense" serve --socket "$sock" 2> "$work/serve.log" &
server_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || { cat "$work/serve.log" >&2; die "condense serve did not create $sock"; }

# CPU seconds (user + system) a process has used so far.
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' "/proc/$1/stat"; }

# --- the boots: alternate the order, so neither side always runs first -----------------------
say "booting $name $runs time(s) each way: TCG, $boot boot, -m $mem -smp $smp, read-write, no snapshot"
echo "   load average before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"
condense_times=() raw_times=() server_cpu=0
boot_condense() {
  local before
  before=$(cpu_s "$server_pid")
  boot_vm "condense-$1" "nbd+unix:///$export_name?socket=$sock" || die "boot from Condense failed"
  condense_times+=("$boot_s")
  server_cpu=$(echo "$server_cpu + $(cpu_s "$server_pid") - $before" | bc)
  printf '   run %d, Condense over NBD: login prompt after %5.1f s  ("%s")\n' "$1" "$boot_s" "$boot_line"
}
boot_raw() {
  boot_vm "raw-$1" "$work/$name.raw" || die "boot from the raw file failed"
  raw_times+=("$boot_s")
  printf '   run %d, raw file:          login prompt after %5.1f s  ("%s")\n' "$1" "$boot_s" "$boot_line"
}
# S3=1: S3 requests (Garage's logs: each request is logged once, by the node that took it).
s3_requests() { # KIND: PUT | GET (objects and lists) | HEAD | DELETE
  cat "$work/garage"/node*/log | grep -F 'generic_server:' | grep -c -e ") $1 /$CONDENSE_S3_BUCKET" || true
}
s3_serve() { # DIR
  rm -f "$s3_sock"
  # Not through s3c: a function run with & is a subshell, and $! must be condense itself.
  env -u CONDENSE_POOL "$condense" --pool "$1" serve --socket "$s3_sock" 2>> "$work/s3-serve.log" &
  s3_pid=$!
  for _ in $(seq 1200); do [ -S "$s3_sock" ] && return 0; kill -0 "$s3_pid" 2>/dev/null || break; sleep 0.1; done
  tail -20 "$work/s3-serve.log" >&2; die "condense serve of the S3 pool did not create $s3_sock"
}
s3_stop() { # clean close: what is not in the bucket yet is uploaded
  kill -TERM "$s3_pid"
  timeout 120 tail --pid="$s3_pid" -f /dev/null || die "the S3 pool's serve still running 120 s after SIGTERM"
  local rc=0
  wait "$s3_pid" || rc=$?
  s3_pid=
  [ "$rc" = 0 ] || { tail -20 "$work/s3-serve.log" >&2; die "the S3 pool's serve exited with status $rc"; }
}
s3_cold_times=() s3_warm_times=() s3_cpu=0 s3_dir=
# boot_s3 RUN: a fresh connect directory; boot with the cache cold, then again warm.
boot_s3() {
  local temp before gets puts line
  [ -z "$s3_dir" ] || rm -rf "$s3_dir"
  s3_dir=$work/s3-cache-$1
  s3c connect "$s3_url" --cache "$s3_dir" --cache-size "$s3_cache_size" --durability "$s3_durability" >/dev/null
  for temp in cold warm; do
    gets=$(s3_requests GET) puts=$(s3_requests PUT)
    s3_serve "$s3_dir"
    before=$(cpu_s "$s3_pid")
    boot_vm "s3-$temp-$1" "nbd+unix:///$export_name?socket=$s3_sock" || die "boot from the S3 pool ($temp cache) failed"
    s3_cpu=$(echo "$s3_cpu + $(cpu_s "$s3_pid") - $before" | bc)
    s3_stop
    gets=$(($(s3_requests GET) - gets)) puts=$(($(s3_requests PUT) - puts))
    if [ "$temp" = cold ]; then s3_cold_times+=("$boot_s"); else s3_warm_times+=("$boot_s"); fi
    line=$(printf '   run %d, S3 pool, %s cache: login prompt after %5.1f s  (%d GETs, %d PUTs from serve start to stop)' "$1" "$temp" "$boot_s" "$gets" "$puts")
    echo "$line"; echo "$line" >> "$work/s3-boots.txt"
  done
}
for i in $(seq "$runs"); do
  if [ $((i % 2)) = 1 ]; then boot_condense "$i"; boot_raw "$i"; else boot_raw "$i"; boot_condense "$i"; fi
  if [ "$s3" = 1 ]; then boot_s3 "$i"; fi
done
rm -f "$work/$name.raw"

say "stopping condense serve (SIGTERM)"
kill -TERM "$server_pid"
if timeout 120 tail --pid="$server_pid" -f /dev/null; then
  wait "$server_pid" && rc=0 || rc=$?
  server_pid=
  cat "$work/serve.log"
  [ "$rc" = 0 ] || die "condense serve exited with status $rc"
else
  die "condense serve still running 120 s after SIGTERM"
fi

# --- the pool after the VM wrote to it ---------------------------------------------------------
say "condense stats (after import)"
cat "$work/stats-import.txt"
say "condense stats (after the boots: the VM wrote to the volume)"
"$condense" stats
say "condense verify"
"$condense" verify && verify=clean || verify="FAILED (exit $?)"
if [ "$s3" = 1 ]; then
  say "S3 pool: condense stats (after import)"
  cat "$work/stats-s3-import.txt"
  say "S3 pool: condense stats (after the boots), then verify (from $s3_dir)"
  s3c --pool "$s3_dir" stats
  s3c --pool "$s3_dir" stats --json | jq -c '{remote_durability, remote_objects, remote_bytes, remote_puts, remote_gets, remote_health}' 2>/dev/null || true
  start=$(date +%s.%N)
  s3c --pool "$s3_dir" verify && s3_verify=clean || s3_verify="FAILED (exit $?)"
  printf 'S3 pool verify: %s in %.1f s\n' "$s3_verify" "$(echo "$(date +%s.%N) - $start" | bc)"
  [ "$s3_verify" = clean ] || verify="$verify; S3 pool: $s3_verify"
fi

median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
list() { printf '%.1f ' "$@"; }
cm=$(median "${condense_times[@]}") rm_=$(median "${raw_times[@]}")
say "result: $name to login: prompt (TCG, $boot boot, -m $mem -smp $smp, $runs run(s) each)"
printf 'Condense over NBD (unix socket): median %6.1f s   runs: %s\n' "$cm" "$(list "${condense_times[@]}")"
printf 'raw file (cp --sparse=always):   median %6.1f s   runs: %s\n' "$rm_" "$(list "${raw_times[@]}")"
printf 'ratio of medians Condense / raw: %.2f\n' "$(echo "$cm / $rm_" | bc -l)"
if [ "$s3" = 1 ]; then
  sc=$(median "${s3_cold_times[@]}") sw=$(median "${s3_warm_times[@]}")
  printf 'S3 pool, cold cache (fresh connect): median %6.1f s   runs: %s\n' "$sc" "$(list "${s3_cold_times[@]}")"
  printf 'S3 pool, warm cache (same dir):      median %6.1f s   runs: %s\n' "$sw" "$(list "${s3_warm_times[@]}")"
  printf 'ratio of medians S3 cold / local Condense: %.2f, S3 warm / local Condense: %.2f\n' \
    "$(echo "$sc / $cm" | bc -l)" "$(echo "$sw / $cm" | bc -l)"
  printf 'S3 pool serve CPU during its boots: %.1f s in all; durability %s, --cache-size %s\n' "$s3_cpu" "$s3_durability" "$s3_cache_size"
  cat "$work/s3-boots.txt"
fi
printf 'condense serve CPU during its boots: %.1f s in all\n' "$server_cpu"
printf 'load average now: %s on %s CPUs (TCG times swing with other load on the machine)\n' "$(cut -d' ' -f1-3 /proc/loadavg)" "$(nproc)"
printf 'condense verify after the boots: %s\n' "$verify"
printf 'serial logs: %s/serial-*.log\n' "$work"
[ "$verify" = clean ]
