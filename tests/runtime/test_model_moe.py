"""Sparse MoE: the layer (routing against transformers' routers, grouped experts against a
per-token loop, weight folding) and the Qwen3-MoE and Mixtral families against transformers,
one of them through the Engine with chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from arborlm.errors import ModelLoadError
from arborlm.kernels.cpu_ops import LayerOps, layer_ops
from arborlm.runtime.layers.mlp import GatedMLP
from arborlm.runtime.layers.moe import (
    DOWN,
    GATE,
    UP,
    FusedMoE,
    SparseMoeBlock,
    TopKRouting,
    fold_expert_weights,
    grouped_experts,
    select_experts,
)
from arborlm.runtime.models.mixtral import MixtralForCausalLM
from arborlm.runtime.models.qwen3_moe import QWEN3_MOE_EXPERTS, Qwen3MoeForCausalLM
from tests.runtime.family_helpers import (
    TINY,
    check_greedy,
    check_prompt_logits,
    load_ours,
    tiny_checkpoint,
)

CPU = torch.device("cpu")
OPS = {"torch": LayerOps(), "native": layer_ops(CPU)}
MOE = dict(num_experts=4, num_experts_per_tok=2)

# ---------------------------------------------------------------- the layer


def hf_block(model_type: str, **config):
    """transformers' sparse block of `model_type` with random float32 weights (router included)."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = AutoConfig.for_model(model_type, **{**TINY, **config})
    block = {"qwen3_moe": Qwen3MoeSparseMoeBlock, "mixtral": MixtralSparseMoeBlock}[model_type](hf_config)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.1)
    return block.eval()


def our_block(hf, renormalize: bool, ops: LayerOps) -> SparseMoeBlock:
    experts = hf.experts
    num_experts, hidden = experts.down_proj.shape[:2]
    inter = experts.down_proj.shape[2]
    block = SparseMoeBlock(hidden, inter, num_experts, hf.gate.top_k, renormalize, torch.float32, CPU, ops)
    block.gate.weight.data.copy_(hf.gate.weight)
    block.experts.gate_up_proj.data.copy_(experts.gate_up_proj)
    block.experts.down_proj.data.copy_(experts.down_proj)
    return block


BLOCKS = [  # (model_type, config, renormalize)
    ("qwen3_moe", dict(**MOE, moe_intermediate_size=48, norm_topk_prob=False), False),
    ("qwen3_moe", dict(**MOE, moe_intermediate_size=48, norm_topk_prob=True), True),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), True),
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=3), True),
]


@pytest.mark.parametrize("model_type, config, renormalize", BLOCKS)
def test_router_top_k_matches_transformers(model_type, config, renormalize):
    hf = hf_block(model_type, **config)
    ours = our_block(hf, renormalize, LayerOps())
    x = torch.randn(300, TINY["hidden_size"])
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
    routing = ours.route(x)
    assert torch.equal(routing.ids, hf_ids)
    torch.testing.assert_close(routing.weights, hf_weights.float(), atol=1e-6, rtol=0)


def test_router_ties_break_as_transformers():
    """A zero router gives every expert the same probability: the ids are torch.topk's, as
    transformers'."""
    hf = hf_block("qwen3_moe", **MOE, moe_intermediate_size=48)
    hf.gate.weight.data.zero_()
    ours = our_block(hf, False, LayerOps())
    x = torch.randn(16, TINY["hidden_size"])
    with torch.no_grad():
        hf_ids = hf.gate(x)[2]
    assert torch.equal(ours.route(x).ids, hf_ids)


@pytest.mark.parametrize("model_type, config, renormalize", BLOCKS)
@pytest.mark.parametrize("ops", list(OPS), ids=str)
def test_sparse_block_matches_transformers(model_type, config, renormalize, ops):
    hf = hf_block(model_type, **config)
    x = torch.randn(37, TINY["hidden_size"])
    with torch.no_grad():
        expected = hf(x.unsqueeze(0))[0]
    torch.testing.assert_close(our_block(hf, renormalize, OPS[ops])(x), expected, atol=1e-5, rtol=0)


