"""Recorded results: one typed record per kind, saying where it was measured and which code it measured.

Every JSON under ``data/bench/`` and ``data/notebooks/`` is a record. Its ``kind`` names the type that reads it
(:data:`KINDS`); ``provenance`` says where and when it was made (:func:`glmvit.provenance.collect`); ``fingerprint``
says which code it measured. A process that tracks what runs (:mod:`glmvit.fingerprint`: ``python -m glmvit`` on
Python 3.12+) records ``units``: a content hash of every function, class body and module statement that ran, so a
record goes *stale* (:func:`staleness`) only when one of those no longer exists anywhere in the tree: a renamed
local, a moved or renamed function, an edited comment, docstring or annotation leave it current. A process that
does not track records ``modules``: one hash per glmvit module it had imported, over the module's syntax tree with
docstrings removed, so any code change in such a module stales it. Every reader can say which. Left out of both are
the modules that cannot change a measured number (:data:`UNFINGERPRINTED`): the recording machinery itself and the
command dispatchers.

A notebook's GPU cell adds the source of its compute function as ``<cell NAME>``: the notebook's own code is part
of what its result depends on (:func:`glmvit.env.run_or_replay` checks it when it replays).

Types are pydantic models: they validate a file when it is read (a wrong shape is a ``ValueError`` naming the file)
and write it back exactly; fields no reader needs stay in the record as extras.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
    with_config,
)
from typing_extensions import Required, TypedDict

from . import fingerprint as tracker
from .files import read_bounded
from .fingerprint import UNFINGERPRINTED, dump, without_docstrings
from .modes import RunMode
from .packing import MAX_TABLE_TOKENS

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent
DATA = REPO / "data"
RECORD_DIRS = (DATA / "bench", DATA / "notebooks")
RUN_ENV = "GLMVIT_RECORD_RUN"
MAX_RECORD_BYTES = 64 * 2**20  # the largest record readers accept (the biggest today is under 1 MB)


class _Open(BaseModel):
    """A JSON object that keeps the fields it does not name (``extra="allow"``)."""

    model_config = ConfigDict(extra="allow")


class Provenance(_Open):
    """Where and how a result was measured (:func:`glmvit.provenance.collect`)."""

    device: str | None = None
    gpu: str | None = None
    driver: str | None = None
    cuda: str | None = None
    cudnn_frontend: str | None = None
    nvmath: str | None = None
    torch: str | None = None
    triton: str | None = None
    transformers: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None
    command: str | None = None
    date_utc: str | None = None

    @property
    def short_commit(self) -> str:
        return (self.git_commit or "unknown")[:7]


class Fingerprint(BaseModel):
    """The code a record measured: ``units`` (label → hash of each unit that ran, :mod:`glmvit.fingerprint`), or
    ``modules`` (module name → hash of its syntax tree without docstrings) from a process that did not track; either
    may hold ``<cell NAME>`` entries (a notebook cell's source). Written without the one it does not use."""

    model_config = ConfigDict(extra="forbid")
    modules: dict[str, str] = Field(default_factory=dict)
    units: dict[str, str] | None = None

    @model_serializer(mode="wrap")
    def _leave_out_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("units") is None:
            data.pop("units", None)
        elif not data.get("modules"):
            data.pop("modules", None)
        return data

    @property
    def digest(self) -> str:
        """One hash over every entry: equal digests, equal code."""
        text = "\n".join(f"{name}={h}" for name, h in sorted({**self.modules, **(self.units or {})}.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def merged(self, other: Fingerprint) -> Fingerprint:
        """Both fingerprints' entries: the code of a record measured in several processes (a server and its load)."""
        units = None if self.units is None and other.units is None else {**(self.units or {}), **(other.units or {})}
        return Fingerprint(modules={**self.modules, **other.modules}, units=units)


class Record(_Open):
    """What every record has. ``elapsed_s``: wall time of the command that made it (plans how long a re-record
    takes); ``record_run``: the id of the ``python -m glmvit record`` run that made it, if one did."""

    kind: str
    provenance: Provenance
    fingerprint: Fingerprint | None = None
    elapsed_s: float | None = None
    record_run: str | None = None


class RunnerSource(BaseModel):
    """Where a graph mode's runner came from in a record run, whose jobs share what they capture and compile
    (:class:`glmvit.cli.session.Session`): the job that captured it, whether that was an earlier job (``reused``:
    then ``capture_s`` and ``capture_reserved_bytes`` are that capture's, not this job's), and for a compiled
    runner the jobs whose compiled code torch.compile held when it was captured (empty: compiled from nothing, as
    its command alone compiles). Absent from a record made by the command alone."""

    captured_by: str | None = None
    reused: bool = False
    capture_s: float | None = None
    capture_reserved_bytes: int | None = None
    compiled_after: list[str] = Field(default_factory=list)


class _MaybeLent(_Open):
    """An object that may name a lent runner: ``runner_source`` is written only when there is one."""

    runner_source: RunnerSource | None = None

    @model_serializer(mode="wrap")
    def _leave_out_unlent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("runner_source") is None:
            data.pop("runner_source", None)
        return data


class ModeResult(_MaybeLent):
    """One mode of a benchmark: how many requests, and their per-request wall times; a graph mode's
    ``runner_source`` when a record run lent its runner (:class:`RunnerSource`)."""

    requests: int
    mean_ms: float
    median_ms: float
    p99_ms: float


class BenchSettings(_Open):
    workload: str | None  # a named preset, or None for a bucket config given on the command line
    num_requests: int
    budgets: list[int]
    max_items: int
    max_segments: int
    attn_backend: str
    dtype: str
    config: str


class BenchRecord(Record):
    """``python -m glmvit bench``: every request's time per mode, the floor, ratios, accuracy, the prediction."""

    kind: Literal["bench"] = "bench"
    settings: BenchSettings
    workload: dict[str, Any]
    floor: dict[str, Any]
    modes: dict[str, ModeResult]
    accuracy: dict[str, Any] = Field(default_factory=dict)
    ratios: dict[str, Any] = Field(default_factory=dict)
    prediction: dict[str, Any] | None = None


M = TypeVar("M", bound=BaseModel)


def _p99_not_below_median(times: M) -> M:
    """``times`` itself, if each P99 it has is at least its median; a ValueError naming the field otherwise."""
    for mode in ("graph", "eager"):
        median, p99 = getattr(times, f"{mode}_ms"), getattr(times, f"{mode}_p99_ms")
        if p99 is not None and p99 < median:
            raise ValueError(f"{mode}_p99_ms {p99:g} is below its median {mode}_ms {median:g}")
    return times


# Numbers as JSON writes them (strict): no true for 1, no "64" or "1.5" for a number, no 64.7 for an integer.
# A measured time is finite, never negative, and under 10⁹ ms (11 days: the fit's arithmetic stays far from
# overflow); Σ L² counts patch rows, four to a token.
Milliseconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False, strict=True)]
Seconds = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False, strict=True)]
Tokens = Annotated[int, Field(ge=1, le=MAX_TABLE_TOKENS, strict=True)]
SegmentRows2 = Annotated[int, Field(ge=0, le=(4 * MAX_TABLE_TOKENS) ** 2, strict=True)]
Limit = Annotated[int, Field(ge=1, strict=True)]
BudgetKey = Annotated[str, Field(pattern=r"^[1-9][0-9]{0,6}$")]  # a budget as a JSON object's key: "64"


