"""Anima's prompt: Qwen3-0.6B's last hidden states over the prompt padded to 512 tokens (with its attention mask,
the padded positions kept: the LLM adapter reads all 512, as the reference's prompt unit gives them), and the
prompt's T5 token ids (`--tokenizer_t5xxl_path`: SD 3.5's T5-XXL tokenizer; no T5 model), which the DiT's LLM adapter
embeds as its queries. The T5 ids are cut at 512 and not padded; a batch of prompts pads them to its longest with a
mask, which the adapter's self-attention honours and whose positions it zeroes, so each prompt reads as it would
alone (the 512 text tokens after the adapter end in zeros in both)."""

from __future__ import annotations

import torch

from ...core.batch import Pad
from ...core.common_units import PromptEmbedder
from ...errors import UserError
from .components import MAX_SEQUENCE_LENGTH


def qwen_hidden_states(pipe, prompts: list[str]) -> torch.Tensor:
    """(B, 512, D): the last hidden states (after the final norm) of the prompts padded to 512 tokens."""
    if pipe.tokenizer is None:
        raise UserError("no tokenizer: pass --tokenizer_path (Qwen/Qwen3-0.6B's folder) to encode prompts")
    text = pipe.tokenizer(prompts, padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                          return_tensors="pt")
    ids, mask = text.input_ids.to(pipe.device), text.attention_mask.to(pipe.device).bool()
    return pipe.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]


def t5_token_ids(pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) T5 token ids of each prompt (its </s> included, cut at 512), padded to the longest, and their mask."""
    tok = getattr(pipe, "tokenizer_t5xxl", None)
    if tok is None:
        raise UserError("no T5 tokenizer: pass --tokenizer_t5xxl_path (stabilityai/stable-diffusion-3.5-large:"
                        "tokenizer_3/) to encode prompts; the Anima DiT's LLM adapter reads their T5 token ids")
    rows = [tok(p, max_length=MAX_SEQUENCE_LENGTH, truncation=True)["input_ids"] for p in prompts]
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids.to(pipe.device), mask.to(pipe.device)


class AnimaPromptEmbedder(PromptEmbedder):
    """The prompt (and the negative prompt) through Qwen3, and its T5 token ids."""

    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds"),
                   "t5_ids": ("t5_ids", "negative_t5_ids"), "t5_mask": ("t5_mask", "negative_t5_mask")}
    batching = {"t5_ids": Pad("t5_mask")}  # prompts of a batch differ in T5 length

    def embed(self, pipe, prompts: list[str]) -> dict:
        ids, mask = t5_token_ids(pipe, prompts)
        return {"prompt_embeds": qwen_hidden_states(pipe, prompts).to(pipe.torch_dtype), "t5_ids": ids,
                "t5_mask": mask}
