"""The docs are tested: the README, docs/, CHANGELOG.md and the report pages written with them hold to the code.

- Every relative link resolves: the file (or folder) exists, and a `#anchor` names a heading of the target page
  (GitHub's slugs). References to `docs/*.md` and to `*.md#anchor` in the code's comments are held alike.
- Every command in a ```bash / ```sh / ```console block, and every inline `python -m MODULE ARGS` command, is dry-run,
  never run: `python -m harness ...` and `fsdp-harness ...` are parsed by the CLI's own parser (torchrun's
  options by torchrun's); `python -m pytest ...` has every option looked up among those pytest registered in this
  very run (the harness's plugin, the suites' conftest, pytest-xdist); any other `python -m MODULE ...` must name
  a module that exists, and its options are parsed by the parser its `main` builds (caught before it parses, so
  nothing runs); `python SCRIPT.py` must name a file; `pip install -e ".[extra]"` an extra of pyproject.toml.
- Every long option named in backticks exists among the options of the CLI, pytest, torchrun and the modules the
  docs' commands run.

Placeholders: values that the CLI would import (`--impl`, `--models`, `--optimizers` given as
`package.module:object`) are accepted unchecked, since a command such as `--impl mypkg.adapter:MyAdapter` names
the reader's package; built-in names are still checked by the CLI's own parsers, without importing anything. A
`--report` path is held to its `.md` suffix only (the CLI's own parser probes the file system). Inline spans with
`...` are fragments, not commands, and are not dry-run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import re

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # wherever this file moves
PAGES = sorted(
    {
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "reports" / "performance.md",
        ROOT / "reports" / "false_alarm_findings.md",
        ROOT / "reports" / "measured_behaviour.md",
    }
)
CODE_DIRS = ("harness", "fsdp_impl", "suites")
COMMAND_BLOCKS = ("bash", "sh", "shell", "console")
# Programs a command block may run that these tests do not dry-run: the shell's own, git, and pip, whose
# `install -e ".[extra]"` is checked against the package's extras (pyproject.toml) apart.
UNCHECKED_PROGRAMS = {".", "source", "cd", "export", "git", "pip", "pip3"}
# Long options named in backticks that belong to no parser these tests can build. Empty: torchrun's and the
# modules' options are read from their own parsers; add one here only with the tool it belongs to.
OTHER_TOOLS_OPTIONS: set[str] = set()

FENCE = re.compile(r"^\s*(```+)\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)
LONG_OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
CODE_REFERENCE = re.compile(r"(?<![\w/.-])((?:docs|reports)/[\w./-]+\.md)(#[\w-]+)?")


# ------------------------------------------------------------------------------------------------ reading pages


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[str, list[tuple[int, str, str]]]:
    """(the text with every fenced block blanked line for line, [(line, language, block text)])."""
    prose, blocks, inside, start, lang, body, fence = [], [], False, 0, "", [], ""
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if not inside and m:
            inside, start, lang, body, fence = True, n, m.group(2).lower(), [], m.group(1)
            prose.append("")
        elif inside and line.strip().startswith(fence) and not line.strip().strip("`"):
            inside = False
            blocks.append((start, lang, "\n".join(body)))
            prose.append("")
        elif inside:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def read(page: Path) -> tuple[str, list[Block]]:
    prose, blocks = split_fences(page.read_text())
    return prose, [Block(page, n, lang, body) for n, lang, body in blocks]


def code_spans(prose: str) -> list[tuple[int, str]]:
    """(line, content) of every inline code span, a span wrapped over lines joined with spaces."""
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())) for m in CODE_SPAN.finditer(prose)]


def without_code_spans(prose: str) -> str:
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = read(page)
    seen: dict[str, int] = {}
    out = set()
    for line in prose.split("\n"):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


# ------------------------------------------------------------------------------------------------ links


def links():
    for page in PAGES:
        prose, _ = read(page)
        text = without_code_spans(prose)
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            yield pytest.param(
                page,
                text.count("\n", 0, m.start()) + 1,
                target,
                id=f"{_rel(page)}:{text.count(chr(10), 0, m.start()) + 1}:{target}",
            )


def check_target(base: Path, target: str, where: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (base.parent / path).resolve() if path else base
    assert dest.exists(), f"{where}: {target!r}: no such file or folder {dest}"
    if anchor:
        assert dest.suffix == ".md", f"{where}: {target!r}: an anchor into a file that is not markdown"
        assert anchor in anchors(dest), (
            f"{where}: {target!r}: {_rel(dest)} has no heading with anchor "
            f"#{anchor} (it has: {', '.join(sorted(anchors(dest)))})"
        )


@pytest.mark.parametrize("page,line,target", list(links()))
def test_relative_link_resolves(page, line, target):
    check_target(page, target, f"{_rel(page)}:{line}")


def code_references():
    for folder in CODE_DIRS:
        for src in sorted((ROOT / folder).rglob("*.py")):
            text = src.read_text()
            for m in CODE_REFERENCE.finditer(text):
                path, anchor = m.group(1), m.group(2) or ""
                if path.startswith("docs/") or anchor:  # the docs, and any section cited by its anchor
                    line = text.count("\n", 0, m.start()) + 1
                    yield pytest.param(src, line, path + anchor, id=f"{_rel(src)}:{line}:{path}{anchor}")


@pytest.mark.parametrize("src,line,target", list(code_references()))
def test_code_cites_a_section_that_exists(src, line, target):
    check_target(ROOT / "README.md", target, f"{_rel(src)}:{line}")  # paths relative to the repository's root


# ------------------------------------------------------------------------------------------------ commands


def block_commands(block: Block) -> list[str]:
    """The command lines of a block: a console block's `$ ` lines; a shell block's lines, continuations joined."""
    if block.lang == "console":
        return [line[2:] for line in block.text.split("\n") if line.startswith("$ ")]
    joined = re.sub(r"\\\n\s*", " ", block.text)
    return [line for line in joined.split("\n") if line.strip() and not line.lstrip().startswith("#")]


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at &&, ||, ;, |), comments, redirections and leading
    VAR=value assignments left out."""
    out, cur = [], []
    for tok in shlex.split(line, comments=True):
        if tok in ("&&", "||", ";", "|"):
            out.append(cur)
            cur = []
        elif not re.match(r"^\d*[<>]", tok):
            cur.append(tok)
    out.append(cur)
    cleaned = []
    for cmd in out:
        while cmd and re.match(r"^[A-Za-z_]\w*=", cmd[0]):
            cmd = cmd[1:]
        if cmd:
            cleaned.append(cmd)
    return cleaned


