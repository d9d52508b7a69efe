"""Every `moelab serve` flag: one torch-free argparse parser, and the flags the benchmark may tune.

The daemon, the profile editor and the benchmark all read this module; importing it must stay cheap
(no torch, no numpy). engine/config/config.py turns what the parser read into the engine's typed
settings.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from ..text import Text
from .split import PIPELINE_MIN_ROWS, LayerSplit, parse_devices

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
EXPERT_DTYPES = ("auto", "bf16", "fp8", "mxfp4", "nvfp4")
DENSE_DTYPES = ("auto", "fp8")
CPU_KERNELS = ("auto", "native", "torch")
CPU_PINS = ("cores", "isolate", "off")
CACHE_ADMISSIONS = ("recent", "frequency")
EARLY_CACHED = ("off", "on")
GENERATION_CONFIGS = ("auto", "off")
REASONING_PARSERS = ("off", "think", "harmony")
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen_xml", "harmony")
LOG_LEVELS = ("debug", "info", "warning", "error")
# the memory a CPU device plans with where --device-memory is not given (a GPU plans its free one)
CPU_DEFAULT_BUDGET_BYTES = 2 * 1024**3


def parse_bytes(text: str) -> int:
    """A size such as `24GiB`, `512M`, `1.5g` or `1073741824`, in bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            Text(
                "{text!r} is not a size; write a number with an optional unit, e.g. 24GiB, 512MiB, "
                "8G",
                text=text,
            )
        )
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def check_bytes(value: int) -> None:
    """A size in bytes, as parse_bytes reads one: 0 or more."""
    if value < 0:
        raise argparse.ArgumentTypeError(Text("{value} is not a size", value=value))


def parse_device_memory(text: str) -> tuple[int, ...]:
    """`--device-memory`: one size for each device (24GiB), or one per device of --devices,
    separated by commas (12GiB,8GiB)."""
    return tuple(parse_bytes(part) for part in str(text).split(","))


def check_device_memory(values: tuple[int, ...]) -> None:
    """Sizes as parse_device_memory reads them: one or more, each 0 or more."""
    for value in values:
        check_bytes(value)


@dataclass(frozen=True, slots=True)
class WholeNumber:
    """An argparse type: a whole number of at least `minimum` (and at most `maximum`). `check`
    is the same rule for a value already read (engine/config/config.py checks its settings with
    it)."""

    minimum: int
    maximum: int | None = None

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                Text("{text!r} is not a whole number", text=text)
            ) from None
        self.check(value)
        return value

    def check(self, value: int) -> None:
        minimum, maximum = self.minimum, self.maximum
        if maximum is not None and not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                Text(
                    "{value} must be from {minimum} to {maximum}",
                    value=value,
                    minimum=minimum,
                    maximum=maximum,
                )
            )
        if value < minimum and minimum == 1:
            raise argparse.ArgumentTypeError(Text("{value} must be at least 1", value=value))
        if value < minimum:
            raise argparse.ArgumentTypeError(
                Text("{value} must be {minimum} or more", value=value, minimum=minimum)
            )


@dataclass(frozen=True, slots=True)
class Share:
    """An argparse type: a number from 0 to 1 (above 0 where `above_zero`, as a share of all
    experts is); `check` is the same rule for a value already read."""

    above_zero: bool = False

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(Text("{text!r} is not a number", text=text)) from None
        self.check(value)
        return value

    def check(self, value: float) -> None:
        if self.above_zero and not 0.0 < value <= 1.0:
            raise argparse.ArgumentTypeError(
                Text("{value} must be a share of all experts, in (0, 1]", value=value)
            )
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(Text("{value} must be from 0 to 1", value=value))


_positive_int = WholeNumber(1)
_non_negative_int = WholeNumber(0)
# rounds of a CPU job's blocks fetched ahead, at most 4 (16 workers' 4 rounds are 64 blocks, about
# one Qwen3-30B-A3B expert's gate and up rows); the hint holds 4 ranges a worker a round, 1024 in
# all (kernels/csrc/prefetch_hint.h): 4 rounds for up to 64 workers, and more workers are told of
# the rounds that fit
parse_prefetch_rounds = WholeNumber(0, 4)
_rate = Share(above_zero=True)
parse_share = Share()


