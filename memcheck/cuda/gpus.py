"""The GPUs memcheck can estimate for, and detection of the local one.

A :class:`GpuSpec` carries what a fit check needs: the memory CUDA reports for the
card, its compute capability (rules pick kernels by it) and the device memory the
CUDA context takes outside PyTorch's caching allocator.

``capacity_bytes`` is the total that ``torch.cuda.mem_get_info()[1]`` (cudaMemGetInfo)
reports. On recent drivers ``nvidia-smi --query-gpu=memory.total`` shows somewhat
more than that (the driver's reserved memory is inside it: H100 81559 MiB against
CUDA's ~81089 MiB), so the table holds CUDA's figure where a published
``torch.cuda.get_device_properties()`` printout gives it, and the nvidia-smi figure
(marked) where none was found.

Nothing here initialises CUDA: :func:`local_gpu` asks ``nvidia-smi`` in a
subprocess, so a later ``torch.cuda`` call in this process is unaffected.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import torch

from memcheck.errors import UsageError, closest
from memcheck import units
from memcheck.units import MAX_BYTES, GiB, KiB, MiB, parse_size

# --- the CUDA context ------------------------------------------------------------------
# memcheck's context figure is what a training process holds on the GPU outside the caching
# allocator after a first training step, with lazy module loading (torch's default):
#
#     context = bare context + the kernel images a training step loads lazily
#
# The bare context is what a process holds once CUDA is initialised and before any kernel
# ran (driver state, the per-thread stacks, torch's registered modules). It is published for
# one GPU of the table (the RTX 3090 row below). Published bare figures outside the table:
# 426 MiB on an RTX 6000 Ada, torch 2.10.0+cu130, nvidia-smi after torch.cuda.mem_get_info(0)
# (unslothai/unsloth-zoo#1053); ~300-400 MB with lazy module loading (ptrblck in
# pytorch/pytorch#107667 and #109888).
#
# Published EAGER contexts are not used per GPU. V100-SXM2-16GB: "GPU memory occupied: 1343 MB"
# (NVML used, MiB) after torch.ones((1, 1)).to("cuda") (huggingface/transformers
# docs/source/en/model_memory_anatomy.md, driver 460.91.03, CUDA 11.2, Jan 2022), less the
# 2 MiB allocator segment = 1341 MiB. RTX 3090: 1644 MiB in nvidia-smi holding a
# 64x16x200x200 fp32 tensor, torch 1.7.1+cu110 (pytorch/pytorch#49877), less its 158 MiB
# segment (163,840,000 B rounded up to 2 MiB) = 1486 MiB; the same card showed 1687 MB with
# torch 1.8.2+cu111 after torch.Tensor(1).cuda() (pytorch/pytorch#55277), 1687 - 2 = 1685 MiB.
# They are torch 1.7-1.10 on CUDA 11.0-11.2, before lazy loading existed, and one card's two
# figures differ by about 200 MiB (1685 against 1486) between torch versions, so they say
# little about torch 2.13 under CUDA_MODULE_LOADING=EAGER; there memcheck adds the measured
# eager-minus-lazy difference instead (memcheck.cuda.overhead.EAGER_EXTRA_BYTES).
#
# Where no bare figure is published it is estimated. The driver reserves a per-thread stack
# (cudaLimitStackSize, 1 KiB by default) for every thread the SMs can hold, so:
#
#     bare context (estimated) = BARE_CONTEXT_BASE + SMs x max resident threads per SM x 1 KiB
#
# BARE_CONTEXT_BASE is set so that the rule gives the one published bare figure of a table
# GPU: RTX 3090, 256 MiB - 82 SMs x 1536 threads x 1 KiB (123 MiB) = 133 MiB. On the RTX 6000
# Ada (142 SMs x 1536 threads, not in the table) the rule gives 133 + 213 = 346 MiB against
# the published 426 MiB (torch 2.10+cu130): it is 19% low there.
#
# The kernels a training step loads (torch's own, cuBLAS/cuBLASLt, cuDNN) are not published
# for any GPU; STEP_KERNELS_BYTES is an estimate, and the part of memcheck's earlier single
# 320 MiB base that is not the bare base (133 + 187 = 320 MiB), so estimated GPUs keep their
# earlier figures. cuBLAS workspaces are not in it: they are caching-allocator blocks
# (memcheck.cuda.overhead.workspace_allocations).
STACK_PER_THREAD = 1 * KiB  # cudaLimitStackSize default (CUDA runtime API docs)
BARE_CONTEXT_BASE = 133 * MiB  # estimate: RTX 3090's published 256 MiB bare context less its 123 MiB of stacks
STEP_KERNELS_BYTES = 187 * MiB  # estimate, unmeasured: kernels a first training step loads lazily
GENERIC_CONTEXT_BYTES = 512 * MiB  # estimate for a GPU outside the table (about an A100's)
GENERIC_CONTEXT_SOURCE = "estimated: 512 MiB for a GPU outside the table (about an A100's)"
GIVEN_CONTEXT_SOURCE = "given: context_bytes passed to GpuSpec"


@dataclass(frozen=True)
class GpuSpec:
    """A target GPU.

    Attributes:
        name: the table name (``"H100-80GB"``), or a description for an unlisted GPU.
        capacity_bytes: total device memory as CUDA reports it (``torch.cuda.mem_get_info()[1]``).
        arch: compute capability, e.g. ``(9, 0)``.
        context_bytes: device memory the CUDA context and libraries take outside the
            caching allocator after a first training step, lazy module loading (see
            the module notes).
        named: True for a row of :data:`GPUS`; False for a GPU given by size or an
            unlisted local GPU, whose context (and, for sizes, arch) are generic guesses.
        context_source: where ``context_bytes`` comes from: ``"published: <source>"``
            when a measurement of this GPU's bare context was published (plus memcheck's
            estimate of what it leaves out), ``"estimated: <rule>"`` otherwise, or
            ``"given: ..."`` for a spec built by hand.
    """

    name: str
    capacity_bytes: int
    arch: tuple[int, int]
    context_bytes: int
    named: bool = True
    context_source: str = GIVEN_CONTEXT_SOURCE

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"GPU name {self.name!r} must be a non-empty string")
        if not isinstance(self.capacity_bytes, int) or not 0 < self.capacity_bytes <= MAX_BYTES:
            raise UsageError(f"GPU capacity {self.capacity_bytes!r} must be a positive number of bytes, "
                             "at most 1 PiB (2**50)")
        if not isinstance(self.context_bytes, int) or not 0 <= self.context_bytes <= MAX_BYTES:
            raise UsageError(f"GPU context size {self.context_bytes!r} must be a non-negative number of bytes, "
                             "at most 1 PiB (2**50)")
        if not isinstance(self.context_source, str) or not self.context_source.strip():
            raise UsageError(f"GPU context source {self.context_source!r} must be a non-empty string")
        arch = tuple(self.arch)
        if len(arch) != 2 or not all(isinstance(v, int) and v >= 0 for v in arch):
            raise UsageError(f"GPU compute capability {self.arch!r} must be two integers, such as (8, 0)")
        object.__setattr__(self, "arch", arch)

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can reserve: capacity less the context."""
        return self.capacity_bytes - self.context_bytes


