"""trainer.ray_address where no Ray cluster answers: one line within seconds, and SIGTERM is honoured while connecting.

Before, `tether train trainer.backend=ray trainer.ray_address=127.0.0.1:1` sat in Ray's own GCS
connection loop (20 attempts of about 40 s, printing Ray's GCS warnings) for about 14 minutes, and a
SIGTERM waited for it: ray.init installs a Python SIGTERM handler and then blocks in C++.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from tether.config import ConfigError  # noqa: E402
from tether.distributed.ray_backend import RayCluster, probe_ray_address  # noqa: E402

ROOT = Path(__file__).parents[2]
ARGS = [
    "trainer.backend=ray",
    "trainer.n_workers=2",
    "trainer.total_steps=1",
    "trainer.progress=false",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    "trainer.threads=1",
    "data.embedded_train_size=8",
    "data.embedded_val_size=4",
]


@pytest.fixture
def silent_listener():
    """A TCP port on 127.0.0.1 that accepts connections and never says a word (a wrong port, a proxy)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        yield srv


@pytest.fixture
def loopback_kept(monkeypatch):
    """Ray replaces a loopback host by this machine's address (ray._private.services.resolve_ip_for_localhost);
    with ENABLE_RAY_CLUSTER off it keeps 127.0.0.1, where the test's listener is."""
    from ray._private import ray_constants

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever Ray this process joined, RayCluster connects


def _env(**extra) -> dict:
    tmp = Path(os.environ.get("TMPDIR", ROOT / ".tmp"))
    return dict(
        os.environ,
        RAY_AUTH_MODE="disabled",
        TMPDIR=str(tmp),
        PYTHONPATH=str(ROOT / "src"),
        OMP_NUM_THREADS="1",
        **extra,
    )


def test_a_listener_that_is_no_ray_gcs_fails_within_the_connect_timeout(silent_listener, loopback_kept, monkeypatch):
    """Something accepts TCP connections but no GCS answers: Ray would retry for about 14 minutes; the
    probe (one GetClusterId call) gives up after TETHER_RAY_CONNECT_TIMEOUT seconds, naming the port."""
    address = f"127.0.0.1:{silent_listener.getsockname()[1]}"
    monkeypatch.setenv("TETHER_RAY_CONNECT_TIMEOUT", "1.5")
    init = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: init.append(k))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        RayCluster(address, 1)
    took = time.monotonic() - t0
    assert str(info.value) == (
        f"trainer.ray_address='{address}': cannot connect to a Ray cluster there ({address} accepts connections, but "
        "no Ray GCS answered within 1.5 s; is it the GCS port (6379 by default)? a Ray client port (10001) needs "
        "ray://); start one with `ray start --head` (or name its GCS address, `ray status` prints it), or leave "
        "trainer.ray_address null for a local Ray"
    )
    assert 1.4 < took < 5 and init == []  # ray.init was never called


@pytest.mark.parametrize(
    "address, why",
    [
        ("ray://127.0.0.1:1", "nothing listens at 127.0.0.1:1: Connection refused"),  # Ray client: the TCP check
        ("127.0.0.1:1", "nothing listens at 127.0.0.1:1: Connection refused"),
    ],
)
def test_nothing_listening_fails_at_once(loopback_kept, address, why):
    t0 = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=rf"^trainer.ray_address='{address}': cannot connect to a Ray cluster there \({why}\); start one",
    ):
        RayCluster(address, 1)
    assert time.monotonic() - t0 < 1


def test_auto_without_a_cluster_or_with_a_stale_record_fails_at_once(loopback_kept, monkeypatch):
    """`auto` finds the cluster `ray start` recorded (or any GCS process on this machine): none gives
    Ray's own one-line error, a recorded cluster that is gone the probe's, naming where `auto` led."""
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])  # not another session's Ray running on this machine
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    with pytest.raises(
        ConfigError,
        match=r"^trainer.ray_address='auto': cannot connect to a Ray cluster there \(Could not find any running Ray "
        r"instance\. Please specify",
    ):
        probe_ray_address("auto")
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: "127.0.0.1:1")
    with pytest.raises(
        ConfigError,
        match=r"^trainer.ray_address='auto': cannot connect to a Ray cluster there \(nothing listens at "
        r"127\.0\.0\.1:1: Connection refused; `auto` resolved to it\)",
    ):
        probe_ray_address("auto")


def test_a_loopback_address_names_where_ray_really_connects():
    """Ray connects to this machine's address for 127.0.0.1 (a cluster bound to 127.0.0.1 only is not
    reachable that way): the line names both."""
    from ray._private.services import get_node_ip_address

    here = get_node_ip_address()
    if here == "127.0.0.1":
        pytest.skip("Ray keeps 127.0.0.1 on this machine")
    with pytest.raises(
        ConfigError,
        match=rf"\(nothing listens at {here}:1: Connection refused; Ray connects there for 127\.0\.0\.1:1: it replaces "
        r"a loopback host by this machine's address\)",
    ):
        probe_ray_address("127.0.0.1:1")


def test_bad_addresses_are_named():
    with pytest.raises(
        ConfigError, match=r"^trainer.ray_address='nonsense' is not a Ray address: expected auto, HOST:PORT"
    ):
        probe_ray_address("nonsense")
    with pytest.raises(ConfigError, match=r"^trainer.ray_address='ray://:x' is not a Ray client address"):
        probe_ray_address("ray://:x")


@pytest.mark.slow
def test_cli_with_nothing_at_the_ray_address_exits_2_with_one_line_within_seconds(tmp_path):
    """The issue's command: one line naming trainer.ray_address and the address, exit status 2, no
    traceback and none of Ray's GCS connection warnings, well within 60 s (start-up included)."""
    cmd = [
        sys.executable,
        "-m",
        "tether.cli",
        "train",
        *ARGS,
        "trainer.ray_address=127.0.0.1:1",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr[-3000:]
    assert last.startswith(
        "tether train: trainer.ray_address='127.0.0.1:1': cannot connect to a Ray cluster there (nothing listens at "
    )
    assert ":1: Connection refused" in last and "Traceback" not in done.stderr
    # Ray's connection loop never ran
    assert "Failed to connect to GCS" not in done.stderr and "rpc_client" not in done.stderr
    assert not (tmp_path / "run").exists()  # a failed start leaves no run directory
    assert took < 60, took


@pytest.mark.slow
def test_cli_sigterm_while_waiting_for_the_gcs_ends_it_at_once(tmp_path, silent_listener):
    """A SIGTERM while tether waits for a GCS that does not answer (the probe's gRPC call, here for up to
    120 s) ends the process at once: the probe waits in Python, and nothing has replaced the default
    SIGTERM action yet (Ray installs its handler in ray.init, which the probe comes before)."""
    port = silent_listener.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "tether.cli",
        "train",
        *ARGS,
        f"trainer.ray_address=127.0.0.1:{port}",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    # Ray keeps 127.0.0.1 (see loopback_kept)
    env = _env(TETHER_RAY_CONNECT_TIMEOUT="120", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    conns = []
    try:
        silent_listener.settimeout(90)
        conns.append(silent_listener.accept()[0])  # the TCP check
        conns.append(silent_listener.accept()[0])  # gRPC: tether now waits for the GCS's answer
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in conns:
            c.close()
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), err[-3000:]
    assert took < 3, took
