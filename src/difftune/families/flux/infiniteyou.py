"""InfiniteYou (ByteDance, `infu_flux_v1.0/aes_stage2/`): `InfuseNetModel/*.safetensors` (a diffusers
`FluxControlNetModel`, 4 double + 10 single blocks; slot `controlnet`, `controlnet.py`) and `image_proj_model.bin`
(slot `image_proj_model`).

`image_proj_model.bin` is a pickled {"image_proj": {...}} (read through torch.load(weights_only=True)) holding an
IP-Adapter-Plus resampler: 8 learnt queries (1280 wide) attend over the projected ArcFace face embedding (512) in 4
perceiver blocks, then project to 4096 (the T5 width). That is diffusers' `IPAdapterPlusImageProjection`; the
release's resampler names (`layers.N.0.to_kv` fused, `layers.N.1.{0,1,3}` for the feed-forward) are mapped onto it
(`image_proj_key` / `convert_image_proj`, as diffusers' own IP-Adapter-Plus converter does for SD).

As the reference: the face embedding of `infinityou_id_image` goes through the projector into `id_embeds`
(B, 8, 4096), which the InfuseNet reads in place of the prompt (text ids 0) with `infinityou_guidance` as its
guidance; its residuals go into the DiT like any ControlNet's (the control image is its conditioning). The
projector runs in model_fn, so `--trainable_models controlnet,image_proj_model` trains both in stage 2 while the face
embedding and the control image's latents come from stage 1.

The face embedding itself needs InsightFace's antelopev2 detector and an ArcFace model (the reference uses
insightface + facexlib with weights from `ByteDance/InfiniteYou:supports/insightface`); `FaceEmbedder` is the seam.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.embeddings import IPAdapterPlusImageProjection
from PIL import Image

from ...core.features import IMAGE, VALUE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list
from ...models.detect import ComponentSpec
from .controlnet import COLUMNS as CONTROLNET_COLUMNS

FACE_EMBED_DIM = 512


class InfiniteYouImageProjection(IPAdapterPlusImageProjection, ModelMixin, ConfigMixin):
    """diffusers' IP-Adapter-Plus resampler as a loadable model (config + from_config)."""

    @register_to_config
    def __init__(self, embed_dims: int = 512, output_dims: int = 4096, hidden_dims: int = 1280, depth: int = 4,
                 dim_head: int = 64, heads: int = 20, num_queries: int = 8, ffn_ratio: float = 4):
        super().__init__(embed_dims, output_dims, hidden_dims, depth, dim_head, heads, num_queries, ffn_ratio)


INFU_IMAGE_PROJ_CONFIG = {"embed_dims": 512, "output_dims": 4096, "hidden_dims": 1280, "depth": 4, "dim_head": 64,
                          "heads": 20, "num_queries": 8, "ffn_ratio": 4}

_LAYER = re.compile(r"^layers\.(\d+)\.(\d)\.(.+)$")
_ATTN = {"norm1": "ln0", "norm2": "ln1", "to_q": "attn.to_q", "to_out": "attn.to_out.0"}
_FF = {"0": "ff.0", "1": "ff.1.net.0.proj", "3": "ff.1.net.2"}


def image_proj_key(key: str) -> str:
    """The release's names (under `image_proj.`) -> the resampler's; `to_kv` stays fused (split by
    `convert_image_proj`). A file difftune's full training saved is in the resampler's own (diffusers') names under
    the slot, `pipe.image_proj_model.` less --remove_prefix_in_ckpt."""
    for prefix in ("pipe.image_proj_model.", "image_proj_model.", "image_proj."):
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    m = _LAYER.match(key)
    if m is None:
        return key
    index, part, rest = m.groups()
    module, _, param = rest.rpartition(".")
    if part == "0" and module in _ATTN:
        return f"layers.{index}.{_ATTN[module]}.{param}"
    if part == "1" and module in _FF:
        return f"layers.{index}.{_FF[module]}.{param}"
    return key


