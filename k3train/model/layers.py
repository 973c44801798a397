"""Basic building blocks shared by every layer: logical-axis linear maps, RMSNorm, SiTU-GLU, embeddings.

All modules are single-device code. Every parameter carries logical axis names (see
`k3train/model/axes.py`); parallel layout is decided by rule tables in `k3train/parallel`.
"""

from __future__ import annotations

from typing import Sequence

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3train.model import expert_tail
from k3train.model import remat
from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from pallas_kernels import platform
from pallas_kernels.situ_glu import op as situ_glu_op

Shape = Sequence[int]
Axes = Sequence[str]


def normal_init(std: float):
  return nnx.initializers.normal(stddev=std)


def next_params_key(rngs: nnx.Rngs) -> jax.Array:
  """The key `rngs.params()` returns, fold_in(stream key, count), with the count advanced.

  The count is replaced whole instead of through `count[...] += 1`: under a trace (the model
  built inside `eval_shape` or `jit`) that in-place form makes flax ask the traced count for its
  sharding, and jax's refusal formats a message by walking every equation traced so far — once
  per parameter, so building a model took time quadratic in its parameter count (8.2 s instead of
  1.2 s for the 592 parameters of configs/k3_h200.py on a 2-core CPU)."""
  stream = rngs.params
  count = stream.count.get_value()
  key = jax.random.fold_in(stream.key.get_value(), count)
  stream.count.set_value(count + 1)
  return key


def param(rngs: nnx.Rngs | None, init, shape: Shape, names: Axes, dtype=jnp.float32) -> nnx.Param:
  """A parameter with logical axis names attached as sharding metadata."""
  if len(shape) != len(names):
    raise ValueError(f"parameter shape {tuple(shape)} and logical axes {tuple(names)} differ in rank")
  key = next_params_key(rngs) if rngs is not None else jax.random.key(0)
  # Logical names only: the mesh layout is applied later by k3train.parallel rule tables.
  return nnx.Param(init(key, tuple(shape), dtype), out_sharding=tuple(names), eager_sharding=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def low_precision_matmul(x: jax.Array, w: jax.Array, n_in: int, dtype) -> jax.Array:
  """x · w contracting x's trailing n_in dims with w's leading n_in dims, in `dtype` (bf16) with
  fp32 accumulation; the result in `dtype`.

  The backward pass keeps the forward's precision: the cotangent is rounded to `dtype` once, the
  input gradient is a `dtype` × `dtype` matmul with fp32 accumulation and the weight gradient
  comes back in w's own dtype (fp32 master weights get an fp32-accumulated gradient). Plain
  autodiff of `dot(...).astype(dtype)` would instead feed an fp32 cotangent into both backward
  matmuls, which then run as fp32 (TF32) GEMMs after extra convert passes.
  """
  return _matmul_fwd(x, w, n_in, dtype)[0]


def _contract(a, b, a_dims, b_dims, out_dtype):
  """a · b accumulated in fp32, the result in out_dtype.

  When out_dtype is the operands' own dtype the matmul writes it directly: GPU GEMMs and the TPU
  MXU still accumulate in fp32 and round once, while asking for fp32 and converting afterwards
  makes the GEMM write twice the bytes and adds a convert pass over them.
  """
  out_dtype = jnp.dtype(out_dtype)
  preferred = out_dtype if out_dtype == a.dtype == b.dtype else jnp.dtype(jnp.float32)
  return jax.lax.dot_general(a, b, ((a_dims, b_dims), ((), ())),
                             preferred_element_type=preferred).astype(out_dtype)


def _matmul_fwd(x, w, n_in, dtype):
  xc, wc = x.astype(dtype), w.astype(dtype)
  y = _contract(xc, wc, tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)), dtype)
  # Scalars standing in for the input dtypes (residuals must be arrays).
  return y, (xc, wc, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _matmul_bwd(n_in, dtype, residuals, g):
  xc, wc, x_like, w_like = residuals
  g = g.astype(dtype)
  n_batch = xc.ndim - n_in
  dx = _contract(g, wc, tuple(range(n_batch, g.ndim)), tuple(range(n_in, wc.ndim)), x_like.dtype)
  dw = _contract(xc, g, tuple(range(n_batch)), tuple(range(n_batch)), w_like.dtype)
  return dx, dw


low_precision_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _bf16_pieces(a: jax.Array, n: int) -> jax.Array:
  """[n, *a.shape] bf16 pieces of fp32 `a` whose fp32 sum is `a`: each piece rounds what the
  ones before it left over. Three pieces hold all 24 bits of an fp32 significand (bf16 keeps
  fp32's exponent range), so for n = 3 the sum is exact."""
  pieces, rest = [], a.astype(jnp.float32)
  for _ in range(n):
    piece = rest.astype(jnp.bfloat16)
    pieces.append(piece)
    rest = rest - piece.astype(jnp.float32)
  return jnp.stack(pieces)


def _exact_dot(a: jax.Array, b: jax.Array, dims, out_dtype) -> jax.Array:
  """dot_general of bf16 operands accumulated in fp32, written in out_dtype. XLA:CPU runs some
  bf16 × bf16 → fp32 dots only on fp32 operands; bf16 values are exact in fp32, so converting
  them there changes no product."""
  if platform.current() == "cpu":
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32).astype(out_dtype)
  return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)


