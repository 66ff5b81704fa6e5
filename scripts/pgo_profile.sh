#!/usr/bin/env bash
# Regenerates cmd/allocd/allocd.pgo, the CPU profile for profile-guided
# optimisation of the allocd command and liballocd, from the repository
# root:
#
#   scripts/pgo_profile.sh
#
# The profile is of `allocd bench` on the simulated device: the cached pair,
# the mixed pattern at 1, 2 and 4 goroutines (cold and warm) and every trace
# in testdata/traces replayed cold and warm, each three times. What it tells
# the compiler is which calls of the hot path (malloc, free, the free index,
# the statistics) to inline; those are the same calls whatever the
# workload. Run it again after a change that reshapes the hot path, and
# commit the result.
#
# Builds use it when asked: go build -pgo=cmd/allocd/allocd.pgo ./cmd/allocd
# (and the same flag for ./cmd/liballocd). It is not named default.pgo, so
# that `go test ./...` does not compile the standard library and every
# dependency a second time with it: that alone doubled the test command's
# time on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go build -pgo=off -o "$tmp/allocd" ./cmd/allocd
shopt -s nullglob
traces=(testdata/traces/*.pickle.gz)
"$tmp/allocd" bench --device sim --threads 1,2,4 --mixed-steps 200000 --cpuprofile "$tmp/micro.prof" >/dev/null
"$tmp/allocd" bench --device sim --no-pair --no-mixed --cpuprofile "$tmp/replay.prof" \
	"${traces[@]}" "${traces[@]}" "${traces[@]}" >/dev/null
go tool pprof -proto "$tmp/micro.prof" "$tmp/replay.prof" >cmd/allocd/allocd.pgo 2>/dev/null
echo "wrote cmd/allocd/allocd.pgo ($(wc -c <cmd/allocd/allocd.pgo) bytes)"
