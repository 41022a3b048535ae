#!/usr/bin/env bash
# End-to-end test of Condense volumes as libvirt disks (docs/LIBVIRT.md), with the libvirtd of
# Debian's libvirt-daemon-system started here, in a mount namespace of its own (its /etc, /run,
# /var/lib, /var/cache and /var/log directories are this test's, so a libvirtd the host runs is
# neither seen nor touched):
#
#   scripts/build-guest-image.sh: a Debian kernel, an initrd and a BusyBox root file system ->
#   pool A: the image imported as `guest`, snapshot guest@golden, clone `vm` of it (what a VM
#   host does with a golden image), served on a Unix socket with --group libvirt-qemu ->
#   pool B: the image as `base` with snapshot base@golden, served over TCP with TLS and client
#   certificates ->
#   `condense volume libvirt-xml` prints vda (vm, socket) and vdb (base@golden, TLS, read-only);
#   the domain XML passes virt-xml-validate, and so does the disk of a volume whose name needs
#   escaping ->
#   virsh define + start (type='qemu': TCG, direct kernel boot, qemu as libvirt-qemu): the guest
#   mounts vda as its root, writes a boot marker, reads vdb, and shows "login:" on its serial
#   console -> virsh destroy + undefine -> both servers stop cleanly, verify is clean, the
#   marker the guest wrote is in vm, the MD5 the guest read from vdb is base@golden's, and
#   guest@golden is still the imported image, byte for byte.
#
#   tests/libvirt/run.sh                       # builds target/release/condense first
#   CONDENSE=/path/to/condense tests/libvirt/run.sh
#   GUEST_DIR=DIR tests/libvirt/run.sh         # a guest scripts/build-guest-image.sh DIR made
#   BASELINE=1 tests/libvirt/run.sh            # also boot the image as a plain file, for the figure
#
# Needs root (libvirtd, a mount namespace) and, from scripts/install-deps.sh, libvirt-daemon-system,
# libvirt-clients, qemu-system-x86, openssl, e2fsprogs (debugfs), libnbd-bin. Prints the seconds
# from `virsh start` to the login prompt. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"

if [ "$(id -u)" != 0 ]; then
    skip "libvirt test" "needs root (libvirtd runs as root, in a mount namespace of its own)"
    summary
    exit
fi
need_tools virsh libvirtd qemu-system-x86_64 virt-xml-validate openssl debugfs nbdinfo unshare
# Everything below runs in a private mount namespace (libvirtd's directories are bind mounts).
if [ -z "${CONDENSE_LIBVIRT_NS:-}" ]; then
    exec unshare --mount --propagation private env CONDENSE_LIBVIRT_NS=1 "$0" "$@"
fi

W=$(mktemp -d /tmp/condense-libvirt.XXXXXX)
chmod 755 "$W" # qemu runs as libvirt-qemu: it must reach the socket, kernel and certificates
A=$W/pool-a B=$W/pool-b SOCK=$W/run/guest.sock
DOMAIN=condense-test-$$
free_port PORT
A_PID= B_PID= LIBVIRTD_PID= defined=0
t0=$SECONDS

cleanup() {
    if [ "$defined" = 1 ]; then
        virsh -q destroy "$DOMAIN" >/dev/null 2>&1
        virsh -q undefine "$DOMAIN" >/dev/null 2>&1
    fi
    # libvirtd is not this shell's child (it daemonized): wait for it by its pid.
    if [ -n "$LIBVIRTD_PID" ] && kill -TERM "$LIBVIRTD_PID" 2>/dev/null; then
        timeout 20 tail --pid="$LIBVIRTD_PID" -f /dev/null || kill -KILL "$LIBVIRTD_PID"
    fi
    stop_pids "$A_PID" "$B_PID"
    remove_work_dir
}
trap cleanup EXIT

# --- the guest ---------------------------------------------------------------------------------
G=${GUEST_DIR:-$W/guest}
if [ -z "${GUEST_DIR:-}" ]; then
    check "guest image built from Debian packages (scripts/build-guest-image.sh)" \
        "$ROOT/scripts/build-guest-image.sh" "$G"
