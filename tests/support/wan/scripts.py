"""A tiny workspace where every Wan script of the reference (tests/reference_scripts/wanvideo/model_training/) runs
with only its script path changed: `./models/<hub id>/` for every repository the scripts name, in the layout the
scripts name its files (Wan-AI's / PAI's / iic's / krea's original files: DiTs in Wan's key names with Wan's own
config.json, the UMT5 / VAE / CLIP .pth files, the tokenizer in google/umt5-xxl/), and
`./data/diffsynth_example_dataset/wanvideo/<name>/` with one sample each, in the columns its script reads.

Bare original files are recognised against the official configs; `write_wan_script_workspace` returns the tiny
models' configs too ((spec, label, config) entries), which a test adds to the official ones. The VAE is the
narrowest Wan2.1 VAE (its first width 2): the scripts' --height 480 --width 832 are kept, so every clip is encoded
at that size.

A variant of another part of the family adds its repositories to `REPOSITORIES` and its data sets to `DATASETS`.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from ..video import moving_circle_frames
from .common import TINY, save_tensors, write_wan_config

DATA = Path("data") / "diffsynth_example_dataset" / "wanvideo"
MODELS = Path("models")
# Frames per clip: one (a 4k + 1 count; every clip is encoded at the scripts' 480 x 832, which a five-frame clip
# makes five times slower), five for Wan2.2-Animate (its training cut, the clip minus 4 frames, leaves one)
FRAMES = 1
ANIMATE_FRAMES = 5
CLIP_SIZE = (52, 30)  # (width, height) of the written clips; the scripts' --height / --width resize them
VAE_BASE_DIM = 2
ANIMATE2_LAYERS = 40
COMMON = ("models_t5_umt5-xxl-enc-bf16.pth", "google")


class Workspace:
    """What the writers share: the root, the tiny base repositories (written once, copied into each repository
    that names them) and the tiny configs the tests register."""

    def __init__(self, root: Path):
        self.root = root
        self.build = root / ".tiny"
        self.known: list[tuple] = []
        self._bases: dict[str, Path] = {}

    def base(self, kind: str) -> Path:
        """A tiny Wan-AI repository of `kind` (t2v, i2v, a14b, i2v_a14b, ti2v) in the original layout."""
        from .tiny import write_tiny_wan_original

        if kind not in self._bases:
            folder, twin = write_tiny_wan_original(self.build / kind, kind, vae_base_dim=VAE_BASE_DIM)
            twin = Path(shutil.move(str(twin), str(self.build / f"{kind}.diffusers")))
            self._bases[kind] = folder
            self.register_base(kind, twin)
        return self._bases[kind]

    def register_base(self, kind: str, twin: Path) -> None:
        from difftune.families.wan.components import DIT_ORIGINAL
        from .common import base_known_configs

        read = lambda folder: json.loads((twin / folder / "config.json").read_text())  # noqa: E731
        for spec, label, config in base_known_configs(twin):
            self.add(spec, f"{label} {kind}", config)
        self.add(DIT_ORIGINAL, f"tiny {kind}", read("transformer"))

    def add(self, spec, label: str, config: dict) -> None:
        if not any(s is spec and c == config for s, _, c in self.known):
            self.known.append((spec, label, config))

    def repo(self, hub_id: str, kind: str = "t2v", files=("Wan2.1_VAE.pth", *COMMON), clip: bool = False,
             dit: bool = False) -> Path:
        """./models/<hub_id>/ with `files` of the `kind` base (its CLIP too with `clip`; its DiT with `dit`)."""
        base = self.base(kind)
        dest = self.root / MODELS / hub_id
        dest.mkdir(parents=True, exist_ok=True)
        names = list(files) + (["models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"] if clip else [])
        if dit:
            names += [p.name for p in base.iterdir() if p.name.startswith("diffusion_pytorch_model")
                      or p.name == "config.json" or p.name.endswith("_noise_model")]
        for name in names:
            src = base / name
            if src.is_dir():
                shutil.copytree(src, dest / name, dirs_exist_ok=True)
            else:
                shutil.copy(src, dest / name)
        return dest


def _experts(folder: Path, write_one: Callable[[Path, int], None], experts: bool) -> None:
    for i, sub in enumerate(["high_noise_model", "low_noise_model"] if experts else [""]):
        write_one(folder / sub if sub else folder, i)


# -- the repositories the scripts name -------------------------------------------------------------------------
def base_repos(ws: Workspace) -> None:
    """Wan-AI's own repositories (T2V, I2V, the A14B experts, TI2V-5B), and krea's T2V-14B fine-tune."""
    for hub_id, kind, clip in (("Wan-AI/Wan2.1-T2V-1.3B", "t2v", False), ("Wan-AI/Wan2.1-T2V-14B", "t2v", False),
                               ("Wan-AI/Wan2.1-I2V-14B-480P", "i2v", True), ("Wan-AI/Wan2.1-I2V-14B-720P", "i2v", True),
                               ("Wan-AI/Wan2.2-T2V-A14B", "a14b", False), ("Wan-AI/Wan2.2-I2V-A14B", "i2v_a14b", False)):
        ws.repo(hub_id, kind, clip=clip, dit=True)
    ws.repo("Wan-AI/Wan2.2-TI2V-5B", "ti2v", files=("Wan2.2_VAE.pth", *COMMON), dit=True)
    # krea-realtime-video-14b.safetensors: the T2V-14B DiT in Wan's names under a `model.` prefix
    from safetensors.torch import load_file

    state = load_file(str(ws.base("t2v") / "diffusion_pytorch_model.safetensors"))
    save_tensors({f"model.{k}": v for k, v in state.items()},
                 ws.root / MODELS / "krea" / "krea-realtime-video" / "krea-realtime-video-14b.safetensors")


def inp_repos(ws: Workspace) -> None:
    """FLF2V (the I2V DiT with the image position embedding for two CLIP images) and PAI's Fun-InP (the I2V DiT
    with CLIP at 1.3B and 14B size; Wan2.2-Fun-A14B-InP as I2V-A14B's experts)."""
    from difftune.families.wan.components import DIT_ORIGINAL
    from difftune.families.wan.dit_keys import dit_to_original
    from .flf2v_inp import tiny_flf2v_transformer

    folder = ws.repo("Wan-AI/Wan2.1-FLF2V-14B-720P", "i2v", clip=True)
    model = tiny_flf2v_transformer()
    save_tensors(dit_to_original(model.state_dict()), folder / "diffusion_pytorch_model.safetensors")
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    write_wan_config(folder, "WanModel", config, model_type="flf2v")
    ws.add(DIT_ORIGINAL, "tiny flf2v", {"_class_name": "WanTransformer3DModel", **config})
    for size in ("1.3B", "14B", "V1.1-1.3B", "V1.1-14B"):
        ws.repo(f"PAI/Wan2.1-Fun-{size}-InP", "i2v", clip=True, dit=True)
    ws.repo("PAI/Wan2.2-Fun-A14B-InP", "i2v_a14b", dit=True)


