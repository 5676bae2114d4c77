"""The bed itself: hosts with network stacks and names of their own, links that can be shaped
and cut, and nothing left behind (also after its owner was killed), the root namespace untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hosts.conftest import MakeBed
from hosts.jobs import REPO
from hosts.netbed import NETNS_ETC, PREFIX, Bed, Shaping, _bed_names, sweep

pytestmark = pytest.mark.timeout(60)

PY = sys.executable


def on(bed: Bed, host: int, code: str, timeout: float = 20) -> str:
    """Run Python ``code`` on ``host``; its stdout."""
    proc = bed.run(host, [PY, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out.strip()


def root_view() -> tuple[str, str, str]:
    """The root namespace's links, addresses and routes."""
    return tuple(  # type: ignore[return-value]
        subprocess.run(["ip", "-o", *what], capture_output=True, text=True, check=True).stdout
        for what in (["link"], ["addr"], ["route"])
    )


def test_each_host_has_its_own_stack_and_name_and_the_root_namespace_is_untouched(make_bed: MakeBed) -> None:
    before = root_view()
    bed = make_bed(3)
    assert root_view() == before
    for h in bed.hosts:
        got = on(bed, h.index, (
            "import socket, subprocess\n"
            "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))\n"
            "print(subprocess.run(['ip', '-o', '-4', 'addr'], capture_output=True, text=True).stdout)"
        ))  # fmt: skip
        first, addrs = got.split("\n", 1)
        assert first == f"{h.name} {h.addr}"  # its name resolves to its own eth0 address
        assert "lo    inet 127.0.0.1/8" in addrs and f"eth0    inet {h.addr}/24" in addrs
        assert addrs.count("inet ") == 2  # nothing of the machine's own interfaces
    # every host reaches every other, by name; the machine's own addresses are not there
    code = "import socket; socket.create_connection(('h2', 1), timeout=5)"
    proc = bed.run(0, [PY, "-c", code], stderr=subprocess.PIPE, text=True)
    assert "Connection refused" in proc.communicate(timeout=20)[1]  # h2 answered (RST): reached


def test_destroy_kills_every_process_and_leaves_nothing(make_bed: MakeBed) -> None:
    bed = make_bed(2)
    sleeper = bed.run(1, ["sleep", "600"])
    deadline = time.monotonic() + 10
    while sleeper.pid not in bed.pids(1):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    bed.destroy()
    assert sleeper.wait(5) == -signal.SIGKILL
    assert bed.name not in _bed_names()
    assert not [p for p in NETNS_ETC.glob(f"{bed.name}-*")] if NETNS_ETC.exists() else True
    bed.destroy()  # again: nothing to do, no error


def test_a_bed_whose_owner_died_is_swept(make_bed: MakeBed) -> None:
    """A test run SIGKILLed before its clean-up leaves its bed; the next bed made sweeps it."""
    make_bed(1)  # (skips the test where no bed can be made)
    code = (
        "import os, signal, subprocess, sys; sys.path.insert(0, 'tests')\n"
        "from hosts.netbed import Bed\n"
        "bed = Bed.create(2)\n"
        "bed.run(0, ['sleep', '600'], die_with_parent=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(bed.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    name = proc.stdout.strip()
    assert name.startswith(PREFIX) and name in _bed_names(), (proc.stdout, proc.stderr)
    assert name in sweep()
    assert name not in _bed_names()


def _transfer_seconds(bed: Bed, src: int, dst: int, nbytes: int) -> float:
    """Seconds host ``src`` takes to send ``nbytes`` to host ``dst`` over one TCP connection."""
    server = bed.run(dst, [PY, "-c", (
        "import socket\n"
        "s = socket.create_server(('0.0.0.0', 5201)); print('ready', flush=True)\n"
        "c, _ = s.accept(); n = 0\n"
        "while (b := c.recv(1 << 20)): n += len(b)\n"
        "print(n, flush=True)"
    )], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    took = float(on(bed, src, (
        "import socket, time\n"
        f"c = socket.create_connection(('{bed.hosts[dst].addr}', 5201)); buf = bytes(1 << 16); t0 = time.monotonic()\n"
        f"for _ in range({nbytes >> 16}): c.sendall(buf)\n"
        "c.shutdown(socket.SHUT_WR); c.recv(1); print(time.monotonic() - t0)"
    )))  # fmt: skip
    assert server.stdout.readline().strip() == str(nbytes)
    server.wait(10)
    return took


def test_a_shaped_link_is_shaped_both_ways(make_bed: MakeBed) -> None:
    """At 100 Mbit/s, 4 MiB take at least 0.34 s each way (a token bucket cannot be beaten;
    a loaded machine only makes it slower)."""
    bed = make_bed(2, Shaping("100mbit"))
    assert bed.shaping(1).startswith("rate 100Mbit")
    mib4 = 4 << 20
    least = mib4 * 8 / 100e6 - 64 * 1024 * 8 / 100e6  # (less one bucket, sent at once)
    assert _transfer_seconds(bed, 1, 0, mib4) > least
    assert _transfer_seconds(bed, 0, 1, mib4) > least
    bed.shape(1, None)
    assert bed.shaping(1) == "none"


def test_a_cut_link_drops_everything_until_it_is_restored(make_bed: MakeBed) -> None:
    bed = make_bed(2)
    reach = f"import socket; socket.create_connection(('{bed.hosts[1].addr}', 1), timeout=1)"
    bed.link_down(1)
    proc = bed.run(0, [PY, "-c", reach], stderr=subprocess.PIPE, text=True)
    assert "timed out" in proc.communicate(timeout=20)[1]  # no answer at all, not a refusal
    bed.link_up(1)
    deadline = time.monotonic() + 10
    while True:  # (the link takes a moment to come back)
        proc = bed.run(0, [PY, "-c", reach], stderr=subprocess.PIPE, text=True)
        err = proc.communicate(timeout=20)[1]
        if "Connection refused" in err or time.monotonic() > deadline:
            break
    assert "Connection refused" in err  # host 1 answers again


def test_the_command_line_stands_a_bed_up_and_takes_it_down(make_bed: MakeBed) -> None:
    make_bed(1)  # (skips the test where no bed can be made)
    name = f"t{os.getpid() % 100000}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PY, "-m", "tests.hosts.netbed", *args], cwd=REPO, capture_output=True, text=True, timeout=60
        )

    try:
        up = cli("up", "--name", name, "--hosts", "2", "--rate", "1gbit")
        assert up.returncode == 0, up.stderr
        assert "h1  10.213.0.2" in up.stdout and "rate 1Gbit" in up.stdout
        ran = cli("exec", name, "h1", "--", "hostname")
        assert (ran.returncode, ran.stdout.strip()) == (0, "h1"), ran.stderr
        assert cli("shape", name, "--off").returncode == 0
        assert "rate" not in cli("ls").stdout.split(f"{PREFIX}{name}:")[1].split("bed ")[0]
        again = cli("up", "--name", name)
        assert again.returncode == 1 and "exists already" in again.stderr
    finally:
        down = cli("down", name)
    assert down.returncode == 0 and f"removed {PREFIX}{name}" in down.stdout, down.stderr
    assert f"{PREFIX}{name}" not in _bed_names()
