"""Execution layout (docs/contract.md §2): packing GGUF block bytes into block-major planes is a lossless byte shuffle.

The GGUF block layouts are written out here by hand (not read from kernels.codebooks), so the tests check
the planes against the file format itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from gemv_dispatch.kernels.codebooks import CODEBOOKS, get, quantize
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.layout import PackedWeights, pack, plane_shapes, unpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# GGUF block layout per format: block bytes and byte offsets of d, m, qh, qs (None: field absent).
GGUF = {
    "Q4_0": dict(block=18, d=0, m=None, qh=None, qs=2),
    "Q4_1": dict(block=20, d=0, m=2, qh=None, qs=4),
    "Q5_0": dict(block=22, d=0, m=None, qh=2, qs=6),
    "Q5_1": dict(block=24, d=0, m=2, qh=4, qs=8),
    "Q8_0": dict(block=34, d=0, m=None, qh=None, qs=2),
    "IQ4_NL": dict(block=18, d=0, m=None, qh=None, qs=2),
}
ALL = tuple(GGUF)


def random_blocks(codebook: str, n: int, kb: int, seed: int) -> np.ndarray:
    """Arbitrary bytes: fp16 fields may be NaN / inf / subnormal, which a byte shuffle must not care about."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, kb * GGUF[codebook]["block"]), dtype=np.uint8)


def test_codebook_list_matches_gguf_layouts():
    assert set(CODEBOOKS) >= set(ALL)
    for name, lay in GGUF.items():
        assert get(name).block_bytes == lay["block"], name


@st.composite
def block_matrices(draw):
    codebook = draw(st.sampled_from(ALL))
    n = draw(st.integers(1, 40))
    kb = draw(st.integers(1, 8))
    size = n * kb * GGUF[codebook]["block"]
    if draw(st.booleans()):
        blocks = random_blocks(codebook, n, kb, draw(st.integers(0, 2**32 - 1)))
    else:  # hypothesis-chosen bytes: shrinkable, biased towards zeros and repeats
        raw = draw(st.binary(min_size=size, max_size=size))
        blocks = np.frombuffer(raw, dtype=np.uint8).reshape(n, -1).copy()
    return codebook, n, kb, blocks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_matrices())
def test_unpack_pack_is_identity(case):
    codebook, n, kb, blocks = case
    before = blocks.copy()
    packed = pack(codebook, blocks, n, kb * 32)
    out = unpack(packed)
    assert out.dtype == np.uint8
    assert out.shape == blocks.shape
    assert out.tobytes() == before.tobytes()
    assert blocks.tobytes() == before.tobytes()  # pack does not modify its input


@pytest.mark.parametrize("codebook", ALL)
def test_roundtrip_of_real_quantized_weights(codebook):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((33, 5 * 32)).astype(np.float32)
    blocks = quantize(codebook, w)
    assert unpack(pack(codebook, blocks, 33, 160)).tobytes() == blocks.tobytes()


@pytest.mark.parametrize("codebook", ALL)
def test_roundtrip_of_non_contiguous_input(codebook):
    bb = GGUF[codebook]["block"]
    wide = random_blocks(codebook, 12, 6, seed=3)
    view = wide[::2, bb:]  # rows 0,2,..,10; blocks 1..5: a strided, offset view
    assert not view.flags.c_contiguous
    assert unpack(pack(codebook, view, 6, 5 * 32)).tobytes() == np.ascontiguousarray(view).tobytes()


