"""FLUX.1: sampling parity with diffusers' FluxPipeline, prompt embeddings, the training shift, LoRA interop."""

import math

import pytest
import torch

from difftune.core.units import run_unit
from difftune.errors import UserError
from difftune.families.flux import FluxImagePipeline
from difftune.families.flux.units import FluxClipEmbedder, FluxT5Embedder
from difftune.models import ModelConfig
from support import tiny_flux_paths, write_tiny_flux


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux"))


def load_pipe(root, dtype=torch.float32):
    paths = tiny_flux_paths(root)
    return FluxImagePipeline.from_pretrained(
        torch_dtype=dtype, device="cpu",
        model_configs=[ModelConfig(p if len(p) > 1 else p[0]) for p in paths.values()],
        tokenizer_1_config=ModelConfig(str(root / "tokenizer")),
        tokenizer_2_config=ModelConfig(str(root / "tokenizer_2")))


@pytest.fixture(scope="module")
def pipe(repo):
    return load_pipe(repo)


@pytest.fixture(scope="module")
def diffusers_pipe(repo):
    from diffusers import FluxPipeline

    p = FluxPipeline.from_pretrained(str(repo), dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def _prompt_units(pipe):
    return [u for u in pipe.units if isinstance(u, (FluxClipEmbedder, FluxT5Embedder))]


def test_prompt_embeddings_equal_diffusers_encode_prompt(pipe, diffusers_pipe):
    prompts = ["a cat", "a much longer prompt about a dog on a red sofa"]
    theirs, their_pooled, text_ids = diffusers_pipe.encode_prompt(prompts, prompt_2=None, device="cpu")
    values = {"prompt": prompts}
    for unit in _prompt_units(pipe):
        run_unit(pipe, unit, values)
    assert values["prompt_embeds"].shape == theirs.shape == (2, 512, 32)
    # equal up to float reordering (transformers' attention kernels may differ between the two loaders)
    d_t5 = (values["prompt_embeds"] - theirs).abs().max().item()
    d_clip = (values["pooled_prompt_embeds"] - their_pooled).abs().max().item()
    print(f"flux prompt embeddings: T5 max difference {d_t5:.2e}, CLIP pooled {d_clip:.2e}")
    assert d_t5 <= 1e-4 and d_clip <= 1e-4
    assert torch.equal(text_ids, torch.zeros(512, 3))


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_sampling_parity_with_diffusers(pipe, diffusers_pipe, cfg):
    """Same seed (CPU generator), steps, embedded guidance and true CFG give the same image as FluxPipeline."""
    kwargs = dict(height=64, width=48, num_inference_steps=3)
    ours = pipe(["a red circle on a blue background"], negative_prompt="blurry", cfg_scale=cfg, embedded_guidance=3.5,
                seed=7, progress=False, output_type="pt", **kwargs)
    theirs = diffusers_pipe(["a red circle on a blue background"], negative_prompt="blurry", true_cfg_scale=cfg,
                            guidance_scale=3.5, generator=torch.Generator().manual_seed(7), output_type="pt",
                            **kwargs).images
    diff = (ours - theirs).abs().max().item()
    print(f"flux parity cfg={cfg}: max pixel difference {diff:.3e}")
    assert ours.shape == theirs.shape == (1, 3, 64, 48)
    assert diff <= 2e-3
    assert ours.std() > 0.01  # not a blank image


def test_embedded_guidance_changes_the_image(pipe):
    a = pipe("x", height=32, width=32, num_inference_steps=2, seed=0, embedded_guidance=1.0, progress=False,
             output_type="pt")
    b = pipe("x", height=32, width=32, num_inference_steps=2, seed=0, embedded_guidance=5.0, progress=False,
             output_type="pt")
    assert (a - b).abs().max() > 0


def test_image_to_image_starts_from_the_input(pipe):
    from PIL import Image

    img = Image.new("RGB", (32, 32), (250, 250, 250))
    out = pipe("x", input_image=img, denoising_strength=0.3, height=32, width=32, num_inference_steps=4, seed=0,
               progress=False, output_type="pt")
    full = pipe("x", height=32, width=32, num_inference_steps=4, seed=0, progress=False, output_type="pt")
    assert out.shape == (1, 3, 32, 32) and (out - full).abs().max() > 1e-3


def test_training_inputs_use_the_reference_settings(pipe):
    from PIL import Image

    values = pipe.training_inputs({"image": Image.new("RGB", (48, 32)), "prompt": "p"})
    assert values["embedded_guidance"] == 1.0 and values["negative_prompt"] == ""


def test_training_table_is_static_shift_3():
    """The reference trains FLUX.1 at a static shift of 3 over linspace(1, 0.003/1.002, 1000) (its FLUX.1 template
    keeps a smallest sigma); mu = ln 3 gives that table exactly (test_flux_training_table.py: the weights too)."""
    sched = FluxImagePipeline.default_scheduler()
    sched.set_training()
    sigmas, _, _ = sched.training_table(sched.training_mu())
    raw = torch.linspace(1, 0.003 / 1.002, 1000, dtype=torch.float64)
    want = 3 * raw / (1 + 2 * raw)
    assert sched.training_mu() == pytest.approx(math.log(3))
    assert torch.allclose(sigmas.double(), want, atol=1e-6)


def test_inference_sigmas_equal_diffusers(diffusers_pipe):
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sched = FluxImagePipeline.default_scheduler()
    seq = (64 // 16) * (48 // 16)
    ours = sched.set_timesteps(5, image_seq_len=seq)
    s = diffusers_pipe.scheduler
    mu = calculate_shift(seq, s.config.base_image_seq_len, s.config.max_image_seq_len, s.config.base_shift,
                         s.config.max_shift)
    s.set_timesteps(sigmas=np.linspace(1.0, 1 / 5, 5), mu=mu)
    assert torch.equal(ours, s.timesteps)


def test_trained_lora_loads_in_diffusers_flux_pipeline(repo, tmp_path):
    """A LoRA trained by difftune (default FLUX targets) loads with FluxPipeline.load_lora_weights, changes the
    image, and gives the image difftune gives with the LoRA fused."""
    import json

    from conftest import run_train
    from diffusers import FluxPipeline
    from difftune.families.flux.components import LORA_TARGET_MODULES
    from support import write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
              "--learning_rate", 5e-2, "--dataset_repeat", 2, "--num_epochs", 1, "--seed", 5, "--no_progress",
              "--enable_tensorboard_log", "false", "--max_pixels", 4096, "--lora_base_model", "dit",
              "--lora_target_modules", LORA_TARGET_MODULES, "--lora_rank", 4)
    lora = tmp_path / "out" / "epoch-0.safetensors"
    kwargs = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.5, output_type="pt")
    theirs = FluxPipeline.from_pretrained(str(repo), dtype=torch.float32)
    theirs.set_progress_bar_config(disable=True)
    base = theirs("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    theirs.load_lora_weights(str(lora))
    with_lora = theirs("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    assert (with_lora - base).abs().max().item() > 1e-3
    ours = load_pipe(repo)
    ours.load_lora(ours.dit, str(lora))
    mine = ours("a red circle", height=32, width=32, num_inference_steps=2, embedded_guidance=3.5, seed=0,
                progress=False, output_type="pt")
    diff = (mine - with_lora).abs().max().item()
    print(f"flux LoRA in diffusers vs difftune fused: max pixel difference {diff:.3e}")
    assert diff <= 2e-3


def test_official_configs_have_the_official_shapes():
    """The FLUX.1-dev configs recognition matches bare weights against build the real architectures."""
    from difftune.families.flux.components import DIT, TEXT_ENCODER, TEXT_ENCODER_2, VAE

    dit = DIT.signature(DIT.known_configs["black-forest-labs/FLUX.1-dev transformer"])
    assert dit["x_embedder.weight"] == (3072, 64) and dit["context_embedder.weight"] == (3072, 4096)
    assert "time_text_embed.guidance_embedder.linear_1.weight" in dit
    assert sum(k.endswith("norm.linear.weight") and k.startswith("single_transformer_blocks.") for k in dit) == 38
    vae = VAE.signature(VAE.known_configs["black-forest-labs/FLUX.1-dev VAE"])
    assert vae["encoder.conv_out.weight"] == (32, 512, 3, 3) and "quant_conv.weight" not in vae
    clip = TEXT_ENCODER.signature(TEXT_ENCODER.known_configs["CLIP ViT-L/14 text model"])
    assert clip["embeddings.token_embedding.weight"] == (49408, 768)
    t5_config = TEXT_ENCODER_2.known_configs["T5 v1.1 XXL encoder"]
    t5 = TEXT_ENCODER_2.signature(t5_config)
    assert t5["shared.weight"] == (32128, 4096)
    assert len([k for k in t5 if k.endswith("DenseReluDense.wi_0.weight")]) == 24
    assert TEXT_ENCODER_2.tied(t5_config) == {"encoder.embed_tokens.weight"}


def test_bare_weights_are_recognised_by_shape(repo, tmp_path):
    """Without a config.json beside them, weights are matched against the known configs by shape; T5's
    tied embedding may be stored once (shared.weight only)."""
    import dataclasses
    import json
    import shutil

    from difftune.models.detect import detect_component

    from difftune.families.flux.components import TEXT_ENCODER_2, VAE

    for spec, folder in ((TEXT_ENCODER_2, "text_encoder_2"), (VAE, "vae")):
        config = json.loads((repo / folder / "config.json").read_text())
        tiny = dataclasses.replace(spec, known_configs={"tiny": config})
        bare = tmp_path / folder
        bare.mkdir()
        files = [shutil.copy(p, bare) for p in tiny_flux_paths(repo)[folder]]
        found = detect_component(ModelConfig(files if len(files) > 1 else files[0]), [tiny])
        assert found.spec.name == spec.name and found.config == config


def test_clip_in_the_official_key_layout_loads(repo, tmp_path):
    """The official text_encoder/model.safetensors names CLIP's tensors text_model.*; they load."""
    from safetensors.torch import load_file, save_file

    from difftune.families.flux.components import TEXT_ENCODER
    from difftune.models.load import load_component

    (tmp_path / "text_encoder").mkdir()
    sd = load_file(tiny_flux_paths(repo)["text_encoder"][0])
    save_file({"text_model." + k: v for k, v in sd.items()}, str(tmp_path / "text_encoder" / "model.safetensors"))
    (tmp_path / "text_encoder" / "config.json").write_text((repo / "text_encoder" / "config.json").read_text())
    module = load_component(ModelConfig(str(tmp_path / "text_encoder" / "model.safetensors")), [TEXT_ENCODER],
                            torch_dtype=torch.float32).module
    key = "embeddings.token_embedding.weight"
    assert torch.equal(module.state_dict()[key], sd[key])


def test_sample_command_on_a_flux_repository(repo, tmp_path):
    """`difftune sample --model_dir` recognises FLUX, finds both tokenizers beside the weights and takes
    --embedded_guidance; the image equals the pipeline's."""
    import numpy as np
    from PIL import Image

    from difftune.cli.sample import main

    out = tmp_path / "a.png"
    argv = ["--model_dir", repo, "--prompt", "a red circle", "--height", 32, "--width", 32, "--num_inference_steps",
            2, "--seed", 3, "--torch_dtype", "float32", "--device", "cpu", "--embedded_guidance", 2.0, "--output", out]
    assert main([str(a) for a in argv]) == 0
    got = np.asarray(Image.open(out))
    want = np.asarray(load_pipe(repo)("a red circle", height=32, width=32, num_inference_steps=2, seed=3,
                                      embedded_guidance=2.0, progress=False))
    assert got.shape == (32, 32, 3) and np.abs(got.astype(int) - want.astype(int)).max() <= 1
    # FLUX.1 Kontext: --kontext_images (repeatable) gives the pipeline's kontext_images
    ref = tmp_path / "ref.png"
    Image.fromarray((np.random.RandomState(0).rand(32, 48, 3) * 255).astype("uint8")).save(ref)
    assert main([str(a) for a in argv] + ["--kontext_images", str(ref)]) == 0
    got = np.asarray(Image.open(out))
    want = np.asarray(load_pipe(repo)("a red circle", height=32, width=32, num_inference_steps=2, seed=3,
                                      embedded_guidance=2.0, kontext_images=[Image.open(ref).convert("RGB")],
                                      progress=False))
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_validation_images_during_flux_training(repo, tmp_path):
    import json

    from PIL import Image

    from conftest import run_train
    from difftune.families.flux.components import LORA_TARGET_MODULES
    from support import write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
              "--learning_rate", 1e-3, "--num_epochs", 1, "--seed", 5, "--no_progress", "--enable_tensorboard_log",
              "false", "--max_pixels", 4096, "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGET_MODULES,
              "--validation_prompts", "a red circle|a blue square", "--validation_steps", 1, "--validation_size", 32,
              "--validation_inference_steps", 2)
    images = sorted((tmp_path / "out").rglob("step-*.png"))
    assert images
    grid = Image.open(images[-1])
    assert grid.size[1] == 32 and len(set(grid.getdata())) > 1


def test_gradient_checkpointing_gives_the_same_gradients(pipe):
    from difftune.families.flux.model_fn import model_fn_flux

    torch.manual_seed(0)
    latents, emb, pooled = torch.randn(1, 16, 4, 4), torch.randn(1, 7, 32), torch.randn(1, 32)
    grads = []
    for ckpt, offload in ((False, False), (True, False), (True, True)):
        pipe.dit.zero_grad()
        pipe.dit.requires_grad_(True)
        out = model_fn_flux(pipe.dit, latents, torch.tensor([400.0]), emb, pooled, torch.tensor([1.0]),
                            use_gradient_checkpointing=ckpt, use_gradient_checkpointing_offload=offload)
        out.square().mean().backward()
        grads.append(pipe.dit.x_embedder.weight.grad.clone())
    pipe.dit.requires_grad_(False)
    pipe.dit.zero_grad()
    model_fn_flux(pipe.dit, latents, torch.tensor([1.0]), emb, pooled)  # back to no checkpointing
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_bf16_inference_is_finite(repo):
    """In bfloat16 the latents and the decoded pixels are finite (an all-NaN result would decode to a black image,
    so the tensors are checked, not the picture)."""
    from PIL import Image

    pipe = load_pipe(repo, dtype=torch.bfloat16)
    call = dict(height=32, width=32, num_inference_steps=2, seed=0, cfg_scale=2.0, progress=False)
    latents = pipe("a cat", output_type="latent", **call)
    pixels = pipe("a cat", output_type="pt", **call)
    assert latents.shape == (1, 16, 4, 4) and torch.isfinite(latents).all() and latents.abs().max() > 0
    assert pixels.shape == (1, 3, 32, 32) and torch.isfinite(pixels).all()
    img = pipe("a cat", **call)
    assert isinstance(img, Image.Image) and img.size == (32, 32)


def test_batched_stage1_matches_one_at_a_time(repo, tmp_path):
    import json

    from conftest import run_train
    from difftune.families.flux.components import LORA_TARGET_MODULES
    from support import write_example_dataset
    from difftune.cache import CacheReader

    def read_all(path):
        reader = CacheReader(str(path))
        return {reader[i]["_id"]: reader[i] for i in range(len(reader))}

    meta = write_example_dataset(tmp_path / "data", n=4, size=(48, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    common = ["--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--max_pixels", 4096, "--model_paths", json.dumps(paths), "--lora_base_model", "dit",
              "--lora_target_modules", LORA_TARGET_MODULES, "--torch_dtype", "float32", "--no_progress"]
    run_train(*common, "--output_path", tmp_path / "one", "--data_process_batch_size", 1)
    run_train(*common, "--output_path", tmp_path / "four", "--data_process_batch_size", 4)
    a, b = read_all(tmp_path / "one"), read_all(tmp_path / "four")
    assert a.keys() == b.keys() and a
    names = set()
    for key in a:
        for name, value in a[key].items():
            if isinstance(value, torch.Tensor):
                names.add(name)
                assert value.shape == b[key][name].shape, (key, name)
                assert (value.float() - b[key][name].float()).abs().max() <= 1e-5, (key, name)
    assert {"prompt_embeds", "pooled_prompt_embeds", "input_latents", "guidance"} <= names


@pytest.mark.parametrize("trained,absent", [("text_encoder", "text_encoder_2"), ("text_encoder_2", "text_encoder")])
def test_a_text_encoder_lora_leaves_the_other_encoder_in_stage_1(trained, absent):
    from conftest import setup_run

    split = setup_run("--dataset_base_path", "data", "--family", "flux", "--lora_base_model", trained,
                      "--lora_target_modules", "q").split
    assert trained in split.stage2_models and "dit" in split.stage2_models
    assert absent not in split.stage2_models and absent in split.stage1_models


def test_bf16_sampling_parity_with_diffusers(repo):
    """In bfloat16 too (the loader keeps T5's `wo` in float32 only for float16, as transformers does)."""
    from diffusers import FluxPipeline

    ours = load_pipe(repo, dtype=torch.bfloat16)
    theirs = FluxPipeline.from_pretrained(str(repo), dtype=torch.bfloat16)
    theirs.set_progress_bar_config(disable=True)
    assert ours.text_encoder_2.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.bfloat16
    kwargs = dict(height=64, width=48, num_inference_steps=3, output_type="pt")
    a = ours(["a red circle"], negative_prompt="blurry", cfg_scale=3.0, seed=7, progress=False, **kwargs)
    b = theirs(["a red circle"], negative_prompt="blurry", true_cfg_scale=3.0,
               generator=torch.Generator().manual_seed(7), **kwargs).images
    diff = (a.float() - b.float()).abs().max().item()
    print(f"flux bf16 parity cfg=3: max pixel difference {diff:.3e}")
    assert diff <= 1e-2


def test_train_from_hub_ids_in_the_diffusers_layout(repo, tmp_path, monkeypatch):
    """`--model_id_with_origin_paths` naming black-forest-labs/FLUX.1-dev's diffusers folders (resolved under
    DIFFTUNE_MODEL_BASE_PATH, no download): the family is recognised and both tokenizers come from the same
    repository's tokenizer/ and tokenizer_2/; split training gives the one-stage LoRA."""
    from safetensors.torch import load_file

    from conftest import run_train
    from support import populate_offline_hub, write_example_dataset

    populate_offline_hub(tmp_path / "models", "black-forest-labs/FLUX.1-dev", repo)
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    ids = ",".join(f"black-forest-labs/FLUX.1-dev:{p}" for p in (
        "transformer/*.safetensors", "text_encoder/model.safetensors", "text_encoder_2/*.safetensors",
        "vae/diffusion_pytorch_model.safetensors"))
    common = ["--model_id_with_origin_paths", ids, "--torch_dtype", "float32", "--learning_rate", 1e-3,
              "--num_epochs", 1, "--seed", 5, "--no_progress", "--enable_tensorboard_log", "false", "--max_pixels",
              4096, "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_k,to_v,proj_mlp", "--lora_rank", 4,
              "--remove_prefix_in_ckpt", "pipe.dit.", "--use_gradient_checkpointing"]
    data = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta]
    run_train("--task", "sft", *data, "--output_path", tmp_path / "one", *common)
    run_train("--task", "sft:data_process", *data, "--output_path", tmp_path / "cache", *common)
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *common)
    a = load_file(str(tmp_path / "one" / "epoch-0.safetensors"))
    b = load_file(str(tmp_path / "two" / "epoch-0.safetensors"))
    assert a.keys() == b.keys() and any(".single_transformer_blocks.0.proj_mlp." in k for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


REFERENCE_TARGETS = ("a_to_qkv,b_to_qkv,ff_a.0,ff_a.2,ff_b.0,ff_b.2,a_to_out,b_to_out,proj_out,norm.linear,"
                     "norm1_a.linear,norm1_b.linear,to_qkv_mlp")  # examples/flux/model_training/lora/FLUX.1-dev.sh


def test_the_reference_lora_targets_name_the_same_modules(repo, tmp_path):
    """The reference's --lora_target_modules (its own fused names) train the default diffusers targets' modules; its
    fused a_to_qkv / b_to_qkv / to_qkv_mlp as one adapter each (q, k, v (+ proj_mlp) share one lora_A, as the
    reference's one adapter on its fused layer: test_flux_fused_lora.py), diffusers' names as one adapter per layer."""
    import json

    from safetensors.torch import load_file

    from conftest import run_train
    from difftune.families.flux.components import LORA_TARGET_MODULES
    from support import write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    out = {}
    for name, targets in (("reference", REFERENCE_TARGETS), ("diffusers", LORA_TARGET_MODULES)):
        run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / name, "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
                  "--learning_rate", 1e-3, "--num_epochs", 1, "--seed", 5, "--no_progress",
                  "--enable_tensorboard_log", "false", "--max_pixels", 4096, "--lora_base_model", "dit",
                  "--lora_target_modules", targets, "--lora_rank", 4)
        out[name] = load_file(str(tmp_path / name / "epoch-0.safetensors"))
    a, b = out["reference"], out["diffusers"]
    assert a.keys() == b.keys()
    assert any(".transformer_blocks.0.attn.add_k_proj." in k for k in a)
    for stem, parts in (("transformer_blocks.0.attn", ("to_q", "to_k", "to_v")),
                        ("transformer_blocks.0.attn", ("add_q_proj", "add_k_proj", "add_v_proj")),
                        ("single_transformer_blocks.0", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))):
        downs = [f"transformer.{stem}.{p}.lora_A.weight" for p in parts]
        assert all(torch.equal(a[downs[0]], a[k]) for k in downs)  # one adapter on the fused layer
        assert not any(torch.equal(b[downs[0]], b[k]) for k in downs[1:])  # an adapter per layer


