"""Adapters: load_adapter's errors, user/CS336 forms, and W=1 bitwise equality with the reference."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.adapters import BUILTINS, AdapterError, load_adapter
from harness.train.data import global_batch, local_slice
from harness.train.models import get_model_spec

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = "suites.harness.unit.example_adapter"


def _module(tmp_path: Path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _error(name: str) -> str:
    with pytest.raises(AdapterError) as info:
        load_adapter(name)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, ValueError)
    return message


def test_unknown_name_lists_the_valid_ones():
    message = _error("fsdp3")
    assert "unknown adapter 'fsdp3'" in message
    assert all(name in message for name in BUILTINS) and "package.module:object" in message


def test_module_that_does_not_import_says_which_and_why(tmp_path, monkeypatch):
    assert "module 'no_such_pkg.mod' could not be imported: ModuleNotFoundError" in _error("no_such_pkg.mod:adapter")
    _module(tmp_path, monkeypatch, "broken_adapter", "raise RuntimeError('boom at import')\n")
    assert "'broken_adapter' could not be imported: RuntimeError: boom at import" in _error("broken_adapter:x")


def test_missing_object_and_missing_method_are_named(tmp_path, monkeypatch):
    mod = _module(
        tmp_path,
        monkeypatch,
        "half_adapter",
        """
        from harness.adapters.base import Adapter
        class NoFull(Adapter):
            def wrap(self, model, units, *, group, device): return model
        class Duck:
            def full_params(self, wrapped): return {}
    """,
    )
    assert f"module '{mod}' has no attribute 'missing'" in _error(f"{mod}:missing")
    assert "has no full_params() method" in _error(f"{mod}:NoFull")
    assert "has no wrap() method" in _error(f"{mod}:Duck")


def test_user_adapter_forms(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    instance, cls = load_adapter(f"{EXAMPLE}:adapter"), load_adapter(f"{EXAMPLE}:AllReduceAdapter")
    assert type(instance) is type(cls) and instance.name == "example_allreduce"
    mod = _module(
        tmp_path,
        monkeypatch,
        "duck_adapter",
        """
        class Duck:
            def wrap(self, model, units, *, group, device): return model
            def full_params(self, wrapped): return dict(wrapped.named_parameters())
        def make(): return Duck()
    """,
    )
    duck = load_adapter(f"{mod}:make")
    assert duck.sharded and duck.name == f"{mod}:make"
    model = get_model_spec("mlp").build()
    opt = duck.make_optimizer(model, name="sgd", lr=0.1)  # default filled in
    assert isinstance(opt, torch.optim.SGD) and duck.after_backward(model, opt) is None


def test_builtins_load_and_declare_sharding():
    for name in BUILTINS:
        assert load_adapter(name).name == name
    assert not load_adapter("ddp").sharded and not load_adapter("reference").sharded
    assert load_adapter("torch_fsdp2").sharded and load_adapter("fsdp_impl").sharded


def test_reference_full_params_are_copies_of_named_parameters():
    adapter, spec = load_adapter("reference"), get_model_spec("tinylm_tied")
    model = spec.build()
    wrapped = adapter.wrap(model, spec.units(model), group=None, device="cpu")
    full, named = adapter.full_params(wrapped), dict(model.named_parameters())
    assert full.keys() == named.keys() and "head.weight" not in full  # the tie appears once
    for name, p in named.items():
        assert torch.equal(full[name], p) and full[name].data_ptr() != p.data_ptr()


CS336_SOURCE = """
    import torch
    class Wrapper(torch.nn.Module):
        def __init__(self, module, compute_dtype):
            super().__init__()
            self.module, self.compute_dtype, self.synced = module, compute_dtype, 0
        def forward(self, x):
            return self.module(x)
    def get_fsdp(module, compute_dtype=None):
        return Wrapper(module, compute_dtype)
    def fsdp_on_after_backward(fsdp_model, optimizer):
        fsdp_model.synced += 1
    def fsdp_gather_full_params(fsdp_model):
        return {"module." + k: v for k, v in fsdp_model.module.named_parameters()}
