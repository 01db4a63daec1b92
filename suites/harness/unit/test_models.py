"""Model zoo, data and optimizer factory: determinism, meta re-init identity, slicing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.optimizers import make_optimizer
from harness.train.data import global_batch, local_slice
from harness.train.models import MODELS, LMConfig, TransformerLM, get_model_spec, materialize_meta

SMALL = [
    "mlp",
    "mlp_frozen",
    "tinylm",
    "tinylm_tied",
    "tied_vocab33",
]  # gpt2_medium and lm_50m are only ever built on meta here


def _build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return get_model_spec(name).build()


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError, match="unknown model 'nope'") as info:
        get_model_spec("nope")
    assert all(name in str(info.value) for name in MODELS)


@pytest.mark.parametrize("name", SMALL)
def test_build_is_deterministic_in_seed(name):
    assert _same_params(_build(name, 0), _build(name, 0))
    assert not _same_params(_build(name, 0), _build(name, 1))


@pytest.mark.parametrize("name", SMALL)
def test_meta_build_then_reinit_reproduces_eager_init(name):
    eager = _build(name, 7)
    with torch.device("meta"):
        lazy = get_model_spec(name).build()
    assert all(p.is_meta for p in lazy.parameters())
    torch.manual_seed(7)
    materialize_meta(lazy)
    assert _same_params(eager, lazy)
    if isinstance(lazy, TransformerLM) and lazy.cfg.tied:
        assert lazy.head.weight is lazy.embed.weight  # the tie survives materialization


@pytest.mark.parametrize("name", list(MODELS))
def test_parameters_are_owned_by_leaves(name):
    """The init property: a module with parameters of its own has no parametrized descendant."""
    with torch.device("meta"):
        model = get_model_spec(name).build()
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert all(not any(True for _ in c.parameters()) for c in module.children())


def _expected_numel(cfg: LMConfig) -> int:
    d = cfg.d_model
    per_block = 2 * d + 4 * d * d + 3 * d * cfg.d_ff
    return cfg.vocab * d * (1 if cfg.tied else 2) + cfg.n_layers * per_block + d


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_count_matches_architecture(name):
    with torch.device("meta"):
        model = get_model_spec(name).build()
    numel = sum(p.numel() for p in model.parameters())
    if isinstance(model, TransformerLM):
        assert numel == _expected_numel(model.cfg)
    else:
        assert numel == sum(lin.in_features * lin.out_features + lin.out_features for lin in model.layers)


def test_mlp_frozen_is_the_mlp_with_its_first_layer_frozen():
    frozen, plain = _build("mlp_frozen", 0), _build("mlp", 0)
    assert _same_params(frozen, plain)  # the same init: freezing draws no random numbers
    assert [n for n, p in frozen.named_parameters() if not p.requires_grad] == ["layers.0.weight", "layers.0.bias"]
    spec = get_model_spec("mlp_frozen")
    x, y = global_batch(spec, 4, 1, 0)
    opt = make_optimizer(frozen.parameters(), "adamw", 1e-2)
    spec.loss(frozen(x), y).backward()
    opt.step()
    assert torch.equal(frozen.layers[0].weight, plain.layers[0].weight)
    assert not torch.equal(frozen.layers[1].weight, plain.layers[1].weight)


def test_mlp_sizes_do_not_divide_by_world_sizes():
    model = _build("mlp", 0)
    for p in model.parameters():
        assert all(p.numel() % w for w in (2, 3, 4, 8)), p.shape


def test_tied_vocab33s_vocabulary_is_its_only_uneven_parameter_and_its_tail_sits_before_the_last_rank_at_8():
    from fsdp_impl.sharding import row_range

    model = _build("tied_vocab33", 0)
    assert model.head.weight is model.embed.weight and model.embed.weight.shape[0] == 4 * 8 + 1
    uneven = {n for n, p in model.named_parameters() if any(p.shape[0] % w for w in (2, 4, 8))}
    assert uneven == {"embed.weight"}
    # 33 rows at 8 ranks: ranks 0-5 hold 5 rows each, rank 6 the last 3, rank 7 none
    assert [row_range(33, 8, r) for r in (5, 6, 7)] == [(25, 30), (30, 33), (33, 33)]


def test_only_tied_vocab33_puts_a_real_tail_before_the_last_rank():
    """The layout the mutant tail_before_last_dropped needs (a rank other than the last holding fewer rows
    than a full chunk) occurs in the zoo only for tied_vocab33's vocabulary at 8 ranks: elsewhere the mutant
    changes nothing, so a catch there is the model's doing."""
    from fsdp_impl.sharding import chunk_rows, local_rows

    found = set()
    for name in SMALL:
        for pname, p in _build(name, 0).named_parameters():
            for w in (2, 4, 8):
                rows = p.shape[0]
                if any(0 < local_rows(rows, w, r) < chunk_rows(rows, w) for r in range(w - 1)):
                    found.add((name, pname, w))
    assert found == {("tied_vocab33", "embed.weight", 8)}


@pytest.mark.parametrize("step", [1, 2, 3])
def test_tied_vocab33s_batch_holds_every_id_as_input_and_as_target(step):
    spec = get_model_spec("tied_vocab33")
    x, y = spec.make_batch(16, step, 0)
    assert set(x.flatten().tolist()) == set(y.flatten().tolist()) == set(range(33))
    # each row a progression mod 33 (learnable in context), its targets the inputs one place on
    assert torch.equal(x[:, 1:], y[:, :-1])
    stride = (x[:, 1] - x[:, 0]) % 33
    assert bool(((x[:, 2:] - x[:, 1:-1]) % 33 == stride.unsqueeze(1)).all())


