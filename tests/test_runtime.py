"""Runtime checks that need no GPU (docs/policy.md §9, §10): dispatch through a table or the safe default with one
warning, and every input mistake refused from host metadata alone, before anything reaches a device."""

from __future__ import annotations

import ctypes
import shutil
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from gemv_dispatch.dispatch.common.paths import data_dir
from gemv_dispatch.dispatch.serve import install, runtime
from gemv_dispatch.kernels import launch, layout
from gemv_dispatch.kernels.codebooks import quantize
from gemv_dispatch.kernels.errors import EnvironmentProblem, InputError
from gemv_dispatch.kernels.registry import by_id

GPU = runtime.GpuModel("NVIDIA Test GPU", 132)


class Answer(NamedTuple):  # the generated module's Choice
    candidate: str
    identity: int
    source: str


@dataclass
class FakeTable:
    answer: Answer
    gpu_level: bool = True
    calls: int = 0

    def select(self, codebook: str, m: int, n: int, k: int, mode: str) -> Answer:
        self.calls += 1
        return self.answer


def loader(table: FakeTable | None):
    def load(gpu: runtime.GpuModel) -> runtime.Serving:
        return runtime.Serving(table) if table is not None else runtime.Serving(None, "no table (test)")
    return load


@pytest.fixture
def nothing_installed(monkeypatch):
    """No installed table for any GPU, and no shipped table either (each test may ship its own)."""
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: None)
    monkeypatch.setattr(runtime.install, "shipped_table", lambda gpu_name, sm_count: (None, []))


# --- dispatch --------------------------------------------------------------------------------------------

def test_no_table_warns_once_and_serves_the_safe_default(nothing_installed):
    d = runtime.Dispatcher()
    with pytest.warns(RuntimeWarning, match=r"no dispatch table is installed for NVIDIA Test GPU.*wide\.s1\.t128\.c1"
                                            r".*gemv-dispatch tune"):
        first = d.choose(GPU, "q4_0", 1, 4096, 4096, "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        others = [d.choose(GPU, cb, m, n, k, mode) for cb in ("q4_0", "iq4_nl") for m in (1, 7, 31)
                  for n, k in ((1, 32), (151936, 4096), (4097, 14336)) for mode in ("graph", "eager")]
    for c in [first, *others]:
        assert (c.candidate.id, c.identity, c.source) == (runtime.SAFE_DEFAULT, 1, "default")
    assert by_id(runtime.SAFE_DEFAULT).valid(31, 1, 32)


def test_table_answers_are_cached_per_key():
    table = FakeTable(Answer("kpar.s8.t128.c1", 8, "overlay"))
    d = runtime.Dispatcher(loader(table))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a table is installed: no warning
        a = d.choose(GPU, "q8_0", 4, 1024, 4096, "graph")
        b = d.choose(GPU, "q8_0", 4, 1024, 4096, "graph")
    assert a is b and table.calls == 1
    assert (a.candidate.id, a.identity, a.source) == ("kpar.s8.t128.c1", 8, "overlay")
    d.choose(GPU, "q8_0", 4, 1024, 4096, "eager")
    assert table.calls == 2  # the mode is part of the key


def test_emulator_only_table_is_not_served(monkeypatch, nothing_installed):
    emulator_only = FakeTable(Answer("kpar.s8.t128.c1", 8, "overlay"), gpu_level=False)
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: emulator_only)
    d = runtime.Dispatcher()
    with pytest.warns(RuntimeWarning, match="emulator only"):
        c = d.choose(GPU, "q8_0", 4, 1024, 4096, "graph")
    assert c.candidate.id == runtime.SAFE_DEFAULT and emulator_only.calls == 0


@pytest.mark.parametrize("answer,why", [
    (Answer("kpar.s8.t128.c1", 4, "fallback"), "identity for K=4096 is 8"),  # the identity it claims is wrong
    (Answer("wide.s1.t128.c2", 1, "fallback"), "not a multiple of 2"),  # invalid for odd N
    (Answer("nonesuch.s1", 1, "fallback"), "no such candidate"),
])
def test_a_wrong_table_answer_fails_loudly(answer, why):
    d = runtime.Dispatcher(loader(FakeTable(answer)))
    with pytest.raises(RuntimeError, match=why):
        d.choose(GPU, "q4_0", 2, 1001, 4096, "eager")


