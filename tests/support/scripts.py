"""The reference's training scripts as `difftune` commands.

A DiffSynth-Studio script is shell: `modelscope download` lines that fetch its data set, then one or more
`accelerate launch [launcher flags] examples/<family>/model_training/train.py <flags>` commands. A user
replaces `accelerate launch .../train.py` with `difftune train` and keeps every flag, so that is what
`reference_commands` returns. Launcher flags (`--config_file <accelerate yaml>`) configure the processes, not
training, and are dropped: these commands run in one process.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ReferenceScript:
    path: Path
    commands: list[list[str]]  # argv after `difftune`, one per `accelerate launch`
    datasets: list[str]  # the `--include` folders of its `modelscope download --dataset` lines
    environment: dict[str, str]  # its `export NAME=value` lines


def _logical_lines(text: str) -> list[str]:
    return [line for line in text.replace("\\\n", " ").splitlines() if line.strip()]


def read_reference_script(path: str | os.PathLike) -> ReferenceScript:
    path = Path(path)
    commands, datasets, env = [], [], {}
    for line in _logical_lines(path.read_text()):
        tokens = shlex.split(line, comments=True)
        if not tokens:
            continue
        if tokens[0] == "export" and len(tokens) == 2 and "=" in tokens[1]:
            name, value = tokens[1].split("=", 1)
            env[name] = value
        elif tokens[:2] == ["accelerate", "launch"]:
            script = next((i for i, t in enumerate(tokens) if t.endswith("train.py")), None)
            if script is None:
                raise ValueError(f"{path}: an `accelerate launch` line names no train.py")
            commands.append(["train", *tokens[script + 1:]])
        elif tokens[:2] == ["modelscope", "download"] and "--include" in tokens:
            pattern = tokens[tokens.index("--include") + 1]
            datasets.append(pattern.rstrip("*").rstrip("/"))
    return ReferenceScript(path, commands, datasets, env)


def reference_commands(path: str | os.PathLike) -> list[list[str]]:
    """The argv after `difftune` for every `accelerate launch` in the script, in order."""
    return read_reference_script(path).commands


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value a command gives `flag` (its last occurrence), or None."""
    value = None
    for i, token in enumerate(argv[:-1]):
        if token == flag:
            value = argv[i + 1]
    return value
