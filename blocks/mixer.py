"""The one mixer layer: every `RecurrencePlan` becomes this module.

Per token `x_t` (`[B, T, d_model]` in, same out), following flash-linear-attention's
DeltaNet / GatedDeltaNet / GatedDeltaProduct / KDA / GLA layers:

1. Streams: `q` (H*K), `k` (n_h*H*K), `v` (n_h*H*V) and, for an untied write key, `w`
   (n_h*H*K): a linear map each, then the optional short causal conv, then SiLU. The k, v
   (and w, beta, erase) projections are n_h times wider: one set per sub-step (DeltaProduct).
2. Householder and RWKV-7 transitions L2-normalise `q`, `k` (and `w`) per head: the kernel
   does not, and the delta rule needs unit keys for its eigenvalues to stay in `[-1, 1]`.
   The diagonal transition (GLA-like, `S += k v^T`) does not: GLA feeds raw q, k to its
   kernel (no feature map, scale K^-0.5), and with no erase there is no eigenvalue to keep.
3. `beta = beta_scale * sigmoid(W_b x)` per sub-step and head (householder only).
4. RWKV-7: erase `e = a * k` with `a = beta_scale * sigmoid(low-rank(x))` per key channel,
   an untied write key `w` (its own projection) and write strength `b = 1`.
5. OSDN (`write_key = preconditioned`): `w = d * k` from `osdn_write_keys`.
6. The gate chosen by the plan (`scalar`: per head; `channel`: per key channel, KDA), in
   the plan's decay form (`mamba2`, `rwkv7` or `gla`, `gates.py`), whatever the backbone: the
   backbone only fixes the defaults and the read-out below.
7. `linear_recurrence`, then the backbone's output: DeltaNet `RMSNorm(o)`; Gated DeltaNet
   `RMSNorm(o) * SiLU(W_g x)`; KDA `RMSNorm(o) * sigmoid(low-rank(x))`; then `o_proj`.

Decoding state (`MixerState`): the matrix state S, the conv tails, OSDN's d. Calling the
mixer on a sequence in one piece or in several, carrying the state, gives the same output.
`step` decodes one token in place on that state: the same streams, then one
`kernels.decode_step` (one launch on CUDA) instead of the chunk kernel.
Packed documents (`cu_seqlens`, B = 1) run as if each were alone: the conv, the OSDN scan
and the recurrence restart at every document, and the state has one row per document.

Saved for the backward, per layer (what is recomputed instead): each stream's projection
output (the conv's SiLU, pre-activation and L2 norm are recomputed by the fused conv, and
on the Triton path the recurrence forms the conv's output again from it in its own
backward, `ShortConv.recipe`, rather than keep it too); the gate's projection (its float32
softplus or sigmoid and decay are recomputed, `gates.py`); the recurrence's other inputs;
the output norm's input and gate (the normalised rows, `o_proj`'s input, are formed again
in the backward: `kernels/norm_linear.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from archspec.kernels import Recompute, decode_step, fan_out_linear, linear_recurrence
from archspec.kernels.fused import linear_as
from archspec.kernels.row_linear import HeadNorm, PreNorm, row_linear
from archspec.kernels.short_conv import stream_step

from .conv import ShortConv
from .gates import DECAY_FORMS, ChannelGate, ScalarGate
from .hooks import fusable, has_forward_hooks
from .joined import JoinedWeights
from .lowrank import LowRankLinear
from .norm import GatedRMSNorm, RMSNorm
from .plan import RecurrencePlan
from .preconditioner import OSDNPreconditioner

Tensor = torch.Tensor

L2_EPS = 1e-6
# The recurrence's argument each stream feeds, where its name differs (its recipe goes there).
RECURRENCE_ARGUMENT = {"w": "write_key"}


@dataclass
class MixerState:
    """One layer's decoding state."""

    recurrent: Tensor  # S [B, H, K, V]; float32 (float64 in a float64 model)
    conv: dict[str, Tensor] = field(default_factory=dict)  # stream -> tail [B, W-1, C]
    d: Tensor | None = None  # OSDN's preconditioner [B, H, K]
    # In a decoding state, the streams' tails side by side `[B, W-1, sum C]`: `conv`'s
    # tensors are its column slices, and `Mixer.step` shifts all of them in one launch.
    tails: Tensor | None = None


