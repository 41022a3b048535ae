#!/usr/bin/env bash
# Images swapped under their name (issue 39): `condense import` and `condense estimate` open the
# image once and read only that file; the checks, qemu-img and Condense's own reads all go
# through one descriptor. A background loop swaps the image's path continuously, by rename(2)
# (`mv -f` of fresh copies), between a benign qcow2 and two evil ones that read a host file
# holding a marker (one through its backing file, one through an external data file), while
# import (with and without --format qcow2) and estimate run over and over. Every import either
# fails with an error that says why or holds exactly the benign image; every estimate that
# succeeds reports the benign image; nothing of the host file is in the pool (made with
# --compression none, so any copy would show). Also: a symbolic link to an image and a FIFO are
# refused, by import and by estimate, with errors that say so.
# shellcheck disable=SC2317  # cleanup runs from the EXIT trap
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-img python3 cmp timeout

W=$(mktemp -d /tmp/condense-swap.XXXXXX)
POOL=$W/pool
SWAP_PID=
cleanup() {
    stop_pids "$SWAP_PID"
    remove_work_dir
}
trap cleanup EXIT
cd "$W" || exit 1
c() { "$CONDENSE" --pool "$POOL" "$@"; }
ROUNDS=${SWAP_ROUNDS:-30}

# The host file: what an attacker wants to read.
MARKER="condense-host-secret-$RANDOM$RANDOM$RANDOM"
HOST=$W/host-secret.bin
{ head -c 1M /dev/urandom; echo "$MARKER"; } >"$HOST"
truncate -s 2M "$HOST"

# The benign image: 2 MiB, its first MiB a pattern of its own, the rest unallocated.
python3 - "$W/benign.raw" <<'EOF'
import sys
with open(sys.argv[1], "wb") as f:
    f.write((b"benign image block " * 216).ljust(4096, b".") * 256)
    f.truncate(2 << 20)
EOF
qemu-img convert -q -f raw -O qcow2 "$W/benign.raw" "$W/benign.qcow2"
# The evil ones, of the same size: a backing file, and an external raw data file (emptied by
# qemu-img create, so filled again).
qemu-img create -q -f qcow2 -b "$HOST" -F raw "$W/evil-backing.qcow2" 2M
qemu-img create -q -f qcow2 -o "data_file=$W/host-data.bin,data_file_raw=on" "$W/evil-datafile.qcow2" 2M
cp "$HOST" "$W/host-data.bin"
check "qemu-img itself reads the host file through the evil data-file image" \
    sh -c "qemu-img convert -f qcow2 -O raw '$W/evil-datafile.qcow2' '$W/leak.raw' && grep -a -q -F '$MARKER' '$W/leak.raw'"
rm -f "$W/leak.raw"

read_bytes() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["read_bytes"])' "$1" 2>/dev/null; }

c init "$POOL" --compression none >"$W/out" 2>&1 || { cat "$W/out"; exit 1; }

# The swapper: the name changes between the three images as fast as cp and mv run.
IMG=$W/upload/vm.qcow2
mkdir -p "$W/upload"
cp "$W/benign.qcow2" "$IMG"
# (Measured on a copy made as the swapper makes them: cp leaves holes where the qcow2 has
# zeros, and qemu-img map reports those as zeros.)
"$CONDENSE" estimate "$IMG" --json >"$W/est.json" 2>"$W/out" || { cat "$W/out"; exit 1; }
BENIGN_READ=$(read_bytes "$W/est.json")
(
    while :; do
        for f in benign evil-backing benign evil-datafile; do
            cp "$W/$f.qcow2" "$W/upload/.next" && mv -f "$W/upload/.next" "$IMG"
        done
    done
) >/dev/null 2>&1 &
SWAP_PID=$!