@pytest.mark.parametrize("codebook", ALL)
@pytest.mark.parametrize(("n", "kb"), [(1, 1), (1, 3), (5, 1), (7, 4), (32, 8)])
def test_plane_shapes_and_dtypes(codebook, n, kb):
    lay = GGUF[codebook]
    packed = pack(codebook, random_blocks(codebook, n, kb, seed=n * 100 + kb), n, kb * 32)
    assert isinstance(packed, PackedWeights)
    assert packed.codebook == codebook
    assert packed.execution == get(codebook).execution
    assert (packed.n, packed.k, packed.kb) == (n, kb * 32, kb)

    words = (lay["block"] - lay["qs"]) // 4
    assert packed.payload.dtype == np.uint32
    assert packed.payload.shape == (kb, n, words)
    assert packed.scale.dtype == np.float16
    assert packed.scale.shape == (kb, n)
    if lay["m"] is None:
        assert packed.min is None
    else:
        assert packed.min.dtype == np.float16
        assert packed.min.shape == (kb, n)
    if lay["qh"] is None:
        assert packed.high is None
    else:
        assert packed.high.dtype == np.uint32
        assert packed.high.shape == (kb, n)

    names = ["payload", "scale"] + ["min"] * (lay["m"] is not None) + ["high"] * (lay["qh"] is not None)
    planes = packed.planes()
    assert list(planes) == names
    for plane in planes.values():
        assert plane.flags.c_contiguous
    # Every byte of every block lands in exactly one plane.
    assert packed.nbytes == n * kb * lay["block"]


@pytest.mark.parametrize("codebook", ALL)
def test_planes_hold_the_gguf_fields_of_each_block(codebook):
    lay = GGUF[codebook]
    bb = lay["block"]
    n, kb = 9, 5
    blocks = random_blocks(codebook, n, kb, seed=11)
    packed = pack(codebook, blocks, n, kb * 32)
    payload_bytes = packed.payload.view(np.uint8)  # [KB, N, payload bytes] in memory order
    for row in range(n):
        for b in range(kb):
            block = blocks[row, b * bb : (b + 1) * bb]
            qs = block[lay["qs"] :]
            # The payload plane of block (n, b) is its GGUF qs bytes, nibble order kept...
            assert payload_bytes[b, row].tobytes() == qs.tobytes()
            # ...read as little-endian uint32 words.
            words = [int.from_bytes(qs[4 * i : 4 * i + 4].tobytes(), "little") for i in range(len(qs) // 4)]
            assert packed.payload[b, row].tolist() == words
            assert packed.scale[b, row].tobytes() == block[lay["d"] : lay["d"] + 2].tobytes()
            if lay["m"] is not None:
                assert packed.min[b, row].tobytes() == block[lay["m"] : lay["m"] + 2].tobytes()
            if lay["qh"] is not None:
                qh = block[lay["qh"] : lay["qh"] + 4].tobytes()
                assert int(packed.high[b, row]) == int.from_bytes(qh, "little")


def test_block_major_order_makes_consecutive_outputs_adjacent():
    """Payloads of outputs n and n+1 in one block are consecutive 16-byte runs (coalesced warp reads)."""
    n, kb = 4, 3
    blocks = random_blocks("Q4_0", n, kb, seed=5)
    flat = pack("Q4_0", blocks, n, kb * 32).payload.reshape(-1).view(np.uint8)
    for b in range(kb):
        for row in range(n):
            start = (b * n + row) * 16
            assert flat[start : start + 16].tobytes() == blocks[row, b * 18 + 2 : b * 18 + 18].tobytes()


def test_codebook_name_is_case_insensitive():
    blocks = random_blocks("Q5_1", 2, 2, seed=1)
    packed = pack("q5_1", blocks, 2, 64)
    assert packed.codebook == "Q5_1"
    assert unpack(packed).tobytes() == blocks.tobytes()


@pytest.mark.parametrize("codebook", ALL)
def test_pack_copies_its_input_for_every_shape(codebook):
    blocks = random_blocks(codebook, 1, 1, seed=2)
    expected = blocks.copy()
    packed = pack(codebook, blocks, 1, 32)
    blocks[:] ^= 0xFF  # the caller reuses its buffer
    assert unpack(packed).tobytes() == expected.tobytes()


# ---------------------------------------------------------------------------------------------------------
# Bad input: one InputError naming the problem.


def _good(codebook="Q4_0", n=3, kb=2):
    return random_blocks(codebook, n, kb, seed=0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("Q4_0", _good().astype(np.int8), 3, 64), r"uint8"),
        (("Q4_0", _good().astype(np.uint16), 3, 64), r"uint8"),
        (("Q4_0", _good().view(np.float16), 3, 64), r"uint8"),
        (("Q4_0", _good().tolist(), 3, 64), r"list"),
        (("Q4_0", _good().reshape(-1), 3, 64), r"2-D"),
        (("Q4_0", _good().reshape(3, 2, 18), 3, 64), r"2-D"),
        (("Q4_0", _good()[:, :-1], 3, 64), r"shape"),  # one byte short per row
        (("Q4_0", _good("Q4_1"), 3, 64), r"shape"),  # Q4_1 bytes offered as Q4_0
        (("Q4_0", _good(), 2, 64), r"shape"),  # N disagrees with the rows
        (("Q4_0", _good(), 3, 32), r"shape"),  # K disagrees with the bytes
        (("Q4_0", _good(), 3, 48), r"multiple of 32"),
        (("Q4_0", _good(), 3, 0), r"positive"),
        (("Q4_0", _good(), 0, 64), r"positive"),
        (("Q4_0", _good(), -1, 64), r"positive"),
        (("Q4_0", np.zeros((0, 36), np.uint8), 0, 64), r"positive"),
        (("Q3_K", _good(), 3, 64), r"unknown codebook"),
        (("", _good(), 3, 64), r"unknown codebook"),
        ((None, _good(), 3, 64), r"codebook"),
    ],
)
def test_bad_input_raises_input_error(args, match):
    with pytest.raises(InputError, match=match) as info:
        pack(*args)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# Super-block formats: codes (qs, qh) split into one run per 32-block, [KB][N][...]; scale fields compact,
