"""DiffSynth-Studio's own training on the benchmark's model and data (run by peers.py, in DiffSynth's venv).

Not a copy of DiffSynth's example script: a training module written against the `diffsynth` package's
documented API (a `DiffusionTrainingModule` subclass whose `forward` runs the pipeline units and
`FlowMatchSFTLoss`; `UnifiedDataset`; `ModelLogger`; `launch_training_task` / `launch_data_process_task`),
which is what its `train.py` does for Qwen-Image. Shims, none of which edits DiffSynth:

* torchvision: the PyPI wheel matching torch 2.13 is a CUDA build whose `_C` cannot load on this CPU-only
  torch; `import torchvision` then dies registering fakes for `torchvision::nms`. Defining the two op
  schemas first lets the pure-Python parts import (DiffSynth's data operators need them): `torchvision_shim.py`,
  installed at the top of this file, before `common` imports difftune's families (diffusers, transformers).
* Model classes: DiffSynth's `QwenImageDiT` and `QwenImageTextEncoder` hard-code the 20B/7B widths, so two
  subclasses change only `__init__` to the benchmark's widths; the weights are the same files difftune
  loads (DiffSynth reads the diffusers/transformers layouts; `load_state_dict(strict=True)` checks it).
* Prompt template: DiffSynth drops a hard-coded 34 template tokens, right for the real Qwen tokenizer. The
  benchmark's byte-level tokenizer turns the same system prompt into more tokens, so the extra ones are
  dropped as well: the DiT then sees exactly the prompt tokens difftune gives it (same work per step).

The payload's `device` ("cpu"), `dtype` ("float32") and `checkpointing` (false) choose where and how it trains
(benchmarks/gpu.py's `reference` part: "cuda", "bfloat16", both checkpointing settings).

Usage: `<diffsynth-venv>/bin/python benchmarks/peer_diffsynth.py --child '<json>'`; prints one BENCH_RESULT.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchvision_shim import install as torchvision_shim  # noqa: E402

torchvision_shim()  # before `common`: it imports difftune's families, which import diffusers and transformers

from common import LORA_TARGETS, child_main, status_kb  # noqa: E402


def build_pipeline(p: dict):
    import torch
    from diffsynth.models.general_modules import AdaLayerNorm, RMSNorm, TimestepEmbeddings
    from diffsynth.models.qwen_image_dit import QwenEmbedRope, QwenImageDiT, QwenImageTransformerBlock
    from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
    from diffsynth.models.qwen_image_vae import QwenImageVAE
    from diffsynth.pipelines.qwen_image import QwenImagePipeline
    from safetensors.torch import load_file
    from torch import nn

    spec, repo = p["spec"], Path(p["repo"])

    class BenchDiT(QwenImageDiT):
        def __init__(self):
            nn.Module.__init__(self)
            heads, head_dim, text = spec["num_attention_heads"], spec["attention_head_dim"], spec["text_hidden"]
            dim = heads * head_dim
            self.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(spec["axes_dims_rope"]), scale_rope=True)
            self.time_text_embed = TimestepEmbeddings(256, dim, diffusers_compatible_format=True, scale=1000,
                                                      align_dtype_to_timestep=False, use_additional_t_cond=False)
            self.txt_norm = RMSNorm(text, eps=1e-6)
            self.img_in, self.txt_in = nn.Linear(64, dim), nn.Linear(text, dim)
            self.transformer_blocks = nn.ModuleList([QwenImageTransformerBlock(dim=dim, num_attention_heads=heads,
                                                                               attention_head_dim=head_dim)
                                                     for _ in range(spec["num_layers"])])
            self.norm_out, self.proj_out = AdaLayerNorm(dim, single=True), nn.Linear(dim, 64)

    class BenchTextEncoder(QwenImageTextEncoder):
        def __init__(self, hf):
            nn.Module.__init__(self)
            self.model, self.lm_head, self.config = hf.model, hf.lm_head, hf.config

    def weights(folder: str) -> dict:
        out = {}
        for f in sorted((repo / folder).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    dtype, device = getattr(torch, p.get("dtype", "float32")), p.get("device", "cpu")
    pipe = QwenImagePipeline(device=device, torch_dtype=dtype)
    if "dit" in p["models"]:
        dit = BenchDiT()
        dit.load_state_dict(weights("transformer"), strict=True)
        pipe.dit = dit.to(device=device, dtype=dtype)
    if "text_encoder" in p["models"]:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(repo / "text_encoder"), torch_dtype=dtype)
        pipe.text_encoder = BenchTextEncoder(hf).to(device).eval()
        pipe.tokenizer = AutoTokenizer.from_pretrained(str(repo / "tokenizer"))
    if "vae" in p["models"]:
        vae = QwenImageVAE(base_dim=spec["vae_base_dim"], z_dim=16, dim_mult=list(spec["vae_dim_mult"]),
                           num_res_blocks=spec["vae_num_res_blocks"], temperal_downsample=[False, True, True])
        vae.load_state_dict(weights("vae"), strict=True)
        pipe.vae = vae.to(device=device, dtype=dtype).eval()
    return pipe


def prompt_drop_shim(extra: int) -> None:
    from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder

    encode = QwenImageUnit_PromptEmbedder.encode_prompt

    def encode_prompt(self, pipe, prompt):
        return [e[extra:] for e in encode(self, pipe, prompt)]

    QwenImageUnit_PromptEmbedder.encode_prompt = encode_prompt


def make_module(pipe, task: str, rank: int, checkpointing: bool = False):
    from diffsynth.diffusion.loss import FlowMatchSFTLoss
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    class BenchTrainingModule(DiffusionTrainingModule):
        """The documented shape: load + switch to training mode in __init__, units + loss in forward."""

        def __init__(self):
            super().__init__()
            self.pipe = pipe
            self.task = task
            self.switch_pipe_to_training_mode(pipe, lora_base_model="dit", lora_target_modules=LORA_TARGETS,
                                              lora_rank=rank, task=task)
            self.split_pipeline_units(task, pipe, None, "dit")

        def get_pipeline_inputs(self, data):
            image = data["image"]
            shared = {"input_image": image, "height": image.size[1], "width": image.size[0], "cfg_scale": 1,
                      "rand_device": self.pipe.device, "use_gradient_checkpointing": checkpointing,
                      "use_gradient_checkpointing_offload": False}
            return shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}

        def forward(self, data, inputs=None):
            if inputs is None:
                inputs = self.get_pipeline_inputs(data)
            inputs = self.transfer_data_to_device(inputs, self.pipe.device, self.pipe.torch_dtype)
            for unit in self.pipe.units:
                inputs = self.pipe.unit_runner(unit, self.pipe, *inputs)
            if self.task.endswith(":data_process"):
                return inputs
            return FlowMatchSFTLoss(self.pipe, **inputs[0], **inputs[1])

    return BenchTrainingModule()


def measure(p: dict) -> dict:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import accelerate
    import diffsynth  # noqa: F401  (the ~10 s import, before the baseline)
    from diffsynth.core.data import UnifiedDataset
    from diffsynth.diffusion.logger import ModelLogger
    from diffsynth.diffusion.runner import launch_data_process_task, launch_training_task

    record = {"step_stamps": [], "write_stamps": [], "loader_waits": []}
    cuda = p.get("device", "cpu") != "cpu"

    def stamp(*_):
        if cuda:  # a step ends when the GPU has done its work (as difftune's runs are timed)
            torch.cuda.synchronize()
        record["step_stamps"].append(time.perf_counter())

    register_optimizer_step_post_hook(stamp)
    save = torch.save

    def timed_save(*a, **k):  # stage 1 writes one .pth per sample with torch.save
        out = save(*a, **k)
        record["write_stamps"].append(time.perf_counter())
        return out

    torch.save = timed_save
    prompt_drop_shim(p["drop"] - 34)
    torch.manual_seed(0)
    record["rss_before_kb"] = status_kb("VmRSS")
    start = time.perf_counter()
    pipe = build_pipeline(p)
    task = p["task"]
    module = make_module(pipe, task, p["rank"], p.get("checkpointing", False))
    res = p["resolution"]
    if task.endswith(":train"):
        dataset = UnifiedDataset(base_path=p["cache"], metadata_path=None, repeat=p["repeat"])
    else:
        dataset = UnifiedDataset(
            base_path=p["data"], metadata_path=p["metadata"], repeat=1 if task.endswith(":data_process")
            else p["repeat"], data_file_keys=("image",),
            main_data_operator=UnifiedDataset.default_image_operator(base_path=p["data"], height=res, width=res))
    args = SimpleNamespace(learning_rate=1e-4, weight_decay=0.01, dataset_num_workers=0, save_steps=None,
                           num_epochs=p["epochs"], enable_model_cpu_offload=False,
                           enable_optimizer_cpu_offload=False, cpu_offload_split_threshold=None,
                           customized_optimizer=None, output_path=p["output"])
    logger = ModelLogger(p["output"], remove_prefix_in_ckpt="pipe.dit.")
    accelerator = accelerate.Accelerator(cpu=not cuda)
    if task.endswith(":data_process"):
        launch_data_process_task(accelerator, dataset, module, logger, args=args)
    else:
        launch_training_task(accelerator, dataset, module, logger, args=args)
    end = time.perf_counter()
    stamps = record["step_stamps"]
    record.update(start=start, end=end, run_seconds=end - start, vmhwm_kb=status_kb("VmHWM"),
                  steps=len(stamps), close_stamp=None)
    if cuda:
        record.update(gpu_peak_allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
                      gpu_peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20)
    return record


if __name__ == "__main__":
    child_main(measure)
