"""One way to configure: every setting declared once (exo/settings/services.py), read once at start
from flags and the environment, listed alike by `exo --help` and docs/operations.md, and handed to
the services, down to each runner process; no module reads the environment on its own."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from exo.main import parse_args
from exo.runner.protocol import Done, Generate, Load, Loaded, RunnerStart
from exo.settings.declare import SettingError, read, settings_of
from exo.settings.docs import with_table
from exo.settings.services import SERVICE_SETTINGS, ApiSettings, MasterSettings, RunnerSettings
from exo.worker.runner_host import RunnerHost
from tests.support.source import parse_python
from tests.support.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXO = ROOT / "exo"
DECLARED = {s.env.name: s for cls in SERVICE_SETTINGS for s in settings_of(cls)}


def test_docs_operations_lists_every_setting_as_the_code_declares_it():
    document = (ROOT / "docs" / "operations.md").read_text()
    assert with_table(document) == document, "run `uv run python -m exo.settings.docs docs/operations.md`"
    for name in DECLARED:
        assert f"| `{name}` |" in document


def test_exo_help_names_every_setting_with_its_flag():
    shown = subprocess.run([sys.executable, "-m", "exo.main", "--help"], capture_output=True, text=True, check=True,
                           env={"COLUMNS": "200", "PATH": ""}).stdout
    for name, setting in DECLARED.items():
        assert name in shown, name
        assert not setting.flag or setting.flag in shown, setting.flag


def test_a_flag_wins_over_the_environment_which_wins_over_the_default():
    environ = {"EXO_SUSPECT_S": "2.5", "EXO_MAX_QUEUE": "7", "EXO_API_KEYS": "a, b", "HF_HUB_OFFLINE": "1",
               "EXO_RUN_MASTER": "0", "EXO_MAX_BATCH": "4", "EXO_HOME": "/tmp/exo-settings-test"}
    config = parse_args(["--max-queue", "9", "--api-key", "c", "--master", "--no-discovery"], environ)
    assert (config.master.suspect_s, config.master.max_queue, config.master.node_timeout_s) == (2.5, 9, 30.0)
    assert config.api.api_keys == ("a", "b", "c") and config.run_master and config.models.offline
    assert config.runner.max_batch == 4 and config.data_dir == Path("/tmp/exo-settings-test")
    assert config.nats_port_auto and config.api_port_auto and config.discovery is None
    given = parse_args(["--no-discovery", "--api-port", "0"], {"EXO_NATS_PORT": "4333"})
    assert (given.nats_port, given.nats_port_auto, given.api_port, given.api_port_auto) == (4333, False, 0, False)


@pytest.mark.parametrize(("environ", "argv", "message"), [
    ({"EXO_SUSPECT_S": "-1"}, [], "EXO_SUSPECT_S='-1': Expected `float` > 0.0"),
    ({"EXO_MAX_BATCH": "lots"}, [], "EXO_MAX_BATCH='lots': Expected `int`, got `str`"),
    ({"EXO_OFFLINE": "perhaps"}, [], "EXO_OFFLINE='perhaps': expected one of 1, true, yes, on, 0, false, no, off"),
    ({}, ["--replicas", "9"], "--replicas='9': Expected `int` <= 5"),
    ({"EXO_RING_PORTS": "many"}, [], "EXO_RING_PORTS='many': Expected `str` matching regex"),
])
def test_a_bad_value_stops_the_start_naming_its_variable_or_flag(environ, argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--no-discovery", *argv], environ)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_an_empty_variable_is_an_unset_one():
    assert read(MasterSettings, {"EXO_SUSPECT_S": "", "EXO_CACHE_ROUTING": " "}) == MasterSettings()
    assert read(ApiSettings, {"EXO_API_KEYS": " , "}).api_keys == ()
    with pytest.raises(SettingError, match="EXO_MAX_IMAGES"):
        read(ApiSettings, {"EXO_MAX_IMAGES": "-3"})


# Reading os.environ is the entry points' business; these few do it for a reason the comment names.
ENVIRONMENT_READERS = {
    "exo/settings/declare.py": "reads the settings (the default environ of read/value_of)",
    "exo/main.py": "the node's entry point passes the environment to the settings",
    "exo/runner/__main__.py": "a runner process reads the RunnerStart its worker put in its environment",
    "exo/runner/distributed.py": "writes MLX_RANK / MLX_HOSTFILE: mlx's ring backend reads only those",
    "exo/worker/runner_host.py": "a runner process inherits the node's environment (HF_*, PATH)",
    "exo/bus/server/embedded.py": "nats-server inherits the node's environment (GOMEMLIMIT wins)",
    "exo/tools/nats_context.py": "XDG_CONFIG_HOME is where the nats CLI keeps its contexts",
}


def _environment_uses(path: Path) -> list[str]:
    uses = []
    for node in ast.walk(parse_python(path)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            uses.append(f"{path.relative_to(ROOT)}:{node.lineno} os.{node.attr}")
    return uses


def test_no_module_reads_the_environment_on_its_own():
    uses = [use for path in sorted(EXO.rglob("*.py")) for use in _environment_uses(path)
            if str(path.relative_to(ROOT)) not in ENVIRONMENT_READERS]
    assert uses == []
    assert _environment_uses(EXO / "runner" / "distributed.py")  # the walk sees a use where there is one


def test_every_exo_variable_the_code_names_is_a_declared_setting():
    """A variable named in the code but not declared would be configuration --help does not show."""
    streams = {json.loads(p.read_text())["name"] for p in (ROOT / "streams").glob("*.json")}
    internal = {"EXO_RUNNER_START"}  # the worker's hand-off to its runner processes (runner/protocol.py)
    named = {m for path in EXO.rglob("*.py") if "settings" not in path.parts
             for node in ast.walk(parse_python(path)) if isinstance(node, ast.Constant)
             and isinstance(node.value, str) for m in re.findall(r"\bEXO_[A-Z0-9_]+\b", node.value)}
    prefixes = {n for n in named if n.endswith("_")}  # of names made at run time: EXO_PROBE_<n> (stream_fit.py)
    assert named - streams - internal - prefixes - set(DECLARED) == set()


@pytest.mark.slow
async def test_a_runner_process_serves_with_the_settings_its_worker_hands_it(nc, nats_url, tmp_path):
    """The hand-off end to end: a real runner process, given an entry limit of 1 for its prompt cache,
    holds one entry after two different prompts and has evicted the first."""
    model = make_tiny_model(tmp_path / "model")
    reports: asyncio.Queue[object] = asyncio.Queue()

    async def on_report(report: object) -> None:
        await reports.put(report)

    async def on_exit(code: int, tail: str) -> None:
        await reports.put(RuntimeError(f"the runner exited with {code}: {tail}"))

    async def next_of(kind: type) -> object:
        while True:
            report = await asyncio.wait_for(reports.get(), 60)
            assert not isinstance(report, RuntimeError), report
            if isinstance(report, kind):
                return report

    start = RunnerStart(nats_urls=[nats_url],  # provisioned by `nc`: the runner streams its text to EXO_TOKENS
                         settings=RunnerSettings(prompt_cache_entries=1, max_batch=1))
    host = RunnerHost("settings-runner", start, tmp_path / "logs")
    await host.start(on_report, on_exit)
    try:
        await host.send(Load(model_path=str(model)))
        await next_of(Loaded)
        for n, text in enumerate(["Tell me about the sea.", "What is the capital of France?"]):
            await host.send(Generate(task_id=f"t{n}", params=_chat(text)))
            done = await next_of(Done)
        assert isinstance(done, Done) and done.prompt_cache is not None
        assert (done.prompt_cache.entries, done.prompt_cache.evictions) == (1, 1)
    finally:
        await host.stop()


def _chat(text: str):
    from exo.core.requests import ChatMessage, GenerationParams

    return GenerationParams(messages=[ChatMessage(role="user", content=text)], temperature=0, max_tokens=4)
