"""Tiny data sets of the Wan variants with inputs of their own, in the layouts of the reference's example data sets
(`data/diffsynth_example_dataset/wanvideo/<model>/`): S2V (a clip, its speech, a pose clip), Wan-Dancer (a clip, its
music, a reference image, keyframes and their mask, the frame rate; the global model's rows framewise),
Video-As-Prompt (a clip and the reference clip) and VACE (a clip, the control clip, a reference image). Every file
is written here: mp4 clips, wav audio, png stills."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from PIL import Image

from ..audio import tone, write_audio
from ..video import write_tiny_clip

_COLORS = [("red", (220, 40, 40)), ("blue", (40, 60, 220)), ("green", (40, 180, 60)), ("yellow", (230, 210, 40))]


def _clip(root: Path, name: str, frames: int, size, i: int, shift: int = 0) -> str:
    rgb, back = _COLORS[(i + shift) % 4][1], _COLORS[(i + shift + 1) % 4][1]
    write_tiny_clip(root / name, frames, size, rgb, back)
    return name


def _csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_s2v_dataset(root: str | os.PathLike, n: int = 2, num_frames: int = 5, size=(64, 32)) -> Path:
    """video_<i>.mp4, speech_<i>.wav (a tone per row, 0.5 s at 22.05 kHz: resampled to 16 kHz when read),
    pose_<i>.mp4 and metadata.csv (video, prompt, input_audio, s2v_pose_video)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        write_audio(root / f"speech_{i + 1}.wav", tone((220.0 * (i + 1), 330.0), seconds=0.5, rate=22050), 22050)
        rows.append({"video": _clip(root, f"video_{i + 1}.mp4", num_frames, size, i),
                     "prompt": f"a {_COLORS[i % 4][0]} ball talking", "input_audio": f"speech_{i + 1}.wav",
                     "s2v_pose_video": _clip(root, f"pose_{i + 1}.mp4", num_frames, size, i, shift=2)})
    return _csv(root / "metadata.csv", rows)


def write_dancer_dataset(root: str | os.PathLike, n: int = 2, num_frames: int = 5, size=(64, 32),
                         framewise: bool = False) -> Path:
    """metadata.json as the Wan-Dancer scripts read it: video, prompt, wantodance_music_path (wav),
    wantodance_reference_image (png), wantodance_fps (30, the local model's; 7.5 with `framewise`, the global's
    keyframe clips), wantodance_keyframes (the reference image, then black: as many frames as the clip stands for),
    wantodance_keyframes_mask, and with `framewise` framewise_decoding."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stands_for = 4 * (num_frames - 1) + 1 if framewise else num_frames
    rows = []
    for i in range(n):
        write_audio(root / f"music_{i + 1}.wav", tone((262.0 * (i + 1), 392.0), seconds=1.0, rate=22050), 22050)
        reference = Image.new("RGB", size, _COLORS[(i + 2) % 4][1])
        reference.save(root / f"refimage_{i + 1}.png")
        keyframes = [reference] + [Image.new("RGB", size, (0, 0, 0))] * (stands_for - 1)
        _write_frames(root / f"keyframes_{i + 1}.mp4", keyframes)
        row = {"video": _clip(root, f"video_{i + 1}.mp4", num_frames, size, i),
               "prompt": f"a {_COLORS[i % 4][0]} ball dancing", "wantodance_music_path": f"music_{i + 1}.wav",
               "wantodance_reference_image": f"refimage_{i + 1}.png", "wantodance_fps": 7.5 if framewise else 30,
               "wantodance_keyframes": f"keyframes_{i + 1}.mp4",
               "wantodance_keyframes_mask": [1] + [0] * (stands_for - 1)}
        if framewise:
            row["framewise_decoding"] = True
        rows.append(row)
    path = root / "metadata.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


def _write_frames(path: Path, frames: list[Image.Image], fps: int = 16) -> Path:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "10"}
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_image(img.convert("RGB"))):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def write_vap_dataset(root: str | os.PathLike, n: int = 2, num_frames: int = 5, size=(64, 32)) -> Path:
    """video_<i>.mp4, reference_<i>.mp4 (the clip whose motion is the prompt) and metadata.csv (video, vap_video,
    prompt)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"video": _clip(root, f"video_{i + 1}.mp4", num_frames, size, i),
             "vap_video": _clip(root, f"reference_{i + 1}.mp4", num_frames, size, i, shift=1),
             "prompt": f"a {_COLORS[i % 4][0]} ball moving like the reference"} for i in range(n)]
    return _csv(root / "metadata.csv", rows)


def write_vace_dataset(root: str | os.PathLike, n: int = 2, num_frames: int = 5, size=(64, 32)) -> Path:
    """video_<i>.mp4, vace_video_<i>.mp4 (the control clip, as long), vace_reference_<i>.png and metadata.csv (video,
    prompt, vace_video, vace_reference_image), the columns of the reference's Wan2.1-VACE-1.3B example data."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        Image.new("RGB", size, _COLORS[(i + 2) % 4][1]).save(root / f"vace_reference_{i + 1}.png")
        rows.append({"video": _clip(root, f"video_{i + 1}.mp4", num_frames, size, i),
                     "prompt": f"a {_COLORS[i % 4][0]} ball following the control video",
                     "vace_video": _clip(root, f"vace_video_{i + 1}.mp4", num_frames, size, i, shift=1),
                     "vace_reference_image": f"vace_reference_{i + 1}.png"})
    return _csv(root / "metadata.csv", rows)


__all__ = ["write_dancer_dataset", "write_s2v_dataset", "write_vace_dataset", "write_vap_dataset"]
