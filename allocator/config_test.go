package allocator

import (
	"errors"
	"math"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/pinned"
	"github.com/allocd/allocd/simdev"
)

// TestParseConfigRejects: every malformed string is a *ConfigError
// wrapping ErrConfig whose message names the key, the value and what is
// accepted (the want fragment), and ParseConfig returns the defaults.
func TestParseConfigRejects(t *testing.T) {
	const rp = "roundup_power2_divisions"
	for _, tc := range []struct {
		conf, key, want string
	}{
		// roundup_power2_divisions lists.
		{rp + ":[256:4,256:2]", rp, "key 256 given twice"},
		{rp + ":[256:1,512:2,]", rp, "trailing comma"},
		{rp + ":[256:1,]", rp, "trailing comma"},
		{rp + ":[]", rp, "empty list"},
		{rp + ":[,256:1]", rp, "empty list entry"},
		{rp + ":[256:1,,512:2]", rp, "empty list entry"},
		{rp + ":[,]", rp, "empty list entry"},
		{rp + ":[256:1,>:8,>:4]", rp, "> given twice"},
		{rp + ":[>:8,256:1]", rp, "> must be the last entry"},
		{rp + ":[512:2,256:1]", rp, "keys must ascend"},
		{rp + ":[32768:2,65536:4]", rp, "name the same interval"},
		{rp + ":[32768:2,>:4]", rp, "covers no interval"},
		{rp + ":[256:3]", rp, "power of two"},
		{rp + ":[256:2147483648]", rp, "from 1 to 1073741824, or 0"},
		{rp + ":[100:2]", rp, `interval "100" must be a power of two`},
		{rp + ":[0:2]", rp, `interval "0" must be a power of two`},
		{rp + ":[-256:2]", rp, "must be a power of two"},
		{rp + ":[256:1", rp, "unterminated list"},
		{rp + ":[256]", rp, "SIZE_MB:DIVISIONS"},
		{rp + ":[256:]", rp, "SIZE_MB:DIVISIONS"},
		{rp + ":[256::]", rp, "SIZE_MB:DIVISIONS"},
		{rp + ":[256:1:2]", rp, "expected , between list items"},
		{rp + ":[256:1 512:2]", rp, "expected , between list items"},
		{rp + ":[256:+1]", rp, "power of two"},
		{rp + ":3", rp, "expected a power of two from 1 to 1073741824"},
		{rp + ":0", rp, "expected a power of two"},
		{rp + ":2147483648", rp, "expected a power of two from 1 to 1073741824"},
		// expandable_page_mb.
		{"expandable_page_mb:3", "expandable_page_mb", "expected 2, 4, 10 or 20"},
		{"expandable_page_mb:0", "expandable_page_mb", "expected 2, 4, 10 or 20"},
		{"expandable_page_mb:40", "expandable_page_mb", "expected 2, 4, 10 or 20"},
		{"expandable_page_mb:-2", "expandable_page_mb", "expected 2, 4, 10 or 20"},
		{"expandable_page_mb:2MiB", "expandable_page_mb", "expected 2, 4, 10 or 20"},
		// expandable_reclaim.
		{"expandable_reclaim:Coarse", "expandable_reclaim", "expected fine or coarse"},
		{"expandable_reclaim:", "expandable_reclaim", ""},
		{"expandable_reclaim:none", "expandable_reclaim", "expected fine or coarse"},
		// Float keys.
		{"garbage_collection_threshold:NaN", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:nan", "garbage_collection_threshold", "not NaN, Inf or subnormal"},
		{"garbage_collection_threshold:Inf", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:-Inf", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:infinity", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:0", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:1", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:1.5", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:-0.5", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:0.99999999999999999999", "garbage_collection_threshold", "strictly between 0 and 1"},
		{"garbage_collection_threshold:1e-310", "garbage_collection_threshold", "subnormal"},
		{"garbage_collection_threshold:1e-400", "garbage_collection_threshold", "subnormal"},
		{"garbage_collection_threshold:0x1p-2", "garbage_collection_threshold", "decimal number"},
		{"garbage_collection_threshold:0_5", "garbage_collection_threshold", "decimal number"},
		{"garbage_collection_threshold:.", "garbage_collection_threshold", "decimal number"},
		{"garbage_collection_threshold:5e", "garbage_collection_threshold", "decimal number"},
		{"per_process_memory_fraction:NaN", "per_process_memory_fraction", "from 0 to 1"},
		{"per_process_memory_fraction:+Inf", "per_process_memory_fraction", "from 0 to 1"},
		{"per_process_memory_fraction:2", "per_process_memory_fraction", "from 0 to 1"},
		{"per_process_memory_fraction:1.0000001", "per_process_memory_fraction", "from 0 to 1"},
		{"per_process_memory_fraction:-0.1", "per_process_memory_fraction", "from 0 to 1"},
		{"per_process_memory_fraction:4.9e-324", "per_process_memory_fraction", "subnormal"},
		{"per_process_memory_fraction:1e-400", "per_process_memory_fraction", "subnormal"},
		{"per_process_memory_fraction:1e400", "per_process_memory_fraction", "from 0 to 1"},
		// The top level.
		{"max_split_size_mb:100,", "", "trailing comma"},
		{"max_split_size_mb:100,,expandable_segments:True", "", "expected a key"},
		{",max_split_size_mb:100", "", "expected a key"},
		{"max_split_size_mb:100,max_split_size_mb:200", "max_split_size_mb", "key given twice"},
		{"max_split_size_mb:1 28", "max_split_size_mb", "expected , between key:value pairs"},
		{"max_split_size_mb:", "max_split_size_mb", "missing value"},
		{"max_split_size_mb:[128]", "max_split_size_mb", "not a list"},
		{"max_split_size_mb:10", "max_split_size_mb", "at least 20"},
		{"expandable_segments:yes", "expandable_segments", "True or False"},
		{"nonsense:1", "nonsense", "unknown key"},
	} {
		cfg, err := ParseConfig(tc.conf)
		var ce *ConfigError
		if !errors.Is(err, ErrConfig) || !errors.As(err, &ce) {
			t.Errorf("ParseConfig(%q) = %v, want a *ConfigError", tc.conf, err)
			continue
		}
		msg := err.Error()
		if ce.Key != tc.key || (tc.key != "" && !strings.Contains(msg, `"`+tc.key+`"`)) {
			t.Errorf("ParseConfig(%q): key %q in %q, want %q", tc.conf, ce.Key, msg, tc.key)
		}
		if (ce.Value == "" && !strings.HasSuffix(tc.conf, ":")) || !strings.Contains(msg, strconv.Quote(ce.Value)) {
			t.Errorf("ParseConfig(%q): %q does not name the value", tc.conf, msg)
		}
		if !strings.Contains(msg, tc.want) {
			t.Errorf("ParseConfig(%q) = %q, want it to say %q", tc.conf, msg, tc.want)
		}
		if cfg != DefaultConfig() {
			t.Errorf("ParseConfig(%q) returned %+v with its error, want the defaults", tc.conf, cfg)
		}
	}
}

// TestParseConfigAccepts pins what the rules still accept, and the value
// each gives.
func TestParseConfigAccepts(t *testing.T) {
	all := func(d uint64) (a [roundupIntervals]uint64) {
		for i := range a {
			a[i] = d
		}
		return a
	}
	for _, tc := range []struct {
		conf  string
		check func(Config) bool
	}{
		{"", func(c Config) bool { return c == DefaultConfig() }},
		{"  ", func(c Config) bool { return c == DefaultConfig() }},
		{"roundup_power2_divisions:4", func(c Config) bool { return c.RoundupPower2Divisions == all(4) }},
		{"roundup_power2_divisions:[>:8]", func(c Config) bool { return c.RoundupPower2Divisions == all(8) }},
		{"roundup_power2_divisions:[1:2,64:4,>:8]", func(c Config) bool {
			return c.RoundupPower2Divisions == [roundupIntervals]uint64{2, 0, 0, 0, 0, 0, 4, 8, 8, 8, 8, 8, 8, 8, 8, 8}
		}},
		{"roundup_power2_divisions:[ 256 : 1 , 512 : 0 ]", func(c Config) bool {
			return c.RoundupPower2Divisions == [roundupIntervals]uint64{1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0}
		}},
		// A key past the last interval names the last one, as in PyTorch.
		{"roundup_power2_divisions:[65536:4]", func(c Config) bool { return c.RoundupPower2Divisions == all(4) }},
		{"roundup_power2_divisions:[1:1073741824]", func(c Config) bool { return c.RoundupPower2Divisions[0] == 1<<30 }},
		{"garbage_collection_threshold:0.6", func(c Config) bool { return c.GarbageCollectionThreshold == 0.6 }},
		{"garbage_collection_threshold:.5", func(c Config) bool { return c.GarbageCollectionThreshold == 0.5 }},
		{"garbage_collection_threshold:5e-1", func(c Config) bool { return c.GarbageCollectionThreshold == 0.5 }},
		{"garbage_collection_threshold:1e-300", func(c Config) bool { return c.GarbageCollectionThreshold == 1e-300 }},
		{"per_process_memory_fraction:0", func(c Config) bool { return c.PerProcessMemoryFraction == 0 }},
		{"per_process_memory_fraction:0.0e5", func(c Config) bool { return c.PerProcessMemoryFraction == 0 }},
		{"per_process_memory_fraction:1", func(c Config) bool { return c.PerProcessMemoryFraction == 1 }},
		{"per_process_memory_fraction:+0.25", func(c Config) bool { return c.PerProcessMemoryFraction == 0.25 }},
	} {
		cfg, err := ParseConfig(tc.conf)
		if err != nil {
			t.Errorf("ParseConfig(%q): %v", tc.conf, err)
			continue
		}
		if !tc.check(cfg) {
			t.Errorf("ParseConfig(%q) = %+v", tc.conf, cfg)
		}
		if back, err := ParseConfig(cfg.String()); err != nil || back != cfg {
			t.Errorf("round trip of %q via %q: %+v, %v", tc.conf, cfg.String(), back, err)
		}
	}
}

// TestValidateFloats: a Config built in Go gets the same float checks as
// a parsed one.
func TestValidateFloats(t *testing.T) {
	bad := []float64{math.NaN(), math.Inf(1), math.Inf(-1), 5e-324, 0x1p-1023, -0.5, 1.5}
	for _, f := range bad {
		c := DefaultConfig()
		c.GarbageCollectionThreshold = f
		if err := c.Validate(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "garbage_collection_threshold") {
			t.Errorf("Validate with garbage_collection_threshold %v = %v", f, err)
		}
		c = DefaultConfig()
		c.PerProcessMemoryFraction = f
		if err := c.Validate(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "per_process_memory_fraction") {
			t.Errorf("Validate with per_process_memory_fraction %v = %v", f, err)
		}
	}
	c := DefaultConfig()
	c.GarbageCollectionThreshold, c.PerProcessMemoryFraction = 0x1p-1022, 1
	if err := c.Validate(); err != nil {
		t.Errorf("Validate of the smallest normal threshold: %v", err)
	}
	c.RoundupPower2Divisions[3] = 1 << 31
	if err := c.Validate(); !errors.Is(err, ErrConfig) {
		t.Errorf("Validate with 2^31 divisions = %v", err)
	}
}

func TestIsDecimal(t *testing.T) {
	for s, want := range map[string]bool{
		"0": true, "1.": true, ".5": true, "-2.5e-3": true, "+1E+2": true, "007": true,
		"": false, ".": false, "e5": false, "1e": false, "1e+": false, "nan": false, "Inf": false,
		"0x1p-2": false, "1_000": false, "1.2.3": false, " 1": false, "--1": false,
	} {
		if got := isDecimal(s); got != want {
			t.Errorf("isDecimal(%q) = %v, want %v", s, got, want)
		}
	}
}

// TestParseConfigLeavesPinnedKeys: the pinned host allocator's keys share
// ALLOCD_CONF; the device allocator leaves their use to package pinned but
// refuses what pinned.ParseConfig refuses (an unknown pinned_ key, a bad
// value, PyTorch's unsupported keys), so every tool refuses the same
// strings, naming the key.
func TestParseConfigLeavesPinnedKeys(t *testing.T) {
	cfg, err := ParseConfig("pinned_roundup_power2_divisions:4,max_split_size_mb:64,pinned_use_background_threads:False")
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	if cfg.MaxSplitSize != 64<<20 {
		t.Errorf("MaxSplitSize = %d, want 64 MiB", cfg.MaxSplitSize)
	}
	for _, bad := range []string{"pinned_roundup_power2_divisions:4,pinned_roundup_power2_divisions:8", "pinned_x:", "pinned_x:1,"} {
		if _, err := ParseConfig(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("ParseConfig(%q) = %v, want an ErrConfig", bad, err)
		}
	}
	for bad, key := range map[string]string{
		"pinned_bogus:1": "pinned_bogus",
		"max_split_size_mb:64,pinned_nonsense:True":          "pinned_nonsense",
		"pinned_roundup_power2_divisions:3":                  "pinned_roundup_power2_divisions",
		"pinned_use_background_threads:True":                 "pinned_use_background_threads",
		"pinned_num_register_threads:8":                      "pinned_num_register_threads",
		"pinned_use_cuda_host_register:[1]":                  "pinned_use_cuda_host_register",
		"pinned_use_cuda_host_register:maybe,backend:native": "pinned_use_cuda_host_register",
	} {
		_, err := ParseConfig(bad)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), key) {
			t.Errorf("ParseConfig(%q) = %v, want an ErrConfig naming %s", bad, err, key)
		}
		if _, perr := pinned.ParseConfig(bad); perr == nil {
			t.Errorf("pinned.ParseConfig(%q) accepts what ParseConfig refuses", bad)
		}
	}
}