def _tiny_known_configs(repo, monkeypatch):
    """The tiny configs as known ones (BFL's single files have no config.json beside them)."""
    import json

    from difftune.families.flux.components import DIT, VAE

    for spec, folder in ((DIT, "transformer"), (VAE, "vae")):
        monkeypatch.setitem(spec.known_configs, "tiny", json.loads((repo / folder / "config.json").read_text()))


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_bfl_single_files_load_the_same_tensors(repo, tmp_path, monkeypatch, prefix):
    """flux1-dev.safetensors (fused qkv, ComfyUI's prefix or none) and ae.safetensors (LDM layout) are
    recognised from their headers and load to exactly the diffusers-layout weights."""
    import shutil

    from difftune.families.flux import FAMILY
    from difftune.models.load import load_component
    from support import write_tiny_flux_bfl

    _tiny_known_configs(repo, monkeypatch)
    root = tmp_path / "repo"
    shutil.copytree(repo, root)
    bfl = write_tiny_flux_bfl(root, prefix=prefix)
    paths = tiny_flux_paths(repo)
    for slot in ("transformer", "vae"):
        got = load_component(bfl[slot], FAMILY.components, torch_dtype="float32")
        want = load_component(paths[slot] if len(paths[slot]) > 1 else paths[slot][0], FAMILY.components,
                              torch_dtype="float32")
        assert got.source == "weights match tiny" and got.name == want.name
        a, b = got.module.state_dict(), want.module.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bfl_transformer_names_equal_diffusers_converter_at_full_size():
    """At FLUX.1-dev's real widths (on meta tensors), the transformer conversion gives the names and shapes
    diffusers' own single-file converter gives, and those of the official config."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from difftune.families.flux.bfl import bfl_transformer_from_diffusers, convert_bfl_transformer
    from difftune.families.flux.components import DIT, DIT_BFL

    config = DIT.known_configs["black-forest-labs/FLUX.1-dev transformer"]
    sig = DIT.signature(config)
    bfl = bfl_transformer_from_diffusers({k: torch.empty(s, device="meta") for k, s in sig.items()})
    ours = {k: tuple(v.shape) for k, v in convert_bfl_transformer(dict(bfl)).items()}
    theirs = {k: tuple(v.shape) for k, v in convert_flux_transformer_checkpoint_to_diffusers(dict(bfl)).items()}
    assert ours == theirs == sig
    assert DIT_BFL.fits(config, DIT_BFL.model_shapes({k: tuple(v.shape) for k, v in bfl.items()}))


def test_train_from_the_reference_bfl_hub_files(repo, tmp_path, monkeypatch):
    """The reference's FLUX.1-dev command form (flux1-dev.safetensors and ae.safetensors at the repository's
    root) trains from an offline hub; the tokenizers come from tokenizer/ and tokenizer_2/."""
    from safetensors.torch import load_file

    from conftest import run_train
    from support import populate_offline_hub, write_example_dataset, write_tiny_flux_bfl

    _tiny_known_configs(repo, monkeypatch)
    hub = populate_offline_hub(tmp_path / "models", "black-forest-labs/FLUX.1-dev", repo)
    write_tiny_flux_bfl(hub)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    ids = ("black-forest-labs/FLUX.1-dev:flux1-dev.safetensors,black-forest-labs/FLUX.1-dev:text_encoder/"
           "model.safetensors,black-forest-labs/FLUX.1-dev:text_encoder_2/*.safetensors,"
           "black-forest-labs/FLUX.1-dev:ae.safetensors")
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_id_with_origin_paths", ids, "--torch_dtype", "float32",
              "--learning_rate", 1e-3, "--max_steps", 2, "--no_progress", "--enable_tensorboard_log", "false",
              "--max_pixels", 4096, "--lora_base_model", "dit", "--lora_target_modules", REFERENCE_TARGETS,
              "--lora_rank", 4, "--remove_prefix_in_ckpt", "pipe.dit.")
    out = sorted((tmp_path / "out").glob("*.safetensors"))
    assert out and any(".single_transformer_blocks.0.attn.to_q." in k for k in load_file(str(out[-1])))


def _kohya_bfl_lora(path, repo, diffusers_subset=False, rank=4):
    """A kohya LoRA in BFL's names on the tiny transformer (fused qkv, linear1, the final modulation)."""
    import json

    from safetensors.torch import save_file

    c = json.loads((repo / "transformer" / "config.json").read_text())
    w = c["num_attention_heads"] * c["attention_head_dim"]
    shapes = {"double_blocks_0_img_attn_qkv": (w, 3 * w), "double_blocks_0_txt_attn_qkv": (w, 3 * w),
              "double_blocks_0_img_attn_proj": (w, w), "double_blocks_0_txt_mlp_2": (4 * w, w),
              "double_blocks_0_img_mod_lin": (w, 6 * w), "single_blocks_0_linear2": (5 * w, w),
              "single_blocks_0_modulation_lin": (w, 3 * w), "final_layer_adaLN_modulation_1": (w, 2 * w),
              "final_layer_linear": (w, 64), "img_in": (64, w)}
    if diffusers_subset:  # what diffusers' converter applies at these widths: the blocks but linear1
        shapes = {k: v for k, v in shapes.items() if "blocks_" in k}
    else:
        shapes["single_blocks_0_linear1"] = (w, 7 * w)
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i, (name, (fan_in, fan_out)) in enumerate(shapes.items()):
        sd[f"lora_unet_{name}.lora_down.weight"] = torch.randn(rank, fan_in, generator=g) * 0.1
        sd[f"lora_unet_{name}.lora_up.weight"] = torch.randn(fan_out, rank, generator=g) * 0.1
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(float(rank if i % 2 else 2 * rank))
    save_file(sd, str(path))
    return sd


