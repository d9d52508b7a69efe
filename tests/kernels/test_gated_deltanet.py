"""The Gated DeltaNet math against transformers' torch implementation (Qwen3-Next, Qwen3.5 MoE)."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNormGated,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from moelab.kernels import gated_deltanet as gdn

from .kernel_inputs import DEVICE, assert_matches, randn

# fp32, of the largest output (the bound): the chunked rule sums in other orders than
# transformers' and than itself cut elsewhere, a few 1e-6 apart over 150 tokens
TOL = 1e-4


def rule_inputs(
    gen: torch.Generator, tokens: int, heads: int = 2, v_heads: int = 4, dk: int = 16, dv: int = 8
) -> tuple[torch.Tensor, ...]:
    """q, k [T, H, DK], v [T, HV, DV], and g, beta [T, HV] as the model derives them."""
    q, k = randn(gen, tokens, heads, dk), randn(gen, tokens, heads, dk)
    v = randn(gen, tokens, v_heads, dv)
    # heads from slow to fast decay (A from 1e-3 to 10), so that some keep their state for
    # hundreds of tokens, across chunks, and others forget it within a few
    a_log = (torch.linspace(-7, 2.3, v_heads) + 0.1 * torch.randn(v_heads, generator=gen)).to(
        DEVICE
    )
    g, beta = gdn.decay_and_beta(
        randn(gen, tokens, v_heads), randn(gen, tokens, v_heads), a_log, randn(gen, v_heads)
    )
    return q, k, v, g, beta


def hf_rule(rule, q, k, v, g, beta, state: torch.Tensor | None, **kwargs):
    """transformers' rule on one sequence [T, ...] (batch 1): (o [T, HV, DV], final state)."""
    o, final = rule(
        *(t.unsqueeze(0) for t in (q, k, v)),
        g=g.unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=None if state is None else state.unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **kwargs,
    )
    return o[0], final[0]


@pytest.mark.parametrize("tokens", [1, 37, 64, 130])
@pytest.mark.parametrize("hf", ["chunked", "recurrent"])
def test_prefill_matches_transformers_from_a_state(gen, tokens, hf):
    q, k, v, g, beta = rule_inputs(gen, tokens)
    start = randn(gen, 4, 16, 8, scale=0.3)
    rule = torch_chunk_gated_delta_rule if hf == "chunked" else torch_recurrent_gated_delta_rule
    ref_o, ref_state = hf_rule(rule, q, k, v, g, beta, start)
    state = start.clone()
    o = gdn.delta_rule_prefill_ref(q, k, v, g, beta, state)
    assert_matches(o, ref_o, TOL)
    assert_matches(state, ref_state, TOL)


def test_prefill_from_a_zero_state_is_transformers_without_one(gen):
    q, k, v, g, beta = rule_inputs(gen, 50, heads=3, v_heads=3)
    ref_o, ref_state = hf_rule(torch_chunk_gated_delta_rule, q, k, v, g, beta, None)
    state = torch.zeros(3, 16, 8, device=DEVICE)
    assert_matches(gdn.delta_rule_prefill_ref(q, k, v, g, beta, state), ref_o, TOL)
    assert_matches(state, ref_state, TOL)


@settings(deadline=None, max_examples=25)
@given(
    tokens=st.integers(1, 150),
    cut=st.floats(0, 1),
    chunk_size=st.sampled_from([16, 64]),
    seed=st.integers(0, 2**16),
)
def test_a_prompt_prefilled_in_two_pieces_equals_one_prefill(tokens, cut, chunk_size, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = rule_inputs(gen, tokens)
    start = randn(gen, 4, 16, 8, scale=0.3)
    whole_state = start.clone()
    whole = gdn.delta_rule_prefill_ref(q, k, v, g, beta, whole_state, chunk_size)
    split = round(cut * tokens)
    state = start.clone()
    first, second = (
        gdn.delta_rule_prefill_ref(*(t[part] for t in (q, k, v, g, beta)), state, chunk_size)
        for part in (slice(0, split), slice(split, tokens))
    )
    assert_matches(torch.cat([first, second]), whole, TOL)
    assert_matches(state, whole_state, TOL)


def test_decode_steps_after_a_prefill_equal_a_longer_prefill(gen):
    q, k, v, g, beta = rule_inputs(gen, 45)
    whole_state = torch.zeros(4, 16, 8, device=DEVICE)
    whole = gdn.delta_rule_prefill_ref(q, k, v, g, beta, whole_state)
    states = torch.zeros(3, 4, 16, 8, device=DEVICE)  # the sequence lives in slot 2 of three
    slot = torch.tensor([2], device=DEVICE)
    prefilled = gdn.delta_rule_prefill_ref(*(t[:40] for t in (q, k, v, g, beta)), states[2])
    steps = [
        gdn.delta_rule_decode_ref(*(t[i : i + 1] for t in (q, k, v, g, beta)), states, slot)
        for i in range(40, 45)
    ]
    assert_matches(torch.cat([prefilled, *steps]), whole, TOL)
    assert_matches(states[2], whole_state, TOL)
    assert not states[:2].any(), "a decode step wrote into another sequence's slot"


def test_a_decode_batch_advances_each_sequence_from_its_own_slot(gen):
    q, k, v, g, beta = rule_inputs(gen, 3)
    states = randn(gen, 5, 4, 16, 8, scale=0.3)
    before = states.clone()
    slot_ids = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEVICE)
    o = gdn.delta_rule_decode_ref(q, k, v, g, beta, states, slot_ids)
    for row, slot in enumerate(slot_ids.tolist()):
        one = slice(row, row + 1)
        ref_o, ref_state = hf_rule(
            torch_recurrent_gated_delta_rule, *(t[one] for t in (q, k, v, g, beta)), before[slot]
        )
        assert_matches(o[one], ref_o, TOL)
        assert_matches(states[slot], ref_state, TOL)
    assert torch.equal(states[[1, 2]], before[[1, 2]]), "a slot outside the batch changed"


