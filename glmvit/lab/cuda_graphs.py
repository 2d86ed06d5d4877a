"""Notebook 03's GPU measurements: the CUDA-graph rules on a small MLP, pools, launch gaps, host syncs."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..testing import forbid_host_syncs


class TinyMLP(nn.Module):
    """A few Linear layers; a Python flag (not a tensor) chooses the activation."""

    def __init__(self, width=32, depth=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.use_relu = True

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
            x = torch.relu(x) if self.use_relu else x
        return x


def random_state(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New weights for module, on its device, scaled like nn.Linear's (values of order 1/sqrt(width))."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=gen) / v.shape[-1] ** 0.5).to(v.device)
            for k, v in module.state_dict().items()}


def host_sync_probes(x: torch.Tensor, counts: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Calls that need a GPU value on the host; x is a float vector of 6, counts 6 repeat counts."""
    return {
        "x.sum().item()": lambda: x.sum().item(),
        "bool(x.sum() > 0)": lambda: bool(x.sum() > 0),
        "x.tolist()": lambda: x.tolist(),
        "x[x > 0]": lambda: x[x > 0],
        "torch.nonzero(x > 0)": lambda: torch.nonzero(x > 0),
        "x.repeat_interleave(counts)": lambda: x.repeat_interleave(counts),
        "x.masked_select(x > 0)": lambda: x.masked_select(x > 0),
        "torch.unique(x > 0)": lambda: torch.unique(x > 0),
    }


def _warm_up(net: nn.Module, *inputs: torch.Tensor, stream: torch.cuda.Stream | None = None) -> torch.cuda.Stream:
    """Run net on every input on a side stream (``stream``, or a new one), returned: lazy initialisation must happen
    before capture, and on the stream that captures, since some of it is per stream (cuBLAS makes a workspace for
    each stream on that stream's first matmul; made inside a capture, it would stay in the graph's private pool)."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for x in inputs:
            net(x)
    torch.cuda.current_stream().wait_stream(side)
    return side


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _capture_memory(net: nn.Module, static_x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, dict]:
    """Capture net(static_x) and a control capture of elementwise ops alone; what each kept allocated."""
    side = None
    for _ in range(3):
        side = _warm_up(net, static_x, stream=side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=side):
        static_y = net(static_x)  # allocated during capture: from the graph's private pool
    torch.cuda.synchronize()
    out = {"pool_reserved_bytes": torch.cuda.memory_reserved() - reserved,
           "allocated_after_capture_bytes": torch.cuda.memory_allocated() - allocated,
           "output_bytes": static_y.numel() * static_y.element_size()}
    allocated = torch.cuda.memory_allocated()  # the control: a capture without matmuls
    elementwise = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(elementwise, stream=side):
        elementwise_y = torch.relu(static_x) * 2
    torch.cuda.synchronize()
    out["elementwise_allocated_after_capture_bytes"] = torch.cuda.memory_allocated() - allocated
    out["elementwise_output_bytes"] = elementwise_y.numel() * elementwise_y.element_size()
    workspace_size = getattr(torch.backends.cuda, "cublas_workspace_size", None)  # not in every torch
    out["cublas_workspace_bytes"] = workspace_size() if workspace_size is not None else None
    return graph, static_y, out


def _eager(net: nn.Module, x: torch.Tensor, params: dict | None = None) -> torch.Tensor:
    with torch.no_grad():
        return net(x) if params is None else torch.func.functional_call(net, params, (x,))


def _rules(net: TinyMLP, graph: torch.cuda.CUDAGraph, static_x: torch.Tensor, static_y: torch.Tensor) -> dict:
    """Notebook 03's sections 2-5 on a real graph: replay vs eager, a rebound input, a flipped branch, the output."""
    dev, out = static_x.device, dict[str, Any]()
    addresses, diffs = {(static_x.data_ptr(), static_y.data_ptr())}, []
    for _ in range(3):  # copy in, replay, read out
        x = torch.randn(64, 512, device=dev)
        static_x.copy_(x)
        graph.replay()
        diffs.append(_diff(static_y, _eager(net, x)))
        addresses.add((static_x.data_ptr(), static_y.data_ptr()))
    out["replay_vs_eager_max_abs"] = max(diffs)
    out["replay_bitwise_equal"] = max(diffs) == 0
    out["addresses_stable"] = len(addresses) == 1
    rebound = torch.randn(64, 512, device=dev)  # 4.1: a new tensor where the captured input was meant
    graph.replay()
    out["rebound_input"] = {"new_address": rebound.data_ptr() != static_x.data_ptr(),
                            "vs_new_input": _diff(static_y, _eager(net, rebound)),
                            "vs_captured_buffer": _diff(static_y, _eager(net, static_x))}
    net.use_relu = False  # 4.3: the branch
    static_x.copy_(torch.randn(64, 512, device=dev) - 1)
    graph.replay()
    out["branch_flipped"] = {"vs_eager_now": _diff(static_y, _eager(net, static_x))}
    net.use_relu = True
    out["branch_flipped"]["vs_eager_with_relu"] = _diff(static_y, _eager(net, static_x))
    alias, owned = static_y, static_y.clone()  # 5: reference vs clone
    snapshot = owned.clone()
    static_x.copy_(torch.randn(64, 512, device=dev))
    graph.replay()
    out["output"] = {"reference_changed": not torch.equal(alias, snapshot), "clone_kept": torch.equal(owned, snapshot)}
    return out


