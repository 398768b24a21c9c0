"""Step1X-Edit (stepfun-ai/Step1X-Edit): Qwen2.5-VL-7B reads the edit instruction with the reference image; a
connector turns its last hidden states into the DiT's prompt tokens and pooled vector, at every step (it takes the
timestep); the DiT is FLUX.1's architecture without the guidance embedder, and the reference image's latents follow
the noisy image's tokens with the same position ids (0, row, column); the output's first half is the prediction.

`step1x-edit-i1258.safetensors` holds both the DiT (BFL's names) and the connector (`connector.*`): the connector
is HunyuanVideo's token refiner (diffusers' `HunyuanVideoTokenRefiner`; the release's `connector.S.*` names are
mapped on load) plus `global_proj_out` (the pooled vector, from the masked mean of the hidden states times
(1 + scale_factor)). `vae.safetensors` is FLUX.1's AE in BFL's layout. No CLIP / T5.
"""

from __future__ import annotations

import re

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from PIL import Image

from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError, row_label
from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.qwen_vl import QWEN25_VL_7B_CONFIG, load_qwen_vl_processor, qwen25_vl_key
from .bfl import convert_bfl_transformer
from .components import FLUX1_DEV_TRANSFORMER_CONFIG, infer_flux_config
from .model_fn import model_fn_flux
from .pipeline import FluxBasePipeline
from .units import FluxInputImageEmbedder, FluxNoiseInitializer, FluxShapeChecker


class Step1XConnector(ModelMixin, ConfigMixin):
    """Qwen2.5-VL hidden states (B, L, in_channels) + mask (B, L) + timestep/1000 (B,) -> prompt tokens
    (B, L, heads * head_dim) and the pooled vector (B, pooled_dim)."""

    @register_to_config
    def __init__(self, in_channels: int = 3584, num_attention_heads: int = 32, attention_head_dim: int = 128,
                 num_layers: int = 2, pooled_dim: int = 768):
        super().__init__()
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTokenRefiner

        self.refiner = HunyuanVideoTokenRefiner(in_channels, num_attention_heads, attention_head_dim, num_layers)
        self.global_proj_out = torch.nn.Linear(in_channels, pooled_dim)
        self.scale_factor = torch.nn.Parameter(torch.full((1,), -0.91))

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, mask: torch.Tensor):
        m = mask.to(hidden_states.dtype).unsqueeze(-1)
        mean = (hidden_states * m).sum(dim=1) / m.sum(dim=1) * (1 + self.scale_factor.to(hidden_states.dtype))
        pooled = self.global_proj_out(mean)
        tokens = self.refiner(hidden_states, timestep.reshape(-1).expand(hidden_states.shape[0]), mask)
        return tokens, pooled


STEP1X_CONNECTOR_CONFIG = {"_class_name": "Step1XConnector", "in_channels": 3584, "num_attention_heads": 32,
                           "attention_head_dim": 128, "num_layers": 2, "pooled_dim": 768}

# the release's refiner names (after `connector.S.`) -> diffusers' HunyuanVideoTokenRefiner's
_REFINER = (("input_embedder.", "proj_in."), ("t_embedder.mlp.0.", "time_text_embed.timestep_embedder.linear_1."),
            ("t_embedder.mlp.2.", "time_text_embed.timestep_embedder.linear_2."),
            ("c_embedder.linear_1.", "time_text_embed.text_embedder.linear_1."),
            ("c_embedder.linear_2.", "time_text_embed.text_embedder.linear_2."))
_BLOCK = (("norm1.", "norm1."), ("norm2.", "norm2."), ("self_attn_proj.", "attn.to_out.0."),
          ("mlp.fc1.", "ff.net.0.proj."), ("mlp.fc2.", "ff.net.2."), ("adaLN_modulation.1.", "norm_out.linear."))
_BLOCK_RE = re.compile(r"^individual_token_refiner\.blocks\.(\d+)\.(.+)$")