// TestExpandableReclaimKey: expandable_reclaim:coarse sets
// ReclaimCoarse and round trips through String; fine is the default (the
// zero value), which String leaves out; Validate refuses a policy it does
// not know.
func TestExpandableReclaimKey(t *testing.T) {
	for conf, want := range map[string]ReclaimPolicy{
		"expandable_segments:True,expandable_reclaim:coarse": ReclaimCoarse,
		"expandable_segments:True,expandable_reclaim:fine":   ReclaimFine,
		"expandable_segments:True":                           ReclaimFine,
	} {
		c, err := ParseConfig(conf)
		if err != nil {
			t.Fatal(err)
		}
		back, err := ParseConfig(c.String())
		if c.ExpandableReclaim != want || err != nil || back != c {
			t.Errorf("%s: policy %q, String %q parses to %+v, %v", conf, c.ExpandableReclaim, c.String(), back, err)
		}
	}
	c := DefaultConfig()
	c.ExpandableReclaim = "sometimes"
	var ce *ConfigError
	if err := c.Validate(); !errors.As(err, &ce) || ce.Key != "expandable_reclaim" {
		t.Errorf("Validate of policy %q: %v", c.ExpandableReclaim, err)
	}
	c.ExpandableReclaim = "fine" // ALLOCD_CONF's word, not the value
	if err := c.Validate(); !errors.As(err, &ce) {
		t.Errorf("Validate of policy %q: %v", c.ExpandableReclaim, err)
	}
}

