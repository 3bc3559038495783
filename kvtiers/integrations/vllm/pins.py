"""Pins from vLLM requests: a request field that pins its prompt's chunks in kvtiers' tiers.

A request whose ``kv_transfer_params`` hold ``"kvtiers_pin"`` (an OpenAI completion request's
``kv_transfer_params`` field, or ``SamplingParams(extra_args={"kv_transfer_params": ...})``
offline) asks each kvtiers secondary tier to pin the chunks of that request it holds: those a
lookup of the request finds there (HIT) and those vLLM's cascade stores there for it. Its
value is ``{"ttl": seconds}`` (a soft pin, at most :data:`MAX_TTL`) or ``{"hard": true}``
(until the tier closes: vLLM has no unpin). vLLM's ``ReqContext`` carries the request's
``kv_transfer_params`` to every tier call, so nothing of vLLM is wrapped here.

The pins are asked for once per scheduler step (in ``get_finished_jobs``), in one ``pin`` call
per lifetime, so a pin of a tier that answers over the network (p2p) costs one round trip per
step, not one per chunk. A refused pin (a tier without the hook, a pin past its cap) is logged
once per reason, and counted; the request itself is served as without the field. vLLM's own
caches (the device cache, the CPU primary tier) do not take pins: the chunks are kept in the
kvtiers tiers, from which vLLM promotes them instead of recomputing them (docs/pins.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ...engine.pins import DEFAULT_MAX_TTL, check_ttl

log = logging.getLogger("kvtiers.integrations.vllm")

PIN_FIELD = "kvtiers_pin"  #: the key of ``kv_transfer_params`` that asks for a pin
MAX_TTL = DEFAULT_MAX_TTL  #: seconds: the longest soft pin a request may ask for


def requested_pin(req_context: Any) -> tuple[bool, float | None]:
    """``(wanted, seconds)`` of a request's ``kvtiers_pin`` (``seconds`` None: hard); ``(False,
    None)`` without the field. A bad value is a one-line ``ValueError``."""
    params = getattr(req_context, "kv_transfer_params", None)
    if not isinstance(params, dict) or PIN_FIELD not in params:
        return False, None
    want = params[PIN_FIELD]
    if not isinstance(want, dict) or not set(want) <= {"ttl", "hard"} or not want:
        raise ValueError(f"kv_transfer_params.{PIN_FIELD} must be {{\"ttl\": seconds}} or {{\"hard\": true}}, "
                         f"got {want!r}")
    hard = want.get("hard", False)
    if not isinstance(hard, bool):
        raise ValueError(f"kv_transfer_params.{PIN_FIELD}: hard must be true or false, got {hard!r}")
    try:
        return True, check_ttl(want.get("ttl"), hard, MAX_TTL)
    except ValueError as e:
        raise ValueError(f"kv_transfer_params.{PIN_FIELD}: {str(e).removeprefix('pin: ')}") from None


class RequestPins:
    """The pins one kvtiers secondary tier is asked for by requests, gathered over a step.

    ``counts``: chunk keys by event (``pinned``, ``refused``, ``bad_field``: requests whose
    field was not understood)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._want: dict[float | None, dict[bytes, None]] = {}
        self._said: set[str] = set()
        self.counts: Counter[str] = Counter()

    def note(self, keys: Iterable[bytes], req_context: Any) -> None:
        """``keys`` of a request were found in or stored to the tier: pin them if it asks."""
        try:
            wanted, seconds = requested_pin(req_context)
        except ValueError as e:
            self.counts["bad_field"] += 1
            self._say(f"kvtiers tier {self.tier!r}: request not pinned: {e}")
            return
        if wanted:
            self._want.setdefault(seconds, {}).update(dict.fromkeys(keys))

    def flush(self, handle: Any) -> None:
        """Ask the tier for the pins gathered since the last flush (one ``pin`` per lifetime)."""
        want, self._want = self._want, {}
        for seconds, keys in want.items():
            if not keys:
                continue
            try:
                why = handle.pin(list(keys), seconds)
            except Exception as e:  # a tier's pin hook must answer, not raise: count it as a refusal
                why = f"{type(e).__name__}: {e}"
            if why is None:
                self.counts["pinned"] += len(keys)
            else:
                self.counts["refused"] += len(keys)
                self._say(f"kvtiers tier {self.tier!r}: pin of {len(keys)} chunk(s) refused: {why}")

    def _say(self, line: str) -> None:
        if line not in self._said and len(self._said) < 64:  # once per reason, and a bounded memory of them
            self._said.add(line)
            log.warning("%s", line)
