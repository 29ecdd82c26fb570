"""Candidate registry (docs/contract.md §3): ids, normalization, validity, launch geometry, compiled instantiations."""

import dataclasses

import pytest
from gemv_dispatch.kernels import registry
from gemv_dispatch.kernels.codebooks import CODEBOOKS
from gemv_dispatch.kernels.emulate import effective_split, identity
from gemv_dispatch.kernels.errors import BLOCK, InputError
from gemv_dispatch.kernels.registry import (
    BY_ID,
    CANDIDATES,
    MMA_OUTPUTS,
    PIPE_SLOTS,
    RING_MIN_BLOCKS,
    RING_SHARED_LIMIT,
    SHARED_MEMORY_LIMIT,
    Candidate,
    by_id,
    candidates_for,
    instantiations,
    kernel_names,
    pipe_slot_bytes,
    ticket_words,
)
from hypothesis import given, settings
from hypothesis import strategies as st

shapes = st.tuples(st.integers(1, 40), st.integers(1, 262144), st.integers(1, 2048).map(lambda kb: 32 * kb))


def test_ids_are_unique_and_name_their_candidate():
    assert len(BY_ID) == len(CANDIDATES)
    for cand in CANDIDATES:
        assert by_id(cand.id) is cand
        family, split, threads, tail, *staged = cand.id.split(".")
        assert (family, split, threads) == (cand.family, f"s{cand.ksplit}", f"t{cand.threads}")
        assert tail == (f"mma{cand.mma_tiles}" if cand.engine == "mma" else f"c{cand.cpt}")
        assert staged == (["st"] if cand.staged else [])


def test_unknown_id_is_one_clear_error():
    with pytest.raises(InputError, match=r"unknown candidate 'wide\.s3\.t7\.c1'"):
        by_id("wide.s3.t7.c1")


def test_both_engines_are_offered():
    engines = {(c.family, c.engine) for c in CANDIDATES}
    assert engines == {("wide", "dp4a"), ("direct", "dp4a"), ("kpar", "dp4a"), ("wide", "mma"), ("kpar", "mma")}


def test_every_dp4a_launch_has_a_staged_twin_for_one_row():
    """gemv_staged: each dp4a candidate's twin (but the two that won no cell of an H200 corpus), valid at M = 1
    only and where its staged blocks fit the shared memory beside the partials (40 bytes a block: direct and wide all
    of K, kpar one partition)."""
    twins = {dataclasses.replace(c, staged=False): c for c in CANDIDATES if c.staged}
    untwinned = {c.id for c in CANDIDATES if c.engine == "dp4a" and not c.staged} - {c.id for c in twins}
    assert untwinned == {"kpar.s64.t128.c1", "direct.s2.t32.c1"}
    direct = twins[next(c for c in twins if c.family == "direct" and c.ksplit == 16 and c.threads == 8)]
    assert direct.kernel_name("Q4_0", 1) == "gemv_staged<0, 1, false>"
    assert direct.shared_bytes(1, 4096) == 15 * 8 * 4 + 40 * 128
    assert direct.valid(1, 4096, 4096) and "M = 1" in direct.invalid_reason(2, 4096, 4096)
    assert "shared memory" in direct.invalid_reason(1, 4096, 32 * 1300)  # 52 KB of blocks
    kpar = twins[next(c for c in twins if c.family == "kpar" and c.ksplit == 4 and c.threads == 64)]
    assert kpar.shared_bytes(1, 32 * 4000) == 40 * 1000 and kpar.valid(1, 4096, 32 * 4000)


def test_staged_walks_get_their_ring_where_it_fits_and_pays(monkeypatch):
    """The ring of the staged walks (PIPE_SLOTS slots per thread of one batch each, 16-byte aligned behind the staged
    blocks) for staged twins only, only where a thread walks RING_MIN_BLOCKS blocks or more, never for Q8_0, and only
    where the whole stays within RING_SHARED_LIMIT; a slot holds a super-block walk's one group, or a legacy walk's
    PIPE_BATCH blocks of each of its cpt columns. The constants are read at each call: tools/source_ab.py sizes
    another kernel source's ring by setting them."""
    assert pipe_slot_bytes("Q4_K", 2) == pipe_slot_bytes("Q4_K", 1) == 8 * 16 + 5 * 4
    assert pipe_slot_bytes("Q4_0", 2) == 2 * pipe_slot_bytes("Q4_0", 1) == 2 * 4 * (16 + 4)
    assert pipe_slot_bytes("Q8_0", 1) == 0
    direct = next(c for c in CANDIDATES if c.id == "direct.s2.t64.c1.st")  # 128 threads
    k = 2 * RING_MIN_BLOCKS * BLOCK  # each of the 2 partitions walks RING_MIN_BLOCKS blocks
    base = direct.shared_bytes(1, k)
    assert base == 64 * 4 + 40 * 2 * RING_MIN_BLOCKS
    for cb in ("Q4_K", "Q4_0"):
        assert direct.shared_bytes(1, k, cb) == base + 128 * PIPE_SLOTS * pipe_slot_bytes(cb, 1)
        assert direct.shared_bytes(1, k - 2 * BLOCK, cb) == direct.shared_bytes(1, k - 2 * BLOCK)  # a block short
        with monkeypatch.context() as patched:  # a ring of one more slot, from one block fewer a thread
            patched.setattr(registry, "PIPE_SLOTS", PIPE_SLOTS + 1)
            patched.setattr(registry, "RING_MIN_BLOCKS", RING_MIN_BLOCKS - 1)
            assert direct.shared_bytes(1, k, cb) == base + 128 * (PIPE_SLOTS + 1) * pipe_slot_bytes(cb, 1)
            assert direct.shared_bytes(1, k - 2 * BLOCK, cb) > direct.shared_bytes(1, k - 2 * BLOCK)
    assert direct.shared_bytes(1, k, "Q8_0") == base
    unstaged = next(c for c in CANDIDATES if c.id == "direct.s2.t64.c1")
    assert unstaged.shared_bytes(1, k, "Q4_K") == unstaged.shared_bytes(1, k)
    wide512 = next(c for c in CANDIDATES if c.id == "direct.s8.t64.c1.st")  # 512 threads: no room
    assert wide512.shared_bytes(1, 4 * k, "IQ4_XS") == wide512.shared_bytes(1, 4 * k)
    for c in CANDIDATES:
        for cb in CODEBOOKS:
            for kk in (5120, k, 4 * k):
                assert c.shared_bytes(1, kk, cb) <= RING_SHARED_LIMIT and c.shared_bytes(1, kk, cb) % 4 == 0


