package gputest

import (
	"fmt"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
)

// TestGPUVirtualMemoryCost times the calls expandable segments make for
// each page, at the page sizes expandable_page_mb offers: create (physical
// memory), map with access, unmap, release. It fails only on an error; the
// figures say how a range's growth cost depends on its page size.
func TestGPUVirtualMemoryCost(t *testing.T) {
	dev := openGPU(t)
	const n = 40
	for _, page := range []uint64{2 * miB, 4 * miB, 10 * miB, 20 * miB, 32 * miB, 64 * miB} {
		base, err := dev.Reserve(n * page)
		if err != nil {
			t.Fatal(err)
		}
		hs := make([]cudart.Handle, n)
		var create, mapAccess, unmap, mapRange, unmapRange, release time.Duration
		t0 := time.Now()
		for i := range hs {
			if hs[i], err = dev.Create(page); err != nil {
				t.Fatal(err)
			}
		}
		create = time.Since(t0)
		t0 = time.Now()
		for i, h := range hs {
			if err := dev.Map(base+cudart.Ptr(uint64(i)*page), page, h); err != nil {
				t.Fatal(err)
			}
		}
		mapAccess = time.Since(t0)
		t0 = time.Now()
		for i := range hs {
			if err := dev.Unmap(base+cudart.Ptr(uint64(i)*page), page); err != nil {
				t.Fatal(err)
			}
		}
		unmap = time.Since(t0)
		// Again, in one call with one access grant (cudart.RangeMapper).
		t0 = time.Now()
		if err := dev.MapRange(base, page, hs); err != nil {
			t.Fatal(err)
		}
		mapRange = time.Since(t0)
		// And unmapped in one call, as expandable segments unmap a
		// stretch of runs.
		t0 = time.Now()
		if err := dev.Unmap(base, n*page); err != nil {
			t.Fatal(err)
		}
		unmapRange = time.Since(t0)
		t0 = time.Now()
		for _, h := range hs {
			if err := dev.Release(h); err != nil {
				t.Fatal(err)
			}
		}
		release = time.Since(t0)
		if err := dev.ReleaseRange(base, n*page); err != nil {
			t.Fatal(err)
		}
		us := func(d time.Duration) float64 { return float64(d.Microseconds()) / n }
		line := fmt.Sprintf("gpu-vmm: page %d MiB: create %.1f µs, map+access %.1f µs, map in a range %.1f µs, unmap %.1f µs, unmap in one call %.1f µs, release %.1f µs per page; growth %.1f µs per 20 MiB page by page, %.1f µs in ranges",
			page>>20, us(create), us(mapAccess), us(mapRange), us(unmap), us(unmapRange), us(release),
			(us(create)+us(mapAccess))*float64(20*miB)/float64(page), (us(create)+us(mapRange))*float64(20*miB)/float64(page))
		t.Log(line)
		fmt.Println(line)
	}
}
