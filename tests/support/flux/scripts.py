"""A tiny workspace where every FLUX.1 script of the reference (examples/flux/model_training/{lora,full,special})
runs with only its script path changed: `./models/<hub id>/` with every file the scripts name, in its release's
layout and name (hub ids resolve there without a download), and `./data/diffsynth_example_dataset/flux/<name>/` in
each data set's format.

The released models' sizes cannot be written tiny, so `tiny_known_configs` gives the configs of the tiny files for
the specs that recognise bare weights by their known configs (a test adds them, as the real configs are there for
the real files)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from ..common import populate_offline_hub
from .tiny import TinyFluxSpec, write_tiny_flux, write_tiny_flux_bfl
from .variants import (TINY_CONTROLNETS, tiny_controlnet_config, tiny_dit, tiny_dit_config, tiny_image_proj_config,
                       tiny_ipadapter_config, write_tiny_bfl_dit, write_tiny_controlnet, write_tiny_image_proj,
                       write_tiny_ipadapter, write_tiny_redux, write_tiny_siglip)

DATA = Path("data") / "diffsynth_example_dataset" / "flux"
COLORS = [(220, 40, 40), (40, 60, 220), (40, 180, 70), (230, 220, 50)]
SIZE = (32, 32)
CONTROLNET_REPOS = {"union": "InstantX/FLUX.1-dev-Controlnet-Union-alpha",
                    "upscaler": "jasperai/Flux.1-dev-Controlnet-Upscaler",
                    "inpaint": "alimama-creative/FLUX.1-dev-Controlnet-Inpainting-Beta"}
INFINITEYOU = "ByteDance/InfiniteYou/infu_flux_v1.0/aes_stage2"


def _picture(path: Path, i: int, size=SIZE) -> str:
    img = Image.new("RGB", size, COLORS[(i + 1) % 4])
    w, h = size
    ImageDraw.Draw(img).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=COLORS[i % 4])
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path.name


def _mask(path: Path, box, size=SIZE) -> str:
    img = Image.new("RGB", size, (0, 0, 0))
    ImageDraw.Draw(img).rectangle(box, fill=(255, 255, 255))
    img.save(path)
    return path.name


def _csv(folder: Path, rows: list[dict], name: str = "metadata.csv") -> None:
    cols = list(rows[0])
    lines = [",".join(cols)] + [",".join(f'"{r[c]}"' if isinstance(r[c], str) else str(r[c]) for c in cols)
                                for r in rows]
    (folder / name).write_text("\n".join(lines) + "\n")


def _rows(folder: Path, n: int = 2, **columns) -> list[dict]:
    """n rows: an image and a prompt, plus each column's value for row i (a function of the folder and i)."""
    return [{"image": _picture(folder / f"image_{i}.png", i), "prompt": f"a circle number {i}",
             **{k: f(folder, i) for k, f in columns.items()}} for i in range(n)]


def _other(name):
    return lambda folder, i: _picture(folder / f"{name}_{i}.png", i + 1)


def _box(name, box=(8, 8, 23, 23)):
    return lambda folder, i: _mask(folder / f"{name}_{i}.png", box)


def text_to_image(folder: Path) -> None:
    _csv(folder, _rows(folder))


def kontext(folder: Path) -> None:
    _csv(folder, _rows(folder, kontext_images=_other("kontext")))


def fill(folder: Path) -> None:
    _csv(folder, _rows(folder, flux_fill_image=_other("fill"), flux_fill_mask=_box("fill_mask")))


def redux(folder: Path) -> None:
    _csv(folder, _rows(folder, flux_redux_image=_other("redux")))


def value_control(folder: Path) -> None:
    _csv(folder, _rows(folder, value_controller_inputs=lambda f, i: 0.2 + 0.5 * i))


def union(folder: Path) -> None:
    _csv(folder, _rows(folder, controlnet_image=_other("control"),
                       controlnet_processor_id=lambda f, i: ("canny", "depth")[i % 2]))


def upscaler(folder: Path) -> None:
    _csv(folder, _rows(folder, controlnet_image=_other("control")))


def inpaint(folder: Path) -> None:
    _csv(folder, _rows(folder, controlnet_image=_other("control"), controlnet_inpaint_mask=_box("mask")))


def eligen(folder: Path) -> None:
    rows = _rows(folder, eligen_entity_prompts=lambda f, i: ["a red circle", "a blue sky"],
                 eligen_entity_masks=lambda f, i: [_mask(f / f"entity_{i}_0.png", (8, 8, 23, 23)),
                                                   _mask(f / f"entity_{i}_1.png", (0, 0, 31, 7))])
    (folder / "metadata.json").write_text(json.dumps(rows, indent=1))


def ipadapter(folder: Path) -> None:
    _csv(folder, _rows(folder, ipadapter_images=_other("style")))


