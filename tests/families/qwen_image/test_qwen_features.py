"""Qwen-Image's features own their parts: the base pipeline lists none, each feature's module holds its units, slots,
columns and call inputs; the units run in the family's order (prompt encoders last); Layered has no ControlNet slot."""

from __future__ import annotations

import pytest
from PIL import Image

from difftune.families.qwen_image import QwenImageLayeredPipeline, QwenImagePipeline
from difftune.families.qwen_image.pipeline import QwenImageBasePipeline


def test_the_base_pipeline_lists_no_feature_and_the_features_add_theirs():
    assert QwenImageBasePipeline.features == ()
    assert QwenImageBasePipeline.model_names == ("dit", "text_encoder", "vae")
    assert QwenImagePipeline.model_names == ("dit", "text_encoder", "vae", "blockwise_controlnet")
    assert QwenImagePipeline.loss_models == ("dit", "blockwise_controlnet")
    assert QwenImageLayeredPipeline.model_names == ("dit", "text_encoder", "vae")  # no ControlNet slot
    assert QwenImageLayeredPipeline.loss_models == ("dit",)
    assert [u.name for u in QwenImageBasePipeline().all_units] == [
        "QwenImageShapeChecker", "QwenImageNoiseInitializer", "QwenImageInputImageEmbedder", "QwenImagePromptEmbedder"]


def test_units_keep_the_family_order():
    """Every image is encoded before the prompt (the edit prompt sees the resized edit images)."""
    assert [u.name for u in QwenImagePipeline().all_units] == [
        "QwenImageShapeChecker", "QwenImageNoiseInitializer", "QwenImageInputImageEmbedder",
        "QwenImageEditImageEmbedder", "QwenImageContextImageEmbedder", "QwenImageBlockwiseControlNetEmbedder",
        "QwenImageEntityControl", "QwenImagePromptEmbedder", "QwenImageEditPromptEmbedder"]
    assert [u.name for u in QwenImageLayeredPipeline().all_units] == [
        "QwenImageShapeChecker", "QwenImageLayeredNoiseInitializer", "QwenImageInputImageEmbedder",
        "QwenImageLayerStackEmbedder", "QwenImageEditImageEmbedder", "QwenImageLayerInputEmbedder",
        "QwenImageLayeredContextImageEmbedder", "QwenImagePromptEmbedder", "QwenImageEditPromptEmbedder"]


def test_call_inputs_come_from_the_features():
    pipe = QwenImagePipeline()
    assert set(pipe.call_inputs()) == {
        "edit_image", "edit_image_auto_resize", "context_image", "blockwise_controlnet_image",
        "blockwise_controlnet_inpaint_mask", "blockwise_controlnet_inputs", "eligen_entity_prompts",
        "eligen_entity_masks", "eligen_enable_on_negative"}
    assert set(QwenImageLayeredPipeline.call_inputs()) == {"edit_image", "edit_image_auto_resize", "context_image"}
    mask = Image.new("RGB", (16, 16))
    values = pipe.prompt_values(["a", "b"], ["n1", "n2"])
    out = pipe.feature_values({"context_image": mask, "eligen_entity_prompts": ["x"], "eligen_entity_masks": [mask],
                               "eligen_enable_on_negative": True}, values)
    assert out["context_image"] == [mask, mask]  # one copy per prompt
    assert out["negative_eligen_entity_prompts"] == [["n1"], ["n2"]]
    assert out["edit_image_auto_resize"] is True and out["edit_image"] is None
    with pytest.raises(TypeError, match=r"unexpected input\(s\) \['contxt_image'\]"):
        pipe.feature_values({"contxt_image": mask}, values)
    with pytest.raises(TypeError, match="unexpected input"):
        QwenImageLayeredPipeline().feature_values({"eligen_entity_prompts": ["x"]}, values)
