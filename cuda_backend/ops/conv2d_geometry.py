"""The geometry of one 2-D convolution: `Geometry` (PyTorch's N C H W, K C/g R S, N K P Q) and
`plan`, which checks the shapes against a ConvolutionConfig and computes the output size
(the precision names conv2d and its gradients accept: `common.normalize_precision`). Shared by
ops/conv2d.py, its launch and plan modules, and ops/conv2d_backward.py; no kernel here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..errors import InvalidArgumentError, ShapeMismatchError


# -- geometry -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """Validated sizes of one convolution (PyTorch's names: N C H W, K C/g R S, N K P Q)."""

    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    groups: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    P: int
    Q: int

    @property
    def Cg(self) -> int:
        return self.C // self.groups

    @property
    def Kg(self) -> int:
        return self.K // self.groups

    @property
    def M(self) -> int:
        return self.N * self.P * self.Q

    @property
    def out_shape(self) -> Tuple[int, int, int, int]:
        return (self.N, self.K, self.P, self.Q)

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.Cg * self.R * self.S


def _config_fields(config: Any) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int],
                                         Tuple[int, int], int]:
    try:
        return (tuple(config.kernel_size), tuple(config.stride), tuple(config.padding),
                tuple(config.dilation), config.groups)
    except (AttributeError, TypeError):
        raise InvalidArgumentError(
            f"config must be a ConvolutionConfig, got {type(config).__name__}") from None


def plan(x_shape: Tuple[int, ...], w_shape: Tuple[int, ...], config: Any,
         bias_shape: Optional[Tuple[int, ...]] = None) -> Geometry:
    """Check shapes against the config and compute the output size (PyTorch's rules)."""
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if len(x_shape) != 4:
        raise InvalidArgumentError(
            f"conv2d input must be 4-D (N, C, H, W), got shape {x_shape}")
    if len(w_shape) != 4:
        raise InvalidArgumentError(
            f"conv2d kernel must be 4-D (K, C/groups, R, S), got shape {w_shape}")
    ksize, stride, padding, dilation, groups = _config_fields(config)
    N, C, H, W = x_shape
    K, Cg, R, S = w_shape
    if (R, S) != ksize:
        raise ShapeMismatchError(
            f"conv2d kernel of shape {w_shape} has spatial size {(R, S)}, but "
            f"config.kernel_size is {ksize}")
    if C % groups or K % groups:
        raise InvalidArgumentError(
            f"groups={groups} must divide both the input channels ({C}, input shape "
            f"{x_shape}) and the output channels ({K}, kernel shape {w_shape})")
    if Cg * groups != C:
        raise ShapeMismatchError(
            f"conv2d channel mismatch: input of shape {x_shape} has {C} channels, but the "
            f"kernel of shape {w_shape} expects {Cg} x groups={groups} = {Cg * groups}")
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    eff = (dh * (R - 1) + 1, dw * (S - 1) + 1)
    if ph > eff[0] or pw > eff[1]:
        raise InvalidArgumentError(
            f"conv2d padding {padding} is larger than the kernel {ksize} (dilated extent "
            f"{eff}); input shape {x_shape}")
    P = (H + 2 * ph - eff[0]) // sh + 1
    Q = (W + 2 * pw - eff[1]) // sw + 1
    if P <= 0 or Q <= 0:
        raise InvalidArgumentError(
            f"conv2d output size {(P, Q)} is not positive: input {x_shape} (H, W = {(H, W)}), "
            f"padding {padding}, kernel {ksize} with dilation {dilation} (extent {eff}), "
            f"stride {stride}")
    if bias_shape is not None and tuple(bias_shape) != (K,):
        raise ShapeMismatchError(
            f"conv2d bias must have shape ({K},) for a kernel of shape {w_shape}, got "
            f"{tuple(bias_shape)}")
    return Geometry(N, C, H, W, K, R, S, groups, sh, sw, ph, pw, dh, dw, P, Q)
