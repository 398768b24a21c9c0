"""LoRA-Encoder (DiffSynth-Studio/LoRA-Encoder-FLUX.1-Dev): a FLUX.1 LoRA file becomes conditioning tokens.

Each of the DiT's LoRA layers (the reference's module names: per double block `attn.a_to_qkv`, `attn.a_to_out`,
`ff_a.0`, `ff_a.2`, `norm1_a.linear` and their `b` twins; per single block `to_qkv_mlp`, `proj_out`,
`norm.linear`) is read through `L` learned probe vectors: x (1, L, in) @ A^T @ B^T, a LayerNorm, and a linear
projection per layer type to the embedding width. The tokens of all layers, after one learned special token, go
through CLIP encoder layers (transformers' `CLIPEncoderLayer`, quick-GELU); the special token(s), normed and
projected, are the output (1, num_special_embeds, embed_dim), appended to the prompt tokens.

The released `model.safetensors` uses the reference's names: `embedder.model_dict.blocks___0___attn___a_to_qkv.x`,
`.layer_norm.*`, `embedder.proj_dict.attn___a_to_qkv.*`, `encoders.0.attn.to_q.*` ... `encoders.0.fc1.*`,
`special_embeds`, `final_layer_norm.*`, `final_linear.*`; the CLIP layers' names are mapped to transformers' on
load (`lora_encoder_key`) and back for saving (`lora_encoder_native_keys`).
"""

from __future__ import annotations

import os
import re

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from ...core.features import VALUE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec

# (name suffix, input width, output width) as multiples of the DiT width w; the MLP is 4w
_DOUBLE = (("attn.a_to_qkv", 1, 3), ("attn.a_to_out", 1, 1), ("ff_a.0", 1, 4), ("ff_a.2", 4, 1),
           ("norm1_a.linear", 1, 6), ("attn.b_to_qkv", 1, 3), ("attn.b_to_out", 1, 1), ("ff_b.0", 1, 4),
           ("ff_b.2", 4, 1), ("norm1_b.linear", 1, 6))
_SINGLE = (("to_qkv_mlp", 1, 7), ("proj_out", 5, 1), ("norm.linear", 1, 3))


def lora_layers(width: int, num_double: int, num_single: int) -> list[tuple[str, str, int, int]]:
    """(reference module name, layer type, in, out) of every DiT layer the encoder reads, in its order."""
    out = [(f"blocks.{i}.{s}", s, a * width, b * width) for i in range(num_double) for s, a, b in _DOUBLE]
    out += [(f"single_blocks.{i}.{s}", s, a * width, b * width) for i in range(num_single) for s, a, b in _SINGLE]
    return out


def _key(name: str) -> str:
    return name.replace(".", "___")


class _LoRALayerProbe(torch.nn.Module):
    def __init__(self, num_probes: int, dim_in: int, dim_out: int):
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(1, num_probes, dim_in))
        self.layer_norm = torch.nn.LayerNorm(dim_out)

    def forward(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.x @ lora_a.T.to(self.x.dtype) @ lora_b.T.to(self.x.dtype))


class _LoRAEmbedder(torch.nn.Module):
    def __init__(self, layers, num_probes: int, out_dim: int):
        super().__init__()
        self.layers = layers
        self.model_dict = torch.nn.ModuleDict({_key(n): _LoRALayerProbe(num_probes, i, o) for n, _, i, o in layers})
        proj = {}
        for _, kind, _, o in layers:
            proj.setdefault(_key(kind), torch.nn.Linear(o, out_dim))
        self.proj_dict = torch.nn.ModuleDict(proj)

    def forward(self, lora: dict[str, torch.Tensor]) -> torch.Tensor:
        out = []
        for name, kind, _, _ in self.layers:
            a, b = lora.get(f"{name}.lora_A.weight"), lora.get(f"{name}.lora_B.weight")
            if a is None or b is None:
                raise UserError(f"lora_encoder_inputs: the LoRA has no {name} (the LoRA encoder reads every layer of "
                                f"the DiT; train LoRAs with the default --lora_target_modules)")
            out.append(self.proj_dict[_key(kind)](self.model_dict[_key(name)](a, b)))
        return torch.cat(out, dim=1)