def _difftune_fused(repo, path):
    from difftune.families.flux import FAMILY
    from difftune.lora import fuse_lora, load_lora_file
    from difftune.models.load import load_component

    dit = load_component(tiny_flux_paths(repo)["transformer"], FAMILY.components, torch_dtype="float32").module
    fuse_lora(dit, load_lora_file(path, converters=FAMILY.lora_converters), component="transformer")
    return dit.state_dict()


def test_kohya_bfl_lora_fuses_as_diffusers_does(repo, tmp_path):
    """A kohya LoRA in BFL's fused-qkv names gives the fused weights of diffusers' FluxPipeline.load_lora_weights
    + fuse_lora, on the blocks' modules (diffusers' converter fixes linear1's split at FLUX.1's widths and leaves
    img_in / final_layer unapplied, so those are checked against the fused-layout arithmetic below)."""
    from diffusers import FluxPipeline

    path = tmp_path / "kohya.safetensors"
    _kohya_bfl_lora(path, repo, diffusers_subset=True)
    ours = _difftune_fused(repo, path)
    pipe = FluxPipeline.from_pretrained(str(repo), dtype=torch.float32)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    theirs = pipe.transformer.state_dict()
    assert ours.keys() == theirs.keys()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= 1e-6
    assert sum(not torch.equal(before[k], theirs[k]) for k in theirs) == 11  # 7 modules, two of them fused qkv


