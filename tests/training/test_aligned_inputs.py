"""Time-aligned inputs cover the clip (issue 36, defects 2 and 3): every input a family reads frame by frame with the
training clip (VACE's control clip and mask, Fun-Control's clip, Animate's pose / face / background / mask clips,
S2V's pose clip and audio, Video-As-Prompt's clip) is held to the row's clip by the data set's up-front row check,
before any model loads: one line naming the row (counted from 1), the column, both files and both lengths."""

from __future__ import annotations

import types
import wave as wavfile

import numpy as np
import pytest
from PIL import Image

from difftune.core.family import get_family
from difftune.data import DataError
from difftune.media.video import write_video
from difftune.training.builders import make_dataset
from difftune.training.config import RunConfig


def _clip(path, frames: int, size=(32, 32)):
    write_video([Image.new("RGB", size, (40 * i % 255, 90, 160)) for i in range(frames)], path, fps=16)


def _wav(path, seconds: float, rate: int = 16000):
    samples = (np.sin(np.arange(int(seconds * rate)) / 9) * 8000).astype(np.int16)
    with wavfile.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.tobytes())


def _pipeline(column: str) -> type:
    """The Wan pipeline class (the family's, or a variant's) whose features read `column`."""
    family = get_family("wan")
    return next(p for p in family.pipelines if column in p.aligned_columns())


def _dataset(tmp_path, pipeline: type, header: str, rows: list[str], keys: str, num_frames: int = 5):
    (tmp_path / "metadata.csv").write_text("\n".join([header, *rows]) + "\n")
    config = RunConfig(dataset_base_path=str(tmp_path), dataset_metadata_path=str(tmp_path / "metadata.csv"),
                       data_file_keys=keys, extra_inputs=",".join(k for k in keys.split(",") if k != "video"),
                       num_frames=num_frames, height=32, width=32, no_progress=True).with_family(get_family("wan"))
    run = types.SimpleNamespace(config=config, family=get_family("wan"), pipeline=pipeline, log=lambda *a: None,
                                features=frozenset())
    return make_dataset(run)


@pytest.mark.parametrize("column,frames", [("vace_video", 3), ("vace_video", 2), ("vace_video_mask", 2),
                                           ("control_video", 3), ("animate_pose_video", 2),
                                           ("animate_face_video", 2), ("animate_inpaint_video", 3),
                                           ("s2v_pose_video", 2), ("vap_video", 3)])
def test_a_clip_shorter_than_the_training_clip_is_refused_up_front(tmp_path, column, frames):
    """Row 2's input has `frames` frames where the clip has 5: before, VACE and Fun-Control said 'has 1 frames'
    (the short file cut to 4k+1) after the models loaded, counting rows from 0; S2V padded it with black; Animate
    took a 2-frame face clip and ended in a shape traceback on a 2-frame pose clip."""
    for name in ("v.mp4", "ok.mp4"):
        _clip(tmp_path / name, 9)
    _clip(tmp_path / "short.mp4", frames)
    rows = [f"v.mp4,a dog,ok.mp4", f"v.mp4,a cat,short.mp4"]
    with pytest.raises(DataError) as err:
        _dataset(tmp_path, _pipeline(column), f"video,prompt,{column}", rows, f"video,{column}")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'metadata.csv'} row 2: '{column}' has {frames} frames, the clip 5 "
                              f"('video': {tmp_path / 'v.mp4'})"), message
    assert message.endswith(str(tmp_path / "short.mp4"))


def test_a_still_for_an_aligned_clip_is_one_frame(tmp_path):
    _clip(tmp_path / "v.mp4", 5)
    Image.new("RGB", (32, 32)).save(tmp_path / "pose.png")
    with pytest.raises(DataError, match=r"row 1: 's2v_pose_video' has 1 frame, the clip 5 "):
        _dataset(tmp_path, _pipeline("s2v_pose_video"), "video,prompt,s2v_pose_video", ["v.mp4,a dog,pose.png"],
                 "video,s2v_pose_video")


def test_inputs_that_cover_the_clip_pass_and_a_longer_one_is_cut_to_it(tmp_path):
    """A control clip longer than a short training clip (7 frames, cut to 5) is cut to the clip's 5 frames."""
    _clip(tmp_path / "v.mp4", 7)
    _clip(tmp_path / "c.mp4", 12)
    pipeline = _pipeline("control_video")
    dataset = _dataset(tmp_path, pipeline, "video,prompt,control_video", ["v.mp4,a dog,c.mp4"],
                       "video,control_video", num_frames=9)
    item = dataset[0]
    assert len(item["video"]) == 5 and len(item["control_video"]) == 9
    assert len(pipeline().feature_data(item, 5)["control_video"]) == 5


def test_audio_shorter_than_the_clip_is_refused_up_front(tmp_path):
    """S2V filled audio shorter than the clip with zeros: 5 frames at 16 fps take 4/16 s of audio."""
    _clip(tmp_path / "v.mp4", 9)
    _wav(tmp_path / "long.wav", 1.0)
    _wav(tmp_path / "short.wav", 0.1)
    pipeline = _pipeline("input_audio")
    assert pipeline.aligned_columns()["input_audio"] == 16
    rows = ["v.mp4,a dog,long.wav", "v.mp4,a cat,short.wav"]
    with pytest.raises(DataError) as err:
        _dataset(tmp_path, pipeline, "video,prompt,input_audio", rows, "video,input_audio")
    assert str(err.value) == (f"{tmp_path / 'metadata.csv'} row 2: 'input_audio' lasts 0.100 s, the clip's 5 frames "
                              f"at 16 fps need 0.250 s ('video': {tmp_path / 'v.mp4'}); give one at least as long as "
                              f"the clip: {tmp_path / 'short.wav'}")
    _wav(tmp_path / "short.wav", 0.25)
    assert _dataset(tmp_path, pipeline, "video,prompt,input_audio", rows, "video,input_audio").num_rows == 2


def test_every_time_aligned_input_of_every_wan_variant_is_declared():
    declared = {c for p in get_family("wan").pipelines for c in p.aligned_columns()}
    assert declared >= {"vace_video", "vace_video_mask", "control_video", "animate_pose_video", "animate_face_video",
                        "animate_inpaint_video", "animate_mask_video", "s2v_pose_video", "input_audio", "vap_video"}
