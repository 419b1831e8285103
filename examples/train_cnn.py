"""Train a small CNN (convolution, batch norm, pooling) on synthetic images with cuda_backend.

    python examples/train_cnn.py --steps 200 [--compare] [--dtype bfloat16] [--graph]

Each image is noise plus one of `--classes` fixed random patterns, scaled by a random
contrast; the label is the pattern, so the loss falls within a few dozen steps. Two blocks of
conv 3x3 -> batch norm -> ReLU -> 2x2 pooling (max, then average), then a linear classifier.
Sizes default small in fallback mode (no GPU). The loop, --compare and the report are
train_mlp.py's.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

import numpy as np

from train_mlp import (add_common_args, gpu, load_into_torch, report, torch_device,
                       train_ours, train_torch)

from cuda_backend import autograd as ag
from cuda_backend import nn, optim


def build(channels: int, width: int, size: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * (size // 4) ** 2, classes))


def torch_build(channels: int, width: int, size: int, classes: int) -> Any:
    import torch.nn as tnn
    return tnn.Sequential(
        tnn.Conv2d(channels, width, 3, padding=1), tnn.BatchNorm2d(width), tnn.ReLU(),
        tnn.MaxPool2d(2),
        tnn.Conv2d(width, 2 * width, 3, padding=1), tnn.BatchNorm2d(2 * width), tnn.ReLU(),
        tnn.AvgPool2d(2),
        tnn.Flatten(), tnn.Linear(2 * width * (size // 4) ** 2, classes))


def make_batches(channels: int, size: int, classes: int, batch: int, seed: int) -> Callable:
    """batch(step) -> (images float32 (batch, channels, size, size), labels int64)."""
    patterns = np.random.default_rng(seed + 1).standard_normal((classes, channels, size, size))

    def get(step: int) -> Sequence[np.ndarray]:
        rng = np.random.default_rng((seed, step))
        labels = rng.integers(0, classes, batch)
        contrast = rng.uniform(0.5, 1.5, (batch, 1, 1, 1))
        x = contrast * patterns[labels] + rng.standard_normal((batch, channels, size, size))
        return x.astype(np.float32), labels.astype(np.int64)
    return get


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, lr=0.05)
    p.add_argument("--batch", type=int, default=None, help="images per step (device batch)")
    p.add_argument("--size", type=int, default=None, help="image side (a multiple of 4)")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--width", type=int, default=None, help="channels of the first conv")
    p.add_argument("--classes", type=int, default=10)
    args = p.parse_args(argv)
    big = gpu()
    batch = args.batch or (64 if big else 16)
    size = args.size or (32 if big else 12)
    width = args.width or (32 if big else 8)
    if size % 4:
        p.error(f"--size must be a multiple of 4, got {size}")
    print(f"CNN {args.channels}x{size}x{size} -> conv {width} -> conv {2 * width} -> "
          f"{args.classes} classes, batch {batch}, {args.dtype}, "
          f"{'GPU' if big else 'fallback mode (NumPy)'}{', CUDA graph' if args.graph else ''}")
    nn.manual_seed(args.seed)
    model = build(args.channels, width, size, args.classes)
    batches = make_batches(args.channels, size, args.classes, batch, args.seed)
    if args.compare:
        import torch
        device = torch_device()
        tmodel = load_into_torch(torch_build(args.channels, width, size, args.classes), model,
                                 device)
    opt = optim.SGD(model.parameters(), args.lr, momentum=0.9)
    ours = train_ours(args, model, opt, batches,
                      lambda x, y: nn.cross_entropy(model(ag.Tensor(x)), y, check_labels=False))
    if args.compare:
        topt = torch.optim.SGD(tmodel.parameters(), args.lr, momentum=0.9)
        theirs = train_torch(args, tmodel, topt, batches,
                             lambda x, y: torch.nn.functional.cross_entropy(tmodel(x).float(), y),
                             device)
        report(ours, theirs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
