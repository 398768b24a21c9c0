"""Tiny Qwen-Image repositories in the official layout: the product's writer (`difftune.families.qwen_image.tiny`,
which `difftune example-workspace` runs) and what only the tests use (variants' models and data sets, diffusers'
pipelines on them, the contract suite's registration)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from difftune.families.qwen_image.tiny import (QWEN_IMAGE_SCHEDULER_CONFIG, QWEN_SPECIAL_TOKENS,  # noqa: F401
                                               TinyQwenImageSpec, qwen_tokenizer, tiny_qwen_text_encoder,
                                               tiny_qwen_transformer, tiny_qwen_vae)
from difftune.families.qwen_image.tiny import write_tiny_qwen_image as _write_tiny_qwen_image

from ..common import quiet_hf, register_tiny, TinyFamily, write_example_dataset


def write_tiny_qwen_image(path: str | os.PathLike, spec: TinyQwenImageSpec | None = None, **kw) -> Path:
    """The product's tiny Qwen-Image writer (`difftune.families.qwen_image.tiny`), with the hub libraries quiet."""
    quiet_hf()
    return _write_tiny_qwen_image(path, spec, **kw)


def qwen_vl_processor(folder: str | os.PathLike):
    """transformers' own Qwen2VLProcessor of a `processor/` folder, without its video processor (which needs
    torchvision): what diffusers' edit pipelines call, for parity tests."""
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyQwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(folder)),
                                     tokenizer=Qwen2Tokenizer.from_pretrained(str(folder)), video_processor=None)


