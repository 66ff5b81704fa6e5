#!/usr/bin/env python3
"""CUDA graphs and private pools, allocd against PyTorch's allocator: a markdown report.

    python3 scripts/compare_graphs.py OUTDIR > compare.md

Reads every torch_graphs.py result JSON in OUTDIR (files with "tool": "torch_graphs"; others
are left alone) and prints, per stage, native against allocd with a verdict per criterion:

  PASS / FAIL   a goal of the issue: the stage ran; outputs equal to native's (bitwise, or for
                the compiled ResNet within a tolerance, said so); peak reserved (capture_forward)
                at most native's; memory returned (two_graphs_pool, mempool); routing into the
                MemPool (mempool); the decode replay's pooled median at most native's (also
                marked "within 2%" when at most 1.02 times it)
  info          a figure beside them (counted in no verdict)

A stage missing on a side, or one that raised, is a FAIL and its error is quoted. The decode
table pools every timed replay of every decode process of a side, and gives each process's
median and the ratio within each ABBA pair (processes with the same tag).

Exit status: 0 when every criterion passed, 1 otherwise, 2 when there is nothing to read.
"""

import glob
import json
import os
import statistics
import sys

MiB = 2 ** 20
SIDES = ("native", "allocd")
FUNC_STAGES = ["capture_forward", "two_graphs_pool", "mempool", "compile_generate", "compile_resnet"]
DECODE_GOAL, DECODE_NEAR = 1.0, 1.02


def load(outdir):
    """{"native"/"allocd": {stage: (record, file name)}}, {"native"/"allocd": [(tag, record, file)]}, runs."""
    func = {s: {} for s in SIDES}
    decode = {s: [] for s in SIDES}
    runs = []
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError) as e:
            print(f"<!-- {os.path.basename(path)} unreadable: {e} -->")
            continue
        if not isinstance(r, dict) or r.get("tool") != "torch_graphs" or r.get("allocator") not in SIDES:
            continue
        if r.get("tag") == "warmup":  # device_graphs.sh's compile warm-up: fills the inductor cache only
            continue
        runs.append((os.path.basename(path), r))
        side = r["allocator"]
        for stage, rec in r.get("stages", {}).items():
            if stage == "decode_replay":
                decode[side].append((r.get("tag", ""), rec, os.path.basename(path)))
            else:
                func[side][stage] = (rec, os.path.basename(path))  # a later file (by name) wins
        # A stage asked for but not in the file: the process died before it.
        for stage in r.get("stages_requested", []):
            if stage not in r.get("stages", {}):
                if r.get("setup_error"):
                    rec = {"ok": False, "error": f"not run: the process's setup failed: {r['setup_error']}",
                           "traceback": r.get("setup_traceback", "")}
                else:
                    rec = {"ok": False, "error": "not run: the process ended before this stage (timeout or crash; "
                                                 f"see {os.path.basename(path)[:-5]}.log)"}
                if stage == "decode_replay":
                    decode[side].append((r.get("tag", ""), rec, os.path.basename(path)))
                else:
                    func[side].setdefault(stage, (rec, os.path.basename(path)))
    return func, decode, runs


def mib(x):
    return "-" if x is None else f"{x / MiB:.1f}"


def yn(x):
    return "-" if x is None else ("yes" if x else "no")


def short(h):
    return "-" if not h else h[:16]


def ratio(a, n):
    return None if a is None or not n else a / n


def fmt_ratio(x):
    return "-" if x is None else f"{x:.3f}"


def one_line(text, n=300):
    text = " ".join(str(text).split())
    text = text.replace("|", "\\|")
    return text if len(text) <= n else text[:n] + "…"