def test_kohya_bfl_lora_equals_the_update_of_the_fused_layers(repo, tmp_path):
    """Each kohya module's update (alpha/rank) * up @ down, added to the BFL-layout weight (fused qkv, q/k/v+MLP
    linear1, (shift, scale) modulation) and converted, equals difftune's fused LoRA on the diffusers modules."""
    from safetensors.torch import load_file

    from difftune.families.flux.bfl import bfl_transformer_from_diffusers, convert_bfl_transformer

    path = tmp_path / "kohya.safetensors"
    sd = _kohya_bfl_lora(path, repo)
    dit = {}
    for f in tiny_flux_paths(repo)["transformer"]:
        dit.update(load_file(f))
    bfl = bfl_transformer_from_diffusers(dit)
    names = {k.replace(".", "_").removesuffix("_weight"): k for k in bfl if k.endswith(".weight")}
    for key in sd:
        if key.endswith(".lora_down.weight"):
            name = key[len("lora_unet_"):-len(".lora_down.weight")]
            down, up = sd[key], sd[key.replace("lora_down", "lora_up")]
            scale = sd[key.replace("lora_down.weight", "alpha")].item() / down.shape[0]
            bfl[names[name]] = bfl[names[name]] + scale * up @ down
    want = convert_bfl_transformer(bfl)
    ours = _difftune_fused(repo, path)
    assert max((ours[k] - want[k]).abs().max().item() for k in want) <= 1e-6


