"""Command-line entry point `gemv-dispatch`: one click group, one command per pipeline stage."""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..kernels.errors import EnvironmentProblem, InputError
from .common.contract import MODES
from .measure.sweep import DEFAULT_CODEBOOKS, DEFAULT_MODES, DEFAULT_MS


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One line on stderr, never a traceback: exit 2 for a caller mistake (bad input, a missing file), exit 3
    for a problem of the environment (no CuPy or GPU, a read-only folder, a full disk)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (InputError, FileNotFoundError) as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except (IsADirectoryError, NotADirectoryError) as err:  # a folder given for a file, or the reverse
            where = f"{err.filename}: " if err.filename else ""
            kind = ("a folder where a file was expected" if isinstance(err, IsADirectoryError) else
                    "a file stands where this path needs a folder")
            click.echo(f"error: {where}{kind}", err=True)
            sys.exit(2)
        except EnvironmentProblem as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(3)
        except OSError as err:  # names the path and the cause: "[Errno 28] No space left on device: 'x'"
            where = f"{err.filename}: " if err.filename else ""
            click.echo(f"error: {where}{err.strerror or err}", err=True)
            sys.exit(3)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gemv-dispatch")
def main() -> None:
    """Time quantized GEMV kernels on a GPU, learn and certify a dispatch table, install it."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def info(as_json: bool) -> None:
    """Show versions, the visible CUDA device (name, SMs, L2), nvcc and the supported codebooks."""
    from .common.environment import describe

    report = describe()
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    for key, value in report.items():
        click.echo(f"{key:>14}: {value}")


@main.command("paths")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def paths_command(as_json: bool) -> None:
    """Where this installation keeps things: the shipped shape inventories, corpora and tables, the work folder
    (where sweep and generate write), the installed tables (install, the runtime) and the sweep locks, each with
    the environment variable that moves it. A GPU model name such as nvidia-h200 stands for its corpus or table
    folder wherever a command takes one: looked up in the work folder, then in the shipped data."""
    from .common import paths

    report = paths.describe()
    report |= {"gpu_models_with_a_corpus": paths.known("corpus"), "gpu_models_with_a_table": paths.known("generated")}
    if as_json:
        click.echo(json.dumps(report, indent=1, sort_keys=True))
        return
    env = {"shapes": paths.DATA_ENV, "shipped_corpora": paths.DATA_ENV, "shipped_tables": paths.DATA_ENV,
           "work_folder": paths.HOME_ENV, "work_corpora": paths.HOME_ENV, "work_generated": paths.HOME_ENV,
           "installed_tables": paths.TABLES_ENV, "locks": paths.LOCKS_ENV}
    for key, value in report.items():
        shown = (", ".join(value) or "none") if isinstance(value, list) else value
        click.echo(f"{key.replace('_', ' '):>25}: {shown}" + (f"  (${env[key]})" if key in env else ""))


@main.group()
def shapes() -> None:
    """Shape inventories: the GEMV geometries (N×K weight matrices) that a sweep measures."""


@shapes.command("list")
@click.argument("sources", nargs=-1, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the inventories as one JSON list.")
@user_errors
def shapes_list(sources: tuple[Path, ...], as_json: bool) -> None:
    """List inventories (default: corpus/shapes/): model, family, #shapes, #unique (N, K) geometries.

    SOURCES are inventory JSON files or directories of them; every file is validated."""
    from .measure.shapes import default_inventory_dir, load_inventories

    inventories = load_inventories(sources or default_inventory_dir())
    if as_json:
        click.echo(json.dumps([inv.to_dict() for inv in inventories], indent=1, sort_keys=True))
        return
    click.echo(f"{'model':<20} {'family':<12} {'shapes':>6} {'geometries':>10}")
    for inv in inventories:
        click.echo(f"{inv.name:<20} {inv.family:<12} {len(inv.shapes):>6} {len(inv.geometries()):>10}")


@shapes.command("from-gguf")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the inventory to this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the inventory as JSON instead of a table.")
@user_errors
def shapes_from_gguf(model: Path, output: Path | None, as_json: bool) -> None:
    """Derive an inventory from a GGUF model's tensor infos (names, shapes, types; no weights read).

    Projections (attn_q/k/v/output, attn_qkv, ffn_gate/up/down, output) become roles, deduplicated
    across layers, each with the GGUF types it is stored in; the name comes from general.name, the family
    from general.architecture. Tensors of a type the tool does not run are skipped with a warning."""
    import warnings

    from .measure.shapes import from_gguf, write_inventory

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inv = from_gguf(model)
    for warning in caught:
        click.echo(f"warning: {warning.message}", err=True)
    if output is not None:
        write_inventory(inv, output)
        # with --json, stdout carries only the JSON
        click.echo(f"wrote {output} ({len(inv.shapes)} shapes, {len(inv.geometries())} geometries)",
                   err=as_json)
    if as_json:
        click.echo(json.dumps(inv.to_dict(), indent=1, sort_keys=True))
    elif output is None:
        click.echo(f"{inv.name} ({inv.family}, {inv.source})")
        for s in inv.shapes:
            click.echo(f"{s.role:<14} n={s.n:<8} k={s.k:<8} {','.join(s.codebooks)}".rstrip())


def _degrees(text: str) -> list[int]:
    """--tp "2,4,8" -> [2, 4, 8]; InputError for anything but integers >= 2."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() and int(item) >= 2 for item in items):
        raise InputError(f"--tp {text!r}: expected comma-separated tensor-parallel degrees >= 2, e.g. 2,4,8")
    return sorted({int(item) for item in items})


