package bench

import (
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/workload"
)

// ReplayRow is one replay's result in the JSON shape `allocd replay
// --json` prints, one object a line.
type ReplayRow struct {
	Trace              string  `json:"trace"`
	Conf               string  `json:"conf"`
	Ops                int     `json:"ops"`
	PeakAllocatedBytes int64   `json:"peak_allocated_bytes"`
	PeakReservedBytes  int64   `json:"peak_reserved_bytes"`
	PeakRequestedBytes int64   `json:"peak_requested_bytes"`
	DeviceMallocs      int64   `json:"device_mallocs"`
	DeviceFrees        int64   `json:"device_frees"`
	AllocRetries       int64   `json:"alloc_retries"`
	OOMs               int64   `json:"ooms"`
	NsPerOp            float64 `json:"ns_per_op"`
	// DeviceMallocNsPerOp is the share of NsPerOp spent in device mallocs.
	DeviceMallocNsPerOp float64 `json:"device_malloc_ns_per_op"`
	// Reclaims, PagesMoved and PagesMovedAcrossStreams count expandable
	// segments' reclaims (allocator.Stats.NumReclaims and the pages they
	// moved); left out when 0.
	Reclaims                int64 `json:"reclaims,omitempty"`
	PagesMoved              int64 `json:"pages_moved,omitempty"`
	PagesMovedAcrossStreams int64 `json:"pages_moved_across_streams,omitempty"`
	// Lends counts free blocks of one stream's expandable segment handed
	// out to another stream (allocator.Stats.NumLends); left out when 0.
	Lends int64 `json:"lends,omitempty"`
	// SmallFromLarge counts small requests that expandable segments
	// served from the large pool (allocator.Stats.NumSmallFromLarge);
	// left out when 0.
	SmallFromLarge int64 `json:"small_from_large,omitempty"`
	// VMM is the driver's virtual memory calls of expandable segments and
	// their time; left out without them.
	VMM *VMMRow `json:"vmm,omitempty"`
	// PyTorchExpandable is set when expandable segments ran with
	// allocator.WithPyTorchExpandable (allocd replay --pytorch-expandable).
	PyTorchExpandable bool `json:"pytorch_expandable,omitempty"`
	// WarmFigures are set by `allocd bench` (RunSuite); nil, and left out
	// of the JSON, in `allocd replay`.
	*WarmFigures
}

// VMMRow is the driver's virtual memory calls of an expandable replay
// (allocator.VMMCalls): handles created, mapped (each map with its grant
// of access, one grant per range mapped in one call), unmapped (one call
// per contiguous stretch of runs) and released, and the nanoseconds each
// kind took, with their total; then the runs taken back through standby
// mappings (no call), the waits for a stream's queued work that
// reclaim made (a stream or an event synchronised), and the time of the
// calls that order memory against queued work (events and stream
// synchronisations, the waits included; not part of TotalNs).
type VMMRow struct {
	Creates   int64 `json:"creates"`
	Maps      int64 `json:"maps"`
	Grants    int64 `json:"access_grants"`
	Unmaps    int64 `json:"unmaps"`
	Releases  int64 `json:"releases"`
	CreateNs  int64 `json:"create_ns"`
	MapNs     int64 `json:"map_ns"`
	UnmapNs   int64 `json:"unmap_ns"`
	ReleaseNs int64 `json:"release_ns"`
	TotalNs   int64 `json:"total_ns"`
	Revived   int64 `json:"revived"`
	Waits     int64 `json:"waits"`
	SyncNs    int64 `json:"sync_ns"`
}

// VMMRowOf returns c as a row, nil when no call was made.
func VMMRowOf(c allocator.VMMCalls) *VMMRow {
	if c.Counts() == (allocator.VMMCalls{}) {
		return nil
	}
	return &VMMRow{c.Creates, c.Maps, c.Grants, c.Unmaps, c.Releases,
		c.CreateTime.Nanoseconds(), c.MapTime.Nanoseconds(), c.UnmapTime.Nanoseconds(), c.ReleaseTime.Nanoseconds(),
		c.Total().Nanoseconds(), c.Revived, c.Waits, c.SyncTime.Nanoseconds()}
}

// WarmFigures are what `allocd bench` measures of a trace beside its cold
// replay (ReplayRow.NsPerOp, on a fresh allocator): the warm replay, as
// PyTorch's anchor measures replay_warm, and the replay driver's own cost.
type WarmFigures struct {
	// WarmNsPerOp is the time per operation of the second of two passes
	// over the trace on one allocator (workload.ReplayWarm).
	WarmNsPerOp float64 `json:"warm_ns_per_op"`
	// WarmDeviceMallocs counts the device mallocs of that pass: 0 when the
	// cache the first pass filled serves it all.
	WarmDeviceMallocs int64 `json:"warm_device_mallocs"`
	// WarmDeviceMallocNsPerOp is the share of WarmNsPerOp spent in device
	// mallocs.
	WarmDeviceMallocNsPerOp float64 `json:"warm_device_malloc_ns_per_op"`
	// WarmVMM is the virtual memory calls of that pass (expandable
	// segments only): what a workload that repeats its steps pays in each.
	WarmVMM *VMMRow `json:"warm_vmm,omitempty"`
	// DriverNsPerOp is the replay loop's own cost per operation, the
	// allocator left out (workload.DriverCost): a part of NsPerOp and of
	// WarmNsPerOp that is not the allocator's.
	DriverNsPerOp float64 `json:"driver_ns_per_op"`
}

