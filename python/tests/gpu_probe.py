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
    """A CUDA graph capture under allocd: refused, naming allocd, before anything is captured.
    In a process of its own: torch's capture_begin registers the CUDA RNG with the graph before
    it asks the allocator for a pool, so after the refusal random ops of that process raise
    "Offset increment outside graph capture"."""
    import torch
    import allocd_torch
    allocd_torch.enable()
    g = torch.cuda.CUDAGraph()
    x = torch.ones(1024, device="cuda")
    try:
        with torch.cuda.graph(g):
            y = x * 2  # noqa: F841
    except RuntimeError as e:
        torch.cuda.synchronize()
        return {"raised": type(e).__name__, "message": str(e), "usable_after": torch.ones(8, device="cuda").sum().item()}
    return {"raised": None, "message": "", "usable_after": None}


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
