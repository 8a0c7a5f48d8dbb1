"""Builders of Kubernetes JSON objects as the API server returns them (manifests, tests)."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def service(
    name: str,
    ns: str = "emojivoto",
    *,
    ports: list[tuple[str, int, int | str]] | None = None,
    selector: dict[str, str] | None = None,
    cluster_ip: str = "10.96.0.10",
    annotations: dict[str, str] | None = None,
) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "annotations": annotations or {}},
        "spec": {
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "selector": {"app": name} if selector is None else selector,
            "ports": [
                {"name": pname, "port": port, "targetPort": target, "protocol": "TCP"}
                for pname, port, target in (ports or [("http", 80, 8080)])
            ],
        },
    }


# Every pod's pod-template-hash: a pod owned by ReplicaSet NAME-5d8f7 belongs to Deployment NAME.
TEMPLATE_HASH = "5d8f7"


def pod(
    name: str,
    ip: str | None,
    ns: str = "emojivoto",
    *,
    app: str = "web",
    sa: str = "web",
    meshed: bool = True,
    annotations: dict[str, str] | None = None,
    container_ports: list[tuple[str, int]] | None = None,
    owner: tuple[str, str] | None = ("ReplicaSet", "web-5d8f7"),
) -> Obj:
    labels = {"app": app, "pod-template-hash": TEMPLATE_HASH}
    if meshed:
        labels["meshlet.io/control-plane-ns"] = "meshlet"
    meta: Obj = {"name": name, "namespace": ns, "labels": labels, "annotations": annotations or {}}
    if owner:
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "controller": True}
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "serviceAccountName": sa,
            "nodeName": "node-1",
            "containers": [
                {
                    "name": "app",
                    "ports": [{"name": n, "containerPort": p} for n, p in (container_ports or [])],
                }
            ],
        },
        "status": {"phase": "Running", **({"podIP": ip} if ip else {})},
    }


def endpoint_slice(
    name: str,
    service_name: str,
    endpoints: list[tuple[str, bool, str | None]],
    ns: str = "emojivoto",
    *,
    ports: list[tuple[str, int]] | None = None,
    zone: str = "zone-a",
) -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": [
            {"name": n, "port": p, "protocol": "TCP"} for n, p in (ports or [("http", 8080)])
        ],
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready},
                **({"targetRef": {"kind": "Pod", "name": pod_name}} if pod_name else {}),
                "zone": zone,
            }
            for ip, ready, pod_name in endpoints
        ],
    }


def profile(service_name: str, spec: Obj, ns: str = "emojivoto") -> Obj:
    return {
        "apiVersion": "meshlet.io/v1alpha1",
        "kind": "ServiceProfile",
        "metadata": {"name": f"{service_name}.{ns}.svc.cluster.local", "namespace": ns},
        "spec": spec,
    }
