"""The fixed binary tree over an index, in which batch-invariant training adds its partial sums (invariant.py):
leaves in index order, pairs (0, 1), (2, 3), ..., then pairs of those. Floating-point addition is commutative, so
only the grouping could differ between world sizes, and the tree fixes it. A leaf module: the unit's gradient
reduction (group.py) and the cross-rank collective (collectives.py) both sum in it."""

from __future__ import annotations

import torch


class TreeSum:
    """Tensors pushed in index order, added in the fixed binary tree over that index: each new tensor is a leaf,
    and two adjacent subtrees of the same size merge (left + right) as soon as both are complete. A None is a
    zero (a parameter that got no gradient in a micro-batch). After 2^k pushes one sum is left."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, torch.Tensor | None]] = []  # (leaves under it, its sum)

    def push(self, t: torch.Tensor | None) -> None:
        size, node = 1, t
        while self.stack and self.stack[-1][0] == size:
            _, left = self.stack.pop()
            node = left if node is None else node if left is None else left.add_(node)
            size *= 2
        self.stack.append((size, node))

    def __len__(self) -> int:
        return sum(n for n, _ in self.stack)

    def result(self) -> torch.Tensor | None:
        """The sum; ValueError unless the pushes made one complete tree (a power of two of them)."""
        if len(self.stack) != 1:
            raise ValueError(
                f"batch-invariant sum: {len(self)} micro-batches do not make one binary tree "
                f"(their number per rank must be a power of two)"
            )
        ((_, total),) = self.stack
        self.stack = []
        return total


def tree_sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The sum of `rows` (R x ..., R a power of two) in the fixed binary tree over the row index."""
    if rows.shape[0] & (rows.shape[0] - 1):
        raise ValueError(f"tree_sum_rows: {rows.shape[0]} rows are not a power of two")
    while rows.shape[0] > 1:
        rows = rows[0::2] + rows[1::2]
    return rows[0]
