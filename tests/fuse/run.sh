#!/usr/bin/env bash
# End-to-end tests of `condense mount` with the real binary and real tools: cp/sha256sum into
# files/, losetup + mkfs.xfs / mkfs.ext4 on volumes/NAME + xfs_repair -n / e2fsck -f -n, fio with
# verify on a files/ file and on a volume file, kill -9 of the daemon and remount, unmount with
# open files, the errno of bad requests, and fsynced buffered writes under --writeback-cache.
#
#   bash tests/fuse/run.sh            # builds target/release/condense first
#   CONDENSE=/path/to/condense bash tests/fuse/run.sh
#
# Needs (Debian): fuse3 fio xfsprogs e2fsprogs util-linux python3; root for loop devices and
# mounts (skipped with a reason otherwise, except with CI=true, where they fail). Ends with the
# line "N passed, M failed" and exits non-zero if anything failed. KEEP=1 keeps the work
# directory of a failed run.

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"

finish() { summary; exit $?; }

if ! "$CONDENSE" mount --help >/dev/null 2>&1; then
    fail "$CONDENSE has no 'mount' command (crates/cli/src/main.rs must add 'mod mount;')"
    finish
fi
if [ ! -e /dev/fuse ]; then
    skip "every FUSE test" "/dev/fuse is missing"
    finish
fi
if [ "$(id -u)" != 0 ] && ! command -v fusermount3 >/dev/null; then
    skip "every FUSE test" "not root and no fusermount3 (apt-get install fuse3)"
    finish
fi
for tool in fio python3 sha256sum; do
    command -v "$tool" >/dev/null || { fail "missing $tool (scripts/install-deps.sh)"; finish; }
done
IS_ROOT=0
[ "$(id -u)" = 0 ] && IS_ROOT=1

W=$(mktemp -d /tmp/condense-fuse-e2e.XXXXXX)
POOL=$W/pool
MNT=$W/mnt
MOUNT_PID=
LOOPS=()
INNER_MOUNTS=()
mkdir -p "$MNT" "$W/src"

unmount_mnt() {
    if mountpoint -q "$MNT" 2>/dev/null || grep -q " $MNT " /proc/mounts; then
        umount "$MNT" 2>/dev/null || fusermount3 -u "$MNT" 2>/dev/null ||
            umount -l "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT" 2>/dev/null
    fi
}

cleanup() {
    for m in "${INNER_MOUNTS[@]}"; do umount "$m" 2>/dev/null; done
    for l in "${LOOPS[@]}"; do losetup -d "$l" 2>/dev/null; done
    stop_pids "$MOUNT_PID"
    unmount_mnt
    remove_work_dir
}
trap cleanup EXIT

condense() { "$CONDENSE" --pool "$POOL" "$@"; }

start_mount() {
    "$CONDENSE" --pool "$POOL" mount "$MNT" "$@" >>"$W/mount.log" 2>&1 &
    MOUNT_PID=$!
    for _ in $(seq 1 100); do
        # ls, not test -d: right after a kill -9 the kernel may still answer a stat of the
        # dead mount's files/ from its attribute cache; a listing needs a live daemon.
        if ls "$MNT/files" >/dev/null 2>&1 && ls "$MNT/volumes" >/dev/null 2>&1; then return 0; fi
        if ! kill -0 "$MOUNT_PID" 2>/dev/null; then break; fi
        sleep 0.1
    done
    echo "mount did not come up:"
    tail -20 "$W/mount.log"
    return 1
}

# SIGTERM; succeeds when the daemon exits 0 and the mount is gone.
stop_mount() {
    kill -TERM "$MOUNT_PID"
    wait "$MOUNT_PID"
    local rc=$?
    MOUNT_PID=
    if grep -q " $MNT " /proc/mounts; then
        echo "still mounted after the daemon exited"
        return 1
    fi
    return $rc
}

# kill -9 of the daemon, as a crash: the dead mount stays behind until start_mount detaches it.
kill_mount() {
    kill -KILL "$MOUNT_PID"
    wait "$MOUNT_PID" 2>/dev/null
    MOUNT_PID=
}