// TestExpandablePageKey: expandable_page_mb sets ExpandablePageSize, round
// trips through String, and sets the large pool's page of a new
// allocator's expandable segments.
func TestExpandablePageKey(t *testing.T) {
	for _, mb := range []uint64{2, 4, 10, 20} {
		conf := "expandable_segments:True,expandable_page_mb:" + strconv.FormatUint(mb, 10)
		c, err := ParseConfig(conf)
		if err != nil {
			t.Fatal(err)
		}
		if c.ExpandablePageSize != mb<<20 || c.String() != conf {
			t.Errorf("%s: page %d, String %q", conf, c.ExpandablePageSize, c.String())
		}
		a, _ := newTestAllocator(t, 4*giB, conf)
		if got := a.exp.PageSize(false); got != mb<<20 {
			t.Errorf("%s: large-pool page %d", conf, got)
		}
	}
	a, _ := newTestAllocator(t, 4*giB, "expandable_segments:True")
	if got := a.exp.PageSize(false); got != DefaultExpandablePage {
		t.Errorf("default large-pool page %d, want %d", got, DefaultExpandablePage)
	}
	if err := (Config{Backend: BackendNative, MaxSplitSize: math.MaxUint64, MaxNonSplitRounding: 20 << 20, ExpandablePageSize: 3 << 20}).Validate(); err == nil {
		t.Error("Validate accepted a 3 MiB page")
	}
}

