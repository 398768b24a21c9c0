"""`load_tensor`: a file of one tensor (ACE-Step's silence_latent.pt) read through torch.load(weights_only=True) or
safetensors; everything else refused in one line naming the file."""

import os

import pytest
import torch
from safetensors.torch import save_file

from difftune.errors import UserError
from difftune.models.files import load_tensor

SIDE_EFFECTS = []


class _Hostile:
    """Unpickling it would call _record (and through it anything else)."""

    def __reduce__(self):
        return (_record, ("unpickled",))


def _record(what):
    SIDE_EFFECTS.append(what)
    return what


def refused(path) -> str:
    with pytest.raises(UserError) as e:
        load_tensor(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_a_bare_tensor_is_read(tmp_path, suffix):
    path = tmp_path / f"silence_latent{suffix}"
    t = torch.randn(1, 64, 150)
    torch.save(t, path)
    got = load_tensor(path)
    assert got.dtype == torch.float32 and got.shape == (1, 64, 150) and torch.equal(got, t)


def test_a_dict_of_one_tensor_is_read(tmp_path):
    path = tmp_path / "latent.pt"
    t = torch.arange(6, dtype=torch.float16)
    torch.save({"latent": t}, path)
    assert torch.equal(load_tensor(str(path)), t)


def test_it_is_read_with_weights_only(tmp_path, monkeypatch):
    path = tmp_path / "latent.pt"
    torch.save(torch.zeros(2), path)
    calls, real = [], torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    load_tensor(path)
    assert calls == [{"map_location": "cpu", "weights_only": True}]


def test_a_one_tensor_safetensors_is_read(tmp_path):
    path = tmp_path / "latent.safetensors"
    t = torch.randn(1, 4, 5)
    save_file({"silence": t}, str(path))
    assert torch.equal(load_tensor(path), t)


def test_a_missing_file(tmp_path):
    assert "no such file" in refused(tmp_path / "silence_latent.pt")


@pytest.mark.parametrize("name", ["latent.ckpt", "latent.npy", "latent"])
def test_an_unknown_suffix(tmp_path, name):
    path = tmp_path / name
    torch.save(torch.zeros(1), path)
    msg = refused(path)
    assert ".pt" in msg and ".safetensors" in msg


def test_a_hostile_pickle_is_refused_and_never_run(tmp_path):
    path = tmp_path / "silence_latent.pt"
    torch.save({"latent": _Hostile()}, path)
    SIDE_EFFECTS.clear()
    msg = refused(path)
    assert "refused" in msg and "_record" in msg and "weights_only=True" in msg and "can run code" in msg
    assert SIDE_EFFECTS == []


def test_a_custom_class_object_is_refused(tmp_path):
    path = tmp_path / "silence_latent.pt"
    torch.save(_Record(), path)
    msg = refused(path)
    assert "refused" in msg and "_Record" in msg


class _Record:
    pass


def test_random_bytes_are_not_a_torch_file(tmp_path):
    path = tmp_path / "silence_latent.pt"
    path.write_bytes(os.urandom(256))
    assert "not a file torch.save wrote" in refused(path)


def test_a_cut_file_is_not_a_torch_file(tmp_path):
    path = tmp_path / "silence_latent.pt"
    torch.save(torch.zeros(1000), path)
    path.write_bytes(path.read_bytes()[:500])
    assert "not a file torch.save wrote" in refused(path)


def test_several_tensors(tmp_path):
    path = tmp_path / "latents.pt"
    torch.save({"a": torch.zeros(1), "b": torch.zeros(1), "c": torch.zeros(1), "d": torch.zeros(1)}, path)
    assert "holds 4 tensors (a, b, c...): expected one" in refused(path)


def test_several_tensors_in_a_safetensors(tmp_path):
    path = tmp_path / "latents.safetensors"
    save_file({"a": torch.zeros(1), "b": torch.zeros(1), "c": torch.zeros(1)}, str(path))
    assert "holds 3 tensors (a, b, c): expected one" in refused(path)


def test_an_empty_safetensors(tmp_path):
    path = tmp_path / "latents.safetensors"
    save_file({}, str(path))
    assert "holds no tensors" in refused(path)


def test_a_broken_safetensors(tmp_path):
    path = tmp_path / "latents.safetensors"
    path.write_bytes(os.urandom(256))
    assert "not a readable safetensors file" in refused(path)


@pytest.mark.parametrize("payload, says", [
    ([torch.zeros(1)], "holds a list, not a tensor"),
    (3, "holds an int, not a tensor"),
    ({}, "holds an empty dict"),
    ({"latent": torch.zeros(1), "step": 3}, "holds a dict of 2 entries (latent, step), not one tensor"),
    ({"latent": "zeros"}, "holds a dict whose one entry (latent) is a str, not a tensor"),
])
def test_a_non_tensor_object(tmp_path, payload, says):
    path = tmp_path / "latent.pt"
    torch.save(payload, path)
    assert says in refused(path)
