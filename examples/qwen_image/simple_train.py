"""A training script of your own on difftune's Python API: LoRA on Qwen-Image's DiT.

The shape is DiffSynth-Studio's `special/simple/train.py` (docs/api.md maps the names): a training module
that loads the pipeline and switches it to training mode in `__init__` and returns one sample's loss in
`forward`, a data set, a checkpoint logger, and the launcher.

    accelerate launch examples/qwen_image/simple_train.py            # Qwen/Qwen-Image, ./data/example_image_dataset
    python examples/qwen_image/simple_train.py --model_path DIR ...  # a local copy in the official layout

With the same settings it trains exactly what `difftune train --lora_base_model dit ...` trains.
"""

from __future__ import annotations

import argparse
import os

import accelerate
import torch

from difftune import (DiffusionTrainingModule, ModelConfig, ModelLogger, QwenImagePipeline, UnifiedDataset,
                      launch_training_task, sft_loss)

LORA_TARGETS = "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1"


class QwenImageTrainingModule(DiffusionTrainingModule):
    def __init__(self, device, model_id="Qwen/Qwen-Image", model_path=None, torch_dtype=torch.bfloat16,
                 lora_target_modules=LORA_TARGETS, lora_rank=32, use_gradient_checkpointing=True):
        super().__init__()
        # Load the pipeline: from the hub (or ./models/<model_id>), or from a local folder.
        if model_path:
            configs = [ModelConfig(os.path.join(model_path, folder)) for folder in ("transformer", "text_encoder", "vae")]
            tokenizer = ModelConfig(os.path.join(model_path, "tokenizer"))
        else:
            configs = [ModelConfig(model_id=model_id, origin_file_pattern=pattern) for pattern in (
                "transformer/diffusion_pytorch_model*.safetensors", "text_encoder/model*.safetensors",
                "vae/diffusion_pytorch_model.safetensors")]
            tokenizer = ModelConfig(model_id=model_id, origin_file_pattern="tokenizer/")
        self.pipe = QwenImagePipeline.from_pretrained(torch_dtype=torch_dtype, device=device, model_configs=configs,
                                                      tokenizer_config=tokenizer)
        # Switch to training mode: everything frozen except a LoRA on the DiT.
        self.switch_pipe_to_training_mode(self.pipe, lora_base_model="dit", lora_target_modules=lora_target_modules,
                                          lora_rank=lora_rank)
        self.use_gradient_checkpointing = use_gradient_checkpointing

    def forward(self, data):
        # Pre-process as inference would be called for this sample (self.pipe.training_inputs(data) does the same).
        image = data["image"]
        values = {"prompt": data["prompt"], "negative_prompt": "", "input_image": image,
                  "height": image.size[1], "width": image.size[0], "seed": None, "rand_device": "cpu",
                  "batch_size": 1}
        self.pipe.run_units(values)
        # The loss: its noise and timestep come from this sample's generator (seed, epoch, sample index).
        return sft_loss(self.pipe, values, self.generator, use_gradient_checkpointing=self.use_gradient_checkpointing)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="LoRA on Qwen-Image's DiT with difftune's Python API.")
    parser.add_argument("--model_id", default="Qwen/Qwen-Image")
    parser.add_argument("--model_path", default=None, help="A local Qwen-Image folder (transformer/, text_encoder/, vae/, tokenizer/).")
    parser.add_argument("--dataset_base_path", default="data/example_image_dataset")
    parser.add_argument("--dataset_metadata_path", default="data/example_image_dataset/metadata.csv")
    parser.add_argument("--dataset_repeat", type=int, default=50)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--output_path", default="models/toy_model")
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--num_epochs", type=int, default=1)
    parser.add_argument("--save_steps", type=int, default=None)
    parser.add_argument("--lora_rank", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch_dtype", choices=("bfloat16", "float32"), default="bfloat16")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    dtype = getattr(torch, args.torch_dtype)
    accelerator = accelerate.Accelerator(
        mixed_precision="bf16" if dtype == torch.bfloat16 else "no",
        kwargs_handlers=[accelerate.DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    dataset = UnifiedDataset(
        base_path=args.dataset_base_path,
        metadata_path=args.dataset_metadata_path,
        repeat=args.dataset_repeat,
        data_file_keys="image",
        main_data_operator=UnifiedDataset.default_image_operator(
            base_path=args.dataset_base_path, height=args.height, width=args.width,
            height_division_factor=16, width_division_factor=16,
        ),
    )
    torch.manual_seed(args.seed)  # the LoRA's initial weights
    model = QwenImageTrainingModule(accelerator.device, model_id=args.model_id, model_path=args.model_path,
                                    torch_dtype=dtype, lora_rank=args.lora_rank)
    model_logger = ModelLogger(output_path=args.output_path, remove_prefix_in_ckpt="pipe.dit.",
                               save_steps=args.save_steps)
    return launch_training_task(accelerator, dataset, model, model_logger, learning_rate=args.learning_rate,
                                num_epochs=args.num_epochs, seed=args.seed)


if __name__ == "__main__":
    main()
