"""`gemv-dispatch tune`, the main job: sweep -> train -> certify -> generate -> install, as one transaction.

Each stage prints a progress line; the first failure stops the run and nothing is installed (a certificate that
records a failed check stops it before anything is written to generated/). Without a GPU and without
`--replay`, `tune` runs the embedded default: it replays the committed corpus/nvidia-h200/ into a temp folder,
trains, certifies on the emulator, renders, and checks that the module is byte-identical to the committed
generated/nvidia-h200/ (the table a GPU run produced from the same corpus): the pipeline is reproducible.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kernels.errors import InputError
from .common.gpu import current_gpu
from .common.paths import data_dir
from .learn.policy import Policy
from .measure.corpus import Corpus, load
from .measure.sweep import SweepPlan, Timer, run_sweep
from .serve import install
from .table import bundle, certify, generate

POLICY = bundle.POLICY


class StageFailed(InputError):
    """A stage's result forbids going on (a failed certificate); nothing was installed."""


@dataclass(frozen=True)
class TuneResult:
    corpus: Path
    cells: int
    policy: Policy
    regret: dict[str, Any]  # geomean / p95 / max of the policy's time over the per-cell best (evaluate.summary)
    # the same for the best launch of the table's own identity (evaluate's invariant oracle takes the profile's
    # best identity instead; the two differ where an identity within the noise band kept the tree's pick)
    price_of_invariance: dict[str, Any]
    certificate: dict[str, Any]
    generated: Path | None  # None: rendered into a temp folder and compared (the embedded default)
    installed: install.Installed | None
    reproduced: bool | None  # embedded default: module and header equal the committed ones (None: nothing to compare)
    mismatch: str = ""  # when not reproduced: where the regenerated policy departs from the committed one
    committed: Path | None = None  # embedded default: the committed table it was compared with
    replayed: Path | None = None  # the replay source, when the corpus was a temporary folder removed at the end

    def lines(self) -> list[str]:
        """The final summary, one fact a line."""
        cert = self.certificate
        checks = ", ".join(f"{name} {c['result']}" for name, c in cert["checks"].items())
        where = f"a replay of {self.replayed} in a temporary folder (removed)" if self.replayed else self.corpus
        out = [
            f"corpus: {where} ({self.cells} cells)",
            f"policy: {len(self.policy.identity_overlays)} identity and {len(self.policy.launch_overlays)} launch "
            f"overlays; {_quality_text(self.regret, self.price_of_invariance)}",
            f"certificate: {'passed' if cert['passed'] else 'FAILED'} at {cert['level']} level on "
            f"{cert['device']['name']}, {cert['keys']} keys, {cert['seconds']} s ({checks})",
            f"generated: {self.generated or 'a temporary folder (removed), compared below'}",
        ]
        if self.installed is not None:
            out.append(f"installed: {self.installed.folder} version {self.installed.version} ({self.installed.note})")
        else:
            out.append("installed: nothing (the embedded default only verifies reproducibility)")
        if self.reproduced is not None:
            out.append(f"reproducible: {'yes' if self.reproduced else 'NO'}, the regenerated module is "
                       f"{'byte-identical to' if self.reproduced else 'different from'} "
                       f"{self.committed}" + (f": {self.mismatch}" if self.mismatch else ""))
        return out


def _pct(summary: Mapping[str, Any]) -> str:
    return "geomean {geomean:.2f} %, p95 {p95:.2f} %, max {max:.2f} %".format(**summary)


def _quality_text(regret: Mapping[str, Any], price: Mapping[str, Any]) -> str:
    """The policy's regret and the price of invariance of the table's own identities, as the log and summary say."""
    return f"regret {_pct(regret)}; price of invariance (the table's identities) {_pct(price)}"


@contextmanager
def _stage(name: str, log: Callable[[str], None]) -> Iterator[None]:
    start = time.monotonic()
    log(f"[{name}] ...")
    yield
    log(f"[{name}] done in {time.monotonic() - start:.1f} s")


def replay_plans(source: Corpus) -> list[SweepPlan]:
    """Sweep plans whose cells together are exactly a corpus's cells. A plan is a full codebook x M x mode x
    shape grid, a corpus need not be (a sweep cut short, M values added for some shapes): per codebook and mode,
    the M values measured on the same shapes share one plan."""
    groups: dict[tuple[str, str], dict[int, set[tuple[int, int]]]] = {}
    for c in source.cells():
        groups.setdefault((c.codebook, c.mode), {}).setdefault(c.m, set()).add((c.n, c.k))
    if not groups:
        raise InputError(f"{source.folder}: the corpus holds no cells to replay")
    plans = []
    for (codebook, mode), by_m in sorted(groups.items()):
        shared: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for m, shapes in sorted(by_m.items()):
            shared.setdefault(tuple(sorted(shapes)), []).append(m)
        plans += [SweepPlan((codebook,), tuple(ms), (mode,), shapes) for shapes, ms in sorted(shared.items())]
    return plans


def _quality(policy: Policy, corpus: Corpus) -> tuple[dict[str, Any], dict[str, Any]]:
    """(regret, price of invariance) summaries of the policy over the corpus's measured cells."""
    from .learn.evaluate import invariant_ratios, policy_ratios, summary
    from .learn.train import Measurements

    meas = Measurements.from_corpus(corpus)
    chosen = {geo: policy.identity(*geo)[0] for geo in meas.geometries()}
    return summary(policy_ratios(policy, meas).values()), summary(invariant_ratios(meas, chosen).values())


