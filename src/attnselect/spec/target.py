"""`Target`: the machine and library versions a choice is made for."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import logging
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from attnselect.errors import InvalidInputError
from attnselect.memos import warn_once

log = logging.getLogger("attnselect")

#: Library versions assumed by every GPU preset unless overridden: the stack measured on
#: the H200 in docs/sources/h200-measurements.md (torch 2.11, cuDNN 9.19) with no
#: optional attention package installed.
DEFAULT_TORCH = "2.11.0"
DEFAULT_CUDNN = "9.19.0"


# A release number (at least major.minor) with an optional PEP 440 / local suffix: 9.19.0, 2.11.0+cu130, 4.0.0b36.
# Linear (no nested optional repetition, so no catastrophic backtracking); "unknown": installed, no metadata.
_VERSION = re.compile(r"\d+(?:\.\d+)+[0-9A-Za-z]*(?:[.+\-_][0-9A-Za-z]+)*|unknown")


@functools.lru_cache(maxsize=256)
def version_tuple(version: str | None) -> tuple[int, ...]:
    """'9.19.0' -> (9, 19, 0); '2.11.0+cu130' -> (2, 11, 0); None -> ()."""
    if not version:
        return ()
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


class Package(NamedTuple):
    """A pip distribution a backend needs (``Backend.package``), and the module whose presence shows it."""

    distribution: str  # e.g. "flash-attn-4"
    module: str  # e.g. "flash_attn.cute"
    shared_module: bool = False  # other distributions install the module too: only the metadata tells


# distribution -> Package: the packages the registered backends need (attnselect.backends.register adds them).
_PACKAGES: dict[str, Package] = {}


def register_package(package: Package) -> None:
    """Have :meth:`Target.current` read this package's installed version."""
    if _PACKAGES.get(package.distribution) != package:
        _PACKAGES[package.distribution] = package
        _forget_targets()


def unregister_package(distribution: str) -> None:
    if _PACKAGES.pop(distribution, None) is not None:
        _forget_targets()


def _forget_targets() -> None:
    """The live targets are read again: the packages they hold changed."""
    for cached in (target_for_device, _cpu_target, _cuda_target):
        cached.cache_clear()


# The package fields of Target before the packages mapping (results files of 2026-12-02 and earlier hold them).
LEGACY_PACKAGE_FIELDS = {
    "cudnn_frontend_version": "nvidia-cudnn-frontend",
    "flash_attn_version": "flash-attn",
    "flash_attn3_version": "flash-attn-3",
    "flash_attn4_version": "flash-attn-4",
}


