"""The inputs Triton's vLLM backend takes (its model.json): `text_input`, `sampling_parameters` as a JSON string,
and BOOL flags (`stream`, `exclude_input_in_output`, `return_*`), built with a tritonclient module
(tritonclient.http or tritonclient.grpc)."""

from __future__ import annotations

import json

import numpy as np


def vllm_backend_inputs(mod, prompt: str, sampling: dict, **flags):
    t = mod.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    sp = mod.InferInput("sampling_parameters", [1], "BYTES")
    sp.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
    out = [t, sp]
    for name, value in flags.items():
        f = mod.InferInput(name, [1], "BOOL")
        f.set_data_from_numpy(np.array([value]))
        out.append(f)
    return out
