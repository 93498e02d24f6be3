"""The documentation site: its generated references match the code, and the built site works in a browser.

(Named to run after tests/test_notebooks.py, whose executed notebooks the site renders.)
"""

import argparse
import base64
import dataclasses
import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import typing
import urllib.request
from pathlib import Path

import pytest
import yaml

import shardmem
from shardmem.config import Config, config_from_dict
from shardmem.models.llama import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclass needs it)
    spec.loader.exec_module(module)
    return module


def _config_fields(cls, prefix="") -> set[str]:
    """Every key a config file can hold, from the dataclasses themselves."""
    hints = typing.get_type_hints(cls)
    keys = set()
    for field in dataclasses.fields(cls):
        if field.metadata.get("internal"):
            continue
        if field.name == "model" and cls is Config:
            keys |= {"model.preset"} | _config_fields(ModelConfig, "model.")
            keys |= _config_fields(shardmem.config.UserModelConfig, "model.")
        elif dataclasses.is_dataclass(hints[field.name]):
            keys |= _config_fields(hints[field.name], f"{prefix}{field.name}.")
        else:
            keys.add(prefix + field.name)
    return keys


def test_config_reference_lists_every_key_with_its_meaning_and_real_default():
    sections = hooks().config_keys()
    rows = [key for keys in sections.values() for key in keys]
    assert {key.path for key in rows} == _config_fields(Config)
    assert all(key.meaning and key.type for key in rows), [k.path for k in rows if not k.meaning]
    # Each default, read back as YAML, is what a config gets when the key is left out ...
    default = config_from_dict({"model": {"preset": "tiny"}})
    written = {}
    for section, keys in sections.items():
        for key in keys:
            if section.startswith("model"):
                continue
            value = yaml.safe_load(key.default)
            actual = default
            for part in key.path.split("."):
                actual = getattr(actual, part)
            assert value == actual, key
            written[key.path] = value
    # ... and a config that writes every one of them out is the same config.
    raw = {"model": {"preset": "tiny"}}
    for path, value in written.items():
        section, _, name = path.rpartition(".")
        (raw.setdefault(section, {}) if section else raw)[name] = value
    assert config_from_dict(raw) == default
    for key in sections["model: the reference decoder"][1:]:  # Defaults of the reference decoder.
        field = ModelConfig.__dataclass_fields__[key.path.removeprefix("model.")]
        if field.default is not dataclasses.MISSING:
            assert yaml.safe_load(key.default) == field.default, key
    page = hooks().config_reference()
    assert all(f'| <code class="key">{key.path}</code> |' in page for key in rows)


def test_field_comments_read_the_comment_on_a_field_and_the_lines_above_it():
    comments = hooks().field_comments(shardmem.config.MemoryConfig)
    assert comments["usable_fraction"] == "The share of device memory the run may use."
    assert comments["deviceless_margin"].startswith("On an H200 one measured step needed 15.5% more")
    assert comments["compiler_options"].startswith("XLA options for every compile")


def test_default_rules_table_lists_every_default_rule():
    from shardmem.parallel.rules import DEFAULT_RULES

    table = hooks().default_rules()
    assert "| `embed` | `fsdp`, `context` |" in table and "| `norm` | replicated (`null`) |" in table
    assert table.count("\n| `") == len(DEFAULT_RULES)
    assert "<!-- default-rules -->" in (ROOT / "docs" / "guides" / "sharding.md").read_text()


def test_cli_reference_has_every_command_and_option_with_its_help():
    page = hooks().cli_reference()
    commands = hooks().cli_commands()
    assert {"plan", "train", "launch", "sweep", "tune", "policies"} <= set(commands)
    for name, parser in commands.items():
        assert f"## `shardmem {name}`" in page
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f'<code class="key">{flag}' in page or f", {flag}" in page, (name, flag)
            assert action.help, (name, action.dest)  # Every option says what it does.


