"""Prometheus metrics: the daemon's figures over HTTP, for a scraper.

``listen`` parses the [metrics] listen address (the config validates with
it). ``snapshot`` is what the event loop collects: plain values, copied at
once from the ledger, the scheduler, the Dispatcher's counters and the
module's GET_STATS, so that a snapshot is consistent and the loop never
formats. ``families`` turns a snapshot into metric families (pure).
``service`` is the adapter: it refreshes the snapshot on the loop at an
interval and serves the text format from a thread of its own, formatting
each snapshot once, whatever the scrape rate.
"""
