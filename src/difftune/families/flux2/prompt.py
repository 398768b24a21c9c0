"""FLUX.2's prompt: hidden states of three layers of the text encoder, stacked along the features, over all 512
(padded) tokens; the DiT takes no mask, so the padding is part of the condition, as in diffusers and the reference.

klein: Qwen3 layers 9, 18, 27 of one user turn of Qwen3's chat template, thinking switched off
(`Flux2KleinPipeline._get_qwen3_prompt_embeds`). dev: Mistral-3 layers 10, 20, 30 of a system turn (BFL's system
message, as diffusers ships it) and a user turn (`Flux2Pipeline._get_mistral_3_small_prompt_embeds`).
"""

from __future__ import annotations

import torch

from ...core.common_units import PromptEmbedder
from ...errors import UserError

MAX_SEQUENCE_LENGTH = 512
QWEN3_LAYERS = (9, 18, 27)
MISTRAL3_LAYERS = (10, 20, 30)


def is_mistral(encoder) -> bool:
    return "mistral" in str(getattr(getattr(encoder, "config", None), "model_type", ""))


def _qwen3_inputs(tokenizer, prompts: list[str]):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                     max_length=MAX_SEQUENCE_LENGTH)


def _mistral_inputs(tokenizer, prompts: list[str]):
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    messages = [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                 {"role": "user", "content": [{"type": "text", "text": p.replace("[IMG]", "")}]}] for p in prompts]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True,
                                         return_tensors="pt", padding="max_length", truncation=True,
                                         max_length=MAX_SEQUENCE_LENGTH)


def encode_prompts(pipe, prompts: list[str]) -> torch.Tensor:
    """(B, 512, 3 x hidden) prompt embeddings."""
    if pipe.tokenizer is None:
        raise UserError("no tokenizer: pass --tokenizer_path (the model's tokenizer/ folder) to encode prompts")
    encoder = pipe.text_encoder
    mistral = is_mistral(encoder)
    tokens = (_mistral_inputs if mistral else _qwen3_inputs)(pipe.tokenizer, prompts)
    layers = MISTRAL3_LAYERS if mistral else QWEN3_LAYERS
    out = encoder(input_ids=tokens["input_ids"].to(pipe.device),
                  attention_mask=tokens["attention_mask"].to(pipe.device), output_hidden_states=True, use_cache=False)
    hidden = torch.stack([out.hidden_states[k] for k in layers], dim=1)  # (B, 3, L, D)
    b, n, length, d = hidden.shape
    return hidden.permute(0, 2, 1, 3).reshape(b, length, n * d).to(pipe.torch_dtype)


class Flux2PromptEmbedder(PromptEmbedder):
    """The prompt through the text encoder (Qwen3 for klein, Mistral-3 for dev)."""

    def embed(self, pipe, prompts):
        return {"prompt_embeds": encode_prompts(pipe, prompts)}


__all__ = ["Flux2PromptEmbedder", "MAX_SEQUENCE_LENGTH", "encode_prompts", "is_mistral"]
