"""Which code a measurement ran, addressed by content: code units, the tracker that sees which of them ran, and the
unit hashes of a source tree. Standard library only, so importing it costs nothing.

**Units.** A module's units are each function or method (one per ``def``; a nested ``def`` is a unit of its own and
also part of its parent), each class body's statements other than ``def``s, and each top-level statement other than
a ``def`` or ``class`` (imports included, the module docstring not). A unit's hash covers its syntax tree with
docstrings, argument and return annotations removed, its own ``def`` name left out, decorators kept, and each
function's local names (bound in its body; not parameters, not ``global``/``nonlocal``) renamed in order of first
appearance. A glmvit function or class the unit names (directly, through an import, or as ``module.name``) stands
for that function's or class's content, not its name, so renaming or moving it changes no unit that calls it.

**What ran.** :func:`start` tracks every glmvit code object that starts (``sys.monitoring`` on Python 3.12+, each
code object reported once per :func:`scope` and then disabled, so tracking costs nothing after a function's first
call; on 3.11 only with ``force=True``, through the profiler hooks, which slow every call). The units a process or
scope *ran* are the functions that started, and for every module any of whose code started (a function, its import,
a class body): all its top-level statement and class-body units and its ``triton.jit`` kernels, whose bodies run on
the GPU and never start in Python. A module whose constants or whole namespace a used module imports counts as used
for its top-level and class-body units too. Files that cannot change a measured number (:data:`UNFINGERPRINTED`)
are never recorded, and a unit that names one of their functions holds its name, not its content. Of a plan module
(:data:`PLAN_MODULES`: the record run's job table) only the functions that ran count.

A record made from these units is stale when one of their hashes is no longer anywhere in the tree
(:func:`tree_unit_hashes`). So a renamed local, a renamed or moved function, an edited comment, docstring or
annotation leave it current; any other edit of code that ran does not, timing-only edits included, nor does an edit
of a function or class (any of its methods) that ran code names, even on a path that did not run. Code that ran only
in another process counts only when that process wrote its units (``GLMVIT_UNITS_FILE``, :func:`read_units`). Data
read from outside glmvit's source (weights, tables in JSON) is not code and never counts.
"""
from __future__ import annotations

import ast
import atexit
import copy
import hashlib
import json
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Callable, Iterator, Sequence

PACKAGE = Path(__file__).resolve().parent
ROOT = os.path.dirname(os.path.abspath(__file__))  # the package as imported: where its code objects say they live
UNITS_ENV = "GLMVIT_UNITS_FILE"
# Modules that cannot change a measured number: the recording machinery and the command dispatchers.
UNFINGERPRINTED = frozenset({"glmvit", "glmvit.__main__", "glmvit.cli", "glmvit.records", "glmvit.provenance",
                             "glmvit.fingerprint"})
# Modules whose top-level statements are a plan, not code a measurement runs (the record run's job table, its time
# estimates, its registry of job runners): only their functions that ran count. What a job measured is its command
# line, which its record's provenance names and ``glmvit record`` compares (``glmvit.cli.recorder.same_command``).
PLAN_MODULES = frozenset({"glmvit.cli.recorder"})
KERNEL_DECORATORS = frozenset({"triton.jit", "jit", "triton.autotune", "triton.heuristics"})

CodeKey = tuple[str, int, str]  # a code object by (file, first line, name)


