"""Train a small character-level GPT on Python standard-library source with cuda_backend.

    python examples/train_gpt.py --steps 200 [--compare] [--dtype bfloat16] [--graph]
    python examples/train_gpt.py --gpt2-small --steps 50 --compare   # batch 8, seq 1024, 768 wide

The text is the source of a few standard-library modules (read offline with inspect). The model:
token and position embeddings, `--layers` blocks of (layer norm, causal multi-head
self-attention on flash_attention, residual; layer norm, Linear+GELU fused, Linear, residual),
a final layer norm and a linear head; AdamW. At the end it prints a sample continuing a
window of the text. Sizes default small in fallback mode (no GPU). The loop, --compare and
the report are train_mlp.py's.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any, Callable, List, Sequence

import numpy as np

from train_mlp import (add_common_args, gpu, load_into_torch, report, torch_device, train_ours,
                       train_torch)

from cuda_backend import autograd as ag
from cuda_backend import nn, optim
# the model, ours and PyTorch's, is the report's training row's (tests/test_nn.py uses Block)
from cuda_backend.performance.cases_training_gpt import GPT, Block, torch_gpt  # noqa: F401

MODULES = ("argparse", "collections", "textwrap", "json.decoder", "json.encoder", "string",
           "functools", "dataclasses")


def corpus() -> str:
    import importlib
    return "\n".join(inspect.getsource(importlib.import_module(name)) for name in MODULES)


# -- the same in PyTorch --------------------------------------------------------------------------
def torch_build(vocab: int, seq: int, dim: int, heads: int, layers: int) -> Any:
    """Our GPT in PyTorch, parameter names as ours (load_into_torch copies our weights)."""
    import torch
    return torch_gpt(torch, vocab, seq, dim, heads, layers)


# -- data and sampling ----------------------------------------------------------------------------
def make_batches(data: np.ndarray, batch: int, seq: int, seed: int) -> Callable:
    """batch(step) -> (ids (batch, seq), positions (seq,), next ids (batch, seq)), int64."""
    positions = np.arange(seq, dtype=np.int64)

    def get(step: int) -> Sequence[np.ndarray]:
        starts = np.random.default_rng((seed, step)).integers(0, len(data) - seq - 1, batch)
        x = np.stack([data[s:s + seq] for s in starts])
        y = np.stack([data[s + 1:s + seq + 1] for s in starts])
        return x, positions, y
    return get


def sample(model: GPT, window: np.ndarray, chars: List[str], n: int, seed: int) -> str:
    """n characters continuing window (seq ids), sampled at temperature 0.8 from the logits of
    the last position, the window sliding by one each time."""
    m = ag.apis()[0]
    rng = np.random.default_rng(seed)
    seq = len(window)
    positions = m.from_numpy(np.arange(seq, dtype=np.int64))
    ids = m.from_numpy(window[None].astype(np.int64))
    out = []
    model.eval()
    with ag.no_grad():
        for _ in range(n):
            logits = m.to_numpy(model(ids, positions).data)[0, -1].astype(np.float64) / 0.8
            p = np.exp(logits - logits.max())
            nxt = int(rng.choice(len(p), p=p / p.sum()))
            out.append(chars[nxt])
            window = np.append(window[1:], nxt)
            m.backend.copy_to_device(window[None].astype(np.int64), ids)
    model.train()
    return "".join(out)


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, lr=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per step (device batch)")
    p.add_argument("--seq", type=int, default=None, help="characters per sequence")
    p.add_argument("--dim", type=int, default=None, help="model width")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--gpt2-small", action="store_true",
                   help="batch 8, seq 1024, width 768, 12 heads, 12 layers (unless given)")
    p.add_argument("--sample", type=int, default=200, help="characters to sample at the end")
    args = p.parse_args(argv)
    big = gpu()
    preset = (8, 1024, 768, 12, 12) if args.gpt2_small else \
        (16, 256, 256, 4, 4) if big else (8, 32, 32, 4, 2)
    batch, seq, dim, heads, layers = (v if v is not None else d for v, d in zip(
        (args.batch, args.seq, args.dim, args.heads, args.layers), preset))
    if args.lr is None:
        args.lr = 6e-4 if dim >= 512 else 3e-3
    text = corpus()
    chars = sorted(set(text))
    code = {c: i for i, c in enumerate(chars)}
    data = np.array([code[c] for c in text], np.int64)
    print(f"GPT: {len(text):,} characters of standard-library source, vocabulary "
          f"{len(chars)}; {layers} blocks, width {dim}, {heads} heads, seq {seq}, batch "
          f"{batch}, {args.dtype}, {'GPU' if big else 'fallback mode (NumPy)'}"
          f"{', CUDA graph' if args.graph else ''}")
    nn.manual_seed(args.seed)
    model = GPT(len(chars), seq, dim, heads, layers)
    batches = make_batches(data, batch, seq, args.seed)
    if args.compare:
        import torch
        device = torch_device()
        tmodel = load_into_torch(torch_build(len(chars), seq, dim, heads, layers), model, device)
    opt = optim.AdamW(model.parameters(), args.lr)
    ours = train_ours(args, model, opt, batches,
                      lambda x, pos, y: nn.cross_entropy(model(x, pos), y, check_labels=False))
    if args.compare:
        topt = torch.optim.AdamW(tmodel.parameters(), args.lr)
        F = torch.nn.functional
        theirs = train_torch(
            args, tmodel, topt, batches,
            lambda x, pos, y: F.cross_entropy(tmodel(x, pos).float().flatten(0, 1),
                                              y.flatten()), device)
        report(ours, theirs)
    if args.sample > 0:
        start = int(np.random.default_rng(args.seed).integers(0, len(data) - seq))
        window = data[start:start + seq]
        print("--- sample, after:\n" + "".join(chars[i] for i in window[-60:]) + "\n--- ours:\n" +
              sample(model, window, chars, args.sample, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