class FluxLoRAEncoder(ModelMixin, ConfigMixin):
    """A FLUX.1 LoRA ({reference name.lora_A/B.weight: tensor}) -> (1, num_special_embeds, embed_dim) tokens."""

    @register_to_config
    def __init__(self, dit_width: int = 3072, num_double_blocks: int = 19, num_single_blocks: int = 38,
                 embed_dim: int = 4096, intermediate_size: int = 8192, num_layers: int = 1,
                 num_attention_heads: int = 32, num_embeds_per_lora: int = 16, num_special_embeds: int = 1):
        super().__init__()
        from transformers import CLIPTextConfig
        from transformers.models.clip.modeling_clip import CLIPEncoderLayer

        layers = lora_layers(dit_width, num_double_blocks, num_single_blocks)
        self.embedder = _LoRAEmbedder(layers, num_embeds_per_lora, embed_dim)
        clip = CLIPTextConfig(hidden_size=embed_dim, intermediate_size=intermediate_size,
                              num_attention_heads=num_attention_heads, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                              attention_dropout=0.0)
        clip._attn_implementation = "sdpa"
        self.encoders = torch.nn.ModuleList([CLIPEncoderLayer(clip) for _ in range(num_layers)])
        self.special_embeds = torch.nn.Parameter(torch.randn(1, num_special_embeds, embed_dim))
        self.final_layer_norm = torch.nn.LayerNorm(embed_dim)
        self.final_linear = torch.nn.Linear(embed_dim, embed_dim)

    def forward(self, lora: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = self.embedder(lora)
        x = torch.cat([self.special_embeds.to(tokens.dtype), tokens], dim=1)
        for layer in self.encoders:
            x = layer(x, None)
        x = x[:, : self.config.num_special_embeds]
        return self.final_linear(self.final_layer_norm(x))


# -- the released names -------------------------------------------------------------------------------------------

_CLIP_NAMES = ((".attn.to_q.", ".self_attn.q_proj."), (".attn.to_k.", ".self_attn.k_proj."),
               (".attn.to_v.", ".self_attn.v_proj."), (".attn.to_out.", ".self_attn.out_proj."),
               (".fc1.", ".mlp.fc1."), (".fc2.", ".mlp.fc2."))


def lora_encoder_key(key: str) -> str:
    """The release's CLIP-layer names (`encoders.0.attn.to_q.weight`) -> transformers' (`encoders.0.self_attn.
    q_proj.weight`); idempotent."""
    if key.startswith("encoders."):
        for old, new in _CLIP_NAMES:
            if old in key and new not in key:
                return key.replace(old, new)
    return key


def lora_encoder_native_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict in the release's names (what the reference loads), for full checkpoints."""
    out = {}
    for key, t in state.items():
        if key.startswith("encoders."):
            for old, new in _CLIP_NAMES:
                key = key.replace(new, old)
        out[key] = t
    return out


def infer_lora_encoder_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    try:
        _, probes, width = shapes["embedder.model_dict.blocks___0___attn___a_to_out.x"]
        _, special, embed = shapes["special_embeds"]
        intermediate = shapes["encoders.0.mlp.fc1.weight"][0]
    except (KeyError, ValueError):
        return None

    def count(pattern):
        ids = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
        return max(ids) + 1 if ids else 0

    # the release's head size is 128 (32 heads of 4096); a smaller width keeps 128 when it can
    head = 128 if embed % 128 == 0 else embed // 2
    return {"_class_name": "FluxLoRAEncoder", "dit_width": width,
            "num_double_blocks": count(r"^embedder\.model_dict\.blocks___(\d+)___"),
            "num_single_blocks": count(r"^embedder\.model_dict\.single_blocks___(\d+)___"),
            "embed_dim": embed, "intermediate_size": intermediate, "num_layers": count(r"^encoders\.(\d+)\."),
            "num_attention_heads": embed // head, "num_embeds_per_lora": probes, "num_special_embeds": special}


LORA_ENCODER_CONFIG = {"_class_name": "FluxLoRAEncoder", "dit_width": 3072, "num_double_blocks": 19,
                       "num_single_blocks": 38, "embed_dim": 4096, "intermediate_size": 8192, "num_layers": 1,
                       "num_attention_heads": 32, "num_embeds_per_lora": 16, "num_special_embeds": 1}

LORA_ENCODER = ComponentSpec(
    name="lora_encoder", library="difftune.families.flux.lora_encoder", class_name="FluxLoRAEncoder",
    known_configs={"DiffSynth-Studio/LoRA-Encoder-FLUX.1-Dev": LORA_ENCODER_CONFIG},
    marker_keys=("special_embeds", "embedder.model_dict.blocks___0___attn___a_to_qkv.x"),
    normalize_key=lora_encoder_key, infer_config=infer_lora_encoder_config,
    description="FLUX.1 LoRA encoder (a LoRA file -> prompt tokens)")


# -- LoRA files as the encoder reads them ---------------------------------------------------------------------

# diffusers' FLUX module -> (reference module, part index, number of parts); q, k, v (+ the single blocks' MLP)
# are fused in the reference's layers
_FUSED_DOUBLE = {"attn.to_q": ("attn.a_to_qkv", 0, 3), "attn.to_k": ("attn.a_to_qkv", 1, 3),
                 "attn.to_v": ("attn.a_to_qkv", 2, 3), "attn.add_q_proj": ("attn.b_to_qkv", 0, 3),
                 "attn.add_k_proj": ("attn.b_to_qkv", 1, 3), "attn.add_v_proj": ("attn.b_to_qkv", 2, 3),
                 "attn.to_out.0": ("attn.a_to_out", 0, 1), "attn.to_add_out": ("attn.b_to_out", 0, 1),
                 "ff.net.0.proj": ("ff_a.0", 0, 1), "ff.net.2": ("ff_a.2", 0, 1),
                 "ff_context.net.0.proj": ("ff_b.0", 0, 1), "ff_context.net.2": ("ff_b.2", 0, 1),
                 "norm1.linear": ("norm1_a.linear", 0, 1), "norm1_context.linear": ("norm1_b.linear", 0, 1)}
_FUSED_SINGLE = {"attn.to_q": ("to_qkv_mlp", 0, 4), "attn.to_k": ("to_qkv_mlp", 1, 4),
                 "attn.to_v": ("to_qkv_mlp", 2, 4), "proj_mlp": ("to_qkv_mlp", 3, 4),
                 "proj_out": ("proj_out", 0, 1), "norm.linear": ("norm.linear", 0, 1)}
_NATIVE = re.compile(r"^(?:pipe\.dit\.)?((?:blocks|single_blocks)\.\d+\..+)\.(lora_A|lora_B)\.weight$")


def reference_lora(adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]], width: int
                   ) -> dict[str, torch.Tensor]:
    """Per-module adapters on diffusers' FLUX modules {path: (A, B, scale)} -> the reference's layers
    {name.lora_A/B.weight}: fused parts with the downs stacked and the up block-diagonal (zero blocks for a part
    not trained: the MLP of a single block is 4 widths), each part's scale (alpha / rank) folded into its up."""
    groups: dict[str, dict[int, tuple]] = {}
    sizes: dict[str, int] = {}
    for path, (a, b, scale) in adapters.items():
        head, _, rest = path.partition(".")
        index, _, module = rest.partition(".")
        table = _FUSED_DOUBLE if head == "transformer_blocks" else _FUSED_SINGLE \
            if head == "single_transformer_blocks" else None
        if table is None or module not in table:
            continue  # a layer the encoder does not read (x_embedder, the final layers, ...)
        name, part, n = table[module]
        ref = f"{'blocks' if head == 'transformer_blocks' else 'single_blocks'}.{index}.{name}"
        groups.setdefault(ref, {})[part] = (a, b * scale)
        sizes[ref] = n
    out = {}
    for ref, parts in groups.items():
        n = sizes[ref]
        if n == 1:
            out[f"{ref}.lora_A.weight"], out[f"{ref}.lora_B.weight"] = parts[0]
            continue
        some_a = next(iter(parts.values()))[0]
        rows = [4 * width if (n == 4 and i == 3) else width for i in range(n)]
        downs, ups = [], []
        for i in range(n):
            a, b = parts.get(i, (some_a.new_zeros(some_a.shape), some_a.new_zeros(rows[i], some_a.shape[0])))
            downs.append(a)
            ups.append(b)
        out[f"{ref}.lora_A.weight"] = torch.cat(downs, dim=0)
        out[f"{ref}.lora_B.weight"] = torch.block_diag(*ups)
    return out


