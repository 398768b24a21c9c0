"""FLUX.1 EliGen (entity-level control; DiffSynth-Studio's FLUX.1-dev EliGen LoRAs).

Each entity is a prompt and a mask image (`eligen_entity_prompts`, `eligen_entity_masks`). As the reference's
`FluxImageUnit_EntityControl` and `FluxDiT.process_entity_masks`:

* every entity prompt is encoded by T5 like the prompt (padded to 512 tokens, padding kept), and the DiT's text
  sequence becomes [entity 1, ..., entity N, prompt], all with text ids 0;
* the attention mask lets an entity's text tokens and the image tokens inside its mask attend to each other (the
  prompt's: all image tokens), text tokens attend only within their own segment, image tokens to every image token.

Masks are taken at latent resolution (nearest), a pixel counting where its channels average above mid-grey; a 2x2
patch token is inside when any of its latent pixels is; the token masks and the attention mask are `parts/eligen.py`'s,
shared with Qwen-Image's EliGen. The attention runs through `attention.py`'s processor.
"""

from __future__ import annotations

import torch

from ...core.features import IMAGES, VALUE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list
from ...parts.eligen import entity_samples, entity_token_masks, segment_attention_mask
from ...util import text_list
from .units import VAE_SCALE, t5_hidden

ENTITY_OUTPUTS = ("entity_prompt_embeds", "entity_masks")


class FluxEntityControl(PipelineUnit):
    """Entity prompts (T5, 512 tokens each) and masks -> `entity_prompt_embeds` (B, N, 512, D) and `entity_masks`
    (B, N, tokens). The negative side gets entities only from `negative_eligen_entity_prompts` (else none)."""

    feature = "eligen"
    before = ("FluxEmbeddedGuidance",)
    inputs = ("eligen_entity_masks", "height", "width", "batch_size")
    cfg_inputs = {"entity_prompts": ("eligen_entity_prompts", "negative_eligen_entity_prompts")}
    cfg_outputs = {name: (name, "negative_" + name) for name in ENTITY_OUTPUTS}
    models = ("text_encoder_2",)

    def process(self, pipe, eligen_entity_masks, height, width, batch_size, entity_prompts):
        if entity_prompts is None:
            return dict.fromkeys(ENTITY_OUTPUTS)  # explicit None: this side has no entities
        embeds, token_masks = [], []
        for p, m in entity_samples(entity_prompts, eligen_entity_masks, int(batch_size or 1), "eligen_entity_prompts",
                                   "eligen_entity_masks"):
            embeds.append(t5_hidden(pipe, p))
            token_masks.append(entity_token_masks(m, height, width, VAE_SCALE))
        if len({e.shape[0] for e in embeds}) > 1:
            raise UserError("EliGen: samples of one batch have different numbers of entities (--batch_size 1 avoids "
                            "it)")
        return {"entity_prompt_embeds": torch.stack(embeds).to(pipe.torch_dtype),
                "entity_masks": torch.stack(token_masks).to(pipe.device)}


def eligen_text_and_mask(prompt_embeds: torch.Tensor, entity_prompt_embeds: torch.Tensor, entity_masks: torch.Tensor,
                         image_len: int):
    """(text (B, (N+1)*L, D) = [entity 1, ..., entity N, prompt], attention mask (B, 1, S + I, S + I) bool)."""
    b, n, length, _ = entity_prompt_embeds.shape
    if entity_masks.shape[-1] != image_len:
        raise UserError(f"EliGen: the entity masks cover {entity_masks.shape[-1]} image tokens, the DiT sees "
                        f"{image_len} (EliGen does not combine with reference images)")
    text = torch.cat([entity_prompt_embeds.to(prompt_embeds).flatten(1, 2), prompt_embeds], dim=1)
    segment = torch.cat([torch.arange(n).repeat_interleave(length),
                         torch.full((prompt_embeds.shape[1],), n)]).to(prompt_embeds.device)
    valid = torch.ones(b, text.shape[1], dtype=torch.bool, device=prompt_embeds.device)
    inside = entity_masks.to(prompt_embeds.device) > 0
    regions = torch.cat([inside, torch.ones_like(inside[:, :1])], dim=1)
    return text, segment_attention_mask(valid, segment, regions, image_len)



PROMPTS, MASKS = "eligen_entity_prompts", "eligen_entity_masks"
ON_NEGATIVE = "eligen_enable_on_negative"


class _EliGen(Feature):
    def prepare_call(self, pipe, values, cfg_scale, state):
        """Entity prompts as a list, given with their masks; `eligen_enable_on_negative`: the negative prompt in every
        entity's place on the unguided side."""
        on_negative = values.pop(ON_NEGATIVE, False)
        prompts = text_list(values.get(PROMPTS), PROMPTS, "(call)")
        if (prompts is None) != (values.get(MASKS) is None):
            raise UserError("EliGen needs both eligen_entity_prompts and eligen_entity_masks")
        if prompts is None:
            return
        values[PROMPTS] = prompts
        if on_negative:
            values["negative_" + PROMPTS] = [values["negative_prompt"][0]] * len(prompts)

    def check_values(self, values, where):
        values[PROMPTS] = text_list(values.get(PROMPTS), PROMPTS, where)
        if (values[PROMPTS] is None) != (values.get(MASKS) is None):
            raise UserError(f"{where}: EliGen needs eligen_entity_prompts and eligen_entity_masks (one prompt per mask "
                            f"image), one of them is missing")

    def denoise(self, pipe, call):
        """The entities' tokens before the prompt's, with the regional attention mask."""
        v = call.values
        if v.get("entity_prompt_embeds") is None or v.get("entity_masks") is None:
            return
        call.before_blocks.append(_entities)


def _entities(call) -> None:
    if call.tokens_after is not None:
        raise UserError("EliGen does not combine with reference images (Kontext)")
    v = call.values
    text, call.attention["attention_mask"] = eligen_text_and_mask(call.text, v["entity_prompt_embeds"],
                                                                  v["entity_masks"], call.image_len)
    call.text_ids = torch.cat([call.text_ids.new_zeros(text.shape[1] - call.text_ids.shape[0], 3), call.text_ids])
    call.text = text


ELIGEN = _EliGen("eligen", columns=(PROMPTS, MASKS), model_fn_inputs=ENTITY_OUTPUTS, units=(FluxEntityControl(),),
                 same_length=((PROMPTS, MASKS),),
                 inputs={PROMPTS: VALUE, MASKS: IMAGES}, call_inputs={PROMPTS: None, MASKS: None, ON_NEGATIVE: None},
                 flags={PROMPTS: sample_input("EliGen: an entity's prompt (repeat; one per mask).", repeat=True),
                        MASKS: sample_input("EliGen: an entity's mask (repeat; one per prompt).", repeat=True,
                                            load="RGB")},
                 description="EliGen: entity prompts with regional attention masks")

__all__ = ["ELIGEN", "FluxEntityControl", "eligen_text_and_mask"]
