"""The shop's tests through the mesh: what plain tests of web and store cannot see, because it
lives in the mesh's configuration (policy/): retries, timeouts, who may call whom."""

from __future__ import annotations

from meshlet.cli.mesh.engine import Mesh


def test_placing_an_order_reserves_stock_once(mesh: Mesh) -> None:
    """The ledger is busy the first time an order is confirmed (503): the order may fail, but
    the proxies must not place it again on their own, or the stock is reserved twice."""
    placed = mesh.get("web", "/orders/o-1", "-X", "POST")
    assert placed.status in (201, 503), placed
    assert mesh.get("web", "/stock").json()["reserved"] == 1


def test_the_report_has_time_for_the_stores_slow_path(mesh: Mesh) -> None:
    report = mesh.get("web", "/report")
    assert report.status == 200, report
    assert "reserved" in report.json()


def test_web_reaches_the_store_and_no_one_else_does(mesh: Mesh) -> None:
    stock = mesh.get("web", "/stock")
    assert stock.status == 200, stock
    assert mesh.get("store", "/shop.Store/Stock").status == 403  # the test's own client pod
    store = mesh.stat("deploy/store")
    assert "web.shop.serviceaccount.identity.meshlet.cluster.local" in store.peers
    assert store.denied == 1


def test_an_order_placed_again_is_confirmed(mesh: Mesh) -> None:
    assert mesh.get("web", "/orders/o-2", "-X", "POST").status == 503  # the busy ledger
    again = mesh.get("web", "/orders/o-2", "-X", "POST")
    assert again.status == 201, again
    assert mesh.get("web", "/stock").json() == {"reserved": 2, "confirmed": 1}
