"""Speed control: the motion controller file recognised from its header, its output against the reference's
formula written out, and its residual on the DiT's block modulation."""

import copy

import pytest
import torch
import torch.nn.functional as F

from difftune.core.units import run_unit
from difftune.families.wan.dit_forward import wan_dit_forward
from difftune.families.wan.pipeline import WanVideoPipeline
from difftune.families.wan.speed_control import MOTION_CONTROLLER, WanSpeedControl, motion_time_residual
from support.wan.common import tiny_dit_kwargs
from support.wan.speed_control import tiny_motion_controller, write_tiny_speed_control
from difftune.models.detect import detect_component, match_header
from difftune.models.load import load_component


def test_released_and_tiny_files_are_recognised(tmp_path):
    header = {"linear.0.weight": (1536, 256), "linear.0.bias": (1536,), "linear.2.weight": (1536, 1536),
              "linear.2.bias": (1536,), "linear.4.weight": (9216, 1536), "linear.4.bias": (9216,)}
    match = match_header(header, [MOTION_CONTROLLER])
    assert match.label == "DiffSynth-Studio/Wan2.1-1.3b-speedcontrol-v1"
    path = write_tiny_speed_control(tmp_path / "DiffSynth-Studio" / "Wan2.1-1.3b-speedcontrol-v1")
    det = detect_component(str(path), [MOTION_CONTROLLER])
    assert det.name == "motion_controller" and det.config["dim"] == 16 and det.source.endswith("in the weights")
    loaded = load_component(str(path), [MOTION_CONTROLLER], torch_dtype=torch.float32).module
    expected = tiny_motion_controller().state_dict()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())
    assert match_header({**header, "linear.4.weight": (1536, 1536)}, [MOTION_CONTROLLER]) is None


def test_motion_controller_is_the_reference_formula():
    model = tiny_motion_controller()
    ids = torch.tensor([3.0, 40.0])
    # the reference: sinusoidal_embedding_1d(freq_dim, 10 * id) in float64 (cos, then sin), three Linear layers
    half = 8
    pos = (ids * 10).double()
    angles = torch.stack([pos * 10000 ** (-k / half) for k in range(half)], dim=1)
    emb = torch.cat([angles.cos(), angles.sin()], dim=1).float()
    w = [model.linear[i] for i in (0, 2, 4)]
    manual = F.linear(F.silu(F.linear(F.silu(F.linear(emb, w[0].weight, w[0].bias)), w[1].weight, w[1].bias)),
                      w[2].weight, w[2].bias)
    with torch.no_grad():
        assert (model(ids) - manual).abs().max() <= 1e-6
    model.zero_init()
    with torch.no_grad():
        assert torch.equal(model(ids), torch.zeros(2, 96))


def test_residual_moves_the_block_modulation_only():
    """A residual r on the blocks' modulation is the DiT with r added to time_proj's bias (the head reads the
    time embedding before that projection, so it is untouched)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    dit = WanTransformer3DModel(**tiny_dit_kwargs(2)).eval()
    controller = tiny_motion_controller()
    g = torch.Generator().manual_seed(1)
    x, t, text = torch.randn(1, 16, 2, 4, 6, generator=g), torch.tensor([400.0]), torch.randn(1, 5, 32, generator=g)
    with torch.no_grad():
        r = motion_time_residual(controller, torch.tensor([12.0]))
        shifted = copy.deepcopy(dit)
        shifted.condition_embedder.time_proj.bias += r[0]
        ours = wan_dit_forward(dit, x, t, text, timestep_proj_residual=r)
        assert (ours - shifted(x, t, text, return_dict=False)[0]).abs().max() <= 1e-5
        assert (ours - wan_dit_forward(dit, x, t, text)).abs().max() > 1e-4
    assert motion_time_residual(controller, None) is None and motion_time_residual(None, torch.ones(1)) is None


def test_speed_control_unit_reads_the_column_as_a_number():
    pipe = WanVideoPipeline(torch_dtype=torch.float32)
    assert torch.equal(run_unit(pipe, WanSpeedControl(), {"motion_bucket_id": "7", "batch_size": 1})
                       ["motion_bucket_id"], torch.tensor([7.0]))
    batch = run_unit(pipe, WanSpeedControl(), {"motion_bucket_id": ["2", 5], "batch_size": 2})
    assert torch.equal(batch["motion_bucket_id"], torch.tensor([2.0, 5.0]))
    with pytest.raises(Exception, match="motion_bucket_id 'fast'"):
        run_unit(pipe, WanSpeedControl(), {"motion_bucket_id": "fast", "batch_size": 1})


def test_motion_residual_unit_is_cached_unless_the_controller_trains():
    from difftune.core.graph import split_units
    from difftune.families.wan.speed_control import WanMotionResidual

    class Pipe(WanVideoPipeline):  # the slot the pipeline gains when speed control is wired in
        model_names = WanVideoPipeline.model_names + ("motion_controller",)

    pipe = Pipe(torch_dtype=torch.float32)
    controller = tiny_motion_controller()
    pipe.motion_controller = controller
    assert pipe.models["motion_controller"] is controller
    values = run_unit(pipe, WanSpeedControl(), {"motion_bucket_id": "5", "batch_size": 1})
    with torch.no_grad():
        residual = run_unit(pipe, WanMotionResidual(), values)["motion_residual"]
        assert torch.equal(residual, controller(torch.tensor([5.0])))
    units = [WanSpeedControl(), WanMotionResidual()]
    lora = split_units(units, ["dit"], ("motion_residual",), loss_models=("dit",))
    assert not lora.stage2 and lora.frontier == ("motion_residual",)
    full = split_units(units, ["motion_controller"], ("motion_residual",), loss_models=("dit",))
    assert [u.name for u in full.stage2] == ["WanMotionResidual"] and full.frontier == ("motion_bucket_id",)


def test_speed_control_is_one_module_and_one_line():
    """The feature registers its model with the family itself (recognition and --full_format original): the family
    package names none of it, the base pipeline lists it once."""
    from pathlib import Path

    import difftune.families.wan as wan
    from difftune.families.wan.speed_control import MOTION_CONTROLLER, SPEED_CONTROL

    assert MOTION_CONTROLLER in wan.FAMILY.components and wan.FAMILY.full_native_keys["motion_controller"] is dict
    assert SPEED_CONTROL in WanVideoPipeline.features and "motion_controller" in WanVideoPipeline.model_names
    folder = Path(wan.__file__).parent
    naming = sorted(p.name for p in folder.rglob("*.py") if "motion_controller" in p.read_text()
                    or "SPEED_CONTROL" in p.read_text() or "motion_bucket_id" in p.read_text())
    assert naming == ["pipeline.py", "speed_control.py"]
    assert sum("SPEED_CONTROL" in line for line in (folder / "pipeline.py").read_text().splitlines()) == 2  # import, list
