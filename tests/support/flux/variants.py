"""Writers of tiny FLUX.1 variant models, each in its release's on-disk layout and file name:

| release | file | writer |
|---|---|---|
| InstantX/FLUX.1-dev-Controlnet-Union-alpha, jasperai/Flux.1-dev-Controlnet-Upscaler, alimama-creative/FLUX.1-dev-Controlnet-Inpainting-Beta, ByteDance/InfiniteYou InfuseNetModel | diffusion_pytorch_model.safetensors (diffusers' names) | write_tiny_controlnet |
| black-forest-labs/FLUX.1-Fill-dev | flux1-fill-dev.safetensors (BFL's names) | write_tiny_fill_dit |
| black-forest-labs/FLUX.1-Redux-dev | image_encoder/model.safetensors, image_embedder/diffusion_pytorch_model.safetensors | write_tiny_redux |
| InstantX/FLUX.1-dev-IP-Adapter | ip-adapter.bin ({"image_proj", "ip_adapter"} pickle) | write_tiny_ipadapter |
| google/siglip-so400m-patch14-384 | model.safetensors (whole SigLIP: vision + text) | write_tiny_siglip |
| ByteDance/InfiniteYou | image_proj_model.bin ({"image_proj"} pickle, resampler names) | write_tiny_image_proj |

Parameters diffusers initialises to zero (ControlNet output blocks) are drawn at random, so a test of the residuals
can fail. Everything is seeded.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..common import quiet_hf
from .tiny import TinyFluxSpec

TINY_CONTROLNETS = {  # kind -> (double blocks, single blocks, union modes, extra condition channels)
    "union": (2, 1, 10, 0), "upscaler": (2, 0, None, 0), "inpaint": (1, 0, None, 4), "infusenet": (1, 2, None, 0),
}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def tiny_controlnet_config(kind: str, spec: TinyFluxSpec | None = None) -> dict:
    spec = spec or TinyFluxSpec()
    layers, single, modes, extra = TINY_CONTROLNETS[kind]
    config = {"_class_name": "FluxMultiControlNet", "patch_size": 1, "in_channels": 64, "num_layers": layers,
              "num_single_layers": single, "attention_head_dim": spec.attention_head_dim,
              "num_attention_heads": spec.num_attention_heads, "joint_attention_dim": spec.t5_hidden,
              "pooled_projection_dim": spec.clip_hidden, "guidance_embeds": True,
              "axes_dims_rope": list(spec.axes_dims_rope), "num_mode": modes, "conditioning_embedding_channels": None}
    return {**config, "extra_condition_channels": extra} if extra else config


def write_tiny_controlnet(folder: str | os.PathLike, kind: str, spec: TinyFluxSpec | None = None,
                          seed: int = 10) -> Path:
    """`<folder>/diffusion_pytorch_model.safetensors`: a tiny FLUX ControlNet of `kind` (TINY_CONTROLNETS) in
    diffusers' names (every release's layout), random weights (none zero)."""
    from safetensors.torch import save_file

    from difftune.families.flux.controlnet import FluxControlNetWithExtraCondition

    config = tiny_controlnet_config(kind, spec)
    model = FluxControlNetWithExtraCondition.from_config({k: v for k, v in config.items() if k != "_class_name"})
    _randomize(model, seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "diffusion_pytorch_model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def tiny_dit_config(spec: TinyFluxSpec | None = None, **overrides) -> dict:
    """The config of a tiny FLUX transformer of `spec`'s sizes (a variant's: in/out channels, guidance, depth)."""
    spec = spec or TinyFluxSpec()
    config = {"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64, "out_channels": None,
              "num_layers": spec.num_layers, "num_single_layers": spec.num_single_layers,
              "attention_head_dim": spec.attention_head_dim, "num_attention_heads": spec.num_attention_heads,
              "joint_attention_dim": spec.t5_hidden, "pooled_projection_dim": spec.clip_hidden,
              "guidance_embeds": spec.guidance_embeds, "axes_dims_rope": list(spec.axes_dims_rope)}
    return {**config, **overrides}


def tiny_dit(spec: TinyFluxSpec | None = None, seed: int = 20, **overrides):
    """A tiny FluxTransformer2DModel (random, seeded) of `tiny_dit_config(spec, **overrides)`."""
    from diffusers import FluxTransformer2DModel

    config = tiny_dit_config(spec, **overrides)
    torch.manual_seed(seed)
    return FluxTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()


def write_tiny_bfl_dit(path: str | os.PathLike, spec: TinyFluxSpec | None = None, seed: int = 20, extra=None,
                       **overrides) -> Path:
    """A tiny FLUX transformer saved as one file in BFL's names (`extra`: more tensors in the same file)."""
    from safetensors.torch import save_file

    from difftune.families.flux.bfl import bfl_transformer_from_diffusers

    state = bfl_transformer_from_diffusers(tiny_dit(spec, seed, **overrides).state_dict())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in {**state, **(extra or {})}.items()}, str(path))
    return path


