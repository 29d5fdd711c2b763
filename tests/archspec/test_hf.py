"""The HuggingFace wrapper (`archspec.hf`, the optional extra): forward, cache, generate
through GenerationMixin, save_pretrained / from_pretrained, `archspec export`, the byte
tokenizer, and lm-evaluation-harness end to end on a local file. Skipped where
transformers (or lm-eval) is not installed; this module imports without them.

References are independent of transformers: the compiled model's own forward and
`generate`, and log-likelihoods summed here from its logits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import archspec  # noqa: E402
from archspec.blocks import build_model  # noqa: E402
from archspec.search.cli import main  # noqa: E402

hf = pytest.importorskip("archspec.hf")

ROOT = Path(__file__).resolve().parents[2]
GDN = str(ROOT / "specs" / "models" / "gated-deltanet.yaml")
OSDN = str(ROOT / "specs" / "models" / "osdn.yaml")
RWKV7 = str(ROOT / "specs" / "models" / "rwkv7.yaml")  # RWKV-7's own decay form
SMALL = [("model.d_model", 32), ("mixer.heads", 2), ("mixer.head_dim", 8), ("model.layers", 2), ("model.vocab_size", 256)]
# Qwen3-Next-style: Gated DeltaNet layers and a gated GQA attention layer (RoPE, q/k norm)
HYBRID = (str(ROOT / "specs" / "models" / "qwen3-next-hybrid.yaml"),
          [("model.layers", 4), ("attention.heads", 2), ("attention.head_dim", 8)])


def _compiled(path: str = GDN, extra=(), seed: int = 0):
    spec = archspec.load_spec(path, [*SMALL, *extra])
    torch.manual_seed(seed)
    model = build_model(archspec.lower(spec)).eval()
    with torch.no_grad():  # weights away from the tiny initialisation: decisive argmaxes
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model, spec


def _ids(shape, seed=1):
    return torch.randint(1, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("path,extra", [(OSDN, []), (RWKV7, []), HYBRID], ids=["osdn", "rwkv7", "hybrid"])
def test_forward_and_cached_continuation_equal_the_compiled_model(path, extra):
    model, spec = _compiled(path, extra)
    wrapped = hf.ArchspecForCausalLM.from_archspec(model, spec).eval()
    recurrent_only = path != HYBRID[0]
    assert ("attention" in wrapped.layer_kinds) == (not recurrent_only)
    assert wrapped.config.layer_types == ["linear_attention"] * 2 if recurrent_only else \
        ["linear_attention"] * 3 + ["full_attention"]
    ids = _ids((2, 9))
    with torch.no_grad():
        want = model(ids)
        out = wrapped(ids, use_cache=False)
        assert out.cache is None
        torch.testing.assert_close(out.logits, want, rtol=0, atol=0)
        first = wrapped(ids[:, :5], use_cache=True)
        assert isinstance(first.cache, hf.ArchspecCache) and first.cache.get_seq_length() == 5
        pieces = [first.logits]
        piece = wrapped(ids[:, 5:7], cache=first.cache, use_cache=True)  # several tokens: the chunk path
        pieces.append(piece.logits)
        for t in (7, 8):  # one token: the decoding step
            pieces.append(wrapped(ids[:, t : t + 1], cache=piece.cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, rtol=1e-5, atol=1e-5)
    assert piece.cache.get_seq_length() == 9 and all(piece.cache.is_linear) == recurrent_only
    # labels: the next-token cross-entropy, shifted inside
    labels = ids.clone()
    labels[0, :3] = -100
    loss = wrapped(ids, labels=labels, use_cache=False).loss
    logp = torch.log_softmax(want[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = labels[:, 1:] != -100
    torch.testing.assert_close(loss.double(), -logp[keep].mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path,extra", [(GDN, []), HYBRID], ids=["gdn", "hybrid"])
def test_generate_through_generation_mixin_with_left_padding(path, extra):
    model, spec = _compiled(path, extra)
    wrapped = hf.ArchspecForCausalLM.from_archspec(model, spec).eval()
    prompts = [_ids((6,), 2), _ids((2,), 3), _ids((4,), 4)]
    batch = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for row, p in enumerate(prompts):
        batch[row, 6 - len(p):], mask[row, 6 - len(p):] = p, 1
    out = wrapped.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    # the compiled model's own generation, prompts packed, each as if alone
    own = model.generate(prompts, 6, temperature=0)
    for row, (p, mine) in enumerate(zip(prompts, own)):
        assert torch.equal(out[row, 6:], mine[len(p):]), row
    with pytest.raises(ValueError, match="new tokens must all be real"):
        first = wrapped(batch, attention_mask=mask, use_cache=True)
        wrapped(batch[:, :2], attention_mask=torch.zeros(3, 8, dtype=torch.long), cache=first.cache)


@pytest.mark.parametrize("path,extra", [(GDN, [("mixer.transition.n_h", 2)]), HYBRID], ids=["gdn-nh2", "hybrid"])
def test_beam_search_and_sampling_reorder_and_repeat_the_state(path, extra):
    model, spec = _compiled(path, extra)
    wrapped = hf.ArchspecForCausalLM.from_archspec(model, spec).eval()
    prompt = _ids((2, 5), 5)
    out = wrapped.generate(prompt, max_new_tokens=5, num_beams=3, do_sample=False, length_penalty=0.0,
                           output_scores=True, return_dict_in_generate=True, early_stopping=True)
    # Each returned beam's score is its log-probability under the model: recomputed here in
    # one forward. A state reordered wrongly between steps would not give these numbers.
    with torch.no_grad():
        logp = torch.log_softmax(model(out.sequences).double(), -1)
    new = out.sequences[:, 5:]
    total = logp[:, 4:-1].gather(-1, new[..., None])[..., 0].sum(1)
    torch.testing.assert_close(out.sequences_scores.double(), total, rtol=1e-4, atol=1e-4)
    sampled = wrapped.generate(prompt, max_new_tokens=4, do_sample=True, top_k=5, num_return_sequences=3)
    assert sampled.shape == (6, 9) and torch.equal(sampled[::3, :5], prompt)


@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_and_from_pretrained_through_the_auto_classes(tmp_path, tie):
    model, spec = _compiled(GDN, [("model.tie_embeddings", tie)])
    hf.ArchspecForCausalLM.from_archspec(model, spec).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "archspec" and config["spec"]["model"]["d_model"] == 32
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, hf.ArchspecForCausalLM)
    assert (loaded.model.head.weight is loaded.model.embed.weight) == tie
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path), hf.ArchspecConfig)


@pytest.mark.parametrize("path,extra", [(GDN, []), HYBRID], ids=["gdn", "hybrid"])
def test_training_loss_makes_no_logits_and_equals_the_logits_cross_entropy(path, extra):
    """In training mode with labels the wrapper takes archspec's linear cross-entropy (no
    logits come back); its loss and every gradient equal cross-entropy of the logits of the
    same weights in evaluation (shifted, -100 unscored); a bad label is a clear error."""
    model, spec = _compiled(path, extra)
    wrapped = hf.ArchspecForCausalLM.from_archspec(model, spec).double()
    ids = _ids((2, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    wrapped.train()
    out = wrapped(input_ids=ids, labels=labels)
    assert out.logits is None
    got = [out.loss, *torch.autograd.grad(out.loss, list(wrapped.parameters()))]
    wrapped.eval()
    ref = wrapped(input_ids=ids, labels=labels, use_cache=False)
    assert ref.logits.shape == (2, 12, 256)
    logp = torch.log_softmax(ref.logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = labels[:, 1:] != -100
    torch.testing.assert_close(ref.loss, -logp[keep].mean(), rtol=1e-12, atol=1e-12)
    want = [ref.loss, *torch.autograd.grad(ref.loss, list(wrapped.parameters()))]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # transformers' loss keyword: an accumulated step of two such micro-batches counts twice
    # the scored positions, and each micro-batch's loss is its sum over that count
    assert wrapped.accepts_loss_kwargs
    twice = int(keep.sum()) * 2
    for mode in ("train", "eval"):
        getattr(wrapped, mode)()
        half = wrapped(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(twice)).loss
        torch.testing.assert_close(half, ref.loss / 2, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(half, list(wrapped.parameters()))
        for a, b in zip(grads, want[1:]):
            torch.testing.assert_close(a, b / 2, rtol=1e-10, atol=1e-12)
    wrapped.train()
    bad = labels.clone()
    bad[1, 5] = 999
    with pytest.raises(ValueError, match=r"labels: 1 outside \[0, 256\) that are not -100; the first, at \[1, 4\], is 999"):
        wrapped(input_ids=ids, labels=bad)


def test_gradient_checkpointing_through_transformers_equals_the_plain_step():
    """transformers' `activation_checkpointing_enable()` (`gradient_checkpointing_enable()`
    before it; what its Trainer calls) flags every block: the loss and every gradient of a
    training step are the plain step's."""
    model, spec = _compiled(HYBRID[0], HYBRID[1])
    wrapped = hf.ArchspecForCausalLM.from_archspec(model, spec).double().train()
    ids = _ids((2, 12))
    runs = []
    for enable in (False, True):
        if enable:
            (getattr(wrapped, "activation_checkpointing_enable", None) or wrapped.gradient_checkpointing_enable)()
            assert all(block.gradient_checkpointing for block in wrapped.model.blocks)
        loss = wrapped(input_ids=ids, labels=ids).loss
        runs.append([loss.detach(), *torch.autograd.grad(loss, list(wrapped.parameters()))])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    (getattr(wrapped, "activation_checkpointing_disable", None) or wrapped.gradient_checkpointing_disable)()
    assert not any(block.gradient_checkpointing for block in wrapped.model.blocks)