@with_config(ConfigDict(extra="allow"))
class CaptureTime(TypedDict, total=False):
    """One budget's capture in a latency table: its seconds, and whatever else the capture recorded (a dict)."""

    seconds: Required[Seconds]


class LatencyLayout(_Open):
    """One batch layout of a budget, replayed and run eagerly: medians and P99s of each."""

    name: str
    real_tokens: Tokens
    segment_rows2: SegmentRows2
    graph_ms: Milliseconds
    eager_ms: Milliseconds
    graph_p99_ms: Milliseconds
    eager_p99_ms: Milliseconds

    @model_validator(mode="after")
    def _p99s(self) -> LatencyLayout:
        return _p99_not_below_median(self)


def _check_layouts_fit(tokens: int, layouts: list[LatencyLayout] | None) -> None:
    """A ValueError if a layout holds more real tokens than its budget."""
    for k, layout in enumerate(layouts or ()):
        if layout.real_tokens > tokens:
            raise ValueError(f"layout {k} holds {layout.real_tokens} real tokens, more than its budget's {tokens}")


class LatencyBudget(_Open):
    """A budget's layouts, the full one (its real tokens are the budget's) first."""

    tokens: Tokens
    graph_ms: Milliseconds
    eager_ms: Milliseconds
    layouts: list[LatencyLayout] = Field(min_length=1)

    @model_validator(mode="after")
    def _fits(self) -> LatencyBudget:
        _check_layouts_fit(self.tokens, self.layouts)
        return self


