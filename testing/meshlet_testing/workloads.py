"""Workloads as the API server hands them to the injector: pods, a Deployment, the
AdmissionReview around them."""

from __future__ import annotations

import copy
from typing import Any

Obj = dict[str, Any]


def pod(
    annotations: dict[str, str] | None = None,
    *,
    name: str = "web-5d4f8c9b7-x2x7q",
    init: bool = False,
    host_network: bool = False,
    probes: bool = False,
) -> Obj:
    """A pod as a ReplicaSet of Deployment `web` creates it; with `probes`, HTTP probes on
    ports of their own (9090, 9091) besides the declared 8080."""
    spec: Obj = {
        "serviceAccountName": "web",
        "containers": [
            {
                "name": "web",
                "image": "ghcr.io/example/web:1.0",
                "ports": [{"containerPort": 8080, "name": "http"}],
            }
        ],
    }
    if probes:
        spec["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 9090}}
        spec["containers"][0]["livenessProbe"] = {"httpGet": {"path": "/live", "port": 9091}}
    if init:
        spec["initContainers"] = [
            {"name": "migrate", "image": "ghcr.io/example/migrate:1.0", "args": ["up"]}
        ]
    if host_network:
        spec["hostNetwork"] = True
    metadata: Obj = {
        "name": name,
        "namespace": "emojivoto",
        "labels": {"app": "web", "pod-template-hash": "5d4f8c9b7"},
        "ownerReferences": [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": "web-5d4f8c9b7",
                "uid": "8c1a9f3e-0000-4000-8000-000000000001",
                "controller": True,
            }
        ],
    }
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def deployment(annotations: dict[str, str] | None = None) -> Obj:
    source = pod(annotations)
    metadata: Obj = {"labels": {"app": "web"}}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "emojivoto"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": metadata, "spec": copy.deepcopy(source["spec"])},
        },
    }


def ready_pod(template: Obj, name: str, namespace: str, ip: str = "10.42.0.9") -> Obj:
    """The pod a Deployment's ReplicaSet would run, with the kubelet's status: ready."""
    spec = copy.deepcopy(template["spec"])
    statuses = [{"name": c["name"], "ready": True, "restartCount": 0, "image": c["image"],
                 "imageID": "", "state": {"running": {}}} for c in spec["containers"]]  # fmt: skip
    inits = [{"name": c["name"], "ready": c.get("restartPolicy") == "Always", "restartCount": 0,
              "image": c["image"], "imageID": "", "state": {"running": {}}}
             for c in spec.get("initContainers", [])]  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**copy.deepcopy(template["metadata"]), "name": name, "namespace": namespace},
        "spec": spec,
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": statuses,
            "initContainerStatuses": inits,
        },
    }


def review(obj: Obj | None, *, namespace: str = "emojivoto", operation: str = "CREATE") -> Obj:
    kind = obj["kind"] if obj else "Pod"
    group, _, version = (obj or {"apiVersion": "v1"})["apiVersion"].rpartition("/")
    request: Obj = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": kind.lower() + "s"},
        "namespace": namespace,
        "operation": operation,
        "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
        "object": obj,
        "dryRun": False,
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
