# Sourced first by the tests of tests/s3 that run Condense on a Garage cluster (pool.sh,
# cluster.sh, nemesis.sh), with ROOT and S3_TEST (what the test is, for its skip line) set:
# installs the pinned Garage in CI (scripts/install-garage.sh), sources tests/lib.sh, and ends
# the test with a skip when no garage binary is there (GARAGE, on PATH, or ~/.cargo/bin).
# Sets GARAGE_SH.

GARAGE_SH=$ROOT/tests/s3/garage.sh
have_garage() {
    if [ -n "${GARAGE:-}" ]; then [ -x "$GARAGE" ]; else
        command -v garage >/dev/null || [ -x "$HOME/.cargo/bin/garage" ]
    fi
}
if [ "${CI:-}" = true ]; then
    bash "$ROOT/scripts/install-garage.sh" || echo "scripts/install-garage.sh failed"
elif ! have_garage; then
    CONDENSE=${CONDENSE:-unused} # nothing to build: the test skips
fi
# shellcheck source=tests/lib.sh
. "$ROOT/tests/lib.sh"
if ! have_garage; then
    skip "$S3_TEST" "garage is not installed (scripts/install-garage.sh builds it, ~10 min)"
    summary
    exit
fi
