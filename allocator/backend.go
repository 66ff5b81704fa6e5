package allocator

// The backends. Allocator's public calls take the locks, check what every
// policy checks (closed, the stream, the history's stack, a request larger
// than the device or the cap) and hand the rest to one of two backends
// behind one small interface:
//
//   - native: the caching policy of PyTorch's native allocator
//     (allocator.go, with its shards, front cache and segment sources);
//   - *asyncAllocator: backend:cudaMallocAsync (async.go), PyTorch's
//     CudaMallocAsyncAllocator, which delegates to the device's
//     stream-ordered pool.
//
// Only the native backend has a hot path (fastMalloc, fastFree); with the
// async one every call runs in world mode. Statistics, events, history,
// Stats, Snapshot and the metrics are shared, so callers, the collector
// and the debug pages see one Allocator whichever backend serves it.

import (
	"github.com/allocd/allocd/cudart"
)

// backend is what differs between the two policies. Every method runs in
// world mode.
type backend interface {
	// malloc serves a checked request of size bytes on sh's stream.
	malloc(c *call, sh *shard, size uint64) (cudart.Ptr, error)
	free(c *call, p cudart.Ptr) error
	recordStream(p cudart.Ptr, s cudart.Stream) error
	emptyCache() error
	// close returns everything to the device and reports how many
	// allocations were still live.
	close() (live int, errs []error)
	// check reports every broken invariant of the backend's structures
	// and their agreement with the statistics.
	check() error
	// holds says how the backend relates to address p.
	holds(p cudart.Ptr) holding
}

// native is the caching policy; its methods are in allocator.go and
// devices.go.
type native struct{ a *Allocator }

func (m *asyncAllocator) malloc(c *call, sh *shard, size uint64) (cudart.Ptr, error) {
	return m.mallocStream(c, size, sh.stream)
}

func (m *asyncAllocator) close() (int, []error) {
	live := len(m.live)
	return live, m.closeAll()
}

func (m *asyncAllocator) holds(p cudart.Ptr) holding {
	if m.live[uint64(p)] != nil {
		return holdLive
	}
	for _, pa := range m.pending {
		if pa.ptr == uint64(p) {
			return holdSegment
		}
	}
	return holdNone
}
