"""Typed configuration, one object per concern. Defaults live here, in code.

`surge serve`'s flags and their SURGE_* environment variables are derived from
these fields (cli/options.py): name, type, default and help (the description).
A field's `json_schema_extra={"flag": ...}` renames its flag; a class's
`flag_prefix` goes in front of its fields' flags. Nothing reads the environment
at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineConfig(_Strict):
    """Which engine runs the model and how."""

    engine: Literal["onnxrt", "torch"] = Field(
        "onnxrt", description="onnxrt (CPU) or torch (GPU; on device cpu its own CPU path, encoder_cpu: with "
        "precision bf16 its GEMMs use AMX where the CPU has it, and gain most from batching).")
    device: str = Field("cpu", description="cpu, cuda or cuda:N.")
    precision: Literal["fp32", "fp16", "bf16", "int8"] = Field("fp32", description="Compute precision.")
    threads: int = Field(0, ge=0, description="Intra-op threads for a CPU engine (ONNX Runtime per session; torch "
                         "on device cpu: torch.set_num_threads, process-wide); 0 lets the runtime choose.")
    exact_gelu: bool = Field(False, description="Torch engine on CUDA: never use cuBLASLt's bias+GeLU epilogue "
                             "(tanh form, < 5e-4 from erf-GeLU; offered in fp16/bf16 when this is false).")
    batch_invariant: bool = Field(
        True, description="Torch engine (tensor-parallel included) and decoder embedding models: a request's result "
        "is bit for bit the same whatever shares its batch. On "
        "CUDA one GEMM tiling, attention tile and pooling order for every batch; on device cpu every GEMM at row "
        "counts whose rounding does not move a row, each sequence in its own attention block. False lets each batch "
        "shape take its fastest GEMMs (cuBLAS by shape) and share attention blocks, whose sums round apart in the "
        "last bits.")
    instances: int = Field(1, ge=1, le=64, description="Engine copies run concurrently for this model.")
    max_batch_size: int = Field(64, ge=1, description="Largest batch the engine is run with.")
    max_seq_len: int | None = Field(None, ge=1, description="Truncation length; default: the model's own.")
    warmup_shapes: list[tuple[int, int]] = Field(
        default_factory=lambda: [(1, 16), (8, 32)], description="(batch, seq) shapes run before turning ready "
        "(flag: 1x16,8x32).")
    devices: list[int] | None = Field(
        None, description="CUDA ordinals for the torch engine: one replica (x instances) per device, each batch to "
        "the least-loaded; with tensor_parallel > 1, the devices of ranks 0..N-1.")
    tensor_parallel: int = Field(
        1, ge=1, le=64, description="Ranks one model is split over (attention heads and FFN columns), one process "
        "each; CUDA ranks use `devices` (default 0..N-1), CPU ranks (device: cpu) talk over gloo.")

    @model_validator(mode="after")
    def _check_devices(self) -> "EngineConfig":
        if (self.devices or self.tensor_parallel > 1) and self.engine != "torch":
            raise ValueError("devices and tensor_parallel need engine: torch")
        if self.tensor_parallel > 1 and self.instances > 1:
            raise ValueError("tensor_parallel runs one engine across its ranks: leave instances at 1")
        if self.devices is not None:
            if not self.devices or min(self.devices) < 0:
                raise ValueError("devices must be a non-empty list of CUDA ordinals")
            if self.tensor_parallel > 1 and len(set(self.devices)) != len(self.devices):
                raise ValueError("tensor-parallel ranks need distinct devices")
            if self.tensor_parallel > 1 and len(self.devices) != self.tensor_parallel:
                raise ValueError(f"tensor_parallel {self.tensor_parallel} needs as many devices, got {self.devices}")
        return self


class BatchingConfig(_Strict):
    """Dynamic batcher settings (per model)."""

    enabled: bool = Field(True, description="Off: every request runs alone (max batch 1).",
                          json_schema_extra={"flag": "batching"})
    # Bounded as Triton's int32 ModelConfig.max_batch_size: a tensor model without tensor.max_batch_size takes
    # this one as its contract, and past it GET /v2/models/x/config would fail after a load that "worked".
    max_batch_size: int = Field(64, ge=1, le=2**31 - 1, description="Most requests' inputs in one engine batch.")
    max_batch_tokens: int = Field(8192, ge=1, description="Token budget per batch (padded tokens for padded engines).")
    max_queue_delay_ms: float = Field(2.0, ge=0, description="Upper bound on an input's wait in the batch queue while an engine is "
                                      "free (batches leave as soon as an instance is free: no added wait).")
    max_queue_size: int = Field(2048, ge=1, description="Queued inputs above which new requests get 429.")
    max_padding_ratio: float = Field(
        0.25, ge=0, le=1, description="Padded engines: an input that would make more than this share of a batch "
        "padding waits for the next batch (padding costs as much compute as real tokens)."
    )
    max_inflight: int | None = Field(
        None, ge=1, description="Inputs admitted at once (queued, tokenizing or computing) before 429; "
        "default: max_queue_size plus one full batch per engine instance."
    )


class CacheConfig(_Strict):
    """Hot-query cache settings (per model)."""

    flag_prefix: ClassVar[str] = "cache-"

    enabled: bool = Field(True, description="Serve repeated inputs from memory (the flags --cache-bytes 0 and "
                          "--cache-pinned 0 together turn it off too).", json_schema_extra={"flag": "cache"})
    max_bytes: int = Field(64 * 1024 * 1024, ge=0, description="Byte bound of the recent tier (0 disables the "
                           "cache unless a pinned tier is asked for); under --workers also of the table that "
                           "every front end shares (runtime/shm_cache.py).", json_schema_extra={"flag": "cache-bytes"})
    pinned_top_k: int = Field(0, ge=0, description="Size of the pinned hot tier.",
                              json_schema_extra={"flag": "cache-pinned"})
    query_log: Path | None = Field(None, description="Query-log file (one query per line, or the JSON lines "
                                   "`surge bench workload` writes) that seeds the pinned tier.")
    learn_hot: bool = Field(True, description="Learn the hot set online with a frequency sketch.")
    recent_policy: Literal["lru", "tinylfu"] = Field(
        "tinylfu", description="Recent tier: plain LRU, or LRU with TinyLFU admission (keeps one-off queries out).",
        json_schema_extra={"flag": "cache-policy"})
    redis_url: str | None = Field(None, description="Shared tier on Redis, e.g. redis://127.0.0.1:6379/0.",
                                  json_schema_extra={"flag": "redis-url"})
    redis_ttl_s: int = Field(24 * 3600, ge=1, description="Time-to-live of entries in the shared tier.",
                             json_schema_extra={"flag": "redis-ttl-s"})


class LimitsConfig(_Strict):
    """Input limits enforced by the protocol layers."""

    max_inputs_per_request: int = Field(
        2048, ge=1, description="Most inputs in one request (OpenAI's own limit; the batcher still runs them in "
        "batches of its max batch size).", json_schema_extra={"flag": "max-inputs"})
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    max_input_chars: int = Field(20_000, ge=1, description="Longest single text input, in characters.")
    max_token_states_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest POST /embed_all answer, as float32 bytes (its tokens x the "
        "hidden size x 4; the JSON is about 3 times that): a request past it gets 413 before any compute. TEI bounds "
        "the same answer by its max batch tokens (16,384 by default: 24 MiB of MiniLM rows).")
    request_timeout_s: float = Field(30.0, gt=0, description="A request still unanswered then gets 504.")
    request_read_timeout_s: float = Field(
        60.0, gt=0, description="A request whose headers and body have not all arrived this long after its first "
        "byte (on a new connection: after the connection opened) gets 408 and its connection is closed, so that "
        "a client that sends slowly, or nothing, cannot hold a connection for ever. On --metrics-port: the request "
        "must arrive whole this long after the connection opened, else it is closed. On the gRPC port: a connection "
        "whose HTTP/2 handshake has not finished, or that has had no call in flight, this long is closed (GOAWAY; "
        "gRPC clients reconnect at their next call), and a call whose one request message (not a request stream's, which "
        "may wait) has not arrived whole this long after the call started gets DEADLINE_EXCEEDED, so that calls that never send "
        "it cannot hold --grpc-max-concurrent-rpcs.")
    send_timeout_s: float = Field(
        60.0, gt=0, description="A connection whose answer has bytes waiting to be sent (the client's TCP window "
        "full: writing paused, or the write buffer not empty) and none of them taken by the client this long is "
        "closed (nginx's send_timeout), and its request ends as if the client had left (its admission slot, a "
        "generation's sequence and KV blocks freed; counted as a failure, \"cancelled\"), so that a client "
        "that asks for a large answer (POST /embed_all, a big batch, a stream) and never reads it cannot hold "
        "the connection, the answer's memory or an admission slot for ever. A client that reads, however "
        "slowly, is never cut: each byte it takes restarts the clock. HTTP port (under --workers, every process "
        "that serves HTTP). On the gRPC port: a call whose answer (a unary answer, a stream's response, the final "
        "status) waits while its connection's client acknowledges nothing the server sent (TCP) this long has its "
        "connection reset, which ends the calls on it and frees their --grpc-max-concurrent-rpcs slots, so that a "
        "client that grants no HTTP/2 window (a ModelStreamInfer whose responses it never reads) cannot hold a call, "
        "its answer's memory and its slot for ever; cut between 1 and 1.5 times this after its last progress.")
    max_header_bytes: int = Field(
        64 * 1024, ge=4096, description="Largest request line and headers of one HTTP request; more gets 431 and "
        "the connection is closed (uvicorn kept every header, ~10 bytes of memory per byte sent, before any "
        "check, the API key's included). On the gRPC port: the largest metadata of a call (headers included), "
        "more gets RESOURCE_EXHAUSTED.")
    max_connections: int | None = Field(
        None, ge=1, description="Most open connections per process on each of the HTTP and gRPC ports; one more "
        "gets 503 at once and is closed (gRPC: closed at once, the client sees UNAVAILABLE). None: the process's "
        "open-file limit (RLIMIT_NOFILE) less 256 kept for its own files (models, sockets), split between the two "
        "ports when gRPC is on, so idle connections cannot leave it unable to accept or load anything. "
        "--metrics-port: this limit or 64, whichever is lower.")
    grpc_max_concurrent_rpcs: int = Field(
        1024, ge=1, description="Most gRPC calls in flight per process (each may hold a request of up to "
        "--max-body-bytes, a Watch stays in flight while it watches); one more gets RESOURCE_EXHAUSTED at once.")
    grpc_max_connection_age_s: float | None = Field(
        None, gt=0, description="A gRPC connection this old is asked to go (GOAWAY: clients reconnect at their next "
        "call); its calls still running --request-timeout-s later are cut, a stream's included. Bounds how long a "
        "request stream (ModelStreamInfer), which the read timeout leaves alone, can hold one of "
        "--grpc-max-concurrent-rpcs. None: no limit.")
    grpc_keepalive_timeout_s: float = Field(
        20.0, gt=0, description="A gRPC connection on which what the server sent (an answer, a keepalive ping) "
        "stays unacknowledged by the client this long is closed (grpc core's keepalive timeout, which it also sets "
        "as the accepted sockets' TCP_USER_TIMEOUT on Linux): a client that stops reading its socket is cut after it "
        "whatever --send-timeout-s says. The default is grpc core's own; shorter cuts a dead or stalled client "
        "sooner, at the risk of cutting one behind a slow link.")
    auto_truncate: bool = Field(
        False, description="OpenAI route: cut inputs longer than the model instead of answering 400 (a request "
        "can also ask with \"truncate\": true).")
    allow_token_ids: bool = Field(
        False, description="OpenAI route: accept token-id inputs as ids of the model's own tokenizer (clients such "
        "as LangChain send tiktoken ids of another vocabulary, so by default they get 400).")


class MetricsConfig(_Strict):
    """Who can read /metrics and where."""

    flag_prefix: ClassVar[str] = "metrics-"

    public: bool = Field(False, description="Serve /metrics without the API key (scrapers that send none).")
    port: int | None = Field(None, ge=0, le=65535, description="Also serve the metrics on this port, with no "
                             "API key (as Triton's and TEI's metrics ports); None: only on the HTTP port.")


class ResponsesConfig(_Strict):
    """The Responses API's stored answers (POST /v1/responses with `store`, read back, continued with
    `previous_response_id`, cancelled in the background): runtime/response_store.py."""

    flag_prefix: ClassVar[str] = "responses-"

    store_entries: int = Field(10_000, ge=0, description="Responses kept (the least recently used leave first); "
                               "0: none is kept, and `previous_response_id` finds nothing.")
    store_ttl_s: float = Field(24 * 3600, gt=0, description="A stored response is forgotten this long after its "
                               "last write.")
    store_bytes: int = Field(1 << 30, ge=0, description="Bytes of responses kept (their JSON; the least recently "
                             "used leave first, and one larger than this is not kept): a count alone let clients "
                             "keep store_entries request bodies of any size, in memory or shared memory. Not "
                             "applied to Redis, whose own maxmemory bounds it.")
    store_dir: Path | None = Field(None, description="Keep them as files in this directory (shared by servers "
                                   "that mount it); default: in memory, or under --workers in the front ends' "
                                   "shared-memory directory.")
    store_redis_url: str | None = Field(None, description="Keep them on this Redis server (shared by servers on "
                                        "several hosts, e.g. redis://127.0.0.1:6379/0); before store_dir.")


def parse_lora_modules(items) -> dict[str, str]:
    """NAME=PATH strings, or vLLM's JSON form {"name": ..., "path": ...}, -> {name: path}."""
    import json

    out: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if item.startswith("{"):
            obj = json.loads(item)
            name, path = obj.get("name"), obj.get("path")
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"a LoRA module is NAME=PATH, got {item!r}")
        name, path = (name or "").strip(), (path or "").strip()
        if not name or not path:
            raise ValueError(f"a LoRA module needs a name and a path, got {item!r}")
        if name in out:
            raise ValueError(f"LoRA module name {name!r} given twice")
        out[name] = path
    return out


