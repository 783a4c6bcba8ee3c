"""The trainer users would pick instead: a PyTorch GPT-2 of zerolm's shape, at its best settings, timed.

    python -m benchmarks.measure.torch_gpt --config 125m --micro-batch 16 --accum 2 --steps 25 [--json OUT.json]

A nanoGPT-style GPT-2 (pre-LN, learned positions, tanh-GELU MLP, tied embeddings, vocabulary padded
to a multiple of 128 as zerolm pads it), the shape read from zerolm's YAML config, trained on one GPU
with the settings a PyTorch user would reach for:
- `torch.compile` (default mode; `--compile-mode` tries others, `--no-compile` turns it off);
- bfloat16 autocast over float32 master weights, TF32 for what stays float32;
- `F.scaled_dot_product_attention(is_causal=True)` on the flash-attention kernel alone (the other kernels
  switched off, so a run that cannot take flash fails rather than timing another; `--sdpa default` leaves
  PyTorch's choice);
- fused AdamW (`fused=True`), weight decay on matrices and embeddings only, global-norm clipping
  at 1.0, the same gradient accumulation (micro-batch × accumulation steps) as zerolm's run.
Tokens are uniform random ids below the vocabulary (GPT-2's 50257 by default) (dense compute time does not depend on them).
Step time is the median over the steps after `--warmup`, each ended by `torch.cuda.synchronize()`.

MFU = (6·N + 12·L·d·T) · tokens/s / peak, N without position embeddings: the same count as
`zerolm.observe.mfu`, which this script imports for the formula and the peak table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.lib import REPO
from zerolm.config.load import load_config
from zerolm.model.flops import flops_per_token
from zerolm.observe.mfu import peak_for


def load_shape(name: str, seq_len: int, vocab_size: int) -> dict:
    """The model shape of configs/NAME.yaml (its `extends:` resolved), at this sequence length and vocabulary."""
    cfg = load_config(REPO / "configs" / f"{name}.yaml", [f"model.seq_len={seq_len}", f"model.vocab_size={vocab_size}"],
                      device_count=1).model
    return {k: getattr(cfg, k) for k in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size")}


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer: int, d_model: int, n_head: int, seq_len: int, vocab_size: int):
        super().__init__()
        self.vocab = vocab_size
        padded = -(-vocab_size // 128) * 128
        self.wte, self.wpe = nn.Embedding(padded, d_model), nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, eps=1e-5)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(T, device=tokens.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="125m", help="a config name under configs/ (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=50257, help="GPT-2's, as benchmarks/measure/train_mfu.py uses")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile-mode", default="default", help="torch.compile mode (default: %(default)s)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--sdpa", choices=("flash", "default"), default="flash",
                   help="flash: attention on the flash kernel only; default: PyTorch's choice (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (default: %(default)s)")
    args = p.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.sdpa == "flash":  # flash or an error: no other kernel to fall back to
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(True)
    shape = load_shape(args.config, args.seq_len, args.vocab_size)
    T = shape["seq_len"]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    with dev:  # built and initialised on its device, not on the CPU and then copied
        model = GPT(**shape)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2]
    no_decay = [q for n, q in model.named_parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_model = model if args.no_compile else torch.compile(model, mode=None if args.compile_mode == "default"
                                                              else args.compile_mode)
    gen = torch.Generator(device=dev).manual_seed(0)
    batches = [torch.randint(0, shape["vocab_size"], (args.accum, args.micro_batch, T + 1), device=dev,
                             generator=gen) for _ in range(2)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def train_step(batch):
        for micro in batch:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = step_model(micro[:, :-1], micro[:, 1:]) / args.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(args.steps):
        t = time.perf_counter()
        loss = train_step(batches[i % 2])
        sync()
        times.append(time.perf_counter() - t)
        if i == 0:
            first = time.perf_counter() - start
    step_s = statistics.median(times[args.warmup:])
    n_no_pos = sum(q.numel() for q in model.parameters()) - model.wpe.weight.numel()
    fpt = flops_per_token(n_no_pos, shape["n_layer"], shape["d_model"], T)
    tokens_per_s = args.accum * args.micro_batch * T / step_s
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_for(device)
    result = {"config": args.config, "device": device, "torch": torch.__version__, "micro": args.micro_batch,
              "accum": args.accum, "compile": "off" if args.no_compile else args.compile_mode,
              "step_s": step_s, "tokens_per_s": tokens_per_s, "first_step_s": first,
              "mfu": tokens_per_s * fpt / peak.flops if peak else None,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "loss": float(loss) * args.accum,
              "sdpa": args.sdpa, "sdpa_flash": torch.backends.cuda.flash_sdp_enabled()}
    print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