class LatencyRow(_Open):
    """One budget of a plain latency table: its times, and the layouts they came from if it has them."""

    tokens: Tokens
    graph_ms: Milliseconds
    eager_ms: Milliseconds
    graph_p99_ms: Milliseconds | None = None
    eager_p99_ms: Milliseconds | None = None
    layouts: Annotated[list[LatencyLayout], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _checks(self) -> LatencyRow:
        if (self.graph_p99_ms is None) != (self.eager_p99_ms is None):
            raise ValueError("graph_p99_ms and eager_p99_ms come together: give both or neither")
        _check_layouts_fit(self.tokens, self.layouts)
        return _p99_not_below_median(self)


class PlainLatencyTable(_Open):
    """A latency table without ``kind`` (written by hand or another tool): ``{"budgets": [...]}`` and labels."""

    budgets: list[LatencyRow] = Field(min_length=1)
    dtype: str = "bfloat16"
    config: str = "glm41v"
    provenance: dict[str, Any] = Field(default_factory=dict)
    capture: dict[BudgetKey, CaptureTime] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _p99_everywhere_or_nowhere(self) -> PlainLatencyTable:
        if len({r.graph_p99_ms is None for r in self.budgets}) > 1:
            raise ValueError("P99 columns on some budgets only: give graph_p99_ms and eager_p99_ms for every "
                             "budget or for none")
        return self


class LatencySweep(Record):
    """``python -m glmvit latency``: every budget replayed with several layouts, and the same batches eagerly."""

    kind: Literal["latency"] = "latency"
    dtype: str
    config: str
    attn_backend: str
    compiled: Annotated[bool, Field(strict=True)]
    max_items: Limit
    max_segments: Limit
    budgets: list[LatencyBudget]
    capture: dict[BudgetKey, CaptureTime] = Field(default_factory=dict)

    @property
    def mode(self) -> str:
        """The runner mode the sweep measured: ``graph-compiled`` or ``graph``."""
        return (RunMode.GRAPH_COMPILED if self.compiled else RunMode.GRAPH).value


class KernelsProfile(Record):
    """``python -m glmvit kernels``: one replay by kernel category, and every matmul and attention alone."""

    kind: Literal["kernels"] = "kernels"
    floor: dict[str, Any]
    layouts: dict[str, Any]
    backends: list[str]
    attention: dict[str, Any] = Field(default_factory=dict)
    gemm: dict[str, Any] = Field(default_factory=dict)
    profile: dict[str, Any] = Field(default_factory=dict)
    # per layout, the kernel ``auto`` runs there at its rows on that machine (its own profile is that kernel's);
    # empty in records made before FlashAttention-4 joined ``auto`` and where that machine had no ``auto``
    auto: dict[str, str] = Field(default_factory=dict)


class NcuProfile(Record):
    """``python -m glmvit ncu``: Nsight Compute's counters for every kernel of one graph replay, per layout."""

    kind: Literal["ncu"] = "ncu"
    ncu: str
    sections: list[str]
    layouts: dict[str, Any]


class StartupRecord(Record):
    """``tools/capture_time.py``: compile + capture of a budget ladder in fresh processes, cold and warm."""

    kind: Literal["startup"] = "startup"
    budgets: list[int]
    runs: dict[str, dict[str, Any]]


class InterpRecord(Record):
    """``python -m glmvit bench-interp``: the Triton interpolation kernel against grid_sample."""

    kind: Literal["interp"] = "interp"
    results: list[dict[str, Any]]


class TuneSweep(Record):
    """``tools/tune_kernels.py``: launch configurations swept; an input to the kernels' tables, not a result."""

    kind: Literal["tune"] = "tune"
    attention: dict[str, Any] = Field(default_factory=dict)
    gemm: list[dict[str, Any]] = Field(default_factory=list)


class ServerInfo(_MaybeLent):
    """One mode's server as it described itself (``/info``); ``runner_source`` when a record run lent its runner
    (:class:`RunnerSource`)."""


@with_config(ConfigDict(extra="allow"))
class ServePerRequest(TypedDict, total=False):
    """One run's requests, each list in the order they were drawn: whether each came back right, when it was sent
    (s after the first), its time to embedding and the server's queueing delay (ms), and the server's split of its
    time (``Server-Timing``, phase → ms; None for a request without one: a failure). A record made before the
    split was kept has no ``timing_ms``."""

    ok: list[bool]
    sent_s: list[float]
    tte_ms: list[float]
    queue_ms: list[float | None]
    timing_ms: list[dict[str, float] | None]


@with_config(ConfigDict(extra="allow"))
class ServeRun(TypedDict, total=False):
    """One run of a mode at a request rate (:func:`glmvit.cli.bench_serve.run_record`), read as the dict it is; its
    fields in the order bench-serve writes them (a record is written back as it was read), any other kept after
    them. ``request_rate``: requests per second, or ``"inf"``; ``time_split_ms``: the mean split (None: no server
    sent one); ``tte_ms`` and ``queue_ms``: mean, median, P99, min and max (each None without a success)."""

    mode: str
    request_rate: float | str
    burstiness: float
    max_concurrency: int | None
    requests: int
    successful: int
    refused: int
    failed: int
    errors: dict[str, int]
    time_split_ms: dict[str, float] | None
    duration_s: float
    requests_per_s: float
    items_per_s: float
    tokens_per_s: float
    vs_floor: float | None
    steady_items_per_s: float | None
    steady_vs_floor: float | None
    encoder_bound_vs_floor: float | None
    tte_ms: dict[str, float | None]
    queue_ms: dict[str, float | None]
    server: dict[str, Any]
    per_request: ServePerRequest
    saturation_share: float | None


class ServeRecord(Record):
    """``python -m glmvit bench-serve``: a served encoder under load, per mode and request rate."""

    kind: Literal["serve"] = "serve"
    settings: dict[str, Any]
    runs: list[ServeRun]
    servers: dict[str, ServerInfo] = Field(default_factory=dict)


class NotebookResult(Record):
    """A notebook GPU cell's result (:func:`glmvit.env.run_or_replay`); the result's own fields are extras."""

    kind: Literal["notebook"] = "notebook"
    name: str


R = TypeVar("R", bound=Record)
KINDS: dict[str, type[Record]] = {cls.model_fields["kind"].default: cls for cls in (
    BenchRecord, LatencySweep, KernelsProfile, NcuProfile, StartupRecord, InterpRecord, TuneSweep, ServeRecord,
    NotebookResult)}
RESULT_KINDS = frozenset(KINDS) - {"tune"}  # what `python -m glmvit record` re-measures; a tune sweep is an input


# ---------------------------------------------------------------------------------------------------------------
# Fingerprints
# ---------------------------------------------------------------------------------------------------------------
def source_hash(source: str) -> str:
    """Hash of Python source by its syntax tree without docstrings: comments, docs and layout do not count, nor the
    Python version that parses it (:func:`glmvit.fingerprint.dump`)."""
    return hashlib.sha256(dump(without_docstrings(ast.parse(source))).encode()).hexdigest()[:16]


def module_path(name: str, package: Path = PACKAGE) -> Path | None:
    """Where module ``glmvit.a.b`` lives in this tree (``a/b.py`` or ``a/b/__init__.py``); None if nowhere."""
    parts = name.split(".")[1:]
    base = package.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=None)
