"""Execution layout (docs/contract.md §2): GGUF block bytes <-> block-major planes the kernels read.

Planes are [KB][N][...] so the threads of a warp that own consecutive outputs read consecutive 16-byte
payloads. Super-block formats split their codes (qs, qh) into one run per 32-block, [KB][N][...] as well,
and keep their scale fields compact, one row per super-block: [KB/8][N][...]. Packing is a lossless byte
shuffle: unpack(pack(blocks)) == blocks, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .codebooks import Codebook, check_blocks, get
from .errors import BLOCK, InputError

# GGUF field -> (plane, dtype). qs and qh are split into runs, one per 32-block (_runs).
_PLANES = {"qs": ("payload", np.uint32), "d": ("scale", np.float16), "m": ("min", np.float16),
           "qh": ("high", np.uint32), "sc": ("sub", np.uint8)}


@dataclass(frozen=True)
class PackedWeights:
    codebook: str  # source format, e.g. "Q4_0"
    execution: str  # execution codebook key (the runtime dispatch key)
    n: int
    k: int
    payload: np.ndarray  # uint32 [KB, N, payload_bytes/4], GGUF nibble order kept
    scale: np.ndarray  # float16 [KB, N]; super-block formats: d, [KB/8, N]
    min: np.ndarray | None  # float16 [KB, N], asymmetric codebooks only; K-quants: dmin, [KB/8, N]
    high: np.ndarray | None  # uint32 [KB, N], Q5 formats and Q5_K; Q6_K: [KB, N, 2]
    sub: np.ndarray | None = None  # uint8 [KB/8, N, sc bytes]: sub-block scales, super-block formats only

    @property
    def kb(self) -> int:
        return self.k // BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes a kernel must read: every plane once."""
        return sum(plane.nbytes for plane in self.planes().values())

    def planes(self) -> dict[str, np.ndarray]:
        """The planes that exist for this codebook, in a fixed order (payload, scale, min, high, sub)."""
        named = {"payload": self.payload, "scale": self.scale, "min": self.min, "high": self.high, "sub": self.sub}
        return {name: plane for name, plane in named.items() if plane is not None}


def _runs(book: Codebook, name: str) -> int:
    """Rows per GGUF block of field `name`'s plane: one per 32-block for codes, else one."""
    return book.weights // BLOCK if name in ("qs", "qh") else 1


def _plane(book: Codebook, blocks3: np.ndarray, name: str) -> np.ndarray:
    """Field `name` of every block moved to block-major order, [NB*runs, N, ...] in its plane's dtype.

    Always a fresh, aligned copy: planes never alias the caller's buffer (even when N = KB = 1)."""
    n, nb, _ = blocks3.shape
    runs, (_, dtype) = _runs(book, name), _PLANES[name]
    raw = blocks3[:, :, book.span(name)].reshape(n, nb, runs, -1).transpose(1, 2, 0, 3).copy()
    plane = raw.view(dtype).reshape(nb * runs, n, -1)
    return plane[:, :, 0] if plane.shape[2] == 1 else plane


def plane_shapes(codebook: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The shape and dtype of each plane `pack` makes of an N×K matrix, by plane name (payload, scale, ...)."""
    book = get(codebook)
    shapes = {}
    for name, size in book.layout:
        plane, dtype = _PLANES[name]
        runs, itemsize = _runs(book, name), np.dtype(dtype).itemsize
        rows, width = k // book.weights * runs, size // runs // itemsize
        shapes[plane] = ((rows, n) if width == 1 else (rows, n, width), np.dtype(dtype))
    return shapes


def random_planes(codebook: str, n: int, k: int, rng: Any, xp: Any = np) -> dict[str, Any]:
    """Timing and certification inputs: every plane of the format (plane_shapes) as an `xp` array (numpy, or
    CuPy with a cupy.random.Generator), random codes and sub-block scales, fp16 scales and mins finite in
    [1e-3, 1e-2): never zeros or special values."""

    def fill(shape: tuple[int, ...], dtype: np.dtype) -> Any:
        if dtype == np.float16:
            return (rng.random(shape, dtype=xp.float32) * 9e-3 + 1e-3).astype(xp.float16)
        return rng.integers(0, 1 << (8 * dtype.itemsize), size=shape, dtype=xp.uint64).astype(dtype)

    return {name: fill(*spec) for name, spec in plane_shapes(codebook, n, k).items()}


def pack(codebook: str, blocks: np.ndarray, n: int, k: int) -> PackedWeights:
    """GGUF block bytes uint8 [N, K/weights*block_bytes] -> execution planes."""
    book = get(codebook)
    if n <= 0:
        raise InputError(f"N must be positive, got N={n}")
    blocks, k = check_blocks(book, blocks, k)
    if blocks.shape[0] != n:
        raise InputError(f"{book.name} blocks for N={n}, K={k} must have {n} rows, got shape {blocks.shape}")
    blocks3 = blocks.reshape(n, k // book.weights, book.block_bytes)
    planes = {_PLANES[name][0]: _plane(book, blocks3, name) for name, _ in book.layout}
    return PackedWeights(codebook=book.name, execution=book.execution, n=n, k=k, payload=planes["payload"],
                         scale=planes["scale"], min=planes.get("min"), high=planes.get("high"),
                         sub=planes.get("sub"))


def unpack(packed: PackedWeights) -> np.ndarray:
    """Execution planes -> the exact GGUF block bytes uint8 [N, K/weights*block_bytes]."""
    book = get(packed.codebook)
    n, nb = packed.n, packed.k // book.weights
    blocks3 = np.empty((n, nb, book.block_bytes), dtype=np.uint8)
    planes = packed.planes()
    for name, _ in book.layout:
        runs = _runs(book, name)
        as_bytes = np.ascontiguousarray(planes[_PLANES[name][0]]).view(np.uint8).reshape(nb, runs, n, -1)
        blocks3[:, :, book.span(name)] = as_bytes.transpose(2, 0, 1, 3).reshape(n, nb, -1)
    return blocks3.reshape(n, nb * book.block_bytes)
