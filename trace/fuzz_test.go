package trace

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzRead feeds arbitrary input to Read: it must return a snapshot or a
// *DecodeError, never panic or hang, and a snapshot it returns must survive
// BuildOps and WritePickle.
func FuzzRead(f *testing.F) {
	paths, _ := filepath.Glob("testdata/*.pickle*")
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		if len(data) > 8<<10 {
			continue
		}
		f.Add(data)
	}
	f.Add([]byte(snap(2, func(p pk) pk { return p.entry("alloc", 1, 2, 3, 4) })))
	f.Add([]byte(rmmSample))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, frames := range []bool{false, true} {
			s, err := Read(bytes.NewReader(data), ReadOptions{Frames: frames})
			if err != nil {
				var de *DecodeError
				if !errors.As(err, &de) {
					t.Fatalf("%v is not a *DecodeError", err)
				}
				continue
			}
			for _, tr := range s.DeviceTraces {
				BuildOps(tr)
			}
		}
	})
}