def _weights(net: nn.Module, graph: torch.cuda.CUDAGraph, static_x: torch.Tensor, static_y: torch.Tensor) -> dict:
    """Notebook 03's 4.2 on a real graph, last (the graph keeps the old weights for good): copied, then assigned."""
    x = torch.randn(64, 512, device=static_x.device)
    static_x.copy_(x)
    addresses = [p.data_ptr() for p in net.parameters()]
    net.load_state_dict(random_state(net, 1))
    graph.replay()
    out = {"weights_copied": {"same_addresses": [p.data_ptr() for p in net.parameters()] == addresses,
                              "vs_eager": _diff(static_y, _eager(net, x))}}
    old = dict(net.named_parameters())  # keep the captured weights alive
    net.load_state_dict(random_state(net, 2), assign=True)
    graph.replay()
    moved = all(p.data_ptr() != a for p, a in zip(net.parameters(), addresses, strict=True))
    out["weights_assigned"] = {"new_addresses": moved,
                               "vs_eager": _diff(static_y, _eager(net, x)),
                               "vs_old_weights": _diff(static_y, _eager(net, x, old))}
    return out


def graph_basics() -> dict[str, Any]:
    """TinyMLP(512, depth 4) on 64 rows captured by torch.cuda.CUDAGraph: the memory the capture reserved and kept
    (next to an elementwise control), then notebook 03's rules checked on the real graph."""
    dev = torch.device("cuda")
    net = TinyMLP(width=512, depth=4).to(dev).eval()
    static_x = torch.zeros(64, 512, device=dev)
    graph, static_y, out = _capture_memory(net, static_x)
    out.update(_rules(net, graph, static_x, static_y))
    out.update(_weights(net, graph, static_x, static_y))
    torch.cuda.synchronize()
    return out