def test_a_narrow_state_is_read_and_written_in_its_dtype(gen):
    q, k, v, g, beta = rule_inputs(gen, 20)
    start = randn(gen, 4, 16, 8, scale=0.3, dtype=torch.bfloat16)
    ref_o, ref_state = hf_rule(torch_chunk_gated_delta_rule, q, k, v, g, beta, start.float())
    state = start.clone()
    assert_matches(gdn.delta_rule_prefill_ref(q, k, v, g, beta, state), ref_o, TOL)
    assert state.dtype == torch.bfloat16
    assert_matches(state.float(), ref_state, 2**-8)


def test_heads_that_do_not_group_are_refused(gen):
    q, k, v, g, beta = rule_inputs(gen, 4, heads=3, v_heads=4)
    with pytest.raises(ValueError, match="HV a multiple of H"):
        gdn.delta_rule_prefill_ref(q, k, v, g, beta, torch.zeros(4, 16, 8, device=DEVICE))


# the short convolution


def hf_conv_prefill(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' convolution over one sequence x [T, C] from no state."""
    return causal_conv1d_fn(x.t().unsqueeze(0), weight, activation="silu")[0].t()


@pytest.mark.parametrize(("tokens", "width"), [(1, 4), (2, 4), (3, 4), (29, 4), (9, 2)])
def test_conv_prefill_matches_transformers_and_keeps_the_last_inputs(gen, tokens, width):
    x, weight = randn(gen, tokens, 24), randn(gen, 24, width)
    state = torch.zeros(width - 1, 24, device=DEVICE)
    assert_matches(gdn.causal_conv_prefill(x, weight, state), hf_conv_prefill(x, weight), TOL)
    expected = torch.cat([torch.zeros(width - 1, 24, device=DEVICE), x])[-(width - 1) :]
    assert torch.equal(state, expected)


@settings(deadline=None, max_examples=25)
@given(tokens=st.integers(1, 20), cut=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_conv_in_two_pieces_equals_one(tokens, cut, seed):
    gen = torch.Generator().manual_seed(seed)
    x, weight, bias = randn(gen, tokens, 12), randn(gen, 12, 4), randn(gen, 12)
    whole_state = torch.zeros(3, 12, device=DEVICE)
    whole = gdn.causal_conv_prefill(x, weight, whole_state, bias)
    split = round(cut * tokens)
    state = torch.zeros(3, 12, device=DEVICE)
    first = gdn.causal_conv_prefill(x[:split], weight, state, bias)
    second = gdn.causal_conv_prefill(x[split:], weight, state, bias)
    assert_matches(torch.cat([first, second]), whole, TOL)
    assert torch.equal(state, whole_state)


def test_conv_decode_of_several_sequences_matches_transformers_update(gen):
    weight = randn(gen, 24, 4)
    prompts = [randn(gen, n, 24) for n in (2, 7, 5)]
    states = torch.zeros(4, 3, 24, device=DEVICE)
    slot_ids = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEVICE)
    # transformers keeps W inputs per sequence (the oldest unused); its state after a prefill
    hf_states = torch.stack(
        [torch.cat([torch.zeros(4, 24, device=DEVICE), p])[-4:] for p in prompts]
    )
    for prompt, slot in zip(prompts, slot_ids.tolist(), strict=True):
        gdn.causal_conv_prefill(prompt, weight, states[slot])
    for _ in range(3):
        x = randn(gen, 3, 24)
        hf_conv_states = hf_states.transpose(1, 2).contiguous()  # [B, C, W], updated in place
        ref = causal_conv1d_update(x.unsqueeze(-1), hf_conv_states, weight, None, "silu")
        hf_states = hf_conv_states.transpose(1, 2)
        assert_matches(gdn.causal_conv_decode(x, weight, states, slot_ids), ref[..., 0], TOL)
    assert torch.equal(states[slot_ids], hf_states[:, 1:])
    assert not states[2].any(), "a decode step wrote into a slot outside the batch"


def test_conv_state_of_the_wrong_shape_is_refused(gen):
    with pytest.raises(ValueError, match=r"\[3, 24\]"):
        gdn.causal_conv_prefill(randn(gen, 5, 24), randn(gen, 24, 4), torch.zeros(4, 24))


# the convolution's Triton kernels (the interpreter on a CPU), against the reference


def conv_inputs(gen: torch.Generator, tokens: int, channels: int, width: int):
    """x [T, C] as the engine passes it (the projection's first C columns: strided rows), a
    weight [C, W], a bias and a conv state [W-1, C] of earlier inputs."""
    projected = randn(gen, tokens, channels + 13)
    return (
        projected[:, :channels],
        randn(gen, channels, width),
        randn(gen, channels),
        randn(gen, width - 1, channels),
    )


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize(
    ("tokens", "width"), [(1, 4), (2, 4), (3, 4), (31, 4), (33, 4), (70, 4), (9, 2), (5, 3)]
)
def test_conv_prefill_kernel_continues_from_the_state_as_the_reference(gen, tokens, width):
    """Prompts shorter than the state, and across token blocks (32): the outputs, and the state
    after the last token copied exactly."""
    x, weight, bias, start = conv_inputs(gen, tokens, 300, width)
    state, ref_state = start.clone(), start.clone()
    out = gdn.causal_conv_prefill_triton(x, weight, state, bias)
    assert_matches(out, gdn.causal_conv_prefill_ref(x, weight, ref_state, bias), TOL)
    assert torch.equal(state, ref_state)


@pytest.mark.usefixtures("triton_runs")
@settings(deadline=None, max_examples=10)
@given(tokens=st.integers(1, 40), cut=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_conv_prefill_kernel_in_two_pieces_equals_one_reference_prefill(tokens, cut, seed):
    gen = torch.Generator().manual_seed(seed)
    x, weight, _, _ = conv_inputs(gen, tokens, 20, 4)
    ref_state = torch.zeros(3, 20, device=DEVICE)
    whole = gdn.causal_conv_prefill_ref(x, weight, ref_state)
    split = round(cut * tokens)
    state = torch.zeros(3, 20, device=DEVICE)
    first = gdn.causal_conv_prefill_triton(x[:split], weight, state)
    second = gdn.causal_conv_prefill_triton(x[split:], weight, state)
    assert_matches(torch.cat([first, second]), whole, TOL)
    assert torch.equal(state, ref_state)


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_conv_decode_kernel_advances_only_its_slots(gen, ids_dtype):
    x, weight, bias, _ = conv_inputs(gen, 3, 200, 4)
    states = randn(gen, 6, 3, 200)
    ref_states = states.clone()
    slot_ids = torch.tensor([4, 0, 5], dtype=ids_dtype, device=DEVICE)
    for _ in range(3):
        out = gdn.causal_conv_decode_triton(x, weight, states, slot_ids, bias)
        ref = gdn.causal_conv_decode_ref(x, weight, ref_states, slot_ids, bias)
        assert_matches(out, ref, TOL)
        assert torch.equal(states, ref_states), "a slot differs, or one outside the batch moved"
        x = randn(gen, 3, 200)


@pytest.mark.usefixtures("triton_runs")
def test_conv_kernels_copy_bf16_inputs_into_the_state_exactly(gen):
    """The state holds inputs, never results: bit for bit in bf16, whatever the rounding of the
    outputs (the interpreter truncates fp32 to bf16: one bf16 unit allowed there)."""
    x, weight, _, start = (t.bfloat16() for t in conv_inputs(gen, 6, 64, 4))
    state, ref_state = start.clone(), start.clone()
    out = gdn.causal_conv_prefill_triton(x, weight, state)
    assert_matches(out, gdn.causal_conv_prefill_ref(x, weight, ref_state), 2**-7)
    assert torch.equal(state, ref_state)
    states, ref_states = state.unsqueeze(0).clone(), ref_state.unsqueeze(0).clone()
    slot = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = gdn.causal_conv_decode_triton(x[:1], weight, states, slot)
    assert_matches(out, gdn.causal_conv_decode_ref(x[:1], weight, ref_states, slot), 2**-7)
    assert torch.equal(states, ref_states)


def test_conv_kernels_refuse_what_they_cannot_step_through(gen):
    x, weight, _, state = conv_inputs(gen, 4, 16, 4)
    with pytest.raises(ValueError, match="x must have a contiguous last dimension"):
        gdn.causal_conv_prefill_triton(x.t().contiguous().t(), weight, state)
    with pytest.raises(ValueError, match=r"slot_ids must be int32 or int64 \[4\]"):
        gdn.causal_conv_decode_triton(x, weight, state.unsqueeze(0), torch.zeros(4))
    every_other = torch.zeros(8, dtype=torch.int32, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="slot_ids must have a contiguous last dimension"):
        gdn.causal_conv_decode_triton(x, weight, state.unsqueeze(0), every_other)


# the delta rule's decode kernel (the interpreter on a CPU), against the reference


def step_inputs(gen: torch.Generator, batch: int, heads: int, v_heads: int, dk: int, dv: int):
    """One decode step's q, k [B, H, DK] and v [B, HV, DV] as the engine passes them (views of
    the convolution's output [B, C]: strided rows), and g, beta [B, HV]."""
    mixed = randn(gen, batch, (2 * heads * dk + v_heads * dv))
    q, k, v = mixed.split([heads * dk, heads * dk, v_heads * dv], dim=-1)
    _, _, _, g, beta = rule_inputs(gen, batch, heads, v_heads, dk, dv)
    return (
        q.unflatten(-1, (heads, dk)),
        k.unflatten(-1, (heads, dk)),
        v.unflatten(-1, (v_heads, dv)),
        g,
        beta,
    )


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("heads", "v_heads", "dk", "dv", "block_v"),
    [
        (2, 4, 16, 64, 32),  # Qwen3.6-35B-A3B's and Qwen3-Next-80B-A3B's ratio (16 and 32 heads)
        (3, 3, 12, 40, 16),  # one value head per key head; DK and DV not powers of two
        (1, 4, 8, 8, 32),  # four value heads per key head; fewer columns than a block
    ],
)
def test_decode_kernel_advances_its_slots_in_place_as_the_reference(
    gen, ids_dtype, heads, v_heads, dk, dv, block_v
):
    """Three sequences in slots out of order, stepped three times: the outputs and the states of
    their slots as the reference's, every other slot untouched."""
    states = randn(gen, 7, v_heads, dk, dv, scale=0.3)
    ref_states = states.clone()
    slot_ids = torch.tensor([5, 0, 3], dtype=ids_dtype, device=DEVICE)
    config = gdn.DeltaDecodeConfig(block_v=block_v)
    for _ in range(3):
        step = step_inputs(gen, 3, heads, v_heads, dk, dv)
        out = gdn.delta_rule_decode_triton(*step, states, slot_ids, config)
        assert_matches(out, gdn.delta_rule_decode_ref(*step, ref_states, slot_ids), 1e-5)
        assert_matches(states, ref_states, 1e-5)
    assert torch.equal(states[[1, 2, 4, 6]], ref_states[[1, 2, 4, 6]])


@pytest.mark.usefixtures("triton_runs")
def test_decode_kernel_sends_a_graphs_padding_rows_to_the_padding_slot(gen):
    """A CUDA graph's batch padded past its two sequences: the padding rows all name the pool's
    padding slot (StatePool.pad_slot). The sequences' outputs and slots are the reference's, the
    other sequences' slots untouched; the padding slot holds a finite state (no row reads it)."""
    states = randn(gen, 6, 4, 16, 8, scale=0.3)  # slots 0-3, the padding slot 4, a checkpoint 5
    ref_states = states.clone()
    slot_ids = torch.tensor([2, 0, 4, 4], dtype=torch.int64, device=DEVICE)
    step = step_inputs(gen, 4, 2, 4, 16, 8)
    out = gdn.delta_rule_decode_triton(*step, states, slot_ids)
    ref = gdn.delta_rule_decode_ref(*(t[:2] for t in step), ref_states, slot_ids[:2])
    assert_matches(out[:2], ref, 1e-5)
    assert_matches(states[[0, 2]], ref_states[[0, 2]], 1e-5)
    assert torch.equal(states[[1, 3, 5]], ref_states[[1, 3, 5]]), "a slot outside the batch moved"
    assert torch.isfinite(states[4]).all() and torch.isfinite(out).all()


@pytest.mark.usefixtures("triton_runs")
def test_decode_kernel_reads_and_writes_a_narrow_state_in_its_dtype(gen):
    states = randn(gen, 3, 4, 16, 8, scale=0.3, dtype=torch.bfloat16)
    ref_states = states.clone()
    slot_ids = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    step = step_inputs(gen, 2, 2, 4, 16, 8)
    out = gdn.delta_rule_decode_triton(*step, states, slot_ids)
    assert_matches(out, gdn.delta_rule_decode_ref(*step, ref_states, slot_ids), 1e-5)
    assert states.dtype == torch.bfloat16
    # the interpreter truncates fp32 to bf16 where the reference rounds: one bf16 unit apart
    assert_matches(states.float(), ref_states.float(), 2**-7)
    assert torch.equal(states[0], ref_states[0])


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2**-6)])
def test_decode_kernel_computes_the_gates_as_decay_and_beta(gen, dtype, tol):
    """The engine's decode step hands the kernel the gates' projections a and b: its decay
    (softplus on both sides of its threshold of 20) and beta (rounded to b's dtype) are
    `decay_and_beta`'s, so its outputs and states are the reference's after it (bf16: the
    interpreter truncates beta where the reference rounds it, one bf16 unit)."""
    heads, v_heads, dk, dv = 2, 4, 16, 8
    states = randn(gen, 5, v_heads, dk, dv, scale=0.3)
    ref_states = states.clone()
    slot_ids = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEVICE)
    a_log, dt_bias = randn(gen, v_heads, scale=0.5), randn(gen, v_heads, dtype=dtype)
    for a_scale in (1.0, 12.0):  # the second step puts some a + dt_bias past 20
        q, k, v, _, _ = step_inputs(gen, 3, heads, v_heads, dk, dv)
        a = randn(gen, 3, v_heads, scale=a_scale, dtype=dtype)
        b = randn(gen, 3, v_heads, scale=3.0, dtype=dtype)
        gates = (a_log, dt_bias)
        out = gdn.delta_rule_decode_triton(q, k, v, a, b, states, slot_ids, gates=gates)
        g, beta = gdn.decay_and_beta(a, b, a_log, dt_bias)
        ref = gdn.delta_rule_decode_ref(q, k, v, g, beta, ref_states, slot_ids)
        assert_matches(out, ref, tol)
        assert_matches(states, ref_states, tol)
    with pytest.raises(ValueError, match=r"A_log \(3,\) and dt_bias \(4,\) must be \[4\]"):
        gdn.delta_rule_decode_triton(q, k, v, a, b, states, slot_ids, gates=(a_log[:3], dt_bias))


