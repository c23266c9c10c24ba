"""All human-readable output: tables through tabulate (or ``table``, which does not pad its
headers), JSON through ``to_dict``. Every table and line fits ``WIDTH`` (80) columns whatever
the terminal: prose is wrapped at spaces (``wrap``), flags are continued with `` \\`` and
arguments broken after commas (``continued``), runs of repeated blocks are ranges
(``ranges``: ``model.layers.{0..30 step 2}``). The JSON keeps every line whole."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import textwrap
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from memcheck.choices import ANSWERS, words
from memcheck.enums import PRECISION_ALIASES, Phase
from memcheck.job import SPELLING, SPELLINGS, Spelling
from memcheck.training.checkpointing import half_of
from memcheck.training.optimizers import HF_OPTIMIZERS, optimizer_name
from memcheck.workloads.hf import checkpointing_argument
from memcheck.units import format_bytes

if TYPE_CHECKING:  # the results import this module to render themselves
    from memcheck.report.results import (
        Comparison,
        DeviceMemory,
        Estimate,
        Judgement,
        Plan,
        PlanOption,
        ShardedFit,
        Suggestion,
        Verdict,
    )

_CATEGORY_LABELS = {
    "params": "parameters",
    "buffers": "buffers",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations (saved for backward)",
    "temporaries": "temporaries",
    "outputs": "outputs and loss",
    "inputs": "input batch",
    "workspaces": "cuBLAS workspaces",
    "communication": "communication buffers",
    "other": "other",
}


WIDTH = 80  # every table and line fits 80 columns, whatever the terminal (issue 19)


# A job setting as each output writes it, through its declaration (memcheck.job.SPELLINGS): the flag
# with its value, the config (TOML) key, a Python keyword, and the trainers' own names.
def flag(field: str, value: Any = None) -> str:
    """``--flag value`` (the bare flag for None; ``--no-flag`` for False on an on/off flag)."""
    name = SPELLING[field].flag
    if value is None or value is True:
        return name
    return f"--no-{name[2:]}" if value is False else f"{name} {value}"


def toml_value(value: Any) -> str:
    """``value`` as a TOML value: true/false, a quoted string, a number, or a list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return f'"{value}"' if isinstance(value, str) else f"{value}"


def key(field: str, value: Any) -> str:
    """``config_key = value``, as a ``memcheck check`` config writes the setting."""
    return f"{SPELLING[field].config} = {toml_value(value)}"


def keyword(field: str, value: Any) -> str:
    """``field=value`` (the value's repr), as the Python API takes the setting."""
    return f"{field}={value!r}"


def hf_argument(field: str, value: Any) -> str:
    """``name=value`` in transformers' TrainingArguments' words."""
    return f"{SPELLING[field].hf}={value}"


def lightning_argument(field: str, value: Any) -> str:
    """``name=value`` in Lightning's Trainer's words."""
    return f"{SPELLING[field].lightning}={value}"


def wrap(line: str, hang: int = 2, indent: str | None = None) -> list[str]:
    """One line of prose broken at spaces to fit ``WIDTH``, never inside a word, a shape or a
    range; the lines after the first indented ``hang`` more than it (and past a leading ``- ``),
    or by ``indent``. A word longer than a line stays whole on its own line."""
    if len(line) <= WIDTH:
        return [line.replace(_GLUE, " ")]
    body = line.lstrip(" ")
    lead = " " * (len(line) - len(body))
    if indent is None:
        indent = lead + " " * (hang + (2 if body.startswith("- ") else 0))
    kept = _UNBROKEN.sub(lambda m: m.group(0).replace(" ", _GLUE), line)
    return [part.replace(_GLUE, " ") for part in
            textwrap.wrap(kept, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)]


_GLUE = "\x00"  # a space that wrap() does not break at
# kept whole on a line: a shape "(8, 1024)", "8 x 1024", a range "{0..10 step 2}"
_UNBROKEN = re.compile(r"\(\d+(?:, \d+)*,?\)|\d+ x \d+|\{[^{}\s]+(?: step \d+)?\}")


def _prose(*lines: str) -> list[str]:
    return [part for line in lines for text in line.split("\n") for part in wrap(text)]


def continued(label: str, parts, *, shell: bool, indent: str = "    ") -> list[str]:
    """``label`` on its own line (when the parts do not fit beside it), then ``parts`` packed
    into lines of ``WIDTH``: a shell command continued with `` \\`` (each part a flag and its
    value, never split), or Python arguments broken after their commas."""
    sep = " " if shell else ", "
    one = label + " " + sep.join(parts)
    if len(one) <= WIDTH:
        return [one]
    tail = " \\" if shell else ","
    lines, current = [label], ""
    for part in parts:
        candidate = current + sep + part if current else part
        if current and len(indent + candidate + tail) > WIDTH:
            lines.append(indent + current + tail)
            candidate = part
        current = candidate
    lines.append(indent + current)
    return lines


_NUMBERED = re.compile(r"(?<=\.)(\d+)(?=\.|$)")


def ranges(names) -> list[str]:
    """Module names with one repeated block index each, their indices as a range:
    ``transformer.h.{0..10 step 2}`` for h.0, h.2, ..., h.10; ``{0..11}`` for a run; ``{1,4,9}``
    otherwise. Names without an index, or alone in their pattern, stay as they are."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for name in names:
        m = _NUMBERED.search(name)
        key = name if m is None else name[:m.start()] + "#" + name[m.end():]
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m is not None:
            groups[key].append(int(m.group(1)))
    out = []
    for key in order:
        idx = groups[key]
        if len(idx) < 2:
            out.append(key if not idx else key.replace("#", str(idx[0]), 1))
            continue
        out.append(key.replace("#", "{" + _index_range(idx) + "}", 1))
    return out


def _index_range(idx: list[int]) -> str:
    step = idx[1] - idx[0]
    if len(idx) >= 3 and step > 0 and all(b - a == step for a, b in zip(idx, idx[1:])):
        return f"{idx[0]}..{idx[-1]}" + (f" step {step}" if step > 1 else "")
    return ",".join(str(i) for i in idx)


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """tabulate's "simple" table, left-aligned, without its 2-column padding of headers, so a
    column is as wide as its widest line (cells and headers may hold several lines, the
    headers' last lines on the rule)."""
    cols = len(headers)
    split = [[c.split("\n") for c in row] for row in [headers] + rows]
    widths = [max(len(line) for row in split for line in row[i]) for i in range(cols)]

    def draw(row) -> list[str]:
        height = max(len(c) for c in row)
        out = []
        for k in range(height):
            cells = [(c[k] if k < len(c) else "") for c in row]
            out.append("  ".join(cells[i].ljust(widths[i]) for i in range(cols)).rstrip())
        return out

    head = [[""] * (max(len(h) for h in split[0]) - len(h)) + h for h in split[0]]  # headers sit on the rule
    return draw(head) + ["  ".join("-" * w for w in widths)] + [line for row in split[1:] for line in draw(row)]


def _cells(text: str, width: int) -> str:
    """A table cell broken into lines of at most ``width`` (tabulate draws them as one row),
    before its parenthesis when it has one: ``CUDA context and libraries`` over
    ``(published bare context + estimate, lazy module loading)``."""
    if len(text) <= width:
        return text
    if " (" in text and text.index(" (") <= width and len(text) - text.index(" (") - 1 <= width:
        return text.replace(" (", "\n(", 1)
    return "\n".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)) or text


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _gpu_label(est: Estimate) -> str:
    gpu = est.gpu
    if gpu is None:
        return "no GPU named"
    return f"{gpu.name}, {format_bytes(gpu.capacity_bytes)}, sm{gpu.arch[0]}{gpu.arch[1]}"


