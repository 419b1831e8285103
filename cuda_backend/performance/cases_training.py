"""The training family: one training step (zero_grad, forward, backward, optimizer step) of
the examples' three models (examples/train_mlp.py, train_cnn.py, train_gpt.py), built with
`cuda_backend.nn`, `autograd` and `optim`, timed against the same model in PyTorch eager,
loaded from the same initial weights, fed the same batch, with the same optimizer.

Rows (batch = the case's size; on a GPU the sizes below, in fallback mode the examples'
small ones, so `report --quick` stays well under a minute on two cores):

    train_mlp  1024 -> 4096 (Linear+GELU fused) -> 1024 classes, batch 32, SGD momentum 0.9
    train_cnn  3x32x32: conv 32, batch norm, ReLU, max pool; conv 64, batch norm, ReLU,
               avg pool; linear -> 10 classes, batch 64, SGD momentum 0.9
    train_gpt  4 blocks, width 256, 4 heads, seq 256, 128 tokens, batch 16, AdamW

Every call is one step on the same batch (no host read-back: the loss stays on the device).
The accuracy check runs on the first step, in float64 NumPy from the initial weights: the
loss against a float64 forward (`reference_loss`); the gradients with one central
difference of that forward along each parameter tensor's own gradient direction g/|g| (the
exact directional derivative is then the sum of the tensors' gradient norms, so every tensor
counts, by its norm, and no PyTorch is needed); the optimizer step element by element
against its formula. FLOPs are three times the forward's GEMM, convolution and attention
FLOPs (the backward ~ twice the forward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .cases import Case, Context, Prepared
from .cases_ml_forward import (attention, conv2d_nchw, cross_entropy_loss, gelu_tanh,
                               layer_norm, pool2x2)

FAMILY = "training"
U32 = 2.0**-24           # float32 unit roundoff
FD_STEP = 1e-6           # the central difference's step along each unit direction
UPDATE_SLACK = 16        # ulps of the update the fused optimizer kernels may be off by
BN_EPS = 1e-5
SEED = 0
REFERENCE = ("float64 NumPy from the initial weights: the loss, a central difference along "
             "each parameter's gradient, the optimizer's formula")

Params = Dict[str, np.ndarray]


@dataclass(frozen=True)
class Model:
    """One training row: how to build the model (ours and PyTorch's), its batch, its loss
    (ours, PyTorch's, float64 NumPy) and its optimizer."""

    op: str
    variant: str
    batch: int
    build: Callable[[], Any]                          # () -> nn.Module
    torch_build: Callable[[Any], Any]                 # (torch) -> torch.nn.Module
    data: Callable[[np.random.Generator], List[np.ndarray]]
    loss: Callable[[Any, List[Any]], Any]             # (model, device tensors) -> loss Tensor
    torch_loss: Callable[[Any, Any, List[Any]], Any]  # (torch, model, tensors) -> loss
    reference: Callable[[Params, List[np.ndarray]], float]   # float64 loss
    optimizer: str                                    # "sgd" (momentum 0.9) or "adamw"
    lr: float
    flops: float                                      # one step: 3x the forward's
    sum_length: int     # the forward's summation lengths added up, layer by layer


# -- float64 NumPy pieces ---------------------------------------------------------------
def _linear(x: np.ndarray, w: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
    y = x @ w.T
    return y if b is None else y + b


def _batch_norm_train(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Batch statistics over (N, H, W), biased variance (PyTorch's training forward)."""
    mu = x.mean(axis=(0, 2, 3), keepdims=True)
    var = ((x - mu) ** 2).mean(axis=(0, 2, 3), keepdims=True)
    sh = (1, -1, 1, 1)
    return (x - mu) / np.sqrt(var + BN_EPS) * gamma.reshape(sh) + beta.reshape(sh)


def _labels(rng: np.random.Generator, classes: int, shape: Any) -> np.ndarray:
    return rng.integers(0, classes, shape).astype(np.int64)


def classifier_loss(model: Any, ts: List[Any]) -> Any:
    """Ours: the mean cross-entropy of model(inputs) against the labels (ts: inputs, labels;
    no label read-back)."""
    from .. import nn
    from ..autograd import Tensor
    return nn.cross_entropy(model(Tensor(ts[0])), ts[1], check_labels=False)


def torch_classifier_loss(T: Any, model: Any, ts: List[Any]) -> Any:
    """PyTorch's: the same loss."""
    return T.nn.functional.cross_entropy(model(ts[0]), ts[1])


# -- the MLP ------------------------------------------------------------------------------
def mlp(gpu: bool) -> Model:
    """features -> hidden (GELU) -> classes, batch 32: examples/train_mlp.py."""
    features, hidden, classes = (1024, 4096, 1024) if gpu else (64, 128, 10)
    batch = 32

    def build() -> Any:
        from .. import nn
        return nn.Sequential(nn.Linear(features, hidden, gelu=True),
                             nn.Linear(hidden, classes))

    def torch_build(T: Any) -> Any:
        from .cases_training_gpt import torch_linear_gelu
        return T.nn.Sequential(torch_linear_gelu(T, features, hidden),
                               T.nn.Linear(hidden, classes))

    def data(rng: np.random.Generator) -> List[np.ndarray]:
        return [rng.standard_normal((batch, features), dtype=np.float32),
                _labels(rng, classes, batch)]

    def reference(p: Params, arrays: List[np.ndarray]) -> float:
        h = gelu_tanh(np, _linear(arrays[0], p["0.weight"], p["0.bias"]))
        return float(cross_entropy_loss(np, _linear(h, p["1.weight"], p["1.bias"]),
                                        arrays[1]))

    return Model("train_mlp", f"{features}-{hidden}-{classes}", batch, build, torch_build,
                 data, classifier_loss, torch_classifier_loss, reference, "sgd", 0.05,
                 3 * 2.0 * batch * (features * hidden + hidden * classes),
                 features + hidden + classes + batch)


# -- the CNN ------------------------------------------------------------------------------
def cnn(gpu: bool) -> Model:
    """Two blocks of conv 3x3 -> batch norm -> ReLU -> 2x2 pool (max, then average), then a
    linear classifier: examples/train_cnn.py."""
    channels, classes = 3, 10
    batch, size, width = (64, 32, 32) if gpu else (16, 12, 8)
    flat = 2 * width * (size // 4) ** 2

    def layers(lib: Any) -> Any:
        """The model in lib, cuda_backend.nn or torch.nn (the same names and arguments)."""
        return lib.Sequential(
            lib.Conv2d(channels, width, 3, padding=1), lib.BatchNorm2d(width), lib.ReLU(),
            lib.MaxPool2d(2),
            lib.Conv2d(width, 2 * width, 3, padding=1), lib.BatchNorm2d(2 * width), lib.ReLU(),
            lib.AvgPool2d(2),
            lib.Flatten(), lib.Linear(flat, classes))

    def build() -> Any:
        from .. import nn
        return layers(nn)

    def torch_build(T: Any) -> Any:
        return layers(T.nn)

    def data(rng: np.random.Generator) -> List[np.ndarray]:
        return [rng.standard_normal((batch, channels, size, size), dtype=np.float32),
                _labels(rng, classes, batch)]

    def block(p: Params, x: np.ndarray, conv: int, pool: str) -> np.ndarray:
        y = conv2d_nchw(np, x, p[f"{conv}.weight"]) + p[f"{conv}.bias"].reshape(1, -1, 1, 1)
        y = _batch_norm_train(y, p[f"{conv + 1}.weight"], p[f"{conv + 1}.bias"])
        return pool2x2(np.maximum(y, 0.0), pool)

    def reference(p: Params, arrays: List[np.ndarray]) -> float:
        x = block(p, block(p, arrays[0], 0, "max"), 4, "mean")
        logits = _linear(x.reshape(batch, -1), p["9.weight"], p["9.bias"])
        return float(cross_entropy_loss(np, logits, arrays[1]))

    half = size // 2
    conv_flops = 2.0 * batch * 9 * (size * size * channels * width
                                    + half * half * width * 2 * width)
    return Model("train_cnn", f"{channels}x{size}x{size} w{width}", batch, build, torch_build,
                 data, classifier_loss, torch_classifier_loss, reference, "sgd", 0.05,
                 3 * (conv_flops + 2.0 * batch * flat * classes),
                 9 * channels + batch * size * size + 9 * width + batch * half * half
                 + flat + classes + batch)


# -- the GPT ------------------------------------------------------------------------------
def gpt(gpu: bool) -> Model:
    """Token and position embeddings, pre-norm blocks of causal self-attention and a
    Linear+GELU -> Linear MLP, a final layer norm and a linear head; AdamW:
    examples/train_gpt.py (random tokens of a 128-symbol vocabulary)."""
    batch, seq, dim, heads, layers = (16, 256, 256, 4, 4) if gpu else (8, 32, 32, 4, 2)
    vocab = 128

    def build() -> Any:
        from .cases_training_gpt import GPT
        return GPT(vocab, seq, dim, heads, layers)

    def torch_build(T: Any) -> Any:
        from .cases_training_gpt import torch_gpt
        return torch_gpt(T, vocab, seq, dim, heads, layers)

    def data(rng: np.random.Generator) -> List[np.ndarray]:
        return [_labels(rng, vocab, (batch, seq)), np.arange(seq, dtype=np.int64),
                _labels(rng, vocab, (batch, seq))]

    def loss(model: Any, ts: List[Any]) -> Any:
        from .. import nn
        return nn.cross_entropy(model(ts[0], ts[1]), ts[2], check_labels=False)

    def torch_loss(T: Any, model: Any, ts: List[Any]) -> Any:
        return T.nn.functional.cross_entropy(model(ts[0], ts[1]).flatten(0, 1),
                                             ts[2].flatten())

    def reference(p: Params, arrays: List[np.ndarray]) -> float:
        ids, pos, targets = arrays
        x = p["tok.weight"][ids] + p["pos.weight"][pos]
        hd = dim // heads
        for i in range(layers):
            b = f"blocks.{i}."
            a = layer_norm(np, x, p[b + "ln1.weight"], p[b + "ln1.bias"])
            qkv = _linear(a, p[b + "attn.qkv.weight"], p[b + "attn.qkv.bias"])
            q, k, v = qkv.reshape(batch, seq, 3, heads, hd).transpose(2, 0, 3, 1, 4)
            y = attention(np, q, k, v, causal=True).transpose(0, 2, 1, 3)
            x = x + _linear(y.reshape(batch, seq, dim), p[b + "attn.proj.weight"],
                            p[b + "attn.proj.bias"])
            a = layer_norm(np, x, p[b + "ln2.weight"], p[b + "ln2.bias"])
            h = gelu_tanh(np, _linear(a, p[b + "fc.weight"], p[b + "fc.bias"]))
            x = x + _linear(h, p[b + "proj.weight"], p[b + "proj.bias"])
        logits = _linear(layer_norm(np, x, p["ln_f.weight"], p["ln_f.bias"]),
                         p["head.weight"], None)
        return float(cross_entropy_loss(np, logits.reshape(-1, vocab), targets.reshape(-1)))

    tokens = batch * seq
    forward = (2.0 * tokens * layers * 12 * dim * dim           # qkv, proj, fc, proj
               + 2.0 * batch * heads * seq * seq * (dim // heads) * layers   # causal QK^T, PV
               + 2.0 * tokens * dim * vocab)                    # the head
    return Model("train_gpt", f"{layers}x{dim} seq{seq}", batch, build, torch_build, data,
                 loss, torch_loss, reference, "adamw", 3e-3, 3 * forward,
                 layers * (2 * 2 * dim + dim + dim // heads + 2 * seq + dim + dim + 4 * dim)
                 + 2 * dim + dim + vocab + tokens)


MODELS: Tuple[Callable[[bool], Model], ...] = (mlp, cnn, gpt)


# -- one row: our step, its check, PyTorch's step -----------------------------------------
class TrainingStep:
    """A model, its optimizer and one batch on the device, drawn from `seed` (nn's generator
    is reseeded with it); `step()` runs one training step, `verify()` checks the first one,
    `torch_step(torch, device)` builds PyTorch's from the same initial weights and batch."""

    def __init__(self, model: Model, seed: int = SEED) -> None:
        from .. import nn, optim
        from ..autograd import apis
        self.spec = model
        self.m = apis()[0]
        nn.manual_seed(seed)
        self.module = model.build()
        self.batch = model.data(np.random.default_rng(seed))
        self.inputs = [self.m.from_numpy(a) for a in self.batch]
        self.initial = self.module.state_dict()
        self.names = [n for n, _ in self.module.named_parameters()]
        params = self.module.parameters()
        self.opt: Any = (optim.SGD(params, model.lr, momentum=0.9) if model.optimizer == "sgd"
                    else optim.AdamW(params, model.lr))
        self.loss: Any = None
        self.steps = 0

    def step(self) -> Any:
        """zero_grad, forward, backward, optimizer step; returns the loss Tensor (on the
        device: reading it back is left to the caller)."""
        self.opt.zero_grad()
        loss = self.spec.loss(self.module, self.inputs)
        loss.backward()
        self.opt.step()
        self.loss = loss
        self.steps += 1
        return loss

    def reference_loss(self, params: Optional[Params] = None) -> float:
        """The float64 loss of the batch at params (default: the initial weights)."""
        p = params if params is not None else {
            k: v.astype(np.float64) for k, v in self.initial.items()}
        return self.spec.reference(p, [a if a.dtype.kind != "f" else a.astype(np.float64)
                                       for a in self.batch])

    def verify(self) -> Tuple[float, float, Optional[str]]:
        """(abs, rel, message) of the first step: the larger relative error of the loss and
        of the gradients' directional derivative; a message if the optimizer's update is off
        by more than its rounding allows, or if the step was not the first."""
        if self.steps != 1 or self.loss is None:
            return float("inf"), float("inf"), (
                f"verify() checks the first step from the initial weights; {self.steps} "
                f"steps have run")
        p0 = {k: v.astype(np.float64) for k, v in self.initial.items()}
        ref = self.reference_loss(p0)
        loss = float(self.loss.item())
        loss_abs = abs(loss - ref)
        loss_rel = loss_abs / abs(ref) if ref else loss_abs
        params = dict(self.module.named_parameters())
        grads = {n: self.m.to_numpy(params[n].grad).astype(np.float64) for n in self.names
                 if params[n].grad is not None}
        norms = {n: float(np.linalg.norm(g)) for n, g in grads.items()}
        dirs = {n: g / norms[n] for n, g in grads.items() if norms[n] > 0}
        ours = sum(norms[n] for n in dirs)

        def moved(sign: float) -> float:
            p = dict(p0)
            for n, d in dirs.items():
                p[n] = p0[n] + sign * FD_STEP * d
            return self.reference_loss(p)
        fd = (moved(1.0) - moved(-1.0)) / (2 * FD_STEP)
        grad_abs = abs(ours - fd)
        grad_rel = grad_abs / abs(fd) if fd else grad_abs
        msg = self._check_update(p0, grads, params)
        if grad_rel > loss_rel:
            return grad_abs, grad_rel, msg
        return loss_abs, loss_rel, msg

    def _check_update(self, p0: Params, grads: Params, params: Dict[str, Any]) -> Optional[str]:
        """The first optimizer step against its formula: SGD (momentum buffer = g on the
        first step) p - lr g; AdamW (bias-corrected moments g and g^2) p (1 - lr wd) -
        lr g / (|g| + eps). Bound per element: three roundings of |p| (the decay factor, the
        product with it, the final subtraction) plus UPDATE_SLACK roundings of the update
        (its float32 scalars and its few operations, none of them cancelling)."""
        lr = self.spec.lr
        bad, total, worst = 0, 0, ""
        for n in self.names:
            g = grads.get(n)
            if g is None:
                continue
            if self.spec.optimizer == "sgd":
                base, delta = p0[n], -lr * g
            else:
                base = p0[n] * (1.0 - lr * self.opt.weight_decay)
                delta = -lr * g / (np.abs(g) + self.opt.eps)
            want = base + delta
            got = self.m.to_numpy(params[n].data).astype(np.float64)
            err = np.abs(got - want)
            bound = 3 * U32 * np.maximum(np.abs(p0[n]), np.abs(want)) \
                + UPDATE_SLACK * U32 * np.abs(delta) + 1e-30
            over = int(np.count_nonzero(err > bound))
            if over:
                i = int(np.argmax(err / bound))
                worst = worst or (f"{n}[{i}]: {got.ravel()[i]!r}, expected "
                                  f"{want.ravel()[i]!r}")
            bad += over
            total += err.size
        if bad:
            return (f"the {self.spec.optimizer} step is off by more than its rounding allows "
                    f"at {bad} of {total} parameter values (first: {worst})")
        return None

    def torch_step(self, T: Any, device: Any) -> Callable[[], Any]:
        """PyTorch's training step: the same model on device from our initial weights and
        buffers, the same batch, the same optimizer (eager; true float32 where the caller
        turns TF32 off)."""
        tmodel = self.spec.torch_build(T)
        state = {k: T.from_numpy(np.array(v)) for k, v in self.initial.items()}
        res = tmodel.load_state_dict(state, strict=False)
        missing = [k for k in res.missing_keys if not k.endswith("num_batches_tracked")]
        if missing or res.unexpected_keys:
            raise ValueError(f"the PyTorch model does not mirror ours: missing {missing}, "
                             f"unexpected {list(res.unexpected_keys)}")
        tmodel = tmodel.to(device).train()
        data = [T.from_numpy(np.ascontiguousarray(a)).to(device) for a in self.batch]
        if self.spec.optimizer == "sgd":
            topt = T.optim.SGD(tmodel.parameters(), self.spec.lr, momentum=0.9)
        else:
            topt = T.optim.AdamW(tmodel.parameters(), self.spec.lr)
        loss_fn = self.spec.torch_loss

        def step() -> Any:
            topt.zero_grad(set_to_none=True)
            loss = loss_fn(T, tmodel, data)
            loss.backward()
            topt.step()
            return loss
        return step

    def free(self) -> None:
        """Give the parameters, gradients, optimizer buffers and inputs back to the pool."""
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.free()
            p.grad = None
            p.data.free()
        for _, b in self.module.named_buffers():
            b.free()
        for _, bufs in self.opt.state.values():
            for b in (bufs if isinstance(bufs, tuple) else (bufs,)):
                if b is not None:
                    b.free()
        self.opt.state.clear()
        for t in self.inputs:
            t.free()
        self.loss = None


def loss_curves(model: Model, T: Any, device: Any, steps: int = 3) -> List[Tuple[float, float]]:
    """(our loss, PyTorch's loss) at each of `steps` training steps on the row's batch, both
    from the same initial weights (PyTorch on device, TF32 off)."""
    row = TrainingStep(model)
    try:
        tf32 = (T.backends.cuda.matmul.allow_tf32, T.backends.cudnn.allow_tf32)
        T.backends.cuda.matmul.allow_tf32 = T.backends.cudnn.allow_tf32 = False
        try:
            theirs = row.torch_step(T, device)
            return [(row.step().item(), float(theirs().item())) for _ in range(steps)]
        finally:
            T.backends.cuda.matmul.allow_tf32, T.backends.cudnn.allow_tf32 = tf32
    finally:
        row.free()


def _build(model: Model) -> Callable[[Context], Prepared]:
    def build(ctx: Context) -> Prepared:
        row = TrainingStep(model)
        prep = Prepared(call=row.step, host_inputs=list(row.batch), verify=row.verify,
                        flops=model.flops, mode="step", cleanup=[row.free],
                        verify_reference=REFERENCE)
        dev = ctx.device_id
        prep.peer_factories = {"torch": lambda T: row.torch_step(T, f"cuda:{dev}")}
        prep.notes.append(f"one step per call on one batch; {model.optimizer}; the PyTorch "
                          f"peer is the same model in eager mode from the same weights")
        return prep
    return build


def training_cases(gpu: bool, unavailable: Optional[str] = None) -> List[Case]:
    """The training rows: the GPU sizes on a GPU, the examples' small ones in fallback mode;
    skipped, with `unavailable` as the reason, when the nn stack cannot be loaded."""
    cases = []
    for make in MODELS:
        model = make(gpu)
        cases.append(Case(FAMILY, model.op, "nn", model.variant, "float32", model.batch,
                          _build(model), compute_unit="fp32", skip_reason=unavailable))
    return cases
