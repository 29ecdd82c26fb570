"""Instructions per unit of work in the main loop of GEMV kernels, from their sm_90 SASS (no GPU needed): per
weight block for the dp4a engine, per mma for the tensor-core engine.

    python tools/sass_per_block.py "gemv_partial<5, 1, 1, false>" ["gemv_mma<0, 2, 1, false, 128>" ...]
        [--source OLD.cu ...] [--cuobjdump PATH] [--json]

kernels.ptxas.compile_report builds the instantiations (the compile check's nvcc command) for the package's kernel
source and each --source; cuobjdump -sass disassembles them. cuobjdump is not part of every CUDA install: `pip
download nvidia-cuda-cuobjdump` brings it (bin/cuobjdump in the wheel). The main loop is the innermost backward
branch holding an mma (IMMA) or at least one block's dp4a instructions (8 IDP of weights and activations per
32-element block; an IDP by a constant, a uniform register or an immediate, sums bytes and is no block's); its units
are its mmas of work, else its blocks. Where a source takes a lookup codebook's payload word as two addends (Addends:
gemv.cu's iq4nl_addends in the staged kernels, or in every one-row dp4a kernel where its SELECTOR_ORDER says MT == 1;
RING_ADDENDS in the ring), each addend has its own dp4a or mma, so a block is 16 IDP and an mma of work 2 IMMA; where
Q5_K's one-row kernels take a pair's odd block as two addends (gemv.cu's IN_PLACE), a pair is 24 IDP. The
ring's loop holds its three chunk variants, so its figure is their mean. A dp4a loop's figure is also given per byte
of weights (`/byte`: a block is bits_per_weight * 4 bytes of its codebook), which the M = 1 launches' share of a
streaming read follows (lab/journal.md, row 50). These are static counts: what the loop issues per unit, not how
long it waits.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from gemv_dispatch.kernels import program, ptxas
from gemv_dispatch.kernels.codebooks import get
from gemv_dispatch.kernels.errors import BLOCK
from gemv_dispatch.kernels.registry import instantiations

DP4A_PER_BLOCK = 8  # 32 int8 products, 4 per IDP
_FUNCTION = re.compile(r"\s+Function : (\S+)")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA (0x[0-9a-f]+)")
_CONSTANT_SOURCE = re.compile(r",\s*(UR\d+|0x[0-9a-f]+|c\[)")  # a uniform register, an immediate, a constant bank


@dataclass(frozen=True)
class LoopCount:
    kernel: str  # source-level name, e.g. "gemv_partial<5, 1, 1, false>"
    instructions: int  # in the main loop's body
    units: float  # per iteration: mma instructions, or weight blocks of dp4a instructions
    unit: str  # "mma" or "block"
    ops: dict[str, int]  # opcode (without modifiers or predicate) -> count in the body

    @property
    def per_unit(self) -> float:
        return self.instructions / self.units


def opcode(instruction: str) -> str:
    """'@!P0 LDG.E.128.CONSTANT R4, ...' -> 'LDG'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def functions(dump: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> mangled function name -> [(address, instruction)]; a function listed again (a helper
    kernel in each of several cubins, disassemble) keeps its first listing."""
    found: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in dump.splitlines():
        if m := _FUNCTION.match(line):
            current = None if m.group(1) in found else found.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append((int(m.group(1), 16), m.group(2)))
    return found


@cache
def codebooks() -> dict[str, str]:
    """The codebook of every kernel instantiation, by its source-level name (the registry's spelling)."""
    return {name: cb for cb, name in instantiations()}


def per_weight_byte(loop: LoopCount) -> float | None:
    """A dp4a loop's instructions per byte of weights it reads (a unit is one column's 32-weight block of its
    codebook: bits_per_weight * 4 bytes, scales included); None for an mma loop or a kernel of no codebook."""
    codebook = codebooks().get(loop.kernel)
    if loop.unit != "block" or codebook is None:
        return None
    return loop.per_unit / (get(codebook).bits_per_weight * BLOCK / 8)


@dataclass(frozen=True)
class Addends:
    """Where a kernel source takes a lookup codebook's payload word as two addends, each its own dp4a or mma, and
    where Q5_K's odd blocks are two addends (nibbles and fifth bits in place) at one row."""

    staged: bool = False  # the staged dp4a kernels (gemv.cu's iq4nl_addends)
    one_row: bool = False  # the unstaged dp4a kernels of one row too (SELECTOR_ORDER's condition: MT == 1)
    ring: bool = False  # the tensor-core ring (RING_ADDENDS)
    fifth_bits: bool = False  # Q5_K's one-row dp4a kernels: 8 + 16 IDP a pair of blocks (gemv.cu's IN_PLACE)

    @classmethod
    def of(cls, source: str) -> Addends:
        split = "iq4nl_addends(" in source
        order = re.search(r"constexpr bool SELECTOR_ORDER = ([^;]*);", source)
        in_place = re.search(r"constexpr bool IN_PLACE = ([^;]*);", source)
        fifth = in_place is not None and "CB == Q5_K && MT == 1" in in_place.group(1) and "Q5_K && IN_PLACE" in source
        return cls(split, split and order is not None and "MT == 1" in order.group(1), "RING_ADDENDS" in source, fifth)

    def per_unit(self, kernel: str) -> tuple[int, int]:
        """(IDP of weights and activations per block, IMMA per mma of work) of a kernel named as in source
        ("gemv_partial<5, 1, 1, false>": a dp4a kernel's third argument its rows); plain for a kernel the registry
        does not launch (quantize_activations)."""
        if kernel not in codebooks():
            return DP4A_PER_BLOCK, 1
        name, _, arguments = kernel.partition("<")
        codebook = codebooks()[kernel]
        lookup = get(codebook).table
        rows_one = name == "gemv_staged" or (name == "gemv_partial" and arguments.split(",")[2].strip() == "1")
        if self.fifth_bits and codebook == "Q5_K" and rows_one:
            return DP4A_PER_BLOCK * 3 // 2, 1
        dp4a = lookup and ((self.staged and name == "gemv_staged") or (self.one_row and rows_one))
        return DP4A_PER_BLOCK * (1 + dp4a), 1 + (lookup and self.ring and name == "gemv_mma")


def work(ops: collections.Counter[str], products: int, per_block: int = DP4A_PER_BLOCK,
         per_mma: int = 1) -> tuple[float, str] | None:
    """(units, unit) of a loop body's opcode counts and its IDP of weights and activations (`products`): its mmas of
    work (`per_mma` IMMA each), else its whole blocks of dp4a (`per_block` products each); None if it holds
    neither."""
    if ops["IMMA"]:
        return ops["IMMA"] / per_mma, "mma"
    return (products / per_block, "block") if products >= per_block else None


def main_loop(name: str, code: list[tuple[int, str]], addends: Addends = Addends()) -> LoopCount | None:
    """The innermost backward-branch loop of function `name` that does work (an mma, or a block's dp4a), counted;
    None if it has none."""
    best: LoopCount | None = None
    kernel = ptxas.source_name(name)
    for address, instruction in code:
        m = _BRANCH.search(instruction)
        if m and int(m.group(1), 16) < address:
            body = [text for at, text in code if int(m.group(1), 16) <= at <= address]
            ops = collections.Counter(map(opcode, body))
            products = sum(opcode(text) == "IDP" and not _CONSTANT_SOURCE.search(text) for text in body)
            found = work(ops, products, *addends.per_unit(kernel))
            if found and (best is None or len(body) < best.instructions):
                best = LoopCount(kernel, len(body), *found, dict(ops.most_common()))
    return best


def count(dump: str, addends: Addends = Addends()) -> list[LoopCount]:
    """The main loop of every function in a cuobjdump -sass listing that has one, by kernel name, of a source whose
    `addends` are these."""
    found = (main_loop(name, code, addends) for name, code in functions(dump).items())
    return sorted((c for c in found if c is not None), key=lambda c: c.kernel)


def build_error(failed: RuntimeError | ValueError | subprocess.CalledProcessError) -> str:
    """The line that names why disassemble failed: nvcc's (kernels.ptxas.compile_report), cuobjdump's, or a source
    without the GEMV kernels (kernels.program)."""
    return ptxas.error_line(failed.stderr if isinstance(failed, subprocess.CalledProcessError) else str(failed))


def disassemble(names: list[str], cuobjdump: str, text: str | None = None) -> str:
    """SASS of the instantiations `names` of a kernel source (default: the package's), built for sm_90 as the
    compile check builds them (kernels.ptxas.build_parallel: several translation units at once)."""
    dumps = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, build in enumerate(ptxas.build_parallel(names, "sm_90", text)):
            cubin = Path(tmp) / f"unit{i}.cubin"
            cubin.write_bytes(build.cubin)
            dumps.append(subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                                        text=True).stdout)
    return "".join(dumps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernels", nargs="+", help='instantiations, e.g. "gemv_partial<5, 1, 1, false>"')
    parser.add_argument("--source", action="append", type=Path, default=[], help="another kernel source to count")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump [default: on PATH]")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    missing = [p for p in args.source if not p.is_file()]
    if missing or not args.cuobjdump or shutil.which("nvcc") is None:
        print(f"error: {f'no file {missing[0]}' if missing else 'cuobjdump or nvcc is not on PATH'}", file=sys.stderr)
        return 2 if missing else 3
    sources = {"package": None, **{str(p): p.read_text() for p in args.source}}
    package = program.source()
    try:
        results = {tag: count(disassemble(args.kernels, args.cuobjdump, text), Addends.of(text or package))
                   for tag, text in sources.items()}
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as failed:
        print(f"error: {build_error(failed)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({tag: [asdict(c) | {"per_unit": c.per_unit, "per_weight_byte": per_weight_byte(c)} for c in cs]
                          for tag, cs in results.items()}))
        return 0
    codebook = codebooks()
    print(f"{'source':28} {'kernel':32} {'codebook':8} {'loop':>5} {'units':>6} {'/unit':>7} {'unit':5} {'/byte':>5}"
          "  top opcodes")
    for tag, cs in results.items():
        for c in cs:
            top = ", ".join(f"{op} {n}" for op, n in list(c.ops.items())[:6])
            per_byte = per_weight_byte(c)
            print(f"{tag[-28:]:28} {c.kernel:32} {codebook.get(c.kernel, '?'):8} {c.instructions:5} {c.units:6.1f} "
                  f"{c.per_unit:7.1f} {c.unit:5} {'' if per_byte is None else f'{per_byte:.2f}':>5}  {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
