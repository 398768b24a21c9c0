"""ERNIE-Image's prompt through Ministral-3: the second-to-last hidden states of the prompt's tokens (<s> and the
text, no chat template, no padding), each prompt encoded alone as diffusers' `ErnieImagePipeline.encode_prompt` and
the reference's prompt embedder do. An empty prompt is the <s> token alone."""

from __future__ import annotations

import torch

from ...core.common_units import PaddedPromptEmbedder
from ...errors import UserError


def encode_prompt(pipe, prompt: str) -> torch.Tensor:
    """One prompt -> (tokens, hidden) second-to-last hidden states."""
    if pipe.tokenizer is None:
        raise UserError("no tokenizer: pass --tokenizer_path (the model's tokenizer/ folder) to encode prompts")
    ids = pipe.tokenizer(prompt, add_special_tokens=True, truncation=True, padding=False)["input_ids"]
    if not ids:
        bos = pipe.tokenizer.bos_token_id
        ids = [bos if bos is not None else 0]
    ids = torch.tensor([ids], device=pipe.device)
    return pipe.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]


class ErnieImagePromptEmbedder(PaddedPromptEmbedder):
    """The prompt (and the negative prompt) through Ministral-3."""

    def rows(self, pipe, prompts):
        return [encode_prompt(pipe, p) for p in prompts]
