"""What `archspec compile` prints: the lowered plan, its cost and its caveats, as rich tables.

A hybrid stack also gets a table of its layers: each one's kind, design, parameters and
decoding state at the long context (where attention's KV cache shows).
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from archspec.blocks import cost as block_cost
from archspec.blocks.plan import AttentionPlan, LayerPlan, ModelPlan, RecurrencePlan
from archspec.cost import CostReport


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:g} {unit}".strip()


def _binary(n: int) -> str:
    for scale, prefix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {prefix}"
    return f"{n} B"


def _gate_text(layer: RecurrencePlan) -> str:
    """The gate kind, with its decay form where it has one: `channel (rwkv7 decay)`."""
    return layer.gate if layer.gate == "none" else f"{layer.gate} ({layer.decay} decay)"


def plan_rows(plan: ModelPlan) -> list[tuple[str, str]]:
    """The plan as (field, value) rows, every lowering decision visible."""
    m = plan.mixer
    rows = [
        ("backbone", m.backbone),
        ("gate", _gate_text(m)),
        ("transition", m.transition),
        ("n_h (sub-steps per token)", str(m.n_h)),
        ("beta", "none" if m.beta_scale is None else f"{m.beta_scale:g} * sigmoid  (range [0, {m.beta_scale:g}])"),
        ("write key", m.write_key),
        ("erase vector", "yes" if m.erase else "no"),
    ]
    if m.preconditioner is None:
        rows.append(("preconditioner", "none"))
    else:
        p = m.preconditioner
        rows.append((
            "preconditioner",
            f"osdn  eta={p.eta:g}  d in [{p.d_min:g}, {p.d_max:g}]  apf={'yes' if p.apf else 'no'}  "
            f"beta_aware={'yes' if p.beta_aware else 'no'}  init={p.init}",
        ))
    rows += [
        ("heads x K x V", f"{m.heads} x {m.head_dim} x {m.value_dim}"),
        ("short conv", "off" if m.short_conv == 0 else str(m.short_conv)),
        ("d_model / layers", f"{plan.d_model} / {plan.layers}"),
        ("mlp", plan.mlp if plan.mlp == "none" else f"{plan.mlp} x{plan.mlp_ratio:g}"),
        ("vocab", str(plan.vocab_size)),
        ("provably stable", _stable(plan)),
    ]
    if plan.hybrid:
        rows.insert(0, ("layout", layout_summary(plan)))
    return rows


def _stable(plan: ModelPlan) -> str:
    recurrent = _recurrent(plan)
    if not recurrent:
        return "no recurrent layer"
    return "yes" if all(p.stable for p in recurrent) else "no"


def _recurrent(plan: ModelPlan) -> list[RecurrencePlan]:
    return [p for p in plan.layer_plans if isinstance(p, RecurrencePlan)]


def layout_summary(plan: ModelPlan) -> str:
    """`8 layers: 6 recurrent, 2 attention (3, 7)`."""
    attention = [i for i, p in enumerate(plan.layer_plans) if isinstance(p, AttentionPlan)]
    text = f"{plan.layers} layers: {plan.layers - len(attention)} recurrent, {len(attention)} attention"
    return text + (f" ({', '.join(map(str, attention))})" if attention else "")


def layer_design(layer: LayerPlan) -> str:
    """One line per layer: what it is."""
    if isinstance(layer, AttentionPlan):
        parts = [f"{layer.heads} heads / {layer.kv_heads} kv x {layer.head_dim}"]
        parts.append("NoPE" if layer.rope_theta is None else f"RoPE {layer.rope_theta:g}")
        parts.append("full" if layer.window is None else f"window {layer.window}")
        parts += [name for name, on in (("output gate", layer.output_gate), ("qk-norm", layer.qk_norm)) if on]
        return ", ".join(parts)
    text = f"{layer.backbone}, {layer.transition} n_h={layer.n_h}, gate {_gate_text(layer)}"
    if layer.beta_scale is not None:
        text += f", beta [0, {layer.beta_scale:g}]"
    if layer.preconditioner is not None:
        text += ", osdn"
    return text + f", {layer.heads} x {layer.head_dim} x {layer.value_dim}"


def layers_table(plan: ModelPlan, context: int) -> Table:
    """Per layer: kind, design, parameters, decoding state after `context` tokens."""
    table = Table(title="layers", title_justify="left")
    for column, justify in (("layer", "right"), ("kind", "left"), ("design", "left"), ("params", "right"),
                            (f"state @ {context}", "right")):
        table.add_column(column, justify=justify)
    for index, layer in enumerate(plan.layer_plans):
        table.add_row(
            str(index), layer.kind, layer_design(layer), _si(block_cost.layer_params(layer, plan.d_model)),
            _binary(block_cost.layer_state_bytes(layer, context)),
        )
    return table


PATHS = {"torch": "CPU, torch path", "triton": "GPU, Triton kernel"}


def compile_report(plan: ModelPlan, cost: CostReport, *others: CostReport) -> Group:
    """Plan table, the layers' table of a hybrid stack, cost table and the stability
    caveats, ready for `Console.print`; `others`: the same plan's cost on the
    recurrence's other paths (their FLOPs differ)."""
    plan_table = Table(title=f"{plan.name}: plan", show_header=False, title_justify="left")
    plan_table.add_column("field", style="bold")
    plan_table.add_column("value")
    for field, value in plan_rows(plan):
        plan_table.add_row(field, value)

    cost_table = Table(title="cost", show_header=False, title_justify="left")
    cost_table.add_column("metric", style="bold")
    cost_table.add_column("value", justify="right")
    cost_table.add_column("exact", justify="right")
    cost_table.add_row("parameters", _si(cost.params), f"{cost.params:,}")
    for c in (cost, *others):
        where = PATHS.get(c.backend, c.backend)
        for length, flops in ((c.seq_len, c.flops_per_token), (c.long_context, c.flops_per_token_long)):
            cost_table.add_row(f"FLOPs/token (T={length}, fwd, {where})", _si(flops, "FLOP"), f"{flops:,.0f}")
    for length, state in ((cost.seq_len, cost.state_bytes), (cost.long_context, cost.state_bytes_long)):
        cost_table.add_row(f"state bytes / sequence after {length} tokens", _binary(state), f"{state:,}")

    parts: list = [plan_table]
    if plan.hybrid:
        parts.append(layers_table(plan, cost.long_context))
    parts.append(cost_table)
    caveats = list(dict.fromkeys(c for p in _recurrent(plan) for c in p.caveats))
    if caveats:
        parts.append(Text("stability caveats:", style="bold yellow"))
        parts += [Text(f"  - {caveat}") for caveat in caveats]
    elif _recurrent(plan):
        parts.append(Text("stability: every transition factor has spectral norm <= 1.", style="green"))
    return Group(*parts)