def commands():
    for page in PAGES:
        prose, blocks = read(page)
        for block in blocks:
            if block.lang in COMMAND_BLOCKS:
                for line in block_commands(block):
                    for cmd in simple_commands(line):
                        yield pytest.param(cmd, True, id=f"{_rel(page)}:{block.line}:{shlex.join(cmd)[:60]}")
        for line, span in code_spans(prose):
            # a span that is the program's name alone (`python -m harness`, `fsdp-harness`) names it, runs nothing
            if re.match(r"^(python3? -m \S+|fsdp-harness) \S", span) and "..." not in span:
                for cmd in simple_commands(span):
                    yield pytest.param(cmd, False, id=f"{_rel(page)}:{line}:{shlex.join(cmd)[:60]}")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


@contextlib.contextmanager
def _capturing_parsers():
    """While active, a parser that starts parsing raises _Captured with itself: a module's main() builds its
    parser and hands it over before it does anything."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def _walk(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _walk(sub)


def _without_imports(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser with the value parsers that import the reader's objects (or probe the file system) made to
    accept placeholders; every other parser, the built-in names' included, runs as it is."""
    from harness import options as opt

    def names_only(parse):
        def check(text):
            items = str(text).split(",")
            builtin = [t for t in items if ":" not in t]
            if builtin:
                parse(",".join(builtin))
            return tuple(items)

        return check

    def md_path(text):
        if not str(text).endswith(".md"):
            raise argparse.ArgumentTypeError(f"{text!r} must be a markdown file path ending in .md")
        return Path(text)

    swap = {
        opt.impls: names_only(opt.impls),
        opt.models: names_only(opt.models),
        opt.optimizers: names_only(opt.optimizers),
        opt.report_path: md_path,
    }
    for p in _walk(parser):
        for action in p._actions:
            if action.type in swap:
                action.type = swap[action.type]
    return parser


def harness_parser() -> argparse.ArgumentParser:
    from harness.cli import build_parser

    return _without_imports(build_parser())


def module_parser(module: str) -> argparse.ArgumentParser | None:
    """The parser `python -m module` builds, or None where its main() parses no options with argparse."""
    spec = importlib.util.find_spec(module)
    mod = importlib.import_module(module)
    main = getattr(mod, "main", None)
    if main is None and spec.submodule_search_locations:  # a package: its __main__, if it is ours (guarded)
        entry = importlib.util.find_spec(f"{module}.__main__")
        if entry and entry.origin and Path(entry.origin).is_relative_to(ROOT):
            main = getattr(importlib.import_module(f"{module}.__main__"), "main", None)
    if not callable(main) or not re.search(r"ArgumentParser\(|parse_args\(", inspect.getsource(main)):
        return None  # a main() that parses no options would run: it is never called
    takes_argv = bool(inspect.signature(main).parameters)
    argv = sys.argv
    with _capturing_parsers():
        try:
            sys.argv = [module, "--help"]
            main(["--help"]) if takes_argv else main()
        except _Captured as captured:
            return _without_imports(captured.parser)
        finally:
            sys.argv = argv
    return None


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def parse(parser: argparse.ArgumentParser, args: list[str], what: str) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{what}: the parser refuses it (exit {e.code}): {err.getvalue().strip()}")


