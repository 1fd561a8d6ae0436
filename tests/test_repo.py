"""The repository stays light: a GPU run carries the tracked files plus ~51 MB of staged wheels under a 64 MiB limit,
and a newcomer reads modules of one concern each."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): what is there
        skip = (".git", ".venv", ".device", ".pytest_cache", "__pycache__", ".egg-info")
        return [p for p in ROOT.rglob("*") if p.is_file() and not any(s in str(p) for s in skip)]


def test_tracked_files_stay_under_8_mb():
    """Raw logs and per-rank files of a result go into one raw.tar.xz per folder (benchmarks/results/README.md)."""
    sizes = {p: p.stat().st_size for p in tracked() if p.is_file()}
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= 8 * 1024 * 1024, (total, [(str(p.relative_to(ROOT)), s) for p, s in biggest])


def test_no_module_of_the_package_is_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "megatron_tp_overlap").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}


def test_every_result_folder_is_reachable_from_the_index():
    """Each folder of benchmarks/results is named in the index (benchmarks/results/README.md) or in the README of a
    folder above it that the index names: no figure is lost in the notebook."""
    results = ROOT / "benchmarks" / "results"
    missing = []
    for d in sorted(p for p in results.rglob("*") if p.is_dir()):
        rel = d.relative_to(results)
        readmes = [results / "README.md"] + [results / a / "README.md" for a in reversed(rel.parents) if str(a) != "."]
        names = {str(rel)} | {str(rel.relative_to(a)) for a in rel.parents if str(a) != "."}
        texts = [p.read_text() for p in readmes if p.exists()]
        if not any(n in t for n in names for t in texts):
            missing.append(str(rel))
    assert missing == []


def test_every_tracked_shell_script_parses():
    """``bash -n`` on each: a device call that fails on a syntax error costs a machine start."""
    scripts = [p for p in tracked() if p.suffix == ".sh"]
    bad = [
        (p.name, r.stderr)
        for p in scripts
        if (r := subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)).returncode
    ]
    assert scripts and not bad, bad
