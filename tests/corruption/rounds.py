#!/usr/bin/env python3
"""Seeded rounds of damage to copies of pools (tests/corruption/run.sh says what each round
checks). Prints one line per kind and a summary; exits 1 on the first broken promise (or,
with KEEP_GOING=1, after all rounds), with the commands' output, the seed and the round, so
that the round can be run again alone:

    rounds.py CONDENSE BASE WORK_DIR ROUNDS SEED [FIRST_ROUND]

BASE holds the three pools run.sh builds, each copied whole into WORK_DIR/round for a round
(BASE itself is never opened, and is checked unchanged at the end):

    BASE/pool                        a local pool
    BASE/cached, BASE/cached.cache   a local pool and its writethrough cache tier
    BASE/bucket, BASE/s3local        an S3 pool: its file:// bucket and its local directory

Absolute paths in a copy's text files (cache.conf, remote.conf, status.json) are rewritten to
name the copy; a copy in which any file still names BASE is broken.

The S3 pool has a second reference, computed once at the start: the pool as of its last
upload, i.e. a copy of BASE/bucket connected (`condense connect file://COPY --cache NEW_DIR`)
into a fresh directory, every volume and snapshot it has exported. `repair` of a pool on S3 is
not built: where an S3 round's pool does not open or verify is not clean, repair must refuse
with that said, and the documented fallback, connecting the round's copy of the bucket into a
new local directory, must open clean and read exactly as that reference.
"""

import atexit
import glob
import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

BS = 4096
LIMIT = 120  # seconds any one command may take: more is a hang

condense, base, work, rounds, seed = sys.argv[1:6]
first_round = int(sys.argv[6]) if len(sys.argv) > 6 else 0
rounds, seed = int(rounds), int(seed)
base, work = os.path.abspath(base), os.path.abspath(work)
# KEEP_GOING=1: run every round, list the broken ones at the end (still exit 1), instead of
# stopping at the first.
keep_going = os.environ.get("KEEP_GOING") == "1"


# Exported images are written, hashed and removed at once: on a tmpfs where there is one
# (removing a 24 MiB file from a busy disk costs more than exporting it).
os.makedirs(work, exist_ok=True)
scratch = tempfile.mkdtemp(
    prefix="condense-corruption-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else work
)
atexit.register(shutil.rmtree, scratch, True)


class Broken(Exception):
    pass


# Each setup: the directories of BASE a round copies, and the one that is --pool.
SETUPS = {
    "local": (["pool"], "pool"),
    "cached": (["cached", "cached.cache"], "cached"),
    "s3": (["bucket", "s3local"], "s3local"),
}

# (kind, setup, file): the file is a path under the setup's --pool directory (or its cache
# directory), "journal" (its journal-*.wal) or "segment" (one of its seg-*.dat, chosen by the
# round's seed; in the S3 local directory: the staged segments, not yet uploaded).
KINDS = [
    ("superblock", "local", "superblock"),
    ("cache tier: cache.dat", "cached", "../cached.cache/cache.dat"),
    ("superblock.copy", "local", "superblock.copy"),
    ("s3 local: pool/meta.dat", "s3", "pool/meta.dat"),
    ("checkpoint", "local", "checkpoint"),
    ("s3 local: journal", "s3", "journal"),
    ("checkpoint.copy", "local", "checkpoint.copy"),
    ("cache tier: cache.idx", "cached", "../cached.cache/cache.idx"),
    ("journal", "local", "journal"),
    ("s3 local: cache.dat", "s3", "cache.dat"),
    ("meta.dat", "local", "meta.dat"),
    ("s3 local: segment (staged)", "s3", "segment"),
    ("segment", "local", "segment"),
    ("s3 local: cache.idx", "s3", "cache.idx"),
    ("segment", "local", "segment"),
    ("s3 local: pool/meta.synced", "s3", "pool/meta.synced"),
    ("dedup.idx", "local", "dedup.idx"),
]
ROOT_KINDS = {"superblock", "superblock.copy", "checkpoint", "checkpoint.copy"}
# Copies of what the pool (or the bucket) holds: damage to them must lose nothing, and the
# pool must open clean (a damaged cache entry is a miss, read again from the segment).
CACHE_FILES = {"cache.dat", "cache.idx"}
# Advisory files: the dedup index saved at the last clean close. Damage must lose nothing,
# and the next write (which loads the index, or builds it when the file is refused) must
# deduplicate as if the file were whole.
ADVISORY_FILES = {"dedup.idx"}
# The S3 local directory's files of which the bucket holds the authoritative copy: nothing may
# be lost. The pool must open (mending what it must from the bucket) and verify clean, and
# every export must be the reference.
BUCKET_HAS_COPY = {"pool/meta.dat", "pool/meta.synced", "cache.dat", "cache.idx"}
# What `repair` of a pool on S3 says (it is not built): connect the bucket into a new local
# directory instead, which opens the pool as of its last checkpoint upload.
S3_REPAIR_REFUSAL = "repair of a pool on S3 is not built yet"


