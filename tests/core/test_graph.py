"""The stage-1/stage-2 split computed from unit declarations."""

from difftune.core.units import PipelineUnit
from difftune.core.graph import split_units
from difftune.families.qwen_image import QwenImagePipeline

from difftune.families.qwen_image import QwenImageLayeredPipeline  # noqa: E402

ENTITY = ("entity_masks", "entity_masks_mask", "entity_prompt_embeds", "entity_prompt_embeds_mask", "entity_token_ids")


def U(name, reads=(), writes=(), models=()):
    return type(name, (PipelineUnit,), {"inputs": tuple(reads), "outputs": tuple(writes), "models": tuple(models)})()


def qwen_split(trainable, features=None, cls=QwenImagePipeline):
    """The split of `cls`'s units for the sft loss with `features` active (None: every feature of the class)."""
    pipe = cls()
    pipe.activate(pipe.feature_names() if features is None else features)
    reads = ("input_latents",) + pipe.active_model_fn_inputs
    return split_units(pipe.units, trainable, reads, settings=pipe.settings, loss_models=("dit",))


def names(units):
    return [u.name for u in units]


def test_a_text_to_image_run_has_only_its_own_units_and_values():
    s = qwen_split(["dit"], features=())
    assert names(s.stage1) == ["QwenImageShapeChecker", "QwenImageNoiseInitializer", "QwenImageInputImageEmbedder",
                               "QwenImagePromptEmbedder"]
    assert s.frontier == ("input_latents", "prompt_embeds", "prompt_embeds_mask")


def test_lora_on_dit_puts_every_unit_in_stage_1():
    s = qwen_split(["dit"])
    assert names(s.stage2) == []
    assert len(s.stage1) == 8  # the edit prompt unit stands in for the plain one
    # only what the loss reads is cached; noise, latents, images, settings are not
    assert s.frontier == ("blockwise_controlnet_conditioning", "context_latents", "edit_latents", *ENTITY,
                          "input_latents", "prompt_embeds", "prompt_embeds_mask")
    assert s.stage1_models == ("text_encoder", "vae") and s.stage2_models == ("dit",)
    assert qwen_split(["dit"], features=["edit"]).frontier == ("edit_latents", "input_latents", "prompt_embeds",
                                                                "prompt_embeds_mask")


def test_lora_on_text_encoder_moves_prompt_encoding_and_caches_the_prompt():
    s = qwen_split(["dit", "text_encoder"])
    assert names(s.stage2) == ["QwenImageEntityControl", "QwenImageEditPromptEmbedder"]
    # the prompt string (data) and the resized edit image (stage-1 output) are cached instead of embeddings;
    # EliGen's entity prompts and masks too, with the size their masks are taken at
    assert s.frontier == ("blockwise_controlnet_conditioning", "context_latents", "edit_image", "edit_latents",
                          "eligen_entity_masks", "eligen_entity_prompts", "height", "input_latents", "prompt", "width")
    assert s.stage2_models == ("dit", "text_encoder")
    assert s.stage1_models == ("vae",)
    # without EliGen data, a text-encoder LoRA moves the prompt unit alone
    assert names(qwen_split(["dit", "text_encoder"], features=["edit"]).stage2) == ["QwenImageEditPromptEmbedder"]


def test_trainable_vae_moves_encoders_and_their_readers():
    s = qwen_split(["vae"])
    # the prompt embedder reads edit_image, which the (now stage-2) edit embedder writes
    assert names(s.stage2) == ["QwenImageInputImageEmbedder", "QwenImageEditImageEmbedder",
                               "QwenImageContextImageEmbedder", "QwenImageBlockwiseControlNetEmbedder",
                               "QwenImageEditPromptEmbedder"]
    assert "input_image" in s.frontier and "noise" in s.frontier and "prompt" in s.frontier
    assert "rand_device" not in s.frontier and "edit_image_auto_resize" not in s.frontier
    layered = qwen_split(["vae"], cls=QwenImageLayeredPipeline)
    assert names(layered.stage2) == ["QwenImageInputImageEmbedder", "QwenImageLayerStackEmbedder",
                                     "QwenImageEditImageEmbedder", "QwenImageLayerInputEmbedder",
                                     "QwenImageLayeredContextImageEmbedder", "QwenImageEditPromptEmbedder"]
    assert {"layer_images", "layer_input_image", "noise"} <= set(layered.frontier)


def test_write_after_read_forces_stage_2():
    units = [U("A", reads=["x"], writes=["y"], models=["m"]), U("B", reads=["z"], writes=["x"])]
    s = split_units(units, ["m"], loss_reads=["y"])
    # B overwrites x, which stage-2 A reads first: running B in stage 1 would hand A the wrong x
    assert names(s.stage2) == ["A", "B"]
    assert s.frontier == ("x", "z")


def test_write_after_write_forces_stage_2():
    units = [U("A", writes=["x"], models=["m"]), U("B", writes=["x"])]
    s = split_units(units, ["m"], loss_reads=["x"])
    assert names(s.stage2) == ["A", "B"]


def test_independent_later_unit_stays_in_stage_1():
    units = [U("A", reads=["p"], writes=["e"], models=["m"]), U("B", reads=["img"], writes=["lat"])]
    s = split_units(units, ["m"], loss_reads=["e", "lat"])
    assert names(s.stage1) == ["B"] and names(s.stage2) == ["A"]
    assert s.frontier == ("lat", "p")


def test_transitive_readers_iterate_to_fixed_point():
    units = [U("A", reads=["i"], writes=["a"], models=["m"]), U("B", reads=["a"], writes=["b"]),
             U("C", reads=["b"], writes=["c"]), U("D", reads=["i"], writes=["d"])]
    s = split_units(units, ["m"], loss_reads=["c", "d"])
    assert names(s.stage2) == ["A", "B", "C"] and names(s.stage1) == ["D"]
    assert s.frontier == ("d", "i")


def test_settings_are_never_cached():
    units = [U("A", reads=["x", "use_ckpt"], writes=["y"], models=["m"])]
    s = split_units(units, ["m"], loss_reads=["y", "use_ckpt"], settings=["use_ckpt"])
    assert s.frontier == ("x",)
