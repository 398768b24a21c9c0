"""Z-Image's features own their parts: the edit and ControlNet modules hold their units, slots, columns, checks and
call inputs; the pipeline lists the features and keeps the family's unit order."""

from __future__ import annotations

import pytest
from PIL import Image

from difftune.core.features import RunContext
from difftune.errors import UserError
from difftune.families.z_image import ZImagePipeline


def test_slots_units_and_call_inputs_come_from_the_features():
    assert ZImagePipeline.model_names == ("dit", "text_encoder", "vae", "image_encoder", "controlnet")
    assert ZImagePipeline.loss_models == ("dit", "controlnet")
    assert [u.name for u in ZImagePipeline().all_units] == [
        "ZImageShapeChecker", "ZImageNoiseInitializer", "ZImageInputImageEmbedder", "ZImagePromptEmbedder",
        "ZImageEditPromptEmbedder", "ZImageEditTextEmbedder", "ZImageEditImageEmbedder", "ZImageSiglipEmbedder",
        "ZImageControlEmbedder"]
    assert set(ZImagePipeline.call_inputs()) == {"edit_image", "controlnet_image", "controlnet_inpaint_mask",
                                                 "controlnet_inpaint_image", "controlnet_scale", "control_compat"}


def test_rows_read_the_run_features_columns_only():
    pipe = ZImagePipeline()
    image = Image.new("RGB", (32, 32))
    row = {"_row": 4, "image": image, "prompt": "p", "edit_image": image, "controlnet_image": "c.png"}
    pipe.activate({"edit"})
    values = pipe.training_inputs(row)
    assert values["edit_image"] == [image] and values["controlnet_image"] is None  # not the run's: left alone
    pipe.activate({"controlnet"})
    with pytest.raises(UserError, match=r"^row 5: 'controlnet_image' must be an image file"):
        pipe.training_inputs(row)


def test_the_features_checks():
    omni = {"dit": {"siglip_feat_dim": 8}}
    with pytest.raises(UserError, match="edit images need its SigLIP2 image encoder"):
        ZImagePipeline.check_features(RunContext(columns=frozenset({"edit_image"}), models=omni),
                                      frozenset({"base", "edit", "omni"}))
    with pytest.raises(UserError, match="not Omni-Base's"):
        ZImagePipeline.check_features(RunContext(columns=frozenset({"controlnet_image"}),
                                                 models={**omni, "controlnet": {}}),
                                      frozenset({"base", "controlnet", "omni"}))
    with pytest.raises(UserError, match="control_compat must be 'reference' or 'diffusers'"):
        ZImagePipeline()("a cat", control_compat="other")