@pytest.mark.parametrize("bad", [
    dict(family="direct", ksplit=2, threads=64, mma_tiles=2),  # in-CTA partitions have no mma kernel
    dict(family="wide", ksplit=1, threads=128, cpt=2, mma_tiles=2),
    dict(family="kpar", ksplit=4, threads=100, mma_tiles=2),  # not whole warps
])
def test_mma_candidates_outside_the_kernel_are_rejected(bad):
    with pytest.raises(ValueError, match="mma candidate"):
        Candidate(**bad)


@settings(max_examples=300, deadline=None)
@given(shapes)
def test_every_gemv_shape_has_candidates_each_identity_spelled_once(shape):
    m, n, k = shape
    cands = candidates_for(m, n, k)
    assert cands, f"no candidate for M={m}, N={n}, K={k}"
    kb = k // 32
    for c in cands:
        assert c.split(k) == c.ksplit == effective_split(kb, c.ksplit)  # normalized: ksplit is effective
        assert c.identity(k) == identity(kb, c.ksplit)
        assert c.shared_bytes(m, k) <= SHARED_MEMORY_LIMIT
        assert not c.staged or m == 1
    launches = [(c.family, c.ksplit, c.threads, c.cpt, c.mma_tiles, c.staged) for c in cands]
    assert len(launches) == len(set(launches))


@settings(max_examples=300, deadline=None)
@given(shapes)
def test_invalid_candidates_say_why_and_valid_ones_cover_n(shape):
    m, n, k = shape
    for c in CANDIDATES:
        reason = c.invalid_reason(m, n, k)
        if reason is not None:
            assert isinstance(reason, str) and reason
            continue
        (gx, gy, gz), (bx, by, bz) = c.launch_geometry(m, n, k)
        assert gx * c.outputs_per_cta >= n > (gx - 1) * c.outputs_per_cta  # every output, no idle CTA column
        assert gy * by == c.ksplit and gz == bz == 1 and bx == c.threads
        if c.engine == "mma":
            assert n % MMA_OUTPUTS == 0
        assert c.workspace_bytes(m, n, k) == (4 * (ticket_words(n) + c.ksplit * m * n) if c.family == "kpar" else 0)
        assert gx <= ticket_words(n)  # a ticket per CTA column


def test_mma_needs_whole_tiles():
    mma = next(c for c in CANDIDATES if c.engine == "mma" and c.family == "wide")
    assert mma.valid(4, 1000, 4096)
    assert "mma tile" in mma.invalid_reason(4, 1004, 4096)


def test_planes_must_fit_32_bit_indices():
    """gemv.cu's block_index is 32-bit: a plane of 2^32 blocks (weights KB·N or activations KB·M) is refused, one
    column fewer is not."""
    wide = next(c for c in CANDIDATES if c.family == "wide" and c.engine == "dp4a" and c.cpt == 1 and c.ksplit == 1)
    k = 32 * 4096
    assert wide.valid(1, 2**20 - 1, k)
    assert "2^32" in wide.invalid_reason(1, 2**20, k)
    assert "2^32" in wide.invalid_reason(2**20, 8, k)


def test_every_kernel_a_valid_candidate_launches_is_compiled():
    """The launcher compiles kernel_names(codebook); a launch outside that set would fail at run time."""
    compiled = set(instantiations())
    assert compiled == {(cb, name) for cb in CODEBOOKS for name in kernel_names(cb)}
    for cb in CODEBOOKS:
        for c in CANDIDATES:
            for m in (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64):
                assert (cb, c.kernel_name(cb, m)) in compiled, (cb, c.id, m)


def test_mma_row_tiles_follow_m():
    mma = next(c for c in CANDIDATES if c.engine == "mma" and c.family == "kpar")
    assert mma.kernel_name("Q4_0", 16) == f"gemv_mma<0, {mma.mma_tiles}, 1, true, {mma.threads}, false>"
    assert mma.kernel_name("IQ4_NL", 31) == f"gemv_mma<5, {mma.mma_tiles}, 2, true, {mma.threads}, false>"


def test_the_ring_takes_the_weights_as_a_at_m_up_to_8_in_tile_pairs():
    """Every codebook's mma launches of tile pairs swap the operands at M <= 8 (ring_chunk_weights_a)."""
    pair = by_id("wide.s1.t128.mma2")
    assert [pair.kernel_name("Q4_0", m).endswith(", true>") for m in (1, 8, 9, 16)] == [True, True, False, False]
    assert all(pair.kernel_name(cb, 4).endswith(", true>") for cb in CODEBOOKS)
    assert not by_id("wide.s1.t256.mma1").kernel_name("Q4_0", 4).endswith(", true>")  # one tile: no pair
