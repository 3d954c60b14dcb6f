"""Schemathesis over the served OpenAPI document of a real `surge serve`.

Every operation the document lists (so routes added later are covered with no
change here) gets a bounded number of generated requests, valid and invalid,
and every built-in check runs: no 5xx, responses match their declared status
codes, content types, headers and schemas, 405 names the allowed methods,
schema-invalid requests are refused.

Two settings differ from schemathesis' defaults. `positive_data_acceptance`
also accepts 400, 413 and 422 for schema-valid requests, because the schema
cannot say everything the server checks (an empty or whitespace text, a
tensor whose shape does not match its data, token ids past the vocabulary, a
version that is not a positive integer). And 501 is not a server error: the
routes Triton has and surge does not support (shared memory) answer 501 Not
Implemented by design, and say so in the document. 424 is accepted too: the
text-embeddings-inference routes answer TEI's 424 Backend error where the model
cannot serve the route (another task, no SPLADE head), as TEI does. Those answers are still
checked against their declared status codes and error schema.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess

MAX_EXAMPLES = 12  # per operation: a few minutes at most on 2 cores, with every phase


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("openapi") / "repo"
    add_version(root, "enc", 1)
    (root / "pipe").mkdir()
    (root / "pipe" / "pipeline.yaml").write_text(
        "inputs: {q: text}\n"
        "nodes:\n"
        "  - {name: a, model: enc, inputs: {text: input.q}}\n"
        "  - {name: b, step: normalize, inputs: {vector: a.vector}}\n"
        "outputs: {v: b.vector}\n")
    # Small limits: generated inputs reach them (413) instead of costing minutes of compute.
    with ServerProcess("--model-repository", str(root), "--threads", "1", "--max-inputs", "8",
                       "--max-body-bytes", "65536", "--request-timeout-s", "20") as srv:
        yield srv


@pytest.fixture(scope="module")
def served_schema(fuzzed_server):
    config = schemathesis.config.SchemathesisConfig.from_dict({
        "checks": {
            # 424: TEI's answer to a schema-valid request its model cannot serve (/predict or /rerank on
            # this embedding model, /embed_sparse without a SPLADE head): declared, and checked as such
            "positive_data_acceptance": {"expected-statuses": ["2xx", "400", "404", "413", "422", "424", "429",
                                                               "501"]},
            "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "501"]},
        },
    })
    return schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("served_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_operation_of_the_served_openapi(case, fuzzed_server):
    case.call_and_validate(timeout=60)
    assert fuzzed_server.alive()
