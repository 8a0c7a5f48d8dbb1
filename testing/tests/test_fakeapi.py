"""Drives the fake API server with the real, unmodified `kubernetes` client."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client, config, watch

from meshlet_testing.fakeapi import FakeKubeAPI

NS = "default"
Event = dict[str, Any]


@pytest.fixture
def v1(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


def pod(name: str, labels: dict[str, str] | None = None, image: str = "app:1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels or {}},
        "spec": {"containers": [{"name": "app", "image": image}]},
    }


def v1_service(name: str, port: int = 80) -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name=name, labels={"app": name}),
        spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=port)]),
    )


class Watcher:
    """Runs `Watch.stream(...)` in a thread, recording events and how the stream ended."""

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.watch = watch.Watch()
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(func, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, func: Callable[..., Any], args: Any, kwargs: Any) -> None:
        try:
            for event in self.watch.stream(func, *args, **kwargs):
                self.events.append(event)
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended.set()

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def wait_for(self, predicate: Callable[[list[Event]], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.events):
                return True
            time.sleep(0.02)
        return predicate(self.events)

    def close(self, api: FakeKubeAPI) -> None:
        self.watch.stop()
        api.break_watches()  # unblocks the stream if no event arrives to notice stop()
        assert self.ended.wait(5), "the watch thread did not end"


def test_service_create_get_list_replace_delete(v1: client.CoreV1Api) -> None:
    created = v1.create_namespaced_service(NS, v1_service("web"))
    assert created.metadata.uid and created.metadata.creation_timestamp is not None
    assert created.kind == "Service" and created.metadata.namespace == NS

    got = v1.read_namespaced_service("web", NS)
    assert got.metadata.resource_version == created.metadata.resource_version
    listed = v1.list_namespaced_service(NS)
    assert [s.metadata.name for s in listed.items] == ["web"]
    assert int(listed.metadata.resource_version) >= int(created.metadata.resource_version)

    got.spec.ports[0].port = 8080
    replaced = v1.replace_namespaced_service("web", NS, got)
    assert replaced.spec.ports[0].port == 8080
    assert int(replaced.metadata.resource_version) > int(got.metadata.resource_version)
    assert replaced.metadata.uid == created.metadata.uid

    with pytest.raises(client.ApiException) as stale:
        v1.replace_namespaced_service("web", NS, got)  # still carries the old resourceVersion
    assert stale.value.status == 409
    assert json.loads(stale.value.body)["reason"] == "Conflict"

    with pytest.raises(client.ApiException) as dup:
        v1.create_namespaced_service(NS, v1_service("web"))
    assert dup.value.status == 409
    assert json.loads(dup.value.body)["reason"] == "AlreadyExists"

    deleted = v1.delete_namespaced_service("web", NS)
    assert deleted.metadata.name == "web"
    with pytest.raises(client.ApiException) as missing:
        v1.read_namespaced_service("web", NS)
    assert missing.value.status == 404
    status = json.loads(missing.value.body)
    assert (status["kind"], status["status"], status["reason"]) == ("Status", "Failure", "NotFound")
    with pytest.raises(client.ApiException) as gone:
        v1.delete_namespaced_service("web", NS)
    assert gone.value.status == 404


def test_pod_lifecycle_and_selectors(api: FakeKubeAPI, v1: client.CoreV1Api) -> None:
    body = client.V1Pod(
        metadata=client.V1ObjectMeta(name="a", labels={"app": "web", "tier": "front"}),
        spec=client.V1PodSpec(containers=[client.V1Container(name="app", image="web:1")]),
    )
    v1.create_namespaced_pod(NS, body)
    api.apply(pod("b", {"app": "web"}))
    api.apply({**pod("c", {"app": "db"}), "metadata": {"name": "c", "namespace": "other"}})

    def names(pods: Any) -> list[str]:
        return [p.metadata.name for p in pods.items]

    assert names(v1.list_namespaced_pod(NS)) == ["a", "b"]
    assert names(v1.list_namespaced_pod(NS, label_selector="app=web,tier=front")) == ["a"]
    assert names(v1.list_namespaced_pod(NS, label_selector="tier!=front")) == ["b"]
    assert names(v1.list_namespaced_pod(NS, field_selector="metadata.name=b")) == ["b"]
    assert names(v1.list_pod_for_all_namespaces()) == ["a", "b", "c"]
    with pytest.raises(client.ApiException) as bad:
        v1.list_namespaced_pod(NS, label_selector="app in (web)")
    assert bad.value.status == 400

    current = v1.read_namespaced_pod("a", NS)
    current.spec.containers[0].image = "web:2"
    assert v1.replace_namespaced_pod("a", NS, current).spec.containers[0].image == "web:2"
    assert api.get("v1", "Pod", "a", NS)["spec"]["containers"][0]["image"] == "web:2"

    assert v1.delete_namespaced_pod("a", NS).metadata.name == "a"
    assert api.get("v1", "Pod", "a", NS) is None
    with pytest.raises(client.ApiException) as missing:
        v1.read_namespaced_pod("a", NS)
    assert missing.value.status == 404


def test_secret_delete_answers_a_success_status(v1: client.CoreV1Api) -> None:
    secret = client.V1Secret(metadata=client.V1ObjectMeta(name="s"), string_data={"k": "v"})
    v1.create_namespaced_secret(NS, secret)
    answer = v1.delete_namespaced_secret("s", NS)
    assert answer["kind"] == "Status" and answer["status"] == "Success"
    assert answer["details"]["name"] == "s"


def test_watch_streams_live_changes_in_order(api: FakeKubeAPI, v1: client.CoreV1Api) -> None:
    rv = v1.list_namespaced_pod(NS).metadata.resource_version
    w = Watcher(v1.list_namespaced_pod, NS, resource_version=rv)
    assert api.wait_for_watches(1)
    api.apply(pod("p"))
    api.apply(pod("p", image="app:2"))
    api.delete("v1", "Pod", "p", NS)
    assert w.wait_for(lambda ev: len(ev) >= 3)
    w.close(api)
    assert w.types() == ["ADDED", "MODIFIED", "DELETED"]
    assert all(isinstance(e["object"], client.V1Pod) for e in w.events)
    versions = [int(e["object"].metadata.resource_version) for e in w.events]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert w.events[1]["object"].spec.containers[0].image == "app:2"


def test_watch_replays_history_after_resource_version(
    api: FakeKubeAPI, v1: client.CoreV1Api
) -> None:
    api.apply(pod("before"))
    rv = v1.list_namespaced_pod(NS).metadata.resource_version
    api.apply(pod("p"))
    api.apply(pod("p", image="app:2"))
    api.delete("v1", "Pod", "p", NS)
    stream = watch.Watch().stream(
        v1.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=1
    )
    events = [(e["type"], e["object"].metadata.name) for e in stream]
    assert events == [("ADDED", "p"), ("MODIFIED", "p"), ("DELETED", "p")]


@pytest.mark.parametrize("start", [{}, {"resource_version": "0"}])
def test_watch_from_unset_or_zero_version_starts_with_current_state(
    api: FakeKubeAPI, v1: client.CoreV1Api, start: dict[str, str]
) -> None:
    api.apply(pod("a"))
    api.apply(pod("b"))
    api.apply({**pod("c"), "metadata": {"name": "c", "namespace": "other"}})
    stream = watch.Watch().stream(v1.list_namespaced_pod, NS, timeout_seconds=1, **start)
    assert [(e["type"], e["object"].metadata.name) for e in stream] == [
        ("ADDED", "a"),
        ("ADDED", "b"),
    ]


def test_watch_label_selector_turns_relabels_into_added_and_deleted(
    api: FakeKubeAPI, v1: client.CoreV1Api
) -> None:
    rv = api.resource_version
    api.apply(pod("p", {"app": "web"}))
    api.apply(pod("p", {"app": "db"}))
    api.apply(pod("p", {"app": "web"}))
    stream = watch.Watch().stream(
        v1.list_namespaced_pod, NS, label_selector="app=web", resource_version=rv, timeout_seconds=1
    )
    assert [e["type"] for e in stream] == ["ADDED", "DELETED", "ADDED"]


def test_python_side_delete_carries_a_new_resource_version(api: FakeKubeAPI) -> None:
    applied = api.apply(pod("p"))
    deleted = api.delete("v1", "Pod", "p", NS)
    assert int(deleted["metadata"]["resourceVersion"]) > int(applied["metadata"]["resourceVersion"])
    assert deleted["metadata"]["uid"] == applied["metadata"]["uid"]


def test_endpointslices_list_and_watch(api: FakeKubeAPI, api_client: client.ApiClient) -> None:
    discovery = client.DiscoveryV1Api(api_client)
    rv = discovery.list_namespaced_endpoint_slice(NS).metadata.resource_version
    api.apply(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "web-abc",
                "namespace": NS,
                "labels": {"kubernetes.io/service-name": "web"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }
    )
    listed = discovery.list_namespaced_endpoint_slice(
        NS, label_selector="kubernetes.io/service-name=web"
    )
    assert [s.endpoints[0].addresses for s in listed.items] == [["10.0.0.1"]]
    stream = watch.Watch().stream(
        discovery.list_namespaced_endpoint_slice, NS, resource_version=rv, timeout_seconds=1
    )
    events = list(stream)
    assert [e["type"] for e in events] == ["ADDED"]
    assert isinstance(events[0]["object"], client.V1EndpointSlice)
    assert events[0]["object"].ports[0].port == 8080


def test_serviceprofiles_list_and_watch(api: FakeKubeAPI, api_client: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(api_client)
    group, version, plural = "meshlet.io", "v1alpha1", "serviceprofiles"
    profile = {
        "apiVersion": "meshlet.io/v1alpha1",
        "kind": "ServiceProfile",
        "metadata": {"name": "web.default.svc.cluster.local"},
        "spec": {"routes": [{"name": "GET /", "condition": {"method": "GET"}}]},
    }
    created = custom.create_namespaced_custom_object(group, version, NS, plural, profile)
    assert created["metadata"]["uid"]
    listed = custom.list_namespaced_custom_object(group, version, NS, plural)
    assert listed["kind"] == "ServiceProfileList"
    assert [p["spec"] for p in listed["items"]] == [profile["spec"]]
    rv = listed["metadata"]["resourceVersion"]
    api.delete("meshlet.io/v1alpha1", "ServiceProfile", "web.default.svc.cluster.local", NS)
    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object,
        group,
        version,
        NS,
        plural,
        resource_version=rv,
        timeout_seconds=1,
    )
    events = list(stream)
    assert [e["type"] for e in events] == ["DELETED"]
    assert events[0]["object"]["metadata"]["name"] == "web.default.svc.cluster.local"


def test_watch_from_compacted_version_raises_410_after_one_retry(
    api: FakeKubeAPI, v1: client.CoreV1Api
) -> None:
    old = v1.list_namespaced_pod(NS).metadata.resource_version
    api.apply(pod("p"))
    api.compact()
    before = len(api.requests)
    with pytest.raises(client.ApiException) as expired:
        list(watch.Watch().stream(v1.list_namespaced_pod, NS, resource_version=old))
    assert expired.value.status == 410
    assert expired.value.reason.startswith("Expired: too old resource version")
    # Without timeout_seconds the client retries once from the same version, then raises.
    watches = [path for _, path in api.requests[before:] if "watch=true" in path]
    assert len(watches) == 2 and all(f"resourceVersion={old}" in p for p in watches)


def test_watch_from_compacted_version_with_timeout_raises_410_at_once(
    api: FakeKubeAPI, v1: client.CoreV1Api
) -> None:
    old = api.resource_version
    api.apply(pod("p"))
    api.compact()
    before = len(api.requests)
    stream = watch.Watch().stream(
        v1.list_namespaced_pod, NS, resource_version=old, timeout_seconds=5
    )
    with pytest.raises(client.ApiException) as expired:
        next(stream)
    assert expired.value.status == 410
    assert len(api.requests) - before == 1
    # The compaction point itself is still a valid place to start from.
    now = api.resource_version
    assert (
        list(
            watch.Watch().stream(
                v1.list_namespaced_pod, NS, resource_version=now, timeout_seconds=1
            )
        )
        == []
    )


def test_abrupt_break_raises_protocol_error_and_server_keeps_serving(
    api: FakeKubeAPI, v1: client.CoreV1Api
) -> None:
    w = Watcher(v1.list_namespaced_pod, NS, resource_version=api.resource_version)
    assert api.wait_for_watches(1)
    api.break_watches()
    assert w.ended.wait(5)
    assert isinstance(w.error, urllib3.exceptions.ProtocolError)
    assert api.wait_for_watches(0)
    api.apply(pod("after"))
    assert [p.metadata.name for p in v1.list_namespaced_pod(NS).items] == ["after"]


def test_graceful_break_makes_the_client_resume_from_its_last_version(
    api: FakeKubeAPI, v1: client.CoreV1Api
) -> None:
    w = Watcher(v1.list_namespaced_pod, NS, resource_version=api.resource_version)
    assert api.wait_for_watches(1)
    api.apply(pod("a"))
    assert w.wait_for(lambda ev: len(ev) == 1)
    last_seen = w.events[0]["object"].metadata.resource_version
    api.break_watches(graceful=True)
    assert w.wait_for(lambda _: sum("watch=true" in p for _, p in api.requests) == 2)
    assert api.requests[-1][1].startswith(
        f"/api/v1/namespaces/default/pods?resourceVersion={last_seen}&"
    )
    assert api.wait_for_watches(1)
    api.apply(pod("b"))
    assert w.wait_for(lambda ev: len(ev) == 2)
    assert w.error is None and not w.ended.is_set()
    w.close(api)
    assert [e["object"].metadata.name for e in w.events] == ["a", "b"]


def test_bookmarks_arrive_periodically(api: FakeKubeAPI, v1: client.CoreV1Api) -> None:
    api.apply(pod("p"))
    w = Watcher(v1.list_namespaced_pod, NS, allow_watch_bookmarks=True, timeout_seconds=5)
    assert w.wait_for(lambda ev: [e["type"] for e in ev].count("BOOKMARK") >= 2)
    bookmark = next(e for e in w.events if e["type"] == "BOOKMARK")
    assert bookmark["raw_object"] == {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": api.resource_version},
    }
    assert w.watch.resource_version == api.resource_version
    w.close(api)


def test_bookmark_on_demand_and_only_when_allowed() -> None:
    with (
        FakeKubeAPI(bookmark_interval=3600) as slow,
        client.ApiClient(slow.client_configuration()) as c,
    ):
        core = client.CoreV1Api(c)
        opted = Watcher(core.list_namespaced_pod, NS, allow_watch_bookmarks=True)
        plain = Watcher(core.list_namespaced_pod, NS)
        assert slow.wait_for_watches(2)
        slow.bookmark()
        assert opted.wait_for(lambda ev: len(ev) == 1, timeout=2)
        assert opted.types() == ["BOOKMARK"]
        time.sleep(0.3)
        assert plain.events == []
        opted.close(slow)
        plain.close(slow)


def test_timeout_seconds_ends_the_stream(api: FakeKubeAPI, v1: client.CoreV1Api) -> None:
    started = time.monotonic()
    assert list(watch.Watch().stream(v1.list_namespaced_pod, NS, timeout_seconds=1)) == []
    assert 0.9 <= time.monotonic() - started < 3


def test_stop_ends_open_watches_and_idle_connections_promptly() -> None:
    api = FakeKubeAPI().start()
    with (
        client.ApiClient(api.client_configuration()) as watching,
        client.ApiClient(api.client_configuration()) as idle,
    ):
        client.CoreV1Api(idle).list_namespace()  # leaves a kept-alive connection in its pool
        w = Watcher(client.CoreV1Api(watching).list_namespaced_pod, NS)
        assert api.wait_for_watches(1)
        started = time.monotonic()
        api.stop()
        assert time.monotonic() - started < 2
        assert w.ended.wait(5)
    assert w.error is not None  # the client cannot reconnect to a stopped server


def test_concurrent_writers_and_watchers_see_every_change_in_order(
    api: FakeKubeAPI, v1: client.CoreV1Api
) -> None:
    rv = api.resource_version
    watchers = [Watcher(v1.list_namespaced_pod, NS, resource_version=rv) for _ in range(4)]
    assert api.wait_for_watches(4)

    def write(prefix: str) -> None:
        for i in range(25):
            api.apply(pod(f"{prefix}-{i}"))

    writers = [threading.Thread(target=write, args=(p,)) for p in "ab"]
    for t in writers:
        t.start()
    for t in writers:
        t.join(10)
    for w in watchers:
        # Generous: four streams of 50 events deserialized by the client on a loaded machine.
        assert w.wait_for(lambda ev: len(ev) >= 50, timeout=30.0), f"{len(w.events)} events"
    # Only then closed: closing one breaks every open watch, so a watcher still receiving
    # would lose the rest of its stream.
    for w in watchers:
        assert len(w.events) == 50
        versions = [int(e["object"].metadata.resource_version) for e in w.events]
        assert versions == sorted(set(versions))
        w.close(api)


def test_token_review(api: FakeKubeAPI, api_client: client.ApiClient) -> None:
    auth = client.AuthenticationV1Api(api_client)
    sa = "system:serviceaccount:default:web"
    api.add_token("good", sa, groups=["system:serviceaccounts"])
    api.add_token("revoked", sa, authenticated=False)

    def review(token: str, audiences: list[str] | None = None) -> Any:
        spec = client.V1TokenReviewSpec(token=token, audiences=audiences)
        return auth.create_token_review(client.V1TokenReview(spec=spec)).status

    ok = review("good", ["identity.meshlet.io", "other"])
    assert ok.authenticated is True and ok.error is None
    assert ok.user.username == sa and ok.user.groups == ["system:serviceaccounts"]
    assert ok.audiences == ["identity.meshlet.io"]

    for status in (
        review("unknown", ["identity.meshlet.io"]),
        review("revoked", ["identity.meshlet.io"]),
        review("good", ["somebody-else"]),
        review("good"),  # no audiences: the API server's own, which the token is not for
    ):
        assert status.authenticated is False
        assert status.error and status.user is None

    api.fail_token_reviews = True
    with pytest.raises(client.ApiException) as failed:
        review("good", ["identity.meshlet.io"])
    assert failed.value.status == 500


def test_token_reviews_are_create_only(api: FakeKubeAPI) -> None:
    status, body = raw_request(api, "GET", "/apis/authentication.k8s.io/v1/tokenreviews")
    assert status == 405 and body["reason"] == "MethodNotAllowed"


@pytest.mark.parametrize("token", [None, "wrong"])
def test_requests_need_the_bearer_token(api: FakeKubeAPI, token: str | None) -> None:
    configuration = client.Configuration(host=api.url)
    if token is not None:
        configuration.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(configuration) as c, pytest.raises(client.ApiException) as denied:
        client.CoreV1Api(c).list_namespace()
    assert denied.value.status == 401
    assert json.loads(denied.value.body)["reason"] == "Unauthorized"


def test_kubeconfig_works_with_the_client_loader(api: FakeKubeAPI, tmp_path: Path) -> None:
    path = api.write_kubeconfig(tmp_path / "kubeconfig")
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "mesh"}})
    with config.new_client_from_config(config_file=str(path)) as c:
        assert [n.metadata.name for n in client.CoreV1Api(c).list_namespace().items] == ["mesh"]


def raw_request(
    api: FakeKubeAPI, method: str, path: str, body: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection(api.url.removeprefix("http://"), timeout=5)
    try:
        headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_raw_watch_stream_is_chunked_json_lines(api: FakeKubeAPI) -> None:
    api.apply(pod("p"))
    conn = http.client.HTTPConnection(api.url.removeprefix("http://"), timeout=5)
    try:
        headers = {"Authorization": f"Bearer {api.token}"}
        conn.request("GET", "/api/v1/pods?watch=1&timeoutSeconds=1", headers=headers)
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Transfer-Encoding") == "chunked"
        assert response.getheader("Content-Type") == "application/json"
        lines = response.read().decode().splitlines()
    finally:
        conn.close()
    events = [json.loads(line) for line in lines]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "p")]
    assert events[0]["object"]["kind"] == "Pod"


def test_malformed_json_is_a_400_and_the_server_keeps_answering(api: FakeKubeAPI) -> None:
    status, body = raw_request(api, "POST", "/api/v1/namespaces/default/pods", b"{not json")
    assert status == 400
    assert (body["kind"], body["status"], body["code"]) == ("Status", "Failure", 400)
    status, body = raw_request(api, "POST", "/api/v1/namespaces/default/pods", b"[1, 2]")
    assert status == 400
    status, body = raw_request(api, "GET", "/api/v1/namespaces/default/pods")
    assert status == 200 and body["kind"] == "PodList"


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/widgets",
        "/apis/meshlet.io/v9/serviceprofiles",
        "/api/v1/pods/loose-pod",
        "/api/v1/namespaces/default/namespaces",
        "/api/v1/namespaces/default/pods/p/status",
        "/healthz",
    ],
)
def test_unknown_paths_are_a_404_status(api: FakeKubeAPI, path: str) -> None:
    status, body = raw_request(api, "GET", path)
    assert status == 404
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "the server could not find the requested resource",
        "reason": "NotFound",
        "code": 404,
        "details": {},
    }


def test_version_endpoint(api_client: client.ApiClient) -> None:
    info = client.VersionApi(api_client).get_code()
    assert (info.major, info.minor, info.git_version) == ("1", "33", "v1.33.1")


def test_more_kinds_through_the_client(api: FakeKubeAPI, api_client: client.ApiClient) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": pod("x")},
    }
    api.apply(deployment)
    api.apply({"apiVersion": "admissionregistration.k8s.io/v1",
               "kind": "MutatingWebhookConfiguration", "metadata": {"name": "hook"}})  # fmt: skip
    api.apply({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
               "metadata": {"name": "serviceprofiles.meshlet.io"}})  # fmt: skip
    got = client.AppsV1Api(api_client).read_namespaced_deployment("web", NS)
    assert got.spec.selector.match_labels == {"app": "web"}
    hooks = client.AdmissionregistrationV1Api(api_client).list_mutating_webhook_configuration()
    assert [h.metadata.name for h in hooks.items] == ["hook"]
    crd = client.ApiextensionsV1Api(api_client).read_custom_resource_definition(
        "serviceprofiles.meshlet.io", _preload_content=False
    )
    assert json.loads(crd.data)["metadata"]["name"] == "serviceprofiles.meshlet.io"


def test_pod_proxy_reaches_the_pods_port(api: FakeKubeAPI, api_client: client.ApiClient) -> None:
    import http.server

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"path {self.path}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api.apply({**pod("web-1"), "status": {"podIP": "127.0.0.1"}})
        port = server.server_address[1]
        body = client.CoreV1Api(api_client).connect_get_namespaced_pod_proxy_with_path(
            f"web-1:{port}", NS, "metrics"
        )
        assert body == "path /metrics\n"
        with pytest.raises(client.ApiException) as missing:
            client.CoreV1Api(api_client).connect_get_namespaced_pod_proxy_with_path(
                f"nope:{port}", NS, "metrics"
            )
        assert missing.value.status == 404
    finally:
        server.shutdown()
        server.server_close()


def test_pod_proxy_follows_the_pod_network(api: FakeKubeAPI, api_client: client.ApiClient) -> None:
    """`expose` sends a pod IP and port to a test's server, as the pod network would."""
    import http.server

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"request_total 1\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api.apply({**pod("web-1"), "status": {"phase": "Running", "podIP": "10.42.0.7"}})
        api.expose("10.42.0.7", 4191, ("127.0.0.1", server.server_address[1]))
        body = client.CoreV1Api(api_client).connect_get_namespaced_pod_proxy_with_path(
            "web-1:4191", NS, "metrics"
        )
        assert body == "request_total 1\n"
    finally:
        server.shutdown()
        server.server_close()


