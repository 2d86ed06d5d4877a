"""Whether a benchmark's compiled peer ran compiled: the rule that keeps a fallen-back peer out of the ratios.

``transformers-compiled`` is transformers' model under ``torch.compile(mode="reduce-overhead")``: inductor fuses its
elementwise ops and the launches they cost, so in every record run from s29_9873271r1 (H200) to s45_4540046r1 (H100)
it took 0.30–0.57× the time of ``transformers`` itself on the same requests (one 224² image and 8×448²; the
records' git history holds them). A compiled peer that takes about what ``transformers`` takes ran as if uncompiled
(dynamo falling back to eager after a recompile limit or a graph break does that), and a ratio to it would credit
glmvit with the peer's failure. :data:`COMPILED_PEER_MAX` draws
the line between the slowest compiled peer of those runs (0.57×) and no gain at all (1.0×).
``tools/readme_results.py`` prints no ratio for such a record and ``tests/test_recorded_data.py`` holds the rule.
Nothing that records imports this module: the records do not depend on it."""
from __future__ import annotations

from .records import BenchRecord

COMPILED_PEER_MAX = 0.75  # compiled peer median / transformers median, at most, for the peer to count as compiled


def compiled_peer_gain(record: BenchRecord) -> float | None:
    """``transformers-compiled``'s median over ``transformers``' median in one record; None without both modes."""
    modes = record.modes
    if "transformers-compiled" not in modes or "transformers" not in modes:
        return None
    return modes["transformers-compiled"].median_ms / modes["transformers"].median_ms


def compiled_peer_ran_compiled(record: BenchRecord) -> bool:
    """Whether the record's compiled peer counts as compiled (:data:`COMPILED_PEER_MAX`); True when it has none."""
    gain = compiled_peer_gain(record)
    return gain is None or gain <= COMPILED_PEER_MAX