def diffusers_qwen_image_edit(root: str | os.PathLike, plus: bool = True):
    """diffusers' QwenImageEditPlusPipeline (or QwenImageEditPipeline) on a repository written by
    `write_tiny_qwen_image(edit_plus=True)` (or `edit=True`)."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    root = Path(root)
    processor = qwen_vl_processor(root / "processor")
    cls = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    pipe = cls(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(root / "scheduler")),
        vae=AutoencoderKLQwenImage.from_pretrained(str(root / "vae")),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(str(root / "text_encoder")).eval(),
        tokenizer=processor.tokenizer, processor=processor,
        transformer=QwenImageTransformer2DModel.from_pretrained(str(root / "transformer")).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_qwen_image_paths(root: str | os.PathLike) -> dict[str, list[str]]:
    """The weight files of a repository written by `write_tiny_qwen_image`, per component, sorted."""
    root = Path(root)
    return {
        "transformer": sorted(str(p) for p in (root / "transformer").glob("diffusion_pytorch_model*.safetensors")),
        "text_encoder": sorted(str(p) for p in (root / "text_encoder").glob("model*.safetensors")),
        "vae": [str(root / "vae" / "diffusion_pytorch_model.safetensors")],
    }


def write_tiny_qwen_image_layered(path: str | os.PathLike, spec: TinyQwenImageSpec | None = None, **kw) -> Path:
    """A tiny Qwen-Image-Layered repository (layered transformer, RGBA VAE) in the layout of `write_tiny_qwen_image`."""
    spec = spec or TinyQwenImageSpec()
    return write_tiny_qwen_image(path, TinyQwenImageSpec(**{**spec.__dict__, "layered": True}), **kw)


def write_layered_dataset(root: str | os.PathLike, n: int = 2, size: tuple[int, int] = (32, 32),
                          layer_num: int = 2) -> Path:
    """A tiny Qwen-Image-Layered data set as the reference's Layered scripts read it: metadata.json rows with
    `image` (a list of RGBA PNG layers, the composite first), `layer_input_image`, `layer_num` and `prompt`."""
    from PIL import Image, ImageDraw

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    colors = [(220, 40, 40), (40, 60, 220), (40, 180, 70), (230, 220, 50)]
    w, h = size
    rows = []
    for i in range(n):
        layers = []
        for k in range(layer_num):  # transparent layers, one shape each
            layer = Image.new("RGBA", size, (0, 0, 0, 0))
            box = (k * w // (layer_num + 1), k * h // (layer_num + 2), w - 1 - k, h - 1 - k * h // 4)
            ImageDraw.Draw(layer).ellipse(box, fill=colors[(i + k) % len(colors)] + (255 - 60 * k,))
            layers.append(layer)
        composite = Image.new("RGBA", size, (255, 255, 255, 255))
        for layer in layers:
            composite = Image.alpha_composite(composite, layer)
        names = []
        for k, img in enumerate([composite] + layers):
            names.append(f"sample_{i + 1}/layer_{k}.png")
            (root / names[-1]).parent.mkdir(exist_ok=True)
            img.save(root / names[-1])
        composite.save(root / f"sample_{i + 1}/input.png")
        rows.append({"image": names, "layer_input_image": f"sample_{i + 1}/input.png", "layer_num": layer_num,
                     "prompt": f"{layer_num} coloured shapes, sample {i + 1}"})
    (root / "metadata.json").write_text(json.dumps(rows, indent=1))
    return root / "metadata.json"


def write_edit_dataset(root: str | os.PathLike, n: int = 2, size: tuple[int, int] = (48, 32)) -> Path:
    """The example data set with an `edit_image` column (each row's edit image: its own image, mirrored)."""
    from PIL import Image, ImageOps

    root = Path(root)
    csv = write_example_dataset(root, n=n, size=size)
    lines = csv.read_text().splitlines()
    rows = ["image,edit_image,prompt"]
    for line in lines[1:]:
        image, prompt = line.split(",", 1)
        ImageOps.mirror(Image.open(root / image)).save(root / f"edit_{image}")
        rows.append(f"{image},edit_{image},{prompt}")
    path = root / "edit.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def _entries(paths, names=("transformer", "text_encoder", "vae")):
    return [paths[c] if len(paths[c]) > 1 else paths[c][0] for c in names]


def _tiny_qwen_image(folder: Path) -> TinyFamily:
    from ..common import TinyVariant
    from difftune.families.qwen_image.components import LORA_TARGET_MODULES

    repo = write_tiny_qwen_image(folder / "repo")
    entries = _entries(tiny_qwen_image_paths(repo))
    size = (48, 32)

    def control(kind, keys, extra):
        return TinyVariant(flags=("--data_file_keys", keys, "--extra_inputs", extra),
                           write_dataset=lambda root: write_control_dataset(root, kind, n=2, size=size))

    variants = {
        # the edit image at its own size: resized to about 1 MP, the tiny VAE's encode took most of the family's
        # contract time (the resize runs in test_qwen_image.py and test_qwen_image_edit_plus.py)
        "edit": TinyVariant(flags=("--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image",
                                   "--edit_image_auto_resize", "false"),
                            write_dataset=lambda root: write_edit_dataset(root, size=size),
                            model_paths=lambda: _entries(tiny_qwen_image_paths(
                                write_tiny_qwen_image(folder / "edit_repo", edit=True)))),
        "context": control("context", "image,context_image", "context_image"),
        "blockwise_controlnet": TinyVariant(
            flags=("--data_file_keys", "image,blockwise_controlnet_image", "--extra_inputs",
                   "blockwise_controlnet_image"),
            write_dataset=lambda root: write_control_dataset(root, "controlnet", n=2, size=size),
            model_paths=lambda: [*entries, str(write_tiny_blockwise_controlnet(folder / "controlnet"))]),
        "eligen": control("eligen", "image,eligen_entity_masks", "eligen_entity_prompts,eligen_entity_masks"),
        "layered": TinyVariant(
            flags=("--data_file_keys", "image,layer_input_image", "--extra_inputs", "layer_num,layer_input_image"),
            write_dataset=lambda root: write_layered_dataset(root, n=2, size=(32, 32), layer_num=1),
            model_paths=lambda: _entries(tiny_qwen_image_paths(write_tiny_qwen_image_layered(folder / "layered")))),
    }
    return TinyFamily(model_paths=entries, lora_base_model="dit", lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=size),
                      flags=("--max_pixels", "4096"),
                      trainable_cases={"text_encoder_lora": (
                          "--lora_base_model", "text_encoder", "--lora_target_modules", "q_proj,v_proj")},
                      optional_slots=("blockwise_controlnet",), variants=variants)


register_tiny("qwen_image", _tiny_qwen_image)




# -- In-Context control, EliGen and the Blockwise ControlNet --------------------------------------------------

