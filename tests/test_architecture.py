"""The house rules, read from the source (AST), so a stray import fails CI, not a review.

* A stage (generate, capture, vocab, train, export, evaluate) imports the shared layers
  (`workflows.core`), `eagle3`, `storage` and its own package, never another stage, a
  tool or `workflows.full`.
* `workflows.core` imports no stage, tool or `workflows.full`; a tool imports no stage.
* `eagle3/` is the model and its maths: the standard library, torch and transformers only.
* `storage/` imports no other package of the project.
* No import cycle among the modules of eagle3, storage and workflows (imports inside
  functions included).
* Importing a module of `workflows` builds no entry point: Hydra's is built only when a
  stage, a tool or `workflows.full` runs as a script (`if __name__ == "__main__"`).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("generate", "capture", "vocab", "train", "export", "evaluate")
PROJECT = ("eagle3", "storage", "workflows", "bench", "tests")
EAGLE3_ALLOWED = ("torch", "transformers", "eagle3")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path, root).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path, root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from workflows import capture` imports the stage `workflows.capture`.
            names = [f"{base}.{a.name}" for a in node.names] if base in ("workflows", "workflows.core") else []
            found += [(node.lineno, base)] + [(node.lineno, n) for n in names]
    return found


def owner(module: str) -> str:
    """What a module belongs to: 'stage:<name>', 'core', 'tools', 'full', or its top package."""
    parts = module.split(".")
    if parts[0] != "workflows" or len(parts) == 1:
        return parts[0]
    if parts[1] in STAGES:
        return f"stage:{parts[1]}"
    return {"core": "core", "tools": "tools", "full": "full"}.get(parts[1], f"workflows.{parts[1]}")


def violations(root: Path) -> list[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] not in ("eagle3", "storage", "workflows") or "sglang_cpu_shim" in rel.parts:
            continue
        me = owner(module_name(path, root))
        reported = set()  # one problem per import statement
        for line, module in imports(path, root):
            if line in reported:
                continue
            count = len(problems)
            top, theirs = module.split(".")[0], owner(module)
            where = f"{rel}:{line} imports {module}"
            if me == "eagle3" and top not in stdlib and top not in EAGLE3_ALLOWED:
                problems.append(f"{where}: eagle3/ may import only the standard library, torch and transformers")
            elif me == "storage" and top in PROJECT and top != "storage":
                problems.append(f"{where}: storage/ imports no other package of the project")
            elif me.startswith("stage:") and theirs.startswith(("stage:", "tools", "full")) and theirs != me:
                problems.append(f"{where}: a stage imports the shared layers (workflows.core), never {theirs}")
            elif me in ("core", "tools") and (theirs.startswith("stage:") or theirs == "full"):
                problems.append(f"{where}: {me} never imports a stage")
            elif me == "core" and theirs == "tools":
                problems.append(f"{where}: core never imports a tool")
            if len(problems) > count:
                reported.add(line)
    return problems


def test_the_project_keeps_its_architecture():
    assert violations(ROOT) == []


def test_every_stage_is_a_module_or_package_of_workflows():
    for stage in STAGES:
        assert (ROOT / "workflows" / f"{stage}.py").is_file() or (ROOT / "workflows" / stage / "__init__.py").is_file()


ALLOWED = {
    "eagle3": "import json\nimport torch\nfrom transformers import DynamicCache\nfrom eagle3.vocab import x\n",
    "storage": "import numpy\nfrom storage.store import x\n",
    "workflows": "import torch\nfrom workflows.core.layout import RunLayout\nfrom eagle3 import modeling\n",
}


@pytest.mark.parametrize(
    "file, source, complaint",
    [
        ("workflows/evaluate.py", "from workflows.train.stage import make_batches\n", "a stage imports the shared"),
        ("workflows/capture/stage.py", "from workflows import generate\n", "a stage imports the shared"),
        ("workflows/vocab.py", "from .tools import doctor\n", "a stage imports the shared"),
        ("workflows/export.py", "import workflows.full\n", "a stage imports the shared"),
        ("workflows/core/layout.py", "import workflows.export\n", "core never imports a stage"),
        ("workflows/core/wiring.py", "from workflows.tools.serve import x\n", "core never imports a tool"),
        ("workflows/tools/doctor.py", "from workflows.capture.stage import run\n", "tools never imports a stage"),
        ("eagle3/ttt.py", "import numpy\n", "eagle3/ may import only"),
        ("eagle3/vocab.py", "from workflows.core import layout\n", "eagle3/ may import only"),
        ("storage/store.py", "from eagle3.schema import ConfigError\n", "storage/ imports no other package"),
    ],
)
def test_the_check_catches_each_kind_of_violation(tmp_path, file, source, complaint):
    """The checker itself, on a one-file tree per rule (an empty report must mean something)."""
    target = tmp_path / file
    target.parent.mkdir(parents=True)
    for parent in target.relative_to(tmp_path).parents:
        if parent != Path("."):
            (tmp_path / parent / "__init__.py").touch()
    target.write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and complaint in found[0], found
    target.write_text(ALLOWED[file.split("/")[0]])  # the same file, importing what it may
    assert violations(tmp_path) == []


# Imports every module of `workflows` (its `__main__` modules too) in one fresh interpreter and
# prints, per module, what importing it added to Hydra's ConfigStore or the exception it raised.
# `--help` in argv: an entry point built at import then prints Hydra's help, never runs a stage.
IMPORT_PROBE = """
import importlib, json, sys
names, sys.argv = sys.argv[1:], ["import-probe", "--help"]
from hydra.core.config_store import ConfigStore
repo, found = ConfigStore.instance().repo, {}
before = set(repo)
for name in names:
    try:
        importlib.import_module(name)
    except BaseException as exc:  # SystemExit too: Hydra's help, or an entry point's exit
        found[name] = f"raised {type(exc).__name__}: {exc}"
    added = sorted(set(repo) - before)
    if added:
        found[name] = f"registered {added} with Hydra"
        for key in added:  # so that the next module's own registrations show
            del repo[key]
