"""Fine-tuning through adapters: LoRA, DoRA and QLoRA, set up on the meta twin as PEFT does it.

``--lora r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05`` (``all-linear`` for every linear
layer but the output head; without ``targets``, PEFT's default for the architecture), ``--dora``
(LoRA with ``use_dora=True``) and ``--qlora`` (the QLoRA recipe: every linear layer but the
head in 4-bit NF4 with double quantization and bf16 compute, ``bitsandbytes.nn.Linear4bit``
as transformers' ``replace_with_bnb_linear`` puts it, then PEFT's
``prepare_model_for_kbit_training`` and LoRA adapters). The same in configs (``lora``,
``dora``, ``qlora``) and the Python API (``Job(lora="r=16", qlora=True)``).

What is traced is PEFT's own code (``get_peft_model``, ``LoraConfig``), installed beside
memcheck (``pip install 'memcheck[peft]'``):

* the frozen base keeps its dtype (4-bit for QLoRA, with bitsandbytes' statistics);
  ``prepare_model_for_kbit_training`` casts the other floating parameters (norms,
  embeddings, the head) to fp32, as it does (peft/utils/other.py);
* the adapters are fp32 (``autocast_adapter_dtype=True``, PEFT's default), trainable;
  gradients and optimizer state exist for them only;
* ``prepare_model_for_kbit_training`` is called with ``use_gradient_checkpointing=False``:
  its default turns gradient checkpointing on, which here is the job's ``checkpointing``
  setting; a QLoRA job that does not name one takes the recipe's (``qlora_recipe``).

The QLoRA recipe's defaults (``qlora_recipe``, applied by ``memcheck.job.Job`` to a ``qlora``
job that leaves the setting unset; a setting given, ``checkpointing="none"`` or
``precision="fp32"``, wins):

* gradient checkpointing on every repeated block (``full``): PEFT's
  ``prepare_model_for_kbit_training(model, use_gradient_checkpointing=True, ...)``,
  peft 0.21.2 ``peft/utils/other.py:158-159``, which then calls
  ``model.gradient_checkpointing_enable`` (``other.py:257``);
* bf16 compute where the GPU has it (sm80 and later, and an unnamed GPU of a given size,
  taken as sm80): ``amp-bf16``, the compute dtype of the recipe's
  ``BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.bfloat16)`` (PEFT's quantization guide,
  docs/source/developer_guides/quantization.md; the QLoRA paper, Dettmers et al. 2023, sec. 3,
  computes in BFloat16) and ``quantize_4bit`` below; before sm80 the job's default, fp32.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

import torch

from memcheck.errors import UsageError

_KEYS = ("r", "alpha", "dropout", "targets", "dora")

# The QLoRA recipe's defaults for the settings a QLoRA job leaves unset (see the module docstring):
# PEFT's prepare_model_for_kbit_training(use_gradient_checkpointing=True) (peft/utils/other.py:158-159,
# peft 0.21.2) and the recipe's bf16 compute (bnb_4bit_compute_dtype=torch.bfloat16).
QLORA_CHECKPOINTING = "full"
QLORA_PRECISION = "amp-bf16"
BF16_FROM_ARCH = (8, 0)  # Ampere: the first compute capability with bf16 tensor cores


def qlora_recipe(arch: tuple[int, int] | None) -> dict[str, str]:
    """The QLoRA recipe's settings for a GPU of compute capability ``arch`` (None: the CPU
    target, where only the checkpointing applies): ``{"checkpointing": "full",
    "precision": "amp-bf16"}`` on sm80 and later."""
    recipe = {"checkpointing": QLORA_CHECKPOINTING}
    if arch is not None and tuple(arch) >= BF16_FROM_ARCH:
        recipe["precision"] = QLORA_PRECISION
    return recipe


@dataclass(frozen=True)
class Lora:
    """LoRA's settings; None fields take PEFT's ``LoraConfig`` defaults (r 8, alpha 8, dropout 0,
    the architecture's default target modules)."""

    r: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    targets: tuple[str, ...] | str | None = None  # module names, or "all-linear"
    dora: bool = False

    @classmethod
    def parse(cls, value) -> "Lora | None":
        """From ``"r=16,alpha=32,targets=q_proj,v_proj"``, a mapping, True (PEFT's defaults),
        False/None/"none" (no LoRA) or a Lora."""
        if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            return None
        if isinstance(value, Lora):
            return value
        if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "default")):
            return cls()
        if isinstance(value, str):
            value = _pairs(value)
        if not isinstance(value, dict):
            raise UsageError(f"lora must be settings such as 'r=16,alpha=32,targets=q_proj,v_proj', got {value!r}")
        unknown = [k for k in value if k not in _KEYS]
        if unknown:
            raise UsageError(f"lora has no setting {unknown[0]!r}; its settings are {', '.join(_KEYS)}")
        return cls(r=_number(value, "r", int, 1, maximum=MAX_RANK), alpha=_number(value, "alpha", float, 0),
                   dropout=_number(value, "dropout", float, 0, below=1), targets=_targets(value.get("targets")),
                   dora=_flag(value.get("dora", False)))

    def __str__(self) -> str:
        parts = [f"{k}={_text(getattr(self, k))}" for k in ("r", "alpha", "dropout", "targets")
                 if getattr(self, k) is not None]
        return ",".join(parts + (["dora=true"] if self.dora else [])) or "default"

    def config(self, task_type: str | None):
        """PEFT's ``LoraConfig`` for these settings."""
        from peft import LoraConfig

        kwargs = {"r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "use_dora": self.dora,
                  "target_modules": list(self.targets) if isinstance(self.targets, tuple) else self.targets}
        return LoraConfig(task_type=task_type, **{k: v for k, v in kwargs.items() if v is not None})