def allocator_life_line(est: Estimate) -> str:
    """Where the caching allocator's reserved memory peaked over the process's life, and
    after which step it stops growing."""
    phase, step = est.reserved_peak_phase, est.reserved_peak_step
    if phase is None:
        where = "reserved peak: none recorded"
    elif phase is Phase.SETUP:
        where = "reserved peak while loading the weights and batch"
    elif phase is Phase.EVAL:
        where = "reserved peak in the evaluation pass"
    else:
        where = f"reserved peak in step {step}, phase {phase.value}"
    if est.steady_step is not None:
        settled = f"the allocator settles after step {est.steady_step} (each later step reuses the same blocks)"
    else:
        settled = "the allocator had not settled when the replay stopped: reserved may grow further in a long run"
    line = f"{where}; {settled}"
    if est.released_cached:
        line += ("\nnear capacity the allocator gave cached segments back to the driver and retried "
                 "(cudaFree synchronises: slower steps, but no out-of-memory)")
    return line


def render_estimate(est: Estimate) -> str:
    """The table printed by ``memcheck MODEL``."""
    b = est.batch
    shapes = ", ".join(f"{i.name} {tuple(i.shape)}" for i in b.inputs)
    how = [est.strategy]
    if est.accumulate > 1:
        how.append(f"accumulate {est.accumulate}")
    if est.checkpointing:
        how.append(f"checkpointing {len(est.checkpointing)} module(s)" if est.checkpointing[0][0] != "("
                   else "checkpointing " + est.checkpointing[0])
    job = est.job
    packed = job is not None and job.packing  # one row of packed sequences, no padding (memcheck.job.Job.packing)
    weights, adapters = f"{est.weights_dtype} weights", ""
    if job is not None and (job.qlora or job.lora is not None):
        lora = job.lora
        kind = "DoRA" if lora is not None and lora.dora else "LoRA"
        adapters = (f"{kind} {lora if lora is not None else 'default'} adapters"
                    + (" (QLoRA)" if job.qlora else "") + ", ")
        if job.qlora:
            weights = f"4-bit NF4 linear weights ({est.weights_dtype} others)"
    lines = _prose(
        f"memcheck: {est.model} on {est.device.value}, {est.precision.value}, {weights}, "
        f"{adapters}{est.optimizer}, "
        f"batch {b.batch_size}" + (f" x {b.max_len} tokens" if b.max_len else "") + (" packed" if packed else ""),
        f"strategy: {', '.join(how)}",
        f"worst-case {'packed ' if packed else ''}batch: {shapes}" if shapes else "",
    )
    lines.append("")
    bd = est.breakdown_at_peak.to_dict()
    rows = [
        [_CATEGORY_LABELS[k], format_bytes(v), _pct(v, est.peak_bytes)] for k, v in bd.items() if v
    ]
    peak_label = "allocated peak (steady state)" if est.reserved_bytes is not None else "peak (steady state)"
    rows.append([peak_label, format_bytes(est.peak_bytes), "100.0%"])
    lines.append(tabulate(rows, headers=["at the peak", "memory", "share"], tablefmt="simple"))
    if est.device_total_bytes is not None:
        lines.append("")
        label = WIDTH - 2 - 10  # the memory column: "123.45 GiB"
        lines.append(tabulate(
            [
                [_cells(what, label), format_bytes(n)] for what, n in (
                    ("allocated peak (max_memory_allocated)", est.peak_bytes),
                    ("reserved by the caching allocator (max_memory_reserved)", est.reserved_bytes),
                    ("of which beyond the allocated peak (fragmentation)", est.fragmentation_bytes),
                    (f"CUDA context and libraries ({_context_kind(est.context_source)}, "
                     f"{est.module_loading} module loading)", est.context_bytes),
                    ("device total (as nvidia-smi shows)", est.device_total_bytes),
                )
            ],
            headers=[_cells(f"on the GPU ({_gpu_label(est)})", label), "memory"], tablefmt="simple",
        ))
    if est.per_device:
        lines.append("")
        lines.append(render_devices(est.per_device))
    lines.append("")
    busiest = est.busiest
    where = (f"{busiest.role.replace(chr(10), ', ')}, " if busiest.role is not None
             else f"GPU {est.busiest_gpu}, " if est.per_device else "")
    lines.extend(_prose(
        f"peak {where}in step {est.peak_step}, phase {est.peak_phase.value}, "
        f"module {_module_label(est, est.peak_module)}"
    ))
    if est.reserved_bytes is not None:
        lines.extend(_prose(allocator_life_line(est)))
    if est.eval_peak_bytes is not None:
        lines.extend(_prose(
            f"the job's peak is in {'evaluation' if est.peak_in == 'eval' else 'training'}: "
            f"training {format_bytes(est.train_peak_bytes)}, evaluation {format_bytes(est.eval_peak_bytes)}"
        ))
    if est.modules:
        lines.append("")
        lines.extend(render_modules(est))
    if est.assumptions:
        lines.append("")
        lines.append("assumed:")
        lines.extend(_prose(*(f"  - {a}" for a in est.assumptions)))
    branch_lines = render_branches(est)
    if branch_lines:
        lines.append("")
        lines.extend(_prose(*branch_lines))
    if est.budget_bytes is not None:
        lines.append("")
        lines.extend(_prose(*estimate_verdict_lines(est)))
    return "\n".join(line for line in lines if line is not None).replace("\n\n\n", "\n\n")


_PEFT_INNER = "base_model.model"  # PEFT's PeftModel -> LoraModel (base_model) -> the transformers model (model)


def _module_label(est: Estimate, name: str, state_bytes: int = 0) -> str:
    """The root module's own row (``(model)``: what its forward allocates outside its
    submodules) says what it holds: with the labels in the batch and no weights of its own, a
    transformers model's loss on the logits (``GPT2LMHeadModel.forward``'s ``loss_function``:
    the logits upcast, their log-softmax, and in backward their gradients); under PEFT that
    model is ``base_model.model``."""
    labels = any(i.name == "labels" for i in est.batch.inputs)
    if name == _PEFT_INNER and labels and not state_bytes:
        return f"{name} (loss, logits)"
    if name != "(model)":
        return name
    return "(model: loss, logits)" if labels and not state_bytes else "(model, outside submodules)"


def render_modules(est: Estimate) -> list[str]:
    """The top modules at the peak, in ``WIDTH`` columns: what each module owns (weights,
    gradients, optimizer state, communication buffers), what autograd saved inside it for
    backward, and the rest allocated inside it (temporaries, outputs, the loss). Identical copies
    of one repeated block share a row (``transformer.h.{0..11}.attn``), its figures each copy's.
    Laid out for ``WIDTH``: a long name is broken after a dot."""
    groups: dict[tuple, list] = {}
    for m in est.modules:
        groups.setdefault(m.repeat_key, []).append(m)
    rows = []
    for members in groups.values():
        m = members[0]
        name = ranges([x.name for x in members])[0] if len(members) > 1 else _module_label(est, m.name,
                                                                                          m.state_bytes)
        rows.append([name, format_bytes(m.state_bytes), format_bytes(m.saved_bytes),
                     format_bytes(m.activation_bytes - m.saved_bytes), format_bytes(m.total)])
    headers = ["top modules at the peak", "weights,\noptim", "saved", "temps", "total"]
    figures = [max(max(len(r[i]) for r in rows), *map(len, headers[i].split("\n"))) for i in range(1, 5)]
    width = WIDTH - sum(figures) - 2 * len(figures)  # the name column: what the figures leave
    for r in rows:
        r[0] = "\n".join(_split_name(r[0], width))
    lines = table(headers, rows)
    lines.extend(wrap("weights, optim: the weights, gradients, optimizer state and communication buffers "
                      "each module owns; saved: what autograd saved inside it for backward; temps: the rest "
                      "allocated inside it (temporaries, outputs and loss, inputs, workspaces)", hang=0))
    if any(len(g) > 1 for g in groups.values()):
        lines.append("{i..j}: copies i to j of a repeated block, with the same figures (each copy's)")
    return lines


