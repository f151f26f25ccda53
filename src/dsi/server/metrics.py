"""Prometheus telemetry of one server: a private ``CollectorRegistry`` per app (no global state).

Series (all prefixed ``dsi_``):

- ``requests_total{endpoint,status}``: HTTP requests by status code (499: the client went away
  before the response was complete); ``request_finish_total{reason}``: generations by how they
  ended (stop, length, cancelled, error).
- ``preparing_requests`` (bodies being read, parsed, tokenised), ``queue_length``,
  ``running_requests``, ``engine_slots``: the server right now.
- histograms ``queue_time_seconds``, ``time_to_first_token_seconds`` (arrival to first
  committed token, queue included), ``inter_token_latency_seconds`` (per token: time since the
  previous committed token of the request; DSI commits accepted runs at once, so many are ~0),
  ``request_latency_seconds``.
- ``prompt_tokens_total``, ``generated_tokens_total``, ``drafted_tokens_total``,
  ``accepted_tokens_total``, ``verify_tasks_total``, ``preempted_tasks_total``, ``cancelled_tasks_total``,
  ``wasted_target_seconds_total`` (target time on tasks whose results were not used),
  ``target_busy_seconds_total`` and ``target_capacity_seconds_total`` (wall time x servers:
  ``rate(busy) / rate(capacity)`` is the pool's utilisation).
- ``target_servers_configured``, ``target_servers_in_service``, ``target_servers_lost`` and
  ``target_server_readmissions_total``: the target servers (the engines of ``--target-servers``, else the
  slots' own), read at each scrape; a lost engine is probed until it passes its start check again.
- ``load_choices_total{way,level}``: generations by the way speculation chosen by load picked (``speculative``
  or ``plain``) and the load level (running requests: 1, 2, 3-4, ...) they started at (:mod:`dsi.server.load_choice`);
  ``load_handoffs_total{to}``: requests it handed over mid-generation, by the way they went on.
- histograms per request ``acceptance_rate``, ``mean_accepted_length``, ``target_utilisation``
  (acceptance: speculative methods only, non-SI has no drafts; utilisation: DSI's target pool).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dsi.engine.stats import GenerationStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_LENGTH_BUCKETS = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0, 32.0, 64.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("dsi_requests", "HTTP requests by endpoint and status code (499: client went away)",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("dsi_request_finish", "Generations by finish reason (stop, length, cancelled, error)",
                                ["reason"], registry=r)
        self.preparing = Gauge("dsi_preparing_requests",
                               "Requests being read, parsed and tokenised (not queued yet)", registry=r)
        self.queue_length = Gauge("dsi_queue_length", "Requests waiting for an engine slot", registry=r)
        self.running = Gauge("dsi_running_requests", "Requests being generated", registry=r)
        self.slots = Gauge("dsi_engine_slots", "Engine slots (decoders)", registry=r)
        self.servers_configured = Gauge("dsi_target_servers_configured",
                                        "Target servers configured (engines of --target-servers, else the slots')",
                                        registry=r)
        self.servers_in_service = Gauge("dsi_target_servers_in_service", "Target servers taking tasks now",
                                        registry=r)
        self.servers_lost = Gauge("dsi_target_servers_lost",
                                  "Target servers out of service (a lost engine is probed until it is back)",
                                  registry=r)
        self.readmissions = Counter("dsi_target_server_readmissions",
                                    "Lost target servers that passed their start check again", registry=r)
        self._readmissions_seen = 0
        self.queue_time = Histogram("dsi_queue_time_seconds", "Time a request waited for a slot",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("dsi_time_to_first_token_seconds", "Arrival to first committed token (queue included)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dsi_inter_token_latency_seconds",
                             "Time between consecutive committed tokens of a request",
                             buckets=(0.0001, *_LATENCY_BUCKETS), registry=r)
        self.latency = Histogram("dsi_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.prompt_tokens = Counter("dsi_prompt_tokens", "Prompt tokens of generated requests", registry=r)
        self.generated_tokens = Counter("dsi_generated_tokens", "Tokens generated (committed)", registry=r)
        self.drafted = Counter("dsi_drafted_tokens", "Draft tokens proposed by the drafter", registry=r)
        self.accepted = Counter("dsi_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        # drafts the target decided (accepted + rejected); drafts never decided (after a rejection, or when
        # the request ended) are not in it. accepted / decided is the acceptance rate of every response
        self.decided = Counter("dsi_decided_drafts", "Draft tokens the target accepted or rejected", registry=r)
        self.verify_tasks = Counter("dsi_verify_tasks", "Verification tasks sent to target servers", registry=r)
        self.preempted = Counter("dsi_preempted_tasks", "Verification tasks preempted by a rejection", registry=r)
        self.cancelled = Counter("dsi_cancelled_tasks", "Verification tasks cancelled when their generation ended",
                                 registry=r)
        self.wasted = Counter("dsi_wasted_target_seconds", "Target server time on tasks whose results were not used",
                              registry=r)
        self.busy = Counter("dsi_target_busy_seconds", "Target server busy time", registry=r)
        self.capacity = Counter("dsi_target_capacity_seconds", "Wall time x number of target servers", registry=r)
        self.acceptance = Histogram("dsi_acceptance_rate", "Per-request acceptance rate of draft tokens",
                                    buckets=_RATIO_BUCKETS, registry=r)
        self.accepted_length = Histogram("dsi_mean_accepted_length", "Per-request mean run of accepted drafts",
                                         buckets=_LENGTH_BUCKETS, registry=r)
        self.utilisation = Histogram("dsi_target_utilisation", "Per-request target pool utilisation",
                                     buckets=(*_RATIO_BUCKETS, 1.5, 2.0), registry=r)
        self.load_choices = Counter("dsi_load_choices", "Generations by the way speculation chosen by load picked "
                                    "(speculative or plain) and the load level they started at", ["way", "level"],
                                    registry=r)
        self.load_handoffs = Counter("dsi_load_handoffs", "Requests handed over mid-generation by speculation chosen "
                                     "by load, by the way they went on (speculative or plain)", ["to"], registry=r)
        self.lookahead_windows = Counter("dsi_lookahead_windows", "SI verification windows whose lookahead "
                                         "speculation by load chose by goodput, by their number of drafts",
                                         ["drafts"], registry=r)

    def observe_generation(self, stats: GenerationStats, prompt_tokens: int, completion_tokens: int) -> None:
        """Record the statistics of one finished (or stopped, or cancelled) generation."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(completion_tokens)
        self.drafted.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.decided.inc(stats.accepted_tokens + stats.rejections)
        self.verify_tasks.inc(stats.verify_tasks)
        self.preempted.inc(stats.preempted_tasks)
        self.cancelled.inc(stats.cancelled_tasks)
        self.wasted.inc(stats.wasted_target_s)
        if stats.accepted_tokens + stats.rejections > 0:
            self.acceptance.observe(stats.acceptance_rate)
            self.accepted_length.observe(stats.mean_accepted_length)
        load = stats.extra.get("load")
        if load is not None:
            self.load_choices.labels(load["way"], load["level"]).inc()
            for handoff in load.get("handoffs", ()):
                self.load_handoffs.labels(handoff["to"]).inc()
            for drafts, windows in (load.get("lookaheads") or {}).items():
                self.lookahead_windows.labels(str(drafts)).inc(windows)
        if stats.method == "dsi" and stats.wall_time_s > 0:  # only DSI's target pool measures busy time
            self.busy.inc(stats.target_busy_s)
            self.capacity.inc(stats.wall_time_s * stats.num_target_servers)
            self.utilisation.observe(stats.target_utilisation)

    def set_target_servers(self, health: dict) -> None:
        """The target servers as ``health`` counts them (configured, in_service, lost, readmissions)."""
        self.servers_configured.set(health["configured"])
        self.servers_in_service.set(health["in_service"])
        self.servers_lost.set(health["lost"])
        if health["readmissions"] > self._readmissions_seen:
            self.readmissions.inc(health["readmissions"] - self._readmissions_seen)
            self._readmissions_seen = health["readmissions"]

    def render(self) -> bytes:
        return generate_latest(self.registry)