def _pairs(text: str) -> dict:
    """``"r=16,targets=q_proj,v_proj"`` -> ``{"r": "16", "targets": "q_proj,v_proj"}``: a piece
    without ``=`` continues the setting before it (targets are comma-separated too)."""
    out: dict = {}
    key = None
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece:
            key, _, value = piece.partition("=")
            key = key.strip().lower()
            out[key] = value.strip()
        elif key == "targets":
            out[key] += "," + piece
        else:
            raise UsageError(f"lora setting {piece!r} has no value; write key=value, as in r=16,alpha=32")
    return out


# The largest LoRA rank taken: 2**14, the hidden size of the widest published model (Llama 3.1
# 405B: 16384). A rank above a layer's width adds nothing, and PEFT builds the adapters' weights for
# real on the CPU (lora/layer.py, update_layer's nn.Linear), so a huge rank would allocate host memory.
MAX_RANK = 2**14


def _number(values: dict, key: str, kind, minimum, below=None, maximum=None):
    if key not in values:
        return None
    try:
        number = kind(values[key])
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"lora {key} must be a number, got {values[key]!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise UsageError(f"lora {key} must be a finite number, got {values[key]!r}")
    if isinstance(values[key], bool) or number < minimum or (below is not None and number >= below):
        bound = f"at least {minimum}" + (f" and below {below}" if below is not None else "")
        raise UsageError(f"lora {key} must be {bound}, got {values[key]!r}")
    if maximum is not None and number > maximum:
        raise UsageError(f"lora {key} must be at most {maximum} (a rank above the widest model's hidden size, "
                         f"16384, adds nothing), got {values[key]!r}")
    return number


def _targets(value):
    if value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
        if value.lower() == "all-linear":
            return "all-linear"
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise UsageError(f"lora targets must be module names or all-linear, got {value!r}")
    return tuple(v.strip() for v in value)


