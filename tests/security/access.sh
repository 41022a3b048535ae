#!/usr/bin/env bash
# Access end to end (issue 23: "access by default only to the pool's owner"), with a second
# Unix account made here and real clients (nbdinfo, qemu-img, qemu-io, head, a FUSE mount).
# Everything runs under umask 000, and the work directory is open to everyone (0755/0777), so
# that only the modes Condense gives its own files and sockets can keep the other user out:
#
#   pool files: init makes the pool directory 0700 and every file 0600 (segments, journal,
#     metadata, superblock, lock, status, sockets; a cache tier's directory and files too; an
#     S3 pool's local directory and a file:// bucket); the other user reads none of them, even
#     after an administrator opens the directory (chmod 755: the files still say no), and
#     condense warns about such a directory with the chmod that closes it ->
#   NBD: serve with no endpoint option serves POOL/nbd.sock (0600) and prints the URIs: the
#     owner reads the volume, the other user's nbdinfo/qemu-io cannot connect; --socket in a
#     world-writable directory is 0600 too; --group GROUP makes it 0660 for GROUP: a member
#     connects and reads, a non-member (nobody) cannot ->
#   TCP: --listen without client authentication is refused with a message naming the ways
#     (client certificates, a shared key, --insecure-listen), and nothing listens; --listen
#     with TLS client certificates starts and turns a plaintext client away; --insecure-listen
#     serves and warns that anyone who reaches the port can read and write every volume ->
#   a pool path too long for a socket: serve names the fix (--socket), which works ->
#   FUSE: mount --allow-other keeps the mount 0700 and volumes 0600 (even a 0666 file under
#     files/ is out of reach); --umask 022 lets the other user read a volume, not write it ->
#   export: raw and qcow2 files are 0600, an existing file overwritten with --force too.
#
#   sudo bash tests/security/access.sh      # builds target/release/condense first
#   sudo CONDENSE=/path/to/condense bash tests/security/access.sh
#
# Needs root (useradd, runuser; skipped with the reason otherwise, a failure under CI=true),
# passwd (useradd), util-linux (runuser), libnbd-bin (nbdinfo), qemu-utils (qemu-img, qemu-io),
# openssl; /dev/fuse for the mount part. Ends with "N passed, M failed, K skipped".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"

if [ "$(id -u)" != 0 ]; then
    skip "access: a second Unix account reaches nothing" "needs root to create the account (useradd) and act as it (runuser)"
    summary
    exit $?
fi
need_tools useradd userdel groupadd groupdel runuser nbdinfo qemu-img qemu-io openssl stat find

umask 000 # Condense's modes must not follow the umask
W=$(mktemp -d /tmp/condense-access.XXXXXX)
chmod 755 "$W" # the other user may walk everywhere below: only Condense's modes protect
U=cacc$$       # the other Unix account, and a group it is a member of
G=caccg$$
SERVER_PID=
MOUNT_PID=
MNT=$W/mnt
cleanup() {
    stop_pids "$SERVER_PID" "$MOUNT_PID"
    if mountpoint -q "$MNT" 2>/dev/null; then umount -l "$MNT"; fi
    userdel "$U" >/dev/null 2>&1
    groupdel "$G" >/dev/null 2>&1
    remove_work_dir
}
trap cleanup EXIT

if groupadd "$G" && useradd --no-create-home --shell /usr/sbin/nologin --groups "$G" "$U"; then
    ok "a second Unix account $U (member of group $G) made for this test"
else
    fail "a second Unix account $U made for this test"
    exit 1
fi
as_user() { runuser -u "$U" -- "$@"; }
user_reads() { as_user head -c1 -- "$1" >/dev/null; } # FILE: one byte of it, as $U
as_nobody() { runuser -u nobody -- "$@"; }

c() { "$CONDENSE" --pool "$POOL" "$@"; }
mode() { stat -c %a "$1"; }

# wait_for PID LOG CMD...: until CMD succeeds (as root), or the server died.
wait_for() { wait_ready "$@"; }
# serve_with LOG ARGS...: start serve on $POOL in the background.
serve_with() {
    local log=$1
    shift
    "$CONDENSE" --pool "$POOL" serve "$@" >"$W/$log" 2>&1 &
    SERVER_PID=$!
}
stop_server() { stop_pids "$SERVER_PID"; SERVER_PID=; }

# --- 1. Pool files ---------------------------------------------------------------------------
PRIVATE=$W/private
mkdir -m 700 "$PRIVATE"
head -c 3M /dev/urandom >"$PRIVATE/src.raw"
truncate -s 4M "$PRIVATE/src.raw"
POOL=$W/pool
"$CONDENSE" init "$POOL" >"$W/init.log" 2>&1 && c import "$PRIVATE/src.raw" --name vm >/dev/null 2>&1 ||
    { fail "pool made and vm imported" "$W/init.log"; exit 1; }
