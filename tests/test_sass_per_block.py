"""tools/sass_per_block.py: which loop of a SASS listing is the main loop, and its instructions per block. The
listing is written here (cuobjdump is not part of CI's toolkit); the real counts are in lab/journal.md."""

from __future__ import annotations

import re

from test_bench_report import repo_script


def listing(body: list[str], outer_extra: int = 3, function: str = "_Z12gemv_partialILi5ELi1ELi1ELb0EEvPKj") -> str:
    """One function: a prologue, an outer loop around an inner loop of `body`, an epilogue."""
    lines = [f"        Function : {function}", '        .headerflags    @"EF_CUDA_SM90"']
    at = 0

    def emit(text: str) -> int:
        nonlocal at
        lines.append(f"        /*{at:04x}*/                   {text} ;   /* 0x000000000000794d */")
        at += 0x10
        return at - 0x10

    emit("S2R R0, SR_TID.X")
    outer = emit("IMAD R1, R0, 0x4, RZ")
    inner = emit("LDG.E.128.CONSTANT R4, desc[UR8][R50.64]")
    for text in body:
        emit(text)
    emit(f"@!P0 BRA 0x{inner:x}")
    for _ in range(outer_extra):
        emit("IDP.4A.S8.S8 R9, R4, R5, R9")  # dp4a outside the inner loop: must not count
    emit(f"@P1 BRA 0x{outer:x}")
    emit("EXIT")
    return "\n".join(lines)


def test_the_innermost_loop_with_a_blocks_dp4a_is_counted():
    sass = repo_script("tools/sass_per_block")
    body = ["IDP.4A.S8.S8 R8, R4, R12, R8"] * 16 + ["LOP3.LUT R4, R4, 0xf0f0f0f, RZ, 0xc0, !PT"] * 6
    (count,) = sass.count(listing(body))
    assert count.kernel == "gemv_partial<5, 1, 1, false>"
    assert count.instructions == 1 + len(body) + 1  # the load, the body, the branch back
    assert (count.units, count.unit, count.per_unit) == (2, "block", 12)
    assert count.ops == {"IDP": 16, "LOP3": 6, "LDG": 1, "BRA": 1}


def test_a_loop_without_a_blocks_dp4a_is_not_the_main_loop():
    """Negative control: with 7 IDP the inner loop does not qualify, so the outer one (with 3 more) is taken."""
    sass = repo_script("tools/sass_per_block")
    (count,) = sass.count(listing(["IDP.4A.S8.S8 R8, R4, R12, R8"] * 7))
    assert count.ops["IDP"] == 10 and count.ops["BRA"] == 2
    assert sass.count(listing(["IMAD R2, R2, 0x3, RZ"], outer_extra=0)) == []


def test_an_mma_loop_is_counted_per_mma():
    """The tensor-core engine's loop: its unit is the IMMA, which outranks a block's dp4a in the same body."""
    sass = repo_script("tools/sass_per_block")
    body = ["IMMA.16832.S8.S8 R8, R12.ROW, R4.COL, R8"] * 2 + ["FMUL R2, R3, R4"] * 8 + ["LDS R5, [R6]"] * 3
    body += ["IDP.4A.S8.S8 R8, R4, R12, R8"] * 8
    (count,) = sass.count(listing(body))
    assert (count.units, count.unit) == (2, "mma") and count.per_unit == (1 + len(body) + 1) / 2
    assert count.ops["IMMA"] == 2 and count.ops["BRA"] == 1  # the inner loop, not the outer one


def test_opcode_drops_predicate_and_modifiers():
    sass = repo_script("tools/sass_per_block")
    assert sass.opcode("@!P0 LDG.E.128.CONSTANT R4, desc[UR8][R50.64]") == "LDG"
    assert sass.opcode("@UP1 UMOV UR4, 0x1") == "UMOV" and sass.opcode("IDP.4A.S8.S8 R8, R4, R12, R8") == "IDP"


def test_the_lookup_codebooks_staged_kernels_count_16_dp4a_a_block():
    """IQ4_NL's staged kernel adds two addends a word (16 IDP a block); the same body in Q4_0's staged kernel is 2
    blocks, and in IQ4_NL's unstaged kernel where the source's addends are the staged kernels' alone."""
    sass = repo_script("tools/sass_per_block")
    body = ["IDP.4A.S8.S8 R8, R4, R12, R8"] * 16 + ["PRMT R4, R4, 0x3210, R5"] * 8
    staged_only = sass.Addends(staged=True, one_row=False, ring=True)  # versions 40 to 44
    for function, blocks in (("_Z11gemv_stagedILi5ELi1ELb0EEvPKj", 1), ("_Z11gemv_stagedILi0ELi1ELb0EEvPKj", 2),
                             ("_Z12gemv_partialILi5ELi1ELi1ELb0EEvPKj", 2)):
        (count,) = sass.count(listing(body, function=function), staged_only)
        assert (count.units, count.unit) == (blocks, "block"), function
    # Where SELECTOR_ORDER covers every one-row kernel, IQ4_NL's unstaged kernel of one row too, not of two.
    one_row, two_rows = "_Z12gemv_partialILi5ELi1ELi1ELb0EEvPKj", "_Z12gemv_partialILi5ELi1ELi2ELb0EEvPKj"
    for function, blocks in ((one_row, 1), (two_rows, 2)):
        (count,) = sass.count(listing(body, function=function), sass.Addends(True, True, True))
        assert count.units == blocks, function
    assert sass.Addends.of("iq4nl_addends( constexpr bool SELECTOR_ORDER = T::TABLE && MT == 1;").one_row
    assert sass.Addends(True, True, True).per_unit("quantize_activations") == (8, 1)
    assert not sass.Addends.of("iq4nl_addends( constexpr bool SELECTOR_ORDER = STAGE && T::TABLE;").one_row


