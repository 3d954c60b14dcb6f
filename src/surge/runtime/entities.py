"""Token-classification entities, as transformers' `pipeline("token-classification")` reports them.

The same steps as `TokenClassificationPipeline.postprocess` (transformers 4.x / 5.x),
on the tokenizers `Encoding` of the input and the head's logits:

* softmax per token; special tokens dropped;
* `aggregation_strategy`: none (one entity per token, with its index), simple
  (adjacent tokens of one B-/I- tag grouped), first / average / max (subword
  tokens of one word forced to one label first, then grouped as simple);
* a subword is detected as the pipeline does for word-aware tokenizers
  (`len(token) != len(text[start:end])` when the model has a
  continuing-subword prefix, else the whitespace heuristic);
* labels in `ignore_labels` (default ["O"]) dropped.

Scores are float32 like the pipeline's; offsets are character offsets into the text.
"""

from __future__ import annotations

import numpy as np

from surge.errors import InvalidInput

STRATEGIES = ("none", "simple", "first", "average", "max")


def check_strategy(value: str | None) -> str:
    s = (value or "none").lower()
    if s not in STRATEGIES:
        raise InvalidInput(f"aggregation_strategy must be one of {', '.join(STRATEGIES)}, not {value!r}",
                           param="aggregation_strategy")
    return s


class EntityDecoder:
    def __init__(self, hf_tokenizer):
        self.tok = hf_tokenizer
        model = hf_tokenizer.model
        self.word_aware = bool(getattr(model, "continuing_subword_prefix", None))
        self.unk_id = hf_tokenizer.token_to_id(getattr(model, "unk_token", "[UNK]") or "[UNK]")

    def _string(self, tokens: list[str]) -> str:
        dec = self.tok.decoder
        return dec.decode(tokens) if dec is not None else " ".join(tokens)

    def entities(self, text: str, encoding, logits: np.ndarray, labels: tuple[str, ...], strategy: str = "none",
                 ignore_labels: list[str] | None = None) -> list[dict]:
        ignore = ["O"] if ignore_labels is None else list(ignore_labels)
        logits = np.asarray(logits, dtype=np.float32)
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores = shifted / shifted.sum(axis=-1, keepdims=True)
        pre = []
        for idx, (tid, special, (start, end)) in enumerate(zip(encoding.ids, encoding.special_tokens_mask,
                                                               encoding.offsets)):
            if special:
                continue
            word = self.tok.id_to_token(tid)
            ref = text[start:end]
            if self.word_aware:
                sub = len(word) != len(ref)
            else:
                sub = start > 0 and " " not in text[start - 1:start + 1]
            if tid == self.unk_id:
                word, sub = ref, False
            pre.append({"word": word, "scores": scores[idx], "start": start, "end": end, "index": idx,
                        "is_subword": sub})
        if strategy in ("none", "simple"):
            ents = []
            for p in pre:
                k = int(p["scores"].argmax())
                ents.append({"entity": labels[k], "score": p["scores"][k], "index": p["index"], "word": p["word"],
                             "start": p["start"], "end": p["end"]})
        else:
            ents = self._words(pre, strategy, labels)
        if strategy != "none":
            ents = self._group(ents)
        out = [e for e in ents if e.get("entity") not in ignore and e.get("entity_group") not in ignore]
        for e in out:
            e["score"] = float(e["score"])
        return out

    def _word(self, group: list[dict], strategy: str, labels) -> dict:
        word = self._string([e["word"] for e in group])
        if strategy == "first":
            sc = group[0]["scores"]
            k = int(sc.argmax())
            score = sc[k]
        elif strategy == "max":
            best = max(group, key=lambda e: e["scores"].max())
            k = int(best["scores"].argmax())
            score = best["scores"][k]
        else:  # average
            avg = np.nanmean(np.stack([e["scores"] for e in group]), axis=0)
            k = int(avg.argmax())
            score = avg[k]
        return {"entity": labels[k], "score": score, "word": word, "start": group[0]["start"], "end": group[-1]["end"]}

    def _words(self, pre: list[dict], strategy: str, labels) -> list[dict]:
        out, group = [], None
        for e in pre:
            if group is None:
                group = [e]
            elif e["is_subword"]:
                group.append(e)
            else:
                out.append(self._word(group, strategy, labels))
                group = [e]
        if group is not None:
            out.append(self._word(group, strategy, labels))
        return out

    @staticmethod
    def _tag(name: str) -> tuple[str, str]:
        if name.startswith("B-"):
            return "B", name[2:]
        if name.startswith("I-"):
            return "I", name[2:]
        return "I", name

    def _sub(self, ents: list[dict]) -> dict:
        return {"entity_group": ents[0]["entity"].split("-", 1)[-1],
                "score": np.mean(np.nanmean([e["score"] for e in ents])),
                "word": self._string([e["word"] for e in ents]),
                "start": ents[0]["start"], "end": ents[-1]["end"]}

    def _group(self, ents: list[dict]) -> list[dict]:
        groups, cur = [], []
        for e in ents:
            if not cur:
                cur.append(e)
                continue
            bi, tag = self._tag(e["entity"])
            _, last = self._tag(cur[-1]["entity"])
            if tag == last and bi != "B":
                cur.append(e)
            else:
                groups.append(self._sub(cur))
                cur = [e]
        if cur:
            groups.append(self._sub(cur))
        return groups
