"""What the per-family test modules differ by, one entry per family: the shared modules beside this file
(test_reference_scripts*.py, ...) run the same checks over every entry that has the part they check, so a family's
scripts, sampling, recognition and LoRA files are tested alike and a check is written once.

An entry names its support writers (tests/support/<family>), its snapshot folder, the family name `difftune` prints,
how a fully trained checkpoint compares with the released weights, the LoRA modules its scripts' checkpoints hold;
what only one family checks is a callable of its entry. Imports of a family's stack happen when a check runs, so
collecting one module does not import every family."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

from support.scripts import commented_command, flag_value

SNAPSHOT = Path(__file__).resolve().parents[1] / "reference_scripts"


# -- the reference's training scripts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """Scripts refused in one line naming `flag` and what is missing (`says`)."""

    flag: str
    says: str
    picks: Callable[[str], bool]  # script (relative to the family's folder) -> whether it is one
    count: int  # how many of the snapshot's scripts are


@dataclass(frozen=True)
class Run:
    """One finished command, for a family's own checks."""

    script: str
    argv: list[str]
    log: str
    saved: dict
    workspace: Path


@dataclass(frozen=True)
class Variant:
    """A command made from a script (its commented-out second command, or a flag changed) that runs too."""

    id: str
    script: str
    command: Callable[[Path, Path], list[str]]  # (the script's path, a scratch folder) -> argv after `difftune`
    extra: tuple[str, ...] = ()  # appended, and why: in the entry's comment
    extra_inputs: str | None = None  # the command's --extra_inputs
    log: str | None = None  # a line its run prints
    check: Callable[[dict, Path], None] | None = None  # (checkpoint, workspace); else the entry's checkpoint check
    slow: bool = True


@dataclass(frozen=True)
class Scripts:
    folder: str  # under tests/reference_scripts/
    workspace: Callable[[Path], Path]  # writes the tiny workspace every script runs in; returns its root
    snapshot: tuple[str, ...] | int  # the scripts (relative to the folder), or how many there are
    lora_prefix: str  # a LoRA checkpoint's keys: <prefix><module>.lora_A/B.weight
    lora_modules: frozenset[str]  # modules a LoRA checkpoint holds at the script's rank
    # (workspace, argv, script) -> the released state dict a full checkpoint has the keys of and moved from, or
    # keys it holds (the trained model's own names, `pipe.<slot>.` removed)
    full: Callable[[Path, list[str], str], dict | tuple[str, ...]]
    lora_exact: bool = False  # the LoRA holds those modules and no other
    lora_alpha: bool = False  # `.alpha` tensors beside the pairs (the comfyui layout)
    once_per_configuration: bool = False  # scripts resolve first; the first of each configuration trains
    slow: bool = False  # the script runs are marked slow
    needs: tuple[str, ...] = ()  # packages the workspace writer imports
    running: int | None = None  # how many scripts run (the rest are refused or inference only)
    refusals: tuple[Refusal, ...] = ()
    inference_only: tuple[str, ...] = ()  # scripts with no command (comments only)
    notes: dict[str, str] = field(default_factory=dict)  # part of a script's name -> a line its run (or its
    # resolution, where an earlier script of its configuration trained) prints
    # (script, monkeypatch) -> what to check after its run, armed before it
    run_checks: Callable[[str, pytest.MonkeyPatch], Callable[[Run], None]] | None = None
    variants: tuple[Variant, ...] = ()
    # (workspace, a LoRA checkpoint) -> the same tensors under `lora_prefix<module>.lora_A/B.weight` (and `.alpha`),
    # for a layout of other names (kohya's flattened lora_unet_ ... lora_down / lora_up); None: read as saved
    canonical: Callable[[Path, dict], dict] | None = None

    @property
    def root(self) -> Path:
        return SNAPSHOT / self.folder

    @property
    def all(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*.sh"))

    def refusal(self, script: str) -> Refusal | None:
        return next((r for r in self.refusals if r.picks(script)), None)

    @property
    def runs(self) -> list[str]:
        return [s for s in self.all if self.refusal(s) is None and s not in self.inference_only]


# -- `difftune sample` ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleCase:
    """One `difftune sample` command and the pipeline's own call it must equal."""

    id: str
    # (the family's support module, its hub, a scratch folder) -> the flags besides --output and the size
    args: Callable[[ModuleType, Path, Path], list[str]]
    # (support, hub, scratch, the size's call arguments) -> [the image it writes, images a flag of it changes...]
    calls: Callable[[ModuleType, Path, Path, dict], list]


@dataclass(frozen=True)
class Sample:
    size: tuple[int, int]  # (height, width) every case samples at
    cases: tuple[SampleCase, ...]
    refused_elsewhere: tuple[tuple[str, str], ...] = ()  # (flag, value) of the family's own, refused for another
    own: tuple[Callable[[ModuleType, Path, Path], None], ...] = ()  # (support, hub, scratch): its checks alone


# -- recognition of the models from their weights -------------------------------------------------------------------


def named(ref: str):
    """"module:NAME" -> that object (a config or a component the entry names without importing it)."""
    import importlib

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def meta_shapes(build, names=lambda sd: sd) -> dict:
    """The state dict's shapes of `build()` at its real size, built on meta tensors (nothing allocated)."""
    import torch

    with torch.device("meta"):
        model = build()
    return {k: tuple(v.shape) for k, v in names(model.state_dict()).items()}


@dataclass(frozen=True)
class Folders:
    """Files as a user names them (the official folders the scripts name, a folder's weights alone): recognised as
    the family, filling `slots`."""

    id: str
    configs: Callable[[ModuleType, Path], list]  # (support, hub) -> ModelConfigs
    slots: tuple[str, ...]
    check: Callable[[dict, ModuleType, Path], None] | None = None  # (slot -> detection, support, hub)


@dataclass(frozen=True)
class SingleFile:
    """Single files (ComfyUI's, BFL's, another library's names): recognised as the entry's components, and loaded to
    exactly the official folder's tensors."""

    id: str
    write: Callable[[ModuleType, Path, Path], list]  # (support, hub, scratch) -> ModelConfigs of the files
    specs: dict[str, str]  # slot -> its component's name in difftune.families.<family>.components
    official: Callable[[ModuleType, Path], object]  # (support, hub) -> the pipeline on the official folders
    load: Callable[[ModuleType, Path], dict] = lambda s, hub: {}  # more from_pretrained arguments (a tokenizer)
    check: Callable[[dict], None] | None = None  # (slot -> detection)


@dataclass(frozen=True)
class Header:
    """A real-size model from its header alone (meta tensors): matched to the component, with its config."""

    id: str
    shapes: Callable[[], dict]
    spec: str  # the component's name in difftune.families.<family>.components
    config: str | None = None  # "module:NAME" of the config it must match with
    holds: tuple[str, ...] = ()  # keys the header has (the layout is the one meant)
    check: Callable[[dict, object], None] | None = None  # (shapes, match)


@dataclass(frozen=True)
class Recognition:
    folders: tuple[Folders, ...] = ()
    single_files: tuple[SingleFile, ...] = ()
    headers: tuple[Header, ...] = ()


# -- LoRA files where users load them -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One saved LoRA file of the entry's training: its flags, and the names its keys have."""

    name: str
    flags: tuple[str, ...]  # (--lora_format ...)
    prefix: str  # every key: <prefix><module>.lora_A/B.weight (and .alpha)
    alpha: bool  # `.alpha` tensors beside the pairs (else alpha is folded into B)
    comfyui_map: str | None = None  # a regex every module (behind the prefix) fully matches: ComfyUI's key map


@dataclass(frozen=True)
class Lora:
    """The same training (rank 4, alpha 8: alpha / rank is 2, same seed) saved in each layout, and who reads which."""

    train: Callable[[ModuleType, Path], list]  # (support, hub) -> the model flags (--model_paths, a tokenizer)
    targets: str  # --lora_target_modules ("module:NAME" of a constant, or the list)
    layouts: tuple[Layout, ...]
    default: str  # the layout of the file difftune fuses to compare with
    modules: int  # LoRA modules in each file
    ours: Callable[[ModuleType, Path], object]  # (support, hub) -> difftune's pipeline on the tiny models
    diffusers: Callable[[ModuleType, Path], object]  # (support, hub) -> diffusers' pipeline on the same models
    diffusers_reads: tuple[str, ...]  # layouts diffusers' load_lora_weights loads, every tensor used
    # (diffusers module, its name in the comfyui file) where diffusers' B @ A is compared with the trained strength
    strength: tuple[str, str]
    # (support, hub, diffusers' pipeline with the file, the file) -> (difftune's sampling with the file fused vs
    # diffusers', how much the LoRA moves diffusers')
    samples: Callable[[ModuleType, Path, object, Path], tuple[float, float]]
    diffusers_refuses: dict[str, str] = field(default_factory=dict)  # layout -> what the ValueError says
    reference_reads_comfyui: bool = False  # the reference's GeneralLoRALoader: the comfyui file, every module found
    reference_moves: float = 1e-3  # by how much (at least) that moves the weights
    own: tuple[Callable[[ModuleType, Path, dict, Path], None], ...] = ()  # (support, hub, layout -> file, scratch)

    @property
    def target_modules(self) -> str:
        return named(self.targets) if ":" in self.targets else self.targets


@dataclass(frozen=True)
class Family:
    name: str  # as `difftune` prints it: "family: <name>"
    support: str  # its tests/support module: what the entry's callables get as `s`
    hub: Callable[[ModuleType, Path], Path]  # (support, folder) -> the tiny hub its sample and recognition cases read
    scripts: Scripts | None = None
    sample: Sample | None = None
    recognition: Recognition | None = None
    lora: Lora | None = None

    @property
    def components(self) -> ModuleType:
        import importlib

        return importlib.import_module(f"difftune.families.{self.name}.components")

    @property
    def spec(self):
        """The registered FamilySpec."""
        import importlib

        return importlib.import_module(f"difftune.families.{self.name}").FAMILY


def covered(families) -> set[str]:
    """The snapshot's scripts (paths under tests/reference_scripts/) the families' entries run or refuse."""
    return {f"{f.scripts.folder}/{s}" for f in families if f.scripts for s in f.scripts.all}


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """The command with `flag`'s value replaced."""
    i = argv.index(flag)
    return [*argv[:i + 1], value, *argv[i + 2:]]


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def picture(path: Path, seed: int, height: int = 32, width: int = 32) -> Path:
    """A seeded random picture saved at `path`."""
    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy()).save(path)
    return path


