"""`meshlet-cni`: meshlet-init's rules as a chained CNI plugin (the CNI spec, 1.1.0), so that a
pod needs no privileged init container: the container runtime runs the plugin on the node, after
the plugins that give the pod its network, and the plugin programs the pod's nat tables in the
pod's network namespace.

The runtime passes the command and the pod in `CNI_*` variables and the network configuration
(JSON) on standard input; a chained plugin gets the previous plugin's result there
(`prevResult`) and passes it on unchanged. Its own settings are in the configuration's
`meshlet` object, meshlet-init's flags by name (`incoming-proxy-port`, `proxy-uid`,
`inbound-ports-to-ignore`, `subnets-to-ignore`, `mode`, `ipv6`, …). ADD applies the plan in the
namespace (`nsenter --net=$CNI_NETNS meshlet-init`), DEL removes it (nothing to do when the
namespace is gone), CHECK exits with an error unless the tables hold it, STATUS says the plugin
can work, VERSION lists the spec versions it speaks. Every failure is a CNI error object on
standard output (`code`, `msg`, `details`) and exit 1, never a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NoReturn

CNI_VERSION: Final = "1.1.0"
SUPPORTED: Final = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
TIMEOUT: Final = 60.0  # seconds meshlet-init may take in the pod's namespace

# The CNI spec's well-known error codes.
INCOMPATIBLE_VERSION: Final = 1
INVALID_ENVIRONMENT: Final = 4
IO_FAILURE: Final = 5
DECODING_FAILURE: Final = 6
INVALID_CONFIG: Final = 7
NOT_AVAILABLE: Final = 50  # STATUS: the plugin cannot work now

# What the `meshlet` object of the configuration may hold: meshlet-init's flags with a value.
SETTINGS: Final = (
    "incoming-proxy-port", "outgoing-proxy-port", "proxy-uid", "proxy-gid",
    "inbound-ports-to-ignore", "outbound-ports-to-ignore", "subnets-to-ignore", "mode", "ipv6",
)  # fmt: skip


class CniError(Exception):
    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details


def init_argv(config: Mapping[str, Any], command: str) -> list[str]:
    """meshlet-init's command line for the configuration's `meshlet` settings."""
    settings = config.get("meshlet") or {}
    if not isinstance(settings, dict):
        raise CniError(INVALID_CONFIG, "the meshlet settings must be an object")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise CniError(INVALID_CONFIG, f"unknown meshlet settings: {', '.join(unknown)}",
                       f"known: {', '.join(SETTINGS)}")  # fmt: skip
    argv = [] if command == "apply" else [command]
    for name in SETTINGS:
        if name in settings:
            value = settings[name]
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise CniError(INVALID_CONFIG, f"meshlet setting {name} must be a string or a"
                               " number")  # fmt: skip
            argv.append(f"--{name}={value}")
    return argv


def _in_netns(netns: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
    init = [sys.executable, "-m", "meshlet.init.main", *argv]
    try:
        return subprocess.run([nsenter, f"--net={netns}", "--", *init], capture_output=True,
                              text=True, timeout=TIMEOUT, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CniError(IO_FAILURE, "meshlet-init could not run in the pod's namespace",
                       str(exc)) from None  # fmt: skip


def _init(netns: str, argv: list[str], what: str) -> None:
    done = _in_netns(netns, argv)
    sys.stderr.write(done.stdout)
    if done.returncode != 0:
        code = INVALID_CONFIG if done.returncode == 64 else IO_FAILURE
        raise CniError(code, f"meshlet-init {what} failed in {netns}", done.stderr.strip())


def handle(command: str, env: Mapping[str, str], stdin: str) -> dict[str, Any] | None:
    """What the plugin prints for `command` (None: nothing); CniError on failure."""
    if command == "VERSION":
        return {"cniVersion": CNI_VERSION, "supportedVersions": list(SUPPORTED)}
    try:
        config = json.loads(stdin) if stdin.strip() else {}
    except ValueError as exc:
        raise CniError(
            DECODING_FAILURE, "the network configuration is not JSON", str(exc)
        ) from None
    if not isinstance(config, dict):
        raise CniError(DECODING_FAILURE, "the network configuration is not a JSON object")
    version = str(config.get("cniVersion", ""))
    if version not in SUPPORTED:
        raise CniError(INCOMPATIBLE_VERSION, f"CNI version {version or 'none'} is not supported",
                       f"supported: {', '.join(SUPPORTED)}")  # fmt: skip
    if command == "STATUS":
        if shutil.which("nsenter") is None and not Path("/usr/bin/nsenter").exists():
            raise CniError(NOT_AVAILABLE, "nsenter (util-linux) is missing on the node")
        init_argv(config, "apply")  # a bad configuration is not ready either
        return None
    if command not in ("ADD", "DEL", "CHECK"):
        raise CniError(INVALID_ENVIRONMENT, f"CNI_COMMAND {command or 'unset'} is not one of"
                       " ADD, DEL, CHECK, STATUS, VERSION")  # fmt: skip
    netns = env.get("CNI_NETNS", "")
    if command == "DEL":
        if netns and Path(netns).exists():
            _init(netns, init_argv(config, "cleanup"), "cleanup")
        return None  # the namespace is gone, and with it the rules
    if not env.get("CNI_CONTAINERID"):
        raise CniError(INVALID_ENVIRONMENT, "CNI_CONTAINERID is not set")
    if not netns or not Path(netns).exists():
        raise CniError(INVALID_ENVIRONMENT, f"CNI_NETNS {netns or 'unset'} is not a network"
                       " namespace")  # fmt: skip
    previous = config.get("prevResult")
    if not isinstance(previous, dict):
        raise CniError(INVALID_CONFIG, "meshlet-cni is chained after the plugins that give the"
                       " pod its network: the configuration has no prevResult")  # fmt: skip
    if command == "CHECK":
        _init(netns, init_argv(config, "check"), "check")
        return None
    _init(netns, init_argv(config, "apply"), "apply")
    return {**previous, "cniVersion": version}


def main() -> NoReturn:
    command = os.environ.get("CNI_COMMAND", "")
    try:
        out = handle(command, os.environ, sys.stdin.read() if command != "VERSION" else "")
    except CniError as exc:
        error = {"cniVersion": CNI_VERSION, "code": exc.code, "msg": exc.msg}
        if exc.details:
            error["details"] = exc.details
        sys.stdout.write(json.dumps(error) + "\n")
        sys.exit(1)
    if out is not None:
        sys.stdout.write(json.dumps(out) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
