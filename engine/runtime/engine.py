"""Engine: loads a checkpoint per the VRAM plan and runs forward steps for scheduled sequences."""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ...kernels import common, no_triton
from ...kernels.native_build import NativeKernelError, load_native
from ..config.args import default_cpu_threads, physical_cores
from ..config.bandwidth import best, device_best, load_profile
from ..config.config import EngineConfig
from ..config.memory import VramPlan, log_plan
from ..config.split import DeviceBudget, LayerSplit, SplitPlan, plan_graphed_devices
from ..experts.bank import ExpertBank, build_in_memory, load_bank
from ..experts.cache import ExpertCache
from ..experts.cpu import (
    ProcessPlacement,
    cpu_ranges,
    measure_bh_gbps,
    measure_bp_gbps,
    measure_device_gbps,
    start_cpu_executor,
)
from ..experts.misses import MissPolicy
from ..experts.moe import MoERunner
from ..experts.moe_stats import LayerCounters
from ..experts.prefill_stream import stream_threshold_tokens
from ..experts.split_experts import SplitCache, SplitExperts, counter_rows
from ..model.checkpoint import SafetensorsSource, TensorSource, load_dense
from ..model.kv import KVCache
from ..model.model import DenseWeights, Model, SeqSlice, StepBatch, flash_chunk_attention
from ..model.placement import LayerPlacement
from ..model.rope import Rotary
from ..model.spec import ModelSpec
from ..model.split_states import SplitStatePool, SplitWindowPool
from ..model.states import StatePool
from ..model.synth import SynthSource, calibration_dir, calibration_threads
from ..model.tokenizer import Tokenizer
from ..model.window import WindowPool
from .graphs import DecodeGraphs
from .loading import LoadProgress
from .microbatch import Pipelining
from .sampling import Sampler, SamplingParams
from .scheduler import ContextTooLong, Scheduler, Sequence
from .split_graphs import SplitDecodeGraphs
from .stepping import Stepper
from .telemetry import Telemetry

log = logging.getLogger("moelab.engine")