# Checksums of every file under DIR, relative paths, sorted.
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 -r sha256sum); }

# A small tree to copy into the file systems on loop devices: text, binaries, a sparse file.
make_tree() {
    local t=$1
    mkdir -p "$t"
    cp -r "$ROOT/crates" "$t/src" 2>/dev/null
    mkdir -p "$t/bin" "$t/deep/a/b/c/d"
    cp /usr/bin/ls /usr/bin/cp /usr/bin/find "$t/bin/"
    head -c 3M /dev/urandom >"$t/random.bin"
    truncate -s 20M "$t/sparse.img"
    printf 'in the middle' | dd of="$t/sparse.img" bs=1 seek=10485760 conv=notrunc status=none
    for i in $(seq 1 200); do echo "file $i" >"$t/deep/a/b/c/d/f$i"; done
}

cd "$W" || exit 1
echo "condense: $CONDENSE; work dir $W"

# ---------------------------------------------------------------------------------------
# Pool, volumes, mount.
if ! condense init >"$W/out" 2>&1; then
    fail "condense init" "$W/out"
    finish
fi
for v in xfsvol:512M ext4vol:256M fiovol:128M small:1M; do
    condense volume create "${v%%:*}" --size "${v##*:}" >"$W/out" 2>&1 || fail "volume create $v" "$W/out"
done
if ! start_mount; then
    fail "condense mount comes up"
    finish
fi
ok "condense mount comes up with volumes/ and files/"

ls "$MNT/volumes" >"$W/out" 2>&1
if [ "$(tr '\n' ' ' <"$W/out")" = "ext4vol fiovol small xfsvol " ]; then
    ok "volumes/ lists the user volumes"
else
    fail "volumes/ lists the user volumes" "$W/out"
fi
size=$(stat -c %s "$MNT/volumes/xfsvol")
if [ "$size" = $((512 << 20)) ]; then ok "a volume file has the volume's size"; else fail "volume file size $size"; fi

# ---------------------------------------------------------------------------------------
# Images into files/: byte-identical, deduplicated.
head -c 24M /dev/urandom >"$W/src/base"
tar cf - /usr/share/doc 2>/dev/null | head -c 16M >"$W/src/text"
for i in 1 2 3 4 5 6; do
    {
        cat "$W/src/base"
        head -c $((i * 1024 * 1024)) /dev/zero
        head -c 1M /dev/urandom
        cat "$W/src/text"
    } >"$W/src/vm$i.img"
done
rm -f "$W/src/base" "$W/src/text"
mkdir -p "$MNT/files/images"
check "cp 6 images into files/images" cp "$W"/src/vm*.img "$MNT/files/images/"
(cd "$W/src" && sha256sum vm*.img) >"$W/images.sha"
check "images read back byte-identical (sha256sum -c)" bash -c "cd '$MNT/files/images' && sha256sum --quiet -c '$W/images.sha'"
apparent=$(du -s --apparent-size -B1 "$MNT/files/images" | cut -f1)
used=$(du -s -B1 "$MNT/files/images" | cut -f1)
if [ "$used" -lt "$apparent" ]; then
    ok "du counts data blocks only ($used of $apparent bytes: zero runs are free)"
else
    fail "du of files/images: $used used vs $apparent apparent"
fi
ls -l "$MNT/files/images" >"$W/out" 2>&1 && grep -q "vm6.img" "$W/out" && ok "ls -l files/images" || fail "ls -l" "$W/out"
check "statfs of the mount (df)" df -h "$MNT"

# ---------------------------------------------------------------------------------------
# Bad input: the right errno, nothing changed.
cat >"$W/errno.py" <<'EOF'
import errno, os, sys
mnt = sys.argv[1]
failures = []
def expect(name, code, fn):
    try:
        fn()
    except OSError as e:
        if e.errno != code:
            failures.append(f"{name}: errno {e.errno} ({os.strerror(e.errno)}), expected {errno.errorcode[code]}")
        return
    failures.append(f"{name}: succeeded, expected {errno.errorcode[code]}")

