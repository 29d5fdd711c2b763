"""Decayed score matrices inside a chunk, without ever evaluating `exp(+large)`.

The chunk algorithm (`chunked.py`) needs, for row vectors `x_r` and column vectors
`y_c` of one chunk,

    P[r, c] = x_r^T diag(exp(G_r - G_c)) y_c      for the pairs where r sees c, else 0,

with `G` the within-chunk cumulative log-gate (non-increasing, since log-gates are <= 0),
here in log2 units: decays are `exp2` of differences of `G` (`chunked.LOG2_E` says why).
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


class _DyadicChannelScores:
    """Channel-gate scores by dyadic splitting (module docstring).

    The decay factors of each level depend only on `G`, so they are computed once here
    and shared by every score matrix of the chunk. `G` is `[..., L, K]`.
    """

    def __init__(self, G: Tensor, ct: int, n_h: int):
        if ct & (ct - 1):
            raise ValueError(f"channel-gate scores need a power-of-two number of tokens per chunk, got {ct}")
        *self.batch, _, self.K = G.shape
        self.ct, self.n_h = ct, n_h
        self.G = G  # [..., L, K]
        self.G_query = G.reshape(*self.batch, ct, n_h, self.K)[..., -1, :]  # a read-out sits at its token's end
        self.block_sizes = [1 << level for level in range(ct.bit_length() - 1)]  # m = 1, 2, .., Ct/2
        # Decay factors and rescaled inputs, made on first use: the same G, q, k, w, a
        # enter several score matrices (inputs are held too, so their ids stay unique).
        self._factors: dict[str, list[Tensor]] = {}
        self._rescaled: dict[tuple, tuple[Tensor, list[Tensor]]] = {}

    def _blocks(self, x: Tensor, m: int, per_token: int) -> Tensor:
        """`[..., Ct*per_token, D]` -> `[..., nb, 2, m*per_token, D]`: halves of 2m-token blocks."""
        return x.reshape(*self.batch, self.ct // (2 * m), 2, m * per_token, x.shape[-1])

    def _level_factors(self, side: str) -> list[Tensor]:
        """Per block size `m`: `exp(ref - G_c)` for the columns of each block's first half
        (`side` "columns"), or `exp(G_r - ref)` for the rows of its second half ("substeps",
        "queries"); `ref` is G at the block's midpoint, so both are <= 1."""
        if side not in self._factors:
            factors = []
            for m in self.block_sizes:
                g_cols = self._blocks(self.G, m, self.n_h)
                ref = g_cols[..., 0, -1:, :]  # [..., nb, 1, K]
                if side == "columns":
                    factors.append(torch.exp2(ref - g_cols[..., 0, :, :]))
                else:
                    g_rows = self._blocks(self.G, m, self.n_h) if side == "substeps" else self._blocks(self.G_query, m, 1)
                    factors.append(torch.exp2(g_rows[..., 1, :, :] - ref))
            self._factors[side] = factors
        return self._factors[side]

    def _halves(self, x: Tensor, side: str) -> list[Tensor]:
        """Per block size: `x`'s rows of each block's second half (`side` "substeps" or
        "queries") or its columns of the first half ("columns"), times their factors."""
        key = (id(x), side)
        if key not in self._rescaled or self._rescaled[key][0] is not x:
            per_token = 1 if side == "queries" else self.n_h
            half = 0 if side == "columns" else 1
            hats = [
                self._blocks(x, m, per_token)[..., half, :, :] * factor
                for m, factor in zip(self.block_sizes, self._level_factors(side))
            ]
            self._rescaled[key] = (x, hats)
        return self._rescaled[key][1]

    def __call__(self, x: Tensor, y: Tensor, rows: Rows) -> Tensor:
        ct, n_h, batch = self.ct, self.n_h, self.batch
        nr = n_h if rows == "substeps" else 1
        K = x.shape[-1]
        out = x.new_zeros(*batch, ct * nr, ct * n_h)
        # Leaves: pairs within one token, no gate between them (none when a token has a
        # single sub-step and rows are sub-steps: nothing is strictly earlier in it).
        if rows == "queries" or n_h > 1:
            xt, yt = x.reshape(*batch, ct, nr, 1, K), y.reshape(*batch, ct, 1, n_h, K)
            leaves = (xt * yt).sum(-1)  # [..., Ct, nr, n_h]
            if rows == "substeps":
                leaves = leaves.tril(-1)  # strictly earlier sub-steps only
            token_pairs = out.view(*batch, ct, nr, ct, n_h)
            torch.diagonal(token_pairs, dim1=-4, dim2=-2).copy_(leaves.movedim(-3, -1))
        # Level m: rows of each block's second half against columns of its first half.
        for m, rows_hat, cols_hat in zip(self.block_sizes, self._halves(x, rows), self._halves(y, "columns")):
            nb = ct // (2 * m)
            cross = rows_hat @ cols_hat.transpose(-1, -2)  # [..., nb, m*nr, m*n_h]
            block_pairs = out.view(*batch, nb, 2, m * nr, nb, 2, m * n_h)
            same_block = torch.diagonal(block_pairs, dim1=-6, dim2=-3)  # [..., 2, m*nr, 2, m*n_h, nb]
            same_block[..., 1, :, 0, :, :].copy_(cross.movedim(-3, -1))
        return out


def make_score_fn(G: Tensor | None, channel: bool, ct: int, n_h: int, device: torch.device) -> ScoreFn:
    """`scores(x, y, rows) -> [..., rows, L]` for one set of chunks.

    `G` is the within-chunk cumulative log-gate per sub-step, `[..., L]` (scalar gate) or
    `[..., L, K]` (channel gate), or None. The ratio matrices of scalar gates and the
    masks are built once here and shared by every score matrix of the chunk.
    """
    if channel:
        return _DyadicChannelScores(G, ct, n_h)

    masks = {rows: _visibility(rows, ct, n_h, device) for rows in ("substeps", "queries")}
    if G is None:

        def ungated(x: Tensor, y: Tensor, rows: Rows) -> Tensor:
            return (x @ y.transpose(-1, -2)).masked_fill(~masks[rows], 0.0)

        return ungated

    g_query = G[..., n_h - 1 :: n_h]
    ratios = {}
    for rows, g_rows in (("substeps", G), ("queries", g_query)):
        exponent = (g_rows[..., :, None] - G[..., None, :]).masked_fill(~masks[rows], float("-inf"))
        ratios[rows] = torch.exp2(exponent)

    def scalar(x: Tensor, y: Tensor, rows: Rows) -> Tensor:
        return (x @ y.transpose(-1, -2)) * ratios[rows]

    return scalar
