#!/usr/bin/env bash
# Install the Debian packages Condense and its tests use, if any is missing.
#   scripts/install-deps.sh          # everything (build, real clients for the tests)
#   scripts/install-deps.sh PKG...   # only these (other scripts' own needs)
# qemu-utils: qemu-img, qemu-io, qemu-nbd (image import/export, NBD tests)
# libnbd-bin: nbdinfo, nbdcopy; nbdkit: the protocol baseline in benchmarks; fio: I/O tests
# fuse3: fusermount3 for the FUSE mount; xfsprogs, e2fsprogs: mkfs on a loop device over FUSE
# bc, time, jq: benchmark scripts
# systemd: systemd-analyze verify on the unit files; python3: the fake sd_notify listener (tests/service)
# openssl: certificates for the NBD-over-TLS test (tests/tls) and bench (bench/nbd/tls-bench.sh)
# libssl-dev (with pkg-config): OpenSSL for TLS-PSK (crates/nbd); gnutls-bin: psktool (tests/security/psk.sh)
# prometheus (the server and promtool), curl: tests/metrics (scrape, promtool check metrics, queries)
# tmux: drives `condense top`'s full-screen view in tests/top (send-keys, capture-pane)
# passwd (useradd, groupadd), util-linux (runuser): the second Unix account of tests/security/access.sh
set -euo pipefail
packages=("$@")
[ $# -gt 0 ] || packages=(build-essential pkg-config qemu-utils libnbd-bin nbdkit fio fuse3 libfuse3-dev xfsprogs e2fsprogs util-linux passwd bc time jq systemd python3 openssl libssl-dev gnutls-bin prometheus curl tmux)
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
