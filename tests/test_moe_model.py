"""Mixture-of-experts models through every way in that describes a model: ``model.hf`` configs (shipped and local),
the main job's keys and their checks, the Megatron-LM flags it launches with, and the sweep (which refuses them)."""

import functools
import json

import pytest

from megatron_tp_overlap.app.config import model_provenance, resolve_model, validate
from megatron_tp_overlap.app.train import compose, megatron_args, model_line
from megatron_tp_overlap.integrations.megatron.gpt import megatron_argv, moe_argv
from megatron_tp_overlap.models import ModelDims, load_model_dims
from megatron_tp_overlap.tools.sweep import plan_tp_sizes

pytest.importorskip("transformers")


@functools.cache
def composed(group: str):
    """``model=group`` composed once (Hydra's compose takes ~0.2 s); :func:`merged` merges overrides onto it."""
    return compose([f"model={group}", *(["model.hf=Qwen/Qwen3-30B-A3B"] if group == "hf" else [])])


def merged(group, *overrides):
    from omegaconf import OmegaConf

    return OmegaConf.merge(composed(group), OmegaConf.from_dotlist(list(overrides)))


@pytest.mark.parametrize(
    "name, dense, moe",
    [
        # (hidden, dense ffn, heads, kv, head dim, layers, vocab), (experts, top-k, expert ffn, shared ffn, MoE layers)
        ("Qwen/Qwen3-30B-A3B", (2048, 6144, 32, 4, 128, 48, 151936), (128, 8, 768, None, range(48))),
        ("Qwen/Qwen3-235B-A22B", (4096, 12288, 64, 4, 128, 94, 151936), (128, 8, 1536, None, range(94))),
        ("mistralai/Mixtral-8x7B-v0.1", (4096, 14336, 32, 8, 128, 32, 32000), (8, 2, 14336, None, range(32))),
        ("mistralai/Mixtral-8x22B-v0.1", (6144, 16384, 48, 8, 128, 56, 32000), (8, 2, 16384, None, range(56))),
        ("openai/gpt-oss-20b", (2880, 2880, 64, 8, 64, 24, 201088), (32, 4, 2880, None, range(24))),
        ("openai/gpt-oss-120b", (2880, 2880, 64, 8, 64, 36, 201088), (128, 4, 2880, None, range(36))),
        ("meta-llama/Llama-4-Scout-17B-16E", (5120, 16384, 40, 8, 128, 48, 202048), (16, 1, 8192, 8192, range(48))),
        (
            "meta-llama/Llama-4-Maverick-17B-128E",
            (5120, 16384, 40, 8, 128, 48, 202048),
            (128, 1, 8192, 8192, range(1, 48, 2)),
        ),
    ],
)
def test_shipped_moe_configs_give_their_moe_dims(name, dense, moe):
    d = load_model_dims(name)
    assert (d.hidden, d.ffn, d.heads, d.kv_heads, d.head_dim, d.layers, d.vocab) == dense
    assert (d.num_experts, d.moe_topk, d.moe_ffn, d.shared_expert_ffn, d.moe_layers) == (*moe[:4], list(moe[4]))


def write(tmp_path, **cfg):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


BASE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=100)


def test_mixtral_and_qwen3_moe_configs_never_give_a_dense_model(tmp_path):
    d = load_model_dims(write(tmp_path / "m", model_type="mixtral", intermediate_size=512, num_local_experts=4, **BASE))
    assert (d.is_moe, d.num_experts, d.moe_topk, d.moe_ffn, d.moe_layer_freq) == (True, 4, 2, 512, 1)
    q = dict(model_type="qwen3_moe", intermediate_size=1024, moe_intermediate_size=128, num_experts=8)
    d = load_model_dims(write(tmp_path / "q", **q, num_experts_per_tok=2, mlp_only_layers=[0], **BASE))
    assert (d.num_experts, d.moe_topk, d.moe_ffn, d.ffn, d.moe_layers) == (8, 2, 128, 1024, [1, 2, 3])
    assert "qk-norm" in d.not_reproduced
    d = load_model_dims(write(tmp_path / "s", **q, decoder_sparse_step=2, **BASE))  # layers 1 and 3
    assert d.moe_layer_freq == (0, 1, 0, 1)
    q2 = dict(q, model_type="qwen2_moe", shared_expert_intermediate_size=512)
    assert load_model_dims(write(tmp_path / "q2", **q2, **BASE)).shared_expert_ffn == 512