def parse_origins(text: str) -> tuple[str, ...]:
    """Origins as a browser sends them, comma-separated (http://localhost:3000), or * for any."""
    origins = tuple(part.strip() for part in text.split(",") if part.strip())
    if not origins:
        raise argparse.ArgumentTypeError(
            Text("give at least one origin, e.g. http://localhost:3000")
        )
    for origin in origins:
        scheme, _, authority = origin.partition("://")
        if origin != "*" and (scheme not in ("http", "https") or not authority or "/" in authority):
            raise argparse.ArgumentTypeError(
                Text(
                    "{origin!r} is not an origin; write scheme://host[:port] as a browser sends it "
                    "(no path, no trailing slash), e.g. http://localhost:3000, or * for any origin",
                    origin=origin,
                )
            )
    return origins


def parse_host_names(text: str) -> tuple[str, ...]:
    """Host names or addresses, comma-separated (llm.lan,gpu-box.example)."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or any("/" in name or " " in name for name in names):
        raise argparse.ArgumentTypeError(
            Text(
                "{text!r} is not a list of host names; write names or addresses separated by "
                "commas, e.g. llm.lan,gpu-box.example",
                text=text,
            )
        )
    return names


def parse_miss_policy(text: str) -> str:
    """`auto`, `gpu`, `cpu` or `split:F` with F the fixed share of misses to fetch, in [0, 1]."""
    if text in ("auto", "gpu", "cpu"):
        return text
    match = re.fullmatch(r"split:([0-9]*\.?[0-9]+)", text)
    if match and 0.0 <= float(match.group(1)) <= 1.0:
        return f"split:{float(match.group(1)):g}"
    raise argparse.ArgumentTypeError(
        Text(
            "{text!r} is not a miss policy; use auto, gpu, cpu or split:F with F in [0, 1]",
            text=text,
        )
    )


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def parse_device(text: str) -> str:
    """auto, cpu, cuda or cuda:N."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(Text("not a device; use auto, cpu, cuda or cuda:N"))
    return text


def physical_cores() -> int:
    """Physical cores of this machine (logical ones when that cannot be told)."""
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def default_cpu_threads() -> int:
    """One thread per physical core, less one that keeps feeding the GPU."""
    return max(1, physical_cores() - 1)


def build_parser(prog: str = "moelab serve") -> argparse.ArgumentParser:
    """The one parser of `moelab serve` (`moelab generate` takes the same engine flags)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve an MoE checkpoint with its experts in host RAM and a GPU cache.",
        allow_abbrev=False,
    )
    add_engine_flags(parser)
    return parser


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag to `parser`, grouped the way the console shows them."""
    _model_flags(parser.add_argument_group("model"))
    _memory_flags(parser.add_argument_group("memory"))
    experts = parser.add_argument_group("experts")
    _expert_cache_flags(experts)
    _cpu_expert_flags(experts)
    experts.add_argument(
        "--bw-profile",
        default=None,
        help="Bandwidth profile written by `moelab bench bw`; default: the newest one for this "
        "machine in the user cache directory, else a short measurement at start.",
    )
    _prefill_flags(parser.add_argument_group("prefill"))
    _batching_flags(parser.add_argument_group("batching"))
    _server_flags(parser.add_argument_group("server"))


Group = argparse._ArgumentGroup


