"""`meshlet upgrade` and `meshlet install` over an installed control plane, against the fake API
server holding what `meshlet install` rendered: the trust anchors, issuer and webhook and tap
certificates kept byte for byte, the values given before applied again, a second install
refused with the hint, no certificate or key in meshlet-config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshlet.cli.install import without_secrets
from meshlet_testing.fakeapi import FakeKubeAPI, StatusError

Run = Callable[..., Any]


def docs(text: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(text) if d}


def kept(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """What must not change across an upgrade."""
    webhook = objects[("MutatingWebhookConfiguration", "meshlet-proxy-injector-webhook-config")]
    return {
        "anchors": objects[("ConfigMap", "meshlet-identity-trust-roots")]["data"],
        "issuer": objects[("Secret", "meshlet-identity-issuer")]["data"],
        "injector": objects[("Secret", "meshlet-proxy-injector-k8s-tls")]["data"],
        "tap": objects[("Secret", "meshlet-tap-k8s-tls")]["data"],
        "ca_bundle": [w["clientConfig"]["caBundle"] for w in webhook["webhooks"]],
    }


def config(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    data = objects[("ConfigMap", "meshlet-config")]["data"]
    return {"values": yaml.safe_load(data["values"]),
            "install": yaml.safe_load(data.get("install-values", "{}"))}  # fmt: skip


@pytest.fixture
def kubeconfig(api: FakeKubeAPI, tmp_path: Path) -> str:
    return str(api.write_kubeconfig(tmp_path / "kubeconfig"))


def applied(api: FakeKubeAPI, text: str) -> dict[tuple[str, str], dict[str, Any]]:
    """`text`'s objects stored in the fake API server (the kinds it serves)."""
    objects = docs(text)
    for obj in objects.values():
        try:
            api.apply(obj)
        except (KeyError, ValueError, LookupError, StatusError):
            continue  # a kind the fake does not serve: nothing the upgrade reads
    return objects


def test_upgrade_keeps_the_identity_and_the_values_given_before(
    meshlet: Run, api: FakeKubeAPI, kubeconfig: str
) -> None:
    first = meshlet("install", "--kubeconfig", kubeconfig, "--set", "proxy.logLevel=debug")
    assert first.code == 0, first.err
    installed = applied(api, first.out)
    assert config(installed)["install"] == {"proxy": {"logLevel": "debug"}}

    run = meshlet("upgrade", "--kubeconfig", kubeconfig,
                  "--set", "proxy.defaultInboundPolicy=all-authenticated")  # fmt: skip
    assert run.code == 0, run.err
    assert "kept" in run.err and "Traceback" not in run.err
    upgraded = docs(run.out)
    assert kept(upgraded) == kept(installed)  # byte for byte
    now = config(upgraded)
    assert now["values"]["proxy"]["logLevel"] == "debug"  # given at install, applied again
    assert now["values"]["proxy"]["defaultInboundPolicy"] == "all-authenticated"
    assert now["install"] == {"proxy": {"logLevel": "debug",
                                        "defaultInboundPolicy": "all-authenticated"}}  # fmt: skip

    # and the next upgrade keeps what this one was given
    applied(api, run.out)
    again = meshlet("upgrade", "--kubeconfig", kubeconfig)
    assert again.code == 0, again.err
    assert config(docs(again.out))["values"]["proxy"]["defaultInboundPolicy"] == "all-authenticated"
    assert kept(docs(again.out)) == kept(installed)


def test_install_over_an_installed_control_plane_is_refused_with_the_hint(
    meshlet: Run, api: FakeKubeAPI, kubeconfig: str
) -> None:
    applied(api, meshlet("install", "--kubeconfig", kubeconfig).out)
    run = meshlet("install", "--kubeconfig", kubeconfig)
    assert run.code == 1 and run.out == ""
    assert "is installed in namespace meshlet already" in run.err
    assert "meshlet upgrade | kubectl apply -f -" in run.err and "--ignore-cluster" in run.err
    assert meshlet("install", "--kubeconfig", kubeconfig, "--ignore-cluster").code == 0
    # the CRDs are not the control plane: rendering them again is fine
    assert meshlet("install", "--crds", "--kubeconfig", kubeconfig).code == 0


def test_upgrade_without_meshlet_installed_says_how_to_install(
    meshlet: Run, kubeconfig: str
) -> None:
    run = meshlet("upgrade", "--kubeconfig", kubeconfig)
    assert run.code == 1 and run.out == ""
    assert "meshlet is not installed in namespace meshlet" in run.err
    assert "meshlet install | kubectl apply -f -" in run.err