def write_tiny_blockwise_controlnet(path: str | os.PathLike, spec: TinyQwenImageSpec | None = None, *,
                                    inpaint: bool = False, zero_init: bool = False, seed: int = 7) -> Path:
    """A tiny Blockwise ControlNet for the tiny DiT of `spec`, laid out as DiffSynth-Studio's
    Qwen-Image-Blockwise-ControlNet-* repositories: one bare `model.safetensors` with the released key names
    (`img_in.*`, `controlnet_blocks.<i>.*`). `zero_init`: as the reference initialises one for training."""
    from safetensors.torch import save_file

    from difftune.families.qwen_image.controlnet import INPAINT_EXTRA_DIM, QwenImageBlockwiseControlNet

    spec = spec or TinyQwenImageSpec()
    torch.manual_seed(seed)
    net = QwenImageBlockwiseControlNet(num_layers=spec.num_layers, additional_in_dim=INPAINT_EXTRA_DIM if inpaint else 0,
                                       dim=spec.num_attention_heads * spec.attention_head_dim)
    if zero_init:
        net.zero_init()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(root / "model.safetensors"))
    return root / "model.safetensors"


def write_tiny_dit_lora(path: str | os.PathLike, rank: int, target_modules: str,
                        spec: TinyQwenImageSpec | None = None, seed: int = 0) -> Path:
    """A LoRA for the tiny DiT in the layout the reference saves (`<module>.lora_A.default.weight`, no prefix),
    as DiffSynth-Studio's released LoRAs (e.g. Qwen-Image-EliGen-V2) that scripts continue from."""
    from safetensors.torch import save_file

    dit = tiny_qwen_transformer(spec or TinyQwenImageSpec())
    targets = target_modules.split(",")
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in dit.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            state[f"{name}.lora_A.default.weight"] = torch.randn(rank, module.in_features, generator=generator) / 100
            state[f"{name}.lora_B.default.weight"] = torch.randn(module.out_features, rank, generator=generator) / 100
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def _shapes_image(size, boxes, back=(30, 30, 30), fore=(230, 230, 230)):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, back)
    for box in boxes:
        ImageDraw.Draw(img).rectangle(box, fill=fore)
    return img


def write_control_dataset(root: str | os.PathLike, kind: str, n: int = 2, size: tuple[int, int] = (48, 32)) -> Path:
    """A tiny data set of the example image data set plus the columns of one control `kind`:
    `context` (context_image, metadata.csv), `controlnet` (blockwise_controlnet_image), `inpaint` (also
    blockwise_controlnet_inpaint_mask) or `eligen` (metadata.json with eligen_entity_prompts and eligen_entity_masks,
    a list of mask files each)."""
    import csv

    root = Path(root)
    write_example_dataset(root, n=n, size=size)
    with open(root / "metadata.csv") as f:
        rows = list(csv.DictReader(f))
    w, h = size
    for i, row in enumerate(rows):
        left = (0, 0, w // 2 - 1, h - 1)
        right = (w // 2, 0, w - 1, h - 1)
        if kind == "context":
            _shapes_image(size, [(w // 4, h // 4, 3 * w // 4, 3 * h // 4)]).save(root / f"context_{i}.png")
            row["context_image"] = f"context_{i}.png"
        elif kind in ("controlnet", "inpaint"):
            _shapes_image(size, [(2 + i, 2, w // 2 + i, h - 3)]).save(root / f"control_{i}.png")
            row["blockwise_controlnet_image"] = f"control_{i}.png"
            if kind == "inpaint":
                _shapes_image(size, [right], back=(0, 0, 0), fore=(255, 255, 255)).save(root / f"mask_{i}.png")
                row["blockwise_controlnet_inpaint_mask"] = f"mask_{i}.png"
        elif kind == "eligen":
            masks = []
            for j, box in enumerate([left, right][: 1 + (i % 2)]):
                _shapes_image(size, [box], back=(0, 0, 0), fore=(255, 255, 255)).save(root / f"entity_{i}_{j}.png")
                masks.append(f"entity_{i}_{j}.png")
            row["eligen_entity_prompts"] = ["a red circle" + " with a dot" * i, "a blue square"][: len(masks)]
            row["eligen_entity_masks"] = masks
        else:
            raise ValueError(f"unknown control data kind {kind!r}")
    if kind == "eligen":
        (root / "metadata.json").write_text(json.dumps(rows, indent=1))
        (root / "metadata.csv").unlink()
        return root / "metadata.json"
    with open(root / "metadata.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return root / "metadata.csv"
