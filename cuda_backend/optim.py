"""Optimizers over parameters: SGD, Adam and AdamW on the fused `CudaML.sgd_update` /
`adam_update` kernels (one launch per parameter, in place), and a loss scaler for float16.

    opt = optim.AdamW(model.parameters(), lr=3e-4)
    opt.zero_grad(); loss.backward(); opt.step()

Each parameter keeps its own `OptimizerState` and buffers (float32 for float32, float16 and
bfloat16 parameters) and its own step count, as PyTorch's (a parameter without a gradient
in a step does not advance). The counts live on the device: one int32 tensor per device
(`counts`), one element per parameter, each parameter's `OptimizerState.step_count` a view
of its element. step() advances the counts of the parameters it updates in one launch
(one per run of consecutive parameters when some have no gradient), then the update
kernels read them (ops/optimizers.py): SGD's first step and Adam's bias corrections follow
the device's count, so step() can be recorded into a CUDA graph and replayed
(`capturable`, PyTorch's `capturable=True`; the graph keeps the learning rate it recorded);
`CapturedStep` records a whole training step.
Semantics are PyTorch's: SGD's momentum buffer starts as the first gradient; Adam adds
weight decay to the gradient, AdamW decays the weights. `state_dict` / `save` / `load`
carry the step counts and the buffers.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .autograd import Tensor, apis, capturing
from .cuda_ml import OptimizerState
from .errors import GraphCaptureError, InvalidArgumentError, ShapeMismatchError
from .ops.optimizers import STEP_DTYPE, advance_steps, state_dtype
from .ops.shape_layouts import make_view
from .tensor import CudaTensor


class Optimizer:
    """Parameters (Tensors with requires_grad) and their per-parameter state and step count."""

    capturable = False
    buffer_names: Tuple[str, ...] = ()   # the state_dict names of a parameter's buffers

    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.params: List[Tensor] = list(params)
        if not self.params:
            raise InvalidArgumentError("the optimizer got an empty parameter list")
        for p in self.params:
            if not isinstance(p, Tensor) or not p.requires_grad:
                raise InvalidArgumentError(
                    f"optimizers update Tensors with requires_grad=True (nn.Parameter), got "
                    f"{p!r}")
        if not lr >= 0.0:
            raise InvalidArgumentError(f"learning rate must be >= 0, got {lr!r}")
        self.lr = float(lr)
        self.state: Dict[int, Tuple[OptimizerState, Any]] = {}
        # the step counts: per device, one int32 per parameter on it (slot: id -> place)
        m = apis()[0]
        self.slots: Dict[int, Tuple[int, int]] = {}
        sizes: Dict[int, int] = {}
        for p in self.params:
            dev = p.data.device_id
            self.slots[id(p)] = (dev, sizes.get(dev, 0))
            sizes[dev] = sizes.get(dev, 0) + 1
        self.counts: Dict[int, CudaTensor] = {
            dev: m.zeros((k,), STEP_DTYPE, dev) for dev, k in sizes.items()}
        self._runs: Dict[Tuple[int, ...], List[CudaTensor]] = {}

    def zero_grad(self) -> None:
        """Drop the gradients (the next backward() assigns fresh ones)."""
        for p in self.params:
            p.grad = None

    def _buffer(self, p: Tensor) -> Any:
        m = apis()[0]
        return m.zeros(p.shape, state_dtype(p.dtype), p.data.device_id)

    def step(self) -> None:
        """One update of every parameter that has a gradient: their step counts advanced on
        the device, then one fused launch per parameter."""
        todo = [p for p in self.params if p.grad is not None]
        if not todo:
            return
        for p in todo:
            if id(p) not in self.state:
                self._start(p)
        for counts in self._count_runs(todo):
            advance_steps(apis()[0], counts)
        for p in todo:
            entry = self.state[id(p)]
            entry[0].learning_rate = self.lr
            self._update(p, *entry)

    def _start(self, p: Tensor) -> Tuple[OptimizerState, Any]:
        """The state of a parameter's first update: buffers made, its count attached."""
        dev, k = self.slots[id(p)]
        if capturing(dev):
            raise GraphCaptureError(
                "optimizer.step() makes a parameter's buffers on its first update, which a "
                "CUDA graph cannot record: take one eager step() (or load_state_dict) before "
                "capturing")
        entry = self._init_state(p)
        entry[0].step_count = make_view(self.counts[dev], (1,), k)
        self.state[id(p)] = entry
        return entry

    def _count_runs(self, todo: List[Tensor]) -> List[CudaTensor]:
        """The step counts of `todo` as views of runs of consecutive elements (one for all
        the parameters of a device when all have gradients), memoized by the set."""
        key = tuple(id(p) for p in todo)
        runs = self._runs.get(key)
        if runs is None:
            runs = []
            places = sorted(self.slots[id(p)] for p in todo)
            start = 0
            for i in range(1, len(places) + 1):
                if i == len(places) or places[i] != (places[i - 1][0], places[i - 1][1] + 1):
                    dev, first = places[start]
                    runs.append(make_view(self.counts[dev], (i - start,), first))
                    start = i
            if len(self._runs) >= 64:
                self._runs.clear()
            self._runs[key] = runs
        return runs

    def steps(self, p: Tensor) -> int:
        """The steps p has taken (its device count, read back)."""
        dev, k = self._slot(p)
        return int(apis()[0].to_numpy(self.counts[dev])[k])

    def _slot(self, p: Tensor) -> Tuple[int, int]:
        place = self.slots.get(id(p))
        if place is None:
            raise InvalidArgumentError(f"{p!r} is not a parameter of this optimizer")
        return place

    # -- state
    def _buffers(self, entry: Tuple[OptimizerState, Any]) -> Tuple[Optional[CudaTensor], ...]:
        """A state entry's buffers, in the order of buffer_names."""
        return ()

    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """The state of every parameter updated so far, as host arrays by PyTorch-style name:
        "state.<i>.step" (int64, the device count) and "state.<i>.<buffer>" (buffer_names),
        i the parameter's index. Hyper-parameters are the constructor's (not included)."""
        m = apis()[0]
        counts = {dev: m.to_numpy(c) for dev, c in self.counts.items()}
        out: "OrderedDict[str, np.ndarray]" = OrderedDict()
        for i, p in enumerate(self.params):
            entry = self.state.get(id(p))
            if entry is None:
                continue
            dev, k = self.slots[id(p)]
            out[f"state.{i}.step"] = np.asarray(counts[dev][k], np.int64)
            for name, buf in zip(self.buffer_names, self._buffers(entry)):
                if buf is not None:
                    out[f"state.{i}.{name}"] = m.to_numpy(buf)
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Copy a state_dict() into this optimizer (same parameters, same order): the step
        counts and buffers of the parameters it names; every entry is checked before any is
        copied. Names it does not know, an entry without its step or a buffer, or a buffer
        of the wrong shape raise."""
        m = apis()[0]
        entries: Dict[int, Dict[str, np.ndarray]] = {}
        for key, value in state.items():
            hit = re.fullmatch(r"state\.(\d+)\.(\w+)", key)
            names = ("step",) + self.buffer_names
            if hit is None or int(hit.group(1)) >= len(self.params) or \
                    hit.group(2) not in names:
                raise InvalidArgumentError(
                    f"load_state_dict: unexpected key {key!r}; expected 'state.<i>.<name>' with "
                    f"i < {len(self.params)} and name in {names}")
            entries.setdefault(int(hit.group(1)), {})[hit.group(2)] = np.asarray(value)
        for i, got in sorted(entries.items()):
            p = self.params[i]
            step = got.get("step")
            if step is None or step.size != 1 or not np.isfinite(step).all() or \
                    float(step.reshape(-1)[0]) != int(step.reshape(-1)[0]) or \
                    not 0 <= int(step.reshape(-1)[0]) < 2**31:
                raise InvalidArgumentError(
                    f"load_state_dict: state.{i}.step must be one integer in [0, 2**31), got "
                    f"{None if step is None else step.tolist()!r}")
            want = self._wanted_buffers(p)
            missing = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want) - {"step"})
            if missing or extra:
                raise InvalidArgumentError(
                    f"load_state_dict: parameter {i} needs buffers {list(want)}; missing "
                    f"{missing}, unexpected {extra}")
            for name in want:
                if got[name].shape != p.shape:
                    raise ShapeMismatchError(
                        f"load_state_dict: state.{i}.{name} has shape {got[name].shape}, the "
                        f"parameter {p.shape}")
        for i, got in sorted(entries.items()):
            p = self.params[i]
            entry = self.state.get(id(p)) or self._start(p)
            for name, buf in zip(self.buffer_names, self._buffers(entry)):
                if buf is not None:
                    m.backend.copy_to_device(
                        np.ascontiguousarray(got[name], buf.dtype.numpy_dtype), buf)
            step = np.array([int(got["step"].reshape(-1)[0])], STEP_DTYPE.numpy_dtype)
            count = entry[0].step_count
            assert count is not None    # (_start attaches it)
            m.backend.copy_to_device(step, count)

    def _wanted_buffers(self, p: Tensor) -> Tuple[str, ...]:
        """The buffer names a state entry of p has."""
        return self.buffer_names

    def save(self, path: str) -> None:
        """state_dict() to an .npz file."""
        state: Dict[str, Any] = self.state_dict()   # (Any: savez's stubs type its options)
        np.savez(path, **state)

    def load(self, path: str) -> None:
        """load_state_dict() from an .npz file of save()."""
        with np.load(path) as f:
            self.load_state_dict({k: f[k] for k in f.files})

    def _init_state(self, p: Tensor) -> Tuple[OptimizerState, Any]:
        raise NotImplementedError

    def _update(self, p: Tensor, st: OptimizerState, buffers: Any) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """p -= lr * (g + wd p), through a momentum buffer when momentum > 0 (Nesterov optional)."""

    capturable = True
    buffer_names = ("momentum_buffer",)

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, lr)
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.nesterov = bool(nesterov)

    def _init_state(self, p: Tensor) -> Tuple[OptimizerState, Any]:
        st = OptimizerState(self.lr, momentum=self.momentum, weight_decay=self.weight_decay,
                            nesterov=self.nesterov)
        return st, (self._buffer(p) if self.momentum > 0.0 else None)

    def _update(self, p: Tensor, st: OptimizerState, buf: Any) -> None:
        apis()[1].sgd_update(p.data, p.grad, buf, st)

    def _buffers(self, entry: Tuple[OptimizerState, Any]) -> Tuple[Optional[CudaTensor], ...]:
        return (entry[1],)

    def _wanted_buffers(self, p: Tensor) -> Tuple[str, ...]:
        return self.buffer_names if self.momentum > 0.0 else ()


class Adam(Optimizer):
    """Adam with bias correction; weight_decay adds wd * p to the gradient."""

    capturable = True
    buffer_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def _init_state(self, p: Tensor) -> Tuple[OptimizerState, Any]:
        st = OptimizerState(self.lr, beta1=self.betas[0], beta2=self.betas[1],
                            epsilon=self.eps, weight_decay=self.weight_decay,
                            decoupled=self.decoupled)
        return st, (self._buffer(p), self._buffer(p))

    def _update(self, p: Tensor, st: OptimizerState, bufs: Any) -> None:
        apis()[1].adam_update(p.data, p.grad, bufs[0], bufs[1], st)

    def _buffers(self, entry: Tuple[OptimizerState, Any]) -> Tuple[Optional[CudaTensor], ...]:
        return tuple(entry[1])


class AdamW(Adam):
    """Adam with decoupled weight decay: p *= 1 - lr * wd before the Adam step."""

    decoupled = True

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)


class LossScaler:
    """Dynamic loss scaling for float16 training: backward() of `scale(loss)`, then `step(opt)`
    unscales the gradients, skips the update (and halves the scale) when one is not finite,
    and doubles the scale after `growth_interval` finite steps. The finiteness check reads one
    number per parameter back from the device, so this step is not capturable."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale_value = float(init_scale)
        self.growth_interval = int(growth_interval)
        self._good = 0

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.scale_value

    def step(self, opt: Optimizer) -> bool:
        """Unscale, check, update; returns whether the update was applied."""
        m = apis()[0]
        inv = 1.0 / self.scale_value
        finite = True
        for p in opt.params:
            if p.grad is None:
                continue
            p.grad = m.multiply(p.grad, inv)
            if finite:
                peak = m.to_numpy(m.reduce_max(m.abs(p.grad)))
                finite = bool(np.isfinite(peak).all())
        if not finite:
            self.scale_value /= 2.0
            self._good = 0
            opt.zero_grad()
            return False
        opt.step()
        self._good += 1
        if self._good >= self.growth_interval:
            self.scale_value *= 2.0
            self._good = 0
        return True



