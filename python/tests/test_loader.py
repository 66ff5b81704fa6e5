"""allocd_torch without a GPU and without torch (stdlib unittest).

    python3 -m unittest discover -s python/tests -v

Always: the library lookup and its messages, the build cache, the C++ allocator's logic
(_allocator.cpp against stub torch headers, needs g++), the device-argument parsing, the
metrics parser.
With ALLOCD_LIB pointing at a built liballocd.so and ALLOCD_DEVICE=sim: the ctypes layer on
the simulated device (stats, summary, snapshot, bad frees, OOM, metrics, the fork guard).
Tests that need torch are skipped when it is absent.
"""

import collections
import ctypes
import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import allocd_torch  # noqa: E402
from allocd_torch import _build, _lib, _metrics, _torch  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_GXX = shutil.which("g++") is not None
SIM_LIB = os.environ.get("ALLOCD_LIB", "") if os.environ.get("ALLOCD_DEVICE") == "sim" else ""

# Keys torch.cuda.memory_stats() has (torch 2.x); allocd must give at least these.
TORCH_KEYS = [f"{s}.{p}.{c}" for s in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                       "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
              for p in ("all", "small_pool", "large_pool") for c in ("current", "peak", "allocated", "freed")]
TORCH_KEYS += [f"oversize_{k}.{c}" for k in ("allocations", "segments") for c in ("current", "peak", "allocated", "freed")]
TORCH_KEYS += ["num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
               "max_split_size"]


