"""Optimizers over parameters: SGD, Adam and AdamW on the fused `CudaML.sgd_update` /
`adam_update` kernels (one launch per parameter, in place), and a loss scaler for float16.

    opt = optim.AdamW(model.parameters(), lr=3e-4)
    opt.zero_grad(); loss.backward(); opt.step()

Each parameter keeps its own `OptimizerState` (the step counter the kernels advance) and its
buffers (float32 for float32, float16 and bfloat16 parameters). Semantics are PyTorch's:
SGD's momentum buffer starts as the first gradient; Adam adds weight decay to the gradient,
AdamW decays the weights. `capturable`: whether step() can be recorded into a CUDA graph and
replayed. SGD's launches take only the hyper-parameters; Adam's take the bias corrections of
the step being taken, so a replayed Adam step would repeat the captured step's corrections:
`CapturedStep` (a whole training step as one CUDA graph) runs Adam's step() eagerly after
each replay.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import numpy as np

from .autograd import Tensor, apis
from .cuda_ml import OptimizerState
from .errors import InvalidArgumentError
from .ops.optimizers import state_dtype


class Optimizer:
    """Parameters (Tensors with requires_grad) and their per-parameter state."""

    capturable = False

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

    def zero_grad(self) -> None:
        """Drop the gradients (the next backward() assigns fresh ones)."""
        for p in self.params:
            p.grad = None

    def _buffer(self, p: Tensor) -> Any:
        m = apis()[0]
        return m.zeros(p.shape, state_dtype(p.dtype), p.data.device_id)

    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for p in self.params:
            if p.grad is None:
                continue
            entry = self.state.get(id(p))
            if entry is None:
                entry = self.state[id(p)] = self._init_state(p)
            st = entry[0]
            st.learning_rate = self.lr
            self._update(p, *entry)

    def _init_state(self, p: Tensor) -> Tuple[OptimizerState, Any]:
        raise NotImplementedError

    def _update(self, p: Tensor, st: OptimizerState, buffers: Any) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """p -= lr * (g + wd p), through a momentum buffer when momentum > 0 (Nesterov optional)."""

    capturable = True

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


class Adam(Optimizer):
    """Adam with bias correction; weight_decay adds wd * p to the gradient."""

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
    capturable, its step, then replays; a non-capturable optimizer (Adam) steps eagerly after
    each replay. Returns the loss Tensor, whose memory each replay rewrites.
    """

    def __init__(self, step_fn: Any, optimizer: Optimizer, warmup: int = 2) -> None:
        if warmup < 1:
            raise InvalidArgumentError(f"warmup must be >= 1 eager step, got {warmup}")
        self.step_fn, self.opt, self.warmup = step_fn, optimizer, int(warmup)
        self.calls = 0
        self.graph: Any = None
        self.loss: Any = None

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
            self.graph, self.loss = graph, loss
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
