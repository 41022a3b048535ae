#!/usr/bin/env bash
# Run the NBD fuzz targets for a bounded time each (default 60 s): bash fuzz/run.sh [SECONDS]
# Needs the nightly toolchain and cargo-fuzz (cargo install cargo-fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
for t in nbd_parse nbd_session; do
    mkdir -p "fuzz/corpus/$t"
    cargo +nightly fuzz run "$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -max_len=4096
done
