"""The combination matrix (issue 38, item 3): tiny transformers architectures of every family, times
the job settings that change how a training step holds memory, combined pairwise.

A covering array (``matrix()``): every pair of values of any two factors meets in at least one cell,
so the matrix stays small (about 40 cells where the full product is 19,200). The factors are the
architecture family (its architectures taken in turn, each at least once), checkpointing, its
reentrant variant, the target, the precision, the adapters and the sharded strategy (as memcheck
spells them: ``memcheck.job.Job``). The array is built greedily (the AETG idea: each new cell is
the best of a few seeded candidates, filled one factor at a time by the value that meets the most
pairs not yet met) with a fixed seed, so it is the same on every run and a failure names its cell.

Pairs memcheck refuses on purpose (``REFUSED``) are not dropped: each gets one cell of its own that
asserts the one-line refusal naming the setting, and no valid cell holds them. Cells whose real run
cannot be made here (``UNMEASURABLE``) are kept out of the CPU target only: the pairs they hold are
met by other cells. tests/test_combinations.py checks the array covers every allowed pair, then runs
every cell: a refusal cell must refuse, every other cell must trace, and every CPU cell is compared
with a real CPU run (``run_real``: ``measure_cpu``, or real gloo ranks for the sharded strategies).
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

import torch

# family -> architectures (transformers model types, as tests/hf_coverage.py builds them at tiny size)
FAMILIES: dict[str, tuple[str, ...]] = {
    "decoder": ("gpt2", "llama", "qwen2", "opt"),
    "encoder": ("bert", "roberta"),
    "encoder-decoder": ("t5", "bart"),
    "vision": ("vit",),
    "conv": ("resnet", "convnext"),
    "moe": ("mixtral", "qwen2_moe"),
    "audio": ("wav2vec2", "whisper"),
    "state-space": ("mamba",),
}
ARCHITECTURES = tuple(a for archs in FAMILIES.values() for a in archs)

FACTORS: dict[str, tuple] = {
    "family": tuple(FAMILIES),
    "checkpointing": ("none", "full", "half", "every:2", "selective-op"),
    "reentrant": (False, True),
    "target": ("cpu", "cuda"),
    "precision": ("fp32", "amp-bf16", "bf16"),
    "adapter": ("none", "lora", "qlora", "dora"),
    "strategy": ("single", "ddp", "fsdp", "fsdp1", "zero3"),
}
# the adapters as memcheck's Job takes them: (lora, qlora), LoRA's targets left to ``targets()``
ADAPTERS = {"none": (None, False), "lora": ("r=4", False), "qlora": ("r=4", True), "dora": ("r=4,dora=true", False)}
# Where PEFT refuses all-linear, the targets a user gives instead (each refusal has a cell: EXTRA_REFUSALS):
# Mamba's out_proj (and conv1d) are "incompatible with Mamba-based models" (peft 0.21); DoRA "does not work"
# with the parameter targets (ParamWrapper) all-linear picks in the fused experts of MoE layers.
TARGETS = {("mamba", False): "in_proj,x_proj,dt_proj", ("mamba", True): "in_proj,x_proj,dt_proj",
           **{(moe, True): "q_proj,k_proj,v_proj,o_proj" for moe in ("mixtral", "qwen2_moe")}}


def lora_spec(architecture: str, adapter: str) -> str | None:
    """The ``lora`` setting of ``adapter`` on ``architecture``: all-linear unless ``TARGETS`` says otherwise."""
    lora = ADAPTERS[adapter][0]
    if lora is None:
        return None
    return f"{lora},targets={TARGETS.get((architecture, adapter == 'dora'), 'all-linear')}"
GPUS = 2  # every sharded strategy over two ranks (two gloo processes in a real run)
CUDA_GPU = "H100-80GB"
SEED = 38

# Pairs memcheck refuses by design: ((factor, value), (factor, value)) -> words the one-line refusal holds.
REFUSED: dict[tuple[tuple[str, object], tuple[str, object]], str] = {
    (("checkpointing", "selective-op"), ("reentrant", True)): "selective-op needs use_reentrant=False",
}
# Pairs left out of the array (as if refused, so that the array stays the one KNOWN_OFF names) because a test
# file of their own checks them against real runs: pair -> where.
CHECKED_ELSEWHERE: dict[tuple[tuple[str, object], tuple[str, object]], str] = {
    # refused until issue 34 item 6: QLoRA under fsdp1 is the FSDP-QLoRA recipe, checked on real FSDP1 gloo ranks
    (("adapter", "qlora"), ("strategy", "fsdp1")): "tests/test_sharded_qlora.py",
}
# Refusals outside the factors' values (a combination of two flags the factors hold as one value each).
# name -> (architecture, job settings over the base cell's, the refusal's words)
EXTRA_REFUSALS: dict[str, tuple[str, dict, str]] = {
    "qlora+dora": ("llama", dict(lora="r=4,targets=all-linear,dora=true", qlora=True), "qlora with DoRA"),
    "mamba-all-linear": ("mamba", dict(lora="r=4,targets=all-linear"), "incompatible with Mamba-based models"),
    "moe-dora-all-linear": ("mixtral", dict(lora="r=4,targets=all-linear,dora=true"), "lora dora=true: PEFT says"),
}


def _cpu_sharded_amp(cell: dict) -> bool:
    return cell.get("target") == "cpu" and cell.get("strategy") not in (None, "single") \
        and cell.get("precision") == "amp-bf16"


def _float_inputs_qlora_pure_bf16(cell: dict) -> bool:
    return cell.get("family") in FLOAT_INPUTS and cell.get("adapter") == "qlora" and cell.get("precision") == "bf16"


# The families whose batch is floating point (pixels, audio samples), which pure bf16 casts to bf16.
FLOAT_INPUTS = ("vision", "conv", "audio")
# Pairs whose job fails for real, so no cell holds them: pair -> reason.
INVALID_PAIRS = {
    (("family", "state-space"), ("adapter", "qlora")): (
        "transformers' Mamba multiplies dt_proj.weight itself (modeling_mamba.py, slow_forward: "
        "self.dt_proj.weight @ time_step), which a 4-bit Linear4bit holds packed: a real run stops at that bmm "
        "('Expected size for first two dimensions of batch2 tensor'), the trace at its meta kernel"),
}
# Jobs that fail for real, the same way as in the trace, so no cell holds them: (predicate, reason).
INVALID = (
    (_float_inputs_qlora_pure_bf16, "QLoRA's prepare_model_for_kbit_training casts the weights it does not quantize "
                                    "(convolutions, norms) to fp32, and pure bf16 feeds them bf16 pixels or samples: "
                                    "a real run stops at the first convolution ('Input type (c10::BFloat16) and bias "
                                    "type (float) should be the same'), and so does the trace"),
)

# Combinations kept off the CPU target, where the real run that checks them cannot be made here:
# (predicate on a partial cell, reason). Their pairs are met by cells on the other target.
UNMEASURABLE = (
    (_cpu_sharded_amp, "the real gloo runs (memcheck.measure.distributed) train without autocast"),
)


def refused(cell: dict) -> str | None:
    """The refusal words of a refused pair ``cell`` holds (or the test file of a pair checked elsewhere), or None."""
    for ((f1, v1), (f2, v2)), words in {**REFUSED, **CHECKED_ELSEWHERE}.items():
        if cell.get(f1, object()) == v1 and cell.get(f2, object()) == v2:
            return words
    return None


def _unmeasurable(cell: dict) -> bool:
    return any(rule(cell) for rule, _ in (*UNMEASURABLE, *INVALID)) or bool(pairs_of(cell) & set(INVALID_PAIRS))


def allowed_pairs() -> set[tuple[tuple[str, object], tuple[str, object]]]:
    """Every pair of values of two factors that a valid cell can hold (the refused pairs left out)."""
    out = set()
    for f1, f2 in itertools.combinations(FACTORS, 2):
        for v1 in FACTORS[f1]:
            for v2 in FACTORS[f2]:
                pair = ((f1, v1), (f2, v2))
                if pair not in REFUSED and pair not in CHECKED_ELSEWHERE and pair not in INVALID_PAIRS:
                    out.add(pair)
    return out


def pairs_of(cell: dict) -> set:
    names = [f for f in FACTORS if f in cell]
    return {((f1, cell[f1]), (f2, cell[f2])) for f1, f2 in itertools.combinations(names, 2)}


def _gloo_again(cell: dict, uncovered: set) -> bool:
    """Whether ``cell`` would be a second CPU cell of one sharded strategy: each real gloo run costs
    seconds of spawned ranks, and the pair needs to meet once."""
    strategy = cell.get("strategy")
    return cell.get("target") == "cpu" and strategy not in (None, "single") \
        and (("target", "cpu"), ("strategy", strategy)) not in uncovered


def _cost(cell: dict) -> float:
    """What a complete cell costs to check, for breaking ties: a real gloo run most, then a real CPU run."""
    if cell["target"] == "cuda":
        return 0.0
    return 1.0 if cell["strategy"] == "single" else 10.0


def covering_array(seed: int = SEED, candidates: int = 20) -> list[dict]:
    """The valid cells, greedily (each one of ``candidates`` seeded tries that meets the most pairs
    not yet met, the cheapest on a tie), until every allowed pair is met."""
    rng = random.Random(seed)
    uncovered = allowed_pairs()
    cells: list[dict] = []
    while uncovered:
        best, best_key = None, None
        ordered = sorted(uncovered, key=repr)
        for _ in range(candidates):
            (f1, v1), (f2, v2) = ordered[rng.randrange(len(ordered))]
            cell = {f1: v1, f2: v2}
            rest = [f for f in FACTORS if f not in cell]
            rng.shuffle(rest)
            for factor in rest:
                options = []
                for value in FACTORS[factor]:
                    trial = {**cell, factor: value}
                    if refused(trial) or _unmeasurable(trial) or _gloo_again(trial, uncovered):
                        continue
                    gain = len(pairs_of(trial) & uncovered)
                    options.append((-gain, rng.random(), value))
                options.sort(key=lambda o: o[:2])
                cell[factor] = options[0][2]
            cell = {f: cell[f] for f in FACTORS}
            key = (-len(pairs_of(cell) & uncovered), _cost(cell))
            if best_key is None or key < best_key:
                best, best_key = cell, key
        cells.append(best)
        uncovered -= pairs_of(best)
    return cells


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: an architecture and a job's settings (picklable: sent to gloo ranks)."""

    name: str
    architecture: str  # the transformers model type
    family: str
    checkpointing: str
    reentrant: bool
    target: str
    precision: str
    adapter: str
    strategy: str
    refusal: str | None = None  # the words of the one-line refusal this cell asserts
    extra: str | None = None  # an EXTRA_REFUSALS key

    def job_settings(self) -> dict:
        """The cell as ``memcheck.estimate``'s keywords."""
        lora, qlora = lora_spec(self.architecture, self.adapter), ADAPTERS[self.adapter][1]
        settings = dict(device=self.target, precision=self.precision, checkpointing=self.checkpointing,
                        use_reentrant=self.reentrant, lora=lora, qlora=qlora, strategy=self.strategy,
                        optimizer="adamw")
        if self.target == "cuda":
            settings["gpu"] = CUDA_GPU
        if self.strategy != "single":
            settings["gpus"] = GPUS
        if self.extra:
            settings.update(EXTRA_REFUSALS[self.extra][1])
        return settings

    def label(self) -> str:
        return (f"{self.architecture} ({self.family}), checkpointing {self.checkpointing}"
                f"{' reentrant' if self.reentrant else ''}, {self.target}, {self.precision}, adapter {self.adapter}, "
                f"strategy {self.strategy}")


