#!/usr/bin/env python3
"""CUDA graphs and private memory pools under PyTorch's allocator or allocd, stage by stage.

    python3 scripts/torch_graphs.py --allocator native|allocd --stage NAME[,NAME...] --out result.json
                                    [--anchor FILE] [--replays N] [--decode-replays N] [--tag TAG]

One process, one allocator (chosen before CUDA is initialised, as in torch_workloads.py).
The GPT-2 medium model (24 layers, 1024 wide, 16 heads, random init from a fixed seed, eval,
bf16) comes from the anchor workloads file's gpt2() builder, as torch_workloads.py's
gpt2m_generate builds it. Stages:

  capture_forward   a GPT-2 medium forward (batch 2 x 128 tokens) captured with torch.cuda.graph
                    after a warm-up on a side stream, replayed --replays times (default 100): the
                    SHA-256 of the replayed logits and of the eager ones, whether they are equal,
                    a second input through the same graph, and the memory before/after capture
                    (reserved, the stage's peak, the private pool's segments from the snapshot,
                    allocd's private_reserved_bytes where it has them)
  decode_replay     one decode step of GPT-2 medium at batch 1 (one new token over a 128-token
                    past) captured into a graph, then --decode-replays (default 300) timed replays,
                    each g.replay(); torch.cuda.synchronize() timed with perf_counter_ns (and with
                    CUDA events): median, p10, p90 us, and the logits' hash. --decode-impl hf uses
                    the HF model with a DynamicCache copied from a prefix (the cache is not updated
                    by the graph); manual is a hand-written step over the model's own blocks and
                    weights with a static past; auto (default) tries hf, then manual
  two_graphs_pool   graph g1 captures A = relu(x @ w1), graph g2 (pool=g1.pool()) captures
                    B = A @ w2 + 1 from g1's output; both replayed and checked against eager (also
                    after new contents in x); memory (memory_reserved, mem_get_info free) at the
                    start, before capture, after capture and after everything is released
  mempool           torch.cuda.MemPool + torch.cuda.use_mem_pool: tensors made inside must lie in
                    the segments the snapshot marks with the pool's id, tensors made outside must
                    not; a freed pool block is not handed out outside the pool; the memory comes
                    back when tensors and pool are gone
  compile_generate  generate() with cache_implementation="static", greedy, 4 prompts x 64 tokens,
                    32 new tokens, its one-token decode steps through torch.compile(model.forward,
                    mode="reduce-overhead", fullgraph=True) (the prefill eager, as generate()'s own
                    compilation does), run twice (the first compiles); if that path fails, a
                    compiled fixed-shape forward with a hand-written greedy loop. Records the path
                    taken, the token ids of the second run, and the time of each run
  compile_resnet    torchvision ResNet-50 (random init, seeded, eval, bf16, channels_last) under
                    torch.compile(mode="reduce-overhead"), 4 calls on a fixed 32x3x224x224 batch:
                    the output's hash, sums and first values, and its max abs difference from eager

Every stage starts after gc, empty_cache and reset_peak_memory_stats, runs in try/except (an
exception's text and traceback go into the JSON), and records the peak reserved bytes
(torch.cuda.memory_stats()["reserved_bytes.all.peak"]: under allocd torch's API answers from
allocd) and the reserved bytes at its end. The JSON is rewritten after every stage, so a
process stopped by a timeout keeps what finished. One summary line per stage on stdout.

--sync sets the CUDA context's scheduling flags before anything makes the context, as in
torch_workloads.py (default auto: CUDA's own choice, which spins here; the decode replay times
are wall times of a replay and its synchronize).
"""

import argparse
import copy
import gc
import hashlib
import json
import os
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_workloads import SCHED_FLAGS, load_anchor, set_sync_schedule  # noqa: E402 (stdlib-only at import)

SEED = 1234
STAGES = ["capture_forward", "decode_replay", "two_graphs_pool", "mempool", "compile_generate", "compile_resnet"]
NEEDS_GPT2M = {"capture_forward", "decode_replay", "compile_generate"}
MiB = 2 ** 20
TOL_RESERVED = 2 * MiB   # memory "came back": reserved at most this much above the start
TOL_FREE = 16 * MiB      # and mem_get_info's free at most this much below it

# GPT-2 medium as torch_workloads.py's gpt2m_generate builds it.
GPT2M = dict(n_layer=24, n_embd=1024, n_head=16)
VOCAB = 50257


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_anchor():
    return os.path.join(REPO, ".devrun", "anchor", "workloads.py")


