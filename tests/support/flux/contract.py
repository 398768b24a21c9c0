"""The FLUX.1 variants for the family contract suite (`TinyFamily.variants`): each variant's tiny models (written
where `difftune train --model_paths` finds them with a config.json beside where their sizes are not in the
weights) and a data set with its columns. Models are written once per folder, on first use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..common import TinyFamily, TinyVariant, register_tiny, write_example_dataset
from .scripts import _box, _csv, _other, _rows
from .tiny import TinyFluxSpec, tiny_flux_paths, write_kontext_dataset, write_tiny_flux
from .variants import (tiny_controlnet_config, tiny_dit, tiny_image_proj_config, tiny_ipadapter_config,
                       write_tiny_redux, write_tiny_siglip)

def _entries(paths: dict) -> list:
    return [p if len(p) > 1 else p[0] for p in paths.values()]


def _save(model, folder: Path) -> str:
    model.save_pretrained(folder)
    return str(next(folder.glob("*.safetensors")))


class ContractModels:
    """The variants' models beside the family's tiny repository `repo`, written when a variant first asks."""

    def __init__(self, folder: Path, repo: Path):
        self.folder, self.repo, self.spec = Path(folder), Path(repo), TinyFluxSpec()
        self.base = tiny_flux_paths(repo)
        self.written: dict[str, object] = {}

    def _once(self, name, make):
        if name not in self.written:
            self.written[name] = make()
        return self.written[name]

    def dit(self, name: str, **overrides) -> str:
        return self._once(f"dit_{name}", lambda: _save(tiny_dit(self.spec, seed=7, **overrides), self.folder / name))

    def with_base(self, *extra, dit: str | None = None) -> list:
        entries = _entries({**self.base, "transformer": [dit]} if dit else self.base)
        return [*entries, *extra]

    def controlnet(self, kind: str) -> str:
        from difftune.families.flux.controlnet import FluxMultiControlNet

        def make():
            config = tiny_controlnet_config(kind, self.spec)
            model = FluxMultiControlNet.from_config({k: v for k, v in config.items() if not k.startswith("_")})
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for p in model.parameters():  # diffusers zero-initialises the output blocks: random, so they act
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            return _save(model, self.folder / f"controlnet_{kind}")
        return self._once(f"controlnet_{kind}", make)

    def redux(self) -> list[str]:
        return self._once("redux", lambda: [str(p) for p in write_tiny_redux(self.folder / "redux", self.spec).values()])

    def ipadapter(self) -> list[str]:
        from difftune.families.flux.ipadapter import FluxIPAdapter

        def make():
            torch.manual_seed(4)
            return [_save(FluxIPAdapter.from_config(tiny_ipadapter_config(self.spec)), self.folder / "ipadapter"),
                    str(write_tiny_siglip(self.folder / "siglip"))]
        return self._once("ipadapter", make)

    def infiniteyou(self) -> list[str]:
        from difftune.families.flux.infiniteyou import InfiniteYouImageProjection

        def make():
            torch.manual_seed(5)
            return [self.controlnet("infusenet"),
                    _save(InfiniteYouImageProjection.from_config(tiny_image_proj_config(self.spec)),
                          self.folder / "image_proj")]
        return self._once("infiniteyou", make)

    def value_controller(self) -> str:
        from .value_control import write_tiny_value_controller

        return self._once("value", lambda: str(write_tiny_value_controller(self.folder / "attrictrl",
                                                                           dim_out=self.spec.t5_hidden)))

    def lora_encoder(self) -> str:
        from .lora_encoder import write_tiny_lora_encoder

        s = self.spec
        return self._once("lora_encoder", lambda: str(write_tiny_lora_encoder(
            self.folder / "lora_encoder", dit_width=s.num_attention_heads * s.attention_head_dim,
            num_double_blocks=s.num_layers, num_single_blocks=s.num_single_layers, embed_dim=s.t5_hidden)))

    def nexus(self) -> list[str]:
        """Nexus-Gen: the autoregressive model (with its processor/ beside) and the embedding merger alone (its
        release keeps it in edit_decoder.bin beside the DiT; the family's tiny DiT stands in for that one)."""
        from safetensors.torch import save_file

        from difftune.families.flux.nexus_gen import NexusGenAR
        from ..qwen_image import TinyQwenImageSpec, qwen_tokenizer, tiny_qwen_text_encoder
        from .nexus_gen import tiny_merger

        def make():
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            root = self.folder / "nexus"
            tok = qwen_tokenizer()
            qwen = tiny_qwen_text_encoder(TinyQwenImageSpec(seed=0), tok)
            torch.manual_seed(1)
            ar = NexusGenAR(qwen_config=qwen.config.to_dict())
            ar.model.load_state_dict(qwen.state_dict())
            ar_file = _save(ar, root / "ar")
            tok.save_pretrained(root / "processor")
            Qwen2VLImageProcessorPil().save_pretrained(root / "processor")
            merger = {"embedding_merger." + k: v.contiguous()
                      for k, v in tiny_merger(32, self.spec.t5_hidden, seed=2).state_dict().items()}
            save_file(merger, str(root / "merger.safetensors"))
            return [ar_file, str(root / "merger.safetensors")]
        return self._once("nexus", make)

    def step1x(self) -> list[str]:
        """Step1X-Edit: its DiT (no guidance embedder, config.json beside), the connector's file, Qwen2.5-VL."""
        from safetensors.torch import save_file

        from .step1x import connector_release_state, tiny_connector, write_tiny_qwen25vl

        def make():
            root = self.folder / "step1x"
            dit = self.dit("step1x_dit", guidance_embeds=False)
            root.mkdir(parents=True, exist_ok=True)
            save_file(connector_release_state(tiny_connector(32, self.spec.t5_hidden, seed=3)),
                      str(root / "connector.safetensors"))
            qwen = write_tiny_qwen25vl(root / "qwen")
            shards = sorted(str(p) for p in qwen.glob("model*.safetensors"))
            return [dit, str(root / "connector.safetensors"), shards, *_entries(
                {"vae": self.base["vae"]})]
        return self._once("step1x", make)


def _columns(write):
    def dataset(root):
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        return write(root)
    return dataset


def _csv_rows(**columns):
    def write(root):
        _csv(root, _rows(root, **columns))
        return root / "metadata.csv"
    return _columns(write)


def _eligen(root):
    from .scripts import _mask

    rows = _rows(root, eligen_entity_prompts=lambda f, i: ["a red circle", "a blue sky"],
                 eligen_entity_masks=lambda f, i: [_mask(f / f"entity_{i}_0.png", (8, 8, 23, 23)),
                                                   _mask(f / f"entity_{i}_1.png", (0, 0, 31, 7))])
    (root / "metadata.json").write_text(json.dumps(rows, indent=1))
    return root / "metadata.json"


def _face(f, i):
    path = f / f"face_{i}.npy"
    np.save(path, np.random.default_rng(i).standard_normal(512).astype(np.float32))
    return str(path.resolve())


def _lora(f, i):
    from .lora_encoder import write_reference_named_lora

    s = TinyFluxSpec()
    return str(write_reference_named_lora(f / f"lora_{i}.safetensors", seed=i,
                                          dit_width=s.num_attention_heads * s.attention_head_dim,
                                          num_double_blocks=s.num_layers, num_single_blocks=s.num_single_layers)
               .resolve())


def _flags(images: str = "", values: str = "") -> tuple:
    named = ",".join(x for x in (images, values) if x)
    return (*(("--data_file_keys", f"image,{images}") if images else ()), "--extra_inputs", named)


def contract_variants(folder: Path, repo: Path) -> dict[str, TinyVariant]:
    """name (the feature it switches on, or the variant pipeline's) -> TinyVariant."""
    m = ContractModels(folder, repo)
    fill_dit = lambda: m.dit("fill_dit", in_channels=384, out_channels=64)  # noqa: E731
    return {
        "controlnet": TinyVariant(
            flags=_flags("controlnet_image,controlnet_inpaint_mask"),
            write_dataset=_csv_rows(controlnet_image=_other("control"), controlnet_inpaint_mask=_box("mask")),
            model_paths=lambda: m.with_base(m.controlnet("inpaint"))),
        "fill": TinyVariant(
            flags=_flags("flux_fill_image,flux_fill_mask"),
            write_dataset=_csv_rows(flux_fill_image=_other("fill"), flux_fill_mask=_box("fill_mask")),
            model_paths=lambda: m.with_base(dit=fill_dit())),
        "redux": TinyVariant(flags=_flags("flux_redux_image"), write_dataset=_csv_rows(flux_redux_image=_other("redux")),
                             model_paths=lambda: m.with_base(*m.redux())),
        "ipadapter": TinyVariant(flags=_flags("ipadapter_images"),
                                 write_dataset=_csv_rows(ipadapter_images=_other("style")),
                                 model_paths=lambda: m.with_base(*m.ipadapter())),
        "infiniteyou": TinyVariant(
            flags=_flags("controlnet_image", "infinityou_face_embedding,infinityou_guidance"),
            write_dataset=_csv_rows(controlnet_image=_other("control"), infinityou_face_embedding=_face,
                                    infinityou_guidance=lambda f, i: 1.5),
            model_paths=lambda: m.with_base(*m.infiniteyou())),
        "eligen": TinyVariant(flags=_flags("eligen_entity_masks", "eligen_entity_prompts"),
                              write_dataset=_columns(_eligen)),
        "flex": TinyVariant(
            flags=_flags("flex_inpaint_image,flex_inpaint_mask"),
            write_dataset=_csv_rows(flex_inpaint_image=_other("inpaint"), flex_inpaint_mask=_box("mask")),
            model_paths=lambda: m.with_base(dit=m.dit("flex_dit", in_channels=196, out_channels=64))),
        "value_control": TinyVariant(flags=_flags(values="value_controller_inputs"),
                                     write_dataset=_csv_rows(value_controller_inputs=lambda f, i: 0.3 + 0.4 * i),
                                     model_paths=lambda: m.with_base(m.value_controller())),
        "lora_encoder": TinyVariant(flags=_flags(values="lora_encoder_inputs"),
                                    write_dataset=_csv_rows(lora_encoder_inputs=_lora),
                                    model_paths=lambda: m.with_base(m.lora_encoder())),
        "nexus_gen": TinyVariant(flags=_flags("nexus_gen_reference_image"),
                                 write_dataset=_csv_rows(nexus_gen_reference_image=_other("reference")),
                                 model_paths=lambda: m.with_base(*m.nexus())),
        "insert_anything": TinyVariant(
            flags=(*_flags("insert_anything_source_image,insert_anything_source_mask,insert_anything_ref_image,"
                           "insert_anything_ref_mask"), "--insert_anything_size", "32"),
            write_dataset=_csv_rows(insert_anything_source_image=_other("source"),
                                    insert_anything_source_mask=_box("source_mask", (10, 12, 21, 25)),
                                    insert_anything_ref_image=_other("object"),
                                    insert_anything_ref_mask=_box("object_mask", (6, 6, 25, 25))),
            model_paths=lambda: m.with_base(*m.redux(), dit=fill_dit())),
        "Step1XEditPipeline": TinyVariant(flags=_flags("step1x_reference_image"),
                                          write_dataset=_csv_rows(step1x_reference_image=_other("reference")),
                                          model_paths=m.step1x),
    }


# every slot a variant fills (the family's tiny models leave them empty)
OPTIONAL_SLOTS = ("controlnet", "ipadapter", "ipadapter_image_encoder", "flux_redux_image_encoder",
                  "flux_redux_image_embedder", "image_proj_model", "value_controller", "lora_encoder", "nexus_gen",
                  "nexus_gen_editing_adapter", "qwenvl", "step1x_connector")

__all__ = ["ContractModels", "OPTIONAL_SLOTS", "contract_variants"]


def _tiny_flux(folder: Path) -> TinyFamily:
    """The family's tiny models for the contract suite, with every variant above."""
    from difftune.families.flux.components import LORA_TARGET_MODULES

    paths = tiny_flux_paths(write_tiny_flux(folder / "repo"))
    entries = [p if len(p) > 1 else p[0] for p in paths.values()]
    kontext = TinyVariant(flags=("--data_file_keys", "image,kontext_images", "--extra_inputs", "kontext_images"),
                          write_dataset=lambda root: write_kontext_dataset(root, n=2))
    variants = {"kontext": kontext, **contract_variants(folder / "variants", folder / "repo")}
    return TinyFamily(model_paths=entries, lora_base_model="dit", lora_target_modules=LORA_TARGET_MODULES,
                      write_dataset=lambda root: write_example_dataset(root, n=2, size=(48, 32)),
                      flags=("--max_pixels", "4096"),
                      trainable_cases={
                          "clip_lora": ("--lora_base_model", "text_encoder", "--lora_target_modules", "q_proj,v_proj"),
                          "t5_lora": ("--lora_base_model", "text_encoder_2", "--lora_target_modules", "q,v")},
                      optional_slots=OPTIONAL_SLOTS, variants=variants)


register_tiny("flux", _tiny_flux)