def _model_flags(model: Group) -> None:

    model.add_argument(
        "--model-path",
        required=True,
        help="Checkpoint directory in Hugging Face layout (config.json, *.safetensors, "
        "tokenizer.json).",
    )
    model.add_argument(
        "--served-model-name",
        default=None,
        help="Name clients use in the `model` field; default: the checkpoint directory's name.",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="Compute and weight dtype; auto keeps the checkpoint's on a GPU and uses float32 "
        "on a CPU device.",
    )
    model.add_argument(
        "--moe-expert-dtype",
        default="auto",
        choices=EXPERT_DTYPES,
        help="How the routed experts are held in host memory and in the GPU's expert slots: "
        "fp8 (e4m3 values with one fp32 factor per 128x128 block, half the bytes of bf16: "
        "a bf16 checkpoint's experts are quantized once, into the prepacked bank), mxfp4 (e2m1 "
        "values with one power-of-two scale per 32, 4.25 bits a weight: a bf16 or FP8 "
        "checkpoint's experts are quantized once, into the prepacked bank; hidden_size and "
        "moe_intermediate_size must be multiples of 32), nvfp4 (e2m1 values with one e4m3 scale "
        "per 16 and an fp32 scale per projection, 4.5 bits a weight, as NVIDIA's ModelOpt "
        "releases store them; others' experts are quantized once; multiples of 16), bf16 (the "
        "compute dtype: an FP8, MXFP4 or NVFP4 checkpoint's experts are widened), auto (the "
        "checkpoint's own format).",
    )
    model.add_argument(
        "--dense-dtype",
        default="auto",
        choices=DENSE_DTYPES,
        help="How the dense projections are held on the device: fp8 (e4m3 values with one fp32 "
        "factor per 128x128 block, about half the bytes of bf16, for the attention's q, k, v and "
        "o, a Gated DeltaNet layer's out projection, shared experts and dense MLPs: an FP8 "
        "checkpoint's keep their values, others' are quantized at load; decode reads them in "
        "an FP8 kernel, prefill widens each for its call), auto (the compute dtype: an FP8 "
        "checkpoint's are widened at load).",
    )
    model.add_argument(
        "--dummy-weights",
        action="store_true",
        help="Ignore the checkpoint's tensors and build deterministic weights of its geometry in "
        "memory (for benchmarks of a geometry you have no weights for).",
    )
    model.add_argument(
        "--bank-dir",
        default=None,
        help="Where the prepacked expert bank is written and memory-mapped from; default: the "
        "user cache directory.",
    )