def test_byte_tokenizer():
    tok = hf.ByteTokenizer()
    text = "Ay, there's the rub — é"
    ids = tok(text).input_ids
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0 and tok.vocab_size == 256


def _trained_bytes_run(tmp_path: Path) -> Path:
    from archspec.search import trainer
    from archspec.search.tasks import get_task

    run = tmp_path / "run"
    result = trainer.train(GDN, get_task("bytes_lm", seq_len=32, eval_windows=8), steps=20, out_dir=run, quiet=True,
                           measure_throughput=False, lr=1e-2, eval_every=10,
                           overrides=["model.layers=1", "model.d_model=16", "mixer.heads=2", "mixer.head_dim=8"])
    assert result.status == "ok"
    return run


def test_archspec_export_and_loading_without_archspec_hf(tmp_path):
    run = _trained_bytes_run(tmp_path)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "modeling_archspec.py"} <= set(os.listdir(out))
    # A fresh process that never imports archspec.hf: transformers' remote-code route.
    code = (
        "import torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        f"t = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        "ids = t('To be, or not', return_tensors='pt').input_ids\n"
        "print(type(m).__name__, type(t).__name__, repr(m(ids).logits[0, -1].tolist()))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, tok_kind, logits = done.stdout.strip().split(" ", 2)
    assert (kind, tok_kind) == ("ArchspecForCausalLM", "ByteTokenizer")
    with torch.no_grad():
        want = archspec.load(run)(torch.tensor([list(b"To be, or not")]))[0, -1]
    torch.testing.assert_close(torch.tensor(eval(logits)), want, rtol=0, atol=0)


def test_without_transformers_import_and_export_say_what_to_install(tmp_path, capsys, monkeypatch):
    """Where the extra is not installed: `import archspec.hf` names it, and `archspec
    export` refuses with it instead of a traceback (transformers hidden here)."""
    for name in [m for m in sys.modules if m == "archspec.hf" or m.startswith(("archspec.hf.", "transformers"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'archspec-lrnn\[hf\]'"):
        import archspec.hf  # noqa: F401
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "out")]) == 2
    assert "archspec export needs transformers: pip install 'archspec-lrnn[hf]'" in capsys.readouterr().err


def test_export_refuses_a_search_directory_and_a_missing_run(tmp_path, capsys):
    (tmp_path / "trials").mkdir()
    (tmp_path / "search.yaml").write_text("name: x\n")
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "out")]) == 2
    assert "a search's run directory: export one trial's model" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "out")]) == 2
    assert "no such directory" in capsys.readouterr().err


