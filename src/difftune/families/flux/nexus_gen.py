"""Nexus-Gen (DiffSynth-Studio/Nexus-GenV2) image editing: a Qwen2.5-VL-7B (`model*.safetensors`, with two extra
tensors: `vision_head`, a hidden -> hidden projection of the last hidden states, and `image_prefill_embeds`, 81
learned input embeddings) reads the instruction with the reference image and predicts the 81 (9 x 9) embeddings of
the edited image in one teacher-forced pass; an embedding merger (`edit_decoder.bin`: `embedding_merger.*`) mixes
them with the reference image's own vision embeddings (bidirectional Qwen2.5-VL decoder layers with 3D RoPE on
positions scaled to a 72 x 72 grid, then an RMSNorm'd MLP projector) into the FLUX DiT's prompt tokens, whose text
position ids place them on the latent grid ((0, r, c) for the target, (1, r, c) for the reference). The DiT
(`edit_decoder.bin`: `pipe.dit.*`, the reference's own FluxDiT names, final modulation in (scale, shift) order) is
FLUX.1-dev; CLIP still gives the pooled vector, T5 is not used.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from ...core.features import IMAGE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec
from ...parts.qwen_vl import QWEN25_VL_7B_CONFIG, load_qwen_vl_processor
from .bfl import convert_bfl_transformer
from .model_fn import one_set
from .components import FLUX1_DEV_TRANSFORMER_CONFIG
from .components import infer_flux_config

NUM_IMAGE_TOKENS = 81  # 9 x 9 merged patches of the 252 x 252 placeholder image

# -- the DiT in the reference's FluxDiT names -------------------------------------------------------------------

_GLOBAL = {"time_embedder.timestep_embedder.0": "time_in.in_layer", "time_embedder.timestep_embedder.2":
           "time_in.out_layer", "guidance_embedder.timestep_embedder.0": "guidance_in.in_layer",
           "guidance_embedder.timestep_embedder.2": "guidance_in.out_layer", "pooled_text_embedder.0":
           "vector_in.in_layer", "pooled_text_embedder.2": "vector_in.out_layer", "context_embedder": "txt_in",
           "x_embedder": "img_in", "final_proj_out": "final_layer.linear",
           "final_norm_out.linear": "final_layer.adaLN_modulation.1"}
_DOUBLE = {"attn.a_to_qkv": "img_attn.qkv", "attn.b_to_qkv": "txt_attn.qkv", "attn.a_to_out": "img_attn.proj",
           "attn.b_to_out": "txt_attn.proj", "attn.norm_q_a": "img_attn.norm.query_norm",
           "attn.norm_k_a": "img_attn.norm.key_norm", "attn.norm_q_b": "txt_attn.norm.query_norm",
           "attn.norm_k_b": "txt_attn.norm.key_norm", "ff_a.0": "img_mlp.0", "ff_a.2": "img_mlp.2",
           "ff_b.0": "txt_mlp.0", "ff_b.2": "txt_mlp.2", "norm1_a.linear": "img_mod.lin",
           "norm1_b.linear": "txt_mod.lin"}
_SINGLE = {"to_qkv_mlp": "linear1", "proj_out": "linear2", "norm.linear": "modulation.lin",
           "norm_q_a": "norm.query_norm", "norm_k_a": "norm.key_norm"}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def diffsynth_dit_to_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference's FluxDiT names -> BFL's (RMSNorm `weight` -> `scale`). The final modulation is stored in
    diffusers' (scale, shift) order in Nexus-Gen's file; BFL's is (shift, scale)."""
    out = {}
    for key, t in state.items():
        module, _, param = key.rpartition(".")
        head, _, rest = module.partition(".")
        if head in ("blocks", "single_blocks"):
            index, _, name = rest.partition(".")
            table = _DOUBLE if head == "blocks" else _SINGLE
            if name not in table:
                raise KeyError(key)
            new = table[name]
            param = "scale" if new.endswith("_norm") else param
            out[f"{'double_blocks' if head == 'blocks' else 'single_blocks'}.{index}.{new}.{param}"] = t
        elif module in _GLOBAL:
            out[f"{_GLOBAL[module]}.{param}"] = _swap_halves(t) if module == "final_norm_out.linear" else t
        else:
            raise KeyError(key)
    return out