# ---------------------------------------------------------------------------------------------------------------
# Syntax trees as stable text
# ---------------------------------------------------------------------------------------------------------------
def without_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with the docstring of every module, class and function in it removed (in place)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def dump(node: Any) -> str:
    """A syntax tree as text, the same on every Python from 3.10: fields that are empty (None or []) are left out
    (newer Pythons add such fields, 3.12's ``type_params``), and an f-string's literal parts are joined, empty ones
    dropped (3.12 parses some f-strings with an extra empty part), so ``ast.dump``'s differences do not count."""
    if isinstance(node, ast.JoinedStr):
        parts: list[Any] = []
        for value in node.values:
            if isinstance(value, ast.Constant) and parts and isinstance(parts[-1], ast.Constant):
                parts[-1] = ast.Constant(str(parts[-1].value) + str(value.value))  # literal parts are str
            elif not (isinstance(value, ast.Constant) and value.value == ""):
                parts.append(value)
        return f"JoinedStr(values={dump(parts)})"
    if isinstance(node, ast.AST):
        fields = [f"{name}={dump(field)}" for name in node._fields
                  if (field := getattr(node, name, None)) is not None and field != []]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(dump(item) for item in node) + "]"
    return repr(node)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Normalising one unit: locals renamed, annotations dropped, references to glmvit definitions by content
# ---------------------------------------------------------------------------------------------------------------
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_KEEP = ""  # in a scope's renaming: a name that stays as written and is never a reference (a parameter)


def _docstring(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)


def _binding_names(node: ast.AST) -> list[str]:
    """The names ``node`` itself binds or mentions as identifiers (not through its children)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
        return [node.name] if node.name else []
    if isinstance(node, ast.MatchMapping):
        return [node.rest] if node.rest else []
    if isinstance(node, ast.alias):
        return [node.asname or node.name] if node.asname or "." not in node.name else []
    if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return list(node.names)
    return []


def _scope_children(node: ast.AST) -> list[ast.AST]:
    """What of ``node`` belongs to the scope ``node`` is in: a nested function's, lambda's, class's or
    comprehension's body does not (its decorators, defaults, bases and first iterable do)."""
    if isinstance(node, _FUNCTIONS):
        return [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
    if isinstance(node, ast.Lambda):
        return [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
    if isinstance(node, ast.ClassDef):
        return [*node.decorator_list, *node.bases, *node.keywords]
    if isinstance(node, _COMPREHENSIONS):
        return [node.generators[0].iter]
    return list(ast.iter_child_nodes(node))


def _walk_scope(nodes: list[ast.AST]) -> list[ast.AST]:
    """Depth first, in field order: ``nodes`` and what of them belongs to their scope (:func:`_scope_children`)."""
    out: list[ast.AST] = []
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(_scope_children(node)))
    return out


def _locals(scope: ast.AST) -> tuple[list[str], set[str], set[str]]:
    """(the names ``scope`` binds locally in order of first appearance, its parameters, its ``global`` names)."""
    params: set[str] = set()
    if isinstance(scope, (*_FUNCTIONS, ast.Lambda)):
        a = scope.args
        params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None}
        walk = _walk_scope([scope.body] if isinstance(scope, ast.Lambda) else list(scope.body))
    else:  # a comprehension: its targets are its locals
        assert isinstance(scope, _COMPREHENSIONS)
        parts: list[ast.AST] = [x for gen in scope.generators for x in (gen.target, *gen.ifs)]
        parts += [gen.iter for gen in scope.generators[1:]]
        parts += [getattr(scope, f) for f in ("elt", "key", "value") if getattr(scope, f, None) is not None]
        walk = _walk_scope(parts)
    declared: set[str] = set()
    globals_: set[str] = set()
    bound: set[str] = set()
    for node in walk:
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            declared.update(node.names)
            if isinstance(node, ast.Global):
                globals_.update(node.names)
        elif isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                bound.add(node.id)
        elif isinstance(node, ast.NamedExpr):
            if isinstance(node.target, ast.Name):
                bound.add(node.target.id)
        else:
            bound.update(_binding_names(node))
    bound -= params | declared
    order: dict[str, None] = {}
    for node in walk:
        for name in _binding_names(node):
            if name in bound:
                order.setdefault(name)
    return list(order), params, globals_


Resolver = Callable[[str], "str | None"]  # a global name (or "module.attr") → the text standing for it, if any


