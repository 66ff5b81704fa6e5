"""allocd_torch on a real GPU (unittest). Skipped without torch and CUDA.

    ALLOCD_LIB=/path/to/liballocd.so python3 -m unittest -v python/tests/test_gpu.py

allocd_torch.enable() runs once for the whole module, before CUDA is initialised, with the
metrics server on a free port. The record_stream, too-late and CUDA graph capture checks run
in subprocesses (gpu_probe.py), since the allocator is chosen once per process (and a failed
capture would leave the process's CUDA state broken). Each test prints one line,
"GPU <test>: <what it measured>".
"""

import collections
import functools
import gc
import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()  # does not initialise CUDA
except ImportError:
    torch = None
    HAVE_CUDA = False

from test_loader import TORCH_KEYS  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def report(test, text):
    print(f"\nGPU {test}: {text}", flush=True)


def setUpModule():
    if not HAVE_CUDA:
        raise unittest.SkipTest("needs torch with CUDA")
    import allocd_torch
    t0 = time.time()
    allocd_torch.enable(metrics_listen="127.0.0.1:0")
    report("enable", f"{time.time() - t0:.2f} s (C++ allocator build or cache load), "
           f"installed={allocd_torch.hooks_installed()}, "
           f"metrics at {allocd_torch.metrics_address()!r}, torch {torch.__version__}")