def _file_adapters(path: str) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """The file's raw tensors, and (unless it is in the reference's own names) its DiT adapters on diffusers'
    modules {path: (A, B, alpha / rank)} through difftune's importer."""
    from safetensors import SafetensorError, safe_open

    from ...lora.formats import load_lora_file
    from .bfl import convert_bfl_named_flux_lora

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"lora_encoder_inputs: {path}: not a readable .safetensors LoRA ({e})") from None
    if any(_NATIVE.match(k) for k in raw):
        return raw, {}
    imported = load_lora_file(path, prefixes=("transformer",), converters=(convert_bfl_named_flux_lora,))
    key = imported.select("transformer")
    sd, alphas = imported.components[key], imported.alphas[key]
    adapters = {}
    for name, a in sd.items():
        if name.endswith(".lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            adapters[module] = (a, sd[f"{module}.lora_B.weight"], alphas[module] / a.shape[0])
    return raw, adapters


def read_lora_for_encoder(path: str, width: int | None = None) -> dict[str, torch.Tensor]:
    """A LoRA file as the LoRA encoder reads it (the reference's layer names, fused). Files in the reference's own
    names (`blocks.0.attn.a_to_qkv.lora_A.weight`, what it trains) are taken as they are, as the reference does;
    every other layout difftune reads (diffusers, kohya, ComfyUI, BFL names) is imported and fused, at the strength
    its alphas give (the DiT width, for the zero MLP block of an untrained part, read off the LoRA)."""
    raw, adapters = _file_adapters(path)
    if not adapters:
        return {f"{m.group(1)}.{m.group(2)}.weight": t for k, t in raw.items() if (m := _NATIVE.match(k))}
    if width is None:
        # every block's attention projections take the DiT width
        outs = [a.shape[1] for p, (a, _, _) in adapters.items() if re.search(r"\.attn\.(to_[qkv]|to_out\.0)$", p)]
        if not outs:
            raise UserError(f"lora_encoder_inputs: {path}: not a FLUX.1 DiT LoRA (no attention layer)")
        width = outs[0]
    return reference_lora(adapters, width)


def _per_sample(value, n: int) -> list[list[str]]:
    """`lora_encoder_inputs` as one list of LoRA paths per sample: a path (or a list of paths) for every sample, or
    (a stage-1 batch) one such value per sample."""
    if isinstance(value, (list, tuple)) and n > 1 and len(value) == n:
        return [list(v) if isinstance(v, (list, tuple)) else [v] for v in value]
    paths = list(value) if isinstance(value, (list, tuple)) else [value]
    return [paths] * n


def _path(p) -> str:
    path = getattr(p, "path", p)  # a ModelConfig (the reference's type) or a path
    if isinstance(path, (list, tuple)) and len(path) == 1:
        path = path[0]
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise UserError(f"lora_encoder_inputs: expected a LoRA file path, got {p!r:.60}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UserError(f"lora_encoder_inputs: no such LoRA file: {path} (a path relative to the current folder, as "
                        f"DiffSynth-Studio reads it)")
    return path


class FluxLoRAEncoderInputs(PipelineUnit):
    """`lora_encoder_inputs` (a LoRA file, or a list of them, per sample) -> `lora_encoder_loras`: per sample the
    list of its LoRAs in the encoder's layout (the reference's fused layer names). Reading the files is a unit of its
    own, so a trainable encoder's stage 2 reads the LoRAs from the cache, not the files."""

    feature = "lora_encoder"
    before = ("FluxEmbeddedGuidance",)
    inputs = ("lora_encoder_inputs", "batch_size")
    outputs = ("lora_encoder_loras",)
    batching = {"lora_encoder_loras": "list"}
    skip_without = ("lora_encoder_inputs",)

    def process(self, pipe, lora_encoder_inputs, batch_size):
        per_sample = _per_sample(lora_encoder_inputs, int(batch_size or 1))
        return {"lora_encoder_loras": [[read_lora_for_encoder(_path(p)) for p in paths] for paths in per_sample]}


class FluxLoRAEncoderEmbedder(PipelineUnit):
    """The LoRA encoder: each sample's LoRAs -> `lora_encoder_embeds` (B, n * num_special_embeds, D), one group per
    LoRA in order, times `lora_encoder_scale`; model_fn appends them to the prompt tokens of the positive side only
    (the negative side has none, as the reference's unit adds them to the positive prompt)."""

    feature = "lora_encoder"
    before = ("FluxEmbeddedGuidance",)
    inputs = ("lora_encoder_loras", "lora_encoder_scale")
    outputs = ("lora_encoder_embeds", "negative_lora_encoder_embeds")
    models = ("lora_encoder",)
    skip_without = ("lora_encoder_loras",)

    def process(self, pipe, lora_encoder_loras, lora_encoder_scale):
        encoder = pipe.lora_encoder
        tokens = [torch.cat([encoder(lora) for lora in loras], dim=1) for loras in lora_encoder_loras]
        if len({t.shape for t in tokens}) > 1:
            raise UserError("lora_encoder_inputs: samples of one batch name different numbers of LoRAs "
                            "(--batch_size 1 avoids it)")
        scale = 1.0 if lora_encoder_scale is None else _scale(lora_encoder_scale)
        return {"lora_encoder_embeds": (torch.cat(tokens) * scale).to(pipe.torch_dtype),
                "negative_lora_encoder_embeds": None}


def _scale(value) -> float:
    if isinstance(value, (list, tuple)):
        if len({float(v) for v in value}) > 1:
            raise UserError("lora_encoder_scale: one value per batch (--batch_size 1 avoids it)")
        value = value[0]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"lora_encoder_scale: expected a number, got {value!r:.40}") from None


class _LoRAEncoder(Feature):
    def denoise(self, pipe, call):
        """The LoRAs' tokens after the prompt's (and the value's)."""
        call.text_after.append(call.values["lora_encoder_embeds"])


INPUTS = ("lora_encoder_inputs", "lora_encoder_scale")
LORA_ENCODER_FEATURE = _LoRAEncoder(
    "lora_encoder", columns=INPUTS[:1], models=("lora_encoder",), model_fn_inputs=("lora_encoder_embeds",),
    data_inputs=INPUTS, units=(FluxLoRAEncoderInputs(), FluxLoRAEncoderEmbedder()), slots=("lora_encoder",),
    inputs=dict.fromkeys(INPUTS, VALUE), call_inputs=dict.fromkeys(INPUTS),
    flags={INPUTS[0]: sample_input("LoRA-Encoder: a FLUX.1 LoRA file whose tokens join the prompt.")},
    description="LoRA-Encoder: a LoRA file's tokens after the prompt")
