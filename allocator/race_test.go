//go:build race

package allocator

// raceSlowdown scales the time bounds of tests that assert a speed: the
// race detector makes the code several times slower.
const raceSlowdown = 15