class _Normaliser:
    """One unit's tree as text (the format of :func:`dump`): docstrings and argument and return annotations left
    out, locals renamed per scope, and names that resolve to a glmvit function or class replaced by what
    ``resolve`` gives for them."""

    def __init__(self, resolve: Resolver, is_module: Callable[[str], bool],
                 scopes: dict[int, tuple[list[str], set[str], set[str]]]) -> None:
        self.resolve = resolve
        self.is_module = is_module
        self.scopes = scopes  # _locals of each scope node, by id: kept by the tree the nodes belong to
        self.depth = 0

    def scope(self, node: ast.AST, env: dict[str, str]) -> dict[str, str]:
        if id(node) not in self.scopes:
            self.scopes[id(node)] = _locals(node)
        order, params, globals_ = self.scopes[id(node)]
        self.depth += 1
        inner = {k: v for k, v in env.items() if k not in globals_}
        inner.update({p: _KEEP for p in params})
        inner.update({name: f"~{self.depth}.{i}" for i, name in enumerate(order)})
        return inner

    def node(self, node: ast.AST, env: dict[str, str], **given: str | None) -> str:
        """``node`` as dump() writes it, with the fields in ``given`` as given (None: left out)."""
        fields = []
        for name in node._fields:
            if name in given:
                text = given[name]
            else:
                value = getattr(node, name, None)
                text = None if value is None or value == [] else self.text(value, env)
            if text is not None:
                fields.append(f"{name}={text}")
        return f"{type(node).__name__}({', '.join(fields)})"

    def body(self, body: list[ast.stmt], env: dict[str, str]) -> str:
        body = body[1:] if _docstring(body) else body
        return self.text(body or [ast.Pass()], env)

    def text(self, node: Any, env: dict[str, str]) -> str:
        if isinstance(node, list):
            return "[" + ", ".join(self.text(item, env) for item in node) + "]"
        if not isinstance(node, ast.AST):
            return repr(node)
        if isinstance(node, (*_FUNCTIONS, ast.Lambda)):
            inner = self.scope(node, env)
            a = node.args
            args = self.node(a, env, **{f: self.text(getattr(a, f), env) if getattr(a, f) else None
                                        for f in ("defaults", "kw_defaults")})  # arg: its name only
            if isinstance(node, ast.Lambda):
                return self.node(node, env, args=args, body=self.text(node.body, inner))
            return self.node(node, env, name=repr(env.get(node.name) or node.name), args=args,
                             body=self.body(node.body, inner), returns=None, type_comment=None)
        if isinstance(node, ast.arg):
            return f"arg(arg={node.arg!r})"
        if isinstance(node, ast.ClassDef):
            data = [s for s in node.body if not isinstance(s, (*_FUNCTIONS, ast.ClassDef))]
            own = {n for s in node.body for n in _binding_names(s)} | {
                t.id for s in data for t in ast.walk(s) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
            class_env = {**{k: v for k, v in env.items() if k not in own}, **{n: _KEEP for n in own}}
            body = node.body[1:] if _docstring(node.body) else node.body
            stmts = [self.text(s, env if isinstance(s, (*_FUNCTIONS, ast.ClassDef)) else class_env)
                     for s in body] or [self.text(ast.Pass(), env)]
            return self.node(node, env, name=repr(env.get(node.name) or node.name), body="[" + ", ".join(stmts) + "]")
        if isinstance(node, _COMPREHENSIONS):
            outer_iter = self.text(node.generators[0].iter, env)
            inner = self.scope(node, env)
            gens = []
            for k, gen in enumerate(node.generators):
                gens.append(self.node(gen, inner, iter=outer_iter if k == 0 else self.text(gen.iter, inner)))
            return self.node(node, inner, generators="[" + ", ".join(gens) + "]")
        if isinstance(node, ast.Name):
            renamed = env.get(node.id)
            if renamed:
                return self.node(node, env, id=repr(renamed))
            if renamed is None and isinstance(node.ctx, ast.Load) and (ref := self.resolve(node.id)):
                return f"Name(id={ref!r}, ctx=Load())"
            return self.node(node, env)
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and env.get(node.value.id) is None
                and isinstance(node.ctx, ast.Load) and self.is_module(node.value.id)
                and (ref := self.resolve(f"{node.value.id}.{node.attr}"))):
            return f"Name(id={ref!r}, ctx=Load())"
        if isinstance(node, ast.ImportFrom):
            names = []
            for alias in node.names:
                bound = alias.asname or alias.name
                if self.resolve(f"<from {node.level}:{node.module or ''}>.{alias.name}"):
                    # a glmvit definition: its name does not count (what names it elsewhere holds its content)
                    names.append(self.node(alias, env, name=repr("@def"), asname=repr(env[bound]) if env.get(bound)
                                           else None))
                else:
                    names.append(self.text(alias, env))
            return self.node(node, env, names="[" + ", ".join(names) + "]")
        if isinstance(node, ast.alias):
            bound = node.asname or node.name
            return self.node(node, env, asname=repr(env[bound]) if env.get(bound) else
                             repr(node.asname) if node.asname else None)
        if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name and env.get(node.name):
            return self.node(node, env, name=repr(env[node.name]))
        if isinstance(node, ast.MatchMapping) and node.rest and env.get(node.rest):
            return self.node(node, env, rest=repr(env[node.rest]))
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return self.node(node, env, names=repr([env.get(n) or n for n in node.names]))
        if isinstance(node, ast.JoinedStr):
            parts: list[Any] = []
            for value in node.values:
                if isinstance(value, ast.Constant) and parts and isinstance(parts[-1], ast.Constant):
                    parts[-1] = ast.Constant(str(parts[-1].value) + str(value.value))
                elif not (isinstance(value, ast.Constant) and value.value == ""):
                    parts.append(value)
            return f"JoinedStr(values={self.text(parts, env)})"
        return self.node(node, env)

