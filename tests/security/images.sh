#!/usr/bin/env bash
# Untrusted images (issue 23): `condense import` and `condense estimate` read exactly the file
# named, nothing else. Hostile images are built with qemu-img and small python edits; each
# names a host file that holds a marker (1 MiB of random bytes and a line of text, made here).
#   (a) a qcow2 whose backing file is the host file; also one with an external data file
#   (b) a VMDK descriptor whose FLAT extent is the host file; a sparse VMDK header of capacity
#       0 that hides such a descriptor; a sparse VMDK whose parentFileNameHint is a host VMDK
#   (c) a raw volume whose guest wrote a qcow2 header with that backing file into sector 0
#       (through NBD, as a VM would), exported to guest.raw and imported again
#   (d) differencing VDI, VHDX and VHD images (their parent is another file)
# Each is refused by import and by estimate with an error naming the host file, no volume
# appears, and the marker is nowhere in the pool (made with --compression none, so that any
# copy would show). Also: protocol names refused; --allow-backing-file does follow (a); a
# truncated qcow2 and a truncated VDI are refused; good qcow2, vmdk (streamOptimized), vdi,
# vhdx and vpc images import byte-identical to `qemu-img convert -O raw`; a raw export that
# fails for want of space leaves no file behind and an existing file untouched.
# shellcheck disable=SC2317  # cleanup runs from the EXIT trap
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-img nbdcopy python3 cmp

W=$(mktemp -d /tmp/condense-images.XXXXXX)
POOL=$W/pool
SERVER_PID=
SMALL=
cleanup() {
    stop_pids "$SERVER_PID"
    [ -n "$SMALL" ] && umount "$SMALL" 2>/dev/null
    remove_work_dir
}
trap cleanup EXIT
cd "$W" || exit 1
c() { "$CONDENSE" --pool "$POOL" "$@"; }
volumes() { c volume list --all --json 2>/dev/null | python3 -c 'import json,sys; print(" ".join(sorted(v["name"] for v in json.load(sys.stdin))))'; }

# The host file: what an attacker wants to read.
MARKER="condense-host-secret-$RANDOM$RANDOM$RANDOM"
HOST=$W/host-secret.bin
{ head -c 1M /dev/urandom; echo "$MARKER"; } >"$HOST"
truncate -s 2M "$HOST"
# marker_absent NAME: the marker is in no file of the pool.
marker_absent() {
    if grep -r -a -q -F "$MARKER" "$POOL"; then fail "$1: the host file's marker is in the pool"; else ok "$1"; fi
}

c init "$POOL" --compression none >"$W/out" 2>&1 || { cat "$W/out"; exit 1; }
check "a raw image imports" sh -c "head -c 8M /dev/urandom >'$W/guest-src.raw' && '$CONDENSE' --pool '$POOL' import '$W/guest-src.raw' --name guest"
BEFORE=$(volumes)

# refused_everywhere LABEL FILE PATTERN [ARGS...]: import and estimate both refuse FILE with an
# error matching PATTERN, and no volume appears.
refused_everywhere() {
    local label=$1 file=$2 pattern=$3
    shift 3
    refuse "$label: import refused, naming $pattern" "$pattern" c import "$file" --name hostile "$@"
    refuse "$label: estimate refused, naming $pattern" "$pattern" "$CONDENSE" estimate "$file" "$@"
    if [ "$(volumes)" = "$BEFORE" ]; then ok "$label: no new volume"; else fail "$label: no new volume (volumes: $(volumes))"; fi
}

# (a) qcow2 with a backing file; with an external data file.
qemu-img create -q -f qcow2 -b "$HOST" -F raw "$W/backing.qcow2" 2M
refused_everywhere "(a) qcow2 backing file" "$W/backing.qcow2" "$HOST"
cp "$HOST" "$W/data-file.bin"
qemu-img create -q -f qcow2 -o "data_file=$W/data-file.bin,data_file_raw=on" "$W/datafile.qcow2" 2M
cp "$HOST" "$W/data-file.bin" # qemu-img create emptied it
refused_everywhere "(a) qcow2 external data file" "$W/datafile.qcow2" "data-file.bin"

