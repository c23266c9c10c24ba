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

Path(__file__).with_name("cases.json").write_text(json.dumps({"cases": cases}, indent=1) + "\n")
print(len(cases), "cases")