def infiniteyou(folder: Path) -> None:
    """The reference's columns (an identity image) in metadata.csv; metadata_embedding.csv: the same rows with a
    precomputed 512-number face embedding (.npy) instead, which difftune takes without InsightFace."""
    def embedding(f, i):
        path = f / f"face_{i}.npy"
        np.save(path, np.random.default_rng(i).standard_normal(512).astype(np.float32))
        return (DATA / f.name / path.name).as_posix()  # relative to the workspace, where the scripts run

    rows = _rows(folder, controlnet_image=_other("control"), infinityou_id_image=_other("face"),
                 infinityou_guidance=lambda f, i: 1.0, infinityou_face_embedding=embedding)
    _csv(folder, [{k: v for k, v in r.items() if k != "infinityou_face_embedding"} for r in rows])
    _csv(folder, [{k: v for k, v in r.items() if k != "infinityou_id_image"} for r in rows],
         "metadata_embedding.csv")


def lora_encoder(folder: Path) -> None:
    """Rows whose `lora_encoder_inputs` name FLUX.1 LoRAs (the reference's own layer names) by paths relative to the
    workspace, as the reference reads them."""
    from .lora_encoder import write_reference_named_lora

    spec = TinyFluxSpec()
    width = spec.num_attention_heads * spec.attention_head_dim

    def lora(f, i):
        path = write_reference_named_lora(f / f"lora_{i}.safetensors", dit_width=width, seed=i,
                                          num_double_blocks=spec.num_layers, num_single_blocks=spec.num_single_layers)
        return (DATA / f.name / path.name).as_posix()

    _csv(folder, _rows(folder, lora_encoder_inputs=lora))


def nexus_gen(folder: Path) -> None:
    _csv(folder, _rows(folder, nexus_gen_reference_image=_other("reference")))


def step1x(folder: Path) -> None:
    _csv(folder, _rows(folder, step1x_reference_image=_other("reference")))


def insert_anything(folder: Path) -> None:
    _csv(folder, _rows(folder, n=1, insert_anything_source_image=_other("source"),
                       insert_anything_source_mask=_box("source_mask", (10, 12, 21, 25)),
                       insert_anything_ref_image=_other("object"),
                       insert_anything_ref_mask=_box("object_mask", (6, 6, 25, 25))))


DATASETS = {
    "FLUX.1-dev": text_to_image, "FLUX.1-Krea-dev": text_to_image, "FLUX.1-Kontext-dev": kontext,
    "FLUX.1-Fill-dev": fill, "FLUX.1-Redux-dev": redux, "FLEX.2-preview": text_to_image,
    "FLUX.1-dev-AttriCtrl": value_control, "FLUX.1-dev-Controlnet-Union-alpha": union,
    "FLUX.1-dev-Controlnet-Upscaler": upscaler, "FLUX.1-dev-Controlnet-Inpainting-Beta": inpaint,
    "FLUX.1-dev-EliGen": eligen, "FLUX.1-dev-IP-Adapter": ipadapter, "FLUX.1-dev-InfiniteYou": infiniteyou,
    "FLUX.1-dev-LoRA-Encoder": lora_encoder, "Nexus-Gen": nexus_gen, "Step1X-Edit": step1x,
    "Insert-Anything": insert_anything,
}


def _copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dest)


