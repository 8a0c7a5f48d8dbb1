"""What `meshlet check` concludes from a snapshot of the cluster (pure: objects and `now` in,
results out), in Linkerd's categories. The shell in `check.py` fetches the snapshot."""

from __future__ import annotations

import base64
import datetime as dt
import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from meshlet.api import wellknown as wk

Obj = dict[str, Any]
MIN_VERSION: Final = (1, 29)  # native sidecars
EXPIRY_WARNING: Final = dt.timedelta(days=60)
COMPONENTS: Final = (wk.DESTINATION_NAME, wk.IDENTITY_NAME, wk.INJECTOR_NAME)
# Every controller Deployment, by its pods' meshlet.io/control-plane-component: what HA covers.
CONTROLLERS: Final = {
    wk.DESTINATION_NAME: "destination", wk.IDENTITY_NAME: "identity",
    wk.INJECTOR_NAME: "proxy-injector", wk.POLICY_NAME: "policy", wk.TAP_NAME: "tap",
}  # fmt: skip
# Namespaces a webhook that fails closed must never wait on (the injector's own pods, and the
# cluster's: a Fail webhook over kube-system can keep the cluster from healing).
NEVER_WAITED_ON: Final = ("kube-system",)
# The policy controller's kinds, as `meshlet install --crds` renders them, and the Gateway API's
# routes it also watches (it is not ready until it has listed each).
POLICY_CRDS: Final = (
    *(
        f"{plural}.{wk.POLICY_API_GROUP}"
        for plural in (
            "servers",
            "authorizationpolicies",
            "meshtlsauthentications",
            "networkauthentications",
            "httplocalratelimitpolicies",
            "httproutes",
            "grpcroutes",
        )
    ),
    "httproutes.gateway.networking.k8s.io",
    "grpcroutes.gateway.networking.k8s.io",
)
# The route kinds whose status the policy controller writes: (group, version, plural).
ROUTE_APIS: Final = (
    ("gateway.networking.k8s.io", "v1", "httproutes"),
    ("gateway.networking.k8s.io", "v1", "grpcroutes"),
    (wk.POLICY_API_GROUP, "v1beta3", "httproutes"),
    (wk.POLICY_API_GROUP, "v1", "grpcroutes"),
)
MAX_NAMED: Final = 10  # routes named in one check's error


