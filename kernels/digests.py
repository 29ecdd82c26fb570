"""Code digests per kernel instantiation and per launch, so that a kernel change makes stale only the timings of
the candidates whose code changed (DESIGN §5).

An instantiation's digest is the SHA-256 of its PTX entry for the reference architecture (REFERENCE_ARCH), with
what depends only on its place in a translation unit normalized away (basic-block label and local depot numbers),
together with the module-level declarations it references. PTX also depends on the translation unit: nvcc
declares a function's `__shared__` array inside the one kernel of the unit that uses it ("demoted") and at
module level when several do, so the digests are taken from one fixed build, the registry's instantiations in
sorted order dealt round-robin into UNITS units (`canonical_builds`), never from however many units a machine's
cores suggest. A launch's digest (`launch_digest`) adds the launch
facts the registry computes for a cell: kernel, grid, block, dynamic shared memory, workspace. A corpus record
carries the launch digest of what it timed; training uses a record only while that digest is still current.

Computing PTX needs nvcc, which CPU machines lack, so the instantiation digests are committed
(kernels/cuda/instantiations.json) with the whole-source digest and the nvcc release they were made with;
`python -m gemv_dispatch.kernels.digests` rewrites the file after a kernel change and `--check` compares it with
a fresh build (the compile test does the same). A table made for another source is refused, never guessed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from functools import cache

from . import program
from .errors import EnvironmentProblem
from .ptxas import Build, build_parallel, source_name
from .registry import Candidate, instantiations

REFERENCE_ARCH = "sm_90"
UNITS = 2  # translation units of the canonical build: the committed digests are defined on this partition
TABLE_PATH = program.SOURCE_PATH.with_name("instantiations.json")
FORMAT = "gemv-dispatch-instantiations/1"
DIGEST_HEX = 16  # characters of a launch digest kept in a record: 64 bits

_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.M)
_DECLARATION = re.compile(r"^(?:\.visible |\.weak |\.extern )?\.(?:func|global|const)\b[^;{]*?(\w+)\s*[(\[;{]", re.M)
_POSITIONAL = ((re.compile(r"\$L__BB\d+_"), "$L__BB_"), (re.compile(r"__local_depot\d+"), "__local_depot"))


def _block_end(ptx: str, start: int) -> int:
    """End of the definition that begins at `start`: a function's body closes with a brace at a line start, a
    variable (initializer braces included) or a prototype with its semicolon."""
    semicolon = ptx.find(";\n", start)
    if ptx.startswith((".visible .entry", ".visible .func", ".func", ".weak .func"), start):
        body = ptx.find("\n{", start)
        if body != -1 and (semicolon == -1 or body < semicolon):
            return ptx.find("\n}\n", body) + 3
    return semicolon + 2


def entry_digests(ptx: str) -> dict[str, str]:
    """{source-level kernel name: SHA-256} for every entry of a PTX text (kernels.ptxas.source_name spells the
    names as the registry does)."""
    declarations = {m.group(1): ptx[m.start():_block_end(ptx, m.start())] for m in _DECLARATION.finditer(ptx)}
    found = {}
    for m in _ENTRY.finditer(ptx):
        text = ptx[m.start():_block_end(ptx, m.start())]
        seen, pending = set(), [text]
        while pending:  # the declarations the entry reaches, transitively
            body = pending.pop()
            for symbol, declaration in declarations.items():
                if symbol not in seen and re.search(rf"\b{re.escape(symbol)}\b", body):
                    seen.add(symbol)
                    pending.append(declaration)
        code = "\n".join([text, *(declarations[s] for s in sorted(seen))])
        for pattern, spelled in _POSITIONAL:
            code = pattern.sub(spelled, code)
        found[source_name(m.group(1))] = hashlib.sha256(code.encode()).hexdigest()
    return found


def nvcc_release() -> str:
    """nvcc's release line (e.g. "release 13.0, V13.0.88"): PTX text depends on it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise EnvironmentProblem("nvcc is not on PATH (the CUDA toolkit): it is needed to digest kernel code")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release [^\n]+", out)
    return match.group(0).strip() if match else out.strip().splitlines()[-1]


def canonical_builds() -> list[Build]:
    """The build the digests are defined on: every instantiation of the registry, sorted by name and dealt
    round-robin into UNITS translation units (compiled in parallel), for REFERENCE_ARCH."""
    return build_parallel(sorted({name for _, name in instantiations()}), REFERENCE_ARCH, units=UNITS)


