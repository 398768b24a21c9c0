"""Qwen-Image's prompt unit (the chat template) and the Qwen2.5-VL encoding the edit feature's prompt unit shares
(edit_plus.py)."""

from __future__ import annotations

import torch

from ...core.common_units import PaddedPromptEmbedder
from .encoding import MAX_SEQUENCE_LENGTH, PROMPT_TEMPLATE, TOKENIZER_MAX_LENGTH


class QwenImagePromptEmbedder(PaddedPromptEmbedder):
    """Encode the prompt with the Qwen-Image chat template."""

    def embed(self, pipe, prompts):
        tokens = pipe.tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts],
                                max_length=TOKENIZER_MAX_LENGTH + pipe.template_drop(PROMPT_TEMPLATE),
                                padding=True, truncation=True, return_tensors="pt")
        return encode(pipe, PROMPT_TEMPLATE, tokens, {}, limit=MAX_SEQUENCE_LENGTH)


def encode(pipe, template: str, tokens: dict, extra: dict, limit: int | None) -> dict:
    """Qwen2.5-VL's last hidden states of the templated prompts, the template's system part dropped, padded and
    masked per prompt."""
    encoder = pipe.text_encoder
    tokens = {k: v.to(pipe.device) for k, v in tokens.items()}
    extra = {k: v.to(pipe.device) for k, v in extra.items()}
    if "pixel_values" in extra:
        extra["pixel_values"] = extra["pixel_values"].to(encoder.dtype)
    # The base model's last hidden state (after the final norm) is what the DiT reads; going round the
    # LM head saves a (tokens x 152k-vocabulary) logits tensor per batch at the real size.
    backbone = getattr(encoder, "model", encoder)
    hidden = backbone(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                      **extra).last_hidden_state
    drop = pipe.template_drop(template)
    pieces = [h[m.bool()][drop:][:limit] for h, m in zip(hidden, tokens["attention_mask"])]
    length = max(p.shape[0] for p in pieces)
    embeds = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, length - p.shape[0])) for p in pieces])
    mask = torch.stack([torch.arange(length, device=embeds.device) < p.shape[0] for p in pieces]).long()
    return {"prompt_embeds": embeds.to(pipe.torch_dtype), "prompt_embeds_mask": mask}