@dataclass(frozen=True)
class Target:
    """What a choice is for: the device and the versions of the libraries that serve it.

    ``capability`` is the CUDA compute capability, e.g. (9, 0), or None for the CPU. Version fields are strings, or
    None when the library is absent. ``packages`` holds the installed versions of the packages backends need, as
    sorted (distribution, version) pairs (:meth:`version` reads one); a dict is taken too.
    """

    name: str
    device_type: str = "cuda"
    capability: tuple[int, int] | None = None
    torch_version: str = DEFAULT_TORCH
    cudnn_version: str | None = DEFAULT_CUDNN
    packages: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidInputError(f"name: got {self.name!r}, expected a non-empty string (the device's name)")
        packages = self.packages
        if isinstance(packages, dict):
            packages = tuple(sorted((k, v) for k, v in packages.items() if v is not None))
        if not (
            isinstance(packages, tuple)
            and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and p[0] for p in packages)
        ):
            raise InvalidInputError(
                f"packages: got {self.packages!r}, expected a dict of distribution name to version, e.g. "
                "{'flash-attn-4': '4.0.0b36'}"
            )
        object.__setattr__(self, "packages", tuple(sorted(packages)))
        versions = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name.endswith("_version")]
        for name, value in versions + [(f"packages[{d!r}]", v) for d, v in self.packages]:
            if value is not None and not (isinstance(value, str) and _VERSION.fullmatch(value)):
                raise InvalidInputError(
                    f"{name}: got {value!r}, expected None or a version string such as '9.19.0' or '2.11.0+cu130'"
                )
        if self.device_type not in ("cuda", "cpu"):
            raise InvalidInputError(f"device_type: got {self.device_type!r}, expected 'cuda' or 'cpu'")
        cc = self.capability
        if self.device_type == "cuda" and not (
            isinstance(cc, tuple)
            and len(cc) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in cc)
            and cc[0] >= 1
            and cc[1] >= 0
        ):
            raise InvalidInputError(f"capability: got {cc!r}, expected a (major, minor) pair for a cuda target")
        if self.device_type == "cpu" and cc is not None:
            raise InvalidInputError(f"capability: got {cc!r}, expected None for a cpu target")

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        """The hash of the fields (what dataclass would hash), worked out once: a packed loop's memo keys hold the
        target and are hashed on every new packing. A pickle leaves it out (:meth:`__getstate__`): str hashes differ
        between processes."""
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_hash", None)
        return state

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def arch(self) -> str:
        """'sm90' style label, or 'cpu'."""
        return f"sm{self.capability[0]}{self.capability[1]}" if self.is_cuda else "cpu"

    def version(self, distribution: str) -> str | None:
        """The installed version of a package (a pip distribution name), or None."""
        return next((v for d, v in self.packages if d == distribution), None)

    def at_least(self, name: str, version: str) -> bool:
        """Whether ``name`` (``torch_version``, ``cudnn_version`` or a package's distribution) is at ``version`` or
        later."""
        fields = [f.name for f in dataclasses.fields(self) if f.name.endswith("_version")]
        if not isinstance(name, str) or (name.endswith("_version") and name not in fields):
            raise InvalidInputError(f"name: got {name!r}, expected one of {fields} or a package's distribution name")
        if not (isinstance(version, str) and version_tuple(version)):
            raise InvalidInputError(f"version: got {version!r}, expected a version string such as '2.11' or '9.19.0'")
        have = getattr(self, name) if name.endswith("_version") else self.version(name)
        return have is not None and version_tuple(have) >= version_tuple(version)

    def with_versions(self, *, packages: dict | None = None, **versions: str | None) -> Target:
        """A copy with some library versions replaced, e.g. ``cudnn_version="9.10.0"`` or
        ``packages={"flash-attn-4": "4.0.0b36"}`` (None removes a package)."""
        unknown = set(versions) - {f.name for f in dataclasses.fields(self) if f.name.endswith("_version")}
        if unknown:
            raise InvalidInputError(
                f"versions: got unknown field(s) {sorted(unknown)}, expected torch_version, cudnn_version or "
                "packages={distribution: version}"
            )
        if packages is not None:
            if not isinstance(packages, dict):
                raise InvalidInputError(f"packages: got {packages!r}, expected a dict of distribution to version")
            unknown = sorted(d for d in packages if _PACKAGES and d not in _PACKAGES)  # a typo simulates its absence
            if unknown:
                raise InvalidInputError(
                    f"packages: got {unknown}, expected distributions the backends use: {sorted(_PACKAGES)}"
                )
            versions["packages"] = {**dict(self.packages), **packages}
        return dataclasses.replace(self, **versions)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["capability"] = list(self.capability) if self.capability else None
        d["packages"] = dict(self.packages)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Target:
        """A target from :meth:`to_dict`; also from the older form with one field per package
        (:data:`LEGACY_PACKAGE_FIELDS`), as results files of 2026-12-02 and earlier hold it."""
        if not isinstance(d, dict):
            raise InvalidInputError(f"target: got {type(d).__name__}, expected a dict (Target.to_dict())")
        known = {f.name for f in dataclasses.fields(cls)} | set(LEGACY_PACKAGE_FIELDS)
        unknown = sorted(map(str, set(d) - known))
        if unknown or "name" not in d:
            raise InvalidInputError(
                f"target: got fields {sorted(map(str, d))}, expected 'name' and any of {sorted(known - {'name'})}"
            )
        fields = dict(d)
        packages = fields.pop("packages", None) or {}
        if not isinstance(packages, dict):
            raise InvalidInputError(f"packages: got {packages!r}, expected a dict of distribution name to version")
        packages = dict(packages)
        for field, distribution in LEGACY_PACKAGE_FIELDS.items():
            if fields.get(field) is not None:
                packages[distribution] = fields[field]
            fields.pop(field, None)
        if isinstance(fields.get("capability"), list):  # JSON's form of the tuple; anything else the constructor names
            fields["capability"] = tuple(fields["capability"])
        return cls(**fields, packages=packages)

    def describe(self) -> str:
        libs = [f"torch {self.torch_version}"] + ([f"cuDNN {self.cudnn_version}"] if self.cudnn_version else [])
        libs += [f"{distribution} {version}" for distribution, version in self.packages]
        return f"{self.name} ({self.arch}), " + ", ".join(libs)

    # -- constructors --------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, *, packages: dict | None = None, **versions: str | None) -> Target:
        """A simulated target: one of :data:`PRESETS`, with library versions and packages overridable."""
        if not isinstance(name, str) or name not in PRESETS:
            raise InvalidInputError(f"target: got {name!r}, expected one of {sorted(PRESETS)} or 'current'")
        if packages is None and not versions:
            return PRESETS[name]
        return PRESETS[name].with_versions(packages=packages, **versions)

    @classmethod
    def of(cls, target: Target | str | None, argument: str = "target") -> Target:
        """``target`` as a Target: None is the live machine, a string a preset name or 'current'."""
        if target is None or target == "current":
            return cls.current()
        if isinstance(target, str):
            return cls.preset(target)
        if not isinstance(target, Target):
            raise InvalidInputError(
                f"{argument}: got {type(target).__name__} {target!r}, expected a Target, a preset "
                f"name ({', '.join(sorted(PRESETS))}), 'current' or None"
            )
        return target

    @classmethod
    def current(cls, device: torch.device | str | int | None = None) -> Target:
        """The live machine. Never raises: without a usable CUDA device it is the CPU target."""
        if device is None:
            return _cuda_target(_current_cuda_index()) if _cuda_usable() else _cpu_target()
        try:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidInputError(
                f"device: got {device!r}, expected a torch.device, 'cpu', 'cuda[:N]' or an index ({exc})"
            ) from None
        if dev.type == "meta":
            raise InvalidInputError(f"device: got {device!r}, expected a device with data (a meta tensor has none)")
        if dev.type == "cuda" and not _cuda_usable():
            warn_once(
                f"no cuda for {dev}", "attnselect: Target.current(%r): CUDA is not usable here; the cpu target", device
            )
        return target_for_device(dev)


