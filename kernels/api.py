"""The public kernel entry points: argument checks, then dispatch to a backend.

Every backend (`naive`, `torch`, `triton`) computes exactly `RECURRENCE.md`; this module
owns the shape contract so that each backend can assume well-formed inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .kinds import DecayForm, Gate, triton_interpreter_on
from .naive import decode_step_naive, linear_recurrence_naive, osdn_write_keys_naive
from .packed import check_offsets
from .recompute import Recompute

Tensor = torch.Tensor

BACKENDS = ("naive", "torch", "triton", "auto")

# Backends register themselves here (name -> function with the public signature), so
# that this module does not import a backend that cannot load on the current machine.
_RECURRENCE_BACKENDS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "naive": linear_recurrence_naive,
}
_OSDN_BACKENDS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "naive": osdn_write_keys_naive,
}
# The decoding step. The torch backend's step is the definition itself: one token is a few
# batched matrix-vector products in torch, with nothing to chunk.
_STEP_BACKENDS: dict[str, Callable[..., Tensor]] = {
    "naive": decode_step_naive,
    "torch": decode_step_naive,
}


def register_backend(
    name: str,
    *,
    recurrence: Callable[..., tuple[Tensor, Tensor | None]] | None = None,
    osdn: Callable[..., tuple[Tensor, Tensor]] | None = None,
    step: Callable[..., Tensor] | None = None,
) -> None:
    """Make `backend=name` available to `linear_recurrence` / `osdn_write_keys` / `decode_step`."""
    if recurrence is not None:
        _RECURRENCE_BACKENDS[name] = recurrence
    if osdn is not None:
        _OSDN_BACKENDS[name] = osdn
    if step is not None:
        _STEP_BACKENDS[name] = step


def _load_backend(name: str) -> None:
    """Import the module that registers `name` on first use."""
    if name == "torch":
        from . import chunked  # noqa: F401  (registers "torch")
    elif name == "triton":
        from . import triton as _triton  # noqa: F401  (registers "triton")
        from .triton.decode import decode_step_triton

        register_backend("triton", step=decode_step_triton)


def resolve_backend(backend: str, device: torch.device, choices: tuple[str, ...] = BACKENDS) -> str:
    """`auto` is the Triton kernel on CUDA tensors and the chunked torch path elsewhere;
    `choices`: the names the caller takes (the fused pieces have no `naive`)."""
    if backend not in choices:
        raise ValueError(f"backend must be one of {choices}, got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" else "torch"


def _get(table: dict[str, Callable], name: str) -> Callable:
    if name not in table:
        _load_backend(name)
    if name not in table:
        raise NotImplementedError(f"backend {name!r} is not available on this machine")
    return table[name]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"linear_recurrence: {message}")


_FLOAT_DTYPES = "float32, bfloat16, float16 or float64"


def check_tensor_arguments(fn: str, reference: str, tensors: dict[str, Any], cu_seqlens: Any) -> None:
    """Types, dtypes and devices: every named argument a floating-point tensor on the
    device of `reference`, `cu_seqlens` an integer tensor there. A Python list has no
    `.shape`; an integer tensor would run through float kernels and give zeros; float
    offsets would be truncated; tensors on two devices fail deep inside a backend."""
    device = tensors[reference].device if isinstance(tensors.get(reference), torch.Tensor) else None
    for name, value in tensors.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}; "
                            f"pass torch.tensor({name}, dtype=torch.float32)")
        if not value.is_floating_point():
            raise TypeError(f"{fn}: {name} must be a floating-point tensor ({_FLOAT_DTYPES}), got {value.dtype}; "
                            f"convert it with {name}.float() (an integer tensor would be computed wrong, as zeros)")
        if device is not None and value.device != device:
            raise ValueError(f"{fn}: {name} is on {value.device} but {reference} is on {device}; pass every tensor on one device")
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: cu_seqlens must be a torch.Tensor of token offsets, got {type(cu_seqlens).__name__}; "
                        f"pass torch.tensor(offsets, dtype=torch.int32, device={reference}.device)")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{fn}: cu_seqlens must hold integer token offsets (torch.int32 or torch.int64), got "
                        f"{cu_seqlens.dtype} (fractional offsets would be truncated); pass whole offsets as "
                        "torch.tensor(offsets, dtype=torch.int32)")
    if device is not None and cu_seqlens.device != device:
        raise ValueError(f"{fn}: cu_seqlens is on {cu_seqlens.device} but {reference} is on {device}; "
                         f"pass cu_seqlens.to({reference}.device)")


def _check_backend_device(fn: str, name: str, device: torch.device) -> None:
    """The Triton kernels run on CUDA tensors (or anywhere under the Triton interpreter,
    `TRITON_INTERPRET=1`); elsewhere Triton would only say it found no active driver."""
    if name == "triton" and device.type != "cuda" and not triton_interpreter_on():
        raise ValueError(f"{fn}: backend='triton' runs on CUDA tensors, but the inputs are on {device}; use "
                         "backend='torch' (or 'auto', which picks it for CPU tensors), or move the inputs to a "
                         "CUDA device with .cuda()")


def _check_number(fn: str, name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{fn}: {name} must be a finite number, got {value!r}")


def check_recurrence_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    write_key: Tensor | None,
    erase: Tensor | None,
    n_h: int,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    gate: Gate | None = None,
) -> None:
    """Raise a ValueError that names the argument and the expected shape (a TypeError
    for an argument of the wrong type or dtype)."""
    check_tensor_arguments(
        "linear_recurrence", "q",
        {"q": q, "k": k, "v": v, "g": g, "beta": beta, "write_key": write_key, "erase": erase, "initial_state": initial_state},
        cu_seqlens,
    )
    _check(q.dim() == 4, f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    _check(isinstance(n_h, int) and not isinstance(n_h, bool) and n_h >= 1, f"n_h must be a positive int, got {n_h!r}")
    TN = T * n_h
    _check(tuple(k.shape) == (B, TN, H, K), f"k must be [B, T*n_h, H, K] = {(B, TN, H, K)}, got {tuple(k.shape)}")
    _check(v.dim() == 4 and tuple(v.shape[:3]) == (B, TN, H), f"v must be [B, T*n_h, H, V] with B, T*n_h, H = {(B, TN, H)}, got {tuple(v.shape)}")
    V = v.shape[-1]
    for name, t in (("write_key", write_key), ("erase", erase)):
        if t is not None:
            _check(tuple(t.shape) == (B, TN, H, K), f"{name} must be [B, T*n_h, H, K] = {(B, TN, H, K)}, got {tuple(t.shape)}")
    if beta is not None:
        _check(tuple(beta.shape) == (B, TN, H), f"beta must be [B, T*n_h, H] = {(B, TN, H)}, got {tuple(beta.shape)}")
    if g is not None:
        _check(
            tuple(g.shape) in ((B, T, H), (B, T, H, K)),
            f"g must be [B, T, H] (scalar gate) or [B, T, H, K] (channel gate), got {tuple(g.shape)}",
        )
    if gate is not None:
        expected = {Gate.NONE: "no g", Gate.SCALAR: f"g of shape {(B, T, H)}", Gate.CHANNEL: f"g of shape {(B, T, H, K)}"}
        _check(Gate.of(g) == gate, f"gate={gate.name.lower()!r} needs {expected[gate]}, got "
               + ("none" if g is None else f"shape {tuple(g.shape)}"))
    N = B
    if cu_seqlens is not None:
        _check(B == 1, f"with cu_seqlens the batch must be 1 (packed), got B={B}")
        check_offsets(cu_seqlens, T, "linear_recurrence")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        _check(
            tuple(initial_state.shape) == (N, H, K, V),
            f"initial_state must be [{'N' if cu_seqlens is not None else 'B'}, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}",
        )


def linear_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    g: Tensor | None = None,
    gate: str | Gate | None = None,
    beta: Tensor | None = None,
    write_key: Tensor | None = None,
    erase: Tensor | None = None,
    n_h: int = 1,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    recompute: Mapping[str, Recompute] | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Run the recurrence of `RECURRENCE.md`.

    Per token `t`: decay the state by `exp(g_t)` (scalar or per key channel), then `n_h`
    sub-steps `i = t*n_h + j`, each with `w_i = write_key_i if given else k_i`:

    - `beta is None and erase is None`: `S <- S + w_i v_i^T`
    - `beta` given, no `erase`:          `S <- S + beta_i w_i (v_i - S^T k_i)^T`
    - `erase` given:                     `S <- S - erase_i (S^T k_i)^T + b_i w_i v_i^T`

    then read out `o_t = S^T (scale * q_t)`. Returns `o` `[B, T, H, V]` in the dtype of `v`
    and, if `output_final_state`, the final state `[B, H, K, V]` (float32).

    `gate` names the gate kind (`"none"`, `"scalar"`, `"channel"`, as a plan says it); the
    backends specialize on it. Left out, it is read from `g`'s shape; given, `g`'s shape
    must match it.

    `recompute` (keys among `RECOMPUTABLE`): how to form an input again, `Recompute`
    (`kernels/recompute.py`); its result must equal the input. The Triton backend keeps
    the recipe's tensors instead of the input and forms it again in the backward (the
    model passes its short convs' recipes, whose inputs the convs' own backward keeps
    anyway, and its gate's, whose projection the gate keeps; with `g` the float32 chunk
    sums of the gate are formed again too). The torch backends keep what autograd keeps
    and ignore it.
    """
    kind = Gate.named(gate) if isinstance(gate, str) else gate
    check_recurrence_inputs(q, k, v, g, beta, write_key, erase, n_h, initial_state, cu_seqlens, kind)
    _check_recompute(recompute, write_key, g)
    _check_number("linear_recurrence", "scale", scale, optional=True)
    kind = Gate.of(g) if kind is None else kind
    name = resolve_backend(backend, q.device)
    _check_backend_device("linear_recurrence", name, q.device)
    fn = _get(_RECURRENCE_BACKENDS, name)
    extra = {"recompute": dict(recompute)} if recompute and name == "triton" else {}
    return fn(
        q,
        k,
        v,
        g=g,
        gate=kind,
        beta=beta,
        write_key=write_key,
        erase=erase,
        n_h=n_h,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        **extra,
    )


