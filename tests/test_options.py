"""TuneOptions is the one source of the autotune options: its rules, and the README table that documents them."""

import dataclasses
import re
from pathlib import Path

from megatron_tp_overlap.engine.options import TuneOptions, option_fields, unknown_prefixed
from megatron_tp_overlap.integrations.megatron.flags import flag_name


def test_every_rule_names_the_option_as_typed():
    bad = dataclasses.replace(
        TuneOptions(), seconds=float("inf"), steps=-1, strategy="greedy", rtol=0.9, trial_timeout=-1.0
    )
    p = "\n".join(bad.problems(lambda k: f"tp_overlap.{k}"))
    for needle in (
        "tp_overlap.seconds = inf: must be a finite number > 0",
        "tp_overlap.steps = -1: must be >= 0",
        "tp_overlap.strategy = 'greedy': must be one of coordinate",
        "tp_overlap.rtol = 0.9: must be <= 0.5",
        "tp_overlap.trial_timeout = -1.0",
    ):
        assert needle in p, p
    assert TuneOptions().problems() == []


def test_a_misspelt_prefixed_option_gets_the_closest_name():
    (p,) = unknown_prefixed({"tp_comm_overlap_autotune_allowoff": True, "tp_comm_overlap": True})
    assert "did you mean 'tp_comm_overlap_autotune_allow_off'" in p


def test_the_readme_options_table_lists_every_option_with_its_flag():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "--" in line and "autotune" in line]
    flags = {m for r in rows for m in re.findall(r"--(?:\[no-\])?(tp-comm-overlap-autotune-[a-z-]+)", r)}
    assert flags == {flag_name(f.name)[2:] for f in option_fields()}


def test_the_readme_options_table_states_each_default_as_the_dataclass_has_it():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for f in option_fields():
        (row,) = [r for r in readme.splitlines() if r.startswith("| ") and flag_name(f.name)[2:] in r]
        default = row.rstrip(" |").rsplit("|", 1)[1].strip()
        if isinstance(f.default, bool):
            assert default.startswith("on" if f.default else "off"), (f.name, default)
        elif isinstance(f.default, (int, float)):
            assert float(default) == f.default, (f.name, default)
        elif isinstance(f.default, str):
            assert default == f.default, (f.name, default)