class Report:
    def __init__(self):
        self.rows = []   # (stage, criterion, native, allocd, verdict)
        self.details = []
        self.fails = []
        self._tbs = set()

    def row(self, stage, criterion, native, allocd, verdict):
        self.rows.append((stage, criterion, native, allocd, verdict))
        if verdict.startswith("FAIL"):
            self.fails.append(f"{stage}: {criterion}")

    def error(self, header, tb, limit=3000):
        """An error's header and its traceback; a traceback already given is not repeated."""
        tb = (tb or "").strip()[-limit:]
        if not tb:
            self.details.append(header + "\n")
        elif tb in self._tbs:
            self.details.append(header + " (traceback as above)\n")
        else:
            self._tbs.add(tb)
            self.details.append(f"{header}\n\n```\n{tb}\n```\n")

    def check(self, stage, criterion, native, allocd, ok, extra=""):
        self.row(stage, criterion, native, allocd, ("PASS" if ok else "FAIL") + (f" {extra}" if extra else ""))

    def info(self, stage, criterion, native, allocd):
        self.row(stage, criterion, native, allocd, "info")


def ran(rep, stage, pair):
    """The "ran" row; returns the two records when both ran without an error, else None."""
    recs = {}
    cells = {}
    for side in SIDES:
        got = pair.get(side)
        if got is None:
            cells[side] = "MISSING"
            continue
        rec, fname = got
        recs[side] = rec
        cells[side] = f"ok ({rec.get('wall_s', '?')} s)" if rec.get("ok") else f"ERROR: {one_line(rec.get('error', '?'), 200)}"
    ok = all(side in recs and recs[side].get("ok") for side in SIDES)
    rep.check(stage, "ran without an error", cells["native"], cells["allocd"], ok)
    for side in SIDES:
        rec = recs.get(side)
        if rec is not None and not rec.get("ok"):
            rep.error(f"**{stage}, {side}: {one_line(rec.get('error', '?'), 500)}** ({pair[side][1]})", rec.get("traceback"))
    return (recs["native"], recs["allocd"]) if ok else None


def peak_rows(rep, stage, n, a, criterion):
    pn, pa = n.get("peak_reserved"), a.get("peak_reserved")
    r = ratio(pa, pn)
    text = f"peak reserved MiB (ratio {fmt_ratio(r)})"
    if criterion:
        rep.check(stage, text + ": allocd ≤ native", mib(pn), mib(pa), pa is not None and pn is not None and pa <= pn,
                  "" if pa is None or pn is None else f"({(pa - pn) / MiB:+.1f} MiB)")
    else:
        rep.info(stage, text + f"; allocd ≤ native: {yn(None if r is None else pa <= pn)}", mib(pn), mib(pa))
    rep.info(stage, "reserved at the stage's end MiB", mib(n.get("reserved_end")), mib(a.get("reserved_end")))


def pools_text(p):
    if not isinstance(p, dict):
        return "-"
    if "error" in p:
        return "snapshot error: " + one_line(p["error"], 80)
    pools = p.get("pools", {})
    t = ", ".join(f"{k}: {v / MiB:.1f} MiB" for k, v in pools.items()) or "none"
    if p.get("segments_without_pool_id"):
        t += f" ({p['segments_without_pool_id']} segments without segment_pool_id)"
    return t


def equal_hash_row(rep, stage, what, n, a):
    hn, ha = (n or {}).get("sha256"), (a or {}).get("sha256")
    ok = hn is not None and hn == ha
    extra = ""
    if not ok and n and a and n.get("first") and a.get("first"):
        d = max(abs(x - y) for x, y in zip(n["first"], a["first"]))
        extra = f"(sums {n.get('sum'):.6g} / {a.get('sum'):.6g}, max diff of the first values {d:.3g})"
    rep.check(stage, what, short(hn), short(ha), ok, extra)


