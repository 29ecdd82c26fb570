"""Shape features of the dispatch policy (docs/policy.md §6): integer arithmetic only.

Every feature is built from + - * // min max and int.bit_length on Python ints, so the generated Python
module and the C header (docs/policy.md §8) can re-implement them exactly (C: int64, N·K and byte counts stay far
below 2^63 for any real matrix). Ratios are scaled integers (x64) instead of floats; a tree threshold over
an integer feature is an integer, so "value <= threshold" needs no float anywhere.

A codebook enters only through its decode properties (block bytes, asymmetric, high bits, table lookup),
not through an index: a codebook added later does not renumber the others, and aliases (one execution key)
share one set of properties.
"""

from __future__ import annotations

from ...kernels.codebooks import EXECUTION, formats_of, get
from ...kernels.errors import BLOCK
from ..common.contract import MODES

WAVE_OUTPUTS = 128  # outputs per CTA of the canonical wide launch; the unit of the "waves" features
SCALE = 64  # fixed-point scale of the ratio features

CODEBOOK_FEATURES: tuple[str, ...] = ("block_bytes", "asymmetric", "high_bits", "table")
IDENTITY_FEATURES: tuple[str, ...] = (
    *CODEBOOK_FEATURES, "n", "k", "nk", "weight_kib", "n_per_k_x64", "k_per_n_x64", "waves_x64",
)
LAUNCH_FEATURES: tuple[str, ...] = (*IDENTITY_FEATURES, "identity", "width", "split_waves_x64", "m", "m_tile", "mode")


def execution_codebooks() -> tuple[str, ...]:
    """Every execution codebook key (the dispatch key), sorted."""
    return tuple(sorted(set(EXECUTION.values())))


def codebook_features(codebook: str) -> dict[str, int]:
    """Decode properties of an execution codebook key (e.g. "q4_0", any case): ints, identical for its aliases.

    Raises InputError for an unknown key."""
    book = get(formats_of(codebook)[0])  # aliases share the execution arithmetic, hence these properties
    return {"block_bytes": book.block_bytes, "asymmetric": int(book.asymmetric), "high_bits": int(book.high_bits),
            "table": int(book.name.startswith("IQ"))}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def weight_bytes(codebook: str, n: int, k: int) -> int:
    """Bytes of the N×K weights in `codebook` (an execution key): a GGUF block holds `weights` weights (256 for
    a super-block format) in `block_bytes` bytes. k a multiple of the block's weights."""
    book = get(formats_of(codebook)[0])
    return n * (k // book.weights) * book.block_bytes


def identity_features(codebook: str, n: int, k: int, sm_count: int) -> dict[str, int]:
    """Features of a (codebook, N, K) for the identity tree; keys in IDENTITY_FEATURES order.

    n >= 1, k a positive multiple of 32, sm_count >= 1 (the GPU's SMs, from the corpus provenance).
    weight_kib: KiB of weight blocks read, counted as if every block held 32 weights, so it is 8× the true
    size for a super-block format (block_bytes is per 256 weights: weight_bytes is the true size). It stays
    so: the committed policy's trees split on this value, and a corrected feature moves their thresholds,
    which changes the table's decisions and needs a GPU to re-certify. waves_x64: CTAs of the canonical wide
    launch per SM, x64."""
    kb = k // BLOCK
    feats = codebook_features(codebook)
    feats.update(
        n=n, k=k, nk=n * k,
        weight_kib=n * kb * feats["block_bytes"] // 1024,
        n_per_k_x64=SCALE * n // k,
        k_per_n_x64=SCALE * k // n,
        waves_x64=SCALE * _ceil_div(n, WAVE_OUTPUTS) // sm_count,
    )
    return feats


def launch_features(codebook: str, identity: int, m: int, n: int, k: int, mode: str,
                    sm_count: int) -> dict[str, int]:
    """Features of (codebook, identity S, M, N, K, mode) for the launch tree; keys in LAUNCH_FEATURES order.

    width: blocks per K partition, ceil(KB / S); split_waves_x64: CTAs of a grid split S ways per SM, x64;
    m_tile: the power of two >= M (the row tile the kernels round M up to); mode: index in MODES."""
    feats = identity_features(codebook, n, k, sm_count)
    feats.update(
        identity=identity,
        width=_ceil_div(k // BLOCK, identity),
        split_waves_x64=SCALE * _ceil_div(n, WAVE_OUTPUTS) * identity // sm_count,
        m=m,
        m_tile=1 << (m - 1).bit_length(),
        mode=MODES.index(mode),
    )
    return feats