def test_the_gated_decode_off_cuda_is_decay_and_beta_then_the_reference(gen):
    q, k, v, _, _ = step_inputs(gen, 2, 2, 4, 16, 8)
    states = randn(gen, 3, 4, 16, 8, scale=0.3)
    ref_states = states.clone()
    slot_ids = torch.tensor([2, 0], dtype=torch.int64, device=DEVICE)
    a, b, a_log, dt_bias = randn(gen, 2, 4), randn(gen, 2, 4), randn(gen, 4), randn(gen, 4)
    out = gdn.gated_delta_rule_decode(q, k, v, a, b, a_log, dt_bias, states, slot_ids)
    g, beta = gdn.decay_and_beta(a, b, a_log, dt_bias)
    ref = gdn.delta_rule_decode_ref(q, k, v, g, beta, ref_states, slot_ids)
    assert_matches(out, ref, 1e-5)
    assert_matches(states, ref_states, 1e-5)


def test_decode_kernel_refuses_what_it_cannot_step_through(gen):
    q, k, v, g, beta = step_inputs(gen, 2, 2, 4, 16, 8)
    states = torch.zeros(3, 4, 16, 8, device=DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"states \[slots, HV, DK, DV\]"):
        gdn.delta_rule_decode_triton(q, k, v, g, beta, states[:, :, :8], slots)
    with pytest.raises(ValueError, match="HV a multiple of H"):
        gdn.delta_rule_decode_triton(q, k, v[:, :3], g[:, :3], beta[:, :3], states[:, :3], slots)
    with pytest.raises(ValueError, match=r"slot_ids must be int32 or int64 \[2\]"):
        gdn.delta_rule_decode_triton(q, k, v, g, beta, states, slots.float())
    with pytest.raises(ValueError, match="states must have a contiguous last dimension"):
        gdn.delta_rule_decode_triton(
            q, k, v, g, beta, states.transpose(2, 3).contiguous().transpose(2, 3), slots
        )
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        gdn.DeltaDecodeConfig(block_v=24)