def run(pool, *args):
    """Run condense on `pool`; (exit status, stdout, stderr). A panic or a hang is broken."""
    try:
        p = subprocess.run(
            [condense, "--pool", pool, *args],
            capture_output=True,
            text=True,
            timeout=LIMIT,
        )
    except subprocess.TimeoutExpired:
        raise Broken(f"condense {' '.join(args)} did not end within {LIMIT} s (a hang)")
    if "panicked" in p.stderr or p.returncode not in (0, 1, 2, 3):
        raise Broken(
            f"condense {' '.join(args)} crashed (exit {p.returncode}):\n{p.stderr[-3000:]}"
        )
    return p.returncode, p.stdout, p.stderr


def volumes(pool, what="the undamaged pool"):
    rc, out, err = run(pool, "volume", "list", "--all", "--json")
    if rc != 0:
        raise Broken(f"volume list of {what} failed: {err}")
    names = [v["name"] for v in json.loads(out)]
    rc, out, err = run(pool, "snapshot", "list", "--json")
    if rc != 0:
        raise Broken(f"snapshot list of {what} failed: {err}")
    names += [s["name"] for s in json.loads(out)["snapshots"]]
    return sorted(names)


def block_hashes(path):
    out = []
    with open(path, "rb") as f:
        while True:
            b = f.read(BS)
            if not b:
                return out
            out.append(hashlib.sha1(b).digest())


def export(pool, name, dest, *extra):
    """The volume's block hashes, or None if export failed (an error, said)."""
    if os.path.exists(dest):
        os.remove(dest)
    rc, _, err = run(pool, "export", name, dest, "--force", *extra)
    if rc != 0:
        return None, err
    hashes = block_hashes(dest)
    os.remove(dest)
    return hashes, err


def journal_batches_end(path):
    """Offset where the journal's last batch starts (damage past it looks like a torn tail)."""
    data = open(path, "rb").read()
    pos, last = 64, 64
    while pos + 24 <= len(data) and data[pos : pos + 4] == b"JBAT":
        (n,) = struct.unpack_from("<I", data, pos + 4)
        last, pos = pos, pos + 24 + n
    return last


def files_under(root):
    for d, _, fs in os.walk(root):
        for f in fs:
            yield os.path.join(d, f)


def copy_setup(setup, root):
    """Copy the setup's directories of BASE into `root`, rewrite the absolute paths that name
    BASE in their files to name the copy; the copy's --pool directory."""
    dirs, pool_dir = SETUPS[setup]
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    for d in dirs:
        shutil.copytree(os.path.join(base, d), os.path.join(root, d), symlinks=True)
    old, new = (base + "/").encode(), (root + "/").encode()
    for path in files_under(root):
        if not os.path.isfile(path):
            continue
        data = open(path, "rb").read()
        if old not in data:
            continue
        if len(data) > 65536:
            raise Broken(f"{path} ({len(data)} bytes) names the base directory {base}")
        open(path, "wb").write(data.replace(old, new))
    return os.path.join(root, pool_dir)


def still_names_base(root):
    old = (base + "/").encode()
    return [p for p in files_under(root) if os.path.isfile(p) and old in open(p, "rb").read()]


