package devspec_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/internal/envcases"
)

// TestParseEnv is the table of ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY
// values every tool reads through ParseEnv (allocator.Open's and
// liballocd's tests run their own entry points over the same values).
func TestParseEnv(t *testing.T) {
	for _, c := range envcases.Cases {
		want := c.Capacity
		if want == envcases.DefaultSimCapacity {
			want = devspec.DefaultSimCapacity
		}
		got, err := devspec.ParseEnv(c.Device, c.SimCapacity)
		if c.Err != "" {
			if !errors.Is(err, devspec.ErrEnv) || !strings.Contains(err.Error(), c.Err) {
				t.Errorf("ParseEnv(%q, %q) = %+v, %v; want an ErrEnv mentioning %q", c.Device, c.SimCapacity, got, err, c.Err)
			}
			continue
		}
		if err != nil || got.Spec.Sim != (c.Sims > 0) || (c.Sims > 0 && got.Spec.Count != c.Sims) || got.SimCapacity != want {
			t.Errorf("ParseEnv(%q, %q) = %+v, %v; want %d simulated devices of %d bytes", c.Device, c.SimCapacity, got, err, c.Sims, want)
		}
		if got.Set != (strings.TrimSpace(c.Device) != "") {
			t.Errorf("ParseEnv(%q, …).Set = %v", c.Device, got.Set)
		}
	}
}
