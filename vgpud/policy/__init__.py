"""Upcall to verdict, sans-I/O.

``base`` (the Policy interface and Request), ``dispatch`` (the Dispatcher:
every upcall to the policy and back, with its verdict checked, never
raising), ``rules`` (builders of our module's filter rules for NVIDIA
escapes), ``quota`` (memory quotas and the virtualized memory view),
``sched`` (channel-group tracking for TDMA, over the quota policy) and
``simple`` (the policies without state: allow, and deny-class for tests).
"""
