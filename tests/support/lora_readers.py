"""What each reader of a LoRA file does with it, for the tests and `benchmarks/lora_readers.py`: a tiny family's DiT
with a LoRA of random A and B (the updates it should make), the file in each layout, and the weights diffusers,
DiffSynth-Studio and ComfyUI end up with.

DiffSynth-Studio's own LoRA loading is rewritten here step by step (its package is not a dependency; the benchmark
runs the real one beside this rewrite and shows they agree). Read from the reference at commit fed7b18 (the same
code as the `diffsynth` 2.1.12 package):

* `diffsynth/diffusion/base_pipeline.py`, `BasePipeline.load_lora`: the file's tensors go through the pipeline's
  loader's `convert_state_dict`, then `fuse_lora_to_base_model`, which converts them once more and adds
  `alpha * up @ down` (alpha = the call's strength, 1) to the weight of every module of the model whose name has a
  `<name>.lora_B.weight` entry. Entries naming no module are skipped without a word.
* `diffsynth/utils/lora/general.py`, `GeneralLoRALoader` (Qwen-Image and Wan use it): for each key holding
  `lora_B` (or `lora_up`), the module name is the key without that part, an adapter name after it, a leading
  `diffusion_model` and the final `weight`; a `<module>.alpha` tensor beside it scales the down matrix by
  alpha / rank (rank = down's rows); no other prefix is removed.
* `diffsynth/utils/lora/flux.py`, `FluxLoRALoader`: a file whose first key naming either has `lora_unet_` (kohya,
  "civitai") or starts with `transformer.` (diffusers) is renamed per block module onto the reference's FLUX
  model; keys of other modules pass unchanged. Every tensor is multiplied by sqrt(alpha / rank) of the first
  `.alpha` found (one scale for the whole file). In the diffusers case the single blocks' to_q/to_k/to_v and
  proj_mlp (zeros where absent) are stacked into `to_qkv_mlp` (downs along the rows, ups block-diagonal) and the
  double blocks' q/k/v into `a_to_qkv` / `b_to_qkv`. Other files pass unchanged (their names must be the model's).

The reference's module names: Qwen-Image's DiT has diffusers' (it has no key converter for it), Wan's has Wan-AI's
original ones, FLUX's its own (`blocks.N.attn.a_to_qkv`, `single_blocks.N.to_qkv_mlp`, `final_proj_out`).
"""

from __future__ import annotations

import math
import re

import torch


def diffsynth_general_convert(sd: dict) -> dict:
    out = {}
    for key in sd:
        a_name, b_name = ("lora_down", "lora_up") if ".lora_up." in key else ("lora_A", "lora_B")
        if b_name not in key:
            continue
        parts = key.split(".")
        at = parts.index(b_name)
        if len(parts) > at + 2:  # lora_B.<adapter>.weight
            del parts[at + 1]
        del parts[at]
        if parts[0] == "diffusion_model":
            del parts[0]
        module = ".".join(parts[:-1])
        alpha_key = key.replace(b_name + ".weight", "alpha").replace(b_name + ".default.weight", "alpha")
        down = sd[key.replace(b_name, a_name)]
        if alpha_key != key and alpha_key in sd:
            down = down * (sd[alpha_key] / down.shape[0])
        out[f"{module}.lora_B.weight"] = sd[key]
        out[f"{module}.lora_A.weight"] = down
    return out


# the reference's FLUX module names, per block, for diffusers' and kohya's (a block's index stands for "{}")
_DOUBLE = {"attn.to_q": "attn.a_to_q", "attn.to_k": "attn.a_to_k", "attn.to_v": "attn.a_to_v",
           "attn.add_q_proj": "attn.b_to_q", "attn.add_k_proj": "attn.b_to_k", "attn.add_v_proj": "attn.b_to_v",
           "attn.to_out.0": "attn.a_to_out", "attn.to_add_out": "attn.b_to_out", "ff.net.0.proj": "ff_a.0",
           "ff.net.2": "ff_a.2", "ff_context.net.0.proj": "ff_b.0", "ff_context.net.2": "ff_b.2",
           "norm1.linear": "norm1_a.linear", "norm1_context.linear": "norm1_b.linear"}
_SINGLE = {"attn.to_q": "a_to_q", "attn.to_k": "a_to_k", "attn.to_v": "a_to_v", "norm.linear": "norm.linear",
           "proj_mlp": "proj_in_besides_attn", "proj_out": "proj_out"}
