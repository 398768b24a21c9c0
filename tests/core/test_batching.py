"""Batch size > 1 changes speed, never the result: buckets of equal shapes, prompts padded with their masks,
partial final batches, and `--batch_size 2` equal to `--batch_size 1 --gradient_accumulation_steps 2`."""


import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import LORA_TARGETS, model_paths_json, noise_image, run_train
from difftune.core.batch import SAME, Pad, collate_values
from difftune.errors import UserError
from difftune.training.sampler import EpochPlan

TOLERANCE = 1e-5
SIZES = [(64, 64), (64, 48), (48, 64)]  # three aspect ratios
PROMPTS = ["a dog", "a red cat sitting on a long wooden bench", "bird", "a fish in a very small glass bowl",
           "tree", "two boats", "a car on a road at night under the rain", "sun", "a house", "moon over hills"]


def mixed_dataset(root, n=10, edit=False, seed=0):
    """n images of three aspect ratios and prompts of different lengths (and edit images of two sizes)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = ["image,prompt" + (",edit_image" if edit else "")]
    for i in range(n):
        w, h = SIZES[i % 3]
        noise_image((w, h), 30 + 5 * i, seed=seed * 100 + i).save(root / f"img_{i}.png")
        line = f'img_{i}.png,"{PROMPTS[i % len(PROMPTS)]}"'
        if edit:
            Image.new("RGB", (32, 32) if i % 2 else (48, 32), (20 * i, 90, 160)).save(root / f"edit_{i}.png")
            line += f",edit_{i}.png"
        rows.append(line)
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root / "metadata.csv"


def flags(models, *more):
    return ["--model_paths", models, "--torch_dtype", "float32", "--lora_base_model", "dit", "--lora_target_modules",
            LORA_TARGETS, "--lora_rank", 4, "--learning_rate", 1e-3, "--seed", 7, "--num_epochs", 2,
            "--max_pixels", 4096, "--no_progress", "--enable_tensorboard_log", "false", *more]


def max_diff(a_path, b_path) -> float:
    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys() and a
    assert max(v.abs().max().item() for k, v in a.items() if ".lora_B." in k) > 100 * TOLERANCE  # it trained
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- the plan ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,world,batch,accum", [(10, 1, 2, 1), (10, 2, 1, 2), (7, 1, 4, 1), (13, 2, 2, 2)])
def test_plan_keeps_every_sample_once_in_single_bucket_steps(n, world, batch, accum):
    keys = [("a", "b", "c")[i % 3] for i in range(n)]
    plans = [EpochPlan(n, 3, world, r, batch, accum, keys=keys) for r in range(world)]
    for epoch in range(3):
        steps = plans[0].steps(epoch)
        flat = [i for s in steps for i in s]
        assert sorted(flat) == list(range(n))  # never a drop, never a duplicate
        assert all(len({keys[i] for i in s}) == 1 for s in steps)  # one bucket per step
        assert len(steps) == plans[0].steps_per_epoch()
        # the processes' micro-batches of each step are exactly the step's samples
        per_step: dict = {}
        for plan in plans:
            for step, _, idx, size in plan.micro_batches(epoch):
                per_step.setdefault(step, []).extend(idx)
                assert size == len(steps[step])
        assert [sorted(per_step[s]) for s in range(len(steps))] == [sorted(s) for s in steps]


def test_layouts_see_the_same_steps():
    keys = [i % 3 for i in range(22)]
    layouts = [(1, 4, 1), (1, 2, 2), (1, 1, 4), (2, 2, 1), (2, 1, 2), (4, 1, 1)]  # world, batch, accum
    steps = {layout: [sorted(s) for s in EpochPlan(22, 5, layout[0], 0, layout[1], layout[2], keys=keys).steps(1)]
             for layout in layouts}
    assert all(s == steps[layouts[0]] for s in steps.values())
    assert EpochPlan(22, 5, 1, 0, 4, 1, keys=keys).describe() == \
        "22 samples in 3 bucket(s) -> 6 optimizer step(s) of up to 4 per epoch (2 partial)"  # 8, 7, 7


# -- collation declared per value -------------------------------------------------------------------------

def test_collation_follows_the_declarations_and_names_the_samples():
    a = {"x": torch.ones(2, 3), "emb": torch.ones(2, 4), "mask": torch.ones(2), "steps": 4, "t": torch.tensor(1.0)}
    b = {"x": torch.zeros(2, 3), "emb": torch.ones(5, 4), "mask": torch.ones(5), "steps": 4, "t": torch.tensor(2.0)}
    rules = {"emb": Pad("mask"), "steps": SAME, "t": "scalar"}
    batch = collate_values([a, b], rules, ids=["s1", "s2"])
    assert batch["x"].shape == (2, 2, 3) and batch["emb"].shape == (2, 5, 4)
    assert batch["mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["steps"] == 4 and batch["t"].tolist() == [1.0, 2.0]
    with pytest.raises(UserError, match=r"cannot batch 'x': sample s1 has shape \[2, 3\] but sample s2 has \[3, 3\]"):
        collate_values([a, {**b, "x": torch.zeros(3, 3)}], rules, ids=["s1", "s2"])
    with pytest.raises(UserError, match=r"cannot batch 'steps': sample s1 has 4 but sample s2 has 8"):
        collate_values([a, {**b, "steps": 8}], rules, ids=["s1", "s2"])


# -- training: batch 2 == batch 1 x accumulation 2 ----------------------------------------------------------

@pytest.fixture(scope="module")
def edit_repo(tmp_path_factory):
    from support import write_tiny_qwen_image

    return write_tiny_qwen_image(tmp_path_factory.mktemp("tiny_edit_batching"), edit=True)


@pytest.mark.parametrize("variant", ["t2i", "edit"])
def test_batch_2_equals_accumulation_2_one_stage_and_split(tmp_path, tiny_repo, edit_repo, variant, capsys):
    edit = variant == "edit"
    meta = mixed_dataset(tmp_path / "data", edit=edit)
    models = model_paths_json(edit_repo if edit else tiny_repo)
    extra = ["--extra_inputs", "edit_image", "--edit_image_auto_resize", "false"] if edit else []
    data = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta]
    run_train(*data, "--output_path", tmp_path / "b2", *flags(models, *extra, "--batch_size", 2))
    log = capsys.readouterr().out
    # 10 samples of three sizes: buckets of 4, 3, 3 (t2i) -> 2 + 2 + 2 steps, 2 of them partial
    if not edit:
        assert "batches: 10 samples in 3 bucket(s) -> 6 optimizer step(s) of up to 2 per epoch (2 partial)" in log
    run_train(*data, "--output_path", tmp_path / "a2", *flags(models, *extra, "--gradient_accumulation_steps", 2))
    assert max_diff(tmp_path / "b2" / "epoch-1.safetensors", tmp_path / "a2" / "epoch-1.safetensors") <= TOLERANCE
    # from a split cache: stage 2 reads the buckets stage 1 recorded, without opening a tensor
    run_train(*data, "--task", "sft:data_process", "--output_path", tmp_path / "cache", *flags(models, *extra))
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "s2",
              *flags(models, *extra, "--batch_size", 2))
    assert max_diff(tmp_path / "b2" / "epoch-1.safetensors", tmp_path / "s2" / "epoch-1.safetensors") <= TOLERANCE


def test_resume_mid_epoch_with_batches_is_exact(tmp_path, tiny_repo):
    meta = mixed_dataset(tmp_path / "data", n=9)
    data = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta]
    models = model_paths_json(tiny_repo)
    run_train(*data, "--output_path", tmp_path / "full", *flags(models, "--batch_size", 2))
    run_train(*data, "--output_path", tmp_path / "cut", *flags(models, "--batch_size", 2, "--save_state_steps", 2,
                                                                "--max_steps", 4))
    run_train(*data, "--output_path", tmp_path / "cut", *flags(models, "--batch_size", 2, "--save_state_steps", 2,
                                                                "--resume_from_checkpoint", "latest"))
    assert max_diff(tmp_path / "full" / "epoch-1.safetensors", tmp_path / "cut" / "epoch-1.safetensors") <= 1e-6


def test_direct_distill_batches_only_samples_with_the_same_step_count(tmp_path, tiny_repo):
    root = tmp_path / "data"
    mixed_dataset(root, n=12)  # 3 sizes x 2 step counts: buckets of 2
    lines = (root / "metadata.csv").read_text().splitlines()
    rows = [f"{line},{4 if i % 2 else 2},{100 + i}" for i, line in enumerate(lines[1:])]  # (seeded noise)
    (root / "metadata.csv").write_text("\n".join([lines[0] + ",num_inference_steps,seed", *rows]) + "\n")
    data = ["--dataset_base_path", root, "--dataset_metadata_path", root / "metadata.csv"]
    models = model_paths_json(tiny_repo)
    run_train(*data, "--task", "direct_distill", "--output_path", tmp_path / "b2",
              *flags(models, "--batch_size", 2, "--num_epochs", 1))
    run_train(*data, "--task", "direct_distill", "--output_path", tmp_path / "a2",
              *flags(models, "--gradient_accumulation_steps", 2, "--num_epochs", 1))
    assert max_diff(tmp_path / "b2" / "epoch-0.safetensors", tmp_path / "a2" / "epoch-0.safetensors") <= TOLERANCE