class Ctx:
    """What the stages share: torch, the allocator's name, the side stream, the model."""

    def __init__(self, torch, args, allocd_torch):
        self.torch = torch
        self.args = args
        self.allocator = args.allocator
        self.allocd_torch = allocd_torch
        self.side = torch.cuda.Stream()
        self.anchor = None
        self._gpt2m = None

    def gpt2m(self):
        if self._gpt2m is None:
            torch = self.torch
            if self.anchor is None:
                self.anchor = load_anchor(self.args.anchor)
            torch.manual_seed(SEED)  # the weights: the same in every process, whatever ran before
            m = self.anchor.gpt2(**GPT2M).eval().to(torch.bfloat16)
            for p in m.parameters():
                p.requires_grad_(False)
            self._gpt2m = m
        return self._gpt2m

    def gen(self, offset):
        """A CPU generator for a stage's inputs: independent of what ran before in the process."""
        g = self.torch.Generator()
        g.manual_seed(SEED + offset)
        return g


# --- helpers ---------------------------------------------------------------------------------------

def digest(torch, t):
    """SHA-256 (hex) of a tensor's bytes, its dtype and shape."""
    t = t.detach().contiguous()
    b = t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(b)
    return h.hexdigest()


def summary(torch, t, first=16):
    """A tensor's hash, shape, sums and first values: enough to compare across processes."""
    f = t.detach().float()
    return {"sha256": digest(torch, t), "shape": list(t.shape), "dtype": str(t.dtype),
            "sum": float(f.double().sum().item()), "abs_sum": float(f.double().abs().sum().item()),
            "first": [float(x) for x in f.reshape(-1)[:first].tolist()]}


def max_diff(a, b):
    return float((a.detach().float() - b.detach().float()).abs().max().item())


def mem(ctx):
    """Memory figures: torch's statistics (allocd's under allocd), the driver's free bytes,
    allocd's private pool bytes where it reports them."""
    torch = ctx.torch
    st = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    d = {"reserved": st.get("reserved_bytes.all.current", 0), "allocated": st.get("allocated_bytes.all.current", 0),
         "peak_reserved": st.get("reserved_bytes.all.peak", 0), "peak_allocated": st.get("allocated_bytes.all.peak", 0),
         "free": free, "total": total}
    if ctx.allocd_torch is not None:
        a = ctx.allocd_torch.memory_stats()
        for k in ("private_reserved_bytes", "private_allocated_bytes"):
            if k in a:
                d[k] = a[k]
    return d


def pool_segments(ctx):
    """Bytes of the segments torch's snapshot marks with a private pool id, per pool id."""
    torch = ctx.torch
    try:
        snap = torch.cuda.memory._snapshot()
    except Exception as e:  # noqa: BLE001 (a figure beside the checks: recorded, not raised)
        return {"error": repr(e)}
    segs = snap.get("segments", [])
    out, missing = {}, 0
    for s in segs:
        if "segment_pool_id" not in s:
            missing += 1
            continue
        pid = tuple(s["segment_pool_id"] or (0, 0))
        if pid != (0, 0):
            out[str(pid)] = out.get(str(pid), 0) + s["total_size"]
    r = {"pools": out, "segments": len(segs)}
    if missing:
        r["segments_without_pool_id"] = missing
    return r


def mib(x):
    return "?" if x is None else f"{x / MiB:.0f}"


def warm_workspace(ctx):
    """A matmul of each dtype used on the side stream, so cuBLAS's per-stream workspace exists
    before a stage's baseline and before any capture (not made inside one)."""
    torch = ctx.torch

    def mm():
        for dt in (torch.float32, torch.bfloat16):
            a = torch.ones(64, 64, device="cuda", dtype=dt)
            (a @ a).sum()
    mm()  # the current stream's workspace too
    ctx.side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ctx.side):
        mm()
    torch.cuda.current_stream().wait_stream(ctx.side)
    torch.cuda.synchronize()


def side_warmup(ctx, fn, n=3):
    """The warm-up the torch.cuda.graph docs ask for: a few eager runs on the side stream."""
    torch = ctx.torch
    ctx.side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ctx.side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(ctx.side)
    torch.cuda.synchronize()


