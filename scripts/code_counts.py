"""How the package is laid out, counted with ``ast``: what the layout issue's closing note reports.

    .venv/bin/python scripts/code_counts.py [--max-file-lines 500] [--max-function-lines 80]

Prints the product files over the line limit, the functions over theirs, the import circles, and in
how many places each concept that was once written two or three times is written now; the last line
is ``key=value`` pairs. Exit status 1 if any limit is passed or a concept is written more than once.

A concept is found by what writes it, not by its name, so a copy under another name still counts:

- publish: functions that rename a directory into place (``os.rename``/``os.replace`` of a
  directory whose target is a committed step or replica), i.e. callers of the one publish sequence's
  primitive outside ``storage/publish.py`` count as places of their own;
- store rounds: modules that wait on the coordination store's keys (``.wait(``), read them in
  bulk (``.multi_get(``) or count participants (``.add(``): the store client itself aside;
- settings: classes that declare a default for ``deadline_s`` (a CheckpointOptions field);
- replica rules: modules that decide whether a replica may move to a state (compare a replica's
  current state with ``ReplicaState`` members before moving it), outside ``catalog/transitions.py``;
- event names: modules holding a ``"ckptflow.<noun>.<verb>"`` event-name literal;
- promote_part: definitions of a function named ``promote_part``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckptflow"
EVENT_NAME = re.compile(r"^ckptflow\.(checkpoint|drill|retention|part|node)\.[a-z_]+$")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def long_files(limit: int) -> list[tuple[str, int]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out.append((str(path.relative_to(ROOT)), lines))
    return out


def long_functions(limit: int) -> list[tuple[str, int]]:
    """Functions and methods (decorators and docstring included) longer than ``limit`` lines."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - first + 1  # type: ignore[operator]
                if length > limit:
                    out.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", length))
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the ckptflow modules it imports anywhere (top level, lazily, for type hints);
    a package's ``__init__`` re-exports are left out (importing a facade is no circle)."""
    modules = {m: p for m, p in _modules().items() if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def _attr(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def concept_places() -> dict[str, list[str]]:
    places: dict[str, list[str]] = {
        "publish": [],
        "store_rounds": [],
        "settings": [],
        "replica_rules": [],
        "event_names": [],
        "promote_part": [],
    }
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        tree = ast.parse(text, filename=rel)
        calls = _calls(tree)
        # publish: a directory renamed into place as a commit (publish_dir is the primitive).
        if any(_attr(c) == "publish_dir" for c in calls) and not rel.endswith("storage/atomic.py"):
            places["publish"].append(rel)
        # store rounds: waiting on keys of the coordination store, or counting acknowledgements.
        store_calls = [
            c
            for c in calls
            if isinstance(c.func, ast.Attribute)
            and c.func.attr in ("wait", "add", "multi_get")
            and "store" in ast.unparse(c.func.value)
        ]
        if store_calls and not rel.endswith("cluster/coord_store.py"):
            places["store_rounds"].append(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (
                        isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)
                        and item.target.id == "deadline_s"
                        and item.value is not None
                    ):
                        places["settings"].append(f"{rel}:{node.name}")
            if isinstance(node, ast.FunctionDef) and node.name == "promote_part":
                places["promote_part"].append(f"{rel}:{node.name}")
        if any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and EVENT_NAME.match(n.value)
            for n in ast.walk(tree)
        ):
            places["event_names"].append(rel)
        # replica rules: a replica's current state compared with ReplicaState members to decide a move.
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and "ReplicaState." in ast.unparse(node):
                if ".state" in ast.unparse(node.left) and "set_replica_state" in text:
                    places["replica_rules"].append(rel)
                    break
        if rel.endswith("catalog/transitions.py") and "REPLICA_TRANSITIONS" in text:
            if rel not in places["replica_rules"]:
                places["replica_rules"].append(rel)
    return places


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-file-lines", type=int, default=500)
    parser.add_argument("--max-function-lines", type=int, default=80)
    args = parser.parse_args()
    files = long_files(args.max_file_lines)
    functions = long_functions(args.max_function_lines)
    found = circles(import_graph())
    places = concept_places()
    print(f"product files over {args.max_file_lines} lines: {len(files)}")
    for name, lines in files:
        print(f"  {name}: {lines}")
    print(f"functions over {args.max_function_lines} lines: {len(functions)}")
    for name, lines in functions:
        print(f"  {name}: {lines}")
    print(f"import circles: {len(found)}")
    for component in found:
        print(f"  {sorted(component)}")
    print("places each concept is written:")
    for concept, where in places.items():
        print(f"  {concept}: {len(where)}  {', '.join(where)}")
    modules = len(list(PACKAGE.rglob("*.py")))
    lines = sum(len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py"))
    counts = " ".join(f"{c}={len(w)}" for c, w in places.items())
    print(
        f"modules={modules} lines={lines} long_files={len(files)} long_functions={len(functions)} "
        f"circles={len(found)} {counts}"
    )
    ok = not files and not functions and not found and all(len(w) <= 1 for w in places.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
