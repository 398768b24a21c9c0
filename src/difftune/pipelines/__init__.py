"""Model families: each is a pipeline class (units + model_fn) registered by name."""

from .base import BasePipeline, PipelineUnit, collate_values, run_unit, split_batch
from .graph import Split, split_units

ENTRY_POINT_GROUP = "difftune.families"
_REGISTERED: dict[str, type] = {}


def register_family(name: str, pipeline_cls: type) -> type:
    """Make a pipeline class available as `--family <name>` (call it when your family's module is imported)."""
    _REGISTERED[name] = pipeline_cls
    return pipeline_cls


def families() -> dict[str, type]:
    """Built-in families, then packages' `difftune.families` entry points, then `register_family` calls."""
    from importlib.metadata import entry_points

    from ..errors import UserError
    from .qwen_image import QwenImagePipeline

    found: dict[str, type] = {"qwen_image": QwenImagePipeline}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            found[ep.name] = ep.load()
        except Exception as err:  # a broken plugin must not hide behind a traceback of ours
            first = (str(err).strip().splitlines() or [""])[0]
            raise UserError(f"family '{ep.name}' (entry point {ep.value}): cannot be imported "
                            f"({type(err).__name__}: {first})") from err
    found.update(_REGISTERED)
    return found


def get_family(name: str | None) -> type:
    """The pipeline class of `--family` (default qwen_image); a UserError naming the known ones if unknown."""
    from ..errors import UserError

    known = families()
    if (name or "qwen_image") not in known:
        raise UserError(f"--family {name}: unknown family (known: {', '.join(sorted(known))})")
    return known[name or "qwen_image"]


__all__ = ["BasePipeline", "PipelineUnit", "Split", "collate_values", "families", "get_family", "register_family",
           "run_unit", "split_batch", "split_units"]