def rgb(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def _only_command(script: Path) -> list[str]:
    from support import read_reference_script

    (argv,) = read_reference_script(script).commands
    return argv


DIFFUSION_TEMPLATES = ("--template_model_id_or_path", "Diffusion Templates")


def diffusers_with_lora(pipe, path):
    """diffusers' `load_lora_weights(path)` on `pipe`, and the warnings it logged."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("diffusers").addHandler(handler)
    try:
        pipe.load_lora_weights(str(path), adapter_name="ours")
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    return pipe, [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def fused(lora: Lora, s, hub, path):
    """difftune's pipeline with the file fused into its DiT."""
    pipe = lora.ours(s, hub)
    pipe.load_lora(pipe.dit, str(path))
    return pipe


# -- ERNIE-Image ----------------------------------------------------------------------------------------------------


def _ernie_image_workspace(root):
    from support.ernie_image import write_ernie_image_script_workspace

    return write_ernie_image_script_workspace(root)


def _ernie_image_released(workspace, argv, script):
    """The whole DiT, `pipe.dit.` removed: diffusers' names, as the released transformer/ shards."""
    from support.ernie_image import REPO

    out = {}
    for f in sorted((workspace / "models" / REPO / "transformer").glob("*.safetensors")):
        out.update(_load(f))
    return out


ERNIE_IMAGE_SCRIPTS = Scripts(
    folder="ernie_image/model_training", workspace=_ernie_image_workspace,
    snapshot=("full/ERNIE-Image.sh", "lora/ERNIE-Image.sh"),
    # the script's targets on every block, diffusers' layout (what ErnieImagePipeline.load_lora_weights reads)
    lora_prefix="transformer.", lora_exact=True,
    lora_modules=frozenset(f"layers.{i}.self_attention.{t}" for i in range(2) for t in ("to_q", "to_k", "to_v", "to_out.0")),
    full=_ernie_image_released)


def _ernie_image_lora(s, hub, root) -> Path:
    """A LoRA of the scripts' targets at rank 4, saved in the default layout."""
    import torch

    from difftune.families.ernie_image.components import LORA_TARGET_MODULES
    from difftune.lora.formats import save_lora

    dit = s.load_tiny_ernie_image(hub).dit
    g = torch.Generator().manual_seed(1)
    state = {}
    for name, module in dit.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(tuple("." + t for t in LORA_TARGET_MODULES.split(","))):
            state[f"{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=g) / 10
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=g) / 10
    assert len(state) == 2 * 2 * 4
    return save_lora(root / "lora.safetensors", {"dit": state}, {"dit": (4, 4, LORA_TARGET_MODULES)})


def _ernie_image_with_lora(s, hub, path, alpha):
    pipe = s.load_tiny_ernie_image(hub)
    pipe.load_lora(pipe.dit, str(path), alpha=alpha)
    return pipe


def _ernie_image_validation(s, hub, tmp):
    """Validation during training renders one image per prompt at the asked step, with the trained LoRA."""
    import numpy as np
    from PIL import Image

    from conftest import run_train
    from support import write_example_dataset

    meta = write_example_dataset(tmp / "data", n=2, size=(32, 32))
    run_train("--dataset_base_path", tmp / "data", "--dataset_metadata_path", meta, "--max_pixels", 1024,
              "--model_paths", json.dumps(s.ernie_image_model_paths(hub)), "--output_path", tmp / "out",
              "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_v", "--lora_rank", 2,
              "--learning_rate", 1e-2, "--torch_dtype", "float32", "--no_progress", "--max_steps", 2,
              "--validation_prompts", "a dog|a cat", "--validation_steps", 2, "--validation_size", 32,
              "--validation_inference_steps", 2, "--enable_tensorboard_log", "false")
    grids = sorted((tmp / "out" / "validation").glob("step-*.png"))
    assert [p.name for p in grids] == ["step-000002.png"]
    grid = np.asarray(Image.open(grids[0]).convert("RGB"))
    assert grid.shape == (32, 64, 3)  # two prompts side by side
    assert grid.std() > 1  # an image, not a blank


# the model folder in its official layout and the scripts' file list, a LoRA at a strength, image-to-image
ERNIE_IMAGE_SAMPLE = Sample(
    size=(32, 48), cases=(
        SampleCase("model-folder", lambda s, hub, tmp: ["--model_dir", str(hub / s.REPO), "--prompt", "a red circle"],
                   lambda s, hub, tmp, kw: [s.load_tiny_ernie_image(hub)("a red circle", **kw)]),
        SampleCase("file-list", lambda s, hub, tmp: ["--model_paths", json.dumps(s.ernie_image_model_paths(hub)),
                                                     "--prompt", "a red circle"],
                   lambda s, hub, tmp, kw: [s.load_tiny_ernie_image(hub)("a red circle", **kw)]),
        SampleCase("lora-at-a-strength",
                   lambda s, hub, tmp: ["--model_dir", str(hub / s.REPO), "--prompt", "a cat", "--lora",
                                        str(_ernie_image_lora(s, hub, tmp)), "--lora_alpha", "0.5"],
                   lambda s, hub, tmp, kw: [_ernie_image_with_lora(s, hub, tmp / "lora.safetensors", 0.5)("a cat", **kw),
                                            s.load_tiny_ernie_image(hub)("a cat", **kw)]),
        SampleCase("image-to-image",
                   lambda s, hub, tmp: ["--model_dir", str(hub / s.REPO), "--prompt", "a cat", "--input_image",
                                        str(picture(tmp / "in.png", 4, 32, 48)), "--denoising_strength", "0.6"],
                   lambda s, hub, tmp, kw: [s.load_tiny_ernie_image(hub)("a cat", input_image=rgb(tmp / "in.png"),
                                                                          denoising_strength=0.6, **kw),
                                            s.load_tiny_ernie_image(hub)("a cat", **kw)]),
    ), own=(_ernie_image_validation,))


def _model_configs(paths) -> list:
    from difftune.models import ModelConfig

    return [ModelConfig(p) for p in paths]


def _ernie_image_folders(found, s, hub):
    from difftune.families.ernie_image.components import DIT, TEXT_ENCODER, VAE

    assert found["dit"].spec is DIT and found["dit"].config["num_layers"] == 2
    assert found["vae"].spec is VAE and found["vae"].config["latent_channels"] == 32
    # config.json names Mistral3Model: the language model's weights are matched instead, the vision tower left aside
    text = found["text_encoder"]
    assert text.spec is TEXT_ENCODER and text.config["hidden_size"] == 32 and text.config["num_hidden_layers"] == 3
    pipe = s.load_tiny_ernie_image(hub)
    assert type(pipe.text_encoder).__name__ == "Ministral3Model"
    assert not any("vision" in k for k in pipe.text_encoder.state_dict())


def _ernie_image_single_files(s, hub, tmp) -> list:
    """ComfyUI's single-file DiT, and the text encoder in transformers 5's Mistral3Model names (`language_model.*`,
    as a fresh save_pretrained writes them), beside the official VAE."""
    from safetensors.torch import save_file

    ours = s.load_tiny_ernie_image(hub)
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in ours.dit.state_dict().items()},
              str(tmp / "ernie-image.safetensors"))
    save_file({"language_model." + k: v.contiguous() for k, v in ours.text_encoder.state_dict().items()},
              str(tmp / "text_encoder.safetensors"))
    return _model_configs([str(tmp / "ernie-image.safetensors"), str(tmp / "text_encoder.safetensors"),
                           s.ernie_image_model_paths(hub)[2]])


def _ernie_image_dit_shapes():
    from diffusers import ErnieImageTransformer2DModel

    from difftune.families.ernie_image.components import ERNIE_IMAGE_TRANSFORMER_CONFIG

    return meta_shapes(lambda: ErnieImageTransformer2DModel.from_config(ERNIE_IMAGE_TRANSFORMER_CONFIG))


def _ernie_image_mistral3_shapes():
    """The whole multimodal model, in transformers 4's names (the official file)."""
    from transformers import Mistral3Config, Mistral3Model

    from difftune.parts.mistral3 import MINISTRAL3_3B_TEXT_CONFIG, PIXTRAL_VISION_CONFIG
    from support.parts import v4_layout

    config = Mistral3Config(text_config=MINISTRAL3_3B_TEXT_CONFIG, vision_config=PIXTRAL_VISION_CONFIG)
    return meta_shapes(lambda: Mistral3Model(config), v4_layout)


def _flux2_ae_shapes():
    from diffusers import AutoencoderKLFlux2

    from difftune.parts.flux2_vae import FLUX2_VAE_CONFIG

    return meta_shapes(lambda: AutoencoderKLFlux2.from_config(FLUX2_VAE_CONFIG))


def _ernie_image_8b(shapes, match):
    import torch

    assert sum(torch.Size(s).numel() for s in shapes.values()) > 7e9  # the 8B DiT


_ERNIE_DIT_CONFIG = "difftune.families.ernie_image.components:ERNIE_IMAGE_TRANSFORMER_CONFIG"

# the official folders the scripts name (the text encoder beside a multimodal config.json it does not match),
# ComfyUI's single-file DiT, a text encoder saved by transformers 5, and at the real sizes the 8B DiT, the whole
# Mistral-3 file and the FLUX.2 AE
ERNIE_IMAGE_RECOGNITION = Recognition(
    folders=(Folders("official-folders", lambda s, hub: _model_configs(s.ernie_image_model_paths(hub)),
                     ("dit", "text_encoder", "vae"), _ernie_image_folders),),
    single_files=(SingleFile("comfyui-dit-and-transformers-5-text-encoder", _ernie_image_single_files,
                             {"dit": "DIT", "text_encoder": "TEXT_ENCODER"},
                             official=lambda s, hub: s.load_tiny_ernie_image(hub),
                             load=lambda s, hub: {"tokenizer_config": _model_configs([str(hub / s.REPO / "tokenizer")])[0]}),),
    headers=(Header("dit-8b", _ernie_image_dit_shapes, "DIT", _ERNIE_DIT_CONFIG, check=_ernie_image_8b),
             Header("dit-8b-comfyui", lambda: {"model.diffusion_model." + k: v for k, v in _ernie_image_dit_shapes().items()},
                    "DIT", _ERNIE_DIT_CONFIG),
             Header("mistral3-file", _ernie_image_mistral3_shapes, "TEXT_ENCODER",
                    "difftune.parts.mistral3:MINISTRAL3_3B_TEXT_CONFIG",
                    holds=("language_model.model.layers.25.mlp.up_proj.weight", "vision_tower.ln_pre.weight")),
             Header("flux2-vae", _flux2_ae_shapes, "VAE", "difftune.parts.flux2_vae:FLUX2_VAE_CONFIG")))


