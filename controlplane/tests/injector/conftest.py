"""The injector configuration the injector tests share."""

from __future__ import annotations

import pytest

from meshlet.controlplane.injector.config import InjectConfig
from meshlet_testing import pki


@pytest.fixture
def config() -> InjectConfig:
    return InjectConfig(trust_anchors_pem=pki.anchors_pem())
