"""parts/mistral3: every file layout maps onto the language model's backbone, the backbone loaded alone gives the
multimodal model's hidden states, and the config read off the weights rebuilds it."""

from __future__ import annotations

import pytest
import torch

from difftune.parts import mistral3 as m3
from support.parts import mistral_tokenizer, tiny_mistral3, tiny_text_config, v4_layout


def _backbone(model_type: str):
    from transformers import Ministral3Config, Ministral3Model, MistralConfig, MistralModel

    return (Ministral3Model, Ministral3Config) if model_type == "ministral3" else (MistralModel, MistralConfig)


@pytest.mark.parametrize("base,conditional", [(m3.MINISTRAL3_3B_TEXT_CONFIG, False),
                                              (m3.MISTRAL_SMALL_3_1_TEXT_CONFIG, True)])
def test_backbone_from_any_layout_gives_the_multimodal_models_hidden_states(base, conditional):
    tok = mistral_tokenizer()
    cfg = tiny_text_config(base, vocab_size=len(tok))
    model = tiny_mistral3(cfg, conditional_generation=conditional)
    v5 = model.state_dict()
    ids = torch.tensor([tok("a red fox")["input_ids"]])
    with torch.no_grad():
        want = model(input_ids=ids, output_hidden_states=True).hidden_states
    for layout in (v5, v4_layout(v5)):
        state = m3.drop_non_text({m3.text_key(k): v for k, v in layout.items()})
        assert not any(k.startswith(m3.NON_TEXT_PREFIXES) for k in state)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        inferred = m3.text_config_from_weights(shapes, base)
        assert {k: inferred[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")} == {
            k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "intermediate_size", "vocab_size")}
        cls, config_cls = _backbone(base["model_type"])
        backbone = cls(config_cls(**inferred)).eval()
        missing, unexpected = backbone.load_state_dict(state, strict=False)
        assert not unexpected and not [k for k in missing if "rotary" not in k]
        with torch.no_grad():
            got = backbone(input_ids=ids, output_hidden_states=True).hidden_states
        assert len(got) == len(want) == cfg["num_hidden_layers"] + 1
        assert torch.equal(got[-2], want[-2])


def test_keys_of_every_layout():
    cases = {
        "language_model.model.layers.0.mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",  # transformers 4
        "language_model.lm_head.weight": "lm_head.weight",
        "language_model.norm.weight": "norm.weight",  # transformers 5 Mistral3Model
        "model.language_model.embed_tokens.weight": "embed_tokens.weight",  # 5's ForConditionalGeneration
        "model.vision_tower.ln_pre.weight": "vision_tower.ln_pre.weight",
        "multi_modal_projector.linear_1.weight": "multi_modal_projector.linear_1.weight",
        "model.layers.1.self_attn.q_proj.weight": "layers.1.self_attn.q_proj.weight",  # a text-only causal LM
    }
    for key, want in cases.items():
        assert m3.text_key(key) == want
        assert m3.text_key(want) == want  # idempotent
    assert m3.conditional_generation_key("language_model.model.norm.weight") == "model.language_model.norm.weight"
    assert m3.conditional_generation_key("vision_tower.ln_pre.weight") == "model.vision_tower.ln_pre.weight"
    assert m3.conditional_generation_key("language_model.lm_head.weight") == "lm_head.weight"
    assert m3.mistral3_model_key("language_model.model.norm.weight") == "language_model.norm.weight"
    assert m3.mistral3_model_key("model.multi_modal_projector.norm.weight") == "multi_modal_projector.norm.weight"
    with pytest.raises(KeyError):
        m3.drop_non_text({"vision_tower.ln_pre.weight": 0})


def test_whole_model_layouts_load_into_transformers_classes():
    tok = mistral_tokenizer()
    model = tiny_mistral3(tiny_text_config(m3.MISTRAL_SMALL_3_1_TEXT_CONFIG, vocab_size=len(tok)),
                          conditional_generation=True)
    v4 = v4_layout(model.state_dict())
    mapped = {m3.conditional_generation_key(k): v for k, v in v4.items()}
    assert mapped.keys() == model.state_dict().keys()
    assert all(torch.equal(mapped[k], v) for k, v in model.state_dict().items())


def test_config_from_weights_refuses_other_llms():
    shapes = {"embed_tokens.weight": (100, 32), "norm.weight": (32,), "layers.0.self_attn.o_proj.weight": (32, 32),
              "layers.0.mlp.gate_proj.weight": (64, 32), "layers.0.self_attn.q_proj.weight": (32, 32),
              "layers.0.self_attn.k_proj.weight": (16, 32)}
    assert m3.text_config_from_weights(shapes, m3.MINISTRAL3_3B_TEXT_CONFIG)["head_dim"] == 16
    assert m3.text_config_from_weights({**shapes, "layers.0.self_attn.q_norm.weight": (16,)},
                                       m3.MINISTRAL3_3B_TEXT_CONFIG) is None  # Qwen3
    assert m3.text_config_from_weights({**shapes, "layers.0.self_attn.q_proj.bias": (32,)},
                                       m3.MINISTRAL3_3B_TEXT_CONFIG) is None  # Qwen2


def test_official_configs_build_the_official_sizes():
    from transformers import Ministral3Config, Mistral3Config, MistralConfig

    c = Ministral3Config(**m3.MINISTRAL3_3B_TEXT_CONFIG)
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim) == (3072, 26, 128)
    c = MistralConfig(**m3.MISTRAL_SMALL_3_1_TEXT_CONFIG)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads * c.head_dim) == (5120, 40, 4096)
    c = Mistral3Config(**m3.MISTRAL3_24B_CONFIG)
    assert c.text_config.hidden_size == 5120 and c.vision_config.hidden_size == 1024