def pctl(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


# --- stages: each fills rec as it goes (so an exception keeps what was found before it) and
# --- returns a one-line summary.

def stage_capture_forward(ctx, rec):
    torch, args = ctx.torch, ctx.args
    model = ctx.gpt2m()
    B, L = 2, 128
    g_in = ctx.gen(1)
    ids = torch.randint(0, VOCAB, (B, L), generator=g_in).cuda()
    ids2 = torch.randint(0, VOCAB, (B, L), generator=g_in).cuda()
    static_ids = ids.clone()
    rec.update(batch=B, length=L, dtype="bfloat16", replays=args.replays)

    def fwd():
        return model(input_ids=static_ids, use_cache=False).logits

    with torch.no_grad():
        warm_workspace(ctx)
        eager = fwd().clone()
        side_warmup(ctx, fwd)
        rec["mem_before_capture"] = mem(ctx)
        rec["peak_before_reset"] = rec["mem_before_capture"]["peak_reserved"]  # run_stage keeps the stage's peak
        torch.cuda.reset_peak_memory_stats()  # from here: the capture's and the replays' peak
        g = torch.cuda.CUDAGraph()
        t = time.perf_counter()
        with torch.cuda.graph(g, stream=ctx.side):
            static_out = fwd()
        torch.cuda.synchronize()
        rec["capture_s"] = round(time.perf_counter() - t, 3)
        rec["mem_after_capture"] = mem(ctx)
        rec["pool_id"] = list(g.pool())
        rec["pool_segments_after_capture"] = pool_segments(ctx)
        t = time.perf_counter()
        for _ in range(args.replays):
            g.replay()
        torch.cuda.synchronize()
        rec["replays_s"] = round(time.perf_counter() - t, 4)
        rec["eager"] = summary(torch, eager)
        rec["replay"] = summary(torch, static_out)
        rec["replay_equals_eager"] = bool(torch.equal(static_out, eager))
        rec["replay_max_diff_eager"] = max_diff(static_out, eager)
        # A new input through the same graph: the graph reads the static buffer.
        static_ids.copy_(ids2)
        g.replay()
        torch.cuda.synchronize()
        replay2 = static_out.clone()
        eager2 = fwd()
        rec["replay2"] = summary(torch, replay2)
        rec["replay2_equals_eager"] = bool(torch.equal(replay2, eager2))
        rec["replay2_max_diff_eager"] = max_diff(replay2, eager2)
        rec["mem_after_replays"] = mem(ctx)
        rec["capture_peak_reserved"] = rec["mem_after_replays"]["peak_reserved"]
        del g, static_out, eager, eager2, replay2
    pr = rec["mem_after_capture"].get("private_reserved_bytes")
    return (f"replay==eager {rec['replay_equals_eager']} (2nd input {rec['replay2_equals_eager']}), replay sha "
            f"{rec['replay']['sha256'][:16]}, reserved before/after capture "
            f"{mib(rec['mem_before_capture']['reserved'])}/{mib(rec['mem_after_capture']['reserved'])} MiB, "
            f"capture+replays peak {mib(rec['capture_peak_reserved'])} MiB, pool segments "
            f"{rec['pool_segments_after_capture']['pools']}" + (f", allocd private_reserved {mib(pr)} MiB" if pr is not None else ""))


def decode_hf(ctx, rec, model, prefix, tok):
    """One decode step through the HF model: the past (a DynamicCache from the prefix) is copied
    before each eager call and before the capture, so the graph reads a fixed past; the cache
    object the graph wrote into is not used again."""
    torch = ctx.torch
    out = model(input_ids=prefix, use_cache=True)
    past = out.past_key_values
    rec["cache_type"] = type(past).__name__
    del out

    def fresh():
        return copy.deepcopy(past)

    def step(cache):
        return model(input_ids=tok, past_key_values=cache, use_cache=True).logits

    eager = step(fresh()).clone()
    side_warmup(ctx, lambda: step(fresh()))
    cap_cache = fresh()
    return step, cap_cache, eager, (past,)


def manual_forward(torch, model, ids, pos0, pasts):
    """GPT-2 through its own modules: wte/wpe, per block ln_1, attn.c_attn, SDPA, attn.c_proj,
    ln_2, mlp, then ln_f and lm_head. pasts: None (causal over ids) or a list of (k, v) per
    layer, each [B, H, P, D]. Returns the logits and the (k, v) of every layer."""
    F = torch.nn.functional
    tr = model.transformer
    cfg = model.config
    E, H = cfg.n_embd, cfg.n_head
    D = E // H
    B, T = ids.shape
    pos = torch.arange(pos0, pos0 + T, device=ids.device).unsqueeze(0)
    h = tr.wte(ids) + tr.wpe(pos)
    kvs = []
    for i, blk in enumerate(tr.h):
        a = blk.ln_1(h)
        q, k, v = blk.attn.c_attn(a).split(E, dim=2)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, H, D).transpose(1, 2)
        v = v.view(B, T, H, D).transpose(1, 2)
        if pasts is not None:
            k = torch.cat((pasts[i][0], k), dim=2)
            v = torch.cat((pasts[i][1], v), dim=2)
        kvs.append((k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=pasts is None and T > 1)
        o = o.transpose(1, 2).reshape(B, T, E)
        h = h + blk.attn.c_proj(o)
        h = h + blk.mlp(blk.ln_2(h))
    return model.lm_head(tr.ln_f(h)), kvs


def decode_manual(ctx, rec, model, prefix, tok):
    torch = ctx.torch
    P = prefix.shape[1]
    _, kvs = manual_forward(torch, model, prefix, 0, None)
    pasts = [(k.contiguous(), v.contiguous()) for k, v in kvs]
    del kvs

    def step(p):
        return manual_forward(torch, model, tok, P, p)[0]

    eager = step(pasts).clone()
    side_warmup(ctx, lambda: step(pasts))
    return step, pasts, eager, (pasts,)


def stage_decode_replay(ctx, rec):
    torch, args = ctx.torch, ctx.args
    model = ctx.gpt2m()
    P = 128
    g_in = ctx.gen(2)
    prefix = torch.randint(0, VOCAB, (1, P), generator=g_in).cuda()
    tok = torch.randint(0, VOCAB, (1, 1), generator=g_in).cuda()
    rec.update(batch=1, past_length=P, dtype="bfloat16", replays=args.decode_replays, warmup=args.decode_warmup)
    impls = ["hf", "manual"] if args.decode_impl == "auto" else [args.decode_impl]
    with torch.no_grad():
        warm_workspace(ctx)
        errors = {}
        for impl in impls:
            try:
                build = decode_hf if impl == "hf" else decode_manual
                step, cap_in, eager, keep = build(ctx, rec, model, prefix, tok)
                rec["mem_before_capture"] = mem(ctx)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=ctx.side):
                    static_out = step(cap_in)
                torch.cuda.synchronize()
                rec["impl"] = impl
                break
            except Exception as e:  # noqa: BLE001 (recorded; the next implementation is tried)
                errors[impl] = {"error": repr(e), "traceback": traceback.format_exc()}
                log(f"decode_replay: the {impl} step failed: {e!r}")
                try:
                    torch.cuda.synchronize()
                except Exception as e2:  # noqa: BLE001
                    errors[impl]["sync_error"] = repr(e2)
                g = static_out = None
                gc.collect()
        if errors:
            rec["impl_errors"] = errors
        if "impl" not in rec:
            raise RuntimeError(f"no decode step could be captured: {'; '.join(k + ': ' + v['error'] for k, v in errors.items())}")
        rec["mem_after_capture"] = mem(ctx)
        rec["pool_segments_after_capture"] = pool_segments(ctx)
        for _ in range(args.decode_warmup):
            g.replay()
        torch.cuda.synchronize()
        wall, gpu = [], []
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.decode_replays):
            t = time.perf_counter_ns()
            g.replay()
            torch.cuda.synchronize()
            wall.append((time.perf_counter_ns() - t) / 1e3)
        # GPU time of a replay, apart: events around it (their own cost stays out of the wall times).
        for _ in range(args.decode_replays):
            ev0.record()
            g.replay()
            ev1.record()
            ev1.synchronize()
            gpu.append(ev0.elapsed_time(ev1) * 1e3)
        rec["wall_us"] = [round(x, 2) for x in wall]
        rec["gpu_us"] = [round(x, 2) for x in gpu]
        rec["median_us"] = statistics.median(wall)
        rec["p10_us"], rec["p90_us"] = pctl(wall, 0.1), pctl(wall, 0.9)
        rec["median_gpu_us"] = statistics.median(gpu)
        rec["eager"] = summary(torch, eager)
        rec["replay"] = summary(torch, static_out)
        rec["replay_equals_eager"] = bool(torch.equal(static_out, eager))
        rec["replay_max_diff_eager"] = max_diff(static_out, eager)
        del g, static_out, eager, keep, cap_in
    return (f"{rec['impl']} step: median {rec['median_us']:.1f} us (p10 {rec['p10_us']:.1f}, p90 {rec['p90_us']:.1f}; "
            f"GPU {rec['median_gpu_us']:.1f}) over {len(rec['wall_us'])} replays, replay==eager "
            f"{rec['replay_equals_eager']}, sha {rec['replay']['sha256'][:16]}")


