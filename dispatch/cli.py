"""Command-line entry point `gemv-dispatch`: one click group, one command per pipeline stage."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kernels.errors import InputError


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a caller mistake into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (InputError, FileNotFoundError) as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gemv-dispatch")
def main() -> None:
    """Time quantized GEMV kernels on a GPU, learn and certify a dispatch table, install it."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def info(as_json: bool) -> None:
    """Show versions, the visible CUDA device (name, SMs, L2), nvcc and the supported codebooks."""
    from dispatch.environment import describe

    report = describe()
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    for key, value in report.items():
        click.echo(f"{key:>14}: {value}")


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
    from dispatch.shapes import default_inventory_dir, load_inventories

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
    """Derive an inventory from a GGUF model's tensor infos (names and shapes only, no weights read).

    Projections (attn_q/k/v/output, attn_qkv, ffn_gate/up/down, output) become roles, deduplicated
    across layers; the name comes from general.name, the family from general.architecture."""
    import warnings

    from dispatch.shapes import from_gguf, write_inventory

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
            click.echo(f"{s.role:<14} n={s.n:<8} k={s.k}")