def _split_name(name: str, width: int) -> list[str]:
    """A module name over ``width`` broken after its dots (never inside a part or a range
    ``{0..31}``), the lines after the first indented 2."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(name):
        depth += (ch == "{") - (ch == "}")
        if ch == "." and depth == 0:
            parts.append(name[start:i + 1])
            start = i + 1
    parts.append(name[start:])
    out, current = [], ""
    for part in parts:
        if current.strip() and len(current + part) > width:
            out.append(current)
            current = "  " + part
        else:
            current += part
    return out + [current]


def _answers(answers) -> str:
    return "; ".join(words(a) for a in answers)


def render_branches(est: Estimate) -> list[str]:
    """The data-dependent branches (``memcheck.choices``): the answers pinned by the job,
    the trace reported and what each other answer gave."""
    lines = []
    pinned = est.job.assume if est.job is not None else ()
    if pinned:
        lines.append(f"data-dependent answers pinned (assume): {_answers(pinned)}")
    b = est.branches
    if b is None:
        return lines
    what = "device total" if est.device_total_bytes is not None else "peak"
    taken = b.traces[0]
    lines.append(f"data-dependent branches: {len(b.traces)} traced ({b.alternatives} alternative(s) in "
                 f"{b.seconds:.1f} s); the larger {what} is {_answers(taken.answers)}: "
                 f"{format_bytes(taken.total_bytes)}")
    lines.extend(f"  - only in it: {a}" for a in taken.only_here)
    for other in b.traces[1:]:
        if other.bounded:
            lines.append(f"  {_answers(other.answers)}: at most that (traced to the end of the first forward: "
                         "the same kernels, a subset of its allocations, no more live bytes)")
            continue
        delta = other.total_bytes - taken.total_bytes
        sign = "-" if delta < 0 else "+"
        lines.append(f"  {_answers(other.answers)}: {sign}{format_bytes(abs(delta))} "
                     f"({format_bytes(other.total_bytes)})")
        lines.extend(f"    - only in it: {a}" for a in other.only_here)
    lines.append(f"  ({flag('assume', 'ANSWER')} pins one: " + ", ".join(ANSWERS) + ")")
    return lines


def _device_groups(devices) -> list[tuple[str, DeviceMemory]]:
    """Consecutive GPUs with the same figures share a column ("GPU 1-7")."""
    groups: list[list[DeviceMemory]] = []
    for d in devices:
        if groups and _same(groups[-1][-1], d):
            groups[-1].append(d)
        else:
            groups.append([d])
    return [(g[0].role if g[0].role is not None else f"GPU {g[0].index}" if len(g) == 1
             else f"GPU {g[0].index}-{g[-1].index}", g[0]) for g in groups]


def _same(a: DeviceMemory, b: DeviceMemory) -> bool:
    return a.role is None and b.role is None and (a.peak_bytes, a.reserved_bytes, a.device_total_bytes, a.breakdown_at_peak) == (
        b.peak_bytes, b.reserved_bytes, b.device_total_bytes, b.breakdown_at_peak)


def render_devices(devices) -> str:
    """Each GPU's figures, GPUs as columns."""
    groups = _device_groups(devices)
    rows = []
    for key, label in _CATEGORY_LABELS.items():
        values = [getattr(d.breakdown_at_peak, key) for _, d in groups]
        if any(values):
            rows.append([label] + [format_bytes(v) for v in values])
    rows.append(["allocated peak"] + [format_bytes(d.peak_bytes) for _, d in groups])
    if groups[0][1].device_total_bytes is not None:
        rows.append(["reserved"] + [format_bytes(d.reserved_bytes) for _, d in groups])
        rows.append(["device total"] + [format_bytes(d.device_total_bytes) for _, d in groups])
    rows.append(["peak phase"] + [d.peak_phase.value for _, d in groups])
    return tabulate(rows, headers=["per GPU, at its own peak"] + [name for name, _ in groups], tablefmt="simple")


def render_comparison(cmp: Comparison) -> str:
    """The table printed by ``memcheck MODEL --compare``."""
    first = cmp.rows[0]
    b = first.batch
    lines = _prose(
        f"memcheck: {first.model} on {first.device.value}, {first.precision.value}, {first.optimizer}, "
        f"{b.batch_size} per GPU" + (f" x {b.max_len} tokens" if b.max_len else "") + f", {cmp.gpus} GPU(s)",
    )
    lines.append("")
    cuda = first.device_total_bytes is not None
    headers = ["strategy", "peak\n(allocated)"] + (["reserved", "device\ntotal"] if cuda else []) + ["busiest\nGPU"]
    rows = []
    for r in cmp.rows:
        row = [r.strategy, format_bytes(r.peak_bytes)]
        if cuda:
            row += [format_bytes(r.reserved_bytes), format_bytes(r.device_total_bytes)]
        row.append(str(r.busiest_gpu) if r.per_device else "-")
        if r.fits is not None:
            row.append("fits" if r.fits else "DOES NOT FIT")
        rows.append(row)
    if any(r.fits is not None for r in cmp.rows):
        headers.append(f"vs\n{format_bytes(first.budget_bytes)}")
    lines.extend(table(headers, rows))
    lines.append("")
    lines.extend(_prose(f"figures are each strategy's busiest GPU; run one with {flag('strategy', 'NAME')} "
                        f"{flag('gpus', 'N')} for its "
                        "breakdown"))
    return "\n".join(lines)


PADDING_NOTE = (
    "padding: these figures are for every sequence padded to the length shown. The tokenizer's "
    "padding=True pads each batch only to its longest sample, so shapes (and memory) vary from batch to "
    "batch; only padding='max_length' (or a bucketing sampler capped at that length) makes the traced "
    "worst case the real worst case."
)


PACKING_NOTE = (
    "packing: these figures are for every sample slot filled to the length shown with packed sequences, the "
    "micro-batch's slots flattened into one row with position ids (DataCollatorWithFlattening, TRL's packing / "
    "padding_free), attended through sdpa's or eager's block-diagonal mask."
)


def _packed(plan: Plan) -> bool:
    return plan.job is not None and plan.job.packing


def _flags(plan: Plan, r: PlanOption) -> tuple[str, str]:
    """The recommendation as memcheck flags and as transformers TrainingArguments, each one line."""
    flags, args = _flag_parts(plan, r)
    return " ".join(flags), ", ".join(args)


def _flag_parts(plan: Plan, r: PlanOption) -> tuple[list[str], list[str]]:
    """The recommendation as memcheck flags (each with its value) and as transformers
    TrainingArguments (each ``key=value``)."""
    flags = [flag("batch_size", r.micro_batch_size)]
    args = [hf_argument("batch_size", r.micro_batch_size)]
    if r.accumulation_steps > 1:
        flags.append(flag("accumulate", r.accumulation_steps))
    args.append(hf_argument("accumulate", r.accumulation_steps))
    if r.checkpointing == "full":
        flags.append(flag("checkpointing", "full"))
        args.append(f"{checkpointing_argument()}=True")
    elif r.checkpointing == "half":
        # memcheck's "half" wraps half_of(repeated_blocks(model)), the blocks the plan traced
        # (memcheck.training.checkpointing.apply_checkpointing); the table lists them
        flags.append(flag("checkpointing", "half"))
        # transformers' every_n_layers checkpoints layers 0, n, 2n, ... (modeling_utils.py
        # _set_gradient_checkpointing): with n = 2 the blocks half_of() names.
        name = checkpointing_argument()
        args.extend((f"{name}=True", f"{name}_kwargs={{'every_n_layers': 2}}"))
    if r.precision != "fp32":
        flags.append(flag("precision", r.precision))
    if _deepspeed(plan, r):  # the Trainer's bf16=True turns on DeepSpeed's bf16 mode (bf16.enabled)
        args.append(_DEEPSPEED_PRECISION.get(r.precision, "fp32 (neither bf16 nor fp16)"))
    else:
        args.append({"amp-bf16": "bf16=True", "amp-fp16": "fp16=True", "bf16": "bf16=True with the model loaded in "
                     "torch.bfloat16", "fp16": "the model loaded in torch.float16 (no TrainingArguments flag)"}
                    .get(r.precision, "fp32 (neither bf16 nor fp16)"))
    optimizer = plan.job.optimizer if plan.job is not None else None
    if isinstance(optimizer, str):  # every setting traced, the optimizer too (issue 17)
        flags.append(flag("optimizer", optimizer))
        hf = {v: k for k, v in reversed(list(HF_OPTIMIZERS.items()))}.get(optimizer)
        args.append(f'optim="{hf}"' if hf else f"an optimizer built as memcheck's {optimizer!r} "
                    "(Trainer(optimizers=(optimizer, None)))")
    elif optimizer is not None:
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        args.append(f"the optimizer {name} builds (Trainer(optimizers=(optimizer, None)))")
    if _packed(plan):
        flags.append(flag("packing"))
        args.append("packing=True (TRL's SFTConfig; or DataCollatorWithFlattening)")
    if plan.job is not None and plan.job.assume:  # the data-dependent answers the plan pinned, or the user's
        flags.append(flag("assume", ",".join(plan.job.assume)))
    for spelling, value in _kept_settings(plan):  # the user's own settings the plan traced with
        flags.append(flag(spelling.field, value if isinstance(value, bool) else shlex.quote(str(value))))
    args.extend(_trainer_words(plan))
    if r.offload == "optimizer":  # DeepSpeed's ZeRO-Offload on this one GPU
        flags.extend((flag("strategy", "zero2"), flag("gpus", 1), flag("offload", "optimizer")))
        args.append('deepspeed= a ZeRO stage 2 config with "offload_optimizer": {"device": "cpu"}')
    elif plan.strategy != "single":
        flags.extend((flag("strategy", plan.strategy), flag("gpus", plan.gpus)))
        sharding = _fsdp1_sharding(plan)
        if plan.strategy == "fsdp1" and sharding != "full_shard":
            flags.append(flag("fsdp_sharding", sharding))
        if plan.job is not None and plan.job.gpus_per_node is not None:
            flags.append(flag("gpus_per_node", plan.job.gpus_per_node))
        args.append({"fsdp": 'fsdp="full_shard"', "fsdp1": f'fsdp="{sharding}", fsdp_config={{"version": 1}}',
                     "zero3": "deepspeed= a ZeRO stage 3 config",
                     "zero2": "deepspeed= a ZeRO stage 2 config", "zero1": "deepspeed= a ZeRO stage 1 config"}
                    .get(plan.strategy, f"launched on {plan.gpus} GPUs (torchrun --nproc_per_node {plan.gpus})"))
    return flags, args


