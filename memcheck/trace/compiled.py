"""Trace a ``torch.compile``'d model as the compiled step runs: TorchDynamo's graphs, split into a
forward and a backward by AOTAutograd's min-cut partition as TorchInductor splits them, each run
on meta tensors with what inductor fuses away left out of the count.

``CompiledForward(module)`` replaces ``module.forward`` (the meta twin's) with a forward that
TorchDynamo compiles, on its first call, with ``compat.inductor_partition_backend``. Each
captured graph is run by ``InductorBuffers``:

* the saved tensors between forward and backward are the partition's: the forward graph's
  extra outputs, kept by AOTAutograd's ``CompiledFunction`` (its ``ctx.save_for_backward``, so
  the tracer sees them as activations), the rest recomputed in the backward graph;
* inside a graph, only the values inductor gives a buffer of their own are counted
  (``realized``): graph outputs, the outputs of its extern and fallback kernels (matmuls,
  convolutions, attention) and of reductions, the inputs of those kernels, and a pointwise value
  reused where inductor's own heuristics store it. Every other pointwise value is fused into
  the kernel that reads it and never allocated. Buffers are freed after their last use, as
  inductor's wrapper code does (``del buf``; a freed buffer of the same size is reused by the next
  allocation, the same peak);
* a fused kernel's output takes the buffer of an input that dies in that kernel (inductor's
  ``config.inplace_buffers``, torch/_inductor/scheduler.py:1466 ``decide_inplace_update`` in 2.13);
* a 2-d convolution's input and weight are laid out channels-last, as inductor does on a CPU with
  oneDNN (``InductorBuffers._channels_last_convolution``).

Only a forward that TorchDynamo captures whole (one graph; one recompilation at step 2 allowed) is
traced so; otherwise ``CompiledForward.check`` raises and the estimate traces the eager step.
``estimate()`` uses none of this unless ``TRACE_AS_COMPILED`` is set: against real compiled
runs it is not closer than the eager trace in every case (the results are in that constant's
docstring).

Known limitations: inductor's joint-graph and post-grad passes, its reordering for peak memory
(``config.reorder_for_peak_memory``) and its other layout choices are not modelled; which
pointwise values it stores is decided from the FX graph with its thresholds, not by its lowering
(bert-narrow reads 3.0 MB, -13.4%, below the real compiled run). A model that makes
a tensor on its own device while TorchDynamo traces it (transformers' ``DynamicCache``:
``torch.tensor([], device=...)``) makes a real meta tensor that TorchDynamo's fake-tensor mode
refuses: it falls back.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Interpreter, Node

from memcheck import compat
from memcheck.trace.tracer import MemoryTracer

# Ops that inductor lowers into fused loops although torch does not tag them pointwise
# (torch/_inductor/lowering.py: clone, _to_copy, where, full, scalar_tensor, iota, fill and
# the *_like factories all make Pointwise IR).
_FUSED_PACKETS = ("clone", "_to_copy", "where", "full", "scalar_tensor", "iota", "fill", "full_like",
                  "zeros_like", "ones_like", "masked_fill", "lift_fresh_copy", "alias", "expand_copy",
                  "permute_copy", "view_copy")


def _is_view(target) -> bool:
    return target is operator.getitem or (isinstance(target, compat.OpOverload) and target.is_view)


def _is_mutation(target) -> bool:
    return isinstance(target, compat.OpOverload) and target._schema.is_mutable


def _is_fused(target, extern: frozenset) -> bool:
    if not isinstance(target, compat.OpOverload) or target in extern:
        return False
    return torch.Tag.pointwise in target.tags or target.overloadpacket.__name__ in _FUSED_PACKETS


def _nbytes(node: Node) -> int | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        try:
            return int(val.untyped_storage().nbytes()) if val.device.type == "meta" else int(
                val.numel() * val.element_size())
        except Exception:
            return int(val.numel() * val.element_size())
    return None


def buffer_plan(gm: torch.fx.GraphModule, extern: frozenset) -> tuple[dict[Node, Node], set[Node], dict[Node, Node]]:
    """Which values of ``gm`` inductor stores: ``(root, realized, inplace)``.

    ``root[n]`` is the node whose storage ``n`` lives in (itself, or what it views or mutates);
    ``realized`` the roots that get a buffer; ``inplace[n]`` the dying input whose buffer the
    fused kernel computing ``n`` writes into. The rules follow ``GraphLowering.run_node``
    (torch/_inductor/graph.py:2028-2140 in 2.13): a value used by an extern kernel
    (``needs_realized_inputs``) or by the output is realized; a pointwise value read more than
    once is stored when its loop reads more than ``realize_reads_threshold`` buffers or uses an op
    heavy on the CPU (``StorageBox.should_realize_on_reuse``), and any pointwise value whose
    accumulated reads pass ``realize_cpu_acc_reads_threshold`` (``has_exceeded_max_reads``)."""
    limits = compat.INDUCTOR_REALIZE
    root: dict[Node, Node] = {}
    realized: set[Node] = set()
    reads: dict[Node, frozenset] = {}
    heavy: dict[Node, bool] = {}
    users: dict[Node, list[Node]] = {}  # the users of each root, through views

    def inputs(n: Node) -> list[Node]:
        return [a for a in n.all_input_nodes]

    for n in gm.graph.nodes:
        if n.op == "output":
            for a in inputs(n):
                realized.add(root[a])
                users.setdefault(root[a], []).append(n)
            continue
        if n.op != "call_function":
            root[n], reads[n], heavy[n] = n, frozenset((n,)), False
            realized.add(n)
            continue
        t = n.target
        args = inputs(n)
        for a in args:
            users.setdefault(root[a], []).append(n)
        if (_is_view(t) or _is_mutation(t)) and args:
            root[n] = root[args[0]]
            continue
        root[n] = n
        if t in extern:
            for a in args:
                realized.add(root[a])
        if not _is_fused(t, extern):
            realized.add(n)
            reads[n], heavy[n] = frozenset((n,)), False
            continue
        got: set = set()
        is_heavy = t.overloadpacket.__name__ in limits["heavy_on_cpu"]  # _is_fused: t is an OpOverload
        for a in args:
            r = root[a]
            if r in realized:
                got.add(r)
            else:
                got |= reads.get(r, frozenset((r,)))
                is_heavy = is_heavy or heavy.get(r, False)
        reads[n], heavy[n] = frozenset(got), is_heavy
        direct = {u for u in n.users}
        if len(direct) > 1 and (is_heavy or len(got) > limits["reads_on_reuse"]):
            realized.add(n)
        elif len(got) > limits["cpu_acc_reads"]:
            realized.add(n)
    # A user reached through a view counts for the root it views (an extern kernel reading a
    # transposed weight realizes the weight's producer): the output and extern users above
    # already did so for their direct inputs' roots.
    inplace: dict[Node, Node] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op != "call_function" or root.get(n) is not n or n not in realized or not _is_fused(n.target, extern):
            continue
        size = _nbytes(n)
        for a in n.all_input_nodes:
            r = root[a]
            if (r in realized and r.op == "call_function" and r not in inplace.values() and _nbytes(r) == size
                    and max(order[u] for u in users.get(r, [n])) == order[n]
                    and all(u.op != "output" for u in users.get(r, []))):
                inplace[n] = r
                break
    return root, realized, inplace


class CompiledTraceError(Exception):
    """The compiled step cannot be traced as compiled; the estimate traces it eagerly."""


_CONVOLUTION = torch.ops.aten.convolution.default


def _channels_last_cpu() -> bool:
    """Whether inductor lays convolutions out channels-last on this CPU (oneDNN enabled and built)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