# the gated norm and the whole layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rmsnorm_is_transformers_bit_for_bit(gen, dtype):
    x, gate = randn(gen, 6, 3, 32, scale=2.0, dtype=dtype), randn(gen, 6, 3, 32, dtype=dtype)
    norm = Qwen3NextRMSNormGated(32, eps=1e-6).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(gen, 32, dtype=dtype))
        expected = norm(x, gate)
    assert torch.equal(gdn.gated_rmsnorm(x, gate, norm.weight, 1e-6), expected)


@pytest.mark.usefixtures("triton_runs")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2**-5)])
def test_gated_rmsnorm_kernel_is_the_reference(gen, dtype, tol):
    """One launch a token and head, the gate a strided view as the projections' output gives
    it, DV not a power of two: the reference's values, every output written (bf16: the
    interpreter truncates where the reference rounds, at each of its three roundings; on CUDA,
    test_the_gated_norm_kernel_rounds_as_the_reference_on_cuda holds it to one bf16 unit)."""
    x = randn(gen, 5, 3, 40, scale=2.0, dtype=dtype)
    z = randn(gen, 5, 200, dtype=dtype)[:, 40:160].unflatten(-1, (3, 40))
    weight = randn(gen, 40, dtype=dtype)
    out = gdn.gated_rmsnorm_triton(x, z, weight, 1e-6)
    assert out.is_contiguous()
    assert_matches(out, gdn.gated_rmsnorm_ref(x, z, weight, 1e-6), tol)
    with pytest.raises(ValueError, match="weight must be x's dtype"):
        gdn.gated_rmsnorm_triton(x, z, weight.double(), 1e-6)
    with pytest.raises(ValueError, match=r"must be one \[T, HV, DV\] shape"):
        gdn.gated_rmsnorm_triton(x, z[:, :2], weight, 1e-6)