def stage_two_graphs_pool(ctx, rec):
    torch = ctx.torch
    N = 4096  # fp32: 64 MiB a tensor
    warm_workspace(ctx)
    gc.collect()
    torch.cuda.empty_cache()
    rec["mem_start"] = mem(ctx)
    g_in = ctx.gen(3)
    x = torch.randn(N, N, generator=g_in).cuda()
    w1 = (torch.randn(N, N, generator=g_in) / 64).cuda()
    w2 = (torch.randn(N, N, generator=g_in) / 64).cuda()
    x2 = torch.randn(N, N, generator=g_in).cuda()

    def op_a():
        return torch.relu(x @ w1)

    def op_b(a):
        return a @ w2 + 1.0

    with torch.no_grad():
        ea = op_a()
        eb = op_b(ea)
        side_warmup(ctx, lambda: op_b(op_a()))
        rec["mem_before_capture"] = mem(ctx)
        g1 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, stream=ctx.side):
            ya = op_a()
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=g1.pool(), stream=ctx.side):
            yb = op_b(ya)
        torch.cuda.synchronize()
        rec["pool_ids"] = [list(g1.pool()), list(g2.pool())]
        rec["same_pool"] = tuple(g1.pool()) == tuple(g2.pool())
        rec["mem_after_capture"] = mem(ctx)
        rec["pool_segments_after_capture"] = pool_segments(ctx)
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        rec["a_equals_eager"] = bool(torch.equal(ya, ea))
        rec["b_equals_eager"] = bool(torch.equal(yb, eb))
        rec["b_max_diff_eager"] = max_diff(yb, eb)
        x.copy_(x2)  # new contents: the graphs must follow them
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        ea2 = op_a()
        eb2 = op_b(ea2)
        rec["a2_equals_eager"] = bool(torch.equal(ya, ea2))
        rec["b2_equals_eager"] = bool(torch.equal(yb, eb2))
        rec["b2_max_diff_eager"] = max_diff(yb, eb2)
        rec["b"] = summary(torch, yb)
        rec["mem_after_replay"] = mem(ctx)
        del g1, g2, ya, yb, x, x2, w1, w2, ea, eb, ea2, eb2
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    rec["mem_after_release"] = after = mem(ctx)
    rec["pool_segments_after_release"] = pool_segments(ctx)
    start = rec["mem_start"]
    rec["reserved_back"] = after["reserved"] <= start["reserved"] + TOL_RESERVED
    rec["free_back"] = after["free"] >= start["free"] - TOL_FREE
    rec["memory_returned"] = rec["reserved_back"] and rec["free_back"]
    rec["results_correct"] = all(rec[k] for k in ("a_equals_eager", "b_equals_eager", "a2_equals_eager", "b2_equals_eager"))
    cap = rec["mem_after_capture"]
    return (f"results==eager {rec['results_correct']}, same pool {rec['same_pool']} {rec['pool_ids'][0]}, reserved "
            f"start/capture/released {mib(start['reserved'])}/{mib(cap['reserved'])}/{mib(after['reserved'])} MiB, free "
            f"start/capture/released {mib(start['free'])}/{mib(cap['free'])}/{mib(after['free'])} MiB, memory returned "
            f"{rec['memory_returned']}")


