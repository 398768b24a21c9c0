"""`difftune sample` on Krea-2: the scripts' files (Krea's single file, Qwen3-VL's folder with its tokenizer, the
VAE), Raw's default time shift and Turbo's `--shift_mu 1.15`, each written image equal to the pipeline's own call;
the family's flag refused for another family."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from difftune.cli.sample import main as sample
from support.krea2 import KREA2_TURBO_REPO, load_tiny_krea2, krea2_model_paths, write_tiny_krea2_hub

SIZE = ["--height", "32", "--width", "48", "--num_inference_steps", "2", "--torch_dtype", "float32", "--seed", "3",
        "--device", "cpu"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_krea2_hub(tmp_path_factory.mktemp("krea2_hub"))


def _same(path, image) -> bool:
    with Image.open(path) as written:
        return np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))


def test_raw_and_turbo(hub, tmp_path):
    kw = dict(seed=3, height=32, width=48, num_inference_steps=2, progress=False)
    assert sample(["--model_paths", json.dumps(krea2_model_paths(hub)), "--prompt", "a red circle", "--cfg_scale", "2",
                   "--output", str(tmp_path / "raw.png"), *SIZE]) == 0
    assert _same(tmp_path / "raw.png", load_tiny_krea2(hub)("a red circle", cfg_scale=2.0, **kw))
    assert sample(["--model_paths", json.dumps(krea2_model_paths(hub, KREA2_TURBO_REPO)), "--prompt", "a red circle",
                   "--cfg_scale", "1", "--shift_mu", "1.15", "--output", str(tmp_path / "turbo.png"), *SIZE]) == 0
    turbo = load_tiny_krea2(hub, KREA2_TURBO_REPO)
    assert _same(tmp_path / "turbo.png", turbo("a red circle", cfg_scale=1.0, mu=1.15, **kw))
    assert not _same(tmp_path / "turbo.png", turbo("a red circle", cfg_scale=1.0, **kw))  # --shift_mu was used


def test_shift_mu_is_refused_for_another_family(tmp_path):
    from difftune.errors import UserError
    from support import write_tiny_qwen_image

    repo = write_tiny_qwen_image(tmp_path / "qwen")
    with pytest.raises(UserError, match="--shift_mu: the qwen_image family does not take it"):
        sample(["--model_dir", str(repo), "--prompt", "x", "--shift_mu", "1.15", "--output", str(tmp_path / "q.png"),
                *SIZE])


def test_image_to_image_starts_from_the_noised_image(hub):
    """An input image at strength 0.5: the reference's schedule (all steps from sigma 0.5, shifted), the image's
    latents noised to the first sigma; a different image gives a different result, strength 1 ignores it."""
    import torch

    pipe = load_tiny_krea2(hub)
    g = torch.Generator().manual_seed(0)
    images = [Image.fromarray((torch.rand(32, 48, 3, generator=g) * 255).to(torch.uint8).numpy()) for _ in range(2)]
    kw = dict(seed=3, height=32, width=48, num_inference_steps=2, cfg_scale=1.0, progress=False, output_type="latent")
    a, b = (pipe("a cat", input_image=i, denoising_strength=0.5, **kw) for i in images)
    assert a.shape == (1, 16, 4, 6) and (a - b).abs().max() > 1e-3
    full = [pipe("a cat", input_image=i, denoising_strength=1.0, **kw) for i in images]
    assert torch.equal(full[0], full[1]) and torch.equal(full[0], pipe("a cat", **kw))
