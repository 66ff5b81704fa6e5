package bench

import (
	"math"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/workload"
)

// fuzzTrace turns data into a device trace, four bytes an entry: what it
// is (segment_alloc, alloc, free, segment_free), where its address comes
// from (the range CUDA hands out, near 2^64, near 0, or unaligned), an
// offset and a size. Allocations go inside segments recorded so far and
// frees name earlier allocations, so that most traces are well formed.
func fuzzTrace(data []byte) []snapshot.Entry {
	const mib = 1 << 20
	var entries []snapshot.Entry
	var segs, allocs [][2]uint64
	for ; len(data) >= 4; data = data[4:] {
		kind, from, off, sz := data[0]%4, data[1]%4, uint64(data[2]), uint64(data[3])
		switch kind {
		case 0:
			size := (sz%24 + 1) * 2 * mib
			var addr uint64
			switch from {
			case 0:
				addr = 0x7f0000000000 + off*2*mib
			case 1:
				addr = math.MaxUint64 - off*2*mib + 1
			case 2:
				addr = off * 2 * mib
			case 3:
				addr = 0x7f0000000000 + off*512
			}
			entries = append(entries, snapshot.Entry{Action: snapshot.ActionSegmentAlloc, Addr: addr, Size: size})
			segs = append(segs, [2]uint64{addr, size})
		case 1:
			if len(segs) == 0 {
				continue
			}
			s := segs[int(off)%len(segs)]
			size := min((sz+1)*512*(1+uint64(from)*1000), s[1])
			entries = append(entries, snapshot.Entry{Action: snapshot.ActionAlloc, Addr: s[0] + uint64(from)*512, Size: size})
			allocs = append(allocs, [2]uint64{s[0] + uint64(from)*512, size})
		case 2:
			if len(allocs) == 0 {
				continue
			}
			i := int(off) % len(allocs)
			a := allocs[i]
			allocs = append(allocs[:i], allocs[i+1:]...)
			entries = append(entries, snapshot.Entry{Action: snapshot.ActionFreeRequested, Addr: a[0], Size: a[1]},
				snapshot.Entry{Action: snapshot.ActionFreeCompleted, Addr: a[0], Size: a[1]})
		case 3:
			if len(segs) == 0 {
				continue
			}
			i := int(off) % len(segs)
			entries = append(entries, snapshot.Entry{Action: snapshot.ActionSegmentFree, Addr: segs[i][0], Size: segs[i][1]})
			segs = append(segs[:i], segs[i+1:]...)
		}
	}
	return entries
}

// FuzzReplayPlan replays traces whose recorded segment addresses are
// fuzzed: a plan workload.CheckSegments refuses is refused by the replay with an
// error naming the entry; any other replays with the recorded addresses
// planned on a simulated device, and the allocator's Check passes after
// it (Target.Replay runs it), with and without expandable segments.
func FuzzReplayPlan(f *testing.F) {
	f.Add(false, []byte{0, 0, 0, 0, 1, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0, 3})       // the same address twice
	f.Add(false, []byte{0, 1, 1, 9, 1, 0, 0, 255, 1, 1, 0, 255, 1, 2, 0, 255}) // wraps past 2^64
	f.Add(false, []byte{0, 3, 1, 0, 1, 0, 0, 0})                               // unaligned
	f.Add(true, []byte{0, 2, 0, 0, 1, 0, 0, 0})                                // at 0
	f.Add(true, []byte{0, 0, 0, 3, 1, 0, 0, 7, 1, 1, 0, 9, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 3, 1, 0, 0, 1})
	target, err := OpenTarget("sim", 64<<30)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = target.Close() })
	f.Fuzz(func(t *testing.T, expandable bool, data []byte) {
		if len(data) > 4*256 {
			return
		}
		tr := workload.NewTrace("fuzz", fuzzTrace(data))
		cfg := allocator.DefaultConfig()
		cfg.ExpandableSegments = expandable
		_, err := target.Replay(tr, cfg, workload.ReplayOptions{}, nil)
		if perr := tr.CheckPlan(); perr != nil {
			if err == nil || !strings.Contains(err.Error(), "trace entry") {
				t.Fatalf("plan refused (%v) but the replay said %v", perr, err)
			}
			return
		}
		if err != nil {
			t.Fatalf("replay of an accepted plan: %v", err)
		}
		lo, hi, _ := simdev.Range(0)
		for i, a := range tr.Addresses {
			if a.Addr < lo || uint64(a.Addr)+a.Size > uint64(hi) || uint64(a.Addr)+a.Size < uint64(a.Addr) {
				t.Fatalf("accepted planned address %d, [%#x, +%d), lies outside [%#x, %#x)", i, uint64(a.Addr), a.Size, uint64(lo), uint64(hi))
			}
		}
	})
}
