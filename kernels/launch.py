"""Launchers (CuPy): move weights to the device, quantize activations, launch a candidate on a stream.

Every launch goes to an explicit stream; the null stream is refused (DESIGN §3). The module for a codebook is
compiled once per process by NVRTC with the contract's options, for the device's own architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from gemv_dispatch.kernels import program
from gemv_dispatch.kernels.codebooks import get
from gemv_dispatch.kernels.emulate import QuantizedActivations
from gemv_dispatch.kernels.errors import BLOCK, InputError
from gemv_dispatch.kernels.layout import PackedWeights
from gemv_dispatch.kernels.registry import FOLD_THREADS, Candidate, kernel_names

try:
    import cupy
except ImportError:  # the CPU stages never launch; only calling into this module needs CuPy
    cupy = None


def require_cupy() -> Any:
    if cupy is None:
        raise InputError("CuPy is not installed: install the 'cuda' extra (pip install '.[cuda]')")
    return cupy


def require_device() -> Any:
    """CuPy, once a CUDA device is known to be usable; otherwise one clear InputError."""
    cp = require_cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as err:
        raise InputError(f"no usable CUDA device: {err}") from None
    if count == 0:
        raise InputError("no CUDA device is visible")
    return cp


@dataclass(frozen=True)
class DeviceWeights:
    codebook: str
    n: int
    k: int
    payload: Any  # cupy uint32 [KB, N, words]
    scale: Any  # cupy uint16 (fp16 bits) [KB, N]
    min: Any | None
    high: Any | None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.payload, self.scale, self.min, self.high) if a is not None)


def to_device(packed: PackedWeights) -> DeviceWeights:
    cp = require_cupy()

    def put(plane: np.ndarray | None, view: Any = None) -> Any:
        if plane is None:
            return None
        return cp.asarray(plane.view(view) if view is not None else plane)

    return DeviceWeights(
        codebook=packed.codebook,
        n=packed.n,
        k=packed.k,
        payload=put(packed.payload),
        scale=put(packed.scale, np.uint16),
        min=put(packed.min, np.uint16),
        high=put(packed.high),
    )


def random_weights(codebook: str, n: int, k: int, rng: Any) -> DeviceWeights:
    """Device planes of random codes with finite fp16 scales and mins in [1e-3, 1e-2): timing inputs that
    are never zeros or special values. `rng` is a cupy.random.Generator."""
    cp = require_cupy()
    book, kb = get(codebook), k // BLOCK

    def halfs() -> Any:
        return (rng.random((kb, n), dtype=cp.float32) * 9e-3 + 1e-3).astype(cp.float16).view(cp.uint16)

    def words(*shape: int) -> Any:
        return rng.integers(0, 2**32, size=shape, dtype=cp.uint64).astype(cp.uint32)

    return DeviceWeights(book.name, n, k, words(kb, n, book.payload_bytes // 4), halfs(),
                         halfs() if book.asymmetric else None, words(kb, n) if book.high_bits else None)


def empty_activations(m: int, k: int) -> QuantizedActivations:
    """Device activations, indexed [M, KB(, BLOCK)] like the emulator's but stored block-major ([KB][M]): the M
    rows of a block are adjacent, so the fragment loads of the mma engine coalesce."""
    cp = require_cupy()
    kb = k // BLOCK
    return QuantizedActivations(
        q=cp.empty((kb, m, BLOCK), cp.int8).transpose(1, 0, 2),
        d=cp.empty((kb, m), cp.float32).T,
        sum=cp.empty((kb, m), cp.int32).T,
    )


def storage(qact: QuantizedActivations) -> tuple[np.uint64, np.uint64, np.uint64]:
    """Base pointers of the block-major buffers behind the [M, KB] views, as the kernels take them."""
    return tuple(np.uint64(a.data.ptr) for a in (qact.q, qact.d, qact.sum))


def is_block_major(qact: QuantizedActivations) -> bool:
    """Whether the [M, KB] views sit on block-major buffers, the only layout the kernels read."""
    return all(a.T.flags.c_contiguous if a.ndim == 2 else a.transpose(1, 0, 2).flags.c_contiguous
               for a in (qact.q, qact.d, qact.sum))


def check_stream(stream: Any) -> None:
    cp = require_cupy()
    if not isinstance(stream, cp.cuda.Stream) or stream.ptr == 0:
        raise InputError("launches need an explicit CuPy stream (cupy.cuda.Stream(non_blocking=True)), not stream 0")


@cache
def _module(codebook: str | None) -> Any:
    """The compiled instantiations of one codebook, or (None) the helper kernels; built once per process."""
    cp = require_cupy()
    names = list(kernel_names(codebook) if codebook else program.HELPER_KERNELS)
    return cp.RawModule(code=program.source(), options=program.CONTRACT_OPTIONS, name_expressions=names)


@cache
def _kernel(codebook: str | None, name: str) -> Any:
    """A compiled kernel, looked up once: launches sit on the timed host path of eager mode."""
    return _module(codebook).get_function(name)


def _helper(name: str) -> Any:
    return _kernel(None, name)


def quantize_activations(x: Any, stream: Any, out: QuantizedActivations | None = None) -> QuantizedActivations:
    """Device activation quantization (DESIGN §1) of float32 x [M, K]; non-finite values are rejected."""
    cp = require_cupy()
    check_stream(stream)
    if not isinstance(x, cp.ndarray) or x.dtype != cp.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise InputError("activations must be a C-contiguous 2-D float32 CuPy array [M, K]")
    m, k = x.shape
    if m < 1 or k < BLOCK or k % BLOCK:
        raise InputError(f"activations have shape {x.shape}; need M >= 1 and K a positive multiple of 32")
    with stream:
        if not bool(cp.isfinite(x).all()):
            raise InputError("activations contain non-finite values; they must be finite")
    out = out or empty_activations(m, k)
    kb = k // BLOCK
    if (out.m, out.kb) != (m, kb) or not is_block_major(out):
        raise InputError(f"`out` must be launch.empty_activations({m}, {k})")
    threads = 256
    with stream:
        _helper("quantize_activations")(
            (-(-m * kb * BLOCK // threads),), (threads,),  # one warp per (row, block)
            (x, np.int32(m), np.int32(kb), *storage(out)),
        )
    return out


def check_launch(candidate: Candidate, weights: DeviceWeights, qact: QuantizedActivations, out: Any,
                 workspace: Any) -> None:
    cp = require_cupy()
    m, n, k = qact.m, weights.n, weights.k
    if qact.kb * BLOCK != k:
        raise InputError(f"activations have K={qact.kb * BLOCK}, weights have K={k}")
    if not is_block_major(qact):
        raise InputError("activations must come from launch.quantize_activations (block-major device arrays)")
    reason = candidate.invalid_reason(m, n, k)
    if reason:
        raise InputError(f"candidate {candidate.id} cannot run M={m}, N={n}, K={k}: {reason}")
    if not isinstance(out, cp.ndarray) or out.dtype != cp.float32 or out.shape != (m, n) or not out.flags.c_contiguous:
        raise InputError(f"output must be a C-contiguous float32 CuPy array of shape ({m}, {n})")
    need = candidate.workspace_bytes(m, n, k)
    if need and (workspace is None or workspace.nbytes < need or workspace.dtype != cp.float32):
        raise InputError(f"candidate {candidate.id} needs a float32 workspace of {need} bytes")
    if out.device.id != weights.payload.device.id:
        raise InputError("output and weights are on different devices")


def bind(candidate: Candidate, copies: Sequence[DeviceWeights], qact: QuantizedActivations, out: Any, stream: Any,
         workspace: Any = None) -> Callable[[int], None]:
    """Check once and resolve everything a launch needs; `launch(i)` then enqueues y = W·x on `stream` with
    W = copies[i] (copies of one matrix, e.g. rotated for cold L2) and nothing left to compute on the host:
    eager timing measures the launch, not this setup. `out` float32 [M, N] receives y."""
    check_stream(stream)
    if not copies:
        raise InputError("bind needs at least one weights copy")
    first = copies[0]
    check_launch(candidate, first, qact, out, workspace)
    if any((w.codebook, w.n, w.k) != (first.codebook, first.n, first.k) for w in copies):
        raise InputError("weights copies must share one codebook and shape")
    m, n, k = qact.m, first.n, first.k
    kernel = _kernel(first.codebook, candidate.kernel_name(first.codebook, m))
    grid, block = candidate.launch_geometry(m, n, k)
    shared = candidate.shared_bytes(m)
    none = np.uint64(0)  # a null pointer for planes this codebook lacks
    tail = (*storage(qact), np.int32(m), np.int32(n), np.int32(k // BLOCK), np.int32(candidate.partition_width(k)),
            workspace if candidate.grid_split else out)
    args = [(w.payload, none if w.high is None else w.high, w.scale, none if w.min is None else w.min, *tail)
            for w in copies]
    if not candidate.grid_split:
        def launch(i: int) -> None:
            with stream:  # CuPy launches raw kernels on the current stream
                kernel(grid, block, args[i], shared_mem=shared)
        return launch

    fold = _helper("fold_partials")
    fold_grid = (-(-m * n // FOLD_THREADS),)
    fold_args = (workspace, np.int32(candidate.ksplit), np.int32(m * n), out)

    def launch_and_fold(i: int) -> None:
        with stream:
            kernel(grid, block, args[i], shared_mem=shared)
            fold(fold_grid, (FOLD_THREADS,), fold_args)
    return launch_and_fold


def gemv(candidate: Candidate, weights: DeviceWeights, qact: QuantizedActivations, out: Any, stream: Any,
         workspace: Any = None) -> None:
    """Enqueue y = W·x for quantized activations on `stream`; `out` float32 [M, N] receives y."""
    bind(candidate, [weights], qact, out, stream, workspace)(0)