@dataclass(frozen=True)
class _Row:
    name: str
    cuda_mib: int  # capacity_bytes / MiB
    smi_mib: int  # nvidia-smi memory.total, to recognise the card in local_gpu()
    arch: tuple[int, int]
    sms: int
    threads_per_sm: int  # max resident threads per SM (CUDA programming guide, table by arch)
    pattern: str  # regex on the lower-cased nvidia-smi name
    # A published bare CUDA context for this GPU (MiB, as nvidia-smi shows a process that
    # initialised CUDA and ran no kernel, lazy module loading), and a short citation: where,
    # which torch, which loading (the full conditions go in the comment above the row).
    bare_context_mib: int | None = None
    bare_context_source: str = ""
    # A whole context measured here (MiB: the driver's used memory less the allocator's reserved
    # memory, after training steps), which replaces bare + step kernels; and its citation.
    context_mib: int | None = None
    context_source: str = ""


def _context(row: _Row) -> tuple[int, str]:
    """``(context_bytes, context_source)`` of a table row: its published bare context, or
    the estimated one, plus the estimated kernels a training step loads."""
    step = f"{STEP_KERNELS_BYTES // MiB} MiB step kernels (estimated)"
    if row.context_mib is not None:
        return row.context_mib * MiB, row.context_source
    if row.bare_context_mib is not None:
        return (row.bare_context_mib * MiB + STEP_KERNELS_BYTES,
                f"published: {row.bare_context_mib} MiB bare ({row.bare_context_source}) + {step}")
    stacks = row.sms * row.threads_per_sm * STACK_PER_THREAD
    return (BARE_CONTEXT_BASE + stacks + STEP_KERNELS_BYTES,
            f"estimated: {BARE_CONTEXT_BASE // MiB} MiB + {row.sms} SMs x {row.threads_per_sm} threads x 1 KiB "
            f"+ {step}")


