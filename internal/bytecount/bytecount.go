// Package bytecount writes byte counts for people: exactly, in the largest
// binary unit that divides them ("4 KiB", "64 MiB", "1 GiB"), else in bytes
// ("1000 bytes"). Limits in error messages and the sizes in benchmark tables
// use it, so that a figure reads the same everywhere.
package bytecount

import "fmt"

// Exact returns n in the largest of GiB, MiB and KiB that divides it, or in
// bytes when none does (or n is below 1 KiB).
func Exact(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