// TestConfigKeysDocumented: every key ParseConfig accepts has a row in
// docs/configuration.md.
func TestConfigKeysDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range ConfigKeys {
		if !strings.Contains(string(doc), "| `"+k+"` |") {
			t.Errorf("docs/configuration.md has no row for %q", k)
		}
	}
}

// FuzzParseConfig feeds arbitrary strings to ParseConfig: it never
// panics; a refusal is a *ConfigError wrapping ErrConfig and returns the
// defaults; an accepted configuration renders (String) to a string that
// parses back to it, and an allocator made with it serves a malloc and a
// free (or, under a small per_process_memory_fraction, refuses the malloc
// with an *OOMError) and passes Check.
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		"", "expandable_segments:True", "max_split_size_mb:20,garbage_collection_threshold:0.6",
		"roundup_power2_divisions:[1:2,64:4,>:8]", "roundup_power2_divisions:4",
		"per_process_memory_fraction:0.5,release_lock_on_cudamalloc:True",
		"expandable_segments:True,expandable_page_mb:20", "backend:cudaMallocAsync",
		"expandable_segments:True,expandable_reclaim:coarse", "expandable_reclaim:fine",
		"pinned_roundup_power2_divisions:4,max_non_split_rounding_mb:64",
		"max_streams:4", "max_streams:0", "max_split_size_mb:", "roundup_power2_divisions:[", ",,", "a:b:c", "max_split_size_mb:1e400",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cfg, err := ParseConfig(s)
		if err != nil {
			var ce *ConfigError
			if !errors.As(err, &ce) || !errors.Is(err, ErrConfig) {
				t.Fatalf("ParseConfig(%q): %v is not a *ConfigError wrapping ErrConfig", s, err)
			}
			if cfg != DefaultConfig() {
				t.Fatalf("ParseConfig(%q) refused but returned %+v, not the defaults", s, cfg)
			}
			return
		}
		back, err := ParseConfig(cfg.String())
		if err != nil || back != cfg {
			t.Fatalf("ParseConfig(%q) = %+v renders as %q, which parses to %+v, %v", s, cfg, cfg.String(), back, err)
		}
		sim, err := simdev.New(simdev.Config{Capacity: 1 << 30})
		if err != nil {
			t.Fatal(err)
		}
		a, err := New(sim, cfg)
		if err != nil {
			t.Fatalf("New with ParseConfig(%q): %v", s, err)
		}
		defer a.Close()
		p, err := a.Malloc(3<<20, 0)
		var oom *OOMError
		if err != nil && !(cfg.PerProcessMemoryFraction > 0 && errors.As(err, &oom)) {
			t.Fatalf("config %q: malloc: %v", s, err) // only a small fraction may refuse it
		}
		if err := a.Free(p); err != nil {
			t.Fatalf("config %q: free: %v", s, err)
		}
		if err := a.Check(); err != nil {
			t.Fatalf("config %q: %v", s, err)
		}
	})
}