def in_segments(ptr, segs):
    return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in segs)


def stage_mempool(ctx, rec):
    torch = ctx.torch
    sizes = [1024, 1 * MiB, 3 * MiB + 512, 20 * MiB, 100 * MiB]
    rec["sizes"] = sizes
    gc.collect()
    torch.cuda.empty_cache()
    rec["mem_start"] = mem(ctx)
    pool = torch.cuda.MemPool()
    pid = tuple(pool.id)
    rec["pool_id"] = list(pid)
    with torch.cuda.use_mem_pool(pool):
        inside = [torch.full((n,), 7, dtype=torch.uint8, device="cuda") for n in sizes]
    outside = [torch.full((n,), 9, dtype=torch.uint8, device="cuda") for n in sizes]
    torch.cuda.synchronize()
    rec["mem_with_tensors"] = mem(ctx)
    snap = torch.cuda.memory._snapshot()
    segs = snap.get("segments", [])
    rec["segments_have_pool_id"] = all("segment_pool_id" in s for s in segs)
    pool_segs = [s for s in segs if tuple(s.get("segment_pool_id") or (0, 0)) == pid]
    rec["pool_segments"] = [{"address": s["address"], "total_size": s["total_size"], "segment_type": s.get("segment_type"),
                             "stream": s.get("stream")} for s in pool_segs]
    rec["pool_segment_bytes"] = sum(s["total_size"] for s in pool_segs)
    rec["inside_in_pool"] = [in_segments(t.data_ptr(), pool_segs) for t in inside]
    rec["outside_in_pool"] = [in_segments(t.data_ptr(), pool_segs) for t in outside]
    rec["values_ok"] = bool(all(int(t.min()) == 7 == int(t.max()) for t in inside)
                            and all(int(t.min()) == 9 == int(t.max()) for t in outside))
    if hasattr(pool, "snapshot"):
        try:
            ps = pool.snapshot()
            rec["pool_snapshot_segments"] = len(ps)
            rec["pool_snapshot_bytes"] = sum(s["total_size"] for s in ps)
        except Exception as e:  # noqa: BLE001
            rec["pool_snapshot_error"] = repr(e)
    if hasattr(pool, "use_count"):
        rec["pool_use_count"] = pool.use_count()
    # A block freed in the pool is the pool's: an allocation outside does not get it, one
    # inside may (the pool's cache).
    freed_ptr = inside[3].data_ptr()
    del inside[3]
    probe_out = torch.empty(sizes[3], dtype=torch.uint8, device="cuda")
    rec["freed_pool_block_given_outside"] = probe_out.data_ptr() == freed_ptr or in_segments(probe_out.data_ptr(), pool_segs)
    with torch.cuda.use_mem_pool(pool):
        probe_in = torch.empty(sizes[3], dtype=torch.uint8, device="cuda")
    rec["freed_pool_block_reused_inside"] = probe_in.data_ptr() == freed_ptr
    rec["probe_inside_in_pool"] = in_segments(probe_in.data_ptr(), pool_segs) or probe_in.data_ptr() == freed_ptr
    rec["routing_ok"] = (all(rec["inside_in_pool"]) and not any(rec["outside_in_pool"])
                         and not rec["freed_pool_block_given_outside"] and rec["values_ok"])
    del inside, outside, probe_out, probe_in, snap, segs, pool_segs
    gc.collect()
    torch.cuda.synchronize()
    rec["mem_tensors_freed_pool_alive"] = mem(ctx)
    del pool
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    rec["mem_after_release"] = after = mem(ctx)
    after_pools = pool_segments(ctx)
    rec["pool_segments_after_release"] = after_pools
    start = rec["mem_start"]
    rec["pool_gone_from_snapshot"] = str(pid) not in after_pools["pools"]
    rec["memory_returned"] = (after["reserved"] <= start["reserved"] + TOL_RESERVED
                              and after["free"] >= start["free"] - TOL_FREE)
    return (f"pool {list(pid)}: inside in pool {rec['inside_in_pool']}, outside in pool {rec['outside_in_pool']}, "
            f"freed pool block given outside {rec['freed_pool_block_given_outside']}, routing ok {rec['routing_ok']}, "
            f"pool segments {mib(rec['pool_segment_bytes'])} MiB, reserved start/with/released "
            f"{mib(start['reserved'])}/{mib(rec['mem_with_tensors']['reserved'])}/{mib(after['reserved'])} MiB, "
            f"memory returned {rec['memory_returned']}")