print(json.dumps(found))
"""


def workflows_modules(root: Path) -> list[str]:
    return [
        module_name(path, root)
        for path in sorted((root / "workflows").rglob("*.py"))
        if "sglang_cpu_shim" not in path.parts
    ]  # the CPU shim loads inside SGLang processes only


def test_importing_a_module_builds_no_entry_point():
    """`main = stage_main(run)` at module level registered the schema with Hydra (and, in a
    `__main__` module, ran the stage) for whoever imported it: tests, full, the bench."""
    names = workflows_modules(ROOT)
    assert "workflows.vocab" in names and "workflows.train.__main__" in names
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, *names], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles among the project's modules (eagle3, storage, workflows), imports inside
    functions included: a cycle hidden by a late import is still one."""
    files = {
        module_name(p, root): p
        for top in ("eagle3", "storage", "workflows")
        for p in (root / top).rglob("*.py")
        if "sglang_cpu_shim" not in p.parts
    }
    graph = {}
    for name, path in files.items():
        targets = set()
        for _, module in imports(path, root):
            while module and module not in files:  # `from a.b import name`: the module a.b
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):  # a package's own __init__
                targets.add(module)
        graph[name] = targets
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycle():
    assert import_cycles(ROOT) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function(tmp_path):
    core = tmp_path / "workflows" / "core"
    core.mkdir(parents=True)
    for init in (tmp_path / "workflows" / "__init__.py", core / "__init__.py"):
        init.touch()
    (core / "a.py").write_text("from workflows.core.b import x\n")
    (core / "b.py").write_text("def f():\n    from workflows.core.a import y\n")
    assert import_cycles(tmp_path) == [["workflows.core.a", "workflows.core.b", "workflows.core.a"]]
    (core / "b.py").write_text("def f():\n    return 1\n")
    assert import_cycles(tmp_path) == []
