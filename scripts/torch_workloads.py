#!/usr/bin/env python3
"""Real PyTorch workloads under PyTorch's allocator or allocd, with timed step loops.

    python3 scripts/torch_workloads.py --allocator native|allocd --workloads a,b,c --out result.json

The models come from the anchor workloads file (--anchor; its gpt2() builder and
torchvision's ResNets); the step loops are this script's own:

  gpt2_train            HF GPT-2 (124M) training, batch 8 x 512 tokens, bf16 autocast, AdamW
  resnet50_train        torchvision ResNet-50 training, batch 64 x 224², bf16 autocast, SGD momentum
  multistream_prefetch  ResNet-18 training whose batches a side stream produces one step ahead,
                        handed over with record_stream (batch 16/32/48 x 160², seeded)
  gpt2m_generate        GPT-2 medium (350M) greedy generation: a step is one generate() of
                        4 prompts x 64 tokens, 32 new tokens

Every workload starts from the same seeds (torch.manual_seed, random.seed), runs W warm-up
steps and N timed steps (torch.cuda.synchronize() before and after each; the median is
reported, and beside it the median launch time: from the step's start until the Python code
returns, before the final synchronize, which tells a CPU-bound step from a GPU-bound one),
measures beside each step's wall time the launching thread's CPU time over the same span
(time.thread_time(); cpu_ms, median_cpu_ms), over the launch only (launch_cpu_ms) and the
whole process's (time.process_time(); proc_cpu_ms; run_one says what each includes),
records each step's loss (or the generated token ids), the peak reserved and allocated bytes
(torch.cuda.memory_stats() natively, allocd_torch.memory_stats() under allocd) and, under
allocd, one scrape of /metrics between two timed steps half way through.
After each workload: gc, empty_cache and reset_peak_memory_stats, so peaks are per workload.

With --sync blocking (the default) the CUDA context is made with CU_CTX_SCHED_BLOCKING_SYNC,
so a synchronize sleeps rather than spins and the CPU times are the work done, not time
spent waiting for the GPU (which a faster launch would turn into more spinning); --sync auto
leaves CUDA's default, which spins. The choice is recorded in the JSON ("sync").

The allocator's configuration comes from the environment (PYTORCH_CUDA_ALLOC_CONF for
native, ALLOCD_CONF for allocd) and is recorded in the JSON. One process per allocator:
it is chosen before CUDA is initialised.
"""

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 1234
# name: (warm-up steps, timed steps)
DEFAULT_STEPS = {
    "gpt2_train": (5, 30),
    "resnet50_train": (5, 30),
    "multistream_prefetch": (5, 40),
    "gpt2m_generate": (2, 20),
}
MIN_TIMED = 20


def default_anchor():
    for p in (os.path.join(REPO, ".devrun", "anchor", "workloads.py"),
              os.path.join(os.path.dirname(REPO), "shared", "anchor", "workloads.py")):
        if os.path.isfile(p):
            return p
    return os.path.join(os.path.dirname(REPO), "shared", "anchor", "workloads.py")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_anchor(path):
    if not os.path.isfile(path):
        raise SystemExit(f"anchor workloads file not found: {path} (give --anchor)")
    spec = importlib.util.spec_from_file_location("anchor_workloads", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "gpt2"):
        raise SystemExit(f"{path} has no gpt2() model builder")
    return mod


# --- the workloads: each returns (step function, kind); step(i) returns a 0-dim loss tensor
# --- (kind "loss") or a token-id tensor (kind "tokens").

