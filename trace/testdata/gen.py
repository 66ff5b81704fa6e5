#!/usr/bin/env python3
"""Generate the small snapshot pickles the trace tests read.

Run from trace/testdata: python3 gen.py. Deterministic; writes the *.pickle
files, a gzip copy and expected.json, which holds what Python's own pickle
module decodes from each file (the tests compare our decoder against it).
"""
import gzip
import json
import pickle
import pickletools

MOD = "/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py"
NEG_STREAM = -(1 << 63) + 12345  # a cudaStream_t >= 2**63 as PyTorch pickles it


def settings():
    return {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
        "max_split_size": -1,
        "garbage_collection_threshold": 0.0,
        "expandable_segments": False,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "roundup_power2_divisions": {str(1 << i): 0 for i in range(4)},
    }


def entry(action, addr, size, stream=0, t=1000, frames=None, **extra):
    e = {"action": action}
    e["device_free" if action == "oom" else "addr"] = addr
    e.update(size=size, stream=stream, time_us=t)
    if frames is not None:
        e["frames"] = frames
    e.update(compile_context="N/A", user_metadata="")
    e.update(extra)
    return e


def small(frames=False):
    """Every action, two devices (one empty), a huge stream, a float time."""
    empty = []  # shared, as PyTorch shares its empty frames list
    stack_a = [
        {"name": "forward", "filename": MOD, "line": 1097},
        {"name": "train", "filename": "examples/train.py", "line": 28},
    ]
    stack_b = [stack_a[1]]
    base = 0x7F00_0000_0000
    big = 0xFFFF_FFFF_FFFF_F000  # an address above 2**63
    tr = [
        entry("segment_alloc", base, 2 << 20, t=1, frames=stack_a if frames else None),
        entry("alloc", base, 512, t=2, frames=stack_a if frames else None),
        entry("alloc", base + 512, 1024, stream=NEG_STREAM, t=3, frames=stack_b if frames else None),
        entry("free_requested", base, 512, t=4, frames=empty if frames else None),
        entry("free_completed", base, 512, t=5),
        entry("segment_map", big, 20 << 20, t=6),
        entry("segment_unmap", big, 20 << 20, t=7),
        entry("snapshot", 0, 0, t=8),
        entry("oom", 123456, 1 << 40, t=9),
        entry("free_requested", base + 512, 1024, stream=NEG_STREAM, t=10.75),
        entry("alloc", base + 4096, 4096, t=11),
        entry("free_completed", base + 512, 1024, stream=NEG_STREAM, t=12),
        entry("free_requested", 0xDEAD, 16, t=13),
        entry("segment_free", base, 2 << 20, t=14),
    ]
    segs = [
        {"device": 1, "address": base, "total_size": 2 << 20, "allocated_size": 4096,
         "active_size": 4096, "requested_size": 4000, "stream": 0, "segment_type": "small",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": empty,
         "blocks": [
             {"address": base, "size": 4096, "requested_size": 4000, "state": "active_allocated",
              "frames": stack_a if frames else empty},
             {"address": base + 4096, "size": (2 << 20) - 4096, "requested_size": 0,
              "state": "inactive", "frames": empty},
         ]},
        {"device": 1, "address": big, "total_size": 20 << 20, "allocated_size": 0,
         "active_size": 0, "requested_size": 0, "stream": NEG_STREAM, "segment_type": "large",
         "segment_pool_id": (0, 0), "is_expandable": True, "frames": empty,
         "blocks": [{"address": big, "size": 20 << 20, "requested_size": 0,
                     "state": "inactive", "frames": empty}]},
    ]
    return {"segments": segs, "device_traces": [[], tr],
            "allocator_settings": settings(), "external_annotations": []}


def many(n=2001):
    """A trace longer than the pickler's batch of 1000, key order shuffled."""
    tr = []
    for i in range(n):
        addr = 0x7F00_0000_0000 + (i % 7) * 4096
        tr.append(entry("alloc" if i % 2 == 0 else "free_requested", addr, 512 * (i % 5 + 1),
                        t=1_796_216_767_109_019 + i))
    # A dict-valued key and an unused list before the typed keys.
    return {"allocator_settings": settings(), "external_annotations": [{"stage": "START"}],
            "device_traces": [tr], "segments": []}


def frames(d):
    return [[f["filename"], f["line"], f["name"]] for f in d.get("frames", [])]


def summary(s):
    """What the Go test checks, computed with Python's pickle."""
    def u64(x):
        return x % (1 << 64)
    out = {"segments": [], "device_traces": []}
    for seg in s["segments"]:
        out["segments"].append({
            "device": seg["device"], "address": u64(seg["address"]), "total_size": seg["total_size"],
            "allocated_size": seg["allocated_size"], "active_size": seg["active_size"],
            "requested_size": seg["requested_size"], "stream": u64(seg["stream"]),
            "segment_type": seg["segment_type"], "is_expandable": seg["is_expandable"],
            "frames": frames(seg),
            "blocks": [{"address": b["address"], "size": b["size"],
                        "requested_size": b["requested_size"], "state": b["state"],
                        "frames": frames(b)}
                       for b in seg["blocks"]]})
    for d in s["device_traces"]:
        entries = [{
            "action": e["action"], "addr": u64(e.get("addr", e.get("device_free", 0))),
            "size": e["size"], "stream": u64(e["stream"]), "time_us": int(e["time_us"]),
            "frames": frames(e),
        } for e in d]
        actions = {}
        for e in entries:
            actions[e["action"]] = actions.get(e["action"], 0) + 1
        out["device_traces"].append({
            "n": len(entries), "actions": actions,
            "sum_addr": sum(e["addr"] for e in entries) % (1 << 64),
            "sum_size": sum(e["size"] for e in entries) % (1 << 64),
            "sum_time": sum(e["time_us"] for e in entries) % (1 << 64),
            "sum_stream": sum(e["stream"] for e in entries) % (1 << 64),
            "entries": entries if len(entries) <= 50 else None})
    out["allocator_settings"] = s.get("allocator_settings")
    return out


def opcodes(b):
    return sorted({op.name for op, _, _ in pickletools.genops(b)})


def main():
    files = {
        "small.p2.pickle": (small(), 2),
        "small.p4.pickle": (small(), 4),
        "small.p5.pickle": (small(), 5),
        "frames.p4.pickle": (small(frames=True), 4),
        "many.p2.pickle": (many(), 2),
    }
    expected = {}
    for name, (obj, proto) in files.items():
        b = pickle.dumps(obj, protocol=proto)
        with open(name, "wb") as f:
            f.write(b)
        expected[name] = {"summary": summary(pickle.loads(b)), "opcodes": opcodes(b)}
    with open("small.p4.pickle", "rb") as f, open("small.p4.pickle.gz", "wb") as g:
        g.write(gzip.compress(f.read(), mtime=0))
    with open("expected.json", "w") as f:
        json.dump(expected, f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
