"""``lease-sidecar operator``: the one Deployment that serves every opted-in namespace.

It runs the admission webhook that injects the sidecar (:mod:`sidecar.injector`) and a
reconciler that keeps the ``lease-role`` labels true for every lease group
(:mod:`.reconciler`, deciding by :mod:`.labels`). kopf and the ``kubernetes`` client live
here, never in the sidecar process: the sidecar only PATCHes its own pod on each
transition and demotes stale leaders when its term begins (sidecar.publish.pod_label).
"""