"""


def test_cs336_adapter(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "cs336_fake", CS336_SOURCE)
    _module(tmp_path, monkeypatch, "cs336_partial", "def get_fsdp(module): return module\n")
    assert "has no fsdp_on_after_backward()" in _error("cs336:cs336_partial")
    assert "unknown compute dtype 'int8'" in _error(f"cs336:{mod}@int8")
    old_style = CS336_SOURCE.replace(
        "def get_fsdp(module, compute_dtype=None):\n        return Wrapper(module, compute_dtype)",
        "def get_fsdp(module):\n        return Wrapper(module, None)",
    )
    assert old_style != CS336_SOURCE
    _module(tmp_path, monkeypatch, "cs336_old", old_style)
    old = load_adapter("cs336:cs336_old@bf16")  # a get_fsdp without a compute_dtype parameter
    with pytest.raises(AdapterError, match="takes no compute_dtype"):
        old.wrap(get_model_spec("mlp").build(), [], group=None, device="cpu")
    assert (
        load_adapter("cs336:cs336_old").wrap(get_model_spec("mlp").build(), [], group=None, device="cpu").compute_dtype
        is None
    )
    adapter = load_adapter(f"cs336:{mod}@bf16")
    model = get_model_spec("mlp").build()
    wrapped = adapter.wrap(model, [], group=None, device="cpu")
    assert wrapped.compute_dtype is torch.bfloat16
    adapter.after_backward(wrapped, None)
    assert wrapped.synced == 1
    full = adapter.full_params(wrapped)
    assert full.keys() == dict(model.named_parameters()).keys()  # "module." stripped


@pytest.fixture
def world1(tmp_path):
    """A gloo world of one rank in this process, destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _train(impl: str, model_name: str, group, steps: int = 3, optimizer: str = "adamw"):
    spec, adapter = get_model_spec(model_name), load_adapter(impl)
    torch.manual_seed(0)
    model = spec.build()
    wrapped = adapter.wrap(model, spec.units(model), group=group, device="cpu")
    opt = adapter.make_optimizer(wrapped, name=optimizer, lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = global_batch(spec, 8, step, 0)
        x, y, _ = local_slice(x, y, 0, 1, "split")
        loss = spec.loss(wrapped(x), y)
        loss.backward()
        adapter.after_backward(wrapped, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses), adapter.full_params(wrapped)


W1_CASES = [
    ("torch_fsdp2", "mlp"),
    ("torch_fsdp2_fp64reduce", "mlp"),
    ("torch_fsdp1", "mlp"),
    ("ddp", "mlp"),
    (f"{EXAMPLE}:adapter", "mlp"),
    ("torch_fsdp2", "tinylm_tied"),
    ("torch_fsdp2", "tinylm"),
    ("torch_fsdp1", "tinylm_tied"),
    ("fsdp_impl", "mlp"),
]


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")  # FSDP1's W=1 notice
@pytest.mark.parametrize("impl, model_name", W1_CASES)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_world_size_one_is_bitwise_equal_to_reference(world1, impl, model_name, optimizer, monkeypatch):
    if impl == "fsdp_impl":
        pytest.importorskip("fsdp_impl", reason="fsdp_impl is not importable yet")
        if not hasattr(__import__("fsdp_impl"), "fully_shard"):
            pytest.skip("fsdp_impl.fully_shard is not written yet")
    monkeypatch.syspath_prepend(str(REPO))
    torch.use_deterministic_algorithms(True)
    try:
        ref_losses, ref = _train("reference", model_name, None, optimizer=optimizer)
        losses, full = _train(impl, model_name, world1, optimizer=optimizer)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not torch.equal(ref_losses[0], ref_losses[-1])  # it did train
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert full.keys() == ref.keys()
    diffs = {k: (full[k] - ref[k]).abs().max().item() for k in ref if not torch.equal(full[k], ref[k])}
    assert not diffs, f"not bitwise at W=1, max |diff| per parameter: {diffs}"
