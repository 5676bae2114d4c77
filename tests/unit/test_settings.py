"""The environment is read in one place, once per job: ``aiodist.settings``.

What users rely on: a bad value fails the init naming the variable (before any rendezvous);
the values in force are those of when the job started; torch's debug level is the one setting
that changes while a job runs (``set_debug_level``), and it never needs the environment read
again. And, as a check of the code: no module on an operation's path reads the environment.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aiodist import settings
from aiodist.errors import DistValueError
from aiodist.settings import DebugLevel, Settings

ROOT = Path(__file__).resolve().parents[2] / "aiodist"

# Who else may read the environment, and why.
READERS_ALLOWED = {
    "settings.py": "the one module that parses it",
    "_launcher": "the launcher, a program of its own (it writes its workers' environment)",
    "bench": "the benchmark tools, programs of their own",
    "testing/procs.py": "starts test processes with an environment",
    "torch/_build.py": "the C++ extension's build (compiler, cache directory), not a job",
    "sync/_core.py": "torch's helpers that read the launcher's variables when called, as torch's do",
}


def _reads_environment(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in ("environ", "getenv")]
    return lines


def test_only_the_settings_module_reads_the_environment() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel == allowed or rel.startswith(allowed + "/") for allowed in READERS_ALLOWED):
            continue
        found += [f"aiodist/{rel}:{line}" for line in _reads_environment(path)]
    assert not found, "read the environment in aiodist/settings.py and pass the value down: " + ", ".join(
        found
    )


def test_the_check_finds_a_reader(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom os import getenv\nx = os.environ.get('A')\n")
    assert sorted(_reads_environment(sample)) == [2, 3]


def test_defaults_when_nothing_is_set() -> None:
    s = Settings.read({})
    assert s == Settings()
    assert (s.task_check, s.shm, s.host_algos, s.link_timeout) == ("auto", "on", "auto", 60.0)
    assert s.secret is None and not s.allow_pickle and s.busy_poll_us is None
    assert s.rank_and_size(-1, -1) == (-1, -1) and s.ranks_on_host == 1


def test_values_are_parsed() -> None:
    s = Settings.read(
        {
            "AIODIST_SECRET": "k",
            "AIODIST_ALLOW_PICKLE": "1",
            "AIODIST_TASK_CHECK": " Strict ",
            "AIODIST_SHM": "copy",
            "AIODIST_SHM_JOB": "job7",
            "AIODIST_LINK_TIMEOUT": "0",
            "AIODIST_BUSY_POLL_US": "50",
            "AIODIST_DEBUG": "detail",
            "AIODIST_LOG_LEVEL": "warn",
            "AIODIST_MAX_OBJECT_BYTES": "1000",
            "PMI_RANK": "3",
            "PMI_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "2",
        }
    )
    assert s.secret == b"k" and s.allow_pickle and s.task_check == "strict" and s.shm == "copy"
    assert (s.shm_job, s.link_timeout, s.busy_poll_us, s.max_object_bytes) == ("job7", 0.0, 50.0, 1000)
    assert s.debug is DebugLevel.DETAIL and s.log_level == 30
    assert s.rank_and_size(-1, -1) == (3, 8) and s.rank_and_size(1, 2) == (1, 2)
    assert s.ranks_on_host == 4 and s.agent_store and s.restart_attempt() == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("AIODIST_TASK_CHECK", "sometimes"),
        ("AIODIST_SHM", "maybe"),
        ("AIODIST_BUSY_POLL_US", "lots"),
        ("AIODIST_LINK_TIMEOUT", "-1"),
        ("AIODIST_RENDEZVOUS_LOG_INTERVAL", "soon"),
        ("AIODIST_LOG_LEVEL", "chatty"),
        ("AIODIST_MAX_OBJECT_BYTES", "a lot"),
        ("AIODIST_TORCH_BACKEND", "rust"),
        ("AIODIST_NATIVE", "fast"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(DistValueError, match=name):
        Settings.read({name: value})


def test_values_checked_where_they_are_used() -> None:
    """Launcher variables no init uses, and the host-aware switch (which the rendezvous checks so
    that a bad value fails every rank at once), are read without complaint and refused where used."""
    s = Settings.read({"RANK": "x", "AIODIST_HOST_ALGOS": "bogus", "TORCHELASTIC_RESTART_COUNT": "-1"})
    assert s.rank_and_size(0, 2) == (0, 2)  # given: the variable is not used
    with pytest.raises(DistValueError, match="RANK='x' is not an integer"):
        s.rank_and_size(-1, 2)
    with pytest.raises(DistValueError, match="AIODIST_HOST_ALGOS='bogus'"):
        s.checked_host_algos()
    with pytest.raises(DistValueError, match="TORCHELASTIC_RESTART_COUNT"):
        s.restart_attempt()


def test_the_debug_level_changes_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective reads the process's level, never the environment: setting the variable
    mid-job changes nothing until the next init applies it; ``set_debug_level`` does at once."""
    monkeypatch.delenv("AIODIST_DEBUG", raising=False)
    Settings.read().apply()
    assert not settings.detail_on()
    monkeypatch.setenv("AIODIST_DEBUG", "DETAIL")
    assert not settings.detail_on()
    Settings.read().apply()
    assert settings.detail_on() and settings.debug_level() is DebugLevel.DETAIL
    settings.set_debug_level(DebugLevel.OFF)
    assert not settings.detail_on()