class CapturedStep:
    """A whole training step recorded once as a CUDA graph and replayed per call (GPU only).

    step_fn() runs the forward and backward and returns the loss Tensor; what it reads must
    be tensors made before the capture (copy each batch into them between calls). The first
    `warmup` calls (>= 1) run eagerly: they compile and autotune every op and make the
    optimizer's buffers. The next call captures zero_grad, step_fn and, when the optimizer is
    capturable (SGD, Adam, AdamW: their step counts live on the device), its step, then
    replays; a non-capturable optimizer steps eagerly after each replay. The graph replays
    the learning rate it recorded: a call after optimizer.lr changed raises
    GraphCaptureError (free() and call again to capture anew). Returns the loss Tensor, whose
    memory each replay rewrites.
    """

    def __init__(self, step_fn: Any, optimizer: Optimizer, warmup: int = 2) -> None:
        if warmup < 1:
            raise InvalidArgumentError(f"warmup must be >= 1 eager step, got {warmup}")
        self.step_fn, self.opt, self.warmup = step_fn, optimizer, int(warmup)
        self.calls = 0
        self.graph: Any = None
        self.loss: Any = None
        self.lr = optimizer.lr     # the learning rate the graph recorded

    def __call__(self) -> Tensor:
        opt = self.opt
        if self.graph is None:
            if self.calls < self.warmup:
                self.calls += 1
                opt.zero_grad()
                loss = self.step_fn()
                opt.step()
                return loss
            opt.zero_grad()
            with apis()[0].backend.capture() as graph:
                loss = self.step_fn()
                if opt.capturable:
                    opt.step()
            self.graph, self.loss, self.lr = graph, loss, opt.lr
        elif opt.capturable and opt.lr != self.lr:
            raise GraphCaptureError(
                f"the optimizer's learning rate changed from {self.lr!r} to {opt.lr!r} after "
                f"the capture, and the graph replays the value it recorded: free() this "
                f"CapturedStep and call it again to capture the new one")
        self.graph.replay()
        if not opt.capturable:
            opt.step()
        return self.loss

    def free(self) -> None:
        """Give the graph's memory back (the gradients it wrote go with it)."""
        if self.graph is not None:
            self.graph.free()
            self.graph = None
            self.opt.zero_grad()