# one row per super-block, [KB/8][N][...]. Layouts from llama.cpp's ggml-common.h: (offset, bytes) per field.

SUPER = {
    "Q4_K": dict(block=144, d=(0, 2), m=(2, 2), sc=(4, 12), qh=None, qs=(16, 128)),
    "Q5_K": dict(block=176, d=(0, 2), m=(2, 2), sc=(4, 12), qh=(16, 32), qs=(48, 128)),
    "Q6_K": dict(block=210, d=(208, 2), m=None, sc=(192, 16), qh=(128, 64), qs=(0, 128)),
    "IQ4_XS": dict(block=136, d=(0, 2), m=None, sc=(2, 6), qh=None, qs=(8, 128)),
}


def super_bytes(codebook: str, n: int, sb: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, sb * SUPER[codebook]["block"]), dtype=np.uint8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codebook=st.sampled_from(sorted(SUPER)), n=st.integers(1, 24), sb=st.integers(1, 3), data=st.data())
def test_superblock_unpack_pack_is_identity(codebook, n, sb, data):
    size = n * sb * SUPER[codebook]["block"]
    raw = data.draw(st.one_of(st.binary(min_size=size, max_size=size), st.just(None)))
    if raw is None:
        blocks = super_bytes(codebook, n, sb, data.draw(st.integers(0, 2**32 - 1)))
    else:
        blocks = np.frombuffer(raw, dtype=np.uint8).reshape(n, -1).copy()
    before = blocks.copy()
    out = unpack(pack(codebook, blocks, n, sb * 256))
    assert out.dtype == np.uint8 and out.tobytes() == before.tobytes() == blocks.tobytes()


