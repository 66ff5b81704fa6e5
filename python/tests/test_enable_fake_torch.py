"""allocd_torch.enable() end to end, with a stand-in for torch (fake_torch/) and the real
liballocd.so on the simulated device: the build of the C++ allocator (_allocator.cpp) from the
torch-like include and lib folders, its setup with liballocd's function addresses, its install
as torch's CUDA allocator, torch's code paths through it (allocation, record_stream,
empty_cache, getDeviceStats, snapshot with history, private pools), the too-late refusals and the
no-compiler fallback behind torch's CUDAPluggableAllocator.

Needs g++, and ALLOCD_LIB=<built liballocd.so> with ALLOCD_DEVICE=sim.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
SIM_LIB = os.environ.get("ALLOCD_LIB", "") if os.environ.get("ALLOCD_DEVICE") == "sim" else ""

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import allocd_torch
    from torch import fake
    MiB = 1 << 20
    SIM_STREAM = 3  # a stream of the simulated device (allocd checks record_stream's stream)
    own_memory_stats = torch.cuda.memory_stats
    allocd_torch.enable(metrics_listen="127.0.0.1:0")
    assert allocd_torch.is_enabled() and allocd_torch.hooks_installed()
    assert fake.allocator_name() == "allocd", fake.allocator_name()
    # torch's functions are torch's own: nothing patched.
    assert torch.cuda.memory_stats is own_memory_stats is torch.memory_stats
    assert torch.cuda.memory.memory_stats is torch.memory_stats

    # An allocation through torch's allocator is allocd's, with its context under history.
    fake.record_history(True)
    p = fake.alloc(3 * MiB)
    assert p and allocd_torch.memory_allocated() == 3 * MiB, allocd_torch.memory_allocated()
    # getDeviceStats through the C++ class agrees with allocd's own view.
    ours, theirs = torch.cuda.memory_stats(), allocd_torch.memory_stats()
    diff = {k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v}
    assert not diff, diff
    assert ours["allocated_bytes.all.current"] == 3 * MiB
    # The snapshot through the C++ class sees the live block, its segment and the merged trace.
    snap = fake.snapshot(p)
    assert snap["segments"] >= 1 and snap["block_size"] == 3 * MiB and snap["allocated"] == 1, snap
    assert snap["has_context"] == 1 and snap["segment_size"] >= 3 * MiB, snap
    assert snap["alloc_entries"] == 1 and snap["segment_alloc_entries"] >= 1, snap
    fake.record_history(False)
    assert fake.snapshot(p)["entries"] == 0

    # record_stream reaches allocd: after the drop the block stays active until the stream's work is done.
    fake.record_stream(p, SIM_STREAM)
    fake.drop(p)
    st = allocd_torch.memory_stats()
    assert st["allocated_bytes.all.current"] == 0 and st["active_bytes.all.current"] == 3 * MiB, st
    assert allocd_torch.memory_reserved() > 0
    fake.empty_cache()
    assert allocd_torch.memory_reserved() == 0, allocd_torch.memory_reserved()
    try:
        fake.alloc(10 << 40)
    except RuntimeError as e:
        print("OOM:", e)
    else:
        sys.exit("a 10 TiB allocation must fail")
    assert torch.cuda.memory_stats()["num_ooms"] == allocd_torch.memory_stats()["num_ooms"] == 1
    allocd_torch.enable(metrics_listen="127.0.0.1:0")  # same arguments: nothing happens
    try:
        allocd_torch.enable(conf="expandable_segments:True")
    except RuntimeError as e:
        print("second enable:", e)
    else:
        sys.exit("a second enable() with other arguments must raise")
    print("ENABLED OK", allocd_torch.metrics_address())
""")