// WarmFiguresOf returns the figures of a warm replay (workload.ReplayWarm)
// and of the driver alone (workload.DriverCost).
func WarmFiguresOf(warm, driver workload.ReplayResult) *WarmFigures {
	w := &WarmFigures{WarmNsPerOp: warm.NsPerOp(), WarmDeviceMallocs: warm.DeviceMallocs, WarmVMM: VMMRowOf(warm.VMM),
		DriverNsPerOp: driver.NsPerOp()}
	if warm.Ops > 0 {
		w.WarmDeviceMallocNsPerOp = float64(warm.DeviceMallocTime.Nanoseconds()) / float64(warm.Ops)
	}
	return w
}

// RowOf returns r as a row, with Trace and Conf empty.
func RowOf(r workload.ReplayResult) ReplayRow {
	row := ReplayRow{
		Ops:                     r.Ops,
		PeakAllocatedBytes:      r.PeakAllocated,
		PeakReservedBytes:       r.PeakReserved,
		PeakRequestedBytes:      r.PeakRequested,
		DeviceMallocs:           r.DeviceMallocs,
		DeviceFrees:             r.DeviceFrees,
		AllocRetries:            r.AllocRetries,
		OOMs:                    r.OOMs,
		NsPerOp:                 r.NsPerOp(),
		Reclaims:                r.Reclaims,
		PagesMoved:              r.PagesMoved,
		PagesMovedAcrossStreams: r.PagesMovedAcrossStreams,
		Lends:                   r.Lends,
		SmallFromLarge:          r.SmallFromLarge,
		VMM:                     VMMRowOf(r.VMM),
	}
	if r.Ops > 0 {
		row.DeviceMallocNsPerOp = float64(r.DeviceMallocTime.Nanoseconds()) / float64(r.Ops)
	}
	return row
}

// MixedRow is one run of the mixed benchmark in `allocd bench --json`.
type MixedRow struct {
	Threads            int     `json:"threads"`
	Ops                int     `json:"ops"`
	NsPerOp            float64 `json:"ns_per_op"`
	MopsPerSec         float64 `json:"mops_per_s"`
	PeakAllocatedBytes int64   `json:"peak_allocated_bytes"`
	PeakReservedBytes  int64   `json:"peak_reserved_bytes"`
	Escalations        int64   `json:"escalations"`
	// The timed pass's escalations, borrows and steals
	// (MixedResult.TimedEscalations, TimedBorrows, TimedSteals).
	TimedEscalations int64 `json:"timed_escalations"`
	TimedBorrows     int64 `json:"timed_cap_borrows"`
	TimedSteals      int64 `json:"timed_cap_steals"`
	// FirstDoneMs and LastDoneMs: when the first and the last goroutine
	// finished their steps (MixedResult.FirstDone, LastDone).
	FirstDoneMs float64 `json:"first_done_ms"`
	LastDoneMs  float64 `json:"last_done_ms"`
}

// MixedRowOf returns m as a row.
func MixedRowOf(m MixedResult) MixedRow {
	ms := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }
	return MixedRow{m.Threads, m.Ops, m.NsPerOp(), m.MopsPerSec(), m.PeakAllocated, m.PeakReserved, m.Escalations,
		m.TimedEscalations, m.TimedBorrows, m.TimedSteals, ms(m.FirstDone), ms(m.LastDone)}
}

// Report is every result of one `allocd bench` run, in the JSON shape of
// its --json.
type Report struct {
	Device string `json:"device"`
	Conf   string `json:"conf"`
	// Pair maps a pair size in bytes, in decimal, to its best ns per pair.
	Pair  map[string]float64 `json:"pair_ns"`
	Mixed []MixedRow         `json:"mixed"`
	// Warm holds mixed_warm: the mixed pattern twice on the same streams,
	// the second pass timed.
	Warm   []MixedRow  `json:"mixed_warm"`
	Replay []ReplayRow `json:"replay"`
}

// ConfLabel is how tables and charts name a configuration: the string
// itself, or "(default)" for the empty one.
func ConfLabel(conf string) string {
	if conf == "" {
		return "(default)"
	}
	return conf
}

func mibString(n int64) string { return strconv.FormatFloat(float64(n)/(1<<20), 'f', 0, 64) }