def gpt2_train(torch, anchor):
    model = anchor.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        x = torch.randint(0, 50257, (8, 512), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, "loss"


def resnet50_train(torch, anchor):
    import torchvision
    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(i):
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, "loss"


def multistream_prefetch(torch, anchor):
    import torchvision
    model = torchvision.models.resnet18(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    rng = random.Random(17)

    def produce():
        bs = rng.choice([16, 32, 48])
        with torch.cuda.stream(side):
            x = torch.randn(bs, 3, 160, 160, device="cuda")
            y = torch.randint(0, 1000, (bs,), device="cuda")
        return x, y

    ahead = [produce()]

    def step(i):
        x, y = ahead.pop()
        main.wait_stream(side)
        x.record_stream(main)
        y.record_stream(main)
        ahead.append(produce())  # the side stream makes the next batch while this one trains
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y  # freed on the side stream's pool, in use on main: record_stream holds them
        return loss.detach()
    return step, "loss"


def gpt2m_generate(torch, anchor):
    model = anchor.gpt2(n_layer=24, n_embd=1024, n_head=16).eval()

    def step(i):
        x = torch.randint(0, 50257, (4, 64), device="cuda")
        with torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, min_new_tokens=32,
                                  do_sample=False, pad_token_id=0)
    return step, "tokens"


WORKLOADS = {f.__name__: f for f in (gpt2_train, resnet50_train, multistream_prefetch, gpt2m_generate)}


def scrape_mid_run(addr):
    from allocd_torch import _metrics
    try:
        text = _metrics.scrape(addr)
    except OSError as e:
        return {"error": f"scrape of http://{addr}/metrics failed: {e}"}
    return {"address": addr,
            "allocd_reserved_bytes": _metrics.total(text, "allocd_reserved_bytes", gpu="0"),
            "allocd_allocated_bytes": _metrics.total(text, "allocd_allocated_bytes", gpu="0"),
            "allocd_segments": _metrics.total(text, "allocd_segments", gpu="0")}


def run_one(torch, anchor, name, warmup, steps, api, metrics_addr):
    random.seed(SEED)
    torch.manual_seed(SEED)
    st0 = api["memory_stats"]()  # what earlier workloads left: live blocks and the memory they hold
    start = {"reserved": st0.get("reserved_bytes.all.current", 0), "allocated": st0.get("allocated_bytes.all.current", 0)}
    t0 = time.time()
    step, kind = WORKLOADS[name](torch, anchor)
    torch.cuda.synchronize()
    build_s = time.time() - t0
    values, tokens, ms, launch, cpu, launch_cpu, proc_cpu = [], [], [], [], [], [], []
    metrics = None
    mid = warmup + steps // 2
    allocs0, st_w = 0, {}
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        if i == warmup:
            st_w = api["memory_stats"]()
            allocs0 = st_w.get("allocation.all.allocated", 0)
        # CPU time beside the wall time, read at the same points. thread_time() is this (the
        # launching) thread's CPU time: the Python code, torch's dispatch, the allocator calls
        # made on this thread, and the final synchronize, which sleeps under --sync blocking
        # and spins under --sync auto (then a launch that ends sooner spins longer);
        # launch CPU time stops before it, where the launch wall time does. Not in it: the
        # autograd engine's CUDA device thread, which runs backward() (and its allocations)
        # while this thread blocks. process_time() (all threads of the process, the autograd
        # thread and allocd's own runtime threads included) is recorded beside it.
        c, pc = time.thread_time(), time.process_time()
        t = time.perf_counter()
        out = step(i)
        tl = time.perf_counter()
        cl = time.thread_time()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) * 1e3
        dc = (time.thread_time() - c) * 1e3
        dpc = (time.process_time() - pc) * 1e3
        if i >= warmup:
            ms.append(dt)
            launch.append((tl - t) * 1e3)
            cpu.append(dc)
            launch_cpu.append((cl - c) * 1e3)
            proc_cpu.append(dpc)
        if kind == "loss":
            values.append(out.item())
        else:
            ids = out.tolist()
            tokens.append(ids)
            values.append(hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16])
        del out
        if i == mid and metrics_addr:
            metrics = scrape_mid_run(metrics_addr)
    st = api["memory_stats"]()
    allocs_per_step = (st.get("allocation.all.allocated", 0) - allocs0) / steps
    wall = time.time() - t0
    res = {
        "kind": kind, "warmup": warmup, "steps": steps, "values": values,
        "step_ms": [round(x, 4) for x in ms], "median_ms": statistics.median(ms),
        "min_ms": min(ms), "launch_ms": [round(x, 4) for x in launch],
        "median_launch_ms": statistics.median(launch),
        "cpu_ms": [round(x, 4) for x in cpu], "median_cpu_ms": statistics.median(cpu),
        "launch_cpu_ms": [round(x, 4) for x in launch_cpu], "median_launch_cpu_ms": statistics.median(launch_cpu),
        "proc_cpu_ms": [round(x, 4) for x in proc_cpu], "median_proc_cpu_ms": statistics.median(proc_cpu),
        "allocs_per_step": allocs_per_step, "build_s": round(build_s, 2), "wall_s": round(wall, 2),
        "peak_reserved": st["reserved_bytes.all.peak"], "peak_allocated": st["allocated_bytes.all.peak"],
        "start_reserved": start["reserved"], "start_allocated": start["allocated"],
        "stats": {k: st.get(k) for k in ("reserved_bytes.all.current", "allocated_bytes.all.current",
                                         "num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms",
                                         "segment.all.peak", "num_bad_frees") if k in st},
        "metrics_mid_run": metrics,
        # What the allocator did a timed step, on average: the counters that grew over the
        # timed steps (device calls, retries, and allocd's reclaim and virtual memory calls).
        "per_step": {k: (st[k] - st_w.get(k, 0)) / steps for k in STEP_COUNTERS if k in st},
    }
    if tokens:
        res["tokens"] = tokens
    del step
    return res