fi
[ -f "$G/root.raw" ] && [ -f "$G/vmlinuz" ] && [ -f "$G/initrd.img" ] || {
    fail "no guest in $G"
    summary
    exit 1
}
chmod 755 "$G"
phase() { echo "# $((SECONDS - t0)) s: $*"; }
phase "guest ready"

# --- pools ---------------------------------------------------------------------------------
ODD="odd&<'\">name" # a volume name that XML must escape
check "pool A: guest imported, snapshot guest@golden, clones vm and $ODD of it" bash -c "
    '$CONDENSE' --pool '$A' init && '$CONDENSE' --pool '$A' import '$G/root.raw' --name guest &&
    '$CONDENSE' --pool '$A' snapshot create guest golden &&
    '$CONDENSE' --pool '$A' volume clone guest@golden vm &&
    '$CONDENSE' --pool '$A' volume clone guest@golden \"\$1\"" _ "$ODD"
check "pool B: base imported, snapshot base@golden" bash -c "
    '$CONDENSE' --pool '$B' init && '$CONDENSE' --pool '$B' import '$G/root.raw' --name base &&
    '$CONDENSE' --pool '$B' snapshot create base golden"

# --- certificates: a CA, the server's for 127.0.0.1, the client's in libvirt's nbd directory ----
PKI=$W/pki
mkdir -p "$PKI" && chmod 755 "$PKI"
certs() {
    cd "$W" || return 1
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
        -keyout ca-key.pem -out "$PKI/ca-cert.pem" -subj "/CN=libvirt test CA" \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
    local who usage san
    for who in server client; do
        usage=clientAuth san=
        [ $who = server ] && usage=serverAuth san="subjectAltName=DNS:localhost,IP:127.0.0.1"
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$who-key.pem" \
            -out "$who.csr" -subj "/CN=$who"
        # qemu refuses a critical keyUsage without keyEncipherment (crypto/tlscredsx509.c).
        printf '%s\n' basicConstraints=CA:FALSE keyUsage=critical,digitalSignature,keyEncipherment \
            "extendedKeyUsage=$usage" $san >"$who.ext"
        openssl x509 -req -in "$who.csr" -CA "$PKI/ca-cert.pem" -CAkey ca-key.pem -CAcreateserial \
            -days 2 -out "$who-cert.pem" -extfile "$who.ext"
    done
    # libvirt's NBD client directory: ca-cert.pem, client-cert.pem, client-key.pem, the key
    # readable by the group qemu runs as (as /etc/pki/libvirt-nbd would be).
    cp client-cert.pem "$PKI/client-cert.pem" && cp client-key.pem "$PKI/client-key.pem" &&
        chgrp libvirt-qemu "$PKI/client-key.pem" && chmod 640 "$PKI/client-key.pem"
}
check "certificates made with openssl (CA, server for 127.0.0.1, client)" certs

# --- servers -----------------------------------------------------------------------------------
mkdir -p "$W/run" && chmod 755 "$W/run"
"$CONDENSE" --pool "$A" serve --socket "$SOCK" --group libvirt-qemu >"$W/serve-a.log" 2>&1 &
A_PID=$!
"$CONDENSE" --pool "$B" serve --listen "127.0.0.1:$PORT" --tls-cert "$W/server-cert.pem" \
    --tls-key "$W/server-key.pem" --tls-client-ca "$PKI/ca-cert.pem" >"$W/serve-b.log" 2>&1 &
B_PID=$!
wait_ready "$A_PID" "$W/serve-a.log" nbdinfo --size "nbd+unix:///vm?socket=$SOCK" || exit 1
wait_ready "$B_PID" "$W/serve-b.log" \
    nbdinfo --size "nbds://127.0.0.1:$PORT/base@golden?tls-certificates=$PKI" || exit 1
phase "pools, certificates and servers ready"
check "socket is mode 0660, group libvirt-qemu" \
    test "$(stat -c %a:%G "$SOCK")" = 660:libvirt-qemu

# --- the domain XML ------------------------------------------------------------------------------
# Through the servers' control sockets (serve holds the pools).
check "volume libvirt-xml vm --socket (vda)" \
    "$CONDENSE" --pool "$A" volume libvirt-xml vm --socket "$SOCK"