def convert_step1x_connector(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `connector.*` tensors of step1x-edit-i1258.safetensors in `Step1XConnector`'s names (the DiT's are
    left out); the fused qkv of each refiner block is split into diffusers' to_q / to_k / to_v."""
    out = {}
    for key, t in state.items():
        if not key.startswith("connector."):
            continue
        name = key[len("connector."):]
        if name in ("scale_factor",) or name.startswith("global_proj_out."):
            out[name] = t
            continue
        if not name.startswith("S."):
            raise KeyError(key)
        name = name[2:]
        m = _BLOCK_RE.match(name)
        if m is None:
            new = next((n + name[len(o):] for o, n in _REFINER if name.startswith(o)), None)
            if new is None:
                raise KeyError(key)
            out["refiner." + new] = t
            continue
        index, rest = m.groups()
        prefix = f"refiner.token_refiner.refiner_blocks.{index}."
        if rest.startswith("self_attn_qkv."):
            param = rest[len("self_attn_qkv."):]
            for part, chunk in zip(("to_q", "to_k", "to_v"), t.chunk(3, dim=0)):
                out[f"{prefix}attn.{part}.{param}"] = chunk
            continue
        new = next((n + rest[len(o):] for o, n in _BLOCK if rest.startswith(o)), None)
        if new is None:
            raise KeyError(key)
        out[prefix + new] = t
    if not out:
        raise KeyError("connector.")
    return out


def infer_connector_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    try:
        hidden, in_channels = shapes["refiner.proj_in.weight"]
        pooled = shapes["global_proj_out.weight"][0]
    except (KeyError, ValueError):
        return None
    blocks = {int(m.group(1)) for k in shapes if (m := re.match(r"^refiner\.token_refiner\.refiner_blocks\.(\d+)\.", k))}
    # the release's heads are 128 wide (32 of 4096); the weights do not show the split
    head = 128 if hidden % 128 == 0 else hidden // 2
    return {"_class_name": "Step1XConnector", "in_channels": in_channels, "num_attention_heads": hidden // head,
            "attention_head_dim": head, "num_layers": max(blocks) + 1 if blocks else 0, "pooled_dim": pooled}


