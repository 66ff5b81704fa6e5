// Package workload is the work that allocd's benchmarks (package bench)
// and `allocd serve` both run on an allocator, so that a daemon's metrics
// move as the benchmarks measure:
//
//   - trace replay: LoadTrace reads and checks a PyTorch memory snapshot
//     and builds the operations of its first device (Trace), and Replay
//     runs them through an allocator;
//   - the mixed workload: SplitMix64 and MixedSize draw the mixed
//     benchmark's sizes, MixedWindow is its window of slots, and
//     MixedStepper takes its steps one at a time;
//   - Load, which drives an allocator with a trace or the mixed steps,
//     paced (Pacer), until its context ends.
package workload
