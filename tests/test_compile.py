"""CPU compile check: every kernel instantiation builds for sm_90 without spills or a stack frame."""

import json
import os
import re
import shutil
import subprocess

import pytest
from gemv_dispatch.kernels import digests, launch, program, registry
from gemv_dispatch.kernels.codebooks import CODEBOOKS, IQ4_NL_KVALUES, get
from gemv_dispatch.kernels.ptxas import compile_report, parse_report, source_name
from gemv_dispatch.kernels.registry import instantiations

needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None and not os.environ.get("CI"), reason="nvcc is not on PATH (CI requires it)"
)


@needs_nvcc
def test_every_instantiation_compiles_spill_free_for_sm90():
    """Every kernel built, none with a stack frame or spills, within the register cap, no flushing float op."""
    names = sorted({name for _, name in instantiations()})
    builds = digests.canonical_builds()  # the sm_90 build the code digests are defined on
    report = list({r.name: r for build in builds for r in build.resources}.values())
    by_name = {r.name: r for r in report}
    assert set(names) | set(program.HELPER_KERNELS) == set(by_name), "ptxas reported other kernels than built"
    offenders = [r for r in report if not r.spill_free]
    assert not offenders, f"stack frame or spills: {offenders}"
    # Registers per thread, recorded in the test log (pytest -rA shows it).
    print("\n".join(f"{r.registers:4d} regs  {r.name}" for r in sorted(report, key=lambda r: r.name)))
    cap = int(next(o for o in program.CONTRACT_OPTIONS if o.startswith("--maxrregcount=")).split("=")[1])
    assert cap == program.MAX_REGISTERS
    assert all(0 < r.registers <= cap for r in report), f"--maxrregcount={cap} caps registers"
    # CuPy builds with -ftz=true: the contract's float operations must not be flushing variants.
    ptx = "".join(build.ptx for build in builds)
    assert ptx.count(".entry") == sum(len(build.resources) for build in builds)
    assert all(build.cubin[:4] == b"\x7fELF" for build in builds)  # the assembled kernels, for tools/sass_per_block.py
    flushing = sorted({line.split()[0] for line in ptx.splitlines() if ".ftz" in line})
    assert not flushing, f"flush-to-zero instructions in the PTX: {flushing}"
    # The committed code digests are this build's: a kernel change must rewrite them (kernels/digests.py).
    committed = json.loads(digests.TABLE_PATH.read_bytes())
    assert committed["source"] == program.digest(), "run `python -m gemv_dispatch.kernels.digests`"
    if committed["nvcc"] != digests.nvcc_release():
        pytest.skip(f"the code digests were made with nvcc {committed['nvcc']}, this is {digests.nvcc_release()}")
    assert digests.build(builds) == committed["instantiations"], "stale kernels/cuda/instantiations.json: rerun " \
        "kernels.digests"


def test_both_engines_declare_the_parameters_the_launchers_pass():
    """The five planes, three activation arrays, M, N, KB and the partition width, the output and kpar's
    workspace: what kernels.launch and tests/hostsim pass, in that order."""
    text = program.source()
    want = program.declared_signature(text, "gemv_partial")
    assert program.declared_signature(text, "gemv_mma") == want
    types = want.strip("()").split(", ")
    assert types[5:] == ["const int*", "const float*", "const int*", "int", "int", "int", "int", "float*", "float*"]
    assert all(t.startswith("const u") for t in types[:5])
    assert set(program.declared_planes(text)) == set(launch.PLANE_FIELDS), "a plane kernels.launch cannot pass"


def test_the_ticket_count_is_the_registrys():
    """kpar's ticket counters ahead of its partials: the source's ticket_words is registry.ticket_words."""
    body = re.search(r"int ticket_words\(int N\) \{ return ([^;]*); \}", program.source())
    assert body is not None
    expression = body.group(1).replace("/", "//")
    assert all(eval(expression, {"N": n}) == registry.ticket_words(n) for n in range(1, 5000))


def test_a_staged_block_is_the_registrys():
    """gemv_staged lays out STAGED_BLOCK_BYTES per activation block (its static_assert ties them to the layout);
    Candidate.shared_bytes allocates the registry's figure, so the two must agree."""
    staged = re.search(r"constexpr int STAGED_BLOCK_BYTES = (\d+);", program.source())
    assert staged is not None and int(staged.group(1)) == registry.STAGED_BLOCK_BYTES


def test_the_staged_rings_codebooks_are_the_registrys():
    """gemv.cu's PIPE leaves out the codebooks whose staged walks take no ring; Candidate.shared_bytes gives a ring
    only to those with a slot (registry.PIPE_GROUP_BYTES), so the two must name the same ones."""
    pipe = re.search(r"constexpr bool PIPE = STAGE((?: && CB != \w+)*);", program.source())
    assert pipe is not None
    left_out = set(re.findall(r"CB != (\w+)", pipe.group(1)))
    assert left_out == {cb for cb in CODEBOOKS if not registry.pipe_slot_bytes(cb, 1)}


