package bytecount

import "testing"

func TestExact(t *testing.T) {
	for _, c := range []struct {
		n    int64
		want string
	}{
		{0, "0 bytes"}, {1, "1 bytes"}, {1000, "1000 bytes"}, {1 << 10, "1 KiB"}, {3 << 10, "3 KiB"},
		{1<<20 + 1<<10, "1025 KiB"}, {64 << 20, "64 MiB"}, {1 << 30, "1 GiB"}, {3<<30 + 1<<20, "3073 MiB"},
	} {
		if got := Exact(c.n); got != c.want {
			t.Errorf("Exact(%d) = %q, want %q", c.n, got, c.want)
		}
	}
}
