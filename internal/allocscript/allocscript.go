// Package allocscript drives an allocator from lines of text, one command
// a line and one answer a line. The broker's end-to-end tests run it in
// child processes (the test binary itself, re-executed), so that several
// processes allocate, write, read and free through one broker, on the
// simulated device in CI and on a GPU on the device machine.
//
// Commands:
//
//	malloc SIZE   allocate a block on the default stream
//	fill BYTE     write BYTE over every held block
//	scan          answer the distinct byte values of every held block
//	free          free every held block
//	empty         EmptyCache
//	check         run the allocator's invariant checker
//	quit          Close the allocator and stop
//
// Each answer is "ok", "ok VALUE" or "err MESSAGE" (on one line). Child
// drives such a process from a test.
package allocscript

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// Run opens device 0's allocator as a deployed program does
// (allocator.Open: ALLOCD_BROKER, ALLOCD_TENANT, ALLOCD_DEVICE, ...) and
// serves commands from in until quit or the end of in. It returns the
// process's exit status.
func Run(in io.Reader, out io.Writer) int {
	a, err := allocator.Open(0)
	if err != nil {
		fmt.Fprintf(out, "err %v\n", oneLine(err))
		return 1
	}
	return Serve(a, in, out)
}

func oneLine(err error) string { return strings.ReplaceAll(err.Error(), "\n", " ") }

// Serve serves commands on a until quit (which closes it) or the end of
// in.
func Serve(a *allocator.Allocator, in io.Reader, out io.Writer) int {
	dev := a.Device()
	type blk struct {
		p cudart.Ptr
		n uint64
	}
	var held []blk
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		reply := "ok"
		fail := func(err error) { reply = "err " + oneLine(err) }
		switch f[0] {
		case "malloc":
			n, err := strconv.ParseUint(f[len(f)-1], 10, 64)
			if err != nil || len(f) != 2 {
				reply = "err malloc takes a size in bytes"
				break
			}
			p, err := a.Malloc(n, cudart.DefaultStream)
			if err != nil {
				fail(err)
				break
			}
			held = append(held, blk{p, n})
		case "fill":
			v, err := strconv.ParseUint(f[len(f)-1], 0, 8)
			if err != nil || len(f) != 2 {
				reply = "err fill takes a byte"
				break
			}
			for _, b := range held {
				if err := dev.MemcpyHtoD(b.p, bytes.Repeat([]byte{byte(v)}, int(b.n))); err != nil {
					fail(err)
				}
			}
		case "scan":
			var seen [256]bool
			for _, b := range held {
				buf := make([]byte, b.n)
				if err := dev.MemcpyDtoH(buf, b.p); err != nil {
					fail(err)
				}
				for _, c := range buf {
					seen[c] = true
				}
			}
			var vals []string
			for v, ok := range seen {
				if ok {
					vals = append(vals, fmt.Sprintf("%#02x", v))
				}
			}
			slices.Sort(vals)
			if reply == "ok" {
				reply = "ok " + strings.Join(vals, ",")
			}
		case "free":
			for _, b := range held {
				if err := a.Free(b.p); err != nil {
					fail(err)
				}
			}
			held = nil
		case "empty":
			if err := a.EmptyCache(); err != nil {
				fail(err)
			}
		case "check":
			if err := a.Check(); err != nil {
				fail(err)
			}
		case "quit":
			if err := a.Close(); err != nil {
				fmt.Fprintf(out, "err %v\n", oneLine(err))
				return 1
			}
			fmt.Fprintln(out, "ok")
			return 0
		default:
			reply = "err unknown command " + f[0]
		}
		fmt.Fprintln(out, reply)
	}
	return 0
}

// Child is a process serving these commands (a test binary re-executed
// with the variable that makes it call Run), driven over its stdin and
// stdout.
type Child struct {
	name string
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
}

// Start starts cmd as a Child; name labels its errors. The caller kills
// it (Kill) if it does not Quit.
func Start(name string, cmd *exec.Cmd) (*Child, error) {
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &Child{name: name, cmd: cmd, in: in, out: bufio.NewScanner(out)}, nil
}

// Name is the child's label.
func (c *Child) Name() string { return c.name }

// Process is the child's process.
func (c *Child) Process() *os.Process { return c.cmd.Process }

// Do sends one command and returns its answer after "ok", or an error
// holding an "err" answer, or saying that none came.
func (c *Child) Do(line string) (string, error) {
	if _, err := fmt.Fprintln(c.in, line); err != nil {
		return "", fmt.Errorf("%s: %s: %w", c.name, line, err)
	}
	if !c.out.Scan() {
		return "", fmt.Errorf("%s: no answer to %q (the process ended: %v)", c.name, line, c.out.Err())
	}
	ans := c.out.Text()
	if rest, ok := strings.CutPrefix(ans, "ok"); ok {
		return strings.TrimSpace(rest), nil
	}
	return "", errors.New(ans)
}

// Quit sends quit and waits for the process to exit.
func (c *Child) Quit() error {
	if _, err := c.Do("quit"); err != nil {
		return err
	}
	return c.cmd.Wait()
}

// Kill ends the process, whatever it is doing, and reaps it.
func (c *Child) Kill() {
	c.in.Close()
	_ = c.cmd.Process.Kill()
	_ = c.cmd.Wait()
}

// TestChild is a Child for a test: Must and Quit fail the test on error,
// and the test's cleanup kills the process.
type TestChild struct {
	tb testing.TB
	*Child
}

// StartTest starts cmd as a TestChild, failing tb if it cannot.
func StartTest(tb testing.TB, name string, cmd *exec.Cmd) *TestChild {
	tb.Helper()
	c, err := Start(name, cmd)
	if err != nil {
		tb.Fatalf("%s: %v", name, err)
	}
	tb.Cleanup(c.Kill)
	return &TestChild{tb, c}
}

// Must is Do, failing the test on an error.
func (c *TestChild) Must(line string) string {
	c.tb.Helper()
	ans, err := c.Do(line)
	if err != nil {
		c.tb.Fatal(err)
	}
	return ans
}

// Quit is Child.Quit, failing the test on an error.
func (c *TestChild) Quit() {
	c.tb.Helper()
	if err := c.Child.Quit(); err != nil {
		c.tb.Fatalf("%s: %v", c.name, err)
	}
}
