// Package deploy holds no code: it is the home of the Kubernetes manifests,
// the Prometheus Operator resources and the scrape samples beside it, and of
// the tests that check them against the real API types, Prometheus's rule
// and PromQL parsers and the metrics allocd exposes.
package deploy
