package allocator

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strconv"
	"strings"

	"github.com/allocd/allocd/internal/confgrammar"
	"github.com/allocd/allocd/pinned"
)

// acceptedPage says what expandable_page_mb takes.
const acceptedPage = "expected 2, 4, 10 or 20 (MiB)"

// acceptedReclaim says what expandable_reclaim takes.
const acceptedReclaim = "expected fine or coarse"

// ReclaimPolicy is how expandable segments grow and reclaim
// (expandable_reclaim, allocd only).
type ReclaimPolicy string

const (
	// ReclaimFine (the default, the zero value, written fine in
	// ALLOCD_CONF) maps growths in pages and moves every free stretch of
	// whole runs that reclaim chooses: the least reserved memory, for more
	// device calls than PyTorch makes where free memory moves often (a
	// decoder's growing cache, streams that take turns).
	ReclaimFine ReclaimPolicy = ""
	// ReclaimCoarse grows ranges to PyTorch's 20 MiB boundaries, one
	// handle per growth (up to 64 MiB), and moves only free stretches of
	// at least 64 MiB, only as much of them as a growth needs: never more
	// reserved memory than PyTorch's expandable segments on the traces
	// measured, in fewer device calls, at a smaller lead.
	ReclaimCoarse ReclaimPolicy = "coarse"
)

// Backend selects how the allocator obtains memory.
type Backend string

// Backends accepted by the `backend` key.
const (
	// BackendNative is allocd's own caching allocator (the default).
	BackendNative Backend = "native"
	// BackendAsync delegates to the device's stream-ordered pool
	// (cudaMallocAsync / cudaFreeAsync).
	BackendAsync Backend = "cudaMallocAsync"
)

// roundupIntervals is the number of power-of-two intervals
// roundup_power2_divisions configures: [1 MiB, 2 MiB), … up to 64 GiB; the
// first also covers smaller sizes and the last larger ones (as PyTorch).
const roundupIntervals = 16

// Config is the allocator's configuration, the keys of ALLOCD_CONF (which
// are PYTORCH_CUDA_ALLOC_CONF's). The zero Config is not valid; start from
// DefaultConfig or ParseConfig.
type Config struct {
	// Backend is "native" or "cudaMallocAsync".
	Backend Backend
	// MaxSplitSize: blocks of at least this many bytes are never split and
	// never serve smaller requests. math.MaxUint64 means unlimited (the
	// default).
	MaxSplitSize uint64
	// MaxNonSplitRounding: a request of at least MaxSplitSize takes a cached
	// block at most this many bytes larger. Default 20 MiB.
	MaxNonSplitRounding uint64
	// GarbageCollectionThreshold in (0, 1), or 0 when off: with a memory
	// fraction set, once reserved memory exceeds threshold × allowed, aged
	// unsplit cached blocks are released before the device is asked for
	// more.
	GarbageCollectionThreshold float64
	// RoundupPower2Divisions[i] divides the power-of-two interval
	// [2^(20+i), 2^(21+i)) into that many equal steps that requests round up
	// to; 0 or 1 means plain 512-byte rounding.
	RoundupPower2Divisions [roundupIntervals]uint64
	// ExpandableSegments maps memory into growing virtual ranges instead of
	// allocating fixed segments.
	ExpandableSegments bool
	// PerProcessMemoryFraction in (0, 1] caps reserved memory at
	// fraction × device total; 0 means no cap.
	PerProcessMemoryFraction float64
	// ReleaseLockOnDeviceMalloc lets other goroutines use the cache while
	// one waits for the device's malloc (release_lock_on_cudamalloc).
	ReleaseLockOnDeviceMalloc bool
	// ExpandablePageSize is the large pool's page with expandable segments
	// (expandable_page_mb, allocd only): the unit in which its ranges grow
	// and in which reclaim unmaps and moves free memory. 0 means the
	// default (DefaultExpandablePage); otherwise 2, 4, 10 or 20 MiB. Smaller
	// pages leave less free memory mapped; each page costs a physical
	// allocation, a mapping and an access call on the device when the range
	// grows. The small pool's page is always 2 MiB, and
	// WithPyTorchExpandable uses PyTorch's 20 MiB.
	ExpandablePageSize uint64
	// ExpandableReclaim is how expandable segments grow and reclaim
	// (expandable_reclaim, allocd only): ReclaimFine (the default) or
	// ReclaimCoarse. It has no effect without
	// ExpandableSegments, or with WithPyTorchExpandable.
	ExpandableReclaim ReclaimPolicy
	// MaxStreams caps the streams, the default stream included, that have
	// live state in the allocator at once (max_streams, allocd only): a
	// new stream beyond it gets an error wrapping
	// ErrTooManyStreams (with backend:cudaMallocAsync the device's pool
	// holds the blocks and no stream is refused). 0 means WithMaxStreams'
	// value (DefaultMaxStreams unless given); a value from 1 to
	// MaxStreamsLimit takes precedence over WithMaxStreams.
	MaxStreams int
}