def test_q5k_one_row_kernels_count_24_dp4a_a_pair_where_the_source_splits_odd_blocks():
    """Q5_K's odd block of a pair as two addends at one row (nibbles and fifth bits in place): 8 + 16 IDP a pair, so
    48 IDP are 4 blocks in its staged and one-row kernels, 6 at two rows and in a source without the split."""
    sass = repo_script("tools/sass_per_block")
    body = ["IDP.4A.U8.S8 R8, R4, R12, R8"] * 48
    split = sass.Addends.of("constexpr bool IN_PLACE = CB == Q4_K || (CB == Q5_K && MT == 1); "
                            "constexpr int ADDENDS = SELECTOR_ORDER || (CB == Q5_K && IN_PLACE) ? 2 : 1;")
    assert split.fifth_bits and not sass.Addends.of("constexpr bool IN_PLACE = CB == Q4_K;").fifth_bits
    staged, one_row = "_Z11gemv_stagedILi7ELi1ELb0EEvPKj", "_Z12gemv_partialILi7ELi1ELi1ELb0EEvPKj"
    two_rows = "_Z12gemv_partialILi7ELi1ELi2ELb0EEvPKj"
    for function, addends, blocks in ((staged, split, 4), (one_row, split, 4), (two_rows, split, 6),
                                      (staged, sass.Addends(), 6)):
        (count,) = sass.count(listing(body, function=function), addends)
        assert (count.units, count.unit) == (blocks, "block"), function


def test_a_dp4a_by_a_constant_sums_bytes_and_is_no_blocks():
    """Q6_K's dp4a kernels sum each half's activation bytes with IDP by 0x01010101 (a uniform register or an
    immediate): 8 products and 4 sums are one block."""
    sass = repo_script("tools/sass_per_block")
    sums = ["IDP.4A.S8.S8 R68, R32, UR5, RZ", "IDP.4A.S8.S8 R65, R33, 0x1010101, R68"] * 2
    (count,) = sass.count(listing(["IDP.4A.S8.S8 R8, R4, R12, R8"] * 8 + sums))
    assert (count.units, count.unit) == (1, "block") and count.ops["IDP"] == 12


def test_the_lookup_codebooks_ring_counts_two_mma_a_unit_where_the_source_has_addends():
    sass = repo_script("tools/sass_per_block")
    body = ["IMMA.16832.S8.S8 R8, R12.ROW, R4.COL, R8"] * 4 + ["PRMT R4, R4, 0x3210, R5"] * 8
    ring = "_Z8gemv_mmaILi5ELi2ELi1ELb0ELi128ELb0EEvPKj"  # gemv_mma<5, 2, 1, false, 128, false>: IQ4_NL
    addends = sass.Addends(staged=True, one_row=True, ring=True)
    (count,) = sass.count(listing(body, function=ring), addends)
    assert (count.units, count.unit) == (2, "mma")
    (count,) = sass.count(listing(body, function=ring), sass.Addends(staged=True, one_row=True, ring=False))
    assert (count.units, count.unit) == (4, "mma")
    (count,) = sass.count(listing(body, function=ring.replace("ILi5E", "ILi0E", 1)), addends)  # Q4_0: no lookup
    assert count.units == 4


def test_instructions_per_weight_byte_take_the_codebooks_block_bytes():
    """A dp4a loop's count per block over its codebook's bytes per 32 weights (Q4_0: 18, Q8_0: 34, IQ4_XS: 17);
    none for an mma loop or a kernel no candidate launches."""
    sass = repo_script("tools/sass_per_block")

    def loop(kernel: str, unit: str = "block") -> object:
        return sass.LoopCount(kernel, instructions=144, units=4.0, unit=unit, ops={})

    assert sass.per_weight_byte(loop("gemv_staged<0, 1, false>")) == 36 / 18
    assert sass.per_weight_byte(loop("gemv_partial<4, 1, 1, false>")) == 36 / 34
    assert sass.per_weight_byte(loop("gemv_staged<9, 1, false>")) == 36 / 17
    assert sass.per_weight_byte(loop("gemv_mma<0, 2, 1, false, 128, false>", unit="mma")) is None
    assert sass.per_weight_byte(loop("quantize_activations")) is None


def test_sass_diff_names_the_functions_whose_instructions_differ():
    """tools/sass_diff.py compares instructions, not addresses: the same body at other addresses is the same, one
    instruction more is a difference, and a function only one source has differs too."""
    repo_script("tools/sass_per_block")  # sass_diff imports it as a sibling script
    diff = repo_script("tools/sass_diff")
    body = ["IDP.4A.S8.S8 R8, R4, R12, R8"] * 8
    base = diff.instructions(listing(body))
    moved = diff.instructions(re.sub(r"/\*([0-9a-f]{4})\*/", lambda m: f"/*{int(m.group(1), 16) + 0x100:04x}*/",
                                     listing(body)))
    longer = diff.instructions(listing([*body, "LOP3.LUT R4, R4, 0xf0f0f0f, RZ, 0xc0, !PT"]))
    other = diff.instructions(listing(body, function="_Z12gemv_partialILi6ELi1ELi1ELb0EEvPKj"))
    assert diff.differing(base, moved) == []
    assert diff.instructions(listing(body) + "\n" + listing(body)) == base  # listed in two cubins: once
    assert diff.differing(base, longer) == ["_Z12gemv_partialILi5ELi1ELi1ELb0EEvPKj"]
    assert diff.differing(base, base | other) == ["_Z12gemv_partialILi6ELi1ELi1ELb0EEvPKj"]