def capture_forward(rep, pair):
    st = "capture_forward"
    both = ran(rep, st, pair)
    if not both:
        return
    n, a = both
    rep.check(st, f"{a.get('replays', '?')} replays == eager, in its process", yn(n.get("replay_equals_eager")),
              yn(a.get("replay_equals_eager")), bool(a.get("replay_equals_eager")),
              f"(max diff {a.get('replay_max_diff_eager')})")
    rep.check(st, "a 2nd input through the graph == eager", yn(n.get("replay2_equals_eager")),
              yn(a.get("replay2_equals_eager")), bool(a.get("replay2_equals_eager")))
    equal_hash_row(rep, st, "replayed logits equal to native's (SHA-256)", n.get("replay"), a.get("replay"))
    equal_hash_row(rep, st, "2nd input's replayed logits equal to native's", n.get("replay2"), a.get("replay2"))
    hn, ha = (n.get("eager") or {}).get("sha256"), (a.get("eager") or {}).get("sha256")
    rep.info(st, f"eager logits equal to native's: {yn(hn is not None and hn == ha)}", short(hn), short(ha))
    peak_rows(rep, st, n, a, criterion=True)
    rn = (n.get("mem_after_capture") or {}).get("reserved")
    ra = (a.get("mem_after_capture") or {}).get("reserved")
    rep.check(st, f"reserved after capture MiB (ratio {fmt_ratio(ratio(ra, rn))}): allocd ≤ native", mib(rn), mib(ra),
              ra is not None and rn is not None and ra <= rn)
    cn, ca = n.get("capture_peak_reserved"), a.get("capture_peak_reserved")
    rep.info(st, f"peak reserved over capture + replays MiB (ratio {fmt_ratio(ratio(ca, cn))})", mib(cn), mib(ca))
    bn = (n.get("mem_before_capture") or {}).get("reserved")
    ba = (a.get("mem_before_capture") or {}).get("reserved")
    rep.info(st, "reserved before capture MiB", mib(bn), mib(ba))
    rep.info(st, "private pool segments after capture (snapshot)", pools_text(n.get("pool_segments_after_capture")),
             pools_text(a.get("pool_segments_after_capture")))
    pa = (a.get("mem_after_capture") or {}).get("private_reserved_bytes")
    if pa is not None:
        rep.info(st, "allocd's private_reserved_bytes after capture MiB", "-", mib(pa))


def two_graphs_pool(rep, pair):
    st = "two_graphs_pool"
    both = ran(rep, st, pair)
    if not both:
        return
    n, a = both
    rep.check(st, "g1 (A) and g2 (B, pool=g1.pool()) replays == eager, twice", yn(n.get("results_correct")),
              yn(a.get("results_correct")), bool(a.get("results_correct")))
    rep.check(st, "g2 shares g1's pool", f"{yn(n.get('same_pool'))} {n.get('pool_ids')}",
              f"{yn(a.get('same_pool'))} {a.get('pool_ids')}", bool(a.get("same_pool")))
    equal_hash_row(rep, st, "B's output equal to native's", n.get("b"), a.get("b"))

    def mem_text(r):
        s, c, e = r.get("mem_start") or {}, r.get("mem_after_capture") or {}, r.get("mem_after_release") or {}
        if not s or not e:
            return "-"
        return (f"reserved {mib(s.get('reserved'))} → {mib(c.get('reserved'))} → {mib(e.get('reserved'))} MiB; free "
                f"{(e['free'] - s['free']) / MiB:+.1f} MiB at the end (capture {(c.get('free', s['free']) - s['free']) / MiB:+.1f})")
    rep.check(st, "memory returned after del + empty_cache (reserved start → capture → released; free's change)",
              f"{yn(n.get('memory_returned'))}: {mem_text(n)}", f"{yn(a.get('memory_returned'))}: {mem_text(a)}",
              bool(a.get("memory_returned")))
    rep.info(st, "pool segments after capture / after release", f"{pools_text(n.get('pool_segments_after_capture'))} / "
             f"{pools_text(n.get('pool_segments_after_release'))}", f"{pools_text(a.get('pool_segments_after_capture'))} / "
             f"{pools_text(a.get('pool_segments_after_release'))}")
    peak_rows(rep, st, n, a, criterion=False)


