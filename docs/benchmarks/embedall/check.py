"""A real `surge serve` (docs/benchmarks/embedall/call1.sh) answering /embed_all over fresh connections: status and per-token cosine to the FP32 reference."""
import json
import sys
import urllib.error
import urllib.request

import numpy as np

from surge.data import load_sentences
from tests.reference import hidden_state_texts

url, npz = sys.argv[1], sys.argv[2]
data = np.load(npz)
ref = [data[f"arr_{i}"] for i in range(len(data.files))]
texts = hidden_state_texts(load_sentences())
for attempt in range(6):
    req = urllib.request.Request(url + "/embed_all", data=json.dumps({"inputs": texts}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.loads(r.read())
    except urllib.error.HTTPError as e:
        print(attempt, e.code, e.read()[:200].decode())
        continue
    cos = min(float(((np.asarray(g) * w).sum(1) / np.linalg.norm(g, axis=1) / np.linalg.norm(w, axis=1)).min())
              for g, w in zip(got, ref))
    print(attempt, 200, [np.asarray(g).shape[0] for g in got], f"min cosine {cos:.6f}")