def probe(*args, env=None, timeout=180):
    e = dict(os.environ)
    e.update(env or {})
    r = subprocess.run([sys.executable, os.path.join(HERE, "gpu_probe.py"), *args], env=e,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    out = r.stdout.decode("utf-8", "replace")
    lines = [ln for ln in out.splitlines() if ln.startswith("PROBE ")]
    if r.returncode != 0 or not lines:
        raise AssertionError(f"probe {args} failed (exit {r.returncode}):\n{out[-4000:]}")
    return json.loads(lines[-1][len("PROBE "):])


def _drop_inherited(holder, worker_id):
    # In the forked DataLoader worker: free a CUDA tensor inherited from the parent. allocd's
    # free hook must do nothing here (the Go runtime does not survive fork), and not hang.
    holder.pop("t", None)
    gc.collect()


class AllocdGPUTest(unittest.TestCase):
    def setUp(self):
        gc.collect()
        torch.cuda.synchronize()

    def test_record_stream_is_honoured_and_fails_without_the_hook(self):
        cycles = 1_000_000_000  # about half a second of torch.cuda._sleep on an H200
        on = probe("record_stream", str(cycles))
        off = probe("record_stream", str(cycles), env={"ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK": "1"})
        report("record_stream", f"with hook: reused while consumer busy={on['reused_while_busy']} "
               f"(busy={on['busy_at_alloc']}/{on['still_busy']}), reused after sync={on['reused_after_sync']}; "
               f"without hook: reused while busy={off['reused_while_busy']} (busy={off['busy_at_alloc']})")
        for r in (on, off):
            self.assertTrue(r["hooks"])
            self.assertTrue(r["busy_at_alloc"] and r["still_busy"],
                            f"the consumer stream finished before the check, the test proves nothing: {r}")
        self.assertFalse(on["reused_while_busy"], "memory reused while the consumer stream still used it")
        self.assertTrue(on["reused_after_sync"], "the block was not reusable after the consumer's work ended")
        self.assertTrue(off["reused_while_busy"], "without the hook the test must observe the reuse")

    def test_enable_too_late(self):
        r = probe("too_late")
        report("too_late", f"{r['raised']}: {r['message'][:100]}...")
        self.assertEqual(r["raised"], "RuntimeError")
        self.assertIn("must run before CUDA is initialised", r["message"])

    def test_empty_cache_returns_memory(self):
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        ts = [torch.empty(GiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
        torch.cuda.synchronize()
        free1 = torch.cuda.mem_get_info()[0]
        del ts
        torch.cuda.synchronize()
        free2 = torch.cuda.mem_get_info()[0]
        reserved2 = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        free3 = torch.cuda.mem_get_info()[0]
        report("empty_cache", f"device free MiB: before {free0 // MiB}, 4 GiB live {free1 // MiB}, "
               f"freed (cached) {free2 // MiB}, after empty_cache {free3 // MiB} "
               f"(difference to before {(free0 - free3) / MiB:+.1f} MiB); reserved before/after empty_cache "
               f"{reserved2 // MiB}/{torch.cuda.memory_reserved() // MiB} MiB")
        self.assertGreaterEqual(free0 - free1, 4 * GiB)
        self.assertGreaterEqual(free0 - free2, 4 * GiB, "freed tensors should stay cached until empty_cache")
        self.assertLessEqual(abs(free0 - free3), 8 * MiB)
        self.assertLessEqual(torch.cuda.memory_reserved(), reserved2 - 4 * GiB)

    def test_oom_then_training_continues(self):
        n_ooms = torch.cuda.memory_stats()["num_ooms"]
        with self.assertRaises(torch.OutOfMemoryError) as cm:
            torch.empty(10 << 40, dtype=torch.uint8, device="cuda")
        msg = str(cm.exception)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(128, 256, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
        losses = []
        for _ in range(10):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        report("oom", f"{type(cm.exception).__name__}: {msg.splitlines()[0][:160]}; hint present="
               f"{'expandable_segments' in msg}; 10 training steps after it, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        self.assertIn("out of memory", msg.lower())
        self.assertIn("tried to allocate", msg.lower())
        self.assertIn("allocd", msg)
        self.assertTrue(all(math.isfinite(v) for v in losses))
        self.assertLess(losses[-1], losses[0])
        self.assertEqual(torch.cuda.memory_stats()["num_ooms"], n_ooms + 1,
                         "num_ooms must count the failed request, as PyTorch's does")

    def test_one_libcudart(self):
        torch.ones(1 << 20, device="cuda").sum().item()
        with open("/proc/self/maps") as f:
            maps = [ln.split()[-1] for ln in f if len(ln.split()) >= 6]
        cudart = sorted({os.path.realpath(p) for p in maps if "libcudart" in os.path.basename(p)})
        ours = sorted({p for p in maps if "liballocd" in os.path.basename(p)})
        report("libcudart", f"{len(cudart)} libcudart mapped: {cudart}; liballocd: {ours}")
        self.assertEqual(len(cudart), 1, cudart)
        self.assertEqual(len(ours), 1, ours)

    def test_memory_stats_sane(self):
        x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(1000, device="cuda")
        s = torch.cuda.memory_stats()
        import allocd_torch
        self.assertIsInstance(s, collections.OrderedDict)
        self.assertEqual(list(s), sorted(s))
        self.assertEqual([k for k in TORCH_KEYS if k not in s], [])
        a, r = s["allocated_bytes.all.current"], s["reserved_bytes.all.current"]
        self.assertGreaterEqual(a, 64 * MiB + 4000)
        self.assertGreaterEqual(r, a)
        for k, v in s.items():
            if k.endswith(".peak"):
                self.assertGreaterEqual(v, s[k[:-len("peak")] + "current"], k)
        self.assertEqual(torch.cuda.memory_allocated(), a)
        self.assertEqual(torch.cuda.memory.memory_allocated(0), allocd_torch.memory_allocated(0))
        self.assertEqual(torch.cuda.memory_reserved(), r)
        self.assertGreaterEqual(torch.cuda.max_memory_reserved(), r)
        torch.cuda.reset_peak_memory_stats()
        self.assertEqual(torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated())
        self.assertEqual(torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"], a)
        summary = torch.cuda.memory_summary()
        self.assertIn("Allocated memory", summary)
        report("memory_stats", f"{len(s)} keys; allocated {a // MiB} MiB, reserved {r // MiB} MiB, "
               f"segments {s['segment.all.current']}, device mallocs {s['num_device_alloc']}")
        del x, y

    def test_snapshot_segsum(self):
        from torch.cuda import _memory_viz
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snap.pickle")
            import allocd_torch
            allocd_torch.dump_snapshot(path)
            with open(path, "rb") as f:
                snap = pickle.load(f)
        text = _memory_viz.segsum(snap)
        report("snapshot", f"{len(snap['segments'])} segments; segsum: {text.splitlines()[0][:100]!r}")
        self.assertTrue(snap["segments"])
        self.assertTrue(any(b["state"] == "active_allocated" for s in snap["segments"] for b in s["blocks"]))
        self.assertIsInstance(text, str)
        del x

    def test_snapshot_history_trace_plot(self):
        from torch.cuda import _memory_viz
        import allocd_torch
        allocd_torch.record_memory_history(True, max_entries=10000)
        try:
            for i in range(5):
                t = torch.empty((i + 1) * MiB, dtype=torch.uint8, device="cuda")
                del t
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "snap.pickle")
                allocd_torch.dump_snapshot(path)
                with open(path, "rb") as f:
                    snap = pickle.load(f)
        finally:
            allocd_torch.record_memory_history(False)
        traces = [e for tr in snap["device_traces"] for e in tr]
        html = _memory_viz.trace_plot(snap)
        report("snapshot_history", f"{len(traces)} trace entries, actions {sorted({e['action'] for e in traces})}; "
               f"trace_plot html {len(html)} chars")
        self.assertTrue(any(e["action"] == "alloc" for e in traces))
        self.assertIn("<html", html.lower())

    def test_torch_apis_are_torchs_own(self):
        """torch's memory APIs are torch's own functions, answered by allocd's CUDAAllocator."""
        import allocd_torch
        self.assertEqual(torch.cuda.memory_stats.__module__, "torch.cuda.memory")
        self.assertIsNot(torch.cuda.memory_stats, allocd_torch.memory_stats)
        backend = torch._C._cuda_getAllocatorBackend()
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        own = allocd_torch.memory_stats()
        s = torch.cuda.memory_stats()
        same = [k for k in TORCH_KEYS if k in s and s[k] == own[k]]
        torch.cuda.reset_accumulated_memory_stats()
        after = torch.cuda.memory_stats()
        y = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        again = torch.cuda.memory_stats()
        p = torch.cuda.caching_allocator_alloc(5 * MiB)
        with_raw = torch.cuda.memory_allocated()
        torch.cuda.caching_allocator_delete(p)
        torch.cuda.set_per_process_memory_fraction(0.5)
        frac = torch.cuda.get_per_process_memory_fraction() if hasattr(torch.cuda, "get_per_process_memory_fraction") \
            else None
        torch.cuda.set_per_process_memory_fraction(1.0)
        report("torch_apis", f"backend {backend!r}; {len(same)} of {len(TORCH_KEYS)} keys equal to allocd's own view; "
               f"after reset_accumulated: allocation.all.allocated {after['allocation.all.allocated']} "
               f"(current {after['allocation.all.current']}), one more malloc -> {again['allocation.all.allocated']}; "
               f"caching_allocator_alloc 5 MiB seen in memory_allocated={with_raw}; fraction read back {frac}")
        self.assertEqual(len(same), len(TORCH_KEYS), sorted(set(TORCH_KEYS) - set(same)))
        self.assertEqual(after["allocation.all.allocated"], 0)
        self.assertEqual(after["num_device_alloc"], 0)
        self.assertGreaterEqual(after["allocation.all.current"], 1)
        self.assertEqual(again["allocation.all.allocated"], 1)
        self.assertGreaterEqual(with_raw, 5 * MiB)
        if frac is not None:
            self.assertEqual(frac, 0.5)
        del x, y

    def test_torch_snapshot_with_python_frames(self):
        """torch.cuda.memory._record_memory_history(stacks="python") and _snapshot() under allocd:
        blocks and trace entries carry Python frames, and torch's viewer reads the snapshot."""
        from torch.cuda import _memory_viz
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=100000)
        try:
            keep = [torch.empty((i + 1) * MiB, dtype=torch.uint8, device="cuda") for i in range(4)]
            t = torch.empty(7 * MiB, dtype=torch.uint8, device="cuda")
            del t
            snap = torch.cuda.memory._snapshot()
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "snap.pickle")
                torch.cuda.memory._dump_snapshot(path)
                with open(path, "rb") as f:
                    dumped = pickle.load(f)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        here = os.path.basename(__file__)
        live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        framed = [b for b in live if any(f["filename"].endswith(here) for f in b.get("frames", []))]
        traces = [e for tr in snap["device_traces"] for e in tr]
        actions = collections.Counter(e["action"] for e in traces)
        alloc_framed = [e for e in traces if e["action"] == "alloc"
                        and any(f["filename"].endswith(here) for f in e.get("frames", []))]
        html = _memory_viz.trace_plot(dumped)
        segsum = _memory_viz.segsum(dumped)
        report("torch_snapshot", f"{len(snap['segments'])} segments, {len(live)} live blocks, {len(framed)} with "
               f"frames in {here}; trace actions {dict(actions)}, {len(alloc_framed)} allocs with Python frames; "
               f"trace_plot {len(html)} chars, segsum {len(segsum)} chars; a frame: "
               f"{framed[0]['frames'][0] if framed else None}")
        self.assertGreaterEqual(len(framed), 4)
        self.assertGreaterEqual(len(alloc_framed), 5)
        self.assertGreaterEqual(actions["free_requested"], 1)
        self.assertIn("<html", html.lower())
        del keep

    def test_cuda_graph_capture_and_replay(self):
        r = probe("cuda_graph")
        if r["raised"]:
            self.fail(f"the capture raised {r['raised']}: {r['message']}")
        report("cuda_graph", f"captured and replayed 3 times, max |graph - eager| = {r['max_diff']:.2e}; pool "
               f"{r['pool']}: {r['pool_segments']} segments, output in the pool {r['output_in_pool']}, allocd "
               f"private_reserved {r['private_reserved'] / MiB:.1f} MiB; CUDA and randn usable after")
        self.assertLess(r["max_diff"], 1e-4)
        self.assertTrue(r["output_in_pool"])
        self.assertGreater(r["private_reserved"], 0)
        self.assertEqual(r["usable_after"], 8)
        self.assertEqual(r["randn_after"], [4])

    def test_two_graphs_share_a_pool_and_return_memory(self):
        import allocd_torch
        x = torch.randn(2048, 2048, device="cuda")
        w = torch.randn(2048, 2048, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on the capture stream
            torch.sigmoid(torch.relu(x @ w) @ w)
        torch.sigmoid(torch.relu(x @ w) @ w)  # and on this one (cuBLAS keeps a workspace per stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, stream=s):
            a = torch.relu(x @ w)
        with torch.cuda.graph(g2, pool=g1.pool(), stream=s):
            b = torch.sigmoid(a @ w)
        x.copy_(torch.randn(2048, 2048, device="cuda"))
        g1.replay()
        g2.replay()
        torch.cuda.synchronize()
        err = (b - torch.sigmoid(torch.relu(x @ w) @ w)).abs().max().item()
        same = tuple(g1.pool()) == tuple(g2.pool())
        private = allocd_torch.memory_stats()["private_reserved_bytes"]
        torch.cuda.empty_cache()  # the graphs' pool is held: it stays
        held = allocd_torch.memory_stats()["private_reserved_bytes"]
        reserved1 = torch.cuda.memory_reserved()
        free1 = torch.cuda.mem_get_info()[0]
        del g1, g2, a, b
        gc.collect()
        torch.cuda.empty_cache()
        after = allocd_torch.memory_stats()["private_reserved_bytes"]
        reserved2 = torch.cuda.memory_reserved()
        free2 = torch.cuda.mem_get_info()[0]
        report("two_graphs_pool", f"same pool {same}, max |graph - eager| = {err:.2e}; private reserved "
               f"{private / MiB:.0f} MiB, after empty_cache {held / MiB:.0f} MiB, after del+gc+empty_cache "
               f"{after / MiB:.0f} MiB; reserved {reserved0 // MiB} -> {reserved1 // MiB} -> {reserved2 // MiB} MiB; "
               f"device free rose {(free2 - free1) / MiB:.0f} MiB")
        self.assertTrue(same)
        self.assertLess(err, 1e-3)
        self.assertGreaterEqual(private, 2 * 16 * MiB)  # a and b, 16 MiB each
        self.assertEqual(held, private)
        self.assertEqual(after, 0)
        self.assertLessEqual(reserved2, reserved0)
        self.assertGreaterEqual(free2 - free1, private - 4 * MiB)
        del x, w

    def test_mempool_routes_allocations(self):
        import allocd_torch
        pool = torch.cuda.MemPool()
        pid = tuple(pool.id)
        with torch.cuda.use_mem_pool(pool):
            inside = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        outside = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        segs = [sg for sg in torch.cuda.memory._snapshot()["segments"]
                if tuple(sg.get("segment_pool_id", (0, 0))) == pid]

        def in_pool(t):
            return any(sg["address"] <= t.data_ptr() < sg["address"] + sg["total_size"] for sg in segs)

        own = pool.snapshot()
        private = allocd_torch.memory_stats()["private_allocated_bytes"]
        uses = pool.use_count()
        report("mempool", f"pool {pid}: {len(segs)} segments, inside in pool {in_pool(inside)}, outside in pool "
               f"{in_pool(outside)}; pool.snapshot() {len(own)} segments; private allocated {private / MiB:.0f} MiB; "
               f"use_count {uses}")
        self.assertTrue(segs)
        self.assertTrue(in_pool(inside))
        self.assertFalse(in_pool(outside))
        self.assertEqual(len(own), len(segs))
        self.assertTrue(all(tuple(sg["segment_pool_id"]) == pid for sg in own))
        self.assertEqual(private, 8 * MiB)
        self.assertEqual(uses, 1)
        del inside, outside, pool
        gc.collect()
        torch.cuda.empty_cache()
        self.assertEqual(allocd_torch.memory_stats()["private_reserved_bytes"], 0)

    def test_dataloader_fork_workers(self):
        import torch.utils.data as tud
        torch.manual_seed(0)
        ds = tud.TensorDataset(torch.randn(2048, 64), torch.randint(0, 10, (2048,)))
        holder = {"t": torch.ones(1 << 20, device="cuda")}
        dl = tud.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, multiprocessing_context="fork",
                            pin_memory=True, timeout=120,
                            worker_init_fn=functools.partial(_drop_inherited, holder))
        model = torch.nn.Linear(64, 10).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        t0, steps = time.time(), 0
        for _ in range(2):
            for xb, yb in dl:
                loss = torch.nn.functional.cross_entropy(model(xb.cuda(non_blocking=True)), yb.cuda(non_blocking=True))
                loss.backward()
                opt.step()
                opt.zero_grad()
                steps += 1
        torch.cuda.synchronize()
        report("dataloader", f"2 epochs, {steps} steps with num_workers=2 (fork, pin_memory, each worker freed an "
               f"inherited CUDA tensor) in {time.time() - t0:.1f} s, last loss {loss.item():.3f}")
        self.assertEqual(steps, 64)
        self.assertEqual(holder["t"].sum().item(), 1 << 20)  # the parent's copy is untouched

    def test_torch_compile(self):
        import torch._inductor.config as inductor_config
        inductor_config.compile_threads = 1

        def f(x, y):
            return torch.sin(x) * y + torch.cos(y).sum(dim=0)

        g = torch.compile(f, mode="default")
        x, y = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
        t0 = time.time()
        out = g(x, y)
        torch.cuda.synchronize()
        dt = time.time() - t0
        err = (out - f(x, y)).abs().max().item()
        report("torch_compile", f"compiled and ran in {dt:.1f} s, max |compiled - eager| = {err:.2e}")
        self.assertLess(err, 1e-3)

    def test_metrics_scrape(self):
        import allocd_torch
        from allocd_torch import _metrics
        addr = allocd_torch.metrics_address()
        self.assertTrue(addr, "enable(metrics_listen='127.0.0.1:0') served no metrics")
        x = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
        text = _metrics.scrape(addr)
        alloc = _metrics.total(text, "allocd_allocated_bytes", gpu="0")
        res = _metrics.total(text, "allocd_reserved_bytes", gpu="0")
        self.assertIsNotNone(alloc, f"no allocd_allocated_bytes with gpu=\"0\" in:\n{text[:2000]}")
        self.assertIsNotNone(res, "no allocd_reserved_bytes with gpu=\"0\"")
        report("metrics", f"http://{addr}/metrics: allocd_allocated_bytes{{gpu=\"0\"}} = {alloc:.0f}, "
               f"allocd_reserved_bytes{{gpu=\"0\"}} = {res:.0f} (torch.cuda.memory_allocated() = "
               f"{torch.cuda.memory_allocated()})")
        self.assertGreaterEqual(alloc, 32 * MiB)
        self.assertGreaterEqual(res, alloc)
        del x

    def test_memory_fraction(self):
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(0.05)
        try:
            with self.assertRaises(torch.OutOfMemoryError) as cm:
                torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
            msg = str(cm.exception)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        t = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
        report("memory_fraction", f"fraction 0.05 refused {int(total * 0.1) // MiB} MiB: {msg.splitlines()[0][:120]}; "
               f"after fraction 1.0 it was granted")
        self.assertIn("per_process_memory_fraction", msg)
        del t


if __name__ == "__main__":
    unittest.main()