@pytest.mark.parametrize("codebook", sorted(SUPER))
@pytest.mark.parametrize(("n", "sb"), [(1, 1), (3, 2), (33, 1)])
def test_superblock_planes_hold_the_gguf_fields(codebook, n, sb):
    lay = SUPER[codebook]
    blocks = super_bytes(codebook, n, sb, seed=n + 10 * sb)
    packed = pack(codebook, blocks, n, sb * 256)
    kb = 8 * sb
    assert packed.codebook == codebook and packed.execution == codebook.lower() and packed.kb == kb
    assert packed.payload.dtype == np.uint32 and packed.payload.shape == (kb, n, 4)
    assert packed.scale.dtype == np.float16 and packed.scale.shape == (sb, n)  # compact: one per super-block
    assert packed.sub is not None and packed.sub.dtype == np.uint8 and packed.sub.shape == (sb, n, lay["sc"][1])
    high_words = None if lay["qh"] is None else lay["qh"][1] // 8 // 4
    assert (packed.min is None) == (lay["m"] is None) and (packed.high is None) == (high_words is None)
    if packed.min is not None:
        assert packed.min.dtype == np.float16 and packed.min.shape == (sb, n)
    if packed.high is not None:
        assert packed.high.dtype == np.uint32
        assert packed.high.shape == ((kb, n) if high_words == 1 else (kb, n, high_words))
    assert list(packed.planes()) == [p for p in ("payload", "scale", "min", "high", "sub")
                                     if getattr(packed, p) is not None]
    assert packed.nbytes == blocks.nbytes
    assert all(plane.flags.c_contiguous for plane in packed.planes().values())

    def field(row: int, s: int, name: str) -> bytes:
        at, size = lay[name]
        start = s * lay["block"] + at
        return blocks[row, start : start + size].tobytes()

    for row in range(n):
        for s in range(sb):
            qs = field(row, s, "qs")
            for r in range(8):  # run r of the codes is the plane row of 32-block 8s + r
                assert packed.payload[8 * s + r, row].tobytes() == qs[16 * r : 16 * r + 16]
                if packed.high is not None:
                    run = lay["qh"][1] // 8
                    assert packed.high[8 * s + r, row].tobytes() == field(row, s, "qh")[run * r : run * (r + 1)]
            assert packed.scale[s, row].tobytes() == field(row, s, "d")
            assert packed.sub[s, row].tobytes() == field(row, s, "sc")
            if packed.min is not None:
                assert packed.min[s, row].tobytes() == field(row, s, "m")


def test_superblock_consecutive_outputs_read_consecutive_16_byte_payloads():
    blocks = super_bytes("Q4_K", 5, 1, seed=3)
    flat = pack("Q4_K", blocks, 5, 256).payload.reshape(-1).view(np.uint8)
    for r in range(8):
        for row in range(5):
            start = (r * 5 + row) * 16
            assert flat[start : start + 16].tobytes() == blocks[row, 16 + 16 * r : 32 + 16 * r].tobytes()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("Q4_K", super_bytes("Q4_K", 2, 1, 0), 2, 288), r"K=288 is not a multiple of 256 \(a Q4_K super-block"),
        (("Q6_K", super_bytes("Q6_K", 2, 1, 0), 2, 32), r"multiple of 256"),
        (("Q5_K", super_bytes("Q5_K", 2, 1, 0), 2, 512), r"K/256\*176 = 352 for K=512, got 176"),
        (("IQ4_XS", super_bytes("Q4_K", 2, 1, 0), 2, 256), r"= 136 for K=256, got 144"),  # Q4_K bytes as IQ4_XS
        (("Q2_K", super_bytes("Q4_K", 2, 1, 0), 2, 256), r"unknown codebook 'Q2_K'"),
    ],
)
def test_superblock_bad_input_raises_input_error(args, match):
    with pytest.raises(InputError, match=match) as info:
        pack(*args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_plane_shapes_are_the_shapes_pack_makes(codebook):
    """layout.plane_shapes (device planes made without packing: launch.random_weights) agrees with pack."""
    n, k = 24, 512
    book = get(codebook)
    blocks = np.random.default_rng(5).integers(0, 256, size=(n, k // book.weights * book.block_bytes), dtype=np.uint8)
    packed = pack(codebook, blocks, n, k)
    assert plane_shapes(codebook, n, k) == {name: (p.shape, p.dtype) for name, p in packed.planes().items()}

