"""The tracer's accounting, on sequences whose bytes can be worked out by hand."""

import sys
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memcheck.enums import Category, Device
from memcheck.trace.tracer import ALLOC, FREE, MemoryTracer
from memcheck.training.loop import run_steps


def live_by_category(tracer):
    totals = defaultdict(int)
    for sid, n in tracer._sizes.items():
        totals[tracer._cats[sid]] += n
    return dict(totals)


def test_allocation_and_free_are_recorded_as_they_happen():
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        a = torch.empty(1000, device="meta")  # 1000 * 4 B = 4000 B
        b = torch.empty(250, device="meta", dtype=torch.float64)  # 250 * 8 B = 2000 B
        assert tracer.live_bytes == 6000
        del a
        assert tracer.live_bytes == 2000
        del b
    kinds = [(e[0], e[2]) for e in tracer.log.events]
    assert kinds == [(ALLOC, 4000), (ALLOC, 2000), (FREE, 4000), (FREE, 2000)]


def test_views_share_their_base_storage():
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        a = torch.empty(10, 10, device="meta")  # 100 * 4 B = 400 B
        v = a.t()[2:5]  # a view: no new storage
        assert tracer.live_bytes == 400
        del a, v


def test_saved_for_backward_becomes_activation():
    tracer = MemoryTracer(Device.CPU)
    x = torch.empty(1000, device="meta", requires_grad=True)
    with tracer:
        tracer.watch(batch=x)  # 4000 B input
        y = x.exp()  # exp saves its result for backward: 4000 B activation
        z = y.sum()  # 0-dim float32: 4 B, saved by nobody
        cats = live_by_category(tracer)
        assert cats == {Category.INPUT: 4000, Category.ACTIVATION: 4000, Category.TEMPORARY: 4}
        del y, z


def test_steady_state_holds_params_and_adamw_state_after_zero_grad():
    # Linear(10, 5): (10*5 + 5) params * 4 B = 220 B.
    # AdamW keeps exp_avg and exp_avg_sq per parameter (2 * 220 B) and a float32
    # 'step' scalar per parameter tensor (2 * 4 B): 448 B of optimizer state.
    # Batch (3, 10) float32: 30 * 4 B = 120 B. After zero_grad(set_to_none) no grads remain.
    with torch.device("meta"):
        model = nn.Linear(10, 5)
        x = torch.empty(3, 10)
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        tracer.watch(model=model, batch=x)
        opt = torch.optim.AdamW(model.parameters())
        tracer.watch(optimizer=opt)
        run_steps(model, x, lambda m, b: m(b).sum(), opt, 2, tracer.set_phase)
        tracer._register_optimizer_state()
        assert live_by_category(tracer) == {
            Category.PARAMETER: 220,
            Category.OPTIMIZER: 448,
            Category.INPUT: 120,
        }


def test_gradients_are_categorised_when_accumulated():
    # Linear(10, 5, bias=False): 50 * 4 B = 200 B of weight, and the same of gradient.
    with torch.device("meta"):
        model = nn.Linear(10, 5, bias=False)
        x = torch.empty(3, 10)
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        tracer.watch(model=model, batch=x)
        model(x).sum().backward()
        assert live_by_category(tracer)[Category.GRADIENT] == 200


def test_trace_cost_does_not_grow_with_batch_or_length():
    # Meta tensors carry no data: the trace records the same events at batch 2 x 16
    # tokens as at batch 64 x 1024, only with larger byte counts.
    from transformers import GPT2Config, GPT2LMHeadModel

    from memcheck.trace.tracer import MemoryTracer as Tracer

    counts = []
    for batch, length in [(2, 16), (64, 1024)]:  # (batch 1 makes some reshapes free views)
        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2))
            ids = torch.zeros(batch, length, dtype=torch.long)
        tracer = Tracer(Device.CPU)
        with tracer:
            tracer.watch(model=model, batch=ids)
            model(input_ids=ids, labels=ids).loss.backward()
        counts.append(len(tracer.log.events))
    assert counts[0] == counts[1]


def test_weights_are_created_in_the_order_model_to_cuda_moves_them():
    # The load phase (issue 22): the caching allocator packs the weights as model.to("cuda")
    # creates them. torch's own Module._apply, given a function that records its argument,
    # says which order that is: children first, then a module's own parameters, then buffers.
    from torch import nn

    from memcheck.enums import ALLOC, Device
    from memcheck.trace.tracer import MemoryTracer

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(1))  # 4 B, the root's own: last
            self.a = nn.Linear(2, 3)  # weight 6 x 4 = 24 B, bias 3 x 4 = 12 B
            self.b = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))  # 48 B, 16 B; BN 16, 16 B + 8 B buffers

    with torch.device("meta"):
        model = Model()
    moved = []
    model._apply(lambda t: moved.append(t.untyped_storage().nbytes()) or t)
    tracer = MemoryTracer(Device.CUDA)
    tracer.watch(model=model)
    assert [e[2] for e in tracer.log.events if e[0] == ALLOC] == moved == [24, 12, 48, 16, 16, 16, 16, 16, 8, 4]


