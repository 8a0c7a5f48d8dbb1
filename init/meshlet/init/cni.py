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

Only meshed pods are changed: the runtime passes the pod's annotations (the
`io.kubernetes.cri.pod-annotations` capability, which the configuration asks for), and a pod
without the injector's `meshlet.io/proxy-version` is passed through untouched, as is every pod
when the runtime passes no annotations (the pod's validator then says so). A meshed pod's
`config.meshlet.io/skip-inbound-ports` and `skip-outbound-ports` replace the configuration's
ports to ignore, as they replace the mesh's defaults in the init container.

On a node, the plugin runs through the launcher that the meshlet-cni DaemonSet writes
(`meshlet.init.cni_install`): it enters the pod's namespace and runs this module in a root of
its own with `--entered`, where the namespace's path is not visible and meshlet-init runs
directly.
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

from meshlet.api import wellknown

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
# The runtime's capability that hands a plugin the pod's annotations (containerd, CRI-O).
ANNOTATIONS_CAPABILITY: Final = "io.kubernetes.cri.pod-annotations"
# A pod's annotations that replace a setting of the configuration.
POD_SETTINGS: Final = {
    wellknown.SKIP_INBOUND_PORTS_ANNOTATION: "inbound-ports-to-ignore",
    wellknown.SKIP_OUTBOUND_PORTS_ANNOTATION: "outbound-ports-to-ignore",
}


class CniError(Exception):
    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details


def pod_annotations(config: Mapping[str, Any]) -> dict[str, str] | None:
    """The pod's annotations as the runtime passed them; None when it passed none."""
    runtime = config.get("runtimeConfig")
    found = runtime.get(ANNOTATIONS_CAPABILITY) if isinstance(runtime, dict) else None
    if not isinstance(found, dict):
        return None
    return {str(k): v for k, v in found.items() if isinstance(v, str)}


def meshed(config: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the pod is one the injector meshed, and why not."""
    annotations = pod_annotations(config)
    if annotations is None:
        return False, (f"the runtime passed no pod annotations ({ANNOTATIONS_CAPABILITY}):"
                       " no pod is changed")  # fmt: skip
    if wellknown.PROXY_VERSION_ANNOTATION not in annotations:
        return False, f"no {wellknown.PROXY_VERSION_ANNOTATION} annotation: not a meshed pod"
    return True, ""


def init_argv(config: Mapping[str, Any], command: str) -> list[str]:
    """meshlet-init's command line for the configuration's `meshlet` settings, with the pod's
    annotations that replace them."""
    settings = config.get("meshlet") or {}
    if not isinstance(settings, dict):
        raise CniError(INVALID_CONFIG, "the meshlet settings must be an object")
    annotations = pod_annotations(config) or {}
    settings = {**settings, **{name: annotations[key] for key, name in POD_SETTINGS.items()
                               if key in annotations}}  # fmt: skip
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
    """meshlet-init run in the pod's namespace; `netns` "" when this process is in it already
    (`--entered`)."""
    command = [sys.executable, "-m", "meshlet.init.main", *argv]
    if netns:
        nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
        command = [nsenter, f"--net={netns}", "--", *command]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT,
                              check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CniError(IO_FAILURE, "meshlet-init could not run in the pod's namespace",
                       str(exc)) from None  # fmt: skip


def _init(netns: str, argv: list[str], what: str) -> None:
    done = _in_netns(netns, argv)
    sys.stderr.write(done.stdout)
    if done.returncode != 0:
        code = INVALID_CONFIG if done.returncode == 64 else IO_FAILURE
        where = netns or "the pod's network namespace"
        raise CniError(code, f"meshlet-init {what} failed in {where}", done.stderr.strip())


def handle(
    command: str, env: Mapping[str, str], stdin: str, entered: bool = False
) -> dict[str, Any] | None:
    """What the plugin prints for `command` (None: nothing); CniError on failure. `entered`:
    this process runs in the pod's network namespace already (the node's launcher entered it)."""
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
    present = entered or bool(netns and Path(netns).exists())
    target = "" if entered else netns
    if command == "DEL":
        if present and meshed(config)[0]:
            _init(target, init_argv(config, "cleanup"), "cleanup")
        return None  # the namespace is gone, and with it the rules
    if not env.get("CNI_CONTAINERID"):
        raise CniError(INVALID_ENVIRONMENT, "CNI_CONTAINERID is not set")
    if not present:
        raise CniError(INVALID_ENVIRONMENT, f"CNI_NETNS {netns or 'unset'} is not a network"
                       " namespace")  # fmt: skip
    previous = config.get("prevResult")
    if not isinstance(previous, dict):
        raise CniError(INVALID_CONFIG, "meshlet-cni is chained after the plugins that give the"
                       " pod its network: the configuration has no prevResult")  # fmt: skip
    init_argv(config, "apply")  # a bad setting is an error for every pod, meshed or not
    chosen, why = meshed(config)
    what = "check" if command == "CHECK" else "apply"
    if chosen:
        _init(target, init_argv(config, what), what)
    elif command == "ADD":
        sys.stderr.write(f"meshlet-cni: pod passed through: {why}\n")
    return None if command == "CHECK" else {**previous, "cniVersion": version}


def main() -> NoReturn:
    command = os.environ.get("CNI_COMMAND", "")
    entered = sys.argv[1:] == ["--entered"]
    try:
        stdin = sys.stdin.read() if command != "VERSION" else ""
        out = handle(command, os.environ, stdin, entered)
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
