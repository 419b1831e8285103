"""Train an MLP on a synthetic classification set with cuda_backend alone.

    python examples/train_mlp.py --steps 200                # float32, progress every 20 steps
    python examples/train_mlp.py --steps 200 --compare      # also PyTorch, same start and data
    python examples/train_mlp.py --dtype bfloat16 --graph   # mixed precision, one graph per step

The labels are the argmax of a fixed random linear "teacher" of the inputs, so the loss falls
steadily. Sizes default small in fallback mode (no GPU: NumPy underneath) and to the batch-32
1024 -> 4096 -> 1024 MLP on a GPU. --compare builds the same model in PyTorch from our initial
weights (state_dict), feeds it the same batches with the same optimizer, and prints both final
losses, the loss curves' largest relative gap, the step times and the peak device memory.

The loop, the PyTorch comparison and the report are written once here (`add_common_args`,
`train_ours`, `train_torch`, `report`); train_cnn.py and train_gpt.py import them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuda_backend import autograd as ag  # noqa: E402
from cuda_backend import nn, optim  # noqa: E402

WARM = 3    # steps left out of the step-time medians (compiles, autotuning, first allocations)


# -- shared by the three examples ---------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser, lr: Optional[float]) -> None:
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=lr, help="learning rate")
    p.add_argument("--log-every", type=int, default=20, help="a progress line every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: compute in bfloat16 from float32 master weights")
    p.add_argument("--compare", action="store_true",
                   help="also train the same model in PyTorch from the same start and data")
    p.add_argument("--graph", action="store_true",
                   help="capture the whole training step as a CUDA graph (GPU only)")


def gpu() -> bool:
    return ag.apis()[0].gpu


def train_ours(args: Any, model: nn.Module, opt: optim.Optimizer,
               batch: Callable[[int], Sequence[np.ndarray]],
               loss_fn: Callable[..., ag.Tensor]) -> Dict[str, Any]:
    """Train for args.steps: batch(step) gives the host arrays, copied each step into device
    tensors made once; loss_fn(*tensors) returns the loss. Returns the losses, the step times
    (s, each ending with the loss read back) and the peak pool bytes."""
    m = ag.apis()[0]
    inputs = [m.from_numpy(a) for a in batch(0)]
    mixed = args.dtype != "float32"

    def forward_backward() -> ag.Tensor:
        with ag.autocast(args.dtype if mixed else None):
            loss = loss_fn(*inputs)
        loss.backward()
        return loss

    if args.graph:
        if not gpu():
            sys.exit("--graph needs a GPU: CUDA graphs do not exist in fallback mode")
        step = optim.CapturedStep(forward_backward, opt)
    else:
        def step() -> ag.Tensor:
            opt.zero_grad()
            loss = forward_backward()
            opt.step()
            return loss
    pool = m.backend.memory_pools[inputs[0].device_id]
    pool.reset_peak_stats()
    losses: List[float] = []
    times: List[float] = []
    for s in range(args.steps):
        for t, a in zip(inputs, batch(s)):
            m.backend.copy_to_device(a, t)
        t0 = time.perf_counter()
        losses.append(step().item())
        times.append(time.perf_counter() - t0)
        if (s + 1) % args.log_every == 0 or s + 1 == args.steps:
            ms = 1e3 * float(np.median(times[-args.log_every:]))
            print(f"step {s + 1:5d}  loss {losses[-1]:.4f}  {ms:8.2f} ms/step", flush=True)
    if args.graph:
        step.free()
    return {"losses": losses, "times": times, "peak": pool.get_stats()["peak_allocated"]}


def torch_device() -> Any:
    import torch
    use_cuda = gpu() and torch.cuda.is_available()
    if use_cuda:   # true float32, as ours (precision=None)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda" if use_cuda else "cpu")


def load_into_torch(tmodel: Any, model: nn.Module, device: Any) -> Any:
    """tmodel with our model's parameters and buffers, on device."""
    import torch
    state = {k: torch.from_numpy(np.array(v)) for k, v in model.state_dict().items()}
    res = tmodel.load_state_dict(state, strict=False)
    missing = [k for k in res.missing_keys if not k.endswith("num_batches_tracked")]
    if missing or res.unexpected_keys:
        raise SystemExit(f"the PyTorch model does not mirror ours: missing {missing}, "
                         f"unexpected {res.unexpected_keys}")
    return tmodel.to(device)