def convert_image_proj(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split each perceiver block's fused `to_kv` into `attn.to_k` / `attn.to_v` (works on meta tensors)."""
    if any(k.endswith(".attn.to_k.weight") for k in state):
        return state  # already in diffusers' names (difftune's own saved files)
    if not any(k.endswith(".0.to_kv.weight") for k in state):
        raise KeyError("no fused to_kv: not the release's resampler layout")
    out = {}
    for key, t in state.items():
        m = _LAYER.match(key)
        if m is not None and m[3] == "to_kv.weight":
            k, v = t.chunk(2, dim=0)
            out[f"layers.{m[1]}.attn.to_k.weight"], out[f"layers.{m[1]}.attn.to_v.weight"] = k, v
        else:
            out[key] = t
    return out


_RELEASE = {"ln0": "0.norm1", "ln1": "0.norm2", "attn.to_q": "0.to_q", "attn.to_out.0": "0.to_out", "ff.0": "1.0",
            "ff.1.net.0.proj": "1.1", "ff.1.net.2": "1.3"}


def image_proj_native_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The resampler's state dict in the release's names (`layers.N.0.to_kv` fused again), for `--full_format
    original`: the inverse of `image_proj_key` + `convert_image_proj`."""
    out = {}
    for key, t in state.items():
        m = re.match(r"^layers\.(\d+)\.(.+)\.(weight|bias)$", key)
        if m is None:
            out[key] = t
            continue
        index, module, param = m.groups()
        if module == "attn.to_k":
            out[f"layers.{index}.0.to_kv.{param}"] = torch.cat([t, state[f"layers.{index}.attn.to_v.{param}"]])
        elif module != "attn.to_v":
            out[f"layers.{index}.{_RELEASE[module]}.{param}"] = t
    return out


def image_proj_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    latents, proj_in = shapes.get("latents"), shapes.get("proj_in.weight")
    proj_out, q = shapes.get("proj_out.weight"), shapes.get("layers.0.attn.to_q.weight")
    if latents is None or proj_in is None or proj_out is None or q is None:
        return None
    depth = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers."))
    ff = shapes.get("layers.0.ff.1.net.0.proj.weight")
    dim_head = 64  # not in the weights: InfiniteYou's (and IP-Adapter-Plus') head width
    if q[0] % dim_head or ff is None:
        return None
    return {"embed_dims": proj_in[1], "output_dims": proj_out[0], "hidden_dims": latents[2], "depth": depth,
            "dim_head": dim_head, "heads": q[0] // dim_head, "num_queries": latents[1],
            "ffn_ratio": ff[0] / latents[2] if ff[0] % latents[2] else ff[0] // latents[2]}


IMAGE_PROJ_MODEL = ComponentSpec(
    name="image_proj_model", library=__name__, class_name="InfiniteYouImageProjection",
    known_configs={"ByteDance/InfiniteYou image_proj_model (infu_flux_v1.0)": INFU_IMAGE_PROJ_CONFIG},
    # in both layouts: the release's (fused to_kv) and the resampler's own, as full training saves it
    marker_keys=("latents", "proj_in.weight", "norm_out.weight"), normalize_key=image_proj_key,
    convert_state_dict=convert_image_proj, infer_config=image_proj_config,
    description="InfiniteYou face-embedding projector (IP-Adapter-Plus resampler)")


# -- the face embedding ---------------------------------------------------------------------------------------

FaceEmbedder = Callable[[Image.Image], torch.Tensor]  # an RGB image -> the largest face's (512,) ArcFace embedding
INSIGHTFACE_FOLDER = "ByteDance/InfiniteYou/supports/insightface"  # under the model base path, as the reference
NO_FACE_EMBEDDER = ("InfiniteYou: infinityou_id_image needs InsightFace's face detector and ArcFace (pip install "
                    "insightface facexlib onnxruntime, and InfiniteYou's supports/insightface/models/antelopev2 under "
                    "the model base path); or give precomputed 512-number ArcFace embeddings as an "
                    "infinityou_face_embedding column instead")


class InsightFaceEmbedder:
    """The reference's face embedding: InsightFace's antelopev2 detector (at 640, then 320, then 160 px) finds the
    faces, the largest one's landmarks align a 112 px crop, and facexlib's ArcFace embeds it (512 numbers)."""

    def __init__(self, root: str | None = None, device="cpu"):
        try:
            import cv2  # noqa: F401  (insightface's own dependency)
            from facexlib.recognition import init_recognition_model
            from insightface.app import FaceAnalysis
        except ImportError:
            raise UserError(NO_FACE_EMBEDDER) from None
        import os

        from ...models.download import model_base_path

        root = root or os.path.join(model_base_path(), INSIGHTFACE_FOLDER)
        if not os.path.isdir(os.path.join(root, "models", "antelopev2")):
            raise UserError(f"{NO_FACE_EMBEDDER} (no {os.path.join(root, 'models', 'antelopev2')})")
        self.apps = []
        for side in (640, 320, 160):
            app = FaceAnalysis(name="antelopev2", root=root, providers=["CPUExecutionProvider"])
            app.prepare(ctx_id=0, det_size=(side, side))
            self.apps.append(app)
        self.device = torch.device(device)
        self.arcface = init_recognition_model("arcface", device=str(self.device))

    @torch.no_grad()
    def __call__(self, image: Image.Image) -> torch.Tensor:
        import numpy as np
        from insightface.utils import face_align

        bgr = np.ascontiguousarray(np.asarray(image.convert("RGB"))[..., ::-1])
        faces = []
        for app in self.apps:
            faces = app.get(bgr)
            if faces:
                break
        if not faces:
            raise UserError("infinityou_id_image: no face found in the image")
        largest = max(faces, key=lambda f: (f["bbox"][2] - f["bbox"][0]) * (f["bbox"][3] - f["bbox"][1]))
        crop = face_align.norm_crop(bgr, landmark=np.array(largest["kps"]), image_size=112)
        x = torch.from_numpy(crop).permute(2, 0, 1)[None].float() / 255 * 2 - 1
        return self.arcface(x.to(self.device))[0].float().cpu()


def face_embedding_from(value, where: str = "infinityou_face_embedding") -> torch.Tensor:
    """A precomputed face embedding: a tensor, a list of 512 numbers (a JSON cell), or a .safetensors / .npy file
    holding one 512-number tensor."""
    import json
    import os

    if isinstance(value, str) and value.lstrip().startswith("["):
        value = json.loads(value)
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if not os.path.isfile(path):
            raise UserError(f"{where}: no such file: {path}")
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = list(load_file(path).values())
            if len(tensors) != 1:
                raise UserError(f"{where}: {path} holds {len(tensors)} tensors, expected one face embedding")
            value = tensors[0]
        elif path.endswith(".npy"):
            import numpy as np

            value = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            raise UserError(f"{where}: {path}: expected a .safetensors or .npy file (or a list of 512 numbers)")
    try:
        t = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError):
        raise UserError(f"{where}: expected 512 numbers, got {value!r:.60}") from None
    if t.numel() != FACE_EMBED_DIM:
        raise UserError(f"{where}: {t.numel()} numbers, an ArcFace embedding has {FACE_EMBED_DIM}")
    return t.reshape(FACE_EMBED_DIM)


class FluxInfiniteYouEmbedder(PipelineUnit):
    """`infinityou_id_image` (through the pipeline's `face_embedder`, InsightFace by default) or, without one, a
    precomputed `infinityou_face_embedding` -> `infinityou_face_embeds` (B, 1, 512); `infinityou_guidance` -> (B,) (default 1,
    as the reference). The projector itself runs in model_fn, so it trains in stage 2."""

    feature = "infiniteyou"
    before = ("FluxClipEmbedder",)
    inputs = ("infinityou_id_image", "infinityou_face_embedding", "infinityou_guidance", "batch_size")
    outputs = ("infinityou_face_embeds", "infinityou_guidance")
    batching = {"infinityou_guidance": "scalar"}

    def process(self, pipe, infinityou_id_image, infinityou_face_embedding, infinityou_guidance, batch_size):
        n = int(batch_size or 1)
        if infinityou_id_image is None and infinityou_face_embedding is not None:
            items = infinityou_face_embedding if isinstance(infinityou_face_embedding, list) and n > 1 and \
                len(infinityou_face_embedding) == n else [infinityou_face_embedding]
            faces = torch.stack([face_embedding_from(v) for v in items])
        elif infinityou_id_image is not None:
            images = as_image_list(infinityou_id_image)
            if len(images) not in (1, n):
                raise UserError(f"infinityou_id_image: {len(images)} images for {n} sample(s)")
            embed = getattr(pipe, "face_embedder", None) or InsightFaceEmbedder(device=pipe.device)
            faces = torch.stack([torch.as_tensor(embed(i.convert("RGB"))).float().reshape(FACE_EMBED_DIM)
                                 for i in images])
        else:
            return {}
        faces = faces.expand(n, -1) if faces.shape[0] == 1 else faces
        g = 1.0 if infinityou_guidance is None else infinityou_guidance
        g = [float(x) for x in g] if isinstance(g, (list, tuple)) else [float(g)] * n
        return {"infinityou_face_embeds": faces[:, None].to(pipe.device, pipe.torch_dtype),
                "infinityou_guidance": torch.tensor(g, dtype=torch.float32, device=pipe.device)}



CONTROL_IMAGE = CONTROLNET_COLUMNS[0]  # the InfuseNet ControlNet's control image


class _InfiniteYou(Feature):
    attributes = {"face_embedder": None}  # an image -> its face's ArcFace embedding (InsightFace by default)

    def check(self, context, features):
        if not context.has(CONTROL_IMAGE):
            raise UserError(f"InfiniteYou needs a {CONTROL_IMAGE} column (the InfuseNet ControlNet's control image)")

    def prepare_call(self, pipe, values, cfg_scale, state):
        """The guidance applies with a face only (default 1, as the reference)."""
        if values.get("infinityou_id_image") is None and values.get("infinityou_face_embedding") is None:
            values.pop("infinityou_guidance", None)
        elif values.get("infinityou_guidance") is None:
            values["infinityou_guidance"] = 1.0

    def denoise(self, pipe, call):
        """The projector's face tokens as the InfuseNet ControlNet's prompt (text ids 0, its own guidance)."""
        v = call.values
        faces = v.get("infinityou_face_embeds")
        if faces is None:
            return
        if v.get("controlnet_conditioning") is None:
            raise UserError(f"InfiniteYou needs its InfuseNet ControlNet and a {CONTROL_IMAGE}")
        projector = call.model("image_proj_model")
        if projector is None:
            raise UserError("InfiniteYou needs its image_proj_model (ByteDance/InfiniteYou:infu_flux_v1.0/"
                            "aes_stage2/image_proj_model.bin)")
        weight = projector.proj_in.weight
        text = projector(faces.to(weight.device, weight.dtype)).to(call.dtype)
        ids = torch.zeros(text.shape[1], 3, device=call.device, dtype=call.dtype)
        guidance = v.get("infinityou_guidance")
        call.control_prompt = (text, ids, 1.0 if guidance is None else guidance)


INPUTS = ("infinityou_id_image", "infinityou_face_embedding", "infinityou_guidance")
INFINITEYOU = _InfiniteYou(
    "infiniteyou", columns=INPUTS[:2], models=("image_proj_model",), requires=("controlnet",),
    model_fn_inputs=("infinityou_face_embeds", "infinityou_guidance"), data_inputs=INPUTS,
    units=(FluxInfiniteYouEmbedder(),), slots=("image_proj_model",), loss_models=("image_proj_model",),
    inputs={INPUTS[0]: IMAGE, INPUTS[1]: VALUE, INPUTS[2]: VALUE}, call_inputs=dict.fromkeys(INPUTS),
    flags={INPUTS[0]: sample_input("InfiniteYou: the identity's face image (needs insightface).", load="RGB"),
           INPUTS[1]: sample_input("InfiniteYou: a precomputed ArcFace embedding (.safetensors or .npy) instead of "
                                   "infinityou_id_image.")},
    description="InfiniteYou: a face embedding's tokens as the InfuseNet ControlNet's prompt")

__all__ = ["INFINITEYOU", "FluxInfiniteYouEmbedder", "IMAGE_PROJ_MODEL", "InfiniteYouImageProjection",
           "InsightFaceEmbedder",
           "convert_image_proj", "face_embedding_from", "image_proj_key", "image_proj_native_keys"]