# The inputs of `linear_recurrence` a `Recompute` may stand for.
RECOMPUTABLE = ("q", "k", "v", "write_key", "g")


def _check_recompute(recompute: Mapping[str, Recompute] | None, write_key: Tensor | None, g: Tensor | None) -> None:
    if recompute is None:
        return
    if not isinstance(recompute, Mapping) or not all(isinstance(r, Recompute) for r in recompute.values()):
        raise ValueError("linear_recurrence: recompute must map input names to kernels.recompute.Recompute recipes")
    unknown = sorted(set(recompute) - set(RECOMPUTABLE))
    if unknown:
        raise ValueError(f"linear_recurrence: recompute names {unknown}; it takes {list(RECOMPUTABLE)}")
    for name, given in (("write_key", write_key), ("g", g)):
        if name in recompute and given is None:
            raise ValueError(f"linear_recurrence: recompute has a {name} recipe but no {name} was passed")


def osdn_write_keys(
    k: Tensor,
    beta: Tensor | None,
    *,
    eta: float = 0.003,
    d_min: float = 0.5,
    d_max: float = 2.0,
    retain: Tensor | None = None,
    beta_aware: bool = True,
    d0: Tensor | None = None,
    eps: float = 1e-6,
    cu_seqlens: Tensor | None = None,
    n_h: int | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """OSDN phase 1: the preconditioned write keys `w_i = d_i * k_i` and the final `d`.

    `k` `[B, T*n_h, H, K]`; `beta` `[B, T*n_h, H]`; `retain` `[B, T, H]` (APF, applied at
    the first sub-step of each token); `d0` `[B, H, K]` or `[H, K]` (default ones; with
    `cu_seqlens`, `[N, H, K]` or `[H, K]`). `cu_seqlens` holds token offsets (B == 1), as
    for `linear_recurrence`; `d` restarts at each sequence. `n_h` (sub-steps per token) is
    read from `retain` when given, else it is 1 unless passed.
    Differentiable with respect to `k`, `beta`, `retain` and `d0`.
    """
    check_tensor_arguments("osdn_write_keys", "k", {"k": k, "beta": beta, "retain": retain, "d0": d0}, cu_seqlens)
    for name, value in (("eta", eta), ("d_min", d_min), ("d_max", d_max), ("eps", eps)):
        _check_number("osdn_write_keys", name, value)
    if k.dim() != 4:
        raise ValueError(f"osdn_write_keys: k must be [B, T*n_h, H, K], got shape {tuple(k.shape)}")
    B, TN, H, K = k.shape
    if beta is not None and tuple(beta.shape) != (B, TN, H):
        raise ValueError(f"osdn_write_keys: beta must be [B, T*n_h, H] = {(B, TN, H)}, got {tuple(beta.shape)}")
    if beta_aware and beta is None:
        raise ValueError("osdn_write_keys: beta_aware=True needs beta (or pass beta_aware=False)")
    if retain is not None:
        if retain.dim() != 3 or retain.shape[0] != B or retain.shape[2] != H or retain.shape[1] == 0 or TN % retain.shape[1]:
            raise ValueError(f"osdn_write_keys: retain must be [B, T, H] with T dividing {TN}, got {tuple(retain.shape)}")
    inferred = 1 if retain is None else TN // retain.shape[1]
    if n_h is None:
        n_h = inferred
    if isinstance(n_h, bool) or not isinstance(n_h, int) or n_h < 1 or TN % n_h or (retain is not None and n_h != inferred):
        raise ValueError(f"osdn_write_keys: n_h={n_h} does not fit k's {TN} sub-steps" + ("" if retain is None else f" and retain's {retain.shape[1]} tokens"))
    rows = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"osdn_write_keys: with cu_seqlens the batch must be 1 (packed), got B={B}")
        check_offsets(cu_seqlens, TN // n_h, "osdn_write_keys")
        rows = cu_seqlens.numel() - 1
        if retain is None and n_h > 1:
            # Backends read n_h from `retain`; without it they count sub-steps, so the
            # token offsets become sub-step offsets here, once, for all of them.
            cu_seqlens = cu_seqlens * n_h
    if d0 is not None and tuple(d0.shape) not in ((H, K), (rows, H, K)):
        per = "N" if cu_seqlens is not None else "B"
        raise ValueError(f"osdn_write_keys: d0 must be [H, K] or [{per}, H, K] = {(rows, H, K)}, got {tuple(d0.shape)}")
    if not (0 < d_min <= d_max):
        raise ValueError(f"osdn_write_keys: need 0 < d_min <= d_max, got [{d_min}, {d_max}]")
    name = resolve_backend(backend, k.device)
    _check_backend_device("osdn_write_keys", name, k.device)
    fn = _get(_OSDN_BACKENDS, name)
    return fn(
        k,
        beta,
        eta=eta,
        d_min=d_min,
        d_max=d_max,
        retain=retain,
        beta_aware=beta_aware,
        d0=d0,
        eps=eps,
        cu_seqlens=cu_seqlens,
    )


def _check_step(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"decode_step: {message}")


def check_step_inputs(
    q: Tensor, k: Tensor, v: Tensor, state: Tensor, g: Tensor | None, gate: Gate | None, beta: Tensor | None,
    write_key: Tensor | None, erase: Tensor | None, n_h: int, d: Tensor | None, retain: Tensor | None,
) -> None:
    """Raise a ValueError that names the argument and the expected shape (a TypeError for
    an argument of the wrong type or dtype)."""
    check_tensor_arguments(
        "decode_step", "q",
        {"q": q, "k": k, "v": v, "state": state, "g": g, "beta": beta, "write_key": write_key, "erase": erase,
         "d": d, "retain": retain},
        None,
    )
    _check_step(q.dim() == 4 and q.shape[1] == 1, f"q must be [B, 1, H, K] (one token), got shape {tuple(q.shape)}")
    B, _, H, K = q.shape
    _check_step(isinstance(n_h, int) and n_h >= 1, f"n_h must be a positive int, got {n_h!r}")
    _check_step(tuple(k.shape) == (B, n_h, H, K), f"k must be [B, n_h, H, K] = {(B, n_h, H, K)}, got {tuple(k.shape)}")
    _check_step(v.dim() == 4 and tuple(v.shape[:3]) == (B, n_h, H),
                f"v must be [B, n_h, H, V] with B, n_h, H = {(B, n_h, H)}, got {tuple(v.shape)}")
    V = v.shape[-1]
    _check_step(tuple(state.shape) == (B, H, K, V), f"state must be [B, H, K, V] = {(B, H, K, V)}, got {tuple(state.shape)}")
    _check_step(state.dtype in (torch.float32, torch.float64) and state.is_contiguous(),
                f"state must be a contiguous float32 (or float64) tensor, got {state.dtype}")
    for name, t in (("write_key", write_key), ("erase", erase)):
        if t is not None:
            _check_step(tuple(t.shape) == (B, n_h, H, K), f"{name} must be [B, n_h, H, K] = {(B, n_h, H, K)}, got {tuple(t.shape)}")
    if beta is not None:
        _check_step(tuple(beta.shape) == (B, n_h, H), f"beta must be [B, n_h, H] = {(B, n_h, H)}, got {tuple(beta.shape)}")
    if g is not None:
        _check_step(tuple(g.shape) in ((B, 1, H), (B, 1, H, K)),
                    f"g must be [B, 1, H] (scalar gate) or [B, 1, H, K] (channel gate), got {tuple(g.shape)}")
    if gate is not None:
        _check_step(Gate.of(g) == gate, f"gate={gate.name.lower()!r} does not match g of "
                    + ("none" if g is None else f"shape {tuple(g.shape)}"))
    if d is not None:
        _check_step(write_key is None, "OSDN (d given) forms the write keys itself: pass write_key=None")
        _check_step(beta is not None and erase is None, "OSDN preconditions the delta rule: it needs beta and no erase")
        _check_step(tuple(d.shape) == (B, H, K) and d.dtype == state.dtype and d.is_contiguous(),
                    f"d must be a contiguous [B, H, K] = {(B, H, K)} tensor of the state's dtype {state.dtype}, "
                    f"got {tuple(d.shape)} {d.dtype}")
    if retain is not None:
        _check_step(d is not None, "retain (APF) acts on OSDN's d: pass d too")
        _check_step(tuple(retain.shape) == (B, 1, H), f"retain must be [B, 1, H] = {(B, 1, H)}, got {tuple(retain.shape)}")


def decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: Tensor,
    *,
    g: Tensor | None = None,
    gate: str | Gate | None = None,
    beta: Tensor | None = None,
    write_key: Tensor | None = None,
    erase: Tensor | None = None,
    n_h: int = 1,
    scale: float | None = None,
    d: Tensor | None = None,
    retain: Tensor | None = None,
    eta: float = 0.003,
    d_min: float = 0.5,
    d_max: float = 2.0,
    beta_aware: bool = True,
    eps: float = 1e-6,
    beta_scale: float | None = None,
    decay: tuple[Tensor, Tensor] | None = None,
    decay_form: str = "mamba2",
    backend: str = "auto",
) -> Tensor:
    """One token of `linear_recurrence` for every row of a batch, in place: the decoding step.

    Arguments in the token layout of `linear_recurrence` with `T = 1`: `q` `[B, 1, H, K]`;
    `k`, `write_key`, `erase` `[B, n_h, H, K]`; `v` `[B, n_h, H, V]`; `beta` `[B, n_h, H]`;
    `g` `[B, 1, H]` or `[B, 1, H, K]`. `state` `[B, H, K, V]` (float32, or float64 for a
    float64 model) is the state after the tokens so far; it is updated in place, so that a
    captured CUDA graph can replay the step on the same buffers.

    With `d` `[B, H, K]` (OSDN's preconditioner, the state's dtype) the write keys are
    `d * k`, formed and `d` updated sub-step by sub-step as `osdn_write_keys` does (`retain`
    `[B, 1, H]`: APF; `eta`, `d_min`, `d_max`, `beta_aware`, `eps` as there); `d` is updated
    in place too.

    The model's step hands over raw projections: with `beta_scale`, `beta` holds logits and
    the step takes `beta_scale * sigmoid(beta)`; with `decay = (A_log [H], bias [H] or
    [H, K])`, `g` holds the gate's projection and the step takes its log decay in
    `decay_form` (`gate_log_decay`: `-exp(A_log) * softplus(g + bias)` for `"mamba2"`,
    `sigmoid` for `"rwkv7"`, `softplus(-(g + bias))` for `"gla"`), in float32 either way.
    A token tensor may be a column slice of a wider `[B, ...]` output (each row contiguous).

    Returns `o` `[B, 1, H, V]` in the dtype of `v`. Running a prefill through
    `linear_recurrence` and then tokens through this step equals running the whole sequence
    (tests/kernels/test_decode.py). No autograd: decoding is inference.
    """
    kind = Gate.named(gate) if isinstance(gate, str) else gate
    check_step_inputs(q, k, v, state, g, kind, beta, write_key, erase, n_h, d, retain)
    _check_number("decode_step", "scale", scale, optional=True)
    for label, value in (("eta", eta), ("d_min", d_min), ("d_max", d_max), ("eps", eps)):
        _check_number("decode_step", label, value)
    if not (0 < d_min <= d_max):
        raise ValueError(f"decode_step: need 0 < d_min <= d_max, got [{d_min}, {d_max}]")
    kind = Gate.of(g) if kind is None else kind
    _check_raw_step_inputs(q, g, kind, beta, beta_scale, decay)
    form = DecayForm.named(decay_form)
    name = resolve_backend(backend, q.device)
    _check_backend_device("decode_step", name, q.device)
    fn = _get(_STEP_BACKENDS, name)
    raw = {}
    if name == "triton":
        raw = dict(beta_scale=beta_scale, decay=decay, decay_form=form)
    else:  # the definitions take beta and g themselves
        if beta_scale is not None:
            beta = beta_scale * torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
        if decay is not None:
            from .log_decay import log_decay_ref  # (log_decay needs this module)

            g = log_decay_ref(decay[0].reshape(-1, *([1] if kind == Gate.CHANNEL else [])), g,
                              decay[1].reshape(g.shape[2:]), form)[0]
    with torch.no_grad():
        return fn(q, k, v, state, g=g, gate=kind, beta=beta, write_key=write_key, erase=erase, n_h=n_h, scale=scale,
                  d=d, retain=retain, eta=eta, d_min=d_min, d_max=d_max, beta_aware=beta_aware, eps=eps, **raw)


