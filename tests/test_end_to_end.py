"""End to end with a real file: a GGUF model written here with the `gguf` package (Q4_0, Q8_0 and IQ4_NL
tensors, odd and even N, and a second layer in Q4_K and Q6_K, as a Q4_K_M model mixes them) -> `shapes
from-gguf` -> the tensor bytes read back -> prepare -> gemv through the runtime's dispatch (the installed table
where one is installed). On a CPU the emulator computes what the dispatched identity must give; on a GPU
(marker `gpu`) the runtime's bytes must equal it and equal serial M = 1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bitcheck import assert_same_bits
from gemv_dispatch.dispatch.measure.shapes import from_gguf
from gemv_dispatch.dispatch.serve import runtime
from gemv_dispatch.kernels import emulate, layout
from gemv_dispatch.kernels.codebooks import quantize
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import by_id
from seeds import fresh_seed

HIDDEN = 256
# name -> (codebook, N, K): odd and even N, each codebook of the issue
TENSORS = {
    "blk.0.attn_q.weight": ("Q4_0", 256, HIDDEN),
    "blk.0.attn_k.weight": ("Q8_0", 33, HIDDEN),
    "blk.0.attn_v.weight": ("IQ4_NL", 64, HIDDEN),
    "blk.0.ffn_down.weight": ("IQ4_NL", HIDDEN, 160),
    "output.weight": ("Q8_0", 1001, HIDDEN),
    "blk.1.attn_q.weight": ("Q4_K", 256, HIDDEN),
    "blk.1.attn_v.weight": ("Q6_K", 64, HIDDEN),
}
ROLES = {"blk.0.attn_q.weight": "q", "blk.0.attn_k.weight": "k", "blk.0.attn_v.weight": "v",
         "blk.0.ffn_down.weight": "down", "output.weight": "lm_head", "blk.1.attn_q.weight": "q",
         "blk.1.attn_v.weight": "v"}
M_SET = (1, 2, 3, 8, 16, 31)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray], int]:
    """The GGUF file, the block bytes written for each tensor, and the seed (printed)."""
    import gguf

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("e2e") / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("End To End")
    written = {}
    for name, (codebook, n, k) in TENSORS.items():
        w = rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05)
        written[name] = quantize(codebook, w)
        writer.add_tensor(name, written[name], raw_dtype=gguf.GGMLQuantizationType[codebook])
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, written, seed


def test_shapes_from_gguf_lists_every_projection(model):
    path, _, _ = model
    inv = from_gguf(path)
    got = {(s.role, s.n, s.k): s.codebooks for s in inv.shapes}
    assert set(got) == {(ROLES[name], n, k) for name, (_, n, k) in TENSORS.items()}
    assert (got[("q", 256, HIDDEN)], got[("v", 64, HIDDEN)]) == (("Q4_0", "Q4_K"), ("IQ4_NL", "Q6_K"))


def test_tensor_bytes_read_back_exactly(model):
    path, written, _ = model
    for name, (codebook, n, k) in TENSORS.items():
        packed = runtime.read_gguf_tensor(path, name)
        assert (packed.codebook, packed.n, packed.k) == (codebook, n, k)
        assert np.array_equal(layout.unpack(packed), written[name]), name


def test_read_gguf_tensor_refuses_bad_requests(model, tmp_path):
    path, _, _ = model
    with pytest.raises(InputError, match=r"no tensor named 'blk\.9\.attn_q\.weight'"):
        runtime.read_gguf_tensor(path, "blk.9.attn_q.weight")
    with pytest.raises(InputError, match="is F32; the kernels run"):
        runtime.read_gguf_tensor(path, "output_norm.weight")
    with pytest.raises(InputError, match="no such GGUF file"):
        runtime.read_gguf_tensor(tmp_path / "absent.gguf", "output.weight")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(InputError, match="not a readable GGUF file"):
        runtime.read_gguf_tensor(junk, "output.weight")


def activations(model, k: int) -> np.ndarray:
    _, _, seed = model
    return np.random.default_rng(seed + k).standard_normal((max(M_SET), k), dtype=np.float32)


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_dispatched_identity_on_the_emulator(model, name, monkeypatch):
    """CPU: what the runtime's dispatch (safe default without any table, or a split table) must compute for
    the file's tensor: grouped rows equal serial M=1 rows, and the result is within the contract's error
    bound of the float64 product."""
    path, written, _ = model
    codebook, n, k = TENSORS[name]
    packed = runtime.read_gguf_tensor(path, name)
    x = activations(model, k)
    monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: None)
    monkeypatch.setattr(runtime.install, "shipped_table", lambda gpu_name, sm_count: (None, []))
    without = runtime.Dispatcher()
    with pytest.warns(RuntimeWarning, match="safe default"):
        choice = without.choose(runtime.GpuModel("TestGPU", 100), packed.execution, 1, n, k, "eager")
    assert choice.candidate.valid(max(M_SET), n, k)
    for ksplit in (choice.candidate.ksplit, 4):  # the default, then a split identity
        y = emulate.gemv(packed, x, ksplit)
        serial = np.concatenate([emulate.gemv(packed, x[r : r + 1], ksplit) for r in range(len(x))])
        assert_same_bits(y, serial, f"{name} ksplit {ksplit}: grouped vs serial M=1")
        original = emulate.gemv(layout.pack(codebook, written[name], n, k), x, ksplit)
        assert_same_bits(y, original, f"{name}: bytes read from the file vs bytes written")
        assert np.all(np.abs(y - emulate.reference(packed, x)) <= emulate.error_bound(packed, x, ksplit))
    # Negative control: another identity gives other bytes for this data, so the comparisons can fail.
    if by_id("kpar.s4.t128.c1").identity(k) != 1:
        assert not np.array_equal(emulate.gemv(packed, x, 1).view(np.uint32),
                                  emulate.gemv(packed, x, 4).view(np.uint32))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:gemv-dispatch")
@pytest.mark.parametrize("name", sorted(TENSORS))
def test_gemv_from_gguf_equals_emulator_and_serial_m1(model, name):
    import cupy as cp

    path, _, _ = model
    codebook, n, k = TENSORS[name]
    packed = runtime.read_gguf_tensor(path, name)
    w = runtime.prepare_from_gguf(path, name)
    assert (w.codebook, w.n, w.k) == (codebook, n, k)
    x = activations(model, k)
    serial = np.concatenate([cp.asnumpy(runtime.gemv(w, cp.asarray(x[r : r + 1]))) for r in range(len(x))])
    for m in M_SET:
        choice = runtime.choice_for(w, m)
        y = cp.asnumpy(runtime.gemv(w, runtime.quantize(cp.asarray(x[:m]))))
        assert_same_bits(y, emulate.gemv(packed, x[:m], choice.candidate.ksplit),
                         f"{name} M={m} {choice.candidate.id} vs emulator")
        if choice.identity == runtime.choice_for(w, 1).identity:  # a certified table keeps one identity
            assert_same_bits(y, serial[:m], f"{name} M={m} vs serial M=1")
