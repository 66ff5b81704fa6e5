package pinned

// Stat is one statistic as PyTorch keeps it: its current value, its peak
// since the last ResetPeakStats, and the totals added and taken away.
type Stat struct {
	Current, Peak, Allocated, Freed int64
}

func (s *Stat) add(n int64) {
	s.Current += n
	s.Allocated += n
	s.Peak = max(s.Peak, s.Current)
}

func (s *Stat) sub(n int64) {
	s.Current -= n
	s.Freed += n
}

// DurationStat is PyTorch's DurationStat: the total, largest and smallest
// of a set of durations in microseconds, and how many there were.
type DurationStat struct {
	Total, Max, Min, Count int64
}

func (d *DurationStat) add(us int64) {
	if d.Count == 0 || us < d.Min {
		d.Min = us
	}
	d.Max = max(d.Max, us)
	d.Total += us
	d.Count++
}

// Avg is Total/Count, 0 without samples.
func (d DurationStat) Avg() int64 {
	if d.Count == 0 {
		return 0
	}
	return d.Total / d.Count
}

// Stats are the allocator's statistics, with the meaning of PyTorch's
// HostStats (torch.cuda.host_memory_stats()).
type Stats struct {
	// Allocation counts blocks in use: handed out, or freed with events
	// still outstanding ("allocation").
	Allocation Stat
	// Segment counts blocks page-locked from the system ("segment").
	Segment Stat
	// AllocatedBytes is the class size of the blocks Allocation counts
	// ("allocated_bytes").
	AllocatedBytes Stat
	// ReservedBytes is the size of the blocks Segment counts
	// ("reserved_bytes").
	ReservedBytes Stat
	// RequestedBytes is what callers asked for in live buffers, before
	// rounding (allocd only).
	RequestedBytes Stat
	// NumHostAlloc counts cudaHostAlloc calls that returned memory
	// ("num_host_alloc").
	NumHostAlloc int64
	// NumHostFree counts cudaFreeHost calls ("num_host_free").
	NumHostFree int64
	// HostAllocTime and HostFreeTime time those calls, in microseconds
	// ("host_alloc_time", "host_free_time").
	HostAllocTime, HostFreeTime DurationStat
	// PendingEvents is the number of events recorded at Free not yet seen
	// complete; CachedBytes the bytes of free blocks (allocd only).
	PendingEvents int
	CachedBytes   int64
	// DestroyedStreamSyncs counts the device synchronisations Free made
	// because a stream recorded on the buffer was destroyed before it;
	// QueryFailureSyncs those made because querying a pending event failed
	// (allocd only; see the package documentation).
	DestroyedStreamSyncs, QueryFailureSyncs int64
}

// Stats returns a copy of the statistics.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.stats
	st.PendingEvents = len(a.pending)
	for _, l := range a.free {
		for _, b := range l {
			st.CachedBytes += int64(len(b.data))
		}
	}
	return st
}

// Map returns the statistics under torch.cuda.host_memory_stats()'s keys:
// "allocation.current", "segment.peak", "allocated_bytes.allocated",
// "reserved_bytes.freed", …, "num_host_alloc", "num_host_free",
// "host_alloc_time.{total,max,min,count,avg}" and the same for
// host_free_time. allocd's own figures are not in it.
func (s Stats) Map() map[string]int64 {
	m := make(map[string]int64, 28)
	for _, st := range []struct {
		name string
		s    Stat
	}{{"allocation", s.Allocation}, {"segment", s.Segment}, {"allocated_bytes", s.AllocatedBytes}, {"reserved_bytes", s.ReservedBytes}} {
		m[st.name+".current"] = st.s.Current
		m[st.name+".peak"] = st.s.Peak
		m[st.name+".allocated"] = st.s.Allocated
		m[st.name+".freed"] = st.s.Freed
	}
	m["num_host_alloc"] = s.NumHostAlloc
	m["num_host_free"] = s.NumHostFree
	for _, d := range []struct {
		name string
		d    DurationStat
	}{{"host_alloc_time", s.HostAllocTime}, {"host_free_time", s.HostFreeTime}} {
		m[d.name+".total"] = d.d.Total
		m[d.name+".max"] = d.d.Max
		m[d.name+".min"] = d.d.Min
		m[d.name+".count"] = d.d.Count
		m[d.name+".avg"] = d.d.Avg()
	}
	return m
}

// ResetPeakStats sets every peak to its current value
// (torch.cuda.reset_peak_host_memory_stats()).
func (a *Allocator) ResetPeakStats() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, s := range []*Stat{&a.stats.Allocation, &a.stats.Segment, &a.stats.AllocatedBytes, &a.stats.ReservedBytes, &a.stats.RequestedBytes} {
		s.Peak = s.Current
	}
	a.stats.HostAllocTime.Max, a.stats.HostAllocTime.Min = 0, 0
	a.stats.HostFreeTime.Max, a.stats.HostFreeTime.Min = 0, 0
}

// ResetAccumulatedStats zeroes the totals: every Stat's Allocated and Freed,
// the call counts and the timings (torch.cuda.reset_accumulated_host_memory_stats()).
func (a *Allocator) ResetAccumulatedStats() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, s := range []*Stat{&a.stats.Allocation, &a.stats.Segment, &a.stats.AllocatedBytes, &a.stats.ReservedBytes, &a.stats.RequestedBytes} {
		s.Allocated, s.Freed = 0, 0
	}
	a.stats.NumHostAlloc, a.stats.NumHostFree = 0, 0
	a.reset = true
	a.stats.HostAllocTime, a.stats.HostFreeTime = DurationStat{}, DurationStat{}
}
