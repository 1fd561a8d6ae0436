"""The search's options before issue 46's twenty-sixth session: a 60 s budget, up to 6 fresh looks at a leader, and
looks after the third only for a leader half-way to its threshold. The exact-seed expectations of the mechanism tests
were recorded at them (the mechanisms are the same at today's 180 s defaults), and a 60 s search runs in about half the
CPU time of a 120 s one (pytest's 90 s bound on a 2-core clone). ``AT_120``: the defaults of the twenty-sixth to the
thirtieth session (120 s, up to 20 looks), where later mechanisms' tests were recorded: at 180 s the budget alone takes
some of the gains that those mechanisms were needed for. Both keep the thirty-second session's two look rules off
(``look_spread``, ``later_reach``), the thirty-third's runners-up (``runners_up``), the forty-second's ride-along
(``ride_along_z``), the forty-third's rest guard (``rest_guard``) and the forty-seventh's rest slopes (``BEFORE_47``)
off, which came after every one of those recordings."""

from megatron_tp_overlap.engine.search import SearchOptions

# the rest scaling before issue 46's forty-seventh session: slopes on the rest at most 1, the final decision unscaled
BEFORE_47 = {"rest_beta_max": 1.0, "decision_rest_norm": 0}

AT_60 = {
    "max_seconds": 60.0,
    "max_looks": 6,
    "later_look_least": 0.5,
    "look_spread": 0,
    "later_reach": 0,
    "runners_up": 0,
    "ride_along_z": 0.0,
    "rest_guard": 0,
    **BEFORE_47,
}
AT_120 = {
    "max_seconds": 120.0,
    "max_looks": 20,
    "look_spread": 0,
    "later_reach": 0,
    "runners_up": 0,
    "ride_along_z": 0.0,
    "rest_guard": 0,
    **BEFORE_47,
}
AT_31 = {
    "look_spread": 0,
    "later_reach": 0,
    "runners_up": 0,
    "ride_along_z": 0.0,
    "rest_guard": 0,
    **BEFORE_47,
}  # the thirty-first session's search: today's budget, the two rules off


def at_60(**changes) -> SearchOptions:
    """The search options of a 60 s budget (``AT_60``) with ``changes``."""
    return SearchOptions(**{**AT_60, **changes})


def at_120(**changes) -> SearchOptions:
    """The search options of a 120 s budget (``AT_120``) with ``changes``."""
    return SearchOptions(**{**AT_120, **changes})


def at_31(**changes) -> SearchOptions:
    """The thirty-first session's search options (``AT_31``: 180 s and 40 looks, without the thirty-second session's
    look rules) with ``changes``: where the mechanism tests of the thirtieth and thirty-first sessions were recorded."""
    return SearchOptions(**{**AT_31, **changes})