class Status(enum.Enum):
    SUCCESS = "success"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Result:
    category: str
    description: str
    status: Status
    error: str = ""
    hint: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What was read from the cluster. A value that could not be read is None with its reason
    in `errors`; an object that does not exist is None without one."""

    namespace: str
    client_error: str = ""
    version: Mapping[str, str] | None = None
    control_namespace: Obj | None = None
    crd: Obj | None = None
    deployments: Mapping[str, Obj] = field(default_factory=dict)
    pods: tuple[Obj, ...] = ()  # of the control plane
    issuer_secret: Obj | None = None
    trust_roots: Obj | None = None
    webhook: Obj | None = None
    validator: Obj | None = None  # the ValidatingWebhookConfiguration
    webhook_secret: Obj | None = None
    data_plane: tuple[Obj, ...] = ()  # meshed pods outside the control plane
    policy_crds: frozenset[str] = frozenset()  # the names of POLICY_CRDS found
    policy_deployment: Obj | None = None
    # policy controller pod → "" when its admin /ready answered 200, else what happened
    policy_ready: Mapping[str, str] = field(default_factory=dict)
    routes: tuple[Obj, ...] = ()  # of ROUTE_APIS, in every namespace
    profiles: tuple[Obj, ...] = ()  # ServiceProfiles, in every namespace
    disruption_budgets: tuple[Obj, ...] = ()  # PodDisruptionBudgets of the control plane
    # namespace → the bundle in its copy of the trust roots (the injector's, which proxies follow)
    trust_root_copies: Mapping[str, str] = field(default_factory=dict)
    cni_enabled: bool = False  # meshlet-config's cniEnabled
    cni_daemonsets: tuple[Obj, ...] = ()  # meshlet-cni's, in any namespace
    errors: Mapping[str, str] = field(default_factory=dict)


class _Fail(Exception):
    def __init__(self, error: str, status: Status = Status.ERROR) -> None:
        super().__init__(error)
        self.status = status


Check = Callable[[Snapshot, dt.datetime], str | None]  # None or a note; raises _Fail


def _load_certs(pem: str, what: str) -> list[Any]:
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(pem.encode())
    except ValueError as exc:
        raise _Fail(f"{what} are not PEM certificates: {exc}") from None
    return list(certs)


def _expiry(certs: list[Any], what: str, now: dt.datetime, warn: bool) -> None:
    for cert in certs:
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if not warn and (now < start or now > end):
            raise _Fail(
                f"{what} {cert.subject.rfc4514_string()} is not valid now"
                f" ({start:%Y-%m-%d} to {end:%Y-%m-%d})"
            )
        if warn and end - now < EXPIRY_WARNING:
            days = max(0, int((end - now).total_seconds() // 86400))
            raise _Fail(f"{what} {cert.subject.rfc4514_string()} expires in {days} days",
                        Status.WARNING)  # fmt: skip


def _anchors(s: Snapshot) -> str:
    roots = (s.trust_roots or {}).get("data") or {}
    pem = roots.get(wk.TRUST_ROOTS_KEY)
    if not pem:
        raise _Fail(
            f"ConfigMap {s.namespace}/{wk.TRUST_ROOTS_CONFIGMAP} has no {wk.TRUST_ROOTS_KEY}"
        )
    return str(pem)


def _secret(obj: Obj | None, key: str, name: str) -> str:
    data = (obj or {}).get("data") or {}
    if key not in data:
        raise _Fail(f"Secret {name} has no {key}")
    try:
        return base64.b64decode(data[key]).decode()
    except (ValueError, UnicodeDecodeError):
        raise _Fail(f"Secret {name} key {key} is not base64 PEM") from None


def _issuer_pem(s: Snapshot) -> tuple[str, str]:
    """The issuer's certificate and key: crt.pem and key.pem, or tls.crt and tls.key in a
    kubernetes.io/tls Secret (the scheme of an issuer cert-manager owns)."""
    if s.issuer_secret is None and not s.errors.get("issuer"):
        raise _Fail(f"Secret {wk.ISSUER_SECRET} not found (with an external issuer: has"
                    " cert-manager issued its Certificate?)")  # fmt: skip
    tls = (s.issuer_secret or {}).get("type") == wk.ISSUER_SCHEME_KUBERNETES
    cert, key = wk.ISSUER_KEYS[wk.ISSUER_SCHEME_KUBERNETES if tls else wk.ISSUER_SCHEME_MESHLET]
    return _secret(s.issuer_secret, cert, wk.ISSUER_SECRET), _secret(
        s.issuer_secret, key, wk.ISSUER_SECRET
    )


def _issuer(s: Snapshot) -> list[Any]:
    return _load_certs(_issuer_pem(s)[0], "issuer certificates")


# -- the checks -------------------------------------------------------------------------------


def api_client(s: Snapshot, now: dt.datetime) -> None:
    if s.client_error:
        raise _Fail(s.client_error)


def api_query(s: Snapshot, now: dt.datetime) -> None:
    if s.version is None:
        raise _Fail(s.errors.get("version", "no answer"))


def version(s: Snapshot, now: dt.datetime) -> str:
    assert s.version is not None
    major, minor = s.version.get("major", ""), s.version.get("minor", "").rstrip("+")
    if not (major.isdigit() and minor.isdigit()):
        raise _Fail(f"unexpected version {s.version.get('gitVersion')!r}")
    if (int(major), int(minor)) < MIN_VERSION:
        raise _Fail(f"Kubernetes {major}.{minor} has no native sidecars (needs 1.29)")
    return s.version.get("gitVersion", f"{major}.{minor}")


def crds(s: Snapshot, now: dt.datetime) -> None:
    if s.crd is None:
        raise _Fail(
            s.errors.get("crd", f"CustomResourceDefinition {wk.SERVICEPROFILE_CRD} not found")
        )


def crds_before_install(s: Snapshot, now: dt.datetime) -> None:
    """Before installing, a missing CRD is the next step, not a failure."""
    if s.crd is None:
        raise _Fail(s.errors.get("crd", f"{wk.SERVICEPROFILE_CRD} not installed yet"),
                    Status.WARNING)  # fmt: skip


def namespace_free(s: Snapshot, now: dt.datetime) -> None:
    if s.control_namespace is not None:
        raise _Fail(f"namespace {s.namespace} exists already", Status.WARNING)


def namespace_exists(s: Snapshot, now: dt.datetime) -> None:
    if s.control_namespace is None:
        raise _Fail(s.errors.get("namespace", f"namespace {s.namespace} not found"))


def deployments(s: Snapshot, now: dt.datetime) -> None:
    missing = [name for name in COMPONENTS if name not in s.deployments]
    if missing:
        raise _Fail("missing Deployments: " + ", ".join(missing))


def _meta(obj: Obj, field: str, key: str) -> Any:
    return ((obj.get("metadata") or {}).get(field) or {}).get(key)


def _ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pods_ready(s: Snapshot, now: dt.datetime) -> None:
    problems = []
    for component in ("destination", "identity", "proxy-injector"):
        pods = [
            p for p in s.pods if _meta(p, "labels", wk.CONTROL_PLANE_COMPONENT_LABEL) == component
        ]
        if not pods:
            problems.append(f"no {component} pod")
        elif not any(_ready(p) for p in pods):
            problems.append(f"no {component} pod is ready")
    if problems:
        raise _Fail("; ".join(problems))


def anchors_parse(s: Snapshot, now: dt.datetime) -> None:
    _load_certs(_anchors(s), "trust anchors")


def anchors_valid(s: Snapshot, now: dt.datetime) -> None:
    _expiry(_load_certs(_anchors(s), "trust anchors"), "trust anchor", now, warn=False)


def anchors_not_expiring(s: Snapshot, now: dt.datetime) -> None:
    _expiry(_load_certs(_anchors(s), "trust anchors"), "trust anchor", now, warn=True)


def issuer_chains(s: Snapshot, now: dt.datetime) -> None:
    from meshlet.controlplane.identity import ca

    cert, key = _issuer_pem(s)
    try:
        ca.load_issuer(cert.encode(), key.encode(), _anchors(s).encode())
    except ca.IssuerError as exc:
        raise _Fail(str(exc)) from None


def issuer_valid(s: Snapshot, now: dt.datetime) -> None:
    _expiry(_issuer(s), "issuer", now, warn=False)


def issuer_not_expiring(s: Snapshot, now: dt.datetime) -> None:
    _expiry(_issuer(s), "issuer", now, warn=True)


def _hook(s: Snapshot) -> Obj:
    if s.webhook is None:
        raise _Fail(s.errors.get("webhook", "MutatingWebhookConfiguration not found"))
    hooks = s.webhook.get("webhooks") or []
    if not hooks:
        raise _Fail("the MutatingWebhookConfiguration has no webhook")
    return dict(hooks[0])


def webhook_config(s: Snapshot, now: dt.datetime) -> None:
    hook = _hook(s)
    service = (hook.get("clientConfig") or {}).get("service") or {}
    if (service.get("name"), service.get("namespace")) != (wk.INJECTOR_NAME, s.namespace):
        raise _Fail(f"the webhook calls {service.get('namespace')}/{service.get('name')}")
    if hook.get("failurePolicy") == "Fail":
        waited = [ns for ns in (s.namespace, *NEVER_WAITED_ON) if not _excluded(hook, ns)]
        if waited:
            raise _Fail(f"failurePolicy is Fail and the webhook selects {', '.join(waited)}: a"
                        " down injector blocks the pods that would bring it back")  # fmt: skip


def _excluded(hook: Obj, namespace: str) -> bool:
    """Whether the webhook's namespaceSelector leaves out `namespace` by its name label."""
    selector = hook.get("namespaceSelector") or {}
    if (selector.get("matchLabels") or {}).get("kubernetes.io/metadata.name") not in (
        None, namespace,
    ):  # fmt: skip
        return True
    return any(
        e.get("key") == "kubernetes.io/metadata.name"
        and (
            (e.get("operator") == "NotIn" and namespace in (e.get("values") or []))
            or (e.get("operator") == "In" and namespace not in (e.get("values") or []))
        )
        for e in selector.get("matchExpressions") or []
    )


