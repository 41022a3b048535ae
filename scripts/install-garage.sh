#!/usr/bin/env bash
# Install the pinned Garage server (the S3-compatible store the tests/s3 cluster runs) into
# ~/.cargo/bin, unless ~/.cargo/bin/garage already reports the pinned version.
#   scripts/install-garage.sh
#
# Pin: garage 2.5.0, the newest release on crates.io (checked 2026-11), builds with Rust 1.95
# and --locked (its own Cargo.lock). Default features (lmdb + sqlite bundled, k2v, metrics).
# Build cost: about 12 min of wall time on the 2-core / 24 GiB machine, cold (no cargo
# cache; 286 crates, downloads included); the installed binary is 56 MB (peak build RSS 1.4 GB). It is built
# once per machine: later runs only compare versions (well under a second).
# Debian packages: a C compiler and pkg-config (bundled LMDB, SQLite and zstd are built from C).
set -euo pipefail
GARAGE_VERSION=2.5.0

bin=$HOME/.cargo/bin/garage
if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -qwF "$GARAGE_VERSION"; then
    echo "garage $GARAGE_VERSION already installed: $bin"
    exit 0
fi

packages=(build-essential pkg-config)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

command -v cargo >/dev/null || { echo "cargo is missing: install a Rust toolchain first"; exit 1; }
echo "building garage $GARAGE_VERSION (about 12 min on 2 cores)"
start=$SECONDS
# A private target directory, so that a CARGO_TARGET_DIR set for the project does not fill up
# with Garage's artefacts (cargo install removes its temporary one when done).
env -u CARGO_TARGET_DIR cargo install garage --version "$GARAGE_VERSION" --locked
"$bin" --version
echo "garage $GARAGE_VERSION installed in $((SECONDS - start)) s"
