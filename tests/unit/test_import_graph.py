"""The layering, read from the import statements of `src/decentrl` (function-local ones included).

- A role (coordinator, trainer, worker, verifier) never imports another role; the shared parts
  import no role; only the launchers (`cli`, `commands`, `role_commands`, `launch/`) start roles.
- `protocol` and `config` reach no torch, transformers or safetensors, however indirectly.
- The coordinator's modules import each other without a cycle.
- Nothing imports the command line, and the installed package never imports `benchmarks/`.
- An environment owns its reward: `envs` never imports `rewards` (the rubric calls environments,
  not the other way round), and no module of either is named like a standard-library module.
- One meaning per file name: no two modules share a name, up to case, underscores and a plural
  `s` (`snapshot.py`/`snapshots.py`, `rundir.py`/`run_dir.py`), unless the name means the same
  thing in every package (`SHARED_MEANING`).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROLES = ("coordinator", "trainer", "worker", "verifier", "scorer", "envd")
LAUNCHERS = (
    "decentrl.cli",
    "decentrl.commands",
    "decentrl.role_commands",
    "decentrl.__main__",
    "decentrl.launch",
)
HEAVY = ("torch", "transformers", "safetensors", "peft")
SHARED_MEANING = {"__init__", "__main__", "main", "base", "registry", "loop", "task"}
"""File names that mean the same in each package: the package itself, a role's entry point, the
Protocol or ABC its variants implement, the table of its built-ins, a role's loop, an
environment's task."""


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> set[str]:
    """Every absolute module name an import statement of `path` names (`from a import b`: a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def build_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between decentrl modules, every name each module imports)."""
    paths = {module_name(path): path for path in SRC.rglob("*.py")}
    names = {module: imported_names(path) for module, path in paths.items()}
    edges = {
        module: {name for name in found if name in paths and name != module}
        for module, found in names.items()
    }
    return edges, names


EDGES, NAMES = build_graph()


def role_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROLES else None


def is_launcher(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in LAUNCHERS)


def cycles(modules: set[str], edges: dict[str, set[str]] = EDGES) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), within `modules`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges[node] & modules):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(modules):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_package() -> None:
    assert {"decentrl.coordinator.http.app", "decentrl.worker.main", "decentrl.verifier.main"} <= set(EDGES)
    assert "decentrl.coordinator.db.store" in EDGES["decentrl.coordinator.context"]