# The job settings plan takes from the user and traces every option with, echoed in the recommendation's
# flags and TOML when they differ from the Job's defaults, so that pasting them back traces the plan's own
# job: those declared kept (memcheck.job.setting).
KEPT_SETTINGS = tuple(s.field for s in SPELLINGS if s.kept)


def _kept_settings(plan: Plan) -> list[tuple[Spelling, Any]]:
    """``(spelling, value)`` of each ``KEPT_SETTINGS`` field the plan's job sets to other than the
    default; values as a flag or config key takes them (enums by value, LoRA settings as text)."""
    if plan.job is None:
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(plan.job) if f.name in SPELLING}
    out = []
    for field in KEPT_SETTINGS:
        value = getattr(plan.job, field)
        if value == defaults[field] or (field == "qlora" and not value):
            continue
        out.append((SPELLING[field], value.value if hasattr(value, "value") else
                    str(value) if not isinstance(value, (bool, int, float)) else value))
    return out


def _trainer_words(plan: Plan) -> list[str]:
    """The kept settings the HF Trainer takes (TrainingArguments) or its model is built with."""
    job, words = plan.job, []
    if job is None:
        return words
    if job.qlora:  # memcheck.training.adapters: NF4, double quantization, bf16 compute (each part one line)
        words.extend(("BitsAndBytesConfig(load_in_4bit=True, nf4, double quant, bf16 compute)",
                      "prepare_model_for_kbit_training"))
    if job.lora is not None or job.qlora:
        words.append(f"PEFT LoraConfig({job.lora or 'defaults'})")
    if job.max_grad_norm is not None:
        words.append(hf_argument("max_grad_norm", job.max_grad_norm))
    if job.eval_batch_size is not None:
        words.append(hf_argument("eval_batch_size", job.eval_batch_size))
    return words


# A precision under DeepSpeed, in the Trainer's words. bf16=True fills the DeepSpeed config's bf16.enabled
# (transformers/integrations/deepspeed.py, fill_match): DeepSpeed's bf16 mode, whose engine casts the
# weights to bf16 and whose ZeRO optimizer keeps an fp32 master, memcheck's pure bf16
# (memcheck.workloads.trainer_files.deepspeed_mode); autocast over fp32 weights is the config's torch_autocast.
_DEEPSPEED_PRECISION = {
    "bf16": "bf16=True (DeepSpeed's bf16 mode: the engine casts the weights to bf16, an fp32 master in the "
            "optimizer)",
    "fp16": "fp16=True (DeepSpeed's fp16 mode: the engine casts the weights to fp16, an fp32 master in the "
            "optimizer)",
    "amp-bf16": 'neither bf16 nor fp16 (they would turn on DeepSpeed\'s bf16 mode); the DeepSpeed config\'s '
                '"torch_autocast": {"enabled": true, "dtype": "bfloat16"}',
    "amp-fp16": 'neither bf16 nor fp16 (they would turn on DeepSpeed\'s fp16 mode); the DeepSpeed config\'s '
                '"torch_autocast": {"enabled": true, "dtype": "float16"}',
}


def _deepspeed(plan: Plan, r: PlanOption) -> bool:
    """The recommendation runs under DeepSpeed: a ZeRO stage, or ZeRO-Offload on one GPU."""
    return r.offload == "optimizer" or plan.strategy.startswith("zero")


def _fsdp1_sharding(plan: Plan) -> str:
    """The plan's fsdp1 sharding strategy (FSDP1's default, full_shard, when the job names none)."""
    sharding = plan.job.fsdp_sharding if plan.job is not None else None
    return sharding.value if sharding is not None else "full_shard"


# Lightning's Trainer(precision=...) for each precision: the first of its names memcheck reads.
LIGHTNING_NAMES = {v: k for k, v in reversed(list(PRECISION_ALIASES.items()))}


def _lightning_parts(plan: Plan, r: PlanOption) -> list[str]:
    """The recommendation in Lightning's words: the Trainer's arguments, then what Lightning
    has no Trainer argument for (checkpointing, the optimizer)."""
    autocast = _deepspeed(plan, r) and r.precision.startswith("amp-")  # bf16-mixed: DeepSpeed's bf16 mode
    parts = [f'precision="{"32-true" if autocast else LIGHTNING_NAMES.get(r.precision, r.precision)}"']
    if r.accumulation_steps > 1:
        parts.append(lightning_argument("accumulate", r.accumulation_steps))
    if autocast:  # fp32 weights under torch.autocast: the DeepSpeed config's torch_autocast section
        stage = 2 if r.offload == "optimizer" else int(plan.strategy[-1])
        offload = ', "offload_optimizer": {"device": "cpu"}' if r.offload == "optimizer" else ""
        dtype = "bfloat16" if r.precision == "amp-bf16" else "float16"
        parts.append(f'strategy=DeepSpeedStrategy(config={{"zero_optimization": {{"stage": {stage}{offload}}}, '
                     f'"torch_autocast": {{"enabled": true, "dtype": "{dtype}"}}}})')
        if r.offload != "optimizer":
            parts.append(f"devices={plan.gpus}")
    elif r.offload == "optimizer":
        parts.append('strategy="deepspeed_stage_2_offload"')
    elif plan.strategy == "ddp":
        parts.extend(('strategy="ddp"', f"devices={plan.gpus}"))
    elif plan.strategy == "fsdp":  # FSDP2: Lightning's strategy="fsdp" is FSDPStrategy, FSDP1's wrapper
        # both sizes given: "auto" makes data_parallel_size the node count and tensor_parallel_size the
        # GPUs of a node (lightning/pytorch/strategies/model_parallel.py, setup_environment)
        parts.extend((f"strategy=ModelParallelStrategy(data_parallel_size={plan.gpus}, tensor_parallel_size=1)",
                      f"devices={plan.gpus}", "fully_shard() on each block, then the model, in configure_model()"))
    elif plan.strategy == "fsdp1":  # Lightning's FSDPStrategy is FSDP1's FullyShardedDataParallel
        sharding = _fsdp1_sharding(plan)
        parts.extend(('strategy="fsdp"' if sharding == "full_shard"
                      else f'strategy=FSDPStrategy(sharding_strategy="{sharding.upper()}")', f"devices={plan.gpus}"))
    elif plan.strategy.startswith("zero"):
        parts.extend((f'strategy="deepspeed_stage_{plan.strategy[-1]}"', f"devices={plan.gpus}"))
    parts.append(f"DataLoader(batch_size={r.micro_batch_size})")
    if r.checkpointing == "full":
        parts.append("model.gradient_checkpointing_enable()")
    elif r.checkpointing == "half":
        parts.append("torch.utils.checkpoint around the blocks listed")
    optimizer = {"adamw-fused": "torch.optim.AdamW(params, fused=True)",
                 "adamw-8bit": "bitsandbytes.optim.AdamW8bit(params)",
                 "adamw": "torch.optim.AdamW(params)"}.get(optimizer_name(r.optimizer))
    if optimizer and r.offload != "optimizer":
        parts.append(optimizer)
    return parts


