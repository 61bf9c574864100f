"""The house rules, read from the source with ``ast`` (nothing is imported), each checker also tested on
a small tree of its own:

* no module of nsa/, experiments/, scripts/ or hydra_plugins/ uses another module's private name
  (``from m import _x``, ``m._x``, or a private module such as ``nsa._x`` from outside its package);
* the modules of nsa/ and experiments/ import each other without cycles. Every import statement
  counts, also one inside a function: a deferred import hides a cycle from the interpreter, not from
  the reader;
* the framework (experiments/framework) imports nothing by name (``importlib.import_module``, a table of
  ``"module:function"`` strings): what an entry point adds, it passes in, so the import graph shows it;
* no module edits ``sys.path`` (scripts import the installed package), and the scripts run from
  another directory;
* one definition of the dtype table and of the config flattener;
* Triton kernels are launched with keyword arguments only;
* every public function of nsa/ has a docstring, the Backend protocol's with Arguments and Returns;
* no comment or docstring names an issue number (code, configs, scripts, tests).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("nsa", "experiments", "scripts", "hydra_plugins")


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def module_files(packages=PACKAGES, root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under ``packages``."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def absolute(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute module a (possibly relative) ``from`` import names."""
    if level == 0:
        return name or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for b in node.body for n in ast.walk(b)}
    return out


def imports(module: str, path: Path, mods: dict[str, Path]):
    """(line, imported module, names taken from it) for every import of a module in ``mods``, at any
    depth; ``from pkg import sub`` names the submodule ``pkg.sub``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, a.asname, ()
        elif isinstance(node, ast.ImportFrom):
            src = absolute(module, path, node.level, node.module)
            rest = []
            for a in node.names:
                if f"{src}.{a.name}" in mods:
                    yield node.lineno, f"{src}.{a.name}", a.asname or a.name, ()
                else:
                    rest.append(a.name)
            if rest:
                yield node.lineno, src, None, tuple(rest)


def private_uses(mods: dict[str, Path], root: Path = REPO) -> list[str]:
    """Every use of another module's private name, as ``file:line: what``."""
    ours = {m.split(".")[0] for m in mods}
    found = []
    for module, path in mods.items():
        aliases = {}  # local name -> our module it is bound to
        for line, target, alias, names in imports(module, path, mods):
            if target.split(".")[0] not in ours:
                continue
            parts = target.split(".")
            for i, part in enumerate(parts):
                # a private module is private to its package: nsa._x may be imported within nsa only
                if private(part) and not module.startswith(".".join(parts[:i]) + "."):
                    found.append(f"{path.relative_to(root)}:{line}: imports the private module {target}")
                    break
            found += [f"{path.relative_to(root)}:{line}: from {target} import {n}" for n in names if private(n)]
            if alias is not None and target in mods:
                aliases[alias] = target
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != module):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return sorted(set(found))


def import_cycles(mods: dict[str, Path]) -> list[list[str]]:
    """The import graph's cycles among ``mods``: one per strongly connected component of two or more
    modules (or a module importing itself), as that component's sorted module names."""
    graph = {m: set() for m in mods}
    for module, path in mods.items():
        for _, target, _, _ in imports(module, path, mods):
            while target and target not in mods:  # from nsa.x import f: the module nsa.x
                target = target.rpartition(".")[0]
            if target:
                graph[module].add(target)
    # Tarjan's strongly connected components
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_private_name_crosses_a_module():
    assert private_uses(module_files()) == []


def test_no_import_cycles_in_nsa_and_experiments():
    assert import_cycles(module_files(("nsa", "experiments"))) == []


def test_compute_code_imports_no_framework():
    """The model, the training loop and the timing (nsa/, experiments/lm, experiments/measure) know nothing of
    the command line, the tracker or the sweeps: what they need from an entry point (``should_stop``, ``log``)
    is passed in."""
    mods = module_files(("nsa", "experiments"))
    compute = {m: p for m, p in mods.items()
               if m.split(".")[0] == "nsa" or m.startswith(("experiments.lm", "experiments.measure"))}
    found = [f"{m}:{line}: {what}" for m, p in compute.items() for line, what, _, _ in imports(m, p, mods)
             if what.startswith("experiments.framework")]
    assert found == []