def resolve_device(name: str) -> torch.device:
    """The compute device --device names (auto: CUDA where there is one); ValueError where this
    machine cannot compute on it."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this machine has no CUDA device; use --device cpu")
    if device.type == "cuda" and not common.HAVE_TRITON:
        raise ValueError(f"--device {name} (CUDA): {no_triton.MISSING}")
    return device


def settle_heap() -> float:
    """Collects the loading's garbage, then moves every object left (modules, the model, the
    graphs) out of the cycle collector's reach (gc.freeze), so that no full collection walks them
    between two decode steps: one such walk is a stall of 100 ms or more. Returns the ms the full
    collection took. A serving process calls it once its engine is ready, and gc.unfreeze() once
    that engine is closed, so that its cycles can be collected; so does the interpreter's exit
    (frozen, the compiler's bindings report their objects as leaked there)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once however often the heap is settled
    atexit.register(gc.unfreeze)
    return 1e3 * (time.perf_counter() - t0)


class Engine:
    """One loaded model: its weights, caches, scheduler and sampler, and the step loop that runs
    them (`stepper`)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        spec: ModelSpec | None = None,
        progress: LoadProgress | None = None,
    ) -> None:
        t0 = time.perf_counter()
        progress = progress or LoadProgress()
        self.config = config
        self.startup_s = progress.startup_s  # seconds per start-up phase, in order
        progress.begin("plan")
        self._resolve(spec)
        progress.begin("dense weights")
        source, dense = self._load_dense()
        progress.begin("expert bank")
        self.bank = self._load_bank(source, progress)
        if len(self.devices) > 1:
            progress.begin("split")
            self._plan_split()
        progress.begin("CPU kernel")
        self._build_cpu_kernel(progress)
        progress.begin("CPU workers")
        self._start_cpu_workers()
        progress.begin("bandwidths")
        self.bp_gbps, self.bh_gbps, self.rates_source = self._bandwidths()
        if self.synth_source is not None:
            progress.begin("routing calibration")
            self._calibrate_routing(self.synth_source, dense)
        progress.begin("caches")
        self._build_caches(dense)
        progress.begin("CUDA graphs")
        self.telemetry = Telemetry(
            self.spec, self, self.moe, self.cache, self.bank, self.scheduler,
            enabled=config.server.stats, states=self.states, devices=self.device_reports,
        )  # fmt: skip
        self.stepper = self._build_stepper()
        self._capture_graphs()
        progress.begin(None)
        self.load_s = time.perf_counter() - t0
        log.info(
            "engine ready in %.2f s (%s)",
            self.load_s,
            ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.startup_s.items()),
        )

    # setup --------------------------------------------------------------------------------------

    def _resolve(self, spec: ModelSpec | None) -> None:
        """The checkpoint's geometry and tokenizer, the device and dtype, and the memory plan."""
        path = Path(self.config.model.path)
        self.spec = spec = spec or ModelSpec.from_dir(path)
        # one device, or the devices a split's layers run on (the first holds the embedding,
        # runs the sampler and hands out the KV pages)
        self.devices = [resolve_device(name) for name in self.config.memory.device_names]
        self.device = self.devices[0]
        self.split: SplitPlan | None = None
        self.layers_on: LayerPlacement | None = None
        cuda = self.device.type == "cuda"
        self.dtype = getattr(torch, self.config.model.compute_dtype(spec.dtype, cpu=not cuda))
        # whether a later prefill chunk's attention runs in flash attention here: the memory
        # plan counts that path's transient (engine/config/memory.py chunk_attention_bytes)
        self.flash_chunks = flash_chunk_attention(spec, self.device, self.dtype)
        # how the bank and the expert slots hold the routed experts: "fp8", "mxfp4", "nvfp4" or
        # "bf16" (self.dtype)
        self.expert_format = spec.expert_format(self.config.model.expert_dtype)
        if spec.quantization == "mixed" and self.config.model.expert_dtype == "auto":
            why = spec.mixed_experts_kept[1]
            log.info(
                "ModelOpt %s checkpoint: %s (--moe-expert-dtype auto)", spec.modelopt_scheme, why
            )
        if spec.kv_cache_quant_algo:
            log.info(
                "ModelOpt kv_cache_quant_algo %s: the checkpoint's KV scales are not read "
                "(--kv-cache-dtype fp8 computes its own factor per token and KV head; auto keeps "
                "the compute dtype)",
                spec.kv_cache_quant_algo,
            )
        self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
        if len(self.devices) > 1:
            return  # planned once the bank is in memory: the split reads each device's link
        free_bytes = torch.cuda.mem_get_info(self.device)[0] if cuda else None
        request = self.config.memory_request(
            budget_bytes=self.config.memory.budget_bytes(free_bytes),
            elem_bytes=self.dtype.itemsize,
            cuda=cuda,
            flash=self.flash_chunks,
        )
        self.plan = request.plan(spec)
        log_plan(self.plan)

    def _load_dense(self) -> tuple[TensorSource, DenseWeights]:
        """Where the weights come from (the checkpoint, or its geometry's synthetic weights with
        --dummy-weights) and the dense weights, on the device."""
        spec, model = self.spec, self.config.model
        synth_info = spec.extra.get("moelab_synth") or {}
        self.synth_source: SynthSource | None = None
        source: TensorSource
        if model.dummy_weights:
            # its routers are calibrated once its bank is built (`_calibrate_routing`)
            source = self.synth_source = SynthSource(
                spec,
                seed=int(synth_info.get("seed", self.config.server.seed)),
                skew=float(synth_info.get("routing_skew", 0.0)),
                expert_format=self.expert_format,
            )
        else:
            source = SafetensorsSource(Path(model.path), spec)
        # a split's dense weights go to their devices once the split is planned
        host = len(self.devices) > 1
        device = HOST if host else self.device
        return source, load_dense(spec, source, device, self.dtype, model.dense_dtype)

    def _plan_split(self) -> None:
        """The layers' split across the devices and each device's memory plan, from each one's
        budget and its link's rate, measured now from the bank's memory."""
        memory = self.config.memory
        budgets = []
        for index, (name, device) in enumerate(zip(memory.device_names, self.devices, strict=True)):
            cuda = device.type == "cuda"
            free = torch.cuda.mem_get_info(device)[0] if cuda else None
            link = measure_bp_gbps(self.bank, device)
            rate = measure_device_gbps(device) if cuda else None
            # each card plans the prefill attention's transient of the path it runs
            flash = flash_chunk_attention(self.spec, device, self.dtype)
            attention = ("flash" if flash else "masked") if cuda else "none"
            budgets.append(
                DeviceBudget(name, memory.budget_bytes(free, index), link, rate, attention)
            )
        # each device holds its own graphs' pool where the memory plan allows
        request = self.config.memory_request(
            budget_bytes=0,
            elem_bytes=self.dtype.itemsize,
            cuda=self.device.type == "cuda",
            flash=self.flash_chunks,
        )
        split = plan_graphed_devices(self.spec, request, tuple(budgets), memory.layer_split)
        self.split = split
        self.split_budgets = tuple(budgets)  # what a resize plans with again
        self.link_gbps = [b.link_gbps for b in budgets]
        self.memory_gbps = [b.memory_gbps for b in budgets]
        self.layers_on = LayerPlacement(tuple(self.devices), split.ranges)
        self.plan = split.total
        for budget, span, plan in zip(budgets, split.ranges, split.plans, strict=True):
            memory_rate = f", memory {budget.memory_gbps:.0f} GB/s" if budget.memory_gbps else ""
            log.info(
                "%s: layers %d-%d, link %.1f GB/s%s; %s",
                budget.name, span.start, span.stop - 1, budget.link_gbps, memory_rate,
                plan.describe(),
            )  # fmt: skip
        log.info("%s", split.limit.limit_text())

    def _load_bank(self, source: TensorSource, progress: LoadProgress) -> ExpertBank:
        """The expert bank in host memory: built in memory for synthetic weights, else the
        prepacked file (written first where there is none)."""
        pin = self.device.type == "cuda"
        if not isinstance(source, SafetensorsSource):  # --dummy-weights
            return build_in_memory(
                self.spec, source, self.dtype, pin=pin, progress=progress.bytes,
                fmt=self.expert_format,
            )  # fmt: skip
        named = self.config.model.bank_dir
        return load_bank(
            self.spec,
            source,
            self.dtype,
            bank_dir=Path(named) if named else None,
            pin=pin,
            progress=progress.bytes,
            fmt=self.expert_format,
        )

    def _calibrate_routing(self, source: SynthSource, dense: DenseWeights) -> None:
        """Calibrate the synthetic routers in `dense` (`SynthSource.calibrate`) over the bank's
        experts where it holds them in the compute dtype, or in FP8 or MXFP4 on CUDA (their
        kernels read them; elsewhere the source's are widened, as `moelab synth` calibrates
        them: a widened copy of the 48 layers of Qwen3-30B-A3B is 54 GiB of host memory). Done
        once the bank is in host memory, so that no second copy of the experts is made and freed
        before the bank's pages are taken, and before the expert cache takes the device memory
        the passes need. A calibration is saved under its key (`calibration_dir`), and the next
        start with the same key takes it back instead of calibrating again."""
        bank = self.bank
        # a split's dense weights are still in host memory (placed with the caches)
        device = HOST if self.layers_on is not None else self.device
        key = source.calibration_key(device, self.dtype, bank.fmt)
        path = calibration_dir() / f"{key}.json"
        if source.restore_calibration(path, key, dense):
            log.info("routing calibration read from %s", path)
            return
        experts = None
        if bank.fmt == "bf16" or (bank.fmt in ("fp8", "mxfp4") and device.type == "cuda"):
            experts = [tuple(bank.layer_tensors(m)) for m in range(bank.num_layers)]
        with calibration_threads(device, default_cpu_threads()):
            source.calibrate(device, self.dtype, dense=dense, experts=experts)
        try:
            source.save_calibration(path, key)
        except OSError as e:  # the next start calibrates again
            log.warning("routing calibration not saved to %s: %s", path, e)

    def _build_cpu_kernel(self, progress: LoadProgress) -> None:
        """Build (or wait for) the native CPU expert kernel here, so that /health tells that
        phase apart; with `auto`, a kernel that does not build leaves the torch one."""
        kernel = self.config.experts.cpu_kernel
        if kernel == "torch":
            return
        try:
            load_native(progress.build)
        except NativeKernelError:
            if kernel == "native":
                raise
            # auto: the CPU workers fall back on the torch kernel and say why

    def _start_cpu_workers(self) -> None:
        """The expert cache on the device, and the CPU expert workers placed per --moe-cpu-pin."""
        spec, experts = self.spec, self.config.experts
        if self.layers_on is None:
            self.cache = self._new_cache(spec.num_moe_layers, self.plan.slots, self.device)
        else:
            assert self.split is not None
            moe_ranges = self.layers_on.moe_ranges(spec.moe_layers)
            # (a device whose layers are all dense has no cache)
            self.cache = SplitCache([
                self._new_cache(len(span), plan.slots, device) if span else None
                for span, plan, device in zip(moe_ranges, self.split.plans, self.devices,
                                              strict=True)
            ])  # fmt: skip
        self.cpu = start_cpu_executor(
            experts.cpu_threads,
            experts.cpu_kernel,
            experts.cpu_spin_us,
            experts.cpu_task_kb,
            pin=experts.cpu_pin != "off",
            redo_us=experts.cpu_redo_us,
        )
        self.placement = ProcessPlacement.around(self.cpu) if experts.cpu_pin == "isolate" else None
        self.cpu_pin = experts.cpu_pin  # as set_cpu_pin may change it
        # torch's own CPU threads spin after every op and would steal the cores the CPU expert
        # workers stream weights on: with a GPU the host's torch ops are tiny, so one thread
        cuda = self.device.type == "cuda"
        torch.set_num_threads(1 if cuda else max(1, physical_cores() - self.cpu.num_threads))

    def _new_cache(self, moe_layers: int, slots: int, device: torch.device) -> ExpertCache:
        spec = self.spec
        return ExpertCache(
            moe_layers,
            spec.num_experts,
            slots,
            spec.hidden_size,
            spec.moe_intermediate_size,
            self.dtype,
            device,
            self.expert_format,
            bias=spec.expert_bias,
            swiglu_limit=spec.swiglu_limit,
            admission=self.config.experts.cache_admission,
        )

    def _new_runner(
        self,
        bank: ExpertBank,
        cache: ExpertCache,
        bp_gbps: float,
        counters: LayerCounters | None = None,
    ) -> MoERunner:
        """The MoE runner over `bank`, `cache` (on a device whose link copies at `bp_gbps`) and
        the CPU workers; counting into `counters` where given (a split's)."""
        config = self.config
        policy = MissPolicy.parse(config.experts.miss_policy, bp_gbps, self.bh_gbps)
        log.info(
            "miss split on %s: Bp %.1f GB/s, Bh %.1f GB/s -> policy %s fetches %.0f%% of misses",
            cache.device,
            bp_gbps,
            self.bh_gbps,
            policy.mode,
            100 * policy.fetch_fraction,
        )
        return MoERunner(
            bank,
            cache,
            policy,
            self.cpu,
            top_k=self.spec.top_k,
            prefill_overlap=config.prefill.overlap,
            prefill_stream_min_tokens=self._stream_threshold(),
            split_misses=config.experts.split_misses,
            prefetch_rounds=config.experts.prefetch_rounds,
            copy_ahead=config.experts.copy_ahead,
            copy_rate=bp_gbps * 1e9,
            counters=counters,
            # one device's pieces only: a split's runners (counters given) launch their own
            early_cached=config.experts.early_cached == "on" and counters is None,
        )

    def _build_caches(self, dense: DenseWeights) -> None:
        """The MoE runner over the bank, cache and CPU workers; the KV cache, the model, the
        scheduler and the sampler."""
        config, spec, plan = self.config, self.spec, self.plan
        if self.layers_on is None:
            self.moe = self._new_runner(self.bank, self.cache, self.bp_gbps)
            if plan.all_resident:
                _load_all_experts(self.cache, self.bank)
            elif plan.prefill_buffer_bytes:
                self.moe.allocate_prefill_buffers()
            self.kv = self._new_kv(plan)
        else:
            dense = self._build_split(dense)
        running = config.batching.max_running_requests
        # a hybrid model's linear layers, or a model's sliding-window layers: one state slot
        # (a ring of the window's tokens) per running sequence and the checkpoints a prompt may
        # resume from (with the prefix cache)
        memory = config.memory
        checkpoints = memory.state_checkpoints if self.kv.prefix_cache else 0
        self.states: StatePool | WindowPool | None = None
        parts = list(zip(self.devices, self.split.ranges, strict=True)) if self.split else []
        if spec.hybrid and not parts:
            self.states = StatePool(spec, running, self.device, self.dtype, checkpoints)
        elif spec.hybrid:
            self.states = SplitStatePool(spec, running, parts, self.dtype, checkpoints)
        elif spec.sliding_layers and not parts:
            self.states = WindowPool(spec, running, memory.kv_block_size, self.device, self.dtype,
                                     checkpoints, memory.kv_cache_dtype)  # fmt: skip
        elif spec.sliding_layers:
            self.states = SplitWindowPool(spec, running, memory.kv_block_size, parts, self.dtype,
                                          checkpoints, memory.kv_cache_dtype)  # fmt: skip
        self.model = Model(spec, dense, self.moe, self.kv, max_positions=plan.max_context + 1,
                           states=self.states, placement=self.layers_on)  # fmt: skip
        if self.layers_on is not None:
            self.model.kv_parts = self.kv_parts
        self.scheduler = Scheduler(
            self.kv, running, config.prefill.chunk_tokens, states=self.states,
            checkpoint_interval=memory.state_checkpoint_interval,
        )  # fmt: skip
        self.sampler = Sampler(config.server.seed)

    def _build_split(self, dense: DenseWeights) -> DenseWeights:
        """A split's parts on each device: its layers' dense weights (returned), its MoE runner
        over its layers' part of the bank and its own cache, its KV cache of its paged attention
        layers (its rings and states: `_build_caches`)."""
        placement, split, cache = self.layers_on, self.split, self.cache
        assert placement is not None and split is not None and isinstance(cache, SplitCache)
        moe_ranges = placement.moe_ranges(self.spec.moe_layers)
        counters = LayerCounters.zeros(self.spec.num_moe_layers, self.spec.num_experts)
        runners: list[MoERunner | None] = []
        for d, span in enumerate(moe_ranges):
            if not span:  # its layers are all dense
                runners.append(None)
                continue
            bank = self.bank.layers(span)
            rows = counter_rows(counters, span)
            runner = self._new_runner(bank, cache.caches[d], self.link_gbps[d], rows)
            if split.plans[d].all_resident:
                _load_all_experts(cache.caches[d], bank)
            elif split.plans[d].prefill_buffer_bytes:
                runner.allocate_prefill_buffers()
            runners.append(runner)
        self.moe = SplitExperts(runners, moe_ranges, counters)
        self.kv_parts = self._new_kv_parts(split)
        self.kv = self.kv_parts[0]
        return placement.place(dense)

    def _new_kv_parts(self, split: SplitPlan) -> list[KVCache]:
        """Each device's KV cache of its paged attention layers under `split`."""
        return [
            self._new_kv(plan, device, sum(1 for i in self.spec.paged_layers if i in span))
            for plan, device, span in zip(split.plans, self.devices, split.ranges, strict=True)
        ]

    def _new_kv(
        self, plan: VramPlan, device: torch.device | None = None, rows: int | None = None
    ) -> KVCache:
        """The KV cache of `plan` on the engine's device; on `device`, of `rows` paged
        attention layers, for one device of a split."""
        memory = self.config.memory
        # a hybrid model's recurrent state, or the ring of a sliding-window layer, cannot be cut
        # back to a matched prefix: it resumes from a checkpoint, without which nothing is matched
        fixed = self.spec.hybrid or bool(self.spec.sliding_layers)
        resumable = not fixed or memory.state_checkpoints > 0
        prefix_cache = memory.prefix_cache and resumable
        if memory.prefix_cache and not prefix_cache:
            kept = ("linear attention layers keep a recurrent state" if self.spec.hybrid
                    else "sliding-window layers keep only their window's tokens")  # fmt: skip
            log.info("prefix cache off: this model's %s, which resumes only from a state "
                     "checkpoint, and --state-checkpoints is 0", kept)  # fmt: skip
        return KVCache(self.spec, plan.kv_blocks, memory.kv_block_size, device or self.device,
                       self.dtype, prefix_cache=prefix_cache, cache_dtype=memory.kv_cache_dtype,
                       rows=rows)  # fmt: skip

    def _build_stepper(self) -> Stepper:
        tokenizer = self.tokenizer
        eos_ids = tokenizer.eos_token_ids if tokenizer else self.spec.eos_token_ids
        stepper = Stepper(
            self.model,
            self.moe,
            self.scheduler,
            self.sampler,
            self.kv,
            self.telemetry,
            device=self.device,
            eos_ids=frozenset(eos_ids),
            max_context=self.max_context,
            overlap_decode=self.config.batching.overlap_decode,
        )
        if self.split is not None:  # a split's decode steps pipeline in micro-batches
            stepper.pipelining = Pipelining(self.config.memory.split_microbatches)
        return stepper

    def _bandwidths(self) -> tuple[float, float, str]:
        """Bp and Bh: from this machine's `moelab bench bw` profile, else measured now."""
        cpu, profile = self.cpu, self._bandwidth_profile()
        bp = bh = None
        if profile is not None:
            kind = "h2d_pinned" if self.bank.pinned_layers else "h2d_pageable"
            bp = (
                device_best(profile, kind, self.device.index or 0)
                if self.device.type == "cuda"
                else None
            )
            # the profile's CPU rate is bf16's: the kernel reads FP8 and 4-bit at rates of their own
            if self.bank.fmt == "bf16":
                bh = best(profile, "cpu_experts", threads=cpu.num_threads, experts=4,
                          kernel=cpu.kernel)  # fmt: skip
        source = "profile" if bp and bh else "measured at start"
        bp = bp or measure_bp_gbps(self.bank, self.device)
        bh = bh or measure_bh_gbps(cpu, self.bank)
        return bp, bh, source

    def _stream_threshold(self) -> int:
        """Prefill chunk length from which whole layers are streamed: measured by `moelab bench
        prefill --crossover` when the profile has it, else where a chunk is expected to route to
        half of a layer's experts."""
        spec, profile = self.spec, self._bandwidth_profile()
        measured = profile and best(
            profile, "prefill_crossover", num_experts=spec.num_experts, top_k=spec.top_k
        )
        return int(measured) if measured else stream_threshold_tokens(spec.num_experts, spec.top_k)

    def _bandwidth_profile(self) -> dict | None:
        spec = self.spec
        return load_profile(
            spec.hidden_size,
            spec.moe_intermediate_size,
            self.dtype_name,
            self.config.experts.bw_profile,
        )

    def _capture_graphs(self) -> None:
        """Capture decode steps on a CUDA device: whole steps when every expert is resident, else
        the dense pieces between the MoE layers (the experts run eagerly between them)."""
        stepper = self.stepper
        stepper.drain()  # a queued step still replays the old graphs
        stepper.graphs = None  # captured graphs hold the old cache and KV tensors
        batching = self.config.batching
        if self.device.type != "cuda" or not batching.cuda_graph:
            return
        t0 = time.perf_counter()
        whole = self.cache.holds_everything
        if self.layers_on is not None and not self.plan.graph_bytes:
            log.info("decode runs eagerly across the split's devices (no room for graph pools)")
            return
        if whole:
            self.cache.device_slot_map()  # upload the slot map now: a capture cannot copy it
        graphs = (
            DecodeGraphs(
                self.model, batching.cuda_graph_max_bs, self.max_context, piecewise=not whole
            )
            if self.layers_on is None
            else SplitDecodeGraphs(
                self.model,
                batching.cuda_graph_max_bs,
                self.max_context,
                piecewise=not whole,
                pipelining=stepper.pipelining,
            )
        )
        graphs.capture()
        stepper.graphs = graphs
        log.info("decode CUDA graphs captured in %.2f s", time.perf_counter() - t0)

    def _replan(self, kv_tokens: int, **settings: int | float | None) -> VramPlan:
        """The plan of the budget in force with `kv_tokens` of KV, and the memory request's
        `settings` (cache_size, cache_rate) where given in place of the configuration's."""
        request = self.config.memory_request(
            budget_bytes=self.plan.budget_bytes,
            elem_bytes=self.dtype.itemsize,
            cuda=self.device.type == "cuda",
            flash=self.flash_chunks,
            kv_tokens=kv_tokens,
        )
        return replace(request, **settings).plan(self.spec)

    def _apply_plan(self, plan: VramPlan) -> None:
        """Resize the expert cache to `plan` (idle engine), keeping the most recent experts."""
        self.stepper.drain()
        self.stepper.graphs = None
        self.moe.count_backlog()  # resident steps still kept, counted before the cache changes
        self.moe.release_prefill_buffers()
        self.cache.resize(plan.slots, self.moe.refill)
        if plan.all_resident:
            _load_all_experts(self.cache, self.bank)
        elif plan.prefill_buffer_bytes:
            self.moe.allocate_prefill_buffers()
        self.plan = plan
        self.stepper.use_kv(self.kv, plan.max_context)
        self._capture_graphs()
        self._end_too_long()

    def resize_cache(self, slots: int) -> None:
        """Set the number of expert slots without reloading weights (no request may be running).

        Raises MemoryPlanError when the current KV and `slots` do not fit the budget.
        """
        assert not self.scheduler.running, "resize while requests run"
        if self.split is not None:
            split = self._replan_split(self.kv.capacity_tokens, cache_size=slots, cache_rate=None)
            self._apply_split(split)
            log.info("expert caches resized: %s", self._split_text(split))
            return
        plan = self._replan(self.kv.capacity_tokens, cache_size=slots, cache_rate=None)
        self._apply_plan(plan)
        log.info("expert cache resized: %s", plan.describe())

    def resize_kv(self, tokens: int) -> None:
        """Reserve `tokens` of KV and give the expert cache what is left (no request running)."""
        assert not self.scheduler.running, "resize while requests run"
        self.stepper.drain()  # a queued step still writes the old KV
        if self.split is not None:
            split = self._replan_split(tokens)
            for kv in self.kv_parts:
                kv.free_memory()
            self.kv_parts[:] = self._new_kv_parts(split)  # the model's list, too
            self.kv = self.scheduler.kv = self.kv_parts[0]
            self._grow_rotaries(split.total.max_context)
            self._apply_split(split)
            log.info("KV reserve changed: %s", self._split_text(split))
            return
        plan = self._replan(tokens)
        self.kv.free_memory()
        self.kv = self._new_kv(plan)
        self.model.kv = self.scheduler.kv = self.kv
        self._grow_rotaries(plan.max_context)
        self._apply_plan(plan)
        log.info("KV reserve changed: %s", plan.describe())

    def _grow_rotaries(self, max_context: int) -> None:
        """Longer rotary tables on every device where `max_context` outgrows them."""
        rotaries = self.model.rotaries
        if max_context + 1 <= rotaries[0].cos.shape[0]:
            return
        for part, device in enumerate(self.devices if self.split is not None else [self.device]):
            rotaries[part] = Rotary(self.spec, max_context + 1, device, self.dtype)

    def _replan_split(self, kv_tokens: int, **settings: int | float | None) -> SplitPlan:
        """The split's plans with `kv_tokens` of KV and the memory request's `settings` where
        given, over the budgets it started with and the same layers on each device (their dense
        weights stay where they are); MemoryPlanError where a device cannot hold its part."""
        assert self.split is not None
        request = self.config.memory_request(
            budget_bytes=0,
            elem_bytes=self.dtype.itemsize,
            cuda=self.device.type == "cuda",
            flash=self.flash_chunks,
            kv_tokens=kv_tokens,
        )
        counts = LayerSplit(counts=tuple(len(span) for span in self.split.ranges))
        split = plan_graphed_devices(
            self.spec, replace(request, **settings), self.split_budgets, counts
        )
        assert split.ranges == self.split.ranges
        return split

    def _apply_split(self, split: SplitPlan) -> None:
        """Resize each device's expert cache to its plan in `split` (idle engine), keeping the
        most recent experts, as `_apply_plan` does on one device."""
        assert isinstance(self.moe, SplitExperts) and isinstance(self.cache, SplitCache)
        self.stepper.drain()
        self.stepper.graphs = None
        self.moe.count_backlog()
        self.moe.release_prefill_buffers()
        parts = zip(self.moe.runners, self.cache.caches, split.plans, strict=True)
        for runner, cache, plan in parts:
            if runner is None or cache is None:  # a device whose layers are all dense
                continue
            cache.resize(plan.slots, runner.refill)
            if plan.all_resident:
                _load_all_experts(cache, runner.bank)
            elif plan.prefill_buffer_bytes:
                runner.allocate_prefill_buffers()
        self.split = split
        self.plan = split.total
        self.stepper.use_kv(self.kv, self.plan.max_context)
        self._capture_graphs()
        self._end_too_long()

    def _split_text(self, split: SplitPlan) -> str:
        parts = zip(split.names, split.plans, strict=True)
        return "; ".join(f"{name}: {plan.describe()}" for name, plan in parts)

    # running ------------------------------------------------------------------------------------

    @property
    def policy(self) -> MissPolicy:
        """The miss split in force (auto follows the CPU rate decode sees)."""
        return self.moe.policy

    @property
    def max_context(self) -> int:
        return self.plan.max_context

    @property
    def dtype_name(self) -> str:
        """The compute dtype by name (bfloat16, float32, ...)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode steps' CUDA graphs (None: steps run eagerly)."""
        return self.stepper.graphs

    @property
    def idle(self) -> bool:
        """Nothing to run and no step in flight."""
        return self.stepper.idle

    def step(self) -> list[Sequence]:
        """Run one forward step; returns the sequences that got a token (stepping.py)."""
        return self.stepper.step()

    def drain(self) -> list[Sequence]:
        """Finish the step in flight, if any (before the caches change or stats are read)."""
        return self.stepper.drain()

    def run_until_idle(self) -> None:
        self.stepper.run_until_idle()

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_token: Callable[[Sequence, int], None] | None = None,
        boundaries: tuple[int, ...] = (),
    ) -> Sequence:
        """Queue a request; raise ValueError when it can never fit the context. `boundaries`:
        prompt token counts where a later request's prompt may part from this one (a chat's
        message ends), at which a hybrid model keeps a state checkpoint."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if too_long := self._too_long(len(prompt_ids), params.max_tokens):
            raise too_long
        seq = Sequence(list(prompt_ids), params, on_token, arrival_time=time.monotonic(),
                       boundaries=boundaries)  # fmt: skip
        self.scheduler.add(seq)
        return seq

    def _too_long(self, prompt: int, max_tokens: int) -> ContextTooLong | None:
        """The error of a request the usable context cannot hold (None where it can)."""
        total = prompt + max_tokens
        if total <= self.max_context:
            return None
        return ContextTooLong(
            f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {total} exceeds the usable "
            f"context of {self.max_context} tokens; shorten the prompt or lower max_tokens"
        )

    def _end_too_long(self) -> None:
        """End each waiting request that the usable context (made smaller by a resize) can no
        longer hold, telling its client why: it would wait for room that never comes."""
        for seq in list(self.scheduler.waiting):
            too_long = self._too_long(len(seq.prompt_ids), seq.params.max_tokens)
            if too_long is None:
                continue
            log.warning("ended request %d: %s", seq.id, too_long)
            seq.error = too_long
            self.scheduler.finish(seq, "error")
            self.sampler.forget(seq.id)
            if seq.on_token is not None:
                seq.on_token(seq, -1)

    def cancel(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, "cancelled")
        self.sampler.forget(seq.id)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Output token ids for each prompt, all run together (continuous batching)."""
        seqs = [self.add(p, params) for p in prompts]
        self.run_until_idle()
        return [s.output_ids for s in seqs]

    @torch.inference_mode()
    def score(self, prompt_ids: list[int]) -> torch.Tensor:
        """Next-token logits [n, vocab] (fp32) after every prefix of one prompt, in one pass."""
        n = len(prompt_ids)
        blocks = self.kv.allocate(self.kv.blocks_for(n))
        state_slot = self.states.allocate() if self.states is not None else -1
        try:
            dev = self.device
            pages = self.kv.page_indices([(blocks, n)])[0]
            batch = StepBatch(
                input_ids=torch.tensor(prompt_ids, dtype=torch.long, device=dev),
                positions=torch.arange(n, device=dev),
                slots=torch.tensor([self.kv.slot(blocks, p) for p in range(n)], device=dev),
                seqs=[SeqSlice(0, n, n, pages, state_slot)],
                logits_index=torch.arange(n, device=dev),
            )
            return self.model.forward(batch)
        finally:
            self.kv.release(blocks)
            if self.states is not None:
                self.states.release(state_slot)

    def device_reports(self) -> list[dict]:
        """Each device's part of the model (/v1/stats `devices`): its layers, its link's rate,
        its expert slots, its memory plan and, for a split, its memory as `memory.device` reports
        one device's."""
        if self.split is None:
            return [
                {
                    "device": str(self.device),
                    "layers": [0, self.spec.num_layers - 1],
                    "link_gbps": self.bp_gbps,
                    "slots": self.cache.slots,
                    "kv_tokens": self.kv.capacity_tokens,
                    "plan": self.plan.to_dict(),
                }
            ]
        caches, runners = self.cache.caches, self.moe.runners
        pipelining = self.stepper.pipelining
        assert pipelining is not None
        # each device's recurrent states, or its rings (counted with its KV, as telemetry does)
        states = self.states.part_bytes() if isinstance(self.states, SplitStatePool) else None
        rings = self.states.part_bytes() if isinstance(self.states, SplitWindowPool) else None
        out = []
        for d, device in enumerate(self.devices):
            plan, span, kv = self.split.plans[d], self.split.ranges[d], self.kv_parts[d]
            cache, runner = caches[d], runners[d]  # (None: its layers are all dense)
            memory = {
                "index": device.index or 0,
                "total": plan.budget_bytes,
                "weights": plan.weights_bytes,
                "kv": kv.nbytes + (rings[d] if rings else 0),
                "expert_cache": 0 if cache is None else cache.nbytes,
                "prefill_buffer": 0 if runner is None else runner.stage_bytes,
                "activations": plan.activation_bytes,
                "graphs": 0,
                "states": states[d] if states else 0,
                "other": 0,
            }
            if device.type == "cuda":
                free, memory["total"] = torch.cuda.mem_get_info(device)
                accounted = sum(v for k, v in memory.items() if k not in ("index", "total"))
                memory["other"] = max(0, memory["total"] - free - accounted)
            step = self.split.steps[d]
            out.append(
                {
                    "device": self.split.names[d],
                    "layers": [span.start, span.stop - 1],
                    "link_gbps": self.link_gbps[d],
                    "memory_gbps": self.memory_gbps[d],
                    "step_ms": step.seconds * 1e3,
                    "limits": step is self.split.limit,
                    "slots": 0 if cache is None else cache.slots,
                    "kv_tokens": kv.capacity_tokens,
                    "plan": plan.to_dict(),
                    "memory": memory,
                    **pipelining.report(),
                }
            )
        return out

    def config_in_force(self) -> dict:
        """The resolved settings the engine runs with (what /v1/stats reports as config)."""
        config, graphs = self.config, self.graphs
        return {
            "policy": config.experts.miss_policy,
            "policy_mode": self.policy.mode,
            "cache_admission": config.experts.cache_admission,
            # auto: follows the CPU's rate as decode sees it (MoERunner._adapt_split)
            "fetch_fraction": self.policy.fetch_fraction,
            "policy_bh_gbps": self.policy.bh_gbps,
            "cpu_threads": self.cpu.num_threads,
            "cpu_kernel": self.cpu.kernel,
            # the native kernel's code path on this CPU (avx512, avx2, scalar; torch: none), and
            # whether its FP8 and 4-bit rows take AVX-512 BF16 dot products (docs/cpu-experts.md)
            "cpu_simd": self.cpu.simd,
            "cpu_bf16_dot": self.cpu.bf16_dot,
            "cpu_spin_us": config.experts.cpu_spin_us,
            "cpu_task_kb": config.experts.cpu_task_kb,
            "cpu_redo_us": self.cpu.redo_us,  # as a bench's alternation leaves it
            "cpu_pin": self.cpu_pin,
            "cpu_worker_cpus": cpu_ranges(self.cpu.cpus) if self.cpu.cpus else "os",
            "process_cpus": cpu_ranges(self.placement.cpus) if self.placement else "os",
            "split_misses": config.experts.split_misses,
            "cpu_prefetch_rounds": self.moe.prefetch_rounds,  # as set_prefetch_rounds leaves it
            "copy_ahead": self.moe.copy_ahead,  # as set_copy_ahead leaves it
            "bp_gbps": self.bp_gbps,
            "bh_gbps": self.bh_gbps,
            "rates_source": self.rates_source,
            "slots": self.cache.slots,
            "kv_reserve_tokens": config.memory.kv_reserve_tokens,
            "prefill_chunk_tokens": config.prefill.chunk_tokens,
            "prefill_overlap": config.prefill.overlap,
            "prefill_stream_min_tokens": self.moe.prefill_stream_min_tokens,
            "max_running_requests": config.batching.max_running_requests,
            "cuda_graphs": graphs is not None,
            "cuda_graph_mode": (
                None if graphs is None else "piecewise" if graphs.piecewise else "whole"
            ),
            # the decode kernels' programmatic dependent launch (kernels/common.py, MOELAB_PDL)
            "pdl": common.pdl(self.device),
            "device": str(self.device),
            "dtype": self.dtype_name,
            # the dense projections as held (--dense-dtype): "fp8", else the compute dtype
            "dense_dtype": "fp8" if config.model.dense_dtype == "fp8" else self.dtype_name,
        }

    def set_cpu_pin(self, mode: str) -> None:
        """--moe-cpu-pin's 'cores' or 'isolate' from now on (between runs: `bench decode
        --alternate-cpu-pin`): the rest of the engine's threads moved off the CPU expert
        workers' cores, or back to the CPUs they had. ValueError where isolate cannot be had
        (workers not pinned, or no core left over) or for another mode."""
        if mode == "isolate":
            if self.placement is None:
                self.placement = ProcessPlacement.around(self.cpu)
            if self.placement is None:
                raise ValueError("needs CPU expert workers pinned to cores, with a core left over")
        elif mode == "cores":
            if self.placement is not None:
                self.placement.restore()
                self.placement = None
        else:
            raise ValueError(f"a placement to switch to is 'cores' or 'isolate', not {mode!r}")
        self.cpu_pin = mode

    def close(self) -> None:
        self.cpu.close()
        if self.placement is not None:
            self.placement.restore()


# where a split's dense weights wait for their devices
HOST = torch.device("cpu")


def _load_all_experts(cache: ExpertCache, bank: ExpertBank) -> None:
    """Every expert of `bank` fits `cache`: fill it once, nothing is fetched afterwards."""
    fills = cache.fills
    for m in range(bank.num_layers):
        for e in range(bank.num_experts):
            if cache.slot_of[m, e] >= 0:
                continue
            slot = cache.admit(m, e, set())
            assert slot is not None
            for dst, src in zip(cache.tensors(), bank.layer_tensors(m), strict=True):
                dst[slot].copy_(src[e], non_blocking=True)
    cache.fills = fills
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