def test_the_thread_limit_follows_the_register_cap():
    """No CTA of more threads than the register file holds at --maxrregcount: a launch of such a CTA fails."""
    assert registry.MAX_CTA_THREADS * program.MAX_REGISTERS == registry.REGISTER_FILE
    assert program.source().count("__launch_bounds__(") == 1
    launch_bounds = re.findall(r"__launch_bounds__\((\w+), (\w+)<CB, THREADS, WEIGHTS_A>\(\)\)", program.source())
    # The one bound: gemv_mma's CTA (the threads its candidate launches) and the CTAs per SM its registers allow.
    assert launch_bounds == [("THREADS", "min_ctas_per_sm")]
    constants = dict(re.findall(r"constexpr int (REGISTER_FILE|REGISTER_CAP|STATIC_SHARED) = (\d+);", program.source()))
    assert constants == {"REGISTER_FILE": str(registry.REGISTER_FILE), "REGISTER_CAP": str(program.MAX_REGISTERS),
                         "STATIC_SHARED": str(registry.SHARED_MEMORY_LIMIT)}
    for c in registry.CANDIDATES:
        if c.mma_tiles:
            assert c.kernel_name("Q4_0", 16).endswith(f", {c.threads}, false>"), c.id
    assert max(c.threads * (1 if c.grid_split else c.ksplit) for c in registry.CANDIDATES) <= registry.MAX_CTA_THREADS


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


@needs_nvcc
def test_another_source_compiles_and_its_stack_frame_is_caught():
    """compile_report builds the text it is given (tools/source_ab.py compiles kernel variants this way), and
    spill_free is false for a kernel with a stack frame: the negative control of the check above, end to end."""
    text = program.source() + (
        'extern "C" __global__ void indexed_local(float* out, int i) {\n'
        "    float a[256];  // more than the register file gives a thread, written and read at runtime indices\n"
        "    for (int j = 0; j < 256; ++j) a[(j * i) & 255] = out[j];\n"
        "    out[0] = a[i & 255];\n"
        "}\n")
    name = registry.instantiations()[0][1]
    by_name = {r.name: r for r in compile_report([name], "sm_90", text=text).resources}
    assert set(by_name) == {name, "indexed_local", *program.HELPER_KERNELS}
    assert by_name[name].spill_free
    assert not by_name["indexed_local"].spill_free and by_name["indexed_local"].stack_bytes >= 256
    assert "stack frame" in by_name["indexed_local"].describe()


def test_the_spill_check_command_reports_user_and_environment_errors(monkeypatch, capsys):
    """python -m gemv_dispatch.kernels.ptxas: a malformed --arch is a user mistake (exit 2), no nvcc an environment
    problem (exit 3), each in one line."""
    from gemv_dispatch.kernels import ptxas

    with pytest.raises(SystemExit) as bad:
        ptxas.main(["--arch", "90"])
    assert bad.value.code == 2 and "not an architecture" in capsys.readouterr().err
    monkeypatch.setattr(ptxas.shutil, "which", lambda name: None)
    assert ptxas.main([]) == 3
    assert capsys.readouterr().err.strip() == "error: nvcc is not on PATH (the CUDA toolkit)"


