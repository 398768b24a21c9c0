"""Model loading: ModelConfig resolution (local, hub base path, HF cache), recognition, loading, FP8."""

import fnmatch
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.errors import UserError
from difftune.families.qwen_image import components as qi
from difftune.families.qwen_image import FAMILY as _QWEN_FAMILY
from difftune.parts.qwen_vl import load_processor, qwen25_vl_key
from difftune import detect_component, load_component
from difftune.models import (ModelConfig, check_fp8_frozen, enable_fp8_storage, load_tokenizer, match_header,
                             parse_model_configs)
from support import populate_offline_hub, tiny_qwen_image_paths, write_tiny_qwen_image

ENV = ["DIFFTUNE_MODEL_BASE_PATH", "DIFFSYNTH_MODEL_BASE_PATH", "DIFFTUNE_SKIP_DOWNLOAD", "DIFFSYNTH_SKIP_DOWNLOAD",
       "DIFFTUNE_DOWNLOAD_SOURCE", "DIFFSYNTH_DOWNLOAD_SOURCE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"]
DIT_PATTERN = "transformer/diffusion_pytorch_model*.safetensors"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_qwen_image(tmp_path_factory.mktemp("qwen"), edit=True)


@pytest.fixture(scope="module")
def paths(repo):
    return tiny_qwen_image_paths(repo)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # never the user's real cache
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)


@pytest.fixture
def tiny_known(monkeypatch, repo):
    """Register the tiny configs as 'known', as the official ones are, so bare tiny files are recognised."""
    for spec, folder in ((qi.DIT, "transformer"), (qi.TEXT_ENCODER, "text_encoder"), (qi.VAE, "vae")):
        monkeypatch.setitem(spec.known_configs, "tiny", json.loads((repo / folder / "config.json").read_text()))


@pytest.fixture
def no_network(monkeypatch):
    import huggingface_hub

    calls = []

    def refuse(*args, **kwargs):
        calls.append(kwargs)
        raise AssertionError("network access attempted")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    return calls


QWEN = _QWEN_FAMILY.components  # recognition is scoped to a family


def saved(files):
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def assert_same_weights(module, files, key=lambda k: k):
    state = module.state_dict()
    expected = saved(files)
    assert len(expected) > 0 and {key(k) for k in expected} == set(state)
    for k, v in expected.items():
        assert torch.equal(state[key(k)], v), k


def user_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def bare_copy(files, dest: Path, rename=None) -> list[str]:
    """The files (and shard index) in a folder with no config.json."""
    dest.mkdir(parents=True, exist_ok=True)
    for index in Path(files[0]).parent.glob("*.index.json"):
        shutil.copy(index, dest / index.name)
    return [str(shutil.copy(f, dest / Path(f).name)) for f in files]


# -- local files ------------------------------------------------------------------------------------------

def test_load_shard_lists_and_single_file_equal_saved_weights(paths):
    dit = load_component(ModelConfig(paths["transformer"]), torch_dtype=torch.float32)
    assert dit.name == "dit" and len(paths["transformer"]) > 1 and dit.files == paths["transformer"]
    assert_same_weights(dit.module, paths["transformer"])
    assert not dit.module.training and not any(p.requires_grad for p in dit.module.parameters())

    te = load_component(ModelConfig(paths["text_encoder"]), torch_dtype=torch.float32)
    assert te.name == "text_encoder" and type(te.module).__name__ == "Qwen2_5_VLForConditionalGeneration"
    # The files use the official layout (model.layers.*, visual.*); the module is transformers 5's.
    assert any(k.startswith("visual.") for k in saved(paths["text_encoder"]))
    assert_same_weights(te.module, paths["text_encoder"], qwen25_vl_key)

    vae = load_component(paths["vae"][0], torch_dtype=torch.bfloat16)
    assert vae.name == "vae"
    assert all(p.dtype == torch.bfloat16 for p in vae.module.parameters())
    expected = saved(paths["vae"])
    assert all(torch.equal(vae.module.state_dict()[k], v.to(torch.bfloat16)) for k, v in expected.items())


