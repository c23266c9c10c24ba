"""memcheck's DeepSpeed mapping against DeepSpeed's own parser (issue 21): each config below is read by
``memcheck.workloads.deepspeed.read_deepspeed`` and by DeepSpeed 0.19.8's ``DeepSpeedConfig`` at the
same world size, and the micro-batch, accumulation, ZeRO stage, precision mode, offload and bucket
sizes compared (or both refusals). Not a test: it needs DeepSpeed, which memcheck does not depend on.

    python -m venv --system-site-packages /tmp/dsvenv
    /tmp/dsvenv/bin/pip install wheel setuptools
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install --no-build-isolation deepspeed==0.19.8
    /tmp/dsvenv/bin/python benchmarks/deepspeed_config_parity.py     # from the repository root

2026-11-26, DeepSpeed 0.19.8 (CPU accelerator), torch 2.13: all 13 configs agree.
"""
import json
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from deepspeed.runtime.config import DeepSpeedConfig
from memcheck.workloads.deepspeed import read_deepspeed
import deepspeed.comm as dist  # noqa: E402

cases = [
    ("examples/ds_zero3.json", 8),
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}, 2),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}, 4),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}, 4),
    ({"train_batch_size": 32, "zero_optimization": {"stage": 3}}, 8),
    ({"train_batch_size": 96, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 8),
    ({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 1e6, "stage3_max_live_parameters": 3e8}}, 4),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": True}, 2),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "cpu_offload": True}}, 2),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 4),  # both refuse
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 1}}, 2),  # both refuse
    ({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, 2),
    ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "not_a_key": 3}, 2),  # both accept
]
ok = True
for cfg, world in cases:
    name = cfg if isinstance(cfg, str) else json.dumps(cfg)[:90]
    data = json.loads((ROOT / cfg).read_text()) if isinstance(cfg, str) else cfg
    if isinstance(cfg, str):  # the HF Trainer fills its autos first (hidden 768)
        data = json.loads(json.dumps(data).replace('"reduce_bucket_size": "auto"', '"reduce_bucket_size": 589824').replace('"stage3_prefetch_bucket_size": "auto"', '"stage3_prefetch_bucket_size": 530841').replace('"stage3_param_persistence_threshold": "auto"', '"stage3_param_persistence_threshold": 7680'))
    with mock.patch.object(dist, "get_rank", return_value=0), mock.patch.object(dist, "get_world_size", return_value=world):
        try:
            c = DeepSpeedConfig(json.loads(json.dumps(data)))
            ds = dict(micro_batch=c.train_micro_batch_size_per_gpu, accumulation=c.gradient_accumulation_steps,
                      stage=int(c.zero_optimization_stage), bf16=c.bfloat16_config.enabled, fp16=c.float16_config.enabled,
                      offload_opt=str(c.zero_config.offload_optimizer.device) if c.zero_config.offload_optimizer else None,
                      offload_param=str(c.zero_config.offload_param.device) if c.zero_config.offload_param else None,
                      reduce=c.zero_config.reduce_bucket_size, prefetch=c.zero_config.prefetch_bucket_size,
                      live=c.zero_config.max_live_parameters)
        except Exception as e:
            ds = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    try:
        r = read_deepspeed(data, gpus=world)
        s = r.settings
        mine = dict(micro_batch=s["micro_batch"], accumulation=s["accumulation"], strategy=s["strategy"],
                    precision=s.get("precision", "fp32"), offload=s.get("offload"), reduce=s.get("reduce_bucket_size"),
                    prefetch=s.get("prefetch_bucket_size"), live=s.get("max_live_parameters"))
    except Exception as e:
        mine = f"refused: {e}"[:120]
    agree = None
    if isinstance(ds, dict) and isinstance(mine, dict):
        stage_ok = mine["strategy"] == (f"zero{ds['stage']}" if ds["stage"] else mine["strategy"])
        prec = "bf16" if ds["bf16"] else "fp16" if ds["fp16"] else "fp32"
        off = "params" if "cpu" in str(ds["offload_param"]) and ds["stage"] == 3 else "optimizer" if "cpu" in str(ds["offload_opt"]) else None
        agree = (mine["micro_batch"] == ds["micro_batch"] and mine["accumulation"] == ds["accumulation"] and stage_ok
                 and mine["precision"] == prec and mine["offload"] == off
                 and (mine["reduce"] in (None, ds["reduce"])) and (mine["prefetch"] in (None, ds["prefetch"]))
                 and (mine["live"] in (None, ds["live"])) and (ds["stage"] < 1 or mine["reduce"] is None or mine["reduce"] == ds["reduce"]))
    else:
        agree = isinstance(ds, str) and isinstance(mine, str)
    ok &= bool(agree)
    print("AGREE" if agree else "DIFFER", name, "\n   deepspeed:", ds, "\n   memcheck: ", mine)
print("all agree" if ok else "some differ")
sys.exit(0 if ok else 1)
