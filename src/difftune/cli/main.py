"""`difftune` command line: train, sample, cache verify (and demo).

User mistakes (`UserError`) are printed as one line and exit with code 2, without a traceback. A run stopped by
SIGTERM / SIGINT exits with 143 / 130 after one line (during training: once it has saved).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import UserError
from ..training.signals import Terminated


def _quiet_libraries() -> None:
    import logging

    # bitsandbytes (an optional extra) warns at import that an optional CPU kernel package is missing; it falls
    # back by itself, and the warning would land in every command's output
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # torchao (an optional extra, imported by diffusers / peft when installed) warns that its CUDA kernels do not
    # load on a machine without them, and torch warns about an enum it registers: neither concerns the command
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import diffusers
        import transformers

        transformers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - logging is cosmetic
        pass


def cmd_train(argv: list[str]) -> int:
    from ..training.recipe import run
    from .args import check_refused_prefixes, check_training_args, training_parser

    check_refused_prefixes(argv)
    args = training_parser().parse_args(argv)
    check_training_args(args)
    summary = run(args)
    code = 0
    if summary.get("stopped"):  # SIGTERM / SIGINT during training: saved, then a clean exit
        from ..training.signals import EXIT_CODES

        print(summary["stop_message"], file=sys.stderr)
        code = EXIT_CODES.get(summary["stopped"], 128 + summary["stopped"])
    return code


def cmd_sample(argv: list[str]) -> int:
    from .sample import main as sample_main

    return sample_main(argv)


def cmd_cache(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="difftune cache")
    sub = parser.add_subparsers(dest="action", required=True)
    verify = sub.add_parser("verify", help="check a stage-1 cache: counts, shapes, dtypes, non-finite values")
    verify.add_argument("path")
    args = parser.parse_args(argv)
    from ..cache import verify_cache

    report = verify_cache(args.path)
    for problem in report.problems:
        print(f"problem: {problem}")
    print(report.summary)
    return 0 if report.ok else 1


def cmd_demo(argv: list[str]) -> int:
    from ..demo import main as demo_main

    return demo_main(argv)


def cmd_example(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="difftune example-workspace",
                                     description="Write the demo's tiny model (official layout) under DIR/models/ (where its "
                                                 "hub id resolves) and a tiny data set under DIR/data/, so the "
                                                 "reference's command lines run unchanged in DIR.")
    parser.add_argument("dir")
    args = parser.parse_args(argv)
    from ..example import write_example_workspace

    print(write_example_workspace(args.dir))
    return 0


COMMANDS = {"train": cmd_train, "sample": cmd_sample, "cache": cmd_cache, "demo": cmd_demo,
            "example-workspace": cmd_example}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: difftune {train,sample,cache,demo} ...\n"
              "  train   fine-tune a model (DiffSynth-Studio compatible flags; see difftune train --help)\n"
              "  sample  generate images, optionally with a trained LoRA\n"
              "  cache   verify a stage-1 cache (difftune cache verify DIR)\n"
              "  example-workspace DIR   a tiny model + data set where the reference's commands run\n"
              "  demo    a split LoRA fine-tune of the bundled tiny model, on CPU", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    _quiet_libraries()
    try:
        return COMMANDS[argv[0]](argv[1:])
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated as err:  # SIGTERM before or after training (during it, the run saves first)
        print(f"stopped by {err}", file=sys.stderr)
        return err.exit_code


def entry(argv: list[str] | None = None) -> None:
    """The `difftune` command (and `python -m difftune.train`): main(), then the process's exit; one of several
    launched processes (accelerate launch) leaves through `exit_launched_process` (training/engines.py says why)."""
    from ..training.engines import exit_launched_process

    code = main(argv)
    exit_launched_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