def test_api_reference_has_an_entry_for_every_public_name():
    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    entries = re.findall(r"^::: shardmem\.(\w+)$", text, flags=re.M)
    assert sorted(entries) == sorted(shardmem.__all__)
    for name in shardmem.__all__:
        obj = getattr(shardmem, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"shardmem.{name} has no docstring"


def _matches(example: str, template: str) -> bool:
    """Whether a message quoted in the docs (maybe cut short with a trailing …) comes from ``template``."""
    cut = example.endswith("…")
    example = example.removesuffix("…")
    pieces = template.split("…")
    for k in range(len(pieces), 1 if cut else len(pieces) - 1, -1):
        pattern = ".*?".join(re.escape(p) for p in pieces[:k]) + (".*" if k < len(pieces) else "")
        if re.fullmatch(pattern, example, flags=re.S):
            return True
    return False


def test_errors_page_quotes_messages_the_code_raises():
    messages = [m for ms in hooks().error_messages().values() for m in ms]
    assert len(messages) > 100  # The package raises about 190, most with literal messages.
    assert any(m.startswith("unknown key …") for m in messages)
    page = (ROOT / "docs" / "reference" / "errors.md").read_text()
    table = page.split("## The ones you are most likely to meet")[1].split("## Every message")[0]
    quoted = re.findall(r"^\| `(.+?)` \|", table, flags=re.M)
    quoted += re.findall(r"^shardmem: error: (.+)$", page, flags=re.M)
    assert len(quoted) >= 10
    for example in quoted:
        assert any(_matches(example, m) for m in messages), example
    assert not _matches("unknown key 'x'; no such thing", "unknown key …; valid keys…: …")


# --- the built site, in a browser ---------------------------------------------------------------------


def _chromium() -> str | None:
    from tests.test_timeline import _chromium as find  # Installs it as root where apt-get can.

    return find()


class _DevTools:
    """The few Chrome DevTools Protocol calls this test needs, over a minimal WebSocket client."""

    def __init__(self, url: str):
        host, port, path = re.match(r"ws://([^:/]+):(\d+)(/.*)", url).groups()
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                          "Sec-WebSocket-Version: 13\r\n\r\n".encode())  # fmt: skip
        response = b""
        while b"\r\n\r\n" not in response:
            response += self.sock.recv(1)
        assert b" 101 " in response.split(b"\r\n")[0], response
        self.next_id, self.events = 0, []

    def _send(self, text: str) -> None:
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
                                  if n < 65536 else bytes([0x80 | 127]) + n.to_bytes(8, "big"))  # fmt: skip
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            out += self.sock.recv(n - len(out))
        return out

    def _receive(self) -> dict:
        message = b""
        while True:
            first, second = self._read(2)
            n = second & 0x7F
            n = int.from_bytes(self._read(2 if n == 126 else 8), "big") if n >= 126 else n
            message += self._read(n)
            if first & 0x80:
                return json.loads(message)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self._send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = self._receive()
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions so far."""
        found = []
        for event in self.events:
            if event.get("method") == "Runtime.exceptionThrown":
                found.append(json.dumps(event["params"]["exceptionDetails"])[:500])
            elif event.get("method") == "Runtime.consoleAPICalled" and event["params"]["type"] == "error":
                found.append(json.dumps(event["params"]["args"])[:500])
            elif event.get("method") == "Log.entryAdded" and event["params"]["entry"]["level"] == "error":
                found.append(json.dumps(event["params"]["entry"])[:500])
        return found


def _wait(devtools: _DevTools, expression: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = devtools.evaluate(expression)
        if value:
            return value
        time.sleep(0.25)
    return devtools.evaluate(expression)


def test_site_builds_strict_and_works_in_headless_chromium(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:  # .ci/run and scripts/setup.sh install it.
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]'): the site is not built")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                           cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    assert all(f'id="shardmem.{name}"' in api for name in shardmem.__all__)
    config_page = (site / "reference" / "config" / "index.html").read_text()
    assert "train.global_batch" in config_page and "<!-- config-reference -->" not in config_page
    notebook = (site / "notebooks" / "01_quickstart" / "index.html").read_text()
    assert "jp-OutputArea" in notebook and "data:image/png;base64" in notebook  # Rendered with outputs.

    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed and cannot be installed here (apt-get as root): not browsed")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}/"
    profile = tmp_path / "profile"
    process = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--disable-background-networking", "--disable-component-update",
                                "--disable-sync", "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                "--window-size=1280,1000", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and "\n" in port_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
        devtools = _DevTools(next(p for p in pages if p["type"] == "page")["webSocketDebuggerUrl"])
        for domain in ("Page", "Runtime", "Log"):
            devtools.call(f"{domain}.enable")
        shots = {}
        for name, path in (("home", ""), ("guide", "guides/remat/")):
            devtools.call("Page.navigate", url=base + path)
            loaded = "document.readyState === 'complete' && !!document.querySelector('.md-content h1')"
            assert _wait(devtools, loaded)
            heading = devtools.evaluate("document.querySelector('.md-content h1').textContent")
            assert heading.strip().startswith({"home": "shardmem", "guide": "Remat"}[name])
            shot = tmp_path / f"site-{name}.png"
            shot.write_bytes(base64.b64decode(devtools.call("Page.captureScreenshot", format="png")["data"]))
            assert shot.stat().st_size > 20_000
            shots[name] = shot
        # Search: Material's ?q= fills the box; its web worker indexes the site and lists the results.
        devtools.call("Page.navigate", url=base + "?q=deviceless")
        results = _wait(devtools, "document.querySelectorAll('.md-search-result__item').length", seconds=60)
        titles = devtools.evaluate("[...document.querySelectorAll('.md-search-result__item h1')]"
                                   ".map(e => e.textContent).join(' | ')")  # fmt: skip
        assert results and results > 0, titles
        shot = tmp_path / "site-search.png"
        shot.write_bytes(base64.b64decode(devtools.call("Page.captureScreenshot", format="png")["data"]))
        assert not devtools.errors(), devtools.errors()
    finally:
        process.terminate()
        process.wait(timeout=30)
        server.shutdown()
    keep = os.environ.get("SHARDMEM_SITE_SCREENSHOTS")  # A folder to keep them in, for a person to look at.
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for shot in tmp_path.glob("site-*.png"):
            shutil.copy(shot, keep)
    print(f"screenshots: {sorted(str(p) for p in tmp_path.glob('site-*.png'))}")
