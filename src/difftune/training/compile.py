"""`--compile`: the trained models' repeated blocks compiled with torch.compile (diffusers' regional compilation,
`ModelMixin.compile_repeated_blocks`). Each block compiles once per input shape, i.e. on the first step of each shape
bucket; gradient checkpointing wraps the compiled block (its recomputation runs the compiled code too), and the LoRA
layers inside are traced with it."""

from __future__ import annotations


def compile_blocks(pipe, slots, log=print) -> list[str]:
    """Compile the repeated blocks of the models in `slots` that declare them; returns the slots compiled."""
    done = []
    for slot in slots:
        model = pipe.models.get(slot)
        if model is None:
            continue
        blocks = list(getattr(model, "_repeated_blocks", None) or [])
        if not blocks or not hasattr(model, "compile_repeated_blocks"):
            log(f"compile: {slot} ({type(model).__name__}) declares no repeated blocks; it runs eagerly")
            continue
        model.compile_repeated_blocks(dynamic=False)
        count = sum(type(m).__name__ in blocks for m in model.modules())
        log(f"compile: {slot}'s {count} {'/'.join(blocks)} blocks compile on the first step of each shape bucket "
            f"(that step is slow; later steps of the bucket reuse it)")
        done.append(slot)
    return done
