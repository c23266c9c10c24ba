"""The tracer: one ``TorchDispatchMode`` that records when every tensor storage is
allocated and freed while a real training loop runs on the meta device.

Meta tensors carry shapes, dtypes and storages with a byte size but no data, so
the loop costs the same at batch 1 or 1024. Each storage seen for the first
time as an op's output is an allocation; a weakref on the storage reports its
free when the last tensor using it dies, the moment the real allocator would get
the block back. Events are kept in order, so the peak, its phase, its module and
what was live at that instant can be replayed afterwards (and, for CUDA, fed to
an allocator simulation).

Categories are assigned as the loop goes: the batch, parameters and buffers at
registration; tensors autograd saves for backward become activations (a
``saved_tensors_hooks`` pack hook); the root module's outputs become outputs;
accumulated ``.grad`` become gradients (``register_post_accumulate_grad_hook``);
tensors held in ``optimizer.state`` after a step become optimizer state;
everything else is a temporary.

Alongside, ``KnownValues`` (``memcheck.rules.known_values``) follows the values that the
traced code itself made known (``torch.ones`` and what follows from it), which the
data-dependent rules read instead of their worst-case stand-ins. The tracer's ``choices``
(``memcheck.choices``) answer the data-dependent questions that have no single worst case:
with the answer ``no-padding`` the batch's attention masks are known to be all ones; with
``padding`` they are not, and a second ``KnownValues`` (``if_unpadded``) follows what they
would be if they were, so a check whose answer the mask decides marks the point consulted.

A dispatch mode changes what autograd itself allocates: torch treats every tensor as a
subclass while one is active, and the engine then sums a tensor's gradients out of place.
``_GradientSums`` puts those sums back in place, as a run without the tracer does them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

import memcheck.rules  # noqa: F401  (every rule module registers its rules)
from memcheck import compat
from memcheck.compat import TorchDispatchMode, tree_flatten
from memcheck.choices import NO_PADDING, PADDING, Choices, attention_masks
from memcheck.enums import ALLOC, AUTOGRAD_THREAD, FREE, MAIN_THREAD, RECAT, Category, Device, Event, Phase
from memcheck.rules.extensions import weight_side_tensors
from memcheck.rules.known_values import KnownValues
from memcheck.rules.registry import DISPATCH_RULES, FUNCTION_RULES, named_rule
from memcheck.trace.engine_modes import EngineUnderModes, device_modes
from memcheck.trace.stacks import StackRecorder


_aten = torch.ops.aten
# Ops that launch no kernel: bare allocations, autograd's aliasing, reading a scalar back.
_NO_KERNEL = frozenset({
    _aten.empty, _aten.empty_strided, _aten.empty_like, _aten.detach, _aten.lift_fresh, _aten.alias,
    _aten._local_scalar_dense, _aten.new_empty, _aten.new_empty_strided,
})


def _cpu_flash(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _low_precision(args) -> bool:
    """Whether the op's first tensor input is bf16/fp16 (tensor-core matmuls)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.dtype in (torch.bfloat16, torch.float16)


# torch.utils.flop_counter's formulas (matmuls, convolutions, the CUDA attention kernels),
# plus the CPU flash-attention kernels it does not list, counted by the same formulas.
_FLOPS = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}

# Ops that call cuBLAS/cuBLASLt on CUDA through torch's handle (``at::cuda::blas``:
# ``getCurrentCUDABlasHandle`` binds the handle's workspace on its first use by a thread,
# CublasHandlePool.cpp ``setWorkspaceForHandle``). Composite ops (``linear``, ``matmul``)
# reach the dispatcher as these.
# (``_grouped_mm`` and ``_scaled_grouped_mm`` are 2.8+: compat.aten_op is None for an op the running torch lacks.)
_BLAS_OPS = frozenset(op for op in map(compat.aten_op, (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "dot", "vdot", "_scaled_mm",
    "_int_mm", "_grouped_mm", "_scaled_grouped_mm")) if op is not None)

# Categories that a later use (being saved for backward, being returned) must not overwrite.
_PERSISTENT = frozenset(
    {Category.PARAMETER, Category.BUFFER, Category.INPUT, Category.OPTIMIZER, Category.GRADIENT}
)
_GLOBAL = "Global"  # ModuleTracker's name for "outside every module"
LOSS_BACKWARD = "(loss, backward)"


