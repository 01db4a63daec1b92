"""Does a CUDA norm of a gradient change with where it sits in memory? DDP (gradient_as_bucket_view) keeps each
.grad as a view at an offset of one flat bucket; the plain model's grads are their own allocations."""

import torch

torch.manual_seed(0)
dev = "cuda"
shapes = [(37, 24), (72, 24), (72,), (24, 72), (48, 24), (888,), (1152,), (1728,), (37, 37)]
for trial in range(3):
    ts = [torch.randn(s, device=dev) * 10 ** torch.randint(-4, 1, ()).item() for s in shapes]
    flat = torch.zeros(sum(t.numel() for t in ts) + 1, device=dev)
    views, off = [], 1  # offset 1 float: 4-byte aligned only
    for t in ts:
        v = flat[off : off + t.numel()].view(t.shape)
        v.copy_(t)
        views.append(v)
        off += t.numel()
    for name, fn in [("vector_norm", lambda x: torch.linalg.vector_norm(x, 2)), ("foreach_norm", None)]:
        if fn is None:
            a, b = torch._foreach_norm(ts, 2), torch._foreach_norm(views, 2)
        else:
            a, b = [fn(t) for t in ts], [fn(v) for v in views]
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
        print(
            trial,
            name,
            "tensors whose norm differs by placement:",
            diff,
            [(float(a[i]), float(b[i])) for i in diff[:3]],
        )
    ga = torch.nn.utils.get_total_norm(ts, 2.0)
    gb = torch.nn.utils.get_total_norm(views, 2.0)
    print(trial, "total norm", float(ga), float(gb), "equal" if torch.equal(ga, gb) else "DIFFERS")