def _flag(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise UsageError(f"lora dora must be true or false, got {value!r}")


def _text(value) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@contextlib.contextmanager
def quiet_third_party():
    """PEFT and bitsandbytes as memcheck drives them, without their notices about the machine
    memcheck runs on: bitsandbytes' CPU backend logs "Failed to load CPU gemm_4bit_forward" on
    import where its optional kernels package is missing, and PEFT reads transformers'
    deprecated ``is_gradient_checkpointing`` (a FutureWarning). Neither concerns the estimate."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            yield
    finally:
        log.setLevel(level)


def _peft():
    from memcheck.trace.device_redirect import cuda_stubbed

    try:
        with quiet_third_party(), cuda_stubbed():  # bitsandbytes, which PEFT imports, asks the GPU on import
            import peft
    except ImportError:
        raise UsageError("LoRA, DoRA and QLoRA need PEFT: pip install 'memcheck[peft]'") from None
    return peft


def _task_type(model: torch.nn.Module) -> str | None:
    """PEFT's task type for a transformers model (CAUSAL_LM, SEQ_2_SEQ_LM, ...), None otherwise.

    None for a model whose main input is not token ids (Whisper's ``input_features``): PEFT's
    ``PeftModelForSeq2SeqLM.forward`` hands the base model ``input_ids=`` and its own keywords, which
    such a model passes on to its decoder beside the decoder's ids ("got multiple values for keyword
    argument 'input_ids'"); PEFT's Whisper recipes leave the task type unset."""
    name = type(model).__name__
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return None
    for suffix, task in (("ForCausalLM", "CAUSAL_LM"), ("ForConditionalGeneration", "SEQ_2_SEQ_LM"),
                         ("ForSequenceClassification", "SEQ_CLS"), ("ForTokenClassification", "TOKEN_CLS"),
                         ("ForQuestionAnswering", "QUESTION_ANS")):
        if name.endswith(suffix):
            return task
    return None


def modules_kept_unquantized(model: torch.nn.Module) -> list[str]:
    """The modules ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` leaves
    in full precision: transformers' ``get_keys_to_not_convert`` (tied weights, the last module, the output
    embeddings) and the model's ``_keep_in_fp32_modules`` (T5's ``wo``, whose forward casts its input to the
    weight's dtype: a 4-bit ``wo`` would turn the hidden states into uint8) (transformers 5.23
    quantizers/quantizer_bnb_4bit.py, ``_process_model_before_weight_loading``); for a model that is not a
    transformers one, its output embeddings, else ``lm_head``."""
    keep: list[str] = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    try:
        from transformers.quantizers.base import get_keys_to_not_convert

        keep += get_keys_to_not_convert(model)
    except (ImportError, AttributeError):  # not a PreTrainedModel (no all_tied_weights_keys)
        head = getattr(model, "get_output_embeddings", lambda: None)()
        keep += [name for name, module in model.named_modules() if head is not None and module is head] or ["lm_head"]
    return sorted(set(keep))


def quantize_4bit(model: torch.nn.Module, quant_storage: torch.dtype = torch.uint8) -> torch.nn.Module:
    """Every linear layer but the output head as bitsandbytes' NF4 ``Linear4bit`` with double
    quantization and bf16 compute (the QLoRA recipe's ``BitsAndBytesConfig``), as transformers'
    ``replace_with_bnb_linear`` puts them (on meta: no weight is quantized for real; the twin
    sizes the 4-bit weight and its statistics, ``memcheck.rules.extensions.bitsandbytes``), leaving out
    ``modules_kept_unquantized``. ``quant_storage``: ``bnb_4bit_quant_storage``, the dtype the packed
    weights are stored as (the sharded recipe's is the other weights')."""
    try:
        with quiet_third_party():
            from transformers import BitsAndBytesConfig
            from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    except ImportError:
        raise UsageError("QLoRA needs transformers and bitsandbytes: pip install transformers bitsandbytes") from None
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=quant_storage)
    keep = modules_kept_unquantized(model)
    with torch.device("meta"):
        return replace_with_bnb_linear(model, modules_to_not_convert=keep, quantization_config=config)


def _dtype_text(model: torch.nn.Module) -> str:
    """The packed 4-bit weights' storage dtype, as text ("bfloat16")."""
    from bitsandbytes.nn import Params4bit

    found = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if isinstance(p, Params4bit)}
    return "/".join(sorted(found)) or "bfloat16"


