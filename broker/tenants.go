package broker

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"

	"go.yaml.in/yaml/v3"

	"github.com/allocd/allocd/devspec"
)

// Tenants is the broker's list of tenants and their quotas, read from a
// YAML file (ParseTenants):
//
//	tenants:
//	  - name: training      # 1 to 64 of A-Z a-z 0-9 _ . -
//	    quota: 60GiB        # on each GPU; omit for no limit
//	    uids: [1000, 1001]  # optional: the peer uids (SO_PEERCRED) allowed
//	    gpus:               # optional: quotas for some GPUs, by the
//	      "0": 40GiB        # broker's index or the GPU's UUID
//	  - name: inference
//	    quota: 20GiB
//
// A Tenants value is immutable; a reload swaps it whole.
type Tenants struct {
	open   bool
	byName map[string]*Tenant
	names  []string
}

// Tenant is one tenant's policy.
type Tenant struct {
	// Name is the tenant's name.
	Name string
	// Quota is the limit on each GPU that GPUs does not name; Limited is
	// false when there is none.
	Quota   uint64
	Limited bool
	// GPUs holds per-GPU quotas, keyed by the broker's device index (in
	// decimal) or the GPU's UUID.
	GPUs map[string]uint64
	// UIDs, when not empty, are the only peer uids that may connect as
	// this tenant.
	UIDs []uint32
}

// QuotaOn returns the tenant's quota on the broker's device index with
// the given UUID, and whether there is one.
func (t *Tenant) QuotaOn(index int, uuid string) (uint64, bool) {
	if q, ok := t.GPUs[strconv.Itoa(index)]; ok {
		return q, true
	}
	if q, ok := t.GPUs[uuid]; ok && uuid != "" {
		return q, true
	}
	return t.Quota, t.Limited
}

// OpenTenants accepts every tenant name, from every uid, without a
// quota: the policy of a broker started without a tenants file.
func OpenTenants() *Tenants { return &Tenants{open: true} }

// Open reports whether t accepts any tenant name (OpenTenants).
func (t *Tenants) Open() bool { return t.open }

// Lookup returns the named tenant's policy, or false when t does not
// list it. An open Tenants returns an unlimited policy for any name.
func (t *Tenants) Lookup(name string) (*Tenant, bool) {
	if t.open {
		return &Tenant{Name: name}, true
	}
	p, ok := t.byName[name]
	return p, ok
}

// Names returns the listed tenants' names in the file's order (none for
// an open Tenants).
func (t *Tenants) Names() []string { return slices.Clone(t.names) }

// ErrTenants: a tenants file is not valid. The message names the file's
// line or tenant and what is wrong.
var ErrTenants = errors.New("invalid tenants file")

type tenantsYAML struct {
	Tenants []tenantYAML `yaml:"tenants"`
}

type tenantYAML struct {
	Name  string            `yaml:"name"`
	Quota string            `yaml:"quota"`
	UIDs  []uint32          `yaml:"uids"`
	GPUs  map[string]string `yaml:"gpus"`
}

// maxTenantsFile bounds the file ParseTenants reads.
const maxTenantsFile = 1 << 20

// ParseTenants parses a tenants file strictly: an unknown key, a
// duplicate or malformed name, a size ParseSize refuses (quotas are at
// least one byte) or an empty list is an error wrapping ErrTenants.
func ParseTenants(data []byte) (*Tenants, error) {
	if len(data) > maxTenantsFile {
		return nil, fmt.Errorf("%w: %d bytes, more than %d", ErrTenants, len(data), maxTenantsFile)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	var f tenantsYAML
	if err := dec.Decode(&f); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: empty file: want a tenants list", ErrTenants)
		}
		return nil, fmt.Errorf("%w: %w", ErrTenants, err)
	}
	var extra tenantsYAML
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: more than one YAML document", ErrTenants)
	}
	if len(f.Tenants) == 0 {
		return nil, fmt.Errorf("%w: no tenants listed (a broker without a tenants file accepts every tenant)", ErrTenants)
	}
	t := &Tenants{byName: make(map[string]*Tenant, len(f.Tenants))}
	for i, y := range f.Tenants {
		if err := checkTenantName(y.Name); err != nil {
			return nil, fmt.Errorf("%w: tenant %d: %w", ErrTenants, i+1, err)
		}
		if _, dup := t.byName[y.Name]; dup {
			return nil, fmt.Errorf("%w: tenant %q listed twice", ErrTenants, y.Name)
		}
		p := &Tenant{Name: y.Name, UIDs: slices.Clone(y.UIDs)}
		if y.Quota != "" {
			q, err := devspec.ParseSize(y.Quota)
			if err != nil {
				return nil, fmt.Errorf("%w: tenant %q: quota: %w", ErrTenants, y.Name, err)
			}
			p.Quota, p.Limited = q, true
		}
		if len(y.GPUs) > 0 {
			p.GPUs = make(map[string]uint64, len(y.GPUs))
			for gpu, s := range y.GPUs {
				if gpu == "" {
					return nil, fmt.Errorf("%w: tenant %q: empty GPU key under gpus (want an index or a UUID)", ErrTenants, y.Name)
				}
				q, err := devspec.ParseSize(s)
				if err != nil {
					return nil, fmt.Errorf("%w: tenant %q: gpus[%q]: %w", ErrTenants, y.Name, gpu, err)
				}
				p.GPUs[gpu] = q
			}
		}
		t.byName[y.Name] = p
		t.names = append(t.names, y.Name)
	}
	return t, nil
}

// LoadTenants reads and parses a tenants file; errors name the file.
func LoadTenants(path string) (*Tenants, error) {
	t, _, err := loadTenants(path)
	return t, err
}

func loadTenants(path string) (*Tenants, []byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("broker: tenants file: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxTenantsFile+1))
	if err != nil {
		return nil, nil, fmt.Errorf("broker: tenants file %s: %w", path, err)
	}
	t, err := ParseTenants(data)
	if err != nil {
		return nil, data, fmt.Errorf("broker: tenants file %s: %w", path, err)
	}
	return t, data, nil
}

// TenantsFile is a tenants file and what was last read from it, for
// reloads on a signal and for polling: a Kubernetes ConfigMap volume
// changes its files without telling the process.
type TenantsFile struct {
	path string
	last []byte
	read bool
}

// NewTenantsFile returns a TenantsFile for path, not read yet.
func NewTenantsFile(path string) *TenantsFile { return &TenantsFile{path: path} }

// Load reads and parses the file. changed reports whether its content
// differs from the last Load's, good or bad (the first Load's always
// does), so a poll acts, and counts a failure, once per change. On error
// t is nil.
func (f *TenantsFile) Load() (t *Tenants, changed bool, err error) {
	t, data, err := loadTenants(f.path)
	if data == nil && err != nil {
		// Unreadable: a change only if the last read was not the same.
		changed = !f.read || f.last != nil
		f.last, f.read = nil, true
		return nil, changed, err
	}
	changed = !f.read || !bytes.Equal(data, f.last)
	f.last, f.read = data, true
	return t, changed, err
}