# (b) VMDK descriptor with a FLAT extent on the host file.
cat >"$W/flat.vmdk" <<EOF
# Disk DescriptorFile
version=1
CID=fffffffe
parentCID=ffffffff
createType="monolithicFlat"
RW 4096 FLAT "$HOST" 0
EOF
check "(b) qemu-img itself reads the host file through flat.vmdk" \
    sh -c "qemu-img convert -f vmdk -O raw '$W/flat.vmdk' '$W/flat.raw' && grep -a -q -F '$MARKER' '$W/flat.raw'"
refused_everywhere "(b) VMDK descriptor extent" "$W/flat.vmdk" "$HOST"
# ... the same descriptor behind a sparse header of capacity 0 (qemu reads it as a descriptor).
python3 - "$W/disguised.vmdk" "$HOST" <<'EOF'
import struct, sys
desc = ('# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\n'
        'createType="monolithicFlat"\nRW 4096 FLAT "%s" 0\n' % sys.argv[2]).encode()
head = b"KDMV" + struct.pack("<IIQQQQ", 1, 3, 0, 128, 1, 20)
with open(sys.argv[1], "wb") as f:
    f.write(head.ljust(512, b"\0") + desc.ljust(20 * 512, b"\0"))
EOF
check "(b) qemu-img itself reads the host file through disguised.vmdk" \
    sh -c "qemu-img convert -f vmdk -O raw '$W/disguised.vmdk' '$W/disguised.raw' && grep -a -q -F '$MARKER' '$W/disguised.raw'"
refused_everywhere "(b) VMDK sparse header hiding a descriptor" "$W/disguised.vmdk" "$HOST"
# ... a sparse VMDK whose parent is a host VMDK.
qemu-img convert -f raw -O vmdk "$HOST" "$W/host-base.vmdk"
qemu-img create -q -f vmdk -b "$W/host-base.vmdk" -F vmdk "$W/child.vmdk"
refused_everywhere "(b) VMDK parentFileNameHint" "$W/child.vmdk" "host-base.vmdk"

# (d) Differencing VDI, VHDX and VHD images: their parent is another file. qemu-img cannot make
# them, so good images are edited into ones (VDI: image type 4 and a parent UUID; VHDX: the
# HasParent flag of the file parameters; VHD: disk type 4 and a parent name).
head -c 2M /dev/urandom >"$W/small.raw"
for fmt in vdi vhdx vpc; do qemu-img convert -f raw -O "$fmt" "$W/small.raw" "$W/diff.$fmt"; done
python3 - "$W" <<'EOF'
import struct, sys
w = sys.argv[1]
with open(w + "/diff.vdi", "r+b") as f:
    f.seek(76); f.write(struct.pack("<I", 4))
    f.seek(424); f.write(bytes(range(1, 17)))
with open(w + "/diff.vhdx", "r+b") as f:
    f.seek(192 << 10); table = f.read(64 << 10)
    meta_guid = bytes.fromhex("06a27c8b90479a4bb8fe575f050f886e")
    params_guid = bytes.fromhex("3767a1ca36fa434db3b633f0aa44e76b")
    for i in range(struct.unpack_from("<I", table, 8)[0]):
        e = table[16 + 32 * i: 48 + 32 * i]
        if e[:16] == meta_guid:
            region = struct.unpack_from("<Q", e, 16)[0]
    f.seek(region); meta = f.read(64 << 10)
    for i in range(struct.unpack_from("<H", meta, 10)[0]):
        e = meta[32 + 32 * i: 64 + 32 * i]
        if e[:16] == params_guid:
            at = region + struct.unpack_from("<I", e, 16)[0] + 4
            f.seek(at); bits = struct.unpack("<I", f.read(4))[0]
            f.seek(at); f.write(struct.pack("<I", bits | 2))
