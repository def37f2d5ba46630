"""Route followers for routers that are not Haru's: HAProxy, nginx, Envoy, or the operator's command.

    from haru.routers import Follower, HAProxy, Nginx, Envoy, Command
    await Follower(log, fleet, "edge-1", HAProxy("/run/haproxy/admin.sock", "haru_default", slots)).run()

The plans are pure (haru.core.router_plans); what each follower applied is reported on
haru.router.<fleet>.<router> (haru.core.router_acks), which the promoter waits for before it settles
the old active.
"""

from haru.routers.command import Command
from haru.routers.envoy import Envoy
from haru.routers.errors import NotApplied, RouterError
from haru.routers.follower import Follower
from haru.routers.haproxy import HAProxy
from haru.routers.nginx import Nginx
from haru.routers.seam import RouterTarget

__all__ = ["Command", "Envoy", "Follower", "HAProxy", "Nginx", "NotApplied", "RouterError", "RouterTarget"]