def _ernie_image_diffusers(s, hub):
    from diffusers import (AutoencoderKLFlux2, ErnieImagePipeline, ErnieImageTransformer2DModel,
                           FlowMatchEulerDiscreteScheduler)
    from transformers import AutoTokenizer

    ours = s.load_tiny_ernie_image(hub)  # its text encoder: the same backbone diffusers' Mistral3Model runs
    repo = hub / s.REPO
    pipe = ErnieImagePipeline(transformer=ErnieImageTransformer2DModel.from_pretrained(repo / "transformer"),
                              vae=AutoencoderKLFlux2.from_pretrained(repo / "vae"), text_encoder=ours.text_encoder,
                              tokenizer=AutoTokenizer.from_pretrained(repo / "tokenizer"),
                              scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(repo / "scheduler"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ernie_image_lora_samples(s, hub, theirs, path):
    from difftune.core.latents import seeded_noise

    kw = dict(height=32, width=32, num_inference_steps=2)
    args = dict(guidance_scale=4.0, output_type="latent", use_pe=False, **kw)
    with_lora = theirs("a red circle", latents=seeded_noise((128, 2, 2), 0, 1, device="cpu"), **args).images
    base = _ernie_image_diffusers(s, hub)("a red circle", latents=seeded_noise((128, 2, 2), 0, 1, device="cpu"),
                                          **args).images
    mine = fused(ERNIE_IMAGE_LORA, s, hub, path)("a red circle", cfg_scale=4.0, seed=0, output_type="latent",
                                                 progress=False, **kw)
    return (mine - with_lora).abs().max().item(), (with_lora - base).abs().max().item()


# The reference's DiT has diffusers' module names, so its `--lora_target_modules` need no translation and one file
# serves every reader: diffusers' ErnieImagePipeline.load_lora_weights (ErnieImageLoraLoaderMixin) reads the default
# (diffusers) layout and refuses the comfyui one (its `.alpha` tensors are not "lora" keys: why that is not the
# default); the reference's GeneralLoRALoader reads `--lora_format comfyui`; ComfyUI (comfy/ldm/ernie/model.py) builds
# the DiT with diffusers' module names, so its generic key map (`diffusion_model.<module>` + `.alpha`) takes that file
ERNIE_IMAGE_LORA = Lora(
    train=lambda s, hub: ["--model_paths", json.dumps(s.ernie_image_model_paths(hub))],
    targets="difftune.families.ernie_image.components:LORA_TARGET_MODULES",
    layouts=(Layout("default", (), "transformer.", alpha=False),
             Layout("comfyui", ("--lora_format", "comfyui"), "diffusion_model.", alpha=True,
                    comfyui_map=r"layers\.\d+\.self_attention\.(to_q|to_k|to_v|to_out\.0)")),
    default="default", modules=2 * 4, ours=lambda s, hub: s.load_tiny_ernie_image(hub),
    diffusers=_ernie_image_diffusers, diffusers_reads=("default",), diffusers_refuses={"comfyui": "lora"},
    strength=("layers.1.self_attention.to_v", "layers.1.self_attention.to_v"), samples=_ernie_image_lora_samples,
    reference_reads_comfyui=True)


# -- Krea-2 ---------------------------------------------------------------------------------------------------------


def _krea2_workspace(root):
    from support.krea2 import write_krea2_script_workspace

    return write_krea2_script_workspace(root)


def _krea2_release(script):
    from support.krea2 import KREA2_RAW_REPO, KREA2_TURBO_REPO

    return (KREA2_RAW_REPO, "raw.safetensors") if "Raw" in script else (KREA2_TURBO_REPO, "turbo.safetensors")


def _krea2_released(workspace, argv, script):
    """The DiT in diffusers' names, as the Krea single file it started from converts to."""
    from difftune.families.krea2.components import convert_original_dit

    repo, name = _krea2_release(script)
    return convert_original_dit(_load(workspace / "models" / repo / name))


def _krea2_in_original_names(saved, workspace):
    """`--full_format original`: the checkpoint in raw.safetensors' own names (the reference's and ComfyUI's)."""
    repo, name = _krea2_release("full/Krea-2-Raw.sh")
    assert saved.keys() == _load(workspace / "models" / repo / name).keys()


KREA2_SCRIPTS = Scripts(
    folder="krea2/model_training", workspace=_krea2_workspace, slow=True, once_per_configuration=True,
    snapshot=("full/Krea-2-Raw.sh", "full/Krea-2-Turbo.sh", "lora/Krea-2-Raw.sh", "lora/Krea-2-Turbo.sh"),
    # `--align_to_opensource_format`: diffusers' names behind `transformer.`
    lora_prefix="transformer.",
    lora_modules=frozenset(("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.down", "img_in",
                            "text_fusion.projector", "time_mod_proj", "final_layer.linear")),
    full=_krea2_released,
    variants=(Variant("full-format-original", "full/Krea-2-Raw.sh",
                      lambda script, tmp: with_flag(_only_command(script), "--output_path",
                                                    "./models/train/Krea-2-Raw_full_original"),
                      extra=("--full_format", "original", "--max_pixels", "1024"), check=_krea2_in_original_names,
                      slow=False),))


def _krea2_image_to_image_starts_from_the_noised_image(s, hub, tmp):
    """An input image at strength 0.5: the reference's schedule (all steps from sigma 0.5, shifted), the image's
    latents noised to the first sigma; a different image gives a different result, strength 1 ignores it."""
    import torch
    from PIL import Image

    pipe = s.load_tiny_krea2(hub)
    g = torch.Generator().manual_seed(0)
    images = [Image.fromarray((torch.rand(32, 48, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in range(2)]
    kw = dict(seed=3, height=32, width=48, num_inference_steps=2, cfg_scale=1.0, progress=False, output_type="latent")
    a, b = (pipe("a cat", input_image=i, denoising_strength=0.5, **kw) for i in images)
    assert a.shape == (1, 16, 4, 6) and (a - b).abs().max() > 1e-3
    full = [pipe("a cat", input_image=i, denoising_strength=1.0, **kw) for i in images]
    assert torch.equal(full[0], full[1]) and torch.equal(full[0], pipe("a cat", **kw))


# the scripts' files (Krea's single file, Qwen3-VL's folder with its tokenizer, the VAE), Raw's default time shift and
# Turbo's `--shift_mu 1.15`
KREA2_SAMPLE = Sample(
    size=(32, 48), cases=(
        SampleCase("raw", lambda s, hub, tmp: ["--model_paths", json.dumps(s.krea2_model_paths(hub)), "--prompt",
                                               "a red circle", "--cfg_scale", "2"],
                   lambda s, hub, tmp, kw: [s.load_tiny_krea2(hub)("a red circle", cfg_scale=2.0, **kw)]),
        SampleCase("turbo-shift-mu",
                   lambda s, hub, tmp: ["--model_paths", json.dumps(s.krea2_model_paths(hub, s.KREA2_TURBO_REPO)),
                                        "--prompt", "a red circle", "--cfg_scale", "1", "--shift_mu", "1.15"],
                   lambda s, hub, tmp, kw: [s.load_tiny_krea2(hub, s.KREA2_TURBO_REPO)("a red circle", cfg_scale=1.0,
                                                                                       mu=1.15, **kw),
                                            s.load_tiny_krea2(hub, s.KREA2_TURBO_REPO)("a red circle", cfg_scale=1.0,
                                                                                       **kw)]),
    ), refused_elsewhere=(("--shift_mu", "1.15"),), own=(_krea2_image_to_image_starts_from_the_noised_image,))


_KREA2_BLOCK_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up",
                        "ff.down")


_KREA2_GLOBAL_MODULES = ("img_in", "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj", "txt_in.linear_1",
                         "txt_in.linear_2", "text_fusion.projector", "final_layer.linear")


def _lora_modules(keys, prefix) -> set[str]:
    return {k[len(prefix):].rpartition(".lora_")[0] if ".lora_" in k else k[len(prefix):].rpartition(".alpha")[0]
            for k in keys}


def _krea2_lora_samples(s, hub, theirs, path):
    from difftune.core.latents import seeded_noise
    from difftune.families.krea2.model_fn import pack

    kw = dict(height=32, width=32, num_inference_steps=2)
    latents = pack(seeded_noise((16, 4, 4), 0, 1))
    with_lora = theirs("a red circle", guidance_scale=0.0, latents=latents, output_type="latent", **kw).images
    base = s.diffusers_krea2(s.load_tiny_krea2(hub))("a red circle", guidance_scale=0.0, latents=latents,
                                                     output_type="latent", **kw).images
    mine = pack(fused(KREA2_LORA, s, hub, path)("a red circle", cfg_scale=1.0, seed=0, output_type="latent",
                                                progress=False, **kw))
    return (mine - with_lora).abs().max().item(), (with_lora - base).abs().max().item()


def _krea2_the_reference_targets_become_diffusers_modules(s, hub, loras, tmp):
    saved = _load(loras["default"])
    blocks = [f"transformer_blocks.{i}" for i in range(2)] + [f"text_fusion.{kind}.{i}" for kind in
                                                              ("layerwise_blocks", "refiner_blocks") for i in range(2)]
    want = {f"{b}.{m}" for b in blocks for m in _KREA2_BLOCK_MODULES} | set(_KREA2_GLOBAL_MODULES)
    assert _lora_modules(saved, "transformer.") == want and len(want) == 56
    assert saved["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"].shape[0] == 4


def _krea2_original_linears(dit) -> dict:
    import torch

    from difftune.families.krea2.lora import to_original_path

    return {to_original_path(name): m.weight.detach().clone() for name, m in dit.named_modules()
            if isinstance(m, torch.nn.Linear)}


def _krea2_reference_fuse(weights: dict, lora: dict) -> tuple[dict, int]:
    """The reference's Krea2LoRALoader on a file: keys starting with `transformer.` are renamed by its rename table
    (diffusers' names back to its own) to `<module>.lora_A/B.default.weight`; GeneralLoRALoader then adds B @ A
    (no alpha in such a file: scale 1) to the module of that name."""
    from difftune.families.krea2.lora import to_original_path

    assert any(k.startswith("transformer.") for k in lora)
    renamed = {}
    for name, value in lora.items():
        weight_name = name.replace(".lora_A.", ".").replace(".lora_B.", ".").replace("transformer.", "", 1)
        kind = "lora_A" if name.endswith(".lora_A.weight") else "lora_B"
        renamed[to_original_path(weight_name.removesuffix(".weight")) + f".{kind}.default.weight"] = value
    out, fused_modules = dict(weights), 0
    for key in renamed:
        if key.endswith(".lora_B.default.weight"):
            module = key.removesuffix(".lora_B.default.weight")
            if module in out:
                out[module] = out[module] + renamed[key] @ renamed[module + ".lora_A.default.weight"]
                fused_modules += 1
    return out, fused_modules


def _krea2_the_reference_loader_fuses_the_default_file_at_the_trained_strength(s, hub, loras, tmp):
    default = _load(loras["default"])
    theirs, fused_modules = _krea2_reference_fuse(_krea2_original_linears(s.load_tiny_krea2(hub).dit), default)
    assert fused_modules == len(_lora_modules(default, "transformer.")) == 56
    mine = _krea2_original_linears(fused(KREA2_LORA, s, hub, loras["default"]).dit)
    diff = max((theirs[k] - mine[k]).abs().max().item() for k in mine)
    print(f"krea2 default LoRA fused by the reference's loader vs difftune: {diff:.2e}")
    assert diff <= 1e-6


def _krea2_comfyui_map(layers: int) -> dict[str, str]:
    """ComfyUI's krea2_to_diffusers (comfy/utils.py), as comfy/lora.py uses it: a diffusers module path (behind
    `transformer.`, `diffusion_model.` or bare) -> the original module it patches."""
    block = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_gate": "attn.gate",
             "attn.to_out.0": "attn.wo", "attn.to_out": "attn.wo", "ff.gate": "mlp.gate", "ff.up": "mlp.up",
             "ff.down": "mlp.down"}
    out = {}
    for ours, theirs in ([(f"transformer_blocks.{i}", f"blocks.{i}") for i in range(layers)]
                         + [(f"text_fusion.{k}.{i}", f"txtfusion.{k}.{i}")
                            for k in ("layerwise_blocks", "refiner_blocks") for i in range(2)]):
        out.update({f"{ours}.{d}": f"{theirs}.{c}" for d, c in block.items()})
    out.update({"img_in": "first", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
                "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3",
                "text_fusion.projector": "txtfusion.projector", "final_layer.linear": "last.linear"})
    return out


def _krea2_every_module_of_both_files_is_one_comfyui_maps(s, hub, loras, tmp):
    comfy_map = _krea2_comfyui_map(2)
    default = _lora_modules(_load(loras["default"]), "transformer.")
    assert default <= set(comfy_map)  # every diffusers path is in ComfyUI's Krea2 map
    # --lora_format comfyui: the original names, which ComfyUI's generic diffusion_model.<key> map takes
    native = _lora_modules(_load(loras["comfyui"]), "diffusion_model.")
    originals = set(_krea2_original_linears(s.load_tiny_krea2(hub).dit))
    assert native <= originals and native == {comfy_map[p] for p in default}


def _krea2_an_original_names_lora_is_read_back(s, hub, loras, tmp):
    """Krea's trainer / ComfyUI's files (`diffusion_model.<original>` + alpha) and the reference's own save
    (`<original>.lora_A.default.weight`): both fuse as the default file does."""
    import re

    from safetensors.torch import save_file

    from difftune.families.krea2.lora import to_diffusers_path

    comfy = _load(loras["comfyui"])
    reference_own = {re.sub(r"^diffusion_model\.", "", k).replace(".lora_A.weight", ".lora_A.default.weight")
                     .replace(".lora_B.weight", ".lora_B.default.weight"): v * (2.0 if ".lora_B." in k else 1.0)
                     for k, v in comfy.items() if not k.endswith(".alpha")}  # no alpha: scale 1, so B carries 2
    save_file(reference_own, str(tmp / "reference.safetensors"))
    want = fused(KREA2_LORA, s, hub, loras["default"])
    for path in (loras["comfyui"], tmp / "reference.safetensors"):
        got = fused(KREA2_LORA, s, hub, path)
        diff = max((got.dit.state_dict()[k] - v).abs().max().item() for k, v in want.dit.state_dict().items())
        assert diff <= 1e-6, path
    assert to_diffusers_path("blocks.1.mlp.down") == "transformer_blocks.1.ff.down"


# trained with the reference's own target names (`wq,wk,wv,gate,wo,...,tproj.1`, translated onto diffusers' modules):
# the default file (diffusers' names behind `transformer.`, alpha folded into B; the reference's
# `--align_to_opensource_format` layout) loads in diffusers' Krea2Pipeline.load_lora_weights; the reference's
# Krea2LoRALoader (rewritten here from its source) fuses it; ComfyUI (its comfy/lora.py Krea2 branch and comfy/utils.py
# krea2_to_diffusers) maps every module of both files; a LoRA in the original names is read back
KREA2_LORA = Lora(
    train=lambda s, hub: ["--model_paths", json.dumps(s.krea2_model_paths(hub))],
    targets="wq,wk,wv,gate,wo,gate,up,down,first,tmlp.0,tmlp.2,projector,txtmlp.1,txtmlp.3,last.linear,tproj.1",
    layouts=(Layout("default", ("--lora_format", "default"), "transformer.", alpha=False),
             Layout("comfyui", ("--lora_format", "comfyui"), "diffusion_model.", alpha=True)),
    default="default", modules=56, ours=lambda s, hub: s.load_tiny_krea2(hub),
    diffusers=lambda s, hub: s.diffusers_krea2(s.load_tiny_krea2(hub)), diffusers_reads=("default",),
    strength=("transformer_blocks.0.attn.to_q", "blocks.0.attn.wq"), samples=_krea2_lora_samples,
    own=(_krea2_the_reference_targets_become_diffusers_modules,
         _krea2_the_reference_loader_fuses_the_default_file_at_the_trained_strength,
         _krea2_every_module_of_both_files_is_one_comfyui_maps, _krea2_an_original_names_lora_is_read_back))


# -- Ideogram-4 -----------------------------------------------------------------------------------------------------


def _ideogram4_workspace(root):
    from support.ideogram4 import write_ideogram4_script_workspace

    return write_ideogram4_script_workspace(root)


IDEOGRAM4_QUANTISED = {"lora/Ideogram-4-fp8.sh": "fp8", "lora/Ideogram-4-nf4.sh": "nf4"}


def _ideogram4_run_checks(script, monkeypatch):
    """The fp8 and nf4 scripts load ideogram-ai's pre-quantised releases (models/prequant.py): the DiT (its fused qkv
    split while packed) and the text encoder kept as the release stores them."""
    def check(run: Run):
        how = IDEOGRAM4_QUANTISED.get(script)
        if how is None:
            return
        for slot, folder in (("dit", "transformer"), ("text_encoder", "text_encoder")):
            line = next((ln for ln in run.log.splitlines() if ln.startswith(f"{slot}: ")), "")
            assert f"ideogram-4-{how}/{folder}/" in line and line.endswith(f"kept as stored ({how})"), run.log[-3000:]
    return check


IDEOGRAM4_SCRIPTS = Scripts(
    folder="ideogram4/model_training", workspace=_ideogram4_workspace, needs=("bitsandbytes",),  # the nf4 release
    snapshot=("full/Ideogram-4-bf16-repackage.sh", "lora/Ideogram-4-bf16-repackage.sh", "lora/Ideogram-4-fp8.sh",
              "lora/Ideogram-4-nf4.sh"),
    # diffusers' layout, the only one diffusers reads with the final layer's modulation the scripts'
    # `adaln_modulation` takes (test_ideogram4_lora.py)
    lora_prefix="transformer.", lora_exact=True,
    lora_modules=frozenset({f"layers.{i}.{m}" for i in range(2) for m in
                            ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                             "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaln_modulation")}
                           | {"final_layer.adaln_modulation"}),
    full=lambda workspace, argv, script: ("layers.0.attention.to_q.weight", "input_proj.weight"),
    run_checks=_ideogram4_run_checks)


# -- FLUX.2 ---------------------------------------------------------------------------------------------------------


def _flux2_workspace(root):
    from support.flux2.scripts import write_flux2_script_workspace

    return write_flux2_script_workspace(root)


FLUX2_SCRIPTS = Scripts(
    folder="flux2/model_training", workspace=_flux2_workspace, slow=True, once_per_configuration=True,
    snapshot=27, running=12, inference_only=("full/TreeAdapter-KleinBase4B.sh",),  # "supports inference only"
    refusals=(Refusal(*DIFFUSION_TEMPLATES, picks=lambda s: "Template-" in s or "i2L" in s, count=13),
              Refusal("--dmd2_fake_score_learning_rate", "DMD2 distillation", picks=lambda s: "dmd2" in s, count=1)),
    # every module the scripts name, diffusers' layout (transformer.<module>)
    lora_prefix="transformer.",
    lora_modules=frozenset(("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
                            "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.ff.linear_in",
                            "transformer_blocks.0.ff_context.linear_out",
                            "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
                            "single_transformer_blocks.19.attn.to_out")),
    full=lambda workspace, argv, script: ("x_embedder.weight", "single_transformer_blocks.0.attn.to_out.weight"),
    # lora/FLUX.2-klein-4B.sh's commented edit command: two edit images per row (a JSON list); the edit images kept
    # at their tiny size (the reference's resize to about 1024 x 1024, the default, makes this CPU run a minute longer)
    variants=(Variant("klein-edit", "lora/FLUX.2-klein-4B.sh", commented_command, extra_inputs="edit_image",
                      extra=("--edit_image_auto_resize", "false"), log="features: base, edit"),))


def _flux2_edit_images(tmp) -> list[str]:
    return [f for i in range(2) for f in ("--edit_image", str(picture(tmp / f"e{i}.png", 10 + i, 32, 48)))]


# klein's model folder and FLUX.2-dev's files with its embedded guidance, klein's edit images
FLUX2_SAMPLE = Sample(
    size=(32, 32), cases=(
        SampleCase("klein-folder", lambda s, hub, tmp: ["--model_dir", str(hub / s.KLEIN_4B), "--prompt",
                                                        "a red circle"],
                   lambda s, hub, tmp, kw: [s.load_tiny_klein(hub)("a red circle", **kw)]),
        SampleCase("dev-embedded-guidance",
                   lambda s, hub, tmp: ["--model_paths", json.dumps(s.dev_model_paths(hub)), "--tokenizer_path",
                                        str(hub / s.DEV / "tokenizer"), "--prompt", "a cat", "--embedded_guidance", "2"],
                   lambda s, hub, tmp, kw: [s.load_tiny_dev(hub)("a cat", embedded_guidance=2.0, **kw),
                                            s.load_tiny_dev(hub)("a cat", **kw)]),
        SampleCase("klein-edit-images",
                   lambda s, hub, tmp: ["--model_dir", str(hub / s.KLEIN_4B), "--prompt", "make it blue",
                                        *_flux2_edit_images(tmp), "--edit_image_auto_resize", "false"],
                   lambda s, hub, tmp, kw: [s.load_tiny_klein(hub)("make it blue", edit_image=[rgb(tmp / f"e{i}.png")
                                                                                           for i in range(2)],
                                                                   edit_image_auto_resize=False, **kw),
                                            s.load_tiny_klein(hub)("make it blue", **kw)]),
    ))


def _flux2_entry(s, hub, repo, folder):
    from difftune.models import ModelConfig

    paths = s.hub_paths(hub, repo, folder)
    return ModelConfig(paths if len(paths) > 1 else paths[0])


def _flux2_folders(dit_repo, encoder_repo, encoder_class, guidance):
    def check(found, s, hub):
        assert found["text_encoder"].spec.class_name == encoder_class
        assert found["dit"].config["guidance_embeds"] is guidance

    return Folders(dit_repo.lower().replace("_", "-"), lambda s, hub: [
        _flux2_entry(s, hub, getattr(s, dit_repo), "transformer"), _flux2_entry(s, hub, getattr(s, encoder_repo),
                                                                                 "text_encoder"),
        _flux2_entry(s, hub, getattr(s, encoder_repo), "vae")], ("dit", "text_encoder", "vae"), check)


def _flux2_bfl_file(s, hub, tmp) -> list:
    return _model_configs([str(s.write_bfl_single_file(hub, s.DEV, tmp / "flux2-dev.safetensors"))])


def _flux2_guidance(found):
    assert found["dit"].config["guidance_embeds"] is True


def _flux2_dit_shapes(config: str, bfl: bool = False):
    def shapes():
        from diffusers import Flux2Transformer2DModel

        from difftune.families.flux2.components import bfl_dit_keys

        c = named(config)
        return meta_shapes(lambda: Flux2Transformer2DModel(**{k: v for k, v in c.items() if k[0] != "_"}),
                           (lambda sd: {"model.diffusion_model." + k: v for k, v in bfl_dit_keys(sd).items()})
                           if bfl else (lambda sd: sd))
    return shapes


def _flux2_qwen3_shapes():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from difftune.families.flux2.components import QWEN3_8B_CONFIG

    return meta_shapes(lambda: Qwen3ForCausalLM(Qwen3Config(**QWEN3_8B_CONFIG)))  # the 8B stores its LM head


def _flux2_mistral_shapes():
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from difftune.parts.mistral3 import MISTRAL3_24B_CONFIG
    from support.parts import v4_layout

    config = Mistral3Config(**{k: v for k, v in MISTRAL3_24B_CONFIG.items() if k != "architectures"})
    return meta_shapes(lambda: Mistral3ForConditionalGeneration(config), v4_layout)


_FLUX2 = "difftune.families.flux2.components:"

# the official folders the scripts name (klein's Qwen3 and dev's Mistral-3 text encoders told apart), BFL's single
# file of the tiny dev DiT, and at the real sizes klein-4B / 9B and dev's DiTs (diffusers' names and BFL's
# single-file layout), Qwen3-8B and Mistral-Small-3.1 in FLUX.2-dev's Mistral-3 file
FLUX2_RECOGNITION = Recognition(
    folders=(_flux2_folders("KLEIN_4B", "KLEIN_4B", "Qwen3Model", False),
             _flux2_folders("KLEIN_BASE_9B", "KLEIN_9B", "Qwen3Model", False),
             _flux2_folders("DEV", "DEV", "MistralModel", True)),
    single_files=(SingleFile("bfl-dev", _flux2_bfl_file, {"dit": "DIT_BFL"}, official=lambda s, hub: s.load_tiny_dev(hub),
                             check=_flux2_guidance),),
    headers=(*(Header(f"dit-{name}", _flux2_dit_shapes(_FLUX2 + config), "DIT", _FLUX2 + config)
               for name, config in (("klein-4b", "FLUX2_KLEIN_4B_CONFIG"), ("klein-9b", "FLUX2_KLEIN_9B_CONFIG"),
                                    ("dev", "FLUX2_DEV_CONFIG"))),
             *(Header(f"bfl-{name}", _flux2_dit_shapes(_FLUX2 + config, bfl=True), "DIT_BFL", _FLUX2 + config,
                      holds=("model.diffusion_model.double_blocks.0.img_attn.qkv.weight",))
               for name, config in (("klein-4b", "FLUX2_KLEIN_4B_CONFIG"), ("dev", "FLUX2_DEV_CONFIG"))),
             Header("qwen3-8b", _flux2_qwen3_shapes, "TEXT_ENCODER_QWEN3", _FLUX2 + "QWEN3_8B_CONFIG"),
             Header("mistral-small-3.1", _flux2_mistral_shapes, "TEXT_ENCODER_MISTRAL",
                    "difftune.parts.mistral3:MISTRAL_SMALL_3_1_TEXT_CONFIG",
                    holds=("language_model.model.layers.39.mlp.down_proj.weight", "vision_tower.ln_pre.weight"))))


def _flux2_diffusers(s, hub):
    import torch
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(hub / s.KLEIN_4B), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _flux2_lora_samples(s, hub, theirs, path):
    """Images (diffusers' latents decoded by its VAE) against difftune's output."""
    import torch

    kw = dict(height=32, width=32, num_inference_steps=2)
    args = dict(generator=torch.Generator().manual_seed(0), guidance_scale=1.0, output_type="latent", **kw)
    with_lora = theirs(prompt="a red circle", **args).images
    args["generator"] = torch.Generator().manual_seed(0)
    base = _flux2_diffusers(s, hub)(prompt="a red circle", **args).images
    mine = fused(FLUX2_LORA, s, hub, path)("a red circle", seed=0, output_type="pt", progress=False, **kw)
    theirs_image = theirs.vae.decode(with_lora).sample.float() / 2 + 0.5
    return (mine - theirs_image.clamp(0, 1)).abs().max().item(), (with_lora - base).abs().max().item()


# ComfyUI's FLUX LoRA key map (comfy/lora.py: for its Flux models, FLUX.2's class included, `transformer.<diffusers
# name>` through comfy/utils.py's flux_to_diffusers) names, per double block, attn.to_q/to_k/to_v and add_q/k/v_proj
# (slices of the fused img/txt qkv), attn.to_out.0, attn.to_add_out, ff.linear_in/out and ff_context.linear_in/out,
# and per single block attn.to_qkv_mlp_proj (linear1) and attn.to_out (linear2)
_FLUX2_COMFYUI_MAP = (r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|"
                      r"to_add_out)|ff\.linear_(in|out)|ff_context\.linear_(in|out))|"
                      r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)")

# on the tiny klein-4B with the reference's target list (every attention projection, both feed-forwards, the single
# blocks' fused projections): diffusers' Flux2KleinPipeline.load_lora_weights (Flux2LoraLoaderMixin) reads the default
# (diffusers) layout; the reference (Flux2ImagePipeline keeps the base pipeline's GeneralLoRALoader; its DiT has
# diffusers' module names) reads `--lora_format comfyui` (diffusers' names behind `diffusion_model.`)
FLUX2_LORA = Lora(
    train=lambda s, hub: ["--model_paths", json.dumps(s.klein_model_paths(hub)), "--tokenizer_path",
                          str(hub / s.KLEIN_4B / "tokenizer")],
    targets="difftune.families.flux2.components:LORA_TARGET_MODULES",
    layouts=(Layout("diffusers", ("--lora_format", "diffusers"), "transformer.", alpha=False,
                    comfyui_map=_FLUX2_COMFYUI_MAP),
             Layout("comfyui", ("--lora_format", "comfyui"), "diffusion_model.", alpha=True,
                    comfyui_map=_FLUX2_COMFYUI_MAP)),
    default="diffusers", modules=5 * 12 + 20 * 2,  # 5 double blocks x 12 modules, 20 single blocks x 2
    ours=lambda s, hub: s.load_tiny_klein(hub), diffusers=_flux2_diffusers, diffusers_reads=("diffusers",),
    strength=("single_transformer_blocks.3.attn.to_qkv_mlp_proj",) * 2, samples=_flux2_lora_samples,
    reference_reads_comfyui=True, reference_moves=1e-4)


# -- Z-Image --------------------------------------------------------------------------------------------------------


def _z_image_workspace(root):
    from support.z_image import write_z_image_script_workspace

    return write_z_image_script_workspace(root)


def _z_image_full(workspace, argv, script):
    from support.z_image import CONTROLNET_REPO

    if flag_value(argv, "--trainable_models") != "controlnet":
        return ("x_pad_token", "layers.0.feed_forward.w1.weight")  # the DiT, prefix removed
    # the released file's own key names: it loads where that one does
    entry = next(e for e in flag_value(argv, "--model_id_with_origin_paths").split(",") if CONTROLNET_REPO in e)
    return _load(workspace / "models" / CONTROLNET_REPO / entry.split(":")[1])


def _z_image_run_checks(script, monkeypatch):
    from difftune.models import quant
    from support.lora_presets import check_merge, record_merges

    quantised = []
    real = quant.quantize_linears
    monkeypatch.setattr(quant, "quantize_linears", lambda module, option, **kw: quantised.append(
        (type(module).__name__, option.method)) or real(module, option, **kw))
    merges = record_merges(monkeypatch)

    def check(run: Run):
        if flag_value(run.argv, "--preset_lora_path"):  # the differential script: ostris' adapter merged into the DiT
            assert check_merge(merges, run.workspace / flag_value(run.argv, "--preset_lora_path")) > 0
        if "trajectory_imitation" in script:
            # it continued from the reference-layout LoRA the script names (rank 32), not from zero
            start = _load(run.workspace / "models" / "train" / "Z-Image-Turbo_lora" / "epoch-4.safetensors")
            key = "layers.0.attention.to_q.lora_B"
            assert (run.saved[f"diffusion_model.{key}.weight"] - start[f"{key}.default.weight"]).abs().max() < 1e-2
        if "quant_training" in script:  # the DiT and the text encoder in NF4, the LoRA on the 4-bit DiT
            assert sorted(quantised) == [("Qwen3Model", "bitsandbytes_nf4"),
                                         ("ZImageTransformer2DModel", "bitsandbytes_nf4")]
        else:
            assert not quantised
    return check


Z_IMAGE_SCRIPTS = Scripts(
    folder="z_image/model_training", workspace=_z_image_workspace, slow=True, once_per_configuration=True,
    snapshot=17, running=16, refusals=(Refusal(*DIFFUSION_TEMPLATES, picks=lambda s: s == "full/ZImage-i2L-v2.sh",
                                               count=1),),
    # the reference's targets on diffusers' modules, in the default (comfyui) layout
    lora_prefix="diffusion_model.", lora_alpha=True,
    lora_modules=frozenset(f"layers.0.{m}" for m in ("attention.to_q", "attention.to_out.0", "feed_forward.w1",
                                                     "feed_forward.w3")),
    full=_z_image_full, notes={"npu_training": "note: --enable_npu_patch"}, run_checks=_z_image_run_checks,
    # the Omni-Base scripts' commented image(s)-to-image commands
    variants=tuple(Variant(f"omni-base-{kind}", f"{kind}/Z-Image-Omni-Base.sh", commented_command,
                           extra_inputs="edit_image", log="features: base, edit, omni") for kind in ("lora", "full")))


def _z_image_controlnet_paths(s, hub) -> list[str]:
    return [s.hub_entry(hub, s.TURBO_REPO, f) for f in ("transformer", "text_encoder", "vae")] + \
        [str(hub / s.CONTROLNET_REPO / s.CONTROLNET_FILES[0])]


def _z_image_with_control(s, hub, tmp, kw, **scale):
    pipe = s.load_tiny_z_image(hub, controlnet=s.CONTROLNET_FILES[0])
    return pipe("a cat", controlnet_image=rgb(tmp / "control.png"), **scale, **kw)


# the model folder of Turbo, a Fun ControlNet's control image, Omni-Base's edit images; the family's flags refused
# for another family
Z_IMAGE_SAMPLE = Sample(
    size=(32, 32), cases=(
        SampleCase("turbo-folder", lambda s, hub, tmp: ["--model_dir", str(hub / s.TURBO_REPO), "--prompt",
                                                        "a red circle"],
                   lambda s, hub, tmp, kw: [s.load_tiny_z_image(hub)("a red circle", **kw)]),
        SampleCase("fun-controlnet-control-image",
                   lambda s, hub, tmp: ["--model_paths", json.dumps(_z_image_controlnet_paths(s, hub)), "--prompt",
                                        "a cat", "--controlnet_image", str(picture(tmp / "control.png", 1)),
                                        "--controlnet_scale", "0.5"],
                   lambda s, hub, tmp, kw: [_z_image_with_control(s, hub, tmp, kw, controlnet_scale=0.5),
                                            _z_image_with_control(s, hub, tmp, kw)]),
        SampleCase("omni-base-edit-images",
                   lambda s, hub, tmp: ["--model_paths", json.dumps(s.omni_model_paths(hub)), "--prompt",
                                        "make it blue", "--tokenizer_path", str(hub / s.TURBO_REPO / "tokenizer"),
                                        *(f for i in range(2) for f in ("--edit_image",
                                                                        str(picture(tmp / f"e{i}.png", 10 + i))))],
                   lambda s, hub, tmp, kw: [s.load_tiny_z_image(hub, dit_repo=s.OMNI_REPO, siglip=True)(
                       "make it blue", edit_image=[rgb(tmp / f"e{i}.png") for i in range(2)], **kw)]),
    ), refused_elsewhere=(("--controlnet_image", "c.png"),))


def _z_image_omni_folders(s, hub) -> list:
    return _model_configs([s.hub_entry(hub, s.OMNI_REPO, "transformer"), s.hub_entry(hub, s.OMNI_REPO, "siglip"),
                           s.hub_entry(hub, s.TURBO_REPO, "text_encoder"), s.hub_entry(hub, s.TURBO_REPO, "vae")])


def _z_image_siglip_feat_dim(want):
    def check(found, s, hub):
        assert found["dit"].config.get("siglip_feat_dim") == want
    return check


def _z_image_original_dit_shapes(config: str):
    def shapes():
        from diffusers import ZImageTransformer2DModel

        from difftune.families.z_image.components import original_dit_keys

        kwargs = {k: v for k, v in named(config).items() if not k.startswith("_")}
        return meta_shapes(lambda: ZImageTransformer2DModel(**kwargs),
                           lambda sd: {"model.diffusion_model." + k: v for k, v in original_dit_keys(sd).items()})
    return shapes


def _z_image_ldm_vae_shapes():
    from diffusers import AutoencoderKL

    from difftune.parts.flux_ae import FLUX1_VAE_CONFIG
    from support import _ldm_vae_from_diffusers  # FLUX's AE layout, which Z-Image ships

    return meta_shapes(lambda: AutoencoderKL(**{k: v for k, v in FLUX1_VAE_CONFIG.items() if k[0] != "_"}),
                       lambda sd: _ldm_vae_from_diffusers(sd, 4))


def _z_image_qwen3_shapes(untied: bool):
    def shapes():
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from difftune.parts.qwen3 import QWEN3_4B_CONFIG

        tied = meta_shapes(lambda: Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B_CONFIG)),
                           lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"})  # tied: not stored
        # a file that stores the head: the backbone is loaded
        return {**tied, "lm_head.weight": (151936, 2560)} if untied else tied
    return shapes


def _z_image_siglip_shapes():
    """The official file keeps transformers 4's `vision_model.` level."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    from difftune.families.z_image.components import SIGLIP2_SO400M_CONFIG

    return meta_shapes(lambda: Siglip2VisionModel(Siglip2VisionConfig(**SIGLIP2_SO400M_CONFIG)),
                       lambda sd: {"vision_model." + k: v for k, v in sd.items()})


def _z_image_fused_qkv(shapes, match):
    assert any(k.endswith("attention.qkv.weight") for k in shapes)


def _z_image_so400m_depth(shapes, match):
    assert match.config["num_hidden_layers"] == 27


_Z_IMAGE = "difftune.families.z_image.components:"

# the official folders the scripts name, ComfyUI's single-file DiT (original names, fused qkv), and at the real sizes
# the original-layout DiT, the LDM-layout VAE, SigLIP2 so400m and Qwen3-4B
Z_IMAGE_RECOGNITION = Recognition(
    folders=(Folders("omni-base", _z_image_omni_folders, ("dit", "image_encoder", "text_encoder", "vae"),
                     _z_image_siglip_feat_dim(32)),  # Omni-Base's DiT, from its config.json
             *(Folders(repo.removesuffix("_REPO").lower(), lambda s, hub, repo=repo: _model_configs([s.hub_entry(hub, getattr(s, repo),
                                                                                             "transformer")]),
                       ("dit",), _z_image_siglip_feat_dim(None)) for repo in ("TURBO_REPO", "BASE_REPO"))),
    single_files=(SingleFile("comfyui-dit", lambda s, hub, tmp: _model_configs([str(s.write_single_files(hub, tmp)["dit"])]),
                             {"dit": "DIT_ORIGINAL"}, official=lambda s, hub: s.load_tiny_z_image(hub)),),
    headers=(*(Header(f"original-dit-{name}", _z_image_original_dit_shapes(_Z_IMAGE + config), "DIT_ORIGINAL",
                      _Z_IMAGE + config, check=_z_image_fused_qkv)
               for name, config in (("turbo", "Z_IMAGE_TRANSFORMER_CONFIG"), ("omni", "Z_IMAGE_OMNI_TRANSFORMER_CONFIG"))),
             Header("ldm-vae", _z_image_ldm_vae_shapes, "VAE_LDM", holds=("encoder.down.0.block.0.conv1.weight",)),
             Header("qwen3-4b", _z_image_qwen3_shapes(False), "TEXT_ENCODER", "difftune.parts.qwen3:QWEN3_4B_CONFIG"),
             Header("qwen3-4b-with-its-head", _z_image_qwen3_shapes(True), "TEXT_ENCODER"),
             Header("siglip2-so400m", _z_image_siglip_shapes, "IMAGE_ENCODER", check=_z_image_so400m_depth)))


def _z_image_diffusers(s, hub):
    import torch
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(hub / s.TURBO_REPO), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _z_image_lora_samples(s, hub, theirs, path):
    import torch

    kw = dict(height=32, width=32, num_inference_steps=2)
    # diffusers' guidance_scale 0 is the reference's cfg_scale 1 (Turbo's sampling)
    args = dict(generator=torch.Generator().manual_seed(0), guidance_scale=0.0, output_type="latent", **kw)
    with_lora = theirs("a red circle", **args).images
    args["generator"] = torch.Generator().manual_seed(0)
    base = _z_image_diffusers(s, hub)("a red circle", **args).images
    mine = fused(Z_IMAGE_LORA, s, hub, path)("a red circle", seed=0, output_type="latent", progress=False, **kw)
    return (mine - with_lora).abs().max().item(), (with_lora - base).abs().max().item()


# ComfyUI's Z-Image map (its comfy/lora.py Lumina2 branch, comfy/utils.py z_image_to_diffusers) names, per block of
# layers / context_refiner / noise_refiner, attention.to_q, to_k, to_v (into the fused qkv), to_out.0 and
# feed_forward.w1, w2, w3; it takes them behind `diffusion_model.`, `transformer.` or bare
_Z_IMAGE_COMFYUI_MAP = r"(layers|context_refiner|noise_refiner)\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123])"

# diffusers' ZImagePipeline.load_lora_weights reads both layouts; the reference's own loader (`pipe.load_lora(pipe.dit,
# path)`) the comfyui one (the default layout's `transformer.` names match none of its modules)
Z_IMAGE_LORA = Lora(
    train=lambda s, hub: ["--model_paths", json.dumps([s.hub_entry(hub, s.TURBO_REPO, f)
                                                       for f in ("transformer", "text_encoder", "vae")])],
    targets="difftune.families.z_image.components:LORA_TARGET_MODULES",
    layouts=(Layout("diffusers", ("--lora_format", "diffusers"), "transformer.", alpha=False,
                    comfyui_map=_Z_IMAGE_COMFYUI_MAP),
             Layout("comfyui", ("--lora_format", "comfyui"), "diffusion_model.", alpha=True,
                    comfyui_map=_Z_IMAGE_COMFYUI_MAP)),
    default="diffusers", modules=7 * (3 + 2 + 2), ours=lambda s, hub: s.load_tiny_z_image(hub),
    diffusers=_z_image_diffusers, diffusers_reads=("diffusers", "comfyui"),
    strength=("layers.0.attention.to_q",) * 2, samples=_z_image_lora_samples, reference_reads_comfyui=True)


# -- ACE-Step 1.5 ----------------------------------------------------------------------------------------------------


def _ace_step_workspace(root):
    from support.ace_step import write_ace_step_script_workspace

    return write_ace_step_script_workspace(root)


def _ace_step_dit_files(workspace: Path, argv) -> list[Path]:
    """The DiT files a script names (its first model: the single file, or the XL's shards)."""
    model_id, _, pattern = flag_value(argv, "--model_id_with_origin_paths").split(",")[0].partition(":")
    return sorted((workspace / "models" / model_id).glob(pattern))


def _ace_step_released(workspace, argv, script):
    """The DiT of the script's release file (`decoder.*`, over its shards) in diffusers' names: what
    `--trainable_models dit` saves with `pipe.dit.` removed."""
    from difftune.families.ace_step.components import dit_from_original

    state = {}
    for path in _ace_step_dit_files(workspace, argv):
        state.update(_load(path))
    return dit_from_original(state)


def _ace_step_xl_trained(saved: dict, workspace: Path) -> None:
    """The XL variant's LoRA: on the wider DiT's modules (hidden 48; the XL's condition_embedder widens the 24-wide
    condition states before cross-attention)."""
    assert saved["transformer.layers.0.self_attn.to_q.lora_A.weight"].shape[1] == 48
    assert saved["transformer.layers.0.cross_attn.to_k.lora_A.weight"].shape[1] == 48
    assert saved["transformer.layers.1.mlp.down_proj.lora_A.weight"].shape[1] == 96
    assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)


ACE_STEP_SCRIPTS = Scripts(
    folder="ace_step/model_training", workspace=_ace_step_workspace, snapshot=19, running=18,
    refusals=(Refusal(*DIFFUSION_TEMPLATES, picks=lambda s: s == "full/acestep15xlsft-vocals2music.sh", count=1),),
    # the reference's targets (q_proj, ..., down_proj) on the DiT's 2 layers, diffusers' layout
    lora_prefix="transformer.", lora_exact=True,
    lora_modules=frozenset(f"layers.{i}.{m}" for i in range(2) for m in (
        *(f"{a}.{p}" for a in ("self_attn", "cross_attn") for p in ("to_q", "to_k", "to_v", "to_out.0")),
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    full=_ace_step_released, once_per_configuration=True, slow=True,
    # the XL scripts resolve as the single file's configuration (the same classes); one trains too: the shards
    # loaded and converted together, a DiT wider than its condition states
    variants=(Variant("xl-shards", "lora/acestep-v15-xl-base.sh", lambda script, tmp: _only_command(script),
                      check=_ace_step_xl_trained),))


def _ace_step_release(s, hub) -> list:
    return _model_configs(s.ace_step_model_paths(hub / s.REPO))


def _ace_step_xl(s, hub) -> list:
    return _model_configs([[str(p) for p in sorted((hub / s.XL_REPO).glob("model-*.safetensors"))],
                           *s.ace_step_model_paths(hub / s.REPO)[1:]])


def _ace_step_release_found(found, s, hub) -> None:
    from difftune.families.ace_step.components import CONDITIONER_ORIGINAL, DIT_ORIGINAL, TEXT_ENCODER, VAE

    assert found["dit"].spec is DIT_ORIGINAL and found["conditioner"].spec is CONDITIONER_ORIGINAL
    assert found["text_encoder"].spec is TEXT_ENCODER and found["vae"].spec is VAE
    assert found["dit"].config["hidden_size"] == 32 and found["dit"].config["encoder_hidden_size"] == 24
    assert found["conditioner"].config["text_hidden_dim"] == found["text_encoder"].config["hidden_size"] == 16
    assert found["vae"].config["decoder_input_channels"] == found["dit"].config["audio_acoustic_hidden_dim"] == 8


def _ace_step_xl_found(found, s, hub) -> None:
    from difftune.families.ace_step.components import CONDITIONER_ORIGINAL, DIT_ORIGINAL

    assert found["dit"].spec is DIT_ORIGINAL and found["conditioner"].spec is CONDITIONER_ORIGINAL
    assert found["dit"].config["hidden_size"] == 48 and found["dit"].config["encoder_hidden_size"] == 24
    assert found["dit"].config["num_attention_heads"] == 3 and found["conditioner"].config["hidden_size"] == 24


def _ace_step_diffusers_folders(s, hub, tmp) -> list:
    """diffusers' layout (`transformer/`, `condition_encoder/`, each with its config.json), saved from the models
    the release file loads to. The condition encoder keeps its silence latent buffer as that load leaves it: the
    release ships the latent apart (silence_latent.pt)."""
    ours = _ace_step_official(s, hub)
    ours.dit.save_pretrained(tmp / "transformer")
    ours.conditioner.save_pretrained(tmp / "condition_encoder")
    return _model_configs([str(tmp / "transformer" / "diffusion_pytorch_model.safetensors"),
                           str(tmp / "condition_encoder" / "diffusion_pytorch_model.safetensors"),
                           *s.ace_step_model_paths(hub / s.REPO)[1:]])


def _ace_step_official(s, hub):
    import torch

    from difftune.families.ace_step import AceStepPipeline

    return AceStepPipeline.from_pretrained(torch_dtype=torch.float32, model_configs=_ace_step_release(s, hub))


def _ace_step_real(build_dit=None, conditioner=False, original=False):
    """The shapes of a real-size DiT (`build_dit`: its config's name) and / or condition encoder, in the release
    file's names (`original`) or diffusers'."""
    def shapes():
        from diffusers import AceStepTransformer1DModel
        from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder

        from difftune.families.ace_step import components as c

        out = {}
        if build_dit:
            kwargs = {k: v for k, v in getattr(c, build_dit).items() if not k.startswith("_")}
            out.update(meta_shapes(lambda: AceStepTransformer1DModel(**kwargs),
                                   c.original_dit_keys if original else (lambda sd: sd)))
        if conditioner:
            kwargs = {k: v for k, v in c.ACE_STEP_CONDITIONER_CONFIG.items() if not k.startswith("_")}
            out.update(meta_shapes(lambda: AceStepConditionEncoder(**kwargs),
                                   c.original_conditioner_keys if original else (lambda sd: sd)))
        if original:  # the FSQ tokenizer the file also holds
            out.update({"tokenizer.quantizer.project_in.weight": (6, 64), "detokenizer.proj_out.weight": (64, 2048)})
        return out
    return shapes


def _ace_step_qwen3_shapes():
    from transformers import Qwen3Config, Qwen3Model

    from difftune.families.ace_step.components import QWEN3_EMBEDDING_06B_CONFIG

    return meta_shapes(lambda: Qwen3Model(Qwen3Config(**QWEN3_EMBEDDING_06B_CONFIG)))


def _ace_step_vae_shapes():
    from diffusers import AutoencoderOobleck

    from difftune.families.ace_step.components import ACE_STEP_VAE_CONFIG

    return meta_shapes(lambda: AutoencoderOobleck(**{k: v for k, v in ACE_STEP_VAE_CONFIG.items()
                                                      if not k.startswith("_")}))


_ACE = "difftune.families.ace_step.components:"
ACE_STEP_RECOGNITION = Recognition(
    folders=(Folders("release", _ace_step_release, ("dit", "conditioner", "text_encoder", "vae"),
                     _ace_step_release_found),
             Folders("xl-shards", _ace_step_xl, ("dit", "conditioner", "text_encoder", "vae"), _ace_step_xl_found)),
    single_files=(SingleFile("diffusers-folders", _ace_step_diffusers_folders,
                             {"dit": "DIT", "conditioner": "CONDITIONER"}, official=_ace_step_official,
                             # the folders hold no silence_latent.pt: the release's
                             load=lambda s, hub: {"silence_latent_config": str(
                                 (hub / s.REPO / s.DIT_FILE).with_name("silence_latent.pt"))}),),
    headers=(Header("turbo-file", _ace_step_real("ACE_STEP_DIT_CONFIG", True, True), "DIT_ORIGINAL",
                    _ACE + "ACE_STEP_DIT_CONFIG", holds=("decoder.proj_in.1.weight", "encoder.text_projector.weight",
                                                         "null_condition_emb")),
             Header("xl-file", _ace_step_real("ACE_STEP_XL_DIT_CONFIG", True, True), "DIT_ORIGINAL",
                    _ACE + "ACE_STEP_XL_DIT_CONFIG", holds=("decoder.layers.31.mlp.down_proj.weight",)),
             Header("dit-diffusers", _ace_step_real("ACE_STEP_DIT_CONFIG"), "DIT", _ACE + "ACE_STEP_DIT_CONFIG",
                    holds=("proj_in_conv.weight",)),
             Header("condition-encoder-diffusers", _ace_step_real(conditioner=True), "CONDITIONER",
                    _ACE + "ACE_STEP_CONDITIONER_CONFIG", holds=("silence_latent",)),
             Header("qwen3-embedding-0.6b", _ace_step_qwen3_shapes, "TEXT_ENCODER",
                    _ACE + "QWEN3_EMBEDDING_06B_CONFIG"),
             Header("oobleck-vae", _ace_step_vae_shapes, "VAE", _ACE + "ACE_STEP_VAE_CONFIG")))


# -- LTX-2 -----------------------------------------------------------------------------------------------------------


def _ltx2_workspace(root):
    from support.ltx2 import write_ltx2_script_workspace

    return write_ltx2_script_workspace(root)


def _ltx2_released(workspace, argv, script):
    """The DiT of the file the script's training command names (the Repackage transformer, JoyAI-Echo's single
    file) in diffusers' names: what `--trainable_models dit` saves with `pipe.dit.` removed."""
    from difftune.families.ltx2.names import dit_to_diffusers

    model_id, _, name = flag_value(argv, "--model_id_with_origin_paths").split(",")[0].partition(":")
    return dit_to_diffusers(_load(workspace / "models" / model_id / name))


LTX2_SCRIPTS = Scripts(
    folder="ltx2/model_training", workspace=_ltx2_workspace, snapshot=11, running=11,
    # the reference's targets (to_k, to_q, to_v, to_out.0) on every attention of the DiT's 2 layers: the video and
    # audio self- and cross-attention and the two cross-modal ones, in the default file's layout (the official
    # names under diffusion_model.: the same paths as diffusers' for these modules)
    lora_prefix="diffusion_model.", lora_exact=True,
    lora_modules=frozenset(f"transformer_blocks.{i}.{a}.{p}" for i in range(2) for a in (
        "attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
        for p in ("to_q", "to_k", "to_v", "to_out.0")),
    full=_ltx2_released, once_per_configuration=True, slow=True)


# -- Stable Diffusion 1.x --------------------------------------------------------------------------------------------


def _sd_workspace(root):
    from support.stable_diffusion import write_sd_script_workspace

    return write_sd_script_workspace(root)


def _sd_released(workspace, argv, script):
    """The whole UNet, `pipe.unet.` removed: diffusers' names, as the released unet/ file."""
    from support.stable_diffusion import REPO

    return _load(workspace / "models" / REPO / "unet" / "diffusion_pytorch_model.safetensors")


def _kohya_canonical(workspace: Path, saved: dict, repo: str = "AI-ModelScope/stable-diffusion-v1-5") -> dict:
    """A kohya file (lora_unet_<path with _>.lora_down / lora_up + alpha) under the UNet's module names."""
    import torch
    from diffusers import UNet2DConditionModel

    config = UNet2DConditionModel.load_config(workspace / "models" / repo / "unet")
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    names = {n.replace(".", "_"): n for n, _ in unet.named_modules() if n}
    out = {}
    for key, value in saved.items():
        flat, _, end = key.removeprefix("lora_unet_").partition(".")
        end = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}.get(end, end)
        out[f"{names[flat]}.{end}"] = value
    return out


SD_SCRIPTS = Scripts(
    folder="stable_diffusion/model_training", workspace=_sd_workspace,
    snapshot=("full/stable-diffusion-v1-5.sh", "lora/stable-diffusion-v1-5.sh"),
    # `--lora_target_modules ""`: the reference's automatic choice on the tiny UNet's 512-wide block (its ResNets'
    # time projections), in kohya's layout (the default for SD 1.x)
    lora_prefix="", lora_exact=True, lora_alpha=True, canonical=_kohya_canonical,
    lora_modules=frozenset({"down_blocks.1.resnets.0.time_emb_proj", "up_blocks.0.resnets.0.time_emb_proj",
                            "up_blocks.0.resnets.1.time_emb_proj"}),
    notes={"lora/": "note: --lora_target_modules \"\": 3 modules of unet chosen as the reference chooses"},
    full=_sd_released)


# the model folder, and kohya's --clip_skip reaching the call
SD_SAMPLE = Sample(
    size=(32, 32), cases=(
        SampleCase("model-folder", lambda s, hub, tmp: ["--model_dir", str(hub / s.REPO), "--prompt", "a red circle"],
                   lambda s, hub, tmp, kw: [s.load_tiny_sd(hub)("a red circle", **kw)]),
        SampleCase("clip-skip", lambda s, hub, tmp: ["--model_dir", str(hub / s.REPO), "--prompt", "a cat",
                                                     "--clip_skip", "2"],
                   lambda s, hub, tmp, kw: [s.load_tiny_sd(hub)("a cat", clip_skip=2, **kw),
                                            s.load_tiny_sd(hub)("a cat", **kw)]),
    ))


# -- Stable Diffusion XL --------------------------------------------------------------------------------------------


def _sdxl_workspace(root):
    from support.stable_diffusion_xl import write_sdxl_script_workspace

    return write_sdxl_script_workspace(root)


def _sdxl_released(workspace, argv, script):
    from support.stable_diffusion_xl import REPO

    return _load(workspace / "models" / REPO / "unet" / "diffusion_pytorch_model.safetensors")


def _sdxl_canonical(workspace: Path, saved: dict) -> dict:
    """--align_to_opensource_format's file: kohya's layout in the original (LDM) UNet names."""
    from difftune.families.stable_diffusion_xl.lora_names import kohya_from_ldm
    from support.stable_diffusion_xl import REPO

    assert all(k.startswith(("lora_unet_input_blocks_", "lora_unet_output_blocks_", "lora_unet_middle_block_"))
               for k in saved), sorted(saved)[:3]
    return _kohya_canonical(workspace, kohya_from_ldm(saved), REPO)




def _sdxl_script_targets() -> frozenset[str]:
    """The 722 modules the reference's SDXL LoRA script names (its --lora_target_modules)."""
    from support import read_reference_script

    argv = read_reference_script(SNAPSHOT / "stable_diffusion_xl/model_training/lora/stable-diffusion-xl-base-1.0.sh"
                                 ).commands[-1]
    return frozenset(flag_value(argv, "--lora_target_modules").split(","))


SDXL_SCRIPTS = Scripts(
    folder="stable_diffusion_xl/model_training", workspace=_sdxl_workspace,
    snapshot=("full/stable-diffusion-xl-base-1.0.sh", "lora/stable-diffusion-xl-base-1.0.sh"),
    # the script's 722 named modules (the tiny UNet has SDXL's blocks), in kohya's layout with the LDM names
    # (--align_to_opensource_format)
    lora_prefix="", lora_exact=True, lora_alpha=True, canonical=_sdxl_canonical, lora_modules=_sdxl_script_targets(),
    full=_sdxl_released)


# -- Anima ----------------------------------------------------------------------------------------------------------


def _anima_workspace(root):
    from support.anima import write_anima_script_workspace

    return write_anima_script_workspace(root)


def _anima_released(workspace, argv, script):
    """The released split file's DiT under difftune's names (`transformer.*` / `text_conditioner.*`: diffusers'
    Cosmos-Predict2 converter and the adapter's own names), `pipe.dit.` removed."""
    from difftune.families.anima.components import convert_original_dit, dit_key
    from support.anima import DIT_FILE, REPO

    return convert_original_dit({dit_key(k): v for k, v in _load(workspace / "models" / REPO / DIT_FILE).items()})


ANIMA_SCRIPTS = Scripts(
    folder="anima/model_training", workspace=_anima_workspace,
    snapshot=("full/anima-preview.sh", "lora/anima-preview.sh"),
    # `--lora_target_modules ""`: the reference's automatic choice on the tiny 512-wide DiT (its blocks' attention
    # and MLP layers; the 32-wide adapter has none), written in the released names behind `diffusion_model.` with
    # an alpha each (ComfyUI's layout, the family's default)
    lora_prefix="diffusion_model.", lora_exact=True, lora_alpha=True,
    lora_modules=frozenset(f"blocks.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.output_proj", "cross_attn.q_proj",
        "cross_attn.output_proj", "mlp.layer1", "mlp.layer2")),
    notes={"lora/": "note: --lora_target_modules \"\": 16 modules of dit chosen as the reference chooses"},
    full=_anima_released)


# -- the manifest ---------------------------------------------------------------------------------------------------

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("ace_step", "support.ace_step", lambda s, root: s.write_tiny_ace_step_hubs(root), scripts=ACE_STEP_SCRIPTS,
           recognition=ACE_STEP_RECOGNITION),
    Family("ltx2", "support.ltx2", lambda s, root: s.write_ltx2_script_workspace(root), scripts=LTX2_SCRIPTS),
    Family("stable_diffusion", "support.stable_diffusion", lambda s, root: s.write_tiny_sd_hub(root),
           scripts=SD_SCRIPTS, sample=SD_SAMPLE),
    Family("stable_diffusion_xl", "support.stable_diffusion_xl", lambda s, root: s.write_tiny_sdxl_hub(root),
           scripts=SDXL_SCRIPTS),
    Family("anima", "support.anima", lambda s, root: s.write_tiny_anima_hub(root), scripts=ANIMA_SCRIPTS),
    Family("ernie_image", "support.ernie_image", lambda s, root: s.write_tiny_ernie_image_hub(root),
           scripts=ERNIE_IMAGE_SCRIPTS, sample=ERNIE_IMAGE_SAMPLE, recognition=ERNIE_IMAGE_RECOGNITION,
           lora=ERNIE_IMAGE_LORA),
    Family("flux2", "support.flux2", lambda s, root: s.write_tiny_flux2_hub(root, dev=True),
           scripts=FLUX2_SCRIPTS, sample=FLUX2_SAMPLE, recognition=FLUX2_RECOGNITION, lora=FLUX2_LORA),
    Family("ideogram4", "support.ideogram4", lambda s, root: s.write_tiny_ideogram4_hub(root),
           scripts=IDEOGRAM4_SCRIPTS),
    Family("krea2", "support.krea2", lambda s, root: s.write_tiny_krea2_hub(root),
           scripts=KREA2_SCRIPTS, sample=KREA2_SAMPLE, lora=KREA2_LORA),
    Family("z_image", "support.z_image", lambda s, root: s.write_tiny_z_image_hub(root),
           scripts=Z_IMAGE_SCRIPTS, sample=Z_IMAGE_SAMPLE, recognition=Z_IMAGE_RECOGNITION, lora=Z_IMAGE_LORA),
)}
