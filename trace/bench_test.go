package trace

import (
	"os"
	"path/filepath"
	"testing"
)

// tracesDir holds the recorded PyTorch traces (testdata/traces/README.md).
const tracesDir = "../testdata/traces"

func BenchmarkReadGPT2MGenerate(b *testing.B) {
	path := filepath.Join(tracesDir, "gpt2m_generate.pickle.gz")
	data, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeBytes(data, ReadOptions{}); err != nil {
			b.Fatal(err)
		}
	}
}
