"""The arithmetic contract (docs/contract.md §1) on the CPU, bit for bit: the oracle every GPU candidate must equal.

numpy float32 elementwise operations are single IEEE operations with round-to-nearest-even and no
contraction, so each ⊗/⊕ of the contract is one numpy operation here, applied in the same order.
The integer block dot products go through a float32 matmul: every partial sum is an integer of magnitude
at most 32·127·127 < 2^24, so any summation order is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .codebooks import BlockFields, block_fields, dequantize_fields
from .errors import BLOCK, InputError, check_matrix
from .layout import PackedWeights, unpack

QMAX = 127
# Every NaN a GPU float operation produces is the canonical 0x7FFFFFFF (PTX); numpy's x86 NaNs carry
# other bits, so the emulator writes NaN results (inf − inf after an overflow) as the GPU does.
CANONICAL_NAN = np.uint32(0x7FFFFFFF).view(np.float32)
# Blocks handled per vectorized step: bounds temporary memory to ~BLOCKS_PER_STEP·M·N floats.
BLOCKS_PER_STEP = 16


@dataclass(frozen=True)
class QuantizedActivations:
    """Quantized activations (docs/contract.md §1): numpy arrays here, CuPy arrays when kernels.launch makes them
    (indexed the same, stored block-major there)."""

    q: Any  # int8 [M, KB, 32]
    d: Any  # float32 [M, KB]: d_a = amax / 127
    sum: Any  # int32 [M, KB]: Σ_j q_j

    @property
    def m(self) -> int:
        return self.q.shape[0]

    @property
    def kb(self) -> int:
        return self.q.shape[1]


def check_activations(x: np.ndarray, k: int | None = None) -> np.ndarray:
    """Validate an activation block float32 [M, K] (and its K against the weights'); raise InputError."""
    x = check_matrix(x, "activations", "M")
    if k is not None and x.shape[1] != k:
        raise InputError(f"activation K={x.shape[1]} does not match the weights' K={k}")
    return x


def quantize_activations(x: np.ndarray, k: int | None = None) -> QuantizedActivations:
    """Per row and 32-value block: d_a = amax/127, q = clamp(rint(a/d_a), ±127) (q = 0 where d_a == 0).

    `k`, when given, is the weights' K that x must match."""
    check_activations(x, k)
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK, BLOCK)
    d = np.abs(blocks).max(axis=2) / np.float32(QMAX)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = blocks / d[:, :, None]
    q = np.where(d[:, :, None] == 0, np.float32(0), np.clip(np.rint(ratio), -QMAX, QMAX)).astype(np.int8)
    return QuantizedActivations(q=q, d=d.astype(np.float32), sum=q.sum(axis=2, dtype=np.int32))