MODULE_FUNCTION = re.compile(r"[A-Za-z_]\w*(\.\w+)*:[A-Za-z_]\w*")  # "experiments.train:run_config"


def imports_by_name(mods: dict[str, Path], root: Path = REPO) -> list[str]:
    """Every import by name: a call of ``importlib.import_module`` or ``__import__``, and every string
    ``"package.module:function"`` naming a module of ``mods``' packages, as ``file:line: what``."""
    ours = {m.split(".")[0] for m in mods}
    found = []
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__"):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_FUNCTION.fullmatch(node.value) \
                    and node.value.split(".")[0].split(":")[0] in ours:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return sorted(found)


def test_the_framework_imports_nothing_by_name():
    """The entry points pass their own config checks to the framework (run_job's and launch's ``check``):
    no table of ``"experiments.<entry>:<function>"`` imported by name, which the cycle check cannot see."""
    assert imports_by_name({m: p for m, p in module_files(("experiments",)).items()
                            if m.startswith("experiments.framework")}) == []


def test_imports_by_name_finds_each_form(tmp_path):
    write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import importlib\nCHECKS = {'x': 'pkg.b:check'}\n"
                                                        "def f(m):\n    return importlib.import_module(m)\n"
                                                        "OTHER = 'os.path:join'\nTIME = '12:30'\n",
                     "pkg/b.py": "def g():\n    return __import__('json')\n"})
    assert imports_by_name(module_files(("pkg",), tmp_path), tmp_path) == [
        "pkg/a.py:2: 'pkg.b:check'", "pkg/a.py:4: importlib.import_module(m)", "pkg/b.py:2: __import__('json')"]


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("files, want", [
    ({"pkg/__init__.py": "", "pkg/a.py": "from .b import _x\n", "pkg/b.py": "_x = 1\n"},
     ["pkg/a.py:1: from pkg.b import _x"]),
    ({"pkg/__init__.py": "", "pkg/a.py": "def f():\n    from pkg import b\n    return b._x\n", "pkg/b.py": "_x = 1\n"},
     ["pkg/a.py:3: pkg.b._x"]),
    ({"pkg/__init__.py": "", "pkg/_c.py": "y = 1\n", "pkg/a.py": "from ._c import y\n",
      "other/__init__.py": "", "other/d.py": "from pkg._c import y\n"},
     ["other/d.py:1: imports the private module pkg._c"]),
    ({"pkg/__init__.py": "", "pkg/a.py": "_x = 1\nprint(_x)\nimport os\nos._exit\n"}, []),
])
def test_private_uses_finds_each_form(tmp_path, files, want):
    """The checker itself: each form of a cross-module private use is found, and nothing else."""
    write(tmp_path, files)
    packages = sorted({name.split("/")[0] for name in files})
    assert private_uses(module_files(packages, tmp_path), tmp_path) == want


def test_import_cycles_finds_a_deferred_cycle(tmp_path):
    """A cycle closed by an import inside a function is still a cycle; a chain is not."""
    write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from .b import f\n",
                     "pkg/b.py": "def f():\n    from .a import g\n", "pkg/c.py": "from pkg import a\n"})
    assert import_cycles(module_files(("pkg",), tmp_path)) == [["pkg.a", "pkg.b"]]


def path_edits(mods: dict[str, Path], root: Path = REPO) -> list[str]:
    """Every change to ``sys.path`` (a call of one of its methods, or an assignment to it)."""
    found = []
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if target is not None and ast.unparse(target) == "sys.path":
                found.append((str(path.relative_to(root)), node.lineno, ast.unparse(node)))
    return [f"{f}:{line}: {what}" for f, line, what in sorted(found)]


def test_no_module_edits_sys_path():
    """Scripts import nsa and experiments as installed (pip install -e .), not through sys.path."""
    assert path_edits(module_files()) == []
    assert path_edits({"x": Path(__file__)}, REPO) == []  # this file's own mentions are strings only


def test_path_edits_finds_insert_and_assignment(tmp_path):
    write(tmp_path, {"pkg/a.py": "import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']\nsys.modules.pop('z')\n"})
    assert path_edits(module_files(("pkg",), tmp_path), tmp_path) == [
        "pkg/a.py:2: sys.path.insert(0, 'x')", "pkg/a.py:3: sys.path += ['y']"]


