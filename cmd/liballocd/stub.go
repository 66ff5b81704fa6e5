//go:build !cgo

package main

import (
	"fmt"
	"os"
)

// Without cgo there is no C API to export: this stub only keeps
// `CGO_ENABLED=0 go build ./...` working.
func main() {
	fmt.Fprintln(os.Stderr, "liballocd is a C shared library: build it with CGO_ENABLED=1 go build -buildmode=c-shared -o liballocd.so ./cmd/liballocd")
	os.Exit(2)
}

// drain is the cgo build's free-queue drain (queue.go); without cgo no free
// is ever queued.
func (l *lib) drain(bool) {}
