"""When drafting does not pay, do not draft: a small switch with back-off, kept per sampling setting
(and per batch size) across requests: :meth:`SpeculationGate.start` opens a request under its setting
and continues that setting's back-off, :meth:`SpeculationGate.reset` starts afresh.

Every step is either *speculative* (draft, build a tree, verify n nodes) or *plain* (one target forward
on the last token, the target alone). The switch learns nothing by itself; after each speculative step
the controller reports the step's **gain**, its best predicted speedup over a plain step:

    gain = max_n S_cal(n) / S_plain,    S_plain = L_AR / (L_AR + plain overhead)

where ``S_cal`` is the speedup predicted from the calibrated acceptance, drafting and every other
overhead included, and a step whose best tree is the root alone counts as no gain (drafting and then
verifying one token is never faster than not drafting). The rule:

- keep a running gain ``G`` over speculative steps: ``G <- (1 - smoothing) * G + smoothing * gain``,
  restarted from the probe's own gain at every probe;
- while ``G > margin`` keep speculating; when it falls to ``margin`` or below, switch to plain decoding
  for ``backoff`` steps (starting at ``min_backoff``);
- after those plain steps, **probe**: draft one step again. If the probe pays, speculation resumes and
  the back-off returns to ``min_backoff``; if not, the back-off grows by ``growth`` (up to
  ``max_backoff``) and plain decoding continues.

With a drafter that never pays, drafting is limited to the probes: at most one step in
``cap + 1`` in the long run. With one that always pays, the switch never turns off.

The cap is cost-aware. A probe that does not pay costs its own time less the plain steps it replaced;
the controller reports that excess, in plain steps, after each such probe (:meth:`observe_probe_cost`),
and the gate keeps a running mean ``E`` of it. The cap is then

    cap = min(ceiling, max(max_backoff, ceil(E / probe_share)))

so in the long run probes that do not pay cost at most ``probe_share`` of plain decoding (0.5% by
default) whatever a probe costs on this hardware and under this sampling setting (``E`` is kept per
setting, as the countdown is), and never fewer than ``max_backoff`` plain steps
separate them (on the demo pair on a CPU a failed probe costs about 2.7 plain steps: a cap of about 540).
On the way to the cap, the wait after a probe that did not pay is the back-off times ``max(1, E)``
(capped): a probe that costs E plain steps more than the step it replaced costs the same share of the
wait before it as a probe that costs one.
:meth:`start` carries the countdown across the requests of one sampling setting. A request is a new
text, though, and greedy requests differ: one whose drafts are mostly accepted can follow one whose
drafts were not. So a request that starts switched off probes on its first step when enough of its
setting's recent probes paid (``start_probe``, a running share over probes): under a setting where
drafting sometimes pays, each request gets its own first look; under one where probes keep failing
(sampling at T = 1 with this drafter), the share falls and the countdown decides. The workload may
change after such a stretch, though (math prompts after chat ones), and the carried countdown, grown
over the failed probes, would then keep the new requests plain for hundreds of steps: so every
second request that starts switched off without that first look still gets it, the gap doubling (to
16 requests) while these looks do not pay and returning to 2 when one does. A drafter that never pays
then costs one look in up to 16 requests. A first-step look (either rule) that does not pay gets one
more look ``min_backoff`` steps in, the back-off unchanged: a request's first draft is its least
informed (the drafter has seen the prompt alone), and one failure there is weak evidence about the rest.

The gains the gate hears are predictions. After a probe predicted not to pay, the controller may
report the probe's *realized* gain (:meth:`observe_realized`); when its verified tree paid after all
(a calibration learnt on poor requests under-prices a new request's drafts), speculation resumes.

The gate holds state across requests, per key (a sampling setting, and for batches its size): the
countdown, the back-off, the share of probes that paid and the probe cost. :meth:`start` opens a
request (or a batch at its current size) under its key and continues that key's state;
:meth:`reset` starts the current sequence afresh. The engine keeps one gate for the whole batch and
calls :meth:`should_draft` once per step.
"""

from __future__ import annotations

import math

from bastion.utils.checks import check_int, check_number
from bastion.contract.errors import InvalidInputError

__all__ = ["SpeculationGate"]