def write_tiny_fill_dit(root: str | os.PathLike, spec: TinyFluxSpec | None = None, seed: int = 20,
                        name: str = "flux1-fill-dev.safetensors") -> Path:
    """`<root>/flux1-fill-dev.safetensors`: a tiny FLUX.1 Fill transformer (384 inputs, 64 outputs) in BFL's names."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from difftune.families.flux.bfl import bfl_transformer_from_diffusers

    spec = spec or TinyFluxSpec()
    torch.manual_seed(seed)
    dit = FluxTransformer2DModel(
        patch_size=1, in_channels=384, out_channels=64, num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers, attention_head_dim=spec.attention_head_dim,
        num_attention_heads=spec.num_attention_heads, joint_attention_dim=spec.t5_hidden,
        pooled_projection_dim=spec.clip_hidden, guidance_embeds=True, axes_dims_rope=tuple(spec.axes_dims_rope))
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    save_file({k: v.contiguous() for k, v in bfl_transformer_from_diffusers(dit.state_dict()).items()}, str(path))
    return path


def _tiny_siglip_vision_config(use_head: bool, hidden: int = 128):  # 2 heads of 64, as SigLIP's sizes
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(hidden_size=hidden, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, vision_use_head=use_head)


def write_tiny_redux(root: str | os.PathLike, spec: TinyFluxSpec | None = None, seed: int = 30) -> dict[str, Path]:
    """FLUX.1-Redux-dev's two files under `root`: `image_encoder/model.safetensors` (a tiny SiglipVisionModel, no
    pooling head, with its config.json) and `image_embedder/diffusion_pytorch_model.safetensors` (ReduxImageEncoder
    to the tiny T5 width)."""
    from diffusers import ReduxImageEncoder
    from transformers import SiglipVisionModel

    quiet_hf()
    spec = spec or TinyFluxSpec()
    root = Path(root)
    torch.manual_seed(seed)
    encoder = SiglipVisionModel(_tiny_siglip_vision_config(use_head=False)).eval()
    encoder.save_pretrained(root / "image_encoder")
    torch.manual_seed(seed + 1)
    embedder = ReduxImageEncoder(redux_dim=encoder.config.hidden_size, txt_in_features=spec.t5_hidden)
    embedder.save_pretrained(root / "image_embedder")
    return {"image_encoder": root / "image_encoder" / "model.safetensors",
            "image_embedder": root / "image_embedder" / "diffusion_pytorch_model.safetensors"}


def write_tiny_siglip(root: str | os.PathLike, seed: int = 40) -> Path:
    """`<root>/model.safetensors`: a tiny whole SigLIP (vision tower with its pooling head, and a text tower), as
    google/siglip-so400m-patch14-384 ships it."""
    from safetensors.torch import save_file
    from transformers import SiglipConfig, SiglipModel, SiglipTextConfig

    torch.manual_seed(seed)
    vision = _tiny_siglip_vision_config(use_head=True)
    quiet_hf()
    text = SiglipTextConfig(vocab_size=64, hidden_size=24, intermediate_size=37, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=16, projection_size=128, pad_token_id=1,
                            bos_token_id=2, eos_token_id=3)
    model = SiglipModel(SiglipConfig(text_config=text.to_dict(), vision_config=vision.to_dict())).eval()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / "model.safetensors"))
    model.config.to_json_file(str(root / "config.json"))  # architectures: SiglipModel, as on the hub
    return root / "model.safetensors"


def tiny_ipadapter_config(spec: TinyFluxSpec | None = None, image_embed_dim: int = 128) -> dict:
    spec = spec or TinyFluxSpec()
    return {"image_embed_dim": image_embed_dim, "cross_attention_dim": spec.t5_hidden, "num_tokens": 4,
            "proj_mult": 2, "num_blocks": spec.num_layers + spec.num_single_layers,
            "num_attention_heads": spec.num_attention_heads, "attention_head_dim": spec.attention_head_dim}


def write_tiny_ipadapter(root: str | os.PathLike, spec: TinyFluxSpec | None = None, seed: int = 50) -> Path:
    """`<root>/ip-adapter.bin`: {"image_proj": {proj.0, proj.2, norm}, "ip_adapter": {<i>.to_k_ip, <i>.to_v_ip}}, a
    tiny InstantX FLUX IP-Adapter (one block per DiT block, SigLIP width of `write_tiny_siglip`)."""
    from difftune.families.flux.ipadapter import FluxIPAdapter, ipadapter_native_keys

    model = FluxIPAdapter.from_config(tiny_ipadapter_config(spec))
    _randomize(model, seed)
    flat = ipadapter_native_keys(model.state_dict())
    nested = {"image_proj": {}, "ip_adapter": {}}
    for key, t in flat.items():
        group, _, name = key.partition(".")
        nested[group][name] = t.clone()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    torch.save(nested, root / "ip-adapter.bin")
    return root / "ip-adapter.bin"


def tiny_image_proj_config(spec: TinyFluxSpec | None = None) -> dict:
    spec = spec or TinyFluxSpec()
    return {"embed_dims": 512, "output_dims": spec.t5_hidden, "hidden_dims": 32, "depth": 2, "dim_head": 8,
            "heads": 4, "num_queries": 3, "ffn_ratio": 2}


def write_tiny_image_proj(root: str | os.PathLike, spec: TinyFluxSpec | None = None, seed: int = 60) -> Path:
    """`<root>/image_proj_model.bin`: {"image_proj": a tiny InfiniteYou resampler in the release's names}."""
    from difftune.families.flux.infiniteyou import InfiniteYouImageProjection, image_proj_native_keys

    model = InfiniteYouImageProjection.from_config(tiny_image_proj_config(spec))
    _randomize(model, seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    torch.save({"image_proj": {k: v.clone() for k, v in image_proj_native_keys(model.state_dict()).items()}},
               root / "image_proj_model.bin")
    return root / "image_proj_model.bin"
