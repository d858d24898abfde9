"""The cluster layer's host-side logic, no JAX and no Ray: the router and the exact prefix
index it reads. The simulator and the server run the same objects."""

from medha_jax.cluster.prefix_index import CacheEvent, PrefixIndex
from medha_jax.cluster.router import (ROUTING_POLICIES, Decision, NoHealthyReplica, ReplicaStatus,
                                      RouteRequest, Router, RouterSnapshot, RoutingConfig, decide)

__all__ = ["ROUTING_POLICIES", "CacheEvent", "Decision", "NoHealthyReplica", "PrefixIndex",
           "ReplicaStatus", "RouteRequest", "Router", "RouterSnapshot", "RoutingConfig", "decide"]
