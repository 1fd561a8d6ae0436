"""Cut each search's JSON to what real_steps_bar.py and slot_coupling.py read, plus what tells a miss.

    python slim.py SRC DST [SEED ...]  # SRC/g*/search_on_real_steps.json -> DST/g*/ (the traces of these seeds
                                       # kept; default 22500)
"""
import glob
import json
import os
import sys

KEEP = ["seed", "variant", "kind", "available_gain_pct", "realized", "excess_pct", "false_winner", "chosen", "reason",
        "steps", "seconds", "switches", "search_end", "phase_seconds", "choices_accepted", "world_fast", "wall_s",
        "gain_put_in_ms", "gain_on_steps_ms", "slot_gain_ms", "miss_shown", "miss_in_trials", "miss_in_trials_frozen",
        "miss_in_trials_on_reference"]  # fmt: skip
src, dst = sys.argv[1], sys.argv[2]
traced = {int(x) for x in sys.argv[3:]} or {22500}
for f in sorted(glob.glob(f"{src}/g*/search_on_real_steps.json")):
    d = json.load(open(f))
    out = {k: v for k, v in d.items() if k != "runs"}
    runs = []
    for r in d["runs"]:
        s = {k: r.get(k) for k in KEEP}
        s["per_slot"] = {
            slot: {k: v.get(k) for k in ("trial_level_pct", "step_spread_pct", "rest_scaled_by", "runners_up")}
            for slot, v in (r.get("per_slot") or {}).items()
        }
        names = {w.split(":")[0] for w in (r.get("world_fast") or [])}
        s["choices"] = {g: c for g, c in (r.get("choices") or {}).items() if g in names}
        if r.get("miss_trace") and r["seed"] in traced:
            s["miss_trace"] = {
                k: [[p[0], p[1], round(p[2], 3), round(p[3], 3)] + ([[round(x, 3) for x in p[4]]] if len(p) > 4 else [])
                    for p in v]
                for k, v in r["miss_trace"].items()
            }  # fmt: skip
        runs.append(s)
    out["runs"] = runs
    g = os.path.basename(os.path.dirname(f))
    os.makedirs(f"{dst}/{g}", exist_ok=True)
    json.dump(out, open(f"{dst}/{g}/search_on_real_steps.json", "w"), separators=(",", ":"))