# ---------------------------------------------------------------------------------------------------------------
# A source tree's units
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Module:
    name: str  # glmvit.a.b
    label: str  # glmvit/a/b.py
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)  # module-level functions and classes by name
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name → (module, attr or None)
    constants: set[str] = field(default_factory=set)  # other module-level names
    spans: list[tuple[int, int, str, str, str]] = field(default_factory=list)  # start, end, kind, name, label
    package: bool = False  # an __init__.py


def _is_kernel(node: ast.AST) -> bool:
    for dec in getattr(node, "decorator_list", ()):
        base = dec.func if isinstance(dec, ast.Call) else dec
        try:
            if ast.unparse(base) in KERNEL_DECORATORS:
                return True
        except (AttributeError, ValueError):
            continue
    return False


def _absolute(module: str, level: int, target: str | None, package: bool) -> str:
    """``from <level dots><target> import ...`` inside ``module``, as an absolute module name."""
    if not level:
        return target or ""
    parts = module.split(".")
    base = parts if package else parts[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


class _Tree:
    """Every module of one package directory, parsed once; unit hashes computed on demand and kept."""

    def __init__(self, package: Path) -> None:
        self.package = package
        self.modules: dict[str, _Module] = {}
        for path in sorted(package.rglob("*.py")):
            rel = path.relative_to(package.parent).as_posix()
            parts = rel[:-3].split("/")
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            try:
                tree = ast.parse(path.read_text(), rel)
            except (SyntaxError, ValueError, UnicodeDecodeError):
                continue  # a file that does not parse has no units: every record that ran it reads as changed
            self.modules[name] = self._index(name, rel, tree, parts[-1] == "__init__")
        self.identities: dict[tuple[str, str], str] = {}
        self.scopes: dict[int, tuple[list[str], set[str], set[str]]] = {}
        self._units: dict[str, dict[str, str]] = {}

    def _index(self, name: str, label: str, tree: ast.Module, package: bool) -> _Module:
        mod = _Module(name, label, tree, package=package)
        for stmt in tree.body:
            if isinstance(stmt, (*_FUNCTIONS, ast.ClassDef)):
                mod.defs[stmt.name] = stmt
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    local = alias.asname or alias.name.split(".")[0]
                    if isinstance(stmt, ast.ImportFrom):
                        source = _absolute(name, stmt.level, stmt.module, package)
                        mod.imports[local] = (source, alias.name)
                    elif alias.asname:
                        mod.imports[local] = (alias.name, None)
            else:
                mod.constants.update(n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)
                                     and isinstance(n.ctx, ast.Store))

        def spans(body: Sequence[ast.AST], prefix: str) -> None:
            for node in body:
                if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
                    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    qual = f"{prefix}{node.name}"
                    kind = "class" if isinstance(node, ast.ClassDef) else "def"
                    label = f"{mod.label}:<class {qual}>" if kind == "class" else f"{mod.label}:{qual}"
                    mod.spans.append((start, node.end_lineno or start, kind, node.name, label))
                    spans(node.body, f"{qual}." if kind == "class" else f"{qual}.<locals>.")
                else:  # defs inside if/try/with/match blocks
                    spans([c for c in ast.iter_child_nodes(node)
                           if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case))], prefix)
        spans(tree.body, "")
        count: dict[str, int] = {}
        for k, (start, end, kind, def_name, label) in enumerate(sorted(mod.spans)):
            count[label] = count.get(label, 0) + 1  # the same name defined twice (in if/else): #2 for the second
            mod.spans[k] = (start, end, kind, def_name, label if count[label] == 1 else f"{label}#{count[label]}")
        return mod

    # -- resolving names to definitions ------------------------------------------------------------------------
    def target(self, module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()
               ) -> tuple[str, str, str] | None:
        """What ``name`` in ``module`` is: ("def", module, name), ("module", module, ""), ("data", module, name);
        None if not glmvit's."""
        if (module, name) in seen:
            return None
        seen = seen | {(module, name)}
        mod = self.modules.get(module)
        if mod is None:
            return None
        if name in mod.defs:
            return ("def", module, name)
        if name in mod.imports:
            source, attr = mod.imports[name]
            if attr is None:
                return ("module", source, "") if source in self.modules else None
            return self.target(source, attr, seen) or (
                ("module", f"{source}.{attr}", "") if f"{source}.{attr}" in self.modules else None)
        if f"{module}.{name}" in self.modules:
            return ("module", f"{module}.{name}", "")
        if name in mod.constants:
            return ("data", module, name)
        return None

    def _lookup(self, module: str, text: str) -> tuple[str, str, str] | None:
        """``name``, ``module.attr`` or ``<from LEVEL:MODULE>.name`` as written in ``module``, resolved."""
        if text.startswith("<from "):
            head, name = text.rsplit(".", 1)
            level, target = head[6:-1].split(":", 1)
            source = _absolute(module, int(level), target or None, self.modules[module].package)
            return self.target(source, name) or (
                ("module", f"{source}.{name}", "") if f"{source}.{name}" in self.modules else None)
        if "." in text:
            head, attr = text.split(".", 1)
            found = self.target(module, head)
            return self.target(found[1], attr) if found and found[0] == "module" else None
        return self.target(module, text)

    def _normalised(self, module: str, node: ast.AST, deep: bool) -> str:
        """The text of one unit: ``deep``: named definitions by their identity, else by a mark (an identity)."""
        def resolve(text: str) -> str | None:
            found = self._lookup(module, text)
            if found is None or found[0] != "def":
                return None
            if found[1] in UNFINGERPRINTED:  # it cannot change a measured number: its name, not its content
                return f"@{found[1]}.{found[2]}"
            return "@" + self.identity(found[1], found[2]) if deep else "@def"

        def is_module(name: str) -> bool:
            found = self.target(module, name)
            return found is not None and found[0] == "module"

        text = _Normaliser(resolve, is_module, self.scopes).text(node, {})
        if isinstance(node, (*_FUNCTIONS, ast.ClassDef)):  # a unit is its content, not its name
            text = text.replace(f"(name={node.name!r}, ", "(name='', ", 1)
        return text

    def identity(self, module: str, name: str) -> str:
        """A module-level function's or class's content, independent of its name and place: what a unit that names
        it holds instead of the name (the definitions it names in turn count by a mark, not their content)."""
        key = (module, name)
        if key not in self.identities:
            self.identities[key] = _digest(self._normalised(module, self.modules[module].defs[name], deep=False))
        return self.identities[key]

    def units(self, module: str) -> dict[str, str]:
        """Every unit of ``module``: label → hash."""
        if module in self._units:
            return self._units[module]
        mod = self.modules[module]
        out: dict[str, str] = {}
        for label, node in self._unit_nodes(mod):
            out[label] = _digest(self._normalised(module, node, deep=True))
        self._units[module] = out
        return out

    def _unit_nodes(self, mod: _Module) -> Iterator[tuple[str, ast.AST]]:
        n = 0
        for stmt in mod.tree.body:
            if isinstance(stmt, (*_FUNCTIONS, ast.ClassDef)):
                continue
            if (not n and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str) and stmt is mod.tree.body[0]):
                continue  # the module docstring
            n += 1
            yield f"{mod.label}:<module stmt {n}>", stmt
        labels = {(s, k, nm): lb for s, _, k, nm, lb in mod.spans}
        for node in ast.walk(mod.tree):
            if not isinstance(node, (*_FUNCTIONS, ast.ClassDef)):
                continue
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            label = labels.get((start, kind, node.name), f"{mod.label}:{node.name}@{start}")
            if isinstance(node, ast.ClassDef):
                body = copy.copy(node)
                body.body = [s for s in node.body if not isinstance(s, (*_FUNCTIONS, ast.ClassDef))]
                yield label, body
            else:
                yield label, node

    def all_hashes(self) -> set[str]:
        return {h for module in self.modules for h in self.units(module).values()}

    # -- from code objects to units ------------------------------------------------------------------------------
    def module_of(self, path: str) -> str | None:
        """The module a file of this package is, by its path relative to the package's parent directory."""
        parts = path[:-3].split("/")
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        return name if name in self.modules else None

    def ran(self, keys: set[CodeKey], root: str) -> dict[str, str]:
        """The units that code objects ``keys`` (of files under ``root``) ran: see the module docstring."""
        defs: dict[str, set[str]] = {}
        used: set[str] = set()
        for filename, line, name in keys:
            rel = os.path.relpath(filename, os.path.dirname(root)).replace(os.sep, "/")
            module = self.module_of(rel)
            if module is None or module in UNFINGERPRINTED:
                continue
            used.add(module)
            spans = self.modules[module].spans
            exact = [lb for s, _, k, nm, lb in spans if s == line and nm == name and k == "def"]
            inside = [(s, lb) for s, e, k, _, lb in spans if k == "def" and s <= line <= e]
            nested = inside and name.startswith("<") and name != "<module>"  # a lambda or comprehension: its def
            label = exact[0] if exact else max(inside)[1] if nested else None
            if label is not None:
                defs.setdefault(module, set()).add(label)
        data = set(used)
        for module in used:  # a used module's imported constants and modules: their data counts too
            for local in self.modules[module].imports:
                found = self.target(module, local)
                if found is not None and found[0] in ("data", "module") and found[1] not in UNFINGERPRINTED:
                    data.add(found[1])
        out: dict[str, str] = {}
        for module in data:
            mod, units = self.modules[module], self.units(module)
            kernels = {f"{mod.label}:{nm}" for s, _, k, nm, _ in mod.spans if k == "def"
                       and _is_kernel(mod.defs.get(nm, ast.Pass()))} if module in used else set()
            for label, h in units.items():
                data_unit = (":<module stmt " in label or ":<class " in label) and module not in PLAN_MODULES
                if data_unit or label in defs.get(module, ()) or label in kernels:
                    out[label] = h
        return out