def mempool(rep, pair):
    st = "mempool"
    both = ran(rep, st, pair)
    if not both:
        return
    n, a = both

    def route(r):
        return (f"inside in pool {r.get('inside_in_pool')}, outside in pool {r.get('outside_in_pool')}, freed pool "
                f"block given outside {yn(r.get('freed_pool_block_given_outside'))}")
    rep.check(st, "use_mem_pool routes into the pool and back (sizes " + ", ".join(str(x) for x in a.get("sizes", [])) + " B)",
              f"{yn(n.get('routing_ok'))}: {route(n)}", f"{yn(a.get('routing_ok'))}: {route(a)}", bool(a.get("routing_ok")))
    rep.info(st, "pool id; pool segments MiB (snapshot); every segment has segment_pool_id",
             f"{n.get('pool_id')}; {mib(n.get('pool_segment_bytes'))}; {yn(n.get('segments_have_pool_id'))}",
             f"{a.get('pool_id')}; {mib(a.get('pool_segment_bytes'))}; {yn(a.get('segments_have_pool_id'))}")
    rep.info(st, "a freed pool block reused inside the pool", yn(n.get("freed_pool_block_reused_inside")),
             yn(a.get("freed_pool_block_reused_inside")))
    if "pool_snapshot_segments" in n or "pool_snapshot_segments" in a:
        rep.info(st, "pool.snapshot(): segments, MiB", f"{n.get('pool_snapshot_segments', '-')}, {mib(n.get('pool_snapshot_bytes'))}",
                 f"{a.get('pool_snapshot_segments', '-')}, {mib(a.get('pool_snapshot_bytes'))}")

    def mem_text(r):
        s, w, e = r.get("mem_start") or {}, r.get("mem_with_tensors") or {}, r.get("mem_after_release") or {}
        if not s or not e:
            return "-"
        return (f"reserved {mib(s.get('reserved'))} → {mib(w.get('reserved'))} → {mib(e.get('reserved'))} MiB, free "
                f"{(e['free'] - s['free']) / MiB:+.1f} MiB; pool gone from the snapshot {yn(r.get('pool_gone_from_snapshot'))}")
    rep.check(st, "memory returned after del tensors + pool, empty_cache (reserved start → with tensors → released)",
              f"{yn(n.get('memory_returned'))}: {mem_text(n)}", f"{yn(a.get('memory_returned'))}: {mem_text(a)}",
              bool(a.get("memory_returned")))
    peak_rows(rep, st, n, a, criterion=False)


def compile_generate(rep, pair):
    st = "compile_generate"
    both = ran(rep, st, pair)
    for side in SIDES:  # the static-cache path's failure is worth seeing even when the fallback ran
        rec = (pair.get(side) or (None,))[0]
        if rec and rec.get("static_error"):
            rep.error(f"**{st}, {side}: generate() with a static cache failed, the fixed-shape loop ran instead: "
                      f"{one_line(rec['static_error'], 500)}**", rec.get("static_traceback"), 2000)
    if not both:
        return
    n, a = both
    rep.check(st, "same path", n.get("path"), a.get("path"), n.get("path") == a.get("path"))
    rep.check(st, "generated token ids (2nd run) equal to native's", short(n.get("tokens_sha256")),
              short(a.get("tokens_sha256")), n.get("tokens") is not None and n.get("tokens") == a.get("tokens"))
    rep.info(st, "both runs agree; compiled == eager", f"{yn(n.get('runs_agree'))}; {yn(n.get('equals_eager'))}",
             f"{yn(a.get('runs_agree'))}; {yn(a.get('equals_eager'))}")
    rep.info(st, "time of each run s (first compiles); eager s", f"{n.get('run_s')}; {n.get('eager_s')}",
             f"{a.get('run_s')}; {a.get('eager_s')}")
    rep.info(st, "pool segments after the runs", pools_text(n.get("pool_segments_after_runs")),
             pools_text(a.get("pool_segments_after_runs")))
    peak_rows(rep, st, n, a, criterion=False)


