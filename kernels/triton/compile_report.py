"""Compile every kernel specialization for Hopper (sm_90) on a machine without a GPU.

Runs the backend's forward and backward on CPU tensors with each launch replaced by an
offline `triton.compile` for `cuda:90`, specialized as the GPU launcher does (pointers and
integers divisible by 16 marked so: without it every load compiles to 2-byte scalar loads,
which doubles a half-precision tile's registers and misreports spills), then reads registers, spills and shared memory
off the cubin (`cuobjdump`, shipped with Triton). GPU compile errors (shapes the
interpreter accepts but the compiler rejects) and register spills show up here, before
any device time is spent. Usage:

    python -m archspec.kernels.triton.compile_report [--plans deltanet,kda,...,decode,gates,fused,model] [--dtype bfloat16] [--dump DIR]

`fused` and `model` compile a training step of the model specs at the whole-model
benchmark's widths (the fused pieces; `model` with the recurrence) and count each kernel's
2-byte scalar global accesses, the sign of a load the compiler could not vectorize.

`--dump DIR` writes each kernel's PTX, TTGIR and SASS there (the one debugging aid).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory a block may take on an H100/H200
REPORT: list[dict] = []
DUMP: Path | None = None  # `--dump`: where each kernel's PTX, TTGIR and SASS go


def _resource_usage(cubin: bytes) -> dict:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k: int(v) for k, v in found.items()}


def _sass(cubin: bytes) -> str:
    """The machine code (for instruction counts: what a kernel spends its issue slots on)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=False).stdout


def half_scalar_accesses(ptx: str) -> int:
    """Global loads and stores of one 2-byte element each (`ld.global.b16`, `st.global.b16`)
    in a kernel's PTX. A row of half-precision data read this way takes 8x the memory
    instructions of 16-byte vector accesses, which binds a streaming kernel by issue rather
    than bandwidth; it happens where the compiler cannot prove that a mask or an offset
    holds for runs of 8 elements (an integer argument left unspecialized, a width not
    divisible by 16). A few are legitimate: one element a row (a target's logit)."""
    return len(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z]+)*\.b16\b", ptx))