def partition_width(kb: int, ksplit: int) -> int:
    """w = ceil(KB / ksplit): blocks per K partition."""
    if ksplit < 1:
        raise InputError(f"ksplit must be >= 1, got {ksplit}")
    return -(-kb // ksplit)


def effective_split(kb: int, ksplit: int) -> int:
    """S = ceil(KB / w). Two ksplits with the same S give the same bytes."""
    return -(-kb // partition_width(kb, ksplit))


def identity(kb: int, ksplit: int) -> int:
    """The identity of a result: S, except that partitions of one block (w = 1) are the same as S = 1.

    With w = 1 every partition is 0 ⊕ t_b, which differs from t_b only by turning −0 into +0, and the
    running sum of S = 1 is never −0 either: the two give the same bytes for every input."""
    return 1 if partition_width(kb, ksplit) == 1 else effective_split(kb, ksplit)


def block_terms(fields: BlockFields, qa: QuantizedActivations, b0: int, b1: int) -> np.ndarray:
    """t_b for blocks [b0, b1): float32 [b1-b0, M, N], each term computed exactly as the contract orders it.

    A block with one scale per 16-weight half (Q6_K) sums its two products, low half first (§2)."""
    codes, scales = fields.by_scale()
    q = qa.q[:, b0:b1].astype(np.float32).transpose(1, 0, 2)  # [B, M, 32]
    d_a = qa.d[:, b0:b1].T[:, :, None]  # [B, M, 1]
    width = codes.shape[3]
    t = None
    for h in range(codes.shape[2]):
        c = codes[:, b0:b1, h].astype(np.float32).transpose(1, 2, 0)  # [B, width, N]
        s = np.matmul(q[:, :, h * width : (h + 1) * width], c)  # exact integers, see module docstring
        d_w = scales[:, b0:b1, h].T[:, None, :]  # [B, 1, N]
        term = (d_a * d_w) * s
        t = term if t is None else t + term
    assert t is not None
    if fields.min is not None:
        m_w = fields.min[:, b0:b1].T[:, None, :]
        sum_a = qa.sum[:, b0:b1].T[:, :, None].astype(np.float32)
        t = t + (d_a * m_w) * sum_a
    return t


def _fields(packed: PackedWeights) -> BlockFields:
    # Decoding goes through the GGUF bytes, so the emulator also checks that the planes are lossless.
    return block_fields(packed.codebook, unpack(packed), packed.k)


def gemv_quantized(packed: PackedWeights, qa: QuantizedActivations, ksplit: int) -> np.ndarray:
    """y float32 [M, N] from already-quantized activations, per docs/contract.md §1 with K split `ksplit`."""
    if qa.kb != packed.kb:
        raise InputError(f"activations have {qa.kb} blocks, weights have {packed.kb}")
    return _gemv(_fields(packed), qa, ksplit)


def _gemv(fields: BlockFields, qa: QuantizedActivations, ksplit: int) -> np.ndarray:
    n, kb, _ = fields.codes.shape
    width = partition_width(kb, ksplit)
    y = np.zeros((qa.m, n), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to ±inf is part of the contract
        _accumulate(fields, qa, kb, width, y)
    y[np.isnan(y)] = CANONICAL_NAN
    return y


def _accumulate(fields: BlockFields, qa: QuantizedActivations, kb: int, width: int, y: np.ndarray) -> None:
    """y ⊕= acc_p over partitions of `width` blocks, in place, in the contract's order."""
    for p0 in range(0, kb, width):
        acc = np.zeros_like(y)
        p1 = min(kb, p0 + width)
        for b0 in range(p0, p1, BLOCKS_PER_STEP):
            terms = block_terms(fields, qa, b0, min(p1, b0 + BLOCKS_PER_STEP))
            for term in terms:  # ascending b: the order fixes the bytes
                acc = acc + term
        y[...] = y + acc


def gemv(packed: PackedWeights, x: np.ndarray, ksplit: int = 1) -> np.ndarray:
    """The contract's result for float32 activations x [M, K]: quantize x, then the split GEMV."""
    return gemv_quantized(packed, quantize_activations(x, packed.k), ksplit)


def reference(packed: PackedWeights, x: np.ndarray) -> np.ndarray:
    """float64 y = dequantized(W) · x, the value the quantized result approximates."""
    check_activations(x, packed.k)
    return x.astype(np.float64) @ _dequantized(_fields(packed)).T


def _dequantized(f: BlockFields) -> np.ndarray:
    """float64 [N, K] of the fp32 weights scale·code (+ min), as gguf dequantizes them."""
    return dequantize_fields(f).astype(np.float64)


def error_bound(packed: PackedWeights, x: np.ndarray, ksplit: int = 1) -> np.ndarray:
    """A rigorous bound float64 [M, N] on |gemv(packed, x, ksplit) − reference(packed, x)|.

    Three sources: (1) activation rounding, |a − d_a·q| ≤ d_a·(1/2 + 2^-17) per element (the fp32 quotient
    a/d_a is off by at most 2^-24·128), except where d_a is subnormal and the clamp or a zero d_a may
    lose up to amax; (2) fp32 rounding: every term takes ≤ 5 roundings and every output ≤ KB + S more, so
    |error| ≤ γ_n · Σ_b |exact t_b| with n = KB + S + 5 and γ_n = n·u/(1 − n·u), u = 2^-24; plus u·|W|·|d_a q|
    for the reference's own rounding of asymmetric weights (fp32 d·c + m); (3) underflow: a rounding in
    the subnormal range errs by up to η = 2^-150 absolutely, amplified by at most |s| (or |sum_a|) in the
    same term, so each term adds η·(2|s| + 2|sum_a| + 8) and each accumulation η. A Q6_K term (two halves)
    also takes ≤ 5 roundings, with |s_lo| + |s_hi| for |s|. Where the result is not finite (an intermediate
    overflowed) the bound is inf.
    """
    qa = quantize_activations(x, packed.k)
    f = _fields(packed)
    w_abs = np.abs(_dequantized(f))  # [N, K]
    m, kb = qa.m, packed.kb
    blocks = np.abs(x.astype(np.float64)).reshape(m, kb, BLOCK)
    amax = blocks.max(axis=2)
    d = qa.d.astype(np.float64)
    normal = d >= np.finfo(np.float32).tiny
    eps_act = np.where(normal, d * (0.5 + 2.0**-17), np.maximum(amax, d * (0.5 + 2.0**-17)))  # [M, KB]
    act = eps_act @ w_abs.reshape(packed.n, kb, BLOCK).sum(axis=2).T

    codes, scales = f.by_scale()
    halves = qa.q.astype(np.float64).reshape(m, kb, *codes.shape[2:])
    s = np.einsum("mbhj,nbhj->mnbh", halves, codes.astype(np.float64))
    exact_t = np.abs(d[:, None, :, None] * scales.astype(np.float64)[None] * s).sum(axis=3)
    abs_s = np.abs(s).sum(axis=3)  # Σ_h |s_h| over the halves of a Q6_K block
    if f.min is not None:
        exact_t += np.abs(d[:, None, :] * f.min.astype(np.float64)[None] * qa.sum[:, None, :])
    n_ops = kb + effective_split(kb, ksplit) + 5
    u = 2.0**-24
    gamma = n_ops * u / (1 - n_ops * u)
    dq = (d[:, :, None] * np.abs(qa.q)).reshape(m, packed.k)
    weight_rounding = u * (dq @ w_abs.T) if f.min is not None else 0.0
    eta = 2.0**-150
    underflow = eta * (2 * abs_s + 2 * np.abs(qa.sum.astype(np.float64))[:, None, :] + 8).sum(axis=2)
    underflow += eta * n_ops
    bound = act + gamma * exact_t.sum(axis=2) + weight_rounding + underflow
    finite = np.isfinite(_gemv(f, qa, ksplit))
    return np.where(finite, bound, np.inf)
