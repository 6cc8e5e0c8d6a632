"""`qkv serve --workers N`: N worker processes behind one set of ports (docs/operations.md, "Worker processes").

A supervisor (supervisor.py) starts the workers, restarts one that dies, and drains them all on SIGTERM. Each
worker (worker.py) is a whole server (service/server.py) binding the gRPC and HTTP ports with SO_REUSEPORT. What
a client expects to be global stays so through a local control channel (channel.py): model load and unload and
shared memory registrations are applied on every worker before they are answered, and a sequence's requests
reach the one worker that holds its state (routing.py). The metrics port is the supervisor's: each counter and
histogram summed over the workers (metrics_view.py). How many workers, and on which cores: plan.py.
"""

from service.workers.plan import worker_count

__all__ = ["worker_count"]