# Sources for cuda_mib: "torch" = a published torch.cuda.get_device_properties() printout
# (total_memory, in MiB); "smi" = nvidia-smi memory.total, used where no CUDA figure was
# found (CUDA's total can be ~2% lower: A10G 22587 vs 23028, L40S 45589 vs 46068).
# SM counts from NVIDIA's product briefs; a printout's multi_processor_count agrees where shown.
# "smi (text search)": a published nvidia-smi printout found by exact-text search of public
# repositories, whose repository was not recorded; several independent files agree on each figure.
_ROWS = (
    # torch: 'Tesla V100-SXM2-16GB' total_memory=16160MB (ultralytics yolov5 logs); smi shows 16160 too
    _Row("V100-16GB", 16160, 16160, (7, 0), 80, 2048, r"v100"),
    # smi: 'Tesla V100-SXM2/PCIE 32GB' 32510MiB; on Volta smi's total equals CUDA's (cf. 16GB)
    _Row("V100-32GB", 32510, 32510, (7, 0), 80, 2048, r"v100"),
    # torch: 'Tesla T4' total_memory=15102MB (Colab; 15079-15109 across drivers); smi 15360 (ECC on)
    _Row("T4", 15102, 15360, (7, 5), 40, 1024, r"\bt4\b"),
    # torch: 'NVIDIA A10G' total_memory=22587MB; smi 23028
    _Row("A10G", 22587, 23028, (8, 6), 80, 1536, r"a10g"),
    # torch: 'NVIDIA GeForce RTX 3090' total_memory=24259MB (24268 on older drivers); smi 24268-24576.
    # Bare context: invoke-ai/InvokeAI#9413 (2x RTX 3090, torch 2.7.1+cu128, driver 610.43.03):
    # "InvokeAI allocates a CUDA context on a GPU at startup, before any generation has been
    # requested ... On this host that is a flat 256 MiB" (nvidia-smi per process); the fix,
    # invoke-ai/InvokeAI#9447, traced it to torch.cuda.mem_get_info() at startup, so no kernel
    # had run. torch sets CUDA_MODULE_LOADING=LAZY when unset (pytorch#86509): lazy loading.
    _Row("RTX-3090", 24259, 24576, (8, 6), 82, 1536, r"3090(?!\s*ti)", bare_context_mib=256,
         bare_context_source="invoke-ai/InvokeAI#9413, torch 2.7.1+cu128, lazy"),
    # torch: 'NVIDIA GeForce RTX 4090' total_memory=24563MB; smi 24564
    # smi (text search): 'NVIDIA GeForce RTX 4080, 16376 MiB' (e.g. Ultralytics log, torch 2.5.1+cu121;
    # driver 596.49; 535.86.10). AD103, 76 SMs, capability 8.9 (Ada whitepaper, appendix).
    _Row("RTX-4080", 16376, 16376, (8, 9), 76, 1536, r"4080"),
    _Row("RTX-4090", 24563, 24564, (8, 9), 128, 1536, r"4090"),
    # CUDA: deviceQuery on 'NVIDIA GeForce RTX 5090' (NVIDIA/nccl#1637, CUDA 12.8): "32120 MBytes
    # (33680457728 bytes)" = 32120.19 MiB, 170 multiprocessors, 1536 threads per multiprocessor,
    # capability 12.0 (another card: 33677180928 B, aikitoria/open-gpu-kernel-modules#1); smi 32607
    # (noonghunna/club-3090#617, driver 595.71.05). The datasheet's 32 GB of GDDR7.
    _Row("RTX-5090", 32120, 32607, (12, 0), 170, 1536, r"5090"),
    # smi only: 'NVIDIA RTX A6000' 49140 MiB (noonghunna/club-3090#1047, driver 580.173.02); no CUDA
    # figure found. 84 SMs: the RTX Blackwell whitepaper's table (RTX A6000 / RTX 6000 Ada / RTX PRO
    # 6000: 84 / 142 / 188 SMs, quoted in NVIDIA/cudnn-frontend#1164); GA102, capability 8.6.
    _Row("RTX-A6000", 49140, 49140, (8, 6), 84, 1536, r"rtx a6000"),
    # CUDA: deviceQuery on 'NVIDIA L4' (bottlerocket-os/bottlerocket-kernel-kit#139, driver CUDA 12.2,
    # runtime 12.8): "22491 MBytes (23583784960 bytes)" = 22491.25 MiB, 58 multiprocessors, capability
    # 8.9; smi 23034 (modal-labs/modal-client#2797).
    _Row("L4", 22491, 23034, (8, 9), 58, 1536, r"\bl4\b"),
    # smi (text search): 'NVIDIA L40, 46068 MiB' (drivers 570.0, 610.57.04; PyTorch 2.10 NGC container);
    # no CUDA figure found. 142 SMs: the L40 datasheet's 18,176 CUDA cores / 128 per SM (AD102).
    _Row("L40", 46068, 46068, (8, 9), 142, 1536, r"\bl40\b"),
    # smi (text search): 'NVIDIA A40, 46068 MiB' (drivers 550.90.07, 570.10). 84 SMs: the A40
    # datasheet's 10,752 CUDA cores / 128 per SM (GA102), capability 8.6.
    _Row("A40", 46068, 46068, (8, 6), 84, 1536, r"\ba40\b"),
    # torch: 'NVIDIA L40S' total_memory=45589MB; smi 46068
    _Row("L40S", 45589, 46068, (8, 9), 142, 1536, r"l40s"),
    # CUDA: 'A100-SXM4-40GB' total_memory=40536MB (cudaGetDeviceProperties via paddle docs); smi 40960
    _Row("A100-40GB", 40536, 40960, (8, 0), 108, 2048, r"a100"),
    # CUDA: deviceQuery on 'A100-SXM4-80GB' "79.15 GB" of global memory = ~81049 MiB; smi 81920
    _Row("A100-80GB", 81049, 81920, (8, 0), 108, 2048, r"a100"),
    # torch: 'NVIDIA H100 80GB HBM3' total_memory=81089MB (torch 2.7/cu12.8; 81082-81090); smi 81559.
    # Context: the H200's measured figure (below): the same GH100 chip, 132 SMs and driver; not
    # measured on an H100.
    _Row("H100-80GB", 81089, 81559, (9, 0), 132, 2048, r"h100(?!\s*(pcie|nvl))", context_mib=767,
         context_source="estimated: 767 MiB measured on an H200 (same GH100 chip, 132 SMs); not measured on an H100"),
    # smi (text search): 'NVIDIA H100 PCIe, 81559 MiB' (drivers 535.216.03, 570.211.01; torch 2.5.1);
    # no CUDA figure found. 114 SMs (NVIDIA's H100 SXM/PCIe table: 132 / 114 SMs, as quoted by
    # archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html). Context: the H200's measured 767 MiB
    # (same GH100 chip) less the stacks of its 18 fewer SMs (18 x 2048 threads x 1 KiB = 36 MiB).
    _Row("H100-PCIe", 81559, 81559, (9, 0), 114, 2048, r"h100\s*pcie", context_mib=731,
         context_source="estimated: 767 MiB measured on an H200 less 18 fewer SMs' stacks (36 MiB); "
                        "not measured on an H100 PCIe"),
    # smi only: 'NVIDIA H100 NVL' 95830 MiB (NVIDIA/gpu-admin-tools#4, driver 535.183.01); no CUDA
    # figure found. 132 SMs: fastfetch-cli/fastfetch#1658 reports 16,896 cores per H100 NVL = 132 SMs x
    # 128 FP32 cores (Hopper whitepaper: 128 per SM). Context borrowed from the H200 as the H100-80GB's.
    _Row("H100-NVL", 95830, 95830, (9, 0), 132, 2048, r"h100\s*nvl", context_mib=767,
         context_source="estimated: 767 MiB measured on an H200 (same GH100 chip, 132 SMs); not measured on an "
                        "H100 NVL"),
    # torch: 'NVIDIA H200' total_memory=143156MB (cudaMemGetInfo gave 150109880320 B = 143155.9 MiB
    # here); smi 143771. Context measured by benchmarks/gpu_accuracy.py on 2026-11-26 (torch
    # 2.11.0+cu130, cuDNN 9.19, driver 580.159.04, lazy loading; results in
    # benchmarks/results/NVIDIA_H200-2026-11-26-run): cudaMemGetInfo's used memory less
    # max_memory_reserved after 3 training steps was 766.8 MiB in 20 of 27 runs (every bf16/fp16
    # run and the convolutional ones), 750.8-752.8 MiB in the 6 fp32 runs without cuDNN, 768.8 MiB
    # once. The estimate it replaces (133 + 264 MiB of stacks + 187 MiB of step kernels = 584 MiB)
    # was 183 MiB low.
    # smi (text search): 'NVIDIA GH200 480GB, 97871 MiB' (Lambda, torch 2.7.0, CUDA 12.8, aarch64; driver
    # 580.95.05). The Grace Hopper superchip's 96 GB HBM3 GPU: the H100's GH100 with 132 SMs, so the
    # H200's measured context is borrowed as for the H100-80GB. The 144 GB HBM3e GH200 (146831 MiB)
    # is recognised as an H200 (143771 MiB, within 3%).
    _Row("GH200", 97871, 97871, (9, 0), 132, 2048, r"gh200", context_mib=767,
         context_source="estimated: 767 MiB measured on an H200 (same GH100 chip, 132 SMs); not measured on a GH200"),
    _Row("H200", 143156, 143771, (9, 0), 132, 2048, r"h200", context_mib=767,
         context_source="measured: 767 MiB after 3 training steps on an H200 (torch 2.11+cu130, driver 580; "
                        "benchmarks/results/NVIDIA_H200-2026-11-26.md)"),
    # torch: 'NVIDIA B200' total_memory=182631MB (torch 2.8/cu128; 182642 in another printout; a
    # cudaGetDeviceProperties dump in pytorch/ao#4002 gives 178.35 GiB, 148 SMs, 2048 threads per SM,
    # compute capability 10.0); smi 183359 (NVIDIA/TensorRT-LLM#10278)
    _Row("B200", 182631, 183359, (10, 0), 148, 2048, r"b200"),
)




