"""The feature registry and the one composable wrap (harness.core.features, harness.adapters.base): what an adapter
declares decides which features and compositions it runs, an adapter of the deprecated protocol keeps running
what each of its one-setting wraps stands for alone, and the docs' feature table is the registry's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.adapters import load_adapter
from harness.adapters.base import PLAIN_WRAP, Adapter, AdapterError, WrapOptions, call_wrap, missing_capability
from harness.core.features import (
    FEATURES,
    REGISTRY,
    WRAP_SETTINGS,
    check_feature,
    conflicting_pairs,
    docs_table,
    parts,
    wrap_settings,
)

ROOT = Path(__file__).resolve().parents[3]
WRAPPED = [name for name in FEATURES if REGISTRY[name].wrap]  # bf16, hsdp, reshard2, shard1, offload
PAIRS = [f"{a}+{b}" for i, a in enumerate(WRAPPED) for b in WRAPPED[i + 1 :]]


class Recording(Adapter):
    """An adapter of the deprecated protocol: one method per wrap setting, each recording what it was given."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def wrap(self, model, units, *, group, device):
        self.calls.append(("wrap", {}))
        return model

    def full_params(self, wrapped):
        return {}


for _setting, _method in WRAP_SETTINGS.items():

    def _legacy(self, model, units, *, _m=_method, **kw):
        self.calls.append((_m, kw))
        return model

    setattr(Recording, _method, _legacy)


class OneSetting(Adapter):
    """The composable wrap, declaring one setting."""

    name = "one_setting"
    wrap_settings = frozenset({"mixed_precision"})

    def wrap(self, model, units, *, group, device, options=PLAIN_WRAP):
        return model

    def full_params(self, wrapped):
        return {}


def test_the_docs_feature_table_is_the_registrys():
    page = (ROOT / "docs" / "features.md").read_text(encoding="utf-8")
    assert docs_table() in page


def test_wrap_settings_compose_and_only_one_scheme_each_is_refused():
    for pair in PAIRS:
        assert set(parts(check_feature(pair))) == set(pair.split("+")), pair
    assert sorted(conflicting_pairs()) == [("accum", "no_sync"), ("clip", "clip_inf")]
    for a, b in conflicting_pairs():
        with pytest.raises(ValueError, match="cannot be composed"):
            check_feature(f"{a}+{b}")
    assert wrap_settings("bf16+hsdp+offload") == ("mixed_precision", "hybrid", "offload")


@pytest.mark.parametrize("impl", ["fsdp_impl", "torch_fsdp2"])
def test_fsdp_impl_and_fsdp2_take_every_wrap_composition_their_implementation_takes(impl):
    adapter = load_adapter(impl)
    refused = {pair: missing_capability(adapter, pair) for pair in PAIRS + ["bf16+hsdp+offload"]}
    expected = {"reshard2+shard1"} if impl == "torch_fsdp2" else set()
    assert {p for p, why in refused.items() if why} == expected, refused
    if expected:  # refused with FSDP2's own reason, not the harness's
        assert "post-forward mesh assumes dim 0" in refused["reshard2+shard1"]


def test_an_adapter_of_the_deprecated_protocol_runs_each_setting_alone_and_no_pair():
    adapter = Recording()
    assert all(missing_capability(adapter, f) is None for f in WRAPPED)
    why = missing_capability(adapter, "bf16+hsdp")
    assert why and "deprecated" in why and "wrap_mixed_precision()" in why and "wrap_hybrid()" in why


def test_a_composable_wrap_runs_what_it_declares_and_names_what_it_does_not():
    adapter = OneSetting()
    assert missing_capability(adapter, "bf16") is None and missing_capability(adapter, "bf16+accum") is None
    why = missing_capability(adapter, "bf16+hsdp")
    assert why and "'hybrid'" in why and "mixed_precision" in why
    assert "'offload'" in missing_capability(adapter, "offload")


def test_ddp_runs_no_wrap_setting_and_says_so():
    ddp = load_adapter("ddp")
    for feature in WRAPPED:
        why = missing_capability(ddp, feature)
        assert why and WRAP_SETTINGS[REGISTRY[feature].wrap] + "()" in why, (feature, why)


def test_call_wrap_hands_each_deprecated_method_what_it_took():
    model = torch.nn.Linear(2, 2)
    group, device = object(), torch.device("cpu")
    placement = lambda p: None  # noqa: E731
    cases = {
        "wrap_mixed_precision": (
            WrapOptions(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
        ),
        "wrap_hybrid": (
            WrapOptions(shard_group="s", replicate_group="r"),
            {"shard_group": "s", "replicate_group": "r"},
        ),
        "wrap_reshard_after_forward": (WrapOptions(reshard_after_forward=2), {"reshard_after_forward": 2}),
        "wrap_shard_placement": (WrapOptions(shard_placement_fn=placement), {"shard_placement_fn": placement}),
        "wrap_offload": (WrapOptions(offload=True), {}),
    }
    for method, (options, given) in cases.items():
        adapter = Recording()
        assert call_wrap(adapter, model, [], group=group, device=device, options=options) is model
        assert adapter.calls == [(method, {"group": group, "device": device, **given})], method
    adapter = Recording()
    call_wrap(adapter, model, [], group=group, device=device, options=WrapOptions(micro_batches=2, clip=(2.0, 0.1)))
    assert adapter.calls == [("wrap", {})]  # the step's settings ask nothing of a wrap that leaves the step alone
    with pytest.raises(AdapterError, match="one wrap"):
        call_wrap(
            adapter, model, [], group=group, device=device, options=WrapOptions(offload=True, reshard_after_forward=2)
        )
