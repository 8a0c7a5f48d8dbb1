"""Kubernetes JSON at the injector's edge: the shapes it reads and writes, and where each
workload kind keeps its pod template."""

from __future__ import annotations

from typing import Any, Final, Literal, NotRequired, TypedDict

Obj = dict[str, Any]

# kind → JSON pointer of its pod template ("" for a Pod itself).
POD_TEMPLATE_PATHS: Final = {
    "Pod": "",
    "Deployment": "/spec/template",
    "StatefulSet": "/spec/template",
    "DaemonSet": "/spec/template",
    "ReplicaSet": "/spec/template",
    "ReplicationController": "/spec/template",
    "Job": "/spec/template",
    "CronJob": "/spec/jobTemplate/spec/template",
}


class PatchOp(TypedDict):
    """One RFC 6902 operation; the injector only adds."""

    op: Literal["add"]
    path: str
    value: Any


class EnvVar(TypedDict):
    name: str
    value: NotRequired[str]
    valueFrom: NotRequired[Obj]


class HTTPGet(TypedDict):
    path: str
    port: int


class Probe(TypedDict):
    httpGet: HTTPGet
    initialDelaySeconds: NotRequired[int]
    periodSeconds: NotRequired[int]
    timeoutSeconds: NotRequired[int]
    failureThreshold: NotRequired[int]


class ContainerPort(TypedDict):
    containerPort: int
    name: str


class VolumeMount(TypedDict):
    name: str
    mountPath: str
    readOnly: NotRequired[bool]


class Container(TypedDict):
    name: str
    image: str
    imagePullPolicy: str
    command: NotRequired[list[str]]
    args: NotRequired[list[str]]
    env: NotRequired[list[EnvVar]]
    ports: NotRequired[list[ContainerPort]]
    readinessProbe: NotRequired[Probe]
    livenessProbe: NotRequired[Probe]
    startupProbe: NotRequired[Probe]
    resources: NotRequired[Obj]
    restartPolicy: NotRequired[Literal["Always"]]
    lifecycle: NotRequired[Obj]
    securityContext: Obj
    terminationMessagePolicy: str
    volumeMounts: NotRequired[list[VolumeMount]]


class Volume(TypedDict):
    name: str
    emptyDir: NotRequired[Obj]
    projected: NotRequired[Obj]
    configMap: NotRequired[Obj]