# --- speed, for the planner's cost proxy -----------------------------------------------
@dataclass(frozen=True)
class Rates:
    """A GPU's datasheet rates, which the planner's cost proxy divides by (dense figures,
    no sparsity): FP32 on the CUDA cores, BF16/FP16 on the tensor cores with FP32
    accumulation (what PyTorch's matmuls use), and memory bandwidth."""

    fp32_flops: float  # FLOP/s
    tensor_flops: float  # FLOP/s, bf16 (fp16 where the GPU has no bf16)
    bandwidth: float  # bytes/s
    source: str


_T = 1e12
# Vendor datasheets, dense. GeForce cards run FP16/BF16 tensor math with FP32 accumulation at
# half their FP16-accumulate rate (Ampere and Ada whitepapers), which is the figure used. The
# A10G is AWS's A10 variant: NVIDIA publishes no sheet for it, so the A10's is used.
RATES = {
    "V100-16GB": Rates(15.7 * _T, 125 * _T, 900e9, "V100 SXM2 datasheet (fp16 tensor; no bf16)"),
    "V100-32GB": Rates(15.7 * _T, 125 * _T, 900e9, "V100 SXM2 datasheet (fp16 tensor; no bf16)"),
    "T4": Rates(8.1 * _T, 65 * _T, 320e9, "T4 datasheet (fp16 tensor; no bf16)"),
    "A10G": Rates(31.2 * _T, 125 * _T, 600e9, "A10 datasheet (the A10G is AWS's variant; not published)"),
    "RTX-3090": Rates(35.6 * _T, 71 * _T, 936e9, "GA102 whitepaper, fp32 accumulate"),
    "RTX-4080": Rates(48.7 * _T, 97.5 * _T, 716.8e9, "Ada whitepaper (AD103), fp32 accumulate"),
    "RTX-4090": Rates(82.6 * _T, 165.2 * _T, 1008e9, "AD102 whitepaper, fp32 accumulate"),
    # 838.4 TFLOPS sparse FP16 with FP16 accumulate (RTX Blackwell whitepaper) = 419 dense, halved for FP32
    # accumulate as on the other GeForce cards; 104.8 TFLOPS FP32, 1,792 GB/s.
    "RTX-5090": Rates(104.8 * _T, 209.5 * _T, 1792e9, "RTX Blackwell (GB202) whitepaper, fp32 accumulate"),
    # 309.7 TFLOPS sparse tensor = 154.8 dense (professional cards: full rate with FP32 accumulate).
    "RTX-A6000": Rates(38.7 * _T, 154.8 * _T, 768e9, "RTX A6000 datasheet (309.7 sparse / 2)"),
    "L4": Rates(30.3 * _T, 121 * _T, 300e9, "L4 datasheet"),
    # L40: 362.1 sparse bf16 = 181 dense (half the L40S's, as the datasheets show).
    "L40": Rates(90.5 * _T, 181 * _T, 864e9, "L40 datasheet (362.1 sparse / 2)"),
    "A40": Rates(37.4 * _T, 149.7 * _T, 696e9, "A40 datasheet (299.4 sparse / 2)"),
    "L40S": Rates(91.6 * _T, 362 * _T, 864e9, "L40S datasheet"),
    "A100-40GB": Rates(19.5 * _T, 312 * _T, 1555e9, "A100 datasheet"),
    "A100-80GB": Rates(19.5 * _T, 312 * _T, 2039e9, "A100 datasheet (SXM)"),
    "H100-80GB": Rates(67 * _T, 989 * _T, 3350e9, "H100 SXM datasheet"),
    "H100-PCIe": Rates(51 * _T, 756 * _T, 2000e9, "H100 PCIe datasheet (1,513 sparse / 2)"),
    "GH200": Rates(67 * _T, 989 * _T, 4000e9, "GH200 datasheet, 96 GB HBM3 (1,979 sparse / 2)"),
    "H100-NVL": Rates(60 * _T, 835 * _T, 3900e9, "H100 NVL datasheet (1,671 sparse / 2)"),
    "H200": Rates(67 * _T, 989 * _T, 4800e9, "H200 SXM datasheet"),
    "B200": Rates(75 * _T, 2250 * _T, 8000e9, "HGX B200 datasheet, per GPU (approximate)"),
}
A100_RATES = RATES["A100-80GB"]


