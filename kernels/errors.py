"""Caller mistakes: the one exception type, and the input checks every entry point shares."""

from __future__ import annotations

import numpy as np

BLOCK = 32  # values per GGUF block and per activation block


class InputError(ValueError):
    """Raised for invalid input; its message is one line naming what is wrong.

    Command-line entry points print it without a traceback and exit non-zero."""


class EnvironmentProblem(RuntimeError):
    """The machine cannot do what was asked (no CuPy, no CUDA device or driver, a read-only or full disk): not
    the caller's input. Its message is one line; command-line entry points exit with status 3."""


def describe(value: object) -> str:
    """What a value is, for error messages: dtype and shape of an array, else its type."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__


def check_matrix(x: object, what: str, rows: str) -> np.ndarray:
    """Validate a finite float32 [rows, K] array with K a positive multiple of 32; return it as an ndarray."""
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise InputError(f"{what} must be a 2-D float32 array [{rows}, K], got {describe(x)}")
    if x.dtype != np.float32:
        raise InputError(f"{what} must be float32 (no implicit casts), got {x.dtype}")
    if x.shape[0] <= 0 or x.shape[1] <= 0:
        raise InputError(f"{what} must have {rows} > 0 and K > 0 (positive sizes), got shape {x.shape}")
    if x.shape[1] % BLOCK:
        raise InputError(f"{what} K={x.shape[1]} is not a multiple of {BLOCK}")
    finite = np.isfinite(x)
    if not finite.all():
        bad = np.argwhere(~finite)
        r, c = bad[0]
        raise InputError(f"{what} has non-finite values in rows {np.unique(bad[:, 0])[:8].tolist()} "
                         f"(first at row {r}, col {c}); they must be finite")
    return x
