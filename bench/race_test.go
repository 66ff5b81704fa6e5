//go:build race

package bench

// raceEnabled is set under -race, which slows the allocator's segment
// directory copies (O(segments) per new segment) too far for the
// 40,000-segment replay.
const raceEnabled = true

// raceSlowdown scales the time bounds of tests that assert a speed: the
// race detector makes the code several times slower.
const raceSlowdown = 15
