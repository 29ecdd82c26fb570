"""Runtime checks that need no GPU (docs/policy.md §9, §10): dispatch through a table or the safe default with one
warning, and every input mistake refused from host metadata alone, before anything reaches a device."""

from __future__ import annotations

import sys
import types
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pytest
from gemv_dispatch.dispatch.serve import runtime
from gemv_dispatch.kernels import launch, layout
from gemv_dispatch.kernels.codebooks import quantize
from gemv_dispatch.kernels.errors import EnvironmentProblem, InputError
from gemv_dispatch.kernels.registry import by_id

GPU = "NVIDIA Test GPU"


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
    def load(gpu_name: str):
        if table is None:
            return None, f"no dispatch table is installed for {gpu_name}"
        return (table, None) if table.gpu_level else (None, "certified on the emulator only")
    return load


# --- dispatch --------------------------------------------------------------------------------------------

def test_no_table_warns_once_and_serves_the_safe_default():
    d = runtime.Dispatcher(loader(None))
    with pytest.warns(RuntimeWarning, match=r"no dispatch table is installed for NVIDIA Test GPU.*wide\.s1\.t128\.c1"):
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


def test_emulator_only_table_is_not_served():
    d = runtime.Dispatcher(loader(FakeTable(Answer("kpar.s8.t128.c1", 8, "overlay"), gpu_level=False)))
    with pytest.warns(RuntimeWarning, match="emulator only"):
        c = d.choose(GPU, "q8_0", 4, 1024, 4096, "graph")
    assert c.candidate.id == runtime.SAFE_DEFAULT


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


def test_installed_table_without_install_stage_or_table(monkeypatch):
    fake = types.ModuleType(runtime._INSTALL_MODULE)
    fake.installed_table = lambda gpu_name: None
    monkeypatch.setitem(sys.modules, runtime._INSTALL_MODULE, fake)
    import gemv_dispatch.dispatch.serve as package  # runtime imports install from its own package

    monkeypatch.setattr(package, "install", fake, raising=False)
    table, why = runtime.installed_table(GPU)
    assert table is None and GPU in why
    fake.installed_table = lambda gpu_name: FakeTable(Answer("wide.s1.t128.c1", 1, "fallback"), gpu_level=False)
    table, why = runtime.installed_table(GPU)
    assert table is None and "emulator only" in why
    good = FakeTable(Answer("wide.s1.t128.c1", 1, "fallback"))
    fake.installed_table = lambda gpu_name: good
    assert runtime.installed_table(GPU) == (good, None)
    monkeypatch.setitem(sys.modules, runtime._INSTALL_MODULE, None)  # import now fails: module absent
    monkeypatch.delattr(package, "install", raising=False)
    table, why = runtime.installed_table(GPU)
    assert table is None and "no install stage" in why


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
