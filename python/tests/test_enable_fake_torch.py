"""allocd_torch.enable() end to end, with a stand-in for torch (fake_torch/) and the real
liballocd.so on the simulated device: the hooks build from the torch-like include and lib
folders, the setup with liballocd's function addresses, the swap, the attach of the three
hooks, the patching of torch.cuda, the too-late refusal and the no-hooks fallback.

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
    import ctypes, sys
    import torch
    import allocd_torch
    allocd_torch.enable(metrics_listen="127.0.0.1:0")
    assert allocd_torch.is_enabled() and allocd_torch.hooks_installed()
    assert torch.stub.stub_hooks() == 7, torch.stub.stub_hooks()
    assert torch.cuda.memory_stats is allocd_torch.memory_stats
    assert torch.cuda.memory.memory_stats is allocd_torch.memory_stats
    err = ctypes.create_string_buffer(4096)
    p = torch.stub.stub_malloc(3 << 20, err, 4096)
    assert p, err.value
    assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == 3 << 20
    torch.stub.stub_record_stream(p)
    torch.stub.stub_free(p, 3 << 20)
    assert allocd_torch.memory_allocated() == 0
    assert allocd_torch.memory_reserved() > 0
    torch.stub.stub_empty_cache()
    assert allocd_torch.memory_reserved() == 0, allocd_torch.memory_reserved()
    assert torch.stub.stub_malloc(10 << 40, err, 4096) is None
    print("OOM:", err.value.decode())
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
        cmd = ["g++", "-std=c++17", "-shared", "-fPIC", "-I" + os.path.join(pkg, "include"),
               os.path.join(HERE, "fake_torch", "stub_torch_cuda.cpp"), "-o", os.path.join(lib, "libtorch_cuda.so")]
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

    def test_too_late(self):
        rc, out = self.run_script("import torch, allocd_torch; allocd_torch.enable()", FAKE_TORCH_CUDA_INITIALISED="1")
        self.assertNotEqual(rc, 0)
        self.assertIn("RuntimeError: allocd_torch.enable() must run before CUDA is initialised in this process, "
                      "but CUDA is already initialised", out)

    def test_no_compiler(self):
        rc, out = self.run_script("import torch, allocd_torch; allocd_torch.enable()", CXX="no-such-gxx")
        self.assertNotEqual(rc, 0)
        self.assertIn("BuildError: the C++ compiler 'no-such-gxx' is not on PATH", out)
        self.assertIn("-ltorch_cuda -lc10_cuda -lc10 -ltorch", out)
        self.assertIn("ALLOCD_TORCH_ALLOW_NO_HOOKS=1", out)

    def test_no_hooks_fallback(self):
        script = ("import torch, allocd_torch; allocd_torch.enable(); "
                  "assert not allocd_torch.hooks_installed(); assert torch.stub.stub_hooks() == 0; print('FALLBACK OK')")
        rc, out = self.run_script(script, CXX="no-such-gxx", ALLOCD_TORCH_ALLOW_NO_HOOKS="1")
        self.assertEqual(rc, 0, out)
        self.assertIn("FALLBACK OK", out)
        self.assertIn("running WITHOUT allocd's C++ hooks", out)

    def test_skip_record_stream_switch(self):
        script = "import torch, allocd_torch; allocd_torch.enable(); print('HOOKS', torch.stub.stub_hooks())"
        rc, out = self.run_script(script, ALLOCD_TORCH_TEST_SKIP_RECORD_STREAM_HOOK="1")
        self.assertEqual(rc, 0, out)
        self.assertIn("HOOKS 6", out)


if __name__ == "__main__":
    unittest.main()
