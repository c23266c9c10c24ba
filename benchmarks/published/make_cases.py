"""Writes cases.json (kept so the file can be regenerated and reviewed; run once, by hand)."""
import json
from pathlib import Path

MiB = 1024 ** 2

HF_DOC = {
    "url": "https://github.com/huggingface/transformers/blob/0016acf7ef421c7fe8eff7945de52c71896c3b01/docs/source/en/perf_train_gpu_one.mdx",
    "repo": "huggingface/transformers",
    "path": "docs/source/en/perf_train_gpu_one.mdx",
    "commit": "0016acf7ef421c7fe8eff7945de52c71896c3b01",
}
BERT_LARGE = {
    "config_class": "BertConfig",
    "kwargs": {"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
               "intermediate_size": 4096, "max_position_embeddings": 512, "type_vocab_size": 2},
    "note": "bert-large-uncased's published hyper-parameters; AutoModelForSequenceClassification adds a 2-label head",
    "task": "classification", "num_labels": 2, "attn_implementation": "eager",
    "inputs": ["input_ids", "labels"],
}
HF_DOC_STACK = (
    "transformers ~4.16 (Jan 2022) Trainer; torch version not given (the nvidia-smi shows driver 460.91.03, CUDA 11.2); "
    "its CUDA context measured 1343 MiB with torch.ones((1, 1)).to('cuda') (eager module loading, before CUDA lazy loading) "
    "against memcheck's 480 MiB V100 estimate; BERT then had eager attention only (traced with attn_implementation='eager'); "
    "the default optimizer was transformers.AdamW (adamw_hf, a per-parameter loop: traced as torch AdamW foreach=False); "
    "gradient checkpointing was the reentrant torch.utils.checkpoint; figure read after trainer.train() returned, "
    "so it is the context plus whatever the caching allocator still held"
)
HF_CONV = "nvmlDeviceGetMemoryInfo(handle).used // 1024**2, printed as 'MB' (MiB, floored): value_bytes = N * 1048576"


def hf_doc(case_id, quote, mib, batch_size, accumulate=1, checkpointing="none", precision="fp32",
           optimizer="adamw", optimizer_kwargs=None, extra_notes=""):
    return {
        "id": case_id,
        "source": {**HF_DOC, "quote": quote},
        "model": BERT_LARGE,
        "batch_size": batch_size, "max_len": 512, "accumulate": accumulate,
        "precision": precision, "optimizer": optimizer,
        "optimizer_kwargs": optimizer_kwargs if optimizer_kwargs is not None else
        ({"foreach": False} if optimizer == "adamw" else {}),
        "checkpointing": checkpointing, "use_reentrant": True,
        "strategy": "single", "gpus": 1,
        "gpu": "V100-16GB", "gpu_published": "Tesla V100-SXM2 16GB (16160MiB in nvidia-smi)",
        "torch_version": "unknown (early 2022; CUDA 11.2 driver)",
        "metric": "nvidia-smi", "value_bytes": mib * MiB, "unit_conversion": HF_CONV,
        "stack_notes": HF_DOC_STACK + extra_notes,
    }


cases = [
    hf_doc("hf-doc-bert-large-bs4-fp32", "Vanilla Training ... per_device_train_batch_size=4 ... GPU memory occupied: 14949 MB.", 14949, 4),
    hf_doc("hf-doc-bert-large-bs1-ga4", "per_device_train_batch_size=1, gradient_accumulation_steps=4 ... GPU memory occupied: 8681 MB.", 8681, 1, accumulate=4),
    hf_doc("hf-doc-bert-large-bs1-ga4-gc", "per_device_train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True ... GPU memory occupied: 6775 MB.", 6775, 1, accumulate=4, checkpointing="full"),
    hf_doc("hf-doc-bert-large-bs4-fp16", "per_device_train_batch_size=4, fp16=True ... GPU memory occupied: 13939 MB.", 13939, 4, precision="amp-fp16"),
    hf_doc("hf-doc-bert-large-bs1-ga4-gc-fp16", "per_device_train_batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True, fp16=True ... GPU memory occupied: 7275 MB.", 7275, 1, accumulate=4, checkpointing="full", precision="amp-fp16"),
    hf_doc("hf-doc-bert-large-bs4-adafactor", "per_device_train_batch_size=4, optim=\"adafactor\" ... GPU memory occupied: 12295 MB.", 12295, 4, optimizer="adafactor",
           extra_notes="; Trainer's optim='adafactor' (scale_parameter=False, relative_step=False)"),
    hf_doc("hf-doc-bert-large-bs1-ga4-gc-fp16-adafactor", "gradient_accumulation_steps=4, gradient_checkpointing=True, fp16=True, optim=\"adafactor\" ... GPU memory occupied: 4847 MB.", 4847, 1, accumulate=4, checkpointing="full", precision="amp-fp16", optimizer="adafactor",
           extra_notes="; Trainer's optim='adafactor' (scale_parameter=False, relative_step=False)"),
    hf_doc("hf-doc-bert-large-bs4-adam8bit", "bnb.optim.Adam8bit(...) ... per_device_train_batch_size=4 ... GPU memory occupied: 13085 MB.", 13085, 4, optimizer="adamw-8bit",
           extra_notes="; bitsandbytes Adam8bit of early 2022 (two parameter groups, embedding layer left unchanged), traced with memcheck's adamw-8bit state layout"),
    hf_doc("hf-doc-bert-large-bs1-ga4-gc-fp16-adam8bit", "gradient_accumulation_steps=4, gradient_checkpointing=True, fp16=True ... optimizers=(adam_bnb_optim, None) ... GPU memory occupied: 5363 MB.", 5363, 1, accumulate=4, checkpointing="full", precision="amp-fp16", optimizer="adamw-8bit",
           extra_notes="; bitsandbytes Adam8bit of early 2022, traced with memcheck's adamw-8bit state layout; the doc reuses the optimizer built for the previous run"),
]