def _webhook_cert(s: Snapshot) -> Any:
    (cert, *_) = _load_certs(_secret(s.webhook_secret, "tls.crt", wk.INJECTOR_TLS_SECRET),
                             "webhook certificates")  # fmt: skip
    return cert


def webhook_cert(s: Snapshot, now: dt.datetime) -> None:
    from cryptography import x509

    cert = _webhook_cert(s)
    _expiry([cert], "webhook certificate", now, warn=False)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    wanted = f"{wk.INJECTOR_NAME}.{s.namespace}.svc"
    if wanted not in names.get_values_for_type(x509.DNSName):
        raise _Fail(f"the webhook certificate is not for {wanted}")
    bundle = base64.b64decode(
        str((_hook(s).get("clientConfig") or {}).get("caBundle", ""))
    ).decode()
    _signed_by_bundle(cert, bundle, "the webhook's caBundle")


def webhook_not_expiring(s: Snapshot, now: dt.datetime) -> None:
    _expiry([_webhook_cert(s)], "webhook certificate", now, warn=True)


def validator_config(s: Snapshot, now: dt.datetime) -> None:
    """The validating webhook calls the injector at /validate and trusts its certificate."""

    if s.validator is None:
        raise _Fail(s.errors.get("validator", "ValidatingWebhookConfiguration not found"))
    hooks = s.validator.get("webhooks") or []
    if not hooks:
        raise _Fail("the ValidatingWebhookConfiguration has no webhook")
    client = hooks[0].get("clientConfig") or {}
    service = client.get("service") or {}
    called = (service.get("name"), service.get("namespace"), service.get("path"))
    if called != (wk.INJECTOR_NAME, s.namespace, wk.INJECTOR_VALIDATE_PATH):
        raise _Fail(f"the validating webhook calls {called[1]}/{called[0]} at {called[2]}")
    cert = _webhook_cert(s)
    bundle = base64.b64decode(str(client.get("caBundle", ""))).decode()
    _signed_by_bundle(cert, bundle, "the validating webhook's caBundle")


