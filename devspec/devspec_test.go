package devspec

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

func TestParse(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Spec
	}{
		{"sim", Spec{Sim: true, Count: 1}},
		{"sim:1", Spec{Sim: true, Count: 1}},
		{"sim:4", Spec{Sim: true, Count: 4}},
		{"sim:64", Spec{Sim: true, Count: 64}},
		{"cuda", Spec{Count: 1}},
		{"cuda:0", Spec{Count: 1}},
		{"cuda:3", Spec{Index: 3, Count: 1}},
		{"cuda:all", Spec{All: true}},
	} {
		got, err := Parse(c.in)
		if err != nil || got != c.want {
			t.Errorf("Parse(%q) = %+v, %v; want %+v", c.in, got, err, c.want)
		}
		// String gives back a form that parses to the same spec.
		if again, err := Parse(got.String()); err != nil || again != got {
			t.Errorf("%q: String %q parses to %+v, %v", c.in, got.String(), again, err)
		}
	}
	for _, in := range []string{"", "gpu", "sim:", "sim:0", "sim:-1", "sim:65", "sim:x", "sim:all", "cuda:", "cuda:-1", "cuda:x", "cuda:1,2", "CUDA"} {
		if got, err := Parse(in); !errors.Is(err, ErrSpec) || !strings.Contains(err.Error(), fmt.Sprintf("%q", in)) {
			t.Errorf("Parse(%q) = %+v, %v; want an ErrSpec naming the value", in, got, err)
		}
	}
	for _, in := range []string{"sim:0", "sim:65"} {
		if _, err := Parse(in); err == nil || !strings.Contains(err.Error(), "1 to 64") {
			t.Errorf("Parse(%q) = %v; want the range 1 to 64", in, err)
		}
	}
}

