#!/usr/bin/env bash
# A small Linux guest that boots in seconds under TCG, for tests/libvirt: Debian's kernel, an
# initrd that loads the virtio and ext4 modules and mounts /dev/vda, and a root file system on
# that disk holding BusyBox, whose init writes a boot marker to the disk and then shows
# "condense-guest login:" on the serial console (ttyS0). Everything comes from two Debian
# packages (linux-image-amd64's kernel, busybox-static) fetched with `apt-get download` from the
# mirror apt already uses; nothing is installed on the host and no root is needed.
#
#   scripts/build-guest-image.sh OUT_DIR [DISK_SIZE]   # DISK_SIZE for truncate, default 256M
#
# Output: OUT_DIR/vmlinuz, OUT_DIR/initrd.img (boot them directly: libvirt <kernel>/<initrd>,
# qemu -kernel/-initrd, with "console=ttyS0"), OUT_DIR/root.raw (a sparse raw disk: ext4 on the
# whole disk, no partition table, no journal, so that what the guest wrote can be read back with
# debugfs after a hard power-off). The guest's /sbin/init (BusyBox) runs /etc/init.d/rcS, which
# appends "boot BOOT_ID" to /boot-marker, syncs, prints the same line on the console, and prints
# the MD5 of the first 4 MiB of every other disk (/dev/vdb...) there too.
set -euo pipefail

out=${1:?usage: build-guest-image.sh OUT_DIR [DISK_SIZE]}
size=${2:-256M}
die() { echo "build-guest-image.sh: $*" >&2; exit 1; }
for t in apt-get apt-cache dpkg-deb depmod modprobe mkfs.ext4 gzip; do
  command -v "$t" >/dev/null || die "missing $t: run scripts/install-deps.sh"
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$out/build
rm -rf "$work" && mkdir -p "$work/debs"

# The kernel package linux-image-amd64 points at, and BusyBox (static: no libraries to copy).
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$kpkg" ] || die "apt knows no linux-image-amd64 (run apt-get update)"
(cd "$work/debs" && apt-get download -q "$kpkg" busybox-static >/dev/null 2>"$work/download.log") ||
  die "apt-get download $kpkg busybox-static failed: $(tail -3 "$work/download.log")"
dpkg-deb -x "$work"/debs/busybox-static_*.deb "$work/busybox"
bb=$work/busybox/bin/busybox
# Only the kernel and the modules the initrd loads (the package holds ~400 MB of modules).
kver=${kpkg#linux-image-}
dpkg-deb --fsys-tarfile "$work"/debs/linux-image-*.deb |
  tar -x -C "$work" --wildcards "./boot/vmlinuz-$kver" "./lib/modules/$kver/kernel/drivers/virtio/*" \
    "./lib/modules/$kver/kernel/drivers/block/virtio_blk.ko" "./lib/modules/$kver/kernel/fs/*" \
    "./lib/modules/$kver/kernel/crypto/*" "./lib/modules/$kver/kernel/arch/x86/crypto/*" \
    "./lib/modules/$kver/kernel/lib/*" "./lib/modules/$kver/modules.*"
cp "$work/boot/vmlinuz-$kver" "$out/vmlinuz"

# The initrd: BusyBox, the modules in load order, and /init, which mounts /dev/vda as the root.
initrd=$work/initrd
mkdir -p "$initrd"/{bin,dev,proc,sys,root,lib/modules}
cp "$bb" "$initrd/bin/busybox"
depmod -b "$work" "$kver"
modprobe -d "$work" -S "$kver" --show-depends -a virtio_pci virtio_blk ext4 crc32c_generic |
  awk '$1 == "insmod" && !seen[$2]++ {print $2}' >"$work/modules"
while read -r ko; do
  cp "$ko" "$initrd/lib/modules/"
  basename "$ko" >>"$initrd/lib/modules/order"
done <"$work/modules"
cat >"$initrd/init" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t devtmpfs dev /dev
mount -t proc proc /proc
# A module the CPU cannot use (crc32c-intel without SSE4.2 under TCG) fails; the next serves.
for m in $(cat /lib/modules/order); do insmod "/lib/modules/$m" 2>/dev/null; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
if ! mount -t ext4 /dev/vda /root; then
  echo "initrd: cannot mount /dev/vda as the root file system; powering off"
  poweroff -f
fi
umount /proc
mount --move /dev /root/dev
exec switch_root /root /sbin/init
EOF
chmod 755 "$initrd/init"
(cd "$initrd" && find . | "$bb" cpio -o -H newc 2>/dev/null | gzip -1) >"$out/initrd.img"

# The root file system on the disk.
root=$work/root
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc/init.d,dev,proc,sys,tmp,root}
cp "$bb" "$root/bin/busybox"
"$bb" --list-full | while read -r applet; do
  [ -e "$root/$applet" ] || ln -s /bin/busybox "$root/$applet"
done
echo condense-guest >"$root/etc/hostname"
printf 'root::0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
printf 'Condense test guest (scripts/build-guest-image.sh)\n\n' >"$root/etc/issue"
cat >"$root/etc/inittab" <<'EOF'
::sysinit:/etc/init.d/rcS
ttyS0::respawn:/sbin/getty -L 115200 ttyS0 vt100
::shutdown:/bin/mount -o remount,ro /
EOF
cat >"$root/etc/init.d/rcS" <<'EOF'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -o remount,rw /
hostname -F /etc/hostname
line="boot $(cat /proc/sys/kernel/random/boot_id)"
echo "$line" >>/boot-marker
sync
echo "condense-guest: wrote \"$line\" to /boot-marker"
for d in /dev/vd[b-z]; do
  [ -b "$d" ] && echo "condense-guest: $d first 4 MiB md5 $(dd if="$d" bs=1M count=4 2>/dev/null | md5sum | cut -d' ' -f1)"
done
EOF
chmod 755 "$root/etc/init.d/rcS"
rm -f "$out/root.raw"
truncate -s "$size" "$out/root.raw"
mkfs.ext4 -q -F -L condense-guest -O ^has_journal -E nodiscard -d "$root" "$out/root.raw"
rm -rf "$work"
echo "guest in $out: vmlinuz ($kpkg), initrd.img, root.raw ($size, ext4 on /dev/vda)"
