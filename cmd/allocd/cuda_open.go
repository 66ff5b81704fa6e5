package main

import (
	"github.com/allocd/allocd/cudart"
)

// openCUDA opens CUDA device index through the runtime loaded at run time.
// Without a driver the error wraps cudart.ErrNoDriver and names the
// libraries tried.
func openCUDA(index int) (cudart.Device, error) {
	return cudart.Open(index)
}
