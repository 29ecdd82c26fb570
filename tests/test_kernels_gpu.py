"""GPU kernels against the CPU emulator, byte for byte (docs/contract.md §1, §3, §7). Marker `gpu`."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from bitcheck import assert_same_bits, bits
from gemv_dispatch.kernels import emulate, layout
from gemv_dispatch.kernels.codebooks import CODEBOOKS, SUPERBLOCK, get, quantize
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import CANDIDATES, candidates_for
from seeds import fresh_seed

pytestmark = pytest.mark.gpu

M_SET = (*range(1, 17), 31)
POISON = np.uint32(0x7FBADBAD)  # a NaN pattern no kernel writes
# K of the first shape: 129 blocks for the legacy formats (odd partition widths), 17 super-blocks (136 blocks,
# partitions that cut Q4_K/Q5_K pairs and Q6_K quads) for the super-block ones.
ODD_K = {cb: 4352 if cb in SUPERBLOCK else 4128 for cb in CODEBOOKS}


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="module")
def stream(cp):
    return cp.cuda.Stream(non_blocking=True)


def make_weights(codebook: str, n: int, k: int, rng: np.random.Generator) -> layout.PackedWeights:
    w = rng.standard_normal((n, k), dtype=np.float32) * rng.uniform(0.01, 2.0, size=(n, 1)).astype(np.float32)
    return layout.pack(codebook, quantize(codebook, w), n, k)


def adversarial_activations(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((m, k), dtype=np.float32)
    blocks = x.reshape(m, k // 32, 32)
    blocks[:, 0] = 0.0  # all-zero block
    blocks[:, 1] *= np.float32(1e-40)  # subnormal block
    blocks[:, 2, ::2] = -0.0
    if k >= 160:
        blocks[:, 3] *= np.float32(1e37)  # near the fp32 maximum
        blocks[:, 4, 7] = np.float32(3e4)  # one huge outlier
    return x


def run(cp, stream, cand, weights, x_np, *, qact=None):
    from gemv_dispatch.kernels import launch

    m = x_np.shape[0]
    with stream:  # uploads and poison on the launch stream: a copy on stream 0 would not be ordered with it
        x = cp.asarray(x_np)
        out = cp.asarray(np.full((m, weights.n), POISON, dtype=np.uint32)).view(cp.float32)
        need = cand.workspace_bytes(m, weights.n, weights.k)
        ws = launch.new_workspace(need, weights.n) if need else None
    qact = qact or launch.quantize_activations(x, stream)
    launch.gemv(cand, weights, qact, out, stream, workspace=ws)
    stream.synchronize()
    return cp.asnumpy(out)


def test_activation_kernel_matches_emulator(cp, stream):
    from gemv_dispatch.kernels import launch

    rng = np.random.default_rng(fresh_seed())
    x = adversarial_activations(7, 4128, rng)
    with stream:
        x_dev = cp.asarray(x)
    q = launch.quantize_activations(x_dev, stream)
    stream.synchronize()
    ref = emulate.quantize_activations(x)
    assert np.array_equal(cp.asnumpy(q.q), ref.q)
    assert np.array_equal(bits(cp.asnumpy(q.d)), bits(ref.d))
    assert np.array_equal(cp.asnumpy(q.sum), ref.sum)


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("n,k,m_set", [(1000, None, M_SET), (4096, 14336, (1, 5, 16, 31))])
def test_candidates_equal_emulator_and_serial_m1(cp, stream, codebook, n, k, m_set):
    """Every candidate: bytes == emulator; grouped M == M serial M=1 launches; repeat identical;
    permuted rows permute outputs; every element written. The staged twins (M = 1 only): bytes == emulator."""
    from gemv_dispatch.kernels import launch

    k = k or ODD_K[codebook]
    assert k % get(codebook).weights == 0
    rng = np.random.default_rng(fresh_seed())
    packed = make_weights(codebook, n, k, rng)
    weights = launch.to_device(packed)
    m_max = max(m_set)
    x = adversarial_activations(m_max, k, rng)
    qa = emulate.quantize_activations(x)
    emulated = cache(lambda s: emulate.gemv_quantized(packed, qa, s))  # one emulation per split S

    def serial_m1(cand, rows: int) -> np.ndarray:
        """x's first `rows` rows, each by its own M = 1 launch of `cand`."""
        return np.stack([run(cp, stream, cand, weights, x[r : r + 1])[0] for r in range(rows)])

    cands = candidates_for(m_max, n, k)
    assert {c.family for c in cands} == {"wide", "direct", "kpar"}
    for cand in cands:
        serial = serial_m1(cand, m_max)
        assert_same_bits(serial, emulated(cand.ksplit), f"{codebook} {cand.id} serial M=1 vs emulator")
        for m in m_set:
            if cand.valid(m, n, k):
                grouped = run(cp, stream, cand, weights, x[:m])
                assert_same_bits(grouped, serial[:m], f"{cand.id} M={m} grouped vs serial")
        again = run(cp, stream, cand, weights, x)
        assert_same_bits(again, serial, f"{cand.id} repeated launch")
        perm = rng.permutation(m_max)
        assert_same_bits(run(cp, stream, cand, weights, x[perm]), serial[perm], f"{cand.id} row permutation")
        assert not (bits(again) == POISON).any()
    # The staged twins run M = 1 only, so candidates_for(m_max) above never holds them; a few rows, a launch each.
    for cand in (c for c in candidates_for(1, n, k) if c.staged):
        assert_same_bits(serial_m1(cand, 4), emulated(cand.ksplit)[:4], f"{codebook} {cand.id} M=1 vs emulator")


