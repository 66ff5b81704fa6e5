"""Read allocd's /metrics from inside the process (stdlib only; used by tests and the harness)."""

import re
import urllib.request

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(address, path="/metrics", timeout=10):
    """GET http://address/path and return the body as text."""
    with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def samples(text):
    """Yield (name, labels dict, value float) for every sample line of a Prometheus text exposition."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        yield m.group(1), labels, value


def total(text, name, **match):
    """The sum of the samples of metric name whose labels include match (e.g. gpu="0"), or None if none."""
    found = [v for n, lab, v in samples(text) if n == name and all(lab.get(k) == w for k, w in match.items())]
    return sum(found) if found else None
