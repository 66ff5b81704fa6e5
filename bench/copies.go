package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/bytecount"
	"github.com/allocd/allocd/pinned"
	"github.com/allocd/allocd/simdev"
)

// CopySizes are the sizes of the copy bandwidth benchmark: 4 KiB to 1 GiB,
// by factors of 4 (scripts/pinned_anchor.py measures the same ones).
var CopySizes = []int{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30}

// CopyAllocSizes are the sizes of the alloc+free comparison.
var CopyAllocSizes = []int{4 << 10, 1 << 20, 64 << 20}

// simCopyLimit caps the sizes on the simulated device, whose copies are Go
// memmoves of memory it must hold twice.
const simCopyLimit = 64 << 20

// CopyDevice is what the copy benchmark needs: device memory, streams and
// synchronous copies (Device), page-locked memory and async copies
// (HostDevice). *cudart.CUDA and *simdev.Sim implement it.
type CopyDevice interface {
	cudart.Device
	cudart.HostDevice
}

// CopyOptions configure Copies. Zero fields take the defaults.
type CopyOptions struct {
	// Sizes are the copy sizes (CopySizes).
	Sizes []int
	// AllocSizes are the alloc+free sizes (CopyAllocSizes).
	AllocSizes []int
	// Bytes is what one timed run of a size moves at least, within 3 to
	// 2,000 copies (1 GiB).
	Bytes int64
	// Trials is the number of timed runs; the best counts (3).
	Trials int
	// CachedIters and CachedTime are the least number of cached
	// Alloc+Free pairs timed (1,000,000) and the least time they run
	// (200 ms): the pairs run in batches of cachedBatch until both are
	// reached, after an untimed warm-up batch.
	CachedIters int
	CachedTime  time.Duration
	// HostAllocTime bounds the time spent timing cudaHostAlloc+cudaFreeHost
	// per size, at least 5 pairs (1 s).
	HostAllocTime time.Duration
}

func (o *CopyOptions) defaults() {
	if o.Sizes == nil {
		o.Sizes = CopySizes
	}
	if o.AllocSizes == nil {
		o.AllocSizes = CopyAllocSizes
	}
	if o.Bytes <= 0 {
		o.Bytes = 1 << 30
	}
	if o.Trials <= 0 {
		o.Trials = 3
	}
	if o.CachedIters <= 0 {
		o.CachedIters = 1_000_000
	}
	if o.CachedTime <= 0 {
		o.CachedTime = 200 * time.Millisecond
	}
	if o.HostAllocTime <= 0 {
		o.HostAllocTime = time.Second
	}
}

// CopyRow is the bandwidth of one size, in GB/s (10^9 bytes a second).
type CopyRow struct {
	Bytes       int     `json:"bytes"`
	PageableH2D float64 `json:"pageable_h2d_gbps"`
	PageableD2H float64 `json:"pageable_d2h_gbps"`
	PinnedH2D   float64 `json:"pinned_h2d_gbps"`
	PinnedD2H   float64 `json:"pinned_d2h_gbps"`
}

// AllocRow compares, for one size, a cached pinned Alloc+Free with a
// cudaHostAlloc+cudaFreeHost pair, in nanoseconds per pair.
type AllocRow struct {
	Bytes            int     `json:"bytes"`
	CachedNs         float64 `json:"cached_alloc_free_ns"`
	CachedRun        int     `json:"cached_alloc_free_pairs"`
	HostAllocFreeNs  float64 `json:"cuda_host_alloc_free_ns"`
	HostAllocFreeRun int     `json:"cuda_host_alloc_free_pairs"`
	Speedup          float64 `json:"speedup"`
}

// CopyReport is the result of Copies, and the JSON of
// `allocd bench --copies --json`.
type CopyReport struct {
	Device string     `json:"device"`
	Copies []CopyRow  `json:"copies"`
	Alloc  []AllocRow `json:"alloc"`
}