def recipe_note(recipe: dict[str, str]) -> str:
    """The report's line for the settings the QLoRA recipe filled in, and how to turn them off."""
    parts, off = [], []
    if "checkpointing" in recipe:
        parts.append(f"checkpointing {recipe['checkpointing']} (PEFT's prepare_model_for_kbit_training, "
                     "use_gradient_checkpointing=True)")
        off.append("--checkpointing none")
    if "precision" in recipe:
        parts.append(f"{recipe['precision']} (bnb_4bit_compute_dtype=bfloat16; the GPU has bf16)")
        off.append("--precision fp32")
    return f"QLoRA recipe's defaults: {'; '.join(parts)}; {' / '.join(off)} turns them off"


def apply_adapters(model: torch.nn.Module, lora: Lora | None, qlora: bool,
                   recipe: dict[str, str] | None = None, sharded: bool = False) -> tuple[torch.nn.Module, list[str]]:
    """The meta twin with QLoRA's quantization and LoRA's adapters set up as PEFT does; and what
    was assumed, for the report. ``model`` unchanged (and no notes) without either.

    ``sharded`` (QLoRA under fsdp, fsdp1 or zero3): the sharded recipe, as TRL sets it up when the
    4-bit weights are loaded on the CPU or meta for a sharded wrapper (trl 1.16
    ``trl/experimental/utils.py:879-905``, ``is_sharded_qlora``): no ``prepare_model_for_kbit_training``
    (the other weights keep the quantization storage dtype) and ``get_peft_model(...,
    autocast_adapter_dtype=False)`` (the adapters too), so each wrapper sees one dtype."""
    if lora is None and not qlora:
        return model, []
    peft = _peft()
    notes = []
    if isinstance(model, peft.PeftModel):
        raise UsageError(f"the model is already a PEFT model ({type(model).__name__}); drop --lora/--qlora/--dora "
                         "(memcheck traces its adapters as they are)")
    if qlora and sharded:  # the caller has cast the twin to the storage dtype and quantized it
        notes.append("sharded QLoRA (fsdp/fsdp1/zero3): linear layers but the head in 4-bit NF4 stored as "
                     f"{_dtype_text(model)} (bnb_4bit_quant_storage, the FSDP-QLoRA recipe), so the wrapper "
                     "shards the packed weights like the others while their quantization statistics stay whole on "
                     "every rank; no prepare_model_for_kbit_training and adapters in the same dtype "
                     "(TRL's is_sharded_qlora: autocast_adapter_dtype=False)")
        if recipe:
            notes.append(recipe_note(recipe))
    elif qlora:  # the caller has quantized the twin (quantize_4bit) and sized its 4-bit weights
        with quiet_third_party():
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        notes.append("QLoRA: linear layers but the head in 4-bit NF4 (double quantization, bf16 compute), other "
                     "weights cast to fp32 by prepare_model_for_kbit_training, whose own gradient checkpointing "
                     "is the job's checkpointing setting")
        if recipe:
            notes.append(recipe_note(recipe))
    lora = lora or Lora()
    try:
        with quiet_third_party():
            model = peft.get_peft_model(model, lora.config(_task_type(model)),
                                        autocast_adapter_dtype=not (qlora and sharded))
    except ValueError as exc:  # PEFT's own check of the targets (NoMatchingPeftModuleError is one)
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and name})
        first = str(exc).strip().splitlines()[0]
        if lora.dora and "use_dora" in first:  # "lora.ParamWrapper does not work with use_dora=True": MoE experts
            raise UsageError(f"lora dora=true: PEFT says {first} (DoRA applies to linear layers only, not to a "
                             f"parameter such as {type(model).__name__}'s fused experts); drop dora=true or give "
                             "targets= linear layers only") from None
        raise UsageError(f"lora targets: PEFT says {first}; give targets= module names of {type(model).__name__} "
                         f"(its linear layers: {', '.join(linear[:8]) or 'none'}) or all-linear") from None
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in trainable})) or "no"
    notes.append(f"{'DoRA' if lora.dora else 'LoRA'} {lora} through PEFT {peft.__version__}: "
                 f"{sum(p.numel() for p in trainable):,} trainable parameters ({dtypes} adapters), the base frozen")
    return model, notes