def plan_statement(label: str) -> bool:
    """Whether unit ``label`` is a top-level statement or class body of a :data:`PLAN_MODULES` module (which never
    counts; a record made before the rule may still name one)."""
    path, _, unit = label.partition(":")
    return unit.startswith(("<module stmt ", "<class ")) and path[:-3].replace("/", ".") in PLAN_MODULES


@lru_cache(maxsize=4)
def _tree(package: Path, signature: tuple[tuple[str, int, int], ...]) -> _Tree:
    return _Tree(package)


def _signature(package: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for path in sorted(package.rglob("*.py")):
        st = path.stat()
        out.append((str(path), st.st_mtime_ns, st.st_size))
    return tuple(out)


def tree(package: Path = PACKAGE) -> _Tree:
    """The parsed tree of ``package`` as it is now (kept while no file's (path, mtime, size) changes)."""
    package = Path(package)
    return _tree(package, _signature(package))


def tree_unit_hashes(package_dir: Path = PACKAGE) -> set[str]:
    """Every unit hash of every module under ``package_dir`` as the files are now."""
    return tree(package_dir).all_hashes()


# ---------------------------------------------------------------------------------------------------------------
# The tracker
# ---------------------------------------------------------------------------------------------------------------
class Scope:
    """What ran while it was open (:func:`scope`), and whatever was merged in with :meth:`add`."""

    def __init__(self) -> None:
        self.keys: set[CodeKey] = set()
        self.added: dict[str, str] = {}

    def add(self, units: dict[str, str]) -> None:
        """Merge units that ran elsewhere (another process's, :func:`read_units`)."""
        self.added.update(units)

    def units(self) -> dict[str, str]:
        """label → hash of every unit that ran in this scope (module docstring), and of those added."""
        return {**_units_of(self.keys), **self.added}


_lock = threading.Lock()
_state: dict[str, Any] = {"on": False, "tool": None, "profile": None, "started": set()}
_process = Scope()
_open: list[Scope] = []
_PREFIX = ROOT + os.sep


def _units_of(keys: set[CodeKey]) -> dict[str, str]:
    return tree(Path(ROOT)).ran(set(keys), ROOT)


def _note(code: CodeType) -> None:
    key = (code.co_filename, code.co_firstlineno, code.co_name)
    _process.keys.add(key)
    for s in tuple(_open):
        s.keys.add(key)


def _on_start(code: CodeType, offset: int) -> Any:
    prefix = _PREFIX  # None while the interpreter tears this module down
    if prefix is not None and code.co_filename.startswith(prefix):
        _note(code)
    return sys.monitoring.DISABLE  # type: ignore[attr-defined]


def _on_profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and frame.f_code.co_filename.startswith(_PREFIX):
        _note(frame.f_code)


def tracking() -> bool:
    """Whether this process is tracking (:func:`start`)."""
    return bool(_state["on"])


def start(force: bool = False) -> bool:
    """Track, process-wide, which glmvit code runs from now on (idempotent). On Python 3.12+ with
    ``sys.monitoring``; below that only with ``force`` (the profiler hooks, slow). True if tracking."""
    with _lock:
        if _state["on"]:
            return True
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is not None:
            free = [i for i in (4, 3, monitoring.OPTIMIZER_ID, monitoring.PROFILER_ID)
                    if monitoring.get_tool(i) is None]
            if not free:
                return False
            tool = free[0]
            monitoring.use_tool_id(tool, "glmvit.fingerprint")
            monitoring.register_callback(tool, monitoring.events.PY_START, _on_start)
            monitoring.set_events(tool, monitoring.events.PY_START)
            monitoring.restart_events()
            _state["tool"] = tool
        elif force:
            _state["profile"] = (sys.getprofile(), threading.getprofile() if hasattr(threading, "getprofile")
                                 else None)
            sys.setprofile(_on_profile)
            threading.setprofile(_on_profile)
        else:
            return False
        _state["on"] = True
        # what was imported before: its import ran, untracked; count those modules as used
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path and os.path.abspath(path).startswith(_PREFIX):
                _process.keys.add((os.path.abspath(path), 1, "<module>"))
        return True


def stop() -> None:
    """End tracking and forget what the process ran (what a test that started it must do)."""
    with _lock:
        if not _state["on"]:
            return
        if _state["tool"] is not None:
            monitoring = sys.monitoring  # type: ignore[attr-defined]
            monitoring.set_events(_state["tool"], 0)
            monitoring.register_callback(_state["tool"], monitoring.events.PY_START, None)
            monitoring.free_tool_id(_state["tool"])
            _state["tool"] = None
        else:
            previous, thread_previous = _state["profile"]
            sys.setprofile(previous)
            threading.setprofile(thread_previous)
        _state["on"] = False
        _process.keys.clear()
        _process.added.clear()


@contextmanager
def scope() -> Iterator[Scope]:
    """A :class:`Scope` that receives every tracked unit that runs while it is open (in any thread; scopes may nest
    and overlap). Opening one re-enables the events disabled so far, so code that ran before runs into it again."""
    s = Scope()
    _open.append(s)
    if _state["tool"] is not None:
        sys.monitoring.restart_events()  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        _open.remove(s)


def add_to_open(units: dict[str, str]) -> None:
    """Merge ``units`` into every scope open now: code that ran earlier for what runs now (a graph captured by an
    earlier job and replayed in this one)."""
    for s in tuple(_open):
        s.add(units)


def process_units() -> dict[str, str]:
    """Every unit this process ran since :func:`start` (empty if it never started)."""
    return _process.units() if _state["on"] else {}


def current_units() -> dict[str, str] | None:
    """The innermost open scope's units if tracking, else the process's if tracking, else None."""
    if not _state["on"]:
        return None
    return _open[-1].units() if _open else process_units()


# ---------------------------------------------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------------------------------------------
def units_path(prefix: str | Path, pid: int | None = None) -> Path:
    """Where a process with ``GLMVIT_UNITS_FILE=prefix`` writes its units: ``PREFIX.PID.json``."""
    return Path(f"{prefix}.{os.getpid() if pid is None else pid}.json")


def write_units(path: str | Path, units: dict[str, str] | None = None) -> None:
    """Write ``units`` (default: this process's) as JSON to ``path`` atomically (a temporary file, renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(process_units() if units is None else units, indent=0, sort_keys=True))
    os.replace(tmp, path)


def read_units(path: str | Path) -> dict[str, str]:
    """The units written by every process that had ``GLMVIT_UNITS_FILE=path`` (``path.*.json``), merged; or those of
    every ``*.json`` in ``path`` if it is a directory, or of the one file ``path``. ValueError naming a bad file."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else \
        [*([path] if path.is_file() else []), *sorted(path.parent.glob(f"{path.name}.*.json"))]
    merged: dict[str, str] = {}
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{file}: not a units file ({err})") from None
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{file}: not a units file (expected an object of label → hash strings)")
        merged.update(data)
    return merged


def start_from_env() -> bool:
    """If ``GLMVIT_UNITS_FILE`` is set: track (on any Python: it was asked for) and write this process's units to
    :func:`units_path` at exit. Called when glmvit is imported."""
    prefix = os.environ.get(UNITS_ENV)
    if not prefix or _state["started"]:
        return False
    _state["started"].add(prefix)
    start(force=True)
    atexit.register(lambda: write_units(units_path(prefix)))
    return True