def accelerate_config(plan: Plan, r: PlanOption) -> dict[str, Any] | None:
    """The recommendation's launch as an ``accelerate config`` file (accelerate's own keys, as
    ``accelerate config`` writes them and ``memcheck.workloads.trainer_files`` reads them back), for
    a DDP or FSDP plan over fp32 or autocast weights; None otherwise (one GPU, DeepSpeed: the
    DeepSpeed config instead; pure bf16/fp16 weights, which accelerate's ``mixed_precision`` does not
    name). The batch, accumulation and checkpointing stay the training script's (the TOML job's)."""
    if r.offload == "optimizer" or plan.strategy not in ("ddp", "fsdp", "fsdp1") or r.precision in ("bf16", "fp16"):
        return None
    if _accelerate_policy(plan, r) is not None:
        return None
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE",
                              "distributed_type": "MULTI_GPU" if plan.strategy == "ddp" else "FSDP",
                              "mixed_precision": {"amp-bf16": "bf16", "amp-fp16": "fp16"}.get(r.precision, "no"),
                              "num_machines": 1, "num_processes": plan.gpus}
    if plan.strategy != "ddp":
        fsdp: dict[str, Any] = {"fsdp_version": 2 if plan.strategy == "fsdp" else 1,
                                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                "fsdp_offload_params": r.offload == "params"}
        if plan.strategy == "fsdp1":
            fsdp["fsdp_reshard_after_forward"] = _fsdp1_sharding(plan).upper()
        config["fsdp_config"] = fsdp
    return config


def _accelerate_policy(plan: Plan, r: PlanOption) -> str | None:
    """Where the plan's FSDP job differs from what accelerate makes of its precision: accelerate (and
    the HF Trainer through it) gives FSDP a mixed-precision policy of the autocast dtype
    (``memcheck.workloads.trainer_files.fsdp_mixed_precision``), so its config is the plan's job only
    when the job has that policy too. The flags of the job it would be, or None when they agree."""
    if plan.strategy not in ("fsdp", "fsdp1") or plan.job is None:
        return None
    from memcheck.workloads.trainer_files import fsdp_mixed_precision

    policy = fsdp_mixed_precision(r.precision, plan.strategy, _fsdp1_sharding(plan), output_dtype=True)
    mine = {name: getattr(plan.job, name).value for name in ("param_dtype", "reduce_dtype", "output_dtype")
            if getattr(plan.job, name) is not None}
    if policy == mine:
        return None
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in policy.items()) or "no policy flags"


def deepspeed_config(plan: Plan, r: PlanOption) -> dict[str, Any] | None:
    """The recommendation as a DeepSpeed JSON config (ZeRO stage, offload, precision, batch and
    accumulation; ``memcheck check ds.json --model ...`` reads it back), for a ZeRO plan or
    ZeRO-Offload on one GPU; None otherwise. Pure bf16/fp16 is DeepSpeed's bf16/fp16 mode (the
    engine casts the weights, an fp32 master in the optimizer), autocast its ``torch_autocast``."""
    if not _deepspeed(plan, r):
        return None
    stage = 2 if r.offload == "optimizer" else int(plan.strategy[-1])
    zero: dict[str, Any] = {"stage": stage}
    if r.offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif r.offload == "params":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": r.micro_batch_size,
                              "gradient_accumulation_steps": r.accumulation_steps, "zero_optimization": zero}
    if r.precision in ("bf16", "fp16"):
        config[r.precision] = {"enabled": True}
    elif r.precision in ("amp-bf16", "amp-fp16"):
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16" if r.precision == "amp-bf16" else "float16"}
    return config


def _yaml_lines(data: dict[str, Any], indent: str = "") -> list[str]:
    """``key: value`` lines of a YAML mapping of scalars and mappings (what ``accelerate_config`` holds)."""
    lines = []
    for name, value in data.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{name}:")
            lines.extend(_yaml_lines(value, indent + "  "))
        else:
            lines.append(f"{indent}{name}: {json.dumps(value)}")
    return lines


def _toml_lines(plan: Plan, r: PlanOption) -> list[str]:
    """The recommendation as a ``memcheck check`` job (its config keys, memcheck.job.SPELLINGS)."""
    lines = ["[jobs.recommended]", key("batch_size", r.micro_batch_size), key("accumulate", r.accumulation_steps),
             key("checkpointing", r.checkpointing), key("precision", r.precision)]
    if isinstance(r.optimizer, str):  # a model file's make_optimizer: the file's own, not a config key
        lines.append(key("optimizer", r.optimizer))
    if r.offload == "optimizer":
        lines += [key("strategy", "zero2"), key("gpus", 1), key("offload", "optimizer")]
    elif plan.strategy != "single":
        lines += [key("strategy", plan.strategy), key("gpus", plan.gpus)]
        if plan.strategy == "fsdp1":
            lines.append(key("fsdp_sharding", _fsdp1_sharding(plan)))
        if plan.job is not None and plan.job.gpus_per_node is not None:
            lines.append(key("gpus_per_node", plan.job.gpus_per_node))
    if plan.job is not None and plan.job.assume:
        lines.append(key("assume", plan.job.assume))
    if plan.job is not None and plan.job.trust_remote_code:
        lines.append(key("trust_remote_code", True))
    for spelling, value in _kept_settings(plan):
        lines.append(key(spelling.field, value))
    return lines


def _optimizer_cell(option: PlanOption) -> str:
    if option.offload == "optimizer":
        return "offload"
    name = optimizer_name(option.optimizer)
    return {"adamw-fused": "fused", "adamw-8bit": "8-bit"}.get(name, name)


def _checkpointing_label(plan: Plan, option: PlanOption, short: bool = False) -> str:
    """``half (6 of 12 blocks)``, or for the table (``short``) ``half (6/12)``: the blocks
    checkpointed of the repeated blocks."""
    total = len(plan.blocks)
    done = len(half_of(plan.blocks)) if option.checkpointing == "half" else total
    if option.checkpointing == "half" or (option.checkpointing == "full" and plan.blocks):
        if short:
            return f"{option.checkpointing} ({done}/{total})"
        return f"half ({done} of {total} blocks)" if option.checkpointing == "half" else f"full ({total} blocks)"
    return option.checkpointing