# Counters whose growth over the timed steps run_one reports per step. torch has the first
# five; the rest are allocd's (expandable segments' reclaim and virtual memory calls).
STEP_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms", "num_sync_all_streams",
                 "num_reclaims", "num_pages_moved", "num_pages_moved_across_streams", "num_small_from_large",
                 "num_lends", "num_handles_created", "num_handles_released", "num_runs_revived",
                 "num_reclaim_waits", "vmm_total_ns", "vmm_sync_ns")


SCHED_FLAGS = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*


def set_sync_schedule(mode):
    """Sets how the primary context of device 0 waits in a synchronize (CU_CTX_SCHED_*).

    It must run before anything makes that context (torch's lazy init, allocd's first
    allocation): the driver keeps the flags for the primary context it makes later. Returns
    the driver's function to read them back, or raises naming what failed."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    for what, rc in (("cuInit", cuda.cuInit(0)), ("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), 0))):
        if rc:
            raise RuntimeError(f"{what} failed with CUresult {rc}")
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    rc = set_flags(dev, SCHED_FLAGS[mode])
    if rc:
        raise RuntimeError(f"cuDevicePrimaryCtxSetFlags({mode}) failed with CUresult {rc}")

    def read():
        flags, active = ctypes.c_uint(), ctypes.c_int()
        rc = cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
        return {"flags": flags.value, "active": bool(active.value)} if rc == 0 else {"error": rc}
    return read


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["native", "allocd"], required=True)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, from: " + ", ".join(WORKLOADS))
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--anchor", default=default_anchor(), help="the anchor workloads.py (model builders)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps for every workload (default: per workload)")
    ap.add_argument("--warmup", type=int, default=-1, help="warm-up steps for every workload (default: per workload)")
    ap.add_argument("--sync", choices=sorted(SCHED_FLAGS), default="blocking",
                    help="how a synchronize waits (CU_CTX_SCHED_*): blocking (default) sleeps, so CPU "
                         "times are work; auto is CUDA's default, which spins")
    ap.add_argument("--history", default="", help="record the allocator's history (no stack frames) over every "
                    "workload and write torch's snapshot there at the end (a .pickle, for allocd replay)")
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")

    t_start = time.time()
    read_sched = set_sync_schedule(args.sync)  # before allocd or torch makes the context
    metrics_addr = ""
    if args.allocator == "allocd":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import allocd_torch
        allocd_torch.enable(metrics_listen=os.environ.get("ALLOCD_METRICS_LISTEN") or "127.0.0.1:0")
        metrics_addr = allocd_torch.metrics_address()
        api = {"memory_stats": allocd_torch.memory_stats, "empty_cache": allocd_torch.empty_cache,
               "reset_peak": allocd_torch.reset_peak_memory_stats}
        log(f"allocd enabled (hooks={allocd_torch.hooks_installed()}, ALLOCD_CONF="
            f"{os.environ.get('ALLOCD_CONF', '')!r}, metrics at {metrics_addr!r})")
    import torch
    if args.allocator == "native":
        api = {"memory_stats": torch.cuda.memory_stats, "empty_cache": torch.cuda.empty_cache,
               "reset_peak": torch.cuda.reset_peak_memory_stats}
        log(f"native allocator (PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r})")
    anchor = load_anchor(args.anchor)
    result = {
        "allocator": args.allocator,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "allocd_conf": os.environ.get("ALLOCD_CONF", "") if args.allocator == "allocd" else "",
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0), "seed": SEED,
        "anchor": os.path.basename(args.anchor), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workloads": {},
    }
    torch.cuda.synchronize()  # the context exists now: its flags are the ones it was made with
    sched = read_sched()
    result["sync"] = {"mode": args.sync, "context": sched}
    if sched.get("flags", -1) & 7 != SCHED_FLAGS[args.sync]:
        raise SystemExit(f"the CUDA context's scheduling flags are {sched}, not {args.sync} "
                         f"({SCHED_FLAGS[args.sync]}): something made the context before this script set them")
    log(f"synchronize: {args.sync} (context flags {sched})")
    api["reset_peak"]()
    if args.history:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, context=None, stacks="python")
    for name in names:
        warmup, steps = DEFAULT_STEPS[name]
        steps = args.steps or steps
        warmup = warmup if args.warmup < 0 else args.warmup
        if steps < MIN_TIMED:
            log(f"WARNING: {name}: {steps} timed steps, fewer than the {MIN_TIMED} the comparison asks for")
        r = run_one(torch, anchor, name, warmup, steps, api, metrics_addr)
        result["workloads"][name] = r
        m = r["metrics_mid_run"] or {}
        log(f"{name}: median {r['median_ms']:.2f} ms over {steps} steps (+{warmup} warm-up), median CPU "
            f"{r['median_cpu_ms']:.2f} ms (launching thread; launch {r['median_launch_cpu_ms']:.2f} ms, process "
            f"{r['median_proc_cpu_ms']:.2f} ms), build {r['build_s']} s, "
            f"wall {r['wall_s']} s, {r['allocs_per_step']:.0f} allocations a step, at start reserved "
            f"{r['start_reserved'] / 2**20:.0f} MiB allocated {r['start_allocated'] / 2**20:.0f} MiB, peak reserved {r['peak_reserved'] / 2**20:.0f} MiB, peak allocated "
            f"{r['peak_allocated'] / 2**20:.0f} MiB, first/last {r['kind']} {r['values'][0]} / {r['values'][-1]}"
            + (f", /metrics mid-run reserved {m.get('allocd_reserved_bytes')} allocated "
               f"{m.get('allocd_allocated_bytes')}" if m else ""))
        gc.collect()
        torch.cuda.synchronize()
        api["empty_cache"]()
        api["reset_peak"]()
        with open(args.out, "w") as f:  # after every workload, so a timeout keeps what finished
            json.dump(result, f)
    if args.history:
        torch.cuda.memory._dump_snapshot(args.history)
        torch.cuda.memory._record_memory_history(enabled=None)
        log(f"wrote the allocator's history to {args.history}")
    result["wall_s"] = round(time.time() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(result, f)
    log(f"wrote {args.out} ({len(names)} workloads, {result['wall_s']} s)")


if __name__ == "__main__":
    main()