// TestMaxStreamsKey: max_streams takes a whole number from 1 to
// MaxStreamsLimit, round trips through String, and refuses anything else
// naming the key; Validate refuses a negative Config.MaxStreams.
func TestMaxStreamsKey(t *testing.T) {
	for _, tc := range []struct {
		conf string
		want int
	}{
		{"max_streams:1", 1},
		{"max_streams:3", 3},
		{"max_streams:65536", 65536},
		{"expandable_segments:True,max_streams:100000", 100000},
		{"max_streams:2147483647", MaxStreamsLimit},
		{"max_streams:007", 7},
	} {
		c, err := ParseConfig(tc.conf)
		if err != nil {
			t.Errorf("ParseConfig(%q): %v", tc.conf, err)
			continue
		}
		if c.MaxStreams != tc.want {
			t.Errorf("ParseConfig(%q): MaxStreams %d, want %d", tc.conf, c.MaxStreams, tc.want)
		}
		if back, err := ParseConfig(c.String()); err != nil || back != c {
			t.Errorf("ParseConfig(%q) renders as %q, which parses to %+v, %v", tc.conf, c.String(), back, err)
		}
	}
	if c, _ := ParseConfig(""); c.MaxStreams != 0 || strings.Contains(c.String(), "max_streams") {
		t.Errorf("the default configuration has MaxStreams %d and renders as %q", c.MaxStreams, c.String())
	}
	for _, bad := range []string{
		"max_streams:0", "max_streams:-1", "max_streams:+5", "max_streams:2147483648",
		"max_streams:18446744073709551616", "max_streams:1.5", "max_streams:1e3", "max_streams:0x10",
		"max_streams:many", "max_streams:[4]", "max_streams:", "max_streams:4,max_streams:4",
	} {
		c, err := ParseConfig(bad)
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), `"max_streams"`) {
			t.Errorf("ParseConfig(%q) = %v, want an ErrConfig naming max_streams", bad, err)
		}
		if c != DefaultConfig() {
			t.Errorf("ParseConfig(%q) refused but returned %+v", bad, c)
		}
	}
	for _, n := range []int{-1, MaxStreamsLimit + 1} {
		c := DefaultConfig()
		c.MaxStreams = n
		if err := c.Validate(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "max_streams") {
			t.Errorf("Validate of MaxStreams %d: %v, want an ErrConfig naming max_streams", n, err)
		}
	}
}