def damage(rng, pool, kind, file):
    """Damage one file of `pool` (or its cache directory); says what it did."""
    if file == "journal":
        path = glob.glob(os.path.join(pool, "journal-*.wal"))[0]
    elif file == "segment":
        path = rng.choice(sorted(glob.glob(os.path.join(pool, "seg-*.dat"))))
    else:
        path = os.path.normpath(os.path.join(pool, file))
    name = os.path.relpath(path, os.path.dirname(pool))
    data = bytearray(open(path, "rb").read())
    end = len(data)
    if file == "journal":
        end = journal_batches_end(path)
    sectors = end // BS
    if rng.random() < 0.6 or sectors == 0 or kind in ROOT_KINDS and len(data) < BS:
        if kind in ROOT_KINDS and rng.random() < 0.3:
            data[:] = bytes(len(data))  # the whole (short) file's one sector, zeroed
            what = f"{name}: zeroed ({len(data)} bytes)"
        else:
            at = sorted(rng.randrange(end) for _ in range(8))
            for a in at:
                data[a] ^= 1 << rng.randrange(8)
            what = f"{name}: 8 bits flipped at {at}"
    else:
        s = rng.randrange(sectors)
        data[s * BS : (s + 1) * BS] = bytes(BS)
        what = f"{name}: 4 KiB sector {s} zeroed"
    open(path, "wb").write(data)
    return what


def lost_blocks(report):
    lost = {}
    for r in report["lost"]:
        lost.setdefault(r["volume"], set()).update(
            range(r["first_block"], r["first_block"] + r["blocks"])
        )
    return lost


def cache_stats(pool):
    rc, out, err = run(pool, "cache", "stats", "--json")
    if rc != 0:
        raise Broken(f"cache stats failed: {err[-1000:]}")
    return json.loads(out)


def serve_and_read(pool, root, reference, log):
    """Serve the pool (a writable open: reads go through its cache tier) and read every
    volume it serves over NBD with qemu-img; each must read as the reference. Then a clean
    stop. Returns the cache hits and the damaged cache entries detected meanwhile."""
    sock = os.path.join(root, "nbd.sock")
    serve_log = os.path.join(root, "serve.log")
    with open(serve_log, "w") as f:
        p = subprocess.Popen(
            [condense, "--pool", pool, "serve", "--socket", sock], stdout=f, stderr=f
        )
    served = []
    try:
        # Ready: both sockets there and the volumes listed in its log.
        deadline = time.time() + 20
        while not (
            os.path.exists(sock)
            and os.path.exists(os.path.join(pool, "control.sock"))
            and (served := [n for n in re.findall(r"nbd\+unix:///([^?\s]+)\?socket=",
                                                 open(serve_log).read()) if n in reference])
        ):
            if p.poll() is not None or time.time() > deadline:
                raise Broken(
                    "serve did not start and list the volumes (the pool must open with a"
                    " damaged cache file):\n" + "\n".join(log) + "\n" + open(serve_log).read()[-3000:]
                )
            time.sleep(0.05)
        before = cache_stats(pool)  # through the control socket: as the open found them
        dest = os.path.join(scratch, "nbd.raw")
        for n in served:
            try:
                q = subprocess.run(
                    ["qemu-img", "convert", "-f", "raw", "-O", "raw",
                     f"nbd+unix:///{n}?socket={sock}", dest],
                    capture_output=True, text=True, timeout=LIMIT,
                )
            except subprocess.TimeoutExpired:
                raise Broken(f"reading {n} over NBD did not end within {LIMIT} s (a hang)\n" + "\n".join(log))
            if q.returncode != 0:
                raise Broken(
                    f"reading {n} over NBD failed (a damaged cache entry must be a miss):\n"
                    + q.stderr[-1500:] + "\n" + "\n".join(log) + "\n" + open(serve_log).read()[-3000:]
                )
            got = block_hashes(dest)
            os.remove(dest)
            if got != reference[n]:
                bad = [i for i, (a, b) in enumerate(zip(got, reference[n])) if a != b]
                raise Broken(
                    f"{n} read over NBD through the cache tier: wrong data in blocks {bad[:10]}"
                    f" (length {len(got)} vs {len(reference[n])}):\n" + "\n".join(log)
                )
        after = cache_stats(pool)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise Broken(f"serve did not stop within {LIMIT} s of SIGTERM (a hang)\n" + "\n".join(log))
    out = open(serve_log).read()
    if "panicked" in out or rc != 0:
        raise Broken(f"serve ended with exit {rc}:\n{out[-3000:]}\n" + "\n".join(log))
    hits = after["cache_hits"] - before["cache_hits"]
    corrupt = after["cache_corrupt_entries"] - before["cache_corrupt_entries"]
    log.append(f"serve: read {', '.join(served)} over NBD as the reference: {hits} cache hits, "
               f"{corrupt} damaged cache entries detected")
    return hits, corrupt


