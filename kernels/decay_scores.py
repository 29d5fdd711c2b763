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

  On CPU that elementwise work, not the matmuls, decides the speed, so the forward
  touches memory few times and never evaluates a decay per level: it keeps every row
  operand relative to the start of its current block and every column operand relative
  to the end of its block, and goes from blocks of `m` tokens to blocks of `2m` by
  multiplying the second-half rows by the decay of the first half and the first-half
  columns by the decay of the second half, in place. Those block decays are products of
  the tokens' own decays `exp2(g_t)` (passed in, `token_decay`): one `exp2` per token
  and channel in all, each factor `<= 1` for log-gates `<= 0`, and a level's factor is a
  product of `log2(m) + 1` of them (float32 roundoff; an underflow to 0 is the decay's
  true size). The operands are interleaved per position (`[Bt, Ct, per, R, K]` rows,
  `[Bt, Ct, n_h, C, K]` columns: `R` row operands, `C` column operands), so that a
  block's half is one `[m per R, K]` or `[m n_h C, K]` matrix, a view: each level is one
  batched matmul of views for all `R x C` cross products, and two in-place
  multiplications. With `n_h == 1` the read-outs sit at the sub-step positions, so `q`
  joins `k` as rows. The whole computation is one autograd Function (`_DyadicScores`)
  with an explicit backward (autograd's own, through every level's half-block views, was
  about five times the forward), which recomputes each level's factors as
  `exp2(G_r - G_ref)`, `exp2(G_ref - G_c)` from `G`.

  Not used, though measured: when a chunk's whole decay is bounded (say `-G_L <= 64`),
  one masked product `(x exp2(G)) (y exp2(-G))^T` (the no-gate path, factors `<= 2**64`)
  is exact too, and made the KDA, RWKV-7 and GLA forwards 15-25% faster on the
  benchmark's mild gates (about -0.6 log2 units per token; measured against the earlier
  dyadic forward, which formed `exp2(G_r - G_ref)` anew at every level). But `blocks/gates.py`'s
  `ChannelGate` starts at -1 to -16 log2 units per token (by head), so its fast heads
  pass any float32-safe bound within a chunk and real layers would take the dyadic path
  anyway; and a data-dependent choice would make the matmul count depend on the gate
  values, which `blocks/cost.py` prices from the plan alone. A factorization per block of
  `s` row tokens (reference at the block's first sub-step, `s` chosen from the data,
  always exact at `s = 1`) keeps the matmul count fixed, but its `Ct/s` rescaled copies
  of the columns made the forward 2.5 to 5.5 times slower than (that earlier) dyadic
  splitting at those gates.

  Measured, with the running products: on one CPU thread at the benchmark's KDA shape
  (256 chunks of 16 tokens, rows `q, k`, column `k`, K = 64) the forward takes about
  1.3 ms, of which the four levels' batched matmuls (thousands of tiny products: MKL's
  per-product cost, not the multiply-adds) ~0.4 ms, the in-place doublings ~0.35 ms,
  the first rescaling of the rows and the column copy ~0.2 ms, the within-token leaves
  ~0.1 ms and the copies of each level's products into the score matrices ~0.1 ms (it
  was ~1.4-1.6 ms before the running products, with per-level `exp2`, and the decayed
  operands of `Ends` then cost ~0.3 ms more in `chunked.py`). Computing a level's
  products elementwise instead (`(x * y).sum(-1)`) was slower at every level.

