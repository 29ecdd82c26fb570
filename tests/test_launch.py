"""kernels.launch on the CPU: what it hands the kernels, with numpy standing in for CuPy where the code is array-API
generic (the GPU tests run it on the device)."""

import ctypes
import itertools
import struct
import threading
import types

import numpy as np
import pytest
from gemv_dispatch.kernels import launch, program, registry
from gemv_dispatch.kernels.codebooks import CODEBOOKS
from gemv_dispatch.kernels.layout import plane_shapes


@pytest.mark.parametrize(("codebook", "k", "present"), [("Q5_0", 32, ("payload", "high", "scale")),
                                                      ("Q4_K", 256, ("payload", "scale", "min", "sub"))])
def test_launches_pass_the_planes_in_declared_order(codebook, k, present):
    """DeviceWeights.plane_args follows the source's declaration (the super-block formats' sub-block scale plane
    fifth), null for a plane the codebook lacks."""
    assert program.planes() == ("payload", "high", "scale", "minv", "sub")
    planes = {f: np.zeros(2, np.uint32) if f in present else None for f in ("payload", "high", "scale", "min", "sub")}
    args = launch.DeviceWeights(codebook, 8, k, **planes).plane_args()
    assert [a is planes[f] if f in present else a == 0 for f, a in zip(
        ("payload", "high", "scale", "min", "sub"), args, strict=True)] == [True] * 5


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_random_device_weights_have_the_planes_pack_makes(codebook, monkeypatch):
    """kernels.launch.random_weights, run with numpy standing in for CuPy (the same array API): every plane of
    the format, in pack's shapes and dtypes, fp16 scales finite in [1e-3, 1e-2)."""
    monkeypatch.setattr(launch, "cupy", types.SimpleNamespace(float16=np.float16, float32=np.float32,
                                                              uint16=np.uint16, uint64=np.uint64))
    assert launch.require_cupy() is launch.cupy
    n, k = 24, 512
    w = launch.random_weights(codebook, n, k, np.random.default_rng(7))
    want = plane_shapes(codebook, n, k)
    got = {"payload": w.payload, "scale": w.scale, "min": w.min, "high": w.high, "sub": w.sub}
    assert {name for name, a in got.items() if a is not None} == set(want)
    for name, (shape, dtype) in want.items():
        assert got[name].shape == shape, name
        assert got[name].dtype == (np.uint16 if dtype == np.float16 else dtype), name  # fp16 as its bits
    scales = w.scale.view(np.float16).astype(np.float32)
    assert np.isfinite(scales).all() and (scales >= 9.99e-4).all() and (scales < 1.0001e-2).all()


def test_staged_kernels_opt_in_to_the_rings_shared_memory_and_no_other_does():
    """opt_in raises a staged kernel's dynamic shared memory cap to RING_SHARED_LIMIT (Candidate.shared_bytes gives a
    staged walk's ring more than the default SHARED_MEMORY_LIMIT where it fits) and leaves every other kernel's."""
    class Kernel:
        max_dynamic_shared_size_bytes = registry.SHARED_MEMORY_LIMIT

    staged, mma = Kernel(), Kernel()
    assert launch.opt_in("gemv_staged<6, 1, true>", staged) is staged
    assert staged.max_dynamic_shared_size_bytes == registry.RING_SHARED_LIMIT
    launch.opt_in("gemv_mma<6, 2, 1, false, 128, false>", mma)
    assert mma.max_dynamic_shared_size_bytes == registry.SHARED_MEMORY_LIMIT


# --- prepared launches: the argument buffer cuLaunchKernel reads -------------------------------------------

class Driver:
    """Stands in for cupy.cuda.driver.launchKernel: records each launch with the argument values it would read,
    each through its pointer in the parameter array at the width of its declared type."""

    def __init__(self, slots: launch.ArgSlots) -> None:
        self.slots, self.launches = slots, []

    def __call__(self, function, gx, gy, gz, bx, by, bz, shared, stream, argv, extra):
        pointers = (ctypes.c_void_p * len(self.slots.names)).from_address(argv)
        width = {launch.POINTER: ctypes.c_uint64, "i": ctypes.c_int32}
        values = {name: width[code].from_address(ptr).value
                  for name, code, ptr in zip(self.slots.names, self.slots.codes, pointers, strict=True)}
        self.launches.append(((function, (gx, gy, gz), (bx, by, bz), shared, stream, extra), values))


GEMV_SOURCE = program.source()


