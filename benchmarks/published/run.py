"""memcheck's CUDA prediction against GPU memory figures that others measured and published.

    python benchmarks/published/run.py                  # every case in cases.json
    python benchmarks/published/run.py --only hf-doc    # ids containing "hf-doc"
    python benchmarks/published/run.py --json out.json  # also write the rows as JSON
    python benchmarks/published/run.py --multi-gpu --json out.json --markdown out.md
                                                        # every multi-GPU record (multi_gpu/records)

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
import dataclasses
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


# ---------------------------------------------------------------------------------------------------------
# Multi-GPU records (multi_gpu/records/*.json, issue 34 item 7): each record translated into the memcheck job
# a user would write for it (Job keywords, shown as the CLI flags), estimated, and compared on its metric.

RECORDS = HERE / "multi_gpu" / "records"
# max_memory_allocated / max_memory_reserved as the single-GPU cases; Megatron's after-step residue has no
# counterpart in memcheck (it reports peaks only), so those records are listed and not compared.
MULTI_METRICS = {"max_memory_allocated": "peak_bytes", "max_memory_reserved": "reserved_bytes",
                 "memory_allocated_after_step": None}
# torchtitan's Grand Teton H100s (HBM2e 96 GB): CUDA reports 95.0396 GiB (torchtitan PR #165's percentages
# are of that figure); arch and CUDA context as memcheck's H100-80GB row (same GH100 chip).
H100_96GB_BYTES = round(95.0396 * 2**30)
_SCHEDULES = (("zerobubble", "zero-bubble"), ("interleaved", "interleaved-1f1b"), ("1f1b", "1f1b"),
              ("gpipe", "gpipe"))
# Megatron-core's GPT "7B" functional-test shape has no transformers class (GQA + learned absolute positions +
# GeLU 4h MLP with biases + LayerNorm); Starcoder2 has all of them but the learned positions (it uses RoPE:
# 8192 x 4096 = 33.6e6 fewer parameters, 0.5% of 6.9e9). Megatron pads the vocabulary to a multiple of
# 128 x TP (megatron/training/tokenizer: _vocab_size_with_padding).
_MCORE_GPT_STAND_IN = dict(config_class="Starcoder2Config", kwargs=dict(
    hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, use_bias=True, hidden_act="gelu_pytorch_tanh",
    norm_epsilon=1e-5, attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.0,
    tie_word_embeddings=False))


class _KeptFloatLogits:
    """torchtitan's step at 83c879f1 (PR #165, March 2024): the model returns ``self.output(h).float()``
    (torchtrain/models/llama/model.py), and train.py keeps it as ``pred`` through the backward
    (``pred = model(input_ids)``; ``loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))``;
    ``loss.backward()``, no ``del pred``; the labels come shifted from the dataset). Here ``pred`` is held
    until the next forward starts (the real loop rebinds it after that forward returns). Under loss
    parallelism the logits are this rank's vocabulary shard and ``cross_entropy`` the parallel one."""

    def __init__(self):
        self.held = None

    def __call__(self, model, batch):
        import torch

        self.held = None
        pred = model(input_ids=batch["input_ids"]).logits.float()
        self.held = pred
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1), batch["labels"].flatten(0, 1))


# The loss code of a record's trainer where it allocates otherwise than transformers' model(**batch).loss.
MULTI_LOSSES = {"torchtitan-83c879f1": _KeptFloatLogits}


def load_records(path: Path = RECORDS) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(path.glob("*.json"))]


