"""The family seam: recognition scoped per family, slots that never silently swap, the latent-layout hooks the
loss reads, and shared code that never imports a family."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import run_train
from difftune.core.family import FamilySpec, recognise, register_family
from difftune.core.target import ImageStream, Target
from difftune.errors import UserError
from difftune.models import ComponentSpec, ModelConfig
from support.toys import toy_family

SRC = Path(__file__).resolve().parents[2] / "src" / "difftune"


@pytest.fixture(scope="module")
def toy_models(tmp_path_factory):
    return toy_family.write_toy_models(tmp_path_factory.mktemp("seam_toy"))


# Shared code: every module of difftune outside families/ (core, training, cache, data, lora, models, media,
# schedulers, cli and the top-level modules: api, demo, example, io, util, train, shapes, errors, ...).
SHARED = sorted(p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] != "families")
# The one family name shared code holds: `difftune demo` teaches the bundled tiny model of one family a new concept
# (and `difftune example-workspace` writes that family's tiny model), so demo.py names that family by its spec name
# and takes everything else (pipeline class, LoRA targets, the tiny-model writer) from the registry entry.
DEMO_FAMILY = ("demo.py", "qwen_image")
FAMILY_WORDS = re.compile(r"qwen|flux|\bwan(\b|_|\d)|z_?image|kontext|layered|eligen|umt5|a14b|ti2v|\bi2v", re.I)


def _code_words(path):
    """(line, text) of every identifier and every string in a module's code (docstrings and comments left out)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield node.lineno, alias.name
            if isinstance(node, ast.ImportFrom) and node.module:
                yield node.lineno, node.module


# parts/: model parts two or more families use (text encoders, autoencoders, EliGen, ControlNet inputs). Families
# import it; it imports no family. It may name an architecture (Qwen2.5-VL, Qwen3, the FLUX.1 AE), which is not a
# family, so FAMILY_WORDS does not apply; what it may not name is a family: its package name as a whole word, a
# path through `families`, a pipeline class or a family's flag (test_parts_name_architectures_never_a_family).
PARTS = "parts"

def _product_modules(folder=SRC):
    return list(folder.rglob("*.py"))


def _imports(path):
    """(line, absolute module, imported names) of each import in a module of src/difftune, relative ones resolved."""
    package = ["difftune", *path.relative_to(SRC).parts[:-1]]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield node.lineno, module, [a.name for a in node.names]


def _owner(module: str) -> tuple[str, ...]:
    """The package a module of difftune belongs to: a family (`families.<name>`) or a top-level package / module."""
    parts = module.split(".")[1:]
    return tuple(parts[:2]) if parts[:1] == ["families"] else tuple(parts[:1])


def test_shared_code_never_imports_a_family():
    offenders = []
    for path in SHARED:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any("families" in (n or "").split(".") for n in names):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
        offenders += [f"{path.relative_to(SRC)}:{line}" for line, module, names in _imports(path)
                      if module.split(".")[:2] == ["difftune", "families"] or
                      (module in ("difftune", "difftune.families") and "families" in names)]
    assert offenders == []


def test_no_family_imports_another_family():
    """A part two families use lives in parts/, not in one of them (relative and absolute imports alike)."""
    families = sorted(p.name for p in (SRC / "families").iterdir() if (p / "__init__.py").is_file())
    offenders = []
    for family in families:
        for path in _product_modules(SRC / "families" / family):
            for line, module, names in _imports(path):
                words = module.split(".")
                other = words[2] if words[:2] == ["difftune", "families"] and len(words) > 2 else None
                if module == "difftune.families":
                    other = next((n for n in names if n in families and n != family), None)
                if other is not None and other != family:
                    offenders.append(f"{path.relative_to(SRC)}:{line}: {module} {names}")
    assert offenders == []