def decode_state(state: MixerState) -> MixerState:
    """A copy of `state` that `Mixer.step` may update in place: tensors of its own, the
    conv tails joined (`MixerState.tails`), OSDN's `d` in the matrix state's dtype."""
    d = None if state.d is None else state.d.to(state.recurrent.dtype).contiguous().clone()
    return join_tails(MixerState(state.recurrent.contiguous().clone(), state.conv, d))


def join_tails(state: MixerState) -> MixerState:
    """`state` with its conv tails copied side by side into one tensor (`MixerState.tails`,
    `conv` its column slices), the rest as it is."""
    if not state.conv:
        return MixerState(state.recurrent, {}, state.d)
    tails = torch.cat(list(state.conv.values()), dim=-1)
    views = tails.split([t.shape[-1] for t in state.conv.values()], dim=-1)
    return MixerState(state.recurrent, dict(zip(state.conv, views)), state.d, tails)


def check_plan(plan: RecurrencePlan) -> None:
    """Refuse plans the mixer cannot build; the spec validator should never produce one."""
    problems = []
    if plan.transition == "diagonal" and (plan.n_h != 1 or plan.write_key != "tied"):
        problems.append("the diagonal transition writes S += k v^T: n_h must be 1 and the write key tied")
    if plan.transition == "householder" and (plan.beta_scale is None or plan.write_key == "untied"):
        problems.append("householder needs a beta_scale and a tied or preconditioned write key")
    if plan.transition == "rwkv7" and (plan.beta_scale is None or plan.write_key != "untied" or not plan.erase):
        problems.append("rwkv7 needs a beta_scale (erase range), an untied write key and erase=True")
    if plan.erase and plan.transition != "rwkv7":
        problems.append("erase is the rwkv7 transition's")
    if (plan.write_key == "preconditioned") != (plan.preconditioner is not None):
        problems.append("a preconditioned write key and a preconditioner go together")
    if plan.decay not in DECAY_FORMS:
        problems.append(f"decay must be one of {sorted(DECAY_FORMS)}, got {plan.decay!r}")
    if min(plan.heads, plan.head_dim, plan.value_dim, plan.n_h) < 1 or plan.short_conv < 0:
        problems.append("sizes must be positive (short_conv >= 0)")
    if problems:
        raise ValueError("invalid RecurrencePlan: " + "; ".join(problems))


def stream_widths(plan: RecurrencePlan) -> dict[str, int]:
    """Output width of each projected stream (q, k, v, and w for an untied write key)."""
    H, K, V, n = plan.heads, plan.head_dim, plan.value_dim, plan.n_h
    widths = {"q": H * K, "k": n * H * K, "v": n * H * V}
    if plan.write_key == "untied":
        widths["w"] = n * H * K
    return widths


