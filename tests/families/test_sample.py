"""`difftune sample` on each family of manifest.py with a sample part: every case's written image equals the
pipeline's own call (and differs from the call without the flag under test, where the case gives one), at the
entry's size; a family's own flags are refused for another family in one line naming the flag; and the checks only
one family makes (its entry's `own`)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from PIL import Image

from difftune.cli.sample import main as sample
from difftune.errors import UserError
from families.manifest import FAMILIES as ENTRIES

FAMILIES = tuple(name for name, f in ENTRIES.items() if f.sample)


def pytest_generate_tests(metafunc):
    families = [ENTRIES[f] for f in metafunc.module.FAMILIES]
    if "sample_case" in metafunc.fixturenames:
        metafunc.parametrize("sample_case", [pytest.param((f, c), id=f"{f.name}-{c.id}") for f in families
                                             for c in f.sample.cases])
    elif "refused_flag" in metafunc.fixturenames:
        metafunc.parametrize("refused_flag", [pytest.param((f, *flag), id=f"{f.name}-{flag[0]}") for f in families
                                              for flag in f.sample.refused_elsewhere])
    elif "own_check" in metafunc.fixturenames:
        metafunc.parametrize("own_check", [pytest.param((f, c), id=f"{f.name}-{c.__name__.removeprefix('_' + f.name + '_')}")
                                           for f in families for c in f.sample.own])


@pytest.fixture(scope="module")
def hubs(tmp_path_factory):
    """family -> (its support module, its tiny hub), written when a test of the family first asks."""
    built = {}

    def get(family):
        if family.name not in built:
            support = importlib.import_module(family.support)
            built[family.name] = support, family.hub(support, tmp_path_factory.mktemp(f"{family.name}_hub"))
        return built[family.name]
    return get


def _size_flags(family) -> list[str]:
    height, width = family.sample.size
    return ["--height", str(height), "--width", str(width), "--num_inference_steps", "2", "--torch_dtype", "float32",
            "--seed", "3", "--device", "cpu"]


def _same(path, image) -> bool:
    with Image.open(path) as written:
        return np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))


def test_sample_writes_the_pipelines_image(sample_case, hubs, tmp_path):
    family, case = sample_case
    support, hub = hubs(family)
    out = tmp_path / "out.png"
    assert sample([*case.args(support, hub, tmp_path), "--output", str(out), *_size_flags(family)]) == 0
    height, width = family.sample.size
    want, *changed = case.calls(support, hub, tmp_path, dict(seed=3, height=height, width=width,
                                                             num_inference_steps=2, progress=False))
    assert _same(out, want)
    assert not any(_same(out, other) for other in changed)  # the flag under test was used
    with Image.open(out) as written:
        assert written.size == (width, height)


def test_a_familys_flag_is_refused_for_another_family(refused_flag, tiny_repo, tmp_path):
    family, flag, value = refused_flag
    with pytest.raises(UserError, match=f"{flag}: the qwen_image family does not take it"):
        sample(["--model_dir", str(tiny_repo), "--prompt", "x", flag, value, "--output", str(tmp_path / "q.png"),
                *_size_flags(family)])


def test_the_familys_own_check(own_check, hubs, tmp_path):
    family, check = own_check
    check(*hubs(family), tmp_path)


def test_separate_streams_is_refused_for_a_family_of_one_stream(tiny_repo, tmp_path):
    out = tmp_path / "q.png"
    with pytest.raises(UserError, match="--separate_streams: QwenImagePipeline makes one stream .*nothing to write"):
        sample(["--model_dir", str(tiny_repo), "--prompt", "x", "--separate_streams", "--output", str(out),
                "--height", "16", "--width", "16"])
    assert not out.exists()
