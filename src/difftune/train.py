"""`accelerate launch -m difftune.train ...` (the same flags as `difftune train`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
