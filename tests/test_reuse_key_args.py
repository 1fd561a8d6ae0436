"""The reuse key against every argument of Megatron-LM's own parser: an argument that changes what the TE layers
compute or communicate (a shape field of the ``TransformerConfig`` Megatron builds from the arguments, the sequence
length, the micro-batch size) must change the key; else a run would reuse a config tuned for other GEMMs.

Each argument is changed alone from a TP=2 GPT base (a flag flipped, a number doubled, another choice); Megatron's
``validate_args`` and ``core_transformer_config_from_args`` turn it into the config, as in a run. Where megatron.training
imports (the GPU machine's stack; megatron-core 0.19 needs Python >= 3.12, so CPU CI skips this). Set
``REUSE_KEY_REPORT=path.json`` to keep what every argument did.
"""

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import sys

import pytest

pytest.importorskip("megatron.training.arguments")

from megatron_tp_overlap.integrations.megatron.flags import add_arguments  # noqa: E402
from megatron_tp_overlap.integrations.megatron.run_shape import RunShape  # noqa: E402

BASE = (
    "--num-layers 2 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 --tensor-model-parallel-size 2 "
    "--sequence-parallel --bf16 --tp-comm-overlap --transformer-impl transformer_engine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 32000 --lr 1e-4 --train-iters 10"
).split()

# TransformerConfig fields that decide the TE layers' GEMM shapes, dtypes and TP communication (found by name, so a
# field Megatron adds later is covered when its name says what it is)
SHAPE_FIELD = re.compile(
    r"hidden_size|ffn|attention_heads|query_groups|kv_channels|gated_linear_unit|tensor_model_parallel|"
    r"context_parallel|sequence_parallel|^fp8$|^fp8_recipe$|^fp4$|^fp4_recipe$|params_dtype|^bf16$|^fp16$|tp_comm|"
    r"first_last_layers_bf16|layers_at_(start|end)_in_bf16|num_moe_experts|^moe_ffn|^moe_shared_expert_intermediate|"
    r"^moe_router_topk$|^moe_layer_freq$|^moe_shared_expert_overlap$"
)
# what the key holds some other way, or what changes no GEMM shape or communication; the reason is the rule
COVERED_ELSEWHERE = {
    "mup_base_hidden_size": "muP's scaling base, not a layer's width",
    "tp_comm_split_ag": "read only for TE < 1.5 (megatron/core/extensions/transformer_engine.py); TE 2 takes _ag",
    "tp_comm_split_rs": "read only for TE < 1.5 (megatron/core/extensions/transformer_engine.py); TE 2 takes _rs",
    "tp_comm_overlap": "required (a run without it does not tune)",
    "tp_comm_overlap_cfg": "the starting config: the key's `reference` is its digest",
    "tp_comm_bootstrap_backend": "how userbuffers exchange handles at init, not what the GEMMs carry",
    "tp_comm_overlap_ag": "the key's `space` names the GEMMs the built modules overlap",
    "tp_comm_overlap_rs": "the key's `space` names the GEMMs the built modules overlap",
    "tp_comm_bulk_dgrad": "the key's `space` names the GEMMs the built modules overlap",
    "tp_comm_bulk_wgrad": "the key's `space` names the GEMMs the built modules overlap",
    "tp_comm_overlap_disable_qkv": "the key's `space` names the GEMMs the built modules overlap",
    "tp_comm_overlap_disable_fc1": "the key's `space` names the GEMMs the built modules overlap",
}


def _variants(action: argparse.Action) -> list[list[str]]:
    """The argument changed alone: flipped, doubled, or another of its choices."""
    flag = next((o for o in action.option_strings if o.startswith("--")), None)
    if flag is None or action.dest in ("help",):
        return []
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return [[flag]]
    if action.choices:
        return [[flag, str(c)] for c in action.choices if c != action.default][:3]
    if action.type in (int, float) and action.nargs in (None, "?"):
        d = action.default
        return [[flag, str(2 * d if d else 2)], [flag, str(3 * d if d else 3)]]
    return []


def _config(argv: list[str]):
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_args, validate_args

    old = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse_args(extra_args_provider=add_arguments)
            validate_args(args)
            cfg = core_transformer_config_from_args(args)
    finally:
        sys.argv = old
    return args, cfg


# fields that mean nothing while another is off: a recipe of a format not in use, edge layer counts without
# --first-last-layers-bf16
ONLY_WITH = {
    "fp8_recipe": "fp8",
    "fp4_recipe": "fp4",
    "num_layers_at_start_in_bf16": "first_last_layers_bf16",
    "num_layers_at_end_in_bf16": "first_last_layers_bf16",
}


def _signature(args, cfg) -> dict:
    def relevant(name: str) -> bool:
        return bool(SHAPE_FIELD.search(name)) and (name not in ONLY_WITH or bool(getattr(cfg, ONLY_WITH[name], None)))

    sig = {f.name: repr(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if relevant(f.name)}
    sig.update(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
    return sig


def _key(args):
    return RunShape.from_args(args).key("gpu", "te", "reference", "space")


def test_every_argument_that_changes_the_gemms_changes_the_reuse_key(monkeypatch):
    from megatron.training.arguments import add_megatron_arguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    base_args, base_cfg = _config(BASE)
    base_sig, base_key = _signature(base_args, base_cfg), _key(base_args)
    parser = add_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    tried, invalid, missing, covered = 0, 0, [], []
    for action in parser._actions:
        for change in _variants(action):
            argv = BASE + change
            try:
                args, cfg = _config(argv)
            except BaseException:  # noqa: BLE001 - an invalid combination (Megatron refuses it): not a run
                invalid += 1
                continue
            tried += 1
            sig = _signature(args, cfg)
            changed = sorted(k for k in set(sig) | set(base_sig) if sig.get(k) != base_sig.get(k))
            if not changed:
                continue
            try:
                same_key = _key(args) == base_key
            except Exception as e:  # noqa: BLE001
                missing.append({"change": change, "fields": changed, "key": f"{type(e).__name__}: {e}"})
                continue
            uncovered = [f for f in changed if f not in COVERED_ELSEWHERE]
            if same_key and uncovered:
                missing.append({"change": change, "fields": uncovered})
            else:
                covered.append({"change": change, "fields": changed})
    report = {"tried": tried, "invalid": invalid, "covered": covered, "missing": missing}
    if os.environ.get("REUSE_KEY_REPORT"):
        with open(os.environ["REUSE_KEY_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    assert tried > 100  # the walk really ran Megatron's parser
    assert covered  # and some changes did reach the GEMMs (e.g. --hidden-size)
    assert not missing, json.dumps(missing, indent=1)