def connect_bucket(bucket, local):
    """The documented fallback of an S3 pool: connect its bucket into a new local directory
    (the pool as of its last checkpoint upload). (exit status, output)."""
    rc, out, err = run(local, "connect", "file://" + bucket, "--cache", local, "--cache-size", "1G")
    return rc, (out + err).strip()[-1500:]


def differing_blocks(got, reference):
    """Blocks of the volumes of `reference` that `got` reads otherwise (a missing volume: all)."""
    n = 0
    for name, ref in reference.items():
        g = got.get(name) or []
        n += sum(a != b for a, b in zip(g, ref)) + abs(len(ref) - len(g))
    return n


def reopen_from_bucket(root, uploaded, live, log):
    """The round's S3 pool did not open or verify clean, and repair refused: connect the round's
    copy of the bucket into a new local directory; it must verify clean and read exactly as the
    pool as of its last upload (`uploaded`). The blocks that differ from the live pool."""
    bucket, fallback = os.path.join(root, "bucket"), os.path.join(root, "fallback")
    rc, out = connect_bucket(bucket, fallback)
    log.append(f"fallback: connect file://{bucket} --cache {fallback}: exit {rc}; {out[-300:]}")
    if rc != 0:
        raise Broken("the documented fallback, connecting the bucket into a new local directory,"
                     " failed:\n" + "\n".join(log))
    rc, out, err = run(fallback, "verify")
    log.append(f"fallback: verify: exit {rc}; {err.strip()[-300:]}")
    if rc != 0:
        raise Broken("the pool connected from the bucket does not verify clean:\n" + "\n".join(log)
                     + "\n" + out[-1500:])
    ref, ref_names = uploaded
    names = volumes(fallback, "the pool connected from the bucket")
    if names != ref_names:
        raise Broken(f"the pool connected from the bucket has volumes and snapshots {names}, as of"
                     f" its last upload it had {ref_names}:\n" + "\n".join(log))
    dest = os.path.join(scratch, "export.raw")
    got = {}
    for n in names:
        got[n], err = export(fallback, n, dest)
        if got[n] is None:
            raise Broken(f"export of {n} from the pool connected from the bucket failed:"
                         f" {err[-1000:]}\n" + "\n".join(log))
        if got[n] != ref[n]:
            bad = [i for i, (a, b) in enumerate(zip(got[n], ref[n])) if a != b]
            raise Broken(
                f"export of {n} from the pool connected from the bucket differs from the pool as"
                f" of its last upload in blocks {bad[:10]} (length {len(got[n])} vs"
                f" {len(ref[n])}):\n" + "\n".join(log))
    if open(os.path.join(fallback, "remote.conf")).read().find("file://" + bucket + "\n") < 0:
        raise Broken(f"{fallback}/remote.conf does not name the round's bucket copy {bucket}:\n"
                     + "\n".join(log))
    differ = differing_blocks(got, live)
    log.append(f"fallback: clean, every volume as of the last upload; {differ} blocks differ from the live pool")
    return differ


def write_after_advisory_damage(pool, name, want, rc, log):
    """A damaged advisory file: verify clean, and importing volume `name` again (the first
    write, which needs the dedup index) stores no new chunk and reads back byte-identical."""
    if rc != 0:
        raise Broken("a damaged dedup.idx holds nothing the pool needs: verify must be clean:\n"
                     + "\n".join(log))
    image = os.path.join(scratch, "again.raw")
    erc, _, err = run(pool, "export", name, image, "--force")
    if erc != 0:
        raise Broken(f"export of {name}: {err[-600:]}\n" + "\n".join(log))
    chunks = lambda: json.loads(run(pool, "stats", "--json")[1])["unique_chunks"]
    before = chunks()
    irc, _, err = run(pool, "import", "--format", "raw", image, "--name", "again")
    os.remove(image)
    log.append(f"import of {name} again: exit {irc}; {err.strip()[-300:]}")
    if irc != 0 or chunks() != before:
        raise Broken(f"importing {name} again after a damaged dedup.idx: exit {irc}, unique chunks"
                     f" {before} -> {chunks()} (every block must deduplicate)\n" + "\n".join(log))
    got, err = export(pool, "again", os.path.join(scratch, "export.raw"))
    if got != want:
        raise Broken(f"the re-imported {name} does not read back as written: {err[-300:]}\n"
                     + "\n".join(log))
    vrc, _, err = run(pool, "verify")
    if vrc != 0:
        raise Broken("verify after the import is not clean:\n" + "\n".join(log) + err[-1000:])