vol = os.path.join(mnt, "volumes", "small")
size = os.stat(vol).st_size
fd = os.open(vol, os.O_RDWR)
os.pwrite(fd, b"\xab" * 4096, size - 4096)
expect("write at the end of a volume", errno.ENOSPC, lambda: os.pwrite(fd, b"x", size))
expect("write across the end of a volume", errno.ENOSPC, lambda: os.pwrite(fd, b"y" * 8192, size - 4096))
if os.pread(fd, 4096, size - 4096) != b"\xab" * 4096:
    failures.append("a refused write changed the volume")
expect("ftruncate of a volume", errno.EPERM, lambda: os.ftruncate(fd, 4096))
os.close(fd)
if os.stat(vol).st_size != size:
    failures.append("the volume's size changed")
expect("O_TRUNC of a volume", errno.EPERM, lambda: os.open(vol, os.O_WRONLY | os.O_TRUNC))
expect("create in volumes/", errno.EPERM, lambda: os.open(os.path.join(mnt, "volumes", "new"), os.O_CREAT | os.O_WRONLY))
expect("unlink in volumes/", errno.EPERM, lambda: os.unlink(vol))

files = os.path.join(mnt, "files")
os.makedirs(os.path.join(files, "full", "sub"), exist_ok=True)
expect("rmdir of a non-empty directory", errno.ENOTEMPTY, lambda: os.rmdir(os.path.join(files, "full")))
expect("a 256-byte name", errno.ENAMETOOLONG, lambda: open(os.path.join(files, "n" * 256), "w"))
expect("mkdir with a 256-byte name", errno.ENAMETOOLONG, lambda: os.mkdir(os.path.join(files, "d" * 256)))
with open(os.path.join(files, "n" * 255), "w") as f:
    f.write("255 bytes is fine")
expect("rename across volumes/ and files/", errno.EXDEV, lambda: os.rename(os.path.join(files, "n" * 255), os.path.join(mnt, "volumes", "x")))
expect("unlink of a missing file", errno.ENOENT, lambda: os.unlink(os.path.join(files, "missing")))
expect("rmdir of a file", errno.ENOTDIR, lambda: os.rmdir(os.path.join(files, "n" * 255)))
os.rmdir(os.path.join(files, "full", "sub"))
os.rmdir(os.path.join(files, "full"))
if failures:
    print("\n".join(failures))
    sys.exit(1)
EOF
check "errno of bad requests (ENOSPC, EPERM, ENOTEMPTY, ENAMETOOLONG, EXDEV, ENOENT, ENOTDIR)" python3 "$W/errno.py" "$MNT"