def render_plan(plan: Plan) -> str:
    """The table printed by ``memcheck plan``."""
    where = plan.gpu.name if plan.gpu is not None else plan.device.value
    head = f"memcheck plan: {plan.model} on {where}" + (
        f", {plan.gpus} GPU(s), {plan.strategy}" if plan.device.value == "cuda" else "")
    if plan.global_batch is not None:
        head += f", global batch {plan.global_batch}"
    packed, length = _packed(plan), "slot length" if _packed(plan) else "padded length"
    if plan.max_len:
        head += f", every sample slot packed to {plan.max_len} tokens" if packed else \
            f", every sequence padded to {plan.max_len}"
    what = "device total" if plan.device.value == "cuda" else "peak"
    lines = _prose(
        head,
        f"limit: {what} at most {format_bytes(plan.limit_bytes)} = capacity {format_bytes(plan.capacity_bytes)} "
        f"minus a {margin_words(plan.margin)} margin ({format_bytes(plan.margin_bytes)})",
    )
    lines.append("")
    r = plan.recommended
    if r is not None:
        per_step = r.micro_batch_size * r.accumulation_steps * plan.gpus
        lines.extend(_prose(
            f"RECOMMENDED: micro-batch {r.micro_batch_size} x {r.accumulation_steps} accumulation step(s)"
            + (f" x {plan.gpus} GPUs" if plan.gpus > 1 else "") + f" = {per_step} samples per optimizer step, "
            f"checkpointing {_checkpointing_label(plan, r)}, {r.precision}, {optimizer_name(r.optimizer)}"
            + (", optimizer offloaded to the CPU (DeepSpeed ZeRO-2)" if r.offload == "optimizer" else "")
        ))
        if plan.global_batch is not None and per_step != plan.global_batch:
            lines.extend(_prose(f"  note: {per_step} is the nearest reachable to the global batch {plan.global_batch}"))
        lines.extend(_prose(f"  {what} {format_bytes(r.predicted_device_total_bytes)} (traced at exactly this point): "
                            f"fits with {headroom_words(plan.judgement_of(r.predicted_device_total_bytes))}"))
        flags, args = _flag_parts(plan, r)
        lines.extend(continued("  memcheck flags:", flags, shell=True))
        lines.extend(continued("  TrainingArguments:", args, shell=False))
        lines.extend(continued("  Lightning:", _lightning_parts(plan, r), shell=False))
        accelerate, deepspeed = accelerate_config(plan, r), deepspeed_config(plan, r)
        policy = _accelerate_policy(plan, r)
        if accelerate is not None:
            lines.append("  accelerate config (YAML; accelerate launch --config_file FILE):")
            lines.extend("    " + line for line in _yaml_lines(accelerate))
        elif policy is not None and r.offload != "optimizer":
            lines.extend(_prose(f"  accelerate config: none is this job: accelerate's mixed_precision also gives "
                                f"FSDP a policy in that dtype, the job of {policy} (plan with those flags for an "
                                "accelerate or TrainingArguments launch)"))
        if deepspeed is not None:
            lines.append("  DeepSpeed config (JSON; TrainingArguments(deepspeed=FILE)):")
            lines.extend("    " + line for line in json.dumps(deepspeed, indent=2).splitlines())
        lines.append("  memcheck check (TOML):")
        lines.extend("    " + line for line in _toml_lines(plan, r))
        if r.checkpointing == "half":
            lines.extend(continued("  checkpointed blocks:", ranges(plan.checkpointed_modules), shell=False))
    else:
        lines.extend(_prose("NOTHING FITS: not even micro-batch 1 with the most checkpointing and the lowest "
                            "precision allowed"))
        if plan.suggestion is not None and str(plan.suggestion):
            lines.extend(_prose(f"  what would: {plan.suggestion}"))
    lines.append("")
    rows = []
    for o in ((r,) if r else ()) + plan.alternatives:
        rows.append([
            "*" if o is r else "", o.precision, _optimizer_cell(o), _checkpointing_label(plan, o, short=True),
            f"{o.micro_batch_size} x {o.accumulation_steps}" if o.fits else "-",
            format_bytes(o.predicted_device_total_bytes),
            ("stopped" if o.note else str(o.largest_fitting_micro_batch)
             + ("" if o.boundary_confirmed else " (not pinned)")) if o.fits else "none",
            f"{o.relative_cost / r.relative_cost:.2f}" if (o.fits and r) else "-",
            str(o.traces),
        ])
    if rows:  # none when every option was ruled out before tracing (not_traced, below)
        lines.extend(table(["", "precision", "optim", "checkpointing", "batch\nx accum", what.replace(" ", "\n"),
                            "largest\nfitting", "cost", "traces"], rows))
        unfit = any(not o.fits for o in plan.alternatives)
        lines.extend(_prose(
            "batch x accum: micro-batch x accumulation steps; cost: the proxy's time per optimizer step (per "
            "sample without a global batch), relative, 1.00 = recommended; see memcheck.engine.plan"
            + (f"; largest fitting none: the option does not fit even at micro-batch 1, whose {what} is shown"
               if unfit else "")
            + ("; stopped: searched no further after micro-batch 1, whose FLOPs alone cost more than a better "
               "option's" if any(o.note for o in plan.alternatives) else "")))
    if plan.length_profile:
        lines.append("")
        lines.append(tabulate(
            [[p.length, f"{100 * p.length / plan.max_len:.0f}%", format_bytes(p.predicted_device_total_bytes),
              "fits" if p.fits else "DOES NOT FIT"] for p in plan.length_profile],
            headers=[f"{length} (micro-batch {r.micro_batch_size})", "of max-len", what, ""],
            tablefmt="simple",
        ))
        if plan.longest_fitting_length is not None:
            limit = plan.position_limit or plan.max_len
            lines.extend(_prose(f"longest {length} that fits at micro-batch {r.micro_batch_size}: "
                                f"{plan.longest_fitting_length}" + (
                                    " (the model's position limit)"
                                    if plan.longest_fitting_length == plan.position_limit
                                    else f" (searched up to {flag('max_len')})" if limit == plan.max_len else
                                    f" (in multiples of 8, up to the position limit {limit})")))
    if plan.verification is not None:
        lines.append("")
        lines.extend(_prose(render_verification(plan.verification)))
    lines.append("")
    lines.append(f"traces: {plan.traces}")
    for skipped in plan.not_traced:
        lines.extend(wrap(f"  {skipped}", hang=4))
    if plan.branches_note:
        lines.extend(_prose(plan.branches_note))
    if plan.max_len:
        lines.extend(wrap(PACKING_NOTE if packed else PADDING_NOTE, hang=0))
    return "\n".join(lines)


def margin_words(margin: float) -> str:
    """``5%``: the margin as the verdict lines say it."""
    return f"{100 * margin:.3g}%"


def headroom_words(j: "Judgement") -> str:
    """The one verdict rule in words, the same on every verdict line (estimate, check, plan,
    preflight, the callbacks): the headroom the job leaves and the margin the gate keeps."""
    kept = f"the gate keeps {margin_words(j.margin)}"
    if j.total_bytes > j.capacity_bytes:
        return f"{format_bytes(j.total_bytes - j.capacity_bytes)} over the capacity; {kept}"
    return f"{100 * j.headroom:.1f}% headroom; {kept}"


def estimate_verdict_lines(est: Estimate) -> tuple[str, ...]:
    """The estimate's verdict (the one rule, ``Estimate.judgement``) and where to go next."""
    j = est.judgement
    what = "device total" if est.device_total_bytes is not None else "peak"
    first = (f"{'FITS' if j.fits else 'DOES NOT FIT'}: {what} {format_bytes(j.total_bytes)} vs "
             f"{format_bytes(j.capacity_bytes)} available, {headroom_words(j)} (limit {format_bytes(j.limit_bytes)})")
    nxt = ("memcheck plan (the same model and flags) finds the largest micro-batch within the limit" if j.fits
           else "memcheck plan (the same model and flags) finds the settings that fit within the limit")
    return first, nxt


def _where(v: Verdict) -> str:
    gpu = v.estimate.gpu
    return (f"{gpu.name} {format_bytes(v.capacity_bytes)}" if gpu is not None
            else f"{v.estimate.device.value} budget {format_bytes(v.capacity_bytes)}")


def verdict_line(v: Verdict) -> str:
    """One line: does the job fit, by how much, and at which settings."""
    est = v.estimate
    what = "device total" if est.device_total_bytes is not None else "peak"
    settings = (f"micro-batch {est.batch.batch_size} x {est.accumulate} accumulation step(s), {est.precision.value}, "
                f"checkpointing {'none' if not est.checkpointing else f'{len(est.checkpointing)} module(s)'}"
                + (f", {est.strategy}" if est.gpus > 1 else ""))  # the label names the GPUs: "zero2 x8"
    limit = (f"the {format_bytes(v.limit_bytes)} limit ({_where(v)} minus a {margin_words(v.margin)} margin)"
             if v.margin else f"the {format_bytes(v.limit_bytes)} capacity ({_where(v)})")
    if v.fits:
        return (f"fits: {est.model} needs {format_bytes(est.total_bytes)} ({what}) of {limit} at {settings}; "
                f"{headroom_words(v.judgement)}")
    where = "the evaluation pass" if est.peak_in == "eval" else est.peak_phase.value
    return (f"will not fit: {est.model} needs {format_bytes(est.total_bytes)} ({what}, reached in {where}) "
            f"over {limit} at {settings}; {headroom_words(v.judgement)}")


