//go:build !cgo

package cudart

import (
	"errors"
	"strings"
	"testing"
)

// TestNoCgoOpen: a binary built without cgo says so when asked for a GPU.
// It exists only in builds without cgo (CI runs CGO_ENABLED=0 go test
// ./cudart/), so a cgo build has no skip for it.
func TestNoCgoOpen(t *testing.T) {
	if _, err := Open(0); !errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
		t.Fatalf("Open(0) = %v, want ErrNoDriver saying the binary was built without cgo", err)
	}
}