class FindLibraryTest(unittest.TestCase):
    def test_env_names_a_missing_file(self):
        with self.assertRaises(_lib.LibraryError) as cm:
            _lib.find_library({"ALLOCD_LIB": "/nonexistent/liballocd.so"})
        msg = str(cm.exception)
        self.assertIn("ALLOCD_LIB='/nonexistent/liballocd.so' does not name a file", msg)
        self.assertIn(_lib.beside_path(), msg)
        self.assertIn("go build -buildmode=c-shared", msg)

    def test_nothing_anywhere_names_both_places(self):
        if os.path.isfile(_lib.beside_path()):
            self.skipTest(f"a liballocd.so lies beside the package ({_lib.beside_path()})")
        with self.assertRaises(_lib.LibraryError) as cm:
            _lib.find_library({})
        msg = str(cm.exception)
        self.assertIn("ALLOCD_LIB is not set", msg)
        self.assertIn(_lib.beside_path(), msg)

    def test_env_wins(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as f:
            self.assertEqual(_lib.find_library({"ALLOCD_LIB": f.name}), f.name)

    def test_not_a_shared_object(self):
        with tempfile.NamedTemporaryFile(suffix=".so") as f:
            f.write(b"not an ELF file")
            f.flush()
            with self.assertRaises(_lib.LibraryError) as cm:
                _lib.Library(f.name)
            self.assertIn("cannot load", str(cm.exception))

    def test_a_library_without_the_functions(self):
        with self.assertRaises(_lib.LibraryError) as cm:
            _lib.Library("libc.so.6")
        self.assertIn("lacks the functions allocd_init", str(cm.exception))

    def test_public_api_needs_enable(self):
        with self.assertRaises(RuntimeError) as cm:
            allocd_torch.memory_stats()
        self.assertIn("call allocd_torch.enable()", str(cm.exception))
        self.assertFalse(allocd_torch.is_enabled())


class DeviceIndexTest(unittest.TestCase):
    def test_forms(self):
        if "torch" not in sys.modules:
            self.assertEqual(_torch.device_index(None), 0)
        self.assertEqual(_torch.device_index(3), 3)
        self.assertEqual(_torch.device_index("cuda:2"), 2)

        class Dev:
            type, index = "cuda", 1
        self.assertEqual(_torch.device_index(Dev()), 1)
        for bad in ("cpu", "cuda:x", True):
            with self.assertRaises((ValueError, TypeError)):
                _torch.device_index(bad)


class WithoutTorchTest(unittest.TestCase):
    @unittest.skipIf(HAVE_TORCH, "torch is installed")
    def test_enable_says_torch_is_needed(self):
        with self.assertRaises(ImportError) as cm:
            allocd_torch.enable()
        self.assertIn("needs torch", str(cm.exception))

    @unittest.skipUnless(HAVE_TORCH, "needs torch")
    def test_build_inputs_for_this_torch(self):
        import torch
        try:
            inc, libdirs, libs, defines = _torch._torch_build_inputs(torch)
        except _build.BuildError as e:  # a CPU-only torch without CUDA headers
            self.skipTest(str(e))
        self.assertTrue(any(os.path.isfile(os.path.join(d, "torch", "csrc", "cuda", "CUDAPluggableAllocator.h"))
                            for d in inc))
        self.assertIn("c10", libs)
        self.assertTrue(defines[0].startswith("_GLIBCXX_USE_CXX11_ABI="))


class MetricsParserTest(unittest.TestCase):
    def test_total(self):
        text = ('# HELP allocd_allocated_bytes x\n# TYPE allocd_allocated_bytes gauge\n'
                'allocd_allocated_bytes{UUID="GPU-1",gpu="0",pool="large"} 2.097152e+07\n'
                'allocd_allocated_bytes{UUID="GPU-1",gpu="0",pool="small"} 512\n'
                'allocd_allocated_bytes{UUID="GPU-2",gpu="1",pool="large"} 7\n'
                'allocd_ooms_total{gpu="0"} 0\n')
        self.assertEqual(_metrics.total(text, "allocd_allocated_bytes", gpu="0"), 20971520 + 512)
        self.assertEqual(_metrics.total(text, "allocd_allocated_bytes"), 20971520 + 512 + 7)
        self.assertIsNone(_metrics.total(text, "allocd_reserved_bytes", gpu="0"))


@unittest.skipUnless(HAVE_GXX, "needs g++")
class BuildCacheTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.env = {"ALLOCD_TORCH_CACHE": os.path.join(self.dir, "cache"), "PATH": os.environ.get("PATH", "")}
        self.src = os.path.join(self.dir, "x.cpp")
        with open(self.src, "w") as f:
            f.write('extern "C" int answer() { return 42; }\n')

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_builds_once_and_loads(self):
        p = _build.build(self.src, "_x.so", "2.11.0+cu130", environ=self.env)
        self.assertTrue(p.startswith(os.path.join(self.env["ALLOCD_TORCH_CACHE"], "2.11.0+cu130-")), p)
        self.assertEqual(ctypes.CDLL(p).answer(), 42)
        mtime = os.stat(p).st_mtime_ns
        # A second call must not run the compiler.
        run = _build.subprocess.run
        _build.subprocess.run = None
        try:
            self.assertEqual(_build.build(self.src, "_x.so", "2.11.0+cu130", environ=self.env), p)
        finally:
            _build.subprocess.run = run
        self.assertEqual(os.stat(p).st_mtime_ns, mtime)
        self.assertEqual([f for f in os.listdir(os.path.dirname(p)) if f.endswith(".tmp")], [])

    def test_the_key_covers_source_version_and_flags(self):
        a = _build.build(self.src, "_x.so", "2.11.0", environ=self.env)
        b = _build.build(self.src, "_x.so", "2.12.0", environ=self.env)
        c = _build.build(self.src, "_x.so", "2.11.0", defines=["_GLIBCXX_USE_CXX11_ABI=0"], environ=self.env)
        with open(self.src, "a") as f:
            f.write("// changed\n")
        d = _build.build(self.src, "_x.so", "2.11.0", environ=self.env)
        self.assertEqual(len({os.path.dirname(x) for x in (a, b, c, d)}), 4)

    def test_compile_error_names_command_and_output(self):
        with open(self.src, "w") as f:
            f.write("this is not C++\n")
        with self.assertRaises(_build.BuildError) as cm:
            _build.build(self.src, "_x.so", "v", include_dirs=["/opt/inc"], environ=self.env)
        msg = str(cm.exception)
        self.assertIn("compiling allocd's C++ allocator failed", msg)
        self.assertIn("g++ -O2 -shared -fPIC -std=c++17 -I/opt/inc " + self.src, msg)
        self.assertIn("error", msg)
        folder = os.path.join(self.env["ALLOCD_TORCH_CACHE"])
        leftovers = [f for _, _, fs in os.walk(folder) for f in fs]
        self.assertEqual(leftovers, [], "a failed build must leave nothing in the cache")

    def test_missing_compiler(self):
        with self.assertRaises(_build.BuildError) as cm:
            _build.build(self.src, "_x.so", "v", cxx="no-such-gxx-compiler", environ=self.env)
        msg = str(cm.exception)
        self.assertIn("'no-such-gxx-compiler' is not on PATH", msg)
        self.assertIn("no-such-gxx-compiler -O2 -shared", msg)

    def test_concurrent_builds(self):
        code = ("import sys; sys.path.insert(0, %r); from allocd_torch import _build; "
                "print(_build.build(%r, '_x.so', 'v', environ={'ALLOCD_TORCH_CACHE': %r, 'PATH': %r}))"
                % (os.path.dirname(HERE), self.src, self.env["ALLOCD_TORCH_CACHE"], self.env["PATH"]))
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(4)]
        outs = {p.communicate(timeout=120)[0].decode().strip() for p in procs}
        self.assertEqual([p.returncode for p in procs], [0] * 4)
        self.assertEqual(len(outs), 1, outs)
        self.assertEqual(ctypes.CDLL(outs.pop()).answer(), 42)