def _signed_by_bundle(cert: Any, bundle: str, what: str) -> None:
    """The webhook certificate is issued by one of the roots in `bundle` (PEM)."""
    from cryptography.exceptions import InvalidSignature

    for root in _load_certs(bundle, what):
        try:
            cert.verify_directly_issued_by(root)
            return
        except (ValueError, TypeError, InvalidSignature):
            continue
    raise _Fail(f"the webhook certificate is not signed by {what}")


def _proxy_status(pod: Obj) -> Obj | None:
    status = pod.get("status") or {}
    for entry in [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]:
        if entry.get("name") == wk.PROXY_CONTAINER:
            return dict(entry)
    return None


def proxies_ready(s: Snapshot, now: dt.datetime) -> str:
    not_ready = [f"{p['metadata'].get('namespace')}/{p['metadata'].get('name')}"
                 for p in s.data_plane if not (_proxy_status(p) or {}).get("ready")]  # fmt: skip
    if not_ready:
        raise _Fail("proxies not ready: " + ", ".join(sorted(not_ready)[:10]))
    return f"{len(s.data_plane)} meshed pods"


def trust_root_copies(s: Snapshot, now: dt.datetime) -> str:
    if "trust root copies" in s.errors:
        raise _Fail(s.errors["trust root copies"])
    current = _anchors(s)
    stale = sorted(ns for ns, pem in s.trust_root_copies.items() if pem != current)
    if stale:
        raise _Fail("copies holding another bundle: " + _named(stale))
    following = {str(p["metadata"].get("namespace")) for p in s.data_plane if _mounts_copy(p)}
    missing = sorted(following - set(s.trust_root_copies))
    if missing:  # injected offline, or the injector could not write it: they keep their anchors
        raise _Fail("meshed pods but no copy (their proxies keep the anchors they started with)"
                    " in: " + _named(missing), Status.WARNING)  # fmt: skip
    count = len(s.trust_root_copies)
    return f"{count} namespace{'' if count == 1 else 's'}"


def _mounts_copy(pod: Obj) -> bool:
    volumes = (pod.get("spec") or {}).get("volumes") or []
    return any(v.get("name") == wk.TRUST_ROOTS_VOLUME for v in volumes)


def _follows_current_copy(s: Snapshot, pod: Obj) -> bool:
    """The pod's proxy follows its namespace's copy of the trust roots, which holds the
    current bundle."""
    namespace = str((pod.get("metadata") or {}).get("namespace", ""))
    return _mounts_copy(pod) and s.trust_root_copies.get(namespace) == _anchors(s)


def proxies_trust_root(s: Snapshot, now: dt.datetime) -> None:
    from meshlet.controlplane.injector.patch import trust_root_sha256

    current = trust_root_sha256(_anchors(s))
    stale = [
        f"{p['metadata'].get('namespace')}/{p['metadata'].get('name')}"
        for p in s.data_plane
        if _meta(p, "annotations", wk.TRUST_ROOT_SHA256_ANNOTATION) != current
        and not _follows_current_copy(s, p)
    ]
    if stale:
        raise _Fail("pods on another trust root (restart them): " + ", ".join(sorted(stale)[:10]))