LAMBADA_LINES = [
    "To be or not to be that is the question",
    "All the world is a stage and all the men and women merely players",
    "Now is the winter of our discontent",
    "If music be the food of love play on",
    "The course of true love never did run smooth",
]


def test_lm_evaluation_harness_runs_lambada_on_a_local_file(tmp_path, monkeypatch):
    """lm-evaluation-harness's own `lambada_openai` task, its dataset swapped for a local
    JSON-lines file, on an exported byte-level model: accuracy and perplexity against the
    log-likelihoods summed here from the model's logits."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    import yaml

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    run = _trained_bytes_run(tmp_path)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "lambada.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in LAMBADA_LINES))
    task = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "lambada" / "lambada_openai.yaml").read_text())
    task.pop("tag", None)
    task.update(task="lambada_local", dataset_path="json", dataset_name=None,
                dataset_kwargs={"data_files": {"test": str(tasks / "lambada.jsonl")}})
    (tasks / "lambada_local.yaml").write_text(yaml.safe_dump(task))

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    lm = HFLM(pretrained=model, tokenizer=transformers.AutoTokenizer.from_pretrained(out), batch_size=2)
    results = lm_eval.simple_evaluate(model=lm, tasks=["lambada_local"], task_manager=TaskManager(include_path=str(tasks)),
                                      bootstrap_iters=0)["results"]["lambada_local"]

    compiled = archspec.load(run)
    logliks, greedy = [], []
    for line in LAMBADA_LINES:
        context, target = " ".join(line.split(" ")[:-1]).encode(), (" " + line.split(" ")[-1]).encode()
        ids = torch.tensor([list(context + target)])
        with torch.no_grad():
            logp = torch.log_softmax(compiled(ids)[0].double(), -1)
        positions = range(len(context) - 1, len(context) + len(target) - 1)
        logliks.append(sum(logp[p, ids[0, p + 1]].item() for p in positions))
        greedy.append(all(int(logp[p].argmax()) == int(ids[0, p + 1]) for p in positions))
    assert results["acc,none"] == pytest.approx(sum(greedy) / len(greedy))
    assert results["perplexity,none"] == pytest.approx(math.exp(-sum(logliks) / len(logliks)), rel=1e-4)


def test_the_checkouts_kernels_folder_does_not_stand_in_for_hugging_faces():
    """transformers 5.25 imports Hugging Face's `kernels` package; run from a checkout's
    root, the checkout's `kernels/` folder would be found under that name first."""
    import importlib.metadata
    import sys
    from pathlib import Path

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels package is not installed (transformers < 5.25)")
    checkout = Path(__file__).resolve().parents[2] / "kernels"
    assert Path(sys.modules["kernels"].__file__).resolve().parent != checkout.resolve()