_KOHYA_DOUBLE = {"img_mod_lin": "norm1_a.linear", "txt_mod_lin": "norm1_b.linear", "img_attn_qkv": "attn.a_to_qkv",
                 "txt_attn_qkv": "attn.b_to_qkv", "img_attn_proj": "attn.a_to_out", "txt_attn_proj": "attn.b_to_out",
                 "img_mlp_0": "ff_a.0", "img_mlp_2": "ff_a.2", "txt_mlp_0": "ff_b.0", "txt_mlp_2": "ff_b.2"}
_KOHYA_SINGLE = {"modulation_lin": "norm.linear", "linear1": "to_qkv_mlp", "linear2": "proj_out"}


def _flux_rename(name: str, resource: str) -> str | None:
    if resource == "diffusers":
        m = re.fullmatch(r"transformer\.(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)\.(lora_[AB]\.weight)",
                         name)
        if m is None:
            return None
        table, head = (_DOUBLE, "blocks") if m[1] == "transformer_blocks" else (_SINGLE, "single_blocks")
        return f"{head}.{m[2]}.{table[m[3]]}.{m[4]}" if m[3] in table else None
    m = re.fullmatch(r"lora_unet_(double|single)_blocks_(\d+)_(.+)\.lora_(down|up)\.weight", name)
    if m is None:
        return None
    table, head = (_KOHYA_DOUBLE, "blocks") if m[1] == "double" else (_KOHYA_SINGLE, "single_blocks")
    return f"{head}.{m[2]}.{table[m[3]]}.lora_{'A' if m[4] == 'down' else 'B'}.weight" if m[3] in table else None


def _stack(sd: dict, parts: list[str], out_name: str, mlp_rows: int | None = None) -> None:
    """q, k, v (and the MLP part) of one fused layer as one LoRA: downs stacked, ups block-diagonal."""
    downs = [sd.pop(f"{p}.lora_A.weight") for p in parts]
    ups = [sd.pop(f"{p}.lora_B.weight") for p in parts]
    if mlp_rows is not None and len(parts) == 3:  # no MLP LoRA: a zero block of q's rank in its place
        downs.append(torch.zeros_like(downs[0]))
        ups.append(torch.zeros(mlp_rows, ups[0].shape[1], dtype=ups[0].dtype))
    up = torch.zeros(sum(u.shape[0] for u in ups), sum(u.shape[1] for u in ups), dtype=ups[0].dtype)
    r = c = 0
    for u in ups:
        up[r:r + u.shape[0], c:c + u.shape[1]] = u
        r, c = r + u.shape[0], c + u.shape[1]
    sd[f"{out_name}.lora_A.weight"] = torch.cat(downs, dim=0)
    sd[f"{out_name}.lora_B.weight"] = up


def diffsynth_flux_convert(sd: dict) -> dict:
    resource = None
    for key in sd:
        if "lora_unet_" in key:
            resource = "civitai"
            break
        if key.startswith("transformer."):
            resource = "diffusers"
            break
    if resource is None:
        return dict(sd)
    scale = 1.0
    for key, value in sd.items():
        if ".alpha" in key:
            down = next((sd[key.replace(".alpha", s)] for s in (".lora_down.weight", ".lora_A.weight")
                         if key.replace(".alpha", s) in sd), None)
            if down is not None:
                scale = math.sqrt(value.item() / down.shape[0])
                break
    out = {}
    for key, value in sd.items():
        value = value * scale if scale != 1 else value
        out[_flux_rename(key, resource) or key] = value
    if resource == "diffusers":
        for key in [k for k in out if k.startswith("single_blocks.") and ".a_to_q.lora_A." in k]:
            stem = key[: -len(".a_to_q.lora_A.weight")]
            mlp_rows = out[f"{stem}.a_to_q.lora_B.weight"].shape[0] * 4
            parts = [f"{stem}.a_to_{x}" for x in "qkv"]
            if f"{stem}.proj_in_besides_attn.lora_A.weight" in out:
                parts.append(f"{stem}.proj_in_besides_attn")
            _stack(out, parts, f"{stem}.to_qkv_mlp", mlp_rows)
        for key in [k for k in out if re.search(r"\.[ab]_to_q\.lora_A\.weight$", k)]:
            stem, side = key[: -len("._to_q.lora_A.weight") - 1], key[-len("_to_q.lora_A.weight") - 1]
            _stack(out, [f"{stem}.{side}_to_{x}" for x in "qkv"], f"{stem}.{side}_to_qkv")
    return out


