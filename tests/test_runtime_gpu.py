"""The runtime on a GPU (docs/policy.md §9), byte for byte against the emulator. Marker `gpu`.

Ordering tests delay the stream that writes x with a spinning kernel (~0.1 s), so a GEMV that does not wait
for it reads the poisoned x deterministically; each has a negative control that skips the ordering and must
see the poison. Seeds are printed (shown by pytest on failure); outputs are poisoned before every launch.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import pytest
from bitcheck import assert_same_bits, bits
from gemv_dispatch.dispatch.serve import runtime
from gemv_dispatch.kernels import emulate, launch, layout
from gemv_dispatch.kernels.codebooks import quantize
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import candidates_for
from seeds import fresh_seed

pytestmark = pytest.mark.gpu

POISON = np.uint32(0x7FBADBAD)  # a NaN pattern no kernel writes
SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""
SPIN_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: far longer than any launch below


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture
def rng():
    return np.random.default_rng(fresh_seed())


def spin(cp, stream) -> None:
    """Keep `stream` busy for ~0.1 s: work enqueued after this on it runs late."""
    cp.RawKernel(SPIN, "spin")((1,), (1,), (np.int64(SPIN_CYCLES),), stream=stream)


def make_packed(codebook: str, n: int, k: int, rng: np.random.Generator) -> layout.PackedWeights:
    w = rng.standard_normal((n, k), dtype=np.float32) * rng.uniform(0.01, 2.0, size=(n, 1)).astype(np.float32)
    return layout.pack(codebook, quantize(codebook, w), n, k)


def poisoned(cp, m: int, n: int):
    out = cp.asarray(np.full((m, n), POISON, dtype=np.uint32)).view(cp.float32)
    cp.cuda.Stream.null.synchronize()
    return out


def expected(packed: layout.PackedWeights, w: runtime.Weights, x: np.ndarray, mode: str = "eager") -> np.ndarray:
    """The emulator's bytes for the identity the runtime dispatches for this M."""
    return emulate.gemv(packed, x, runtime.choice_for(w, x.shape[0], mode).candidate.ksplit)


