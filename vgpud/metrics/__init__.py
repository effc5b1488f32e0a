"""Prometheus metrics: the daemon's figures over HTTP, for a scraper.

``listen`` parses the [metrics] listen address (the config validates with
it). ``snapshot`` is what the event loop collects: plain values, copied at
once from the ledger, the scheduler, the Dispatcher's counters and the
module's GET_STATS, so that a snapshot is consistent and the loop never
formats. ``families`` turns a snapshot into metric families (pure). ``wire``
encodes a snapshot for a pipe and decodes it, checking every value (pure).
``service`` is the daemon's side: it binds the port, refreshes the snapshot
on the loop at an interval and writes each new one to the pipe of
``exporter``, a child process that renders and serves the text format
(formatting each snapshot once, whatever the scrape rate), restarted when it
dies and ended with the daemon. ``sources`` wires where a snapshot's figures
come from in the running daemon.
"""