def mixer(layer: Qwen3_5MoeGatedDeltaNet, hidden: torch.Tensor, states, slot_ids=None):
    """The layer's token mixer as the engine runs it: a prefill of one sequence's tokens
    [T, hidden] into its slot's views (conv, recurrent) when slot_ids is None, else one decode
    step of [B, hidden] over the pools."""
    c, w = layer.conv_dim, layer.conv1d.weight[:, 0]
    mixed = layer.in_proj_qkv(hidden)
    if slot_ids is None:
        mixed = gdn.causal_conv_prefill(mixed, w, states[0])
    else:
        mixed = gdn.causal_conv_decode(mixed, w, states[0], slot_ids)
    q, k, v = mixed.split([layer.key_dim, layer.key_dim, c - 2 * layer.key_dim], dim=-1)
    q, k = (t.unflatten(-1, (layer.num_k_heads, layer.head_k_dim)) for t in (q, k))
    v = v.unflatten(-1, (layer.num_v_heads, layer.head_v_dim))
    g, beta = gdn.decay_and_beta(
        layer.in_proj_a(hidden), layer.in_proj_b(hidden), layer.A_log, layer.dt_bias
    )
    if slot_ids is None:
        o = gdn.delta_rule_prefill(q, k, v, g, beta, states[1])
    else:
        o = gdn.delta_rule_decode(q, k, v, g, beta, states[1], slot_ids)
    z = layer.in_proj_z(hidden).unflatten(-1, (layer.num_v_heads, layer.head_v_dim))
    o = gdn.gated_rmsnorm(o, z, layer.norm.weight, layer.norm.variance_epsilon)
    return layer.out_proj(o.flatten(-2))