@jax.custom_vjp
def fp32_weight_matmul(x_td: jax.Array, w_de: jax.Array) -> jax.Array:
  """x [..., d] (bf16) · w [d, e] (fp32) → fp32 [..., e], as exact as an fp32 matmul, on bf16
  tensor cores.

  w is split into three bf16 pieces whose sum is w (`_bf16_pieces`), so every product of a
  bf16 x with a piece is exact and only the fp32 accumulation rounds: one GEMM of x with the
  [3, d, e] pieces, then a sum over them. An fp32 matmul at full precision instead runs on the
  GPU's fp32 cores, ~10× slower at the router's shape. Backward: ∂w = xᵀ·g with g split into
  three pieces (exact products again); ∂x = g·wᵀ from the hi·hi + hi·lo + lo·hi products of
  two-piece splits (relative error ~2⁻¹⁶, below the bf16 rounding of ∂x).
  """
  return _fp32_weight_fwd(x_td, w_de)[0]


def _fp32_weight_fwd(x_td, w_de):
  if x_td.dtype != jnp.bfloat16:
    raise ValueError(f"fp32_weight_matmul needs a bfloat16 input, got {x_td.dtype}")
  w_pde = _bf16_pieces(w_de, 3)
  y_tpe = _exact_dot(x_td, w_pde, (((x_td.ndim - 1,), (1,)), ((), ())), jnp.float32)
  return jnp.sum(y_tpe, axis=-2), (x_td, w_de)


def _fp32_weight_bwd(residuals, g_te):
  x_td, w_de = residuals
  batch = tuple(range(x_td.ndim - 1))
  g_pte = _bf16_pieces(g_te, 3)
  dw_dpe = _exact_dot(x_td, g_pte, ((batch, tuple(b + 1 for b in batch)), ((), ())), jnp.float32)
  dw_de = jnp.sum(dw_dpe, axis=-2).astype(w_de.dtype)
  w_hi, w_lo = _bf16_pieces(w_de, 2)
  g_hi, g_lo = _bf16_pieces(g_te, 2)
  g_qte = jnp.stack([g_hi, g_hi, g_lo])                     # hi·hi + hi·lo + lo·hi
  w_qde = jnp.stack([w_hi, w_lo, w_hi])
  n = x_td.ndim
  dx_td = _exact_dot(g_qte, w_qde, (((0, n), (0, 2)), ((), ())), x_td.dtype)  # one rounding
  return dx_td, dw_de


fp32_weight_matmul.defvjp(_fp32_weight_fwd, _fp32_weight_bwd)


