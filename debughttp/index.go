package debughttp

import (
	"fmt"
	"net/http"
	"strings"
)

// Endpoint is one path a program serves, as its index page lists it.
type Endpoint struct{ Path, Doc string }

// PageEndpoints returns Pages as Endpoints, for an index.
func PageEndpoints() []Endpoint {
	eps := make([]Endpoint, 0, len(pages))
	for _, p := range pages {
		eps = append(eps, Endpoint{p.Path, p.Doc})
	}
	return eps
}

// Index returns a handler that answers with a plain-text index: title,
// a blank line, then each endpoint's path and what it holds, one a line.
// Mount it at "GET /{$}" (and, beside the debug pages, at
// "GET /debug/{$}"), so that a reader who opens the server's root finds
// its pages. The page is built once; the handler is safe for concurrent
// use.
func Index(title string, endpoints []Endpoint) http.Handler {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n\n", title)
	for _, e := range endpoints {
		fmt.Fprintf(&b, "%-16s %s\n", e.Path, e.Doc)
	}
	page := []byte(b.String())
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(page)
	})
}