class FamilyTable:
    """A stand-in installed table that picks the first valid candidate of one family and engine, so the
    runtime's kpar (workspace), direct and mma paths run without a real table."""

    gpu_level = True

    def __init__(self, family: str, engine: str = "dp4a") -> None:
        self.family, self.engine = family, engine

    def select(self, codebook, m, n, k, mode):
        cands = [c for c in candidates_for(m, n, k) if c.family == self.family and c.engine == self.engine]
        c = cands[len(cands) // 2] if cands else candidates_for(m, n, k)[0]
        return _Answer(c.id, c.identity(k), "fallback")


class _Answer(NamedTuple):  # the generated module's Choice
    candidate: str
    identity: int
    source: str


TABLES = {"default": None, "kpar": FamilyTable("kpar"), "direct": FamilyTable("direct"),
          "wide-mma": FamilyTable("wide", "mma"), "kpar-mma": FamilyTable("kpar", "mma")}


@pytest.fixture(params=[*sorted(TABLES), "shipped"])
def table(request, monkeypatch):
    """Route the runtime's dispatch through one stand-in table, none (the safe default), or what serves a GPU with
    no installed table (a shipped table)."""
    fake = TABLES.get(request.param)

    def load(gpu: runtime.GpuModel) -> runtime.Serving:
        return runtime.Serving(fake, None if fake else "no table (test)")

    if request.param == "shipped":
        monkeypatch.setattr(runtime.install, "installed_table", lambda gpu_name: None)
        load = runtime.serving_table
    monkeypatch.setattr(runtime._STATE, "dispatcher", runtime.Dispatcher(load))
    return request.param


# --- bytes ----------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:gemv-dispatch")
@pytest.mark.parametrize("codebook,n,k", [("Q4_0", 1001, 4096), ("Q8_0", 1024, 2080), ("IQ4_NL", 4096, 512),
                                           ("Q4_1", 520, 1024), ("Q5_1", 96, 8192), ("Q5_K", 1000, 4096),
                                           ("Q6_K", 264, 2304)])
def test_gemv_equals_emulator_and_serial_m1(cp, rng, table, codebook, n, k):
    packed = make_packed(codebook, n, k, rng)
    w = runtime.prepare(packed)
    x = rng.standard_normal((31, k), dtype=np.float32)
    serial = np.concatenate([cp.asnumpy(runtime.gemv(w, cp.asarray(x[r : r + 1]))) for r in range(31)])
    assert_same_bits(serial[:1], expected(packed, w, x[:1]), f"{table} {codebook} M=1 vs emulator")
    for m in (1, 2, 5, 16, 31):
        xd = cp.asarray(x[:m])
        out = poisoned(cp, m, n)
        got = runtime.gemv(w, xd, out=out)
        assert got is out
        cp.cuda.Stream.null.synchronize()
        want = expected(packed, w, x[:m])
        assert_same_bits(cp.asnumpy(out), want, f"{table} {codebook} M={m} vs emulator "
                         f"({runtime.choice_for(w, m).candidate.id})")
        if runtime.choice_for(w, m).identity == runtime.choice_for(w, 1).identity:
            assert_same_bits(cp.asnumpy(out), serial[:m], f"{table} {codebook} M={m} vs serial M=1")
        qx = runtime.quantize(xd)  # shared activations give the same bytes as quantizing inside gemv
        assert_same_bits(cp.asnumpy(runtime.gemv(w, qx)), want, f"{table} {codebook} M={m} via quantize()")


def test_pooled_activations_are_never_shared_by_live_results(cp, rng):
    """quantize reuses a buffer only once the Activations holding it is dropped: two live results keep their own
    bytes, and a reused buffer holds the new x's."""
    xs = [rng.standard_normal((4, 1024), dtype=np.float32) for _ in range(3)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = runtime.quantize(cp.asarray(xs[0]))
        b = runtime.quantize(cp.asarray(xs[1]))
        assert a.ptrs != b.ptrs
        first = a.ptrs
        del a
        c = runtime.quantize(cp.asarray(xs[2]))
        assert c.ptrs == first, "a dropped result's buffers were not reused"
        stream.synchronize()
    for qx, x in ((b, xs[1]), (c, xs[2])):
        assert np.array_equal(cp.asnumpy(qx.buffers.q), emulate.quantize_activations(x).q)


@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_reused_scratch_gives_each_call_its_own_bytes(cp, rng):
    """gemv(w, x) quantizes into a pooled buffer it returns once its launches are enqueued: calls issued back to
    back on one stream (no host wait between them) each see their own x."""
    n, k, m = 1000, 2048, 3
    packed = make_packed("Q8_0", n, k, rng)
    w = runtime.prepare(packed)
    xs = [rng.standard_normal((m, k), dtype=np.float32) for _ in range(4)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        spin(cp, stream)  # everything below is enqueued before any of it runs
        ys = [runtime.gemv(w, cp.asarray(x)) for x in xs]
    stream.synchronize()
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        assert_same_bits(cp.asnumpy(y), expected(packed, w, x), f"call {i}")


@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_threads_launch_one_matrix_concurrently(cp, rng):
    """Each thread patches its own copy of a prepared launch's arguments: threads sharing one matrix (and so one
    prepared launch per M) on their own streams all get their own results."""
    n, k, m = 512, 4096, 2
    packed = make_packed("Q4_0", n, k, rng)
    w = runtime.prepare(packed)
    xs = [rng.standard_normal((m, k), dtype=np.float32) for _ in range(8)]
    results: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            x = cp.asarray(xs[i])
            for _ in range(50):
                y = runtime.gemv(w, x)
            results[i] = cp.asnumpy(y)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(len(xs)))
    for i, x in enumerate(xs):
        assert_same_bits(results[i], expected(packed, w, x), f"thread {i}")


def test_quantize_equals_emulator(cp, rng):
    x = rng.standard_normal((7, 4128), dtype=np.float32)
    x.reshape(7, -1, 32)[:, 0] = 0.0
    x.reshape(7, -1, 32)[:, 1] *= np.float32(1e-40)
    qx = runtime.quantize(cp.asarray(x))
    cp.cuda.Stream.null.synchronize()
    ref = emulate.quantize_activations(x)
    assert np.array_equal(cp.asnumpy(qx.buffers.q), ref.q)
    assert np.array_equal(bits(cp.asnumpy(qx.buffers.d)), bits(ref.d))
    assert np.array_equal(cp.asnumpy(qx.buffers.sum), ref.sum)


# --- streams --------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_x_filled_on_one_stream_gemv_from_another(cp, rng):
    n, k, m = 1000, 4096, 4
    packed = make_packed("Q4_0", n, k, rng)
    w = runtime.prepare(packed)
    x_np = rng.standard_normal((m, k), dtype=np.float32)
    want = expected(packed, w, x_np)
    writer, reader = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)

    def run(ordered: bool) -> np.ndarray:
        x = cp.full((m, k), np.nan, dtype=cp.float32)
        out = poisoned(cp, m, n)
        spin(cp, writer)
        x.set(x_np, stream=writer)  # lands after the spin
        filled = writer.record()
        with reader:
            if ordered:
                reader.wait_event(filled)  # the caller orders its streams; gemv orders with `reader`
            runtime.gemv(w, x, out=out)
        cp.cuda.Device().synchronize()
        return cp.asnumpy(out)

    assert_same_bits(run(ordered=True), want, "gemv on a stream ordered after the writer")
    # Negative control: with no ordering the GEMV reads the NaN x before the writer fills it.
    assert not np.array_equal(bits(run(ordered=False)), bits(want)), "the spin did not delay the writer"


@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_null_stream_caller_is_ordered_both_ways(cp, rng):
    """The defect of issue 10: x filled on stream 0 and quantized at once. The runtime bridges stream 0 to its
    internal stream before the launches, and stream 0 to the launches after them."""
    n, k, m = 512, 2048, 3
    packed = make_packed("Q8_0", n, k, rng)
    w = runtime.prepare(packed)
    x_np = rng.standard_normal((m, k), dtype=np.float32)
    want = expected(packed, w, x_np)
    null = cp.cuda.Stream.null
    x = cp.full((m, k), np.nan, dtype=cp.float32)
    null.synchronize()
    spin(cp, null)
    x.set(x_np, stream=null)
    y = runtime.gemv(w, x)  # current stream: stream 0
    after = y.copy()  # stream 0 work after gemv: must see the finished result
    cp.cuda.Device().synchronize()
    assert_same_bits(cp.asnumpy(after), want, "stream-0 caller, result read back on stream 0")
    # Negative control, the old behaviour: quantize on an unrelated stream without ordering reads stale x.
    x2 = cp.full((m, k), np.nan, dtype=cp.float32)
    null.synchronize()
    spin(cp, null)
    x2.set(x_np, stream=null)
    other = cp.cuda.Stream(non_blocking=True)
    stale = launch.quantize_activations(x2, other)
    other.synchronize()
    assert np.isnan(cp.asnumpy(stale.d)).any() or not np.array_equal(
        cp.asnumpy(stale.q), emulate.quantize_activations(x_np).q), "the unordered quantize was not stale"
    cp.cuda.Device().synchronize()


def test_quantize_does_not_synchronize_the_host(cp, rng):
    """quantize() returns while its stream is still busy: no host synchronization on the hot path."""
    stream = cp.cuda.Stream(non_blocking=True)
    x = cp.asarray(rng.standard_normal((2, 1024), dtype=np.float32))
    cp.cuda.Stream.null.synchronize()
    with stream:
        spin(cp, stream)
        runtime.quantize(x)
        assert not stream.done, "quantize waited for the stream"
        with pytest.raises(InputError, match="non-finite"):
            bad = x.copy()
            bad[1, 5] = cp.nan
            runtime.quantize(bad, strict=True)  # strict synchronizes, after the spin
    stream.synchronize()


# --- graphs ---------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_graph_capture_of_quantize_and_gemv_replays_correctly(cp, rng, table):
    k = 4096
    shapes = {"q": 4096, "k": 1024, "v": 1000}  # q, k, v of one layer share the activations
    packed = {name: make_packed("Q4_0", n, k, rng) for name, n in shapes.items()}
    ws = {name: runtime.prepare(p) for name, p in packed.items()}
    m = 5
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.empty((m, k), cp.float32)
        outs = {name: cp.empty((m, n), cp.float32) for name, n in shapes.items()}
        x.set(rng.standard_normal((m, k), dtype=np.float32), stream=stream)
        qx = runtime.quantize(x)  # warm-up outside the capture (compilation, module loading)
        for name in shapes:
            runtime.gemv(ws[name], qx, out=outs[name])
        stream.synchronize()
        stream.begin_capture()
        try:
            qx = runtime.quantize(x)
            for name in shapes:
                runtime.gemv(ws[name], qx, out=outs[name])
            y_raw = runtime.gemv(ws["v"], x)  # unquantized x inside a capture: runtime-kept scratch
        finally:
            graph = stream.end_capture()
    for w in ws.values():
        assert (m, "graph") in w._launches, "a capture must dispatch in graph mode"
    for replay in range(3):
        x_np = rng.standard_normal((m, k), dtype=np.float32)
        x.set(x_np, stream=stream)
        for name, n in shapes.items():
            outs[name].set(np.full((m, n), POISON, dtype=np.uint32).view(np.float32), stream=stream)
        graph.launch(stream)
        stream.synchronize()
        for name in shapes:
            assert_same_bits(cp.asnumpy(outs[name]), expected(packed[name], ws[name], x_np, "graph"),
                             f"{table} replay {replay} {name}")
        assert_same_bits(cp.asnumpy(y_raw), expected(packed["v"], ws["v"], x_np, "graph"), f"replay {replay} raw x")


def test_strict_refused_while_capturing(cp, rng):
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.asarray(rng.standard_normal((2, 256), dtype=np.float32))
        stream.synchronize()
        stream.begin_capture()
        try:
            with pytest.raises(InputError, match="capturing"):
                runtime.quantize(x, strict=True)
        finally:
            stream.end_capture()


# --- torch ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_torch_in_and_out_without_copies(cp, torch, rng, table):
    n, k, m = 1000, 4096, 6
    packed = make_packed("IQ4_NL", n, k, rng)
    w = runtime.prepare(packed)
    x_np = rng.standard_normal((m, k), dtype=np.float32)
    want = expected(packed, w, x_np)
    x = torch.full((m, k), float("nan"), device="cuda")
    src = torch.from_numpy(x_np).cuda()
    out = torch.from_numpy(np.full((m, n), POISON, dtype=np.uint32).view(np.float32)).cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # torch's current (default) stream runs late ...
    x.copy_(src)  # ... and only then fills x (a device copy: the host does not wait)
    got = runtime.gemv(w, x, out=out)
    assert got is out and got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert_same_bits(out.cpu().numpy(), want, f"{table} torch in/out")
    y = runtime.gemv(w, runtime.quantize(x))  # torch in, new torch out
    assert isinstance(y, torch.Tensor) and y.is_cuda and y.dtype == torch.float32 and tuple(y.shape) == (m, n)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # torch's current stream is followed, not CuPy's
        side.wait_stream(torch.cuda.default_stream())
        torch.cuda._sleep(SPIN_CYCLES)
        x2 = x * 1.0
        y2 = runtime.gemv(w, x2)
    torch.cuda.synchronize()
    assert_same_bits(y.cpu().numpy(), want, "torch quantize + gemv")
    assert_same_bits(y2.cpu().numpy(), want, "torch side stream")


@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_torch_graph_capture(cp, torch, rng):
    n, k, m = 1024, 2048, 3
    packed = make_packed("Q8_0", n, k, rng)
    w = runtime.prepare(packed)
    x = torch.zeros((m, k), device="cuda")
    out = torch.empty((m, n), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runtime.gemv(w, runtime.quantize(x), out=out)  # warm-up, as torch graphs require
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        runtime.gemv(w, runtime.quantize(x), out=out)
    for _ in range(2):
        x_np = rng.standard_normal((m, k), dtype=np.float32)
        x.copy_(torch.from_numpy(x_np))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(out.cpu().numpy(), expected(packed, w, x_np, "graph"), "torch graph replay")


# --- bad input ------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:gemv-dispatch")
def test_bad_arrays_are_refused(cp, rng):
    w = runtime.prepare(make_packed("Q4_0", 64, 256, rng))
    x = cp.asarray(rng.standard_normal((2, 256), dtype=np.float32))
    cases = [
        (x.astype(cp.float64), "float32"),
        (x.astype(cp.float16), "float32"),
        (cp.asarray(rng.standard_normal((2, 512), dtype=np.float32)), "K=256"),
        (cp.asarray(rng.standard_normal((256, 4), dtype=np.float32)).T, "C-contiguous"),
        (x[None], "2-D"),
        (cp.asnumpy(x), r"CPU \(numpy\)"),
    ]
    for bad, why in cases:
        with pytest.raises(InputError, match=why):
            runtime.gemv(w, bad)
    with pytest.raises(InputError, match=r"out has shape \(2, 65\)"):
        runtime.gemv(w, x, out=cp.empty((2, 65), cp.float32))
    with pytest.raises(InputError, match="out must be float32"):
        runtime.gemv(w, x, out=cp.empty((2, 64), cp.float64))
    with pytest.raises(InputError, match="non-finite"):
        bad = x.copy()
        bad[0, 0] = cp.inf
        runtime.gemv(w, bad, strict=True)
    assert runtime.gemv(w, x, strict=True).shape == (2, 64)  # negative control: finite x passes strict
    if cp.cuda.runtime.getDeviceCount() > 1:
        with cp.cuda.Device(1):
            x1 = cp.asarray(cp.asnumpy(x))
        with pytest.raises(InputError, match="device 1, weights on device 0"):
            runtime.gemv(w, x1)