def generate_static(ctx, rec, model, x):
    """generate() with a static cache, greedy, twice, its decode steps through
    torch.compile(model.forward, mode="reduce-overhead", fullgraph=True). The prefill runs the
    eager forward: the static cache's tensors are made there, lazily, outside any CUDA graph
    (made inside the compiled prefill they are graph outputs that the next replay overwrites),
    as generate()'s own compilation does it."""
    torch = ctx.torch
    eager_forward = model.forward
    compiled = torch.compile(eager_forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
    calls = {"compiled": 0, "eager": 0}
    rec["forward_calls"] = calls

    def forward(*a, **kw):
        ids = kw.get("input_ids", a[0] if a else None)
        if ids is not None and ids.shape[-1] == 1:
            calls["compiled"] += 1
            torch.compiler.cudagraph_mark_step_begin()  # generate() copies what it keeps of the last step
            return compiled(*a, **kw)
        calls["eager"] += 1
        return eager_forward(*a, **kw)

    model.forward = forward
    gc_ = model.generation_config
    old_disable = getattr(gc_, "disable_compile", None)
    gc_.disable_compile = True  # the decode step is compiled here, not once more by generate()
    runs = []
    try:
        for i in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False, pad_token_id=0, cache_implementation="static")
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t, out.clone()))
            del out
    finally:
        del model.forward  # the class's forward again
        gc_.disable_compile = old_disable
    if calls["compiled"] == 0:
        raise RuntimeError(f"generate() never called the compiled decode step (forward calls {calls})")
    return runs


def generate_fixed(ctx, rec, model, x, compiled=True):
    """The fallback: a compiled forward over a fixed [B, prompt + new] buffer and a greedy loop
    (causal attention: the zeros after the current position change nothing before it)."""
    torch = ctx.torch
    B, P = x.shape
    N = 32

    def fwd(ids):
        return model(input_ids=ids, use_cache=False).logits

    f = torch.compile(fwd, mode="reduce-overhead", fullgraph=False, dynamic=False) if compiled else fwd
    runs = []
    for i in range(2 if compiled else 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        buf = torch.zeros(B, P + N, dtype=x.dtype, device=x.device)
        buf[:, :P] = x
        for j in range(N):
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            logits = f(buf)
            buf[:, P + j] = logits[:, P + j - 1].argmax(-1)
            del logits
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t, buf.clone()))
    return runs


def stage_compile_generate(ctx, rec):
    torch = ctx.torch
    model = ctx.gpt2m()
    g_in = ctx.gen(4)
    x = torch.randint(0, VOCAB, (4, 64), generator=g_in).cuda()
    rec.update(batch=4, prompt=64, new_tokens=32, dtype="bfloat16")
    with torch.no_grad():
        # Eager references (uncompiled): generate() with its default cache, and the fixed-shape loop.
        t = time.perf_counter()
        eager = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, min_new_tokens=32,
                               do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        rec["eager_s"] = round(time.perf_counter() - t, 3)
        rec["eager_tokens"] = eager.tolist()
        runs = None
        try:
            runs = generate_static(ctx, rec, model, x)
            rec["path"] = "generate_static_cache_compiled_decode"
        except Exception as e:  # noqa: BLE001
            rec["static_error"] = repr(e)
            rec["static_traceback"] = traceback.format_exc()
            log(f"compile_generate: generate() with a static cache failed ({e!r}); the fixed-shape loop instead")
            try:
                torch.compiler.reset()
            except Exception:  # noqa: BLE001
                pass
            gc.collect()
            rec["eager_fixed_tokens"] = generate_fixed(ctx, rec, model, x, compiled=False)[0][1].tolist()
            runs = generate_fixed(ctx, rec, model, x)
            rec["path"] = "compiled_forward_fixed_shape_loop"
        rec["run_s"] = [round(s, 3) for s, _ in runs]
        tokens = runs[-1][1]
        rec["tokens"] = tokens.tolist()
        rec["tokens_sha256"] = hashlib.sha256(json.dumps(rec["tokens"]).encode()).hexdigest()
        rec["runs_agree"] = bool(torch.equal(runs[0][1], runs[1][1]))
        ref = rec["eager_fixed_tokens"] if "eager_fixed_tokens" in rec else rec["eager_tokens"]
        rec["equals_eager"] = rec["tokens"] == ref
        rec["mem_after_runs"] = mem(ctx)
        rec["pool_segments_after_runs"] = pool_segments(ctx)
        del runs, tokens, eager
    try:
        torch.compiler.reset()  # drops the compiled code and its CUDA graph trees
    except Exception as e:  # noqa: BLE001
        rec["reset_error"] = repr(e)
    return (f"path {rec['path']}, runs {rec['run_s']} s (eager {rec['eager_s']} s), tokens sha "
            f"{rec['tokens_sha256'][:16]}, both runs agree {rec['runs_agree']}, equal to eager {rec['equals_eager']}")