# ---------------------------------------------------------------------------------------
# SEEK_DATA/SEEK_HOLE and punch hole on a volume file, through the kernel.
cat >"$W/holes.py" <<'EOF'
import os, sys
p = sys.argv[1]
fd = os.open(p, os.O_RDWR)
M = 1 << 20
os.pwrite(fd, os.urandom(M), 4 * M)
os.fsync(fd)
assert os.lseek(fd, 0, os.SEEK_DATA) == 4 * M, os.lseek(fd, 0, os.SEEK_DATA)
assert os.lseek(fd, 4 * M, os.SEEK_HOLE) == 5 * M
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
r = libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, ctypes.c_long(4 * M), ctypes.c_long(M // 2))
assert r == 0, ctypes.get_errno()
assert os.lseek(fd, 0, os.SEEK_DATA) == 4 * M + M // 2
assert os.pread(fd, M // 2, 4 * M) == bytes(M // 2)
os.close(fd)
EOF
check "SEEK_DATA/SEEK_HOLE and fallocate(PUNCH_HOLE) on volumes/fiovol" python3 "$W/holes.py" "$MNT/volumes/fiovol"

# ---------------------------------------------------------------------------------------
# fio with verify: random 4 KiB writes by 4 jobs, each in its own quarter, then read back.
fio_verify() { # NAME FILE SIZE_PER_JOB
    fio --name="$1" --filename="$2" --rw=randwrite --bs=4k --numjobs=4 --size="$3" \
        --offset_increment="$3" --ioengine=psync --verify=crc32c --verify_fatal=1 \
        --do_verify=1 --fsync_on_close=1 --group_reporting >"$W/fio.out" 2>&1 &&
        ! grep -qi "verify: bad" "$W/fio.out"
}
if fio_verify files "$MNT/files/fio.dat" 16M; then ok "fio verify on files/fio.dat (4 jobs, random 4K)"; else fail "fio verify on files/fio.dat" "$W/fio.out"; fi
if fio_verify volume "$MNT/volumes/fiovol" 16M; then ok "fio verify on volumes/fiovol (4 jobs, random 4K)"; else fail "fio verify on volumes/fiovol" "$W/fio.out"; fi

# ---------------------------------------------------------------------------------------
# A real file system on a loop device over volumes/NAME.
loop_fs() { # VOLUME MKFS FSCK...: mkfs, mount, copy a tree, unmount, fsck -n
    local vol=$1 mkfs=$2
    shift 2
    local loop dir=$W/fs-$vol
    loop=$(losetup -f --show "$MNT/volumes/$vol") || { echo "losetup failed"; return 1; }
    LOOPS+=("$loop")
    $mkfs "$loop" >"$W/mkfs-$vol.log" 2>&1 || { cat "$W/mkfs-$vol.log"; return 1; }
    mkdir -p "$dir"
    mount "$loop" "$dir" || return 1
    INNER_MOUNTS+=("$dir")
    cp -a "$W/tree" "$dir/tree" || return 1
    sync
    sums "$dir/tree" >"$W/$vol.sha"
    sums "$W/tree" | cmp - "$W/$vol.sha" || { echo "checksums differ after the copy"; return 1; }
    umount "$dir" || return 1
    "$@" "$loop" || return 1
    losetup -d "$loop"
}
if [ "$IS_ROOT" = 1 ] && command -v losetup >/dev/null; then
    make_tree "$W/tree"
    if command -v mkfs.xfs >/dev/null; then
        check "losetup + mkfs.xfs + mount + cp -a tree + umount + xfs_repair -n" loop_fs xfsvol "mkfs.xfs -f -q" xfs_repair -n
    else
        skip "XFS on a loop device" "no mkfs.xfs (apt-get install xfsprogs)"
    fi
    check "losetup + mkfs.ext4 + mount + cp -a tree + umount + e2fsck -f -n" loop_fs ext4vol "mkfs.ext4 -F -q" e2fsck -f -n
else
    skip "file systems on loop devices over volume files" "needs root and losetup"
fi

# ---------------------------------------------------------------------------------------
# Remount: SIGTERM unmounts cleanly; everything is there afterwards.
if stop_mount; then ok "SIGTERM unmounts cleanly (exit 0)"; else fail "SIGTERM unmount" "$W/mount.log"; fi
if condense stats --json >"$W/stats.json" 2>"$W/stats.err"; then
    ok "condense stats after unmount"
else
    fail "condense stats after unmount" "$W/stats.err"
fi
cat >"$W/stats.py" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
names = [v["name"] for v in s["volumes"]]
files = [n for n in names if n.startswith(".file.")]
assert len(files) >= 7, f"expected the content volumes of files/ in stats, got {names}"
assert "xfsvol" in names and "fiovol" in names, names
assert s["dedup_saving_percent"] > 30, f"six images sharing 24 MiB dedup: {s['dedup_saving_percent']}%"
print(f"dedup saving {s['dedup_saving_percent']}%, total saving {s['saving_percent']}%")
EOF
check "condense stats counts files/ and volumes/, with the images' savings" python3 "$W/stats.py" "$W/stats.json"
cat "$W/out" 2>/dev/null | sed 's/^/    /'

if start_mount; then ok "remount"; else fail "remount" "$W/mount.log"; finish; fi
check "images identical after remount" bash -c "cd '$MNT/files/images' && sha256sum --quiet -c '$W/images.sha'"
verify_fs() { # VOLUME: mount read-only and compare checksums
    local vol=$1
    local loop dir=$W/fs-$vol
    loop=$(losetup -f --show "$MNT/volumes/$vol") || return 1
    LOOPS+=("$loop")
    mount -o ro "$loop" "$dir" || return 1
    sums "$dir/tree" | cmp - "$W/$vol.sha"
    local rc=$?
    umount "$dir"
    losetup -d "$loop"
    return $rc
}
if [ "$IS_ROOT" = 1 ]; then
    [ -f "$W/xfsvol.sha" ] && check "XFS tree checksums after remount" verify_fs xfsvol
    [ -f "$W/ext4vol.sha" ] && check "ext4 tree checksums after remount" verify_fs ext4vol
fi

# ---------------------------------------------------------------------------------------
# kill -9 of the daemon: what was fsynced is there after a remount.
head -c 5M /dev/urandom >"$W/synced"
check "write + fsync a file (dd conv=fsync)" dd if="$W/synced" of="$MNT/files/synced" bs=1M conv=fsync status=none
check "write + fsync a volume range (dd conv=notrunc,fsync)" dd if="$W/synced" of="$MNT/volumes/small" bs=512K count=1 conv=notrunc,fsync status=none
mkdir -p "$MNT/files/dir-synced" && python3 -c "import os; fd = os.open('$MNT/files/dir-synced', os.O_RDONLY); os.fsync(fd)"
head -c 1M /dev/urandom >"$MNT/files/not-synced"
kill_mount
# The dead mount is left behind ("Transport endpoint is not connected"): condense mount
# detaches it by itself.
if start_mount; then ok "remount after kill -9 over the dead mount"; else fail "remount after kill -9" "$W/mount.log"; finish; fi
check "the fsynced file is there, byte-identical" cmp "$W/synced" "$MNT/files/synced"
check "the fsynced volume range is there" cmp -n 524288 "$W/synced" "$MNT/volumes/small"
check "the fsynced directory is there" test -d "$MNT/files/dir-synced"
check "earlier files survive the crash" bash -c "cd '$MNT/files/images' && sha256sum --quiet -c '$W/images.sha'"

# ---------------------------------------------------------------------------------------
# SIGTERM with a file open: detached at once, flushed, exits when the file closes.
echo "written while a file stays open" >"$MNT/files/open-file"
exec 3<"$MNT/files/open-file"
kill -TERM "$MOUNT_PID"
for _ in $(seq 1 50); do
    grep -q "detached" "$W/mount.log" && break
    sleep 0.1
done
if grep -q "detached" "$W/mount.log" && kill -0 "$MOUNT_PID" 2>/dev/null; then
    ok "SIGTERM with an open file: detached, daemon waits for the file"
else
    fail "SIGTERM with an open file" "$W/mount.log"
fi
read -r line <&3
exec 3<&-
if [ "$line" = "written while a file stays open" ]; then ok "the open file stays readable after detach"; else fail "read from the open file: '$line'"; fi
for _ in $(seq 1 50); do kill -0 "$MOUNT_PID" 2>/dev/null || break; sleep 0.1; done
if wait "$MOUNT_PID"; then ok "daemon exits 0 once the last file closed"; else fail "daemon exit after detach" "$W/mount.log"; fi
MOUNT_PID=
if start_mount --read-only; then
    check "read-only remount shows the file written before" grep -q "written while" "$MNT/files/open-file"
    if echo x 2>/dev/null >"$MNT/files/ro-test"; then fail "a write on a read-only mount succeeded"; else ok "a read-only mount refuses writes"; fi
    stop_mount || fail "unmount of the read-only mount" "$W/mount.log"
else
    fail "read-only remount" "$W/mount.log"
fi
# ---------------------------------------------------------------------------------------
# --writeback-cache: buffered writes (unaligned ones too, which make the kernel read the page
# first) to a files/ file and a volume file, fsync, kill -9 of the daemon: everything fsynced
# is in the pool after a remount without the cache.
cat >"$W/wb.py" <<'EOF'
import os, random, sys
mnt, ref = sys.argv[1], sys.argv[2]
rng = random.Random(13)
M = 1 << 20
data = bytearray(os.urandom(6 * M))
path = os.path.join(mnt, "files", "wb.dat")
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for off in range(0, 4 * M, 64 * 1024):
    os.pwrite(fd, data[off:off + 64 * 1024], off)
for _ in range(500):  # 4 KiB pages in random order, then odd sizes at odd offsets
    off = rng.randrange(0, 6 * M - 4096) // 4096 * 4096
    os.pwrite(fd, data[off:off + 4096], off)
for _ in range(200):
    off, n = rng.randrange(0, 6 * M - 10000), rng.randrange(1, 10000)
    data[off:off + n] = os.urandom(n)
    os.pwrite(fd, data[off:off + n], off)
os.pwrite(fd, data[4 * M:], 4 * M)  # the file grows to 6 MiB in the cache
os.fsync(fd)
os.close(fd)
if os.stat(path).st_size != 6 * M:
    sys.exit(f"size {os.stat(path).st_size}, expected {6 * M}")
vol = os.open(os.path.join(mnt, "volumes", "small"), os.O_RDWR)
os.pwrite(vol, data[:M // 2], 0)
os.pwrite(vol, data[M // 2 + 100:M // 2 + 300], 100)
os.fsync(vol)
os.close(vol)
with open(ref, "wb") as f:
    f.write(data)
EOF
wb_roundtrip() {
    local rc=0
    start_mount --writeback-cache || return 1
    if ! grep -q "writeback cache for files/" "$W/mount.log"; then
        echo "the mount did not report the writeback cache"
        rc=1
    fi
    python3 "$W/wb.py" "$MNT" "$W/wb.ref" || rc=1
    kill_mount
    [ "$rc" = 0 ] || return 1
    start_mount || return 1
    cmp "$W/wb.ref" "$MNT/files/wb.dat" || rc=1
    cmp -n 100 "$W/wb.ref" "$MNT/volumes/small" || rc=1
    cmp -i $((524288 + 100)):100 -n 200 "$W/wb.ref" "$MNT/volumes/small" || rc=1
    cmp -i 300:300 -n $((524288 - 300)) "$W/wb.ref" "$MNT/volumes/small" || rc=1
    rm -f "$MNT/files/wb.dat"
    stop_mount || rc=1
    return $rc
}
check "--writeback-cache: buffered writes + fsync survive kill -9 and read back after remount" wb_roundtrip
# --writeback-cache with the mount's dirty limit raised (20 % of the system's, not the kernel's
# 1 %): random 4 KiB pages over 64 MiB, many written twice, most of them still in the kernel
# at the fsync; kill -9 right after it; all of them are in the pool after a remount.
cat >"$W/wb-rand.py" <<'EOF'
import os, random, sys
path, ref = sys.argv[1], sys.argv[2]
rng = random.Random(26)
P, N = 4096, 16384  # 64 MiB of 4 KiB pages
data = bytearray(P * N)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, P * N)
for _ in range(2 * N):
    page = rng.randrange(N)
    block = rng.randbytes(P)
    data[page * P:(page + 1) * P] = block
    os.pwrite(fd, block, page * P)
os.fsync(fd)
os.close(fd)
with open(ref, "wb") as f:
    f.write(data)
EOF
wb_random_kill() {
    local rc=0 ratio
    start_mount --writeback-cache || return 1
    if [ "$IS_ROOT" = 1 ]; then
        ratio=$(cat "/sys/class/bdi/$(mountpoint -d "$MNT")/max_ratio")
        [ "$ratio" = 20 ] || { echo "the mount's max_ratio is $ratio, not 20"; rc=1; }
    fi
    python3 "$W/wb-rand.py" "$MNT/files/wb-rand.dat" "$W/wb-rand.ref" || rc=1
    kill_mount
    [ "$rc" = 0 ] || return 1
    start_mount || return 1
    cmp "$W/wb-rand.ref" "$MNT/files/wb-rand.dat" || rc=1
    rm -f "$MNT/files/wb-rand.dat" "$W/wb-rand.ref"
    stop_mount || rc=1
    return $rc
}
check "--writeback-cache: random 4 KiB buffered writes + fsync survive kill -9 (dirty limit raised)" wb_random_kill
# SIGTERM with a file open under --writeback-cache: what was written to it (not fsynced) is
# written back before the mount is detached, so it is in the pool even if the daemon is then
# killed. (On Linux 6.18 the kernel writes FUSE dirty pages back within a fraction of a second
# anyway, so there this passes without the syncfs too; it guards the promise, not the code.)
wb_detach() {
    local rc=0 before
    start_mount --writeback-cache || return 1
    head -c 3M /dev/urandom >"$W/wb-open.ref"
    exec 4>"$MNT/files/wb-open"
    cat "$W/wb-open.ref" >&4
    before=$(grep -c "detached" "$W/mount.log")
    kill -TERM "$MOUNT_PID"
    for _ in $(seq 1 50); do
        [ "$(grep -c "detached" "$W/mount.log")" -gt "$before" ] && break
        sleep 0.1
    done
    [ "$(grep -c "detached" "$W/mount.log")" -gt "$before" ] || { echo "not detached"; rc=1; }
    kill_mount
    exec 4>&-
    start_mount || return 1
    cmp "$W/wb-open.ref" "$MNT/files/wb-open" || rc=1
    rm -f "$MNT/files/wb-open"
    stop_mount || rc=1
    return $rc
}
check "--writeback-cache: SIGTERM with a file open writes its cache back before detaching" wb_detach
check "condense verify after all of it" condense verify

# ---------------------------------------------------------------------------------------
# Out of space: a pool on a 96 MiB tmpfs. Writes fail with ENOSPC, nothing written before is
# harmed, and after rm + condense gc the pool takes writes again.
nospace() {
    local fs=$W/small-fs pool=$W/small-fs/pool pid rc=0
    mkdir -p "$fs" "$W/mnt2"
    mount -t tmpfs -o size=96m tmpfs "$fs" || return 1
    INNER_MOUNTS+=("$fs")
    "$CONDENSE" --pool "$pool" init >/dev/null || return 1
    "$CONDENSE" --pool "$pool" mount "$W/mnt2" >>"$W/mount2.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do [ -d "$W/mnt2/files" ] && break; sleep 0.1; done
    head -c 10M /dev/urandom >"$W/keep"
    cp "$W/keep" "$W/mnt2/files/keep" && sync
    python3 - "$W/mnt2/files/big" <<'PY' || rc=1
import errno, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
try:
    for i in range(1000):
        os.write(fd, os.urandom(1 << 20))
        if i % 16 == 15:
            os.fsync(fd)
    sys.exit("1000 MiB written into a 96 MiB pool")
except OSError as e:
    if e.errno != errno.ENOSPC:
        sys.exit(f"expected ENOSPC, got {e}")
    print(f"ENOSPC after {i} MiB")
finally:
    os.close(fd)
PY
    cmp "$W/keep" "$W/mnt2/files/keep" || { echo "a file written before changed"; rc=1; }
    rm "$W/mnt2/files/big" || rc=1
    kill -TERM "$pid"
    wait "$pid" || { echo "unmount after ENOSPC failed"; rc=1; }
    "$CONDENSE" --pool "$pool" gc || rc=1
    "$CONDENSE" --pool "$pool" mount "$W/mnt2" >>"$W/mount2.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do [ -d "$W/mnt2/files" ] && break; sleep 0.1; done
    cmp "$W/keep" "$W/mnt2/files/keep" || { echo "the kept file changed after gc"; rc=1; }
    head -c 5M /dev/urandom >"$W/mnt2/files/after-gc" || { echo "no space after rm + gc"; rc=1; }
    kill -TERM "$pid"
    wait "$pid" || rc=1
    "$CONDENSE" --pool "$pool" verify || rc=1
    umount "$fs"
    return $rc
}
if [ "$IS_ROOT" = 1 ]; then
    check "out of space: ENOSPC, earlier files intact, writable again after rm + gc" nospace
else
    skip "out of space on a small tmpfs pool" "needs root"
fi

finish