def train_policy(folder: Path, log: Callable[[str], None] = certify._log) -> Policy:
    """The policy `train` makes of a corpus folder."""
    from .learn.train import train

    policy, notes = train(load(folder))
    for note in notes:
        log(f"  warning: {note}")
    return policy


def tune(plans: Sequence[SweepPlan], corpus_root: Path, timer: Timer, runner: certify.Runner, generated_root: Path,
         tables: Path | None, *, install_table: bool = True, seed: int = 0,
         gpu: Callable[[], dict[str, str] | None] = current_gpu,
         log: Callable[[str], None] = certify._log) -> TuneResult:
    """Run every stage; StageFailed (nothing installed) when certification fails. `gpu` reports this machine's
    GPU to `install` (tests substitute it)."""
    with _stage("sweep", log):
        # Each plan compacts what it staged, so the next one starts from a clean, listed corpus.
        swept = [run_sweep(plan, corpus_root, timer) for plan in plans]
        folder = Path(swept[0].folders[0])
        log(f"  {sum(s.cells for s in swept)} cells: {sum(s.timed for s in swept)} timed, "
            f"{sum(s.skipped for s in swept)} already in {folder}")
    with _stage("train", log):
        corpus = load(folder)
        policy = train_policy(folder, log)
        regret, price = _quality(policy, corpus)
        log(f"  {_quality_text(regret, price)}")
    with _stage("certify", log), runner:
        rendered = generate.render(policy)
        cert = certify.certify(policy, rendered, runner, seed=seed, corpus_folder=folder, log=log)
    if not cert["passed"]:
        failed = [f"{n}: {c['failures'][:1] or c['result']}" for n, c in cert["checks"].items()
                  if c["result"] == "fail"]
        raise StageFailed(f"certification failed, nothing installed: {'; '.join(failed)}")
    with _stage("generate", log):
        out = generate.write(generated_root / cert["gpu_slug"], rendered, cert, policy)
        log(f"  {out}")
    installed = None
    if install_table:
        with _stage("install", log):
            installed = install.install(out, tables, gpu)
            log(f"  {installed.folder} version {installed.version}: {installed.note}")
    return TuneResult(folder, len(corpus.cells()), policy, regret, price, cert, out, installed, None)


def committed_models() -> list[str]:
    """The GPU models (slugs) with a committed corpus: what the embedded default reproduces, each in turn."""
    root = data_dir() / "corpus"
    return sorted(p.parent.name for p in root.glob("*/manifest.json"))


def embedded_default(slug: str, log: Callable[[str], None] = certify._log, seed: int = 0) -> TuneResult:
    """The CPU run for one committed GPU model: replay its corpus, train, certify on the emulator, render,
    compare with its committed table. Nothing is installed."""
    from .measure.sweep import ReplayTimer

    source = load(data_dir() / "corpus" / slug)
    committed = data_dir() / "generated" / slug
    with tempfile.TemporaryDirectory(prefix="gemv-dispatch-tune-") as tmp:
        result = tune(replay_plans(source), Path(tmp) / "corpus", ReplayTimer(source),
                      certify.EmulatorRunner(seed), Path(tmp) / "generated", None, install_table=False, seed=seed,
                      log=log)
        if not (committed / bundle.MODULE).is_file():
            log(f"reproducible: cannot say, {committed} holds no table yet (it is committed after a GPU run)")
            reproduced = None
        else:
            reproduced = all((committed / name).read_bytes() == (result.generated / name).read_bytes()
                             for name in (bundle.MODULE, bundle.HEADER))
        mismatch = "" if reproduced in (True, None) else policy_mismatch(committed / POLICY, result.policy)
        return TuneResult(source.folder, result.cells, result.policy, result.regret, result.price_of_invariance,
                          result.certificate, None, None, reproduced, mismatch, committed)


def policy_mismatch(committed: Path, policy: Policy) -> str:
    """Why a regenerated module differs, in one phrase: the policy sections that differ from the committed
    policy.json (with both scikit-learn versions where they differ), or that the policies agree, so the
    rendering differs."""
    if not committed.is_file():
        return f"no {committed.name} beside it to tell whether the policy or the rendering differs"
    try:
        theirs = json.loads(committed.read_bytes())
    except ValueError:
        theirs = None
    if not isinstance(theirs, dict) or not isinstance(theirs.get("source", {}), dict):
        return f"its {committed.name} is no policy, so whether the policy or the rendering differs is unknown"
    ours = json.loads(policy.to_bytes())
    sections = _differing(theirs, ours)
    if not sections:
        return "the policy is the same, so the rendering differs (generate's template or the tool version)"
    versions = theirs.get("source", {}).get("sklearn_version"), ours["source"].get("sklearn_version")
    trained = f" (trained with scikit-learn {versions[0]}, here {versions[1]})" if versions[0] != versions[1] else ""
    return f"the policy differs in {', '.join(sections)}{trained}"


_SECTIONS_BY_PART = ("fallback", "options", "source")  # named part by part; the rest (overlays, shapes) whole


def _differing(theirs: Mapping[str, Any], ours: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if key == "digest" or a == b:
            continue
        if not prefix and key in _SECTIONS_BY_PART and isinstance(a, dict) and isinstance(b, dict):
            out += _differing(a, b, f"{key}.")
        else:
            out.append(prefix + key)
    return out