check "init made the pool directory 0700 under umask 000" test "$(mode "$POOL")" = 700

# open_modes DIR...: every file or socket not 0600 and directory not 0700 below DIR (none).
open_modes() {
    local n
    find "$@" -mindepth 1 \( \( -type f -o -type s \) ! -perm 600 \) -printf 'file %m %p\n' \
        -o \( -type d ! -perm 700 \) -printf 'dir %m %p\n' >"$W/modes"
    n=$(find "$@" -mindepth 1 | wc -l)
    echo "$n entries examined"
    cat "$W/modes"
    [ "$n" -gt 3 ] && [ ! -s "$W/modes" ]
}
# unreadable DIR...: the other user can read not one byte of any file below DIR.
unreadable() {
    local f n=0 read=
    while IFS= read -r -d '' f; do
        n=$((n + 1))
        if user_reads "$f" 2>/dev/null; then read="$read $f"; fi
    done < <(find "$@" -type f -print0)
    echo "$n files tried as $U"
    [ -z "$read" ] || { echo "readable by $U:$read"; return 1; }
    [ "$n" -gt 3 ]
}

# A running serve adds the sockets, the status file, and with --cache a cache tier.
serve_with serve-default.log --cache "$W/cache" --cache-size 64M
DEFAULT_URI="nbd+unix:///vm?socket=$POOL/nbd.sock"
if wait_for "$SERVER_PID" "$W/serve-default.log" nbdinfo --size "$DEFAULT_URI"; then
    ok "serve with no endpoint option serves the pool's Unix socket"
else
    fail "serve with no endpoint option serves the pool's Unix socket" "$W/serve-default.log"
fi
check "... and prints the volume's URI" grep -qF "$DEFAULT_URI" "$W/serve-default.log"
check "the owner reads vm over it (qemu-img compare)" \
    qemu-img compare -f raw -F raw "$PRIVATE/src.raw" "$DEFAULT_URI"
for _ in $(seq 1 50); do [ -f "$POOL/status.json" ] && break; sleep 0.1; done
check "the pool's files, sockets and cache tier are 0600, its directories 0700" \
    open_modes "$POOL" "$W/cache"
check "the NBD and control sockets are 0600" \
    test "$(mode "$POOL/nbd.sock") $(mode "$POOL/control.sock")" = "600 600"
refuse "$U cannot list the pool directory" "" as_user ls "$POOL"
check "$U reads no file of the pool or its cache tier" unreadable "$POOL" "$W/cache"
refuse "$U: nbdinfo cannot connect to the default socket" "" \
    as_user nbdinfo --list "nbd+unix:///?socket=$POOL/nbd.sock"
refuse "$U: qemu-io cannot read vm" "" as_user qemu-io -r -f raw -c "read 0 4k" "$DEFAULT_URI"
install -m 755 "$CONDENSE" "$W/condense" # wherever $CONDENSE is, the other user can run this
check "$U can run condense" as_user "$W/condense" --version
refuse "$U: condense stats cannot open the pool" "Permission denied" \
    as_user "$W/condense" --pool "$POOL" stats

# An administrator who opens the directory: the files still keep the other user out, and
# condense says how to close it again (leaving the mode alone).
chmod 755 "$POOL"
check "with the pool directory opened (chmod 755), $U still reads no file of it" unreadable "$POOL"
refuse "... nor connects to its sockets" "" as_user nbdinfo --list "nbd+unix:///?socket=$POOL/nbd.sock"
stop_server
warns() {
    c volume list >"$W/warn.out" 2>&1
    cat "$W/warn.out"
    grep -qF "chmod 700 $POOL" "$W/warn.out" && [ "$(mode "$POOL")" = 755 ]
}
check "opening a pool whose directory others can enter warns with the chmod (mode left alone)" warns
chmod 700 "$POOL"

mkdir -m 777 "$W/loose"
check "init into an existing open directory warns with the chmod" \
    bash -c "'$CONDENSE' init '$W/loose' 2>&1 | grep -qF 'chmod 700 $W/loose'"

# An S3 pool's local directory, with a file:// bucket.
if "$CONDENSE" init "file://$W/bucket" --cache "$W/s3local" --cache-size 1G >"$W/s3.log" 2>&1 &&
    "$CONDENSE" --pool "$W/s3local" import "$PRIVATE/src.raw" --name vm >>"$W/s3.log" 2>&1; then
    check "an S3 pool's local directory and a file:// bucket: files 0600, directories 0700" \
        open_modes "$W/s3local" "$W/bucket"
    check "$U reads no file of them" unreadable "$W/s3local" "$W/bucket"
    check "... and their top directories are 0700" \
        test "$(mode "$W/s3local") $(mode "$W/bucket")" = "700 700"