def test_negative_control_identities_differ(cp, stream):
    """Two different identities on random data must give different bytes: the checks above can fail."""
    rng = np.random.default_rng(fresh_seed())
    n, k = 1000, 4128
    packed = make_weights("Q4_0", n, k, rng)
    from gemv_dispatch.kernels import launch

    weights = launch.to_device(packed)
    x = rng.standard_normal((4, k), dtype=np.float32)
    wide = next(c for c in CANDIDATES if c.family == "wide" and c.valid(4, n, k))
    kpar = next(c for c in CANDIDATES if c.family == "kpar" and c.ksplit == 8 and c.valid(4, n, k))
    assert not np.array_equal(bits(run(cp, stream, wide, weights, x)), bits(run(cp, stream, kpar, weights, x)))


def test_bad_launches_are_refused(cp, stream):
    from gemv_dispatch.kernels import launch

    rng = np.random.default_rng(fresh_seed())
    weights = launch.to_device(make_weights("Q8_0", 64, 256, rng))
    x = cp.asarray(rng.standard_normal((2, 256), dtype=np.float32))
    with pytest.raises(InputError, match="stream 0"):
        launch.quantize_activations(x, cp.cuda.Stream.null)
    bad = x.copy()
    bad[1, 3] = cp.inf
    cp.cuda.Stream.null.synchronize()  # `bad` was written on stream 0
    with pytest.raises(InputError, match="non-finite"):
        launch.quantize_activations(bad, stream, strict=True)
    launch.quantize_activations(bad, stream)  # the check is opt-in: no host synchronization by default
    qact = launch.quantize_activations(x, stream)
    kpar = next(c for c in CANDIDATES if c.family == "kpar" and c.valid(2, 64, 256))
    out = cp.empty((2, 64), cp.float32)
    with pytest.raises(InputError, match="workspace"):
        launch.gemv(kpar, weights, qact, out, stream)
    with pytest.raises(InputError, match="shape"):
        launch.gemv(CANDIDATES[0], weights, qact, cp.empty((3, 64), cp.float32), stream)
    # Row-major activations (the emulator's, copied over) would be read block-major: refused, not misread.
    host = emulate.quantize_activations(cp.asnumpy(x))
    row_major = emulate.QuantizedActivations(cp.asarray(host.q), cp.asarray(host.d), cp.asarray(host.sum))
    with pytest.raises(InputError, match="block-major"):
        launch.gemv(CANDIDATES[0], weights, row_major, out, stream)
    with pytest.raises(InputError, match="empty_activations"):
        launch.quantize_activations(x, stream, out=row_major)
    # bind: one matrix in every copy, and at least one copy.
    other = launch.to_device(make_weights("Q8_0", 64, 512, rng))
    with pytest.raises(InputError, match="share one codebook and shape"):
        launch.bind(CANDIDATES[0], [weights, other], qact, out, stream)
    with pytest.raises(InputError, match="at least one"):
        launch.bind(CANDIDATES[0], [], qact, out, stream)
    # The mma engine needs whole 8-output tiles.
    narrow = launch.to_device(make_weights("Q8_0", 60, 256, rng))
    mma = next(c for c in CANDIDATES if c.engine == "mma" and c.family == "wide")
    with pytest.raises(InputError, match="mma tile"):
        launch.gemv(mma, narrow, qact, cp.empty((2, 60), cp.float32), stream)


@pytest.mark.parametrize("codebook", ["Q4_0", "Q6_K"])
def test_kpar_candidates_share_one_workspace_and_leave_its_tickets_zero(cp, stream, codebook):
    """One-launch kpar on the device: every kpar candidate (both engines, every split) takes turns on one
    workspace, back to back on one stream, twice over; each equals the emulator and the tickets end zero."""
    from gemv_dispatch.kernels import launch
    from gemv_dispatch.kernels.registry import ticket_words

    rng = np.random.default_rng(fresh_seed())
    n, k, m = 1000, ODD_K[codebook], 16
    packed = make_weights(codebook, n, k, rng)
    weights = launch.to_device(packed)
    x = adversarial_activations(m, k, rng)
    qa = emulate.quantize_activations(x)
    kpar = [c for c in candidates_for(m, n, k) if c.grid_split]
    assert {c.engine for c in kpar} == {"dp4a", "mma"} and len({c.ksplit for c in kpar}) >= 3
    with stream:
        ws = launch.new_workspace(max(c.workspace_bytes(m, n, k) for c in kpar), n)
        qact = launch.quantize_activations(cp.asarray(x), stream)
        outs = {c.id: cp.full((m, n), POISON, dtype=cp.uint32).view(cp.float32) for c in kpar}
    for _ in range(2):
        for cand in kpar:
            launch.gemv(cand, weights, qact, outs[cand.id], stream, workspace=ws)
    stream.synchronize()
    assert not cp.asnumpy(ws[: ticket_words(n)].view(cp.uint32)).any(), "tickets left non-zero"
    for cand in kpar:
        assert_same_bits(cp.asnumpy(outs[cand.id]), emulate.gemv_quantized(packed, qa, cand.ksplit), cand.id)