def test_an_unreachable_cluster_is_named_with_the_way_around(
    meshlet: Run, unreachable_kubeconfig: Path
) -> None:
    run = meshlet("install", "--kubeconfig", str(unreachable_kubeconfig))
    assert run.code == 1 and run.out == ""
    assert "cannot reach the Kubernetes API" in run.err and "--ignore-cluster" in run.err
    assert "Traceback" not in run.err
    upgrade = meshlet("upgrade", "--kubeconfig", str(unreachable_kubeconfig))
    assert upgrade.code == 1 and "cannot reach the Kubernetes API" in upgrade.err


def test_no_certificate_or_key_is_kept_in_the_values() -> None:
    given = {
        "identityTrustAnchorsPEM": "anchors",
        "identity": {"issuer": {"tls": {"crtPEM": "c", "keyPEM": "k"}}},
        "proxyInjector": {"caBundle": "b", "crtPEM": "c", "keyPEM": "k", "replicas": 2},
        "tap": {"crtPEM": "c", "keyPEM": "k"},
        "proxy": {"logLevel": "debug"},
    }
    assert without_secrets(given) == {"proxyInjector": {"replicas": 2},
                                      "proxy": {"logLevel": "debug"}}  # fmt: skip
    assert given["tap"] == {"crtPEM": "c", "keyPEM": "k"}  # the caller's values untouched


def test_upgrade_ha_turns_high_availability_on_and_it_stays_on(
    meshlet: Run, api: FakeKubeAPI, kubeconfig: str
) -> None:
    installed = applied(api, meshlet("install", "--kubeconfig", kubeconfig).out)
    run = meshlet("upgrade", "--kubeconfig", kubeconfig, "--ha")
    assert run.code == 0, run.err
    upgraded = applied(api, run.out)
    assert kept(upgraded) == kept(installed)
    assert upgraded[("Deployment", "meshlet-destination")]["spec"]["replicas"] == 3
    assert ("PodDisruptionBudget", "meshlet-identity") in upgraded
    again = docs(meshlet("upgrade", "--kubeconfig", kubeconfig).out)  # no --ha this time
    hook = again[("MutatingWebhookConfiguration", "meshlet-proxy-injector-webhook-config")]
    assert hook["webhooks"][0]["failurePolicy"] == "Fail"
    assert again[("Deployment", "meshlet-policy")]["spec"]["replicas"] == 3
    assert ("PodDisruptionBudget", "meshlet-tap") in again


def test_an_external_issuer_is_neither_made_nor_kept_and_stays_external(
    meshlet: Run, api: FakeKubeAPI, kubeconfig: str, tmp_path: Path
) -> None:
    """`--identity-external-issuer` (cert-manager's issuer): install renders neither the issuer
    Secret nor tap's, needs the anchors the issuer chains to and refuses issuer files; the
    identity service reads the kubernetes.io/tls scheme; an upgrade keeps it so, with the
    anchors byte for byte, whatever cert-manager's Secret holds."""
    assert meshlet("identity", "ca", "create", "--out", str(tmp_path / "ca")).code == 0
    anchors = str(tmp_path / "ca" / "trust-anchors.pem")
    no_anchors = meshlet("install", "--kubeconfig", kubeconfig, "--identity-external-issuer")
    assert no_anchors.code == 64 and "give --identity-trust-anchors-file" in no_anchors.err
    with_files = meshlet("install", "--kubeconfig", kubeconfig, "--identity-external-issuer",
                         "--identity-trust-anchors-file", anchors,
                         "--identity-issuer-certificate-file", anchors,
                         "--identity-issuer-key-file", anchors)  # fmt: skip
    assert with_files.code == 64 and "give only --identity-trust-anchors-file" in with_files.err
    run = meshlet("install", "--kubeconfig", kubeconfig, "--identity-external-issuer",
                  "--identity-trust-anchors-file", anchors)  # fmt: skip
    assert run.code == 0, run.err
    assert "the issuer is cert-manager's" in run.err
    installed = applied(api, run.out)
    assert ("Secret", "meshlet-identity-issuer") not in installed
    assert ("Secret", "meshlet-tap-k8s-tls") not in installed
    args = installed[("Deployment", "meshlet-identity")]["spec"]["template"]["spec"]
    identity_args = next(c for c in args["containers"] if c["name"] == "identity")["args"]
    assert "--issuer-scheme=kubernetes.io/tls" in identity_args
    assert config(installed)["install"] == {"identity": {"issuer": {"scheme": "kubernetes.io/tls"}}}

    upgraded = docs(meshlet("upgrade", "--kubeconfig", kubeconfig).out)
    assert ("Secret", "meshlet-identity-issuer") not in upgraded
    assert (upgraded[("ConfigMap", "meshlet-identity-trust-roots")]["data"]
            == installed[("ConfigMap", "meshlet-identity-trust-roots")]["data"])  # fmt: skip


