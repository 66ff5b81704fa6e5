//go:build !race

package allocator

// raceSlowdown scales the time bounds of tests that assert a speed (see
// race_test.go).
const raceSlowdown = 1