def test_valid_table_answer_is_accepted_negative_control():
    # The checks above reject only wrong answers: the same table shape with a right one passes.
    d = runtime.Dispatcher(loader(FakeTable(Answer("wide.s1.t128.c1", 1, "fallback"))))
    assert d.choose(GPU, "q4_0", 2, 1001, 4096, "eager").candidate.id == "wide.s1.t128.c1"


def test_bad_mode_is_refused():
    with pytest.raises(InputError, match="mode"):
        runtime.Dispatcher(loader(None)).choose(GPU, "q4_0", 1, 64, 64, "lazy")


def test_installed_table_or_why_not(monkeypatch):
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: None)
    table, why = runtime.installed_table(GPU.name)
    assert table is None and GPU.name in why
    emulator_only = FakeTable(Answer("wide.s1.t128.c1", 1, "fallback"), gpu_level=False)
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: emulator_only)
    table, why = runtime.installed_table(GPU.name)
    assert table is None and "emulator only" in why
    good = FakeTable(Answer("wide.s1.t128.c1", 1, "fallback"))
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: good)
    assert runtime.installed_table(GPU.name) == (good, None)
    assert runtime.serving_table(GPU) == runtime.Serving(good, None)  # an installed table: served, no warning


# --- no table installed: a shipped table --------------------------------------------------------------------

H100 = runtime.GpuModel("NVIDIA H100 80GB HBM3", 132)


def test_without_an_installed_table_the_shipped_one_serves_with_its_identities(monkeypatch):
    """The committed table (verified as install verifies) serves a GPU model with none installed: one warning naming
    it and `tune`, then its answers, one identity per shape for every M and mode, so grouped launches equal serial
    M = 1 ones; never the safe default where a shipped table loads."""
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: None)
    d = runtime.Dispatcher()
    with pytest.warns(RuntimeWarning) as caught:
        first = d.choose(H100, "q4_0", 1, 4096, 4096, "eager")
    (message,) = [str(w.message) for w in caught]
    assert "no dispatch table is installed for NVIDIA H100 80GB HBM3" in message
    assert "shipped table of NVIDIA H200 (tuned on 132 SMs, the nearest to this GPU's 132)" in message
    assert "gemv-dispatch tune" in message and runtime.SAFE_DEFAULT not in message
    assert first.source in ("overlay", "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        for codebook, n, k in (("q4_0", 4096, 4096), ("q4_0", 4096, 14336), ("q8_0", 151936, 4096),
                               ("q4_k", 1024, 4096), ("iq4_nl", 1000, 2080)):
            choices = [d.choose(H100, codebook, m, n, k, mode) for m in (*range(1, 17), 31)
                       for mode in ("graph", "eager")]
            assert len({c.identity for c in choices}) == 1, (codebook, n, k)
            assert all(c.candidate.valid(m, n, k) for c, m in zip(choices, [m for m in (*range(1, 17), 31)
                                                                            for _ in range(2)], strict=True))
    # The table of its own model is served as certified for it (the same warning names it so).
    own = runtime.serving_table(runtime.GpuModel("NVIDIA H200", 132))
    assert own.table is not None and own.table.gpu_level and "certified on a GPU of this model" in own.warning


def test_a_shipped_table_is_verified_as_install_verifies(tmp_path):
    """A committed table whose module was edited after certification is refused by name (and the intact copy, the
    negative control, serves): the shipped tables go through install's verifier, not around it."""
    shipped = data_dir() / "generated" / "nvidia-h200"
    for copy in ("intact", "edited"):
        shutil.copytree(shipped, tmp_path / copy / "nvidia-h200")
    module = tmp_path / "edited" / "nvidia-h200" / "dispatch_table.py"
    module.write_text(module.read_text().replace("SM_COUNT = 132", "SM_COUNT = 133"))
    table, refused = install.shipped_table("GPU X", 132, tmp_path / "intact")
    assert table is not None and table.table.gpu_name == "NVIDIA H200" and refused == []
    table, refused = install.shipped_table("GPU X", 132, tmp_path / "edited")
    assert table is None and len(refused) == 1 and "differ from what the certificate binds" in refused[0]