def _capture_sizes(net: nn.Module, inputs: dict[int, torch.Tensor], expected: dict[int, torch.Tensor],
                   order: list[int], shared: bool, stream: torch.cuda.Stream) -> dict[str, Any]:
    """Capture one graph per input size in ``order`` (one shared pool or one each); the memory reserved after each
    capture, and the worst replay-vs-eager difference over a scrambled replay order."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pool = torch.cuda.graph_pool_handle() if shared else None
    graphs, steps = {}, []
    for n in order:
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g, pool=pool, stream=stream):
            y = net(inputs[n])
        torch.cuda.synchronize()
        graphs[n] = (g, y)
        steps.append(torch.cuda.memory_reserved() - before)
    worst = 0.0
    for n in [256, 4096, 512, 2048, 1024, 4096, 256]:  # any order, one at a time
        g, y = graphs[n]
        g.replay()
        worst = max(worst, (y - expected[n]).abs().max().item())
    del graphs, g, y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"order": order, "reserved_after_each": steps, "replay_vs_eager_max_abs": worst}


def pool_strategies() -> dict[str, Any]:
    """Five graphs of TinyMLP(2048, depth 4) for 256 to 4096 rows, captured with a pool each, one shared pool
    largest first, and one shared pool smallest first."""
    dev = torch.device("cuda")
    width, sizes = 2048, [4096, 2048, 1024, 512, 256]
    net = TinyMLP(width=width, depth=4).to(dev).eval()
    inputs = {n: torch.randn(n, width, device=dev) for n in sizes}
    side = _warm_up(net, *inputs.values())  # warm-up for every shape, on the stream that captures
    with torch.no_grad():
        expected = {n: net(x) for n, x in inputs.items()}
    result: dict[str, Any] = {"sizes": sizes, "width": width, "activation_bytes": [n * width * 4 for n in sizes],
                              "strategies": {}}
    for name, order, shared in [("own pool per graph", sizes, False), ("shared, largest first", sizes, True),
                                ("shared, smallest first", sizes[::-1], True)]:
        result["strategies"][name] = _capture_sizes(net, inputs, expected, order, shared, side)
    return result


def _raises_under(guard: Callable[[], Any], fn: Callable[[], Any]) -> bool:
    try:
        with guard():
            fn()
    except AssertionError:
        return True
    return False


def _failed_capture() -> dict[str, Any]:
    """A real capture with ``.item()`` inside, on a stream of its own: what CUDA says."""
    x = torch.randn(6, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.stream(torch.cuda.current_stream()):  # restores the stream even if capture_end raises
            with torch.cuda.graph(graph, stream=stream):
                x.sum().item()
        return {"failed": False}
    except Exception as err:  # noqa: BLE001 - whatever CUDA says is the result
        first = err.__context__ if err.__context__ is not None else err
        return {"failed": True, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}",
                "first_error": f"{type(first).__name__}: {str(first).splitlines()[0]}"}


def host_syncs_on_gpu() -> dict[str, Any]:
    """Which of :func:`host_sync_probes` ``set_sync_debug_mode("error")`` and ``forbid_host_syncs`` catch on CUDA
    tensors; then a capture with ``.item()`` inside, which fails (last: its leftovers are never used again)."""
    dev = torch.device("cuda")
    probes = host_sync_probes(torch.randn(6, device=dev), torch.tensor([1, 2, 0, 1, 1, 1], device=dev))
    result: dict[str, Any] = {"sync_debug_mode": {}, "forbid_host_syncs": {}}
    for name, fn in probes.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            raised = False
        except RuntimeError:
            raised = True
        finally:
            torch.cuda.set_sync_debug_mode(0)
        result["sync_debug_mode"][name] = raised
        result["forbid_host_syncs"][name] = _raises_under(forbid_host_syncs, fn)
    result["capture"] = _failed_capture()
    return result


# ---- notebook 03's CPU views: the tape's listing and memory, the verdict table, the pool pictures ----


def tape_listing(tape: Any, names: dict[int, str]) -> list[str]:
    """One line per taped operator: what it read and wrote, tensors named by ``names`` (``data_ptr() → name``, for
    the inputs and weights). An output at a named address is a view ("nothing"); any other gets the name ``t{i}``,
    added to ``names``."""
    lines = []
    for i, (func, args, _kwargs, out) in enumerate(tape.ops):
        reads = ", ".join(names.get(a.data_ptr(), "?") for a in args if isinstance(a, torch.Tensor))
        if out.data_ptr() in names:
            writes = f"nothing: a view of {names[out.data_ptr()]}"
        else:
            writes = names[out.data_ptr()] = f"t{i}"
        lines.append(f"{i:>2}  {str(func):<18} reads {reads:<34} writes {writes}")
    return lines


def capture_allocations(tape: Any, outside: set[int]) -> dict[int, int]:
    """The tensors the capture created (``data_ptr() → bytes``): every taped output at an address not in ``outside``
    (the inputs' and weights'; a view of a weight shares its address and makes nothing)."""
    return {out.data_ptr(): out.numel() * out.element_size() for _f, _a, _k, out in tape.ops
            if out.data_ptr() not in outside}


def peak_alive(tape: Any, outside: set[int]) -> int:
    """Most tensors the capture created that are alive at once: one lives from the op that makes it to the last op
    that reads it; the output lives on past the capture."""
    from torch.utils._pytree import tree_leaves

    made: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (_func, args, kwargs, out) in enumerate(tape.ops):
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.data_ptr() in made:
                last[a.data_ptr()] = i
        if out.data_ptr() not in outside and out.data_ptr() not in made:
            made[out.data_ptr()] = i
    end = len(tape.ops)
    last[tape.ops[-1][3].data_ptr()] = end
    return max(sum(made[p] <= i <= last.get(p, made[p]) for p in made) for i in range(end + 1))


def raises_under(guard: Callable[[], Any], fn: Callable[[], Any]) -> bool:
    """Whether ``fn()`` raises inside ``with guard():`` an ``AssertionError`` (``forbid_host_syncs``) or a
    ``CaptureError`` (the tape); any other exception propagates."""
    from .tape import CaptureError

    try:
        with guard():
            fn()
    except (AssertionError, CaptureError):
        return True
    return False


def sync_table(caught: dict[str, tuple[bool, bool]], on_gpu: dict[str, bool]) -> str:
    """The host-sync verdicts side by side: per call, whether ``forbid_host_syncs`` and the tape raise (``caught``)
    and whether CUDA's sync debug mode did (``on_gpu``, a record's ``sync_debug_mode``)."""
    def mark(flag: bool) -> str:
        return "raises" if flag else "-"

    lines = [f"{'call':<30}{'forbid_host_syncs':>19}{'tape':>8}{'sync debug mode':>17}"]
    lines += [f"{name:<30}{mark(g):>19}{mark(t):>8}{mark(on_gpu[name]):>17}" for name, (g, t) in caught.items()]
    return "\n".join(lines)


def pool_growth(sweep: Any) -> dict[int, int]:
    """Bytes the memory pool grew by during each budget's capture in a latency sweep (``records.LatencySweep``)."""
    return {int(b): c["graph_bytes"] for b, c in sweep.capture.items()}


def plot_pool_growth(growth: dict[int, int], commit: str) -> Any:
    """Bars of :func:`pool_growth` in MiB, budgets in capture order (largest first). Returns the figure."""
    import matplotlib.pyplot as plt

    order = sorted(growth, reverse=True)
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    ax.bar([str(b) for b in order], [growth[b] / 2**20 for b in order])
    ax.set_xlabel("budget (tokens), in capture order"), ax.set_ylabel("pool growth during capture (MiB)")
    ax.set_title(f"one shared pool, largest first: later captures reuse its blocks ({commit})")
    fig.tight_layout()
    return fig


def plot_pool_strategies(pools: dict[str, Any]) -> Any:
    """Memory reserved after each capture, one line per strategy of :func:`pool_strategies`. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3))
    for name, s in pools["strategies"].items():
        ax.plot(range(1, len(s["order"]) + 1), [r / 2**20 for r in s["reserved_after_each"]], "o-",
                label=f"{name} ({' → '.join(map(str, s['order']))})")
    ax.set_xlabel("graphs captured"), ax.set_ylabel("memory reserved (MiB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
