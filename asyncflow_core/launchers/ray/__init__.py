"""The ``ray`` launcher: rollout replicas, trainer and reward workers as Ray actors, the store on its ray deployment.

The flow runtime (stages, ledger, staleness bookkeeping) stays in the driver
process; it talks to each remote role through a proxy that implements the
role's interface (:class:`~asyncflow_core.interfaces.RolloutEngine`,
:class:`~asyncflow_core.interfaces.TrainEngine`, a reward pool), so the
stages run unchanged. Every proxy watches its actor with heartbeats that have
deadlines: see docs/launchers.md for what happens when one dies.

Modules: :mod:`.config` (the options, no Ray import), :mod:`.actors` (what
runs inside the actors), :mod:`.watch` (an actor and its heartbeat, seen from
the driver), :mod:`.remote` (the driver-side proxies), the weight path
(:mod:`.handles` what the driver stages, :mod:`.weight_actors` the actors'
side, :mod:`.weights` the driver's side), :mod:`.ranks` (trainer ranks as
actors), :mod:`.launcher` (starting Ray, placement groups, the launcher
itself). Imports go one way: watch and handles import no other module here.
"""