def rates_for(gpu: GpuSpec | None) -> Rates:
    """The datasheet rates of a table GPU; an A100's for any other (a size, an unlisted card)."""
    if gpu is not None and gpu.named and gpu.name in RATES:
        return RATES[gpu.name]
    return A100_RATES


def _spec(row: _Row) -> GpuSpec:
    context, source = _context(row)
    return GpuSpec(row.name, row.cuda_mib * MiB, row.arch, context, context_source=source)


GPUS: dict[str, GpuSpec] = {r.name: _spec(r) for r in _ROWS}
# Rows whose capacity is nvidia-smi's memory.total, no CUDA figure having been found (see the rows'
# comments): CUDA's own may be ~2% lower.
SMI_CAPACITY = ("V100-32GB", "RTX-4080", "RTX-A6000", "L40", "A40", "H100-PCIe", "H100-NVL", "GH200")

_PREFIXES = ("nvidia", "geforce", "tesla", "quadro")


def _norm(text: str) -> str:
    """Lower-case, drop '-', '_' and spaces, and a leading vendor or product-line word."""
    key = re.sub(r"[-_\s]", "", text.lower())
    stripped = True
    while stripped:
        stripped = False
        for prefix in _PREFIXES:
            if key.startswith(prefix) and len(key) > len(prefix):
                key, stripped = key[len(prefix):], True
    return key


