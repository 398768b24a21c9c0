"""A tiny workspace where the reference's LTX-2 scripts run with only their script path changed:
`./models/DiffSynth-Studio/LTX-2-Repackage/` and `LTX-2.3-Repackage/` (the seven files each),
`./models/jd-opensource/JoyAI-Echo/JoyAI-Echo-release.safetensors`, `./models/google/gemma-3-12b-it-qat-q4_0-unquantized/`
(Gemma-3 with its tokenizer), and each script's data folder under `./data/diffsynth_example_dataset/ltx2/`: clips of
9 frames at 24 fps with their sound track (a tone per clip), the no-audio set's without one, the IC-LoRA sets'
reference clips (metadata.json with in_context_downsample_factor and frame_rate, as the reference's example)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .tiny import write_tiny_gemma3, write_tiny_joyai_echo, write_tiny_ltx2_repackage

DATA = Path("data") / "diffsynth_example_dataset" / "ltx2"
FRAMES, FPS, SIZE = 9, 24, (64, 64)
GEMMA = Path("google") / "gemma-3-12b-it-qat-q4_0-unquantized"


def write_ltx2_clips(root: Path, n: int = 2, sound: bool = True, shade: int = 0) -> list[str]:
    """`n` clips (clip<i>.mp4, a moving circle) with a stereo tone each as their sound track (or none)."""
    from support.audio import tone, write_clip_with_audio
    from support.video import moving_circle_frames

    root.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(n):
        frames = moving_circle_frames(FRAMES, SIZE, color=(220, 40 + 80 * i + shade, 40), background=(40, 60, 220))
        wave = tone((300.0 * (i + 1), 450.0 * (i + 1)), seconds=FRAMES / FPS, rate=16000) if sound else None
        write_clip_with_audio(root / f"clip{i}.mp4", frames, wave, fps=FPS)
        names.append(f"clip{i}.mp4")
    return names


def write_ltx2_dataset(root: Path, sound: bool = True, in_context: bool = False) -> Path:
    root = Path(root)
    clips = write_ltx2_clips(root, sound=sound)
    prompts = [f"a circle crossing the frame with a tone of {300 * (i + 1)} hertz" for i in range(len(clips))]
    if in_context:
        refs = write_ltx2_clips(root / "reference", sound=False, shade=60)
        rows = [{"video": c, "input_audio": c, "in_context_videos": [f"reference/{r}"],
                 "in_context_downsample_factor": 2, "frame_rate": FPS, "prompt": p}
                for c, r, p in zip(clips, refs, prompts)]
        (root / "metadata.json").write_text(json.dumps(rows, indent=1))
        return root / "metadata.json"
    lines = ["video,input_audio,prompt" if sound else "video,prompt"]
    lines += [f"{c},{c},{p}" if sound else f"{c},{p}" for c, p in zip(clips, prompts)]
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


def write_ltx2_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    models = root / "models"
    write_tiny_ltx2_repackage(models / "DiffSynth-Studio" / "LTX-2-Repackage", "2")
    write_tiny_ltx2_repackage(models / "DiffSynth-Studio" / "LTX-2.3-Repackage", "2.3")
    write_tiny_joyai_echo(models / "jd-opensource" / "JoyAI-Echo")
    write_tiny_gemma3(models / GEMMA)
    for name in ("LTX-2-T2AV-splited", "LTX-2.3-T2AV-splited", "LTX-2.3-I2AV-splited"):
        write_ltx2_dataset(root / DATA / name)
    write_ltx2_dataset(root / DATA / "LTX-2-T2AV-noaudio", sound=False)
    for name in ("LTX-2-T2AV-IC-LoRA-splited", "LTX-2.3-T2AV-IC-LoRA-splited"):
        write_ltx2_dataset(root / DATA / name, in_context=True)
    return root


__all__ = ["write_ltx2_clips", "write_ltx2_dataset", "write_ltx2_script_workspace"]


def _tiny_ltx2(folder):
    from difftune.families.ltx2.components import LORA_TARGET_MODULES
    from support import TinyFamily, TinyVariant

    from .tiny import GEMMA3_SHARDS

    folder = Path(folder)
    # LTX-2.3's: its video decoder pads with zeros (2.0's reflects, which a 1x1 latent of the suite's 32 px renders
    # cannot take)
    files = write_tiny_ltx2_repackage(folder / "LTX-2.3-Repackage", "2.3")
    gemma = write_tiny_gemma3(folder / "gemma")
    paths = [str(files[name]) for name in ("transformer.safetensors", "text_encoder_post_modules.safetensors",
                                           "video_vae_encoder.safetensors", "video_vae_decoder.safetensors",
                                           "audio_vae_encoder.safetensors", "audio_vae_decoder.safetensors",
                                           "audio_vocoder.safetensors")]
    paths.append([str(gemma / shard) for shard in GEMMA3_SHARDS])
    size = ("--height", "32", "--width", "32", "--num_frames", "9")
    return TinyFamily(
        model_paths=paths, lora_base_model="dit", lora_target_modules=LORA_TARGET_MODULES,
        write_dataset=lambda root: write_ltx2_dataset(root),
        flags=("--data_file_keys", "video,input_audio", "--extra_inputs", "input_audio", *size),
        call_args={"height": 32, "width": 32, "num_frames": 9},
        variants={
            "i2av": TinyVariant(flags=("--data_file_keys", "video,input_audio", "--extra_inputs",
                                       "input_audio,input_image", *size)),
            "in_context": TinyVariant(
                flags=("--data_file_keys", "video,input_audio,in_context_videos", "--extra_inputs",
                       "input_audio,in_context_videos,in_context_downsample_factor,frame_rate", *size),
                write_dataset=lambda root: write_ltx2_dataset(root, in_context=True)),
        })


def _register():
    from support import register_tiny

    register_tiny("ltx2", _tiny_ltx2)


_register()
