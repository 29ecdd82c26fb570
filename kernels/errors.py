"""The one exception type for caller mistakes (bad shape, dtype, codebook, file)."""


class InputError(ValueError):
    """Raised for invalid input; its message is one line naming what is wrong.

    Command-line entry points print it without a traceback and exit non-zero."""
