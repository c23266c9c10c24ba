"""Write records/<id>.json: one published multi-GPU memory measurement per file (issue 21).

    python benchmarks/published/multi_gpu/make_records.py

Every figure below is copied from its source with the line that prints it (`quote`), converted to
bytes as the source meant it (`unit_conversion`), and every setting the source does not state is
listed in `gaps`, never filled in silently. Nothing here is measured or estimated by memcheck.
See README.md in this folder for the fields and what each record can check.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "records"
GIB = 2**30

# ---------------------------------------------------------------- sources, as read
TT_REPO = "pytorch/torchtitan"
TT_BENCH_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"  # the mirror read; the file is unchanged since 820504e2
TT_BENCH_PATH = "benchmarks/llama3_h100_202412_torchtitan.md"
TT_RUN_COMMIT = "9dec370ad26b5f8e9a7333a0e36165018262644b"  # torchtitan commit the tables were run at (2024-12-26)
TT_TORCH = "nightly 1963fc83a1c32e162162e2414f78b043f0674bae (2024-12-23, between 2.5 and 2.6); torchao eab345c"
TT_METRIC = (
    "max_memory_reserved",
    "torchtitan's 'Memory(GiB)': train.py @ 9dec370 logs device_mem_stats.max_reserved_gib "
    "(torch.cuda.memory_stats()['reserved_bytes.all.peak'] / 2**30, peak reset after each log, every 10 steps); "
    "the table's footnote: 'Different PP ranks can have different peak memory usages. We take the maximum across all GPUs.'",
)
TT_GPU = "H100 SXM, HBM2e 96 GB (95 GiB usable), 500 W (Grand Teton)"

TT165_COMMIT = "83c879f18763611bda68586c45f0082fd568d646"  # 'Used per-parameter FSDP (#165)', 2024-03-28
TT165_CAP_GIB = 95.0396

LT_REPO = "Lightning-AI/pytorch-lightning"
MG_REPO = "NVIDIA/Megatron-LM"
MG_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # the mirror read (2026-08-22)

LLAMA31_8B = {"config_class": "LlamaConfig", "kwargs": {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "derivation": "torchtitan llama3_configs['8B'] @ 9dec370: dim 4096, n_layers 32, n_heads 32, n_kv_heads 8, "
                  "ffn_dim_multiplier 1.3, multiple_of 1024 -> FFN int(2*4*4096/3)=10922, *1.3=14198, rounded up to "
                  "a multiple of 1024 = 14336; vocab 128256 from the tiktoken tokenizer (128000 + 256 reserved)"}
LLAMA31_70B = {"config_class": "LlamaConfig", "config_file": "examples/llama-3-70b/config.json",
    "derivation": "torchtitan llama3_configs['70B'] @ 9dec370: dim 8192, n_layers 80, n_heads 64, n_kv_heads 8, "
                  "ffn_dim_multiplier 1.3, multiple_of 4096 -> int(2*4*8192/3)=21845, *1.3=28398, rounded up to "
                  "4096s = 28672 (= examples/llama-3-70b); vocab 128256"}
LLAMA31_405B = {"config_class": "LlamaConfig", "kwargs": {
    "vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
    "num_attention_heads": 128, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "derivation": "torchtitan llama3_configs['405B'] @ 9dec370: dim 16384, n_layers 126, n_heads 128, n_kv_heads 8, "
                  "ffn_dim_multiplier 1.2, multiple_of 4096 -> int(2*4*16384/3)=43690, *1.2=52428, rounded up = 53248"}
LLAMA2_7B_SHAPE = {"config_class": "LlamaConfig", "kwargs": {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False},
    "derivation": "ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=None, multiple_of=256) -> FFN "
                  "int(2*4*4096/3)=10922 rounded up to 256s = 11008; vocab 32000 (Llama 2 sentencepiece); 6.74e9 parameters"}

TT_MODEL_CODE_NOTES = [
    "torchtitan's own Llama (torchtitan/models/llama/model.py), not transformers' LlamaForCausalLM: same parameter "
    "shapes, but RoPE through view_as_complex on float32 copies of q and k, SDPA with is_causal=True, "
    "the loss as cross_entropy(pred.flatten(0, 1).float(), ...) with the logits deleted before backward",
    "FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), float32 sharded parameters and "
    "AdamW state; reshard_after_forward=False for the last block; the root resharded unless PP",
    "AdamW(lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True) (torchtitan/optimizer.py @ 9dec370); grad-norm "
    "clipping max_norm 1.0 with foreach",
]


def tt_record(rid, table, row, value_gib, model, model_name, gpus, layout, local_batch, seq_len, ac, compile_, float8,
              async_tp, global_batch=None, extra_gaps=(), extra_diffs=(), grade="C", can_check=""):
    gaps = [
        "the exact command line is not published; settings not named in the table are taken from the train config "
        f"(train_configs/{model_name}.toml @ {TT_RUN_COMMIT[:8]}) and torchtitan's defaults at that commit",
        "the rank whose figure is shown is not named ('maximum across all GPUs')",
        "one decimal of GiB: +-0.05 GiB",
    ] + list(extra_gaps)
    diffs = list(TT_MODEL_CODE_NOTES) + list(extra_diffs)
    if compile_:
        diffs.append("torch.compile of every transformer block (memcheck traces eager code; compiled graphs free and fuse differently)")
    if float8:
        diffs.append("torchao Float8 linears (dynamic tensorwise scaling, float8 all-gather in FSDP): memcheck models no float8 training")
    if async_tp:
        diffs.append("async TP (SymmetricMemory buffers, micro-pipelined all-gather matmuls): memcheck's TP would model plain DTensor TP")
    return {
        "id": rid,
        "source": {
            "url": f"https://github.com/{TT_REPO}/blob/{TT_BENCH_COMMIT}/{TT_BENCH_PATH}",
            "repo": TT_REPO, "path": TT_BENCH_PATH, "commit": TT_BENCH_COMMIT,
            "also": "docs/performance.md @ d4c86e37 (same tables); torchtitan paper arXiv 2410.06511 reports the same study",
            "quote": f"{table} | {row} | {value_gib} |",
        },
        "model": dict(model, name=model_name, code="torchtitan Llama 3 (torchtitan/models/llama/model.py @ 9dec370)"),
        "gpus": {"count": gpus, "type": TT_GPU},
        "layout": layout,
        "local_batch": local_batch, "global_batch": global_batch, "seq_len": seq_len,
        "precision": "bf16 params in compute (FSDP2 mixed precision), fp32 master/optimizer, fp32 reduce" + (" + float8 linears" if float8 else ""),
        "optimizer": "torch AdamW foreach (betas 0.9/0.95, wd 0.1)",
        "activation_checkpointing": ac,
        "compile": compile_, "float8": float8, "async_tp": async_tp,
        "framework": {"name": "torchtitan", "commit": TT_RUN_COMMIT},
        "torch_version": TT_TORCH,
        "metric": TT_METRIC[0], "metric_definition": TT_METRIC[1], "rank": "max over all ranks",
        "value_published": f"{value_gib} GiB",
        "value_bytes": round(value_gib * GIB),
        "unit_conversion": "GiB as printed (/ 2**30, torchtitan's _to_gib): value_bytes = round(x * 2**30)",
        "gaps": gaps,
        "stack_differences": diffs,
        "reproducibility": grade,
        "can_check": can_check,
    }


def torchtitan_2412():
    r = []
    fsdp_layout = lambda n: {"dp_shard": n, "dp_replicate": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    t1 = "**Table 1** 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. Selective activation checkpointing."
    t3 = "**Table 3** 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, global batch size 256. Selective activation checkpointing."
    sac = "selective, op level (llama3_8b.toml: mode='selective', selective_ac_option='op'; _save_list: mm (every second one recomputed), SDPA flash/efficient, reduce_scatter, abs, max)"
    sac_gap = ["the table says 'Selective activation checkpointing' without the option; 'op' is the 8B toml's value at 9dec370",
               "sequence length not in the table: 8192 is the 8B toml's seq_len at 9dec370"]
    for gpus, tab, vals in ((8, t1, (82.4, 77.0, 76.8)), (128, t3, (67.0, 62.0, 61.8))):
        tn = "t1" if gpus == 8 else "t3"
        for (tech, c, f8), v in zip((("FSDP", False, False), ("FSDP + torch.compile", True, False),
                                      ("FSDP + torch.compile + Float8", True, True)), vals):
            suffix = "" if not c else ("-compile" if not f8 else "-compile-fp8")
            r.append(tt_record(
                f"tt2412-{tn}-llama3.1-8b-fsdp{gpus}-sac{suffix}", tab, tech, v, LLAMA31_8B, "llama3_8b", gpus,
                fsdp_layout(gpus), 2, 8192, sac, c, f8, False, global_batch=2 * gpus, extra_gaps=sac_gap,
                grade="B" if not c else "C",
                can_check=("memcheck's fsdp strategy (FSDP2) per rank on a Llama-3.1-8B-shaped HF model at batch 2 x 8192 "
                           "with --checkpointing selective-op, bf16 FSDP mixed precision: the static part (sharded fp32 "
                           "params/grads/AdamW) shrinks with 1/N while the activations stay, so the 8-GPU and 128-GPU rows "
                           "together separate the two" if not c else
                           "only an upper bound for an eager estimate (the compiled/float8 run is lower than the eager row)")))
    t2 = "**Table 2** FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch size 1. Full activation checkpointing."
    for (fs, cp, seq), v in zip(((8, 1, 32768), (4, 2, 65536), (2, 4, 131072), (1, 8, 262144)), (83.9, 84.2, 84.0, 84.5)):
        r.append(tt_record(
            f"tt2412-t2-llama3.1-8b-fsdp{fs}-cp{cp}-seq{seq}-compile-fp8", t2, f"FSDP {fs}, CP {cp} | {seq}", v, LLAMA31_8B,
            "llama3_8b", 8, {"dp_shard": fs, "dp_replicate": 1, "tp": 1, "pp": 1, "cp": cp, "ep": 1,
                             "fsdp_shard_group": "dp_shard x cp = 8 (the dp_shard_cp mesh)",
                             "cp_rotate_method": "allgather (torchtitan default @ 9dec370)"}, 1, seq,
            "full (every block, non-reentrant checkpoint_wrapper)", True, True, False,
            extra_gaps=["FSDP shards over dp_shard x cp ranks (parallelize_llama.py @ 9dec370 applies fully_shard on the "
                        "dp_shard_cp mesh) -- from the code, not the table",
                        "max_position/rope length for 262144 tokens: torchtitan's max_seq_len is set from seq_len"],
            extra_diffs=["torch's experimental context_parallel (ring SDPA over sequence shards, the buffers sharded in "
                         "place by context_parallel()) as of the 2024-12 nightly"],
            can_check="CP per-rank activation scaling (84 GiB flat while seq doubles with CP) only qualitatively: compile and float8 change the absolute level"))
    t4 = "**Table 4** 2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs (FSDP 32, TP 8). Local batch size 16, global batch size 512. Full activation checkpointing."
    for tech, v, atp in (("2D", 71.9, False), ("2D + AsyncTP", 67.6, True)):
        r.append(tt_record(
            f"tt2412-t4-llama3.1-70b-fsdp32-tp8-compile-fp8{'-asynctp' if atp else ''}", t4, tech, v, LLAMA31_70B,
            "llama3_70b", 256, {"dp_shard": 32, "dp_replicate": 1, "tp": 8, "sequence_parallel": True,
                                "loss_parallel": True, "pp": 1, "cp": 1, "ep": 1}, 16, 8192,
            "full (every block)", True, True, atp, global_batch=512,
            extra_gaps=["seq_len not in the table: 8192 from llama3_70b.toml @ 9dec370",
                        "'local batch size 16' is per data-parallel rank (the 8 TP ranks of a group share it)"],
            extra_diffs=["TP plan: torchtitan's (colwise wq/wk/wv/w1/w3, rowwise wo/w2, sequence parallel norms, "
                         "loss parallel on Shard(-1) logits, float8 TP variants)"],
            can_check="the FSDP+TP per-rank order of magnitude for the 70B config memcheck's plan targets; not exact (compile, float8)"))
    t5 = "**Table 5** 3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP. Llama 3.1 405B model. 512 GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global batch size 256. Full activation checkpointing."
    for sched, v, spr in (("1F1B", 82.5, 1), ("Interleaved 1F1B", 72.7, 2)):
        r.append(tt_record(
            f"tt2412-t5-llama3.1-405b-fsdp8-tp8-pp8-{sched.lower().replace(' ', '-')}", t5, sched, v, LLAMA31_405B,
            "llama3_405b", 512, {"dp_shard": 8, "dp_replicate": 1, "tp": 8, "sequence_parallel": True, "pp": 8,
                                 "pp_schedule": sched, "stages_per_rank": spr, "microbatches": 8,
                                 "microbatch_size": 4, "cp": 1, "ep": 1}, 32, 8192,
            "full (every block)", True, True, True, global_batch=256,
            extra_gaps=["microbatches not stated: torchtitan's default (pipeline_parallel_microbatches=None -> the PP "
                        "degree, 8) gives 32/8 = 4 samples per micro-batch",
                        "split points not stated: generate_split_points' default (126 layers over 8 or 16 stages, "
                        "embedding and output counted as layers) is assumed",
                        "seq_len 8192 from llama3_405b.toml; 'global batch size 256' = 32 x FSDP 8",
                        "issue #773 (2025-01-03) prints the same runs' log lines with two decimals: 1F1B 'memory: "
                        "82.46GiB(86.80%)', Interleaved1F1B 'memory: 72.69GiB(76.52%)' -- confirming that the table's "
                        "'Memory' is the log line's max_reserved figure"],
            extra_diffs=["torch.distributed.pipelining Schedule1F1B / ScheduleInterleaved1F1B of the 2024-12 nightly; "
                         "FSDP2 with reshard_after_forward=False under PP"],
            can_check="only which schedule holds less (interleaved 1F1B 72.7 vs 1F1B 82.5 GiB on the busiest rank); not exact"))
    t6 = "**Table 6** 4D parallelism (FSDP + TP + PP + CP) + torch.compile + Float8 + AsyncTP + 1F1B. Llama 3.1 405B model. 512 GPUs (TP 8, PP8). Local batch size 8. Full activation checkpointing."
    for (fs, cp, seq), v in zip(((8, 1, 32768), (4, 2, 65536), (2, 4, 131072), (1, 8, 262144)), (75.3, 75.9, 77.1, 84.9)):
        r.append(tt_record(
            f"tt2412-t6-llama3.1-405b-fsdp{fs}-cp{cp}-tp8-pp8-seq{seq}", t6, f"FSDP {fs}, CP {cp} | {seq}", v, LLAMA31_405B,
            "llama3_405b", 512, {"dp_shard": fs, "dp_replicate": 1, "tp": 8, "sequence_parallel": True, "pp": 8,
                                 "pp_schedule": "1F1B", "microbatches": 8, "cp": cp, "ep": 1,
                                 "fsdp_shard_group": "dp_shard x cp = 8 (the dp_shard_cp mesh)"}, 8, seq,
            "full (every block)", True, True, True,
            extra_gaps=["microbatches and micro-batch size not stated (default 8 micro-batches of 1 sample assumed)",
                        "FSDP shards over dp_shard x cp = 8 ranks in every row (dp_shard_cp mesh, from the code)",
                        "global batch not stated (8 x FSDP degree)"],
            can_check="qualitative only (CP x PP x TP with compile and float8)"))
    return r


def tt165():
    r = []
    q = ("commit message of 'Used per-parameter FSDP (#165)' (" + TT165_COMMIT + "): ")
    base_gaps = [
        "model: torchtitan (then 'torchtrain') llama '7B' flavor: ModelArgs(dim=4096, n_layers=32, n_heads=32), vocab 32000 "
        "(Llama 2 tokenizer), FFN 11008; the PR does not print the command line",
        "'SAC' is not defined in the PR: at this commit selective_ac_option defaulted to '2' (every second block fully "
        "checkpointed) and 'op' (no_recompute_list: mm except every second, SDPA, reduce_scatter) existed; which one ran is not stated",
        "dataset minipile, sequence length 2048 (packed, fixed length in torchtitan's loader)",
        "figures are percentages of 95.0396 GiB printed to 2 decimals: +-0.005 % = +-4.9 MiB",
        "rank: the log line of rank 0 (torchtitan logs rank 0)",
        "torch: a nightly of March 2024 (not named)",
    ]
    diffs = [
        "torchtitan's own Llama: output logits cast .float() in the model (model.py line 501 @ 83c879f1), loss "
        "cross_entropy on the float32 logits; RoPE via view_as_complex in float32",
        "bf16 mixed precision: FSDP2 MixedPrecisionPolicy(bf16, reduce fp32) / FSDP1 MixedPrecision(param bf16, reduce fp32); "
        "AdamW foreach (betas 0.9/0.95, wd 0.1)",
        "the 2024-03 FSDP2 (torch.distributed._composable.fsdp) before its 2.4 release",
    ]
    rows = [
        ("fsdp1", 8, 1, "AC", 8, 24.81, 33.82, "FSDP1 (AC): 24.81% peak active, 33.82% peak reserved, 6100-6200 WPS"),
        ("fsdp1", 8, 1, "SAC", 8, 52.98, 67.23, "FSDP1 (SAC): 52.98% peak active, 67.23% peak reserved, 6500-6700 WPS"),
        ("fsdp2", 8, 1, "AC", 8, 23.92, 32.64, "FSDP2 (AC): 23.92% peak active, 32.64% peak reserved, 6100-6300 WPS"),
        ("fsdp2", 8, 1, "SAC", 8, 52.13, 62.51, "FSDP2 (SAC): 52.13% peak active, 62.51% peak reserved, 6600-6800 WPS"),
        ("fsdp2", 4, 2, "AC", 16, 50.12, 60.97, "2D FSDP - Eager (2-way SP, 4-way FSDP) ... local batch size 16 ... FSDP2 (AC): 50.12% peak active, 60.97% peak reserved"),
        ("fsdp2", 4, 2, "SAC", 16, 76.49, 90.14, "2D FSDP - Eager (2-way SP, 4-way FSDP) ... FSDP2 (SAC): 76.49% peak active, 90.14% peak reserved"),
    ]
    for fsdp, dp, tp, ac, bs, act, res, quote in rows:
        for metric, pct, defn in (("max_memory_allocated", act, "torch.cuda.memory_stats()['active_bytes.all.peak'] (torchtrain/metrics.py), the same counter as max_memory_allocated on one stream"),
                                  ("max_memory_reserved", res, "torch.cuda.memory_stats()['reserved_bytes.all.peak']")):
            rid = f"tt165-llama2-7b-{fsdp}-dp{dp}" + (f"-tp{tp}sp" if tp > 1 else "") + f"-{ac.lower()}-bs{bs}-{'active' if metric.endswith('allocated') else 'reserved'}"
            r.append({
                "id": rid,
                "source": {"url": f"https://github.com/{TT_REPO}/pull/165", "repo": TT_REPO, "commit": TT165_COMMIT,
                           "quote": q + quote},
                "model": dict(LLAMA2_7B_SHAPE, name="torchtitan llama 7B (Llama-2-7B shape)",
                              code="torchtrain/models/llama/model.py @ 83c879f1"),
                "gpus": {"count": 8, "type": "H100 (95.0396 GiB reported capacity: HBM2e 96 GB)"},
                "layout": {"dp_shard": dp, "dp_replicate": 1, "tp": tp, "sequence_parallel": tp > 1, "pp": 1, "cp": 1, "ep": 1,
                           "fsdp_implementation": "FSDP1 FullyShardedDataParallel FULL_SHARD" if fsdp == "fsdp1" else "FSDP2 fully_shard"},
                "local_batch": bs, "global_batch": bs * dp, "seq_len": 2048,
                "precision": "bf16 mixed precision, fp32 reduce-scatter",
                "optimizer": "torch AdamW foreach (betas 0.9/0.95, wd 0.1)",
                "activation_checkpointing": "full (every block, non-reentrant)" if ac == "AC" else "SAC (see gaps)",
                "compile": False, "float8": False, "async_tp": False,
                "framework": {"name": "torchtitan (torchtrain)", "commit": TT165_COMMIT},
                "torch_version": "nightly, March 2024 (not named)",
                "metric": metric, "metric_definition": defn, "rank": "rank 0",
                "value_published": f"{pct}% of {TT165_CAP_GIB} GiB",
                "value_bytes": round(pct / 100 * TT165_CAP_GIB * GIB),
                "unit_conversion": "percent of the reported device capacity 95.0396 GiB: value_bytes = round(pct/100 * 95.0396 * 2**30)",
                "gaps": base_gaps + (["FSDP1 wrapping policy, limit_all_gathers and backward_prefetch not stated"] if fsdp == "fsdp1" else [])
                        + (["the 2D plan at this commit (colwise/rowwise with SequenceParallel norms); loss parallel not used then"] if tp > 1 else []),
                "stack_differences": diffs,
                "reproducibility": "B" if ac == "AC" else "C",
                "can_check": ("FSDP1 vs FSDP2 per rank on the same job (the issue's fsdp1 strategy), allocated and reserved"
                              if dp == 8 else "FSDP2 x TP(SP) 2D per rank, allocated and reserved") +
                             ("" if ac == "AC" else "; the SAC rows only once the SAC policy that ran is known"),
            })
    return r


def lightning():
    lt_model = dict(LLAMA2_7B_SHAPE, name="Lightning example Llama (torchtitan's Llama 2 code), ModelArgs(vocab_size=32000)")
    common_gaps = [
        "GPU type not stated (README: 'at least 4 GPUs and 24 GB memory each'; the figures exceed 24 GB, so a larger card)",
        "torch version not stated ('pip install torch>=2.3'; May 2024, so torch 2.3.0)",
        "which rank printed it: the print is rank 0's (fabric.print / trainer.print)",
        "the reading is taken after saving a distributed checkpoint of the sharded model and optimizer state",
        "printed with 2 decimals of GB (1e9): +-0.005e9 bytes",
    ]
    diffs = [
        "the example's own Llama (torchtitan's Llama 2 code): the output layer's logits .float() in the model, RoPE in "
        "complex float32, SDPA is_causal; loss_parallel cross entropy on the Shard(-1) DTensor logits",
        "FSDP2 (torch 2.3 _composable.fsdp) with MixedPrecisionPolicy(bf16, reduce fp32) on the data-parallel mesh, "
        "checkpoint_wrapper (full, non-reentrant by default) around every block, reshard_after_forward=False for the last block",
        "TP plan: RowwiseParallel embedding, ColwiseParallel output with Shard(-1) logits, SequenceParallel norms, "
        "colwise wq/wk/wv/w1/w3 and rowwise wo/w2 with Shard(1) outputs (sequence parallel)",
        "torch.set_float32_matmul_precision('high')",
    ]
    layout = {"dp_shard": 2, "dp_replicate": 1, "tp": 2, "sequence_parallel": True, "loss_parallel": True, "pp": 1, "cp": 1, "ep": 1}
    recs = []
    recs.append({
        "id": "lightning-trainer-tp2-fsdp2-llama2-7b-bs8-seq128",
        "source": {"url": f"https://github.com/{LT_REPO}/blob/c8059d7bfd/examples/pytorch/tensor_parallel/README.md",
                   "repo": LT_REPO, "path": "examples/pytorch/tensor_parallel/README.md", "commit": "c8059d7bfd (2024-05-18, '(6/n) Support 2D Parallelism - Trainer example')",
                   "quote": "Peak memory usage: 36.73 GB  (train.py @ c8059d7bfd: trainer.print(f\"Peak memory usage: {torch.cuda.max_memory_reserved() / 1e9:.02f} GB\"))"},
        "model": lt_model, "gpus": {"count": 4, "type": "unknown (>24 GB each)"}, "layout": layout,
        "local_batch": 8, "global_batch": 16, "seq_len": 128,
        "precision": "fp32 parameters (Trainer precision '32-true'), bf16 compute through FSDP2 MixedPrecisionPolicy, fp32 reduce",
        "optimizer": "torch AdamW(lr=3e-3, foreach=True), configure_optimizers after configure_model (real DTensor parameters)",
        "activation_checkpointing": "full (checkpoint_wrapper on every block)", "compile": False, "float8": False, "async_tp": False,
        "framework": {"name": "Lightning Trainer ModelParallelStrategy", "commit": "c8059d7bfd"},
        "torch_version": "2.3 (assumed from the README's requirement)",
        "metric": "max_memory_reserved", "metric_definition": "torch.cuda.max_memory_reserved() over the whole process (never reset)",
        "rank": "rank 0", "value_published": "36.73 GB", "value_bytes": 36_730_000_000,
        "unit_conversion": "/ 1e9 printed as 'GB' (decimal): value_bytes = 36.73e9",
        "gaps": common_gaps + ["limit_train_batches=10 (the README shows 10/10 steps) over RandomTokenDataset(128 samples, 129 tokens); "
                               "inputs are batch[:, :-1]: 8 x 128 tokens per rank, the same batch on both TP ranks of a group",
                               "the README's sample output prints 'Saving a (distributed) checkpoint ...', a line that "
                               "train.py @ c8059d7bfd does not print (the Fabric script's line): the output may come from a "
                               "draft of the script; the Trainer's default ModelCheckpoint also saves at the end of the epoch",
                               "DataLoader num_workers=4 (host side only)"],
        "stack_differences": diffs,
        "reproducibility": "B",
        "can_check": "FSDP2 x TP(SP) 2D on 4 ranks of a Llama-2-7B shape with tiny activations (8 x 128 tokens): almost all "
                     "of the figure is the 1/4 shard of fp32 params, grads and AdamW state (6,738,415,616 parameters x 16 B / 4 = "
                     "26,953,662,464 B of the published 36.73e9 B) plus the bf16 all-gather buffers, the checkpoint save and "
                     "the allocator's caching: a check of the static per-rank accounting of TP x FSDP",
    })
    recs.append({
        "id": "lightning-fabric-tp2-fsdp2-llama2-7b-bs8-seq128-no-optimizer-state",
        "source": {"url": f"https://github.com/{LT_REPO}/blob/0c8a193d3c/examples/fabric/tensor_parallel/README.md",
                   "repo": LT_REPO, "path": "examples/fabric/tensor_parallel/README.md", "commit": "0c8a193d3c (2024-05-07, '(1/n) Support 2D Parallelism'); the figure is unchanged in the README at HEAD",
                   "quote": "Peak memory usage: 17.95 GB  (train.py @ 0c8a193d3c: fabric.print(f\"Peak memory usage: {torch.cuda.max_memory_reserved() / 1e9:.02f} GB\"))"},
        "model": lt_model, "gpus": {"count": 4, "type": "unknown (>= 24 GB each)"}, "layout": layout,
        "local_batch": 8, "global_batch": 16, "seq_len": 128,
        "precision": "fp32 parameters, bf16 compute through FSDP2 MixedPrecisionPolicy, fp32 reduce",
        "optimizer": "AdamW(foreach=True) built on the meta-device parameters BEFORE fabric.setup() replaced them with "
                     "DTensor shards: the optimizer held stale parameters, so no AdamW state was ever allocated and "
                     "zero_grad() never reached the real gradients (fixed in 9455871c93 a week later; the README figure was not rerun)",
        "activation_checkpointing": "full (checkpoint_wrapper on every block)", "compile": False, "float8": False, "async_tp": False,
        "framework": {"name": "Lightning Fabric ModelParallelStrategy", "commit": "0c8a193d3c"},
        "torch_version": "2.3 (assumed)",
        "metric": "max_memory_reserved", "metric_definition": "torch.cuda.max_memory_reserved() over the whole process",
        "rank": "rank 0", "value_published": "17.95 GB", "value_bytes": 17_950_000_000,
        "unit_conversion": "/ 1e9 printed as 'GB' (decimal): value_bytes = 17.95e9",
        "gaps": common_gaps + ["8 iterations (128 samples / 2 DP ranks / batch 8)",
                               "that the run printing 17.95 GB used this buggy order is inferred from the README's commit "
                               "(0c8a193d3c) and the 26.95e9 B that params, grads and AdamW state would need (13.48e9 B for AdamW state alone); it was not rerun"],
        "stack_differences": diffs,
        "reproducibility": "C",
        "can_check": "a forward/backward-only protocol (gradients kept, no optimizer state) under TP x FSDP2; "
                     "NOT a normal training step: do not compare with an AdamW estimate",
    })
    return recs


def megatron():
    recs = []
    gpt7b_model = {
        "config_class": None,
        "megatron_args": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "group_query_attention": True,
                          "num_query_groups": 8, "ffn_hidden_size": "4 x hidden = 16384 (default)", "activation": "GeLU (default)",
                          "normalization": "LayerNorm (default)", "position_embedding_type": "learned_absolute (default)",
                          "add_bias_linear": "True (default)", "attention_dropout": 0.1, "hidden_dropout": 0.1,
                          "untie_embeddings_and_output_weights": True, "vocab_size": "131073 padded to a multiple of 128 x TP",
                          "max_position_embeddings": 8192},
        "name": "Megatron-core GPT, '7B' functional test shape",
        "code": "megatron/core GPTModel with Transformer Engine layers (--transformer-impl transformer_engine)",
        "hf_equivalent": "none: no transformers class has GQA with learned absolute positions, GeLU 4h MLP and biases",
    }
    mg_diffs = [
        "Megatron-core engine, not torch FSDP2/DTensor/pipelining: Transformer Engine fused kernels (fused attention, "
        "LayerNorm-linear fusion), Megatron's own TP (column/row parallel linears) and PP schedules",
        "distributed optimizer (ZeRO-1-like): fp32 main params and Adam state sharded over DP; bf16 params; fp32 "
        "contiguous gradient buffer (main_grad) with overlap-grad-reduce / overlap-param-gather buckets",
        "dropout 0.1 on attention and hidden states (masks saved)",
    ]
    mg_gaps = [
        "GPU count from the recipe (tests/test_utils/recipes/h100/gpt.yaml: nodes 1, gpus 8), so DP = 8 / (TP x PP) = 2",
        "the figure is the tensorboard writer's rank only: global rank world_size-1 (megatron/training/global_vars.py), "
        "i.e. the last pipeline stage / last TP rank; other ranks are not published",
        "the container (torch, TE, cuDNN versions) is the CI's 'dev' image of the golden values' date, not recorded in the repo",
        "mem-max-allocated-bytes is allocated_bytes.all.peak, never reset: the value from step 2 on includes the first "
        "optimizer step's lazy allocation",
    ]
    for test, tp, pp, vpp, mb, vals in (
        ("gpt3_7b_tp4_pp1_memory_speed", 4, 1, None, 2,
         {"h100": (20663519232, 57143791616, 50289487872, 1), "a100": (20634103808, 58188115968, 51333926912, 5)}),
        ("gpt3_7b_tp1_pp4_memory_speed", 1, 4, 8, 1,
         {"h100": (24808996864, 60720852992, 52931256320, 1), "a100": (24510808064, 60489064448, 52700401664, 5)}),
    ):
        path = f"tests/functional_tests/test_cases/gpt/{test}"
        for plat, (cur, peak, peak1, every) in vals.items():
            for metric, v, key in (("max_memory_allocated", peak, "mem-max-allocated-bytes"),
                                   ("memory_allocated_after_step", cur, "mem-allocated-bytes")):
                recs.append({
                    "id": f"mcore-gpt7b-tp{tp}-pp{pp}" + (f"-vpp{vpp}" if vpp else "") + f"-{plat}-{'peak' if metric.startswith('max') else 'after-step'}",
                    "source": {"url": f"https://github.com/{MG_REPO}/tree/{MG_COMMIT}/{path}", "repo": MG_REPO,
                               "path": f"{path}/golden_values_dev_dgx_{plat}.json and model_config.yaml", "commit": MG_COMMIT,
                               "quote": f"\"{key}\": {{\"start_step\": 1, \"end_step\": 25, \"step_interval\": {every}, \"values\": {{... \"25\": {float(v)}}}}} "
                                        + (f"(the same at every logged step after the first; step 1: {float(peak1)})" if metric.startswith("max")
                                           else "(the same at every logged step)")},
                    "model": gpt7b_model,
                    "gpus": {"count": 8, "type": "DGX H100 (80 GB)" if plat == "h100" else "DGX A100 (80 GB)"},
                    "layout": {"dp": 8 // (tp * pp), "tp": tp, "sequence_parallel": False, "pp": pp,
                               "pp_schedule": ("interleaved 1F1B, 8 virtual stages of 1 layer per rank" if vpp else None),
                               "microbatches": 8 // (mb * (8 // (tp * pp))), "cp": 1, "ep": 1},
                    "local_batch": mb, "global_batch": 8, "seq_len": 8192,
                    "precision": "bf16 (Megatron --bf16: bf16 params/activations, fp32 main params, fp32 grad accumulation)",
                    "optimizer": "Megatron distributed Adam (wd 0.01, clip 1.0)",
                    "activation_checkpointing": "none",
                    "compile": False, "float8": False, "async_tp": False,
                    "framework": {"name": "Megatron-LM (mcore + Transformer Engine)", "commit": MG_COMMIT},
                    "torch_version": "unknown (NVIDIA PyTorch container of the CI's 'dev' environment)",
                    "metric": metric,
                    "metric_definition": ("torch.cuda.memory_stats()['allocated_bytes.all.peak'] logged as mem-max-allocated-bytes"
                                          if metric.startswith("max") else
                                          "torch.cuda.memory_stats()['allocated_bytes.all.current'] at the log point after "
                                          "the optimizer step (mem-allocated-bytes): the resident weights, grad buffers and optimizer shards"),
                    "rank": "global rank 7 (last)",
                    "value_published": f"{int(v)} bytes", "value_bytes": int(v),
                    "unit_conversion": "exact bytes as logged (float in the JSON)",
                    "gaps": mg_gaps,
                    "stack_differences": mg_diffs,
                    "reproducibility": "C",
                    "can_check": "exact-byte, exact-config per-rank TP and (interleaved) PP figures; memcheck could only "
                                 "compare its layout arithmetic (e.g. the after-step static bytes) through a hand-built HF "
                                 "stand-in, since the architecture and engine differ",
                })
    mx = "tests/functional_tests/test_cases/mixtral/mixtral_8x7b_tp1pp4ep8vpp8_release"
    for metric, v, key in (("max_memory_allocated", 35505844224, "mem-max-allocated-bytes"),
                           ("memory_allocated_after_step", 19743387648, "mem-allocated-bytes")):
        recs.append({
            "id": f"mcore-mixtral-8x7b-tp2-pp4-ep8-vpp8-h100-{'peak' if metric.startswith('max') else 'after-step'}",
            "source": {"url": f"https://github.com/{MG_REPO}/tree/{MG_COMMIT}/{mx}", "repo": MG_REPO,
                       "path": f"{mx}/golden_values_dev_dgx_h100.json and model_config.yaml", "commit": MG_COMMIT,
                       "quote": f"\"{key}\": {{\"start_step\": 1, \"end_step\": 200, \"step_interval\": 5, \"values\": {{... \"200\": {float(v)}}}}} "
                                + ("(the largest logged value; step 1: 29394774016.0, step 5: 35408363520.0, step 10: "
                                   "35420778496.0: the peak creeps up with the routing)" if metric.startswith("max")
                                   else "(the same at all 41 logged steps)")},
            "model": {"config_class": "MixtralConfig", "kwargs": {
                "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
                "name": "Mixtral-8x7B (Megatron-core MoE, Llama2Tokenizer vocab 32000)",
                "code": "megatron/core GPTModel + MoE (grouped GEMM, alltoall dispatcher), Transformer Engine"},
            "gpus": {"count": "unknown (>= 32: TP2 x PP4 x EP8/ETP1 needs 32 | world size)", "type": "DGX H100"},
            "layout": {"tp": 2, "sequence_parallel": True, "pp": 4, "pp_schedule": "interleaved 1F1B, 8 virtual stages of 1 layer per rank",
                       "ep": 8, "etp": 1, "cp": 1, "dp": "unknown"},
            "local_batch": 1, "global_batch": 256, "seq_len": 4096,
            "precision": "bf16 (fp32 main params and grads)", "optimizer": "Megatron distributed Adam (betas 0.9/0.95, wd 0.1)",
            "activation_checkpointing": "none", "compile": False, "float8": False, "async_tp": False,
            "framework": {"name": "Megatron-LM (mcore MoE + TE)", "commit": MG_COMMIT},
            "torch_version": "unknown (CI container)",
            "metric": metric, "metric_definition": "as for the mcore-gpt7b records (last global rank)",
            "rank": "last global rank", "value_published": f"{int(v)} bytes", "value_bytes": int(v),
            "unit_conversion": "exact bytes as logged",
            "gaps": ["GPU count and DP degree not in the test case and the recipe no longer lists the test; the mirror's "
                     "history could not be read to find it", "--finetune from a checkpoint (same shapes)",
                     "the router's token distribution (per-expert activation sizes) is data-dependent"] + mg_gaps[1:],
            "stack_differences": mg_diffs[:2] + ["MoE: alltoall token dispatcher, grouped GEMM, aux loss 1e-2; "
                                                 "memcheck's EP would need the routing assumption of the MoE work"],
            "reproducibility": "C",
            "can_check": "EP x TP x interleaved PP on an HF-available architecture (MixtralConfig), only once the GPU count is known",
        })
    return recs


TT773_URL = "https://github.com/pytorch/torchtitan/issues/773"
TT773_COMMIT = "90567fc9827ffdf17bdd0349cd5276c662d0769a"  # torchtitan main just before the 2025-01-10 runs (settings read here)


def tt773():
    """torchtitan issue #773: per-rank logs of pure pipeline parallelism (eager), and the 405B zero-bubble run."""
    recs = []
    pp8_gaps = [
        "the comment gives batch_size 16, seq_len 512, pipeline_parallel_degree 8 and the schedule; the rest is the "
        "llama3_8b.toml and torchtitan defaults of that week (read at " + TT773_COMMIT[:8] + ")",
        "GPU count and data-parallel degree NOT known. On 8 GPUs (PP 8 and nothing else) dp_shard would be 1, torchtitan "
        "would apply no FSDP and so no mixed precision (parallelize_llama.py @ 90567fc9 calls fully_shard only when "
        "dp_shard or cp is enabled): float32 parameters, gradients and AdamW state. That reading is contradicted by "
        "the figures: rank 0 (embedding 525,336,576 + 4 layers x 218,112,000 parameters = 1,397,784,576) and rank 7 "
        "(4 layers + output 525,336,576 + norm = 1,397,788,672) would hold 1.398e9 x 16 B = 20.83 GiB of static state "
        "alone, above the published 15.86-22.74 GiB. The run therefore had fewer bytes per parameter (e.g. FSDP over "
        "more GPUs, or bf16 weights); which, is not published",
        "micro-batches: the default n_microbatches = total stages = 16 (2 stages per rank for looped schedules), so "
        "16 micro-batches of 1 x 512 tokens; split points generated: 2 layers per stage; rank r holds stages r and r+8 "
        "(rank 0: embedding + layers 0-1 and layers 16-17; rank 7: layers 14-15 and layers 30-31 + norm + output)",
        "GPU: 80 GB H100 inferred from the percentages (22.74 GiB = 28.73 % -> 79.15 GiB capacity)",
        "reading at step 4 (the log interval's peak reserved since the previous log)",
        "torch nightly of January 2025 (not named)",
        "two decimals of GiB: +-0.005 GiB",
    ]
    pp8_diffs = [
        "torchtitan's own Llama 3 8B code (RoPE via complex float32, logits cast to float32 in loss_fn)",
        "torch.distributed.pipelining ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble of January 2025 (the "
        "latter splits backward into input- and weight-gradient steps, holding the weight-gradient inputs longer)",
        "loss computed on the last stage only (rank 0 prints loss -1.0)",
    ]
    rows = [
        ("interleaved-1f1b", "Interleaved1F1B", "none (see gaps)", 0, 22.74, "[rank0]: ... step:  4  loss: -1.0000  memory: 22.74GiB(28.73%)  tps: 304"),
        ("interleaved-1f1b", "Interleaved1F1B", "none (see gaps)", 7, 17.97, "[rank7]: ... step:  4  loss: 12.1754  memory: 17.97GiB(22.71%)  tps: 304"),
        ("interleaved-zb", "InterleavedZeroBubble", "none (see gaps)", 0, 20.57, "PP8, interleaved zero bubble [rank0]: ... step:  4  loss: -1.0000  memory: 20.57GiB(25.99%)  tps: 339"),
        ("interleaved-zb", "InterleavedZeroBubble", "none (see gaps)", 7, 22.23, "PP8, interleaved zero bubble [rank7]: ... step:  4  loss: 12.1761  memory: 22.23GiB(28.09%)  tps: 339"),
        ("interleaved-1f1b-fullac", "Interleaved1F1B", "full (every block)", 0, 15.86, "**With full AC** PP8, interleaved 1f1b [rank0]: ... step:  4  loss: -1.0000  memory: 15.86GiB(20.04%)  tps: 243"),
    ]
    for tag, sched, ac, rank, gib, quote in rows:
        recs.append({
            "id": f"tt773-llama3-8b-pp8-{tag}-bs16-seq512-rank{rank}",
            "source": {"url": TT773_URL, "repo": TT_REPO, "commit": None,
                       "quote": "H-Huang, 2025-01-13: 'Llama3 8B / batch_size = 16 / seq_len = 512 / pipeline_parallel_degree = 8' ... " + quote},
            "model": dict(LLAMA31_8B, name="llama3_8b", code="torchtitan Llama 3 (torchtitan/models/llama/model.py, January 2025)"),
            "gpus": {"count": "unknown (>= 8)", "type": "H100 80 GB (inferred from the percentage)"},
            "layout": {"dp_shard": "unknown (1 on 8 GPUs)", "dp_replicate": 1, "tp": 1, "pp": 8, "pp_schedule": sched, "stages_per_rank": 2,
                       "microbatches": 16, "microbatch_size": 1, "cp": 1, "ep": 1},
            "local_batch": 16, "global_batch": "16 x DP degree", "seq_len": 512,
            "precision": "unknown (fp32 if no FSDP, which the figures contradict; see gaps)",
            "optimizer": "torch AdamW foreach (betas 0.9/0.95, wd 0.1)",
            "activation_checkpointing": ac,
            "compile": False, "float8": False, "async_tp": False,
            "framework": {"name": "torchtitan", "commit": "main of 2025-01-10 (not named; " + TT773_COMMIT[:8] + " read)"},
            "torch_version": "nightly, January 2025",
            "metric": "max_memory_reserved", "metric_definition": TT_METRIC[1].split(";")[0],
            "rank": f"rank {rank}", "value_published": f"{gib} GiB", "value_bytes": round(gib * GIB),
            "unit_conversion": "GiB (/ 2**30) with 2 decimals: value_bytes = round(x * 2**30)",
            "gaps": pp8_gaps + (["the first block of logs is not labelled; the comment's sentence ('without AC the TPS "
                                  "is fine') suggests activation checkpointing off, while the 8B toml's default was "
                                  "selective op"] if ac.startswith("none") else []),
            "stack_differences": pp8_diffs,
            "reproducibility": "C",
            "can_check": "per-rank PP memory of two schedules and two ranks (first stage vs last stage with the "
                         "128256-wide output), eager, on torch.distributed.pipelining: the differences between "
                         "ranks and schedules (e.g. zero bubble +4.26 GiB on rank 7, -2.17 GiB on rank 0 against "
                         "interleaved 1F1B) are usable once the data-parallel layout is pinned; the absolute figures are not",
        })
    recs.append({
        "id": "tt773-llama3.1-405b-fsdp8-tp8-pp8-interleaved-zb-eager",
        "source": {"url": TT773_URL, "repo": TT_REPO, "commit": None,
                   "quote": "tianyu-l, 2025-01-03: 'Here are benchmark results on on 512-GPU experiments ... \"Interleaved Zero Bubble\" : "
                            "memory: 89.73GiB(94.45%)  tps: 13 ... Note that for Zero Bubble, no torch.compile / async TP / Float8 is "
                            "used since not compatible.' (the same post gives 1F1B 82.46GiB and Interleaved1F1B 72.69GiB, Table 5's 82.5 and 72.7)"},
        "model": dict(LLAMA31_405B, name="llama3_405b", code="torchtitan Llama 3 @ 9dec370"),
        "gpus": {"count": 512, "type": TT_GPU},
        "layout": {"dp_shard": 8, "dp_replicate": 1, "tp": 8, "sequence_parallel": True, "pp": 8,
                   "pp_schedule": "InterleavedZeroBubble", "stages_per_rank": 2, "microbatches": "8 (9dec370's default) or 16",
                   "cp": 1, "ep": 1},
        "local_batch": 32, "global_batch": 256, "seq_len": 8192,
        "precision": "bf16 FSDP2 mixed precision, fp32 reduce", "optimizer": "torch AdamW foreach (betas 0.9/0.95, wd 0.1)",
        "activation_checkpointing": "full (Table 5's setting, assumed)",
        "compile": False, "float8": False, "async_tp": False,
        "framework": {"name": "torchtitan", "commit": TT_RUN_COMMIT + " (assumed: same study as Table 5)"},
        "torch_version": TT_TORCH + " (assumed)",
        "metric": "max_memory_reserved", "metric_definition": TT_METRIC[1],
        "rank": "max over all ranks (assumed, as Table 5)", "value_published": "89.73 GiB", "value_bytes": round(89.73 * GIB),
        "unit_conversion": "GiB (/ 2**30) with 2 decimals",
        "gaps": ["only Table 5's settings are implied ('512-GPU experiments'); micro-batch count, split points and AC are "
                 "not restated for this run", "94.45 % of the card: near the limit, allocator retries likely shape the figure"],
        "stack_differences": TT_MODEL_CODE_NOTES + ["eager TP (no async TP), bf16 (no float8): closer to memcheck's stack "
                                                    "than Table 5's two rows, but the 1F1B/Interleaved rows it sits beside are compiled"],
        "reproducibility": "C",
        "can_check": "a 4D-scale FSDP x TP x PP zero-bubble figure in eager mode; only with its unstated settings pinned",
    })
    return recs


def main() -> None:
    records = torchtitan_2412() + tt165() + tt773() + lightning() + megatron()
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "duplicate ids"
    OUT.mkdir(exist_ok=True)
    for old in OUT.glob("*.json"):
        old.unlink()
    for r in records:
        (OUT / f"{r['id']}.json").write_text(json.dumps(r, indent=1) + "\n")
    print(f"{len(records)} records written to {OUT}")


if __name__ == "__main__":
    main()