def diffsynth_fuse(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], convert) -> tuple[dict, set]:
    """`load_lora` on a model whose Linear weights are `weights` (module name -> weight): convert, fuse (converting
    again), as the reference does. Returns the new weights and the LoRA module names no module took."""
    sd = convert(convert({k: v.float() for k, v in lora.items()}))
    names = {k[: -len(".lora_B.weight")] for k in sd if k.endswith(".lora_B.weight")}
    out = dict(weights)
    for name in names & set(weights):
        out[name] = weights[name] + sd[f"{name}.lora_B.weight"] @ sd[f"{name}.lora_A.weight"]
    return out, names - set(weights)


# -- the reference's and ComfyUI's module names for a tiny family's DiT ----------------------------------------------

def reference_weights(family: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT's Linear weights (a diffusers state dict) under the reference's module names (module -> weight)."""
    linear = {k[: -len(".weight")]: v for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2}
    if family == "qwen_image":
        return linear
    if family == "wan":
        from difftune.families.wan.dit_keys import dit_to_original

        return {k[: -len(".weight")]: v for k, v in dit_to_original({f"{p}.weight": w for p, w in linear.items()}
                                                                     ).items()}
    if family == "flux":
        out = {}
        for path, parts in flux_reference_parts(linear).items():
            out[path] = torch.cat([linear[p] for p in parts], dim=0)
        return out
    raise KeyError(family)


def flux_reference_parts(linear: dict) -> dict[str, list[str]]:
    """The reference's FLUX module -> the diffusers modules whose weights it stacks (rows), for those present."""
    out = {}
    doubles = sorted({int(k.split(".")[1]) for k in linear if k.startswith("transformer_blocks.")})
    singles = sorted({int(k.split(".")[1]) for k in linear if k.startswith("single_transformer_blocks.")})
    for i in doubles:
        b = f"transformer_blocks.{i}"
        out[f"blocks.{i}.attn.a_to_qkv"] = [f"{b}.attn.to_q", f"{b}.attn.to_k", f"{b}.attn.to_v"]
        out[f"blocks.{i}.attn.b_to_qkv"] = [f"{b}.attn.add_q_proj", f"{b}.attn.add_k_proj", f"{b}.attn.add_v_proj"]
        for theirs, ours in _DOUBLE.items():
            if "_to_q" not in ours and "_to_k" not in ours and "_to_v" not in ours:
                out[f"blocks.{i}.{ours}"] = [f"{b}.{theirs}"]
    for i in singles:
        s = f"single_transformer_blocks.{i}"
        out[f"single_blocks.{i}.to_qkv_mlp"] = [f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v", f"{s}.proj_mlp"]
        out[f"single_blocks.{i}.norm.linear"] = [f"{s}.norm.linear"]
        out[f"single_blocks.{i}.proj_out"] = [f"{s}.proj_out"]
    for theirs, ours in (("x_embedder", "x_embedder"), ("context_embedder", "context_embedder"),
                         ("proj_out", "final_proj_out")):
        out[ours] = [theirs]
    return {k: v for k, v in out.items() if all(p in linear for p in v)}


def comfyui_state_dict(family: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT's state dict under ComfyUI's names (the original releases' keys: Qwen-Image's are diffusers')."""
    if family == "qwen_image":
        return dict(sd)
    if family == "wan":
        from difftune.families.wan.dit_keys import dit_to_original

        return dit_to_original(dict(sd))
    if family == "flux":
        from difftune.families.flux.bfl import bfl_transformer_from_diffusers

        return bfl_transformer_from_diffusers(dict(sd))
    raise KeyError(family)


# -- a LoRA whose updates are known -------------------------------------------------------------------------------

DIFFUSERS_PIPELINES = {"qwen_image": "QwenImagePipeline", "flux": "FluxPipeline", "wan": "WanPipeline"}


def random_lora(spec, model, target_names, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """A LoRA of random A and B on `model`'s modules for `target_names` (the family's aliases applied, as training
    does), injected in place: (its config, its state dict, {module: its update (alpha / rank) B A})."""
    import types

    from difftune.lora import inject_lora, lora_state_dict
    from difftune.training.module import lora_targets

    targets = lora_targets(types.SimpleNamespace(spec=spec, models={"dit": model}), "dit", list(target_names))
    torch.manual_seed(seed)
    config = inject_lora(model, targets, rank, alpha, init=False)
    sd = lora_state_dict(model)
    intended = {k[: -len(".lora_A.weight")]: (alpha / rank) * (sd[k.replace("lora_A", "lora_B")] @ sd[k])
                for k in sd if k.endswith(".lora_A.weight")}
    return config, sd, intended


def save_dit_lora(spec, path, sd, config, layout: str, reference: bool = True):
    """The DiT LoRA `sd` written in `layout` as a training checkpoint would, with the family's renames."""
    from difftune.lora import save_lora

    return save_lora(path, {"dit": sd}, {"dit": config}, prefixes=dict(spec.lora_prefixes), layout=layout,
                     denoiser="dit", native_names=spec.lora_native_names,
                     reference_names=spec.lora_reference_names if reference else None)


def with_updates(state: dict[str, torch.Tensor], intended: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (a module's state dict) with each module's update added to its weight: what a reader should give."""
    out = {k: v.detach().clone() for k, v in state.items()}
    for path, delta in intended.items():
        out[f"{path}.weight"] = out[f"{path}.weight"] + delta
    return out


class KnownLora:
    """A tiny family's DiT (from its tiny repository in the diffusers layout) with a rank-`rank` LoRA of random A and
    B on the family's default targets (its aliases applied, as training does): `intended` is each module's update
    (alpha / rank) B A; `save(layout)` writes it as a training checkpoint would."""

    def __init__(self, family: str, folder, rank: int = 4, alpha: float = 8.0, seed: int = 0):
        from pathlib import Path

        import diffusers

        from difftune.core.family import get_family
        from difftune.util import names
        from .common import tiny_family

        self.family, self.spec = family, get_family(family)
        tiny = tiny_family(family, Path(folder))
        first = next(p[0] if isinstance(p, list) else p for p in tiny.model_paths if "transformer" in
                     str(p[0] if isinstance(p, list) else p))
        self.repo = Path(first).parent.parent
        self.pipeline_class = getattr(diffusers, DIFFUSERS_PIPELINES[family])
        cls = getattr(diffusers, json_class(self.repo / "transformer"))
        self.base = {k: v.float().clone() for k, v in cls.from_pretrained(str(self.repo / "transformer")).state_dict()
                     .items()}
        model = cls.from_pretrained(str(self.repo / "transformer")).float()
        self.config, self.lora, self.intended = random_lora(self.spec, model, names(self.spec.lora_target_modules),
                                                            rank, alpha, seed)

    def save(self, path, layout: str):
        return save_dit_lora(self.spec, path, self.lora, self.config, layout, reference=False)

    def trained(self) -> dict[str, torch.Tensor]:
        """The DiT's state dict with every update added (what a reader should end up with)."""
        return with_updates(self.base, self.intended)

    def diffusers_updates(self, path) -> dict[str, torch.Tensor]:
        """{module: update} as the family's diffusers pipeline applies the file (`load_lora_weights`, through peft)."""
        from peft.tuners.lora import LoraLayer

        pipe = self.pipeline_class.from_pretrained(str(self.repo), torch_dtype=torch.float32)
        pipe.load_lora_weights(str(path), adapter_name="file")
        return {name: layer.get_delta_weight("file").detach().float()
                for name, layer in pipe.transformer.named_modules()
                if isinstance(layer, LoraLayer) and "file" in layer.lora_A}

    def reference_result(self, path) -> tuple[dict[str, torch.Tensor], set]:
        """(the reference's module weights after its loader fused the file, the LoRA modules it skipped), by the
        rewrite above, on the DiT under the reference's names."""
        from safetensors.torch import load_file

        convert = diffsynth_flux_convert if self.family == "flux" else diffsynth_general_convert
        return diffsynth_fuse(reference_weights(self.family, self.base), load_file(str(path)), convert)


def json_class(folder) -> str:
    import json
    from pathlib import Path

    return json.loads((Path(folder) / "config.json").read_text())["_class_name"]


def max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over `want`'s keys (inf for a key `got` lacks)."""
    worst = 0.0
    for key, value in want.items():
        if key not in got or got[key].shape != value.shape:
            return float("inf")
        worst = max(worst, (got[key].float() - value.float()).abs().max().item())
    return worst


# -- ComfyUI's LoRA loading, for ACE-Step 1.5 ---------------------------------------------------------------------

# ComfyUI's LoRAAdapter.load (comfy/weight_adapter/lora.py): the (up, down) key pairs tried for a module name x, in
# its order
_COMFYUI_PAIRS = ((".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
                  (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
                  (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
                  (".lora_B.default.weight", ".lora_A.default.weight"))


def comfyui_ace_step15_key_map(model_keys) -> dict[str, str]:
    """ComfyUI's `model_lora_keys_unet` (comfy/lora.py) for its ACE-Step 1.5 model, whose state dict keys are
    `diffusion_model.decoder.<original DiT key>`: LoRA module name -> the model weight it patches.

    The generic map for every model: each `diffusion_model.<path>.weight` as `diffusion_model.<path>` and as kohya's
    `lora_unet_<path, dots as _>` (a key not ending in `.weight` as itself); then the `ACEStep15` branch, for each
    `diffusion_model.decoder.<path>.weight`: `base_model.model.<path>` (the official trainer's peft files) and
    `lycoris_<path, dots as _>`."""
    key_map = {}
    for k in model_keys:
        if k.startswith("diffusion_model."):
            if k.endswith(".weight"):
                key_map["lora_unet_" + k[len("diffusion_model."):-len(".weight")].replace(".", "_")] = k
                key_map[k[:-len(".weight")]] = k
            else:
                key_map[k] = k
    for k in model_keys:
        if k.startswith("diffusion_model.decoder.") and k.endswith(".weight"):
            path = k[len("diffusion_model.decoder."):-len(".weight")]
            key_map[f"base_model.model.{path}"] = k
            key_map["lycoris_" + path.replace(".", "_")] = k
    return key_map


def comfyui_ltxav_key_map(model_keys) -> dict[str, str]:
    """`model_lora_keys_unet` for ComfyUI's LTXV / LTXAV models (keys `diffusion_model.<official DiT key>`): the
    generic map, then the branch's bare `<path>` for each `diffusion_model.<path>.weight`."""
    key_map = {}
    for k in model_keys:
        if k.startswith("diffusion_model."):
            if k.endswith(".weight"):
                path = k[len("diffusion_model."):-len(".weight")]
                key_map["lora_unet_" + path.replace(".", "_")] = k
                key_map[k[:-len(".weight")]] = k
            else:
                key_map[k] = k
    for k in model_keys:
        if k.startswith("diffusion_model.") and k.endswith(".weight"):
            key_map[k[len("diffusion_model."):-len(".weight")]] = k
    return key_map


def comfyui_lora_updates(model_keys, lora: dict[str, torch.Tensor], strength: float = 1.0, key_map=None
                         ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """What ComfyUI's LoRA loader adds to its model's weights: ({model weight key: update}, the file's keys it left
    unread, which ComfyUI logs as "lora key not loaded"). `comfy.lora.load_lora` over the key map: a module's
    `<x>.alpha` when present, its up and down by the first pair found (`_COMFYUI_PAIRS`); the update is
    strength * (alpha / rank, 1 without an alpha) * up @ down (`LoRAAdapter.calculate_weight`, rank = down's rows).
    The file's keys pass `comfy.lora_convert.convert_lora` unchanged (it renames only BFL control, Wan Fun and USO
    files). `key_map`: the model's map function (ACE-Step 1.5's by default)."""
    updates, loaded = {}, set()
    for x, target in (key_map or comfyui_ace_step15_key_map)(model_keys).items():
        alpha = None
        if f"{x}.alpha" in lora:
            alpha = lora[f"{x}.alpha"].item()
            loaded.add(f"{x}.alpha")
        pair = next(((x + u, x + d) for u, d in _COMFYUI_PAIRS if x + u in lora), None)
        if pair is None:
            continue
        up, down = lora[pair[0]].float(), lora[pair[1]].float()
        loaded.update(pair)
        scale = alpha / down.shape[0] if alpha is not None else 1.0
        updates[target] = strength * scale * (up @ down)
    return updates, set(lora) - loaded