def _file_hash(path: Path, mtime_ns: int, size: int) -> str:
    return source_hash(path.read_text())


def tree_hash(name: str, package: Path = PACKAGE) -> str | None:
    """The hash of module ``name`` as this working tree has it now; None if it no longer exists."""
    path = module_path(name, package)
    if path is None:
        return None
    stat = path.stat()
    return _file_hash(path, stat.st_mtime_ns, stat.st_size)


def fingerprint_now(extra: dict[str, str] | None = None) -> Fingerprint:
    """The code this process measured, with ``extra`` entries added: the units that ran in the innermost open
    :func:`glmvit.fingerprint.scope`, or since :func:`glmvit.fingerprint.start` if none is open; in a process that
    does not track, every glmvit module it imported from this tree (see module docstring)."""
    units = tracker.current_units()
    if units is not None:
        return Fingerprint(units={**units, **(extra or {})})
    modules = {}
    for name in sorted(n for n in sys.modules if n == "glmvit" or n.startswith("glmvit.")):
        if name in UNFINGERPRINTED:
            continue
        h = tree_hash(name)
        if h is not None:
            modules[name] = h
    return Fingerprint(modules={**modules, **(extra or {})})


def staleness(record: Record, cells: dict[str, str] | None = None, package: Path | None = None) -> list[str]:
    """What changed since ``record`` was made, sorted: the units whose hash is nowhere in the tree at ``package``
    (default: this one) now, the modules whose hash differs, and the ``<cell …>`` entries whose current source hash
    (given in ``cells``) differs; ``["no fingerprint"]`` for a record made before fingerprints. Empty: current."""
    if record.fingerprint is None:
        return ["no fingerprint"]
    fp = record.fingerprint
    changed = []
    for name, h in fp.modules.items():
        if name.startswith("<"):
            continue
        if (tree_hash(name) if package is None else tree_hash(name, package)) != h:
            changed.append(name)
    if fp.units:
        present = tracker.tree_unit_hashes(PACKAGE if package is None else package)
        changed += [label for label, h in fp.units.items()
                    if not label.startswith("<") and h not in present and not tracker.plan_statement(label)]
    for name, h in {**fp.modules, **(fp.units or {})}.items():
        if name.startswith("<") and cells is not None and name in cells and cells[name] != h:
            changed.append(name)
    return sorted(changed)


