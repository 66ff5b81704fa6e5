# device_lib.sh: what the device_*.sh scripts that take TRACEDIR ANCHORDIR
# share. Source it after `set -uo pipefail`, then call
#
#   device_setup NAME "$@"     # sets TRACES, ANCHOR, OUT (default .devrun/NAME), BIN, BUDGET_S, START
#   device_build [TESTPKG...]  # allocd, and a TESTPKG.test per package (gputest, cudart)
#   device_pack                # with PACK=1, every result so far into $RESULTS/NAME.tar.gz
#
# and use say (a line stamped with the seconds so far) and left (seconds of
# $BUDGET_S, default 560, still to spend).
#
# PACK=1 is for a machine that returns only a few files from a command: the
# results are written to a temporary folder ($OUT) and device_pack, which a
# script calls as each stage ends, and again on exit (which also removes the
# temporary folder), writes all of them so far as one archive,
# $RESULTS/NAME.tar.gz ($RESULTS is the OUT given, or its default). Without
# it, $RESULTS is $OUT and device_pack does nothing.

device_setup() {
	DEVICE_NAME=$1
	shift
	TRACES=${1:?usage: scripts/$DEVICE_NAME.sh TRACEDIR ANCHORDIR}
	ANCHOR=${2:?usage: scripts/$DEVICE_NAME.sh TRACEDIR ANCHORDIR}
	OUT=${OUT:-.devrun/${DEVICE_NAME#device_}}
	BIN=${BIN:-.devrun/bin}
	BUDGET_S=${BUDGET_S:-560}
	mkdir -p "$OUT" "$BIN" || exit 2
	OUT=$(realpath "$OUT")
	RESULTS=$OUT
	if [ "${PACK:-}" = 1 ]; then
		OUT=$(mktemp -d) || exit 2
		trap 'device_pack; rm -rf "$OUT"' EXIT
	fi
	BIN=$(realpath "$BIN")
	TRACES=$(realpath "$TRACES")
	ANCHOR=$(realpath "$ANCHOR")
	START=$(date +%s)
	unset ALLOCD_DEVICE ALLOCD_CONF PYTORCH_CUDA_ALLOC_CONF
}

device_pack() {
	[ "$OUT" = "$RESULTS" ] && return 0
	tar -C "$OUT" -czf "$RESULTS/$DEVICE_NAME.tar.gz.part" . && mv "$RESULTS/$DEVICE_NAME.tar.gz.part" "$RESULTS/$DEVICE_NAME.tar.gz"
}

say() { echo "[$DEVICE_NAME $(($(date +%s) - START))s] $*"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# device_build builds allocd and the named packages' test binaries into
# $BIN where Go is present; a GPU machine without Go must have them there
# already (built elsewhere with CGO_ENABLED=1). It also records the GPU.
device_build() {
	if command -v go >/dev/null; then
		say "building"
		go build -pgo=cmd/allocd/allocd.pgo -o "$BIN/allocd" ./cmd/allocd || exit 2
		for p in "$@"; do
			go test -c -o "$BIN/$p.test" "./$p/" || exit 2
		done
	else
		for b in allocd "${@/%/.test}"; do
			[ -x "$BIN/$b" ] || { say "no Go here and no $BIN/$b: build it first (CGO_ENABLED=1)"; exit 2; }
		done
	fi
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/gpu.txt" 2>&1
	cat "$OUT/gpu.txt"
}