class Linear(nnx.Module):
  """y = x · W contracting the trailing `in_shape` dims of x with the leading dims of W.

  The kernel has shape `in_shape + out_shape` (e.g. [d, heads, head_dim] for a per-head
  projection) so that heads are a real axis: tensor parallelism shards it and per-head Muon
  treats it as a batch axis. Matmul runs in `dtype` with fp32 accumulation; below fp32 its
  backward matmuls run in `dtype` too (`low_precision_matmul`).
  """

  def __init__(self, in_shape: Shape, out_shape: Shape, names: Axes, *, std: float = 0.02,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.in_shape = tuple(in_shape)
    self.out_shape = tuple(out_shape)
    self.dtype = dtype
    self.kernel = param(rngs, normal_init(std), self.in_shape + self.out_shape, names, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    n_in = len(self.in_shape)
    if x.shape[x.ndim - n_in:] != self.in_shape:
      raise ValueError(f"Linear expects trailing dims {self.in_shape}, got input shape {x.shape}")
    return project(x, self.kernel[...], n_in, self.dtype)


def project(x: jax.Array, kernel: jax.Array, n_in: int, dtype) -> jax.Array:
  """x · kernel over x's trailing n_in dims, as `Linear` computes it: in `dtype` with fp32
  accumulation (below fp32 through `low_precision_matmul`)."""
  if jnp.dtype(dtype).itemsize < 4:
    return low_precision_matmul(x, kernel, n_in, dtype)
  return _contract(x.astype(dtype), kernel.astype(dtype), tuple(range(x.ndim - n_in, x.ndim)),
                   tuple(range(n_in)), dtype)


@jax.named_scope("norm")
def rms_norm(x: jax.Array, gain: jax.Array | None, eps: float) -> jax.Array:
  """RMSNorm over the last axis in fp32; returns x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if gain is not None:
    y = y * gain.astype(jnp.float32)
  return y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """gamma ⊙ x / sqrt(mean(x²) + eps), computed in fp32, gain initialised to 1."""

  def __init__(self, dim: int, *, eps: float, name: str = ax.NORM, param_dtype=jnp.float32,
               rngs: nnx.Rngs | None = None):
    self.eps = eps
    self.scale = param(rngs, nnx.initializers.ones, (dim,), (name,), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)


def situ_glu(g: jax.Array, u: jax.Array, beta: float, linear_beta: float | None,
             row_scale: jax.Array | None = None, *, backend: str = "xla") -> jax.Array:
  """SiTU-GLU(g, u) = SiTU_β1(g) · β2·tanh(u/β2); bounded by β1·β2 (docs/maths.md §5.4). Returns g's dtype.

  row_scale [rows] (optional): each row is multiplied by its value in fp32 before the rounding
  (routed experts fold their routing weight in here). `backend`: pallas_kernels.situ_glu's
  ("pallas_gpu": Triton kernels whose backward keeps nothing but g and u)."""
  return situ_glu_op.situ_glu(g, u, beta, linear_beta, row_scale, backend=backend)


class GluMLP(nnx.Module):
  """W_down · SiTU-GLU(x W_gate, x W_up): dense first-layer FFN and shared experts."""

  def __init__(self, d_model: int, hidden: int, *, beta: float, linear_beta: float | None,
               std: float = 0.02, dtype=jnp.float32, param_dtype=jnp.float32,
               in_axis: str = ax.EMBED, hidden_axis: str = ax.MLP, situ_backend: str = "xla",
               rngs: nnx.Rngs):
    situ_glu_op.resolve_backend(situ_backend)      # fail at construction on a bad name
    self.beta = beta
    self.linear_beta = linear_beta
    self.situ_backend = situ_backend
    kw = dict(std=std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate_proj = Linear((d_model,), (hidden,), (in_axis, hidden_axis), **kw)
    self.up_proj = Linear((d_model,), (hidden,), (in_axis, hidden_axis), **kw)
    self.down_proj = Linear((hidden,), (d_model,), (hidden_axis, in_axis), **kw)

  @jax.named_scope("ffn")
  def __call__(self, x: jax.Array) -> jax.Array:
    g, u = self.gate_proj(x), self.up_proj(x)
    if situ_glu_op.backend_for(g, self.situ_backend) == "pallas_gpu":
      # The activation's kernels with the down projection as one op (model/expert_tail.py). Its
      # output is a custom VJP's, which remat's dots policy does not see: tagged, so that
      # selective remat keeps it as it keeps the plain down projection's output.
      down = functools.partial(project, n_in=1, dtype=self.down_proj.dtype)
      y = expert_tail.situ_glu_down(g, u, None, self.down_proj.kernel[...], down=down,
                                    beta=self.beta, linear_beta=self.linear_beta,
                                    situ_backend="pallas_gpu")
      return remat.tag(y, remat.EXPERT_MLP)
    h = situ_glu(g, u, self.beta, self.linear_beta, backend=self.situ_backend)
    h = constrain(h, ax.BATCH, ax.SEQ, ax.MLP) if h.ndim == 3 else h
    return self.down_proj(h)


class Embed(nnx.Module):
  """Token embedding table [vocab, d]."""

  def __init__(self, vocab: int, d_model: int, *, std: float = 0.02, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = param(rngs, normal_init(std), (vocab, d_model), (ax.VOCAB, ax.EMBED), param_dtype)

  def __call__(self, tokens_bt: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens_bt, axis=0).astype(self.dtype)


def dtype_from_name(name: str):
  try:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64,
            "float16": jnp.float16}[name]
  except KeyError:
    raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16, float16 or float64") from None
