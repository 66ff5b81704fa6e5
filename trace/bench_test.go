package trace

import (
	"io"
	"os"
	"path/filepath"
	"testing"
)

// tracesDir holds the recorded PyTorch traces (testdata/traces/README.md).
const tracesDir = "../testdata/traces"

// longTrace reports the traces that -short leaves out of the round trips:
// gpt2m_generate and llm_decode_varlen, with 913,006 and 613,812 entries,
// take longer than the eight others together.
func longTrace(file string) bool {
	return file == "gpt2m_generate.pickle.gz" || file == "llm_decode_varlen.pickle.gz"
}

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

func BenchmarkWriteGPT2MGenerate(b *testing.B) {
	s, err := ReadFile(filepath.Join(tracesDir, "gpt2m_generate.pickle.gz"), ReadOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := WritePickle(io.Discard, s); err != nil {
			b.Fatal(err)
		}
	}
}