_FIX_STYLES = ("python", "memcheck", "trainer", "lightning", "config", "deepspeed")


def fix_line(v: Verdict, style: str = "python") -> str:
    """One line: what to run instead, in the words of where the job is configured:
    ``python`` (check()'s arguments), ``memcheck`` (CLI flags), ``trainer`` (transformers'
    TrainingArguments), ``lightning`` (Trainer arguments), ``config`` (``memcheck check`` keys) or
    ``deepspeed`` (a DeepSpeed config's keys, and ``memcheck check``'s --checkpointing)."""
    if style not in _FIX_STYLES:
        raise ValueError(f"style must be one of {', '.join(_FIX_STYLES)}, got {style!r}")
    if v.fits:
        return "fix: none needed"
    if v.eval_fix is not None:
        e = v.eval_fix
        words = {
            "python": f"{keyword('eval_batch_size', e.eval_batch_size)}, "
                      f"{keyword('eval_accumulate_predictions', e.eval_accumulate_predictions)}",
            "memcheck": f"{flag('eval_batch_size', e.eval_batch_size)} "
                        f"{flag('eval_accumulate_predictions', e.eval_accumulate_predictions)}",
            "trainer": hf_argument("eval_batch_size", e.eval_batch_size)
                       + (f", eval_accumulation_steps={e.eval_accumulate_predictions}"
                          if e.eval_accumulate_predictions else ""),
            "lightning": f"an evaluation DataLoader with batch_size={e.eval_batch_size}",
            "config": f"{key('eval_batch_size', e.eval_batch_size)}, "
                      f"{key('eval_accumulate_predictions', e.eval_accumulate_predictions)}",
            "deepspeed": f"a batch size of {e.eval_batch_size}"
                         + (f", {e.eval_accumulate_predictions} batches of predictions kept"
                            if e.eval_accumulate_predictions else ""),
        }[style]
        return (f"fix: training fits, evaluation does not; evaluate with {words} "
                f"({format_bytes(e.predicted_device_total_bytes)}, traced)")
    if v.fix is None:
        if v.estimate.peak_in == "eval":
            return "fix: not even an evaluation batch of 1 fits next to the training state; use a larger GPU"
        return "fix: not searched (check(fix=False))"
    plan, r = v.fix, v.fix.recommended
    if r is None:
        tried = ", ".join(dict.fromkeys([v.estimate.precision.value, *(o.precision for o in plan.alternatives)]))
        return (f"fix: no micro-batch, accumulation and checkpointing at {tried} fits on this card; "
                f"what would: {(plan.suggestion and str(plan.suggestion)) or ('a larger GPU' if plan.device.value == 'cuda' else 'a larger budget')}")
    flags, args = _flags(plan, r)
    ck = "none" if r.checkpointing == "none" else "full" if r.checkpointing == "full" else list(
        plan.checkpointed_modules)
    est = v.estimate
    # a fix found at another precision or optimizer (check's second stage) names them in every style
    precision = r.precision if r.precision != est.precision.value else None
    optimizer = (r.optimizer if isinstance(r.optimizer, str) and r.optimizer != est.job.optimizer else None)
    offload = r.offload == "optimizer"
    more = {"precision": precision, "optimizer": optimizer,
            **({"strategy": "zero2", "gpus": 1, "offload": "optimizer"} if offload else {})}
    more = {field: value for field, value in more.items() if value}
    if r.checkpointing == "none" and est.job.checkpointing != "none":
        flags += " " + flag("checkpointing", "none")  # the job's own (a QLoRA recipe's full) is not the fix's
    words = {
        "python": ", ".join(keyword(field, value) for field, value in {
            "batch_size": r.micro_batch_size, "accumulate": r.accumulation_steps, "checkpointing": ck, **more}.items()),
        "memcheck": flags,
        "trainer": args,
        "lightning": f"batch_size={r.micro_batch_size} in the DataLoader, Trainer("
                     f"{lightning_argument('accumulate', r.accumulation_steps)}"
                     + (f', precision="{LIGHTNING_NAMES.get(precision, precision)}"' if precision else "") + ")"
                     + ("" if r.checkpointing == "none" else ", gradient checkpointing on "
                        + _checkpointing_label(plan, r)) + (f", optimizer {optimizer}" if optimizer else ""),
        "config": ", ".join(key(field, value) for field, value in {
            "batch_size": r.micro_batch_size, "accumulate": r.accumulation_steps, "checkpointing": ck, **more}.items()),
        "deepspeed": f'"train_micro_batch_size_per_gpu": {r.micro_batch_size}, "gradient_accumulation_steps": '
                     f"{r.accumulation_steps}, " + flag("checkpointing", ck if isinstance(ck, str) else ",".join(ck)),
    }[style]
    return (f"fix: {words} (global batch {plan.effective_global_batch} kept; "
            f"{format_bytes(r.predicted_device_total_bytes)}, traced at exactly these settings)")


def render_verdict(v: Verdict, style: str = "python") -> str:
    """The verdict and, for a job that does not fit, the fix: two lines."""
    return verdict_line(v) if v.fits else f"{verdict_line(v)}\n{fix_line(v, style)}"


def render_verification(v) -> str:
    """``--measure``'s line: the recommendation run for real."""
    if v.out_of_memory:
        return (f"MEASURED: ran out of memory after {v.steps} step(s) on {v.device}, predicted "
                f"{format_bytes(v.predicted_bytes)}: {v.error}")
    what = "device used (driver)" if v.device == "cuda" else "peak (profiler)"
    text = (f"MEASURED over {v.steps} real steps on {v.device}: {what} {format_bytes(v.measured_bytes)}, "
            f"predicted {format_bytes(v.predicted_bytes)} ({100 * v.error_fraction:+.1f}%)")
    if v.peak_reserved_bytes is not None:
        text += (f"; max_memory_allocated {format_bytes(v.peak_allocated_bytes)}, "
                 f"max_memory_reserved {format_bytes(v.peak_reserved_bytes)}")
    return text


def render_json(est) -> str:
    """One JSON object, as ``--json`` prints it (an Estimate, a Comparison or a Plan)."""
    return json.dumps(est.to_dict(), indent=2)


def _context_kind(source: str | None) -> str:
    """How a context figure was got, for a label: measured on that GPU, a published bare context
    (plus memcheck's estimate of what it leaves out), or an estimate."""
    if source and source.startswith("measured:"):
        return "measured"
    return "published bare context + estimate" if source and source.startswith("published:") else "estimate"


def render_gpus(gpus, as_json: bool = False, wide: bool = False) -> str:
    """The table (or JSON) of ``memcheck gpus``, within 80 columns: name, capacity as CUDA reports
    it, compute capability, the CUDA context and what it rests on (measured, published or
    estimated), and the datasheet rates the planner's cost proxy uses. ``wide`` adds each card's
    sources under the table, wrapped; JSON carries everything."""
    from memcheck.cuda.gpus import RATES, SMI_CAPACITY

    gpus = list(gpus)
    names = {g.name for g in gpus}
    rows = []
    for g in gpus:
        r = RATES.get(g.name)
        rows.append({"name": g.name, "capacity_bytes": g.capacity_bytes, "arch": f"sm{g.arch[0]}{g.arch[1]}",
                     "context_bytes": g.context_bytes, "context_source": g.context_source,
                     "fp32_flops": r.fp32_flops if r else None, "tensor_flops": r.tensor_flops if r else None,
                     "bandwidth_bytes_per_s": r.bandwidth if r else None, "rates_source": r.source if r else None})
    if as_json:
        return json.dumps(rows, indent=2)
    table = tabulate(
        [[r["name"], format_bytes(r["capacity_bytes"]), r["arch"], format_bytes(r["context_bytes"]),
          r["context_source"].split(":")[0],
          "" if r["tensor_flops"] is None else f"{r['tensor_flops'] / 1e12:.0f}",
          "" if r["bandwidth_bytes_per_s"] is None else f"{r['bandwidth_bytes_per_s'] / 1e9:.0f}"] for r in rows],
        headers=["GPU", "capacity", "arch", "CUDA context", "context", "TFLOP/s", "GB/s"], tablefmt="simple",
        colalign=("left", "right", "left", "right", "left", "right", "right"),
    )
    lines = [table, "",
             *wrap(f"capacity: what CUDA reports (nvidia-smi's figure, maybe ~2% high, for "
                   f"{', '.join(n for n in SMI_CAPACITY if n in names)}); CUDA context: device memory outside PyTorch's allocator; "
                   "TFLOP/s: bf16 tensor (fp16 without bf16), dense, datasheet; GB/s: memory bandwidth. "
                   + ("Sources below." if wide else "Sources: memcheck gpus --wide or --json."), indent="")]
    if wide:
        for r in rows:
            lines.append("")
            lines.extend(wrap(f"{r['name']}: context {r['context_source']}", indent="    "))
            if r["rates_source"]:
                lines.extend(wrap(f"    rates: {r['rates_source']}", indent="    "))
    return "\n".join(lines)