def _memory_flags(memory: Group) -> None:
    where = memory.add_mutually_exclusive_group()
    where.add_argument(
        "--device",
        type=parse_device,
        default="auto",
        help="Compute device: auto (CUDA when present), cpu, cuda or cuda:N.",
    )
    where.add_argument(
        "--devices",
        type=parse_devices,
        default=None,
        help="Split the layers across these devices, comma-separated (cuda:0,cuda:1; cpu,cpu "
        "emulates a split on the CPU): each holds a contiguous range of layers with their dense "
        "weights, KV pages and an expert cache of their experts, filled over its own link, and "
        "the activations cross once per boundary. The first device holds the embedding, the "
        "last the final norm and LM head. Takes the place of --device.",
    )
    memory.add_argument(
        "--layer-split",
        type=LayerSplit.parse,
        default=None,
        help="With --devices: each device's layers, as counts that add up to the model's "
        "layers (20,20) or as shares that add up to 1 (0.6,0.4). Default: from each device's "
        "free memory, measured link rate and memory rate, so that every device finishes its "
        'share of a step at the same time (docs/architecture.md, "Layers across devices").',
    )
    memory.add_argument(
        "--split-microbatches",
        type=_positive_int,
        default=None,
        help="With --devices: cut each decode step's batch into this many micro-batches, "
        "launched so that one device runs a micro-batch while the next device runs the one "
        f"before it. Default: 2 from {PIPELINE_MIN_ROWS} rows a step, else 1 (unmeasured on two "
        "GPUs); a step of fewer rows runs in as many micro-batches as it has rows, an offloaded "
        "step replayed from CUDA graphs in one.",
    )
    memory.add_argument(
        "--device-memory",
        type=parse_device_memory,
        default=None,
        help="Memory budget of the compute device (e.g. 24GiB). With --devices: one size for "
        "each device, or one per device, comma-separated in the order of --devices "
        "(12GiB,8GiB). Default: the free memory of the GPU; required to plan memory on a "
        f"CPU-only machine, where it defaults to {CPU_DEFAULT_BUDGET_BYTES // 1024**3}GiB.",
    )
    memory.add_argument(
        "--kv-reserve-tokens",
        type=_positive_int,
        default=8192,
        help="KV cache tokens reserved before the expert cache takes what is left. The context "
        "the engine advertises is what its KV can hold.",
    )
    memory.add_argument(
        "--max-context",
        type=_positive_int,
        default=None,
        help="Cap on the context (prompt + generation) of one request; default: the model's own.",
    )
    memory.add_argument(
        "--memory-headroom",
        type=parse_bytes,
        default=parse_bytes("512MiB"),
        help="Device memory left unplanned for allocator slack and other programs.",
    )
    memory.add_argument(
        "--kv-block-size",
        type=_positive_int,
        default=16,
        help="Tokens per page of the paged KV cache.",
    )
    memory.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="How the KV cache holds keys and values: auto in the compute dtype, bf16, or fp8 "
        "(e4m3 with one factor per token and KV head): about twice the tokens of bf16 in the "
        "same memory, for a small loss of precision (docs/kernels.md).",
    )
    memory.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="Compute every prompt whole. By default a prompt that begins with whole KV pages "
        "an earlier request computed (a chat's history, a shared system prompt) reuses them "
        "and is prefilled from there; pages no request holds stay cached until new ones need "
        "the room.",
    )
    memory.add_argument(
        "--state-checkpoints",
        type=_non_negative_int,
        default=8,
        help="Hybrid models (Gated DeltaNet layers) and gpt-oss (sliding-window layers): "
        "checkpoints kept on the device for the prefix cache, each one sequence's recurrent "
        "states or windows' tokens (61.4 MiB at Qwen3.6-35B-A3B, 4.5 MiB at gpt-oss-120b), "
        "the least recently used dropped first. A prompt resumes from the longest checkpoint "
        "its cached pages reach: the end of a chat's system prompt or of its last message in "
        "an earlier request, or one every --state-checkpoint-interval tokens. 0: none, and no "
        "prefix cache for these models.",
    )
    memory.add_argument(
        "--state-checkpoint-interval",
        type=_non_negative_int,
        default=8192,
        help="Hybrid models: a long prompt's state is also kept every this many tokens "
        "(0: only at message ends).",
    )


def _expert_cache_flags(moe: Group) -> None:
    size = moe.add_mutually_exclusive_group()
    size.add_argument(
        "--moe-cache-size",
        type=_non_negative_int,
        default=None,
        help="Expert slots on the GPU, shared by all MoE layers (with --devices, each device's "
        "slots for its own layers' experts). Default: whatever fits after the KV reserve.",
    )
    size.add_argument(
        "--moe-cache-rate",
        type=_rate,
        default=None,
        help="Expert slots as a share of all experts, in (0, 1]; exclusive with --moe-cache-size.",
    )
    moe.add_argument(
        "--moe-miss-policy",
        type=parse_miss_policy,
        default="auto",
        help="Where a decode step's cache misses run: auto (split by measured bandwidths), gpu "
        "(fetch all), cpu (run all on the CPU), split:F (fetch a fixed share F).",
    )
    moe.add_argument(
        "--moe-cache-admission",
        choices=CACHE_ADMISSIONS,
        default="frequency",
        help="Where an offloaded decode step's fill goes in the expert cache's recency order "
        "(the least recently used slot is evicted either way): frequency (the most recently "
        "used end, unless the expert it evicts was picked more often: then at the least "
        "recently used end, so that the next fill takes its slot first) or recent (always the "
        "most recently used end: LRU). frequency keeps the most used experts where a step "
        "fills more experts than the cache holds a layer (batches on a small cache: "
        "docs/cpu-experts.md).",
    )
    split = moe.add_mutually_exclusive_group()
    split.add_argument(
        "--no-split-misses",
        action="store_true",
        help="Do not split a miss of an offloaded decode layer step (CUDA graphs of pieces). By "
        "default one miss per layer step may be split: its first rows (and the same columns of "
        "its down projection) copied to the GPU, the rest run on the CPU, so that the copies and "
        "the CPU end together (docs/cpu-experts.md).",
    )
    split.add_argument(
        "--split-misses",
        action="store_true",
        help="Split misses, as by default; kept so that launch profiles saved with it still start.",
    )


