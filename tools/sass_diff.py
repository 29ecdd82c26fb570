"""Which kernel instantiations' sm_90 SASS differ between two kernel sources (no GPU needed).

    python tools/sass_diff.py OLD.cu [NEW.cu] [--cuobjdump PATH]     # NEW: the package's source

Every instantiation the registry launches (registry.instantiations) is built from both sources as the compile
check builds it (sass_per_block.disassemble) and compared instruction by instruction, addresses left out. A source
edit whose SASS is the same everywhere (a comment, a rename, a helper that inlines to the same code) changes no
launch's timing, only the kernel digest: its corpus is the old one's, re-swept only because the digest moved.
Exit status 0 when every instantiation is the same, 1 when some differ (each named), 2 or 3 on a usage or
environment error.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from gemv_dispatch.kernels.registry import instantiations
from sass_per_block import build_error, disassemble, functions


def instructions(dump: str) -> dict[str, list[str]]:
    """cuobjdump -sass text -> mangled function name -> its instructions, without addresses."""
    return {name: [text for _, text in code] for name, code in functions(dump).items()}


def differing(old: dict[str, list[str]], new: dict[str, list[str]]) -> list[str]:
    """The functions whose instructions differ, or that only one side has, sorted."""
    return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="a kernel source")
    parser.add_argument("new", type=Path, nargs="?", help="another (default: the package's)")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump [default: on PATH]")
    args = parser.parse_args(argv)
    missing = [p for p in (args.old, args.new) if p is not None and not p.is_file()]
    if missing:
        print(f"error: no file {missing[0]}", file=sys.stderr)
        return 2
    if not args.cuobjdump or shutil.which("nvcc") is None:
        print("error: cuobjdump or nvcc is not on PATH", file=sys.stderr)
        return 3
    names = sorted({name for _, name in instantiations()})
    try:
        old = instructions(disassemble(names, args.cuobjdump, args.old.read_text()))
        new = instructions(disassemble(names, args.cuobjdump, args.new.read_text() if args.new else None))
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as failed:
        print(f"error: {build_error(failed)}", file=sys.stderr)
        return 2 if isinstance(failed, ValueError) else 1  # a file that is no kernel source: a usage error
    changed = differing(old, new)
    print(f"{len(old.keys() | new.keys())} functions, {len(changed)} with different SASS")
    for name in changed:
        print(f"  {name}: {len(old.get(name, []))} -> {len(new.get(name, []))} instructions")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
