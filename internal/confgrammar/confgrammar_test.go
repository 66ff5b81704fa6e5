package confgrammar

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestSplit(t *testing.T) {
	pairs, err := Split(" a:1 , b:[256:1,>:8],c:True ", nil)
	want := []Pair{
		{"a", []string{"1"}},
		{"b", []string{"[", "256", ":", "1", ",", ">", ":", "8", "]"}},
		{"c", []string{"True"}},
	}
	if err != nil || !reflect.DeepEqual(pairs, want) {
		t.Fatalf("Split = %q, %v; want %q", pairs, err, want)
	}
	if pairs, err := Split("", nil); err != nil || len(pairs) != 0 {
		t.Errorf("Split(\"\") = %q, %v", pairs, err)
	}
}

// TestSplitRejects: every malformed string is an *Error naming the key
// (when there is one) and the problem.
func TestSplitRejects(t *testing.T) {
	for _, tc := range []struct{ s, key, problem string }{
		{",a:1", "", "expected a key, one of x, y"},
		{"a:1,,b:2", "", "expected a key"},
		{"a", "a", "expected key:value"},
		{"a 1", "a", "expected key:value"},
		{"a:", "a", "missing value"},
		{"a:,b:1", "a", "missing value"},
		{"a:[1", "a", "unterminated list"},
		{"a:1 2", "a", "expected , between key:value pairs"},
		{"a:1,", "", "trailing comma"},
		{"a:1,a:2", "a", "key given twice"},
	} {
		_, err := Split(tc.s, []string{"x", "y"})
		var e *Error
		if !errors.As(err, &e) || e.Key != tc.key || !strings.Contains(e.Problem, tc.problem) {
			t.Errorf("Split(%q) = %v, want an *Error for key %q: %q", tc.s, err, tc.key, tc.problem)
		}
	}
}
