// Package confgrammar splits a configuration string in
// PYTORCH_CUDA_ALLOC_CONF's grammar, which ALLOCD_CONF shares, into its
// key:value pairs: pairs separated by commas, a value either one token or
// a list in brackets, whitespace around tokens ignored. It knows no keys:
// the device allocator (package allocator) and the pinned host allocator
// (package pinned) read the same string, each taking its own keys from
// the pairs, so both see the same syntax and report its errors alike.
package confgrammar

import (
	"fmt"
	"strings"
)

// Pair is one key and its value: one token, or a bracketed list's tokens,
// the brackets included ("[", "256", ":", "1", "]").
type Pair struct {
	Key string
	Val []string
}

// Error is a syntax error: Key is the key it concerns ("" when none),
// Value the text found there, and Problem what was expected.
type Error struct {
	Key, Value, Problem string
}

// Error formats the error.
func (e *Error) Error() string {
	if e.Key == "" {
		return fmt.Sprintf("%s (got %q)", e.Problem, e.Value)
	}
	return fmt.Sprintf("key %q: bad value %q: %s", e.Key, e.Value, e.Problem)
}

// IsPunct reports whether t is one of the grammar's punctuation tokens.
func IsPunct(t string) bool { return t == "," || t == ":" || t == "[" || t == "]" }

// Tokenize splits s into tokens: each of , : [ ] alone, and the runs of
// other characters between them and whitespace.
func Tokenize(s string) []string {
	var toks []string
	var cur strings.Builder
	flush := func() {
		if cur.Len() > 0 {
			toks = append(toks, cur.String())
			cur.Reset()
		}
	}
	for _, r := range s {
		switch r {
		case ',', ':', '[', ']':
			flush()
			toks = append(toks, string(r))
		case ' ', '\t', '\n', '\r':
			flush()
		default:
			cur.WriteRune(r)
		}
	}
	flush()
	return toks
}

// Split returns the pairs of s in order. A missing key, colon or value, an
// unterminated list, a missing or trailing comma and a key given twice are
// an *Error; keys names the keys the caller accepts, for the message about
// a missing key. The empty string has no pairs.
func Split(s string, keys []string) ([]Pair, error) {
	toks := Tokenize(s)
	var pairs []Pair
	seen := map[string]bool{}
	for i := 0; i < len(toks); {
		key := toks[i]
		if IsPunct(key) {
			return nil, &Error{Value: key, Problem: "expected a key, one of " + strings.Join(keys, ", ")}
		}
		if i+1 >= len(toks) || toks[i+1] != ":" {
			return nil, &Error{Key: key, Problem: "expected key:value"}
		}
		i += 2
		if i >= len(toks) || toks[i] == "," {
			return nil, &Error{Key: key, Problem: "missing value"}
		}
		var val []string
		if toks[i] == "[" {
			j := i + 1
			for j < len(toks) && toks[j] != "]" {
				j++
			}
			if j >= len(toks) {
				return nil, &Error{Key: key, Value: strings.Join(toks[i:], ""), Problem: "unterminated list: missing ]"}
			}
			val = toks[i : j+1]
			i = j + 1
		} else {
			val = toks[i : i+1]
			i++
		}
		if i < len(toks) {
			if toks[i] != "," {
				return nil, &Error{Key: key, Value: toks[i], Problem: "expected , between key:value pairs"}
			}
			i++
			if i == len(toks) {
				return nil, &Error{Value: s, Problem: "trailing comma"}
			}
		}
		if seen[key] {
			return nil, &Error{Key: key, Value: strings.Join(val, ""), Problem: "key given twice"}
		}
		seen[key] = true
		pairs = append(pairs, Pair{key, val})
	}
	return pairs, nil
}
