"""How the encoder runs, as two enums whose values are the strings of the command-line flags and the records.

:class:`RunMode` says what encodes a batch (``eager``, ``graph``, ``graph-compiled``); :class:`GraphMode` says how
a graph runner replays (``cuda``: real CUDA graphs; ``emulate``: the same bookkeeping with ``forward_static`` called
where a graph would replay, on any device). :meth:`GraphMode.for_device` is the one place that picks between them.
Both are ``str`` subclasses equal to (and hashing as) their values, so records and dictionaries keyed by the
strings keep working.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

_E = TypeVar("_E", bound="_StrEnum")


class _StrEnum(str, Enum):
    """An enum of strings that prints, formats and hashes as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __hash__(self) -> int:
        return hash(str(self.value))

    @classmethod
    def parse(cls: type[_E], value: Any) -> _E:
        """``value`` as a member (a member, or its string); a one-line ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown {cls.__name__} {value!r}; choose one of {choices}") from None


class RunMode(_StrEnum):
    """What encodes a batch: the eager forward, or captured budgets replayed (their forward compiled or not)."""

    EAGER = "eager"
    GRAPH = "graph"
    GRAPH_COMPILED = "graph-compiled"

    @property
    def graphs(self) -> bool:
        """Whether this mode replays captured budgets (a graph runner)."""
        return self is not RunMode.EAGER

    @property
    def compiled(self) -> bool:
        """Whether the captured forward is compiled first (``torch.compile``)."""
        return self is RunMode.GRAPH_COMPILED

    def label(self, graph_mode: "GraphMode | str | None") -> str:
        """The name this mode is reported under: a graph mode whose runner emulates is ``graph-emulated``
        (``graph-emulated-compiled`` when compiled): no CUDA graph is involved."""
        if not self.graphs or GraphMode.parse(graph_mode) is GraphMode.CUDA:
            return self.value
        return self.value.replace("graph", "graph-emulated", 1)


class GraphMode(_StrEnum):
    """How a graph runner replays: real CUDA graphs, or an emulation of them that runs anywhere."""

    CUDA = "cuda"
    EMULATE = "emulate"

    @classmethod
    def for_device(cls, device: Any) -> "GraphMode":
        """CUDA graphs on a CUDA device, emulation elsewhere (``device``: a torch.device or its string)."""
        kind = device if isinstance(device, str) else device.type
        return cls.CUDA if kind.split(":")[0] == "cuda" else cls.EMULATE


TABLE_MODES = (RunMode.GRAPH_COMPILED, RunMode.GRAPH)  # what a latency sweep measures (compiled first: the default)
