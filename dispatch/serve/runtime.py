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

Dispatch: the table serving this GPU model answers select(codebook, M, N, K, mode) with mode "graph" while
the caller's stream is capturing, else "eager"; each answer is cached per key and the resolved launch per
prepared matrix and (M, mode) as a kernels.launch.PreparedLaunch (function handle and argument buffer built
once), so a repeated call costs the metadata checks, a few dictionary lookups, patching the pointers that changed
and cuLaunchKernel on the caller's raw stream handle. The table is the installed one (GPU-level certified for this
model); else, with one warning, a shipped table (install.shipped_table: this model's committed table, else the
nearest model's by SM count), verified as install verifies and used with its identities, so a process stays
byte-identical across M; else, with one warning, SAFE_DEFAULT, which is valid for every shape and gives the same
bytes as any identity-1 table choice.

Memory: nothing is allocated on the hot path of an eager caller. quantize() takes its buffers from a pool per
(device, caller stream, M, KB) and thread; they return to it when the Activations is dropped, and the caller's
stream orders their reuse, as in CuPy's and torch's pools: a result used on another stream needs that stream
ordered after the quantize, and the quantizing stream ordered after that use before the result is dropped (an
event, or a host synchronization). gemv(w, x) quantizes into such a
buffer and returns it once its launches are enqueued. Fresh pool buffers come from CuPy's pool on the caller's
stream, for torch callers too. kpar workspaces hold ticket counters that every launch leaves zero, so the
runtime keeps them, one per (device, launch stream, N). Results (`out` not given) come from the allocator of
the caller's array library on the caller's stream.
While the caller's stream captures a graph, buffers come from the caller's allocator as without a pool: torch's
caching allocator for torch callers (inside torch.cuda.graph that is the graph's private pool, which keeps them
for the graph), CuPy's pool for CuPy callers. CuPy has no graph-private pool, so for a CuPy capture the caller
keeps x, the result of quantize and `out` alive while the graph lives, and the runtime keeps the scratch it
allocates during a capture (kpar workspaces, activations of `gemv(w, x)` with unquantized x) for the life of the
process, one set per capturing stream, shared by the graphs captured on that stream: do not replay such graphs
concurrently with each other.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ...kernels import launch
from ...kernels.codebooks import CODEBOOKS, get
from ...kernels.errors import BLOCK, InputError
from ...kernels.layout import PackedWeights, pack
from ...kernels.registry import Candidate, by_id
from ..common.contract import MODES, Mode
from ..measure.shapes import open_gguf
from . import install

SAFE_DEFAULT = "wide.s1.t128.c1"  # identity 1, valid for every (M, N, K): no split, cpt 1, no mma tile
_FLOAT32 = np.dtype(np.float32)  # compared on every call: a dtype object, not a type to convert each time


# ---------------------------------------------------------------------------------------------------------
# Dispatch: the installed table, a shipped one, or the safe default


@dataclass(frozen=True)
class GpuModel:
    """What dispatch knows of a GPU: its model name (the table's key) and SM count (to find the nearest table)."""

    name: str
    sm_count: int


@dataclass(frozen=True)
class Choice:
    """What the runtime launches for one (codebook, M, N, K, mode)."""

    candidate: Candidate
    identity: int
    source: str  # the table's "overlay" / "fallback", or "default" without a table


@dataclass(frozen=True)
class Serving:
    """What answers select() for one GPU model, and why it is not a certified table of that model (None when it
    is): said once per process and model."""

    table: Any | None  # None: SAFE_DEFAULT for every shape
    warning: str | None = None


def installed_table(gpu_name: str) -> tuple[Any, str | None]:
    """(table, None) for a GPU-level certified table installed for `gpu_name`, else (None, why not)."""
    table = install.installed_table(gpu_name)
    if table is None:
        return None, f"no dispatch table is installed for {gpu_name}"
    if not table.gpu_level:  # docs/policy.md §9: a table serves a GPU only with GPU-level certification
        return None, f"the table installed for {gpu_name} is certified on the emulator only, not on this GPU model"
    return table, None


_TUNE = "Run `gemv-dispatch tune` to install a table certified on this GPU."


def serving_table(gpu: GpuModel) -> Serving:
    """The installed table of this GPU model; else the shipped table install.shipped_table picks (this model's
    committed table, else the nearest model's by SM count), verified as install verifies, whose identities keep
    every result byte-identical across M; else SAFE_DEFAULT."""
    table, why = installed_table(gpu.name)
    if table is not None:
        return Serving(table)
    shipped, refused = install.shipped_table(gpu.name, gpu.sm_count)
    if shipped is None:
        unusable = f"; no shipped table loads ({'; '.join(refused)})" if refused else ""
        return Serving(None, f"{why}{unusable}; every GEMV on this GPU uses the safe default {SAFE_DEFAULT} "
                             f"(correct and byte-identical across M, not tuned). {_TUNE}")
    name = shipped.table.gpu_name
    if shipped.gpu_level:
        return Serving(shipped, f"{why}; serving the table shipped for {name}, certified on a GPU of this model. "
                                "Run `gemv-dispatch tune` to install one tuned on this GPU.")
    return Serving(shipped, f"{why}; serving the shipped table of {name} (tuned on {shipped.sm_count} SMs, the "
                            f"nearest to this GPU's {gpu.sm_count}): one K split per shape, so results are "
                            f"byte-identical across M, but neither tuned nor certified on this GPU model. {_TUNE}")


class Dispatcher:
    """Answers select() from the table serving each GPU model (`load`, once per model), warning once where that
    is not a certified table of the model. Answers are cached per key; a table's answer is checked once (known
    candidate, valid for the shape, the identity it claims) so a bad table fails loudly, not in a kernel."""

    def __init__(self, load: Callable[[GpuModel], Serving] = serving_table) -> None:
        self._load = load
        self._tables: dict[GpuModel, Any] = {}
        self._choices: dict[tuple[GpuModel, str, int, int, int, str], Choice] = {}
        self._lock = threading.Lock()  # one load and one warning per GPU even with concurrent first calls

    def table(self, gpu: GpuModel) -> Any:
        """The table serving `gpu`, or None for SAFE_DEFAULT (after warning once)."""
        try:
            return self._tables[gpu]
        except KeyError:
            pass
        with self._lock:
            if gpu not in self._tables:
                serving = self._load(gpu)
                if serving.warning:
                    warnings.warn(f"gemv-dispatch: {serving.warning}", RuntimeWarning, stacklevel=2)
                self._tables[gpu] = serving.table
        return self._tables[gpu]

    def choose(self, gpu: GpuModel, codebook: str, m: int, n: int, k: int, mode: Mode) -> Choice:
        key = (gpu, codebook, m, n, k, mode)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = self._resolve(*key)
        return choice

    def _resolve(self, gpu: GpuModel, codebook: str, m: int, n: int, k: int, mode: Mode) -> Choice:
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        table = self.table(gpu)
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
            raise RuntimeError(f"the dispatch table serving {gpu.name} chose {cid} for {codebook} M={m} "
                               f"N={n} K={k} {mode}, which is wrong: {reason}; reinstall or roll it back")
        return Choice(candidate, identity, answer.source)


# ---------------------------------------------------------------------------------------------------------
# Weights


@dataclass(frozen=True)
class _Resolved:
    """A matrix's launch for one (M, mode): prepared once, so a call patches pointers and launches."""

    launch: launch.PreparedLaunch
    choice: Choice
    workspace_floats: int  # kpar's workspace (launch.Plan.workspace_floats); 0 for the others


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
    _launches: dict[tuple[int, str], _Resolved] = field(default_factory=dict, repr=False)


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


# What the launches need from a CuPy array or torch tensor, read from metadata, never from the data: its address,
# shape, device and whether it is a torch tensor. A plain tuple: built on every call, and a tuple builds fastest.
_Meta = tuple[int, tuple[int, ...], int, bool]


def _torch_module() -> Any:
    # torch is never imported here: an object can only be a torch tensor if the caller imported torch.
    return sys.modules.get("torch")


def _array(x: Any, what: str) -> _Meta:
    """Check that `x` is a C-contiguous 2-D float32 GPU array (CuPy or CUDA torch); InputError otherwise."""
    cp = launch.cupy
    if cp is not None and isinstance(x, cp.ndarray):  # first: the common case pays for no other test
        if x.dtype != _FLOAT32:
            raise InputError(f"{what} must be float32 (no implicit casts), got {x.dtype}")
        # _c_contiguous is the attribute behind flags.c_contiguous, read without building a flags object
        if x.ndim != 2 or not x._c_contiguous:
            raise InputError(f"{what} must be a C-contiguous 2-D array, got shape {x.shape}"
                             f"{'' if x._c_contiguous else ' (not C-contiguous)'}")
        data = x.data
        return data.ptr, x.shape, data.device_id, False
    if isinstance(x, np.ndarray):
        raise InputError(f"{what} is a CPU (numpy) array; the GPU runtime takes CuPy arrays or CUDA torch tensors "
                         "(move it with cupy.asarray)")
    torch = _torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        device = x.device
        if device.type != "cuda":
            raise InputError(f"{what} is a torch tensor on {device}; the GPU runtime needs a CUDA tensor "
                             "(tensor.cuda())")
        if x.dtype != torch.float32:
            raise InputError(f"{what} must be float32 (no implicit casts), got {x.dtype}")
        if x.dim() != 2 or not x.is_contiguous():
            raise InputError(f"{what} must be a contiguous 2-D tensor, got shape {tuple(x.shape)}"
                             f"{'' if x.is_contiguous() else ' (not contiguous)'}")
        return x.data_ptr(), tuple(x.shape), device.index, True
    raise InputError(f"{what} must be a CuPy array or a CUDA torch tensor, got {type(x).__name__}")


# ---------------------------------------------------------------------------------------------------------
# Activations


_Slab = tuple[Any, tuple[int, int, int]]  # pooled activation buffers (launch.empty_activations) and their pointers


@dataclass(slots=True, eq=False)  # built on every quantize: a slots class constructs fast; treat it as read-only
class Activations:
    """Quantized activations (quantize): block-major device buffers of M rows and K, on one device, with
    the array library of the x they came from (gemv returns the same kind). Pooled buffers go back to their
    pool when this object is dropped; the stream they were quantized on orders their reuse."""

    m: int
    k: int
    device_id: int
    torch: bool
    ptrs: tuple[int, int, int]  # base pointers of q, d_a and sum_a, as the kernels take them
    buffers: Any  # what owns them: a launch.empty_activations, or one torch uint8 tensor (torch graph capture)
    _pool: list[_Slab] | None = field(default=None, repr=False)  # where the buffers return when this is dropped

    def __del__(self) -> None:
        if self._pool is not None:
            self._pool.append((self.buffers, self.ptrs))


def _carve(base: int, m: int, kb: int) -> tuple[int, int, int]:
    """Pointers of q int8 [KB][M][32], d float32 [KB][M] and sum int32 [KB][M] packed in one buffer from `base`
    (q's size is a multiple of 32 bytes, so d and sum stay aligned)."""
    q_bytes = m * kb * BLOCK
    return base, base + q_bytes, base + q_bytes + 4 * m * kb


def _activation_bytes(m: int, kb: int) -> int:
    return m * kb * (BLOCK + 8)


class _StreamHandle:
    """A foreign stream handle speaking the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _cupy_stream(handle: int, device_id: int) -> Any:
    """A CuPy stream object for a raw handle (torch's), under which CuPy's pool allocates for that stream; only
    on the allocating (cold) paths."""
    cp = launch.cupy
    current = cp.cuda.get_current_stream(device_id)
    if current.ptr == handle:
        return current
    if hasattr(cp.cuda.Stream, "from_external"):  # CuPy >= 14 (ExternalStream is deprecated there)
        return cp.cuda.Stream.from_external(_StreamHandle(handle))
    return cp.cuda.ExternalStream(handle, device_id)


class _Pools(threading.local):
    # Per thread, so that the per-thread default stream (one handle, 2, for every thread) never shares a buffer
    # between threads whose streams are unordered.
    def __init__(self) -> None:
        self.free: dict[tuple[int, int, int, int], list[_Slab]] = {}


@dataclass(frozen=True)
class _Cuda:
    """The CuPy calls of the hot path, looked up once: a module attribute chain per call costs more than the call."""

    get_device: Callable[[], int]
    device: Callable[[int], Any]  # cupy.cuda.Device: a context that makes a device current
    current_stream: Callable[[int], Any]  # cupy.cuda.get_current_stream
    is_capturing: Callable[[int], bool]  # cupy.cuda.runtime.streamIsCapturing, of a stream handle

    @classmethod
    def of(cls, cp: Any) -> _Cuda:
        return cls(cp.cuda.runtime.getDevice, cp.cuda.Device, cp.cuda.get_current_stream,
                   cp.cuda.runtime.streamIsCapturing)


class _Runtime:
    """Process state: the dispatcher, GPU models, activation pools, and scratch buffers."""

    def __init__(self) -> None:
        self.dispatcher = Dispatcher()
        self.gpus: dict[int, GpuModel] = {}
        self.pools = _Pools()
        self.workspaces: dict[tuple[int, int, int], tuple[Any, int]] = {}  # eager, per (device, stream, N)
        self.captured_workspaces: dict[tuple[int, int, int], tuple[Any, int]] = {}  # kept for the graphs
        self.captured_activations: dict[tuple[int, int, int, int], _Slab] = {}
        self.retired: list[Any] = []  # captured buffers replaced by larger ones: a graph may still read them

    @cached_property
    def cuda(self) -> _Cuda:
        return _Cuda.of(launch.require_cupy())

    def gpu(self, device_id: int) -> GpuModel:
        model = self.gpus.get(device_id)
        if model is None:
            props = launch.cupy.cuda.runtime.getDeviceProperties(device_id)
            model = self.gpus[device_id] = GpuModel(props["name"].decode(), int(props["multiProcessorCount"]))
        return model

    def pool(self, device_id: int, stream: int, m: int, kb: int) -> list[_Slab]:
        """The free activation buffers for M×KB on a caller's stream (handle) of a device: a buffer taken from it
        and returned after its launches were enqueued on that stream is next used by later work of the same
        stream, so stream order makes the reuse safe, as in CuPy's and torch's own pools."""
        key = (device_id, stream, m, kb)
        free = self.pools.free.get(key)
        if free is None:
            free = self.pools.free[key] = []
        return free

    def new_slab(self, device_id: int, stream: int, m: int, k: int) -> _Slab:
        """Fresh activation buffers from CuPy's pool on `stream`, for a pool (only when none is free)."""
        with _cupy_stream(stream, device_id):
            buffers = launch.empty_activations(m, k)
        return buffers, launch.storage(buffers)

    def workspace(self, floats: int, device_id: int, n: int, on: int, capturing: bool) -> int:
        """The address of a kpar workspace (launch.new_workspace) of at least `floats` elements for outputs of width
        N and launches on the stream handle `on`, from CuPy's pool on that stream, for CuPy and torch callers alike:
        each launch leaves its tickets zero and stream order makes reuse by the next launch on `on` safe; a
        workspace serves one N, since another N's tickets would sit on its partials. Eager buffers are replaced
        when too small (the old one returns to the pool); buffers used in a capture are kept."""
        cache = self.captured_workspaces if capturing else self.workspaces
        key = (device_id, on, n)
        held = cache.get(key)
        if held is None or held[0].size < floats:
            if capturing and held is not None:
                self.retired.append(held[0])
            with _cupy_stream(on, device_id):
                ws = launch.new_workspace(4 * floats, n)
            held = cache[key] = (ws, ws.data.ptr)
        return held[1]

    def captured_scratch(self, device_id: int, stream: int, m: int, k: int) -> _Slab:
        """Activations for gemv(w, x) while capturing on `stream`: kept, since the graph writes and reads them."""
        key = (device_id, stream, m, k)
        slab = self.captured_activations.get(key)
        if slab is None:
            slab = self.captured_activations[key] = self.new_slab(device_id, stream, m, k)
        return slab


_STATE = _Runtime()


def _caller(cuda: _Cuda, torch: bool, device_id: int) -> tuple[int, bool]:
    """The handle of the caller's current stream in the array's own library, and whether it is capturing a graph
    (a default stream cannot capture, and querying the legacy stream while another thread captures would fail)."""
    stream = (_torch_module().cuda.current_stream(device_id).cuda_stream if torch
              else cuda.current_stream(device_id).ptr)
    return stream, stream not in launch.DEFAULT_STREAMS and cuda.is_capturing(stream)


def _check_finite(x: Any, torch: bool, capturing: bool) -> None:
    """strict=True: one host synchronization with the caller's stream (the reduction runs on it: it is current)."""
    if capturing:
        raise InputError("strict=True synchronizes the host and cannot run while the stream is capturing a graph")
    xp = _torch_module() if torch else launch.cupy
    if not bool(xp.isfinite(x).all()):
        raise InputError("activations contain non-finite values; they must be finite")


def quantize(x: Any, *, strict: bool = False) -> Activations:
    """Quantize float32 activations x [M, K] (docs/contract.md §1) once, for every GEMV that reads them.

    On the caller's current stream (CuPy's, or torch's for a torch tensor), no host synchronization unless
    `strict` (then non-finite values raise InputError). The buffers are reused per (M, K) and stream once an
    earlier result is dropped; while the stream captures a graph they come from the caller's allocator."""
    ptr, (m, k), device_id, torch = _array(x, "activations")
    if m < 1 or k < BLOCK or k % BLOCK:
        raise InputError(f"activations have shape {(m, k)}; need M >= 1 and K a positive multiple of {BLOCK}")
    cuda = _STATE.cuda
    if cuda.get_device() != device_id:  # the launches need x's device current: again, there
        with cuda.device(device_id):
            return quantize(x, strict=strict)
    kb = k // BLOCK
    caller, capturing = _caller(cuda, torch, device_id)
    if strict:
        _check_finite(x, torch, capturing)
    pool = None
    if capturing:  # the caller's allocator: torch's graph pool keeps them for a torch graph
        if torch:
            buffers = _torch_bytes(_activation_bytes(m, kb), device_id)
            ptrs = _carve(buffers.data_ptr(), m, kb)
        else:
            buffers = launch.empty_activations(m, k)  # CuPy's pool on its current stream, the caller's
            ptrs = launch.storage(buffers)
    else:
        pool = _STATE.pool(device_id, caller, m, kb)
        buffers, ptrs = pool.pop() if pool else _STATE.new_slab(device_id, caller, m, k)
    on = caller if caller not in launch.DEFAULT_STREAMS else launch.launch_stream(caller)
    launch.quantize_launch(device_id, m, kb).launch(on, (ptr, *ptrs))
    if on != caller:
        launch.rejoin(caller, on)
    return Activations(m, k, device_id, torch, ptrs, buffers, pool)


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
        m, k, device_id, torch, ptrs = x.m, x.k, x.device_id, x.torch, x.ptrs
    else:
        x_ptr, (m, k), device_id, torch = _array(x, "activations")
        ptrs = None
    if k != weights.k or m < 1:
        raise InputError(f"activations have shape ({m}, {k}); the weights need [M >= 1, K={weights.k}]")
    if device_id != weights.device_id:
        raise InputError(f"activations are on device {device_id}, weights on device {weights.device_id}")
    out_ptr = 0
    if out is not None:
        out_ptr, shape, out_device, _ = _array(out, "out")
        if shape != (m, weights.n):
            raise InputError(f"out has shape {shape}; the result is ({m}, {weights.n})")
        if out_device != device_id:
            raise InputError(f"out is on device {out_device}, weights on device {device_id}")
    cuda = _STATE.cuda
    if cuda.get_device() != device_id:  # the launches need the weights' device current: again, there
        with cuda.device(device_id):
            return gemv(weights, x, out, strict=strict)
    caller, capturing = _caller(cuda, torch, device_id)
    mode: Mode = "graph" if capturing else "eager"
    resolved = weights._launches.get((m, mode)) or _resolve(weights, m, mode)
    on = caller if caller not in launch.DEFAULT_STREAMS else launch.launch_stream(caller)
    pool = scratch = None  # this call's unquantized-x buffers: returned to the pool, or referenced, until enqueued
    if ptrs is None:  # unquantized x: quantize into scratch first, same stream
        if strict:
            _check_finite(x, torch, capturing)
        kb = k // BLOCK
        if not capturing:
            pool = _STATE.pool(device_id, caller, m, kb)
            scratch = pool.pop() if pool else _STATE.new_slab(device_id, caller, m, k)
            ptrs = scratch[1]
        elif torch:
            scratch = _torch_bytes(_activation_bytes(m, kb), device_id)
            ptrs = _carve(scratch.data_ptr(), m, kb)
        else:
            ptrs = _STATE.captured_scratch(device_id, caller, m, k)[1]
        launch.quantize_launch(device_id, m, kb).launch(on, (x_ptr, *ptrs))
    if out is None:
        out = _new_output(torch, device_id, m, weights.n)
        out_ptr = out.data_ptr() if torch else out.data.ptr
    floats = resolved.workspace_floats
    ws = _STATE.workspace(floats, device_id, weights.n, on, capturing) if floats else 0
    resolved.launch.launch(on, ptrs + (out_ptr, ws))  # noqa: RUF005 (concatenating builds it faster than unpacking)
    if on != caller:
        launch.rejoin(caller, on)
    if pool is not None:
        pool.append(scratch)  # stream order covers the launches just enqueued
    return out


def _resolve(weights: Weights, m: int, mode: Mode) -> _Resolved:
    choice = _STATE.dispatcher.choose(_STATE.gpu(weights.device_id), weights.execution, m, weights.n, weights.k, mode)
    plan = launch.plan(choice.candidate, weights.planes, m)
    resolved = weights._launches[(m, mode)] = _Resolved(plan.prepare(), choice, plan.workspace_floats)
    return resolved


def _new_output(torch: bool, device_id: int, m: int, n: int) -> Any:
    """A float32 [M, N] result in the library of x, from its allocator on its current stream, the caller's (each
    library's own stream-ordered reuse then covers it)."""
    if torch:
        module = _torch_module()
        return module.empty((m, n), dtype=module.float32, device=module.device("cuda", device_id))
    return launch.cupy.empty((m, n), launch.cupy.float32)


def choice_for(weights: Weights, m: int, mode: Mode = "eager") -> Choice:
    """The table's choice for this matrix and M (what gemv launches in `mode`), for diagnostics and tests."""
    if m < 1:
        raise InputError(f"M must be >= 1, got {m}")
    return _STATE.dispatcher.choose(_STATE.gpu(weights.device_id), weights.execution, m, weights.n, weights.k, mode)