// MaxStreamsLimit is the largest value of max_streams.
const MaxStreamsLimit = math.MaxInt32

// acceptedStreams says what max_streams takes.
var acceptedStreams = fmt.Sprintf("expected a whole number of streams from 1 to %d", MaxStreamsLimit)

// DefaultExpandablePage is the large pool's expandable page when
// ExpandablePageSize is 0.
const DefaultExpandablePage = 2 << 20

// expandablePages lists the accepted expandable_page_mb values, in MiB:
// multiples of the 2 MiB mapping granularity that divide PyTorch's 20 MiB
// page.
var expandablePages = []uint64{2, 4, 10, 20}

// DefaultConfig returns PyTorch's defaults.
func DefaultConfig() Config {
	return Config{
		Backend:             BackendNative,
		MaxSplitSize:        math.MaxUint64,
		MaxNonSplitRounding: 20 << 20,
	}
}

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("invalid allocator configuration")

// PinnedKeyPrefix starts the keys of the pinned host allocator, which reads
// the same ALLOCD_CONF string. ParseConfig checks them as pinned.ParseConfig
// does (an unknown pinned_ key or a bad value is an error here too) and
// leaves their use to package pinned.
const PinnedKeyPrefix = "pinned_"

// ConfigError names the key and value that were wrong and what is accepted.
type ConfigError struct {
	Key, Value string
	// Accepted says what the key takes.
	Accepted string
}

// Error formats the error.
func (e *ConfigError) Error() string {
	if e.Key == "" {
		return fmt.Sprintf("allocator config: %s (got %q)", e.Accepted, e.Value)
	}
	return fmt.Sprintf("allocator config: key %q: bad value %q: %s", e.Key, e.Value, e.Accepted)
}

// Unwrap makes errors.Is(err, ErrConfig) hold.
func (e *ConfigError) Unwrap() error { return ErrConfig }

// ConfigKeys lists the keys ParseConfig accepts.
var ConfigKeys = []string{
	"backend", "max_split_size_mb", "max_non_split_rounding_mb",
	"garbage_collection_threshold", "roundup_power2_divisions",
	"expandable_segments", "per_process_memory_fraction",
	"release_lock_on_cudamalloc", "expandable_page_mb", "expandable_reclaim",
	"max_streams",
}

// ParseConfig parses a configuration string in PYTORCH_CUDA_ALLOC_CONF's
// grammar: comma-separated key:value pairs, lists in brackets
// (roundup_power2_divisions:[256:1,512:2,>:8]), booleans True/False. The
// empty string gives DefaultConfig. Unknown keys, bad values and stray
// tokens are errors wrapping ErrConfig; nothing is ignored.
func ParseConfig(s string) (Config, error) {
	cfg := DefaultConfig()
	pairs, err := confgrammar.Split(s, ConfigKeys)
	if err != nil {
		var se *confgrammar.Error
		errors.As(err, &se)
		return cfg, &ConfigError{Key: se.Key, Value: se.Value, Accepted: se.Problem}
	}
	hasPinned := false
	for _, kv := range pairs {
		if strings.HasPrefix(kv.Key, PinnedKeyPrefix) {
			hasPinned = true
			continue // the pinned host allocator's key: checked below
		}
		if err := cfg.set(kv.Key, kv.Val); err != nil {
			return DefaultConfig(), err
		}
	}
	if hasPinned {
		// The host allocator's keys are checked as pinned.ParseConfig
		// checks them, so that every reader of ALLOCD_CONF refuses the
		// same strings, whether or not it uses the host allocator.
		if _, err := pinned.ParseConfig(s); err != nil {
			var pe *pinned.ConfigError
			if errors.As(err, &pe) {
				return DefaultConfig(), &ConfigError{Key: pe.Key, Value: pe.Value, Accepted: pe.Accepted}
			}
			return DefaultConfig(), &ConfigError{Value: s, Accepted: err.Error()}
		}
	}
	return cfg, cfg.Validate()
}

