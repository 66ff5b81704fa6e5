package broker

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseTenants(t *testing.T) {
	good := `
tenants:
  - name: training
    quota: 60GiB
    uids: [1000, 1001]
    gpus:
      "1": 40GiB
      GPU-abcd: 1GiB
  - name: inference
`
	ts, err := ParseTenants([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if got := ts.Names(); len(got) != 2 || got[0] != "training" || got[1] != "inference" {
		t.Fatalf("Names = %v", got)
	}
	tr, ok := ts.Lookup("training")
	if !ok || len(tr.UIDs) != 2 {
		t.Fatalf("training: %+v", tr)
	}
	for _, tc := range []struct {
		index   int
		uuid    string
		quota   uint64
		limited bool
	}{{0, "GPU-x", 60 << 30, true}, {1, "GPU-x", 40 << 30, true}, {2, "GPU-abcd", 1 << 30, true}} {
		if q, l := tr.QuotaOn(tc.index, tc.uuid); q != tc.quota || l != tc.limited {
			t.Errorf("QuotaOn(%d, %s) = %d %v, want %d %v", tc.index, tc.uuid, q, l, tc.quota, tc.limited)
		}
	}
	inf, _ := ts.Lookup("inference")
	if _, l := inf.QuotaOn(0, "GPU-x"); l {
		t.Error("a tenant without a quota is limited")
	}
	if _, ok := ts.Lookup("other"); ok {
		t.Error("an unlisted tenant was found")
	}
	if p, ok := OpenTenants().Lookup("anyone"); !ok || p.Limited {
		t.Error("OpenTenants refused or limited a tenant")
	}
}

func TestParseTenantsErrors(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string
	}{
		{"empty", "", "empty file"},
		{"no tenants", "tenants: []\n", "no tenants"},
		{"unknown top key", "tenant:\n  - name: a\n", "field tenant not found"},
		{"unknown tenant key", "tenants:\n  - name: a\n    qouta: 1GiB\n", "field qouta not found"},
		{"bad name", "tenants:\n  - name: a/b\n", "character"},
		{"no name", "tenants:\n  - quota: 1GiB\n", "tenant 1"},
		{"duplicate", "tenants:\n  - name: a\n  - name: a\n", "listed twice"},
		{"bad quota", "tenants:\n  - name: a\n    quota: lots\n", "quota"},
		{"zero quota", "tenants:\n  - name: a\n    quota: 0\n", "quota"},
		{"bad gpu quota", "tenants:\n  - name: a\n    gpus:\n      \"0\": -1GiB\n", "gpus"},
		{"negative uid", "tenants:\n  - name: a\n    uids: [-1]\n", "line 3"},
		{"two documents", "tenants:\n  - name: a\n---\ntenants:\n  - name: b\n", "more than one"},
		{"not yaml", "tenants: [\n", ""},
	} {
		_, err := ParseTenants([]byte(tc.in))
		if err == nil || !errors.Is(err, ErrTenants) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want ErrTenants saying %q", tc.name, err, tc.want)
		}
	}
}

func TestLoadTenantsNamesFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tenants.yaml")
	if _, err := LoadTenants(path); err == nil {
		t.Fatal("a missing file loaded")
	}
	os.WriteFile(path, []byte("tenants:\n  - name: a\n    quota: x\n"), 0o600)
	if _, err := LoadTenants(path); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("error %v does not name the file", err)
	}
}

func TestTenantsFileChanges(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tenants.yaml")
	os.WriteFile(path, []byte("tenants:\n  - name: a\n"), 0o600)
	tf := NewTenantsFile(path)
	steps := []struct {
		write       string // "" leaves the file; "-" removes it
		changed, ok bool
	}{
		{"", true, true},  // the first load
		{"", false, true}, // unchanged
		{"tenants:\n  - name: b\n", true, true},
		{"tenants:\n  - name: b\n    qouta: 1\n", true, false},
		{"", false, false}, // the same bad content: no new failure
		{"-", true, false},
		{"", false, false},
		{"tenants:\n  - name: c\n", true, true},
	}
	for i, st := range steps {
		switch st.write {
		case "":
		case "-":
			os.Remove(path)
		default:
			os.WriteFile(path, []byte(st.write), 0o600)
		}
		ts, changed, err := tf.Load()
		if changed != st.changed || (err == nil) != st.ok || (ts != nil) != st.ok {
			t.Errorf("step %d: changed %v, err %v, tenants %v; want changed %v, ok %v", i, changed, err, ts != nil, st.changed, st.ok)
		}
	}
}
