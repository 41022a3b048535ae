#!/usr/bin/env bash
# Install Condense as a systemd service (docs/SERVICE.md):
#   /usr/local/bin/condense                             the binary (release build)
#   /etc/systemd/system/condense-{serve,mount}@.service the units
#   /etc/condense/condense.toml.sample                  a sample config (never overwritten)
#   /usr/local/share/doc/condense/SERVICE.md            the administrator's guide
# and the system user `condense` the serve unit runs as; then `systemctl daemon-reload`.
#
#   sudo scripts/install-service.sh                      # builds target/release/condense first
#   sudo CONDENSE=/path/to/condense scripts/install-service.sh
#   DESTDIR=/tmp/stage scripts/install-service.sh        # stage only: no user, no reload
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DESTDIR=${DESTDIR:-}
if [ -z "${CONDENSE:-}" ]; then
    (cd "$ROOT" && cargo build --release -p condense)
    CONDENSE=${CARGO_TARGET_DIR:-$ROOT/target}/release/condense
fi
[ -x "$CONDENSE" ] || { echo "install-service: $CONDENSE is not an executable; build it or set CONDENSE=" >&2; exit 1; }
if [ -z "$DESTDIR" ] && [ "$(id -u)" != 0 ]; then
    echo "install-service: run as root (or set DESTDIR=DIR to stage the files)" >&2
    exit 1
fi

install -D -m 0755 "$CONDENSE" "$DESTDIR/usr/local/bin/condense"
for unit in condense-serve@.service condense-mount@.service; do
    install -D -m 0644 "$ROOT/dist/systemd/$unit" "$DESTDIR/etc/systemd/system/$unit"
done
install -d -m 0755 "$DESTDIR/etc/condense"
install -m 0644 "$ROOT/dist/condense.toml" "$DESTDIR/etc/condense/condense.toml.sample"
install -D -m 0644 "$ROOT/docs/SERVICE.md" "$DESTDIR/usr/local/share/doc/condense/SERVICE.md"
echo "installed condense, the units and /etc/condense/condense.toml.sample under ${DESTDIR:-/}"

[ -n "$DESTDIR" ] && exit 0
if ! getent passwd condense >/dev/null; then
    useradd --system --home-dir /var/lib/condense --no-create-home \
        --shell /usr/sbin/nologin --comment "Condense storage service" condense
    echo "created system user condense"
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    echo "next: write /etc/condense/NAME.toml (see the sample), then systemctl enable --now condense-serve@NAME"
else
    echo "systemd is not running here; the units take effect at the next boot with systemd"
fi