_BY_KEY = {_norm(name): name for name in GPUS}
# Unambiguous short names; a tuple lists the candidates of an ambiguous one.
_ALIASES: dict[str, str | tuple[str, ...]] = {
    "h100": "H100-80GB",
    "h100sxm": "H100-80GB",
    "h10080g": "H100-80GB",
    "3090": "RTX-3090",
    "4090": "RTX-4090",
    "5090": "RTX-5090",
    "4080": "RTX-4080",
    "a6000": "RTX-A6000",
    "h100nvl": "H100-NVL",
    "a10040g": "A100-40GB",
    "a10080g": "A100-80GB",
    "v10016g": "V100-16GB",
    "v10032g": "V100-32GB",
    "a100": ("A100-40GB", "A100-80GB"),
    "v100": ("V100-16GB", "V100-32GB"),
}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")


def sized_gpu(capacity_bytes: int) -> GpuSpec:
    """An unnamed GPU of the given capacity: arch sm80 assumed, generic context estimate."""
    return GpuSpec(
        name=f"{capacity_bytes / GiB:.1f} GiB GPU",
        capacity_bytes=capacity_bytes,
        arch=(8, 0),
        context_bytes=GENERIC_CONTEXT_BYTES,
        named=False,
        context_source=GENERIC_CONTEXT_SOURCE,
    )


def resolve_gpu(spec: str | GpuSpec | None) -> GpuSpec | None:
    """Turn a ``--gpu`` value into a :class:`GpuSpec`.

    Args:
        spec: a table name (``"H100-80GB"``), matched case-insensitively ignoring
            ``-``, ``_`` and spaces, or an unambiguous alias (``"h100"``, ``"3090"``);
            a memory size such as ``"24GiB"``, ``"80GB"`` or ``"80G"`` (units as
            :func:`memcheck.units.parse_size`: GiB/G binary, GB decimal), which gives an
            unnamed GPU with compute capability 8.0 (sm80) assumed for kernel choice and
            a generic context estimate; a ``GpuSpec``, returned as is; or None for
            :func:`local_gpu`.

    Returns:
        The spec, or None when ``spec`` is None and no local GPU is found.

    Raises:
        UsageError: for an unknown or ambiguous name or a malformed size, naming the
            value, the closest valid name and the allowed names.
    """
    if spec is None:
        return local_gpu()
    if isinstance(spec, GpuSpec):
        return spec
    text = str(spec).strip()
    key = _norm(text)
    if key in _BY_KEY:
        return GPUS[_BY_KEY[key]]
    alias = _ALIASES.get(key)
    if isinstance(alias, str):
        return GPUS[alias]
    if alias is not None:
        raise UsageError(f"GPU {spec!r} is ambiguous; use one of: {', '.join(alias)}")
    size = _SIZE.fullmatch(text)
    if size:
        if not size.group(2):
            raise UsageError(f"GPU memory {spec!r} needs a unit, such as 24GiB or 80GB")
        try:
            return sized_gpu(parse_size(text, what="GPU memory"))
        except UsageError:
            if float(size.group(1)) <= 0 or size.group(2).lower() in units.UNITS:  # too large, say
                raise
            # a number with letters that are not a unit ("4090D"): report it as a name
    raise UsageError(unknown_gpu_message(text))


# A memory size inside a card's name ("H100-94GB", "A800 80G"): datasheet gigabytes.
_NAMED_SIZE = re.compile(r"(?<![0-9.])([0-9]+)\s*G(?:B|IB)?(?![A-Z])", re.IGNORECASE)
# Each table card's memory as its datasheet states it (GB), to compare with a size in a name:
# CUDA's bytes are no measure of that (the T4's "16 GB" is 15.84e9 B to CUDA, the H100 NVL's
# "94 GB" 100.5e9 B), and a card is never called at least as large as one it is not.
DATASHEET_GB = {
    "V100-16GB": 16, "V100-32GB": 32, "T4": 16, "A10G": 24, "RTX-3090": 24, "RTX-4080": 16,
    "RTX-4090": 24, "RTX-5090": 32, "RTX-A6000": 48, "L4": 24, "L40": 48, "A40": 48, "L40S": 48,
    "A100-40GB": 40, "A100-80GB": 80, "H100-80GB": 80, "H100-PCIe": 80, "H100-NVL": 94, "GH200": 96,
    "H200": 141, "B200": 180,  # B200: the DGX B200 datasheet's 1,440 GB over 8 GPUs
}
# The message's room: 80 columns less the CLI's "memcheck: error: --gpu: " (24).
_ROOM = 80 - len("memcheck: error: --gpu: ")