def stage_compile_resnet(ctx, rec):
    torch = ctx.torch
    import torchvision
    torch.manual_seed(SEED)
    m = torchvision.models.resnet50(weights=None).eval().to(device="cuda", dtype=torch.bfloat16,
                                                              memory_format=torch.channels_last)
    g_in = ctx.gen(5)
    x = torch.randn(32, 3, 224, 224, generator=g_in).to(device="cuda", dtype=torch.bfloat16,
                                                          memory_format=torch.channels_last)
    rec.update(batch=32, image=224, dtype="bfloat16", calls=4)
    with torch.no_grad():
        eager = m(x).clone()
        cm = torch.compile(m, mode="reduce-overhead")
        times, outs = [], []
        for i in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            torch.cuda.synchronize()
            t = time.perf_counter()
            y = cm(x)
            torch.cuda.synchronize()
            times.append(round(time.perf_counter() - t, 4))
            outs.append(y.clone())
            del y
        rec["call_s"] = times
        out = outs[-1]
        rec["out"] = summary(torch, out)
        rec["out"]["row_sums"] = [float(v) for v in out.float().sum(dim=1).tolist()]
        rec["out"]["first256"] = [float(v) for v in out.float().reshape(-1)[:256].tolist()]
        rec["eager"] = summary(torch, eager)
        rec["calls_agree"] = all(bool(torch.equal(o, out)) for o in outs[1:])
        rec["max_diff_eager"] = max_diff(out, eager)
        rec["max_abs_eager"] = float(eager.float().abs().max().item())
        rec["mem_after_calls"] = mem(ctx)
        rec["pool_segments_after_calls"] = pool_segments(ctx)
        del outs, out, eager, cm
    try:
        torch.compiler.reset()
    except Exception as e:  # noqa: BLE001
        rec["reset_error"] = repr(e)
    del m
    return (f"calls {rec['call_s']} s, out sha {rec['out']['sha256'][:16]} sum {rec['out']['sum']:.4f}, calls agree "
            f"{rec['calls_agree']}, max |compiled - eager| {rec['max_diff_eager']:.4g} (max |eager| {rec['max_abs_eager']:.4g})")


STAGE_FNS = {"capture_forward": stage_capture_forward, "decode_replay": stage_decode_replay,
             "two_graphs_pool": stage_two_graphs_pool, "mempool": stage_mempool,
             "compile_generate": stage_compile_generate, "compile_resnet": stage_compile_resnet}


def run_stage(ctx, name, result, out_path):
    torch = ctx.torch
    rec = {"ok": False}
    result["stages"][name] = rec
    t0 = time.time()
    try:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rec["mem_stage_start"] = mem(ctx)
        rec["summary"] = STAGE_FNS[name](ctx, rec)
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 (recorded; the next stage runs)
        rec["error"] = repr(e)
        rec["traceback"] = traceback.format_exc()
        rec["summary"] = f"ERROR {e!r}"
    rec["wall_s"] = round(time.time() - t0, 2)
    try:
        gc.collect()
        torch.cuda.synchronize()
        # The stage's peak (a stage that resets the peaks on the way says what it was before).
        rec["peak_reserved"] = max(torch.cuda.memory_stats().get("reserved_bytes.all.peak", 0),
                                   rec.get("peak_before_reset", 0))
        rec["mem_stage_end"] = mem(ctx)
        rec["reserved_end"] = rec["mem_stage_end"]["reserved"]
    except Exception as e:  # noqa: BLE001
        rec["end_error"] = repr(e)
    log(f"{name}: {'ok' if rec['ok'] else 'FAILED'} in {rec['wall_s']} s, peak reserved {mib(rec.get('peak_reserved'))} "
        f"MiB, reserved at end {mib(rec.get('reserved_end'))} MiB: {rec['summary']}")
    if not rec["ok"]:
        print(rec["traceback"], file=sys.stderr, flush=True)
    write(result, out_path)


