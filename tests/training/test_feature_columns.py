"""Features follow what reaches the pipeline (issue 36, defects 2 and 7): a column loaded by --data_file_keys alone is
ignored with a note, as the reference's train.py hands only --extra_inputs to its pipeline; an empty cell in a column
that switches a feature on is refused before the first step, naming the row."""

from __future__ import annotations

import pytest

from difftune.core.family import get_family
from difftune.data import DataError, UnifiedDataset
from difftune.training.config import RunConfig
from difftune.training.setup import data_columns, unread_file_columns


def _metadata(tmp_path, rows):
    path = tmp_path / "metadata.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_column_named_only_in_data_file_keys_switches_no_feature_on(tmp_path):
    """Wan2.2-Fun-A14B-Control-Camera's scripts load control_video and reference_image (--data_file_keys) and hand
    the pipeline only input_image and the camera columns (--extra_inputs): Fun-Control and its reference stay off."""
    metadata = _metadata(tmp_path, ["video,prompt,control_video,reference_image,camera_control_direction",
                                    "a.mp4,a dog,c.mp4,r.png,Left"])
    config = RunConfig(dataset_base_path=str(tmp_path), dataset_metadata_path=str(metadata),
                       data_file_keys="video,control_video,reference_image",
                       extra_inputs="input_image,camera_control_direction")
    assert data_columns(config) == {"input_image", "camera_control_direction"}
    pipeline = get_family("wan").pipeline
    assert unread_file_columns(config, pipeline) == ["control_video", "reference_image"]
    from difftune.core.features import RunContext

    features = pipeline.resolve_features(RunContext(columns=data_columns(config)))
    assert "fun_reference" not in features and "fun_control" not in features and "camera" in features


def test_an_empty_trigger_cell_is_refused_up_front(tmp_path):
    """An empty motion_bucket_id cell would turn speed control off for that row while the log says it is on."""
    metadata = _metadata(tmp_path, ["image,prompt,motion_bucket_id", "a.png,a dog,3", "b.png,a cat,"])
    pipeline = get_family("wan").pipeline
    required = pipeline.required_columns(frozenset({"base", "speed_control"}), ["motion_bucket_id"])
    assert required == ("motion_bucket_id",)
    with pytest.raises(DataError, match=r"row 2: 'motion_bucket_id' is empty, but the run trains on it"):
        UnifiedDataset(str(tmp_path), str(metadata), data_file_keys=(), extra_inputs=("motion_bucket_id",),
                       required_columns=required)
    assert pipeline.required_columns(frozenset({"base"}), ["motion_bucket_id"]) == ()


def _vace_rows(tmp_path, header, row):
    from PIL import Image

    from difftune.media.video import write_video

    for name in ("v.mp4", "c.mp4", "m.mp4"):
        write_video([Image.new("RGB", (32, 32), (40 * i % 255, 90, 160)) for i in range(5)], tmp_path / name, fps=16)
    return _metadata(tmp_path, [header, row])


@pytest.mark.parametrize("keys,extra,header,row,mask_used", [
    # named in --extra_inputs: handed to VACE
    ("video,vace_video,vace_video_mask", "vace_video,vace_video_mask", "video,prompt,vace_video,vace_video_mask",
     "v.mp4,a dog,c.mp4,m.mp4", True),
    # named only in --data_file_keys: loaded (as the reference loads it) and ignored, as the note says
    ("video,vace_video,vace_video_mask", "vace_video", "video,prompt,vace_video,vace_video_mask",
     "v.mp4,a dog,c.mp4,m.mp4", False),
    # a metadata column no flag names: ignored too (it reached VACE as text and was refused as 'no clip')
    ("video,vace_video", "vace_video", "video,prompt,vace_video,vace_video_mask", "v.mp4,a dog,c.mp4,m.mp4", False),
])
def test_a_feature_column_reaches_the_pipeline_only_through_extra_inputs(tmp_path, keys, extra, header, row,
                                                                         mask_used):
    """VACE's mask named only in --data_file_keys: the note said 'it is ignored' and the run used it (its LoRA
    equalled the run that names it); now every feature column reaches the pipeline only when --extra_inputs names it,
    as the reference's train.py hands its pipeline --extra_inputs alone, and the note says so truly."""
    import types

    from difftune.training.builders import make_dataset

    metadata = _vace_rows(tmp_path, header, row)
    family = get_family("wan")
    config = RunConfig(dataset_base_path=str(tmp_path), dataset_metadata_path=str(metadata), data_file_keys=keys,
                       extra_inputs=extra, num_frames=5, height=32, width=32, no_progress=True).with_family(family)
    pipeline = family.pipeline
    noted = unread_file_columns(config, pipeline)
    assert ("vace_video_mask" in noted) == (not mask_used and "vace_video_mask" in keys)
    run = types.SimpleNamespace(config=config, family=family, pipeline=pipeline, log=lambda *a: None,
                                features=frozenset({"base", "vace"}))
    sample = make_dataset(run)[0]
    pipe = pipeline()
    pipe.activate({"base", "vace"})
    values = pipe.training_inputs(sample)
    assert values["vace_video"] is not None
    assert (values["vace_video_mask"] is not None) == mask_used