@torch.no_grad()
def test_the_mixer_prefilled_in_pieces_then_decoded_is_the_transformers_layer(gen):
    config = Qwen3_5MoeTextConfig(
        hidden_size=48,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    layer = Qwen3_5MoeGatedDeltaNet(config, 0).to(DEVICE).eval()
    for p in layer.parameters():
        p.copy_(randn(gen, *p.shape, scale=0.3))
    layer.A_log.copy_(torch.linspace(-7, 2.3, 4))  # slow to fast decay, as in rule_inputs
    hidden = randn(gen, 2, 75, 48)
    expected = layer(hidden)
    conv = torch.zeros(3, 3, layer.conv_dim, device=DEVICE)
    rec = torch.zeros(3, 4, 16, 8, device=DEVICE)
    slot_ids = torch.tensor([2, 0], device=DEVICE)
    out = torch.empty_like(expected)
    for row, slot in enumerate(slot_ids.tolist()):  # two prefills each: 40 and 30 tokens
        for part in (slice(0, 40), slice(40, 70)):
            out[row, part] = mixer(layer, hidden[row, part], (conv[slot], rec[slot]))
    for t in range(70, 75):  # both sequences decode together
        out[:, t] = mixer(layer, hidden[:, t], (conv, rec), slot_ids)
    # on CUDA the decode steps run in the Triton kernel (its sums in another order, the device's
    # approximate rsqrt)
    assert_matches(out, expected, 1e-4 if DEVICE.type == "cpu" else 1e-2)


# fla, and the kernels on a GPU at Qwen3.6-35B-A3B's linear layers: H, HV, DK, DV (C = 8,192)

QWEN36 = (16, 32, 128, 128)
QWEN36_CHANNELS = 2 * 16 * 128 + 32 * 128


def test_cpu_tensors_go_to_the_reference_where_fla_is_installed(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fla ran on CPU tensors")

    fla = types.SimpleNamespace(
        chunk_gated_delta_rule=refuse, fused_recurrent_gated_delta_rule=refuse
    )
    monkeypatch.setattr(gdn, "fla_ops", lambda: fla)
    q, k, v, g, beta = (t.cpu() for t in rule_inputs(gen, 9))
    state, ref_state = torch.zeros(4, 16, 8), torch.zeros(4, 16, 8)
    o = gdn.delta_rule_prefill(q, k, v, g, beta, state)
    assert torch.equal(o, gdn.delta_rule_prefill_ref(q, k, v, g, beta, ref_state))
    slots = torch.tensor([0])
    o = gdn.delta_rule_decode(*(t[:1] for t in (q, k, v, g, beta)), state.unsqueeze(0), slots)
    ref = gdn.delta_rule_decode_ref(*(t[:1] for t in (q, k, v, g, beta)), ref_state[None], slots)
    assert torch.equal(o, ref)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or gdn.fla_ops() is None, reason="needs CUDA and fla installed"
)
def test_fp32_prefill_on_cuda_takes_the_fp32_rule_and_bf16_takes_fla(gen, monkeypatch):
    """fla rounds fp32 operands to TF32: an fp32 engine's prefill is the torch rule's, bit for
    bit, and a bf16 one goes to fla."""
    calls = []
    real = gdn.fla_ops()

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return real.chunk_gated_delta_rule(*args, **kwargs)

    monkeypatch.setattr(gdn, "fla_ops", lambda: types.SimpleNamespace(
        chunk_gated_delta_rule=counted))  # fmt: skip
    q, k, v, g, beta = rule_inputs(gen, 70)
    state, ref_state = torch.zeros(4, 16, 8, device=DEVICE), torch.zeros(4, 16, 8, device=DEVICE)
    o = gdn.delta_rule_prefill(q, k, v, g, beta, state)
    assert torch.equal(o, gdn.delta_rule_prefill_ref(q, k, v, g, beta, ref_state))
    assert torch.equal(state, ref_state) and calls == []
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    gdn.delta_rule_prefill(q, k, v, g, beta, state)
    assert calls == [torch.bfloat16]


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or gdn.fla_ops() is None, reason="needs CUDA and fla installed"
)
@pytest.mark.parametrize("tokens", [300, 8192])
def test_fla_matches_the_reference_at_the_qwen36_geometry(gen, tokens):
    heads, v_heads, dk, dv = QWEN36
    q, k, v, g, beta = rule_inputs(gen, tokens, heads, v_heads, dk, dv)
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))  # as the engine's projections give
    start = randn(gen, v_heads, dk, dv, scale=0.1)
    state, ref_state = start.clone(), start.clone()
    o = gdn.delta_rule_prefill_fla(q, k, v, g, beta, state)
    assert_matches(o, gdn.delta_rule_prefill_ref(q, k, v, g, beta, ref_state), 2e-2)
    assert_matches(state, ref_state, 2e-2)

    states = randn(gen, 6, v_heads, dk, dv, scale=0.1)
    ref_states = states.clone()
    slot_ids = torch.tensor([4, 1, 5], device=DEVICE)
    step = [t[:3] for t in (q, k, v, g, beta)]
    o = gdn.delta_rule_decode_fla(*step, states, slot_ids)
    assert_matches(o, gdn.delta_rule_decode_ref(*step, ref_states, slot_ids), 2e-2)
    assert_matches(states, ref_states, 2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_kernel_matches_the_reference_and_fla_at_the_qwen36_geometry(gen, batch):
    """bf16 q, k, v, beta as the engine's projections give them, fp32 states, slots out of
    order: the kernel's outputs and states as the reference's, and as fla's adapter's (where
    installed) on the same inputs, so that the bench's rows time the same work."""
    heads, v_heads, dk, dv = QWEN36
    states = randn(gen, batch + 3, v_heads, dk, dv, scale=0.1)
    ref_states, fla_states = states.clone(), states.clone()
    slot_ids = torch.randperm(batch + 3, generator=gen)[:batch].int().to(DEVICE)
    q, k, v, g, beta = step_inputs(gen, batch, heads, v_heads, dk, dv)
    step = (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16())
    out = gdn.delta_rule_decode_triton(*step, states, slot_ids)
    ref = gdn.delta_rule_decode_ref(*step, ref_states, slot_ids)
    assert_matches(out.float(), ref.float(), 1e-2)  # the output rounded to bf16
    assert_matches(states, ref_states, 1e-4)
    if gdn.fla_ops() is not None:
        fla = gdn.delta_rule_decode_fla(*step, fla_states, slot_ids)
        assert_matches(out.float(), fla.float(), 1e-2)
        assert_matches(states, fla_states, 1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_kernel_replays_in_a_cuda_graph_with_padding_rows(gen):
    """The kernel captured as the engine's decode graphs hold it: a batch of four rows whose
    slot ids are refilled between replays, the rows past the running sequences naming the
    padding slot; replayed with new inputs, other slots and fewer sequences, against the
    reference on the running rows, every slot outside the batch untouched."""
    heads, v_heads, dk, dv = QWEN36
    pad_slot = 6
    states = randn(gen, pad_slot + 2, v_heads, dk, dv, scale=0.1)  # a checkpoint row after it
    step = [t.clone() for t in step_inputs(gen, 4, heads, v_heads, dk, dv)]
    slot_ids = torch.tensor([1, 4, 0, 5], dtype=torch.int64, device=DEVICE)
    gdn.delta_rule_decode_triton(*step, states, slot_ids)  # compiles outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn.delta_rule_decode_triton(*step, states, slot_ids)
    for ids in ([3, 0, 5, pad_slot], [5, 2, pad_slot, pad_slot]):
        for captured, new in zip(step, step_inputs(gen, 4, heads, v_heads, dk, dv), strict=True):
            captured.copy_(new)
        slot_ids.copy_(torch.tensor(ids))
        running = ids.index(pad_slot)
        ref_states = states.clone()
        ref = gdn.delta_rule_decode_ref(
            *(t[:running] for t in step), ref_states, slot_ids[:running]
        )
        graph.replay()
        assert_matches(out[:running], ref, 1e-4)
        others = [s for s in range(pad_slot + 2) if s not in ids]
        assert torch.equal(states[others], ref_states[others]), "a slot outside the batch moved"
        assert_matches(states[slot_ids[:running]], ref_states[slot_ids[:running]], 1e-4)
        assert torch.isfinite(states[pad_slot]).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 300, 8192])