def compile_resnet(rep, pair):
    st = "compile_resnet"
    both = ran(rep, st, pair)
    if not both:
        return
    n, a = both
    on, oa = n.get("out") or {}, a.get("out") or {}
    if on.get("sha256") and on.get("sha256") == oa.get("sha256"):
        rep.check(st, "output equal to native's", short(on["sha256"]), short(oa["sha256"]), True, "(bitwise)")
    else:
        # Compiled kernels may be chosen differently in two processes: a tolerance, from the
        # compiled-vs-eager difference each process saw, or 1% of the output's largest value.
        fa, fn = oa.get("first256") or [], on.get("first256") or []
        ra, rn = oa.get("row_sums") or [], on.get("row_sums") or []
        d = max([abs(x - y) for x, y in zip(fn, fa)] or [float("inf")])
        dr = max([abs(x - y) for x, y in zip(rn, ra)] or [float("inf")])
        tol = max(2 * max(n.get("max_diff_eager", 0), a.get("max_diff_eager", 0)), 0.01 * n.get("max_abs_eager", 0))
        rep.check(st, "output equal to native's", f"{short(on.get('sha256'))} sum {on.get('sum')}",
                  f"{short(oa.get('sha256'))} sum {oa.get('sum')}", d <= tol,
                  f"(not bitwise; max diff of the first 256 values {d:.4g}, tolerance {tol:.4g}; of the row sums {dr:.4g})")
    rep.info(st, "max |compiled − eager| in its process (max |eager|); calls agree",
             f"{n.get('max_diff_eager')} ({n.get('max_abs_eager')}); {yn(n.get('calls_agree'))}",
             f"{a.get('max_diff_eager')} ({a.get('max_abs_eager')}); {yn(a.get('calls_agree'))}")
    rep.info(st, "time of each call s (the first compiles)", n.get("call_s"), a.get("call_s"))
    rep.info(st, "pool segments after the calls", pools_text(n.get("pool_segments_after_calls")),
             pools_text(a.get("pool_segments_after_calls")))
    peak_rows(rep, st, n, a, criterion=False)


