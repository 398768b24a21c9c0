"""Tiny tokenizers built in code (no download), identical in every process: byte-level CLIP and a character
T5 (Unigram), for any family whose text encoders are those."""

from __future__ import annotations


def clip_tokenizer():
    """A CLIP BPE tokenizer with no merges: one token per byte-level character (word ends marked `</w>`)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({c + "</w>": len(alphabet) + i for i, c in enumerate(alphabet)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer():
    """A T5 (Unigram) tokenizer over single characters, hand-scored so it is identical in every process."""
    from transformers import T5Tokenizer

    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


__all__ = ["clip_tokenizer", "t5_tokenizer"]
