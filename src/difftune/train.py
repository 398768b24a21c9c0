"""`accelerate launch -m difftune.train ...` (the same flags as `difftune train`)."""

import sys

from .cli.main import entry

if __name__ == "__main__":
    entry(["train", *sys.argv[1:]])
