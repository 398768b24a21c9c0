"""AttriCtrl (DiffSynth-Studio/AttriCtrl-FLUX.1-Dev): a value controller turns a number (brightness, ...) into
`prefer_len` extra prompt tokens. The value (times 1000) is embedded as a sinusoidal timestep (diffusers'
`get_timestep_embedding`, cos first), projected by an MLP (linear, SiLU, linear) to the T5 width, repeated
`prefer_len` times and added to a learned positional embedding. The tokens follow the T5 prompt tokens, with text
position ids 0 as the prompt's.

`models/brightness.safetensors` holds `prefer_value_embedder.{0,2}.{weight,bias}` and `positional_embedding`
(prefer_len, dim_out), the names of `FluxValueEncoder` here.
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import get_timestep_embedding
from diffusers.models.modeling_utils import ModelMixin

from ...core.features import VALUE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec


class FluxValueEncoder(ModelMixin, ConfigMixin):
    """One AttriCtrl value encoder: values (B,) -> tokens (B, prefer_len, dim_out)."""

    @register_to_config
    def __init__(self, dim_in: int = 256, dim_out: int = 4096, prefer_len: int = 32):
        super().__init__()
        self.prefer_value_embedder = torch.nn.Sequential(
            torch.nn.Linear(dim_in, dim_out), torch.nn.SiLU(), torch.nn.Linear(dim_out, dim_out))
        self.positional_embedding = torch.nn.Parameter(torch.randn(prefer_len, dim_out))

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        dtype = self.positional_embedding.dtype
        values = values.reshape(-1).to(self.positional_embedding.device)
        emb = get_timestep_embedding(values * 1000, self.config.dim_in, flip_sin_to_cos=True, downscale_freq_shift=0)
        emb = self.prefer_value_embedder(emb.to(dtype))
        return emb[:, None, :] + self.positional_embedding[None]


class FluxMultiValueEncoder(ModelMixin, ConfigMixin):
    """The `value_controller` slot: the value encoder at `encoders.0` (the reference's pipeline keeps its encoders in
    a list there), so `--remove_prefix_in_ckpt pipe.value_controller.encoders.0.` saves a trained encoder in the
    released file's names."""

    @register_to_config
    def __init__(self, dim_in: int = 256, dim_out: int = 4096, prefer_len: int = 32):
        super().__init__()
        self.encoders = torch.nn.ModuleList([FluxValueEncoder(dim_in, dim_out, prefer_len)])

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        return self.encoders[0](values)


ATTRICTRL_CONFIG = {"_class_name": "FluxMultiValueEncoder", "dim_in": 256, "dim_out": 4096, "prefer_len": 32}


def value_controller_key(key: str) -> str:
    """A released encoder's names (`positional_embedding`, `prefer_value_embedder.0.weight`) at `encoders.0.`; the
    reference's trained files (`pipe.value_controller.` removed) already say so; difftune's full training saves the
    slot's names under `pipe.value_controller.`, less --remove_prefix_in_ckpt."""
    for prefix in ("pipe.value_controller.", "value_controller."):  # --remove_prefix_in_ckpt pipe.dit. / pipe.
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key if key.startswith("encoders.") else "encoders.0." + key


def infer_value_encoder_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    try:
        prefer_len, dim_out = shapes["encoders.0.positional_embedding"]
        dim_in = shapes["encoders.0.prefer_value_embedder.0.weight"][1]
    except (KeyError, ValueError):
        return None
    return {"_class_name": "FluxMultiValueEncoder", "dim_in": dim_in, "dim_out": dim_out, "prefer_len": prefer_len}


def value_controller_native_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The slot's state dict in the released file's names (`encoders.0.` dropped)."""
    return {k[len("encoders.0."):] if k.startswith("encoders.0.") else k: v for k, v in state.items()}


VALUE_CONTROLLER = ComponentSpec(
    name="value_controller", library=__name__, class_name="FluxMultiValueEncoder",
    known_configs={"DiffSynth-Studio/AttriCtrl-FLUX.1-Dev value controller": ATTRICTRL_CONFIG},
    marker_keys=("encoders.0.positional_embedding", "encoders.0.prefer_value_embedder.0.weight"),
    normalize_key=value_controller_key, infer_config=infer_value_encoder_config,
    description="AttriCtrl value controller (a number -> prompt tokens)")


def _values(value, row_hint: str = "") -> list[float]:
    """A sample's value(s): a number, a numeric string (CSV cells are read as text), or a list of them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in items:
        try:
            x = float(v.item() if isinstance(v, torch.Tensor) else v)
        except (TypeError, ValueError):
            raise UserError(f"value_controller_inputs{row_hint}: expected a number, got {v!r:.40}") from None
        if not math.isfinite(x):
            raise UserError(f"value_controller_inputs{row_hint}: {x} is not a finite number")
        out.append(x)
    return out


class FluxValueControlEmbedder(PipelineUnit):
    """`value_controller_inputs` (one number per sample; a list of one for the one controller) -> `value_embeds`
    (B, prefer_len, T5 width), appended to the prompt tokens by the model_fn. A unit of its own so that training
    the controller (`--trainable_models value_controller`) moves only it to stage 2."""

    feature = "value_control"
    before = ("FluxEmbeddedGuidance",)
    inputs = ("value_controller_inputs", "batch_size")
    outputs = ("value_embeds",)
    models = ("value_controller",)

    def process(self, pipe, value_controller_inputs, batch_size):
        if value_controller_inputs is None:
            return {}
        b = int(batch_size or 1)
        per_sample = value_controller_inputs if isinstance(value_controller_inputs, list) and \
            len(value_controller_inputs) == b and b > 1 else [value_controller_inputs] * b
        rows = [_values(v) for v in per_sample]
        if any(len(r) != 1 for r in rows):
            raise UserError(f"value_controller_inputs: one value per sample for the one value controller loaded, "
                            f"got {max(len(r) for r in rows)}")
        values = torch.tensor([r[0] for r in rows], dtype=torch.float32, device=pipe.device)
        return {"value_embeds": pipe.value_controller(values).to(pipe.torch_dtype)}


def extend_prompt(prompt_embeds: torch.Tensor, *extra: torch.Tensor | None) -> torch.Tensor:
    """model_fn's part: prompt tokens (B, n, d) followed by extra tokens (value / LoRA-encoder embeddings, each
    (B, k, d)); their text position ids are 0, as the prompt's, so only the tokens are extended."""
    parts = [prompt_embeds] + [e.to(device=prompt_embeds.device, dtype=prompt_embeds.dtype).expand(
        prompt_embeds.shape[0], -1, -1) for e in extra if e is not None]
    return torch.cat(parts, dim=1) if len(parts) > 1 else prompt_embeds


class _ValueControl(Feature):
    def denoise(self, pipe, call):
        """The value's tokens after the prompt's."""
        call.text_after.append(call.values["value_embeds"])


VALUE_CONTROL = _ValueControl(
    "value_control", columns=("value_controller_inputs",), models=("value_controller",),
    model_fn_inputs=("value_embeds",), units=(FluxValueControlEmbedder(),), slots=("value_controller",),
    # --full_format original: the released encoder's names; diffusers (the default): the slot's `encoders.0.`, as
    # the reference's trained files. Both load back (`value_controller_key`).
    native_keys={"value_controller": value_controller_native_keys},
    inputs={"value_controller_inputs": VALUE}, call_inputs={"value_controller_inputs": None},
    flags={"value_controller_inputs": sample_input("AttriCtrl: the attribute's value (e.g. brightness 0..1).",
                                                   kind=float)},
    description="AttriCtrl: a value's tokens after the prompt")
