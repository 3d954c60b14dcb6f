"""LoRA adapters in GenerateService (engine on a thread of this process, CPU FP32): names, slots, the
generation cache's keys and the settings, each answer checked against transformers + peft."""

from __future__ import annotations

import asyncio
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from surge.config import GenerationConfig  # noqa: E402
from surge.errors import ConfigError, InvalidInput, NotFound  # noqa: E402
from surge.runtime.generate_load import load_generate_service# noqa: E402
from surge.runtime.scheduler import SamplingParams  # noqa: E402
from tests.decoder_models import build_lora, build_model, load_peft  # noqa: E402

PROMPT = list(range(5, 25))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lorasvc")
    base = build_model("llama", root / "base", seed=9)
    # one adapter inside the model directory: a model.yaml names it by a relative path
    return {"base": base, "inside": build_lora(base, base / "adapters" / "inside", seed=1, r=4),
            "other": build_lora(base, root / "other", seed=2, r=8)}


def _peft(dirs, name):
    out = load_peft(dirs["base"], dirs[name]).generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                                       eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _service(dirs, **settings):
    svc = load_generate_service(dirs["base"], "base", config=GenerationConfig(**settings))
    svc.mark_ready()
    return svc


async def _ids(svc, adapter=None, params=GREEDY):
    return (await svc.generate(PROMPT, params, adapter=adapter)).token_ids


def test_configured_adapters_and_their_names(dirs):
    svc = _service(dirs, lora_modules={"inside": "adapters/inside"}, max_loras=2, max_lora_rank=8)

    async def main():
        assert [v.name for v in svc.views] == ["inside"] and svc.views[0].parent == "base"
        assert svc.adapters["inside"].path == (dirs["base"] / "adapters" / "inside").resolve()
        assert await _ids(svc, "inside") == _peft(dirs, "inside")
        base = await _ids(svc)
        assert base != await _ids(svc, "inside")
        with pytest.raises(NotFound, match="'nope' of model 'base' is not loaded"):
            await _ids(svc, "nope")
        view = svc.add_adapter("other", dirs["other"])
        assert await view.generate(PROMPT, GREEDY) is not None
        assert (await view.generate(PROMPT, GREEDY)).token_ids == _peft(dirs, "other")
        with pytest.raises(InvalidInput, match="taken"):
            svc.add_adapter("other", dirs["other"])
        with pytest.raises(InvalidInput, match="2 LoRA adapters loaded, its max_cpu_loras"):
            svc.add_adapter("third", dirs["other"])
        assert svc.remove_adapter("other") is view and not view.ready
        with pytest.raises(NotFound):
            await view.generate(PROMPT, GREEDY)
        third = svc.add_adapter("third", dirs["other"])
        assert (await third.generate(PROMPT, GREEDY)).token_ids == _peft(dirs, "other")
        assert await _ids(svc) == base
        await svc.close()

    asyncio.run(main())


def test_more_adapters_than_slots_are_swapped_in(dirs):
    """Three adapters on one slot, their requests and the base model's all at once (sampled with seeds, so
    not from the generation cache): each answer is its adapter's, as the loop swaps them through the slot."""
    # the loop on a thread of this process: the test reads its slots' load count
    svc = _service(dirs, lora_modules={"a": str(dirs["inside"]), "b": str(dirs["other"])}, max_loras=1,
                   max_cpu_loras=3, max_lora_rank=8, engine_process=False)
    svc.add_adapter("c", dirs["inside"])  # the same files under another name: one registration

    async def main():
        names = [None, "a", "b", "c"] * 3
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=i) for i in range(len(names))]
        got = await asyncio.gather(*(_ids(svc, n, p) for n, p in zip(names, params)))
        base = await _ids(svc)
        want = {None: base, "a": _peft(dirs, "inside"), "b": _peft(dirs, "other"), "c": _peft(dirs, "inside")}
        assert got == [want[n] for n in names]
        assert svc.core.adapters.loads >= 2 and svc.core.adapters.slots == 1
        await svc.close()

    asyncio.run(main())


def test_the_generation_cache_is_keyed_by_the_adapters_content(dirs, tmp_path):
    """The same name loaded again with other weights must not be answered from the first one's cache."""
    moved = tmp_path / "a"
    shutil.copytree(dirs["inside"], moved)
    svc = _service(dirs, max_loras=1, max_lora_rank=8, allow_runtime_lora=True)

    async def main():
        svc.add_adapter("a", moved)
        first = await _ids(svc, "a")
        assert first == _peft(dirs, "inside")
        svc.remove_adapter("a")
        shutil.rmtree(moved)
        shutil.copytree(dirs["other"], moved)
        svc.add_adapter("a", moved)
        hits = svc.metrics.cache_hits._value.get()
        assert await _ids(svc, "a") == _peft(dirs, "other") != first
        assert svc.metrics.cache_hits._value.get() == hits
        assert await _ids(svc, "a") == _peft(dirs, "other")  # a repeat is a hit
        assert svc.metrics.cache_hits._value.get() == hits + 1
        await svc.close()

    asyncio.run(main())


def test_settings_are_checked(dirs):
    with pytest.raises(ConfigError, match="2 LoRA modules but max_cpu_loras 1"):
        _service(dirs, lora_modules={"a": str(dirs["inside"]), "b": str(dirs["other"])}, max_loras=1)
    with pytest.raises(ConfigError, match="rank 8, above max_lora_rank 4"):
        _service(dirs, lora_modules={"b": str(dirs["other"])}, max_lora_rank=4)
    svc = _service(dirs)
    with pytest.raises(InvalidInput, match="without LoRA slots"):
        svc.add_adapter("a", dirs["inside"])
    assert not svc.runtime_adapters
    asyncio.run(svc.close())
    assert GenerationConfig(lora_modules="a=/x; b=/y").lora_modules == {"a": "/x", "b": "/y"}
    assert GenerationConfig(lora_modules=['{"name": "a", "path": "/x"}']).lora_modules == {"a": "/x"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        GenerationConfig(lora_modules=["nopath"])
