"""Faults that do not raise (issue 52): a rank killed, a rank that hangs, the store gone, SIGTERM, a full disk, a cache
shared by two accounts. Each ends as one true line; none leaves a half-written file. Multi-rank cases run the
benchmark's harness (benchmarks/faults_scale.py) at 4 ranks, all at once, forked from this process."""

import errno
import multiprocessing as mp
import os
import signal
import socket
import sys
import types
from pathlib import Path

from test_cache import KEY

from megatron_tp_overlap import atomic
from megatron_tp_overlap.engine import ending
from megatron_tp_overlap.engine.cache import TunedConfigCache
from megatron_tp_overlap.engine.space import TuningConfig
from megatron_tp_overlap.ub.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import faults_scale  # noqa: E402 - the harness the benchmark runs at 8 and 32 ranks

HOST = socket.gethostname()


def test_a_killed_or_hung_rank_and_a_lost_store_each_end_every_rank_with_one_line_naming_who(tmp_path):
    """Rank 3 of 4 killed (store on rank 0); rank 0, which hosts the store, killed; rank 3 hanging outside a step
    (store outside the ranks, as torchrun's agent hosts it); the store's process killed. Every other rank prints the
    same one line and exits 70, without a traceback."""
    ctx = mp.get_context("fork")  # torch is imported here already: a spawned rank would import it again (~2 s each)
    setup = faults_scale.Setup(bound_s=1.5, census_s=1.0, poll_s=0.05, local_size=2, tp=2, trials=6)
    kinds = ["kill", "kill0", "hang", "store"]
    launches = [faults_scale.start(k, 4, tmp_path / k, setup, ctx) for k in kinds]
    results = {r["fault"]: r for r in faults_scale.finish(launches, timeout_s=120)}
    expect = {
        "kill": f"rank 3 (host {HOST}) stopped answering during tuning",
        "kill0": f"rank 0 (host {HOST}) stopped answering during tuning (it hosted the c10d store)",
        "hang": f"rank 3 (host {HOST}) did not reach the tuning's agreement point 3 within 1.5 s",
        "store": "the c10d store (127.0.0.1:",
    }
    for kind, r in results.items():
        bad = r["bad"]
        assert r["exit_codes"] == [9 if q == bad and kind != "hang" else ending.EXIT_CODE for q in range(4)], r
        ends = [ln for ln in r["lines"] if "ending the job" in ln]
        assert len(ends) == 1 and expect[kind] in ends[0], (kind, r["lines"])  # one line, the same everywhere
        alive = [q for q in range(4) if q != bad or kind == "hang"]
        assert r["end_lines_per_rank"] == [1 if q in alive else 0 for q in range(4)], (kind, r)
        assert not any("Traceback" in (tmp_path / kind / f"r{q}.err").read_text() for q in range(4))


def _write_under_sigterm(path: str) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:  # the scheduler's SIGTERM arrives halfway through the write
        os.kill(os.getpid(), signal.SIGTERM)
        real(fd)

    os.fsync = fsync
    atomic.atomic_write_text(path, "new: 2\n" * 1000, backup=True)
    os._exit(0)  # not reached: the deferred SIGTERM ends the process once the file is whole


def test_sigterm_during_a_write_lands_after_it_and_leaves_whole_files_only(tmp_path):
    target = tmp_path / "tuned.yaml"
    target.write_text("old: 1\n")
    p = mp.get_context("fork").Process(target=_write_under_sigterm, args=(str(target),))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGTERM
    assert target.read_text() == "new: 2\n" * 1000 and (tmp_path / "tuned.yaml.bak").read_text() == "old: 1\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tuned.yaml", "tuned.yaml.bak"]  # no temporary file


def test_a_rewritten_file_keeps_its_mode_and_a_new_one_gets_the_umasks(tmp_path):
    old = os.umask(0o022)
    try:
        shared = tmp_path / "tuned.yaml"
        shared.write_text("a: 1\n")
        os.chmod(shared, 0o644)
        atomic.atomic_write_text(shared, "a: 2\n", backup=True)
        atomic.atomic_write_text(tmp_path / "new.json", "{}")
        os.umask(0o002)  # a group's shared folder
        atomic.atomic_write_text(tmp_path / "group.json", "{}")
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()}
    assert modes == {"tuned.yaml": 0o644, "tuned.yaml.bak": 0o644, "new.json": 0o644, "group.json": 0o664}


def _as_other_account(root: str, out) -> None:
    """Reads a cache another account wrote: as uid 65534 when root can switch to it, else under modes that refuse
    this account the writes (a read-only lock file and folder) as another account's would."""
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    lines: list[str] = []
    from megatron_tp_overlap.integrations.megatron.reuse import _get

    got = _get(TunedConfigCache(root), KEY, lines.append)
    hidden = TunedConfigCache(root + "_private")
    none = _get(hidden, KEY, lines.append)
    out.send([got is not None and got.ub == next(iter(PRESETS.values())), none is None, lines])
    os._exit(0)