def naive_experts(x, gate_up, down, routing: TopKRouting) -> torch.Tensor:
    """Token by token, expert by expert: the definition the grouped path must equal."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, expert in zip(routing.weights[t].tolist(), routing.ids[t].tolist()):
            gate, up = (gate_up[expert] @ x[t]).chunk(2)
            out[t] += weight * (down[expert] @ (F.silu(gate) * up))
    return out


GROUPED = [  # (num_tokens, num_experts, top_k)
    (1, 4, 2),  # one decode token
    (23, 4, 2),
    (40, 8, 3),
    (5, 16, 2),  # most experts get no token
    (0, 4, 2),  # an empty step
]


@pytest.mark.parametrize("num_tokens, num_experts, top_k", GROUPED)
@pytest.mark.parametrize("ops", list(OPS), ids=str)
def test_grouped_experts_equal_a_per_token_loop(num_tokens, num_experts, top_k, ops):
    torch.manual_seed(2)
    hidden, inter = 32, 24
    x = torch.randn(num_tokens, hidden)
    gate_up = torch.randn(num_experts, 2 * inter, hidden) * 0.2
    down = torch.randn(num_experts, hidden, inter) * 0.2
    routing = select_experts(torch.randn(num_tokens, num_experts), top_k, renormalize=True)
    got = grouped_experts(x, gate_up, down, routing, OPS[ops])
    assert got.shape == (num_tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, naive_experts(x, gate_up, down, routing), atol=1e-5, rtol=0)


def test_grouped_experts_in_bfloat16_keep_the_dtype():
    torch.manual_seed(3)
    x = torch.randn(9, 32)
    gate_up, down = torch.randn(4, 48, 32) * 0.2, torch.randn(4, 32, 24) * 0.2
    routing = select_experts(torch.randn(9, 4), 2, renormalize=False)
    got = grouped_experts(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), routing, OPS["native"])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), naive_experts(x, gate_up, down, routing), atol=0.05, rtol=0.05)


class _Holder(torch.nn.Module):
    """A model whose one sparse block sits at `layers.0.mlp`."""

    def __init__(self, num_experts=2):
        super().__init__()
        mlp = torch.nn.Module()
        mlp.experts = FusedMoE(num_experts, 4, 3, torch.float32, CPU, LayerOps())
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].mlp = mlp


def expert_weights(num_experts=2, skip=()):
    names = {GATE: ("gate_proj", (3, 4)), UP: ("up_proj", (3, 4)), DOWN: ("down_proj", (4, 3))}
    for e in range(num_experts):
        for shard, (proj, shape) in names.items():
            if (e, shard) not in skip:
                yield f"layers.0.mlp.experts.{e}.{proj}.weight", torch.full(shape, 10.0 * e + len(proj))


def test_fold_stacks_experts_and_yields_each_stacked_weight_once_complete():
    model = _Holder()
    passed = list(fold_expert_weights(model, [("other.weight", torch.ones(1)), *expert_weights()], QWEN3_MOE_EXPERTS))
    experts = model.layers[0].mlp.experts
    assert [name for name, _ in passed] == [
        "other.weight", "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
    ]
    assert passed[1][1].data_ptr() == experts.gate_up_proj.data_ptr()  # the parameter itself, no copy
    assert torch.equal(experts.gate_up_proj[1, :3], torch.full((3, 4), 19.0))  # expert 1's gate_proj
    assert torch.equal(experts.gate_up_proj[1, 3:], torch.full((3, 4), 17.0))  # its up_proj
    assert torch.equal(experts.down_proj[0], torch.full((4, 3), 9.0))


def test_fold_leaves_an_incomplete_stacked_weight_out():
    passed = list(fold_expert_weights(_Holder(), expert_weights(skip={(1, UP)}), QWEN3_MOE_EXPERTS))
    assert [name for name, _ in passed] == ["layers.0.mlp.experts.down_proj"]


@pytest.mark.parametrize("name, shape, match", [
    ("layers.0.mlp.experts.2.gate_proj.weight", (3, 4), "expert 2 out of range"),
    ("layers.0.mlp.experts.0.gate_proj.weight", (4, 4), "has shape"),
    ("layers.0.mlp.experts.0.fc1.weight", (3, 4), "unexpected expert weight"),
    ("layers.1.mlp.experts.0.gate_proj.weight", (3, 4), "no sparse MoE layer"),
])
def test_fold_refuses_bad_expert_weights(name, shape, match):
    with pytest.raises(ModelLoadError, match=match):
        list(fold_expert_weights(_Holder(), [(name, torch.zeros(shape))], QWEN3_MOE_EXPERTS))


# ---------------------------------------------------------------- the families

FAMILIES = {  # name -> (model_type, config on top of TINY, which layers are sparse)
    # Layer 1 dense (mlp_only_layers), the others sparse; top-k weights not renormalised.
    "qwen3_moe_mixed": (
        "qwen3_moe",
        dict(**MOE, num_hidden_layers=4, moe_intermediate_size=48, mlp_only_layers=[1], head_dim=32),
        [True, False, True, True],
    ),
    # Every second layer sparse, renormalised top-k, tied head.
    "qwen3_moe_step2_tied": (
        "qwen3_moe",
        dict(**MOE, num_hidden_layers=4, moe_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=True,
             tie_word_embeddings=True),
        [False, True, False, True],
    ),
    "mixtral_window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4), [True, True]),
    "mixtral_tied": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True), [True, True]),
}
CLASSES = {"qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_checkpoint(request, tmp_path_factory):
    model_type, config, sparse = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return folder, tiny_checkpoint(folder, model_type, **config), sparse


def test_loads_with_the_configured_layer_pattern(moe_checkpoint):
    folder, reference, sparse = moe_checkpoint
    config = reference.config
    loaded = load_ours(folder)
    assert type(loaded.model) is CLASSES[config.model_type]
    layers = loaded.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == sparse
    assert all(isinstance(layer.mlp, GatedMLP) for layer, s in zip(layers, sparse) if not s)
    renormalize = config.model_type == "mixtral" or config.norm_topk_prob
    assert all(layer.mlp.renormalize == renormalize for layer, s in zip(layers, sparse) if s)
    windows = [layer.self_attn.attn.sliding_window for layer in layers]
    assert windows == [config.sliding_window] * len(layers)
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert tied == config.tie_word_embeddings


def test_prompt_logits_match_transformers(moe_checkpoint):
    folder, reference, _ = moe_checkpoint
    check_prompt_logits(folder, reference)


def test_greedy_tokens_match_transformers(moe_checkpoint):
    folder, reference, _ = moe_checkpoint
    check_greedy(folder, reference)


def test_a_missing_expert_weight_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_checkpoint(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.1.mlp.experts.gate_up_proj"):
        load_ours(tmp_path)


# ---------------------------------------------------------------- through the Engine

ENGINE_PROMPTS = [
    "The experts of a sparse layer each see only the tokens that the router sends them, so",
    "Short one",
]


@pytest.fixture(scope="module")
def moe_engine_dir(tmp_path_factory, smollm_dir):
    """A tiny Qwen3-MoE with SmolLM2's tokenizer (its vocabulary size)."""
    from tests.conftest import TOKENIZER_FILES

    folder = tmp_path_factory.mktemp("qwen3_moe_engine")
    reference = tiny_checkpoint(
        folder, "qwen3_moe", **FAMILIES["qwen3_moe_mixed"][1], vocab_size=49152,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    for name in TOKENIZER_FILES:
        if (smollm_dir / name).is_file():
            (folder / name).write_bytes((smollm_dir / name).read_bytes())
    return folder, reference


@pytest.fixture(scope="module")
def moe_engine(moe_engine_dir):
    import arborlm

    engine = arborlm.Engine(
        model=str(moe_engine_dir[0]), dtype="float32", max_total_tokens=4096, chunked_prefill_size=8,
        enable_cache_report=True, random_seed=1234, log_level="warning",
    )
    yield engine
    engine.shutdown()


def _check_pools_back(engine) -> None:
    deadline = time.monotonic() + 10
    while True:
        info = engine.get_server_info(check_invariants=True)
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["free_req_rows"] == info["total_req_rows"]
    assert info["free_kv_tokens"] + info["cached_kv_tokens"] == info["max_total_tokens"]


def test_engine_greedy_with_chunked_prefill_and_a_cache_hit(moe_engine, moe_engine_dir):
    from tests.runtime.scheduler_helpers import reference_greedy

    _, reference = moe_engine_dir
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ids = [moe_engine.tokenizer.encode(p, add_special_tokens=False) for p in ENGINE_PROMPTS]
    assert len(ids[0]) > 2 * 8  # the long prompt is prefilled in several chunks
    first = moe_engine.generate(ENGINE_PROMPTS, params)  # the short one decodes beside the chunks
    again = moe_engine.generate(ENGINE_PROMPTS[0], params)
    with torch.no_grad():
        expected = [reference_greedy(reference, prompt, 12) for prompt in ids]
    assert [out["output_ids"] for out in first] == expected
    assert again["output_ids"] == expected[0]
    assert again["meta_info"]["cached_tokens"] >= len(ids[0]) - 1
    _check_pools_back(moe_engine)
