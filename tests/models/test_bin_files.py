"""`.bin` weight files: plain tensor state dicts (and the IP-Adapter releases' one level of them) are read through
torch.load(weights_only=True, mmap=True); anything else is refused in one line naming the file."""

import collections
import os

import numpy as np
import pytest
import torch

from difftune.errors import UserError
from difftune.models.detect import read_header
from difftune.models.files import iter_tensors, load_pth


def test_flat_bin_state_dict_is_read(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    state = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(4, dtype=torch.float16)}
    torch.save(state, path)
    got = dict(iter_tensors(path))
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    assert read_header(path) == {"a.weight": (2, 3), "b.bias": (4,)}


def test_nested_ip_adapter_layout_is_flattened(tmp_path):
    """InstantX's ip-adapter.bin / InfiniteYou's image_proj_model.bin: {"image_proj": {...}, "ip_adapter": {...}}."""
    path = tmp_path / "ip-adapter.bin"
    proj, kv = torch.randn(3, 2), torch.randn(5, 3)
    torch.save({"image_proj": {"proj.0.weight": proj}, "ip_adapter": {"0.to_k_ip.weight": kv}}, path)
    got = load_pth(path)
    assert set(got) == {"image_proj.proj.0.weight", "ip_adapter.0.to_k_ip.weight"}
    assert torch.equal(got["image_proj.proj.0.weight"], proj) and torch.equal(got["ip_adapter.0.to_k_ip.weight"], kv)


def test_bin_is_loaded_weights_only_and_memory_mapped(tmp_path, monkeypatch):
    path = tmp_path / "big.bin"
    torch.save({"w": torch.zeros(256, 256)}, path)
    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    assert load_pth(path)["w"].shape == (256, 256)
    assert calls and calls[0]["weights_only"] is True and calls[0]["mmap"] is True


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo should never run",))


@pytest.mark.parametrize("payload, why", [
    (collections.OrderedDict(), "state dict"),                          # empty
    ({"w": torch.zeros(2), "step": 3}, "state dict"),                   # a non-tensor value
    ([torch.zeros(2)], "list"),                                          # not a dict
    ({"a": {"b": {"c": torch.zeros(1)}}}, "state dict"),               # two levels deep
    ({"a": {"w": torch.zeros(1)}, "b": torch.zeros(1)}, "state dict"),  # mixed levels
])
def test_other_bin_contents_are_refused_in_one_line(tmp_path, payload, why):
    path = tmp_path / "model.bin"
    torch.save(payload, path)
    with pytest.raises(UserError) as e:
        load_pth(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and why in msg


def test_code_in_a_bin_is_never_run(tmp_path, capfd):
    path = tmp_path / "evil.bin"
    torch.save({"w": _Evil()}, path)
    with pytest.raises(UserError) as e:
        list(iter_tensors(path))
    assert str(path) in str(e.value) and "weights_only" in str(e.value) and "\n" not in str(e.value)
    assert "should never run" not in capfd.readouterr().out


def test_not_a_pickle_is_refused(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(UserError) as e:
        read_header(path)
    assert str(path) in str(e.value) and "pickle" in str(e.value)


def test_ckpt_still_refused(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"w": torch.zeros(1)}, path)
    with pytest.raises(UserError, match="refusing to load a pickle"):
        list(iter_tensors(path))


def test_random_bytes_named_as_the_ip_adapter_are_one_line(tmp_path):
    """Recognition of a file it cannot read ends in one line naming the file, whichever family tries it first."""
    from difftune.core.family import recognise
    from difftune.models.detect import as_model_config

    path = tmp_path / "FLUX.1-dev-IP-Adapter" / "ip-adapter.bin"
    path.parent.mkdir()
    path.write_bytes(np.random.RandomState(0).bytes(5000))
    with pytest.raises(UserError) as err:
        recognise([as_model_config(str(path))])
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{path}: not a plain tensor state dict")
