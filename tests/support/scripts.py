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


def commented_command(path: str | os.PathLike, scratch: str | os.PathLike) -> list[str]:
    """The argv of a script's commented-out command (from its first `# accelerate launch` line on, e.g. a second way
    to train the same model), uncommented into `scratch`."""
    path, scratch = Path(path), Path(scratch)
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# accelerate launch"))
    uncommented = scratch / path.name
    uncommented.write_text("\n".join(line[2:] for line in lines[start:] if line.startswith("# ")) + "\n")
    (argv,) = read_reference_script(uncommented).commands
    return argv


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value a command gives `flag` (its last occurrence), or None."""
    value = None
    for i, token in enumerate(argv[:-1]):
        if token == flag:
            value = argv[i + 1]
    return value


# -- one end-to-end training per distinct configuration ------------------------------------------------------------
# Every script is parsed, its models recognised, its features resolved and its split computed from its own text
# (`resolve_script`, no model loaded); scripts that resolve alike train the same code, so only the first of each
# configuration trains end to end (`trained_once`).


@dataclass(frozen=True)
class Configuration:
    """What one command trains, as far as the code it runs goes."""

    pipeline: str
    features: tuple[str, ...]
    task: str  # e.g. "sft:data_process"
    trains: str  # "lora:<model>" or "full:<models>" ("" for stage 1)
    models: tuple[tuple[str, str, bool], ...]  # (slot, class, converted from another layout)
    split: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())  # (stage-1 units, stage-2 units)
    flags: tuple[str, ...] = ()  # the CODE_PATH_FLAGS it passes


# Flags that take a run down another path (loading, precision, what is saved); the rest (sizes, rates, epochs,
# paths, --initialize_model_on_cpu of the NPU copies) change numbers, not code.
CODE_PATH_FLAGS = ("--fp8_models", "--quant_options", "--lora_checkpoint", "--preset_lora_path", "--offload_models",
                   "--zero_cond_t", "--framewise_decoding", "--align_to_opensource_format", "--max_timestep_boundary",
                   "--min_timestep_boundary", "--use_gradient_checkpointing_offload", "--tokenizer_path",
                   "--audio_processor_path")


def resolve_command(argv: list[str], known: dict[str, Configuration] | None = None) -> Configuration:
    """The configuration of one `difftune train` command, from the run's setup (flags, recognition from the weights'
    headers, features, split); a `:train` command reads the configuration of the stage 1 that wrote its cache
    (`known`: output path -> configuration)."""
    from difftune.cli.args import training_parser
    from difftune.training.config import RunConfig
    from difftune.training.setup import setup

    assert argv[0] == "train", argv
    config = RunConfig.from_namespace(training_parser().parse_args(argv[1:]))
    task = config.task_spec
    lora = flag_value(argv, "--lora_base_model")
    trains = f"lora:{lora}" if lora else f"full:{flag_value(argv, '--trainable_models') or ''}"
    flags = tuple(f for f in CODE_PATH_FLAGS if f in argv)
    if task.stage == "train":
        cache = os.path.normpath(config.dataset_base_path)
        stage1 = (known or {}).get(cache)
        assert stage1 is not None, f"{cache}: no earlier stage-1 command writes this cache"
        return Configuration(stage1.pipeline, stage1.features, flag_value(argv, "--task"), trains, stage1.models,
                             stage1.split, flags)
    run = setup(config, accelerator=None, log=lambda *a: None)
    split = run.split
    models = tuple(sorted((slot, d.spec.class_name, d.spec.convert_state_dict is not None)
                          for slot, d in run.detected.items()))
    return Configuration(run.pipeline.__name__, tuple(sorted(run.features)), flag_value(argv, "--task") or "sft",
                         trains if task.stage != "data_process" else "", models,
                         (tuple(u.name for u in split.stage1), tuple(u.name for u in split.stage2)), flags)


def resolve_script(path: str | os.PathLike, known: dict[str, Configuration] | None = None,
                   before: list[list[str]] = ()) -> tuple[Configuration, ...]:
    """The configurations of a script's commands, in order (`before`: commands of another script it depends on)."""
    known = dict(known or {})
    out = []
    for i, argv in enumerate([*before, *reference_commands(path)]):
        c = resolve_command(argv, known)
        if (flag_value(argv, "--task") or "").endswith("data_process"):
            known[os.path.normpath(flag_value(argv, "--output_path"))] = c
        if i >= len(before):
            out.append(c)
    return tuple(out)


def trained_once(configurations: dict[str, tuple[Configuration, ...]], always=()) -> set[str]:
    """The scripts that train end to end: the first (in sorted order) of each distinct configuration, and `always`."""
    first: dict[tuple, str] = {}
    for script in sorted(configurations):
        first.setdefault(configurations[script], script)
    return set(first.values()) | set(always)


@dataclass
class ResolvedScript:
    configurations: tuple[Configuration, ...] | None  # None: it did not resolve
    log: str  # what reading it printed (notes)
    error: str = ""  # why it did not resolve, one line


def resolve_scripts(root: Path, scripts, before: dict[str, tuple[str, int]] | None = None) -> dict[str, ResolvedScript]:
    """Every script resolved with the workspace as the working directory. `before`: script -> (another script, the
    index of its last command that must come first)."""
    import contextlib
    import io

    from difftune.errors import UserError

    out: dict[str, ResolvedScript] = {}
    for script in scripts:
        first = []
        if before and script in before:
            other, index = before[script]
            first = reference_commands(root / other)[:index + 1]
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                resolved = resolve_script(root / script, before=first)
            out[script] = ResolvedScript(resolved, log.getvalue())
        except (UserError, AssertionError, SystemExit, ValueError) as e:
            out[script] = ResolvedScript(None, log.getvalue(), f"{type(e).__name__}: {e}")
    return out


def trains_end_to_end(script: str, resolved: dict[str, ResolvedScript], always=()) -> bool:
    """Asserts the script resolved; True where it is the first script of its configuration (or in `always`)."""
    assert resolved[script].configurations is not None, f"{script} does not resolve: {resolved[script].error}"
    return script in trained_once({s: r.configurations for s, r in resolved.items() if r.configurations}, always)


def at_small_size(argv: list[str], height: int = 32, width: int = 32) -> list[str]:
    """The command at a small frame size (appended flags win): the scripts' own sizes (480x832, 1328^2) cost seconds
    per tiny-VAE encode on a CPU and prove nothing more; sizes a script does not give are left to its data."""
    return [*argv, "--height", str(height), "--width", str(width)] if "--height" in argv else list(argv)
