package stats

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/simdev"
)

// TestEveryOOMCounts: a request larger than the device, one over the
// per_process_memory_fraction cap, and one the device refuses after the
// cache is released each count in num_ooms and allocd_ooms_total, log one
// warning and leave an oom history entry.
func TestEveryOOMCounts(t *testing.T) {
	const capacity = 1 << 30
	sim, err := simdev.New(simdev.Config{Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	cfg, err := allocator.ParseConfig("per_process_memory_fraction:0.5")
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.WarnLevel)
	a, err := allocator.New(sim, cfg, allocator.WithLogger(zap.New(core)), allocator.WithHistory(100))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	c, err := NewCollector(a)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)

	p, err := a.Malloc(400<<20, 0) // within the cap: the third request cannot fit beside it
	if err != nil {
		t.Fatal(err)
	}
	for i, size := range []uint64{2 * capacity, capacity * 3 / 4, 200 << 20} {
		_, err := a.Malloc(size, 0)
		if !errors.Is(err, allocator.ErrOutOfMemory) {
			t.Fatalf("request %d of %d bytes: %v, want an OOM", i+1, size, err)
		}
		want := int64(i + 1)
		if got := a.Stats().NumOOMs; got != want {
			t.Errorf("after OOM %d: num_ooms = %d, want %d", i+1, got, want)
		}
		exp := fmt.Sprintf(`
# HELP allocd_ooms_total Mallocs that failed with an out-of-memory error.
# TYPE allocd_ooms_total counter
allocd_ooms_total{UUID="%s",gpu="0"} %d
`, simUUID, want)
		if err := testutil.GatherAndCompare(reg, strings.NewReader(exp), "allocd_ooms_total"); err != nil {
			t.Errorf("after OOM %d: %v", i+1, err)
		}
		if n := logs.FilterMessage("out of memory").Len(); n != i+1 {
			t.Errorf("after OOM %d: %d warnings logged, want %d", i+1, n, i+1)
		}
	}
	var ooms int
	for _, e := range a.Snapshot().DeviceTraces[0] {
		if e.Action == "oom" {
			ooms++
		}
	}
	if ooms != 3 {
		t.Errorf("%d oom history entries, want 3", ooms)
	}
	if err := a.Free(p); err != nil {
		t.Fatal(err)
	}
}