func parseBool(key, v string) (bool, error) {
	switch v {
	case "True", "true":
		return true, nil
	case "False", "false":
		return false, nil
	}
	return false, &ConfigError{Key: key, Value: v, Accepted: "expected True or False"}
}

func parseMB(key, v string, min uint64) (uint64, error) {
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil || n < min {
		return 0, &ConfigError{Key: key, Value: v, Accepted: fmt.Sprintf("expected a whole number of MiB, at least %d", min)}
	}
	if n > math.MaxUint64>>20 {
		return math.MaxUint64, nil
	}
	return n << 20, nil
}

// Accepted ranges of the float keys, as their errors state them.
const (
	acceptedThreshold = "expected a decimal number strictly between 0 and 1 (not NaN, Inf or subnormal)"
	acceptedFraction  = "expected a decimal number from 0 to 1, 0 for no cap (not NaN, Inf or subnormal)"
)

// parseFraction parses the value of a float key: a plain decimal number
// (digits, an optional point and exponent; no NaN, Inf or hexadecimal)
// whose float64 is normal, in (0, 1), or in [0, 1] with 1 included when
// fraction. A number so small that it rounds to zero or to a subnormal is
// an error, not 0: it would silently turn the setting off.
func parseFraction(key, v string, fraction bool) (float64, error) {
	accepted := acceptedThreshold
	if fraction {
		accepted = acceptedFraction
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !isDecimal(v) || !normalOrZero(f) ||
		(f == 0 && strings.ContainsAny(mantissa(v), "123456789")) {
		return 0, &ConfigError{Key: key, Value: v, Accepted: accepted}
	}
	if fraction && !(f >= 0 && f <= 1) || !fraction && !(f > 0 && f < 1) {
		return 0, &ConfigError{Key: key, Value: v, Accepted: accepted}
	}
	return f, nil
}

// normalOrZero reports whether f is 0 or a normal finite float64: not NaN,
// not ±Inf, not subnormal.
func normalOrZero(f float64) bool {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return false
	}
	return f == 0 || math.Abs(f) >= 0x1p-1022
}

// isDecimal reports whether s is [+-]digits[.digits][e[+-]digits], with
// digits on at least one side of the point.
func isDecimal(s string) bool {
	i := 0
	if i < len(s) && (s[i] == '+' || s[i] == '-') {
		i++
	}
	digits := func() int {
		j := i
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		return i - j
	}
	n := digits()
	if i < len(s) && s[i] == '.' {
		i++
		n += digits()
	}
	if n == 0 {
		return false
	}
	if i < len(s) && (s[i] == 'e' || s[i] == 'E') {
		i++
		if i < len(s) && (s[i] == '+' || s[i] == '-') {
			i++
		}
		if digits() == 0 {
			return false
		}
	}
	return i == len(s)
}

// mantissa is the part of a decimal number before its exponent.
func mantissa(s string) string {
	if i := strings.IndexAny(s, "eE"); i >= 0 {
		return s[:i]
	}
	return s
}

func isPow2(n uint64) bool { return n != 0 && n&(n-1) == 0 }

