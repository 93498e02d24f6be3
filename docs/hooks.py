"""MkDocs hooks: the pages that are generated from the code, so that they cannot drift from it.

- ``<!-- config-reference -->`` in a page becomes a table of every config key (its type, default and
  meaning) read from the config dataclasses in ``shardmem/config.py`` and ``shardmem/models/llama.py``:
  the meaning is the comment on the field's line, or the comment lines just above it;
- ``<!-- cli-reference -->`` becomes every command and option of ``shardmem.cli.build_parser()``;
- ``<!-- error-messages -->`` becomes every literal ``ConfigError``/``PlanError`` message in the package;
- ``notebooks/*.ipynb`` are rendered with their outputs from the executed copies that
  ``tests/test_notebooks.py`` stores (:func:`executed_notebook`); a notebook without a current copy is
  executed here, once (minutes), and stored.

The functions are plain Python (MkDocs is imported only by the hooks), so tests/test_site.py calls them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import html
import io
import json
import re
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / ".cache" / "executed-notebooks"


# --- the config reference ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of the config reference."""

    path: str  # e.g. train.global_batch
    type: str
    default: str  # as YAML, or a word for keys without one ("required")
    meaning: str


def field_comments(cls) -> dict[str, str]:
    """Returns field name -> its comment in the source: the comment ending the field's line, after the
    comment lines directly above it (a comment above one field and a blank line before it)."""
    import inspect

    source = inspect.getsource(cls)
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    body = ast.parse(source).body[0].body
    out = {}
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, line = [], node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        lines = range(node.lineno, node.end_lineno + 1)
        trailing = [comments[n] for n in lines if n in comments and n in code_lines]
        out[node.target.id] = " ".join([*above, *trailing]).strip()
    return out


def _type_name(hint) -> str:
    from shardmem.config import Bytes

    if hint == Bytes:
        return "bytes (e.g. 1GiB)"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        names = [_type_name(a) for a in typing.get_args(hint)]
        return " | ".join("null" if n == "NoneType" else n for n in names)
    if origin in (dict, list):
        args = ", ".join(_type_name(a) for a in typing.get_args(hint))
        return f"{'mapping' if origin is dict else 'list'}[{args}]" if args else origin.__name__
    if hint is typing.Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def yaml_value(value) -> str:
    """``value`` as one line of YAML, as a config file would write it."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix(" ...")


def _rows(cls, prefix: str, required: str = "required", skip=()) -> list[Key]:
    hints = typing.get_type_hints(cls, include_extras=True)
    comments = field_comments(cls)
    rows = []
    for field in dataclasses.fields(cls):
        if field.metadata.get("internal") or field.name in skip:
            continue
        if field.default is not dataclasses.MISSING:
            default = yaml_value(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            default = yaml_value(field.default_factory())
        else:
            default = required
        rows.append(Key(prefix + field.name, _type_name(hints[field.name]), default, comments[field.name]))
    return rows


def config_keys() -> dict[str, list[Key]]:
    """Returns the config reference: section title -> its keys, from the config's dataclasses."""
    from shardmem import config as c
    from shardmem.models.llama import PRESETS, ModelConfig

    presets = ", ".join(f"`{name}` ({model.param_count():,} parameters)" for name, model in PRESETS.items())
    preset = Key("model.preset", "str", "null",
                 f"A named architecture, whose fields the other model keys override: {presets}. Setting it "
                 "with --set (or a sweep --grid) replaces the whole model section.")  # fmt: skip
    sections = {
        "model: the reference decoder": [preset, *_rows(ModelConfig, "model.", "from model.preset")],
        "model: a model of your own": _rows(c.UserModelConfig, "model."),
    }
    top = [f for f in dataclasses.fields(c.Config) if not f.metadata.get("internal") and f.name != "model"]
    hints = typing.get_type_hints(c.Config)
    nested = {f.name for f in top if dataclasses.is_dataclass(hints[f.name])}
    sections["top level"] = _rows(c.Config, "", skip={"model", *nested})
    for field in top:
        if dataclasses.is_dataclass(hints[field.name]):
            sections[field.name] = _rows(hints[field.name], field.name + ".")
    return sections