def echo_server() -> tuple[Any, int]:
    import socketserver

    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while data := self.request.recv(65536):
                self.request.sendall(data.upper())

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def recv_exactly(sock: Any, n: int) -> bytes:
    data = b""
    while len(data) < n and (chunk := sock.recv(n - len(data))):
        data += chunk
    return data


def test_port_forward_carries_bytes_both_ways(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    from kubernetes.stream import portforward

    server, port = echo_server()
    try:
        api.apply({**pod("web-1"), "status": {"phase": "Running", "podIP": "10.42.0.7"}})
        api.expose("10.42.0.7", 8086, ("127.0.0.1", port))
        forward = portforward(
            client.CoreV1Api(api_client).connect_get_namespaced_pod_portforward,
            "web-1", NS, ports="8086",
        )  # fmt: skip
        sock = forward.socket(8086)
        sock.settimeout(5)
        big = b"x" * 200_000  # several frames, 64-bit lengths
        sock.sendall(b"hello " + big)
        assert recv_exactly(sock, 6 + len(big)) == b"HELLO " + big.upper()
        sock.close()
        assert forward.error(8086) is None
        assert ("GET", f"/api/v1/namespaces/{NS}/pods/web-1/portforward?ports=8086") in api.requests
    finally:
        server.shutdown()
        server.server_close()


def test_port_forward_reports_what_the_kubelet_would(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    from kubernetes.stream import portforward

    v1 = client.CoreV1Api(api_client)
    with pytest.raises(client.ApiException) as missing:
        portforward(v1.connect_get_namespaced_pod_portforward, "nope", NS, ports="8086")
    assert "404" in str(missing.value.reason)
    api.apply({**pod("pending"), "status": {"phase": "Pending"}})
    with pytest.raises(client.ApiException) as pending:
        portforward(v1.connect_get_namespaced_pod_portforward, "pending", NS, ports="8086")
    assert "400" in str(pending.value.reason)

    api.apply({**pod("web-1"), "status": {"phase": "Running", "podIP": "10.42.0.7"}})
    server, port = echo_server()
    server.shutdown()
    server.server_close()  # nothing listens there any more
    api.expose("10.42.0.7", 8086, ("127.0.0.1", port))
    forward = portforward(v1.connect_get_namespaced_pod_portforward, "web-1", NS, ports="8086")
    sock = forward.socket(8086)
    sock.settimeout(5)
    assert sock.recv(10) == b""  # the pod side refused: the port's socket is closed
    sock.close()
    assert "error forwarding port 8086 to pod web-1" in (forward.error(8086) or "")


def test_forbidden_resources_answer_403(api: FakeKubeAPI, v1: client.CoreV1Api) -> None:
    api.forbidden.add("namespaces")
    with pytest.raises(client.ApiException) as refused:
        v1.read_namespace("default")
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert message == (
        'namespaces "default" is forbidden: User "system:serviceaccount:default:fake" cannot get'
        ' resource "namespaces" in API group "" at the cluster scope'
    )
    assert v1.list_namespaced_pod(NS).items == []  # other resources still answer


def test_the_status_subresource_of_the_route_kinds() -> None:
    """As the API server serves a CRD with `subresources: {status: {}}`: writes to the object
    keep its status and count spec changes in metadata.generation; /status takes a JSON merge
    patch of the status only, checked against a resourceVersion it names."""
    from meshlet_testing.fakeapi import POLICY_RESOURCES, RESOURCES

    gw = "gateway.networking.k8s.io"
    route = {"apiVersion": f"{gw}/v1", "kind": "HTTPRoute",
             "metadata": {"name": "r", "namespace": NS}, "spec": {"hostnames": ["a.example"]},
             "status": {"parents": ["set on create"]}}  # fmt: skip
    path = f"/apis/{gw}/v1/namespaces/{NS}/httproutes/r/status"
    with FakeKubeAPI(resources=RESOURCES + POLICY_RESOURCES) as fake:
        created = fake.apply(route)
        assert created["metadata"]["generation"] == 1 and "status" not in created
        written = fake.patch_status(f"{gw}/v1", "HTTPRoute", "r", {"status": {"parents": []}}, NS)
        assert written["status"] == {"parents": []} and written["metadata"]["generation"] == 1
        relabelled = fake.apply({**route, "metadata": {**route["metadata"], "labels": {"a": "b"}}})
        assert relabelled["metadata"]["generation"] == 1 and relabelled["status"] == {"parents": []}
        edited = fake.apply({**route, "spec": {"hostnames": ["b.example"]}})
        assert edited["metadata"]["generation"] == 2 and edited["status"] == {"parents": []}

        status, body = raw_request(fake, "GET", path)
        assert status == 200 and body["metadata"]["name"] == "r"
        status, body = raw_request(fake, "PATCH", path, b'{"status": {"parents": []}}')
        assert (status, body["reason"]) == (415, "UnsupportedMediaType")  # sent as JSON
        version = created["metadata"]["resourceVersion"]
        changed = {"parents": [{"controllerName": "x/y"}]}
        stale = json.dumps({"metadata": {"resourceVersion": version}, "status": changed}).encode()
        conn = http.client.HTTPConnection(fake.url.removeprefix("http://"), timeout=5)
        try:
            headers = {"Authorization": f"Bearer {fake.token}",
                       "Content-Type": "application/merge-patch+json"}  # fmt: skip
            conn.request("PATCH", path, body=stale, headers=headers)
            response = conn.getresponse()
            assert response.status == 409 and json.loads(response.read())["reason"] == "Conflict"
        finally:
            conn.close()
        status, _ = raw_request(fake, "GET", f"/api/v1/namespaces/{NS}/services/s/status")
        assert status == 404  # a kind without a status subresource here