cp "$W/out" "$W/vda.xml"
check "volume libvirt-xml base@golden --tls (vdb)" \
    "$CONDENSE" --pool "$B" volume libvirt-xml base@golden --tls "127.0.0.1:$PORT" --target vdb
cp "$W/out" "$W/vdb.xml"
check "a snapshot's disk is read-only, over TLS" \
    bash -c "grep -q '<readonly/>' '$W/vdb.xml' && grep -q \"tls='yes'\" '$W/vdb.xml'"
check "the default socket is the pool's nbd.sock" \
    bash -c "'$CONDENSE' --pool '$A' volume libvirt-xml vm | grep -qF \"socket='$A/nbd.sock'\""
refuse "a volume the pool does not hold is refused" "not found" \
    "$CONDENSE" --pool "$A" volume libvirt-xml nosuch
refuse "a relative socket path is refused" "absolute path" \
    "$CONDENSE" --pool "$A" volume libvirt-xml vm --socket run/guest.sock

domain_xml() { # DISK_XML...: the domain, its disks the files given
    cat <<EOF
<domain type='qemu'>
  <name>$DOMAIN</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>$G/vmlinuz</kernel>
    <initrd>$G/initrd.img</initrd>
    <cmdline>console=ttyS0 quiet</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <devices>
$(cat "$@")
    <serial type='file'><source path='$W/serial.log'/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
</domain>
EOF
}
domain_xml "$W/vda.xml" "$W/vdb.xml" >"$W/domain.xml"
check "the domain XML is valid (virt-xml-validate)" virt-xml-validate "$W/domain.xml" domain
check "volume libvirt-xml of $ODD" "$CONDENSE" --pool "$A" volume libvirt-xml "$ODD" --target vdc
cp "$W/out" "$W/odd.xml"
domain_xml "$W/vda.xml" "$W/odd.xml" >"$W/odd-domain.xml"
check "a name with & < ' \" > is escaped: the domain XML is valid" \
    virt-xml-validate "$W/odd-domain.xml" domain

# --- libvirtd, in this namespace ----------------------------------------------------------------
for d in etc/libvirt run/libvirt var/lib/libvirt var/cache/libvirt var/log/libvirt; do
    mkdir -p "$W/ns/$d" "/$d"
    mount --bind "$W/ns/$d" "/$d"
done
mkdir -p /var/lib/libvirt/qemu /var/cache/libvirt/qemu /run/libvirt/qemu
chown libvirt-qemu:libvirt-qemu /var/lib/libvirt/qemu /var/cache/libvirt/qemu
printf 'log_outputs = "3:file:%s/libvirtd.log"\n' "$W" >/etc/libvirt/libvirtd.conf
# security_driver none: no AppArmor/SELinux labels (DAC, qemu as libvirt-qemu, stays);
# stdio_handler file: no virtlogd; no cgroups or namespaces of libvirt's own (no systemd here).
cat >/etc/libvirt/qemu.conf <<EOF
user = "libvirt-qemu"
group = "libvirt-qemu"
security_driver = "none"
stdio_handler = "file"
cgroup_controllers = [ ]
namespaces = [ ]
nbd_tls_x509_cert_dir = "$PKI"
EOF
# The domain is type='qemu' (TCG, as on CI, which has no KVM). Where /dev/kvm exists, libvirt
# probes qemu with and without KVM, and where libvirt-qemu cannot open it (a device of another
# group) it finds its cached probe out of date at every lookup and probes again (~45 s of this
# test on the development machine). An unopenable file in its place, in this namespace only,
# makes libvirt see what CI has.
if [ -e /dev/kvm ]; then
    : >"$W/no-kvm" && chmod 600 "$W/no-kvm" && mount --bind "$W/no-kvm" /dev/kvm
fi
libvirtd --daemon --pid-file "$W/libvirtd.pid" >"$W/libvirtd.out" 2>&1
for _ in $(seq 1 300); do
    virsh -q version >/dev/null 2>&1 && break
    sleep 0.1
done
LIBVIRTD_PID=$(cat "$W/libvirtd.pid" 2>/dev/null)
check "libvirtd started (qemu:///system in the test's namespace)" virsh -q version
phase "libvirtd ready: $(virsh -q version 2>/dev/null | grep -o 'hypervisor: .*')"