def _padded_vocab(vocab: int, tp: int) -> int:
    multiple = 128 * tp
    return -(-vocab // multiple) * multiple


def _degree(layout: dict, *names, default: int = 1):
    for name in names:
        value = layout.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, False
        if value is not None:
            return default, True  # "unknown (...)": assumed
    return default, False


def _schedule(text: str | None) -> str | None:
    if not text:
        return None
    key = text.lower().replace(" ", "").replace("_", "").replace("-", "")
    return next(value for word, value in _SCHEDULES if word in key)


def _gpu(record: dict) -> tuple[object, str]:
    """The target GPU: a GpuSpec, and how the command line writes it."""
    from memcheck.cuda.gpus import GPUS

    kind = record["gpus"]["type"]
    if "96 GB" in kind or "95.0396" in kind:
        spec = dataclasses.replace(GPUS["H100-80GB"], name="H100-96GB (HBM2e)", capacity_bytes=H100_96GB_BYTES)
        return spec, "95.04GiB (an H100: sm90, H100-80GB's context)"
    if "A100" in kind:
        return "A100-80GB", "A100-80GB"
    return "H100-80GB", "H100-80GB"


def _checkpointing(text: str) -> str:
    text = text.lower()
    if text.startswith("none"):
        return "none"
    if text.startswith("selective, op"):
        return "selective-op"
    if text.startswith("sac"):  # PR #165: selective_ac_option '2' at 83c879f1, every second block (the gaps)
        return "half"
    if text.startswith("full"):
        return "full"
    raise ValueError(f"unknown activation_checkpointing {text!r}")


def multi_gpu_job(record: dict) -> dict:
    """The memcheck job a user would write for ``record``, without running it.

    Returns a dict: ``settings`` (the ``memcheck.Job`` keywords), ``model`` (config class, kwargs, and a
    stand-in note), ``flags`` (the command line), ``field`` (the Estimate field the metric compares with, None:
    not comparable), ``rank`` (``max``: the largest over the traced ranks, ``first`` or ``last``), ``assumed``
    (what the translation chose where the record is silent), ``outside`` (what memcheck does not model)."""
    layout = record["layout"]
    assumed, outside = [], []
    model = {"config_class": record["model"].get("config_class"), "kwargs": dict(record["model"].get("kwargs") or {}),
             "task": "causal-lm", "stand_in": None, "loss": None}
    if record["model"].get("config_file"):  # a config.json of this repository (examples/llama-3-70b)
        loaded = json.loads((HERE.parent.parent / record["model"]["config_file"]).read_text())
        # the shapes only: the weights are fp32 (torchtitan's master weights), not config.json's bf16 dtype
        model["kwargs"] = {k: v for k, v in loaded.items()
                           if k not in ("architectures", "dtype", "transformers_version", "model_type")}
    megatron = record["id"].startswith("mcore-")
    dp, unknown_dp = _degree(layout, "dp_shard", "dp")
    tp, _ = _degree(layout, "tp")
    pp, _ = _degree(layout, "pp")
    cp, _ = _degree(layout, "cp")
    ep, _ = _degree(layout, "ep")
    dp_replicate, _ = _degree(layout, "dp_replicate")
    if unknown_dp and ep > 1:
        dp = ep  # expert parallelism borrows its ranks from dp * cp: the smallest dp that holds ep
        assumed.append(f"dp={dp}: the record's data-parallel degree is unknown; the smallest that holds ep={ep}")
    elif unknown_dp:
        assumed.append("dp=1: the record's data-parallel degree is unknown (its gaps: the figures contradict "
                       "this reading)")
    schedule = _schedule(layout.get("pp_schedule"))
    virtual = layout.get("stages_per_rank") or 1
    if schedule and "virtual" in (layout.get("pp_schedule") or ""):
        virtual = int(re.search(r"(\d+) virtual", layout["pp_schedule"])[1])
    microbatches = layout.get("microbatches")
    if isinstance(microbatches, str):
        microbatches = int(re.match(r"\d+", microbatches)[0])
        assumed.append(f"{microbatches} micro-batches (the record: {layout['microbatches']!r})")

    batch_size, accumulate = record["local_batch"], 1
    if pp > 1:
        accumulate = microbatches or pp * virtual
        batch_size = layout.get("microbatch_size") or max(1, record["local_batch"] // accumulate)
    elif megatron and isinstance(record.get("global_batch"), int):
        # Megatron: global batch = micro-batch x micro-batches x DP; the record's local_batch is the micro-batch
        accumulate = record["global_batch"] // (record["local_batch"] * dp)

    loss_parallel = bool(layout.get("loss_parallel"))
    if record["id"].startswith("tt165"):
        model["loss"] = "torchtitan-83c879f1"
    if record["id"].startswith("tt") and tp > 1 and "loss_parallel" not in layout:
        # torchtitan's default whenever tp > 1: config_manager.py @ 83c879f1 (--training.enable_loss_parallel,
        # default True) and @ 9dec370 (--training.disable_loss_parallel, default False; train.py:57, :226 also
        # under pp)
        if cp > 1:
            assumed.append("loss_parallel off: torchtitan's default is on, but memcheck does not model it with cp")
        else:
            loss_parallel = True
            assumed.append("loss_parallel=true: torchtitan's default with tp (not stated in the record)")
    fsdp1 = "FSDP1" in str(layout.get("fsdp_implementation", ""))
    sharded = dp * cp > 1
    settings: dict = dict(device="cuda", batch_size=batch_size, max_len=record["seq_len"], accumulate=accumulate,
                          optimizer="adamw-foreach", checkpointing=_checkpointing(record["activation_checkpointing"]))
    gpu, gpu_flag = _gpu(record)
    settings["gpu"] = gpu
    if megatron:
        # Megatron --bf16 with its distributed optimizer: bf16 compute over fp32 main weights, the fp32 main
        # parameters and Adam state sharded over DP (ZeRO-1): memcheck's zero1 under autocast is the job a user
        # would write (memcheck keeps fp32 parameters and gradients whole, Megatron bf16 parameters and an fp32
        # gradient buffer)
        settings.update(precision="amp-bf16", strategy="zero1" if dp > 1 else "single", optimizer="adamw")
        settings["max_grad_norm"] = 1.0
        outside.append("Megatron-core engine with Transformer Engine kernels and its distributed optimizer "
                       "(bf16 parameters, fp32 gradient buffer): modelled as zero1 under amp-bf16")
        if model["config_class"] is None:
            model.update(_MCORE_GPT_STAND_IN)
            model["kwargs"] = dict(model["kwargs"], vocab_size=_padded_vocab(131073, tp))
            model["stand_in"] = ("Starcoder2 stand-in for Megatron's GPT (GQA 8, GeLU 4h with biases, LayerNorm, "
                                 "dropout 0.1) with RoPE in place of learned positions")
        else:
            model["kwargs"]["vocab_size"] = _padded_vocab(model["kwargs"]["vocab_size"], tp)
    else:
        settings["precision"] = "fp32"  # fp32 sharded parameters and AdamW state (torchtitan, Lightning '32-true')
        if sharded:
            # FSDP's mixed precision: bf16 all-gathered parameters and compute, fp32 reduce-scatter
            settings.update(param_dtype="bf16", reduce_dtype="fp32")
        if record["id"].startswith("lightning-fabric"):
            # the optimizer held the meta parameters fully_shard replaced: no AdamW state, the gradients never
            # zeroed (the record's stack_differences); an optimizer without state and the gradients alive
            # through the forward (the lightning order) are the nearest job
            settings.update(optimizer="sgd", step_order="lightning")
            assumed.append("optimizer sgd (no state): the run's AdamW never saw the real parameters")
        elif record["id"].startswith("lightning"):
            settings["step_order"] = "lightning"  # the Trainer's automatic optimization
        else:
            settings["max_grad_norm"] = 1.0  # torchtitan clips (max_norm 1.0, foreach)
            if pp == 1:
                settings["step_order"] = "plain"  # torchtitan's train loop zeroes the gradients first
    if fsdp1:
        settings.update(strategy="fsdp1", gpus=dp)
    elif tp == pp == cp == ep == dp_replicate == 1:
        if sharded and not megatron:
            settings.update(strategy="fsdp", gpus=dp)
        elif dp > 1:
            settings["gpus"] = dp
    else:
        parts = {"dp_replicate": dp_replicate, "dp": dp, "cp": cp, "tp": tp, "pp": pp, "ep": ep}
        text = ",".join(f"{k}={v}" for k, v in parts.items() if v != 1) or "dp=1"
        if pp > 1:
            text += f",schedule={schedule}"
            if virtual > 1:
                text += f",virtual={virtual}"
        if layout.get("sequence_parallel"):
            text += ",sp=true"
        if loss_parallel:
            text += ",loss_parallel=true"
        settings["layout"] = text
        if sharded and "strategy" not in settings:
            settings["strategy"] = "fsdp"
    if megatron and "layout" not in settings and settings.get("strategy") == "zero1":
        settings["gpus"] = dp

    for flag, what in (("compile", "torch.compile (traced eagerly)"), ("float8", "float8 linears (traced in bf16)"),
                       ("async_tp", "async TP")):
        if record.get(flag):
            outside.append(what)
    metric = record["metric"]
    field = MULTI_METRICS[metric]
    rank_text = str(record.get("rank", "")).lower()
    rank = "first" if "rank 0" in rank_text else "last" if ("last" in rank_text or "rank 7" in rank_text) else "max"
    return {"id": record["id"], "grade": record["reproducibility"], "metric": metric, "field": field, "rank": rank,
            "model": model, "settings": settings, "flags": _flags(settings, gpu_flag), "assumed": assumed,
            "outside": outside, "value_bytes": record["value_bytes"]}


def _flags(settings: dict, gpu_flag: str) -> str:
    from memcheck.job import SPELLING

    parts = []
    for field, value in settings.items():
        if field == "device" or (field == "accumulate" and value == 1):
            continue
        flag = SPELLING[field].flag
        if field == "gpu":
            value = gpu_flag
        if isinstance(value, bool):
            parts.append(flag if value else f"--no-{flag[2:]}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def build_job(translation: dict):
    import memcheck

    return memcheck.Job(**translation["settings"])


def predict_multi(translation: dict):
    """The estimate of one translated record (the model built on meta from its config)."""
    import memcheck

    spec = translation["model"]
    model, config = build_model({**spec, "task": "causal-lm"})
    settings = translation["settings"]
    batch = build_batch({"inputs": ("input_ids", "labels"), "task": "causal-lm"}, config,
                        settings["batch_size"], settings["max_len"])
    loss = MULTI_LOSSES[spec["loss"]]() if spec.get("loss") else None
    return memcheck.estimate(model, batch, build_job(translation), model_name=translation["id"], loss_fn=loss)


def pick(est, translation: dict) -> int | None:
    """The estimate's figure for the record's metric and rank: the largest over the traced ranks (``max``),
    the first pipeline rank, or the last."""
    field = translation["field"]
    if field is None:
        return None
    devices = est.devices
    if translation["rank"] == "first":
        return getattr(devices[0], field)
    if translation["rank"] == "last":
        return getattr(devices[-1], field)
    values = [getattr(d, field) for d in devices]
    return None if None in values else max(values)


def _only(items: list[dict], only: str | None, what: str) -> list[dict] | None:
    """The items whose id contains ``only`` (all without it); None, said on stderr, when none does."""
    chosen = [i for i in items if only in i["id"]] if only else items
    if not chosen:
        print(f"no {what} id contains {only!r}", file=sys.stderr)
        return None
    return chosen


def main_multi(args) -> int:
    records = _only(load_records(args.records), args.only, "record")
    if records is None:
        return 2
    rows, skipped, cache = [], [], {}
    header = (f"{'record':<66} {'grade':<5} {'metric':<27} {'published GiB':>13} {'predicted GiB':>13} "
              f"{'error':>8}")
    print(header)
    print("-" * len(header))
    for record in records:
        t = multi_gpu_job(record)
        start = time.perf_counter()
        row = {"id": t["id"], "grade": t["grade"], "metric": t["metric"], "rank": t["rank"],
               "published_bytes": t["value_bytes"], "predicted_bytes": None, "peak_bytes": None,
               "reserved_bytes": None, "error": None, "comparable": t["field"] is not None,
               "flags": t["flags"], "stand_in": t["model"]["stand_in"], "assumed": t["assumed"],
               "outside": t["outside"]}
        key = json.dumps([t["model"], {k: repr(v) for k, v in t["settings"].items()}], sort_keys=True)
        try:
            est = cache[key] if key in cache else predict_multi(t)  # one trace for a run's allocated and reserved
            cache = {key: est}
        except Exception as exc:  # a record that cannot be traced is listed, not fatal
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            row.update(skipped=f"{type(exc).__name__}: {text}", seconds=round(time.perf_counter() - start, 1))
            skipped.append(row)
            print(f"{t['id']:<66} SKIPPED: {type(exc).__name__}: {text}", flush=True)
            continue
        predicted = pick(est, t)
        per_rank = [{"role": d.role, "peak_bytes": d.peak_bytes, "reserved_bytes": d.reserved_bytes,
                     "peak_phase": d.peak_phase.value, "peak_module": d.peak_module,
                     "breakdown_at_peak": d.breakdown_at_peak.to_dict()}
                    for d in (est.devices if est.job.layout is not None else est.devices[:1])]  # ranks alike
        row.update(predicted_bytes=predicted, per_rank=per_rank, seconds=round(time.perf_counter() - start, 1),
                   peak_bytes=pick(est, {**t, "field": "peak_bytes"}),
                   reserved_bytes=pick(est, {**t, "field": "reserved_bytes"}))
        if predicted is not None:
            row["error"] = (predicted - t["value_bytes"]) / t["value_bytes"]
        rows.append(row)
        err = "n/a" if row["error"] is None else f"{row['error']:+.1%}"
        shown = predicted if predicted is not None else row["peak_bytes"]
        print(f"{t['id']:<66} {t['grade']:<5} {t['metric']:<27} {gib(t['value_bytes']):>13} {gib(shown):>13} "
              f"{err:>8}", flush=True)
        if args.json:  # written after every record: a long run keeps what it has
            _write_multi(args.json, rows, skipped)
    print()
    lines = multi_summary(rows)
    print("\n".join(lines))
    if skipped:
        print("\nskipped (failed to trace):")
        for s in skipped:
            print(f"  {s['id']}: {s['skipped']}")
    if args.json:
        _write_multi(args.json, rows, skipped)
    if args.markdown:
        import torch
        import transformers

        args.markdown.write_text(multi_markdown(rows, skipped, torch.__version__, transformers.__version__))
    return 0


def multi_summary(rows: list[dict]) -> list[str]:
    lines = []
    allocated = lambda r: r["metric"] == "max_memory_allocated"  # noqa: E731
    for title, keep in (("all comparable", lambda r: True), ("grade B", lambda r: r["grade"] == "B"),
                        ("grade C", lambda r: r["grade"] == "C"),
                        ("B allocated", lambda r: r["grade"] == "B" and allocated(r)),
                        ("B reserved", lambda r: r["grade"] == "B" and not allocated(r))):
        errs = [abs(r["error"]) for r in rows if r.get("error") is not None and keep(r)]
        if errs:
            lines.append(f"{title:<15} n={len(errs):<3} median |error| {statistics.median(errs):6.1%}   "
                         f"worst {max(errs):6.1%}")
        else:
            lines.append(f"{title:<15} n=0")
    return lines


def multi_markdown(rows: list[dict], skipped: list[dict], torch_version: str, transformers_version: str) -> str:
    """The committed table: one row per record, in id order, then the summary."""
    out = ["# memcheck against the published multi-GPU records (benchmarks/published/multi_gpu)", "",
           "`python benchmarks/published/run.py --multi-gpu` (here run in parts with `--only`, joined with `--merge`). "
           "Each record's metric against the matching estimate of its rank (`first`/`last` pipeline rank, or `max` "
           "over the traced ranks); grades and every case outside 5% are explained in "
           "`benchmarks/published/multi_gpu/README.md`.", "",
           "| record | grade | metric (rank) | published GiB | memcheck GiB | error | memcheck job |",
           "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in sorted(rows + skipped, key=lambda r: r["id"]):
        metric = f"{r['metric']} ({r['rank']})"
        if r.get("skipped"):
            predicted, err = "not traced", r["skipped"]
        elif r["error"] is None:
            predicted = f"(allocated peak {gib(r['peak_bytes'])})"
            err = "not comparable: memcheck has no after-step figure"
        else:
            predicted, err = gib(r["predicted_bytes"]), f"{r['error']:+.1%}"
        notes = "; ".join(filter(None, [r.get("stand_in"), *r.get("assumed", []),
                                        *(f"outside memcheck: {o}" for o in r.get("outside", []))]))
        job = f"`{r['flags']}`" + (f" ({notes})" if notes else "")
        out.append(f"| `{r['id']}` | {r['grade']} | {metric} | {gib(r['published_bytes'])} | {predicted} | {err} | "
                   f"{job} |")
    out += ["", f"torch {torch_version}, transformers {transformers_version}; error = (memcheck - published) / "
                "published; GiB = 2**30 B.", "", "```", *multi_summary(rows), "```", ""]
    return "\n".join(out)


def main_merge(args) -> int:
    """``--merge A.json B.json ... --json OUT.json --markdown OUT.md``: the parts of a run written by
    ``--only``, as one JSON and one table."""
    rows, skipped, versions = [], [], set()
    for path in args.merge:
        data = json.loads(Path(path).read_text())
        for row in data["rows"]:  # ranks alike (no layout) written once
            if row.get("per_rank") and all(r == row["per_rank"][0] for r in row["per_rank"]):
                row["per_rank"] = row["per_rank"][:1]
        rows += data["rows"]
        skipped += data["skipped"]
    by_id = {r["id"]: r for r in load_records(args.records)}
    for row in skipped:  # never estimated: shown with the job as run.py translates it now
        t = multi_gpu_job(by_id[row["id"]])
        row.update(flags=t["flags"], assumed=t["assumed"], outside=t["outside"], stand_in=t["model"]["stand_in"])
        versions.add((data["torch"], data["transformers"]))
    seen = {r["id"] for r in rows + skipped}
    for record in load_records(args.records):  # a record no part ran is listed as such, not dropped
        if record["id"] not in seen:
            t = multi_gpu_job(record)
            skipped.append({"id": t["id"], "grade": t["grade"], "metric": t["metric"], "rank": t["rank"],
                            "published_bytes": t["value_bytes"], "predicted_bytes": None, "error": None,
                            "comparable": t["field"] is not None, "flags": t["flags"],
                            "stand_in": t["model"]["stand_in"], "assumed": t["assumed"], "outside": t["outside"],
                            "skipped": "not run in this session (time)"})
    if len(versions) != 1:
        print(f"the parts ran on different versions: {sorted(versions)}", file=sys.stderr)
        return 2
    (torch_version, transformers_version), = versions
    if args.json:
        args.json.write_text(json.dumps({"torch": torch_version, "transformers": transformers_version,
                                         "date": time.strftime("%Y-%m-%d"), "rows": rows, "skipped": skipped,
                                         "summary": multi_summary(rows)}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(multi_markdown(rows, skipped, torch_version, transformers_version))
    print("\n".join(multi_summary(rows)))
    return 0


def _write_multi(path: Path, rows: list[dict], skipped: list[dict]) -> None:
    import torch
    import transformers

    path.write_text(json.dumps({
        "torch": torch.__version__, "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
        "rows": rows, "skipped": skipped, "summary": multi_summary(rows)}, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the cases whose id contains this text")
    parser.add_argument("--json", type=Path, help="write the rows and summary here")
    parser.add_argument("--cases", type=Path, default=HERE / "cases.json")
    parser.add_argument("--multi-gpu", action="store_true",
                        help="run the multi-GPU records (multi_gpu/records/*.json) instead of cases.json")
    parser.add_argument("--records", type=Path, default=RECORDS)
    parser.add_argument("--merge", nargs="+", metavar="PART.json",
                        help="--multi-gpu: join the JSON parts of a run (written with --only) into --json/--markdown")
    parser.add_argument("--markdown", type=Path, help="--multi-gpu: also write the table as markdown")
    args = parser.parse_args(argv)
    if args.multi_gpu and args.merge:
        return main_merge(args)
    if args.multi_gpu:
        return main_multi(args)

    cases = _only(load_cases(args.cases), args.only, "case")
    if cases is None:
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