def policy_crds(s: Snapshot, now: dt.datetime) -> None:
    failed = [s.errors[k] for k in POLICY_CRDS if k in s.errors]
    if failed:
        raise _Fail(failed[0])
    missing = [name for name in POLICY_CRDS if name not in s.policy_crds]
    if missing:
        raise _Fail("CustomResourceDefinitions not found: " + ", ".join(missing))


def policy_deployment(s: Snapshot, now: dt.datetime) -> str:
    deploy = s.policy_deployment
    if deploy is None:
        raise _Fail(
            s.errors.get(
                f"deployment {wk.POLICY_NAME}",
                f"Deployment {s.namespace}/{wk.POLICY_NAME} not found",
            )
        )
    wanted = (deploy.get("spec") or {}).get("replicas", 1)
    ready = (deploy.get("status") or {}).get("readyReplicas") or 0
    if not ready:
        raise _Fail(f"Deployment {s.namespace}/{wk.POLICY_NAME}: 0 of {wanted} replicas ready")
    return f"{ready} of {wanted} ready"


def policy_admin_ready(s: Snapshot, now: dt.datetime) -> None:
    if not s.policy_ready:
        raise _Fail("no running policy controller pod")
    if not any(reason == "" for reason in s.policy_ready.values()):
        raise _Fail("; ".join(f"{pod}: {reason}" for pod, reason in sorted(s.policy_ready.items())))