def one_round(r, setups):
    rng = random.Random(seed * 1_000_003 + r)
    kind, setup, file = KINDS[r % len(KINDS)]
    reference, names = setups[setup]
    uploaded = setups.get("s3 as of its last upload")
    root = os.path.join(work, "round")
    pool = copy_setup(setup, root)
    what = damage(rng, pool, kind, file)
    log = [f"round {r} ({setup}): {what}"]
    cache_file = os.path.basename(file) in CACHE_FILES

    hits = corrupt = 0
    if setup == "cached":
        # First, before anything rewrites the index: reads through the damaged cache.
        hits, corrupt = serve_and_read(pool, root, reference, log)
    elif cache_file:
        # The counters as the first open finds them in the damaged index (verify, the
        # exports, and an S3 pool's reads go through the cache tier).
        before = cache_stats(pool)

    rc, out, err = run(pool, "verify")
    log.append(f"verify: exit {rc}; {err.strip()[-400:]}")
    if kind in ROOT_KINDS:
        if rc != 0:
            raise Broken("one damaged copy of the superblock or root must lose nothing:\n" + "\n".join(log))
        if "opened with" not in err:
            raise Broken("open did not say which copy it used:\n" + "\n".join(log))
    if cache_file and rc != 0:
        raise Broken(
            "a damaged cache file holds only copies: the pool must open and verify clean:\n"
            + "\n".join(log) + "\n" + out[-1500:]
        )
    if setup == "s3" and file in BUCKET_HAS_COPY and rc != 0:
        raise Broken(
            f"the bucket holds a good copy of {file}: the pool must open (mending it from the"
            " bucket) and verify clean, losing nothing:\n" + "\n".join(log) + "\n" + out[-1500:]
        )
    if rc not in (0, 1, 3):
        raise Broken("verify: unexpected exit\n" + "\n".join(log))
    dest = os.path.join(scratch, "export.raw")
    first = {}
    for n in names:
        got, err = first[n] = export(pool, n, dest)
        if got is None and cache_file:
            raise Broken(f"export of {n} failed with only a cache file damaged: {err[-1000:]}\n" + "\n".join(log))
        if got is not None and got != reference[n]:
            bad = [i for i, (a, b) in enumerate(zip(got, reference[n])) if a != b]
            raise Broken(
                f"export of {n} succeeded with wrong data in blocks {bad[:10]}:\n" + "\n".join(log)
            )
    if os.path.basename(file) in ADVISORY_FILES:
        write_after_advisory_damage(pool, names[0], reference[names[0]], rc, log)
    lost = {}
    unknown = False
    differ = None  # blocks that differ from the live pool after the S3 fallback
    # Lost blocks fail to read after repair (the default) or read as zeros (asked for).
    as_zeros = rng.random() < 0.3
    if rc != 0 and setup == "s3":
        # Not built for a pool on S3: repair must say so (exit 1) and name the fallback.
        rrc, out, err = run(pool, "repair", "--json", *(["--lost-as-zeros"] if as_zeros else []))
        log.append(f"repair: exit {rrc}; {err.strip()[-600:]}")
        if rrc != 1 or S3_REPAIR_REFUSAL not in err or "condense connect" not in err:
            raise Broken(f"repair of an S3 pool must fail (exit 1) saying {S3_REPAIR_REFUSAL!r}"
                         " and naming `condense connect`:\n" + "\n".join(log) + "\n" + out[-1000:])
        differ = reopen_from_bucket(root, uploaded, reference, log)
    elif rc != 0:
        rrc, out, err = run(pool, "repair", "--json", *(["--lost-as-zeros"] if as_zeros else []))
        log.append(f"repair: exit {rrc}; {err.strip()[-400:]}")
        if rrc != 0:
            raise Broken("repair failed:\n" + "\n".join(log) + "\n" + out[-2000:])
        report = json.loads(out)
        lost = lost_blocks(report)
        # Damaged journal batches: repair names the batches; which blocks they wrote is
        # decoded from bytes that failed their checksum (best effort: a flipped bit in a
        # record can name other blocks), or is unknown where nothing decodes (a zeroed
        # sector). Those blocks keep older content.
        unknown = bool(report["journal"]["damaged"])
        log.append(f"repair: {report['lost_blocks']} blocks lost, {report['damaged_chunks']} damaged chunks")
        vrc, out, err = run(pool, "verify", "--json")
        if vrc != 0:
            raise Broken("verify after repair is not clean:\n" + "\n".join(log) + "\n" + err[-2000:])
        # What was lost stays listed (the pool's damage history) until cleared.
        kept = lost_blocks({"lost": [l for d in json.loads(out)["accepted_damage"] for l in d["lost"]]})
        if kept != lost:
            raise Broken(f"verify lists other accepted damage than repair reported: {kept} vs {lost}\n" + "\n".join(log))
    zero = hashlib.sha1(bytes(BS)).digest()
    for n in names if differ is None else []:
        gone = lost.get(n, set())
        # Without a repair the pool is as the first exports found it: they are the answer.
        got, err = first[n] if rc == 0 else export(pool, n, dest)
        if got is None and (as_zeros or not gone or "was lost" not in err):
            raise Broken(f"export of {n} after repair failed: {err[-1000:]}\n" + "\n".join(log))
        if got is not None and gone and not as_zeros and not unknown:
            raise Broken(f"export of {n} read its lost blocks {sorted(gone)[:10]} without an error\n" + "\n".join(log))
        if got is None:
            # What is left, with zeros where the blocks were lost, and how many it says.
            got, err = export(pool, n, dest, "--lost-as-zeros")
            if got is None:
                raise Broken(f"export --lost-as-zeros of {n} failed: {err[-1000:]}\n" + "\n".join(log))
            said = [int(m) for m in re.findall(r"(\d+) blocks of \S+ were lost", err)]
            if not unknown and said != [len(gone)]:
                raise Broken(f"export --lost-as-zeros of {n} said {err.strip()!r}, {len(gone)} blocks were lost\n" + "\n".join(log))
        if not unknown and any(got[i] != zero for i in gone if i < len(got)):
            raise Broken(f"{n}: a block reported lost reads other data than zeros\n" + "\n".join(log))
        bad = [i for i, (a, b) in enumerate(zip(got, reference[n])) if a != b and i not in gone]
        if len(got) != len(reference[n]) or bad and not unknown:
            raise Broken(
                f"{n} after repair differs outside the lost ranges, blocks {bad[:10]}:\n"
                + "\n".join(log)
            )
    if kind in ROOT_KINDS and lost:
        raise Broken("a damaged copy of the superblock or root lost blocks:\n" + "\n".join(log))
    if cache_file and setup != "cached":
        after = cache_stats(pool)
        hits = after["cache_hits"] - before["cache_hits"]
        corrupt = after["cache_corrupt_entries"] - before["cache_corrupt_entries"]
    left = still_names_base(root)
    if left:
        raise Broken(f"files of the round's copy name the base directory: {left}\n" + "\n".join(log))
    shutil.rmtree(root, ignore_errors=True)
    return kind, setup, file, rc, sum(len(v) for v in lost.values()), unknown, corrupt, hits, differ


