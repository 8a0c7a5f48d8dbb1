"""The demo application as Kubernetes objects: the local mesh's topology (web → api with three
replicas, one slower, and a canary → store; a load generator calling web), for a real cluster.

The namespace is annotated for injection, so the mesh's webhook adds every pod's proxy; the
Services, api's HTTPRoute and the store's policy are the local mesh's own objects. Every app runs
the demo image (`python -m meshlet.cli.demo.apps`) as UID 1000, not the proxy's 2102, whose
traffic the iptables rules let past the proxy. An api pod fails every call while its fault flag
(`/tmp/fail`, in the pod) exists: `kubectl exec` creates it.
"""

from __future__ import annotations

from typing import Any, Final

from meshlet.api import wellknown
from meshlet.cli.demo import topology

FAULT_FLAG: Final = "/tmp/fail"
APP_UID: Final = 1000
# The api Deployments: name → (replicas, delay in seconds). api-slow's pod is api's slow replica:
# a Deployment of its own, as one pod of a Deployment cannot be made slower than the others.
API_DEPLOYMENTS: Final = {"api": (2, 0.0), "api-slow": (1, topology.SLOW_DELAY)}


def manifests(
    image: str, *, rate: float = 20.0, pull_policy: str = "IfNotPresent"
) -> list[dict[str, Any]]:
    """Every object of the demo, in the order to apply them."""
    ns = topology.NAMESPACE
    objs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": ns,
                "annotations": {wellknown.INJECT_ANNOTATION: wellknown.INJECT_ENABLED},
            },
        }
    ]
    for sa in ("web", "api", topology.CANARY, "store", "load"):
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": sa, "namespace": ns},
            }
        )
    for files in topology.manifests_static().values():
        for obj in files:
            objs.append(_cluster_service(obj) if obj["kind"] == "Service" else obj)
    web, api, store = (topology.service(n) for n in ("web", "api", "store"))
    env_pod = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]

    def deployment(
        name: str,
        app: str,
        sa: str,
        replicas: int,
        args: list[str],
        port: int | None,
        annotations: dict[str, str] | None = None,
        probeless: bool = False,
    ) -> dict[str, Any]:
        container: dict[str, Any] = {
            "name": app,
            "image": image,
            "imagePullPolicy": pull_policy,
            "args": args,
            "env": [*env_pod, {"name": "GRPC_DNS_RESOLVER", "value": "native"}],
            "securityContext": {
                "runAsUser": APP_UID,
                "runAsGroup": APP_UID,
                "allowPrivilegeEscalation": False,
            },
        }
        if port is not None:
            container["ports"] = [{"name": app, "containerPort": port}]
        if port is not None and not probeless:
            container["readinessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 2}
        labels = {"app": sa, "deployment": name}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "labels": {"app": sa}},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels, "annotations": annotations or {}},
                    "spec": {"serviceAccountName": sa, "containers": [container]},
                },
            },
        }

    for name, (replicas, delay) in API_DEPLOYMENTS.items():
        objs.append(
            deployment(
                name,
                "api",
                "api",
                replicas,
                [
                    "api",
                    "--listen",
                    f"0.0.0.0:{topology.API_PORT}",
                    "--pod",
                    "$(POD_NAME)",
                    "--delay",
                    str(delay),
                    "--fail-flag",
                    FAULT_FLAG,
                ],
                topology.API_PORT,
            )
        )
    objs.append(
        deployment(
            topology.CANARY,
            "api",
            topology.CANARY,
            1,
            [
                "api",
                "--listen",
                f"0.0.0.0:{topology.API_PORT}",
                "--pod",
                "$(POD_NAME)",
                "--fail-flag",
                FAULT_FLAG,
            ],
            topology.API_PORT,
        )
    )
    opaque = {wellknown.OPAQUE_PORTS_ANNOTATION: str(topology.STORE_PORT)}
    objs.append(
        deployment(
            "store",
            "store",
            "store",
            1,
            [
                "store",
                "--listen",
                f"0.0.0.0:{topology.STORE_PORT}",
                "--pod",
                "$(POD_NAME)",
            ],
            topology.STORE_PORT,
            opaque,
            # No TCP probe: the kubelet's connect reaches the store's proxy, which accepts it
            # whatever the app does (a probe of the proxy, not of the store), and the store's
            # policy, admitting only web's identity, would count every probe as a denial.
            probeless=True,
        )
    )
    objs.append(
        deployment(
            "web",
            "web",
            "web",
            1,
            [
                "web",
                "--listen",
                f"0.0.0.0:{topology.WEB_PORT}",
                "--pod",
                "$(POD_NAME)",
                "--api",
                api.authority,
                "--store",
                store.authority,
            ],
            topology.WEB_PORT,
        )
    )
    objs.append(
        deployment(
            "load",
            "load",
            "load",
            1,
            [
                "load",
                "--target",
                web.authority,
                "--rate",
                f"{rate:g}",
                "--stats",
                "/tmp/stats.json",
            ],
            None,
        )
    )
    return objs


def _cluster_service(obj: dict[str, Any]) -> dict[str, Any]:
    """The local mesh's Service with its address left to the cluster and its selector set."""
    spec = {k: v for k, v in obj["spec"].items() if k not in ("clusterIP", "clusterIPs")}
    spec["selector"] = {"app": obj["metadata"]["name"]}
    metadata = {
        k: v for k, v in obj["metadata"].items() if k in ("name", "namespace", "annotations")
    }
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}
