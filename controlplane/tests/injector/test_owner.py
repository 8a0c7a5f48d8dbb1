"""The owner label's value from a pod's own metadata."""

from __future__ import annotations

from meshlet.controlplane.injector.owner import Owner, of_pod, of_workload, valid_label_value


def ref(kind: str, name: str, controller: bool = True) -> dict[str, object]:
    return {"kind": kind, "name": name, "controller": controller}


def test_replicaset_with_template_hash_stands_for_its_deployment() -> None:
    meta = {
        "ownerReferences": [ref("ReplicaSet", "web-5d4f8")],
        "labels": {"pod-template-hash": "5d4f8"},
    }
    assert of_pod(meta) == Owner("deployment", "web")


def test_a_bare_replicaset_stays_one() -> None:
    assert of_pod({"ownerReferences": [ref("ReplicaSet", "web")]}) == Owner("replicaset", "web")


def test_the_controller_reference_wins() -> None:
    meta = {"ownerReferences": [ref("ConfigMap", "x", False), ref("StatefulSet", "db")]}
    assert of_pod(meta) == Owner("statefulset", "db")


def test_pods_without_owners() -> None:
    assert of_pod({"name": "debug"}) == Owner("pod", "debug")
    assert of_pod({"generateName": "debug-"}) is None
    assert of_pod({"ownerReferences": "junk"}) is None
    assert of_workload("CronJob", {"name": "nightly"}) == Owner("cronjob", "nightly")


def test_label_values() -> None:
    assert valid_label_value("web-1.a_b")
    assert not valid_label_value("a" * 64)
    assert not valid_label_value("-web")