with open(w + "/diff.vpc", "r+b") as f:
    footer = bytearray(f.read(512))
    struct.pack_into(">I", footer, 60, 4)
    dynamic = struct.unpack_from(">Q", footer, 16)[0]
    f.seek(0); f.write(footer)
    f.seek(dynamic + 64); f.write("host-secret.vhd".encode("utf-16-be"))
EOF
refused_everywhere "(d) differencing VDI" "$W/diff.vdi" "parent image"
refused_everywhere "(d) differencing VHDX" "$W/diff.vhdx" "parent image"
refused_everywhere "(d) differencing VHD" "$W/diff.vpc" "host-secret.vhd"

# (c) The guest writes a qcow2 header naming the host file into sector 0 of its raw disk.
"$CONDENSE" --pool "$POOL" serve --socket "$W/nbd.sock" >"$W/server.log" 2>&1 &
SERVER_PID=$!
wait_ready "$SERVER_PID" "$W/server.log" test -S "$W/nbd.sock" || exit 1
check "(c) the guest writes a qcow2 header into sector 0 over NBD" \
    nbdcopy "$W/backing.qcow2" "nbd+unix:///guest?socket=$W/nbd.sock"
stop_pids "$SERVER_PID"
SERVER_PID=
check "(c) the volume is exported to guest.raw" c export guest "$W/guest.raw"
check "(c) guest.raw starts with a qcow2 header" sh -c "head -c 4 '$W/guest.raw' | grep -q QFI"
refused_everywhere "(c) guest-written qcow2 header" "$W/guest.raw" "$HOST"
cp "$W/out" "$W/refusal"
check "(c) the refusal says how to import it as raw" grep -q -- "--format raw" "$W/refusal"
check "(c) --format raw imports guest.raw as raw bytes" c import "$W/guest.raw" --format raw --name guest-again
check "(c) ... byte-identical to guest.raw" sh -c "'$CONDENSE' --pool '$POOL' export guest-again '$W/guest-again.raw' && cmp '$W/guest.raw' '$W/guest-again.raw'"
check "(c) estimate --format raw reads guest.raw" "$CONDENSE" estimate --format raw "$W/guest.raw"
check "(c) standard input: --format raw imports it too" \
    sh -c "'$CONDENSE' --pool '$POOL' import - --name guest-stdin --size 8M --format raw <'$W/guest.raw'"
refuse "(c) standard input without --format raw is refused" "format raw" \
    sh -c "'$CONDENSE' --pool '$POOL' import - --name guest-stdin2 --size 8M <'$W/guest.raw'"
BEFORE=$(volumes)

# Protocol and json: names are never handed to qemu.
refuse "protocol name refused" "protocol" c import "nbd+unix:///x?socket=$W/nbd.sock" --name proto
refuse "json: name refused" "protocol" c import "json:{\"driver\":\"raw\",\"file\":{\"driver\":\"file\",\"filename\":\"$HOST\"}}" --name proto
refuse "json: name refused by estimate" "protocol" "$CONDENSE" estimate "json:{\"driver\":\"raw\",\"file\":{\"driver\":\"file\",\"filename\":\"$HOST\"}}"
if [ "$(volumes)" = "$BEFORE" ]; then ok "protocol names: no new volume"; else fail "protocol names: no new volume"; fi

marker_absent "nothing of the host file is in the pool after every refusal"

# --allow-backing-file does what it says (in a pool of its own).
POOL2=$W/pool2
"$CONDENSE" init "$POOL2" --compression none >/dev/null 2>&1
check "--allow-backing-file imports (a)" "$CONDENSE" --pool "$POOL2" import "$W/backing.qcow2" --allow-backing-file --name allowed
check "... and the volume holds the backing file's data" \
    sh -c "'$CONDENSE' --pool '$POOL2' export allowed '$W/allowed.raw' && cmp '$W/allowed.raw' '$HOST'"
check "--allow-backing-file lets estimate read (a)" "$CONDENSE" estimate --allow-backing-file "$W/backing.qcow2"