def test_kohya_lora_with_unknown_bfl_names_is_refused(repo, tmp_path):
    from safetensors.torch import save_file

    from difftune.errors import UserError
    from difftune.families.flux import FAMILY
    from difftune.lora import load_lora_file

    path = tmp_path / "bad.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(2, 32),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(96, 2),
               "lora_unet_double_blocks_0_nothing.lora_down.weight": torch.zeros(2, 32),
               "lora_unet_double_blocks_0_nothing.lora_up.weight": torch.zeros(32, 2)}, str(path))
    with pytest.raises(UserError, match="no FLUX.1 Linear layer"):
        load_lora_file(path, converters=FAMILY.lora_converters)


def test_kohya_bfl_lora_via_the_commands(repo, tmp_path):
    """`--lora_checkpoint` starts training from a kohya BFL-named LoRA (at learning rate 0 the saved LoRA fuses
    to the same weights), and `difftune sample --lora` applies it (the image changes, as the pipeline's)."""
    import numpy as np
    from PIL import Image

    from conftest import run_train
    from difftune.cli.sample import main
    from support import write_example_dataset

    path = tmp_path / "kohya.safetensors"
    _kohya_bfl_lora(path, repo, diffusers_subset=True)
    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", __import__("json").dumps(paths),
              "--torch_dtype", "float32", "--learning_rate", 0, "--max_steps", 1, "--no_progress",
              "--enable_tensorboard_log", "false", "--max_pixels", 4096, "--lora_base_model", "dit",
              "--lora_target_modules", REFERENCE_TARGETS, "--lora_rank", 4, "--lora_checkpoint", path,
              "--remove_prefix_in_ckpt", "pipe.dit.")
    saved = sorted((tmp_path / "out").glob("*.safetensors"))[-1]
    a, b = _difftune_fused(repo, path), _difftune_fused(repo, saved)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6

    def sample(*extra):
        out = tmp_path / f"{len(extra)}.png"
        argv = ["--model_dir", repo, "--prompt", "a red circle", "--height", 32, "--width", 32,
                "--num_inference_steps", 2, "--seed", 3, "--torch_dtype", "float32", "--device", "cpu",
                "--output", out, *extra]
        assert main([str(x) for x in argv]) == 0
        return np.asarray(Image.open(out)).astype(int)

    plain, lora = sample(), sample("--lora", path)
    pipe = load_pipe(repo)
    pipe.load_lora(pipe.dit, str(path))
    want = np.asarray(pipe("a red circle", height=32, width=32, num_inference_steps=2, seed=3, progress=False))
    assert np.abs(plain - lora).max() > 0 and np.abs(lora - want.astype(int)).max() <= 1


# -- FLUX.1 Kontext -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kontext_pipe(repo):
    from diffusers import FluxKontextPipeline

    p = FluxKontextPipeline.from_pretrained(str(repo), dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def _noise_image(w, h, seed=0):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.mark.parametrize("ref_size,cfg", [((48, 32), 1.0), ((37, 50), 2.0)])
def test_kontext_sampling_parity_with_diffusers(pipe, kontext_pipe, ref_size, cfg):
    """kontext_images gives FluxKontextPipeline's image (same CPU seed, steps, guidance; its auto-resize off and
    max_area = the image's area, so it keeps the size): a reference of another size than the output, and one
    whose sides are not multiples of 16 (both floor them and resize)."""
    ref = _noise_image(*ref_size)
    kwargs = dict(height=32, width=48, num_inference_steps=3)
    ours = pipe("a red circle", negative_prompt="blurry", cfg_scale=cfg, kontext_images=ref, embedded_guidance=2.5,
                seed=3, progress=False, output_type="pt", **kwargs)
    theirs = kontext_pipe(prompt="a red circle", negative_prompt="blurry", true_cfg_scale=cfg, image=ref,
                          guidance_scale=2.5, generator=torch.Generator().manual_seed(3), output_type="pt",
                          max_area=32 * 48, _auto_resize=False, **kwargs).images
    diff = (ours - theirs).abs().max().item()
    print(f"flux kontext parity ref {ref_size} cfg={cfg}: max pixel difference {diff:.3e}")
    assert ours.shape == theirs.shape == (1, 3, 32, 48)
    assert diff <= 1e-4
    plain = pipe("a red circle", negative_prompt="blurry", cfg_scale=cfg, embedded_guidance=2.5, seed=3,
                 progress=False, output_type="pt", **kwargs)
    assert (ours - plain).abs().max().item() > 1e-3  # the reference image is used


def test_kontext_tokens_and_ids(pipe):
    """Each reference image: VAE latents (FLUX shift/scale) packed 2x2, ids (1, row, column) from 0; several
    follow one another; one set of references serves every prompt of a batch."""
    from difftune.core.latents import pack_latents
    from difftune.families.flux.kontext import FluxKontextEmbedder
    from difftune.parts.flux_ae import vae_encode
    from difftune.media.image import images_to_tensor

    a, b = _noise_image(32, 48, 1), _noise_image(64, 16, 2)
    values = {"kontext_images": [a, b], "batch_size": 2}
    run_unit(pipe, FluxKontextEmbedder(), values)
    lat, ids = values["kontext_latents"], values["kontext_ids"]
    assert lat.shape == (2, 3 * 2 + 1 * 4, 64) and ids.shape == (2, 10, 3)
    want_a = pack_latents(vae_encode(pipe, images_to_tensor(a)))[0]
    assert torch.equal(lat[0, :6], want_a) and torch.equal(lat[1, :6], want_a)
    assert torch.equal(ids[0, :6], torch.tensor([[1., r, c] for r in range(3) for c in range(2)]))
    assert torch.equal(ids[0, 6:], torch.tensor([[1., 0, c] for c in range(4)]))
    # a list per sample (stage-1 batches): each sample its own references
    values = {"kontext_images": [[a], [_noise_image(32, 48, 3)]], "batch_size": 2}
    run_unit(pipe, FluxKontextEmbedder(), values)
    assert torch.allclose(values["kontext_latents"][0], want_a, atol=1e-6)  # encoded in one batch of 2
    assert not torch.allclose(values["kontext_latents"][1], want_a)


def test_kontext_model_output_is_only_the_image_tokens(pipe):
    """The denoiser sees the reference tokens but returns (and a loss compares) only the noisy image's."""
    values = {"kontext_images": _noise_image(32, 32), "batch_size": 1}
    run_unit(pipe, next(u for u in pipe.units if type(u).__name__ == "FluxKontextEmbedder"), values)
    latents = torch.randn(1, 16, 4, 6)
    kw = dict(timestep=torch.tensor([500.0]), prompt_embeds=torch.randn(1, 7, 32),
              pooled_prompt_embeds=torch.randn(1, 32), guidance=torch.tensor([1.0]))
    out = pipe.model_fn(latents=latents, kontext_latents=values["kontext_latents"],
                        kontext_ids=values["kontext_ids"], **kw)
    assert out.shape == latents.shape
    assert (out - pipe.model_fn(latents=latents, **kw)).abs().max() > 1e-4


def test_kontext_images_named_by_no_flag_are_left_out(repo, tmp_path):
    """A kontext_images column named by no flag is left out of the samples, as the reference's train.py does (only
    --extra_inputs hands a feature its column): the run trains the plain task and says so, instead of reading the
    file names as text."""
    import json

    from conftest import run_train
    from support import write_kontext_dataset

    meta = write_kontext_dataset(tmp_path / "data")
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
              "--max_steps", 1, "--no_progress", "--enable_tensorboard_log", "false", "--max_pixels", 4096,
              "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 4)
    assert list((tmp_path / "out").rglob("*.safetensors"))


@pytest.mark.parametrize("references", [1, 2])
def test_kontext_lora_split_equals_one_stage(repo, tmp_path, references):
    """A DiT LoRA on Kontext data: split training (the kontext latents cached in stage 1, no VAE in stage 2)
    equals one-stage training (<= 1e-5), batch 2 included; one reference per row (csv) or two (json lists)."""
    import json

    from safetensors.torch import load_file

    from conftest import run_train
    from support import write_kontext_dataset

    meta = write_kontext_dataset(tmp_path / "data", n=2, size=(48, 32), kontext_size=(32, 32),
                                 references=references)
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    common = ["--model_paths", json.dumps(paths), "--torch_dtype", "float32", "--learning_rate", 1e-3,
              "--dataset_repeat", 2, "--num_epochs", 1, "--seed", 5, "--no_progress", "--enable_tensorboard_log",
              "false", "--max_pixels", 4096, "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_v,proj_mlp",
              "--lora_rank", 4, "--batch_size", 2,
              "--data_file_keys", "image,kontext_images", "--extra_inputs", "kontext_images"]
    data = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta]
    run_train("--task", "sft", *data, "--output_path", tmp_path / "one", *common)
    run_train("--task", "sft:data_process", *data, "--output_path", tmp_path / "cache", *common)
    cached = load_file(str(next((tmp_path / "cache").rglob("*.safetensors"))))
    assert any("kontext_latents" in k for k in cached), sorted(cached)[:10]
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *common)
    a = load_file(str(tmp_path / "one" / "epoch-0.safetensors"))
    b = load_file(str(tmp_path / "two" / "epoch-0.safetensors"))
    assert a.keys() == b.keys() and a
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"flux kontext ({references} reference(s)) split vs one-stage: max LoRA difference {diff:.2e}")
    assert diff <= 1e-5