@pytest.mark.parametrize("script", ["check_install", "compile_check", "decode_step", "decode_variants"])
def test_script_runs_from_elsewhere(script, tmp_path):
    """Each script's usage line, from another directory: its imports resolve through the installed package."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / f"{script}.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: {script}.py")


@pytest.mark.parametrize("name", ["DTYPES", "flatten"])
def test_defined_once(name):
    """The dtype table and the config flattener have one definition each, which the others import."""
    where = [m for m, path in module_files(("nsa", "experiments")).items()
             for node in ast.parse(path.read_text()).body
             if getattr(node, "name", None) == name
             or isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)]
    assert len(where) == 1, where


def jit_names(tree: ast.Module) -> set[str]:
    """The module's functions decorated with ``triton.jit`` (or ``jit``)."""
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
            and any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in n.decorator_list)}


def test_triton_kernels_live_under_nsa_backends():
    """A Triton kernel is the library's (nsa/backends/, beside its reference and the toolchain checks); the
    experiments and scripts launch them."""
    found = [m for m, p in module_files().items() if jit_names(ast.parse(p.read_text(), str(p)))
             and not m.startswith("nsa.backends.")]
    assert found == []


def positional_launches(mods: dict[str, Path], root: Path = REPO) -> list[str]:
    """Every ``kernel[grid](...)`` launch of a Triton kernel (of any module here) with positional arguments."""
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    kernels = set().union(*(jit_names(t) for t in trees.values()))
    found = []
    for m, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and node.args:
                name = node.func.value
                name = name.attr if isinstance(name, ast.Attribute) else getattr(name, "id", None)
                if name in kernels:
                    found.append(f"{mods[m].relative_to(root)}:{node.lineno}: {name}, {len(node.args)} positional")
    return sorted(found)


def test_kernel_launches_pass_keywords():
    """A launch names every argument (kernels take 25-50): a shifted argument cannot pass unseen."""
    assert positional_launches(module_files()) == []


def test_positional_launches_finds_them(tmp_path):
    write(tmp_path, {"pkg/k.py": "import triton\n@triton.jit\ndef kern(A, n, B: tl.constexpr):\n    pass\n"
                                 "def run(a):\n    kern[(1,)](A=a, n=1, B=2)\n    kern[(1,)](a, 1, B=2)\n"
                                 "    table = {}\n    table['x'](a)\n",
                     "pkg/u.py": "from . import k\ndef go(a):\n    k.kern[(2,)](a, n=1, B=2)\n"})
    assert positional_launches(module_files(("pkg",), tmp_path), tmp_path) == [
        "pkg/k.py:7: kern, 2 positional", "pkg/u.py:3: kern, 1 positional"]


def missing_docs(mods: dict[str, Path], root: Path = REPO) -> list[str]:
    """Public functions and methods (of public classes) without a docstring; a property's setter shares
    its getter's."""
    found = []

    def visit(body, path, prefix=""):
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not private(n.name) \
                    and not n.name.startswith("__") \
                    and not any(ast.unparse(d).endswith(".setter") for d in n.decorator_list) \
                    and ast.get_docstring(n) is None:
                found.append(f"{path.relative_to(root)}:{n.lineno}: {prefix}{n.name}")
            if isinstance(n, ast.ClassDef) and not private(n.name):
                visit(n.body, path, f"{prefix}{n.name}.")

    for path in mods.values():
        visit(ast.parse(path.read_text(), str(path)).body, path)
    return sorted(found)


def test_public_functions_of_nsa_have_docstrings():
    assert missing_docs(module_files(("nsa",))) == []


