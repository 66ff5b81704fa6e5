package workload

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// callCounter is a device that counts every call of cudart.Device (and
// CheckStream) made into it. It hides the Sim's type, so a replay takes
// the path it takes on a GPU: deferred frees are delayed to their
// free_completed position instead of waiting for manual events. The
// Sim's optional interfaces stay visible through the embedding.
type callCounter struct {
	*simdev.Sim
	mu sync.Mutex
	n  map[string]int64
}

func (c *callCounter) count(name string) {
	c.mu.Lock()
	c.n[name]++
	c.mu.Unlock()
}

func (c *callCounter) reset() {
	c.mu.Lock()
	c.n = map[string]int64{}
	c.mu.Unlock()
}

func (c *callCounter) counts() map[string]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int64, len(c.n))
	for k, v := range c.n {
		out[k] = v
	}
	return out
}

func (c *callCounter) Info() cudart.Info { c.count("Info"); return c.Sim.Info() }
func (c *callCounter) Malloc(n uint64) (cudart.Ptr, error) {
	c.count("Malloc")
	return c.Sim.Malloc(n)
}
func (c *callCounter) Free(p cudart.Ptr) error { c.count("Free"); return c.Sim.Free(p) }
func (c *callCounter) MemGetInfo() (uint64, uint64, error) {
	c.count("MemGetInfo")
	return c.Sim.MemGetInfo()
}
func (c *callCounter) Synchronize() error { c.count("Synchronize"); return c.Sim.Synchronize() }
func (c *callCounter) StreamCreate() (cudart.Stream, error) {
	c.count("StreamCreate")
	return c.Sim.StreamCreate()
}
func (c *callCounter) StreamDestroy(s cudart.Stream) error {
	c.count("StreamDestroy")
	return c.Sim.StreamDestroy(s)
}
func (c *callCounter) StreamSynchronize(s cudart.Stream) error {
	c.count("StreamSynchronize")
	return c.Sim.StreamSynchronize(s)
}
func (c *callCounter) EventCreate() (cudart.Event, error) {
	c.count("EventCreate")
	return c.Sim.EventCreate()
}
func (c *callCounter) EventRecord(e cudart.Event, s cudart.Stream) error {
	c.count("EventRecord")
	return c.Sim.EventRecord(e, s)
}
func (c *callCounter) EventQuery(e cudart.Event) (bool, error) {
	c.count("EventQuery")
	return c.Sim.EventQuery(e)
}
func (c *callCounter) EventSynchronize(e cudart.Event) error {
	c.count("EventSynchronize")
	return c.Sim.EventSynchronize(e)
}
func (c *callCounter) EventDestroy(e cudart.Event) error {
	c.count("EventDestroy")
	return c.Sim.EventDestroy(e)
}
func (c *callCounter) MemsetAsync(p cudart.Ptr, v byte, n uint64, s cudart.Stream) error {
	c.count("MemsetAsync")
	return c.Sim.MemsetAsync(p, v, n, s)
}
func (c *callCounter) MemcpyHtoD(dst cudart.Ptr, src []byte) error {
	c.count("MemcpyHtoD")
	return c.Sim.MemcpyHtoD(dst, src)
}
func (c *callCounter) MemcpyDtoH(dst []byte, src cudart.Ptr) error {
	c.count("MemcpyDtoH")
	return c.Sim.MemcpyDtoH(dst, src)
}
func (c *callCounter) CheckStream(s cudart.Stream) error {
	c.count("CheckStream")
	return c.Sim.CheckStream(s)
}

var _ cudart.StreamChecker = (*callCounter)(nil)

// TestReplayDeviceCalls: a replay on a device that is not a manual-event
// Sim (the path a GPU takes) calls the device only for its segments
// (cudaMalloc, and cudaFree when a retry releases the cache) and for the
// trace's streams: no call per operation. On a GPU every device call is a
// cgo call into the CUDA runtime (100 ns and more), so one per operation
// would slow every replay by that much while the simulated device, whose
// calls are nearly free, shows nothing.
func TestReplayDeviceCalls(t *testing.T) {
	tests := []struct {
		trace   string
		mallocs int64 // device mallocs of the default configuration
		streams int64 // trace streams besides the default one
		long    bool  // 409,172 operations: skipped with -short
	}{
		{"llm_decode_varlen", 56, 0, true},
		{"varlen_inference", 65, 0, false},
		{"multistream_prefetch", 33, 1, false},
	}
	for _, tt := range tests {
		t.Run(tt.trace, func(t *testing.T) {
			if tt.long && testing.Short() {
				t.Skip("a long replay; run without -short")
			}
			tr, err := LoadTrace(filepath.Join("..", "testdata", "traces", tt.trace+".pickle.gz"))
			if err != nil {
				t.Fatal(err)
			}
			sim, err := simdev.New(simdev.Config{Capacity: 141 << 30, Addresses: tr.Addresses})
			if err != nil {
				t.Fatal(err)
			}
			dev := &callCounter{Sim: sim, n: map[string]int64{}}
			a, err := allocator.New(dev, allocator.DefaultConfig())
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			dev.reset()
			res, err := Replay(&tr.Ops, a, ReplayOptions{})
			if err != nil {
				t.Fatal(err)
			}
			got := dev.counts()
			want := map[string]int64{"Malloc": tt.mallocs}
			if tt.streams > 0 {
				want["StreamCreate"] = tt.streams
				want["StreamDestroy"] = tt.streams
				want["CheckStream"] = tt.streams
			}
			if res.DeviceMallocs != tt.mallocs || res.DeviceFrees != 0 {
				t.Errorf("device mallocs and frees = %d, %d; want %d, 0", res.DeviceMallocs, res.DeviceFrees, tt.mallocs)
			}
			if g, w := formatCalls(got), formatCalls(want); g != w {
				t.Errorf("device calls in a replay of %d operations:\n got %s\nwant %s", res.Ops, g, w)
			}
		})
	}
}

// formatCalls lists the non-zero counts by name.
func formatCalls(n map[string]int64) string {
	var parts []string
	for k, v := range n {
		if v != 0 {
			parts = append(parts, fmt.Sprintf("%s=%d", k, v))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}