# Every import: refused with a message, or exactly the benign image.
imported=0 refused=0 wrong=0 unclear=0
for i in $(seq 1 "$ROUNDS"); do
    for declared in "" qcow2; do
        name="s$i${declared:+-$declared}"
        args=()
        [ -n "$declared" ] && args=(--format "$declared")
        if timeout 120 "$CONDENSE" --pool "$POOL" import "$IMG" --name "$name" "${args[@]}" >"$W/imp.log" 2>&1; then
            imported=$((imported + 1))
            if ! c export "$name" "$W/back.raw" >"$W/exp.log" 2>&1 || ! cmp -s "$W/back.raw" "$W/benign.raw"; then
                wrong=$((wrong + 1))
                echo "    | import $name holds something other than the benign image" >&2
            fi
            rm -f "$W/back.raw"
        else
            refused=$((refused + 1))
            if grep -q -i "panick" "$W/imp.log" || ! grep -q -E "refusing|changed while|failed" "$W/imp.log"; then
                unclear=$((unclear + 1))
                sed 's/^/    | /' "$W/imp.log" >&2
            fi
        fi
    done
done
# Every estimate that succeeds reads as many bytes as the benign image alone (a swapped-in image
# reads none through a forced-off backing file, others through a data file).
estimated=0 misread=0 est_refused=0
for i in $(seq 1 "$ROUNDS"); do
    if timeout 120 "$CONDENSE" estimate "$IMG" --json >"$W/est.json" 2>"$W/est.log"; then
        estimated=$((estimated + 1))
        read_bytes=$(read_bytes "$W/est.json")
        if [ "$read_bytes" != "$BENIGN_READ" ]; then
            misread=$((misread + 1))
            echo "    | estimate read $read_bytes bytes, not the benign image's $BENIGN_READ" >&2
        fi
    else
        est_refused=$((est_refused + 1))
        if grep -q -i "panick" "$W/est.log" || ! grep -q -E "refusing|changed while|cannot" "$W/est.log"; then
            unclear=$((unclear + 1))
            sed 's/^/    | /' "$W/est.log" >&2
        fi
    fi
done
stop_pids "$SWAP_PID"
SWAP_PID=
echo "# imports: $imported imported, $refused refused; estimates: $estimated done, $est_refused refused"

if [ "$wrong" = 0 ]; then ok "every import under swapping holds exactly the benign image ($imported of $((2 * ROUNDS)))"; else fail "$wrong of $imported imports under swapping hold something else"; fi
if [ "$misread" = 0 ]; then ok "every estimate under swapping reports the benign image ($estimated of $ROUNDS)"; else fail "$misread of $estimated estimates under swapping report another image"; fi
if [ "$unclear" = 0 ]; then ok "every refusal says why (no panic)"; else fail "$unclear refusals without a clear error"; fi
# Both outcomes happen, so the name really changed under the commands.
if [ "$imported" -gt 0 ] && [ "$refused" -gt 0 ]; then ok "the swapping was seen: some imports refused, some imported"; else fail "the swapping was not seen ($imported imported, $refused refused)"; fi
if grep -r -a -q -F "$MARKER" "$POOL"; then fail "the host file's marker is in the pool"; else ok "nothing of the host file is in the pool"; fi
vols=$(c volume list --all --json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))')
if [ "$vols" = "$imported" ]; then ok "a refused import leaves no volume ($vols volumes)"; else fail "a refused import leaves no volume ($vols volumes, $imported imported)"; fi

# A symbolic link to an image, and a FIFO, are refused by name.
ln -s "$W/benign.qcow2" "$W/link.qcow2"
refuse "import refuses a symbolic link" "symbolic link" c import "$W/link.qcow2" --name link
refuse "estimate refuses a symbolic link" "symbolic link" "$CONDENSE" estimate "$W/link.qcow2"
mkfifo "$W/fifo.raw"
refuse "import refuses a FIFO (without waiting for a writer)" "FIFO" timeout 20 "$CONDENSE" --pool "$POOL" import "$W/fifo.raw" --name fifo
refuse "estimate refuses a FIFO" "FIFO" timeout 20 "$CONDENSE" estimate "$W/fifo.raw"
check "the benign image itself still imports" c import "$W/benign.qcow2" --name direct
check "... byte-identical" sh -c "'$CONDENSE' --pool '$POOL' export direct '$W/direct.raw' && cmp '$W/direct.raw' '$W/benign.raw'"

summary
