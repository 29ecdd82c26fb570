"""The kernel source (kernels/cuda/gemv.cu) on the CPU: every candidate of every codebook, both engines, the
legacy formats and the super-block ones, byte for byte against the emulator (docs/contract.md §1-3).

tests/hostsim runs the kernels' own code with one fiber per CUDA thread, so CI without a GPU checks the
decode, index and accumulation code; the GPU tests (tests/test_kernels_gpu.py) check the same on the device.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import hostsim
import numpy as np
import pytest
from bitcheck import assert_same_bits, bits
from gemv_dispatch.kernels import emulate, launch, layout, registry
from gemv_dispatch.kernels.codebooks import CODEBOOKS, SUPERBLOCK
from gemv_dispatch.kernels.errors import BLOCK
from gemv_dispatch.kernels.layout import pack
from gemv_dispatch.kernels.registry import CANDIDATES, Candidate
from seeds import fresh_seed
from test_emulate import ADVERSARIAL, weights

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CI"),
                                reason="g++ is not on PATH (CI requires it)")

# KB = 40 blocks (five super-blocks): the effective splits are S = 2, 4 and 8, whose partitions of 20, 10 and 5
# blocks cut Q4_K/Q5_K pairs (5) and Q6_K quads (10, 5) at their edges. N = 72: a partial CTA in every family
# and a warp with one mma tile of four.
N, K = 72, 1280
M_SET = (1, 2, 5, 8, 16, 31)
POISON = np.uint32(0x7FBADBAD)  # a NaN pattern no kernel writes
KINDS = [(c, "gaussian") for c in CODEBOOKS] + [(c, "bytes") for c in CODEBOOKS] + [
    (c, kind) for c in SUPERBLOCK for kind in ("special", "corrupt")]


def valid(m: int) -> list:
    return [c for c in CANDIDATES if c.valid(m, N, K)]


@pytest.fixture(scope="module")
def sim() -> hostsim.Simulator:
    names = {c.kernel_name(cb, m) for cb in CODEBOOKS for m in M_SET for c in valid(m)}
    return hostsim.build(tuple(sorted(names)))


def activations(m: int, rng: np.random.Generator) -> np.ndarray:
    """Gaussian rows at mixed scales, with the emulator tests' adversarial blocks (zeros of both signs,
    subnormals, ties) spread over rows and blocks; those near the fp32 maximum, which overflow every output of
    their row, only in the last row of 31."""
    x = (rng.standard_normal((m, K)) * 2.0 ** rng.integers(-20, 20, size=(m, 1))).astype(np.float32)
    blocks = x.reshape(m, K // BLOCK, BLOCK)
    for i, block in enumerate(ADVERSARIAL.values()):
        huge = np.abs(block).max() > 1e30
        if not huge or m == max(M_SET):
            blocks[m - 1 if huge else i % (m - 1 or 1), (7 * i) % (K // BLOCK)] = block
    return x


def emulated(packed, x: np.ndarray) -> dict[int, np.ndarray]:
    """The emulator's y for x [rows, K] at every identity a candidate of the matrix's (N, K) has. An output row
    depends only on its x row (test_emulate), so the first M rows are the answer for M."""
    full = emulate.quantize_activations(np.ascontiguousarray(x))
    splits = {c.split(packed.k) for c in CANDIDATES if c.valid(1, packed.n, packed.k)}
    return {s: emulate.gemv_quantized(packed, full, s) for s in splits}


def test_candidates_cover_every_family_and_engine():
    assert {(c.family, c.engine) for c in valid(31)} == {
        ("wide", "dp4a"), ("direct", "dp4a"), ("kpar", "dp4a"), ("wide", "mma"), ("kpar", "mma")}
    assert {c.split(K) for c in valid(31)} == {1, 2, 4, 8}


@pytest.mark.parametrize(("codebook", "kind"), KINDS)
def test_staged_kernels_equal_the_emulator(sim, codebook, kind):
    """Every valid candidate at every M: the emulator's bytes (so grouped M equals serial M = 1), every element
    written; kpar through its fold launch."""
    value = fresh_seed()
    rng = np.random.default_rng(value)
    packed = pack(codebook, weights(codebook, N, K // BLOCK, value, kind), N, K)
    x = activations(max(M_SET), rng)
    with np.errstate(all="ignore"):
        expected = emulated(packed, x)
        for m in M_SET:
            qa = emulate.quantize_activations(x[:m])
            for cand in valid(m):
                got = sim.gemv(cand, packed, qa, POISON)
                assert_same_bits(got, expected[cand.split(K)][:m], f"{codebook} ({kind}) {cand.id} M={m}")
                assert not (bits(got) == POISON).any()
    if kind in ("gaussian", "bytes"):  # the comparisons were of numbers, not only of infinities and NaNs
        assert np.isfinite(expected[1][:-1]).mean() > 0.9


def test_kpar_candidates_share_one_workspace(sim):
    """The one-launch kpar leaves its tickets zero, ahead of the partials: candidates of every split and CTA
    width can take turns on one workspace (as the sweep's interleaved rounds do), twice over."""
    value = fresh_seed()
    packed = pack("Q4_0", weights("Q4_0", N, K // BLOCK, value, "gaussian"), N, K)
    x = activations(16, np.random.default_rng(value))
    qa, expected = emulate.quantize_activations(x), emulated(packed, x)
    kpar = [c for c in valid(16) if c.grid_split]
    assert len({c.split(K) for c in kpar}) >= 3 and {c.engine for c in kpar} == {"dp4a", "mma"}
    ws = launch.new_workspace(max(c.workspace_bytes(16, N, K) for c in kpar), N, np)
    for _ in range(2):
        for cand in kpar:
            assert_same_bits(sim.gemv(cand, packed, qa, POISON, ws), expected[cand.split(K)], cand.id)


def test_staged_launches_need_their_shared_memory_and_no_more(sim, monkeypatch):
    """gemv_staged's CTAs stage their activation blocks behind the partials in exactly Candidate.shared_bytes: with
    it they give the emulator's bytes; with one staged block (40 bytes) less than the blocks alone take (no ring) the
    CTA writes past its shared memory (the simulator's guard), for a direct and a kpar twin."""
    value = fresh_seed()
    packed = pack("Q4_0", weights("Q4_0", N, K // BLOCK, value, "gaussian"), N, K)
    qa = emulate.quantize_activations(activations(1, np.random.default_rng(value)))
    twins = [next(c for c in valid(1) if c.staged and c.family == f and c.split(K) == 4) for f in ("direct", "kpar")]
    for cand in twins:
        assert_same_bits(sim.gemv(cand, packed, qa, POISON), emulate.gemv_quantized(packed, qa, 4), cand.id)
    exact = Candidate.shared_bytes
    monkeypatch.setattr(Candidate, "shared_bytes", lambda c, m, k, codebook=None: exact(c, m, k) - 40)  # no ring
    for cand in twins:
        with pytest.raises(RuntimeError, match="wrote past"):
            sim.gemv(cand, packed, qa, POISON)


@pytest.mark.parametrize("codebook", [cb for cb in CODEBOOKS if registry.pipe_slot_bytes(cb, 1)])
@pytest.mark.parametrize("cand_id", ["kpar.s2.t128.c1.st", "kpar.s2.t64.c2.st"])
def test_staged_rings_need_their_shared_memory_and_no_more(sim, monkeypatch, codebook, cand_id):
    """The staged walks copy their batches through a ring of PIPE_SLOTS slots per thread behind the staged blocks
    (registry.pipe_slot_bytes; here on walks of any length): with Candidate.shared_bytes a launch gives the emulator's
    bytes; with 4 bytes less, a CTA whose threads all walk (N = 128) writes past its shared memory."""
    monkeypatch.setattr(registry, "RING_MIN_BLOCKS", 0)
    n, value = 128, fresh_seed()
    packed = pack(codebook, weights(codebook, n, K // BLOCK, value, "gaussian"), n, K)
    qa = emulate.quantize_activations(activations(1, np.random.default_rng(value)))
    cand = next(c for c in valid(1) if c.id == cand_id)
    exact = Candidate.shared_bytes
    assert exact(cand, 1, K, codebook) > exact(cand, 1, K)  # the ring fits
    with np.errstate(all="ignore"):
        expected = emulate.gemv_quantized(packed, qa, 2)
    assert_same_bits(sim.gemv(cand, packed, qa, POISON), expected, f"{codebook} {cand_id}")
    monkeypatch.setattr(Candidate, "shared_bytes", lambda c, m, k, cb=None: exact(c, m, k, cb) - (4 if cb else 0))
    with pytest.raises(RuntimeError, match="wrote past"):
        sim.gemv(cand, packed, qa, POISON)


def check_candidates(sim, codebook: str, n: int, k: int, x: np.ndarray, ms: tuple[int, ...], value: int,
                     chosen=lambda cand: True) -> dict[int, list]:
    """Gaussian weights of (N, K) from seed `value`; every valid `chosen` candidate at each M of `ms` gives the
    emulator's bytes for x[:M]. Returns the candidates run, by M."""
    packed = pack(codebook, weights(codebook, n, k // BLOCK, value, "gaussian"), n, k)
    ran = {}
    with np.errstate(all="ignore"):
        expected = emulated(packed, x)
        for m in ms:
            qa = emulate.quantize_activations(x[:m])
            ran[m] = [c for c in CANDIDATES if c.valid(m, n, k) and chosen(c)]
            for cand in ran[m]:
                got = sim.gemv(cand, packed, qa, POISON)
                assert_same_bits(got, expected[cand.split(k)][:m], f"{codebook} {cand.id} N={n} K={k} M={m}")
    return ran


@pytest.mark.parametrize("codebook", [c for c in CODEBOOKS if c not in SUPERBLOCK])
def test_legacy_formats_on_an_odd_block_count(sim, codebook):
    """KB = 33 (legacy formats only; super-blocks need KB % 8 == 0): odd partition widths, ring chunks cut short,
    N = 40 (one partial tile group per CTA)."""
    n, k = 40, 33 * BLOCK
    value = fresh_seed()
    x = np.ascontiguousarray(activations(max(M_SET), np.random.default_rng(value))[:, :k])
    check_candidates(sim, codebook, n, k, x, (1, 5, 16, 31), value)


@pytest.mark.parametrize("codebook", ["Q4_0", "Q6_K"])
@pytest.mark.parametrize("n", [37, 70])
def test_kpar_folds_one_column_at_a_time_where_4_does_not_divide_n(sim, codebook, n):
    """The last CTA folds 4 columns per load only where 4 | N: N = 37 takes the one-column fold, N = 70 the
    two-column fold where it gives every thread a pair, else the one-column fold (the dp4a kpar candidates of 1 and 2
    outputs per thread, M = 1 and 5), the last CTA column range cut short."""
    assert n % 4
    value = fresh_seed()
    x = activations(max(M_SET), np.random.default_rng(value))
    ran = check_candidates(sim, codebook, n, K, x, (1, 5), value, lambda c: c.grid_split)
    assert all({c.cpt for c in kpar} == ({1} if n % 2 else {1, 2}) for kpar in ran.values())


@pytest.mark.parametrize("codebook", ["Q4_0", "Q8_0", "Q4_K"])
def test_up_to_64_partitions(sim, codebook):
    """K = 2048: every candidate; kpar and direct split into S = 2 ... 64, more partitions than one round of the
    fold's loads takes (at most FOLD_AHEAD_MAX = 8 ahead), direct's narrow CTAs of 8 and 16 columns up to 64
    partitions (the tests above reach 8); M = 31: several tiles too."""
    k = 2048
    value = fresh_seed()
    x = np.random.default_rng(value).standard_normal((31, k)).astype(np.float32)
    for run in check_candidates(sim, codebook, N, k, x, (1, 16, 31), value).values():
        assert {c.split(k) for c in run if c.family == "kpar"} >= {16, 32, 64}
        assert {c.split(k) for c in run if c.family == "direct"} >= {16, 32, 64}


def test_activation_kernel_equals_the_emulator(sim):
    rng = np.random.default_rng(fresh_seed())
    x = activations(5, rng)
    m, kb = x.shape[0], K // BLOCK
    q = np.zeros((kb, m, BLOCK), np.int8)
    d, s = np.full((kb, m), np.nan, np.float32), np.zeros((kb, m), np.int32)
    ints = [np.array([v], dtype=np.int32) for v in (m, kb)]
    sim.launch("quantize_activations", (-(-m * kb * BLOCK // 256), 1), (256, 1), 0,
               [hostsim.pointer(a) for a in (x, *ints, q, d, s)])
    ref = emulate.quantize_activations(x)
    assert np.array_equal(q.transpose(1, 0, 2), ref.q)
    assert_same_bits(d.T, ref.d)
    assert np.array_equal(s.T, ref.sum)


@pytest.mark.parametrize("codebook", SUPERBLOCK)
def test_wrong_scales_or_identities_are_detected(sim, codebook):
    """Negative controls: the comparison above can fail. A kernel fed other sub-block scales (the super-blocks
    in another order), or a candidate of another identity, differs from the emulator on random data."""
    value = fresh_seed()
    packed = pack(codebook, weights(codebook, N, K // BLOCK, value, "gaussian"), N, K)
    qa = emulate.quantize_activations(activations(5, np.random.default_rng(value)))
    wide, kpar = (next(c for c in valid(5) if c.family == f and c.split(K) == s) for f, s in (("wide", 1), ("kpar", 8)))
    want = emulate.gemv_quantized(packed, qa, 1)
    assert_same_bits(sim.gemv(wide, packed, qa, POISON), want)
    shuffled = dataclasses.replace(packed, sub=np.ascontiguousarray(packed.sub[[1, 0, 2, 3, 4]]))
    with pytest.raises(AssertionError, match="differ"):
        assert_same_bits(sim.gemv(wide, shuffled, qa, POISON), want)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_bits(sim.gemv(kpar, packed, qa, POISON), want)


# A Q4_K_M-like model: Q4_K for most tensors, Q6_K for some attn_v (one geometry, two types), ffn_down and the
# output head. (codebook, N, K) per tensor.
MIXED = {
    "blk.0.attn_q.weight": ("Q4_K", 72, 512),
    "blk.0.attn_v.weight": ("Q6_K", 16, 512),
    "blk.1.attn_v.weight": ("Q4_K", 16, 512),
    "blk.0.ffn_down.weight": ("Q6_K", 72, 1280),
    "output.weight": ("Q6_K", 136, 512),
}


def test_a_mixed_q4_k_q6_k_gguf_runs_through_the_kernels(sim, tmp_path):
    """A GGUF file written with the gguf package -> `shapes from-gguf` (a mixed-type inventory) -> the tensor
    bytes read back exactly -> every candidate equals the emulator (on the GPU through the installed table:
    tests/test_installed.py)."""
    import gguf
    from gemv_dispatch.dispatch.measure.shapes import from_gguf
    from gemv_dispatch.dispatch.serve import runtime
    from gemv_dispatch.kernels.codebooks import quantize

    rng = np.random.default_rng(fresh_seed())
    path = tmp_path / "q4_k_m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    written = {}
    for name, (codebook, n, k) in MIXED.items():
        written[name] = quantize(codebook, rng.standard_normal((n, k), dtype=np.float32) * np.float32(0.05))
        writer.add_tensor(name, written[name], raw_dtype=gguf.GGMLQuantizationType[codebook])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    inventory = {(s.role, s.n, s.k): s.codebooks for s in from_gguf(path).shapes}
    assert inventory == {("q", 72, 512): ("Q4_K",), ("v", 16, 512): ("Q4_K", "Q6_K"), ("down", 72, 1280): ("Q6_K",),
                         ("lm_head", 136, 512): ("Q6_K",)}
    x = activations(max(M_SET), rng)
    for name, (codebook, n, k) in MIXED.items():
        packed = runtime.read_gguf_tensor(path, name)
        assert (packed.codebook, packed.n, packed.k) == (codebook, n, k)
        assert np.array_equal(layout.unpack(packed), written[name]), name
        xk = np.ascontiguousarray(x[:, :k])
        expected = emulated(packed, xk)
        for m in (1, 16):
            qa = emulate.quantize_activations(xk[:m])
            for cand in (c for c in CANDIDATES if c.valid(m, n, k)):
                got = sim.gemv(cand, packed, qa, POISON)
                assert_same_bits(got, expected[cand.split(k)][:m], f"{name} {cand.id} M={m}")
