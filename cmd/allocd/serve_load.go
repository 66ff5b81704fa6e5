package main

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/server"
	"github.com/allocd/allocd/workload"
)

// newServeWorkload reads the trace of --replay, or sets up --synthetic.
func newServeWorkload(f serveFlags) (*workload.Load, error) {
	if f.replay == "" {
		return &workload.Load{Loop: true, Rate: f.rate}, nil
	}
	tr, err := workload.LoadTrace(f.replay)
	if err != nil {
		return nil, fmt.Errorf("--replay: %w", err)
	}
	return &workload.Load{Trace: tr, Loop: f.loop, Rate: f.rate}, nil
}

// loadServeWorkload runs newServeWorkload in a goroutine and waits for it
// or for ctx. It returns nil, nil when ctx ended first (logged as a
// shutdown during loading).
func loadServeWorkload(ctx context.Context, f serveFlags, log *zap.Logger) (*workload.Load, error) {
	type result struct {
		w   *workload.Load
		err error
	}
	if f.replay != "" {
		log.Info("loading trace", zap.String("trace", f.replay))
	}
	t0 := time.Now()
	done := make(chan result, 1) // never blocks the loader
	go func() {
		w, err := newServeWorkload(f)
		done <- result{w, err}
	}()
	select {
	case r := <-done:
		if r.err == nil && r.w.Trace != nil {
			log.Info("trace loaded", zap.String("trace", f.replay), zap.Int("ops", len(r.w.Trace.Ops.Ops)),
				zap.Duration("took", time.Since(t0)))
		}
		return r.w, r.err
	case <-ctx.Done():
		server.LogShutdown(ctx, log, "trace loading")
		log.Info("shutdown complete: nothing was started")
		return nil, nil
	}
}
