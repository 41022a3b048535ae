#!/usr/bin/env python3
"""Seeded rounds of damage to copies of a pool (tests/corruption/run.sh says what each round
checks). Prints one line per round and a summary; exits 1 on the first broken promise, with
the commands' output, the seed and the round, so that the round can be run again alone:

    rounds.py CONDENSE POOL WORK_DIR ROUNDS SEED [FIRST_ROUND]
"""

import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys

BS = 4096
LIMIT = 120  # seconds any one command may take: more is a hang

condense, base, work, rounds, seed = sys.argv[1:6]
first_round = int(sys.argv[6]) if len(sys.argv) > 6 else 0
rounds, seed = int(rounds), int(seed)


class Broken(Exception):
    pass


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


def volumes(pool):
    rc, out, err = run(pool, "volume", "list", "--all", "--json")
    if rc != 0:
        raise Broken(f"volume list of the undamaged pool failed: {err}")
    names = [v["name"] for v in json.loads(out)]
    rc, out, err = run(pool, "snapshot", "list", "--json")
    if rc != 0:
        raise Broken(f"snapshot list of the undamaged pool failed: {err}")
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


KINDS = [
    "superblock",
    "superblock.copy",
    "checkpoint",
    "checkpoint.copy",
    "journal",
    "meta.dat",
    "segment",
    "segment",
]
ROOT_KINDS = {"superblock", "superblock.copy", "checkpoint", "checkpoint.copy"}


def damage(rng, pool, kind):
    """Damage one file of `pool`; says what it did."""
    files = sorted(os.listdir(pool))
    if kind == "journal":
        name = next(f for f in files if f.startswith("journal-"))
    elif kind == "segment":
        name = rng.choice([f for f in files if f.startswith("seg-") and f.endswith(".dat")])
    else:
        name = kind
    path = os.path.join(pool, name)
    data = bytearray(open(path, "rb").read())
    end = len(data)
    if kind == "journal":
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


def one_round(r, reference, names):
    rng = random.Random(seed * 1_000_003 + r)
    pool = os.path.join(work, "pool")
    shutil.rmtree(pool, ignore_errors=True)
    shutil.copytree(base, pool)
    kind = KINDS[r % len(KINDS)]
    what = damage(rng, pool, kind)
    log = [f"round {r}: {what}"]

    rc, out, err = run(pool, "verify")
    log.append(f"verify: exit {rc}; {err.strip()[-400:]}")
    if kind in ROOT_KINDS:
        if rc != 0:
            raise Broken("one damaged copy of the superblock or root must lose nothing:\n" + "\n".join(log))
        if "opened with" not in err:
            raise Broken("open did not say which copy it used:\n" + "\n".join(log))
    if rc not in (0, 1, 3):
        raise Broken("verify: unexpected exit\n" + "\n".join(log))
    dest = os.path.join(work, "export.raw")
    for n in names:
        got, _ = export(pool, n, dest)
        if got is not None and got != reference[n]:
            bad = [i for i, (a, b) in enumerate(zip(got, reference[n])) if a != b]
            raise Broken(
                f"export of {n} succeeded with wrong data in blocks {bad[:10]}:\n" + "\n".join(log)
            )
    lost = {}
    unknown = False
    # Lost blocks fail to read after repair (the default) or read as zeros (asked for).
    as_zeros = rng.random() < 0.3
    if rc != 0:
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
    for n in names:
        gone = lost.get(n, set())
        got, err = export(pool, n, dest)
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
    shutil.rmtree(pool, ignore_errors=True)
    return kind, rc, sum(len(v) for v in lost.values()), unknown


def main():
    os.makedirs(work, exist_ok=True)
    names = volumes(base)
    ref_pool = os.path.join(work, "reference")
    shutil.copytree(base, ref_pool)
    reference = {}
    for n in names:
        got, err = export(ref_pool, n, os.path.join(work, "export.raw"))
        if got is None:
            print(f"cannot export {n} from the undamaged pool: {err}")
            return 1
        reference[n] = got
    shutil.rmtree(ref_pool)
    print(f"volumes and snapshots: {', '.join(names)}; seed {seed}")
    tally = {}
    for r in range(first_round, first_round + rounds):
        try:
            kind, rc, lost, unknown = one_round(r, reference, names)
        except Broken as e:
            print(f"BROKEN (seed {seed}, round {r}; rerun: rounds.py ... 1 {seed} {r}):\n{e}")
            return 1
        t = tally.setdefault(kind, [0, 0, 0, 0, 0])
        t[0] += 1
        t[1] += rc == 0
        t[2] += rc != 0
        t[3] += lost
        t[4] += unknown
    for kind, (n, clean, repaired, lost, unknown) in sorted(tally.items()):
        print(
            f"{kind}: {n} rounds, {clean} clean at once (or mended at open), "
            f"{repaired} repaired, {lost} blocks lost in all"
            + (f", {unknown} with damaged journal batches (named; their blocks best effort)" if unknown else "")
        )
    print(f"{rounds} rounds: no panic, no hang, no wrong data without an error")
    return 0


sys.exit(main())