@functools.cache
def target_for_device(device: torch.device) -> Target:
    """The target of the device tensors live on (memoized: cheap on the hot path). Meta tensors, which hold no data,
    have none: attention() on them is refused before any kernel runs (a kernel's failure there would be recorded
    as the CPU's); traced calls validate on meta tensors but decide for the traced device (attnselect.ops)."""
    if device.type == "meta":
        raise InvalidInputError("q.device: got meta, expected tensors with data (the CPU or a GPU) to run a kernel on")
    if device.type != "cuda" or not _cuda_usable():
        return _cpu_target()
    return _cuda_target(device.index if device.index is not None else _current_cuda_index())


def _cuda_usable() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception as exc:  # a broken driver must not break import or selection
        log.warning("attnselect: CUDA is present but unusable (%s); using the cpu target", exc)
        return False


def _current_cuda_index() -> int:
    try:
        return torch.cuda.current_device()
    except Exception:
        return 0


def _package_version(package: Package) -> str | None:
    """The installed version of the package's distribution if its module imports, else None.

    Without package metadata the version is "unknown", except for a module that several
    distributions install (``flash_attn`` comes with flash-attn and with flash-attn-4):
    there the metadata decides.
    """
    distribution, module, shared_module = package
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return None
        if "." in module and importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None if shared_module else "unknown"


def _installed_packages() -> dict:
    versions = {d: _package_version(package) for d, package in _PACKAGES.items()}
    return {"packages": {d: v for d, v in versions.items() if v is not None}}


def cudnn_version_string(number: int) -> str:
    """torch.backends.cudnn.version() to 'major.minor.patch': 91900 -> 9.19.0 (cuDNN 9+), 8902 -> 8.9.2."""
    if number >= 90000:
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


@functools.cache
def _cpu_target() -> Target:
    return Target(
        name="cpu",
        device_type="cpu",
        capability=None,
        torch_version=str(torch.__version__),  # a plain str: TorchVersion parses on every comparison (memo keys)
        cudnn_version=None,
        **_installed_packages(),
    )


@functools.cache
def _cuda_target(index: int) -> Target:
    try:
        capability = tuple(torch.cuda.get_device_capability(index))
        name = torch.cuda.get_device_name(index)
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception as exc:
        log.warning("attnselect: could not read CUDA device %d (%s); using the cpu target", index, exc)
        return _cpu_target()
    cudnn_version = cudnn_version_string(cudnn) if cudnn else None
    return Target(
        name=name,
        device_type="cuda",
        capability=capability,
        torch_version=str(torch.__version__),  # a plain str: TorchVersion parses on every comparison (memo keys)
        cudnn_version=cudnn_version,
        **_installed_packages(),
    )


#: Simulation presets. GPU presets assume DEFAULT_TORCH and DEFAULT_CUDNN and no optional
#: attention package; override with ``Target.preset("b200", cudnn_version="9.10.0")``.
PRESETS: dict[str, Target] = {
    "a100": Target(name="NVIDIA A100", capability=(8, 0)),
    "h100": Target(name="NVIDIA H100", capability=(9, 0)),
    "h200": Target(name="NVIDIA H200", capability=(9, 0)),
    "b200": Target(name="NVIDIA B200", capability=(10, 0)),
    "b300": Target(name="NVIDIA B300", capability=(10, 3)),
    "rtx-pro-6000": Target(name="NVIDIA RTX PRO 6000 Blackwell", capability=(12, 0)),
    "cpu": Target(name="cpu", device_type="cpu", capability=None, cudnn_version=None),
}
