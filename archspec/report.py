"""What `archspec compile` prints: the lowered plan, its cost and its caveats, as rich tables."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from archspec.blocks.plan import ModelPlan
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


def plan_rows(plan: ModelPlan) -> list[tuple[str, str]]:
    """The plan as (field, value) rows, every lowering decision visible."""
    m = plan.mixer
    rows = [
        ("backbone", m.backbone),
        ("gate", m.gate),
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
        ("provably stable", "yes" if m.stable else "no"),
    ]
    return rows


PATHS = {"torch": "CPU, torch path", "triton": "GPU, Triton kernel"}


def compile_report(plan: ModelPlan, cost: CostReport, *others: CostReport) -> Group:
    """Plan table, cost table and the stability caveats, ready for `Console.print`;
    `others`: the FLOPs of the same plan on the recurrence's other paths."""
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
        cost_table.add_row(f"FLOPs/token (T={c.seq_len}, fwd, {where})", _si(c.flops_per_token, "FLOP"), f"{c.flops_per_token:,.0f}")
    cost_table.add_row("state bytes / sequence", _binary(cost.state_bytes), f"{cost.state_bytes:,}")

    parts: list = [plan_table, cost_table]
    if plan.mixer.caveats:
        parts.append(Text("stability caveats:", style="bold yellow"))
        parts += [Text(f"  - {caveat}") for caveat in plan.mixer.caveats]
    else:
        parts.append(Text("stability: every transition factor has spectral norm <= 1.", style="green"))
    return Group(*parts)