def test_loading_equals_diffusers_and_transformers_from_pretrained(repo, paths):
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    ours = load_component(paths["transformer"], torch_dtype=torch.bfloat16).module
    ref = QwenImageTransformer2DModel.from_pretrained(str(repo / "transformer"), dtype=torch.bfloat16)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours.state_dict().values(),
                                                                         ref.state_dict().values()))
    te = load_component(paths["text_encoder"], torch_dtype=torch.float32).module
    te_ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(repo / "text_encoder"), dtype=torch.float32)
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = te(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        b = te_ref(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(a, b)


def test_directory_with_config_json(repo, paths):
    det = detect_component(ModelConfig(str(repo / "transformer")))
    assert det.name == "dit" and det.source.endswith(os.path.join("transformer", "config.json"))
    assert det.files == paths["transformer"]
    vae = load_component(str(repo / "vae"), torch_dtype=torch.float32)
    assert_same_weights(vae.module, paths["vae"])


def test_bare_files_without_a_known_config_are_refused(paths, tmp_path):
    files = bare_copy(paths["transformer"], tmp_path / "bare")
    msg = user_error(detect_component, files)
    assert files[0] in msg and "unknown architecture" in msg
    assert "looks like a QwenImageTransformer2DModel" in msg and "config.json" in msg


def test_bare_files_recognised_from_headers(tiny_known, paths, tmp_path):
    for name, folder in (("dit", "transformer"), ("text_encoder", "text_encoder"), ("vae", "vae")):
        files = bare_copy(paths[folder], tmp_path / folder)
        loaded = load_component(ModelConfig(files), torch_dtype=torch.float32)
        assert loaded.name == name and loaded.source == "weights match tiny"
        assert_same_weights(loaded.module, files, qwen25_vl_key if name == "text_encoder" else str)


def test_text_encoder_in_transformers5_layout_and_comfyui_transformer(tiny_known, paths, tmp_path):
    te = saved(paths["text_encoder"])
    v5 = {qwen25_vl_key(k): v for k, v in te.items()}
    assert any(k.startswith("model.language_model.") for k in v5) and not any(k.startswith("visual.") for k in v5)
    save_file(v5, tmp_path / "te_v5.safetensors")
    loaded = load_component(str(tmp_path / "te_v5.safetensors"), torch_dtype=torch.float32)
    assert loaded.name == "text_encoder"
    assert_same_weights(loaded.module, [str(tmp_path / "te_v5.safetensors")])

    dit = saved(paths["transformer"])
    save_file({f"model.diffusion_model.{k}": v for k, v in dit.items()}, tmp_path / "qwen_image_comfy.safetensors")
    loaded = load_component(str(tmp_path / "qwen_image_comfy.safetensors"), torch_dtype=torch.float32)
    assert loaded.name == "dit"
    assert_same_weights(loaded.module, paths["transformer"])


def _meta_state_shapes(module) -> dict:
    return {k: list(v.shape) for k, v in module.state_dict().items()}


def test_official_qwen_image_headers_are_recognised():
    """Synthetic headers with the official names and shapes (built on the meta device from the published sizes)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with init_empty_weights():
        dit = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                                          attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                          axes_dims_rope=(16, 56, 56))
        vae = AutoencoderKLQwenImage(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     temperal_downsample=[False, True, True])
        te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                               out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])))
    header = {k: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for k, s in _meta_state_shapes(dit).items()}
    assert len(header) == 1933 and header["txt_in.weight"]["shape"] == [3072, 3584]
    match = match_header(header, QWEN)
    assert match.spec.name == "dit" and match.config["num_layers"] == 60
    assert match_header({f"model.diffusion_model.{k}": v for k, v in header.items()}, QWEN).spec.name == "dit"
    changed = dict(header, **{"img_in.weight": {"dtype": "BF16", "shape": [3072, 128], "data_offsets": [0, 0]}})
    assert match_header(changed, QWEN) is None
    assert match_header({k: v for k, v in header.items() if not k.startswith("transformer_blocks.59.")}, QWEN) is None

    assert match_header(_meta_state_shapes(vae), QWEN).spec.name == "vae"
    te_shapes = _meta_state_shapes(te)
    assert match_header(te_shapes, QWEN).spec.name == "text_encoder"
    official = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): s
                for k, s in te_shapes.items()}  # the layout of the files in Qwen/Qwen-Image/text_encoder
    assert "model.layers.27.mlp.down_proj.weight" in official and "visual.merger.mlp.2.weight" in official
    assert match_header(official, QWEN).config["hidden_size"] == 3584


# -- hub ids ----------------------------------------------------------------------------------------------

def test_hub_id_from_model_base_path_with_skip_download(repo, tmp_path, monkeypatch, no_network):
    base = tmp_path / "models"
    populate_offline_hub(base, "Org/Tiny", repo)
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(base))
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    config = ModelConfig(model_id="Org/Tiny", origin_file_pattern=DIT_PATTERN)
    loaded = load_component(config, torch_dtype=torch.float32)
    assert loaded.name == "dit" and all(f.startswith(str(base / "Org" / "Tiny" / "transformer")) for f in loaded.files)
    assert_same_weights(loaded.module, loaded.files)
    tok = load_tokenizer(ModelConfig(model_id="Org/Tiny", origin_file_pattern="tokenizer/"))
    assert tok.decode(tok("a cat")["input_ids"]) == "a cat"
    assert no_network == []


def test_complete_local_files_need_no_network_even_without_skip(repo, tmp_path, monkeypatch, no_network):
    base = tmp_path / "models"
    populate_offline_hub(base, "Org/Tiny", repo)
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(base))
    files = ModelConfig(model_id="Org/Tiny", origin_file_pattern="text_encoder/model*.safetensors").resolve()
    assert len(files) == 3 and no_network == []


def test_missing_shard_is_the_only_thing_downloaded(repo, tmp_path, monkeypatch):
    import huggingface_hub

    base = tmp_path / "models"
    local = populate_offline_hub(base, "Org/Tiny", repo)
    gone = sorted((local / "transformer").glob("*-00002-of-*.safetensors"))[0]
    gone.unlink()
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, local_dir=None, **kwargs):
        calls.append(dict(repo_id=repo_id, allow_patterns=allow_patterns, **kwargs))
        for f in repo.rglob("*"):
            rel = f.relative_to(repo).as_posix()
            if f.is_file() and any(fnmatch.fnmatchcase(rel, p) for p in allow_patterns):
                (Path(local_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, Path(local_dir) / rel)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(base))
    files = ModelConfig(model_id="Org/Tiny", origin_file_pattern=DIT_PATTERN).resolve()
    assert len(calls) == 1 and calls[0]["repo_id"] == "Org/Tiny"
    assert f"transformer/{gone.name}" in calls[0]["allow_patterns"] and DIT_PATTERN not in calls[0]["allow_patterns"]
    assert str(gone) in files and gone.is_file()


def test_missing_shard_with_downloads_off_names_it(repo, tmp_path, monkeypatch, no_network):
    base = tmp_path / "models"
    local = populate_offline_hub(base, "Org/Tiny", repo)
    (local / "transformer" / "diffusion_pytorch_model.safetensors.index.json").unlink()  # naming alone tells
    gone = sorted((local / "transformer").glob("*-00003-of-*.safetensors"))[0]
    gone.unlink()
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(base))
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "1")
    msg = user_error(ModelConfig(model_id="Org/Tiny", origin_file_pattern=DIT_PATTERN).resolve)
    assert str(gone) in msg and "DIFFTUNE_SKIP_DOWNLOAD" in msg


def test_hub_id_from_offline_hf_cache(repo, tmp_path, monkeypatch):
    import huggingface_hub

    real = huggingface_hub.snapshot_download
    calls = []

    def local_only(*args, **kwargs):
        calls.append(kwargs)
        assert kwargs.get("local_files_only") is True
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", local_only)
    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hf_home" / "hub" / "models--Org--Tiny"
    shutil.copytree(repo, cache / "snapshots" / commit)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "empty"))
    loaded = load_component(ModelConfig(model_id="Org/Tiny", origin_file_pattern="vae/*.safetensors"), torch.float32)
    assert loaded.name == "vae" and loaded.files[0].startswith(str(cache / "snapshots" / commit))
    assert_same_weights(loaded.module, loaded.files)
    assert calls and not (tmp_path / "empty").exists()
    msg = user_error(ModelConfig(model_id="Org/Other", origin_file_pattern="vae/*.safetensors").resolve)
    assert "Org/Other:vae/*.safetensors" in msg and "HF_HUB_OFFLINE" in msg


def test_reference_env_aliases_and_precedence(repo, tmp_path, monkeypatch, no_network):
    from difftune.models.download import download_source

    base = tmp_path / "models"
    populate_offline_hub(base, "Org/Tiny", repo)
    monkeypatch.setenv("DIFFSYNTH_MODEL_BASE_PATH", str(base))
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    files = ModelConfig(model_id="Org/Tiny", origin_file_pattern="vae/*.safetensors").resolve()
    assert files == [str(base / "Org" / "Tiny" / "vae" / "diffusion_pytorch_model.safetensors")]
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "elsewhere"))  # ours win over DIFFSYNTH_*
    msg = user_error(ModelConfig(model_id="Org/Tiny", origin_file_pattern="vae/*.safetensors").resolve)
    assert str(tmp_path / "elsewhere") in msg
    # An explicit local_model_path beats both environment variables.
    explicit = ModelConfig(model_id="Org/Tiny", origin_file_pattern="vae/*.safetensors", local_model_path=str(base))
    assert explicit.resolve() == files
    monkeypatch.setenv("DIFFSYNTH_DOWNLOAD_SOURCE", "modelscope")
    assert download_source() == "modelscope"
    monkeypatch.setenv("DIFFTUNE_DOWNLOAD_SOURCE", "huggingface")
    assert download_source() == "huggingface"
    assert no_network == []


def test_modelscope_source_without_the_package(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("modelscope") is not None:
        pytest.skip("modelscope is installed")
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "models"))
    config = ModelConfig(model_id="Org/Tiny", origin_file_pattern="vae/*.safetensors", download_source="modelscope")
    msg = user_error(config.resolve)
    assert "pip install modelscope" in msg and "Org/Tiny:vae/*.safetensors" in msg


# -- flags ------------------------------------------------------------------------------------------------

def test_model_paths_json_errors():
    msg = user_error(parse_model_configs, '["a.safetensors",]', None, None)
    assert msg.startswith("--model_paths") and "line 1 column 18" in msg
    assert "--model_paths" in user_error(parse_model_configs, '{"a": 1}', None, None)
    assert "entry 1" in user_error(parse_model_configs, '["a.safetensors", 3]', None, None)
    assert "--model_id_with_origin_paths" in user_error(parse_model_configs, None, "Qwen/Qwen-Image", None)
    assert "model_id" in user_error(ModelConfig)
    assert "modelscope" in user_error(ModelConfig, model_id="a/b", origin_file_pattern="*", download_source="s3")


def test_parse_model_configs_and_fp8_matching():
    shards = ["m/te/model-00001-of-00002.safetensors", "m/te/model-00002-of-00002.safetensors"]
    configs = parse_model_configs(json.dumps([shards, "m/vae.safetensors"]),
                                  f"Qwen/Qwen-Image:{DIT_PATTERN}, Qwen/Qwen-Image:tokenizer/",
                                  f"{shards[1]},Qwen/Qwen-Image:{DIT_PATTERN}")
    assert [c.describe() for c in configs] == [f"{shards[0]} (+1 shards)", "m/vae.safetensors",
                                               f"Qwen/Qwen-Image:{DIT_PATTERN}", "Qwen/Qwen-Image:tokenizer/"]
    assert [c.fp8 for c in configs] == [True, False, True, False]  # a list entry matched by one of its shards
    by_folder = parse_model_configs(json.dumps([shards]), None, "m/te")
    assert by_folder[0].fp8
    by_list = parse_model_configs(json.dumps([shards, "m/vae.safetensors"]), None, json.dumps([shards]))
    assert [c.fp8 for c in by_list] == [True, False]
    by_name = parse_model_configs(json.dumps(["m/vae.safetensors"]), f"Qwen/Qwen-Image:{DIT_PATTERN}", "dit")
    assert [c.wants_fp8("dit") for c in by_name] == [True, True]
    assert [c.wants_fp8("vae") for c in by_name] == [False, False]
    msg = user_error(parse_model_configs, json.dumps(["m/vae.safetensors"]), None, "m/other.safetensors")
    assert "--fp8_models" in msg and "m/other.safetensors" in msg


# -- bad files --------------------------------------------------------------------------------------------

def test_non_safetensors_files_are_refused(tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("these are not weights\n")
    msg = user_error(load_component, str(text))
    assert str(text) in msg and "not a safetensors file" in msg
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes((20).to_bytes(8, "little") + b'{"a": {"dtype": "F3' + b"\x00" * 64)
    msg = user_error(load_component, str(corrupt))
    assert str(corrupt) in msg and "header is not valid" in msg
    pickle = tmp_path / "pytorch_model.bin"
    pickle.write_bytes(b"\x80\x04not really a pickle")
    msg = user_error(load_component, str(pickle))
    assert str(pickle) in msg and "pickle" in msg
    folder = tmp_path / "only_pickles"
    folder.mkdir()
    shutil.copy(pickle, folder / "pytorch_model.bin")
    assert str(folder / "pytorch_model.bin") in user_error(load_component, str(folder))
    (tmp_path / "empty_dir").mkdir()
    msg = user_error(load_component, str(tmp_path / "empty_dir"))
    assert str(tmp_path / "empty_dir") in msg and "no weight files" in msg


def test_truncated_safetensors_file(paths, tmp_path):
    data = Path(paths["vae"][0]).read_bytes()
    cut = tmp_path / "vae.safetensors"
    cut.write_bytes(data[:-100])
    msg = user_error(load_component, str(cut))
    assert str(cut) in msg and "truncated" in msg


def test_unknown_architecture(tmp_path):
    f = tmp_path / "mystery.safetensors"
    save_file({"encoder.weight": torch.zeros(4, 4), "head.bias": torch.zeros(4)}, f)
    msg = user_error(load_component, str(f))
    # the expected classes of a family are named, and every family that was tried
    assert str(f) in msg and "unknown architecture" in msg and "expected one of dit: " in msg
    from difftune.core.family import families

    assert f"tried the families {', '.join(sorted(families()))};" in msg  # every registered family, by name


def test_missing_shard_is_named(paths, repo, tmp_path):
    msg = user_error(load_component, ModelConfig(paths["transformer"][:-1]))
    assert paths["transformer"][-1] in msg and "missing shard" in msg
    folder = tmp_path / "te"
    shutil.copytree(repo / "text_encoder", folder)
    gone = sorted(folder.glob("model-00002-*.safetensors"))[0]
    gone.unlink()
    msg = user_error(load_component, str(folder))
    assert str(gone) in msg and "index.json" in msg


def test_weights_that_do_not_fit_the_config(paths, repo, tmp_path):
    folder = tmp_path / "vae"
    folder.mkdir()
    shutil.copy(repo / "vae" / "config.json", folder / "config.json")
    weights = saved(paths["vae"])
    dropped = sorted(weights)[0]
    weights.pop(dropped)
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, folder / "diffusion_pytorch_model.safetensors")
    msg = user_error(load_component, str(folder))
    assert str(folder / "diffusion_pytorch_model.safetensors") in msg
    assert dropped in msg and "extra.weight" in msg and "1 missing" in msg and "1 unexpected" in msg


# -- FP8 --------------------------------------------------------------------------------------------------

def _dit_forward(module, dtype):
    g = torch.Generator().manual_seed(0)
    return module(hidden_states=torch.randn(1, 16, 64, generator=g).to(dtype),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g).to(dtype),
                  encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.tensor([0.5]),
                  img_shapes=[[(1, 4, 4)]], return_dict=False)[0]


def _linear_weight_bytes(module):
    return sum(m.weight.numel() * m.weight.element_size() for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_fp8_storage_close_to_bf16_and_half_the_memory(paths):
    bf16 = load_component(paths["transformer"], torch_dtype=torch.bfloat16).module
    configs = parse_model_configs(json.dumps([paths["transformer"]]), None, "dit")  # by component name
    fp8 = load_component(configs[0], torch_dtype=torch.bfloat16).module
    q = fp8.transformer_blocks[0].attn.to_q
    assert isinstance(q, torch.nn.Linear) and q.weight.dtype == torch.float8_e4m3fn
    assert fp8.transformer_blocks[0].attn.norm_q.weight.dtype == torch.bfloat16
    assert _linear_weight_bytes(fp8) * 2 == _linear_weight_bytes(bf16)
    with torch.no_grad():
        a, b = _dit_forward(bf16, torch.bfloat16).float(), _dit_forward(fp8, torch.bfloat16).float()
    assert b.dtype == torch.float32 and (a - b).norm() / a.norm() < 0.1
    # The file's (fp32) weight is rounded to fp8 once, as it is read, not via the bf16 copy.
    stored = saved(paths["transformer"])["transformer_blocks.0.attn.to_q.weight"]
    assert torch.equal(q.weight.float(), stored.to(torch.float8_e4m3fn).float())
    fp8.to(torch.float32)  # a dtype change moves the compute dtype, never the storage
    assert q.weight.dtype == torch.float8_e4m3fn and q.compute_dtype == torch.float32


def test_lora_on_an_fp8_model_trains(paths):
    from peft import LoraConfig, inject_adapter_in_model

    model = load_component(ModelConfig(paths["transformer"], fp8=True), torch_dtype=torch.float32).module
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                       target_modules=["to_q", "to_k", "img_mlp.net.2"]), model)
    layer = model.transformer_blocks[0].attn.to_q
    assert layer.base_layer.weight.dtype == torch.float8_e4m3fn
    assert layer.lora_A["default"].weight.dtype == torch.float32  # the compute dtype, not fp8
    _dit_forward(model, torch.float32).pow(2).mean().backward()
    for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
        assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0
    assert layer.base_layer.weight.grad is None


def test_fp8_refused_for_trainable_models():
    check_fp8_frozen(["text_encoder", "vae"], "dit")
    msg = user_error(check_fp8_frozen, ["dit"], "dit,vae")
    assert "dit" in msg and "--trainable_models" in msg
    layer = torch.nn.Linear(4, 4)
    assert enable_fp8_storage(torch.nn.Sequential(layer), torch.float32) == 1
    layer.weight.requires_grad_(True)
    assert "float8" in user_error(layer, torch.randn(2, 4))


def test_fp8_conv_storage_keeps_subclass_forward(paths):
    vae = load_component(paths["vae"][0], torch_dtype=torch.float32).module
    x = torch.rand(1, 3, 1, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mean
        count = enable_fp8_storage(vae, torch.float32, include_conv=True)
        out = vae.encode(x).latent_dist.mean
    assert count > 0 and vae.encoder.conv_in.weight.dtype == torch.float8_e4m3fn
    assert type(vae.encoder.conv_in).__name__ == "Fp8QwenImageCausalConv3d"
    assert (out - ref).norm() / ref.norm() < 0.1


# -- tokenizer and processor ------------------------------------------------------------------------------

def test_tokenizer_and_processor(repo, tmp_path):
    from PIL import Image

    tok = load_tokenizer(ModelConfig(str(repo / "tokenizer")))
    assert tok.convert_tokens_to_ids("<|im_start|>") == 257
    processor = load_processor(str(repo / "processor"))
    assert processor.merge_size == 2 and processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == 261
    out = processor(images=[Image.new("RGB", (56, 56))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    msg = user_error(load_tokenizer, str(repo / "vae"))
    assert str(repo / "vae") in msg and "tokenizer" in msg
