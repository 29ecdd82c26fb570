"""Execution layout (docs/contract.md §2): GGUF block bytes <-> block-major planes the kernels read.

Planes are [KB][N][...] so the threads of a warp that own consecutive outputs read consecutive 16-byte
payloads. Packing is a lossless byte shuffle: unpack(pack(blocks)) == blocks, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gemv_dispatch.kernels.codebooks import check_blocks, get
from gemv_dispatch.kernels.errors import BLOCK, InputError


@dataclass(frozen=True)
class PackedWeights:
    codebook: str  # source format, e.g. "Q4_0"
    execution: str  # execution codebook key (the runtime dispatch key)
    n: int
    k: int
    payload: np.ndarray  # uint32 [KB, N, payload_bytes/4], GGUF nibble order kept
    scale: np.ndarray  # float16 [KB, N]
    min: np.ndarray | None  # float16 [KB, N], asymmetric codebooks only
    high: np.ndarray | None  # uint32 [KB, N], Q5 formats only

    @property
    def kb(self) -> int:
        return self.k // BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes a kernel must read: every plane once."""
        return sum(plane.nbytes for plane in self.planes().values())

    def planes(self) -> dict[str, np.ndarray]:
        """The planes that exist for this codebook, in a fixed order (payload, scale, min, high)."""
        named = {"payload": self.payload, "scale": self.scale, "min": self.min, "high": self.high}
        return {name: plane for name, plane in named.items() if plane is not None}


def _field(blocks3: np.ndarray, offset: int, size: int) -> np.ndarray:
    """Bytes [offset, offset+size) of every block, moved to block-major order [KB, N, size].

    Always a fresh, aligned copy: planes never alias the caller's buffer (even when N = KB = 1)."""
    return blocks3[:, :, offset : offset + size].transpose(1, 0, 2).copy()


def pack(codebook: str, blocks: np.ndarray, n: int, k: int) -> PackedWeights:
    """GGUF block bytes uint8 [N, KB*block_bytes] -> execution planes."""
    book = get(codebook)
    if n <= 0:
        raise InputError(f"N must be positive, got N={n}")
    blocks, k = check_blocks(book, blocks, k)
    if blocks.shape[0] != n:
        raise InputError(f"{book.name} blocks for N={n}, K={k} must have {n} rows, got shape {blocks.shape}")
    kb = k // BLOCK
    blocks3 = blocks.reshape(n, kb, book.block_bytes)
    return PackedWeights(
        codebook=book.name,
        execution=book.execution,
        n=n,
        k=k,
        payload=_field(blocks3, book.qs_offset, book.payload_bytes).view(np.uint32).reshape(kb, n, -1),
        scale=_field(blocks3, book.d_offset, 2).view(np.float16).reshape(kb, n),
        min=_field(blocks3, book.m_offset, 2).view(np.float16).reshape(kb, n) if book.asymmetric else None,
        high=_field(blocks3, book.qh_offset, 4).view(np.uint32).reshape(kb, n) if book.high_bits else None,
    )


def unpack(packed: PackedWeights) -> np.ndarray:
    """Execution planes -> the exact GGUF block bytes uint8 [N, KB*block_bytes]."""
    book = get(packed.codebook)
    n, kb = packed.n, packed.kb
    blocks3 = np.empty((n, kb, book.block_bytes), dtype=np.uint8)

    def put(plane: np.ndarray, offset: int) -> None:
        as_bytes = np.ascontiguousarray(plane).view(np.uint8).reshape(kb, n, -1)
        blocks3[:, :, offset : offset + as_bytes.shape[2]] = as_bytes.transpose(1, 0, 2)

    put(packed.scale, book.d_offset)
    put(packed.payload, book.qs_offset)
    if packed.min is not None:
        put(packed.min, book.m_offset)
    if packed.high is not None:
        put(packed.high, book.qh_offset)
    return blocks3.reshape(n, kb * book.block_bytes)
