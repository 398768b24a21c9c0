"""The Anima family (circlestone-labs/Anima's ComfyUI split files): its spec, found by the family scan."""

from ...core.family import FamilySpec, TokenizerSpec, text_tokenizer
from ...models.load import load_tokenizer
from ...parts.qwen3 import qwen3_tokenizer_problem
from .components import COMPONENTS, LORA_TARGET_MODULES, original_dit_keys
from .lora import from_kohya_original_names, from_original_names, original_names
from .pipeline import AnimaPipeline

REPO = "circlestone-labs/Anima"
T5_TOKENIZER = "stabilityai/stable-diffusion-3.5-large:tokenizer_3/"

FAMILY = FamilySpec(
    name="anima",
    pipeline=AnimaPipeline,
    components=COMPONENTS,
    tokenizers=(
        # the reference's defaults when a command names none
        text_tokenizer("tokenizer_path", "Qwen/Qwen3-0.6B:./", fits=qwen3_tokenizer_problem),
        TokenizerSpec(attr="tokenizer_t5xxl", slot="text_encoder", folder="tokenizer_3", load=load_tokenizer,
                      flag="tokenizer_t5xxl_path", default=T5_TOKENIZER,
                      help="The T5-XXL tokenizer whose token ids the Anima DiT's LLM adapter reads (no T5 model is "
                           f"loaded): a directory or model_id:folder/ (default: {T5_TOKENIZER})."),
    ),
    lora_target_modules=LORA_TARGET_MODULES,
    # the default file: diffusion_model.<released name> + .alpha, which ComfyUI, the reference's loader and diffusers'
    # Anima loader all read (docs/anima.md)
    lora_default_format="comfyui",
    lora_native_names=original_names,
    lora_converters=(from_original_names, from_kohya_original_names),
    full_native_keys={"dit": original_dit_keys},
    repositories=(REPO,),
    description="Anima (Cosmos-Predict2 MiniTrainDIT + LLM adapter: diffusers CosmosTransformer3DModel + "
                "AnimaTextConditioner; Qwen3-0.6B, Qwen-Image VAE)",
)

__all__ = ["AnimaPipeline", "FAMILY"]
