"""`surge serve`'s flags are derived from the config fields (cli/options.py): every field has its
flag and its SURGE_* variable in the real `surge serve --help`, with the field's default; the
values that reach the ServerConfig are those set, a flag before a variable; and every flag the
README, docs and tests use still parses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from surge.cli.options import OMITTED, SECTIONS, flags
from surge.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def help_text() -> str:
    env = {**os.environ, "COLUMNS": "400", "TERM": "dumb", "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", "--help"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return re.sub(r"\s+", " ", out.stdout.replace("│", " "))


def test_every_config_field_has_a_flag_and_a_variable_in_the_help(help_text):
    by_target = {t: f for f in flags() for t in f.targets}
    for section, cls in SECTIONS:
        for field, info in cls.model_fields.items():
            if section == "" and field in OMITTED:
                continue
            flag = by_target.get((section, field))
            assert flag is not None, f"{section}.{field} has no flag"
            for name in flag.decl.split("/"):
                assert f" {name} " in help_text, name
            assert f"[env var: {flag.envvar}]" in help_text, flag.envvar
            default = info.get_default(call_default_factory=True)
            if default not in (None, [], False, True) and not flag.multiple:
                assert f"[default: {default}]" in help_text, (flag.name, default)
    # The fields that are no flag of their own are set another way, which the help names.
    assert "[env var: SURGE_MODEL_DIR]" in help_text and "SURGE_GENERATION_<FIELD>" in help_text
    assert set(OMITTED) <= set(ServerConfig.model_fields)


def test_one_flag_for_fields_of_two_sections_sets_both():
    shared = {f.name: f.targets for f in flags() if len(f.targets) > 1}
    assert shared == {"--max-batch-size": [("engine", "max_batch_size"), ("batching", "max_batch_size")]}


def _config(args: list[str], env: dict | None = None) -> ServerConfig:
    import surge.cli.serve as serve_module
    from surge.cli.main import app

    got: list[ServerConfig] = []
    saved = serve_module.run_server
    serve_module.run_server = got.append
    try:
        clean = {k: None for k in os.environ if k.startswith("SURGE_")}
        result = CliRunner().invoke(app, ["serve", *args], env={**clean, **(env or {})})
    finally:
        serve_module.run_server = saved
    assert result.exit_code == 0, result.output
    return got[0]


def test_a_flag_beats_its_variable_and_only_what_is_set_reaches_the_config():
    c = _config(["--max-queue-delay-ms", "3", "--threads", "1"],
                env={"SURGE_MAX_QUEUE_DELAY_MS": "5", "SURGE_MAX_BATCH_SIZE": "8", "SURGE_TEI_EMBED": "true"})
    assert c.batching.max_queue_delay_ms == 3.0  # the flag, over the variable
    assert c.batching.max_batch_size == 8 and c.engine.max_batch_size == 8  # the variable
    assert c.tei_embed is True and c.engine.threads == 1
    assert c.batching.model_fields_set == {"max_queue_delay_ms", "max_batch_size"}
    assert c.engine.model_fields_set == {"threads", "max_batch_size"}
    assert c.cache.model_fields_set == set() and c.cache == ServerConfig().cache  # field defaults, unset
    assert ServerConfig.model_validate(c.model_dump()) .port == 8000


def test_existing_flags_keep_their_meaning():
    c = _config(["--no-batching", "--cache-bytes", "0", "--grpc-port", "0", "--devices", "0,1", "--engine",
                 "torch", "--served-model-name", "a,b", "--served-model-name", "c", "--auto-truncate",
                 "--allow-token-ids", "--metrics-public", "--metrics-port", "9100", "--max-inputs", "16",
                 "--cache-pinned", "0", "--cache-policy", "lru", "--redis-url", "redis://x:1/0",
                 "--request-timeout-s", "2", "--repository-poll-s", "0", "--api-key", "",
                 "--warmup-shapes", "1x8,4x16", "--task", "rerank", "--workers", "1", "--log-level", "warning"])
    assert c.batching.enabled is False and c.cache.enabled is False and c.cache.max_bytes == 0
    assert c.grpc_port is None and c.repository_poll_s is None and c.api_key is None
    assert c.engine.devices == [0, 1] and c.engine.engine == "torch"
    assert c.served_model_names == ["a", "b", "c"]
    assert c.limits.auto_truncate and c.limits.allow_token_ids and c.limits.max_inputs_per_request == 16
    assert c.metrics.public and c.metrics.port == 9100
    assert c.cache.recent_policy == "lru" and c.cache.redis_url == "redis://x:1/0"
    assert c.limits.request_timeout_s == 2.0 and c.engine.warmup_shapes == [(1, 8), (4, 16)]
    assert c.task == "rerank" and c.log_level == "warning"
    # SURGE_NO_BATCHING of earlier releases still turns batching off
    assert _config([], env={"SURGE_NO_BATCHING": "1"}).batching.enabled is False


def test_every_no_switch_is_also_its_variable():
    """README: every flag is also SURGE_ + its name in capitals, `--no-cache` among its examples: a
    `--x/--no-x` switch's SURGE_NO_X=1 turns it off (it was ignored, but for SURGE_NO_BATCHING), SURGE_NO_X=0
    leaves it on; SURGE_X and the flag itself beat it."""
    from surge.cli.options import flags

    switches = [f for f in flags() if "/--no-" in f.decl]
    assert {f.name for f in switches} >= {"--cache", "--batching", "--batch-invariant"}
    for flag in switches:
        section, field = flag.targets[0]
        def value(cfg, section=section, field=field):
            return getattr(getattr(cfg, section) if section else cfg, field)
        var = "SURGE_NO_" + flag.param.upper()
        assert value(_config([], env={var: "1"})) is False, var
        assert value(_config([], env={var: "0"})) is True, var
        assert value(_config([], env={var: "1", flag.envvar: "true"})) is True, var
        assert value(_config([flag.name], env={var: "1"})) is True, var


def test_bad_values_name_their_flag():
    from surge.cli.main import app

    for args, needle in ((["--port", "70000"], "--port"), (["--max-batch-size", "0"], "--max-batch-size"),
                         (["--precision", "fp8"], "--precision"), (["--cache-bytes", "-1"], "--cache-bytes")):
        result = CliRunner().invoke(app, ["serve", *args])
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.output, (args, result.output)


def test_flags_used_in_readme_docs_and_tests_exist():
    """Every `--flag` written after `surge serve` (or passed to ServerProcess) is one of its options."""
    from surge.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    known = set(re.findall(r"--[a-z][a-z0-9-]+", result.output))
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    used: set[str] = set()
    for path in texts:
        for line in path.read_text().splitlines():
            for cmd in re.findall(r"surge serve[^`|]*", line):
                used.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", cmd))
    for path in sorted((ROOT / "tests" / "e2e").rglob("*.py")):
        for call in re.findall(r"ServerProcess\(([^)]*)\)", path.read_text()):
            used.update(re.findall(r"\"(--[a-z][a-z0-9-]+)\"", call))
    missing = sorted(used - known - {"--help"})
    assert not missing, missing


def test_model_yaml_against_the_flags_in_each_mode():
    """`surge serve MODEL`: a set flag beats the model.yaml; in a repository the model.yaml's field
    beats the server-wide flag, and the flag fills what the model.yaml leaves unset."""
    from surge.cli.bootstrap import _sections
    from surge.config import ModelFile

    server = _config(["--max-batch-size", "8", "--max-queue-delay-ms", "3", "--threads", "1"])
    own = ModelFile.model_validate({"engine": {"instances": 2, "max_batch_size": 16},
                                    "batching": {"max_batch_size": 16, "max_queue_size": 100}})
    engine, batching, cache, _ = _sections(server, own, single=True)
    assert (engine.max_batch_size, engine.instances, engine.threads) == (8, 2, 1)
    assert (batching.max_batch_size, batching.max_queue_delay_ms, batching.max_queue_size) == (8, 3.0, 100)
    engine, batching, cache, _ = _sections(server, own, single=False)
    assert (engine.max_batch_size, engine.instances, engine.threads) == (16, 2, 1)
    assert (batching.max_batch_size, batching.max_queue_delay_ms, batching.max_queue_size) == (16, 3.0, 100)
    assert cache == server.cache  # no cache section: the server's
    # nothing set anywhere: the field defaults
    engine, batching, _, _ = _sections(_config([]), ModelFile(), single=True)
    assert engine == ServerConfig().engine and batching == ServerConfig().batching


def test_a_child_process_tells_what_was_set_as_its_parent_does():
    """`--workers`' engine and front-end processes rebuild the ServerConfig from `child_config`: the
    same values, and the fields the user set are still the only ones set, so the model.yaml's fields
    and a decoder's GPU precision come out as they do in the parent."""
    from surge.cli.bootstrap import _sections
    from surge.cli.workers import child_config
    from surge.config import ModelFile
    from surge.runtime.loader import generate_settings

    own = ModelFile.model_validate({"engine": {"instances": 2, "max_batch_size": 16, "threads": 3},
                                    "batching": {"max_batch_size": 16, "max_queue_size": 100}})
    for args in (["--max-batch-size", "8", "--threads", "1"], ["--device", "cuda"],
                 ["--device", "cuda", "--precision", "fp32"], []):
        server = _config(args)
        child = ServerConfig.model_validate_json(child_config(server))
        assert child == server
        for single in (True, False):
            assert _sections(child, own, single) == _sections(server, own, single)
        spec = SimpleNamespace(path=Path("m"))  # a decoder's ModelSpec: only its path is read
        assert generate_settings(spec, child.engine)[:2] == generate_settings(spec, server.engine)[:2]
    engine, _, _, _ = _sections(_config([]), own, single=True)  # nothing set: the model.yaml's threads
    assert engine.threads == 3


