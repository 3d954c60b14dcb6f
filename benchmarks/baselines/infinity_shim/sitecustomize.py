# surge benchmark shim: Infinity 0.0.78 calls tokenizer.batch_encode_plus, which transformers 5 removed.
try:
    import transformers.tokenization_utils_base as _t

    if "batch_encode_plus" not in vars(_t.PreTrainedTokenizerBase):
        def batch_encode_plus(self, batch_text_or_text_pairs, **kw):
            return self(batch_text_or_text_pairs, **kw)

        _t.PreTrainedTokenizerBase.batch_encode_plus = batch_encode_plus
except Exception:  # noqa: BLE001
    pass