def decode_section(rep, decode):
    st = "decode_replay"
    md = ""
    ok_runs = {s: [(t, r, f) for t, r, f in decode[s] if r.get("ok") and r.get("wall_us")] for s in SIDES}
    bad = [(s, t, r, f) for s in SIDES for t, r, f in decode[s] if not (r.get("ok") and r.get("wall_us"))]
    cells = {s: f"{len(ok_runs[s])} ok" + (f", {sum(1 for b in bad if b[0] == s)} failed" if any(b[0] == s for b in bad) else "")
             for s in SIDES}
    rep.check(st, "processes ran without an error", cells["native"], cells["allocd"],
              not bad and all(ok_runs[s] for s in SIDES))
    for s, t, r, f in bad:
        rep.error(f"**{st}, {s} ({f}): {one_line(r.get('error', 'no timings'), 500)}**", r.get("traceback"))
    for s in SIDES:
        for t, r, f in decode[s]:
            if r.get("impl_errors"):
                errs = "; ".join(f"{k}: {one_line(v.get('error'), 200)}" for k, v in r["impl_errors"].items())
                rep.details.append(f"**{st}, {s} ({f}): an implementation failed before the one that ran "
                                   f"({r.get('impl', 'none')}): {errs}**\n")
    if not all(ok_runs[s] for s in SIDES):
        return md
    impls = {s: sorted({r.get("impl") for _, r, _ in ok_runs[s]}) for s in SIDES}
    rep.check(st, "the same decode step (implementation) everywhere", ", ".join(map(str, impls["native"])),
              ", ".join(map(str, impls["allocd"])), impls["native"] == impls["allocd"] and len(impls["native"]) == 1)
    hashes = {s: sorted({(r.get("replay") or {}).get("sha256") for _, r, _ in ok_runs[s]}) for s in SIDES}
    rep.check(st, "replayed logits equal to native's (every process)", ", ".join(map(short, hashes["native"])),
              ", ".join(map(short, hashes["allocd"])), len(hashes["native"]) == 1 and hashes["native"] == hashes["allocd"])
    rep.check(st, "replay == eager, in each process", yn(all(r.get("replay_equals_eager") for _, r, _ in ok_runs["native"])),
              yn(all(r.get("replay_equals_eager") for _, r, _ in ok_runs["allocd"])),
              all(r.get("replay_equals_eager") for _, r, _ in ok_runs["allocd"]))
    pooled = {s: statistics.median([x for _, r, _ in ok_runs[s] for x in r["wall_us"]]) for s in SIDES}
    counts = {s: sum(len(r["wall_us"]) for _, r, _ in ok_runs[s]) for s in SIDES}
    enough = all(len(r["wall_us"]) >= 200 for s in SIDES for _, r, _ in ok_runs[s])
    rep.check(st, "≥ 200 timed replays in every process", f"{counts['native']} in {len(ok_runs['native'])}",
              f"{counts['allocd']} in {len(ok_runs['allocd'])}", enough)
    r = pooled["allocd"] / pooled["native"]
    near = "" if r <= DECODE_GOAL else ("(within 2%)" if r <= DECODE_NEAR else "(more than 2% slower)")
    rep.check(st, f"pooled median µs a replay + synchronize (ratio allocd / native {r:.4f}): allocd ≤ native",
              f"{pooled['native']:.2f}", f"{pooled['allocd']:.2f}", r <= DECODE_GOAL, near)
    gpu = {s: statistics.median([x for _, r_, _ in ok_runs[s] for x in r_.get("gpu_us", [])] or [float("nan")]) for s in SIDES}
    rep.info(st, f"pooled median GPU µs a replay (CUDA events; ratio {gpu['allocd'] / gpu['native']:.4f})",
             f"{gpu['native']:.2f}", f"{gpu['allocd']:.2f}")
    # Per process, and the ratio within each ABBA pair (the same tag).
    md += ("\n### decode_replay per process\n\n| process | allocator | tag | step | median µs | p10 µs | p90 µs | "
           "GPU median µs | replays | logits SHA-256 |\n|---|---|---|---|---|---|---|---|---|---|\n")
    allr = sorted([(t, s, r, f) for s in SIDES for t, r, f in ok_runs[s]], key=lambda x: (x[0], x[3]))
    for t, s, r_, f in allr:
        md += (f"| {f} | {s} | {t} | {r_.get('impl')} | {r_['median_us']:.2f} | {r_['p10_us']:.2f} | {r_['p90_us']:.2f} | "
               f"{r_.get('median_gpu_us', float('nan')):.2f} | {len(r_['wall_us'])} | {short((r_.get('replay') or {}).get('sha256'))} |\n")
    tags = sorted({t for t, _, _, _ in allr})
    paired = []
    for t in tags:
        n = [r_ for tt, s, r_, _ in allr if tt == t and s == "native"]
        a = [r_ for tt, s, r_, _ in allr if tt == t and s == "allocd"]
        if len(n) == 1 and len(a) == 1:
            paired.append((t, a[0]["median_us"] / n[0]["median_us"]))
    meds = {s: [r_["median_us"] for _, r_, _ in ok_runs[s]] for s in SIDES}
    md += (f"\nProcess medians µs: native {', '.join(f'{x:.2f}' for x in meds['native'])} (spread max/min "
           f"{max(meds['native']) / min(meds['native']):.3f}); allocd {', '.join(f'{x:.2f}' for x in meds['allocd'])}.\n")
    if paired:
        md += ("Ratio allocd / native within each pair: " + ", ".join(f"{t} {x:.4f}" for t, x in paired)
               + f"; their median {statistics.median(x for _, x in paired):.4f}.\n")
    return md


