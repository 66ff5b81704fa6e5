#!/usr/bin/env python3
"""allocd's replays and PyTorch's, side by side in time, on one CPU core.

    python3 scripts/paired_replays.py ALLOCD TRACEDIR ANCHORDIR OUTJSON [--rounds 5] [--device cuda]
        [--conf CONF] [--no-pair]
    python3 scripts/paired_replays.py --summary OUTJSON    (prints a saved run's summary again)

Why: on a shared GPU host the speed of a core moves. On one H200 host, a
replay pinned to each of its 16 cores in turn ran 1.6 times slower on 7 of
them, and one core's speed moved as much from one minute to the next. Rounds
of all the traces on one side and then all on the other, on whatever core the
scheduler picks, compare a fast core's figures with a slow one's.

What it does:
1. Picks a core: `ALLOCD bench --device sim` replays the smallest trace on each
   core this process may use (the simulated device: no GPU call), and the core
   with the fastest warm replay is kept, unless --core names one. This process
   then runs on that core alone, and so does every allocd it starts.
2. For each round and each trace, allocd and PyTorch replay the trace one
   right after the other (allocd first in odd rounds, PyTorch first in even
   ones):
   - allocd: `ALLOCD bench --device DEVICE --no-pair --no-mixed --json TRACE
     TRACE`, the second trace's cold replay (ns_per_op) and warm replay
     (warm_ns_per_op);
   - PyTorch: the anchor's own C++ loops (anchor_ext.cpp, built as its
     bench.py builds it), `replay` twice and then `replay_warm`, in mode 0
     (PyTorch's caching allocator), with the statistics reset and the cache
     emptied before each, as bench.py does; the second `replay` is the
     cold figure.
   Each side's first cold replay is left out of the ratios (it is kept in
   OUTJSON as first_ns_per_op), so that both sides' timed replays follow
   one of the same trace in the same process: allocd starts a process for
   each trace, PyTorch's one process replays every trace in every round.
   On one H200 host the first replays cost what the later ones did (medians
   within 25%, in both directions, on both sides).
   Then the pair benchmark on each side, the same way: `ALLOCD bench
   --no-mixed` (no trace) and the anchor's pair_torch, best of 3 each.
   Each side's replay loop alone is timed too, once per trace: allocd's
   driver_ns_per_op (from the same `allocd bench`), and, after the rounds,
   the anchor's loop with the allocator left out (scripts/anchor_driver.cpp,
   compiled with `c++ -O2` in a second, the fastest of enough passes for
   about a million operations). Nothing is subtracted: the two are printed
   beside the replays.
3. Writes OUTJSON: the core, the calibration, and every round's figures.
   Prints, per trace and kind, both statistics:
   - the median over rounds of the round's ratio (PyTorch / allocd), from
     figures taken seconds apart on the same core;
   - the ratio of the two sides' best rounds;
   - the medians of the rounds in which both sides ran at the same pace:
     a core of a GPU host runs at one of two paces about 1.9 times apart
     and switches from one replay to the next, and the slow pace slows
     allocd more than PyTorch, so these say how much of a spread is the
     host's (a figure above PACE_SLOW times its side's fastest counts as
     slow).

--conf gives both sides one allocator configuration: allocd bench --conf CONF, and
PYTORCH_CUDA_ALLOC_CONF=CONF in this process before torch starts (the keys the two share, such
as expandable_segments:True). With it, each replay's peak reserved bytes are kept too, and
allocd's virtual memory calls (vmm). --no-pair leaves the pair benchmark out.

--vmm-timer counts and times PyTorch's virtual memory calls too: scripts/vmm_timer.c, compiled
with `cc -O2 -shared -fPIC` and loaded into this process before torch, hands PyTorch's lookups
of cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease a wrapper that counts each
call and clocks it, as allocd clocks its own. Each round's PyTorch cold replay then has a vmm
object with allocd's keys (creates, maps, access_grants, unmaps, releases, their *_ns, total_ns),
and the summary prints both sides' measured call time per trace. Were PyTorch to reach the
driver some other way, nothing would be hooked, and the summary says so.

Needs torch with CUDA (the anchor's extension is compiled on first use into
$EXT_BUILD, default /tmp/anchor_build).
"""
import argparse
import ctypes
import glob
import gzip
import json
import os
import pickle
import statistics
import subprocess
import sys
import time


