"""Decayed score matrices inside a chunk, without ever evaluating `exp(+large)`.

The chunk algorithm (`chunked.py`) needs, for row vectors `x_r` and column vectors
`y_c` of one chunk,

    P[r, c] = x_r^T diag(exp(G_r - G_c)) y_c      for the pairs where r sees c, else 0,

with `G` the within-chunk cumulative log-gate (non-increasing, since log-gates are <= 0),
here in log2 units: decays are `exp2` of differences of `G` (`chunked.LOG2_E` says why).
Rows are either the chunk's sub-steps (`"substeps"`: `c` strictly before `r`) or its
tokens' read-outs (`"queries"`: every sub-step of the token and before). Every path
needs the scores of all its row operands (`q`; `k`) against all its column operands
(`w`; `a`), so `score_matrices` makes them together.

The usual factorization `(x_r exp(G_r)) . (y_c exp(-G_c))` overflows for strong decays
(`exp(-G_c)` grows with the decay accumulated since the chunk's start). Here every
exponent is <= 0:

- no gate / scalar gate: one matmul `x y^T` times the ratio matrix `exp(G_r - G_c)`,
  whose exponent is masked to `-inf` before `exp` wherever `r` does not see `c` (no gate:
  a constant 0/1 mask, cached per shape);
- channel gate: the ratio depends on the key channel, so it cannot multiply a matmul
  afterwards. Dyadic splitting keeps it in matmuls: the pairs "row in the second half,
  column in the first half" of a block of `2m` tokens all straddle the block's midpoint
  `ref` (the last sub-step of the first half), and there

      exp(G_r - G_c) = exp(G_r - G_ref) * exp(G_ref - G_c),   both exponents <= 0,

  so that quarter of the block is one matmul of rescaled rows and columns. Recursing on
  both halves down to single tokens covers every pair; within one token there is no gate
  between sub-steps (the gate sits at its first sub-step, inside both `G`s), so the leaf
  blocks are plain `x y^T` products. `log2(tokens)` levels, each one batched matmul,
  together about half the multiply-adds of the dense `[rows, K] @ [K, L]` product (only
  the lower triangle is formed), plus `O(L K log L)` elementwise work. Tokens per chunk
  must be a power of two.

  On CPU that elementwise work, not the matmuls, decides the speed, so it is organised
  to touch memory few times: the operands are stacked once (`[..., L, R, K]` rows,
  `[..., L, C, K]` columns), so that each level rescales every row operand with one
  multiplication, every column operand with one, and forms all `R x C` cross products
  with one matmul. A level's factors are the two half-block tensors it needs, not a full
  one; at the lowest level the column factor is exactly 1 (the columns are the token
  `ref` belongs to, with no gate after its first sub-step) and is skipped. With
  `n_h == 1` the read-outs sit at the sub-step positions, so `q` joins `k` as a row
  operand of the same stack.

Shapes: row operands `[..., Ct*nr, K]` (`nr = n_h` for sub-steps, 1 for queries), column
operands `[..., L, K]`, `G` `[..., L]` (scalar) or `[..., L, K]` (channel) or None, `L =
Ct*n_h`; a score matrix is `[..., Ct*nr, L]`.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

Tensor = torch.Tensor
Rows = Literal["substeps", "queries"]


def baddmm(input: Tensor, x: Tensor, y: Tensor, *, alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """`beta * input + alpha * (x @ y)` in one matmul call (MKL's `beta`/`alpha`), for any
    number of leading batch dimensions; `input` may be a 0-dim tensor when `beta == 0`
    (then it is never read), so a scaled product costs no extra pass."""
    batch, rows, cols = x.shape[:-2], x.shape[-2], y.shape[-1]
    if input.dim() > 0:
        input = input.reshape(-1, rows, cols)
    out = torch.baddbmm(input, x.reshape(-1, rows, x.shape[-1]), y.reshape(-1, *y.shape[-2:]), alpha=alpha, beta=beta)
    return out.view(*batch, rows, cols)


def scaled_bmm(x: Tensor, y: Tensor, alpha: float) -> Tensor:
    """`alpha * (x @ y)` in one matmul call."""
    return baddmm(x.new_zeros(()), x, y, alpha=alpha, beta=0.0)


@functools.lru_cache(maxsize=64)
def _visibility(rows: Rows, ct: int, n_h: int, device: torch.device) -> Tensor:
    """`[Ct*nr, Ct*n_h]` bool: which column sub-steps each row sees (cached per shape)."""
    cols = torch.arange(ct * n_h, device=device)
    if rows == "substeps":
        return cols[:, None] > cols[None, :]
    token = torch.arange(ct, device=device)
    return (cols[None, :] // n_h) <= token[:, None]


@functools.lru_cache(maxsize=64)
def _mask(rows: Rows, ct: int, n_h: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """No gate: the visibility mask as numbers, 1 where visible, else 0."""
    return _visibility(rows, ct, n_h, device).to(dtype)


def _ratio_scores(G: Tensor | None, ct: int, n_h: int, rows: list[tuple[Tensor, Rows]], cols: list[Tensor]) -> list[list[Tensor]]:
    """No gate or scalar gate: `(x @ y^T) * ratio`, one ratio matrix per kind of rows."""
    ratios = {}
    for _, kind in rows:
        if kind in ratios:
            continue
        if G is None:
            ratios[kind] = _mask(kind, ct, n_h, cols[0].device, cols[0].dtype)
        else:
            g_rows = G if kind == "substeps" else G[..., n_h - 1 :: n_h]
            exponent = (g_rows[..., :, None] - G[..., None, :]).masked_fill_(~_visibility(kind, ct, n_h, G.device), float("-inf"))
            ratios[kind] = torch.exp2(exponent)
    return [[(x @ y.transpose(-1, -2)) * ratios[kind] for y in cols] for x, kind in rows]


# ---------------------------------------------------------------------------------------
# Channel gate: dyadic splitting


def _levels(ct: int) -> list[int]:
    """Block half-sizes m = 1, 2, .., Ct/2 (tokens) of the dyadic levels."""
    return [1 << level for level in range(ct.bit_length() - 1)]


def _halves(x: Tensor, batch_dims: int, m: int, per_token: int) -> tuple[Tensor, Tensor]:
    """`x` `[*batch, Ct*per_token, *rest]` -> the first and the second half of every
    2m-token block, `[*batch, nb, m*per_token, *rest]` each (views)."""
    shape = x.shape
    blocks = x.view(*shape[:batch_dims], -1, 2, m * per_token, *shape[batch_dims + 1 :])
    return blocks.select(batch_dims + 1, 0), blocks.select(batch_dims + 1, 1)


def _stack(operands: list[Tensor]) -> Tensor:
    """`[..., P, K]` operands at the same positions -> `[..., P, S, K]` (a copy only when S > 1)."""
    return torch.stack(operands, dim=-2) if len(operands) > 1 else operands[0].unsqueeze(-2)


def _place_leaves(out: Tensor, x: Tensor, Y: Tensor, kind: Rows, ct: int, n_h: int) -> None:
    """Write the within-token pairs of row operand `x` `[*batch, Ct*nr, K]` against the
    stacked columns `Y` `[*batch, L, C, K]` into its matrices `out` `[C, *batch, Ct*nr, L]`:
    plain products, no gate inside a token (none when rows are single sub-steps)."""
    nr = n_h if kind == "substeps" else 1
    if kind == "substeps" and n_h == 1:
        return
    *batch, _, C, K = Y.shape
    nd = len(batch)
    leaves = (x.reshape(*batch, ct, nr, 1, 1, K) * Y.reshape(*batch, ct, 1, n_h, C, K)).sum(-1)  # [*batch, Ct, nr, n_h, C]
    if kind == "substeps":  # strictly earlier sub-steps only
        leaves = leaves * _mask("substeps", 1, n_h, Y.device, Y.dtype)[:, :, None]
    token_pairs = torch.diagonal(out.view(C, *batch, ct, nr, ct, n_h), dim1=nd + 1, dim2=nd + 3)  # [C, *batch, nr, n_h, Ct]
    token_pairs.copy_(leaves.permute(nd + 3, *range(nd), nd + 1, nd + 2, nd))


def _dyadic_scores(G: Tensor, ct: int, n_h: int, rows: list[tuple[Tensor, Rows]], cols: list[Tensor]) -> list[list[Tensor]]:
    """Channel-gate scores by dyadic splitting (module docstring)."""
    if ct & (ct - 1):
        raise ValueError(f"channel-gate scores need a power-of-two number of tokens per chunk, got {ct}")
    *batch, _, K = G.shape
    nd, C = len(batch), len(cols)
    Y = _stack(cols)  # [*batch, L, C, K]
    # Row groups: operands at the same positions, `per` of them per token (sub-steps, or
    # the read-outs at each token's last sub-step; one group when n_h == 1).
    members: dict[int, list[int]] = {}
    for i, (_, kind) in enumerate(rows):
        members.setdefault(n_h if kind == "substeps" else 1, []).append(i)
    groups = []  # (per, stacked rows [*batch, Ct*per, R, K], G at the rows, out [R, C, *batch, Ct*per, L])
    for per, indices in members.items():
        out = G.new_zeros(len(indices), C, *batch, ct * per, ct * n_h)
        for r, i in enumerate(indices):
            _place_leaves(out[r], rows[i][0], Y, rows[i][1], ct, n_h)
        G_rows = G if per == n_h else G[..., n_h - 1 :: n_h, :]
        groups.append((per, _stack([rows[i][0] for i in indices]), G_rows, out))

    # Level m: rows of each block's second half against columns of its first half.
    for m in _levels(ct):
        G_first, _ = _halves(G, nd, m, n_h)
        ref = G_first[..., -1:, :]  # [*batch, nb, 1, K]
        Y_first, _ = _halves(Y, nd, m, n_h)  # [*batch, nb, m*n_h, C, K]
        if m > 1:  # at m == 1 the columns are ref's own token: exp2(G_ref - G_c) == 1
            Y_first = Y_first * torch.exp2_(ref - G_first)[..., None, :]
        Y_hat = Y_first.reshape(*batch, -1, m * n_h * C, K)
        for per, X, G_rows, out in groups:
            R = X.shape[-2]
            _, X_second = _halves(X, nd, m, per)
            _, G_second = _halves(G_rows, nd, m, per)
            X_hat = (X_second * torch.exp2_(G_second - ref)[..., None, :]).reshape(*batch, -1, m * per * R, K)
            cross = (X_hat @ Y_hat.transpose(-1, -2)).view(*batch, -1, m * per, R, m * n_h, C)
            # out's pairs (second-half rows, first-half columns) of the same block:
            blocks = out.view(R, C, *batch, -1, 2, m * per, ct // (2 * m), 2, m * n_h)
            same_block = torch.diagonal(blocks, dim1=nd + 2, dim2=nd + 5)[..., 1, :, 0, :, :]  # [R, C, *batch, m*per, m*n_h, nb]
            same_block.copy_(cross.permute(nd + 2, nd + 4, *range(nd), nd + 1, nd + 3, nd))
    # (the matrices are taken as views only now, after every write into `out`)
    results: list[list[Tensor]] = [[] for _ in rows]
    for (per, _, _, out), indices in zip(groups, members.values()):
        for r, i in enumerate(indices):
            results[i] = [out[r, c] for c in range(C)]
    return results


def score_matrices(G: Tensor | None, channel: bool, ct: int, n_h: int, rows: list[tuple[Tensor, Rows]], cols: list[Tensor]) -> list[list[Tensor]]:
    """`scores[i][j]`: the decayed score matrix `[..., Ct*nr, L]` of row operand
    `rows[i] = (x, kind)` against column operand `cols[j]`, for one set of chunks.

    `G` is the within-chunk cumulative log-gate per sub-step (log2 units), `[..., L]`
    (scalar gate) or `[..., L, K]` (channel gate), or None. Decay factors and masks are
    built once and shared by every matrix.
    """
    if channel:
        return _dyadic_scores(G, ct, n_h, rows, cols)
    return _ratio_scores(G, ct, n_h, rows, cols)