def test_a_cache_written_by_one_account_is_read_by_another_and_one_it_cannot_read_is_said_in_one_line(tmp_path):
    """Account A tunes and caches; account B (another uid, or modes standing for it) reuses the entry without
    taking the lock it may not open; an entry B may not read at all gives one line and tuning, not an error on rank
    0 while the other ranks wait in the broadcast."""
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"shared-cache-{os.getpid()}"  # pytest's tmp_path is 0700
    old = os.umask(0o022)
    try:
        TunedConfigCache(base / "cache").put(KEY, next(iter(PRESETS.values())))
        private = TunedConfigCache(base / "cache_private")
        private.put(KEY, next(iter(PRESETS.values())))
        for f in (base / "cache_private").iterdir():
            os.chmod(f, 0o600)  # another account's entry, private to it
        if os.geteuid() != 0:
            for d in (base / "cache", base / "cache_private"):
                os.chmod(d / ".lock", 0o444)
                os.chmod(d, 0o555)
            os.chmod(base / "cache_private" / f"{KEY.digest()}.json", 0o000)
        os.chmod(base, 0o755)
        ctx = mp.get_context("fork")
        here, there = ctx.Pipe()
        p = ctx.Process(target=_as_other_account, args=(str(base / "cache"), there))
        p.start()
        reused, retuned, lines = here.recv() if here.poll(30) else (None, None, [])
        p.join(30)
        assert p.exitcode == 0 and reused and retuned
        assert len(lines) == 1 and "cannot read the tuned-config cache" in lines[0] and "cache_private" in lines[0]
    finally:
        os.umask(old)
        for d in (base / "cache", base / "cache_private"):
            if d.exists():
                os.chmod(d, 0o755)
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_a_full_disk_names_each_path_in_one_line_keeps_what_the_user_had_and_the_run_trains_on(tmp_path, monkeypatch):
    from megatron_tp_overlap.integrations.megatron.flags import Recipe
    from megatron_tp_overlap.integrations.megatron.outputs import _write_all
    from megatron_tp_overlap.integrations.megatron.tuning import Tuned

    yaml = tmp_path / "tuned.yaml"
    yaml.write_text("# the user's\n")
    real_open = open

    class Full:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return None

        def write(self, _):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    full = lambda f, mode="r", *a, **k: Full() if "w" in mode else real_open(f, mode)  # noqa: E731
    monkeypatch.setattr(atomic, "open", full, raising=False)
    config = TuningConfig(next(iter(PRESETS.values())), frozenset(), "autotuned")
    tuned = Tuned(config, None, yaml, Recipe(str(yaml), [], [], {}), result=types.SimpleNamespace(report={}))
    lines: list[str] = []
    cache = TunedConfigCache(tmp_path / "cache")
    assert _write_all(tuned, KEY, cache, 1.0, lines.append) is False
    assert len(lines) == 3 and all("No space left on device" in ln and "\n" not in ln for ln in lines), lines
    assert str(yaml) in lines[0] and "in memory" in lines[0]
    assert str(tmp_path / "tuned.report.json") in lines[1] and str(cache.root) in lines[2]
    assert yaml.read_text() == (tmp_path / "tuned.yaml.bak").read_text() == "# the user's\n"  # the user's, twice
    assert sorted(f.name for f in tmp_path.rglob("*") if f.is_file()) == [".lock", "tuned.yaml", "tuned.yaml.bak"]


def test_waits_are_bounded_by_the_runs_distributed_timeout_and_a_relaunch_reuses(monkeypatch):
    from megatron_tp_overlap.integrations.megatron import reuse, tuning
    from megatron_tp_overlap.integrations.megatron.launcher import _minutes

    assert ending.bound_s(120.0, None) == 300.0 and ending.bound_s(120.0, _minutes(10)) == 300.0
    assert ending.bound_s(120.0, _minutes(2)) == 120.0 and _minutes(None) is None
    assert "the run's distributed timeout 120 s" in ending.bound_text(120.0, 120.0, 120.0)
    made = {}
    monkeypatch.setattr("megatron_tp_overlap.engine.tuner.Autotuner", lambda *a, **k: made.update(k))
    run = types.SimpleNamespace(rs_dgrad=False)
    options = types.SimpleNamespace(allow_off=False, strategy="coordinate", steps=0, seconds=1, rtol=0.02)
    options.trial_timeout = 10.0
    steps = types.SimpleNamespace(step=None, fingerprint=None)
    tuning._make_tuner(None, steps, None, run, options, None, print, timeout_s=_minutes(10))
    assert made["distributed_timeout_s"] == 600.0  # Megatron's --distributed-timeout-minutes, through tune()
    monkeypatch.delenv(reuse.RESTART_ENV, raising=False)
    assert reuse.relaunched("k") is None
    monkeypatch.setenv(reuse.RESTART_ENV, "2")  # torchrun / the fault-tolerance launcher relaunched the job
    assert reuse.relaunched("k") == f"relaunched ({reuse.RESTART_ENV}=2)"
    monkeypatch.setenv(reuse.RESTART_ENV, "0")
    monkeypatch.setattr(reuse, "TUNED_HERE", {"k"})  # an in-process restart: tune() ran in this process
    assert reuse.relaunched("k") == "restarted in this process"