def build(builds: Iterable[Build] | None = None) -> dict[str, str]:
    """Instantiation digests of `builds` (default: a fresh canonical_builds())."""
    names = sorted({name for _, name in instantiations()})
    digests: dict[str, str] = {}
    for part in canonical_builds() if builds is None else builds:
        digests |= entry_digests(part.ptx)
    missing = sorted(set(names) - set(digests))
    if missing:
        raise RuntimeError(f"no PTX entry for {len(missing)} instantiations, e.g. {missing[0]}")
    return {name: digests[name] for name in names}


def table_bytes(digests: Mapping[str, str], release: str) -> bytes:
    data = {"format": FORMAT, "source": program.digest(), "arch": REFERENCE_ARCH, "nvcc": release,
            "instantiations": dict(sorted(digests.items()))}
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()


@cache
def table() -> Mapping[str, str]:
    """The committed instantiation digests; EnvironmentProblem when they were made for another kernel source
    (the file must be rewritten with the command the message names)."""
    try:
        data = json.loads(TABLE_PATH.read_bytes())
    except (OSError, ValueError) as err:
        raise EnvironmentProblem(f"{TABLE_PATH}: cannot read the kernel code digests ({err})") from None
    if data.get("format") != FORMAT or data.get("source") != program.digest():
        raise EnvironmentProblem(f"{TABLE_PATH} was made for kernel source {str(data.get('source'))[:12]}, this is "
                                 f"{program.digest()[:12]}: run `python -m gemv_dispatch.kernels.digests` (nvcc)")
    return data["instantiations"]


def launch_facts(candidate: Candidate, codebook: str, m: int, n: int, k: int) -> tuple[object, ...]:
    """What a launch of `candidate` runs for a cell: the candidate, its kernel and that kernel's code digest, and
    the registry's launch facts (grid, block, dynamic shared memory, workspace bytes)."""
    name = candidate.kernel_name(codebook, m)
    grid, block = candidate.launch_geometry(m, n, k)
    return (candidate.id, name, table()[name], grid, block, candidate.shared_bytes(m, k, codebook),
            candidate.workspace_bytes(m, n, k))


# Shapes on which `code_digest` records every candidate's launch facts, for every codebook and M of the served set:
# small and large N, short and long K, a super-block multiple throughout.
PROBE_SHAPES = ((1, 256), (1000, 4096), (4096, 4096), (27648, 5120), (5120, 27648), (151936, 4096))
PROBE_MS = (1, 2, 4, 8, 16, 31)


@cache
def code_digest() -> str:
    """SHA-256 of what the kernels run: every instantiation's code and the launch facts of every candidate on
    the probe shapes. A policy and its certificate bind it, so a table is refused once the code it was timed
    and checked with changed, and stays valid across edits that change no code (comments, other files)."""
    from .codebooks import CODEBOOKS
    from .registry import CANDIDATES

    launches = [launch_facts(c, cb, m, n, k) for cb in CODEBOOKS for m in PROBE_MS for n, k in PROBE_SHAPES
                for c in CANDIDATES if c.valid(m, n, k)]
    return hashlib.sha256(repr((sorted(table().items()), launches)).encode()).hexdigest()


def launch_digest(candidate: Candidate, codebook: str, m: int, n: int, k: int) -> str:
    """The digest a corpus record of `candidate` in cell (codebook, M, N, K) carries (DIGEST_HEX hex digits)."""
    return hashlib.sha256(repr(launch_facts(candidate, codebook, m, n, k)).encode()).hexdigest()[:DIGEST_HEX]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemv_dispatch.kernels.digests", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare the committed file with a fresh build; "
                        "exit 1 when they differ")
    args = parser.parse_args(argv)
    try:
        release = nvcc_release()
        fresh = table_bytes(build(), release)
    except EnvironmentProblem as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    if args.check:
        same = TABLE_PATH.is_file() and TABLE_PATH.read_bytes() == fresh
        print(f"{TABLE_PATH}: {'current' if same else 'STALE: rerun without --check'}")
        return 0 if same else 1
    TABLE_PATH.write_bytes(fresh)
    print(f"{TABLE_PATH}: {len(json.loads(fresh)['instantiations'])} instantiations, nvcc {release}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
