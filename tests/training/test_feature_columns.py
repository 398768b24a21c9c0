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
