"""User-facing errors.

A `UserError` is a mistake in what the user handed us (a flag, a file, a data set). The CLI prints its
message as one line and exits with code 2, without a traceback. Everything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A problem with the user's input; the message must name the file or flag and what is wrong."""

    exit_code = 2


class UndeclaredIOError(RuntimeError):
    """A pipeline unit read or wrote a name, or used a model, that it did not declare (a bug in the unit)."""
