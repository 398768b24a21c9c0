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


def row_label(data) -> str:
    """A data row as messages name it: "row N", counted from 1 as the metadata file's rows are ("row ?" unknown)."""
    row = data.get("_row") if hasattr(data, "get") else data
    return f"row {row + 1}" if isinstance(row, int) and not isinstance(row, bool) else "row ?"


def one_line(text) -> str:
    return " ".join(str(text).split("\n")).replace("\r", " ").strip()


class DataError(UserError):
    """A bad metadata file or sample: one line naming the file (and the row).

    A DataLoader worker's exception reaches the main process as `DataError(<worker traceback>)` (torch
    rebuilds it from the formatted traceback), so the constructor recovers the original one-line message
    from the traceback's last line. Pickling keeps the message (it is the only argument)."""

    def __init__(self, message: str = ""):
        text = str(message)
        if text.startswith("Caught ") and "Traceback" in text:
            last = text.rstrip().splitlines()[-1]
            marker = f"{type(self).__name__}: "
            at = last.find(marker)
            if at >= 0:
                text = last[at + len(marker):]
        super().__init__(one_line(text))
