"""The layering of docs/architecture.md holds: every import between headsearch's subpackages, those
inside functions included, goes from a lower layer to a higher one (never back, so no cycles)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "headsearch"
# Highest first: a layer may import only the layers before it.
LAYERS = ["core", "models", "tasks", "training", "analysis", "machine", "search", "api", "cli"]


def layer_of(module: str) -> str | None:
    """headsearch.search.runner -> search; headsearch.config -> core; other packages -> None."""
    parts = module.split(".")
    if parts[0] != "headsearch":
        return None
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return "cli" if parts[1:2] == ["__main__"] else "core"


def imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth of the file (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [base] + [f"{base}.{a.name}" for a in node.names]
    return found


def test_imports_follow_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        src = layer_of(module)
        for target in imports(path):
            dst = layer_of(target)
            if dst is not None and dst != src and LAYERS.index(dst) > LAYERS.index(src):
                wrong.append(f"{path.relative_to(PACKAGE.parent)} ({src}) imports {target} ({dst})")
    assert not wrong, "imports against docs/architecture.md's layers:\n" + "\n".join(sorted(set(wrong)))


def test_the_checker_sees_imports_inside_functions():
    layers = {layer_of(t) for t in imports(PACKAGE / "training" / "__init__.py")}
    assert "tasks" in layers  # module level
    assert layer_of("headsearch.training.fastpath") == "training"  # imported inside preflight()
    assert "headsearch.training.fastpath" in imports(PACKAGE / "training" / "__init__.py")


def module_cycles(folder: Path) -> list[list[str]]:
    """Import cycles among the modules under `folder`, at any depth: a package's __init__ is the package's
    node (a submodule that imports its own package goes round through it), and type-only imports count."""
    graph = {}
    for path in sorted(folder.rglob("*.py")):
        graph[".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")] = path
    graph = {module: {t for t in imports(path) if t in graph and t != module} for module, path in graph.items()}
    cycles, seen = [], set()

    def walk(node, stack):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        for nxt in sorted(graph.get(node, ())):
            walk(nxt, stack + [node])

    for node in graph:
        walk(node, [])
    return cycles


def test_no_module_imports_itself_round_a_cycle():
    # The registry finds the built-in tasks as it finds plugins (entry points), so no task module imports
    # it; the CLI's commands share cli/common.py rather than importing each other's helpers; the search's
    # units are built with what they use (search/definition.py) and never import the runner back.
    assert module_cycles(PACKAGE) == []
    assert "headsearch.tasks.registry" not in imports(PACKAGE / "tasks" / "vit_cifar10.py")
    assert "headsearch.tasks.registry" not in imports(PACKAGE / "tasks" / "translation.py")
    units = ["architectures", "backends", "costs", "loop", "scheduler", "trial_life", "trial_pruning"]
    assert not [u for u in units if "headsearch.search.runner" in imports(PACKAGE / "search" / f"{u}.py")]


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "headsearch" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from headsearch.demo import b\n")
    (pkg / "b.py").write_text("def f():\n    from headsearch.demo.a import x\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "headsearch")
    assert module_cycles(pkg) == [["headsearch.demo.a", "headsearch.demo.b", "headsearch.demo.a"]]
    sub = pkg / "sub"
    sub.mkdir()
    (sub / "__init__.py").write_text("from headsearch.demo.sub.c import y\n")
    (sub / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from headsearch.demo.sub import z\n")
    assert ["headsearch.demo.sub", "headsearch.demo.sub.c", "headsearch.demo.sub"] in module_cycles(pkg)


MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 250  # issue 40: the search, then the whole package, in small units one can pick up


def oversized(root: Path) -> list[str]:
    """The modules over MAX_MODULE_LINES and the classes over MAX_CLASS_LINES under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(root)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                out.append(f"{path.relative_to(root)}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    return out


def test_the_package_is_made_of_small_units():
    assert oversized(PACKAGE) == []


def test_the_size_check_sees_a_big_class(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    (tmp_path / "big.py").write_text(f"class Big:\n{body}\n")
    assert oversized(tmp_path) == [f"big.py: class Big {MAX_CLASS_LINES + 1} lines"]


def test_one_loop_runs_real_and_simulated_trials():
    """The simulator and a real worker both go through `Search.run` (the loop of headsearch.search.loop);
    the old second loop is gone."""
    from headsearch.search.runner import Search

    assert not hasattr(Search, "run_interleaved") and not hasattr(Search, "run_cohort_worker")
    simulate = (PACKAGE / "search" / "simulate.py").read_text()
    runner = (PACKAGE / "search" / "runner.py").read_text()
    assert "search.run(study, cohort" in simulate and "self.run(study, machine_backend(" in runner