def render_config_check(results, skipped=(), as_json: bool = False) -> str:
    """``memcheck check``'s output for ``(JobConfig, Verdict)`` pairs: one line per job that
    fits; for one that does not, its verdict and its fix in config keys; then the job's notes
    (a DeepSpeed config's keys read and not modelled). ``--json``: one object, ``{"fits",
    "results": [...], "skipped": [...]}``, each result with its ``notes``."""
    if as_json:
        return json.dumps({
            "fits": all(v.fits for _, v in results),
            "results": [{"file": job.file, "job": job.name, "table": job.where or None,
                         "verdict_line": verdict_line(v), "fix_line": None if v.fits else fix_line(v, _style(job)),
                         "notes": list(getattr(job, "notes", ())), **v.to_dict()} for job, v in results],
            "skipped": list(skipped),
        }, indent=2)
    lines = []
    for job, v in results:
        if v.fits:
            what = "device total" if v.estimate.device_total_bytes is not None else "peak"
            lines.extend(wrap(f"ok{_GLUE * 4}{job.label}: {what} {format_bytes(v.estimate.total_bytes)} of the "
                              f"{format_bytes(v.limit_bytes)} limit; {headroom_words(v.judgement)}", indent=" " * 8))
        else:  # the verdict's word stays on the first line with the file's name
            lines.extend(wrap(f"FAIL{_GLUE * 2}{job.label}: {verdict_line(v)}", indent=" " * 8))
            lines.extend(wrap(f"      {fix_line(v, _style(job))}", indent=" " * 8))
        for note in getattr(job, "notes", ()):
            lines.extend(wrap(f"      note: {note}", indent=" " * 8))
    return "\n".join(lines)


def _style(job) -> str:
    """How a ``memcheck check`` job's fix is worded: a DeepSpeed config's keys, or memcheck's config keys."""
    return "deepspeed" if getattr(job, "deepspeed", None) is not None else "config"


def will_not_fit_message(verdict: "Verdict", style: str = "python") -> str:
    """``WillNotFit``'s message: the verdict on one line, the fix (in ``style``'s words) on the next."""
    return f"{verdict_line(verdict)}\n{fix_line(verdict, style)}"


def render_suggestion(s: "Suggestion") -> str:
    """When nothing fits: the larger GPU that holds the most frugal option, and the fewest GPUs
    of this size a sharded strategy needs, as one sentence ("" on the CPU target)."""
    if not s.searched:
        return ""
    how = f"micro-batch 1, {s.precision}, checkpointing {s.checkpointing}"
    multi = s.strategy != "single"
    if s.larger_gpu is None:
        parts = ["no single GPU in `memcheck gpus` holds it"]
    else:
        g = s.larger_gpu
        which = f"{s.strategy} over {s.gpus} {g.name}s" if multi else f"one {g.name}"  # the job as asked
        parts = [f"{which} ({format_bytes(g.capacity_bytes)}) holds {how}: {format_bytes(g.device_total_bytes)}"
                 + (" per GPU" if multi else "")]
    if s.sharded is not None:
        parts.append(_sharded_sentence(s.sharded, how, s.global_batch))
    return "; ".join(parts)


def _sharded_sentence(fit: "ShardedFit", how: str, global_batch: int | None) -> str:
    seen, name, limit = dict(fit.traced), fit.strategy, format_bytes(fit.limit_bytes)
    if fit.gpus is None:
        most = max(seen)
        if fit.stopped_after_traces:
            return (f"{name} over {most} GPUs of this size still does not hold {how}: "
                    f"{format_bytes(seen[most])} per GPU (the search stopped after {fit.stopped_after_traces} traces)")
        return (f"{name} would not hold {how} even over {most} GPUs of this size: {format_bytes(seen[most])} per GPU, "
                f"and what does not shard (about {format_bytes(fit.unsharded_bytes)}) already fills the {limit} limit")
    hi = fit.gpus
    text = f"{name} over {hi} GPUs of this size holds {how}: {format_bytes(seen[hi])} per GPU"
    if hi - 1 in seen:
        text += f" ({hi - 1} GPUs: {format_bytes(seen[hi - 1])}, over the {limit} limit)"
    elif not fit.fewer_do_not_fit:
        text += f" (fewer not ruled out: {fit.most_not_fitting} GPUs do not fit, the counts between were not traced)"
    if global_batch is not None and hi > global_batch:
        text += f"; that is more GPUs than the global batch of {global_batch} has samples"
    return text


LAYOUT_ROWS = 8  # rows of the layout search's table


def render_layout_plan(plan: "LayoutPlan") -> str:
    """The table printed by ``memcheck plan --gpus N`` (a layout search)."""
    where = plan.gpu.name if plan.gpu is not None else "the budget"
    lines = _prose(
        f"memcheck plan: {plan.model} on {plan.gpus} x {where} ({plan.gpus_per_node} a node), global batch "
        f"{plan.global_batch}, every sequence padded to {plan.max_len}",
        f"limit: every rank's device total at most {format_bytes(plan.limit_bytes)} = capacity "
        f"{format_bytes(plan.capacity_bytes)} minus a {plan.margin:.0%} margin",
    )
    lines.append("")
    r, job = plan.recommended, plan.job
    if r is not None and job is not None and plan.estimate is not None:
        lines.extend(_prose(
            f"RECOMMENDED: {flag('layout', r.layout)} ({job.strategy_config.label} inside), micro-batch "
            f"{r.micro_batch_size} x {r.microbatches} micro-batches a step, checkpointing {r.checkpointing}, "
            f"{job.precision.value}, {optimizer_name(job.optimizer)}"))
        lines.extend(continued("  memcheck flags:", [
            flag("layout", r.layout), flag("batch_size", r.micro_batch_size), flag("accumulate", r.microbatches),
            flag("checkpointing", r.checkpointing), flag("precision", job.precision.value),
            flag("max_len", plan.max_len)], shell=True))
        lines.append("")
        lines.append(render_devices(plan.estimate.devices))
    else:
        lines.extend(_prose("NOTHING FITS: no layout searched keeps every rank under the limit"))
    lines.append("")
    rows = [[c.layout.replace(",schedule=", ","), f"{c.micro_batch_size} x {c.microbatches}", c.checkpointing,
             f"{c.relative_cost:.3g}", c.status] for c in plan.considered[-LAYOUT_ROWS:]]
    lines.append(tabulate(rows, headers=["layout", "micro x M", "ckpt", "cost", "device total (traced)"],
                          tablefmt="simple"))
    lines.extend(_prose(
        f"the last {min(LAYOUT_ROWS, len(plan.considered))} of {len(plan.considered)} layouts looked at, cheapest "
        f"first, of {plan.candidates} ranked; cost: the proxy of seconds a step (FLOPs, pipeline bubble, tensor- "
        "and context-parallel traffic over estimated link rates); skipped: weights, gradients and optimizer state "
        "alone pass the limit (state), or one-block probe traces predict more than 1.25 x the limit (~; >=: the "
        "tp=1 probes divided by tp x cp); "
        f"{plan.traces} traces, {plan.seconds:.1f} s"))
    for why in plan.refusals:  # every later layout of the same kind was left out too
        lines.extend(_prose(f"not possible: {why}"))
    return "\n".join(lines)
