"""Shared fixtures: tiny Qwen-Image repositories and tiny image datasets in the reference's layout."""

import json
import os
import sys
from pathlib import Path

import pytest
from PIL import Image


def __getattr__(name):
    """`from conftest import LORA_TARGETS` (Qwen-Image's LoRA targets, for the tests), imported when first asked for:
    pytest's main process (which only hands modules to the two workers) never pays difftune's imports (~7 s)."""
    if name == "LORA_TARGETS":
        from difftune.families.qwen_image.components import LORA_TARGET_MODULES

        return LORA_TARGET_MODULES
    raise AttributeError(name)

# Tests in other folders take helpers from test_bad_input (data/) and test_resume (training/) by plain name.
for _folder in ("data", "training"):
    if str(Path(__file__).parent / _folder) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent / _folder))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `-n 2` each worker has a core: one intra-op thread each (and in the processes a test starts), so the
    # two never fight over the cores; tiny models gain little from a second thread anyway.
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Everything imported by now (torch, diffusers, transformers, every test module) lives to the end: frozen, the
    collector never walks it again. A run's own `gc.collect()` (stage 1 ends with one) then scans the objects the tests
    made, not the libraries (0.25 s a call with the stack alone imported, 530k objects; hundreds of calls a suite)."""
    import gc

    gc.collect()
    gc.freeze()


QUICK_FOLDERS = ("core", "data", "cache", "lora", "models", "parts")
QUICK_END_TO_END = "test_split_equals_one_stage"


# The longest modules (15-90 s each on 2 cores), handed out first: `--dist loadfile` then gives each worker the next
# module in this order, and the many short ones at the end keep the two workers' finishing times together (xdist's
# default, most tests first, leaves the long modules of few tests, the launches, for the end: 66 s apart).
LONGEST_FIRST = ("training/test_deepspeed.py", "families/test_contract.py", "test_benchmarks.py",
                 "training/test_sharded.py", "families/wan/test_reference_scripts.py", "training/test_distributed.py",
                 "training/test_training.py", "families/flux/test_flux_reference_scripts.py",
                 "families/wan/test_reference_scripts_b.py", "training/test_demo.py",
                 "training/test_offload_training.py", "training/test_resume.py",
                 "families/test_reference_scripts_b.py", "families/ltx2/test_ltx2_family.py",
                 "families/test_reference_scripts.py", "families/wan/test_wan.py",
                 "training/test_run_safety.py")


def pytest_configure(config):
    # pytest-xdist would otherwise hand out modules by their number of tests (most first), not in LONGEST_FIRST order
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """`-m quick`: the edit-test loop's tier (docs/testing.md): the unit-test folders whole, plus the tests marked
    quick elsewhere (one end-to-end run per family), minus those marked slow. And the longest modules first."""
    root = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).relative_to(root).as_posix(), len(rank)))
    for item in items:
        path = Path(str(item.fspath)).relative_to(root)
        unit_test = path.parts[0] in QUICK_FOLDERS and item.get_closest_marker("slow") is None
        # every family's split == one stage on its tiny models (the contract suite): one end-to-end run per family
        end_to_end = path.name == "test_contract.py" and getattr(item, "originalname", "") == QUICK_END_TO_END
        if unit_test or end_to_end:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory):
    from support import write_tiny_qwen_image

    return write_tiny_qwen_image(tmp_path_factory.mktemp("tiny_qwen_image"))


def make_image_dataset(root, n=2, size=(64, 48), fmt="csv"):
    """metadata.csv + image_<i>.png, as in the reference's example_image_dataset."""
    root.mkdir(parents=True, exist_ok=True)
    colors = [(220, 30, 30), (30, 30, 220), (30, 200, 60), (230, 230, 40)]
    rows = []
    for i in range(n):
        img = Image.new("RGB", size, colors[i % len(colors)])
        for x in range(size[0] // 4, size[0] // 2):
            for y in range(size[1] // 4, size[1] // 2):
                img.putpixel((x, y), (255, 255, 255))
        img.save(root / f"image_{i + 1}.png")
        rows.append({"image": f"image_{i + 1}.png", "prompt": ["a dog", "a cat", "a bird", "a fish"][i % 4]})
    if fmt == "csv":
        lines = ["image,prompt"] + [f'{r["image"]},"{r["prompt"]}"' for r in rows]
        (root / "metadata.csv").write_text("\n".join(lines) + "\n")
        return root / "metadata.csv"
    path = root / f"metadata.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def noise_image(size, sigma, seed=0):
    """A grey picture with Gaussian noise (what PIL's `Image.effect_noise` draws), from a seeded generator:
    effect_noise draws from the C library's one global `rand()` state, so its pictures depend on what ran before in
    the process (and with them a test's float margins)."""
    import numpy as np

    pixels = np.random.default_rng(seed).normal(128.0, sigma, (size[1], size[0]))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "L").convert("RGB")


@pytest.fixture()
def image_dataset(tmp_path):
    return make_image_dataset(tmp_path / "data")


def model_paths_json(repo, components=("transformer", "text_encoder", "vae")):
    from support import tiny_qwen_image_paths

    paths = tiny_qwen_image_paths(repo)
    return json.dumps([paths[c] if len(paths[c]) > 1 else paths[c][0] for c in components])


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerator state is process-global; each in-process training run starts from a clean one."""
    yield
    from difftune.training.accelerator import reset_accelerate_state

    reset_accelerate_state()




def train_args(*argv):
    from difftune.cli.args import training_parser

    return training_parser().parse_args([str(a) for a in argv])


def run_train(*argv):
    from difftune.training.recipe import run

    return run(train_args(*argv))


def setup_run(*argv):
    """A training command set up from its flags (nothing loaded): its family, pipeline class, features and split."""
    from difftune.training.accelerator import make_accelerator, reset_accelerate_state
    from difftune.training.config import RunConfig
    from difftune.training.setup import setup

    config = RunConfig.from_namespace(train_args(*argv))
    reset_accelerate_state()
    try:
        return setup(config, make_accelerator(config, None), log=lambda *a, **k: None)
    finally:
        reset_accelerate_state()  # a run in the same test starts from a clean accelerator
