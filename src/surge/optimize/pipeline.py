"""`surge optimize` end to end: export, prune, passes, precision, validate, measure, write.

Everything that is decided is recorded in the artifact's manifest.json; an
artifact that misses its accuracy budget is not written unless forced.
"""

from __future__ import annotations

import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

from surge.errors import ConfigError, SurgeError
from surge.models.hf import ModelSpec, copy_side_files
from surge.optimize import artifact as art
from surge.optimize import precision as prec
from surge.optimize.passes import PassContext, PassReport, graph_passes, op_counts, run_passes
from surge.optimize.validate import BUDGETS, LOSSY, Budget, Evaluator, GateResult, check_set_sizes

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
TARGETS = ("cpu", "gpu")


class GateFailed(SurgeError):
    code = "accuracy_gate_failed"

    def __init__(self, message: str, result: "OptimizeResult"):
        super().__init__(message)
        self.result = result


@dataclass
class OptimizeOptions:
    target: str = "cpu"
    precision: str = "fp32"
    auto_block_list: bool = False  # search for the smallest FP32 block list (fp16/bf16)
    block_list: list[str] | None = None  # fixed block list; None = precision.DEFAULT_BLOCK_LIST
    per_channel: bool = True  # int8 weights per output channel (per tensor is far less accurate)
    smooth_alpha: float | str | None = "auto"  # int8 SmoothQuant strength: "auto" (measured), None (off), or 0 < a <= 1
    int8_fallback: bool = True  # int8: keep the most sensitive nodes in FP32 until the calibration budget is met
    int8_method: str = "per-row"  # "per-row" (batch invariant) or "dynamic" (ORT per-tensor, batch dependent)
    int8_outliers: int = 4  # = int8_search.OUTLIER_CHANNELS: each node's largest input channels tried in FP32 (0: never)
    prune_heads: float = 0.0  # fraction of attention heads to remove
    rules: list[str] = field(default_factory=list)  # extra rewrite rules by import path
    budget: Budget | None = None  # None = validate.BUDGETS[precision] (LOSSY when pruning)
    budget_overrides: dict = field(default_factory=dict)  # Budget field -> floor, over `budget` or its default
    force: bool = False
    calibration: list[str] | None = None
    heldout: list[str] | None = None
    search_sentences: int = 48  # calibration sentences the block-list search measures on
    measure_latency: bool = True  # and gate on it: promote only an artifact faster than its source
    serving_shapes: tuple = ()  # (batch, seq) pairs the latency gate measures; () = latency.SHAPES
    min_speedup: float = 1.0  # the latency gate's floor on the median interleaved speedup
    latency_rounds: int = 9
    threads: int = 0

    def check(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.target not in TARGETS:
            raise ConfigError(f"--target must be one of {', '.join(TARGETS)}, not {self.target!r}")
        if self.precision == "int8" and self.target == "gpu":
            raise ConfigError("int8 quantization is a CPU path; use --target cpu")
        from surge.optimize.int8_search import METHODS

        if self.int8_method not in METHODS:
            raise ConfigError(f"--int8-method must be one of {', '.join(METHODS)}, not {self.int8_method!r}")
        if self.int8_outliers < 0:
            raise ConfigError(f"--int8-outliers must be >= 0 (0: off), not {self.int8_outliers}")
        if self.smooth_alpha not in ("auto", None) and not (isinstance(self.smooth_alpha, (int, float))
                                                            and 0.0 < self.smooth_alpha <= 1.0):
            raise ConfigError(f"--smooth-alpha must be 'auto', 'off' or in (0, 1], not {self.smooth_alpha!r}")
        if self.block_list is not None:
            self._check_block_list()
        if not 0.0 <= self.prune_heads < 1.0:
            raise ConfigError("--prune-heads must be in [0, 1)")
        # A floor above 1 (or NaN) fails every artifact, one below 0 passes every one: either way the user
        # learns it only after the whole run, so they are refused here.
        for name, value in {**(self.budget.to_json() if self.budget else {}), **self.budget_overrides}.items():
            flag = BUDGET_FLAGS.get(name, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
                raise ConfigError(f"{flag} must be in [0, 1], not {value!r}", param=flag.lstrip("-"))
        if not (isinstance(self.min_speedup, (int, float)) and self.min_speedup >= 0.0 and self.min_speedup < float("inf")):
            raise ConfigError(f"--min-speedup must be >= 0 (0: measure only), not {self.min_speedup!r}",
                              param="min-speedup")
        from surge.optimize.rules import load_user_rules

        for path in self.rules:  # fail before the slow steps, not in the middle of them
            load_user_rules(path)


    def _check_block_list(self) -> None:
        """A block list names ONNX op types kept in FP32 by the fp16/bf16 conversion: a misspelt name keeps
        nothing, silently, and other precisions have no conversion to apply it to."""
        if self.precision not in ("fp16", "bf16"):
            raise ConfigError(f"--block applies to --precision fp16 or bf16, not {self.precision}", param="block")
        # FP16/BF16 graphs keep standard ONNX ops (no contrib fusions), so the ONNX schemas are the names.
        unknown = [op for op in self.block_list if not onnx.defs.has(op)]
        if unknown:
            raise ConfigError(f"--block: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not ONNX op "
                              f"type(s); the default block list is {', '.join(prec.DEFAULT_BLOCK_LIST)}", param="block")

    def resolved_budget(self) -> Budget:
        """The budget the gate applies: the given one or the precision's (LOSSY when heads are pruned,
        INT8 keeps its own), with the CLI's overrides on top of that same base."""
        import dataclasses

        base = self.budget or (LOSSY if self.prune_heads > 0 and self.precision != "int8" else BUDGETS[self.precision])
        return dataclasses.replace(base, **self.budget_overrides)


# The CLI flag that sets each Budget field, for error messages.
BUDGET_FLAGS = {"mean_cosine": "--min-cosine", "top1": "--min-top1", "top1_strict": "--min-top1-strict",
                "kappa": "--min-kappa", "rank_top1": "--min-rank-top1", "ndcg10": "--min-ndcg10",
                "rank_tau": "--min-rank-tau", "rank_score": "--min-rank-score"}


def check_output(out_dir: Path) -> None:
    """Refuse an output that is a file, or a non-empty folder other than an artifact: before the slow
    steps, so that a typo in -o costs seconds, not the whole run (and never deletes the user's files)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} exists and is not a folder; refusing to overwrite it", param="output")
    if out_dir.is_dir() and not (out_dir / art.MANIFEST).is_file() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} exists and is not a surge artifact; refusing to overwrite it", param="output")


@dataclass
class OptimizeResult:
    manifest: dict
    gate: GateResult
    reports: list[PassReport]
    written: bool = False
    artifact: Path | None = None


def tool_versions() -> dict:
    import numpy
    import onnxruntime
    import onnxscript

    versions = {"python": platform.python_version(), "onnx": onnx.__version__, "onnx_ir": ir.__version__,
                "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__,
                "numpy": numpy.__version__}
    try:
        import torch
        import transformers

        versions.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    return versions


def optimize(spec: ModelSpec, out_dir: Path, options: OptimizeOptions, cache_dir: Path,
             progress: Callable[[str], None] | None = None, on_pass=None) -> OptimizeResult:
    from surge.data import calibration_queries, heldout_queries
    from surge.optimize.export import ensure_exported

    options.check()
    check_output(out_dir)
    calibration = options.calibration or calibration_queries()
    heldout = options.heldout or heldout_queries()
    check_set_sizes(spec, calibration, heldout)
    say = progress or (lambda _: None)
    say("exporting the FP32 source model")
    source_dir = ensure_exported(spec, cache_dir, progress=lambda s: say(f"export: {s}"))
    source_file = source_dir / art.MODEL_FILE
    say("running the FP32 reference on calibration and held-out sentences")
    evaluator = Evaluator(spec, source_file, calibration, heldout, threads=options.threads)
    manifest: dict = {"kind": "optimized", "model_name": spec.name, "source": str(spec.path),
                      "source_hash": spec.content_hash(), "target": options.target,
                      "precision": options.precision, "tools": tool_versions()}

    with tempfile.TemporaryDirectory() as tmp:
        work_file = source_file
        num_heads = spec.num_heads
        if options.prune_heads > 0:
            from surge.optimize.prune import prune_and_export

            say("measuring attention-head importance")
            pruned = prune_and_export(spec, options.prune_heads, calibration, Path(tmp) / "pruned.onnx", say)
            work_file, num_heads = pruned.onnx_file, pruned.heads_per_layer
            manifest["pruning"] = pruned.to_json()

        model = ir.load(str(work_file))
        source_model = ir.load(str(source_file))
        before = op_counts(source_model)
        # Contrib-op fusions are for ONNX Runtime's CPU kernels; FP16/BF16 graphs
        # keep standard ops so the converter can type every value.
        fuse = options.target == "cpu" and options.precision in ("fp32", "int8")
        # The attention width is heads x head size: the hidden size, unless heads were pruned.
        ctx = PassContext(num_heads=num_heads, hidden_size=num_heads * (spec.hidden_size // spec.num_heads),
                          target=options.target,
                          user_rules=list(options.rules))
        say("graph passes")
        reports = run_passes(model, graph_passes(fuse=fuse), ctx, on_pass)
        proto = ir.serde.serialize_model(model)
        if fuse:
            from surge.optimize import skip_split

            say("timing SkipLayerNormalization fused vs split on this CPU")
            proto, manifest["skip_layernorm"] = skip_split.choose(proto, spec.vocab_size, options.threads)
            manifest["ort_disabled_optimizers"] = manifest["skip_layernorm"]["ort_disabled_optimizers"]
        budget = options.resolved_budget()
        decisions, candidate, executed = _apply_precision(proto, options, evaluator, say, budget)
        manifest["precision_decisions"] = decisions

        say("validating against the FP32 source")
        gate = evaluator.gate(candidate, budget)
        gate_json = gate.to_json()
        gate_json["executed"] = executed
        if options.precision == "int8":  # which product the gate measured (engines/int8_weights.py)
            from surge.engines.int8_weights import should_widen

            gate_json["int8_products"] = ("u8 x u8: int8 weights widened at load (this CPU's u8 x s8 product "
                                          "saturates)" if should_widen() else "u8 x s8: int8 weights as stored")
        manifest["validation"] = gate_json
        final = proto if not isinstance(decisions.get("model"), onnx.ModelProto) else decisions.pop("model")
        manifest["precision_decisions"].pop("model", None)
        after = {}
        for node in final.graph.node:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
            after[key] = after.get(key, 0) + 1
        manifest.update(
            nodes={"before": sum(before.values()), "after": sum(after.values())},
            op_types={"before": dict(sorted(before.items())), "after": dict(sorted(after.items()))},
            passes=[r.to_json() for r in reports],
        )
        if options.measure_latency and executed.startswith("onnxruntime-cpu"):
            from surge.optimize.latency import SHAPES, compare_latency

            say("measuring latency (ONNX Runtime CPU)")
            manifest["latency"] = compare_latency(source_file, final.SerializeToString(), spec, options.threads,
                                                  shapes=tuple(options.serving_shapes) or SHAPES,
                                                  rounds=options.latency_rounds,
                                                  disabled_optimizers=manifest.get("ort_disabled_optimizers", ()),
                                                  min_speedup=options.min_speedup)
            from surge.optimize import serving_batch

            say("measuring the serving batch size (ONNX Runtime CPU, one thread)")
            manifest["serving"] = serving_batch.measure(final.SerializeToString(), spec, heldout,
                                                        manifest.get("ort_disabled_optimizers", ()))
            from surge.optimize import serving_layout

            cores = serving_layout.usable_cores()
            say(f"measuring the serving layout at {manifest['serving']['max_batch_size']} a batch (ONNX Runtime CPU, "
                f"{cores} core{'s' if cores > 1 else ''}: one session with every core against one single-thread "
                "session a core)")
            manifest["serving"].update(serving_layout.measure(
                final.SerializeToString(), spec, heldout, manifest["serving"]["max_batch_size"],
                manifest.get("ort_disabled_optimizers", ()), cores=cores,
                progress=lambda step: say(f"serving layout: {step}")))
        else:
            manifest["latency"] = {"measured": False,
                                   "why": "skipped (--no-latency)" if not options.measure_latency else "the artifact does not run on ONNX Runtime CPU (target gpu / bf16)"}
        result = OptimizeResult(manifest, gate, reports)
        failures = [] if gate.passed else ["accuracy gate failed: " + "; ".join(gate.failures)]
        latency_gate = manifest["latency"].get("gate")
        if latency_gate and not latency_gate["passed"]:
            slow = [f"{r['batch']}x{r['seq']} {r['speedup']:.2f}x" for r in manifest["latency"]["rows"] if not r["faster"]]
            failures.append("latency gate failed: not faster than the FP32 source at " + ", ".join(slow))
        if failures and not options.force:
            raise GateFailed("; ".join(failures), result)
        manifest["forced"] = bool(failures)
        manifest["promotion"] = {"accuracy": gate.passed, "latency": latency_gate["passed"] if latency_gate else None,
                                 "forced": bool(failures)}
        say("writing the artifact")
        _write(out_dir, final, manifest, spec)
        result.written, result.artifact = True, Path(out_dir)
        return result


def _apply_precision(proto: onnx.ModelProto, options: OptimizeOptions, evaluator: Evaluator, say, budget: Budget):
    """(decisions, model to validate, how it was executed)."""
    p = options.precision
    if p == "fp32":
        return {"precision": "fp32"}, proto.SerializeToString(), "onnxruntime-cpu fp32"
    if p == "int8":
        from surge.optimize.int8_search import build_int8

        say(f"quantizing to int8 ({options.int8_method})")
        plan = build_int8(proto, evaluator, budget, per_channel=options.per_channel, alpha=options.smooth_alpha,
                          search=options.int8_fallback, progress=say, method=options.int8_method,
                          outlier_channels=options.int8_outliers)
        return ({"precision": "int8", "quantization": plan.info, "model": plan.model}, plan.model.SerializeToString(),
                "onnxruntime-cpu int8")
    decisions: dict = {"precision": p}
    if options.auto_block_list:
        from surge.optimize.search import search_block_list
        from surge.optimize.validate import Encoded, compare, run_model, session

        sample = evaluator.data["calibration"].texts[: options.search_sentences]
        data = Encoded(evaluator.spec, sample)
        ref = run_model(session(evaluator.reference_model_bytes, options.threads), evaluator.spec, data)

        def measure(block: list[str]):
            model = prec.emulate(prec.convert(proto, p, block), p)
            return compare(ref, run_model(session(model.SerializeToString(), options.threads), evaluator.spec, data))

        result = search_block_list(prec.float_op_types(proto), measure, budget, say,
                                   all_op_types=sorted({n.op_type for n in proto.graph.node}))
        block = result.block_list
        decisions["search"] = result.to_json()
    else:
        block = list(options.block_list if options.block_list is not None else prec.DEFAULT_BLOCK_LIST)
    say(f"converting to {p} (FP32 kept for: {', '.join(block) or 'nothing'})")
    nodes: list[str] = []
    if evaluator.reference["calibration"].logits is not None:  # a task graph: its metric may need a few FP32 nodes
        from surge.optimize.task_fallback import search_fp32_nodes

        nodes, decisions["fp32_fallback"] = search_fp32_nodes(
            proto, lambda kept: prec.emulate(prec.convert(proto, p, block, kept), p), evaluator, budget, say)
    low = prec.convert(proto, p, block, nodes)
    decisions.update(block_list=block, fp32_nodes=nodes, model=low,
                     block_list_violations=prec.blocked_nodes_ok(low, block))
    # Validate on the emulation: ORT's CPU provider silently runs FP16 nodes that
    # lack an FP16 kernel in FP32 (it inserts Casts), so a real CPU run would hide
    # FP16 overflow; BF16 has no CPU kernels at all; and a GPU artifact is not
    # run here. The emulation rounds every low-precision value where it is made.
    return decisions, prec.emulate(low, p).SerializeToString(), f"emulated {p} on onnxruntime-cpu (fp32 compute, {p}-rounded values)"


def _write(out_dir: Path, model: onnx.ModelProto, manifest: dict, spec: ModelSpec) -> None:
    out_dir = Path(out_dir)
    manifest.update(model_file=art.MODEL_FILE, pooling=spec.pooling, normalize=spec.normalize,
                    max_length=spec.max_length, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size)
    check_output(out_dir)  # again: the folder may have changed during the run
    with art.staging_dir(out_dir, replace=True) as tmp:
        onnx.save(model, str(tmp / art.MODEL_FILE))
        # The tokenizer, pooling and prompts travel with the artifact so that it can be served alone.
        copy_side_files(spec.path, tmp, extra=("config.json",))
        if spec.task in ("classify", "rerank", "token-classify"):
            from surge.engines.heads import save_head_tensors

            # The graph computes the head (logits out); its tensors travel beside it as well, so the
            # artifact reads as the task model it is (labels checked against the head's outputs).
            save_head_tensors(spec.path, tmp)
        art.write_manifest(tmp, manifest)
