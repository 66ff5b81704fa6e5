// Package bench holds allocd's benchmarks and its trace replay harness, so
// that `go test -bench` and `allocd bench` / `allocd replay` run the same
// code on the same work (package workload, which `allocd serve` runs too):
//
//   - the micro benchmarks: Pair (malloc+free of one size) and Mixed (T
//     goroutines, each on its own stream, over a random window of sizes
//     from 512 B to 256 MiB), with RunSuite running them all into a
//     Report;
//   - trace replay: Target gives each replay of a workload.Trace a fresh
//     simulated device (or one CUDA device) and runs workload.Replay;
//     Sampler, SnapshotAtPeak, WriteChart and WriteReplayTable show the
//     result.
package bench
