#!/usr/bin/env python3
"""Self time of `perf report --no-children --sort sym --stdio -g none` (on stdin) summed by
component of the write path: hashing, compression, copies, the network, the disk submission,
the metadata (dedup index, maps, journal), memory management, scheduling, other. Prints each
component's share and the largest symbols of "other" (bench/nbd/write-account.sh)."""
import re
import sys

# (component, substrings of a symbol); the first that matches wins
RULES = [
    ("hash (BLAKE3)", ["blake3"]),
    ("checksums (CRC32C of records)", ["crc32c", "crc_u64"]),
    ("compression (LZ4/zstd)", ["lz4", "zstd", "compress"]),
    ("metadata (index, maps, journal)", ["dedup_index", "chunk_table", "block_map", "journal",
                                         "metadata", "page_cache", "page_alloc", "attribution",
                                         "counters"]),
    ("copies (memcpy, user copies)", ["memcpy", "memmove", "copy_user", "copy_to_user",
                                      "copy_from_user", "_copy_to_iter", "_copy_from_iter",
                                      "rep_movs", "copy_page"]),
    ("memory (faults, alloc, zeroing)", ["clear_page", "page_fault", "alloc", "free", "malloc",
                                         "mmap", "munmap", "memset", "folio", "lru", "zap_",
                                         "do_anonymous", "handle_mm", "__handle"]),
    ("network (TCP)", ["tcp", "skb", "sock", "inet", "ip_", "net_", "netif", "__sys_recv",
                       "__sys_send", "recvmsg", "sendmsg", "loopback", "nf_", "napi", "softirq"]),
    ("disk submission (direct I/O, fs)", ["iomap", "blk_", "ext4", "xfs", "bio", "dio",
                                          "io_uring", "virtio", "vring", "submit", "jbd2", "gup_", "iowrite", "dd_insert",
                                          "pwrite", "fsync", "file_write", "generic_perform"]),
    ("engine, other (write steps, staging)", ["condense_"]),
    ("scheduling, locks, waits", ["schedule", "futex", "spin", "__lock", "mutex", "task_switch",
                                  "wake", "pick_next", "enqueue", "dequeue", "update_curr",
                                  "condvar", "park", "select_task", "idle", "syscall",
                                  "entry_SYSCALL", "do_syscall"]),
]

line_re = re.compile(r"^\s*([0-9.]+)%\s+\[([^\]]+)\]\s+(.*)$")
totals = {}
other = {}
for line in sys.stdin:
    m = line_re.match(line)
    if not m:
        continue
    pct, sym = float(m.group(1)), m.group(3).strip()
    low = sym.lower()
    for name, keys in RULES:
        if any(k in low for k in keys):
            totals[name] = totals.get(name, 0.0) + pct
            break
    else:
        totals["other"] = totals.get("other", 0.0) + pct
        other[sym] = other.get(sym, 0.0) + pct
for name, pct in sorted(totals.items(), key=lambda kv: -kv[1]):
    print(f"  {pct:6.1f} %  {name}")
top = sorted(other.items(), key=lambda kv: -kv[1])[:8]
if top:
    print("  largest of other: " + ", ".join(f"{s[:60]} {p:.1f} %" for s, p in top))
