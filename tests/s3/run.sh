#!/usr/bin/env bash
# The S3 backend against a real distributed store (issue 11): the object-store conformance
# suite (crates/object-store/src/conformance.rs) on a 3-node Garage cluster with replication factor 3.
#
#   install the pinned Garage (scripts/install-garage.sh; ~9.5 min once per machine, then < 1 s)
#   -> tests/s3/garage.sh start -> CONDENSE_S3_TEST=1 cargo test -p condense-object-store
#   (every test of the crate, the S3 conformance included) -> freeze every node (SIGSTOP): a
#   GET fails in bounded time with "store unreachable", then works after SIGCONT -> kill node 2 -> the S3 conformance
#   again (RF 3 keeps a quorum of 2) -> restart node 2 -> stop the cluster.
#
#   bash tests/s3/run.sh                     # KEEP=1 keeps the work directory if a step fails
#
# Does not use the condense binary (it tests the crate); honours CARGO_TARGET_DIR. Needs curl
# (garage.sh's readiness check), a C compiler and pkg-config for the Garage build (the install
# script installs them). Ends with "N passed, M failed, K skipped".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CONDENSE=${CONDENSE:-unused} # lib.sh would build the binary otherwise; this test does not run it
. "$ROOT/tests/lib.sh"
need_tools curl cargo

W=$(mktemp -d /tmp/condense-s3-e2e.XXXXXX)
G=$W/garage
GARAGE_SH=$ROOT/tests/s3/garage.sh
started=0
began=$SECONDS

cleanup() {
    if [ "$started" = 1 ]; then "$GARAGE_SH" stop "$G" >/dev/null 2>&1; fi
    remove_work_dir
}
trap cleanup EXIT

# timed NAME CMD...: check, then the step's wall time.
timed() {
    local t=$SECONDS
    check "$@"
    echo "    ($((SECONDS - t)) s)"
}

# conformance_lines: the figures the S3 test printed (in $W/out).
conformance_lines() { grep -E '^(s3 open|conformance s3)' "$W/out" | sed 's/^/    /'; }

cd "$ROOT" || exit 1
timed "garage 2.5.0 installed (scripts/install-garage.sh)" bash scripts/install-garage.sh
mkdir -p "$G"
timed "3-node Garage cluster started (RF 3)" "$GARAGE_SH" start "$G"
if [ "$passed" -lt 2 ]; then
    summary
    exit 1
fi
started=1
# shellcheck disable=SC1091
. "$G/credentials.env"

timed "cargo test -p condense-object-store, S3 conformance on 3 nodes" \
    env CONDENSE_S3_TEST=1 cargo test -p condense-object-store -- --nocapture
conformance_lines
if ! grep -q '^conformance s3' "$W/out"; then fail "the S3 conformance suite ran (no figures in its output)"; fi

# A hung store (every node SIGSTOPped): a GET fails within the backend's timeouts, then works.
mapfile -t pids < <(cat "$G"/node*/pid)
timed "frozen store: GET fails in bounded time, works after SIGCONT" \
    env CONDENSE_S3_TEST=1 CONDENSE_S3_FREEZE_PIDS="${pids[*]}" cargo test -p condense-object-store \
    --test conformance -- --nocapture --exact s3_frozen_store_fails_in_bounded_time
grep -E '^(frozen store|after thaw: GET)' "$W/out" | sed 's/^/    /'
kill -CONT "${pids[@]}" 2>/dev/null # in case the test died before it thawed them

timed "node 2 killed" "$GARAGE_SH" kill "$G" 2
timed "S3 conformance with node 2 down" \
    env CONDENSE_S3_TEST=1 cargo test -p condense-object-store --test conformance \
    -- --nocapture --exact s3_backend_conforms
conformance_lines

timed "node 2 restarted" "$GARAGE_SH" restart "$G" 2
timed "cluster stopped" "$GARAGE_SH" stop "$G"
started=0
echo "wall time: $((SECONDS - began)) s"
summary