def _architecture_fits(architecture: str, cell: dict) -> bool:
    """Whether ``architecture`` can hold ``cell``'s settings as a job a user would run.

    ResNet's only linear layer is its classifier, which ``all-linear`` leaves out (PEFT's rule for the
    output layer): LoRA on it has no target, a refusal of the lora setting, so a ResNet takes the cells
    without adapters and ConvNeXt (linear layers in every block) the others."""
    return not (architecture == "resnet" and cell["adapter"] != "none")


@functools.cache
def matrix() -> tuple[Cell, ...]:
    """The covering array as cells, each with its architecture (the family's in turn), then one cell per
    refused pair and per extra refusal."""
    cells, used = [], {a: 0 for a in ARCHITECTURES}
    for i, cell in enumerate(covering_array()):
        fits = [a for a in FAMILIES[cell["family"]] if _architecture_fits(a, cell)]
        arch = min(fits, key=lambda a: used[a])  # the family's least used so far, in the listed order on a tie
        used[arch] += 1
        cells.append(Cell(f"c{i:02d}-{arch}", arch, **cell))
    base = dict(family="decoder", checkpointing="none", reentrant=False, target="cuda", precision="fp32",
                adapter="none", strategy="single")
    for i, (((f1, v1), (f2, v2)), words) in enumerate(REFUSED.items()):
        cell = {**base, f1: v1, f2: v2}
        cells.append(Cell(f"r{i}-llama", "llama", **cell, refusal=words))
    for key, (arch, _, words) in EXTRA_REFUSALS.items():
        family = next(f for f, archs in FAMILIES.items() if arch in archs)
        cells.append(Cell(f"x-{key}", arch, **{**base, "family": family}, refusal=words, extra=key))
    return tuple(cells)


