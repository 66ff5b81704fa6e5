//go:build !race

package bench

const raceEnabled = false

// raceSlowdown scales the time bounds of tests that assert a speed (see
// race_test.go).
const raceSlowdown = 1
