"""A malformed config.pbtxt is a ConfigError naming the file and the field (the repository shows it for
that model; the others keep loading), never a ValueError / OverflowError / UnicodeDecodeError that
breaks the start, GET /models and the repository index for every model. Strings decode the text
format's escapes and keep UTF-8 text as it is."""

from __future__ import annotations

import pytest

from surge.errors import ConfigError
from surge.models.config_pbtxt import load_model_file, parse_text_proto
from surge.runtime.repository import scan_model

HEAD = 'backend: "python"\n'


@pytest.mark.parametrize("bad, field", [
    ("max_batch_size: abc", "max_batch_size"),
    ("max_batch_size: 1e400", "max_batch_size"),     # float('inf'): int() overflows
    ("max_batch_size: nan", "max_batch_size"),
    ("max_batch_size: [ 4 ]", "max_batch_size"),
    ('input [ { name: "x" data_type: TYPE_FP32 dims: [ x ] } ]', "input"),
    ('output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ two ] } } ]', "output"),
    ("instance_group [ { count: two kind: KIND_CPU } ]", "instance_group"),
    ("instance_group [ { count: 1 kind: KIND_GPU gpus: [ first ] } ]", "instance_group"),
    ("dynamic_batching { max_queue_delay_microseconds: soon }", "max_queue_delay_microseconds"),
    ('parameters: { key: [ 1 ] value: { string_value: "a" } }', "parameters.key"),
    (r'parameters: { key: "p" value: { string_value: "a\x" } }', "invalid escape"),
    (r'parameters: { key: "p" value: { string_value: "\xff" } }', "UTF-8"),
])
def test_malformed_values_are_config_errors_naming_the_file_and_field(tmp_path, bad, field):
    path = tmp_path / "config.pbtxt"
    path.write_text(HEAD + bad + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_model_file(path)
    assert str(path) in e.value.message and field in e.value.message, e.value.message


def test_a_backend_given_as_a_message_is_a_config_error(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text("backend { }\n")
    with pytest.raises(ConfigError) as e:
        load_model_file(path)
    assert str(path) in e.value.message and "field 'backend'" in e.value.message, e.value.message


def test_the_repository_reports_a_malformed_config_pbtxt_on_its_model_only(tmp_path):
    (tmp_path / "bad" / "1").mkdir(parents=True)
    (tmp_path / "bad" / "config.pbtxt").write_text(HEAD + "max_batch_size: abc\n")
    entry = scan_model(tmp_path, "bad")
    assert "max_batch_size" in entry.versions["1"].error


def test_strings_keep_utf8_and_decode_escapes():
    cfg = parse_text_proto(r'''
        a: "naïve café ✓"
        b: "tab\there \"quoted\" back\\slash 'single' nl\n"
        c: "\x41\101\u00e9\303\251"
        d: 'it\'s'
    ''')
    assert cfg["a"] == "naïve café ✓"
    assert cfg["b"] == 'tab\there "quoted" back\\slash \'single\' nl\n'
    assert cfg["c"] == "AAéé"  # hex, octal, \u, and octal bytes that are UTF-8 together
    assert cfg["d"] == "it's"