class _OfflineLauncher:
    def __init__(self, fn, grid):
        self.fn, self.grid = fn, grid

    def __call__(self, *args, **kwargs):
        fn = self.fn
        names = fn.arg_names
        values = dict(zip(names, args))
        values.update(kwargs)
        options = {k: values.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "launch_pdl") if k in values}
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(names):
            val = values.get(name)
            param = fn.params[i]
            if param.is_constexpr or val is None:
                signature[name] = "constexpr"
                constexprs[name] = val
            elif isinstance(val, torch.Tensor):
                signature[name] = "*" + _TYPES[val.dtype]
                if val.data_ptr() % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(val, bool):
                signature[name] = "i1"
            elif isinstance(val, int):
                signature[name] = "i32"
                if val % 16 == 0 and not param.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(val, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: cannot type argument {name}={val!r}")
        src = ASTSource(fn, signature, constexprs, attrs)
        compiled = triton.compile(src, target=TARGET, options=options)
        usage = _resource_usage(compiled.asm["cubin"])
        usage["SHARED"] = compiled.metadata.shared  # dynamic shared memory, what the launch asks for
        ptx = compiled.asm.get("ptx", "")
        usage["mma"] = ",".join(sorted({m.split(".")[0] + "." + m.split(".")[1] for m in re.findall(r"(?:wgmma|mma)\.\w+\.\w+", ptx)}))
        usage["half_scalar"] = half_scalar_accesses(ptx)
        if DUMP is not None:
            DUMP.mkdir(parents=True, exist_ok=True)
            (DUMP / f"{fn.__name__}.ptx").write_text(ptx)
            (DUMP / f"{fn.__name__}.ttgir").write_text(compiled.asm.get("ttgir", ""))
            (DUMP / f"{fn.__name__}.sass").write_text(_sass(compiled.asm["cubin"]))
        flags = {k: (v if not hasattr(v, "name") else v.name) for k, v in constexprs.items() if v is not None}
        REPORT.append({"kernel": fn.__name__, **usage, "flags": flags})


def offline(fn_module_kernels: list) -> None:
    """Route `kernel[grid](...)` of the given JITFunctions to the offline compiler."""
    for kernel in fn_module_kernels:
        kernel.__class__ = type("Offline" + kernel.__class__.__name__, (kernel.__class__,),
                                {"__getitem__": lambda self, grid: _OfflineLauncher(self, grid)})


def main(argv: list[str] | None = None) -> None:
    global DUMP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default="", help="comma-separated plan names (default: all)")
    parser.add_argument("--specs", default=",".join(MODEL_SPECS),
                        help="`fused` and `model`: comma-separated model specs (specs/models)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--dump", type=Path, default=None, help="write each kernel's PTX, TTGIR and SASS here")
    args = parser.parse_args(argv)
    DUMP = args.dump
    os.environ.pop("TRITON_INTERPRET", None)
    from . import backward, backward_channel, gate, osdn, output, prepare, state
    from .recurrence import linear_recurrence_triton
    offline([gate.gate_cumsum_kernel, prepare.inverse_kernel, prepare.prepare_kernel, state.state_forward_kernel, state.state_backward_kernel,
             output.output_kernel, output.output_backward_kernel, backward.chunk_backward_kernel,
             backward_channel.chunk_pairs_kernel, backward_channel.chunk_channels_kernel,
             osdn.osdn_forward_kernel, osdn.osdn_backward_kernel])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    B, T, H, K, V = 1, 128, 2, 128, 128
    dtype = getattr(torch, args.dtype)
    plans = [dict(name="deltanet", beta=True), dict(name="gdn", beta=True, gate="scalar"),
             dict(name="kda", beta=True, gate="channel"), dict(name="gla", gate="channel"), dict(name="gla-scalar", gate="scalar"),
             dict(name="rwkv7", erase=True, gate="channel", untied=True), dict(name="dp3-gated", beta=True, gate="scalar", n_h=3),
             # launch settings differ with these (`launch.py`): RWKV-7 with a scalar gate, n_h 8
             dict(name="rwkv7-scalar", erase=True, gate="scalar", untied=True, n_h=2),
             dict(name="rwkv7-8", erase=True, gate="channel", untied=True, n_h=8), dict(name="kda-8", beta=True, gate="channel", n_h=8)]
    only = set(args.plans.split(",")) if args.plans else None
    for plan in plans:
        if only and plan["name"] not in only:
            continue
        n_h = plan.get("n_h", 1)
        TN = T * n_h
        t = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=True)  # noqa: E731
        kw = dict(q=t(B, T, H, K), k=t(B, TN, H, K), v=t(B, TN, H, V), n_h=n_h, output_final_state=True)
        if plan.get("beta"):
            kw["beta"] = t(B, TN, H)
        # the gate in float32 (or wider), as a model's log decay forms it: the specialization models run
        gate = lambda *s: torch.randn(*s, dtype=torch.promote_types(dtype, torch.float32), requires_grad=True)  # noqa: E731
        if plan.get("gate") == "scalar":
            kw["g"] = gate(B, T, H)
        elif plan.get("gate") == "channel":
            kw["g"] = gate(B, T, H, K)
        if plan.get("erase"):
            kw["erase"] = t(B, TN, H, K)
        if plan.get("untied"):
            kw["write_key"] = t(B, TN, H, K)
        start = len(REPORT)
        o, s = linear_recurrence_triton(**kw)
        (o.float().sum() + s.sum()).backward()
        for row in REPORT[start:]:
            print(f"{plan['name']:10s} {row['kernel']:26s} regs {row.get('REG', '?'):>4} stack {row.get('STACK', '?'):>6} "
                  f"shared {row.get('SHARED', '?'):>7} {'OVER' if row.get('SHARED', 0) > SHARED_LIMIT else ''}")
    if not only or "decode" in only:
        _decoding_kernels(dtype, K, V)
    if not only or "gates" in only:
        _gate_kernels(dtype, K)
    if not only or "model" in only:
        _model_kernels(args.specs.split(","), recurrence=True)
    elif "fused" in only:
        _model_kernels(args.specs.split(","), recurrence=False)
    if only and "osdn" not in only:
        return
    from .osdn import osdn_write_keys_triton
    for name, retain in (("osdn", None), ("osdn-apf", torch.rand(B, T, H, dtype=dtype))):
        k = torch.randn(B, T, H, K, dtype=dtype, requires_grad=True)
        start = len(REPORT)
        w, d = osdn_write_keys_triton(k, torch.rand(B, T, H, dtype=dtype), retain=retain)
        (w.float().sum() + d.sum()).backward()
        for row in REPORT[start:]:
            print(f"{name:10s} {row['kernel']:26s} regs {row.get('REG', '?'):>4} stack {row.get('STACK', '?'):>6}")


