"""Subprocess probes for test_gpu.py: each runs in a fresh process (the allocator is chosen
before CUDA init) and prints one JSON line. Usage: python3 gpu_probe.py record_stream CYCLES | too_late | cuda_graph
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def record_stream(cycles):
    """x made on stream A, used on a busy stream B, x.record_stream(B), del x, then at once
    an allocation of the same size on A: does it get x's memory while B still runs?"""
    import torch
    import allocd_torch
    allocd_torch.enable()
    n = (37 << 20) + 3 * 512  # a size nothing else in this process uses
    a = torch.cuda.current_stream()
    b = torch.cuda.Stream()
    # Launch both kernels once first: the first launch of a kernel loads its
    # module (CUDA lazy loading), which synchronises the context and would end
    # B's sleep before the check.
    warm = torch.ones(1024, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(b):
        torch.cuda._sleep(1000)
        warm.add_(1)
    torch.cuda.synchronize()
    del warm
    x = torch.ones(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    b.wait_stream(a)
    with torch.cuda.stream(b):
        torch.cuda._sleep(cycles)
        x.add_(1)
    x.record_stream(b)
    ptr = x.data_ptr()
    del x
    busy_at_alloc = not b.query()
    z = torch.empty(n, dtype=torch.uint8, device="cuda")
    reused_while_busy = z.data_ptr() == ptr
    still_busy = not b.query()
    b.synchronize()
    w = torch.empty(n, dtype=torch.uint8, device="cuda")  # polls B's event: x's block is free now
    reused_after_sync = w.data_ptr() == ptr
    return {"hooks": allocd_torch.hooks_installed(), "busy_at_alloc": busy_at_alloc, "still_busy": still_busy,
            "reused_while_busy": reused_while_busy, "reused_after_sync": reused_after_sync,
            "skip_hook_env": os.environ.get("ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK", "")}


def too_late():
    """enable() after CUDA is initialised must raise RuntimeError saying so."""
    import torch
    torch.zeros(1, device="cuda")
    import allocd_torch
    try:
        allocd_torch.enable()
    except RuntimeError as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "message": ""}


def cuda_graph():
    """A CUDA graph captured under allocd and replayed with new inputs: its output equals eager's,
    lies in a segment that the snapshot marks with the graph's pool, and the process's CUDA
    (random ops included) works after. In a process of its own, so that a failed capture leaves
    the test process's CUDA state alone."""
    import torch
    import allocd_torch
    allocd_torch.enable()
    torch.manual_seed(0)
    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda")
    s = torch.cuda.Stream()
    # Warm up on the capture stream first, as torch's docs ask (cuBLAS's workspace for that
    # stream is made outside the capture).
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.tanh(x @ w) * 2
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s):
            y = torch.tanh(x @ w) * 2
    except RuntimeError as e:
        return {"raised": type(e).__name__, "message": str(e)}
    diffs = []
    for _ in range(3):
        new = torch.randn(512, 512, device="cuda")
        x.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        diffs.append((y - torch.tanh(new @ w) * 2).abs().max().item())
    pid = tuple(g.pool())
    segs = [sg for sg in torch.cuda.memory._snapshot()["segments"] if tuple(sg.get("segment_pool_id", (0, 0))) == pid]
    out_in_pool = any(sg["address"] <= y.data_ptr() < sg["address"] + sg["total_size"] for sg in segs)
    private = allocd_torch.memory_stats()["private_reserved_bytes"]
    return {"raised": None, "message": "", "max_diff": max(diffs), "pool": list(pid), "pool_segments": len(segs),
            "output_in_pool": out_in_pool, "private_reserved": private,
            "usable_after": torch.ones(8, device="cuda").sum().item(),
            "randn_after": list(torch.randn(4, device="cuda").shape)}


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "record_stream":
        out = record_stream(int(sys.argv[2]))
    elif what == "too_late":
        out = too_late()
    elif what == "cuda_graph":
        out = cuda_graph()
    else:
        raise SystemExit(f"unknown probe {what!r}")
    print("PROBE " + json.dumps(out), flush=True)