class GenerationConfig(_Strict):
    """Decoder models (task generate): KV cache, scheduler and defaults of one model.

    Server-wide from `--generation FIELD=VALUE` / SURGE_GENERATION_<FIELD>; a model.yaml's
    `generation:` section overrides it field by field.
    """

    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    kv_cache_tokens: int | None = Field(None, ge=1, description="KV-cache size in tokens; default: sized by memory "
                                        "(1 GiB on the host, 40% of free GPU memory).")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences running at once (also the largest "
                                     "CUDA-graph bucket); default: engine.max_batch_size.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step (chunked prefill).")
    max_model_len: int | None = Field(None, ge=1, description="Longest prompt + output; default: engine.max_seq_len, "
                                      "else the model's max_position_embeddings.")
    max_waiting: int = Field(256, ge=1, description="Queued sequences above which new requests get 429.")
    prefix_caching: bool = Field(True, description="Reuse the KV blocks of a seen prompt prefix (by block hash).")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: requests wait and are preempted in arrival order; priority (vLLM's): by each "
        "request's `priority` (lower first, then arrival), the lowest running one preempted first; a request "
        "may give a priority other than 0 only under this policy.")
    quantization: Literal["none", "fp8", "int8", "w8a8"] = Field(
        "none", description="fp8 (vLLM's --quantization fp8): the layers' linear weights quantized at load to FP8 "
        "E4M3 with a scale per output channel, on a GPU of compute capability 8.9+ (Ada, Hopper); int8: to "
        "symmetric INT8 with a scale per output channel (compressed-tensors' W8A16 form), on any GPU of 8.0+ "
        "(Ampere on). Half the weights' memory and the bytes a decode step reads; activations, the KV cache, the "
        "embedding and the LM head stay in the model's dtype. Answers differ from the unquantized model's by the "
        "weights' rounding. A quantized checkpoint's 8-bit weights run as they are on a GPU that runs their kind, "
        "whatever this says. w8a8 (compressed-tensors' W8A8 scheme), on the CPU: every linear weight and the LM "
        "head as symmetric INT8 a row, each input row quantized to INT8 as it comes, the products in integers "
        "(oneDNN's VNNI / AMX kernels): a quarter of FP32's weight bytes; answers are a W8A8 model's.")
    fp8_activations: bool = Field(
        True, description="With FP8 weights (quantization=fp8, or an FP8 checkpoint) on a GPU with FP8 tensor cores "
        "(Hopper on): the products whose input is a norm's output (q/k/v, gate/up) quantize that input's rows to FP8 "
        "E4M3 too, one scale a row, and run on the FP8 tensor cores (vLLM's FP8 W8A8 form; faster than converting "
        "the weights to BF16 from ~1B parameters up, benchmarks/gpu_fp8_forms.py); the o and down products keep "
        "BF16 inputs. false: every FP8 product keeps BF16 inputs (weight-only, closer to the unquantized model).")
    cuda_graphs: bool = Field(True, description="On a GPU: replay decode steps as CUDA graphs per batch bucket.")
    graph_prefill_tokens: int = Field(512, ge=0, le=2048, description="On a GPU with cuda_graphs: a step of "
                                      "prompt chunks (and the decodes beside them) of at most this many tokens in "
                                      "all (whose prompt rows attend to no more keys than a prompt of that many "
                                      "tokens does from its start: a short chunk after a long cached context runs "
                                      "eagerly) replays CUDA graphs of rows, a token a row attending to its "
                                      "sequence's cache up to itself, in replays of up to 256 rows, instead of "
                                      "launching its several hundred kernels one by one (the host's launches were "
                                      "most of a short prompt's time to first token, and stalled every decoding "
                                      "stream while a request joined). 0: such steps run eagerly.")
    prefill_beside: bool = Field(True, description="On a GPU with graph_prefill_tokens and overlap_steps: a prompt "
                                 "arriving while decode launches are in flight (up to overlap_depth x decode_steps "
                                 "steps queued on the GPU) is prefilled and sampled at once, its row graphs replayed "
                                 "on a second CUDA stream beside those launches, instead of waiting for them; the "
                                 "running streams' decodes go on, and the new sequence joins the next launch. "
                                 "Steps that do not take the row graphs, and prompts whose KV blocks the launches in "
                                 "flight may still write (just freed), wait as before.")
    overlap_steps: bool = Field(True, description="Launch the next greedy decode step before the last one's tokens "
                                "are read back (its inputs stay on the device), so host work overlaps the GPU.")
    overlap_depth: int = Field(2, ge=1, le=3, description="Launched decode steps in flight before the oldest is "
                               "read back (with overlap_steps): 2 keeps one step queued behind the running one, "
                               "so a slow host iteration does not idle the GPU; a stop is found up to this many "
                               "steps late (those tokens are dropped).")
    decode_steps: int = Field(4, ge=1, le=16, description="On a GPU, with overlap_steps: greedy decode steps one "
                              "launch runs back to back, each step's inputs made on the device (multi-step "
                              "launches): the host's per-launch work is shared by that many tokens, which then "
                              "reach a stream together (a delivery every few ms), and a request arriving "
                              "meanwhile waits for the launches in flight; 1: a launch a token.")
    decode_launch_ms: float = Field(4.0, gt=0, description="With decode_steps > 1: the longest a launch may take "
                                    "at the step time its batch measured when the graphs were captured (fewer "
                                    "steps for larger models), so a stream's tokens come at least this often.")
    speculative_tokens: int = Field(0, ge=0, le=16, description="Speculative decoding by n-gram lookup (vLLM's "
                                    "'ngram' method): a decode step also checks up to this many draft tokens, "
                                    "copied from where the sequence's last tokens occurred before in its prompt "
                                    "or output, and keeps those the model agrees with (greedy: the model's "
                                    "argmax; sampled: the token the row draws, as plain sampling draws it), so "
                                    "the answer is the one plain decoding gives. Requests with penalties, "
                                    "guides or logprobs are not speculated. Pays where answers repeat their "
                                    "context (quotes, code, JSON, lists); each draft is one more row of the "
                                    "step. 0: off.")
    speculative_model: str | None = Field(None, description="With speculative_tokens: a small decoder model "
                                          "directory of the same tokenizer (e.g. Qwen2.5-0.5B-Instruct for a "
                                          "Qwen2.5-7B) whose greedy tokens are the drafts, instead of n-gram "
                                          "lookup (vLLM's draft-model speculation); it runs beside the model "
                                          "on the same device, its KV cache in blocks numbered as the model's.")
    speculative_max_batch: int = Field(2, ge=1, description="With speculative_tokens: speculate only in steps of "
                                       "at most this many sequences (vLLM's disable_by_batch_size). A decode step "
                                       "costs about the same at 1 or 64 sequences, so drafts are nearly free for a "
                                       "few streams; a step with drafts is read back before the next (no launches "
                                       "ahead), which larger batches lose to (docs/benchmarks/generate.md, "
                                       "session 33).")
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="With speculative_tokens: the shortest n-gram "
                                   "looked up.")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="With speculative_tokens: the longest n-gram looked "
                                   "up (longer matches are tried first).")
    engine_process: bool | None = Field(None, description="Run the engine loop (scheduler, engine, sampler) in a "
                                        "process of its own, so that it and the server's event loop (HTTP, "
                                        "detokenization, streams) never wait for each other's GIL, and on the CPU "
                                        "the engine's OpenMP threads are their process's only ones; default: on.")
    cpu_weight_layout: Literal["auto", "in_out", "out_in"] = Field(
        "auto", description="On the CPU, the layout the linear weights are kept in: in_out ([in, out], x @ W) or "
        "out_in ([out, in], F.linear); each is faster on some processors. auto (default): both timed at load on "
        "the model's own weights at the rows of a decode step, the layers and the LM head apart, the faster kept "
        "(engines/decoder/cpu_layout.py; the choice is logged; weights under 8 MiB a group stay in_out). Answers "
        "are equal up to floating-point rounding; pin one for results that never depend on the machine's timings. "
        "Not used on the GPU.")
    cache_entries: int = Field(1024, ge=0, description="Finished greedy / seeded generations kept (0: off).")
    cache_bytes: int = Field(64 * 1024 * 1024, ge=0, description="Most memory the kept generations may take, "
                             "their keys (prompt, sampling fields) and answers (log-probabilities included) "
                             "counted as the objects they are (about; 0: off): one request's bad words, logit "
                             "bias or grammar can make an entry megabytes, so cache_entries alone let clients "
                             "fill gigabytes. The least recently used go first; a generation larger than this is "
                             "not kept.")
    tool_call_parser: Literal["none", "hermes", "llama3_json", "mistral"] = Field(
        "none", description="How a chat answer's tool calls are read, and written by a required or named "
        "tool_choice (vLLM's --tool-call-parser; server/http/tool_parsers/): 'hermes', <tool_call>{json}</tool_call> "
        "blocks (Qwen2.5, Hermes); 'llama3_json', an answer of {\"name\": ..., \"parameters\": {...}} objects "
        "joined by '; ', optionally after <|python_tag|> (Llama 3.1 / 3.2 / 3.3); 'mistral', [TOOL_CALLS] then a "
        "JSON array of {\"name\", \"arguments\"} or name{json} (Mistral, Mixtral; the text then keeps special "
        "tokens); 'none': requests with tools and tool_choice other than 'none' get 400.")
    reasoning_parser: Literal["none", "deepseek_r1", "qwen3"] = Field(
        "none", description="How a chat answer's thinking is separated from its answer (vLLM's --reasoning-parser; "
        "the message's `reasoning` field, `content` only the answer; server/http/reasoning.py): 'deepseek_r1' "
        "(DeepSeek-R1 and its Qwen2 / Llama distills, QwQ): a leading <think> is dropped, the text before "
        "</think> is reasoning, the rest content, an answer without </think> all reasoning; 'qwen3': the same, "
        "except that a request with chat_template_kwargs enable_thinking false is all content; 'none': the "
        "thinking stays in content.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that gives none (chat, "
                                    "Responses, KServe generate; /v1/completions keeps OpenAI's and "
                                    "vLLM's 16).")
    generation_config: Literal["auto", "none"] = Field(
        "auto", description="vLLM's --generation-config: 'auto' (its default) takes the sampling defaults of the "
        "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; those other than "
        "transformers' own defaults) for a request that leaves them unset, as transformers' generate does; 'none': "
        "OpenAI's defaults (temperature 1, no filters, no penalty).")
    lora_modules: dict[str, str] = Field(default_factory=dict, description="LoRA adapters (PEFT directories) "
                                         "served with the model, each under its own model name: NAME=PATH pairs "
                                         "(--lora-modules, vLLM's flag; separated by ';' in SURGE_GENERATION_"
                                         "LORA_MODULES).")
    max_loras: int | None = Field(None, ge=0, le=64, description="LoRA adapter slots on the engine (any mix of "
                                  "adapters runs in one batch); default: as many as lora_modules, at least one with "
                                  "allow_runtime_lora (as vLLM's --enable-lora); 0: no LoRA. With slots the model "
                                  "runs its unfused layer on a GPU.")
    max_lora_rank: int = Field(16, ge=1, le=512, description="The largest LoRA rank a slot holds (vLLM's default).")
    max_cpu_loras: int | None = Field(None, ge=0, description="LoRA adapters kept loaded (in host memory), swapped "
                                      "into the max_loras slots as their requests run; default: max_loras.")
    allow_runtime_lora: bool = Field(False, description="Adapters may be loaded and unloaded while serving (POST "
                                     "/v1/load_lora_adapter and /v1/unload_lora_adapter, vLLM's routes; "
                                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING): any reachable directory can be read.")

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_pairs(cls, value):
        if isinstance(value, str):  # NAME=PATH[;NAME=PATH...] (an environment variable)
            value = [p for p in value.split(";") if p.strip()]
        if isinstance(value, (list, tuple)):
            return parse_lora_modules(value)
        return value

    @model_validator(mode="after")
    def _lookup_sizes(self):
        if self.speculative_model and not self.speculative_tokens:
            raise ValueError("speculative_model needs speculative_tokens >= 1 (the drafts a step)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self

    def resolved(self, engine: "EngineConfig | None" = None) -> "GenerationConfig":
        """Concrete values: the fields left to the engine's settings take them."""
        engine = engine or EngineConfig()
        # allow_runtime_lora without slots could load nothing: it takes one, as vLLM's --enable-lora does
        loras = self.max_loras if self.max_loras is not None else \
            max(len(self.lora_modules), 1 if self.allow_runtime_lora else 0)
        return self.model_copy(update={"max_num_seqs": self.max_num_seqs or engine.max_batch_size,
                                       "max_model_len": self.max_model_len or engine.max_seq_len,
                                       "max_loras": loras, "max_cpu_loras": max(self.max_cpu_loras or 0, loras)})

    def merged(self, over: "GenerationConfig | None") -> "GenerationConfig":
        """These settings with the fields `over` sets (a model.yaml's section) replaced."""
        if over is None:
            return self
        return self.model_validate({**self.model_dump(), **over.model_dump(exclude_unset=True)})

    @classmethod
    def from_sources(cls, pairs: list[str] | None = None, env=None) -> "GenerationConfig":
        """SURGE_GENERATION_<FIELD> variables, then FIELD=VALUE pairs (the --generation flag). A variable of
        that prefix whose FIELD is not a field is a ValueError naming it, as an unknown --generation field is
        (a misspelled one was silently ignored; other SURGE_* variables are one per flag, and internal knobs
        share the prefix, so only this section's names are a closed set)."""
        import os

        env = os.environ if env is None else env
        known = {f"SURGE_GENERATION_{name.upper()}" for name in cls.model_fields}
        unknown = sorted(k for k in env if k.upper().startswith("SURGE_GENERATION_") and k not in known)
        if unknown:
            raise ValueError(f"unknown environment variable {unknown[0]}: SURGE_GENERATION_<FIELD> takes FIELD one "
                             f"of {', '.join(cls.model_fields)} (in capitals)")
        values: dict = {}
        for name in cls.model_fields:
            raw = env.get(f"SURGE_GENERATION_{name.upper()}")
            if raw is not None:
                values[name] = None if raw.strip().lower() in ("", "none") else raw.strip()
        for pair in pairs or []:
            for item in filter(None, (p.strip() for p in pair.split(","))):
                key, sep, raw = item.partition("=")
                key = key.strip().replace("-", "_")
                if not sep or key not in cls.model_fields:
                    raise ValueError(f"--generation takes FIELD=VALUE with FIELD one of "
                                     f"{', '.join(cls.model_fields)}; got {item!r}")
                values[key] = None if raw.strip().lower() in ("", "none") else raw.strip()
        return cls.model_validate(values)


class ServerConfig(_Strict):
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port.")
    grpc_port: int | None = Field(8001, ge=0, le=65535, description="gRPC port (KServe v2); 0 or None disables gRPC.")
    api_key: str | None = Field(None, description="When set, every route but the health checks needs "
                                "'Authorization: Bearer KEY'.")
    model_dir: Path | None = Field(None, description="Hugging Face model directory; default: the bundled MiniLM.")
    model_name: str | None = Field(None, description="Name the model is served under; default: from its directory.")
    served_model_names: list[str] = Field(
        default_factory=list, description="More names the model answers to on every protocol, e.g. "
        "text-embedding-3-small (the defaults of OpenAI clients, LangChain, LlamaIndex); comma-separated "
        "and/or repeated.", json_schema_extra={"flag": "served-model-name"})
    model_repository: Path | None = Field(None, description="Directory of models/<name>/<version>/model.yaml.")
    task: Literal["embed", "classify", "rerank", "token-classify", "generate"] | None = Field(
        None, description="Override the task detected from the model directory (config.json architectures, "
        "sentence-transformers files).")
    tei_embed: bool = Field(False, description="POST /embed answers text-embeddings-inference's bare array of "
                            "vectors (normalized unless asked otherwise, and TEI's errors, as TEI's) instead of "
                            "surge's native object (POST / always answers TEI's shapes).")
    repository_poll_s: float | None = Field(
        None, gt=0, description="Rescan the model repository this often, in seconds (new versions, changed "
        "model.yaml); 0 or None: never.")
    cache_dir: Path | None = Field(None, description="Where exported artifacts are kept; default ~/.cache/surge.")
    log_level: str = Field("info", description="uvicorn log level.")
    workers: int | None = Field(
        None, ge=0, description="Front-end processes (HTTP, gRPC, cache, tokenizing) in front of the engine "
        "process(es) (cli/workers.py); 1 serves from one process; 0: one per CPU core; None (default): from the "
        "core count where the mode supports it (one embedding model on one CUDA device: three quarters of the "
        "cores, at most 12), else 1. With --model-repository give it explicitly: the engine process runs the "
        "repository and the front ends follow it (embedding models; docs/repository.md).")
    engine_processes: int | None = Field(
        None, ge=1, description="Under --workers: engine processes sharing the device(s); front end i talks to "
        "engine process i mod N (each batches its front ends' requests; several processes can share one "
        "GPU, with NVIDIA MPS where it runs). None (default): 2 with 8 or more front ends, else 1. "
        "With --model-repository each runs the repository; repository calls reach them all.")
    engine_connections: int = Field(
        1, ge=0, description="Under --workers (one model): HTTP connections each engine process serves "
        "itself, taken over from the front end that accepted them while the engine process has fewer: a "
        "lone client's requests then skip the hop between processes (server/http/handoff.py); under load "
        "every other connection stays with the front ends. 0: front ends serve every connection.")
    gc_freeze: bool = Field(
        True, description="Each process of the server freezes its heap once its models are loaded and warmed up "
        "(gc.freeze: Python's full garbage collections then skip torch, the models and the web stack, which "
        "they would walk holding the GIL for 50-200 ms, stalling every request of that process); a model "
        "loaded or unloaded at run time settles the process again (one full collection), so an unloaded model "
        "is freed (runtime/gc_settle.py).")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Decoder models' settings.")
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)

    @field_validator("grpc_port", "repository_poll_s", "api_key", mode="before")
    @classmethod
    def _off(cls, value):
        """0 (a port, a period) or an empty key: off, as None (what a flag or variable can write)."""
        return None if value in (0, "0", "") else value