# ---- the autograd engine's sum of a tensor's gradients (issue 18, cause 5) -------------------------
N = 1024  # float32 elements: U = 4096 B per tensor


def _twice_used(x):
    """``h = -x`` feeds two ops, so the engine sums h's two gradients. Negation saves nothing for
    backward (and, unlike ``h * 2``, makes no 4 B tensor of a Python number), so only ``x`` and
    ``loss`` outlive the forward."""
    h = x.neg()
    return h.neg().sum() + h.neg().sum()


def _real_backward_peak(mode=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from memcheck.rules.probe import cpu_memory_events, running_peak

    x = torch.randn(N, requires_grad=True)
    loss = _twice_used(x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with mode if mode is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss.backward()
    return running_peak(n for _, n in cpu_memory_events(prof.profiler.kineto_results.events()))


def _traced_backward_peak() -> int:
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        x = torch.empty(N, device="meta", requires_grad=True)
        loss = _twice_used(x)
        start, live = len(tracer.log.events), 0
        loss.backward()
        peak = 0
        for kind, _, n, *_ in tracer.log.events[start:]:
            live += n if kind == ALLOC else -n if kind == FREE else 0
            peak = max(peak, live)
        del x, loss
    return peak


# Backward, above x and loss: the loss's gradient (a 4 B scalar, still held by the expand views the
# two SumBackward0 pass on); g1 = -grad (U); g2 = -grad (U), which the engine adds into g1 in place
# and frees; then x's gradient -g1 (U) while g1 lives, stolen into x.grad.
# Peak: 4 B + 2U = 8,196 B. Summed out of place (g1 + g2, a third U): 4 B + 3U = 12,292 B.
IN_PLACE_SUM = 4 + 2 * 4 * N
OUT_OF_PLACE_SUM = 4 + 3 * 4 * N


def test_a_real_backward_sums_a_twice_used_tensors_gradients_in_place():
    assert _real_backward_peak() == IN_PLACE_SUM


def test_any_dispatch_mode_makes_a_real_backward_sum_gradients_out_of_place():
    # torch's isTensorSubclassLike is true for every tensor while a dispatch mode is active, and the
    # engine's input buffer then adds out of place: the reason the tracer must undo it.
    assert _real_backward_peak(_DoNothing()) == OUT_OF_PLACE_SUM


def test_trace_sums_a_twice_used_tensors_gradients_in_place_as_a_real_run():
    assert _traced_backward_peak() == IN_PLACE_SUM


def _indexed(x):
    return x[torch.arange(0, 1024, 2, device=x.device)].sum()  # rows 0, 2, ..., 1022 of x


ROWS = (1024, 256)  # float32: U = 1024 * 256 * 4 B = 1,048,576 B


def _real_index_backward_peak(mode=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from memcheck.rules.probe import cpu_memory_events, running_peak

    x = torch.randn(ROWS, requires_grad=True)
    loss = _indexed(x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with mode if mode is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss.backward()
    return running_peak(n for _, n in cpu_memory_events(prof.profiler.kineto_results.events()))


class _DoNothing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# Backward of x[idx].sum(), above x and loss: the loss's gradient (4 B) expanded to the (512, 256)
# rows without a copy, then zeros like x (U) into which index_backward puts the rows in place
# (_index_put_impl_), stolen into x.grad: 4 B + U = 1,048,580 B. Out of place (zeros.index_put(...),
# what torch does under any dispatch mode) copies the zeros first: 4 B + 2U = 2,097,156 B.
INDEX_IN_PLACE = 4 + 1024 * 256 * 4
INDEX_OUT_OF_PLACE = 4 + 2 * 1024 * 256 * 4


def test_a_real_index_backward_fills_its_zeros_in_place_unless_a_dispatch_mode_is_active():
    assert _real_index_backward_peak() == INDEX_IN_PLACE
    assert _real_index_backward_peak(_DoNothing()) == INDEX_OUT_OF_PLACE


def test_trace_fills_an_index_backwards_zeros_in_place_as_a_real_run():
    tracer = MemoryTracer(Device.CPU)
    with tracer:
        x = torch.empty(ROWS, device="meta", requires_grad=True)
        loss = _indexed(x)
        start, live, peak = len(tracer.log.events), 0, 0
        loss.backward()
        for kind, _, n, *_ in tracer.log.events[start:]:
            live += n if kind == ALLOC else -n if kind == FREE else 0
            peak = max(peak, live)
        del x, loss
    assert peak == INDEX_IN_PLACE


class _UnusedBranch(nn.Module):
    """A model that computes a second output and drops it, as SigLIP's image classifier drops its
    attention-pooling head's output (its loss reads the mean of the last hidden state)."""

    def __init__(self, width=64):
        super().__init__()
        self.pre, self.fc = nn.Linear(width, width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.pre(x)
        self.down(torch.relu(self.up(h)))  # its graph: relu's output saved, (4, 196, 256) fp32 = 802,816 B
        return self.fc(h).mean(1)


def test_a_graph_no_loss_uses_is_freed_with_its_output_as_in_a_real_run():
    # The tracer's pack hook kept each saved tensor with its grad_fn; for relu's own output that is
    # the node holding it, a cycle only a backward breaks, so the unused branch's graph (relu's
    # 802,816 B output and the rest) lived on into the next step's peak: +46% here before.
    import memcheck
    from memcheck.measure.local import measure_cpu

    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            return _UnusedBranch(), torch.randn(4, 196, 64)

    def loss_fn(model, batch):
        return model(batch).sum()

    measured = measure_cpu(lambda: build("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn)
    model, batch = build("meta")
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss_fn)
    assert est.peak_bytes == measured.steady_peak_bytes


class _Body(nn.Module):
    """Returns its hidden state and a pooled output of it, as a ModelOutput holds both."""

    def __init__(self, width):
        super().__init__()
        self.pre, self.head = nn.Linear(width, width), _Head(width)

    def forward(self, x):
        h = self.pre(x)
        return h, self.head(h)


class _Head(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h):
        return self.down(torch.relu(self.up(h)))


class _DropsPooled(nn.Module):
    """SigLIP's image classifier in small: the loss reads the hidden state, the pooled output is dropped."""

    def __init__(self, width=64):
        super().__init__()
        self.body, self.big = _Body(width), nn.Linear(width, 8 * width)

    def forward(self, x):
        h, _pooled = self.body(x)
        return self.big(h).mean(1)


def test_a_dropped_output_beside_a_used_one_is_freed_after_the_forward_as_in_a_real_run():
    # ModuleTracker's gradient hook on body's two outputs held both grad_fns, the dropped one's graph
    # with them, to the optimizer step: the backward's peak was 124,924 B (3.8%) over the real run's.
    import memcheck
    from memcheck.measure.local import measure_cpu

    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            return _DropsPooled(), torch.randn(4, 196, 64)

    def loss_fn(model, batch):
        return model(batch).sum()

    measured = measure_cpu(lambda: build("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn)
    model, batch = build("meta")
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss_fn)
    assert abs(est.peak_bytes - measured.steady_peak_bytes) <= 0.001 * measured.steady_peak_bytes


class _NormFromAdapters(nn.Module):
    """PEFT's DoRA layer in small (peft/tuners/lora/dora.py, ``DoraLinearLayer.forward``): a weight norm
    from ``b(a(eye))`` computed in grad mode and detached, so its graph is a dead end the layer drops."""

    def __init__(self, width=256, rank=4, eye=64):
        super().__init__()
        self.a, self.b = nn.Linear(eye, rank, bias=False), nn.Linear(rank, width, bias=False)
        self.m = nn.Parameter(torch.ones(width))

    def forward(self, x):
        w = self.b(self.a(torch.eye(self.a.in_features, device=x.device)))
        norm = w.detach().norm(dim=0)
        return x * (self.m / norm)


class _LossInside(nn.Module):
    """A model that computes its loss in its own forward (transformers' ``labels=``), after a transient
    only the forward makes: the step's peak is there, before the root module returns."""

    def __init__(self, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(_NormFromAdapters() for _ in range(layers))
        self.head = nn.Linear(256, 64)

    def forward(self, x, seen=None):
        for layer in self.layers:
            x = layer(x)
        if seen is not None:
            seen()
        scale = torch.ones(x.shape[0], 1024, device=x.device).mean(-1, keepdim=True)  # 512 x 1024 x 4 B = 2 MiB
        return (self.head(x) * scale).mean()


def test_a_layers_dead_end_graph_is_freed_as_the_layer_returns():
    # ModuleTracker's hooks on a's and b's outputs held their nodes, and with them what those nodes
    # saved, until the root module returned. After one layer, beside what it had before the forward:
    # its output x * (m / norm), (8, 256) x 4 B = 8,192 B, and norm, 256 x 4 B = 1,024 B, which the
    # division saves (d(m / norm)/dm = 1 / norm; x needs no gradient, so the product saves x, live
    # already): 9,216 B. The hooks also held eye (64 x 64 x 4 B = 16,384 B, saved by a for a's weight
    # gradient) and a's output (64 x 4 x 4 B = 1,024 B, saved by b): 26,624 B before the fix.
    tracer = MemoryTracer(Device.CPU)
    with torch.device("meta"):
        model, x = _LossInside(layers=1), torch.randn(8, 256)
    seen = []
    with tracer:
        tracer.watch(model, x)
        before = tracer.live_bytes
        model(x, seen=lambda: seen.append(tracer.live_bytes))
    assert seen[0] - before == 8_192 + 1_024


def test_dead_end_graphs_do_not_raise_a_peak_reached_before_the_root_returns():
    # PEFT's DoRA under a transformers model with labels: the peak is at the loss, in the root's
    # forward. Before the fix the trace held 4 x 17,408 B (eye and a's output per layer, above) there:
    # 4,887,808 B against the real run's 4,818,188 B (+1.4%); now within 12 B of it.
    import memcheck
    from memcheck.measure.local import measure_cpu

    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            return _LossInside(), torch.randn(512, 256)

    def loss_fn(model, batch):
        return model(batch)

    measured = measure_cpu(lambda: build("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn)
    model, batch = build("meta")
    est = memcheck.estimate(model, batch, device="cpu", optimizer="sgd", loss_fn=loss_fn)
    assert abs(est.peak_bytes - measured.steady_peak_bytes) <= 0.001 * measured.steady_peak_bytes


class _CppNode:
    """A C++ autograd node: only its children (``next_functions``) matter to the walk."""

    def __init__(self, children=()):
        self.children = list(children)


class _Wrappers:
    """``functionToPyObject`` (torch/csrc/autograd/python_cpp_function.cpp) as torch <= 2.12 runs
    it: a node hands out its live Python wrapper if it has one, else a new one, and the node does
    not keep it alive. The allocator's reuse of a dropped wrapper's address is made certain here:
    a wrapper no one but this pool holds any more is handed out again, the same object (so the
    same ``id``), for the next node that needs one."""

    def __init__(self):
        self.pool = []

    def wrap(self, node):
        # sys.getrefcount(w) inside the loops: the pool, the loop variable and the call's argument: 3
        for w in self.pool:
            if w.node is node and sys.getrefcount(w) > 3:
                return w
        for w in self.pool:
            if sys.getrefcount(w) <= 3:  # dropped by everyone else: its address is free again
                w.node = node
                return w
        self.pool.append(_Wrapper(self, node))
        return self.pool[-1]


class _Wrapper:
    def __init__(self, pool, node):
        self.pool, self.node = pool, node

    @property
    def next_functions(self):
        return tuple((self.pool.wrap(child), 0) for child in self.node.children)


def _id_only_walk(roots):
    """The walk ``drop_unreachable`` made before: ids kept, nodes dropped."""
    reached, todo = set(), list(roots)
    while todo:
        node = todo.pop()
        if id(node) not in reached:
            reached.add(id(node))
            todo.extend(child for child, _ in node.next_functions if child is not None)
    return reached


def test_the_node_walk_reaches_a_whole_chain_when_wrappers_are_dropped_and_their_addresses_reused():
    # Torch <= 2.12 lets a node's wrapper die when nothing holds it, and the next wrapper made may
    # take its address: an id-only walk then calls an unseen node seen. A 101-node chain: the
    # id-only walk stops after 3 (the root, held by the caller; its child; the grandchild, given
    # the child's freed wrapper, which the walk had just dropped, i.e. an id it has seen), as
    # as on torch 2.6 to 2.12 (issue 38; 2.13 keeps wrappers alive); holding the nodes reaches all 101.
    from memcheck.trace.tracer import reachable_nodes

    chain = [_CppNode()]
    for _ in range(100):
        chain.append(_CppNode([chain[-1]]))
    pool = _Wrappers()
    root = pool.wrap(chain[-1])
    assert len(_id_only_walk([root])) == 3  # the fake reproduces the failure
    reached = reachable_nodes([root])
    assert len(reached) == 101
    assert {id(w.node) for w in reached.values()} == {id(n) for n in chain}


def test_the_node_walk_reaches_every_node_of_a_real_101_node_graph():
    # x (a leaf: AccumulateGrad) then 100 multiplications (MulBackward0 each): 1 + 100 = 101 nodes.
    # On torch 2.6 to 2.12 the id-only walk found 2 of them.
    from memcheck.trace.tracer import reachable_nodes

    x = torch.ones(3, requires_grad=True)
    y = x
    for _ in range(100):
        y = y * 1.0
    reached = reachable_nodes([y.grad_fn])
    assert len(reached) == 101
    assert sum(type(n).__name__ == "MulBackward0" for n in reached.values()) == 100
