"""Tiny Qwen-Image repositories in the official layout."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ....testing.common import _quiet_hf, register_tiny, TinyFamily, write_example_dataset


# The official Qwen/Qwen-Image scheduler/scheduler_config.json.
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>"]


@dataclass
class TinyQwenImageSpec:
    """Sizes of a tiny Qwen-Image. Defaults are the smallest that keep every architectural feature."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    axes_dims_rope: tuple = (8, 4, 4)  # sums to attention_head_dim
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    text_intermediate: int = 64
    mrope_section: tuple = (2, 3, 3)  # sums to text head_dim / 2
    vae_base_dim: int = 8
    vae_dim_mult: tuple = (1, 1, 1, 1)  # 4 entries -> x8 spatial downsampling, as the real VAE
    vae_num_res_blocks: int = 1
    zero_cond_t: bool = False
    layered: bool = False  # Qwen-Image-Layered: the "is RGB" embedding, layer-3D RoPE, an RGBA VAE
    seed: int = 0
    extra: dict = field(default_factory=dict)


def qwen_tokenizer():
    """A byte-level Qwen2 tokenizer with no merges (one token per byte) and the Qwen special tokens.

    Hand-built, so its vocabulary is identical in every process (trained tokenizers are not).
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {"<|endoftext|>": 0}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.model_max_length = 2048
    return tok


def tiny_qwen_transformer(spec: TinyQwenImageSpec):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(spec.seed)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=spec.num_layers,
        attention_head_dim=spec.attention_head_dim, num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.text_hidden, guidance_embeds=False, axes_dims_rope=tuple(spec.axes_dims_rope),
        zero_cond_t=spec.zero_cond_t, use_additional_t_cond=spec.layered, use_layer3d_rope=spec.layered,
    )


def tiny_qwen_vae(spec: TinyQwenImageSpec):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(spec.seed + 1)
    return AutoencoderKLQwenImage(base_dim=spec.vae_base_dim, z_dim=16, dim_mult=list(spec.vae_dim_mult),
                                  num_res_blocks=spec.vae_num_res_blocks, temperal_downsample=[False, True, True],
                                  input_channels=4 if spec.layered else 3)


def tiny_qwen_text_encoder(spec: TinyQwenImageSpec, tok):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(spec.seed + 2)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads, num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(spec.mrope_section)},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=spec.text_hidden,
                           fullatt_block_indexes=[1], window_size=112),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def write_tiny_qwen_image(path: str | os.PathLike, spec: TinyQwenImageSpec | None = None, *, edit: bool = False,
                          shard: bool = True, edit_plus: bool = False) -> Path:
    """Write a tiny Qwen-Image (or Qwen-Image-Edit with `edit=True`, Qwen-Image-Edit-2509 with `edit_plus=True`;
    -2511 is that with `TinyQwenImageSpec(zero_cond_t=True)`) repository to `path`.

    Layout, as on the hub: `model_index.json`, `scheduler/`, `tokenizer/`, `transformer/` (sharded
    `diffusion_pytorch_model-0000N-of-0000M.safetensors` + index), `text_encoder/` (sharded
    `model-0000N-of-0000M.safetensors` + index), `vae/diffusion_pytorch_model.safetensors`, and for the
    edit model `processor/`.
    """
    _quiet_hf()
    spec = spec or TinyQwenImageSpec()
    edit = edit or edit_plus
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = qwen_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    transformer = tiny_qwen_transformer(spec)
    text_encoder = tiny_qwen_text_encoder(spec, tok)
    vae = tiny_qwen_vae(spec)
    # Small shard sizes force several shards, as in the real repositories.
    transformer.save_pretrained(root / "transformer", max_shard_size="100KB" if shard else "10GB")
    text_encoder.save_pretrained(root / "text_encoder", max_shard_size="100KB" if shard else "10GB")
    vae.save_pretrained(root / "vae")
    (root / "scheduler").mkdir(exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_IMAGE_SCHEDULER_CONFIG, indent=2))
    index = {
        "_class_name": "QwenImageEditPlusPipeline" if edit_plus else "QwenImageEditPipeline" if edit else
                       "QwenImageLayeredPipeline" if spec.layered else "QwenImagePipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    if edit:
        # The official processor/ folder holds the Qwen2-VL image processor config and the tokenizer.
        # Written piecewise: transformers' Qwen2VLProcessor also wants a video processor (torchvision).
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil().save_pretrained(root / "processor")
        tok.save_pretrained(root / "processor")
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    (root / "difftune_tiny_spec.json").write_text(json.dumps(spec.__dict__, indent=2, default=list))
    return root


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


def write_example_workspace(root: str | os.PathLike) -> Path:
    """`./models/Qwen/Qwen-Image` (a tiny model in the official layout, where hub ids resolve) and
    `./data/example_image_dataset`, so the reference's command lines run unchanged inside `root`."""
    root = Path(root)
    write_tiny_qwen_image(root / "models" / "Qwen" / "Qwen-Image")
    write_example_dataset(root / "data" / "example_image_dataset")
    return root


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
    from ....testing.common import TinyVariant
    from ..components import LORA_TARGET_MODULES

    repo = write_tiny_qwen_image(folder / "repo")
    entries = _entries(tiny_qwen_image_paths(repo))
    size = (48, 32)

    def control(kind, keys, extra):
        return TinyVariant(flags=("--data_file_keys", keys, "--extra_inputs", extra),
                           write_dataset=lambda root: write_control_dataset(root, kind, n=2, size=size))

    variants = {
        "edit": TinyVariant(flags=("--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image"),
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

    from ..controlnet import INPAINT_EXTRA_DIM, QwenImageBlockwiseControlNet

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
