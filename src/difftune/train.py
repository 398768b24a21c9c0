"""`accelerate launch -m difftune.train ...` (the same flags as `difftune train`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    from .training.engines import exit_launched_process

    code = main(["train", *sys.argv[1:]])
    exit_launched_process(code)  # one of several launched processes ends here (training/engines.py says why)
    sys.exit(code)