@needs_nvcc
def test_the_spill_check_command_names_an_architecture_nvcc_refuses(capsys):
    from gemv_dispatch.kernels import ptxas

    assert ptxas.main(["--arch", "sm_10"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: nvcc failed for sm_10:") and len(err.splitlines()) == 1


@needs_nvcc
def test_the_spill_check_command_names_the_compilers_error_in_a_source_it_refuses(monkeypatch, capsys):
    """A kernel source nvcc refuses: the one line printed is the compiler's error, not the last line of its excerpt
    (a caret or a blank gutter)."""
    from gemv_dispatch.kernels import ptxas

    broken = program.source() + "\n#error deliberately broken\n"
    monkeypatch.setattr(program, "source", lambda: broken)
    assert ptxas.main([]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: nvcc failed for sm_90:") and "deliberately broken" in err
    assert len(err.splitlines()) == 1


def test_the_error_line_is_the_compilers_error_not_its_excerpt():
    from gemv_dispatch.kernels.ptxas import error_line

    excerpt = "nvcc failed (1):\nk.cu(3): error: identifier \"x\" is undefined\n  int y = x;\n          ^\n\n"
    assert error_line(excerpt) == 'k.cu(3): error: identifier "x" is undefined'
    fatal = "nvcc fatal   : Unsupported gpu architecture 'compute_10'"
    assert error_line(f"nvcc failed (1):\n{fatal}\n") == fatal  # no line says error: the last one
    assert error_line("\n \n") == "failed"


def test_report_parser_names_both_engines():
    assert source_name("_Z8gemv_mmaILi5ELi2ELi2ELb1EEvPKjS1_PKtS3_PKiPKfS5_iiiiPf") == "gemv_mma<5, 2, 2, true>"
    assert source_name("_Z8gemv_mmaILi0ELi2ELi1ELb0ELi256EEvPKjS1_PKtS3_PKhPKiPKfS7_iiiiPfSA_") == (
        "gemv_mma<0, 2, 1, false, 256>")
    assert source_name("_Z12gemv_partialILi3ELi2ELi8ELb0EEvPKj") == "gemv_partial<3, 2, 8, false>"
    assert source_name("quantize_activations") == "quantize_activations"


def test_the_codebook_enum_numbers_the_formats_as_the_registry_does():
    """registry.CODEBOOK_IDS numbers a format by its place in CODEBOOKS, as the source's enum does."""
    enum = re.search(r"enum Codebook \{([^}]*)\}", program.source())
    assert enum is not None
    pairs = [item.split("=") for item in enum.group(1).split(",")]
    assert [(name.strip(), int(value)) for name, value in pairs] == [(name, i) for i, name in enumerate(CODEBOOKS)]
    assert {name: i for i, name in enumerate(CODEBOOKS)} == registry.CODEBOOK_IDS


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CI"),
                               reason="g++ is not on PATH (CI requires it)")


@needs_gxx
def test_the_sources_traits_are_the_codebooks(tmp_path):
    """gemv.cu's Traits, evaluated by a C++ compiler for every format, equal what kernels.codebooks says of it:
    the facts are written once in Python and the source is checked against them field by field."""
    source = program.source()
    enum = re.search(r"enum Codebook \{[^}]*\};", source)
    traits = re.search(r"template <int CB>\nstruct Traits \{.*?\n\};", source, re.S)
    assert enum is not None and traits is not None
    fields = ("SUPER", "WORDS", "ASYM", "HIGH", "TABLE", "HALVES", "SUB_BYTES")
    shows = "\n".join(f'    std::printf("{name}' + " %d" * len(fields) + '\\n", '
                      + ", ".join(f"(int)Traits<{name}>::{f}" for f in fields) + ");" for name in CODEBOOKS)
    program_text = f"#include <cstdio>\n{enum.group(0)}\n{traits.group(0)}\nint main() {{\n{shows}\n}}\n"
    (tmp_path / "traits.cpp").write_text(program_text)
    subprocess.run(["g++", "-std=c++17", "-o", str(tmp_path / "traits"), str(tmp_path / "traits.cpp")], check=True)
    out = subprocess.run([str(tmp_path / "traits")], capture_output=True, text=True, check=True).stdout
    got = {line.split()[0]: dict(zip(fields, map(int, line.split()[1:]), strict=True)) for line in out.splitlines()}
    want = {}
    for name in CODEBOOKS:
        book = get(name)
        want[name] = {"SUPER": int(book.superblock), "WORDS": book.payload_bytes // 4, "ASYM": int(book.asymmetric),
                      "HIGH": int(book.high_bits and not book.superblock), "TABLE": int(book.table),
                      "HALVES": book.subscales.count // 8 if book.superblock else 1,
                      "SUB_BYTES": dict(book.layout)["sc"] if book.superblock else 0}
    assert got == want


def test_the_sub_block_record_is_the_codebooks_sc_field():
    """gemv.cu's Traits::SUB_BYTES (the ring stages and the kernels address super-block records by it) is the size
    of each format's GGUF `sc` field."""
    chain = re.search(r"int SUB_BYTES = ([^;]*);", program.source())
    assert chain is not None and chain.group(1).endswith(": 0")
    sizes = {name: int(size) for names, size in re.findall(r"((?:CB == \w+(?: \|\| )?)+) \? (\d+)", chain.group(1))
             for name in re.findall(r"CB == (\w+)", names)}
    assert sizes == {book.name: dict(book.layout)["sc"] for book in map(get, CODEBOOKS) if book.superblock}


def test_the_lookup_table_words_are_the_codebooks_kvalues():
    """gemv.cu's IQ4NL_i words hold kvalues i..i+3 little-endian, as kernels.codebooks.IQ4_NL_KVALUES lists them."""
    words = dict(re.findall(r"IQ4NL_(\d+) = (0x[0-9A-F]+)u", program.source()))
    assert sorted(map(int, words)) == [0, 4, 8, 12]
    table = b"".join(int(words[str(i)], 16).to_bytes(4, "little") for i in (0, 4, 8, 12))
    assert tuple(int.from_bytes([b], signed=True) for b in table) == IQ4_NL_KVALUES
