"""GGUF block codebooks (docs/contract.md §2): block geometry, quantize / dequantize, and the integer codes the
kernels consume.

Two kinds of source format. The legacy formats store 32 weights per block with an fp16 scale d at byte 0;
the super-block formats (Q4_K, Q5_K, Q6_K, IQ4_XS) store 256 weights per block: eight 32-blocks whose scale
(and min) derive from an fp16 super-block scale and integer sub-block scales. `quantize` and `dequantize` are
bit-exact with the `gguf` package (the test reference; never imported here) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0;
`dequantize` is bit-exact for every format, NaN payloads included. IQ4_NL and the super-block formats are
quantized by our own least-squares searches. `dequantize` is computed from `block_fields`, the same per-block
(codes, scale, min) the kernels and the CPU emulator use, so the two cannot drift apart.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .errors import BLOCK, InputError, check_matrix, describe

# The formats the tool understands and the GPU kernels run: what the registry, sweep plans, policy training and
# certification iterate over, in the order of the kernel source's `Codebook` enum.
LEGACY: tuple[str, ...] = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")  # one 32-weight block each
SUPERBLOCK: tuple[str, ...] = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # 256-weight super-blocks of 8 blocks
CODEBOOKS: tuple[str, ...] = LEGACY + SUPERBLOCK
SUPERBLOCK_WEIGHTS = 256  # weights per super-block: 8 blocks of 32

# Source format -> execution codebook key (the runtime dispatch key). This is the ONE place the mapping
# lives. Formats whose execution arithmetic is identical (same code range, same planes, same §1
# formula) would map to one shared key and become aliases; a dispatch table for that key must then be
# good for every alias. Today every format has its own arithmetic, so every key is its own lowercase name.
EXECUTION: dict[str, str] = {name: name.lower() for name in CODEBOOKS}

# IQ4_NL non-linear code table (GGUF / llama.cpp kvalues_iq4nl), indexed by nibble.
IQ4_NL_KVALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_KVALUES_I8 = np.array(IQ4_NL_KVALUES, dtype=np.int8)


def _unpack_nibbles(packed: np.ndarray, run: int) -> np.ndarray:
    """uint8 [..., G*run] -> [..., 2*G*run]: byte i of each run of `run` bytes holds code i (low nibble) and
    code run+i (high nibble) of that run's 2*run codes."""
    lead = packed.shape[:-1]
    pairs = packed.reshape(*lead, -1, 1, run) >> np.array([[0], [4]], dtype=np.uint8)
    return (pairs & np.uint8(0x0F)).reshape(*lead, -1)


def _pack_nibbles(q: np.ndarray, run: int) -> np.ndarray:
    """The inverse of _unpack_nibbles for codes q uint8 [..., 2*G*run] (bits above the nibble are dropped)."""
    lead = q.shape[:-1]
    pairs = q.reshape(*lead, -1, 2, run)
    return ((pairs[..., 0, :] & np.uint8(0x0F)) | (pairs[..., 1, :] << np.uint8(4))).reshape(*lead, -1)


