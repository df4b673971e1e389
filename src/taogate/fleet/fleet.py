"""The set of instances the gateway dispatches to, and the one place their live state is kept.

``Fleet`` maps names to ``Instance`` objects, snapshots them for dispatch, and applies a new
instance list on reload: unchanged instances keep their live state (in-flight leases, health,
learned speed); removed ones stop taking work at once and finish what they hold.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from taogate.dispatch.slow import slow_instances, unsure_slow
from taogate.dispatch.speed import SpeedEstimator, SpeedStat
from taogate.dispatch.types import InstanceView
from taogate.fleet.engine import stale_after
from taogate.fleet.instance import BOUND_TTL, Instance, InstanceSpec
from taogate.instance_settings import InstanceSettings
from taogate.settings import ConfigError, Settings

log = logging.getLogger("taogate.fleet")


#: Env vars already said to be unset (discovery asks at every change of its addresses).
_UNSET_SAID: set[str] = set()


def instance_key(environ: Mapping[str, str], var: str | None, who: str) -> str | None:
    """An instance's own key from the env var ``var`` names, stripped of surrounding whitespace (a
    secret mounted from a file ends in a newline); ConfigError for a control character inside (it
    goes into a header line verbatim); None, said once, when the variable is unset or empty."""
    if var is None:
        return None
    key = environ.get(var, "").strip() or None
    if key is not None and not key.isprintable():
        raise ConfigError(
            f"{who}: {var} holds a control character; set it to the key alone (a trailing newline "
            "from a file is stripped, inner ones are not)"
        )
    if key is None and var not in _UNSET_SAID:
        _UNSET_SAID.add(var)
        log.warning("%s: api_key_env %s is not set; sending no key", who, var)
    return key


def specs_from_settings(settings: Settings, environ: Mapping[str, str] | None = None) -> list[InstanceSpec]:
    """Resolve instance keys from their env vars; the overflow channel comes last."""
    env = os.environ if environ is None else environ

    def spec(item: InstanceSettings, overflow: bool) -> InstanceSpec:
        key = instance_key(env, item.api_key_env, f"instance {item.label}")
        return InstanceSpec(
            name=item.label,
            url=item.url,
            api_key=key,
            role=item.role,
            weight=item.weight,
            cap=item.max_queue or settings.dispatch.max_queue_per_instance,
            overflow=overflow,
            priority=item.scheduling_policy == "priority",
            kv_events=item.kv_events,
            kv_events_replay=item.kv_events_replay,
        )

    out = [spec(i, False) for i in settings.instances]
    if settings.overflow is not None:
        out.append(spec(settings.overflow, True))
    return out


class Fleet:
    def __init__(self, settings: Settings, speeds: SpeedEstimator) -> None:
        self._instances: dict[str, Instance] = {}
        self._retired: list[Instance] = []  # removed by reload, still finishing their leases
        self.speeds = speeds
        self._settings = settings
        # What a config says for every view (read per dispatch, so kept as plain attributes).
        self.caching = settings.dispatch.prefix_affinity  # instances' caches are modelled and shown
        self._stale = stale_after(settings.dispatch.scrape_interval)  # engine stats' trusted age
        self.slow: frozenset[str] = frozenset()  # flagged by the slow-instance detector
        self.models: frozenset[str] = frozenset()  # served by some instance (bounds metric labels)

    @property
    def health_interval(self) -> float:
        return self._settings.dispatch.health_check_interval

    def __iter__(self) -> Iterator[Instance]:
        return iter(self._instances.values())

    def __len__(self) -> int:
        return len(self._instances)

    def get(self, name: str) -> Instance:
        return self._instances[name]

    def find(self, name: str) -> Instance | None:
        return self._instances.get(name)

    def _new_instance(self, spec: InstanceSpec) -> Instance:
        d = self._settings.dispatch
        self.speeds.seed(spec.name, spec.weight)
        return Instance(
            spec,
            unhealthy_after=d.unhealthy_after,
            healthy_after=d.healthy_after,
            breaker_failures=d.breaker_failures,
            breaker_cooldown=d.breaker_cooldown,
            breaker_max_cooldown=d.breaker_max_cooldown,
            assume_up=spec.overflow,
        )

    def apply(self, settings: Settings, specs: list[InstanceSpec]) -> tuple[list[str], list[str], list[str]]:
        """Install a new instance list; returns (added, removed, changed) names."""
        self._settings = settings
        self.caching = settings.dispatch.prefix_affinity
        self._stale = stale_after(settings.dispatch.scrape_interval)
        added: list[str] = []
        changed: list[str] = []
        new: dict[str, Instance] = {}
        for spec in specs:
            old = self._instances.get(spec.name)
            if old is None or not _same_server(old.spec, spec):
                if old is None:
                    added.append(spec.name)
                else:  # another server under the old name: nothing it learned holds for this one
                    self._retire(old)
                    changed.append(spec.name)
                old = self._revived(spec)
                if old is None:
                    new[spec.name] = self._new_instance(spec)
                    continue
            if old.spec != spec:
                if spec.name not in changed:
                    changed.append(spec.name)
                if old.spec.weight != spec.weight:  # what it learned stays, priced at the new weight
                    self.speeds.seed(spec.name, spec.weight)
                old.spec = spec  # live counters and health carry over; cap/role/key take effect now
            d = settings.dispatch
            old.breaker.reconfigure(d.breaker_failures, d.breaker_cooldown, d.breaker_max_cooldown)
            old.health.reconfigure(
                unhealthy_after=settings.dispatch.unhealthy_after,
                healthy_after=settings.dispatch.healthy_after,
            )
            new[spec.name] = old
        removed = [n for n in self._instances if n not in new]
        for name in removed:
            self._retire(self._instances[name])
        self._instances = new
        for inst in new.values():  # the config's rules, the spec: each view is rebuilt
            inst._changed()
            if settings.dispatch.scrape_interval <= 0:
                inst.scrapes_off()
        self._refresh_models()
        self._retired = [i for i in self._retired if i.inflight > 0]
        return added, removed, changed

    def _retire(self, inst: Instance) -> None:
        """Out of the fleet: no new work, its speed forgotten; kept while its leases finish."""
        inst.draining = inst.retired = True
        if inst.inflight:
            self._retired.append(inst)
        self.speeds.forget(inst.name)

    def _revived(self, spec: InstanceSpec) -> Instance | None:
        """A removed (or re-pointed) instance listed again, at the same URL, while its requests
        still run (a pod back in DNS): the same object, so its cap counts them, and its breaker and
        health carry over."""
        for inst in self._retired:
            if inst.name == spec.name and _same_server(inst.spec, spec):
                self._retired.remove(inst)
                inst.draining = inst.retired = False
                self.speeds.seed(spec.name, inst.spec.weight)
                return inst
        return None

    def views(self, now: float) -> list[InstanceView]:
        """Every instance as dispatch sees it now, with what the speed estimator has learned.

        The speed is the learned one, or lower when requests still waiting for their first token
        there prove it lower now (``speed_bound``): a cold or suddenly degraded card stops drawing
        work before its slow samples complete. Each view also carries the share of its prompt tokens
        the instance's prefix cache recently left to prefill, which ``dispatch.load`` applies to the
        work booked there.

        An instance's view is rebuilt only when it may have changed (``Instance.dispatch_view``):
        a write to what it shows, the speed estimator's ``version``, its engine stats' age, its
        speed bound's TTL while requests wait there. A property test holds the kept views equal
        to fresh ones.
        """
        speeds = self.speeds
        version = speeds.settled()
        stale = self._stale
        out = []
        for inst in self._instances.values():
            view = inst._view
            if (
                view is None
                or inst._view_speeds != version
                or now - inst._view_ref > stale
                or (inst.pending and now - inst._bound_at >= BOUND_TTL)
            ):
                params, uncached = speeds.view_params(inst.spec.name)
                view = inst.dispatch_view(
                    now, stale, version=version, params=params, uncached_ratio=uncached, cache=self.caching
                )
            out.append(view)
        return out

    def any_room(self, now: float) -> bool:
        return any(i.available(now) and i.inflight < i.spec.cap for i in self._instances.values())

    def set_models(self, inst: Instance, cards: dict[str, dict[str, Any]]) -> None:
        """What an instance serves (from its /v1/models); keeps the fleet-wide set current."""
        inst.model_cards = cards
        inst.models = frozenset(cards)
        self._refresh_models()

    def _refresh_models(self) -> None:
        self.models = frozenset().union(*(i.models for i in self._instances.values()))

    def known_models(self) -> frozenset[str]:
        return self.models

    def describe_unavailable(self, now: float) -> str:
        if not self._instances:
            return "no instances are configured"
        parts = []
        for inst in self._instances.values():
            if inst.draining:
                why = "draining"
            elif not inst.up:
                why = inst.health.state.value
            elif not inst.breaker.allows(now):
                why = "ejected"
            else:
                why = "ok"
            parts.append(f"{inst.name}: {why}")
        return ", ".join(parts)

    def _speed_stats(self) -> dict[str, SpeedStat]:
        return {name: stat for name, stat in self.speeds.snapshot().items() if name in self._instances}

    def update_slow(self) -> tuple[frozenset[str], frozenset[str]]:
        """Re-run the slow-instance detector; returns (newly flagged, newly cleared)."""
        slow = slow_instances(self._speed_stats(), self.slow)
        flagged, cleared = slow - self.slow, self.slow - slow
        self.slow = slow
        return flagged, cleared

    def unsure_slow(self) -> dict[str, float]:
        """The unflagged instances whose estimate leaves a doubt, with their ratio to the fleet's."""
        return unsure_slow(self._speed_stats(), self.slow)

    def all_inflight(self) -> int:
        return sum(i.inflight for i in self._instances.values()) + sum(i.inflight for i in self._retired)


def _same_server(a: InstanceSpec, b: InstanceSpec) -> bool:
    """Whether two specs of one name are one instance: one server, probed (a fleet member) or
    assumed up (the overflow channel) alike."""
    return a.url == b.url and a.overflow == b.overflow
