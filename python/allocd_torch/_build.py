"""Compile a C++ source into a shared library once, cached by torch version and source hash.

It does not import torch: the caller passes the include and library directories, so
the cache and its error paths are testable without torch.

The cache directory is $ALLOCD_TORCH_CACHE, else ~/.cache/allocd_torch, and holds one
folder per <torch version>-<hash>; the hash covers the source and the compiler command
line, so a change of either builds anew. The library is built under a temporary name
and renamed into place, so processes that start at the same time never load a half
written file (both may compile; the last rename wins, with identical content).
"""

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile

CACHE_ENV = "ALLOCD_TORCH_CACHE"


class BuildError(RuntimeError):
    """allocd's C++ allocator (_allocator.cpp) could not be compiled; the message names the command and its output."""


def cache_root(environ=None):
    env = os.environ if environ is None else environ
    root = env.get(CACHE_ENV, "")
    if root:
        return root
    return os.path.join(os.path.expanduser("~"), ".cache", "allocd_torch")


def compile_command(cxx, source, output, include_dirs, library_dirs, libraries, defines=()):
    """The compiler command line (a list) that builds source into the shared library output."""
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17"]
    cmd += [f"-D{d}" for d in defines]
    cmd += [f"-I{d}" for d in include_dirs]
    cmd += [source, "-o", output]
    cmd += [f"-L{d}" for d in library_dirs]
    cmd += [f"-Wl,-rpath,{d}" for d in library_dirs]
    cmd += [f"-l{lib}" for lib in libraries]
    return cmd


def _tail(text, lines=30):
    return "\n".join(text.strip().splitlines()[-lines:])


def build(source, name, version_tag, include_dirs=(), library_dirs=(), libraries=(), defines=(),
          cxx=None, environ=None, timeout=300):
    """Return the path of the shared library built from source, compiling it if the cache lacks it.

    name is the file name of the library inside its cache folder ("_allocator.so");
    version_tag the first part of the folder name (torch's version). cxx defaults
    to $CXX, else g++. Raises BuildError when the compiler is missing or fails,
    with the command line and the tail of its output.
    """
    env = os.environ if environ is None else environ
    cxx = cxx or env.get("CXX") or "g++"
    with open(source, "rb") as f:
        src = f.read()
    # The hash covers everything that changes the binary but not the output path.
    probe = compile_command(cxx, "SOURCE", "OUTPUT", include_dirs, library_dirs, libraries, defines)
    h = hashlib.sha256(src + b"\0" + "\0".join(probe).encode()).hexdigest()[:16]
    folder = os.path.join(cache_root(env), f"{_safe(version_tag)}-{h}")
    out = os.path.join(folder, name)
    if os.path.isfile(out):
        return out
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create the cache folder {folder} ({e}); set {CACHE_ENV} to a "
                         f"writable folder") from e
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    cmd = compile_command(cxx, source, tmp, include_dirs, library_dirs, libraries, defines)
    shown = " ".join(shlex.quote(c) for c in cmd)
    try:
        if shutil.which(cxx) is None:
            raise BuildError(f"the C++ compiler {cxx!r} is not on PATH (set CXX to another). "
                             f"It is needed once per torch version to build allocd's C++ allocator, with: {shown}")
        try:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"running the compiler failed ({e}); command: {shown}") from e
        if r.returncode != 0:
            raise BuildError(f"compiling allocd's C++ allocator failed (exit {r.returncode}).\ncommand: {shown}\n"
                             f"output (tail):\n{_tail(r.stdout.decode('utf-8', 'replace'))}")
        os.replace(tmp, out)
        tmp = None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return out


def _safe(tag):
    return "".join(c if c.isalnum() or c in ".+_-" else "_" for c in tag)