def _decoding_kernels(dtype: torch.dtype, K: int, V: int) -> None:
    """The decoding step's kernels at batch 1 as the H200 runs them: overlapped
    (programmatic dependent launch, `launch.overlapped`), the step and the streams of a
    gated delta rule, and `row_linear` with every prologue."""
    from . import decode, row_linear

    offline([decode.decode_step_kernel, decode.stream_step_kernel, row_linear.row_linear_kernel])
    decode.overlapped = row_linear.overlapped = lambda device: True
    H, d_model, hidden = 2, 256, 688
    t = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
    start = len(REPORT)
    decode.decode_step_triton(t(1, 1, H, K), t(1, 2, H, K), t(1, 2, H, V), torch.zeros(1, H, K, V), g=t(1, 1, H),
                              gate=decode.Gate.SCALAR, beta=t(1, 2, H), n_h=2, beta_scale=2.0,
                              decay=(t(H), t(H)))
    C = H * K * 3 + 2 * H * V
    decode.stream_step_triton(t(1, 1, C), t(C, 4), t(1, 3, C), ((H * K, K), (2 * H * K, K), (2 * H * V, 0)), 1e-6)
    for prologue, kw in (("none", {}), ("norm", dict(pending=t(1, d_model), norm_weight=t(d_model))),
                         ("head_norm", dict(norm_weight=t(V), gate=t(1, d_model), activation="sigmoid", head=V)),
                         ("swiglu", {})):
        width = 2 * hidden if prologue == "swiglu" else d_model
        row_linear.row_linear_triton(t(1, width), t(d_model, width // (2 if prologue == "swiglu" else 1)), None,
                                     prologue=prologue, **kw)
    for row in REPORT[start:]:
        flags = row["flags"]
        name = row["kernel"] + (f"[{next(k for k, v in row_linear.PROLOGUES.items() if v == flags['PRE'])}]"
                                if "PRE" in flags else "")
        print(f"{'decode':10s} {name:26s} regs {row.get('REG', '?'):>4} stack {row.get('STACK', '?'):>6} "
              f"shared {row.get('SHARED', '?'):>7}")


def _gate_kernels(dtype: torch.dtype, K: int) -> None:
    """A channel gate's log decay forward and backward, and the decoding step forming it,
    in every decay form (`kinds.DecayForm`)."""
    from ..kinds import DecayForm
    from . import decode, log_decay

    offline([log_decay.log_decay_forward_kernel, log_decay.log_decay_backward_kernel, decode.decode_step_kernel])
    H, V = 2, K
    t = lambda *s: torch.randn(*s, dtype=dtype)  # noqa: E731
    start = len(REPORT)
    for form in DecayForm:
        proj = t(1, 64, H, K)
        A_log, bias = torch.randn(H, 1), torch.randn(H, K)
        log_decay.log_decay_forward_triton(A_log, proj, bias, form)
        log_decay.log_decay_backward_triton(A_log, proj, bias, torch.randn(proj.shape), form)
        decode.decode_step_triton(t(1, 1, H, K), t(1, 1, H, K), t(1, 1, H, V), torch.zeros(1, H, K, V),
                                  g=t(1, 1, H, K), gate=decode.Gate.CHANNEL, beta=t(1, 1, H), n_h=1,
                                  decay=(torch.randn(H), torch.randn(H, K)), decay_form=form)
    for row in REPORT[start:]:
        form = DecayForm(row["flags"]["FORM"]).name.lower()
        print(f"{'gates':10s} {row['kernel'] + f'[{form}]':26s} regs {row.get('REG', '?'):>4} "
              f"stack {row.get('STACK', '?'):>6} shared {row.get('SHARED', '?'):>7}")


# The whole-model benchmark's widths (`benchmarks/models.py`), one layer: the fused pieces
# compile per width class (divisible by 16 or not), so one layer shows every kernel a step runs.
MODEL_OVERRIDES = {"model.d_model": 1024, "model.layers": 1, "mixer.heads": 8, "mixer.head_dim": 128,
                   "model.vocab_size": 32000}
MODEL_SPECS = ("deltanet", "gated-deltanet", "kda", "gla", "rwkv7")  # every gate form, norm and conv kind
MODEL_TOKENS = 128


def _model_kernels(names: list[str], recurrence: bool) -> None:
    """Every Triton kernel of a training step (forward, loss, backward under bfloat16
    autocast, float32 weights) of the model specs `names` at the whole-model
    benchmark's widths: the fused pieces (norms, SwiGLU, short convs, gates, loss), and
    with `recurrence` the recurrence's kernels too (`--plans model`; `--plans fused`
    leaves the recurrence on the torch path, which compiles in a fraction of the time).
    Each row also counts the kernel's 2-byte scalar global accesses (`half_scalar_accesses`)."""
    import importlib
    import pkgutil

    import archspec
    from archspec.blocks import build_model

    from .. import triton as package

    kernels = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        kernels += [v for v in vars(module).values() if isinstance(v, triton.runtime.jit.JITFunction)
                    and v.__module__ == module.__name__]
    offline(kernels)
    # CPU tensors stand in for CUDA ones here: no kernel runs, each launch compiles for sm_90.
    from .. import api
    api._check_backend_device = lambda *args: None
    specs = Path(__file__).resolve().parents[2] / "specs" / "models"
    for name in names:
        torch.manual_seed(0)
        plan = archspec.lower(archspec.load_spec(specs / f"{name}.yaml", list(MODEL_OVERRIDES.items())))
        model = build_model(plan)
        model.set_backend("triton")
        if not recurrence:
            for mixer in model.mixers():
                mixer.backend = "torch"
        ids = torch.randint(0, plan.vocab_size, (1, MODEL_TOKENS))
        start = len(REPORT)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids)
        loss.backward()
        seen = set()
        for row in REPORT[start:]:
            key = (row["kernel"], tuple(sorted((k, str(v)) for k, v in row["flags"].items())))
            if key in seen:
                continue
            seen.add(key)
            print(f"{name:14s} {row['kernel']:30s} regs {row.get('REG', '?'):>4} stack {row.get('STACK', '?'):>6} "
                  f"shared {row.get('SHARED', '?'):>7} half-scalar {row['half_scalar']:>4}")


if __name__ == "__main__":
    main()
