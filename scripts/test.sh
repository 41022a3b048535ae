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
passed=0; failed=0; failures=(); times=()
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name"
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); failures+=("$name"); fi
  times+=("$((SECONDS - t0)) s  $name")
}
step "cargo fmt --check" cargo fmt --all -- --check
step "cargo clippy -D warnings" cargo clippy --workspace --all-targets --release -- -D warnings
step "cargo build --release" cargo build --workspace --release --all-targets
step "cargo test (unit, property, crash simulation, CLI end to end)" cargo test --workspace --release
# The engine's assertions (debug_assert!: lock order, group commit, paired checks) are
# compiled only without --release: its tests once more in a debug build (a few minutes).
step "cargo test -p condense-engine (debug build: assertions on)" cargo test -p condense-engine
# Every decoder of bytes from disk, a bucket or the network, 10 s each (fuzz/run.sh; longer
# runs by hand: `fuzz/run.sh 300 TARGET`). 10 s, not 15: the many-hosts steps of
# tests/s3/cluster.sh took the ~95 s back that CI's time budget had not.
step "fuzz/run.sh 10" fuzz/run.sh 10
export CONDENSE="${CARGO_TARGET_DIR:-$PWD/target}/release/condense"
for t in tests/*/run.sh; do
  [ -x "$t" ] || continue
  step "$t" "$t"
done
# Pools on S3 on a 3-node Garage cluster (after tests/s3/run.sh, which installs Garage).
step "tests/s3/pool.sh" tests/s3/pool.sh
# Many hosts on one pool: the claim race (100 rounds), a takeover after kill -9, hosts sharing
# one pool (dedup across hosts, GC that waits for every host, a clone and a move between hosts).
step "tests/s3/cluster.sh" tests/s3/cluster.sh
echo
echo "time per step (the whole run: $SECONDS s):"
printf '  %s\n' "${times[@]}"
if [ $failed -gt 0 ]; then echo "failed: ${failures[*]}"; fi
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