// BestRows marks, per trace, the row with the lowest peak reserved among
// those without OOMs (fewer device mallocs breaks a tie); nothing is
// marked for a trace replayed with one configuration. Keys are indexes
// into rows.
func BestRows(rows []ReplayRow) map[int]bool {
	best := map[string]int{}
	count := map[string]int{}
	for i, r := range rows {
		count[r.Trace]++
		if r.OOMs > 0 {
			continue
		}
		j, ok := best[r.Trace]
		if !ok || r.PeakReservedBytes < rows[j].PeakReservedBytes ||
			(r.PeakReservedBytes == rows[j].PeakReservedBytes && r.DeviceMallocs < rows[j].DeviceMallocs) {
			best[r.Trace] = i
		}
	}
	marked := map[int]bool{}
	for t, i := range best {
		if count[t] > 1 {
			marked[i] = true
		}
	}
	return marked
}

// WriteReplayTable writes rows as an aligned table, in MiB, with the best
// row of each trace (BestRows) marked "*" in a best column. The column is
// left out when no trace has several configurations to compare. When rows
// have WarmFigures (`allocd bench`), columns follow ns/op: the cold
// replay's ns/op in device mallocs, the warm replay's ns/op and device
// mallocs, and the driver's ns/op; a line under the table names each
// trace whose warm pass made device mallocs.
func WriteReplayTable(w io.Writer, rows []ReplayRow) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	confs := map[string]int{}
	compared, warm := false, false
	for _, r := range rows {
		confs[r.Trace]++
		compared = compared || confs[r.Trace] > 1
		warm = warm || r.WarmFigures != nil
	}
	header := "trace\tconf\tops\tpeak allocated MiB\tpeak reserved MiB\treserved/allocated\tdevice mallocs\tretries\tOOMs\tns/op\t"
	if warm {
		header += "device ns/op\twarm ns/op\twarm device mallocs\tdriver ns/op\t"
	}
	if compared {
		header += "best\t"
	}
	fmt.Fprintln(tw, header)
	best := BestRows(rows)
	for i, r := range rows {
		ratio := 0.0
		if r.PeakAllocatedBytes > 0 {
			ratio = float64(r.PeakReservedBytes) / float64(r.PeakAllocatedBytes)
		}
		label := ConfLabel(r.Conf)
		if r.PyTorchExpandable {
			label += " (as PyTorch)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%.3f\t%d\t%d\t%d\t%.0f\t", r.Trace, label, r.Ops,
			mibString(r.PeakAllocatedBytes), mibString(r.PeakReservedBytes), ratio, r.DeviceMallocs, r.AllocRetries, r.OOMs, r.NsPerOp)
		if warm {
			if wf := r.WarmFigures; wf != nil {
				fmt.Fprintf(tw, "%.0f\t%.0f\t%d\t%.1f\t", r.DeviceMallocNsPerOp, wf.WarmNsPerOp, wf.WarmDeviceMallocs, wf.DriverNsPerOp)
			} else {
				fmt.Fprint(tw, "\t\t\t\t")
			}
		}
		if compared {
			mark := ""
			if best[i] {
				mark = "*"
			}
			fmt.Fprint(tw, mark+"\t")
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rows {
		if r.WarmFigures != nil && r.WarmDeviceMallocs > 0 {
			if _, err := fmt.Fprintf(w, "%s, %s: the warm pass made %d device mallocs (%.0f ns/op): the cache the first pass filled did not serve it all\n",
				r.Trace, ConfLabel(r.Conf), r.WarmDeviceMallocs, r.WarmDeviceMallocNsPerOp); err != nil {
				return err
			}
		}
	}
	return nil
}

// WriteReport writes rep as tables: the pair benchmark (in PairSizes'
// order), the mixed benchmark and the replays (WriteReplayTable), each
// only when it has results.
func WriteReport(w io.Writer, rep Report) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	if len(rep.Pair) > 0 {
		fmt.Fprintln(tw, "benchmark\tns/pair\t")
		for _, size := range PairSizes {
			fmt.Fprintf(tw, "pair/%d\t%.0f\t\n", size, rep.Pair[fmt.Sprint(size)])
		}
		fmt.Fprintln(tw, "\t\t")
	}
	if len(rep.Mixed) > 0 {
		fmt.Fprintln(tw, "benchmark\tns/op\tMops/s\tpeak allocated MiB\tpeak reserved MiB\t")
		for _, m := range rep.Mixed {
			fmt.Fprintf(tw, "mixed/threads=%d\t%.0f\t%.2f\t%s\t%s\t\n", m.Threads, m.NsPerOp, m.MopsPerSec, mibString(m.PeakAllocatedBytes), mibString(m.PeakReservedBytes))
		}
		for _, m := range rep.Warm {
			fmt.Fprintf(tw, "mixed_warm/threads=%d\t%.0f\t%.2f\t%s\t%s\t\n", m.Threads, m.NsPerOp, m.MopsPerSec, mibString(m.PeakAllocatedBytes), mibString(m.PeakReservedBytes))
		}
		fmt.Fprintln(tw, "\t\t\t\t\t")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(rep.Replay) > 0 {
		return WriteReplayTable(w, rep.Replay)
	}
	return nil
}
