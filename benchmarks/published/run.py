"""memcheck's CUDA prediction against GPU memory figures that others measured and published.

    python benchmarks/published/run.py                  # every case in cases.json
    python benchmarks/published/run.py --only hf-doc    # ids containing "hf-doc"
    python benchmarks/published/run.py --json out.json  # also write the rows as JSON

Each case of ``cases.json`` is rebuilt on the meta device from its config (no weights, no
hub access) and traced with ``memcheck.estimate`` for the CUDA target. The published
figure is compared with the matching field of the estimate:

    max_memory_allocated -> Estimate.peak_bytes
    max_memory_reserved  -> Estimate.reserved_bytes
    nvidia-smi           -> Estimate.device_total_bytes

Error is (predicted - published) / published. Summary lines give the median and worst
|error| over the cases whose published stack matches the installed semantics
(``stack_notes`` empty), over the cases whose published torch is 2.3 or newer, and over
all cases, per metric. Nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

METRICS = {
    "max_memory_allocated": "peak_bytes",
    "max_memory_reserved": "reserved_bytes",
    "nvidia-smi": "device_total_bytes",
}
REQUIRED = ("id", "source", "model", "batch_size", "max_len", "precision", "optimizer", "checkpointing",
            "gpu", "torch_version", "metric", "value_bytes", "unit_conversion", "stack_notes")
_AUTO = {
    "causal-lm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "base-model": "AutoModel",  # the bare model, no head: its loss is the case's `loss`
}


def load_cases(path: Path = HERE / "cases.json") -> list[dict]:
    return json.loads(path.read_text())["cases"]


def build_model(spec: dict):
    import torch
    import transformers

    kwargs = dict(spec["kwargs"])
    if "num_labels" in spec:
        kwargs["num_labels"] = spec["num_labels"]
    config = getattr(transformers, spec["config_class"])(**kwargs)
    auto = getattr(transformers, _AUTO[spec["task"]])
    extra = {"attn_implementation": spec["attn_implementation"]} if spec.get("attn_implementation") else {}
    if spec.get("dtype"):  # the published torch_dtype, where adapters added after loading keep another dtype
        extra["dtype"] = getattr(torch, spec["dtype"])
    with torch.device("meta"):
        model = auto.from_config(config, **extra)
    if spec.get("peft"):
        model = _with_peft(model, spec["peft"])
    return model, config


def _with_peft(model, spec: dict):
    """LoRA adapters as trl's SFTTrainer adds them: ``enable_input_require_grads()`` first when the
    job checkpoints with use_reentrant=True (``input_require_grads``), then
    ``peft.get_peft_model(model, LoraConfig(...))``, which keeps the base weights frozen in their
    dtype and, by default, makes the adapter weights float32."""
    from peft import LoraConfig, get_peft_model

    kwargs = {k: v for k, v in spec.items() if k not in ("method", "input_require_grads")}
    if spec["method"] != "lora":
        raise ValueError(f"unknown peft method {spec['method']!r}")
    if spec.get("input_require_grads"):
        model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(**kwargs))


def build_batch(spec: dict, config, batch_size: int, max_len: int) -> dict:
    """The batch the published run fed the model, as meta tensors of its worst-case shape."""
    import torch

    def tokens():
        return torch.empty(batch_size, max_len, dtype=torch.long, device="meta")

    batch = {}
    for name in spec["inputs"]:
        if name == "input_ids":
            batch[name] = tokens()
        elif name == "attention_mask":
            batch[name] = tokens()
        elif name == "labels" and spec["task"] == "classification":
            batch[name] = torch.empty(batch_size, dtype=torch.long, device="meta")
        elif name == "labels":
            batch[name] = tokens()
        elif name in ("start_positions", "end_positions"):
            batch[name] = torch.empty(batch_size, dtype=torch.long, device="meta")
        else:
            raise ValueError(f"unknown input {name!r}")
    return batch


def optimizer_for(case: dict):
    """memcheck's optimizer name, or a constructor when the case pins the implementation's kwargs."""
    kwargs = case.get("optimizer_kwargs") or {}
    if not kwargs:
        return case["optimizer"]
    import torch

    classes = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    cls = classes[case["optimizer"]]
    return lambda params: cls(params, **kwargs)


def _shift_ce(model, batch, upcast: bool):
    import torch

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    if upcast:
        logits = logits.float()
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = batch["labels"][..., 1:].contiguous()
    return torch.nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


class _KeepOutput:
    """loss keep-output: ``model(**batch).loss`` with the output object (and so its logits) kept
    referenced after the forward, as a script's ``out = model(...); loss = out.loss; loss.backward();
    opt.step()`` keeps it until its step function returns (XiaoJianyu219/llm-infra-bench,
    experiments/08-single-gpu-profiling/scripts/train_loop.py one_step). Here it is dropped when the
    next forward starts: after the optimizer step as there, but after memcheck's zero_grad where the
    script's zero_grad comes first in the next step (both only free memory before the next forward)."""

    def __init__(self):
        self.held = None

    def __call__(self, model, batch):
        self.held = None  # the previous step's output is gone before this forward
        self.held = model(**batch)
        return self.held.loss