MAX_NAMED = 3  # changes a one-line status names before it counts the rest


def changed_summary(changed: list[str] | tuple[str, ...]) -> str:
    """What :func:`staleness` found, in a few words: ``a, b, c and 5 more``."""
    named = ", ".join(changed[:MAX_NAMED])
    return named + (f" and {len(changed) - MAX_NAMED} more" if len(changed) > MAX_NAMED else "")


def describe(record: Record, path: str | Path | None = None, cells: dict[str, str] | None = None) -> str:
    """One line: what, where, at which commit, and whether it still describes this tree."""
    p = record.provenance
    where = f"{p.gpu or p.device or 'unknown device'}, commit {p.short_commit}, {p.date_utc or 'undated'}"
    changed = staleness(record, cells)
    status = "current" if not changed else "STALE: " + (
        "made before fingerprints" if changed == ["no fingerprint"] else changed_summary(changed) + " changed since")
    name = f"{Path(path).name}: " if path else ""
    return f"{name}{record.kind} record ({where}); {status}"


# ---------------------------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------------------------
def parse(data: Any, kind: type[M], source: str = "record") -> M:
    """``data`` (a decoded JSON object) as a record of type ``kind``; a ValueError naming ``source`` otherwise."""
    expected = kind.model_fields["kind"].default if "kind" in kind.model_fields else None
    if isinstance(data, dict) and expected and data.get("kind") != expected:
        raise ValueError(f"{source}: a {data.get('kind')!r} record, not the {expected!r} record expected")
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        what = f"not a valid {expected} record" if expected else "not valid"
        raise ValueError(f"{source}: {what} ({where}: {first['msg']})") from None


