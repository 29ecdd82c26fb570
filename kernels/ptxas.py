"""Build every kernel instantiation with nvcc for a GPU architecture and read ptxas's resource report.

Used by the CPU compile check (no GPU needed), the certificate's spill_free check and tools/source_ab.py:
registers, stack frame and spills per kernel. `python -m gemv_dispatch.kernels.ptxas` checks every instantiation
the registry may launch (exit 1 if one spills): what a device sweep runs first, since a kernel source that spills
cannot be certified.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import program

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_TEMPLATE = re.compile(r"(gemv_[a-z]+)I((?:L[ib]\d+E)+)E")  # name<int or bool, ...> in Itanium mangling
_TEMPLATE_ARG = re.compile(r"L([ib])(\d+)E")


@dataclass(frozen=True)
class KernelResources:
    name: str  # the source-level name, e.g. "gemv_partial<0, 1, 1, false>", "gemv_mma<0, 2, 1, true, 128>"
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spill_free(self) -> bool:
        """No stack frame and no spills: what the compile check and the certificate require."""
        return not (self.stack_bytes or self.spill_store_bytes or self.spill_load_bytes)

    def describe(self) -> str:
        return (f"{self.name}: {self.stack_bytes} bytes stack frame, {self.spill_store_bytes} bytes spill stores, "
                f"{self.spill_load_bytes} bytes spill loads")


def source_name(mangled: str) -> str:
    match = _TEMPLATE.search(mangled)
    if not match:
        return mangled
    name, args = match.groups()
    spelled = [v if kind == "i" else ("true" if v == "1" else "false") for kind, v in _TEMPLATE_ARG.findall(args)]
    return f"{name}<{', '.join(spelled)}>"


def parse_report(text: str) -> list[KernelResources]:
    """ptxas -v output -> one record per entry function."""
    found: list[KernelResources] = []
    name = frame = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name, frame = source_name(m.group(1)), None
        elif (m := _FRAME.search(line)) and name:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _REGS.search(line)) and name and frame:
            found.append(KernelResources(name, int(m.group(1)), *frame))
            name = None
    return found


@dataclass(frozen=True)
class Build:
    resources: list[KernelResources]
    ptx: str  # the PTX the cubin was assembled from
    cubin: bytes  # the assembled kernels (for a disassembler: tools/sass_per_block.py)


def compile_report(kernel_names: list[str], arch: str = "sm_90", text: str | None = None) -> Build:
    """Compile the instantiations of a kernel source (default: the package's) with nvcc -Xptxas -v, with the
    options CuPy's NVRTC build ends up with."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "instantiations.cu"
        unit.write_text(program.explicit_instantiations(kernel_names, text))
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-Xptxas", "-v", *program.CONTRACT_OPTIONS, *program.FORCED_BY_CUPY,
               "--keep", "--keep-dir", tmp, "-o", str(Path(tmp) / "out.cubin"), str(unit)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"nvcc failed ({done.returncode}):\n{done.stderr[-4000:]}")
        ptx = "".join(p.read_text() for p in Path(tmp).glob("*.ptx"))
        cubin = (Path(tmp) / "out.cubin").read_bytes()
    return Build(parse_report(done.stderr + done.stdout), ptx, cubin)


def error_line(output: str) -> str:
    """The line of a compiler's output that names its error: the first that says so (nvcc prints an excerpt with a
    caret gutter after it), else the last that is not blank."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "failed")


JOBS = min(16, os.cpu_count() or 1)  # parallel nvcc processes: nvcc is single-threaded, ~0.2 s per instantiation


def build_parallel(kernel_names: list[str], arch: str = "sm_90", text: str | None = None,
                   units: int = JOBS) -> list[Build]:
    """compile_report over `units` translation units at once (default JOBS), `kernel_names` dealt round-robin."""
    chunks = [kernel_names[i::units] for i in range(min(units, len(kernel_names)))]
    with ThreadPoolExecutor(len(chunks) or 1) as pool:
        return list(pool.map(lambda chunk: compile_report(chunk, arch, text), chunks))


def compile_parallel(kernel_names: list[str], arch: str = "sm_90", text: str | None = None) -> list[KernelResources]:
    """build_parallel's resources: one record per kernel (helpers once)."""
    return list({r.name: r for b in build_parallel(kernel_names, arch, text) for r in b.resources}.values())


def _arch(text: str) -> str:
    if not re.fullmatch(r"sm_\d+[a-z]?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an architecture such as sm_90")
    return text


def main(argv: list[str] | None = None) -> int:
    from .registry import instantiations

    parser = argparse.ArgumentParser(prog="python -m gemv_dispatch.kernels.ptxas", description=__doc__)
    parser.add_argument("--arch", default="sm_90", type=_arch, help="GPU architecture to compile for (default sm_90)")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("error: nvcc is not on PATH (the CUDA toolkit)", file=sys.stderr)
        return 3
    names = sorted({name for _, name in instantiations()})
    try:
        report = compile_parallel(names, args.arch)
    except RuntimeError as failed:  # nvcc's own error, e.g. an architecture it does not know or a source it refuses
        print(f"error: nvcc failed for {args.arch}: {error_line(str(failed))}", file=sys.stderr)
        return 1
    if offenders := [r for r in report if not r.spill_free]:
        print("\n".join(r.describe() for r in offenders), file=sys.stderr)
        print(f"error: {len(offenders)} of {len(report)} kernels spill ({args.arch})", file=sys.stderr)
        return 1
    print(f"{len(report)} kernels spill-free on {args.arch}, {max(r.registers for r in report)} registers at most")
    return 0


if __name__ == "__main__":
    sys.exit(main())
