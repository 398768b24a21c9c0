"""A DeepSpeed accelerate config on a machine without deepspeed: accelerate's ImportError traceback from inside
`Accelerator(...)` before; now one line naming the missing package and the install extra. The import failure is
simulated (deepspeed is installed where the test suite runs)."""

from __future__ import annotations

import sys

import pytest

from difftune.errors import UserError


def test_a_deepspeed_launch_without_deepspeed_names_the_package_and_the_extra(monkeypatch):
    from difftune.training.accelerator import make_accelerator, reset_accelerate_state
    from difftune.training.config import RunConfig

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError
    try:
        with pytest.raises(UserError) as err:
            make_accelerator(RunConfig(), None)
    finally:
        reset_accelerate_state()
    text = str(err.value)
    assert "\n" not in text and "deepspeed is not installed" in text and "pip install 'difftune[deepspeed]'" in text


def test_without_a_deepspeed_launch_nothing_is_asked_of_it(monkeypatch):
    from difftune.training import engines

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert engines.accelerator_arguments()["kwargs_handlers"] == []  # no refusal: one process or DDP
