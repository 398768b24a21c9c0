"""The unit runner enforces what units declare."""

import pytest
import torch

from difftune.errors import UndeclaredIOError, UserError
from difftune.core import BasePipeline, PipelineUnit, collate_values, run_unit, split_batch


class Pipe(BasePipeline):
    model_names = ("enc", "dit")


class Adds(PipelineUnit):
    inputs = ("a", "b")
    outputs = ("c",)

    def process(self, pipe, a, b):
        return {"c": a + b}


class Leaky(PipelineUnit):
    inputs = ("a",)
    outputs = ("c",)

    def process(self, pipe, a):
        return {"c": a, "secret": 1}


class SeesOnlyDeclared(PipelineUnit):
    inputs = ("a",)
    outputs = ("seen",)

    def process(self, pipe, **kwargs):
        return {"seen": sorted(kwargs)}


class UsesUndeclaredModel(PipelineUnit):
    inputs = ("a",)
    outputs = ("c",)
    models = ("enc",)

    def process(self, pipe, a):
        return {"c": pipe.dit(a)}


class UsesModel(PipelineUnit):
    inputs = ("a",)
    outputs = ("c",)
    models = ("enc",)

    def process(self, pipe, a):
        return {"c": pipe.enc(a)}


class Prompt(PipelineUnit):
    inputs = ("shared",)
    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"emb": ("emb", "negative_emb")}

    def process(self, pipe, prompt, shared):
        return {"emb": f"{prompt}+{shared}"}


def test_runner_passes_only_declared_inputs():
    values = {"a": 1, "b": 2, "zzz": 3}
    run_unit(Pipe(), SeesOnlyDeclared(), values)
    assert values["seen"] == ["a"]


def test_runner_merges_declared_outputs():
    values = run_unit(Pipe(), Adds(), {"a": 1, "b": 2})
    assert values["c"] == 3


def test_runner_rejects_undeclared_output():
    with pytest.raises(UndeclaredIOError, match=r"Leaky returned undeclared name\(s\) \['secret'\]"):
        run_unit(Pipe(), Leaky(), {"a": 1})


def test_runner_rejects_undeclared_model():
    pipe = Pipe()
    pipe.enc = torch.nn.Identity()
    pipe.dit = torch.nn.Identity()
    with pytest.raises(UndeclaredIOError, match="used model 'dit' without declaring it"):
        run_unit(pipe, UsesUndeclaredModel(), {"a": torch.ones(1)})
    assert run_unit(pipe, UsesModel(), {"a": torch.ones(1)})["c"].item() == 1


def test_missing_model_is_a_user_error():
    with pytest.raises(UserError, match="model 'enc' is needed by UsesModel but was not loaded"):
        run_unit(Pipe(), UsesModel(), {"a": torch.ones(1)})


def test_cfg_sides_run_only_with_guidance():
    values = {"prompt": "p", "negative_prompt": "n", "shared": "s"}
    run_unit(Pipe(), Prompt(), values, cfg=False)
    assert values["emb"] == "p+s" and "negative_emb" not in values
    run_unit(Pipe(), Prompt(), values, cfg=True)
    assert values["negative_emb"] == "n+s"
    assert Prompt().reads(cfg=True) == ("shared", "prompt", "negative_prompt")
    assert Prompt().writes(cfg=False) == ("emb",)


def test_freeze_except():
    pipe = Pipe()
    pipe.enc = torch.nn.Linear(2, 2)
    pipe.dit = torch.nn.Linear(2, 2)
    pipe.freeze_except(["dit"])
    assert pipe.dit.training and all(p.requires_grad for p in pipe.dit.parameters())
    assert not pipe.enc.training and not any(p.requires_grad for p in pipe.enc.parameters())
    with pytest.raises(UserError, match="--trainable_models: unknown model"):
        pipe.freeze_except(["unet"])


def test_freeze_except_trains_a_named_submodule():
    """`--trainable_models dit.<module path>` (the reference's submodule form) trains that submodule alone, the
    pipeline's `module_path` mapping the reference's module names onto its own."""

    class Renamed(Pipe):
        def module_path(self, slot, path):
            return path.replace("q", "0")

    pipe = Renamed()
    pipe.enc = torch.nn.Linear(2, 2)
    pipe.dit = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    trained = pipe.freeze_except(["dit.q"])
    assert trained == [pipe.dit[0]] and pipe.dit[0].training
    assert all(p.requires_grad for p in pipe.dit[0].parameters())
    assert not any(p.requires_grad for p in [*pipe.dit[1].parameters(), *pipe.enc.parameters()])
    with pytest.raises(UserError, match="--trainable_models dit.k: dit .* has no module k"):
        pipe.freeze_except(["dit.k"])
    from difftune.training.config import RunConfig

    config = RunConfig(trainable_models="dit.blocks.0.q,dit.blocks.1.q,vae", lora_base_model=None)
    assert config.fully_trained == ["dit", "vae"] and config.trainable == ["dit", "vae"]


def test_collate_pads_and_split_restores():
    a = {"emb": torch.ones(3, 2), "mask": torch.ones(3, dtype=torch.long), "x": torch.zeros(4), "s": "a"}
    b = {"emb": torch.full((5, 2), 2.0), "mask": torch.ones(5, dtype=torch.long), "x": torch.ones(4), "s": "b"}
    batch = collate_values([a, b], {"emb": "mask"})
    assert batch["emb"].shape == (2, 5, 2) and batch["mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert batch["s"] == ["a", "b"] and batch["x"].shape == (2, 4)
    back = split_batch(batch, 2, {"emb": "mask"}, ["emb", "mask", "x", "s"])
    assert torch.equal(back[0]["emb"], a["emb"]) and torch.equal(back[1]["mask"], b["mask"])
    assert back[1]["s"] == "b"