def main():
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    outdir = sys.argv[1]
    func, decode, runs = load(outdir)
    if not runs:
        print(f"no torch_graphs.py results in {outdir}")
        return 2
    rep = Report()
    stages_seen = [s for s in FUNC_STAGES if any(s in func[side] for side in SIDES)]
    fns = {"capture_forward": capture_forward, "two_graphs_pool": two_graphs_pool, "mempool": mempool,
           "compile_generate": compile_generate, "compile_resnet": compile_resnet}
    for s in stages_seen:
        fns[s](rep, {side: func[side].get(s) for side in SIDES})
    decode_md = ""
    if any(decode[s] for s in SIDES):
        decode_md = decode_section(rep, decode)

    device = next((r["device"] for _, r in runs if r.get("device")), "?")
    vers = sorted({json.dumps(r["versions"], sort_keys=True) for _, r in runs if r.get("versions")})
    confs = sorted({f"{r['allocator']}: PYTORCH_CUDA_ALLOC_CONF={r.get('pytorch_cuda_alloc_conf', '')!r} "
                    f"ALLOCD_CONF={r.get('allocd_conf', '')!r}" for _, r in runs})
    syncs = sorted({(r.get("sync") or {}).get("mode", "?") for _, r in runs if r.get("sync")})
    hooks = sorted({str(r.get("hooks_installed")) for _, r in runs if r["allocator"] == "allocd" and "hooks_installed" in r})
    setup_failed = [f"{f} ({one_line(r['setup_error'], 200)})" for f, r in runs if r.get("setup_error")]
    out = ["# CUDA graphs, private pools and torch.compile(mode=\"reduce-overhead\"): allocd vs native", ""]
    out.append(f"{len(runs)} processes ({', '.join(f for f, _ in runs)}); device {device}; versions "
               + ("; ".join(", ".join(f"{k} {v}" for k, v in json.loads(v).items()) for v in vers) or "-")
               + f"; synchronize {', '.join(syncs) or '-'}; allocd's C++ allocator installed: {', '.join(hooks) or '-'}.")
    out.append("Configurations: " + "; ".join(confs) + ".")
    if setup_failed:
        out.append(f"**Processes whose setup failed (no stage ran): {'; '.join(setup_failed)}.**")
    missing = [s for s in FUNC_STAGES if s not in stages_seen]
    if missing:
        out.append(f"Stages with no result on either side: {', '.join(missing)}.")
    if not any(decode[s] for s in SIDES):
        out.append("No decode_replay results.")
    out += ["", "| stage | criterion | native | allocd | verdict |", "|---|---|---|---|---|"]
    for stage, crit, n, a, v in rep.rows:
        out.append(f"| {stage} | {one_line(crit, 400)} | {one_line(n, 400)} | {one_line(a, 400)} | "
                   f"{'**' + v + '**' if v.startswith('FAIL') else v} |")
    out.append("")
    out.append("Peaks are torch.cuda.memory_stats()'s reserved_bytes.all.peak over the stage (allocd's under allocd), "
               "after gc, empty_cache and reset_peak_memory_stats at its start; the criterion is on capture_forward's, "
               "the others are info. A compile stage's peak depends on whether it compiled cold (autotuning holds "
               "memory) or from the inductor cache: compare its first call's time on the two sides.")
    out.append(decode_md)
    if rep.details:
        out += ["", "## Errors", ""] + rep.details
    out.append("")
    if rep.fails:
        out.append(f"**Overall: FAIL** ({len(rep.fails)}): " + "; ".join(rep.fails) + ".")
    else:
        out.append("**Overall: PASS** (every criterion above).")
    print("\n".join(out))
    return 1 if rep.fails else 0


if __name__ == "__main__":
    sys.exit(main())