def train_torch(args: Any, tmodel: Any, topt: Any, batch: Callable[[int], Sequence[np.ndarray]],
                loss_fn: Callable[..., Any], device: Any) -> Dict[str, Any]:
    """The same loop in PyTorch eager (autocast for bfloat16)."""
    import torch
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses: List[float] = []
    times: List[float] = []
    for s in range(args.steps):
        data = [torch.from_numpy(a).to(device) for a in batch(s)]
        t0 = time.perf_counter()
        topt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16,
                            enabled=args.dtype == "bfloat16"):
            loss = loss_fn(*data)
        loss.backward()
        topt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"losses": losses, "times": times, "peak": peak}


def torch_linear_gelu(in_features: int, out_features: int) -> Any:
    """PyTorch's Linear followed by GELU (tanh form) as one module: our Linear(gelu=True)."""
    import torch

    class LinearGELU(torch.nn.Linear):
        def forward(self, x: Any) -> Any:
            return torch.nn.functional.gelu(super().forward(x), approximate="tanh")
    return LinearGELU(in_features, out_features)


def report(ours: Dict[str, Any], theirs: Dict[str, Any]) -> None:
    a, b = np.array(ours["losses"]), np.array(theirs["losses"])
    gap = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
    t_ours = float(np.median(ours["times"][WARM:] or ours["times"]))
    t_torch = float(np.median(theirs["times"][WARM:] or theirs["times"]))
    print(f"final loss: ours {a[-1]:.6f}, PyTorch {b[-1]:.6f} (relative gap {gap[-1]:.2e}); "
          f"largest relative gap of the curves {gap.max():.2e} (step {int(gap.argmax()) + 1})")
    print(f"step time (median after {WARM}): ours {1e3 * t_ours:.3f} ms, PyTorch "
          f"{1e3 * t_torch:.3f} ms: PyTorch / ours = {t_torch / t_ours:.2f}x")
    if theirs["peak"]:
        print(f"peak device memory: ours {ours['peak'] / 2**20:.1f} MiB, PyTorch "
              f"{theirs['peak'] / 2**20:.1f} MiB: ours / PyTorch = "
              f"{ours['peak'] / theirs['peak']:.2f}")


# -- the MLP --------------------------------------------------------------------------------------
def build(features: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden, gelu=True), nn.Linear(hidden, classes))


def torch_build(features: int, hidden: int, classes: int) -> Any:
    import torch
    return torch.nn.Sequential(torch_linear_gelu(features, hidden),
                               torch.nn.Linear(hidden, classes))


def make_batches(features: int, classes: int, batch: int, seed: int) -> Callable:
    """batch(step) -> (x float32 (batch, features), labels int64): a teacher's argmax."""
    teacher = np.random.default_rng(seed + 1).standard_normal((features, classes))

    def get(step: int) -> Sequence[np.ndarray]:
        x = np.random.default_rng((seed, step)).standard_normal((batch, features))
        return x.astype(np.float32), np.argmax(x @ teacher, axis=1).astype(np.int64)
    return get


def main(argv: Sequence[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, lr=0.05)
    p.add_argument("--batch", type=int, default=None, help="samples per step (device batch)")
    p.add_argument("--features", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--classes", type=int, default=None)
    args = p.parse_args(argv)
    big = gpu()
    batch = args.batch or 32
    features = args.features or (1024 if big else 64)
    hidden = args.hidden or (4096 if big else 128)
    classes = args.classes or (1024 if big else 10)
    print(f"MLP {features} -> {hidden} (GELU) -> {classes}, batch {batch}, {args.dtype}, "
          f"{'GPU' if big else 'fallback mode (NumPy)'}{', CUDA graph' if args.graph else ''}")
    nn.manual_seed(args.seed)
    model = build(features, hidden, classes)
    batches = make_batches(features, classes, batch, args.seed)
    if args.compare:
        import torch
        device = torch_device()
        tmodel = load_into_torch(torch_build(features, hidden, classes), model, device)
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
