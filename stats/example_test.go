package stats_test

import (
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/stats"
)

// Export an allocator's statistics to Prometheus: register a collector
// with a registry of your own and serve it with promhttp.HandlerFor.
func ExampleNewCollector() {
	sim, _ := simdev.New(simdev.Config{Capacity: 1 << 30})
	defer sim.Close()
	a, _ := allocator.New(sim, allocator.DefaultConfig())
	defer a.Close()

	c, err := stats.NewCollector(a)
	if err != nil {
		fmt.Println(err)
		return
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)

	p, _ := a.Malloc(3<<20, cudart.DefaultStream)
	_, _ = a.Malloc(2<<30, cudart.DefaultStream) // more than the device holds
	err = testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP allocd_ooms_total Mallocs that failed with an out-of-memory error.
# TYPE allocd_ooms_total counter
allocd_ooms_total{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0"} 1
`), "allocd_ooms_total")
	fmt.Println("ooms_total as expected:", err == nil)
	n, _ := testutil.GatherAndCount(reg, "allocd_allocated_bytes")
	fmt.Println("allocated_bytes series (small and large pool):", n)
	_ = a.Free(p)
	// Output:
	// ooms_total as expected: true
	// allocated_bytes series (small and large pool): 2
}

// Print torch.cuda.memory_summary()'s table for one device.
func ExampleSummary() {
	sim, _ := simdev.New(simdev.Config{Capacity: 1 << 30})
	defer sim.Close()
	a, _ := allocator.New(sim, allocator.DefaultConfig())
	defer a.Close()
	p, _ := a.Malloc(3<<20, cudart.DefaultStream)
	defer a.Free(p)

	table := stats.Summary(a.Stats(), 0)
	for _, line := range strings.Split(table, "\n") {
		if strings.HasPrefix(line, "| Allocated memory") || strings.HasPrefix(line, "| GPU reserved memory") {
			fmt.Println(strings.Join(strings.Fields(line), " "))
		}
	}
	// Output:
	// | Allocated memory | 3072 KiB | 3072 KiB | 3072 KiB | 0 B |
	// | GPU reserved memory | 20480 KiB | 20480 KiB | 20480 KiB | 0 B |
}
