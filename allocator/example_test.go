package allocator_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// Open the device ALLOCD_DEVICE names (here a simulated one of 1 GiB),
// configured by ALLOCD_CONF.
func ExampleOpen() {
	os.Setenv("ALLOCD_DEVICE", "sim")
	os.Setenv("ALLOCD_SIM_CAPACITY", "1GiB")
	os.Setenv("ALLOCD_CONF", "max_split_size_mb:256")
	defer os.Unsetenv("ALLOCD_DEVICE")
	defer os.Unsetenv("ALLOCD_SIM_CAPACITY")
	defer os.Unsetenv("ALLOCD_CONF")

	a, err := allocator.Open(0)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer a.Close() // closes the device too
	p, err := a.Malloc(3<<20, cudart.DefaultStream)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("config:", a.Config())
	fmt.Println("allocated:", allocator.FormatSize(uint64(a.MemoryAllocated())))
	fmt.Println("reserved:", allocator.FormatSize(uint64(a.MemoryReserved())))
	_ = a.Free(p)
	// Output:
	// config: max_split_size_mb:256
	// allocated: 3.00 MiB
	// reserved: 20.00 MiB
}

// newSim returns an allocator over a simulated device whose events
// complete only when told to.
func newSim(capacity uint64) (*allocator.Allocator, *simdev.Sim) {
	sim, err := simdev.New(simdev.Config{Capacity: capacity, ManualEvents: true})
	if err != nil {
		panic(err)
	}
	a, err := allocator.New(sim, allocator.DefaultConfig())
	if err != nil {
		panic(err)
	}
	return a, sim
}

func states(a *allocator.Allocator) []snapshot.BlockState {
	var out []snapshot.BlockState
	for _, s := range a.Snapshot().Segments {
		for _, b := range s.Blocks {
			out = append(out, b.State)
		}
	}
	return out
}

// A block used by a second stream is reused only once that stream's work
// queued before the Free has completed.
func ExampleAllocator_RecordStream() {
	a, sim := newSim(1 << 30)
	defer sim.Close()
	defer a.Close()
	side, _ := sim.StreamCreate()

	p, _ := a.Malloc(1<<20, cudart.DefaultStream)
	_ = a.RecordStream(p, side) // a kernel on side reads p
	_ = a.Free(p)
	fmt.Println("after Free:", states(a))

	sim.CompleteStream(side) // the kernel finished
	q, _ := a.Malloc(512, cudart.DefaultStream)
	fmt.Println("after the next Malloc:", states(a))
	_ = a.Free(q)
	// Output:
	// after Free: [active_pending_free inactive]
	// after the next Malloc: [active_allocated inactive]
}

// Handle an out-of-memory error: it says how much was asked for and what
// the device holds, and counts in num_ooms.
func ExampleOOMError() {
	a, sim := newSim(1 << 30)
	defer sim.Close()
	defer a.Close()

	_, err := a.Malloc(2<<30, cudart.DefaultStream)
	var oom *allocator.OOMError
	if errors.As(err, &oom) {
		fmt.Println("requested:", allocator.FormatSize(oom.Requested))
		fmt.Println("device total:", allocator.FormatSize(oom.DeviceTotal))
	}
	fmt.Println("is ErrOutOfMemory:", errors.Is(err, allocator.ErrOutOfMemory))
	fmt.Println("num_ooms:", a.Stats().NumOOMs)
	// Output:
	// requested: 2.00 GiB
	// device total: 1.00 GiB
	// is ErrOutOfMemory: true
	// num_ooms: 1
}

// Record history, then write the snapshot memory_viz opens; the JSON view
// is the same value with PyTorch's keys.
func ExampleAllocator_WriteSnapshot() {
	a, sim := newSim(1 << 30)
	defer sim.Close()
	defer a.Close()
	_ = a.RecordHistory(allocator.HistoryOptions{MaxEntries: 10_000})

	p, _ := a.Malloc(4096, cudart.DefaultStream)
	var buf bytes.Buffer
	if err := a.WriteSnapshot(&buf); err != nil { // e.g. to a .pickle file
		fmt.Println(err)
		return
	}
	back, _ := trace.Read(&buf, trace.ReadOptions{})
	for _, e := range back.DeviceTraces[0] {
		fmt.Println(e.Action, e.Size)
	}
	js, _ := json.Marshal(a.Snapshot().Segments[0].Blocks[0])
	fmt.Println(string(js))
	_ = a.Free(p)
	// Output:
	// segment_alloc 2097152
	// alloc 4096
	// {"address":17592186044416,"size":4096,"requested_size":4096,"state":"active_allocated"}
}
