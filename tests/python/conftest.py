"""Fixtures of the published-client conformance suite.

The suite builds nothing: run `cargo build --bin pegaflow-server` first (or set
PEGAFLOW_SERVER_BIN). `server` is one server shared by the tests that leave it running (each
uses its own instance ids); `fresh_server` starts a private one for tests that stop it or need
exact server-wide numbers.
"""

from __future__ import annotations

import shutil
import uuid

import pytest

import pftest
from pegaflow.pegaflow import EngineRpcClient


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of seconds (still part of the suite)")


@pytest.fixture(scope="session")
def server():
    s = pftest.Server().start()
    yield s
    s.stop()
    shutil.rmtree(s.dir, ignore_errors=True)


@pytest.fixture
def fresh_server():
    servers: list[pftest.Server] = []

    def start(**kw) -> pftest.Server:
        s = pftest.Server(**kw).start()
        servers.append(s)
        return s

    start.servers = servers
    yield start
    for s in servers:
        s.stop()
        shutil.rmtree(s.dir, ignore_errors=True)


@pytest.fixture
def client(server):
    return EngineRpcClient(server.endpoint)


@pytest.fixture
def uid(request):
    """A unique, side-channel-safe instance id for this test."""
    name = request.node.name.replace("[", "-").replace("]", "")
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:60]
    return f"{safe}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def host_kv():
    kvs: list[pftest.HostKv] = []

    def make(**kw) -> pftest.HostKv:
        kv = pftest.HostKv(**kw)
        kvs.append(kv)
        return kv

    yield make
    for kv in kvs:
        kv.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        servers = []
        for v in getattr(item, "funcargs", {}).values():
            if isinstance(v, pftest.Server):
                servers.append(v)
            servers.extend(getattr(v, "servers", []) or [])
        for s in servers:
            rep.sections.append((f"pegaflow-server log ({s.log_path})", s.log_tail(60)))
