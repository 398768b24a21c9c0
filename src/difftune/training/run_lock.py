"""One run at a time per output folder, and nothing of an earlier run overwritten by a run that fails.

`OutputLock`: `<output_path>/.difftune.lock` (JSON: pid, host, start time, command, a token), created with
`O_CREAT | O_EXCL` so two runs cannot both take it, removed when the run ends (also on an error or a signal).
A lock whose pid is no longer alive on this host is stale (the run was killed) and is taken over with a note;
any other holder is named in a one-line error. Under several processes only the main process takes it.

`RunRecord`: each run records its flags under a name of its own, `runs/<UTC time>-<pid>/training_args.json`,
when it starts training; `<output_path>/training_args.json` is replaced by that record only once the run has
saved its first checkpoint, training state or validation image there. So a run that fails before then leaves
every earlier file as it was.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from ..errors import UserError
from ..io import atomic_write_text, write_error

LOCK_NAME = ".difftune.lock"
RUNS_DIR = "runs"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return True  # unknown: assume alive rather than take a lock that may be held
    return True


class OutputLock:
    """`<folder>/.difftune.lock` held by this process while a run writes into `folder`."""

    def __init__(self, lock_path: str | os.PathLike, flag: str = "--output_path", log=print):
        self.path = Path(lock_path)
        self.flag, self.log = flag, log
        self.token = uuid.uuid4().hex
        self.held = False

    def _describe(self, holder: dict) -> str:
        command = holder.get("command") or "?"
        if len(command) > 200:
            command = command[:197] + "..."
        return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}: "
                f"{command}")

    def _read(self) -> dict | None:
        """The holder's record; {} if the file cannot be parsed; None if it is gone."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def _stale(self, holder: dict) -> bool:
        pid = holder.get("pid")
        return (holder.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid()
                and not _pid_alive(pid))

    def acquire(self) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "command": shlex.join([os.path.basename(sys.executable), *sys.argv]), "token": self.token}
        data = (json.dumps(record, indent=1) + "\n").encode()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # released meanwhile: try again
                if not self._stale(holder):
                    who = self._describe(holder) if holder else "a run whose lock file cannot be read"
                    raise UserError(f"{self.flag} {self.path.parent}: another difftune run is writing there ({who}); "
                                    f"wait for it or use another folder (if no such run exists, delete {self.path})")
                # Take over only the lock we judged stale: a run that took it over meanwhile has another token.
                if self._read() == holder:
                    self.path.unlink(missing_ok=True)
                    self.log(f"note: took over the lock of a run that is no longer running ({self._describe(holder)})")
                continue
            except OSError as err:
                raise write_error(self.path, err) from None
            try:
                os.write(fd, data)
                os.fsync(fd)
            except OSError as err:
                os.close(fd)
                self.path.unlink(missing_ok=True)
                raise write_error(self.path, err, len(data)) from None
            os.close(fd)
            self.held = True
            return
        raise UserError(f"{self.flag} {self.path.parent}: could not take {self.path} (other runs keep taking it)")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("token") == self.token:  # never remove a lock another run took over
            self.path.unlink(missing_ok=True)


def lock_path_for(output_path: str | os.PathLike, cache_only: bool = False) -> Path:
    """Where the lock of `output_path` lives: inside it, except for a stage-1 cache folder, which must hold only
    cache files (its lock is the hidden sibling `.<name>.difftune.lock`)."""
    out = Path(output_path)
    if cache_only:
        return out.parent / f".{out.name}{LOCK_NAME}"
    return out / LOCK_NAME


@contextmanager
def output_lock(output_path: str | os.PathLike, enabled: bool = True, cache_only: bool = False, log=print):
    """Hold the output folder's lock for the duration of the block (`enabled`: the main process only)."""
    lock = OutputLock(lock_path_for(output_path, cache_only), log=log)
    if enabled:
        lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


class RunRecord:
    """This run's flags in `runs/<id>/training_args.json`; the folder's `training_args.json` once it writes."""

    def __init__(self, output_path: str | os.PathLike, args: dict, run_id: str | None = None):
        self.output_path = Path(output_path)
        self.run_id = run_id or new_run_id()
        base, n = self.run_id, 1
        while self.folder.exists():  # two runs of one process within a second (tests, the demo)
            n += 1
            self.run_id = f"{base}-{n}"
        self.args = dict(args)
        self.promoted = False

    @property
    def folder(self) -> Path:
        return self.output_path / RUNS_DIR / self.run_id

    def _text(self) -> str:
        return json.dumps({**self.args, "run_id": self.run_id}, indent=2, default=str)

    def start(self) -> Path:
        return atomic_write_text(self.folder / "training_args.json", self._text())

    def promote(self) -> None:
        """After the run's first save into the folder: `training_args.json` describes this run."""
        if not self.promoted:
            self.promoted = True
            atomic_write_text(self.output_path / "training_args.json", self._text())


def new_run_id() -> str:
    """`<UTC time>-<pid>`: sorts by start time, unique on a host."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
