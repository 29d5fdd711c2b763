"""Decayed score matrices inside a chunk, without ever evaluating `exp(+large)`.

The chunk algorithm (`chunked.py`) needs, for row vectors `x_r` and column vectors
`y_c` of one chunk,

    P[r, c] = x_r^T diag(exp(G_r - G_c)) y_c      for the pairs where r sees c, else 0,

with `G` the within-chunk cumulative log-gate (non-increasing, since log-gates are <= 0).
Rows are either the chunk's sub-steps (`rows="substeps"`: `c` strictly before `r`) or
its tokens' read-outs (`rows="queries"`: every sub-step of the token and before).

The usual factorization `(x_r exp(G_r)) . (y_c exp(-G_c))` overflows for strong decays
(`exp(-G_c)` grows with the decay accumulated since the chunk's start). Here every
exponent is <= 0:

- no gate / scalar gate: one matmul `x y^T` times the ratio matrix `exp(G_r - G_c)`,
  whose exponent is masked to `-inf` before `exp` wherever `r` does not see `c`;
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

Shapes: `x` `[..., Ct, nr, K]` (rows grouped by token: `nr = n_h` for sub-steps, 1 for
queries), `y` `[..., Ct, n_h, K]`, `G` `[..., Ct, n_h]` (scalar) or `[..., Ct, n_h, K]`
(channel) or None; the result is `[..., Ct*nr, Ct*n_h]`.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

Tensor = torch.Tensor
Rows = Literal["substeps", "queries"]
ScoreFn = Callable[[Tensor, Tensor, Rows], Tensor]


def _visibility(rows: Rows, ct: int, n_h: int, device: torch.device) -> Tensor:
    """`[Ct*nr, Ct*n_h]` bool: which column sub-steps each row sees."""
    cols = torch.arange(ct * n_h, device=device)
    if rows == "substeps":
        return cols[:, None] > cols[None, :]
    token = torch.arange(ct, device=device)
    return (cols[None, :] // n_h) <= token[:, None]


def _channel_scores(x: Tensor, y: Tensor, gx: Tensor, gy: Tensor, rows: Rows) -> Tensor:
    """Dyadic splitting (module docstring). `x` `[..., Ct, nr, K]`, `gx` like `x`, `y`/`gy`
    `[..., Ct, n_h, K]`; returns `[..., Ct*nr, Ct*n_h]`."""
    *batch, ct, nr, K = x.shape
    n_h = y.shape[-2]
    if ct & (ct - 1):
        raise ValueError(f"channel-gate scores need a power-of-two number of tokens per chunk, got {ct}")
    leaf_mask = (
        torch.ones(1, n_h, dtype=torch.bool, device=x.device)
        if rows == "queries"
        else torch.ones(n_h, n_h, dtype=torch.bool, device=x.device).tril(-1)
    )
    blocks = (x @ y.transpose(-1, -2)).masked_fill(~leaf_mask, 0.0)  # [..., Ct, nr, n_h]
    m = 1  # tokens per block
    while m < ct:
        nb = ct // (2 * m)
        xs, gxs = (t.reshape(*batch, nb, 2, m * nr, K) for t in (x, gx))
        ys, gys = (t.reshape(*batch, nb, 2, m * n_h, K) for t in (y, gy))
        ref = gys[..., 0, -1:, :]  # G at the midpoint of each block: [..., nb, 1, K]
        rows_hat = xs[..., 1, :, :] * torch.exp(gxs[..., 1, :, :] - ref)
        cols_hat = ys[..., 0, :, :] * torch.exp(ref - gys[..., 0, :, :])
        cross = rows_hat @ cols_hat.transpose(-1, -2)  # [..., nb, m*nr, m*n_h]
        halves = blocks.reshape(*batch, nb, 2, m * nr, m * n_h)
        upper = torch.cat([halves[..., 0, :, :], torch.zeros_like(cross)], dim=-1)
        lower = torch.cat([cross, halves[..., 1, :, :]], dim=-1)
        blocks = torch.cat([upper, lower], dim=-2)  # [..., nb, 2m*nr, 2m*n_h]
        m *= 2
    return blocks.reshape(*batch, ct * nr, ct * n_h)


def make_score_fn(G: Tensor | None, channel: bool, ct: int, n_h: int, device: torch.device) -> ScoreFn:
    """`scores(x, y, rows) -> [..., rows, L]` for one set of chunks.

    `G` is the within-chunk cumulative log-gate per sub-step, `[..., L]` (scalar gate) or
    `[..., L, K]` (channel gate), or None. The ratio matrices of scalar gates and the
    masks are built once here and shared by every score matrix of the chunk.
    """
    if channel:
        gy = G.reshape(*G.shape[:-2], ct, n_h, G.shape[-1])
        g_rows = {"substeps": gy, "queries": gy[..., -1:, :]}

        def channel(x: Tensor, y: Tensor, rows: Rows) -> Tensor:
            nr = n_h if rows == "substeps" else 1
            xg = x.reshape(*x.shape[:-2], ct, nr, x.shape[-1])
            yg = y.reshape(*y.shape[:-2], ct, n_h, y.shape[-1])
            return _channel_scores(xg, yg, g_rows[rows], gy, rows)

        return channel

    masks = {rows: _visibility(rows, ct, n_h, device) for rows in ("substeps", "queries")}
    if G is None:

        def ungated(x: Tensor, y: Tensor, rows: Rows) -> Tensor:
            return (x @ y.transpose(-1, -2)).masked_fill(~masks[rows], 0.0)

        return ungated

    g_query = G[..., n_h - 1 :: n_h]
    ratios = {}
    for rows, g_rows in (("substeps", G), ("queries", g_query)):
        exponent = (g_rows[..., :, None] - G[..., None, :]).masked_fill(~masks[rows], float("-inf"))
        ratios[rows] = torch.exp(exponent)

    def scalar(x: Tensor, y: Tensor, rows: Rows) -> Tensor:
        return (x @ y.transpose(-1, -2)) * ratios[rows]

    return scalar