def test_a_decoder_on_a_gpu_runs_bf16_unless_a_precision_is_set():
    from surge.config import EngineConfig, merge_set
    from surge.runtime.loader import generate_settings

    spec = SimpleNamespace(path=Path("m"))  # a decoder's ModelSpec: only its path is read
    assert generate_settings(spec, EngineConfig(device="cuda"))[:2] == ("cuda", "bf16")
    assert generate_settings(spec, EngineConfig(device="cuda", precision="fp32"))[:2] == ("cuda", "fp32")
    assert generate_settings(spec, EngineConfig(device="cuda:1", precision="fp16"))[:2] == ("cuda:1", "fp16")
    assert generate_settings(spec, EngineConfig(engine="torch", devices=[1]))[:2] == ("cuda:1", "bf16")
    assert generate_settings(spec, EngineConfig())[:2] == ("cpu", "fp32")
    # a model.yaml's fp32 merged under the server's settings (which set the device only) stays set
    merged = merge_set(_config(["--device", "cuda"]).engine, EngineConfig(precision="fp32"))
    assert generate_settings(spec, merged)[1] == "fp32"
    with pytest.raises(Exception, match="int8"):
        generate_settings(spec, EngineConfig(precision="int8"))


def test_python_dash_m_surge_is_the_surge_command():
    """`python -m surge ...` runs the CLI (it was "'surge' is a package and cannot be directly executed"):
    what to type where the `surge` entry point is missing or belongs to another install."""
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "surge", "--help"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "Usage: surge " in out.stdout and "serve" in out.stdout and "optimize" in out.stdout, out.stdout
