"""Instructions per weight block in the main loop of dp4a-engine kernels, from their sm_90 SASS (no GPU needed).

    python bench/sass_per_block.py "gemv_partial<5, 1, 1, false>" ["gemv_partial<7, 2, 1, false>" ...]
        [--source OLD.cu ...] [--cuobjdump PATH] [--json]

kernels.ptxas.compile_report builds the instantiations (the compile check's nvcc command) for the package's kernel
source and each --source; cuobjdump -sass disassembles them. cuobjdump is not part of every CUDA install: `pip
download nvidia-cuda-cuobjdump` brings it (bin/cuobjdump in the wheel). The main loop is the innermost backward
branch holding at least one block's dp4a instructions (8 IDP per 32-element block); blocks per iteration = its
IDP count / 8. These are static counts: what the loop issues per block, not how long it waits.
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
from pathlib import Path

from gemv_dispatch.kernels import ptxas
from gemv_dispatch.kernels.registry import instantiations

DP4A_PER_BLOCK = 8  # 32 int8 products, 4 per IDP
_FUNCTION = re.compile(r"\s+Function : (\S+)")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA (0x[0-9a-f]+)")


@dataclass(frozen=True)
class LoopCount:
    kernel: str  # source-level name, e.g. "gemv_partial<5, 1, 1, false>"
    instructions: int  # in the main loop's body
    blocks: float  # weight blocks per iteration
    ops: dict[str, int]  # opcode (without modifiers or predicate) -> count in the body

    @property
    def per_block(self) -> float:
        return self.instructions / self.blocks


def opcode(instruction: str) -> str:
    """'@!P0 LDG.E.128.CONSTANT R4, ...' -> 'LDG'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def functions(dump: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> mangled function name -> [(address, instruction)]."""
    found: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in dump.splitlines():
        if m := _FUNCTION.match(line):
            current = found.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append((int(m.group(1), 16), m.group(2)))
    return found


def main_loop(code: list[tuple[int, str]]) -> list[str] | None:
    """The innermost backward-branch loop with at least one block's dp4a instructions; None if there is none."""
    best: list[str] | None = None
    for address, instruction in code:
        m = _BRANCH.search(instruction)
        if m and int(m.group(1), 16) < address:
            body = [text for at, text in code if int(m.group(1), 16) <= at <= address]
            if sum(opcode(t) == "IDP" for t in body) >= DP4A_PER_BLOCK and (best is None or len(body) < len(best)):
                best = body
    return best


def count(dump: str) -> list[LoopCount]:
    counts = []
    for name, code in functions(dump).items():
        if (body := main_loop(code)) is not None:
            ops = collections.Counter(opcode(t) for t in body)
            counts.append(LoopCount(ptxas.source_name(name), len(body), ops["IDP"] / DP4A_PER_BLOCK,
                                    dict(ops.most_common())))
    return sorted(counts, key=lambda c: c.kernel)


def disassemble(names: list[str], cuobjdump: str, text: str | None = None) -> str:
    """SASS of the instantiations `names` of a kernel source (default: the package's), built for sm_90 as the
    compile check builds them (kernels.ptxas.compile_report)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "unit.cubin"
        cubin.write_bytes(ptxas.compile_report(names, "sm_90", text).cubin)
        return subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout


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
    try:
        results = {tag: count(disassemble(args.kernels, args.cuobjdump, text)) for tag, text in sources.items()}
    except (RuntimeError, subprocess.CalledProcessError) as failed:  # nvcc (compile_report) or cuobjdump
        text = failed.stderr if isinstance(failed, subprocess.CalledProcessError) else str(failed)
        print(f"error: {([line for line in text.splitlines() if line.strip()] or ['failed'])[-1]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({tag: [asdict(c) | {"per_block": c.per_block} for c in cs] for tag, cs in results.items()}))
        return 0
    codebook = {name: cb for cb, name in instantiations()}
    print(f"{'source':28} {'kernel':32} {'codebook':8} {'loop':>5} {'blocks':>6} {'/block':>7}  top opcodes")
    for tag, cs in results.items():
        for c in cs:
            top = ", ".join(f"{op} {n}" for op, n in list(c.ops.items())[:6])
            print(f"{tag[-28:]:28} {c.kernel:32} {codebook.get(c.kernel, '?'):8} {c.instructions:5} {c.blocks:6.1f} "
                  f"{c.per_block:7.1f}  {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