def convert_step1x_dit(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT tensors of step1x-edit-i1258.safetensors (BFL's names beside `connector.*`) in diffusers' names."""
    if not any(k.startswith("connector.") for k in state):
        raise KeyError("connector.")  # a plain BFL file: DIT_BFL's
    return convert_bfl_transformer({k: t for k, t in state.items() if not k.startswith("connector.")})


STEP1X_DIT_CONFIG = {**FLUX1_DEV_TRANSFORMER_CONFIG, "guidance_embeds": False}

STEP1X_DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="FluxTransformer2DModel",
    known_configs={"stepfun-ai/Step1X-Edit transformer": STEP1X_DIT_CONFIG},
    marker_keys=("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "connector.S.input_embedder.weight"),
    normalize_key=strip_comfyui_prefix, convert_state_dict=convert_step1x_dit, infer_config=infer_flux_config,
    description="Step1X-Edit DiT (FLUX.1 without guidance embedder; the connector in the same file)")

STEP1X_CONNECTOR = ComponentSpec(
    name="step1x_connector", library="difftune.families.flux.step1x", class_name="Step1XConnector",
    known_configs={"stepfun-ai/Step1X-Edit connector": STEP1X_CONNECTOR_CONFIG},
    marker_keys=("connector.S.input_embedder.weight", "connector.global_proj_out.weight"),
    convert_state_dict=convert_step1x_connector, infer_config=infer_connector_config, companion=True,
    description="Step1X-Edit connector (Qwen2.5-VL hidden states -> prompt tokens, per timestep)")


QWENVL = ComponentSpec(
    name="qwenvl", library="transformers", class_name="Qwen2_5_VLForConditionalGeneration",
    config_class_name="Qwen2_5_VLConfig",
    known_configs={"Qwen/Qwen2.5-VL-7B-Instruct": dict(QWEN25_VL_7B_CONFIG)},
    marker_keys=("model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight"),
    normalize_key=qwen25_vl_key, description="Qwen2.5-VL-7B-Instruct (Step1X-Edit's prompt encoder)")


def load_step1x_processor(path_or_config):
    """The Qwen2.5-VL processor at the reference's pixel bounds for Step1X-Edit (256 to 324 merged 28 px patches)."""
    return load_qwen_vl_processor(path_or_config, "Qwen2.5-VL-7B-Instruct", STEP1X_MIN_PIXELS, STEP1X_MAX_PIXELS)


def is_step1x(context) -> bool:
    """Step1X-Edit runs: a connector is given (the DiT alone is FLUX.1 without guidance)."""
    return context.config("step1x_connector") is not None


# -- the Qwen2.5-VL prompt (the reference's Step1xEditEmbedder) ---------------------------------------------------

STEP1X_PREFIX = (
    'Given a user prompt, generate an "Enhanced prompt" that provides detailed visual descriptions suitable for '
    'image generation. Evaluate the level of detail in the user prompt:\n'
    '- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial '
    'relationships to create vivid and concrete scenes.\n'
    '- If the prompt is already detailed, refine and enhance the existing details slightly without '
    'overcomplicating.\n\n'
    'Here are examples of how to transform or refine prompts:\n'
    '- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping '
    'peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.\n'
    '- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing street '
    'lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass '
    'skyscrapers.\n\n'
    'Please generate only the enhanced description for the prompt below and avoid including any additional '
    'commentary or evaluations:\n'
    'User Prompt:')
STEP1X_MAX_LENGTH = 640
# leading hidden states dropped, as released: the system prompt and the prefix in Qwen2.5-VL's own tokenizer (a
# tokenizer that splits them otherwise needs its own count: `Step1XEmbedder` reads `pipe.step1x_drop`)
STEP1X_DROP = 217
STEP1X_MIN_PIXELS, STEP1X_MAX_PIXELS = 256 * 28 * 28, 324 * 28 * 28


def step1x_chat_text(prompt: str) -> str:
    """Qwen2.5-VL's chat template on [prefix, the image, the prompt] with the vision id and the generation prompt
    (what `apply_chat_template(..., add_generation_prompt=True, add_vision_id=True)` writes)."""
    return ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            f"{STEP1X_PREFIX}Picture 1: <|vision_start|><|image_pad|><|vision_end|>{prompt}<|im_end|>\n"
            "<|im_start|>assistant\n")


def split_quoted(text: str) -> list[str]:
    """The reference's split of the chat text: quotes normalised to '"'; after character 155, each character
    inside quotes becomes its own piece wrapped in “ ” (so quoted text is tokenized letter by letter)."""
    text = text.replace("“", '"').replace("”", '"').replace("'", '"')
    pieces, inside, current = [], False, ""
    for i, ch in enumerate(text):
        if ch == '"' and i > 155:
            current += ch
            if not inside:
                pieces.append(current)
                current = ""
            inside = not inside
            continue
        if inside:
            pieces.append("“" + ch + "”")
        else:
            current += ch
    if current:
        pieces.append(current)
    return pieces


def step1x_input_ids(tokenizer, text: str, expanded_ids: torch.Tensor) -> torch.Tensor:
    """The token ids the reference feeds: the processor's ids (image pads expanded) up to <|vision_end|>, then the
    piecewise tokenization of the rest (quoted characters one by one, their “ ” stripped)."""
    vision_end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    open_q = tokenizer("“", add_special_tokens=False).input_ids
    close_q = tokenizer("”", add_special_tokens=False).input_ids
    pieces = []
    for piece in split_quoted(text):
        ids = tokenizer(piece, add_special_tokens=False).input_ids
        if piece.startswith("“") and piece.endswith("”") and ids[:len(open_q)] == open_q and \
                ids[len(ids) - len(close_q):] == close_q and len(ids) > len(open_q) + len(close_q):
            ids = ids[len(open_q):len(ids) - len(close_q)]
        pieces.extend(ids)
    new = torch.tensor(pieces, dtype=torch.long)
    cut_old = int((expanded_ids[0] == vision_end).nonzero()[0, 0])
    cut_new = int((new == vision_end).nonzero()[0, 0])
    return torch.cat([expanded_ids[0, :cut_old], new[cut_new:]]).unsqueeze(0)


def step1x_embed(qwenvl, processor, prompt: str, image, max_length: int = STEP1X_MAX_LENGTH,
                 drop: int = STEP1X_DROP) -> tuple[torch.Tensor, torch.Tensor]:
    """One prompt with its reference image -> (max_length, hidden) last hidden states (those after the first
    `drop`, zero-padded) and their (max_length,) mask."""
    text = step1x_chat_text(prompt)
    inputs = processor(text=[text], images=[image], padding=True, return_tensors="pt")
    ids = step1x_input_ids(processor.tokenizer, text, inputs["input_ids"])
    device = next(qwenvl.parameters()).device
    out = qwenvl.model(input_ids=ids.to(device), attention_mask=(ids > 0).long().to(device),
                       pixel_values=inputs["pixel_values"].to(device, qwenvl.dtype),
                       image_grid_thw=inputs["image_grid_thw"].to(device), output_hidden_states=True, return_dict=True)
    hidden = out.hidden_states[-1][0, drop:][:max_length]
    emb = hidden.new_zeros(max_length, hidden.shape[-1])
    mask = torch.zeros(max_length, dtype=torch.long, device=hidden.device)
    emb[: hidden.shape[0]] = hidden
    mask[: hidden.shape[0]] = 1
    return emb, mask


class Step1XEmbedder(PipelineUnit):
    """Step1X-Edit's inputs: the Qwen2.5-VL embedding of the prompt read with the reference image (and of the
    negative prompt, when one is given: true CFG), its mask, and the reference image's latents (FLUX AE). The prompt
    cannot be read without the image, so this is not a prompt unit: validation renders a training sample's."""

    inputs = ("prompt", "negative_prompt", "step1x_reference_image", "height", "width")
    outputs = ("step1x_llm_embedding", "step1x_mask", "negative_step1x_llm_embedding", "negative_step1x_mask",
               "step1x_reference_latents")
    models = ("qwenvl", "vae")

    def process(self, pipe, prompt, negative_prompt, step1x_reference_image, height, width):
        from ...media.image import as_image_list, images_to_tensor
        from ...parts.flux_ae import vae_encode
        from ...core.common_units import prompt_list

        if step1x_reference_image is None:
            raise UserError("Step1X-Edit needs a reference image: the data column step1x_reference_image "
                            "(--data_file_keys image,step1x_reference_image --extra_inputs step1x_reference_image)")
        processor = getattr(pipe, "step1x_processor", None)
        if processor is None:
            raise UserError("Step1X-Edit: no Qwen2.5-VL processor (the Qwen/Qwen2.5-VL-7B-Instruct folder beside "
                            "the weights, or --step1x_processor_path)")
        prompts = prompt_list(prompt)
        images = as_image_list(step1x_reference_image)
        images = images * len(prompts) if len(images) == 1 else images
        if len(images) != len(prompts):
            raise UserError(f"step1x_reference_image: {len(images)} images for {len(prompts)} prompts")
        drop = getattr(pipe, "step1x_drop", None) or STEP1X_DROP

        def embed(texts):
            embs, masks = zip(*(step1x_embed(pipe.qwenvl, processor, p, i, drop=drop) for p, i in zip(texts, images)))
            return torch.stack(embs).to(pipe.torch_dtype), torch.stack(masks)

        out = dict(zip(("step1x_llm_embedding", "step1x_mask"), embed(prompts)))
        if negative_prompt is not None:
            out.update(zip(("negative_step1x_llm_embedding", "negative_step1x_mask"),
                           embed(prompt_list(negative_prompt))))
        # the reference image keeps its own size (the reference does not resize it), floored to 16
        w, h = (s // 16 * 16 for s in images[0].size)
        out["step1x_reference_latents"] = vae_encode(pipe, images_to_tensor(images, h, w))
        return out


def step1x_prompt(connector, llm_embedding: torch.Tensor, mask: torch.Tensor, timestep: torch.Tensor):
    """model_fn's part: the connector's prompt tokens and pooled vector at this timestep (0-1000 scale in, /1000
    as the reference)."""
    return connector(llm_embedding, timestep.reshape(-1) / 1000, mask)


def step1x_tokens(tokens: torch.Tensor, img_ids: torch.Tensor, reference_latents: torch.Tensor | None):
    """model_fn's part: the packed reference latents after the noisy tokens, with the same kind of ids (0, row,
    column) from their own size; the model_fn keeps the first `tokens.shape[1]` outputs."""
    from ...core.latents import pack_latents
    from .model_fn import image_ids

    if reference_latents is None:
        return tokens, img_ids
    _, _, h, w = reference_latents.shape
    ref = pack_latents(reference_latents.to(device=tokens.device, dtype=tokens.dtype))
    ids = image_ids(h // 2, w // 2, tokens.device, img_ids.dtype)
    return torch.cat([tokens, ref.expand(tokens.shape[0], -1, -1)], dim=1), torch.cat([img_ids, ids], dim=0)


# -- the pipeline -------------------------------------------------------------------------------------------------

# the reference's defaults (its examples sample at cfg_scale 6)
# height / width None: the reference image's size, in the Python call and `difftune sample` alike
STEP1X_CALL_DEFAULTS = {"height": None, "width": None, "num_inference_steps": 30, "cfg_scale": 1.0}


class Step1XEditPipeline(FluxBasePipeline):
    """Step1X-Edit: FLUX.1's sampling and latents, but the prompt is Qwen2.5-VL's reading of the instruction with the
    reference image, turned into prompt tokens by the connector at every step (it takes the timestep), and the
    reference image's latents follow the noisy tokens. No CLIP / T5, no embedded guidance (true CFG: the reference's
    examples sample at cfg_scale 6)."""

    model_names = ("dit", "vae", "qwenvl", "step1x_connector")
    model_fn_inputs = ("step1x_llm_embedding", "step1x_mask", "step1x_reference_latents")
    sampling_values = ()
    data_inputs = ("image", "prompt", "seed", "num_inference_steps", "height", "width", "step1x_reference_image")
    sample_flags = {"step1x_reference_image": sample_input("Step1X-Edit: the image to edit.", load="RGB")}
    loss_models = ("dit", "step1x_connector")  # the connector runs at every step
    call_defaults = STEP1X_CALL_DEFAULTS

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.step1x_processor = None
        self.step1x_drop = None  # None: the released tokenizer's 217 (a tiny tokenizer's count in tests)
        self.units = [FluxShapeChecker(), FluxNoiseInitializer(), FluxInputImageEmbedder(), Step1XEmbedder()]

    @classmethod
    def claims(cls, context) -> bool:
        return is_step1x(context) or context.config("qwenvl") is not None or context.has("step1x_reference_image")

    @classmethod
    def check_run(cls, context, features) -> None:
        if not context.has("step1x_reference_image"):
            raise UserError("Step1X-Edit needs a reference image: the data column step1x_reference_image "
                            "(--data_file_keys image,step1x_reference_image --extra_inputs step1x_reference_image)")

    def model_fn(self, latents, timestep, step1x_llm_embedding, step1x_mask, step1x_reference_latents=None,
                 **settings):
        from ...core.latents import pack_latents
        from .model_fn import image_ids

        if self.step1x_connector is None:
            raise UserError("Step1X-Edit needs its connector: the step1x-edit-i1258.safetensors file holds it")
        prompt, pooled = step1x_prompt(self.step1x_connector, step1x_llm_embedding.to(latents.device),
                                       step1x_mask.to(latents.device), timestep.to(latents.device, latents.dtype))
        reference = ids = None
        if step1x_reference_latents is not None:  # the reference's tokens, with the image's kind of ids
            _, _, h, w = step1x_reference_latents.shape
            reference = pack_latents(step1x_reference_latents.to(latents.device, latents.dtype))
            ids = image_ids(h // 2, w // 2, latents.device, latents.dtype)
        return model_fn_flux(self.dit, latents, timestep, prompt, pooled, None, pipe=self, features=(),
                             tokens_after=reference, ids_after=ids, **settings)

    def training_inputs(self, data: dict) -> dict:
        values = super().training_inputs(data)
        reference = data.get("step1x_reference_image")
        if reference is not None and not isinstance(reference, Image.Image):
            raise UserError(f"{row_label(data)}: 'step1x_reference_image' must be an image file listed "
                            f"in --data_file_keys (--data_file_keys image,step1x_reference_image)")
        values["step1x_reference_image"] = reference
        values["negative_prompt"] = None  # training reads the positive side only: no negative Qwen2.5-VL pass
        return values

    def batch_signature(self, sample: dict) -> tuple:
        ref = sample.get("step1x_reference_image")
        return (super().batch_signature(sample), getattr(ref, "size", None))

    def __call__(self, prompt, negative_prompt="", cfg_scale: float = STEP1X_CALL_DEFAULTS["cfg_scale"],
                 height: int | None = STEP1X_CALL_DEFAULTS["height"], width: int | None = STEP1X_CALL_DEFAULTS["width"],
                 num_inference_steps: int = STEP1X_CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 step1x_reference_image=None, input_image=None, denoising_strength: float = 1.0,
                 progress: bool = True, output_type: str = "pil"):
        """`step1x_reference_image`: the image to edit (the output takes its size unless height/width are given)."""
        from ...media.image import as_image_list

        if step1x_reference_image is None:
            raise UserError("Step1X-Edit needs step1x_reference_image (the image to edit)")
        reference = as_image_list(step1x_reference_image)[0]
        width, height = width or reference.size[0], height or reference.size[1]
        values = self.prompt_values(prompt, negative_prompt)
        if cfg_scale == 1.0:
            values["negative_prompt"] = None  # not read: no negative Qwen2.5-VL pass
        values.update({"height": height, "width": width, "seed": seed, "input_image": input_image,
                       "step1x_reference_image": step1x_reference_image})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out
