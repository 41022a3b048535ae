#!/usr/bin/env bash
# Checks the Garage test harness itself (tests/s3/garage.sh), with plain curl --aws-sigv4:
# start a 3-node RF3 cluster, PUT/GET/LIST/DELETE, kill node 2 and still PUT/GET (quorum 2 of 3),
# stop every node, restart, find the objects again, stop and clean up. Not run by CI (it is not
# a run.sh); needs garage (scripts/install-garage.sh) and curl.
#   tests/s3/harness-check.sh          # KEEP=1 keeps the work directory when something failed
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# tests/lib.sh builds condense unless $CONDENSE is set; this check does not use it.
CONDENSE=${CONDENSE:-unused}
# shellcheck source=tests/lib.sh
. "$ROOT/tests/lib.sh"
need_tools curl cmp
G=$ROOT/tests/s3/garage.sh

W=$(mktemp -d /tmp/garage-check.XXXXXX)
C=$W/cluster
cleanup() {
    if [ -f "$C/ports" ]; then "$G" stop "$C" >/dev/null 2>&1 || true; fi
    remove_work_dir
}
trap cleanup EXIT

# s3 METHOD KEY [curl args...]: a signed request on the bucket through node 1 (AWS_ENDPOINT_URL).
# Garage wants x-amz-content-sha256, which curl < 8 does not add by itself.
SHA=(-H "x-amz-content-sha256: UNSIGNED-PAYLOAD")
s3() {
    local method=$1 key=$2
    shift 2
    curl -sS -f --max-time 30 -X "$method" "${SHA[@]}" --aws-sigv4 "aws:amz:$AWS_REGION:s3" \
        --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" "$@" \
        "$AWS_ENDPOINT_URL/$CONDENSE_S3_BUCKET/$key"
}
put() { s3 PUT "$1" -T "$2" -o /dev/null; }
get_same() { s3 GET "$1" -o "$W/got" && cmp "$W/got" "$2"; }
status_of() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 30 "${SHA[@]}" --aws-sigv4 "aws:amz:$AWS_REGION:s3" \
        --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" "$AWS_ENDPOINT_URL/$CONDENSE_S3_BUCKET/$1"
}
# LIST with a prefix: a '/' in the query must be sent as %2F (curl signs the query as written).
list() { s3 GET "?list-type=2&prefix=${1//\//%2F}"; }
listed() { list "$1" | grep -q "<Key>$1</Key>"; }
not_listed() { list "$1" >"$W/list" && ! grep -q "<Key>$1</Key>" "$W/list"; }
gone() { [ "$(status_of "$1")" = 404 ]; }
# range_same KEY FILE: bytes 1000..1999 of KEY are those of FILE.
range_same() { s3 GET "$1" -r 1000-1999 | cmp - <(head -c 2000 "$2" | tail -c 1000); }
# running_nodes: how many of the cluster's nodes are alive.
running_nodes() {
    local n=0 f
    for f in "$C"/node*/pid; do if kill -0 "$(cat "$f")" 2>/dev/null; then n=$((n + 1)); fi; done
    echo "$n"
}

t0=$SECONDS
if ! "$G" start "$C" >"$W/out" 2>&1; then
    fail "start a 3-node cluster"
    summary
    exit 1
fi
ok "start a 3-node cluster ($((SECONDS - t0)) s)"
check "credentials.env has the five variables" \
    grep -c -E '^export (AWS_ACCESS_KEY_ID|AWS_SECRET_ACCESS_KEY|AWS_ENDPOINT_URL|AWS_REGION|CONDENSE_S3_BUCKET)=.' "$C/credentials.env"
# shellcheck disable=SC1091
. "$C/credentials.env"
check "3 garage processes" test "$(running_nodes)" = 3
refuse "start refuses a directory with a running cluster" "already has a running cluster" "$G" start "$C"

head -c 3000000 /dev/urandom >"$W/a"
head -c 5000 /dev/urandom >"$W/b"
head -c 700000 /dev/urandom >"$W/c"
check "PUT a (3 MB)" put dir/a "$W/a"
check "GET a: same bytes" get_same dir/a "$W/a"
check "range GET a" range_same dir/a "$W/a"
check "LIST finds a" listed dir/a
check "DELETE a" s3 DELETE dir/a -o /dev/null
check "GET a after DELETE: 404" gone dir/a
check "LIST no longer finds a" not_listed dir/a
check "PUT b" put b "$W/b"

check "kill node 2" "$G" kill "$C" 2
check "2 nodes left" test "$(running_nodes)" = 2
check "PUT c with node 2 dead" put c "$W/c"
check "GET b with node 2 dead" get_same b "$W/b"
check "GET c with node 2 dead" get_same c "$W/c"
check "LIST with node 2 dead" listed c

check "stop all nodes" "$G" stop "$C"
check "no node left running" test "$(running_nodes)" = 0
refuse "GET while every node is stopped fails" "" s3 GET b -o /dev/null --max-time 5
t0=$SECONDS
check "restart all nodes" "$G" restart "$C"
echo "    (restart took $((SECONDS - t0)) s)"
check "GET b after the restart" get_same b "$W/b"
check "GET c after the restart (written while node 2 was dead)" get_same c "$W/c"
check "status shows 3 running nodes" sh -c "'$G' status '$C' | grep -c ': running' | grep -qx 3"
check "stop" "$G" stop "$C"
summary
