"""Krea-2's prompt through Qwen3-VL: the Qwen-Image system prompt, the user's prompt padded to a fixed length, then
the assistant turn's opening after the padding; 12 of the encoder's hidden states stacked per token (diffusers'
`Krea2Pipeline.get_text_hidden_states`, the reference's prompt unit). Positions count real tokens only, so the
suffix after the padding sits where it would without it (both implementations do this)."""

from __future__ import annotations

import torch

from ...core.common_units import PaddedPromptEmbedder
from ...errors import UserError
from .components import TEXT_LAYERS

PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
MAX_SEQUENCE_LENGTH = 512  # tokens the DiT reads per prompt (the prompt, its padding and the suffix)


def token_count(tokenizer, text: str) -> int:
    """Tokens of `text` with this tokenizer (the official one gives 34 for the prefix and 5 for the suffix, which
    diffusers hard-codes)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_hidden_states(pipe, prompts: list[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """(B, max_sequence_length, 12, D) hidden states and the (B, max_sequence_length) bool mask of real tokens."""
    tok = pipe.tokenizer
    if tok is None:
        raise UserError("no tokenizer: pass --tokenizer_path (Qwen/Qwen3-VL-4B-Instruct's folder) to encode prompts")
    prefix, suffix = token_count(tok, PREFIX), token_count(tok, SUFFIX)
    text = tok([PREFIX + p for p in prompts], truncation=True, padding="max_length",
               max_length=max_sequence_length + prefix - suffix, return_tensors="pt")
    tail = tok([SUFFIX] * len(prompts), return_tensors="pt")
    ids = torch.cat([text.input_ids, tail.input_ids], dim=1).to(pipe.device)
    mask = torch.cat([text.attention_mask, tail.attention_mask], dim=1).bool().to(pipe.device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
    encoder = pipe.text_encoder
    depth = encoder.config.text_config.num_hidden_layers
    if depth < TEXT_LAYERS[-1]:
        taps = ", ".join(map(str, TEXT_LAYERS))
        raise UserError(f"the text encoder has {depth} layers; Krea-2 reads its hidden states {taps} "
                        f"(Qwen3-VL-4B has 36)")
    out = encoder(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    hidden = torch.stack([out.hidden_states[i] for i in TEXT_LAYERS], dim=2)
    return hidden[:, prefix:], mask[:, prefix:]


def real_tokens(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's real tokens only (the prompt's, then the suffix's), padded to the longest of the batch.

    The same result as the fixed-length sequence: padded tokens are masked out as keys everywhere in the DiT and never
    read back, and the text has no positions there (no rotary embedding in the text fusion, all text tokens at the
    origin in the blocks), so which tokens are left out and in what order the rest come changes nothing. A prompt of
    40 tokens caches and attends 45 text tokens instead of 512."""
    rows = [h[m] for h, m in zip(hidden, mask)]
    length = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, 0, 0, length - r.shape[0])) for r in rows])
    keep = torch.stack([torch.arange(length, device=embeds.device) < r.shape[0] for r in rows])
    return embeds, keep


class Krea2PromptEmbedder(PaddedPromptEmbedder):
    """The prompt through Qwen3-VL: 12 tapped hidden states per real token and the mask of real tokens."""

    def embed(self, pipe, prompts):
        hidden, mask = real_tokens(*text_hidden_states(pipe, prompts))
        return {"prompt_embeds": hidden.to(pipe.torch_dtype), "prompt_embeds_mask": mask.long()}