def test_no_role_imports_another_and_shared_parts_import_none() -> None:
    wrong = []
    for module, targets in EDGES.items():
        if is_launcher(module):
            continue
        for target in targets:
            if role_of(target) is not None and role_of(target) != role_of(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


@pytest.mark.parametrize("root", ["decentrl.protocol", "decentrl.config"])
def test_protocol_and_config_reach_no_torch(root: str) -> None:
    seen, todo = {root}, [root]
    while todo:
        for target in EDGES[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    heavy = sorted(
        f"{module} imports {name}" for module in seen for name in NAMES[module] if name.split(".")[0] in HEAVY
    )
    assert not heavy, heavy


def test_the_coordinator_has_no_import_cycle() -> None:
    coordinator = {module for module in EDGES if module.startswith("decentrl.coordinator")}
    assert cycles(coordinator) == []


def test_no_import_cycle_anywhere_in_the_package() -> None:
    assert cycles(set(EDGES)) == []


def module_level_names(path: Path) -> set[str]:
    """The names imported when `path` runs: module-level imports, not those inside a function or
    under `if TYPE_CHECKING:`."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    visit(part)

    visit(ast.parse(path.read_text(), str(path)).body)
    return names


def load_time_edges() -> dict[str, set[str]]:
    """What importing each module runs first: its module-level imports, and every package above
    it (importing `decentrl.config.base` runs `decentrl/config/__init__.py` first)."""
    paths = {module_name(path): path for path in SRC.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for module, path in paths.items():
        named = module_level_names(path) | {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        prefixes = {".".join(name.split(".")[:k]) for name in named for k in range(1, name.count(".") + 2)}
        edges[module] = {name for name in prefixes if name in paths and name != module}
    return edges


def cycles_across_packages(edges: dict[str, set[str]]) -> list[list[str]]:
    """Load-time cycles that leave a package. A package whose `__init__` imports its own modules
    loops back through itself harmlessly (the package is first in every such loop); a loop through
    another package fails for whichever module a fresh process imports first ("partially
    initialized module")."""

    def inside_one_package(component: list[str]) -> bool:
        return any(all(m == root or m.startswith(root + ".") for m in component) for root in component)

    return [component for component in cycles(set(edges), edges) if not inside_one_package(component)]


def test_no_load_time_import_cycle_leaves_a_package() -> None:
    """Any module imported first in a fresh process (a spawned child unpickling its target, a
    role's `python -m`) loads: no loop of module-level imports through two packages."""
    assert cycles_across_packages(load_time_edges()) == []


def test_a_load_time_cycle_through_a_package_init_is_seen() -> None:
    """The checker itself: `stage_map` importing `decentrl.config.base` runs `decentrl.config`,
    whose `roles` imports `protocol`, which imports `stage_map`."""
    edges = load_time_edges()
    edges["decentrl.stage_map"].add("decentrl.config.base")
    found = cycles_across_packages(edges)
    assert len(found) == 1 and {"decentrl.protocol", "decentrl.stage_map", "decentrl.config"} <= set(found[0])


def test_a_cycle_is_seen() -> None:
    """The checker itself: a loop added to a copy of the graph is reported."""
    edges = {module: set(targets) for module, targets in EDGES.items()}
    edges["decentrl.protocol"].add("decentrl.coordinator.context")
    loop = cycles(set(edges), edges)
    assert len(loop) == 1 and {"decentrl.protocol", "decentrl.coordinator.context"} <= set(loop[0])


def test_nothing_imports_the_cli_and_the_package_never_imports_benchmarks() -> None:
    cli_users = sorted(
        m for m, targets in EDGES.items() if "decentrl.cli" in targets and m != "decentrl.__main__"
    )
    assert not cli_users, cli_users
    harness_users = sorted(
        m for m, names in NAMES.items() if any(n.split(".")[0] == "benchmarks" for n in names)
    )
    assert not harness_users, harness_users


def imports_into(package: str, target: str, names: dict[str, set[str]] = NAMES) -> list[str]:
    """`module -> name` for every import of `target` or below it by a module of `package` or below."""

    def within(name: str, root: str) -> bool:
        return name == root or name.startswith(root + ".")

    return sorted(
        f"{module} -> {name}"
        for module, found in names.items()
        if within(module, package)
        for name in found
        if within(name, target)
    )


def test_environments_never_import_rewards() -> None:
    upward = imports_into("decentrl.envs", "decentrl.rewards")
    assert not upward, upward


def test_an_environment_importing_rewards_is_seen() -> None:
    """The checker itself: an upward import added to a copy of the graph is reported."""
    names = {module: set(found) for module, found in NAMES.items()}
    names["decentrl.envs.coding.task"].add("decentrl.rewards.rubric")
    assert imports_into("decentrl.envs", "decentrl.rewards", names) == [
        "decentrl.envs.coding.task -> decentrl.rewards.rubric"
    ]


def test_no_environment_or_reward_module_is_named_like_the_standard_library() -> None:
    shadowing = sorted(
        module
        for module in EDGES
        if module.startswith(("decentrl.envs", "decentrl.rewards"))
        and set(module.split(".")[2:]) & sys.stdlib_module_names
    )
    assert not shadowing, shadowing


def name_key(path: Path) -> str:
    """The name `path` is known by: its stem without case, underscores or one plural `s`."""
    return path.stem.lower().replace("_", "").removesuffix("s")


def shared_names(paths: list[Path], allowed: set[str] = SHARED_MEANING) -> dict[str, list[str]]:
    """{name key: the files holding it} for every key more than one of `paths` holds."""
    allowed_keys = {name_key(Path(name)) for name in allowed}
    holders: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        if name_key(path) not in allowed_keys:
            holders[name_key(path)].append(path.relative_to(SRC).as_posix())
    return {key: sorted(files) for key, files in sorted(holders.items()) if len(files) > 1}


def test_no_two_modules_share_a_file_name() -> None:
    shared = shared_names(sorted(SRC.rglob("*.py")))
    assert not shared, shared


def test_a_shared_file_name_is_seen() -> None:
    """The checker itself: a name repeated in another package, or nearly, is reported."""
    package = SRC / "decentrl"
    paths = [package / "weights/snapshot.py", package / "coordinator/weights/snapshots.py"]
    paths += [package / "rundir.py", package / "weights/run_dir.py", package / "worker/main.py"]
    paths += [package / "verifier/main.py"]
    assert shared_names(paths) == {
        "rundir": ["decentrl/rundir.py", "decentrl/weights/run_dir.py"],
        "snapshot": ["decentrl/coordinator/weights/snapshots.py", "decentrl/weights/snapshot.py"],
    }
