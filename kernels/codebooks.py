"""GGUF block codebooks (docs/contract.md §2): block geometry, quantize / dequantize, and the integer codes the
kernels consume.

Every source format here stores 32 weights per block with an fp16 scale d at byte 0. `quantize` and
`dequantize` are bit-exact with the `gguf` package (the test reference; never imported here) for
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; IQ4_NL dequantize is bit-exact too, and IQ4_NL quantize is our own
fp16-aware scale search. `dequantize` is computed from `block_fields`, the same (codes, scale, min)
the kernels and the CPU emulator use, so the two cannot drift apart.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
from gemv_dispatch.kernels.errors import BLOCK, InputError, check_matrix, describe

CODEBOOKS: tuple[str, ...] = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")

# Source format -> execution codebook key (the runtime dispatch key). This is the ONE place the mapping
# lives. Formats whose execution arithmetic is identical (same code range, same planes, same §1
# formula) would map to one shared key and become aliases; a dispatch table for that key must then be
# good for every alias. Today every format has its own arithmetic, so every key is its own lowercase name.
EXECUTION: dict[str, str] = {name: name.lower() for name in CODEBOOKS}

# IQ4_NL non-linear code table (GGUF / llama.cpp kvalues_iq4nl), indexed by nibble.
IQ4_NL_KVALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_KVALUES_I8 = np.array(IQ4_NL_KVALUES, dtype=np.int8)


@dataclass(frozen=True)
class Codebook:
    name: str  # source format, e.g. "Q4_0"
    block_bytes: int  # GGUF bytes per 32-weight block
    payload_bytes: int  # bytes of packed codes (qs) per block
    asymmetric: bool  # has an fp16 min m (Q4_1, Q5_1)
    high_bits: bool  # has a 32-bit qh word holding bit 4 of each code (Q5_0, Q5_1)
    # Derived, stored as fields so they show in repr / asdict.
    bits_per_weight: float = field(init=False)
    execution: str = field(init=False)  # execution codebook key, from EXECUTION
    d_offset: int = field(init=False)  # fp16 scale, always byte 0
    m_offset: int | None = field(init=False)  # fp16 min, asymmetric only
    qh_offset: int | None = field(init=False)  # little-endian uint32 high bits, Q5 only
    qs_offset: int = field(init=False)  # packed codes

    def __post_init__(self) -> None:
        # GGUF field order is d, [m], [qh], qs with no padding.
        m_offset = 2 if self.asymmetric else None
        qh_offset = (4 if self.asymmetric else 2) if self.high_bits else None
        qs_offset = 2 + 2 * self.asymmetric + 4 * self.high_bits
        if qs_offset + self.payload_bytes != self.block_bytes:
            raise AssertionError(f"{self.name}: inconsistent block layout")
        for key, value in (
            ("bits_per_weight", self.block_bytes * 8 / BLOCK),
            ("execution", EXECUTION[self.name]),
            ("d_offset", 0),
            ("m_offset", m_offset),
            ("qh_offset", qh_offset),
            ("qs_offset", qs_offset),
        ):
            object.__setattr__(self, key, value)


_BOOKS: dict[str, Codebook] = {
    b.name: b
    for b in (
        Codebook("Q4_0", block_bytes=18, payload_bytes=16, asymmetric=False, high_bits=False),
        Codebook("Q4_1", block_bytes=20, payload_bytes=16, asymmetric=True, high_bits=False),
        Codebook("Q5_0", block_bytes=22, payload_bytes=16, asymmetric=False, high_bits=True),
        Codebook("Q5_1", block_bytes=24, payload_bytes=16, asymmetric=True, high_bits=True),
        Codebook("Q8_0", block_bytes=34, payload_bytes=32, asymmetric=False, high_bits=False),
        Codebook("IQ4_NL", block_bytes=18, payload_bytes=16, asymmetric=False, high_bits=False),
    )
}
assert tuple(_BOOKS) == CODEBOOKS


def get(name: str) -> Codebook:
    """The codebook called `name` (case-insensitive)."""
    if not isinstance(name, str):
        raise InputError(
            f"codebook must be a name (str), got {type(name).__name__}; known: {', '.join(CODEBOOKS)}"
        )
    book = _BOOKS.get(name.upper())
    if book is None:
        raise InputError(f"unknown codebook {name!r}; known: {', '.join(CODEBOOKS)}")
    return book


@dataclass(frozen=True)
class BlockFields:
    """What a kernel sees of each block: weight = scale * code (+ min)."""

    codes: np.ndarray  # int8 [N, KB, 32], element order j = 0..31 of the block
    scale: np.ndarray  # float32 [N, KB] = float(fp16 d)
    min: np.ndarray | None  # float32 [N, KB] = float(fp16 m), asymmetric codebooks only


# ---------------------------------------------------------------------------------------------------------
# Validation: one clear InputError per problem (docs/architecture.md §10).


def _check_weights(book: Codebook, w: object) -> np.ndarray:
    return np.ascontiguousarray(check_matrix(w, f"{book.name} quantize: w", "N"))


def check_blocks(book: Codebook, blocks: object, k: object) -> tuple[np.ndarray, int]:
    """Validate GGUF block bytes uint8 [N, K/32*block_bytes]; return them contiguous, with K as an int."""
    if isinstance(k, bool):
        raise InputError(f"{book.name}: k must be an int, got bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise InputError(f"{book.name}: k must be an int, got {type(k).__name__}") from None
    if k <= 0:
        raise InputError(f"{book.name}: K must be positive, got K={k}")
    if k % BLOCK:
        raise InputError(f"{book.name}: K={k} is not a multiple of {BLOCK}")
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or blocks.ndim != 2:
        raise InputError(f"{book.name}: blocks must be a 2-D uint8 array, got {describe(blocks)}")
    if blocks.shape[0] <= 0:
        raise InputError(f"{book.name}: N must be positive, got blocks of shape {blocks.shape}")
    expected = k // BLOCK * book.block_bytes
    if blocks.shape[1] != expected:
        raise InputError(
            f"{book.name}: bytes per row must be K/32*{book.block_bytes} = {expected} for K={k}, "
            f"got {blocks.shape[1]} (blocks of shape {blocks.shape})"
        )
    return np.ascontiguousarray(blocks), k


# ---------------------------------------------------------------------------------------------------------
# Decoding


def block_fields(codebook: str, blocks: np.ndarray, k: int) -> BlockFields:
    """GGUF block bytes uint8 [N, KB*block_bytes] -> integer codes and float32 scale (and min)."""
    book = get(codebook)
    blocks, k = check_blocks(book, blocks, k)
    n, kb = blocks.shape[0], k // BLOCK
    b3 = blocks.reshape(n, kb, book.block_bytes)

    scale = b3[:, :, book.d_offset : book.d_offset + 2].copy().view("<f2")[..., 0].astype(np.float32)
    mins = None
    if book.asymmetric:
        mins = b3[:, :, book.m_offset : book.m_offset + 2].copy().view("<f2")[..., 0].astype(np.float32)

    qs = b3[:, :, book.qs_offset :]
    if book.name == "Q8_0":
        return BlockFields(codes=qs.view(np.int8).copy(), scale=scale, min=mins)

    # Byte i holds element i (low nibble) and element i+16 (high nibble).
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    if book.high_bits:
        # Bit j of the little-endian uint32 qh is bit 4 of element j: byte j//8, bit j%8.
        qh = b3[:, :, book.qh_offset : book.qh_offset + 4]
        q |= np.unpackbits(qh, axis=-1, bitorder="little") << np.uint8(4)

    if book.name == "IQ4_NL":
        codes = np.take(_KVALUES_I8, q)
    else:
        codes = q.view(np.int8)  # 0..15 or 0..31: fits int8 unchanged
        if not book.asymmetric:  # symmetric formats centre the code
            codes = codes - np.int8(16 if book.high_bits else 8)
    return BlockFields(codes=np.ascontiguousarray(codes), scale=scale, min=mins)


def dequantize(codebook: str, blocks: np.ndarray, k: int) -> np.ndarray:
    """GGUF block bytes uint8 [N, KB*block_bytes] -> float32 [N, K].

    scale*code (+min), one fp32 rounding per operation: the same operations, in the same order, as gguf
    (multiplication commutes bitwise, so code*scale == scale*code). For finite scales the product is even
    exact (11-bit fp16 significand times an 8-bit code), so the only rounding is the asymmetric +min."""
    return dequantize_fields(block_fields(codebook, blocks, k))


def dequantize_fields(f: BlockFields) -> np.ndarray:
    """The weights float32 [N, K] of decoded blocks: scale*code (+min), as `dequantize` describes."""
    with np.errstate(over="ignore", invalid="ignore"):  # arbitrary bytes may hold inf/nan scales
        w = f.codes.astype(np.float32) * f.scale[:, :, None]
        if f.min is not None:
            w += f.min[:, :, None]
    return w.reshape(f.codes.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------
# Encoding

_CHUNK_BLOCKS = 4096  # blocks per step: keeps the temporaries in cache


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 [B] -> uint8 [B, 2], fp16 round-to-nearest-even, little-endian."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [B, 32] codes -> [B, 16] bytes: element i low nibble, element i+16 high nibble."""
    return (q[:, :16] & np.uint8(0x0F)) | (q[:, 16:] << np.uint8(4))


