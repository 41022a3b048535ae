#!/usr/bin/env bash
# kill -9 of `condense serve` in the middle of writes to a pool with delta compression (issue
# 44), with a real client over NBD: a pool made by `condense init --delta`, two volumes, and
# ROUNDS rounds (default 4) of: serve -> qemu-io writes, one 256 KiB piece and a flush per
# connection, alternating between volume a (a random image with a few bytes changed per 4 KiB
# block for the round) and volume b (the same with 16 more bytes changed per block: deltas of
# a's blocks, written in the same serve, whose sketch index holds them) -> kill -9 of the
# server once a random number of pieces were acknowledged -> `condense verify` clean -> both
# volumes exported: every piece acknowledged before the kill reads back, the piece in flight
# holds per block the old or the new data, nothing else changed. Then `condense gc`, verify
# and the exports again, volume a deleted (its last blocks' chunks then live only as the bases
# b's deltas name) and gc again: b still reads back and verify is clean (a base is never freed
# while a delta names it), and `repair --dry-run` finds nothing. Last, the record of a base
# only one of b's deltas names is damaged: `repair` names exactly that block of b (dry run and
# repair), verify is clean, and b reads as before but that block.
#
#   bash tests/deltas/run.sh               # builds target/release/condense first
#   ROUNDS=10 SEED=7 bash tests/deltas/run.sh
#
# Needs (Debian): qemu-utils (qemu-io), python3, jq. No root. Ends with "N passed, M failed".

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-io python3 jq