@shapes.command("tp")
@click.argument("sources", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--tp", "degrees", required=True, help="Tensor-parallel degrees, e.g. 2,4,8.")
@click.option("-o", "--output", type=click.Path(path_type=Path, file_okay=False),
              help="Write each derived inventory to this folder as <model>-tp<degree>.json (for sweep --shapes).")
@click.option("--json", "as_json", is_flag=True, help="Print the derived inventories as one JSON list.")
@user_errors
def shapes_tp(sources: tuple[Path, ...], degrees: str, output: Path | None, as_json: bool) -> None:
    """Derive the shapes one rank runs under tensor parallelism, for every inventory and degree.

    Column-parallel projections (q, k, v, qkv, gate, up, gate_up, lm_head, MoE gate/up) split N, row-parallel
    ones (o, down, MoE down) split K, as vLLM, TensorRT-LLM and llama.cpp shard them; attention splits by whole
    heads (KV heads replicated when there are fewer than ranks), lm_head after padding the vocabulary to 64.
    A split that does not exist (heads or N not divisible, K/tp not a whole number of blocks) is refused,
    naming it, and nothing is written. SOURCES are inventory files, folders of them, or names of shipped
    inventories (shapes list), e.g. `shapes tp llama-3.1-70b --tp 2,4,8 -o tp/` then `sweep --shapes tp/`."""
    from .measure.shapes import default_inventory_dir, load_inventories, tensor_parallel, write_inventory

    tps = _degrees(degrees)
    shipped = {inv.name: inv for inv in load_inventories(default_inventory_dir())}
    inventories = [inv for src in sources for inv in
                   ([shipped[str(src)]] if not src.exists() and str(src) in shipped else load_inventories(src))]
    derived = [tensor_parallel(inv, tp) for inv in inventories for tp in tps]  # every split checked before a write
    if output is not None:
        for inv in derived:
            write_inventory(inv, output / f"{inv.name}.json")
        click.echo(f"wrote {len(derived)} inventories to {output}", err=as_json)
    if as_json:
        click.echo(json.dumps([inv.to_dict() for inv in derived], indent=1, sort_keys=True))
    elif output is None:
        click.echo(f"{'model':<24} {'role':<14} {'n':>8} {'k':>8}")
        for inv in derived:
            for s in inv.shapes:
                click.echo(f"{inv.name:<24} {s.role:<14} {s.n:>8} {s.k:>8} {','.join(s.codebooks)}".rstrip())


def _default_plan() -> str:
    """The default sweep plan in words, counted from the shipped inventories and the codebook registry now."""
    from ..kernels.codebooks import CODEBOOKS, SUPERBLOCK, SUPERBLOCK_WEIGHTS
    from .measure import sweep

    try:
        plan = sweep.parse_plan()
    except InputError as err:
        return f"the model inventories (unreadable here: {err})"
    whole = sum(k % SUPERBLOCK_WEIGHTS == 0 for _, k in plan.geometries)
    ms = ", ".join(map(str, plan.ms))
    return (f"the {len(plan.geometries)} (N, K) geometries of every model inventory in corpus/shapes/, all "
            f"{len(CODEBOOKS)} codebooks (the {len(SUPERBLOCK)} super-block ones on the {whole} whose K is a multiple "
            f"of {SUPERBLOCK_WEIGHTS}), M in {{{ms}}}, {', '.join(plan.modes)} mode, cold L2, racing: "
            f"{len(plan.cells())} cells")


class _PlanHelp(click.Command):
    """A command whose help states the default plan as counted when the help is shown, never as stale text."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.help and "{plan}" in self.help:
            self.help = self.help.replace("{plan}", _default_plan())
        super().format_help_text(ctx, formatter)


def _root(folder: Path | None, default: Path) -> Path:
    """A folder to write below (created when missing); InputError, one line, when it is a file."""
    root = folder if folder is not None else default
    if root.exists() and not root.is_dir():
        raise InputError(f"{root}: a file, not a folder to write below")
    return root


@main.command("sweep", cls=_PlanHelp)
@click.option("--corpus-root", type=click.Path(path_type=Path),
              help="Folder that holds one corpus folder per GPU model [default: corpus/ of the work folder, "
              "see dispatch.common.paths: GEMV_DISPATCH_HOME, the source checkout, or ~/.local/share/gemv-dispatch].")
@click.option("--replay", type=click.Path(path_type=Path),
              help="Serve timings from this corpus folder, or the corpus of a GPU model (e.g. nvidia-h200: see "
              "`gemv-dispatch paths`), instead of a GPU (CPU runs and tests).")
@click.option("--devices", help="CUDA device ids, e.g. 0,1: one child process per GPU, geometries dealt "
              "round robin, one compaction at the end.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", metavar="[ADDRESS]",
              help="Sweep every GPU of a Ray cluster (the `fleet` extra), one corpus folder per GPU model: ADDRESS "
              "as ray.init takes it (auto, ray://host:10001); alone, the local Ray (a running one, else a new one).")
@click.option("--codebooks", default=DEFAULT_CODEBOOKS, show_default=True, help="Comma list, or 'all'.")
@click.option("--m", "ms", default=DEFAULT_MS, show_default=True, help="Activation rows M, comma list.")
@click.option("--modes", default=DEFAULT_MODES, show_default=True, help="Launch modes: graph, eager or both.")
@click.option("--shapes", "shape_paths", multiple=True, type=click.Path(path_type=Path),
              help="Inventory file or directory (repeatable; the synthetic grid too) [default: the model "
              "inventories in corpus/shapes/, without the synthetic grid].")
@click.option("--limit", type=int, help="Only the plan's first N cells (smoke runs).")
@click.option("--hot", is_flag=True, help="Hot L2: every launch reads the same weights (default: cold).")
@click.option("--wait", is_flag=True, help="Wait for another sweep of the same GPU to end instead of refusing.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--device-index", type=int, hidden=True)  # set by a --devices parent for its children
@click.option("--device-count", type=int, default=1, hidden=True)
@click.option("--replay-delay", type=float, default=0.0, hidden=True)  # seconds per cell, for tests
@user_errors
def sweep_command(corpus_root: Path | None, replay: Path | None, devices: str | None, ray_address: str | None,
                  codebooks: str, ms: str, modes: str, shape_paths: tuple[Path, ...], limit: int | None, hot: bool,
                  wait: bool, as_json: bool, device_index: int | None, device_count: int, replay_delay: float) -> None:
    """Time every candidate kernel over (codebook, M, N, K, mode) cells into CORPUS_ROOT/<gpu>/.

    Default plan: {plan}. One shard per finished cell: an interrupted sweep loses at most the cell in flight,
    and a rerun skips the cells already measured with the same provenance (GPU, driver, kernel sources, tool,
    timing parameters). One sweep per GPU at a time. Progress and an ETA go to stderr."""
    from .common.paths import home_dir, resolve
    from .measure import sweep
    from .measure.corpus import load

    # A replay serves its corpus's timings as recorded: options that change how a GPU is timed cannot apply.
    moot = [flag for flag, given in (("--hot", hot), ("--wait", wait)) if replay and given]
    moot += ["--replay-delay"] if replay_delay and not replay else []
    if moot:
        raise InputError(f"{', '.join(moot)} cannot apply {'under' if replay else 'without'} --replay")
    if ray_address is not None and devices is not None:
        raise InputError("--ray and --devices exclude each other: a Ray cluster deals out its own GPUs")
    plan = sweep.parse_plan(codebooks, ms, modes, shape_paths, limit, hot)
    root = _root(corpus_root, home_dir() / "corpus")
    replay = resolve(replay, "corpus") if replay is not None else None
    if ray_address is not None:
        from .measure import fleet

        spec = fleet.ReplaySpec((str(replay.resolve()),), replay_delay) if replay else fleet.GpuSpec(plan.timing)
        result = fleet.run_fleet(plan, root, spec, address=ray_address or None, wait=wait)
    elif devices is not None:
        argv = ["--corpus-root", str(root.resolve()), "--codebooks", codebooks, "--m", ms, "--modes", modes]
        argv += [arg for p in shape_paths for arg in ("--shapes", str(p.resolve()))]
        argv += ["--limit", str(limit)] if limit is not None else []
        argv += ["--hot"] if hot else []
        argv += ["--wait"] if wait else []
        argv += ["--replay", str(replay.resolve()), "--replay-delay", str(replay_delay)] if replay else []
        try:
            result = sweep.run_devices(sweep.parse_devices(devices), argv)
        except RuntimeError as err:
            raise click.ClickException(str(err)) from None
    else:
        timer = sweep.ReplayTimer(load(replay), replay_delay) if replay else sweep.GpuTimer(plan.timing)
        child = device_index is not None
        result = sweep.run_sweep(plan, root, timer, part=(device_index or 0, device_count),
                                 compact_at_end=not child, label=f"device {device_index}: " if child else "",
                                 wait=wait)
    if as_json:
        click.echo(json.dumps(result.to_dict(), sort_keys=True))
        return
    click.echo(f"{result.cells} cells: {result.timed} timed, {result.skipped} already in the corpus; "
               f"{result.records} records in {result.seconds:.1f} s -> {', '.join(result.folders)}")


@main.group("corpus")
def corpus_group() -> None:
    """Measured corpora: one folder per GPU model, append-only shards with SHA-256s in a manifest."""


@corpus_group.command("check")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the counts as one JSON object.")
@user_errors
def corpus_check(folder: Path, as_json: bool) -> None:
    """Verify FOLDER (a corpus folder, or a GPU model such as nvidia-h200): every shard's SHA-256 against the
    manifest, no unlisted or missing shard, well-formed records, one GPU model; print the counts, and how many
    records are stale (timed with code the kernels no longer run: a sweep re-times those candidates, training
    leaves them out)."""
    from .common.paths import resolve
    from .measure.corpus import load

    folder = resolve(folder, "corpus")
    loaded = load(folder)
    current = set(loaded.current)
    provenances = {
        key: {"gpu_name": p.gpu_name, "gpu_uuid": p.gpu_uuid, "kernel_digest": p.kernel_digest,
              "records": sum(r.provenance == key for r in loaded.records),
              "stale": sum(r.provenance == key and r not in current for r in loaded.records)}
        for key, p in loaded.provenances.items()
    }
    report = {"folder": str(folder), "shards": len(loaded.shards), "records": len(loaded.records),
              "stale": loaded.stale, "cells": len(loaded.cells()), "provenances": provenances}
    if as_json:
        click.echo(json.dumps(report, indent=1, sort_keys=True))
        return
    click.echo(f"{folder}: ok, {report['shards']} shards, {report['records']} records ({report['stale']} stale), "
               f"{report['cells']} cells")
    for key, p in provenances.items():
        click.echo(f"  {key}: {p['gpu_name']} {p['gpu_uuid']}, kernels {p['kernel_digest'][:12]}, "
                   f"{p['records']} records ({p['stale']} stale)")


@corpus_group.command("compact")
@click.argument("folder", type=click.Path(path_type=Path))
@user_errors
def corpus_compact(folder: Path) -> None:
    """Merge FOLDER's shards into one sorted, deduplicated shard per provenance (deterministic), after
    adopting complete shards an interrupted write left outside the manifest."""
    from .measure.corpus import compact

    before, after = compact(folder)
    click.echo(f"{folder}: {before} shards -> {after}")


# ---------------------------------------------------------------------------------------------------------
# train -> evaluate, explain (dispatch.learn: train, evaluate, explain)


def _corpus_folder(folder: Path | None) -> Path:
    """FOLDER (or the corpus of a GPU model named so: common.paths.resolve), else the one committed corpus
    folder of the reference data (an error if there are several)."""
    from .common.paths import data_dir, resolve

    if folder is not None:
        return resolve(folder, "corpus")
    found = sorted(p.parent for p in (data_dir() / "corpus").glob("*/manifest.json"))
    if len(found) != 1:
        raise InputError(f"name a CORPUS folder ({len(found)} corpora under {data_dir() / 'corpus'})")
    return found[0]


def _profile(text: str | None) -> dict[int, int]:
    from .learn.policy import DEFAULT_PROFILE, parse_profile

    return parse_profile(text) if text is not None else dict(DEFAULT_PROFILE)


FALLBACK_OPTION = click.option(
    "--fallback", type=click.Choice(("trees", "compact")), default="trees", show_default=True,
    help="The fallback for unmeasured shapes: integer decision trees, or the compact fallback (boosted oblivious "
    "trees over integer features, docs/policy.md §6; slower to train and to select, better on unseen families).")
PROFILE_OPTION = click.option("--profile", help="M profile as M:WEIGHT pairs, e.g. 1:0.5,4:0.25,16:0.25 "
                              "[default: 0.5 on M=1, 0.5 spread evenly over M in 2..16 and 31].")


@main.command("train")
@click.argument("corpus_folder", required=False, type=click.Path(path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Policy file to write (canonical JSON).")
@PROFILE_OPTION
@FALLBACK_OPTION
@user_errors
def train_command(corpus_folder: Path | None, output: Path, profile: str | None, fallback: str) -> None:
    """Learn a dispatch policy from CORPUS_FOLDER [default: the committed corpus]: one identity per
    (codebook, N, K) over the M profile, a decision-tree fallback for every shape, exact overlays.
    Same corpus and options give the same bytes."""
    from .common.files import check_output
    from .learn import train
    from .measure.corpus import load

    check_output(output, "policy")
    options = train.TrainOptions(profile=_profile(profile), fallback=fallback)
    policy, notes = train.train(load(_corpus_folder(corpus_folder)), options)
    for note in notes:
        click.echo(f"warning: {note}", err=True)
    policy.save(output)
    click.echo(f"wrote {output}: {len(policy.codebooks)} codebooks, {len(policy.shapes)} trained shapes, "
               f"{len(policy.identity_overlays)} identity and {len(policy.launch_overlays)} launch overlays")


@main.command("evaluate")
@click.argument("corpus_folder", required=False, type=click.Path(path_type=Path))
@PROFILE_OPTION
@FALLBACK_OPTION
@click.option("--folds", type=click.IntRange(2), default=5, show_default=True, help="Grouped CV folds.")
@click.option("--jobs", type=click.IntRange(1), help="Processes for the folds and the hold-out (default: the "
              "cores this process may run on); the report is the same for any count.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as one JSON object.")
@click.option("--plot", type=click.Path(path_type=Path), help="Write the regret CDF here "
              "(needs the `plot` extra: matplotlib).")
@user_errors
def evaluate_command(corpus_folder: Path | None, profile: str | None, fallback: str, folds: int,
                     jobs: int | None, as_json: bool, plot: Path | None) -> None:
    """Regret against the per-cell oracle. Headline: leave-one-family-out over every model family of the shape
    inventories (the fallback alone, the invariant oracle, the fallback's excess over it, with the targets'
    PASS/FAIL). Then the policy with overlays, the fallback under grouped CV and on the sealed family hold-out,
    best single candidate, an MMVQ-style rule, and the price of invariance. Progress goes to stderr."""
    from .common.threads import usable_cores
    from .learn import evaluate, train
    from .measure.corpus import load

    if plot is not None:
        from .common.files import check_output

        check_output(plot, "plot")
        evaluate.require_matplotlib()  # fail before minutes of fitting, not after
    start = time.monotonic()
    options = train.TrainOptions(profile=_profile(profile), fallback=fallback)
    report = evaluate.evaluate(load(_corpus_folder(corpus_folder)), options, folds=folds,
                               workers=jobs or usable_cores(), progress=lambda line: click.echo(
                                   f"evaluate: [{time.monotonic() - start:4.0f} s] {line}", err=True))
    if plot is not None:
        evaluate.plot_cdf(report, plot)
    if as_json:
        click.echo(json.dumps(report.data, indent=1, sort_keys=True))
        return
    click.echo(evaluate.render(report.data))


# A negative M, N or K ("explain q4_0 -1 4096 4096") reaches the argument, and its check, instead of reading as
# an option: what is left of an unknown option lands among the arguments and is refused there.
@main.command("explain", context_settings={"ignore_unknown_options": True})
@click.argument("codebook")
@click.argument("m", type=int)
@click.argument("n", type=int)
@click.argument("k", type=int)
@click.option("--mode", type=click.Choice(MODES), default="graph", show_default=True)
@click.option("--policy", "policy_path", type=click.Path(path_type=Path),
              help="Policy file [default: train one on the corpus now].")
@click.option("--corpus", "corpus_folder", type=click.Path(path_type=Path),
              help="Corpus folder, or a GPU model, for the neighbours and the time model [default: the committed "
              "corpus].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@user_errors
def explain_command(codebook: str, m: int, n: int, k: int, mode: str, policy_path: Path | None,
                    corpus_folder: Path | None, as_json: bool) -> None:
    """Why (CODEBOOK, M, N, K) gets its kernel: pick, identity, overlay or fallback, measured neighbours,
    predicted time and GB/s."""
    from .learn import policy, train
    from .learn.explain import explain
    from .measure.corpus import load

    policy.check_arguments(codebook, m, n, k, mode)  # before minutes of loading and training
    given = policy.load(policy_path) if policy_path is not None else None
    corpus = load(_corpus_folder(corpus_folder))
    chosen = given or train.train(corpus)[0]
    out = explain(chosen, corpus, codebook, m, n, k, mode)
    if as_json:
        click.echo(json.dumps(out, indent=1, sort_keys=True))
        return
    click.echo(f"{out['codebook']} M={m} N={n} K={k} {mode}: {out['candidate']} (identity S={out['identity']}, "
               f"decided by the {out['source']}{', measured cell' if out['measured'] else ''})")
    click.echo(f"predicted {out['predicted_us']:.2f} us, {out['gbps']:.0f} GB/s of weights")
    click.echo("measured neighbours (same codebook and mode):")
    for nb in out["neighbours"]:
        same = (f"S={out['identity']}: {nb['same_identity']} {nb['same_identity_us']:.2f} us"
                if "same_identity" in nb else f"S={out['identity']}: not measured")
        click.echo(f"  M={nb['m']:<3} N={nb['n']:<7} K={nb['k']:<6} best {nb['best']} {nb['best_us']:.2f} us; {same}")



# ---------------------------------------------------------------------------------------------------------
# certify -> generate -> install -> check, and tune (all of it)

DEVICE_OPTION = click.option("--device", type=click.Choice(["auto", "gpu", "emulator"]), default="auto",
                             show_default=True, help="Where launches run: the GPU (CuPy, device 0), the CPU "
                             "emulator (emulator-level), or the GPU when there is one.")
TABLES_OPTION = click.option("--tables", type=click.Path(path_type=Path),
                             help="Install location [default: $GEMV_DISPATCH_TABLES, else "
                             "~/.local/share/gemv-dispatch/tables].")


def _echo_lines(lines: list[str]) -> None:
    for line in lines:
        click.echo(line)


def _gpu_model(source: Path | None, option: str) -> str:
    """The GPU model (its slug) `install --rollback` or `check --installed` acts on: this machine's GPU without
    SOURCE; else SOURCE as a GPU model (nvidia-h200, "NVIDIA H200") or a table folder whose certificate names
    the model. Never a folder's bare name: InputError, one line, for a folder without a certificate, a file, or
    a name that is both a model and a folder here holding another model's table."""
    from .common.gpu import current_gpu, gpu_slug
    from .table import bundle

    if source is None:
        here = current_gpu()
        if here is None:
            raise InputError(f"{option} on a machine without a GPU needs the GPU model, e.g. nvidia-h200")
        return gpu_slug(here["name"])
    bare = len(source.parts) == 1  # can be a model name; a path with a folder in it is a folder
    named = gpu_slug(str(source)) if bare else None
    if source.is_dir():
        cert_path = source / bundle.CERTIFICATE
        if not cert_path.is_file() and bare:
            raise InputError(f"{source}: ambiguous: a GPU model, or the folder here, which holds no "
                             f"{bundle.CERTIFICATE}; name the model from another folder")
        if not cert_path.is_file():
            raise InputError(f"{source}: a folder without {bundle.CERTIFICATE}, so it names no GPU model; pass the "
                             "model (e.g. nvidia-h200) or a table folder")
        gpu_name = str(bundle.read_certificate(cert_path.read_bytes(), str(cert_path))["gpu_name"])
        if named is not None and named != gpu_slug(gpu_name):
            raise InputError(f"{source}: ambiguous: the GPU model {named}, or the folder here holding a table for "
                             f"{gpu_name}; pass {source.resolve()} for the folder")
        return gpu_slug(gpu_name)
    if source.exists():
        raise InputError(f"{source}: a file; pass a GPU model (e.g. nvidia-h200) or a table folder")
    if named is None:
        raise InputError(f"{source}: no such table folder; pass a GPU model (e.g. nvidia-h200) or a table folder")
    return named


@main.command("certify")
@click.argument("policy_path", metavar="POLICY", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True,
              help="Certificate file to write (JSON).")
@click.option("--corpus", "corpus_folder", type=click.Path(path_type=Path),
              help="The corpus folder (or GPU model) the policy was trained on: refused if its manifest differs.")
@DEVICE_OPTION
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of weights, activations and samples.")
@click.option("--carry", "carry_from", type=click.Path(path_type=Path),
              help="A certified table folder of the same GPU model and kernels: keys where POLICY decides as it "
              "did keep its evidence, only the other shapes are checked here (its seed is used).")
@user_errors
def certify_command(policy_path: Path, output: Path, corpus_folder: Path | None, device: str, seed: int,
                    carry_from: Path | None) -> None:
    """Certify POLICY (docs/policy.md §7): every table shape and a seeded sample of unmeasured ones, every M in
    {1..16, 31}, both modes: grouped == serial M=1 bytes, repeat, permutation, poison, emulator equality,
    negative control, spill-free kernels. Exit 1 when a check fails (the certificate records it)."""
    from .common.files import check_output, write_atomic
    from .common.paths import resolve
    from .learn import policy
    from .table import bundle, carry, certify, generate

    loaded = policy.load(policy_path)
    check_output(output, "certificate")  # before the minutes certification takes
    corpus_folder = resolve(corpus_folder, "corpus") if corpus_folder is not None else None
    previous = bundle.verify(resolve(carry_from, "generated")) if carry_from is not None else None
    with certify.runner_for(device, seed) as runner:
        if previous is not None:
            cert = carry.carry(loaded, generate.render(loaded), previous, runner, corpus_folder=corpus_folder)
        else:
            cert = certify.certify(loaded, generate.render(loaded), runner, seed=seed, corpus_folder=corpus_folder)
    write_atomic(output, bundle.certificate_bytes(cert))
    click.echo(f"{output}: {'passed' if cert['passed'] else 'FAILED'} ({cert['level']}-level on "
               f"{cert['device']['name']}, {cert['keys']} keys, {cert['seconds']} s)")
    if not cert["passed"]:
        sys.exit(1)


@main.command("generate")
@click.argument("policy_path", metavar="POLICY", type=click.Path(path_type=Path))
@click.option("--cert", "cert_path", type=click.Path(path_type=Path), required=True,
              help="The certificate `certify` wrote for POLICY.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Folder to write [default: generated/<gpu-slug>/ of the work folder].")
@user_errors
def generate_command(policy_path: Path, cert_path: Path, output: Path | None) -> None:
    """Render POLICY as dispatch_table.py (standard library only) and dispatch_table.h (C99) and write them with
    the certificate and POLICY (as policy.json, like `tune`); refused unless the certificate passed and binds
    exactly the rendered bytes."""
    from .common.gpu import gpu_slug
    from .common.paths import home_dir
    from .learn import policy
    from .table import bundle, generate

    loaded = policy.load(policy_path)
    folder = output or home_dir() / "generated" / gpu_slug(str(loaded.source.get("gpu_name")))
    generate.generate(loaded, cert_path, folder)
    click.echo(f"{folder}: {', '.join((*bundle.FILES, bundle.POLICY))}")


@main.command("install")
@click.argument("source", required=False, type=click.Path(path_type=Path))
@TABLES_OPTION
@click.option("--rollback", is_flag=True, help="Make the previous table current again (SOURCE: the GPU model, e.g. "
              "nvidia-h200, or a table folder whose certificate names it; default: this machine's GPU).")
@user_errors
def install_command(source: Path | None, tables: Path | None, rollback: bool) -> None:
    """Install the certified table in SOURCE (a table folder such as generated/nvidia-h200/, or a GPU model
    whose table the work folder or the shipped data hold) for the runtime, atomically, keeping the previous one.
    Refused: a missing, edited or failed certificate, an edited module, other kernel sources, another GPU model
    than this machine's, another install in progress."""
    from .common.paths import resolve, tables_dir
    from .serve import install

    tables = _root(tables, tables_dir())
    if rollback:
        done = install.rollback(_gpu_model(source, "--rollback"), tables)
    else:
        if source is None:
            raise InputError("name the table folder to install, e.g. generated/nvidia-h200/ or nvidia-h200")
        done = install.install(resolve(source, "generated"), tables)
    click.echo(f"{done.folder}: current is {done.version}, previous {done.previous or 'none'} ({done.note})")


@main.command("check")
@click.argument("source", required=False, type=click.Path(path_type=Path))
@click.option("--installed", is_flag=True, help="Check the table installed for this machine's GPU (or, without "
              "one, for the GPU model SOURCE names).")
@TABLES_OPTION
@DEVICE_OPTION
@user_errors
def check_command(source: Path | None, installed: bool, tables: Path | None, device: str) -> None:
    """Re-run the certification checks on a table here: SOURCE (a table folder such as generated/nvidia-h200/,
    or a GPU model) or --installed. Prints a per-codebook summary; exit 1 on any difference, naming the shape, M
    and first differing element."""
    from .common.gpu import current_gpu
    from .common.paths import resolve, tables_dir
    from .serve import install
    from .table import bundle, certify, check

    if installed:
        model = _gpu_model(source if current_gpu() is None else None, "--installed")
        link = _root(tables, tables_dir()) / model / install.CURRENT
        if not link.is_symlink():
            raise InputError(f"{link}: no table is installed for {model}")
        table = bundle.verify(link.resolve())
    elif source is not None:
        table = bundle.verify(resolve(source, "generated"))
    else:
        raise InputError("name a table folder (generated/<gpu-slug>/) or pass --installed")
    runner = certify.runner_for(device, int(table.certificate["seed"]))
    if runner.level == "emulator":
        click.echo("no GPU: emulator-level check (the emulator stands in for the device)")
    report = check.check(table, runner, lambda line: click.echo(line, err=True))
    for cb, outcomes in report.by_codebook.items():
        counts = outcomes["grouped_equals_serial"].counts
        bad = sum(o.counts["failed"] for o in outcomes.values())
        click.echo(f"{cb:<8} {counts['keys']:>6} keys  {'ok' if not bad else f'{bad} FAILED'}")
    for name, outcome in report.overall.items():
        click.echo(f"{name}: {outcome.result}" + (f" ({outcome.reason})" if outcome.reason else ""))
    if not report.passed:
        _echo_lines(report.failures()[:20])
        sys.exit(1)
    click.echo(f"{table.folder}: ok ({report.level}-level on {report.device})")


@main.command("tune")
@click.option("--corpus-root", type=click.Path(path_type=Path),
              help="Folder of the corpus folders [default: corpus/ of the work folder; a temp folder with --replay].")
@click.option("--replay", type=click.Path(path_type=Path),
              help="Serve timings from this corpus folder, or a GPU model's corpus (e.g. nvidia-h200), instead of "
              "sweeping a GPU.")
@click.option("--generated", "generated_root", type=click.Path(path_type=Path),
              help="Where generated/<gpu-slug>/ goes [default: generated/ of the work folder].")
@TABLES_OPTION
@click.option("--codebooks", default=DEFAULT_CODEBOOKS, show_default=True, help="Sweep: comma list, or 'all'.")
@click.option("--m", "ms", default=DEFAULT_MS, show_default=True, help="Sweep: activation rows M, comma list.")
@click.option("--modes", default=DEFAULT_MODES, show_default=True, help="Sweep: graph, eager or both.")
@click.option("--shapes", "shape_paths", multiple=True, type=click.Path(path_type=Path),
              help="Sweep: inventory file or directory (repeatable) [default: the model inventories].")
@click.option("--seed", type=int, default=0, show_default=True, help="Certification seed.")
@user_errors
def tune_command(corpus_root: Path | None, replay: Path | None, generated_root: Path | None, tables: Path | None,
                 codebooks: str, ms: str, modes: str, shape_paths: tuple[Path, ...], seed: int) -> None:
    """The main job: sweep this GPU (resumable) -> train -> certify -> generate -> install, one transaction
    (nothing installed unless every stage passed). Without a GPU: the embedded default (replay of the
    committed corpus/nvidia-h200/, emulator-level certification, the regenerated module compared with the
    committed generated/nvidia-h200/; nothing installed)."""
    import dataclasses
    import tempfile

    from . import tune
    from .common.gpu import Gpu, current_gpu
    from .common.paths import home_dir, resolve, tables_dir
    from .measure import sweep
    from .measure.corpus import load
    from .table import certify

    log = lambda line: click.echo(line, err=True)  # noqa: E731 - progress to stderr, the summary to stdout
    if current_gpu() is None and replay is None:
        models = tune.committed_models()
        if not models:
            raise InputError("no GPU here and no committed corpus to reproduce (see `gemv-dispatch paths`)")
        click.echo(f"no GPU here: running the embedded default for {', '.join(models)} (replay of each committed "
                   "corpus, emulator-level certification, reproducibility check against its committed table)")
        failed = []
        for slug in models:
            click.echo(f"== {slug}")
            result = tune.embedded_default(slug, log, seed)
            _echo_lines(result.lines())
            if result.reproduced is False:
                failed.append(slug)
        if failed:
            click.echo(f"not reproduced: {', '.join(failed)}")
            sys.exit(1)
        return
    generated_root = _root(generated_root, home_dir() / "generated")
    tables = _root(tables, tables_dir())
    with tempfile.TemporaryDirectory(prefix="gemv-dispatch-replay-") as tmp:
        gpu = None
        if replay is not None:
            source = load(resolve(replay, "corpus"))
            plans, timer = tune.replay_plans(source), sweep.ReplayTimer(source)
            root = _root(corpus_root, Path(tmp))
        else:
            plans = [sweep.parse_plan(codebooks, ms, modes, shape_paths)]
            gpu = Gpu.open()  # one device object: the sweep's timer and the certifier's runner share it
            timer, root = sweep.GpuTimer(plans[0].timing, gpu), _root(corpus_root, home_dir() / "corpus")
        runner = certify.runner_for("auto", seed, gpu)
        result = tune.tune(plans, root, timer, runner, generated_root, tables, seed=seed, log=log)
        if root == Path(tmp):  # the summary must not name a folder that is gone once it is read
            result = dataclasses.replace(result, replayed=source.folder)
    _echo_lines(result.lines())


if __name__ == "__main__":  # `python -m gemv_dispatch.dispatch.cli`: how a --devices sweep starts its children
    main()
