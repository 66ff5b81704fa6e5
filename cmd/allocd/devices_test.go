package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
)

// TestPrintDevicesEveryIndex: `allocd devices` prints a row for every
// device it is given, text and JSON.
func TestPrintDevicesEveryIndex(t *testing.T) {
	var devs []cudart.DeviceStatus
	for i := range 8 {
		devs = append(devs, cudart.DeviceStatus{
			Info:       cudart.Info{Index: i, Name: "NVIDIA H200", UUID: fmt.Sprintf("GPU-%08x-0000-0000-0000-000000000000", i), TotalMemory: 141 << 30},
			FreeMemory: uint64(140-i) << 30,
		})
	}
	var b bytes.Buffer
	if err := printDevices(&b, devs, false); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 1+len(devs) || !strings.HasPrefix(lines[0], "index") {
		t.Fatalf("%d lines for %d devices:\n%s", len(lines), len(devs), b.String())
	}
	for i, line := range lines[1:] {
		f := strings.Fields(line)
		if f[0] != fmt.Sprint(i) || !strings.HasSuffix(line, devs[i].UUID) || !strings.Contains(line, fmt.Sprintf("%d.00 GiB", 140-i)) {
			t.Errorf("row %d: %q", i, line)
		}
	}
	b.Reset()
	if err := printDevices(&b, devs, true); err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		Index int    `json:"index"`
		UUID  string `json:"uuid"`
		Free  uint64 `json:"free_memory_bytes"`
	}
	if err := json.Unmarshal(b.Bytes(), &rows); err != nil {
		t.Fatal(err)
	}
	if len(rows) != len(devs) {
		t.Fatalf("%d JSON rows for %d devices", len(rows), len(devs))
	}
	for i, r := range rows {
		if r.Index != i || r.UUID != devs[i].UUID || r.Free != devs[i].FreeMemory {
			t.Errorf("JSON row %d: %+v", i, r)
		}
	}
}

// TestDevicesCommand: on a machine without CUDA the command
// fails and says why (on a GPU machine it lists the devices instead).
func TestDevicesCommand(t *testing.T) {
	n, err := cudart.DeviceCount()
	out, _, cmdErr := runCLI(t, "devices")
	switch {
	case errors.Is(err, cudart.ErrNoDriver):
		if !errors.Is(cmdErr, cudart.ErrNoDriver) {
			t.Errorf("allocd devices without a driver = %v, want ErrNoDriver", cmdErr)
		}
	case err == nil:
		if cmdErr != nil {
			t.Fatalf("allocd devices: %v", cmdErr)
		}
		if rows := strings.Count(strings.TrimSpace(out), "\n"); rows != n {
			t.Errorf("allocd devices printed %d rows for %d devices:\n%s", rows, n, out)
		}
	default:
		t.Skipf("DeviceCount: %v", err)
	}
}