def _route_name(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    group = str(obj.get("apiVersion", "")).split("/")[0]
    return f"{obj.get('kind')}.{group} {meta.get('namespace')}/{meta.get('name')}"


def _refs(obj: Obj) -> list[Obj]:
    refs = (obj.get("spec") or {}).get("parentRefs")
    return [r for r in refs if isinstance(r, dict)] if isinstance(refs, list) else []


def _service_parents(obj: Obj) -> list[tuple[str, str]]:
    ns = str((obj.get("metadata") or {}).get("namespace") or "default")
    return [
        (str(r.get("namespace") or ns), str(r.get("name")))
        for r in _refs(obj)
        if str(r.get("kind", "")).lower() == "service" and r.get("group", "core") in ("", "core")
    ]


def _served(obj: Obj) -> bool:
    """Whether the policy controller serves a route: a Service or a Server parent."""
    return bool(_service_parents(obj)) or any(
        r.get("kind") == "Server" and r.get("group") == wk.POLICY_API_GROUP for r in _refs(obj)
    )


def _named(items: list[str]) -> str:
    more = len(items) - MAX_NAMED
    return "; ".join(items[:MAX_NAMED]) + (f"; and {more} more" if more > 0 else "")


def _route_errors(s: Snapshot) -> None:
    failed = [s.errors[k] for k in ("routes", "profiles") if k in s.errors]
    if failed:
        raise _Fail(failed[0], Status.WARNING)


def routes_accepted(s: Snapshot, now: dt.datetime) -> str | None:
    """Each route the controller serves has its status entries, all Accepted and resolved."""
    _route_errors(s)
    problems = []
    served = [obj for obj in s.routes if _served(obj)]
    for obj in served:
        listed = (obj.get("status") or {}).get("parents") or []
        entries = [
            e
            for e in listed
            if isinstance(e, dict) and e.get("controllerName") == wk.POLICY_CONTROLLER_NAME
        ]
        if not entries:
            problems.append(f"{_route_name(obj)}: no status from the policy controller yet")
            continue
        for entry in entries:
            ref = entry.get("parentRef")
            parent: Obj = ref if isinstance(ref, dict) else {}
            conditions = entry.get("conditions")
            for c in conditions if isinstance(conditions, list) else []:
                if (
                    isinstance(c, dict)
                    and c.get("type") in ("Accepted", "ResolvedRefs")
                    and c.get("status") != "True"
                ):
                    said = f": {c['message']}" if c.get("message") else ""
                    where = f"{parent.get('kind')} {parent.get('namespace')}/{parent.get('name')}"
                    what = f"{c.get('type')} {c.get('status')} ({c.get('reason')}){said}"
                    problems.append(f"{_route_name(obj)} on {where}: {what}")
    if problems:
        raise _Fail(_named(problems), Status.WARNING)
    return f"{len(served)} routes" if served else None


def overrides_policy(profile: Obj) -> bool:
    """Whether proxies use a ServiceProfile instead of its Service's policy (Linkerd's rule):
    it has `routes` or `dstOverrides`."""
    raw = profile.get("spec")
    spec: Obj = raw if isinstance(raw, dict) else {}
    return any(isinstance(spec.get(k), list) and spec[k] for k in ("routes", "dstOverrides"))


def routes_not_shadowed(s: Snapshot, now: dt.datetime) -> None:
    """No route has a parent Service whose ServiceProfile proxies use instead of its policy."""
    _route_errors(s)
    profiles = {
        (str(meta.get("namespace")), str(meta.get("name")))
        for p in s.profiles
        if isinstance(meta := p.get("metadata"), dict) and overrides_policy(p)
    }
    shadowed = []
    for obj in s.routes:
        for ns, name in _service_parents(obj):
            fqn = f"{name}.{ns}.svc.{wk.CLUSTER_DOMAIN}"
            if (ns, fqn) in profiles:
                shadowed.append(
                    f"{_route_name(obj)}: ServiceProfile {ns}/{fqn} (with routes or dstOverrides)"
                    " is used instead"
                )
    if shadowed:
        raise _Fail(_named(sorted(set(shadowed))), Status.WARNING)


# -- high availability: run when the control plane is installed for it -----------------------


def is_ha(s: Snapshot) -> bool:
    """Installed with --ha (or values that ask for any part of it): disruption budgets, a
    webhook that fails closed, or a controller with more than one replica."""
    hooks = (s.webhook or {}).get("webhooks") or []
    return bool(
        s.disruption_budgets
        or any(h.get("failurePolicy") == "Fail" for h in hooks)
        or any(((d.get("spec") or {}).get("replicas") or 1) > 1 for d in s.deployments.values())
    )


def _pods_of(s: Snapshot, component: str) -> list[Obj]:
    return [p for p in s.pods if _meta(p, "labels", wk.CONTROL_PLANE_COMPONENT_LABEL) == component]


def ha_replicas(s: Snapshot, now: dt.datetime) -> None:
    short = []
    for name in CONTROLLERS:
        deploy = s.deployments.get(name)
        if deploy is None:
            short.append(f"{name}: no Deployment")
            continue
        ready = (deploy.get("status") or {}).get("readyReplicas") or 0
        if ready < 2:
            wanted = (deploy.get("spec") or {}).get("replicas", 1)
            short.append(f"{name}: {ready} of {wanted} ready")
    if short:
        raise _Fail("; ".join(short), Status.WARNING)


def ha_budgets(s: Snapshot, now: dt.datetime) -> None:
    problems = []
    for name, component in CONTROLLERS.items():
        budget = next(
            (b for b in s.disruption_budgets
             if ((b.get("spec") or {}).get("selector") or {}).get("matchLabels")
             == {wk.CONTROL_PLANE_COMPONENT_LABEL: component}),
            None,
        )  # fmt: skip
        if budget is None:
            problems.append(f"{name}: no PodDisruptionBudget")
            continue
        status = budget.get("status") or {}
        if not status.get("disruptionsAllowed"):
            problems.append(
                f"{name}: no disruption allowed now ({status.get('currentHealthy', 0)} of"
                f" {status.get('expectedPods', 0)} healthy): a drain waits for it"
            )
    if problems:
        raise _Fail("; ".join(problems), Status.WARNING)


def ha_spread(s: Snapshot, now: dt.datetime) -> None:
    crowded = []
    for name, component in CONTROLLERS.items():
        nodes = [str((p.get("spec") or {}).get("nodeName") or "") for p in _pods_of(s, component)]
        placed = [n for n in nodes if n]
        if len(placed) != len(set(placed)):
            crowded.append(f"{name}: {len(placed)} pods on {len(set(placed))} node(s)")
    if crowded:
        raise _Fail("; ".join(crowded) + ": losing one node takes several replicas",
                    Status.WARNING)  # fmt: skip


def ha_webhook(s: Snapshot, now: dt.datetime) -> None:
    if _hook(s).get("failurePolicy") != "Fail":
        raise _Fail("failurePolicy is Ignore: a pod created while no injector answers starts"
                    " unmeshed", Status.WARNING)  # fmt: skip


# -- meshlet-cni: run when the control plane has cniEnabled ------------------------------------


def cni_daemonset(s: Snapshot, now: dt.datetime) -> None:
    if "cni daemonsets" in s.errors:
        raise _Fail(f"cannot list DaemonSets: {s.errors['cni daemonsets']}")
    if not s.cni_daemonsets:
        raise _Fail("cniEnabled is set but no meshlet-cni DaemonSet exists: every new meshed pod"
                    " fails its validator")  # fmt: skip


def cni_ready(s: Snapshot, now: dt.datetime) -> str:
    short = []
    for ds in s.cni_daemonsets:
        status = ds.get("status") or {}
        wanted, ready = status.get("desiredNumberScheduled", 0), status.get("numberReady", 0)
        if ready < wanted or not wanted:
            meta = ds.get("metadata") or {}
            short.append(f"{meta.get('namespace')}/{meta.get('name')}: {ready} of {wanted}"
                         " nodes ready")  # fmt: skip
    if short:
        raise _Fail("; ".join(short) + ": pods made on the others are not redirected")
    return f"{sum((d.get('status') or {}).get('numberReady', 0) for d in s.cni_daemonsets)} nodes"


def _validator_failed(pod: Obj) -> bool:
    for status in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if status.get("name") != wk.VALIDATOR_CONTAINER:
            continue
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            ended = state.get("terminated") or {}
            if ended.get("exitCode", 0) != 0:
                return not status.get("ready")
    return False


def cni_validators(s: Snapshot, now: dt.datetime) -> None:
    held = sorted(f"{p['metadata'].get('namespace')}/{p['metadata'].get('name')}"
                  for p in s.data_plane if _validator_failed(p))  # fmt: skip
    if held:
        raise _Fail(f"not redirected, held by their validators: {_named(held)}")


# (category, description, check, hint); a category stops at its first error.
Entry = tuple[str, str, Callable[[Snapshot, dt.datetime], Any], str]

API: Final[tuple[Entry, ...]] = (
    ("kubernetes-api", "can initialize the client", api_client,
     "give --kubeconfig or set KUBECONFIG to a cluster's kubeconfig"),
    ("kubernetes-api", "can query the Kubernetes API", api_query,
     "is the cluster running and reachable from here? try kubectl version"),
    ("kubernetes-version", "is running the minimum Kubernetes API version (1.29)", version,
     "upgrade the cluster to Kubernetes 1.29 or later: the charts need native sidecars"),
)  # fmt: skip
PRE: Final[tuple[Entry, ...]] = (
    ("pre-kubernetes-setup", "control plane namespace does not already exist", namespace_free,
     "meshlet seems installed: run meshlet check"),
    ("pre-kubernetes-setup", "ServiceProfile CRD is installed", crds_before_install,
     "install it first: meshlet install --crds | kubectl apply -f -"),
)  # fmt: skip
INSTALLED: Final[tuple[Entry, ...]] = (
    ("meshlet-crds", "ServiceProfile CRD is installed", crds,
     "run: meshlet install --crds | kubectl apply -f -"),
    ("meshlet-crds", "policy CRDs are installed", policy_crds,
     "run: meshlet install --crds | kubectl apply -f -"),
    ("meshlet-existence", "control plane namespace exists", namespace_exists,
     "run: meshlet install | kubectl apply -f -"),
    ("meshlet-existence", "control plane Deployments exist", deployments,
     "run: meshlet install | kubectl apply -f -"),
    ("meshlet-existence", "control plane pods are ready", pods_ready,
     "kubectl -n meshlet get pods; kubectl -n meshlet describe pods"),
    ("meshlet-identity", "trust anchors are valid certificates", anchors_parse,
     "reinstall with valid --identity-trust-anchors-file"),
    ("meshlet-identity", "trust anchors are within their validity period", anchors_valid,
     "create a new CA (meshlet identity ca create) and reinstall"),
    ("meshlet-identity", "trust anchors are valid for at least 60 days", anchors_not_expiring,
     "plan a trust anchor rotation"),
    ("meshlet-identity", "issuer certificate is issued by the trust anchors", issuer_chains,
     "create the issuer from the installed anchors: meshlet identity issuer create"),
    ("meshlet-identity", "issuer certificate is within its validity period", issuer_valid,
     "rotate the issuer: meshlet identity issuer create, then update the Secret"),
    ("meshlet-identity", "issuer certificate is valid for at least 60 days", issuer_not_expiring,
     "rotate the issuer soon: meshlet identity issuer create, then update the Secret"),
    ("meshlet-identity", "every namespace's copy of the trust roots is current", trust_root_copies,
     "the injector rewrites the copies (ConfigMap meshlet-trust-roots) within its reload"
     " interval; kubectl -n meshlet logs deploy/meshlet-proxy-injector says why it did not"),
    ("meshlet-webhook", "proxy-injector webhook is configured", webhook_config,
     "run: meshlet install | kubectl apply -f -"),
    ("meshlet-webhook", "proxy-injector webhook certificate is valid", webhook_cert,
     "reinstall to make a new webhook certificate"),
    ("meshlet-webhook", "proxy-injector webhook certificate is valid for at least 60 days",
     webhook_not_expiring, "reinstall to make a new webhook certificate"),
    ("meshlet-webhook", "validating webhook is configured", validator_config,
     "run: meshlet install | kubectl apply -f -"),
    ("meshlet-policy", "policy controller Deployment is ready", policy_deployment,
     f"kubectl -n meshlet describe deploy/{wk.POLICY_NAME}; run: meshlet install | kubectl apply"
     " -f - if it is missing"),
    ("meshlet-policy", "policy controller answers on its admin /ready", policy_admin_ready,
     f"kubectl -n meshlet logs deploy/{wk.POLICY_NAME} -c policy"),
    ("meshlet-policy", "routes are accepted by the policy controller", routes_accepted,
     "kubectl -n NAMESPACE get httproute NAME -o yaml shows each condition; fix the parent"
     " Service or the backendRefs it names"),
    ("meshlet-policy", "no route is shadowed by a ServiceProfile", routes_not_shadowed,
     "while a Service's ServiceProfile has routes or dstOverrides, proxies use the profile and"
     " ignore the Service's routes and retry/timeout annotations: delete the ServiceProfile"
     " (kubectl -n NAMESPACE delete serviceprofile NAME) to use the routes"),
    ("meshlet-data-plane", "data plane proxies are ready", proxies_ready,
     "kubectl describe the pods named; meshlet diagnostics proxy-metrics POD"),
    ("meshlet-data-plane", "data plane proxies use the current trust root", proxies_trust_root,
     "restart the pods named so that they are meshed with the current anchors"),
)  # fmt: skip


HA: Final[tuple[Entry, ...]] = (
    ("meshlet-ha-checks", "controllers have more than one replica ready", ha_replicas,
     "meshlet upgrade --ha | kubectl apply -f -; kubectl -n meshlet get pods for those not"
     " ready"),
    ("meshlet-ha-checks", "each controller has a PodDisruptionBudget that allows a drain",
     ha_budgets, "meshlet upgrade --ha | kubectl apply -f - adds the budgets; a budget that"
     " allows nothing waits for its pods to be ready (kubectl -n meshlet get pods)"),
    ("meshlet-ha-checks", "controller replicas are on distinct nodes", ha_spread,
     "add nodes, or keep enablePodAntiAffinity=true so the scheduler spreads them"),
    ("meshlet-ha-checks", "the proxy injector refuses pods while it is down", ha_webhook,
     "meshlet upgrade --set webhookFailurePolicy=Fail | kubectl apply -f -"),
)  # fmt: skip

CNI: Final[tuple[Entry, ...]] = (
    ("meshlet-cni-plugin", "meshlet-cni DaemonSet exists", cni_daemonset,
     "meshlet install-cni | kubectl apply -f - (docs/cni.md)"),
    ("meshlet-cni-plugin", "meshlet-cni is ready on every node", cni_ready,
     "kubectl -n meshlet-cni get pods -o wide; kubectl -n meshlet-cni logs ds/meshlet-cni"),
    ("meshlet-cni-plugin", "no meshed pod is held by its network validator", cni_validators,
     "delete the pods named once meshlet-cni is ready on their nodes, so they are made again"),
)  # fmt: skip

GATES: Final = frozenset({"kubernetes-api", "meshlet-existence"})


def evaluate(snapshot: Snapshot, now: dt.datetime, pre: bool = False) -> Iterator[Result]:
    """Every check in order. After an error in kubernetes-api or meshlet-existence nothing else
    is run (the rest would only repeat it); after one elsewhere, the rest of that category is
    skipped."""
    failed: set[str] = set()
    ha = HA if not pre and is_ha(snapshot) else ()
    cni = CNI if not pre and snapshot.cni_enabled else ()
    for category, description, check, hint in (*API, *(PRE if pre else INSTALLED), *cni, *ha):
        if category in failed or failed & GATES:
            continue
        try:
            note = check(snapshot, now)
        except _Fail as exc:
            if exc.status is Status.ERROR:
                failed.add(category)
            yield Result(category, description, exc.status, str(exc), hint)
            continue
        yield Result(category, description + (f" ({note})" if note else ""), Status.SUCCESS)
