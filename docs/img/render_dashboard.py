#!/usr/bin/env python3
"""Scrape a running `allocd serve` and draw the panels of
docs/grafana-dashboard.json from the scrapes, as a PNG.

There is no Grafana in allocd's CI; this draws the same queries from real
/metrics scrapes so that the picture in docs/operations.md shows real data.

    allocd serve --device sim --sim-capacity 3150MiB \
        --replay testdata/traces/resnet50_train.pickle.gz --loop --replay-rate 1500 &
    python3 docs/img/render_dashboard.py --url http://127.0.0.1:9612 \
        --seconds 20 --interval 0.1 --out docs/img/dashboard.png

Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""

import argparse
import re
import time
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def scrape(url):
    """Returns {metric name: sum of its samples} for one scrape."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def rate(ts, values, window=1.0):
    """Per-second increase over the trailing window, like PromQL rate()."""
    out = []
    j = 0
    for i, t in enumerate(ts):
        while ts[j] < t - window:
            j += 1
        dt = t - ts[j]
        out.append((values[i] - values[j]) / dt if dt > 0 else 0.0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:9612")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--title", default="allocd: resnet50_train replayed in a loop on a simulated 3150 MiB GPU")
    ap.add_argument("--out", default="docs/img/dashboard.png")
    args = ap.parse_args()

    samples = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        t = time.monotonic() - t0
        samples.append((t, scrape(args.url)))
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0 - t)))
    ts = [t for t, _ in samples]

    def series(name, scale=1.0):
        return [s.get(name, 0.0) / scale for _, s in samples]

    gib, mib = float(1 << 30), float(1 << 20)
    allocated = series("allocd_allocated_bytes", gib)
    reserved = series("allocd_reserved_bytes", gib)
    fragmentation = [1 - a / r if r > 0 else 0 for a, r in zip(allocated, reserved)]

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), sharex=True)
    fig.suptitle(args.title + f"  ({len(samples)} scrapes, every {args.interval * 1000:.0f} ms)")

    ax = axes[0][0]
    ax.set_title("Allocated vs reserved (GiB)")
    ax.plot(ts, reserved, label="sum(allocd_reserved_bytes)", color="tab:orange")
    ax.plot(ts, allocated, label="sum(allocd_allocated_bytes)", color="tab:blue")
    ax.plot(ts, series("allocd_peak_reserved_bytes", gib), "--", label="allocd_peak_reserved_bytes", color="tab:red")
    ax.plot(ts, series("allocd_device_total_bytes", gib), ":", label="allocd_device_total_bytes", color="grey")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)

    ax = axes[0][1]
    ax.set_title("Fragmentation = 1 - allocated / reserved")
    ax.plot(ts, fragmentation, color="tab:purple")
    ax.set_ylim(0, 1)

    ax = axes[0][2]
    ax.set_title("Device mallocs and frees (per second)")
    ax.plot(ts, rate(ts, series("allocd_device_mallocs_total")), label="rate(allocd_device_mallocs_total)")
    ax.plot(ts, rate(ts, series("allocd_device_frees_total")), label="rate(allocd_device_frees_total)")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[1][0]
    ax.set_title("Allocations (per second)")
    ax.plot(ts, rate(ts, series("allocd_allocations_total")), color="tab:green", label="rate(allocd_allocations_total)")
    ax.legend(loc="lower right", fontsize=8)

    ax = axes[1][1]
    ax.set_title("OOMs and retries (total)")
    ax.step(ts, series("allocd_ooms_total"), where="post", label="allocd_ooms_total", color="tab:red")
    ax.step(ts, series("allocd_alloc_retries_total"), where="post", label="allocd_alloc_retries_total", color="tab:orange")
    ax.legend(loc="upper left", fontsize=8)

    ax = axes[1][2]
    ax.set_title("Largest free cached block (MiB)")
    ax.plot(ts, series("allocd_largest_free_block_bytes", mib), color="tab:cyan")
    ax.set_ylim(bottom=0)

    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out} from {len(samples)} scrapes")


if __name__ == "__main__":
    main()
