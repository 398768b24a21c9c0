"""Which reader loads which LoRA file difftune writes, at what strength: diffusers (`load_lora_weights`), ComfyUI's
own loader (its code, from a checkout) and DiffSynth-Studio's own loader (the `diffsynth` package), for Qwen-Image,
FLUX.1 and Wan, in each layout (`--lora_format default|diffusers|comfyui|kohya`).

For each family a tiny DiT gets a LoRA of random A and B on the family's default targets (alpha 8, rank 4: the
strength alpha/rank = 2 is not 1, so a reader that drops alpha shows). Each file is read by each reader, and the
weights it ends up with are compared with the intended ones, W + (alpha/rank) B A, over the whole DiT:

* diffusers: the family's pipeline, `load_lora_weights`; the update of every LoRA layer peft made.
* ComfyUI: `comfy.sd.load_lora_for_models` (its key maps, `lora_convert`, `load_lora`, the weight adapters) on
  ComfyUI's own model class for the family (`comfy.model_detection` picks it from the DiT's keys; the tiny widths
  and head counts are set from the tiny config, which ComfyUI's detection assumes to be the released ones), then
  `ModelPatcher.patch_model`; keys it reports as not loaded are counted.
* DiffSynth-Studio: the pipeline's loader (`GeneralLoRALoader`, FLUX's `FluxLoRALoader`) as
  `BasePipeline.load_lora` calls it (convert, then fuse) on a model holding the DiT's Linear layers under the
  reference's module names; beside it, tests/support/lora_readers.py's step-by-step rewrite, which the tests use
  where the package is absent: the two must agree.

Run it in a venv that has ComfyUI's and DiffSynth-Studio's requirements (torchvision's compiled ops are not needed:
a CPU-only torch without torchvision works, the two modules are stubbed):

    python3 -m venv /tmp/comfy_venv && echo $PWD/.venv/lib/python3.11/site-packages > \\
        /tmp/comfy_venv/lib/python3.11/site-packages/difftune_venv.pth
    /tmp/comfy_venv/bin/pip install einops torchsde scipy psutil imageio modelscope && \\
        /tmp/comfy_venv/bin/pip install --no-deps diffsynth==2.1.12
    git clone https://github.com/Comfy-Org/ComfyUI /tmp/ComfyUI && git -C /tmp/ComfyUI checkout a125cd84
    PYTHONPATH=src /tmp/comfy_venv/bin/python benchmarks/lora_readers.py --comfyui /tmp/ComfyUI

The last line printed is the JSON result; the table goes to docs/lora_files.md (unless --no-doc).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import logging
import sys
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402,F401  (puts tests/ on the path: the tiny models and the readers' rewrite, tests/support)

FAMILIES = ("qwen_image", "flux", "wan")
LAYOUTS = ("default", "diffusers", "comfyui", "kohya")
TOLERANCE = 1e-5


class _Stub(types.ModuleType):
    """A module that is only imported, never used by the LoRA code (torchvision / torchaudio)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Stub(f"{self.__name__}.{name}")
        sys.modules[sub.__name__] = sub
        return sub

    def __call__(self, *args, **kwargs):
        return self

    def __mro_entries__(self, bases):
        return (object,)


def _stub(*names):
    for name in names:
        try:
            __import__(name)
        except Exception:
            sys.modules[name] = _Stub(name)
            sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)


