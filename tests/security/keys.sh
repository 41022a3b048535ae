#!/usr/bin/env bash
# A key means an encrypted pool, and refused commands leave nothing behind (issue 39), end to
# end with the CLI, qemu-img and nbdinfo:
#
#   1. A plaintext pool swapped in where a service expects its encrypted pool: every way of
#      giving a key (--key-file, $CONDENSE_KEY_FILE, --passphrase-file, a `serve --config`
#      file with key-file) is refused with "is not encrypted, yet a key was given", no file of
#      the pool changes, and no byte of what would have been written is in it. Without a key
#      it is used as before.
#   2. A refused `init --encrypt` (a passphrase too short) leaves no directory, no `lock`.
#   3. A refused `import -` (input longer than --size) leaves the pool clean: the next open
#      recovers nothing.
#   4. An S3 endpoint or pool URL whose query may hold a password is refused without showing
#      it.
#
#   bash tests/security/keys.sh
#
# Needs (Debian): qemu-utils libnbd-bin. Ends with "N passed, M failed, K skipped". KEEP=1
# keeps the work directory of a failed run.

set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
. "$ROOT/tests/lib.sh"
need_tools qemu-img nbdinfo sha256sum

W=$(mktemp -d /tmp/condense-keys.XXXXXX)
SERVER_PID=
cleanup() {
    stop_pids "$SERVER_PID"
    remove_work_dir
}
trap cleanup EXIT

(umask 077 && head -c 32 /dev/urandom >"$W/pool.key")
(umask 077 && echo "correct horse battery staple" >"$W/pass")
# A marker no pool here holds unless it was written in the clear: 1 MiB of one pattern.
python3 -c 'import sys; sys.stdout.buffer.write(b"SECRET-VM-DATA-39" * 61681 + b"x" * 3)' |
    head -c 1M >"$W/secret.raw"
MARK=SECRET-VM-DATA-39SECRET-VM-DATA-39

# digest DIR: one line per file of DIR with its checksum (what a refused command must not change).
digest() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }

# --- 1. A key on a plaintext pool ------------------------------------------------------------
POOL=$W/pool
"$CONDENSE" init "$POOL" --compression none >"$W/init.log" 2>&1 &&
    "$CONDENSE" --pool "$POOL" volume create vm --size 4M >>"$W/init.log" 2>&1 ||
    { fail "a plaintext pool made" "$W/init.log"; exit 1; }
digest "$POOL" >"$W/before"

refuse "import with --key-file into a plaintext pool is refused" \
    "pool $POOL is not encrypted, yet a key was given" \
    "$CONDENSE" --pool "$POOL" --key-file "$W/pool.key" import "$W/secret.raw" --name leak1
refuse "import with \$CONDENSE_KEY_FILE is refused" "is not encrypted, yet a key was given" \
    env CONDENSE_KEY_FILE="$W/pool.key" "$CONDENSE" --pool "$POOL" import "$W/secret.raw" --name leak2
refuse "import - with --passphrase-file is refused" "is not encrypted, yet a key was given" \
    sh -c "\"$CONDENSE\" --pool \"$POOL\" --passphrase-file \"$W/pass\" import - --name leak3 --size 1M <\"$W/secret.raw\""
refuse "a read-only command with a key is refused too" "is not encrypted, yet a key was given" \
    "$CONDENSE" --pool "$POOL" --key-file "$W/pool.key" volume list

cat >"$W/serve.toml" <<EOF
pool = "$POOL"
socket = "$W/nbd.sock"
key-file = "$W/pool.key"
EOF
"$CONDENSE" serve --config "$W/serve.toml" >"$W/serve.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$SERVER_PID" 2>/dev/null; then
    fail "serve --config with key-file on a plaintext pool does not start" "$W/serve.log"
    stop_pids "$SERVER_PID"
else
    wait "$SERVER_PID"
    rc=$?
    if [ "$rc" -ne 0 ] && grep -q "is not encrypted, yet a key was given" "$W/serve.log"; then
        ok "serve --config with key-file on a plaintext pool refuses to start (exit $rc)"
    else
        fail "serve --config with key-file on a plaintext pool refuses to start (exit $rc)" "$W/serve.log"
    fi
fi
SERVER_PID=
check "no socket was made" test ! -e "$W/nbd.sock"
digest "$POOL" >"$W/after"
check "no file of the pool changed under the refused commands" cmp -s "$W/before" "$W/after"
if grep -rqa "$MARK" "$POOL"; then
    fail "no byte of the data given under a key is in the plaintext pool"
else
    ok "no byte of the data given under a key is in the plaintext pool"
fi
check "without a key the plaintext pool is used as before" \
    "$CONDENSE" --pool "$POOL" import "$W/secret.raw" --name plain
check "... and its data is there in the clear (the check above would see it)" \
    grep -rqa "$MARK" "$POOL"

# --- 2. A refused init leaves nothing behind --------------------------------------------------
(umask 077 && echo "short" >"$W/short")
refuse "init --encrypt with a 5-character passphrase is refused" "15" \
    "$CONDENSE" init "$W/new" --encrypt --passphrase-file "$W/short"
check "... and leaves no directory behind" test ! -e "$W/new"
mkdir "$W/empty"
refuse "the same in an empty directory that was there" "15" \
    "$CONDENSE" init "$W/empty" --encrypt --passphrase-file "$W/short"
check "... which stays empty (no lock file)" test -z "$(ls -A "$W/empty")"

# --- 3. A refused import - leaves the pool clean ----------------------------------------------
P2=$W/pool2
"$CONDENSE" init "$P2" >/dev/null 2>&1 || fail "pool2 made"
head -c 3000000 /dev/urandom >"$W/long.raw"
refuse "import - of input longer than --size is refused" "nothing was kept" \
    sh -c "\"$CONDENSE\" --pool \"$P2\" import - --name vm --size 1M <\"$W/long.raw\""
"$CONDENSE" --pool "$P2" volume list >"$W/list.log" 2>&1
if grep -q "recovered pool" "$W/list.log"; then
    fail "the next open recovers nothing: the refused import closed the pool" "$W/list.log"
else
    ok "the next open recovers nothing: the refused import closed the pool"
fi
check "... and no volume vm is left" sh -c "! grep -qw vm \"$W/list.log\""

# --- 4. Secrets in an S3 URL's query are never shown ------------------------------------------
(umask 077 && printf 'AWS_ACCESS_KEY_ID=GK1\nAWS_SECRET_ACCESS_KEY=x\n' >"$W/creds.env")
refuse "an endpoint with a query is refused" "has a query or fragment" \
    "$CONDENSE" --pool s3://bucket/p init --cache "$W/c1" --cache-size 1G \
    --credentials "$W/creds.env" --endpoint 'https://s3.example.net/?X-Amz-Credential=A&password=hunter2'
cp "$W/out" "$W/refused"
check "... without showing it" sh -c "! grep -q hunter2 \"$W/refused\""
refuse "a pool URL with a query is refused" "has a query or fragment" \
    "$CONDENSE" --pool 's3://bucket/p?password=hunter2' init --cache "$W/c2" --cache-size 1G \
    --credentials "$W/creds.env" --endpoint https://s3.example.net
cp "$W/out" "$W/refused"
check "... without showing it" sh -c "! grep -q hunter2 \"$W/refused\""

summary