def test_no_import_of_another_packages_private_names():
    """`from M import _name` only within one package (a family, or a top-level package such as models): what another
    package uses is public and documented (e.g. models.load.model_directory)."""
    offenders = []
    for path in _product_modules():
        here = _owner(".".join(["difftune", *path.relative_to(SRC).with_suffix("").parts]))
        for line, module, names in _imports(path):
            for name in names:
                private = name.startswith("_") and not name.startswith("__")
                there = _owner(module if module != "difftune" else f"difftune.{name}")
                if private and module.startswith("difftune") and there != here:
                    offenders.append(f"{path.relative_to(SRC)}:{line}: from {module} import {name}")
    assert offenders == []


def test_parts_name_architectures_never_a_family():
    """parts/ may name an architecture (Qwen2.5-VL, Qwen3, the FLUX.1 AE) but never a family: a family's package name
    as a whole word (so `flux_ae` is the FLUX.1 AE, `families.flux` or `"flux"` the family), a path through
    `families`, a pipeline class or a family's flag (they are the family's to pass in, as column names are)."""
    from difftune.core.family import families
    from difftune.core.options import flag_fields

    specs = families().values()
    packages = {spec.name for spec in specs}
    exact = {cls.__name__ for spec in specs for cls in spec.pipelines}
    exact |= {f.name for spec in specs for f in flag_fields(spec.options)}
    offenders = []
    for path in (SRC / PARTS).rglob("*.py"):
        for line, text in _code_words(path):
            words = {w.lower() for w in re.split(r"[^A-Za-z0-9_]+", text)}
            if words & (packages | {"families"}) or text in exact or any(f"--{n}" in text for n in exact):
                offenders.append(f"{path.relative_to(SRC)}:{line}: {text[:60]!r}")
    assert offenders == []


def test_shared_code_names_no_family_flag_or_default():
    """Shared code (every module outside families/ and parts/) holds no family's name, pipeline class, flag or model name in
    its code (identifiers and strings; docstrings and comments may mention them): what is particular to a family is
    declared by the family. The demo's one spec name is the exception (DEMO_FAMILY)."""
    from difftune.core.family import families
    from difftune.core.options import flag_fields

    specs = families().values()
    exact = {cls.__name__ for spec in specs for cls in spec.pipelines}
    exact |= {f.name for spec in specs for f in flag_fields(spec.options)}
    offenders = []
    for path in SHARED:
        if path.relative_to(SRC).parts[0] == PARTS:
            continue  # architectures' names are allowed there (test_parts_name_architectures_never_a_family)
        for line, text in _code_words(path):
            if (str(path.relative_to(SRC)), text) == DEMO_FAMILY:
                continue
            if FAMILY_WORDS.search(text) or text in exact or any(f"--{n}" in text for n in exact):
                offenders.append(f"{path.relative_to(SRC)}:{line}: {text[:60]!r}")
    assert offenders == []


def test_adding_a_family_touches_no_shared_file(tmp_path):
    """A family is found by its package alone: the built-ins by scanning difftune/families/, so the list of known
    families is not written anywhere."""
    from difftune.core.family import builtin_families

    packages = sorted(p.name for p in (SRC / "families").iterdir() if (p / "__init__.py").is_file())
    assert sorted(builtin_families()) == packages
    for path in SHARED:
        named = [name for name in packages if f'"{name}"' in path.read_text()]
        assert named == ([DEMO_FAMILY[1]] if str(path.relative_to(SRC)) == DEMO_FAMILY[0] else []), path


def test_the_demo_names_its_family_once_and_takes_the_rest_from_the_registry():
    import difftune.demo as demo
    from difftune.core.family import families

    path = SRC / DEMO_FAMILY[0]
    assert [text for _, text in _code_words(path) if text == DEMO_FAMILY[1]] == [DEMO_FAMILY[1]]
    assert path.read_text().count(f'"{DEMO_FAMILY[1]}"') == 1
    spec = demo.demo_family()
    assert spec is families()[demo.DEMO_FAMILY] and demo.DEMO_FAMILY == DEMO_FAMILY[1]
    index = json.loads((demo.BUNDLED_MODEL / "model_index.json").read_text())
    assert index["_class_name"] == spec.pipeline.__name__  # the bundled model is that family's