def _apply_order(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s modules in the order ``Module._apply`` converts them: children first
    (each once), then the module itself."""
    order, seen = [], set()

    def visit(module):
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(model)
    return order


class ForwardDone(BaseException):
    """Raised by ``set_phase`` as step 1's backward begins when the tracer is told to stop
    there (``stop_at_backward``): a trace of the first forward only. A BaseException, so that
    no ``except Exception`` of the traced code takes it."""


@dataclass
class TraceLog:
    """The ordered allocation events of a trace and what the tracer assumed.

    ``events`` holds ``memcheck.enums.Event``s ``(kind, sid, nbytes, category, module, phase,
    step, gpu)``; ``kind`` is ALLOC, FREE or RECAT (a change of category, nbytes 0); ``gpu`` is
    the index of the device the storage lives on (0 unless a strategy emulates several).
    """

    events: list[Event] = field(default_factory=list)
    assumptions: dict[str, None] = field(default_factory=dict)
    step_starts: list[int] = field(default_factory=list)  # event index where each step begins
    # (step, phase, gpu) -> [FLOPs, of which in bf16/fp16, kernels]: what the planner's cost proxy reads
    work: dict[tuple, list[int]] = field(default_factory=dict)
    # id(an ALLOC event in ``events``, which keeps it alive) -> the Python stack it was made at,
    # innermost first, as (filename, line, name) (``MemoryTracer.record_stacks``; memcheck.trace.stacks)
    stacks: dict[int, tuple] = field(default_factory=dict)
    # (thread, gpu) -> the index in ``events`` just after the outputs of that thread's first
    # cuBLAS op: where its cuBLAS workspace is allocated (``memcheck.cuda.replay``)
    blas_first: dict[tuple[str, int], int] = field(default_factory=dict)


def storage_key(t: torch.Tensor):
    """(key, storage) of ``t``'s storage, or None for tensors without one."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return st._cdata, st


class _ModuleNames(ModuleTracker):
    """torch's ModuleTracker, adjusted for a forward that runs inside backward
    (gradient checkpointing's recomputation):

    - its gradient hooks are left out there. They wait for the gradients of every
      recomputed output; the ones that never come (checkpoint stops recomputing
      early, or an output is unused) keep the ones that did, so the trace would hold
      memory a real run frees (measured: +7.5% on a 4-block MLP, use_reentrant=False);
    - the autograd engine runs backward without Python torch-function modes, so the
      tracer's kernel-choice mode (autocast, SDPA's kernel choice) is entered again
      around each recomputed module, as the real recomputation runs them (a fallback now:
      ``memcheck.trace.engine_modes`` keeps the mode in force through every backward the
      tracer sees, the checkpointed function's own code included);
    - the gradient hooks of a forward are removed once its backward has run
      (``drop_grad_hooks``);
    - when a module returns, the hooks registered inside it let go of the nodes made inside it
      that its outputs do not reach (``drop_dead_ends``), and when the root module returns,
      of every node its outputs do not reach (``drop_unreachable``): the graph of a tensor the
      model computes and drops dies with it, as in a real run.
    """

    def __init__(self, function_mode: TorchFunctionMode):
        super().__init__()
        self._function_mode = function_mode
        self._entered: list[int] = []
        self._pending: list[list] = []  # this forward's hooks' node lists (``drop_unreachable``)
        # the modules running now, outermost first: (id(module), the index in ``_pending`` of the first
        # list registered inside it, {id(node): node} of its positional inputs' nodes) (``drop_dead_ends``)
        self._frames: list[tuple[int, int, dict]] = []

    def drop_grad_hooks(self) -> None:
        """Remove the gradient hooks registered so far (the tracer calls it as a forward or
        an optimizer step begins, when the backward they served is over).

        Each hook holds the autograd nodes it waits for (``register_multi_grad_hook``'s
        ``grad_fns``) and sits in the hook dict of those nodes' tensors: a cycle through
        C++ that outlives the graph. For a custom ``autograd.Function`` it keeps the tensors
        stored on ``ctx`` as attributes, which a real run frees with the loss: bitsandbytes'
        ``MatMul8bitFp`` keeps its input as ``ctx.A``: without this, one extra (64, 512) fp32
        input lived on into the next step, +7% of the measured peak.
        """
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        getattr(self, "_hooks", []).clear()
        self._pending.clear()
        self._frames.clear()

    def drop_unreachable(self, outputs) -> None:
        """Cut from this forward's gradient hooks the nodes that the root module's ``outputs``
        do not reach: the graph of an output the model computes and drops (SigLIP's
        attention-pooling head under an image classifier, whose loss reads the mean of the last
        hidden state). A real run frees that graph with the output, after the forward; a hook
        holding its node kept it to the next optimizer step (+5% on that model). A backward from
        the outputs runs none of those nodes, so the hooks fire as before (``nb_calls`` counts
        the nodes the engine will run). Known limitation: a loss built from a tensor the model
        keeps elsewhere (stored on a module) reaches nodes cut here, and its hooks may fire early;
        that moves module names in backward, not memory."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        reached = reachable_nodes(
            t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        for nodes in pending:
            nodes[:] = [n for n in nodes if id(n) in reached]

    def drop_dead_ends(self, module, outputs) -> None:
        """Cut from the gradient hooks registered while ``module`` ran the nodes made inside it that
        its ``outputs`` do not reach: the graph of a tensor the module computes and drops.

        ``drop_unreachable`` does this for the root module, but a model that computes its loss in
        its own forward (transformers' ``labels=``) reaches its peak before the root returns: PEFT's
        DoRA computes its weight norm from ``lora_B(lora_A(eye))`` in grad mode and detaches it
        (peft/tuners/lora/dora.py, ``DoraLinearLayer.forward``); a real run frees that graph as the
        layer returns, while the hooks on lora_A's and lora_B's outputs held it to the root's return,
        past the loss (+3.11% on a 2-layer Qwen2 with DoRA, half reentrant checkpointing, pure bf16).

        "Made inside it": the walk from ``outputs`` stops at the module's positional inputs' nodes
        (recorded by the pre-hook), which are never cut, so each node is walked once per module
        that encloses it. A node made before the module and reached only through a tensor it did
        not get as a positional input (a keyword argument, an attribute) is walked through, not cut
        wrongly. Outputs that hold something other than tensors and plain values (an object pytree
        does not open) leave the hooks as they are: what it holds is not known."""
        while self._frames and self._frames[-1][0] != id(module):
            self._frames.pop()  # a module whose forward raised: its post-hook never ran
        if not self._frames:
            return
        _, first, inputs = self._frames.pop()
        lists = self._pending[first:]
        made = {id(n): n for nodes in lists for n in nodes if id(n) not in inputs}
        if not made:
            return
        leaves = tree_flatten(outputs)[0]
        if not all(isinstance(t, (torch.Tensor, int, float, bool, str, type(None))) for t in leaves):
            return
        roots = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        reached = reachable_nodes(roots, stop=inputs, wanted=made)
        for nodes in lists:
            nodes[:] = [n for n in nodes if id(n) not in made or id(n) in reached]

    def _grad_hook(self, tree, fn) -> None:
        """ModuleTracker's gradient hook on ``tree``'s tensors that require grad (``_all_grads_hook``)."""
        tensors = [a for a in tree_flatten(tree)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
        if tensors:
            handle, nodes = _all_grads_hook(tensors, fn)
            self._hooks.append(handle)
            self._pending.append(nodes)

    def _fw_pre_hook(self, mod, input) -> None:
        if compat.current_graph_task_id() == -1:  # ModuleTracker._fw_pre_hook, its hook cuttable
            name = self._get_mod_name(mod)
            self._get_append_fn(name, False)()
            inputs = {id(t.grad_fn): t.grad_fn for t in tree_flatten(input)[0]
                      if isinstance(t, torch.Tensor) and t.grad_fn is not None}
            self._frames.append((id(mod), len(self._pending), inputs))
            return self._grad_hook(input, self._get_pop_fn(name, True))
        self._get_append_fn(self._get_mod_name(mod), False)()
        if self._function_mode not in _function_modes():
            self._function_mode.__enter__()
            self._entered.append(id(mod))

    def _fw_post_hook(self, mod, input, output) -> None:
        if compat.current_graph_task_id() == -1:  # ModuleTracker._fw_post_hook, its hook cuttable
            name = self._get_mod_name(mod)
            self._get_pop_fn(name, False)()
            self.drop_dead_ends(mod, output)
            return self._grad_hook(output, self._get_append_fn(name, True))
        self._get_pop_fn(self._get_mod_name(mod), False)()
        if self._entered and self._entered[-1] == id(mod):
            self._entered.pop()
            modes = _function_modes()
            if modes and modes[-1] is self._function_mode:
                self._function_mode.__exit__(None, None, None)


def reachable_nodes(roots, stop: dict | None = None, wanted: dict | None = None) -> dict[int, object]:
    """``{id(node): node}`` for every autograd node reachable from the nodes ``roots`` through
    ``next_functions`` (the roots included), not walking on from the nodes in ``stop`` (``{id: node}``,
    held by the caller); with ``wanted`` (``{id: node}``), the walk ends once it has reached them all.

    The nodes themselves are held while the walk lasts, not only their ids. Up to torch 2.12 a C++
    node does not keep its Python wrapper alive: ``functionToPyObject``
    (torch/csrc/autograd/python_cpp_function.cpp) makes a wrapper when the node has none, and the
    wrapper's dealloc clears it again. A wrapper dropped during the walk frees its address, the next
    wrapper made can take it, and a set of ids calls that new node seen: the walk stopped after
    2 or 3 nodes of a 101-node chain (torch 2.6 to 2.12; from 2.13 the node keeps its wrapper),
    ModuleTracker's gradient hooks lost the nodes they count, never fired, and every gradient stayed
    to the end of the step (+40% on GPT-2 with full checkpointing and SGD under 2.11, issue 38).
    While a wrapper lives, every access returns that same wrapper, so the ids of held nodes stay
    unique and comparable with the ids of nodes held elsewhere (the hooks' lists).
    """
    reached: dict[int, object] = {}
    todo = collections.deque(roots)  # breadth first: a module's own nodes before the history behind its inputs
    missing = len(wanted) if wanted is not None else -1
    while todo and missing:
        node = todo.popleft()
        if id(node) not in reached:
            reached[id(node)] = node
            if wanted is not None and id(node) in wanted:
                missing -= 1
            if stop is None or id(node) not in stop:
                todo.extend(child for child, _ in node.next_functions if child is not None)
    return reached


def _all_grads_hook(tensors: list, fn) -> tuple[object, list]:
    """``torch.autograd.graph.register_multi_grad_hook(tensors, fn)`` in its default mode "all"
    (torch/autograd/graph.py, same steps: the same hooks on the same tensors, ``fn`` once every
    gradient the running backward computes for them has arrived), returning with its handle the
    list of nodes it counts those gradients by, which ``_ModuleNames.drop_unreachable`` may cut.

    torch keeps that list in the hooks' closure, and the hooks sit in the nodes' own hook dicts:
    a cycle through C++ that holds every node, and the graph above it, until the hook is removed.
    """
    count: dict[int, int] = {}
    buffer: dict[int, list] = {}
    nb_calls = None
    lock = threading.Lock()
    grad_fns = list(map(compat.grad_fn_or_grad_acc, tensors))
    len_tensors = len(tensors)

    def get_inner_hook(idx: int):
        def inner_hook(grad):
            nonlocal nb_calls
            task = compat.current_graph_task_id()
            count[task] = count.get(task, 0)
            buffer[task] = buffer.get(task, [None] * len_tensors)
            with lock:
                curr_count, count[task] = count[task], count[task] + 1
                if curr_count == 0:  # on the first call, the calls this backward will make
                    nb_calls = sum(map(compat.will_engine_execute_node, grad_fns))
            buffer[task][idx] = grad
            if curr_count == nb_calls - 1:
                fn(buffer[task])
                del count[task]
                del buffer[task]

        return inner_hook

    handles = tuple(t.register_hook(get_inner_hook(i)) for i, t in enumerate(tensors))
    return compat.MultiHandle(handles), grad_fns


def _function_modes() -> list:
    return compat.current_function_modes()


class _KernelChoiceMode(TorchFunctionMode):
    """Applies autocast's casts (when tracing mixed precision) and routes the few
    composite ops whose kernel depends on the device to their rules. In force in backward
    too (``memcheck.trace.engine_modes``)."""

    stands_for_device = True

    def __init__(self, tracer: "MemoryTracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        autocast = self.tracer.autocast
        if autocast is not None:
            if autocast.active:
                return autocast.run(func, args, kwargs, self.call)
            if compat.current_graph_task_id() != -1 and torch.is_grad_enabled() and not autocast.paused:
                # Gradient checkpointing recomputes the forward inside backward, in the
                # autocast state the forward had (torch.utils.checkpoint restores it).
                with autocast:
                    return autocast.run(func, args, kwargs, self.call)
        return self.call(func, args, kwargs)

    def call(self, func, args, kwargs):
        """Run ``func``, through its rule when one is registered."""
        rule = FUNCTION_RULES.get(func)
        if rule is None:
            return func(*args, **kwargs)
        return rule(self.tracer, func, args, kwargs)


class _GradientSums:
    """Makes the autograd engine's sum of a tensor's gradients in place, as it is in a real run
    (and the backward of ``x[idx]``, which the same test sends out of place).

    When a tensor feeds several ops, the engine sums their gradients in the input buffer of the
    node that made it (torch/csrc/autograd/input_buffer.cpp, ``accumulate``): in place,
    ``old_var.add_(var)``, when the buffer holds the only reference to ``old_var`` and its storage
    (``can_accumulate_inplace``) and ``var`` is no tensor subclass; else ``old_var + var``, a new
    tensor. But ``at::isTensorSubclassLike`` answers yes for every tensor while any dispatch mode
    is active (ATen/TensorSubclassLikeUtils.h: ``if (c10::impl::dispatch_mode_enabled()) return
    true``), so under the tracer every such sum allocates a new tensor, live with both addends:
    one extra gradient per sum at that moment (measured: +8% on a 2-layer Mamba, whose
    sequential scan sums the state's gradient at every position). Nothing the tracer holds
    causes it: a do-nothing ``TorchDispatchMode`` changes the real run's peak alike.

    The engine calls ``InputBuffer::add`` for a node's outputs after the node's apply and its post
    hooks have run (engine.cpp, ``evaluate_function`` after ``call_function``), still as the current
    autograd node. So each node of a backward graph gets a post hook that marks it done, and an
    ``aten.add.Tensor`` dispatched while a done node is still current is the engine's sum; where
    ``can_accumulate_inplace`` would hold in the real run it runs as ``add_`` on ``old_var``.

    Known limitations: nodes are found by walking ``next_functions`` from the first node that
    dispatches an op, so a node above it (a root whose backward dispatches nothing, as
    ``AddBackward0`` of ``loss = a + b``) keeps the out-of-place sum; ``AccumulateGrad`` gets no
    post hook (one would hold a second reference to the incoming gradient and stop it being
    stolen into ``.grad``), and needs none (it has no outputs).
    """

    def __init__(self):
        # graph task -> {id: node} of that running backward graph (kept alive: ids stay unique). One
        # map per graph task: reentrant checkpointing runs a nested backward over the recomputed
        # graph, whose nodes (and the tensors they save) must go when that nested backward ends,
        # not when the outer one does (they held the recomputed activations to the end: +9%).
        self._tasks: dict[int, dict[int, object]] = {}
        self._done = None  # the node whose apply and post hooks have run; the engine now sums its outputs

    def end_of_backward(self, task: int | None = None) -> None:
        """Forget graph task ``task``'s nodes (every task's when None)."""
        if task is None:
            self._tasks.clear()
        else:
            self._tasks.pop(task, None)
        self._done = None

    def _node_done(self, grad_inputs, grad_outputs) -> None:
        self._done = compat.current_autograd_node()

    def real_op(self, func, args, kwargs) -> tuple:
        """``(func, args, kwargs)`` as a run without a dispatch mode would dispatch them: the
        engine's gradient sum as ``add_``, the backward of ``x[idx]`` as ``_index_put_impl_``."""
        node = compat.current_autograd_node()
        if node is None:
            return func, args, kwargs
        task = compat.current_graph_task_id()
        nodes = self._tasks.get(task)
        if nodes is None:
            nodes = self._tasks[task] = {}
            compat.queue_engine_callback(lambda: self.end_of_backward(task))
        if id(node) not in nodes:
            self._hook_below(node, nodes)
        if node is not self._done:
            self._done = None
            if func is _aten.index_put.default and type(node) is compat.IndexBackward0:
                # index_backward (FunctionsManual.cpp) fills zeros_like(self) in place,
                # ``at::_index_put_impl_(zeros, indices, grad, true, true)``, unless some tensor is
                # subclass-like; then, and so under any dispatch mode, ``zeros.index_put(...)``: a copy.
                b = dict(zip(("self", "indices", "values", "accumulate"), args), **kwargs)
                if b.get("accumulate") and not torch.is_grad_enabled():
                    return _aten._index_put_impl_.default, (b["self"], b["indices"], b["values"], True, True), {}
            return func, args, kwargs
        if func is _aten.add.Tensor and not kwargs and len(args) == 2 and not torch.is_grad_enabled():
            old, var = args
            if (
                isinstance(old, torch.Tensor) and isinstance(var, torch.Tensor) and old.shape == var.shape
                and old.dtype == var.dtype and type(var) is torch.Tensor and var.layout == torch.strided
                and _sole_owner(old)
            ):
                return _aten.add_.Tensor, args, {}
        return func, args, kwargs

    def _hook_below(self, root, nodes: dict[int, object]) -> None:
        nodes[id(root)] = root
        todo = [root]
        while todo:
            for child, _ in todo.pop().next_functions:
                if child is None or id(child) in nodes:
                    continue
                nodes[id(child)] = child
                todo.append(child)
                if type(child) is not compat.AccumulateGrad:
                    child.register_hook(self._node_done)


def _ref_counts(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s tensor and storage use counts, as read from inside ``__torch_dispatch__``."""
    return t._use_count(), compat.storage_use_count(t.untyped_storage()._cdata)


@functools.cache
def _sole_owner_counts() -> tuple[int, int]:
    """What ``_ref_counts`` reads, at the engine's gradient sum, for a gradient that only the
    engine's input buffer holds (the dispatcher's argument stack and the Python wrappers add
    references of their own; this measures them instead of assuming their number)."""

    class Probe(TorchDispatchMode):
        counts = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _aten.add.Tensor and compat.current_graph_task_id() != -1:
                self.counts = _ref_counts(args[0])  # the only add in this backward: the engine's sum
            out = func(*args, **(kwargs or {}))
            storage_key(out)  # the tracer looks at every output's storage
            return out

    probe = Probe()
    x = torch.empty(4, device="meta", requires_grad=True)
    with torch.enable_grad(), probe:
        h = x * 2
        ((h * 3).sum() + (h * 4).sum()).backward()  # h's gradient: 3 + 4, summed by the engine
    return probe.counts


def _sole_owner(t) -> bool:
    """``can_accumulate_inplace`` (input_buffer.cpp) for a real run of the traced tensor ``t``: a plain
    dense tensor that only the engine's input buffer references, storage included."""
    return (
        type(t) is torch.Tensor and t.layout == torch.strided and not t.is_nested and not t._is_zerotensor()
        and _non_overlapping_and_dense(t) and _ref_counts(t) == _sole_owner_counts()
    )


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """c10's ``is_non_overlapping_and_dense``: contiguous once its dimensions are sorted by stride."""
    dims = sorted((d for d in range(t.dim()) if t.size(d) != 1), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


class MemoryTracer(TorchDispatchMode):
    """Record every storage allocation and free during a traced training loop.

    Use as a context manager around code that runs on meta tensors; call
    ``watch`` first with the model, batch and optimizer so their memory is
    registered and categorised, and ``set_phase`` as the loop moves on.

    Example:
        >>> tracer = MemoryTracer(Device.CPU)
        >>> with tracer:
        ...     tracer.watch(model, batch)
        ...     loss = model(batch).sum(); loss.backward()
        >>> tracer.log.events[-1]
    """

    def __init__(self, device: Device, arch: tuple[int, int] = (8, 0), choices: Choices | None = None):
        super().__init__()
        self.choices = choices if choices is not None else Choices()  # answers at the choice points
        self.if_unpadded = KnownValues()  # the values known if the batch had no padding (choices)
        self.stop_at_backward = False  # raise ForwardDone as step 1's backward begins
        self.compiles = False  # TorchDynamo compiles the model under the tracer (ignore_compile_internals)
        # note each allocation's Python stack in ``log.stacks`` (``--snapshot``'s frames; it costs time)
        self.record_stacks = False
        self._stacks = StackRecorder()
        self.device = Device.parse(device)
        self.arch = arch  # CUDA compute capability of the target GPU; rules pick kernels by it
        self.autocast = None  # a memcheck.rules.autocast.MetaAutocast while tracing mixed precision
        self.on_phase = None  # called as on_phase(step, phase) when the loop enters a phase (progress)
        self.log = TraceLog()
        self.known = KnownValues()  # values the trace made known (torch.ones, ...): rules read them
        self.phase = Phase.SETUP
        self.step = 0
        self.live_bytes = 0
        self._sizes: dict[int, int] = {}
        self._cats: dict[int, Category] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._ignored: set[int] = set()  # storages a strategy accounts for itself (sharded parameters)
        self._owner: dict[int, str] = {}  # id(param) -> module name
        self._deepest: dict[frozenset, str] = {}  # the modules entered -> the deepest (``_module``)
        self._handles: list = []
        self._roots: list[torch.nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._closed = False
        self._scratch_id = 0  # scratch buffers get negative ids, never a storage's
        # Several GPUs (DataParallel): meta tensors have no device index, so the tracer
        # keeps one per storage. An op's outputs live where its first tracked input
        # does; ``on_gpu`` forces the index (copies between GPUs, factory calls).
        self.multi_gpu = False
        self._gpu: dict[int, int] = {}
        self._forced_gpu: int | None = None
        self._base_gpu = 0  # where factory calls (no tensor inputs) allocate
        self._op_gpu = 0
        self._kernel_mode = _KernelChoiceMode(self)
        self.modules = _ModuleNames(self._kernel_mode)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._engine_modes: list = []  # the device's function modes, carried into backward (engine_modes)
        self._engine = EngineUnderModes(lambda: self._engine_modes)
        self._grad_sums = _GradientSums()
        _sole_owner_counts()  # measured now, outside any backward

    def ignore_compile_internals(self) -> bool:
        """Whether TorchDynamo compiles under this tracer (``compiles``, set by
        ``memcheck.trace.compiled.CompiledForward.install`` before the trace): with the tracer off
        while it traces and on while the compiled graphs run (torch/utils/_python_dispatch.py
        ``ignore_compile_internals``, read on each instance as it is pushed). Otherwise TorchDynamo
        skips every frame while the tracer is in force (torch/_dynamo/convert_frame.py, "non-infra
        torch dispatch mode present"), so compiled code a library calls under ``memcheck run``
        runs eagerly, as before."""
        return self.compiles

    # ---- context management -------------------------------------------------------
    def __enter__(self):
        self.modules.__enter__()
        self._saved_hooks.__enter__()
        self._kernel_mode.__enter__()
        self._engine_modes = device_modes()
        self._engine.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._engine.__exit__(*exc)
            self._kernel_mode.__exit__(*exc)
            self._grad_sums.end_of_backward()
            self._saved_hooks.__exit__(*exc)
            self.modules.__exit__(*exc)
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._closed = True
            self._refs.clear()
            self.known.clear()
            self.if_unpadded.clear()

    # ---- what the loop tells the tracer --------------------------------------------
    @contextlib.contextmanager
    def on_gpu(self, index: int, *, force: bool = True):
        """Allocate on GPU ``index`` inside (multi-GPU strategies).

        ``force`` puts every storage there (a copy between GPUs); otherwise only
        ops without tensor inputs go there (a replica's factory calls), and the rest
        follow their inputs.
        """
        before = self._forced_gpu, self._base_gpu, self._op_gpu
        if force:
            self._forced_gpu = index
        else:
            self._base_gpu = self._op_gpu = index
        try:
            yield
        finally:
            self._forced_gpu, self._base_gpu, self._op_gpu = before

    def gpu_of(self, t: torch.Tensor) -> int:
        """The GPU index of ``t``'s storage (0 when it is not tracked)."""
        key = storage_key(t)
        return self._gpu.get(key[0], 0) if key is not None else 0

    def _current_gpu(self) -> int:
        return self._forced_gpu if self._forced_gpu is not None else self._op_gpu

    def route(self, func, args: tuple, kwargs: dict):
        """Run the torch function ``func`` as the tracer's function mode does (autocast's casts,
        then its rule, if any). For a call made inside a Python function that the mode already
        handles: torch pops a mode while its handler runs, so such calls never reach it."""
        return self._kernel_mode.__torch_function__(func, (), args, kwargs)

    def assume(self, text: str) -> None:
        """Note an assumption a rule made; it is listed in the report."""
        self.log.assumptions.setdefault(text, None)

    def set_phase(self, step: int, phase: Phase) -> None:
        """Called by the training loop as it enters each phase of each step."""
        if self.stop_at_backward and phase is Phase.BACKWARD:
            raise ForwardDone
        if phase is Phase.ZERO_GRAD or (phase is Phase.FORWARD and step > 0):
            self._register_optimizer_state()
        if phase in (Phase.FORWARD, Phase.OPTIMIZER):
            self.modules.drop_grad_hooks()
            self._grad_sums.end_of_backward()  # in case a backward failed before its end callback
        if phase is Phase.FORWARD and step != self.step or not self.log.step_starts:
            self.log.step_starts.append(len(self.log.events))
        self.step, self.phase = step, phase
        if self.on_phase is not None:
            self.on_phase(step, phase)

    def watch(self, model=None, batch=None, optimizer=None, *, root_outputs: bool = True) -> None:
        """Register memory that exists before the loop and hook the model and optimizer.

        ``root_outputs=False`` leaves the model's outputs uncategorised (a wrapper
        that calls the model several times, DataParallel's replicas, watches its own
        with ``watch_outputs``).
        """
        if model is not None:
            root = type(model).__name__
            self._roots.append(model)
            owners, fresh = {}, {}  # id(module) -> its name; id(param) -> param, not yet registered
            for mod_name, mod in model.named_modules():
                owners[id(mod)] = f"{root}.{mod_name}" if mod_name else root
                for p in mod.parameters(recurse=False):
                    if id(p) not in self._owner:  # a tied weight belongs to its first owner
                        self._owner[id(p)] = owners[id(mod)]
                        fresh[id(p)] = p
            # The weights reach the GPU as ``model.to("cuda")`` (the HF Trainer's and Lightning's
            # move) makes them: Module._apply converts the children first, then the module's own
            # parameters, then its buffers (torch/nn/modules/module.py, ``_apply``). The order
            # decides how the caching allocator packs them into segments.
            for mod in _apply_order(model):
                fqn = owners[id(mod)]
                for p in mod.parameters(recurse=False):
                    if fresh.pop(id(p), None) is None:
                        continue
                    self.register(p, Category.PARAMETER, self._owner[id(p)])
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
                for b in mod.buffers(recurse=False):
                    self.register(b, Category.BUFFER, fqn)
                for t in weight_side_tensors(mod):  # a quantized weight's statistics (bitsandbytes)
                    self.register(t, Category.PARAMETER, fqn)
            if root_outputs:
                self.watch_outputs(model)
        if batch is not None:
            for t in tree_flatten(batch)[0]:
                if isinstance(t, torch.Tensor):
                    self.register(t, Category.INPUT, _GLOBAL)
                    self.known.forget(t)  # the user's data: its checks keep the worst case
            unpadded = self.choices.answer(PADDING) == NO_PADDING
            for t in attention_masks(batch):  # all ones without padding: known, or followed in case
                (self.known if unpadded else self.if_unpadded).set_value(t, 1)
        if optimizer is not None:
            self._optimizers.append(optimizer)
            self._register_optimizer_state()

    def watch_outputs(self, module: torch.nn.Module) -> None:
        """Categorise ``module``'s outputs as the model's outputs; the loss phase starts there."""
        self._handles.append(module.register_forward_hook(self._on_root_output))

    def ignore(self, t: torch.Tensor) -> None:
        """Stop counting ``t``'s storage, now and later (a FREE event if it was counted).

        Sharded strategies use it for the full parameters: what a rank really holds
        of them (its shard, a gathered copy) is allocated explicitly instead.
        """
        key = storage_key(t)
        if key is None:
            return
        sid, st = key
        self._free(sid)
        self._ignored.add(sid)
        # Forget it when it dies, so a later storage at the same address is counted.
        self._refs[sid] = weakref.ref(st, lambda _, sid=sid: self._ignored.discard(sid))

    def register(self, t: torch.Tensor, category: Category, module: str | None = None) -> None:
        """Count ``t``'s storage (if new) and put it in ``category``."""
        key = storage_key(t)
        if key is None or key[0] in self._ignored:
            return
        sid, st = key
        if sid not in self._sizes:
            self._alloc(sid, st, category, module)
        elif self._cats[sid] is not category:
            self._recat(sid, category, module)

    def track(self, out) -> None:
        """Register an op's outputs now (rules call this before ``scratch``)."""
        # most ops return one tensor or a flat tuple of them: no pytree walk (its order is theirs)
        if isinstance(out, torch.Tensor):
            leaves = (out,)
        elif type(out) is tuple and all(o is None or isinstance(o, (torch.Tensor, int, float)) for o in out):
            leaves = out
        else:
            leaves = tree_flatten(out)[0]
        for t in leaves:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key is not None and key[0] not in self._sizes and key[0] not in self._ignored:
                    self._alloc(key[0], key[1], Category.TEMPORARY, None)

    def scratch(self, *nbytes: int, name: str | None = None) -> None:
        """Record buffers a kernel allocates and frees inside one op, on top of what is live.

        They are allocated in the order given and freed together, as the kernels
        that rules describe do (each rule cites the source it follows). ``name`` labels
        them: it is their innermost frame, ``("<name>", 0, name)``, above the Python stack
        when stacks are recorded, so a ``--snapshot`` shows the block by name
        (``"cuDNN workspace: conv forward"``) where a tensor shows the code that made it.
        """
        sizes = [int(n) for n in nbytes if n > 0]
        module = self._module()
        gpu = self._current_gpu()
        for i, n in enumerate(sizes):
            self._scratch_id -= 1
            self._sizes[self._scratch_id] = n
            self._cats[self._scratch_id] = Category.TEMPORARY
            self.live_bytes += n
            event = Event(ALLOC, self._scratch_id, n, Category.TEMPORARY, module, self.phase, self.step, gpu)
            self._alloc_event(event)
            if name is not None:
                self.log.stacks[id(event)] = (("<" + name + ">", 0, name),) + self.log.stacks.get(id(event), ())
        for sid in range(self._scratch_id, self._scratch_id + len(sizes)):
            n = self._sizes.pop(sid)
            self._cats.pop(sid)
            self.live_bytes -= n
            self.log.events.append(Event(FREE, sid, n, Category.TEMPORARY, None, self.phase, self.step, gpu))

    # ---- hooks -----------------------------------------------------------------------
    def _pack(self, t):
        key = storage_key(t) if isinstance(t, torch.Tensor) else None
        if key is not None and key[0] not in self._ignored:
            sid, st = key
            if sid not in self._sizes:
                self._alloc(sid, st, Category.ACTIVATION, None)
            elif self._cats[sid] not in _PERSISTENT and self._cats[sid] is not Category.ACTIVATION:
                self._recat(sid, Category.ACTIVATION, None)
        # Kept detached, as autograd keeps a saved output without hooks (``tensor_data()``): with
        # default hooks the pack hook gets the live tensor, grad_fn and all (saved_variable.cpp,
        # ``set_hooks_and_pack_data``), and for a node's own output that grad_fn is the node that
        # holds this SavedVariable: a cycle through C++ that no collection breaks. Only a
        # backward breaks it (it frees the saved tensors), so a graph that never gets one (an
        # output the loss does not use: SigLIP's pooling head under an image classifier) lived
        # to the end of the trace, where a real run frees it with the output (+14%). unpack
        # restores the grad_fn from the SavedVariable (its own ``grad_fn_``, or the node saved
        # for), so autograd sees the same tensor; the storage, all memcheck counts, is the same.
        return t.detach() if isinstance(t, torch.Tensor) else t

    @staticmethod
    def _unpack(t):
        return t

    def _on_grad(self, p):
        if p.grad is not None:
            self.register(p.grad, Category.GRADIENT, self._owner.get(id(p)))

    def _on_root_output(self, module, args, output):
        self.modules.drop_unreachable(output)
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key and key[0] in self._cats and self._cats[key[0]] is Category.TEMPORARY:
                    self._recat(key[0], Category.OUTPUT, None)
        if self.phase is Phase.FORWARD:
            self.phase = Phase.LOSS

    def _register_optimizer_state(self):
        for opt in self._optimizers:
            for p, state in opt.state.items():
                owner = self._owner.get(id(p))
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        self.register(value, Category.OPTIMIZER, owner)

    # ---- bookkeeping -----------------------------------------------------------------
    def _module(self) -> str:
        parents = self.modules.parents
        if len(parents) == 1:
            # In backward, work done before the first module's backward starts is the
            # backward of whatever follows the model's outputs: the loss.
            return LOSS_BACKWARD if self.phase is Phase.BACKWARD else _GLOBAL
        # the deepest module entered; remembered per set of names (tens of them in backward, and
        # the same few sets again and again: one per layer and step)
        key = frozenset(parents)
        name = self._deepest.get(key)
        if name is None:
            name = self._deepest[key] = max((p for p in parents if p != _GLOBAL),
                                            key=lambda name: (name.count("."), name))
        return name

    def _alloc(self, sid, st, category, module):
        if self.device is Device.CUDA and st.device.type == "cpu":
            return  # host memory (e.g. Adam's step counters): not on the GPU
        n = st.nbytes()
        self._sizes[sid] = n
        self._cats[sid] = category
        self._refs[sid] = weakref.ref(st, lambda _, sid=sid: self._free(sid))
        self.live_bytes += n
        gpu = self._current_gpu()
        if gpu:
            self._gpu[sid] = gpu
        self._alloc_event(Event(ALLOC, sid, n, category, module or self._module(), self.phase, self.step, gpu))

    def _alloc_event(self, event: Event) -> None:
        """Append an ALLOC event, with its Python stack when ``record_stacks``."""
        self.log.events.append(event)
        if self.record_stacks:
            self.log.stacks[id(event)] = self._stacks.record(skip=2)  # past this method and its caller

    def _free(self, sid):
        if self._closed:
            return
        n = self._sizes.pop(sid, None)
        if n is None:
            return
        category = self._cats.pop(sid)
        self._refs.pop(sid, None)
        self.live_bytes -= n
        self.log.events.append(Event(FREE, sid, n, category, None, self.phase, self.step, self._gpu.pop(sid, 0)))

    def _recat(self, sid, category, module):
        self._cats[sid] = category
        self.log.events.append(Event(RECAT, sid, 0, category, module, self.phase, self.step, self._gpu.get(sid, 0)))

    # ---- the dispatch hook -------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self._op_gpu
        if self.multi_gpu:  # the op allocates where its first tracked input lives
            self._op_gpu = self._input_gpu(args, kwargs)
        try:
            func, args, kwargs = self._grad_sums.real_op(func, args, kwargs)
            rule = DISPATCH_RULES.get(func) or named_rule(func)
            out = rule(self, func, args, kwargs) if rule is not None else func(*args, **kwargs)
            self.track(out)
            if func._overloadpacket in _BLAS_OPS:  # the thread's handle takes its workspace now
                thread = AUTOGRAD_THREAD if self.phase is Phase.BACKWARD else MAIN_THREAD
                self.log.blas_first.setdefault((thread, self._current_gpu()), len(self.log.events))
            self.known.observe(func, args, kwargs, out)
            if self.if_unpadded:
                self.if_unpadded.observe(func, args, kwargs, out)
            self._count_work(func, args, kwargs, out)
            return out
        finally:
            self._op_gpu = before

    def _count_work(self, func, args, kwargs, out) -> None:
        """Add the op's FLOPs (torch.utils.flop_counter's formulas) and one kernel launch,
        unless the op only makes a view or an uninitialised buffer (no kernel runs)."""
        if func.is_view or func._overloadpacket in _NO_KERNEL:
            return
        formula = _FLOPS.get(func._overloadpacket)
        flops = 0
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not know this overload's arguments
                flops = 0
        work = self.log.work.setdefault((self.step, self.phase, self._current_gpu()), [0, 0, 0])
        work[0] += flops
        if flops and _low_precision(args):
            work[1] += flops
        work[2] += 1

    def _input_gpu(self, args, kwargs) -> int:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key is not None and key[0] in self._sizes:
                    return self._gpu.get(key[0], 0)
        return self._base_gpu
