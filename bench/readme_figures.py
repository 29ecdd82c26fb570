"""The README's current figures, rendered from the committed results (no GPU needed):

    python bench/readme_figures.py            # rewrites README.md between its figures markers
    python bench/readme_figures.py --check    # exit 1 if the README's block is not what the results give

Per GPU model (slug), from bench/results/kernels-<slug>.json: the kernel benchmark's M = 1 and M = 16 figures of
every codebook and the end-to-end decode step; from corpus/<slug>/ and generated/<slug>/policy.json (the committed
table's policy): the regret of the table's picks and of two baselines against the per-cell oracle on every measured
cell. tests/test_readme_figures.py checks that the committed README holds exactly this block.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gemv_dispatch.dispatch.learn.evaluate import best_single_ratios, mmvq_ratios, policy_ratios, summary
from gemv_dispatch.dispatch.learn.policy import Policy
from gemv_dispatch.dispatch.learn.policy import load as load_policy
from gemv_dispatch.dispatch.learn.train import Measurements
from gemv_dispatch.dispatch.measure.corpus import load as load_corpus

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
LARGE = ((27648, 5120), (5120, 27648), (151936, 4096))  # the anchors of >= 64 MB at 4 bits a weight
SMALL = (4096, 4096)
MID = (14336, 4096)


def kernel_table(data: Mapping, source: str) -> list[str]:
    """The kernel benchmark of one GPU model: a row per codebook, then the end-to-end decode step."""
    at = {(r["codebook"], r["m"], r["n"], r["k"]): r for r in data["rows"]}
    codebooks = list(dict.fromkeys(r["codebook"] for r in data["rows"]))
    lines = [f"Kernel benchmark ([{Path(source).with_suffix('.md').name}]({Path(source).with_suffix('.md')}); the "
             f"fastest candidate per cell, CUDA-graph replays, cold L2; read ceiling "
             f"{data['read_ceiling_gbs']:,.0f} GB/s, measured in the same run):", "",
             "| codebook | M = 1, % of the read ceiling: " + " / ".join(f"{n}×{k}" for n, k in LARGE)
             + f" | M = 1, {SMALL[0]}×{SMALL[1]} | M = 16, {MID[0]}×{MID[1]} | M = 16 vs cuBLAS fp16 |",
             "|---|---|---|---|---|"]
    for cb in codebooks:
        ceiling = " / ".join(f"{100 * at[(cb, 1, n, k)]['of_ceiling']:.0f}" for n, k in LARGE)
        small = at[(cb, 1, *SMALL)]["us"]
        mid = at.get((cb, 16, *MID))
        m16 = f"{mid['us']:.1f} µs | {mid['x_cublas_fp16']:.2f}×" if mid else "— | —"
        lines.append(f"| {cb} | {ceiling} | {small:.2f} µs | {m16} |")
    lines += ["", "One Llama-3.1-8B decode step (32 layers and lm_head, activation quantization included):", "",
              "| codebook, M | ours | cuBLAS fp16 | torch int4 tinygemm |", "|---|---|---|---|"]
    for name, t in data["end_to_end_us"].items():
        lines.append(f"| {name.replace(' M=', ', M = ')} | {t['ours']:,.0f} µs | {t['cublas_fp16']:,.0f} µs "
                     f"({t['cublas_fp16'] / t['ours']:.2f}×) | {t['tinygemm_int4']:,.0f} µs "
                     f"({t['tinygemm_int4'] / t['ours']:.2f}×) |")
    return lines


def dispatch_table(meas: Measurements, policy: Policy, corpus: str, records: int) -> list[str]:
    """Regret against the per-cell oracle (time / fastest time − 1) on every measured cell of a corpus."""
    ms = sorted({key[1] for key in meas.times})
    modes = sorted({key[4] for key in meas.times})
    methods = {"the committed table (policy with overlays)": policy_ratios(policy, meas),
               "best single candidate per codebook": best_single_ratios(meas),
               "llama.cpp-MMVQ-style rule": mmvq_ratios(meas)}
    lines = [f"Dispatch on the committed corpus ({corpus}: {len(meas.times):,} cells of {len(meas.codebooks)} "
             f"codebooks, M ∈ {{{', '.join(map(str, ms))}}}, {' and '.join(modes)} mode, {records:,} records), "
             "regret against the per-cell oracle:", "",
             "| picks | geomean | p95 | max |", "|---|---|---|---|"]
    for name, ratios in methods.items():
        s = summary(ratios.values())
        lines.append(f"| {name} | {s['geomean']:.2f} % | {s['p95']:.2f} % | {s['max']:.2f} % |")
    return lines


def render(root: Path = REPO) -> str:
    """The figures block (without its markers): a section per GPU model with committed results."""
    results = sorted((root / "bench" / "results").glob("kernels-*.json"))
    slugs = sorted({p.stem.removeprefix("kernels-") for p in results}
                   | {p.parent.name for p in (root / "generated").glob("*/policy.json")})
    out: list[str] = []
    for slug in slugs:
        kernels = root / "bench" / "results" / f"kernels-{slug}.json"
        data = json.loads(kernels.read_text()) if kernels.is_file() else None
        name = data["device"]["name"] if data else slug
        out += [f"### {name}", ""]
        if data:
            out += [*kernel_table(data, str(kernels.relative_to(root))), ""]
        policy, folder = root / "generated" / slug / "policy.json", root / "corpus" / slug
        if policy.is_file() and folder.is_dir():
            corpus = load_corpus(folder)
            meas = Measurements.from_corpus(corpus)
            out += [*dispatch_table(meas, load_policy(policy), f"corpus/{slug}", len(corpus.records)), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def replace_block(text: str, block: str) -> str:
    """`text` with the part between the markers replaced by `block`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"the README must hold {BEGIN} once, then {END} once")
    head, rest = text.split(BEGIN)
    return head + BEGIN + "\n" + block + END + rest.split(END, 1)[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's block differs, write nothing")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    new = replace_block(text, render())
    if args.check:
        if new != text:
            print(f"{args.readme}: the figures block is not what the committed results give "
                  "(python bench/readme_figures.py rewrites it)", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