def _class_summary(cls) -> str:
    doc = (cls.__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def config_reference() -> str:
    """Returns the config reference as Markdown."""
    from shardmem import config as c
    from shardmem.models.llama import ModelConfig

    classes = {"model: the reference decoder": ModelConfig, "model: a model of your own": c.UserModelConfig,
               "top level": c.Config}  # fmt: skip
    hints = typing.get_type_hints(c.Config)
    out = []
    for title, keys in config_keys().items():
        cls = classes.get(title) or hints[title]
        out += [f"## {title}", "", _rst_to_md(_class_summary(cls)), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]  # fmt: skip
        for k in keys:
            default = k.default if k.default in ("required", "from model.preset") else f"`{k.default}`"
            out.append(f"| {_key(k.path)} | {k.type} | {default} | {_cell(k.meaning)} |")
        out.append("")
    return "\n".join(out)


def _rst_to_md(text: str) -> str:
    """Docstrings' ``code`` and :role:`target` as Markdown code."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _key(text: str) -> str:
    """A key or flag as code that does not wrap (docs/stylesheets/extra.css), in a table's first column."""
    return f'<code class="key">{html.escape(text)}</code>'


def _cell(text: str) -> str:
    return _rst_to_md(text).replace("|", "\\|")


# --- the CLI reference ---------------------------------------------------------------------------------


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    """Returns subcommand name -> its parser, from ``shardmem.cli.build_parser()``."""
    from shardmem.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def cli_reference() -> str:
    """Returns the reference of every ``shardmem`` command and option as Markdown."""
    from shardmem.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = [f"`shardmem COMMAND`: {parser.description}", ""]
    for action in parser._actions:  # The options before any command (--version).
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            out += [f"`shardmem {action.option_strings[0]}`: {action.help}.", ""]
    for name, command in cli_commands().items():
        usage = " ".join(command.format_usage().removeprefix("usage: ").split())
        out += [f"## `shardmem {name}`", "", f"{helps.get(name, '')}.", "", "```", usage, "```", ""]
        if command.description:
            out += [command.description, ""]
        out += ["| argument | default | meaning |", "|---|---|---|"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(action.option_strings) or action.metavar or action.dest
            if action.option_strings and action.nargs != 0:
                flags += f" {action.metavar or action.dest.upper()}"
            if action.choices and not isinstance(action.choices, dict):
                flags += " {" + ",".join(action.choices) + "}"
            default = "" if action.default in (None, False, [], argparse.SUPPRESS) else f"`{action.default}`"
            if action.required and action.option_strings:
                default = "required"
            out.append(f"| {_key(flags)} | {default} | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out)


# --- the error messages --------------------------------------------------------------------------------

ERROR_CLASSES = ("ConfigError", "PlanError", "DoesNotFitError", "DivergedError")


def error_messages() -> dict[str, list[str]]:
    """Returns module -> the messages it raises (ERROR_CLASSES with a literal or f-string message), with
    each interpolated value written as ``…``."""
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "shardmem").rglob("*.py")):
        tree = ast.parse(path.read_text())
        found = []
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
            text = _template(node.exc.args[0]) if name in ERROR_CLASSES else None
            if text and text not in found:
                found.append(text)
        if found:
            out[str(path.relative_to(ROOT))] = found
    return out


def _template(node) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "..." + "..." across lines
        left, right = _template(node.left), _template(node.right)
        return left + right if left is not None and right is not None else None
    return None


def error_reference() -> str:
    out = []
    for module, messages in error_messages().items():
        out += [f"### `{module}`", ""]
        out += [f"- `{m}`" if "`" not in m else f"- {m}" for m in messages]
        out.append("")
    return "\n".join(out)


def template_pattern(template: str) -> re.Pattern:
    """A regular expression that a message made from ``template`` matches (each ``…`` any text)."""
    return re.compile(".*?".join(re.escape(part) for part in template.split("…")), flags=re.S)


# --- the notebooks -------------------------------------------------------------------------------------


def code_fingerprint() -> str:
    """A hash of what a notebook's outputs depend on besides itself: the package, configs and examples."""
    digest = hashlib.sha256()
    for folder in ("shardmem", "configs", "examples"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def executed_path(notebook: Path, fingerprint: str | None = None) -> Path:
    """Where the executed copy of ``notebook`` (as it is now, with the code as it is now) is stored."""
    source = hashlib.sha256(Path(notebook).read_bytes()).hexdigest()[:16]
    return EXECUTED / f"{Path(notebook).stem}-{source}-{fingerprint or code_fingerprint()}.ipynb"


def store_executed(notebook: Path, executed) -> Path:
    """Saves an executed notebook (an nbformat node) as the copy the docs render; returns its path."""
    import nbformat

    path = executed_path(notebook)
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f"{Path(notebook).stem}-*.ipynb"):
        old.unlink()
    nbformat.write(executed, path)
    return path


def executed_notebook(notebook: Path, log=print) -> Path:
    """Returns the executed copy of ``notebook``, executing it (and storing the copy) if there is none."""
    path = executed_path(notebook)
    if path.exists():
        return path
    import nbclient
    import nbformat

    log(f"executing {notebook.name} (no executed copy for this code yet; tests/test_notebooks.py stores one)")
    executed = nbformat.read(notebook, as_version=4)
    nbclient.NotebookClient(executed, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}}).execute()  # fmt: skip
    return store_executed(notebook, executed)


