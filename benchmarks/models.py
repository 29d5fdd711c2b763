"""Whole-model benchmark: the training step of every model spec, ours against
flash-linear-attention's HF model of the same design.

    python benchmarks/models.py [--out DIR] [--specs a,b] [--no-fla] [--rounds N]
                                [--budget-s S] [--warm-workers N] [--merge] [--no-graph] [--smoke]

Each spec in `specs/models` is compiled at the size of issue 17 (d_model 1024, 8 layers,
8 heads of 128, vocabulary 32,000, SwiGLU MLP) with float32 master weights and trained
under bfloat16 autocast (`archspec.training`: the trainer's own step, the loss without
logits, fused AdamW), at three settings that all hold 16,384 tokens a step:

- `T=2048`: B = 8 sequences of 2,048 tokens;
- `T=8192`: B = 2 sequences of 8,192 (B lowered to keep the tokens per step equal);
- `packed`: one row of 16,384 tokens holding documents of mixed lengths (seeded, 64 to
  4,096 tokens), passed as `cu_seqlens` so that no document sees another.

Per setting it reports the median of the forward + loss + backward (tokens/s), the
optimizer step apart (ms), and the peak memory of the whole step (the model's own
weights and AdamW state plus the most the step allocated on top). flash-linear-attention
(`fla.models.*ForCausalLM` with its defaults: fused norms, fused SwiGLU, fused
cross-entropy) is optional: where it has the design (DeltaNet, Gated DeltaNet, gated
DeltaProduct, KDA, GLA, RWKV-7) its config is mapped field by field (`fla_config`), both
parameter counts are printed and must agree within 2%, and the two models are timed in
one process in alternating rounds. GLA's and RWKV-7's fla layers spend a different number
of parameters on gates and low-rank maps than ours (their ranks are not config fields), so
their MLP width is set to bring the totals level (`BALANCED_MLP`); fla's RWKV-7 is its own
macro design (token shift, LoRAs, squared-ReLU MLP), ours the RWKV-7 transition and decay
(`decay: rwkv7`, at most 0.61 nats a token on both sides) in the KDA backbone: that row
compares equal-sized models around the same recurrence. Where fla refuses (an import error, a kernel that will
not run on this machine) the refusal's text is recorded and ours is shown alone. OSDN
and hybrid stacks have no fla model (fla's attention layers lack our output gate and q/k
norm and size their heads from the width).

On a cold machine compiling dominates (the first DeltaNet setting took 370 s on the H200,
mostly fla's autotuning), so first every design is trained one step per setting in
`--warm-workers` spawned processes at once, fla's autotune configs shared out among
`--fla-shards` of them (`WarmJob`); the timing then finds every kernel in Triton's disk
cache. `--budget-s` counts the timing only. Each row records its untimed warm-up steps'
seconds (`warmup_s`), which show what the warming left.

One forward + loss + backward of each model at the first setting (or `--anatomy-at
SETTING`, e.g. `packed`) is profiled (`anatomy.py`, `--no-anatomy` skips it): its
kernels' device time by part of the model
(recurrence, matmuls, loss, norms, short convolution, activations, attention, other) goes
under the table, the heaviest kernels by name into the JSON, so a row that misses its
target shows which part limits it. Beside it, the share of the timed step no kernel ran
and the host's time to issue the forward + loss and the backward (every timed row keeps
both in the JSON): a half whose host time nears the step's share is bound by the host.

Results: `DIR/models.json` (machine, torch / triton / fla versions, commit, every row)
and `DIR/models.md`, written after every setting, so a run cut short by `--budget-s`
keeps what it finished; `--merge` keeps an earlier file's rows of what was not timed now
(specs not named, those `--budget-s` skipped, the settings a run cut short did not reach;
the table's notes say which run measured which), so a run can be split over several
calls (`--specs a,b --merge`). On CUDA ours is also
timed with the step captured as a CUDA graph, as the trainer runs it (`archspec.training.
TrainingStep`, `archspec.graphed_step`: one launch issues the whole forward + loss +
backward, for a step bound by the host) in the same rounds, row `ours-graph`, listed
under the table; not for packed documents, which the trainer runs eagerly (`--no-graph`
leaves it out). The table's `ours` is the eager step, the one profiled. `--smoke` runs
ours only, at a tiny size, on the CPU (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import anatomy
import common
import picks
from common import first_line, machine

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs" / "models"
PARAM_TOLERANCE = 0.02  # fla's parameter count within 2% of ours
# The issue's targets first (a run cut short by its budget keeps them), then the rest.
FIRST = ["deltanet", "kda", "gated-deltanet", "gated-deltaproduct-2", "gla", "rwkv7"]
FLA_MODELS = {  # our design -> fla's model class and config class
    "deltanet": ("DeltaNetForCausalLM", "DeltaNetConfig"),
    "gated-deltanet": ("GatedDeltaNetForCausalLM", "GatedDeltaNetConfig"),
    "gated-deltaproduct": ("GatedDeltaProductForCausalLM", "GatedDeltaProductConfig"),
    "kda": ("KDAForCausalLM", "KDAConfig"),
    "gla": ("GLAForCausalLM", "GLAConfig"),
    "rwkv7": ("RWKV7ForCausalLM", "RWKV7Config"),
}


@dataclass(frozen=True)
class Size:
    """The model size and the three settings (each `tokens` tokens a step)."""

    d_model: int = 1024
    layers: int = 8
    heads: int = 8
    head_dim: int = 128
    vocab: int = 32000
    batch: int = 8
    seq_len: int = 2048
    long_seq_len: int = 8192
    min_doc: int = 64
    max_doc: int = 4096
    device: str = "cuda"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def overrides(self) -> dict[str, Any]:
        return {"model.d_model": self.d_model, "model.layers": self.layers, "mixer.heads": self.heads,
                "mixer.head_dim": self.head_dim, "model.vocab_size": self.vocab}

    def settings(self) -> list[tuple[str, int, int]]:
        """(name, B, T) of the three settings; `packed` is one row."""
        return [(f"T={self.seq_len}", self.batch, self.seq_len),
                (f"T={self.long_seq_len}", max(1, self.tokens // self.long_seq_len), self.long_seq_len),
                ("packed", 1, self.tokens)]


ISSUE_SIZE = Size()
SMOKE_SIZE = Size(d_model=32, layers=1, heads=2, head_dim=16, vocab=64, batch=2, seq_len=32, long_seq_len=64,
                  min_doc=3, max_doc=24, device="cpu")


# --------------------------------------------------------------------------- the designs


def load_plan(spec: Path, size: Size):
    import archspec

    return archspec.lower(archspec.load_spec(spec, list(size.overrides().items())))


def unfit_at(names: list[str], size: Size) -> dict[str, str]:
    """The specs among `names` that have no form at `size`, each with the first problem
    the spec's validation names (a layout placing attention at layer 14 has no 8-layer
    form): the run leaves them out and says why, instead of failing on them."""
    from archspec.errors import ArchspecError

    unfit = {}
    for name in names:
        try:
            load_plan(SPECS / f"{name}.yaml", size)
        except ArchspecError as err:
            problem = next((f"{field}: {message}" if field else message for _, field, message in err.problems),
                           str(err).splitlines()[0])
            unfit[name] = problem
    return unfit


# The decay form of each fla design's gate (`blocks/gates.py`): a plan whose gate forms its
# decay otherwise is not that design.
FLA_DECAY = {"gated-deltaproduct": "mamba2", "gated-deltanet": "mamba2", "kda": "mamba2", "gla": "gla",
             "rwkv7": "rwkv7"}


def fla_design(plan) -> str | None:
    """Which fla model has this plan's design, or None (OSDN, a hybrid stack, or a
    combination fla lacks). fla's `attn` layers have no output gate or q/k norm and size
    their heads from the width, so a hybrid of ours has no field-by-field counterpart."""
    design = _fla_layer(plan)
    gated = plan.mixer.gate != "none"
    if design is not None and gated and plan.mixer.decay != FLA_DECAY.get(design):
        return None
    return design


def _fla_layer(plan) -> str | None:
    """fla's layer of this plan's transition, gate kind and backbone (the decay form aside)."""
    m = plan.mixer
    if m.preconditioner is not None or plan.hybrid:
        return None
    if m.transition == "householder":
        if m.n_h > 1 and m.gate in ("none", "scalar") and m.backbone == ("gdn" if m.gate == "scalar" else "deltanet"):
            return "gated-deltaproduct"
        if m.n_h == 1 and (m.backbone, m.gate) == ("deltanet", "none"):
            return "deltanet"
        if m.n_h == 1 and (m.backbone, m.gate) == ("gdn", "scalar"):
            return "gated-deltanet"
        if m.n_h == 1 and (m.backbone, m.gate) == ("kda", "channel"):
            return "kda"
    if m.transition == "diagonal" and (m.backbone, m.gate) == ("kda", "channel"):
        return "gla"
    if m.transition == "rwkv7" and m.n_h == 1:
        return "rwkv7"
    return None


def fla_config(plan) -> tuple[str, str, dict[str, Any]]:
    """(model class, config class, config fields) of fla 0.6.0 for this plan, field by field."""
    from archspec.blocks.mlp import mlp_hidden_size

    design = fla_design(plan)
    if design is None:
        raise ValueError(f"{plan.name}: flash-linear-attention has no model of this design")
    m, d = plan.mixer, plan.d_model
    common = dict(
        hidden_size=d, num_hidden_layers=plan.layers, vocab_size=plan.vocab_size, norm_eps=plan.norm_eps,
        intermediate_size=mlp_hidden_size(plan.mlp, d, plan.mlp_ratio), tie_word_embeddings=plan.tie_embeddings,
    )
    conv = dict(use_short_conv=m.short_conv > 0, conv_size=m.short_conv or 4)
    neg = dict(allow_neg_eigval=m.beta_scale == 2.0)  # beta in [0, 2]
    expand_v = m.value_dim / m.head_dim
    if design == "deltanet":
        # DeltaNet sizes heads by expand_k: key_dim = hidden * expand_k = heads * head_dim.
        fields = dict(num_heads=m.heads, expand_k=m.heads * m.head_dim / d, expand_v=m.heads * m.value_dim / d,
                      use_gate=False, use_beta=True, use_output_norm=True, qk_norm="l2", qk_activation="silu",
                      **conv, **neg)
    elif design == "gated-deltanet":
        fields = dict(num_heads=m.heads, head_dim=m.head_dim, expand_v=expand_v, use_gate=True,
                      output_gate_activation="swish", **conv, **neg)
    elif design == "gated-deltaproduct":
        gated = m.gate == "scalar"
        fields = dict(num_heads=m.heads, head_dim=m.head_dim, expand_v=expand_v, num_householder=m.n_h,
                      use_forget_gate=gated, use_output_gate=gated, **conv, **neg)
    elif design == "kda":
        fields = dict(num_heads=m.heads, head_dim=m.head_dim, expand_v=expand_v, **conv, **neg)
    elif design == "gla":
        fields = dict(num_heads=m.heads, expand_k=m.heads * m.head_dim / d, expand_v=m.heads * m.value_dim / d,
                      use_output_gate=True, feature_map=None, use_gk=True, use_gv=False, **conv)
    else:  # rwkv7: fla's own macro design (token shift, LoRAs, squared-ReLU MLP of two matrices)
        fields = dict(num_heads=m.heads, head_dim=m.head_dim, value_dim=m.heads * m.value_dim)
        # Two MLP matrices instead of SwiGLU's three: the width that spends the same parameters.
        fields["intermediate_size"] = 3 * common["intermediate_size"] // 2
    model_cls, config_cls = FLA_MODELS[design]
    return model_cls, config_cls, {**common, **fields}


# Designs whose fla layer spends a different number of parameters on its gates than ours:
# GLA's decay is rank 16 (ours rank V) and its output gate a full d x H*V map (ours low
# rank); RWKV-7 has its own LoRAs and no output-gate or decay projections of ours. fla's
# config exposes none of these ranks, so the MLP width takes up the difference: the
# intermediate size that brings the totals level (matrices per MLP: 3 SwiGLU, 2 RWKV-7).
BALANCED_MLP = {"gla": 3, "rwkv7": 2}


def fla_model_config(plan, params: int):
    """fla's config object for `plan`, its MLP width balanced where `BALANCED_MLP` says."""
    import fla.models

    model_cls, config_cls, fields = fla_config(plan)
    design = fla_design(plan)
    if design in BALANCED_MLP:
        with torch.device("meta"):
            probe = getattr(fla.models, model_cls)(getattr(fla.models, config_cls)(**fields))
        gap = params - sum(p.numel() for p in probe.parameters())
        fields["intermediate_size"] += round(gap / (plan.layers * BALANCED_MLP[design] * plan.d_model))
    return model_cls, getattr(fla.models, config_cls)(**fields)