// Copies measures, on dev, for every size: H2D and D2H bandwidth from and
// to pageable Go memory (synchronous cudaMemcpy) and from and to a pooled
// pinned buffer (pinned.Allocator's copy helpers, cudaMemcpyAsync on one
// stream, synchronised once per run); and the cost of a cached pinned
// Alloc+Free against cudaHostAlloc+cudaFreeHost. Each run moves at least
// opt.Bytes; the best of opt.Trials runs counts.
func Copies(dev CopyDevice, opt CopyOptions) (CopyReport, error) {
	opt.defaults()
	rep := CopyReport{Device: dev.Info().Name}
	h, err := pinned.New(dev, pinned.DefaultConfig())
	if err != nil {
		return rep, err
	}
	defer h.Close()
	s, err := dev.StreamCreate()
	if err != nil {
		return rep, err
	}
	defer dev.StreamDestroy(s)
	for _, n := range opt.Sizes {
		row, err := copyRow(dev, h, s, n, opt)
		if err != nil {
			return rep, fmt.Errorf("bench: copies of %d bytes: %w", n, err)
		}
		rep.Copies = append(rep.Copies, row)
		if err := h.EmptyCache(); err != nil { // keep one size's buffer at a time
			return rep, err
		}
	}
	for _, n := range opt.AllocSizes {
		row, err := allocRow(dev, h, n, opt)
		if err != nil {
			return rep, fmt.Errorf("bench: alloc+free of %d bytes: %w", n, err)
		}
		rep.Alloc = append(rep.Alloc, row)
	}
	return rep, nil
}

func copyRow(dev CopyDevice, h *pinned.Allocator, s cudart.Stream, n int, opt CopyOptions) (CopyRow, error) {
	row := CopyRow{Bytes: n}
	reps := int(min(max(opt.Bytes/int64(n), 3), 2000))
	d, err := dev.Malloc(uint64(n))
	if err != nil {
		return row, err
	}
	defer dev.Free(d)
	page := make([]byte, n)
	for i := range page {
		page[i] = byte(i) // touch every page before timing
	}
	buf, err := h.Alloc(n)
	if err != nil {
		return row, err
	}
	defer h.Free(buf)
	copy(buf.Bytes(), page)
	gbps := func(run func() error) (float64, error) {
		if err := run(); err != nil { // warm-up
			return 0, err
		}
		best := time.Duration(0)
		for range opt.Trials {
			t0 := time.Now()
			for range reps {
				if err := run(); err != nil {
					return 0, err
				}
			}
			if err := dev.StreamSynchronize(s); err != nil {
				return 0, err
			}
			if el := time.Since(t0); best == 0 || el < best {
				best = el
			}
		}
		return float64(n) * float64(reps) / best.Seconds() / 1e9, nil
	}
	for _, m := range []struct {
		out *float64
		run func() error
	}{
		{&row.PageableH2D, func() error { return dev.MemcpyHtoD(d, page) }},
		{&row.PageableD2H, func() error { return dev.MemcpyDtoH(page, d) }},
		{&row.PinnedH2D, func() error { return h.CopyToDevice(d, buf, s) }},
		{&row.PinnedD2H, func() error { return h.CopyFromDevice(buf, d, s) }},
	} {
		if *m.out, err = gbps(m.run); err != nil {
			return row, err
		}
	}
	return row, nil
}

// cachedBatch is the number of cached Alloc+Free pairs between two reads
// of the clock in allocRow, and its warm-up.
const cachedBatch = 10_000

