"""An adapter's weights are read from the file that was checked, not from whatever its path names by then.

read_adapter checks adapter_model.safetensors (a regular file: models/lora.open_regular, the one place an
adapter's file is opened) and then reads it. Here the path is swapped right after that check (the test wraps
open_regular, the documented seam, and runs the real one): for another adapter's weights, and for a FIFO. The
weights read are the checked file's, the same as an untouched copy's. Before, the path was opened a second
time (safetensors' safe_open), so the swapped-in adapter was loaded, and a FIFO was opened (a blocking open,
and the load's, the adapters' lock's and, in Rust, the GIL's, until a writer came).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from surge.errors import ConfigError
from surge.models import lora
from surge.models.decoder import load_decoder_config
from tests.decoder_models import build_lora, build_model

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loraonce")
    base = build_model("qwen2", root / "base-qwen", seed=3)
    return {"root": root, "cfg": load_decoder_config(base), "base": base,
            "one": build_lora(base, root / "one", seed=1, r=4), "two": build_lora(base, root / "two", seed=2, r=4)}


def _same(a: lora.LoraAdapter, b: lora.LoraAdapter) -> bool:
    return a.rank == b.rank and a.weights.keys() == b.weights.keys() and all(
        torch.equal(x, y) for k in a.weights for x, y in zip(a.weights[k], b.weights[k]))


def _swapped_after_check(monkeypatch, swap):
    """open_regular as it is, then `swap(path)` once the weights file has been checked and opened."""
    real = lora.open_regular

    def checked_then_swapped(file, shown, name):
        fh = real(file, shown, name)
        if os.path.basename(file) == WEIGHTS:
            swap(file)
        return fh

    monkeypatch.setattr(lora, "open_regular", checked_then_swapped)


def test_weights_swapped_for_another_adapters_after_the_check_are_not_read(dirs, monkeypatch, tmp_path):
    adapter = shutil.copytree(dirs["one"], tmp_path / "adapter")
    reference = lora.read_adapter(dirs["one"], dirs["cfg"], "one")
    other = lora.read_adapter(dirs["two"], dirs["cfg"], "two")
    assert not _same(reference, other)  # the case this checks: the swap would be seen

    def to_other(file):
        shutil.copy(dirs["two"] / WEIGHTS, tmp_path / "other")
        os.replace(tmp_path / "other", file)

    _swapped_after_check(monkeypatch, to_other)
    got = lora.read_adapter(adapter, dirs["cfg"], "swapped")
    assert (adapter / WEIGHTS).read_bytes() == (dirs["two"] / WEIGHTS).read_bytes()  # it was swapped
    assert _same(got, reference)


def test_weights_swapped_for_a_fifo_after_the_check_are_read_from_the_checked_file(dirs, monkeypatch, tmp_path):
    """A writer process waits on the FIFO for a reader (its open blocks until one comes, then it closes): had
    the loader opened the path again it would have met the writer and read an empty file (and without the writer
    its open would block for ever, holding the GIL: safetensors opens in Rust). The writer is still waiting at
    the end: nothing opened the FIFO."""
    adapter = shutil.copytree(dirs["one"], tmp_path / "adapter")
    reference = lora.read_adapter(dirs["one"], dirs["cfg"], "one")
    writers = []

    def to_fifo(file):
        os.unlink(file)
        os.mkfifo(file)
        writers.append(subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'wb').close()",
                                         str(file)]))

    _swapped_after_check(monkeypatch, to_fifo)
    try:
        got = lora.read_adapter(adapter, dirs["cfg"], "swapped")
        assert len(writers) == 1 and writers[0].poll() is None  # no reader came to the FIFO
    finally:
        for w in writers:
            w.kill()
            w.wait()
    assert _same(got, reference)


def test_a_fifo_in_place_before_the_check_is_refused(dirs, tmp_path):
    adapter = shutil.copytree(dirs["one"], tmp_path / "adapter")
    (adapter / WEIGHTS).unlink()
    os.mkfifo(adapter / WEIGHTS)
    with pytest.raises(ConfigError, match="is not a regular file"):
        lora.read_adapter(adapter, dirs["cfg"], "fifo")