def _cpu_expert_flags(moe: Group) -> None:
    moe.add_argument(
        "--moe-cpu-threads",
        type=_positive_int,
        default=None,
        help="CPU expert worker threads; default: physical cores minus one.",
    )
    moe.add_argument(
        "--moe-cpu-kernel",
        default="auto",
        choices=CPU_KERNELS,
        help="CPU expert kernel: native (compiled, reads weights at memory speed), torch "
        "(the reference), auto (native when it builds).",
    )
    moe.add_argument(
        "--moe-cpu-spin-us",
        type=_non_negative_int,
        default=300,
        help="How long idle CPU expert workers spin for the next job before sleeping, in "
        "microseconds: spinning saves the wake-up of every worker at each MoE layer (longer than "
        "the gap between two layers' CPU jobs), but slows the thread that feeds the GPU where "
        "they share its cores; 0 sleeps at once.",
    )
    moe.add_argument(
        "--moe-cpu-redo-us",
        type=_non_negative_int,
        default=150,  # kernels/cpu_experts.DEFAULT_REDO_US (this module imports no torch)
        help="How long a task of a CPU expert job in decode may be in flight before an idle "
        "worker runs it again, in microseconds: a task takes 15-25 us, but a worker whose core "
        "the OS gives to another thread holds the job's end up until it gets a core back "
        "(milliseconds); the first of the two runs to finish writes the result. 0: never.",
    )
    moe.add_argument(
        "--moe-cpu-task-kb",
        type=_positive_int,
        default=96,  # kernels/cpu_experts.DEFAULT_TASK_KB (this module imports no torch)
        help="The weight KiB each task of a CPU expert job aims at (the workers claim tasks one "
        "at a time): smaller tasks balance the threads at a job's end, larger ones stream longer "
        "runs of memory.",
    )
    moe.add_argument(
        "--moe-cpu-prefetch-rounds",
        type=parse_prefetch_rounds,
        default=4,
        help="Offloaded decode at batch 1 (CUDA graphs, the native CPU kernel): each piece sends "
        "a guess of its MoE layer's routing to the host ahead of the routing, and the idle CPU "
        "expert workers fetch the weights of this many rounds of their first gate/up blocks of "
        "the guessed job into their own caches; where the real job is the guessed one, those "
        'blocks are theirs. 0 (off) to 4 (docs/cpu-experts.md, "Guessed steps"); the autotuner '
        "tries fewer per machine.",
    )
    moe.add_argument(
        "--moe-copy-ahead",
        type=parse_share,
        default=0.75,
        help="Offloaded decode at batch 1 (CUDA graphs, the native planner, split misses): once "
        "a piece's guess of its MoE layer's routing reaches the host, the device's first miss "
        "of the guessed step starts copying into a cache slot: the gate and up projections of "
        "as many of its first rows as the copies move in this share of the guesses' usual lead "
        "over the routing (measured as decode runs). Where the guess was right, the step's "
        "copies then take only the rest, and the CPU fewer rows; a wrong guess costs that copy "
        "and the slot's expert. 0: off.",
    )
    moe.add_argument(
        "--moe-early-cached",
        choices=EARLY_CACHED,
        default="off",
        help="Offloaded decode at batch 1 and more (CUDA graphs, the native planner, one GPU): "
        "on runs each MoE layer's cached experts as soon as the layer's routing is made, their "
        "slots looked up on the GPU in a copy of the cache's slot map, while the host plans "
        "the misses; off runs them once the host has planned the layer step. Off by default: on "
        "a GPU it measured no faster than the runs' spread; the benchmark tries on "
        "(docs/cpu-experts.md).",
    )
    moe.add_argument(
        "--moe-cpu-pin",
        choices=CPU_PINS,
        default="cores",
        help="Where the CPU expert workers run: 'cores' keeps each on a physical core of its own "
        "and off the first core, which is left to the thread that feeds the GPU (where the "
        "machine has a core more than workers); 'isolate' also keeps every other thread of the "
        "engine (the one feeding the GPU among them) on the cores the workers leave; 'off' lets "
        "the OS place and move them.",
    )