Shapes: row operands `[..., Ct*nr, K]` (`nr = n_h` for sub-steps, 1 for queries), column
operands `[..., L, K]`, `G` `[..., L]` (scalar) or `[..., L, K]` (channel) or None, `L =
Ct*n_h`; a score matrix is `[..., Ct*nr, L]` (a view with rows `R` apart when made with
the by-products of `Ends`, whose storage interleaves the row operands per position so that
a column operand's scores against all of them are one matrix; RWKV-7's chain without
autograd multiplies `[M_qw; A_kw]` by `U` in one matmul that way; the copies of each
level's products into that layout measured ~25% cheaper than into `[R, C, ...]`).
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import torch
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor
Rows = Literal["substeps", "queries"]
LN2 = math.log(2.0)  # d exp2(x) / dx = ln 2 * exp2(x)


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


class _Dyadic:
    """The geometry of one dyadic score computation, shared by its forward and backward.

    Internally the batch is flattened (`Bt`), row operands come in groups of positions
    (`P = Ct*per` rows: `per = n_h` for sub-steps, 1 for read-outs; one group when
    `n_h == 1`), and each group's matrices are `out` `[R, C, Bt, P, L]`. At level `m`
    (blocks of `2m` tokens, `nb` of them) a group's cross products are one matmul of
    `[Bt*nb, R*mp, K]` rescaled second-half rows against `[Bt*nb, C*mn, K]` rescaled
    first-half columns (`mp = m*per`, `mn = m*n_h`). The backward (and the helpers below)
    stack the operands outermost, `X` `[R, Bt, P, K]`, `Y` `[C, Bt, L, K]`; the forward
    interleaves them per position (`_DyadicScores.forward`).
    """

    def __init__(self, ct: int, n_h: int, kinds: tuple[Rows, ...], Bt: int, K: int):
        self.ct, self.n_h, self.kinds = ct, n_h, kinds
        self.Bt, self.L, self.K = Bt, ct * n_h, K
        # groups: (per, indices of their row operands)
        members: dict[int, list[int]] = {}
        for i, kind in enumerate(kinds):
            members.setdefault(n_h if kind == "substeps" else 1, []).append(i)
        self.groups = list(members.items())

    def rows_of(self, G: Tensor, per: int) -> Tensor:
        """G (or its gradient) at a group's row positions: every sub-step, or each token's last."""
        return G if per == self.n_h else G[:, self.n_h - 1 :: self.n_h]

    def column_factor(self, G: Tensor, m: int) -> Tensor | None:
        """`exp2(G_ref - G_c)` on each block's first half `[Bt, nb, mn, K]`; None (exactly 1)
        at m == 1, where the first half is ref's own token (no gate after its first sub-step)."""
        if m == 1:
            return None
        first = G.view(self.Bt, -1, 2, m * self.n_h, self.K)[:, :, 0]
        return torch.sub(first[:, :, -1:], first).exp2_()

    def row_factor(self, G: Tensor, m: int, per: int) -> Tensor:
        """`exp2(G_r - G_ref)` on each block's second half `[Bt, nb, mp, K]`."""
        ref = G.view(self.Bt, -1, 2, m * self.n_h, self.K)[:, :, 0, -1:]
        second = self.rows_of(G, per).view(self.Bt, -1, 2, m * per, self.K)[:, :, 1]
        return torch.sub(second, ref).exp2_()

    def rescaled(self, x: Tensor, factor: Tensor | None, m: int, per: int, half: int) -> Tensor:
        """`[Bt, nb, S, m*per, K]`: one half (0 first, 1 second) of every block of the
        stacked operands `x` `[S, Bt, Ct*per, K]`, times `factor` (the layout a matmul wants)."""
        S = x.shape[0]
        part = x.view(S, self.Bt, -1, 2, m * per, self.K)[:, :, :, half]
        out = x.new_empty(self.Bt, part.shape[2], S, m * per, self.K)
        if factor is None:
            out.permute(2, 0, 1, 3, 4).copy_(part)
        else:
            torch.mul(part, factor, out=out.permute(2, 0, 1, 3, 4))
        return out

    def same_block(self, out: Tensor, m: int, per: int) -> Tensor:
        """The pairs (second-half row, first-half column) of every block, as a view of `out`
        `[R, C, Bt, P, L]`: `[R, C, Bt, mp, mn, nb]`."""
        R, C = out.shape[:2]
        nb = self.ct // (2 * m)
        blocks = out.view(R, C, self.Bt, nb, 2, m * per, nb, 2, m * self.n_h)
        return torch.diagonal(blocks, dim1=3, dim2=6)[:, :, :, 1, :, 0]

    def token_pairs(self, out_r: Tensor, per: int) -> Tensor:
        """The pairs within each token, as a view of one row operand's `out_r` `[C, Bt, P, L]`:
        `[C, Bt, per, n_h, Ct]`."""
        C = out_r.shape[0]
        return torch.diagonal(out_r.view(C, self.Bt, self.ct, per, self.ct, self.n_h), dim1=2, dim2=4)

    def leaf_mask(self, kind: Rows, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """Within a token, sub-step rows see strictly earlier sub-steps; read-outs see all."""
        return _mask("substeps", 1, self.n_h, device, dtype) if kind == "substeps" else None

    def has_leaves(self, kind: Rows) -> bool:
        return kind == "queries" or self.n_h > 1


class _DyadicScores(torch.autograd.Function):
    """Channel-gate scores by dyadic splitting (module docstring), with an explicit backward.

    `(ct, n_h, kinds, ends, G, token_decay, *rows, *cols) -> one [R*C, *batch, P, L] per group
    of rows`, or with `ends` one `[C, *batch, P*R, L]` per group (stored by column operand,
    rows interleaved per position: `Ends.stacked_scores`) and the by-products of `Ends`;
    `token_decay = exp2(g_t)` `[*batch, Ct, K]` (not differentiated: the backward gives `G`
    the gate's whole gradient).
    Written with autograd, every level's half-block views and products would record nodes
    whose backward allocates full-size zero gradients and accumulates them one by one (for
    KDA about five times the forward's time). Here the backward recomputes each level's
    factors and rescaled halves (cheap) and accumulates into one gradient per operand:

        dX_hat = dcross Y_hat,  dY_hat = dcross^T X_hat,
        dX    += dX_hat * F_row,  dG_r += ln2 sum_R dX_hat * X_hat,  dG_ref -= the same summed over r,
        dY    += dY_hat * F_col,  dG_c -= ln2 sum_C dY_hat * Y_hat,  dG_ref += the same summed over c.
    """

    @staticmethod
    def forward(ctx, ct, n_h, kinds, ends, G, token_decay, *operands):
        *batch, _, K = token_decay.shape
        L = ct * n_h
        G = None if G is None else G.reshape(-1, L, K)  # (only the backward needs G)
        geo = _Dyadic(ct, n_h, kinds, token_decay.numel() // (ct * K), K)
        Bt = geo.Bt
        rows, cols = operands[: len(kinds)], operands[len(kinds) :]
        C = len(cols)
        # Columns, interleaved per sub-step `[Bt, Ct, n_h, C, K]` (a block's first half is
        # then one `[m n_h C, K]` matrix), each relative to the end of its block: at level 1
        # that is its own token, with no gate after its first sub-step, so the plain values.
        Y = token_decay.new_empty(Bt, ct, n_h, C, K)
        # (Operands may be views with any leading shape of Bt elements, such as chunks of the
        # input layout; every access below goes through `_positions`.)
        for c, y in enumerate(cols):
            Y_y, y_pos = _positions(Y, y, ct, n_h)
            Y_y[..., c, :].copy_(y_pos)
        decay = token_decay.reshape(Bt, ct, K)  # from the end of the previous token to the token
        groups, storages = [], []
        for per, indices in geo.groups:
            R = len(indices)
            if ends:
                # Without autograd the scores are stored `[C, Bt, P, R, L]`: a column operand's
                # scores against all rows interleaved per position (`Ends.stacked_scores`);
                # `out` is the same `[R, C, Bt, P, L]` view as otherwise, only strided.
                storages.append(token_decay.new_zeros(C, Bt, ct * per, R, L))
                out = storages[-1].permute(3, 0, 1, 2, 4)
            else:
                out = token_decay.new_zeros(R, C, Bt, ct * per, L)
                storages.append(out)
            # Rows `[Bt, Ct, per, R, K]`, each relative to the end of the token before its block
            # (level 1: the previous token).
            X = token_decay.new_empty(Bt, ct, per, R, K)
            for r, i in enumerate(indices):
                X_x, x = _positions(X, rows[i], ct, per)
                torch.mul(x, decay.view(*X_x.shape[:-3], 1, K), out=X_x[..., r, :])
                if geo.has_leaves(kinds[i]):
                    Y_x = Y.view(*X_x.shape[:-3], n_h, C, K)
                    leaves = (x[..., None, None, :] * Y_x.unsqueeze(-4)).sum(-1).view(Bt, ct, per, n_h, C)
                    mask = geo.leaf_mask(kinds[i], Y.dtype, Y.device)
                    leaves = leaves if mask is None else leaves * mask[..., None]
                    geo.token_pairs(out[r], per).copy_(leaves.permute(4, 0, 2, 3, 1))
            groups.append((per, X, out))
        for m in _levels(ct):
            nb = ct // (2 * m)
            first = Y.view(Bt * nb, 2, m * n_h * C, K)[:, 0]
            for per, X, out in groups:
                R = X.shape[3]
                second = X.view(Bt * nb, 2, m * per * R, K)[:, 1]
                if R > C:  # (MKL's small batched products run faster with the longer side as columns)
                    cross = torch.bmm(first, second.transpose(1, 2))  # [Bt*nb, (m, n_h, C), (m, per, R)]
                    cross = cross.view(Bt, nb, m * n_h, C, m * per, R).permute(5, 3, 0, 4, 2, 1)
                else:
                    cross = torch.bmm(second, first.transpose(1, 2))  # [Bt*nb, (m, per, R), (m, n_h, C)]
                    cross = cross.view(Bt, nb, m * per, R, m * n_h, C).permute(3, 5, 0, 2, 4, 1)
                geo.same_block(out, m, per).copy_(cross)
            if 2 * m == ct and not ends:
                break
            # From blocks of m tokens to blocks of 2m: second-half rows take on the decay of the
            # first half, first-half columns that of the second half. Every factor is a decay
            # of whole tokens (<= 1 for log-gates <= 0): their products never overflow.
            pair = decay.view(Bt, nb, 2, 1, K)
            Y.view(Bt, nb, 2, m * n_h * C, K)[:, :, 0].mul_(pair[:, :, 1])
            for per, X, out in groups:
                X.view(Bt, nb, 2, m * per * X.shape[3], K)[:, :, 1].mul_(pair[:, :, 0])
            decay = torch.mul(pair[:, :, 0, 0], pair[:, :, 1, 0])  # [Bt, nb, K]: blocks of 2m tokens
        ctx.save_for_backward(G, *operands)
        ctx.geometry = (ct, n_h, kinds, batch, len(groups), ends)
        if not ends:
            return tuple(out.view(-1, *batch, ct * per, L) for per, _, out in groups)
        # One doubling past the chunk: rows decayed from the chunk's start, columns to its end.
        by_row = {i: X[:, :, :, r].view(*batch, ct * per, K) for per, X, _ in groups for r, i in enumerate(dict(geo.groups)[per])}
        starts = tuple(by_row[i] for i in range(len(kinds)))
        col_ends = tuple(Y[:, :, :, c].view(*batch, L, K) for c in range(C))
        # With one group of rows, also the rows interleaved per position `[*batch, P R, K]`.
        stacked = (groups[0][1].view(*batch, -1, K),) if len(groups) == 1 else ()
        extras = (*starts, *col_ends, decay.view(*batch, K), *stacked)
        ctx.mark_non_differentiable(*extras)
        return (*(x.view(C, *batch, -1, L) for x in storages), *extras)

    @staticmethod
    @once_differentiable
    def backward(ctx, *d_outs):
        G, *operands = ctx.saved_tensors
        ct, n_h, kinds, batch, n_groups, stored_by_column = ctx.geometry
        d_outs = d_outs[:n_groups]  # (the by-products of `ends` are not differentiable)
        Bt, L, K = G.shape
        geo = _Dyadic(ct, n_h, kinds, Bt, K)
        rows, Y = operands[: len(kinds)], _stack(operands[len(kinds) :], Bt)
        C = Y.shape[0]
        dG, dY = torch.zeros_like(G), torch.zeros_like(Y)
        d_rows: list[Tensor | None] = [None] * len(kinds)
        groups = []
        for (per, indices), d_out in zip(geo.groups, d_outs):
            X = _stack([rows[i] for i in indices], Bt)
            dX = torch.zeros_like(X)
            if stored_by_column:  # `[C, *batch, P R, L]` (the layout without autograd)
                d_out = d_out.reshape(C, Bt, ct * per, len(indices), L).permute(3, 0, 1, 2, 4)
            else:
                d_out = d_out.reshape(len(indices), C, Bt, ct * per, L)
            for r, i in enumerate(indices):
                if geo.has_leaves(kinds[i]):
                    d_leaves = geo.token_pairs(d_out[r], per).permute(0, 1, 4, 2, 3)  # [C, Bt, Ct, per, n_h]
                    mask = geo.leaf_mask(kinds[i], G.dtype, G.device)
                    d_leaves = (d_leaves if mask is None else d_leaves * mask)[..., None]
                    dX[r].view(Bt, ct, per, K).add_((d_leaves * Y.view(C, Bt, ct, 1, n_h, K)).sum((0, 4)))
                    dY.view(C, Bt, ct, n_h, K).add_((d_leaves * X[r].view(Bt, ct, per, 1, K)).sum(3))
                d_rows[i] = dX[r]
            groups.append((per, X, dX, d_out))
        for m in _levels(ct):
            nb = ct // (2 * m)
            F_col = geo.column_factor(G, m)
            Y_hat = geo.rescaled(Y, F_col, m, n_h, half=0)  # [Bt, nb, C, mn, K]
            dG_blocks = dG.view(Bt, nb, 2, m * n_h, K)
            dG_ref = dG_blocks[:, :, 0, -1:]
            for per, X, dX, d_out in groups:
                R = X.shape[0]
                F_row = geo.row_factor(G, m, per)
                X_hat = geo.rescaled(X, F_row, m, per, half=1)  # [Bt, nb, R, mp, K]
                d_cross = G.new_empty(Bt, nb, R, m * per, C, m * n_h)
                d_cross.permute(2, 4, 0, 3, 5, 1).copy_(geo.same_block(d_out, m, per))
                d_cross = d_cross.view(Bt * nb, R * m * per, C * m * n_h)
                dX_hat = torch.bmm(d_cross, Y_hat.view(Bt * nb, C * m * n_h, K)).view(Bt, nb, R, m * per, K)
                dY_hat = torch.bmm(d_cross.transpose(1, 2), X_hat.view(Bt * nb, R * m * per, K)).view(Bt, nb, C, m * n_h, K)
                # rows: X_hat = X_second * exp2(G_r - G_ref)
                dX.view(R, Bt, nb, 2, m * per, K)[:, :, :, 1].add_((dX_hat * F_row[:, :, None]).permute(2, 0, 1, 3, 4))
                d_exponent = (dX_hat * X_hat).sum(2).mul_(LN2)  # [Bt, nb, mp, K]
                geo.rows_of(dG, per).view(Bt, nb, 2, m * per, K)[:, :, 1].add_(d_exponent)
                dG_ref.sub_(d_exponent.sum(2, keepdim=True))
                # columns: Y_hat = Y_first * exp2(G_ref - G_c)
                first = dY.view(C, Bt, nb, 2, m * n_h, K)[:, :, :, 0]
                if F_col is None:
                    first.add_(dY_hat.permute(2, 0, 1, 3, 4))
                    continue
                first.add_((dY_hat * F_col[:, :, None]).permute(2, 0, 1, 3, 4))
                d_exponent = (dY_hat * Y_hat).sum(2).mul_(LN2)  # [Bt, nb, mn, K]
                dG_blocks[:, :, 0].sub_(d_exponent)
                dG_ref.add_(d_exponent.sum(2, keepdim=True))
        def unflatten(x: Tensor) -> Tensor:
            return x.view(*batch, *x.shape[-2:])

        d_cols = [unflatten(dY[c]) for c in range(C)]
        return (None, None, None, None, unflatten(dG), None, *[unflatten(d) for d in d_rows], *d_cols)


def _positions(buffer: Tensor, x: Tensor, ct: int, per: int) -> tuple[Tensor, Tensor]:
    """An operand `x` `[*s, Ct*per, K]` as `[*s, Ct, per, K]`, and the interleaved `buffer`
    `[Bt, Ct, per, S, K]` viewed with the same leading dimensions `s` (views both)."""
    x = x.unflatten(-2, (ct, per))
    return buffer.view(*x.shape[:-3], *buffer.shape[1:]), x


def _stack(operands, Bt: int) -> Tensor:
    """`[*batch, P, K]` operands -> `[S, Bt, P, K]` (a copy only when S > 1)."""
    if len(operands) == 1:
        x = operands[0]
        return x.reshape(1, Bt, *x.shape[-2:])
    return torch.stack([x.reshape(Bt, *x.shape[-2:]) for x in operands])


class Ends(NamedTuple):
    """What the dyadic scores' running products hold after one more doubling: every row
    operand decayed from the chunk's start (`x * exp2(G_r)`, at the row positions), every
    column operand decayed to the chunk's end (`y * exp2(G_L - G_c)`), and the chunk's
    whole decay `exp2(G_L)` `[..., K]`. Not differentiable."""

    rows: list[Tensor]
    cols: list[Tensor]
    decay: Tensor
    # With one group of rows (every row operand at the same positions: `n_h == 1`, or
    # sub-step rows only), the same interleaved per position (row operand innermost):
    # `stacked_rows` `[..., P R, K]` (the decayed rows) and, per column operand,
    # `stacked_scores[j]` `[..., P R, L]` (its score matrices against every row operand),
    # else None.
    stacked_rows: Tensor | None = None
    stacked_scores: list[Tensor] | None = None


def _dyadic_scores(
    G: Tensor, token_decay: Tensor | None, ct: int, n_h: int, rows: list[tuple[Tensor, Rows]], cols: list[Tensor], ends: bool = False
) -> tuple[list[list[Tensor]], Ends | None]:
    """Channel-gate scores by dyadic splitting: `_DyadicScores`, unstacked."""
    if ct & (ct - 1):
        raise ValueError(f"channel-gate scores need a power-of-two number of tokens per chunk, got {ct}")
    kinds = tuple(kind for _, kind in rows)
    if token_decay is None:
        G_tokens = G[..., n_h - 1 :: n_h, :]
        token_decay = torch.exp2(torch.diff(G_tokens, dim=-2, prepend=torch.zeros_like(G_tokens[..., :1, :])))
    G = None if G is None else G.contiguous()
    outs = _DyadicScores.apply(ct, n_h, kinds, ends, G, token_decay.detach(), *(x for x, _ in rows), *cols)
    K = token_decay.shape[-1]
    groups = _Dyadic(ct, n_h, kinds, token_decay.numel() // (ct * K), K).groups
    C = len(cols)
    results: list[list[Tensor]] = [[] for _ in rows]
    for (per, indices), out in zip(groups, outs):
        if ends:  # `[C, *batch, P R, L]`
            R = len(indices)
            by_column = out.unflatten(-2, (-1, R))
            for r, i in enumerate(indices):
                results[i] = [by_column[c, ..., r, :] for c in range(C)]
        else:
            matrices = out.unbind(0)
            for r, i in enumerate(indices):
                results[i] = list(matrices[r * C : (r + 1) * C])
    if not ends:
        return results, None
    extras = outs[len(groups) :]
    n = len(rows) + C + 1
    stacked = (extras[n], list(outs[0].unbind(0))) if len(groups) == 1 else (None, None)
    return results, Ends(list(extras[: len(rows)]), list(extras[len(rows) : len(rows) + C]), extras[len(rows) + C], *stacked)


def score_matrices_and_ends(
    G: Tensor | None, token_decay: Tensor, ct: int, n_h: int, rows: list[tuple[Tensor, Rows]], cols: list[Tensor]
) -> tuple[list[list[Tensor]], Ends]:
    """Channel gate, without autograd: `score_matrices` and, at the cost of one more
    doubling, the decayed operands of `Ends` (which would otherwise cost an `exp2` and a
    multiplication each). `G` may be None: only a backward needs it."""
    scores, ends = _dyadic_scores(G, token_decay, ct, n_h, rows, cols, ends=True)
    assert ends is not None
    return scores, ends


def score_matrices(
    G: Tensor | None, channel: bool, ct: int, n_h: int, rows: list[tuple[Tensor, Rows]], cols: list[Tensor], token_decay: Tensor | None = None
) -> list[list[Tensor]]:
    """`scores[i][j]`: the decayed score matrix `[..., Ct*nr, L]` of row operand
    `rows[i] = (x, kind)` against column operand `cols[j]`, for one set of chunks.

    `G` is the within-chunk cumulative log-gate per sub-step (log2 units), `[..., L]`
    (scalar gate) or `[..., L, K]` (channel gate), or None. Decay factors and masks are
    built once and shared by every matrix. `token_decay` (channel gate; formed from `G`
    when not given) is each token's own decay `exp2(g_t)` `[..., Ct, K]`, which the
    caller has exactly, before the cumulative sum.
    """
    if channel:
        return _dyadic_scores(G, token_decay, ct, n_h, rows, cols)[0]
    return _ratio_scores(G, ct, n_h, rows, cols)