def write(result, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def setup(args, names, result):
    """The allocator, torch, the context's scheduling flags, the shared model. Returns the Ctx."""
    read_sched = set_sync_schedule(args.sync)  # before allocd or torch makes the context
    allocd_torch = None
    if args.allocator == "allocd":
        sys.path.insert(0, os.path.join(REPO, "python"))
        import allocd_torch
        allocd_torch.enable(metrics_listen="")
        log(f"allocd enabled (hooks={allocd_torch.hooks_installed()}, ALLOCD_CONF={os.environ.get('ALLOCD_CONF', '')!r})")
    import torch
    if args.allocator == "native":
        log(f"native allocator (PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r})")
    torch.backends.cudnn.benchmark = False
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("transformers", "torchvision"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            versions[mod] = f"unavailable: {e!r}"
    result["versions"] = versions
    result["hooks_installed"] = allocd_torch.hooks_installed() if allocd_torch else None
    result["device"] = torch.cuda.get_device_name(0)
    torch.cuda.synchronize()
    sched = read_sched()
    result["sync"] = {"mode": args.sync, "context": sched}
    if sched.get("flags", -1) & 7 != SCHED_FLAGS[args.sync]:
        raise SystemExit(f"the CUDA context's scheduling flags are {sched}, not {args.sync}: something made the "
                         "context before this script set them")
    log(f"torch {versions['torch']} transformers {versions['transformers']} torchvision {versions['torchvision']}, "
        f"{result['device']}, synchronize {args.sync}, stages {','.join(names)}")
    ctx = Ctx(torch, args, allocd_torch)
    if NEEDS_GPT2M & set(names):
        t = time.time()
        try:
            ctx.gpt2m()  # built once, before the stages, so no stage's peak holds its build
            torch.cuda.synchronize()
            result["model_build_s"] = round(time.time() - t, 2)
            log(f"GPT-2 medium built in {result['model_build_s']} s")
        except Exception as e:  # noqa: BLE001 (the stages that need it record the error again)
            result["model_build_error"] = repr(e)
            log(f"GPT-2 medium build FAILED: {e!r}")
    write(result, args.out)
    return ctx


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allocator", choices=["native", "allocd"], required=True)
    ap.add_argument("--stage", required=True, help="comma-separated, from: " + ", ".join(STAGES))
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--anchor", default=default_anchor(), help="the anchor workloads.py (its gpt2() builder)")
    ap.add_argument("--replays", type=int, default=100, help="capture_forward's replays")
    ap.add_argument("--decode-replays", type=int, default=300, help="decode_replay's timed replays (at least 200)")
    ap.add_argument("--decode-warmup", type=int, default=20, help="decode_replay's untimed replays first")
    ap.add_argument("--decode-impl", choices=["auto", "hf", "manual"], default="auto")
    ap.add_argument("--tag", default="", help="recorded in the JSON (e.g. the ABBA pair of a decode process)")
    ap.add_argument("--sync", choices=sorted(SCHED_FLAGS), default="auto",
                    help="how a synchronize waits (CU_CTX_SCHED_*; default auto: CUDA's choice)")
    args = ap.parse_args()
    names = [s for s in args.stage.split(",") if s]
    unknown = [s for s in names if s not in STAGE_FNS]
    if unknown or not names:
        raise SystemExit(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    # torch.compile's caches: the caller's, else beside the output (before torch is imported).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(out_dir, "inductor_cache"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton"))

    t_start = time.time()
    # Written before anything can fail, so that a process that cannot even start its stages
    # (allocd_torch.enable() refusing, say) leaves its reason for compare_graphs.py.
    result = {
        "tool": "torch_graphs", "allocator": args.allocator, "tag": args.tag, "stages_requested": names,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "allocd_conf": os.environ.get("ALLOCD_CONF", "") if args.allocator == "allocd" else "",
        "seed": SEED, "anchor": os.path.basename(args.anchor), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "anchor")},
        "stages": {},
    }
    write(result, args.out)
    try:
        ctx = setup(args, names, result)
    except BaseException as e:  # SystemExit too: the scheduling check
        result["setup_error"] = repr(e)
        result["setup_traceback"] = traceback.format_exc()
        write(result, args.out)
        log(f"setup FAILED, no stage ran: {e!r}")
        print(result["setup_traceback"], file=sys.stderr, flush=True)
        return 1
    for name in names:
        run_stage(ctx, name, result, args.out)
    result["wall_s"] = round(time.time() - t_start, 1)
    write(result, args.out)
    failed = [n for n in names if not result["stages"][n]["ok"]]
    log(f"wrote {args.out} ({len(names)} stages, {len(failed)} failed{': ' + ','.join(failed) if failed else ''}, "
        f"{result['wall_s']} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
