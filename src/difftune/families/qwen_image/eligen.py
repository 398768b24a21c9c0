"""Qwen-Image EliGen (entity-level control, DiffSynth-Studio's Qwen-Image-EliGen LoRAs).

Each entity is a prompt and a mask image. The entity prompts are encoded like the prompt, and the DiT's text
sequence becomes [entity 1 tokens, ..., entity N tokens, prompt tokens], each segment with RoPE positions counted
from its own start. An attention mask then lets

* an entity's text tokens and the image tokens inside its mask attend to each other (the prompt's: all of them),
* text tokens attend only to tokens of their own segment,
* image tokens attend to every image token,

as the reference's `process_entity_masks` builds it. Masks are taken at latent resolution (nearest), a pixel
counting where its colour channels average above mid-grey; a 2x2 patch token is inside when any of its latent
pixels is. Padding (samples of a batch with prompts of different lengths) is masked out as well.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import (QwenDoubleStreamAttnProcessor2_0,
                                                                 apply_rotary_emb_qwen)

from ...core.batch import Pad
from ...core.features import RAW, Feature
from ...core.units import PipelineUnit
from ...errors import UserError, row_label
from ...parts.eligen import entity_samples, entity_token_masks, segment_attention_mask
from ...util import text_list
from .encoding import DIVISION_FACTOR, VAE_SCALE
from .feature import loaded, per_prompt

ENTITY_OUTPUTS = ("entity_prompt_embeds", "entity_prompt_embeds_mask", "entity_token_ids", "entity_masks",
                  "entity_masks_mask")


class QwenImageEntityControl(PipelineUnit):
    """`eligen_entity_prompts` (a list of strings) and `eligen_entity_masks` (as many mask images) -> the entity
    prompts' embeddings and token masks. The negative side gets them only from `negative_eligen_entity_prompts`
    (the pipeline sets them with `eligen_enable_on_negative`)."""

    inputs = ("eligen_entity_masks", "height", "width", "batch_size")
    cfg_inputs = {"entity_prompts": ("eligen_entity_prompts", "negative_eligen_entity_prompts")}
    cfg_outputs = {name: (name, "negative_" + name) for name in ENTITY_OUTPUTS}
    models = ("text_encoder",)
    feature = "eligen"
    before = ("QwenImagePromptEmbedder",)  # the family encodes prompts after every image
    batching = {"entity_prompt_embeds": Pad("entity_prompt_embeds_mask"),
                "entity_token_ids": Pad("entity_prompt_embeds_mask"), "entity_masks": Pad("entity_masks_mask")}

    def process(self, pipe, eligen_entity_masks, height, width, batch_size, entity_prompts):
        if entity_prompts is None:
            return dict.fromkeys(ENTITY_OUTPUTS)  # explicit None: the negative side has no entities
        from .prompt import QwenImagePromptEmbedder  # (prompt -> edit_plus: not at import time)

        embeds, ids, token_masks = [], [], []
        for p, m in entity_samples(entity_prompts, eligen_entity_masks, batch_size or 1, "eligen_entity_prompts",
                                   "eligen_entity_masks"):
            enc = QwenImagePromptEmbedder().process(pipe, p)
            lengths = enc["prompt_embeds_mask"].sum(dim=1).tolist()
            embeds.append(torch.cat([e[:n_] for e, n_ in zip(enc["prompt_embeds"], lengths)]))
            ids.append(torch.cat([torch.full((n_,), i, dtype=torch.long) for i, n_ in enumerate(lengths)]))
            token_masks.append(entity_token_masks(m, height, width, VAE_SCALE).to(pipe.device))
        longest, most = max(e.shape[0] for e in embeds), max(t.shape[0] for t in token_masks)

        def pad(t, n_):
            return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, n_ - t.shape[0]))

        return {
            "entity_prompt_embeds": torch.stack([pad(e, longest) for e in embeds]).to(pipe.torch_dtype),
            "entity_prompt_embeds_mask": torch.stack([pad(torch.ones(e.shape[0], dtype=torch.long), longest)
                                                      for e in embeds]).to(pipe.device),
            "entity_token_ids": torch.stack([pad(i, longest) for i in ids]).to(pipe.device),
            "entity_masks": torch.stack([pad(t, most) for t in token_masks]),
            "entity_masks_mask": torch.stack([pad(torch.ones(t.shape[0], dtype=torch.long), most)
                                              for t in token_masks]).to(pipe.device),
        }


# -- the DiT's text sequence and attention mask ----------------------------------------------------------------

def entity_sequence(prompt_embeds, prompt_embeds_mask, entity_prompt_embeds, entity_prompt_embeds_mask,
                    entity_token_ids, entity_masks, entity_masks_mask):
    """The text sequence [entity 1, ..., entity N, prompt] of a batch, laid out alike in every sample (segment e is
    as long as its longest version in the batch) so RoPE positions can be shared.

    Returns (text (B, S, D), valid (B, S) bool, segment of each position (S,), RoPE position within its segment
    (S,), regions (B, N + 1, T): the image tokens each segment's tokens may see)."""
    b, _, dim = prompt_embeds.shape
    n = entity_masks.shape[1]
    e_valid = entity_prompt_embeds_mask.bool()
    counts = torch.stack([((entity_token_ids == e) & e_valid).sum(dim=1) for e in range(n)], dim=1)  # (B, N)
    seg_len = [int(c) for c in counts.max(dim=0).values] + [prompt_embeds.shape[1]]
    total = sum(seg_len)
    text = prompt_embeds.new_zeros(b, total, dim)
    valid = torch.zeros(b, total, dtype=torch.bool, device=prompt_embeds.device)
    start = 0
    for e, length in enumerate(seg_len[:-1]):
        for i in range(b):
            pick = e_valid[i] & (entity_token_ids[i] == e)
            k = int(pick.sum())
            text[i, start:start + k] = entity_prompt_embeds[i][pick].to(text.dtype)
            valid[i, start:start + k] = True
        start += length
    text[:, start:] = prompt_embeds
    valid[:, start:] = True if prompt_embeds_mask is None else prompt_embeds_mask.bool()
    segment = torch.cat([torch.full((length,), s, dtype=torch.long) for s, length in enumerate(seg_len)])
    position = torch.cat([torch.arange(length) for length in seg_len])
    inside = entity_masks > 0
    if entity_masks_mask is not None:
        inside &= entity_masks_mask.bool()[..., None]
    regions = torch.cat([inside, torch.ones_like(inside[:, :1])], 1)
    return text, valid, segment.to(text.device), position.to(text.device), regions


def entity_attention_mask(valid: torch.Tensor, segment: torch.Tensor, regions: torch.Tensor,
                          image_len: int) -> torch.Tensor:
    """(B, 1, S + I, S + I) bool mask over [text, image] tokens (True: may attend). `regions` (B, segments, T)
    covers the noisy image's T tokens; further image tokens (context / edit images of the same size) repeat it."""
    t = regions.shape[-1]
    if image_len % t:
        raise UserError(f"EliGen needs every extra image (context / edit) to have the output's size: {image_len} image "
                        f"tokens are not a multiple of the output's {t}")
    return segment_attention_mask(valid, segment, regions, image_len)


def segment_freqs(dit, img_shapes, position: torch.Tensor, device) -> torch.Tensor:
    """Text RoPE frequencies when every segment counts positions from its own start (as each entity prompt
    alone would)."""
    _, freqs = dit.pos_embed(img_shapes, max_txt_seq_len=int(position.max()) + 1, device=device)
    return freqs[position.to(freqs.device)]


class MaskedJointAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """diffusers' Qwen-Image joint attention, which also takes a full [text, image] x [text, image] mask (diffusers'
    own processor takes only the text padding mask). Without one it is diffusers' processor."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        if attention_mask is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, None,
                                    image_rotary_emb)
        head_dim = attn.inner_dim // attn.heads

        def heads(x):
            return x.unflatten(-1, (-1, head_dim))

        img_q, img_k, img_v = (heads(p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v))
        txt_q, txt_k, txt_v = (heads(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj,
                                                                          attn.add_v_proj))
        img_q, img_k = attn.norm_q(img_q), attn.norm_k(img_k)
        txt_q, txt_k = attn.norm_added_q(txt_q), attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q, img_k = (apply_rotary_emb_qwen(x, img_freqs, use_real=False) for x in (img_q, img_k))
            txt_q, txt_k = (apply_rotary_emb_qwen(x, txt_freqs, use_real=False) for x in (txt_q, txt_k))
        q, k, v = (torch.cat(pair, dim=1) for pair in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(q.dtype)
        n_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out[:, n_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(out[:, :n_txt].contiguous())


def use_masked_attention(dit) -> None:
    for block in dit.transformer_blocks:
        if not isinstance(block.attn.processor, MaskedJointAttnProcessor):
            block.attn.set_processor(MaskedJointAttnProcessor())


def eligen_inputs(dit, prompt_embeds, prompt_embeds_mask, entity_prompt_embeds, entity_prompt_embeds_mask,
                  entity_token_ids, entity_masks, entity_masks_mask, img_shapes, image_len, device):
    """(text, attention mask, text RoPE frequencies) for `transformer_forward`."""
    text, valid, segment, position, regions = entity_sequence(
        prompt_embeds, prompt_embeds_mask, entity_prompt_embeds.to(prompt_embeds.device), entity_prompt_embeds_mask,
        entity_token_ids, entity_masks.to(prompt_embeds.device), entity_masks_mask)
    use_masked_attention(dit)
    return text, entity_attention_mask(valid, segment, regions, image_len), segment_freqs(dit, img_shapes,
                                                                                            position, device)


# -- the feature ---------------------------------------------------------------------------------------------------

class _EliGen(Feature):
    def in_call(self, values):
        return values.get("entity_prompt_embeds") is not None  # the entities are used with their prompts only

    def operators(self, config):
        """Masks are cropped as the training image is (a mask of the image's size stays aligned with it), and one
        too small for the size factor is kept whole: the unit resizes every mask to the latent grid."""
        from ...data import IMAGE_EXTENSIONS, ImageCropAndResize, LoadImage, RouteByExtension, ToAbsolutePath

        f = DIVISION_FACTOR
        height, width = ((None, None) if config.height is None or config.width is None else
                         (-(-config.height // f) * f, -(-config.width // f) * f))
        return {"eligen_entity_masks": ToAbsolutePath(config.dataset_base_path)
                >> RouteByExtension({IMAGE_EXTENSIONS: LoadImage()})
                >> ImageCropAndResize(height, width, config.max_pixels, f, f, keep_small=True)}

    def row_values(self, pipe, data, values):
        row = row_label(data)
        masks = loaded(data.get("eligen_entity_masks"))
        prompts = None if masks is None else \
            text_list(data.get("eligen_entity_prompts"), "eligen_entity_prompts", row)
        if (prompts is None) != (masks is None):
            given = "eligen_entity_prompts" if masks is None else "eligen_entity_masks"
            raise UserError(f"{row}: {given} without its other half (EliGen needs eligen_entity_prompts and "
                            f"eligen_entity_masks, one prompt per mask image)")
        return {"eligen_entity_prompts": prompts, "eligen_entity_masks": masks}

    def call_values(self, given, values):
        """One copy per prompt; `eligen_enable_on_negative`: the negative prompt in every entity's place."""
        prompts = text_list(given.get("eligen_entity_prompts"), "eligen_entity_prompts", "(call)")
        masks = given.get("eligen_entity_masks")
        if (prompts is None) != (masks is None):
            raise UserError("EliGen needs both eligen_entity_prompts and eligen_entity_masks")
        n = values["batch_size"]
        out = {"eligen_entity_prompts": per_prompt(prompts, n), "eligen_entity_masks": per_prompt(masks, n)}
        if given.get("eligen_enable_on_negative") and prompts is not None:
            per = [[negative] * len(prompts) for negative in values["negative_prompt"]]
            out["negative_eligen_entity_prompts"] = per[0] if n == 1 else per
        return out, {}

    def signature(self, sample):
        return ()  # masks are resized to the latent grid: entities of any size share a stage-1 batch

    def denoise(self, pipe, call):
        """The entity prompts before the prompt in the text sequence, with their RoPE positions and the regional
        attention mask, once the image sequence is complete."""
        entity = {name: call.values.get(name) for name in ENTITY_OUTPUTS}

        def entities(call):
            call.text, call.attention_mask, call.txt_freqs = eligen_inputs(
                call.dit, call.text, call.text_mask, img_shapes=call.img_shapes, image_len=call.sequence.shape[1],
                device=call.sequence.device, **entity)
            call.text_mask = None

        call.sequence_hooks.append(entities)


ENTITY_INPUTS = ("eligen_entity_prompts", "eligen_entity_masks")
ELIGEN = _EliGen("eligen", columns=ENTITY_INPUTS, model_fn_inputs=ENTITY_OUTPUTS, same_length=(ENTITY_INPUTS,),
                 units=(QwenImageEntityControl(),), inputs=dict.fromkeys(ENTITY_INPUTS, RAW),
                 call_inputs={**dict.fromkeys(ENTITY_INPUTS), "eligen_enable_on_negative": False},
                 description="EliGen: entity prompts with regional attention masks")