def fun_control_repos(ws: Workspace) -> None:
    """PAI's Fun-Control / Control-Camera DiTs (ref_conv, control_adapter where they have one)."""
    from difftune.families.wan.dit_keys import dit_to_original
    from difftune.families.wan.fun_control import FUN_DIT_ORIGINAL
    from .fun_control import VARIANTS, tiny_fun_transformer

    repos = {"Wan2.1-Fun-1.3B-Control": "control", "Wan2.1-Fun-14B-Control": "control",
             "Wan2.1-Fun-V1.1-1.3B-Control": "control_v11", "Wan2.1-Fun-V1.1-14B-Control": "control_v11",
             "Wan2.1-Fun-V1.1-1.3B-Control-Camera": "camera", "Wan2.1-Fun-V1.1-14B-Control-Camera": "camera",
             "Wan2.2-Fun-A14B-Control": "control_a14b", "Wan2.2-Fun-A14B-Control-Camera": "camera_a14b"}
    for repo, variant in repos.items():
        _, image, _, _, experts = VARIANTS[variant]
        folder = ws.repo(f"PAI/{repo}", "i2v" if image else "t2v", clip=image)

        def write(where: Path, i: int, variant=variant):
            model = tiny_fun_transformer(variant, seed=TINY.seed + 30 + i)
            save_tensors(dit_to_original(model.state_dict()), where / "diffusion_pytorch_model.safetensors")
            config = {k: v for k, v in model.config.items() if not k.startswith("_")}
            write_wan_config(where, "WanModel", config, model_type="i2v")
            ws.add(FUN_DIT_ORIGINAL, f"tiny {variant}", {"_class_name": "WanFunTransformer3DModel", **config})

        _experts(folder, write, experts)


def vace_repos(ws: Workspace) -> None:
    """Wan-AI's / iic's VACE files (the T2V DiT and the VACE branch in one file), PAI's Wan2.2-VACE-Fun-A14B."""
    from difftune.families.wan.vace import VACE_DIT_ORIGINAL, VACE_ORIGINAL
    from .vace import tiny_vace_transformer, write_vace_file

    for hub_id, experts in (("Wan-AI/Wan2.1-VACE-1.3B", False), ("iic/VACE-Wan2.1-1.3B-Preview", False),
                            ("Wan-AI/Wan2.1-VACE-14B", False), ("PAI/Wan2.2-VACE-Fun-A14B", True)):
        folder = ws.repo(hub_id, "t2v")

        def write(where: Path, i: int):
            dit, vace = write_vace_file(where, tiny_vace_transformer(seed=TINY.seed + 20 + i))
            ws.add(VACE_DIT_ORIGINAL, "tiny", dit)
            ws.add(VACE_ORIGINAL, "tiny", vace)

        _experts(folder, write, experts)