def check_pytest_options(args: list[str], config, what: str) -> None:
    for tok in args:
        if tok.startswith("-") and tok != "-" and not re.match(r"^-\d", tok):
            name = tok.split("=", 1)[0]
            try:
                config.getoption(name)
            except ValueError:
                pytest.fail(f"{what}: pytest has no option {name}")


def check_extra(args: list[str], what: str) -> None:
    # pyproject.toml's own, not the installed metadata's (an editable install keeps the extras of its install);
    # Python 3.10 has no tomllib: the metadata's there
    if tomllib is None:
        extras = importlib.metadata.metadata("fsdp-equivalence").get_all("Provides-Extra") or []
    else:
        extras = list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for tok in args:
        m = re.match(r"^\.\[([\w,-]+)\]$", tok)
        if m:
            for extra in m.group(1).split(","):
                assert extra in extras, f"{what}: pyproject.toml has no extra {extra!r} (it has {sorted(extras)})"


def check_command(cmd: list[str], in_block: bool, config) -> None:
    what = shlex.join(cmd)
    prog, args = cmd[0], cmd[1:]
    if prog == "torchrun":
        ns = parse(torchrun_parser(), args, what)
        assert ns.module, f"{what}: torchrun runs the harness with -m"
        return check_command(["python", "-m", ns.training_script, *ns.training_script_args], in_block, config)
    if prog == "fsdp-harness":
        parse(harness_parser(), args, what)
        return
    if prog in ("pip", "pip3") and args[:2] == ["install", "-e"]:
        return check_extra(args, what)
    if prog in UNCHECKED_PROGRAMS:
        return
    if prog == "pytest":
        return check_pytest_options(args, config, what)
    assert re.fullmatch(r"python3?", prog), f"{what}: a command these tests do not know how to check"
    if args[:1] == ["-c"]:
        return
    if args[:1] != ["-m"]:
        script = args[0] if args else ""
        assert (ROOT / script).is_file(), f"{what}: no script {script!r} in the repository"
        return
    module, rest = args[1], args[2:]
    if module == "harness":
        parse(harness_parser(), rest, what)
    elif module == "pytest":
        check_pytest_options(rest, config, what)
    else:
        assert importlib.util.find_spec(module) is not None, f"{what}: no module {module!r}"
        if in_block and rest:  # inline spans name modules with placeholders (SEED MODEL DIR): existence only
            parser = module_parser(module)
            assert parser is not None, f"{what}: {module}'s main() builds no argparse parser to check its options"
            parse(parser, rest, what)


@pytest.mark.parametrize("cmd,in_block", list(commands()))
def test_command_dry_runs(cmd, in_block, pytestconfig):
    check_command(cmd, in_block, pytestconfig)


# ------------------------------------------------------------------------------------------------ options named


def known_options() -> set[str]:
    """The long options of the CLI, torchrun and every module the docs' commands run."""
    names = {o for p in _walk(harness_parser()) for a in p._actions for o in a.option_strings}
    names |= {o for a in torchrun_parser()._actions for o in a.option_strings}
    modules = set()
    for param in commands():
        cmd = param.values[0]
        if cmd[:2] in (["python", "-m"], ["python3", "-m"]) and cmd[2] not in ("harness", "pytest"):
            modules.add(cmd[2])
    for module in sorted(modules):
        if importlib.util.find_spec(module) is not None:
            parser = module_parser(module)
            if parser is not None:
                names |= {o for p in _walk(parser) for a in p._actions for o in a.option_strings}
    return names | OTHER_TOOLS_OPTIONS


def named_options():
    for page in PAGES:
        prose, _ = read(page)
        for line, span in code_spans(prose):
            for opt in LONG_OPTION.findall(span):
                yield page, line, opt


def test_every_option_named_exists(pytestconfig):
    known = known_options()
    missing = []
    for page, line, opt in named_options():
        if opt in known:
            continue
        try:
            pytestconfig.getoption(opt)
        except ValueError:
            missing.append(f"{_rel(page)}:{line}: {opt}")
    assert not missing, "options named in the docs that no parser has:\n" + "\n".join(missing)


def test_the_docs_have_commands_links_and_options():
    """The extraction itself finds what it should (a regex that matches nothing would pass every test above)."""
    assert len(list(links())) > 50
    assert len([p for p in commands() if p.values[1]]) > 30
    assert len(list(named_options())) > 100
    assert len(list(code_references())) > 10