@unittest.skipUnless(HAVE_GXX, "needs g++")
class AllocatorLogicTest(unittest.TestCase):
    """_allocator.cpp against stub torch headers and a fake liballocd, driven by tests/hooks_stub/driver.cpp."""

    def test_driver(self):
        stub = os.path.join(HERE, "hooks_stub")
        src = os.path.join(os.path.dirname(HERE), "allocd_torch", "_allocator.cpp")
        with tempfile.TemporaryDirectory() as d:
            exe = os.path.join(d, "driver")
            cmd = ["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I" + os.path.join(stub, "include"),
                   f'-DHOOKS_SOURCE="{src}"', os.path.join(stub, "driver.cpp"), "-o", exe, "-lpthread"]
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.assertEqual(r.returncode, 0, r.stdout.decode())
            r = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
            out = r.stdout.decode()
            self.assertEqual(r.returncode, 0, out)
            self.assertRegex(out, r"^ok \d+ checks")
            print(f"\n  allocator driver: {out.strip()}", file=sys.stderr)


@unittest.skipUnless(SIM_LIB, "set ALLOCD_LIB=<built liballocd.so> and ALLOCD_DEVICE=sim")
class SimLibraryTest(unittest.TestCase):
    """The ctypes layer over a real liballocd.so on the simulated device."""

    lib = None

    @classmethod
    def setUpClass(cls):
        cls.lib = _lib.Library(_lib.find_library())
        cls.lib.init("", "127.0.0.1:0", None)

    def test_init_is_idempotent_and_refuses_other_arguments(self):
        self.lib.init("", "127.0.0.1:0", None)
        with self.assertRaises(_lib.LibraryError):
            self.lib.init("expandable_segments:True", "127.0.0.1:0", None)

    def test_stats_follow_malloc_and_free(self):
        before = self.lib.memory_stats(0)
        self.assertIsInstance(before, collections.OrderedDict)
        self.assertEqual(list(before), sorted(before))
        self.assertTrue(all(type(v) is int for v in before.values()))
        missing = [k for k in TORCH_KEYS if k not in before]
        self.assertEqual(missing, [], "keys torch.cuda.memory_stats() has")
        p = self.lib.malloc(3 << 20, 0)
        self.assertNotEqual(p, 0, self.lib.last_error())
        try:
            s = self.lib.memory_stats(0)
            self.assertEqual(s["allocated_bytes.all.current"] - before["allocated_bytes.all.current"], 3 << 20)
            self.assertEqual(s["requested_bytes.all.current"] - before["requested_bytes.all.current"], 3 << 20)
            self.assertGreaterEqual(s["reserved_bytes.all.current"], s["allocated_bytes.all.current"])
            self.assertEqual(self.lib.memory_allocated(0), s["allocated_bytes.all.current"])
            self.assertEqual(self.lib.memory_reserved(0), s["reserved_bytes.all.current"])
            self.assertGreaterEqual(self.lib.max_memory_allocated(0), s["allocated_bytes.all.current"])
            self.assertGreaterEqual(self.lib.max_memory_reserved(0), s["reserved_bytes.all.current"])
        finally:
            self.lib.free(p, 3 << 20, 0)
        self.assertEqual(self.lib.memory_allocated(0), before["allocated_bytes.all.current"])

    def test_reset_peak_and_empty_cache(self):
        p = self.lib.malloc(5 << 20, 0)
        self.lib.free(p, 5 << 20, 0)
        self.assertGreater(self.lib.memory_reserved(0), 0)
        self.lib.reset_peak_stats(0)
        self.assertEqual(self.lib.max_memory_allocated(0), self.lib.memory_allocated(0))
        self.lib.empty_cache()
        self.assertEqual(self.lib.memory_reserved(0), self.lib.memory_stats(0)["reserved_bytes.all.current"])
        if self.lib.memory_allocated(0) == 0:
            self.assertEqual(self.lib.memory_reserved(0), 0)

    def test_release_stream(self):
        stream = 3  # a simulated device's stream
        p = self.lib.malloc(1 << 20, 0, stream)
        self.assertNotEqual(p, 0, self.lib.last_error())
        self.lib.free(p, 1 << 20, 0, stream)
        before = self.lib.memory_reserved(0)
        self.lib.release_stream(0, stream)
        self.assertEqual(before - self.lib.memory_reserved(0), 2 << 20, "the stream's cached 2 MiB segment")
        self.lib.release_stream(5, stream)  # a device not created: nothing to release
        with self.assertRaises(_lib.LibraryError) as cm:
            self.lib.release_stream(-1, stream)
        self.assertIn("no such device", str(cm.exception))

    def test_summary(self):
        text = self.lib.memory_summary(0, False)
        self.assertIn("Allocated memory", text)
        self.assertIn("GPU reserved memory", text)
        self.assertLessEqual(len(self.lib.memory_summary(0, True)), len(text))

    def test_snapshot_with_history(self):
        self.lib.record_history(True, 1000, 0)
        p = self.lib.malloc(1 << 20, 0)
        try:
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "snap.pickle")
                self.lib.dump_snapshot(path)
                with open(path, "rb") as f:
                    snap = pickle.load(f)
        finally:
            self.lib.free(p, 1 << 20, 0)
            self.lib.record_history(False, 1000, 0)
        self.assertIn("segments", snap)
        self.assertIn("device_traces", snap)
        blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
        self.assertTrue(any(b["state"] == "active_allocated" and b["size"] >= 1 << 20 for b in blocks), blocks)
        actions = [e["action"] for tr in snap["device_traces"] for e in tr]
        self.assertIn("alloc", actions)

    def test_bad_free_is_counted_not_fatal(self):
        n = self.lib.memory_stats(0)["num_bad_frees"]
        self.lib.free(0x3039, 16, 0)
        p = self.lib.malloc(4096, 0)
        self.lib.free(p, 4096, 0)
        self.lib.free(p, 4096, 0)  # double free
        self.assertEqual(self.lib.memory_stats(0)["num_bad_frees"], n + 2)

    def test_oom_message(self):
        n = self.lib.memory_stats(0)["num_ooms"]
        self.assertEqual(self.lib.malloc(10 << 40, 0), 0)
        msg = self.lib.last_error()
        self.assertIn("out of memory", msg)
        self.assertIn("tried to allocate 10.00 TiB", msg)
        self.assertEqual(self.lib.memory_stats(0)["num_ooms"], n + 1,
                         "num_ooms must count the failed request, as PyTorch's does")

    def test_metrics(self):
        addr = self.lib.metrics_address()
        self.assertRegex(addr, r"^127\.0\.0\.1:\d+$")
        p = self.lib.malloc(2 << 20, 0)
        try:
            text = _metrics.scrape(addr)
        finally:
            self.lib.free(p, 2 << 20, 0)
        self.assertGreaterEqual(_metrics.total(text, "allocd_allocated_bytes", gpu="0"), 2 << 20)
        self.assertGreater(_metrics.total(text, "allocd_reserved_bytes", gpu="0"), 0)

    def test_forked_child_is_refused(self):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self.lib.memory_stats(0)
            except _lib.LibraryError as e:
                code = 0 if "forked child" in str(e) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        self.assertIsInstance(self.lib.memory_stats(0), collections.OrderedDict)


if __name__ == "__main__":
    unittest.main()