def unknown_gpu_message(text: str) -> str:
    """The one-line error for a ``--gpu`` name outside the table: the fullest wording that fits
    ``_ROOM`` columns (so the CLI's line fits 80 unless the name itself is long), else the
    shortest.

    A spelling suggestion ("did you mean") is made only for a likely typo (:func:`_likely_typo`:
    "RTX4900", "H100-8GB", "H10O"), never for a different model number or family ("RTX-5080" is
    not offered the RTX-5090, "B300" or "GB200" not the B200, "B100" not the H100). Where
    the name carries its memory ("H100-94GB"), no card with less (by datasheet) is suggested, and
    the table's nearest cards with at least that much are listed, smallest first."""
    named = _NAMED_SIZE.search(text)
    need = int(named.group(1)) if named else None
    big_enough = sorted((g for g in GPUS.values() if need is None or DATASHEET_GB[g.name] >= need),
                        key=lambda g: (DATASHEET_GB[g.name], g.capacity_bytes))
    head = f"unknown GPU {text!r}"
    # Spelling is compared as resolve_gpu reads names (no case, dashes or vendor words), against the
    # table's names and its unambiguous aliases ("H10O" is near the alias "h100", the H100-80GB).
    keys = {_norm(g.name): g.name for g in big_enough}
    keys.update({k: v for k, v in _ALIASES.items() if isinstance(v, str) and v in keys.values()})
    match = closest(_norm(text), keys)
    key = match[len(" (did you mean '"):-len("'?)")] if match else None
    name = keys[key] if key is not None else None
    if name is not None and _likely_typo(_norm(text), key):
        options = [f"{head}; did you mean {name!r}? (see memcheck gpus)", f"{head}; did you mean {name!r}?"]
    elif need is not None and not big_enough:
        options = [f"{head}; no GPU in the table has {need} GB: --gpu {need}GB",
                   f"{head}; none has {need} GB: --gpu {need}GB"]
    elif need is not None:
        options = [f"{head}; at least {need} GB: {', '.join(g.name for g in big_enough[:count])}"
                   for count in (3, 2, 1)]
    else:
        options = [f"{head}; see memcheck gpus, or give its memory: 24GiB",
                   f"{head}; see memcheck gpus, or give 24GiB", f"{head}; see memcheck gpus"]
    return next((line for line in options if len(line) <= _ROOM), options[-1])


def _likely_typo(text: str, key: str) -> bool:
    """True when the normalised name ``text`` is a likely misspelling of the table key ``key``: the
    same letters before the model number ("h", "rtx"; "GB200" is not a "B200", "B100" not an
    "H100") and the same digits reordered, or one digit string inside the other in order (a digit
    dropped or doubled); a changed digit is another model."""
    if re.match(r"[a-z]*", text).group(0) != re.match(r"[a-z]*", key).group(0):
        return False
    a, b = re.sub(r"\D", "", text), re.sub(r"\D", "", key)
    if sorted(a) == sorted(b):
        return True
    short, long = sorted((a, b), key=len)
    it = iter(long)
    return all(ch in it for ch in short)


def _match_row(smi_name: str, smi_mib: int) -> _Row | None:
    """The table row for an nvidia-smi name whose memory.total is within 3% of the row's."""
    name = smi_name.lower()
    candidates = [r for r in _ROWS if re.search(r.pattern, name)]
    if not candidates:
        return None
    best = min(candidates, key=lambda r: abs(r.smi_mib - smi_mib))
    return best if abs(best.smi_mib - smi_mib) <= 0.03 * best.smi_mib else None


def gpu_from_smi(line: str) -> GpuSpec | None:
    """Parse one ``name, memory.total [MiB], compute_cap`` line of nvidia-smi CSV output.

    A known card (name pattern and memory.total within 3%) gives its :data:`GPUS` row,
    e.g. ``"NVIDIA H100 80GB HBM3, 81559, 9.0"`` gives H100-80GB. An unlisted card gives
    an unnamed spec with nvidia-smi's memory.total (which may be ~2% above CUDA's
    figure), the queried compute capability and the generic context estimate. The
    compute capability may be missing (``name, memory.total``), as older drivers lack
    the field; then a listed card's own arch is used, or sm80. Returns None for a line
    it cannot read.
    """
    parts = [p.strip() for p in line.split(",")]
    if len(parts) not in (2, 3) or not parts[0]:
        return None
    name = parts[0]
    smi_mib = _smi_mib(parts[1])
    if smi_mib is None or smi_mib <= 0:
        return None
    arch = None
    if len(parts) == 3:
        cap = re.fullmatch(r"(\d+)\.(\d+)", parts[2])
        if cap:
            arch = (int(cap.group(1)), int(cap.group(2)))
    row = _match_row(name, smi_mib)
    if row is not None and (arch is None or arch == row.arch):
        return GPUS[row.name]
    return GpuSpec(
        name=name, capacity_bytes=smi_mib * MiB, arch=arch or (8, 0), context_bytes=GENERIC_CONTEXT_BYTES, named=False,
        context_source=GENERIC_CONTEXT_SOURCE,
    )