#: weight of the newest probe in the running share of probes that paid (``start_probe``)
_PAID_WEIGHT = 0.25
#: failed probes a setting must have costed before their excess lengthens the wait after one
_EXCESS_SAMPLES = 2
#: requests starting switched off (with too few paying probes for ``start_probe``) between two
#: first-step looks: the first gap, and the largest the gap doubles to after looks that did not pay
_LOOK_GAP, _LOOK_GAP_MAX = 2, 16


class SpeculationGate:
    """Speculate-or-plain switch with exponential back-off between probes (see the module doc).

    Parameters
    ----------
    margin:
        Speculation continues while the running gain exceeds this (1.0: break-even with plain decoding;
        ``inf`` never trusts speculation, so only the probes draft).
    smoothing:
        Weight of the newest step in the running gain (1.0: decide on the last step alone).
    min_backoff, max_backoff:
        Plain steps before the first probe, and the cap of the growing back-off.
    growth:
        Factor applied to the back-off after each probe that did not pay.
    probe_share:
        The long-run share of plain decoding that probes which do not pay may cost: the back-off cap
        rises above ``max_backoff`` (up to ``ceiling``) when probes cost more than ``max_backoff *
        probe_share`` plain steps. None keeps the cap at ``max_backoff``.
    ceiling:
        The largest cap ``probe_share`` may set.
    start_probe:
        A sequence that starts switched off probes on its first step when the running share of this
        setting's probes that paid (each probe weighs ``1/4``) is at least this; None: never (the
        carried countdown alone decides when the next probe comes).
    """

    def __init__(
        self,
        *,
        margin: float = 1.0,
        smoothing: float = 0.5,
        min_backoff: int = 4,
        max_backoff: int = 256,
        growth: float = 2.0,
        probe_share: float | None = 0.005,
        ceiling: int = 4096,
        start_probe: float | None = 0.25,
    ) -> None:
        if not (isinstance(margin, (int, float)) and not isinstance(margin, bool) and margin == math.inf):
            margin = check_number("margin", margin)  # a finite margin >= 0, or inf (never trust speculation)
        smoothing = check_number("smoothing", smoothing, strict=True)
        if smoothing > 1:
            raise InvalidInputError(f"smoothing must be in (0, 1], got {smoothing!r}")
        min_backoff = check_int("min_backoff", min_backoff)
        max_backoff = check_int("max_backoff", max_backoff)
        if max_backoff < min_backoff:
            raise InvalidInputError(f"max_backoff ({max_backoff}) is below min_backoff ({min_backoff})")
        growth = check_number("growth", growth, low=1.0)
        if probe_share is not None:
            probe_share = check_number("probe_share", probe_share, strict=True)
            if probe_share > 1:
                raise InvalidInputError(f"probe_share must be in (0, 1] or None, got {probe_share!r}")
        ceiling = check_int("ceiling", ceiling)
        if start_probe is not None:
            start_probe = check_number("start_probe", start_probe)
            if start_probe > 1:
                raise InvalidInputError(f"start_probe must be in [0, 1] or None, got {start_probe!r}")
        if ceiling < max_backoff:
            raise InvalidInputError(f"ceiling ({ceiling}) is below max_backoff ({max_backoff})")
        self.margin = float(margin)
        self.smoothing = float(smoothing)
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.growth = float(growth)
        self.probe_share = None if probe_share is None else float(probe_share)
        self.ceiling = ceiling
        self.start_probe = None if start_probe is None else float(start_probe)
        #: per sampling key, the running share of probes that paid (None until its first probe)
        self._paid: dict[object, float] = {}
        #: per sampling key, the running mean of what a probe that did not pay cost beyond the plain
        #: steps it replaced, in plain steps (a failed probe at T = 0 still emits a few tokens, one at
        #: T = 1 hardly any, so the excess is the setting's own); it sets :attr:`cap`
        self._excess: dict[object, float] = {}
        self._excess_n: dict[object, int] = {}  # failed probes costed, per setting
        self._cost_due = False  # the last update was a probe that did not pay: its cost is due
        #: per sampling key, how its last sequence ended: (speculating, backoff, gain, plain steps left before the probe)
        self._ended: dict[object, tuple[bool, int, float | None, int]] = {}
        #: per sampling key: requests started switched off without a first-step look since the last
        #: look, and the gap (in such requests) before the next one
        self._unlooked: dict[object, int] = {}
        self._look_gap: dict[object, int] = {}
        self._look_pending = False  # this request's first step is such a look: its outcome sets the gap
        self._last_look = False  # the last update was such a look (a realized gain may still correct it)
        self._realized_due = False  # the last update was a probe predicted not to pay: its realized gain is due
        self._key: object = None
        self.reset()

    def start(self, key: object) -> None:
        """Start a new sequence under the sampling setting ``key``. A setting whose previous sequence
        ended with speculation switched off starts switched off and continues that countdown where it
        stopped (its next probe comes after the plain steps the back-off still had to run), so a stream
        of requests under one setting probes as one long sequence would: never a probe per request
        just because requests are shorter than the back-off. Any other setting starts speculating, as
        :meth:`reset` does. Only the speed depends on this, never the tokens."""
        if getattr(self, "_key", None) is not None:
            self._ended[self._key] = (self.speculating, self.backoff, self.gain, self.wait)
        ended = self._ended.get(key)
        self.reset()
        self._key = key
        if ended is not None and not ended[0]:
            self.speculating, self._probing = False, False
            self.backoff, self.gain, self.wait = ended[1], ended[2], ended[3]
            paid = self._paid.get(key)
            if self.start_probe is None:
                return
            if paid is not None and paid >= self.start_probe:
                self.wait = 0  # a new text under a setting where probes often pay: look at it first
                self._first_look = True
                return
            # probes rarely paid lately; the workload may have changed since (code after chat): every
            # gap-th such request still looks on its first step, the gap doubling (to a bound) while
            # the looks do not pay, so a drafter that never pays costs one look in up to 16 requests
            unlooked = self._unlooked.get(key, 0) + 1
            if unlooked >= self._look_gap.get(key, _LOOK_GAP):
                self._unlooked[key] = 0
                self.wait = 0
                self._look_pending = self._first_look = True
            else:
                self._unlooked[key] = unlooked

    def reset(self) -> None:
        """Start a new sequence: speculate on the first step (it is the first probe)."""
        self.speculating = True  # False: plain decoding, waiting for the next probe
        self.backoff = self.min_backoff  # plain steps before the next probe once switched off
        self.wait = 0  # plain steps left before the next probe
        self.gain: float | None = None  # running gain over speculative steps
        self._probing = True
        self.probes = 0  # speculative steps taken while switched off (the first step counts)
        self.plain_steps = 0
        self._cost_due = False
        self._realized_due = False
        self._look_pending = False
        self._first_look = False  # this request's first step is a look (either rule above)
        self._retry_look = False  # the next probe is the second look of a request whose first one failed

    def should_draft(self) -> bool:
        """Whether this step drafts; call exactly once per step (it counts the plain steps)."""
        if self.speculating:
            return True
        if self.wait > 0:
            self.wait -= 1
            self.plain_steps += 1
            return False
        self._probing = True
        return True

    def update(self, gain: float) -> None:
        """Report the gain of the speculative step just decided (see the module doc)."""
        gain = float(gain) if math.isfinite(gain) else 0.0
        self._cost_due = self._realized_due = False
        first_look, retry = self._first_look, self._retry_look
        self._first_look = self._retry_look = False
        self._last_look = self._look_pending or retry
        if self._probing:
            self.probes += 1
            self.gain = gain
        else:
            self.gain = gain if self.gain is None else (1 - self.smoothing) * self.gain + self.smoothing * gain
        pays = self.gain > self.margin
        if self._probing:
            last = self._paid.get(self._key)
            won = 1.0 if pays else 0.0
            self._paid[self._key] = won if last is None else last + _PAID_WEIGHT * (won - last)
            if self._look_pending:
                gap = self._look_gap.get(self._key, _LOOK_GAP)
                self._look_gap[self._key] = _LOOK_GAP if pays else min(_LOOK_GAP_MAX, 2 * gap)
                self._look_pending = False
        if pays:
            self.speculating = True
            self.backoff = self.min_backoff
            if retry:
                self._look_gap[self._key] = _LOOK_GAP
        elif self._probing and not self.speculating and first_look:
            # a request's first draft is its least informed (the drafter has seen the prompt alone): a
            # failed first-step look gets one more look min_backoff steps in, the back-off unchanged
            self.wait = self.min_backoff
            self._retry_look = True
            self._cost_due = self._realized_due = True
        elif self._probing and not self.speculating:  # a probe that did not pay: wait longer next time
            cap = self.cap
            self.backoff = min(cap, max(self.backoff + 1, int(math.ceil(self.backoff * self.growth))))
            # probes dearer than a plain step wait proportionally longer: the same share of the wait
            # (only once a few probes were costed: a cold start's first probes, timed before any estimate
            # settled or beside a burst, must not switch speculation off for long)
            known = self._excess_n.get(self._key, 0) >= _EXCESS_SAMPLES
            scale = 1.0 if self.probe_share is None or self.probe_excess is None or not known else max(1.0, self.probe_excess)
            self.wait = min(cap, int(math.ceil(self.backoff * scale)))
            self._cost_due = self._realized_due = True
        else:  # speculation stopped paying: plain decoding until the first probe
            self.speculating = False
            self.wait = self.backoff
        self._probing = False

    def observe_realized(self, gain: float) -> None:
        """Report the realized gain of the probe just verified (its committed tokens per second over a
        plain step's). The gate decides on predicted gains, and a prediction learnt on other texts can
        be wrong about this one: calibration that has just seen poor requests prices a new request's
        confident drafts low, so its probes are predicted not to pay and, verifying small trees, never
        show otherwise. A probe predicted not to pay whose verified tree nevertheless paid (``gain`` >
        ``margin``) is evidence that drafting pays here: speculation resumes and the back-off returns to
        ``min_backoff``, as after a probe predicted to pay. Only the report right after such a probe
        counts; any other is ignored."""
        if not self._realized_due:
            return
        self._realized_due = False
        if not (math.isfinite(gain) and gain > self.margin):
            return
        self._cost_due = False  # it paid: no excess to count
        self.speculating, self.backoff, self.wait, self.gain = True, self.min_backoff, 0, float(gain)
        last = self._paid.get(self._key)
        if last is not None:  # the probe counted as not paid: count it as paid
            self._paid[self._key] = min(1.0, last + _PAID_WEIGHT)
        if self._last_look:
            self._look_gap[self._key] = _LOOK_GAP

    @property
    def looking(self) -> bool:
        """Whether the next probe is a request's first-step look or its retry (scheduled by
        :meth:`start`, outside the back-off's countdown), not the countdown's own probe."""
        return self._first_look or self._retry_look

    @property
    def probe_excess(self) -> float | None:
        """The current sampling setting's running mean excess of a failed probe, in plain steps (None
        until the controller reports one)."""
        return self._excess.get(self._key)

    @property
    def cap(self) -> int:
        """The largest back-off: ``max_backoff``, raised so that probes which do not pay cost at most
        ``probe_share`` of plain decoding (see the module doc)."""
        if self.probe_share is None or self.probe_excess is None:
            return self.max_backoff
        wanted = math.ceil(self.probe_excess / self.probe_share)
        return int(min(self.ceiling, max(self.max_backoff, wanted)))

    def observe_probe_cost(self, excess_steps: float) -> None:
        """Report what the step just verified cost beyond the plain steps it replaced, in plain steps
        (its seconds over a plain step's, less the tokens it emitted). Only a probe that did not pay is
        counted; any other report is ignored."""
        if not self._cost_due:
            return
        self._cost_due = False
        if not math.isfinite(excess_steps):
            return
        excess = max(0.0, float(excess_steps))
        self._excess_n[self._key] = self._excess_n.get(self._key, 0) + 1
        last = self._excess.get(self._key)
        self._excess[self._key] = excess if last is None else 0.5 * (last + excess)

    def __repr__(self) -> str:
        return (
            f"SpeculationGate(margin={self.margin}, smoothing={self.smoothing}, min_backoff={self.min_backoff}, "
            f"max_backoff={self.max_backoff}, growth={self.growth}, probe_share={self.probe_share}, ceiling={self.ceiling}, "
            f"start_probe={self.start_probe})"
        )
