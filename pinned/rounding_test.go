package pinned

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// TestSizeClassWaste replays three generated streams of host↔device copy
// sizes through the allocator with 1 (PyTorch's power of two), 2, 4 and 8
// size classes per power of two, and reports (go test -v -run
// TestSizeClassWaste ./pinned/) the peak of reserved pinned memory, the
// share of it that requests did not ask for at that peak, the mean rounding
// waste per buffer, and the cudaHostAlloc calls. docs/pinned.md quotes the
// table. Each workload is a data loader that allocates the buffers of one
// batch, keeps the last four batches in flight and frees the oldest.
func TestSizeClassWaste(t *testing.T) {
	type workload struct {
		name  string
		batch func(r *rand.Rand) []int
	}
	workloads := []workload{
		{"vision: 8×3×224×224 fp32 images + int64 labels", func(r *rand.Rand) []int {
			return []int{8 * 3 * 224 * 224 * 4, 8 * 8}
		}},
		{"text: 16×L int64 tokens and mask, L uniform in 16..2048", func(r *rand.Rand) []int {
			l := 16 + r.IntN(2033)
			return []int{16 * l * 8, 16 * l * 8}
		}},
		{"mixed: 4 tensors, log-uniform 4 KiB..16 MiB", func(r *rand.Rand) []int {
			out := make([]int, 4)
			for i := range out {
				out[i] = int(math.Exp(math.Log(4<<10) + r.Float64()*(math.Log(16<<20)-math.Log(4<<10))))
			}
			return out
		}},
	}
	const batches, depth = 400, 4
	var report strings.Builder
	fmt.Fprintf(&report, "%-58s %4s %14s %12s %12s %10s\n", "workload", "div", "peak reserved", "waste@peak", "mean waste", "host allocs")
	for _, w := range workloads {
		for _, div := range []int{1, 2, 4, 8} {
			dev := newSim(t, false)
			a := newAlloc(t, dev, Config{RoundupDivisions: div, Flags: DefaultFlags})
			r := rand.New(rand.NewPCG(14, 1))
			var inflight [][]Buffer
			var requested, peakReserved, reqAtPeak int64
			var wasteSum float64
			var n int
			for range batches {
				var bufs []Buffer
				for _, size := range w.batch(r) {
					b, err := a.Alloc(size)
					if err != nil {
						t.Fatal(err)
					}
					bufs = append(bufs, b)
					requested += int64(size)
					cls, _ := RoundSize(uint64(size), div)
					wasteSum += 1 - float64(size)/float64(cls)
					n++
				}
				inflight = append(inflight, bufs)
				if st := a.Stats(); st.ReservedBytes.Current > peakReserved {
					peakReserved, reqAtPeak = st.ReservedBytes.Current, requested
				}
				if len(inflight) > depth {
					for _, b := range inflight[0] {
						requested -= int64(b.Len())
						if err := a.Free(b); err != nil {
							t.Fatal(err)
						}
					}
					inflight = inflight[1:]
				}
			}
			st := a.Stats()
			fmt.Fprintf(&report, "%-58s %4d %10.1f MiB %11.1f%% %11.1f%% %10d\n", w.name, div,
				float64(peakReserved)/(1<<20), 100*(1-float64(reqAtPeak)/float64(peakReserved)), 100*wasteSum/float64(n), st.NumHostAlloc)
			for _, bufs := range inflight {
				for _, b := range bufs {
					_ = a.Free(b)
				}
			}
			mustCheck(t, a)
		}
	}
	t.Logf("size classes per power of two vs waste:\n%s", report.String())
}