def build_fla(plan, device: str, params: int):
    import fla.models

    model_cls, config = fla_model_config(plan, params)
    return getattr(fla.models, model_cls)(config).to(device)


# --------------------------------------------------------------------------- the step


def document_lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Mixed document lengths, log-uniform in [low, high], summing to `total`."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        u = torch.rand((), generator=gen).item()
        lengths.append(int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


@dataclass
class Batch:
    inputs: torch.Tensor
    labels: torch.Tensor  # aligned: labels[t] is what position t predicts (ours)
    cu_seqlens: torch.Tensor | None = None

    @property
    def hf_labels(self) -> torch.Tensor:
        """The same targets as HF models take them (they shift: position t predicts
        `hf_labels[t + 1]`), so fla scores exactly the positions ours does."""
        shifted = torch.roll(self.labels, 1, 1)
        shifted[:, 0] = self.inputs[:, 0]
        return shifted


def make_batch(size: Size, B: int, T: int, packed: bool, seed: int = 0) -> Batch:
    from archspec.blocks.loss import packed_labels
    from archspec.kernels import IGNORE_INDEX

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(size.vocab, (B, T), generator=gen)
    if packed:
        lengths = document_lengths(T, size.min_doc, size.max_doc, seed)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        labels = packed_labels(tokens, cu)
        return Batch(tokens.to(size.device), labels.to(size.device), cu.to(size.device))
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    return Batch(tokens.to(size.device), labels.to(size.device))


class Trainee:
    """One model's training step, split as the benchmark times it."""

    def __init__(self, name: str, model: torch.nn.Module, loss_fn: Callable[[Batch], torch.Tensor], device: str):
        from archspec.training import make_optimizer

        self.name, self.model, self.loss_fn, self.device = name, model, loss_fn, device
        self.model.train()
        self.optimizer = make_optimizer(model, lr=1e-4, device=device)
        self.params = sum(p.numel() for p in model.parameters())

    def forward_backward(self, batch: Batch) -> tuple[float, float]:
        """One forward + loss + backward; the host's seconds to issue each half. CUDA runs
        them asynchronously, so a half whose host time nears its device time is bound
        by the host (Python, launches), not by its kernels."""
        began = time.perf_counter()
        loss = self.loss_fn(batch)
        issued = time.perf_counter()
        loss.backward()
        return issued - began, time.perf_counter() - issued

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)

    def resident_bytes(self) -> int:
        """Weights, buffers and AdamW state: what the model holds between steps."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def ours(plan, size: Size) -> Trainee:
    from archspec.blocks import build_model
    from archspec.training import training_loss

    model = build_model(plan).to(size.device)

    def loss(batch: Batch) -> torch.Tensor:
        return training_loss(model, batch.inputs, batch.labels, device=size.device, cu_seqlens=batch.cu_seqlens)

    return Trainee("ours", model, loss, size.device)


GRAPHED = "ours-graph"


class GraphedTrainee(Trainee):
    """Ours with the step captured as a CUDA graph (`archspec.graphed_step`), one graph for
    the batch shape at hand (a new shape drops the old graph and captures again). The host
    time is the whole call (check, copies, replay) as the forward's, none as the backward's."""

    def __init__(self, plan, size: Size):
        from archspec.blocks import build_model

        super().__init__(GRAPHED, build_model(plan).to(size.device), lambda batch: None, size.device)
        self.step = None

    def forward_backward(self, batch: Batch) -> tuple[float, float]:
        from archspec.graphed_step import GraphedStep

        began = time.perf_counter()
        shape = tuple(batch.inputs.shape)
        if self.step is None or self.step.shape != shape:
            self.step = None  # the old graph and its memory pool go before the new capture
            torch.cuda.empty_cache()
            self.step = GraphedStep(self.model, *shape)
        self.step(batch.inputs, batch.labels, batch.cu_seqlens)
        return time.perf_counter() - began, 0.0

    def resident_bytes(self) -> int:
        """Weights, AdamW state and the graph's memory pool: a replay allocates nothing, the
        pool holds the step's activations and gradients between steps."""
        return super().resident_bytes() + (self.step.pool_bytes[0] if self.step is not None else 0)