# Truncated images are refused, not imported as zeros.
head -c 6M /dev/urandom >"$W/src6.raw"
qemu-img convert -f raw -O qcow2 "$W/src6.raw" "$W/trunc.qcow2"
truncate -s 3M "$W/trunc.qcow2"
refused_everywhere "truncated qcow2" "$W/trunc.qcow2" "truncated"
qemu-img convert -f raw -O vdi "$W/src6.raw" "$W/trunc.vdi"
truncate -s 3M "$W/trunc.vdi"
refused_everywhere "truncated vdi" "$W/trunc.vdi" "truncated"

# Good images of every format import byte-identical to qemu-img's own raw conversion.
python3 - "$W/src.raw" <<'EOF'
import os, sys
with open(sys.argv[1], "wb") as f:
    for i in range(16):  # 16 MiB: random data, zeros and holes in turns
        if i % 3:
            f.seek(i << 20)
            f.write(os.urandom(512 << 10) + bytes(256 << 10))
    f.truncate(16 << 20)
EOF
for fmt in qcow2 vmdk vdi vhdx vpc; do
    opts=()
    [ "$fmt" = vmdk ] && opts=(-o subformat=streamOptimized)
    qemu-img convert -f raw -O "$fmt" "${opts[@]}" "$W/src.raw" "$W/good.$fmt"
    qemu-img convert -f "$fmt" -O raw "$W/good.$fmt" "$W/ref-$fmt.raw"
    check "good $fmt imports" c import "$W/good.$fmt" --name "good-$fmt"
    check "good $fmt exports byte-identical to qemu-img convert -O raw" \
        sh -c "'$CONDENSE' --pool '$POOL' export 'good-$fmt' '$W/exp-$fmt.raw' && qemu-img compare -q -f raw -F raw '$W/ref-$fmt.raw' '$W/exp-$fmt.raw' && cmp -n \$(stat -c %s '$W/ref-$fmt.raw') '$W/ref-$fmt.raw' '$W/exp-$fmt.raw'"
done
check "--format qcow2 on a qcow2 imports" c import "$W/good.qcow2" --format qcow2 --name good-declared
refuse "--format qcow2 on a raw file is refused" "not a qcow2" c import "$W/src.raw" --format qcow2 --name not-qcow2
check "estimate reads every good format" "$CONDENSE" estimate "$W/good.qcow2" "$W/good.vmdk" "$W/good.vdi" "$W/good.vhdx" "$W/good.vpc" "$W/src.raw"

# A raw export that fails midway (no space) leaves no file, and an existing file as it was.
if [ "$(id -u)" != 0 ]; then
    skip "a failed export leaves no file" "needs root to mount a small tmpfs"
else
    SMALL=$W/small
    mkdir -p "$SMALL"
    if mount -t tmpfs -o size=4m tmpfs "$SMALL"; then
        refuse "export to a full file system fails" "No space" c export guest "$SMALL/out.raw"
        check "... and leaves no file behind" sh -c "[ -z \"\$(ls -A '$SMALL')\" ]"
        echo "an existing file" >"$SMALL/keep.raw"
        refuse "export --force to a full file system fails" "No space" c export guest "$SMALL/keep.raw" --force
        check "... and leaves the existing file as it was" \
            sh -c "[ \"\$(cat '$SMALL/keep.raw')\" = 'an existing file' ] && [ \"\$(ls -A '$SMALL')\" = keep.raw ]"
        check "export --force replaces a file once complete" \
            sh -c "'$CONDENSE' --pool '$POOL' export good-qcow2 '$W/replace.raw' && echo old >'$W/replace.raw' && '$CONDENSE' --pool '$POOL' export good-qcow2 '$W/replace.raw' --force && cmp '$W/replace.raw' '$W/exp-qcow2.raw'"
        umount "$SMALL"
        SMALL=
    else
        skip "a failed export leaves no file" "cannot mount a tmpfs here"
    fi
fi

summary