else
    fail "an S3 pool (file:// bucket) made" "$W/s3.log"
fi

# --- 2. NBD sockets ------------------------------------------------------------------------
PUB=$W/pub
mkdir -m 777 "$PUB" # anyone may create and reach files here: only a socket's mode protects it
serve_with serve-socket.log --socket "$PUB/nbd.sock"
wait_for "$SERVER_PID" "$W/serve-socket.log" nbdinfo --size "nbd+unix:///vm?socket=$PUB/nbd.sock" ||
    fail "serve --socket starts" "$W/serve-socket.log"
check "--socket PATH is 0600 under umask 000" test "$(mode "$PUB/nbd.sock")" = 600
check "the owner reads vm over it" \
    qemu-img compare -f raw -F raw "$PRIVATE/src.raw" "nbd+unix:///vm?socket=$PUB/nbd.sock"
refuse "$U: nbdinfo cannot connect to --socket in a world-writable directory" "" \
    as_user nbdinfo --list "nbd+unix:///?socket=$PUB/nbd.sock"
refuse "$U: qemu-img cannot read vm through it" "" \
    as_user qemu-img info "nbd+unix:///vm?socket=$PUB/nbd.sock"
stop_server

serve_with serve-group.log --socket "$PUB/g.sock" --group "$G"
GURI="nbd+unix:///vm?socket=$PUB/g.sock"
wait_for "$SERVER_PID" "$W/serve-group.log" nbdinfo --size "$GURI" ||
    fail "serve --socket --group starts" "$W/serve-group.log"
check "--group $G: the socket is 0660, group $G" \
    test "$(stat -c '%a %G' "$PUB/g.sock")" = "660 $G"
check "$U (in $G) connects: nbdinfo lists vm" \
    bash -c "runuser -u '$U' -- nbdinfo --list 'nbd+unix:///?socket=$PUB/g.sock' | grep -q 'export=\"vm\"'"
cp "$PRIVATE/src.raw" "$PUB/src.raw" # a copy the other user may read, to compare with
check "$U (in $G) reads vm through it (qemu-img compare)" \
    as_user qemu-img compare -f raw -F raw "$PUB/src.raw" "$GURI"
refuse "nobody (not in $G) cannot connect to it" "" \
    as_nobody nbdinfo --list "nbd+unix:///?socket=$PUB/g.sock"
stop_server
refuse "--group with the default socket (in the owner-only pool directory) is refused" \
    "needs --socket PATH" c serve --group "$G"

# --- 3. TCP --------------------------------------------------------------------------------
free_port PORT
refuse "serve --listen without client authentication is refused" \
    "insecure-listen 127.0.0.1:$PORT" timeout 20 "$CONDENSE" --pool "$POOL" serve --listen "127.0.0.1:$PORT"
cp "$W/out" "$W/listen.out"
check "... and the message names client certificates and a shared key" \
    grep -q -- "--tls-client-ca.*--tls-psk" "$W/listen.out"
refuse "... and nothing listens on the port" "" nbdinfo --list "nbd://127.0.0.1:$PORT"

# --listen with TLS client certificates is authentication enough.
mkdir -m 700 "$W/tls"
tls_files() {
    (cd "$W/tls" &&
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
            -keyout ca-key.pem -out ca-cert.pem -subj "/CN=access test CA" \
            -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign &&
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout server-key.pem \
            -out server.csr -subj "/CN=localhost" &&
        printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >server.ext &&
        openssl x509 -req -in server.csr -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
            -days 2 -out server-cert.pem -extfile server.ext) >"$W/openssl.log" 2>&1
}
if tls_files; then
    serve_with serve-tls.log --listen "127.0.0.1:$PORT" --tls-cert "$W/tls/server-cert.pem" \
        --tls-key "$W/tls/server-key.pem" --tls-client-ca "$W/tls/ca-cert.pem"
    if wait_for "$SERVER_PID" "$W/serve-tls.log" grep -q "stop with Ctrl-C" "$W/serve-tls.log"; then
        ok "--listen with TLS client certificates (--tls-client-ca) starts"
    else
        fail "--listen with TLS client certificates (--tls-client-ca) starts" "$W/serve-tls.log"
    fi
    refuse "... and a plaintext client ($U) gets nothing" "" \
        as_user nbdinfo --list "nbd://127.0.0.1:$PORT"
    stop_server
else
    fail "certificates made with openssl" "$W/openssl.log"
fi

free_port PORT2
serve_with serve-insecure.log --insecure-listen "127.0.0.1:$PORT2"
if wait_for "$SERVER_PID" "$W/serve-insecure.log" nbdinfo --size "nbd://127.0.0.1:$PORT2/vm"; then
    ok "--insecure-listen serves plaintext TCP"
