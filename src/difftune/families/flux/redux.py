"""FLUX.1 Redux (`black-forest-labs/FLUX.1-Redux-dev`): `image_encoder/model.safetensors` (transformers'
`SiglipVisionModel`, SigLIP so400m at 384 px; slot `flux_redux_image_encoder`) and
`image_embedder/diffusion_pytorch_model.safetensors` (diffusers' `ReduxImageEncoder`: `redux_up` 1152 -> 3 x 4096,
SiLU, `redux_down` -> 4096; slot `flux_redux_image_embedder`). Both load with their own key names.

`FluxReduxPromptEmbedder` (the reference's `FluxImageUnit_ReduxPromptEmbedder`; diffusers' `FluxPriorReduxPipeline`
without text encoders): `flux_redux_image` (384x384 bicubic, in [-1, 1]) -> SigLIP's last hidden states -> the
embedder's tokens, appended to 512 zero "T5" tokens; the pooled CLIP embedding is zero (no
`pooled_prompt_embeds`: model_fn then uses zeros of the DiT's width). This stands in for both prompt units (the
prompt is not read, as in the reference, so T5 and CLIP are not loaded), for the positive and the negative side
alike.
"""

from __future__ import annotations

import torch

from ...core.features import IMAGE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list
from ...models.detect import ComponentSpec
from .ipadapter import SIGLIP_SO400M_VISION_CONFIG, siglip_pixels, siglip_vision_config, siglip_vision_key
from .units import T5_MAX_LENGTH

REDUX_EMBEDDER_CONFIG = {"_class_name": "ReduxImageEncoder", "redux_dim": 1152, "txt_in_features": 4096}


def redux_embedder_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    up, down = shapes.get("redux_up.weight"), shapes.get("redux_down.weight")
    if up is None or down is None or up[0] != 3 * down[0]:
        return None
    return {"_class_name": "ReduxImageEncoder", "redux_dim": up[1], "txt_in_features": down[0]}


REDUX_IMAGE_ENCODER = ComponentSpec(
    name="flux_redux_image_encoder", library="transformers", class_name="SiglipVisionModel",
    config_class_name="SiglipVisionConfig",
    known_configs={"FLUX.1-Redux-dev image_encoder (SigLIP so400m, no head)":
                   {**SIGLIP_SO400M_VISION_CONFIG, "vision_use_head": False},
                   "SigLIP so400m vision tower": SIGLIP_SO400M_VISION_CONFIG},
    marker_keys=("embeddings.patch_embedding.weight", "post_layernorm.weight"), normalize_key=siglip_vision_key,
    infer_config=siglip_vision_config, description="SigLIP image encoder (FLUX.1 Redux)")

REDUX_IMAGE_EMBEDDER = ComponentSpec(
    name="flux_redux_image_embedder", library="diffusers", class_name="ReduxImageEncoder",
    known_configs={"black-forest-labs/FLUX.1-Redux-dev image_embedder": REDUX_EMBEDDER_CONFIG},
    marker_keys=("redux_up.weight", "redux_down.weight"), infer_config=redux_embedder_config,
    description="FLUX.1 Redux image embedder")


def redux_tokens(pipe, images) -> torch.Tensor:
    """Images -> Redux's prompt tokens (n, 729, txt_in_features) (diffusers' encode_image + image_embedder)."""
    encoder, embedder = pipe.flux_redux_image_encoder, pipe.flux_redux_image_embedder
    pixels = siglip_pixels(images, encoder.config.image_size).to(pipe.device, encoder.dtype)
    hidden = encoder(pixel_values=pixels).last_hidden_state
    return embedder(hidden.to(embedder.dtype)).image_embeds


class FluxReduxPromptEmbedder(PipelineUnit):
    """`flux_redux_image` -> prompt_embeds = [512 zero tokens, the image's Redux tokens] on both sides of guidance
    (no pooled embedding: zeros in model_fn). Stands in for the CLIP and T5 units when Redux is used (the prompt text is not read)."""

    feature = "redux"
    replaces = ("FluxClipEmbedder", "FluxT5Embedder")
    inputs = ("flux_redux_image", "batch_size")
    outputs = ("prompt_embeds", "negative_prompt_embeds")
    models = ("flux_redux_image_encoder", "flux_redux_image_embedder")

    def process(self, pipe, flux_redux_image, batch_size):
        if flux_redux_image is None:
            raise UserError("FLUX.1 Redux needs flux_redux_image (the image whose tokens replace the prompt)")
        images = as_image_list(flux_redux_image)
        n = int(batch_size or 1)
        if len(images) not in (1, n):
            raise UserError(f"flux_redux_image: {len(images)} images for {n} sample(s)")
        tokens = redux_tokens(pipe, images).to(pipe.torch_dtype)
        tokens = tokens.expand(n, -1, -1) if tokens.shape[0] == 1 else tokens
        zeros = tokens.new_zeros(n, T5_MAX_LENGTH, tokens.shape[-1])
        prompt = torch.cat([zeros, tokens], dim=1)
        return {"prompt_embeds": prompt, "negative_prompt_embeds": prompt}


COLUMN = "flux_redux_image"
REDUX = Feature("redux", columns=(COLUMN,), models=("flux_redux_image_encoder", "flux_redux_image_embedder"),
                    units=(FluxReduxPromptEmbedder(),),
                    slots=("flux_redux_image_encoder", "flux_redux_image_embedder"), inputs={COLUMN: IMAGE},
                    call_inputs={COLUMN: None},
                    flags={COLUMN: sample_input("FLUX.1 Redux: the image whose variations to make.", load="RGB")},
                    description="FLUX.1 Redux: an image's SigLIP tokens in place of the prompt")


__all__ = ["REDUX", "FluxReduxPromptEmbedder", "REDUX_IMAGE_EMBEDDER", "REDUX_IMAGE_ENCODER", "redux_tokens"]
