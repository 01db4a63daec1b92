"""Evidence for [Note: trajectory replayed] (harness/core/policy.py): how far the order of summing the same slice
gradients moves a standard model under AdamW, with no sharding code at all.

    python reports/sweep/summation_orders.py encoder_lm 5 8     # model, seed, ranks (2 micro-batches each)

One process trains five copies of the model from the same start on the same batches: the full batch (2
micro-batches, as the accum reference), and four correct split computations that sum the same W x 2 slice
gradients in different orders: rank order (the noise probe), reversed (the other probe), pass-major (all ranks'
micro-batch m, then the passes: how FSDP2 and DDP reduce under accumulation) and a ring order per dim-0 chunk
(chunk c summed from rank c + 1 on, as a ring reduce-scatter may). It prints, at steps 1, 5 and 10, each order's
largest |param diff| from the full batch outside the attention input biases (whose key part is known to be
model-sensitive), and at the end the row of layers.0.linear1.weight that moved most with its full-batch gradient
at every step; and, at each step, every input of layers.0's ReLU that lies on the other side of zero in the full
batch's and the rank order's trajectories. Seen on AVX2 at seed 5: at step 7 unit 4's input for token 185 is
+4.1e-8 in the full batch's trajectory and -8.9e-8 in the rank order's (the kink crossed: rounding-sized parameter
differences, 1.5e-8, put one token on either side); from step 8 that unit's row parts by 1.8e-4, 5.8e-4 by step 10,
100x any other row, in every order, while its gradient was ordinary at every step (a noise-level gradient it is
not).
"""

import sys

import torch

from harness.train.features import rank_slices
from harness.train.optim import make_optimizer
from harness.train.standard_models import STANDARD_MODELS

MODEL, SEED, W = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
K, STEPS, LR, BATCH = 2, 10, 1e-2, 16
SPEC = STANDARD_MODELS[MODEL]
HOWS = ("rank", "reverse", "passmajor", "ring")


def build():
    torch.manual_seed(SEED)
    return SPEC.build()


def slice_grads(model, x, y):
    """[r][m] -> {name: gradient} of slice r's micro-batch m, its loss scaled by 1 / (W K)."""
    out = []
    for xs, ys in rank_slices(x, y, W):
        row = []
        for xm, ym in rank_slices(xs, ys, K):
            model.zero_grad(set_to_none=True)
            (SPEC.loss(model(xm), ym) / (W * K)).backward()
            row.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        out.append(row)
    return out


def full_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    for xm, ym in rank_slices(x, y, K):
        (SPEC.loss(model(xm), ym) / K).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def in_order(ts):
    acc = ts[0].clone()
    for t in ts[1:]:
        acc = acc + t
    return acc


def summed(g, name, how):
    pairs = [(r, m) for r in range(W) for m in range(K)]
    if how == "rank":
        return in_order([g[r][m][name] for r, m in pairs])
    if how == "reverse":
        return in_order([g[r][m][name] for r, m in reversed(pairs)])
    first = g[0][0][name]
    if how == "passmajor" or first.dim() == 0 or first.shape[0] < W:
        return in_order([in_order([g[r][m][name] for r in range(W)]) for m in range(K)])
    rows, out = -(-first.shape[0] // W), torch.empty_like(first)
    for c in range(W):
        part = slice(c * rows, min((c + 1) * rows, first.shape[0]))
        if part.start < first.shape[0]:
            ring = [(c + 1 + i) % W for i in range(W)]
            out[part] = in_order([in_order([g[r][m][name][part] for r in ring]) for m in range(K)])
    return out


def relu_sides(x):
    """(unit, token, full batch's input, rank order's input) for each input of layers.0's ReLU (its linear1's
    output) that lies on the other side of zero in the two trajectories, the parameters the step starts from."""
    seen = {}
    for h in ("full", "rank"):
        layer = getattr(models[h], "layers", [None])[0]
        if not hasattr(layer, "linear1"):
            return []
        hook = layer.linear1.register_forward_hook(lambda mod, a, out, h=h: seen.setdefault(h, out.detach()))
        with torch.no_grad():
            models[h](x)
        hook.remove()
    a, b = (seen[h].reshape(-1, seen[h].shape[-1]) for h in ("full", "rank"))
    return [
        (int(u), int(t), f"{float(a[t, u]):.3g}", f"{float(b[t, u]):.3g}")
        for t, u in ((a > 0) != (b > 0)).nonzero().tolist()
    ]


models = {h: build() for h in ("full",) + HOWS}
optimizers = {h: make_optimizer(list(m.parameters()), "adamw", LR) for h, m in models.items()}
history = []
for step in range(1, STEPS + 1):
    x, y = SPEC.make_batch(BATCH, step, SEED)
    g = full_grads(models["full"], x, y)
    history.append(g)
    for n, p in models["full"].named_parameters():
        p.grad = g.get(n)
    for how in HOWS:
        parts = slice_grads(models[how], x, y)
        for n, p in models[how].named_parameters():
            p.grad = summed(parts, n, how) if n in parts[0][0] else None
    kinks = relu_sides(x)
    if kinks:
        print(
            f"step {step}: the full batch's and the rank order's ReLU inputs in layers.0 on either side of 0: {kinks}"
        )
    for opt in optimizers.values():
        opt.step()
    if step in (1, 5, 10):
        full = dict(models["full"].named_parameters())
        worst = {
            h: max(
                (float((p - full[n]).detach().abs().max()), n)
                for n, p in models[h].named_parameters()
                if "in_proj_bias" not in n
            )
            for h in HOWS
        }
        print(step, " | ".join(f"{h} {d:.3g} {n}" for h, (d, n) in worst.items()))
name = "layers.0.linear1.weight"
if name in history[0]:
    diff = (
        (dict(models["rank"].named_parameters())[name] - dict(models["full"].named_parameters())[name]).detach().abs()
    )
    row = int(diff.max(1).values.argmax())
    print(
        f"{name}: row {row} moved {float(diff[row].max()):.3g} (next rows: "
        f"{[round(float(v), 7) for v in diff.max(1).values.topk(4).values[1:]]}); its full-batch gradient, largest "
        f"|element| per step: {[f'{float(h[name][row].abs().max()):.2g}' for h in history]}"
    )
