"""The FP8 KV cache (--kv-cache-dtype fp8) in the engine on the CPU: its pages and their factors,
the memory it plans, and a long prompt's greedy tokens and logits against bf16 KV."""

from __future__ import annotations

import pytest
import torch

from moelab.engine.config.config import EngineConfig
from moelab.engine.config.memory import kv_bytes_per_token
from moelab.engine.model.kv import KVCache
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize
from moelab.kernels import fp8_kv

from .reference import make_engine

CONTEXT = 1024  # the synthetic models' context, most of it filled by the prompt
PROMPT = 960
STEPS = 32


def _kv(cache_dtype: str, blocks: int = 4) -> KVCache:
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    return KVCache(spec, blocks, 4, torch.device("cpu"), torch.float32, cache_dtype=cache_dtype)


def test_fp8_pages_give_back_what_was_written_within_e4m3s_precision():
    kv = _kv("fp8")
    assert kv.k.dtype == torch.uint8 and kv.scales(1) is not None
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(6, 2, 16, generator=gen) * torch.tensor([1e-3, 1e2])[None, :, None]
    v = torch.randn(6, 2, 16, generator=gen)
    blocks = kv.allocate(2)
    kv.write(1, k, v, torch.tensor([kv.slot(blocks, p) for p in range(6)]))
    keys, values = kv.gather(1, torch.tensor(blocks), 6)
    assert keys.dtype == torch.float32
    for got, want in ((keys, k), (values, v)):
        amax = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= want.abs() / 16 + amax / 448 * 2**-10).all()
    assert not torch.equal(keys, k)  # held in FP8, not in the compute dtype


def test_a_bf16_cache_under_fp32_compute_reads_back_rounded_to_bf16():
    kv = _kv("bf16")
    k = torch.randn(3, 2, 16)
    blocks = kv.allocate(1)
    kv.write(0, k, k, torch.tensor([kv.slot(blocks, p) for p in range(3)]))
    keys, _ = kv.gather(0, torch.tensor(blocks), 3)
    assert kv.k.dtype == torch.bfloat16 and keys.dtype == torch.float32
    assert torch.equal(keys, k.to(torch.bfloat16).float())


@pytest.mark.parametrize("cache_dtype", ["auto", "bf16", "fp8"])
def test_the_plan_counts_the_bytes_the_cache_holds(cache_dtype):
    spec = ModelSpec.from_config(make_config("qwen3_moe", "tiny"))
    kv = _kv(cache_dtype, blocks=7)
    assert kv.bytes_per_token == kv_bytes_per_token(spec, 4, cache_dtype)  # fp32 compute
    assert fp8_kv.SCALE_BYTES == 4  # the factor the plan counts


def test_fp8_holds_about_twice_the_tokens_of_bf16_in_the_same_memory():
    """The Qwen3-30B-A3B geometry: the plan's KV bytes of one reserve, and the expert slots the
    rest of a 24 GiB budget buys."""
    spec = ModelSpec.from_config(make_config("qwen3_moe", "qwen3-30b-a3b"))

    def plan(cache_dtype: str):
        config = EngineConfig.from_flags(
            ["--model-path", "m", "--kv-cache-dtype", cache_dtype, "--kv-reserve-tokens", "65536"]
        )
        return config.memory_request(budget_bytes=24 << 30, elem_bytes=2, cuda=True).plan(spec)

    bf16, fp8 = plan("bf16"), plan("fp8")
    assert plan("auto") == bf16
    assert min(bf16.kv_tokens, fp8.kv_tokens) >= 65536  # and what is left after whole slots
    per_token = [p.kv_bytes / p.kv_tokens for p in (bf16, fp8)]
    assert per_token[0] / per_token[1] == 256 / 132  # 128 bytes and a 4-byte factor a head
    assert fp8.slots > bf16.slots


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def engines(request, tmp_path_factory):
    """One synthetic checkpoint of `CONTEXT` tokens, served with bf16 KV and with FP8 KV."""
    arch = request.param
    path = synthesize(
        tmp_path_factory.mktemp(arch),
        arch=arch,
        preset="tiny",
        overrides={"max_position_embeddings": CONTEXT},
        seed=5,
    )
    pair = (
        make_engine(path, "--kv-cache-dtype", "bf16"),
        make_engine(path, "--kv-cache-dtype", "fp8"),
    )
    yield arch, *pair
    for engine in pair:
        engine.close()


# prompts whose greedy steps hold no near tie (a top-2 margin under 0.02 logits, which FP8's
# error can flip: the logits of the two caches differ by up to about 0.04 along the way)
PROMPT_SEEDS = {"qwen3_moe": 4, "mixtral": 2}


def test_a_long_prompts_greedy_tokens_agree_with_bf16_kv(engines):
    arch, bf16, fp8 = engines
    gen = torch.Generator().manual_seed(PROMPT_SEEDS[arch])
    ids = torch.randint(0, 2000, (PROMPT,), generator=gen).tolist()
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    ours, ref = fp8.generate([ids], params)[0], bf16.generate([ids], params)[0]
    assert fp8.kv.k.dtype == torch.uint8 and bf16.kv.k.dtype == torch.bfloat16
    # the logits after the prompt and each generated token, as each cache holds them
    along = slice(PROMPT - 1, PROMPT - 1 + STEPS)
    ref_logits = bf16.score(ids + ref)[along]
    fp8_logits = fp8.score(ids + ref)[along]
    top2 = ref_logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    diff = (fp8_logits - ref_logits).abs()
    print(
        f"\n{arch}: FP8 against bf16 KV over {STEPS} greedy steps after {PROMPT} prompt tokens: "
        f"max |Δlogit| {diff.max():.4f}, mean {diff.mean():.5f}, of logits up to "
        f"{ref_logits.abs().max():.2f}; smallest top-2 margin {margins.min():.4f}"
    )
    assert margins.min() > 0.02, "the prompt holds a near tie: pick another"
    assert ours == ref
    assert 0 < diff.max() < margins.min()


def test_the_prompts_logits_stay_close_to_bf16_kvs(engines):
    """Every position of a long prompt scored in one pass (its attention reads the FP8 pages
    back): the next-token picks agree nearly everywhere."""
    arch, bf16, fp8 = engines
    ids = torch.randint(0, 2000, (PROMPT,), generator=torch.Generator().manual_seed(9)).tolist()
    ref, ours = bf16.score(ids), fp8.score(ids)
    diff = (ours - ref).abs()
    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    print(
        f"\n{arch}: FP8 against bf16 KV over a {PROMPT}-token prompt: max |Δlogit| "
        f"{diff.max():.4f}, mean {diff.mean():.5f}, next-token picks agree at {agree:.2%}"
    )
    assert diff.mean() < 0.05 and agree > 0.97