def merge_set(base: BaseModel, over: BaseModel) -> BaseModel:
    """`base` with the fields `over` set explicitly (its `model_fields_set`) replacing its own;
    validated again, so the result is as if both were written in one file."""
    if not over.model_fields_set:
        return base
    data = base.model_dump(exclude_unset=True)
    data.update({k: getattr(over, k) for k in over.model_fields_set})
    return type(base).model_validate(data)


def default_cache_dir() -> Path:
    """The artifact cache directory, resolved at call time (never at import)."""
    import os

    env = os.environ.get("SURGE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "surge"


# --- model repository and pipeline files (model.yaml, pipeline.yaml) -----------
# The schemas live here; runtime/repository.py and runtime/dag.py read them
# through `load_yaml_file`, whose errors name the file and the field.


class VersionPolicy(_Strict):
    """Which versions of a model are served: exactly one of the three."""

    latest: int | None = Field(None, ge=1, description="Serve the newest N versions (default: 1).")
    specific: list[str] | None = Field(None, min_length=1, description="Serve exactly these versions.")
    all: bool = Field(False, description="Serve every version on disk.")

    @model_validator(mode="after")
    def _one_policy(self):
        chosen = [k for k, on in (("latest", self.latest is not None), ("specific", self.specific is not None),
                                   ("all", self.all)) if on]
        if len(chosen) > 1:
            raise ValueError(f"choose one of latest, specific or all (got {', '.join(chosen)})")
        return self

    def select(self, versions: list[str]) -> list[str]:
        """The versions to serve, out of those on disk (sorted oldest first)."""
        if self.all:
            return list(versions)
        if self.specific is not None:
            wanted = {str(v) for v in self.specific}
            return [v for v in versions if v in wanted]
        return list(versions)[-(self.latest or 1):]


class ModelFile(_Strict):
    """One model version: `models/<name>/<version>/model.yaml`.

    A `models/<name>/model.yaml` next to the version directories may hold
    defaults shared by every version (and the version policy); a version's own
    file overrides them field by field.
    """

    source: str = Field("bundled", description="'bundled' (all-MiniLM-L6-v2) or a model directory, relative to the yaml.")
    task: Literal["embed", "classify", "rerank", "token-classify", "generate"] | None = Field(
        None, description="Override the task detected from `source` (config.json architectures).")
    heads: "list[HeadFile] | None" = Field(
        None, description="Several heads on the backbone of `source` (encode once): each is served under its own "
        "name; the first also under the model's name.")
    artifact: str | None = Field(None, description="A prebuilt artifact directory (relative to the yaml); default: export `source`.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine, device, precision, instances, warm-up shapes.")
    batching: BatchingConfig | None = Field(None, description="Batcher settings; default: the server's.")
    cache: CacheConfig | None = Field(None, description="Cache settings; default: the server's.")
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy, description="Which versions are served.")
    description: str = Field("", description="Free text shown by GET /models.")
    aliases: list[str] = Field(default_factory=list, description="More names the model answers to on every "
                               "protocol (e.g. text-embedding-3-small), listed by GET /v1/models.")
    ray: "RayDeploymentConfig | None" = Field(
        None, description="Ray Serve deployment (replicas, autoscaling, resources) under `surge serve --ray`.")
    kind: Literal["hf", "onnx", "torch", "python"] = Field(
        "hf", description="hf: a Hugging Face encoder (`source`); onnx, torch (.pt2), python (model.py): a tensor "
        "model served by tensor name (KServe v2), see the `tensor` section.")
    tensor: "TensorModelOptions" = Field(default_factory=lambda: TensorModelOptions(),
                                         description="Kinds onnx, torch, python: file, inputs, outputs, batching.")
    generation: GenerationConfig | None = Field(
        None, description="Decoder models: KV cache, scheduler, default max_tokens; default: the server's "
        "(fields set here override it one by one).")