def convert_nexus_dit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `pipe.dit.*` tensors of edit_decoder.bin in diffusers' FluxTransformer2DModel names."""
    dit = {k[len("pipe.dit."):]: t for k, t in state.items() if k.startswith("pipe.dit.")}
    if not dit:
        raise KeyError("pipe.dit.")
    return convert_bfl_transformer(diffsynth_dit_to_bfl(dit))


NEXUS_DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="FluxTransformer2DModel",
    known_configs={"DiffSynth-Studio/Nexus-GenV2 edit decoder": dict(FLUX1_DEV_TRANSFORMER_CONFIG)},
    marker_keys=("pipe.dit.x_embedder.weight", "pipe.dit.blocks.0.attn.a_to_qkv.weight"),
    convert_state_dict=convert_nexus_dit, infer_config=infer_flux_config,
    description="Nexus-Gen edit decoder's FLUX.1 DiT (edit_decoder.bin, the reference's FluxDiT names)")


# -- the embedding merger ---------------------------------------------------------------------------------------

class _MergerAttention(torch.nn.Module):
    """Qwen2.5-VL attention without the causal mask (the merger attends both ways), grouped k/v heads."""

    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=True)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=True)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, cos, sin):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb

        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class _MergerLayer(torch.nn.Module):
    def __init__(self, hidden, heads, kv_heads, intermediate, eps):
        super().__init__()
        from transformers import Qwen2Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

        self.self_attn = _MergerAttention(hidden, heads, kv_heads)
        self.mlp = Qwen2MLP(Qwen2Config(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu"))
        self.input_layernorm = Qwen2RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = Qwen2RMSNorm(hidden, eps=eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class NexusGenEmbeddingMerger(ModelMixin, ConfigMixin):
    """Predicted target embeddings (B, n, hidden) [+ reference embeddings (B, m, hidden)] with their (1, 3) grids
    (t, h, w in patches) -> prompt tokens (B, n [+ m], out_channels)."""

    @register_to_config
    def __init__(self, hidden_size: int = 3584, num_attention_heads: int = 28, num_key_value_heads: int = 4,
                 intermediate_size: int = 18944, num_layers: int = 1, out_channels: int = 4096,
                 expand_ratio: int = 4, rms_norm_eps: float = 1e-6, rope_theta: float = 1e6,
                 mrope_section: tuple = (16, 24, 24), spatial_merge_size: int = 2, tokens_per_second: int = 2,
                 base_grid: int = 72):
        super().__init__()
        from transformers.activations import ACT2FN
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

        self.layers = torch.nn.ModuleList([
            _MergerLayer(hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps)
            for _ in range(num_layers)])
        wide = out_channels * expand_ratio
        self.projector = torch.nn.Sequential(
            Qwen2RMSNorm(hidden_size, eps=rms_norm_eps), torch.nn.Linear(hidden_size, wide),
            Qwen2RMSNorm(wide, eps=rms_norm_eps), ACT2FN["silu"], torch.nn.Linear(wide, out_channels),
            Qwen2RMSNorm(out_channels, eps=rms_norm_eps))

    def position_ids(self, grid: torch.Tensor) -> torch.Tensor:
        """(3, B, t*h*w/merge^2) positions of a grid's merged patches: time * tokens_per_second, rows and columns
        scaled so the grid spans the base 72 x 72 grid (fractional), as the reference's merger."""
        c = self.config
        t, h, w = (int(v) for v in grid[0])
        gh, gw = h // c.spatial_merge_size, w // c.spatial_merge_size
        t_idx = (torch.arange(t).view(-1, 1).expand(-1, gh * gw) * c.tokens_per_second).long().flatten()
        h_idx = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten() * (c.base_grid / h)
        w_idx = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten() * (c.base_grid / w)
        ids = torch.stack([t_idx.float(), h_idx.float(), w_idx.float()])
        return ids.unsqueeze(1).expand(-1, grid.shape[0], -1).to(grid.device)

    def rotary(self, position_ids: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                                   device=position_ids.device) / head_dim))
        freqs = position_ids.float()[..., None] * inv_freq  # (3, B, n, head_dim / 2)
        # multimodal RoPE: each section of the frequencies from its own axis (time, row, column)
        freqs = torch.cat([f[i % 3] for i, f in enumerate(freqs.split(list(self.config.mrope_section), dim=-1))],
                          dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, embeds, embeds_grid, ref_embeds=None, ref_embeds_grid=None):
        ids = self.position_ids(embeds_grid)
        x = embeds
        if ref_embeds is not None:
            ids = torch.cat([ids, self.position_ids(ref_embeds_grid)], dim=-1)
            x = torch.cat([embeds, ref_embeds], dim=1)
        cos, sin = self.rotary(ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.projector(x)


NEXUS_MERGER_CONFIG = {"_class_name": "NexusGenEmbeddingMerger", "hidden_size": 3584, "num_attention_heads": 28,
                       "num_key_value_heads": 4, "intermediate_size": 18944, "num_layers": 1, "out_channels": 4096,
                       "expand_ratio": 4}


def convert_nexus_merger(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k[len("embedding_merger."):]: t for k, t in state.items() if k.startswith("embedding_merger.")}
    if not out:
        raise KeyError("embedding_merger.")
    return out


def infer_merger_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    try:
        hidden = shapes["layers.0.input_layernorm.weight"][0]
        kv = shapes["layers.0.self_attn.k_proj.weight"][0]
        intermediate = shapes["layers.0.mlp.gate_proj.weight"][0]
        wide, _ = shapes["projector.1.weight"]
        out = shapes["projector.4.weight"][0]
    except (KeyError, ValueError):
        return None
    # the head size does not show in the weights: the release's 128, or 16 for widths 128 does not divide
    head = 128 if hidden % 128 == 0 else 16
    if hidden % head or kv % head or wide % out:
        return None
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.")}
    return {**NEXUS_MERGER_CONFIG, "hidden_size": hidden, "num_attention_heads": hidden // head,
            "num_key_value_heads": kv // head, "intermediate_size": intermediate, "num_layers": len(layers),
            "out_channels": out, "expand_ratio": wide // out,
            "mrope_section": [head // 8, head * 3 // 16, head * 3 // 16]}


NEXUS_MERGER = ComponentSpec(
    name="nexus_gen_editing_adapter", library="difftune.families.flux.nexus_gen",
    class_name="NexusGenEmbeddingMerger",
    known_configs={"DiffSynth-Studio/Nexus-GenV2 embedding merger": NEXUS_MERGER_CONFIG},
    marker_keys=("embedding_merger.projector.1.weight", "embedding_merger.layers.0.self_attn.q_proj.weight"),
    convert_state_dict=convert_nexus_merger, infer_config=infer_merger_config, companion=True,
    description="Nexus-Gen editing adapter (embedding merger, edit_decoder.bin)")


# -- the autoregressive model -----------------------------------------------------------------------------------

class NexusGenAR(ModelMixin, ConfigMixin):
    """transformers' Qwen2_5_VLForConditionalGeneration (`model`) plus Nexus-Gen's `vision_head` and
    `image_prefill_embeds`. `qwen_config` is the Qwen2_5_VLConfig as a dict."""

    @register_to_config
    def __init__(self, qwen_config: dict | None = None, num_prefill: int = NUM_IMAGE_TOKENS):
        super().__init__()
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        cfg = Qwen2_5_VLConfig(**(qwen_config or {}))
        self.model = Qwen2_5_VLForConditionalGeneration(cfg)
        hidden = cfg.text_config.hidden_size
        self.vision_head = torch.nn.Linear(hidden, hidden, bias=False)
        self.image_prefill_embeds = torch.nn.Embedding(num_prefill, hidden)


def nexus_ar_key(key: str) -> str:
    """Nexus-GenV2's names (transformers 4.49's Qwen2.5-VL: `visual.*`, `model.layers.*`, `lm_head.*`) ->
    `NexusGenAR`'s; idempotent."""
    if key.startswith(("model.model.", "model.lm_head.")) or key.startswith(("vision_head.", "image_prefill_")):
        return key
    if key.startswith("visual."):
        return "model.model." + key
    if key.startswith("model."):
        return "model.model.language_model." + key[len("model."):]
    if key.startswith("lm_head."):
        return "model." + key
    return key


NEXUS_AR = ComponentSpec(
    name="nexus_gen", library="difftune.families.flux.nexus_gen", class_name="NexusGenAR",
    known_configs={"DiffSynth-Studio/Nexus-GenV2 (Qwen2.5-VL-7B)": {
        "_class_name": "NexusGenAR", "qwen_config": dict(QWEN25_VL_7B_CONFIG), "num_prefill": NUM_IMAGE_TOKENS}},
    marker_keys=("vision_head.weight", "image_prefill_embeds.weight", "model.model.visual.patch_embed.proj.weight"),
    normalize_key=nexus_ar_key, foreign_config_classes=("Qwen2_5_VLForConditionalGeneration",),
    description="Nexus-Gen autoregressive model (Qwen2.5-VL-7B + vision head)")


def load_nexus_processor(path_or_config):
    """Nexus-GenV2's `processor/` folder (Qwen2.5-VL's tokenizer and image processor)."""
    return load_qwen_vl_processor(path_or_config, "Nexus-GenV2 processor")


def editing_messages_text(instruction: str) -> str:
    """The reference's editing chat (Qwen2.5 template, no generation prompt), images as vision tokens."""
    if "<image>" not in instruction:
        instruction = "<image> " + instruction
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{instruction}<|im_end|>\n"
            "<|im_start|>assistant\nHere is the image: <image><|im_end|>\n")
    return text.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


def bound_image(image, max_pixels: int = 262640):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(image.height, image.width, factor=28, min_pixels=56 * 56, max_pixels=max_pixels)
    return image.resize((w, h))


@torch.no_grad()
def nexus_target_embeddings(ar: NexusGenAR, processor, instruction: str, reference_image):
    """One teacher-forced pass: (81, hidden) predicted target embeddings, the reference image's (m, hidden) vision
    embeddings, and the grids (2, 3): [reference, placeholder]."""
    from PIL import Image

    images = [bound_image(reference_image.convert("RGB")), Image.new("RGB", (252, 252), (255, 255, 255))]
    inputs = processor(text=[editing_messages_text(instruction)], images=images, padding=True, return_tensors="pt")
    qwen = ar.model
    device = ar.vision_head.weight.device
    ids, mask = inputs["input_ids"].to(device), inputs["attention_mask"].to(device)
    grid = inputs["image_grid_thw"].to(device)
    embeds = qwen.get_input_embeddings()(ids)
    vision = qwen.model.visual(inputs["pixel_values"].to(device, qwen.dtype), grid_thw=grid).pooler_output
    target, reference = vision[-NUM_IMAGE_TOKENS:], vision[:-NUM_IMAGE_TOKENS]
    image_mask = ids == qwen.config.image_token_id
    order = image_mask.cumsum(dim=1)
    ref_mask = image_mask & (order <= reference.shape[0])
    gt_mask = image_mask & ~ref_mask
    embeds = embeds.masked_scatter(ref_mask.unsqueeze(-1).expand_as(embeds), reference.to(embeds.dtype))
    prefill = ar.image_prefill_embeds(torch.arange(NUM_IMAGE_TOKENS, device=device))
    embeds = embeds.masked_scatter(gt_mask.unsqueeze(-1).expand_as(embeds), prefill.to(embeds.dtype))
    position_ids, _ = qwen.model.get_rope_index(ids, image_mask.int(), image_grid_thw=grid, attention_mask=mask)
    hidden = qwen.model.language_model(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask
                                       ).last_hidden_state
    predicted = ar.vision_head(hidden)[:, :-1][gt_mask[:, 1:]]
    return predicted, reference, grid


def editing_text_ids(latent_h: int, latent_w: int, target_grid, reference_grid) -> torch.Tensor:
    """(n + m, 3) text position ids of the merged tokens: each grid's merged patches (grid / 2) placed on the latent
    grid (row * latent_h / grid_h, ...), (0, ...) for the target, (1, ...) for the reference."""
    parts = []
    for first, (_, gh, gw) in ((0.0, target_grid), (1.0, reference_grid)):
        gh, gw = int(gh), int(gw)
        ids = torch.zeros(gh // 2, gw // 2, 3)
        ids[..., 0] = first
        ids[..., 1] = torch.arange(gh // 2)[:, None] * (latent_h / gh)
        ids[..., 2] = torch.arange(gw // 2)[None, :] * (latent_w / gw)
        parts.append(ids.reshape(-1, 3))
    return torch.cat(parts)


class NexusGenEmbedder(PipelineUnit):
    """Nexus-Gen editing: the instruction and `nexus_gen_reference_image` -> the DiT's prompt tokens (the merger's
    output) and their text position ids; stands in for T5 (CLIP still gives the pooled vector)."""

    feature = "nexus_gen"
    inputs = ("prompt", "nexus_gen_reference_image", "height", "width")
    outputs = ("prompt_embeds", "txt_ids")
    models = ("nexus_gen", "nexus_gen_editing_adapter")
    replaces = ("FluxT5Embedder",)

    def process(self, pipe, prompt, nexus_gen_reference_image, height, width):
        from ...media.image import as_image_list
        from ...core.common_units import prompt_list

        if nexus_gen_reference_image is None:
            raise UserError("Nexus-Gen editing needs nexus_gen_reference_image (--data_file_keys "
                            "image,nexus_gen_reference_image --extra_inputs nexus_gen_reference_image)")
        processor = getattr(pipe, "nexus_gen_processor", None)
        if processor is None:
            raise UserError("Nexus-Gen: no processor (the processor/ folder of DiffSynth-Studio/Nexus-GenV2)")
        prompts, images = prompt_list(prompt), as_image_list(nexus_gen_reference_image)
        images = images * len(prompts) if len(images) == 1 else images
        tokens, ids = [], []
        for p, image in zip(prompts, images):
            target, reference, grid = nexus_target_embeddings(pipe.nexus_gen, processor, p, image)
            tokens.append(pipe.nexus_gen_editing_adapter(target[None], grid[1:2], reference[None], grid[0:1])[0])
            ids.append(editing_text_ids(height // 8, width // 8, grid[1].tolist(), grid[0].tolist()))
        if len({t.shape for t in tokens}) > 1:
            raise UserError("nexus_gen_reference_image: images of different sizes in one batch (--batch_size 1 "
                            "avoids it)")
        return {"prompt_embeds": torch.stack(tokens).to(pipe.torch_dtype),
                "txt_ids": torch.stack(ids).to(pipe.device)}


COLUMN = "nexus_gen_reference_image"


class _NexusGen(Feature):
    attributes = {"nexus_gen_processor": None}

    def prepare_call(self, pipe, values, cfg_scale, state):
        if values.get(COLUMN) is not None and cfg_scale != 1.0:
            raise UserError("Nexus-Gen editing samples with cfg_scale 1 (the reference's editing adapter gives the "
                            "positive side only)")

    def denoise(self, pipe, call):
        """The prompt tokens' ids on the latent grid."""
        call.text_ids = one_set(call.values["txt_ids"].to(device=call.device, dtype=call.dtype), COLUMN)


NEXUS_GEN = _NexusGen("nexus_gen", columns=(COLUMN,), models=("nexus_gen",), model_fn_inputs=("txt_ids",),
                      units=(NexusGenEmbedder(),), slots=("nexus_gen", "nexus_gen_editing_adapter"),
                      inputs={COLUMN: IMAGE}, call_inputs={COLUMN: None},
                      flags={COLUMN: sample_input("Nexus-Gen: the image to edit.", load="RGB")},
                      description="Nexus-Gen editing: Qwen2.5-VL's predicted image embeddings as the prompt")