# ---- building the models ---------------------------------------------------------------------------


def _case(architecture: str):
    from hf_coverage import cases

    return next(c for c in cases() if c[0] == architecture)


@functools.cache
def _config(architecture: str):
    from hf_coverage import tiny_config

    model_type, arch, task, _ = _case(architecture)
    return tiny_config(model_type, arch), task


def build_meta(cell: Cell):
    """The tiny model and its batch on the meta device, as a user hands them to ``memcheck.estimate``."""
    from hf_coverage import build

    config, task = _config(cell.architecture)
    with torch.device("meta"):
        return build(config, task, torch.device("meta"))


def quantize_4bit_real(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s linear layers as bitsandbytes NF4 ``Linear4bit`` with double quantization and bf16
    compute, quantized for real on the CPU (``.to("cpu")``), as ``from_pretrained`` with a 4-bit
    ``BitsAndBytesConfig`` leaves them: the modules ``get_keys_to_not_convert`` and ``_keep_in_fp32_modules``
    name stay in full precision (transformers' ``should_convert_module`` matches them), GPT-2's ``Conv1D``
    is converted too."""
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = [*get_keys_to_not_convert(model), *(model._keep_in_fp32_modules or [])]
    for name, module in list(model.named_modules()):
        if not should_convert_module(name, keep) or not (isinstance(module, Conv1D) or type(module) is torch.nn.Linear):
            continue
        weight = module.weight.data.t() if isinstance(module, Conv1D) else module.weight.data
        out_features, in_features = weight.shape
        q = bnb.nn.Linear4bit(in_features, out_features, bias=module.bias is not None, compute_dtype=torch.bfloat16,
                              quant_type="nf4", compress_statistics=True)
        q.weight = bnb.nn.Params4bit(weight.contiguous(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=True)
        if module.bias is not None:
            q.bias = torch.nn.Parameter(module.bias.data, requires_grad=module.bias.requires_grad)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
    return model.to("cpu")


def build_real(cell: Cell):
    """The same model and batch built for real on the CPU and set up as the job says, with the libraries
    a user would call: the cast of pure bf16, bitsandbytes' 4-bit layers and ``prepare_model_for_kbit_training``
    (QLoRA), PEFT's ``get_peft_model``, then the checkpointing. Module-level, so gloo ranks can unpickle it."""
    from hf_coverage import build

    from memcheck.enums import Precision
    from memcheck.training.adapters import Lora
    from memcheck.training.checkpointing import apply_checkpointing
    from memcheck.training.loop import to_precision

    config, task = _config(cell.architecture)
    torch.manual_seed(0)
    model, batch = build(config, task, torch.device("cpu"))
    dtype = Precision.parse(cell.precision).weights_dtype
    if dtype is not None:
        model, batch = model.to(dtype), to_precision(batch, dtype)
    lora, qlora = lora_spec(cell.architecture, cell.adapter), ADAPTERS[cell.adapter][1]
    if lora is not None:
        import peft

        from memcheck.training.adapters import _task_type

        if qlora:
            model = peft.prepare_model_for_kbit_training(quantize_4bit_real(model), use_gradient_checkpointing=False)
        model = peft.get_peft_model(model, Lora.parse(lora).config(_task_type(model)))
    apply_checkpointing(model, cell.checkpointing, use_reentrant=cell.reentrant)
    return model, batch


def adamw(params):
    return torch.optim.AdamW(params)


def sharded_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a sharded wrapper takes as units: the repeated blocks, as memcheck's fsdp and fsdp1 do."""
    from memcheck.training.checkpointing import repeated_blocks

    names = dict(model.named_modules())
    return [names[n] for n in repeated_blocks(model)]


def run_real(cell: Cell) -> tuple[int | None, str]:
    """The real run's steady peak (bytes) of ``cell`` on the CPU, and how it was measured; None and the
    reason where it cannot be run here."""
    import importlib.util

    from memcheck.enums import Precision
    from memcheck.measure import distributed
    from memcheck.measure.local import measure_cpu

    build = functools.partial(build_real, cell)
    if cell.strategy == "single":
        amp = Precision.parse(cell.precision).autocast_dtype
        return measure_cpu(build, adamw, steps=2, autocast_dtype=amp).steady_peak_bytes, "measure_cpu"
    if cell.strategy == "zero3" and importlib.util.find_spec("deepspeed") is None:
        return None, "zero3's real run needs DeepSpeed, which is not in the test extras"
    if cell.strategy == "ddp":
        ranks = distributed.measure_ddp_cpu(build, adamw, world_size=GPUS, steps=2)
    elif cell.strategy == "fsdp":
        ranks = distributed.measure_fsdp_cpu(build, adamw, world_size=GPUS, steps=2, wrap=sharded_units)
    elif cell.strategy == "fsdp1":
        ranks = distributed.measure_fsdp1_cpu(build, adamw, world_size=GPUS, steps=2, wrap=sharded_units)["full_shard"]
    else:
        ranks = distributed.measure_zero3_cpu(build, adamw, world_size=GPUS, steps=2)
    # gloo's staging copies and late frees only add bytes to some ranks (tests/test_sharded.py): the
    # smallest rank peak is the wrapper's own allocation
    return min(r.steady_peak_bytes for r in ranks), f"{cell.strategy} over {GPUS} gloo ranks (smallest rank peak)"