class InductorBuffers(Interpreter):
    """Run a captured graph on meta tensors, counting only the buffers of ``buffer_plan``: a
    fused value is computed with the dispatch modes (the tracer) set aside, so it is never
    allocated; a stored one is computed under them. Without a plan every value counts
    (AOTAutograd's graphs run as they are: the ``aot_eager`` backend)."""

    def __init__(self, gm: torch.fx.GraphModule, plan: tuple | None, channels_last: bool = False):
        super().__init__(gm, garbage_collect_values=True)
        self.fused = plan is not None
        self.channels_last = channels_last
        self.root, self.realized, self.inplace = plan if plan is not None else ({}, set(), {})

    def run_node(self, n: Node) -> Any:
        if not self.fused or n.op != "call_function" or self.root[n] in self.realized:
            dying = self.inplace.get(n)
            if dying is not None:
                self._release(dying)
            if n.op == "call_function" and n.target is _CONVOLUTION and self.channels_last:
                return self._channels_last_convolution(n)
            return super().run_node(n)
        with compat.disable_current_modes():
            return super().run_node(n)

    def _channels_last_convolution(self, n: Node) -> Any:
        """A 2-d convolution as inductor runs it on the CPU with oneDNN: its graph's layout
        optimisation (``GraphLowering.decide_layout_opt``, torch/_inductor/graph.py:766-776 in 2.13:
        "for cpu backend and mkldnn enabled, we always use channels_last") gives the input and the
        weight channels-last buffers (a copy where they are not), so the output, the activations
        computed from it and the convolution's backward are channels-last, and oneDNN reorders
        nothing (the CPU convolution rule probes that layout)."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inp, weight = args[0], args[1]
        if inp.dim() == 4:
            args = (inp.contiguous(memory_format=torch.channels_last),
                    weight.contiguous(memory_format=torch.channels_last), *args[2:])
        return n.target(*args, **kwargs)

    def _release(self, dying: Node) -> None:
        """Free ``dying``'s buffer before the kernel that writes into it runs: its value is
        swapped for an uncounted meta tensor of the same layout (the kernel reads only shapes)."""
        for node, value in list(self.env.items()):
            if isinstance(value, torch.Tensor) and self.root.get(node) is dying and value.device.type == "meta":
                with compat.disable_current_modes():
                    self.env[node] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                                         device="meta")


TRACE_AS_COMPILED = False
"""Whether ``memcheck.estimate`` traces a ``torch.compile``'d model as compiled (this module) or
eagerly. Off: against real inductor runs (benchmarks/results/compiled-estimates-2026-12-02.md,
torch 2.13 CPU) the compiled trace is closer than the eager one on cnn_bn (-2.3% against +49.6%)
and vit-narrow (+8.0% against -10.5%), as close on mlp, but further on bert-narrow (-13.4% against
+6.2%); TorchDynamo captured no graph under the tracer for gpt2-narrow, t5 and lstm (the eager
trace stands there). Turned on by benchmarks/compiled.py and the tests."""

FUSE = True
"""Model inductor's fusion (``buffer_plan``). False: every value of the captured graphs counts, as
they run under AOTAutograd with no inductor (the graphs as they are, FX's generated code freeing
each value after its last use): what tests compare with real runs of the same partition, which
take seconds where an inductor compile takes a minute on 2 cores."""


class CompiledForward:
    """``module.forward`` compiled by TorchDynamo with inductor's partition, each graph run by
    ``InductorBuffers``. Installed on the traced twin (``install``); its first call compiles (the
    tracer's dispatch mode is off while TorchDynamo and AOTAutograd trace: the tracer ignores
    compile internals), later calls run the compiled graphs under the tracer; the second call may
    compile once more, a later recompilation raises (``fail_on_recompile``) and the caller falls
    back to the eager trace."""

    def __init__(self, module: torch.nn.Module, *, fused: bool | None = None):
        self.module = module
        self.fused = FUSE if fused is None else fused
        self.graphs: list[tuple[str, torch.fx.GraphModule]] = []
        self.calls = 0
        self.compiled_per_call: list[int] = []  # forward graphs compiled by each call
        self._extern = compat.inductor_extern_ops() if self.fused else frozenset()
        backend = compat.inductor_partition_backend(self._compiler("forward"), self._compiler("backward"))
        self._compiled = torch.compile(module.forward, backend=backend, dynamic=False)

    def install(self, tracer: MemoryTracer) -> "CompiledForward":
        """Put the compiled forward on the twin, and let TorchDynamo compile under ``tracer`` (set
        before the tracer is entered: torch reads it as the mode is pushed)."""
        self.module.forward = self  # an instance attribute of the twin: the class's forward is untouched
        tracer.compiles = True
        return self

    def _compiler(self, kind: str):
        def compile_graph(gm, example_inputs):
            self.graphs.append((kind, gm))
            plan = buffer_plan(gm, self._extern) if self.fused else None
            channels_last = kind == "forward" and _channels_last_cpu()  # the backward gets its layouts from it

            def run(args):
                return InductorBuffers(gm, plan, channels_last).boxed_run(args)

            run._boxed_call = True  # AOTAutograd's boxed convention (make_boxed_func): it frees the inputs
            return run
        return compile_graph

    def __call__(self, *args, **kwargs):
        # The first call compiles; the second may recompile once, as a real run does where the
        # first forward changed what TorchDynamo guards on (transformers sets
        # ``config.problem_type`` in its first loss: ViT's classifier); after that a recompilation
        # raises (a step that recompiles every time would end in TorchDynamo's cache limit,
        # running eagerly).
        stance = "default" if self.calls < 2 else "fail_on_recompile"
        before = self.partitions
        with compat.no_global_module_hooks(), compat.no_function_modes(), torch.compiler.set_stance(stance):
            out = self._compiled(*args, **kwargs)
        self.compiled_per_call.append(self.partitions - before)
        self.calls += 1
        return out

    def check(self) -> None:
        """Raise ``CompiledTraceError`` unless TorchDynamo captured the whole forward as one graph.
        With none it ran the model eagerly; with several (graph breaks) the code between graphs ran
        here without the tracer's module hooks and function modes (its kernel rules), so neither
        is the compiled step's trace."""
        if self.partitions == 0:
            raise CompiledTraceError("TorchDynamo captured no graph: the compiled model runs eagerly")
        breaks = max(self.compiled_per_call, default=0)
        if breaks > 1:
            raise CompiledTraceError(f"TorchDynamo broke the forward into {breaks} graphs (graph breaks)")

    @property
    def recompiled(self) -> bool:
        """Whether a call after the first compiled the forward again."""
        return any(self.compiled_per_call[1:])

    @property
    def partitions(self) -> int:
        """How many forward graphs TorchDynamo captured (more than one: graph breaks)."""
        return sum(1 for kind, _ in self.graphs if kind == "forward")
