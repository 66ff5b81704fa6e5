#!/usr/bin/env python3
"""Record memory traces of real PyTorch workloads, as replay inputs for allocd.

    python3 scripts/record_traces.py OUTDIR [--workloads a,b] [--no-snapshot]

For each workload, in one process: the allocator's history is switched on
(torch.cuda.memory._record_memory_history, no stack frames, so the files stay small), the
workload runs from fixed seeds, and OUTDIR/NAME.pickle.gz (PyTorch's snapshot, the format
`allocd replay` reads) and OUTDIR/NAME.stats.json (torch.cuda.memory_stats() at the end,
with the allocator configuration) are written. Between workloads: gc, empty_cache and
reset_peak_memory_stats, so every figure is the workload's own. Run it once as it is and
once with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and --no-snapshot to get
PyTorch's expandable figures beside the native ones (NAME.expandable.stats.json).

The workloads are unlike the shared five on purpose:

  vit_b16_train        torchvision ViT-B/16 training, batch 32 x 224², bf16 autocast, AdamW
  segment_varsize      torchvision FCN-ResNet50 segmentation training, batch 4, image sizes
                       drawn from 256..512 (multiples of 32) every step
  moe_train            a 4-layer mixture-of-experts transformer (8 experts, top-2 routing):
                       the tokens each expert gets vary from step to step
  llm_decode_varlen    GPT-2 small greedy decoding with a KV cache, batches of 1..16
                       requests whose prompts are 8..384 tokens and outputs 8..96 tokens
  varlen_inference     GPT-2 small forward passes without gradients on batches of varying
                       size and length (1..32 x 16..1024)
"""

import argparse
import gzip
import json
import os
import pickle
import random
import sys
import time

import torch

SEED = 4321


def vit_b16_train():
    import torchvision
    model = torchvision.models.vit_b_16(weights=None).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(8):
        x = torch.randn(32, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (32,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def segment_varsize():
    import torchvision
    model = torchvision.models.segmentation.fcn_resnet50(weights=None, weights_backbone=None, num_classes=21).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = random.Random(SEED)
    for _ in range(12):
        h, w = rng.randrange(256, 513, 32), rng.randrange(256, 513, 32)
        x = torch.randn(4, 3, h, w, device="cuda")
        y = torch.randint(0, 21, (4, h, w), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x)["out"], y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class MoE(torch.nn.Module):
    def __init__(self, d, experts, k):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Linear(d, experts)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
            for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, idx = torch.topk(torch.softmax(self.gate(flat), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot].unsqueeze(-1))
        return out.reshape(x.shape)


def moe_train():
    d, layers = 512, 4
    blocks = torch.nn.ModuleList()
    for _ in range(layers):
        blocks.append(torch.nn.ModuleDict({
            "attn": torch.nn.MultiheadAttention(d, 8, batch_first=True),
            "ln1": torch.nn.LayerNorm(d), "ln2": torch.nn.LayerNorm(d), "moe": MoE(d, 8, 2)}))
    emb = torch.nn.Embedding(32000, d)
    head = torch.nn.Linear(d, 32000)
    model = torch.nn.ModuleList([emb, blocks, head]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(SEED)
    for _ in range(12):
        bs, sl = rng.choice([4, 8, 16]), rng.randrange(128, 513, 64)
        ids = torch.randint(0, 32000, (bs, sl), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = emb(ids)
            for b in blocks:
                a = b["ln1"](h)
                h = h + b["attn"](a, a, a, need_weights=False)[0]
                h = h + b["moe"](b["ln2"](h))
            loss = torch.nn.functional.cross_entropy(head(h).float().view(-1, 32000), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    return GPT2LMHeadModel(cfg).cuda().eval()


def llm_decode_varlen():
    model = _gpt2()
    rng = random.Random(SEED)
    with torch.no_grad():
        for _ in range(10):
            bs, pl = rng.choice([1, 2, 4, 8, 16]), rng.randint(8, 384)
            x = torch.randint(0, 50257, (bs, pl), device="cuda")
            model.generate(x, max_new_tokens=rng.randint(8, 96), do_sample=False, pad_token_id=0)


def varlen_inference():
    model = _gpt2()
    rng = random.Random(SEED)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(60):
            bs, sl = rng.choice([1, 2, 4, 8, 16, 32]), rng.randint(16, 1024)
            x = torch.randint(0, 50257, (bs, sl), device="cuda")
            model(input_ids=x).logits.argmax(-1)


WORKLOADS = {f.__name__: f for f in (vit_b16_train, segment_varsize, moe_train, llm_decode_varlen, varlen_inference)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--no-snapshot", action="store_true", help="write the stats only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    tag = ".expandable" if "expandable_segments:true" in conf.lower().replace(" ", "") else ""
    torch.cuda.init()
    for name in args.workloads.split(","):
        random.seed(SEED)
        torch.manual_seed(SEED)
        if not args.no_snapshot:
            torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=3_000_000)
        t0 = time.time()
        WORKLOADS[name]()
        torch.cuda.synchronize()
        wall = time.time() - t0
        base = os.path.join(args.out, name)
        if not args.no_snapshot:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with gzip.open(base + ".pickle.gz", "wb", compresslevel=9) as f:
                pickle.dump(snap, f)
        stats = torch.cuda.memory_stats()
        stats["wall_s"] = wall
        stats["alloc_conf"] = conf
        with open(base + tag + ".stats.json", "w") as f:
            json.dump(stats, f, indent=0, sort_keys=True)
        print(name, tag or ".native", "wall", round(wall, 1), "peak alloc MiB", stats["allocated_bytes.all.peak"] >> 20,
              "peak reserved MiB", stats["reserved_bytes.all.peak"] >> 20, "cudaMalloc", stats.get("num_device_alloc"),
              flush=True)
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()


if __name__ == "__main__":
    sys.exit(main())