@pytest.mark.parametrize(
    "cfg, needles",
    [
        (
            dict(model_type="deepseek_v3", q_lora_rank=64, kv_lora_rank=32, num_nextn_predict_layers=1),
            ("'deepseek_v3'", "multi-latent attention (q_lora_rank=64, kv_lora_rank=32)", "multi-token prediction"),
        ),
        (dict(model_type="olmoe", num_experts=8), ("'olmoe'", "mixture-of-experts structure", "num_experts=8")),
        (
            dict(model_type="qwen3", layer_types=["linear_attention", "full_attention"] * 2),
            ("'qwen3'", "not attention (layer_types: linear_attention)"),
        ),
    ],
)
def test_what_cannot_be_built_is_refused_in_one_line(tmp_path, cfg, needles):
    path = write(tmp_path, intermediate_size=512, **BASE, **cfg)
    with pytest.raises(ValueError) as e:
        load_model_dims(path)
    assert "\n" not in str(e.value) and "no dense stand-in" in str(e.value)
    assert all(n in str(e.value) for n in needles), str(e.value)
    (p,) = validate(merged("hf", f"model.hf={path}"), 2)
    assert p.startswith("model.hf = ") and needles[0] in p


def test_the_main_job_takes_an_moe_hf_model_and_says_what_it_leaves_out():
    c = merged("hf", "model.hf=meta-llama/Llama-4-Maverick-17B-128E", "model.num_layers=4")
    m = resolve_model(c.model)  # the first 4 layers of the 48: dense, MoE, dense, MoE
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.ffn_hidden_size) == (128, 1, 8192, 16384)
    assert (m.moe_shared_expert_intermediate_size, m.moe_layer_freq) == (8192, [0, 1, 0, 1])
    assert all(validate(c, n) == [] for n in (2, 4, 8))
    model = model_provenance(c.model)
    assert "MoE on layers [1, 3]: 128 experts, top-1" in model_line(model)
    assert "chunked attention (8192) and NoPE layers" in model["not_reproduced"]
    argv = megatron_args(c, 4)
    assert argv[argv.index("--moe-layer-freq") + 1] == "[0,1,0,1]" and "--moe-router-pre-softmax" in argv
    oss = model_provenance(merged("hf", "model.hf=openai/gpt-oss-20b").model)
    assert {"attention sinks", "sliding-window attention (window 128) on alternate layers"} <= set(
        oss["not_reproduced"]
    )


def flag_values(argv):
    return {a: (b if not b.startswith("--") else True) for a, b in zip(argv, argv[1:] + ["--"]) if a.startswith("--")}