def load(path: str | Path, kind: type[R]) -> R:
    """Read the record at ``path`` as ``kind``: a one-line ValueError naming the file when it is not one."""
    return parse(_read(path), kind, str(path))


def _read(path: str | Path) -> Any:
    """The decoded JSON of a record file, read bounded (:func:`glmvit.files.read_bounded`); ValueError otherwise."""
    try:
        return json.loads(read_bounded(path, MAX_RECORD_BYTES, "record"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such record file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{path}: not a JSON record ({err})") from None


def load_any(path: str | Path) -> Record:
    """Read a record of whatever kind it says it is."""
    data = _read(path)
    name = data.get("kind") if isinstance(data, dict) else None
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"{path}: no known record kind ({name!r})")
    return parse(data, kind, str(path))


def to_json(record: Record) -> str:
    return json.dumps(record.model_dump(mode="json", exclude_none=False), indent=1) + "\n"


def make(kind: type[R], *, provenance: dict[str, Any], fingerprint: Fingerprint | None = None, **fields: Any) -> R:
    """A new record of ``kind`` from a result's fields, fingerprinted by this process unless given, and stamped with
    the ``python -m glmvit record`` run that made it (``GLMVIT_RECORD_RUN``) if any."""
    return kind.model_validate({**fields, "kind": kind.model_fields["kind"].default, "provenance": provenance,
                                "fingerprint": fingerprint or fingerprint_now(),
                                "record_run": os.environ.get(RUN_ENV)})


def record_files(dirs: tuple[Path, ...] = RECORD_DIRS) -> Iterator[Path]:
    for directory in dirs:
        yield from sorted(directory.glob("*.json"))


def find(kind: type[R], dirs: tuple[Path, ...] = RECORD_DIRS, **match: Any) -> list[tuple[Path, R]]:
    """Every record of ``kind`` whose fields equal ``match`` (e.g. ``find(LatencySweep, compiled=True)``)."""
    expected = kind.model_fields["kind"].default
    found = []
    for path in record_files(dirs):
        try:
            head = _read(path)
        except ValueError:
            continue
        if not isinstance(head, dict) or head.get("kind") != expected:
            continue
        record = parse(head, kind, str(path))
        if all(getattr(record, key, None) == value for key, value in match.items()):
            found.append((path, record))
    return found


def find_one(kind: type[R], dirs: tuple[Path, ...] = RECORD_DIRS, **match: Any) -> tuple[Path, R]:
    """The one record of ``kind`` matching ``match``; a ValueError saying what was looked for otherwise."""
    found = find(kind, dirs, **match)
    if len(found) != 1:
        what = ", ".join(f"{k}={v!r}" for k, v in match.items())
        names = ", ".join(p.name for p, _ in found) or "none"
        raise ValueError(f"expected one {kind.model_fields['kind'].default} record with {what}; found {names}")
    return found[0]