@unittest.skipUnless(SIM_LIB, "set ALLOCD_LIB=<built liballocd.so> and ALLOCD_DEVICE=sim")
@unittest.skipUnless(shutil.which("g++"), "needs g++")
class EnableWithFakeTorchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp()
        pkg = os.path.join(cls.dir, "torch")
        shutil.copytree(os.path.join(HERE, "fake_torch", "torch"), pkg)
        shutil.copytree(os.path.join(HERE, "hooks_stub", "include"), os.path.join(pkg, "include"))
        lib = os.path.join(pkg, "lib")
        os.makedirs(lib)
        cmd = ["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
               "-I" + os.path.join(pkg, "include"), os.path.join(HERE, "fake_torch", "stub_torch_cuda.cpp"),
               os.path.join(HERE, "hooks_stub", "fake_runtime.cpp"), "-o", os.path.join(lib, "libtorch_cuda.so")]
        subprocess.run(cmd, check=True)
        empty = os.path.join(cls.dir, "empty.c")
        open(empty, "w").close()
        for name in ("c10_cuda", "c10", "torch"):
            subprocess.run(["gcc", "-shared", "-fPIC", empty, "-o", os.path.join(lib, f"lib{name}.so")], check=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def run_script(self, script, **env):
        e = dict(os.environ, PYTHONPATH=os.pathsep.join([self.dir, PYDIR]),
                 ALLOCD_TORCH_CACHE=os.path.join(self.dir, "cache"))
        e.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        e.update(env)
        r = subprocess.run([sys.executable, "-c", script], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=120)
        return r.returncode, r.stdout.decode("utf-8", "replace")

    def test_enable(self):
        rc, out = self.run_script(SCRIPT)
        self.assertEqual(rc, 0, out)
        self.assertIn("ENABLED OK 127.0.0.1:", out)
        self.assertIn("OOM: OutOfMemoryError: allocd: out of memory: tried to allocate 10.00 TiB", out)
        self.assertIn("second enable: allocd_torch.enable() already ran", out)

    def test_private_pools(self):
        # torch's pool calls through the C++ class reach allocd: a capture's filter routes its
        # stream's mallocs to the pool, other streams stay in the general cache; the snapshot
        # names each segment's pool; a MemPool's life (create, use_mem_pool, destructor) counts
        # users, and the pool's memory returns at the last release and free; a graph tree's
        # checkpoint is restored.
        script = textwrap.dedent("""
            import torch, allocd_torch
            from torch import fake
            MiB = 1 << 20
            SIM_STREAM = 3
            allocd_torch.enable()
            graph = (1, 0)
            fake.set_stream(SIM_STREAM)
            fake.begin_pool(graph, stream=SIM_STREAM)
            g = fake.alloc(3 * MiB)
            fake.set_stream(0)
            q = fake.alloc(MiB)
            st = allocd_torch.memory_stats()
            assert st["private_allocated_bytes"] == 3 * MiB, st["private_allocated_bytes"]
            assert st["allocated_bytes.all.current"] == 4 * MiB, st["allocated_bytes.all.current"]
            snap = fake.pool_snapshot(graph, g)
            assert snap == {"segments": 1, "owned": 1, "holds": 1, "in_whole": 1}, snap
            assert fake.pool_snapshot(graph, q)["holds"] == 0
            assert fake.pool_use_count(graph) == 1
            try:
                fake.begin_pool(graph, stream=SIM_STREAM)
            except RuntimeError as e:
                print("second begin:", e)
            fake.end_pool(graph)
            fake.release_pool(graph)
            assert fake.pool_use_count(graph) == 0
            fake.drop(g)
            fake.drop(q)
            st = allocd_torch.memory_stats()
            assert st["private_reserved_bytes"] == 0, st["private_reserved_bytes"]

            mempool = (0, 1)
            fake.create_pool(mempool)
            fake.begin_pool(mempool)  # use_mem_pool: every stream of this thread
            m = fake.alloc(MiB)
            fake.end_pool(mempool)
            fake.release_pool(mempool)
            plain = fake.alloc(MiB)
            assert fake.pool_snapshot(mempool, m)["holds"] == 1
            assert fake.pool_snapshot(mempool, plain)["holds"] == 0
            assert fake.pool_use_count(mempool) == 1
            fake.release_pool(mempool)  # the MemPool's destructor
            fake.empty_pool(mempool)
            assert allocd_torch.memory_stats()["private_reserved_bytes"] > 0  # m is live
            fake.drop(m)
            fake.drop(plain)
            st = allocd_torch.memory_stats()
            assert st["private_reserved_bytes"] == 0, st["private_reserved_bytes"]
            assert st["allocated_bytes.all.current"] == 0 and st["num_bad_frees"] == 0, st
            try:
                fake.release_pool(mempool)
            except RuntimeError as e:
                print("third release:", e)

            # A graph tree's pool: checkpointed with a and b live; after b dies and c is made, the
            # restore frees a and c and gives a and b back, at their addresses.
            tree = (2, 0)
            fake.begin_pool(tree)
            a, b = fake.alloc(MiB), fake.alloc(2 * MiB)
            fake.end_pool(tree)
            ck = fake.checkpoint(tree)
            fake.drop(b)
            fake.begin_pool(tree)
            c = fake.alloc(MiB)
            fake.end_pool(tree)
            assert fake.restore(ck) == (2, 2)
            st = allocd_torch.memory_stats()
            assert st["private_allocated_bytes"] == 3 * MiB, st["private_allocated_bytes"]
            fake.drop(a)
            fake.drop(b)
            fake.drop_checkpoint(ck)
            fake.release_pool(tree)  # each begin was a user, as each graph is until its reset
            assert fake.pool_use_count(tree) == 1
            fake.release_pool(tree)
            st = allocd_torch.memory_stats()
            assert st["private_reserved_bytes"] == 0 and st["num_bad_frees"] == 0, st
            print("POOLS OK")
        """)
        rc, out = self.run_script(script)
        self.assertEqual(rc, 0, out)
        self.assertIn("POOLS OK", out)
        self.assertIn("second begin: Error: beginAllocateToPool: already recording to mempool_id (1, 0)", out)
        self.assertIn("third release: Error: allocd: device 0: allocator: release pool (0, 1): it has no user: "
                      "unknown memory pool", out)

    def test_too_late(self):
        rc, out = self.run_script("import torch, allocd_torch; allocd_torch.enable()", FAKE_TORCH_CUDA_INITIALISED="1")
        self.assertNotEqual(rc, 0)
        self.assertIn("RuntimeError: allocd_torch.enable() must run before CUDA is initialised in this process, "
                      "but CUDA is already initialised", out)

    def test_native_allocator_initialised(self):
        rc, out = self.run_script("import torch, allocd_torch; allocd_torch.enable()",
                                  FAKE_TORCH_ALLOCATOR_INITIALISED="1")
        self.assertNotEqual(rc, 0)
        self.assertIn("RuntimeError: allocd_torch.enable() must run before CUDA is initialised in this process, "
                      "but torch's current CUDA allocator ('native') is already initialised", out)

    def test_no_compiler(self):
        rc, out = self.run_script("import torch, allocd_torch; allocd_torch.enable()", CXX="no-such-gxx")
        self.assertNotEqual(rc, 0)
        self.assertIn("BuildError: the C++ compiler 'no-such-gxx' is not on PATH", out)
        self.assertIn("-ltorch_cuda -lc10_cuda -lc10 -ltorch", out)
        self.assertIn("allocd_torch needs g++ (or $CXX) once per torch version to build its C++ allocator; "
                      "set ALLOCD_TORCH_ALLOW_NO_HOOKS=1", out)

    def test_no_hooks_fallback(self):
        # Behind torch's CUDAPluggableAllocator: allocations still reach allocd, torch's stats raise.
        script = textwrap.dedent("""
            import torch, allocd_torch
            from torch import fake
            allocd_torch.enable()
            assert not allocd_torch.hooks_installed()
            assert fake.allocator_name() == "pluggable", fake.allocator_name()
            p = fake.alloc(1 << 20)
            assert allocd_torch.memory_allocated() == 1 << 20, allocd_torch.memory_allocated()
            fake.drop(p)
            assert allocd_torch.memory_allocated() == 0, allocd_torch.memory_allocated()
            try:
                torch.cuda.memory_stats()
            except RuntimeError as e:
                print("memory_stats:", e)
            print("FALLBACK OK")
        """)
        rc, out = self.run_script(script, CXX="no-such-gxx", ALLOCD_TORCH_ALLOW_NO_HOOKS="1")
        self.assertEqual(rc, 0, out)
        self.assertIn("FALLBACK OK", out)
        self.assertIn("running WITHOUT allocd's C++ allocator, behind torch's CUDAPluggableAllocator", out)
        self.assertIn("memory_stats: Error: CUDAPluggableAllocator does not yet support getDeviceStats", out)

    def test_skip_record_stream_switch(self):
        # The switch: record_stream through the C++ class does not reach allocd, so the dropped
        # block is not kept active for the stream (test_enable shows that otherwise it is).
        script = textwrap.dedent("""
            import torch, allocd_torch
            from torch import fake
            allocd_torch.enable()
            p = fake.alloc(1 << 20)
            fake.record_stream(p, 3)
            fake.drop(p)
            st = allocd_torch.memory_stats()
            assert st["active_bytes.all.current"] == 0, st["active_bytes.all.current"]
            print("RECORD_STREAM IGNORED")
        """)
        rc, out = self.run_script(script, ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK="1")
        self.assertEqual(rc, 0, out)
        self.assertIn("ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK=1 (a test switch): x.record_stream() is NOT honoured",
                      out)
        self.assertIn("RECORD_STREAM IGNORED", out)


if __name__ == "__main__":
    unittest.main()
