"""Timing and counting primitives used by the mechanisms, the callbacks, the planner and the commands: the
collectives a piece of code issues and their bytes (:mod:`~.collectives`), the time compute waits on them
(:mod:`~.collective_waits`), live tensor memory on any device (:mod:`~.live_memory`) and torch's own count of it
beside ours (:mod:`~.mem_tracker`), point-to-point bytes between pipeline stages (:mod:`~.p2p`). Pure PyTorch; may
import the base modules only.
"""
