package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progressMinOps is the trace length from which replay shows a progress bar
// (on a terminal only).
const progressMinOps = 100_000

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

func newProgressBar(w io.Writer, total int, desc string) *progressbar.ProgressBar {
	return progressbar.NewOptions(total,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(desc),
		progressbar.OptionShowCount(),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(100_000_000),
		progressbar.OptionClearOnFinish(),
	)
}

// outName returns path for a single trace, and path with the trace's name
// before the extension when several traces are replayed.
func outName(path, traceFile string, traces int) string {
	if traces <= 1 {
		return path
	}
	ext := filepath.Ext(path)
	name := filepath.Base(traceFile)
	for _, suffix := range []string{".gz", ".pickle", ".csv", ".log"} {
		name = strings.TrimSuffix(name, suffix)
	}
	return strings.TrimSuffix(path, ext) + "-" + name + ext
}

// writeFile creates path and writes it with write; errors name flag and
// path.
func writeFile(flag, path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("%s: writing %s: %w", flag, path, err)
	}
	return f.Close()
}
