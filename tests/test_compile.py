"""CPU compile check: every kernel instantiation builds for sm_90 without spills or a stack frame."""

import os
import re
import shutil

import hostsim
import pytest
from gemv_dispatch.kernels import launch, program
from gemv_dispatch.kernels.codebooks import CODEBOOKS, FORMATS
from gemv_dispatch.kernels.ptxas import compile_report, compile_unit, parse_report, source_name
from gemv_dispatch.kernels.registry import CANDIDATES, MMA_ROWS, instantiations

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None and not os.environ.get("CI"), reason="nvcc is not on PATH (CI requires it)"
)


def assert_clean_build(build, names: list[str], helpers: tuple[str, ...] = program.HELPER_KERNELS) -> None:
    """Every kernel built, none with a stack frame or spills, within the register cap, no flushing float op."""
    report = build.resources
    by_name = {r.name: r for r in report}
    assert set(names) | set(helpers) == set(by_name), "ptxas reported other kernels than built"
    offenders = [r for r in report if r.stack_bytes or r.spill_store_bytes or r.spill_load_bytes]
    assert not offenders, f"stack frame or spills: {offenders}"
    # Registers per thread, recorded in the test log (pytest -rA shows it).
    print("\n".join(f"{r.registers:4d} regs  {r.name}" for r in sorted(report, key=lambda r: r.name)))
    cap = int(next(o for o in program.CONTRACT_OPTIONS if o.startswith("--maxrregcount=")).split("=")[1])
    assert all(0 < r.registers <= cap for r in report), f"--maxrregcount={cap} caps registers"
    # CuPy builds with -ftz=true: the contract's float operations must not be flushing variants.
    assert build.ptx.count(".entry") == len(report)
    flushing = sorted({line.split()[0] for line in build.ptx.splitlines() if ".ftz" in line})
    assert not flushing, f"flush-to-zero instructions in the PTX: {flushing}"


@needs_nvcc
def test_every_instantiation_compiles_spill_free_for_sm90():
    names = sorted({name for _, name in instantiations()})
    assert_clean_build(compile_report(names, "sm_90"), names)


@needs_nvcc
def test_staged_source_compiles_spill_free_for_sm90():
    """The staged next kernel source (bench/next), every codebook including the super-block ones."""
    names = sorted({c.template_name(hostsim.codebook_index(cb), m)
                    for cb in FORMATS for c in CANDIDATES for m in range(1, 2 * MMA_ROWS + 1)})
    text = program.explicit_instantiations(names, hostsim.STAGED_SOURCE.read_text())
    assert_clean_build(compile_unit(text, "sm_90"), names, helpers=("quantize_activations",))  # kpar folds itself


@pytest.mark.parametrize(("text", "planes", "outputs"),
                         [(program.source(), 4, 1), (hostsim.STAGED_SOURCE.read_text(), 5, 2)])
def test_both_engines_declare_the_parameters_the_launchers_pass(text, planes, outputs):
    """The planes, three activation arrays, M, N, KB and the partition width, the output (staged: and kpar's
    workspace): what kernels.launch (registered source) and tests/hostsim (staged) pass, in that order."""
    want = program.declared_signature(text, "gemv_partial")
    assert program.declared_signature(text, "gemv_mma") == want
    types = want.strip("()").split(", ")
    assert types[planes:] == ["const int*", "const float*", "const int*", "int", "int", "int", "int",
                              *["float*"] * outputs]
    assert all(t.startswith("const u") for t in types[:planes])
    assert len(program.declared_planes(text)) == planes
    assert set(program.declared_planes(text)) <= set(launch.PLANE_FIELDS), "a plane kernels.launch cannot pass"


def test_report_parser_flags_spills():
    """Negative control: a report with spills must be read as spills, or the check above could never fail."""
    text = (
        "ptxas info    : Compiling entry function '_Z12gemv_partialILi0ELi1ELi1ELb0EEvPKj' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z12gemv_partialILi0ELi1ELi1ELb0EEvPKj\n"
        "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers\n"
    )
    (r,) = parse_report(text)
    assert (r.name, r.registers, r.stack_bytes, r.spill_store_bytes, r.spill_load_bytes) == (
        "gemv_partial<0, 1, 1, false>", 255, 16, 8, 12)


def test_report_parser_names_both_engines():
    assert source_name("_Z8gemv_mmaILi5ELi2ELi2ELb1EEvPKjS1_PKtS3_PKiPKfS5_iiiiPf") == "gemv_mma<5, 2, 2, true>"
    assert source_name("_Z12gemv_partialILi3ELi2ELi8ELb0EEvPKj") == "gemv_partial<3, 2, 8, false>"
    assert source_name("fold_partials") == "fold_partials"


@pytest.mark.parametrize(("text", "names"),
                         [(program.source(), CODEBOOKS), (hostsim.STAGED_SOURCE.read_text(), FORMATS)])
def test_the_codebook_enum_numbers_the_formats_as_the_registry_does(text, names):
    """registry.CODEBOOK_IDS (and hostsim.codebook_index) number a format by its place in the list."""
    enum = re.search(r"enum Codebook \{([^}]*)\}", text)
    assert enum is not None
    pairs = [item.split("=") for item in enum.group(1).split(",")]
    assert [(name.strip(), int(value)) for name, value in pairs] == [(name, i) for i, name in enumerate(names)]
