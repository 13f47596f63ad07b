"""The kernels torch launches for a piece of code, seen through a dispatch mode: each aten op that is not a view, with
the bytes it reads and writes and the shapes it makes. The simulator's kernel lists are checked against it
(tests/test_sim_eager.py, tests/test_sim_op_recompute.py). Named apart from the `kernels` package, which
transformers imports: tests/ is on sys.path under pytest."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten ops that make no kernel: views, and the lazy conjugate (a bit on the tensor, made real by the next op's copy)
VIEWS = {"view", "_unsafe_view", "transpose", "t", "expand", "unsqueeze", "view_as_complex", "view_as_real",
         "_reshape_alias", "permute", "alias", "detach", "squeeze", "_conj"}


def touched_bytes(t: torch.Tensor) -> int:
    """A tensor's bytes as a kernel touches them: a broadcast (stride 0) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


class Kernels(TorchDispatchMode):
    """`seen`: (aten op, bytes read, bytes written) per kernel; `made`: (aten op, its output shapes) per kernel."""

    def __init__(self):
        super().__init__()
        self.seen, self.made = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[1]
        if name not in VIEWS:
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
            self.seen.append((name, sum(map(touched_bytes, ins)), sum(map(touched_bytes, outs))))
            self.made.append((name, [tuple(t.shape) for t in outs]))
        return out


def same_kernels(priced, seen) -> None:
    """A priced kernel list (name, read, written) against the kernels seen: as many, with the same bytes each."""
    assert len(priced) == len(seen), ([k for k, _, _ in priced], [k for k, _, _ in seen])
    assert sorted((r, w) for _, r, w in priced) == sorted((r, w) for _, r, w in seen)
