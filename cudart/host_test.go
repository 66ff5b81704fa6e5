package cudart

import (
	"bytes"
	"errors"
	"testing"
)

// TestHostMemory runs on a GPU and against the mock libraries: pinned
// memory round-trips through the device with the three async copies.
func TestHostMemory(t *testing.T) {
	c := openOrSkip(t)
	if _, err := c.HostAlloc(0, 0); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("HostAlloc(0) = %v, want ErrInvalidValue", err)
	}
	if _, err := c.HostAlloc(1, 1<<8); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("HostAlloc with an unknown flag = %v, want ErrInvalidValue", err)
	}
	for _, huge := range []uint64{1 << 50, 1 << 62, 1<<63 + 1, ^uint64(0)} {
		if b, err := c.HostAlloc(huge, HostAllocPortable|HostAllocMapped); !errors.Is(err, ErrOutOfMemory) {
			t.Errorf("HostAlloc(%d) = %d bytes, %v; want ErrOutOfMemory", huge, len(b), err)
		}
	}
	const n = 1 << 20
	h, err := c.HostAlloc(n, HostAllocPortable|HostAllocMapped)
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != n || cap(h) != n {
		t.Fatalf("HostAlloc slice len %d cap %d", len(h), cap(h))
	}
	for i := range h {
		h[i] = byte(i * 7)
	}
	want := bytes.Clone(h)
	a, err := c.Malloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free(a)
	b, err := c.Malloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free(b)
	s, err := c.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer c.StreamDestroy(s)
	if err := c.MemcpyHtoDAsync(a, h, s); err != nil {
		t.Fatal(err)
	}
	if err := c.MemcpyDtoDAsync(b, a, n, s); err != nil {
		t.Fatal(err)
	}
	back, err := c.HostAlloc(n, HostAllocPortable)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.MemcpyDtoHAsync(back, b, s); err != nil {
		t.Fatal(err)
	}
	if err := c.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, want) {
		t.Error("pinned round trip changed the bytes")
	}
	if err := c.MemcpyHtoDAsync(0, h, s); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("copy to the zero pointer = %v", err)
	}
	if err := c.FreeHost(h[1:]); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("FreeHost of an interior pointer = %v, want ErrInvalidValue", err)
	}
	if err := c.FreeHost(h); err != nil {
		t.Fatal(err)
	}
	if err := c.FreeHost(h); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("second FreeHost = %v, want ErrInvalidValue", err)
	}
	if err := c.FreeHost(back); err != nil {
		t.Fatal(err)
	}
}
