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
#   and tests/security/daemon.sh (whose forged daemons are python3, its peak RSS from time)
# libvirt-daemon-system (libvirtd), libvirt-clients (virsh, virt-xml-validate, which runs
#   libxml2-utils' xmllint), qemu-system-x86: tests/libvirt; installed without their recommends
#   (qemu's GUI, firmware, libvirt's network helpers), which nothing here uses. The guest's
#   kernel and BusyBox are fetched by scripts/build-guest-image.sh (`apt-get download`); kmod:
#   its depmod and modprobe, which order the modules of the guest's initrd.
set -euo pipefail
packages=("$@")
[ $# -gt 0 ] || packages=(build-essential pkg-config qemu-utils libnbd-bin nbdkit fio fuse3 libfuse3-dev xfsprogs e2fsprogs util-linux passwd bc time jq systemd python3 openssl libssl-dev gnutls-bin prometheus curl tmux kmod libvirt-daemon-system libvirt-clients libxml2-utils qemu-system-x86)
without_recommends=" libvirt-daemon-system libvirt-clients libxml2-utils qemu-system-x86 "
missing=() lean=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" && continue
  case "$without_recommends" in *" $p "*) lean+=("$p") ;; *) missing+=("$p") ;; esac
done
# qemu-system-x86 must come from where qemu-utils came from: on a machine whose qemu-utils is
# bookworm-backports' (the CI image has 10.0), bookworm's qemu-system 7.2 would make apt remove
# qemu-utils (qemu-img, qemu-io, qemu-nbd). There qemu-system and its firmware come from
# backports, through apt options that leave /etc/apt as it is: their own list of sources
# (bookworm and its backports) and their own package lists.
from_backports=0
case " ${lean[*]} " in
  *" qemu-system-x86 "*) [[ $(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null) == *bpo12* ]] && from_backports=1 ;;
esac
if [ $((${#missing[@]} + ${#lean[@]})) -gt 0 ]; then
  echo "installing: ${missing[*]} ${lean[*]}"
  SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  [ ${#missing[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
  apt_opts=()
  if [ $from_backports = 1 ]; then
    bpo=$(mktemp -d /tmp/condense-apt-XXXXXX)
    trap '$SUDO rm -rf "$bpo"' EXIT
    mkdir -p "$bpo/lists/partial" "$bpo/archives/partial"
    keys=/usr/share/keyrings/debian-archive-keyring.gpg
    {
      for suite in bookworm bookworm-updates bookworm-backports; do
        echo "deb [signed-by=$keys] http://deb.debian.org/debian $suite main"
      done
      echo "deb [signed-by=$keys] http://deb.debian.org/debian-security bookworm-security main"
    } >"$bpo/sources.list"
    apt_opts=(-o "Dir::Etc::sourcelist=$bpo/sources.list" -o Dir::Etc::sourceparts=- \
      -o "Dir::State::lists=$bpo/lists" -o "Dir::Cache::archives=$bpo/archives" -o APT::Sandbox::User=root)
    $SUDO apt-get "${apt_opts[@]}" update -q
    for i in "${!lean[@]}"; do
      case ${lean[$i]} in qemu-system-x86) lean[$i]=qemu-system-x86/bookworm-backports ;; esac
    done
    lean+=(qemu-system-common/bookworm-backports qemu-system-data/bookworm-backports seabios/bookworm-backports)
  fi
  [ ${#lean[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive $SUDO apt-get "${apt_opts[@]}" install -y -q --no-install-recommends "${lean[@]}"
fi