def trace_ops(path, torch):
    """The anchor's trace_ops (bench.py), reading .pickle.gz too."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        snap = pickle.load(f)
    tr = snap["device_traces"][0]
    has_req = any(e["action"] == "free_requested" for e in tr)
    free_act = "free_requested" if has_req else "free_completed"
    ids, ops, nid = {}, [], 0
    for e in tr:
        if e["action"] == "alloc":
            ids[e["addr"]] = nid
            ops.append((0, nid, e["size"]))
            nid += 1
        elif e["action"] == free_act:
            i = ids.pop(e["addr"], None)
            if i is not None:
                ops.append((1, i, e["size"]))
    return torch.tensor(ops, dtype=torch.int64)


def trace_name(path):
    base = os.path.basename(path)
    for suffix in (".pickle.gz", ".pickle"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def allocd_bench(allocd, args, timeout=120):
    out = subprocess.run([allocd, "bench", "--json", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"allocd bench {' '.join(args)}: rc {out.returncode}: {out.stderr[-500:]}")
    return json.loads(out.stdout)


def anchor_driver(build):
    """scripts/anchor_driver.cpp compiled into build and loaded, or None (said why)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchor_driver.cpp")
    lib = os.path.join(build, "anchor_driver.so")
    try:
        os.makedirs(build, exist_ok=True)
        subprocess.run([os.environ.get("CXX", "c++"), "-O2", "-shared", "-fPIC", "-o", lib, src],
                       check=True, capture_output=True, text=True, timeout=60)
        f = ctypes.CDLL(lib).replay_driver
    except (OSError, subprocess.SubprocessError) as e:
        print(f"no driver loop for PyTorch's side: {e}", flush=True)
        return None
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4
    return f


def vmm_timer(build):
    """scripts/vmm_timer.c compiled into build and loaded into the global
    scope (before torch, so that PyTorch's lookups reach it), or None (said
    why)."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vmm_timer.c")
    lib = os.path.join(build, "vmm_timer.so")
    try:
        os.makedirs(build, exist_ok=True)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", lib, src, "-ldl"],
                       check=True, capture_output=True, text=True, timeout=60)
        t = ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"no timer of PyTorch's virtual memory calls: {e}", flush=True)
        return None
    t.vmm_timer_hooked.restype = ctypes.c_int
    return t


VMM_CALLS = ("create", "map", "access", "unmap", "release")


def vmm_read(t):
    """The timer's totals so far: {call: (count, ns)}."""
    out = (ctypes.c_longlong * 10)()
    t.vmm_timer_read(out)
    return {k: (out[i], out[5 + i]) for i, k in enumerate(VMM_CALLS)}


def vmm_since(t, before):
    """The calls since before (vmm_read), as allocd's vmm object names them."""
    now = vmm_read(t)
    d = {k: (now[k][0] - before[k][0], now[k][1] - before[k][1]) for k in VMM_CALLS}
    return {"creates": d["create"][0], "maps": d["map"][0], "access_grants": d["access"][0], "unmaps": d["unmap"][0],
            "releases": d["release"][0], "create_ns": d["create"][1], "map_ns": d["map"][1], "access_ns": d["access"][1],
            "unmap_ns": d["unmap"][1], "release_ns": d["release"][1], "total_ns": sum(v[1] for v in d.values())}


