"""Runtime (docs/policy.md §9): prepare weights once, quantize activations once per x, and launch the GEMV the installed
dispatch table chooses for the current GPU, on the caller's stream, with no host synchronization.

    w = runtime.prepare(blocks, "Q4_0", k)         # GGUF block bytes (or a PackedWeights): uploaded once
    qx = runtime.quantize(x)                        # once per x; q, k and v of a layer share it
    y = runtime.gemv(w, qx)                         # or runtime.gemv(w, x): quantize + gemv

Arrays: CuPy arrays, or CUDA torch tensors (then the result is a torch tensor). No copies are made: an array is
read and written where it lies, through its device pointer, after host-side checks of its metadata (type,
dtype, shape, contiguity, device). Streams: CuPy arrays follow CuPy's current stream, torch tensors torch's
current stream; launches go to that stream when it is an explicit stream, else to an internal stream ordered
both ways with it by events (kernels.launch's stream contract). Nothing here waits for the GPU on the hot
path, so quantize + gemv can be captured in a CUDA graph. `strict=True` additionally checks the activations
for non-finite values, which synchronizes the host with the caller's stream and cannot run while capturing.

Dispatch: `installed_table(gpu_name)` of the install stage answers select(codebook, M, N, K, mode) with mode
"graph" while the caller's stream is capturing, else "eager"; each answer is cached per key and the resolved
launch per prepared matrix and (M, mode), so a repeated call costs the checks and the launch. Without a
GPU-level certified table for this GPU, the runtime warns once and uses SAFE_DEFAULT, which is valid for
every shape and gives the same bytes as any identity-1 table choice.

Memory: new buffers come from the allocator of the caller's array library on the caller's stream, whose
stream-ordered reuse makes dropping them right after the launches safe: torch's caching allocator for torch
callers (inside torch.cuda.graph that is the graph's private pool, which keeps them for the graph), CuPy's
pool for CuPy callers. kpar workspaces are the exception: they hold ticket counters that every launch leaves
zero, so the runtime keeps them, from CuPy's pool, one per (launch stream, N), for torch callers too. CuPy has
no graph-private pool, so for a CuPy capture the caller keeps x, the result of quantize and `out` alive while
the graph lives, and the runtime keeps the scratch it allocates during a capture (kpar workspaces, activations
of `gemv(w, x)` with unquantized x) for the life of the process, one set per capturing stream, shared by the
graphs captured on that stream: do not replay such graphs concurrently with each other.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...kernels import launch
from ...kernels.codebooks import CODEBOOKS, get
from ...kernels.emulate import QuantizedActivations
from ...kernels.errors import BLOCK, InputError
from ...kernels.layout import PackedWeights, pack
from ...kernels.registry import Candidate, by_id
from ..common.contract import MODES, Mode
from ..measure.shapes import open_gguf
from . import install

SAFE_DEFAULT = "wide.s1.t128.c1"  # identity 1, valid for every (M, N, K): no split, cpt 1, no mma tile
_FLOAT32 = np.dtype(np.float32)  # compared on every call: a dtype object, not a type to convert each time


# ---------------------------------------------------------------------------------------------------------
# Dispatch: the installed table, or the safe default


@dataclass(frozen=True)
class Choice:
    """What the runtime launches for one (codebook, M, N, K, mode)."""

    candidate: Candidate
    identity: int
    source: str  # the table's "overlay" / "fallback", or "default" without a table


def installed_table(gpu_name: str) -> tuple[Any, str | None]:
    """(table, None) for a GPU-level certified table installed for `gpu_name`, else (None, why not)."""
    table = install.installed_table(gpu_name)
    if table is None:
        return None, f"no dispatch table is installed for {gpu_name}"
    if not table.gpu_level:  # docs/policy.md §9: a table serves a GPU only with GPU-level certification
        return None, f"the table installed for {gpu_name} is certified on the emulator only, not on this GPU model"
    return table, None


class Dispatcher:
    """Answers select() from the installed table of each GPU, looked up once per GPU name, with one warning
    and SAFE_DEFAULT where there is none. Answers are cached per key; a table's answer is checked once
    (known candidate, valid for the shape, the identity it claims) so a bad table fails loudly, not in a kernel."""

    def __init__(self, load: Callable[[str], tuple[Any, str | None]] = installed_table) -> None:
        self._load = load
        self._tables: dict[str, Any] = {}
        self._choices: dict[tuple[str, str, int, int, int, str], Choice] = {}
        self._lock = threading.Lock()  # one load and one warning per GPU even with concurrent first calls

    def table(self, gpu_name: str) -> Any:
        """The table serving `gpu_name`, or None (after warning once)."""
        try:
            return self._tables[gpu_name]
        except KeyError:
            pass
        with self._lock:
            if gpu_name not in self._tables:
                table, why = self._load(gpu_name)
                if table is None:
                    warnings.warn(f"gemv-dispatch: {why}; every GEMV on this GPU uses the safe default "
                                  f"{SAFE_DEFAULT} (correct and byte-identical across M, not tuned). Run "
                                  f"`gemv-dispatch tune` to install a certified table.", RuntimeWarning, stacklevel=2)
                self._tables[gpu_name] = table
        return self._tables[gpu_name]

    def choose(self, gpu_name: str, codebook: str, m: int, n: int, k: int, mode: Mode) -> Choice:
        key = (gpu_name, codebook, m, n, k, mode)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = self._resolve(*key)
        return choice

    def _resolve(self, gpu_name: str, codebook: str, m: int, n: int, k: int, mode: Mode) -> Choice:
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        table = self.table(gpu_name)
        if table is None:
            return Choice(by_id(SAFE_DEFAULT), 1, "default")
        answer = table.select(codebook, m, n, k, mode)
        cid, identity = answer.candidate, answer.identity
        try:
            candidate = by_id(cid)
        except InputError:
            candidate = None
        reason = "no such candidate in this build" if candidate is None else candidate.invalid_reason(m, n, k)
        if reason is None and candidate.identity(k) != identity:
            reason = f"its identity for K={k} is {candidate.identity(k)}, the table says {identity}"
        if reason:
            raise RuntimeError(f"the dispatch table installed for {gpu_name} chose {cid} for {codebook} M={m} "
                               f"N={n} K={k} {mode}, which is wrong: {reason}; reinstall or roll it back")
        return Choice(candidate, identity, answer.source)


# ---------------------------------------------------------------------------------------------------------
# Weights


@dataclass(eq=False)
class Weights:
    """A weight matrix prepared for the GPU (prepare): execution planes on one device, and the launches
    resolved for it so far, one per (M, mode)."""

    codebook: str  # source format, e.g. "Q4_0"
    execution: str  # the dispatch key, e.g. "q4_0"
    n: int
    k: int
    device_id: int
    planes: launch.DeviceWeights
    _launches: dict[tuple[int, str], tuple[launch.Plan, Choice]] = field(default_factory=dict, repr=False)


def prepare(weights: PackedWeights | np.ndarray, codebook: str | None = None, k: int | None = None) -> Weights:
    """Upload a matrix once, on the current CuPy device: GGUF block bytes (numpy uint8 [N, KB·block bytes]
    with its `codebook` and `k`) or a kernels.layout.PackedWeights. Waits for the upload (once per matrix),
    so any stream may use the result at once."""
    if isinstance(weights, PackedWeights):
        if codebook is not None or k is not None:
            raise InputError("a PackedWeights carries its codebook and K; pass codebook and k only with block bytes")
        packed = weights
    elif isinstance(weights, np.ndarray):
        if codebook is None or k is None:
            raise InputError("GGUF block bytes need their codebook and K: prepare(blocks, 'Q4_0', k)")
        if weights.ndim != 2:
            raise InputError(f"GGUF block bytes must be a 2-D uint8 array [N, KB*block_bytes], got {weights.ndim}-D")
        packed = pack(codebook, weights, weights.shape[0], k)
    else:
        raise InputError("prepare takes GGUF block bytes (a numpy uint8 array [N, KB*block_bytes]) or a "
                         f"kernels.layout.PackedWeights, got {type(weights).__name__}")
    cp = launch.require_device()
    planes = launch.to_device(packed)
    return Weights(packed.codebook, packed.execution, packed.n, packed.k, cp.cuda.runtime.getDevice(), planes)


def read_gguf_tensor(path: str | Path, name: str) -> PackedWeights:
    """The block bytes of one 2-D tensor of a GGUF file, packed: the codebook from its GGML type, N and K from
    its dims (ne = [K, N]); any codebook the kernels run. InputError for a missing file or tensor or another type."""
    path = Path(path)
    reader = open_gguf(path)
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        raise InputError(f"{path}: no tensor named {name!r}")
    codebook = tensor.tensor_type.name
    if codebook not in CODEBOOKS:
        raise InputError(f"{path}: tensor {name!r} is {codebook}; the kernels run {', '.join(CODEBOOKS)}")
    if len(tensor.shape) != 2:
        raise InputError(f"{path}: tensor {name!r} has {len(tensor.shape)} dims; a GEMV weight is 2-D")
    k, n = (int(d) for d in tensor.shape)
    book = get(codebook)
    blocks = np.array(tensor.data, dtype=np.uint8).reshape(n, k // book.weights * book.block_bytes)
    return pack(codebook, blocks, n, k)


def prepare_from_gguf(path: str | Path, name: str) -> Weights:
    """prepare() for one tensor of a GGUF file (read_gguf_tensor)."""
    return prepare(read_gguf_tensor(path, name))


# ---------------------------------------------------------------------------------------------------------
# Arrays: host metadata only


@dataclass(slots=True)  # built on every call: a plain slots class constructs faster than a frozen one
class _Array:
    """What the launches need from a CuPy array or torch tensor; read from metadata, never from the data."""

    obj: Any
    ptr: int
    shape: tuple[int, ...]
    device_id: int
    torch: bool


def _torch_module() -> Any:
    # torch is never imported here: an object can only be a torch tensor if the caller imported torch.
    return sys.modules.get("torch")


def _array(x: Any, what: str) -> _Array:
    """Check that `x` is a C-contiguous 2-D float32 GPU array (CuPy or CUDA torch); InputError otherwise."""
    if isinstance(x, np.ndarray):
        raise InputError(f"{what} is a CPU (numpy) array; the GPU runtime takes CuPy arrays or CUDA torch tensors "
                         "(move it with cupy.asarray)")
    torch = _torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cuda":
            raise InputError(f"{what} is a torch tensor on {x.device}; the GPU runtime needs a CUDA tensor "
                             "(tensor.cuda())")
        if x.dtype != torch.float32:
            raise InputError(f"{what} must be float32 (no implicit casts), got {x.dtype}")
        if x.dim() != 2 or not x.is_contiguous():
            raise InputError(f"{what} must be a contiguous 2-D tensor, got shape {tuple(x.shape)}"
                             f"{'' if x.is_contiguous() else ' (not contiguous)'}")
        return _Array(x, x.data_ptr(), tuple(x.shape), x.device.index, True)
    cp = launch.cupy
    if cp is None or not isinstance(x, cp.ndarray):
        raise InputError(f"{what} must be a CuPy array or a CUDA torch tensor, got {type(x).__name__}")
    if x.dtype != _FLOAT32:
        raise InputError(f"{what} must be float32 (no implicit casts), got {x.dtype}")
    if x.ndim != 2 or not x.flags.c_contiguous:
        raise InputError(f"{what} must be a C-contiguous 2-D array, got shape {x.shape}"
                         f"{'' if x.flags.c_contiguous else ' (not C-contiguous)'}")
    return _Array(x, x.data.ptr, x.shape, x.data.device_id, False)


# ---------------------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True, eq=False)
class Activations:
    """Quantized activations (quantize): block-major device buffers of M rows and K, on one device, with
    the array library of the x they came from (gemv returns the same kind)."""

    m: int
    k: int
    device_id: int
    torch: bool
    ptrs: tuple[Any, Any, Any]  # base pointers of q, d_a and sum_a, as the kernels take them
    buffers: Any  # what owns them: a launch.empty_activations (CuPy) or one torch uint8 tensor


def _carve(base: int, m: int, kb: int) -> tuple[Any, Any, Any]:
    """Pointers of q int8 [KB][M][32], d float32 [KB][M] and sum int32 [KB][M] packed in one buffer from `base`
    (q's size is a multiple of 32 bytes, so d and sum stay aligned)."""
    q_bytes = m * kb * BLOCK
    return np.uint64(base), np.uint64(base + q_bytes), np.uint64(base + q_bytes + 4 * m * kb)


def _activation_bytes(m: int, kb: int) -> int:
    return m * kb * (BLOCK + 8)


class _StreamHandle:
    """A foreign stream handle speaking the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


class _Runtime:
    """Process state: the dispatcher, GPU names, wrappers of torch's streams, and scratch buffers."""

    def __init__(self) -> None:
        self.dispatcher = Dispatcher()
        self.gpu_names: dict[int, str] = {}
        self.torch_streams: dict[int, Any] = {}
        self.workspaces: dict[tuple[int, int], Any] = {}  # eager kpar workspace per (launch stream, N), grow-only
        self.captured_workspaces: dict[tuple[int, int], Any] = {}  # per (capturing stream, N); kept for the graphs
        self.captured_activations: dict[tuple[int, int, int], QuantizedActivations] = {}
        self.retired: list[Any] = []  # captured buffers replaced by larger ones: a graph may still read them

    def gpu_name(self, device_id: int) -> str:
        name = self.gpu_names.get(device_id)
        if name is None:
            props = launch.cupy.cuda.runtime.getDeviceProperties(device_id)
            name = self.gpu_names[device_id] = props["name"].decode()
        return name

    def caller_stream(self, a: _Array | Activations, device_id: int) -> Any:
        """The caller's current stream in the array's own library, as a CuPy stream object."""
        cp = launch.cupy
        if not a.torch:
            return cp.cuda.get_current_stream(device_id)
        ptr = _torch_module().cuda.current_stream(device_id).cuda_stream
        stream = self.torch_streams.get(ptr)
        if stream is None:
            if hasattr(cp.cuda.Stream, "from_external"):  # CuPy >= 14 (ExternalStream is deprecated there)
                stream = cp.cuda.Stream.from_external(_StreamHandle(ptr))
            else:
                stream = cp.cuda.ExternalStream(ptr, device_id)
            self.torch_streams[ptr] = stream
        return stream

    def workspace(self, floats: int, n: int, on: Any, capturing: bool) -> Any:
        """A kpar workspace (launch.new_workspace) of at least `floats` elements for outputs of width N and
        launches on `on`, from CuPy's pool on that stream, for CuPy and torch callers alike: each launch leaves
        its tickets zero and stream order makes reuse by the next launch on `on` safe; a workspace serves one
        N, since another N's tickets would sit on its partials. Eager buffers are replaced when too small (the
        old one returns to the pool); buffers used in a capture are kept."""
        cache = self.captured_workspaces if capturing else self.workspaces
        key = (on.ptr, n)
        ws = cache.get(key)
        if ws is None or ws.size < floats:
            if capturing and ws is not None:
                self.retired.append(ws)
            with on:
                ws = cache[key] = launch.new_workspace(4 * floats, n)
        return ws

    def captured_scratch(self, on: Any, m: int, k: int) -> QuantizedActivations:
        """Activations for gemv(w, x) while capturing on `on`: kept, since the graph writes and reads them."""
        key = (on.ptr, m, k)
        act = self.captured_activations.get(key)
        if act is None:
            with on:
                act = self.captured_activations[key] = launch.empty_activations(m, k)
        return act


_STATE = _Runtime()


def _capturing(stream: Any) -> bool:
    # A default stream cannot capture; querying the legacy stream while another thread captures would fail.
    return not launch.is_default_stream(stream) and launch.cupy.cuda.runtime.streamIsCapturing(stream.ptr)


def _check_finite(a: _Array, caller: Any) -> None:
    """strict=True: one host synchronization with the caller's stream (the reduction runs on it)."""
    if _capturing(caller):
        raise InputError("strict=True synchronizes the host and cannot run while the stream is capturing a graph")
    if a.torch:
        finite = bool(_torch_module().isfinite(a.obj).all())
    else:
        with caller:
            finite = bool(launch.cupy.isfinite(a.obj).all())
    if not finite:
        raise InputError("activations contain non-finite values; they must be finite")


def _device_guard(device_id: int) -> Any:
    """None when `device_id` is current, else a context that makes it current for the launches."""
    return None if launch.cupy.cuda.runtime.getDevice() == device_id else launch.cupy.cuda.Device(device_id)


def quantize(x: Any, *, strict: bool = False) -> Activations:
    """Quantize float32 activations x [M, K] (docs/contract.md §1) once, for every GEMV that reads them.

    On the caller's current stream (CuPy's, or torch's for a torch tensor), no host synchronization unless
    `strict` (then non-finite values raise InputError). The buffers come from CuPy's pool on that stream."""
    a = _array(x, "activations")
    m, k = a.shape
    if m < 1 or k < BLOCK or k % BLOCK:
        raise InputError(f"activations have shape {a.shape}; need M >= 1 and K a positive multiple of {BLOCK}")
    guard = _device_guard(a.device_id)
    if guard is None:
        return _quantize(a, strict)
    with guard:
        return _quantize(a, strict)


def _quantize(a: _Array, strict: bool) -> Activations:
    m, k = a.shape
    caller = _STATE.caller_stream(a, a.device_id)
    if strict:
        _check_finite(a, caller)
    if a.torch:
        buffers = _torch_bytes(_activation_bytes(m, k // BLOCK), a.device_id)
        ptrs = _carve(buffers.data_ptr(), m, k // BLOCK)
    else:
        with caller:
            buffers = launch.empty_activations(m, k)
        ptrs = launch.storage(buffers)
    _enqueue_quantize(a, ptrs, caller)
    return Activations(m, k, a.device_id, a.torch, ptrs, buffers)


def _enqueue_quantize(a: _Array, ptrs: tuple[Any, Any, Any], caller: Any) -> None:
    on = launch.launch_stream(caller)
    launch.enqueue_quantize(np.uint64(a.ptr), a.shape[0], a.shape[1] // BLOCK, ptrs, on)
    launch.rejoin(caller, on)


def _torch_bytes(nbytes: int, device_id: int) -> Any:
    """A uint8 torch buffer from torch's allocator on torch's current stream (its graph pool when capturing)."""
    torch = _torch_module()
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device_id))


def gemv(weights: Weights, x: Any, out: Any = None, *, strict: bool = False) -> Any:
    """y = W·x [M, N] float32 for prepared weights and x: float32 activations [M, K] (quantized here, with
    the `strict` check when asked) or the Activations of quantize(x).

    `out`, when given, is a C-contiguous float32 [M, N] CuPy array or CUDA torch tensor on the weights'
    device and is returned; else a new array of x's library is. Launched on the caller's current stream
    (torch's when x is a torch tensor) with no host synchronization; the installed table chooses the kernel."""
    if not isinstance(weights, Weights):
        raise InputError(f"weights must come from runtime.prepare(...), got {type(weights).__name__}")
    if isinstance(x, Activations):
        src: _Array | Activations = x
        m, k = x.m, x.k
    else:
        src = _array(x, "activations")
        m, k = src.shape
    if k != weights.k or m < 1:
        raise InputError(f"activations have shape ({m}, {k}); the weights need [M >= 1, K={weights.k}]")
    if src.device_id != weights.device_id:
        raise InputError(f"activations are on device {src.device_id}, weights on device {weights.device_id}")
    dst = None
    if out is not None:
        dst = _array(out, "out")
        if dst.shape != (m, weights.n):
            raise InputError(f"out has shape {dst.shape}; the result is ({m}, {weights.n})")
        if dst.device_id != weights.device_id:
            raise InputError(f"out is on device {dst.device_id}, weights on device {weights.device_id}")
    guard = _device_guard(weights.device_id)
    if guard is None:
        return _gemv(weights, src, dst, m, strict)
    with guard:
        return _gemv(weights, src, dst, m, strict)


def _gemv(weights: Weights, src: _Array | Activations, dst: _Array | None, m: int, strict: bool) -> Any:
    caller = _STATE.caller_stream(src, weights.device_id)
    capturing = _capturing(caller)
    mode = "graph" if capturing else "eager"
    resolved = weights._launches.get((m, mode))
    if resolved is None:
        choice = _STATE.dispatcher.choose(_STATE.gpu_name(weights.device_id), weights.execution, m, weights.n,
                                          weights.k, mode)
        resolved = weights._launches[(m, mode)] = (launch.plan(choice.candidate, weights.planes, m), choice)
    plan = resolved[0]
    scratch = None  # keeps this call's temporary activations referenced until their launches are enqueued
    if isinstance(src, Activations):
        ptrs = src.ptrs
    else:  # unquantized x: quantize into scratch first, same stream
        if strict:
            _check_finite(src, caller)
        if src.torch:
            scratch = _torch_bytes(_activation_bytes(m, weights.k // BLOCK), weights.device_id)
            ptrs = _carve(scratch.data_ptr(), m, weights.k // BLOCK)
        elif capturing:
            ptrs = launch.storage(_STATE.captured_scratch(caller, m, weights.k))
        else:
            with caller:
                scratch = launch.empty_activations(m, weights.k)
            ptrs = launch.storage(scratch)
        _enqueue_quantize(src, ptrs, caller)
    if dst is None:
        result = _new_output(src, m, weights.n, caller)
        out_ptr = result.data_ptr() if src.torch else result.data.ptr
    else:
        result, out_ptr = dst.obj, dst.ptr
    on = launch.launch_stream(caller)
    ws = _STATE.workspace(plan.workspace_floats, weights.n, on, capturing) if plan.workspace_floats else None
    plan.enqueue(ptrs, np.uint64(out_ptr), ws, on)
    launch.rejoin(caller, on)
    del scratch  # now safe to free: the allocator's stream order covers the enqueued launches
    return result


def _new_output(src: _Array | Activations, m: int, n: int, caller: Any) -> Any:
    """A float32 [M, N] result in the library of x: torch's allocator on torch's stream, or CuPy's pool on
    the caller's stream (each library's own stream-ordered reuse then covers it)."""
    if src.torch:
        torch = _torch_module()
        return torch.empty((m, n), dtype=torch.float32, device=torch.device("cuda", src.device_id))
    with caller:
        return launch.cupy.empty((m, n), launch.cupy.float32)


def choice_for(weights: Weights, m: int, mode: Mode = "eager") -> Choice:
    """The table's choice for this matrix and M (what gemv launches in `mode`), for diagnostics and tests."""
    if m < 1:
        raise InputError(f"M must be >= 1, got {m}")
    return _STATE.dispatcher.choose(_STATE.gpu_name(weights.device_id), weights.execution, m, weights.n, weights.k,
                                    mode)