@dataclass
class ShippedTable:  # what install.shipped_table ranks: a verified Table's fields
    gpu_name: str
    sm_count: int | None
    folder: Path
    level: str = "gpu"

    @property
    def module(self):
        return types.SimpleNamespace() if self.sm_count is None else types.SimpleNamespace(SM_COUNT=self.sm_count)


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A shipped-data folder of table folders, each standing for a verified table (install._verified faked):
    ship(slug, gpu_name, sm_count, ...) adds one; a verify failure is an InputError."""
    tables: dict[str, ShippedTable | InputError] = {}

    def ship(slug: str, gpu_name: str, sm_count: int | None, level: str = "gpu", refused: str | None = None):
        folder = tmp_path / "generated" / slug
        folder.mkdir(parents=True)
        (folder / "certificate.json").write_text("{}")
        tables[str(folder)] = InputError(f"{folder}: {refused}") if refused else ShippedTable(
            gpu_name, sm_count, folder, level)

    def verified(folder: str):
        table = tables[folder]
        if isinstance(table, InputError):
            raise table
        return table

    monkeypatch.setattr(install, "_verified", verified)
    ship.data = tmp_path
    ship.root = tmp_path / "generated"
    return ship


def shipped_for(shipped, gpu_name: str, sm_count: int) -> tuple[str | None, bool, list[str]]:
    table, refused = install.shipped_table(gpu_name, sm_count, shipped.root)
    return (None, False, refused) if table is None else (table.table.gpu_name, table.gpu_level, refused)


def test_shipped_table_is_this_models_else_the_nearest_by_sm_count(shipped):
    shipped("gpu-a", "GPU A", 132)
    shipped("gpu-b", "GPU B", 80)
    shipped("gpu-c", "GPU C", 108)
    assert shipped_for(shipped, "GPU X", 114) == ("GPU C", False, [])  # |108 - 114| < |132 - 114|
    assert shipped_for(shipped, "GPU X", 128) == ("GPU A", False, [])  # negative control: nearer to 132
    assert shipped_for(shipped, "GPU X", 10) == ("GPU B", False, [])
    assert shipped_for(shipped, "gpu b", 130) == ("GPU B", True, [])  # its own model first, however far


def test_shipped_table_ties_go_to_the_folder_name_and_a_table_without_sm_count_last(shipped):
    shipped("gpu-z", "GPU Z", 100)
    shipped("gpu-y", "GPU Y", 120)
    shipped("gpu-w", "GPU W", None)
    assert shipped_for(shipped, "GPU X", 110) == ("GPU Y", False, [])
    assert shipped_for(shipped, "GPU X", 100_000)[0] == "GPU Y"


def test_shipped_tables_that_fail_verification_or_are_emulator_level_are_skipped_and_named(shipped):
    shipped("gpu-a", "GPU A", 132, refused="its bytes differ from what the certificate binds")
    shipped("gpu-b", "GPU B", 130, level="emulator")
    assert shipped_for(shipped, "GPU X", 132) == (None, False, [
        f"{shipped.root / 'gpu-a'}: its bytes differ from what the certificate binds",
        f"{shipped.root / 'gpu-b'}: certified on the emulator only"])
    shipped("gpu-c", "GPU C", 20)
    name, _, refused = shipped_for(shipped, "GPU X", 132)
    assert name == "GPU C" and len(refused) == 2  # the far one that verifies serves; the refused are named


def test_safe_default_only_when_no_shipped_table_loads(monkeypatch, shipped):
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: None)
    monkeypatch.setattr(install, "data_dir", lambda: shipped.data)
    serving = runtime.serving_table(GPU)  # no shipped tables at all
    assert serving.table is None and runtime.SAFE_DEFAULT in serving.warning and "no shipped" not in serving.warning
    shipped("gpu-a", "GPU A", 132, refused="certified for kernel code 0123")
    serving = runtime.serving_table(GPU)
    assert serving.table is None and "no shipped table loads" in serving.warning and "0123" in serving.warning
    shipped("gpu-b", "GPU B", 100)
    serving = runtime.serving_table(GPU)  # negative control: one that loads serves instead of the default
    assert serving.table.table.gpu_name == "GPU B" and runtime.SAFE_DEFAULT not in serving.warning


# --- prepare ---------------------------------------------------------------------------------------------

def blocks(codebook: str, n: int, k: int) -> np.ndarray:
    return quantize(codebook, np.random.default_rng(3).standard_normal((n, k), dtype=np.float32))


def test_prepare_refuses_bad_weights():
    good = blocks("Q4_0", 8, 64)
    with pytest.raises(InputError, match="codebook and K"):
        runtime.prepare(good)
    with pytest.raises(InputError, match="carries its codebook"):
        runtime.prepare(layout.pack("Q4_0", good, 8, 64), "Q4_0", 64)
    with pytest.raises(InputError, match="PackedWeights, got list"):
        runtime.prepare([[1, 2]], "Q4_0", 64)
    with pytest.raises(InputError, match="2-D"):
        runtime.prepare(good.ravel(), "Q4_0", 64)
    with pytest.raises(InputError):
        runtime.prepare(good, "Q4_0", 96)  # K does not match the bytes
    with pytest.raises(InputError):
        runtime.prepare(good, "Q9_9", 64)
    with pytest.raises(InputError, match="not a multiple of 256"):
        runtime.prepare(blocks("Q4_K", 8, 256)[:, :72], "Q4_K", 128)  # half a super-block


@pytest.mark.skipif(launch.cupy is not None, reason="CuPy is installed here")
def test_prepare_without_cupy_says_so():
    with pytest.raises(EnvironmentProblem, match="CuPy is not installed"):
        runtime.prepare(blocks("Q8_0", 8, 64), "Q8_0", 64)


# --- gemv / quantize input checks (host metadata only) ----------------------------------------------------

def fake_weights(n: int = 16, k: int = 64, device_id: int = 0) -> runtime.Weights:
    return runtime.Weights("Q4_0", "q4_0", n, k, device_id, planes=None)


class FakeDevice:
    def __init__(self, type_: str, index: int | None) -> None:
        self.type, self.index = type_, index

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


@pytest.fixture
def torch(monkeypatch):
    """A stand-in torch module with just the tensor metadata the runtime reads; restored after the test."""
    fake = types.ModuleType("torch")
    fake.float32, fake.float16 = "torch.float32", "torch.float16"

    class Tensor:
        def __init__(self, shape, dtype=fake.float32, device=("cuda", 0), contiguous=True):
            self.shape, self.dtype, self.device, self._contiguous = tuple(shape), dtype, FakeDevice(*device), contiguous

        def dim(self) -> int:
            return len(self.shape)

        def is_contiguous(self) -> bool:
            return self._contiguous

        def data_ptr(self) -> int:
            return 0x7F0000000000

    fake.Tensor = Tensor
    monkeypatch.setitem(sys.modules, "torch", fake)
    return fake


def test_gemv_refuses_cpu_arrays_and_foreign_objects():
    w = fake_weights()
    with pytest.raises(InputError, match=r"CPU \(numpy\) array"):
        runtime.gemv(w, np.zeros((1, 64), np.float32))
    with pytest.raises(InputError, match=r"CPU \(numpy\) array"):
        runtime.quantize(np.zeros((1, 64), np.float32))
    with pytest.raises(InputError, match="CuPy array or a CUDA torch tensor, got list"):
        runtime.gemv(w, [[0.0] * 64])
    with pytest.raises(InputError, match=r"runtime\.prepare"):
        runtime.gemv(layout.pack("Q4_0", blocks("Q4_0", 16, 64), 16, 64), np.zeros((1, 64), np.float32))


def test_gemv_checks_torch_metadata(torch):
    w = fake_weights(n=16, k=64)
    with pytest.raises(InputError, match=r"torch tensor on cpu; .*CUDA tensor"):
        runtime.gemv(w, torch.Tensor((2, 64), device=("cpu", None)))
    with pytest.raises(InputError, match=r"float32 .*got torch\.float16"):
        runtime.gemv(w, torch.Tensor((2, 64), dtype=torch.float16))
    with pytest.raises(InputError, match="not contiguous"):
        runtime.gemv(w, torch.Tensor((2, 64), contiguous=False))
    with pytest.raises(InputError, match="2-D"):
        runtime.gemv(w, torch.Tensor((2, 4, 16)))
    with pytest.raises(InputError, match=r"K=64"):
        runtime.gemv(w, torch.Tensor((2, 128)))
    with pytest.raises(InputError, match="device 1, weights on device 0"):
        runtime.gemv(w, torch.Tensor((2, 64), device=("cuda", 1)))
    x = torch.Tensor((2, 64))
    with pytest.raises(InputError, match=r"out has shape \(3, 16\)"):
        runtime.gemv(w, x, out=torch.Tensor((3, 16)))
    with pytest.raises(InputError, match="out must be float32"):
        runtime.gemv(w, x, out=torch.Tensor((2, 16), dtype=torch.float16))
    with pytest.raises(InputError, match="out is on device 1"):
        runtime.gemv(w, x, out=torch.Tensor((2, 16), device=("cuda", 1)))
    with pytest.raises(InputError, match=r"out is a CPU \(numpy\) array"):
        runtime.gemv(w, x, out=np.zeros((2, 16), np.float32))
    with pytest.raises(InputError, match="positive multiple of 32"):
        runtime.quantize(torch.Tensor((2, 48)))
    with pytest.raises(InputError, match="M >= 1"):
        runtime.quantize(torch.Tensor((0, 64)))


def test_activations_from_another_matrix_are_refused():
    qx = runtime.Activations(m=2, k=128, device_id=0, torch=False, ptrs=(0, 0, 0), buffers=None)
    with pytest.raises(InputError, match=r"\(2, 128\).*K=64"):
        runtime.gemv(fake_weights(k=64), qx)
    with pytest.raises(InputError, match="device 0, weights on device 1"):
        runtime.gemv(fake_weights(k=128, device_id=1), qx)


def test_carved_activation_buffers_are_disjoint_and_aligned():
    for m, kb in ((1, 1), (3, 7), (31, 448)):
        q, d, s = (int(p) for p in runtime._carve(4096, m, kb))
        assert (q, d - q, s - d) == (4096, m * kb * 32, 4 * m * kb)
        assert d % 16 == 0 and s % 4 == 0
        assert s + 4 * m * kb - q == runtime._activation_bytes(m, kb)


# --- the hot path, on a stand-in CuPy: what is resolved, allocated and launched per call --------------------

class FakeDeviceArray:
    """A CuPy array's metadata, the only part of it the runtime reads on the hot path."""

    def __init__(self, shape: tuple[int, ...], ptr: int, dtype=np.float32, device_id: int = 0) -> None:
        self.shape, self.ndim, self.dtype, self._c_contiguous = tuple(shape), len(shape), np.dtype(dtype), True
        self.size = int(np.prod(shape))
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device_id)