class Mixer(nn.Module):
    def __init__(self, plan: RecurrencePlan, d_model: int, norm_eps: float = 1e-6, depth: float = 0.5):
        """`depth`: the layer's place in the stack, 0 the first layer and 1 the last (an
        rwkv7-form gate's initial decay speeds depend on it, as in RWKV-7)."""
        super().__init__()
        check_plan(plan)
        self.plan = plan
        H, K, V, n = plan.heads, plan.head_dim, plan.value_dim, plan.n_h
        self.backend = "auto"
        self.capture = False  # set True: the next forward stores `captured` (then resets)
        self.captured: dict | None = None

        widths = stream_widths(plan)
        self.proj = nn.ModuleDict({s: nn.Linear(d_model, w, bias=False) for s, w in widths.items()})
        self.conv = nn.ModuleDict({s: ShortConv(w, plan.short_conv) for s, w in widths.items()}) if plan.short_conv else None

        self.b_proj = nn.Linear(d_model, n * H, bias=False) if plan.transition == "householder" else None
        # RWKV-7's per-channel erase strength, low rank like its a-LoRA (rank K here).
        self.a_proj = LowRankLinear(d_model, K, n * H * K, bias=True) if plan.transition == "rwkv7" else None
        self.gate: nn.Module | None = None
        if plan.gate == "scalar":
            self.gate = ScalarGate(d_model, H, form=plan.decay, depth=depth)
        elif plan.gate == "channel":
            # rank = head_v_dim, as in KDA
            self.gate = ChannelGate(d_model, H, K, rank=V, form=plan.decay, depth=depth)
        self.preconditioner = (
            OSDNPreconditioner(plan.preconditioner, d_model, H, K) if plan.preconditioner is not None else None
        )

        if plan.backbone == "deltanet":
            self.o_norm: nn.Module = RMSNorm(V, eps=norm_eps)
            self.g_proj = None
        elif plan.backbone == "gdn":
            self.o_norm = GatedRMSNorm(V, "silu", eps=norm_eps)
            self.g_proj = nn.Linear(d_model, H * V, bias=False)
        else:  # kda
            self.o_norm = GatedRMSNorm(V, "sigmoid", eps=norm_eps)
            self.g_proj = LowRankLinear(d_model, V, H * V, bias=True)
        self.o_proj = nn.Linear(H * V, d_model, bias=False)
        self.fused_backend = "auto"  # the decoding step's streams; `LanguageModel.set_backend` sets it
        self._step_inputs = self._joined_inputs()
        self._step_conv = JoinedWeights([c.conv for c in self.conv.values()]) if self.conv is not None else None

    def _joined_inputs(self) -> JoinedWeights:
        """Every projection of the token that the decoding step reads, as one matrix: the
        streams (q, k, v, w, in `stream_widths` order), then beta's, the gate's and the output
        gate's (their first stage where low rank), RWKV-7's erase and APF's retain."""
        sources: dict[str, nn.Module] = dict(self.proj)
        if self.b_proj is not None:
            sources["beta"] = self.b_proj
        if isinstance(self.gate, ScalarGate):
            sources["gate"] = self.gate.a_proj
        elif isinstance(self.gate, ChannelGate):
            sources["gate"] = self.gate.f_proj.down
        if self.g_proj is not None:
            sources["out_gate"] = self.g_proj.down if isinstance(self.g_proj, LowRankLinear) else self.g_proj
        if self.a_proj is not None:
            sources["erase"] = self.a_proj.down
        if self.preconditioner is not None and self.preconditioner.retain_proj is not None:
            sources["retain"] = self.preconditioner.retain_proj
        self._step_names = list(sources)
        return JoinedWeights(list(sources.values()))

    @property
    def scale(self) -> float:
        return self.plan.head_dim**-0.5

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> MixerState:
        """The state of a sequence that has not started (what `state=None` means)."""
        p = self.o_proj.weight
        device = p.device if device is None else torch.device(device)
        acc = torch.float64 if p.dtype == torch.float64 else torch.float32
        H, K, V = self.plan.heads, self.plan.head_dim, self.plan.value_dim
        conv = {} if self.conv is None else {s: c.empty_tail(batch_size, device, p.dtype) for s, c in self.conv.items()}
        d = None if self.preconditioner is None else self.preconditioner.start_state(batch_size, device, acc)
        return MixerState(torch.zeros(batch_size, H, K, V, device=device, dtype=acc), conv, d)

    def _projections(self, x: Tensor) -> dict[str, Tensor]:
        """The streams' and beta's projections of `x` that are plain bias-free Linears
        without hooks (`fusable`), by name, formed in one call whose backward sums their
        input gradients inside its matmuls (`kernels.fan_out_linear`); the others are
        left to their own forward. Their gradients all arrive as the recurrence's backward
        ends, so joining them holds none back (the output gate's would wait: it is apart)."""
        modules = {name: m for name, m in self.proj.items() if fusable(m)}
        if self.b_proj is not None and fusable(self.b_proj):
            modules["beta"] = self.b_proj
        if len(modules) < 2:
            return {}
        return dict(zip(modules, fan_out_linear(x, [m.weight for m in modules.values()], backend=self.fused_backend)))

    def _stream(self, name: str, x: Tensor, state: MixerState | None, tails: dict[str, Tensor],
                cu_seqlens: Tensor | None, unit: bool, return_state: bool, shape: tuple[int, ...],
                recipes: dict[str, Recompute], projected: dict[str, Tensor]) -> Tensor:
        """Projection (`projected`'s where `_projections` formed it), optional short conv
        (its new tail goes to `tails` when the state is
        returned), SiLU, and with `unit` the L2 norm of each head, reshaped to `shape`: the
        conv, SiLU and norm are one fused call that recomputes rather than saves its
        intermediates, and its recipe goes to `recipes` under the recurrence argument the stream
        feeds (`RECURRENCE_ARGUMENT`; the recurrence forms the output
        again in its backward instead of keeping it beside the conv's input)."""
        h = projected[name] if name in projected else self.proj[name](x)
        head_dim = self.plan.head_dim if unit else 0
        if self.conv is not None:
            conv, tail = self.conv[name], None if state is None else state.conv[name]
            y, new_tail = conv(h, tail, cu_seqlens=cu_seqlens, activation=True, head_dim=head_dim, norm_eps=L2_EPS,
                               return_tail=return_state)
            if return_state:
                tails[name] = new_tail
            if type(conv) is ShortConv and not has_forward_hooks(conv):  # else its output is kept
                recipes[RECURRENCE_ARGUMENT.get(name, name)] = conv.recipe(
                    h, tail, cu_seqlens=cu_seqlens, activation=True, head_dim=head_dim, norm_eps=L2_EPS, shape=shape)
            return y.reshape(shape)
        h = F.silu(h)
        if unit:
            h = F.normalize(h.unflatten(-1, (-1, head_dim)), dim=-1, eps=L2_EPS).flatten(-2)
        return h.reshape(shape)

    def forward(
        self, x: Tensor, state: MixerState | None = None, return_state: bool = False, *, cu_seqlens: Tensor | None = None
    ) -> tuple[Tensor, MixerState | None]:
        """`x` `[B, T, d_model]` -> `[B, T, d_model]`, and the state after the last token.

        `cu_seqlens` (token offsets `[N+1]`, B = 1) packs N documents in one row: each starts
        from its own state (`state` then holds N rows) or from zeros, and no token sees
        another document; the returned state has one row per document.
        """
        plan = self.plan
        B, T, _ = x.shape
        H, K, V, n = plan.heads, plan.head_dim, plan.value_dim, plan.n_h
        tails: dict[str, Tensor] = {}
        unit = plan.transition != "diagonal"  # the delta rule and RWKV-7 need unit q, k

        recipes: dict[str, Recompute] = {}
        projected = self._projections(x)
        q = self._stream("q", x, state, tails, cu_seqlens, unit, return_state, (B, T, H, K), recipes, projected)
        # (t, n, h, d) order: the n_h sub-steps of token t are rows t*n_h .. t*n_h + n_h - 1.
        k = self._stream("k", x, state, tails, cu_seqlens, unit, return_state, (B, T * n, H, K), recipes, projected)
        v = self._stream("v", x, state, tails, cu_seqlens, False, return_state, (B, T * n, H, V), recipes, projected)

        beta = erase = write_key = None
        if self.b_proj is not None:
            beta_logit = projected["beta"] if "beta" in projected else self.b_proj(x)
            beta = plan.beta_scale * torch.sigmoid(beta_logit).reshape(B, T * n, H)
        if self.a_proj is not None:
            erase = plan.beta_scale * torch.sigmoid(self.a_proj(x)).reshape(B, T * n, H, K) * k
        if "w" in self.proj:
            write_key = self._stream("w", x, state, tails, cu_seqlens, True, return_state, (B, T * n, H, K), recipes,
                                     projected)

        d_final, osdn_inputs = None, None
        if self.preconditioner is not None:
            write_key, d_final, osdn_inputs = self.preconditioner(
                x, k, beta, None if state is None else state.d, backend=self.backend, cu_seqlens=cu_seqlens, n_h=n
            )

        g = None
        if isinstance(self.gate, (ScalarGate, ChannelGate)) and not has_forward_hooks(self.gate):
            g, recipes["g"] = self.gate(x, recipe=True)
        elif self.gate is not None:  # a hooked or replaced gate: its output is kept
            g = self.gate(x)
        kwargs = dict(
            q=q,
            k=k,
            v=v,
            g=g,
            gate=plan.gate,
            beta=beta,
            write_key=write_key,
            erase=erase,
            n_h=n,
            scale=self.scale,
            initial_state=None if state is None else state.recurrent,
            output_final_state=return_state,
            cu_seqlens=cu_seqlens,
        )
        o, final = linear_recurrence(**kwargs, recompute=recipes, backend=self.backend)
        if self.capture:
            self._store_capture(kwargs, osdn_inputs)
        y = self._read_out(o, *self._out_gate(x, o.shape))
        return y, (MixerState(final, tails, d_final) if return_state else None)

    def _out_gate(self, x: Tensor, shape: torch.Size) -> tuple[Tensor | None, Recompute | None]:
        """The output gate's pre-activation `g_proj(x)` (None without one), and its recipe
        (`kernels.Recompute`, reshaped to `shape`) where the read-out may form it again in
        its backward: the projection's input (`x`, or a low-rank gate's rank-r stage) is
        kept by that projection anyway, so keeping the gate too would hold it twice. A
        replaced or hooked projection keeps its own forward, and its output is kept."""
        proj = self.g_proj
        if proj is None:
            return None, None
        if type(proj) is nn.Linear and not has_forward_hooks(proj):
            gate = proj(x)
            return gate, Recompute(linear_as, (x, proj.weight, proj.bias), dict(dtype=gate.dtype), shape)
        if type(proj) is LowRankLinear and not any(has_forward_hooks(m) for m in (proj, proj.down, proj.up)) \
                and type(proj.up) is nn.Linear:
            rank_r = proj.activate(proj.down(x))  # what `proj.up` keeps for its own backward
            gate = proj.up(rank_r)
            return gate, Recompute(linear_as, (rank_r, proj.up.weight, proj.up.bias), dict(dtype=gate.dtype), shape)
        return proj(x), None

    def _read_out(self, o: Tensor, out_gate: Tensor | None, gate_recompute: Recompute | None = None) -> Tensor:
        """The backbone's output of the recurrence's `o` `[B, T, H, V]`: the output norm
        (gated by `out_gate` `[B, T, H*V]` for Gated DeltaNet, GLA and KDA, formed again in
        the backward from `gate_recompute` where given), then `o_proj`."""
        if out_gate is None:
            return self.o_norm.project(o, self.o_proj)
        return self.o_norm.project(o, out_gate.reshape(o.shape), self.o_proj, gate_recompute)

    def step(self, x: Tensor, state: MixerState, *, pre_norm: PreNorm | None = None) -> tuple[Tensor, Tensor]:
        """One token `x` `[B, 1, d_model]` -> `([B, 1, d_model], residual)`, continuing `state`
        in place (S, the conv tails and OSDN's d; each row one sequence): what `forward`
        gives for a one-token piece. With `pre_norm` (the block's norm, `kernels.PreNorm`),
        `x` is the residual stream and the step reads `rms_norm(x + pending)`; `residual`
        is `x + pending` (`x` without a `pre_norm`). `state` must come from `decode_state`
        (tensors of its own, the tails joined), since it is overwritten.

        Kernels per token on CUDA: one matrix-vector product for every projection of the
        token (joined, `joined.py`; the pre-norm fused in front, `kernels.row_linear`), the
        second stage of the low-rank ones, one launch for the streams' conv, SiLU and norm,
        one `kernels.decode_step` (beta's sigmoid and the gate's log decay formed inside it),
        and `o_proj` with the output norm fused in front."""
        plan = self.plan
        B = x.shape[0]
        H, K, V, n = plan.heads, plan.head_dim, plan.value_dim, plan.n_h
        if self.conv is not None and (state.tails is None or list(state.conv) != list(self.conv)):
            raise ValueError(f"Mixer.step: the state must come from decode_state, its conv tails joined in one tensor "
                             f"in the streams' order {list(self.conv)}; got tails of {list(state.conv)}"
                             + (" not joined" if state.tails is None else ""))
        weight, bias = self._step_inputs.current()
        # [B, 1, every projection's width]
        projected, residual = row_linear(x, weight, bias, before=pre_norm, backend=self.fused_backend)
        token = dict(zip(self._step_names, projected.split(self._step_inputs.widths, dim=-1)))
        widths = stream_widths(plan)
        unit = plan.transition != "diagonal"  # the delta rule and RWKV-7 need unit q, k (and w)
        streams = tuple((width, K if unit and name != "v" else 0) for name, width in widths.items())
        conv_weight = None if self._step_conv is None else self._step_conv.current()[0]
        # the streams lead the joined projection (`_joined_inputs`): its first columns
        out = stream_step(projected[..., : sum(widths.values())], conv_weight, state.tails, streams, eps=L2_EPS,
                          backend=self.fused_backend)
        vectors = dict(zip(widths, out.split(list(widths.values()), dim=-1)))
        q = vectors["q"].reshape(B, 1, H, K)
        k = vectors["k"].reshape(B, n, H, K)
        v = vectors["v"].reshape(B, n, H, V)
        write_key = vectors["w"].reshape(B, n, H, K) if "w" in vectors else None
        erase = None
        if self.a_proj is not None:
            erase = plan.beta_scale * torch.sigmoid(self._up(self.a_proj, token["erase"])).reshape(B, n, H, K) * k
        g, decay = None, None
        if isinstance(self.gate, ScalarGate):
            g, decay = token["gate"], self.gate.decay_params()
        elif isinstance(self.gate, ChannelGate):
            g = self._up(self.gate.f_proj, token["gate"]).reshape(B, 1, H, K)
            decay = self.gate.decay_params()
        osdn: dict = {}
        if self.preconditioner is not None:
            pre = self.preconditioner.plan
            retain = torch.sigmoid(token["retain"]) if "retain" in token else None
            osdn = dict(d=state.d, retain=retain, eta=pre.eta, d_min=pre.d_min, d_max=pre.d_max,
                        beta_aware=pre.beta_aware, eps=pre.eps)
        beta = None if self.b_proj is None else token["beta"].reshape(B, n, H)
        o = decode_step(q, k, v, state.recurrent, g=g, gate=plan.gate, beta=beta, write_key=write_key, erase=erase,
                        n_h=n, scale=self.scale, backend=self.backend, decay=decay, decay_form=plan.decay,
                        beta_scale=None if beta is None else plan.beta_scale, **osdn)
        out_gate = None
        if self.g_proj is not None:
            out_gate = self._up(self.g_proj, token["out_gate"]) if isinstance(self.g_proj, LowRankLinear) else \
                token["out_gate"]
        norm = self.o_norm if out_gate is None else self.o_norm.norm
        head_norm = HeadNorm(norm.weight, norm.eps, out_gate, "none" if out_gate is None else self.o_norm.activation)
        y, _ = row_linear(o.reshape(B, 1, H * V), self.o_proj.weight, before=head_norm, backend=self.fused_backend)
        return y, x if residual is None else residual

    def _up(self, low_rank: LowRankLinear, down: Tensor) -> Tensor:
        """The second stage of a low-rank projection in the decoding step, on the
        low-rank row `down` (a column slice of the joined projection's output)."""
        return row_linear(low_rank.activate(down), low_rank.up.weight, low_rank.up.bias, backend=self.fused_backend)[0]

    def _store_capture(self, kwargs: dict, osdn_inputs: dict | None) -> None:
        """Diagnostics (docs/interfaces.md): the kernel's exact inputs, detached."""

        def detach(d: dict) -> dict:
            return {k: v.detach() if isinstance(v, Tensor) else v for k, v in d.items()}

        self.captured = detach(kwargs)
        if osdn_inputs is not None:
            self.captured["osdn_inputs"] = detach(osdn_inputs)
        self.capture = False