def animate_repos(ws: Workspace) -> None:
    """Wan2.2-Animate-14B (the I2V DiT and the animate adapter in one file) and Wan2.2-Animate-2-14B
    (videomodel/Wan-AI/ UMT5 + CLIP, wan_animate_2/ transformers; its scripts take the VAE from
    Wan-AI/Wan2.1-T2V-14B)."""
    from difftune.families.wan.animate import ANIMATE_ADAPTER_ORIGINAL, ANIMATE_DIT_ORIGINAL
    from difftune.families.wan.animate2 import ANIMATE2_ORIGINAL, animate2_to_original
    from difftune.families.wan.components import IMAGE_ENCODER_ORIGINAL
    from .animate import animate_file_state, tiny_animate_configs, tiny_animate_transformer
    from .animate2 import FILES, _clip_pth, tiny_animate2_transformer

    folder = ws.repo("Wan-AI/Wan2.2-Animate-14B", "i2v", clip=True)
    model = tiny_animate_transformer()
    save_tensors(animate_file_state(model), folder / "diffusion_pytorch_model.safetensors")
    dit, adapter = tiny_animate_configs(model)
    write_wan_config(folder, "WanModel", dit, model_type="animate")
    ws.add(ANIMATE_DIT_ORIGINAL, "tiny", dit)
    ws.add(ANIMATE_ADAPTER_ORIGINAL, "tiny", adapter)

    root = ws.root / MODELS / "Wan-AI" / "Wan2.2-Animate-2-14B"
    video = ws.repo("Wan-AI/Wan2.2-Animate-2-14B/videomodel/Wan-AI", "t2v", files=COMMON)
    ws.add(IMAGE_ENCODER_ORIGINAL, "tiny animate-2", _clip_pth(video / "models_clip_open-clip-xlm-roberta-large-"
                                                                       "vit-huge-14.pth"))
    for name, offset in FILES.items():  # at the released depth: the full-training script names every block
        model = tiny_animate2_transformer(seed=TINY.seed + 60 + offset, num_layers=ANIMATE2_LAYERS)
        save_tensors(animate2_to_original(model.state_dict()), root / "wan_animate_2" / name)
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    ws.add(ANIMATE2_ORIGINAL, "tiny", {"_class_name": "WanAnimate2Transformer3DModel", **config})


def speed_control_repos(ws: Workspace) -> None:
    """DiffSynth-Studio/Wan2.1-1.3b-speedcontrol-v1's model.safetensors (the motion controller)."""
    from .speed_control import write_tiny_speed_control

    write_tiny_speed_control(ws.root / MODELS / "DiffSynth-Studio" / "Wan2.1-1.3b-speedcontrol-v1")


REPOSITORIES: list[Callable[[Workspace], None]] = [base_repos, inp_repos, fun_control_repos, vace_repos,
                                                    animate_repos, speed_control_repos]


# -- the data sets ---------------------------------------------------------------------------------------------
def _clip(path: Path, seed: int, frames: int = FRAMES, size=CLIP_SIZE) -> str:
    from difftune.media.video import write_video

    colors = [(220, 40, 40), (40, 60, 220), (40, 180, 70), (230, 220, 50)]
    write_video(moving_circle_frames(frames, size, colors[seed % 4], colors[(seed + 1) % 4]), path, fps=16)
    return path.name