def test_conv_prefill_kernel_matches_the_reference_at_the_qwen36_geometry(gen, tokens):
    x, weight, _, start = (
        t.bfloat16() for t in conv_inputs(gen, tokens, QWEN36_CHANNELS, 4)
    )  # bf16 as the engine's projections and pools hold them
    state, ref_state = start.clone(), start.clone()
    out = gdn.causal_conv_prefill(x, weight, state)
    ref = gdn.causal_conv_prefill_ref(x.float(), weight.float(), ref_state.float())
    assert_matches(out.float(), ref, 1e-2)
    assert torch.equal(state, ref_state.bfloat16())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_step_replays_in_a_cuda_graph_at_the_qwen36_geometry(gen, monkeypatch):
    """The linear layer's decode math as the engine captures it: the convolution from the conv
    pool, the delta rule from the recurrent pool, both kernels by slot ids in a device tensor
    (never fla's gather and write-back); replayed with new inputs and other slots, against the
    references."""

    def refuse(*args, **kwargs):
        raise AssertionError("the decode step went through fla's adapter")

    monkeypatch.setattr(gdn, "delta_rule_decode_fla", refuse)
    heads, v_heads, dk, dv = QWEN36
    key_dim = heads * dk
    weight = randn(gen, QWEN36_CHANNELS, 4, dtype=torch.bfloat16)
    conv = randn(gen, 9, 3, QWEN36_CHANNELS, dtype=torch.bfloat16)
    rec = randn(gen, 9, v_heads, dk, dv, scale=0.1)
    mixed = randn(gen, 3, QWEN36_CHANNELS, dtype=torch.bfloat16)
    _, _, _, g, beta = rule_inputs(gen, 3, heads, v_heads, dk, dv)
    beta = beta.bfloat16()
    slot_ids = torch.tensor([7, 2, 4], dtype=torch.int32, device=DEVICE)

    def step(pools, conv_fn, rule_fn):
        out = conv_fn(mixed, weight, pools[0], slot_ids)
        q, k, v = out.split([key_dim, key_dim, v_heads * dv], dim=-1)
        q, k = (t.unflatten(-1, (heads, dk)) for t in (q, k))
        return rule_fn(q, k, v.unflatten(-1, (v_heads, dv)), g, beta, pools[1], slot_ids)

    step((conv, rec), gdn.causal_conv_decode, gdn.delta_rule_decode)  # compiles outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step((conv, rec), gdn.causal_conv_decode, gdn.delta_rule_decode)
    for ids in ([0, 5, 8], [8, 5, 0]):  # new inputs and slots in the captured tensors
        mixed.copy_(randn(gen, 3, QWEN36_CHANNELS, dtype=torch.bfloat16))
        g.copy_(rule_inputs(gen, 3, heads, v_heads, dk, dv)[3])
        slot_ids.copy_(torch.tensor(ids))
        ref_pools = (conv.clone(), rec.clone())
        graph.replay()
        ref = step(ref_pools, gdn.causal_conv_decode_ref, gdn.delta_rule_decode_ref)
        assert_matches(out, ref, 2e-2)
        assert torch.equal(conv, ref_pools[0])
        assert_matches(rec, ref_pools[1], 2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gated_norm_kernel_rounds_as_the_reference_on_cuda(gen):
    """At Qwen3.6-35B-A3B's heads (32 of 128) in bf16, the gate a view of the projections'
    output: within one bf16 unit of the reference everywhere, nearly all elements equal."""
    _, v_heads, _, dv = QWEN36
    x = randn(gen, 8, v_heads, dv, scale=2.0, dtype=torch.bfloat16)
    z = randn(gen, 8, 3 * v_heads * dv, dtype=torch.bfloat16)[:, v_heads * dv : 2 * v_heads * dv]
    z = z.unflatten(-1, (v_heads, dv))
    weight = randn(gen, dv, dtype=torch.bfloat16)
    out = gdn.gated_rmsnorm(x, z, weight, 1e-6)
    ref = gdn.gated_rmsnorm_ref(x, z, weight, 1e-6)
    assert_matches(out, ref, 2**-7)
    assert (out == ref).float().mean().item() > 0.95


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gated_decode_step_replays_in_a_cuda_graph(gen):
    """The decode step from the gates' projections as the engine captures it, at Qwen3.6's
    geometry with bf16 a and b: replayed with new projections, against decay_and_beta and the
    reference step."""
    heads, v_heads, dk, dv = QWEN36
    states = randn(gen, 4, v_heads, dk, dv, scale=0.1)
    slot_ids = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    q, k, v, _, _ = step_inputs(gen, 2, heads, v_heads, dk, dv)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    a = randn(gen, 2, v_heads, scale=4.0, dtype=torch.bfloat16)
    b = randn(gen, 2, v_heads, scale=2.0, dtype=torch.bfloat16)
    a_log, dt_bias = randn(gen, v_heads, scale=0.5), randn(gen, v_heads, dtype=torch.bfloat16)

    def step(pool):
        return gdn.gated_delta_rule_decode(q, k, v, a, b, a_log, dt_bias, pool, slot_ids)

    step(states.clone())  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(states)
    for _ in range(2):
        a.copy_(randn(gen, 2, v_heads, scale=4.0, dtype=torch.bfloat16))
        b.copy_(randn(gen, 2, v_heads, scale=2.0, dtype=torch.bfloat16))
        ref_states = states.clone()
        graph.replay()
        g, beta = gdn.decay_and_beta(a, b, a_log, dt_bias)
        ref = gdn.delta_rule_decode_ref(q, k, v, g, beta, ref_states, slot_ids)
        assert_matches(out.float(), ref.float(), 2e-2)
        assert_matches(states, ref_states, 1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or gdn.fla_ops() is None, reason="needs CUDA and fla installed"
)
def test_flas_convolution_computes_what_the_bench_compares_it_with(gen):
    """fla's convolution in its own layout (W inputs per sequence as [N, C, W], the oldest
    unused) gives the reference's outputs and states, so its bench rows time the same work."""
    from fla.modules import causal_conv1d as fla_conv

    x, weight, _, start = (t.bfloat16() for t in conv_inputs(gen, 300, QWEN36_CHANNELS, 4))
    ref_state = start.clone()
    ref = gdn.causal_conv_prefill_ref(x, weight, ref_state)
    initial = torch.cat([torch.zeros_like(start[:1]), start]).t().unsqueeze(0).contiguous()
    out, final = fla_conv.causal_conv1d(
        x.unsqueeze(0), weight, initial_state=initial, output_final_state=True, activation="silu"
    )
    assert_matches(out[0], ref, 1e-2)
    assert torch.equal(final[0].t()[1:], ref_state)
    xs, cache = randn(gen, 3, QWEN36_CHANNELS, dtype=torch.bfloat16), final.repeat(3, 1, 1)
    states = cache.transpose(1, 2)[:, 1:].contiguous()
    ref = gdn.causal_conv_decode_ref(xs, weight, states, torch.arange(3, device=DEVICE))
    out, cache = fla_conv.causal_conv1d_update(xs, cache, weight=weight, activation="silu")
    assert_matches(out, ref, 1e-2)
    assert torch.equal(cache.transpose(1, 2)[:, 1:], states)
