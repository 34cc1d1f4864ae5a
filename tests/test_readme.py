"""The README is a first page whose commands run, and the docs say what is so: every `vlmspec` and
`python -m recipes` command in README.md and docs/*.md (shell blocks and inline code) names a
real subcommand and only options that subcommand takes, every other `python -m vlmspec...` module
and script they run exists and has the options given, every repository path they name exists, a
lab folder (runs/...) is read only after a command on the same page writes it, every make target
exists, every docs link resolves, the README stays under 200 lines, and the README's Python
examples run (on the built default model; skipped before `make setup`)."""

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from vlmspec.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# repository paths a page may name; runs/ (lab output), models/ (make setup) and gpu-check/ (make gpu-check) are written, not shipped
REPO_DIRS = ("vlmspec/", "app/", "recipes/", "scripts/", "docs/", "assets/", "tests/")
PATH = re.compile(r"(?<![\w./-])((?:%s)[\w./*-]*[\w/*])" % "|".join(re.escape(d) for d in REPO_DIRS))
IMAGE = re.compile(r"(?<![\w./<-])([\w./-]+\.(?:png|jpe?g|gif|webp))\b")  # an image file a command or a snippet reads


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def python_problems(blocks: list[str]) -> list[str]:
    """A page's Python snippets, read in order as one script: each compiles, each name it reads is
    defined above it (or a builtin), and each name it imports from vlmspec is there."""
    import ast
    import builtins
    import importlib
    import importlib.util

    defined, problems = set(dir(builtins)), []
    for block in blocks:
        try:
            tree = ast.parse(block)
        except SyntaxError as exc:
            problems.append(f"does not compile: {exc}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlmspec"):
                module = importlib.import_module(node.module)
                problems += [f"{node.module} has no {a.name}" for a in node.names  # an attribute, or a submodule not yet imported
                             if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
        used = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        problems += [f"{n.id} is used but never defined (line {n.lineno} of a snippet)" for n in used if n.id not in defined]
    return sorted(set(problems))


def _shell_lines(text: str) -> list[str]:
    """Every command line of the page's ```bash blocks and of its indented blocks that run a program:
    comments dropped, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    blocks += re.findall(r"(?m)^ {4}((?:\.venv/bin/)?(?:vlmspec|python3?|torchrun|make) .*(?:\n {5,}.*)*)$", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    lines = [line.split(" #")[0].strip() if not line.lstrip().startswith("#") else "" for block in blocks
             for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def _inline(text: str) -> list[str]:
    """The page's inline code spans (outside fenced blocks)."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))


def _argv(command: str) -> list[str] | None:
    """A command line -> argv from the program on (env assignments, .venv/bin/, PYTHONPATH=... dropped;
    [optional] brackets opened), or None when it cannot be split."""
    try:
        argv = shlex.split(command.replace("[", " ").replace("]", " "))
    except ValueError:
        return None
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        argv = argv[1:]
    return [a.removeprefix(".venv/bin/") for a in argv]


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0, argv
    return out.getvalue()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _commands(page: Path) -> list[tuple[str, list[str]]]:
    """(the text as written, argv) of every command on a page: shell lines, and inline spans that
    start with a program (`vlmspec SUB`, `python -m ...`, `torchrun`, a script)."""
    text = page.read_text()
    found = [(line, _argv(line)) for line in _shell_lines(text)]
    for span in _inline(text):
        argv = _argv(span)
        if argv and (argv[0] == "vlmspec" and len(argv) > 1 and re.fullmatch(r"[a-z][a-z-]*", argv[1])
                     or argv[0] in ("python", "python3", "torchrun") and "-m" in argv or re.match(r"^(scripts|docs)/.*\.(py|sh)$", argv[0])):
            found.append((span, argv))
    return [(t, a) for t, a in found if a]


def _program(argv: list[str]) -> tuple[str, list[str]] | None:
    """('vlmspec' | 'recipes' | a module or script path, its argv after the program), or None for a
    command that runs nothing of this repository (curl, ray, pip, ...)."""
    if argv[0] == "vlmspec":
        return "vlmspec", argv[1:]
    if argv[0] in ("python", "python3", "torchrun"):
        if "-m" in argv:
            module = argv[argv.index("-m") + 1]
            rest = argv[argv.index("-m") + 2:]
            if module == "vlmspec.cli":
                return "vlmspec", rest
            if module == "recipes":
                return "recipes", rest
            return (module, rest) if module.startswith("vlmspec") else None
        script = next((a for a in argv[1:] if a.endswith(".py")), None)
        return (script, argv[argv.index(script) + 1:]) if script else None
    if argv[0] == "bash" and len(argv) > 1:
        return argv[1], argv[2:]
    if re.match(r"^(scripts|docs)/.*\.(py|sh)$", argv[0]):
        return argv[0], argv[1:]
    return None


def _source_of(program: str) -> Path:
    """The file a `python -m vlmspec.X` module or a script is."""
    if program.startswith("vlmspec."):
        parts = program.split(".")[1:]
        top = {"app": "app", "recipes": "recipes"}.get(parts[0])
        base = ROOT / top / Path(*parts[1:]) if top else ROOT / "vlmspec" / Path(*parts)
        return base / "__main__.py" if base.is_dir() else base.with_suffix(".py")
    return ROOT / program


def _options_problem(program: str, args: list[str]) -> str | None:
    """Why a command's subcommand or options are not what the program takes, else None."""
    opts = [a.split("=")[0] for a in args if a.startswith("--")]
    if program in ("vlmspec", "recipes"):
        if not args or args[0] in ("...", "--help") or args[0].isupper():  # a placeholder (python -m recipes SUITE)
            return None
        if program == "vlmspec":
            parser = build_parser()
        else:
            from recipes.__main__ import build_parser as recipes_parser

            parser = recipes_parser()
        subs = _subparsers(parser)
        name = "vlmspec" if program == "vlmspec" else "python -m recipes"
        if args[0] not in subs:
            return f"`{name}` has no subcommand {args[0]!r} (it has {', '.join(subs)})"
        sub = subs[args[0]]
        nested = _subparsers(sub)
        if nested and len(args) > 1 and args[1] in nested:
            sub = nested[args[1]]
        text = sub.format_help() + (sub.epilog or "")
        missing = [o for o in opts if not re.search(rf"{re.escape(o)}\b", text)]
        return f"`{name} {args[0]}` has no option {', '.join(missing)}" if missing else None
    source = _source_of(program)
    if not source.is_file():
        return f"{program}: no such module or script ({source.relative_to(ROOT)})"
    code = source.read_text()
    missing = [o for o in opts if o not in code]
    return f"{program} takes no option {', '.join(missing)}" if missing else None


def _written(program: str | None, argv: list[str]) -> list[str]:
    """The lab folders (runs/...) a command writes: its --out, mkdir -p, cp's target; a script run by
    bash, every --out runs/... and mkdir -p runs/... in it."""
    out = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--out"]
    if argv[0] in ("mkdir", "cp"):
        out.append(argv[-1])
    if argv[0] == "bash" and program and (ROOT / program).is_file():
        out += re.findall(r"(?:--out|mkdir -p)\s+(runs/[\w./-]+)", (ROOT / program).read_text())
    return [o.rstrip("/") for o in out if o.startswith("runs/")]


def page_problems(page: Path) -> list[str]:
    """Everything on `page` that is not so (see the module docstring)."""
    problems, written = [], []
    for text, argv in _commands(page):
        prog = _program(argv)
        if prog is not None:
            why = _options_problem(*prog)
            if why:
                problems.append(f"{text}: {why}")
        for arg in argv:
            if arg.startswith("runs/") and arg.rstrip("/") not in _written(None, argv) and "--out" not in argv[argv.index(arg) - 1:argv.index(arg)]:
                if not any(arg == w or arg.startswith(w + "/") for w in written):
                    problems.append(f"{text}: reads {arg}, which no command above it on the page writes (a lab folder that does not ship)")
        written += _written(prog[0] if prog else None, argv)
    code = _python_blocks(page.read_text())
    spans = " ".join(_inline(page.read_text())) + " " + " ".join(_shell_lines(page.read_text())) + " " + " ".join(code)
    for path in sorted(set(PATH.findall(spans))):
        if not any(ROOT.glob(path)):
            problems.append(f"names {path}, which is not in the repository")
    run = " ".join(text for text, _ in _commands(page)) + " " + " ".join(code)  # what commands and snippets read (not a table's names)
    for image in sorted(set(IMAGE.findall(run))):  # from the repository's root, the page's folder, or a docs folder the page names
        if not ((ROOT / image).is_file() or (page.parent / image).is_file() or any((ROOT / "docs").glob(f"**/{image}"))):
            problems.append(f"names the image {image}, which is not in the repository (the sample images are in assets/images/)")
    problems += [f"python: {why}" for why in python_problems(code)]
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not re.match(r"^[a-z]+://", link) and not (page.parent / link).exists():
            problems.append(f"links to {link}, which is not there")
    return problems


VLMSPEC = [shlex.split(line) for line in _shell_lines(README) if line.startswith((".venv/bin/vlmspec ", "vlmspec "))]


def test_readme_is_a_first_page():
    assert len(README.splitlines()) <= 200
    assert len(VLMSPEC) >= 4  # serve, generate, train, generate with the trained drafter


@pytest.mark.parametrize("argv", VLMSPEC, ids=[" ".join(a[1:3]) for a in VLMSPEC])
def test_every_vlmspec_command_takes_its_options(argv):
    sub = argv[1]
    text = _help([sub, "--help"])
    for opt in (a for a in argv[2:] if a.startswith("--")):
        assert re.search(rf"{re.escape(opt)}\b", text), f"`vlmspec {sub}` has no option {opt}"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_command_and_path_on_a_page_is_so(page):
    problems = page_problems(page)
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_page_checks_catch_what_they_are_for(tmp_path):
    """Negative control: a page with each kind of mistake the checks are for fails each of them."""
    page = tmp_path / "bad.md"
    page.write_text("\n".join([
        "```bash", "vlmspec train-align --out runs/a", "vlmspec generate --image cat.png --prompt hi --no-such-option",
        "python -m recipes eval-target --model runs/aligned5 --n 3", "vlmspec export runs/a/drafter --out runs/b", "```",
        "Run `python -m recipes train-align --nope` or `scripts/no_such.py`; see `vlmspec/no_such.py` and [x](missing.md).",
        "```python", "from vlmspec.engine import NoSuchThing", "print(other_inputs, Image.open('cat.png'))", "```",
    ]))
    problems = "\n".join(page_problems(page))
    for says in ("has no subcommand 'train-align'", "has no option --no-such-option", "reads runs/aligned5, which no command",
                 "`python -m recipes train-align` has no option --nope", "scripts/no_such.py: no such module or script",
                 "names vlmspec/no_such.py", "links to missing.md", "names the image cat.png", "vlmspec.engine has no NoSuchThing",
                 "other_inputs is used but never defined", "Image is used but never defined"):
        assert says in problems, (says, problems)
    assert "reads runs/a/drafter" not in problems  # written by the line above it


def test_make_targets_and_docs_links_exist():
    makefile = (ROOT / "Makefile").read_text()
    for page in PAGES:
        for line in _shell_lines(page.read_text()) + [s for s in _inline(page.read_text()) if s.startswith("make ")]:
            if line.startswith("make "):
                assert re.search(rf"^{line.split()[1]}:", makefile, flags=re.MULTILINE), f"{page.name}: {line}"
    for link in re.findall(r"\]\((docs/[^)#]+|assets/[^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / link).exists(), link


def _readme_python() -> list[str]:
    start = README.index("## Python\n")
    return _python_blocks(README[start:README.index("\n## ", start + 1)])


def test_the_readme_python_examples_run(monkeypatch):
    """The README's Python section, run in order as one script from the repository's root: the first
    block (five lines) answers about an image with the default model and its drafter, the batch
    answers both requests, and the engine-level calls run (skipped until `make setup` builds the
    default model; under CI, as tests/test_real_target.py, a missing model is a failure)."""
    import os

    from vlmspec import assets

    if assets.default_target() is None:
        if os.environ.get("CI"):
            pytest.fail(f"the default model is not built ({assets.DEFAULT_TARGET}): make setup builds it", pytrace=False)
        pytest.skip(f"the default model is not built ({assets.DEFAULT_TARGET}); make setup builds it")
    blocks = _readme_python()
    first = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(blocks) >= 3 and first[0] == "from vlmspec import LLM" and len(first) <= 5, first
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md, Python block {i + 1}", "exec"), scope)
    out, outs = scope["out"], scope["outs"]
    assert out.text.strip() and out.tau >= 1.0 and out.drafted >= out.accepted >= 0
    assert out.prompt_tokens > scope["llm"].engine.target.image_tokens  # the image is in the prompt
    assert len(outs) == 2 and all(o.text.strip() for o in outs)
    done, results = scope["done"], scope["results"]
    assert results[0].token_ids[: len(done.result.token_ids)] == done.result.token_ids  # in a batch as alone (done may stop at "\n\n")
    assert scope["result"].policy == "goodput"


def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the check itself")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(tmp_path / "out")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=120)
    assert run.returncode == 0 and "no CUDA device here" in run.stdout, run.stdout + run.stderr


def test_the_docs_stay_a_manual_under_5_mb():
    """docs/ as tracked by git stays <= 5 MB (#74): run histories and superseded figures leave (git
    keeps them); the negative control is the repository's own largest folder, docs/ and assets/ together."""
    import subprocess

    def tracked_bytes(*folders: str) -> int:
        names = subprocess.run(["git", "ls-files", "-z", *folders], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
        return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: what is tracked is unknown")
    docs = tracked_bytes("docs")
    assert 0 < docs <= 5_000_000, f"docs/ tracks {docs / 1e6:.2f} MB (at most 5): move run histories out (git keeps them)"
    assert tracked_bytes("docs", "assets") > docs  # the count sees what it is given


CONFIGURATION = ROOT / "docs" / "configuration.md"


def serve_options() -> list[str]:
    """Every --option that `vlmspec serve`'s parser defines (--help aside)."""
    serve = _subparsers(build_parser())["serve"]
    return sorted({o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"})


def environment_reads(*folders: Path) -> list[str]:
    """The environment variables the Python code under `folders` names: every string constant spelled
    VLMSPEC_..., and the constant key of every `os.environ[...]`, `os.environ.get / setdefault / pop(...)`
    (an `environ` mapping passed in too), `os.getenv(...)` and `env_default(...)`."""
    import ast

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "environ" or isinstance(node, ast.Attribute) and node.attr == "environ"

    names = set()
    for path in sorted(p for folder in folders for p in folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"VLMSPEC_[A-Z0-9_]+", node.value):
                names.add(node.value)
            key = None
            if isinstance(node, ast.Subscript) and is_environ(node.value):
                key = node.slice
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                if (isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") and is_environ(func.value)
                        or isinstance(func, (ast.Name, ast.Attribute)) and getattr(func, "id", getattr(func, "attr", "")) in ("getenv", "env_default")):
                    key = node.args[0]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
    return sorted(names)


def missing_from_page(text: str, options: list[str], variables: list[str]) -> list[str]:
    """The options and variables that `text` never names as themselves (`--replicas` inside
    `--min-replicas`, or `RANK` inside `LOCAL_RANK`, does not count)."""
    missing = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
    return missing + [v for v in variables if not re.search(rf"(?<!\w){re.escape(v)}(?!\w)", text)]


def test_the_configuration_page_names_every_serve_option_and_variable(tmp_path):
    """docs/configuration.md names every option of `vlmspec serve` and every environment variable the
    code under vlmspec/ and app/ reads. Negative controls: a made-up option and variable, and a real
    option taken off the page, are reported; the scan finds the reads in a file written for it."""
    options, variables = serve_options(), environment_reads(ROOT / "vlmspec", ROOT / "app")
    assert len(options) >= 30 and {"--max-queue", "--drain-seconds", "--no-packed-weights", "--replica-cpus"} <= set(options)
    assert {"VLMSPEC_API_KEY", "VLMSPEC_MODELS", "VLMSPEC_ASSETS", "VLMSPEC_CACHE_DIR"} <= set(variables)
    text = CONFIGURATION.read_text()
    missing = missing_from_page(text, options, variables)
    assert not missing, f"docs/configuration.md does not name {', '.join(missing)}"
    assert missing_from_page(text, ["--no-such-option", "--max-queue"], ["VLMSPEC_NO_SUCH_VARIABLE", "VLMSPEC_CACHE_DIR"]) == [
        "--no-such-option", "VLMSPEC_NO_SUCH_VARIABLE"]
    taken_off = re.sub(r"(?<![\w-])--replicas(?![\w-])", "--", text)
    assert missing_from_page(taken_off, options, variables) == ["--replicas"]  # --min-replicas and --max-replicas still there
    (tmp_path / "reads.py").write_text('import os\nA = os.environ.get("SOME_HOST")\nB = os.environ["SOME_DIR"]\n'
                                       'C = os.getenv("SOME_FLAG")\nD = env_default("VLMSPEC_NEW_KEY")\nE = {"x": 1}.get("NOT_ENV")\n')
    assert environment_reads(tmp_path) == ["SOME_DIR", "SOME_FLAG", "SOME_HOST", "VLMSPEC_NEW_KEY"]
