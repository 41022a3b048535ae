#!/usr/bin/env bash
# Security end to end (issue "nothing gets in, out or lost"): every part script in this
# directory, each a self-contained test with real clients (tests/lib.sh harness):
#   images.sh     untrusted images: backing files, host extents, guest-written headers
#   swap.sh       an image swapped under its name while it is checked and imported
#   nonces.sh     copied and rolled-back pools never seal twice under one nonce
#   access.sh     a second Unix account reaches nothing; TCP needs authentication
#   daemon.sh     the CLI trusts only the pool owner's (or root's) daemon, reads it bounded
#   psk.sh        TLS-PSK with qemu-img and nbdinfo
#   resources.sh  clients that never read, connection floods, huge sparse diffs, SIGTERM
#   keys.sh       a key on a plaintext pool is refused; refused init/import leave nothing behind
#   metrics-flood.sh  1,000 and more slow metrics clients while a scrape every second succeeds
#   preauth.sh    floods without credentials (TLS-PSK, Unix socket), SIGTERM and RSS bounds
# Run one part alone with tests/security/PART.sh.
set -uo pipefail
cd "$(dirname "$0")"
rc=0
for part in ./*.sh; do
    [ "$part" = ./run.sh ] && continue
    echo "--- tests/security/${part#./}"
    bash "$part" || rc=1
done
exit $rc