def base_state():
    """Size and mtime of every file of BASE (the rounds must never touch it)."""
    return {
        p: (os.stat(p).st_size, os.stat(p).st_mtime_ns)
        for p in files_under(base)
        if not os.path.basename(p).endswith(".sock")
    }


def base_digest():
    h = hashlib.sha1()
    for p in sorted(files_under(base)):
        if os.path.isfile(p):
            h.update(p.encode() + b"\0" + open(p, "rb").read())
    return h.hexdigest()


def main():
    os.makedirs(work, exist_ok=True)
    state, digest = base_state(), base_digest()
    setups = {}
    for setup in sorted({s for _, s, _ in KINDS}):
        ref_root = os.path.join(work, "reference")
        ref_pool = copy_setup(setup, ref_root)
        rc, out, err = run(ref_pool, "verify")
        if rc != 0:
            print(f"the undamaged {setup} pool does not verify clean (exit {rc}): {err[-2000:]}")
            return 1
        names = volumes(ref_pool)
        reference = {}
        for n in names:
            got, err = export(ref_pool, n, os.path.join(scratch, "export.raw"))
            if got is None:
                print(f"cannot export {n} from the undamaged {setup} pool: {err}")
                return 1
            reference[n] = got
        shutil.rmtree(ref_root)
        setups[setup] = (reference, names)
        print(f"{setup} pool: volumes and snapshots {', '.join(names)}")
    if "s3" in setups:
        # The S3 pool as of its last upload: a copy of its bucket connected into a new directory.
        ref_root = os.path.join(work, "reference")
        shutil.rmtree(ref_root, ignore_errors=True)
        os.makedirs(ref_root)
        shutil.copytree(os.path.join(base, "bucket"), os.path.join(ref_root, "bucket"), symlinks=True)
        local = os.path.join(ref_root, "local")
        rc, out = connect_bucket(os.path.join(ref_root, "bucket"), local)
        if rc != 0:
            print(f"cannot connect a copy of the undamaged bucket (exit {rc}): {out}")
            return 1
        rc, out, err = run(local, "verify")
        if rc != 0:
            print(f"the undamaged bucket, connected, does not verify clean (exit {rc}): {err[-2000:]}")
            return 1
        names = volumes(local, "the undamaged bucket, connected")
        reference = {}
        for n in names:
            got, err = export(local, n, os.path.join(scratch, "export.raw"))
            if got is None:
                print(f"cannot export {n} from the undamaged bucket, connected: {err}")
                return 1
            reference[n] = got
        if still_names_base(ref_root):
            print(f"files of the connected copy of the bucket name the base: {still_names_base(ref_root)}")
            return 1
        shutil.rmtree(ref_root)
        setups["s3 as of its last upload"] = (reference, names)
        print(f"s3 pool as of its last upload (a copy of the bucket connected): volumes and snapshots"
              f" {', '.join(names)}; {differing_blocks(reference, setups['s3'][0])} blocks differ"
              " from the live pool")
    print(f"seed {seed}, rounds {first_round}..{first_round + rounds - 1}")
    tally, broken = {}, {}
    for r in range(first_round, first_round + rounds):
        try:
            kind, setup, file, rc, lost, unknown, corrupt, hits, differ = one_round(r, setups)
            if base_state() != state:
                raise Broken(f"round {r} changed files of the base directory {base}")
        except Broken as e:
            print(f"BROKEN (seed {seed}, round {r}; rerun: rounds.py ... 1 {seed} {r}):\n{e}")
            if not keep_going or base_state() != state:
                return 1
            broken.setdefault(KINDS[r % len(KINDS)][0], []).append(r)
            continue
        t = tally.setdefault(kind, [setup, file, 0, 0, 0, 0, 0, 0, 0, []])
        t[2] += 1
        t[3] += rc == 0
        t[4] += rc != 0 and differ is None
        t[5] += lost
        t[6] += unknown
        t[7] += corrupt
        t[8] += hits
        if differ is not None:
            t[9].append(differ)
    if base_digest() != digest:
        print(f"BROKEN: the rounds changed the contents of the base directory {base}")
        return 1
    for kind, (setup, file, n, clean, repaired, lost, unknown, corrupt, hits, differ) in sorted(tally.items()):
        span = f"{min(differ)}" if differ and min(differ) == max(differ) else f"{min(differ or [0])}..{max(differ or [0])}"
        print(
            f"{kind}: {n} rounds, {clean} clean at once (or mended at open), "
            + (f"{repaired} repaired, {lost} blocks lost in all" if not differ or repaired else "")
            + (f", " if differ and repaired else "")
            + (f"{len(differ)} repair not built for S3: reopened from the bucket as of its last"
               f" upload, {span} blocks differ from the live pool" if differ else "")
            + (f", {unknown} with damaged journal batches (named; their blocks best effort)" if unknown else "")
            + (f", {corrupt} damaged cache entries detected (dropped, read again), {hits} hits"
               if os.path.basename(file) in CACHE_FILES else "")
            + (" (the bucket holds a good copy: nothing lost)" if setup == "s3" and file in BUCKET_HAS_COPY else "")
        )
    if broken:
        for kind, rs in sorted(broken.items()):
            print(f"{kind}: BROKEN in {len(rs)} rounds: {' '.join(map(str, rs))}")
        print(f"{rounds} rounds: {sum(map(len, broken.values()))} broken (KEEP_GOING=1 ran them all)")
        return 1
    print(f"{rounds} rounds: no panic, no hang, no wrong data without an error")
    return 0


sys.exit(main())