def write_flux_script_workspace(root: str | os.PathLike) -> Path:
    """`root/models/...` and `root/data/...` for every FLUX.1 script of the reference (see the module docstring)."""
    from .lora_encoder import write_tiny_lora_encoder
    from .nexus_gen import diffsynth_dit_state, tiny_merger, write_tiny_nexus_ar
    from .step1x import connector_release_state, tiny_connector, write_tiny_qwen25vl
    from .value_control import write_tiny_value_controller

    root = Path(root)
    spec = TinyFluxSpec()
    models = root / "models"
    bfl = models / "black-forest-labs"
    # the narrowest AE (4 channels): Insert-Anything's diptych is 1536 x 768, and an 8-channel tiny AE takes ~8 s per
    # encode of it on a CPU
    repo = write_tiny_flux(root / ".tiny" / "flux", TinyFluxSpec(vae_channels=4))
    dev = populate_offline_hub(models, "black-forest-labs/FLUX.1-dev", repo)
    write_tiny_flux_bfl(dev)
    for name, file, seed in (("FLUX.1-Krea-dev", "flux1-krea-dev.safetensors", 10),
                             ("FLUX.1-Kontext-dev", "flux1-kontext-dev.safetensors", 20)):
        write_tiny_bfl_dit(bfl / name / file, spec, seed=seed)
    # FLUX.1-Fill-dev ships its own text encoders, tokenizers and AE beside the Fill transformer
    fill_repo = bfl / "FLUX.1-Fill-dev"
    for part in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "ae.safetensors"):
        _copy(dev / part, fill_repo / part)
    write_tiny_bfl_dit(fill_repo / "flux1-fill-dev.safetensors", spec, seed=30, in_channels=384, out_channels=64)
    write_tiny_redux(bfl / "FLUX.1-Redux-dev", spec)
    write_tiny_bfl_dit(models / "ostris" / "Flex.2-preview" / "Flex.2-preview.safetensors", spec, seed=40,
                       in_channels=196, out_channels=64)
    write_tiny_value_controller(models / "DiffSynth-Studio" / "AttriCtrl-FLUX.1-Dev", dim_out=spec.t5_hidden)
    for kind, repo_id in CONTROLNET_REPOS.items():
        write_tiny_controlnet(models / repo_id, kind, spec)
    write_tiny_ipadapter(models / "InstantX" / "FLUX.1-dev-IP-Adapter", spec)
    write_tiny_siglip(models / "google" / "siglip-so400m-patch14-384")
    write_tiny_image_proj(models / INFINITEYOU, spec)
    write_tiny_controlnet(models / INFINITEYOU / "InfuseNetModel", "infusenet", spec)
    write_tiny_lora_encoder(models / "DiffSynth-Studio" / "LoRA-Encoder-FLUX.1-Dev",
                            dit_width=spec.num_attention_heads * spec.attention_head_dim,
                            num_double_blocks=spec.num_layers, num_single_blocks=spec.num_single_layers,
                            embed_dim=spec.t5_hidden)
    # Nexus-GenV2: the Qwen2.5-VL (+ vision head) at the top, edit_decoder.bin = the DiT (the reference's FluxDiT
    # names under pipe.dit.) and the embedding merger
    nexus = models / "DiffSynth-Studio" / "Nexus-GenV2"
    _, ar_config = write_tiny_nexus_ar(nexus)
    (root / ".tiny" / "nexus_ar_config.json").write_text(json.dumps(ar_config))
    decoder = {"pipe.dit." + k: v.contiguous() for k, v in diffsynth_dit_state(tiny_dit(spec, seed=50)).items()}
    decoder.update({"embedding_merger." + k: v.contiguous()
                    for k, v in tiny_merger(32, spec.t5_hidden, seed=51).state_dict().items()})
    torch.save(decoder, nexus / "edit_decoder.bin")
    # Step1X-Edit: one file with the DiT (no guidance embedder) and the connector; FLUX.1's AE as vae.safetensors
    write_tiny_qwen25vl(models / "Qwen" / "Qwen2.5-VL-7B-Instruct")
    step1x = models / "stepfun-ai" / "Step1X-Edit"
    write_tiny_bfl_dit(step1x / "step1x-edit-i1258.safetensors", spec, seed=60, guidance_embeds=False,
                       extra=connector_release_state(tiny_connector(32, spec.t5_hidden, seed=61)))
    shutil.copy(dev / "ae.safetensors", step1x / "vae.safetensors")
    for name, write in DATASETS.items():
        folder = root / DATA / name
        folder.mkdir(parents=True, exist_ok=True)
        write(folder)
    return root


def tiny_known_configs(root: str | os.PathLike) -> list[tuple[object, str, dict]]:
    """(spec, label, config) for each tiny file of the workspace that is recognised by a known config (the real
    releases' configs are the specs' own)."""
    from difftune.families.flux.components import DIT, VAE
    from difftune.families.flux.controlnet import CONTROLNET
    from difftune.families.flux.infiniteyou import IMAGE_PROJ_MODEL
    from difftune.families.flux.ipadapter import IPADAPTER
    from difftune.families.flux.nexus_gen import NEXUS_AR, NEXUS_DIT
    from difftune.families.flux.step1x import STEP1X_DIT

    root = Path(root)
    spec = TinyFluxSpec()
    vae = json.loads((root / ".tiny" / "flux" / "vae" / "config.json").read_text())
    ar_config = json.loads((root / ".tiny" / "nexus_ar_config.json").read_text())
    found = [(DIT, "tiny FLUX.1-dev", tiny_dit_config(spec)),
             (DIT, "tiny FLUX.1-Fill-dev", tiny_dit_config(spec, in_channels=384, out_channels=64)),
             (DIT, "tiny Flex.2-preview", tiny_dit_config(spec, in_channels=196, out_channels=64)),
             (VAE, "tiny FLUX.1 AE", vae), (NEXUS_DIT, "tiny Nexus-Gen DiT", tiny_dit_config(spec)),
             (STEP1X_DIT, "tiny Step1X-Edit DiT", tiny_dit_config(spec, guidance_embeds=False)),
             (IPADAPTER, "tiny IP-Adapter", tiny_ipadapter_config(spec)),
             (IMAGE_PROJ_MODEL, "tiny InfiniteYou projector", tiny_image_proj_config(spec)),
             (NEXUS_AR, "tiny Nexus-GenV2", ar_config)]
    found += [(CONTROLNET, f"tiny {kind} ControlNet", tiny_controlnet_config(kind, spec)) for kind in TINY_CONTROLNETS]
    return found


__all__ = ["DATA", "DATASETS", "tiny_known_configs", "write_flux_script_workspace"]