def _picture(path: Path, seed: int, size=CLIP_SIZE) -> str:
    colors = [(230, 220, 50), (220, 40, 40), (40, 60, 220), (40, 180, 70)]
    img = Image.new("RGB", size, colors[(seed + 1) % 4])
    w, h = size
    ImageDraw.Draw(img).rectangle((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=colors[seed % 4])
    img.save(path)
    return path.name


def write_rows(folder: Path, rows: list[dict], fmt: str = "csv") -> Path:
    """metadata.csv (or .json) with the rows' columns, as the reference's example data sets."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        path = folder / "metadata.json"
        path.write_text(json.dumps(rows, indent=1))
        return path
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    path = folder / "metadata.csv"
    path.write_text(out.getvalue())
    return path


def plain(folder: Path, frames: int = FRAMES, **extra) -> Path:
    return write_rows(folder, [{"video": _clip(folder / "video_1.mp4", 0, frames), "prompt": "a ball rolling",
                                **extra}])


def first_last(folder: Path) -> Path:
    """Clips with a first and a last frame apart (FLF2V / Fun-InP: input_image and end_image from the clip)."""
    return plain(folder, frames=5)


def distill(folder: Path) -> Path:
    return plain(folder, seed=0, rand_device="cpu", num_inference_steps=2, cfg_scale=2)


def control(folder: Path, reference: bool = False) -> Path:
    extra = {"reference_image": _picture(folder / "reference_1.png", 3)} if reference else {}
    return plain(folder, control_video=_clip(folder / "control_1.mp4", 1), **extra)


def camera(folder: Path) -> Path:
    # 5 frames: the camera moves from the first frame's pose, which a one-frame clip never leaves
    return plain(folder, frames=5, camera_control_direction="LeftUp", camera_control_speed=0.0185)


def vace(folder: Path) -> Path:
    return plain(folder, vace_video=_clip(folder / "vace_video_1.mp4", 2),
                 vace_reference_image=_picture(folder / "vace_reference_1.png", 1))


def speed(folder: Path) -> Path:
    return plain(folder, motion_bucket_id=5)


def animate(folder: Path) -> Path:
    return write_rows(folder, [{"video": _clip(folder / "video_1.mp4", 0, ANIMATE_FRAMES), "prompt": "a person",
                                "animate_pose_video": _clip(folder / "pose_1.mp4", 2, ANIMATE_FRAMES),
                                "animate_face_video": _clip(folder / "face_1.mp4", 3, ANIMATE_FRAMES, (24, 24))}])


def animate2(folder: Path) -> Path:
    return write_rows(folder, [{"video": _clip(folder / "video_1.mp4", 0), "prompt": "a person dancing",
                                "animate2_reference_image": _picture(folder / "reference_1.png", 2),
                                "animate2_reference_video": _clip(folder / "reference_video_1.mp4", 3),
                                "animate2_prompt_ref": "a person walking"}], fmt="json")


# data set folder -> writer (folder -> metadata path); each script names its folder
DATASETS: dict[str, Callable[[Path], Path]] = {
    **{name: plain for name in ("Wan2.1-T2V-1.3B", "Wan2.1-T2V-14B", "Wan2.2-T2V-A14B", "krea-realtime-video",
                                "Wan2.1-I2V-14B-480P", "Wan2.1-I2V-14B-720P", "Wan2.2-I2V-A14B")},
    # TI2V-5B's first latent frame is the input image, kept out of the loss: a one-frame clip would train nothing
    **{name: first_last for name in ("Wan2.2-TI2V-5B", "Wan2.1-FLF2V-14B-720P", "Wan2.1-Fun-1.3B-InP",
                                     "Wan2.1-Fun-14B-InP",
                                     "Wan2.1-Fun-V1.1-1.3B-InP", "Wan2.1-Fun-V1.1-14B-InP", "Wan2.2-Fun-A14B-InP")},
    "Wan2.1-T2V-1.3B_direct_distill": distill,
    "Wan2.1-Fun-1.3B-Control": control, "Wan2.1-Fun-14B-Control": control,
    **{name: lambda f: control(f, reference=True) for name in ("Wan2.1-Fun-V1.1-1.3B-Control",
                                                               "Wan2.1-Fun-V1.1-14B-Control",
                                                               "Wan2.2-Fun-A14B-Control")},
    **{name: camera for name in ("Wan2.1-Fun-V1.1-1.3B-Control-Camera", "Wan2.1-Fun-V1.1-14B-Control-Camera",
                                 "Wan2.2-Fun-A14B-Control-Camera")},
    **{name: vace for name in ("Wan2.1-VACE-1.3B", "Wan2.1-VACE-1.3B-Preview", "Wan2.1-VACE-14B",
                               "Wan2.2-VACE-Fun-A14B")},
    "Wan2.1-1.3b-speedcontrol-v1": speed, "Wan2.2-Animate-14B": animate,
    "Wan2.2-Animate-2-14B": animate2, "Wan2.2-Animate-2-14B-Distilled": animate2,
}


def write_wan_script_workspace(root: str | os.PathLike) -> tuple[Path, list[tuple]]:
    """The workspace at `root`; returns it and the tiny models' (spec, label, config) entries."""
    root = Path(root)
    ws = Workspace(root)
    with torch.random.fork_rng():
        for write in REPOSITORIES:
            write(ws)
    for name, write in DATASETS.items():
        (root / DATA / name).mkdir(parents=True, exist_ok=True)
        write(root / DATA / name)
    return root, ws.known


__all__ = ["DATASETS", "REPOSITORIES", "Workspace", "write_rows", "write_wan_script_workspace"]
