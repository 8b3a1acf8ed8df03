"""Every code block of README.md and docs/ runs, or names only real commands and flags.

- python blocks execute (each with its ``<!-- continues -->`` blocks, in one namespace);
  the examples with checked output are ``test_examples.py``'s, the kit's saved files
  ``test_kit_example.py``'s;
- bash blocks marked ``<!-- run -->`` run in a scratch folder; every other bash block is
  checked command by command: ``kvtier`` subcommands and flags against ``kvtier ... --help``
  (and the values of flags with choices), scripts and files it names exist, ``pip install``
  names only the project's extras and the pinned torch, ``python -m`` names an importable
  module;
- json blocks parse, one JSON document per line; text blocks are drawings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

from docs.codeblocks import REPO, Block, all_blocks, python_groups

LANGS = {"python", "bash", "json", "text"}
BASH = [b for b in all_blocks() if b.lang == "bash"]
RUN = [b for b in BASH if b.marker == "run"]
CHECKED = [b for b in BASH if b.marker != "run"]
#: commands a block may name that are not part of kvtier (checked no further)
EXTERNAL = {"redis-server", "vllm", "pytest"}


def test_every_block_names_a_known_language() -> None:
    bad = [f"{b.name}: {b.lang or '(none)'}" for b in all_blocks() if b.lang not in LANGS]
    assert not bad, f"code blocks need one of {sorted(LANGS)}: {bad}"


def test_markers_are_known() -> None:
    bad = [f"{b.name}: {b.marker}" for b in all_blocks()
           if b.marker is not None and not (b.marker in ("run", "continues") or b.marker.startswith("example:"))]
    assert not bad
    assert all(b.lang == "bash" for b in RUN) and RUN, "<!-- run --> marks bash blocks"


@pytest.mark.parametrize("group", python_groups(), ids=lambda g: g[0].name)
def test_python_block_runs(group: list[Block], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in group:
            exec(compile(block.code, block.name, "exec"), namespace)
    assert out.getvalue().strip(), f"{group[0].name} prints nothing: say what it shows, or assert it"


def test_json_blocks_parse() -> None:
    blocks = [b for b in all_blocks() if b.lang == "json"]
    assert blocks
    for b in blocks:
        for n, line in enumerate(b.code.splitlines(), b.line + 1):
            if line.strip():
                json.loads(line)  # a JSONDecodeError names the line's text; n is its page line


def _env() -> dict[str, str]:
    """The environment of a block that runs: this interpreter's scripts first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_bash_block_runs(block: Block, tmp_path: Path) -> None:
    """In a scratch folder that links the repository's ``diagrams/`` (``kvtier diagram
    --check`` reads it), with the interpreter's scripts on PATH; every command must succeed."""
    (tmp_path / "diagrams").symlink_to(REPO / "diagrams")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