# The loss code of the transformers version a case ran, where it allocates otherwise than the installed
# version's model(**batch).loss: the model is called without labels and the loss computed here.
#   shift-ce:       CrossEntropyLoss on the logits' shifted contiguous copy in the logits' dtype
#                   (transformers 4.45/4.48 GPTBigCodeForCausalLM.forward).
#   float-shift-ce: logits.float(), then the shifted contiguous copy and cross entropy
#                   (transformers 4.48 ForCausalLMLoss; 4.45 GraniteForCausalLM.forward).
LOSSES = {
    "shift-ce": lambda model, batch: _shift_ce(model, batch, upcast=False),
    "float-shift-ce": lambda model, batch: _shift_ce(model, batch, upcast=True),
    # a bare model's output summed, as a wrapper module's forward returns it
    "sum-last-hidden": lambda model, batch: model(**batch).last_hidden_state.sum(),
    # the output object kept until the next forward (a class: one instance per case)
    "keep-output": _KeepOutput,
}


def _forward_backward(loss_fn):
    """protocol forward-backward: each step is the loss's forward and backward only, no optimizer step,
    then zero_grad(set_to_none=False): the gradients stay allocated across steps (zeroed in place), so a
    step after the first starts with parameters and gradients resident."""
    def forward_backward(model, batch, optimizer):
        loss_fn(model, batch).backward()
        optimizer.zero_grad(set_to_none=False)
    return forward_backward


def predict(case: dict):
    import memcheck

    model, config = build_model(case["model"])
    batch = build_batch(case["model"], config, case["batch_size"], case["max_len"])
    settings = dict(device="cuda", gpu=case["gpu"], precision=case["precision"], optimizer=optimizer_for(case),
                    checkpointing=case["checkpointing"], batch_size=case["batch_size"], max_len=case["max_len"],
                    accumulate=case.get("accumulate", 1))
    if case.get("max_grad_norm"):
        settings["max_grad_norm"] = case["max_grad_norm"]
    if case.get("step_order"):  # the trainer's own order (memcheck.enums.StepOrder): "lightning" for its Trainer
        settings["step_order"] = case["step_order"]
    if case["model"].get("loss"):
        loss = LOSSES[case["model"]["loss"]]
        settings["loss_fn"] = loss() if isinstance(loss, type) else loss
    if case.get("protocol", "train") == "forward-backward":
        settings["train_step"] = _forward_backward(settings.pop("loss_fn"))  # the case names its loss
    if case["checkpointing"] != "none":
        settings["use_reentrant"] = bool(case.get("use_reentrant", False))
    if case.get("strategy", "single") != "single":
        settings["strategy"] = case["strategy"]
        settings["gpus"] = case.get("gpus", 1)
        if case.get("bucket_view"):
            settings["bucket_view"] = True
    return memcheck.estimate(model, batch, model_name=case["id"], **settings)


def recent_torch(case: dict) -> bool:
    """Whether the published run's torch is known to be 2.3 or newer (``torch_version`` starts with it)."""
    match = re.match(r"(\d+)\.(\d+)", case["torch_version"])
    return bool(match) and (int(match[1]), int(match[2])) >= (2, 3)


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def summary(rows: list[dict], title: str) -> list[str]:
    lines = []
    for metric in METRICS:
        errs = [abs(r["error"]) for r in rows if r["metric"] == metric and r.get("error") is not None]
        if errs:
            worst = max((r for r in rows if r["metric"] == metric and r.get("error") is not None),
                        key=lambda r: abs(r["error"]))
            lines.append(f"{title:<14} {metric:<21} n={len(errs):<3} median |error| {statistics.median(errs):6.1%}   "
                         f"worst {max(errs):6.1%} ({worst['id']})")
        else:
            lines.append(f"{title:<14} {metric:<21} n=0")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose id contains this text")
    parser.add_argument("--json", type=Path, help="write the rows and summary here")
    parser.add_argument("--cases", type=Path, default=HERE / "cases.json")
    args = parser.parse_args(argv)

    cases = load_cases(args.cases)
    if args.only:
        cases = [c for c in cases if args.only in c["id"]]
        if not cases:
            print(f"no case id contains {args.only!r}", file=sys.stderr)
            return 2
    rows, skipped = [], []
    header = f"{'case':<46} {'metric':<21} {'published GiB':>13} {'predicted GiB':>13} {'error':>8}  stack"
    print(header)
    print("-" * len(header))
    for case in cases:
        start = time.perf_counter()
        try:
            est = predict(case)
        except Exception as exc:  # a case that cannot be traced is listed, not fatal
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            skipped.append({"id": case["id"], "error": f"{type(exc).__name__}: {text}"})
            print(f"{case['id']:<46} SKIPPED: {type(exc).__name__}: {text}")
            continue
        predicted = getattr(est, METRICS[case["metric"]])
        published = case["value_bytes"]
        error = None if predicted is None else (predicted - published) / published
        row = {"id": case["id"], "metric": case["metric"], "published_bytes": published, "predicted_bytes": predicted,
               "error": error, "stack_matches": not case["stack_notes"], "recent_torch": recent_torch(case),
               "seconds": round(time.perf_counter() - start, 1)}
        rows.append(row)
        err_text = "-" if error is None else f"{error:+.1%}"
        print(f"{case['id']:<46} {case['metric']:<21} {gib(published):>13} {gib(predicted):>13} {err_text:>8}  "
              f"{'matches' if row['stack_matches'] else 'differs'}")
    print()
    lines = (summary([r for r in rows if r["stack_matches"]], "stack matches")
             + summary([r for r in rows if r["recent_torch"]], "torch >= 2.3") + summary(rows, "all cases"))
    print("\n".join(lines))
    if skipped:
        print("\nskipped (failed to trace):")
        for s in skipped:
            print(f"  {s['id']}: {s['error']}")
    if args.json:
        import torch
        import transformers

        args.json.write_text(json.dumps({
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"), "rows": rows, "skipped": skipped, "summary": lines,
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