func (c *Config) set(key string, val []string) error {
	single := func() (string, error) {
		if len(val) != 1 {
			return "", &ConfigError{Key: key, Value: strings.Join(val, ""), Accepted: "expected a single value, not a list"}
		}
		return val[0], nil
	}
	switch key {
	case "backend":
		v, err := single()
		if err != nil {
			return err
		}
		switch Backend(v) {
		case BackendNative, BackendAsync:
			c.Backend = Backend(v)
		default:
			return &ConfigError{Key: key, Value: v, Accepted: "expected native or cudaMallocAsync"}
		}
	case "max_split_size_mb", "max_non_split_rounding_mb":
		v, err := single()
		if err != nil {
			return err
		}
		n, err := parseMB(key, v, 20)
		if err != nil {
			return err
		}
		if key == "max_split_size_mb" {
			c.MaxSplitSize = n
		} else {
			c.MaxNonSplitRounding = n
		}
	case "garbage_collection_threshold":
		v, err := single()
		if err != nil {
			return err
		}
		f, err := parseFraction(key, v, false)
		if err != nil {
			return err
		}
		c.GarbageCollectionThreshold = f
	case "per_process_memory_fraction":
		v, err := single()
		if err != nil {
			return err
		}
		f, err := parseFraction(key, v, true)
		if err != nil {
			return err
		}
		c.PerProcessMemoryFraction = f
	case "expandable_segments", "release_lock_on_cudamalloc":
		v, err := single()
		if err != nil {
			return err
		}
		b, err := parseBool(key, v)
		if err != nil {
			return err
		}
		if key == "expandable_segments" {
			c.ExpandableSegments = b
		} else {
			c.ReleaseLockOnDeviceMalloc = b
		}
	case "expandable_page_mb":
		v, err := single()
		if err != nil {
			return err
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || !slices.Contains(expandablePages, n) {
			return &ConfigError{Key: key, Value: v, Accepted: acceptedPage}
		}
		c.ExpandablePageSize = n << 20
	case "expandable_reclaim":
		v, err := single()
		if err != nil {
			return err
		}
		switch v {
		case "fine":
			c.ExpandableReclaim = ReclaimFine
		case string(ReclaimCoarse):
			c.ExpandableReclaim = ReclaimCoarse
		default:
			return &ConfigError{Key: key, Value: v, Accepted: acceptedReclaim}
		}
	case "max_streams":
		v, err := single()
		if err != nil {
			return err
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n < 1 || n > MaxStreamsLimit {
			return &ConfigError{Key: key, Value: v, Accepted: acceptedStreams}
		}
		c.MaxStreams = int(n)
	case "roundup_power2_divisions":
		return c.setRoundup(key, val)
	default:
		return &ConfigError{Key: key, Value: strings.Join(val, ""), Accepted: "unknown key; accepted keys are " + strings.Join(ConfigKeys, ", ")}
	}
	return nil
}

// maxRoundupDivisions is the largest number of divisions a
// roundup_power2_divisions value may ask for: the largest power of two
// PyTorch's parser (stoi) takes.
const maxRoundupDivisions = 1 << 30

// parseDivisions parses a roundup_power2_divisions value: a power of two
// up to maxRoundupDivisions, or 0 (off) when zeroOK.
func parseDivisions(key, whole, v string, zeroOK bool) (uint64, error) {
	n, err := strconv.ParseUint(v, 10, 64)
	if err == nil && n <= maxRoundupDivisions && (isPow2(n) || (zeroOK && n == 0)) {
		return n, nil
	}
	accepted := fmt.Sprintf("divisions %q must be a power of two from 1 to %d", v, maxRoundupDivisions)
	if zeroOK {
		accepted += ", or 0"
	}
	return 0, &ConfigError{Key: key, Value: whole, Accepted: accepted}
}

// setRoundup follows PyTorch's parser: a single power of two applies to
// every interval; a list maps interval starts in MiB (powers of two) or ">"
// (all later intervals) to divisions (powers of two, or 0 to disable).
// Where PyTorch is silent allocd is strict, so that no entry is ignored or
// overwritten: the list is not empty, has no empty entry and no trailing
// comma, its keys ascend and name each interval once, and ">", at most
// once, comes last and covers at least one interval.
func (c *Config) setRoundup(key string, val []string) error {
	whole := strings.Join(val, "")
	if len(val) == 1 {
		n, err := strconv.ParseUint(val[0], 10, 64)
		if err != nil || !isPow2(n) || n > maxRoundupDivisions {
			return &ConfigError{Key: key, Value: whole, Accepted: fmt.Sprintf("expected a power of two from 1 to %d, or a list like [256:1,512:2,>:8]", maxRoundupDivisions)}
		}
		for i := range c.RoundupPower2Divisions {
			c.RoundupPower2Divisions[i] = n
		}
		return nil
	}
	items := val[1 : len(val)-1] // inside the brackets
	if len(items) == 0 {
		return &ConfigError{Key: key, Value: whole, Accepted: "empty list: expected at least one SIZE_MB:DIVISIONS entry, as in [256:1,512:2,>:8]"}
	}
	var div [roundupIntervals]uint64
	// next is the first interval ">" covers: the one after the last
	// explicit interval. (PyTorch fills from the last explicit interval
	// itself, overwriting it; allocd keeps what the user wrote.)
	next := 0
	prevKey := "" // the last explicit key, for messages
	sawRest := false
	for i := 0; i < len(items); {
		if items[i] == "," {
			return &ConfigError{Key: key, Value: whole, Accepted: "empty list entry: expected SIZE_MB:DIVISIONS between commas"}
		}
		if i+2 >= len(items) || items[i+1] != ":" || confgrammar.IsPunct(items[i+2]) {
			return &ConfigError{Key: key, Value: whole, Accepted: "expected list items SIZE_MB:DIVISIONS"}
		}
		k, v := items[i], items[i+2]
		if sawRest {
			if k == ">" {
				return &ConfigError{Key: key, Value: whole, Accepted: "> given twice: it may appear once, as the last entry"}
			}
			return &ConfigError{Key: key, Value: whole, Accepted: fmt.Sprintf("entry %s:%s after >: > must be the last entry", k, v)}
		}
		d, err := parseDivisions(key, whole, v, true)
		if err != nil {
			return err
		}
		if k == ">" {
			if next >= roundupIntervals {
				return &ConfigError{Key: key, Value: whole, Accepted: fmt.Sprintf("> after %s covers no interval: %s MiB already names the last one (%d MiB and above)", prevKey, prevKey, uint64(1)<<(roundupIntervals-1))}
			}
			for j := next; j < roundupIntervals; j++ {
				div[j] = d
			}
			sawRest = true
		} else {
			mb, err := strconv.ParseUint(k, 10, 64)
			if err != nil || !isPow2(mb) {
				return &ConfigError{Key: key, Value: whole, Accepted: fmt.Sprintf("interval %q must be a power of two (MiB) or >", k)}
			}
			idx := min(bits.Len64(mb)-1, roundupIntervals-1)
			switch {
			case prevKey != "" && idx == next-1:
				accepted := fmt.Sprintf("key %s given twice: each interval may be given once", k)
				if k != prevKey {
					accepted = fmt.Sprintf("keys %s and %s name the same interval (every key from %d MiB up names the last one): each interval may be given once", prevKey, k, uint64(1)<<(roundupIntervals-1))
				}
				return &ConfigError{Key: key, Value: whole, Accepted: accepted}
			case prevKey != "" && idx < next:
				return &ConfigError{Key: key, Value: whole, Accepted: fmt.Sprintf("key %s after %s: keys must ascend", k, prevKey)}
			}
			if prevKey == "" {
				for j := 0; j < idx; j++ {
					div[j] = d
				}
			}
			div[idx] = d
			next, prevKey = idx+1, k
		}
		i += 3
		if i < len(items) {
			if items[i] != "," {
				return &ConfigError{Key: key, Value: whole, Accepted: "expected , between list items"}
			}
			i++
			if i == len(items) {
				return &ConfigError{Key: key, Value: whole, Accepted: "trailing comma in the list: expected SIZE_MB:DIVISIONS after each ,"}
			}
		}
	}
	c.RoundupPower2Divisions = div
	return nil
}

// Validate checks the values and their combination. The allocator calls it
// in New; ParseConfig calls it too.
func (c Config) Validate() error {
	switch c.Backend {
	case BackendNative, BackendAsync:
	default:
		return &ConfigError{Key: "backend", Value: string(c.Backend), Accepted: "expected native or cudaMallocAsync"}
	}
	if c.MaxSplitSize < 20<<20 {
		return &ConfigError{Key: "max_split_size_mb", Value: strconv.FormatUint(c.MaxSplitSize>>20, 10), Accepted: "expected at least 20"}
	}
	if c.MaxNonSplitRounding < 20<<20 {
		return &ConfigError{Key: "max_non_split_rounding_mb", Value: strconv.FormatUint(c.MaxNonSplitRounding>>20, 10), Accepted: "expected at least 20"}
	}
	if g := c.GarbageCollectionThreshold; g != 0 && !(normalOrZero(g) && g > 0 && g < 1) {
		return &ConfigError{Key: "garbage_collection_threshold", Value: fmt.Sprint(g), Accepted: acceptedThreshold}
	}
	if f := c.PerProcessMemoryFraction; !(normalOrZero(f) && f >= 0 && f <= 1) {
		return &ConfigError{Key: "per_process_memory_fraction", Value: fmt.Sprint(f), Accepted: acceptedFraction}
	}
	if p := c.ExpandablePageSize; p != 0 && (p%(1<<20) != 0 || !slices.Contains(expandablePages, p>>20)) {
		return &ConfigError{Key: "expandable_page_mb", Value: strconv.FormatUint(p, 10) + " bytes", Accepted: acceptedPage}
	}
	switch c.ExpandableReclaim {
	case ReclaimFine, ReclaimCoarse:
	default:
		return &ConfigError{Key: "expandable_reclaim", Value: string(c.ExpandableReclaim), Accepted: acceptedReclaim}
	}
	if c.MaxStreams < 0 || c.MaxStreams > MaxStreamsLimit {
		return &ConfigError{Key: "max_streams", Value: strconv.Itoa(c.MaxStreams), Accepted: acceptedStreams + ", or 0 in a Config for WithMaxStreams' value"}
	}
	for _, d := range c.RoundupPower2Divisions {
		if d != 0 && (!isPow2(d) || d > maxRoundupDivisions) {
			return &ConfigError{Key: "roundup_power2_divisions", Value: fmt.Sprint(d), Accepted: fmt.Sprintf("divisions must be powers of two from 1 to %d, or 0", maxRoundupDivisions)}
		}
	}
	return nil
}

// String renders the configuration in ALLOCD_CONF's grammar, listing only
// keys that differ from the defaults; ParseConfig(c.String()) == c.
func (c Config) String() string {
	d := DefaultConfig()
	var parts []string
	if c.Backend != d.Backend {
		parts = append(parts, "backend:"+string(c.Backend))
	}
	if c.MaxSplitSize != d.MaxSplitSize {
		parts = append(parts, fmt.Sprintf("max_split_size_mb:%d", c.MaxSplitSize>>20))
	}
	if c.MaxNonSplitRounding != d.MaxNonSplitRounding {
		parts = append(parts, fmt.Sprintf("max_non_split_rounding_mb:%d", c.MaxNonSplitRounding>>20))
	}
	if c.GarbageCollectionThreshold != 0 {
		parts = append(parts, "garbage_collection_threshold:"+strconv.FormatFloat(c.GarbageCollectionThreshold, 'g', -1, 64))
	}
	if c.RoundupPower2Divisions != d.RoundupPower2Divisions {
		var items []string
		for i, v := range c.RoundupPower2Divisions {
			items = append(items, fmt.Sprintf("%d:%d", uint64(1)<<i, v))
		}
		parts = append(parts, "roundup_power2_divisions:["+strings.Join(items, ",")+"]")
	}
	if c.ExpandableSegments {
		parts = append(parts, "expandable_segments:True")
	}
	if c.PerProcessMemoryFraction != 0 {
		parts = append(parts, "per_process_memory_fraction:"+strconv.FormatFloat(c.PerProcessMemoryFraction, 'g', -1, 64))
	}
	if c.ReleaseLockOnDeviceMalloc {
		parts = append(parts, "release_lock_on_cudamalloc:True")
	}
	if c.ExpandablePageSize != 0 {
		parts = append(parts, fmt.Sprintf("expandable_page_mb:%d", c.ExpandablePageSize>>20))
	}
	if c.ExpandableReclaim != ReclaimFine {
		parts = append(parts, "expandable_reclaim:"+string(c.ExpandableReclaim))
	}
	if c.MaxStreams != 0 {
		parts = append(parts, fmt.Sprintf("max_streams:%d", c.MaxStreams))
	}
	return strings.Join(parts, ",")
}
