"""The GEMV kernels on the CPU: a kernel source built with g++ against cuda_host.h (-DGEMV_HOSTSIM), launched
by template name through ctypes with numpy planes and activations, in the layouts the GPU reads.

A test oracle, not a device: it runs the kernels' own decode, index and accumulation code with one fiber per
CUDA thread, so a layout or arithmetic mistake shows up on a machine without a GPU. Timing, caches and the
PTX assembler's choices are the GPU's to judge.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from gemv_dispatch.kernels import launch, program
from gemv_dispatch.kernels.emulate import QuantizedActivations
from gemv_dispatch.kernels.errors import BLOCK
from gemv_dispatch.kernels.layout import PackedWeights
from gemv_dispatch.kernels.registry import Candidate, ticket_words

HERE = Path(__file__).parent
FLAGS = ("-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-w")


def entry(signature: str) -> str:
    """gemv_entry<F>: kernel F called with void* arguments in its parameter order, scalars by pointer."""
    types = [t.strip() for t in signature.strip("()").split(",")]
    args = ", ".join(f"*(const int*)a[{i}]" if t == "int" else f"({t})a[{i}]" for i, t in enumerate(types))
    return f"template <auto F>\nvoid gemv_entry(void* const* a) {{ F({args}); }}\n"


def unit(kernel_names: tuple[str, ...]) -> str:
    """The translation unit: the shim, the kernel source, and an entry per instantiation (launcher.h)."""
    rows = [("quantize_activations", "quantize_entry"), *((name, f"gemv_entry<&{name}>") for name in kernel_names)]
    table = ",\n".join(f'    {{"{name}", {run}}}' for name, run in rows)
    return (f'#define GEMV_HOSTSIM 1\n#include "{HERE / "cuda_host.h"}"\n#include "{program.SOURCE_PATH}"\n'
            f'#include "{HERE / "launcher.h"}"\n{entry(program.declared_signature(program.source()))}'
            f"const Entry entries[] = {{\n{table}\n}};\nconst int entry_count = {len(rows)};\n")


def cache_dir() -> Path:
    return Path(os.environ.get("GEMV_HOSTSIM_CACHE", Path(tempfile.gettempdir()) / "gemv-hostsim"))


@cache
def build(kernel_names: tuple[str, ...]) -> Simulator:
    """Compile the kernel source for the host with these instantiations (cached by content in cache_dir())."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("g++ is not on PATH")
    text = unit(tuple(sorted(kernel_names)))
    headers = [(HERE / name).read_text() for name in ("cuda_host.h", "launcher.h")]
    key = hashlib.sha256("\0".join([text, program.source(), *headers, *FLAGS]).encode())
    library = cache_dir() / f"{key.hexdigest()[:24]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "unit.cpp", Path(tmp) / "unit.so"
            src.write_text(text)
            done = subprocess.run([compiler, *FLAGS, "-o", str(out), str(src)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"g++ failed ({done.returncode}):\n{done.stderr[-6000:]}")
            os.replace(out, library)
    return Simulator(ctypes.CDLL(str(library)))


def pointer(a: np.ndarray | None) -> ctypes.c_void_p:
    """A numpy array's data as a kernel argument (None: a null pointer)."""
    return ctypes.c_void_p(0 if a is None else a.ctypes.data)


@dataclass
class Simulator:
    lib: ctypes.CDLL

    def launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], shared: int,
               args: list[ctypes.c_void_p]) -> None:
        array = (ctypes.c_void_p * len(args))(*args)
        failed = self.lib.hostsim_launch(name.encode(), ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
                                         ctypes.c_uint(block[0]), ctypes.c_uint(block[1]), ctypes.c_ulong(shared),
                                         array)
        if failed == 1:
            raise KeyError(f"{name} is not built into this simulator")
        if failed == 3:
            raise RuntimeError(f"{name}: a CTA wrote past its {shared} bytes of dynamic shared memory")
        if failed:
            raise RuntimeError(f"{name}: the threads of a CTA deadlocked at barriers")

    def gemv(self, candidate: Candidate, packed: PackedWeights, qa: QuantizedActivations,
             poison: np.uint32, ws: np.ndarray | None = None) -> np.ndarray:
        """y float32 [M, N] by `candidate` into a buffer filled with `poison` bits; kpar folds in the same launch,
        through `ws` (default: a new one of zero tickets and NaN partials), whose tickets it must leave zero."""
        m, n, k = qa.m, packed.n, packed.k
        planes = [None if p is None else np.ascontiguousarray(p)  # in the source's order, as kernels.launch passes
                  for p in (getattr(packed, launch.PLANE_FIELDS[name]) for name in program.planes())]
        # Block-major activations ([KB][M]), as launch.quantize_activations writes them.
        q = np.ascontiguousarray(qa.q.transpose(1, 0, 2))
        d, s = np.ascontiguousarray(qa.d.T), np.ascontiguousarray(qa.sum.T)
        ints = [np.array([v], dtype=np.int32) for v in (m, n, k // BLOCK, candidate.partition_width(k))]
        out = np.full((m, n), poison, dtype=np.uint32).view(np.float32)
        grid, block = candidate.launch_geometry(m, n, k)
        if candidate.grid_split and ws is None:  # zero tickets, NaN partials
            ws = launch.new_workspace(candidate.workspace_bytes(m, n, k), n, np)
        name = candidate.kernel_name(packed.codebook, m)
        self.launch(name, grid, block, candidate.shared_bytes(m, k, packed.codebook),
                    [*map(pointer, planes), pointer(q), pointer(d), pointer(s), *map(pointer, ints), pointer(out),
                     pointer(ws if candidate.grid_split else None)])
        if candidate.grid_split and ws[: ticket_words(n)].view(np.uint32).any():
            raise AssertionError(f"{name}: the kpar tickets were not reset")
        return out