// TestMaxStreamsKeyLimits: max_streams caps the live streams as
// WithMaxStreams does, and takes precedence over it; without the key
// WithMaxStreams applies. With backend:cudaMallocAsync the device's pool
// holds the blocks and a stream's state is always idle: no stream is
// refused.
func TestMaxStreamsKeyLimits(t *testing.T) {
	for _, tc := range []struct {
		conf string
		opt  int // WithMaxStreams, 0 for none
		want int // streams live at most, the default stream's included
	}{
		{"max_streams:3", 0, 3},
		{"max_streams:3", 10, 3},
		{"max_streams:5", 2, 5},
		{"", 2, 2},
		{"max_streams:1", 0, 1},
	} {
		sim, err := simdev.New(simdev.Config{Capacity: 8 * giB})
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := ParseConfig(tc.conf)
		if err != nil {
			t.Fatal(err)
		}
		var opts []Option
		if tc.opt != 0 {
			opts = append(opts, WithMaxStreams(tc.opt))
		}
		a, err := New(sim, cfg, opts...)
		if err != nil {
			t.Fatal(err)
		}
		live := []cudart.Ptr{mustMalloc(t, a, miB, cudart.DefaultStream)}
		for range tc.want - 1 {
			s, _ := sim.StreamCreate()
			live = append(live, mustMalloc(t, a, miB, s))
		}
		s, _ := sim.StreamCreate()
		_, err = a.Malloc(miB, s)
		if !errors.Is(err, ErrTooManyStreams) || !strings.Contains(err.Error(), "max_streams") {
			t.Errorf("%q, WithMaxStreams(%d): Malloc on stream %d: %v, want ErrTooManyStreams naming max_streams", tc.conf, tc.opt, tc.want+1, err)
		}
		for _, p := range live {
			mustFree(t, a, p)
		}
		if err := a.Check(); err != nil {
			t.Errorf("%q: %v", tc.conf, err)
		}
		a.Close()
		sim.Close()
	}
	sim, err := simdev.New(simdev.Config{Capacity: 8 * giB})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	a, err := New(sim, Config{Backend: BackendAsync, MaxSplitSize: math.MaxUint64, MaxNonSplitRounding: 20 << 20, MaxStreams: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	var live []cudart.Ptr
	for range 5 {
		s, _ := sim.StreamCreate()
		live = append(live, mustMalloc(t, a, miB, s))
	}
	for _, p := range live {
		mustFree(t, a, p)
	}
	if err := a.Check(); err != nil {
		t.Error(err)
	}
}
