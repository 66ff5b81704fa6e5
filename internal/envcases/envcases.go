// Package envcases is the table of ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY
// values that the tests of devspec.ParseEnv, allocator.Open and liballocd
// share, so that the three entry points are seen to agree on every value,
// the bad ones included. It is for tests only.
package envcases

// DefaultSimCapacity stands for devspec.DefaultSimCapacity in Capacity
// (this package imports nothing of allocd's, so that devspec's own tests
// can use it).
const DefaultSimCapacity = 0

// Case is one value of ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY and what
// every allocd tool makes of it: Err, when set, is text the error must
// contain (it wraps ErrEnv); otherwise Sims simulated devices (0: CUDA)
// of Capacity bytes (0: the default).
type Case struct {
	Device, SimCapacity string
	Err                 string
	Sims                int
	Capacity            uint64
}

// Cases is the table.
var Cases = []Case{
	{Device: ""},
	{Device: "cuda"},
	{Device: " cuda "},
	{Device: "sim", Sims: 1},
	{Device: "sim", SimCapacity: "2GiB", Sims: 1, Capacity: 2 << 30},
	{Device: "sim", SimCapacity: "80GB", Sims: 1, Capacity: 80 << 30},
	{Device: "sim", SimCapacity: "1.5 GiB", Sims: 1, Capacity: 3 << 29},
	{Device: "sim", SimCapacity: "9223372036854775807", Sims: 1, Capacity: 1<<63 - 1},
	{Device: "sim:1", Sims: 1},
	{Device: "sim:3", SimCapacity: "1GiB", Sims: 3, Capacity: 1 << 30},
	{Device: "sim:64", SimCapacity: "1GiB", Sims: 64, Capacity: 1 << 30},
	{Device: "bogus", Err: "ALLOCD_DEVICE"},
	{Device: "tpu", Err: "accepted are cuda (the default), sim and sim:N"},
	{Device: "CUDA", Err: "ALLOCD_DEVICE"},
	{Device: "cuda:0", Err: "the program picks the index"},
	{Device: "cuda:1", Err: "the program picks the index"},
	{Device: "cuda:all", Err: "the program picks the index"},
	{Device: "sim:", Err: "ALLOCD_DEVICE"},
	{Device: "sim:0", Err: "1 to 64"},
	{Device: "sim:65", Err: "1 to 64"},
	{Device: "sim:128", Err: "1 to 64"},
	{Device: "sim:x", Err: "ALLOCD_DEVICE"},
	{Device: "sim", SimCapacity: "lots", Err: "ALLOCD_SIM_CAPACITY"},
	{Device: "sim", SimCapacity: "0", Err: "ALLOCD_SIM_CAPACITY"},
	{Device: "sim", SimCapacity: "NaN", Err: "ALLOCD_SIM_CAPACITY"},
	{Device: "sim", SimCapacity: "-1GiB", Err: "ALLOCD_SIM_CAPACITY"},
	{Device: "sim", SimCapacity: "8388608TiB", Err: "8 EiB less one byte"},
	{Device: "cuda", SimCapacity: "lots", Err: "ALLOCD_SIM_CAPACITY"},
}
