"""`LinearOps`, the part of CudaML (cuda_ml.py) built on GEMMs: the linear layers (linear,
fused_linear_gelu, sketched_linear; ops/linear.py), the GEMM gradients (linear_backward,
fused_linear_gelu_backward, matmul_backward; ops/matmul_backward.py) and flash attention with
its gradient (ops/attention.py, ops/attention_backward.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Tuple, Union

from .ops import common
from .ops.common import LazyOp
from .tensor import CudaTensor

if TYPE_CHECKING:
    from .cuda_math import CudaMath


class LinearOps:
    """CudaML's linear layers, GEMM gradients and attention (a mixin: CudaML holds `math`)."""

    math: CudaMath

    # -- layers ---------------------------------------------------------------------------
    def fused_linear_gelu(self, x: CudaTensor, weight: CudaTensor,
                          bias: Optional[CudaTensor] = None,
                          precision: Optional[str] = None) -> CudaTensor:
        """GELU(x Wᵀ + b) in one kernel; weight is (out_features, in_features). float32 is
        float32-accurate (3xTF32 on tensor cores where faster, else CUDA cores);
        precision="ieee" keeps CUDA cores, precision="tf32" uses TF32."""
        m = self.math
        if type(x) is CudaTensor and type(weight) is CudaTensor and \
                (precision is None or type(precision) is str):
            # the plan of ops/linear.py fused_linear_gelu (its key: _linear_key), looked up
            # here too so that a repeated call skips the import and a call
            b: Union[None, bool, Tuple[Tuple[int, ...], Any, int]]
            if bias is None:
                b = None
            elif type(bias) is CudaTensor:
                b = (bias.shape, bias.dtype, bias.device_id)
            else:
                b = False
            plans = getattr(m, "plans", None)
            fast = None if plans is None or b is False else plans.get(
                ("fused_linear_gelu", x.shape, weight.shape, x.dtype, weight.dtype,
                 x.device_id, weight.device_id, b, precision))
            if fast is not None and m.backend.direct_launch(x.device_id):
                res = fast(x, weight, bias)
                if res is not None:
                    return res
        from .ops import linear
        return linear.fused_linear_gelu(m, x, weight, bias, precision)

    _op_linear = LazyOp("linear", "linear")

    def linear(self, x: CudaTensor, weight: CudaTensor, bias: Optional[CudaTensor] = None,
               precision: Optional[str] = None) -> CudaTensor:
        """x Wᵀ + b in one kernel (the bias added in its store stage); weight is
        (out_features, in_features), x (..., in_features). Precision as fused_linear_gelu."""
        return self._op_linear(self.math, x, weight, bias, precision)

    # -- GEMM gradients (ops/matmul_backward.py) -------------------------------------------
    _op_linear_backward = LazyOp("matmul_backward", "linear_backward")

    def linear_backward(self, grad_out: CudaTensor, x: CudaTensor, weight: CudaTensor,
                        has_bias: bool = True, precision: Optional[str] = None) -> Any:
        """The gradients of linear(x, weight, bias): (grad_x = grad_out W, grad_weight =
        grad_outᵀ x, grad_bias = grad_out's column sums, or None with has_bias=False), no
        transposed copy. float32 as matrix_multiply (3xTF32 or CUDA cores, the faster;
        "ieee": CUDA cores only); precision="tf32" uses TF32."""
        return self._op_linear_backward(self.math, grad_out, x, weight, has_bias, precision)

    _op_fused_linear_gelu_backward = LazyOp("matmul_backward", "fused_linear_gelu_backward")

    def fused_linear_gelu_backward(self, grad_out: CudaTensor, x: CudaTensor,
                                   weight: CudaTensor, bias: Optional[CudaTensor] = None,
                                   precision: Optional[str] = None) -> Any:
        """The gradients of fused_linear_gelu(x, weight, bias): (grad_x, grad_weight,
        grad_bias or None), through dZ = grad_out * GELU'(x Wᵀ + b) from one recompute whose
        epilogue applies the derivative (no pre-activation stored)."""
        return self._op_fused_linear_gelu_backward(self.math, grad_out, x, weight, bias, precision)

    _op_matmul_backward = LazyOp("matmul_backward", "matmul_backward")

    def matmul_backward(self, grad_out: CudaTensor, a: CudaTensor, b: CudaTensor,
                        precision: Optional[str] = None) -> Any:
        """The gradients of matrix_multiply(a, b): (grad_a = grad_out bᵀ, grad_b =
        aᵀ grad_out), of a's and b's shapes (a broadcast batch summed), no transposed copy.
        float32 as matrix_multiply (3xTF32 or CUDA cores, the faster; "ieee": CUDA cores
        only); precision="tf32" uses TF32."""
        return self._op_matmul_backward(self.math, grad_out, a, b, precision)

    _op_flash_attention = LazyOp("attention", "flash_attention")

    def flash_attention(self, q: CudaTensor, k: CudaTensor, v: CudaTensor,
                        scale: Optional[float] = None, causal: bool = False,
                        return_lse: bool = False) -> Any:
        """softmax(q kᵀ · scale) v for (batch, heads, seq, head_dim), never forming seq×seq.
        return_lse=True gives (out, lse): lse float32 (batch, heads, seq_q), the natural log
        of each row's sum of exp(scale q·k) (-inf without keys), for flash_attention_backward."""
        m = self.math
        if return_lse is not False:   # ops/attention.py looks up its plan ("flash_attention_lse")
            return self._op_flash_attention(m, q, k, v, scale, causal, return_lse=return_lse)
        if type(causal) is bool and (scale is None or type(scale) is float) and \
                type(q) is CudaTensor and type(k) is CudaTensor and type(v) is CudaTensor:
            # the plan of ops/attention.py flash_attention (same key), looked up here too so
            # that a repeated call skips the import and a call
            plans = getattr(m, "plans", None)
            fast = None if plans is None else plans.get(
                ("flash_attention", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                 q.device_id, k.device_id, v.device_id, scale is None, causal))
            if fast is not None and m.backend.direct_launch(q.device_id):
                res = fast(q, k, v, scale)
                if res is not None:
                    return res
        from .ops import attention
        return attention.flash_attention(m, q, k, v, scale, causal)

    _op_flash_attention_backward = LazyOp("attention_backward", "flash_attention_backward")

    def flash_attention_backward(self, grad_out: CudaTensor, q: CudaTensor, k: CudaTensor,
                                 v: CudaTensor, out: CudaTensor, lse: CudaTensor,
                                 scale: Optional[float] = None,
                                 causal: bool = False) -> Tuple[CudaTensor, CudaTensor,
                                                                CudaTensor]:
        """(grad_q, grad_k, grad_v) of flash_attention for the gradient grad_out of its
        output, from the forward's out and lse (flash_attention(..., return_lse=True));
        scale and causal as given to the forward."""
        m = self.math
        if type(causal) is bool and (scale is None or type(scale) is float) and \
                type(q) is CudaTensor and type(k) is CudaTensor:
            # the plan of ops/attention_backward.py (its plan_key), looked up here too
            key = ("flash_attention_backward", q.shape, k.shape, q.dtype, q.device_id,
                   scale is None, causal)
            if m.backend.direct_launch(q.device_id):
                res = common.planned(m, key, grad_out, q, k, v, out, lse, scale)
                if res is not None:
                    return res
        return self._op_flash_attention_backward(m, grad_out, q, k, v, out, lse, scale, causal)

    _op_flash_attention_packed = LazyOp("attention_packed", "flash_attention_packed")

    def flash_attention_packed(self, qkv: CudaTensor, heads: int,
                               scale: Optional[float] = None, causal: bool = False,
                               return_lse: bool = False) -> Any:
        """flash_attention of the q, k, v packed in a fused projection qkv (batch, seq,
        3 * heads * head_dim), read in place (no permute copies): out (batch, seq, heads *
        head_dim); return_lse=True gives (out, lse), lse float32 (batch, heads, seq)."""
        return self._op_flash_attention_packed(self.math, qkv, heads, scale, causal, return_lse)

    _op_flash_attention_packed_backward = LazyOp("attention_packed",
                                                 "flash_attention_packed_backward")

    def flash_attention_packed_backward(self, grad_out: CudaTensor, qkv: CudaTensor,
                                        out: CudaTensor, lse: CudaTensor, heads: int,
                                        scale: Optional[float] = None,
                                        causal: bool = False) -> CudaTensor:
        """grad of qkv (batch, seq, 3 * heads * head_dim) for flash_attention_packed's output
        gradient grad_out (batch, seq, heads * head_dim), from its out and lse."""
        return self._op_flash_attention_packed_backward(self.math, grad_out, qkv, out, lse, heads,
                                                        scale, causal)

    def sketched_linear(self, x: CudaTensor, U: CudaTensor, V: CudaTensor,
                        bias: Optional[CudaTensor] = None) -> CudaTensor:
        """y = (1/num_terms) Σᵢ (x Uᵢ) Vᵢ + b, U (terms, in, rank), V (terms, rank, out)."""
        from .ops import linear
        return linear.sketched_linear(self.math, x, U, V, bias)

    def sketched_linear_params(self, in_features: int, out_features: int, num_terms: int,
                               low_rank: int, dtype: Any = "float32",
                               seed: Optional[int] = None) -> Tuple[CudaTensor, CudaTensor]:
        """Draw U, V as SKLinear(in_features, out_features, num_terms, low_rank) does
        (../shared/seeds/004_98bf96c14fc0e5d5.txt)."""
        from .ops import linear
        return linear.sketched_linear_params(self.math, in_features, out_features, num_terms,
                                             low_rank, dtype, seed)