class FakeStream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@dataclass
class FakeGpu:
    """Device 0 as a stand-in CuPy shows it: the current stream, which streams capture, every allocation and every
    launch (kernel name, stream, argument values read from the prepared argument buffer)."""

    current: FakeStream
    capturing: set[int]
    allocations: list[str]
    launches: list[tuple[str, int, dict[str, int]]]
    events: list[tuple[str, int, int]]


@pytest.fixture
def gpu(monkeypatch):
    addresses = iter(range(0x10_0000, 0x1000_0000, 0x1000))
    functions: dict[int, str] = {}
    fake = FakeGpu(FakeStream(0x9000), set(), [], [], [])

    def kernel(device: int, codebook: str | None, name: str):
        ptr = 0xF000 + len(functions)
        functions[ptr] = name
        return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=ptr))

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, argv, extra):
        name = functions[function]
        slots = launch._quantize_slots() if name == "quantize_activations" else launch.gemv_slots()
        pointers = (ctypes.c_void_p * len(slots.names)).from_address(argv)
        width = {launch.POINTER: ctypes.c_uint64, "i": ctypes.c_int32}
        fake.launches.append((name, stream, {n: width[c].from_address(p).value
                                             for n, c, p in zip(slots.names, slots.codes, pointers, strict=True)}))

    def empty_activations(m: int, k: int):
        fake.allocations.append(f"activations {m}x{k}")
        return types.SimpleNamespace(**{part: FakeDeviceArray((m, k // 32), next(addresses)) for part in
                                        ("q", "d", "sum")})

    def new_workspace(nbytes: int, n: int):
        fake.allocations.append(f"workspace {nbytes} N={n}")
        return FakeDeviceArray((nbytes // 4,), next(addresses))

    def empty(shape, dtype):
        fake.allocations.append(f"output {shape}")
        return FakeDeviceArray(shape, next(addresses))

    handles = iter(range(0x5000, 0x6000, 0x10))
    cuda = types.SimpleNamespace(
        get_current_stream=lambda device_id=-1: fake.current,
        Stream=lambda **kw: FakeStream(next(handles)), Event=lambda **kw: FakeStream(next(handles)),
        ExternalStream=lambda ptr, device_id: FakeStream(ptr), Device=FakeStream,
        driver=types.SimpleNamespace(launchKernel=launch_kernel),
        runtime=types.SimpleNamespace(
            getDevice=lambda: 0, streamIsCapturing=lambda s: s in fake.capturing,
            getDeviceProperties=lambda d: {"name": GPU.name.encode(), "multiProcessorCount": GPU.sm_count},
            eventRecord=lambda e, s: fake.events.append(("record", e, s)),
            streamWaitEvent=lambda s, e, flags=0: fake.events.append(("wait", s, e))))
    monkeypatch.setattr(launch, "cupy", types.SimpleNamespace(ndarray=FakeDeviceArray, float32=np.float32,
                                                              empty=empty, cuda=cuda))
    monkeypatch.setattr(launch, "_kernel", kernel)
    monkeypatch.setattr(launch, "empty_activations", empty_activations)
    monkeypatch.setattr(launch, "new_workspace", new_workspace)
    monkeypatch.setattr(launch._BRIDGES, "by_device", {})
    monkeypatch.setattr(runtime, "_STATE", runtime._Runtime())
    launch.quantize_launch.cache_clear()
    yield fake
    launch.quantize_launch.cache_clear()


def serve(table: FakeTable) -> FakeTable:
    runtime._STATE.dispatcher = runtime.Dispatcher(loader(table))
    return table


def device_weights(n: int, k: int) -> runtime.Weights:
    kb = k // 32
    planes = launch.DeviceWeights("Q4_0", n, k, FakeDeviceArray((kb, n, 4), 0xA000), FakeDeviceArray((kb, n), 0xB000),
                                  None, None)
    return runtime.Weights("Q4_0", "q4_0", n, k, 0, planes)


def test_gemv_resolves_once_per_m_and_mode_then_only_patches_and_launches(gpu, monkeypatch):
    table = serve(FakeTable(Answer("wide.s1.t128.c1", 1, "fallback")))
    plans = []
    monkeypatch.setattr(launch, "plan", lambda *a, _plan=launch.plan: plans.append(a) or _plan(*a))
    w = device_weights(256, 512)
    x, out = FakeDeviceArray((2, 512), 0x7000), FakeDeviceArray((2, 256), 0x8000)
    qx = runtime.quantize(x)
    for _ in range(3):
        assert runtime.gemv(w, qx, out=out) is out
    assert table.calls == 1 and len(plans) == 1 and list(w._launches) == [(2, "eager")]
    quantized, *gemvs = gpu.launches
    assert quantized[:2] == ("quantize_activations", 0x9000)
    assert quantized[2] | {"x": 0x7000, "M": 2, "KB": 16} == quantized[2]
    assert (quantized[2]["q"], quantized[2]["d"], quantized[2]["sums"]) == qx.ptrs
    for name, stream, args in gemvs:  # on the caller's stream, the prepared planes and scalars, this call's pointers
        assert name.startswith("gemv_partial<") and stream == 0x9000
        assert args == {"payload": 0xA000, "high": 0, "scale": 0xB000, "minv": 0, "sub": 0, "qa": qx.ptrs[0],
                        "da": qx.ptrs[1], "sa": qx.ptrs[2], "M": 2, "N": 256, "KB": 16, "width": 16, "out": 0x8000,
                        "ws": 0}
    assert gpu.allocations == ["activations 2x512"] and gpu.events == []  # nothing allocated per gemv
    gpu.capturing.add(0x9000)  # a graph capture asks the table for mode "graph": a key of its own
    runtime.gemv(w, qx, out=out)
    assert table.calls == 2 and list(w._launches) == [(2, "eager"), (2, "graph")]


def test_quantize_reuses_buffers_once_the_result_is_dropped(gpu):
    x = FakeDeviceArray((3, 256), 0x7000)
    a = runtime.quantize(x)
    b = runtime.quantize(x)
    assert a.ptrs != b.ptrs  # a is alive: its buffers are not reused
    first = a.ptrs
    del a
    c = runtime.quantize(x)
    assert c.ptrs == first and gpu.allocations == ["activations 3x256"] * 2
    gpu.current = FakeStream(0x9100)  # another stream: its own buffers (their reuse is ordered by that stream)
    runtime.quantize(x)
    runtime.quantize(FakeDeviceArray((4, 256), 0x7100))  # another M
    assert gpu.allocations == ["activations 3x256"] * 3 + ["activations 4x256"]


def test_quantize_while_capturing_takes_the_callers_allocator_and_pools_nothing(gpu):
    gpu.capturing.add(0x9000)
    x = FakeDeviceArray((2, 256), 0x7000)
    a = runtime.quantize(x)
    first = a.ptrs
    del a  # a graph may still read it: the caller keeps it alive, as with CuPy's pool; never back into a pool
    b = runtime.quantize(x)
    assert b._pool is None and b.ptrs != first and gpu.allocations == ["activations 2x256"] * 2
    assert not any(runtime._STATE.pools.free.values())


def test_gemv_on_unquantized_x_quantizes_into_reused_scratch(gpu):
    serve(FakeTable(Answer("wide.s1.t128.c1", 1, "fallback")))
    w = device_weights(256, 512)
    x, out = FakeDeviceArray((2, 512), 0x7000), FakeDeviceArray((2, 256), 0x8000)
    runtime.gemv(w, x, out=out)
    runtime.gemv(w, x, out=out)
    assert gpu.allocations == ["activations 2x512"]  # the scratch went back after the first call's launches
    names = [(name, stream) for name, stream, _ in gpu.launches]
    assert names == [("quantize_activations", 0x9000), (gpu.launches[1][0], 0x9000)] * 2
    q, g = gpu.launches[0][2], gpu.launches[1][2]
    assert (q["x"], q["q"], q["d"], q["sums"]) == (0x7000, g["qa"], g["da"], g["sa"])
    y = runtime.gemv(w, x)  # no out: a new result from the caller's allocator
    assert isinstance(y, FakeDeviceArray) and gpu.allocations[-1] == "output (2, 256)"


def test_kpar_workspaces_are_kept_per_stream_and_n(gpu):
    serve(FakeTable(Answer("kpar.s8.t128.c1", 8, "overlay")))
    w = device_weights(1024, 4096)
    qx, out = runtime.quantize(FakeDeviceArray((4, 4096), 0x7000)), FakeDeviceArray((4, 1024), 0x8000)
    runtime.gemv(w, qx, out=out)
    runtime.gemv(w, qx, out=out)
    workspaces = [a for a in gpu.allocations if a.startswith("workspace")]
    assert len(workspaces) == 1
    ws = {args["ws"] for name, _, args in gpu.launches if name != "quantize_activations"}
    assert len(ws) == 1 and 0 not in ws


def test_a_default_stream_caller_is_served_on_the_bridge(gpu):
    serve(FakeTable(Answer("wide.s1.t128.c1", 1, "fallback")))
    gpu.current = FakeStream(0)
    w = device_weights(256, 512)
    runtime.gemv(w, FakeDeviceArray((1, 512), 0x7000), out=FakeDeviceArray((1, 256), 0x8000))
    bridge = launch._BRIDGES.by_device[0]
    assert {stream for _, stream, _ in gpu.launches} == {bridge.stream.ptr}  # never stream 0 itself
    assert gpu.events == [("record", bridge.entered.ptr, 0), ("wait", bridge.stream.ptr, bridge.entered.ptr),
                          ("record", bridge.done.ptr, bridge.stream.ptr), ("wait", 0, bridge.done.ptr)]
