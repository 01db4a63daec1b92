"""Packed parameter files (harness.train.params_file): what is read back is what was written, bit for bit; the\nearlier forms are still read; a file of the other byte order is refused."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from harness.train import params_file
from harness.train.params_file import load_params, save_params


def test_packed_tensors_come_back_bitwise_with_their_names_shapes_and_dtypes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(7, generator=g).to(torch.bfloat16),
        "strided": torch.randn(4, 6, generator=g).t(),
        "b.bias": torch.tensor([float("nan"), -0.0, 1e-45]),
    }
    alone = {"one": torch.tensor(5.0).expand(1), "none": torch.tensor(5.0).expand(0)}  # stride 0, one per dtype
    save_params(tensors, tmp_path / "p.pt")
    back = load_params(tmp_path / "p.pt")
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        bits = [x.contiguous().view(-1).view(torch.uint8) for x in (back[name], t)]
        assert torch.equal(*bits), name  # every bit, NaN and -0.0 too
    for name, t in alone.items():  # a file of one tensor, as a gradient digest's part is
        save_params({name: t}, tmp_path / f"{name}.pt")
        assert torch.equal(load_params(tmp_path / f"{name}.pt")[name], t), name
    save_params({}, tmp_path / "none.pt")
    assert load_params(tmp_path / "none.pt") == {}


def test_a_plain_saved_dict_is_read_as_it_is(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    back = load_params(tmp_path / "plain.pt")
    assert list(back) == ["w"] and torch.equal(back["w"], torch.ones(2))


def test_a_file_of_the_earlier_pickled_form_is_read(tmp_path):
    flat = torch.arange(7.0)
    torch.save(("fsdp-harness packed tensors v1", ["a", "b"], [(2, 3), (1,)], [0, 0], [flat]), tmp_path / "v1.pt")
    back = load_params(tmp_path / "v1.pt")
    assert torch.equal(back["a"], flat[:6].view(2, 3)) and torch.equal(back["b"], flat[6:])


def test_a_file_from_a_machine_of_the_other_byte_order_is_refused(tmp_path, monkeypatch):
    other = "big" if sys.byteorder == "little" else "little"
    monkeypatch.setattr(params_file, "sys", types.SimpleNamespace(byteorder=other))  # written there
    save_params({"w": torch.ones(2)}, tmp_path / "p.pt")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=f"{other}-endian"):
        load_params(tmp_path / "p.pt")
