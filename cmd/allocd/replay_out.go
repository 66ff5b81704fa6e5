package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/bench"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/trace"
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

func writeChartFile(path, title string, series []chartSeries) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("--svg: %w", err)
	}
	if err := writeChart(f, title, series); err != nil {
		f.Close()
		return fmt.Errorf("--svg: writing %s: %w", path, err)
	}
	return f.Close()
}

// historyLimit bounds the history recorded for --snapshot-out: enough for
// every shared trace, as PyTorch's max_entries does.
const historyLimit = 3_000_000

// writePeakSnapshot writes the snapshot at the peak-reserved moment of a
// replay of ops with cfg.
func writePeakSnapshot(path string, target *replayTarget, ops *trace.Ops, plan []cudart.SimAddress, cfg allocator.Config) error {
	snap, _, err := bench.SnapshotAtPeak(ops, func(history bool) (*allocator.Allocator, error) {
		dev, err := target.device(plan)
		if err != nil {
			return nil, err
		}
		var opts []allocator.Option
		if history {
			opts = append(opts, allocator.WithHistory(historyLimit))
		}
		return allocator.New(dev, cfg, opts...)
	})
	if err != nil {
		return fmt.Errorf("--snapshot-out: %w", err)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("--snapshot-out: %w", err)
	}
	if err := trace.WritePickle(f, snap); err != nil {
		f.Close()
		return fmt.Errorf("--snapshot-out: writing %s: %w", path, err)
	}
	return f.Close()
}