# -- LoRA files difftune writes: diffusers (every key used), kohya and ComfyUI in BFL's names ------------------

def _diffusers_lora(repo, targets, rank=4, alphas=None, seed=11):
    """A random LoRA on the tiny transformer's `targets` (diffusers module paths): canonical sd, alpha per path."""
    from difftune.families.flux import FAMILY
    from difftune.models.load import load_component

    dit = load_component(tiny_flux_paths(repo)["transformer"], FAMILY.components, torch_dtype="float32").module
    g = torch.Generator().manual_seed(seed)
    sd, al = {}, {}
    for i, path in enumerate(targets):
        lin = dit.get_submodule(path)
        r = rank + (i % 2)  # ranks differ between modules, and between the parts of a fused layer
        sd[f"{path}.lora_A.weight"] = torch.randn(r, lin.in_features, generator=g) * 0.1
        sd[f"{path}.lora_B.weight"] = torch.randn(lin.out_features, r, generator=g) * 0.1
        al[path] = (alphas or {}).get(path, float(r))
    return sd, al


EXPORT_TARGETS = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v",  # k left out: zero rows
                  "transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.add_k_proj",
                  "transformer_blocks.0.attn.add_v_proj", "transformer_blocks.0.attn.to_out.0",
                  "transformer_blocks.0.ff_context.net.2", "transformer_blocks.0.norm1.linear",
                  "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
                  "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp",
                  "single_transformer_blocks.0.proj_out", "single_transformer_blocks.0.norm.linear",
                  "norm_out.linear", "proj_out", "x_embedder", "time_text_embed.guidance_embedder.linear_1"]


@pytest.mark.parametrize("layout,first_key", [
    ("kohya", "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"),
    ("comfyui", "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight")])
def test_kohya_and_comfyui_files_are_written_in_bfl_names_and_read_back_exactly(repo, tmp_path, layout, first_key):
    """`--lora_format kohya|comfyui` for FLUX writes BFL's module names (what kohya tools and ComfyUI's FLUX
    read): q, k, v (and the single blocks' MLP) re-fused into one adapter (downs stacked, up block-diagonal),
    the final modulation's rows swapped. Read back through difftune's importer, it fuses to the weights the
    LoRA it was written from fuses to (<= 1e-6), with alphas that differ between the fused parts too."""
    import re

    from safetensors.torch import load_file

    from difftune.families.flux import FAMILY
    from difftune.lora import fuse_lora, load_lora_file, save_lora
    from difftune.models.load import load_component

    alphas = {"transformer_blocks.0.attn.add_k_proj": 2.0, "single_transformer_blocks.0.proj_mlp": 16.0}
    sd, al = _diffusers_lora(repo, EXPORT_TARGETS, alphas=alphas)
    config = {"r": 4, "lora_alpha": 4.0, "target_modules": EXPORT_TARGETS,
              # anchored: a bare "proj_out" pattern would also match the single blocks' proj_out
              "rank_pattern": {"^" + re.escape(p): sd[f"{p}.lora_A.weight"].shape[0] for p in EXPORT_TARGETS},
              "alpha_pattern": {"^" + re.escape(p): a for p, a in al.items()}}
    out = tmp_path / f"{layout}.safetensors"
    save_lora(out, {"dit": sd}, {"dit": config}, layout=layout, native_names=FAMILY.lora_native_names)
    written = load_file(str(out))
    assert first_key in written
    sep = "_" if layout == "kohya" else "."
    bfl_modules = {k.rsplit(".", 2 if k.endswith(".weight") else 1)[0] for k in written}
    assert len(bfl_modules) == 12  # 18 diffusers modules: img qkv (2 parts), txt qkv (3), linear1 (4) fused
    assert not any("transformer_blocks" in k or "to_q" in k for k in written)
    qkv = "lora_unet_double_blocks_0_img_attn_qkv" if layout == "kohya" else \
        "diffusion_model.double_blocks.0.img_attn.qkv"
    down, up = written[f"{qkv}{'.lora_down.weight' if layout == 'kohya' else '.lora_A.weight'}"], \
        written[f"{qkv}{'.lora_up.weight' if layout == 'kohya' else '.lora_B.weight'}"]
    w = up.shape[0] // 3
    assert down.shape[0] == 4 + 5 and up[w:2 * w].abs().max() == 0  # q (rank 4) + v (rank 5); k's rows zero
    assert sep in first_key
    # every module is a weight of BFL's transformer with that shape: what ComfyUI's FLUX (BFL keys,
    # `diffusion_model.<key>` / `lora_unet_<key with _>`) and kohya tools map a LoRA module to
    from difftune.families.flux.bfl import bfl_transformer_from_diffusers

    dit = load_component(tiny_flux_paths(repo)["transformer"], FAMILY.components, torch_dtype="float32").module
    bfl = {k[: -len(".weight")]: v.shape for k, v in bfl_transformer_from_diffusers(dit.state_dict()).items()
           if k.endswith(".weight") and v.dim() == 2}
    names = {("lora_unet_" + k.replace(".", "_")) if layout == "kohya" else "diffusion_model." + k: k for k in bfl}
    for module in bfl_modules:
        a, b = (".lora_down.weight", ".lora_up.weight") if layout == "kohya" else (".lora_A.weight", ".lora_B.weight")
        assert module in names, module
        assert (written[module + b].shape[0], written[module + a].shape[1]) == bfl[names[module]], module

    def fused(lora):
        dit = load_component(tiny_flux_paths(repo)["transformer"], FAMILY.components, torch_dtype="float32").module
        fuse_lora(dit, lora, component="transformer")
        return dit.state_dict()

    want = fused(load_lora_file(_write_diffusers(tmp_path, sd, config)))
    got = fused(load_lora_file(out, converters=FAMILY.lora_converters))
    base = fused(load_lora_file(_write_diffusers(tmp_path, {k: v * 0 for k, v in sd.items()}, config, "zero")))
    changed = [k for k in want if not torch.equal(want[k], base[k])]
    assert len(changed) == len(EXPORT_TARGETS)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    print(f"flux {layout} export (BFL names) read back: max weight difference {diff:.2e}")
    assert diff <= 1e-6