def test_gemv_argument_slots_follow_the_kernel_signature():
    """One slot per declared parameter of the GEMV kernels (GEMV_PARAMS in gemv.cu), as wide as its type (8-byte
    pointers, 4-byte ints), aligned, disjoint, inside the buffer; the per-call ones first and adjacent."""
    params = program.declared_params(GEMV_SOURCE)
    slots = launch.gemv_slots()
    assert slots.names == tuple(name for _, name in params)
    assert program.declared_signature(GEMV_SOURCE) == (
        "(const u32*, const u32*, const u16*, const u16*, const unsigned char*, const int*, const float*, const int*, "
        "int, int, int, int, float*, float*)")
    widths = {launch.POINTER: 8, "i": 4}
    spans = sorted((off, off + widths[code]) for off, code in zip(slots.offsets, slots.codes, strict=True))
    for (kind, _), code, off in zip(params, slots.codes, slots.offsets, strict=True):
        assert code == (launch.POINTER if kind.endswith("*") else "i") and off % widths[code] == 0
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) and spans[-1][1] <= slots.size
    per_call = [slots.offsets[slots.names.index(n)] for n in launch.GEMV_PER_CALL]
    assert per_call == [8 * i for i in range(len(per_call))] and slots.per_call.size == 8 * len(per_call)
    # The scalars the plans fill are the ints the kernels declare, in order; the rest are planes and per-call.
    assert tuple(n for (kind, n) in params if kind == "int") == launch.GEMV_SCALARS
    assert set(slots.fixed) == {*program.planes(), *launch.GEMV_SCALARS}


def test_quantize_argument_slots_follow_the_kernel_signature():
    params = program.declared_params(GEMV_SOURCE, "quantize_activations")
    assert [kind for kind, _ in params] == ["const float*", "int", "int", "signed char*", "float*", "int*"]
    slots = launch.ArgSlots.of(params, launch.QUANTIZE_PER_CALL)
    assert slots.codes == (launch.POINTER, "i", "i", launch.POINTER, launch.POINTER, launch.POINTER)
    assert [slots.offsets[slots.names.index(n)] for n in launch.QUANTIZE_PER_CALL] == [0, 8, 16, 24]


def test_a_prepared_launch_patches_only_the_per_call_arguments():
    slots = launch.gemv_slots()
    driver = Driver(slots)
    fixed = {"payload": 0x1000, "high": 0, "scale": 0x2000, "minv": 0x3000, "sub": 0, "M": 5, "N": 4096, "KB": 128,
             "width": 64}
    prepared = launch.PreparedLaunch(0xF00, (32, 2, 1), (128, 1, 1), 4096, slots, fixed, launch_kernel=driver)
    before = prepared.argument_bytes()
    prepared.launch(7, (0xA0, 0xB0, 0xC0, 0xD0, 0xE0))
    prepared.launch(9, (0xA1, 0xB1, 0xC1, 0xD1, 0))
    first, second = driver.launches
    assert first[0] == (0xF00, (32, 2, 1), (128, 1, 1), 4096, 7, 0)
    assert first[1] == {**fixed, "qa": 0xA0, "da": 0xB0, "sa": 0xC0, "out": 0xD0, "ws": 0xE0}
    assert second[0][4] == 9 and second[1] == {**fixed, "qa": 0xA1, "da": 0xB1, "sa": 0xC1, "out": 0xD1, "ws": 0}
    after = prepared.argument_bytes()
    run = slots.per_call.size
    assert before[run:] == after[run:] and before[:run] != after[:run]  # the fixed arguments stay as packed
    assert prepared.head == (0xF00, 32, 2, 1, 128, 1, 1, 4096)


def test_the_argument_reader_sees_a_wrong_value_negative_control():
    """The Driver above reads the buffer through the parameter array: a slot overwritten behind the launch's back
    shows in what it reads, so the checks above can fail."""
    slots = launch.gemv_slots()
    driver = Driver(slots)
    fixed = dict.fromkeys(slots.fixed, 1)
    prepared = launch.PreparedLaunch(1, (1, 1, 1), (32, 1, 1), 0, slots, fixed, launch_kernel=driver)
    struct.pack_into("<i", prepared._buffers()[0], slots.offsets[slots.names.index("N")], 77)
    prepared.launch(3, (0, 0, 0, 0, 0))
    assert driver.launches[0][1]["N"] == 77


def test_argument_slots_refuse_what_the_kernel_does_not_take():
    params = program.declared_params(GEMV_SOURCE)
    with pytest.raises(ValueError, match="no kernel parameter named bias"):
        launch.ArgSlots.of(params, ("qa", "bias"))
    with pytest.raises(ValueError, match="need padding"):
        launch.ArgSlots.of(params, ("M", "qa"))  # an int before a pointer: the run would not pack as laid out
    with pytest.raises(ValueError, match="no launch encoding"):
        launch.ArgSlots.of([("float", "alpha")], ())
    with pytest.raises(ValueError, match="no value for kernel parameter N"):
        fixed = dict.fromkeys(set(launch.gemv_slots().fixed) - {"N"}, 0)
        launch.PreparedLaunch(1, (1, 1, 1), (1, 1, 1), 0, launch.gemv_slots(), fixed, launch_kernel=print)


