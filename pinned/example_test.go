package pinned_test

import (
	"fmt"

	"github.com/allocd/allocd/pinned"
	"github.com/allocd/allocd/simdev"
)

// Fill a pinned buffer from Go, copy it to the device, free it at once
// (the allocator keeps it until the copy has run), and copy the data back.
func Example() {
	dev, _ := simdev.New(simdev.Config{Capacity: 1 << 30, Backed: true})
	h, err := pinned.New(dev, pinned.DefaultConfig())
	if err != nil {
		panic(err)
	}
	defer h.Close()
	s, _ := dev.StreamCreate()
	p, _ := dev.Malloc(5)

	in, _ := h.Alloc(5)
	copy(in.Bytes(), "hello")
	if err := h.CopyToDevice(p, in, s); err != nil {
		panic(err)
	}
	_ = h.Free(in) // reused only once s has run the copy

	out, _ := h.Alloc(5)
	if err := h.CopyFromDevice(out, p, s); err != nil {
		panic(err)
	}
	_ = dev.StreamSynchronize(s) // the bytes are there once the stream is
	fmt.Println(string(out.Bytes()))
	_ = h.Free(out)
	fmt.Println(h.Stats().Map()["num_host_alloc"], "cudaHostAlloc call")
	// Output:
	// hello
	// 1 cudaHostAlloc call
}