# XLA's C++ start-up lines on a machine without a GPU (the kernel imports jax before shardmem quiets them).
NATIVE_LOG = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\).*|I\d{4} .*cudart_stub\.cc.*)$", flags=re.M
)


def _without_native_logs(text: str) -> str:
    """The notebook (JSON) without XLA's native log lines in its stderr outputs."""
    notebook = json.loads(text)
    for cell in notebook["cells"]:
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                source = output["text"] if isinstance(output["text"], str) else "".join(output["text"])
                source = NATIVE_LOG.sub("", source).replace("\n\n", "\n")
                if not source.strip():
                    continue
                output["text"] = source
            kept.append(output)
        if "outputs" in cell:
            cell["outputs"] = kept
    return json.dumps(notebook)


# --- the MkDocs hooks ----------------------------------------------------------------------------------


def default_rules() -> str:
    """Returns the default logical axis rules as a Markdown table."""
    from shardmem.parallel.rules import DEFAULT_RULES

    rows = ["| logical axis | mesh axes |", "|---|---|"]
    for name, axes in DEFAULT_RULES.items():
        rows.append(f"| `{name}` | {', '.join(f'`{a}`' for a in axes) if axes else 'replicated (`null`)'} |")
    return "\n".join(rows)


MARKERS = {
    "<!-- default-rules -->": default_rules,
    "<!-- config-reference -->": config_reference,
    "<!-- cli-reference -->": cli_reference,
    "<!-- error-messages -->": error_reference,
}


def _event_priority(priority):
    try:
        from mkdocs.plugins import event_priority
    except ImportError:  # Plain Python (the tests): no MkDocs.
        return lambda f: f
    return event_priority(priority)


@_event_priority(100)  # Before mkdocs-jupyter's on_files, which turns .ipynb files into pages.
def on_files(files, config):
    import logging

    from mkdocs.structure.files import File

    log = logging.getLogger("mkdocs.hooks.shardmem").info
    # A real file under a source folder of its own: mkdocs-jupyter's page wrapper cannot read a
    # File.generated one.
    staged = EXECUTED.parent / "site-notebooks"
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        uri = f"notebooks/{notebook.name}"
        (staged / uri).parent.mkdir(parents=True, exist_ok=True)
        (staged / uri).write_text(_without_native_logs(executed_notebook(notebook, log).read_text()))
        files.append(File(uri, src_dir=str(staged), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))  # fmt: skip
    return files


def on_page_markdown(markdown, page, config, files):
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