def calibrate(allocd, trace, cores):
    """Warm ns/op of trace on the simulated device, per core (median of 3)."""
    speed = {}
    for c in cores:
        os.sched_setaffinity(0, {c})
        rep = allocd_bench(allocd, ["--device", "sim", "--no-pair", "--no-mixed", trace, trace, trace])
        speed[c] = statistics.median(r["warm_ns_per_op"] for r in rep["replay"])
    return speed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("allocd")
    ap.add_argument("tracedir")
    ap.add_argument("anchordir")
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--core", type=int, default=-1, help="the core to run on (default: the fastest found)")
    ap.add_argument("--budget", type=float, default=0, help="start no round past this many seconds (0: no limit)")
    ap.add_argument("--conf", default="", help="both sides' allocator configuration (allocd's --conf, PyTorch's PYTORCH_CUDA_ALLOC_CONF)")
    ap.add_argument("--no-pair", action="store_true", help="leave the pair benchmark out")
    ap.add_argument("--vmm-timer", action="store_true", help="count and time PyTorch's virtual memory calls (scripts/vmm_timer.c)")
    args = ap.parse_args()
    start = time.time()

    traces = sorted(glob.glob(os.path.join(args.tracedir, "*.pickle.gz")) + glob.glob(os.path.join(args.tracedir, "*.pickle")))
    if not traces:
        sys.exit(f"no *.pickle.gz or *.pickle in {args.tracedir}")
    allowed = sorted(os.sched_getaffinity(0))
    if args.core >= 0:
        core, speed = args.core, {}
    else:
        smallest = min(traces, key=os.path.getsize)
        speed = calibrate(args.allocd, smallest, allowed)
        core = min(speed, key=speed.get)
        print(f"calibration on {trace_name(smallest)}, warm ns/op by core: "
              + " ".join(f"{c}:{v:.0f}" for c, v in sorted(speed.items())) + f"; running on core {core}", flush=True)
    os.sched_setaffinity(0, {core})
    conf = ["--conf", args.conf] if args.conf else []
    if args.conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.conf  # read when torch's allocator starts

    build = os.environ.get("EXT_BUILD", "/tmp/anchor_build")
    os.makedirs(build, exist_ok=True)
    timer = vmm_timer(build + "_vmm_timer") if args.vmm_timer else None

    import torch
    from torch.utils.cpp_extension import load

    ext = load(name="anchor_ext", sources=[os.path.join(args.anchordir, "anchor_ext.cpp")], extra_ldflags=["-lcudart"],
               build_directory=build, verbose=False, with_cuda=True)

    def reset():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()

    def torch_replay(ops):
        reset()
        first, n0, _, _ = ext.replay(0, ops)  # the untimed first replay (see above)
        reset()
        before = vmm_read(timer) if timer else None
        ns, n, _, _ = ext.replay(0, ops)
        vmm = vmm_since(timer, before) if timer else None
        peak = torch.cuda.memory_stats().get("reserved_bytes.all.peak")
        reset()
        wns, wn, _, _ = ext.replay_warm(0, ops)
        torch.cuda.empty_cache()
        r = {"ns_per_op": ns / n, "warm_ns_per_op": wns / wn, "first_ns_per_op": first / n0, "peak_reserved": peak}
        if vmm is not None:
            r["vmm"] = vmm
        return r

    def allocd_replay(path):
        first, r = allocd_bench(args.allocd, ["--device", args.device, "--no-pair", "--no-mixed", *conf, path, path])["replay"]
        return {"ns_per_op": r["ns_per_op"], "warm_ns_per_op": r["warm_ns_per_op"], "first_ns_per_op": first["ns_per_op"],
                "driver_ns_per_op": r.get("driver_ns_per_op"), "peak_reserved": r.get("peak_reserved_bytes"),
                "vmm": r.get("vmm")}

    sizes = [512, 4096, 1 << 20, 8 << 20, 64 << 20]

    def torch_pair():
        return {str(s): min(ext.pair_torch(s, 200000) for _ in range(3)) for s in sizes}

    def allocd_pair():
        return allocd_bench(args.allocd, ["--device", args.device, "--no-mixed", *conf])["pair_ns"]

    ops = {trace_name(p): trace_ops(p, torch) for p in traces}
    result = {"core": core, "calibration": {str(c): v for c, v in speed.items()}, "device": args.device, "conf": args.conf,
              "torch": torch.__version__, "rounds": [], "torch_driver_ns_per_op": {}}
    for k in range(1, args.rounds + 1):
        if args.budget and time.time() - start > args.budget:
            print(f"no time left for round {k}", flush=True)
            break
        rnd = {"replay": {}, "pair": {}}
        allocd_first = k % 2 == 1
        for p in traces:
            name = trace_name(p)
            if allocd_first:
                a, t = allocd_replay(p), torch_replay(ops[name])
            else:
                t, a = torch_replay(ops[name]), allocd_replay(p)
            rnd["replay"][name] = {"allocd": a, "torch": t}
        if args.no_pair:
            pass
        elif allocd_first:
            rnd["pair"] = {"allocd": allocd_pair(), "torch": torch_pair()}
        else:
            tp = torch_pair()
            rnd["pair"] = {"allocd": allocd_pair(), "torch": tp}
        if timer:
            result["torch_vmm_hooked"] = timer.vmm_timer_hooked()
        result["rounds"].append(rnd)
        print(f"round {k} done at {time.time() - start:.0f}s", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    # The anchor's loop alone, after the rounds so that it never delays them.
    driver = anchor_driver(build + "_driver")
    if driver is not None:
        for name, o in ops.items():
            o = o.contiguous()
            passes = 1 + min(100, max(1, 1_000_000 // max(len(o), 1)))
            result["torch_driver_ns_per_op"][name] = driver(o.data_ptr(), o.size(0), o.stride(0), o.stride(1), passes)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    summarize(result, [trace_name(p) for p in traces], [] if args.no_pair else sizes)


# A host's core runs at one of two paces about 1.9 times apart and switches
# between them from one replay to the next (docs/benchmarks.md, "On an H100
# host, 2026-12-08"): a figure more than PACE_SLOW times its side's fastest
# is taken as one of the slow pace.
PACE_SLOW = 1.3


def pace_matched(t, a):
    """The rounds' ratios (PyTorch / allocd) where both sides ran at the
    same pace: (fast-fast ratios, slow-slow ratios)."""
    tf, af = min(t), min(a)
    fast, slow = [], []
    for x, y in zip(t, a):
        xs, ys = x > PACE_SLOW * tf, y > PACE_SLOW * af
        if xs == ys:
            (slow if xs else fast).append(x / y)
    return fast, slow


def summarize(result, names, sizes):
    """Prints result's rounds: per trace and kind, both sides' figures, the
    median of the rounds' ratios, best round against best round, and the
    medians of the rounds in which both sides ran at the same pace."""
    rounds = result["rounds"]
    if not rounds:
        return
    print(f"core {result['core']}, {len(rounds)} round(s); each side's figures taken seconds apart; "
          "ratio = PyTorch / allocd: median of the rounds' ratios, and best round against best round; "
          f"same pace: the medians of the rounds in which both sides ran fast, or both slow (slow: above {PACE_SLOW}x its side's fastest)")

    def med(xs):
        return f"{statistics.median(xs):.2f}x ({len(xs)})" if xs else "- (0)"

    for name in names:
        for key, kind in (("warm_ns_per_op", "warm"), ("ns_per_op", "cold")):
            a = [r["replay"][name]["allocd"][key] for r in rounds]
            t = [r["replay"][name]["torch"][key] for r in rounds]
            ratios = [x / y for x, y in zip(t, a)]
            fast, slow = pace_matched(t, a)
            print(f"{name:<22} {kind}: PyTorch {' '.join(f'{x:.0f}' for x in t)}; allocd {' '.join(f'{x:.0f}' for x in a)};"
                  f" median ratio {statistics.median(ratios):.2f}x, best/best {min(t) / min(a):.2f}x;"
                  f" same pace: fast {med(fast)}, slow {med(slow)}")
    if "torch_vmm_hooked" in result:
        print_vmm(result, names)
    td = result.get("torch_driver_ns_per_op", {})
    for name in names:
        ad = [r["replay"][name]["allocd"].get("driver_ns_per_op") for r in rounds]
        ad = [x for x in ad if x is not None]
        print(f"{name:<22} driver alone, ns/op: PyTorch's loop {td.get(name, float('nan')):.2f};"
              f" allocd's {' '.join(f'{x:.2f}' for x in ad)}")
    for s in sizes if rounds[0].get("pair") else []:
        a = [r["pair"]["allocd"][str(s)] for r in rounds]
        t = [r["pair"]["torch"][str(s)] for r in rounds]
        ratios = [x / y for x, y in zip(t, a)]
        print(f"pair/{s:<17} PyTorch {' '.join(f'{x:.0f}' for x in t)}; allocd {' '.join(f'{x:.0f}' for x in a)};"
              f" median ratio {statistics.median(ratios):.2f}x, best/best {min(t) / min(a):.2f}x")


def vmm_calls(v):
    """A vmm object's calls, as creates/maps/grants/unmaps/releases."""
    return "/".join(str(v.get(k, 0)) for k in ("creates", "maps", "access_grants", "unmaps", "releases"))


def print_vmm(result, names):
    """Prints each trace's virtual memory calls of the timed cold replays, both
    sides measured: the calls of the first round and every round's ms, and the
    median of the rounds' ratios (PyTorch's ms over allocd's: above 1, allocd's
    calls took less time)."""
    rounds = result["rounds"]
    hooked = result["torch_vmm_hooked"]
    print(f"virtual memory calls of the cold replays, measured on both sides (PyTorch's through scripts/vmm_timer.c: "
          f"{hooked} of its lookups hooked{', so none of its calls were counted' if hooked == 0 else ''}); "
          "calls are creates/maps/access grants/unmaps/releases")
    for name in names:
        a = [r["replay"][name]["allocd"].get("vmm") for r in rounds]
        t = [r["replay"][name]["torch"].get("vmm") for r in rounds]
        if not all(a) or not all(t):
            continue
        ams, tms = [x["total_ns"] / 1e6 for x in a], [x["total_ns"] / 1e6 for x in t]
        ratios = [x / y for x, y in zip(tms, ams) if y > 0]
        med = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        print(f"{name:<22} vmm: PyTorch {vmm_calls(t[0])}, ms {' '.join(f'{x:.1f}' for x in tms)};"
              f" allocd {vmm_calls(a[0])}, ms {' '.join(f'{x:.1f}' for x in ams)}; median ratio {med}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summary":
        with open(sys.argv[2]) as f:
            saved = json.load(f)
        first = saved["rounds"][0] if saved["rounds"] else {}
        summarize(saved, list(first.get("replay", {})), [int(k) for k in first.get("pair", {}).get("allocd", {})])
    else:
        main()
