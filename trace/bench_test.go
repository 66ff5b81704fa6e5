package trace

import (
	"io"
	"os"
	"path/filepath"
	"testing"
)

// sharedTraces is where CI places the recorded PyTorch traces: beside the
// checkout, as they are too large for the repository.
const sharedTraces = "../../shared/traces"

func BenchmarkReadGPT2MGenerate(b *testing.B) {
	path := filepath.Join(sharedTraces, "gpt2m_generate.pickle.gz")
	data, err := os.ReadFile(path)
	if err != nil {
		b.Skipf("no shared traces: %v", err)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeBytes(data, ReadOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkWriteGPT2MGenerate(b *testing.B) {
	s, err := ReadFile(filepath.Join(sharedTraces, "gpt2m_generate.pickle.gz"), ReadOptions{})
	if err != nil {
		b.Skipf("no shared traces: %v", err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := WritePickle(io.Discard, s); err != nil {
			b.Fatal(err)
		}
	}
}