ROUNDS=${ROUNDS:-4}
SEED=${SEED:-$((RANDOM % 1000))}
RANDOM=$SEED
W=$(mktemp -d /tmp/condense-deltas.XXXXXX)
POOL=$W/pool
SOCK=$W/nbd.sock
PIECES=32 # 256 KiB each: 8 MiB volumes
SERVER_PID=
WRITER_PID=
cleanup() {
    [ -n "$WRITER_PID" ] && kill "$WRITER_PID" 2>/dev/null
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT
c() { "$CONDENSE" --pool "$POOL" "$@"; }
echo "condense: $CONDENSE; work dir $W; SEED=$SEED ROUNDS=$ROUNDS"

# The data of every round (pieces to write, whole images to compare) and the checker.
cat >"$W/data.py" <<'PY'
import json, os, random, sys

BS, PIECE = 4096, 256 << 10


def content(seed, rnd, vol, pieces):
    """Volume `vol`'s image in round `rnd`: a random image (the same every round), each 4 KiB
    block with 8 bytes set for the round, and for b 16 more (a near copy of a)."""
    img = bytearray(random.Random(seed).randbytes(pieces * PIECE))
    for blk in range(len(img) // BS):
        at = blk * BS + 64 * rnd % 3000
        img[at:at + 8] = bytes([rnd]) * 8
        if vol == "b":
            img[blk * BS + 3500:blk * BS + 3516] = bytes([rnd ^ 0x5A]) * 16
    return bytes(img)


def make(w, seed, rounds, pieces):
    for rnd in range(1, rounds + 1):
        os.makedirs(f"{w}/r{rnd}", exist_ok=True)
        for vol in "ab":
            img = content(seed, rnd, vol, pieces)
            for i in range(pieces):
                with open(f"{w}/r{rnd}/{vol}.{i}", "wb") as f:
                    f.write(img[i * PIECE:(i + 1) * PIECE])


def check(w, seed, rnd, pieces):
    """After round `rnd` (0: just the final check): every block holds a round its state
    allows; acknowledged pieces the new round, the piece in flight the old or the new one."""
    state_path = f"{w}/state.json"
    state = json.load(open(state_path)) if os.path.exists(state_path) else {
        v: [[0] for _ in range(pieces * PIECE // BS)] for v in "ab"}
    per = PIECE // BS
    if rnd:
        order = [(v, i) for i in range(pieces) for v in "ab"]
        acked = [tuple(l.split()) for l in open(f"{w}/acked.{rnd}").read().split("\n") if l]
        acked = [(v, int(i)) for v, i in acked]
        assert acked == order[:len(acked)], f"acknowledged out of order: {acked}"
        for v, i in acked:
            for b in range(i * per, (i + 1) * per):
                state[v][b] = [rnd]
        if len(acked) < len(order):
            v, i = order[len(acked)]
            for b in range(i * per, (i + 1) * per):
                state[v][b] = sorted(set(state[v][b]) | {rnd})
    images = {}
    bad = []
    for v in "ab":
        got = open(f"{w}/{v}.raw", "rb").read()
        for b, allowed in enumerate(state[v]):
            block = got[b * BS:(b + 1) * BS]
            found = None
            for r in allowed:
                if r not in images.setdefault(v, {}):
                    images[v][r] = bytes(pieces * PIECE) if r == 0 else content(seed, r, v, pieces)
                if images[v][r][b * BS:(b + 1) * BS] == block:
                    found = r
                    break
            if found is None:
                bad.append(f"{v} block {b} (allowed rounds {allowed})")
            else:
                state[v][b] = [found]
    json.dump(state, open(state_path, "w"))
    if bad:
        print(f"{len(bad)} blocks hold other data: " + ", ".join(bad[:10]))
        sys.exit(1)
    print(f"every block as acknowledged (round {rnd})")


def damage(w, seed, pieces, pool):
    """Flip a byte in the record of the base of one of b's deltas (a's block of the round b's
    block holds, stored raw: random data); prints the block."""
    state = json.load(open(f"{w}/state.json"))
    segs = [f"{pool}/{n}" for n in os.listdir(pool) if n.startswith("seg-") and n.endswith(".dat")]
    for k in random.Random(seed).sample(range(len(state["b"])), len(state["b"])):
        rnd = state["b"][k][0]
        if rnd == 0:
            continue
        base = content(seed, rnd, "a", pieces)[k * BS:(k + 1) * BS]
        hit = False
        for s in segs:
            data = bytearray(open(s, "rb").read())
            at = data.find(base)
            while at >= 0:
                data[at + 100] ^= 0xFF
                hit = True
                at = data.find(base, at + 1)
            if hit:
                open(s, "wb").write(data)
        if hit:
            print(k)
            return
    sys.exit("no base record of b's blocks found in the segments")


if __name__ == "__main__":
    cmd, w, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if cmd == "damage":
        damage(w, seed, int(sys.argv[4]), sys.argv[5])
    elif cmd == "make":
        make(w, seed, int(sys.argv[4]), int(sys.argv[5]))
    else:
        check(w, seed, int(sys.argv[4]), int(sys.argv[5]))
PY
python3 "$W/data.py" make "$W" "$SEED" "$ROUNDS" "$PIECES" || { fail "making the data"; exit 1; }

check "init --delta" c init --delta --write-policy async
check "volume create a" c volume create a --size $((PIECES / 4))M
check "volume create b" c volume create b --size $((PIECES / 4))M

start_server() {
    rm -f "$SOCK"
    "$CONDENSE" --pool "$POOL" serve --socket "$SOCK" --scrub-rate 0 >>"$W/serve.log" 2>&1 &
    SERVER_PID=$!
    wait_ready "$SERVER_PID" "$W/serve.log" test -S "$POOL/control.sock" -a -S "$SOCK"
}

# writer ROUND: piece i of a, then piece i of b, i = 0.. (each one write and a flush on its
# own connection); each one acknowledged is listed in $W/acked.ROUND, in order.
writer() {
    local r=$1 i v
    for i in $(seq 0 $((PIECES - 1))); do
        for v in a b; do
            qemu-io -f raw -c "write -q -s $W/r$r/$v.$i $((i * 256))k 256k" -c flush \
                "nbd+unix:///$v?socket=$SOCK" >>"$W/writer.log" 2>&1 || return 0
            echo "$v $i" >>"$W/acked.$r"
        done
    done
}

exports_match() { # ROUND (0: no new writes)
    rm -f "$W/a.raw" "$W/b.raw"
    c export a "$W/a.raw" && c export b "$W/b.raw" &&
        python3 "$W/data.py" check "$W" "$SEED" "$1" "$PIECES"
}

for r in $(seq 1 "$ROUNDS"); do
    start_server || { fail "round $r: serve starts" "$W/serve.log"; break; }
    : >"$W/acked.$r"
    # Killed once this many pieces were acknowledged (of 2 x PIECES).
    at=$((2 + RANDOM % (2 * PIECES - 4)))
    writer "$r" &
    WRITER_PID=$!
    for _ in $(seq 1 3000); do
        [ "$(wc -l <"$W/acked.$r")" -ge "$at" ] && break
        kill -0 "$WRITER_PID" 2>/dev/null || break
        sleep 0.01
    done
    kill9_server
    wait "$WRITER_PID" 2>/dev/null
    WRITER_PID=
    n=$(wc -l <"$W/acked.$r")
    if [ "$n" -ge "$at" ] && [ "$n" -lt $((2 * PIECES)) ]; then
        ok "round $r: kill -9 mid-write ($n of $((2 * PIECES)) pieces acknowledged)"
    else
        fail "round $r: kill -9 mid-write ($n acknowledged, wanted $at..$((2 * PIECES - 1)))" "$W/writer.log"
    fi
    check "round $r: verify clean after kill -9" c verify
    check "round $r: every acknowledged write reads back, nothing else changed" exports_match "$r"
done

deltas=$(c stats --json 2>/dev/null | jq -r '.delta_chunks_written // empty')
expect_ge "the pool holds deltas (delta_chunks_written)" "$deltas" 64
check "gc" c gc --min-dead-percent 1
check "verify clean after gc" c verify
check "after gc every block reads as before" exports_match 0
cp "$W/b.raw" "$W/b.before"
check "volume delete a (b's deltas still name its chunks)" c volume delete a
check "gc after the delete" c gc --min-dead-percent 1
check "verify clean after the delete and gc (no base freed while a delta names it)" c verify
rm -f "$W/b.raw"
check "export b after the delete and gc" c export b "$W/b.raw"
check "b reads as before the delete" cmp "$W/b.raw" "$W/b.before"
check "repair --dry-run finds nothing to repair" c repair --dry-run

# A base only a delta names damaged in its segment: repair names the delta's block, verify is
# clean after it, and every other block of b reads as before.
if k=$(python3 "$W/data.py" damage "$W" "$SEED" "$PIECES" "$POOL" 2>"$W/out"); then
    ok "flipped a byte of the base of b's block $k"
    want="[{\"volume\":\"b\",\"first_block\":$k,\"blocks\":1}]"
    lost_of() { jq -c '[.lost[] | {volume, first_block, blocks}]' "$1"; }
    c repair --dry-run --json >"$W/dry.json" 2>"$W/out"
    rc=$?
    if [ "$rc" = 3 ] && [ "$(lost_of "$W/dry.json")" = "$want" ]; then
        ok "repair --dry-run names b's block $k (exit 3)"
    else
        fail "repair --dry-run names b's block $k (exit $rc): $(lost_of "$W/dry.json")"
    fi
    c repair --json >"$W/repair.json" 2>"$W/out"
    rc=$?
    if [ "$rc" = 0 ] && [ "$(lost_of "$W/repair.json")" = "$want" ]; then
        ok "repair loses exactly b's block $k, the delta on the damaged base"
    else
        fail "repair loses exactly b's block $k (exit $rc): $(lost_of "$W/repair.json")"
    fi
    check "verify clean after the repair" c verify
    rm -f "$W/b.raw"
    check "export --lost-as-zeros b" c export --lost-as-zeros b "$W/b.raw"
    python3 - "$W/b.before" "$W/b.raw" "$k" >"$W/out" 2>&1 <<'PY'
import sys
a, b, k = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read(), int(sys.argv[3])
diff = [i for i in range(len(a) // 4096) if a[i * 4096:(i + 1) * 4096] != b[i * 4096:(i + 1) * 4096]]
sys.exit(0 if diff == [k] and b[k * 4096:(k + 1) * 4096] == bytes(4096) else f"blocks differing: {diff}")
PY
    if [ $? = 0 ]; then ok "b reads as before but block $k (zeros)"; else fail "b reads as before but block $k" "$W/out"; fi
else
    fail "damaging a base of b's deltas" "$W/out"
fi

summary
