"""Launchers beyond the embedded ``local`` one (which lives in :mod:`asyncflow_core.flow.launcher`).

``ray``: every role of a run as a Ray actor (see :mod:`asyncflow_core.launchers.ray`
and docs/launchers.md). Each launcher's heavy imports load only when it is used.
"""