# --- XLM-RoBERTa base on SQuAD, HF Trainer memory metrics (exact bytes) ----------------------
xlmr_init, xlmr_alloc, xlmr_peaked = 1109893120, 3330195456, 8287144960
cases.append({
    "id": "card-xlmr-base-squad-bs16-384",
    "source": {
        "note": "a Hugging Face model card (README.md) stored in the search index (file id 12297098718); repository not shown by the index",
        "quote": "XLM-RoBERTa base (`xlm-roberta-base`) finetuned on squad v1.1. ... max_seq_length: 384 - batch_size: 16 ... "
                 "\"init_mem_gpu_alloc_delta\": 1109893120, ... \"train_mem_gpu_alloc_delta\": 3330195456, "
                 "\"train_mem_gpu_peaked_delta\": 8287144960",
    },
    "model": {
        "config_class": "XLMRobertaConfig",
        "kwargs": {"vocab_size": 250002, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "intermediate_size": 3072, "max_position_embeddings": 514, "type_vocab_size": 1,
                   "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        "note": "xlm-roberta-base's published hyper-parameters",
        "task": "question-answering", "attn_implementation": "eager",
        "inputs": ["input_ids", "attention_mask", "start_positions", "end_positions"],
    },
    "batch_size": 16, "max_len": 384, "accumulate": 1,
    "precision": "fp32", "optimizer": "adamw", "optimizer_kwargs": {"foreach": False},
    "checkpointing": "none", "use_reentrant": True, "strategy": "single", "gpus": 1,
    "gpu": "V100-16GB", "gpu_published": "unknown",
    "torch_version": "unknown (the Trainer memory metrics date it to transformers >= 4.3, early 2021)",
    "metric": "max_memory_allocated",
    "value_bytes": xlmr_init + xlmr_alloc + xlmr_peaked,
    "unit_conversion": "bytes as printed. TrainerMemoryTracker: peaked_delta = max_memory_allocated - allocated at the stage's end, "
                       "alloc_delta = end - start; the train stage starts where init ended (model moved to the GPU), so "
                       "max_memory_allocated = init_alloc_delta + train_alloc_delta + train_peaked_delta = "
                       f"{xlmr_init} + {xlmr_alloc} + {xlmr_peaked}",
    "stack_notes": "precision not stated on the card (no fp16 listed; fp32 assumed); GPU and torch version unknown; "
                   "number of GPUs unknown (the metrics are GPU 0's); transformers of early 2021: eager attention, "
                   "transformers.AdamW (per-parameter loop, traced as torch AdamW foreach=False); run_qa.py pads to "
                   "max_seq_length by default, so every batch is 16 x 384",
})

# --- Giles Thomas: Qwen1.5-0.5B, HF Trainer + DeepSpeed ZeRO-3 fp16 on one GPU ----------------
GPJT_COMMIT = "179f7ac9ba77343268d53e58eadb432edf12616b"
QWEN05 = {
    "config_class": "Qwen2Config",
    "kwargs": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
               "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
               "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "note": "Qwen/Qwen1.5-0.5B's published hyper-parameters (Qwen2 architecture in transformers)",
    "task": "causal-lm", "attn_implementation": "sdpa",
    "inputs": ["input_ids", "attention_mask", "labels"],
}
GPJT_STACK = ("unsupported: deepspeed. HF Trainer (transformers 4.40.0) with DeepSpeed ZeRO stage 3, DeepSpeed's fp16 engine "
              "(fp16 weights, fp32 master weights and AdamW state in DeepSpeed's flat partitions, DeepSpeed's own buckets) "
              "on a single GPU; memcheck's zero3 needs 2 GPUs or more, so it is traced as plain single-GPU amp-fp16 training "
              "(fp32 weights and grads + fp32 AdamW state: the same 16 bytes per parameter as DeepSpeed's fp16 + fp32 "
              "master + fp32 state + fp16 grads, but not the same layout, buckets or transients). "
              "torch version not pinned in the repository; metric is torch.cuda.memory_stats()['active_bytes.all.peak'] "
              "(equal to max_memory_allocated's allocated_bytes.all.peak except for blocks freed but still in use by "
              "another stream) after 30 steps, in a fresh process per run; padding='max_length' so every batch is full")


def gpjt(case_id, path, commit, row, seq, bs, metric, mib, script):
    return {
        "id": case_id,
        "source": {
            "url": f"https://github.com/gpjt/fine-tune-2024-04/blob/{commit}/{path}",
            "repo": "gpjt/fine-tune-2024-04", "path": path, "commit": commit,
            "quote": f"CSV row '{row}' (columns: {'sequence length' if 'sequence' in path else 'batch size'}, "
                     "active_bytes.all.peak MiB, reserved_bytes.all.peak MiB, iterations/s) written by " + script,
            "blog": "https://www.gilesthomas.com/2024/07/fine-tuning-6",
        },
        "model": QWEN05,
        "batch_size": bs, "max_len": seq, "accumulate": 1,
        "precision": "amp-fp16", "optimizer": "adamw", "optimizer_kwargs": {},
        "checkpointing": "none", "use_reentrant": False, "strategy": "single", "gpus": 1,
        "gpu": "RTX-3090", "gpu_published": "the author's local 24 GiB GPU (RTX 3090 per the blog series)",
        "torch_version": "unknown (transformers 4.40.0, April 2024)",
        "metric": metric, "value_bytes": mib * MiB,
        "unit_conversion": "int(bytes / (1024 * 1024)) written as MiB (floored): value_bytes = N * 1048576",
        "stack_notes": GPJT_STACK,
    }


SEQ_PATH = "sequence-length-memory-modeling/results-without-env-var.csv"
SEQ_SCRIPT = "sequence-length-memory-modeling/measure_memory_usage_for_sequence_length.py (batch size 1)"
for seq, row, act, res in [
    (1, "1, 10900, 14024, 7.20335803073923", 10900, 14024),
    (256, "256, 10900, 14198, 8.706725322890543", 10900, 14198),
    (1024, "1024, 11162, 15872, 7.429284931388875", 11162, 15872),
    (2048, "2048, 14105, 18080, 4.4314861547863424", 14105, 18080),
]:
    cases.append(gpjt(f"gpjt-qwen1.5-0.5b-zero3-bs1-{seq}-alloc", SEQ_PATH, GPJT_COMMIT, row, seq, 1, "max_memory_allocated", act, SEQ_SCRIPT))
    cases.append(gpjt(f"gpjt-qwen1.5-0.5b-zero3-bs1-{seq}-reserved", SEQ_PATH, GPJT_COMMIT, row, seq, 1, "max_memory_reserved", res, SEQ_SCRIPT))

BS_PATH = "batch-size-memory-modeling-0.5B/results-no-optimizer-offload.csv"
BS_COMMIT = "197fd9598ecfe6190ced9f017857023832432853"
BS_SCRIPT = "batch-size-memory-modeling-0.5B/measure_memory_usage_for_batch_size.py (sequence length 2048)"
row = "2, 20228, 21662, 2.368081557058567"
cases.append(gpjt("gpjt-qwen1.5-0.5b-zero3-bs2-2048-alloc", BS_PATH, BS_COMMIT, row, 2048, 2, "max_memory_allocated", 20228, BS_SCRIPT))
cases.append(gpjt("gpjt-qwen1.5-0.5b-zero3-bs2-2048-reserved", BS_PATH, BS_COMMIT, row, 2048, 2, "max_memory_reserved", 21662, BS_SCRIPT))


# --- IBM fms-acceleration benchmark references: HF Trainer full fine-tuning on one A100-80GB ------
# scripts/benchmarks/benchmark.py runs `python -m tuning.sft_trainer` (fms-hf-tuning) for one GPU (accelerate/FSDP
# only for num_gpus > 1), with scenarios.yaml's `full-finetuning` arguments (torch_dtype bfloat16, no bf16/fp16
# flag: pure bf16 weights, grads and AdamW state, no autocast), defaults.yaml (use_flash_attn True,
# gradient_checkpointing True, weight_decay 0.01, adam_epsilon 1e-4, max_steps 100, gradient_accumulation_steps 1)
# and benchmark.py's matrices (packing True, max_seq_len 4096, effective batch 4 or 8 -> per_device_train_batch_size).
FMS_REPO = "foundation-model-stack/fms-acceleration"
FMS_MAIN_COMMIT = "24bdadb228e2d55bc0c69deec034b86a73da6917"   # refs/a100_80gb.csv + refs/requirements.txt (2025-02-07)
FMS_GRANITE_COMMIT = "fc78b55b65446fbade0306ac2e619a6182bfea47"  # refs/a100_80gb_granite.csv (2024-10-18)
FMS_HEADER = ("bf16,epoch,fp16,framework_config,learning_rate,lora_alpha,lora_dropout,mem_nvidia_mem_reserved,"
              "mem_peak_torch_mem_alloc_in_bytes,mem_torch_mem_alloc_in_bytes,model_name_or_path,num_gpus,peft_method,"
              "per_device_train_batch_size,r,target_modules,torch_dtype,train_loss,train_runtime,"
              "train_samples_per_second,train_steps_per_second,train_tokens_per_second")
FMS_METRICS = {
    "max_memory_allocated": (
        "mem_peak_torch_mem_alloc_in_bytes, bytes as printed. benchmark.py extract_gpu_memory_metrics: "
        "before_init_mem_gpu + init_mem_gpu_alloc_delta + train_mem_gpu_alloc_delta + train_mem_gpu_peaked_delta of "
        "the HF Trainer's memory tracker (skip_memory_metrics=False), i.e. torch.cuda.max_memory_allocated() over "
        "trainer.train() (the tracker resets the peak at the stage's start)"),
    "nvidia-smi": (
        "mem_nvidia_mem_reserved in MiB (nvidia-smi --query-gpu memory.used --format csv --loop 1, "
        "get_peak_mem_usage_by_device_id: the peak reading minus the first reading, which is taken before the "
        "training subprocess initialises CUDA): value_bytes = N * 1048576"),
}
FMS_COMMON_NOTES = (
    "fms-hf-tuning's sft_trainer.py on one GPU (no accelerate/FSDP), HF Trainer, torch_dtype=bfloat16 without "
    "--bf16 (pure bf16 weights, grads and optimizer state); optim adamw_torch = torch.optim.AdamW(eps=1e-4, "
    "weight_decay=0.01), foreach by torch's CUDA default; the Trainer's two parameter groups (no weight decay "
    "for biases and norm weights) are traced as one group; max_grad_norm 1.0 (Trainer default); "
    "gradient_checkpointing=True with the Trainer's default use_reentrant=True; packing=True (trl "
    "ConstantLengthDataset: every sample is max_seq_length tokens, confirmed by train_tokens_per_second x "
    "train_runtime = 100 steps x batch x length) through DataCollatorForLanguageModeling (input_ids, an "
    "all-ones attention_mask, labels); the flash-attention paths of transformers 4.45/4.48 drop an attention_mask "
    "without zeros (Mistral/Granite _update_causal_mask returns None, GPTBigCodeModel keeps it only when "
    "`0 in attention_mask`), so the batch is traced without it (no mask is built); use_flash_attn=True (flash_attention_2, flash-attn 2.7.3) is traced "
    "with attn_implementation='sdpa', which on the CUDA target takes SDPA's flash kernel (same outputs and "
    "logsumexp, not the flash-attn package's buffers); the loss is the published transformers version's code, "
    "reproduced by run.py's `loss` (the installed transformers computes it differently). ")


def fms(case_id, *, commit, path, row, model, batch_size, max_len, metric, value, loss, stack, model_note):
    quote = f"CSV header '{FMS_HEADER}'; row '{row}'"
    return {
        "id": case_id,
        "source": {
            "url": f"https://github.com/{FMS_REPO}/blob/{commit}/{path}",
            "repo": FMS_REPO, "path": path, "commit": commit, "quote": quote,
            "settings": f"https://github.com/{FMS_REPO}/blob/{commit}/scripts/benchmarks/ (benchmark.py, "
                        "scenarios*.yaml 'full-finetuning', defaults.yaml, ../run_benchmarks.sh)",
        },
        "model": {**model, "note": model_note, "loss": loss},
        "batch_size": batch_size, "max_len": max_len, "accumulate": 1,
        "precision": "bf16", "optimizer": "adamw",
        "optimizer_kwargs": {"eps": 1e-4, "weight_decay": 0.01, "foreach": True},
        "max_grad_norm": 1.0,
        "checkpointing": "full", "use_reentrant": True, "strategy": "single", "gpus": 1,
        "gpu": "A100-80GB", "gpu_published": "A100 80GB (refs file name a100_80gb; one GPU, num_gpus=1)",
        "torch_version": "2.4.1",
        "metric": metric, "value_bytes": value if metric == "max_memory_allocated" else value * MiB,
        "unit_conversion": FMS_METRICS[metric],
        "stack_notes": FMS_COMMON_NOTES + stack,
    }


SANTACODER = {
    "config_class": "GPTBigCodeConfig",
    "kwargs": {"vocab_size": 49280, "n_positions": 2048, "n_embd": 2048, "n_layer": 24, "n_head": 16,
               "n_inner": 8192, "activation_function": "gelu_pytorch_tanh", "multi_query": True,
               "layer_norm_epsilon": 1e-5, "attention_softmax_in_fp32": True,
               "scale_attention_softmax_in_fp32": True, "scale_attn_weights": True,
               "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1,
               "bos_token_id": 49152, "eos_token_id": 49152},
    "task": "causal-lm", "attn_implementation": "sdpa",
    "inputs": ["input_ids", "labels"],
}
SANTA_NOTE = ("bigcode/gpt_bigcode-santacoder's config.json (transformers_version 4.28.0.dev0), as quoted "
              "field-for-field in another project's test file (search index file id 58528290474: "
              "n_embd 2048, n_head 16, n_inner 8192, n_layer 24, n_positions 2048, multi_query, "
              "gelu_pytorch_tanh, dropouts 0.1, bos/eos 49152, vocab_size 49280); tied embeddings")
MISTRAL7B = {
    "config_class": "MistralConfig",
    "kwargs": {"vocab_size": 32001, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": None, "tie_word_embeddings": False},
    "task": "causal-lm", "attn_implementation": "sdpa",
    "inputs": ["input_ids", "labels"],
}
MISTRAL_NOTE = ("mistralai/Mistral-7B-v0.1's published hyper-parameters (Mistral 7B paper / model card); "
                "vocabulary 32000 + 1: fms-hf-tuning adds '<pad>' to a LlamaTokenizerFast and resizes the "
                "embeddings to len(tokenizer) (tokenizer_and_embedding_resize, multiple_of=1). The published "
                "sliding_window 4096 is left out: at 4096 tokens it masks nothing, and transformers 4.48.1's "
                "flash-attention path applies it only when the length exceeds it")
POWERLM3B = {
    "config_class": "GraniteConfig",
    "kwargs": {"vocab_size": 49152, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 40,
               "num_attention_heads": 36, "num_key_value_heads": 36, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
               "residual_multiplier": 0.22, "logits_scaling": 8.0, "attention_multiplier": 0.015625},
    "task": "causal-lm", "attn_implementation": "sdpa",
    "inputs": ["input_ids", "labels"],
}
POWERLM_NOTE = ("ibm/PowerLM-3b's hyper-parameters from the Power Scheduler paper (arXiv 2408.13359, Table 4: "
                "embedding 2304, 40 layers, 36 heads of 64, 36 KV heads, MLP 9216 swiglu, sequence 4096, "
                "mwidth 8, memb 12, mresidual 0.22). Vocabulary (49152, the StarCoder tokenizer) and tied "
                "embeddings are not in the paper: tied is implied by the published mem_torch_mem_alloc_in_bytes "
                "(6 bytes x 3.51e9 parameters; untied would be 3.62e9); the multipliers' values do not change "
                "memory")

MAIN_PATH = "scripts/benchmarks/refs/a100_80gb.csv"
MAIN_STACK = ("torch 2.4.1, transformers 4.48.1, trl 0.13.0, accelerate 1.0.1, fms-hf-tuning 2.5.0, flash-attn 2.7.3 "
              "(refs/requirements.txt at the same commit). ")
GRANITE_PATH = "scripts/benchmarks/refs/a100_80gb_granite.csv"
GRANITE_STACK = ("torch 2.4.1, transformers 4.45.2, accelerate 0.34.2, fms-hf-tuning @ b33634c8, trl @ 9b80f3d5 "
                 "(refs/requirements_granite.txt at the same commit); scenarios-granite.yaml 'full-finetuning'. ")
for key, model, note, loss, path, commit, stack, rows in [
    ("santacoder", SANTACODER, SANTA_NOTE, "shift-ce", MAIN_PATH, FMS_MAIN_COMMIT,
     MAIN_STACK + "max_seq_length = min(4096, tokenizer.model_max_length) = 2048 (train_tokens_per_second x "
     "train_runtime = 100 x batch x 2048). transformers 4.48.1's GPTBigCodeForCausalLM computes "
     "CrossEntropyLoss on the bf16 logits' shifted contiguous copy (no fp32 upcast): loss 'shift-ce'. "
     "fms-hf-tuning adds a '<PAD>' token and resizes the embeddings to len(tokenizer) (not published; at most "
     "49281 rows, against the config's 49280); flash-attn takes MQA's single KV head as is, SDPA in the "
     "installed transformers may expand it",
     [(4, 2048, ",0.07,,none,2.00E-05,,,15116,11267745280,6770300416,bigcode/gpt_bigcode-santacoder,1,,4,,,bfloat16,2.33703125,47.6604,8.393,2.098,17188.262", 11267745280, 15116),
      (8, 2048, ",0.14,,none,2.00E-05,,,18102,15193274880,6769448448,bigcode/gpt_bigcode-santacoder,1,,8,,,bfloat16,2.30890625,88.991,8.99,1.124,18410.851", 15193274880, 18102)]),
    ("mistral-7b", MISTRAL7B, MISTRAL_NOTE, "float-shift-ce", MAIN_PATH, FMS_MAIN_COMMIT,
     MAIN_STACK + "transformers 4.48.1's MistralForCausalLM: bf16 logits, then ForCausalLMLoss (logits.float(), "
     "shifted contiguous copy, cross entropy): loss 'float-shift-ce'. nvidia-smi read within 4.6 GiB of the "
     "card's 80 GiB, so the caching allocator may have freed cached blocks and retried (not recorded)",
     [(4, 4096, ",0.15,,none,2.00E-05,,,77256,72434837504,43467876352,mistralai/Mistral-7B-v0.1,1,,4,,,bfloat16,0.840260801,534.9538,0.748,0.187,3062.694", 72434837504, 77256),
      (8, 4096, ",0.29,,none,2.00E-05,,,72988,72435230720,43468269568,mistralai/Mistral-7B-v0.1,1,,8,,,bfloat16,0.833927689,1042.5316,0.767,0.096,3143.118", 72435230720, 72988)]),
    ("powerlm-3b", POWERLM3B, POWERLM_NOTE, "float-shift-ce", GRANITE_PATH, FMS_GRANITE_COMMIT,
     GRANITE_STACK + "transformers 4.45.2's GraniteForCausalLM: logits / logits_scaling, logits.float(), shifted "
     "contiguous copy, CrossEntropyLoss: loss 'float-shift-ce' after the installed model's own division",
     [(4, 4096, ",0.14,,none,2e-05,,,47683.0,35134836736,21089537536,ibm/PowerLM-3b,1,,4,,,bfloat16,0.9708438396453858,321.2872,1.245,0.311,5099.488", 35134836736, 47683),
      (8, 4096, ",0.29,,none,2e-05,,,52927.0,47059390976,21089930752,ibm/PowerLM-3b,1,,8,,,bfloat16,0.9677363204956054,627.2531,1.275,0.159,5224.047", 47059390976, 52927)]),
]:
    for bs, seq, row, alloc, smi in rows:
        for metric, value, tag in (("max_memory_allocated", alloc, "alloc"), ("nvidia-smi", smi, "smi")):
            cases.append(fms(f"fms-{key}-full-bs{bs}-{seq}-{tag}", commit=commit, path=path, row=row, model=model,
                             batch_size=bs, max_len=seq, metric=metric, value=value, loss=loss, stack=stack,
                             model_note=note))

# fms-acceleration's `standard-peft` scenario without a framework config (plain peft LoRA): the same runs
# with learning_rate 2e-4, peft_method lora, r 16, lora_alpha 16, lora_dropout 0.1, target_modules
# q_proj k_proj v_proj o_proj, torch_dtype bfloat16 (no --bf16).
LORA = {"method": "lora", "r": 16, "lora_alpha": 16, "lora_dropout": 0.1,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "task_type": "CAUSAL_LM",
        "input_require_grads": True}
LORA_NOTES = ("LoRA through trl's SFTTrainer (peft 0.13.2 at the published commit; the installed peft traces): "
              "model.enable_input_require_grads() (gradient checkpointing with use_reentrant=True), then "
              "get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.1, target_modules=q/k/v/o)) "
              "with peft's default autocast_adapter_dtype=True: frozen bf16 base weights, float32 adapter weights, "
              "gradients and AdamW state (consistent with the published mem_torch_mem_alloc_in_bytes: bf16 weights "
              "plus 12 bytes per adapter parameter); the model is built in bfloat16 (`dtype`) so the adapters "
              "keep float32. ")
for key, model, note, loss, path, commit, stack, rows in [
    ("mistral-7b", MISTRAL7B, MISTRAL_NOTE, "float-shift-ce", MAIN_PATH, FMS_MAIN_COMMIT,
     MAIN_STACK + "transformers 4.48.1's MistralForCausalLM: bf16 logits, then ForCausalLMLoss (logits.float(), "
     "shifted contiguous copy, cross entropy): loss 'float-shift-ce'",
     [(4, 4096, ",0.15,,none,2.00E-04,16,0.1,29576,26704571904,14664493056,mistralai/Mistral-7B-v0.1,1,lora,4,16,q_proj k_proj v_proj o_proj,bfloat16,0.862205324,492.8771,0.812,0.203,3324.155", 26704571904, 29576),
      (8, 4096, ",0.29,,none,2.00E-04,16,0.1,43232,38742912512,14664886272,mistralai/Mistral-7B-v0.1,1,lora,8,16,q_proj k_proj v_proj o_proj,bfloat16,0.858190823,977.0384,0.819,0.102,3353.809", 38742912512, 43232)]),
    ("powerlm-3b", POWERLM3B, POWERLM_NOTE, "float-shift-ce", GRANITE_PATH, FMS_GRANITE_COMMIT,
     GRANITE_STACK.replace("'full-finetuning'", "'standard-peft'") + "peft 0.12.0 at that commit. transformers "
     "4.45.2's GraniteForCausalLM: logits / logits_scaling, logits.float(), shifted contiguous copy, "
     "CrossEntropyLoss: loss 'float-shift-ce' after the installed model's own division",
     [(4, 4096, ",0.14,,none,0.0002,16.0,0.1,24591.0,20169870848,7183026688,ibm/PowerLM-3b,1,lora,4,16.0,q_proj k_proj v_proj o_proj,bfloat16,1.0160441780090332,325.5188,1.229,0.307,5033.196", 20169870848, 24591),
      (8, 4096, ",0.29,,none,0.0002,16.0,0.1,41237.0,33152880128,7183419904,ibm/PowerLM-3b,1,lora,8,16.0,q_proj k_proj v_proj o_proj,bfloat16,1.015061044692993,641.7595,1.247,0.156,5105.963", 33152880128, 41237)]),
]:
    for bs, seq, row, alloc, smi in rows:
        for metric, value, tag in (("max_memory_allocated", alloc, "alloc"), ("nvidia-smi", smi, "smi")):
            case = fms(f"fms-{key}-lora-bs{bs}-{seq}-{tag}", commit=commit, path=path, row=row,
                       model={**model, "dtype": "bfloat16", "peft": LORA},
                       batch_size=bs, max_len=seq, metric=metric, value=value, loss=loss,
                       stack=LORA_NOTES + stack, model_note=note)
            case["source"]["settings"] = case["source"]["settings"].replace("'full-finetuning'", "'standard-peft'")
            cases.append(case)

# --- ackaudit (siddddd17/ackaudit): eager forward + backward of a 32-layer Llama on a GTX 1650 ----------------
ACK_COMMIT = "7dfeca000ed898fd24a42aff66c93b4475825d53"
ACK_PATH = "results/measured_backward/endpoints/llama_scale8_eager.json"
cases.append({
    "id": "ackaudit-llama-scale8-eager-fwd-bwd",
    "source": {
        "url": f"https://github.com/siddddd17/ackaudit/blob/{ACK_COMMIT}/{ACK_PATH}",
        "repo": "siddddd17/ackaudit", "path": ACK_PATH, "commit": ACK_COMMIT,
        "quote": "\"model\": \"llama\", \"budget\": 0.0, \"scale\": 8, \"torch_version\": \"2.14.0+cu130\", "
                 "\"device_name\": \"NVIDIA GeForce GTX 1650\", \"eager\": true, ... \"resident_before\": 221613056, "
                 "\"measured_peaks\": [1642860544, 1642860544, 1642860544, 1642860544, 1642860544]",
        "code": "experiments/measured_backward/run_d.py @ 29d506f8 (measure(..., eager=True): model(*args).backward() "
                "once, model.zero_grad(set_to_none=False), then per repetition torch.cuda.reset_peak_memory_stats(); "
                "model(*args).backward(); torch.cuda.max_memory_allocated(); model.zero_grad(set_to_none=False)); "
                "ackaudit/hf_models.py @ 92275d5e (LlamaWrap, hf_models(scale): layers 4*scale, sequence 128*scale, "
                "batch 2); results/measured_backward/README.md @ fbc533f7",
    },
    "model": {
        "config_class": "LlamaConfig",
        "kwargs": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 32, "num_attention_heads": 8,
                   "num_key_value_heads": 8, "vocab_size": 1000, "use_cache": False},
        "note": "LlamaWrap(layers=32): LlamaModel(LlamaConfig(hidden_size=256, intermediate_size=int(256 * 2.6875), "
                "num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=8, vocab_size=1000, "
                "use_cache=False)), forward returns model(input_ids=ids).last_hidden_state.sum(); the other "
                "settings are LlamaConfig's defaults",
        "task": "base-model", "loss": "sum-last-hidden", "attn_implementation": None,
        "inputs": ["input_ids"],
    },
    "protocol": "forward-backward",
    "batch_size": 2, "max_len": 1024, "accumulate": 1,
    "precision": "fp32", "optimizer": "sgd",
    "checkpointing": "none", "use_reentrant": False, "strategy": "single", "gpus": 1,
    "gpu": "T4", "gpu_published": "NVIDIA GeForce GTX 1650 (4 GB, sm75); traced as the T4, memcheck's sm75 card",
    "torch_version": "2.14.0+cu130",
    "metric": "max_memory_allocated", "value_bytes": 1642860544,
    "unit_conversion": "bytes as written (the median of five identical readings, all 1642860544)",
    "stack_notes": "forward + backward only, no optimizer (protocol forward-backward; memcheck's sgd is built "
                   "but never stepped); torch 2.14.0 against the installed 2.13; transformers version not pinned "
                   "(pyproject: transformers unpinned; torch>=2.10), so LlamaConfig's defaults and the default "
                   "attention implementation are the installed version's; the hf_models.py read is the stored "
                   "copy (92275d5e), not pinned to the results commit; GTX 1650 traced as a T4 (same sm75, "
                   "other SM count)",
})

# --- XiaoJianyu219/llm-infra-bench, experiment 08: Qwen3-0.6B full training on one RTX 4090 ----------------
# Both max_memory_allocated and max_memory_reserved per run (results/runs/<tag>.json), written by
# scripts/train_loop.py: HF Qwen3-0.6B loaded in float32, torch AdamW(lr=1e-4, betas=(0.9, 0.95),
# weight_decay=0.1), one fixed random batch (B x S ids, labels = ids, no attention mask), bf16 autocast or
# none, SDPA backend forced with sdpa_kernel, optional non-reentrant gradient checkpointing, 10 warmup steps,
# reset_peak_memory_stats(), then 3 x 10 measured steps. Only the runs that finished ("status": "ok") are used.
XJY_COMMIT = "c4bca64b77a2d7f2b84e5e1916a1e4bcd8bfe4ce"
XJY_DIR = "experiments/08-single-gpu-profiling"
QWEN3_06B = {
    "config_class": "Qwen3Config",
    "kwargs": {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
               "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
               "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True, "attention_bias": False, "use_cache": False},
    "note": "Qwen/Qwen3-0.6B's published config.json (the dimensions also in the source's scripts/model_flops.py "
            "QWEN3_06B: 28 layers, hidden 1024, head_dim 128, 16 heads, 8 KV heads, MLP 3072, vocab 151936); "
            "train_loop.py sets cfg._attn_implementation = 'sdpa', cfg.use_cache = False and loads it with "
            "dtype=torch.float32",
    "task": "causal-lm", "attn_implementation": "sdpa", "dtype": "float32",
    "inputs": ["input_ids", "labels"],
}
XJY_STACK = (
    "torch 2.14.0+cu130 and transformers 5.17.0 (results/env.txt) against the installed 2.13 / 5.23; "
    "train_loop.py forces the SDPA backend with torch.nn.attention.sdpa_kernel ({sdpa}), memcheck picks its "
    "own kernel for SDPA without a mask; the model is loaded by from_pretrained on the CPU and then moved "
    "with model.to('cuda') (memcheck's setup phase builds it in place); the allocated peak covers only the "
    "30 measured steps (reset_peak_memory_stats after 10 warmup steps), while reserved, never released in "
    "this loop (no empty_cache before the reading), is the process's peak over loading, warmup and the "
    "measured steps; no gradient clipping; one fixed batch reused every step; one_step() keeps "
    "`out = model(...)` (the output object, holding the bf16 logits) referenced until it returns after "
    "opt.step(), traced with model.loss keep-output"
)


def xjy(tag, *, seq, bs, precision, sdpa, ckpt, alloc_mib, resv_mib):
    path = f"{XJY_DIR}/results/runs/{tag}.json"
    out = []
    for metric, mib, key in (("max_memory_allocated", alloc_mib, "mem_allocated_mib"),
                             ("max_memory_reserved", resv_mib, "mem_reserved_mib")):
        value = mib * MiB
        assert value == int(value), (tag, metric)
        out.append({
            "id": f"xjy-qwen3-0.6b-{tag.replace('_', '-')}-{'alloc' if metric.endswith('allocated') else 'reserved'}",
            "source": {
                "url": f"https://github.com/XiaoJianyu219/llm-infra-bench/blob/{XJY_COMMIT}/{path}",
                "repo": "XiaoJianyu219/llm-infra-bench", "path": path, "commit": XJY_COMMIT,
                "quote": (f"\"seq_len\": {seq}, \"batch_size\": {bs}, \"precision\": \"{precision}\", "
                          f"\"sdpa\": \"{sdpa}\", \"ckpt\": {ckpt}, ... \"torch\": \"2.14.0+cu130\", "
                          f"\"device\": \"NVIDIA GeForce RTX 4090\", ... \"mem_allocated_mib\": {alloc_mib!r}, "
                          f"\"mem_reserved_mib\": {resv_mib!r}, \"status\": \"ok\""),
                "code": f"{XJY_DIR}/scripts/train_loop.py (build, one_step, the two readings), "
                        f"scripts/run_matrix2.py (the job list), results/env.txt (torch, transformers)",
            },
            "model": dict(QWEN3_06B, loss="keep-output"),
            "batch_size": bs, "max_len": seq, "accumulate": 1,
            "precision": "amp-bf16" if precision == "bf16" else "fp32",
            "optimizer": "adamw",
            "checkpointing": "full" if ckpt else "none", "use_reentrant": False,
            "strategy": "single", "gpus": 1,
            "gpu": "RTX-4090", "gpu_published": "NVIDIA GeForce RTX 4090 (24 GB, sm89)",
            "torch_version": "2.14.0+cu130",
            "metric": metric, "value_bytes": int(value),
            "unit_conversion": f"{key} = torch.cuda.{metric}() / 2 ** 20 as written (a float): "
                               f"value_bytes = {mib!r} * 1048576",
            "stack_notes": XJY_STACK.format(sdpa=sdpa),
        })
    return out


for tag, seq, bs, prec, sdpa, ckpt, alloc_mib, resv_mib in (
        ("ref_s2048_b1", 2048, 1, "bf16", "flash", 0, 16645.00634765625, 16684.0),
        ("tok2048_s1024_b2", 1024, 2, "bf16", "flash", 0, 16644.00634765625, 16682.0),
        ("ref_s512_b4", 512, 4, "bf16", "flash", 0, 16643.50634765625, 16682.0),
        ("tok2048_s256_b8", 256, 8, "bf16", "flash", 0, 16643.25634765625, 16682.0),
        ("bsw_s512_b1_ckpt0", 512, 1, "bf16", "flash", 0, 11538.259765625, 11878.0),
        ("bsw_s512_b2_ckpt0", 512, 2, "bf16", "flash", 0, 12309.64306640625, 12958.0),
        ("bsw_s512_b6_ckpt0", 512, 6, "bf16", "flash", 0, 20971.86962890625, 21792.0),
        ("ckpt1_s2048_b1", 2048, 1, "bf16", "flash", 1, 11981.533203125, 15564.0),
        ("ckpt1_s512_b4", 512, 4, "bf16", "flash", 1, 11981.533203125, 15560.0),
        ("bsw_s512_b8_ckpt1", 512, 8, "bf16", "flash", 1, 15934.08447265625, 19732.0),
        ("bsw_s512_b12_ckpt1", 512, 12, "bf16", "flash", 1, 20333.87353515625, 23532.0),
        ("prec_fp32_s2048_b1", 2048, 1, "fp32", "mem_efficient", 0, 18345.25634765625, 19000.0),
        ("prec_fp32_s512_b4", 512, 4, "fp32", "mem_efficient", 0, 18343.75634765625, 18998.0)):
    cases.extend(xjy(tag, seq=seq, bs=bs, precision=prec, sdpa=sdpa, ckpt=ckpt, alloc_mib=alloc_mib, resv_mib=resv_mib))

# --- the same repository, experiment 09: single-GPU and two-GPU DDP runs, full and LoRA ----------------------
# experiments/09-parallel-strategies/scripts/train_dist.py: the same model and fixed random batch (seq 512),
# default SDPA backend (none forced), AdamW(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1), bf16 autocast,
# `loss = net(input_ids=ids, labels=labels, use_cache=False).loss` (the output object is not kept), 10 warmup
# steps, reset_peak_memory_stats(), 3 x 10 measured steps. Full training loads float32 weights; --lora loads the
# base in bfloat16 and adds peft LoRA r 16, alpha 32, dropout 0.0 on q/k/v/o (peft 0.21.0: adapters float32).
# DDP: DistributedDataParallel(gradient_as_bucket_view=True), bucket_cap_mb 25 (default), 2 GPUs; both ranks
# read the same figures (per_rank in the file).
XJY9_DIR = "experiments/09-parallel-strategies"
XJY9_STACK = (
    "torch 2.14.0+cu130, transformers 5.17.0, peft 0.21.0, deepspeed 0.19.7 (results/env.txt) against the "
    "installed torch 2.13 / transformers 5.23 / peft 0.21.2; the model is loaded by from_pretrained on the CPU "
    "(LoRA added there) and moved with .cuda() (memcheck's setup phase builds it in place); the allocated peak "
    "covers the 30 measured steps after reset_peak_memory_stats, reserved the whole process (no empty_cache); "
    "no gradient clipping; one fixed batch reused every step; a different RTX 4090 machine from experiment 08"
)
XJY9_LORA = {"method": "lora", "r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "bias": "none",
             "task_type": "CAUSAL_LM", "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def xjy9(tag, *, bs, lora, strategy, alloc_mib, resv_mib, extra_notes=""):
    path = f"{XJY9_DIR}/results/runs/{tag}.json"
    model = dict(QWEN3_06B)
    if lora:
        model = dict(model, dtype="bfloat16", peft=XJY9_LORA,
                     note=QWEN3_06B["note"].replace("dtype=torch.float32", "dtype=torch.bfloat16 (train_dist.py "
                                                    "build_model(torch.bfloat16 if args.lora ...))"))
    out = []
    for metric, mib, key in (("max_memory_allocated", alloc_mib, "mem_allocated_mib"),
                             ("max_memory_reserved", resv_mib, "mem_reserved_mib")):
        value = mib * MiB
        assert value == int(value), (tag, metric)
        case = {
            "id": f"xjy09-qwen3-0.6b-{tag.replace('_', '-')}-{'alloc' if metric.endswith('allocated') else 'reserved'}",
            "source": {
                "url": f"https://github.com/XiaoJianyu219/llm-infra-bench/blob/{XJY_COMMIT}/{path}",
                "repo": "XiaoJianyu219/llm-infra-bench", "path": path, "commit": XJY_COMMIT,
                "quote": (f"\"strategy\": \"{strategy}\", \"world_size\": {2 if strategy == 'ddp' else 1}, ... "
                          f"\"device\": \"NVIDIA GeForce RTX 4090\", ... \"seq_len\": 512, \"micro_bsz\": {bs}, "
                          f"\"grad_accum\": 1, ... \"lora\": {'true' if lora else 'false'}, \"lora_r\": 16, "
                          f"\"lora_alpha\": 32, \"lora_target\": \"q_proj,k_proj,v_proj,o_proj\", ... "
                          f"\"mem_allocated_mib\": {alloc_mib!r}, \"mem_reserved_mib\": {resv_mib!r}, "
                          f"... \"status\": \"ok\""),
                "code": f"{XJY9_DIR}/scripts/train_dist.py (build_model, apply_lora, setup_single/setup_ddp, "
                        f"one_step, the two readings), results/env.txt (versions)",
            },
            "model": model,
            "batch_size": bs, "max_len": 512, "accumulate": 1,
            "precision": "amp-bf16", "optimizer": "adamw",
            "checkpointing": "none", "use_reentrant": False,
            "strategy": strategy, "gpus": 2 if strategy == "ddp" else 1,
            "gpu": "RTX-4090", "gpu_published": "NVIDIA GeForce RTX 4090 (24 GB, sm89)"
                                                + (" x 2, no P2P (NCCL over shared memory)" if strategy == "ddp" else ""),
            "torch_version": "2.14.0+cu130",
            "metric": metric, "value_bytes": int(value),
            "unit_conversion": f"{key} = torch.cuda.{metric}() / 2 ** 20 as written (a float; rank 0, the same "
                               f"on every rank): value_bytes = {mib!r} * 1048576",
            "stack_notes": XJY9_STACK + extra_notes,
        }
        if strategy == "ddp":
            case["bucket_view"] = True
        out.append(case)
    return out


for tag, bs, lora, strategy, alloc_mib, resv_mib in (
        ("single_mb2", 2, False, "single", 12012.8935546875, 12662.0),
        ("single_mb4", 4, False, "single", 16049.5068359375, 16682.0),
        ("lora_single_mb2", 2, True, "single", 4684.6845703125, 5028.0),
        ("w2_ddp_mb2", 2, False, "ddp", 14286.3544921875, 14610.0),
        ("lora_w2_ddp_mb2", 2, True, "ddp", 4702.1845703125, 5034.0)):
    cases.extend(xjy9(tag, bs=bs, lora=lora, strategy=strategy, alloc_mib=alloc_mib, resv_mib=resv_mib,
                      extra_notes="; DDP over 2 GPUs with NCCL (its communicator buffers are outside the caching "
                                  "allocator)" if strategy == "ddp" else ""))

Path(__file__).with_name("cases.json").write_text(json.dumps({"cases": cases}, indent=1) + "\n")
print(len(cases), "cases")
