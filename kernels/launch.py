"""Launchers (CuPy): move weights to the device, quantize activations, launch a candidate on a stream.

No launch goes to a default stream (docs/contract.md §3). Stream contract of `quantize_activations` and `gemv`:
- an explicit `stream` argument (never a default stream) receives the launches;
- without one, the launches go to the caller's current CuPy stream when that is an explicit stream, and,
  when it is a default stream (null, legacy or per-thread), to an internal non-blocking stream of this
  thread and device that first waits on an event recorded on the caller's stream and afterwards makes the
  caller's stream wait on an event recorded after the launches (`launch_stream`, `rejoin`): ordered both
  ways with the caller's work (docs/policy.md §9), with no host synchronization.
Nothing here synchronizes the host except the opt-in `strict` finiteness check.
Launches are prepared (`PreparedLaunch`): the kernel's function handle and its argument buffer are built once,
and a launch patches only the pointers that change, then calls cuLaunchKernel on a raw stream handle; no
per-launch argument marshalling. `bind` prepares every launch of a timing loop: zero host work per launch
beyond cuLaunchKernel itself. The module for a codebook is compiled once per process by NVRTC with the
contract's options, for the device's own architecture.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
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


def storage(qact: QuantizedActivations) -> tuple[int, int, int]:
    """Base pointers of the block-major buffers behind the [M, KB] views, as the kernels take them."""
    return qact.q.data.ptr, qact.d.data.ptr, qact.sum.data.ptr


def is_block_major(qact: QuantizedActivations) -> bool:
    """Whether the [M, KB] views sit on block-major buffers, the only layout the kernels read."""
    return all(a.T.flags.c_contiguous if a.ndim == 2 else a.transpose(1, 0, 2).flags.c_contiguous
               for a in (qact.q, qact.d, qact.sum))


# ---------------------------------------------------------------------------------------------------------
# Streams, as raw handles: the hot path never builds a stream object


# Stream handles of the default streams: the null stream (0), cudaStreamLegacy (1), cudaStreamPerThread (2).
DEFAULT_STREAMS = (0, 1, 2)


def is_default_stream(handle: int) -> bool:
    return handle in DEFAULT_STREAMS


def check_stream(stream: Any) -> None:
    """An explicit stream argument must be a CuPy stream object other than a default stream."""
    if not isinstance(getattr(stream, "ptr", None), int) or is_default_stream(stream.ptr):
        raise InputError("launches need an explicit CuPy stream (cupy.cuda.Stream(non_blocking=True)), not stream 0")


@dataclass(frozen=True)
class _Bridge:
    """The internal stream that serves callers whose current stream is a default stream, with the two events
    that order it with them (the objects own the handles). Reusing the events is safe: a wait binds to the record
    that precedes it."""

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


def launch_stream(caller: int) -> int:
    """The stream handle to launch on for a caller whose current stream is `caller` (a handle): `caller` itself
    when it is an explicit stream; else this thread's internal stream for the current device, made to wait (on
    the device, not the host) for everything already enqueued on `caller`. Pair with `rejoin` after the
    launches."""
    if caller not in DEFAULT_STREAMS:
        return caller
    cp = require_cupy()
    bridge = _bridge(cp)
    cp.cuda.runtime.eventRecord(bridge.entered.ptr, caller)
    cp.cuda.runtime.streamWaitEvent(bridge.stream.ptr, bridge.entered.ptr)
    return bridge.stream.ptr


def rejoin(caller: int, launched_on: int) -> None:
    """After launches on `launched_on = launch_stream(caller)`: make `caller` wait for them (device-side)."""
    if launched_on == caller:
        return
    cp = require_cupy()
    bridge = _bridge(cp)
    cp.cuda.runtime.eventRecord(bridge.done.ptr, launched_on)
    cp.cuda.runtime.streamWaitEvent(caller, bridge.done.ptr)


def caller_stream(stream: Any = None) -> Any:
    """The stream whose work a launch must follow: `stream` when given (explicit, checked), else the current
    CuPy stream of the current device."""
    if stream is not None:
        check_stream(stream)
        return stream
    return require_cupy().cuda.get_current_stream()


# ---------------------------------------------------------------------------------------------------------
# Kernels and prepared launches


@cache
def _module(codebook: str | None) -> Any:
    """The compiled instantiations of one codebook, or (None) the helper kernels; built once per process."""
    cp = require_cupy()
    names = list(kernel_names(codebook) if codebook else program.HELPER_KERNELS)
    return cp.RawModule(code=program.source(), options=program.CONTRACT_OPTIONS, name_expressions=names)


@cache
def _kernel(device: int, codebook: str | None, name: str) -> Any:
    """A compiled kernel, looked up and opted in once per device (`device` is the current one): a function's
    attributes belong to the device it is loaded on."""
    return opt_in(name, _module(codebook).get_function(name))


def opt_in(name: str, kernel: Any) -> Any:
    """`kernel`, instantiation `name`; a staged one (gemv_staged) allowed registry.RING_SHARED_LIMIT bytes of dynamic
    shared memory, which Candidate.shared_bytes gives its ring where that fits (a cap: launches that take less are
    as they were). The other kernels keep the default: the ring kernels' 48 KB of static shared memory plus that
    much would pass the opt-in limit of some GPUs."""
    if name.startswith("gemv_staged<"):
        kernel.max_dynamic_shared_size_bytes = registry.RING_SHARED_LIMIT  # read here: source_ab.py may raise it
    return kernel


# A kernel parameter's C type -> its struct code: pointers travel as 64-bit addresses, `int` as int32.
_INT_TYPES = {"int": "i"}
POINTER = "Q"


def _code(kind: str) -> str:
    if kind.endswith("*"):
        return POINTER
    if kind in _INT_TYPES:
        return _INT_TYPES[kind]
    raise ValueError(f"kernel parameter type {kind!r} has no launch encoding")


@dataclass(frozen=True)
class ArgSlots:
    """Where each kernel argument's value lies in a prepared launch's argument buffer: the per-call arguments first
    and adjacent (one struct write patches them all), then the fixed ones, each at its natural alignment.
    cuLaunchKernel reads argument i through the i-th pointer of the parameter array, so the buffer's order is
    free; each value's width is that of its declared type."""

    names: tuple[str, ...]  # the kernel's parameters, in declared order
    codes: tuple[str, ...]  # their struct codes (POINTER or "i")
    offsets: tuple[int, ...]  # byte offset of each parameter's value in the buffer
    size: int  # bytes, a multiple of 8
    per_call: struct.Struct  # packs the per-call arguments, in their given order, at offset 0
    fixed: tuple[str, ...]  # the other parameters

    @classmethod
    def of(cls, params: Sequence[tuple[str, str]], per_call: Sequence[str]) -> ArgSlots:
        """Slots for a kernel's declared (type, name) parameters (program.declared_params) with `per_call` patched
        at every launch; ValueError for an unknown name or type."""
        names = tuple(name for _, name in params)
        codes = dict(zip(names, (_code(kind) for kind, _ in params), strict=True))
        unknown = [name for name in per_call if name not in codes]
        if unknown:
            raise ValueError(f"no kernel parameter named {', '.join(unknown)} (the kernel takes {', '.join(names)})")
        fixed = tuple(name for name in names if name not in per_call)
        offsets: dict[str, int] = {}
        end = 0
        for name in (*per_call, *fixed):
            width = struct.calcsize(codes[name])
            offsets[name] = end = -(-end // width) * width
            end += width
        head = "<" + "".join(codes[name] for name in per_call)
        run = offsets[per_call[-1]] + struct.calcsize(codes[per_call[-1]]) if per_call else 0
        if struct.calcsize(head) != run:  # "<" packs without padding: the slots above would not match
            raise ValueError(f"per-call arguments {', '.join(per_call)} need padding between them; order them "
                             "widest first")
        return cls(names, tuple(codes[n] for n in names), tuple(offsets[n] for n in names), -(-end // 8) * 8,
                   struct.Struct(head), fixed)


class PreparedLaunch:
    """One kernel launch on the device current at construction: its function handle, geometry and argument buffer
    built once. `launch(stream, values)` writes the per-call argument values (ArgSlots.per_call order) into the
    buffer and calls cuLaunchKernel on a raw stream handle. cuLaunchKernel copies the arguments before it returns,
    so a buffer serves every launch; each thread gets its own copy of it, since CuPy's binding releases the GIL
    around the call and another thread could patch a shared buffer while the driver reads it."""

    __slots__ = ("_call", "_head", "_keep", "_local", "_template", "_write", "slots")

    def __init__(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
                 slots: ArgSlots, fixed: Mapping[str, int], keep: Any = None,
                 launch_kernel: Callable[..., Any] | None = None) -> None:
        missing = sorted(set(slots.fixed) - set(fixed))
        if missing:
            raise ValueError(f"no value for kernel parameter {', '.join(missing)}")
        self.slots = slots
        template = bytearray(slots.size)
        for name, code, offset in zip(slots.names, slots.codes, slots.offsets, strict=True):
            if name in fixed:
                struct.pack_into("<" + code, template, offset, int(fixed[name]))
        self._template = bytes(template)
        self._head = (function, *grid, *block, shared)
        # cuLaunchKernel's leading arguments bound once: a call passes only the stream, the parameters and `extra`.
        self._call = partial(launch_kernel or require_cupy().cuda.driver.launchKernel, *self._head)
        self._write = slots.per_call.pack_into
        self._local = threading.local()
        self._keep = keep  # what the fixed pointers address, alive as long as the launch

    def _buffers(self) -> tuple[Any, int]:
        """This thread's argument buffer and the address of its parameter array, made on its first launch."""
        try:
            return self._local.buffers
        except AttributeError:
            store = (ctypes.c_uint64 * (self.slots.size // 8)).from_buffer_copy(self._template)
            base = ctypes.addressof(store)
            argv = (ctypes.c_void_p * len(self.slots.names))(*(base + offset for offset in self.slots.offsets))
            self._local.arrays = (store, argv)  # the ctypes objects own the memory the addresses name
            self._local.buffers = (store, ctypes.addressof(argv))
            return self._local.buffers

    @property
    def head(self) -> tuple[int, ...]:
        """(function, grid x/y/z, block x/y/z, dynamic shared bytes): cuLaunchKernel's leading arguments."""
        return self._head

    @property
    def argv(self) -> int:
        """Address of this thread's parameter array (one pointer per kernel parameter, into its argument buffer)."""
        return self._buffers()[1]

    def argument_bytes(self) -> bytes:
        """This thread's argument buffer as it stands (for tests)."""
        return bytes(self._buffers()[0])

    def launch(self, stream: int, values: tuple[int, ...] = ()) -> None:
        """Enqueue the kernel on the stream handle `stream` with these per-call argument values."""
        try:
            store, argv = self._local.buffers
        except AttributeError:
            store, argv = self._buffers()
        self._write(store, 0, *values)
        self._call(stream, argv, 0)


def _function(kernel: Any) -> int:
    """The CUfunction handle of a CuPy RawKernel on the current device."""
    return kernel.kernel.ptr


def address(buffer: Any) -> int:
    """A kernel pointer argument's value: a device array's address, an address as given, 0 for None."""
    if buffer is None:
        return 0
    data = getattr(buffer, "data", None)
    return int(data.ptr) if data is not None and hasattr(data, "ptr") else int(buffer)


# The activations kernel (kernels/cuda/gemv.cu, quantize_activations): x and the three buffers change per call.
QUANTIZE_PER_CALL = ("x", "q", "d", "sums")
QUANTIZE_THREADS = 256


@cache
def _quantize_slots() -> ArgSlots:
    return ArgSlots.of(program.declared_params(program.source(), "quantize_activations"), QUANTIZE_PER_CALL)


@cache
def quantize_launch(device: int, m: int, kb: int) -> PreparedLaunch:
    """The prepared activation quantization of M rows of KB blocks on `device` (the current device): launch it with
    the stream and the addresses (x, q, d_a, sum_a), q/d_a/sum_a block-major (`storage`)."""
    fixed = {"M": m, "KB": kb}
    return PreparedLaunch(_function(_kernel(device, None, "quantize_activations")),
                          (-(-m * kb * BLOCK // QUANTIZE_THREADS), 1, 1), (QUANTIZE_THREADS, 1, 1), 0,
                          _quantize_slots(), fixed)  # one warp per (row, block)


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
    on = launch_stream(caller.ptr)
    quantize_launch(cp.cuda.runtime.getDevice(), m, kb).launch(on, (x.data.ptr, *storage(out)))
    rejoin(caller.ptr, on)
    return out


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


# The GEMV kernels' parameters (GEMV_PARAMS in kernels/cuda/gemv.cu) that change per call: the activations, the
# output and the workspace (0 where the candidate takes none); the weight planes and the scalars are the plan's.
GEMV_PER_CALL = ("qa", "da", "sa", "out", "ws")
GEMV_SCALARS = ("M", "N", "KB", "width")


@cache
def gemv_slots(per_call: tuple[str, ...] = GEMV_PER_CALL) -> ArgSlots:
    return ArgSlots.of(program.declared_params(program.source()), per_call)


@dataclass(frozen=True)
class Plan:
    """One candidate's launch for one weights matrix and M, resolved once: kernel, geometry, weight planes and
    scalar arguments. `prepare` turns it into a PreparedLaunch (callers check once, as `check_launch` does).
    `bind`, `gemv` and the runtime all launch through plans."""

    candidate: Candidate
    m: int
    kernel: Any  # a CuPy RawKernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    weights: tuple[Any, ...]  # DeviceWeights.plane_args: the planes in the kernels' order
    scalars: tuple[int, ...]  # M, N, KB, partition width (GEMV_SCALARS)
    workspace_floats: int  # kpar's tickets and partials (Candidate.workspace_bytes / 4); 0 for the others

    def prepare(self, fixed: Mapping[str, int] | None = None, keep: Any = None,
                launch_kernel: Callable[..., Any] | None = None) -> PreparedLaunch:
        """The launch on the current device. Each `launch(stream, (qa, da, sa, out, ws))` then takes the
        activations' base pointers (`storage`), the output's and the workspace's (0 for none); `fixed` may give some
        of those once instead (a timing loop's, with `keep` the buffers they address, kept alive with the launch),
        and each launch then takes only the others, in GEMV_PER_CALL order."""
        fixed = dict(fixed or {})
        values = {**dict(zip(program.planes(), map(address, self.weights), strict=True)),
                  **dict(zip(GEMV_SCALARS, self.scalars, strict=True)), **fixed}
        slots = gemv_slots(tuple(name for name in GEMV_PER_CALL if name not in fixed))
        return PreparedLaunch(_function(self.kernel), self.grid, self.block, self.shared, slots, values,
                              keep=(self.weights, keep), launch_kernel=launch_kernel)


def plan(candidate: Candidate, weights: DeviceWeights, m: int) -> Plan:
    """Resolve `candidate`'s launch for `weights` and M rows; InputError when the candidate cannot run it."""
    n, k = weights.n, weights.k
    reason = candidate.invalid_reason(m, n, k)
    if reason:
        raise InputError(f"candidate {candidate.id} cannot run M={m}, N={n}, K={k}: {reason}")
    grid, block = candidate.launch_geometry(m, n, k)
    return Plan(
        candidate=candidate, m=m,
        kernel=_kernel(require_cupy().cuda.runtime.getDevice(), weights.codebook,
                       candidate.kernel_name(weights.codebook, m)),
        grid=grid, block=block, shared=candidate.shared_bytes(m, k, weights.codebook),
        weights=weights.plane_args(),
        scalars=(m, n, k // BLOCK, candidate.partition_width(k)),
        workspace_floats=candidate.workspace_bytes(m, n, k) // 4,
    )


def bind(candidate: Candidate, copies: Sequence[DeviceWeights], qact: QuantizedActivations, out: Any, stream: Any,
         workspace: Any = None) -> Callable[[int], None]:
    """Check once and prepare everything a launch needs; `launch(i)` then enqueues y = W·x on `stream` with
    W = copies[i] (copies of one matrix, e.g. rotated for cold L2) and nothing left to do on the host but
    cuLaunchKernel: eager timing measures the launch, not this setup. `out` float32 [M, N] receives y. No stream
    ordering is added: the timing harness owns `stream`."""
    check_stream(stream)
    if not copies:
        raise InputError("bind needs at least one weights copy")
    first = copies[0]
    check_launch(candidate, first, qact, out, workspace)
    if any((w.codebook, w.n, w.k) != (first.codebook, first.n, first.k) for w in copies):
        raise InputError("weights copies must share one codebook and shape")
    qa, da, sa = storage(qact)
    fixed = {"qa": qa, "da": da, "sa": sa, "out": address(out),
             "ws": address(workspace if candidate.grid_split else None)}
    launches = [plan(candidate, w, qact.m).prepare(fixed, keep=(qact, out, workspace)) for w in copies]
    handle = stream.ptr

    def launch(i: int) -> None:
        launches[i].launch(handle)
    return launch


def gemv(candidate: Candidate, weights: DeviceWeights, qact: QuantizedActivations, out: Any, stream: Any = None,
         workspace: Any = None) -> None:
    """Enqueue y = W·x for quantized activations under the module's stream contract (`stream`, or the
    caller's current stream); `out` float32 [M, N] receives y. No host synchronization."""
    caller = caller_stream(stream).ptr
    check_launch(candidate, weights, qact, out, workspace)
    on = launch_stream(caller)
    plan(candidate, weights, qact.m).prepare().launch(on, (*storage(qact), address(out), address(workspace)))
    rejoin(caller, on)