def theirs(plan, size: Size, params: int) -> Trainee:
    from archspec.training import autocast_for

    model = build_fla(plan, size.device, params)

    def loss(batch: Batch) -> torch.Tensor:
        kwargs = {} if batch.cu_seqlens is None else {"cu_seqlens": batch.cu_seqlens}
        with autocast_for(size.device):
            return model(input_ids=batch.inputs, labels=batch.hf_labels, **kwargs).loss

    return Trainee("fla", model, loss, size.device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], None], device: str) -> tuple[float, int]:
    """(seconds, bytes allocated on top of what was allocated before) of one call."""
    _sync(device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn()
    _sync(device)
    seconds = time.perf_counter() - start
    extra = torch.cuda.max_memory_allocated() - before if cuda else 0
    return seconds, extra


def beside_fla(plan, mine, build_theirs: Callable[[int], Any], *, with_fla: bool, label: str,
               log: Callable[[str], None]) -> tuple[list, str | None]:
    """`[mine]` or `[mine, fla's]` (anything with `.params`), and why fla's is missing:
    no fla model of this design, fla refused (its error), or a parameter count more than
    `PARAM_TOLERANCE` from ours (not comparable). Both counts are logged. Without
    `with_fla` fla is not asked, yet a design fla has no model of still says so: that
    is a fact of the design, not of this run, and a merged run keeps it."""
    if plan.hybrid:
        return [mine], "a hybrid stack: fla's attention layers have no field-by-field counterpart of ours"
    if fla_design(plan) is None:
        return [mine], "flash-linear-attention has no model of this design"
    if not with_fla:
        return [mine], None
    try:
        their = build_theirs(mine.params)
    except Exception as exc:  # an import error, a kernel that will not run here: recorded, ours shown alone
        return [mine], refusal_text(exc)
    log(f"{label}: params ours {mine.params:,} / fla {their.params:,} ({their.params / mine.params - 1:+.2%})")
    if abs(their.params / mine.params - 1) > PARAM_TOLERANCE:
        return [mine], f"not comparable: fla's config has {their.params:,} parameters against our {mine.params:,}"
    return [mine, their], None


def refusal_text(exc: BaseException, limit: int = 2000) -> str:
    """What a peer said when it refused: its exception, whole up to `limit` characters."""
    return f"{type(exc).__name__}: {exc}"[:limit]


@dataclass
class Row:
    design: str
    spec: str
    setting: str
    impl: str
    batch: int
    seq_len: int
    documents: int | None = None
    params: int | None = None
    tokens_per_s: float | None = None
    step_ms: float | None = None
    optimizer_ms: float | None = None
    peak_mem_bytes: int | None = None
    rounds: int = 0
    refused: str | None = None
    warmup_s: float | None = None  # the untimed steps (compiling and autotuning, where the caches are cold)
    step_ms_all: list[float] = field(default_factory=list)
    # the host's time to issue the forward + loss and the backward (medians; `Trainee.forward_backward`)
    host_forward_ms: float | None = None
    host_backward_ms: float | None = None


def time_side_by_side(trainees: list[Trainee], batch: Batch, rounds: int, warmup: int, device: str,
                      rows: dict[str, Row]) -> None:
    """Warm each up, then alternate rounds (the order flips every round); the median step.

    A trainee that raises (warm-up or timed) is dropped with its error in its row."""
    live = list(trainees)
    steps: dict[str, list[float]] = {t.name: [] for t in live}
    optim: dict[str, list[float]] = {t.name: [] for t in live}
    peak: dict[str, int] = {t.name: 0 for t in live}
    host: dict[str, list[tuple[float, float]]] = {t.name: [] for t in live}

    def attempt(t: Trainee, timed: bool) -> None:
        try:
            if timed:
                s, extra = _timed(lambda: host[t.name].append(t.forward_backward(batch)), device)
                o, extra_o = _timed(t.optimizer_step, device)
                steps[t.name].append(s)
                optim[t.name].append(o)
                peak[t.name] = max(peak[t.name], extra, extra_o)
            else:
                t.forward_backward(batch)
                t.optimizer_step()
        except Exception as exc:  # fla's kernels may refuse this machine: record, show ours
            rows[t.name].refused = refusal_text(exc)
            t.model.zero_grad(set_to_none=True)
            live.remove(t)

    for t in list(live):
        began = time.perf_counter()
        for _ in range(warmup):
            if t in live:
                attempt(t, timed=False)
        _sync(device)
        rows[t.name].warmup_s = round(time.perf_counter() - began, 2)
    for r in range(rounds):
        for t in (list(live) if r % 2 == 0 else live[::-1]):
            attempt(t, timed=True)
    tokens = batch.inputs.numel()
    for t in live:
        row = rows[t.name]
        median = statistics.median(steps[t.name])
        row.tokens_per_s = tokens / median
        row.step_ms = 1e3 * median
        row.optimizer_ms = 1e3 * statistics.median(optim[t.name])
        row.step_ms_all = [round(1e3 * s, 3) for s in steps[t.name]]
        row.host_forward_ms = 1e3 * statistics.median(f for f, _ in host[t.name])
        row.host_backward_ms = 1e3 * statistics.median(b for _, b in host[t.name])
        row.rounds = rounds
        row.peak_mem_bytes = t.resident_bytes() + peak[t.name] if device.startswith("cuda") else None


# --------------------------------------------------------------------------- warm caches


@dataclass(frozen=True)
class WarmJob:
    """One design's model (ours or fla's) run once in a worker, so that its kernels are
    compiled into Triton's disk cache before the timing: `setup` says what is run (a
    `Size` here, a `decode.Decode` there); fla's autotuners compile only the configs of
    `shard` `(j, n)`, `configs[j::n]` (`common._worker_init`)."""

    spec: str
    impl: str
    setup: Any
    shard: tuple[int, int] | None = None


def _warm(job: WarmJob) -> str:
    """This benchmark's warm-up: one training step per setting."""
    from archspec.blocks import count_params

    size = job.setup
    plan = load_plan(SPECS / f"{job.spec}.yaml", size)
    trainee = ours(plan, size) if job.impl == "ours" else theirs(plan, size, count_params(plan))
    for setting, B, T in size.settings():
        trainee.forward_backward(make_batch(size, B, T, packed=setting == "packed"))
        trainee.optimizer_step()
    return "ok"


def _run_warm_job(job_and_work: tuple[WarmJob, Callable[[WarmJob], str]]) -> str:
    job, work = job_and_work
    common._SHARD = job.shard
    try:
        return work(job)
    except Exception as exc:  # noqa: BLE001  (fla's refusal is recorded by the timing)
        return first_line(exc)
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# Device memory one warm-up process may hold at the issue's size: on the H200 fifteen at
# once held 12.6-15.6 GB each, ran the device out of memory and left fla's jobs cold.
WARM_JOB_BYTES = 16 * 2**30


def fitting_workers(workers: int) -> int:
    """`workers`, fewer where the device's free memory holds fewer warm-up processes."""
    if not torch.cuda.is_available():
        return workers
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(workers, free // WARM_JOB_BYTES))


def warm_caches(names: list[str], size: Size, setup: Any, work: Callable[[WarmJob], str], *, with_fla: bool,
                workers: int, fla_shards: int, log: Callable[[str], None], pinned: dict | None = None,
                covered: set[str] = frozenset()) -> None:
    """Compile every design's kernels in `workers` spawned processes at once (as many as
    the device's memory holds, `fitting_workers`): ours in one job, fla's in `fla_shards`
    jobs that share out its autotune configs. On a cold H200 the first DeltaNet setting
    of this benchmark took 370 s in one process, fla's autotuning most of it. `work` is a
    module-level function (it is pickled to the workers). With `pinned` (an earlier run's
    autotune picks, `picks.py`), a design they cover (`covered`) has one fla job, which
    compiles the recorded configs; the others still share theirs out."""
    if fitting_workers(workers) < workers:
        log(f"warm-up: {fitting_workers(workers)} processes, not {workers}: the device's free memory holds no more")
        workers = fitting_workers(workers)
    jobs = []
    for name in names:
        jobs.append(WarmJob(name, "ours", setup))
        if with_fla and fla_design(load_plan(SPECS / f"{name}.yaml", size)) is not None:
            shards = 1 if pinned and name in covered else fla_shards
            jobs += [WarmJob(name, "fla", setup, (j, shards)) for j in range(shards)]
    began = time.perf_counter()
    statuses = common.map_in_workers(_run_warm_job, [(job, work) for job in jobs], workers, fresh_process=True,
                                     label=lambda item: f"warmed {item[0].spec}/{item[0].impl}", log=log, pinned=pinned)
    failed = [f"{j.spec}/{j.impl}: {s}" for j, s in zip(jobs, statuses) if s != "ok"]
    log(f"warmed {len(jobs) - len(failed)} of {len(jobs)} jobs in {time.perf_counter() - began:.0f} s"
        + ("" if not failed else "; not warmed: " + "; ".join(failed)))


# --------------------------------------------------------------------------- one design


def setting_specific(refusal: str) -> bool:
    """Whether a refusal may not repeat at another setting: running out of memory depends
    on the batch; a kernel refusing the machine (fla's gated backward on Triton 3.6 took
    two minutes to get there at the packed setting) does not."""
    return "OutOfMemoryError" in refusal or "out of memory" in refusal


def run_design(spec: Path, size: Size, *, with_fla: bool, rounds: int, warmup: int, log: Callable[[str], None],
               on_setting: Callable[[list[Row]], None] = lambda rows: None,
               anatomies: dict[str, dict] | None = None, anatomy_at: str | None = None,
               graphed: bool = False) -> list[Row]:
    """The rows of one design, every setting's handed to `on_setting` as it is measured
    (a run cut short keeps them: a cold machine spends minutes compiling the first).
    With `anatomies`, one step of each model at the setting `anatomy_at` (default: the
    first) is profiled into it under the spec's name (`anatomy.profile`). With `graphed`
    (CUDA), ours is also timed with its step captured as a CUDA graph (`GraphedTrainee`,
    row `ours-graph`) beside the others, in the settings without packed documents; its
    peak counts the graph's memory pool whole (`GraphedTrainee.resident_bytes`), and it is
    not profiled."""
    anatomy_at = anatomy_at or size.settings()[0][0]
    plan = load_plan(spec, size)
    design = fla_design(plan)
    trainees, refusal = beside_fla(plan, ours(plan, size), lambda params: theirs(plan, size, params),
                                   with_fla=with_fla, label=spec.stem, log=log)
    if graphed and size.device.startswith("cuda"):
        trainees.insert(1, GraphedTrainee(plan, size))
    rows: list[Row] = []
    for setting, B, T in size.settings():
        batch = make_batch(size, B, T, packed=setting == "packed")
        docs = None if batch.cu_seqlens is None else batch.cu_seqlens.numel() - 1
        timed = [t for t in trainees if not (t.name == GRAPHED and batch.cu_seqlens is not None)]
        by_impl = {t.name: Row(spec.stem if design is None else design, spec.stem, setting, t.name, B, T, docs, t.params)
                   for t in timed}
        time_side_by_side(timed, batch, rounds, warmup, size.device, by_impl)
        measured = list(by_impl.values())
        if refusal is not None and "fla" not in by_impl:
            measured.append(Row(design or spec.stem, spec.stem, setting, "fla", B, T, docs, refused=refusal))
        rows += measured
        if anatomies is not None and setting == anatomy_at:  # after the timing, never in it; before the rows are handed on
            anatomies[spec.stem] = {"setting": setting, "impls": {
                t.name: profile_step(t, batch) for t in timed if t.name != GRAPHED and not by_impl[t.name].refused}}
        on_setting(measured)
        for row in by_impl.values():  # a peer refusing the design (not this setting's size) is not asked again
            if row.impl != "ours" and row.refused and not setting_specific(row.refused):
                trainees = [t for t in trainees if t.name != row.impl]
                refusal = row.refused
        for row in by_impl.values():
            log(f"  {setting:>8} {row.impl:10}: " + (f"refused: {row.refused.splitlines()[0]}" if row.refused else
                f"{row.tokens_per_s:,.0f} tok/s, optimizer {row.optimizer_ms:.1f} ms, peak "
                f"{'n/a' if row.peak_mem_bytes is None else f'{row.peak_mem_bytes / 1e9:.2f} GB'}"))
    for t in trainees:
        del t.model, t.optimizer
    if size.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def profile_step(trainee: Trainee, batch: Batch) -> dict:
    """One forward + loss + backward under the profiler (its gradients are dropped)."""
    try:
        return anatomy.profile(lambda: trainee.forward_backward(batch), trainee.device)
    finally:
        trainee.model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------- results


def _gb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e9:.2f}"


def markdown(record: dict[str, Any]) -> str:
    m, s = record["machine"], record["size"]
    lines = [
        "# Whole-model training step: ours against flash-linear-attention",
        "",
        f"{m.get('device', 'CPU')}, torch {m['torch']}, Triton {m['triton']}, fla {m['fla'] or 'not installed'}, "
        f"commit {m['commit'] or '?'}, {m['date']}.",
        f"d_model {s['d_model']}, {s['layers']} layers, {s['heads']} heads of {s['head_dim']}, vocabulary "
        f"{s['vocab']}; float32 weights{' under bfloat16 autocast' if s['device'] == 'cuda' else ''}; {s['batch'] * s['seq_len']:,} tokens a step in "
        f"every setting (T={s['long_seq_len']} with B={max(1, s['batch'] * s['seq_len'] // s['long_seq_len'])}; "
        f"`packed`: one row of documents of {s['min_doc']}-{s['max_doc']} tokens with cu_seqlens). tokens/s: "
        f"forward + loss + backward, median of {record['rounds']} alternating rounds; optimizer: fused AdamW, ms; "
        "peak: the model's weights and AdamW state plus the most the step allocated, GB.",
        "",
        "| design | spec | setting | params ours / fla | tokens/s ours / fla | ratio | optimizer ms ours / fla | peak GB ours / fla | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = record["rows"]
    order = [name for name, _, _ in Size(**s).settings()]
    keys = sorted({(r["spec"], r["setting"]) for r in rows}, key=lambda k: (k[0], order.index(k[1])))
    for spec, setting in keys:
        group = {r["impl"]: r for r in rows if r["spec"] == spec and r["setting"] == setting}
        o, f = group.get("ours"), group.get("fla")
        if o is None:
            continue
        if f is None or f.get("refused"):
            note = "" if f is None else f"fla: {f['refused'].splitlines()[0][:90]}"
            lines.append(f"| {o['design']} | {spec} | {setting} | {o['params']:,} | {o['tokens_per_s']:,.0f} | - | "
                         f"{o['optimizer_ms']:.1f} | {_gb(o['peak_mem_bytes'])} | {note} |")
            continue
        speed = o["tokens_per_s"] / f["tokens_per_s"]
        mem = "-" if not (o["peak_mem_bytes"] and f["peak_mem_bytes"]) else f"{o['peak_mem_bytes'] / f['peak_mem_bytes']:.2f}"
        lines.append(f"| {o['design']} | {spec} | {setting} | {o['params']:,} / {f['params']:,} | "
                     f"{o['tokens_per_s']:,.0f} / {f['tokens_per_s']:,.0f} | {speed:.2f} | "
                     f"{o['optimizer_ms']:.1f} / {f['optimizer_ms']:.1f} | {_gb(o['peak_mem_bytes'])} / {_gb(f['peak_mem_bytes'])} | {mem} |")
    import common

    lines += graphed_notes(rows)
    lines += measured_notes(rows)
    profiled = record.get("anatomy", {})
    at_profiled = [r for r in rows
                   if r.get("step_ms") and r["spec"] in profiled and r["setting"] == profiled[r["spec"]]["setting"]]
    step_ms = {(r["spec"], r["impl"]): r["step_ms"] for r in at_profiled}
    host_ms = {(r["spec"], r["impl"]): (r["host_forward_ms"], r["host_backward_ms"])
               for r in at_profiled if r.get("host_forward_ms") is not None}
    lines += anatomy.markdown(profiled, step_ms, host_ms)
    lines += common.run_notes(record)
    return "\n".join(lines) + "\n"


def graphed_notes(rows: list[dict]) -> list[str]:
    """The `ours-graph` rows: tokens/s with the step replayed from a CUDA graph (the
    trainer's step), against ours eager and fla's in the same rounds, and the peak where measured
    (the graph's pool counted whole)."""
    parts = []
    for r in rows:
        if r["impl"] != GRAPHED:
            continue
        group = {x["impl"]: x for x in rows if x["spec"] == r["spec"] and x["setting"] == r["setting"]}
        if r.get("refused") or not r.get("tokens_per_s"):
            parts.append(f"{r['spec']} {r['setting']}: refused ({(r.get('refused') or '?').splitlines()[0][:120]})")
            continue
        against = [f"{r['tokens_per_s'] / group[k]['tokens_per_s']:.2f}x {k}" for k in ("ours", "fla")
                   if group.get(k, {}).get("tokens_per_s")]
        if r.get("peak_mem_bytes"):
            against.append(f"peak {_gb(r['peak_mem_bytes'])} GB")
        parts.append(f"{r['spec']} {r['setting']}: {r['tokens_per_s']:,.0f} ({', '.join(against)})")
    if not parts:
        return []
    return ["", "Ours with the step replayed from a CUDA graph, as the trainer runs it (`archspec.training."
            "TrainingStep`; packed documents run eagerly), tokens/s: "
            + "; ".join(parts) + "."]


def measured_notes(rows: list[dict]) -> list[str]:
    """Which machine, commit (and kernel sources, `kernels_sha1`) each spec's rows were
    measured at, where a merged file holds rows of several runs. Ours and fla's of one row
    always share a run; rows of different machines compare only through their ratios."""
    runs: dict[tuple, dict[str, list[str]]] = {}  # run -> spec -> its settings measured there
    for r in rows:
        m = r.get("measured") or {}
        key = (m.get("device"), m.get("commit"), m.get("kernels_sha1"), m.get("date"))
        settings = runs.setdefault(key, {}).setdefault(r["spec"], [])
        if r.get("setting") not in settings:
            settings.append(r.get("setting"))
    if len(runs) < 2:
        return []
    spans = Counter(spec for specs in runs.values() for spec in specs)  # how many runs measured each spec

    def label(spec: str, settings: list[str]) -> str:
        # a spec whose settings come from different runs (a run cut short) names them
        return spec if spans[spec] == 1 else f"{spec} ({', '.join(map(str, settings))})"

    parts = [f"{', '.join(label(s, st) for s, st in specs.items())}: {device or 'device ?'}, commit {c or '?'}, "
             f"kernels {k or '?'}, {d or '?'}"
             for (device, c, k, d), specs in sorted(runs.items(), key=lambda kv: str(kv[0][3]))]
    note = "Measured in several runs (`--merge`): " + "; ".join(parts) + "."
    if len({device for device, *_ in runs}) > 1:
        note += " The runs were on different machines: compare tokens/s across rows by their ratios to fla's only."
    return ["", note]


def write_results(out: Path, record: dict[str, Any]) -> None:
    import common

    common.write_results(out, "models", record, markdown(record))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    ap.add_argument("--specs", default=None, help="comma-separated spec names (default: every spec in specs/models)")
    ap.add_argument("--no-fla", action="store_true", help="ours only")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per setting (alternating)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model and setting")
    ap.add_argument("--budget-s", type=float, default=None, help="start no design after this many seconds")
    ap.add_argument("--warm-workers", type=int, default=None,
                    help="processes that compile every design first (default 8 on CUDA, 0 with --smoke; 0: none)")
    ap.add_argument("--fla-shards", type=int, default=3, help="warm-up jobs that share one fla model's autotune configs")
    ap.add_argument("--retune", action="store_true",
                    help=f"let fla autotune afresh, not from the picks an earlier run left in --out ({picks.FILE}; "
                         "a fresh --out starts from the committed ones)")
    ap.add_argument("--no-anatomy", action="store_true",
                    help="profile no step (by default one step of each model at the first setting is profiled)")
    ap.add_argument("--anatomy-at", default=None, metavar="SETTING",
                    help="the setting whose step is profiled (T=2048, T=8192 or packed at the issue's size; default the first)")
    ap.add_argument("--smoke", action="store_true", help="ours only, tiny size, on the CPU")
    ap.add_argument("--no-graph", action="store_true",
                    help="leave out ours with its step captured as a CUDA graph, as the trainer runs it "
                         "(row ours-graph; never for packed documents)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows not timed now (specs, settings) from an earlier models.json in --out "
                         "(runs split over calls)")
    args = ap.parse_args(argv)

    size = SMOKE_SIZE if args.smoke else ISSUE_SIZE
    if size.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on the CPU", file=sys.stderr)
        return 2
    every = sorted(p.stem for p in SPECS.glob("*.yaml"))
    names = args.specs.split(",") if args.specs else [n for n in FIRST if n in every] + [n for n in every if n not in FIRST]
    missing = [n for n in names if not (SPECS / f"{n}.yaml").exists()]
    if missing:
        print(f"unknown spec(s): {', '.join(missing)} (see {SPECS})", file=sys.stderr)
        return 2
    setting_names = [name for name, _, _ in size.settings()]
    if args.anatomy_at is not None and args.anatomy_at not in setting_names:
        print(f"--anatomy-at {args.anatomy_at}: not a setting of this size ({', '.join(setting_names)})", file=sys.stderr)
        return 2
    with_fla = not (args.no_fla or args.smoke)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {msg}", flush=True)

    unfit = unfit_at(names, size)
    for name, problem in unfit.items():
        log(f"{name}: left out, no form at this size ({problem})")
    names = [n for n in names if n not in unfit]
    if not names:
        print("no spec to time at this size", file=sys.stderr)
        return 2
    record: dict[str, Any] = {"machine": machine(), "size": asdict(size), "rounds": args.rounds, "rows": [],
                              "skipped": [], "failed": {}, "anatomy": {}, "unfit": unfit}
    out = Path(args.out)
    if args.merge and (out / "models.json").exists():
        # An earlier spec's rows go when this run starts timing it (`forget`): a spec the
        # budget skips, or the run never reaches, keeps what was measured before.
        earlier = json.loads((out / "models.json").read_text())
        record["rows"] = earlier.get("rows", [])
        record["failed"] = earlier.get("failed", {})
        record["anatomy"] = earlier.get("anatomy", {})
        record["unfit"] = {**{k: v for k, v in earlier.get("unfit", {}).items() if k not in names}, **unfit}
        record["earlier_machines"] = [earlier.get("machine"), *earlier.get("earlier_machines", [])]
    # Each row says which tree it was measured on: `--merge` keeps rows of earlier runs.
    measured = {k: record["machine"].get(k) for k in ("commit", "kernels_sha1", "date", "device")}
    pinned = picks.pin_from(out, log) if with_fla and not args.retune and size.device == "cuda" else None
    workers = args.warm_workers if args.warm_workers is not None else 0 if args.smoke else 8
    if workers > 0:
        warm_caches(names, size, size, _warm, with_fla=with_fla, workers=workers, fla_shards=args.fla_shards, log=log,
                    pinned=pinned, covered=picks.covered(out / picks.FILE))
    timing_began = time.perf_counter()  # the budget is the timing's own: warming is not counted
    for i, name in enumerate(names):
        spent = time.perf_counter() - timing_began
        if args.budget_s is not None and i and spent + spent / i > args.budget_s:
            record["skipped"] = names[i:]
            log(f"budget: {spent:.0f} s spent, skipping {', '.join(names[i:])}")
            break

        record["failed"].pop(name, None)
        record["anatomy"].pop(name, None)

        def keep(rows: list[Row]) -> None:
            # A setting's earlier rows go when its new ones come, so a run cut short in the
            # middle of a design keeps the earlier rows of the settings it did not reach.
            again = {(r.spec, r.setting) for r in rows}
            record["rows"] = [r for r in record["rows"] if (r["spec"], r["setting"]) not in again]
            record["rows"] += [{**asdict(r), "measured": measured} for r in rows]
            write_results(out, record)

        try:
            run_design(SPECS / f"{name}.yaml", size, with_fla=with_fla, rounds=args.rounds, warmup=args.warmup,
                       log=log, on_setting=keep, anatomies=None if args.no_anatomy else record["anatomy"],
                       anatomy_at=args.anatomy_at, graphed=not args.no_graph)
        except Exception as exc:  # one design failing (out of memory, ...) must not lose the others
            record["failed"][name] = traceback.format_exc()
            log(f"{name} failed: {first_line(exc)}")
        write_results(out, record)
        if with_fla and size.device == "cuda":
            # after every design: a run cut short keeps what it tuned; the design counts as
            # covered where fla's model ran a whole step at every setting
            fla_rows = [r for r in record["rows"] if r["spec"] == name and r["impl"] == "fla"]
            whole = bool(fla_rows) and all(r["refused"] is None for r in fla_rows)
            picks.keep(out, log, designs=[name] if whole else ())
    write_results(out, record)
    log(f"wrote {out / 'models.json'} and {out / 'models.md'}")
    return 1 if record["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