# --- boot ---------------------------------------------------------------------------------------
# boot_to_login XML LABEL: define and start the domain, wait for "login:" on its serial
# console, destroy and undefine it. Sets boot_s.
boot_to_login() {
    local xml=$1 label=$2 start
    : >"$W/serial.log"
    check "$label: virsh define" virsh define "$xml" || return 1
    defined=1
    start=$(date +%s.%N)
    check "$label: virsh start" virsh start "$DOMAIN" || return 1
    local ok=0
    for _ in $(seq 1 1500); do
        if grep -q 'login:' "$W/serial.log" 2>/dev/null; then ok=1; break; fi
        virsh -q domstate "$DOMAIN" 2>/dev/null | grep -q running || break
        sleep 0.2
    done
    boot_s=$(echo "$(date +%s.%N) - $start" | bc)
    if [ $ok = 1 ]; then
        ok "$label: the guest reached its login prompt on the serial console ($(printf '%.1f' "$boot_s") s)"
    else
        fail "$label: no login prompt (state $(virsh -q domstate "$DOMAIN" 2>&1))" "$W/serial.log"
        tail -5 "/var/log/libvirt/qemu/$DOMAIN.log" 2>/dev/null
    fi
    check "$label: virsh destroy" virsh destroy "$DOMAIN"
    check "$label: virsh undefine" virsh undefine "$DOMAIN"
    defined=0
}
boot_to_login "$W/domain.xml" "vda on the Unix socket, vdb over TLS"
condense_s=$boot_s
cp "$W/serial.log" "$W/serial-condense.log"
if [ "${BASELINE:-0}" = 1 ]; then
    cp --sparse=always "$G/root.raw" "$W/plain.raw" && chown libvirt-qemu "$W/plain.raw"
    printf "<disk type='file' device='disk'><driver name='qemu' type='raw'/><source file='%s'/><target dev='vda' bus='virtio'/></disk>\n" \
        "$W/plain.raw" >"$W/plain.xml"
    domain_xml "$W/plain.xml" >"$W/plain-domain.xml"
    boot_to_login "$W/plain-domain.xml" "baseline: the image as a plain file"
    echo "# boot to login: from Condense $(printf '%.1f' "$condense_s") s, plain file $(printf '%.1f' "$boot_s") s"
fi

# --- afterwards: the servers, the pools, what the guest wrote and read --------------------------
stop_server_of() { # NAME PID: SIGTERM, and pass if it exits 0
    kill -TERM "$2"
    if wait "$2"; then ok "$1 stopped cleanly"; else fail "$1 exited with status $?" "$W/$1.log"; fi
}
phase "booted"
stop_server_of serve-a "$A_PID"
A_PID=
stop_server_of serve-b "$B_PID"
B_PID=
check "pool A: verify clean" "$CONDENSE" --pool "$A" verify
check "pool B: verify clean" "$CONDENSE" --pool "$B" verify

marker=$(grep -a -o 'wrote "boot [0-9a-f-]*"' "$W/serial-condense.log" | head -1 | cut -d'"' -f2)
check "the guest wrote its boot marker (console: \"$marker\")" test -n "$marker"
check "export of vm" "$CONDENSE" --pool "$A" export vm "$W/vm.raw"
check "the marker the guest wrote is in volume vm" \
    bash -c "debugfs -R 'cat /boot-marker' '$W/vm.raw' 2>/dev/null | grep -qxF '$marker'"
read_md5=$(grep -a -o '/dev/vdb first 4 MiB md5 [0-9a-f]*' "$W/serial-condense.log" | awk '{print $NF}')
want_md5=$(head -c 4M "$G/root.raw" | md5sum | cut -d' ' -f1)
check "the guest read base@golden over TLS (md5 ${read_md5:-none} = $want_md5)" \
    test "$read_md5" = "$want_md5"
check "export of guest@golden" "$CONDENSE" --pool "$A" export guest@golden "$W/golden.raw"
check "guest@golden is still the imported image (the clone's writes stayed in vm)" \
    cmp "$W/golden.raw" "$G/root.raw"
phase "done"

summary
