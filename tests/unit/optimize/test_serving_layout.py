"""optimize/serving_layout.py: the rule that picks an artifact's engine layout (one session with every core, or
one single-thread session a core), its measurement on a real model, the manifest round trip, and the layout
`surge serve --artifact` applies from it: only when no flag, SURGE_* variable or model.yaml sets threads or
instances, and only on the core count it was measured on."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from surge.optimize import artifact as art
from surge.optimize.serving_layout import MAX_INSTANCES, choose, layout_hint, layouts, measure, usable_cores
from tests.conftest import CACHE_DIR


@pytest.mark.parametrize("ms, expected", [
    ({(2, 1): 1.00, (1, 2): 0.60}, (1, 2)),  # the INT8 graph on 2 cores: two sessions clearly faster
    ({(2, 1): 1.00, (1, 2): 0.96}, (2, 1)),  # 4% faster is within the tolerance: one session kept
    ({(2, 1): 1.00, (1, 2): 0.94}, (1, 2)),  # 6% is not
    ({(2, 1): 0.55, (1, 2): 0.60}, (2, 1)),  # one session faster outright (big GEMMs)
    ({(1, 1): 2.0}, (1, 1)),                 # one core: one layout
    ({(4, 1): 1.0, (1, 4): 0.50, (2, 2): 0.51}, (2, 2)),  # of the tied layouts, the fewest instances
])
def test_choose_keeps_one_session_unless_another_layout_is_clearly_faster(ms, expected):
    assert choose(ms) == expected


def test_choose_with_no_measurement_is_an_error():
    with pytest.raises(ValueError):
        choose({})


def test_the_layouts_timed_are_one_session_with_every_core_and_one_single_thread_session_a_core():
    assert layouts(1) == [(1, 1)]
    assert layouts(2) == [(2, 1), (1, 2)]
    assert layouts(8) == [(8, 1), (1, 8)]
    assert layouts(200) == [(200, 1), (1, MAX_INSTANCES)]  # EngineConfig.instances' bound


def test_usable_cores_is_this_process_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0))


def _write_serving(path, serving: dict | None, **extra) -> None:
    manifest = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
    manifest.update(extra)
    if serving is None:
        manifest.pop("serving", None)
    else:
        manifest["serving"] = serving
    art.write_manifest(path, manifest)


def test_layout_hint_reads_the_manifest(tmp_path):
    assert layout_hint(None) is None and layout_hint(tmp_path) is None  # no manifest
    _write_serving(tmp_path, None, precision="int8")
    assert layout_hint(tmp_path) is None  # an artifact from before any serving measurement
    # from before the layout measurement: serving.threads was the batch-size timing's thread count
    _write_serving(tmp_path, {"max_batch_size": 8, "threads": 1, "ms_per_query": {"8": 0.7}})
    assert layout_hint(tmp_path) is None
    _write_serving(tmp_path, {"max_batch_size": 8, "threads": 1, "instances": 2, "layout": {"cores": 2}})
    assert layout_hint(tmp_path) == {"threads": 1, "instances": 2, "cores": 2}
    for bad in ({"threads": 1, "instances": 0, "layout": {"cores": 2}},
                {"threads": 1, "instances": True, "layout": {"cores": 2}},
                {"threads": "1", "instances": 2, "layout": {"cores": 2}},
                {"threads": 1, "instances": 2},  # no core count: not known where it holds
                {"threads": 1, "instances": MAX_INSTANCES + 1, "layout": {"cores": 128}},
                {"threads": 1, "instances": 2, "layout": "2 cores"}):
        _write_serving(tmp_path, bad)
        assert layout_hint(tmp_path) is None, bad
    (tmp_path / "manifest.json").write_text("{not json")
    assert layout_hint(tmp_path) is None


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    from surge.models import load_model_spec
    from surge.optimize.export import ensure_exported
    from tests.unit.optimize.conftest import make_tiny_bert

    spec = load_model_spec(make_tiny_bert(tmp_path_factory.mktemp("tiny"), seed=7))
    return spec, (ensure_exported(spec, CACHE_DIR) / "model.onnx").read_bytes()


def test_measure_times_both_layouts_of_a_real_model_and_the_manifest_keeps_the_choice(tiny_onnx, sentences, tmp_path):
    spec, model = tiny_onnx
    seen: list[str] = []
    out = measure(model, spec, sentences[:40], batch_size=4, cores=2, rounds=2, queries=16, progress=seen.append)
    rows = {(r["threads"], r["instances"]): r["ms"] for r in out["layout"]["ms_per_query"]}
    assert set(rows) == {(2, 1), (1, 2)} and all(v > 0 for v in rows.values())
    assert (out["threads"], out["instances"]) == choose(rows)
    assert out["layout"]["cores"] == 2 and out["layout"]["batch_size"] == 4 and out["layout"]["queries"] == 16
    assert len(seen) == 2  # a progress line a layout
    # the round trip: written as `surge optimize` writes it (beside the batch size), read back as the server reads it
    _write_serving(tmp_path, {"max_batch_size": 4, "batch_threads": 1, **out})
    assert layout_hint(tmp_path) == {"threads": out["threads"], "instances": out["instances"], "cores": 2}
    # by default enough batches that every concurrent session runs several
    default = measure(model, spec, sentences[:40], batch_size=8, cores=2, rounds=1)
    assert default["layout"]["queries"] >= 8 * 2 * 4


def test_measure_on_one_core_has_one_layout(tiny_onnx, sentences):
    spec, model = tiny_onnx
    out = measure(model, spec, sentences[:20], batch_size=4, cores=1, rounds=1, queries=8)
    assert (out["threads"], out["instances"]) == (1, 1) and len(out["layout"]["ms_per_query"]) == 1


# --- the serve path: real flag and variable parsing (`surge serve --artifact`), the real model loader ---------

@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory, sentences):
    """A real `surge optimize` artifact of a tiny model (latency unmeasured: its serving fields are written by
    each test, with values no default gives)."""
    from surge.models import load_model_spec
    from surge.optimize.pipeline import OptimizeOptions, optimize
    from tests.unit.optimize.conftest import make_tiny_bert

    spec = load_model_spec(make_tiny_bert(tmp_path_factory.mktemp("tiny-src"), seed=8))
    out = tmp_path_factory.mktemp("art") / "tiny-fp32"
    optimize(spec, out, OptimizeOptions(calibration=sentences[:16], heldout=sentences[200:216], measure_latency=False,
                                        threads=1), CACHE_DIR)
    return out


def _served(artifact, args: list[str] = (), env: dict | None = None):
    """(intra-op threads, instances) of the engines `surge serve --artifact ARTIFACT ARGS` builds."""
    import surge.cli.serve as serve_module
    from surge.cli.bootstrap import load_repository_version
    from surge.cli.main import app
    from surge.cli.single_model import SingleModelCatalog

    got = []
    saved = serve_module.run_server
    serve_module.run_server = got.append  # stops before the HTTP server: the config as the flags built it
    try:
        clean = {k: None for k in os.environ if k.startswith("SURGE_")}
        result = CliRunner().invoke(app, ["serve", "--artifact", str(artifact), *args], env={**clean, **(env or {})})
    finally:
        serve_module.run_server = saved
    assert result.exit_code == 0, result.output
    config = got[0].model_copy(update={"cache_dir": CACHE_DIR})
    catalog = SingleModelCatalog(config)
    entry = catalog.read(catalog.name).versions["1"]
    service = load_repository_version(config, entry, single=True)
    try:
        engines = service.worker.engines.engines
        return engines[0].threads, len(engines)
    finally:
        asyncio.run(service.close())


@pytest.fixture
def served_artifact(tiny_artifact, tmp_path):
    out = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, out)
    return out


def test_serve_applies_the_measured_layout_only_when_nothing_sets_one(served_artifact, capfd):
    # 3 instances of 1 thread: no default gives it (one instance, threads 0), so every assertion below can fail
    _write_serving(served_artifact, {"max_batch_size": 8, "threads": 1, "instances": 3,
                                     "layout": {"cores": usable_cores()}})
    assert _served(served_artifact) == (1, 3)
    assert "3 engine instance(s) x 1 thread(s)" in capfd.readouterr().err
    assert _served(served_artifact, ["--threads", "2"]) == (2, 1)  # an explicit flag wins, the other stays default
    assert _served(served_artifact, ["--instances", "2"]) == (0, 2)
    assert _served(served_artifact, ["--threads", "1", "--instances", "2"]) == (1, 2)
    assert _served(served_artifact, env={"SURGE_THREADS": "2"}) == (2, 1)  # so does a variable
    assert _served(served_artifact, env={"SURGE_INSTANCES": "2"}) == (0, 2)
    capfd.readouterr()
    assert _served(served_artifact, ["--max-batch-size", "4"]) == (1, 3)  # other engine flags leave it applied
    (served_artifact / "model.yaml").write_text("engine: {instances: 2}\n")  # so does a model.yaml's engine section
    assert _served(served_artifact) == (0, 2)
    (served_artifact / "model.yaml").write_text("engine: {max_seq_len: 64}\n")
    assert _served(served_artifact) == (1, 3)


def test_serve_keeps_its_defaults_for_an_artifact_without_a_layout_or_measured_on_other_cores(served_artifact, capfd):
    _write_serving(served_artifact, {"max_batch_size": 8, "threads": 1, "ms_per_query": {"8": 0.5}})  # before
    assert _served(served_artifact) == (0, 1)
    _write_serving(served_artifact, {"max_batch_size": 8, "threads": 1, "instances": 3,
                                     "layout": {"cores": usable_cores() + 1}})
    capfd.readouterr()
    assert _served(served_artifact) == (0, 1)
    assert "not applied" in capfd.readouterr().err
