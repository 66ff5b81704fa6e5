package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

func TestNewLoggerJSON(t *testing.T) {
	var buf serveLogBuffer
	log, err := newLoggerTo(&buf, false, "info")
	if err != nil {
		t.Fatal(err)
	}
	log.Debug("hidden at info")
	log.Named("allocator").Info("segment released")
	_ = log.Sync()
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 1 {
		t.Fatalf("want one line (debug filtered out), got %q", buf.String())
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &m); err != nil {
		t.Fatalf("not JSON: %q: %v", lines[0], err)
	}
	if m["level"] != "info" || m["msg"] != "segment released" || m["logger"] != "allocator" {
		t.Errorf("line %v", m)
	}
	if _, err := time.Parse(time.RFC3339Nano, m["ts"].(string)); err != nil {
		t.Errorf("ts %v is not RFC 3339: %v", m["ts"], err)
	}
}

func TestNewLoggerConsoleAndLevels(t *testing.T) {
	var buf serveLogBuffer
	log, err := newLoggerTo(&buf, true, "warn")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hidden at warn")
	log.Warn("out of memory")
	_ = log.Sync()
	out := buf.String()
	if strings.Contains(out, "hidden") || !strings.Contains(out, "WARN") || !strings.Contains(out, "out of memory") || strings.HasPrefix(out, "{") {
		t.Errorf("console output %q", out)
	}
	for _, lvl := range []string{"", "debug", "info", "warn", "error"} {
		if _, err := newLogger(false, lvl); err != nil {
			t.Errorf("newLogger(%q): %v", lvl, err)
		}
	}
	for _, lvl := range []string{"trace", "INFO", "fatal"} {
		if _, err := newLogger(false, lvl); err == nil {
			t.Errorf("newLogger(%q) accepted", lvl)
		}
	}
}