def _check_raw_step_inputs(q: Tensor, g: Tensor | None, kind: Gate, beta: Tensor | None, beta_scale: float | None,
                           decay: tuple[Tensor, Tensor] | None) -> None:
    """`decode_step`'s raw-projection options (`beta_scale`, `decay`), named when wrong."""
    if beta_scale is not None:
        _check_number("decode_step", "beta_scale", beta_scale)
        _check_step(beta is not None, "beta_scale turns beta's logits into beta: pass beta too")
    if decay is None:
        return
    H, K = q.shape[2], q.shape[3]
    _check_step(g is not None, "decay forms the log decay from the gate's projection: pass g too")
    _check_step(isinstance(decay, tuple) and len(decay) == 2 and all(isinstance(t, Tensor) for t in decay),
                "decay must be a pair of tensors (A_log, bias)")
    A_log, bias = decay
    bias_shapes = [(H,)] if kind == Gate.SCALAR else [(H, K), (H * K,)]
    _check_step(tuple(A_log.shape) == (H,), f"decay's A_log must be [H] = {(H,)}, got {tuple(A_log.shape)}")
    _check_step(tuple(bias.shape) in bias_shapes,
                f"decay's bias must be one of {bias_shapes}, got {tuple(bias.shape)}")
    _check_step(A_log.device == q.device and bias.device == q.device, "decay's tensors must be on q's device")
