"""scripts/compare_workloads.py on synthetic results (stdlib only)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "compare_workloads.py")
MiB = 1 << 20


def result(allocator, workloads, conf=""):
    return {"allocator": allocator, "torch": "2.11.0", "device": "H200", "pytorch_cuda_alloc_conf": conf,
            "allocd_conf": conf if allocator == "allocd" else "", "workloads": workloads}


def wl(values, ms, reserved, kind="loss", metrics=None):
    return {"kind": kind, "values": values, "median_ms": ms, "peak_reserved": reserved,
            "peak_allocated": reserved // 2, "metrics_mid_run": metrics}


GOOD_METRICS = {"allocd_reserved_bytes": 100 * MiB, "allocd_allocated_bytes": 50 * MiB}


class CompareTest(unittest.TestCase):
    def run_compare(self, *results):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for i, r in enumerate(results):
                p = os.path.join(d, f"r{i}.json")
                with open(p, "w") as f:
                    json.dump(r, f)
                paths.append(p)
            md = os.path.join(d, "out.md")
            p = subprocess.run([sys.executable, SCRIPT, *paths, "--md", md], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
            with open(md) as f:
                return p.returncode, p.stdout.decode(), f.read()

    def test_all_pass(self):
        n1 = result("native", {"gpt2_train": wl([10.0, 9.5, 9.0], 50.0, 1000 * MiB),
                               "gpt2m_generate": wl(["aa", "bb"], 700.0, 800 * MiB, kind="tokens")})
        n2 = result("native", {"gpt2_train": wl([10.0, 9.5, 9.0], 50.4, 1000 * MiB),
                               "gpt2m_generate": wl(["aa", "bb"], 702.0, 800 * MiB, kind="tokens")})
        al = result("allocd", {"gpt2_train": wl([10.0, 9.5, 9.0], 50.9, 990 * MiB, metrics=GOOD_METRICS),
                               "gpt2m_generate": wl(["aa", "bb"], 705.0, 800 * MiB, kind="tokens",
                                                    metrics=GOOD_METRICS)})
        nx = result("native", {"gpt2_train": wl([10.0, 9.5, 9.0], 50.0, 900 * MiB)}, "expandable_segments:True")
        ax = result("allocd", {"gpt2_train": wl([10.0, 9.5, 9.0], 50.0, 880 * MiB)}, "expandable_segments:True")
        rc, out, md = self.run_compare(n1, n2, al, nx, ax)
        self.assertEqual(rc, 0, out)
        self.assertIn("| gpt2_train | 3 | 0 (bit-identical) | 0 (bit-identical) | PASS |", md)
        self.assertIn("0 steps differ", md)
        self.assertIn("9 of 9 criteria pass", md)

    def test_failures_are_named(self):
        n1 = result("native", {"gpt2_train": wl([10.0, 9.5], 50.0, 1000 * MiB)})
        n2 = result("native", {"gpt2_train": wl([10.0, 9.5], 50.0, 1000 * MiB)})
        al = result("allocd", {"gpt2_train": wl([10.0, 9.5001], 52.0, 1001 * MiB)})
        rc, out, md = self.run_compare(n1, n2, al)
        self.assertEqual(rc, 1)
        for what in ("gpt2_train results", "gpt2_train speed", "gpt2_train memory", "gpt2_train metrics"):
            self.assertIn(what, md.split("FAILED:")[1])

    def test_noisy_native_sets_the_tolerance(self):
        n1 = result("native", {"w": wl([1.0, 2.0], 10.0, 10)})
        n2 = result("native", {"w": wl([1.0, 2.001], 10.0, 10)})
        ok = result("allocd", {"w": wl([1.0015, 2.0], 10.0, 10, metrics=GOOD_METRICS)})
        bad = result("allocd", {"w": wl([1.0025, 2.0], 10.0, 10, metrics=GOOD_METRICS)})
        self.assertEqual(self.run_compare(n1, n2, ok)[0], 0)
        rc, _, md = self.run_compare(n1, n2, bad)
        self.assertEqual(rc, 1)
        self.assertIn("w: results: FAIL (tolerance 2 x native noise)", md)


if __name__ == "__main__":
    unittest.main()
