"""Upcall to verdict, sans-I/O.

``base`` (the Policy interface and Request), ``dispatch`` (the Dispatcher:
every upcall to the policy and back, with its verdict checked, never
raising), ``rules`` (builders of our module's filter rules for NVIDIA
escapes), ``handles`` (where a new object's handle lies in its params, and
the handles the daemon names where the driver would generate one),
``quota`` (memory quotas: the decisions, and the completion of what each
allowed call waits for, by one table per way it completes), ``pending``
(those records), ``objects`` (objects held under tenants' object limits),
``classes`` (which classes, heap functions and UVM calls are charged,
passed or refused), ``fbview`` (the virtualized memory view), ``sched``
(channel-group tracking for the scheduler, over the quota policy) and
``events`` (what the quota policy publishes as it decides).
"""
