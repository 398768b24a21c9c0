"""`difftune sample`'s flags come from where the inputs are taken: a feature's `flags`, a pipeline's `sample_flags`
and a tokenizer's flag (no family restates them in its options); `sample_values` maps them to the call's inputs."""

from __future__ import annotations

from dataclasses import fields

import pytest
from PIL import Image

from difftune.cli.sample import call_inputs_of, family_inputs, sample_parser
from difftune.core.family import FamilySpec, get_family, text_tokenizer
from difftune.core.features import Feature
from difftune.core.options import flag_fields, sample_input
from difftune.core.pipeline import BasePipeline
from difftune.errors import UserError


def _flags(family, argv):
    """The family's options and its flags' values (image flags read) from `difftune sample`'s `argv`."""
    args = sample_parser().parse_args(["--prompt", "p", *argv])
    return family_inputs(args, family)


def _image(path, color):
    Image.new("RGB", (8, 8), color).save(path)
    return str(path)


def test_every_sampling_flag_is_declared_by_a_feature_or_a_pipeline_not_the_family_options():
    for name in ("flux", "qwen_image", "z_image", "flux2", "krea2", "wan"):
        family = get_family(name)
        own = {f.name for f in fields(family.options)}
        declared = {n for cls in family.pipelines for n in cls.all_sample_flags()}
        sample_only = {f.name for f in flag_fields(family.sample_options) if not f.metadata["flag"]["train"]}
        assert sample_only == declared - own, name
        assert all(f.metadata["flag"]["train"] for f in flag_fields(family.options)), name
    assert "kontext_images" in {f.name for f in flag_fields(get_family("flux").sample_options)}
    assert "kontext_images" not in {f.name for f in fields(get_family("flux").options)}


def test_qwen_image_edit_one_image_is_edit_two_are_edit_plus(tmp_path):
    family = get_family("qwen_image")
    a, b = _image(tmp_path / "a.png", "red"), _image(tmp_path / "b.png", "blue")
    _, flags = _flags(family, ["--edit_image", a])
    one = call_inputs_of(family.pipeline, family, flags)["edit_image"]
    assert isinstance(one, Image.Image) and one.getpixel((0, 0)) == (255, 0, 0)
    _, flags = _flags(family, ["--edit_image", a, "--edit_image", b])
    assert [i.getpixel((0, 0)) for i in call_inputs_of(family.pipeline, family, flags)["edit_image"]] == \
        [(255, 0, 0), (0, 0, 255)]
    _, flags = _flags(family, ["--edit_image", a, "--edit_plus"])
    assert isinstance(call_inputs_of(family.pipeline, family, flags)["edit_image"], list)
    _, flags = _flags(family, ["--edit_plus"])
    with pytest.raises(UserError, match="--edit_plus: it needs --edit_image"):
        call_inputs_of(family.pipeline, family, flags)


def test_a_flag_of_another_pipeline_class_is_refused_and_a_renamed_input_arrives_by_its_name(tmp_path):
    qwen = get_family("qwen_image")
    _, flags = _flags(qwen, ["--layer_num", "2"])
    with pytest.raises(UserError, match="--layer_num: QwenImagePipeline does not take it"):
        call_inputs_of(qwen.pipeline, qwen, flags)
    layered = qwen.variants[0]
    assert call_inputs_of(layered, qwen, flags) == {"layer_num": 2}
    krea2 = get_family("krea2")
    _, flags = _flags(krea2, ["--shift_mu", "1.15"])
    assert call_inputs_of(krea2.pipeline, krea2, flags) == {"mu": 1.15}


def test_a_new_features_flags_and_a_tokenizers_flag_need_no_family_option(tmp_path):
    class Hinted(Feature):
        def sample_values(self, flags):
            values = super().sample_values(flags)
            if "hint" in values:
                values["hint"] = values["hint"].convert("L")
            return values

    hint = Hinted("hint", columns=("hint",), call_inputs={"hint": None},
                  flags={"hint": sample_input("A hint image.", load="RGB"),
                         "hint_scale": sample_input("Its strength.", kind=float)})

    class Pipe(BasePipeline):
        model_names = ("dit",)
        features = (hint,)

    spec = FamilySpec(name="hinted_toy", pipeline=Pipe, components=(),
                      tokenizers=(text_tokenizer("tokenizer_path", "org/repo:tokenizer/"),))
    (tokenizer,) = [f for f in fields(spec.options) if f.name == "tokenizer_path"]
    assert tokenizer.metadata["flag"]["help"] == ("Tokenizer directory or model_id:folder/ (default: tokenizer/ beside "
                                                  "the text encoder, else org/repo:tokenizer/).")
    assert {f.name for f in flag_fields(spec.sample_options)} == {"tokenizer_path", "hint", "hint_scale"}
    path = _image(tmp_path / "h.png", "white")
    options = spec.sample_options(tokenizer_path="tok", hint=path, hint_scale=0.5)
    assert options.tokenizer_path == "tok" and isinstance(options, spec.options)
    flags = {"_given": {"hint", "hint_scale"}, "tokenizer_path": "tok", "hint": Image.open(path), "hint_scale": 0.5}
    call = call_inputs_of(Pipe, spec, flags)
    assert call["hint"].mode == "L" and call["hint_scale"] == 0.5
