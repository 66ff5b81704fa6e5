// Command embed is a Go program that embeds allocd's allocator from start
// to end: it opens a device configured by ALLOCD_CONF, allocates on two
// streams, hands a block to the second stream with RecordStream, meets an
// out-of-memory error, serves /metrics and the /debug pages on a loopback
// listener, writes a snapshot that pytorch.org/memory_viz opens, reads its
// own /metrics once, and closes the allocator.
//
//	go run ./examples/embed                      # CUDA device 0
//	ALLOCD_DEVICE=sim go run ./examples/embed    # a simulated device
//
// It uses CUDA device -device (0) unless ALLOCD_DEVICE=sim asks for a
// simulated device, and prints which one it used; with neither a driver
// nor ALLOCD_DEVICE=sim it fails. It ends after -seconds of serving (0:
// at once after its own scrape), or at Ctrl-C. docs/embedding.md walks
// through it.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/debughttp"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/stats"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "embed:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, out io.Writer, args []string) error {
	fs := flag.NewFlagSet("embed", flag.ContinueOnError)
	device := fs.Int("device", 0, "CUDA device index (or simulated device index with ALLOCD_DEVICE=sim)")
	listen := fs.String("listen", "127.0.0.1:0", "address for /metrics and /debug/ (keep it on loopback: the debug pages show addresses)")
	snapshot := fs.String("snapshot", "allocd-embed.pickle", "write the allocator's snapshot to this file")
	seconds := fs.Float64("seconds", 0, "keep serving this many seconds after the work (0: stop at once)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	log, err := zap.NewProduction()
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()

	// 1. Open: CUDA device N, configured by ALLOCD_CONF; a simulated
	// device only when ALLOCD_DEVICE=sim says so.
	a, err := allocator.Open(*device, allocator.WithLogger(log.Named("allocator")))
	if err != nil {
		return err
	}
	defer a.Close() // on early returns; the Close at the end reports errors
	dev := a.Device()
	info := dev.Info()
	kind, why := "CUDA device", ""
	if _, sim := dev.(*simdev.Sim); sim {
		kind, why = "simulated device", ", asked for by ALLOCD_DEVICE=sim"
	}
	fmt.Fprintf(out, "device: %s %d (%s, %s%s)\n", kind, info.Index, info.Name, allocator.FormatSize(info.TotalMemory), why)
	conf := a.Config().String()
	if conf == "" {
		conf = "PyTorch's defaults"
	}
	fmt.Fprintf(out, "config: %s\n", conf)
	if err := a.RecordHistory(allocator.HistoryOptions{MaxEntries: 10_000, StackDepth: 8}); err != nil {
		return err
	}

	// 2. Allocate on two streams: the default stream and a side stream.
	side, err := dev.StreamCreate()
	if err != nil {
		return fmt.Errorf("creating a stream: %w", err)
	}
	defer dev.StreamDestroy(side)
	weights, err := a.Malloc(64<<20, cudart.DefaultStream)
	if err != nil {
		return err
	}
	scratch, err := a.Malloc(1<<20, side)
	if err != nil {
		return err
	}

	// 3. RecordStream: work queued on side reads weights, so its memory
	// may be reused only once that work is done, even after Free.
	if err := dev.MemsetAsync(weights, 0, 64<<20, side); errors.Is(err, simdev.ErrNotBacked) {
		fmt.Fprintln(out, "memset: skipped, the simulated device holds no data")
	} else if err != nil {
		return fmt.Errorf("memset on the side stream: %w", err)
	}
	if err := a.RecordStream(weights, side); err != nil {
		return err
	}
	if err := a.Free(weights); err != nil {
		return err
	}
	if err := dev.StreamSynchronize(side); err != nil {
		return err
	}
	fmt.Fprintf(out, "allocated: %s, reserved: %s\n",
		allocator.FormatSize(uint64(a.MemoryAllocated())), allocator.FormatSize(uint64(a.MemoryReserved())))

	// 4. Out of memory: an *OOMError says what was asked for and what the
	// device holds; it counts in num_ooms and allocd_ooms_total.
	_, err = a.Malloc(2*info.TotalMemory, cudart.DefaultStream)
	var oom *allocator.OOMError
	if !errors.As(err, &oom) {
		return fmt.Errorf("a request for twice the device's memory gave %v, want an OOMError", err)
	}
	fmt.Fprintf(out, "out of memory, as expected: requested %s of %s (num_ooms %d)\n",
		allocator.FormatSize(oom.Requested), allocator.FormatSize(oom.DeviceTotal), a.Stats().NumOOMs)

	// 5. Metrics and debug pages on a loopback listener: the program's own
	// registry with the allocator's collector, and debughttp's pages.
	reg := prometheus.NewRegistry()
	col, err := stats.NewCollector(a)
	if err != nil {
		return err
	}
	if err := reg.Register(col); err != nil {
		return fmt.Errorf("registering the collector: %w", err)
	}
	debug, err := debughttp.ForAllocator(a, debughttp.Options{})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("GET /debug/", debug)
	index := debughttp.Index("examples/embed", append([]debughttp.Endpoint{{Path: "/metrics", Doc: "Prometheus metrics"}}, debughttp.PageEndpoints()...))
	mux.Handle("GET /{$}", index)
	mux.Handle("GET /debug/{$}", index)
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("-listen: %w", err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	base := "http://" + ln.Addr().String()
	fmt.Fprintf(out, "serving: %s/metrics %s/debug/summary %s/debug/snapshot\n", base, base, base)

	// 6. Snapshot: the pickle that torch.cuda.memory._dump_snapshot
	// writes, with the history and the Go call sites of each block.
	if err := writeSnapshot(a, *snapshot); err != nil {
		return err
	}
	fmt.Fprintf(out, "snapshot: %s (%d segments; open it at pytorch.org/memory_viz)\n", *snapshot, len(a.Snapshot().Segments))

	// 7. Scrape our own /metrics once, as Prometheus would.
	if err := printMetrics(ctx, out, base+"/metrics"); err != nil {
		return err
	}
	if *seconds > 0 {
		fmt.Fprintf(out, "serving for %gs (Ctrl-C stops)\n", *seconds)
		select {
		case <-time.After(time.Duration(*seconds * float64(time.Second))):
		case <-ctx.Done():
		}
	}

	// 8. Close: stop serving, free what is live, return every segment to
	// the device.
	shutCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutCtx); err != nil {
		return fmt.Errorf("stopping the HTTP server: %w", err)
	}
	if err := a.Free(scratch); err != nil {
		return err
	}
	held := a.Stats().Segment[allocator.PoolAll].Current
	if err := a.Close(); err != nil {
		return fmt.Errorf("closing the allocator: %w", err)
	}
	fmt.Fprintf(out, "closed: %d segments returned to the device, %s still reserved\n",
		held, allocator.FormatSize(uint64(a.MemoryReserved())))
	return nil
}

// writeSnapshot writes a's snapshot to path.
func writeSnapshot(a *allocator.Allocator, path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("-snapshot: %w", err)
	}
	if err := a.WriteSnapshot(f); err != nil {
		f.Close()
		return fmt.Errorf("-snapshot: writing %s: %w", path, err)
	}
	return f.Close()
}

// printMetrics gets url and prints the allocd series that tell the story
// so far: bytes allocated and reserved, device mallocs, OOMs.
func printMetrics(ctx context.Context, out io.Writer, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("scraping /metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("scraping /metrics: %s", resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		for _, name := range []string{"allocd_allocated_bytes{", "allocd_reserved_bytes{", "allocd_device_mallocs_total{", "allocd_ooms_total{"} {
			if strings.HasPrefix(line, name) {
				fmt.Fprintln(out, "metric:", line)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading /metrics: %w", err)
	}
	return nil
}