def _prefill_flags(prefill: Group) -> None:
    prefill.add_argument(
        "--prefill-chunk-tokens",
        type=_positive_int,
        default=2048,
        help="Longest prompt piece run in one step; longer prompts are chunked and interleaved "
        "with decode.",
    )
    prefill.add_argument(
        "--no-prefill-overlap",
        action="store_true",
        help="Do not stream the next layer's experts while this layer computes (for comparison).",
    )


def _batching_flags(batching: Group) -> None:
    batching.add_argument(
        "--max-running-requests",
        type=_positive_int,
        default=8,
        help="Requests decoded together; more wait in the queue.",
    )
    batching.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        default=64,
        help="Requests waiting beyond the running ones before new ones get 429.",
    )
    batching.add_argument(
        "--cuda-graph-max-bs",
        type=_positive_int,
        default=8,
        help="Largest decode batch captured as a CUDA graph.",
    )
    batching.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="Run every step eagerly (no CUDA graphs).",
    )
    batching.add_argument(
        "--no-overlap-decode",
        action="store_true",
        help="Wait for each decode step's tokens before preparing the next. By default, decode "
        "with CUDA graphs queues step N+1 while the GPU runs step N (with offloaded experts: "
        "while it runs step N's last CPU job and logits), the tokens greedy or drawn on the "
        "GPU; requests with penalties, a logit bias or log probabilities wait for the host's "
        "sampler.",
    )


