#!/usr/bin/env bash
# Install the pinned Garage server (the S3-compatible store the tests/s3 cluster runs) into
# ~/.cargo/bin, unless ~/.cargo/bin/garage already reports the pinned version.
#   scripts/install-garage.sh
#
# Pin: garage 2.5.0, the newest release on crates.io (checked 2026-11); builds with Rust 1.95
# and --locked (its own Cargo.lock). Features: bundled-libs + lmdb only (the metadata engine the
# test cluster uses); sqlite, k2v and metrics are left out to save build time.
# Build cost on the 2-core / 24 GiB machine: default features 12 min 08 s cold (empty cargo
# cache, 286 crates, downloads included; peak RSS 1.4 GB); these features 9 min 21 s with the
# crates already downloaded. Built once per machine: later runs only compare versions (< 1 s).
# Debian packages: a C compiler and pkg-config (bundled LMDB, SQLite and zstd are built from C).
set -euo pipefail
GARAGE_VERSION=2.5.0

bin=$HOME/.cargo/bin/garage
# One build at a time: scripts/test.sh starts one in the background under CI, and the first
# test of tests/s3 calls this script again; that call waits here, then finds it installed.
mkdir -p "$HOME/.cargo"
exec 9>"$HOME/.cargo/.condense-garage-install.lock"
flock 9
if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -qwF "$GARAGE_VERSION"; then
    echo "garage $GARAGE_VERSION already installed: $bin"
    exit 0
fi

"$(dirname "$0")/install-deps.sh" build-essential pkg-config

command -v cargo >/dev/null || { echo "cargo is missing: install a Rust toolchain first"; exit 1; }
echo "building garage $GARAGE_VERSION (about 10 min on 2 cores)"
start=$SECONDS
# A private target directory, so that a CARGO_TARGET_DIR set for the project does not fill up
# with Garage's artefacts (cargo install removes its temporary one when done).
env -u CARGO_TARGET_DIR cargo install garage --version "$GARAGE_VERSION" --locked \
    --no-default-features --features bundled-libs,lmdb
"$bin" --version
echo "garage $GARAGE_VERSION installed in $((SECONDS - start)) s"
