#!/usr/bin/env bash
# Fuzz every decoder of bytes that come from disk, a bucket or the network, for a bounded time
# each, and fail on the first crash:
#
#   fuzz/run.sh [SECONDS] [TARGET...]     SECONDS per target (default 60); default: every target
#
# - Installs the pinned cargo-fuzz into ~/.cargo/bin unless the one there is that version.
#   cargo-fuzz needs nightly flags (-Zsanitizer=address): on the stable toolchain this script
#   sets RUSTC_BOOTSTRAP=1, which lets stable rustc take them.
# - Builds every target once (fuzz/target, or $CARGO_TARGET_DIR if set), then runs each from
#   a scratch corpus (fuzz/corpus/TARGET, kept between runs, never committed) into which the
#   committed seeds (fuzz/seeds/TARGET: real encodings, see fuzz/seeds/README.md) are copied.
# - Limits per target: -max_len (a little above the largest real input the decoder sees),
#   -rss_limit_mb and -malloc_limit_mb (a decoder that allocates more for such an input is a
#   bug: a length field trusted), -timeout (one input taking longer is a hang).
# - FUZZ_BUILD_ARGS: more options of `cargo fuzz build` and `run`, e.g. "--dev" (unoptimized:
#   a cold build takes a fraction of the time, for short passes) or "-s none" (no sanitizer).
# - Exits non-zero if any target crashes, hangs or goes over a memory limit, and prints the
#   reproducer (fuzz/artifacts/TARGET/...) and the command that replays it. A fixed crash's
#   minimized reproducer goes into fuzz/seeds/TARGET/ as a regression seed.
set -uo pipefail
cd "$(dirname "$0")/.."
CARGO_FUZZ_VERSION=0.13.2

secs=60
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
    secs=$1
    shift
fi

# target  max_len  rss_limit_mb  malloc_limit_mb  [more libFuzzer options]
# nbd_session: -detect_leaks=0, as its tokio runtime's threads outlive an input and LeakSanitizer
# reports their thread-local destructor records (glibc's __cxa_thread_atexit_impl, 64 bytes).
limits="
nbd_parse        4096   2048 512
nbd_session      65536  2048 512 -detect_leaks=0
superblock       512    1024 64
checkpoint_root  65536  1024 256
journal          65536  1024 256
meta_page        4200   1024 64
segment          65536  1024 256
cache_index      8192   1024 128
cache_conf       1024   1024 64
dedup_index      65536  1024 128
remote_conf      2048   1024 64
lease            1024   1024 64
manifest         65536  1024 128
wal_object       16384  1024 64
sealed_object    16384  1024 64
key_file         256    1024 64
delta_record     8192   1024 64
fuse_records     8192   1024 64
image_header     327680 1024 64
qemu_img_json    16384  1024 128
config_file      4096   1024 128
control_reply    8192   1024 64
"
all=$(awk 'NF { print $1 }' <<<"$limits")
targets=${*:-$all}
for t in $targets; do
    grep -qw "^$t" <<<"$limits" || { echo "unknown target $t (targets: $(echo $all))"; exit 2; }
done

# A C++ compiler builds libFuzzer (libfuzzer-sys).
scripts/install-deps.sh build-essential || exit 1
export RUSTC_BOOTSTRAP=1
cargo_fuzz=$HOME/.cargo/bin/cargo-fuzz
if ! { [ -x "$cargo_fuzz" ] && "$cargo_fuzz" --version 2>/dev/null | grep -qwF "$CARGO_FUZZ_VERSION"; }; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION"
    # Its own target directory, so that a CARGO_TARGET_DIR set for the project stays clean.
    env -u CARGO_TARGET_DIR cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked ||
        { echo "cannot install cargo-fuzz $CARGO_FUZZ_VERSION"; exit 1; }
fi
# The fuzz crate is its own workspace: keep its artefacts apart from the project's.
export CARGO_TARGET_DIR=${FUZZ_TARGET_DIR:-$PWD/fuzz/target}
read -r -a build_args <<<"${FUZZ_BUILD_ARGS:-}"

start=$SECONDS
echo "building the fuzz targets"
if [ "$targets" = "$all" ]; then
    "$cargo_fuzz" build "${build_args[@]}" || { echo "building the fuzz targets failed"; exit 1; }
else
    for t in $targets; do
        "$cargo_fuzz" build "${build_args[@]}" "$t" || { echo "building fuzz target $t failed"; exit 1; }
    done
fi
echo "built in $((SECONDS - start)) s; running each target for $secs s"

failed=()
for t in $targets; do
    read -r _ max_len rss malloc extra < <(grep -w "^$t" <<<"$limits")
    corpus=fuzz/corpus/$t
    artifacts=fuzz/artifacts/$t
    mkdir -p "$corpus" "$artifacts"
    if [ -d "fuzz/seeds/$t" ]; then
        cp -n fuzz/seeds/"$t"/* "$corpus"/ 2>/dev/null
    fi
    log=$artifacts/last-run.log
    before=$(ls "$artifacts" | grep -cv '^last-run.log$')
    "$cargo_fuzz" run "${build_args[@]}" "$t" "$corpus" -- \
        -max_total_time="$secs" -max_len="$max_len" -rss_limit_mb="$rss" \
        -malloc_limit_mb="$malloc" -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" ${extra:+"$extra"} >"$log" 2>&1
    rc=$?
    stats=$(grep -E '^stat::(number_of_executed_units|peak_rss_mb|new_units_added)' "$log" |
        sed 's/stat:://; s/: */=/' | tr '\n' ' ')
    cov=$(grep -E '^#[0-9]+' "$log" | tail -1 | grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9a-zA-Z]+')
    echo "$t: exit $rc; $cov; $stats; corpus $(ls "$corpus" | wc -l) files"
    after=$(ls "$artifacts" | grep -cv '^last-run.log$')
    if [ "$rc" -ne 0 ] || [ "$after" -gt "$before" ]; then
        failed+=("$t")
        grep -E '^(==[0-9]+==|SUMMARY|thread .* panicked|ERROR)' "$log" | head -5
        for a in $(ls -t "$artifacts" | grep -v '^last-run.log$' | head -1); do
            echo "  reproducer: $artifacts/$a"
            echo "  replay: RUSTC_BOOTSTRAP=1 cargo fuzz run $t $artifacts/$a"
        done
        echo "  log: $log"
    fi
done
echo "fuzzing done in $((SECONDS - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz targets that failed: ${failed[*]}"
    exit 1
fi