class FakeArray:
    def __init__(self, ptr: int) -> None:
        self.data = types.SimpleNamespace(ptr=ptr)


def test_a_plan_prepares_its_planes_and_scalars_and_bind_fixes_the_rest():
    cand = registry.by_id("kpar.s8.t128.c1")
    planes = (FakeArray(0x100), np.uint64(0), FakeArray(0x300), FakeArray(0x400), np.uint64(0))
    plan = launch.Plan(cand, 3, types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF1)), (8, 8, 1),
                       (128, 1, 1), 0, planes, (3, 1024, 128, 16), 5000)
    driver = Driver(launch.gemv_slots())
    plan.prepare(launch_kernel=driver).launch(11, (1, 2, 3, 4, 5))
    assert driver.launches[0][1] == {"payload": 0x100, "high": 0, "scale": 0x300, "minv": 0x400, "sub": 0, "M": 3,
                                     "N": 1024, "KB": 128, "width": 16, "qa": 1, "da": 2, "sa": 3, "out": 4, "ws": 5}
    bound = {"qa": 21, "da": 22, "sa": 23, "out": 24, "ws": 0}
    fixed_driver = Driver(launch.gemv_slots(()))
    plan.prepare(bound, launch_kernel=fixed_driver).launch(12)  # a timing loop's launch: nothing left per call
    assert fixed_driver.launches[0][0][4] == 12 and fixed_driver.launches[0][1]["qa"] == 21
    assert launch.address(None) == 0 and launch.address(FakeArray(9)) == 9 and launch.address(np.uint64(4)) == 4


# --- streams: raw handles, default streams bridged by events -----------------------------------------------

@pytest.fixture
def fake_streams(monkeypatch):
    """A stand-in CuPy with the stream and event calls the bridge makes, recorded in order."""
    calls = []
    handles = iter(range(0x5000, 0x6000, 0x10))

    class Handle:
        def __init__(self, *args, **kwargs) -> None:
            self.ptr = next(handles)

    runtime_api = types.SimpleNamespace(
        getDevice=lambda: 0,
        eventRecord=lambda event, stream: calls.append(("record", event, stream)),
        streamWaitEvent=lambda stream, event, flags=0: calls.append(("wait", stream, event)))
    monkeypatch.setattr(launch, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=runtime_api, Stream=Handle, Event=Handle)))
    monkeypatch.setattr(launch._BRIDGES, "by_device", {})
    return calls


def test_an_explicit_stream_is_launched_on_as_is(fake_streams):
    assert launch.launch_stream(0x7777) == 0x7777
    launch.rejoin(0x7777, 0x7777)
    assert fake_streams == []


@pytest.mark.parametrize("default", launch.DEFAULT_STREAMS)
def test_a_default_stream_is_bridged_both_ways_by_events(fake_streams, default):
    on = launch.launch_stream(default)
    bridge = launch._BRIDGES.by_device[0]
    assert on == bridge.stream.ptr != default
    launch.rejoin(default, on)
    assert fake_streams == [("record", bridge.entered.ptr, default), ("wait", on, bridge.entered.ptr),
                            ("record", bridge.done.ptr, on), ("wait", default, bridge.done.ptr)]


def test_each_thread_launches_from_its_own_argument_buffer():
    """CuPy's launchKernel releases the GIL during cuLaunchKernel: a shared buffer could be patched by one thread
    while the driver reads it for another, so each thread patches its own copy of the packed arguments."""
    slots = launch.gemv_slots()
    driver = Driver(slots)
    fixed = dict.fromkeys(slots.fixed, 3)
    prepared = launch.PreparedLaunch(1, (1, 1, 1), (32, 1, 1), 0, slots, fixed, launch_kernel=driver)
    prepared.launch(5, (1, 1, 1, 1, 1))
    mine = prepared.argv
    theirs = []

    def other() -> None:
        prepared.launch(6, (2, 2, 2, 2, 2))
        theirs.append(prepared.argv)

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert theirs and theirs[0] != mine
    assert [values["qa"] for _, values in driver.launches] == [1, 2]
    assert driver.launches[1][1] == {**fixed, "qa": 2, "da": 2, "sa": 2, "out": 2, "ws": 2}
    assert prepared.argument_bytes()[: slots.per_call.size] == struct.pack("<5Q", 1, 1, 1, 1, 1)  # this thread's
