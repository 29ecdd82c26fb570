"""The CUDA program: source text, its digest, and the compile options every build uses.

The options are part of the arithmetic contract: no FMA contraction, no flush-to-zero, IEEE division.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

SOURCE_PATH = Path(__file__).with_name("cuda") / "gemv.cu"
# Shared by NVRTC (CuPy) and nvcc (the compile check); the architecture flag is added by each builder.
# CuPy appends -ftz=true to every NVRTC build, so the source writes its float operations as explicit
# non-ftz PTX; the compile check builds with FORCED_BY_CUPY too and asserts no .ftz instruction remains.
CONTRACT_OPTIONS = ("--std=c++17", "--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--maxrregcount=128")
FORCED_BY_CUPY = ("-ftz=true",)
HELPER_KERNELS = ("quantize_activations", "fold_partials")


@cache
def source() -> str:
    return SOURCE_PATH.read_text()


@cache
def digest() -> str:
    """SHA-256 of the kernel source and options: the provenance key of every timing and certificate."""
    h = hashlib.sha256(source().encode())
    h.update("\0".join(CONTRACT_OPTIONS).encode())
    return h.hexdigest()


# The parameter types of every GEMV template kernel of the source (payload, high, scale, min, activations q,
# d_a, sum_a, M, N, KB, partition width, out).
SIGNATURE = (
    "(const u32*, const u32*, const u16*, const u16*, const int*, const float*, const int*, int, int, int, int, float*)"
)


def explicit_instantiations(kernel_names: list[str], text: str | None = None, signature: str = SIGNATURE) -> str:
    """A translation unit that instantiates each template kernel of `text` (the source), for building with nvcc."""
    body = source() if text is None else text
    return "\n".join([body, *(f"template __global__ void {name}{signature};" for name in kernel_names)]) + "\n"
