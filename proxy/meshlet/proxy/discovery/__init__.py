"""Service discovery: the destination service's streams, shared per outbound target."""

from meshlet.api.backoff import Backoff
from meshlet.proxy.core.routes import Route
from meshlet.proxy.discovery.client import DestinationClient, Received, StreamRefused
from meshlet.proxy.discovery.profile import DstOverride, Profile, RetryBudgetSpec
from meshlet.proxy.discovery.resolver import Destination, DestinationClosed, Kind, Resolver

__all__ = [
    "Backoff",
    "Destination",
    "DestinationClient",
    "DestinationClosed",
    "DstOverride",
    "Kind",
    "Profile",
    "Received",
    "Resolver",
    "RetryBudgetSpec",
    "Route",
    "StreamRefused",
]
