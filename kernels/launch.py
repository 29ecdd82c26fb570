"""Launchers (CuPy): move weights to the device, quantize activations, launch a candidate on a stream.

No launch goes to a default stream (docs/contract.md §3). Stream contract of `quantize_activations` and `gemv`:
- an explicit `stream` argument (never a default stream) receives the launches;
- without one, the launches go to the caller's current CuPy stream when that is an explicit stream, and,
  when it is a default stream (null, legacy or per-thread), to an internal non-blocking stream of this
  thread and device that first waits on an event recorded on the caller's stream and afterwards makes the
  caller's stream wait on an event recorded after the launches (`launch_stream`, `rejoin`): ordered both
  ways with the caller's work (docs/policy.md §9), with no host synchronization.
Nothing here synchronizes the host except the opt-in `strict` finiteness check. `bind` resolves a launch
once for timing loops: zero host work per launch beyond the launch itself.
The module for a codebook is compiled once per process by NVRTC with the contract's options, for the
device's own architecture.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from . import layout, program, registry
from .codebooks import get
from .emulate import QuantizedActivations
from .errors import BLOCK, EnvironmentProblem, InputError
from .registry import Candidate, kernel_names, ticket_words

try:
    import cupy
except ImportError:  # the CPU stages never launch; only calling into this module needs CuPy
    cupy = None


def require_cupy() -> Any:
    """CuPy, or EnvironmentProblem (the machine lacks it; not the caller's input)."""
    if cupy is None:
        raise EnvironmentProblem("CuPy is not installed: pip install 'gemv-dispatch[cuda]' (CUDA 13), or "
                                 "pip install cupy-cuda12x on CUDA 12")
    return cupy


def nvidia_driver_present() -> bool:
    """Whether the NVIDIA driver's CUDA library (libcuda) can be loaded: without it CuPy reports only an
    "insufficient driver" version error."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def require_device() -> Any:
    """CuPy, once a CUDA device is known to be usable; otherwise one clear EnvironmentProblem."""
    cp = require_cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as err:
        if not nvidia_driver_present():
            raise EnvironmentProblem("no NVIDIA driver found (libcuda.so.1 cannot be loaded)") from None
        raise EnvironmentProblem(f"no usable CUDA device: {err}") from None
    if count == 0:
        raise EnvironmentProblem("no CUDA device is visible")
    return cp


@dataclass(frozen=True)
class DeviceWeights:
    """The execution planes of kernels.layout.PackedWeights on the device; a plane the codebook lacks is None."""

    codebook: str
    n: int
    k: int
    payload: Any  # cupy uint32 [KB, N, words]
    scale: Any  # cupy uint16 (fp16 bits) [KB, N]
    min: Any | None
    high: Any | None
    sub: Any | None = None  # cupy uint8 [KB/8, N, sc bytes]: super-block formats

    @property
    def nbytes(self) -> int:
        planes = (getattr(self, field) for field in PLANE_FIELDS.values())
        return sum(a.nbytes for a in planes if a is not None)

    def plane_args(self) -> tuple[Any, ...]:
        """The planes in the order the kernels declare them (program.planes()), null pointers for absent ones."""
        planes = (getattr(self, PLANE_FIELDS[name]) for name in program.planes())
        return tuple(np.uint64(0) if plane is None else plane for plane in planes)


# Kernel parameter name of a plane -> its DeviceWeights field (`min` is a CUDA function, hence `minv`).
PLANE_FIELDS = {"payload": "payload", "high": "high", "scale": "scale", "minv": "min", "sub": "sub"}


def to_device(packed: layout.PackedWeights) -> DeviceWeights:
    """Upload the planes on the current stream and wait for them (one host synchronization, once per
    matrix): afterwards any stream may read them, whatever stream it is ordered with."""
    cp = require_cupy()

    def put(plane: np.ndarray | None, view: Any = None) -> Any:
        if plane is None:
            return None
        return cp.asarray(plane.view(view) if view is not None else plane)

    weights = DeviceWeights(
        codebook=packed.codebook,
        n=packed.n,
        k=packed.k,
        payload=put(packed.payload),
        scale=put(packed.scale, np.uint16),
        min=put(packed.min, np.uint16),
        high=put(packed.high),
        sub=put(packed.sub),
    )
    cp.cuda.get_current_stream().synchronize()
    return weights


def random_weights(codebook: str, n: int, k: int, rng: Any) -> DeviceWeights:
    """Device planes of layout.random_planes (any format the layout knows): timing inputs. `rng` is a
    cupy.random.Generator."""
    cp = require_cupy()
    planes = layout.random_planes(codebook, n, k, rng, cp)
    bits = {name: a.view(cp.uint16) if a.dtype == cp.float16 else a for name, a in planes.items()}
    return DeviceWeights(get(codebook).name, n, k, bits["payload"], bits["scale"], bits.get("min"),
                         bits.get("high"), bits.get("sub"))


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


# Stream handles of the default streams: the null stream (0), cudaStreamLegacy (1), cudaStreamPerThread (2).
DEFAULT_STREAMS = (0, 1, 2)


def is_default_stream(stream: Any) -> bool:
    return stream.ptr in DEFAULT_STREAMS


def check_stream(stream: Any) -> None:
    """An explicit stream argument must be a CuPy stream object other than a default stream."""
    if not isinstance(getattr(stream, "ptr", None), int) or is_default_stream(stream):
        raise InputError("launches need an explicit CuPy stream (cupy.cuda.Stream(non_blocking=True)), not stream 0")


@dataclass(frozen=True)
class _Bridge:
    """The internal stream that serves callers whose current stream is a default stream, with the two events
    that order it with them. Reusing the events is safe: a wait binds to the record that precedes it."""

    stream: Any  # non-blocking, so it never serializes with unrelated default-stream work
    entered: Any  # recorded on the caller's stream before the launches
    done: Any  # recorded on `stream` after the launches


class _Bridges(threading.local):
    # Per thread: with per-thread default streams two threads' callers are different streams, and a shared
    # event recorded by one thread could be waited on by another.
    def __init__(self) -> None:
        self.by_device: dict[int, _Bridge] = {}


_BRIDGES = _Bridges()


def _bridge(cp: Any) -> _Bridge:
    device = cp.cuda.runtime.getDevice()
    bridge = _BRIDGES.by_device.get(device)
    if bridge is None:
        bridge = _BRIDGES.by_device[device] = _Bridge(
            cp.cuda.Stream(non_blocking=True),
            cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True))
    return bridge


def launch_stream(caller: Any) -> Any:
    """The stream to launch on for a caller whose current stream is `caller`: `caller` itself when it is an
    explicit stream; else this thread's internal stream for the current device, made to wait (on the device,
    not the host) for everything already enqueued on `caller`. Pair with `rejoin` after the launches."""
    if not is_default_stream(caller):
        return caller
    cp = require_cupy()
    bridge = _bridge(cp)
    bridge.entered.record(caller)
    bridge.stream.wait_event(bridge.entered)
    return bridge.stream


def rejoin(caller: Any, launched_on: Any) -> None:
    """After launches on `launched_on = launch_stream(caller)`: make `caller` wait for them (device-side)."""
    if launched_on is caller:
        return
    bridge = _bridge(require_cupy())
    bridge.done.record(launched_on)
    caller.wait_event(bridge.done)


def caller_stream(stream: Any = None) -> Any:
    """The stream whose work a launch must follow: `stream` when given (explicit, checked), else the current
    CuPy stream of the current device."""
    if stream is not None:
        check_stream(stream)
        return stream
    return require_cupy().cuda.get_current_stream()


@cache
def _module(codebook: str | None) -> Any:
    """The compiled instantiations of one codebook, or (None) the helper kernels; built once per process."""
    cp = require_cupy()
    names = list(kernel_names(codebook) if codebook else program.HELPER_KERNELS)
    return cp.RawModule(code=program.source(), options=program.CONTRACT_OPTIONS, name_expressions=names)


@cache
def _kernel(codebook: str | None, name: str) -> Any:
    """A compiled kernel, looked up and opted in once: launches sit on the timed host path of eager mode."""
    return opt_in(name, _module(codebook).get_function(name))


def opt_in(name: str, kernel: Any) -> Any:
    """`kernel`, instantiation `name`; a staged one (gemv_staged) allowed registry.RING_SHARED_LIMIT bytes of dynamic
    shared memory, which Candidate.shared_bytes gives its ring where that fits (a cap: launches that take less are
    as they were). The other kernels keep the default: the ring kernels' 48 KB of static shared memory plus that
    much would pass the opt-in limit of some GPUs."""
    if name.startswith("gemv_staged<"):
        kernel.max_dynamic_shared_size_bytes = registry.RING_SHARED_LIMIT  # read here: source_ab.py may raise it
    return kernel


def _helper(name: str) -> Any:
    return _kernel(None, name)


def quantize_activations(x: Any, stream: Any = None, out: QuantizedActivations | None = None, *,
                         strict: bool = False) -> QuantizedActivations:
    """Device activation quantization (docs/contract.md §1) of float32 x [M, K], a C-contiguous CuPy array.

    Runs after the work already enqueued on the caller's stream (the module's stream contract: `stream`, or
    the current stream) and never synchronizes the host, so it can be captured in a CUDA graph. Non-finite
    activations are the caller's contract to avoid; `strict=True` checks them and raises InputError, at the
    price of one host synchronization with the caller's stream (not capturable). `out`, when given, must come
    from `empty_activations(M, K)`; new buffers are allocated on the caller's stream (CuPy's pool)."""
    cp = require_cupy()
    caller = caller_stream(stream)
    if not isinstance(x, cp.ndarray) or x.dtype != cp.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise InputError("activations must be a C-contiguous 2-D float32 CuPy array [M, K]")
    m, k = x.shape
    if m < 1 or k < BLOCK or k % BLOCK:
        raise InputError(f"activations have shape {x.shape}; need M >= 1 and K a positive multiple of 32")
    with caller:  # the check and the buffers belong to the caller's stream
        if strict and not bool(cp.isfinite(x).all()):
            raise InputError("activations contain non-finite values; they must be finite")
        out = out or empty_activations(m, k)
    kb = k // BLOCK
    if (out.m, out.kb) != (m, kb) or not is_block_major(out):
        raise InputError(f"`out` must be launch.empty_activations({m}, {k})")
    on = launch_stream(caller)
    enqueue_quantize(x, m, kb, storage(out), on)
    rejoin(caller, on)
    return out


QUANTIZE_THREADS = 256


def enqueue_quantize(x: Any, m: int, kb: int, qact: tuple[Any, Any, Any], stream: Any) -> None:
    """Enqueue the activation kernel on `stream`, nothing checked: x is a CuPy array or a device pointer
    (np.uint64) to float32 [M, KB·32]; `qact` the base pointers of block-major q, d_a and sum_a buffers of
    that shape (`storage`)."""
    _helper("quantize_activations")(
        (-(-m * kb * BLOCK // QUANTIZE_THREADS),), (QUANTIZE_THREADS,),  # one warp per (row, block)
        (x, np.int32(m), np.int32(kb), *qact), stream=stream)


def new_workspace(nbytes: int, n: int, xp: Any = None) -> Any:
    """A kpar workspace of at least `nbytes` (Candidate.workspace_bytes) for outputs of width N, on the current
    stream: its ticket_words(N) counters zero, as every launch leaves them, and its partials a NaN pattern (a
    fold that read a partial no CTA wrote shows). The tickets' place depends on N alone, so candidates of any
    split may share it for one N (not for another N: its partials would sit under that N's tickets)."""
    xp = xp or require_cupy()
    ws = xp.full(-(-nbytes // 4), np.nan, dtype=xp.float32)
    ws[: ticket_words(n)] = 0.0
    return ws


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
        raise InputError(f"candidate {candidate.id} needs a float32 workspace of {need} bytes (launch.new_workspace)")
    if out.device.id != weights.payload.device.id:
        raise InputError("output and weights are on different devices")


@dataclass(frozen=True)
class Plan:
    """One candidate's launch for one weights matrix and M, resolved once: kernel, geometry, weight pointers
    and scalar arguments. `enqueue` adds the per-call pointers and launches, nothing checked (callers check
    once, as `check_launch` does). `bind` and the runtime both launch through plans."""

    candidate: Candidate
    m: int
    kernel: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    weights: tuple[Any, ...]  # DeviceWeights.plane_args: the planes in the kernels' order
    scalars: tuple[Any, ...]  # int32 M, N, KB, partition width
    workspace_floats: int  # kpar's tickets and partials (Candidate.workspace_bytes / 4); 0 for the others

    def enqueue(self, qact: tuple[Any, Any, Any], out: Any, workspace: Any, stream: Any) -> None:
        """y = W·x on `stream`: `qact` = storage(activations), `out` float32 [M, N] (array or pointer),
        `workspace` (kpar only, else None) from new_workspace for this N, of at least `workspace_floats`."""
        self.kernel(self.grid, self.block, (*self.weights, *qact, *self.scalars, out, _pointer(workspace)),
                    shared_mem=self.shared, stream=stream)


def _pointer(buffer: Any) -> Any:
    """A kernel argument for an optional buffer: the null pointer for None."""
    return np.uint64(0) if buffer is None else buffer


def plan(candidate: Candidate, weights: DeviceWeights, m: int) -> Plan:
    """Resolve `candidate`'s launch for `weights` and M rows; InputError when the candidate cannot run it."""
    n, k = weights.n, weights.k
    reason = candidate.invalid_reason(m, n, k)
    if reason:
        raise InputError(f"candidate {candidate.id} cannot run M={m}, N={n}, K={k}: {reason}")
    grid, block = candidate.launch_geometry(m, n, k)
    return Plan(
        candidate=candidate, m=m,
        kernel=_kernel(weights.codebook, candidate.kernel_name(weights.codebook, m)),
        grid=grid, block=block, shared=candidate.shared_bytes(m, k, weights.codebook),
        weights=weights.plane_args(),
        scalars=(np.int32(m), np.int32(n), np.int32(k // BLOCK), np.int32(candidate.partition_width(k))),
        workspace_floats=candidate.workspace_bytes(m, n, k) // 4,
    )


def bind(candidate: Candidate, copies: Sequence[DeviceWeights], qact: QuantizedActivations, out: Any, stream: Any,
         workspace: Any = None) -> Callable[[int], None]:
    """Check once and resolve everything a launch needs; `launch(i)` then enqueues y = W·x on `stream` with
    W = copies[i] (copies of one matrix, e.g. rotated for cold L2) and nothing left to compute on the host:
    eager timing measures the launch, not this setup. `out` float32 [M, N] receives y. No stream ordering is
    added: the timing harness owns `stream`."""
    check_stream(stream)
    if not copies:
        raise InputError("bind needs at least one weights copy")
    first = copies[0]
    check_launch(candidate, first, qact, out, workspace)
    if any((w.codebook, w.n, w.k) != (first.codebook, first.n, first.k) for w in copies):
        raise InputError("weights copies must share one codebook and shape")
    plans = [plan(candidate, w, qact.m) for w in copies]
    first_plan = plans[0]
    kernel, grid, block, shared = first_plan.kernel, first_plan.grid, first_plan.block, first_plan.shared
    tail = (*storage(qact), *first_plan.scalars, out, _pointer(workspace if candidate.grid_split else None))
    args = [(*p.weights, *tail) for p in plans]

    def launch(i: int) -> None:
        kernel(grid, block, args[i], shared_mem=shared, stream=stream)
    return launch


def gemv(candidate: Candidate, weights: DeviceWeights, qact: QuantizedActivations, out: Any, stream: Any = None,
         workspace: Any = None) -> None:
    """Enqueue y = W·x for quantized activations under the module's stream contract (`stream`, or the
    caller's current stream); `out` float32 [M, N] receives y. No host synchronization."""
    caller = caller_stream(stream)
    check_launch(candidate, weights, qact, out, workspace)
    on = launch_stream(caller)
    plan(candidate, weights, qact.m).enqueue(storage(qact), out, workspace, on)
    rejoin(caller, on)