def test_backend_protocol_says_arguments_and_returns():
    """Each method of nsa.dispatch.Backend, the contract every backend implements, documents both."""
    tree = ast.parse((REPO / "nsa" / "dispatch.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Backend"]
    methods = {n.name: ast.get_docstring(n) or "" for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert len(methods) == 8
    assert [m for m, doc in methods.items() if "Arguments:" not in doc or "Returns:" not in doc] == []


def test_missing_docs_finds_functions_and_methods(tmp_path):
    write(tmp_path, {"pkg/a.py": 'def f():\n    pass\ndef g():\n    """Doc."""\ndef _h():\n    pass\n'
                                 'class C:\n    def m(self):\n        pass\n    @property\n    def p(self):\n'
                                 '        """Doc."""\n    @p.setter\n    def p(self, v):\n        pass\n'})
    assert missing_docs(module_files(("pkg",), tmp_path), tmp_path) == ["pkg/a.py:1: f", "pkg/a.py:8: C.m"]


# Comments and docstrings say what and why; which issue asked for a change is the commit's story, not the code's.
ISSUE = re.compile(r"\bissues? ?#?\d+", re.I)
NOTE_GLOBS = ("nsa/**/*.py", "experiments/**/*.py", "hydra_plugins/**/*.py", "scripts/**/*.py", "tests/**/*.py",
              "noxfile.py", "conf/**/*.yaml", "scripts/**/*.sh", ".ci/run")


def issue_notes(root: Path = REPO, globs=NOTE_GLOBS) -> list[str]:
    """``path:line: text`` of each comment or docstring (Python) and each ``#`` comment (YAML, shell) naming an
    issue number."""
    import io
    import tokenize

    out = []
    for pattern in globs:
        for path in sorted(root.glob(pattern)):
            text, rel = path.read_text(), path.relative_to(root)
            if path.suffix != ".py":
                out += [f"{rel}:{i}: {ln.strip()}" for i, ln in enumerate(text.splitlines(), 1)
                        if "#" in ln and ISSUE.search(ln[ln.index("#"):])]
                continue
            notes = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
                     if t.type == tokenize.COMMENT]
            for node in ast.walk(ast.parse(text, str(path))):
                body = getattr(node, "body", None)
                if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                    notes.append((body[0].lineno, body[0].value.value))
            out += [f"{rel}:{line}: {note.strip().splitlines()[0][:80]}" for line, note in sorted(notes)
                    if ISSUE.search(note)]
    return out


def test_no_comment_or_docstring_names_an_issue():
    assert issue_notes() == []


def test_issue_notes_finds_comments_docstrings_and_yaml(tmp_path):
    write(tmp_path, {"pkg/a.py": '"""The cache (issue 12)."""\nx = "issue 3 in a string is a value"  # see Issue #4\n'
                                 'def f():\n    """Fixed for issues 5, 6."""\n',
                     "conf/a.yaml": "a: 1  # issue 7\nb: 'issue 8'\n"})
    assert issue_notes(tmp_path, ("pkg/*.py", "conf/*.yaml")) == [
        "pkg/a.py:1: The cache (issue 12).", "pkg/a.py:2: # see Issue #4", "pkg/a.py:4: Fixed for issues 5, 6.",
        "conf/a.yaml:1: a: 1  # issue 7"]


def environment_reads(mods: dict[str, Path]) -> list[str]:
    """``module:line`` of each ``os.environ`` / ``os.getenv`` / ``os.putenv`` in ``mods``."""
    out = []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                out.append(f"{name}:{node.lineno}")
    return sorted(set(out))


def test_the_library_reads_its_own_environment_only_in_nsa_env():
    """nsa/ reads environment variables in nsa/env.py alone, and none of a tracker's or a scheduler's: those are
    the experiments' (experiments/env.py)."""
    mods = module_files(("nsa",))
    assert [r for r in environment_reads(mods) if not r.startswith("nsa.env:")] == []
    words = {w for path in mods.values() for w in re.findall(r"\b(MLFLOW_\w+|SLURM_\w+|CUDA_VISIBLE_DEVICES)\b",
                                                             path.read_text())}
    assert words == set(), words


def test_the_experiments_read_the_environment_only_in_experiments_env():
    """experiments/ and its Hydra plugins read and set environment variables in experiments/env.py alone
    (torchrun's ranks, SLURM's tasks, MLflow's and CUDA's variables)."""
    mods = module_files(("experiments", "hydra_plugins"))
    assert [r for r in environment_reads(mods) if not r.startswith("experiments.env:")] == []


def test_environment_reads_finds_each_form(tmp_path):
    write(tmp_path, {"pkg/a.py": "import os\nos.environ['A']\nos.getenv('B')\nx = 'os.environ'\n"})
    assert environment_reads(module_files(("pkg",), tmp_path)) == ["pkg.a:2", "pkg.a:3"]
