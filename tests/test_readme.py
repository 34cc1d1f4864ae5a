"""The README is a first page whose commands run: every `vlmspec` command it shows names a real
subcommand and only options that subcommand takes, every make target exists, every docs link
resolves, and it stays under 200 lines."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from vlmspec.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _shell_lines(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.split("#")[0].strip()]


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0, argv
    return out.getvalue()


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


def test_make_targets_and_docs_links_exist():
    makefile = (ROOT / "Makefile").read_text()
    for line in _shell_lines(README):
        if line.startswith("make "):
            assert re.search(rf"^{line.split()[1]}:", makefile, flags=re.MULTILINE), line
    for link in re.findall(r"\]\((docs/[^)]+|assets/[^)]+)\)", README):
        assert (ROOT / link).exists(), link


def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the check itself")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(tmp_path / "out")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=120)
    assert run.returncode == 0 and "no CUDA device here" in run.stdout, run.stdout + run.stderr