def test_prune_names_what_the_current_manifests_no_longer_have(
    meshlet: Run, api: FakeKubeAPI, kubeconfig: str
) -> None:
    """After an upgrade, objects of the control plane (by its labels) that the new manifests
    lack are listed for `kubectl delete -f -`; what the manifests still have, objects without
    the labels and another control plane's are not."""
    installed = applied(api, meshlet("install", "--kubeconfig", kubeconfig).out)
    labels = installed[("ConfigMap", "meshlet-config")]["metadata"]["labels"]
    left = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "meshlet-retired", "namespace": "meshlet", "labels": labels},
    }
    unlabelled = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "users-own", "namespace": "meshlet"},
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "meshlet-old-controller", "namespace": "meshlet",
                            "labels": labels}}  # fmt: skip
    for obj in (left, unlabelled, account):
        api.apply(obj)
    run = meshlet("prune", "--kubeconfig", kubeconfig)
    assert run.code == 0, run.err
    assert {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(run.out) if d} == {
        ("ConfigMap", "meshlet-retired"), ("ServiceAccount", "meshlet-old-controller"),
    }  # fmt: skip
    assert "2 object(s)" in run.err
    not_there = meshlet("prune", "--kubeconfig", kubeconfig, "-L", "elsewhere")
    assert not_there.code == 1 and "not installed in namespace elsewhere" in not_there.err


def test_after_the_issuer_is_rotated_the_tap_controller_gets_a_certificate_from_the_new_one(
    meshlet: Run, api: FakeKubeAPI, kubeconfig: str, tmp_path: Path
) -> None:
    """Step 2 of a trust-anchor rotation replaces the issuer Secret with one signed by the new
    anchor; the next `meshlet upgrade` re-issues the tap controller's certificate from it (the
    old one chains to the old anchor, which step 3 removes from every proxy's bundle). Without
    a rotation it is kept byte for byte (the test above)."""
    import base64

    from cryptography import x509

    for name in ("old", "new"):
        assert meshlet("identity", "ca", "create", "--out", str(tmp_path / name)).code == 0
    old, new = tmp_path / "old", tmp_path / "new"
    run = meshlet("install", "--kubeconfig", kubeconfig,
                  "--identity-trust-anchors-file", str(old / "trust-anchors.pem"),
                  "--identity-issuer-certificate-file", str(old / "issuer" / "crt.pem"),
                  "--identity-issuer-key-file", str(old / "issuer" / "key.pem"))  # fmt: skip
    assert run.code == 0, run.err
    installed = applied(api, run.out)
    both = (old / "trust-anchors.pem").read_text() + (new / "trust-anchors.pem").read_text()
    roots = installed[("ConfigMap", "meshlet-identity-trust-roots")]
    api.apply({**roots, "data": {"ca-bundle.crt": both}})  # step 1
    issuer = installed[("Secret", "meshlet-identity-issuer")]
    encoded = {key: base64.b64encode((new / "issuer" / key).read_bytes()).decode()
               for key in ("crt.pem", "key.pem")}  # fmt: skip
    api.apply({**issuer, "data": encoded})  # step 2

    upgraded = meshlet("upgrade", "--kubeconfig", kubeconfig)
    assert upgraded.code == 0, upgraded.err
    assert "the tap controller's certificate was issued by an earlier issuer" in upgraded.err
    tap = docs(upgraded.out)[("Secret", "meshlet-tap-k8s-tls")]
    text = tap.get("stringData", {}).get("tls.crt") or base64.b64decode(tap["data"]["tls.crt"])
    leaf = x509.load_pem_x509_certificates(text.encode() if isinstance(text, str) else text)[0]
    new_issuer = x509.load_pem_x509_certificate((new / "issuer" / "crt.pem").read_bytes())
    leaf.verify_directly_issued_by(new_issuer)  # raises unless the new issuer signed it
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [
        "meshlet-tap.meshlet.serviceaccount.identity.meshlet.cluster.local"
    ]