def test_the_installed_package_carries_no_test_support():
    """Tiny-model writers for tests, script workspaces, contract registrations and the LoRA-reader rewrites live in
    tests/support/; the package keeps only what its commands run (the example workspace's tiny model)."""
    assert not list(SRC.rglob("testing/*.py"))
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n.split(".")[0] in ("support", "pytest", "conftest") for n in names):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == []


def test_the_family_is_recognised_from_the_weights_and_logged(toy_models, capsys):
    configs = [ModelConfig(p) for p in toy_models.values()]
    spec, found = recognise(configs, None)
    assert spec.name == "toy" and sorted(s for s, _, _ in found) == ["denoiser", "image_encoder", "prompt_encoder"]
    assert "family: toy (recognised from the weights)" in capsys.readouterr().out


def test_weights_of_no_family_are_one_line_naming_the_families_tried(tmp_path):
    from safetensors.torch import save_file

    save_file({"some.weight": torch.zeros(3, 3)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(UserError, match=r"tried the families .*qwen_image.*toy"):
        recognise([ModelConfig(str(tmp_path / "x.safetensors"))], None)


def test_a_second_model_for_one_slot_is_an_error_not_a_silent_swap(toy_models):
    configs = [ModelConfig(toy_models["denoiser"]), ModelConfig(toy_models["denoiser"])]
    with pytest.raises(UserError, match=r"both a ToyDenoiser \(denoiser\); toy has no slot for another"):
        recognise(configs, "toy")


def test_a_second_model_of_one_class_fills_the_next_slot(toy_models, monkeypatch):
    """As Wan2.2-A14B's two experts will: the spec's extra slots take further models of its class."""
    import difftune.core.family as family_mod

    monkeypatch.setattr(family_mod, "_REGISTERED", dict(family_mod._REGISTERED))  # this family is for this test
    base = toy_family.FAMILY
    comps = tuple(dataclasses.replace(c, extra_slots=("denoiser2",)) if c.name == "denoiser" else c
                  for c in base.components)

    class TwoExperts(toy_family.ToyPipeline):
        family = "toy_two_experts"
        model_names = (*toy_family.ToyPipeline.model_names, "denoiser2")

    register_family(dataclasses.replace(base, name="toy_two_experts", pipeline=TwoExperts, components=comps))
    first, second = ModelConfig(toy_models["denoiser"]), ModelConfig(toy_models["denoiser"])
    _, found = recognise([first, second, ModelConfig(toy_models["prompt_encoder"])], "toy_two_experts")
    assert [(slot, cfg is first, cfg is second) for slot, cfg, _ in found][:2] == \
        [("denoiser", True, False), ("denoiser2", False, True)]


def test_loss_mask_leaves_masked_elements_out_of_the_loss():
    from difftune.training.losses import flow_match_sft_loss, sample_generator

    @dataclasses.dataclass(frozen=True, eq=False)
    class Masked(ImageStream):
        def loss_mask(self, pipe, values):
            return pipe.mask

    class Pipe(toy_family.ToyPipeline):
        mask = None
        target = Target((Masked(channels=4, scale=toy_family.PATCH, division=toy_family.PATCH),))

        def model_fn(self, latents, timestep, prompt_emb, **settings):
            return latents * 0  # predicts 0: the error is the target itself

    pipe = Pipe()
    pipe.scheduler.set_training()
    x0 = torch.randn(1, 4, 2, 6, generator=torch.Generator().manual_seed(0))
    values = {"input_latents": x0, "prompt_emb": torch.zeros(1, 16, 16)}
    full = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    pipe.mask = torch.zeros(1, 1, 1, 6)
    pipe.mask[..., :3] = 1  # only the left half counts
    half = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    # same noise and timestep (same generator): recompute the two means by hand
    g = sample_generator(0, 0, 0)
    sigma, _, weight = pipe.scheduler.sample_training(1, g, image_seq_len=pipe.stream.seq_len(x0))
    noise = torch.randn(x0.shape[1:], generator=g)[None]
    err = (noise - x0).pow(2)
    assert torch.allclose(full, err.mean() * weight, atol=1e-6)
    assert torch.allclose(half, err[..., :3].mean() * weight, atol=1e-6)


def test_family_settings_from_flags_reach_the_units_and_the_cache_fingerprint(tmp_path):
    """A family option (--edit_image_auto_resize) that a stage-1 unit of the run reads is in the cache's fingerprint;
    a run whose units do not read it (plain text-to-image) keeps it out, so the cache stays valid either way."""
    from conftest import make_image_dataset, model_paths_json
    from support import write_tiny_qwen_image

    repo = write_tiny_qwen_image(tmp_path / "edit_repo", edit=True)
    meta = make_image_dataset(tmp_path / "data", n=2)
    rows = [line.split(",", 1) for line in meta.read_text().splitlines()[1:]]
    edit = tmp_path / "data" / "edit.csv"
    edit.write_text("image,edit_image,prompt\n" + "".join(f"{i},{i},{p}\n" for i, p in rows))
    common = ["--dataset_base_path", meta.parent, "--model_paths", model_paths_json(repo, ("text_encoder", "vae")),
              "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--torch_dtype", "float32",
              "--max_pixels", 4096, "--edit_image_auto_resize", "false", "--no_progress", "--task", "sft:data_process"]
    run_train(*common, "--dataset_metadata_path", edit, "--data_file_keys", "image,edit_image", "--extra_inputs",
              "edit_image", "--output_path", tmp_path / "edit_cache")
    manifest = json.loads((tmp_path / "edit_cache" / "manifest.json").read_text())
    assert manifest["fingerprint"]["preprocessing"]["edit_image_auto_resize"] is False
    assert manifest["family"] == "qwen_image" and manifest["fingerprint"]["features"] == ["base", "edit"]
    run_train(*common, "--dataset_metadata_path", meta, "--output_path", tmp_path / "plain_cache")
    plain = json.loads((tmp_path / "plain_cache" / "manifest.json").read_text())["fingerprint"]
    assert "edit_image_auto_resize" not in plain["preprocessing"] and plain["features"] == ["base"]


def test_family_spec_is_needed_to_register():
    with pytest.raises(TypeError, match="FamilySpec"):
        register_family("toy", toy_family.ToyPipeline)
    assert isinstance(toy_family.FAMILY, FamilySpec)
    assert all(isinstance(c, ComponentSpec) for c in toy_family.FAMILY.components)


def test_a_package_on_the_families_path_is_found_and_trains(tmp_path, monkeypatch, toy_models):
    """A family is a package under difftune/families/ and nothing else: one placed on that package's path (here a
    copy of the toy family under another name) is found by the scan, exported by the API and trains."""
    import difftune
    import difftune.families

    package = tmp_path / "families" / "toy_copy"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import dataclasses\nfrom support.toys import toy_family\n\n"
        "ToyCopyPipeline = type('ToyCopyPipeline', (toy_family.ToyPipeline,), {})\n"
        "FAMILY = dataclasses.replace(toy_family.FAMILY, name='toy_copy', pipeline=ToyCopyPipeline)\n")
    monkeypatch.setattr(difftune.families, "__path__", [*difftune.families.__path__, str(tmp_path / "families")])
    from difftune.core.family import families

    assert "toy_copy" in families()
    assert difftune.ToyCopyPipeline.spec.name == "toy_copy"
    from conftest import make_image_dataset

    data = make_image_dataset(tmp_path / "data", n=2, size=(32, 24))
    run_train("--family", "toy_copy", "--model_paths", json.dumps(list(toy_models.values())), "--dataset_base_path",
              data.parent, "--dataset_metadata_path", data, "--trainable_models", "denoiser", "--torch_dtype",
              "float32", "--max_steps", 1, "--output_path", tmp_path / "out", "--remove_prefix_in_ckpt",
              "pipe.denoiser.", "--no_progress")
    assert (tmp_path / "out" / "epoch-0.safetensors").is_file()