def _visible_device() -> str | None:
    """nvidia-smi's ``-i`` value for CUDA device 0, '' when no device is visible, None for 'first GPU'."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    first = visible.split(",")[0].strip()
    if first == "" or first.startswith("-"):
        return ""  # CUDA_VISIBLE_DEVICES="" or "-1": CUDA sees no device
    if first.startswith("MIG-"):
        return ""  # a MIG slice: nvidia-smi --query-gpu reports the whole card, not the slice
    return first  # an index or a GPU-UUID, both accepted by nvidia-smi -i


def local_gpu(*, timeout: float = 5.0) -> GpuSpec | None:
    """The GPU that would be ``cuda:0`` here, from ``nvidia-smi``, without initialising CUDA.

    Runs ``nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader,nounits``
    (retrying without ``compute_cap`` for older drivers) and reads the first line with
    :func:`gpu_from_smi`. ``CUDA_VISIBLE_DEVICES`` picks the card (an index or UUID).

    Returns:
        The spec, or None when nvidia-smi is missing, fails or times out, no device is
        visible, or device 0 is a MIG slice (whose size nvidia-smi does not report here).

    Known limitations:
        With ``CUDA_DEVICE_ORDER`` unset, CUDA numbers devices fastest first while
        nvidia-smi uses PCI order; on a machine with mixed GPUs the two can differ.
    """
    for fields in ("name,memory.total,compute_cap", "name,memory.total"):
        answer = _query_smi(fields, timeout)
        if answer is None:
            return None
        returncode, line = answer
        if returncode == 0:
            return gpu_from_smi(line) if line else None
    return None


def device_used_bytes(*, timeout: float = 30.0) -> int | None:
    """Memory in use on the GPU that would be ``cuda:0`` (nvidia-smi ``memory.used``, all
    processes), without initialising CUDA; None when nvidia-smi cannot say."""
    answer = _query_smi("memory.used", timeout)
    if answer is None or answer[0] != 0 or not answer[1]:
        return None
    used = _smi_mib(answer[1])
    return None if used is None or used < 0 else used * MiB


def _smi_mib(text: str) -> int | None:
    """A MiB figure nvidia-smi printed, as an int; None for what is not one: not a number, nan,
    inf or ``1e999``, or more than ``MAX_BYTES`` (a broken or fake nvidia-smi)."""
    try:
        value = float(text)
    except ValueError:
        return None
    if not -MAX_BYTES / MiB <= value <= MAX_BYTES / MiB:  # nan fails this too
        return None
    return int(value)


def _query_smi(fields: str, timeout: float) -> tuple[int, str | None] | None:
    """``(returncode, first non-empty line)`` of ``nvidia-smi --query-gpu=FIELDS`` for the
    device ``cuda:0`` would be; None when nvidia-smi is missing, fails to run, or no
    device is visible."""
    exe = shutil.which("nvidia-smi")
    device = _visible_device()
    if exe is None or device == "":
        return None
    select = ["-i", device] if device else []
    try:
        done = subprocess.run(
            [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits", *select],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    return done.returncode, (lines[0] if lines else None)


def local_library_versions() -> dict[str, object]:
    """This torch build's CUDA toolkit and cuDNN versions, which decide attention kernels.

    Returns ``{"cuda_version": (13, 0), "cudnn_version": 91501}`` for the keys it can
    read, ``{}`` on a CPU-only build. Reads build metadata and loads the cuDNN library
    only; CUDA is not initialised.
    """
    out: dict[str, object] = {}
    if not torch.version.cuda:
        return out
    try:
        out["cuda_version"] = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
    except ValueError:
        pass
    # Not torch.backends.cudnn.version(): its _init() checks the library against every device's
    # compute capability (torch/backends/cudnn/__init__.py, _init, torch.cuda.get_device_capability),
    # which initialises CUDA; seen on an H200 with torch 2.11 (benchmarks/gpu_accuracy.py). The
    # binding it reads first, _cudnn.getVersionInt(), only asks the loaded library.
    from memcheck.compat import cudnn_version_int

    version = cudnn_version_int()  # None: no cuDNN in this build, or a broken install
    if version:
        out["cudnn_version"] = int(version)
    return out