else
    fail "--insecure-listen serves plaintext TCP" "$W/serve-insecure.log"
fi
check "... and warns that anyone who reaches the port can read and write every volume" \
    grep -q "warning: --insecure-listen: .*anyone who can reach port $PORT2 can list, read and write every volume" \
    "$W/serve-insecure.log"
check "... which is true: $U reads vm over it" \
    as_user qemu-img compare -f raw -F raw "$PUB/src.raw" "nbd://127.0.0.1:$PORT2/vm"
stop_server

# --- 4. A pool path too long for a socket ---------------------------------------------------
LONG=$W/$(printf 'l%.0s' $(seq 1 90))/pool
"$CONDENSE" init "$LONG" >/dev/null 2>&1 || fail "a pool at a long path made"
refuse "a pool path too long for its default socket: serve names the fix" "shorter one with --socket PATH" \
    timeout 20 "$CONDENSE" --pool "$LONG" serve
"$CONDENSE" --pool "$LONG" serve --socket "$PUB/long.sock" >"$W/serve-long.log" 2>&1 &
SERVER_PID=$!
if wait_for "$SERVER_PID" "$W/serve-long.log" nbdinfo --list "nbd+unix:///?socket=$PUB/long.sock"; then
    ok "... and with --socket SHORTER_PATH it serves"
else
    fail "... and with --socket SHORTER_PATH it serves" "$W/serve-long.log"
fi
stop_server

# --- 5. FUSE --allow-other ------------------------------------------------------------------
mkdir -m 777 "$MNT"
mount_with() { # ARGS...: mount $POOL at $MNT in the background, until volumes/vm shows
    "$CONDENSE" --pool "$POOL" mount "$MNT" --allow-other "$@" >"$W/mount.log" 2>&1 &
    MOUNT_PID=$!
    wait_for "$MOUNT_PID" "$W/mount.log" test -f "$MNT/volumes/vm"
}
unmount() { stop_pids "$MOUNT_PID"; MOUNT_PID=; }
if [ ! -c /dev/fuse ]; then
    skip "FUSE mount --allow-other" "no /dev/fuse"
elif mount_with; then
    ok "mount --allow-other (as root)"
    check "the mount root is 0700 and volumes/vm 0600, owned by the mounting user" \
        test "$(stat -c '%a %U' "$MNT") $(stat -c '%a %U' "$MNT/volumes/vm")" = "700 root 600 root"
    check "the owner reads vm through the mount" cmp "$PRIVATE/src.raw" "$MNT/volumes/vm"
    echo "a file anyone could read" >"$MNT/files/open.txt" # 0666: umask 000
    refuse "$U cannot list the mount" "" as_user ls "$MNT/volumes"
    refuse "$U cannot read volumes/vm" "" user_reads "$MNT/volumes/vm"
    refuse "$U cannot read even a 0666 file under files/" "" user_reads "$MNT/files/open.txt"
    check "--allow-other with the default umask says that it lets nobody in yet" \
        grep -q "add --umask 022" "$W/mount.log"
    unmount
    if mount_with --umask 022; then
        check "--umask 022: volumes/vm is 0644" test "$(mode "$MNT/volumes/vm")" = 644
        check "... and $U reads it" as_user cmp "$PUB/src.raw" "$MNT/volumes/vm"
        refuse "... but cannot write it" "" \
            as_user dd if=/dev/zero of="$MNT/volumes/vm" bs=4k count=1 conv=notrunc
        unmount
    else
        fail "mount --allow-other --umask 022" "$W/mount.log"
    fi
else
    fail "mount --allow-other (as root)" "$W/mount.log"
fi

# --- 6. export --------------------------------------------------------------------------------
check "export to raw" c export vm "$PUB/vm.raw"
check "export to qcow2" c export vm "$PUB/vm.qcow2"
: >"$PUB/old.raw" # 0666, as umask 000 makes it
check "export --force over an existing 0666 file" c export vm "$PUB/old.raw" --force
check "every export is 0600 (raw, qcow2, overwritten)" \
    test "$(mode "$PUB/vm.raw") $(mode "$PUB/vm.qcow2") $(mode "$PUB/old.raw")" = "600 600 600"
check "the exports hold the volume" \
    bash -c "cmp '$PRIVATE/src.raw' '$PUB/vm.raw' && cmp '$PRIVATE/src.raw' '$PUB/old.raw' &&
             qemu-img compare -f raw -F qcow2 '$PRIVATE/src.raw' '$PUB/vm.qcow2'"
for f in vm.raw vm.qcow2 old.raw; do
    refuse "$U cannot read the export $f" "" user_reads "$PUB/$f"
done

summary
