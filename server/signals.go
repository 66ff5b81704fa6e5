package server

import (
	"context"
	"errors"
	"os"
	"time"

	"go.uber.org/zap"
)

// ExitCode is the exit status after a second SIGINT or SIGTERM, as a
// shell reports a process killed by SIGINT.
const ExitCode = 130

// SecondSignalGrace: a signal that follows the first by less than this
// counts as a second signal even if the shutdown has finished by then.
const SecondSignalGrace = 100 * time.Millisecond

// ShutdownSignal is the cause of a Signals' context once a signal has
// cancelled it.
type ShutdownSignal struct{ Signal os.Signal }

// Error names the signal.
func (s ShutdownSignal) Error() string { return "signal " + s.Signal.String() }

// Signals watches a channel of SIGINT and SIGTERM for the whole life of a
// daemon. The first signal cancels Context, with a ShutdownSignal as its
// cause; a second one logs, calls the exit function with ExitCode at
// once, whatever the daemon is doing, and then (exit returns only in
// tests) closes Forced.
type Signals struct {
	ctx    context.Context
	exit   func(code int)
	forced chan struct{}
	done   chan struct{}
	exited chan struct{}
}

// WatchSignals starts watching sigs until Stop. Its context is also
// cancelled when parent is. exit ends the process (os.Exit outside
// tests); log receives the second signal's line.
func WatchSignals(parent context.Context, log *zap.Logger, sigs <-chan os.Signal, exit func(code int)) *Signals {
	ctx, cancel := context.WithCancelCause(parent)
	s := &Signals{ctx: ctx, exit: exit, forced: make(chan struct{}), done: make(chan struct{}), exited: make(chan struct{})}
	second := func(sig os.Signal) {
		log.Warn("second signal: exiting without cleanup", zap.String("signal", sig.String()), zap.Int("exit_code", ExitCode))
		_ = log.Sync()
		s.exit(ExitCode)
		close(s.forced)
	}
	go func() {
		defer close(s.exited)
		defer cancel(nil)
		var first os.Signal
		var firstAt time.Time
		for {
			select {
			case sig := <-sigs:
				if first != nil {
					second(sig)
					return
				}
				first, firstAt = sig, time.Now()
				cancel(ShutdownSignal{sig})
			case <-s.done:
				// Two signals sent together (a double Ctrl-C, a
				// supervisor that signals twice) exit 130 even when the
				// shutdown is quicker than the second one's delivery,
				// as during trace loading: the exit waits until
				// SecondSignalGrace after the first signal.
				if first == nil {
					return
				}
				wait := time.NewTimer(SecondSignalGrace - time.Since(firstAt))
				defer wait.Stop()
				select {
				case sig := <-sigs:
					second(sig)
				case <-wait.C:
				}
				return
			}
		}
	}()
	return s
}

// Context is cancelled by the first signal (its cause a ShutdownSignal)
// or by the parent's end.
func (s *Signals) Context() context.Context { return s.ctx }

// Forced is closed after a second signal, once exit has returned (in
// tests only).
func (s *Signals) Forced() <-chan struct{} { return s.forced }

// Stop ends the watch; once it returns no signal calls exit. It returns at
// once unless a signal came less than SecondSignalGrace ago.
func (s *Signals) Stop() {
	close(s.done)
	<-s.exited
}

// LogShutdown logs why ctx, a Signals' context, ended: the signal, or the
// reason its parent was cancelled; during says which start-up step it
// interrupted, when one did.
func LogShutdown(ctx context.Context, log *zap.Logger, during string) {
	fields := []zap.Field{}
	var ss ShutdownSignal
	if cause := context.Cause(ctx); errors.As(cause, &ss) {
		fields = append(fields, zap.String("signal", ss.Signal.String()))
	} else {
		fields = append(fields, zap.String("reason", cause.Error()))
	}
	if during != "" {
		fields = append(fields, zap.String("during", during))
	}
	log.Info("shutting down", fields...)
}