def _server_flags(server: Group) -> None:
    server.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    server.add_argument("--port", type=_positive_int, default=8000, help="Port to listen on.")
    server.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer KEY` on every API request (and allow control "
        "endpoints from other machines).",
    )
    server.add_argument(
        "--allowed-origins",
        type=parse_origins,
        default=None,
        help="Web origins whose pages may call the inference endpoints from a browser "
        "(cross-origin, with CORS), comma-separated: http://localhost:3000,https://chat.example, "
        "or * for any. Default: none; a page of another origin gets 403. Cache resizing never "
        "takes a request from another site's page.",
    )
    server.add_argument(
        "--allow-host",
        type=parse_host_names,
        default=None,
        help="More names the engine answers to in the Host header (DNS aliases, a proxy that "
        "keeps the client's Host), comma-separated. Always served: loopback, the address it "
        "listens on (with 0.0.0.0: every address and the host names) and the address a "
        "request arrived on; any other Host gets 400 (DNS rebinding).",
    )
    server.add_argument(
        "--no-stats",
        action="store_true",
        help="Turn off expert telemetry (per-layer counters, what-if curve, time breakdown).",
    )
    server.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIGS,
        default="auto",
        help="auto: a request that leaves out temperature, top_p, top_k, min_p or "
        "repetition_penalty takes the checkpoint's generation_config.json value, where it has "
        "one (as vLLM does); off: OpenAI's defaults (temperature 1, the rest off).",
    )
    server.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="off",
        help="think: a chat reply's reasoning, what a thinking model (Qwen3, QwQ, DeepSeek-R1) "
        "writes between <think> and </think>, goes into the message's reasoning_content and "
        "the rest into its content (streamed alike), as vLLM's reasoning parsers do; harmony: "
        "the reply is read in gpt-oss's format (its analysis channel as reasoning_content, its "
        "final channel as content, its calls as tool_calls), which a chat template that writes "
        "harmony gets whatever this says; off: the reply stays one text, tags and all.",
    )
    server.add_argument(
        "--reasoning-budget",
        type=_non_negative_int,
        default=None,
        help="End a chat reply's <think> block after this many of its tokens by writing the "
        "closing tag, so that the model goes on with its answer (0: no reasoning); a request's "
        "reasoning_budget (Anthropic's thinking.budget_tokens) takes the place of this one. "
        "Default: no limit.",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="How a chat reply's tool calls are read: hermes (JSON in <tool_call> blocks: "
        "Qwen2.5, Qwen3), qwen_xml (<function=...> and <parameter=...> blocks: Qwen3-Coder, "
        "Qwen3.5), harmony (gpt-oss's commentary channel to=functions.NAME), or auto (the form "
        "the chat template writes; none where it writes none of them).",
    )
    server.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed for sampling when a request gives none, and for --dummy-weights.",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="How much the engine logs.",
    )


@dataclass(frozen=True, slots=True)
class Tunable:
    """A flag the benchmark may change, and how to pick its candidate values."""

    flag: str
    # "choice": values as listed; "switch": on/off; "threads", "slots", "tokens", "devices": derived
    kind: str
    values: tuple[str, ...] = ()
    why: Text | str = ""  # in words: what the flag trades against what

    def __post_init__(self) -> None:
        assert self.kind in ("choice", "switch", "threads", "slots", "tokens", "devices"), self.kind


TUNABLE: tuple[Tunable, ...] = (
    Tunable(
        "--moe-expert-dtype",
        "choice",
        ("bf16", "fp8", "mxfp4"),
        Text(
            "FP8 or MXFP4 experts: a half or about a quarter of the bytes of every miss and as "
            "many more slots, against rounding"
        ),
    ),
    Tunable(
        "--moe-miss-policy",
        "choice",
        ("auto", "gpu", "cpu", "split:0.25", "split:0.75"),
        Text("where cache misses run decides decode speed"),
    ),
    Tunable("--moe-cpu-threads", "threads", why=Text("CPU expert speed against memory bandwidth")),
    Tunable("--moe-cache-rate", "slots", why=Text("expert slots against KV and prefill space")),
    Tunable(
        "--prefill-chunk-tokens",
        "choice",
        ("512", "1024", "2048", "4096", "8192"),
        Text("prefill speed against activation memory"),
    ),
    Tunable("--no-prefill-overlap", "switch", why=Text("streaming the next layer during prefill")),
    Tunable(
        "--no-split-misses", "switch", why=Text("copies and CPU end together where misses are few")
    ),
    Tunable("--no-cuda-graph", "switch", why=Text("graph replay cuts launch overhead")),
    Tunable(
        "--no-overlap-decode", "switch", why=Text("host work between steps hides behind the GPU")
    ),
    Tunable(
        "--max-running-requests",
        "choice",
        ("1", "2", "4", "8", "16"),
        Text("batching against expert-cache thrash"),
    ),
    Tunable(
        "--moe-cpu-kernel", "choice", ("native", "torch"), Text("which CPU expert kernel is faster")
    ),
    Tunable(
        "--moe-cpu-spin-us",
        "choice",
        ("0", "300", "1000", "5000"),
        Text("idle CPU workers spinning against the thread that feeds the GPU"),
    ),
    Tunable(
        "--moe-cpu-redo-us",
        "choice",
        ("0", "150", "1000"),
        Text("idle CPU workers running again the task of one the OS stopped, against double reads"),
    ),
    Tunable(
        "--moe-cpu-task-kb",
        "choice",
        ("48", "96", "192", "384"),
        Text("CPU expert tasks: balance at a job's end against longer streams"),
    ),
    Tunable(
        "--moe-cpu-prefetch-rounds",
        "choice",
        ("0", "2", "4"),
        Text("CPU workers fetching their first blocks while they wait, against the guess's launch"),
    ),
    Tunable(
        "--moe-cache-admission",
        "choice",
        ("recent", "frequency"),
        Text("a rarer expert's fill kept from evicting a more used one next, against recency"),
    ),
    Tunable(
        "--moe-early-cached",
        "choice",
        EARLY_CACHED,
        Text("the cached experts run before the host's plan, against a slot map copied a layer"),
    ),
    Tunable(
        "--moe-copy-ahead",
        "choice",
        ("0", "0.75"),
        Text("a guessed miss's first rows copied before the routing, against a wrong guess's copy"),
    ),
    Tunable(
        "--devices",
        "devices",
        why=Text(
            "the layers across every GPU: their memory and links together, against the "
            "activations' crossing between the cards"
        ),
    ),
    Tunable(
        "--kv-cache-dtype",
        "choice",
        ("auto", "fp8"),
        Text("KV pages in FP8: twice the context or more expert slots, against precision"),
    ),
    Tunable(
        "--dense-dtype",
        "choice",
        ("auto", "fp8"),
        Text(
            "the dense projections in FP8: fewer bytes a decode step and more expert slots, "
            "against precision"
        ),
    ),
    Tunable(
        "--moe-cpu-pin",
        "choice",
        ("cores", "isolate", "off"),
        Text(
            "CPU expert workers on cores of their own (and the rest of the engine off them) "
            "against the OS's placement"
        ),
    ),
)


def describe_flags(parser: argparse.ArgumentParser | None = None) -> list[dict]:
    """Every flag with its group, help, type, choices and default, for editors and validators."""
    parser = parser or build_parser()
    tunable = {t.flag for t in TUNABLE}
    exclusive = {}
    for group in parser._mutually_exclusive_groups:
        names = [a.option_strings[-1] for a in group._group_actions]
        for name in names:
            exclusive[name] = [n for n in names if n != name]
    formatter = parser._get_formatter()  # the help as --help prints it (`%%` as `%`)
    out = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[-1]
            if isinstance(action, argparse._StoreTrueAction):
                kind = "switch"
            elif action.type is int or isinstance(action.type, WholeNumber):
                kind = "int"
            elif action.type is float or isinstance(action.type, Share):
                kind = "float"
            elif action.type in (parse_bytes, parse_device_memory):
                kind = "bytes"
            else:
                kind = "str"
            out.append(
                {
                    "flag": flag,
                    "dest": action.dest,
                    "group": group.title,
                    "help": formatter._expand_help(action) if action.help else "",
                    "kind": kind,
                    "choices": list(action.choices) if action.choices else None,
                    "default": action.default,
                    "required": bool(action.required),
                    "tunable": flag in tunable,
                    "exclusive_with": exclusive.get(flag, []),
                }
            )
    return out


def flags_markdown() -> str:
    """docs/flags.md: every flag by group, generated from the parser (a test keeps them in sync)."""
    lines = [
        "# `moelab serve` flags",
        "",
        "Generated from `engine/config/args.py` by `python -m moelab.engine.config.args > "
        "docs/flags.md`; `moelab generate` and `moelab bench decode|prefill` take the same flags. "
        "Flags marked *tunable* are the ones the benchmark may change. The engine reads them as "
        "`EngineConfig` (`engine/config/config.py`): one typed group of settings per group below.",
    ]
    group = None
    for flag in describe_flags():
        if flag["group"] != group:
            group = flag["group"]
            lines += [
                "",
                f"## {group}",
                "",
                "| flag | value | default | what it does |",
                "|---|---|---|---|",
            ]
        value = (
            "on/off"
            if flag["kind"] == "switch"
            else (" \\| ".join(flag["choices"]) if flag["choices"] else flag["kind"])
        )
        default = flag["default"]
        blank = default is None or default is False  # not `in (None, False)`: 0 == False
        default = "required" if flag["required"] else ("" if blank else default)
        note = flag["help"].replace("|", "\\|")
        if flag["tunable"]:
            note += " *(tunable)*"
        if flag["exclusive_with"]:
            note += f" Exclusive with {', '.join(flag['exclusive_with'])}."
        lines.append(f"| `{flag['flag']}` | {value} | {default} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
