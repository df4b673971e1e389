"""Hostile clients and instances run against the gateway on uvloop, the loop ``taogate serve`` runs
on (its readers are drained in bursts, so a costly read starves neighbours more there)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"uvloop": uvloop.new_event_loop}