def _pack_high(q: np.ndarray) -> np.ndarray:
    """uint8 [B, 32] 5-bit codes -> [B, 4] bytes of the little-endian uint32 qh (bit j = bit 4 of q_j)."""
    return np.packbits(q >> np.uint8(4), axis=-1, bitorder="little")


def _abs_extreme(wb: np.ndarray) -> np.ndarray:
    """The signed value of largest magnitude per block (first one on ties), float32 [B, 1]."""
    return np.take_along_axis(wb, np.abs(wb).argmax(axis=-1, keepdims=True), axis=-1)


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.where(d == 0, np.float32(0), np.float32(1) / d)


# The four gguf formats below reproduce gguf's numpy operations one for one (including its trunc(x+0.5)
# rounding and the order of casts and clips) because bit-exactness is the contract, even where the
# reference behaves oddly (e.g. a subnormal block scale whose reciprocal overflows).


def _q4_0(wb: np.ndarray) -> np.ndarray:
    d = _abs_extreme(wb) / np.float32(-8)
    q = np.trunc(wb * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q5_0(wb: np.ndarray) -> np.ndarray:
    d = _abs_extreme(wb) / np.float32(-16)
    q = np.trunc(wb * _inverse(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
    return np.concatenate([_fp16_bytes(d), _pack_high(q), _pack_nibbles(q)], axis=-1)


def _affine(wb: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hi = wb.max(axis=-1, keepdims=True)
    lo = wb.min(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(levels)
    q = np.trunc((wb - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, levels)
    return d, lo, q


def _q4_1(wb: np.ndarray) -> np.ndarray:
    d, lo, q = _affine(wb, 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], axis=-1)


def _q5_1(wb: np.ndarray) -> np.ndarray:
    d, lo, q = _affine(wb, 31)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_high(q), _pack_nibbles(q)], axis=-1)


def _q8_0(wb: np.ndarray) -> np.ndarray:
    d = np.abs(wb).max(axis=-1, keepdims=True) / np.float32(127)
    x = wb * _inverse(d)
    # Round half away from zero, computed exactly as gguf's np_roundf (floor of twice the fraction).
    a = np.abs(x)
    fl = np.floor(a)
    q = np.sign(x) * (fl + np.floor(np.float32(2) * (a - fl)))
    return np.concatenate([_fp16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=-1)


# --- IQ4_NL: our own scale search -------------------------------------------------------------------------
#
# Objective per block: minimise sum_j (w_j - float(fp16 d) * kv[c_j])^2 over the fp16 scale d and nibbles c.
# For a fixed d the best codes are the nearest table values to w/d, so the search is one-dimensional in d.
# Candidates: the extreme weight a (signed) mapped onto either end of the table with a spread of divisors
# (llama.cpp's ntry loop, both signs). Each candidate gets nearest codes and a least-squares refit
# d = sum(w k)/sum(k k); the candidate and its refit are both scored with their fp16-rounded scale and those
# codes, and the best wins. The winner's codes are then recomputed exactly (so they are optimal for the
# stored scale), refit once more, and the result is kept only if it is no worse than the baselines
# d = +-amax/127 with nearest codes under the same exact float64 error.

# Divisors of the signed extreme a (d = a / divisor): a lands near -127 (negative divisors) or near +113.
# Eight spread-out starts do as well as fifteen tightly packed ones once each is refit (rel. RMSE on
# Gaussian rows 0.07348 vs 0.07357) at half the cost.
_IQ4_DIVISORS = np.array([-139, -133, -127, -121, -115, 107, 113, 119], dtype=np.float32)
_FP16_MAX = np.float32(65504.0)
_KV_F32 = np.array(IQ4_NL_KVALUES, dtype=np.float32)
_KV_F64 = _KV_F32.astype(np.float64)
_NIBBLE_ONE = 8  # nibble of kvalue 1: the code stored where d == 0

# Nearest-code lookup over half-unit bins of x = w/d: all midpoints between neighbouring kvalues are
# multiples of 0.5, so each bin [h/2, (h+1)/2) has one nearest value (ties only at a bin edge).
_HALF_RANGE = 512  # x is clipped to [-256, 256); |kv| <= 127 so clipping never changes the answer
_BIN_CENTRES = (np.arange(2 * _HALF_RANGE) - _HALF_RANGE + 0.5) / 2
_NEAREST_NIBBLE = np.abs(_BIN_CENTRES[:, None] - _KV_F64[None, :]).argmin(axis=1).astype(np.uint8)
_NEAREST_KV = _KV_F32[_NEAREST_NIBBLE]
_NEAREST_KV64 = _KV_F64[_NEAREST_NIBBLE]


def _fp16_round(d: np.ndarray) -> np.ndarray:
    """float -> the float32 value of its fp16 rounding, saturating at +-65504 (never inf)."""
    return np.clip(d, -_FP16_MAX, _FP16_MAX).astype(np.float16).astype(np.float32)


def _nearest_kv(wb: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """Table values nearest to w/d (float32 [B, 32]); d = 0 gives kv 1. Computed in float32, so a
    quotient within rounding of a midpoint may take the neighbour: fine for ranking candidates, whose
    scores are exact for whatever valid codes they carry."""
    inv2 = np.where(d16 == 0, np.float32(0), np.float32(2) / d16)
    x = wb * inv2[:, None]
    x += np.float32(_HALF_RANGE)
    np.clip(x, 0, 2 * _HALF_RANGE - 1, out=x)
    return np.take(_NEAREST_KV, x.astype(np.intp), mode="wrap")


def _exact_codes(wb64: np.ndarray, d16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nibbles minimising |w - d*kv| and the per-block float64 squared error; d16 = 0 gives nibble 8.

    Exact without a tie-break pass: w is float32 and d*kv has at most 19 significant bits, so w/d is
    either exactly a midpoint between two table values (a true tie: both codes give the same error) or
    at least ~2^-25 relatively away from it, far beyond the float64 rounding of the quotient."""
    d64 = d16.astype(np.float64)
    with np.errstate(divide="ignore"):
        inv2 = np.where(d64 == 0, 0.0, 2.0 / d64)
    x = wb64 * inv2[:, None]
    x += _HALF_RANGE
    np.clip(x, 0, 2 * _HALF_RANGE - 1, out=x)
    idx = x.astype(np.intp)
    r = wb64 - d64[:, None] * np.take(_NEAREST_KV64, idx, mode="wrap")
    return np.take(_NEAREST_NIBBLE, idx, mode="wrap"), np.einsum("ij,ij->i", r, r)


def _iq4_nl(wb: np.ndarray) -> np.ndarray:
    hi = wb.max(axis=-1)
    lo = wb.min(axis=-1)
    a = np.where(hi >= -lo, hi, lo)  # signed extreme (positive on a tie)
    wb64 = wb.astype(np.float64)
    sww = np.einsum("ij,ij->i", wb64, wb64)

    # Score every candidate and its refit from block sums; rows of `scales` are candidate scales.
    cand = _fp16_round(a[None, :] / _IQ4_DIVISORS[:, None])  # [C, B]
    swk = np.empty(cand.shape, dtype=np.float64)
    skk = np.empty(cand.shape, dtype=np.float64)
    for i, d16 in enumerate(cand):
        kv = _nearest_kv(wb, d16)
        swk[i] = np.einsum("ij,ij->i", wb, kv)
        skk[i] = np.einsum("ij,ij->i", kv, kv)
    refit = _fp16_round((swk / skk).astype(np.float32))
    scales = np.concatenate([cand, refit])
    s64 = scales.astype(np.float64)
    swk2 = np.concatenate([swk, swk])
    skk2 = np.concatenate([skk, skk])
    # Expanded square: cancellation costs ~1e-16*sum(w^2), irrelevant for ranking.
    score = sww - 2 * s64 * swk2 + s64 * s64 * skk2
    pick = score.argmin(axis=0)
    cols = np.arange(wb.shape[0])
    best_d = scales[pick, cols]

    codes, err = _exact_codes(wb64, best_d)

    def offer(d16: np.ndarray) -> None:
        nonlocal best_d, codes, err
        c2, e2 = _exact_codes(wb64, d16)
        better = e2 < err
        best_d = np.where(better, d16, best_d)
        codes = np.where(better[:, None], c2, codes)
        err = np.where(better, e2, err)

    # One more refit from the exact codes, then the baselines (and d = 0, i.e. error sum w^2).
    kv = np.take(_KV_F64, codes)
    offer(_fp16_round((np.einsum("ij,ij->i", wb64, kv) / np.einsum("ij,ij->i", kv, kv)).astype(np.float32)))
    amax = np.maximum(hi, -lo)
    offer(_fp16_round(amax / np.float32(127)))
    offer(_fp16_round(-amax / np.float32(127)))
    zero = sww <= err  # d = 0 (codes irrelevant, nibble 8): error sum w^2, e.g. all-zero or tiny blocks
    best_d[zero] = 0  # also stores +0, never -0
    codes[zero] = _NIBBLE_ONE
    return np.concatenate([_fp16_bytes(best_d), _pack_nibbles(codes)], axis=-1)


_ENCODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "IQ4_NL": _iq4_nl}


def quantize(codebook: str, w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> GGUF block bytes uint8 [N, K//32*block_bytes]."""
    book = get(codebook)
    w = _check_weights(book, w)
    n, k = w.shape
    wb = w.reshape(-1, BLOCK)
    out = np.empty((wb.shape[0], book.block_bytes), dtype=np.uint8)
    encode = _ENCODERS[book.name]
    # Blocks are independent, so chunking changes nothing but speed. Overflow / division warnings are
    # expected for extreme (still finite) inputs and match the reference's results.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, wb.shape[0], _CHUNK_BLOCKS):
            stop = start + _CHUNK_BLOCKS
            out[start:stop] = encode(wb[start:stop])
    return out.reshape(n, k // BLOCK * book.block_bytes)
