"""The search's options before issue 46's twenty-sixth session: a 60 s budget, up to 6 fresh looks at a leader, and
looks after the third only for a leader half-way to its threshold. The exact-seed expectations of the mechanism tests
were recorded at them (the mechanisms are the same at today's 180 s defaults), and a 60 s search runs in about half the
CPU time of a 120 s one (pytest's 90 s bound on a 2-core clone). ``AT_120``: the defaults of the twenty-sixth to the
thirtieth session (120 s, up to 20 looks), where later mechanisms' tests were recorded: at 180 s the budget alone takes
some of the gains that those mechanisms were needed for."""

from megatron_tp_overlap.engine.search import SearchOptions

AT_60 = {"max_seconds": 60.0, "max_looks": 6, "later_look_least": 0.5}
AT_120 = {"max_seconds": 120.0, "max_looks": 20}


def at_60(**changes) -> SearchOptions:
    """The search options of a 60 s budget (``AT_60``) with ``changes``."""
    return SearchOptions(**{**AT_60, **changes})


def at_120(**changes) -> SearchOptions:
    """The search options of a 120 s budget (``AT_120``) with ``changes``."""
    return SearchOptions(**{**AT_120, **changes})