// TestParseOne: work on one device keeps sim, cuda and cuda:N, and
// refuses the forms that name several devices.
func TestParseOne(t *testing.T) {
	for in, want := range map[string]Spec{
		"sim":    {Sim: true, Count: 1},
		"cuda":   {Count: 1},
		"cuda:2": {Index: 2, Count: 1},
	} {
		if got, err := ParseOne(in); err != nil || got != want {
			t.Errorf("ParseOne(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"sim:1", "sim:2", "cuda:all"} {
		if _, err := ParseOne(in); !errors.Is(err, ErrSpec) || !strings.Contains(err.Error(), "several devices") {
			t.Errorf("ParseOne(%q) = %v; want an error saying it names several devices", in, err)
		}
	}
	if _, err := ParseOne("tpu"); err == nil || !strings.Contains(err.Error(), "expected sim, cuda or cuda:N") {
		t.Errorf("ParseOne(tpu) = %v", err)
	}
}

func TestOpenSim(t *testing.T) {
	spec, err := Parse("sim:3")
	if err != nil {
		t.Fatal(err)
	}
	plan := []simdev.Address{{Addr: 0x7f0000000000, Size: 2 << 20}}
	devs, err := Opener{Sim: simdev.Config{Capacity: 8 << 30, Addresses: plan}}.Open(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer CloseAll(devs)
	if len(devs) != 3 {
		t.Fatalf("sim:3 opened %d devices", len(devs))
	}
	seen := map[cudart.Ptr]int{}
	for i, dev := range devs {
		info := dev.Info()
		if info.Index != i || info.TotalMemory != 8<<30 {
			t.Errorf("device %d: %+v", i, info)
		}
		p, err := dev.Malloc(2 << 20)
		if err != nil {
			t.Fatal(err)
		}
		// Device i hands out the plan moved by i × SimDeviceSpan.
		if want := plan[0].Addr + cudart.Ptr(uint64(i)*SimDeviceSpan); p != want {
			t.Errorf("device %d: first Malloc = %#x, want %#x", i, uint64(p), uint64(want))
		}
		if j, dup := seen[p]; dup {
			t.Errorf("devices %d and %d both handed out %#x", j, i, uint64(p))
		}
		seen[p] = i
	}
	one, err := Opener{}.Open(Spec{Sim: true, Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer CloseAll(one)
	if len(one) != 1 || one[0].Info().TotalMemory != DefaultSimCapacity {
		t.Errorf("sim: %d devices of %d bytes", len(one), one[0].Info().TotalMemory)
	}
}

// fakeCUDA returns an Opener whose CUDA calls open Sims: count devices,
// of which the one with index failAt (if any) cannot be opened. opened
// collects the Sims it opened.
func fakeCUDA(count int, countErr error, failAt int) (Opener, *[]*simdev.Sim) {
	opened := &[]*simdev.Sim{}
	return Opener{
		DeviceCount: func() (int, error) { return count, countErr },
		OpenCUDA: func(i int) (cudart.Device, error) {
			if i == failAt {
				return nil, fmt.Errorf("cudart: open device %d: cudaErrorDevicesUnavailable: busy", i)
			}
			if i >= count {
				return nil, fmt.Errorf("cudart: open device %d: no such device: %w", i, cudart.ErrInvalidValue)
			}
			s, err := simdev.New(simdev.Config{Capacity: 1 << 30, Index: i, Name: "fake GPU"})
			if err != nil {
				return nil, err
			}
			*opened = append(*opened, s)
			return s, nil
		},
	}, opened
}

func TestOpenCUDAAll(t *testing.T) {
	all := Spec{All: true}
	t.Run("every device", func(t *testing.T) {
		o, _ := fakeCUDA(4, nil, -1)
		devs, err := o.Open(all)
		if err != nil {
			t.Fatal(err)
		}
		defer CloseAll(devs)
		if len(devs) != 4 {
			t.Fatalf("cuda:all opened %d devices, want 4", len(devs))
		}
		for i, d := range devs {
			if d.Info().Index != i {
				t.Errorf("device %d has index %d", i, d.Info().Index)
			}
		}
	})
	t.Run("one failing closes the others", func(t *testing.T) {
		o, opened := fakeCUDA(4, nil, 2)
		devs, err := o.Open(all)
		if devs != nil || err == nil || !strings.Contains(err.Error(), "opening device 2 of 4") {
			t.Fatalf("Open = %v, %v; want an error naming device 2", devs, err)
		}
		if len(*opened) != 2 {
			t.Fatalf("%d devices opened before the failure, want 2", len(*opened))
		}
		for _, s := range *opened {
			if _, err := s.Malloc(512); !errors.Is(err, cudart.ErrClosed) {
				t.Errorf("device %d left open after the failure: Malloc = %v", s.Info().Index, err)
			}
		}
	})
	t.Run("no device", func(t *testing.T) {
		o, _ := fakeCUDA(0, nil, -1)
		if _, err := o.Open(all); err == nil || !strings.Contains(err.Error(), "no device") {
			t.Errorf("Open with no device = %v", err)
		}
	})
	t.Run("no driver", func(t *testing.T) {
		o, _ := fakeCUDA(0, fmt.Errorf("cudart: no libcudart: %w", cudart.ErrNoDriver), -1)
		if _, err := o.Open(all); !errors.Is(err, cudart.ErrNoDriver) || !strings.Contains(err.Error(), "cuda:all") {
			t.Errorf("Open without a driver = %v", err)
		}
	})
	t.Run("cuda:N", func(t *testing.T) {
		o, _ := fakeCUDA(4, nil, -1)
		devs, err := o.Open(Spec{Index: 3, Count: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer CloseAll(devs)
		if len(devs) != 1 || devs[0].Info().Index != 3 {
			t.Errorf("cuda:3 opened %d devices, the first %+v", len(devs), devs[0].Info())
		}
		if _, err := o.Open(Spec{Index: 9, Count: 1}); !errors.Is(err, cudart.ErrInvalidValue) {
			t.Errorf("cuda:9 of 4 = %v", err)
		}
	})
}

// TestParseSize: the stated range and the check agree to the byte: the
// largest int64 is accepted, one more (8388608TiB is 2^63) is refused with
// a message stating the real limit.
func TestParseSize(t *testing.T) {
	for in, want := range map[string]uint64{
		"512": 512, "141GiB": 141 << 30, "1.5 GiB": 3 << 29, "64MiB": 64 << 20, "2TB": 2 << 40, "80GB": 80 << 30,
		" 7 B ": 7, "1e3": 1000, "1.9": 1, "9223372036854775807": math.MaxInt64,
		"9223372036854775807.0": math.MaxInt64, "8388607.5TiB": 8388607<<40 + 1<<39, "1KiB": 1024, "0.5KB": 512,
		"+2": 2, "2.": 2, ".5KiB": 512, "1E3": 1000, "1e+3": 1000, "1000e-3": 1,
	} {
		got, err := ParseSize(in)
		if err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "abc", "0", "NaN", "nan GiB", "Inf", "+InfGiB", "-Inf", "1e-300GiB",
		"5e-324", "0.5", "1e19", "8388608TiB", "9223372036854775808", "18446744073709551616", "1e999999999",
		"GiB", "0x10", "1_000", "1/2", "12 XiB", "1e-999999999GiB", "1e-9999999", "1e646456992", "1p-99999999",
		"0x1p-99999999", ".", "1e", "1e+", "--1", "1.2.3", strings.Repeat("1", 65), "1 000"} {
		if got, err := ParseSize(in); err == nil || !strings.Contains(err.Error(), "from 1 to 9223372036854775807 (8 EiB less one byte)") {
			t.Errorf("ParseSize(%q) = %d, %v; want an error stating the range", in, got, err)
		}
	}
}

// TestOpenIndex: sim:N opens device i of N alone, as Open would; an
// index outside is an error.
func TestOpenIndex(t *testing.T) {
	o := Opener{Sim: simdev.Config{Capacity: 1 << 30}}
	dev, err := o.OpenIndex(Spec{Sim: true, Count: 3}, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	if info := dev.Info(); info.Index != 2 || info.TotalMemory != 1<<30 {
		t.Errorf("device 2 of sim:3: %+v", info)
	}
	for _, i := range []int{-1, 3} {
		if _, err := o.OpenIndex(Spec{Sim: true, Count: 3}, i); !errors.Is(err, cudart.ErrInvalidValue) {
			t.Errorf("OpenIndex(sim:3, %d) = %v", i, err)
		}
	}
	d0, err := Opener{}.OpenIndex(Spec{Sim: true, Count: 1}, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer d0.Close()
	if d0.Info().TotalMemory != DefaultSimCapacity {
		t.Errorf("default capacity %d", d0.Info().TotalMemory)
	}
}

// FuzzParseSize: ParseSize never panics; what it accepts is from 1 to
// MaxSize, and what it refuses gets the error stating that range.
func FuzzParseSize(f *testing.F) {
	for _, s := range []string{"512", "141GiB", "1.5 TiB", "9223372036854775807", "8388608TiB", "1e999999999", "NaN", "-0", "0.5KB", "GiB", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParseSize(s)
		if err != nil {
			if n != 0 || !strings.Contains(err.Error(), "8 EiB less one byte") {
				t.Fatalf("ParseSize(%q) = %d, %v", s, n, err)
			}
			return
		}
		if n < 1 || n > MaxSize {
			t.Fatalf("ParseSize(%q) = %d, outside 1 to %d", s, n, uint64(MaxSize))
		}
	})
}

// TestParseSizeHostileExponent: a huge exponent is refused at once (a
// big.ParseFloat of "1e-99999999" alone takes seconds).
func TestParseSizeHostileExponent(t *testing.T) {
	start := time.Now()
	for _, s := range []string{"1e-99999999", "1e99999999GiB", "1e-646456993", "9e-2147483648"} {
		if _, err := ParseSize(s); err == nil {
			t.Errorf("ParseSize(%q) accepted", s)
		}
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("four hostile exponents took %v", d)
	}
}
