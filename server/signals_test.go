package server

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestSignals: the first signal cancels the context with the signal as
// its cause; the second calls exit with ExitCode and closes Forced.
func TestSignals(t *testing.T) {
	sigs := make(chan os.Signal, 2)
	codes := make(chan int, 1)
	s := WatchSignals(context.Background(), zap.NewNop(), sigs, func(code int) { codes <- code })
	sigs <- syscall.SIGTERM
	<-s.Context().Done()
	var ss ShutdownSignal
	if cause := context.Cause(s.Context()); !errors.As(cause, &ss) || ss.Signal != syscall.SIGTERM {
		t.Fatalf("cause %v, want the SIGTERM", cause)
	}
	sigs <- syscall.SIGINT
	select {
	case code := <-codes:
		if code != ExitCode {
			t.Errorf("exit(%d), want %d", code, ExitCode)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a second signal did not call exit")
	}
	<-s.Forced()
	s.Stop()
}

// TestSignalsStopQuiet: without a signal, Stop returns at once and exit is
// never called; a parent's end cancels the context too.
func TestSignalsStopQuiet(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	s := WatchSignals(parent, zap.NewNop(), make(chan os.Signal), func(int) { t.Error("exit called without a signal") })
	cancel()
	<-s.Context().Done()
	t0 := time.Now()
	s.Stop()
	if d := time.Since(t0); d > SecondSignalGrace {
		t.Errorf("Stop took %v without a signal", d)
	}
}

func TestWriteFileAtomic(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ready")
	if err := WriteFileAtomic(path, "127.0.0.1:1234\n"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "127.0.0.1:1234\n" {
		t.Errorf("read back %q, %v", b, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("%d files in the directory, want only the ready file", len(ents))
	}
	if err := WriteFileAtomic(filepath.Join(dir, "no", "such", "dir"), "x"); err == nil {
		t.Error("writing into a missing directory succeeded")
	}
}

// TestCloseLogsEveryDevice: Close returns every segment of every device,
// live blocks included, and logs one line per device saying so.
func TestCloseLogsEveryDevice(t *testing.T) {
	var devs []cudart.Device
	for i := range 2 {
		sim, err := simdev.New(simdev.Config{Capacity: 1 << 30, Index: i})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sim.Close() })
		devs = append(devs, sim)
	}
	allocs, err := allocator.NewDevices(devs, allocator.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	d, err := New(zap.New(core), allocs, "test")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Allocators()[1].Malloc(4<<20, cudart.DefaultStream); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatalf("Close with a live block: %v", err)
	}
	closed := logs.FilterMessage("allocator closed: every segment returned to the device").All()
	if len(closed) != 2 {
		t.Fatalf("%d close lines, want one per device:\n%v", len(closed), logs.All())
	}
	if live := closed[1].ContextMap()["live_blocks"]; live != int64(1) {
		t.Errorf("gpu 1 logged live_blocks %v, want 1", live)
	}
	for _, dev := range devs {
		if used := dev.(*simdev.Sim).Used(); used != 0 {
			t.Errorf("device %d still holds %d bytes", dev.Info().Index, used)
		}
	}
}
