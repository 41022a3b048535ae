#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit/property/crash-simulation tests, and the
# end-to-end tests with real clients (qemu-img, qemu-io, nbdinfo, nbdcopy, fio, FUSE, loop
# devices). Tests that need root, /dev/fuse or loop devices run when they are available and
# always in CI (CI=true); elsewhere they skip and say why.
#
#   scripts/test.sh
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh || exit 1
# The builds below take ~6 GB and the end-to-end tests a few more; say so up front, since a full
# disk fails every later step with errors that look like anything but that.
df -h . | tail -1 | awk '{print "disk: " $4 " free of " $2 " where the suite runs"}'
# Garage, the store of tests/s3, takes ~10 min of CPU to build on a fresh machine. Under CI it
# builds from here on in the background at the lowest CPU priority, on what the steps below
# leave idle (their sleeps, lease waits and I/O); the first test of tests/s3 calls
# scripts/install-garage.sh again, which waits for this build (a lock) and finds it installed.
garage_log=
if [ "${CI:-}" = true ]; then
  garage_log=$(mktemp /tmp/condense-garage-build.XXXXXX)
  nice -n 19 bash scripts/install-garage.sh >"$garage_log" 2>&1 &
  echo "building Garage in the background (nice 19; its log: $garage_log)"
fi
passed=0; failed=0; failures=(); times=()
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name"
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("$name"); fi
  times+=("$((SECONDS - t0)) s  $name")
}
step "cargo fmt --check" cargo fmt --all -- --check
# The walls (issue 41): no import circle or upward import (scripts/layers.txt), no function
# over 100 lines, json! in at most 5 places in the CLI and service, crate sizes, no fuzz or sim
# module in release builds. Under a second.
step "scripts/module-map.py --check" scripts/module-map.py --check
step "cargo clippy -D warnings" cargo clippy --workspace --all-targets -- -D warnings
# The shipped binary (release profile: thin LTO), which the end-to-end tests below run.
step "cargo build --release -p condense" cargo build --release -p condense
# Every unit, property, crash-simulation and CLI test once, in the test profile (Cargo.toml:
# optimised, with the engine's debug_assert! checks of lock order, group commit and paired
# checks compiled in, and overflow checks). Not in release: a release build of every test
# binary links each with LTO, which took most of CI's time (2108 s of 4468 in one run).
step "cargo test (unit, property, crash simulation, CLI; assertions on)" cargo test --workspace
# Every decoder of bytes from disk, a bucket or the network, 5 s each under ASan (fuzz/run.sh):
# the committed seeds and what the fuzzer finds from them. An unoptimized build (--dev, with
# overflow checks and debug assertions) builds in ~4 minutes where the optimized one took ~11
# of CI's time; long runs by hand use the optimized build: `fuzz/run.sh 300 TARGET`.
step "fuzz/run.sh 5 (--dev)" env FUZZ_BUILD_ARGS=--dev fuzz/run.sh 5
# The fuzz build (~2 GB under ASan) is needed by nothing after it.
[ "${CI:-}" = true ] && rm -rf "${FUZZ_TARGET_DIR:-fuzz/target}"
export CONDENSE="${CARGO_TARGET_DIR:-$PWD/target}/release/condense"
for t in tests/*/run.sh; do
  [ -x "$t" ] || continue
  step "$t" "$t"
done
# Pools on S3 on a 3-node Garage cluster (after tests/s3/run.sh, which installs Garage).
step "tests/s3/pool.sh" tests/s3/pool.sh
# Many hosts on one pool (~10 minutes): the pool-lease race (20 rounds), a takeover after kill -9,
# hosts sharing one pool (dedup across hosts, GC that waits for every host, a clone and a move
# between hosts), a race for one volume (50 rounds here, ~1.4 s each, 100 by default; 99 in
# 100 are decided by the claim rule, so every round is a real race), GC under load (1 minute
# here, 2 by default), a dead host's volume taken over under durability remote, adopts killed
# part way and finished, a host killed for good and forgotten (`hosts forget`, its space back).
step "tests/s3/cluster.sh" env GC_SECONDS="${GC_SECONDS:-60}" ROUNDS="${ROUNDS:-50}" tests/s3/cluster.sh
# Randomized faults on three hosts of one pool (issue 40, ~3 minutes): the claim, join and
# hand-over windows hit on purpose (3 rounds each), then 60 random operations under SIGSTOP,
# kill -9 of hosts and Garage nodes and slow store replies; the checker (one writer per name,
# every acknowledged write in its owner's volume, unique slots, verify clean). The seed is
# printed: SEED=N tests/s3/nemesis.sh repeats a failing run's choices.
step "tests/s3/nemesis.sh" tests/s3/nemesis.sh
echo
echo "time per step (the whole run: $SECONDS s):"
df -h . | tail -1 | awk '{print "disk at the end: " $4 " free"}'
printf '  %s\n' "${times[@]}"
[ -z "$garage_log" ] || echo "background Garage build: $(tail -1 "$garage_log")"
if [ $failed -gt 0 ]; then echo "failed: ${failures[*]}"; fi
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