# ---------------------------------------------------------------------------- checked blocks
def _open_quote(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:
        return True
    return False


def commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block: continuation lines and quoted arguments spanning
    lines joined, comments dropped,
    split at ``&&``, ``||``, ``;``, ``|`` and ``&``; leading ``VAR=value`` kept as words."""
    logical: list[str] = []
    for line in code.replace("\\\n", " ").splitlines():
        if logical and _open_quote(logical[-1]):
            logical[-1] += "\n" + line  # a quoted argument that spans lines
        else:
            logical.append(line)
    out: list[list[str]] = []
    for line in logical:
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        words: list[str] = []
        for tok in lex:
            if tok and set(tok) <= set(";&|"):
                if words:
                    out.append(words)
                words = []
            else:
                words.append(tok)
        if words:
            out.append(words)
    return out


@cache
def help_text(*command: str) -> str:
    """What ``kvtier COMMAND --help`` prints (run in-process)."""
    from kvtier.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    return out.getvalue()


def subcommands() -> set[str]:
    listing = help_text().split("positional arguments:", 1)[1].split("options:", 1)[0]
    return set(re.findall(r"^ {4}(\w+) ", listing, flags=re.M))


def options(sub: str) -> dict[str, set[str] | None]:
    """The options of ``kvtier SUB``: flag -> its choices (None: any value or none)."""
    text = help_text(sub)
    found: dict[str, set[str] | None] = {}
    for m in re.finditer(r"(?<![\w-])(-{1,2}[A-Za-z][\w-]*)(?: \{([^}]*)\})?", text):
        choices = set(m.group(2).split(",")) if m.group(2) else None
        found[m.group(1)] = choices if choices is not None else found.get(m.group(1))
    return found


def check_kvtier(words: list[str]) -> None:
    assert len(words) > 1 and words[1] in subcommands(), f"unknown kvtier subcommand in {words}"
    opts = options(words[1])
    args = words[2:]
    for i, w in enumerate(args):
        if not w.startswith("-") or w in ("-", "--"):
            continue
        flag = w.split("=", 1)[0]
        assert flag in opts, f"kvtier {words[1]} has no option {flag} (kvtier {words[1]} --help)"
        choices = opts[flag]
        if choices is not None:
            value = w.split("=", 1)[1] if "=" in w else args[i + 1]
            assert value in choices, f"kvtier {words[1]} {flag} takes one of {sorted(choices)}, not {value!r}"


@cache
def project() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]  # type: ignore[no-any-return]


def pinned(name: str) -> str | None:
    for line in (REPO / ".ci" / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.split("==")[0].strip().lower() == name:
            return line.split("==", 1)[1].strip()
    return None


def check_pip(words: list[str]) -> None:
    assert words[1] == "install", f"pip {words[1]}: only pip install is documented"
    extras = set(project()["optional-dependencies"])  # type: ignore[arg-type]
    wheel = f"dist/kvtier-{project()['version']}-py3-none-any.whl"
    args = iter(words[2:])
    for w in args:
        if w in ("-q", "-e", "--no-deps", "--upgrade"):
            continue
        if w == "-c":
            assert (REPO / next(args)).is_file()
            continue
        m = re.fullmatch(r"(\.|kvtier|dist/[\w.-]+\.whl)(?:\[([\w,]+)\])?", w)
        if m is not None:
            if m.group(1).startswith("dist/"):
                assert m.group(1) == wheel, f"the wheel python -m build writes is {wheel}, not {m.group(1)}"
            unknown = set((m.group(2) or "").split(",")) - extras - {""}
            assert not unknown, f"pyproject.toml has no extra {sorted(unknown)}"
            continue
        name, _, version = w.partition("==")
        assert version, f"pip install {w}: pin a version (name==version)"
        if name == "torch":
            assert version == pinned("torch"), f"torch=={version}, but .ci/constraints.txt pins {pinned('torch')}"


def check_python(words: list[str]) -> None:
    args = words[1:]
    if args[0] == "-m":
        module = args[1]
        assert module in ("venv", "pytest", "kvtier") or importlib.util.find_spec(module) is not None, \
            f"python -m {module}: no such module"
    else:
        assert (REPO / args[0]).is_file(), f"python {args[0]}: no such file in the repository"


def check_command(words: list[str]) -> None:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # VAR=value prefixes
    program = words[0]
    if program in ("kvtier", ".venv/bin/kvtier"):
        check_kvtier(words)
    elif program == "bash":
        assert (REPO / words[1]).is_file(), f"bash {words[1]}: no such script in the repository"
    elif program == "pip":
        check_pip(words)
    elif program in ("python", "python3"):
        check_python(words)
    elif program == ".":
        assert words[1] == ".venv/bin/activate", f". {words[1]}: only the venv's activate is sourced"
    elif program == "vllm" and "--kv-transfer-config" in words:
        check_vllm_config(json.loads(words[words.index("--kv-transfer-config") + 1]))
    else:
        assert program in EXTERNAL, f"unknown command {program!r} (not kvtier's, not in EXTERNAL)"


def check_vllm_config(config: dict[str, object]) -> None:
    """The connector config names kvtier's spec class in a module that defines it."""
    extra = config["kv_connector_extra_config"]
    assert isinstance(extra, dict)
    spec = importlib.util.find_spec(extra["spec_module_path"])
    assert spec is not None and spec.origin is not None, f"no module {extra['spec_module_path']}"
    source = Path(spec.origin).read_text(encoding="utf-8")
    assert re.search(rf"^class {extra['spec_name']}\b", source, flags=re.M), \
        f"{extra['spec_module_path']} defines no class {extra['spec_name']}"


@pytest.mark.parametrize("block", CHECKED, ids=lambda b: b.name)
def test_bash_block_names_real_commands_and_flags(block: Block) -> None:
    cmds = commands(block.code)
    assert cmds, f"{block.name}: an empty bash block"
    for words in cmds:
        check_command(words)


def test_the_command_checker_refuses_what_does_not_exist() -> None:
    """The checks above fail on a wrong subcommand, flag, choice, script, extra or pin."""
    for bad in ("kvtier replai", "kvtier replay --no-such-flag", "kvtier replay --router random",
                "bash scripts/no_such.sh", "pip install '.[no_such_extra]'", "pip install torch==0.1",
                "python bench/no_such.py", "make all",
                """vllm serve M --kv-transfer-config '{"kv_connector_extra_config": {"spec_name": "NoSuchSpec",
                   "spec_module_path": "kvtier.adapters.vllm"}}'"""):
        with pytest.raises(AssertionError):
            for words in commands(bad):
                check_command(words)
    for good in ("kvtier replay --router conversation --l3 redis://h:1 # a comment --bogus",
                 "PYTHONPATH=tests kvtier fuzz --machine m:C --steps 1 && kvtier verify --depth 2"):
        for words in commands(good):
            check_command(words)
