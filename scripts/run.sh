#!/usr/bin/env bash
# Quick start: install what is missing, build, create the default pool ./condense-pool (or
# $CONDENSE_POOL) if there is none, import any disk images given, show the savings, and serve
# every volume over NBD until Ctrl-C on the pool's Unix socket, POOL/nbd.sock (only you and
# root can connect; serve prints the nbd+unix:// URIs).
#
#   scripts/run.sh [IMAGE...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release -p condense
condense=$PWD/target/release/condense
export CONDENSE_POOL=${CONDENSE_POOL:-$PWD/condense-pool}
[ -f "$CONDENSE_POOL/superblock" ] || "$condense" init
for img in "$@"; do "$condense" import "$img"; done
"$condense" stats
exec "$condense" serve
