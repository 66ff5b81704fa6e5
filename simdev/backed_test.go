package simdev

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
)

// TestSimUnbackedRefusesData: without Backed, memset and memcpy of a live
// allocation fail with ErrNotBacked and say what was attempted; a bad
// address is still reported as such; with Backed the bytes move.
func TestSimUnbackedRefusesData(t *testing.T) {
	s, err := New(Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, err := s.Malloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	buf := []byte("allocd")
	for name, call := range map[string]func() error{
		"memcpy host to device": func() error { return s.MemcpyHtoD(p, buf) },
		"memcpy device to host": func() error { return s.MemcpyDtoH(buf, p) },
		"memset":                func() error { return s.MemsetAsync(p, 7, 16, cudart.DefaultStream) },
	} {
		err := call()
		if !errors.Is(err, ErrNotBacked) || !strings.Contains(err.Error(), name) {
			t.Errorf("%s on an unbacked sim: %v, want ErrNotBacked naming the call", name, err)
		}
	}
	if string(buf) != "allocd" {
		t.Errorf("MemcpyDtoH wrote %q into the buffer", buf)
	}
	if err := s.MemcpyHtoD(p+8192, buf); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("memcpy outside any allocation: %v, want ErrInvalidValue", err)
	}

	b, err := New(Config{Capacity: 1 << 30, Backed: true})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	q, err := b.Malloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(buf))
	if err := b.MemcpyHtoD(q, buf); err != nil {
		t.Fatal(err)
	}
	if err := b.MemcpyDtoH(got, q); err != nil || !bytes.Equal(got, buf) {
		t.Errorf("backed round trip: %q, %v", got, err)
	}
}