def _write_diffusers(tmp_path, sd, config, name="diffusers"):
    from difftune.lora import save_lora

    return save_lora(tmp_path / f"{name}.safetensors", {"dit": sd}, {"dit": config})


def test_lora_format_kohya_from_the_command(repo, tmp_path):
    """`difftune train --lora_format kohya` on FLUX writes BFL's kohya names, which load back at the trained
    strength: the fused weights equal those of the same run saved in diffusers' layout."""
    import json

    from safetensors.torch import load_file

    from conftest import run_train
    from difftune.families.flux import FAMILY
    from difftune.lora import fuse_lora, load_lora_file
    from difftune.models.load import load_component
    from support import write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    saved = {}
    for layout in ("diffusers", "kohya"):
        run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / layout, "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
                  "--learning_rate", 1e-2, "--max_steps", 2, "--seed", 5, "--no_progress",
                  "--enable_tensorboard_log", "false", "--max_pixels", 4096, "--lora_base_model", "dit",
                  "--lora_target_modules", REFERENCE_TARGETS, "--lora_rank", 4, "--lora_format", layout)
        saved[layout] = next((tmp_path / layout).glob("*.safetensors"))
    keys = load_file(str(saved["kohya"])).keys()
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in keys
    assert "lora_unet_double_blocks_0_txt_attn_qkv.alpha" in keys
    assert all(k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_", "lora_unet_final_layer_"))
               for k in keys)

    def fused(path):
        dit = load_component(tiny_flux_paths(repo)["transformer"], FAMILY.components, torch_dtype="float32").module
        fuse_lora(dit, load_lora_file(path, converters=FAMILY.lora_converters), component="transformer")
        return dit.state_dict()

    a, b = fused(saved["diffusers"]), fused(saved["kohya"])
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def diffusers_warnings(action) -> list[str]:
    """The warnings diffusers logs while `action` runs, at diffusers' own warning level (not the tiny writers')."""
    import logging

    import diffusers

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("diffusers")
    before = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_warning()
    root.addHandler(handler)
    try:
        action()
    finally:
        root.removeHandler(handler)
        diffusers.utils.logging.set_verbosity(before)
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_saved_lora_uses_every_key_in_diffusers(repo, tmp_path):
    """diffusers' FluxPipeline.load_lora_weights takes every tensor of the LoRA difftune writes (default FLUX
    targets + a CLIP LoRA in one file is not possible: one model per run, so the DiT's): each lora_A/lora_B
    lands in the transformer unchanged, no key is left over or missing, and no warning is logged but diffusers' note
    that the file has no text-encoder part (a file with a stray key shows the check can fail)."""
    import json
    import logging

    from safetensors.torch import load_file

    from conftest import run_train
    from diffusers import FluxPipeline
    from difftune.families.flux.components import LORA_TARGET_MODULES
    from support import write_example_dataset

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(repo).values()]
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
              "--learning_rate", 1e-2, "--max_steps", 2, "--seed", 5, "--no_progress", "--enable_tensorboard_log",
              "false", "--max_pixels", 4096, "--lora_base_model", "dit", "--lora_target_modules",
              LORA_TARGET_MODULES, "--lora_rank", 4, "--lora_alpha", 8)
    path = tmp_path / "out" / "epoch-0.safetensors" if (tmp_path / "out" / "epoch-0.safetensors").exists() else \
        next((tmp_path / "out").glob("*.safetensors"))
    saved = load_file(str(path))
    pipe = FluxPipeline.from_pretrained(str(repo), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.5, output_type="pt")
    base = pipe("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    # the tiny writers turn diffusers' logger down to errors: its warnings are let through here, and a file with a
    # key for no module shows that a warning would be caught
    warned = diffusers_warnings(lambda: pipe.load_lora_weights(str(path), adapter_name="ours"))
    # diffusers says of a file without a text-encoder part that it holds none, which it calls "safe to ignore"
    assert [w for w in warned if "safe to ignore if LoRA state dict didn't originally have any" not in w] == []
    stray = dict(saved, **{"transformer.no_such_module.lora_A.weight": torch.zeros(4, 8),
                           "transformer.no_such_module.lora_B.weight": torch.zeros(8, 4)})
    from safetensors.torch import save_file

    save_file(stray, str(tmp_path / "stray.safetensors"))
    other = FluxPipeline.from_pretrained(str(repo), dtype=torch.float32)
    stray_warned = diffusers_warnings(lambda: other.load_lora_weights(str(tmp_path / "stray.safetensors"),
                                                                      adapter_name="x"))
    assert any("no_such_module" in w for w in stray_warned), stray_warned
    loaded = {k: v for k, v in pipe.transformer.state_dict().items() if ".lora_" in k}
    as_file = {"transformer." + k.replace(".ours.", "."): v for k, v in loaded.items()}
    assert as_file.keys() == saved.keys()  # every key used, none missing
    assert all(torch.equal(as_file[k], saved[k]) for k in saved)
    assert pipe.transformer.peft_config["ours"].lora_alpha == pipe.transformer.peft_config["ours"].r  # folded
    with_lora = pipe("a red circle", generator=torch.Generator().manual_seed(0), **kwargs).images
    assert (with_lora - base).abs().max().item() > 1e-3


def test_kohya_export_reads_in_diffusers_at_flux_size():
    """At FLUX.1-dev's widths (3072; diffusers' kohya reader fixes them), the kohya file difftune writes is read by
    diffusers' own `_convert_kohya_flux_lora_to_diffusers` to the same per-module updates (alpha/r)·B·A as the
    LoRA it was written from: fused img/txt qkv and linear1 (q, k, v, MLP), parts of unequal ranks included."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    from difftune.families.flux.bfl import bfl_lora_from_diffusers
    from difftune.lora import to_kohya

    w = 3072
    shapes = {"transformer_blocks.0.attn.to_q": (w, w), "transformer_blocks.0.attn.to_k": (w, w),
              "transformer_blocks.0.attn.to_v": (w, w), "transformer_blocks.0.attn.add_q_proj": (w, w),
              "transformer_blocks.0.attn.add_k_proj": (w, w), "transformer_blocks.0.attn.add_v_proj": (w, w),
              "single_transformer_blocks.1.attn.to_q": (w, w), "single_transformer_blocks.1.attn.to_k": (w, w),
              "single_transformer_blocks.1.attn.to_v": (w, w), "single_transformer_blocks.1.proj_mlp": (w, 4 * w),
              "transformer_blocks.0.ff.net.2": (4 * w, w)}
    g = torch.Generator().manual_seed(0)
    sd, alphas = {}, {}
    for i, (path, (fan_in, fan_out)) in enumerate(shapes.items()):
        r = 2 if path.startswith("transformer_blocks") else 2 + i % 2  # linear1's parts: unequal ranks
        sd[f"{path}.lora_A.weight"] = torch.randn(r, fan_in, generator=g)
        sd[f"{path}.lora_B.weight"] = torch.randn(fan_out, r, generator=g)
        alphas[path] = 1.0 if path.startswith("single") else 4.0
    bfl, bfl_alphas = bfl_lora_from_diffusers(sd, alphas)
    theirs = _convert_kohya_flux_lora_to_diffusers(to_kohya(bfl, bfl_alphas))
    for path, (fan_in, _) in shapes.items():
        a, b = theirs[f"transformer.{path}.lora_A.weight"], theirs[f"transformer.{path}.lora_B.weight"]
        x = torch.randn(fan_in, 3, generator=g)  # the updates compared on random inputs (no 12288x3072 products)
        ours = sd[f"{path}.lora_B.weight"] @ (sd[f"{path}.lora_A.weight"] @ x)
        ours = ours * (alphas[path] / sd[f"{path}.lora_A.weight"].shape[0])
        assert torch.allclose(b @ (a @ x), ours, atol=1e-3, rtol=1e-4), path


def test_kohya_export_whole_file_in_diffusers_and_the_note_for_what_it_drops(tmp_path):
    """Issue 25 item 11: the whole kohya file (blocks, and the final layer and an embedder when they are trained)
    through diffusers' own reading (`FluxPipeline.lora_state_dict`, what `load_lora_weights` hands the
    transformer), at FLUX.1's widths: every block module keeps its update (alpha/r)·B·A, and the modules outside the
    blocks are left out of the transformer without a warning, which the note difftune prints when it writes the
    layout names exactly."""
    from diffusers import FluxPipeline
    from safetensors.torch import save_file

    from difftune.families.flux.bfl import bfl_lora_from_diffusers, flux_lora_export_notes
    from difftune.lora import to_kohya

    w = 3072
    shapes = {"transformer_blocks.0.attn.to_q": (w, w), "transformer_blocks.0.attn.to_k": (w, w),
              "transformer_blocks.0.attn.to_v": (w, w), "transformer_blocks.0.attn.to_out.0": (w, w),
              "single_transformer_blocks.0.attn.to_q": (w, w), "single_transformer_blocks.0.attn.to_k": (w, w),
              "single_transformer_blocks.0.attn.to_v": (w, w), "single_transformer_blocks.0.proj_mlp": (w, 4 * w),
              "single_transformer_blocks.0.proj_out": (5 * w, w),
              "proj_out": (w, 64), "norm_out.linear": (w, 2 * w), "x_embedder": (64, w)}
    g = torch.Generator().manual_seed(1)
    sd, alphas = {}, {}
    for path, (fan_in, fan_out) in shapes.items():
        sd[f"{path}.lora_A.weight"] = torch.randn(2, fan_in, generator=g)
        sd[f"{path}.lora_B.weight"] = torch.randn(fan_out, 2, generator=g)
        alphas[path] = 4.0
    bfl, bfl_alphas = bfl_lora_from_diffusers(sd, alphas)
    save_file(to_kohya(bfl, bfl_alphas), str(tmp_path / "kohya.safetensors"))
    theirs = FluxPipeline.lora_state_dict(str(tmp_path / "kohya.safetensors"))
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    taken = {k[len("transformer."):].rpartition(".lora_")[0] for k in theirs if k.startswith("transformer.")}
    inside = {p for p in shapes if p.startswith(("transformer_blocks.", "single_transformer_blocks."))}
    assert taken == inside  # the block modules, and no other
    for path in inside:
        a, b = theirs[f"transformer.{path}.lora_A.weight"], theirs[f"transformer.{path}.lora_B.weight"]
        x = torch.randn(shapes[path][0], 3, generator=g)
        ours = 2.0 * (sd[f"{path}.lora_B.weight"] @ (sd[f"{path}.lora_A.weight"] @ x))
        assert torch.allclose(b @ (a @ x), ours, atol=1e-3, rtol=1e-4), path
    dropped = sorted(set(shapes) - inside)
    notes = flux_lora_export_notes("kohya", sorted(shapes))
    said = [n for n in notes if "diffusers' FluxPipeline.load_lora_weights drops" in n]
    assert len(said) == 1 and f"({', '.join(dropped)})" in said[0]
    assert not [n for n in flux_lora_export_notes("kohya", sorted(inside)) if "diffusers" in n]  # blocks only: none


def test_features_compose_the_pipeline_and_step1x_has_none_of_their_slots():
    """FluxImagePipeline lists its features (each its own module): their units sit among the base units in the order
    the reference runs them, their slots and denoiser-call models join the base's; Step1X-Edit, on the base class,
    has none of them; an unknown sampling input is refused naming the features' inputs."""
    from difftune.families.flux import Step1XEditPipeline
    from difftune.families.flux.pipeline import FluxBasePipeline

    assert [u.name for u in FluxImagePipeline().all_units] == [
        "FluxInsertAnything", "FluxShapeChecker", "FluxNoiseInitializer", "FluxInputImageEmbedder",
        "FluxKontextEmbedder", "FluxControlNetEmbedder", "FluxFillCondition", "FluxFlexConditioner",
        "FluxIPAdapterImageEncoder", "FluxInfiniteYouEmbedder", "FluxClipEmbedder", "FluxT5Embedder",
        "FluxReduxPromptEmbedder", "NexusGenEmbedder", "FluxEntityControl", "FluxValueControlEmbedder",
        "FluxLoRAEncoderInputs", "FluxLoRAEncoderEmbedder", "FluxEmbeddedGuidance"]
    assert FluxImagePipeline.model_names == (
        "dit", "text_encoder", "text_encoder_2", "vae", "controlnet", "ipadapter", "ipadapter_image_encoder",
        "flux_redux_image_encoder", "flux_redux_image_embedder", "image_proj_model", "value_controller",
        "lora_encoder", "nexus_gen", "nexus_gen_editing_adapter")
    assert FluxImagePipeline.loss_models == ("dit", "controlnet", "ipadapter", "image_proj_model")
    assert "insert_anything_size" in FluxImagePipeline.settings
    assert FluxBasePipeline.features == () and Step1XEditPipeline.features == ()
    assert Step1XEditPipeline.model_names == ("dit", "vae", "qwenvl", "step1x_connector")
    assert "insert_anything_size" not in Step1XEditPipeline.settings
    assert {"kontext_images", "controlnet_image", "controlnet_inputs", "eligen_enable_on_negative"} <= set(
        FluxImagePipeline.call_inputs())
    with pytest.raises(TypeError, match=r"unexpected input\(s\) \['kontext_image'\]; its features take "
                                        r".*kontext_images"):
        FluxImagePipeline()("a cat", kontext_image=None)


def test_difftune_sample_takes_insert_anything_size_with_the_training_default():
    from difftune.cli.sample import call_inputs_of, family_inputs, sample_parser
    from difftune.core.family import get_family
    from difftune.families.flux.insert_anything import SIZE

    flux = get_family("flux")

    def inputs(*argv):
        options, flags = family_inputs(sample_parser().parse_args(["--prompt", "p", *argv]), flux)
        return options, call_inputs_of(flux.pipeline, flux, flags)

    options, call = inputs("--insert_anything_size", "512")
    assert options.insert_anything_size == 512 and call["insert_anything_size"] == 512
    options, call = inputs()
    assert "insert_anything_size" not in call  # unset: the pipeline's default, which is the training flag's
    assert options.insert_anything_size == SIZE == 768
    with pytest.raises(UserError, match="--insert_anything_size 500: a multiple of 16"):
        inputs("--insert_anything_size", "500")
    # a training-and-sampling flag that is no call input (a tokenizer path) is still not handed to the call
    _, call = inputs("--tokenizer_1_path", "x")
    assert "tokenizer_1_path" not in call
