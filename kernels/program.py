"""The CUDA program: source text, its digest, and the compile options every build uses.

The options are part of the arithmetic contract: no FMA contraction, no flush-to-zero, IEEE division.
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from pathlib import Path

SOURCE_PATH = Path(__file__).with_name("cuda") / "gemv.cu"
# Shared by NVRTC (CuPy) and nvcc (the compile check); the architecture flag is added by each builder.
# CuPy appends -ftz=true to every NVRTC build, so the source writes its float operations as explicit
# non-ftz PTX; the compile check builds with FORCED_BY_CUPY too and asserts no .ftz instruction remains.
MAX_REGISTERS = 128  # per thread: every instantiation must fit without spills (the compile check)
CONTRACT_OPTIONS = ("--std=c++17", "--fmad=false", "--prec-div=true", "--prec-sqrt=true",
                    f"--maxrregcount={MAX_REGISTERS}")
FORCED_BY_CUPY = ("-ftz=true",)
HELPER_KERNELS = ("quantize_activations",)


@cache
def source() -> str:
    return SOURCE_PATH.read_text()


@cache
def digest() -> str:
    """SHA-256 of the kernel source and options: the provenance key of every timing and certificate."""
    h = hashlib.sha256(source().encode())
    h.update("\0".join(CONTRACT_OPTIONS).encode())
    return h.hexdigest()


def declared_params(text: str, kernel: str = "gemv_partial") -> list[tuple[str, str]]:
    """(type, name) of each parameter of `kernel` as declared in a kernel source; a parameter list written as the
    macro GEMV_PARAMS is read from the macro's definition."""
    # The bounds may call a constexpr function: one level of nested parentheses.
    bounds = r"__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+"
    head = re.search(rf"__global__\s+void\s+(?:{bounds})?{kernel}\s*\(([^)]*)\)", text)
    if head is None:
        raise ValueError(f"no __global__ {kernel} in the kernel source")
    params = head.group(1).strip()
    if params == "GEMV_PARAMS":
        macro = re.search(r"#define GEMV_PARAMS((?:.*\\\n)*.*)", text)
        assert macro is not None, "GEMV_PARAMS is used but not defined"
        params = macro.group(1).replace("\\\n", " ")
    declared = [re.sub(r"\s+", " ", p.replace("__restrict__", "")).strip().rsplit(" ", 1) for p in params.split(",")]
    return [(kind.replace(" *", "*"), name) for kind, name in declared]


def declared_signature(text: str, kernel: str = "gemv_partial") -> str:
    """The parameter types of `kernel`, e.g. "(const u32*, ..., int, float*)", as an instantiation names them."""
    return "(" + ", ".join(kind for kind, _ in declared_params(text, kernel)) + ")"


def declared_planes(text: str) -> tuple[str, ...]:
    """The weight planes a kernel source's GEMV kernels take, in order: the parameters before the activations."""
    names = [name for _, name in declared_params(text)]
    return tuple(names[: names.index("qa")])


@cache
def planes() -> tuple[str, ...]:
    """declared_planes of the source: what kernels.launch passes."""
    return declared_planes(source())


def explicit_instantiations(kernel_names: list[str], text: str | None = None) -> str:
    """A translation unit that instantiates each template kernel of a kernel source (default: the package's), for
    nvcc."""
    text = source() if text is None else text
    params = declared_signature(text)
    return "\n".join([text, *(f"template __global__ void {name}{params};" for name in kernel_names)]) + "\n"
