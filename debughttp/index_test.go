package debughttp_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/allocd/allocd/debughttp"
)

// TestIndex: the index lists its title and every endpoint given, the debug
// pages among them, with what each holds.
func TestIndex(t *testing.T) {
	eps := append([]debughttp.Endpoint{{Path: "/metrics", Doc: "Prometheus metrics"}}, debughttp.PageEndpoints()...)
	if len(eps) != len(debughttp.Pages())+1 {
		t.Fatalf("PageEndpoints gives %d endpoints for %d pages", len(eps)-1, len(debughttp.Pages()))
	}
	mux := http.NewServeMux()
	idx := debughttp.Index("example 1.0", eps)
	mux.Handle("GET /{$}", idx)
	mux.Handle("GET /debug/{$}", idx)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, path := range []string{"/", "/debug/"} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") || !strings.HasPrefix(string(body), "example 1.0\n\n") {
			t.Errorf("GET %s = %d %s %q", path, resp.StatusCode, resp.Header.Get("Content-Type"), body)
		}
		for _, e := range eps {
			if !strings.Contains(string(body), e.Path) || !strings.Contains(string(body), e.Doc) {
				t.Errorf("GET %s does not list %s (%s):\n%s", path, e.Path, e.Doc, body)
			}
		}
	}
}