def test_megatron_argv_emits_megatrons_moe_flags():
    dense = dict(num_layers=4, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16, num_query_groups=8)
    run = dict(seq_length=4096, vocab_size=32000, tp=2, pp=1, sequence_parallel=True, micro_batch_size=1)
    run |= dict(global_batch_size=8, train_iters=10, precision="fp8")
    moe = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816)
    moe |= dict(moe_layer_freq=[0, 1, 1, 1], moe_router_enable_expert_bias=True, ep=2)
    moe |= dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-3)
    f = flag_values(megatron_argv(**dense, **run, moe=moe))
    assert {k: f[k] for k in f if "moe" in k or "expert" in k} == {
        "--num-experts": "8",
        "--moe-router-topk": "2",
        "--moe-ffn-hidden-size": "1408",
        "--moe-shared-expert-intermediate-size": "2816",
        "--moe-layer-freq": "[0,1,1,1]",
        "--moe-router-score-function": "sigmoid",  # expert bias: Megatron allows sigmoid / sqrtsoftplus only
        "--moe-router-enable-expert-bias": True,
        "--moe-router-load-balancing-type": "global_aux_loss",
        "--moe-aux-loss-coeff": "0.001",
        "--moe-grouped-gemm": True,
        "--moe-token-dispatcher-type": "alltoall",
        "--expert-model-parallel-size": "2",
        "--moe-router-padding-for-quantization": True,  # FP8
    }
    assert "--sequence-parallel" in f and not any("moe" in a for a in megatron_argv(**dense, **run))
    with pytest.raises(ValueError, match="moe_router_topk = 9: must be between 1 and num_experts = 8"):
        moe_argv(**dict(moe, moe_router_topk=9))
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        moe_argv(**moe, tp=2, sequence_parallel=False)
    with pytest.raises(ValueError, match="expert bias needs the sigmoid"):
        moe_argv(**dict(moe, moe_router_score_function="softmax"))


def test_the_moe_preset_validates_at_every_node_size():
    c = compose(["model=moe_small"])
    assert all(validate(c, n) == [] for n in (2, 4, 8))
    f = flag_values(megatron_args(c, 8))
    assert (f["--num-experts"], f["--moe-shared-expert-intermediate-size"], f["--moe-router-enable-expert-bias"]) == (
        "8",
        "2816",
        True,
    )


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["model.moe_router_topk=9"], 2, "model.moe_router_topk = 9: must be between 1 and model.num_experts = 8"),
        (["parallel.ep=3"], 6, "parallel.ep = 3: must divide model.num_experts = 8"),
        (["parallel.tp=2", "parallel.ep=4"], 4, "parallel.tp x parallel.ep x parallel.pp = 8 must divide"),
        (
            ["parallel.sequence_parallel=false", "tp_overlap.mode=off"],
            2,
            "MoE model with parallel.tp > 1 needs sequence",
        ),
        (["model.moe_router_score_function=softmax"], 2, "expert bias (aux-loss-free balancing) needs"),
        (["model.num_layers=8"], 2, "model.moe_layer_freq = [0, 1, 1, 1]: a per-layer pattern must have one"),
        (["model.moe_layer_freq=[0,0,0,0]"], 2, "names no MoE layer"),
        (["model.moe_ffn_hidden_size=1004"], 8, "model.moe_ffn_hidden_size = 1004: must be >= 1 and divisible by"),
        (["model.moe_token_dispatcher_type=flex"], 2, "must be one of alltoall, allgather"),
        (["model.moe_token_dispatcher_type=allgather", "training.precision=fp8"], 2, "FP8 expert GEMMs need"),
        (["model.moe_router_load_balancing_type=aux"], 2, "must be one of aux_loss, seq_aux_loss, global_aux_loss"),
    ],
)
def test_moe_rules_are_one_line_each_before_any_gpu_work(overrides, world, needle):
    problems = validate(merged("moe_small", *overrides), world)
    assert any(needle in p for p in problems), problems


def test_moe_keys_on_a_dense_model_name_what_they_need():
    problems = validate(merged("gpt_small", "model.moe_router_topk=2", "parallel.ep=2"), 4)
    assert problems == [
        "model.moe_router_topk = 2: needs model.num_experts (a mixture-of-experts model)",
        "parallel.ep = 2: needs model.num_experts (a mixture-of-experts model)",
    ]


def test_sweep_refuses_moe_models_in_one_line():
    for d in (load_model_dims("Qwen/Qwen3-30B-A3B"), ModelDims("x", 1024, 4096, 16, 8, 64, 2, 1, True, num_experts=8)):
        with pytest.raises(ValueError, match="mixture-of-experts model .* is not timed as dense layers") as e:
            plan_tp_sizes(d, 8, 8, 8192)
        assert "\n" not in str(e.value)