def _unpack_kq_high(qh: np.ndarray, bits: int) -> np.ndarray:
    """K-quant qh uint8 [..., R*32] -> the code bits above the nibble, uint8 [..., R*(8/bits)*32]: byte e of
    each 32-byte run holds `bits` bits of code e of 8/bits consecutive 32-blocks, the first block lowest."""
    lead = qh.shape[:-1]
    shifts = (np.arange(8 // bits, dtype=np.uint8) * np.uint8(bits))[:, None]
    fields = (qh.reshape(*lead, -1, 1, BLOCK) >> shifts) & np.uint8((1 << bits) - 1)
    return fields.reshape(*lead, -1)


def _pack_kq_high(high: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of _unpack_kq_high."""
    lead = high.shape[:-1]
    shifts = (np.arange(8 // bits, dtype=np.uint8) * np.uint8(bits))[:, None]
    fields = high.reshape(*lead, -1, 8 // bits, BLOCK) << shifts
    return np.bitwise_or.reduce(fields, axis=-2).reshape(*lead, -1)


# --- Sub-block scales of the super-block formats: their `sc` bytes <-> integers -------------------------


def _k6_decode(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 6-bit scales and mins [..., 8] (GGUF get_scale_min): bytes 0-3 hold the low six
    bits of scales 0-3, bytes 4-7 those of mins 0-3; blocks 4-7 take their low nibbles from bytes 8-11
    (scale low, min high) and their top two bits from the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    six, top = np.uint8(0x3F), np.uint8(0x30)
    scales = np.concatenate([d & six, (md & np.uint8(0x0F)) | ((d >> np.uint8(2)) & top)], axis=-1)
    mins = np.concatenate([m & six, (md >> np.uint8(4)) | ((m >> np.uint8(2)) & top)], axis=-1)
    return scales, mins


def _k6_encode(scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
    assert mins is not None
    s, m = scales.astype(np.uint8), mins.astype(np.uint8)
    four, six = np.uint8(4), np.uint8(6)
    tops = [s[..., :4] | ((s[..., 4:] >> four) << six), m[..., :4] | ((m[..., 4:] >> four) << six)]
    return np.concatenate([*tops, (s[..., 4:] & np.uint8(0x0F)) | (m[..., 4:] << four)], axis=-1)


def _int8_decode(sc: np.ndarray) -> tuple[np.ndarray, None]:
    """Q6_K: 16 int8 scales, one per 16 weights."""
    return sc.view(np.int8), None


def _int8_encode(scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
    return scales.astype(np.int8).view(np.uint8)


def _xs_decode(sc: np.ndarray) -> tuple[np.ndarray, None]:
    """IQ4_XS: scales_h (little-endian uint16: bits 2j, 2j+1 are the top bits of block j) then scales_l
    (4 bytes: the low nibbles of blocks 2i, 2i+1); the scale is the 6-bit value minus 32."""
    high = (sc[..., 0:1].astype(np.uint16) | (sc[..., 1:2].astype(np.uint16) << np.uint16(8))) >> (
        np.arange(8, dtype=np.uint16) * np.uint16(2)
    )
    six = _unpack_nibbles(sc[..., 2:6], 1) | ((high & np.uint16(3)).astype(np.uint8) << np.uint8(4))
    return six.view(np.int8) - np.int8(32), None


def _xs_encode(scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
    six = (scales + 32).astype(np.uint16)
    high = np.bitwise_or.reduce((six >> np.uint16(4)) << (np.arange(8, dtype=np.uint16) * np.uint16(2)), axis=-1)
    return np.concatenate(
        [high[..., None].astype("<u2").view(np.uint8), _pack_nibbles(six.astype(np.uint8), 1)], axis=-1
    )


@dataclass(frozen=True)
class SubScales:
    """How a super-block format stores its integer sub-block scales (and mins) in its `sc` bytes."""

    count: int  # scales per super-block: one per 32-block, or per 16-weight half (Q6_K)
    lo: int  # range of a sub-block scale (and of a min: Q4_K/Q5_K, 0..63)
    hi: int
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]  # uint8 [..., sc bytes] -> ints
    encode: Callable[[np.ndarray, np.ndarray | None], np.ndarray]


_K6 = SubScales(8, 0, 63, _k6_decode, _k6_encode)
_INT8 = SubScales(16, -128, 127, _int8_decode, _int8_encode)
_XS6 = SubScales(8, -32, 31, _xs_decode, _xs_encode)


@dataclass(frozen=True)
class Codebook:
    """A source format's traits, each written once; everything else derives from them."""

    name: str  # source format, e.g. "Q4_0"
    # GGUF fields of one block in byte order, (field, bytes): d = fp16 scale, m = fp16 min (Q4_1, Q5_1) or
    # super-block min scale dmin (K-quants), sc = sub-block scales, qh = code bits above the nibble, qs =
    # nibbles (int8 codes for Q8_0)
    layout: tuple[tuple[str, int], ...]
    code_bits: int  # bits per code
    nibble_run: int = 16  # qs: byte i of each run of this many bytes holds codes i and run+i (_unpack_nibbles)
    table: bool = False  # codes are IQ4_NL table values of the nibble
    subscales: SubScales | None = None  # super-block formats only
    # Derived, stored as fields so they show in repr / asdict.
    superblock: bool = field(init=False)
    weights: int = field(init=False)  # weights per GGUF block: 32, or SUPERBLOCK_WEIGHTS
    block_bytes: int = field(init=False)  # GGUF bytes per block (per super-block for super-block formats)
    payload_bytes: int = field(init=False)  # bytes of qs per 32 weights
    asymmetric: bool = field(init=False)  # weight = scale * code + min
    high_bits: bool = field(init=False)  # has qh (Q5_0, Q5_1, Q5_K, Q6_K)
    bits_per_weight: float = field(init=False)
    execution: str = field(init=False)  # execution codebook key from EXECUTION
    d_offset: int = field(init=False)
    m_offset: int | None = field(init=False)
    sc_offset: int | None = field(init=False)
    qh_offset: int | None = field(init=False)
    qs_offset: int = field(init=False)

    def __post_init__(self) -> None:
        sizes = dict(self.layout)
        starts = dict(zip(sizes, itertools.accumulate(sizes.values(), initial=0), strict=False))
        weights = SUPERBLOCK_WEIGHTS if self.subscales is not None else BLOCK
        for key, value in (
            ("superblock", self.subscales is not None),
            ("weights", weights),
            ("block_bytes", sum(sizes.values())),
            ("payload_bytes", sizes["qs"] * BLOCK // weights),
            ("asymmetric", "m" in sizes),
            ("high_bits", "qh" in sizes),
            ("bits_per_weight", sum(sizes.values()) * 8 / weights),
            ("execution", EXECUTION[self.name]),
            ("d_offset", starts["d"]),
            ("m_offset", starts.get("m")),
            ("sc_offset", starts.get("sc")),
            ("qh_offset", starts.get("qh")),
            ("qs_offset", starts["qs"]),
        ):
            object.__setattr__(self, key, value)

    def span(self, name: str) -> slice:
        """The bytes of GGUF field `name` (d, m, sc, qh, qs) within one block."""
        start = getattr(self, f"{name}_offset")
        if start is None:
            raise AssertionError(f"{self.name} has no field {name}")
        return slice(start, start + dict(self.layout)[name])


_BOOKS: dict[str, Codebook] = {
    b.name: b
    for b in (
        Codebook("Q4_0", (("d", 2), ("qs", 16)), code_bits=4),
        Codebook("Q4_1", (("d", 2), ("m", 2), ("qs", 16)), code_bits=4),
        Codebook("Q5_0", (("d", 2), ("qh", 4), ("qs", 16)), code_bits=5),
        Codebook("Q5_1", (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)), code_bits=5),
        Codebook("Q8_0", (("d", 2), ("qs", 32)), code_bits=8),
        Codebook("IQ4_NL", (("d", 2), ("qs", 16)), code_bits=4, table=True),
        Codebook("Q4_K", (("d", 2), ("m", 2), ("sc", 12), ("qs", 128)), code_bits=4, nibble_run=32, subscales=_K6),
        Codebook("Q5_K", (("d", 2), ("m", 2), ("sc", 12), ("qh", 32), ("qs", 128)), code_bits=5, nibble_run=32,
                 subscales=_K6),
        Codebook("Q6_K", (("qs", 128), ("qh", 64), ("sc", 16), ("d", 2)), code_bits=6, nibble_run=64,
                 subscales=_INT8),
        Codebook("IQ4_XS", (("d", 2), ("sc", 6), ("qs", 128)), code_bits=4, table=True, subscales=_XS6),
    )
}
assert tuple(_BOOKS) == CODEBOOKS


# Codebook names as a user types them, in any case (the GGUF type name "Q4_K", its execution key "q4_k"): the
# two spellings the tool keeps inside are a source format's `Codebook.name` (kernels, corpus, inventories) and
# its execution key (policy, tables, runtime dispatch). `get` and `execution_key` are the only ways in. Case is
# folded in ASCII only (as the generated C header does): str.lower() would also fold, say, the Kelvin sign into k.
_BY_SOURCE: dict[str, str] = {name.lower(): name for name in CODEBOOKS}
_BY_EXECUTION: dict[str, tuple[str, ...]] = {
    key: tuple(name for name in CODEBOOKS if EXECUTION[name] == key) for key in sorted(set(EXECUTION.values()))
}


def _folded(name: str) -> str:
    """`name` in lower case, ASCII letters only folded."""
    return name.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _unknown(name: object) -> InputError:
    if not isinstance(name, str):
        return InputError(f"codebook must be a name (str), got {type(name).__name__}; known: {', '.join(CODEBOOKS)}")
    return InputError(f"unknown codebook {name!r}; known: {', '.join(CODEBOOKS)} (in any case)")


def get(name: str) -> Codebook:
    """The source format called `name`, in any case ("q4_k" is Q4_K); InputError naming the known ones otherwise."""
    source = _BY_SOURCE.get(_folded(name)) if isinstance(name, str) else None
    if source is None:
        raise _unknown(name)
    return _BOOKS[source]


def execution_key(name: str) -> str:
    """The execution codebook key (the dispatch key, e.g. "q4_k") of a source format or of an execution key, in
    any case; InputError naming the known codebooks otherwise."""
    if isinstance(name, str):
        lowered = _folded(name)
        if lowered in _BY_EXECUTION:
            return lowered
        if lowered in _BY_SOURCE:
            return EXECUTION[_BY_SOURCE[lowered]]
    raise _unknown(name)


def formats_of(name: str) -> tuple[str, ...]:
    """The source formats that share the execution key of `name` (its aliases, itself included), in registry
    order: a table for that key must be good for every one of them (docs/contract.md §2)."""
    return _BY_EXECUTION[execution_key(name)]


def k_error(name: str, k: int) -> str | None:
    """Why K cannot hold whole GGUF blocks of codebook `name` (a super-block format needs K a multiple of 256;
    for an execution key, of every alias's block), or None. K's other rules are `registry.shape_error`'s."""
    formats = formats_of(name)
    weights = max(_BOOKS[f].weights for f in formats)
    if k % weights:
        unit = "super-block" if weights > BLOCK else "block"
        return f"K={k} is not a multiple of {weights}, the {unit} of {'/'.join(formats)}"
    return None


@dataclass(frozen=True)
class BlockFields:
    """What a kernel sees of each 32-weight block: weight = scale * code (+ min).

    Super-block formats derive each block's scale and min exactly from their super-block fields
    (docs/contract.md §2); a Q6_K block has one scale per 16-weight half."""

    codes: np.ndarray  # int8 [N, KB, 32], element order j = 0..31 of the block
    scale: np.ndarray  # float32 [N, KB] = float(fp16 d) (super-block: d * sc_j); Q6_K: [N, KB, 2], per half
    min: np.ndarray | None  # float32 [N, KB] = float(fp16 m) (K-quants: -(dmin * m_j)), asymmetric only

    def by_scale(self) -> tuple[np.ndarray, np.ndarray]:
        """The codes int8 [N, KB, H, 32/H] that each scale float32 [N, KB, H] multiplies (H = 1; Q6_K 2)."""
        n, kb, _ = self.codes.shape
        scale = self.scale.reshape(n, kb, -1)
        return self.codes.reshape(n, kb, scale.shape[2], -1), scale


# ---------------------------------------------------------------------------------------------------------
# Validation: one clear InputError per problem (docs/architecture.md §10).


def _check_weights(book: Codebook, w: object) -> np.ndarray:
    w = check_matrix(w, f"{book.name} quantize: w", "N")
    if w.shape[1] % book.weights:
        raise InputError(f"{book.name} quantize: w K={w.shape[1]} is not a multiple of {book.weights} "
                         f"(a {book.name} super-block holds {book.weights} weights)")
    return np.ascontiguousarray(w)


def check_blocks(book: Codebook, blocks: object, k: object) -> tuple[np.ndarray, int]:
    """Validate GGUF block bytes uint8 [N, K/weights*block_bytes]; return them contiguous, with K as an int."""
    if isinstance(k, bool):
        raise InputError(f"{book.name}: k must be an int, got bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise InputError(f"{book.name}: k must be an int, got {type(k).__name__}") from None
    if k <= 0:
        raise InputError(f"{book.name}: K must be positive, got K={k}")
    if k % book.weights:
        whole = f" (a {book.name} super-block holds {book.weights} weights)" if book.superblock else ""
        raise InputError(f"{book.name}: K={k} is not a multiple of {book.weights}{whole}")
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or blocks.ndim != 2:
        raise InputError(f"{book.name}: blocks must be a 2-D uint8 array, got {describe(blocks)}")
    if blocks.shape[0] <= 0:
        raise InputError(f"{book.name}: N must be positive, got blocks of shape {blocks.shape}")
    expected = k // book.weights * book.block_bytes
    if blocks.shape[1] != expected:
        raise InputError(
            f"{book.name}: bytes per row must be K/{book.weights}*{book.block_bytes} = {expected} for K={k}, "
            f"got {blocks.shape[1]} (blocks of shape {blocks.shape})"
        )
    return np.ascontiguousarray(blocks), k


# ---------------------------------------------------------------------------------------------------------
# Decoding


def _fp16(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian fp16 -> float32 [...]."""
    return raw.copy().view("<f2")[..., 0].astype(np.float32)


def _raw_codes(book: Codebook, b3: np.ndarray) -> np.ndarray:
    """The stored codes of blocks uint8 [N, NB, block_bytes] as unsigned integers [N, NB, weights]."""
    qs = b3[:, :, book.span("qs")]
    if book.code_bits == 8:
        return qs
    q = _unpack_nibbles(qs, book.nibble_run)
    if book.high_bits:
        qh = b3[:, :, book.span("qh")]
        if book.superblock:
            high = _unpack_kq_high(qh, book.code_bits - 4)
        else:  # legacy Q5: bit j of the little-endian uint32 is bit 4 of code j
            high = np.unpackbits(qh, axis=-1, bitorder="little")
        q |= high << np.uint8(4)
    return q


def _codes(book: Codebook, raw: np.ndarray) -> np.ndarray:
    """Stored codes -> the signed integer codes the kernels multiply (int8, same shape)."""
    if book.table:
        return np.take(_KVALUES_I8, raw)
    if book.code_bits == 8 or book.asymmetric:  # Q8_0 is two's complement; unsigned codes fit int8 unchanged
        return raw.view(np.int8)
    return raw.view(np.int8) - np.int8(1 << (book.code_bits - 1))  # symmetric formats centre the code


def block_fields(codebook: str, blocks: np.ndarray, k: int) -> BlockFields:
    """GGUF block bytes uint8 [N, K/weights*block_bytes] -> integer codes and float32 scale (and min)."""
    book = get(codebook)
    blocks, k = check_blocks(book, blocks, k)
    n, kb = blocks.shape[0], k // BLOCK
    b3 = blocks.reshape(n, k // book.weights, book.block_bytes)
    codes = _codes(book, _raw_codes(book, b3)).reshape(n, kb, BLOCK)
    scale = _fp16(b3[:, :, book.span("d")])
    mins = _fp16(b3[:, :, book.span("m")]) if book.asymmetric else None
    if book.subscales is not None:
        # The same fp32 operations, in the same order, as gguf: d*sc, and dmin*m subtracted (stored negated,
        # so the kernels' asymmetric rule adds it). Exact for finite d: an fp16 times at most 8 bits.
        sc, m = book.subscales.decode(b3[:, :, book.span("sc")])
        with np.errstate(over="ignore", invalid="ignore"):  # arbitrary bytes may hold inf/nan scales
            scale = (scale[:, :, None] * sc.astype(np.float32)).reshape(n, kb, -1)
            scale = scale[:, :, 0] if scale.shape[2] == 1 else scale
            if mins is not None and m is not None:
                mins = -(mins[:, :, None] * m.astype(np.float32)).reshape(n, kb)
    return BlockFields(codes=np.ascontiguousarray(codes), scale=scale, min=mins)


def dequantize(codebook: str, blocks: np.ndarray, k: int) -> np.ndarray:
    """GGUF block bytes uint8 [N, K/weights*block_bytes] -> float32 [N, K].

    scale*code (+min), one fp32 rounding per operation: the same operations, in the same order, as gguf
    (multiplication commutes bitwise, so code*scale == scale*code). For finite scales the products are even
    exact (an 11-bit fp16 significand times sub-scale and code, at most 12 bits together, e.g. Q6_K's
    127·31), so the only rounding is the asymmetric min."""
    book = get(codebook)
    return dequantize_fields(block_fields(book.name, blocks, k), subtract_min=book.superblock)


def dequantize_fields(f: BlockFields, subtract_min: bool = False) -> np.ndarray:
    """The weights float32 [N, K] of decoded blocks: scale*code (+min), as `dequantize` describes.

    subtract_min: compute w − (−min) as the K-quants' gguf reference does (w − dmin·m); it differs from
    w + min only in the sign of a NaN, which this keeps bit-exact too."""
    codes, scale = f.by_scale()
    with np.errstate(over="ignore", invalid="ignore"):  # arbitrary bytes may hold inf/nan scales
        w = codes.astype(np.float32) * scale[..., None]
        if f.min is not None:
            m = f.min[:, :, None, None]
            w = w - (-m) if subtract_min else w + m
    return w.reshape(codes.shape[0], -1)
# ---------------------------------------------------------------------------------------------------------
# Encoding

_CHUNK_WEIGHTS = 4096 * BLOCK  # weights per step: keeps the temporaries in cache


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 [B] -> uint8 [B, 2], fp16 round-to-nearest-even, little-endian."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


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
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q, 16)], axis=-1)


def _q5_0(wb: np.ndarray) -> np.ndarray:
    d = _abs_extreme(wb) / np.float32(-16)
    q = np.trunc(wb * _inverse(d) + np.float32(16.5)).astype(np.uint8).clip(0, 31)
    return np.concatenate([_fp16_bytes(d), _pack_high(q), _pack_nibbles(q, 16)], axis=-1)


def _affine(wb: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hi = wb.max(axis=-1, keepdims=True)
    lo = wb.min(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(levels)
    q = np.trunc((wb - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, levels)
    return d, lo, q


def _q4_1(wb: np.ndarray) -> np.ndarray:
    d, lo, q = _affine(wb, 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q, 16)], axis=-1)


def _q5_1(wb: np.ndarray) -> np.ndarray:
    d, lo, q = _affine(wb, 31)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack_high(q), _pack_nibbles(q, 16)], axis=-1)


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
    return np.concatenate([_fp16_bytes(best_d), _pack_nibbles(codes, 16)], axis=-1)


# --- Super-block formats: least-squares choice of scales and codes ---------------------------------------
#
# Objective per super-block: the squared error sum (w - w')^2 of its dequantized weights w'.
# Stage 1 fits every sub-block alone with continuous parameters: a scale, and for Q4_K/Q5_K a min <= 0 (GGUF
# stores -dmin*m with dmin, m >= 0). Candidates map the sub-block's signed extreme (with a min: its range)
# onto the end levels with a spread of divisors (llama.cpp's make_qx/make_qkx2 searches); each gets nearest
# codes and the least-squares refit of its parameters for those codes, and the best refit wins.
# Stage 2 stores them: the fp16 super-block scale maps the extreme sub-block scale onto the end of the
# integer range, and every sub-block takes the integer just below or above its target (scale and min: four
# pairs), whichever has the smaller exact error with nearest codes. Then the fp16 super-block scale(s) are
# refit by least squares for the chosen integers and codes, stage 2 runs again and the better one stays.
# The plain rule (stage 1 replaced by extreme / end level, or range / top level) also goes through stage 2,
# and every super-block keeps the encoding of least error: none is worse than the plain rule's.

_SPREAD_LOW = np.array([1.09, 1.045, 1.0, 0.955, 0.91])  # divisors: the lowest level times these...
_SPREAD_HIGH = np.array([0.955, 1.0, 1.045])  # ...and the highest level times these
_RANGE_STEPS = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])  # with a min: range / (top level + step)


class _Encoding(NamedTuple):
    """One way to store a chunk of super-blocks, and its error."""

    d: np.ndarray  # float64 [B]: the fp16 super-block scale's value
    dmin: np.ndarray  # float64 [B]: the fp16 super-block min scale's value (zeros without mins)
    scales: np.ndarray  # float64 [B, G]: integer sub-block scales
    mins: np.ndarray  # float64 [B, G]: integer sub-block mins (zeros without mins)
    codes: np.ndarray  # uint8 [B, G, S]: stored codes (level indices)
    err: np.ndarray  # float64 [B]: squared error


def _levels(book: Codebook) -> np.ndarray:
    """The code values a sub-block scale multiplies, ascending, float64, indexed by the stored code."""
    if book.table:
        return _KV_F64
    top = 1 << book.code_bits
    return np.arange(top, dtype=np.float64) - (0 if book.asymmetric else top // 2)


def _nearest(book: Codebook, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stored codes (uint8) whose levels are nearest to y (float64), and those levels."""
    if book.table:
        x = y * 2 + _HALF_RANGE
        np.clip(x, 0, 2 * _HALF_RANGE - 1, out=x)
        bins = x.astype(np.intp)
        return np.take(_NEAREST_NIBBLE, bins), np.take(_NEAREST_KV64, bins)
    levels = _levels(book)
    values = np.clip(np.rint(y), levels[0], levels[-1])
    return (values - levels[0]).astype(np.uint8), values


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, and 0 where b == 0 (a finite; b may be the smaller operand of a broadcast)."""
    return a / np.where(b == 0, 1.0, b) * (b != 0)


def _total(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis (einsum: several times faster than .sum over a short axis)."""
    return np.einsum("...s->...", v)


def _squared_error(s: np.ndarray, m: np.ndarray, n: int, sx: np.ndarray, sxx: np.ndarray, sq: np.ndarray,
                   sqq: np.ndarray, sxq: np.ndarray) -> np.ndarray:
    """sum (x - s*q - m)^2 over n elements from the sums of x, x^2, q, q^2, x*q. The expansion cancels to
    ~1e-16*sum(x^2): enough to rank encodings."""
    return sxx - 2 * s * sxq - 2 * m * sx + s * s * sqq + 2 * s * m * sq + n * m * m


def _signed_extreme(v: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis (positive on a tie)."""
    hi, lo = v.max(axis=-1), v.min(axis=-1)
    return np.where(hi >= -lo, hi, lo)


_Params = tuple[np.ndarray, np.ndarray]  # per sub-block (scale, min), float64 [B, G]


def _fit_subblocks(book: Codebook, x: np.ndarray) -> tuple[_Params, _Params]:
    """Stage 1 for x float64 [B, G, S]: the fitted (scale, min) and the plain rule's, each [B, G]."""
    levels = _levels(book)
    zero = np.zeros(x.shape[:2])
    if book.asymmetric:
        lo = np.minimum(x.min(axis=-1), 0)
        span = x.max(axis=-1) - lo
        plain = (span / levels[-1], lo)
        starts = [(span / (levels[-1] + step), lo) for step in _RANGE_STEPS]
    else:
        ext = _signed_extreme(x)
        plain = (ext / levels[0], zero)
        starts = [(ext / div, zero) for div in np.concatenate([levels[0] * _SPREAD_LOW, levels[-1] * _SPREAD_HIGH])]
    n, sx, sxx = x.shape[-1], _total(x), np.einsum("bgs,bgs->bg", x, x)
    best, best_err = plain, np.full(zero.shape, np.inf)
    for s0, m0 in starts:
        q = _nearest(book, (x - m0[..., None]) * _div(1.0, s0)[..., None])[1]
        sq, sqq, sxq = _total(q), np.einsum("bgs,bgs->bg", q, q), np.einsum("bgs,bgs->bg", x, q)
        if book.asymmetric:  # least squares in (s, m); m > 0 is not storable, so then m = 0
            det = n * sqq - sq * sq
            s = _div(n * sxq - sx * sq, det)
            m = np.where(det == 0, sx / n, (sx - s * sq) / n)
            s = np.where(m > 0, _div(sxq, sqq), s)
            m = np.minimum(m, 0)
        else:
            s, m = _div(sxq, sqq), zero
        err = _squared_error(s, m, n, sx, sxx, sq, sqq, sxq)
        better = err < best_err
        best = (np.where(better, s, best[0]), np.where(better, m, best[1]))
        best_err = np.where(better, err, best_err)
    return best, plain


def _integers(book: Codebook, x: np.ndarray, s: np.ndarray, m: np.ndarray, d: np.ndarray,
              dmin: np.ndarray) -> _Encoding:
    """Stage 2 for given super-block scales: per sub-block the best integers next to the targets s, m."""
    sub = book.subscales
    assert sub is not None
    around = [np.floor(_div(target, scale[:, None])) + step
              for target, scale in ((s, d), (-m, dmin)) for step in (0, 1)]
    scales = [np.clip(k, sub.lo, sub.hi) for k in around[:2]]
    mins = [np.clip(k, 0, sub.hi) for k in around[2:]] if book.asymmetric else [np.zeros_like(s)]
    n, sx, sxx = x.shape[-1], _total(x), np.einsum("bgs,bgs->bg", x, x)
    best = _Encoding(d, dmin, scales[0], mins[0], np.zeros(x.shape, np.uint8), np.full(s.shape, np.inf))
    for k, mk in itertools.product(scales, mins):
        dw, mw = d[:, None] * k, -(dmin[:, None] * mk)
        # Nearest codes are optimal for this d_w, m_w (a reciprocal may flip an exact tie: same error).
        codes, v = _nearest(book, (x - mw[..., None]) * _div(1.0, dw)[..., None])
        err = _squared_error(dw, mw, n, sx, sxx, _total(v), np.einsum("bgs,bgs->bg", v, v),
                             np.einsum("bgs,bgs->bg", x, v))
        better = err < best.err
        best = _Encoding(d, dmin, np.where(better, k, best.scales), np.where(better, mk, best.mins),
                         np.where(better[..., None], codes, best.codes), np.minimum(err, best.err))
    return best._replace(err=best.err.sum(axis=-1))


def _fp16_value(d: np.ndarray) -> np.ndarray:
    """float64 -> the value of its saturating fp16 rounding (never inf, never -0)."""
    return _fp16_round(d).astype(np.float64) + 0.0


def _refit(book: Codebook, x: np.ndarray, e: _Encoding) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares super-block scale(s) for the integers and codes of e: x ~ d*(k*level) - dmin*m."""
    a = e.scales[..., None] * _levels(book)[e.codes]
    saa, sxa = np.einsum("bgs,bgs->b", a, a), np.einsum("bgs,bgs->b", x, a)
    if not book.asymmetric:
        return _fp16_value(_div(sxa, saa)), e.dmin
    sab = np.einsum("bg,bg->b", e.mins, _total(a))
    sbb = np.einsum("bg,bg->b", e.mins, e.mins) * x.shape[-1]
    sxb = np.einsum("bg,bg->b", e.mins, _total(x))
    det = sab * sab - saa * sbb
    d = np.where(det == 0, _div(sxa, saa), _div(sab * sxb - sxa * sbb, det))
    return _fp16_value(d), np.where(det == 0, e.dmin, _fp16_value(_div(saa * sxb - sab * sxa, det)))


def _better(a: _Encoding, b: _Encoding) -> _Encoding:
    """Per super-block, the encoding of smaller error (a on ties)."""
    pick = b.err < a.err
    return _Encoding(*(np.where(pick.reshape(-1, *[1] * (u.ndim - 1)), v, u) for u, v in zip(a, b, strict=True)))


def _store(book: Codebook, x: np.ndarray, s: np.ndarray, m: np.ndarray) -> _Encoding:
    """Stage 2 for targets s, m [B, G]: the super-block scale(s) from the extremes, then refit once."""
    sub = book.subscales
    assert sub is not None
    d = _fp16_value(_signed_extreme(s) / (sub.lo if sub.lo < 0 else sub.hi))
    dmin = _fp16_value(np.max(-m, axis=-1) / sub.hi)
    first = _integers(book, x, s, m, d, dmin)
    return _better(first, _integers(book, x, s, m, *_refit(book, x, first)))


def _superblock(book: Codebook, wb: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> GGUF super-block bytes [B, block_bytes]."""
    sub = book.subscales
    assert sub is not None
    x = wb.astype(np.float64).reshape(len(wb), sub.count, -1)
    fitted, plain = _fit_subblocks(book, x)
    e = _better(_store(book, x, *fitted), _store(book, x, *plain))
    codes = e.codes.reshape(len(wb), -1)
    fields: dict[str, Callable[[], np.ndarray]] = {
        "d": lambda: _fp16_bytes(e.d),
        "m": lambda: _fp16_bytes(e.dmin),
        "sc": lambda: sub.encode(e.scales, e.mins),
        "qh": lambda: _pack_kq_high(codes >> np.uint8(4), book.code_bits - 4),
        "qs": lambda: _pack_nibbles(codes, book.nibble_run),
    }
    return np.concatenate([fields[name]() for name, _ in book.layout], axis=-1)


_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "IQ4_NL": _iq4_nl,
    **{name: functools.partial(_superblock, _BOOKS[name]) for name in SUPERBLOCK},
}


def quantize(codebook: str, w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> GGUF block bytes uint8 [N, K/weights*block_bytes]."""
    book = get(codebook)
    w = _check_weights(book, w)
    n, k = w.shape
    wb = w.reshape(-1, book.weights)
    out = np.empty((wb.shape[0], book.block_bytes), dtype=np.uint8)
    encode = _ENCODERS[book.name]
    step = _CHUNK_WEIGHTS // book.weights
    # Blocks are independent, so chunking changes nothing but speed. Overflow / division warnings are
    # expected for extreme (still finite) inputs and match the reference's results.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, wb.shape[0], step):
            out[start : start + step] = encode(wb[start : start + step])
    return out.reshape(n, k // book.weights * book.block_bytes)