class HeadFile(_Strict):
    """One head of a multi-head model.yaml."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Model name the head is served under.")
    task: Literal["embed", "classify", "rerank", "token-classify"] = Field(..., description="The head's task.")
    source: str | None = Field(None, description="Model directory holding the trained head (relative to the yaml), "
                               "trained on this backbone; embed heads use the backbone's pooling and need none.")

    @model_validator(mode="after")
    def _needs_source(self):
        if self.task != "embed" and not self.source:
            raise ValueError(f"head '{self.name}' of task {self.task} needs a source (its trained checkpoint)")
        return self


PortType = Literal["text", "tokens", "vector", "label", "number", "ranking", "json", "any"]


class PipelineNode(_Strict):
    """One node of a pipeline: exactly one of model, step or function."""

    name: str = Field(..., pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$", description="Unique node name.")
    model: str | None = Field(None, description="A served model: the node embeds its input with it.")
    version: str | None = Field(None, description="Pin a model version (default: the serving one).")
    step: str | None = Field(None, description="A built-in step: tokenize, pool, normalize, classify, topk.")
    function: str | None = Field(None, description="A user function, 'package.module:function' (sync or async).")
    inputs: dict[str, str] = Field(default_factory=dict, description="port -> 'node.output' or 'input.<name>'.")
    outputs: dict[str, PortType] = Field(default_factory=dict, description="Declared outputs of a function node.")
    params: dict = Field(default_factory=dict, description="Settings of the step or function.")
    when: "Condition | None" = Field(None, description="Run only when this holds; skipped nodes output null.")

    @model_validator(mode="after")
    def _one_kind(self):
        kinds = [k for k in ("model", "step", "function") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError(f"node '{self.name}' needs exactly one of model, step, function (got {kinds or 'none'})")
        return self


class Condition(_Strict):
    input: str = Field(..., description="'node.output' whose value is tested.")
    in_: list[str | int | float | bool] = Field(..., alias="in", min_length=1, description="Values for which the node runs.")


class PipelineFile(_Strict):
    """A DAG of models and steps: `<repository>/<name>/pipeline.yaml`."""

    description: str = Field("", description="Free text shown by GET /pipelines.")
    inputs: dict[str, PortType] = Field(..., min_length=1, description="Request fields and their types.")
    nodes: list[PipelineNode] = Field(..., min_length=1, description="The nodes; order does not matter.")
    outputs: dict[str, str] = Field(..., min_length=1, description="Response field -> 'node.output'.")


PipelineNode.model_rebuild()


def load_yaml_file(path: Path, schema: type[BaseModel], *, merge_with: dict | None = None):
    """Parse and validate a YAML file; a ConfigError names the file, line or field."""
    import yaml
    from pydantic import ValidationError

    from surge.errors import ConfigError

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of fields at the top level, got {type(data).__name__}")
    if merge_with:
        data = _deep_merge(merge_with, data)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(_loc(p) for p in err.get("loc", ())).replace(".[", "[") or "(top level)"
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "missing":
            msg = "field required"
        more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
        raise ConfigError(f"{path}: field '{field}': {msg}{more}", param=field) from None


def _loc(part) -> str:
    return f"[{part}]" if isinstance(part, int) else str(part)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


from surge.distributed.config import RayDeploymentConfig  # noqa: E402  (no Ray import: plain pydantic)
from surge.models.tensor_config import TensorModelOptions  # noqa: E402  (plain pydantic)

ModelFile.model_rebuild()
