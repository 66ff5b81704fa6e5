package main

import (
	"fmt"
	"io"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// logLevels are the levels --log-level accepts.
const logLevels = "debug, info, warn or error"

// newLogger returns the daemon's logger on stderr: JSON lines in
// production, or colourless human-readable console lines with dev set. level
// is debug, info, warn or error ("" means info).
func newLogger(dev bool, level string) (*zap.Logger, error) {
	return newLoggerTo(os.Stderr, dev, level)
}

// newLoggerTo is newLogger writing to w.
func newLoggerTo(w io.Writer, dev bool, level string) (*zap.Logger, error) {
	lvl, err := parseLogLevel(level)
	if err != nil {
		return nil, err
	}
	var enc zapcore.Encoder
	opts := []zap.Option{zap.ErrorOutput(zapcore.Lock(zapcore.AddSync(os.Stderr)))}
	if dev {
		cfg := zap.NewDevelopmentEncoderConfig()
		cfg.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
		enc = zapcore.NewConsoleEncoder(cfg)
		opts = append(opts, zap.Development(), zap.AddCaller())
	} else {
		cfg := zap.NewProductionEncoderConfig()
		cfg.EncodeTime = zapcore.RFC3339NanoTimeEncoder
		enc = zapcore.NewJSONEncoder(cfg)
	}
	core := zapcore.NewCore(enc, zapcore.Lock(zapcore.AddSync(w)), lvl)
	return zap.New(core, opts...), nil
}

// parseLogLevel parses --log-level.
func parseLogLevel(s string) (zapcore.Level, error) {
	switch s {
	case "", "info":
		return zapcore.InfoLevel, nil
	case "debug":
		return zapcore.DebugLevel, nil
	case "warn":
		return zapcore.WarnLevel, nil
	case "error":
		return zapcore.ErrorLevel, nil
	}
	return 0, fmt.Errorf("--log-level %q: expected %s", s, logLevels)
}