def comfyui_patched(comfyui: Path, family: str, known, path) -> tuple[dict, list[str]]:
    """ComfyUI's weights (its key names) after `load_lora_for_models`, and the file's keys it did not load."""
    if str(comfyui) not in sys.path:
        sys.path.insert(0, str(comfyui))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sd
    import comfy.utils
    from safetensors.torch import load_file

    from support.lora_readers import comfyui_state_dict

    sd = {f"diffusion_model.{k}": v for k, v in comfyui_state_dict(family, known.base).items()}
    config = json.loads((known.repo / "transformer" / "config.json").read_text())
    unet = comfy.model_detection.detect_unet_config(sd, "diffusion_model.")
    if family == "wan":
        unet.update(num_heads=config["num_attention_heads"], freq_dim=config["freq_dim"], text_dim=config["text_dim"],
                    eps=config["eps"])
    elif family == "qwen_image":
        unet.update(num_attention_heads=config["num_attention_heads"], attention_head_dim=config["attention_head_dim"],
                    joint_attention_dim=config["joint_attention_dim"], axes_dims_rope=tuple(config["axes_dims_rope"]),
                    out_channels=config["out_channels"], patch_size=config["patch_size"])
    elif family == "flux":
        unet.update(hidden_size=config["num_attention_heads"] * config["attention_head_dim"],
                    num_heads=config["num_attention_heads"], context_in_dim=config["joint_attention_dim"],
                    vec_in_dim=config["pooled_projection_dim"], axes_dim=list(config["axes_dims_rope"]),
                    in_channels=config["in_channels"] // 4, out_channels=config["in_channels"] // 4)
    model_config = comfy.model_detection.model_config_from_unet_config(unet, sd)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model(sd, "diffusion_model.")
    model.load_model_weights(sd, "diffusion_model.")
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        patched, _ = comfy.sd.load_lora_for_models(patcher, None, load_file(str(path)), 1.0, 0)
        patched.patch_model()
    finally:
        logging.getLogger().removeHandler(handler)
    weights = {k: v.detach().float() for k, v in patched.model.diffusion_model.state_dict().items()}
    unloaded = [r.getMessage() for r in records if "not loaded" in r.getMessage().lower()]
    return weights, unloaded


def diffsynth_real(family: str, known, path) -> tuple[dict, set]:
    """DiffSynth-Studio's own loader on the DiT's Linear layers under the reference's names."""
    from diffsynth.utils.lora import GeneralLoRALoader
    from diffsynth.utils.lora.flux import FluxLoRALoader
    from safetensors.torch import load_file

    from support.lora_readers import reference_weights

    weights = reference_weights(family, known.base)
    model = torch.nn.Module()
    for name, w in weights.items():
        parent = model
        *parents, leaf = name.split(".")
        for part in parents:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.clone()
        parent.add_module(leaf, linear)
    loader = (FluxLoRALoader if family == "flux" else GeneralLoRALoader)(torch_dtype=torch.float32, device="cpu")
    lora = loader.convert_state_dict(load_file(str(path)))  # BasePipeline.load_lora, then the fuse converts again
    loader.fuse_lora_to_base_model(model, lora, alpha=1)
    fused = {n: m.weight.detach().float() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = {k[: -len(".lora_B.weight")] for k in loader.convert_state_dict(dict(lora)) if k.endswith(".lora_B.weight")}
    return fused, names - set(weights)


def check(comfyui: Path | None, workdir: Path, families=FAMILIES) -> dict:
    from support import quiet_hf
    from support.lora_readers import (KnownLora, comfyui_state_dict, max_difference, reference_weights)

    quiet_hf()
    results = {}
    for family in families:
        known = KnownLora(family, workdir / family)
        trained = known.trained()
        for layout in LAYOUTS:
            actual = known.spec.lora_default_format if layout == "default" else layout
            path = known.save(workdir / f"{family}-{layout}.safetensors", actual)
            row = {"layout": actual}
            try:
                got = known.diffusers_updates(path)
                row["diffusers"] = max_difference(got, known.intended)
                row["diffusers_missing"] = len(set(known.intended) - set(got))
            except Exception as err:  # a reader that refuses the file
                row["diffusers"], row["diffusers_error"] = float("inf"), f"{type(err).__name__}: {err}"[:200]
            want = reference_weights(family, trained)
            ours, skipped = known.reference_result(path)
            row["diffsynth_rewrite"], row["diffsynth_rewrite_skipped"] = max_difference(ours, want), len(skipped)
            try:
                real, real_skipped = diffsynth_real(family, known, path)
                row["diffsynth"], row["diffsynth_skipped"] = max_difference(real, want), len(real_skipped)
                row["rewrite_vs_real"] = max_difference(ours, real)
            except ImportError as err:
                row["diffsynth_error"] = f"not installed ({err})"
            if comfyui is not None:
                weights, unloaded = comfyui_patched(comfyui, family, known, path)
                row["comfyui"] = max_difference(weights, comfyui_state_dict(family, trained))
                row["comfyui_not_loaded"] = len(unloaded)
            results[f"{family}/{layout}"] = row
            print(f"{family:10s} {layout:9s} ({actual:9s}) " + " ".join(
                f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "layout"),
                flush=True)
    return results


def verdict(value, extra=0) -> str:
    return "yes" if value <= TOLERANCE and not extra else "no"


def table(results: dict) -> str:
    lines = ["| family | layout | diffusers | ComfyUI | DiffSynth-Studio |", "|---|---|---|---|---|"]
    for key, row in results.items():
        family, layout = key.split("/")
        name = f"{layout} ({row['layout']})" if layout == "default" else layout
        diffusers = ("refused (FLUX.1's widths needed)" if "AssertionError" in row.get("diffusers_error", "") else
                     verdict(row.get("diffusers", float("inf")), row.get("diffusers_missing", 0)))
        cells = [diffusers,
                 verdict(row["comfyui"], row.get("comfyui_not_loaded")) if "comfyui" in row else "not run",
                 verdict(row.get("diffsynth", row["diffsynth_rewrite"]),
                         row.get("diffsynth_skipped", row["diffsynth_rewrite_skipped"]))]
        lines.append(f"| {family} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", type=Path, default=None, help="a ComfyUI checkout (its comfy/ package is imported)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/lora_files.md alone")
    p.add_argument("--quick", action="store_true", help="(the same run: it is small)")
    args = p.parse_args(argv)
    import difftune.core.family  # noqa: F401  (diffusers decides what it has before the stubs go in)
    from difftune.core.family import families

    families()
    import diffusers.loaders.peft  # noqa: F401

    _stub("torchvision", "torchaudio")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lora_readers_"))
    results = check(args.comfyui, workdir, tuple(args.families.split(",")))
    print(table(results))
    if not args.no_doc:
        doc = ROOT / "docs" / "lora_files.md"
        text = doc.read_text()
        start, end = "<!-- lora_readers table -->", "<!-- end lora_readers table -->"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            doc.write_text(head + start + "\n" + table(results) + "\n" + end + rest.split(end, 1)[1])
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
