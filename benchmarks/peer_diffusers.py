"""diffusers' Qwen-Image DreamBooth LoRA script on the benchmark's model and data (run by peers.py).

The script (`examples/dreambooth/train_dreambooth_lora_qwen_image.py`) ships in neither the diffusers
wheel nor its sdist: only the GitHub repository has it, so `peers.py --diffusers-script PATH` names a
checkout of it, and this launcher runs that file unchanged (`runpy`) inside DiffSynth's venv, which has a
matching diffusers (>= the script's `check_min_version`) and the torchvision shim. Shims, none of which
edits the script:

* torchvision: the same op-schema shim as peer_diffsynth.py (`torchvision_shim.py`, installed at the top of this
  file; the script imports `torchvision.transforms`).
* Prompt template: the pipeline drops a hard-coded 34 template tokens; with the benchmark's byte-level
  tokenizer that count is wrong, so the pipeline's `prompt_template_encode_start_idx` is set to the count
  difftune uses, and the DiT sees the same prompt tokens in both.
* Images: `--instance_data_dir` opens every file in the folder, so the images (not metadata.csv) are
  linked into a folder of their own.

Usage: `<diffsynth-venv>/bin/python benchmarks/peer_diffusers.py --child '<json>'`; prints one BENCH_RESULT.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchvision_shim import install as torchvision_shim  # noqa: E402

torchvision_shim()  # before `common`: it imports difftune's families, which import diffusers and transformers

from common import LORA_TARGETS, child_main, status_kb  # noqa: E402


def measure(p: dict) -> dict:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import accelerate  # noqa: F401
    import diffusers
    import peft  # noqa: F401
    import torchvision  # noqa: F401
    import transformers  # noqa: F401

    init = diffusers.QwenImagePipeline.__init__

    @functools.wraps(init)  # diffusers reads the pipeline's components from this signature
    def pipeline_init(self, *a, **k):
        init(self, *a, **k)
        self.prompt_template_encode_start_idx = p["drop"]

    diffusers.QwenImagePipeline.__init__ = pipeline_init

    images = Path(p["output"]) / "instance_images"
    images.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(p["data"]).glob("*.png")):
        link = images / f.name
        if not link.exists():
            link.symlink_to(f)
    steps = p["steps"]
    argv = [p["script"], "--pretrained_model_name_or_path", p["repo"], "--instance_data_dir", str(images),
            "--instance_prompt", p["prompt"], "--output_dir", str(Path(p["output"]) / "out"),
            "--resolution", str(p["resolution"]), "--center_crop", "--train_batch_size", "1",
            "--max_train_steps", str(steps), "--checkpointing_steps", str(steps + 1), "--learning_rate", "1e-4",
            "--lr_scheduler", "constant", "--lr_warmup_steps", "0", "--rank", str(p["rank"]),
            "--lora_alpha", str(p["rank"]), "--lora_layers", LORA_TARGETS, "--mixed_precision", "no",
            "--dataloader_num_workers", "0", "--seed", "0", "--report_to", "all"]  # "all": only trackers installed (none)
    if p.get("cache_latents", True):
        argv.append("--cache_latents")
    record = {"step_stamps": [], "loader_waits": [], "write_stamps": []}
    register_optimizer_step_post_hook(lambda *a: record["step_stamps"].append(time.perf_counter()))
    record["rss_before_kb"] = status_kb("VmRSS")
    sys.argv = argv
    start = time.perf_counter()
    runpy.run_path(p["script"], run_name="__main__")
    end = time.perf_counter()
    stamps = record["step_stamps"]
    record.update(start=start, end=end, run_seconds=end - start, vmhwm_kb=status_kb("VmHWM"), steps=len(stamps))
    return record


if __name__ == "__main__":
    child_main(measure)