def test_every_embedding_row_of_tied_vocab33_gets_a_gradient_through_its_tokens():
    """Not only through the tied head (whose softmax gives every row a gradient): the embedding lookup alone
    reaches every row, since every id is an input of every step."""
    spec, model = get_model_spec("tied_vocab33"), _build("tied_vocab33", 0)
    x, _ = spec.make_batch(16, 1, 0)
    model.embed(x).sum().backward()
    assert bool((model.embed.weight.grad.abs().sum(1) > 0).all())


def test_gpt2_medium_is_gpt2_medium_sized():
    with torch.device("meta"):
        model = get_model_spec("gpt2_medium").build()
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.vocab, cfg.context) == (24, 1024, 16, 50257, 1024)
    assert 330e6 < sum(p.numel() for p in model.parameters()) < 380e6
    x, y = get_model_spec("gpt2_medium").make_batch(2, 0, 0)
    assert x.shape == y.shape == (2, cfg.seq_len) and int(x.max()) < cfg.vocab


def test_lm_50m_has_at_least_50m_parameters():
    """The benchmark's big model (harness/bench/fsdp_vs_fsdp2.py): >= 50M parameters, untied, short
    sequences, one shard unit per block plus the embedding."""
    spec = get_model_spec("lm_50m")
    with torch.device("meta"):
        model = spec.build()
    assert 50e6 <= sum(p.numel() for p in model.parameters()) < 60e6
    assert not model.cfg.tied and len(spec.units(model)) == model.cfg.n_layers + 1
    x, y = spec.make_batch(2, 0, 0)
    assert x.shape == y.shape == (2, model.cfg.seq_len) and int(x.max()) < model.cfg.vocab


@pytest.mark.parametrize("name", list(MODELS))
def test_units_are_distinct_submodules(name):
    spec = get_model_spec(name)
    with torch.device("meta"):
        model = spec.build()
    units = spec.units(model)
    subs = [m for m in model.modules() if m is not model]
    assert units and all(any(u is m for m in subs) for u in units)
    assert len({id(u) for u in units}) == len(units)


@pytest.mark.parametrize("name", list(MODELS))
def test_make_batch_is_a_pure_function_of_step_and_seed(name):
    spec = get_model_spec(name)
    rng = torch.get_rng_state()
    a, b = spec.make_batch(8, 3, 5), spec.make_batch(8, 3, 5)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], spec.make_batch(8, 4, 5)[0])
    assert not torch.equal(a[0], spec.make_batch(8, 3, 6)[0])
    assert a[0].shape[0] == a[1].shape[0] == 8 and a[0].device.type == "cpu"


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_split_slices_partition_the_global_batch(world_size):
    x, y = global_batch(get_model_spec("tinylm"), 16, 0, 0)
    seen = []
    for rank in range(world_size):
        lx, ly, idx = local_slice(x, y, rank, world_size, "split")
        assert torch.equal(idx, torch.arange(rank, 16, world_size))
        assert torch.equal(lx, x[idx]) and torch.equal(ly, y[idx])
        seen.append(idx)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(16))


def test_replicated_slice_is_everything():
    x, y = global_batch(get_model_spec("mlp"), 12, 1, 0)
    lx, ly, idx = local_slice(x, y, 2, 4, "replicated")
    assert torch.equal(lx, x) and torch.equal(ly, y) and torch.equal(idx, torch.arange(12))


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 4, "split"), "divisible"),
        ((0, 2, "shuffled"), "unknown data mode"),
        ((4, 4, "split"), "outside world size"),
    ],
)
def test_local_slice_rejects_bad_arguments(args, match):
    x, y = global_batch(get_model_spec("mlp"), 6, 0, 0)
    with pytest.raises(ValueError, match=match):
        local_slice(x, y, *args)


@pytest.mark.parametrize("name", SMALL)
def test_loss_is_finite_and_every_trainable_parameter_gets_a_gradient(name):
    spec, model = get_model_spec(name), _build(name, 0)
    x, y = spec.make_batch(4, 0, 0)
    loss = spec.loss(model(x), y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        if not p.requires_grad:  # frozen (mlp_frozen): no gradient at all
            assert p.grad is None, pname
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", SMALL)
def test_training_lowers_the_loss(name):
    """The 'loss must fall' check of split mode relies on the zoo being learnable."""
    spec, model = get_model_spec(name), _build(name, 0)
    opt = make_optimizer(model.parameters(), "adamw", 1e-2)
    probe = spec.make_batch(16, 10_000, 0)
    before = spec.loss(model(probe[0]), probe[1]).item()
    for step in range(20):
        x, y = spec.make_batch(16, step, 0)
        spec.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert spec.loss(model(probe[0]), probe[1]).item() < before


def test_make_optimizer():
    params = list(_build("mlp", 0).parameters())
    adamw, sgd = make_optimizer(params, "adamw", 0.1), make_optimizer(params, "sgd", 0.2)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(sgd, torch.optim.SGD)
    assert adamw.defaults["weight_decay"] == 0.01 and adamw.defaults["foreach"] is False
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 0.2
    with pytest.raises(ValueError, match="unknown optimizer 'adam'; valid: adamw, sgd"):
        make_optimizer(params, "adam", 0.1)
