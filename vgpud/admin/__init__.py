"""Administration: ``manager`` (the admin model: config + runtime state + the
ledger's limits, every change validated, persisted, then applied), ``dbus``
(the org.vgpud1 API over it), ``auth`` (who may change things),
``client`` (what vgpuctl uses to call the API) and ``names`` (the API's
D-Bus names, shared by both sides).
"""