func allocRow(dev CopyDevice, h *pinned.Allocator, n int, opt CopyOptions) (AllocRow, error) {
	row := AllocRow{Bytes: n}
	warm, err := h.Alloc(n)
	if err != nil {
		return row, err
	}
	if err := h.Free(warm); err != nil {
		return row, err
	}
	pairs := func(k int) error {
		for range k {
			b, err := h.Alloc(n)
			if err != nil {
				return err
			}
			if err := h.Free(b); err != nil {
				return err
			}
		}
		return nil
	}
	if err := pairs(cachedBatch); err != nil { // warm-up, untimed
		return row, err
	}
	t0 := time.Now()
	var el time.Duration
	for row.CachedRun < opt.CachedIters || el < opt.CachedTime {
		if err := pairs(cachedBatch); err != nil {
			return row, err
		}
		row.CachedRun += cachedBatch
		el = time.Since(t0)
	}
	row.CachedNs = float64(el.Nanoseconds()) / float64(row.CachedRun)
	t0 = time.Now()
	for row.HostAllocFreeRun < 5 || time.Since(t0) < opt.HostAllocTime {
		b, err := dev.HostAlloc(uint64(n), pinned.DefaultFlags)
		if err != nil {
			return row, err
		}
		if err := dev.FreeHost(b); err != nil {
			return row, err
		}
		row.HostAllocFreeRun++
	}
	row.HostAllocFreeNs = float64(time.Since(t0).Nanoseconds()) / float64(row.HostAllocFreeRun)
	if row.CachedNs > 0 {
		row.Speedup = row.HostAllocFreeNs / row.CachedNs
	}
	return row, nil
}

// RunCopies runs Copies on dev and writes the tables (or, with asJSON, the
// CopyReport) to w: what `allocd bench --copies` prints. On the simulated
// device it uses a backed Sim of the same capacity, whose copies move
// bytes, with sizes up to 64 MiB, one short run each, and says that its
// figures are Go memory speeds, not a GPU's.
func RunCopies(w io.Writer, dev cudart.Device, asJSON bool) error {
	opt := CopyOptions{}
	if sim, ok := dev.(*simdev.Sim); ok {
		backed, err := simdev.New(simdev.Config{Capacity: sim.Info().TotalMemory, Backed: true})
		if err != nil {
			return err
		}
		dev = backed
		for _, n := range CopySizes {
			if n <= simCopyLimit {
				opt.Sizes = append(opt.Sizes, n)
			}
		}
		// Its figures mean nothing for a GPU: run the harness briefly.
		opt.Bytes, opt.Trials, opt.CachedIters, opt.CachedTime, opt.HostAllocTime = 64<<20, 1, 100_000, 20*time.Millisecond, 100*time.Millisecond
	}
	cd, ok := dev.(CopyDevice)
	if !ok {
		return fmt.Errorf("bench: the device %q has no page-locked host memory: %w", dev.Info().Name, cudart.ErrNotSupported)
	}
	rep, err := Copies(cd, opt)
	if err != nil {
		return err
	}
	if _, sim := dev.(*simdev.Sim); sim {
		rep.Device += " (simulated: copies are Go memmoves, cudaHostAlloc is Go's allocator)"
	}
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", " ")
		return enc.Encode(rep)
	}
	return rep.WriteText(w)
}

// RunCopies runs the copy benchmark on the target's device (RunCopies):
// the CUDA device, or a backed simulated one of the target's capacity.
func (t *Target) RunCopies(w io.Writer, asJSON bool) error {
	dev, err := t.Device(simdev.Config{})
	if err != nil {
		return err
	}
	return RunCopies(w, dev, asJSON)
}

// WriteText writes the report as two tables.
func (r CopyReport) WriteText(w io.Writer) error {
	fmt.Fprintf(w, "copy bandwidth on %s, GB/s (best of the runs):\n", r.Device)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "size\tpageable H2D\tpinned H2D\tpageable D2H\tpinned D2H\t")
	for _, c := range r.Copies {
		fmt.Fprintf(tw, "%s\t%.2f\t%.2f\t%.2f\t%.2f\t\n", bytecount.Exact(int64(c.Bytes)), c.PageableH2D, c.PinnedH2D, c.PageableD2H, c.PinnedD2H)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w, "\npinned alloc+free, ns per pair:")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "size\tcached Alloc+Free\tcudaHostAlloc+cudaFreeHost\tspeedup\t")
	for _, a := range r.Alloc {
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f\t%.0f×\t\n", bytecount.Exact(int64(a.Bytes)), a.CachedNs, a.HostAllocFreeNs, a.Speedup)
	}
	return tw.Flush()
}
