"""What the daemon keeps in files: ``config`` (the TOML configuration),
``state`` (runtime changes to tenants, persisted atomically) and ``journal``
(the charges and channel groups of live contexts, for a restarted daemon).
"""
